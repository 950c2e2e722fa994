"""The residual add of a pre-norm transformer, ``out = x + y`` (x the FP32 residual stream, y a branch output in any
float dtype), fused: one kernel reads x and y once and writes out, and can also return the RMSNorm statistics of
``out`` that the next block's fused norm + quantizer (:mod:`lowbit.ops.norm_quant`) would otherwise read ``out``
again to compute.

Numerics: ``out = x + float(y)`` in FP32, one rounding: bit for bit torch's ``x + y`` with type promotion.
``rstd = 1 / sqrt(mean(out²) + eps)`` per row, FP32 accumulation in the kernel's order (as
:func:`lowbit.ops.norm_quant.rmsnorm_rstd_reference`, to FP32 rounding of a sum). Backward: ``dx = g``,
``dy = g`` rounded to y's dtype (torch's add backward); rstd carries no gradient (the norm's own backward
accounts for its dependence on x).

In torch the add of an FP32 and a BF16 tensor runs the non-vectorized mixed-dtype elementwise kernel (about
2.5 TB/s on an H200, 3.1 ms of a 1.3b GPT step).
"""

from __future__ import annotations

import os

import torch

from .norm_quant import row_reduce_configs

__all__ = ["residual_add", "residual_add_reference", "residual_add_supported"]

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def residual_add_reference(x: torch.Tensor, y: torch.Tensor, rms_eps: float | None = None):
    """The spec: ``x + y`` (FP32), and with ``rms_eps`` also rstd (M,) of the sum in FP64, rounded to FP32 (the
    kernel's to within FP32 rounding of its sum)."""
    out = x + y.float()
    if rms_eps is None:
        return out
    from .norm_quant import rmsnorm_rstd_reference

    return out, rmsnorm_rstd_reference(out, rms_eps)


def residual_add_supported(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether the kernel takes (x, y): the fusion on (``LOWBIT_FUSED_RESIDUAL``, default 1), Triton on CUDA (or its
    interpreter), x float32 and y float32 / bfloat16 / float16 of x's shape, both contiguous, non-empty, same device."""
    return (os.environ.get("LOWBIT_FUSED_RESIDUAL", "1") != "0" and triton is not None
            and isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == torch.float32
            and y.dtype in (torch.float32, torch.bfloat16, torch.float16) and x.shape == y.shape and x.dim() >= 1
            and x.numel() > 0 and x.is_contiguous() and y.is_contiguous() and x.device == y.device
            and (x.is_cuda or INTERPRET))


if triton is not None:
    from .norm_quant import rstd_of_sumsq

    @triton.jit
    def _residual_add_kernel(x_ptr, y_ptr, o_ptr, rstd_ptr, M, K, eps, STATS: tl.constexpr, ROWS: tl.constexpr,
                             BLOCK: tl.constexpr):
        """ROWS rows a program, BLOCK columns at a time: o = x + y (FP32); STATS: rstd of o's rows (elementwise
        partial sums of squares over the chunks, then norm_quant.rstd_of_sumsq, as the rstd kernel)."""
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        rmask = rows < M
        acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            m = rmask[:, None] & (cols < K)[None, :]
            off = rows[:, None] * K + cols[None, :]
            o = tl.load(x_ptr + off, mask=m, other=0.0) + tl.load(y_ptr + off, mask=m, other=0.0).to(tl.float32)
            tl.store(o_ptr + off, o, mask=m)
            if STATS:
                acc += o * o
        if STATS:
            tl.store(rstd_ptr + rows, rstd_of_sumsq(acc, K, eps), mask=rmask)


def _launch(x, y, out, rstd, eps, stats: bool):
    from ..quant.triton_backend import _bucket, tuned_launch

    K = x.shape[-1]
    M = x.numel() // K
    # (candidates: the rstd kernel's, the same row walk)
    tuned_launch("residual_add", (stats, y.dtype, _bucket(M), _bucket(K)), lambda: row_reduce_configs(K),
                 lambda c: _residual_add_kernel[(triton.cdiv(M, c["ROWS"]),)](x, y, out, rstd, M, K, float(eps), STATS=stats,
                                                                             **c))


class _ResidualAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, eps):
        out = torch.empty_like(x)
        stats = eps is not None
        rstd = torch.empty(x.numel() // x.shape[-1], dtype=torch.float32, device=x.device) if stats else out
        _launch(x, y, out, rstd, eps if stats else 1.0, stats)
        ctx.y_dtype = y.dtype
        if not stats:
            return out
        ctx.mark_non_differentiable(rstd)
        return out, rstd

    @staticmethod
    def backward(ctx, g, *_):
        return g, g.to(ctx.y_dtype), None


def residual_add(x: torch.Tensor, y: torch.Tensor, *, rms_eps: float | None = None):
    """``x + y`` for the residual stream (see the module docstring); differentiable.

    Args:
        x: (..., K) float32, the residual stream.
        y: x's shape, float32 / bfloat16 / float16: the branch output added to it.
        rms_eps: given (> 0), also return rstd (M,) float32 of the sum's rows, M = prod(x.shape[:-1]), for a
            following RMSNorm with this epsilon (``LayerNormLinear`` / ``LayerNormMLP``'s ``input_rstd``).

    Returns:
        ``out`` (x's shape, float32), or ``(out, rstd)`` with ``rms_eps``. One Triton kernel where
        :func:`residual_add_supported`; else torch's ``x + y`` and rstd None (a following fused norm then computes
        its statistics itself: nothing is gained by computing them here apart from the sum).
    """
    if rms_eps is not None and (not isinstance(rms_eps, (int, float)) or isinstance(rms_eps, bool) or not rms_eps > 0):
        raise ValueError(f"rms_eps: expected None or a float > 0, got {rms_eps!r}")
    if not residual_add_supported(x, y):
        return x + y if rms_eps is None else (x + y, None)
    return _ResidualAdd.apply(x, y, None if rms_eps is None else float(rms_eps))
