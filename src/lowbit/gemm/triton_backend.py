"""Triton GEMM backend for :func:`lowbit.gemm.scaled_mm`: registers ``"triton"`` (FP8, all scale pairings),
``"triton_dequant"`` (NVFP4 and MXFP8 operands dequantized once to exact BF16, then a BF16 GEMM; M, N >= 256)
and ``"triton_emulated"`` (NVFP4 and MXFP8 operands unpacked to BF16 in registers, tile by tile).

``"triton"`` covers every FP8 pairing :func:`lowbit.gemm._validate` accepts — tensorwise, rowwise and
blockwise 1D×2D, 2D×1D, 1D×1D, with E4M3/E5M2 mixes, ragged M/N/K and the full epilogue — with FP32
promotion once per ``block_size``-wide K block (128-wide for tensorwise/rowwise operands).
Nothing here touches CUDA at import time.
"""

from __future__ import annotations

import torch

from ..quant.schemes import BLOCK_SIZE, MXFP8, NVFP4, Float8Blockwise, Float8Rowwise, Float8Tensorwise
from ..quant.tensor import cdiv
from ..runtime import env
from ..runtime.autotune import bucket, tuned_config, tuned_launch
from ..runtime.device import INTERPRET, capability, num_sms
from ..runtime.launch import ensure_tma_allocator, launcher
from ..runtime.log import declined
from . import check_k_contiguous, gemm_dims, register_backend
from .kernels import gemm as G

__all__ = ["supports_fp8", "supports_emulated", "supports_dequant", "scaled_mm_triton", "scaled_mm_emulated",
           "scaled_mm_dequant", "dequantize_bf16", "gluon_takes"]

_FP8 = (Float8Tensorwise, Float8Rowwise, Float8Blockwise)


def _on_device(a, b) -> bool:
    return a.device.type == "cuda" and b.device.type == "cuda"


def _copy(t, which, name):
    """``t``'s ``which`` copy; ``name`` ("a" / "b") is the operand an error blames."""
    c = getattr(t, which)
    check_k_contiguous(name, which, c.data, "triton")
    return c


def _block_size(sa, sb) -> int:
    bs = [s.block_size for s in (sa, sb) if isinstance(s, Float8Blockwise)]
    return bs[0] if bs else BLOCK_SIZE


def supports_fp8(a, b, a_copy, b_copy, opts) -> bool:
    """FP8 schemes on CUDA; blockwise block sizes 32..1024."""
    if not _on_device(a, b) or not isinstance(a.scheme, _FP8) or not isinstance(b.scheme, _FP8):
        return False
    if a.scheme.fmt == "e5m2" and b.scheme.fmt == "e5m2":
        return False
    bs = _block_size(a.scheme, b.scheme)
    return 32 <= bs <= 1024


def supports_emulated(a, b, a_copy, b_copy, opts) -> bool:
    """NVFP4×NVFP4 and MXFP8×MXFP8 on CUDA."""
    if not _on_device(a, b):
        return False
    return type(a.scheme) is type(b.scheme) and isinstance(a.scheme, (NVFP4, MXFP8))


def _scale_mode(sch, c):
    """(mode, ld, tensor) for the fp8 kernel: 0 tensorwise, 1 per row, 2 1xBS (outer-dim-major), 3 BSxBS."""
    s = c.scale_inv
    if isinstance(sch, Float8Tensorwise):
        return 0, 0, s
    if isinstance(sch, Float8Rowwise):
        return 1, 0, s
    return (2 if sch.block_dim == 1 else 3), s.shape[1], s


def _out_tensors(M, N, dev, out_dtype, gelu, accumulate, out):
    pre = torch.empty(M, N, dtype=out_dtype, device=dev) if gelu else None
    if accumulate:
        c = out
        if not c.is_contiguous():
            raise ValueError(f"out: accumulate needs a contiguous out, got strides {tuple(c.stride())}")
    else:
        c = torch.empty(M, N, dtype=out_dtype, device=dev)
    return c, pre


