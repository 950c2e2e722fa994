"""``lowbit.nn.Linear``: a drop-in ``torch.nn.Linear`` whose three GEMMs are quantized inside autocast."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import state as _ac
from .base import LowbitModule
from .functional import check_microbatch_arg, quantized_linear
from .layernorm_linear import check_module_args

__all__ = ["Linear"]


class Linear(LowbitModule, torch.nn.Linear):
    """``y = x · Wᵀ + b`` — ``torch.nn.Linear`` (same constructor, parameters, init, state_dict keys)
    whose fprop, dgrad and wgrad run as quantized GEMMs inside :func:`lowbit.autocast`.

    Args:
        in_features, out_features, bias, device, dtype: as ``torch.nn.Linear``. ``weight`` (out, in) and
            ``bias`` (out,) are the high-precision master parameters the optimizer sees. Checked first: the
            features positive ints whose weight fits the device's memory, ``bias`` a bool, ``device`` one this
            process can allocate on, ``dtype`` None or float32 / bfloat16 / float16 / float64 (a TypeError or
            ValueError naming the argument).

    Shapes: input (..., in_features) float32/bfloat16/float16 -> output (..., out_features), same dtype.

    Outside autocast (or with ``enabled=False``) ``forward`` is ``F.linear`` — bit-identical to
    ``torch.nn.Linear``. Inside, x, W and dy are quantized per the recipe's input / weight /
    grad_output roles; only quantized copies are saved for the backward.

    ``state_dict()`` has ``weight`` and ``bias`` as ``torch.nn.Linear`` plus one more key,
    ``_extra_state``: the scaling state (delayed-scaling amax histories, scales, pending amaxes) as a
    dict of plain tensors, empty until a ``DelayedScaling`` step ran. A ``torch.nn.Linear`` state_dict
    loads into this module as is (the missing key is fine); to load this module's state_dict into a
    plain ``torch.nn.Linear``, pass ``strict=False`` or drop the key first:
    ``{k: v for k, v in sd.items() if not k.endswith("_extra_state")}``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        # (torch.nn.Linear checks none of these: bias=0 or "no", a device it cannot use, an int dtype or a weight
        # larger than the machine would fail inside the allocation or the init, or pass silently)
        check_module_args(dict(in_features=in_features, out_features=out_features),
                          lambda: (in_features + 1) * out_features, bias, device, dtype)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_gemms("")

    @classmethod
    def from_linear(cls, lin: torch.nn.Linear) -> "Linear":
        """A lowbit Linear sharing ``lin``'s parameter objects (no copy, no re-init, RNG untouched)."""
        if not isinstance(lin, torch.nn.Linear):
            raise TypeError(f"lin: expected a torch.nn.Linear, got {type(lin).__name__}")
        m = cls.__new__(cls)
        torch.nn.Module.__init__(m)
        m.in_features, m.out_features = lin.in_features, lin.out_features
        m.weight = lin.weight
        m.bias = lin.bias  # a Parameter or None (registered as such)
        m.train(lin.training)
        m._init_gemms("")
        return m

    def forward(self, input: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        """``is_first_microbatch``: None (default) quantize the weight every call; True: quantize and cache it
        (first microbatch of a step); False: reuse the cached copies (later microbatches, weights unchanged). False
        raises if the weight changed through torch since (its version or storage); an in-place edit through ``.data``
        (its own version counter) is not seen: pass True after one."""
        check_microbatch_arg(is_first_microbatch)
        st = _ac.get_state()
        if not st.enabled:
            return F.linear(input, self.weight, self.bias)
        return quantized_linear(input, self.weight, self.bias, self._gemms[""], is_first_microbatch, state=st)
