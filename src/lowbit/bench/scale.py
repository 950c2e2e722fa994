"""``lowbit bench scale``: how ``lowbit train`` scales over GPUs, FSDP2 and DDP, against one GPU with the same
per-GPU batch.

For each recipe it runs ``lowbit train`` (fresh processes; ``torch.distributed.run`` for more than one) on one GPU
(CUDA-graphed, eager, and compiled where a compile mode is asked for: the references), then on each GPU count of
``--gpus`` in each mode of ``--modes`` (``fsdp``, ``fsdp-fp8ag``: FSDP2 with the FP8 weight all-gather, ``ddp``, and
``fsdp-keep``: FSDP2 keeping each block's gathered weights from its forward to its backward, ``fsdp-fp8ag-keep``: both,
``fsdp-bf16ag`` / ``fsdp-bf16ag-keep``: the same with BF16's weight all-gather (recipe bf16 only),
``fsdp-compile`` / ``ddp-compile``: each block ``torch.compile``'d; ``fsdp``, ``fsdp-fp8ag``, ``fsdp-keep``,
``fsdp-fp8ag-keep`` and ``ddp`` run inside ``lowbit train``'s CUDA graphs on CUDA, their collectives captured with
the step, ``fsdp-eager`` and ``ddp-eager`` without), every run with the same per-GPU batch; and, for the loss
check, one process with ``--grad-accum N``: the same global batch as N GPUs, micro-batch for micro-batch, and one
with the global batch split in half as many micro-batches (the check's floor). It reads
each run's ``summary.json`` and writes a table (markdown and JSON; rewritten after each run, so a sweep cut short
keeps what finished, ``"complete": false`` in the JSON until the end) and a plot (matplotlib, when installed).

Columns: **tokens/s** of the timed steps (all but the first, and those under the step profiler) and **per GPU**;
**x graphed** = tokens/s over one CUDA-graphed GPU's (the baseline of the scaling targets: 1.85 on 2 GPUs, 3.6 on 4),
**x eager** (and **x compile** for compile modes) the same over one eager (compiled) GPU's; the **eff.** columns are
those ratios over the GPU count; **fp8/bf16**: tokens/s over the fastest BF16 run in the same mode on as many GPUs
(for ``fsdp-fp8ag*``: BF16's ``fsdp-bf16ag*`` and ``fsdp*`` too); **loss diff**:
the largest relative difference of a step's training loss from the one-process run with the same global batch
(target 0.3%; every run warms its learning rate up over all its steps, ``--warmup``: the default schedule's loss
spikes in the first steps of a short run turn last-bit differences between the runs into different trajectories);
**loss floor**: the same between the two one-process runs, whose steps differ only in the order of the FP32 sums (the
difference the training trajectory itself grows from rounding, against which the loss diff is read);
then the step profile (``lowbit train --step-profile``, mean over ranks, ms a step): **compute** (with its
**concurrent** part: kernels running beside each other, the side-stream weight gradients), **exposed comm**
(communication no compute hides), **host** (the device idle) and **comm** (with the share hidden).

``--device cpu`` (the default without CUDA) runs the same on the CPU with gloo processes and the tiny preset: a smoke
test of the path; its timings mean nothing. ``--reuse`` keeps each run whose summary came from the same command line
(a sweep split over several calls); ``--report-only`` rebuilds the table and plot from the summaries in ``--out``
without running anything.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from ..train.cli import exit_status
from ..train.loop import FP8_ALL_GATHER_RECIPES, PRESET_DEFAULTS, RECIPES
from ..train.report import write_json
from . import git_commit

PROG = "lowbit bench scale"
MODES = {
    "fsdp": ["--fsdp"],
    "fsdp-fp8ag": ["--fsdp", "--fp8-all-gather"],
    "fsdp-compile": ["--fsdp", "--compile"],
    "fsdp-eager": ["--fsdp", "--cuda-graph", "off"],
    "fsdp-keep": ["--fsdp", "--fsdp-keep-gathered"],
    "fsdp-fp8ag-keep": ["--fsdp", "--fp8-all-gather", "--fsdp-keep-gathered"],
    "fsdp-bf16ag": ["--fsdp", "--bf16-all-gather"],
    "fsdp-bf16ag-keep": ["--fsdp", "--bf16-all-gather", "--fsdp-keep-gathered"],
    "ddp": [],
    "ddp-eager": ["--cuda-graph", "off"],
    "ddp-compile": ["--compile"],
}
"""Multi-GPU modes: the ``lowbit train`` flags each adds."""
REFS = {"graph": ["--cuda-graph", "on"], "eager": ["--cuda-graph", "off"], "compile": ["--compile"]}
"""The one-GPU references: the ``lowbit train`` flags of each."""
TARGETS = {2: 1.85, 4: 3.6}
"""The scaling targets: tokens/s on N GPUs over one CUDA-graphed GPU's."""
LOSS_TARGET = 0.003
CUDA_RUN = dict(model="350m", steps=50, eval_windows=32, step_profile=2)
CPU_RUN = dict(model="tiny", steps=6, eval_windows=4, step_profile=2, seq_len=64, batch_size=4)