def _finish(c, pre, out, accumulate):
    if out is not None and not accumulate:
        out.copy_(c)
        return out, pre
    return c, pre


def _candidates(M, N, emulated: bool):
    out = []
    for bm, bn, bk, w, st in ((128, 128, 128, 8, 3), (128, 256, 128, 8, 3), (128, 128, 64, 4, 4), (64, 128, 128, 4, 4),
                              (64, 64, 128, 4, 3)):
        if emulated:
            bk = 64
        if bm > max(bucket(M), 64) or bn > max(bucket(N), 64):
            continue
        out.append(dict(BM=bm, BN=bn, BK=bk, num_warps=w, num_stages=st))
    if INTERPRET:
        out = [dict(BM=32, BN=32, BK=32, num_warps=4, num_stages=1)]
    return out or [dict(BM=64, BN=64, BK=64, num_warps=4, num_stages=3)]


SPLIT_K_MAX_M = 64
"""Split-K candidates for M up to this (decode steps, small batches): below it the output tiles are too few to fill
the SMs, each streaming its whole K alone."""


def split_k_candidates(M: int, N: int, K: int, bs: int, sms: int) -> list[dict]:
    """The small-M candidates of :func:`fp8_gemm_kernel` (blockwise scales only): 16-64-row tiles (the bucket of M),
    64 or 128 columns, the K blocks split 2, 4 or 8 ways (SPLIT_K) where each split keeps at least two blocks and
    the grid stays within four programs an SM, and the unsplit small tiles."""
    if M > SPLIT_K_MAX_M or INTERPRET:
        return []
    nkb = cdiv(K, bs)
    bm = min(max(bucket(M), 16), 64)
    out = []
    for bn in (64, 128):
        tiles = cdiv(M, bm) * cdiv(N, bn)
        for split in (1, 2, 4, 8):
            if split == 1 or (nkb >= 2 * split and tiles * split <= 4 * sms):
                out.append(dict(BM=bm, BN=bn, BK=bs, num_warps=4, num_stages=3, SPLIT_K=split))
    return out


def _tma_ok(A, B, row_bytes) -> bool:
    """Operand tiles by TMA descriptors (``LOWBIT_TMA``, default on: the FP8 GEMM measured 1.10-1.19x faster with
    them on the H200, the dequantized BF16 GEMM within 1%) where TMA's rules hold: K-contiguous operands with
    16-byte aligned data and rows (``row_bytes`` % 16 == 0). Where not, says why."""
    if env.get("LOWBIT_TMA") and not (row_bytes % 16 or A.data_ptr() % 16 or B.data_ptr() % 16):
        ensure_tma_allocator()
        return True
    if not env.get("LOWBIT_TMA"):
        declined("gemm.tma", "LOWBIT_TMA=0")
    elif row_bytes % 16:
        declined("gemm.tma", f"operand rows of {row_bytes} bytes (TMA needs multiples of 16)")
    else:
        declined("gemm.tma", "operand data not 16-byte aligned")
    return False


