"""Warp-specialized Gluon forward kernel for INT8 Q·Kᵀ + FP8 P·V on Hopper (the FlashAttention-3 structure).

The Triton kernel of ``_triton.py`` computes the same numbers but cannot overlap its parts: compiled for sm_90 every
``tl.dot`` waits for its tensor-core result right after issuing it (one wait per k32 step), and the software pipeline
recycles K/V stages with CTA-wide barriers, which keep the two warpgroups of a CTA in lockstep, so one warpgroup's
softmax never hides the other's MMAs. Here:

* one **loader warp** keeps ``STAGES`` key tiles in flight through TMA (K: BN x D int8 rows; V: FP8, stored
  sequence-contiguous, as two D x 64 halves so each half is one K-major wgmma B operand) and a stage goes back to it
  through an mbarrier as soon as both math warpgroups are done with it — no CTA-wide barrier anywhere;
* two **math warpgroups**, 64 query rows each of a 128-row tile, issue their wgmmas back to back (async) and drift
  out of step, so one's softmax runs while the other's MMAs occupy the tensor cores; within a warpgroup, tile j's
  scores and tile j - 1's P·V are issued together and tile j's softmax runs while that P·V does. P reaches the P·V
  wgmma through a shared-memory buffer of the warpgroup (carried in registers across the loop, Triton unpacked the
  FP8 operand byte by byte and spilled).

Measured on an H200 (2026-11-23, BENCHMARKS.md session 12): 1.00-1.09x cuDNN BF16 at head dim 128 against the Triton
kernel's 0.91-0.98x; latency-bound (issue slots 45% busy, a third of the stalls at warpgroup barriers). At head dim
64 the Triton kernel (two CTAs an SM) is faster, so that stays its default.

Numbers, per 128-key tile (the quantized reference's, as the Triton kernel's): two INT32 score halves of 64 keys
(one K scale each: ``K_SCALE_ROWS`` is a multiple of 64), converted to FP32 and scaled by q_scale[row]·k_scale[half]
inside the exp2's FMA; the running row max / sum update; P·448 rounded to E4M3 (saturating RNE); P·V of the tile's
128 keys accumulated by the FP8 wgmma from zero and promoted into the FP32 accumulator once per tile
(``acc·alpha + tile``); the output divided by the row sum and multiplied by V's per-channel scale.

Scope (``why_not`` gives the rule a call breaks; such calls run the Triton kernel): dense ``bhsd`` / ``bshd`` (no
varlen), head dim 128 (64 with ``LOWBIT_ATTN_GLUON=force``), no window but causal (bottom-right aligned), GQA / MQA,
optional log-sum-exp (K smoothing undone as in the Triton kernel), TMA-able strides. sm_90 only (wgmma, TMA).
"""
from __future__ import annotations

import os

import torch

from .._device import capability
from .._launch import ensure_tma_allocator

try:  # Triton >= 3.5 with Gluon's Hopper ops and warp specialization
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _wg_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # inside a partition: its warps only
    GLUON_WS = hasattr(gl, "warp_specialize")
except Exception:  # pragma: no cover - older Triton
    GLUON_WS = False

BLOCK_M = 128  # query rows a CTA: two math warpgroups of 64
BLOCK_N = 128  # keys a tile: two halves of 64 (one K scale block each)

