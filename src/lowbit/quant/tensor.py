"""QuantizedTensor: a plain container for quantized data, its scales and its amax (NUMERICS §4)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from ..formats import e2m1_decode, e8m0_decode, unpack_e2m1
from .rht import rht_matrix
from .schemes import MXFP8, NVFP4, Float8Blockwise, Float8Rowwise, Float8Tensorwise, Scheme

__all__ = ["QuantizedCopy", "QuantizedTensor", "expand_blocks", "pad_to", "scale_storage", "scale_logical",
           "scale_storage_shape", "copy_layout", "check_copy", "copy_tensors",
           "copy_from_tensors", "empty_copy_tensors", "n_copy_tensors", "columnwise_from_rowwise"]


def expand_blocks(s: torch.Tensor, r: int, k: int, bs_r: int, bs_k: int) -> torch.Tensor:
    """Repeat a (ceil(r/bs_r), ceil(k/bs_k)) block grid to (r, k) elements (ragged edge blocks cut)."""
    return s.repeat_interleave(bs_r, dim=0)[:r].repeat_interleave(bs_k, dim=1)[:, :k]


def pad_to(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


# ------------------------------------------------------------------------------------------------
# Scale layouts. Logical = (rows, blocks) of the 2D copy. Storage = what the fast GEMM consumes:
#   tensorwise      (1,) fp32
#   rowwise         (rows, 1) fp32
#   1xB blockwise   (n_blocks, pad4(rows)) fp32, "outer-dim-major": the GEMM reads
#                   storage[:, :rows].t() -> shape (rows, n_blocks), strides (1, pad4(rows))
#   BxB blockwise   (row_blocks, pad4(col_blocks)) fp32, row-major
#   MXFP8           (rows, cols/32) uint8 E8M0
#   NVFP4           (rows, cols/16) (1x16) or (rows/16, cols/16) (16x16) float8_e4m3fn
# ------------------------------------------------------------------------------------------------
def scale_storage(scheme: Scheme, logical: torch.Tensor) -> torch.Tensor:
    """Convert a logical (rows, blocks) scale grid to the storage layout of ``scheme`` (once, at quantization)."""
    if isinstance(scheme, Float8Tensorwise):
        return logical.reshape(1).contiguous()
    if isinstance(scheme, Float8Blockwise):
        r, b = logical.shape
        if scheme.block_dim == 1:
            out = torch.zeros(b, pad_to(r, 4), dtype=logical.dtype, device=logical.device)
            out[:, :r] = logical.t()
            return out
        out = torch.zeros(r, pad_to(b, 4), dtype=logical.dtype, device=logical.device)
        out[:, :b] = logical
        return out
    return logical.contiguous()


def scale_logical(scheme: Scheme, storage: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`scale_storage` for a copy whose 2D data is (rows, cols) (logical columns)."""
    if isinstance(scheme, Float8Tensorwise):
        return storage.reshape(1, 1)
    if isinstance(scheme, Float8Blockwise):
        bs = scheme.block_size
        if scheme.block_dim == 1:
            return storage[:, :rows].t()
        return storage[:, : cdiv(cols, bs)]
    return storage


