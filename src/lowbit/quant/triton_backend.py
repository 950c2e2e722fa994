"""Triton quantization backend: registers ``"triton"`` with :func:`lowbit.quant.register_backend`.

Covers, on CUDA tensors (float32 / bfloat16 / float16, contiguous):

* ``Float8Tensorwise``: current scaling (amax pass + cast, 2 launches) and delayed scaling (given
  ``scale``, one launch that casts and records the amax); rowwise and the transposed copy from one read.
* ``Float8Rowwise``: one scale per row of each copy (each copy reads its rows twice: amax, then cast).
* ``Float8Blockwise``: 1xBS (rowwise + columnwise in one launch, fused cast + transpose) and BSxBS
  (columnwise = transposed data + transposed scale grid, same launch). Scales are written directly in
  the storage layout of :func:`lowbit.quant.tensor.scale_storage`.
* ``MXFP8``: both copies in one launch.
* ``NVFP4``: 1x16 and 16x16, stochastic rounding; amax pass + one quantize launch. With the Random
  Hadamard Transform, the columnwise copy is transformed in registers (the reference's butterfly, same
  bits): one amax pass gives max |RHT(x)| (and max |x| for a rowwise copy) without writing RHT(x) out,
  then one quantize launch per copy (their global scales differ).

Every output is bit-identical to :func:`lowbit.quant.reference.quantize_reference` (tests/test_quant_kernels.py).
Nothing here touches CUDA at import time.

Fused-prologue API (used by lowbit.ops and lowbit.optim): a fused kernel that computes the tensor to quantize
itself (RMSNorm, SwiGLU, RoPE's backward) writes the blockwise quantizer's outputs with the quantizer's own layouts
and launch configs:

* :class:`BlockwisePlan`: the shape-dependent part of one blockwise quantize call (scale-grid layouts, kernel
  constants; ``launch_args(config)`` gives the kernel, grid and arguments of a launch candidate);
* :func:`blockwise_buffers`: a plan's output buffers (FP8 copies, scale grids, amax accumulator);
* :func:`blockwise_args`: the quantize kernels' arguments after the input, for those buffers;
* :func:`set_copies`: attach the filled buffers to a :class:`~lowbit.quant.tensor.QuantizedTensor`;
* :func:`regs_ok`, :func:`packed_ok`: whether the register-tile kernel (and its BF16-pair form) may take an input;
* :data:`REGS_CONFIGS`: the register-tile kernel's launch candidates;
* :func:`rowcol_regs_prologue`, :func:`bf16_pack_candidates`: both 1x128 copies of a tensor the register-tile
  kernel computes in a prologue, autotuned against the unfused path.
"""

from __future__ import annotations

import functools
import math

import torch

from ..formats import E4M3, FloatFormat
from ..runtime.amax_arena import arena_slot
from ..runtime.autotune import bucket, tuned_launch
from ..runtime.device import INTERPRET, capability, num_sms
from ..runtime.launch import CachedLaunch, SpecializedLaunch
from ..runtime.log import declined
from . import register_backend
from .kernels import quant as K
from .kernels import quant_gluon as QG
from .reference import resolve_seed, validate_quantize_args
from .schemes import BLOCK_SIZE, MXFP8, NVFP4, Float8Blockwise, Float8Rowwise, Float8Tensorwise
from .tensor import QuantizedCopy, QuantizedTensor, cdiv, scale_storage_shape

__all__ = ["supports", "quantize_triton",
           # fused-prologue API
           "BlockwisePlan", "blockwise_buffers", "blockwise_args", "set_copies", "regs_ok", "packed_ok", "REGS_CONFIGS",
           "rowcol_regs_prologue", "bf16_pack_candidates"]

# Software rounding onto the grid before the FP8 cast in the interpreter (its float->fp8 cast is wrong for some
# values); on the GPU the hardware's saturating RNE conversion.
SW_ROUND = INTERPRET
_IN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _configs(tile_m: list[int], tile_k: list[int], warps: list[int], M: int, K: int, *, min_m: int = 1, min_k: int = 1):
    """Config generator with a pruning filter: drop tiles much larger than the tensor (keep one at least)."""
    out = []
    for bm in tile_m:
        for bk in tile_k:
            for w in warps:
                if bm > max(bucket(M), min_m) or bk > max(bucket(K), min_k):
                    continue
                if bm * bk >= 128 * 128 and w < 4 or bm * bk <= 32 * 32 and w > 4:
                    continue
                out.append(dict(BM=bm, BK=bk, num_warps=w))
    if not out:
        out.append(dict(BM=tile_m[0], BK=tile_k[0], num_warps=warps[0]))
    return out


# ------------------------------------------------------------------------------------------------
# dispatch
# ------------------------------------------------------------------------------------------------
def supports(x, scheme, rowwise: bool, columnwise: bool) -> bool:
    """True for CUDA, contiguous float32/bf16/fp16 tensors with a scheme and shape implemented here."""
    if not isinstance(x, torch.Tensor) or not x.is_cuda:
        return False
    return _implemented(x, scheme, rowwise, columnwise)


def _implemented(x, scheme, rowwise: bool, columnwise: bool) -> bool:
    if x.dtype not in _IN_DTYPES or not x.is_contiguous():
        return False
    if x.dim() == 0 or x.numel() == 0 or not (rowwise or columnwise):
        return False
    M, Kd = x.numel() // x.shape[-1], x.shape[-1]
    if isinstance(scheme, (Float8Tensorwise, Float8Rowwise)):
        return True
    if isinstance(scheme, Float8Blockwise):
        return scheme.block_size <= BLOCK_SIZE
    if isinstance(scheme, MXFP8):
        return (not rowwise or Kd % 32 == 0) and (not columnwise or M % 32 == 0)
    if isinstance(scheme, NVFP4):
        return Kd % 16 == 0 and (not (columnwise or scheme.two_d) or M % 16 == 0)
    return False


def _fmt_args(fmt: FloatFormat) -> dict:
    return dict(FMAX=float(fmt.max), EMIN=fmt.emin, MBITS=fmt.mbits)


def _amax_buffer(dev) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32, device=dev)


_AMAX_LAUNCH = CachedLaunch(K.amax_kernel)


