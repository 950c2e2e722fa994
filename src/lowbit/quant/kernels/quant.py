"""Triton quantization kernels (NUMERICS §2-§4). Launchers live in :mod:`lowbit.quant.triton_backend`.

Every kernel reproduces :mod:`lowbit.quant.reference` bit for bit:

* amax is a max over the int32 bit patterns of |x| (sign bit cleared): for non-negative floats the
  integer order is the float order, and a NaN (0x7F8xxxxx+) dominates every finite value and Inf,
  so the amax propagates NaN exactly as ``torch.amax`` does. Tile maxima meet through an int32
  ``atomic_max`` with ``sem="relaxed"``: no kernel reads the amax it is accumulating (only later launches and
  the host do), so Triton's default acq_rel — a GPU-scope fence waiting for every earlier store of the
  program — buys nothing (the same change cut most of the attention backward's FP8-epilogue cost).
* divisions are ``div_rn`` (IEEE round-to-nearest, as torch's tensor/tensor division); products are
  single FP32 multiplies, in the reference's order.
* float casts: saturating round-to-nearest-even. On the GPU (``SW=False``) FP8 uses the hardware
  conversion (``cvt.rn.satfinite``) after a NaN-preserving clamp to ±fmax; with ``SW=True`` (Triton's
  interpreter, whose float->fp8 conversion is not exact) the value is first rounded onto the grid in
  integer/FP32 arithmetic that mirrors :func:`lowbit.formats.round_to_format`, after which the cast is
  exact. E2M1 (no Hopper instruction) always uses the software path; stochastic rounding draws
  ``tl.randint(seed, index)`` with the reference's counter convention.
* offsets are int64.

Fused-prologue API (used by lowbit.ops and lowbit.optim): the ``@triton.jit`` helpers below are the scale and cast
rules every quantizer shares; a kernel that quantizes its own values (a fused prologue, the AdamW step writing FP8
weight copies, the Gluon quantizers) calls them, so its bits are the quantizers' own.

* :func:`sigmoid`: sigmoid of FP32 values as the SwiGLU kernels compute it (MUFU exp2 and reciprocal);
* :func:`abs_bits`: the int32 bit pattern of |x|, ordered like |x| (the amax reductions);
* :func:`bits_to_f32`: int32 bits back to FP32;
* :func:`compute_scale`: ``reference.compute_scale`` (fmax / amax, pow2, eps) from an FP32 amax;
* :func:`recip`: the stored ``scale_inv = 1 / scale``, exact for power-of-two scales;
* :func:`fp8_prep`: an FP32 value ready for the FP8 cast (on-grid in the interpreter, else clamped);
* :func:`fp8_cast`: the FP8 cast itself (no clamp where the hardware's satfinite conversion clamps);
* :func:`rowcol_tile_1d`: both 1x128 copies of one whole tile held in registers;
* :func:`mx_exponent`: MXFP8's shared exponent and E8M0 code from a block maximum's bits.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...runtime.device import INTERPRET

__all__ = ["sigmoid", "abs_bits", "bits_to_f32", "compute_scale", "recip", "fp8_prep", "fp8_cast", "rowcol_tile_1d",
           "mx_exponent", "amax_kernel", "amax_rht_kernel", "tensorwise_kernel", "rowscale_kernel", "blockwise_kernel",
           "blockwise_persistent_kernel", "mxfp8_kernel", "nvfp4_kernel"]

FP32_MAX = tl.constexpr(3.4028234663852886e38)
# sigmoid by PTX inline asm where the kernel is compiled; plain Triton ops where Triton's interpreter runs it (no
# asm there).
_FAST_SIGMOID = tl.constexpr(not INTERPRET)
# 1.5 * 2**23: (t + MAGIC) - MAGIC rounds 0 <= t < 2**22 to the nearest integer, ties to even
MAGIC_RNE = tl.constexpr(12582912.0)


@triton.jit
def sigmoid(a):
    """sigmoid(a) = 1 / (1 + exp(-a)) of FP32 a, as the SwiGLU kernels and their fused quantizers compute it (one
    place, so that the fused kernels reproduce the unfused ones bit for bit): the hardware's approximate exp2 and
    reciprocal (MUFU.EX2, MUFU.RCP) on 2^(-a·log2 e), with subnormal inputs and results flushed to zero (``.ftz``).
    Triton's ``1.0 / (1.0 + tl.exp(-a))`` compiles to the same two MUFU operations plus a negation and the
    non-ftz fix-ups around each (range tests and rescaling multiplies, ~8 instructions an element on sm_90), which
    made the fused SwiGLU-backward quantizer issue-bound. The values differ from that form only where
    1 + exp(-a) > 2^126 (a < -87.3): there the reciprocal flushes to 0 instead of a number below 2^-126. Under
    Triton's interpreter: ``1.0 / (1.0 + tl.exp(-a))``."""
    if _FAST_SIGMOID:
        e = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [a * -1.4426950408889634],
                                      dtype=tl.float32, is_pure=True, pack=1)
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [1.0 + e], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return 1.0 / (1.0 + tl.exp(-a))


@triton.jit
def abs_bits(x):
    """int32 bit pattern of |x| (x float32): ordered like |x|, NaN above +Inf."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def bits_to_f32(b):
    return b.to(tl.float32, bitcast=True)


@triton.jit
def compute_scale(a, FMAX: tl.constexpr, POW2: tl.constexpr, EPS: tl.constexpr):
    """reference.compute_scale: fmax / max(amax, eps); 0 -> 1; overflow -> FP32 max; pow2 rounds down; NaN stays.

    POW2 (FMAX >= 4) takes no division: see _pow2_scale."""
    if EPS > 0:
        a = tl.where(a != a, a, tl.maximum(a, EPS))
    if POW2 and FMAX >= 4.0:
        s = _pow2_scale(a, FMAX)
    else:
        s = tl.math.div_rn(tl.cast(FMAX, tl.float32), a)
        s = tl.where(a == 0, 1.0, s)
        s = tl.where(s == float("inf"), FP32_MAX, s)
        if POW2:
            pb = s.to(tl.int32, bitcast=True) & 0x7F800000
            # not below 2**(floor(log2 FMAX) - 127) (reference.pow2_scale_floor; FMAX >= 2 here keeps it normal)
            fe = (tl.cast(FMAX, tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF
            p = bits_to_f32(tl.maximum(pb, (fe - 127) << 23))
            s = tl.where((s == s) & (s > 0), p, s)  # finite positive s: zero the mantissa; 0 and NaN unchanged
    return s


@triton.jit
def _pow2_scale(a, FMAX: tl.constexpr):
    """The power-of-two scale 2**E of reference.compute_scale(pow2=True): the exponent of RN(FMAX / a), from bits.

    With a = ma * 2**ea and FMAX = mf * 2**ef (ma, mf in [1, 2)), FMAX / a = (mf / ma) * 2**(ef - ea) and
    mf / ma lies in (mf / 2, 2): its exponent is ef - ea if ma <= mf, else ef - ea - 1 — and round-to-nearest cannot
    carry it up to the next power of two there, since the float after mf exceeds mf / (1 - 2**-25), the largest ma
    whose quotient would round up. E >= 128 is the quotient's overflow to inf, FP32 max, 2**127 (subnormal a lands
    there too: its biased exponent is 0). E is at least ef - 127 (reference.pow2_scale_floor: the one finite amax
    range whose E would be ef - 128, above 1.75 · 2**127 for FMAX = 1.75 · 2**ef, would dequantize to Inf), so for
    FMAX >= 4 it stays normal. a = 0 -> 1, Inf -> 0, NaN -> NaN, as the reference. A division costs a slow-path
    call whose register convention raised the 1x128 quantizers' registers from ~60 to 160+ (Triton 3.6, sm_90)."""
    b = a.to(tl.int32, bitcast=True)
    fb = tl.cast(FMAX, tl.float32).to(tl.int32, bitcast=True)
    fbe = (fb >> 23) & 0xFF  # biased: ef + 127
    e = fbe - ((b >> 23) & 0xFF) - ((b & 0x7FFFFF) > (fb & 0x7FFFFF)).to(tl.int32)
    s = bits_to_f32((tl.minimum(tl.maximum(e, fbe - 254), 127) + 127) << 23)
    s = tl.where(a == 0, 1.0, s)
    s = tl.where(a == float("inf"), 0.0, s)
    return tl.where(a != a, a, s)


