"""Gluon (Triton's explicit-layout dialect) quantizers that make the rowwise and the columnwise (transposed) copy
of an input from one read.

``rowcol_1x128_regs`` (the default for both 1x128 copies of whole 128 x 128 tiles, sm_89+) and
``mxfp8_rowcol_regs`` (the same for MXFP8): one tile a program held in registers, 8 x 8 elements a thread. Row and
column block maxima both come from the one load, and the transposed copy needs no shared-memory transposition:
the same registers read down the columns (layout B of :func:`rowcol_regs_layouts`, a linear layout with the lanes
of A) give the hardware's two-value FP8 cast vertical pairs, stored as 8-byte pieces of the transposed rows.
On the H200 (BENCHMARKS.md) 1x128 reaches 0.80 of a device copy's bandwidth from BF16 and 0.93 from FP32, above
``quant.blockwise_kernel``'s slab walk; MXFP8 0.66, above ``mxfp8_kernel``.
``rowcol_1x128_regs`` also takes the RMSNorm (``NORM``), SwiGLU (``SWIGLU``) and SwiGLU-backward (``SWIGLU_BWD``)
prologues of the fused quantizers. ``rowcol_1x128_regs_packed`` (BF16 input, no prologue; the default there)
holds and reduces the tile as BF16 pairs in 80 registers, three CTAs an SM: 0.87-0.90 of a copy.

The numbers are blockwise_kernel's / mxfp8_kernel's (hence the reference's, bit for bit): amax as a max over int32
patterns of |x|, ``scale = fmax / amax`` (0 -> 1, overflow -> FP32 max, power-of-two scales from the exponent bits),
``scale_inv = 1 / scale`` stored, one FP32 product ``x * scale`` and the hardware's saturating RNE cast; MXFP8 E8M0
codes from the block maximum's exponent. Only whole tiles: M and K multiples of 128 (the launchers check; everything
else takes the Triton kernels).
"""

from __future__ import annotations

try:  # Triton >= 3.5 with Gluon's Hopper ops
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma  # noqa: F401 - (the version check)
    GLUON = True
except Exception:  # pragma: no cover - older Triton, or none
    GLUON = False

# The scale math is the Triton kernels' own (quant.kernels.quant): those helpers make no layout-less tensors, so
# the Gluon kernels call them as they are.
from .quant import compute_scale, mx_exponent, recip, sigmoid  # noqa: E402