def _launch_amax(x2: torch.Tensor, amax_i: torch.Tensor) -> None:
    """amax_i (int32 bits, zeroed) = max |x2| over the contiguous x2. amax_i is a fresh allocation (aligned), so
    the specialization key is the size, dtype, device and x2's 16-byte alignment (see lowbit._launch)."""
    n = x2.numel()
    block = 4096 if n >= 4096 else max(16, bucket(n))
    key = (n, x2.dtype, x2.device.index, x2.data_ptr() % 16 == 0)
    _AMAX_LAUNCH((cdiv(n, block),), key, x2, amax_i, n, block, num_warps=8 if block >= 4096 else 4)


def quantize_triton(x: torch.Tensor, scheme, *, rowwise: bool = True, columnwise: bool = False,
                    scale: torch.Tensor | None = None, seed: int | None = None,
                    _checked: bool = False) -> QuantizedTensor:
    """Quantize a CUDA tensor with the Triton kernels; same contract and results as :func:`quantize_reference`.

    Args:
        x: (..., K) float32/bfloat16/float16 CUDA tensor, contiguous; viewed as (M, K).
        scheme, rowwise, columnwise, scale, seed: see :func:`lowbit.quantize`.
        _checked: internal (``lowbit.quantize``'s memoized dispatch): x's device, dtype, shape, contiguity and
            the scheme were validated for this exact key before; only a given ``scale`` is still checked.
    """
    if _checked:
        if scale is not None:
            validate_quantize_args(x, scheme, rowwise, columnwise, scale)
    else:
        _check_triton_input(x, scheme, rowwise, columnwise, scale)
    return _quantize_triton(x, scheme, rowwise, columnwise, scale, seed)


def _check_triton_input(x, scheme, rowwise, columnwise, scale):
    validate_quantize_args(x, scheme, rowwise, columnwise, scale)
    if not x.is_cuda and not INTERPRET:
        raise ValueError(f"x: the triton backend runs on CUDA tensors, got device {x.device}; use backend='reference'")
    if x.dtype not in _IN_DTYPES:
        raise TypeError(f"x: the triton backend takes float32, bfloat16 or float16, got {x.dtype}; use "
                        "backend='reference'")
    if not x.is_contiguous():
        raise ValueError(f"x: the triton kernels need a contiguous tensor (got strides {tuple(x.stride())} for shape "
                         f"{tuple(x.shape)}); call x.contiguous() or use backend='reference'")
    if not _implemented(x, scheme, rowwise, columnwise):
        raise NotImplementedError(f"scheme: the triton backend does not implement {scheme!r} with rowwise={rowwise}, "
                                  f"columnwise={columnwise} for shape {tuple(x.shape)}; use backend='reference'")


def _quantize_triton(x, scheme, rowwise, columnwise, scale, seed):
    x2 = x.detach().reshape(-1, x.shape[-1])
    qt = QuantizedTensor(shape=x.shape, dtype=x.dtype, scheme=scheme)
    seed = qt.meta["seed"] = resolve_seed(scheme, seed, x.device)  # (on CUDA: a device tensor, see there)
    if isinstance(scheme, Float8Tensorwise):
        _tensorwise(qt, x2, scheme, rowwise, columnwise, scale)
    elif isinstance(scheme, Float8Rowwise):
        _rowwise(qt, x2, scheme, rowwise, columnwise)
    elif isinstance(scheme, Float8Blockwise):
        _blockwise(qt, x2, scheme, rowwise, columnwise)
    elif isinstance(scheme, MXFP8):
        _mxfp8(qt, x2, scheme, rowwise, columnwise)
    else:
        key = 0 if seed is None else seed  # (None: no stochastic rounding, the kernel ignores the key)
        if scheme.rht and columnwise:
            _nvfp4_rht(qt, x2, scheme, rowwise, key)
        else:
            _nvfp4(qt, x2, scheme, rowwise, columnwise, key)
    return qt


_TENSORWISE_PLANS: dict = {}  # (M, K, dtype, scheme, rowwise, columnwise, delayed) -> tuned launch config
_TENSORWISE_LAUNCH = CachedLaunch(K.tensorwise_kernel)


def _tensorwise(qt, x2, sch: Float8Tensorwise, rowwise, columnwise, scale):
    M, Kd = x2.shape
    fmt, dev = sch.format, x2.device
    # the amax and scale_inv bits, zeroed by one fill (scale_inv 16 bytes in, aligned as a fresh allocation): the
    # delayed kernel ORs the scale_inv bits in (see tensorwise_kernel)
    buf = torch.zeros(8, dtype=torch.int32, device=dev)
    amax_i, si = buf[0:1], buf[4:5]
    delayed = scale is not None
    s = scale.to(torch.float32).reshape(1) if delayed else amax_i  # (unused by the kernel when not delayed)
    rq = torch.empty(M, Kd, dtype=fmt.torch_dtype, device=dev) if rowwise else None
    cq = torch.empty(Kd, M, dtype=fmt.torch_dtype, device=dev) if columnwise else None
    pkey = (M, Kd, x2.dtype, sch, rowwise, columnwise, delayed)
    plan = _TENSORWISE_PLANS.get(pkey)
    fa = _fmt_args(fmt)
    # Triton specializes pointers on 16-byte alignment: the only argument whose alignment can vary here is
    # the caller's x (and a given scale); the buffers above are fresh allocations.
    # (and the device: a compiled kernel's function handle belongs to one device's context)
    lkey = (pkey, SW_ROUND, dev.index, x2.data_ptr() % 16 == 0, s.data_ptr() % 16 == 0)
    if not delayed:
        _launch_amax(x2, amax_i)
    a1, a2 = (rq if rowwise else cq), (cq if columnwise else rq)
    if plan is not None:
        c = plan
        _TENSORWISE_LAUNCH((cdiv(M, c["BM"]), cdiv(Kd, c["BK"])), lkey, x2, a1, a2, s, amax_i, si, M, Kd, fa["FMAX"],
                           fa["EMIN"], fa["MBITS"], delayed, rowwise, columnwise, SW_ROUND, c["BM"], c["BK"],
                           num_warps=c["num_warps"])
    else:
        cands = _configs([32, 64, 128], [64, 128], [4, 8], M, Kd)

        def launch(c):
            if delayed:
                buf.zero_()
            grid = (cdiv(M, c["BM"]), cdiv(Kd, c["BK"]))
            K.tensorwise_kernel[grid](x2, a1, a2, s, amax_i, si, M, Kd, **fa, DELAYED=delayed, ROW=rowwise,
                                      COL=columnwise,
                                      SW=SW_ROUND, BM=c["BM"], BK=c["BK"], num_warps=c["num_warps"])

        _TENSORWISE_PLANS[pkey] = tuned_launch(
            "tensorwise", (delayed, rowwise, columnwise, x2.dtype, bucket(M), bucket(Kd)), cands, launch)
    amax, si = amax_i.view(torch.float32), si.view(torch.float32)
    if rowwise:
        qt.rowwise = QuantizedCopy(data=rq, scale_inv=si, amax=amax)
    if columnwise:
        qt.columnwise = QuantizedCopy(data=cq, scale_inv=si, amax=amax)  # one scale, one amax: shared


