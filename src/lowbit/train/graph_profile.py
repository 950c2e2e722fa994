"""Where a captured training step's GPU time goes (diagnostic: ``lowbit train --profile-graphs DIR``).

A CUDA graph replays its kernels back to back, but not without gaps: each node's launch, ramp-up and drain cost
time that no kernel's duration counts. :func:`profile_step` replays the step's graphs one at a time, each under
its own ``torch.profiler`` session, and splits each graph's span (first kernel start to last kernel end) into busy
time (the union of the kernel intervals) and idle time between kernels; it also groups kernel time by name.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict

import torch


def chrome_trace(prof) -> list[dict]:
    """The events of a finished ``torch.profiler`` session as its chrome trace has them (``name``, ``cat``, ``ts`` and
    ``dur`` in us, ``tid``, ``args``): host ops, annotations and GPU kernels on one clock."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    return trace.get("traceEvents", [])


def kernel_trace(prof) -> list[list]:
    """[start us, duration us, stream, grid, name] of every GPU kernel in a finished ``torch.profiler`` session, by
    start time (its chrome trace's kernel events)."""
    return sorted(([float(e["ts"]), float(e.get("dur", 0.0)), (e.get("args") or {}).get("stream"),
                    (e.get("args") or {}).get("grid"), e.get("name", "?")]
                   for e in chrome_trace(prof) if e.get("cat") == "kernel"), key=lambda r: (r[0], r[1]))


def _kernels(prof, raw: list | None = None) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every GPU kernel in a finished profiler session, by start time; ``raw``, if
    given, also receives each kernel's [start, duration, stream, grid, name]."""
    rows = kernel_trace(prof)
    if raw is not None:
        raw.extend([s, d, st, g, n[:120]] for s, d, st, g, n in rows)
    return [(s, s + d, n) for s, d, _, _, n in rows]


def merge(intervals) -> list[tuple[float, float]]:
    """The union of ``(start, end)`` intervals as sorted disjoint intervals."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def summarize(kernels: list[tuple[float, float, str]], top: int = 25) -> dict:
    """Span, busy time (union of intervals), idle time, gap statistics and the ``top`` kernel names by total time
    (all in microseconds) of one graph's kernels."""
    if not kernels:
        return {"kernels": 0}
    spans = merge((s, e) for s, e, _ in kernels)
    busy = sum(e - s for s, e in spans)
    gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:])]
    idle = sum(gaps)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for s, e, n in kernels:
        by_name[n][0] += e - s
        by_name[n][1] += 1
    gaps.sort()
    return {
        "kernels": len(kernels), "span_us": spans[-1][1] - spans[0][0],
        "busy_us": busy, "idle_us": idle, "kernel_sum_us": sum(e - s for s, e, _ in kernels),
        "gaps": len(gaps), "gap_median_us": gaps[len(gaps) // 2] if gaps else 0.0,
        "gap_p90_us": gaps[int(0.9 * len(gaps))] if gaps else 0.0,
        "top": [{"name": n[:160], "us": t, "calls": c}
                for n, (t, c) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]],
    }


def kernel_family(name: str) -> str:
    """The library a kernel comes from, by its name: ``cublas`` (nvjet / cutlass GEMMs), ``deepgemm``, ``cudnn``,
    ``torch`` (ATen's templates), ``cuda:<name>`` (lowbit's NVRTC-compiled kernels, named ``lowbit_*``) or
    ``triton:<name>`` (anything else: lowbit's Triton / Gluon kernels)."""
    if name.startswith(("nvjet", "sm90_xmma", "cutlass")):
        return "cublas"
    if name.startswith("lowbit_"):
        return "cuda:" + name[:40]
    if "deep_gemm::" in name:
        return "deepgemm"
    if "cudnn" in name:
        return "cudnn"
    if name.startswith(("void at::", "void (anonymous namespace)", "void at_cuda_detail", "memset", "memcpy")):
        return "torch"
    return "triton:" + name.split("(")[0][:40]


def transition_gaps(trace: list) -> list[dict]:
    """Where the whole GPU sat idle, by what ran before and after: each gap of the union of all streams' kernel
    intervals (no kernel running anywhere), grouped by (family of the kernel that ended last, family of the kernel
    that starts) (:func:`kernel_family`), largest total first. ``trace``: the [start, duration, stream, grid, name]
    rows of the trace. (Per-stream gaps would also count a stream waiting on another's work.)
    (This is how ~9 us of idle GPU before every cuBLAS / cuDNN kernel of a training graph shows up, against
    0.3-0.6 us before anything else.)"""
    rows = sorted(trace, key=lambda r: r[0])
    groups: dict = defaultdict(list)
    if rows:
        end, last = rows[0][0] + rows[0][1], rows[0][4]
        for start, dur, _, _, name in rows[1:]:
            if start > end:
                groups[(kernel_family(last), kernel_family(name))].append(start - end)
            if start + dur > end:
                end, last = start + dur, name
    out = []
    for (f0, f1), gaps in groups.items():
        gs = sorted(gaps)
        out.append({"from": f0, "to": f1, "count": len(gs), "total_us": sum(gs), "median_us": gs[len(gs) // 2]})
    return sorted(out, key=lambda d: -d["total_us"])


def profile_step(graphed, out_dir: str, say) -> None:
    """Replay ``graphed``'s forward+backward graph and then its update graph (a ``loop._GraphedStep`` whose update is
    captured), each under its own profiler session, and write ``graph_profile.json`` into ``out_dir``; ``say``
    prints the one-line summary of each graph."""
    from torch.profiler import ProfilerActivity, profile

    res = {}
    for name, g in (("forward+backward", graphed.graph), ("update", graphed.update)):
        if g is None:
            continue
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            g.replay()
            torch.cuda.synchronize()
        raw = []  # every kernel in order (start, duration, stream, grid, name)
        s = summarize(_kernels(prof, raw), top=25)
        s["trace"] = raw
        s["transitions"] = transition_gaps(raw)[:20]
        res[name] = s
        if s["kernels"]:
            say(f"[lowbit] graph {name}: {s['kernels']} kernels, span {s['span_us'] / 1e3:.2f} ms, busy "
                f"{s['busy_us'] / 1e3:.2f} ms, idle {s['idle_us'] / 1e3:.2f} ms in {s['gaps']} gaps (median "
                f"{s['gap_median_us']:.2f} us, p90 {s['gap_p90_us']:.2f} us)")
            for t in s.get("transitions", [])[:3]:
                say(f"[lowbit]   GPU idle between {t['from']} -> {t['to']}: {t['total_us'] / 1e3:.2f} ms in "
                    f"{t['count']} (median {t['median_us']:.2f} us)")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "graph_profile.json"), "w") as f:
        json.dump(res, f, indent=1)
