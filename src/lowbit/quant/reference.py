"""Reference quantizers: the specification in plain torch (NUMERICS §3). Any device, any shape the scheme takes.

Every GPU kernel is tested bit for bit against these functions, so each one spells out its
operation order (where FP32 rounding could differ, the comment says which order is the rule).

Conventions shared by all schemes:

* A tensor of shape (..., K) is viewed as a 2D matrix (M, K), M = prod(leading dims). The rowwise
  copy quantizes that matrix along K; the columnwise copy quantizes its transpose (K, M) along M.
* ``scale`` multiplies x on the way in; ``scale_inv = 1 / scale`` is stored, so x ≈ q · scale_inv.
* A scaling group whose amax is 0 gets scale 1 (and dequantizes to exact zeros).
* A non-finite amax is never hidden: it is stored in the copy's ``amax`` and flagged by
  :attr:`QuantizedTensor.has_nonfinite_amax`, and its scaling group dequantizes to NaN (a NaN or 0 scale, MXFP8's
  E8M0 NaN, a delayed copy's NaN ``scale_inv``).
"""

from __future__ import annotations

import math

import torch

from ..formats import (
    E4M3,
    FP32_MAX,
    FloatFormat,
    cast_to_format,
    e8m0_encode,
    pack_e2m1,
    unpack_e2m1,
)
from .rht import hadamard_16, rht_blocks, rht_matrix
from .schemes import MXFP8, NVFP4, Float8Blockwise, Float8Rowwise, Float8Tensorwise, Scheme
from .tensor import QuantizedCopy, QuantizedTensor, expand_blocks, pad_to, scale_logical, scale_storage

__all__ = [
    "quantize_reference",
    "validate_quantize_args",
    "resolve_seed",
    "compute_scale",
    "pow2_scale_floor",
    "delayed_scale_inv",
    "amax_of",
    "rht_matrix",
    "rht_blocks",
    "hadamard_16",
]


# ------------------------------------------------------------------------------------------------
# scale math
# ------------------------------------------------------------------------------------------------
def _f32(v: float, like: torch.Tensor) -> torch.Tensor:
    """A float32 0-dim tensor on ``like``'s device. Divide by this, never by a Python float: on CUDA,
    ``tensor / python_float`` is computed as a multiply by the rounded reciprocal, which is not the
    correctly rounded quotient a kernel's ``a / b`` gives."""
    return torch.tensor(v, dtype=torch.float32, device=like.device)


def amax_of(x: torch.Tensor) -> torch.Tensor:
    """float32 (1,) max |x|; NaN if any element is NaN (torch.amax propagates NaN)."""
    if x.numel() == 0:
        return torch.zeros(1, dtype=torch.float32, device=x.device)
    return x.detach().abs().amax().to(torch.float32).reshape(1)


def compute_scale(amax: torch.Tensor, fmax: float, *, pow2: bool = False, eps: float = 0.0) -> torch.Tensor:
    """scale = fmax / max(amax, eps) in float32, with the rules every quantizer shares.

    * amax == 0 (after eps) -> 1;  scale that overflows (tiny amax) -> FP32 max;
    * ``pow2``: round the scale *down* to a power of two (zero its mantissa), so amax · scale ≤ fmax — but never
      below :func:`pow2_scale_floor` (2**(floor(log2 fmax) - 127)), the smallest power of two whose
      dequantized range fmax / scale is finite: an amax above fmax / floor (1.75 · 2**127 for E4M3 and E5M2,
      within 12.5% of the FP32 max) takes the floor, and its largest elements saturate to fmax instead of
      rounding up to 2**128 (Inf) on dequantization;
    * non-finite amax -> NaN scale for NaN amax, 0-free: Inf amax gives scale 0, which the caller's
      sentry reports (the amax is stored).
    """
    a = amax.to(torch.float32)
    if eps > 0:
        a = torch.clamp(a, min=eps)  # NaN stays NaN
    s = torch.tensor(fmax, dtype=torch.float32, device=a.device) / a
    s = torch.where(a == 0, torch.ones_like(s), s)
    s = torch.where(torch.isinf(s), torch.full_like(s, FP32_MAX), s)
    if pow2:
        m, e = torch.frexp(s)  # s = m·2**e, m in [0.5, 1)
        p = torch.ldexp(torch.ones_like(s), (e - 1).to(torch.float32))
        p = torch.clamp(p, min=pow2_scale_floor(fmax))
        s = torch.where(torch.isfinite(s) & (s > 0), p, s)
    return s


