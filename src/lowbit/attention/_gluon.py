"""Warp-specialized Gluon forward kernel for INT8 Q·Kᵀ + FP8 P·V on Hopper (the FlashAttention-3 structure).

The Triton kernel of ``_triton.py`` computes the same numbers but cannot overlap its parts: compiled for sm_90 every
``tl.dot`` waits for its tensor-core result right after issuing it (one wait per k32 step), and the software pipeline
recycles K/V stages with CTA-wide barriers, which keep the two warpgroups of a CTA in lockstep, so one warpgroup's
softmax never hides the other's MMAs. Here:

* one **loader warp** keeps ``STAGES`` key tiles in flight through TMA (K: BN x D int8 rows; V: FP8, stored
  sequence-contiguous, as two D x 64 halves so each half is one K-major wgmma B operand) and a stage goes back to it
  as soon as both math warpgroups are done with it — through an mbarrier, or at head dim 64 through a named barrier
  every math thread arrives at (``named``: no warpgroup barrier for the arrive) — no CTA-wide barrier anywhere;
* two **math warpgroups**, 64 query rows each of a 128-row tile. For key tile j a warpgroup runs the softmax of
  its scores, then issues tile j + 1's INT8 scores and tile j's FP8 P·V back to back (async) and waits for both;
  the two warpgroups drift out of step, so one's softmax runs while the other's MMAs occupy the tensor cores.
  **P stays in registers**: the accumulator layout of the scores is the A-operand layout of the P·V wgmma up to a
  permutation of keys inside each 32-key chunk (``_fa_p_operand``), so V is stored with its keys in that order
  (``_triton.quantize_v_fp8_triton(key_order="wgmma32")``, free in the prepass) and no shuffle, shared-memory round
  trip or warpgroup barrier stands between the softmax and the P·V. No FP8 value crosses the loop's back edge
  (Triton unpacks a loop-carried FP8 tensor byte by byte).

* **persistent** where Q, K and V are each one dense block of heads (``_flat``: contiguous ``bhsd`` Q / K and the
  prepass's V buffer): one TMA descriptor per operand spans every head, one CTA an SM takes work tiles (128 query
  rows of one head) in turn, Q is double-buffered, and the loader fetches the next tile's Q and keys while the math
  warpgroups finish the last one — the per-CTA start (launch, Q load, pipeline fill) and the epilogue no longer
  stall the SM. Causal, the CTAs take the work tiles heaviest first: each head's last query block first, or, where
  ``heavy_first_pays``, across all heads (every head's last block, then the one before: the CTAs' shares of the
  triangle even out). Other layouts get one CTA a work tile with per-head descriptors (same numbers, bit for bit).

At head dim 128 it runs up to 1.4x cuDNN BF16 on the persistent grid (BENCHMARKS.md). Latency-bound: a mask-free tile
costs 524 instructions a thread (I2F, the exp2's FFMA, MUFU.EX2, the row sums and the FP32 promotion: 64 each). At
head dim 64 the kernel is the default only on the persistent grid (with the named-barrier hand-back); with one CTA a
tile the Triton kernel (two CTAs an SM) is faster there.

Numbers, per 128-key tile (the quantized reference's, as the Triton kernel's): two INT32 score halves of 64 keys
(one K scale each: ``K_SCALE_ROWS`` is a multiple of 64), converted to FP32 and scaled by q_scale[row]·k_scale[half]
inside the exp2's FMA; the running row max / sum update; P·448 rounded to E4M3 (saturating RNE); P·V of the tile's
128 keys accumulated by the FP8 wgmma from zero and promoted into the FP32 accumulator once per tile
(``acc·alpha + tile``); the output divided by the row sum and multiplied by V's per-channel scale. The row
sums are kept per (row, lane) and added across lanes at the end: the same terms as the reference, another order.

Scope (``why_not`` gives the rule a call breaks; such calls run the Triton kernel): dense ``bhsd`` / ``bshd`` (no
varlen), head dim 128, and 64 on the persistent grid (else with ``LOWBIT_ATTN_GLUON=force``), no window but causal
(bottom-right aligned), GQA / MQA, optional log-sum-exp (K smoothing undone as in the Triton kernel), TMA-able
strides. sm_90 only (wgmma, TMA).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..runtime import env
from ..runtime.device import capability, l2_bytes, num_sms
from ..runtime.launch import SpecializedLaunch, ensure_tma_allocator, remember

try:  # Triton >= 3.5 with Gluon's Hopper ops and warp specialization
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    GLUON_WS = hasattr(gl, "warp_specialize")
except Exception:  # pragma: no cover - older Triton
    GLUON_WS = False

BLOCK_M = 128  # query rows a CTA: two math warpgroups of 64
BLOCK_N = 128  # keys a tile: two halves of 64 (one K scale block each)
NAMED_BARRIER_BASE = 4  # the named-barrier hand-back's first id (Triton's warp specialization uses 0-3; 16 a CTA)

if GLUON_WS:
    BM = gl.constexpr(BLOCK_M)
    BN = gl.constexpr(BLOCK_N)
    LOG2_448 = gl.constexpr(8.807354922057604)  # P is computed as p·448 (E4M3's range); l carries the same factor
    # NAMED: the stage / Q-buffer hand-back to the loader through named barriers (ids from NB_BASE: Triton's warp
    # specialization takes 0-3, one a partition and the CTA-wide one), every thread of both math warpgroups
    # arriving (bar.arrive) and the loader warp waiting (bar.sync) on NB_COUNT threads. Gluon's mbarrier.arrive is
    # one elected thread behind a warpgroup bar.sync (each key tile, on the critical path); bar.arrive waits for
    # nothing. Safe with one id a stage: a math thread arrives for a stage's next content only after it was loaded,
    # i.e. after the loader's bar.sync on the previous content completed.
    NB_BASE = gl.constexpr(NAMED_BARRIER_BASE)
    NB_COUNT = gl.constexpr(2 * 128 + 32)

    @gluon.jit
    def _named_arrive(bid):
        """bar.arrive on named barrier ``bid`` (NB_COUNT threads): this thread is done; waits for nothing."""
        gl.inline_asm_elementwise("bar.arrive $1, $2;", "=r,r,r", [bid, NB_COUNT], dtype=gl.int32, is_pure=False,
                                  pack=1)

    @gluon.jit
    def _named_sync(bid):
        """bar.sync on named barrier ``bid`` (NB_COUNT threads): wait until every math thread has arrived."""
        gl.inline_asm_elementwise("bar.sync $1, $2;", "=r,r,r", [bid, NB_COUNT], dtype=gl.int32, is_pure=False,
                                  pack=1)

    @gluon.jit
    def _fa_tile(t, n_m, n_bh, Sq, Sk, win_right, REVERSE_M: gl.constexpr, HEAVY_FIRST: gl.constexpr):
        """Work tile t (query block fastest, then batch·head; HEAVY_FIRST: batch·head fastest, the last query block
        of every head first): (pid_m, bh, number of mask-free key tiles, number of key tiles). Key tiles start at 0
        (no left window); a tile is mask-free when every key is < Sk and inside every row's causal limit."""
        if HEAVY_FIRST:
            bh = t % n_bh
            pid_m = n_m - 1 - t // n_bh
        else:
            bh = t // n_m
            pid_m = t % n_m
            if REVERSE_M:  # causal: each head's heaviest query blocks first
                pid_m = n_m - 1 - pid_m
        m0 = pid_m * BM
        diag = Sk - Sq
        hi = gl.maximum(gl.minimum(Sk, m0 + BM + diag + win_right), 0)
        full_end = gl.maximum(gl.minimum(Sk, m0 + diag + win_right + 1), 0)
        return pid_m, bh, full_end // BN, gl.cdiv(hi, BN)

    @gluon.jit
    def _fa_order(t, n_tiles, SNAKE: gl.constexpr):
        """The work tile a CTA's loop index t stands for. SNAKE (causal): every other full round of the grid (one
        tile a CTA) is handed out in reverse CTA order. A causal tile's cost repeats every n_m tiles, and where the
        grid and n_m share a factor (132 SMs, n_m = 16 or 32: 4) a CTA would otherwise only ever get one class of
        query blocks: every fourth, the dearest class ~20% above the cheapest (B4 H32 S4096). Reversed rounds pair
        each class with its mirror. The last, partial round keeps the natural order (the tiles past the end are
        then exactly the CTAs' own)."""
        if SNAKE:
            nprog = gl.num_programs(0)
            j = t // nprog
            if ((j % 2) == 1) & ((j + 1) * nprog <= n_tiles):
                t = j * nprog + nprog - 1 - t % nprog
        return t

    @gluon.jit
    def _fa_loader(qd, kd, vd, q_s, k_s, v_s, qbar, q_empty, ready, empty, H, GROUP, Sq, Sk, win_right, n_tiles,
                   REVERSE_M: gl.constexpr, STAGES: gl.constexpr, FLAT: gl.constexpr, HEAD_DIM: gl.constexpr,
                   NAMED: gl.constexpr, HEAVY_FIRST: gl.constexpr):
        """Loader partition (one warp). For each work tile of this CTA: its Q tile into buffer i % 2 once both math
        warpgroups are done with the tile before last, then every key tile's K and V halves into the ring's next
        stage once both have handed that stage back (ring counter c runs on across work tiles; TMA zero-fills rows
        past the tensor). FLAT: the descriptors span every head (rows of the other heads past Sq / Sk are read as
        garbage and masked: K's by the last tile's key mask, Q's rows are not stored); else they are this CTA's
        head's and the CTA has one work tile. NAMED: the hand-backs are named barriers (the first use of each stage
        and Q buffer waits for none; the last ones are taken before exit)."""
        n_m = gl.cdiv(Sq, BM)
        c = 0
        i = 0
        for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            pid_m, bh, n_full, n_all = _fa_tile(_fa_order(t, n_tiles, REVERSE_M), n_m, n_tiles // n_m, Sq, Sk,
                                                win_right, REVERSE_M, HEAVY_FIRST)
            if FLAT:
                kv = bh // H * (H // GROUP) + bh % H // GROUP  # (batch, kv head) of query head bh
                q_row = bh * Sq
                k_row = kv * Sk
                v_row = kv * HEAD_DIM
            else:
                q_row = 0
                k_row = 0
                v_row = 0
            qb = i % 2
            if NAMED:
                if i >= 2:
                    _named_sync(NB_BASE + STAGES + qb)
            else:
                mbarrier.wait(q_empty.index(qb), ((i // 2) & 1) ^ 1)  # a fresh barrier passes phase 1 at once
            mbarrier.expect(qbar.index(qb), qd.block_type.nbytes)
            _tma_load(qd, [q_row + pid_m * BM, 0], qbar.index(qb), q_s.index(qb))
            for j in range(n_all):
                s = c % STAGES
                if NAMED:
                    if c >= STAGES:
                        _named_sync(NB_BASE + s)
                else:
                    mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), kd.block_type.nbytes + 2 * vd.block_type.nbytes)
                _tma_load(kd, [k_row + j * BN, 0], ready.index(s), k_s.index(s))
                _tma_load(vd, [v_row, j * BN], ready.index(s), v_s.index(2 * s))
                _tma_load(vd, [v_row, j * BN + BN // 2], ready.index(s), v_s.index(2 * s + 1))
                c += 1
            i += 1
        if NAMED:  # take the last hand-backs: no named barrier is left part-arrived at exit
            for k in range(gl.maximum(c - STAGES, 0), c):
                _named_sync(NB_BASE + k % STAGES)
            for k in range(gl.maximum(i - 2, 0), i):
                _named_sync(NB_BASE + STAGES + k % 2)

    @gluon.jit
    def _fa_qk(q, k_s, ready, c, STAGES: gl.constexpr, mma_s: gl.constexpr):
        """Wait for the key tile in the ring's slot c, issue its two INT8 score halves (async, in layout mma_s): the
        in-flight tokens."""
        HALF: gl.constexpr = BN // 2
        s = c % STAGES
        mbarrier.wait(ready.index(s), (c // STAGES) & 1)
        kt = k_s.index(s)
        zs = gl.zeros((BM // 2, HALF), gl.int32, mma_s)
        t0 = warpgroup_mma(q, kt.slice(0, HALF, dim=0).permute((1, 0)), zs, use_acc=False, is_async=True)
        t1 = warpgroup_mma(q, kt.slice(HALF, HALF, dim=0).permute((1, 0)), zs, use_acc=False, is_async=True)
        return t0, t1

    @gluon.jit
    def _fa_p_operand(p, mma_o: gl.constexpr):
        """P (64 x 64 E4M3, the score wgmma's accumulator layout) relabelled as the A operand of the FP8 P·V wgmma in
        registers, with no data movement (``assert_trivial``). A thread holds score columns 2c, 2c+1, 2c+8, 2c+9,
        ... (c its lane in the quad) and the A operand wants keys 4c..4c+3, 16+4c..16+4c+3 of each 32-key chunk, so
        within a chunk the operand's key kappa = 16h + 4c + 2a + b is score column sigma = 16h + 8a + 2c + b: V
        arrives with its keys stored in that order (``quantize_v_fp8_triton(key_order="wgmma32")``)."""
        R: gl.constexpr = p.shape[0]
        p = gl.reshape(p, [R, 2, 2, 2, 4, 2])  # (row, chunk, h, a, c, b): column sigma
        p = gl.permute(p, [0, 1, 2, 4, 3, 5])  # (row, chunk, h, c, a, b): key kappa
        p = gl.reshape(p, [R, BN // 2])
        return gl.convert_layout(p, gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=4), assert_trivial=True)

    @gluon.jit
    def _by_lane(x):
        """A (64, 64) score-half tensor (layout mma_s) viewed as (64, 8, 4, 2): column = 8·i + 2·lane + b, so axes
        1 and 3 are a thread's own registers and axis 2 its lane in the quad. Reducing axes 3 and 1 reduces within
        each thread: no shuffle."""
        return gl.reshape(x, [x.shape[0], 8, 4, 2])

    @gluon.jit
    def _fa_softmax(s0, s1, l_i, m_i, q_sc, ks_base, offs_m, j, Sk, diag, win_right,
                    K_SCALE_ROWS: gl.constexpr, MASK: gl.constexpr, mma_s: gl.constexpr):
        """The online-softmax update of key tile j from its INT32 score halves (layout mma_s): (P·448 halves as
        E4M3, alpha = the factor on the accumulator, l, m). l_i is kept per (row, lane of the quad), shape (64, 4):
        each thread sums its own columns and the four lanes of a row are added once, in the epilogue."""
        HALF: gl.constexpr = BN // 2
        n0 = j * BN
        # one K scale per 64-key half (K_SCALE_ROWS is a multiple of 64); a half past Sk reads as 1
        c0 = q_sc * gl.load(ks_base + n0 // K_SCALE_ROWS)
        c1 = q_sc * gl.load(ks_base + (n0 + HALF) // K_SCALE_ROWS, mask=n0 + HALF < Sk, other=1.0)
        # c > 0: the row max of s·c is c·max(s) (rounding is monotone), and p = exp2(s·c - m) is one FMA
        if MASK:
            s0 = s0.to(gl.float32)
            s1 = s1.to(gl.float32)
            cols = n0 + gl.arange(0, HALF, layout=gl.SliceLayout(0, mma_s))
            lim = offs_m[:, None] + diag + win_right  # key j is visible from row i when j - (i + diag) <= win_right
            s0 = gl.where((cols[None, :] < Sk) & (cols[None, :] <= lim), s0, float("-inf"))
            s1 = gl.where((cols[None, :] + HALF < Sk) & (cols[None, :] + HALF <= lim), s1, float("-inf"))
            m_new = gl.maximum(m_i, gl.maximum(gl.max(s0, 1) * c0, gl.max(s1, 1) * c1))
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row may see nothing: no (-inf) - (-inf)
        else:
            # mask-free: the maxima over the INT32 scores (exact in FP32, |s| < 2^24; 3-input VIMNMX3), a thread's
            # own columns of both halves first (_by_lane), then one cross-lane reduction of
            # max(max(s0)·c0, max(s1)·c1) for the two halves together
            pm0 = gl.max(gl.max(_by_lane(s0), 3), 1)
            pm1 = gl.max(gl.max(_by_lane(s1), 3), 1)
            pl: gl.constexpr = gl.SliceLayout(1, pm0.type.layout)
            pm = gl.maximum(pm0.to(gl.float32) * gl.convert_layout(c0, pl)[:, None],
                            pm1.to(gl.float32) * gl.convert_layout(c1, pl)[:, None])
            m_new = gl.maximum(m_i, gl.convert_layout(gl.max(pm, 1), m_i.type.layout))
            m_use = m_new
            s0 = s0.to(gl.float32)
            s1 = s1.to(gl.float32)
        mb = m_use - LOG2_448
        p0 = gl.exp2(s0 * c0[:, None] - mb[:, None])
        p1 = gl.exp2(s1 * c1[:, None] - mb[:, None])
        alpha = gl.exp2(m_i - m_use)
        part = gl.sum(gl.sum(_by_lane(p0), 3), 1) + gl.sum(gl.sum(_by_lane(p1), 3), 1)
        l_i = l_i * gl.convert_layout(alpha, gl.SliceLayout(1, part.type.layout))[:, None] + part
        p0 = p0.to(gl.float8e4nv, fp_downcast_rounding="rtne")
        p1 = p1.to(gl.float8e4nv, fp_downcast_rounding="rtne")
        return p0, p1, alpha, l_i, m_new

    @gluon.jit
    def _fa_step(acc, l_i, m_i, s0, s1, q, q_sc, k_s, v_s, ready, empty, ks_base, offs_m, j, c, Sk, diag, win_right,
                 K_SCALE_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, MASK: gl.constexpr,
                 LAST: gl.constexpr, mma_s: gl.constexpr, mma_o: gl.constexpr, NAMED: gl.constexpr):
        """Key tile j from its scores (s0, s1): its softmax; then tile j + 1's scores (unless LAST) and tile j's
        P·V (its two 64-key halves, P in registers, FP8 wgmmas from zero) go to the tensor cores together; tile j is
        folded into acc (acc·alpha + o: the FP32 promotion) and its stage goes back to the loader. Both wgmma groups
        are waited for before the loop's back edge: an FP8 value carried across it is unpacked byte by byte
        (hundreds of PRMT, spills), and a wgmma in flight across it can make ptxas serialize every wgmma. The other
        warpgroup's softmax fills the tensor cores meanwhile. c: tile j's slot in the K/V ring. Returns tile j + 1's
        scores."""
        p0, p1, alpha, l_i, m_i = _fa_softmax(s0, s1, l_i, m_i, q_sc, ks_base, offs_m, j, Sk, diag, win_right,
                                              K_SCALE_ROWS, MASK, mma_s)
        a0 = _fa_p_operand(p0, mma_o)
        a1 = _fa_p_operand(p1, mma_o)
        st = c % STAGES
        zo = gl.zeros((BM // 2, HEAD_DIM), gl.float32, mma_o)
        if not LAST:
            t0, t1 = _fa_qk(q, k_s, ready, c + 1, STAGES, mma_s)
        o = warpgroup_mma(a0, v_s.index(2 * st).permute((1, 0)), zo, use_acc=False, is_async=True)
        o = warpgroup_mma(a1, v_s.index(2 * st + 1).permute((1, 0)), o, is_async=True)
        if not LAST:
            s0, s1 = warpgroup_mma_wait(num_outstanding=2, deps=(t0, t1))  # (each wgmma call is one group)
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
        if NAMED:
            _named_arrive(NB_BASE + st)
        else:
            mbarrier.arrive(empty.index(st), count=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, mma_o))[:, None] + o
        return acc, l_i, m_i, s0, s1

    @gluon.jit
    def _fa_math(q_s, k_s, v_s, qbar, q_empty, ready, empty,
                 O, LSE, QS, KS, VS, KM, sob, soh, sos, sqsb, sqsh, sksb, sksh, svsb, svsh, skmb, skmh,
                 slb, slh, sls, H, GROUP, Sq, Sk, win_right, n_tiles,
                 Q_SCALE_ROWS: gl.constexpr, K_SCALE_ROWS: gl.constexpr, HAS_KMEAN: gl.constexpr,
                 RETURN_LSE: gl.constexpr, REVERSE_M: gl.constexpr, HEAD_DIM: gl.constexpr,
                 STAGES: gl.constexpr, PART: gl.constexpr, NAMED: gl.constexpr, HEAVY_FIRST: gl.constexpr):
        """Math partition PART (one warpgroup): query rows PART*64 .. PART*64+63 of each work tile of this CTA."""
        n_m = gl.cdiv(Sq, BM)
        c = 0
        i = 0
        for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            c += _fa_math_tile(q_s, k_s, v_s, qbar, q_empty, ready, empty,
                               O, LSE, QS, KS, VS, KM, sob, soh, sos, sqsb, sqsh, sksb, sksh, svsb, svsh, skmb, skmh,
                               slb, slh, sls, H, GROUP, Sq, Sk, win_right, _fa_order(t, n_tiles, REVERSE_M), n_m,
                               n_tiles // n_m, c, i, Q_SCALE_ROWS, K_SCALE_ROWS, HAS_KMEAN, RETURN_LSE, REVERSE_M,
                               HEAD_DIM, STAGES, PART, NAMED, HEAVY_FIRST)
            i += 1

    @gluon.jit
    def _fa_math_tile(q_s, k_s, v_s, qbar, q_empty, ready, empty,
                      O, LSE, QS, KS, VS, KM, sob, soh, sos, sqsb, sqsh, sksb, sksh, svsb, svsh, skmb, skmh,
                      slb, slh, sls, H, GROUP, Sq, Sk, win_right, t, n_m, n_bh, c0, i,
                      Q_SCALE_ROWS: gl.constexpr, K_SCALE_ROWS: gl.constexpr, HAS_KMEAN: gl.constexpr,
                      RETURN_LSE: gl.constexpr, REVERSE_M: gl.constexpr, HEAD_DIM: gl.constexpr,
                      STAGES: gl.constexpr, PART: gl.constexpr, NAMED: gl.constexpr, HEAVY_FIRST: gl.constexpr):
        """One work tile t: its key tiles occupy ring slots c0, c0 + 1, ...; its Q tile is in buffer i % 2. Returns
        its number of key tiles."""
        NW: gl.constexpr = gl.num_warps()
        ROWS: gl.constexpr = BM // 2
        R0: gl.constexpr = PART * ROWS
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                        instr_shape=[16, BN // 2, 32])  # a 64-key INT32 score half
        mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                        instr_shape=[16, HEAD_DIM, 32])  # the FP32 P·V tile
        row_l: gl.constexpr = gl.SliceLayout(1, mma_s)
        pid_m, bh, n_full, n_all = _fa_tile(t, n_m, n_bh, Sq, Sk, win_right, REVERSE_M, HEAVY_FIRST)
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
        l_i = gl.sum(gl.sum(_by_lane(gl.zeros((ROWS, BN // 2), gl.float32, mma_s)), 3), 1)  # per (row, lane)
        acc = gl.zeros((ROWS, HEAD_DIM), gl.float32, mma_o)
        qb = i % 2
        mbarrier.wait(qbar.index(qb), (i // 2) & 1)
        q = q_s.index(qb).slice(R0, ROWS, dim=0)
        if n_all > 0:
            t0, t1 = _fa_qk(q, k_s, ready, c0, STAGES, mma_s)  # tile 0's scores
            s0, s1 = warpgroup_mma_wait(num_outstanding=0, deps=(t0, t1))
            n_a = gl.minimum(n_full, n_all - 1)
            for j in range(0, n_a):
                acc, l_i, m_i, s0, s1 = _fa_step(acc, l_i, m_i, s0, s1, q, q_sc, k_s, v_s, ready, empty, ks_base,
                                                 offs_m, j, c0 + j, Sk, diag, win_right, K_SCALE_ROWS, HEAD_DIM,
                                                 STAGES, False, False, mma_s, mma_o, NAMED)
            for j in range(n_a, n_all - 1):
                acc, l_i, m_i, s0, s1 = _fa_step(acc, l_i, m_i, s0, s1, q, q_sc, k_s, v_s, ready, empty, ks_base,
                                                 offs_m, j, c0 + j, Sk, diag, win_right, K_SCALE_ROWS, HEAD_DIM,
                                                 STAGES, True, False, mma_s, mma_o, NAMED)
            # the last tile (masked: harmless where it is not needed, and it runs once)
            acc, l_i, m_i, s0, s1 = _fa_step(acc, l_i, m_i, s0, s1, q, q_sc, k_s, v_s, ready, empty, ks_base, offs_m,
                                             n_all - 1, c0 + n_all - 1, Sk, diag, win_right, K_SCALE_ROWS, HEAD_DIM,
                                             STAGES, True, True, mma_s, mma_o, NAMED)
        l_i = gl.convert_layout(gl.sum(l_i, 1), row_l)

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
        if NAMED:  # this warpgroup is done with the Q buffer (the LSE reads it)
            _named_arrive(NB_BASE + STAGES + qb)
        else:
            mbarrier.arrive(q_empty.index(qb), count=1)
        return n_all

    # Sq / Sk / B / H / GROUP not specialized: Sk == 1 compiled as a constant gave NaN outputs (Triton 3.6; the same
    # code with Sk a runtime value is exact), and a size of 1 would only add recompiles
    @gluon.jit(do_not_specialize=["B", "H", "GROUP", "Sq", "Sk"])
    def attn_fwd_int8_fp8_ws(Q, K, V, O, LSE, QS, KS, VS, KM,
                             sqb, sqh, sqs, skb, skh, sks, svb, svh, svd, sob, soh, sos,
                             sqsb, sqsh, sksb, sksh, svsb, svsh, skmb, skmh, slb, slh, sls,
                             B, H, GROUP, Sq, Sk, win_right,
                             Q_SCALE_ROWS: gl.constexpr, K_SCALE_ROWS: gl.constexpr, HAS_KMEAN: gl.constexpr,
                             RETURN_LSE: gl.constexpr, REVERSE_M: gl.constexpr, HEAD_DIM: gl.constexpr,
                             STAGES: gl.constexpr, FLAT: gl.constexpr, LOAD_REGS: gl.constexpr,
                             MATH_REGS: gl.constexpr, NAMED: gl.constexpr, HEAVY_FIRST: gl.constexpr):
        """Work tiles: cdiv(Sq, 128) query blocks x B·Hq heads, query block fastest (HEAVY_FIRST, FLAT and causal
        only: batch·head fastest, the last query block of every head first). num_warps 4 (+ one loader warp and a
        second math warpgroup), one CTA an SM.

        FLAT (Q, K and V each one dense block of heads: Q (B, Hq, Sq, D), K (B, Hkv, Sk, D) contiguous, V's buffer
        (B, Hkv, D, S_pad) contiguous): one TMA descriptor per operand spans every head, and the grid may be
        persistent (fewer CTAs than work tiles: each CTA takes tiles pid, pid + grid, ...; the loader fetches the
        next tile's Q and keys while the math warpgroups finish the last one). Else grid = the work tiles, and each
        CTA's descriptors are its head's.

        Q, K: int8 codes, head dim contiguous (strides s?b, s?h, s?s in elements); V: E4M3 codes stored
        sequence-contiguous (svd = the stride between channels, unit stride along the sequence); O: BF16, FP16 or
        FP32 out; QS: q_scale (B, Hq, groups of Q_SCALE_ROWS rows); KS: k_scale (B, Hkv, blocks of K_SCALE_ROWS
        keys); VS:
        v_scale (B, Hkv, D); KM: K's channel mean (only read for the LSE, HAS_KMEAN); LSE (B, Hq, Sq) FP32 natural
        log. win_right: 0 causal, 1 << 30 none. Every base, descriptor base and non-unit stride 16-byte aligned."""
        n_tiles = gl.cdiv(Sq, BM) * B * H
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, HEAD_DIM], gl.int8)
        k_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, HEAD_DIM], gl.int8)
        v_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEAD_DIM, BN // 2], gl.float8e4nv)
        # V's keys are stored permuted within 32-key chunks (key_order "wgmma32"), the last chunk zero-padded: the
        # descriptor covers whole chunks (a key < Sk may be stored at a position >= Sk)
        s_pad = (Sk + 31) // 32 * 32
        if FLAT:
            Hk = H // GROUP
            qd = tma.make_tensor_descriptor(Q, shape=[B * H * Sq, HEAD_DIM], strides=[sqs, 1],
                                            block_shape=[BM, HEAD_DIM], layout=q_layout)
            kd = tma.make_tensor_descriptor(K, shape=[B * Hk * Sk, HEAD_DIM], strides=[sks, 1],
                                            block_shape=[BN, HEAD_DIM], layout=k_layout)
            vd = tma.make_tensor_descriptor(V, shape=[B * Hk * HEAD_DIM, s_pad], strides=[svd, 1],
                                            block_shape=[HEAD_DIM, BN // 2], layout=v_layout)
        else:
            bh = gl.program_id(0) // gl.cdiv(Sq, BM)
            b64 = (bh // H).to(gl.int64)
            h = (bh % H).to(gl.int64)
            hk = h // GROUP
            qd = tma.make_tensor_descriptor(Q + b64 * sqb + h * sqh, shape=[Sq, HEAD_DIM], strides=[sqs, 1],
                                            block_shape=[BM, HEAD_DIM], layout=q_layout)
            kd = tma.make_tensor_descriptor(K + b64 * skb + hk * skh, shape=[Sk, HEAD_DIM], strides=[sks, 1],
                                            block_shape=[BN, HEAD_DIM], layout=k_layout)
            vd = tma.make_tensor_descriptor(V + b64 * svb + hk * svh, shape=[HEAD_DIM, s_pad], strides=[svd, 1],
                                            block_shape=[HEAD_DIM, BN // 2], layout=v_layout)
        q_s = gl.allocate_shared_memory(gl.int8, [2, BM, HEAD_DIM], q_layout)
        k_s = gl.allocate_shared_memory(gl.int8, [STAGES, BN, HEAD_DIM], k_layout)
        v_s = gl.allocate_shared_memory(gl.float8e4nv, [2 * STAGES, HEAD_DIM, BN // 2], v_layout)
        qbar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(qbar.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=2)  # both math warpgroups hand the Q buffer back
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # both math warpgroups hand the stage back
        # Each partition gets its own argument tuple, written out in the call (a tuple bound to a name first turns
        # its constexprs into tensors); the two math warpgroups run _fa_math, their index PART a gl.constexpr (a
        # plain literal would arrive as a tensor).
        gl.warp_specialize([(_fa_math, (q_s, k_s, v_s, qbar, q_empty, ready, empty,
                                        O, LSE, QS, KS, VS, KM, sob, soh, sos, sqsb, sqsh, sksb, sksh, svsb, svsh,
                                        skmb, skmh, slb, slh, sls, H, GROUP, Sq, Sk, win_right, n_tiles,
                                        Q_SCALE_ROWS, K_SCALE_ROWS, HAS_KMEAN, RETURN_LSE, REVERSE_M, HEAD_DIM,
                                        STAGES, gl.constexpr(0), NAMED, HEAVY_FIRST)),
                            (_fa_loader, (qd, kd, vd, q_s, k_s, v_s, qbar, q_empty, ready, empty, H, GROUP, Sq, Sk,
                                          win_right, n_tiles, REVERSE_M, STAGES, FLAT, HEAD_DIM, NAMED, HEAVY_FIRST)),
                            (_fa_math, (q_s, k_s, v_s, qbar, q_empty, ready, empty,
                                        O, LSE, QS, KS, VS, KM, sob, soh, sos, sqsb, sqsh, sksb, sksh, svsb, svsh,
                                        skmb, skmh, slb, slh, sls, H, GROUP, Sq, Sk, win_right, n_tiles,
                                        Q_SCALE_ROWS, K_SCALE_ROWS, HAS_KMEAN, RETURN_LSE, REVERSE_M, HEAD_DIM,
                                        STAGES, gl.constexpr(1), NAMED, HEAVY_FIRST))],
                           [1, gl.num_warps()], [LOAD_REGS, MATH_REGS])


# ------------------------------------------------------------------------------------------------ launcher
# Head dims: 128 runs this kernel by default; 64 only on the persistent grid (dense Q/K/V, ``_flat``), where it beats
# the Triton kernel; one CTA a tile it is slower than the Triton kernel there. LOWBIT_ATTN_GLUON=force runs it on any
# TMA-able call (tests).
DEFAULT_DIMS = (128,)
PERSISTENT_DIMS = (64,)
# The named-barrier hand-back (``GluonOptions.named``) by default at head dim 64 only: 2-5% faster there, neutral to
# slower at 128. Triton 3.6 keeps one warpgroup barrier a key tile either way: its shared-memory barrier pass puts
# one before each key tile's wait on the ring's `ready` mbarrier (it orders two waits on one barrier array as
# conflicting accesses; without the wait the barrier goes).
NAMED_DIMS = (64,)
STAGES = {64: 3, 128: 3}  # key tiles in flight: 32 + 3 x 32 KB of shared memory at D = 128, 16 + 3 x 16 at 64
# Registers: two math warpgroups (the second with MATH_REGS, the default partition gets what is left: 504 - 24 - 240)
# and the loader warp with LOAD_REGS; launched at maxnreg 168 x 12 warps = the 64K register file, one CTA an SM. At
# 232 / 248 the masked loop of one warpgroup spilled (Triton 3.6); at 240 / 240 nothing does.
_LAUNCH = dict(LOAD_REGS=24, MATH_REGS=240, num_warps=4, maxnreg=168)


_LAUNCHER = SpecializedLaunch(attn_fwd_int8_fp8_ws) if GLUON_WS else None  # no per-call argument binding


@dataclass(frozen=True)
class GluonOptions:
    """How the Gluon kernel runs a call it takes (the launcher's ``gluon_options``; tests and benchmarks). The
    defaults are the measured choices; every choice gives the same bits."""

    named: Optional[bool] = None
    """The math warpgroups hand K/V stages and Q buffers back to the loader through named barriers (every thread
    ``bar.arrive``, the loader ``bar.sync``) rather than mbarriers (Gluon's single-thread arrive behind a warpgroup
    ``bar.sync``). None: at the head dims of ``NAMED_DIMS``."""
    persistent: bool = True
    """A FLAT call (``_flat``) runs on a persistent grid (one CTA an SM, each taking work tiles in turn) rather than
    one CTA a work tile."""
    heavy_first: Optional[bool] = None
    """A causal FLAT call takes its work tiles heaviest first across all heads (the last query block of every head,
    then the one before, ...: longest-processing-time order) rather than head by head. None: where
    :func:`heavy_first_pays`."""
    stages: Optional[int] = None
    """Key tiles in flight. None: ``STAGES[head_dim]``. With the named-barrier hand-back at most
    ``16 - NAMED_BARRIER_BASE - 2``."""

    def named_at(self, head_dim: int) -> bool:
        """Whether a call of this head dim uses the named-barrier hand-back."""
        return head_dim in NAMED_DIMS if self.named is None else bool(self.named)

    def stages_at(self, head_dim: int) -> int:
        """Key tiles in flight for a call of this head dim."""
        return STAGES[head_dim] if self.stages is None else int(self.stages)


DEFAULT_OPTIONS = GluonOptions()


def mode() -> str:
    """``LOWBIT_ATTN_GLUON``: "1" (default) eligible calls run this kernel, "0" never, "force": as "1" but an
    ineligible INT8·FP8 call raises instead of falling back (tests)."""
    return env.get("LOWBIT_ATTN_GLUON")


def why_not_qk(q, k, *, qk_mode: int, varlen: bool, left: int, right: int, big: int, k_scale_rows: int, qv, kv,
               device, call_only: bool = False, options: GluonOptions = DEFAULT_OPTIONS) -> str | None:
    """The rules of :func:`why_not` that do not depend on V or the output (``_triton.fp8_v_key_order`` asks them
    before V is quantized), then the machine's (not with ``call_only``): None when they pass, else the reason."""
    if qk_mode != 1:
        return "only INT8 Q·Kᵀ with FP8 P·V"
    if varlen:
        return "varlen"
    if left != big or right not in (0, big):
        return "a sliding window (causal and no mask only)"
    D = q.shape[-1]
    if D not in STAGES:
        return f"head dim {D} (64 or 128)"
    if D not in DEFAULT_DIMS and mode() != "force":
        B, Hq, Sq = q.shape[0], q.shape[1], q.shape[2]  # (only a dense bhsd call can be FLAT)
        Hkv, Sk = k.shape[1], k.shape[2]
        if D not in PERSISTENT_DIMS or not (options.persistent and _flat_qk(qv, kv, B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=Sk)):
            return f"head dim {D} off the persistent grid: the Triton kernel is faster there"
    if k_scale_rows % 64:
        return f"K scale blocks of {k_scale_rows} keys (a multiple of 64)"
    for name, t, st in (("q", q, qv), ("k", k, kv)):
        if st[3] != 1 or t.data_ptr() % 16 or any((x * t.element_size()) % 16 for x in st[:3]):
            return f"{name}'s strides / alignment (TMA)"
    return None if call_only else machine_why_not(device)


def why_not(q, k, v, *, qk_mode: int, pv_fp8: bool, v_scaled: bool, varlen: bool, left: int, right: int, big: int,
            k_scale_rows: int, qv, kv, vv, ov, device, v_key_order: str = "natural",
            options: GluonOptions = DEFAULT_OPTIONS) -> str | None:
    """None when this kernel can run the call, else the reason (the Triton kernel runs it). The call's own rules
    first, then the machine's. V must come with its keys in the "wgmma32" order (``_triton.quantize_v_fp8_triton``)."""
    if qk_mode != 1 or not pv_fp8 or not v_scaled:
        return "only INT8 Q·Kᵀ with FP8 P·V"
    reason = why_not_qk(q, k, qk_mode=qk_mode, varlen=varlen, left=left, right=right, big=big,
                        k_scale_rows=k_scale_rows, qv=qv, kv=kv, device=device, call_only=True, options=options)
    if reason is not None:
        return reason
    if v_key_order != "wgmma32":
        return "V's keys in natural order (the kernel reads key_order='wgmma32')"
    if vv[2] != 1 or v.data_ptr() % 16 or any((x * v.element_size()) % 16 for i, x in enumerate(vv) if i != 2):
        return "v's strides / alignment (TMA)"
    if ov[3] != 1:
        return "output not channel-contiguous"
    D = q.shape[-1]
    if D not in DEFAULT_DIMS and mode() != "force" and not _flat_v(vv, Hkv=k.shape[1], D=D):
        return f"head dim {D} off the persistent grid (V not one dense buffer): the Triton kernel is faster there"
    return machine_why_not(device)


def machine_why_not(device) -> str | None:
    """None when this Triton and ``device`` can run the kernel (Gluon warp specialization, sm_90), else why not."""
    if not GLUON_WS:
        return "this Triton has no Gluon warp_specialize"
    device = torch.device(device)
    if device.type != "cuda" or capability(device) != (9, 0):
        return "not an sm_90 GPU"
    return None


def runs_by_default(device, head_dim: int, options: GluonOptions = DEFAULT_OPTIONS) -> bool:
    """Whether a dense INT8·FP8 call of this head dim (contiguous ``bhsd`` Q/K, the prepass's V, causal or no mask)
    runs this kernel under the current ``LOWBIT_ATTN_GLUON`` and ``options`` (what ``lowbit info`` reports and the
    tests expect)."""
    dims = DEFAULT_DIMS + (PERSISTENT_DIMS if options.persistent else ())
    return mode() != "0" and head_dim in dims and machine_why_not(device) is None


_PLANS: dict = {}  # launch(key=...): the caller's key -> (grid, the integer arguments, the constexprs)


def launch(q, k, v, o, lse, q_scale, k_scale, v_scale, k_mean, *, qv, kv, vv, ov, sl, B, Hq, Hkv, Sq, Sk,
           q_scale_rows, k_scale_rows, right, return_lse, reverse_m, key=None,
           options: GluonOptions = DEFAULT_OPTIONS):
    """Run attn_fwd_int8_fp8_ws on operands ``why_not`` accepted (qv/kv/vv/ov: (stride_b, stride_h, stride_s,
    stride_d) of q, k, v, o; sl: the LSE's (b, h, s) strides). ``key``: the call's signature (it must determine
    every other argument, ``options`` and the switches included), under which the grid and arguments are computed once
    and the launch is keyed (``SpecializedLaunch.keyed``)."""
    ensure_tma_allocator()
    km = k_mean if k_mean is not None else v_scale
    plan = _PLANS.get(key) if key is not None else None
    if plan is None:
        D = q.shape[-1]
        n_tiles = -(-Sq // BLOCK_M) * B * Hq
        flat = _flat(qv, kv, vv, B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=Sk, D=D)
        grid = (min(n_tiles, num_sms(q.device)) if flat and options.persistent else n_tiles,)
        heavy = flat and bool(reverse_m) and (
            heavy_first_pays(B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=Sk, D=D, grid=grid[0], device=q.device)
            if options.heavy_first is None else bool(options.heavy_first))
        ints = (qv[0], qv[1], qv[2], kv[0], kv[1], kv[2], vv[0], vv[1], vv[3], ov[0], ov[1], ov[2],
                q_scale.stride(0), q_scale.stride(1), k_scale.stride(0), k_scale.stride(1),
                v_scale.stride(0), v_scale.stride(1),
                km.stride(0) if k_mean is not None else 0, km.stride(1) if k_mean is not None else 0, *sl,
                B, Hq, Hq // Hkv, Sq, Sk, right)
        const = dict(Q_SCALE_ROWS=q_scale_rows, K_SCALE_ROWS=k_scale_rows, HAS_KMEAN=k_mean is not None,
                     RETURN_LSE=bool(return_lse), REVERSE_M=bool(reverse_m), HEAD_DIM=D,
                     STAGES=options.stages_at(D), FLAT=flat, NAMED=options.named_at(D), HEAVY_FIRST=heavy,
                     **_LAUNCH)
        if const["NAMED"] and NAMED_BARRIER_BASE + const["STAGES"] + 2 > 16:  # 16 named barriers a CTA
            raise ValueError(f"GluonOptions.stages={const['STAGES']} with the named-barrier hand-back needs "
                             f"barrier ids up to {NAMED_BARRIER_BASE + const['STAGES'] + 1} (at most 15): set at "
                             f"most {16 - NAMED_BARRIER_BASE - 2} stages or GluonOptions.named=False")
        plan = (grid, ints, const)
        if key is not None:
            remember(_PLANS, key, plan)
    grid, ints, const = plan
    args = (q, k, v, o, lse, q_scale, k_scale, v_scale, km, *ints)
    if key is None:
        _LAUNCHER[grid](*args, **const)
    else:
        _LAUNCHER.keyed(grid, key, args, const)


HEAVY_FIRST_MIN_GAIN = 1.05
"""Heavy first across heads (Gluon) only where the modeled balance of the CTAs' work gains at least this factor."""
HEAVY_FIRST_MAX_L2_CACHES = 2.5
"""Heavy first across heads (Gluon and Triton) only where K and V take at most this many L2 caches: each round of
heavy-first tiles reads every head's keys (measured: the Triton kernel's heavy-first order lost at 192 MiB of K and
V on a 60 MiB L2)."""
HEAVY_FIRST_MAX_ROUNDS = 32
"""Heavy first across heads (Gluon) only where a CTA takes at most this many work tiles: past that both orders give
every CTA a like mix of tiles (and the model's host cost grows with the tiles)."""


def heavy_first_kv_fits(kv_bytes: int, device) -> bool:
    """Whether K and V of ``kv_bytes`` are few enough for a heavy-first order (``HEAVY_FIRST_MAX_L2_CACHES``)."""
    return kv_bytes <= HEAVY_FIRST_MAX_L2_CACHES * l2_bytes(device)


def causal_makespan_over_mean(*, n_m: int, n_bh: int, grid: int, Sq: int, Sk: int, heavy_first: bool) -> float:
    """Modeled makespan of a causal call's CTAs over their mean work (1.0: every CTA the same work): work tile t
    (``_fa_order``'s snake, then ``_fa_tile``'s order) runs on CTA t % grid and costs its key tiles plus one (its
    Q load and epilogue)."""
    n = n_m * n_bh
    t = torch.arange(n, dtype=torch.int64)
    j = t // grid
    t2 = torch.where((j % 2 == 1) & ((j + 1) * grid <= n), j * grid + grid - 1 - t % grid, t)
    pid_m = n_m - 1 - (t2 // n_bh if heavy_first else t2 % n_m)
    hi = (pid_m * BLOCK_M + BLOCK_M + Sk - Sq).clamp(0, Sk)
    cost = (hi + BLOCK_N - 1) // BLOCK_N + 1
    loads = torch.zeros(grid, dtype=torch.int64).index_add_(0, t % grid, cost)
    return loads.max().item() * grid / loads.sum().item()


def heavy_first_pays(*, B: int, Hq: int, Hkv: int, Sq: int, Sk: int, D: int, grid: int, device) -> bool:
    """Whether a causal FLAT call takes its work tiles heaviest first across all heads: the modeled balance
    (:func:`causal_makespan_over_mean`) gains at least ``HEAVY_FIRST_MIN_GAIN``, a CTA takes at most
    ``HEAVY_FIRST_MAX_ROUNDS`` tiles and K and V take at most ``HEAVY_FIRST_MAX_L2_CACHES`` L2 caches. Measured on
    an H200: it picked the faster order at eight shapes (BENCHMARKS.md)."""
    n_m = -(-Sq // BLOCK_M)
    n_tiles = n_m * B * Hq
    if grid <= 1 or n_tiles == 0 or n_tiles > HEAVY_FIRST_MAX_ROUNDS * grid:
        return False
    if not heavy_first_kv_fits(2 * B * Hkv * Sk * D, device):  # (INT8 K, E4M3 V)
        return False
    kw = dict(n_m=n_m, n_bh=B * Hq, grid=grid, Sq=Sq, Sk=Sk)
    by_head = causal_makespan_over_mean(**kw, heavy_first=False)
    return by_head >= HEAVY_FIRST_MIN_GAIN * causal_makespan_over_mean(**kw, heavy_first=True)


def _flat(qv, kv, vv, *, B, Hq, Hkv, Sq, Sk, D) -> bool:
    """Whether one TMA descriptor per operand can span every head (the kernel's FLAT): Q's and K's rows of all
    heads one evenly strided sequence ((b, h, s) at (b·H + h)·S + s rows), V's channels likewise, and every row
    index inside TMA's int32 coordinates."""
    return _flat_qk(qv, kv, B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=Sk) and _flat_v(vv, Hkv=Hkv, D=D) and B * Hkv * D < 2**31


def _flat_qk(qv, kv, *, B, Hq, Hkv, Sq, Sk) -> bool:
    """Q's and K's part of ``_flat`` (strides (b, h, s, d) in elements)."""
    q_ok = qv[1] == Sq * qv[2] and qv[0] == Hq * qv[1]
    k_ok = kv[1] == Sk * kv[2] and kv[0] == Hkv * kv[1]
    return q_ok and k_ok and max(B * Hq * Sq, B * Hkv * Sk) < 2**31


def _flat_v(vv, *, Hkv, D) -> bool:
    """V's part of ``_flat``: its (B, Hkv, D, S_pad) buffer dense (strides (b, h, s, d) of the sequence-contiguous
    view)."""
    return vv[1] == D * vv[3] and vv[0] == Hkv * vv[1]
