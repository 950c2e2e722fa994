"""FP8 quantization as one registered operator, for torch.compile to hold in a graph.

Inside a compiled graph, lowbit's quantized linear quantizes with :func:`quantize_traceable`: the operator
``lowbit::quantize_fp8`` runs lowbit's Triton kernels on CUDA (both copies of a tensor from one read; the reference
elsewhere) and hands the copies, their scales and the amax back as plain tensors, with a fake implementation for
tracing. Inductor's own kernels for the same arithmetic were measured 1.1-7x slower at the Llama client's shapes
(``lowbit bench quant``), so the graph calls the kernels instead of fusing the quantizers with their neighbours.
The bits are :func:`lowbit.quant.quantize`'s (tested).

They cover what the compiled linear needs: :class:`Float8Tensorwise` (current scaling, or a given scale, for
delayed scaling), and :class:`Float8Blockwise` where the copy's dims are multiples of the block (no ragged
blocks); :func:`traceable_fits` says which.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import torch

from .schemes import Float8Blockwise, Float8Tensorwise
from .tensor import scale_logical, scale_storage_shape

__all__ = ["TracedCopies", "quantize_fp8_op", "quantize_traceable", "traceable_fits"]


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


@functools.lru_cache(maxsize=64)
def _scheme(fmt: str, block_dim: int, block_size: int, pow2: bool, eps: float):
    return Float8Tensorwise(fmt) if block_dim == 0 else Float8Blockwise(fmt, block_dim, block_size, pow2, eps)


def _buffer_size(sch, rows: int, cols: int, rowwise: bool, columnwise: bool) -> int:
    """Elements of the operator's float32 buffer (see :func:`lowbit.quant.triton_backend.quantize_fp8_flat`)."""
    if isinstance(sch, Float8Tensorwise):
        return 8
    return ((math.prod(scale_storage_shape(sch, rows, cols)) if rowwise else 0)
            + (math.prod(scale_storage_shape(sch, cols, rows)) if columnwise else 0) + 1)