def _rowwise(qt, x2, sch: Float8Rowwise, rowwise, columnwise):
    M, Kd = x2.shape
    fmt, dev = sch.format, x2.device
    for which in ("rowwise", "columnwise"):
        if not (rowwise if which == "rowwise" else columnwise):
            continue
        R, C, sr, sc = (M, Kd, Kd, 1) if which == "rowwise" else (Kd, M, 1, Kd)
        q = torch.empty(R, C, dtype=fmt.torch_dtype, device=dev)
        si = torch.empty(R, 1, dtype=torch.float32, device=dev)
        amax_i = _amax_buffer(dev)
        cands = lambda R=R, C=C, which=which: _configs(  # noqa: E731 - built on a tuning miss only
            [1, 4, 16, 64] if which == "rowwise" else [32, 64], [256, 512, 1024] if which == "rowwise" else [32, 64],
            [4, 8], R, C)

        def launch(c, R=R, C=C, sr=sr, sc=sc, q=q, si=si, amax_i=amax_i):
            K.rowscale_kernel[(cdiv(R, c["BM"]),)](x2, q, si, amax_i, R, C, sr, sc, **_fmt_args(fmt), POW2=sch.pow2,
                                                  SW=SW_ROUND, BR=c["BM"], BC=c["BK"], num_warps=c["num_warps"])

        tuned_launch("rowscale", (which, x2.dtype, bucket(R), bucket(C)), cands, launch)
        setattr(qt, which, QuantizedCopy(data=q, scale_inv=si, amax=amax_i.view(torch.float32)))


_BLOCKWISE_PLANS: dict = {}  # (M, K, dtype, scheme, rowwise, columnwise, SW_ROUND, persistent?, ...) -> BlockwisePlan


# (two_d, rowwise, columnwise, dtype) -> candidates of blockwise_persistent_kernel (first = default without
# autotuning) where it is used: the uses where it measured bit-identical to blockwise_kernel and faster than it on the
# H200 (BENCHMARKS.md); CTAS: programs an SM, PREFETCH: tiles loaded ahead. Not listed, so on blockwise_kernel:
# 1x128 both copies (the slab walk and the register-tile kernel are faster), FP32 128x128 (the persistent kernel's
# columnwise copy from FP32 is wrong under Triton 3.6, see the kernel), and the cases not measured.
_PERSISTENT = {
    (True, True, True, torch.bfloat16): [dict(BM=128, CTAS=1, PREFETCH=1, num_warps=16),  # 0.86 of a copy
                                         dict(BM=128, CTAS=1, PREFETCH=1, num_warps=8),
                                         dict(BM=128, CTAS=1, PREFETCH=2, num_warps=16)],
    (False, True, False, torch.float32): [dict(BM=64, CTAS=2, PREFETCH=1, num_warps=4)],
}


def _persistent_ok(x2, bs: int, two_d: bool, rowwise: bool, columnwise: bool) -> bool:
    """Whether blockwise_persistent_kernel may run on this input: one of the uses in _PERSISTENT, and the compiled
    variant measured there (whole tiles only: M and K multiples of BLOCK_SIZE; x 16-byte aligned, since Triton
    specializes the loads' vector width, hence the layouts, on it). Checked on every call (x's alignment can
    change from call to call); the candidate list is built only on a tuning miss."""
    if INTERPRET or bs != BLOCK_SIZE or not x2.is_cuda or (two_d, rowwise, columnwise, x2.dtype) not in _PERSISTENT:
        return False  # (not one of its uses: no decline)
    M, Kd = x2.shape
    if M % BLOCK_SIZE == 0 and Kd % BLOCK_SIZE == 0 and x2.data_ptr() % 16 == 0:
        return True
    if M % BLOCK_SIZE or Kd % BLOCK_SIZE:
        declined("quant.blockwise_persistent", f"shape ({M}, {Kd}) is not whole {BLOCK_SIZE}x{BLOCK_SIZE} tiles")
    else:
        declined("quant.blockwise_persistent", "input not 16-byte aligned")
    return False


def _blockwise_persistent_configs(x2, bs: int, two_d: bool, rowwise: bool, columnwise: bool) -> list[dict]:
    """Candidates of blockwise_persistent_kernel for this input (tagged KIND="pers"), or [] where it is not used."""
    if not _persistent_ok(x2, bs, two_d, rowwise, columnwise):
        return []
    return [dict(c, KIND="pers") for c in _PERSISTENT[(two_d, rowwise, columnwise, x2.dtype)]]


# Candidates of the register-tile 1x128 row+col kernel (quant_gluon.rowcol_1x128_regs): one 128 x 128 tile a
# program held in registers, both copies from the one load, no shared-memory transposition; on the H200 0.80 of a
# copy's bandwidth from BF16 and 0.93 from FP32, above the slab walk (BENCHMARKS.md). Other layouts, warp counts, a
# TMA-fed persistent form and BF16 maxima from the bits all measured slower.
REGS_CONFIGS = [dict(KIND="regs", COMPACT=True, LC=8, num_warps=8),
                dict(KIND="regs", COMPACT=False, LC=8, num_warps=8),
                dict(KIND="regs", COMPACT=True, LC=4, num_warps=8)]


# Candidates of its BF16 form that reads and reduces the tile as BF16 pairs (quant_gluon.rowcol_1x128_regs_packed),
# tried before REGS_CONFIGS for BF16 input: capped at 80 registers a thread (three CTAs an SM) it beat REGS_CONFIGS'
# first on every shape measured (0.87 against 0.80 of a copy); uncapped or at 64 registers it was slower.
_PACKED_CONFIGS = [dict(KIND="packed", LC=8, num_warps=8, maxnreg=80)]


# Candidates of the MXFP8 register-tile kernel (quant_gluon.mxfp8_rowcol_regs), 8 warps: at most 128 registers
# a thread (two CTAs an SM; a few spills under Triton 3.6), or what ptxas picks (148 there, no spills: one CTA an SM).
_MX_REGS_CONFIGS = [dict(KIND="regs", maxnreg=128), dict(KIND="regs", maxnreg=None)]

