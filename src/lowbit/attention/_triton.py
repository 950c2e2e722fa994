"""Triton kernels for quantized attention: Q/K/V quantization prepass and one forward kernel family.

The forward kernel is a FlashAttention-2 style loop (one program per (query block, batch·head),
streaming key/value tiles) with ``tl.constexpr`` switches:

* ``QK_MODE``: 0 = 16-bit Q·Kᵀ (bf16/fp16 in, FP32 out), 1 = INT8 Q·Kᵀ with INT32 accumulation,
  2 = FP8 E4M3 Q·Kᵀ.  For 1 and 2 every score tile is converted to FP32 and multiplied by
  ``q_scale[row] * k_scale[col]`` *before* the running max/sum update, so per-block / per-warp scales
  are exact per tile whatever the tile shape (scales are gathered per row / per column).
* ``PV_FP8``: P·V in FP8 E4M3: P is computed directly as p·448 = exp2(s - (m - log2 448)) and rounded to E4M3
  (the row sum l carries the same factor, so out = acc / l needs no 1/448), V carries one scale per channel
  applied once in the epilogue (it commutes with the sum over keys); each tile's product is promoted into the
  FP32 accumulator (``max_num_imprecise_acc = BLOCK_N``), avoiding the reduced-precision accumulation of Hopper
  FP8 MMA across the whole sequence.
* ``V_SCALED``: V comes with per-channel scales applied in the epilogue: FP8 V, or BF16 V carried in FP16 under
  exact power-of-two scales (``quantize_v_fp16_triton``), so that P (in [0, 1]) is rounded to FP16 — 3 more
  mantissa bits than BF16 — for the P·V MMA.
* The score scale is one FMA per element: p = exp2(s·c - m) with c = q_scale[row]·k_scale[tile] (or
  softmax_scale·log2 e), and the row max taken as c·max(s); the kernel is instruction-issue bound (compiled for
  sm_90 its inner loop is ~400-600 instructions per thread per 128x64 tile against ~250 cycles of MMA), so every
  per-element instruction counts.
* causal / sliding window are runtime ints (bottom-right aligned); tiles are split into
  "masked" ranges and a mask-free middle range, so only boundary tiles pay for masking.
* GQA via ``GROUP`` (query head h reads kv head h // GROUP); layouts via strides; varlen via
  ``cu_seqlens``; all base offsets in int64.

Under ``TRITON_INTERPRET=1`` (``INTERPRET``) two interpreter defects are worked around: its
FP32 -> E4M3 cast mishandles mantissa carry (126.98 -> 64), so the cast is emulated with exact FP32
arithmetic, and its bf16 ``tl.dot`` returns garbage and its fp32 -> bf16 cast truncates, so 16-bit operands are
rounded by hand and upcast to FP32 (exact).
"""
from __future__ import annotations

import math
import struct

import torch
import triton
import triton.language as tl

try:  # InterpretedFunction is what triton.jit returns under TRITON_INTERPRET=1
    from triton.runtime.interpreter import InterpretedFunction as _Interp
except Exception:  # pragma: no cover
    _Interp = ()

from ..runtime import env
from ..runtime.launch import SpecializedLaunch, ensure_tma_allocator, remember
from . import _gluon
from ._checks import views
from ._gluon import DEFAULT_OPTIONS, GluonOptions
from .reference import E4M3_MAX, INT8_MAX, LOG2E, QKQuantized, n_q_groups

BIG = 1 << 30  # "no window limit" (keeps i + off + BIG inside int32)


