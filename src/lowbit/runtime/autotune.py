"""The small autotuner every Triton launcher shares: candidate configs from a generator, pruned by the caller,
timed once per (name, key) and the fastest kept for the process.

Each candidate is timed from a CUDA graph of one launch, so a launch's host cost does not rank short kernels: timed
eagerly, the Python and Triton host work of a launch (tens of microseconds) can outlast a 20-50 us kernel. Each
candidate gets two rounds and is judged by its best: the first tuning of a process often starts on a GPU whose
clocks are still ramping. ``LOWBIT_AUTOTUNE=0`` takes the first candidate always.
"""

from __future__ import annotations

import sys
import threading

import torch

from . import env
from .device import INTERPRET, capture

__all__ = ["tuned_launch", "tuned_config", "tuned_configs", "forget_tuned", "bucket"]

_TUNED: dict = {}
_notice = threading.Event()  # said once per process: a model's first steps compile and time many kernel variants


def bucket(n: int) -> int:
    """The power of two at or above ``n`` (at least 1): shapes in one bucket share a tuned config."""
    return 1 << max(0, (int(n) - 1).bit_length())


def tuned_config(name: str, key: tuple) -> dict | None:
    """The config tuned for (``name``, ``key``), or None where none is yet (or autotuning is off)."""
    return _TUNED.get((name,) + tuple(key)) if env.get("LOWBIT_AUTOTUNE") and not INTERPRET else None


def tuned_configs(name: str | None = None) -> dict:
    """A copy of the tuned configs, ``{(name, *key): config}``, those of launcher ``name`` only if given."""
    return {k: v for k, v in _TUNED.items() if name is None or k[0] == name}


def forget_tuned(name: str | None = None) -> None:
    """Drop the tuned configs (of launcher ``name`` only, if given): the next calls tune again."""
    for k in [k for k in _TUNED if name is None or k[0] == name]:
        del _TUNED[k]


def _tuning_notice(name: str, key: tuple) -> None:
    if not _notice.is_set():
        _notice.set()
        print(f"[lowbit] autotuning Triton launch configs for new shapes (first {name} key {key}); the first steps "
              f"of a model compile and time each kernel's candidates, later calls reuse the choice "
              f"(LOWBIT_AUTOTUNE=0 skips tuning)", file=sys.stderr, flush=True)


def _gpu_ms(fn) -> float:
    """Time of ``fn`` in ms (triton.testing.do_bench's mean, which clears the L2 cache before each call): on CUDA,
    of one call captured in a CUDA graph and replayed; eagerly where that cannot be (no CUDA, or ``fn`` not
    capturable). A candidate that cannot run raises from the eager timing."""
    import triton

    if not torch.cuda.is_available():
        return triton.testing.do_bench(fn, warmup=3, rep=10)
    try:  # (thread_local: another thread's CUDA calls, a data loader's copies, must not invalidate the capture)
        g = capture(fn, capture_error_mode="thread_local")
    except Exception:  # a host synchronization inside fn, or fn fails (then it raises again here)
        return triton.testing.do_bench(fn, warmup=3, rep=10)
    return triton.testing.do_bench(g.replay, warmup=3, rep=20)


def tuned_launch(name: str, key: tuple, candidates, launch) -> dict:
    """Run ``launch(cfg)`` with the fastest of ``candidates`` for this (name, key); returns the config used.

    ``candidates``: a list of configs, or a function returning it (built only when a tuned config is not known yet:
    this runs on every call). ``launch`` must be idempotent (it overwrites its outputs). In the interpreter, with
    one candidate, or with ``LOWBIT_AUTOTUNE=0``, the first candidate is used; likewise, untuned, inside a
    CUDA-graph capture (a graph, or another tuner timing a launch that calls this one), where candidates cannot be
    timed: the tuning waits for a call outside a capture. A candidate that fails (out of shared memory, say) is
    dropped; if none runs, RuntimeError.
    """
    k = (name,) + tuple(key)
    autotune = env.get("LOWBIT_AUTOTUNE") and not INTERPRET
    cfg = _TUNED.get(k) if autotune else None
    if cfg is not None:
        launch(cfg)
        return cfg
    if callable(candidates):
        candidates = candidates()
    if not candidates:
        raise RuntimeError(f"{name}: no launch configuration fits key {key}")
    if not autotune or len(candidates) == 1 or (torch.cuda.is_available()
                                                 and torch.cuda.is_current_stream_capturing()):
        launch(candidates[0])
        return candidates[0]
    _tuning_notice(name, key)
    best, failed, err = {}, set(), None
    for _ in range(2):
        for i, c in enumerate(candidates):
            if i in failed:
                continue
            try:
                t = _gpu_ms(lambda c=c: launch(c))
            except Exception as e:
                failed.add(i)
                err = e
                continue
            best[i] = min(t, best.get(i, t))
    ok = [(t, i) for i, t in best.items() if i not in failed]
    if not ok:
        raise RuntimeError(f"{name}: no candidate config ran for key {key}") from err
    cfg = _TUNED[k] = candidates[min(ok)[1]]
    launch(cfg)
    return cfg
