"""``lowbit.nn.LayerNormLinear``: LayerNorm or RMSNorm followed by a quantized Linear."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..runtime.checks import check_bool, check_device, check_float_dtype, check_param_memory, check_positive_int
from . import state as _ac
from .base import LowbitModule
from .functional import check_microbatch_arg, linear_traces, norm_fuses, quantized_linear

__all__ = ["LayerNormLinear", "check_norm_args", "check_norm_input", "apply_norm", "check_input_rstd",
           "check_norm_link", "check_features", "check_module_args"]

_NORMS = ("LayerNorm", "RMSNorm")


def check_norm_args(normalization, eps) -> None:
    if normalization not in _NORMS:
        raise ValueError(f"normalization: expected one of {_NORMS}, got {normalization!r}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not (eps > 0) or not math.isfinite(eps):
        raise ValueError(f"eps: expected a finite float > 0, got {eps!r}")


def apply_norm(x, normalization, shape, weight, bias, eps, link=None):
    """Exactly ``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm``'s forward (high precision, autograd); with ``link`` (a
    :class:`lowbit.ops.residual.NormGradLink`, RMSNorm) the backward runs in the residual add that made x."""
    if normalization == "LayerNorm":
        return F.layer_norm(x, shape, weight, bias, eps)
    if link is not None:
        from ..ops.residual import rms_norm_linked

        return rms_norm_linked(x, weight, eps, link)
    return F.rms_norm(x, shape, weight, eps)


def check_norm_link(link, normalization: str, input: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """``input_norm_link``: None, or the :class:`lowbit.ops.residual.NormGradLink` that
    ``residual_add(..., norm_weight=weight, rms_eps=eps)`` returned with ``input`` (RMSNorm only)."""
    if link is None:
        return
    from ..ops.residual import NormGradLink

    if not isinstance(link, NormGradLink):
        raise TypeError("input_norm_link: expected None or a lowbit.ops.residual.NormGradLink, got "
                        f"{type(link).__name__}")
    if normalization != "RMSNorm":
        raise ValueError("input_norm_link: links an RMSNorm's backward; this module's normalization is "
                         f"{normalization!r}")
    link.check(input, weight, eps)


def check_input_rstd(input_rstd, input: torch.Tensor) -> None:
    """``input_rstd`` (a module's precomputed RMSNorm statistics of its input): None, or float32 (M,) on the input's
    device with M = the input's rows."""
    if input_rstd is None:
        return
    M = input.numel() // input.shape[-1] if input.dim() else 1
    if not (isinstance(input_rstd, torch.Tensor) and input_rstd.dtype == torch.float32
            and tuple(input_rstd.shape) == (M,)
            and input_rstd.device == input.device):
        raise ValueError(f"input_rstd: expected None or a float32 tensor of shape ({M},) on {input.device} "
                         "(one per input "
                         f"row), got {getattr(input_rstd, 'dtype', type(input_rstd).__name__)} "
                         f"{tuple(getattr(input_rstd, 'shape', ()))} on {getattr(input_rstd, 'device', None)}")


def check_norm_input(input, size: int, name: str) -> None:
    """The norm's input must end in ``size`` features. Checked here (shapes only, no device sync) so the error
    names the module's argument instead of F.layer_norm's "normalized_shape" RuntimeError."""
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"input: expected a torch.Tensor, got {type(input).__name__}")
    if input.dim() < 1 or input.shape[-1] != size:
        got = input.shape[-1] if input.dim() else "a 0-dim tensor"
        raise ValueError(f"input: last dim must be {name} = {size}, got {got} (input shape {tuple(input.shape)})")


def check_features(**kw):
    """Each ``name=value`` must be a positive int (TypeError for another type, ValueError for an int < 1)."""
    for n, v in kw.items():
        check_positive_int(n, v)


def check_module_args(features: dict, numel, bias, device, dtype) -> None:
    """The constructor arguments lowbit's Linear-like modules share, checked before any parameter is allocated:
    ``features`` (``{name: value}``) positive ints, ``bias`` a bool, ``device`` one this process can allocate on,
    ``dtype`` None or a float dtype of :data:`~lowbit.runtime.checks.PARAM_DTYPES`, and the ``numel()`` parameter
    elements (called once the features passed) within the device's memory."""
    check_features(**features)
    check_bool("bias", bias)
    device = check_device("device", device)
    check_float_dtype("dtype", dtype)
    check_param_memory(features, numel(), device, dtype)


