"""Where a training step's time goes between computing, communicating and waiting on the host (diagnostic:
``lowbit train --step-profile [N]``).

:class:`StepProfiler` runs ``torch.profiler`` over ``N`` steps after warm-up (the step before them warms the profiler
up and is not counted) and splits each step's wall time (from its launch on the host to its end, the device
synchronized) with :func:`split_step`:

* **compute**: the time the device runs anything but a collective (the union of those kernels' intervals);
  on CUDA with **concurrent**, the part of their GPU time that ran beside another of them (their summed times minus
  compute): the work of a second stream hidden behind the first (``lowbit train``'s weight gradients on a side
  stream); none means every kernel waited for the one before it;
* **comm**: the time it runs a collective (NCCL kernels: all-gather, reduce-scatter, all-reduce ...);
* **exposed comm**: the part of comm with no compute beside it, which overlap did not hide;
* **host**: the time it runs nothing, waiting on the host (Python, launches, a ``.item()``).

On CUDA each step also gets **kernels**: the GPU time of each kernel family (:func:`kernel_family`), summed (kernels
on concurrent streams each count), the most expensive :data:`TOP_KERNELS` kept: what to compare between two runs;
and **idle**: where the host time falls, the device's idle time summed by the pair of kernel families around each
gap (the kernel that ran last before it, the one that starts it; ``<step start>`` / ``<step end>`` at the edges),
the :data:`TOP_GAPS` largest pairs kept: what the device waited for.

So wall = compute + exposed comm + host. On the CPU (gloo) the step's own thread is the device: compute is the
time that thread spends in ATen operators, comm the time gloo's threads spend in collectives. Every rank profiles
its own steps; :meth:`StepProfiler.gather` collects them on every rank.
"""

from __future__ import annotations

import re

import torch

from .graph_profile import chrome_trace, merge

__all__ = ["StepProfiler", "split_trace", "split_step", "merge", "uncovered", "collective_kind", "kernel_family",
           "idle_gaps", "MARKER", "TOP_KERNELS", "TOP_GAPS"]

MARKER = "lowbit.step"
"""The ``torch.profiler.record_function`` name around each profiled step."""
TOP_KERNELS = 40
"""How many kernel families a step profile keeps (the most GPU time first)."""
FAMILY_CHARS = 160
"""The longest kernel family name kept (:func:`kernel_family`)."""
TOP_GAPS = 10
"""How many (before, after) kernel pairs of idle time a step profile keeps (the most idle time first)."""

_KINDS = (("allgather", "all_gather"), ("reducescatter", "reduce_scatter"), ("allreduce", "all_reduce"),
          ("broadcast", "broadcast"), ("sendrecv", "send_recv"), ("alltoall", "all_to_all"))


def uncovered(a: list, b: list) -> float:
    """The length of ``a`` outside ``b`` (both :func:`~lowbit.train.graph_profile.merge` results)."""
    total, j = 0.0, 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        cur, k = s, j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                total += b[k][0] - cur
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            total += e - cur
    return total


def collective_kind(name: str) -> str | None:
    """``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"`` ... where ``name`` is a collective's kernel (NCCL) or
    work (gloo), else None."""
    low = name.lower()
    if not (low.startswith("nccl") or low.startswith("gloo:")):
        return None
    flat = re.sub(r"[^a-z]", "", low)
    return next((kind for key, kind in _KINDS if key in flat), "other")


def kernel_family(name: str) -> str:
    """A CUDA kernel's name without its return type, parameter list and ``(anonymous namespace)::``, at most
    :data:`FAMILY_CHARS` characters: the template arguments that say what a launcher runs stay, e.g.
    ``"void at::native::vectorized_elementwise_kernel<4, at::native::AbsFunctor<float>>(int, ...)"`` ->
    ``"at::native::vectorized_elementwise_kernel<4, at::native::AbsFunctor<float>>"``."""
    name = name.strip().replace("(anonymous namespace)::", "")
    if name.startswith("void "):
        name = name[5:]
    depth, cut = 0, len(name)
    for i, ch in enumerate(name):
        if ch == "<":
            depth += 1
        elif ch == ">" and depth:
            depth -= 1
        elif ch == "(" and depth == 0:
            cut = i
            break
    return (name[:cut].strip() or name)[:FAMILY_CHARS]


