"""Benchmarks against peers (one module per op, each with ``main(argv)``), and what they share."""

from __future__ import annotations

import os
import subprocess


def git_commit() -> str:
    """Short hash of the checkout the benchmark runs from ("unknown" outside a git checkout)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=os.path.dirname(__file__)).stdout.strip()
        return out or "unknown"
    except Exception:
        return "unknown"


def median_ms(fn, *, warmup: int = 25, rep: int = 100, **kw) -> float:
    """Median time of ``fn`` in ms by ``triton.testing.do_bench`` (its default return mode is the mean)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median", **kw))