@triton.jit
def recip(s, POW2: tl.constexpr = False, FMAX: tl.constexpr = 0.0):
    """1 / s rounded to nearest. With the POW2 and FMAX that compute_scale made s with, FMAX >= 4 (so s is 2**E
    with -126 <= E <= 127, or 1, 0, NaN): exact from the bits, no division (2**127 -> 2**-127, a subnormal;
    0 -> Inf)."""
    if POW2 and FMAX >= 4.0:
        r = bits_to_f32((254 << 23) - s.to(tl.int32, bitcast=True))
        r = tl.where(s == 1.7014118346046923e38, 5.877471754111438e-39, r)  # 2**127 -> 2**-127
        r = tl.where(s == 0, float("inf"), r)
        return tl.where(s != s, s, r)
    else:
        return tl.math.div_rn(tl.cast(1.0, tl.float32), s)


@triton.jit
def _round_sw(v, u, FMAX: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr, SR: tl.constexpr):
    """formats.round_to_format in FP32 arithmetic: returns v rounded onto the format grid (saturated, NaN kept).

    ``u``: uniform [0, 1) numbers for stochastic rounding (ignored unless SR).
    """
    a = tl.abs(v)
    a = tl.where(a > FMAX, FMAX, a)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2 a) for normal a
    e = tl.maximum(e, EMIN)
    qe = e - MBITS
    quantum = bits_to_f32((qe + 127) << 23)
    inv_q = bits_to_f32((127 - qe) << 23)
    t = a * inv_q  # exact
    if SR:
        fl = tl.floor(t)
        n = fl + tl.where(u < (t - fl), 1.0, 0.0)
    else:
        n = (t + MAGIC_RNE) - MAGIC_RNE
    r = tl.minimum(n * quantum, FMAX)
    sign = v.to(tl.int32, bitcast=True) & -2147483648
    r = bits_to_f32(r.to(tl.int32, bitcast=True) | sign)
    return tl.where(v != v, v, r)


@triton.jit
def fp8_prep(v, FMAX: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr, SW: tl.constexpr):
    """FP32 value ready for ``.to(fp8)``: on-grid (SW) or clamped to ±fmax with NaN kept (hardware satfinite RNE)."""
    if SW:
        return _round_sw(v, v, FMAX, EMIN, MBITS, False)
    else:
        return tl.where(v != v, v, tl.minimum(tl.maximum(v, -FMAX), FMAX))


@triton.jit
def fp8_cast(v, dtype: tl.constexpr, FMAX: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr, SW: tl.constexpr,
             SATCVT: tl.constexpr):
    """v cast to FP8 ``dtype`` as ``fp8_prep(v).to(dtype)``. SATCVT (host: sm_89+, where Triton emits
    ``cvt.rn.satfinite``, which already sends ±Inf and |v| > fmax to ±fmax and keeps NaN): no clamp first."""
    if SATCVT and not SW:
        return v.to(dtype)
    else:
        return fp8_prep(v, FMAX, EMIN, MBITS, SW).to(dtype)


@triton.jit
def _uniform(seed, idx):
    """formats.philox_uniform: (philox(seed, idx)[0] >> 8) * 2**-24."""
    r = tl.randint(seed, idx)
    r = r.to(tl.uint32, bitcast=True) >> 8
    return r.to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def _e2m1_codes(r):
    """uint8 E2M1 codes of on-grid values (formats.e2m1_encode): NaN -> +0, -0 keeps its sign bit."""
    a = tl.abs(r)
    a = tl.where(r != r, 0.0, a)
    idx = tl.where(a < 2.0, a * 2.0, tl.where(a < 4.0, a + 2.0, tl.where(a < 6.0, 6.0, 7.0)))
    neg = (r.to(tl.int32, bitcast=True) < 0) & (r == r)
    return (idx.to(tl.int32) | tl.where(neg, 8, 0)).to(tl.uint8)