if GLUON:
    @gluon.jit
    def _swiglu_bwd_half(x_ptr, g_ptr, m0, k0, K, H: gl.constexpr, h: gl.constexpr):
        """Rows 2i + h (i < 64) of the du tile (m0, k0) in layout H (16-bit): lowbit.ops.swiglu's _swiglu_kernel
        (BACKWARD): sig = 1 / (1 + exp(-a)) (quant.sigmoid), da = g * b * (sig * (1 + a * (1 - sig))),
        db = g * (a * sig), FP32 math rounded once to u's dtype; the tile lies in the a half of du (da: reads a, b,
        g) or the b half (db: reads a, g; b's load is masked off). Both halves run one branch-free expression (below):
        a branch on the half (uniform in a program) made ptxas spill under the 128-register cap, and computing both
        values and selecting one cost ~3 instructions an element more (4-10% slower on the H200)."""
        F = K // 2
        f0 = k0 - (k0 >= F).to(gl.int64) * F  # the column of a (and of g) under this tile
        i = gl.arange(0, 64, layout=gl.SliceLayout(1, H))
        c = gl.arange(0, 128, layout=gl.SliceLayout(0, H))
        rows = gl.expand_dims(2 * i + h, 1)
        pa = x_ptr + (m0 * K + f0) + rows * K + gl.expand_dims(c, 0)
        a = gl.load(pa).to(gl.float32)
        g = gl.load(g_ptr + (m0 * F + f0) + rows * F + gl.expand_dims(c, 0)).to(gl.float32)
        sig = sigmoid(a)
        isa = (gl.expand_dims(i * 0, 1) + gl.expand_dims(c, 0) + k0) < F  # (all or none of the tile)
        b = gl.load(pa + F, mask=isa, other=1.0).to(gl.float32)
        # One expression for both halves, (g * b') * (sig * fma(a, w, addend)): in the a half b' = b, w = 1 - sig (as
        # fma(sig, -1, 1), one rounding as the subtraction), addend 1, which is da as the kernel computes it (its
        # 1 + a * (1 - sig) contracts to that fma); in the b half b' = 1 (the masked load's value), w = 1, addend -0,
        # and fma(a, 1, -0) = a exactly (-0 keeps a = -0's sign), so (g * 1) * (sig * a) = db bit for bit. This
        # takes ~3 instructions an element fewer than computing both and selecting one.
        s1 = (k0 < F).to(gl.float32)
        w = gl.fma(sig, -s1, 1.0)
        # the addend from its bits: Triton folds a -0.0 literal to +0.0 (and fma(-0, 1, +0) = +0 would flip db's sign)
        addend = gl.where(k0 < F, 0x3F800000, -2147483648).to(gl.float32, bitcast=True)  # 1.0 or -0.0
        t = gl.fma(a, w, addend)
        x = ((g * b) * (sig * t)).to(x_ptr.dtype.element_ty)
        return x

    @gluon.jit
    def _swiglu_bwd_tile(x_ptr, g_ptr, m0, k0, K, A: gl.constexpr, H: gl.constexpr):
        """The du tile (m0, k0) in layout A, computed as two halves of 64 rows (even rows, then odd rows: half the
        registers of a thread's 8 x 8 block each), so the three 16-bit input tiles are not all held at once (as one
        piece: 253 registers under Triton 3.6). Joined along a new last dimension, the halves are A's elements in
        A's threads: the conversion to A only renames registers."""
        return _join_halves(_swiglu_bwd_half(x_ptr, g_ptr, m0, k0, K, H, 0),
                            _swiglu_bwd_half(x_ptr, g_ptr, m0, k0, K, H, 1), A)

    @gluon.jit
    def _join_halves(x0, x1, A: gl.constexpr):
        """The 128 x 128 tile in layout A from its even rows x0 and odd rows x1 (each 64 x 128 in layout H of
        rowcol_regs_half_layout): joined along a new last dimension they are A's elements in A's threads, so the
        conversion only renames registers."""
        x = gl.reshape(gl.permute(gl.join(x0, x1), [0, 2, 1]), [128, 128])  # row 2i + h
        return gl.convert_layout(x, A)

    @gluon.jit
    def _rope_bwd_half(gq_ptr, gk_ptr, gv_ptr, cos_ptr, sin_ptr, m0, k0, T, tab_row, HD, DH: gl.constexpr,
                       H: gl.constexpr, h: gl.constexpr):
        """Rows 2i + h (i < 64) of the dqkv tile (m0, k0) in layout H (FP32 of the 16-bit values): RoPE's backward
        as lowbit.ops.rope's kernel computes it (SIGN = -1), from the gradients of the rotated q and k and of v.
        dqkv (M, 3 * HD) is [dq | dk | dv] by columns, HD = heads x DH; each g* is (M, HD) row-major (bshd). A tile
        lies in one part (HD % 128 == 0) and covers whole heads (DH in 64, 128), so a column's rotation partner
        (d +- DH/2) is in the tile: out[d] = fma(g[pd], +-sin[t, pd], g[d] * cos[t, d]) (+ for d < DH/2), t = row % T,
        rounded once to g's dtype; dv is g itself."""
        HALF: gl.constexpr = DH // 2
        part = k0 // HD
        kk = k0 - part * HD
        i = gl.arange(0, 64, layout=gl.SliceLayout(1, H))
        c = gl.arange(0, 128, layout=gl.SliceLayout(0, H))
        base = m0 * HD + kk  # (int64; the in-tile offsets below are int32, as the other prologues')
        rows = gl.expand_dims(2 * i + h, 1) * HD
        offs = base + rows + gl.expand_dims(c, 0)
        if part == 2:
            x = gl.load(gv_ptr + offs)
        else:
            # partner columns as c + (+-HALF), the sign constant over each aligned group of HALF columns (not
            # c ^ HALF: the compiler would not see 8 contiguous columns a thread, and load them one at a time)
            hi = (c // HALF) % 2  # 1 in the second half of a head
            dc = c % DH
            pc = c + HALF - hi * DH
            pofs = base + rows + gl.expand_dims(pc, 0)
            if part == 0:  # (loads in the branches, not a selected pointer, whose alignment the compiler loses)
                g = gl.load(gq_ptr + offs)
                gp = gl.load(gq_ptr + pofs)
            else:
                g = gl.load(gk_ptr + offs)
                gp = gl.load(gk_ptr + pofs)
            g = g.to(gl.float32)
            gp = gp.to(gl.float32)
            # (the table row in int32: M may pass 2^31 elements, T and the rows of a tile do not)
            t = gl.expand_dims(((m0 % T).to(gl.int32) + 2 * i + h) % T, 1) * tab_row
            cs = gl.load(cos_ptr + (t + gl.expand_dims(dc, 0)))
            sn = gl.load(sin_ptr + (t + gl.expand_dims(dc + HALF - hi * DH, 0)))
            sn = gl.where(gl.expand_dims(hi == 0, 0), sn, -sn)
            x = gl.fma(gp, sn, g * cs).to(gq_ptr.dtype.element_ty)
        return x

    @gluon.jit
    def _rope_bwd_tile(gq_ptr, gk_ptr, gv_ptr, cos_ptr, sin_ptr, m0, k0, T, tab_row, HD, DH: gl.constexpr,
                       A: gl.constexpr, H: gl.constexpr):
        """The dqkv tile (m0, k0) in layout A, as two halves of 64 rows (as _swiglu_bwd_tile: fewer registers)."""
        return _join_halves(_rope_bwd_half(gq_ptr, gk_ptr, gv_ptr, cos_ptr, sin_ptr, m0, k0, T, tab_row, HD, DH, H, 0),
                            _rope_bwd_half(gq_ptr, gk_ptr, gv_ptr, cos_ptr, sin_ptr, m0, k0, T, tab_row, HD, DH, H, 1),
                            A)

    @gluon.jit
    def _tile_origin(K):
        """(pm, pk, m0, k0): this program's 128 x 128 tile in K-major order (program p: row panel p // (K / 128),
        column tile p % (K / 128)) and its first row and column (int64)."""
        pid = gl.program_id(0)
        nkt = K // 128
        pm = pid // nkt
        pk = pid - pm * nkt
        return pm, pk, pm.to(gl.int64) * 128, pk.to(gl.int64) * 128

    @gluon.jit
    def _store_transposed(cq_ptr, qc, T: gl.constexpr, m0, k0, M):
        """Tile (m0, k0) of the columnwise copy, qc (128 x 128 FP8 in layout B), into rows k0.. of cq (K, M):
        transposed in registers only (T is B with the dimensions swapped), 8 bytes of a cq row a thread."""
        qt = gl.convert_layout(gl.permute(qc, [1, 0]), T)
        ct = gl.arange(0, 128, layout=gl.SliceLayout(1, T))
        rt = gl.arange(0, 128, layout=gl.SliceLayout(0, T))
        gl.store(cq_ptr + (k0 * M + m0) + gl.expand_dims(ct, 1) * M + gl.expand_dims(rt, 0), qt)

    @gluon.jit
    def rowcol_1x128_regs(x_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr, amax_ptr, M, K, rs_ld, cs_ld,
                          FMAX: gl.constexpr, POW2: gl.constexpr, EPS: gl.constexpr, A: gl.constexpr,
                          B: gl.constexpr, T: gl.constexpr, COMPACT: gl.constexpr = False, NORM: gl.constexpr = False,
                          SWIGLU: gl.constexpr = False, abs_mask=0x7FFFFFFF, rstd_ptr=None, nw_ptr=None,
                          SWIGLU_BWD: gl.constexpr = False, g_ptr=None, H: gl.constexpr = None,
                          ROPE_BWD: gl.constexpr = False, gv_ptr=None, cos_ptr=None, sin_ptr=None, rope_T=1, tab_row=0,
                          HD=0, DH: gl.constexpr = None, AW: gl.constexpr = None):
        """x (M, K) 16-bit or FP32 row-major, M % 128 == K % 128 == 0; one 128 x 128 tile a program, K-major
        order (program p: row panel p // (K / 128), column tile p % (K / 128)).

        Outputs and numbers: rowcol_1x128_gluon's (rq (M, K) with rs[kb, m], cq (K, M) with cs[mb, k], scale_inv
        stored, amax_ptr the int32 bits of max |x|, atomically maxed).

        One read, nothing through shared memory but the reductions' partials: a thread holds an RPT x 8 block
        (RPT consecutive rows, 8 consecutive columns) of the tile, so the tile's row maxima and column maxima both
        come from the one load, and the columnwise copy needs no transposition: with the same block read down its
        columns (a register reorder, no data moves), the hardware's two-value FP8 cast packs vertical pairs, and
        each thread stores RPT consecutive bytes of 8 rows of cq directly. A, B, T: rowcol_regs_layouts(num_warps).
        COMPACT: each scale computed by one thread, not by every thread holding its row / column.
        NORM: quantize the RMSNorm output (x * rstd[m]) * w[k] (FP32 x; rstd_ptr (M,), nw_ptr (K,) FP32) instead of x,
        as blockwise_kernel's NORM (lowbit.ops.norm_quant).
        SWIGLU: quantize h = silu(a) * b (M, K) of x = u (M, 2K) = [a | b], 16-bit (lowbit.ops.swiglu).
        SWIGLU_BWD: quantize SwiGLU's input gradient du = d[a | b] (M, K), K = 2F, from x = u (M, K) = [a | b] and
        g_ptr = dh (M, F), both 16-bit: du as lowbit.ops.swiglu's backward kernel stores it (the same FP32 operations,
        rounded once to u's dtype). A program's tile lies in the a half (da = g * b * silu'(a), reading a, b, g) or in
        the b half (db = g * silu(a), reading a, g). H: rowcol_regs_half_layout(num_warps) (the tile is computed in
        two halves of 64 rows).
        ROPE_BWD: quantize the gradient of a packed QKV projection output, dqkv (M, K) = [dq | dk | dv], K = 3 HD, from
        the gradients of RoPE's outputs: x_ptr = dq_rot, g_ptr = dk_rot, gv_ptr = dv, each (M, HD) row-major 16-bit,
        cos_ptr / sin_ptr (>= rope_T, DH) FP32 with row stride tab_row, t = row % rope_T: dqkv as lowbit.ops.rope's
        backward kernel stores it (_rope_bwd_half). HD % 128 == 0, DH in (64, 128); H as for SWIGLU_BWD.
        AW (BF16 tiles of the SWIGLU_BWD / ROPE_BWD prologues; rowcol_regs_word_layout): the computed tile is packed
        into BF16 pairs and quantized as rowcol_1x128_regs_packed does (fewer instructions for the maxima).
        """
        pm, pk, m0, k0 = _tile_origin(K)
        r = gl.arange(0, 128, layout=gl.SliceLayout(1, A))
        c = gl.arange(0, 128, layout=gl.SliceLayout(0, A))
        LD: gl.constexpr = 2 if SWIGLU else 1  # x's row stride in units of K
        ptrs = x_ptr + (m0 * K * LD + k0) + gl.expand_dims(r, 1) * (K * LD) + gl.expand_dims(c, 0)  # (not *_BWD)
        if ROPE_BWD:
            x = _rope_bwd_tile(x_ptr, g_ptr, gv_ptr, cos_ptr, sin_ptr, m0, k0, rope_T, tab_row, HD, DH, A, H)
        elif SWIGLU_BWD:
            x = _swiglu_bwd_tile(x_ptr, g_ptr, m0, k0, K, A, H)
        elif SWIGLU:
            # h = silu(a) * b of u = [a | b], FP32 math rounded once to u's dtype: lowbit.ops.swiglu's _silu and
            # _swiglu_h (the same operations, so the same bits as the SwiGLU kernel stores)
            a = gl.load(ptrs).to(gl.float32)
            b = gl.load(ptrs + K)
            x = ((a * sigmoid(a)) * b.to(gl.float32)).to(b.dtype)
        else:
            x = gl.load(ptrs)
        if AW is not None:
            _rowcol_packed_core(_pack_words(x, AW), rq_ptr, rs_ptr, cq_ptr, cs_ptr, amax_ptr, M, K, rs_ld, cs_ld, pm,
                                pk,
                                m0, k0, FMAX, POW2, EPS, A, B, T, abs_mask)
        else:
            _rowcol_quant(x, rq_ptr, rs_ptr, cq_ptr, cs_ptr, amax_ptr, M, K, rs_ld, cs_ld, pm, pk, m0, k0, r, c, FMAX,
                          POW2, EPS, A, B, T, COMPACT, NORM, abs_mask, rstd_ptr, nw_ptr)

    @gluon.jit
    def _rowcol_quant(x, rq_ptr, rs_ptr, cq_ptr, cs_ptr, amax_ptr, M, K, rs_ld, cs_ld, pm, pk, m0, k0, r, c,
                      FMAX: gl.constexpr, POW2: gl.constexpr, EPS: gl.constexpr, A: gl.constexpr, B: gl.constexpr,
                      T: gl.constexpr, COMPACT: gl.constexpr, NORM: gl.constexpr, abs_mask, rstd_ptr, nw_ptr):
        """rowcol_1x128_regs' quantization of its tile x (16-bit or FP32, layout A): maxima over int32 patterns of |x|
        in FP32, scales, both copies, the amax."""
        DT: gl.constexpr = rq_ptr.dtype.element_ty
        x = x.to(gl.float32)
        if NORM:  # the RMSNorm output (x * rstd[m]) * w[k], as blockwise_kernel's _norm_rows
            x = (x * gl.expand_dims(gl.load(rstd_ptr + m0 + r), 1)) * gl.expand_dims(gl.load(nw_ptr + k0 + c), 0)
        ab = x.to(gl.int32, bitcast=True) & abs_mask
        rmax = gl.max(ab, axis=1)
        cmax = gl.max(ab, axis=0)
        if COMPACT:
            # The maxima leave the reductions replicated (a row's in its 16 threads): the scales are computed once
            # each, one a thread, and brought back (through shared memory, as the reductions were).
            S1: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
            i1 = gl.arange(0, 128, layout=S1)
            sr1 = compute_scale(gl.convert_layout(rmax, S1).to(gl.float32, bitcast=True), FMAX, POW2, EPS)
            gl.store(rs_ptr + pk.to(gl.int64) * rs_ld + m0 + i1, recip(sr1, POW2, FMAX))
            sc1 = compute_scale(gl.convert_layout(cmax, S1).to(gl.float32, bitcast=True), FMAX, POW2, EPS)
            gl.store(cs_ptr + pm.to(gl.int64) * cs_ld + k0 + i1, recip(sc1, POW2, FMAX))
            sr = gl.convert_layout(sr1, gl.SliceLayout(1, A))
            sc = gl.convert_layout(sc1, gl.SliceLayout(0, A))
        else:
            sr = compute_scale(rmax.to(gl.float32, bitcast=True), FMAX, POW2, EPS)
            gl.store(rs_ptr + pk.to(gl.int64) * rs_ld + m0 + r, recip(sr, POW2, FMAX))
            sc = compute_scale(cmax.to(gl.float32, bitcast=True), FMAX, POW2, EPS)
            gl.store(cs_ptr + pm.to(gl.int64) * cs_ld + k0 + c, recip(sc, POW2, FMAX))
        q = (x * gl.expand_dims(sr, 1)).to(DT)
        gl.store(rq_ptr + (m0 * K + k0) + gl.expand_dims(r, 1) * K + gl.expand_dims(c, 0), q)
        xb = gl.convert_layout(x, B)
        qc = (xb * gl.expand_dims(gl.convert_layout(sc, gl.SliceLayout(0, B)), 0)).to(DT)
        _store_transposed(cq_ptr, qc, T, m0, k0, M)
        gl.atomic_max(amax_ptr, gl.max(cmax, axis=0), sem="relaxed")


if GLUON:
    @gluon.jit
    def _max_u16x2(a, b):
        """Per 16-bit half, the unsigned maximum of two int32 words (VIMNMX.U16x2): on |x| bit patterns of BF16 pairs
        the larger magnitude of each half, NaN (0x7FC0..) above Inf (0x7F80) as blockwise_kernel's int32 maximum."""
        return gl.inline_asm_elementwise("max.u16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=gl.int32, is_pure=True,
                                         pack=1)

    @gluon.jit
    def _bf16_words_f32(w, A: gl.constexpr):
        """The 128 x 128 FP32 tile in layout A from its BF16 pairs w (128 x 64 int32 in rowcol_regs_word_layout: the
        low half is the even column): a BF16 is the top 16 bits of its FP32, so each value is one shift or mask,
        and joined along a new last dimension the halves are A's elements in A's threads (a register renaming)."""
        x = gl.reshape(gl.join(w << 16, w & -65536), [128, 128])
        return gl.convert_layout(x, A).to(gl.float32, bitcast=True)

    @gluon.jit
    def _bf16_bits(v):
        """The BF16 bit pattern of ``v`` (FP32: rounded to BF16, RNE; BF16: itself) in the low 16 bits of an int32."""
        return v.to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF

    @gluon.jit
    def _swiglu_words(aw, bw):
        """h = silu(a) * b as BF16 pairs from the pairs of a and b (the SWIGLU prologue's operations, per half)."""
        a0 = (aw << 16).to(gl.float32, bitcast=True)
        a1 = (aw & -65536).to(gl.float32, bitcast=True)
        h0 = (a0 * sigmoid(a0)) * (bw << 16).to(gl.float32, bitcast=True)
        h1 = (a1 * sigmoid(a1)) * (bw & -65536).to(gl.float32, bitcast=True)
        return _bf16_bits(h0) | (_bf16_bits(h1) << 16)

    @gluon.jit
    def rowcol_1x128_regs_packed(x_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr, amax_ptr, M, K, rs_ld, cs_ld,
                                 FMAX: gl.constexpr, POW2: gl.constexpr, EPS: gl.constexpr, A: gl.constexpr,
                                 B: gl.constexpr, T: gl.constexpr, AW: gl.constexpr, abs_mask=0x7FFFFFFF,
                                 SWIGLU: gl.constexpr = False):
        """rowcol_1x128_regs (COMPACT, no prologue) for BF16 x, with the tile read and reduced as BF16 pairs.

        Same outputs and numbers, bit for bit: the block maxima are taken on the 16-bit |x| patterns two at a time
        (one VIMNMX.U16x2 a pair; a BF16's pattern orders as its FP32's, which is the top half) and widened once
        per row / column; the FP32 values are made from the pairs only for the two products. The tile lives in
        32 registers a thread instead of 64 + 64 (FP32 values and |x| patterns), so the kernel fits 80 registers:
        three CTAs an SM instead of two, more loads in flight. AW: rowcol_regs_word_layout (A over pairs).
        SWIGLU: quantize h = silu(a) * b (M, K) of x = u (M, 2K) = [a | b], BF16, as rowcol_1x128_regs' SWIGLU
        prologue computes it, pair by pair."""
        pm, pk, m0, k0 = _tile_origin(K)
        rw = gl.arange(0, 128, layout=gl.SliceLayout(1, AW))
        cw = gl.arange(0, 64, layout=gl.SliceLayout(0, AW))
        K2 = K // 2
        LD: gl.constexpr = 2 if SWIGLU else 1  # x's row stride in units of K
        xw = x_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
        wp = xw + (m0 * K2 * LD + k0 // 2) + gl.expand_dims(rw, 1) * (K2 * LD) + gl.expand_dims(cw, 0)
        if SWIGLU:
            w = _swiglu_words(gl.load(wp), gl.load(wp + K2))
        else:
            w = gl.load(wp)
        _rowcol_packed_core(w, rq_ptr, rs_ptr, cq_ptr, cs_ptr, amax_ptr, M, K, rs_ld, cs_ld, pm, pk, m0, k0, FMAX, POW2,
                            EPS, A, B, T, abs_mask)

    @gluon.jit
    def _pack_words(x16, AW: gl.constexpr):
        """The BF16 tile x16 (128 x 128, layout A) as its pairs (128 x 64 int32 in AW, the even column low): the
        split along the first register dimension and the conversion to AW only rename registers."""
        lo, hi = gl.split(gl.reshape(_bf16_bits(x16), [128, 64, 2]))
        return gl.convert_layout(lo | (hi << 16), AW)

    @gluon.jit
    def _rowcol_packed_core(w, rq_ptr, rs_ptr, cq_ptr, cs_ptr, amax_ptr, M, K, rs_ld, cs_ld, pm, pk, m0, k0,
                            FMAX: gl.constexpr, POW2: gl.constexpr, EPS: gl.constexpr, A: gl.constexpr,
                            B: gl.constexpr, T: gl.constexpr, abs_mask):
        """Both 1x128 copies, their scales and the amax of tile (m0, k0) from its BF16 pairs w (128 x 64 int32, the
        layout A over pairs): rowcol_1x128_regs_packed's reductions and products."""
        DT: gl.constexpr = rq_ptr.dtype.element_ty
        r = gl.arange(0, 128, layout=gl.SliceLayout(1, A))
        c = gl.arange(0, 128, layout=gl.SliceLayout(0, A))
        # (the mask from the run-time abs_mask, as rowcol_1x128_regs': a constant could become a half-precision |x|)
        aw = w & (abs_mask & 0x7FFF7FFF)
        rmw = gl.reduce(aw, 1, _max_u16x2)  # (128,) per row: the max of its even columns | of its odd columns
        cmw = gl.reduce(aw, 0, _max_u16x2)  # (64,) per column pair
        S1: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        i1 = gl.arange(0, 128, layout=S1)
        rmax = gl.convert_layout(gl.maximum(rmw << 16, rmw & -65536), S1)  # FP32 patterns, >= 0
        cmax = gl.convert_layout(gl.reshape(gl.join(cmw << 16, cmw & -65536), [128]), S1)
        sr1 = compute_scale(rmax.to(gl.float32, bitcast=True), FMAX, POW2, EPS)
        gl.store(rs_ptr + pk.to(gl.int64) * rs_ld + m0 + i1, recip(sr1, POW2, FMAX))
        sc1 = compute_scale(cmax.to(gl.float32, bitcast=True), FMAX, POW2, EPS)
        gl.store(cs_ptr + pm.to(gl.int64) * cs_ld + k0 + i1, recip(sc1, POW2, FMAX))
        x = _bf16_words_f32(w, A)
        q = (x * gl.expand_dims(gl.convert_layout(sr1, gl.SliceLayout(1, A)), 1)).to(DT)
        gl.store(rq_ptr + (m0 * K + k0) + gl.expand_dims(r, 1) * K + gl.expand_dims(c, 0), q)
        xb = gl.convert_layout(x, B)
        qc = (xb * gl.expand_dims(gl.convert_layout(sc1, gl.SliceLayout(0, B)), 0)).to(DT)
        _store_transposed(cq_ptr, qc, T, m0, k0, M)
        gl.atomic_max(amax_ptr, gl.max(cmax, axis=0), sem="relaxed")


def rowcol_regs_layouts(num_warps: int, lanes_c: int = 8):
    """The three register layouts of rowcol_1x128_regs for a 128 x 128 tile at ``num_warps`` (4, 8 or 16) warps.

    A thread holds RPT = 64 / num_warps consecutive rows x 8 consecutive columns; a warp's lanes are ``lanes_c``
    along the columns x 32 / lanes_c along the rows, the warps 16 / lanes_c along the columns and the rest along
    the rows. So a warp instruction stores 8 * lanes_c consecutive bytes of each rq row it touches and
    RPT * 32 / lanes_c of each cq row; with 8 (the default) both are whole 32-byte sectors or more.
    A: registers along the columns (vector loads of x, 8-byte stores of rq); B: the same elements in the same lanes
    and warps with the registers ordered down the columns (a BlockedLayout cannot say this: its one ``order`` also
    decides how lanes are laid out, so B is linear); T: B transposed, cq's (column, row) coordinates.
    """
    if num_warps not in (4, 8, 16):
        raise ValueError(f"rowcol_regs_layouts: num_warps must be 4, 8 or 16, got {num_warps}")
    if lanes_c not in (2, 4, 8, 16) or 16 // lanes_c > num_warps:
        raise ValueError(f"rowcol_regs_layouts: lanes_c must be 2, 4, 8 or 16 with 16 / lanes_c <= num_warps, got "
                         f"{lanes_c} at {num_warps} warps")
    rpt = 64 // num_warps
    log2 = lambda n: n.bit_length() - 1  # noqa: E731
    rows_reg = [[1 << i, 0] for i in range(log2(rpt))]
    cols_reg = [[0, 1], [0, 2], [0, 4]]
    lanes = [[0, 8 << i] for i in range(log2(lanes_c))] + [[rpt << i, 0] for i in range(log2(32 // lanes_c))]
    wc = 16 // lanes_c
    warps = [[0, 8 * lanes_c << i] for i in range(log2(wc))] \
        + [[rpt * 32 // lanes_c << i, 0] for i in range(log2(num_warps // wc))]
    A = gl.DistributedLinearLayout(cols_reg + rows_reg, lanes, warps, [], [128, 128])
    B = gl.DistributedLinearLayout(rows_reg + cols_reg, lanes, warps, [], [128, 128])
    sw = lambda bases: [[b[1], b[0]] for b in bases]  # noqa: E731
    T = gl.DistributedLinearLayout(sw(rows_reg + cols_reg), sw(lanes), sw(warps), [], [128, 128])
    return A, B, T


def rowcol_regs_word_layout(num_warps: int, lanes_c: int = 8):
    """AW: rowcol_regs_layouts' A over the (128, 64) int32 words of a BF16 tile (word j of a row = columns 2j, 2j + 1):
    A with its first column register (column 1) taken out and every other column coordinate halved, so that
    joining each word's two halves along a new last dimension gives back A's elements in A's threads."""
    A = rowcol_regs_layouts(num_warps, lanes_c)[0]
    half = lambda bases: [[b[0], b[1] // 2] for b in bases if b != [0, 1]]  # noqa: E731
    return gl.DistributedLinearLayout(half(A.reg_bases), half(A.lane_bases), half(A.warp_bases), [], [128, 64])


def rowcol_regs_half_layout(num_warps: int, lanes_c: int = 8):
    """H: the (64, 128) half of rowcol_regs_layouts' A that holds the tile's rows 2i + h (i < 64) for one h: A with
    its first row register (row 1) taken out and every other row coordinate halved, so that joining the two halves
    along a new last dimension and reshaping gives back A's elements in A's threads (the SWIGLU_BWD prologue)."""
    A = rowcol_regs_layouts(num_warps, lanes_c)[0]
    half = lambda bases: [[b[0] // 2, b[1]] for b in bases if b != [1, 0]]  # noqa: E731
    return gl.DistributedLinearLayout(half(A.reg_bases), half(A.lane_bases), half(A.warp_bases), [], [64, 128])


if GLUON:
    @gluon.jit
    def mxfp8_rowcol_regs(x_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr, amax_ptr, M, K, EMAX: gl.constexpr,
                          A: gl.constexpr, B: gl.constexpr, T: gl.constexpr, abs_mask=0x7FFFFFFF):
        """MXFP8 rowwise + columnwise copies (quant.kernels.quant.mxfp8_kernel's outputs and numbers) of x (M, K)
        16-bit or FP32 row-major, M % 128 == K % 128 == 0: rq (M, K) with E8M0 codes rs (M, K / 32), cq (K, M) the
        transposed copy with cs (K, M / 32); amax_ptr the int32 bits of max |x|, atomically maxed.

        rowcol_1x128_regs' register tile (layouts A, B, T of rowcol_regs_layouts(8)): a thread's 8 x 8 block and
        its 3 neighbours along a row (lanes) make a 1 x 32 block, and along a column a 32 x 1 block, so every block
        maximum is a warp shuffle away (no shared memory but the tile amax), and the columnwise copy is cast from
        vertical pairs in the same registers (B) and stored as 8-byte pieces of cq rows (T)."""
        DT: gl.constexpr = rq_ptr.dtype.element_ty
        pm, pk, m0, k0 = _tile_origin(K)
        r = gl.arange(0, 128, layout=gl.SliceLayout(1, A))
        c = gl.arange(0, 128, layout=gl.SliceLayout(0, A))
        x = gl.load(x_ptr + (m0 * K + k0) + gl.expand_dims(r, 1) * K + gl.expand_dims(c, 0)).to(gl.float32)
        ab = x.to(gl.int32, bitcast=True) & abs_mask
        # rowwise: 1 x 32 blocks
        X, code = mx_exponent(gl.max(gl.reshape(ab, [128, 4, 32]), axis=2), EMAX)
        mult = ((127 - X) << 23).to(gl.float32, bitcast=True)  # 2**-X, as mxfp8_kernel
        q = gl.reshape(gl.reshape(x, [128, 4, 32]) * gl.expand_dims(mult, 2), [128, 128])
        gl.store(rq_ptr + (m0 * K + k0) + gl.expand_dims(r, 1) * K + gl.expand_dims(c, 0),
                 gl.convert_layout(q, A).to(DT))
        rb = gl.arange(0, 128, layout=gl.SliceLayout(1, code.type.layout))
        jb = gl.arange(0, 4, layout=gl.SliceLayout(0, code.type.layout))
        gl.store(rs_ptr + (m0 + gl.expand_dims(rb, 1)) * (K // 32) + (pk * 4 + gl.expand_dims(jb, 0)),
                 code.to(gl.uint8))
        # columnwise: 32 x 1 blocks, the values read down the columns (B) for the transposed copy
        bmc = gl.max(gl.reshape(ab, [4, 32, 128]), axis=1)
        Xc, codec = mx_exponent(bmc, EMAX)
        multc = ((127 - Xc) << 23).to(gl.float32, bitcast=True)
        xb = gl.reshape(gl.convert_layout(x, B), [4, 32, 128])
        mb = gl.expand_dims(gl.convert_layout(multc, gl.SliceLayout(1, xb.type.layout)), 1)
        qc = gl.convert_layout(gl.reshape(xb * mb, [128, 128]), B).to(DT)
        _store_transposed(cq_ptr, qc, T, m0, k0, M)
        ib = gl.arange(0, 4, layout=gl.SliceLayout(1, codec.type.layout))
        kb = gl.arange(0, 128, layout=gl.SliceLayout(0, codec.type.layout))
        gl.store(cs_ptr + (k0 + gl.expand_dims(kb, 0)) * (M // 32) + (pm * 4 + gl.expand_dims(ib, 1)),
                 codec.to(gl.uint8))
        gl.atomic_max(amax_ptr, gl.max(gl.max(bmc, axis=1), axis=0), sem="relaxed")
