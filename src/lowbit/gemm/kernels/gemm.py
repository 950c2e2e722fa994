"""Triton scaled-GEMM kernels (NUMERICS §5): ``C = A · Bᵀ`` with A (M, K) and B (N, K) both K-contiguous.

* :func:`fp8_gemm_kernel`: FP8 (E4M3/E5M2 in any pairing the caller allows) tensor-core GEMM with
  per-operand scale modes — 0 tensorwise ``s[0]``, 1 per row ``s[row]``, 2 1xBS blocks
  ``s[kb * ld + row]`` (outer-dim-major storage), 3 BSxBS tiles ``s[(row // BS) * ld + kb]`` —
  and FP32 promotion once per BS-wide K block: each block's partial product is reduced on the tensor
  cores from a zero accumulator, multiplied by its two scales and added into the FP32 accumulator.
  One program per output tile, tiles ordered in groups along M for L2 reuse (a persistent loop over
  tiles stopped Triton from software-pipelining the K loop, which costs far more than it saves).
* :func:`emu_gemm_kernel`: NVFP4 / MXFP8 operands, emulated on Hopper: the elements are unpacked and
  multiplied by their block scale in registers (exact in BF16: an E2M1 × E4M3 product has at most 6
  significant bits, an FP8 element × 2^X at most 4), then BF16 tensor-core math with FP32 accumulation;
  the NVFP4 global scales are divided out at the end. With ``PRE`` the operands are BF16 matrices
  already dequantized by :func:`dequant_bf16_kernel` (same exact values; a plain, well-pipelined BF16
  GEMM in the K loop, the unpack work done once per element instead of once per output tile).
* :func:`scale_epilogue_kernel`: the same epilogue on an FP32 product computed elsewhere (cuBLAS's BF16 GEMM
  with FP32 output): divides out the NVFP4 global scales (device values, which cuBLAS's host-side alpha cannot take).
* :func:`dequant_bf16_kernel`: one NVFP4 / MXFP8 copy -> its exact BF16 values (element × block
  scale, NVFP4 global scale not applied), the operand of the ``PRE`` GEMM.

Epilogue (both): + bias (N,), GELU (erf form, pre-GELU stored when asked), accumulate into C
(``C = C + round(y)``, as :func:`lowbit.gemm.reference.apply_epilogue`), output in C's dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile_ids(tile, num_pm, num_pn, GROUP_M: tl.constexpr):
    group = GROUP_M * num_pn
    gid = tile // group
    first_m = gid * GROUP_M
    gsize = tl.minimum(num_pm - first_m, GROUP_M)
    pid_m = first_m + (tile % group) % gsize
    pid_n = (tile % group) // gsize
    return pid_m, pid_n


@triton.jit
def _epilogue(acc, c_ptr, pre_ptr, bias_ptr, offs_m, offs_n, M, N,
              HAS_BIAS: tl.constexpr, GELU: tl.constexpr, ACCUM: tl.constexpr):
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    y = acc
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    cp = c_ptr + offs_m[:, None] * N + offs_n[None, :]
    if GELU:
        tl.store(pre_ptr + offs_m[:, None] * N + offs_n[None, :], y.to(pre_ptr.dtype.element_ty), mask=mask)
        y = 0.5 * y * (1.0 + tl.math.erf(y * 0.7071067811865476))
    if ACCUM:
        y = tl.load(cp, mask=mask, other=0.0).to(tl.float32) + y.to(c_ptr.dtype.element_ty).to(tl.float32)
    tl.store(cp, y.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_scale(s_ptr, offs, mask, kb, ld, MODE: tl.constexpr, BS: tl.constexpr):
    """Scale per row (vector) of K block kb for block modes 2 (1xBS) and 3 (BSxBS)."""
    if MODE == 2:
        return tl.load(s_ptr + kb * ld + offs, mask=mask, other=0.0)
    else:
        return tl.load(s_ptr + (offs // BS) * ld + kb, mask=mask, other=0.0)


@triton.jit
def _tile_scale(s_ptr, offs, mask, first, kb, ld, MODE: tl.constexpr, BS: tl.constexpr, BR: tl.constexpr):
    """K block kb's scale for the tile's rows offs (first = offs[0]): a vector (1xBS, or BSxBS tiles straddling
    blocks), one scalar for BSxBS when the BR-row tile lies inside one block (BS % BR == 0), 1 for the modes
    applied after the loop (tensorwise, per row)."""
    if MODE == 3 and BS % BR == 0:
        return tl.load(s_ptr + (first // BS) * ld + kb)
    elif MODE >= 2:
        return _row_scale(s_ptr, offs, mask, kb, ld, MODE, BS)
    else:
        return 1.0


@triton.jit
def _fold(acc, part, fa, fb, A_VEC: tl.constexpr, B_VEC: tl.constexpr):
    """acc + part · fa · fb with fa / fb vectors along M / N or scalars: one FMA per element unless both are
    vectors (the scalar folded into the other's vector first)."""
    if A_VEC and B_VEC:
        return acc + part * fa[:, None] * fb[None, :]
    elif A_VEC:
        return acc + part * (fa * fb)[:, None]
    elif B_VEC:
        return acc + part * (fb * fa)[None, :]
    else:
        return acc + part * (fa * fb)


@triton.jit
def fp8_gemm_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, pre_ptr, bias_ptr, ws_ptr, M, N, K, lda_s, ldb_s,
                    SA: tl.constexpr, SB: tl.constexpr, BS: tl.constexpr,
                    HAS_BIAS: tl.constexpr, GELU: tl.constexpr, ACCUM: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr, TMA: tl.constexpr = False,
                    SPLIT_K: tl.constexpr = 1):
    """C = A·Bᵀ of FP8 operands with their scales, one output tile a program (grouped along M for L2 reuse), the K
    blocks of BS in order. SPLIT_K > 1 (blockwise SA, SB only: every scale folded per K block): SPLIT_K programs a
    tile, each summing one contiguous share of the K blocks (balanced) into ws_ptr's FP32 slice (SPLIT_K, M, N) of
    its split; :func:`scale_epilogue_kernel` adds the slices in split order and runs the epilogue. Small M (a decode
    step) has too few output tiles to keep the SMs busy otherwise."""
    tl.static_assert(SPLIT_K == 1 or (SA >= 2 and SB >= 2), "split-K folds every scale per K block: blockwise only")
    pid = tl.program_id(0)
    num_pm = tl.cdiv(M, BM)
    num_pn = tl.cdiv(N, BN)
    nkb = tl.cdiv(K, BS)
    tile = pid // SPLIT_K
    split = pid % SPLIT_K
    k_lo = split * nkb // SPLIT_K  # (balanced shares: their sizes differ by at most one block)
    k_hi = (split + 1) * nkb // SPLIT_K
    pid_m, pid_n = _tile_ids(tile, num_pm, num_pn, GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN).to(tl.int64)
    mmask = offs_m < M
    nmask = offs_n < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if TMA:
        # Tiles by TMA descriptor (zero fill past M, N, K) instead of (rows, BS) tensors of 64-bit pointers,
        # which the software pipeline keeps live: compiled for sm_90 (Triton 3.6) the pointer version spills
        # ~300 STL/LDL at 128x128 / 8 warps, this one none. The launcher checks TMA's rules (K % 16 == 0,
        # 16-byte aligned data).
        ad = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BS])
        bd = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BS])
    for kb in range(k_lo, k_hi):
        if TMA:
            a = ad.load([pid_m * BM, kb * BS])
            b = bd.load([pid_n * BN, kb * BS])
        else:
            offs_k = kb * BS + tl.arange(0, BS).to(tl.int64)
            kmask = offs_k < K
            a = tl.load(a_ptr + offs_m[:, None] * K + offs_k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(b_ptr + offs_n[:, None] * K + offs_k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        part = tl.dot(a, tl.trans(b))  # one scaling block of K, reduced on the tensor cores from zero
        fa = _tile_scale(sa_ptr, offs_m, mmask, pid_m * BM, kb, lda_s, SA, BS, BM)
        fb = _tile_scale(sb_ptr, offs_n, nmask, pid_n * BN, kb, ldb_s, SB, BS, BN)
        acc = _fold(acc, part, fa, fb, SA == 2 or (SA == 3 and BS % BM != 0), SB == 2 or (SB == 3 and BS % BN != 0))
    if SPLIT_K > 1:
        w = ws_ptr + split.to(tl.int64) * M * N + offs_m[:, None] * N + offs_n[None, :]
        tl.store(w, acc, mask=mmask[:, None] & nmask[None, :])
    else:
        if SA == 0:
            acc = acc * tl.load(sa_ptr)
        if SA == 1:
            acc = acc * tl.load(sa_ptr + offs_m, mask=mmask, other=0.0)[:, None]
        if SB == 0:
            acc = acc * tl.load(sb_ptr)
        if SB == 1:
            acc = acc * tl.load(sb_ptr + offs_n, mask=nmask, other=0.0)[None, :]
        _epilogue(acc, c_ptr, pre_ptr, bias_ptr, offs_m, offs_n, M, N, HAS_BIAS, GELU, ACCUM)


@triton.jit
def _e2m1_value(c):
    """float32 values of E2M1 codes (int32 0..15)."""
    mag = c & 7
    e = mag >> 1
    half = (mag & 1).to(tl.float32) * 0.5
    v = tl.where(e == 0, half, (1.0 + half) * tl.where(e == 1, 1.0, tl.where(e == 2, 2.0, 4.0)))
    return tl.where((c & 8) != 0, -v, v)


@triton.jit
def _emu_tile(p_ptr, s_ptr, offs_r, rmask, k0, K, ld_s,
              NV: tl.constexpr, TWO_D: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr):
    """(BR, BK) bf16 tile of exact element·block-scale values of rows offs_r, K columns k0..k0+BK."""
    if NV:
        offs_h = k0 // 2 + tl.arange(0, BK // 2)
        p = tl.load(p_ptr + offs_r[:, None] * (K // 2) + offs_h[None, :],
                    mask=rmask[:, None] & (offs_h[None, :] < K // 2), other=0).to(tl.int32)
        codes = tl.reshape(tl.join(p & 0xF, p >> 4), (BR, BK))
        v = _e2m1_value(codes)
        offs_b = k0 // 16 + tl.arange(0, BK // 16)
        bmask = rmask[:, None] & (offs_b[None, :] < K // 16)
        if TWO_D:
            d = tl.load(s_ptr + (offs_r // 16)[:, None] * ld_s + offs_b[None, :], mask=bmask, other=0.0)
        else:
            d = tl.load(s_ptr + offs_r[:, None] * ld_s + offs_b[None, :], mask=bmask, other=0.0)
        d = d.to(tl.float32)
        v = tl.reshape(tl.reshape(v, (BR, BK // 16, 16)) * d[:, :, None], (BR, BK))
    else:
        offs_k = k0 + tl.arange(0, BK)
        v = tl.load(p_ptr + offs_r[:, None] * K + offs_k[None, :], mask=rmask[:, None] & (offs_k[None, :] < K),
                    other=0.0).to(tl.float32)
        offs_b = k0 // 32 + tl.arange(0, BK // 32)
        code = tl.load(s_ptr + offs_r[:, None] * ld_s + offs_b[None, :],
                       mask=rmask[:, None] & (offs_b[None, :] < K // 32), other=127).to(tl.int32)
        sc = tl.where(code == 255, float("nan"), (code << 23).to(tl.float32, bitcast=True))
        v = tl.reshape(tl.reshape(v, (BR, BK // 32, 32)) * sc[:, :, None], (BR, BK))
    if F32:  # Triton's interpreter: BF16 dots are not emulated faithfully there
        return v
    else:
        return v.to(tl.bfloat16)


@triton.jit
def scale_epilogue_kernel(acc_ptr, gsa_ptr, gsb_ptr, c_ptr, pre_ptr, bias_ptr, M, N, NV: tl.constexpr,
                          HAS_BIAS: tl.constexpr, GELU: tl.constexpr, ACCUM: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr = 1):
    """The epilogue of an FP32 product acc (M, N), or (SPLIT) the sum of its SPLIT slices (SPLIT, M, N) in order
    (:func:`fp8_gemm_kernel`'s split-K partials); NV: divided by the two global scales first."""
    offs_m = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM).to(tl.int64)
    offs_n = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN).to(tl.int64)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    acc = tl.load(acc_ptr + offs_m[:, None] * N + offs_n[None, :], mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(acc_ptr + (offs_m[:, None] + s * M) * N + offs_n[None, :], mask=mask, other=0.0)
    if NV:  # the same two divisions as emu_gemm_kernel
        acc = acc / tl.load(gsa_ptr) / tl.load(gsb_ptr)
    _epilogue(acc, c_ptr, pre_ptr, bias_ptr, offs_m, offs_n, M, N, HAS_BIAS, GELU, ACCUM)


@triton.jit
def dequant_bf16_kernel(p_ptr, s_ptr, out_ptr, R, K, ld_s,
                        NV: tl.constexpr, TWO_D: tl.constexpr, F32: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    """out (R, K) bf16 (float32 under the interpreter) = elements × block scales of one copy (R rows, K along K)."""
    offs_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR).to(tl.int64)
    k0 = tl.program_id(1).to(tl.int64) * BK
    rmask = offs_r < R
    v = _emu_tile(p_ptr, s_ptr, offs_r, rmask, k0, K, ld_s, NV, TWO_D, BR, BK, F32)
    offs_k = k0 + tl.arange(0, BK)
    tl.store(out_ptr + offs_r[:, None] * K + offs_k[None, :], v, mask=rmask[:, None] & (offs_k[None, :] < K))


@triton.jit
def emu_gemm_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, gsa_ptr, gsb_ptr, c_ptr, pre_ptr, bias_ptr, M, N, K, lda_s, ldb_s,
                    NV: tl.constexpr, A2D: tl.constexpr, B2D: tl.constexpr, F32: tl.constexpr, PRE: tl.constexpr,
                    HAS_BIAS: tl.constexpr, GELU: tl.constexpr, ACCUM: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                    TMA: tl.constexpr = False):
    pid = tl.program_id(0)
    num_pm = tl.cdiv(M, BM)
    num_pn = tl.cdiv(N, BN)
    tile = pid  # one output tile per program (grouped along M for L2 reuse)
    pid_m, pid_n = _tile_ids(tile, num_pm, num_pn, GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN).to(tl.int64)
    mmask = offs_m < M
    nmask = offs_n < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if TMA:  # (PRE only) dense operand tiles by TMA descriptor, as in fp8_gemm_kernel
        ad = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
        bd = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    for k0 in range(0, K, BK):
        if TMA:
            a = ad.load([pid_m * BM, k0])
            b = bd.load([pid_n * BN, k0])
        elif PRE:  # dense dequantized operands (R, K)
            offs_k = k0 + tl.arange(0, BK)
            kmask = offs_k[None, :] < K
            a = tl.load(a_ptr + offs_m[:, None] * K + offs_k[None, :], mask=mmask[:, None] & kmask, other=0.0)
            b = tl.load(b_ptr + offs_n[:, None] * K + offs_k[None, :], mask=nmask[:, None] & kmask, other=0.0)
        else:
            a = _emu_tile(a_ptr, sa_ptr, offs_m, mmask, k0, K, lda_s, NV, A2D, BM, BK, F32)
            b = _emu_tile(b_ptr, sb_ptr, offs_n, nmask, k0, K, ldb_s, NV, B2D, BN, BK, F32)
        acc = tl.dot(a, tl.trans(b), acc)
    if NV:
        acc = acc / tl.load(gsa_ptr) / tl.load(gsb_ptr)
    _epilogue(acc, c_ptr, pre_ptr, bias_ptr, offs_m, offs_n, M, N, HAS_BIAS, GELU, ACCUM)


# ------------------------------------------------------------------------------------------------
# Gluon (Triton's explicit-layout dialect) FP8 blockwise GEMM for Hopper: the same numbers as fp8_gemm_kernel
# (per-block wgmma from zero, scaled and added into FP32 once per BS-wide K block) with the wgmma of block j+1
# overlapping block j's promotion — which tl.dot cannot express (Triton waits for a zero-initialised dot
# right after issuing it). 1xBS x BSxBS scales (one scalar per B tile and block) or BSxBS x BSxBS; TMA tiles.
# ------------------------------------------------------------------------------------------------
try:  # Triton >= 3.5 with Gluon's Hopper ops
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

    # (renamed async_load and barrier after Triton 3.6)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    GLUON = True
    GLUON_WS = hasattr(gl, "warp_specialize")
except Exception:  # pragma: no cover - older Triton
    GLUON = GLUON_WS = False

if GLUON:
    @gluon.jit
    def _g_load(ad, bd, a_s, b_s, bars, off_m, off_n, j, pred, BS: gl.constexpr, STAGES: gl.constexpr):
        """TMA loads of K block j into stage j % STAGES (zero fill past M, N, K)."""
        s = j % STAGES
        mbarrier.expect(bars.index(s), ad.block_type.nbytes + bd.block_type.nbytes, pred=pred)
        _tma_load(ad, [off_m, j * BS], bars.index(s), a_s.index(s), pred=pred)
        _tma_load(bd, [off_n, j * BS], bars.index(s), b_s.index(s), pred=pred)


    @gluon.jit
    def _g_refill(ad, bd, a_s, b_s, bars, off_m, off_n, j, nkbu, BS: gl.constexpr, STAGES: gl.constexpr):
        """Block j's wgmma is done in this warpgroup; once both are (barrier), load block j + STAGES into its stage."""
        _cta_barrier()
        _g_load(ad, bd, a_s, b_s, bars, off_m, off_n, j + STAGES, j + STAGES < nkbu, BS, STAGES)


    @gluon.jit
    def _g_mma(a_s, b_s, bars, j, regs, STAGES: gl.constexpr):
        """Wait for K block j's tiles, issue its wgmma from zero (async: returns the in-flight token)."""
        s = j % STAGES
        mbarrier.wait(bars.index(s), (j // STAGES) & 1)
        return warpgroup_mma(a_s.index(s), b_s.index(s).permute((1, 0)), regs, use_acc=False, is_async=True)


    @gluon.jit
    def _g_scales(sa_ptr, sb_ptr, offs_m, offs_n, mmask, nmask, off_m, off_n, kb, nkb, lda_s, ldb_s,
                  SA: gl.constexpr, SB: gl.constexpr, BS: gl.constexpr):
        """Scales of K block kb: a vector along the tile for 1xBS (mode 2), one scalar for BSxBS (mode 3: the tile lies
        inside one block)."""
        if SA == 2:
            r = gl.load(sa_ptr + kb * lda_s + offs_m, mask=mmask & (kb < nkb), other=0.0)
        else:
            r = gl.load(sa_ptr + (off_m // BS) * lda_s + kb, mask=kb < nkb, other=0.0)
        if SB == 2:
            c = gl.load(sb_ptr + kb * ldb_s + offs_n, mask=nmask & (kb < nkb), other=0.0)
        else:
            c = gl.load(sb_ptr + (off_n // BS) * ldb_s + kb, mask=kb < nkb, other=0.0)
        return r, c


    @gluon.jit
    def _g_fold(acc, part, r, c, SA: gl.constexpr, SB: gl.constexpr):
        """acc + part * (scale factor), one FMA per element; SA / SB: which factor is a vector (2) or scalar (3).
        The FMA is a non-pure inline asm so that the compiler keeps it between the wgmma wait that produces part and
        the next wgmma issue (sunk below them, all partials would be live at once and ptxas serializes the wgmmas)."""
        if SA == 2:
            f = gl.broadcast((r * c)[:, None], part)[0]
        elif SB == 2:
            f = gl.broadcast((c * r)[None, :], part)[0]
        else:
            f = gl.full(part.shape, r * c, gl.float32, part.type.layout)
        return gl.inline_asm_elementwise("fma.rn.f32 $0, $1, $2, $3;", "=r,r,r,r", [part, f, acc], dtype=gl.float32,
                                         is_pure=False, pack=1)


    @gluon.jit
    def _g_operands(a_ptr, b_ptr, M, N, K, BM: gl.constexpr, BN: gl.constexpr, BS: gl.constexpr,
                    STAGES: gl.constexpr):
        """TMA descriptors of A (M, K) and B (N, K), both K-major, in BM x BS / BN x BS boxes, and STAGES shared-memory
        stages of each in the wgmma's NVMMA layout: (ad, bd, a_s, b_s)."""
        a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BS], a_ptr.dtype.element_ty)
        b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BS], b_ptr.dtype.element_ty)
        ad = tma.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BS], layout=a_layout)
        bd = tma.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BS], layout=b_layout)
        a_s = gl.allocate_shared_memory(a_ptr.dtype.element_ty, [STAGES, BM, BS], a_layout)
        b_s = gl.allocate_shared_memory(b_ptr.dtype.element_ty, [STAGES, BN, BS], b_layout)
        return ad, bd, a_s, b_s

    @gluon.jit
    def _g_tile(t, num_pm, num_pn, GROUP_M: gl.constexpr):
        """(pid_m, pid_n) of output tile t, tiles ordered in groups of GROUP_M along M (as _tile_ids)."""
        group = GROUP_M * num_pn
        first_m = (t // group) * GROUP_M
        gsize = gl.minimum(num_pm - first_m, GROUP_M)
        return first_m + (t % group) % gsize, (t % group) // gsize


    @gluon.jit
    def _g_epilogue(y, off_m, off_n, c_ptr, pre_ptr, bias_ptr, M, N,
                    HAS_BIAS: gl.constexpr, GELU: gl.constexpr, ACCUM: gl.constexpr):
        """The epilogue of _epilogue on the FP32 tile y (any distributed layout) whose first element is C[off_m,
        off_n]: + bias, GELU (pre-GELU stored), accumulate into C, store in C's dtype."""
        em = off_m + gl.arange(0, y.shape[0], layout=gl.SliceLayout(1, y.type.layout))
        en = off_n + gl.arange(0, y.shape[1], layout=gl.SliceLayout(0, y.type.layout))
        cm = em.to(gl.int64)[:, None] * N + en[None, :]
        emask = en < N
        mask = (em < M)[:, None] & emask[None, :]
        if HAS_BIAS:
            y = y + gl.load(bias_ptr + en, mask=emask, other=0.0).to(gl.float32)[None, :]
        if GELU:
            gl.store(pre_ptr + cm, y.to(pre_ptr.dtype.element_ty), mask=mask)
            y = 0.5 * y * (1.0 + gl.erf(y * 0.7071067811865476))
        if ACCUM:
            y = gl.load(c_ptr + cm, mask=mask, other=0.0).to(gl.float32) + y.to(c_ptr.dtype.element_ty).to(gl.float32)
        gl.store(c_ptr + cm, y.to(c_ptr.dtype.element_ty), mask=mask)


    @gluon.jit
    def fp8_gemm_gluon(a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, pre_ptr, bias_ptr, M, N, K, lda_s, ldb_s,
                       SA: gl.constexpr, SB: gl.constexpr, BS: gl.constexpr,
                       HAS_BIAS: gl.constexpr, GELU: gl.constexpr, ACCUM: gl.constexpr,
                       BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
        NW: gl.constexpr = gl.num_warps()
        pid_m, pid_n = _g_tile(gl.program_id(0), gl.cdiv(M, BM), gl.cdiv(N, BN), GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
        nkb = gl.cdiv(K, BS)

        ad, bd, a_s, b_s = _g_operands(a_ptr, b_ptr, M, N, K, BM, BN, BS, STAGES)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        # K blocks rounded up to a multiple of 4 (padding blocks past K read TMA's zero fill and zero scales)
        nkbu = (nkb + 3) // 4 * 4
        for i in gl.static_range(STAGES):
            _g_load(ad, bd, a_s, b_s, bars, off_m, off_n, i, i < nkbu, BS, STAGES)

        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BN, 32])
        offs_m = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
        offs_n = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
        mmask = offs_m < M
        nmask = offs_n < N
        zero = gl.zeros((BM, BN), gl.float32, mma)
        acc = zero

        # Four K blocks per iteration: block j+1 is issued to the tensor cores before block j is waited for, scaled
        # and added into acc (the wait leaves one wgmma group in flight). Nothing is in flight across the loop's back
        # edge: ptxas serializes every wgmma of the kernel when an in-flight accumulator is copied, as a loop-carried
        # one would be.
        for kb in range(0, nkbu, 4):
            t0 = _g_mma(a_s, b_s, bars, kb, zero, STAGES)
            r0, c0 = _g_scales(sa_ptr, sb_ptr, offs_m, offs_n, mmask, nmask, off_m, off_n, kb, nkb, lda_s, ldb_s, SA,
                               SB, BS)
            t1 = _g_mma(a_s, b_s, bars, kb + 1, zero, STAGES)
            r1, c1 = _g_scales(sa_ptr, sb_ptr, offs_m, offs_n, mmask, nmask, off_m, off_n, kb + 1, nkb, lda_s, ldb_s,
                               SA, SB, BS)
            p0 = warpgroup_mma_wait(num_outstanding=1, deps=(t0,))
            _g_refill(ad, bd, a_s, b_s, bars, off_m, off_n, kb, nkbu, BS, STAGES)
            acc = _g_fold(acc, p0, r0, c0, SA, SB)
            t0 = _g_mma(a_s, b_s, bars, kb + 2, zero, STAGES)
            r0, c0 = _g_scales(sa_ptr, sb_ptr, offs_m, offs_n, mmask, nmask, off_m, off_n, kb + 2, nkb, lda_s, ldb_s,
                               SA, SB, BS)
            p1 = warpgroup_mma_wait(num_outstanding=1, deps=(t1,))
            _g_refill(ad, bd, a_s, b_s, bars, off_m, off_n, kb + 1, nkbu, BS, STAGES)
            acc = _g_fold(acc, p1, r1, c1, SA, SB)
            t1 = _g_mma(a_s, b_s, bars, kb + 3, zero, STAGES)
            r1, c1 = _g_scales(sa_ptr, sb_ptr, offs_m, offs_n, mmask, nmask, off_m, off_n, kb + 3, nkb, lda_s, ldb_s,
                               SA, SB, BS)
            p0 = warpgroup_mma_wait(num_outstanding=1, deps=(t0,))
            _g_refill(ad, bd, a_s, b_s, bars, off_m, off_n, kb + 2, nkbu, BS, STAGES)
            acc = _g_fold(acc, p0, r0, c0, SA, SB)
            p1 = warpgroup_mma_wait(num_outstanding=0, deps=(t1,))
            _g_refill(ad, bd, a_s, b_s, bars, off_m, off_n, kb + 3, nkbu, BS, STAGES)
            acc = _g_fold(acc, p1, r1, c1, SA, SB)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))

        # epilogue in a store-friendly layout: 8 consecutive columns per thread
        out_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
        _g_epilogue(gl.convert_layout(acc, out_l), off_m, off_n, c_ptr, pre_ptr, bias_ptr, M, N, HAS_BIAS, GELU, ACCUM)


    # --------------------------------------------------------------------------------------------
    # Warp-specialized, persistent variant of fp8_gemm_gluon (same numbers: each K block's wgmma from zero, scaled
    # and added into FP32 once per block), and the same skeleton for BF16 operands. One loader warp keeps STAGES K
    # steps of A and B in flight through TMA for a whole run of output tiles (it runs ahead into the next tile while
    # the math warps are in the epilogue); two math warpgroups, each over half the rows of a tile, release each
    # stage through an mbarrier (no CTA-wide barrier), so they drift out of step and one's promotion overlaps the
    # other's wgmma. Grid: one CTA per SM, tiles in the grouped order of fp8_gemm_gluon.
    #
    # Every partition function below takes the same arguments (the math one also its index PART), so the
    # warp_specialize call passes one list three times.
    # --------------------------------------------------------------------------------------------
    @gluon.jit
    def _ws_ksteps(K, BS: gl.constexpr, SA: gl.constexpr):
        """K steps a tile: FP8 blocks rounded up to a multiple of 4 (the math loop's unroll; the padding blocks
        read TMA's zero fill), BF16 (SA == 0) steps as they are."""
        if SA == 0:
            return gl.cdiv(K, BS)
        else:
            return (gl.cdiv(K, BS) + 3) // 4 * 4


    @gluon.jit
    def _ws_loader(ad, bd, a_s, b_s, ready, empty, sa_ptr, sb_ptr, c_ptr, pre_ptr, bias_ptr, M, N, K, lda_s, ldb_s,
                   SA: gl.constexpr, SB: gl.constexpr, BS: gl.constexpr,
                   HAS_BIAS: gl.constexpr, GELU: gl.constexpr, ACCUM: gl.constexpr,
                   BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                   NMATH: gl.constexpr):
        """Loader partition (one warp): for every K step of every tile of this CTA, wait for its stage to be free,
        then TMA A's and B's tiles into it (zero fill past M, N, K) and let `ready` count the bytes."""
        num_pm = gl.cdiv(M, BM)
        num_pn = gl.cdiv(N, BN)
        nkbu = _ws_ksteps(K, BS, SA)
        it = 0
        for t in range(gl.program_id(0), num_pm * num_pn, gl.num_programs(0)):
            pid_m, pid_n = _g_tile(t, num_pm, num_pn, GROUP_M)
            for kb in range(nkbu):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1 at once
                mbarrier.expect(ready.index(s), ad.block_type.nbytes + bd.block_type.nbytes)
                _tma_load(ad, [pid_m * BM, kb * BS], ready.index(s), a_s.index(s))
                _tma_load(bd, [pid_n * BN, kb * BS], ready.index(s), b_s.index(s))
                it += 1


    @gluon.jit
    def _ws_mma(a_s, b_s, ready, it, regs, ROW0: gl.constexpr, ROWS: gl.constexpr, STAGES: gl.constexpr,
                USE_ACC: gl.constexpr):
        """Wait for the stage of pipeline step `it`, issue the wgmma of its rows ROW0:ROW0+ROWS of A (async), into
        `regs` (USE_ACC) or from zero."""
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        a = a_s.index(s)
        if ROWS < a_s.shape[1]:
            a = a.slice(ROW0, ROWS, dim=0)
        return warpgroup_mma(a, b_s.index(s).permute((1, 0)), regs, use_acc=USE_ACC, is_async=True)


    @gluon.jit
    def _ws_fp8(a_s, b_s, ready, empty, sa_ptr, sb_ptr, c_ptr, pre_ptr, bias_ptr, M, N, K, lda_s, ldb_s,
                SA: gl.constexpr, SB: gl.constexpr, BS: gl.constexpr,
                HAS_BIAS: gl.constexpr, GELU: gl.constexpr, ACCUM: gl.constexpr,
                BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, NMATH: gl.constexpr,
                PART: gl.constexpr):
        """FP8 math partition PART of NMATH (rows PART*BM/NMATH onwards of every tile): the K loop of
        fp8_gemm_gluon, each stage handed back to the loader as soon as its wgmma has been waited for, then the
        epilogue."""
        NW: gl.constexpr = gl.num_warps()
        ROWS: gl.constexpr = BM // NMATH
        R0: gl.constexpr = PART * ROWS
        num_pm = gl.cdiv(M, BM)
        num_pn = gl.cdiv(N, BN)
        nkb = gl.cdiv(K, BS)
        nkbu = _ws_ksteps(K, BS, SA)
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BN, 32])
        out_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
        zero = gl.zeros((ROWS, BN), gl.float32, mma)
        it = 0
        for t in range(gl.program_id(0), num_pm * num_pn, gl.num_programs(0)):
            pid_m, pid_n = _g_tile(t, num_pm, num_pn, GROUP_M)
            off_m = pid_m * BM + R0
            off_n = pid_n * BN
            offs_m = off_m + gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma))
            offs_n = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
            mmask = offs_m < M
            nmask = offs_n < N
            acc = zero
            # as in fp8_gemm_gluon: block j+1 in flight while block j is folded; nothing across the back edge
            for kb in range(0, nkbu, 4):
                t0 = _ws_mma(a_s, b_s, ready, it, zero, R0, ROWS, STAGES, False)
                r0, c0 = _g_scales(sa_ptr, sb_ptr, offs_m, offs_n, mmask, nmask, off_m, off_n, kb, nkb, lda_s, ldb_s,
                                   SA, SB, BS)
                t1 = _ws_mma(a_s, b_s, ready, it + 1, zero, R0, ROWS, STAGES, False)
                r1, c1 = _g_scales(sa_ptr, sb_ptr, offs_m, offs_n, mmask, nmask, off_m, off_n, kb + 1, nkb, lda_s,
                                   ldb_s, SA, SB, BS)
                p0 = warpgroup_mma_wait(num_outstanding=1, deps=(t0,))
                mbarrier.arrive(empty.index(it % STAGES), count=1)
                acc = _g_fold(acc, p0, r0, c0, SA, SB)
                t0 = _ws_mma(a_s, b_s, ready, it + 2, zero, R0, ROWS, STAGES, False)
                r0, c0 = _g_scales(sa_ptr, sb_ptr, offs_m, offs_n, mmask, nmask, off_m, off_n, kb + 2, nkb, lda_s,
                                   ldb_s, SA, SB, BS)
                p1 = warpgroup_mma_wait(num_outstanding=1, deps=(t1,))
                mbarrier.arrive(empty.index((it + 1) % STAGES), count=1)
                acc = _g_fold(acc, p1, r1, c1, SA, SB)
                t1 = _ws_mma(a_s, b_s, ready, it + 3, zero, R0, ROWS, STAGES, False)
                r1, c1 = _g_scales(sa_ptr, sb_ptr, offs_m, offs_n, mmask, nmask, off_m, off_n, kb + 3, nkb, lda_s,
                                   ldb_s, SA, SB, BS)
                p0 = warpgroup_mma_wait(num_outstanding=1, deps=(t0,))
                mbarrier.arrive(empty.index((it + 2) % STAGES), count=1)
                acc = _g_fold(acc, p0, r0, c0, SA, SB)
                p1 = warpgroup_mma_wait(num_outstanding=0, deps=(t1,))
                mbarrier.arrive(empty.index((it + 3) % STAGES), count=1)
                acc = _g_fold(acc, p1, r1, c1, SA, SB)
                it += 4
            _g_epilogue(gl.convert_layout(acc, out_l), off_m, off_n, c_ptr, pre_ptr, bias_ptr, M, N, HAS_BIAS, GELU,
                        ACCUM)


    @gluon.jit
    def _ws_bf16(a_s, b_s, ready, empty, sa_ptr, sb_ptr, c_ptr, pre_ptr, bias_ptr, M, N, K,
                 SB: gl.constexpr, BS: gl.constexpr, HAS_BIAS: gl.constexpr, GELU: gl.constexpr, ACCUM: gl.constexpr,
                 BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, NMATH: gl.constexpr,
                 PART: gl.constexpr):
        """BF16 math partition (the dequantized NVFP4 / MXFP8 operands): one FP32 accumulator over all of K (wgmma
        chained, one step in flight), then with SB == 1 the NVFP4 global scales divided out (``acc / gsa / gsb``,
        sa_ptr / sb_ptr pointing at them, as emu_gemm_kernel) and the epilogue, stored from the wgmma layout."""
        NW: gl.constexpr = gl.num_warps()
        ROWS: gl.constexpr = BM // NMATH
        R0: gl.constexpr = PART * ROWS
        num_pm = gl.cdiv(M, BM)
        num_pn = gl.cdiv(N, BN)
        nk = gl.cdiv(K, BS)
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BN, 16])
        it = 0
        for t in range(gl.program_id(0), num_pm * num_pn, gl.num_programs(0)):
            pid_m, pid_n = _g_tile(t, num_pm, num_pn, GROUP_M)
            acc = gl.zeros((ROWS, BN), gl.float32, mma)
            for kb in range(nk):
                acc = _ws_mma(a_s, b_s, ready, it + kb, acc, R0, ROWS, STAGES, True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                # step kb - 1's wgmma is done: its stage goes back to the loader
                mbarrier.arrive(empty.index((it + kb + STAGES - 1) % STAGES), count=1, pred=kb > 0)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index((it + nk - 1) % STAGES), count=1)
            it += nk
            if SB == 1:
                acc = acc / gl.load(sa_ptr) / gl.load(sb_ptr)
            _g_epilogue(acc, pid_m * BM + R0, pid_n * BN, c_ptr, pre_ptr, bias_ptr, M, N, HAS_BIAS, GELU, ACCUM)


    @gluon.jit
    def _ws_math(ad, bd, a_s, b_s, ready, empty, sa_ptr, sb_ptr, c_ptr, pre_ptr, bias_ptr, M, N, K, lda_s, ldb_s,
                 SA: gl.constexpr, SB: gl.constexpr, BS: gl.constexpr,
                 HAS_BIAS: gl.constexpr, GELU: gl.constexpr, ACCUM: gl.constexpr,
                 BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, NMATH: gl.constexpr,
                 PART: gl.constexpr):
        """Math partition PART: FP8 blockwise (SA > 0) or BF16 (SA == 0)."""
        if SA == 0:
            _ws_bf16(a_s, b_s, ready, empty, sa_ptr, sb_ptr, c_ptr, pre_ptr, bias_ptr, M, N, K,
                     SB, BS, HAS_BIAS, GELU, ACCUM, BM, BN, GROUP_M, STAGES, NMATH, PART)
        else:
            _ws_fp8(a_s, b_s, ready, empty, sa_ptr, sb_ptr, c_ptr, pre_ptr, bias_ptr, M, N, K, lda_s, ldb_s,
                    SA, SB, BS, HAS_BIAS, GELU, ACCUM, BM, BN, GROUP_M, STAGES, NMATH, PART)


    @gluon.jit
    def gemm_gluon_ws(a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, pre_ptr, bias_ptr, M, N, K, lda_s, ldb_s,
                      SA: gl.constexpr, SB: gl.constexpr, BS: gl.constexpr,
                      HAS_BIAS: gl.constexpr, GELU: gl.constexpr, ACCUM: gl.constexpr,
                      BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                      NMATH: gl.constexpr, LOAD_REGS: gl.constexpr, MATH_REGS: gl.constexpr):
        """Persistent, warp-specialized GEMM ``C = A · Bᵀ``: one loader warp and NMATH = 2 math partitions of
        num_warps = 4 each, one warpgroup apiece over BM/2 rows of every tile. (One 8-warp partition over whole tiles
        ran at 0.82-0.95 of this on an H200: its two warpgroups synchronise at every stage release.)
        Launch at most one CTA per SM, with ``maxnreg`` such that every warpgroup (the loader's rounded up to one)
        fits the register file; MATH_REGS is the second math partition's register count (the default partition
        gets what is left).

        SA, SB > 0: fp8_gemm_gluon's FP8 blockwise numbers (BS = the 128 scale block = the K step). SA == 0: BF16
        A and B (BS = the K step, 64), plain FP32 accumulation, SB == 1 dividing the NVFP4 global scales out."""
        ad, bd, a_s, b_s = _g_operands(a_ptr, b_ptr, M, N, K, BM, BN, BS, STAGES)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=NMATH)  # every math partition hands the stage back
        # (the argument tuples are written out in the call: a tuple bound to a name first turns its constexprs
        # into tensors; the math partition index is a gl.constexpr, as a plain literal would arrive as a tensor)
        gl.warp_specialize([(_ws_math, (ad, bd, a_s, b_s, ready, empty, sa_ptr, sb_ptr, c_ptr, pre_ptr, bias_ptr, M, N,
                                        K, lda_s, ldb_s,
                                        SA, SB, BS, HAS_BIAS, GELU, ACCUM, BM, BN, GROUP_M, STAGES, NMATH,
                                        gl.constexpr(0))),
                            (_ws_loader, (ad, bd, a_s, b_s, ready, empty, sa_ptr, sb_ptr, c_ptr, pre_ptr, bias_ptr, M,
                                          N, K, lda_s, ldb_s,
                                          SA, SB, BS, HAS_BIAS, GELU, ACCUM, BM, BN, GROUP_M, STAGES, NMATH)),
                            (_ws_math, (ad, bd, a_s, b_s, ready, empty, sa_ptr, sb_ptr, c_ptr, pre_ptr, bias_ptr, M, N,
                                        K, lda_s, ldb_s,
                                        SA, SB, BS, HAS_BIAS, GELU, ACCUM, BM, BN, GROUP_M, STAGES, NMATH,
                                        gl.constexpr(1)))],
                           [1, gl.num_warps()], [LOAD_REGS, MATH_REGS])