@triton.jit
def _pack_pairs(codes, R: tl.constexpr, C: tl.constexpr):
    """(R, C) uint8 codes -> (R, C/2) bytes: element 2i in the low nibble, 2i+1 in the high."""
    lo, hi = tl.split(tl.reshape(codes, (R, C // 2, 2)))
    return lo | (hi << 4)


# ------------------------------------------------------------------------------------------------
# amax of a whole tensor (per-tensor current scaling, NVFP4 global scale)
# ------------------------------------------------------------------------------------------------
@triton.jit
def amax_kernel(x_ptr, amax_ptr, N, BLOCK: tl.constexpr):
    """amax_ptr (int32 bits, pre-zeroed) = max |x| over the flat contiguous x of N elements."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < N, other=0.0).to(tl.float32)
    tl.atomic_max(amax_ptr, tl.max(abs_bits(x), axis=0), sem="relaxed")


# ------------------------------------------------------------------------------------------------
# Random Hadamard Transform along M (NVFP4 columnwise copy), in registers
# ------------------------------------------------------------------------------------------------
# reference.rht_blocks is the spec: v * s (s = ±1), then stages h = 1, 2, 4, 8 of (a + b, a - b) on pairs
# (j, j + h) inside groups of 2h, then * 0.25, all FP32. A float result depends only on its operands, so
# doing those same adds on the same operands (in any schedule) gives the reference's bits. Each of the 16
# rows of a group is loaded as its own (G, BK) vector: the butterfly is then straight-line adds between
# registers of one thread (no layout shuffles), and a final join stacks the rows in-thread as (G, BK, 16).
@triton.jit
def _rht_row(x_ptr, rows, offs_k, K, mask, signs, J: tl.constexpr):
    """Row J of every 16-row group (rows: the groups' first rows, int64), FP32, times its sign s_J (exact)."""
    s = 1.0 - 2.0 * ((signs >> J) & 1).to(tl.float32)
    v = tl.load(x_ptr + (rows[:, None] + J) * K + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    return v, v * s


@triton.jit
def _fwht4(a, b, c, d):
    """Two butterfly stages on the vectors at positions j, j + h, j + 2h, j + 3h: stage h pairs (a, b) and
    (c, d), stage 2h pairs the results (a, c) and (b, d). Returns the new values of the same positions."""
    a, b = a + b, a - b
    c, d = c + d, c - d
    return a + c, b + d, a - c, b - d


@triton.jit
def _join4(a, b, c, d):
    """(..., 2, 2) whose row-major flattening is a, b, c, d: tl.join adds its selector as the *last* axis."""
    return tl.join(tl.join(a, c), tl.join(b, d))


@triton.jit
def _rht_tile(x_ptr, rows, offs_k, K, mask, signs, G: tl.constexpr, BK: tl.constexpr):
    """x[rows + j, offs_k] for j < 16 as (G, BK, 16) FP32, raw and RHT'd along j (reference.rht_blocks' bits)."""
    x0, y0 = _rht_row(x_ptr, rows, offs_k, K, mask, signs, 0)
    x1, y1 = _rht_row(x_ptr, rows, offs_k, K, mask, signs, 1)
    x2, y2 = _rht_row(x_ptr, rows, offs_k, K, mask, signs, 2)
    x3, y3 = _rht_row(x_ptr, rows, offs_k, K, mask, signs, 3)
    x4, y4 = _rht_row(x_ptr, rows, offs_k, K, mask, signs, 4)
    x5, y5 = _rht_row(x_ptr, rows, offs_k, K, mask, signs, 5)
    x6, y6 = _rht_row(x_ptr, rows, offs_k, K, mask, signs, 6)
    x7, y7 = _rht_row(x_ptr, rows, offs_k, K, mask, signs, 7)
    x8, y8 = _rht_row(x_ptr, rows, offs_k, K, mask, signs, 8)
    x9, y9 = _rht_row(x_ptr, rows, offs_k, K, mask, signs, 9)
    x10, y10 = _rht_row(x_ptr, rows, offs_k, K, mask, signs, 10)
    x11, y11 = _rht_row(x_ptr, rows, offs_k, K, mask, signs, 11)
    x12, y12 = _rht_row(x_ptr, rows, offs_k, K, mask, signs, 12)
    x13, y13 = _rht_row(x_ptr, rows, offs_k, K, mask, signs, 13)
    x14, y14 = _rht_row(x_ptr, rows, offs_k, K, mask, signs, 14)
    x15, y15 = _rht_row(x_ptr, rows, offs_k, K, mask, signs, 15)
    # stages h = 1, 2 inside each group of 4 rows
    y0, y1, y2, y3 = _fwht4(y0, y1, y2, y3)
    y4, y5, y6, y7 = _fwht4(y4, y5, y6, y7)
    y8, y9, y10, y11 = _fwht4(y8, y9, y10, y11)
    y12, y13, y14, y15 = _fwht4(y12, y13, y14, y15)
    # stages h = 4, 8 across the groups of 4
    y0, y4, y8, y12 = _fwht4(y0, y4, y8, y12)
    y1, y5, y9, y13 = _fwht4(y1, y5, y9, y13)
    y2, y6, y10, y14 = _fwht4(y2, y6, y10, y14)
    y3, y7, y11, y15 = _fwht4(y3, y7, y11, y15)
    # (.., t, i) = row 4t + i: inner joins stack rows i, i+4, i+8, i+12, the outer one the four i
    y = _join4(_join4(y0, y4, y8, y12), _join4(y1, y5, y9, y13), _join4(y2, y6, y10, y14), _join4(y3, y7, y11, y15))
    x = _join4(_join4(x0, x4, x8, x12), _join4(x1, x5, x9, x13), _join4(x2, x6, x10, x14), _join4(x3, x7, x11, x15))
    return tl.reshape(x, (G, BK, 16)), tl.reshape(y, (G, BK, 16)) * 0.25


@triton.jit
def _rht_rows_mask(M, K, pid_m, pid_k, BM: tl.constexpr, BK: tl.constexpr):
    """(rows, offs_k, mask) of an RHT tile: the first rows of its BM // 16 groups (int64), its columns, and
    the (group, column) mask (M % 16 == 0: a group lies wholly inside x or wholly outside)."""
    rows = pid_m * BM + tl.arange(0, BM // 16).to(tl.int64) * 16
    offs_k = pid_k * BK + tl.arange(0, BK)
    return rows, offs_k, (rows[:, None] < M) & (offs_k[None, :] < K)


@triton.jit
def amax_rht_kernel(x_ptr, amax_rht_ptr, amax_ptr, M, K, signs, PLAIN: tl.constexpr, BM: tl.constexpr,
                    BK: tl.constexpr):
    """amax_rht_ptr (int32 bits, pre-zeroed) = max |RHT(x)| for x (M, K) contiguous, M % 16 == 0, the RHT
    along M in 16-row groups of each column; RHT(x) is never written out. PLAIN: amax_ptr = max |x| as well,
    from the same read (the rowwise copy's amax)."""
    pid_m = tl.program_id(0).to(tl.int64)
    pid_k = tl.program_id(1).to(tl.int64)
    rows, offs_k, mask = _rht_rows_mask(M, K, pid_m, pid_k, BM, BK)
    x, y = _rht_tile(x_ptr, rows, offs_k, K, mask, signs, BM // 16, BK)
    tl.atomic_max(amax_rht_ptr, tl.max(tl.max(tl.max(abs_bits(y), axis=2), axis=1), axis=0), sem="relaxed")
    if PLAIN:
        tl.atomic_max(amax_ptr, tl.max(tl.max(tl.max(abs_bits(x), axis=2), axis=1), axis=0), sem="relaxed")


# ------------------------------------------------------------------------------------------------
# per-tensor (current or delayed): one scale, rowwise and/or transposed copy from one read
# ------------------------------------------------------------------------------------------------
@triton.jit
def tensorwise_kernel(x_ptr, rq_ptr, cq_ptr, scale_ptr, amax_ptr, si_ptr, M, K,
                      FMAX: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr,
                      DELAYED: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr, SW: tl.constexpr,
                      BM: tl.constexpr, BK: tl.constexpr):
    """Cast x (M, K) with one scale. DELAYED: scale read from scale_ptr (fp32) and the amax is recorded
    here; else the scale comes from the amax already in amax_ptr (reference.compute_scale).

    si_ptr: the int32 bits of scale_inv, zeroed by the host. DELAYED: 1 / scale OR'd with the NaN bits by every
    program whose tile holds a NaN or Inf (in any order: an OR loses nothing), so a copy whose amax is non-finite
    dequantizes to NaN (reference.delayed_scale_inv)."""
    pid_m = tl.program_id(0).to(tl.int64)
    pid_k = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_k = pid_k * BK + tl.arange(0, BK)
    mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    first = (pid_m == 0) & (pid_k == 0)
    if DELAYED:
        s = tl.load(scale_ptr)
        tmax = tl.max(tl.max(abs_bits(x), axis=1), axis=0)
        tl.atomic_max(amax_ptr, tmax, sem="relaxed")
        bad = tmax >= 0x7F800000
        if first | bad:
            bits = tl.where(first, recip(s, False, FMAX).to(tl.int32, bitcast=True), 0)
            tl.atomic_or(si_ptr, tl.where(bad, bits | 0x7FC00000, bits), sem="relaxed")
    else:
        a = bits_to_f32(tl.load(amax_ptr))
        s = compute_scale(a, FMAX, False, 0.0)
        if first:
            tl.store(si_ptr, recip(s, False, FMAX).to(tl.int32, bitcast=True))
    q = fp8_prep(x * s, FMAX, EMIN, MBITS, SW)
    if ROW:
        tl.store(rq_ptr + offs_m[:, None] * K + offs_k[None, :], q.to(rq_ptr.dtype.element_ty), mask=mask)
    if COL:
        qt = tl.trans(q)
        tl.store(cq_ptr + offs_k[:, None] * M + offs_m[None, :], qt.to(cq_ptr.dtype.element_ty), mask=tl.trans(mask))


# ------------------------------------------------------------------------------------------------
# per-row scales (Float8Rowwise): a copy's rows are read along their length twice (amax, then cast)
# ------------------------------------------------------------------------------------------------
@triton.jit
def rowscale_kernel(x_ptr, q_ptr, si_ptr, amax_ptr, R, C, stride_r, stride_c,
                    FMAX: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr, POW2: tl.constexpr,
                    SW: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """Copy (R, C) of x read through strides (stride_r, stride_c); one scale per copy row; q (R, C) row-major."""
    pid = tl.program_id(0).to(tl.int64)
    offs_r = pid * BR + tl.arange(0, BR)
    rmask = offs_r < R
    amax = tl.zeros((BR,), dtype=tl.int32)
    for c0 in range(0, C, BC):
        offs_c = c0 + tl.arange(0, BC).to(tl.int64)
        mask = rmask[:, None] & (offs_c[None, :] < C)
        x = tl.load(x_ptr + offs_r[:, None] * stride_r + offs_c[None, :] * stride_c, mask=mask,
                    other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(abs_bits(x), axis=1))
    tl.atomic_max(amax_ptr, tl.max(amax, axis=0), sem="relaxed")
    s = compute_scale(bits_to_f32(amax), FMAX, POW2, 0.0)
    tl.store(si_ptr + offs_r, recip(s, POW2, FMAX), mask=rmask)
    for c0 in range(0, C, BC):
        offs_c = c0 + tl.arange(0, BC).to(tl.int64)
        mask = rmask[:, None] & (offs_c[None, :] < C)
        x = tl.load(x_ptr + offs_r[:, None] * stride_r + offs_c[None, :] * stride_c, mask=mask,
                    other=0.0).to(tl.float32)
        q = fp8_prep(x * s[:, None], FMAX, EMIN, MBITS, SW)
        tl.store(q_ptr + offs_r[:, None] * C + offs_c[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------------
# blockwise 1xBS / BSxBS (DeepSeek-V3): fused rowwise + columnwise from one read of each tile
# ------------------------------------------------------------------------------------------------
@triton.jit
def _tile_offsets(r, c, ld, WIDE: tl.constexpr):
    """Element offsets r * ld + c inside a tile. Tile bases are int64 pointers; in-tile offsets fit int32
    unless a tile spans >= 2**31 elements of the array (WIDE, chosen on the host from the shape)."""
    if WIDE:
        return r.to(tl.int64)[:, None] * ld + c.to(tl.int64)[None, :]
    else:
        return r[:, None] * ld + c[None, :]


@triton.jit
def _tile_load(ptr, r, c, ld, nr, nc, EVEN: tl.constexpr, WIDE: tl.constexpr):
    """FP32 tile (r, c) of the row-major array at ptr (leading dimension ld); 0 at r >= nr or c >= nc."""
    ptrs = ptr + _tile_offsets(r, c, ld, WIDE)
    if EVEN:
        v = tl.load(ptrs)
    else:
        v = tl.load(ptrs, mask=(r[:, None] < nr) & (c[None, :] < nc), other=0.0)
    return v.to(tl.float32)


@triton.jit
def _tile_store(ptr, r, c, ld, nr, nc, v, EVEN: tl.constexpr, WIDE: tl.constexpr):
    ptrs = ptr + _tile_offsets(r, c, ld, WIDE)
    if EVEN:
        tl.store(ptrs, v)
    else:
        tl.store(ptrs, v, mask=(r[:, None] < nr) & (c[None, :] < nc))


@triton.jit
def _norm_rows(x, rstd_b, r, nm, nw, EVEN: tl.constexpr):
    """(x * rstd[r]) * w: the RMSNorm output of an FP32 slab (rows r of a tile whose rstd starts at rstd_b)."""
    if EVEN:
        rs = tl.load(rstd_b + r)
    else:
        rs = tl.load(rstd_b + r, mask=r < nm, other=0.0)
    return (x * rs[:, None]) * nw[None, :]


@triton.jit
def _vec_store(ptr, offs, n, v, EVEN: tl.constexpr):
    if EVEN:
        tl.store(ptr + offs, v)
    else:
        tl.store(ptr + offs, v, mask=offs < n)


@triton.jit
def _rows_1d(x, row_max, rsb, rqb, r, ck, K, nm, nk, FMAX: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr,
             POW2: tl.constexpr, EPS: tl.constexpr, SW: tl.constexpr, SATCVT: tl.constexpr, DT: tl.constexpr,
             EVEN: tl.constexpr, WIDE: tl.constexpr):
    """The rowwise 1xBS copy of slab x (rows r of a tile; row_max its rows' |x| maxima as int32 bits): scale_inv at
    rsb[r], FP8 data at rqb (leading dimension K)."""
    sr = compute_scale(bits_to_f32(row_max), FMAX, POW2, EPS)
    _vec_store(rsb, r, nm, recip(sr, POW2, FMAX), EVEN)
    _tile_store(rqb, r, ck, K, nm, nk, fp8_cast(x * sr[:, None], DT, FMAX, EMIN, MBITS, SW, SATCVT), EVEN, WIDE)


@triton.jit
def _amax_out(amax_ptr, a, EACH: tl.constexpr):
    """A program's amax bits ``a``: max-accumulated at amax_ptr, or (EACH) stored at amax_ptr[linear program id]."""
    if EACH:
        pid = tl.program_id(0).to(tl.int64) + tl.program_id(1).to(tl.int64) * tl.num_programs(0)
        tl.store(amax_ptr + pid, a)
    else:
        tl.atomic_max(amax_ptr, a, sem="relaxed")


@triton.jit
def blockwise_kernel(x_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr, amax_ptr, M, K, rs_ld, cs_ld,
                     FMAX: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr, POW2: tl.constexpr,
                     EPS: tl.constexpr, TWO_D: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr,
                     SW: tl.constexpr, BM: tl.constexpr, BS: tl.constexpr,
                     SLAB: tl.constexpr = 0, EVEN: tl.constexpr = False, WIDE: tl.constexpr = True,
                     SATCVT: tl.constexpr = False, SCR: tl.constexpr = False, UNROLL: tl.constexpr = 1,
                     KMAJOR: tl.constexpr = False, NORM: tl.constexpr = False, SLAB2: tl.constexpr = 0,
                     ROW2: tl.constexpr = False, AMAX_EACH: tl.constexpr = False, abs_mask=0x7FFFFFFF,
                     rstd_ptr=None, nw_ptr=None):
    """x (M, K) contiguous; a tile is BM rows x BS cols (BM == BS for the columnwise copy and for 2D tiles).

    1D rowwise scales: rs[kb, m] (ld rs_ld = pad4(M)); 1D columnwise: cs[mb, k] (ld pad4(K)).
    2D: rs[mb, kb] (ld pad4(cdiv(K, BS))), columnwise grid transposed cs[kb, mb] (ld pad4(cdiv(M, BS))).
    Stored values are scale_inv = 1 / scale.

    One program a tile: grid (cdiv(M, BM), cdiv(K, BS)), or with KMAJOR (cdiv(K, BS), cdiv(M, BM)), so that
    consecutive programs read neighbouring column tiles of the same rows, which DRAM serves better than
    tiles BM rows apart (rowwise only: ~5%).

    SLAB = 0: the whole tile is loaded once and held in registers (FP32: ~170 registers a thread for
    128x128 at 8 warps, so one CTA an SM and nothing in flight while it computes): small blocks, short
    rowwise-only inputs, and 2D from FP32 (see blockwise_configs). The transposed copy is cast in its
    own (transposed) layout, as the original single-pass kernel did.
    SLAB > 0: the tile is walked in SLAB x BS row slabs, twice. Walk 1 makes the rowwise copy (a row's
    scale needs only its BS values) and keeps an elementwise running max for the column / tile amax;
    walk 2 re-reads the slabs (just brought into L1/L2 by walk 1: DRAM still sees one read) and makes the
    columnwise copy (2D: both copies). Few registers a CTA, so several CTAs an SM keep loads in flight.
    UNROLL: the walks' unroll factor (their loads in flight together).
    SCR: the column scales are computed one column a thread: the column maxima are parked in the cs row
    (global, this tile's own) and read back, since in the slab layout every thread holds 16 columns and
    would do the two divisions for each.
    EVEN: M % BM == 0 and K % BS == 0, no bounds masks. WIDE: in-tile offsets in int64 (see _tile_offsets).
    SATCVT: see fp8_cast. abs_mask: 0x7FFFFFFF, passed at run time so that the compiler cannot see
    "bits & 0x7FFFFFFF" as fabs: fused with the bf16->fp32 conversion, ptxas may then compute |x| with a
    half-precision FMA, which replaces a NaN's payload (the amax bits would change).
    SLAB2: walk 2's slab height (0: SLAB). 128 rows give 128-byte pieces of each row of the transposed copy.
    ROW2 (1D, both copies; ignored otherwise): the rowwise copy is made in walk 2 from the slab loaded for the
    columnwise one, so that walk 1 only loads and takes maxima.
    NORM (slab walk only): quantize the RMSNorm output y = (x * rstd[m]) * w[k] (FP32, the same two products in
    both walks) instead of x: rstd_ptr (M,) FP32, nw_ptr (K,) FP32 norm weight (lowbit.ops.norm_quant).
    AMAX_EACH: each program stores its tile's amax bits at amax_ptr[its linear program id] (no pre-zeroed
    accumulator, so no fill launch before the kernel; the tensor amax is their max) instead of an atomic max.
    """
    tl.static_assert(not NORM or SLAB > 0, "NORM needs the slab walk")
    S2: tl.constexpr = SLAB2 if SLAB2 > 0 else SLAB
    R2: tl.constexpr = ROW2 and ROW and COL and not TWO_D  # (a ROW2 config given one copy runs as without it)
    DT: tl.constexpr = rq_ptr.dtype.element_ty  # rq and cq share the FP8 format
    pid_m = tl.program_id(1 if KMAJOR else 0).to(tl.int64)
    pid_k = tl.program_id(0 if KMAJOR else 1).to(tl.int64)
    m0 = pid_m * BM
    k0 = pid_k * BS
    nm = tl.minimum(M - m0, BM).to(tl.int32)  # rows / cols of this tile inside x
    nk = tl.minimum(K - k0, BS).to(tl.int32)
    xb = x_ptr + (m0 * K + k0)
    rqb = rq_ptr + (m0 * K + k0)
    cqb = cq_ptr + (k0 * M + m0)
    ck = tl.arange(0, BS)
    if SLAB == 0:
        # The whole tile held at once: exactly the original single-pass kernel (bit-identical to the reference for
        # every dtype and scheme, incl. 2D from FP32, which the slab walk does not match).
        offs_m = m0 + tl.arange(0, BM)
        offs_k = k0 + tl.arange(0, BS)
        mmask = offs_m < M
        kmask = offs_k < K
        mask = mmask[:, None] & kmask[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        ab = abs_bits(x)
        row_max = tl.max(ab, axis=1)
        _amax_out(amax_ptr, tl.max(row_max, axis=0), AMAX_EACH)
        if TWO_D:
            s = compute_scale(bits_to_f32(tl.max(row_max, axis=0)), FMAX, POW2, EPS)
            si = recip(s, POW2, FMAX)
            q = fp8_prep(x * s, FMAX, EMIN, MBITS, SW)
            if ROW:
                tl.store(rs_ptr + pid_m * rs_ld + pid_k, si)
                tl.store(rq_ptr + offs_m[:, None] * K + offs_k[None, :], q.to(rq_ptr.dtype.element_ty), mask=mask)
            if COL:
                tl.store(cs_ptr + pid_k * cs_ld + pid_m, si)
                tl.store(cq_ptr + offs_k[:, None] * M + offs_m[None, :], tl.trans(q).to(cq_ptr.dtype.element_ty),
                         mask=kmask[:, None] & mmask[None, :])
        else:
            if ROW:
                sr = compute_scale(bits_to_f32(row_max), FMAX, POW2, EPS)
                tl.store(rs_ptr + pid_k * rs_ld + offs_m, recip(sr, POW2, FMAX), mask=mmask)
                q = fp8_prep(x * sr[:, None], FMAX, EMIN, MBITS, SW)
                tl.store(rq_ptr + offs_m[:, None] * K + offs_k[None, :], q.to(rq_ptr.dtype.element_ty), mask=mask)
            if COL:
                sc = compute_scale(bits_to_f32(tl.max(ab, axis=0)), FMAX, POW2, EPS)
                tl.store(cs_ptr + pid_m * cs_ld + offs_k, recip(sc, POW2, FMAX), mask=kmask)
                qc = fp8_prep(x * sc[None, :], FMAX, EMIN, MBITS, SW)
                tl.store(cq_ptr + offs_k[:, None] * M + offs_m[None, :], tl.trans(qc).to(cq_ptr.dtype.element_ty),
                         mask=kmask[:, None] & mmask[None, :])
    else:
        if NORM:
            if EVEN:
                nw = tl.load(nw_ptr + k0 + ck)
            else:
                nw = tl.load(nw_ptr + k0 + ck, mask=ck < nk, other=0.0)
        # walk 1: rowwise copy (1D); running maxima: elementwise when the column or 2D tile amax is needed
        if COL or TWO_D:
            acc = tl.zeros((SLAB, BS), dtype=tl.int32)
        else:
            tmax = tl.zeros((SLAB,), dtype=tl.int32)
        for r0 in tl.range(0, BM, SLAB, loop_unroll_factor=UNROLL):
            r = r0 + tl.arange(0, SLAB)
            x = _tile_load(xb, r, ck, K, nm, nk, EVEN, WIDE)
            if NORM:
                x = _norm_rows(x, rstd_ptr + m0, r, nm, nw, EVEN)
            ab = x.to(tl.int32, bitcast=True) & abs_mask
            if COL or TWO_D:
                acc = tl.maximum(acc, ab)
            if ROW and not TWO_D and not R2:
                row_max = tl.max(ab, axis=1)
                if not COL:
                    tmax = tl.maximum(tmax, row_max)
                _rows_1d(x, row_max, rs_ptr + pid_k * rs_ld + m0, rqb, r, ck, K, nm, nk, FMAX, EMIN, MBITS, POW2, EPS,
                         SW,
                         SATCVT, DT, EVEN, WIDE)
        if COL or TWO_D:
            col_max = tl.max(acc, axis=0)
            a = tl.max(col_max, axis=0)
        else:
            a = tl.max(tmax, axis=0)
        _amax_out(amax_ptr, a, AMAX_EACH)
        # the scales of walk 2: the tile's (2D) or one a column (1D)
        if TWO_D:
            mult = compute_scale(bits_to_f32(a), FMAX, POW2, EPS)
            si = recip(mult, POW2, FMAX)
            if ROW:
                tl.store(rs_ptr + pid_m * rs_ld + pid_k, si)
            if COL:
                tl.store(cs_ptr + pid_k * cs_ld + pid_m, si)
        elif COL:
            csb = cs_ptr + pid_m * cs_ld + k0
            if SCR:
                _vec_store(csb, ck, nk, bits_to_f32(col_max), EVEN)
                tl.debug_barrier()
                c1 = tl.arange(0, BS)
                if EVEN:
                    cm1 = tl.load(csb + c1)
                else:
                    cm1 = tl.load(csb + c1, mask=c1 < nk, other=0.0)
                sc = compute_scale(cm1, FMAX, POW2, EPS)
                tl.debug_barrier()  # every maximum read before any is overwritten
                _vec_store(csb, c1, nk, recip(sc, POW2, FMAX), EVEN)
            else:
                sc = compute_scale(bits_to_f32(col_max), FMAX, POW2, EPS)
                _vec_store(csb, ck, nk, recip(sc, POW2, FMAX), EVEN)
            mult = sc[None, :]
        # walk 2: columnwise copy (2D: and the rowwise one, same scale; ROW2: and the rowwise one, its own scales)
        if COL or TWO_D:
            for r0 in tl.range(0, BM, S2, loop_unroll_factor=UNROLL):
                r = r0 + tl.arange(0, S2)
                x = _tile_load(xb, r, ck, K, nm, nk, EVEN, WIDE)
                if NORM:
                    x = _norm_rows(x, rstd_ptr + m0, r, nm, nw, EVEN)
                if TWO_D:
                    xs = x * mult
                    if ROW:
                        _tile_store(rqb, r, ck, K, nm, nk, fp8_cast(xs, DT, FMAX, EMIN, MBITS, SW, SATCVT), EVEN, WIDE)
                    if COL:
                        _tile_store(cqb, ck, r, M, nk, nm, fp8_cast(tl.trans(xs), DT, FMAX, EMIN, MBITS, SW, SATCVT),
                                    EVEN, WIDE)
                else:
                    if R2:
                        row_max = tl.max(x.to(tl.int32, bitcast=True) & abs_mask, axis=1)
                        _rows_1d(x, row_max, rs_ptr + pid_k * rs_ld + m0, rqb, r, ck, K, nm, nk, FMAX, EMIN, MBITS,
                                 POW2,
                                 EPS, SW, SATCVT, DT, EVEN, WIDE)
                    q = fp8_cast(x * mult, DT, FMAX, EMIN, MBITS, SW, SATCVT)
                    _tile_store(cqb, ck, r, M, nk, nm, tl.trans(q), EVEN, WIDE)


@triton.jit
def _tile_raw(ptr, t, nkt, M, K, BM: tl.constexpr, BS: tl.constexpr, EVEN: tl.constexpr, WIDE: tl.constexpr):
    """Tile t (row-panel order) of the (M, K) row-major array at ptr, in its own dtype; 0 past M, K."""
    pm = t // nkt
    m0 = pm * BM
    k0 = (t - pm * nkt) * BS
    r = tl.arange(0, BM)
    c = tl.arange(0, BS)
    ptrs = ptr + (m0.to(tl.int64) * K + k0) + _tile_offsets(r, c, K, WIDE)
    if EVEN:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=(r[:, None] < M - m0) & (c[None, :] < K - k0), other=0.0)


@triton.jit
def blockwise_persistent_kernel(x_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr, amax_ptr, M, K, rs_ld, cs_ld, n_prog,
                                FMAX: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr, POW2: tl.constexpr,
                                EPS: tl.constexpr, TWO_D: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr,
                                SW: tl.constexpr, BM: tl.constexpr, BS: tl.constexpr, SATCVT: tl.constexpr = False,
                                EVEN: tl.constexpr = False, WIDE: tl.constexpr = True, PREFETCH: tl.constexpr = 1,
                                abs_mask=0x7FFFFFFF):
    """blockwise_kernel's outputs (same arguments and scale layouts) from a persistent grid of ``n_prog`` programs.

    Program p walks tiles t = p, p + n_prog, ... in row-panel order (neighbouring programs read neighbouring
    BS-column tiles of the same BM rows). The next PREFETCH tiles are loaded into registers, in the input's own
    dtype, before the current one is computed (the loads of a tile are only waited for when it is used, so
    they stay in flight during the current tile's work); the prefetch index stops at the last tile (a re-read,
    no masks needed). Per tile, all in registers: row maxima, column (or tile) maxima, both casts; the
    columnwise copy is the FP8 tile transposed by the compiler's layout conversion and stored as 16-byte runs
    of cq rows. The amax is kept per program and meets the others in one atomic_max at the end.
    EVEN / WIDE: as in blockwise_kernel.

    Used only where it was measured bit-identical and faster (see triton_backend._PERSISTENT):
    Triton 3.6 miscompiles one pattern here. With FP32 input, the transpose of an FP8 tile cast straight from
    FP32 (SATCVT, no clamp first) permutes pairs of elements along K (2D: columnwise data wrong, rowwise right;
    the same bug made blockwise_kernel's 2D slab walk differ for FP32, and it goes away with the clamp).
    TMA descriptor tiles were measured too (1x128 row+col 0.22-0.29 of copy, 128x128 0.47-0.52): the
    transpose then reads the NVMMA-swizzled tile column-wise from shared memory (or writes it byte-wise),
    which serializes on bank conflicts.
    """
    DT: tl.constexpr = rq_ptr.dtype.element_ty
    pid = tl.program_id(0)
    nkt = tl.cdiv(K, BS)
    n_tiles = tl.cdiv(M, BM) * nkt
    last = n_tiles - 1
    rr = tl.arange(0, BM)
    cc = tl.arange(0, BS)
    amax = tl.zeros((), dtype=tl.int32)
    xa = _tile_raw(x_ptr, tl.minimum(pid, last), nkt, M, K, BM, BS, EVEN, WIDE)
    if PREFETCH >= 2:
        xn = _tile_raw(x_ptr, tl.minimum(pid + n_prog, last), nkt, M, K, BM, BS, EVEN, WIDE)
    for t in range(pid, n_tiles, n_prog):
        xc = xa
        if PREFETCH >= 2:
            xa = xn
            xn = _tile_raw(x_ptr, tl.minimum(t + 2 * n_prog, last), nkt, M, K, BM, BS, EVEN, WIDE)
        else:
            xa = _tile_raw(x_ptr, tl.minimum(t + n_prog, last), nkt, M, K, BM, BS, EVEN, WIDE)
        pm = t // nkt
        pk = t - pm * nkt
        m0 = pm * BM
        k0 = pk * BS
        nm = M - m0
        nk = K - k0
        rqb = rq_ptr + (m0.to(tl.int64) * K + k0)
        cqb = cq_ptr + (k0.to(tl.int64) * M + m0)
        if TWO_D:
            x = xc.to(tl.float32)
            ab = x.to(tl.int32, bitcast=True) & abs_mask
            a = tl.max(tl.max(ab, axis=1), axis=0)
            amax = tl.maximum(amax, a)
            s = compute_scale(bits_to_f32(a), FMAX, POW2, EPS)
            si = recip(s, POW2, FMAX)
            q = fp8_cast(x * s, DT, FMAX, EMIN, MBITS, SW, SATCVT)
            if ROW:
                tl.store(rs_ptr + pm.to(tl.int64) * rs_ld + pk, si)
                _tile_store(rqb, rr, cc, K, nm, nk, q, EVEN, WIDE)
            if COL:
                tl.store(cs_ptr + pk.to(tl.int64) * cs_ld + pm, si)
                _tile_store(cqb, cc, rr, M, nk, nm, tl.trans(q), EVEN, WIDE)
        else:
            a = rowcol_tile_1d(xc, rqb, rs_ptr + pk.to(tl.int64) * rs_ld + m0, cqb,
                               cs_ptr + pm.to(tl.int64) * cs_ld + k0,
                                M, K, nm, nk, FMAX, EMIN, MBITS, POW2, EPS, SW, SATCVT, DT, ROW, COL, EVEN, WIDE,
                                False, abs_mask)
            amax = tl.maximum(amax, a)
    tl.atomic_max(amax_ptr, amax, sem="relaxed")


@triton.jit
def rowcol_tile_1d(raw, rqb, rsb, cqb, csb, M, K, nm, nk, FMAX: tl.constexpr, EMIN: tl.constexpr,
                   MBITS: tl.constexpr, POW2: tl.constexpr, EPS: tl.constexpr, SW: tl.constexpr, SATCVT: tl.constexpr,
                   DT: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr, EVEN: tl.constexpr, WIDE: tl.constexpr,
                   BITS16: tl.constexpr, abs_mask):
    """1x128 scales both ways for one whole (BM, BS) tile ``raw`` (the input's own dtype, in registers): stores the
    rowwise copy at rqb (ld K) with its scale_inv at rsb[r], the columnwise copy transposed at cqb (ld M) with its
    scale_inv at csb[c]; nm / nk rows / cols of the tile lie inside the array. Returns the tile's |x| maximum bits.

    BITS16 (BF16 input only): the maxima are taken over the 16-bit patterns (|x| bits = (bf16 bits & 0x7FFF) << 16,
    the same integers as the FP32 patterns, since BF16 -> FP32 only appends zero bits), so the FP32 tile need not
    be live during the reductions (an autotune candidate of lowbit.ops.swiglu's whole-tile kernel; for
    blockwise_persistent_kernel's 1x128 BF16 it was no faster, so that kernel does not offer it)."""
    BM: tl.constexpr = raw.shape[0]
    BS: tl.constexpr = raw.shape[1]
    rr = tl.arange(0, BM)
    cc = tl.arange(0, BS)
    if BITS16:
        ab = raw.to(tl.int16, bitcast=True).to(tl.int32) & (abs_mask >> 16)
        row_max = tl.max(ab, axis=1) << 16
        col_max = tl.max(ab, axis=0) << 16
    else:
        ab = raw.to(tl.float32).to(tl.int32, bitcast=True) & abs_mask
        row_max = tl.max(ab, axis=1)
        col_max = tl.max(ab, axis=0)
    x = raw.to(tl.float32)
    if ROW:
        sr = compute_scale(bits_to_f32(row_max), FMAX, POW2, EPS)
        _vec_store(rsb, rr, nm, recip(sr, POW2, FMAX), EVEN)
        _tile_store(rqb, rr, cc, K, nm, nk, fp8_cast(x * sr[:, None], DT, FMAX, EMIN, MBITS, SW, SATCVT), EVEN, WIDE)
    if COL:
        sc = compute_scale(bits_to_f32(col_max), FMAX, POW2, EPS)
        _vec_store(csb, cc, nk, recip(sc, POW2, FMAX), EVEN)
        _tile_store(cqb, cc, rr, M, nk, nm, tl.trans(fp8_cast(x * sc[None, :], DT, FMAX, EMIN, MBITS, SW, SATCVT)),
                    EVEN, WIDE)
    return tl.max(row_max, axis=0)


@triton.jit
def _load_tile(x_ptr, M, K, pid_m, pid_k, BM: tl.constexpr, BK: tl.constexpr):
    """Tile (pid_m, pid_k) of x (M, K) contiguous: (offs_m, offs_k, mmask, kmask, mask, x as FP32, 0 outside x)."""
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_k = pid_k * BK + tl.arange(0, BK)
    mmask = offs_m < M
    kmask = offs_k < K
    mask = mmask[:, None] & kmask[None, :]
    x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    return offs_m, offs_k, mmask, kmask, mask, x


# ------------------------------------------------------------------------------------------------
# MXFP8: 1x32 blocks, E8M0 scales; rowwise (along K) and columnwise (along M) from one read
# ------------------------------------------------------------------------------------------------
@triton.jit
def mx_exponent(amax_bits, EMAX: tl.constexpr):
    """(X, code): X = floor(log2 amax) - emax from the exponent bits (amax 0 -> 0; clamp ±127); a non-finite amax
    (NaN or Inf: exponent bits all ones) -> code 0xFF, the E8M0 NaN."""
    be = (amax_bits >> 23) & 0xFF
    # torch.frexp: normal a -> floor(log2 a) = be - 127; subnormal ends up clamped to -127 either way;
    # Inf/NaN -> frexp exponent 0, i.e. floor = -1.
    fl = tl.where(be == 255, -1, be - 127)
    X = fl - EMAX
    X = tl.where(amax_bits == 0, 0, X)
    X = tl.minimum(tl.maximum(X, -127), 127)
    code = tl.where(be == 255, 255, X + 127)
    return X, code


@triton.jit
def mxfp8_kernel(x_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr, amax_ptr, M, K,
                 FMAX: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr, EMAX: tl.constexpr,
                 ROW: tl.constexpr, COL: tl.constexpr, SW: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """x (M, K) contiguous; rowwise q (M, K) + scales (M, K/32) uint8; columnwise q (K, M) + scales (K, M/32)."""
    pid_m = tl.program_id(0).to(tl.int64)
    pid_k = tl.program_id(1).to(tl.int64)
    offs_m, offs_k, mmask, kmask, mask, x = _load_tile(x_ptr, M, K, pid_m, pid_k, BM, BK)
    ab = abs_bits(x)
    tl.atomic_max(amax_ptr, tl.max(tl.max(ab, axis=1), axis=0), sem="relaxed")
    if ROW:
        bm = tl.max(tl.reshape(ab, (BM, BK // 32, 32)), axis=2)
        X, code = mx_exponent(bm, EMAX)
        mult = bits_to_f32((127 - X) << 23)  # 2**-X, a normal FP32 power of two
        xs = tl.reshape(tl.reshape(x, (BM, BK // 32, 32)) * mult[:, :, None], (BM, BK))
        q = fp8_prep(xs, FMAX, EMIN, MBITS, SW)
        tl.store(rq_ptr + offs_m[:, None] * K + offs_k[None, :], q.to(rq_ptr.dtype.element_ty), mask=mask)
        offs_kb = pid_k * (BK // 32) + tl.arange(0, BK // 32)
        tl.store(rs_ptr + offs_m[:, None] * (K // 32) + offs_kb[None, :], code.to(tl.uint8),
                 mask=mmask[:, None] & (offs_kb[None, :] < K // 32))
    if COL:
        bmc = tl.max(tl.reshape(ab, (BM // 32, 32, BK)), axis=1)
        Xc, codec = mx_exponent(bmc, EMAX)
        multc = bits_to_f32((127 - Xc) << 23)
        xc = tl.reshape(tl.reshape(x, (BM // 32, 32, BK)) * multc[:, None, :], (BM, BK))
        qc = fp8_prep(xc, FMAX, EMIN, MBITS, SW)
        tl.store(cq_ptr + offs_k[:, None] * M + offs_m[None, :], tl.trans(qc).to(cq_ptr.dtype.element_ty),
                 mask=kmask[:, None] & mmask[None, :])
        offs_mb = pid_m * (BM // 32) + tl.arange(0, BM // 32)
        tl.store(cs_ptr + offs_k[:, None] * (M // 32) + offs_mb[None, :], tl.trans(codec).to(tl.uint8),
                 mask=kmask[:, None] & (offs_mb[None, :] < M // 32))


# ------------------------------------------------------------------------------------------------
# NVFP4: E2M1 elements, E4M3 scale per 16 (1x16 or 16x16), FP32 global scale from the tensor amax
# ------------------------------------------------------------------------------------------------
@triton.jit
def _nvfp4_encode(x, bamax, S, seed, idx, SR: tl.constexpr, SW: tl.constexpr):
    """Block amax (broadcastable to x) -> (d as float32 on the E4M3 grid, E2M1 codes of x)."""
    t = bamax * tl.math.div_rn(S, tl.full(S.shape, 6.0, tl.float32))
    t = tl.where(t != t, t, tl.minimum(t, 448.0))
    d = fp8_prep(t, 448.0, -6, 3, SW).to(tl.float8e4nv).to(tl.float32)
    enc = recip(tl.math.div_rn(d, S))
    enc = tl.where(enc == float("inf"), FP32_MAX, enc)
    return d, enc


@triton.jit
def _nvfp4_round(v, seed, idx, SR: tl.constexpr):
    v = tl.where(v != v, v, tl.minimum(tl.maximum(v, -6.0), 6.0))
    if SR:
        u = _uniform(seed, idx)
    else:
        u = v
    return _e2m1_codes(_round_sw(v, u, 6.0, 0, 1, SR))


@triton.jit
def nvfp4_kernel(x_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr, amax_ptr, gs_ptr, M, K, seed, signs,
                 TWO_D: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr, SR: tl.constexpr, SW: tl.constexpr,
                 BM: tl.constexpr, BK: tl.constexpr, RHT: tl.constexpr = False, SEED_PTR: tl.constexpr = False):
    """x (M, K) contiguous (M % 16 == 0 when COL or TWO_D, K % 16 == 0); amax_ptr holds the tensor amax bits.

    rowwise: rq (M, K/2) packed, rs (M, K/16) e4m3 (TWO_D: (M/16, K/16)); columnwise: cq (K, M/2),
    cs (K, M/16) (TWO_D: the transposed grid (K/16, M/16)). Philox counters: rowwise m*K + k,
    columnwise (1x16) M*K + k*M + m. gs = S = 2688 / amax (0 -> 1, overflow -> FP32 max).
    RHT (columnwise 1x16 only: never with ROW or TWO_D): the columnwise copy of RHT(x) (reference.rht_blocks
    along M with sign mask ``signs``), transformed in registers; amax_ptr must then hold max |RHT(x)|.
    SEED_PTR: ``seed`` points at an int64 on the device (drawn there: CUDA-graph safe) instead of being a value.
    """
    if SEED_PTR:
        seed = tl.load(seed)
    pid_m = tl.program_id(0).to(tl.int64)
    pid_k = tl.program_id(1).to(tl.int64)
    amax = bits_to_f32(tl.load(amax_ptr))
    S = tl.math.div_rn(tl.full((1,), 2688.0, tl.float32), tl.full((1,), 1.0, tl.float32) * amax)
    S = tl.where(amax == 0, 1.0, S)
    S = tl.where(S == float("inf"), FP32_MAX, S)
    if (pid_m == 0) & (pid_k == 0):
        tl.store(gs_ptr + tl.arange(0, 1), S)
    S2 = tl.reshape(S, (1, 1))
    K16 = K // 16
    M16 = M // 16
    if RHT:
        # The tile as (G, BK, 16): 16-row groups (one 1x16 block of the copy each) with the block's elements
        # in-thread, so the block amax, encode and pairing of nibbles need no data exchange between threads.
        G: tl.constexpr = BM // 16
        rows, offs_k, gmask = _rht_rows_mask(M, K, pid_m, pid_k, BM, BK)
        _, y = _rht_tile(x_ptr, rows, offs_k, K, gmask, signs, G, BK)
        bmc = bits_to_f32(tl.max(abs_bits(y), axis=2))
        dc, encc = _nvfp4_encode(y, bmc, S2, seed, 0, SR, SW)
        # M*K + k*M + m, formed as (K + k) * M + m so that nothing is computed in int32
        idxc = (K + offs_k[None, :, None]) * M + rows[:, None, None] + tl.arange(0, 16)[None, None, :]
        codes = _nvfp4_round(y * encc[:, :, None], seed, idxc, SR)
        lo, hi = tl.split(tl.reshape(codes, (G, BK, 8, 2)))
        packed = tl.permute(lo | (hi << 4), (1, 0, 2))  # (BK, G, 8): byte i of group g is cq[k, rows[g] / 2 + i]
        cmask = tl.trans(gmask)
        tl.store(cq_ptr + offs_k[:, None, None] * (M // 2) + (rows // 2)[None, :, None]
                 + tl.arange(0, 8)[None, None, :],
                 packed, mask=cmask[:, :, None])
        tl.store(cs_ptr + offs_k[:, None] * M16 + (rows // 16)[None, :], tl.trans(dc.to(tl.float8e4nv)), mask=cmask)
    else:
        offs_m, offs_k, mmask, kmask, mask, x = _load_tile(x_ptr, M, K, pid_m, pid_k, BM, BK)
        ab = abs_bits(x)
        idx = offs_m[:, None] * K + offs_k[None, :]
        if TWO_D:
            bm = bits_to_f32(tl.max(tl.max(tl.reshape(ab, (BM // 16, 16, BK // 16, 16)), axis=3), axis=1))
            d, enc = _nvfp4_encode(x, bm, tl.reshape(S, (1, 1)), seed, idx, SR, SW)
            enc_e = tl.reshape(tl.broadcast_to(tl.reshape(enc, (BM // 16, 1, BK // 16, 1)), (BM // 16, 16, BK // 16,
                                                                                             16)),
                               (BM, BK))
            codes = _nvfp4_round(x * enc_e, seed, idx, SR)
            dq = d.to(tl.float8e4nv)
            offs_mb = pid_m * (BM // 16) + tl.arange(0, BM // 16)
            offs_kb = pid_k * (BK // 16) + tl.arange(0, BK // 16)
            smask = (offs_mb[:, None] < M16) & (offs_kb[None, :] < K16)
            if ROW:
                offs_kh = pid_k * (BK // 2) + tl.arange(0, BK // 2)
                tl.store(rq_ptr + offs_m[:, None] * (K // 2) + offs_kh[None, :], _pack_pairs(codes, BM, BK),
                         mask=mmask[:, None] & (offs_kh[None, :] < K // 2))
                tl.store(rs_ptr + offs_mb[:, None] * K16 + offs_kb[None, :], dq, mask=smask)
            if COL:
                offs_mh = pid_m * (BM // 2) + tl.arange(0, BM // 2)
                tl.store(cq_ptr + offs_k[:, None] * (M // 2) + offs_mh[None, :], _pack_pairs(tl.trans(codes), BK, BM),
                         mask=kmask[:, None] & (offs_mh[None, :] < M // 2))
                tl.store(cs_ptr + offs_kb[:, None] * M16 + offs_mb[None, :], tl.trans(dq), mask=tl.trans(smask))
        else:
            if ROW:
                bm = bits_to_f32(tl.max(tl.reshape(ab, (BM, BK // 16, 16)), axis=2))
                d, enc = _nvfp4_encode(x, bm, S2, seed, idx, SR, SW)
                enc_e = tl.reshape(tl.broadcast_to(enc[:, :, None], (BM, BK // 16, 16)), (BM, BK))
                codes = _nvfp4_round(x * enc_e, seed, idx, SR)
                offs_kh = pid_k * (BK // 2) + tl.arange(0, BK // 2)
                tl.store(rq_ptr + offs_m[:, None] * (K // 2) + offs_kh[None, :], _pack_pairs(codes, BM, BK),
                         mask=mmask[:, None] & (offs_kh[None, :] < K // 2))
                offs_kb = pid_k * (BK // 16) + tl.arange(0, BK // 16)
                tl.store(rs_ptr + offs_m[:, None] * K16 + offs_kb[None, :], d.to(tl.float8e4nv),
                         mask=mmask[:, None] & (offs_kb[None, :] < K16))
            if COL:
                bmc = bits_to_f32(tl.max(tl.reshape(ab, (BM // 16, 16, BK)), axis=1))
                dc, encc = _nvfp4_encode(x, bmc, S2, seed, idx, SR, SW)
                encc_e = tl.reshape(tl.broadcast_to(encc[:, None, :], (BM // 16, 16, BK)), (BM, BK))
                idxc = (K + offs_k[None, :]) * M + offs_m[:, None]  # M*K + k*M + m without an int32 M*K
                codesc = _nvfp4_round(x * encc_e, seed, idxc, SR)
                offs_mh = pid_m * (BM // 2) + tl.arange(0, BM // 2)
                tl.store(cq_ptr + offs_k[:, None] * (M // 2) + offs_mh[None, :], _pack_pairs(tl.trans(codesc), BK, BM),
                         mask=kmask[:, None] & (offs_mh[None, :] < M // 2))
                offs_mb = pid_m * (BM // 16) + tl.arange(0, BM // 16)
                tl.store(cs_ptr + offs_k[:, None] * M16 + offs_mb[None, :], tl.trans(dc.to(tl.float8e4nv)),
                         mask=kmask[:, None] & (offs_mb[None, :] < M16))
