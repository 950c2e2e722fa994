"""lowbit's CUDA backend for :func:`lowbit.gemm.scaled_mm`: registers ``"cuda"``.

Its kernel (``kernels/fp8_1d2d_sm90.py``) is CUDA C++ that NVRTC compiles at run time (``lowbit.runtime.nvrtc``: no
nvcc, no build step; the cubin is cached on disk) for the blockwise FP8 forward and data-gradient GEMMs: 1x128
activations or gradients against 128x128 weights, BF16 out.

What it takes (``supports``): an sm_90 GPU; A ``Float8Blockwise(block_dim=1)``, B ``Float8Blockwise(block_dim=2)``,
both E4M3 with 128-element blocks; K a multiple of 16 and N of 8 (TMA's 16-byte row pitch), K at most 131072 (B's
scales for a tile sit in shared memory); BF16 out with no epilogue (no bias, GELU, accumulation or ``out``); M at least
:data:`MIN_M` unless the call names this backend. Every other call goes to the next backend. ``LOWBIT_CUDA_GEMM=0``
turns it off.

Numerics: each 128-wide K block's sum is formed on the tensor cores and promoted into FP32 with both scales, as
NUMERICS §5 requires of a fast backend; the GPU test holds it to that section's bound and to the reference's bits where
every partial sum is exact.

Where the kernel cannot be built (no NVRTC library, a driver without TMA), lowbit warns once and this backend takes no
more calls; the call runs on the next backend. The first call on a device compiles (a fraction of a second; the cubin is
kept in the disk cache) and loads the kernel, so a first call inside a CUDA-graph capture runs on the next backend too.
Nothing here touches CUDA at import time.

Under ``torch.compile`` a traced fp8-block linear calls :func:`scaled_mm_traceable`, which puts this kernel in the
graph as the operator ``lowbit::fp8_gemm_1x128_128x128_bf16`` where this backend supports the call (see the section
at the end).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading

import torch

from ..quant.schemes import Float8Blockwise
from ..quant.tensor import cdiv
from ..runtime import env, nvrtc
from ..runtime.device import capability, num_sms
from ..runtime.log import declined, warn_once
from . import blockwise_1d2d_bf16, check_k_contiguous, forget_choices, gemm_dims, register_backend, run_after
from .kernels import fp8_1d2d_sm90 as K1D2D

__all__ = ["supports", "scaled_mm_cuda", "scaled_mm_traceable", "status", "MIN_M", "TILE"]

MIN_M = 4096
"""The fewest rows (tokens) a call needs for this backend to take it unasked: at 4096 the 350m and 1.3b GPT layers'
forward and data-gradient GEMMs ran 1.09x cuBLAS's blockwise ones summed, at 2048 1.00x (BENCHMARKS.md)."""

TILE = dict(block_m=256, block_n=128, stages=3, group_m=8, cluster=2)
"""The kernel's tile: ``block_m`` x ``block_n`` outputs a CTA, ``stages`` shared-memory stages, row-block groups of
``group_m``, ``cluster`` CTAs (side by side along N) sharing A's tile by TMA multicast."""

_MAX_DIM = 2**31 - 256  # (TMA coordinates and the kernel's sizes are 32-bit)

_lock = threading.Lock()
_state: dict = {}  # "kernel": the CudaKernel; "why": why the backend is off (a build that failed)


def _kernel() -> nvrtc.CudaKernel:
    k = _state.get("kernel")
    if k is None:
        with _lock:
            k = _state.get("kernel")
            if k is None:
                k = nvrtc.CudaKernel(K1D2D.source(**TILE), K1D2D.KERNEL_NAME, "sm_90a",
                                     shared_bytes=K1D2D.shared_bytes(TILE["block_m"], TILE["block_n"], TILE["stages"]))
                _state["kernel"] = k
    return k


def status(device=None) -> str:
    """One line for ``lowbit info``: whether this backend runs on ``device`` (default: the current CUDA device)."""
    if not env.get("LOWBIT_CUDA_GEMM"):
        return "off (LOWBIT_CUDA_GEMM=0)"
    if "why" in _state:
        return f"off: {_state['why']}"
    if device is None:
        if not torch.cuda.is_available():
            return "not used: no CUDA device"
        device = torch.device("cuda")
    if device.type != "cuda":
        return f"not used: {device} is not a CUDA device"
    if not _on_sm90(device):
        return f"not used: its kernel is sm_90's, this GPU is sm_{''.join(map(str, capability(device)))}"
    return f"1x128 x 128x128 blockwise FP8, BF16 out, no epilogue, M >= {MIN_M} (NVRTC, cached in {nvrtc.cache_dir()})"


def _on_sm90(device) -> bool:
    return device.type == "cuda" and capability(device) == (9, 0)


def _k_fits(K: int) -> bool:
    """Whether B's scales for a tile of a K-long contraction fit the kernel's shared memory."""
    return cdiv(K, K1D2D.BLOCK_K) <= K1D2D.MAX_K_BLOCKS