def _gluon_ok(sa_mode, sb_mode, bs, dev) -> bool:
    """The Gluon kernels (:func:`~lowbit.gemm.kernels.gemm.fp8_gemm_gluon`: wgmma of K block j+1 overlapping block j's
    promotion; :func:`~lowbit.gemm.kernels.gemm.gemm_gluon_ws`: persistent and warp-specialized) as autotune
    candidates (``LOWBIT_GEMM_GLUON``: 1 default, 0 off, ``force`` / ``ws`` the one-tile / warp-specialized configs
    only, for tests): Hopper (sm_90), TMA tiles, A 1x128 and B 128x128 blocks (one B scale per tile and block).
    Measured 1.5-1.6x torchao's Triton blockwise kernel on large shapes on the H200. Where a 1x128 x 128x128 call
    does not fit, says why."""
    if sb_mode != 3 or sa_mode != 2:
        return False  # (not 1x128 x 128x128 blockwise: not one of its uses)
    mode = env.get("LOWBIT_GEMM_GLUON")
    if mode != "0" and not INTERPRET and G.GLUON and bs == BLOCK_SIZE and capability(dev) == (9, 0):
        return True
    if mode == "0":
        declined("gemm.gluon", "LOWBIT_GEMM_GLUON=0")
    elif INTERPRET or not G.GLUON:
        declined("gemm.gluon", "Triton's interpreter, or Gluon not importable")
    elif bs != BLOCK_SIZE:
        declined("gemm.gluon", f"block size {bs} (only {BLOCK_SIZE})")
    else:
        declined("gemm.gluon", f"compute capability {capability(dev)} (sm_90 only)")
    return False


def gluon_takes(a, b, a_copy, b_copy) -> bool:
    """Whether :func:`scaled_mm_triton` runs this call on its Gluon kernels (its own two tests: :func:`_tma_ok` and
    :func:`_gluon_ok`): FP8 1x128 x 128x128 blockwise operands TMA can read, on an sm_90 GPU, Gluon on. The cuBLAS
    backend leaves it the calls cuBLAS could take only with K zero-padded (:func:`lowbit.gemm.cublas.supports`)."""
    sa, sb = a.scheme, b.scheme
    if not (_on_device(a, b) and isinstance(sa, Float8Blockwise) and isinstance(sb, Float8Blockwise)
            and sa.block_dim == 1 and sb.block_dim == 2):
        return False
    A, B = getattr(a, a_copy).data, getattr(b, b_copy).data
    return _tma_ok(A, B, A.shape[1]) and _gluon_ok(2, 3, _block_size(sa, sb), A.device)


WS_CONFIGS = [dict(GLUON=True, WS=True, BM=128, BN=128, STAGES=st) for st in (4, 5)]
"""The candidate list of the persistent warp-specialized Gluon kernel (G.gemm_gluon_ws) on FP8 1x128 x 128x128:
128x128 tiles, 4 or 5 stages (4 measured fastest on the H200; 5 within 0-11%). Tests and tools/gemm_sweep.py
narrow it to force one config."""

# What every launch of G.gemm_gluon_ws shares: two 4-warp math partitions (the second with MATH_REGS registers, the
# default one with what is left), one loader warp with 24; 12 warps in all at maxnreg 168 = the 64K register file.
_WS_LAUNCH = dict(NMATH=2, LOAD_REGS=24, MATH_REGS=232, num_warps=4, maxnreg=168)

def _launch_ws(dev, cfg, ptrs, M, N, K, lda_s, ldb_s, keyed=False, **consts):
    """G.gemm_gluon_ws on a persistent grid (one CTA per SM at most) with config cfg (BM, BN, STAGES); ptrs: its
    seven pointer arguments (A, B, their scales, C, pre-GELU, bias). ``keyed``: the launch is keyed by
    :func:`_launch_key`."""
    tiles = cdiv(M, cfg["BM"]) * cdiv(N, cfg["BN"])
    kw = dict(BM=cfg["BM"], BN=cfg["BN"], GROUP_M=8, STAGES=cfg["STAGES"], **consts, **_WS_LAUNCH)
    grid, ints = (min(tiles, num_sms(dev)),), (M, N, K, lda_s, ldb_s)
    if keyed:
        launcher(G.gemm_gluon_ws).keyed(grid, _launch_key(ptrs, ints, kw), (*ptrs, *ints), kw)
    else:
        launcher(G.gemm_gluon_ws)[grid](*ptrs, *ints, **kw)