def _length(merged: list) -> float:
    return sum(e - s for s, e in merged)


def idle_gaps(spans: list[tuple[float, float, str]], lo: float, hi: float) -> dict:
    """The device's idle time in ``[lo, hi]`` (us) between ``spans`` ``(start, end, family)`` (inside ``[lo, hi]``),
    summed by the pair of families around each gap: ``{"before | after": (ms, gaps)}``, the :data:`TOP_GAPS`
    largest."""
    out: dict = {}
    cur, last = lo, "<step start>"
    for s, e, fam in sorted(spans) + [(hi, hi, "<step end>")]:
        if s > cur:
            key = f"{last} | {fam}"
            ms, n = out.get(key, (0.0, 0))
            out[key] = (ms + (s - cur) / 1e3, n + 1)
        if e > cur:
            cur, last = e, fam
    return dict(sorted(out.items(), key=lambda kv: -kv[1][0])[:TOP_GAPS])


def split_step(events: list[dict], marker: dict, device_type: str) -> dict:
    """One step's split (see the module docstring), in ms, from chrome-trace ``events`` and the step's ``marker``
    event: wall, compute (and on CUDA concurrent), comm, exposed comm, host and the comm time of each collective
    kind."""
    lo = float(marker["ts"])
    hi = lo + float(marker.get("dur", 0.0))
    compute, comm, kinds, kernels, spans = [], [], {}, {}, []
    for e in events:
        if "ts" not in e or e.get("ph") != "X":
            continue
        s = max(lo, float(e["ts"]))
        t = min(hi, float(e["ts"]) + float(e.get("dur", 0.0)))
        if t <= s:
            continue
        name, cat = e.get("name", ""), e.get("cat")
        if device_type == "cuda":
            if cat not in ("kernel", "gpu_memcpy", "gpu_memset"):
                continue
        elif not ((cat == "cpu_op" and e.get("tid") == marker.get("tid") and name.startswith("aten::"))
                  or (cat == "user_annotation" and name.startswith("gloo:"))):
            continue
        if device_type == "cuda":
            fam = kernel_family(name) if cat == "kernel" else cat
            kernels[fam] = kernels.get(fam, 0.0) + (t - s) / 1e3
            spans.append((s, t, fam))
        kind = collective_kind(name)
        if kind is None:
            compute.append((s, t))
        else:
            comm.append((s, t))
            kinds.setdefault(kind, []).append((s, t))
    compute_sum = _length(compute)
    compute, comm = merge(compute), merge(comm)
    compute_union = _length(compute)
    busy = _length(merge(compute + comm))
    exposed = uncovered(comm, compute)
    return {"wall_ms": (hi - lo) / 1e3, "compute_ms": compute_union / 1e3, "comm_ms": _length(comm) / 1e3,
            "concurrent_ms": (compute_sum - compute_union) / 1e3 if device_type == "cuda" else None,
            "exposed_comm_ms": exposed / 1e3, "host_ms": max(0.0, hi - lo - busy) / 1e3,
            "comm_kinds_ms": {k: _length(merge(v)) / 1e3 for k, v in sorted(kinds.items())},
            "kernels_ms": _top(kernels), "idle": idle_gaps(spans, lo, hi) if device_type == "cuda" else {}}


def _top(kernels: dict) -> dict:
    return dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:TOP_KERNELS])


def split_trace(events: list[dict], device_type: str) -> list[dict]:
    """:func:`split_step` of every step marked (``MARKER``) in chrome-trace ``events``, in order."""
    # (the host's ranges: on CUDA the profiler also draws each range on the GPU's timeline, "gpu_user_annotation")
    markers = sorted((e for e in events if e.get("name") == MARKER and e.get("ph") == "X"
                      and e.get("cat") == "user_annotation"), key=lambda e: float(e["ts"]))
    return [split_step(events, m, device_type) for m in markers]


