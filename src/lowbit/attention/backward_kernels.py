"""Triton kernels for the flash-attention backward (and a 16-bit forward with Philox dropout).

One kernel family, ``tl.constexpr`` switches, no copied variants:

* ``bwd_preprocess``: ``delta = rowsum(dO · O)`` in FP32 and the LSE converted to log2 units
  (``lse2 = lse · log2 e``, rows that saw no key: ``+inf`` so every recomputed probability is 0).
* ``bwd_dkdv``: one program per (key block, batch · kv-head); loops over the ``GROUP`` query
  heads of its kv head (GQA/MQA: dK/dV are summed over the group in registers, no atomics) and
  over the query blocks that can see the key block.  FP32 accumulators.
* ``bwd_dq``: one program per (query block, batch · query head); loops over the visible key
  blocks.  FP32 accumulator.  Splitting dQ from dK/dV recomputes Q·Kᵀ and dO·Vᵀ once more but
  needs no atomics, so every gradient is complete in FP32 when its program ends — which is what
  lets the epilogue quantize it to FP8 (a per-row or per-tensor scale needs the final value).
* Epilogue (``QMODE``): 0 = store in the output's dtype (bf16/fp16/fp32); 1 = per-tensor given
  scale: ``q = sat_rne(g · scale)``; 2 = per-row scale along head_dim computed here:
  ``scale = fmax / amax_row`` (0 -> 1, inf -> FP32 max), ``q = sat_rne(g · scale)``, ``1/scale``
  stored.  Modes 1 and 2 also atomic-max (relaxed) the tensor's amax.  The casts saturate to ±fmax
  and round to nearest even (= ``lowbit.formats.cast_to_format``).
* Dropout (``DROPOUT``): element (b, h, i, j) of the attention matrix has counter
  ``offset + ((b·Hq + h)·DROP_SQ + i)·DROP_SK + j`` (DROP_SQ/SK = Sq/Sk dense, max_seqlen_q/k
  varlen) and is kept iff ``(randint(seed, counter) >> 8) · 2^-24 >= p`` (Philox-4x32-10, first
  output, as ``tl.randint`` and ``lowbit.formats.philox_randint``); kept values are scaled by
  ``1/(1-p)``.  The mask is regenerated, never stored.
* causal / sliding window: runtime ints, bottom-right aligned (see ``attention.reference``);
  tiles are split into masked ranges and a mask-free middle range.
* layouts via strides; varlen via ``cu_seqlens``; all base offsets in int64.

Under ``TRITON_INTERPRET=1`` (``INTERPRET``) the interpreter's defects are worked around as in
the forward: 16-bit dots run in FP32 (exact), FP32 -> bf16 rounding is done by hand, and FP8
casts are emulated on the FP32 grid first.
"""
from __future__ import annotations

import triton
import triton.language as tl

try:  # InterpretedFunction is what triton.jit returns under TRITON_INTERPRET=1
    from triton.runtime.interpreter import InterpretedFunction as _Interp
except Exception:  # pragma: no cover
    _Interp = ()

BIG = 1 << 30  # "no window limit"
FP32_MAX = 3.4028234663852886e38


# ============================================================================ device helpers
@triton.jit
def _dot(a, b, INTERPRET: tl.constexpr):
    if INTERPRET:  # the interpreter's 16-bit dot is wrong; FP32 is exact for 16-bit inputs
        r = tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        r = tl.dot(a, b)
    return r


@triton.jit
def _to16(x, dt: tl.constexpr, INTERPRET: tl.constexpr):
    """FP32 -> 16-bit, round to nearest even (by hand for bf16 in the interpreter, which truncates)."""
    if INTERPRET:
        if dt == tl.bfloat16:
            bits = x.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            x = bits.to(tl.float32, bitcast=True)
    return x.to(dt)