def _launch_key(ptrs, ints, kwargs) -> tuple:
    """A GEMM launch's key for ``SpecializedLaunch.keyed``, made of the launch's own arguments: every integer as given
    (Triton specializes integers on == 1 and % 16), every keyword (constexprs and launch options), and each pointer
    argument's dtype and 16-byte alignment (views into a fused output may be unaligned). Built per call: cheaper than
    deriving one parameter by parameter."""
    return (*ints, *kwargs.items(), *[(t.dtype, not t.data_ptr() & 15) for t in ptrs])


def _check_bias(bias):
    if bias is not None and not bias.is_contiguous():
        raise ValueError(f"bias: must be contiguous, got strides {tuple(bias.stride())}")


def scaled_mm_triton(a, b, *, a_copy, b_copy, out_dtype, bias=None, gelu=False, accumulate=False, out=None):
    """FP8 scaled GEMM ``A · Bᵀ`` (see :func:`lowbit.gemm.scaled_mm`); returns ``(y, pre_gelu or None)``."""
    ca, cb = _copy(a, a_copy, "a"), _copy(b, b_copy, "b")
    A, B = ca.data, cb.data
    M, K = A.shape
    N = B.shape[0]
    dev = A.device
    _check_bias(bias)
    bs = _block_size(a.scheme, b.scheme)
    sa_mode, lda, sa = _scale_mode(a.scheme, ca)
    sb_mode, ldb, sb = _scale_mode(b.scheme, cb)
    c, pre = _out_tensors(M, N, dev, out_dtype, gelu, accumulate, out)

    tma = _tma_ok(A, B, K)
    gluon = tma and _gluon_ok(sa_mode, sb_mode, bs, dev)

    ptrs = (A, B, sa, sb, c, pre if gelu else c, bias if bias is not None else c)
    consts = dict(SA=sa_mode, SB=sb_mode, BS=bs, HAS_BIAS=bias is not None, GELU=gelu, ACCUM=accumulate)

    def launch(cfg):  # (the K loop steps by the scale block BS: cfg["BK"] is for the emulated kernel)
        if cfg.get("WS"):
            _launch_ws(dev, cfg, ptrs, M, N, K, lda, ldb, keyed=True, **consts)
            return
        split = cfg.get("SPLIT_K", 1)
        if cfg.get("GLUON"):
            kern, extra, p = G.fp8_gemm_gluon, dict(STAGES=cfg["STAGES"]), ptrs
        else:
            # split-K: the FP32 partials of each split, added in order by scale_epilogue_kernel
            ws = torch.empty((split, M, N), dtype=torch.float32, device=dev) if split > 1 else c
            kern, extra, p = G.fp8_gemm_kernel, dict(TMA=tma, num_stages=cfg["num_stages"], SPLIT_K=split), (*ptrs, ws)
        kw = dict(consts, BM=cfg["BM"], BN=cfg["BN"], GROUP_M=8, num_warps=cfg["num_warps"], **extra)
        ints, grid = (M, N, K, lda, ldb), (cdiv(M, cfg["BM"]) * cdiv(N, cfg["BN"]) * split,)
        launcher(kern).keyed(grid, _launch_key(p, ints, kw), (*p, *ints), kw)
        if split > 1:
            ep = (ws, ws, ws, c, ptrs[5], ptrs[6])
            ekw = dict(NV=False, HAS_BIAS=bias is not None, GELU=gelu, ACCUM=accumulate, BM=16, BN=128, SPLIT=split,
                       num_warps=4)
            launcher(G.scale_epilogue_kernel).keyed((cdiv(M, 16), cdiv(N, 128)), _launch_key(ep, (M, N), ekw),
                                                    (*ep, M, N), ekw)

    def cands():
        out = _candidates(M, N, False)
        if sa_mode >= 2 and sb_mode >= 2:
            out = out + split_k_candidates(M, N, K, bs, num_sms(dev) if dev.type == "cuda" else 132)
        if gluon:  # (128x128 / 8 warps / 4 stages: faster than the tl kernel on large shapes)
            g = [dict(GLUON=True, BM=bm, BN=128, num_warps=w, STAGES=st)
                 for bm, w, st in ((128, 8, 4), (128, 8, 3), (64, 4, 3)) if bm <= max(bucket(M), 64)]
            ws = list(WS_CONFIGS) if G.GLUON_WS else []
            mode = env.get("LOWBIT_GEMM_GLUON")
            if ws and mode not in ("force", "ws") and cdiv(M, 128) * cdiv(N, 128) >= num_sms(dev):
                # at least a tile per SM: the warp-specialized kernel alone (1.04-1.25x every other candidate on the
                # H200; timing them all let noise pick a slower one)
                return ws
            out = {"force": g, "ws": ws}.get(mode, out + g + ws)
        return out

    # (the Gluon mode in the key: a forced-Gluon call must not reuse a config tuned without it, and vice versa)
    _run(("fp8", sa_mode, sb_mode, bs, A.dtype, B.dtype, bucket(M), bucket(N), bucket(K), tma,
          gluon and env.get("LOWBIT_GEMM_GLUON")),
         cands, launch, accumulate)
    return _finish(c, pre, out, accumulate)


