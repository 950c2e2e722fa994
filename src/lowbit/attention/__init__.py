"""Attention: FP32 reference, INT8/FP8 quantization prepass, Triton forward and backward kernels (DESIGN §3, §7).

Triton is imported lazily (only when a Triton backend runs), so the package works without it.
"""
from .api import attention, attention_qk_int8, backend_for, quantize_qk, quantize_v_fp8, quantize_v_fp16, select_backend
from . import backward  # callable: lowbit.attention.backward(do, q, k, v, o, lse, ...) (see backward._CallableModule)
from .reference import (
    QKQuantized,
    attention_prequantized_reference,
    attention_quantized_reference,
    attention_reference,
    quantize_qk_reference,
    quantize_v_fp8_reference,
)

__all__ = [
    "attention",
    "backward",
    "attention_qk_int8",
    "quantize_qk",
    "quantize_v_fp8",
    "quantize_v_fp16",
    "select_backend",
    "backend_for",
    "QKQuantized",
    "attention_reference",
    "attention_quantized_reference",
    "attention_prequantized_reference",
    "quantize_qk_reference",
    "quantize_v_fp8_reference",
]


# `lowbit.attention` is both this package and the function users call (`lowbit.attention(q, k, v)`).
# Importing any submodule binds the package to the parent's attribute, so make the package itself
# callable: calling it calls :func:`attention`.
import sys as _sys
import types as _types


class _CallablePackage(_types.ModuleType):
    def __call__(self, *args, **kwargs):
        return attention(*args, **kwargs)


_sys.modules[__name__].__class__ = _CallablePackage