# ============================================================================ shared device helpers
@triton.jit
def _to_e4m3(x, EMULATE: tl.constexpr):
    """Saturating RNE cast fp32 -> float8e4nv.  x must be finite."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    if EMULATE:
        # Snap to the E4M3 grid in FP32 first: ulp = 2^(e - 3) with e = max(exponent(x), -6);
        # (x + 1.5·2^23·ulp) - (1.5·2^23·ulp) rounds to a multiple of ulp, ties to even.
        bits = x.to(tl.int32, bitcast=True)
        e = tl.maximum((bits >> 23) & 0xFF, 121)
        ulp = ((e - 3) << 23).to(tl.float32, bitcast=True)
        big = ulp * 12582912.0
        x = (x + big) - big
    return x.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def _p_to_16(p, dt: tl.constexpr):
    """Interpreter only: its fp32 -> bf16 cast truncates; round to nearest even by hand (p >= 0)."""
    if dt == tl.bfloat16:
        bits = p.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        p = bits.to(tl.float32, bitcast=True)
    return p.to(dt)


@triton.jit
def _round_half_away(x):
    a = tl.abs(x)
    f = tl.floor(a)
    r = f + tl.where(a - f >= 0.5, 1.0, 0.0)
    return tl.where(x < 0, -r, r)


@triton.jit
def _to_int8(y, INTERPRET: tl.constexpr):
    """INT8 code of y: round half away from zero, clamp to ±127 (``reference.round_half_away``), bit-identical.

    Compiled: no XU-pipe instruction (FRND / F2I run at 16 per clock per SM): n = floor(|y| + 0.5) as
    rz(rz(|y| + 0.5) + 2^23) - 2^23 read from the bits, then the sign applied in integers. |y| + 0.5 is exact for
    |y| >= 0.5, and rounding toward zero keeps the one inexact case below it, |y| = 0.5 - 2^-25, under 1."""
    if INTERPRET:
        return tl.minimum(tl.maximum(_round_half_away(y), -127.0), 127.0).to(tl.int8)
    t = tl.inline_asm_elementwise("{ .reg .f32 u; add.rz.f32 u, $1, 0f3F000000; add.rz.f32 $0, u, 0f4B000000; }",
                                  "=r,r", [tl.abs(y)], dtype=tl.int32, is_pure=True, pack=1)
    n = tl.minimum(t - 0x4B000000, 127)
    sgn = y.to(tl.int32, bitcast=True) >> 31
    return ((n ^ sgn) - sgn).to(tl.int8)


# ============================================================================ prepass kernels
# One family of three launches serves quantize_qk, quantize_v_fp8 / _fp16 and the fused prepass of
# lowbit.attention (Q, K and V in three launches instead of six and a torch reduction):
#   1. _prepass_stats_kernel: per chunk of key rows the FP32 column sums of K (smoothing) and the column amax of V;
#      further programs of the same grid quantize Q's scale groups (they need no statistics);
#   2. _prepass_finalize_kernel: per (batch, kv head) the K mean and V's per-channel scales and multipliers;
#   3. _prepass_codes_kernel: per K scale group the K codes (mean subtracted) and the V codes of the same rows.
# K and V are each read twice (the statistics precede the codes), Q once.
@triton.jit
def _rows_group(xb, yb, sp, mp, g, seqlen, n_groups, mult, sxs, sxd, sys_, syd,
                ROWS: tl.constexpr, ROWS_P2: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
                QMAX: tl.constexpr, TO_FP8: tl.constexpr, HAS_MEAN: tl.constexpr, INTERPRET: tl.constexpr):
    """One scale group: rows g·ROWS ... of the (batch, head) at xb -> codes at yb, scale at sp[g].

    y = code((x·mult - mean) · (QMAX / amax)); scale = amax/QMAX (amax 0 -> 1 and 1). mp: the (batch, head)'s mean
    row (HAS_MEAN). ROWS_P2 = next power of two >= ROWS (tl.arange needs one; a user's block_k need not be)."""
    r = tl.arange(0, ROWS_P2)
    rows = g * ROWS + r
    d = tl.arange(0, BLOCK_D)
    m = (rows[:, None] < seqlen) & (r[:, None] < ROWS) & (d[None, :] < D)
    roff = rows.to(tl.int64)
    x = tl.load(xb + roff[:, None] * sxs + d[None, :] * sxd, mask=m, other=0.0).to(tl.float32)
    x = x * mult
    if HAS_MEAN:
        mu = tl.load(mp + d, mask=d < D, other=0.0)
        x = tl.where(m, x - mu[None, :], 0.0)  # masked rows/columns read 0 but the mean moved them
    amax = tl.max(tl.abs(x))  # one flat reduction (per-row then per-column reductions cost ~10 shuffles per element)
    scale = tl.where(amax == 0.0, 1.0, tl.math.div_rn(amax, QMAX))
    # the quantizer's multiplier (one division per group)
    inv = tl.where(amax == 0.0, 1.0, tl.math.div_rn(tl.full([], QMAX, tl.float32), amax))
    if g < n_groups:
        tl.store(sp + g, scale)
    y = x * inv
    if TO_FP8:
        code = _to_e4m3(y, INTERPRET)
    else:
        code = _to_int8(y, INTERPRET)
    tl.store(yb + roff[:, None] * sys_ + d[None, :] * syd, code, mask=m)


@triton.jit
def _seq_base(X, CU, b, h, sb, sh, ss, seqlen, VARLEN: tl.constexpr):
    """(pointer to sequence b, head h of X, its length): dense strides, or packed rows from cu_seqlens CU."""
    if VARLEN:
        start = tl.load(CU + b).to(tl.int64)
        seqlen = (tl.load(CU + b + 1) - tl.load(CU + b)).to(tl.int32)
        base = X + start * ss + h.to(tl.int64) * sh
    else:
        base = X + b.to(tl.int64) * sb + h.to(tl.int64) * sh
    return base, seqlen


@triton.jit
def _col_stats(K, V, PK, PV, CUK, idx, Hkv, Sk, n_chunks, skb, skh, sks, skd, svb, svh, svs, svd,
               BLOCK_D: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr,
               K_SUM: tl.constexpr, V_AMAX: tl.constexpr, VARLEN: tl.constexpr):
    """Chunk c = idx % n_chunks of CHUNK key rows of (batch·kv head) idx // n_chunks -> PK[bh, c, :] = FP32 column
    sums of K (K_SUM), PV[bh, c, :] = column max of |V| (V_AMAX); rows past the sequence add 0."""
    c = idx % n_chunks
    bh = idx // n_chunks
    b = bh // Hkv
    h = bh % Hkv
    d = tl.arange(0, BLOCK_D)
    r = tl.arange(0, SUB)
    seqlen = Sk
    if K_SUM:
        kb, seqlen = _seq_base(K, CUK, b, h, skb, skh, sks, Sk, VARLEN)
        acc = tl.zeros([SUB, BLOCK_D], dtype=tl.float32)
    if V_AMAX:
        vb, seqlen = _seq_base(V, CUK, b, h, svb, svh, svs, Sk, VARLEN)
        amx = tl.zeros([SUB, BLOCK_D], dtype=tl.float32)
    for i in tl.static_range(CHUNK // SUB):
        rows = c * CHUNK + i * SUB + r
        m = (rows[:, None] < seqlen) & (d[None, :] < D)
        roff = rows.to(tl.int64)[:, None]
        if K_SUM:
            acc += tl.load(kb + roff * sks + d[None, :] * skd, mask=m, other=0.0).to(tl.float32)
        if V_AMAX:
            amx = tl.maximum(amx, tl.abs(tl.load(vb + roff * svs + d[None, :] * svd, mask=m, other=0.0).to(tl.float32)))
    out = (bh.to(tl.int64) * n_chunks + c) * D + d
    if K_SUM:
        tl.store(PK + out, tl.sum(acc, 0), mask=d < D)
    if V_AMAX:
        tl.store(PV + out, tl.max(amx, 0), mask=d < D)


@triton.jit
def _prepass_stats_kernel(Q, QC, QS, K, V, PK, PV, CUQ, CUK,
                          sqb, sqh, sqs, sqd, scb, sch, scs, scd, ssb, ssh,
                          skb, skh, sks, skd, svb, svh, svs, svd,
                          Hq, Hkv, Sq, Sk, nq_groups, nq_grid, n_chunks, n_stat, mult,
                          Q_ROWS: tl.constexpr, Q_ROWS_P2: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
                          QMAX: tl.constexpr, TO_FP8: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr,
                          DO_Q: tl.constexpr, K_SUM: tl.constexpr, V_AMAX: tl.constexpr, SPLIT: tl.constexpr,
                          VARLEN: tl.constexpr, INTERPRET: tl.constexpr):
    """Programs [0, n_stat): one chunk of key rows each (``_col_stats``), both K's sums and V's amax, or (SPLIT, both
    asked for) the first half K's and the second half V's. Programs [n_stat, n_stat + nq_grid·B·Hq) (DO_Q): one Q
    scale group each (``_rows_group``)."""
    pid = tl.program_id(0)
    if pid < n_stat:
        if SPLIT:  # K's sums and V's amax in programs of their own (twice the programs, each reading one tensor)
            n_kv = n_stat // 2
            if pid < n_kv:
                _col_stats(K, V, PK, PV, CUK, pid, Hkv, Sk, n_chunks, skb, skh, sks, skd, svb, svh, svs, svd,
                           BLOCK_D, D, CHUNK, SUB, True, False, VARLEN)
            else:
                _col_stats(K, V, PK, PV, CUK, pid - n_kv, Hkv, Sk, n_chunks, skb, skh, sks, skd, svb, svh, svs, svd,
                           BLOCK_D, D, CHUNK, SUB, False, True, VARLEN)
        else:
            _col_stats(K, V, PK, PV, CUK, pid, Hkv, Sk, n_chunks, skb, skh, sks, skd, svb, svh, svs, svd,
                       BLOCK_D, D, CHUNK, SUB, K_SUM, V_AMAX, VARLEN)
    elif DO_Q:
        p = pid - n_stat
        g = p % nq_grid
        bh = p // nq_grid
        b = bh // Hq
        h = bh % Hq
        qb, seqlen = _seq_base(Q, CUQ, b, h, sqb, sqh, sqs, Sq, VARLEN)
        cb, seqlen = _seq_base(QC, CUQ, b, h, scb, sch, scs, Sq, VARLEN)
        _rows_group(qb, cb, QS + b.to(tl.int64) * ssb + h * ssh, QS, g, seqlen, nq_groups, mult, sqs, sqd, scs, scd,
                    Q_ROWS, Q_ROWS_P2, BLOCK_D, D, QMAX, TO_FP8, False, INTERPRET)


@triton.jit
def _prepass_finalize_kernel(PK, PV, KM, VS, VR, CUK, Hkv, Sk, n_chunks, smb, smh,
                             D: tl.constexpr, BLOCK_D: tl.constexpr, CH: tl.constexpr, K_SUM: tl.constexpr,
                             V_AMAX: tl.constexpr, FP16: tl.constexpr, VARLEN: tl.constexpr):
    """Per (batch·kv head) bh, from the stats kernel's partials: KM[b, h, 0, :] = (sum of K's rows) / length
    (length 0 -> / 1), summed chunk by chunk in order; VS / VR = V's dequantization scale and quantizer multiplier
    per channel. FP8: VS = amax/448, VR = 448/amax. FP16 (BF16 V into FP16's range): the power of two VR = 2^e,
    e = 15 - floor(log2 amax) clamped to <= 126 (amax·VR < 2^16 and a BF16 mantissa ends at 1.9921875, so
    amax·VR <= 65280 < 65504), VS = 2^-e; both exact. amax 0 -> VS = VR = 1."""
    bh = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    c = tl.arange(0, CH)
    base = bh.to(tl.int64) * n_chunks * D
    ksum = tl.zeros([BLOCK_D], dtype=tl.float32)
    amax = tl.zeros([BLOCK_D], dtype=tl.float32)
    for c0 in range(0, n_chunks, CH):
        off = base + (c0 + c[:, None]) * D + d[None, :]
        m = (c0 + c[:, None] < n_chunks) & (d[None, :] < D)
        if K_SUM:
            ksum += tl.sum(tl.load(PK + off, mask=m, other=0.0), 0)
        if V_AMAX:
            amax = tl.maximum(amax, tl.max(tl.load(PV + off, mask=m, other=0.0), 0))
    if K_SUM:
        b = bh // Hkv
        h = bh % Hkv
        n = Sk
        if VARLEN:
            n = tl.load(CUK + b + 1) - tl.load(CUK + b)
        n = tl.maximum(n, 1).to(tl.float32)
        tl.store(KM + b.to(tl.int64) * smb + h * smh + d, tl.math.div_rn(ksum, n + tl.zeros_like(ksum)), mask=d < D)
    if V_AMAX:
        if FP16:
            e = 15 - (((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127)
            e = tl.where(amax == 0.0, 0, tl.minimum(e, 126))
            r = ((e + 127) << 23).to(tl.float32, bitcast=True)
            sc = ((127 - e) << 23).to(tl.float32, bitcast=True)
        else:
            sc = tl.where(amax == 0.0, 1.0, tl.math.div_rn(amax, 448.0))
            r = tl.where(amax == 0.0, 1.0, tl.math.div_rn(448.0 + tl.zeros_like(amax), amax))
        tl.store(VS + bh.to(tl.int64) * D + d, sc, mask=d < D)
        tl.store(VR + bh.to(tl.int64) * D + d, r, mask=d < D)


@triton.jit
def _prepass_codes_kernel(K, KC, KS, KM, V, VC, VR, CUK,
                          skb, skh, sks, skd, scb, sch, scs, scd, ssb, ssh, smb, smh,
                          svb, svh, svs, svd, syb, syh, sys_, syd, Hkv, Sk, nk_groups,
                          ROWS: tl.constexpr, ROWS_P2: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
                          QMAX: tl.constexpr, TO_FP8: tl.constexpr, HAS_MEAN: tl.constexpr, K_CODES: tl.constexpr,
                          V_CODES: tl.constexpr, V_FP16: tl.constexpr, KEY_PERM: tl.constexpr,
                          VARLEN: tl.constexpr, INTERPRET: tl.constexpr):
    """Program (g, bh): K scale group g (rows g·ROWS ...) of (batch·kv head) bh -> K codes and scale (K_CODES,
    ``_rows_group`` with the mean), and V's same rows -> codes y = code(v · VR[bh, channel]) (V_CODES): E4M3
    (saturating RNE) or, V_FP16, v·2^e rounded to nearest even (exact unless it lands among FP16's subnormals).
    KEY_PERM (dense V only): key s is stored at position ``wgmma32_position(s)`` (see ``quantize_v_fp8_triton``): the
    program's rows are storage positions and it loads the key each holds, so its stores stay contiguous along the
    sequence (permuting the stores instead was 25% slower), and the positions past the last key of its 32-key chunk
    are written 0."""
    g = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hkv
    h = bh % Hkv
    if K_CODES:
        kb, seqlen = _seq_base(K, CUK, b, h, skb, skh, sks, Sk, VARLEN)
        cb, seqlen = _seq_base(KC, CUK, b, h, scb, sch, scs, Sk, VARLEN)
        _rows_group(kb, cb, KS + b.to(tl.int64) * ssb + h * ssh, KM + b.to(tl.int64) * smb + h * smh, g, seqlen,
                    nk_groups, 1.0, sks, skd, scs, scd, ROWS, ROWS_P2, BLOCK_D, D, QMAX, TO_FP8, HAS_MEAN, INTERPRET)
    if V_CODES:
        vb, seqlen = _seq_base(V, CUK, b, h, svb, svh, svs, Sk, VARLEN)
        yb, seqlen = _seq_base(VC, CUK, b, h, syb, syh, sys_, Sk, VARLEN)
        r_ = tl.arange(0, ROWS_P2)
        rows = g * ROWS + r_
        d = tl.arange(0, BLOCK_D)
        sm = (r_[:, None] < ROWS) & (d[None, :] < D)
        if KEY_PERM:  # rows are storage positions: load the key each holds (the inverse of wgmma32_position)
            key = (rows & ~31) | (rows & 0x11) | ((rows & 2) << 2) | ((rows >> 1) & 6)
            lm = sm & (key[:, None] < seqlen)
            sm = sm & (rows[:, None] < (seqlen + 31) // 32 * 32)  # the last chunk's unused positions get code 0
        else:
            key = rows
            sm = sm & (rows[:, None] < seqlen)
            lm = sm
        x = tl.load(vb + key.to(tl.int64)[:, None] * svs + d[None, :] * svd, mask=lm, other=0.0).to(tl.float32)
        rv = tl.load(VR + bh.to(tl.int64) * D + d, mask=d < D, other=1.0)
        y = x * rv[None, :]
        if V_FP16:
            code = y.to(tl.float16)
        else:
            code = _to_e4m3(y, INTERPRET)
        tl.store(yb + rows.to(tl.int64)[:, None] * sys_ + d[None, :] * syd, code, mask=sm)


# ============================================================================ forward kernel
@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, q_sc, k_base, v_base, ks_base, offs_m, offs_d, lo, hi,
               Sk, diag, win_left, win_right,
               sks, skd, svs, svd,
               QK_MODE: tl.constexpr, PV_FP8: tl.constexpr, K_SCALE_ROWS: tl.constexpr, MASK: tl.constexpr,
               BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr, TMA: tl.constexpr = False,
               HEAD_DIM: tl.constexpr = 128, KS_TILE: tl.constexpr = False):
    offs_nl = tl.arange(0, BLOCK_N)
    if TMA:
        # Tensor descriptors (TMA): a tile address is (descriptor, coordinates), not a (rows, cols) tensor of
        # 64-bit pointers kept live across the software pipeline. Compiled for sm_90 (Triton 3.6), the pointer
        # version of this loop spills (hundreds of STL/LDL at 128x64 tiles, 8 warps); a descriptor version
        # does not. Rows past Sk read as zero. The launcher checks TMA's rules (unit last stride, 16-byte
        # aligned base and strides) and otherwise uses pointers.
        kd = tl.make_tensor_descriptor(k_base, shape=[Sk, HEAD_DIM], strides=[sks, 1], block_shape=[BLOCK_N, HEAD_DIM])
        if PV_FP8:  # FP8 V is stored sequence-contiguous (K-major for the MMA): tiles (HEAD_DIM, BLOCK_N)
            vd = tl.make_tensor_descriptor(v_base, shape=[HEAD_DIM, Sk], strides=[svd, 1],
                                           block_shape=[HEAD_DIM, BLOCK_N])
        else:
            vd = tl.make_tensor_descriptor(v_base, shape=[Sk, HEAD_DIM], strides=[svs, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])
    else:
        # 64-bit tile base once, then 32-bit increments (BLOCK_N * stride always fits)
        kt_ptrs = k_base + lo.to(tl.int64) * sks + offs_nl[None, :] * sks + offs_d[:, None] * skd
        v_ptrs = v_base + lo.to(tl.int64) * svs + offs_nl[:, None] * svs + offs_d[None, :] * svd
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_nl
        if TMA:
            kt = tl.trans(kd.load([start_n, 0]))
        elif MASK:
            kt = tl.load(kt_ptrs, mask=offs_n[None, :] < Sk, other=0.0)
        else:
            kt = tl.load(kt_ptrs)
        if QK_MODE == 1:
            s = tl.dot(q, kt, out_dtype=tl.int32).to(tl.float32)
        elif QK_MODE == 0 and INTERPRET:  # the interpreter's bf16 dot is wrong; fp32 is exact there
            s = tl.dot(q.to(tl.float32), kt.to(tl.float32))
        elif QK_MODE == 2:  # FP8 MMA accumulates in reduced precision: promote to FP32 every 32 products
            s = tl.dot(q, kt, max_num_imprecise_acc=32)
        else:
            s = tl.dot(q, kt)
        # Scores in log2 units are s·c with c = q_scale[row]·k_scale[tile] (INT8/FP8; 16-bit: c = softmax_scale·log2
        # e).
        # The multiply is not done per element: c > 0, so the row max is c·max(s) (rounding is monotone: the same
        # number as max(s·c)) and p = exp2(s·c - m) is one FMA per element. Where a key tile spans several K scale
        # blocks, the column scale still multiplies s first: s·k_scale[col], then c = q_scale[row].
        if QK_MODE == 0:
            c = q_sc
        elif KS_TILE:
            c = q_sc * tl.load(ks_base + start_n // K_SCALE_ROWS)
        else:
            if MASK:
                ks = tl.load(ks_base + offs_n // K_SCALE_ROWS, mask=offs_n < Sk, other=1.0)
            else:
                ks = tl.load(ks_base + offs_n // K_SCALE_ROWS)
            s = s * ks[None, :]
            c = q_sc
        if MASK:
            rel = offs_n[None, :] - (offs_m[:, None] + diag)  # j - (i + Sk - Sq)
            ok = (offs_n[None, :] < Sk) & (rel <= win_right) & (rel >= -win_left)
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * c)
        if MASK:  # a row may still see nothing: keep exp2 away from (-inf) - (-inf)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        if PV_FP8:  # p·448 directly (P is scaled into E4M3's range): exp2(s·c - (m - log2 448)); l sums p·448 too
            p = tl.math.exp2(s * c[:, None] - (m_use - 8.807354922057604)[:, None])
        else:
            p = tl.math.exp2(s * c[:, None] - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if TMA:
            if PV_FP8:
                v = tl.trans(vd.load([0, start_n]))
            else:
                v = vd.load([start_n, 0])
        elif MASK:
            v = tl.load(v_ptrs, mask=offs_n[:, None] < Sk, other=0.0)
        else:
            v = tl.load(v_ptrs)
        if PV_FP8:  # p <= 448 (up to exp2's rounding, which the saturating cast absorbs): no clamp needed
            p8 = _to_e4m3(p, True) if INTERPRET else p.to(tl.float8e4nv, fp_downcast_rounding="rtne")
            acc = tl.dot(p8, v, acc, max_num_imprecise_acc=BLOCK_N)
        elif INTERPRET:
            acc = tl.dot(_p_to_16(p, v.dtype).to(tl.float32), v.to(tl.float32), acc)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
        if not TMA:
            kt_ptrs += BLOCK_N * sks
            v_ptrs += BLOCK_N * svs
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["Sq", "Sk", "win_left", "win_right", "SEQ_BUCKET"])
def attn_fwd(Q, K, V, O, LSE, QS, KS, VS, KM, CUQ, CUK,
              sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd, sob, soh, sos, sod,
              sqsb, sqsh, sksb, sksh, svsb, svsh, skmb, skmh, slb, slh, sls,
              H, GROUP, Sq, Sk, sm_scale_log2, win_left, win_right, SEQ_BUCKET,
              QK_MODE: tl.constexpr, PV_FP8: tl.constexpr, Q_SCALE_ROWS: tl.constexpr,
              K_SCALE_ROWS: tl.constexpr, HAS_KMEAN: tl.constexpr, RETURN_LSE: tl.constexpr,
              VARLEN: tl.constexpr, REVERSE_M: tl.constexpr, HEAD_DIM: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr, TMA: tl.constexpr = False,
              V_SCALED: tl.constexpr = False, HEAVY_FIRST: tl.constexpr = False):
    if HEAVY_FIRST:  # causal, grid (heads, query blocks): every head's last query block, then the one before, ...
        pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
        bh = tl.program_id(0)
    else:  # grid (query blocks, heads)
        pid_m = tl.program_id(0)
        if REVERSE_M:  # causal: each head's heaviest query blocks first
            pid_m = tl.num_programs(0) - 1 - pid_m
        bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    b64 = b.to(tl.int64)
    if VARLEN:
        q0 = tl.load(CUQ + b)
        k0 = tl.load(CUK + b)
        Sq = tl.load(CUQ + b + 1) - q0
        Sk = tl.load(CUK + b + 1) - k0
        q_base = Q + q0.to(tl.int64) * sqs + h.to(tl.int64) * sqh
        o_base = O + q0.to(tl.int64) * sos + h.to(tl.int64) * soh
        k_base = K + k0.to(tl.int64) * sks + hk.to(tl.int64) * skh
        v_base = V + k0.to(tl.int64) * svs + hk.to(tl.int64) * svh
        lse_base = LSE + q0.to(tl.int64) * sls + h.to(tl.int64) * slh
    else:
        q_base = Q + b64 * sqb + h.to(tl.int64) * sqh
        o_base = O + b64 * sob + h.to(tl.int64) * soh
        k_base = K + b64 * skb + hk.to(tl.int64) * skh
        v_base = V + b64 * svb + hk.to(tl.int64) * svh
        lse_base = LSE + b64 * slb + h.to(tl.int64) * slh
    m0 = pid_m * BLOCK_M
    if m0 >= Sq:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Sq
    q = tl.load(q_base + offs_m.to(tl.int64)[:, None] * sqs + offs_d[None, :] * sqd, mask=row_ok[:, None], other=0.0)
    if QK_MODE != 0:
        q_sc = tl.load(QS + b64 * sqsb + h * sqsh + offs_m // Q_SCALE_ROWS, mask=row_ok, other=1.0)
    else:
        q_sc = tl.zeros([BLOCK_M], dtype=tl.float32) + sm_scale_log2
    ks_base = KS + b64 * sksb + hk * sksh
    KS_TILE: tl.constexpr = QK_MODE != 0 and K_SCALE_ROWS % BLOCK_N == 0  # one k_scale per key tile

    # ---- key range seen by this query block, split into masked / mask-free tiles
    diag = Sk - Sq
    hi = tl.minimum(Sk, m0 + BLOCK_M + diag + win_right)
    lo = tl.maximum(m0 + diag - win_left, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    full_lo = tl.maximum(m0 + BLOCK_M - 1 + diag - win_left, lo)
    full_lo = ((full_lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    full_end = tl.maximum(tl.minimum(Sk, m0 + diag + win_right + 1), 0)
    full_hi = tl.maximum((full_end // BLOCK_N) * BLOCK_N, full_lo)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, q_sc, k_base, v_base, ks_base, offs_m, offs_d,
                               lo, tl.minimum(full_lo, hi), Sk, diag, win_left, win_right,
                               sks, skd, svs, svd, QK_MODE, PV_FP8, K_SCALE_ROWS, True, BLOCK_N, INTERPRET,
                               TMA, HEAD_DIM, KS_TILE)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, q_sc, k_base, v_base, ks_base, offs_m, offs_d,
                               full_lo, full_hi, Sk, diag, win_left, win_right,
                               sks, skd, svs, svd, QK_MODE, PV_FP8, K_SCALE_ROWS, False, BLOCK_N, INTERPRET,
                               TMA, HEAD_DIM, KS_TILE)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, q_sc, k_base, v_base, ks_base, offs_m, offs_d,
                               full_hi, hi, Sk, diag, win_left, win_right,
                               sks, skd, svs, svd, QK_MODE, PV_FP8, K_SCALE_ROWS, True, BLOCK_N, INTERPRET,
                               TMA, HEAD_DIM, KS_TILE)

    # ---- epilogue
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # FP8 P·V: acc and l both carry the factor 448
    if V_SCALED:  # FP8 V, or BF16 V carried in FP16: one dequantization scale per channel
        vs = tl.load(VS + b64 * svsb + hk * svsh + offs_d)
        out = out * vs[None, :]
    tl.store(o_base + offs_m.to(tl.int64)[:, None] * sos + offs_d[None, :] * sod, out.to(O.dtype.element_ty),
             mask=row_ok[:, None])
    if RETURN_LSE:
        lse2 = m_i + tl.log2(l_i)
        if PV_FP8:
            lse2 -= 8.807354922057604  # l summed p·448
        if HAS_KMEAN:  # undo K smoothing: true scores are higher by (q·q_scale)·mean(k)
            km = tl.load(KM + b64 * skmb + hk * skmh + offs_d)
            lse2 += tl.sum(q.to(tl.float32) * km[None, :], 1) * q_sc
        tl.store(lse_base + offs_m.to(tl.int64) * sls, lse2 * 0.6931471805599453, mask=row_ok)


# ============================================================================ configs / autotune
def fwd_configs():
    """Small config generator (BLOCK_M, BLOCK_N, warps, stages); ``prune_fwd_configs`` filters it by shape."""
    out = []
    for bm in (64, 128):
        for bn in (64, 128):
            for warps in (4, 8):
                for stages in (2, 3):
                    out.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages))
    return out


def prune_fwd_configs(configs, named_args, **kwargs):
    """Keep at most a handful of configs known to be sensible on Hopper for this shape:
    one warpgroup per 64 query rows (BLOCK_M // 16 warps), no tiles longer than the sequence,
    D <= 64: 3 stages and allow 128-wide key tiles; D = 128: 128x128 tiles only with 2 stages
    (shared memory); D = 256: 64x64 tiles."""
    bucket = named_args["SEQ_BUCKET"]
    d = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM"))
    keep = []
    for c in configs:
        bm, bn, w, st = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages
        if w != bm // 16:
            continue
        if bm > max(64, bucket) or bn > max(64, bucket):
            continue
        if d >= 256 and (bm, bn, st) != (64, 64, 2):
            continue
        if d <= 64 and st != 3:
            continue
        if d == 128 and ((bn == 128 and st != 2) or (bn == 64 and st != 3)):
            continue
        keep.append(c)
    return keep or configs[:1]


_TUNE_KEY = ["SEQ_BUCKET", "win_left", "win_right", "H", "GROUP", "HEAD_DIM", "QK_MODE", "PV_FP8",
             "Q_SCALE_ROWS", "K_SCALE_ROWS", "HAS_KMEAN", "RETURN_LSE", "VARLEN", "TMA", "V_SCALED"]
# The launches of an eager call without Triton's per-call argument binding (~20-40 us each on the host, four a
# quantized call): the compiled kernel is reused by its specialization key (lowbit._launch.SpecializedLaunch)
_PREPASS_STATS = SpecializedLaunch(_prepass_stats_kernel)
_PREPASS_FINALIZE = SpecializedLaunch(_prepass_finalize_kernel)
_PREPASS_CODES = SpecializedLaunch(_prepass_codes_kernel)
_ATTN_FWD = SpecializedLaunch(attn_fwd)

_attn_fwd_tuned = triton.autotune(configs=fwd_configs(), key=_TUNE_KEY,
                                  prune_configs_by={"early_config_prune": prune_fwd_configs})(attn_fwd)

INTERPRETED = isinstance(attn_fwd, _Interp) if _Interp else False


def heavy_first_pays(k, v, *, B: int, Hkv: int, Sk: int, varlen: bool, device) -> bool:
    """Whether a causal call of the Triton kernel launches its query blocks heaviest first across all heads rather
    than head by head: dense calls whose K and V take at most ``HEAVY_FIRST_MAX_L2_CACHES`` L2 caches. The blocks
    start in launch order as SMs free up; head by head, the last heads' heaviest blocks start last and the SMs finish
    unevenly. Heaviest first evens that out, but each wave of blocks reads every head's keys. Measured on an H200:
    it picked the faster order at sixteen (shape, mode) pairs (BENCHMARKS.md)."""
    if varlen:
        return False
    kv_bytes = B * Hkv * Sk * k.shape[-1] * (k.element_size() + v.element_size())
    return device.type == "cuda" and _gluon.heavy_first_kv_fits(kv_bytes, device)


def heuristic_config(max_seqlen_q: int, head_dim: int):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) used when autotuning is off."""
    if INTERPRETED:
        return 32, 32, 4, 1
    if max_seqlen_q <= 64:
        return 64, 64, 4, 3
    return (128, 64, 8, 3) if head_dim <= 128 else (64, 64, 4, 2)


def _autotune_enabled() -> bool:
    return env.get("LOWBIT_AUTOTUNE") and not INTERPRETED


def tma_enabled(k, v, kv, vv, pv_fp8: bool, varlen: bool) -> bool:
    """K/V tiles through TMA tensor descriptors where TMA's rules hold: a unit-stride inner dim (head_dim for K
    and 16-bit V; the sequence for FP8 V, which is stored sequence-contiguous), a 16-byte aligned data pointer
    and 16-byte multiples for the other strides. Not for varlen FP8 V: a packed sequence starts at any byte of
    its sequence-contiguous row, and a descriptor's base (or inner start coordinate) must be 16-byte aligned.
    kv / vv: (stride_b, stride_h, stride_s, stride_d) as the kernel gets them.

    ``LOWBIT_TMA=0`` turns it off (pointer loads, same bits); on by default: up to 1.36x faster for the INT8 / FP8
    variants, even for BF16."""
    if not env.get("LOWBIT_TMA") or (varlen and pv_fp8):
        return False
    for t, st, inner in ((k, kv, 3), (v, vv, 2 if pv_fp8 else 3)):
        if st[inner] != 1 or t.data_ptr() % 16:
            return False
        if any((x * t.element_size()) % 16 for i, x in enumerate(st) if i != inner):
            return False
    ensure_tma_allocator()
    return True


# ============================================================================ launchers
def _f32(x: float) -> float:
    """x rounded to the nearest FP32 (what a float32 tensor holds), without a tensor."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _seq_len(x, layout, varlen, cu, max_seqlen):
    """(B, H, S, D) of a dense tensor, or of a packed (T, H, D) one with B and the longest S from cu_seqlens."""
    if varlen:
        S = int(max_seqlen) if max_seqlen is not None else int((cu[1:] - cu[:-1]).max())
        return cu.numel() - 1, x.shape[1], S, x.shape[2]
    if layout == "bhsd":
        return tuple(x.shape)
    B, S, H, D = x.shape
    return B, H, S, D


# Launch parameters, from a sweep over them on the H200: the whole INT8·FP8 prepass runs at 0.92 of copy speed for
# its bytes with these.
_STAT_CHUNK = None  # key rows a statistics program reads: None = 32768 elements' worth, 64..256 (256 at D <= 128)
_STAT_SUB = 16  # rows a statistics program loads at once
_STATS_WARPS = 4  # warps of the statistics + Q launch (8 for the 128 x 128 Q groups was 18% slower)
_CODES_WARPS = 4  # warps of the codes launch (8 for 64 x 128 groups was 9% slower)
_STAT_SPLIT = True  # K's sums and V's amax in separate programs of the statistics launch (4-10% faster overall)


def _p2(n: int) -> int:
    """The next power of two >= n >= 1 (triton.next_power_of_2 is a constexpr function in newer Triton: ~4 us a call
    on the host)."""
    return 1 << (n - 1).bit_length()


def _signature(t):
    """What a launch specializes on that a tensor argument (and the integers computed from it) can change."""
    return None if t is None else (tuple(t.shape), t.stride(), t.dtype, not t.data_ptr() & 15)


def _run(launch, grid, key, args, kwargs):
    """``launch[grid](*args, **kwargs)`` (a SpecializedLaunch), under ``key`` (``SpecializedLaunch.keyed``) unless it
    is None."""
    if key is None:
        launch[grid](*args, **kwargs)
    else:
        launch.keyed(grid, key, args, kwargs)


_ORDERS: dict = {}  # dense calls' signatures -> fp8_v_key_order's answer


def _auto_key_order(qc, kc, qk, pv, layout, varlen, causal, window, block_k, options=DEFAULT_OPTIONS):
    """``fp8_v_key_order`` for fresh Q/K codes, cached for dense calls on what it depends on (the codes are fresh,
    contiguous and aligned: their shapes and the options decide)."""
    if pv != "fp8":
        return "natural"
    if varlen or INTERPRETED:
        return fp8_v_key_order(qc, kc, layout=layout, varlen=varlen, causal=causal, window=window,
                               k_scale_rows=block_k, gluon_options=options)
    okey = (qc.device.index, tuple(qc.shape), tuple(kc.shape), qk, layout, bool(causal),
            None if window is None else tuple(window), block_k, _gluon.mode(), options)
    order = _ORDERS.get(okey)
    if order is None:
        order = remember(_ORDERS, okey, fp8_v_key_order(qc, kc, layout=layout, varlen=varlen, causal=causal,
                                                        window=window, k_scale_rows=block_k, gluon_options=options))
    return order


def prepass_triton(q, k, v, *, qk=None, pv=None, granularity="per_block", smooth_k=True, block_q=128, block_k=64,
                   warp_q=32, softmax_scale=None, layout="bhsd", cu_seqlens_q=None, cu_seqlens_k=None,
                   max_seqlen_q=None, max_seqlen_k=None, key_order="natural", causal=False, window=None,
                   gluon_options: GluonOptions | None = None):
    """Quantize what an attention call needs in three launches: Q and K (``qk`` "int8" / "fp8", or None to leave
    them) and V (``pv`` "fp8" / "fp16", or None). Outputs equal ``quantize_qk_reference(..., k_mean=<this
    mean>)`` and ``quantize_v_fp8_reference`` / ``quantize_v_fp16_reference`` bit for bit; the K mean is the FP32
    column sums of chunks of key rows (``_STAT_CHUNK``) added in order, divided by the length
    (``reference.k_mean`` sums in torch's order: the two agree to FP32 rounding).

    ``key_order`` (FP8 V): "natural", "wgmma32" (dense only, see ``quantize_v_fp8_triton``) or "auto": what
    ``fp8_v_key_order`` says the forward kernel wants for these Q/K codes (``causal`` / ``window`` / ``block_k``
    as the forward call will get them, and ``gluon_options`` as ``attention_fwd_triton`` will get them).

    Returns (``QKQuantized`` or None, V codes or None, V scales (B, Hkv, D) or None, the key order used)."""
    if qk is None and pv is None:
        raise ValueError("prepass_triton: nothing to quantize (qk and pv are both None)")
    if pv != "fp8" and key_order not in ("natural", "auto"):
        raise ValueError(f"key_order={key_order!r} is for FP8 V, got pv={pv!r}")
    varlen = cu_seqlens_k is not None
    do_qk, x = qk is not None, (k if qk is not None else v)
    B, Hkv, Sk, D = _seq_len(x, layout, varlen, cu_seqlens_k, max_seqlen_k)
    dev = x.device
    bd = _p2(D)
    f32 = torch.float32
    if do_qk:
        _, Hq, Sq, _ = _seq_len(q, layout, varlen, cu_seqlens_q, max_seqlen_q)
        scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(D)
        qmax, code_dtype = (INT8_MAX, torch.int8) if qk == "int8" else (E4M3_MAX, torch.float8_e4m3fn)
        qrows = warp_q if granularity == "per_warp" else block_q
        nq, nq_grid, nk = n_q_groups(Sq, granularity, block_q, warp_q), -(-Sq // qrows), -(-Sk // block_k)
        # every scale group the grid covers is written (scale 1 where a group has no row); only per-warp groups
        # past the last row's block need their 1 beforehand
        q_scale = (torch.empty if nq == nq_grid else torch.ones)(B, Hq, nq, device=dev, dtype=f32)
        k_scale = torch.empty(B, Hkv, nk, device=dev, dtype=f32)
        qc = torch.empty(q.shape, device=dev, dtype=code_dtype)
        kc = torch.empty(k.shape, device=dev, dtype=code_dtype)
        km = torch.empty(B, Hkv, 1, D, device=dev, dtype=f32) if smooth_k else None
    if key_order == "auto":
        key_order = (_auto_key_order(qc, kc, qk, pv, layout, varlen, causal, window, block_k,
                                     gluon_options or DEFAULT_OPTIONS) if do_qk else "natural")
    vo = vs = vr = None
    if pv == "fp8":
        if key_order not in KEY_ORDERS:
            raise ValueError(f"key_order must be one of {KEY_ORDERS}, got {key_order!r}")
        if varlen and key_order != "natural":
            raise ValueError(f"key_order={key_order!r} needs dense V (varlen V is stored in natural key order)")
        # sequence-contiguous storage (a view of a (B, H, D, S_pad) / (H, D, T_pad) buffer): the P·V tile is K-major
        if varlen:
            T = v.shape[0]
            buf = torch.empty(Hkv, D, -(-T // 16) * 16, device=dev, dtype=torch.float8_e4m3fn)
            vo = buf[:, :, :T].permute(2, 0, 1)
        else:
            pad = 32 if key_order == "wgmma32" else 16
            buf = torch.empty(B, Hkv, D, -(-Sk // pad) * pad, device=dev, dtype=torch.float8_e4m3fn)
            vo = buf[..., :Sk].permute(0, 1, 3, 2) if layout == "bhsd" else buf[..., :Sk].permute(0, 3, 1, 2)
    elif pv == "fp16":
        vo = torch.empty_like(v, dtype=torch.float16)
    elif pv is not None:
        raise ValueError(f"pv must be 'fp8', 'fp16' or None, got {pv!r}")
    if vo is not None:
        vs = torch.empty(B, Hkv, D, device=dev, dtype=f32)
        vr = torch.empty_like(vs)
    k_sum, v_amax = do_qk and smooth_k, vo is not None
    dummy = vs if vs is not None else k_scale
    cu_q = cu_seqlens_q if (varlen and do_qk) else dummy
    cu_k = cu_seqlens_k if varlen else dummy
    z4 = (0, 0, 0, 0)
    qv = views(q, layout, varlen) if do_qk else z4  # (stride_b, stride_h, stride_s, stride_d) of each operand
    kv = views(k, layout, varlen) if do_qk else z4
    vv = views(v, layout, varlen) if v_amax else z4
    # dense: the launches' key is the call's signature (every launch argument is computed from it, the buffers are
    # fresh and aligned); varlen: each launch keys on its arguments (max_seqlen would grow a signature cache)
    key = None if varlen else (qk, pv, granularity, smooth_k, block_q, block_k, warp_q, layout, key_order,
                               _STAT_CHUNK, _STAT_SUB, _STATS_WARPS, _CODES_WARPS, _STAT_SPLIT,
                               _signature(q), _signature(k), _signature(v))
    # 1. statistics (K sums, V amax) and Q's codes
    chunk = _STAT_CHUNK or max(64, min(256, 32768 // bd))
    n_chunks = max(1, -(-Sk // chunk))
    split = bool(_STAT_SPLIT and k_sum and v_amax)
    n_stat = n_chunks * B * Hkv * (2 if split else 1) if (k_sum or v_amax) else 0
    n_qp = nq_grid * B * Hq if do_qk else 0
    pk = torch.empty(B * Hkv, n_chunks, D, device=dev, dtype=f32) if k_sum else dummy
    pvm = torch.empty(B * Hkv, n_chunks, D, device=dev, dtype=f32) if v_amax else dummy
    if n_stat + n_qp:
        sub = min(_STAT_SUB, chunk)
        _run(_PREPASS_STATS, (n_stat + n_qp,), key, (
            q if do_qk else dummy, qc if do_qk else dummy, q_scale if do_qk else dummy, k if do_qk else dummy,
            v if v_amax else dummy, pk, pvm, cu_q, cu_k,
            *qv, *(views(qc, layout, varlen) if do_qk else z4),
            q_scale.stride(0) if do_qk else 0, q_scale.stride(1) if do_qk else 0, *kv, *vv,
            Hq if do_qk else 1, Hkv, Sq if do_qk else 0, Sk, nq if do_qk else 0, nq_grid if do_qk else 1,
            n_chunks, n_stat, _f32(scale * LOG2E) if do_qk else 1.0), dict(
            Q_ROWS=qrows if do_qk else 1, Q_ROWS_P2=_p2(qrows) if do_qk else 1, BLOCK_D=bd, D=D,
            QMAX=qmax if do_qk else 1.0, TO_FP8=do_qk and qk == "fp8", CHUNK=chunk, SUB=sub, DO_Q=do_qk,
            K_SUM=k_sum, V_AMAX=v_amax, SPLIT=split, VARLEN=varlen, INTERPRET=INTERPRETED,
            num_warps=_STATS_WARPS))
    # 2. the K mean, V's scales and multipliers
    if k_sum or v_amax:
        ch = max(1, min(_p2(n_chunks), 4096 // bd))
        _run(_PREPASS_FINALIZE, (B * Hkv,), key, (
            pk, pvm, km if k_sum else dummy, vs if v_amax else dummy, vr if v_amax else dummy, cu_k, Hkv, Sk,
            n_chunks, km.stride(0) if k_sum else 0, km.stride(1) if k_sum else 0),
            dict(D=D, BLOCK_D=bd, CH=ch, K_SUM=k_sum, V_AMAX=v_amax, FP16=pv == "fp16", VARLEN=varlen, num_warps=4))
    # 3. K's and V's codes, one K scale group's rows a program
    rows = block_k if do_qk else 64
    perm = v_amax and key_order == "wgmma32"
    # "wgmma32": every position of the last 32-key chunk is written (0 past the last key: P is 0 there, and 0 · 0 = 0)
    covered = -(-Sk // 32) * 32 if perm else Sk
    _run(_PREPASS_CODES, (max(1, -(-covered // rows)), B * Hkv), key, (
        k if do_qk else dummy, kc if do_qk else dummy, k_scale if do_qk else dummy, km if k_sum else dummy,
        v if v_amax else dummy, vo if v_amax else dummy, vr if v_amax else dummy, cu_k,
        *kv, *(views(kc, layout, varlen) if do_qk else z4),
        k_scale.stride(0) if do_qk else 0, k_scale.stride(1) if do_qk else 0,
        km.stride(0) if k_sum else 0, km.stride(1) if k_sum else 0,
        *vv, *(views(vo, layout, varlen) if v_amax else z4),
        Hkv, Sk, nk if do_qk else 0), dict(
        ROWS=rows, ROWS_P2=_p2(rows), BLOCK_D=bd, D=D, QMAX=qmax if do_qk else 1.0,
        TO_FP8=do_qk and qk == "fp8", HAS_MEAN=k_sum, K_CODES=do_qk, V_CODES=v_amax, V_FP16=pv == "fp16",
        KEY_PERM=perm, VARLEN=varlen, INTERPRET=INTERPRETED, num_warps=_CODES_WARPS))
    qq = (QKQuantized(qc, kc, q_scale, k_scale, km, scale, qk, granularity, block_q, block_k, warp_q)
          if do_qk else None)
    return qq, vo, vs, key_order


def quantize_qk_triton(q, k, *, dtype="int8", granularity="per_block", smooth_k=True, block_q=128, block_k=64,
                       warp_q=32, softmax_scale=None, layout="bhsd", cu_seqlens_q=None, cu_seqlens_k=None,
                       max_seqlen_q=None, max_seqlen_k=None) -> QKQuantized:
    """Fused scale + quantize of Q and K (``prepass_triton`` without V): ``quantize_qk_reference`` bit for bit given
    the same K mean."""
    return prepass_triton(q, k, None, qk=dtype, granularity=granularity, smooth_k=smooth_k, block_q=block_q,
                          block_k=block_k, warp_q=warp_q, softmax_scale=softmax_scale, layout=layout,
                          cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                          max_seqlen_k=max_seqlen_k)[0]


KEY_ORDERS = ("natural", "wgmma32")


def wgmma32_position(s: torch.Tensor) -> torch.Tensor:
    """Where key ``s`` is stored in a "wgmma32" FP8 V (integer tensor in, same shape out): within each 32-key chunk
    key sigma = 16h + 8a + 2c + b (h, a, b bits, c two bits) goes to position kappa = 16h + 4c + 2a + b, the order in
    which the Gluon kernel's P·V wgmma takes P's columns from the score accumulator (attention/_gluon.py,
    ``_fa_p_operand``)."""
    return (s & ~31) | (s & 0x11) | ((s << 1) & 0xC) | ((s >> 2) & 0x2)


def quantize_v_fp8_triton(v, *, layout="bhsd", cu_seqlens_k=None, max_seqlen_k=None, key_order="natural"):
    """V -> (E4M3 codes, fp32 scale (B, Hkv, D)) = ``quantize_v_fp8_reference`` bit for bit.

    The codes have v's logical shape but are stored sequence-contiguous (a view of a
    (B, H, D, S_pad) / (H, D, T_pad) buffer), so the P·V tile is K-major, as Hopper FP8 MMA needs.
    Three launches (``prepass_triton``): per-chunk channel amax, the scales (amax/448 and the multiplier 448/amax),
    the codes.

    ``key_order="wgmma32"`` (dense only): the keys are stored in the Gluon kernel's order (``wgmma32_position``),
    the buffer padded to whole 32-key chunks with zero codes; the returned view's key index is then the storage
    position, not the key (only ``attention_fwd_triton(..., v_key_order="wgmma32")`` reads it right).
    """
    _, v8, vs, _ = prepass_triton(None, None, v, pv="fp8", layout=layout, cu_seqlens_k=cu_seqlens_k,
                                  max_seqlen_k=max_seqlen_k, key_order=key_order)
    return v8, vs


def _wgmma32_storage(v8, layout):
    """The (B, H, D, whole 32-key chunks) storage view of a "wgmma32" FP8 V; ValueError where v8 is not laid out as
    ``quantize_v_fp8_triton(key_order="wgmma32")`` makes it (sequence-contiguous, its buffer padded to whole chunks):
    the kernels read up to the padded end."""
    S = v8.shape[2] if layout == "bhsd" else v8.shape[1]
    st = v8.permute(0, 1, 3, 2) if layout == "bhsd" else v8.permute(0, 2, 3, 1)  # (B, H, D, S) storage view
    s32 = -(-S // 32) * 32
    last = v8.storage_offset() + sum((n - 1) * x for n, x in zip(st.shape[:3] + (s32,), st.stride()))
    if st.stride(3) != 1 or last >= v8.untyped_storage().nbytes():
        raise ValueError(f"v_key_order='wgmma32' needs V as quantize_v_fp8_triton(key_order='wgmma32') stores it "
                         f"(sequence-contiguous, padded to whole 32-key chunks); got strides {tuple(v8.stride())} "
                         f"over a buffer of {v8.untyped_storage().nbytes()} bytes")
    return st.as_strided(st.shape[:3] + (s32,), st.stride())


def _v_natural_order(v8, layout):
    """A "wgmma32" FP8 V (``quantize_v_fp8_triton``) -> the same codes in natural key order (a fresh buffer)."""
    S = v8.shape[2] if layout == "bhsd" else v8.shape[1]
    full = _wgmma32_storage(v8, layout)  # (B, H, D, whole chunks), inside the buffer
    pos = wgmma32_position(torch.arange(S, device=v8.device))
    buf = torch.empty(full.shape[:3] + (-(-S // 16) * 16,), device=v8.device, dtype=v8.dtype)
    buf[..., :S] = full.index_select(3, pos)
    return buf[..., :S].permute(0, 1, 3, 2) if layout == "bhsd" else buf[..., :S].permute(0, 3, 1, 2)


def fp8_v_key_order(q, k, *, layout="bhsd", varlen=False, causal=False, window=None, k_scale_rows=64,
                    gluon_options: GluonOptions | None = None) -> str:
    """The key order ``attention_fwd_triton`` wants an FP8 V in for an INT8·FP8 call on these quantized q, k:
    "wgmma32" where the Gluon kernel takes the call (V quantized that way by the prepass, no extra pass), else
    "natural" (``gluon_options``: as ``attention_fwd_triton`` will get them)."""
    if varlen or INTERPRETED or q.dtype != torch.int8:
        return "natural"
    if _gluon.mode() == "0":
        return "natural"
    left, right = _window_bounds(causal, window)
    reason = _gluon.why_not_qk(q, k, qk_mode=1, varlen=varlen, left=left, right=right, big=BIG,
                               k_scale_rows=k_scale_rows, qv=views(q, layout, False), kv=views(k, layout, False),
                               device=q.device, options=gluon_options or DEFAULT_OPTIONS)
    return "wgmma32" if reason is None else "natural"


def _window_bounds(causal, window):
    """(left, right) of a call: -1 in ``window`` is unbounded (BIG), causal caps right at 0."""
    left, right = (-1, -1) if window is None else (int(window[0]), int(window[1]))
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return (BIG if left < 0 else left), (BIG if right < 0 else right)


def quantize_v_fp16_triton(v, *, layout="bhsd", cu_seqlens_k=None, max_seqlen_k=None):
    """BF16 V -> (FP16 V with v's layout, fp32 power-of-two scale (B, Hkv, D)) = ``quantize_v_fp16_reference``.

    Per (batch, head, channel) V is multiplied by 2^e (e = 15 - floor(log2 amax), so amax lands in [2^15, 65280])
    and rounded to FP16: exact wherever the result is a normal FP16 number (BF16 has 8 significant bits, FP16 11),
    and the kernel's output is multiplied back by the exact 2^-e."""
    _, v16, vs, _ = prepass_triton(None, None, v, pv="fp16", layout=layout, cu_seqlens_k=cu_seqlens_k,
                                   max_seqlen_k=max_seqlen_k)
    return v16, vs


_UNSET = object()
# dense INT8·FP8 call signature -> _gluon.why_not's answer (None: the Gluon kernel runs it); a signature in it also
# passed the V key-order check (_wgmma32_storage), which runs before why_not in the call that stored it
_WHY_NOT: dict = {}


def attention_fwd_triton(q, k, v, *, q_scale=None, k_scale=None, v_scale=None, k_mean=None,
                         q_scale_rows=128, k_scale_rows=64, softmax_scale=None, causal=False, window=None,
                         layout="bhsd", cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                         max_seqlen_k=None, return_lse=False, out_dtype=None, config=None, v_key_order="natural",
                         gluon_options: GluonOptions | None = None, out_like=None, heavy_first: bool | None = None):
    """Launch the forward kernel on already-prepared operands (no validation here: see api.py).

    q, k: 16-bit (QK_MODE 0), int8 (1) or float8_e4m3fn (2); v: 16-bit, float8_e4m3fn + v_scale, or float16
    + v_scale (BF16 V carried in FP16 by ``quantize_v_fp16_triton``; the output is multiplied by v_scale).
    ``config`` = (BLOCK_M, BLOCK_N, num_warps, num_stages) forces a config (tests); otherwise
    autotuned unless LOWBIT_AUTOTUNE=0. ``v_key_order``: how an FP8 v's keys are stored
    (``quantize_v_fp8_triton``'s ``key_order``; ``fp8_v_key_order`` says which the call wants); a "wgmma32" V that
    the Gluon kernel cannot take is put back in natural order first (one extra pass over V). ``gluon_options``: how
    the Gluon kernel runs a dense INT8·FP8 call it takes (``_gluon.GluonOptions``; default: the measured choices).
    ``out_like``: a tensor of q's shape whose memory order the output takes (``torch.empty_like``; e.g. the 16-bit Q
    a quantized q was made from, a (B, H, S, D) view of a (B, S, H, D) tensor); None: contiguous. ``heavy_first``
    (causal without a window, the Triton kernel): True launches every head's last query block first, then every
    head's one before, ...; False each head's query blocks together, last first; None: as ``heavy_first_pays``
    (tests and benchmarks).
    """
    options = gluon_options or DEFAULT_OPTIONS
    if v_key_order not in KEY_ORDERS:
        raise ValueError(f"v_key_order must be one of {KEY_ORDERS}, got {v_key_order!r}")
    varlen = cu_seqlens_q is not None
    gkey = None
    if config is None and not varlen and q.dtype == torch.int8 and v.dtype == torch.float8_e4m3fn and not INTERPRETED:
        # dense INT8·FP8: what the Gluon kernel's choice and launch depend on (see below)
        gkey = (q.device.index, _signature(q), _signature(k), _signature(v), v.storage_offset(),
                v.untyped_storage().nbytes(), _signature(q_scale), _signature(k_scale), _signature(v_scale),
                _signature(k_mean), q_scale_rows, k_scale_rows, bool(causal), None if window is None else tuple(window),
                bool(return_lse), out_dtype, None if out_like is None else out_like.stride(),
                layout, v_key_order, _gluon.mode(), options)
    if v_key_order != "natural" and gkey not in _WHY_NOT:
        if v.dtype != torch.float8_e4m3fn:
            raise ValueError(f"v_key_order={v_key_order!r} is for FP8 V, got v of dtype {v.dtype}")
        if cu_seqlens_q is not None:
            raise ValueError(f"v_key_order={v_key_order!r} needs dense V (varlen V is stored in natural key order)")
        _wgmma32_storage(v, layout)
    B, Hq, Sq, D = _seq_len(q, layout, varlen, cu_seqlens_q, max_seqlen_q)
    _, Hkv, Sk, _ = _seq_len(k, layout, varlen, cu_seqlens_k, max_seqlen_k)
    qk_mode = {torch.int8: 1, torch.float8_e4m3fn: 2}.get(q.dtype, 0)
    pv_fp8 = v.dtype == torch.float8_e4m3fn
    if out_dtype is None:
        out_dtype = v.dtype if not pv_fp8 else torch.bfloat16
    if out_like is None:
        o = torch.empty(q.shape, device=q.device, dtype=out_dtype)
    else:
        if tuple(out_like.shape) != tuple(q.shape) or out_like.device != q.device:
            raise ValueError(f"out_like must have q's shape {tuple(q.shape)} on {q.device}, got "
                             f"{tuple(out_like.shape)} on {out_like.device}")
        o = torch.empty_like(out_like, dtype=out_dtype)
    if varlen:
        lse = torch.empty(Hq, q.shape[0], device=q.device, dtype=torch.float32) if return_lse else o
        sl = (0, lse.stride(0), lse.stride(1)) if return_lse else (0, 0, 0)
    else:
        lse = torch.empty(B, Hq, Sq, device=q.device, dtype=torch.float32) if return_lse else o
        sl = lse.stride() if return_lse else (0, 0, 0)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(D)
    left, right = _window_bounds(causal, window)
    dummy = o
    qs = q_scale if q_scale is not None else dummy
    ks = k_scale if k_scale is not None else dummy
    vs = v_scale if v_scale is not None else dummy
    km = k_mean if (k_mean is not None and qk_mode != 0) else None
    qv, kv, vv, ov = (views(t, layout, varlen) for t in (q, k, v, o))
    if config is None and qk_mode == 1 and pv_fp8 and not INTERPRETED:
        # INT8 Q·Kᵀ + FP8 P·V: the warp-specialized kernel where it applies
        gmode = _gluon.mode()
        if gmode != "0":
            # dense calls: the decision, the V check above and the launch's arguments once per signature (gkey)
            reason = _WHY_NOT.get(gkey, _UNSET) if gkey is not None else _UNSET
            if reason is _UNSET:
                reason = _gluon.why_not(q, k, v, qk_mode=qk_mode, pv_fp8=pv_fp8, v_scaled=v_scale is not None,
                                        varlen=varlen, left=left, right=right, big=BIG, k_scale_rows=k_scale_rows,
                                        qv=qv, kv=kv, vv=vv, ov=ov, device=q.device, v_key_order=v_key_order,
                                        options=options)
                if gkey is not None:
                    remember(_WHY_NOT, gkey, reason)
            if reason is None:
                _gluon.launch(q, k, v, o, lse, q_scale, k_scale, v_scale, km, qv=qv, kv=kv, vv=vv, ov=ov, sl=sl,
                              B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=Sk,
                              q_scale_rows=q_scale_rows, k_scale_rows=k_scale_rows, right=right,
                              return_lse=return_lse, reverse_m=right != BIG, key=gkey, options=options)
                return (o, lse) if return_lse else o
            if gmode == "force":
                raise RuntimeError(f"LOWBIT_ATTN_GLUON=force, but the Gluon kernel cannot run this call: {reason}")
    if v_key_order != "natural":  # the Triton kernel reads V in natural key order
        v = _v_natural_order(v, layout)
        vv = views(v, layout, varlen)
    args = [q, k, v, o, lse, qs, ks, vs, km if km is not None else dummy,
            cu_seqlens_q if varlen else dummy, cu_seqlens_k if varlen else dummy,
            *qv, *kv, *vv, *ov,
            qs.stride(0) if q_scale is not None else 0, qs.stride(1) if q_scale is not None else 0,
            ks.stride(0) if k_scale is not None else 0, ks.stride(1) if k_scale is not None else 0,
            vs.stride(0) if v_scale is not None else 0, vs.stride(1) if v_scale is not None else 0,
            km.stride(0) if km is not None else 0, km.stride(1) if km is not None else 0,
            *sl, Hq, Hq // Hkv, Sq, Sk, scale * LOG2E, left, right, triton.next_power_of_2(max(Sq, 1))]
    meta = dict(QK_MODE=qk_mode, PV_FP8=pv_fp8, V_SCALED=v_scale is not None, Q_SCALE_ROWS=q_scale_rows,
                K_SCALE_ROWS=k_scale_rows,
                HAS_KMEAN=km is not None, RETURN_LSE=bool(return_lse), VARLEN=varlen,
                REVERSE_M=right != BIG, HEAD_DIM=D, INTERPRET=INTERPRETED,
                TMA=tma_enabled(k, v, kv, vv, pv_fp8, varlen))
    # heavy first: causal without a window, its query blocks (of at least 16 rows) within grid dimension 1's limit
    heavy = bool(causal) and window is None and -(-Sq // 16) <= 65535 and (
        heavy_first_pays(k, v, B=B, Hkv=Hkv, Sk=Sk, varlen=varlen, device=q.device) if heavy_first is None
        else bool(heavy_first))
    if heavy:
        meta["HEAVY_FIRST"] = True

    def grid(bm):
        return (B * Hq, triton.cdiv(Sq, bm)) if heavy else (triton.cdiv(Sq, bm), B * Hq)

    if config is None and _autotune_enabled():
        _attn_fwd_tuned[lambda mt: grid(mt["BLOCK_M"])](*args, **meta)
    else:
        bm, bn, warps, stages = config or heuristic_config(Sq, D)
        _ATTN_FWD[grid(bm)](*args, **meta, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
    return (o, lse) if return_lse else o
