"""FP8 quantization in a form torch.compile holds in a graph, for lowbit's quantized linear.

* :class:`Float8Tensorwise` (current scaling, or a given scale: :func:`tensorwise_copies`, for delayed scaling) as
  torch operations: Inductor compiles them and fuses the amax and the cast with the work around them. They are the
  reference's arithmetic (NUMERICS §2–§3) step for step: the amax is exact, the scale is a correctly rounded
  ``fmax / amax`` (divided in float64 and rounded once), the saturating cast rounds to nearest even.
* :class:`Float8Blockwise` (1x128 segments, 128x128 tiles; dims multiples of the block) as one registered operator,
  ``lowbit::quantize_fp8_blockwise``, a ``torch.library.triton_op``: on CUDA Inductor allocates its outputs and
  launches lowbit's ``blockwise_kernel`` (both copies from one read) from its own code, with no lowbit Python per
  call; elsewhere it calls an opaque operator over the reference. Inductor's kernels for the same arithmetic were
  measured up to 7x slower at the Llama client's shapes (BF16 activations; FP32 weight tiles about even), with
  ``lowbit bench quant``.

Each copy is bit-identical to :func:`lowbit.quant.quantize_reference` (tested); :func:`traceable_fits` says what is
covered.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

from ..runtime.checks import PARAM_DTYPES
from ..runtime.device import INTERPRET
from .reference import FP32_MAX, amax_of
from .schemes import Float8Blockwise, Float8Tensorwise
from .tensor import scale_logical, scale_storage_shape

__all__ = ["TracedCopies", "amax_value", "current_scale", "quantize_blockwise_op", "quantize_traceable",
           "tensorwise_copies", "traceable_fits"]


class TracedCopies(NamedTuple):
    """The FP8 copies of one 2D tensor (rows, cols), with their scales in the logical (rows, blocks) layout of
    :meth:`lowbit.quant.QuantizedTensor.logical_scales` (tensorwise: (1, 1)).

    rowwise, row_scale_inv: the (rows, cols) copy and its dequantization scales (None where not asked for).
    columnwise, col_scale_inv: the (cols, rows) copy (scaled along the rows) and its scales (None where not asked).
    amax: float32 1-D, maxima whose max is max |x| of the whole tensor (what the NaN sentry reads): (1,), or one a
        program of the blockwise kernel's compiled launch (:func:`amax_value` reduces it).
    """

    rowwise: Optional[torch.Tensor]
    row_scale_inv: Optional[torch.Tensor]
    columnwise: Optional[torch.Tensor]
    col_scale_inv: Optional[torch.Tensor]
    amax: torch.Tensor


def current_scale(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """:func:`lowbit.quant.reference.compute_scale` (no power-of-two rounding, no eps) in operations Inductor
    compiles; the same bits for every amax, NaN and Inf included."""
    a = amax.to(torch.float32)
    # float64 quotients rounded once to float32 are the correctly rounded float32 quotients (53 >= 2 * 24 + 2 bits),
    # which Triton's float32 division is not for every divisor
    s = (torch.full_like(a, fmax, dtype=torch.float64) / a.double()).float()
    s = torch.where(a == 0, torch.ones_like(s), s)
    return torch.where(torch.isinf(s), torch.full_like(s, FP32_MAX), s)


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


@functools.lru_cache(maxsize=64)
def _blockwise_scheme(fmt: str, block_dim: int, block_size: int, pow2: bool, eps: float) -> Float8Blockwise:
    """The Float8Blockwise an operator's plain arguments spell (built once per spelling)."""
    return Float8Blockwise(fmt, block_dim, block_size, pow2, eps)