@torch.library.custom_op("lowbit::quantize_fp8", mutates_args=())
def quantize_fp8_op(x2: torch.Tensor, fmt: str, block_dim: int, block_size: int, pow2: bool, eps: float,
                    rowwise: bool, columnwise: bool,
                    scale: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The FP8 copies of the 2D tensor ``x2`` under Float8Tensorwise (``block_dim`` 0; ``scale``: a given one) or
    Float8Blockwise(fmt, block_dim, block_size, pow2, eps): (rowwise data, columnwise data, float32 buffer) as
    :func:`lowbit.quant.triton_backend.quantize_fp8_flat` lays them out (an empty tensor for a copy not asked
    for). Lowbit's Triton kernels where they run, the reference elsewhere: the same bits."""
    from . import backend_for
    from .reference import quantize_reference

    sch = _scheme(fmt, block_dim, block_size, pow2, eps)
    if x2.is_cuda:  # (a gradient may come strided: the kernels read contiguous rows, as lowbit.quantize gives them)
        x2 = x2.contiguous()
    if backend_for(x2, sch, rowwise, columnwise) == "triton":
        from .triton_backend import quantize_fp8_flat

        return quantize_fp8_flat(x2, sch, rowwise, columnwise, scale)
    q = quantize_reference(x2, sch, rowwise=rowwise, columnwise=columnwise, scale=scale)
    empty = torch.empty(0, dtype=sch.format.torch_dtype, device=x2.device)
    rq = q.rowwise.data if rowwise else empty
    cq = q.columnwise.data if columnwise else empty
    if block_dim == 0:
        buf = torch.zeros(8, dtype=torch.float32, device=x2.device)
        buf[0:1] = q.amax
        buf[4:5] = (q.rowwise or q.columnwise).scale_inv.reshape(1)
    else:
        grids = [c.scale_inv.reshape(-1) for c in (q.rowwise, q.columnwise) if c is not None]
        buf = torch.cat(grids + [q.amax.reshape(1).float()])
    return rq.contiguous(), cq.contiguous(), buf


@quantize_fp8_op.register_fake
def _(x2, fmt, block_dim, block_size, pow2, eps, rowwise, columnwise, scale):
    sch = _scheme(fmt, block_dim, block_size, pow2, eps)
    rows, cols = x2.shape
    dt = sch.format.torch_dtype
    rq = x2.new_empty((rows, cols) if rowwise else (0,), dtype=dt)
    cq = x2.new_empty((cols, rows) if columnwise else (0,), dtype=dt)
    return rq, cq, x2.new_empty(_buffer_size(sch, rows, cols, rowwise, columnwise), dtype=torch.float32)


def traceable_fits(scheme, rows: int, cols: int) -> bool:
    """Whether :func:`quantize_traceable` covers ``scheme`` for a (rows, cols) tensor: Float8Tensorwise, or
    Float8Blockwise with both dims multiples of the block size."""
    if isinstance(scheme, Float8Tensorwise):
        return True
    if isinstance(scheme, Float8Blockwise):
        bs = scheme.block_size
        return rows % bs == 0 and cols % bs == 0
    return False


def quantize_traceable(x2: torch.Tensor, scheme, *, rowwise: bool = True, columnwise: bool = False,
                       scale: torch.Tensor | None = None) -> TracedCopies:
    """The FP8 copies of the 2D tensor ``x2`` under ``scheme`` through :func:`quantize_fp8_op` (one operator in a
    compiled graph), with their logical scale grids: :func:`lowbit.quant.quantize`'s bits.

    Args:
        scale: Float8Tensorwise only: a given float32 scale of one element (delayed scaling) to cast with; the
            copies' ``scale_inv`` is then the reciprocal the kernel stores, and the amax is still measured.

    Raises:
        NotImplementedError: ``scheme`` and the shape are not covered (:func:`traceable_fits`).
        ValueError: ``x2`` is not 2D, neither copy is asked for, or a scale is given to a blockwise scheme.
    """
    if x2.dim() != 2:
        raise ValueError(f"x2: expected a 2D tensor, got shape {tuple(x2.shape)}")
    if not (rowwise or columnwise):
        raise ValueError("rowwise, columnwise: ask for at least one copy")
    if not traceable_fits(scheme, *x2.shape):
        raise NotImplementedError(f"scheme: quantize_traceable covers Float8Tensorwise and Float8Blockwise with dims "
                                  f"that are multiples of the block, got {scheme!r} for shape {tuple(x2.shape)}")
    rows, cols = x2.shape
    if isinstance(scheme, Float8Tensorwise):
        rq, cq, buf = quantize_fp8_op(x2.detach(), scheme.fmt, 0, 0, False, 0.0, rowwise, columnwise, scale)
        si = buf[4:5].reshape(1, 1)
        return TracedCopies(rq if rowwise else None, si if rowwise else None, cq if columnwise else None,
                            si if columnwise else None, buf[0:1])
    if scale is not None:
        raise ValueError(f"scale: a given scale is for Float8Tensorwise, got scheme {scheme!r}")
    rq, cq, buf = quantize_fp8_op(x2.detach(), scheme.fmt, scheme.block_dim, scheme.block_size, scheme.pow2,
                                  float(scheme.eps), rowwise, columnwise, None)
    rshape, cshape = scale_storage_shape(scheme, rows, cols), scale_storage_shape(scheme, cols, rows)
    nr = math.prod(rshape) if rowwise else 0
    nc = math.prod(cshape) if columnwise else 0
    rs = scale_logical(scheme, buf[:nr].view(rshape), rows, cols) if rowwise else None
    cs = scale_logical(scheme, buf[nr:nr + nc].view(cshape), cols, rows) if columnwise else None
    return TracedCopies(rq if rowwise else None, rs, cq if columnwise else None, cs, buf[nr + nc:])
