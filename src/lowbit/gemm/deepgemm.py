"""DeepGEMM backend for :func:`lowbit.gemm.scaled_mm`: registers ``"deepgemm"``, ahead of cuBLAS.

Where the ``deep_gemm`` package imports (it is built from source: ``tools/deepgemm_build.sh``), its SM90 "1D2D"
kernel takes the blockwise FP8 forward and data-gradient GEMMs of training-sized token counts: 1x128 activations or
gradients against 128x128 weights, BF16 out. It was faster than cuBLAS's blockwise kernel on every such GEMM of the
350m and 1.3b GPTs, and made their fp8-block training steps faster (H200, BENCHMARKS.md).

What it takes (``supports``): an sm_90 GPU; A ``Float8Blockwise(block_dim=1)``, B ``Float8Blockwise(block_dim=2)``,
both E4M3 with 128-element blocks; K a multiple of 128 and N of 8 (its TMA rows are 16-byte aligned); BF16 out with no
epilogue (no bias, GELU, accumulation or ``out``); M at least :data:`MIN_M` unless the call names this backend. Every
other call goes to the next backend. ``LOWBIT_DEEPGEMM=0`` turns it off.

Numerics: DeepGEMM forms each 128-wide K block's sum on the tensor cores and promotes it into FP32 with both scales,
as NUMERICS §5 requires of a fast backend; the GPU test holds it to that section's bound and to the reference's bits
where every partial sum is exact. It sums in another order than cuBLAS, so a linear that ``torch.compile`` traces
(its GEMMs stay cuBLAS's) agrees with eager to that bound, not bit for bit.

Operands go in as lowbit stores them: the 1x128 scales' stored layout, (K/128, pad4(rows)), is already the MN-major,
TMA-aligned one DeepGEMM reads; a 128x128 grid whose K/128 is not a multiple of 4 is stored with padded rows, so that
grid (N/128 x K/128 floats) is copied to a packed one first. DeepGEMM compiles a kernel for each new GEMM shape (its
tile choice depends on M too) the first time it sees it: that call takes seconds (the process's first one prints a
notice; ``LOWBIT_LOG=info`` names each shape). A shape first seen inside a CUDA-graph capture runs on the next backend
instead (no compile during a capture; cuBLAS, or the Gluon / Triton kernel where cuBLAS does not take the call). Where
DeepGEMM raises for a shape (a kernel that cannot compile: no nvcc, say), lowbit warns once, answers the call with the
next backend and sends that (N, K) there from then on; out-of-memory and CUDA errors propagate. Nothing here touches
CUDA or imports ``deep_gemm`` at import time.
"""

from __future__ import annotations

import importlib
import sys
import threading

import torch

from ..quant.schemes import BLOCK_SIZE
from ..runtime import env
from ..runtime.device import capability
from ..runtime.log import declined, info, warn_once
from . import (
    blockwise_1d2d_bf16,
    check_k_contiguous,
    forget_choices,
    gemm_dims,
    not_capability,
    register_backend,
    run_after,
)

__all__ = ["supports", "scaled_mm_deepgemm", "status", "RECIPE", "MIN_M"]

RECIPE = (1, 128, 128)
"""DeepGEMM's scaling recipe for the pairing it takes: one A scale per row and 128 K-elements, one B scale per 128x128
block."""

MIN_M = 8192
"""The fewest rows (tokens) a call needs for DeepGEMM to take it unasked: the smallest M it was measured faster at. Each
new M may compile another kernel, which a decode or prefill loop of varying sizes would keep paying for."""

_lock = threading.Lock()
_loaded: dict = {}  # "module": the deep_gemm module or None; "why": why it is not used
_compiled: set = set()  # (device index, M, N, K) this process has launched: a new one may make DeepGEMM compile
_failed: dict = {}  # (device index, N, K) -> the error DeepGEMM raised for it: such calls go to the next backend


def _module():
    """``deep_gemm`` if it imports and has the API this backend calls (``fp8_fp4_gemm_nt``), else None; tried once.
    A package that is installed but fails to import (a build for another torch or CUDA) is warned about once."""
    if "module" in _loaded:
        return _loaded["module"]
    with _lock:
        if "module" in _loaded:
            return _loaded["module"]
        mod, why = None, ""
        try:
            mod = importlib.import_module("deep_gemm")
        except ModuleNotFoundError:
            why = "the deep_gemm package is not installed (tools/deepgemm_build.sh builds it)"
        except Exception as e:  # noqa: BLE001 - a broken build must not break lowbit: say so, use the next backend
            why = f"deep_gemm is installed but does not import: {type(e).__name__}: {e}"
            warn_once(f"lowbit: {why}; the blockwise GEMMs run on cuBLAS instead")
        if mod is not None and not callable(getattr(mod, "fp8_fp4_gemm_nt", None)):
            why = (f"deep_gemm {getattr(mod, '__version__', '(no version)')} has no fp8_fp4_gemm_nt (lowbit calls "
                   "the API of DeepGEMM 2.x)")
            mod = None
        _loaded["module"], _loaded["why"] = mod, why
        return mod