def _blockwise_outputs(x2: torch.Tensor, sch: Float8Blockwise, rowwise: bool,
                       columnwise: bool) -> tuple[torch.Tensor, ...]:
    """x2's blockwise copies from :func:`lowbit.quant.quantize` (lowbit's kernels where they run, the reference
    elsewhere: the same bits) as an operator returns them, each output its own contiguous tensor: (rowwise data,
    columnwise data, rowwise scale storage, columnwise scale storage, amax as int32 bits), a copy not asked for as
    empty tensors."""
    from . import quantize

    q = quantize(x2, sch, rowwise=rowwise, columnwise=columnwise)
    rows, cols = x2.shape
    out = []
    for c, shape in ((q.rowwise, (rows, cols)), (q.columnwise, (cols, rows))):
        if c is None:
            out.append((x2.new_empty(0, dtype=sch.format.torch_dtype), x2.new_empty(0, dtype=torch.float32)))
        else:  # (the scale grids may be views of one buffer: outputs must not alias)
            grid = c.scale_inv.reshape(scale_storage_shape(sch, *shape))
            out.append((c.data.contiguous(), grid.clone(memory_format=torch.contiguous_format)))
    (rq, rs), (cq, cs) = out
    return rq, cq, rs, cs, q.amax.reshape(1).view(torch.int32).clone()


def _blockwise_outputs_fake(x2: torch.Tensor, sch: Float8Blockwise, rowwise: bool,
                            columnwise: bool) -> tuple[torch.Tensor, ...]:
    """:func:`_blockwise_outputs`' outputs as empty tensors of the same shapes, dtypes and strides (for fakes)."""
    rows, cols = x2.shape
    dt = sch.format.torch_dtype
    return (x2.new_empty((rows, cols) if rowwise else (0,), dtype=dt),
            x2.new_empty((cols, rows) if columnwise else (0,), dtype=dt),
            x2.new_empty(scale_storage_shape(sch, rows, cols) if rowwise else (0,), dtype=torch.float32),
            x2.new_empty(scale_storage_shape(sch, cols, rows) if columnwise else (0,), dtype=torch.float32),
            x2.new_empty(1, dtype=torch.int32))


def amax_value(amax: torch.Tensor) -> torch.Tensor:
    """(1,) float32: the amax of a :class:`TracedCopies` (maxima of non-negative floats as float32 bits) reduced to one
    value, NaN above Inf above every finite one, as the sentry's check orders them."""
    return amax.view(torch.int32).amax().reshape(1).view(torch.float32)


def _blockwise_copies(sch: Float8Blockwise, rows: int, cols: int, rowwise: bool, columnwise: bool, rq: torch.Tensor,
                     cq: torch.Tensor, rs: torch.Tensor, cs: torch.Tensor, amax_i: torch.Tensor) -> TracedCopies:
    """:class:`TracedCopies` over :func:`quantize_blockwise_op`'s outputs for a (rows, cols) tensor: views, no copy."""
    return TracedCopies(rq if rowwise else None, scale_logical(sch, rs, rows, cols) if rowwise else None,
                        cq if columnwise else None, scale_logical(sch, cs, cols, rows) if columnwise else None,
                        amax_i.view(torch.float32))


# The opaque form, for what the wrapped launch does not cover (off CUDA; Triton's interpreter): defined with
# torch.library.Library, whose kernel is reached without custom_op's Python autograd and backend wrappers. It takes
# no gradient (callers pass a detached x2).
_LIB = torch.library.Library("lowbit", "FRAGMENT")
_LIB.define("quantize_fp8_blockwise_opaque(Tensor x2, str fmt, int block_dim, int block_size, bool pow2, float eps, "
            "bool rowwise, bool columnwise) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
            tags=(torch.Tag.pt2_compliant_tag,))


def _quantize_blockwise_opaque(x2: torch.Tensor, fmt: str, block_dim: int, block_size: int, pow2: bool, eps: float,
                               rowwise: bool, columnwise: bool) -> tuple[torch.Tensor, ...]:
    """:func:`_blockwise_outputs` of the 2D tensor ``x2`` under Float8Blockwise(fmt, block_dim, block_size, pow2,
    eps): the kernel of ``lowbit::quantize_fp8_blockwise_opaque``."""
    return _blockwise_outputs(x2, _blockwise_scheme(fmt, block_dim, block_size, pow2, eps), rowwise, columnwise)


_LIB.impl("quantize_fp8_blockwise_opaque", _quantize_blockwise_opaque, "CompositeExplicitAutograd")