_FP8_DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def scale_storage_shape(scheme: Scheme, rows: int, cols: int) -> tuple[int, ...]:
    """Shape of the stored scale grid (the layouts above) of a copy whose 2D data is (rows, cols) logical elements."""
    if isinstance(scheme, Float8Tensorwise):
        return (1,)
    if isinstance(scheme, Float8Rowwise):
        return (rows, 1)
    if isinstance(scheme, Float8Blockwise):
        bs = scheme.block_size
        if scheme.block_dim == 1:
            return (cdiv(cols, bs), pad_to(rows, 4))
        return (cdiv(rows, bs), pad_to(cdiv(cols, bs), 4))
    if isinstance(scheme, MXFP8):
        return (rows, cols // 32)
    if isinstance(scheme, NVFP4):
        return (rows // 16, cols // 16) if scheme.two_d else (rows, cols // 16)
    raise TypeError("scheme: expected one of Float8Tensorwise, Float8Rowwise, Float8Blockwise, MXFP8, NVFP4, "
                    f"got {scheme!r}")


def copy_layout(scheme: Scheme, rows: int, cols: int):
    """What a copy of logical 2D shape (rows, cols) stores under ``scheme``:
    ``(data dtype, data shape, scale dtype, scale shape, the scale layout's rule in words)``, or a ``str``
    saying why no copy of that shape exists (NVFP4: cols divisible by 16, 16x16 tiles: rows too; MXFP8:
    cols divisible by 32 — what the quantizers require). Memoized: every quantized GEMM operand is
    checked against it, every call."""
    try:
        return _copy_layout_memo(scheme, rows, cols)
    except TypeError:  # an unhashable scheme: the plain function names what is wrong with it
        return _copy_layout(scheme, rows, cols)


def _copy_layout(scheme: Scheme, rows: int, cols: int):
    """The layout table behind :func:`copy_layout`."""
    sshape = scale_storage_shape(scheme, rows, cols)
    if isinstance(scheme, NVFP4):
        if cols % 16 or (scheme.two_d and rows % 16):
            return (f"NVFP4 {'16x16 tiles need rows and cols' if scheme.two_d else 'needs cols'} divisible by 16")
        rule = "NVFP4 16x16: (rows/16, cols/16)" if scheme.two_d else "NVFP4 1x16: (rows, cols/16)"
        return torch.uint8, (rows, cols // 2), torch.float8_e4m3fn, sshape, rule
    dt = _FP8_DTYPE[scheme.fmt]
    if isinstance(scheme, MXFP8):
        if cols % 32:
            return "MXFP8 needs cols divisible by 32"
        return dt, (rows, cols), torch.uint8, sshape, "MXFP8: (rows, cols/32) E8M0 bytes"
    if isinstance(scheme, Float8Blockwise):
        bs = scheme.block_size
        rule = (f"1x{bs}: (ceil(cols/{bs}), pad4(rows))" if scheme.block_dim == 1
                else f"{bs}x{bs}: (ceil(rows/{bs}), pad4(ceil(cols/{bs})))")
    else:
        rule = "tensorwise: (1,)" if isinstance(scheme, Float8Tensorwise) else "rowwise: (rows, 1)"
    return dt, (rows, cols), torch.float32, sshape, rule


_copy_layout_memo = functools.lru_cache(maxsize=4096)(_copy_layout)


def check_copy(qt: "QuantizedTensor", which: str, name: str = "x") -> None:
    """Raise ValueError unless ``qt``'s ``which`` copy is structurally what its scheme and logical shape require:
    data dtype and shape, scale dtype, shape (storage layout, see :func:`scale_storage`), contiguity and device,
    and (NVFP4) a float32 (1,) global scale. Metadata only: no data is read, no device is synchronized.
    ``name`` is the argument the message blames (``a``/``b`` for :func:`lowbit.scaled_mm`)."""
    c = getattr(qt, which)
    r, k = (qt.rows, qt.cols) if which == "rowwise" else (qt.cols, qt.rows)
    lay = copy_layout(qt.scheme, r, k)
    if isinstance(lay, str):
        _bad(qt, which, name, r, k, f"{lay}; got cols {k} and rows {r} (logical shape {tuple(qt.shape)})")
    dt, dshape, st, sshape, rule = lay
    d, s = c.data, c.scale_inv
    if not isinstance(d, torch.Tensor) or not isinstance(s, torch.Tensor):
        raise TypeError(f"{name}: the {which} copy's data and scale_inv must be tensors, got {type(d).__name__} and "
                        f"{type(s).__name__}")
    # (the common case passes the conditions below; the messages are formatted only on failure)
    if d.dtype != dt:
        _bad(qt, which, name, r, k, f"data must be {dt}, got {d.dtype}")
    if d.shape != dshape:
        _bad(qt, which, name, r, k,
             f"data must have shape {dshape}{' (two E2M1 codes a byte)' if dt == torch.uint8 else ''}, "
                                    f"got {tuple(d.shape)}")
    if s.dtype != st:
        _bad(qt, which, name, r, k, f"scale_inv must be {st}, got {s.dtype}")
    if s.shape != sshape:
        _bad(qt, which, name, r, k, f"scale_inv must have the storage shape {sshape} ({rule}), got {tuple(s.shape)}")
    if not s.is_contiguous():
        _bad(qt, which, name, r, k,
             f"scale_inv must be contiguous (the storage layout), got strides {tuple(s.stride())}")
    if s.device != d.device:
        _bad(qt, which, name, r, k, f"scale_inv must be on the data's device {d.device}, got {s.device}")
    if dt == torch.uint8:
        g = c.global_scale
        if g is None or g.dtype != torch.float32 or g.shape != (1,) or g.device != d.device:
            _bad(qt, which, name, r, k, f"global_scale must be a float32 (1,) tensor on {d.device}, got "
                                        f"{None if g is None else (g.dtype, tuple(g.shape), str(g.device))}")


def copy_tensors(qt: "QuantizedTensor", which: str) -> list[torch.Tensor]:
    """The tensors a GEMM reads of ``qt``'s ``which`` copy, in a fixed order: ``[data, scale_inv]``, plus
    ``global_scale`` under NVFP4 (what an operator saves for its backward; the amax is not among them). FP8 tensors
    are given as their bytes (uint8 views), which autograd does not treat as differentiable. Rebuilt by
    :func:`copy_from_tensors`."""
    c = qt._copy(which)
    return [_bytes(c.data), _bytes(c.scale_inv)] + ([c.global_scale] if isinstance(qt.scheme, NVFP4) else [])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _layout_of(scheme: Scheme, shape, which: str):
    """:func:`copy_layout` of the ``which`` copy of a tensor of logical ``shape``; ValueError where there is none."""
    rows = 1
    for d in shape[:-1]:
        rows *= d
    r, k = (rows, shape[-1]) if which == "rowwise" else (shape[-1], rows)
    lay = copy_layout(scheme, r, k)
    if isinstance(lay, str):
        raise ValueError(f"shape: no {which} copy of shape {tuple(shape)} under {scheme!r}: {lay}")
    return lay


def n_copy_tensors(scheme: Scheme) -> int:
    """How many tensors :func:`copy_tensors` lists for a copy under ``scheme``."""
    return 3 if isinstance(scheme, NVFP4) else 2


def copy_from_tensors(tensors, scheme: Scheme, shape, dtype: torch.dtype, which: str) -> "QuantizedTensor":
    """A QuantizedTensor of logical ``shape`` holding the one ``which`` copy in ``tensors`` (as
    :func:`copy_tensors` lists them). Its amax is not kept (an uninitialised placeholder), so it must not go to the
    NaN sentry; the Random Hadamard Transform flag follows the scheme (NVFP4 applies it to the columnwise copy where
    ``scheme.rht``)."""
    n = n_copy_tensors(scheme)
    if len(tensors) != n:
        raise ValueError(f"tensors: a {which} copy under {scheme!r} is {n} tensors, got {len(tensors)}")
    lay = _layout_of(scheme, shape, which)
    data, sinv = tensors[0].view(lay[0]), tensors[1].view(lay[2])
    gs = tensors[2] if n == 3 else None
    rht = which == "columnwise" and isinstance(scheme, NVFP4) and bool(scheme.rht)
    amax = torch.empty(1, dtype=torch.float32, device=data.device)
    c = QuantizedCopy(data=data, scale_inv=sinv, amax=amax, global_scale=gs, rht=rht)
    return QuantizedTensor(torch.Size(shape), dtype, scheme, **{which: c})


def empty_copy_tensors(scheme: Scheme, shape, which: str, device) -> list[torch.Tensor]:
    """Uninitialised tensors with the dtypes, shapes and (contiguous) strides of :func:`copy_tensors` of a ``which``
    copy of a tensor of logical ``shape`` (e.g. on the ``meta`` device, or fake tensors, for an operator's fake
    implementation)."""
    _, dshape, st, sshape, _ = _layout_of(scheme, shape, which)
    st = torch.uint8 if st.itemsize == 1 else st
    out = [torch.empty(dshape, dtype=torch.uint8, device=device), torch.empty(sshape, dtype=st, device=device)]
    if isinstance(scheme, NVFP4):
        out.append(torch.empty(1, dtype=torch.float32, device=device))
    return out


def columnwise_from_rowwise(qt: "QuantizedTensor") -> "QuantizedCopy":
    """The columnwise copy of ``qt`` made from its rowwise copy, where the two hold the same scaling groups:
    Float8Tensorwise (the transposed data, the same scale) and Float8Blockwise with ``block_dim=2`` (square tiles: the
    transposed data and the transposed tile grid). Bit-identical to quantizing the high-precision tensor with
    ``columnwise=True`` (every tile's amax, hence its scale, is the same set of elements either way). The data is
    transposed by :func:`lowbit.runtime.transpose.transpose_2d` (one tiled kernel on the GPU, where torch's
    transposing copy is slow).

    Raises:
        ValueError: ``qt`` has no rowwise copy, or its scheme scales rows and columns differently.
    """
    from ..runtime.transpose import transpose_2d  # (lazy: that module imports triton)

    sch, r = qt.scheme, qt.rowwise
    if r is None:
        raise ValueError("qt: has no rowwise copy to transpose")
    if isinstance(sch, Float8Tensorwise):
        return QuantizedCopy(data=transpose_2d(r.data.contiguous()), scale_inv=r.scale_inv, amax=r.amax)
    if isinstance(sch, Float8Blockwise) and sch.block_dim == 2:
        logical = scale_logical(sch, r.scale_inv, qt.rows, qt.cols)
        return QuantizedCopy(data=transpose_2d(r.data.contiguous()), scale_inv=scale_storage(sch, logical.t()),
                             amax=r.amax)
    raise ValueError(f"qt: the columnwise copy is the transposed rowwise copy only under Float8Tensorwise or "
                     f"128x128 Float8Blockwise (block_dim=2), got scheme {sch!r}")


def _bad(qt, which, name, r, k, why):
    raise ValueError(f"{name}: the {which} copy ({r}, {k}) under {qt.scheme}: {why}")


@dataclass
class QuantizedCopy:
    """One copy (rowwise or columnwise) of a quantized tensor, as a 2D matrix.

    Attributes:
        data: the quantized elements, shape (rows, cols), last dim contiguous: ``float8_e4m3fn`` /
            ``float8_e5m2``, or ``uint8`` holding two E2M1 codes per byte (shape (rows, cols/2)).
            For the rowwise copy rows = prod(leading dims), cols = last dim; the columnwise copy is
            the transpose (rows = last dim).
        scale_inv: dequantization scales (x ≈ q · scale_inv) in the storage layout of the scheme
            (see :func:`scale_storage`); for NVFP4 the E4M3 block scales ``d`` (x ≈ q · d / global_scale).
        amax: float32 (1,), max |x| over what this copy quantized (after the RHT where it applies).
        global_scale: NVFP4 only: float32 (1,), S = 448·6 / amax.
        rht: whether the Random Hadamard Transform was applied before quantizing this copy.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    amax: torch.Tensor
    global_scale: torch.Tensor | None = None
    rht: bool = False

    @property
    def nbytes(self) -> int:
        n = self.data.numel() * self.data.element_size() + self.scale_inv.numel() * self.scale_inv.element_size()
        if self.global_scale is not None:
            n += self.global_scale.numel() * self.global_scale.element_size()
        return n


@dataclass
class QuantizedTensor:
    """A quantized tensor: logical shape, nominal dtype, scheme and up to two copies (NUMERICS §4).

    * ``rowwise``: data laid out with the original last dim contiguous (fprop: x and w; dgrad: dy).
    * ``columnwise``: the transpose, contiguous along the original rows (dgrad: w; wgrad: dy and x).

    Build one with :func:`lowbit.quantize`.
    """

    shape: torch.Size
    dtype: torch.dtype
    scheme: Scheme
    rowwise: QuantizedCopy | None = None
    columnwise: QuantizedCopy | None = None
    meta: dict = field(default_factory=dict)

    # -- sizes --------------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        """Rows of the rowwise 2D view (product of all leading dims)."""
        n = 1
        for s in self.shape[:-1]:
            n *= s
        return n

    @property
    def cols(self) -> int:
        return self.shape[-1]

    @property
    def device(self) -> torch.device:
        return (self.rowwise or self.columnwise).data.device

    @property
    def data_nbytes(self) -> int:
        return sum(c.data.numel() * c.data.element_size() for c in self._copies())

    @property
    def nbytes(self) -> int:
        """Bytes held: data plus scales (plus the NVFP4 global scales) of every copy present."""
        return sum(c.nbytes for c in self._copies())

    def _copies(self):
        return [c for c in (self.rowwise, self.columnwise) if c is not None]

    def _copy(self, which: str) -> QuantizedCopy:
        if which not in ("rowwise", "columnwise"):
            raise ValueError(f"which: expected 'rowwise' or 'columnwise', got {which!r}")
        c = getattr(self, which)
        if c is None:
            raise ValueError(f"which: this QuantizedTensor has no {which} copy (quantize with {which}=True)")
        return c

    def validate(self, name: str = "x", which: str | None = None) -> None:
        """Raise ValueError (naming ``name`` and the copy) unless the ``which`` copy (None: every present copy) has
        the data dtype and shape, and the scale dtype, shape, contiguity and device, that the scheme and the logical
        shape require (see :func:`check_copy`), and the copies share one device. Metadata only: cheap, no device
        synchronization."""
        copies = [which] if which is not None else [w for w in ("rowwise", "columnwise")
                                                    if getattr(self, w) is not None]
        if not copies:
            raise ValueError(f"{name}: has neither a rowwise nor a columnwise copy")
        for w in copies:
            if getattr(self, w) is None:
                raise ValueError(f"{name}: has no {w} copy; quantize it with {w}=True")
            check_copy(self, w, name)
        r, c = self.rowwise, self.columnwise
        if r is not None and c is not None and r.data.device != c.data.device:
            raise ValueError(f"{name}: the rowwise copy is on {r.data.device} but the columnwise copy on "
                             f"{c.data.device}")

    # -- amax / NaN sentry ----------------------------------------------------------------------
    @property
    def amax(self) -> torch.Tensor:
        """float32 (1,): amax of the high-precision tensor (of the rowwise copy if present)."""
        return (self.rowwise or self.columnwise).amax

    @property
    def has_nonfinite_amax(self) -> bool:
        """True when an amax measured during quantization is NaN or ±Inf (the NaN sentry's flag). Syncs."""
        return any(not bool(torch.isfinite(c.amax).all()) for c in self._copies())

    # -- scales ---------------------------------------------------------------------------------
    def logical_scales(self, which: str = "rowwise") -> torch.Tensor:
        """The copy's scales in the plain (rows, blocks) layout, in their stored dtype.

        fp32 ``scale_inv`` for FP8 schemes (tensorwise: (1, 1)); uint8 E8M0 bytes for MXFP8;
        float8_e4m3fn block scales ``d`` for NVFP4 ((rows, cols/16) or (rows/16, cols/16) for 16x16 tiles).
        """
        c = self._copy(which)
        r, k = (self.rows, self.cols) if which == "rowwise" else (self.cols, self.rows)
        return scale_logical(self.scheme, c.scale_inv, r, k)

    def expanded_block_scales(self, which: str = "rowwise", dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(rows, cols) per-element block scale of the 2D copy, in ``dtype`` (exact: every stored scale is
        representable in float32): ``scale_inv`` for FP8 schemes, the decoded E8M0 power of two for MXFP8,
        the E4M3 block scale ``d`` for NVFP4 (not yet divided by the global scale)."""
        r, k = (self.rows, self.cols) if which == "rowwise" else (self.cols, self.rows)
        s = self.logical_scales(which)
        sch = self.scheme
        if isinstance(sch, (Float8Tensorwise, Float8Rowwise)):
            return s.to(dtype).expand(r, k)
        if isinstance(sch, Float8Blockwise):
            bs = sch.block_size
            return expand_blocks(s.to(dtype), r, k, bs if sch.block_dim == 2 else 1, bs)
        if isinstance(sch, MXFP8):
            return expand_blocks(e8m0_decode(s).to(dtype), r, k, 1, sch.block_size)
        if isinstance(sch, NVFP4):
            return expand_blocks(s.float().to(dtype), r, k, 16 if sch.two_d else 1, 16)
        raise TypeError(f"unknown scheme {sch!r}")

    def expanded_scale_inv(self, which: str = "rowwise") -> torch.Tensor:
        """float32 (rows, cols) dequantization multiplier per element of the 2D copy (for references)."""
        s = self.expanded_block_scales(which)
        if isinstance(self.scheme, NVFP4):
            return s / self._copy(which).global_scale
        return s

    # -- dequantize -----------------------------------------------------------------------------
    def elements(self, which: str = "rowwise") -> torch.Tensor:
        """float32 (rows, cols) element values of a copy before scaling (E2M1 codes decoded)."""
        c = self._copy(which)
        if isinstance(self.scheme, NVFP4):
            return e2m1_decode(unpack_e2m1(c.data))
        return c.data.to(torch.float32)

    def dequantize(self, which: str | None = None, *, dtype: torch.dtype | None = None,
                   undo_rht: bool = True) -> torch.Tensor:
        """High-precision tensor of the logical shape: element · scale_inv (NVFP4: q · d / S).

        ``which`` picks the copy (default: rowwise if present). A columnwise copy quantized after the
        Random Hadamard Transform is transformed back (``undo_rht=True``) so both copies approximate x.
        """
        which = which or ("rowwise" if self.rowwise is not None else "columnwise")
        c = self._copy(which)
        q = self.elements(which)
        if isinstance(self.scheme, NVFP4):
            r, k = q.shape
            # q·d is exact (E2M1 × E4M3); one rounding in the division
            x = (q * self.expanded_block_scales(which)) / c.global_scale
            if c.rht and undo_rht:
                R = rht_matrix(self.scheme.rht_signs, device=x.device)
                x = (x.reshape(r, k // 16, 16) @ R.t()).reshape(r, k)
        else:
            x = q * self.expanded_scale_inv(which)
        if which == "columnwise":
            x = x.t()
        return x.reshape(self.shape).to(dtype or self.dtype)

    def __repr__(self) -> str:
        copies = "+".join(n for n in ("rowwise", "columnwise") if getattr(self, n) is not None)
        return (f"QuantizedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, scheme={self.scheme}, "
                f"copies={copies}, nbytes={self.nbytes})")
