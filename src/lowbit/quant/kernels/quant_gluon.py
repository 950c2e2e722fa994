"""Gluon (Triton's explicit-layout dialect) 1x128 FP8 quantizer for Hopper: rowwise + columnwise copies from one
read, with the input streamed through shared memory by TMA.

Why a second kernel next to ``quant.blockwise_kernel``: that kernel's slab walk loads with plain global loads, so a
warp waits for each of its slabs and the memory system sees only what a few CTAs an SM have asked for at once:
0.68-0.72 of a device copy on the H200 (BENCHMARKS.md, sessions 4-7, every launch variant swept). Here one CTA an
SM walks its tiles with STAGES tiles of TMA loads in flight (STAGES x 32 KiB of input a SM), computes a tile from
shared memory while the next ones arrive, and writes both FP8 copies with vectorized stores.

The numbers are blockwise_kernel's (hence the reference's, bit for bit): amax as a max over int32 patterns of |x|,
``scale = fmax / amax`` by IEEE division (0 -> 1, overflow -> FP32 max, pow2 rounds down), ``scale_inv = 1 / scale``
stored, one FP32 product ``x * scale`` and the hardware's saturating RNE cast. Only whole tiles: M and K multiples
of 128, 16-bit input, 16-byte aligned (the launcher checks; everything else takes blockwise_kernel).
"""

from __future__ import annotations

try:  # Triton >= 3.5 with Gluon's Hopper ops
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

    # (renamed async_load and barrier after Triton 3.6)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    GLUON = True
except Exception:  # pragma: no cover - older Triton, or none
    GLUON = False

FP32_MAX = 3.4028234663852886e38