@torch.library.register_fake("lowbit::quantize_fp8_blockwise_opaque", lib=_LIB)
def _(x2, fmt, block_dim, block_size, pow2, eps, rowwise, columnwise):
    return _blockwise_outputs_fake(x2, _blockwise_scheme(fmt, block_dim, block_size, pow2, eps), rowwise, columnwise)


@torch.library.triton_op("lowbit::quantize_fp8_blockwise", mutates_args=())
def _quantize_blockwise(x2: torch.Tensor, fmt: str, block_dim: int, block_size: int, pow2: bool, eps: float,
                        rowwise: bool, columnwise: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                  torch.Tensor, torch.Tensor]:
    """The Float8Blockwise(fmt, block_dim, block_size, pow2, eps) copies of the 2D tensor ``x2``: (rowwise data,
    columnwise data, rowwise scale storage, columnwise scale storage, amax as int32 bits: (1,), or one a kernel
    program on CUDA, whose max is x2's), a copy not asked for as empty tensors. A ``triton_op``: on CUDA
    torch.compile sees its kernel launch (:func:`lowbit.quant.triton_backend.quantize_blockwise_wrapped`) and Inductor
    makes it; elsewhere it calls the opaque ``lowbit::quantize_fp8_blockwise_opaque`` (the reference, or the
    interpreted kernels)."""
    # (an int or float a compiled caller passes as an input may come symbolic: specialized, a guard on its value)
    block_dim, block_size, pow2, eps = int(block_dim), int(block_size), bool(pow2), float(eps)
    rowwise, columnwise = bool(rowwise), bool(columnwise)
    sch = _blockwise_scheme(fmt, block_dim, block_size, pow2, eps)
    if x2.is_cuda and not INTERPRET:  # (compiled kernels: Triton's interpreter cannot be wrapped)
        from .triton_backend import quantize_blockwise_wrapped

        return quantize_blockwise_wrapped(x2, sch, rowwise, columnwise)
    return torch.ops.lowbit.quantize_fp8_blockwise_opaque(x2, fmt, block_dim, block_size, pow2, eps, rowwise,
                                                          columnwise)


quantize_blockwise_op = torch.ops.lowbit.quantize_fp8_blockwise.default
"""The registered operator ``lowbit::quantize_fp8_blockwise`` (see :func:`_quantize_blockwise`)."""


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
    """The current-scaling FP8 copies of the 2D tensor ``x2`` under ``scheme``, in a form a compiled graph holds
    (tensorwise: torch operations; blockwise: :func:`quantize_blockwise_op`), with their logical scale grids.

    Raises:
        TypeError: ``x2`` is not a floating-point tensor (float32, bfloat16, float16, float64).
        NotImplementedError: ``scheme`` and the shape are not covered (:func:`traceable_fits`).
        ValueError: ``x2`` is not 2D, or neither copy is asked for.
    """
    if not isinstance(x2, torch.Tensor) or x2.dtype not in PARAM_DTYPES:
        what = x2.dtype if isinstance(x2, torch.Tensor) else type(x2).__name__
        raise TypeError(f"x2: expected a float32, bfloat16, float16 or float64 tensor, got {what}")
    if x2.dim() != 2:
        raise ValueError(f"x2: expected a 2D tensor, got shape {tuple(x2.shape)}")
    if not (rowwise or columnwise):
        raise ValueError("rowwise, columnwise: ask for at least one copy")
    if not traceable_fits(scheme, *x2.shape):
        raise NotImplementedError(f"scheme: quantize_traceable covers Float8Tensorwise and Float8Blockwise with dims "
                                  f"that are multiples of the block, got {scheme!r} for shape {tuple(x2.shape)}")
    if isinstance(scheme, Float8Tensorwise):
        return _tensorwise(x2, scheme, rowwise, columnwise)
    outs = quantize_blockwise_op(x2.detach(), scheme.fmt, scheme.block_dim, scheme.block_size, scheme.pow2,
                                 float(scheme.eps), rowwise, columnwise)
    return _blockwise_copies(scheme, *x2.shape, rowwise, columnwise, *outs)