def _run(key, cands, launch, accumulate):
    # Accumulating launches are not idempotent: never time them; reuse a tuned config or take the first.
    if accumulate:
        cfg = tuned_config("gemm", key)
        launch(cfg if cfg is not None else cands()[0])
    else:
        tuned_launch("gemm", key, cands, launch)


DEQUANT_GEMM: str | None = None
"""Which core GEMM the dequantized path may use: None (autotuned: the fastest of Triton's BF16 GEMM, cuBLAS's
with FP32 output + :func:`~lowbit.gemm.kernels.gemm.scale_epilogue_kernel`, and on sm_90 the persistent
warp-specialized Gluon GEMM with the scales in its epilogue), "triton", "cublas" or "gluon" (for tests)."""


WS_BF16_CONFIGS = [dict(GWS=True, BM=128, BN=bn, STAGES=4) for bn in (256, 128)]
"""The candidate list of the persistent warp-specialized Gluon GEMM on the dequantized BF16 operands
(G.gemm_gluon_ws with SA=0): two 4-warp math partitions over 64-row halves of 128 x BN tiles, K steps of 64, STAGES
operand stages (BN=256: 48 KB a stage). NVFP4 at 16384x4096x4096 on the H200: 128x256 fastest, 1.09x cuBLAS with
the scale epilogue. Tests and tools/gemm_sweep.py narrow it to force one config."""


def _emu_candidates(M, N, pre: bool, gws: bool = False):
    if not pre:
        return _candidates(M, N, True)
    ws = list(WS_BF16_CONFIGS) if gws and DEQUANT_GEMM in (None, "gluon") else []
    if DEQUANT_GEMM == "gluon":
        if not ws:
            raise RuntimeError("DEQUANT_GEMM='gluon' needs Gluon's warp_specialize, an sm_90 GPU and TMA-able operands")
        return ws
    cublas = [] if INTERPRET or DEQUANT_GEMM == "triton" else [dict(CUBLAS=True)]
    if DEQUANT_GEMM == "cublas" and cublas:
        return cublas
    # A plain BF16 GEMM in the K loop: the usual Hopper tiles (128x256x64 with 8 warps first).
    out = [dict(BM=bm, BN=bn, BK=64, num_warps=w, num_stages=st)
           for bm, bn, w, st in ((128, 256, 8, 3), (128, 128, 8, 4), (128, 128, 4, 4), (64, 128, 4, 4))
           if bm <= max(bucket(M), 64) and bn <= max(bucket(N), 64)]
    if INTERPRET:
        out = [dict(BM=32, BN=32, BK=32, num_warps=4, num_stages=1)]
    return (out or [dict(BM=64, BN=64, BK=64, num_warps=4, num_stages=3)]) + cublas + ws


