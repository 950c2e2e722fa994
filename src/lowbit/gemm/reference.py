"""Reference scaled GEMM: exact math in float64, the spec every fast backend is tested against (NUMERICS §5).

``y = A · Bᵀ`` where A (M, K) and B (N, K) are copies of two QuantizedTensors, both contiguous along
K. Each operand is dequantized *exactly* in float64 (an FP8/E2M1 element times its scale, with the
NVFP4 scale d / S formed in float64), the product is taken in float64, and only the final result
is rounded to ``out_dtype``. A fast FP32-accumulating backend differs from this by the rounding of
its accumulation order alone.
"""

from __future__ import annotations

import torch

from ..quant.schemes import NVFP4
from ..quant.tensor import QuantizedTensor

__all__ = ["dequantize_exact", "scaled_mm_reference", "apply_epilogue"]


def dequantize_exact(t: QuantizedTensor, which: str) -> torch.Tensor:
    """float64 (rows, cols) exact values of one copy (no rounding: every product fits in float64)."""
    q = t.elements(which).to(torch.float64) * t.expanded_block_scales(which, torch.float64)
    if isinstance(t.scheme, NVFP4):
        return q / getattr(t, which).global_scale.to(torch.float64)
    return q


def apply_epilogue(acc: torch.Tensor, *, out_dtype, bias=None, gelu=False, accumulate=False, out=None):
    """Epilogue shared by all backends' references: (+bias) -> pre; GELU (erf form) -> y; out += y if accumulate.

    Returns ``(y, pre)``; ``pre`` is the pre-GELU value in ``out_dtype`` (None without GELU).
    """
    y = acc
    if bias is not None:
        y = y + bias.to(acc.dtype)
    pre = None
    if gelu:
        pre = y.to(out_dtype)
        y = torch.nn.functional.gelu(y)
    if accumulate:
        out.add_(y.to(out.dtype))
        return out, pre
    if y.dtype != out_dtype:  # (no no-op .to: torch 2.11's Dynamo zeroes the gradient of a Function returning one)
        y = y.to(out_dtype)
    if out is not None:
        out.copy_(y)
        return out, pre
    return y, pre


def scaled_mm_reference(a: QuantizedTensor, b: QuantizedTensor, *, a_copy="rowwise", b_copy="rowwise",
                        out_dtype=torch.float32,
                        bias=None, gelu=False, accumulate=False, out=None):
    """float64-exact ``A · Bᵀ`` with the epilogue; see :func:`lowbit.gemm.scaled_mm`. Returns ``(y, pre_gelu)``."""
    A = dequantize_exact(a, a_copy)
    B = dequantize_exact(b, b_copy)
    acc = A @ B.t()
    return apply_epilogue(acc, out_dtype=out_dtype, bias=bias, gelu=gelu, accumulate=accumulate, out=out)
