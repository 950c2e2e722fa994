"""FP8 quantization written as torch operations, for torch.compile to trace and fuse.

Inside a compiled graph, lowbit's quantized linear quantizes with these (:func:`lowbit.nn.quantized_linear`): Inductor
generates the kernels and fuses them with the elementwise work around them, and the graph launches them with no
lowbit Python in between. They are the reference's arithmetic (NUMERICS §2–§3) step for step, so each copy is
bit-identical to :func:`lowbit.quant.quantize_reference` and to the Triton kernels (tested): the amax is exact, the
scale is a correctly rounded ``fmax / amax`` (divided in float64 and rounded once), the power-of-two rounding clears
the scale's mantissa bits, and the saturating cast rounds to nearest even.

They cover what the compiled linear needs: :class:`Float8Tensorwise` (current scaling, or a given scale:
:func:`tensorwise_copies`, for delayed scaling), and :class:`Float8Blockwise` where the copy's dims are multiples of
the block (no ragged blocks); :func:`traceable_fits` says which.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .reference import FP32_MAX, amax_of, pow2_scale_floor
from .schemes import Float8Blockwise, Float8Tensorwise

__all__ = ["TracedCopies", "current_scale", "quantize_traceable", "tensorwise_copies", "traceable_fits"]

_EXPONENT_BITS = 0x7F800000  # an FP32's exponent field: masking the rest rounds a positive normal down to 2**e


class TracedCopies(NamedTuple):
    """The FP8 copies of one 2D tensor (rows, cols), with their scales in the logical (rows, blocks) layout of
    :meth:`lowbit.quant.QuantizedTensor.logical_scales` (tensorwise: (1, 1)).

    rowwise, row_scale_inv: the (rows, cols) copy and its dequantization scales (None where not asked for).
    columnwise, col_scale_inv: the (cols, rows) copy (scaled along the rows) and its scales (None where not asked).
    amax: float32 (1,) max |x| of the whole tensor (what the NaN sentry reads).
    """

    rowwise: Optional[torch.Tensor]
    row_scale_inv: Optional[torch.Tensor]
    columnwise: Optional[torch.Tensor]
    col_scale_inv: Optional[torch.Tensor]
    amax: torch.Tensor


def current_scale(amax: torch.Tensor, fmax: float, *, pow2: bool = False, eps: float = 0.0) -> torch.Tensor:
    """:func:`lowbit.quant.reference.compute_scale` in operations Inductor compiles (the power-of-two rounding by
    masking the exponent, not ``frexp``); the same bits for every amax, NaN and Inf included."""
    a = amax.to(torch.float32)
    if eps > 0:
        a = torch.clamp(a, min=eps)
    # float64 quotients rounded once to float32 are the correctly rounded float32 quotients (53 >= 2 * 24 + 2 bits),
    # which Triton's float32 division is not for every divisor
    s = (torch.full_like(a, fmax, dtype=torch.float64) / a.double()).float()
    s = torch.where(a == 0, torch.ones_like(s), s)
    s = torch.where(torch.isinf(s), torch.full_like(s, FP32_MAX), s)
    if pow2:
        p = (s.view(torch.int32) & _EXPONENT_BITS).view(torch.float32)
        p = torch.clamp(p, min=pow2_scale_floor(fmax))
        s = torch.where(torch.isfinite(s) & (s > 0), p, s)
    return s


def _cast(v: torch.Tensor, fmt) -> torch.Tensor:
    """Saturating round-to-nearest-even cast of float32 ``v`` to the FP8 format (NaN stays NaN)."""
    return torch.clamp(v, -fmt.max, fmt.max).to(fmt.torch_dtype)


def _reciprocal(s: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 ``1 / s`` (see :func:`current_scale`)."""
    return (1.0 / s.double()).float()


def tensorwise_copies(x2: torch.Tensor, sch: Float8Tensorwise, amax: torch.Tensor, scale: torch.Tensor,
                      scale_inv: torch.Tensor, *, rowwise: bool, columnwise: bool) -> TracedCopies:
    """The Float8Tensorwise copies of x2 cast with a given ``scale`` (current, or a delayed one), which dequantize by
    ``scale_inv``; ``amax`` is x2's (:func:`lowbit.quant.reference.amax_of`), carried along."""
    data = _cast(x2.float() * scale, sch.format).contiguous()
    si = scale_inv.reshape(1, 1)
    return TracedCopies(data if rowwise else None, si if rowwise else None,
                        data.t().contiguous() if columnwise else None, si if columnwise else None, amax)


def _tensorwise(x2: torch.Tensor, sch: Float8Tensorwise, rowwise: bool, columnwise: bool) -> TracedCopies:
    amax = amax_of(x2)
    s = current_scale(amax, sch.format.max)
    return tensorwise_copies(x2, sch, amax, s, _reciprocal(s), rowwise=rowwise, columnwise=columnwise)