def _mean(parts: list[dict]) -> dict:
    """The mean of :func:`split_step` results (the collective kinds of any of them), with ``overlap_pct``: the
    share of comm hidden behind compute (None without comm)."""
    n = len(parts)
    out = {k: sum(p[k] for p in parts) / n for k in ("wall_ms", "compute_ms", "comm_ms", "exposed_comm_ms", "host_ms")}
    kinds = sorted({k for p in parts for k in p["comm_kinds_ms"]})
    out["comm_kinds_ms"] = {k: sum(p["comm_kinds_ms"].get(k, 0.0) for p in parts) / n for k in kinds}
    out["overlap_pct"] = 100.0 * (1 - out["exposed_comm_ms"] / out["comm_ms"]) if out["comm_ms"] > 0 else None
    conc = [p.get("concurrent_ms") for p in parts]
    out["concurrent_ms"] = None if None in conc else sum(conc) / n
    names = {k for p in parts for k in p.get("kernels_ms", {})}
    out["kernels_ms"] = _top({k: sum(p.get("kernels_ms", {}).get(k, 0.0) for p in parts) / n for k in names})
    pairs = {k for p in parts for k in p.get("idle", {})}
    idle = {k: (sum(p.get("idle", {}).get(k, (0.0, 0))[0] for p in parts) / n,
                sum(p.get("idle", {}).get(k, (0.0, 0))[1] for p in parts) / n) for k in pairs}
    out["idle"] = dict(sorted(idle.items(), key=lambda kv: -kv[1][0])[:TOP_GAPS])
    return out


class StepProfiler:
    """``torch.profiler`` over ``n`` steps after warm-up: steps ``start + 2`` to ``start + n + 1`` are split
    (:func:`split_step`), step ``start + 1`` runs under the profiler uncounted (its start-up costs land there); ``n``
    0: nothing happens. The loop calls :meth:`begin` before launching a step and :meth:`end` once the device is
    synchronized at its end; :meth:`covers` says which steps run under the profiler (their times are not the run's
    throughput)."""

    def __init__(self, n: int, start: int, steps: int, device: torch.device):
        self.n, self.device, self.first = n, device, start + 2
        self.skipped = None
        if n and steps - self.first < n:
            self.skipped = (f"step_profile={n} needs {n + 2} steps after the first one run ({start}), the run has "
                            f"{steps - start}")
        self.prof = self.marker = None
        self.parts: list[dict] = []

    @property
    def on(self) -> bool:
        return self.n > 0 and self.skipped is None

    @property
    def steps(self) -> list[int]:
        """The steps split, counted from 1 as the run's history counts them."""
        return list(range(self.first + 1, self.first + self.n + 1)) if self.on else []

    def covers(self, step: int) -> bool:
        return self.on and self.first - 1 <= step < self.first + self.n

    def begin(self, step: int) -> None:
        if not self.covers(step):
            return
        if self.prof is None:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.prof = profile(activities=acts)
            self.prof.__enter__()
        if step >= self.first:
            self.marker = torch.profiler.record_function(MARKER)
            self.marker.__enter__()

    def end(self, step: int) -> None:
        if not self.covers(step):
            return
        if self.marker is not None:
            self.marker.__exit__(None, None, None)
            self.marker = None
        if step == self.first + self.n - 1:
            self.close()

    def close(self) -> None:
        """Stop the profiler (at the last profiled step, or where the run stopped before it) and split the steps."""
        if self.prof is None:
            return
        if self.marker is not None:
            self.marker.__exit__(None, None, None)
            self.marker = None
        self.prof.__exit__(None, None, None)
        events = chrome_trace(self.prof)
        self.prof = None
        self.parts = split_trace(events, self.device.type)

    def result(self) -> dict:
        """This rank's mean split of its profiled steps, or ``{"skipped": why}``."""
        if self.skipped is not None:
            return {"skipped": self.skipped}
        if not self.parts:
            return {"skipped": "the run ended before the profiled steps"}
        return {**_mean(self.parts), "per_step": self.parts}

    def gather(self, group=None) -> dict | None:
        """Every rank's :meth:`result` (a collective where torch.distributed runs with more than one rank) and their
        mean: ``{"steps", "basis", "ranks": [...], "mean": {...}}``; None where ``n`` is 0."""
        if self.n == 0:
            return None
        mine = self.result()
        dist = torch.distributed
        ranks = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            ranks = [None] * dist.get_world_size(group)
            dist.all_gather_object(ranks, mine, group=group)
        done = [r for r in ranks if "skipped" not in r]
        basis = ("CUDA kernels (NCCL = comm)" if self.device.type == "cuda"
                 else "CPU: the step thread's ATen ops (compute), gloo's threads (comm)")
        return {"steps": self.steps, "basis": basis, "ranks": ranks, "mean": _mean(done) if done else None}
