"""CUDA C++ kernels compiled at run time with NVRTC, cached on disk, launched through the CUDA driver.

Users need nothing beyond ``pip install``: NVRTC comes with the CUDA build of torch (the ``nvidia-cuda-nvrtc`` wheel)
and the driver with the GPU; no nvcc, no build step. :func:`compile_cubin` turns a source into a cubin for one
architecture and keeps it under :func:`cache_dir`, keyed by the source, the options, the architecture and NVRTC's
version; :class:`CudaKernel` loads it once per device and launches it on torch's current stream (CUDA-graph capture
included). :func:`tensor_map_2d` encodes a TMA descriptor for a 2D tensor.

Where a piece is missing (no NVRTC library, a driver without the entry points, a source NVRTC rejects) the error is a
:class:`KernelUnavailable` naming it; callers that have another backend catch it and use that one. Nothing here loads
a library or touches CUDA at import time.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import hashlib
import os
import sys
import tempfile
import threading
from pathlib import Path

import torch

from . import env

__all__ = ["KernelUnavailable", "cache_dir", "compile_cubin", "nvrtc_version", "CudaKernel", "tensor_map_2d",
           "U8", "F32", "BF16", "SWIZZLE_NONE", "SWIZZLE_128B"]


class KernelUnavailable(RuntimeError):
    """A run-time-compiled kernel cannot be built or loaded here; the message says what is missing."""


_lock = threading.Lock()
_libs: dict = {}

# cuTensorMapEncodeTiled's enums (cuda.h)
U8, F32, BF16 = 0, 7, 9
"""Element types of :func:`tensor_map_2d`: unsigned bytes (FP8 codes), float32, bfloat16."""
SWIZZLE_NONE, SWIZZLE_128B = 0, 3
"""Shared-memory swizzles of :func:`tensor_map_2d`."""
_L2_256B = 3
_CUDA_ERROR_INVALID_IMAGE = (200, 209, 218, 222)  # invalid image / no binary for GPU / invalid PTX / unsupported PTX
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
_CUDA_ERROR_OUT_OF_MEMORY = 2


def _nvrtc():
    """The NVRTC library: the soname of torch's CUDA major version (already loaded, or on the loader's path), else
    the copy an ``nvidia-*`` wheel installed under a ``sys.path`` entry."""
    if "nvrtc" in _libs:
        return _libs["nvrtc"]
    major = (torch.version.cuda or "13").split(".")[0]
    names = [f"libnvrtc.so.{major}", "libnvrtc.so"]
    for base in sys.path:
        names += sorted(glob.glob(os.path.join(base, "nvidia", "*", "lib", f"libnvrtc.so.{major}*")))
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        raise KernelUnavailable(f"NVRTC (libnvrtc.so.{major}) was not found: lowbit compiles its CUDA kernels at run "
                                f"time with it; pip install nvidia-cuda-nvrtc (the CUDA {major} build of torch "
                                "normally brings it)")
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    _libs["nvrtc"] = lib
    return lib


def _cuda():
    if "cuda" not in _libs:
        try:
            _libs["cuda"] = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise KernelUnavailable(f"the CUDA driver library (libcuda.so.1) did not load: {e}") from None
    return _libs["cuda"]


def _bind_primary_context(index: int) -> None:
    """Make device ``index``'s primary context (the one torch uses) current on this thread if no context is."""
    cu = _cuda()
    ctx = ctypes.c_void_p()
    _check_cu(cu.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if not ctx.value:
        dev = ctypes.c_int()
        _check_cu(cu.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
        _check_cu(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        _check_cu(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def _check_cu(res: int, what: str) -> None:
    if res == _CUDA_ERROR_OUT_OF_MEMORY:
        raise torch.OutOfMemoryError(f"CUDA out of memory in {what}")
    if res:
        msg = ctypes.c_char_p()
        _cuda().cuGetErrorString(res, ctypes.byref(msg))
        text = msg.value.decode(errors="replace") if msg.value else "unknown error"
        raise RuntimeError(f"CUDA driver error {res} in {what}: {text}")


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library in use."""
    lib = _nvrtc()
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


def cache_dir() -> Path:
    """Where compiled kernels are kept: ``$LOWBIT_CACHE/kernels``, else ``$XDG_CACHE_HOME/lowbit/kernels``, else
    ``~/.cache/lowbit/kernels``."""
    return env.cache_root() / "kernels"


def _compile(source: str, name: str, options: list[str]) -> tuple[bytes, str]:
    lib = _nvrtc()

    def check(res, what):
        if res:
            raise KernelUnavailable(f"NVRTC {what} failed for {name}: {lib.nvrtcGetErrorString(res).decode()}")

    prog = ctypes.c_void_p()
    check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None),
          "nvrtcCreateProgram")
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        res = lib.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        log_text = log.value.decode(errors="replace")
        if res:
            raise KernelUnavailable(f"NVRTC could not compile {name} ({' '.join(options)}):\n{log_text}")
        check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        check(lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin.raw, log_text
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def compile_cubin(source: str, name: str, arch: str, options: tuple[str, ...] = (), *, cache: bool = True,
                  fresh: bool = False) -> tuple[bytes, str]:
    """``(cubin, log)`` of ``source`` compiled by NVRTC for ``arch`` (e.g. ``"sm_90a"``) with ``options``; ``name``
    names the program in messages and the cache file. With ``cache``, a cubin cached on disk under the same key is
    returned with an empty log (unless ``fresh``: a cached file the driver rejected), and a new one is written there
    atomically (a cache that cannot be written is skipped). Raises :class:`KernelUnavailable` with NVRTC's log when
    the source does not compile."""
    opts = [f"--gpu-architecture={arch}", "-std=c++17", *options]
    key = hashlib.sha256("\0".join([source, *opts, repr(nvrtc_version())]).encode()).hexdigest()[:32]
    path = cache_dir() / f"{name}-{key}.cubin"
    if cache and not fresh:
        try:
            data = path.read_bytes()
        except OSError:  # not there, or not readable (another user's cache): compile
            data = b""
        if data:
            return data, ""
    cubin, log = _compile(source, name, opts)
    if cache:
        _write_atomic(path, cubin)
    return cubin, log


def _write_atomic(path: Path, data: bytes) -> None:
    """``data`` into ``path`` through a temporary file renamed over it (readers see the old file or the new one),
    readable by others as a plain file would be; a cache that cannot be written is skipped."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


class _LaunchAttr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_uint32 * 16)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttr)), ("numAttrs", ctypes.c_uint)]