if GLUON:
    @gluon.jit
    def _g_scale(a, FMAX: gl.constexpr, POW2: gl.constexpr, EPS: gl.constexpr):
        """quant.kernels.quant._compute_scale: fmax / max(amax, eps); 0 -> 1; overflow -> FP32 max; pow2 rounds down;
        NaN stays."""
        if EPS > 0:
            a = gl.where(a != a, a, gl.maximum(a, EPS))
        s = gl.div_rn(gl.full_like(a, FMAX), a)
        s = gl.where(a == 0, 1.0, s)
        s = gl.where(s == float("inf"), 3.4028234663852886e38, s)
        if POW2:
            p = (s.to(gl.int32, bitcast=True) & 0x7F800000).to(gl.float32, bitcast=True)
            s = gl.where(s == s, p, s)
        return s

    @gluon.jit
    def _g_issue(xd, x_s, bars, t, nkt, pred, STAGES: gl.constexpr, i):
        """TMA load of tile t (row-panel order of the 128 x 128 grid) into stage i % STAGES."""
        s = i % STAGES
        pm = t // nkt
        mbarrier.expect(bars.index(s), xd.block_type.nbytes, pred=pred)
        _tma_load(xd, [pm * 128, (t - pm * nkt) * 128], bars.index(s), x_s.index(s), pred=pred)

    @gluon.jit
    def rowcol_1x128_gluon(x_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr, amax_ptr, M, K, rs_ld, cs_ld, n_prog,
                           FMAX: gl.constexpr, POW2: gl.constexpr, EPS: gl.constexpr,
                           ROW: gl.constexpr, COL: gl.constexpr, STAGES: gl.constexpr, abs_mask=0x7FFFFFFF):
        """x (M, K) 16-bit row-major, M % 128 == K % 128 == 0; persistent: program p takes 128 x 128 tiles p,
        p + n_prog, ... in row-panel order.

        Outputs (quant.kernels.quant.blockwise_kernel's 1D layouts): rq (M, K) FP8 with rs[kb, m] (ld rs_ld), cq
        (K, M) FP8 = the transposed columnwise copy with cs[mb, k] (ld cs_ld); scale_inv stored. amax_ptr: int32
        bits of max |x|, atomically maxed (the caller zeroes it). ``abs_mask``: a run-time 0x7FFFFFFF (see
        blockwise_kernel: a constant lets ptxas compute |x| in half precision, which rewrites NaN payloads).
        """
        NW: gl.constexpr = gl.num_warps()
        DT: gl.constexpr = rq_ptr.dtype.element_ty
        pid = gl.program_id(0)
        nkt = K // 128
        n_tiles = (M // 128) * nkt
        my_n = gl.cdiv(n_tiles - pid, n_prog)

        # No swizzle: a 128-wide 16-bit row is 256 bytes, wider than TMA's largest swizzle; the loads below read
        # 16 bytes a thread with 8 threads on each 128-byte row segment, which unswizzled rows serve without
        # bank conflicts.
        x_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
        xd = tma.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1], block_shape=[128, 128], layout=x_layout)
        x_s = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [STAGES, 128, 128], x_layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        for i in gl.static_range(STAGES):
            _g_issue(xd, x_s, bars, pid + i * n_prog, nkt, i < my_n, STAGES, i)

        # a thread holds 4 rows x 8 columns: 16-byte rows from shared memory, 8-byte rows of the rowwise copy
        L: gl.constexpr = gl.BlockedLayout([4, 8], [2, 16], [NW, 1], [1, 0])
        # the columnwise copy, transposed: 16 consecutive bytes of a cq row a thread, 8 threads a 128-byte row
        LT: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [NW, 1], [1, 0])
        r = gl.arange(0, 128, layout=gl.SliceLayout(1, L))
        c = gl.arange(0, 128, layout=gl.SliceLayout(0, L))
        rt = gl.arange(0, 128, layout=gl.SliceLayout(1, LT))
        ct = gl.arange(0, 128, layout=gl.SliceLayout(0, LT))
        tmax = gl.max(gl.zeros([128], gl.int32, gl.SliceLayout(1, L)), axis=0)
        for i in range(my_n):
            t = pid + i * n_prog
            pm = t // nkt
            pk = t - pm * nkt
            m0 = pm * 128
            k0 = pk * 128
            s = i % STAGES
            mbarrier.wait(bars.index(s), (i // STAGES) & 1)
            x = x_s.index(s).load(L).to(gl.float32)
            _cta_barrier()  # every warp has read stage s: refill it with the tile STAGES ahead
            _g_issue(xd, x_s, bars, t + STAGES * n_prog, nkt, i + STAGES < my_n, STAGES, i)

            ab = x.to(gl.int32, bitcast=True) & abs_mask
            rmax = gl.max(ab, axis=1)
            tmax = gl.maximum(tmax, gl.max(rmax, axis=0))
            if ROW:
                sr = _g_scale(rmax.to(gl.float32, bitcast=True), FMAX, POW2, EPS)
                gl.store(rs_ptr + pk.to(gl.int64) * rs_ld + m0 + r, gl.div_rn(gl.full_like(sr, 1.0), sr))
                q = (x * gl.expand_dims(sr, 1)).to(DT)
                gl.store(rq_ptr + (m0.to(gl.int64) * K + k0) + (gl.expand_dims(r, 1) * K + gl.expand_dims(c, 0)), q)
            if COL:
                sc = _g_scale(gl.max(ab, axis=0).to(gl.float32, bitcast=True), FMAX, POW2, EPS)
                gl.store(cs_ptr + pm.to(gl.int64) * cs_ld + k0 + c, gl.div_rn(gl.full_like(sc, 1.0), sc))
                qc = (x * gl.expand_dims(sc, 0)).to(DT)
                qt = gl.convert_layout(gl.permute(qc, [1, 0]), LT)
                gl.store(cq_ptr + (k0.to(gl.int64) * M + m0) + (gl.expand_dims(rt, 1) * M + gl.expand_dims(ct, 0)), qt)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))
        gl.atomic_max(amax_ptr, tmax, sem="relaxed")
