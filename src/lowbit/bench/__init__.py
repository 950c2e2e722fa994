"""Benchmarks against peers (one module per op, each with ``main(argv)``), and what they share."""

from __future__ import annotations

import os
import subprocess

from ..runtime.device import capture  # noqa: F401  (re-exported: the benches time CUDA graphs of their calls)


def git_commit() -> str:
    """Short hash of the checkout the benchmark runs from ("unknown" outside a git checkout), with "+dirty" when
    tracked files differ from it — as on a copy of a working tree whose ``.git`` is older than its files, where the
    hash alone would name a commit the measured code is not."""
    try:
        here = os.path.dirname(__file__)
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=here).stdout.strip()
        if not out:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=30, cwd=here).stdout.strip()
        return out + ("+dirty" if dirty else "")
    except Exception:
        return "unknown"


def median_ms(fn, *, warmup: int = 25, rep: int = 100, **kw) -> float:
    """Median time of ``fn`` in ms by ``triton.testing.do_bench`` (its default return mode is the mean)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median", **kw))


def nrmse(out, ref) -> float:
    """||out - ref|| / ||ref|| in float32 (the accuracy column of the benchmarks)."""
    a, b = out.float(), ref.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def host_us(fn, n: int = 300, warmup: int = 20) -> float:
    """Host (enqueue) time of ``fn`` in microseconds per call: ``n`` calls back to back with no sync inside (on
    shapes small enough that the GPU never limits, this is what Python + launches cost), CUDA synced around."""
    import time

    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return t


def table_main(argv, *, prog: str, description: str, default_shapes, shapes_help: str, run, markdown) -> int:
    """The command line shared by the table benchmarks (gemm, quant): ``--shapes AxB[xC],...``, ``--rep``,
    ``--markdown FILE`` (or ``--out FILE``, as the other benchmarks name it); ``run(shapes, rep, rows, done)`` appends
    rows to ``rows`` and calls ``done()`` after each shape, ``markdown(rows)`` -> the table printed at the end. The file
    is rewritten after each shape, so a run cut short (a time limit, Ctrl-C) keeps the rows it finished."""
    import argparse

    import torch

    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--shapes", default=None, help=shapes_help)
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time in ms")
    p.add_argument("--markdown", "--out", dest="markdown", default=None, metavar="FILE",
                   help="write the result table (markdown) to this file, rewritten after each shape")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{prog}: needs a CUDA GPU")
        return 1
    try:
        shapes = default_shapes if not args.shapes else [tuple(int(v) for v in s.split("x"))
                                                         for s in args.shapes.split(",")]
    except ValueError:
        p.error(f"--shapes: expected a comma-separated list of x-separated integers, got {args.shapes!r}")
    rows = []

    def done():
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(markdown(rows))

    run(shapes, args.rep, rows, done)
    done()
    print(markdown(rows))
    return 0