def dequantize_bf16(c, nv: bool, two_d: bool, rows: int, K: int) -> torch.Tensor:
    """(rows, K) BF16 exact values (element × block scale; NVFP4 global scale not applied) of one copy ``c``.

    Exact: an E2M1 × E4M3 product has at most 6 significant bits and an FP8 element × 2^X at most 4,
    both inside BF16's 8 — except MXFP8 products below 2^-126 (X near -127), which BF16 holds as
    subnormals with fewer bits. Under Triton's interpreter the values are returned in float32.
    """
    out = torch.empty(rows, K, dtype=torch.float32 if INTERPRET else torch.bfloat16, device=c.data.device)
    br, bk = (16, 32) if INTERPRET else (32, 128)  # bk: a multiple of both block lengths (16, 32)
    launcher(G.dequant_bf16_kernel)[(cdiv(rows, br), cdiv(K, bk))](
        c.data, c.scale_inv, out, rows, K, c.scale_inv.stride(0), NV=nv, TWO_D=two_d, F32=INTERPRET, BR=br, BK=bk,
        num_warps=4)
    return out


def _scaled_mm_emu(a, b, a_copy, b_copy, out_dtype, bias, gelu, accumulate, out, pre: bool):
    ca, cb = _copy(a, a_copy, "a"), _copy(b, b_copy, "b")
    nv = isinstance(a.scheme, NVFP4)
    A, B = ca.data, cb.data
    M = A.shape[0]
    N = B.shape[0]
    K = A.shape[1] * (2 if nv else 1)
    dev = A.device
    _check_bias(bias)
    sa, sb = ca.scale_inv, cb.scale_inv
    a2d = nv and a.scheme.two_d
    b2d = nv and b.scheme.two_d
    if pre:
        A, B = dequantize_bf16(ca, nv, a2d, M, K), dequantize_bf16(cb, nv, b2d, N, K)
        # MXFP8 has no global scale: with BF16 output and a BF16 (or no) bias cuBLAS's own epilogue is the whole job
        if (not nv and not gelu and not accumulate and out_dtype == torch.bfloat16 and not INTERPRET
                and DEQUANT_GEMM not in ("triton", "gluon") and (bias is None or bias.dtype == torch.bfloat16)):
            return _finish(_mm_cublas(A, B, bias), None, out, False)
    c, pre_out = _out_tensors(M, N, dev, out_dtype, gelu, accumulate, out)
    gsa = ca.global_scale if nv else sa
    gsb = cb.global_scale if nv else sb
    tma = pre and _tma_ok(A, B, K * A.element_size())  # (the dequantized rows: fresh, 16-byte aligned buffers)

    gws = (pre and tma and not INTERPRET and G.GLUON_WS and env.get("LOWBIT_GEMM_GLUON") != "0"
           and capability(dev) == (9, 0))

    def launch(cfg):
        if cfg.get("GWS"):
            _launch_ws(dev, cfg, (A, B, gsa, gsb, c, pre_out if gelu else c, bias if bias is not None else c), M, N, K,
                       0, 0,
                       SA=0, SB=1 if nv else 0, BS=64, HAS_BIAS=bias is not None, GELU=gelu, ACCUM=accumulate)
            return
        if cfg.get("CUBLAS"):
            acc = _mm_cublas(A, B, fp32_out=True)
            launcher(G.scale_epilogue_kernel)[(cdiv(M, 64), cdiv(N, 128))](
                acc, gsa, gsb, c, pre_out if gelu else c, bias if bias is not None else c, M, N, NV=nv,
                HAS_BIAS=bias is not None, GELU=gelu, ACCUM=accumulate, BM=64, BN=128, num_warps=8)
            return
        launcher(G.emu_gemm_kernel)[(cdiv(M, cfg["BM"]) * cdiv(N, cfg["BN"]),)](
            A, B, sa, sb, gsa, gsb, c, pre_out if gelu else c, bias if bias is not None else c, M, N, K,
            sa.stride(0), sb.stride(0), NV=nv, A2D=a2d, B2D=b2d, F32=INTERPRET, PRE=pre, HAS_BIAS=bias is not None,
            GELU=gelu, ACCUM=accumulate, BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], GROUP_M=8, TMA=tma,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])

    _run(("emu", pre, DEQUANT_GEMM, nv, a2d, b2d, A.dtype, B.dtype, bucket(M), bucket(N), bucket(K), tma, gws),
         lambda: _emu_candidates(M, N, pre, gws), launch, accumulate)
    return _finish(c, pre_out, out, accumulate)