def _segments(x2: torch.Tensor, sch: Float8Blockwise) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """1 x block segments along the rows of x2 (r, k): (data (r, k), scale_inv (r, k / block), block amaxes)."""
    fmt, bs = sch.format, sch.block_size
    r, k = x2.shape
    xb = x2.float().reshape(r, k // bs, bs)
    bamax = xb.abs().amax(dim=-1)
    s = current_scale(bamax, fmt.max, pow2=sch.pow2, eps=sch.eps)
    data = _cast(xb * s.unsqueeze(-1), fmt).reshape(r, k).contiguous()
    return data, _reciprocal(s), bamax


def _segments_down(x2: torch.Tensor, sch: Float8Blockwise) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """block x 1 segments down the columns of x2 (r, k), read row by row: the columnwise copy (k, r) and its
    scale_inv (k, r / block) (a transposed view of the (r / block, k) grid cuBLAS reads), and the block amaxes."""
    fmt, bs = sch.format, sch.block_size
    r, k = x2.shape
    xb = x2.float().reshape(r // bs, bs, k)
    bamax = xb.abs().amax(dim=1)
    s = current_scale(bamax, fmt.max, pow2=sch.pow2, eps=sch.eps)
    data = _cast(xb * s.unsqueeze(1), fmt).reshape(r, k).t().contiguous()
    return data, _reciprocal(s).t(), bamax


def _tiles(x2: torch.Tensor, sch: Float8Blockwise) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """block x block tiles of x2 (r, k): (data (r, k), scale_inv (r / block, k / block), tile amaxes)."""
    fmt, bs = sch.format, sch.block_size
    r, k = x2.shape
    xb = x2.float().reshape(r // bs, bs, k // bs, bs)
    bamax = xb.abs().amax(dim=(1, 3))
    s = current_scale(bamax, fmt.max, pow2=sch.pow2, eps=sch.eps)
    data = _cast(xb * s[:, None, :, None], fmt).reshape(r, k).contiguous()
    return data, _reciprocal(s), bamax


def _blockwise(x2: torch.Tensor, sch: Float8Blockwise, rowwise: bool, columnwise: bool) -> TracedCopies:
    # (the tensor's amax is the largest block amax: no second pass over x2)
    if sch.block_dim == 2:  # one tile grid: the columnwise copy is the transpose of the rowwise one
        data, si, bamax = _tiles(x2, sch)
        return TracedCopies(data if rowwise else None, si if rowwise else None,
                            data.t().contiguous() if columnwise else None, si.t() if columnwise else None,
                            _max_of(bamax))
    row = _segments(x2, sch) if rowwise else (None, None, None)
    col = _segments_down(x2, sch) if columnwise else (None, None, None)
    return TracedCopies(row[0], row[1], col[0], col[1], _max_of(row[2] if rowwise else col[2]))


def _max_of(bamax: torch.Tensor) -> torch.Tensor:
    return bamax.amax().reshape(1)


def traceable_fits(scheme, rows: int, cols: int) -> bool:
    """Whether :func:`quantize_traceable` covers ``scheme`` for a (rows, cols) tensor: Float8Tensorwise, or
    Float8Blockwise with both dims multiples of the block size."""
    if isinstance(scheme, Float8Tensorwise):
        return True
    if isinstance(scheme, Float8Blockwise):
        bs = scheme.block_size
        return rows % bs == 0 and cols % bs == 0
    return False


def quantize_traceable(x2: torch.Tensor, scheme, *, rowwise: bool = True, columnwise: bool = False) -> TracedCopies:
    """The current-scaling FP8 copies of the 2D tensor ``x2`` under ``scheme``, as torch operations.

    Raises:
        NotImplementedError: ``scheme`` and the shape are not covered (:func:`traceable_fits`).
        ValueError: ``x2`` is not 2D, or neither copy is asked for.
    """
    if x2.dim() != 2:
        raise ValueError(f"x2: expected a 2D tensor, got shape {tuple(x2.shape)}")
    if not (rowwise or columnwise):
        raise ValueError("rowwise, columnwise: ask for at least one copy")
    if not traceable_fits(scheme, *x2.shape):
        raise NotImplementedError(f"scheme: quantize_traceable covers Float8Tensorwise and Float8Blockwise with dims "
                                  f"that are multiples of the block, got {scheme!r} for shape {tuple(x2.shape)}")
    if isinstance(scheme, Float8Tensorwise):
        return _tensorwise(x2, scheme, rowwise, columnwise)
    return _blockwise(x2, scheme, rowwise, columnwise)
