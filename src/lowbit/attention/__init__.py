"""Attention: FP32 reference, INT8/FP8 quantization prepass, Triton forward and backward kernels (NUMERICS §3, §7).

Triton is imported lazily (only when a Triton backend runs), so the package works without it.
"""
from ..runtime.callable import make_callable as _make_callable
from . import backward  # callable: lowbit.attention.backward(do, q, k, v, o, lse, ...) (runtime/callable.py)
from .api import (
    attention,
    attention_qk_int8,
    backend_for,
    gluon_by_default,
    quantize_qk,
    quantize_v_fp8,
    quantize_v_fp16,
    select_backend,
)
from .config import AttentionConfig, CallStats
from .reference import (
    QKQuantized,
    attention_prequantized_reference,
    attention_quantized_reference,
    attention_reference,
    quantize_qk_reference,
    quantize_v_fp8_reference,
)
from .sdpa_override import SDPAOverride, sdpa_override

__all__ = [
    "attention",
    "backward",
    "attention_qk_int8",
    "quantize_qk",
    "quantize_v_fp8",
    "quantize_v_fp16",
    "select_backend",
    "backend_for",
    "gluon_by_default",
    "QKQuantized",
    "attention_reference",
    "attention_quantized_reference",
    "attention_prequantized_reference",
    "quantize_qk_reference",
    "quantize_v_fp8_reference",
    "AttentionConfig",
    "CallStats",
    "sdpa_override",
    "SDPAOverride",
]


def __getattr__(name):
    # forward_kernel: the Triton forward kernel, for tools (tools/kernel_spills.py). Loaded on first access, so
    # importing the package does not build the Triton kernels.
    if name == "forward_kernel":
        from ._triton import attn_fwd

        return attn_fwd
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# `lowbit.attention` is both this package and the function users call (`lowbit.attention(q, k, v)`).
_make_callable(__name__, "attention")
