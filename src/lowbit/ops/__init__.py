"""Fused elementwise ops of the transformer around the quantized GEMMs (kernel + autograd.Function + reference
side by side, one file per op): :func:`rope_qkv` (rotate-half RoPE applied to a packed QKV projection output)."""

from .rope import rope_qkv, rope_qkv_reference

__all__ = ["rope_qkv", "rope_qkv_reference"]