def _split(s: str | None) -> list[str]:
    return [v.strip() for v in (s or "").split(",") if v.strip()]


def parse_args(argv):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", default=None,
                   help="comma-separated GPU (process) counts; 1 is always run (default: 1, 2, 4 ... up to the GPUs "
                        "present; cpu: 1,2)")
    p.add_argument("--recipes", default="bf16,fp8-block", help="comma-separated recipes (default bf16,fp8-block)")
    p.add_argument("--modes", default="fsdp,ddp",
                   help=f"comma-separated multi-GPU modes: {', '.join(MODES)} (default fsdp,ddp)")
    p.add_argument("--model", default=None, help="model preset (default 350m; cpu: tiny)")
    p.add_argument("--steps", type=int, default=None, help="steps a run (default 50; cpu 6)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per GPU (default: the preset's)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the preset's; cpu 64)")
    p.add_argument("--step-profile", type=int, default=None, metavar="N",
                   help="steps profiled in each run (lowbit train --step-profile; default 2, 0: off)")
    p.add_argument("--refs", default=None,
                   help="the one-GPU references run: comma-separated graph, eager, compile, or none (default graph, "
                        "eager, and compile where a compile mode runs; graph only on CUDA)")
    p.add_argument("--no-loss-check", action="store_true",
                   help="skip the one-process runs with the same global batch (no loss diff column)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="cuda (default when present) or cpu (gloo processes, tiny preset: a smoke test)")
    p.add_argument("--data", default=None, metavar="PATH", help="lowbit train --data (default: its own)")
    p.add_argument("--cache-dir", default=None, help="lowbit train --cache-dir")
    p.add_argument("--train-args", default="", metavar="ARGS",
                   help="more lowbit train arguments for every run, one string (e.g. \"--attention sdpa\", "
                        "--deterministic)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds a run may take (default 3600)")
    p.add_argument("--out", default="runs/scale", metavar="DIR",
                   help="the runs' folders and scaling.{md,json,png} (default runs/scale)")
    p.add_argument("--reuse", action="store_true",
                   help="keep each run whose summary is already in --out from the same command line (an earlier "
                        "call, e.g. one GPU count at a time), run the rest")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: rebuild the table and plot from the summaries already in --out")
    argv = list(sys.argv[1:] if argv is None else argv)
    # (argparse takes a lone "--flag" after --train-args for an option of its own: joined, it is the value)
    for i in range(len(argv) - 1):
        if argv[i] == "--train-args" and argv[i + 1].startswith("-"):
            argv[i:i + 2] = [f"--train-args={argv[i + 1]}"]
            break
    return p.parse_args(argv)


def resolve(args) -> dict:
    """Check the arguments and fill in the defaults; raises ValueError on bad input."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available() and not args.report_only:
        raise ValueError("--device cuda: no CUDA device here (pass --device cpu for the smoke test)")
    run = dict(CPU_RUN if device == "cpu" else CUDA_RUN)
    for k in ("model", "steps", "batch_size", "seq_len", "step_profile"):
        if getattr(args, k) is not None:
            run[k] = getattr(args, k)
    if run["model"] not in PRESET_DEFAULTS:
        raise ValueError(f"--model: unknown preset {run['model']!r}; expected one of {', '.join(PRESET_DEFAULTS)}")
    seq, bs, _ = PRESET_DEFAULTS[run["model"]]
    run.setdefault("seq_len", seq)
    run.setdefault("batch_size", bs)
    for k in ("steps", "batch_size", "seq_len"):
        if not isinstance(run[k], int) or run[k] < 1:
            raise ValueError(f"--{k.replace('_', '-')}: expected an integer >= 1, got {run[k]}")
    if run["step_profile"] < 0:
        raise ValueError(f"--step-profile: expected an integer >= 0 (0: off), got {run['step_profile']}")
    untimed = 1 + (run["step_profile"] + 1 if run["step_profile"] else 0)
    if run["steps"] <= untimed:
        raise ValueError(f"--steps: must exceed the untimed steps (the first, and {run['step_profile']} profiled + 1 "
                         f"warm-up), i.e. be >= {untimed + 1}, got {run['steps']}")
    n_dev = torch.cuda.device_count() if device == "cuda" else None
    if args.gpus is None:
        gpus = [1, 2] if device == "cpu" else [n for n in (1, 2, 4, 8) if n <= max(1, n_dev or 1)]
    else:
        try:
            gpus = [int(v) for v in _split(args.gpus)]
        except ValueError:
            raise ValueError(f"--gpus: expected comma-separated integers, got {args.gpus!r}") from None
    for n in gpus:
        if n < 1:
            raise ValueError(f"--gpus: each count must be >= 1, got {n}")
        if n_dev is not None and n > n_dev and not args.report_only:
            raise ValueError(f"--gpus: {n} GPUs asked for, this machine has {n_dev}")
    gpus = sorted(set(gpus) | {1})
    recipes = list(dict.fromkeys(_split(args.recipes)))
    modes = list(dict.fromkeys(_split(args.modes)))
    if not recipes:
        raise ValueError("--recipes: empty list")
    for r in recipes:
        if r not in RECIPES:
            raise ValueError(f"--recipes: unknown recipe {r!r}; expected some of {', '.join(RECIPES)}")
    for m in modes:
        if m not in MODES:
            raise ValueError(f"--modes: unknown mode {m!r}; expected some of {', '.join(MODES)}")
    if args.refs is None:
        refs = (["graph"] if device == "cuda" else []) + ["eager"] + (["compile"] if any(
            "-compile" in m for m in modes) else [])
    else:
        refs = [] if args.refs.strip() == "none" else list(dict.fromkeys(_split(args.refs)))
        for r in refs:
            if r not in REFS:
                raise ValueError(f"--refs: unknown reference {r!r}; expected some of {', '.join(REFS)}, or none")
        if "graph" in refs and device != "cuda":
            raise ValueError("--refs: graph needs CUDA (lowbit train's CUDA graphs); drop it on --device cpu")
    if not args.timeout > 0:
        raise ValueError(f"--timeout: expected a positive number of seconds, got {args.timeout}")
    try:
        extra = shlex.split(args.train_args)
    except ValueError as e:
        raise ValueError(f"--train-args: {e}: {args.train_args!r}") from None
    return dict(device=device, gpus=gpus, recipes=recipes, modes=modes, refs=refs, loss_check=not args.no_loss_check,
                data=args.data, cache_dir=args.cache_dir, train_args=extra, timeout=float(args.timeout),
                out=args.out, reuse=args.reuse, report_only=args.report_only, **run)


# ------------------------------------------------------------------------------------------------
# the runs
# ------------------------------------------------------------------------------------------------
def plan(cfg: dict) -> list[dict]:
    """Every run of ``cfg``, in order: ``{recipe, kind ("ref" | "mode" | "loss" | "floor"), mode, gpus, flags, dir,
    skip}``."""
    runs = []
    for r in cfg["recipes"]:
        for ref in cfg["refs"]:
            runs.append(dict(recipe=r, kind="ref", mode=ref, gpus=1, flags=REFS[ref], dir=f"{r}/1gpu-{ref}"))
        for n in cfg["gpus"]:
            if n == 1:
                continue
            for m in cfg["modes"]:
                skip = None
                if m.startswith("fsdp-fp8ag") and r not in FP8_ALL_GATHER_RECIPES:
                    skip = f"--fp8-all-gather takes {' or '.join(FP8_ALL_GATHER_RECIPES)}"
                if m.startswith("fsdp-bf16ag") and r != "bf16":
                    skip = "--bf16-all-gather takes bf16"
                runs.append(dict(recipe=r, kind="mode", mode=m, gpus=n, flags=MODES[m], dir=f"{r}/{m}-{n}gpu",
                                 skip=skip))
            if cfg["loss_check"]:  # one process, the global batch of n GPUs as n micro-batches
                runs.append(dict(recipe=r, kind="loss", mode=f"grad-accum {n}", gpus=1,
                                 flags=["--grad-accum", str(n)], dir=f"{r}/1gpu-accum{n}"))
                # and split in half as many micro-batches (all in one for an odd n): the same step to rounding
                b, a = (2 * cfg["batch_size"], n // 2) if n % 2 == 0 else (n * cfg["batch_size"], 1)
                runs.append(dict(recipe=r, kind="floor", mode=f"batch {b} x grad-accum {a}", gpus=1,
                                 flags=["--batch-size", str(b), "--grad-accum", str(a)], dir=f"{r}/1gpu-floor{n}"))
    return runs


def command(cfg: dict, run: dict, out: Path) -> list[str]:
    """The command line of ``run``: ``lowbit train`` (``python -m lowbit.train.cli``), under
    ``torch.distributed.run`` for more than one process."""
    args = ["--model", cfg["model"], "--recipe", run["recipe"], "--steps", str(cfg["steps"]),
            "--batch-size", str(cfg["batch_size"]), "--seq-len", str(cfg["seq_len"]), "--eval-every",
            str(cfg["steps"]), "--eval-windows", str(cfg["eval_windows"]), "--no-progress", "--overwrite",
            "--no-save", "--out-dir", str(out / run["dir"]), "--device", cfg["device"], "--warmup", str(cfg["steps"]),
            *run["flags"]]
    if cfg["step_profile"] and run["kind"] not in ("loss", "floor"):
        args += ["--step-profile", str(cfg["step_profile"])]
    for k in ("data", "cache_dir"):
        if cfg[k]:
            args += [f"--{k.replace('_', '-')}", cfg[k]]
    args += cfg["train_args"]
    head = [sys.executable, "-m"]
    if run["gpus"] > 1:
        head += ["torch.distributed.run", "--standalone", "--nproc_per_node", str(run["gpus"]), "-m"]
    return head + ["lowbit.train.cli", *args]


def _child_env() -> dict:
    """This process's environment, with the folder holding the lowbit package in use first on PYTHONPATH (so the
    runs train with the same code)."""
    src = str(Path(__file__).resolve().parents[2])
    paths = [src] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), "PYTHONUNBUFFERED": "1"}


def _last_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "error" in ln.lower():
            return ln[:300]
    return lines[-1][:300] if lines else "no output"


def _logged_command(run_dir: Path) -> str | None:
    """The command line a run's ``log.txt`` opens with (None without one)."""
    try:
        with open(run_dir / "log.txt") as f:
            first = f.readline().rstrip("\n")
    except OSError:
        return None
    return first[2:] if first.startswith("$ ") else None