class LayerNormLinear(LowbitModule, torch.nn.Module):
    """``y = Linear(Norm(x))``: the norm in high precision, the Linear's three GEMMs quantized in autocast.

    Under a 1x128 blockwise recipe with RMSNorm on an FP32 input (CUDA), the norm runs inside the input quantizer
    (:mod:`lowbit.ops.norm_quant`) and its FP32 output is never written; ``LOWBIT_UNFUSE=norm_quant`` turns that off.

    Args:
        in_features, out_features, bias: as ``torch.nn.Linear``.
        normalization: ``"LayerNorm"`` (weight and bias) or ``"RMSNorm"`` (weight only).
        eps: the norm's epsilon.
        return_layernorm_output: also return the normalized input (for residual branches).
        device, dtype: parameter placement.

    Parameters: ``layer_norm_weight`` (in,) [ones], ``layer_norm_bias`` (in,) [zeros, LayerNorm only],
    ``weight`` (out, in) and ``bias`` (out,) initialised as ``torch.nn.Linear``.

    Outside autocast it equals ``nn.Sequential(nn.LayerNorm(in) | nn.RMSNorm(in), nn.Linear(in, out))``
    bit for bit. Input (..., in) -> output (..., out) [and the norm output (..., in)].
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, normalization: str = "LayerNorm",
                 eps: float = 1e-5, return_layernorm_output: bool = False, device=None, dtype=None):
        super().__init__()
        check_module_args(dict(in_features=in_features, out_features=out_features),
                          lambda: in_features * out_features + out_features + 2 * in_features, bias, device, dtype)
        check_norm_args(normalization, eps)
        if not isinstance(return_layernorm_output, bool):  # bool("no") would silently be True
            raise TypeError(f"return_layernorm_output: expected a bool, got {return_layernorm_output!r}")
        self.in_features, self.out_features = in_features, out_features
        self.normalization, self.eps = normalization, float(eps)
        self.return_layernorm_output = return_layernorm_output
        fk = dict(device=device, dtype=dtype)
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(in_features, **fk))
        self.layer_norm_bias = torch.nn.Parameter(torch.zeros(in_features,
                                                              **fk)) if normalization == "LayerNorm" else None
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, **fk))
        self.bias = torch.nn.Parameter(torch.empty(out_features, **fk)) if bias else None
        self.reset_parameters()
        self._init_gemms("")

    def reset_parameters(self) -> None:
        """Norm: weight 1, bias 0; Linear: as ``torch.nn.Linear.reset_parameters``."""
        torch.nn.init.ones_(self.layer_norm_weight)
        if self.layer_norm_bias is not None:
            torch.nn.init.zeros_(self.layer_norm_bias)
        torch.nn.Linear.reset_parameters(self)  # uses self.weight / self.bias only

    def fuses_norm(self, input: torch.Tensor, is_first_microbatch: bool | None = None) -> bool:
        """Whether a forward on ``input`` now would run the norm inside the input quantizer (and so use an
        ``input_rstd``): the active recipe, the norm and the input's dtype / device decide. Not inside torch.compile
        where the plain linear traces (:func:`lowbit.nn.functional.linear_traces`): there the norm is torch's, which
        Inductor compiles, and the linear is torch operations (the fused form is an operator whose Python runs every
        call)."""
        st = _ac.get_state()
        return (not self.return_layernorm_output and st.enabled and self.normalization == "RMSNorm"
                and norm_fuses(input, self.layer_norm_weight, st.recipe)
                and not linear_traces(input, self.weight, st.recipe, is_first_microbatch, self._gemms[""]))

    def forward(self, input: torch.Tensor, is_first_microbatch: bool | None = None,
                input_rstd: torch.Tensor | None = None,
                input_norm_link=None):
        """``input`` (..., in_features); ``input_rstd``: optional (M,) float32 RMSNorm statistics of the input rows
        computed already (:func:`lowbit.ops.residual.residual_add` with ``rms_eps=self.eps``), used only where the norm
        runs inside the input quantizer (:meth:`fuses_norm`); ``input_norm_link``: optional
        :class:`lowbit.ops.residual.NormGradLink` from ``residual_add(..., rms_eps=self.eps,
        norm_weight=self.layer_norm_weight)`` that made ``input``: the norm's backward then runs fused into the add's
        (the same gradients to FP32 rounding of the reductions; the forward is unchanged)."""
        check_microbatch_arg(is_first_microbatch)
        check_norm_input(input, self.in_features, "in_features")
        check_input_rstd(input_rstd, input)
        check_norm_link(input_norm_link, self.normalization, input, self.layer_norm_weight, self.eps)
        st = _ac.get_state()
        if self.fuses_norm(input, is_first_microbatch):  # the norm inside the input quantizer: never written
            return quantized_linear(input, self.weight, self.bias, self._gemms[""], is_first_microbatch, state=st,
                                    norm_weight=self.layer_norm_weight, norm_eps=self.eps, norm_rstd=input_rstd,
                                    norm_link=input_norm_link)
        ln = apply_norm(input, self.normalization, (self.in_features,), self.layer_norm_weight, self.layer_norm_bias,
                        self.eps,
                        input_norm_link)
        if not st.enabled:
            y = F.linear(ln, self.weight, self.bias)
        else:
            y = quantized_linear(ln, self.weight, self.bias, self._gemms[""], is_first_microbatch, state=st)
        return (y, ln) if self.return_layernorm_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"normalization={self.normalization}, eps={self.eps}")