def pow2_scale_floor(fmax: float) -> float:
    """The smallest power-of-two scale ``compute_scale(pow2=True)`` returns: 2**(floor(log2 fmax) - 127), so that
    fmax / scale = fmax · 2**(127 - floor(log2 fmax)) < 2**128 stays finite. A power-of-two scale keeps the
    mantissa, so a smaller one would round the top elements of an amax near the FP32 max up to 2**128."""
    return math.ldexp(1.0, math.frexp(fmax)[1] - 1 - 127)


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _block_amax_1d(x2: torch.Tensor, bs: int) -> torch.Tensor:
    """(rows, ceil(cols/bs)) amax of 1 x bs segments; a ragged last segment covers what is left."""
    r, k = x2.shape
    kp = pad_to(k, bs)
    xp = torch.nn.functional.pad(x2.abs().float(), (0, kp - k))
    return xp.reshape(r, kp // bs, bs).amax(dim=-1)


def _block_amax_2d(x2: torch.Tensor, bs: int) -> torch.Tensor:
    """(ceil(rows/bs), ceil(cols/bs)) amax of bs x bs tiles; ragged edge tiles cover what is left."""
    r, k = x2.shape
    rp, kp = pad_to(r, bs), pad_to(k, bs)
    xp = torch.nn.functional.pad(x2.abs().float(), (0, kp - k, 0, rp - r))
    return xp.reshape(rp // bs, bs, kp // bs, bs).amax(dim=(1, 3))


def resolve_seed(scheme, seed, device=None):
    """The stochastic-rounding seed a quantization uses: ``seed``, or for an NVFP4 scheme with stochastic rounding
    and no seed one drawn so that torch.manual_seed makes the run reproducible — from torch's CPU generator as an
    int, or, for a CUDA ``device`` (the Triton kernels), by the CUDA generator as a (1,) int64 device tensor the
    kernel reads: no host round-trip, and CUDA-graph safe (a captured draw yields a fresh key at every replay,
    where a host int would be frozen into the graph)."""
    if isinstance(scheme, NVFP4) and scheme.stochastic_rounding and seed is None:
        if device is not None and torch.device(device).type == "cuda":
            return torch.randint(0, 2**62, (1,), device=device, dtype=torch.int64)
        return int(torch.randint(0, 2**62, (1,)).item())
    return seed


# ------------------------------------------------------------------------------------------------
# per-scheme copy quantizers: each takes the 2D matrix to quantize along its last dim
# ------------------------------------------------------------------------------------------------
def delayed_scale_inv(scale: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """The stored ``scale_inv`` of a copy cast with a given (delayed) scale: ``1 / scale``, or NaN when the copy's
    own amax is non-finite. The cast saturates ±Inf to ±fmax, so without the NaN an Inf would come back as a finite
    fmax / scale; with it the copy dequantizes to NaN, as a current scale (0 for an Inf amax) makes it."""
    si = (1.0 / scale.to(torch.float32)).reshape(1)
    return torch.where(torch.isfinite(amax.reshape(1)), si, torch.full_like(si, float("nan")))


def _copy_tensorwise(x2, fmt: FloatFormat, scale: torch.Tensor | None):
    amax = amax_of(x2)
    s = compute_scale(amax, fmt.max) if scale is None else scale.to(torch.float32).reshape(1)
    data = cast_to_format(x2.float() * s, fmt)
    si = (1.0 / s).reshape(1) if scale is None else delayed_scale_inv(s, amax)
    return QuantizedCopy(data=data, scale_inv=si, amax=amax)


def _copy_rowwise(x2, sch: Float8Rowwise):
    fmt = sch.format
    r = x2.shape[0]
    row_amax = x2.abs().float().amax(dim=1, keepdim=True) if x2.shape[1] else torch.zeros(r, 1, device=x2.device)
    s = compute_scale(row_amax, fmt.max, pow2=sch.pow2)
    data = cast_to_format(x2.float() * s, fmt)
    return QuantizedCopy(data=data, scale_inv=1.0 / s, amax=amax_of(x2))


def _copy_blockwise(x2, sch: Float8Blockwise):
    fmt, bs = sch.format, sch.block_size
    r, k = x2.shape
    if sch.block_dim == 1:
        bamax = _block_amax_1d(x2, bs)
        s = compute_scale(bamax, fmt.max, pow2=sch.pow2, eps=sch.eps)
        se = expand_blocks(s, r, k, 1, bs)
    else:
        bamax = _block_amax_2d(x2, bs)
        s = compute_scale(bamax, fmt.max, pow2=sch.pow2, eps=sch.eps)
        se = expand_blocks(s, r, k, bs, bs)
    data = cast_to_format(x2.float() * se, fmt)
    return QuantizedCopy(data=data, scale_inv=scale_storage(sch, 1.0 / s), amax=amax_of(x2))


def _copy_mxfp8(x2, sch: MXFP8):
    fmt = sch.format
    r, k = x2.shape
    bamax = _block_amax_1d(x2, 32)
    # X = floor(log2(amax)) - emax, from the exponent bits (frexp) so no log2 rounding can move it.
    _, e = torch.frexp(bamax)
    X = (e.to(torch.int32) - 1) - fmt.emax
    X = torch.where(bamax == 0, torch.zeros_like(X), X)
    X = torch.clamp(X, -127, 127)
    code = e8m0_encode(X)
    # A non-finite amax (a NaN or ±Inf in the block) stores the E8M0 NaN: the whole block dequantizes to NaN, as
    # the other schemes' NaN / zero scales make it. Its elements keep the X above (frexp of Inf / NaN: exponent 0).
    code = torch.where(torch.isfinite(bamax), code, torch.full_like(code, 255))
    Xe = X.repeat_interleave(32, dim=1)[:, :k].to(torch.float32)
    data = cast_to_format(torch.ldexp(x2.float(), -Xe), fmt)  # x / 2**X, exact
    return QuantizedCopy(data=data, scale_inv=code, amax=amax_of(x2))


def _nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    S = torch.tensor(448.0 * 6.0, dtype=torch.float32, device=amax.device) / amax
    S = torch.where(amax == 0, torch.ones_like(S), S)
    return torch.where(torch.isinf(S), torch.full_like(S, FP32_MAX), S)


def _copy_nvfp4(x2, sch: NVFP4, *, rht: bool, seed: int, index_base: int):
    r, k = x2.shape
    xf = x2.float()
    if rht:
        xf = rht_blocks(xf, sch.rht_signs)
    amax = amax_of(xf)
    S = _nvfp4_global_scale(amax)
    bamax = _block_amax_2d(xf, 16) if sch.two_d else _block_amax_1d(xf, 16)
    # d = e4m3(clamp(amax_block · (S / 6), 448)): S/6 first, then the product (the kernels use this order).
    # (tensor / tensor: CUDA turns `tensor / python_float` into a multiply by the rounded reciprocal)
    d = cast_to_format(torch.clamp(bamax * (S / _f32(6.0, S)), max=448.0), E4M3)
    df = d.to(torch.float32)
    enc = 1.0 / (df / S)
    enc = torch.where(torch.isinf(enc), torch.full_like(enc, FP32_MAX), enc)
    enc_e = expand_blocks(enc, r, k, 16 if sch.two_d else 1, 16)
    v = torch.clamp(xf * enc_e, -6.0, 6.0)
    rounding = {}
    if sch.stochastic_rounding:
        idx = index_base + torch.arange(r * k, device=x2.device, dtype=torch.int64).reshape(r, k)
        rounding = dict(stochastic=True, seed=seed, index=idx)
    codes = cast_to_format(v, "e2m1", **rounding)
    return QuantizedCopy(data=pack_e2m1(codes), scale_inv=d, amax=amax, global_scale=S, rht=rht)


# ------------------------------------------------------------------------------------------------
# validation and the entry point
# ------------------------------------------------------------------------------------------------
def validate_quantize_args(x: torch.Tensor, scheme: Scheme, rowwise: bool, columnwise: bool, scale) -> None:
    """Raise the error :func:`lowbit.quantize` raises for these arguments, if any (every backend checks them the same
    way; a backend then checks what it implements)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.is_complex() or not x.is_floating_point():
        raise TypeError(f"x: quantizers take float32, bfloat16, float16 or float64 tensors, got {x.dtype}")
    if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):
        raise TypeError(f"x: already an FP8 tensor ({x.dtype}); quantize the high-precision tensor instead")
    if x.dim() == 0:
        raise ValueError(f"x: expected at least 1 dim, got a 0-dim tensor (shape {tuple(x.shape)})")
    if x.numel() == 0:
        raise ValueError(f"x: cannot quantize an empty tensor (shape {tuple(x.shape)})")
    if not (rowwise or columnwise):
        raise ValueError("rowwise/columnwise: at least one copy must be requested, got rowwise=False, columnwise=False")
    if not isinstance(scheme, (Float8Tensorwise, Float8Rowwise, Float8Blockwise, MXFP8, NVFP4)):
        raise TypeError("scheme: expected one of Float8Tensorwise, Float8Rowwise, Float8Blockwise, MXFP8, NVFP4, "
                        f"got {scheme!r}")
    if scale is not None:
        if not isinstance(scheme, Float8Tensorwise):
            raise ValueError(f"scale: a given (delayed) scale only applies to Float8Tensorwise, got scheme {scheme!r}")
        if not isinstance(scale, torch.Tensor) or scale.numel() != 1:
            raise ValueError(f"scale: expected a float32 tensor with one element, got {scale!r}")
        if scale.dtype != torch.float32:
            raise TypeError(f"scale: expected a float32 tensor with one element (the delayed scale), got {scale.dtype}")
        if scale.device != x.device:
            raise ValueError(f"scale: must be on the same device as x ({x.device}), got {scale.device}")
        if scale.device.type == "cpu":
            # The value is checked where reading it is free. On a GPU that would synchronize the device (and break
            # CUDA-graph capture), so it is not read there: lowbit's own delayed scales come from
            # AmaxHistory.update_scale, which only ever holds finite scales > 0 (the first one is 1).
            v = float(scale.reshape(()))
            if not (v > 0.0 and v != float("inf")):
                raise ValueError(f"scale: a delayed scale must be finite and > 0 (x is multiplied by it), got {v}")
    M = x.numel() // x.shape[-1]
    K = x.shape[-1]
    if isinstance(scheme, MXFP8):
        if rowwise and K % 32:
            raise ValueError(f"x: MXFP8 rowwise needs the last dim divisible by 32, got shape {tuple(x.shape)} "
                             f"(last dim {K})")
        if columnwise and M % 32:
            raise ValueError(
                "x: MXFP8 columnwise needs the product of the leading dims divisible by 32, got shape "
                f"{tuple(x.shape)} (rows {M})"
            )
    if isinstance(scheme, NVFP4):
        if K % 16:
            raise ValueError(f"x: NVFP4 needs the last dim divisible by 16, got shape {tuple(x.shape)} (last dim {K})")
        if (columnwise or scheme.two_d) and M % 16:
            raise ValueError(
                f"x: NVFP4 {'16x16 tiles' if scheme.two_d else 'columnwise'} need the product of the leading dims "
                f"divisible by 16, got shape {tuple(x.shape)} (rows {M})"
            )


def quantize_reference(
    x: torch.Tensor,
    scheme: Scheme,
    *,
    rowwise: bool = True,
    columnwise: bool = False,
    scale: torch.Tensor | None = None,
    seed: int | None = None,
) -> QuantizedTensor:
    """Quantize ``x`` with ``scheme`` in plain torch. See :func:`lowbit.quantize` for the arguments."""
    validate_quantize_args(x, scheme, rowwise, columnwise, scale)
    x2 = _as_2d(x.detach())
    qt = QuantizedTensor(shape=x.shape, dtype=x.dtype, scheme=scheme)
    seed = qt.meta["seed"] = resolve_seed(scheme, seed)

    if isinstance(scheme, Float8Tensorwise):
        row = _copy_tensorwise(x2, scheme.format, scale)
        qt.rowwise = row if rowwise else None
        if columnwise:  # same scale, transposed data: one scale per tensor commutes with the transpose
            qt.columnwise = QuantizedCopy(data=row.data.t().contiguous(), scale_inv=row.scale_inv.clone(),
                                          amax=row.amax.clone())
        return qt
    if isinstance(scheme, Float8Blockwise) and scheme.block_dim == 2 or isinstance(scheme, NVFP4) and scheme.two_d:
        # Square tiles are symmetric under transpose: the columnwise copy is the transposed data and scale grid.
        row = _copy_blockwise(x2, scheme) if isinstance(scheme, Float8Blockwise) else _copy_nvfp4(x2, scheme, rht=False,
                                                                                                  seed=seed or 0,
                                                                                                  index_base=0)
        qt.rowwise = row if rowwise else None
        if columnwise:
            if isinstance(scheme, NVFP4):
                cdata = pack_e2m1(unpack_e2m1(row.data).t().contiguous())
                cscale = row.scale_inv.t().contiguous()
            else:
                cdata = row.data.t().contiguous()
                logical = scale_logical(scheme, row.scale_inv, *x2.shape)
                cscale = scale_storage(scheme, logical.t().contiguous())
            qt.columnwise = QuantizedCopy(data=cdata, scale_inv=cscale, amax=row.amax.clone(),
                                          global_scale=row.global_scale)
        return qt

    def one(m2, which):
        if isinstance(scheme, Float8Rowwise):
            return _copy_rowwise(m2, scheme)
        if isinstance(scheme, Float8Blockwise):
            return _copy_blockwise(m2, scheme)
        if isinstance(scheme, MXFP8):
            return _copy_mxfp8(m2, scheme)
        # NVFP4 1x16: disjoint Philox counters for the two copies (rowwise 0..n-1, columnwise n..2n-1)
        col = which == "columnwise"
        return _copy_nvfp4(m2, scheme, rht=col and scheme.rht, seed=seed or 0, index_base=m2.numel() if col else 0)

    if rowwise:
        qt.rowwise = one(x2, "rowwise")
    if columnwise:
        qt.columnwise = one(x2.t().contiguous(), "columnwise")  # the copy is stored K-contiguous (NUMERICS §4)
    return qt
