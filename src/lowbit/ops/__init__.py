"""Fused elementwise ops of the transformer around the quantized GEMMs (kernel + autograd.Function + reference
side by side, one file per op): :func:`rope_qkv` (rotate-half RoPE applied to a packed QKV projection output),
:func:`swiglu` (silu(a)·b on a packed fc1 output)."""

from .rope import rope_qkv, rope_qkv_reference
from .swiglu import swiglu, swiglu_reference

__all__ = ["rope_qkv", "rope_qkv_reference", "swiglu", "swiglu_reference"]