_REGS_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def regs_ok(x2, bs: int, two_d: bool, rowwise: bool, columnwise: bool, path: str = "quant.rowcol_1x128_regs") -> bool:
    """Whether quant_gluon's register-tile kernels may run (rowcol_1x128_regs for 1x128, bs = BLOCK_SIZE;
    mxfp8_rowcol_regs, asked with bs = BLOCK_SIZE too): both copies from BF16 / FP16 / FP32 input of whole 128 x 128
    tiles (in-tile offsets within int32), on a CUDA GPU with the hardware's saturating FP8 cast (sm_89+; not in
    Triton's interpreter), Gluon importable. Where a call of its kind (both 1D copies of BLOCK_SIZE blocks) does not
    fit, says why (:func:`lowbit.runtime.log.declined` under ``path``)."""
    if bs != BLOCK_SIZE or two_d or not (rowwise and columnwise):
        return False  # (not one of its uses: no decline)
    M, Kd = x2.shape
    if (QG.GLUON and not INTERPRET and not SW_ROUND and x2.is_cuda and x2.dtype in _REGS_DTYPES
            and M % BLOCK_SIZE == 0 and Kd % BLOCK_SIZE == 0 and BLOCK_SIZE * max(M, Kd) < 2**31
            and capability(x2.device) >= (8, 9)):
        return True
    if not QG.GLUON:
        declined(path, "Gluon is not importable (Triton >= 3.5 with Hopper ops)")
    elif INTERPRET or SW_ROUND or not x2.is_cuda:
        declined(path, "not a CUDA tensor, or Triton's interpreter")
    elif x2.dtype not in _REGS_DTYPES:
        declined(path, f"dtype {x2.dtype} (bfloat16, float16 or float32 only)")
    elif M % BLOCK_SIZE or Kd % BLOCK_SIZE:
        declined(path, f"shape ({M}, {Kd}) is not whole {BLOCK_SIZE}x{BLOCK_SIZE} tiles")
    elif BLOCK_SIZE * max(M, Kd) >= 2**31:
        declined(path, f"shape ({M}, {Kd}): in-tile offsets past int32")
    else:
        declined(path, f"compute capability {capability(x2.device)} (sm_89+ only)")
    return False


def packed_ok(x2) -> bool:
    """Whether quant_gluon.rowcol_1x128_regs_packed may run where the register-tile kernel may (regs_ok): BF16 input
    whose base is 16-byte aligned (it reads the tile as int32 pairs, vectorized by 4; a 2-byte-aligned view would
    fault)."""
    return x2.dtype == torch.bfloat16 and x2.data_ptr() % 16 == 0


@functools.lru_cache(maxsize=None)
def _regs_layouts(num_warps: int, lanes_c: int) -> dict:
    """rowcol_1x128_regs' layout arguments (quant_gluon.rowcol_regs_layouts; built once each). Read-only."""
    return dict(zip("ABT", QG.rowcol_regs_layouts(num_warps, lanes_c)))


@functools.lru_cache(maxsize=None)
def _regs_word_layout(num_warps: int, lanes_c: int):
    """rowcol_1x128_regs_packed's layout of the tile's BF16 pairs (quant_gluon.rowcol_regs_word_layout; built once)."""
    return QG.rowcol_regs_word_layout(num_warps, lanes_c)


@functools.lru_cache(maxsize=None)
def _regs_half_layout(num_warps: int, lanes_c: int):
    """The SWIGLU_BWD prologue's half-tile layout H (quant_gluon.rowcol_regs_half_layout; built once each)."""
    return QG.rowcol_regs_half_layout(num_warps, lanes_c)


def bf16_pack_candidates(candidates: list, dtype: torch.dtype) -> list:
    """``candidates`` of a prologue quantizer (rowcol_regs_prologue applies it) without the "PACK" ones unless
    ``dtype`` is BF16; all of them where that would leave none (a PACK candidate forced alone: it runs unpacked)."""
    keep = [c for c in candidates if not c.get("PACK") or dtype == torch.bfloat16]
    return keep or list(candidates)


_PROLOGUE_PLANS: dict = {}  # (name, M, W, dtype, scheme) -> BlockwisePlan of a prologue quantizer's output


def rowcol_regs_prologue(name: str, tkey: tuple, shape: tuple, scheme, candidates, x: torch.Tensor, prologue,
                         unfused) -> QuantizedTensor:
    """Both 1x128 copies of a 16-bit tensor of logical ``shape`` (viewed as (M, W), W = shape[-1]) that
    rowcol_1x128_regs computes in a prologue from other inputs (ops.swiglu's SwiGLU backward, ops.rope's RoPE
    backward), autotuned (``name``, ``tkey``) over ``candidates`` (a list, or a function returning it, as tuned_launch
    takes): KIND "regs" runs the kernel on ``x`` (the first input; its dtype and device are the output's) with
    ``prologue(c)``'s keyword arguments (its switch and extra pointers) and the half-tile layout H of ``c``'s warps
    and lanes (these prologues compute their tile in two 64-row halves), with "PACK" the tile quantized as BF16 pairs
    (BF16 x only; ignored otherwise); KIND "two" runs ``unfused()`` (the (M, W)
    tensor in 16 bits) and the plain quantizer's default candidate on it. Returns the QuantizedTensor."""
    W = shape[-1]
    M = math.prod(shape) // W
    key = (name, M, W, x.dtype, scheme)
    plan = _PROLOGUE_PLANS.get(key)
    if plan is None:  # the blockwise quantizer's plan for the (M, W) output: layouts and kernel constants
        plan = _PROLOGUE_PLANS[key] = BlockwisePlan(M, W, scheme, True, True, x.device)
    bufs = blockwise_buffers(plan, scheme.format, x.device, True, True)
    args = blockwise_args(plan, *bufs)

    def launch(c):
        if c["KIND"] == "two":
            fn, grid, _, kw = plan.launch_args(REGS_CONFIGS[0])
            fn[grid](unfused(), *args, **kw)
        else:
            if c.get("PACK") and x.dtype != torch.bfloat16:  # (BF16 pairs only: FP16 runs the form without)
                c = dict(c, PACK=False)
            fn, grid, _, kw = plan.launch_args(c)
            fn[grid](x, *args, **kw, **prologue(c), H=_regs_half_layout(c["num_warps"], c["LC"]))

    tuned_launch(name, tkey, lambda: bf16_pack_candidates(candidates() if callable(candidates) else candidates,
                                                          x.dtype),
                 launch)
    qt = QuantizedTensor(shape=tuple(shape), dtype=x.dtype, scheme=scheme)
    set_copies(qt, *bufs)
    return qt