if GLUON_WS:
    BM = gl.constexpr(BLOCK_M)
    BN = gl.constexpr(BLOCK_N)
    LOG2_448 = gl.constexpr(8.807354922057604)  # P is computed as p·448 (E4M3's range); l carries the same factor

    @gluon.jit
    def _fa_ranges(Sq, Sk, win_right, REVERSE_M: gl.constexpr):
        """(pid_m, number of mask-free key tiles, number of key tiles) of this CTA. Key tiles start at 0 (no left
        window); a tile is mask-free when every key is < Sk and inside every row's causal limit."""
        pid_m = gl.program_id(0)
        if REVERSE_M:  # causal: heaviest query blocks first
            pid_m = gl.num_programs(0) - 1 - pid_m
        m0 = pid_m * BM
        diag = Sk - Sq
        hi = gl.maximum(gl.minimum(Sk, m0 + BM + diag + win_right), 0)
        full_end = gl.maximum(gl.minimum(Sk, m0 + diag + win_right + 1), 0)
        return pid_m, full_end // BN, gl.cdiv(hi, BN)

    @gluon.jit
    def _fa_loader(qd, kd, vd, q_s, k_s, v_s, qbar, ready, empty, Sq, Sk, win_right,
                   REVERSE_M: gl.constexpr, STAGES: gl.constexpr):
        """Loader partition (one warp): the CTA's Q tile once, then every key tile's K and V halves into stage
        j % STAGES once both math warpgroups have handed that stage back (TMA zero-fills rows past Sq / Sk)."""
        pid_m, n_full, n_all = _fa_ranges(Sq, Sk, win_right, REVERSE_M)
        mbarrier.expect(qbar, qd.block_type.nbytes)
        _tma_load(qd, [pid_m * BM, 0], qbar, q_s)
        for j in range(n_all):
            s = j % STAGES
            mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1 at once
            mbarrier.expect(ready.index(s), kd.block_type.nbytes + 2 * vd.block_type.nbytes)
            _tma_load(kd, [j * BN, 0], ready.index(s), k_s.index(s))
            _tma_load(vd, [0, j * BN], ready.index(s), v_s.index(2 * s))
            _tma_load(vd, [0, j * BN + BN // 2], ready.index(s), v_s.index(2 * s + 1))

    @gluon.jit
    def _fa_qk(q, k_s, ready, j, STAGES: gl.constexpr, mma_s: gl.constexpr):
        """Wait for key tile j, issue its two INT8 score halves (async, in layout mma_s): the in-flight tokens."""
        HALF: gl.constexpr = BN // 2
        s = j % STAGES
        mbarrier.wait(ready.index(s), (j // STAGES) & 1)
        kt = k_s.index(s)
        zs = gl.zeros((BM // 2, HALF), gl.int32, mma_s)
        t0 = warpgroup_mma(q, kt.slice(0, HALF, dim=0).permute((1, 0)), zs, use_acc=False, is_async=True)
        t1 = warpgroup_mma(q, kt.slice(HALF, HALF, dim=0).permute((1, 0)), zs, use_acc=False, is_async=True)
        return t0, t1

    @gluon.jit
    def _fa_pv(p_s, pb, v_s, j, STAGES: gl.constexpr, HEAD_DIM: gl.constexpr, mma_o: gl.constexpr):
        """Issue P·V of key tile j (its two 64-key halves, P from shared memory p_s[pb], p_s[pb + 1]; FP8 wgmmas
        from zero into layout mma_o, async): the token."""
        s = j % STAGES
        zo = gl.zeros((BM // 2, HEAD_DIM), gl.float32, mma_o)
        o = warpgroup_mma(p_s.index(pb), v_s.index(2 * s).permute((1, 0)), zo, use_acc=False, is_async=True)
        return warpgroup_mma(p_s.index(pb + 1), v_s.index(2 * s + 1).permute((1, 0)), o, is_async=True)

    @gluon.jit
    def _fa_softmax(s0, s1, l_i, m_i, q_sc, ks_base, offs_m, j, Sk, diag, win_right,
                    K_SCALE_ROWS: gl.constexpr, MASK: gl.constexpr, mma_s: gl.constexpr):
        """The online-softmax update of key tile j from its INT32 score halves (layout mma_s): (P·448 halves as
        E4M3, alpha = the factor on the accumulator, l, m)."""
        HALF: gl.constexpr = BN // 2
        n0 = j * BN
        # one K scale per 64-key half (K_SCALE_ROWS is a multiple of 64); a half past Sk reads as 1
        c0 = q_sc * gl.load(ks_base + n0 // K_SCALE_ROWS)
        c1 = q_sc * gl.load(ks_base + (n0 + HALF) // K_SCALE_ROWS, mask=n0 + HALF < Sk, other=1.0)
        s0 = s0.to(gl.float32)
        s1 = s1.to(gl.float32)
        if MASK:
            cols = n0 + gl.arange(0, HALF, layout=gl.SliceLayout(0, mma_s))
            lim = offs_m[:, None] + diag + win_right  # key j is visible from row i when j - (i + diag) <= win_right
            s0 = gl.where((cols[None, :] < Sk) & (cols[None, :] <= lim), s0, float("-inf"))
            s1 = gl.where((cols[None, :] + HALF < Sk) & (cols[None, :] + HALF <= lim), s1, float("-inf"))
        # c > 0: the row max of s·c is c·max(s) (rounding is monotone), and p = exp2(s·c - m) is one FMA
        m_new = gl.maximum(m_i, gl.maximum(gl.max(s0, 1) * c0, gl.max(s1, 1) * c1))
        if MASK:  # a row may still see nothing: keep exp2 away from (-inf) - (-inf)
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        mb = m_use - LOG2_448
        p0 = gl.exp2(s0 * c0[:, None] - mb[:, None])
        p1 = gl.exp2(s1 * c1[:, None] - mb[:, None])
        alpha = gl.exp2(m_i - m_use)
        l_i = l_i * alpha + gl.sum(p0, 1) + gl.sum(p1, 1)
        p0 = p0.to(gl.float8e4nv, fp_downcast_rounding="rtne")
        p1 = p1.to(gl.float8e4nv, fp_downcast_rounding="rtne")
        return p0, p1, alpha, l_i, m_new

    @gluon.jit
    def _fa_fold(acc, o, alpha, empty, j, STAGES: gl.constexpr, mma_o: gl.constexpr):
        """Tile j's P·V is done: its stage goes back to the loader, and acc = acc·alpha + o (the FP32 promotion)."""
        mbarrier.arrive(empty.index(j % STAGES), count=1)
        a = gl.convert_layout(alpha, gl.SliceLayout(1, mma_o))
        return acc * a[:, None] + o

    @gluon.jit
    def _fa_step(acc, l_i, m_i, alpha, q, q_sc, k_s, v_s, p_s, pb, ready, empty, ks_base, offs_m, j, Sk, diag,
                 win_right, K_SCALE_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                 MASK: gl.constexpr, mma_s: gl.constexpr, mma_o: gl.constexpr):
        """Key tile j's scores and tile j - 1's P·V (its P in the warpgroup's shared buffer, alpha from its softmax)
        go to the tensor cores together; tile j's softmax runs while the P·V does; then tile j - 1 is folded into acc
        and tile j's P takes the buffer. Nothing is left in flight at the end (a wgmma in flight across the loop's back
        edge can make ptxas serialize every wgmma; an FP8 P carried in registers across it was unpacked byte by byte
        and spilled)."""
        t0, t1 = _fa_qk(q, k_s, ready, j, STAGES, mma_s)
        o = _fa_pv(p_s, pb, v_s, j - 1, STAGES, HEAD_DIM, mma_o)
        s0, s1 = warpgroup_mma_wait(num_outstanding=2, deps=(t0, t1))  # (each wgmma call is one group)
        p0, p1, alpha_n, l_i, m_i = _fa_softmax(s0, s1, l_i, m_i, q_sc, ks_base, offs_m, j, Sk, diag, win_right,
                                                K_SCALE_ROWS, MASK, mma_s)
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
        acc = _fa_fold(acc, o, alpha, empty, j - 1, STAGES, mma_o)
        _fa_put_p(p0, p1, p_s, pb)
        return acc, l_i, m_i, alpha_n

    @gluon.jit
    def _fa_put_p(p0, p1, p_s, pb):
        """Tile j's P halves into the warpgroup's buffer p_s[pb], p_s[pb + 1] (free: the last P·V that read it has
        been waited for), visible to the next wgmma (async proxy) once every thread of the warpgroup has written."""
        p_s.index(pb).store(p0)
        p_s.index(pb + 1).store(p1)
        fence_async_shared()
        _wg_barrier()

    @gluon.jit
    def _fa_math(q_s, k_s, v_s, p_s, qbar, ready, empty,
                 O, LSE, QS, KS, VS, KM, sob, soh, sos, sqsb, sqsh, sksb, sksh, svsb, svsh, skmb, skmh,
                 slb, slh, sls, H, GROUP, Sq, Sk, win_right,
                 Q_SCALE_ROWS: gl.constexpr, K_SCALE_ROWS: gl.constexpr, HAS_KMEAN: gl.constexpr,
                 RETURN_LSE: gl.constexpr, REVERSE_M: gl.constexpr, HEAD_DIM: gl.constexpr,
                 STAGES: gl.constexpr, PART: gl.constexpr):
        """Math partition PART (one warpgroup): query rows PART*64 .. PART*64+63 of the CTA's tile."""
        NW: gl.constexpr = gl.num_warps()
        ROWS: gl.constexpr = BM // 2
        R0: gl.constexpr = PART * ROWS
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                        instr_shape=[16, BN // 2, 32])  # a 64-key INT32 score half
        mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                        instr_shape=[16, HEAD_DIM, 32])  # the FP32 P·V tile
        row_l: gl.constexpr = gl.SliceLayout(1, mma_s)
        pid_m, n_full, n_all = _fa_ranges(Sq, Sk, win_right, REVERSE_M)
        bh = gl.program_id(1)
        b = bh // H
        h = bh % H
        hk = h // GROUP
        b64 = b.to(gl.int64)
        offs_m = pid_m * BM + R0 + gl.arange(0, ROWS, layout=row_l)
        row_ok = offs_m < Sq
        q_sc = gl.load(QS + b64 * sqsb + h * sqsh + offs_m // Q_SCALE_ROWS, mask=row_ok, other=1.0)
        ks_base = KS + b64 * sksb + hk * sksh
        diag = Sk - Sq

        m_i = gl.full([ROWS], float("-inf"), gl.float32, row_l)
        l_i = gl.zeros([ROWS], gl.float32, row_l)
        acc = gl.zeros((ROWS, HEAD_DIM), gl.float32, mma_o)
        mbarrier.wait(qbar, 0)
        q = q_s.slice(R0, ROWS, dim=0)
        pb = 2 * PART  # this warpgroup's P buffer (two 64x64 halves)
        if n_all > 0:
            # tile 0: scores and softmax only (masked: harmless where it is not needed, and it runs once)
            t0, t1 = _fa_qk(q, k_s, ready, 0, STAGES, mma_s)
            s0, s1 = warpgroup_mma_wait(num_outstanding=0, deps=(t0, t1))
            p0, p1, alpha, l_i, m_i = _fa_softmax(s0, s1, l_i, m_i, q_sc, ks_base, offs_m, 0, Sk, diag, win_right,
                                                  K_SCALE_ROWS, True, mma_s)
            _fa_put_p(p0, p1, p_s, pb)
            for j in range(1, n_full):
                acc, l_i, m_i, alpha = _fa_step(acc, l_i, m_i, alpha, q, q_sc, k_s, v_s, p_s, pb, ready, empty,
                                                ks_base, offs_m, j, Sk, diag, win_right, K_SCALE_ROWS,
                                                HEAD_DIM, STAGES, False, mma_s, mma_o)
            for j in range(gl.maximum(n_full, 1), n_all):
                acc, l_i, m_i, alpha = _fa_step(acc, l_i, m_i, alpha, q, q_sc, k_s, v_s, p_s, pb, ready, empty,
                                                ks_base, offs_m, j, Sk, diag, win_right, K_SCALE_ROWS,
                                                HEAD_DIM, STAGES, True, mma_s, mma_o)
            o = _fa_pv(p_s, pb, v_s, n_all - 1, STAGES, HEAD_DIM, mma_o)  # the last tile's P·V
            o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
            acc = _fa_fold(acc, o, alpha, empty, n_all - 1, STAGES, mma_o)

        # ---- epilogue: out = acc / l · v_scale (acc and l both carry the factor 448)
        lo = gl.convert_layout(l_i, gl.SliceLayout(1, mma_o))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, mma_o))
        vs = gl.load(VS + b64 * svsb + hk * svsh + offs_d)
        out = acc / gl.where(lo == 0.0, 1.0, lo)[:, None] * vs[None, :]
        out_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
        out = gl.convert_layout(out.to(O.dtype.element_ty), out_l)
        rows = pid_m * BM + R0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, out_l))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, out_l))
        o_base = O + b64 * sob + h.to(gl.int64) * soh
        gl.store(o_base + rows.to(gl.int64)[:, None] * sos + cols[None, :], out, mask=(rows < Sq)[:, None])
        if RETURN_LSE:
            lse2 = m_i + gl.log2(l_i) - LOG2_448
            if HAS_KMEAN:  # undo K smoothing: true scores are higher by (q·q_scale)·mean(k)
                q_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [NW, 1], [1, 0])
                qv = q.load(q_l).to(gl.float32)
                km = gl.load(KM + b64 * skmb + hk * skmh + gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_l)))
                lse2 += gl.convert_layout(gl.sum(qv * km[None, :], 1), row_l) * q_sc
            gl.store(LSE + b64 * slb + h.to(gl.int64) * slh + offs_m.to(gl.int64) * sls, lse2 * 0.6931471805599453,
                     mask=row_ok)

    @gluon.jit
    def attn_fwd_int8_fp8_ws(Q, K, V, O, LSE, QS, KS, VS, KM,
                             sqb, sqh, sqs, skb, skh, sks, svb, svh, svd, sob, soh, sos,
                             sqsb, sqsh, sksb, sksh, svsb, svsh, skmb, skmh, slb, slh, sls,
                             H, GROUP, Sq, Sk, win_right,
                             Q_SCALE_ROWS: gl.constexpr, K_SCALE_ROWS: gl.constexpr, HAS_KMEAN: gl.constexpr,
                             RETURN_LSE: gl.constexpr, REVERSE_M: gl.constexpr, HEAD_DIM: gl.constexpr,
                             STAGES: gl.constexpr, LOAD_REGS: gl.constexpr,
                             MATH_REGS: gl.constexpr):
        """Grid (cdiv(Sq, 128), B·Hq), num_warps 4 (+ one loader warp and a second math warpgroup), one CTA an SM.

        Q, K: int8 codes, head dim contiguous (strides s?b, s?h, s?s in elements); V: E4M3 codes stored
        sequence-contiguous (svd = the stride between channels, unit stride along the sequence); O: BF16, FP16 or FP32 out;
        QS: q_scale (B, Hq, groups of Q_SCALE_ROWS rows); KS: k_scale (B, Hkv, blocks of K_SCALE_ROWS keys); VS:
        v_scale (B, Hkv, D); KM: K's channel mean (only read for the LSE, HAS_KMEAN); LSE (B, Hq, Sq) FP32 natural
        log. win_right: 0 causal, 1 << 30 none. Every base, descriptor base and non-unit stride 16-byte aligned."""
        bh = gl.program_id(1)
        b64 = (bh // H).to(gl.int64)
        h = (bh % H).to(gl.int64)
        hk = h // GROUP
        q_base = Q + b64 * sqb + h * sqh
        k_base = K + b64 * skb + hk * skh
        v_base = V + b64 * svb + hk * svh
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, HEAD_DIM], gl.int8)
        k_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, HEAD_DIM], gl.int8)
        v_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEAD_DIM, BN // 2], gl.float8e4nv)
        qd = tma.make_tensor_descriptor(q_base, shape=[Sq, HEAD_DIM], strides=[sqs, 1], block_shape=[BM, HEAD_DIM],
                                        layout=q_layout)
        kd = tma.make_tensor_descriptor(k_base, shape=[Sk, HEAD_DIM], strides=[sks, 1], block_shape=[BN, HEAD_DIM],
                                        layout=k_layout)
        vd = tma.make_tensor_descriptor(v_base, shape=[HEAD_DIM, Sk], strides=[svd, 1],
                                        block_shape=[HEAD_DIM, BN // 2], layout=v_layout)
        q_s = gl.allocate_shared_memory(gl.int8, [BM, HEAD_DIM], q_layout)
        k_s = gl.allocate_shared_memory(gl.int8, [STAGES, BN, HEAD_DIM], k_layout)
        v_s = gl.allocate_shared_memory(gl.float8e4nv, [2 * STAGES, HEAD_DIM, BN // 2], v_layout)
        # P reaches the P·V wgmma through shared memory: per math warpgroup one buffer of two 64x64 halves
        p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM // 2, BN // 2], gl.float8e4nv)
        p_s = gl.allocate_shared_memory(gl.float8e4nv, [4, BM // 2, BN // 2], p_layout)
        qbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(qbar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # both math warpgroups hand the stage back
        # Each partition gets its own argument tuple, written out in the call (a tuple bound to a name first turns
        # its constexprs into tensors); the two math warpgroups run _fa_math, their index PART a gl.constexpr (a
        # plain literal would arrive as a tensor).
        gl.warp_specialize([(_fa_math, (q_s, k_s, v_s, p_s, qbar, ready, empty,
                                        O, LSE, QS, KS, VS, KM, sob, soh, sos, sqsb, sqsh, sksb, sksh, svsb, svsh,
                                        skmb, skmh, slb, slh, sls, H, GROUP, Sq, Sk, win_right,
                                        Q_SCALE_ROWS, K_SCALE_ROWS, HAS_KMEAN, RETURN_LSE, REVERSE_M, HEAD_DIM,
                                        STAGES, gl.constexpr(0))),
                            (_fa_loader, (qd, kd, vd, q_s, k_s, v_s, qbar, ready, empty, Sq, Sk, win_right,
                                          REVERSE_M, STAGES)),
                            (_fa_math, (q_s, k_s, v_s, p_s, qbar, ready, empty,
                                        O, LSE, QS, KS, VS, KM, sob, soh, sos, sqsb, sqsh, sksb, sksh, svsb, svsh,
                                        skmb, skmh, slb, slh, sls, H, GROUP, Sq, Sk, win_right,
                                        Q_SCALE_ROWS, K_SCALE_ROWS, HAS_KMEAN, RETURN_LSE, REVERSE_M, HEAD_DIM,
                                        STAGES, gl.constexpr(1)))],
                           [1, gl.num_warps()], [LOAD_REGS, MATH_REGS])


# ------------------------------------------------------------------------------------------------ launcher
# Head dims the kernel runs by default: at D = 64 it ran at 0.58-0.67 of cuDNN against the Triton kernel's 0.85-0.88
# (H200, 2026-11-23: half the MMA work a tile for the same softmax work, one CTA an SM); LOWBIT_ATTN_GLUON=force
# runs it there too (tests).
DEFAULT_DIMS = (128,)
STAGES = {64: 4, 128: 3}  # key tiles in flight: 16 + 3 x 32 KB of shared memory at D = 128, 8 + 4 x 16 at 64
# Registers: two math warpgroups (the second with MATH_REGS, the default partition gets what is left) and the loader
# warp with LOAD_REGS; launched at maxnreg 168 x 12 warps = the 64K register file, one CTA an SM.
_LAUNCH = dict(LOAD_REGS=24, MATH_REGS=232, num_warps=4, maxnreg=168)


def mode() -> str:
    """``LOWBIT_ATTN_GLUON``: "1" (default) eligible calls run this kernel, "0" never, "force": as "1" but an
    ineligible INT8·FP8 call raises instead of falling back (tests)."""
    m = os.environ.get("LOWBIT_ATTN_GLUON", "1")
    if m not in ("0", "1", "force"):
        raise ValueError(f"LOWBIT_ATTN_GLUON must be 0, 1 or force, got {m!r}")
    return m


def why_not(q, k, v, *, qk_mode: int, pv_fp8: bool, v_scaled: bool, varlen: bool, left: int, right: int, big: int,
            k_scale_rows: int, qv, kv, vv, ov, device) -> str | None:
    """None when this kernel can run the call, else the reason (the Triton kernel runs it). The call's own rules
    first, then the machine's."""
    if qk_mode != 1 or not pv_fp8 or not v_scaled:
        return "only INT8 Q·Kᵀ with FP8 P·V"
    if varlen:
        return "varlen"
    if left != big or right not in (0, big):
        return "a sliding window (causal and no mask only)"
    D = q.shape[-1]
    if D not in STAGES:
        return f"head dim {D} (64 or 128)"
    if D not in DEFAULT_DIMS and mode() != "force":
        return f"head dim {D}: the Triton kernel is faster there (H200, 2026-11-23)"
    if k_scale_rows % 64:
        return f"K scale blocks of {k_scale_rows} keys (a multiple of 64)"
    for name, t, st, inner in (("q", q, qv, 3), ("k", k, kv, 3), ("v", v, vv, 2)):
        if st[inner] != 1 or t.data_ptr() % 16 or any((x * t.element_size()) % 16 for i, x in enumerate(st) if i != inner):
            return f"{name}'s strides / alignment (TMA)"
    if ov[3] != 1:
        return "output not channel-contiguous"
    return machine_why_not(device)


def machine_why_not(device) -> str | None:
    """None when this Triton and ``device`` can run the kernel (Gluon warp specialization, sm_90), else why not."""
    if not GLUON_WS:
        return "this Triton has no Gluon warp_specialize"
    device = torch.device(device)
    if device.type != "cuda" or capability(device) != (9, 0):
        return "not an sm_90 GPU"
    return None


def runs_by_default(device, head_dim: int) -> bool:
    """Whether a dense INT8·FP8 call of this head dim (TMA-able, causal or no mask) runs this kernel under the
    current ``LOWBIT_ATTN_GLUON`` (what ``lowbit info`` reports and the tests expect)."""
    return mode() != "0" and head_dim in DEFAULT_DIMS and machine_why_not(device) is None


def launch(q, k, v, o, lse, q_scale, k_scale, v_scale, k_mean, *, qv, kv, vv, ov, sl, B, Hq, Hkv, Sq, Sk,
           q_scale_rows, k_scale_rows, right, return_lse, reverse_m):
    """Run attn_fwd_int8_fp8_ws on operands ``why_not`` accepted (qv/kv/vv/ov: (stride_b, stride_h, stride_s,
    stride_d) of q, k, v, o; sl: the LSE's (b, h, s) strides)."""
    ensure_tma_allocator()
    D = q.shape[-1]
    km = k_mean if k_mean is not None else v_scale
    grid = (-(-Sq // BLOCK_M), B * Hq)
    attn_fwd_int8_fp8_ws[grid](
        q, k, v, o, lse, q_scale, k_scale, v_scale, km,
        qv[0], qv[1], qv[2], kv[0], kv[1], kv[2], vv[0], vv[1], vv[3], ov[0], ov[1], ov[2],
        q_scale.stride(0), q_scale.stride(1), k_scale.stride(0), k_scale.stride(1),
        v_scale.stride(0), v_scale.stride(1),
        km.stride(0) if k_mean is not None else 0, km.stride(1) if k_mean is not None else 0, *sl,
        Hq, Hq // Hkv, Sq, Sk, right,
        Q_SCALE_ROWS=q_scale_rows, K_SCALE_ROWS=k_scale_rows, HAS_KMEAN=k_mean is not None,
        RETURN_LSE=bool(return_lse), REVERSE_M=bool(reverse_m), HEAD_DIM=D,
        STAGES=int(os.environ.get("LOWBIT_ATTN_GLUON_STAGES", STAGES[D])),  # (the override: sweeps)
        **_LAUNCH)