def status(device=None) -> str:
    """One line for ``lowbit info``: whether this backend runs on ``device`` (default: the current CUDA device), and
    why not."""
    if not env.get("LOWBIT_DEEPGEMM"):
        return "off (LOWBIT_DEEPGEMM=0)"
    if _module() is None:
        return f"not used: {_loaded['why']}"
    if device is None:
        if not torch.cuda.is_available():
            return "not used: no CUDA device"
        device = torch.device("cuda")
    if not _on_sm90(device):
        return f"not used: its kernels are sm_90's, this GPU is sm_{''.join(map(str, capability(device)))}"
    return (f"1x128 x 128x128 blockwise FP8, BF16 out, no epilogue, M >= {MIN_M} (fprop, dgrad of training-sized "
            f"token counts; fewer when named): DeepGEMM {getattr(_module(), '__version__', '')}".rstrip())


def _on_sm90(device) -> bool:
    return device.type == "cuda" and capability(device) == (9, 0)


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def supports(a, b, a_copy, b_copy, opts) -> bool:
    """The calls this backend takes (the module docstring's rules); checks the cheap rules before importing."""
    if not blockwise_1d2d_bf16(a.scheme, b.scheme, opts):
        return False
    M, N, K = gemm_dims(a, b, a_copy, b_copy)
    if K % BLOCK_SIZE or N % 8 or not env.get("LOWBIT_DEEPGEMM") or (a.device.index, N, K) in _failed:
        return False
    if M < MIN_M and not opts.get("forced"):
        return False
    return _on_sm90(a.device) and _on_sm90(b.device) and _module() is not None


def scaled_mm_deepgemm(a, b, *, a_copy, b_copy, out_dtype, bias=None, gelu=False, accumulate=False, out=None):
    """``A · Bᵀ`` in BF16 through DeepGEMM's 1D2D kernel (see :func:`lowbit.gemm.scaled_mm`); returns ``(y, None)``.
    A call it cannot take once it runs (data not 16-byte aligned: a view into a larger buffer; a new shape inside a
    CUDA-graph capture; a shape DeepGEMM raised for) runs on the next backend."""
    kw = dict(a_copy=a_copy, b_copy=b_copy, out_dtype=out_dtype, bias=bias, gelu=gelu, accumulate=accumulate, out=out)
    A, B = getattr(a, a_copy).data, getattr(b, b_copy).data
    check_k_contiguous("a", a_copy, A, "DeepGEMM")
    check_k_contiguous("b", b_copy, B, "DeepGEMM")
    if A.data_ptr() % 16 or B.data_ptr() % 16:
        declined("deepgemm", "operand data not 16-byte aligned")
        return run_after("deepgemm", a, b, **kw)
    (M, K), N = A.shape, B.shape[0]
    key = (A.device.index, M, N, K)
    if key not in _compiled:
        if _capturing(A):
            declined("deepgemm", "a GEMM shape first seen inside a CUDA-graph capture (DeepGEMM would compile there)")
            return run_after("deepgemm", a, b, **kw)
        if not _compiled:
            print("[lowbit] DeepGEMM runs the blockwise FP8 forward / data-gradient GEMMs; it compiles a kernel for "
                  "each new GEMM shape on first use (nvcc, seconds each; kept in its disk cache after). "
                  "LOWBIT_LOG=info names each, LOWBIT_DEEPGEMM=0 turns DeepGEMM off", file=sys.stderr, flush=True)
        _compiled.add(key)
        info("DeepGEMM: first call with M=%d, N=%d, K=%d on %s (it compiles a kernel for it unless cached)", M, N, K,
             A.device)
    sfb = b.logical_scales(b_copy)
    if sfb.stride() != (sfb.shape[1], 1):
        # K/128 not a multiple of 4: the stored grid's rows are padded. (A clone, not .contiguous(): torch calls a
        # one-row grid contiguous whatever its row stride, and DeepGEMM checks the strides.)
        sfb = sfb.clone(memory_format=torch.contiguous_format)
    y = torch.empty(M, N, device=A.device, dtype=torch.bfloat16)
    try:
        _module().fp8_fp4_gemm_nt((A, a.logical_scales(a_copy)), (B, sfb), y, recipe=RECIPE, disable_ue8m0_cast=True)
    except RuntimeError as e:  # (DeepGEMM's own errors, a failed kernel compile among them, arrive as RuntimeError)
        if not_capability(e):
            raise
        _failed[(A.device.index, N, K)] = why = f"{type(e).__name__}: {str(e)[:400]}"
        warn_once(f"lowbit: DeepGEMM failed on a GEMM with N={N}, K={K} ({why}); GEMMs of this N and K run on the "
                  "next backend (cuBLAS, or lowbit's Gluon / Triton kernel) from now on")
        forget_choices()  # the dispatcher's memo re-asks supports(), which now declines this (N, K)
        return run_after("deepgemm", a, b, **kw)
    return y, None


register_backend("deepgemm", supports, scaled_mm_deepgemm)