def blockwise_buffers(plan: "BlockwisePlan", fmt: FloatFormat, dev, rowwise: bool, columnwise: bool):
    """The outputs of one blockwise quantize launch: (rq, rs, cq, cs, amax_i) — FP8 copies (None where not asked
    for), scale grids in storage layout and the int32 amax accumulator. One zero-filled buffer (one launch) holds
    both scale grids (pads must read 0) and the amax at the end; every grid starts 16-byte aligned (sizes are
    multiples of 4 floats). Under :func:`amax_arena` in a CUDA-graph capture, grids without padding (every element
    written by the kernel) are not filled, and the amax is an arena slot (zeroed by the arena's one fill)."""
    rq = torch.empty(plan.M, plan.K, dtype=fmt.torch_dtype, device=dev) if rowwise else None
    cq = torch.empty(plan.K, plan.M, dtype=fmt.torch_dtype, device=dev) if columnwise else None
    nr, nc = plan.nr, plan.nc
    slot = None if plan.padded else arena_slot(dev)
    if slot is not None:
        buf = torch.empty(nr + nc, dtype=torch.float32, device=dev)
        amax_i = slot
    else:
        buf = torch.zeros(nr + nc + 1, dtype=torch.float32, device=dev)
        amax_i = buf[nr + nc:].view(torch.int32)
    rs = buf[:nr].view(plan.rshape) if rowwise else None
    cs = buf[nr:nr + nc].view(plan.cshape) if columnwise else None
    return rq, rs, cq, cs, amax_i


def blockwise_args(plan: "BlockwisePlan", rq, rs, cq, cs, amax_i) -> tuple:
    """The blockwise kernels' arguments after the input, for blockwise_buffers' outputs: (rq, rs, cq, cs, amax_i,
    M, K, rs_ld, cs_ld); a copy not asked for is passed as the other one (its ROW / COL switch is off: not written)."""
    rw, cw = rq is not None, cq is not None
    return (rq if rw else cq, rs if rw else cs, cq if cw else rq, cs if cw else rs, amax_i, plan.M, plan.K,
            plan.rshape[1] if rw else 0, plan.cshape[1] if cw else 0)


def set_copies(qt: QuantizedTensor, rq, rs, cq, cs, amax_i) -> None:
    """Attach the copies blockwise_buffers made (and a kernel filled) to ``qt``; both share the amax tensor."""
    amax = amax_i.view(torch.float32)
    if rq is not None:
        qt.rowwise = QuantizedCopy(data=rq, scale_inv=rs, amax=amax)
    if cq is not None:  # both copies come from the same read: the same amax tensor (never written in place later)
        qt.columnwise = QuantizedCopy(data=cq, scale_inv=cs, amax=amax)


def _row2_configs(bs: int) -> list[dict]:
    """blockwise_kernel's launches for both 1D copies with the rowwise copy made in walk 2 (ROW2): walk 1 only loads
    32-row slabs and keeps their elementwise maximum, walk 2 makes both copies from 64-row slabs. Each is
    bit-identical to the reference; the first is faster than the best walk that makes the rowwise copy in walk 1
    (about 0.75 of a copy's bandwidth for BF16 and FP32 input), the other two within 1-2% of it."""
    return [dict(BM=bs, SLAB=32, SLAB2=64, num_warps=4, UNROLL=2, SCR=True, ROW2=True),
            dict(BM=bs, SLAB=32, SLAB2=64, num_warps=4, UNROLL=4, SCR=True, ROW2=True),
            dict(BM=bs, SLAB=64, num_warps=4, SCR=True, ROW2=True)]