def _takes(a_scheme, b_scheme, M: int, N: int, K: int, device, opts) -> bool:
    """The module docstring's rules for a call of these schemes and dims on ``device``."""
    if "why" in _state or not blockwise_1d2d_bf16(a_scheme, b_scheme, opts) or not env.get("LOWBIT_CUDA_GEMM"):
        return False
    if K % 16 or N % 8 or M == 0 or N == 0 or K == 0 or max(M, N) >= _MAX_DIM or not _k_fits(K):
        return False
    if M < MIN_M and not opts.get("forced"):
        return False
    return _on_sm90(device)


def supports(a, b, a_copy, b_copy, opts) -> bool:
    """The calls this backend takes (the module docstring's rules)."""
    return a.device == b.device and _takes(a.scheme, b.scheme, *gemm_dims(a, b, a_copy, b_copy), a.device, opts)


def _row_pitch(t: torch.Tensor) -> int:
    """Elements between rows of a 2D grid (torch gives a one-row tensor any row stride)."""
    return t.stride(0) if t.shape[0] > 1 else t.shape[1]


def _aligned(*ts) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in ts)


def _launch(A: torch.Tensor, B: torch.Tensor, SA: torch.Tensor, SB: torch.Tensor) -> torch.Tensor | None:
    """``A · Bᵀ`` (BF16) by the kernel from A (M, K) and B (N, K) E4M3, row-major, A's scales stored (K / 128, M...)
    and B's (N / 128, K / 128...), both with unit column stride; None where the kernel declines this call (the
    reason logged by :func:`lowbit.runtime.log.declined`; a kernel that cannot be built turns the backend off)."""
    if not _aligned(A, B, SA):
        declined("cuda", "operand data or scales not 16-byte aligned")
        return None
    if (SA.shape[1] > 1 and SA.stride(1) != 1) or (SB.shape[1] > 1 and SB.stride(1) != 1) or _row_pitch(SA) % 4:
        declined("cuda", "scale grids with strided rows, or A's rows not 16 bytes apart")
        return None
    if not _k_fits(A.shape[1]):  # (the operator called directly: _takes not asked)
        declined("cuda", f"K = {A.shape[1]}: more than {K1D2D.MAX_K_BLOCKS} K blocks of B's scales for shared memory")
        return None
    if A.is_cuda and A.device.index != torch.cuda.current_device():
        with torch.cuda.device(A.device):
            return _launch(A, B, SA, SB)
    (M, Kd), N = A.shape, B.shape[0]
    y = torch.empty(M, N, device=A.device, dtype=torch.bfloat16)
    bm, bk, bn, cl = TILE["block_m"], K1D2D.BLOCK_K, TILE["block_n"], TILE["cluster"]
    try:
        kernel = _kernel()
        if A.is_cuda and torch.cuda.is_current_stream_capturing() and not kernel.loaded(A.device.index):
            declined("cuda", "the kernel's first call on this device inside a CUDA-graph capture (no compile there)")
            return None
        args = [
            nvrtc.tensor_map_2d(A, nvrtc.U8, M, Kd, Kd, bm // cl, bk, nvrtc.SWIZZLE_128B),
            nvrtc.tensor_map_2d(B, nvrtc.U8, N, Kd, Kd, bn, bk, nvrtc.SWIZZLE_128B),
            nvrtc.tensor_map_2d(SA, nvrtc.F32, cdiv(Kd, bk), M, _row_pitch(SA) * 4, 1, bm, nvrtc.SWIZZLE_NONE),
            nvrtc.tensor_map_2d(y, nvrtc.BF16, M, N, N * 2, bm, 64, nvrtc.SWIZZLE_128B),
            ctypes.c_void_p(SB.data_ptr()),
            ctypes.c_int(M), ctypes.c_int(N), ctypes.c_int(Kd), ctypes.c_int(_row_pitch(SB)),
        ]
        tiles = cdiv(M, bm) * cdiv(N, bn * cl)  # (of cl CTAs each)
        kernel.launch(A.device, (min(tiles, num_sms(A.device) // cl) * cl, 1, 1), K1D2D.THREADS, args, cluster=cl)
    except nvrtc.KernelUnavailable as e:
        _state["why"] = str(e).splitlines()[0]
        warn_once(f"lowbit: the CUDA GEMM kernel is unavailable ({_state['why']}); blockwise GEMMs run on the next "
                  "backend (cuBLAS, or lowbit's Gluon / Triton kernel)")
        forget_choices()
        return None
    return y


def scaled_mm_cuda(a, b, *, a_copy, b_copy, out_dtype, bias=None, gelu=False, accumulate=False, out=None):
    """``A · Bᵀ`` in BF16 through the 1x128 · 128x128 kernel (see :func:`lowbit.gemm.scaled_mm`); returns
    ``(y, None)``. Operands whose data or scales are not 16-byte aligned (views into a larger buffer) run on the next
    backend."""
    ca, cb = getattr(a, a_copy), getattr(b, b_copy)
    check_k_contiguous("a", a_copy, ca.data, "cuda")
    check_k_contiguous("b", b_copy, cb.data, "cuda")
    y = _launch(ca.data, cb.data, ca.scale_inv, cb.scale_inv)
    if y is None:
        with torch.cuda.device(ca.data.device) if ca.data.is_cuda else contextlib.nullcontext():
            return run_after("cuda", a, b, a_copy=a_copy, b_copy=b_copy, out_dtype=out_dtype, bias=bias, gelu=gelu,
                             accumulate=accumulate, out=out)
    return y, None


register_backend("cuda", supports, scaled_mm_cuda)


# ------------------------------------------------------------------------------------------------
# The traced call (torch.compile)
# ------------------------------------------------------------------------------------------------
# A compiled fp8-block linear holds its GEMMs as calls on plain tensors (lowbit.nn.functional's traced linear). Where
# this backend supports a call (supports' rules, DeepGEMM aside: where it is installed, eager runs it first), the graph
# calls the kernel as the operator below; elsewhere, cuBLAS's aten calls (lowbit.gemm.cublas.scaled_mm_cublas_traceable,
# imported where called: importing it here would register cuBLAS ahead of this backend). The operator answers a call
# the kernel declines at run time (a first call inside a CUDA-graph capture, an unaligned or strided view, a kernel
# that cannot be built) with cuBLAS, whose bits the GPU test checks are the kernel's on the layer shapes. Whether the
# backend is on is read when the graph is traced: a kernel that fails to build recompiles the graphs that held it. The
# operator is defined with torch.library.Library, whose call reaches the Python kernel directly
# (torch.library.custom_op's wrappers cost about 9 us of host time a call).
_LIB = torch.library.Library("lowbit", "FRAGMENT")
_LIB.define("fp8_gemm_1x128_128x128_bf16(Tensor a, Tensor b, Tensor a_scale_inv, Tensor b_scale_inv) -> Tensor",
            tags=(torch.Tag.pt2_compliant_tag,))

_ACT, _WEIGHT = Float8Blockwise(block_dim=1), Float8Blockwise(block_dim=2)


def _cublas_traced(a, b, a_scale_inv, b_scale_inv) -> torch.Tensor:
    from .cublas import scaled_mm_cublas_traceable

    return scaled_mm_cublas_traceable(a, b, a_scale_inv, b_scale_inv, a_scheme=_ACT, b_scheme=_WEIGHT,
                                      out_dtype=torch.bfloat16)


def _gemm_op(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor) -> torch.Tensor:
    """``a · bᵀ`` in BF16: a (M, K) and b (N, K) E4M3, row-major; their scales in the logical layouts of
    :meth:`lowbit.quant.QuantizedTensor.logical_scales`, a's (M, K / 128) per 1x128 segment, b's (N / 128, K / 128)
    per 128x128 block."""
    if "why" in _state or not (a.is_contiguous() and b.is_contiguous()):
        return _cublas_traced(a, b, a_scale_inv, b_scale_inv)
    sa, sb = a_scale_inv.t(), b_scale_inv
    if sa.shape[1] > 1 and sa.stride(1) != 1:  # (a logical grid stored row-major: the kernel reads it K-block-major)
        sa = sa.contiguous()
    if sb.shape[1] > 1 and sb.stride(1) != 1:
        sb = sb.contiguous()
    y = _launch(a, b, sa, sb)
    return _cublas_traced(a, b, a_scale_inv, b_scale_inv) if y is None else y


_LIB.impl("fp8_gemm_1x128_128x128_bf16", _gemm_op, "CompositeExplicitAutograd")


@torch.library.register_fake("lowbit::fp8_gemm_1x128_128x128_bf16", lib=_LIB)
def _(a, b, a_scale_inv, b_scale_inv):
    return a.new_empty(a.shape[0], b.shape[0], dtype=torch.bfloat16)


def scaled_mm_traceable(A: torch.Tensor, B: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, *, a_scheme, b_scheme,
                        out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``A · Bᵀ (+ bias)`` in calls a compiled graph holds: this backend's operator where the backend supports the
    call (as eager runs it where DeepGEMM is not installed), else :func:`lowbit.gemm.cublas.scaled_mm_cublas_traceable`
    (whose arguments these are)."""
    (M, K), N = A.shape, B.shape[0]
    if _takes(a_scheme, b_scheme, M, N, K, A.device, dict(out_dtype=out_dtype, bias=bias)):
        return torch.ops.lowbit.fp8_gemm_1x128_128x128_bf16(A, B, sa, sb)
    from .cublas import scaled_mm_cublas_traceable

    return scaled_mm_cublas_traceable(A, B, sa, sb, a_scheme=a_scheme, b_scheme=b_scheme, out_dtype=out_dtype,
                                      bias=bias)
