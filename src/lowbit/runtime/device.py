"""Facts about the machine that kernel dispatch asks on every call.

:data:`INTERPRET`: whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``, read once at import, as
Triton does). :func:`capability` / :func:`num_sms`: a CUDA device's compute capability and SM count, cached per
device index (torch's queries cost microseconds of host time a call, which the launchers would otherwise pay for
every operand of every step). :func:`memory_bytes`: a device's total memory. :func:`capture`: a function captured
once in a CUDA graph. :func:`triton_installed`: whether the optional triton package imports.
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["INTERPRET", "capability", "num_sms", "memory_bytes", "capture", "in_graph_pool", "in_graph_tree",
           "triton_installed", "TRITON_MISSING", "is_dtensor", "stream_apart"]

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""Triton's interpreter runs the kernels (on CPU tensors too); the one place the library reads this variable."""


TRITON_MISSING = "backend: 'triton' needs the triton package, which is not installed (pip install lowbit[gpu])"
"""The start of the error a Triton backend asked for without triton gives (each caller adds what to use instead)."""


@functools.lru_cache(maxsize=None)
def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # (a torch without torch.distributed)
        return None
    return DTensor


def is_dtensor(t) -> bool:
    """Whether ``t`` is a DTensor (how FSDP2 holds a parameter shard outside its module's forward)."""
    dt = _dtensor_type()
    return dt is not None and isinstance(t, dt)


@functools.lru_cache(maxsize=None)
def triton_installed() -> bool:
    """Whether ``import triton`` works (the ``lowbit[gpu]`` extra); asked before a Triton path is taken, so that a
    missing package is a clear error or the torch path, never a ModuleNotFoundError from inside lowbit."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _index(device) -> int:
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple:
    return tuple(torch.cuda.get_device_capability(index))


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _l2_bytes(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).L2_cache_size)


def capability(device) -> tuple:
    """(major, minor) compute capability of CUDA ``device`` (a torch.device, string or index)."""
    if torch.compiler.is_compiling():  # (torch's query, which Dynamo folds; it warns on a call into an lru_cache)
        return tuple(torch.cuda.get_device_capability(_index(device)))
    return _capability(_index(device))


def num_sms(device) -> int:
    """Streaming multiprocessors of CUDA ``device``."""
    return _num_sms(_index(device))


def l2_bytes(device) -> int:
    """L2 cache size of CUDA ``device`` in bytes."""
    return _l2_bytes(_index(device))


def memory_bytes(device) -> int | None:
    """Total memory of ``device``: a CUDA device's (the current one for ``"cuda"``), the machine's physical memory for
    the CPU; None where it cannot be read or does not apply (``meta``, other device types)."""
    d = torch.device(device)
    if d.type == "cuda":
        return int(torch.cuda.get_device_properties(_index(d)).total_memory)
    if d.type == "cpu":
        try:
            return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (ValueError, OSError, AttributeError):  # no sysconf (Windows) or no such name
            return None
    return None


def stream_apart(device, *avoid) -> torch.cuda.Stream:
    """A stream from torch's pool on CUDA ``device`` that is none of the streams ``avoid``, for work meant to run
    beside theirs. ``torch.cuda.Stream()`` hands out the pool's 32 streams of a priority in turn, so a stream drawn
    for concurrent work can be the very stream its caller runs on (``torch.cuda.graph``'s capture stream comes from
    the same pool): work put on it would then run after the caller's, not beside it. Consecutive draws differ, so
    ``len(avoid) + 1`` draws suffice."""
    for _ in range(len(avoid) + 1):
        s = torch.cuda.Stream(device)
        if not any(s == a for a in avoid):
            return s
    raise RuntimeError(f"stream_apart: {len(avoid) + 1} streams drawn from torch's pool on {device}, each one of the "
                       f"{len(avoid)} to avoid")


def capture(fn, *, capture_error_mode: str = "global"):
    """``fn`` warmed up on a side stream, then captured once in a CUDA graph (as ``torch.cuda.graphs`` asks); returns
    the graph (replay it to time GPU work without host cost). Raises what the warm-up or the capture raises.
    ``capture_error_mode="thread_local"`` lets other threads' CUDA calls (a data loader's copies) run meanwhile."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode=capture_error_mode):
        fn()
    torch.cuda.synchronize()
    return g


def in_graph_tree(device: torch.device) -> bool:
    """True while torch.compile's CUDA graph trees (``mode="reduce-overhead"``) warm up or record a graph on
    ``device``: they run on the tree manager's own stream and allocate from the graph's private pool."""
    if device.type != "cuda":
        return False
    try:  # the tree manager is torch's internal object: no manager, or another layout of it, means no tree
        from torch._inductor import cudagraph_trees
        mgr = cudagraph_trees.get_manager(_index(device), create_if_none_exists=False)
        return mgr is not None and torch.cuda.current_stream(device) == mgr.stream
    except (ImportError, AttributeError):
        return False


def in_graph_pool(device: torch.device) -> bool:
    """True while work on ``device`` allocates from a CUDA graph's private memory pool: a CUDA-graph capture, or
    :func:`in_graph_tree`. A tensor allocated there and kept after the call breaks the graph."""
    if device.type != "cuda":
        return False
    return torch.cuda.is_current_stream_capturing() or in_graph_tree(device)