def blockwise_configs(M: int, Kd: int, bs: int, two_d: bool, rowwise: bool, columnwise: bool,
                       dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Candidate launches of ``blockwise_kernel`` (the first is the default when not autotuning), pruned by shape.

    A tile is BM x bs; BM = bs with the columnwise copy or 2D scales. 128-wide tiles are walked in
    SLAB-row slabs at 4 warps (see the kernel): both 1D copies with the rowwise one made in
    walk 2 (_row2_configs, BF16 / FP16 / FP32); the columnwise copy alone in 64-row slabs, column scales one a
    thread (SCR), both walks unrolled; 32-row slabs for rowwise only. Smaller blocks, and rowwise-only inputs of few
    rows, are held whole.
    2D from FP32 input stays on whole tiles (the previous kernel's structure): the slab walk's 2D columnwise data
    from FP32 input is wrong (pairs of elements along K permuted) — a Triton 3.6 miscompile of the transpose of an
    FP8 tile cast from FP32 without a clamp first (SATCVT); with the clamp it matches. 1D from FP32 matches either
    way.
    """
    square = two_d or columnwise
    out = []

    def add(bm, slab, warps, **kw):
        if bm <= max(bucket(M), bs if square else 1):
            out.append(dict(BM=bm, SLAB=slab, num_warps=warps, **kw))

    # The slab walk is used only where it was shown bit-identical on the GPU (BF16 / FP16, 1D); 2D and FP32
    # inputs keep the original whole-tile kernel (a 2D slab walk from FP32 differed there; the weights of an
    # FP32-master model are exactly that case).
    if dtype == torch.float32 or two_d:
        out = []
        if dtype == torch.float32 and not two_d and rowwise and columnwise and bs >= 128:
            # 1D row+col from FP32 (the RMSNorm / LayerNorm outputs of LayerNormLinear): the slab walk first
            # (faster than blockwise_persistent_kernel and whole tiles; the rowwise-in-walk-1 walk kept as a
            # candidate)
            out += _row2_configs(bs) + [dict(BM=bs, SLAB=64, num_warps=4, SCR=True)]
        for w in (8, 4) if bs >= 64 else (4,):
            c = dict(BM=bs, SLAB=0, num_warps=w) if square else dict(BM=min(bs, 64), SLAB=0, num_warps=4)
            if c not in out:
                out.append(c)
        if dtype == torch.float32 and not two_d and columnwise and not rowwise and bs >= 128:
            out += [dict(BM=bs, SLAB=64, num_warps=4, SCR=True), dict(BM=bs, SLAB=32, num_warps=4, SCR=True)]
        return out or [dict(BM=bs if square else 8, SLAB=0, num_warps=4)]
    if square and bs >= 128:  # (1D columnwise here: 2D returned above)
        if rowwise:
            out += [c for c in _row2_configs(bs) if bs <= max(bucket(M), bs)]
            add(bs, 64, 4, SCR=True)  # the rowwise copy written in walk 1
        else:
            add(bs, 64, 4, SCR=True, UNROLL=2)
            add(bs, 64, 4, SCR=True)
            add(bs, 32, 4, SCR=True)
    elif square:
        for w in (4, 8) if bs >= 64 else (4,):
            add(bs, 0, w)
    else:
        if bs >= 64:
            add(128, 32, 4)
            add(128, 32, 4, UNROLL=4)
        for bm in (64, 32, 16, 8):
            add(bm, 0, 4)
    if not out:  # fewer rows than any tile: the smallest
        out.append(dict(BM=bs if square else 8, SLAB=0, num_warps=4))
    return out


class BlockwisePlan:
    """Everything shape-dependent about one blockwise quantize call, computed once (host time per call
    matters: this runs for every quantized GEMM operand of every step)."""

    __slots__ = ("rshape", "cshape", "nr", "nc", "grid", "kw", "cfg", "M", "K", "bs", "fn", "nsm", "extra", "padded",
                 "launch")

    def __init__(self, M, Kd, sch: Float8Blockwise, rowwise, columnwise, device):
        bs = sch.block_size
        self.rshape, self.cshape = scale_storage_shape(sch, M, Kd), scale_storage_shape(sch, Kd, M)
        self.nr = self.rshape[0] * self.rshape[1] if rowwise else 0
        self.nc = self.cshape[0] * self.cshape[1] if columnwise else 0
        # whether a stored grid has padding columns (pad4 of its logical width), which no kernel writes
        lr, lc = (cdiv(Kd, bs), cdiv(M, bs)) if sch.block_dim == 2 else (M, Kd)
        self.padded = (rowwise and self.rshape[1] != lr) or (columnwise and self.cshape[1] != lc)
        # SATCVT: from sm_89 Triton casts to FP8 with cvt.rn.satfinite (the only form PTX has), which clamps
        # by itself; older GPUs get Triton's software conversion, so the clamp stays there.
        satcvt = not INTERPRET and device.type == "cuda" and capability(device) >= (8, 9)
        self.kw = dict(**_fmt_args(sch.format), POW2=sch.pow2, EPS=float(sch.eps), TWO_D=sch.block_dim == 2,
                       ROW=rowwise, COL=columnwise, SW=SW_ROUND, BS=bs, SATCVT=satcvt)
        self.M, self.K, self.bs = M, Kd, bs
        self.cfg = None
        self.grid = None
        self.fn, self.extra = K.blockwise_kernel, ()
        self.launch = None  # the chosen kernel's SpecializedLaunch, bound once per alignment (set with cfg)
        self.nsm = num_sms(device) if device.type == "cuda" else 1

    def launch_args(self, c: dict):
        """(kernel, grid, extra positional arguments, keyword arguments) for candidate ``c``."""
        M, Kd, bs = self.M, self.K, self.bs
        kind = c.get("KIND")
        if kind == "regs":
            kw = dict(FMAX=self.kw["FMAX"], POW2=self.kw["POW2"], EPS=self.kw["EPS"], COMPACT=c["COMPACT"],
                      num_warps=c["num_warps"], **_regs_layouts(c["num_warps"], c["LC"]))
            if c.get("maxnreg"):
                kw["maxnreg"] = c["maxnreg"]
            if c.get("PACK"):  # (a BF16 prologue's tile quantized as BF16 pairs)
                kw["AW"] = _regs_word_layout(c["num_warps"], c["LC"])
            return QG.rowcol_1x128_regs, ((M // 128) * (Kd // 128),), (), kw
        if kind == "packed":
            kw = dict(FMAX=self.kw["FMAX"], POW2=self.kw["POW2"], EPS=self.kw["EPS"], num_warps=c["num_warps"],
                      AW=_regs_word_layout(c["num_warps"], c["LC"]), **_regs_layouts(c["num_warps"], c["LC"]))
            if c.get("maxnreg"):
                kw["maxnreg"] = c["maxnreg"]
            return QG.rowcol_1x128_regs_packed, ((M // 128) * (Kd // 128),), (), kw
        bm = c["BM"]
        kw = dict(self.kw, **{k: v for k, v in c.items() if k not in ("KIND", "CTAS")})
        kw["EVEN"] = M % bm == 0 and Kd % bs == 0
        kw["WIDE"] = bm * Kd + bs >= 2**31 or bs * M + bm >= 2**31  # in-tile offsets past int32
        if kind == "pers":
            n_prog = min(cdiv(M, bm) * cdiv(Kd, bs), self.nsm * c["CTAS"])
            return K.blockwise_persistent_kernel, (n_prog,), (n_prog,), kw
        gm, gk = cdiv(M, bm), cdiv(Kd, bs)
        kw["KMAJOR"] = gm <= 65535  # a grid's y extent is at most 65535
        return K.blockwise_kernel, ((gk, gm) if kw["KMAJOR"] else (gm, gk)), (), kw


def _blockwise(qt, x2, sch: Float8Blockwise, rowwise, columnwise):
    M, Kd = x2.shape
    fmt, dev, bs = sch.format, x2.device, sch.block_size
    two_d = sch.block_dim == 2
    # (the plan's kernel arguments include SW; whether the persistent kernel may run depends on x's alignment)
    pers = _persistent_ok(x2, bs, two_d, rowwise, columnwise)
    # (the register-tile kernels' eligibility follows from the rest of the key, except the BF16-pair form's alignment)
    packed = packed_ok(x2)
    key = (M, Kd, x2.dtype, sch, rowwise, columnwise, SW_ROUND, pers, packed)
    plan = _BLOCKWISE_PLANS.get(key)
    if plan is None:
        plan = BlockwisePlan(M, Kd, sch, rowwise, columnwise, dev)
    bufs = blockwise_buffers(plan, fmt, dev, rowwise, columnwise)
    args = blockwise_args(plan, *bufs)
    if plan.cfg is not None:
        # the plan fixes every other argument's specialization (the buffers are fresh allocations, except an arena
        # slot for the amax under capture)
        lkey = (x2.data_ptr() % 16 == 0, bufs[4].data_ptr() % 16 == 0)
        plan.launch.keyed(plan.grid, lkey, (x2, *args, *plan.extra), plan.cfg)
    else:
        # (the register-tile kernel's candidates first where it may run, then the persistent kernel's where it
        # may, then blockwise_kernel's: the autotuner times them all; whether the register-tile kernel may run
        # follows from the plan's key, unlike the alignment-dependent two above)
        regs = regs_ok(x2, bs, two_d, rowwise, columnwise)
        packed = packed and regs
        cands = (list(_PACKED_CONFIGS) if packed else []) \
            + (list(REGS_CONFIGS) if regs else [])\
            + _blockwise_persistent_configs(x2, bs, two_d, rowwise, columnwise) \
            + blockwise_configs(M, Kd, bs, two_d, rowwise, columnwise, x2.dtype)

        def launch(c):
            fn, grid, extra, kw = plan.launch_args(c)
            fn[grid](x2, *args, *extra, **kw)

        tkey = (two_d, rowwise, columnwise, bs, x2.dtype, pers, regs, packed, bucket(M), bucket(Kd))
        c = tuned_launch("blockwise", tkey, cands, launch)
        plan.fn, plan.grid, plan.extra, plan.cfg = plan.launch_args(c)
        plan.launch = SpecializedLaunch(plan.fn)
        _BLOCKWISE_PLANS[key] = plan
    set_copies(qt, *bufs)


@functools.lru_cache(maxsize=256)
def _wrapped_launch(M: int, Kd: int, dtype: torch.dtype, sch: Float8Blockwise, rowwise: bool, columnwise: bool,
                    device: torch.device, amax_each: bool = True) -> tuple:
    """(plan, kernel, grid, every argument after the tensors and sizes by name) of blockwise_kernel's launch for
    :func:`quantize_blockwise_wrapped`: the first of :func:`blockwise_configs` (the untuned default), every parameter
    given (Inductor's launch fills no default). ``amax_each``: each program stores its amax (no zero-filled
    accumulator, one launch less a call); else each max-accumulates it into one given int32."""
    plan = BlockwisePlan(M, Kd, sch, rowwise, columnwise, device)
    fn, grid, extra, kw = plan.launch_args(blockwise_configs(M, Kd, plan.bs, sch.block_dim == 2, rowwise, columnwise,
                                                             dtype)[0])
    kw["AMAX_EACH"] = amax_each
    tail = {p.name: kw.get(p.name, p.default) for p in fn.params[10 + len(extra):]}
    tail.update((k, v) for k, v in kw.items() if k not in tail)  # (launch options: num_warps)
    return plan, fn, grid, extra, tail


def quantize_blockwise_wrapped(x2: torch.Tensor, scheme: Float8Blockwise, rowwise: bool, columnwise: bool, *,
                               amax_into: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Float8Blockwise copies of the CUDA tensor ``x2`` read as 2D (rows: the product of its leading dims) from one
    ``blockwise_kernel`` launch made through ``torch.library.wrap_triton``, for a ``torch.library.triton_op`` body:
    under torch.compile Inductor allocates the outputs and launches the kernel from its own wrapper (no lowbit Python
    per call); the configuration is fixed when traced (the untuned default; lowbit's Gluon register-tile kernels
    cannot be wrapped), for static dims (a compiled graph is specialized on x2's shape). Returns fresh tensors
    (rowwise data, columnwise data, rowwise scale storage, columnwise scale storage, the amax bits of each program as
    int32: their max is the tensor's), a copy not asked for as empty tensors. Given ``amax_into`` (int32 (1,)), the
    programs max-accumulate their amax bits into it instead (atomically) and the last output is ``amax_into``. The
    same bits as :func:`quantize_triton`."""
    from torch.library import wrap_triton

    x2 = x2.contiguous()  # (N-D as it came: the kernel reads rows of the last dim)
    # (a dynamic dim is specialized, a guard on its value: the configuration, grid and flags are fixed per shape)
    Kd = int(x2.shape[-1])
    M = int(x2.numel()) // Kd if Kd else 0
    plan, fn, grid, extra, tail = _wrapped_launch(M, Kd, x2.dtype, scheme, rowwise, columnwise, x2.device,
                                                  amax_into is None)
    dt, dev = scheme.format.torch_dtype, x2.device
    grids = torch.zeros if plan.padded else torch.empty  # (padding columns no kernel writes are zeros, as eager's)
    rq = torch.empty(M, Kd, dtype=dt, device=dev) if rowwise else None
    rs = grids(plan.rshape, dtype=torch.float32, device=dev) if rowwise else None
    cq = torch.empty(Kd, M, dtype=dt, device=dev) if columnwise else None
    cs = grids(plan.cshape, dtype=torch.float32, device=dev) if columnwise else None
    amax_i = torch.empty(math.prod(grid), dtype=torch.int32, device=dev) if amax_into is None else amax_into
    wrap_triton(fn)[grid](x2, *blockwise_args(plan, rq, rs, cq, cs, amax_i), *extra, **tail)

    def out(t, dtype):  # (a copy not asked for: an empty tensor, as the operator's schema returns one)
        return torch.empty(0, dtype=dtype, device=dev) if t is None else t

    return out(rq, dt), out(cq, dt), out(rs, torch.float32), out(cs, torch.float32), amax_i


def _mxfp8(qt, x2, sch: MXFP8, rowwise, columnwise):
    M, Kd = x2.shape
    fmt, dev = sch.format, x2.device
    amax_i = _amax_buffer(dev)
    rq = torch.empty(M, Kd, dtype=fmt.torch_dtype, device=dev) if rowwise else None
    rs = torch.empty(M, Kd // 32, dtype=torch.uint8, device=dev) if rowwise else None
    cq = torch.empty(Kd, M, dtype=fmt.torch_dtype, device=dev) if columnwise else None
    cs = torch.empty(Kd, M // 32, dtype=torch.uint8, device=dev) if columnwise else None
    # both copies of whole 128 x 128 tiles: the register-tile kernel first (quant_gluon.mxfp8_rowcol_regs)
    regs = regs_ok(x2, BLOCK_SIZE, False, rowwise, columnwise, "quant.mxfp8_rowcol_regs")
    cands = lambda: (list(_MX_REGS_CONFIGS) if regs else []) \
        + _configs([32, 64, 128], [32, 64, 128], [4, 8], M, Kd, min_m=32, min_k=32)  # noqa: E731
    rq_, rs_ = (rq, rs) if rowwise else (cq, cs)
    cq_, cs_ = (cq, cs) if columnwise else (rq, rs)

    def launch(c):
        if c.get("KIND") == "regs":
            QG.mxfp8_rowcol_regs[((M // 128) * (Kd // 128),)](x2, rq, rs, cq, cs, amax_i, M, Kd, EMAX=fmt.emax,
                                                               num_warps=8, maxnreg=c["maxnreg"], **_regs_layouts(8, 8))
            return
        grid = (cdiv(M, c["BM"]), cdiv(Kd, c["BK"]))
        K.mxfp8_kernel[grid](x2, rq_, rs_, cq_, cs_, amax_i, M, Kd, **_fmt_args(fmt), EMAX=fmt.emax, ROW=rowwise,
                             COL=columnwise, SW=SW_ROUND, BM=c["BM"], BK=c["BK"], num_warps=c["num_warps"])

    tuned_launch("mxfp8", (rowwise, columnwise, x2.dtype, regs, bucket(M), bucket(Kd)), cands, launch)
    amax = amax_i.view(torch.float32)
    if rowwise:
        qt.rowwise = QuantizedCopy(data=rq, scale_inv=rs, amax=amax)
    if columnwise:
        qt.columnwise = QuantizedCopy(data=cq, scale_inv=cs, amax=amax)  # one read, one amax: shared


def _nvfp4(qt, x2, sch: NVFP4, rowwise, columnwise, seed, *, amax_i: torch.Tensor | None = None,
           rht: bool = False):
    """One nvfp4_kernel launch for the asked copies. ``amax_i``: the amax (int32 bits) already computed, else an
    amax pass of x2 runs here. ``rht``: the columnwise copy (only) of RHT(x2); ``amax_i`` is then max |RHT(x2)|.
    ``seed``: the stochastic-rounding key, an int or a (1,) int64 device tensor holding it."""
    M, Kd = x2.shape
    dev = x2.device
    if amax_i is None:
        amax_i = _amax_buffer(dev)
        _launch_amax(x2, amax_i)
    gs = torch.empty(1, dtype=torch.float32, device=dev)
    rq = torch.empty(M, Kd // 2, dtype=torch.uint8, device=dev) if rowwise else None
    cq = torch.empty(Kd, M // 2, dtype=torch.uint8, device=dev) if columnwise else None
    if sch.two_d:
        rs = torch.empty(M // 16, Kd // 16, dtype=E4M3.torch_dtype, device=dev) if rowwise else None
        cs = torch.empty(Kd // 16, M // 16, dtype=E4M3.torch_dtype, device=dev) if columnwise else None
    else:
        rs = torch.empty(M, Kd // 16, dtype=E4M3.torch_dtype, device=dev) if rowwise else None
        cs = torch.empty(Kd, M // 16, dtype=E4M3.torch_dtype, device=dev) if columnwise else None
    min_m = 16 if (columnwise or sch.two_d) else 1

    def cands():
        return _configs([16, 32, 64] if min_m == 16 else [4, 16, 32, 64], [16, 32, 64, 128], [4, 8], M, Kd,
                        min_m=min_m, min_k=16)

    rq_, rs_ = (rq, rs) if rowwise else (cq, cs)
    cq_, cs_ = (cq, cs) if columnwise else (rq, rs)
    seed_ptr = isinstance(seed, torch.Tensor)  # (1,) int64 on the device
    if not seed_ptr:
        seed = int(seed) & 0xFFFFFFFFFFFFFFFF
        if seed >= 2**63:
            seed -= 2**64  # passed to the kernel as int64; the same 64 bits as the reference's key
    signs = int(sch.rht_signs) if rht else 0

    def launch(c):
        grid = (cdiv(M, c["BM"]), cdiv(Kd, c["BK"]))
        K.nvfp4_kernel[grid](x2, rq_, rs_, cq_, cs_, amax_i, gs, M, Kd, seed, signs, TWO_D=sch.two_d, ROW=rowwise,
                             COL=columnwise, SR=sch.stochastic_rounding, SW=SW_ROUND, BM=c["BM"], BK=c["BK"],
                             RHT=rht, SEED_PTR=seed_ptr, num_warps=c["num_warps"])

    tuned_launch("nvfp4", (sch.two_d, sch.stochastic_rounding, rowwise, columnwise, rht, x2.dtype, bucket(M),
                           bucket(Kd)), cands, launch)
    amax = amax_i.view(torch.float32)
    if rowwise:
        qt.rowwise = QuantizedCopy(data=rq, scale_inv=rs, amax=amax, global_scale=gs, rht=False)
    if columnwise:
        qt.columnwise = QuantizedCopy(data=cq, scale_inv=cs, amax=amax, global_scale=gs, rht=rht)  # one read: shared


def _nvfp4_rht(qt, x2, sch: NVFP4, rowwise, seed):
    """NVFP4 with the RHT: the columnwise copy quantizes RHT(x2) (along M, in registers; never written out) with
    its own amax max |RHT(x2)| and global scale; a rowwise copy quantizes x2 itself with max |x2|, as the
    reference does. One pass reads x2 once for both amaxes; then one quantize launch per copy."""
    M, Kd = x2.shape  # (M % 16 == K % 16 == 0 and 1x16 blocks: checked by quantize_triton)
    buf = torch.zeros(2, dtype=torch.int32, device=x2.device)  # one fill: [max |RHT(x)|, max |x|]
    amax_c, amax_r = buf[0:1], buf[1:2]
    cands = lambda: _configs([32, 64, 128], [64, 128], [4, 8], M, Kd, min_m=16, min_k=16)  # noqa: E731

    def launch(c):
        grid = (cdiv(M, c["BM"]), cdiv(Kd, c["BK"]))
        K.amax_rht_kernel[grid](x2, amax_c, amax_r, M, Kd, int(sch.rht_signs), PLAIN=rowwise, BM=c["BM"], BK=c["BK"],
                                num_warps=c["num_warps"])

    tuned_launch("amax_rht", (rowwise, x2.dtype, bucket(M), bucket(Kd)), cands, launch)
    if rowwise:
        _nvfp4(qt, x2, sch, True, False, seed, amax_i=amax_r)
    _nvfp4(qt, x2, sch, False, True, seed, amax_i=amax_c, rht=True)


quantize_triton.checked = lambda x, scheme, **kw: quantize_triton(x, scheme, _checked=True, **kw)  # see lowbit.quantize
register_backend("triton", supports, quantize_triton)
