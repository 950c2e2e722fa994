"""The shared-memory carveout of lowbit's Triton and Gluon kernels: the whole unified L1 as shared memory.

An SM's 256 KB of unified L1 / shared memory is split by a *carveout* that the driver chooses per launch from the
kernel's preference. Triton asks for the shared-memory-heavy split only for kernels that need more than 48 KB
(``cuFuncSetCacheConfig(PREFER_SHARED)`` in its loader); every other Triton kernel (the register-tile quantizers,
RoPE, the residual adds, the norm backward) has no preference, and the driver gives it a split with more L1. The
cuBLAS and cuDNN kernels that follow them in a training step want the largest shared memory, so the SMs are
reconfigured between the two: the GPU drains and stalls for ~9-10 us before each such GEMM or attention kernel
(H200, 2026-11-25: 1.3b fp8-block step, 123 Triton -> cuBLAS/cuDNN transitions on the main stream at 8.9-9.9 us each,
against 0.3-0.6 us between any other pair of kernels; BENCHMARKS.md session 29).

:func:`install` registers a Triton kernel-load hook that sets ``CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT``
on every kernel defined in a ``lowbit`` module as it is loaded (other code's Triton kernels are left alone). It is
a preference, not a requirement: a kernel's results do not depend on it. ``LOWBIT_SMEM_CARVEOUT`` sets the
percentage (default 100: all shared memory; ``off`` leaves the driver's default, for A/B runs).
"""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["install", "carveout_percent", "lowbit_kernel_names"]

CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9  # (CUfunction_attribute in cuda.h)

_STATE: dict = {"lib": None, "names": None, "set": 0, "failed": 0}


def carveout_percent() -> int | None:
    """The carveout asked for, from ``LOWBIT_SMEM_CARVEOUT``: an integer percentage 0-100 (default 100), or None
    (``off``: leave the driver's choice)."""
    raw = os.environ.get("LOWBIT_SMEM_CARVEOUT", "100").strip().lower()
    if raw in ("off", "none", "default", ""):
        return None
    try:
        v = int(raw)
    except ValueError:
        raise ValueError(f"LOWBIT_SMEM_CARVEOUT: expected an integer percentage 0-100 or 'off', got {raw!r}") from None
    if not 0 <= v <= 100:
        raise ValueError(f"LOWBIT_SMEM_CARVEOUT: expected an integer percentage 0-100 or 'off', got {raw!r}")
    return v


def lowbit_kernel_names() -> set:
    """Names of the Triton / Gluon kernels defined in the ``lowbit`` modules imported so far (autotuned or heuristic
    wrappers unwrapped)."""
    try:
        from triton.runtime.jit import JITFunction
    except Exception:  # noqa: BLE001
        return set()
    names = set()
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not (mod_name == "lowbit" or mod_name.startswith("lowbit.")):
            continue
        for v in list(vars(mod).values()):
            for _ in range(4):  # Autotuner / Heuristics keep the kernel as .fn
                if isinstance(v, JITFunction):
                    names.add(getattr(v, "__name__", None) or v.fn.__name__)
                    break
                v = getattr(v, "fn", None)
                if v is None:
                    break
    return names


def _libcuda():
    if _STATE["lib"] is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        lib.cuFuncSetAttribute.restype = ctypes.c_int
        lib.cuFuncGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_void_p]
        lib.cuFuncGetAttribute.restype = ctypes.c_int
        _STATE["lib"] = lib
    return _STATE["lib"]


def _on_load(module, function, name, metadata_group, hash):  # noqa: A002 - Triton's hook signature
    """Triton's ``kernel_load_end_hook``: the carveout preference on a lowbit kernel just loaded."""
    pct = carveout_percent()
    if pct is None or not function:
        return
    names = _STATE["names"]
    if names is None or name not in names:  # (a module imported since the last scan)
        names = _STATE["names"] = lowbit_kernel_names()
        if name not in names:
            return
    rc = _libcuda().cuFuncSetAttribute(ctypes.c_void_p(int(function)), CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                                       pct)
    # a preference only: a driver that refuses it runs the kernel with its own choice, same results
    _STATE["set" if rc == 0 else "failed"] += 1


def function_carveout(function) -> int:
    """The carveout preference set on a loaded kernel (a ``CompiledKernel.function`` handle; -1: none). Diagnostics
    and tests."""
    v = ctypes.c_int(0)
    rc = _libcuda().cuFuncGetAttribute(ctypes.byref(v), CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                                       ctypes.c_void_p(int(function)))
    if rc != 0:
        raise RuntimeError(f"cuFuncGetAttribute(PREFERRED_SHARED_MEMORY_CARVEOUT) failed: CUresult {rc}")
    return v.value


def install() -> bool:
    """Register the kernel-load hook (once; idempotent). False where this Triton has no load hooks."""
    try:
        from triton import knobs

        chain = knobs.runtime.kernel_load_end_hook
        chain.add  # noqa: B018 - attribute probe: a HookChain (Triton >= 3.5)
    except Exception:  # noqa: BLE001
        return False
    chain.add(_on_load)
    return True
