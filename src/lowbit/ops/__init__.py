"""Fused ops of the transformer around the quantized GEMMs (kernel + autograd.Function + reference side by side, one
file per op, with the ``torch.library`` operator that torch.compile traces in the Function's place):
:func:`rope_qkv` (rotate-half RoPE applied to a packed QKV projection output), :func:`swiglu` (silu(a)·b on a
packed fc1 output), :func:`residual_add` (the residual stream's add, optionally with the next
RMSNorm's statistics); :mod:`lowbit.ops.norm_quant` (RMSNorm inside the 1x128 input quantizer)."""

from .residual import residual_add, residual_add_reference
from .rope import rope_qkv, rope_qkv_reference
from .swiglu import swiglu, swiglu_reference

__all__ = ["rope_qkv", "rope_qkv_reference", "swiglu", "swiglu_reference", "residual_add", "residual_add_reference"]
