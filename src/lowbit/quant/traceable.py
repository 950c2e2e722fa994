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
covered. Given ``amax_into`` (an int32 (1,) slot, the NaN sentry's), the amax is max-accumulated into it in place
(blockwise: the kernel's own atomic max, ``lowbit::quantize_fp8_blockwise_into``), with no launch of its own.
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

__all__ = ["TracedCopies", "amax_value", "current_scale", "delayed_scale", "quantize_blockwise_into_op",
           "quantize_blockwise_op", "quantize_traceable", "tensorwise_copies", "traceable_fits"]


class TracedCopies(NamedTuple):
    """The FP8 copies of one tensor read as 2D (rows, cols), with their scales in the logical (rows, blocks) layout of
    :meth:`lowbit.quant.QuantizedTensor.logical_scales` (tensorwise: (1, 1)).

    rowwise, row_scale_inv: the (rows, cols) copy and its dequantization scales (None where not asked for).
    columnwise, col_scale_inv: the (cols, rows) copy (scaled along the rows) and its scales (None where not asked).
    amax: float32 1-D, maxima whose max is max |x| of the whole tensor (what the NaN sentry reads): (1,), or one a
        program of the blockwise kernel's compiled launch (:func:`amax_value` reduces it); None where the amax went
        into a caller's slot (``amax_into``).
    """

    rowwise: Optional[torch.Tensor]
    row_scale_inv: Optional[torch.Tensor]
    columnwise: Optional[torch.Tensor]
    col_scale_inv: Optional[torch.Tensor]
    amax: Optional[torch.Tensor]


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


def delayed_scale(amax: torch.Tensor, scale: torch.Tensor, steps: torch.Tensor, warmup_steps: int,
                  fmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, scale_inv)`` (float32 (1,) each) to cast a tensor of amax ``amax`` with under delayed scaling, in
    operations a compiled graph holds: the history's ``scale`` once its record count ``steps`` (float32 (1,)) reaches
    ``warmup_steps``, with ``scale_inv`` = 1 / scale, NaN where ``amax`` is not finite
    (:func:`lowbit.quant.reference.delayed_scale_inv`); before that the current scale of ``amax``
    (:func:`current_scale`). The bits of eager's choice, made on the device."""
    a = amax.reshape(1).to(torch.float32)
    cur = current_scale(a, fmax)
    ready = steps.reshape(1) >= warmup_steps
    si_delayed = torch.where(torch.isfinite(a), _reciprocal(scale.reshape(1)), torch.full_like(a, float("nan")))
    return torch.where(ready, scale.reshape(1), cur), torch.where(ready, si_delayed, _reciprocal(cur))


def tensorwise_copies(x2: torch.Tensor, sch: Float8Tensorwise, amax: torch.Tensor, scale: torch.Tensor,
                      scale_inv: torch.Tensor, *, rowwise: bool, columnwise: bool,
                      amax_into: Optional[torch.Tensor] = None) -> TracedCopies:
    """The Float8Tensorwise copies of x2 cast with a given ``scale`` (current, or a delayed one), which dequantize by
    ``scale_inv``; ``amax`` is x2's (:func:`lowbit.quant.reference.amax_of`), carried along, or max-accumulated into
    ``amax_into`` (as :func:`quantize_traceable` takes it; the copies' amax is then None)."""
    data = _cast(x2.float() * scale, sch.format).contiguous()
    si = scale_inv.reshape(1, 1)
    if amax_into is not None:
        _check_amax_into(amax_into, x2)
        _max_into(amax_into, amax)
        amax = None
    return TracedCopies(data if rowwise else None, si if rowwise else None,
                        data.t().contiguous() if columnwise else None, si if columnwise else None, amax)


def _tensorwise(x2: torch.Tensor, sch: Float8Tensorwise, rowwise: bool, columnwise: bool,
                amax_into: Optional[torch.Tensor]) -> TracedCopies:
    amax = amax_of(x2)
    s = current_scale(amax, sch.format.max)
    return tensorwise_copies(x2, sch, amax, s, _reciprocal(s), rowwise=rowwise, columnwise=columnwise,
                             amax_into=amax_into)


@functools.lru_cache(maxsize=64)
def _blockwise_scheme(fmt: str, block_dim: int, block_size: int, pow2: bool, eps: float) -> Float8Blockwise:
    """The Float8Blockwise an operator's plain arguments spell (built once per spelling)."""
    return Float8Blockwise(fmt, block_dim, block_size, pow2, eps)


def _rows_cols(x: torch.Tensor) -> tuple[int, int]:
    """(rows, cols) of ``x`` read as 2D: the product of its leading dims, its last dim."""
    cols = x.shape[-1]
    return (x.numel() // cols if cols else 0), cols


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    """``x`` read as 2D (rows, cols) (a view where the layout allows)."""
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def _blockwise_outputs(x2: torch.Tensor, sch: Float8Blockwise, rowwise: bool,
                       columnwise: bool) -> tuple[torch.Tensor, ...]:
    """x2's (read as 2D) blockwise copies from :func:`lowbit.quant.quantize` (lowbit's kernels where they run, the
    reference elsewhere: the same bits) as an operator returns them, each output its own contiguous tensor: (rowwise
    data, columnwise data, rowwise scale storage, columnwise scale storage, amax as int32 bits), a copy not asked for
    as empty tensors."""
    from . import quantize

    x2 = _as_2d(x2)
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
    rows, cols = _rows_cols(x2)
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
                      cq: torch.Tensor, rs: torch.Tensor, cs: torch.Tensor,
                      amax_i: Optional[torch.Tensor]) -> TracedCopies:
    """:class:`TracedCopies` over :func:`quantize_blockwise_op`'s outputs for a (rows, cols) tensor: views, no copy."""
    return TracedCopies(rq if rowwise else None, scale_logical(sch, rs, rows, cols) if rowwise else None,
                        cq if columnwise else None, scale_logical(sch, cs, cols, rows) if columnwise else None,
                        None if amax_i is None else amax_i.view(torch.float32))


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


def _max_into(amax_into: torch.Tensor, amax_bits: torch.Tensor) -> None:
    """amax_into (int32 (1,)) = max(amax_into, the max of ``amax_bits``), both float32 bits of non-negative values
    (sign bits cleared: NaN above Inf above every finite one, as :func:`amax_value` orders them)."""
    a = amax_bits.reshape(-1).view(torch.int32) & 0x7FFFFFFF
    amax_into.copy_(torch.maximum(amax_into, a.amax().reshape(1)))


def _blockwise_body(x2: torch.Tensor, fmt: str, block_dim: int, block_size: int, pow2: bool, eps: float,
                    rowwise: bool, columnwise: bool, amax_into: Optional[torch.Tensor] = None) -> tuple:
    """Both operators' body: on CUDA the wrapped kernel launch Inductor makes
    (:func:`lowbit.quant.triton_backend.quantize_blockwise_wrapped`), elsewhere the opaque
    ``lowbit::quantize_fp8_blockwise_opaque`` (the reference, or the interpreted kernels); given ``amax_into``, the
    amax is max-accumulated into it (the last output is then ``amax_into`` on CUDA, the opaque amax elsewhere)."""
    # (an int or float a compiled caller passes as an input may come symbolic: specialized, a guard on its value)
    block_dim, block_size, pow2, eps = int(block_dim), int(block_size), bool(pow2), float(eps)
    rowwise, columnwise = bool(rowwise), bool(columnwise)
    if x2.is_cuda and not INTERPRET:  # (compiled kernels: Triton's interpreter cannot be wrapped)
        from .triton_backend import quantize_blockwise_wrapped

        sch = _blockwise_scheme(fmt, block_dim, block_size, pow2, eps)
        return quantize_blockwise_wrapped(x2, sch, rowwise, columnwise, amax_into=amax_into)
    outs = torch.ops.lowbit.quantize_fp8_blockwise_opaque(x2, fmt, block_dim, block_size, pow2, eps, rowwise,
                                                          columnwise)
    if amax_into is not None:
        _max_into(amax_into, outs[4])
    return outs


@torch.library.triton_op("lowbit::quantize_fp8_blockwise", mutates_args=())
def _quantize_blockwise(x2: torch.Tensor, fmt: str, block_dim: int, block_size: int, pow2: bool, eps: float,
                        rowwise: bool, columnwise: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                  torch.Tensor, torch.Tensor]:
    """The Float8Blockwise(fmt, block_dim, block_size, pow2, eps) copies of ``x2`` read as 2D (rows: the product of
    its leading dims): (rowwise data, columnwise data, rowwise scale storage, columnwise scale storage, amax as int32
    bits: (1,), or one a kernel program on CUDA, whose max is x2's), a copy not asked for as empty tensors. A
    ``triton_op``: on CUDA torch.compile sees its kernel launch and Inductor makes it (:func:`_blockwise_body`)."""
    return tuple(_blockwise_body(x2, fmt, block_dim, block_size, pow2, eps, rowwise, columnwise))


quantize_blockwise_op = torch.ops.lowbit.quantize_fp8_blockwise.default
"""The registered operator ``lowbit::quantize_fp8_blockwise`` (see :func:`_quantize_blockwise`)."""


@torch.library.triton_op("lowbit::quantize_fp8_blockwise_into", mutates_args=("amax_into",))
def _quantize_blockwise_into(x2: torch.Tensor, fmt: str, block_dim: int, block_size: int, pow2: bool, eps: float,
                             rowwise: bool, columnwise: bool, amax_into: torch.Tensor) -> tuple[
                                 torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``lowbit::quantize_fp8_blockwise``'s first four outputs; x2's amax bits are max-accumulated into the int32
    (1,) ``amax_into`` in place (on CUDA by the kernel's programs, an atomic max each: no launch and no buffer of
    their own)."""
    return tuple(_blockwise_body(x2, fmt, block_dim, block_size, pow2, eps, rowwise, columnwise, amax_into)[:4])


quantize_blockwise_into_op = torch.ops.lowbit.quantize_fp8_blockwise_into.default
"""The registered operator ``lowbit::quantize_fp8_blockwise_into`` (see :func:`_quantize_blockwise_into`)."""


def traceable_fits(scheme, rows: int, cols: int) -> bool:
    """Whether :func:`quantize_traceable` covers ``scheme`` for a (rows, cols) tensor: Float8Tensorwise, or
    Float8Blockwise with both dims multiples of the block size."""
    if isinstance(scheme, Float8Tensorwise):
        return True
    if isinstance(scheme, Float8Blockwise):
        bs = scheme.block_size
        return rows % bs == 0 and cols % bs == 0
    return False


def _check_amax_into(amax_into, x: torch.Tensor) -> None:
    if not isinstance(amax_into, torch.Tensor):
        raise TypeError(f"amax_into: expected a tensor or None, got {type(amax_into).__name__}")
    if amax_into.dtype != torch.int32 or tuple(amax_into.shape) != (1,):
        raise ValueError(f"amax_into: expected an int32 tensor of shape (1,) (float32 bits), got "
                         f"{amax_into.dtype} {tuple(amax_into.shape)}")
    if amax_into.device != x.device:
        raise ValueError(f"amax_into: expected a tensor on x's device {x.device}, got {amax_into.device}")


def quantize_traceable(x: torch.Tensor, scheme, *, rowwise: bool = True, columnwise: bool = False,
                       amax_into: Optional[torch.Tensor] = None) -> TracedCopies:
    """The current-scaling FP8 copies of ``x`` read as 2D (rows: the product of its leading dims; cols: its last
    dim) under ``scheme``, in a form a compiled graph holds (tensorwise: torch operations; blockwise:
    :func:`quantize_blockwise_op`), with their logical scale grids.
    Given ``amax_into`` (int32 (1,), float32 bits, on x's device), x's amax is max-accumulated into it in place
    (:func:`quantize_blockwise_into_op` for blockwise) and the returned amax is None.

    Raises:
        TypeError: ``x`` is not a floating-point tensor (float32, bfloat16, float16, float64); ``amax_into`` is
            not a tensor.
        NotImplementedError: ``scheme`` and the shape are not covered (:func:`traceable_fits`).
        ValueError: ``x`` has fewer than 2 dims, neither copy is asked for, or ``amax_into`` is not an int32 (1,)
            tensor on x's device.
    """
    if not isinstance(x, torch.Tensor) or x.dtype not in PARAM_DTYPES:
        what = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"x: expected a float32, bfloat16, float16 or float64 tensor, got {what}")
    if x.dim() < 2:
        raise ValueError(f"x: expected a tensor of at least 2 dims (read as 2D), got shape {tuple(x.shape)}")
    if not (rowwise or columnwise):
        raise ValueError("rowwise, columnwise: ask for at least one copy")
    rows, cols = _rows_cols(x)
    if not traceable_fits(scheme, rows, cols):
        raise NotImplementedError(f"scheme: quantize_traceable covers Float8Tensorwise and Float8Blockwise with dims "
                                  f"that are multiples of the block, got {scheme!r} for shape {(rows, cols)}")
    if amax_into is not None:
        _check_amax_into(amax_into, x)
    if torch.is_grad_enabled() and x.requires_grad:  # (no gradient flows through the copies; inside an autograd
        x = x.detach()  # Function's forward grad is off: no view between the caller's tensor and the kernel)
    if isinstance(scheme, Float8Tensorwise):
        return _tensorwise(_as_2d(x), scheme, rowwise, columnwise, amax_into)
    args = (scheme.fmt, scheme.block_dim, scheme.block_size, scheme.pow2, float(scheme.eps), rowwise, columnwise)
    if amax_into is None:
        return _blockwise_copies(scheme, rows, cols, rowwise, columnwise, *quantize_blockwise_op(x, *args))
    rq, cq, rs, cs = quantize_blockwise_into_op(x, *args, amax_into)
    return _blockwise_copies(scheme, rows, cols, rowwise, columnwise, rq, cq, rs, cs, None)
