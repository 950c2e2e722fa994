"""``lowbit.nn.LayerNormMLP``: Norm -> fc1 -> GELU | SwiGLU -> fc2, both Linears quantized in autocast."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..ops.swiglu import swiglu
from . import state as _ac
from .base import LowbitModule
from .functional import (
    check_microbatch_arg,
    linear_traces,
    norm_fuses,
    quantized_linear,
    quantized_swiglu_mlp,
    swiglu_mlp_fusable,
)
from .layernorm_linear import (
    apply_norm,
    check_input_rstd,
    check_module_args,
    check_norm_args,
    check_norm_input,
    check_norm_link,
)

__all__ = ["LayerNormMLP", "quantized_swiglu_branch", "swiglu_act"]

_ACTS = ("gelu", "swiglu")


def _linear_init(w, b):
    """``torch.nn.Linear.reset_parameters`` for a (out, in) weight and (out,) bias."""
    torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))
    if b is not None:
        bound = 1 / math.sqrt(w.shape[1]) if w.shape[1] > 0 else 0
        torch.nn.init.uniform_(b, -bound, bound)


def swiglu_act(h: torch.Tensor, fused_swiglu: bool | None, fused_default: bool) -> torch.Tensor:
    """silu(a)·b of h = [a | b]: :func:`lowbit.ops.swiglu` or torch's ops, per ``fused_swiglu`` (None: the
    default)."""
    if fused_swiglu if fused_swiglu is not None else fused_default:
        return swiglu(h)
    a, b = h.chunk(2, dim=-1)
    return F.silu(a) * b


def quantized_swiglu_branch(ln: torch.Tensor, fc1_weight, fc1_bias, fc2_weight, fc2_bias, g1, g2, is_first_microbatch,
                            st, fused_swiglu: bool | None, **nkw) -> torch.Tensor:
    """``fc2(silu(a)·b)`` with ``[a | b] = fc1(ln)``, all GEMMs quantized under the autocast state ``st`` (``g1``,
    ``g2``: the GemmLayers; ``nkw``: the fused-norm arguments of fc1's input, if any). Under a 1x128 blockwise recipe
    with no fc1 bias (and ``fused_swiglu`` not False) the SwiGLU runs inside fc2's input quantizer (same bits)."""
    # (an empty input takes the unfused path, whose quantized_linear says what is wrong)
    # (inside torch.compile, where fc1 traces as torch operations, fc1, the SwiGLU and fc2 each stay in the graph:
    # the fused MLP is an operator whose Python runs every call)
    if (fused_swiglu is not False and ln.numel() > 0 and swiglu_mlp_fusable(ln, fc1_weight, fc1_bias, st.recipe)
            and not linear_traces(ln, fc1_weight, st.recipe, is_first_microbatch, g1)):
        return quantized_swiglu_mlp(ln, fc1_weight, fc2_weight, fc2_bias, g1, g2, is_first_microbatch, state=st, **nkw)
    h = quantized_linear(ln, fc1_weight, fc1_bias, g1, is_first_microbatch, state=st, **nkw)
    h = swiglu_act(h, fused_swiglu, fused_default=True)
    return quantized_linear(h, fc2_weight, fc2_bias, g2, is_first_microbatch, state=st)


class LayerNormMLP(LowbitModule, torch.nn.Module):
    """``y = fc2(act(fc1(Norm(x))))`` with fc1 and fc2's fprop/dgrad/wgrad quantized inside autocast.

    Args:
        hidden_size: input and output features.
        ffn_hidden_size: features between fc1 and fc2.
        bias: fc1 and fc2 biases.
        normalization: ``"LayerNorm"`` or ``"RMSNorm"``.
        activation: ``"gelu"`` (erf form, as ``torch.nn.GELU()``; fused into fc1's GEMM epilogue in
            autocast) or ``"swiglu"`` (fc1 outputs 2·ffn features [a, b]; act = silu(a) · b).
        eps: the norm's epsilon.
        fused_swiglu: SwiGLU as one fused kernel (:func:`lowbit.ops.swiglu`: FP32 math, one rounding) or as
            torch's ``F.silu(a) * b``. None (default): fused inside autocast, torch outside (so the module
            stays bit-identical to torch outside autocast); True / False: always / never fused (a model
            compared across recipes should use the same kernels in every mode, e.g. lowbit.models.GPT).
            Under a 1x128 blockwise recipe (``Float8BlockScaling``) with no fc1 bias, the fused SwiGLU also
            runs inside fc2's input quantizer (same bits; h is never written in 16 bits;
            ``LOWBIT_UNFUSE=swiglu_quant`` turns that off).
        device, dtype: parameter placement.

    Parameters: ``layer_norm_weight``, ``layer_norm_bias`` (LayerNorm only), ``fc1_weight``
    (ffn or 2·ffn, hidden), ``fc1_bias``, ``fc2_weight`` (hidden, ffn), ``fc2_bias``.

    Outside autocast (and with ``fused_swiglu`` not True) it equals Norm -> ``F.linear`` -> ``F.gelu``
    (or silu(a)·b) -> ``F.linear`` bit for bit. Input (..., hidden) -> output (..., hidden).
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, bias: bool = True, normalization: str = "LayerNorm",
                 activation: str = "gelu", eps: float = 1e-5, fused_swiglu: bool | None = None, device=None,
                 dtype=None):
        super().__init__()
        if fused_swiglu is not None and fused_swiglu.__class__ is not bool:  # (1 == True would pass an `in` test)
            raise TypeError(f"fused_swiglu: expected None, True or False, got {type(fused_swiglu).__name__} "
                            f"{fused_swiglu!r}")
        self.fused_swiglu = fused_swiglu
        if activation not in _ACTS:
            raise ValueError(f"activation: expected one of {_ACTS}, got {activation!r}")
        per_ffn = 2 if activation == "swiglu" else 1  # fc1's outputs per ffn feature
        check_module_args(dict(hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size),
                          lambda: (hidden_size + 1) * per_ffn * ffn_hidden_size + (ffn_hidden_size + 3) * hidden_size,
                          bias, device, dtype)
        check_norm_args(normalization, eps)
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.normalization, self.activation, self.eps = normalization, activation, float(eps)
        fk = dict(device=device, dtype=dtype)
        fc1_out = 2 * ffn_hidden_size if activation == "swiglu" else ffn_hidden_size
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(hidden_size, **fk))
        self.layer_norm_bias = torch.nn.Parameter(torch.zeros(hidden_size,
                                                              **fk)) if normalization == "LayerNorm" else None
        self.fc1_weight = torch.nn.Parameter(torch.empty(fc1_out, hidden_size, **fk))
        self.fc1_bias = torch.nn.Parameter(torch.empty(fc1_out, **fk)) if bias else None
        self.fc2_weight = torch.nn.Parameter(torch.empty(hidden_size, ffn_hidden_size, **fk))
        self.fc2_bias = torch.nn.Parameter(torch.empty(hidden_size, **fk)) if bias else None
        self.reset_parameters()
        self._init_gemms("fc1", "fc2")

    def reset_parameters(self) -> None:
        torch.nn.init.ones_(self.layer_norm_weight)
        if self.layer_norm_bias is not None:
            torch.nn.init.zeros_(self.layer_norm_bias)
        _linear_init(self.fc1_weight, self.fc1_bias)
        _linear_init(self.fc2_weight, self.fc2_bias)

    def fuses_norm(self, input: torch.Tensor, is_first_microbatch: bool | None = None) -> bool:
        """Whether a forward on ``input`` now would run the norm inside fc1's input quantizer (and so use an
        ``input_rstd``); not inside torch.compile where fc1 traces (as :meth:`LayerNormLinear.fuses_norm`)."""
        st = _ac.get_state()
        return (st.enabled and self.normalization == "RMSNorm" and norm_fuses(input, self.layer_norm_weight, st.recipe)
                and not (self.activation == "swiglu"
                         and linear_traces(input, self.fc1_weight, st.recipe, is_first_microbatch,
                                           self._gemms["fc1"])))

    def forward(self, input: torch.Tensor, is_first_microbatch: bool | None = None,
                input_rstd: torch.Tensor | None = None, input_norm_link=None) -> torch.Tensor:
        """``input`` (..., hidden_size); ``input_rstd``, ``input_norm_link``: as :meth:`LayerNormLinear.forward`."""
        check_microbatch_arg(is_first_microbatch)
        check_norm_input(input, self.hidden_size, "hidden_size")
        check_input_rstd(input_rstd, input)
        check_norm_link(input_norm_link, self.normalization, input, self.layer_norm_weight, self.eps)
        st = _ac.get_state()
        if not st.enabled:
            ln = apply_norm(input, self.normalization, (self.hidden_size,), self.layer_norm_weight,
                            self.layer_norm_bias, self.eps,
                            input_norm_link)
            h = F.linear(ln, self.fc1_weight, self.fc1_bias)
            h = F.gelu(h) if self.activation == "gelu" else self._swiglu(h, fused_default=False)
            return F.linear(h, self.fc2_weight, self.fc2_bias)
        g1, g2 = self._gemms["fc1"], self._gemms["fc2"]
        # the norm inside fc1's input quantizer where it can be (its output never written), else on its own
        if self.fuses_norm(input, is_first_microbatch):
            ln, nkw = input, dict(norm_weight=self.layer_norm_weight, norm_eps=self.eps, norm_rstd=input_rstd,
                                  norm_link=input_norm_link)
        else:
            ln = apply_norm(input, self.normalization, (self.hidden_size,), self.layer_norm_weight,
                            self.layer_norm_bias, self.eps,
                            input_norm_link)
            nkw = {}
        if self.activation == "gelu":
            h = quantized_linear(ln, self.fc1_weight, self.fc1_bias, g1, is_first_microbatch, gelu=True, state=st,
                                 **nkw)
        else:
            return quantized_swiglu_branch(ln, self.fc1_weight, self.fc1_bias, self.fc2_weight, self.fc2_bias, g1, g2,
                                           is_first_microbatch, st, self.fused_swiglu, **nkw)
        return quantized_linear(h, self.fc2_weight, self.fc2_bias, g2, is_first_microbatch, state=st)

    def _swiglu(self, h: torch.Tensor, fused_default: bool) -> torch.Tensor:
        return swiglu_act(h, self.fused_swiglu, fused_default)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"normalization={self.normalization}, "
                f"activation={self.activation}, eps={self.eps}")