def _mm_cublas(A, B, bias=None, fp32_out=False):
    """``A · Bᵀ (+ bias)`` of BF16 operands by cuBLAS with FP32 sums throughout (reduced-precision BF16 split-K
    reductions switched off for the call); BF16 output (the bias, BF16, added by cuBLASLt in FP32 before the one
    rounding) or, with ``fp32_out``, the FP32 product for :func:`~lowbit.gemm.kernels.gemm.scale_epilogue_kernel`."""
    be = torch.backends.cuda.matmul
    reduced = be.allow_bf16_reduced_precision_reduction
    be.allow_bf16_reduced_precision_reduction = False
    try:
        if fp32_out:
            return torch.mm(A, B.t(), out_dtype=torch.float32)
        return torch.mm(A, B.t()) if bias is None else torch.addmm(bias, A, B.t())
    finally:
        be.allow_bf16_reduced_precision_reduction = reduced


def scaled_mm_emulated(a, b, *, a_copy, b_copy, out_dtype, bias=None, gelu=False, accumulate=False, out=None):
    """NVFP4 / MXFP8 GEMM emulated with BF16 tensor cores, operands unpacked in registers tile by tile
    (no extra memory; the choice for small M or N, where each element is unpacked only a few times)."""
    return _scaled_mm_emu(a, b, a_copy, b_copy, out_dtype, bias, gelu, accumulate, out, pre=False)


def scaled_mm_dequant(a, b, *, a_copy, b_copy, out_dtype, bias=None, gelu=False, accumulate=False, out=None):
    """NVFP4 / MXFP8 GEMM: both operands dequantized once to exact BF16 (:func:`dequantize_bf16`, two
    memory-bound passes and (M + N)·K·2 bytes of scratch), then a BF16 tensor-core GEMM with FP32
    accumulation and the global scales, bias, GELU and accumulation in its epilogue (MXFP8 with BF16 output
    and no GELU / accumulation: cuBLAS's BF16 GEMM, bias in its epilogue). The same values
    and the same FP32 accumulation as :func:`scaled_mm_emulated`, without unpacking every element
    once per output tile — which made that kernel ALU-bound at ~100 TFLOP/s on large shapes."""
    return _scaled_mm_emu(a, b, a_copy, b_copy, out_dtype, bias, gelu, accumulate, out, pre=True)


DEQUANT_MIN_MN = 256  # below this M or N an element is unpacked only a few times: the fused kernel wins


def supports_dequant(a, b, a_copy, b_copy, opts) -> bool:
    """NVFP4×NVFP4 and MXFP8×MXFP8 on CUDA; picked by default when M and N >= DEQUANT_MIN_MN."""
    if not supports_emulated(a, b, a_copy, b_copy, opts):
        return False
    if opts.get("forced"):
        return True
    M, N, _ = gemm_dims(a, b, a_copy, b_copy)
    return min(M, N) >= DEQUANT_MIN_MN


register_backend("triton", supports_fp8, scaled_mm_triton)
register_backend("triton_dequant", supports_dequant, scaled_mm_dequant)
register_backend("triton_emulated", supports_emulated, scaled_mm_emulated)