@triton.jit
def _snap(x, EMIN: tl.constexpr, MANT: tl.constexpr):
    """Interpreter only: round |x| to the FP8 grid in exact FP32 arithmetic (ulp = 2^(e - MANT),
    e >= EMIN biased), keeping the sign bit (so -0 and tiny negatives stay -0)."""
    bits = x.to(tl.int32, bitcast=True)
    e = tl.maximum((bits >> 23) & 0xFF, EMIN)
    ulp = ((e - MANT) << 23).to(tl.float32, bitcast=True)
    big = ulp * 12582912.0
    a = (tl.abs(x) + big) - big
    return (a.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def _sat_fp8(x, FMT: tl.constexpr, EMULATE: tl.constexpr):
    """Saturating RNE cast FP32 -> FP8 (FMT 1 = E4M3, 2 = E5M2).

    On the GPU Triton lowers this cast to ``cvt.rn.satfinite.e4m3x2/e5m2x2.f32``, which already clamps
    to ±fmax (±inf -> ±fmax, NaN stays NaN, as ``lowbit.formats.cast_to_format``), so no min/max is
    spent per element; the interpreter's cast does not saturate, so there we clamp and round by hand."""
    if FMT == 1:
        if EMULATE:
            x = tl.minimum(tl.maximum(x, -448.0), 448.0)
            x = _snap(x, 121, 3)  # smallest normal 2^-6
        y = x.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    else:
        if EMULATE:
            x = tl.minimum(tl.maximum(x, -57344.0), 57344.0)
            x = _snap(x, 113, 2)  # smallest normal 2^-14
        y = x.to(tl.float8e5, fp_downcast_rounding="rtne")
    return y


@triton.jit
def _keep(seed, idx, p_drop):
    r = tl.randint(seed, idx)
    u = (r >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2^-24
    return u >= p_drop


@triton.jit
def _max2(a0, b0, a1, b1):
    return tl.maximum(a0, a1), tl.maximum(b0, b1)


@triton.jit
def _amax_add(AMAX, a):
    """Fold a tile's amax into the tensor's: a *relaxed* integer max on the FP32 bit pattern (a >= 0, so integer
    order is float order; +NaN sorts above +inf).  Triton's default ``acq_rel`` atomic puts a GPU-scope fence and
    an L1 invalidate around it (waiting for every store before it); nothing in the kernel reads the amax back, so
    no ordering is needed (the host reads it after the launch)."""
    tl.atomic_max(AMAX.to(tl.pointer_type(tl.int32)), a.to(tl.int32, bitcast=True), sem="relaxed")


@triton.jit
def _fp8_codes(g, row_amax, row_ok, row_scale_ptrs, SCALE,
               QMODE: tl.constexpr, FMT: tl.constexpr, FMAX: tl.constexpr, EMULATE: tl.constexpr):
    """FP8 codes of one FP32 gradient tile: given scale (QMODE 1) or per-row scales ``fmax / row_amax`` (QMODE 2;
    0 -> 1, inf -> FP32 max), whose inverses are stored here."""
    if QMODE == 1:
        s = tl.load(SCALE)
        y = g * s
    else:
        s = tl.math.div_rn(tl.zeros_like(row_amax) + FMAX, row_amax)
        s = tl.where(row_amax == 0.0, 1.0, s)
        s = tl.where(s == float("inf"), 3.4028234663852886e38, s)
        y = g * s[:, None]
        tl.store(row_scale_ptrs, tl.math.div_rn(tl.zeros_like(s) + 1.0, s), mask=row_ok)
    return _sat_fp8(y, FMT, EMULATE)


# The FP8 epilogues below cost about three instructions per element (|g| max, the scale multiply, the saturating
# convert) beside the 16-bit one's convert, and are ordered so the FP8 stores do not wait for the tensor amax:
# with one 8-warp program per SM nothing hides an epilogue, so its serial latency is what the FP8 variant pays.
# * rows outside the tensor leave the amax per row (``row_ok``), not by a select per element (their gradient
#   rows are zero anyway: masked P);
# * the per-row amax feeds the scales and the stores first; the cross-warp reduction to the tensor amax (shared
#   memory + barriers) comes after the stores, and its atomic is relaxed (``_amax_add``);
# * dK and dV share one pass for their row maxima and one cross-warp reduction for their two amaxes;
# * no clamp before the cast (``_sat_fp8``).
# The codes, scales and amaxes are bit-identical to a clamp / select / reduce-then-store formulation.
# With these the per-row FP8 dK/dV kernel runs within ~1% of the BF16 one (it was 8.8% slower before).
@triton.jit
def _store_grad(g, ptrs, mask, row_ok, row_scale_ptrs, SCALE, AMAX,
                QMODE: tl.constexpr, FMT: tl.constexpr, FMAX: tl.constexpr, EMULATE: tl.constexpr):
    """Write one FP32 gradient tile (rows x head_dim): plain, or FP8 with given / per-row scales."""
    if QMODE == 0:
        tl.store(ptrs, g.to(ptrs.dtype.element_ty), mask=mask)
    else:
        row_amax = tl.where(row_ok, tl.max(tl.abs(g), 1), 0.0)
        tl.store(ptrs, _fp8_codes(g, row_amax, row_ok, row_scale_ptrs, SCALE, QMODE, FMT, FMAX, EMULATE), mask=mask)
        _amax_add(AMAX, tl.max(row_amax, 0))


@triton.jit
def _store_grad2(ga, gb, ptrs_a, ptrs_b, mask, row_ok, rs_a, rs_b, SCALE_A, SCALE_B, AMAX_A, AMAX_B,
                 QMODE: tl.constexpr, FMT: tl.constexpr, FMAX: tl.constexpr, EMULATE: tl.constexpr):
    """``_store_grad`` of two tiles of one shape (dK and dV), their reductions done together."""
    if QMODE == 0:
        tl.store(ptrs_a, ga.to(ptrs_a.dtype.element_ty), mask=mask)
        tl.store(ptrs_b, gb.to(ptrs_b.dtype.element_ty), mask=mask)
    else:
        ra, rb = tl.reduce((tl.abs(ga), tl.abs(gb)), 1, _max2)
        ra = tl.where(row_ok, ra, 0.0)
        rb = tl.where(row_ok, rb, 0.0)
        tl.store(ptrs_a, _fp8_codes(ga, ra, row_ok, rs_a, SCALE_A, QMODE, FMT, FMAX, EMULATE), mask=mask)
        tl.store(ptrs_b, _fp8_codes(gb, rb, row_ok, rs_b, SCALE_B, QMODE, FMT, FMAX, EMULATE), mask=mask)
        am_a, am_b = tl.reduce((ra, rb), 0, _max2)
        _amax_add(AMAX_A, am_a)
        _amax_add(AMAX_B, am_b)


# ============================================================================ preprocess
@triton.jit
def bwd_preprocess(O, DO, LSE, DELTA, LSE2, CUQ,
                    sob, soh, sos, sod, sdob, sdoh, sdos, sdod, slb, slh, sls, sdb, sdh, sds,
                    H, Sq, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, VARLEN: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    if VARLEN:
        q0 = tl.load(CUQ + b)
        Sq = tl.load(CUQ + b + 1) - q0
        o_base = O + q0.to(tl.int64) * sos + h.to(tl.int64) * soh
        do_base = DO + q0.to(tl.int64) * sdos + h.to(tl.int64) * sdoh
        l_base = LSE + q0.to(tl.int64) * sls + h.to(tl.int64) * slh
        d_off = q0.to(tl.int64) * sds + h.to(tl.int64) * sdh
    else:
        o_base = O + b.to(tl.int64) * sob + h.to(tl.int64) * soh
        do_base = DO + b.to(tl.int64) * sdob + h.to(tl.int64) * sdoh
        l_base = LSE + b.to(tl.int64) * slb + h.to(tl.int64) * slh
        d_off = b.to(tl.int64) * sdb + h.to(tl.int64) * sdh
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = offs_m < Sq
    om = offs_m.to(tl.int64)
    o = tl.load(o_base + om[:, None] * sos + offs_d[None, :] * sod, mask=ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(do_base + om[:, None] * sdos + offs_d[None, :] * sdod, mask=ok[:, None], other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    lse = tl.load(l_base + om * sls, mask=ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    tl.store(DELTA + d_off + om * sds, delta, mask=ok)
    tl.store(LSE2 + d_off + om * sds, lse2, mask=ok)


# ============================================================================ dK / dV
@triton.jit
def _dkdv_tiles(dk, dv, k, v, q_base, do_base, l_base, d_base, offs_n, offs_d, lo, hi,
                Sq, Sk, diag, win_left, win_right, sm_scale_log2, sqs, sqd, sdos, sdod, sds,
                seed, drop_base, p_drop, drop_scale, DROP_SK,
                MASK: tl.constexpr, DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr, INTERPRET: tl.constexpr):
    offs_ml = tl.arange(0, BLOCK_M)
    q_ptrs = q_base + lo.to(tl.int64) * sqs + offs_ml[:, None] * sqs + offs_d[None, :] * sqd
    do_ptrs = do_base + lo.to(tl.int64) * sdos + offs_ml[:, None] * sdos + offs_d[None, :] * sdod
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_ml
        if MASK:
            row_ok = offs_m < Sq
            q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
            do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0)
            lse2 = tl.load(l_base + offs_m * sds, mask=row_ok, other=float("inf"))
            delta = tl.load(d_base + offs_m * sds, mask=row_ok, other=0.0)
        else:
            q = tl.load(q_ptrs)
            do = tl.load(do_ptrs)
            lse2 = tl.load(l_base + offs_m * sds)
            delta = tl.load(d_base + offs_m * sds)
        sT = _dot(k, tl.trans(q), INTERPRET)  # (BLOCK_N, BLOCK_M)
        dpT = _dot(v, tl.trans(do), INTERPRET)  # dO·Vᵀ, transposed
        pT = tl.math.exp2(sT * sm_scale_log2 - lse2[None, :])
        if MASK:
            rel = offs_n[:, None] - (offs_m[None, :] + diag)
            ok = (offs_m[None, :] < Sq) & (offs_n[:, None] < Sk) & (rel <= win_right) & (rel >= -win_left)
            pT = tl.where(ok, pT, 0.0)
        if DROPOUT:
            idx = drop_base + offs_m.to(tl.int64)[None, :] * DROP_SK + offs_n[:, None]
            keep = _keep(seed, idx, p_drop)
            pdT = tl.where(keep, pT * drop_scale, 0.0)
            dpT = tl.where(keep, dpT * drop_scale, 0.0)
        else:
            pdT = pT
        dv += _dot(_to16(pdT, do.dtype, INTERPRET), do, INTERPRET)
        dsT = pT * (dpT - delta[None, :])
        dk += _dot(_to16(dsT, q.dtype, INTERPRET), q, INTERPRET)
        q_ptrs += BLOCK_M * sqs
        do_ptrs += BLOCK_M * sdos
    return dk, dv


@triton.jit(do_not_specialize=["Sq", "Sk", "win_left", "win_right", "seed", "drop_offset", "DROP_SQ",
                               "DROP_SK", "SEQ_BUCKET"])
def bwd_dkdv(Q, K, V, DO, DK, DV, LSE2, DELTA, CUQ, CUK, SCK, SCV, RSK, RSV, AMK, AMV,
              sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd, sdob, sdoh, sdos, sdod,
              sgb, sgh, sgs, sgd, srb, srh, srs, sdb, sdh, sds,
              Hkv, GROUP, Sq, Sk, sm_scale, sm_scale_log2, win_left, win_right,
              seed, drop_offset, p_drop, drop_scale, DROP_SQ, DROP_SK, SEQ_BUCKET,
              QMODE: tl.constexpr, FMT: tl.constexpr, FMAX: tl.constexpr, DROPOUT: tl.constexpr,
              VARLEN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              INTERPRET: tl.constexpr):
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    b = bhk // Hkv
    hk = bhk % Hkv
    b64 = b.to(tl.int64)
    if VARLEN:
        q0 = tl.load(CUQ + b)
        k0 = tl.load(CUK + b)
        Sq = tl.load(CUQ + b + 1) - q0
        Sk = tl.load(CUK + b + 1) - k0
        q_off = q0.to(tl.int64) * sqs
        do_off = q0.to(tl.int64) * sdos
        d_off0 = q0.to(tl.int64) * sds
        k_base = K + k0.to(tl.int64) * sks + hk.to(tl.int64) * skh
        v_base = V + k0.to(tl.int64) * svs + hk.to(tl.int64) * svh
        g_off = k0.to(tl.int64) * sgs + hk.to(tl.int64) * sgh
        r_off = k0.to(tl.int64) * srs + hk.to(tl.int64) * srh
    else:
        q_off = b64 * sqb
        do_off = b64 * sdob
        d_off0 = b64 * sdb
        k_base = K + b64 * skb + hk.to(tl.int64) * skh
        v_base = V + b64 * svb + hk.to(tl.int64) * svh
        g_off = b64 * sgb + hk.to(tl.int64) * sgh
        r_off = b64 * srb + hk.to(tl.int64) * srh
    n0 = pid_n * BLOCK_N
    if n0 >= Sk:
        return
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n < Sk
    on = offs_n.to(tl.int64)
    k = tl.load(k_base + on[:, None] * sks + offs_d[None, :] * skd, mask=col_ok[:, None], other=0.0)
    v = tl.load(v_base + on[:, None] * svs + offs_d[None, :] * svd, mask=col_ok[:, None], other=0.0)

    # ---- query rows that see this key block: masked / mask-free / masked ranges
    diag = Sk - Sq
    lo = tl.maximum(n0 - diag - win_right, 0)
    lo = (lo // BLOCK_M) * BLOCK_M
    hi = tl.minimum(Sq, n0 + BLOCK_N - diag + win_left)
    full_lo = tl.maximum(n0 + BLOCK_N - 1 - diag - win_right, lo)
    full_lo = ((full_lo + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    full_end = tl.maximum(tl.minimum(Sq, n0 - diag + win_left + 1), 0)
    full_hi = tl.maximum((full_end // BLOCK_M) * BLOCK_M, full_lo)
    if n0 + BLOCK_N > Sk:  # ragged key block: every tile masked
        full_hi = full_lo
    mid = tl.minimum(full_lo, hi)

    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        q_base = Q + q_off + h.to(tl.int64) * sqh
        do_base = DO + do_off + h.to(tl.int64) * sdoh
        l_base = LSE2 + d_off0 + h.to(tl.int64) * sdh
        d_base = DELTA + d_off0 + h.to(tl.int64) * sdh
        drop_base = drop_offset + ((b64 * Hkv * GROUP + h) * DROP_SQ) * DROP_SK
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, l_base, d_base, offs_n, offs_d, lo, mid,
                             Sq, Sk, diag, win_left, win_right, sm_scale_log2, sqs, sqd, sdos, sdod, sds,
                             seed, drop_base, p_drop, drop_scale, DROP_SK, True, DROPOUT, BLOCK_M, INTERPRET)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, l_base, d_base, offs_n, offs_d, full_lo, full_hi,
                             Sq, Sk, diag, win_left, win_right, sm_scale_log2, sqs, sqd, sdos, sdod, sds,
                             seed, drop_base, p_drop, drop_scale, DROP_SK, False, DROPOUT, BLOCK_M, INTERPRET)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, l_base, d_base, offs_n, offs_d, full_hi, hi,
                             Sq, Sk, diag, win_left, win_right, sm_scale_log2, sqs, sqd, sdos, sdod, sds,
                             seed, drop_base, p_drop, drop_scale, DROP_SK, True, DROPOUT, BLOCK_M, INTERPRET)
    dk = dk * sm_scale

    # ---- epilogue: dK, dV (same shape / layout / strides)
    m2 = col_ok[:, None]
    g_ptr = on[:, None] * sgs + offs_d[None, :] * sgd + g_off
    r_ptr = on * srs + r_off
    _store_grad2(dk, dv, DK + g_ptr, DV + g_ptr, m2, col_ok, RSK + r_ptr, RSV + r_ptr, SCK, SCV, AMK, AMV,
                 QMODE, FMT, FMAX, INTERPRET)


# ============================================================================ dQ
@triton.jit
def _dq_tiles(dq, q, do, lse2, delta, k_base, v_base, offs_m, offs_d, lo, hi,
              Sq, Sk, diag, win_left, win_right, sm_scale_log2, sks, skd, svs, svd,
              seed, drop_base, p_drop, drop_scale, DROP_SK,
              MASK: tl.constexpr, DROPOUT: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr):
    offs_nl = tl.arange(0, BLOCK_N)
    k_ptrs = k_base + lo.to(tl.int64) * sks + offs_nl[:, None] * sks + offs_d[None, :] * skd
    v_ptrs = v_base + lo.to(tl.int64) * svs + offs_nl[:, None] * svs + offs_d[None, :] * svd
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_nl
        if MASK:
            k = tl.load(k_ptrs, mask=(offs_n < Sk)[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=(offs_n < Sk)[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        s = _dot(q, tl.trans(k), INTERPRET)
        dp = _dot(do, tl.trans(v), INTERPRET)
        p = tl.math.exp2(s * sm_scale_log2 - lse2[:, None])
        if MASK:
            rel = offs_n[None, :] - (offs_m[:, None] + diag)
            ok = (offs_n[None, :] < Sk) & (rel <= win_right) & (rel >= -win_left)
            p = tl.where(ok, p, 0.0)
        if DROPOUT:
            idx = drop_base + offs_m.to(tl.int64)[:, None] * DROP_SK + offs_n[None, :]
            dp = tl.where(_keep(seed, idx, p_drop), dp * drop_scale, 0.0)
        ds = p * (dp - delta[:, None])
        dq += _dot(_to16(ds, k.dtype, INTERPRET), k, INTERPRET)
        k_ptrs += BLOCK_N * sks
        v_ptrs += BLOCK_N * svs
    return dq


@triton.jit(do_not_specialize=["Sq", "Sk", "win_left", "win_right", "seed", "drop_offset", "DROP_SQ",
                               "DROP_SK", "SEQ_BUCKET"])
def bwd_dq(Q, K, V, DO, DQ, LSE2, DELTA, CUQ, CUK, SCQ, RSQ, AMQ,
            sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd, sdob, sdoh, sdos, sdod,
            sgb, sgh, sgs, sgd, srb, srh, srs, sdb, sdh, sds,
            H, GROUP, Sq, Sk, sm_scale, sm_scale_log2, win_left, win_right,
            seed, drop_offset, p_drop, drop_scale, DROP_SQ, DROP_SK, SEQ_BUCKET,
            QMODE: tl.constexpr, FMT: tl.constexpr, FMAX: tl.constexpr, DROPOUT: tl.constexpr,
            VARLEN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            INTERPRET: tl.constexpr):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # last query blocks (most keys when causal) first
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
        do_base = DO + q0.to(tl.int64) * sdos + h.to(tl.int64) * sdoh
        d_off = q0.to(tl.int64) * sds + h.to(tl.int64) * sdh
        k_base = K + k0.to(tl.int64) * sks + hk.to(tl.int64) * skh
        v_base = V + k0.to(tl.int64) * svs + hk.to(tl.int64) * svh
        g_off = q0.to(tl.int64) * sgs + h.to(tl.int64) * sgh
        r_off = q0.to(tl.int64) * srs + h.to(tl.int64) * srh
    else:
        q_base = Q + b64 * sqb + h.to(tl.int64) * sqh
        do_base = DO + b64 * sdob + h.to(tl.int64) * sdoh
        d_off = b64 * sdb + h.to(tl.int64) * sdh
        k_base = K + b64 * skb + hk.to(tl.int64) * skh
        v_base = V + b64 * svb + hk.to(tl.int64) * svh
        g_off = b64 * sgb + h.to(tl.int64) * sgh
        r_off = b64 * srb + h.to(tl.int64) * srh
    m0 = pid_m * BLOCK_M
    if m0 >= Sq:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Sq
    om = offs_m.to(tl.int64)
    q = tl.load(q_base + om[:, None] * sqs + offs_d[None, :] * sqd, mask=row_ok[:, None], other=0.0)
    do = tl.load(do_base + om[:, None] * sdos + offs_d[None, :] * sdod, mask=row_ok[:, None], other=0.0)
    lse2 = tl.load(LSE2 + d_off + om * sds, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + d_off + om * sds, mask=row_ok, other=0.0)
    drop_base = drop_offset + ((b64 * H + h) * DROP_SQ) * DROP_SK

    diag = Sk - Sq
    hi = tl.minimum(Sk, m0 + BLOCK_M + diag + win_right)
    lo = tl.maximum(m0 + diag - win_left, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    full_lo = tl.maximum(m0 + BLOCK_M - 1 + diag - win_left, lo)
    full_lo = ((full_lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    full_end = tl.maximum(tl.minimum(Sk, m0 + diag + win_right + 1), 0)
    full_hi = tl.maximum((full_end // BLOCK_N) * BLOCK_N, full_lo)
    if m0 + BLOCK_M > Sq:  # ragged query block: every tile masked
        full_hi = full_lo
    mid = tl.minimum(full_lo, hi)

    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    dq = _dq_tiles(dq, q, do, lse2, delta, k_base, v_base, offs_m, offs_d, lo, mid, Sq, Sk, diag, win_left,
                   win_right, sm_scale_log2, sks, skd, svs, svd, seed, drop_base, p_drop, drop_scale, DROP_SK,
                   True, DROPOUT, BLOCK_N, INTERPRET)
    dq = _dq_tiles(dq, q, do, lse2, delta, k_base, v_base, offs_m, offs_d, full_lo, full_hi, Sq, Sk, diag,
                   win_left, win_right, sm_scale_log2, sks, skd, svs, svd, seed, drop_base, p_drop, drop_scale,
                   DROP_SK, False, DROPOUT, BLOCK_N, INTERPRET)
    dq = _dq_tiles(dq, q, do, lse2, delta, k_base, v_base, offs_m, offs_d, full_hi, hi, Sq, Sk, diag, win_left,
                   win_right, sm_scale_log2, sks, skd, svs, svd, seed, drop_base, p_drop, drop_scale, DROP_SK,
                   True, DROPOUT, BLOCK_N, INTERPRET)
    dq = dq * sm_scale
    _store_grad(dq, DQ + om[:, None] * sgs + offs_d[None, :] * sgd + g_off, row_ok[:, None], row_ok,
                RSQ + om * srs + r_off, SCQ, AMQ, QMODE, FMT, FMAX, INTERPRET)


# ============================================================================ forward with dropout
@triton.jit(do_not_specialize=["Sq", "Sk", "win_left", "win_right", "seed", "drop_offset", "DROP_SQ", "DROP_SK"])
def fwd_dropout(Q, K, V, O, LSE, CUQ, CUK,
                 sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd, sob, soh, sos, sod, slb, slh, sls,
                 H, GROUP, Sq, Sk, sm_scale_log2, win_left, win_right,
                 seed, drop_offset, p_drop, drop_scale, DROP_SQ, DROP_SK,
                 DROPOUT: tl.constexpr, VARLEN: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr):
    """16-bit forward with Philox dropout (same counters as the backward); every tile masked.

    LSE is of the un-dropped softmax (natural log); O = Σ_j P_ij · keep_ij / (1 - p) · V_j."""
    pid_m = tl.program_id(0)
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
        l_base = LSE + q0.to(tl.int64) * sls + h.to(tl.int64) * slh
        k_base = K + k0.to(tl.int64) * sks + hk.to(tl.int64) * skh
        v_base = V + k0.to(tl.int64) * svs + hk.to(tl.int64) * svh
    else:
        q_base = Q + b64 * sqb + h.to(tl.int64) * sqh
        o_base = O + b64 * sob + h.to(tl.int64) * soh
        l_base = LSE + b64 * slb + h.to(tl.int64) * slh
        k_base = K + b64 * skb + hk.to(tl.int64) * skh
        v_base = V + b64 * svb + hk.to(tl.int64) * svh
    m0 = pid_m * BLOCK_M
    if m0 >= Sq:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_nl = tl.arange(0, BLOCK_N)
    row_ok = offs_m < Sq
    om = offs_m.to(tl.int64)
    q = tl.load(q_base + om[:, None] * sqs + offs_d[None, :] * sqd, mask=row_ok[:, None], other=0.0)
    drop_base = drop_offset + ((b64 * H + h) * DROP_SQ) * DROP_SK
    diag = Sk - Sq
    hi = tl.minimum(Sk, m0 + BLOCK_M + diag + win_right)
    lo = tl.maximum(m0 + diag - win_left, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_nl
        on = offs_n.to(tl.int64)
        k = tl.load(k_base + on[:, None] * sks + offs_d[None, :] * skd, mask=(offs_n < Sk)[:, None], other=0.0)
        v = tl.load(v_base + on[:, None] * svs + offs_d[None, :] * svd, mask=(offs_n < Sk)[:, None], other=0.0)
        s = _dot(q, tl.trans(k), INTERPRET) * sm_scale_log2
        rel = offs_n[None, :] - (offs_m[:, None] + diag)
        ok = (offs_n[None, :] < Sk) & (rel <= win_right) & (rel >= -win_left)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if DROPOUT:
            idx = drop_base + om[:, None] * DROP_SK + offs_n[None, :]
            p = tl.where(_keep(seed, idx, p_drop), p, 0.0)
        acc += _dot(_to16(p, v.dtype, INTERPRET), v, INTERPRET)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if DROPOUT:
        out = out * drop_scale
    tl.store(o_base + om[:, None] * sos + offs_d[None, :] * sod, out.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(l_base + om * sls, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=row_ok)


# ============================================================================ configs / autotune
# (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and head-dim class, best first (BENCHMARKS.md "Attention
# backward"): at D=128 the dQ kernel gains from a third stage (K/V tiles prefetched two ahead; q/dO stay resident),
# and 32x128 dK/dV tiles with 8 warps and 3 stages fit in registers without spills (64x128 spills).  At D<=64 the
# 64x64 4-warp tiles win both kernels.  D=256 keeps the earlier untuned choice.  Short sequences: 64x64.
_CANDIDATES = {
    "dkdv": {64: [(64, 64, 4, 3), (64, 128, 8, 2)], 128: [(32, 128, 8, 3), (64, 128, 8, 2)],
             256: [(64, 128, 8, 2), (32, 128, 4, 3)], "short": [(64, 64, 4, 3)]},
    "dq": {64: [(64, 64, 4, 3), (128, 64, 8, 2)], 128: [(128, 64, 8, 3), (64, 64, 4, 2)],
           256: [(128, 64, 8, 2), (128, 32, 4, 3)], "short": [(64, 64, 4, 3)]},
}
# (More candidates per kernel gave no gain beyond the run-to-run spread, so the list stays short: every candidate
# costs a compile on a model's first step.)


def _head_dim_class(head_dim: int) -> int:
    return 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256


def _candidates(kernel: str, head_dim: int, max_seqlen: int):
    return _CANDIDATES[kernel]["short" if max_seqlen <= 64 else _head_dim_class(head_dim)]


def _all_configs(kernel: str):
    seen = []
    for lst in _CANDIDATES[kernel].values():
        seen += [c for c in lst if c not in seen]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in seen]


def _pruner(kernel: str):
    def prune(configs, named_args, **kwargs):
        """Keep the candidates of this (head dim, bucketed sequence length); see ``_CANDIDATES``."""
        d = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM"))
        want = _candidates(kernel, d, named_args["SEQ_BUCKET"])
        key = lambda c: (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)  # noqa: E731
        return [c for c in configs if key(c) in want] or configs[-1:]
    return prune


_TUNE_KEY = ["SEQ_BUCKET", "win_left", "win_right", "GROUP", "HEAD_DIM", "QMODE", "FMT", "DROPOUT", "VARLEN"]
bwd_dkdv_tuned = triton.autotune(configs=_all_configs("dkdv"), key=_TUNE_KEY,
                                 prune_configs_by={"early_config_prune": _pruner("dkdv")})(bwd_dkdv)
bwd_dq_tuned = triton.autotune(configs=_all_configs("dq"), key=_TUNE_KEY,
                               prune_configs_by={"early_config_prune": _pruner("dq")})(bwd_dq)

INTERPRETED = isinstance(bwd_dq, _Interp) if _Interp else False


def heuristic_configs(head_dim: int, max_seqlen: int, causal: bool = False):
    """((dkdv BM, BN, warps, stages), (dq BM, BN, warps, stages)) when autotuning is off: the best measured.

    Causal at D=128 the dK/dV kernel prefers the second candidate, 64x128 / 8 warps / 2 stages (7% faster there
    than the non-causal winner; the autotuner sees both)."""
    if INTERPRETED:
        return (16, 32, 4, 1), (32, 16, 4, 1)
    dkdv = _candidates("dkdv", head_dim, max_seqlen)
    pick = 1 if causal and max_seqlen > 64 and _head_dim_class(head_dim) == 128 else 0
    return dkdv[pick], _candidates("dq", head_dim, max_seqlen)[0]