class CudaKernel:
    """One ``extern "C"`` kernel of a source, compiled for ``arch`` and loaded on first use on each device.

    Args:
        source: CUDA C++ text (no includes beyond NVRTC's built-in headers).
        name: the kernel's ``extern "C"`` name (and the cache file's prefix).
        arch: NVRTC's ``--gpu-architecture``, e.g. ``"sm_90a"``.
        options: more NVRTC options.
        shared_bytes: dynamic shared memory of every launch (the kernel's limit is raised to it once per device).
    """

    def __init__(self, source: str, name: str, arch: str, options: tuple[str, ...] = (), shared_bytes: int = 0):
        self.source, self.name, self.arch, self.options = source, name, arch, tuple(options)
        self.shared_bytes = shared_bytes
        self._fn: dict[int, ctypes.c_void_p] = {}

    def loaded(self, index: int) -> bool:
        """Whether the kernel is loaded on CUDA device ``index`` (a launch there compiles and loads nothing)."""
        return index in self._fn

    def cubin(self, fresh: bool = False) -> bytes:
        """The compiled kernel (from the disk cache unless ``fresh``: see :func:`compile_cubin`)."""
        return compile_cubin(self.source, self.name, self.arch, self.options, fresh=fresh)[0]

    def _load(self, index: int) -> ctypes.c_void_p:
        with _lock:
            if index in self._fn:
                return self._fn[index]
            try:
                fn = self._load_on(index)
            except (RuntimeError, AttributeError) as e:  # (a driver without the entry points, an image it rejects)
                if isinstance(e, (KernelUnavailable, torch.OutOfMemoryError)):
                    raise
                raise KernelUnavailable(f"the CUDA driver did not load {self.name}: {e}") from e
            self._fn[index] = fn
            return fn

    def _load_on(self, index: int) -> ctypes.c_void_p:
        cu = _cuda()
        with torch.cuda.device(index):
            _bind_primary_context(index)
            module = ctypes.c_void_p()
            cubin = self.cubin()
            res = cu.cuModuleLoadData(ctypes.byref(module), cubin)
            if res in _CUDA_ERROR_INVALID_IMAGE:  # a corrupted cache file: compile afresh and rewrite it
                cubin = self.cubin(fresh=True)
                res = cu.cuModuleLoadData(ctypes.byref(module), cubin)
            _check_cu(res, f"cuModuleLoadData({self.name})")
            fn = ctypes.c_void_p()
            _check_cu(cu.cuModuleGetFunction(ctypes.byref(fn), module, self.name.encode()),
                      f"cuModuleGetFunction({self.name})")
            if self.shared_bytes:
                _check_cu(cu.cuFuncSetAttribute(fn, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                self.shared_bytes), f"cuFuncSetAttribute({self.name})")
        return fn

    def launch(self, device: torch.device, grid: tuple[int, int, int], block: int, args: list,
               cluster: int = 1) -> None:
        """Launch on ``device``'s current torch stream. ``args``: ctypes objects in the kernel's parameter order
        (``ctypes.c_void_p`` for pointers, ``ctypes.c_int`` for ints, a :func:`tensor_map_2d` buffer for a
        ``__grid_constant__`` descriptor). ``cluster``: CTAs per cluster along x (1: none)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        if torch.cuda.current_device() != index:  # (the driver launches into the current context)
            with torch.cuda.device(index):
                return self.launch(device, grid, block, args, cluster)
        fn = self._fn.get(index) or self._load(index)
        params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        cfg = _LaunchConfig(grid[0], grid[1], grid[2], block, 1, 1, self.shared_bytes,
                            torch.cuda.current_stream(index).cuda_stream, None, 0)
        if cluster > 1:
            attr = _LaunchAttr(_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, 0)
            attr.value[0], attr.value[1], attr.value[2] = cluster, 1, 1
            cfg.attrs, cfg.numAttrs = ctypes.pointer(attr), 1
        _check_cu(_cuda().cuLaunchKernelEx(ctypes.byref(cfg), fn, params, None), f"cuLaunchKernelEx({self.name})")


_TMAP = ctypes.c_uint64 * 16
_TMAPS: dict = {}  # encoded descriptors by what they encode: a call on the same buffers skips the driver


def tensor_map_2d(t: torch.Tensor, dtype: int, rows: int, cols: int, row_stride_bytes: int, box_rows: int,
                  box_cols: int, swizzle: int) -> ctypes.Array:
    """A TMA descriptor (``CUtensorMap``, 128 bytes) of the ``rows`` x ``cols`` matrix at ``t.data_ptr()`` whose
    rows are ``row_stride_bytes`` apart (a multiple of 16), read or written in ``box_rows`` x ``box_cols`` boxes;
    out-of-bounds elements read as zero and are not written. ``dtype``: :data:`U8`, :data:`F32` or :data:`BF16`;
    ``swizzle``: :data:`SWIZZLE_NONE` or :data:`SWIZZLE_128B`. Kept by what it encodes, so a call on the same
    buffers (a weight, an activation buffer the allocator hands out again) reuses it."""
    key = (t.data_ptr(), dtype, rows, cols, row_stride_bytes, box_rows, box_cols, swizzle)
    out = _TMAPS.get(key)
    if out is not None:  # (a descriptor holds only these numbers: the same key encodes the same bytes)
        return out
    if t.data_ptr() % 16:
        raise ValueError(f"t: a TMA descriptor needs 16-byte aligned data, got address {t.data_ptr():#x}")
    if row_stride_bytes % 16 or row_stride_bytes <= 0:
        raise ValueError(f"row_stride_bytes: a TMA descriptor needs a positive multiple of 16, got {row_stride_bytes}")
    if not (1 <= box_rows <= 256 and 1 <= box_cols <= 256):
        raise ValueError(f"box_rows, box_cols: a TMA box is 1-256 elements a side, got {box_rows} x {box_cols}")
    if rows < 1 or cols < 1:
        raise ValueError(f"rows, cols: expected at least 1 each, got {rows} x {cols}")
    out = _TMAP()
    dims = (ctypes.c_uint64 * 2)(cols, rows)
    strides = (ctypes.c_uint64 * 1)(row_stride_bytes)
    box = (ctypes.c_uint32 * 2)(box_cols, box_rows)
    one = (ctypes.c_uint32 * 2)(1, 1)
    _check_cu(_cuda().cuTensorMapEncodeTiled(ctypes.byref(out), dtype, 2, ctypes.c_void_p(t.data_ptr()), dims,
                                             strides, box, one, 0, swizzle, _L2_256B, 0),
              f"cuTensorMapEncodeTiled({rows}x{cols}, box {box_rows}x{box_cols})")
    if len(_TMAPS) >= 1024:
        _TMAPS.clear()
    _TMAPS[key] = out
    return out