def launch(cmd: list[str], run_dir: Path, timeout: float, log) -> tuple[int | None, str]:
    """Run ``cmd`` with its output in ``run_dir/log.txt``, echoing its ``[lowbit]`` lines through ``log``; kill it
    (its process group: torchrun's workers too) after ``timeout`` s. Returns (exit status or None on time-out,
    the output)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "log.txt"
    with open(path, "w") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=_child_env(), start_new_session=True)
    deadline, seen = time.monotonic() + timeout, 0
    rc = None
    while True:
        try:
            rc = proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            rc = None
        text = path.read_text(errors="replace")
        for line in text[seen:].splitlines(keepends=True):
            if not line.endswith("\n") and rc is None:
                break  # (a line still being written)
            seen += len(line)
            if line.startswith("[lowbit]") or "Error" in line:
                log("    " + line.rstrip())
        if rc is not None:
            return rc, text
        if time.monotonic() > deadline:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            return None, path.read_text(errors="replace")


def run_all(cfg: dict, runs: list[dict], log=print, after_each=None) -> dict:
    """Run every planned run (or, with ``report_only``, run nothing); ``{dir: summary or {"status": why not}}``.
    ``after_each(results)`` is called after each run that ran, with the results so far."""
    out = Path(cfg["out"])
    results = {}
    todo = [r for r in runs if not r.get("skip")]
    unit = ("GPU", "GPUs") if cfg["device"] == "cuda" else ("process", "processes")
    for run in runs:
        where = out / run["dir"]
        label = f"{run['recipe']} {run['mode']} on {run['gpus']} {unit[run['gpus'] > 1]}"
        if run.get("skip"):
            results[run["dir"]] = {"status": f"skipped: {run['skip']}"}
            log(f"[bench scale] {label}: skipped: {run['skip']}")
            continue
        summary_path = where / "summary.json"
        cmd = command(cfg, run, out)
        if cfg["reuse"] and summary_path.exists() and _logged_command(where) == shlex.join(cmd):
            log(f"[bench scale] {label}: reused {summary_path}")
        elif not cfg["report_only"]:
            if summary_path.exists():
                summary_path.unlink()  # (a summary left by an earlier run must not stand in for this one)
            n = todo.index(run) + 1
            log(f"[bench scale] run {n}/{len(todo)}: {label} -> {where}")
            t0 = time.monotonic()
            rc, text = launch(cmd, where, cfg["timeout"], log)
            if rc != 0 or not summary_path.exists():
                why = f"timed out after {cfg['timeout']:.0f} s" if rc is None else _last_error(text)
                results[run["dir"]] = {"status": f"failed: {why}"}
                log(f"[bench scale] {label}: failed ({why}); log: {where / 'log.txt'}")
                if after_each is not None:
                    after_each(results)
                continue
            log(f"[bench scale] {label}: done in {time.monotonic() - t0:.0f} s")
        if not summary_path.exists():
            results[run["dir"]] = {"status": "skipped: no summary.json"}
            continue
        s = json.loads(summary_path.read_text())
        s["status"] = "ok"
        results[run["dir"]] = s
        if s.get("tokens_per_s"):
            log(f"[bench scale] {label}: {s['tokens_per_s']:,.0f} tokens/s, final train loss "
                f"{_f(s.get('final_train_loss'), '.4f')}")
        if after_each is not None and not cfg["report_only"]:
            after_each(results)
    return results


# ------------------------------------------------------------------------------------------------
# the table
# ------------------------------------------------------------------------------------------------
def _losses(s: dict) -> list[float]:
    return [v for _, v in (s.get("history") or {}).get("train", [])]


def max_rel_diff(a: list[float], b: list[float]) -> float | None:
    """max |a - b| / |b| over the steps both have (None without any)."""
    pairs = [(x, y) for x, y in zip(a, b) if isinstance(x, (int, float)) and isinstance(y, (int, float)) and y]
    return max(abs(x - y) / abs(y) for x, y in pairs) if pairs else None


def rows(cfg: dict, runs: list[dict], results: dict) -> list[dict]:
    """One row per reference and per multi-GPU run (the loss-check runs feed the others' loss diff)."""
    by = {(r["recipe"], r["kind"], r["mode"], r["gpus"]): results.get(r["dir"], {}) for r in runs}
    out = []
    for run in runs:
        if run["kind"] in ("loss", "floor"):
            continue
        s = results.get(run["dir"], {})
        row = dict(recipe=run["recipe"], mode=run["mode"] if run["kind"] == "mode" else f"1 GPU {run['mode']}",
                   gpus=run["gpus"], status=s.get("status", "skipped: not run"), dir=run["dir"])
        out.append(row)
        if row["status"] != "ok":
            continue
        tps = s.get("tokens_per_s")
        row.update(tokens_per_s=tps, tokens_per_s_per_gpu=tps / run["gpus"] if tps else None,
                   final_train_loss=s.get("final_train_loss"), final_val_loss=s.get("final_val_loss"),
                   peak_gib=s["peak_memory_bytes"] / 2**30 if s.get("peak_memory_bytes") else None,
                   cuda_graph=s.get("cuda_graph"), compile=s.get("compile"), fsdp=s.get("fsdp"),
                   fp8_all_gather=s.get("fp8_all_gather"), world_size=s.get("world_size"), device=s.get("device"),
                   losses=_losses(s))
        for ref in REFS:
            base = by.get((run["recipe"], "ref", ref, 1), {})
            if tps and base.get("status") == "ok" and base.get("tokens_per_s"):
                row[f"x_{ref}"] = tps / base["tokens_per_s"]
                row[f"eff_{ref}"] = row[f"x_{ref}"] / run["gpus"]
        target = TARGETS.get(run["gpus"])
        if target is not None and "x_graph" in row and run["kind"] == "mode":
            row["target"] = target
            row["target_met"] = row["x_graph"] >= target
        if run["kind"] == "mode" and cfg["loss_check"]:
            ref = by.get((run["recipe"], "loss", f"grad-accum {run['gpus']}", 1), {})
            if ref.get("status") == "ok":
                row["max_loss_diff"] = max_rel_diff(row["losses"], _losses(ref))
                row["loss_ref"] = f"1 process, grad-accum {run['gpus']}"
                row["loss_ref_val"] = ref.get("final_val_loss")
                row["loss_ref_losses"] = _losses(ref)
                floor = results.get(f"{run['recipe']}/1gpu-floor{run['gpus']}", {})
                if floor.get("status") == "ok":
                    row["loss_floor"] = max_rel_diff(_losses(floor), _losses(ref))
        sp = (s.get("step_profile") or {}).get("mean")
        if sp:
            row["step_profile"] = sp
    for row in out:  # fp8/bf16: over the fastest BF16 run of the same mode on as many GPUs
        if row["recipe"] == "bf16" or not row.get("tokens_per_s"):
            continue
        peers = peer_modes(row["mode"])
        base = max((b["tokens_per_s"] for b in out if b["recipe"] == "bf16" and b["mode"] in peers
                    and b["gpus"] == row["gpus"] and b.get("tokens_per_s")), default=None)
        if base is not None:
            row["x_bf16"] = row["tokens_per_s"] / base
    return out


def peer_modes(mode: str) -> set[str]:
    """The modes whose BF16 runs are the peers of ``mode``'s quantized runs: the mode itself and, for a low-precision
    all-gather, BF16's own (``fsdp-fp8ag-keep``: ``fsdp-bf16ag-keep``) and FSDP2's plain gather (``fsdp-keep``)."""
    return {mode, mode.replace("-fp8ag", "-bf16ag"), mode.replace("-fp8ag", "")}


def _f(v, fmt: str, none: str = "-") -> str:
    """``v`` formatted; a non-finite float as ``lowbit train``'s summary.json holds it ("nan", "inf") stays as it is."""
    return none if v is None else v if isinstance(v, str) else format(v, fmt)


def header(cfg: dict, table: list[dict]) -> str:
    dev = next((r["device"] for r in table if r.get("device")), cfg["device"])
    if cfg["device"] == "cpu":
        dev = "CPU, gloo processes (smoke test: timings mean nothing)"
    sp = cfg["step_profile"]
    timed = f"steps {2 + (sp + 1 if sp else 0)}-{cfg['steps']}"
    return (f"## lowbit bench scale — {dev}, torch {torch.__version__}, {datetime.date.today().isoformat()}, commit "
            f"{git_commit()}\n\nmodel {cfg['model']}, per-GPU batch {cfg['batch_size']} x {cfg['seq_len']} tokens, "
            f"{cfg['steps']} steps a run, tokens/s over {timed}"
            + (f"; step profile over steps 3-{2 + sp} (ms a step, mean of the ranks)" if sp else "")
            + (f"; every run with `{shlex.join(cfg['train_args'])}`" if cfg.get("train_args") else "")
            + ". x graphed / x eager / x compile: tokens/s over one GPU's (CUDA-graphed, eager, compiled), eff.: "
              "that over the GPU count; targets (x graphed): "
            + ", ".join(f"{t} on {n} GPUs" for n, t in TARGETS.items())
            + f"; loss diff: the largest per-step relative train-loss difference from one process with the same "
              f"global batch (grad-accum N; target {100 * LOSS_TARGET:.1f}%); loss floor: the same between two "
              f"such processes that split the global batch differently (the same step but for rounding)")


GROWTH_TOP = 6
"""Kernel families listed a multi-GPU run under the table (:func:`kernel_growth`)."""
IDLE_TOP = 3
"""Idle pairs (``lowbit train --step-profile``'s ``idle``) listed a run under the table."""


def _paren(v) -> str:
    return "" if v is None else f" ({v:.1f})"


def markdown(cfg: dict, table: list[dict]) -> str:
    cols = ["recipe", "mode", "GPUs", "tokens/s", "per GPU", "x graphed", "eff.", "x eager", "eff. eager",
            "x compile", "fp8/bf16", "peak GiB", "train loss", "val loss", "loss diff", "loss floor",
            "compute ms (concurrent)", "exposed comm ms", "host ms", "comm ms (hidden)"]
    lines = [header(cfg, table), "", "| " + " | ".join(cols) + " |",
             "|" + "|".join(["---", "---", "---:"] + ["---:"] * (len(cols) - 3)) + "|"]
    for r in table:
        if r["status"] != "ok":
            lines.append(f"| {r['recipe']} | {r['mode']} | {r['gpus']} | {r['status'].replace('|', '/')} |"
                         + " |" * (len(cols) - 4))
            continue
        sp = r.get("step_profile") or {}
        target = ""
        if "target_met" in r:
            target = " (met)" if r["target_met"] else f" (< {r['target']})"
        diff = r.get("max_loss_diff")
        comm = "-"
        if sp.get("comm_ms"):
            comm = f"{sp['comm_ms']:.1f} ({_f(sp.get('overlap_pct'), '.0f')}%)"
        elif sp:
            comm = "0"
        cells = [r["recipe"], r["mode"], str(r["gpus"]), _f(r.get("tokens_per_s"), ",.0f"),
                 _f(r.get("tokens_per_s_per_gpu"), ",.0f"), _f(r.get("x_graph"), ".2f") + target,
                 _f(r.get("eff_graph"), ".0%"), _f(r.get("x_eager"), ".2f"), _f(r.get("eff_eager"), ".0%"),
                 _f(r.get("x_compile"), ".2f") if r["mode"].endswith("compile") else "-",
                 _f(r.get("x_bf16"), ".2f"), _f(r.get("peak_gib"), ".2f"), _f(r.get("final_train_loss"), ".4f"),
                 _f(r.get("final_val_loss"), ".4f"),
                 "-" if diff is None else f"{100 * diff:.3f}%" + ("" if diff <= LOSS_TARGET else " (> target)"),
                 "-" if r.get("loss_floor") is None else f"{100 * r['loss_floor']:.3f}%",
                 _f(sp.get("compute_ms"), ".1f") + _paren(sp.get("concurrent_ms")),
                 _f(sp.get("exposed_comm_ms"), ".1f"), _f(sp.get("host_ms"), ".1f"),
                 comm]
        lines.append("| " + " | ".join(cells) + " |")
    growth = kernel_growth(table)
    if growth:
        lines += ["", f"Where the GPU time of a step grew over one graphed GPU (ms a step, each run's {GROWTH_TOP} "
                      "kernel families that grew most; kernels on concurrent streams each count):", ""]
        for r, items in growth:
            lines.append(f"- {r['recipe']} {r['mode']} ({r['gpus']} GPUs): "
                         + ", ".join(f"`{k}` {d:+.2f}" for k, d in items))
    idle = [(r, list((r.get("step_profile") or {}).get("idle", {}).items())[:IDLE_TOP]) for r in table
            if r["status"] == "ok"]
    idle = [(r, items) for r, items in idle if items]
    if idle:
        lines += ["", f"Where the device sat idle (ms a step and gaps a step, each run's {IDLE_TOP} largest, by the "
                      "kernels before and after the gap):", ""]
        for r, items in idle:
            lines.append(f"- {r['recipe']} {r['mode']} ({r['gpus']} GPU{'s' if r['gpus'] > 1 else ''}): "
                         + ", ".join(f"`{k}` {ms:.2f} ({n:g})" for k, (ms, n) in items))
    return "\n".join(lines) + "\n"



def kernel_growth(table: list[dict], top: int = GROWTH_TOP) -> list[tuple[dict, list[tuple[str, float]]]]:
    """For each multi-GPU row with a step profile, the ``top`` kernel families whose GPU time a step grew most over
    the same recipe's one-GPU graphed run (``lowbit train --step-profile``'s ``kernels_ms``): (row, [(family,
    ms)])."""
    out = []
    for r in table:
        mine = (r.get("step_profile") or {}).get("kernels_ms")
        if r["gpus"] < 2 or not mine:
            continue
        ref = next((b for b in table if b["recipe"] == r["recipe"] and b["mode"] == "1 GPU graph"
                    and (b.get("step_profile") or {}).get("kernels_ms")), None)
        if ref is None:
            continue
        base = ref["step_profile"]["kernels_ms"]
        diff = {k: mine.get(k, 0.0) - base.get(k, 0.0) for k in set(mine) | set(base)}
        out.append((r, sorted(diff.items(), key=lambda kv: -kv[1])[:top]))
    return out


def plot(cfg: dict, table: list[dict], path: Path) -> Path | None:
    """Speed-up against GPUs per recipe and mode (over one graphed GPU, else one eager GPU; the ideal line and the
    targets dashed), and each run's step profile as stacked bars; None (nothing written) without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    ok = [r for r in table if r["status"] == "ok"]
    key = "x_graph" if any("x_graph" in r for r in ok) else "x_eager"
    fig = Figure(figsize=(13, 4.8), dpi=110)
    FigureCanvasAgg(fig)
    ax_s, ax_p = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.6]})
    ns = sorted({r["gpus"] for r in ok}) or [1]
    ax_s.plot(ns, ns, ":", color="grey", label="ideal")
    if cfg["device"] == "cuda":
        ax_s.plot(list(TARGETS), list(TARGETS.values()), "x", color="red", ms=9, label="target")
    for i, (recipe, mode) in enumerate(dict.fromkeys((r["recipe"], r["mode"]) for r in ok if r["gpus"] > 1)):
        pts = [(1, 1.0)] + [(r["gpus"], r[key]) for r in ok if (r["recipe"], r["mode"]) == (recipe, mode) and key in r]
        xs, ys = zip(*sorted(pts))
        ax_s.plot(xs, ys, "o-", color=f"C{i}", label=f"{recipe} {mode}", lw=1.4, ms=4)
    ax_s.set(title=f"tokens/s over one {'CUDA-graphed' if key == 'x_graph' else 'eager'} GPU", xlabel="GPUs",
             ylabel="speed-up", xticks=ns)
    ax_s.grid(alpha=0.3)
    ax_s.legend(fontsize=7)
    prof = [r for r in ok if r.get("step_profile")]
    labels = [f"{r['recipe']}\n{r['mode']}\nx{r['gpus']}" for r in prof]
    bottom = [0.0] * len(prof)
    for part, color in (("compute_ms", "C0"), ("exposed_comm_ms", "C3"), ("host_ms", "C7")):
        vals = [r["step_profile"][part] for r in prof]
        ax_p.bar(range(len(prof)), vals, bottom=bottom, color=color, label=part[:-3].replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax_p.set_xticks(range(len(prof)), labels, fontsize=6)
    ax_p.set(title="step profile (mean of ranks)", ylabel="ms a step")
    ax_p.grid(alpha=0.3, axis="y")
    ax_p.legend(fontsize=7)
    fig.suptitle(f"lowbit bench scale: {cfg['model']}, per-GPU batch {cfg['batch_size']} x {cfg['seq_len']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def main(argv=None) -> int:
    """Run the benchmark; print progress, then the markdown table; returns the exit status (2: bad input)."""
    args = parse_args(argv)

    def body():
        cfg = resolve(args)
        runs = plan(cfg)
        log = lambda s: print(s, flush=True)  # noqa: E731
        n = sum(not r.get("skip") for r in runs)
        log(f"[bench scale] {n} runs of lowbit train ({cfg['model']}, {cfg['steps']} steps, per-GPU batch "
            f"{cfg['batch_size']} x {cfg['seq_len']}) on {cfg['device']}: recipes {', '.join(cfg['recipes'])}; "
            f"modes {', '.join(cfg['modes']) or 'none'} on {', '.join(map(str, cfg['gpus']))} GPU(s)"
            + (" (report only)" if args.report_only else ""))
        out = Path(cfg["out"])

        def write(results, final=False):
            """The table of what has finished: rewritten after each run (a sweep cut short keeps its table),
            with the plot at the end."""
            table = rows(cfg, runs, results)
            md = markdown(cfg, table)
            out.mkdir(parents=True, exist_ok=True)
            (out / "scaling.md").write_text(md)
            png = plot(cfg, table, out / "scaling.png") if final else None
            write_json(out / "scaling.json", dict(header=header(cfg, table), config=cfg, rows=table,
                                                  commands={r["dir"]: shlex.join(command(cfg, r, out)) for r in runs},
                                                  plot=None if png is None else str(png), complete=final))
            return md, png

        results = run_all(cfg, runs, log, after_each=write)
        md, png = write(results, final=True)
        print("\n" + md, flush=True)
        log(f"[bench scale] wrote {out / 'scaling.md'}, {out / 'scaling.json'}"
            + (f", {png}" if png else " (no plot: matplotlib is not installed)"))

    return exit_status(PROG, body)
