"""``lowbit bench model``: lowbit in the user's own training loop — a HuggingFace ``LlamaForCausalLM`` trained the way
HF Trainer does it in bf16 mode, eager and under ``torch.compile``, against the same loop without lowbit.

The loop (what a 40-line script or HF Trainer runs): FP32 parameters, forward under
``torch.autocast(device, dtype=torch.bfloat16)``, ``loss = model(input_ids, labels=input_ids).loss``,
``loss.backward()``, ``torch.optim.AdamW(fused=True)`` (on CUDA) ``.step()``, ``.zero_grad(set_to_none=True)``.
The model is random-initialised from a fixed seed (nothing downloaded, ``attn_implementation="sdpa"``); the data is
one seeded batch of random token ids, repeated every step (the model memorises it, so the loss falls and the
last-step loss compares the variants' numerics). Every variant builds a fresh model from the same seed.

Variants:

* ``bf16`` / ``bf16-compile``: the loop as is / with ``torch.compile(model)``;
* ``<recipe>`` (each of ``lowbit.recipes.QUANTIZED_NAMES``): ``lowbit.convert(model, recipe=...)`` and the forward
  inside ``lowbit.autocast(recipe=...)`` nested in ``torch.autocast`` (the backward runs after it, as in the guide);
  ``<recipe>-compile``: the same plus ``torch.compile(model)``;
* ``torchao-compile`` (when torchao imports): ``torchao.float8.convert_to_float8_training`` (tensorwise, the
  default config; ``lm_head`` kept in high precision as lowbit keeps it) plus ``torch.compile(model)``;
* ``<any>-compile-graphs`` (not run by default): ``torch.compile(model, mode="reduce-overhead")``, CUDA graphs;
* ``<any>-compile-static`` (not run by default, ``--isolate`` only): ``<any>-compile`` in a process started with
  ``TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS=1``: Inductor launches user-defined Triton kernels
  (lowbit's blockwise quantizer) with its static launcher, which takes less host time a launch than Triton's own.

The lowbit variants run with lowbit's NaN sentry as a user gets it (``on_nonfinite="raise"``); ``--on-nonfinite
off`` measures them without it (torchao has none). They convert with ``lowbit.convert``'s defaults; ``--fuse-mlp``
converts each gated MLP into a ``lowbit.nn.SwiGLUMLP`` with the RMSNorm before it moved in, ``--fuse-qkv`` each
attention's q, k, v projections into one ``lowbit.nn.QKVLinear``.

A variant that raises is reported as ``failed: <type>: <message>`` and the benchmark goes on.

Each variant runs in a fresh Python process of its own on CUDA (``--isolate``, the default there), as a user's
training script does: run one after another in one process, a compiled lowbit step took 13-35% more time
(d_model 1024, 8 layers, H200) after another variant had run or torchao had only been imported, and the order of the
variants then decided their ratios. ``--no-isolate`` (the default on the CPU) runs them in this process.

``--rounds R`` compares variants whose difference is near the run-to-run spread (host-bound steps move by 5-20%
between runs): every variant is built and warmed up first, then their timed steps alternate in R rounds, so a drift
of the machine lands on all of them alike (all live at once: no peak memory reported; they share one compile cache,
so a compiled call may first check the guards of another variant's graphs; all in one process, so every variant but
the first is measured after another, see above).

How to read it: each step is timed with ``torch.cuda.synchronize()`` around it; **tokens/s** is batch x seq over the
median step time of the steps after the warm-up (the first steps compile and autotune). **host ms** is the time from
the step's start until Python has enqueued all of it (before the synchronize): when it is close to the step time the
run is host-bound and a faster kernel will not show. **first step s** is the first step's time: compiling (and
autotuning) is paid there. **peak GiB** is ``torch.cuda.max_memory_allocated``.
**x bf16** and **x bf16-compile** are tokens/s ratios against the loop without lowbit (eager, compiled): above 1 is
faster. **loss** is the last step's loss; a quantized variant should sit close to ``bf16``'s.

``--device cpu`` (the default without CUDA) is a smoke test of the code path on a tiny model: its timings mean
nothing; compile variants run there only with ``--compile-on-cpu`` and torchao never.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch

from ..nn.state import ON_NONFINITE
from ..recipes import QUANTIZED_NAMES, from_name
from ..train.cli import exit_status
from . import git_commit

PROG = "lowbit bench model"

# --size presets: Llama shapes (heads of 64 and 128 dims, SwiGLU intermediate ~ 2.75 x hidden)
PRESETS = {
    1024: dict(hidden=1024, intermediate=2816, layers=24, heads=16, vocab=32000),  # ~ 370M parameters
    2048: dict(hidden=2048, intermediate=5632, layers=8, heads=16, vocab=32000),  # ~ 540M parameters
}
CPU_SMOKE = dict(hidden=64, intermediate=128, layers=2, heads=4, vocab=256)
CUDA_RUN = dict(batch=4, seq=2048, steps=15, warmup=5, lr=3e-4)
CPU_RUN = dict(batch=2, seq=64, steps=3, warmup=1, lr=1e-3)
DEFAULT_RECIPES = "fp8-current,fp8-block"
SEED = 0


def _split(s: str | None) -> list[str]:
    return [v.strip().lower() for v in (s or "").split(",") if v.strip()]


def variant_names(recipe_names) -> list[str]:
    """The default variants for these recipes, in run order."""
    out = ["bf16", "bf16-compile"]
    for r in recipe_names:
        out += [r, f"{r}-compile"]
    return out + ["torchao-compile"]


STATIC_LAUNCH_ENV = {"TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS": "1"}
"""The environment a ``-compile-static`` variant's process starts with."""


def all_variant_names(recipe_names) -> list[str]:
    """Every variant for these recipes: the defaults and each compiled one with CUDA graphs (``-compile-graphs``)
    and with Inductor's static launcher for user Triton kernels (``-compile-static``)."""
    out = variant_names(recipe_names)
    compiled = [v for v in out if v.endswith("-compile")]
    return out + [f"{v}-graphs" for v in compiled] + [f"{v}-static" for v in compiled]


def parse_args(argv):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=2048, help=f"model preset: {', '.join(map(str, PRESETS))} (hidden "
                   "size; default 2048); ignored on --device cpu (tiny smoke model)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: per preset)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 4; cpu 2)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048; cpu 64)")
    p.add_argument("--steps", type=int, default=None, help="steps per variant (default 15; cpu 3)")
    p.add_argument("--warmup", type=int, default=None,
                   help="steps left out of the median (default 5; cpu 1); must be < --steps")
    p.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default 3e-4; cpu 1e-3)")
    p.add_argument("--variants", default=None,
                   help="comma-separated variants (default: bf16, bf16-compile, <recipe>, <recipe>-compile for each "
                        "of --recipes, torchao-compile)")
    p.add_argument("--recipes", default=DEFAULT_RECIPES,
                   help=f"lowbit recipes of the default variants (default {DEFAULT_RECIPES}; any of "
                        f"{', '.join(QUANTIZED_NAMES)})")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="cuda (the benchmark; default when present) or cpu (a smoke test on a tiny model)")
    p.add_argument("--compile-on-cpu", action="store_true", help="run the compile variants on --device cpu too")
    p.add_argument("--on-nonfinite", default="raise", metavar="{raise,skip,ignore,off}",
                   help="the lowbit variants' NaN-sentry policy (lowbit.autocast's on_nonfinite; default raise, "
                        "lowbit's default; off: no sentry, nothing recorded or checked)")
    p.add_argument("--fuse-mlp", action="store_true",
                   help="convert the lowbit variants with lowbit.convert(..., fuse_mlp=True): each gated MLP a "
                        "SwiGLUMLP with its RMSNorm moved in (fused into fc1's quantizer under fp8-block)")
    p.add_argument("--fuse-qkv", action="store_true",
                   help="convert the lowbit variants with lowbit.convert(..., fuse_qkv=True): each attention's q, k, "
                        "v projections one QKVLinear (one GEMM inside autocast)")
    p.add_argument("--rounds", type=int, default=1,
                   help="split each variant's timed steps into this many rounds that alternate between the variants "
                        "(all built and warmed up first, all live at once: no peak memory); default 1: one variant "
                        "after another")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="run each variant in a fresh Python process of its own (default: on CUDA without --rounds; "
                        "off on the CPU)")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="write the table (markdown) to FILE and the rows (JSON) to FILE.json")
    return p.parse_args(argv)


def resolve(args) -> dict:
    """Check the arguments and fill in the defaults; raises ValueError on bad input."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here (pass --device cpu for the smoke test)")
    if device == "cpu":
        model = dict(CPU_SMOKE)
    else:
        if args.size not in PRESETS:
            raise ValueError(f"--size: expected one of {', '.join(map(str, PRESETS))}, got {args.size}")
        model = dict(PRESETS[args.size])
    run = dict(CPU_RUN if device == "cpu" else CUDA_RUN)
    for k in ("batch", "seq", "steps", "warmup", "lr"):
        if getattr(args, k) is not None:
            run[k] = getattr(args, k)
    if args.layers is not None:
        model["layers"] = args.layers
    for k, v in (("layers", model["layers"]), ("batch", run["batch"]), ("seq", run["seq"]),
                 ("steps", run["steps"])):
        if v < 1:
            raise ValueError(f"--{k}: expected an integer >= 1, got {v}")
    if run["warmup"] < 0 or run["warmup"] >= run["steps"]:
        raise ValueError(f"--warmup: expected 0 <= warmup < steps ({run['steps']}), got {run['warmup']}")
    if not 1 <= args.rounds <= run["steps"] - run["warmup"]:
        raise ValueError(f"--rounds: expected 1 <= rounds <= the timed steps ({run['steps'] - run['warmup']}), got "
                         f"{args.rounds}")
    if not (run["lr"] > 0 and math.isfinite(run["lr"])):
        raise ValueError(f"--lr: expected a positive number, got {run['lr']}")
    if args.on_nonfinite not in ON_NONFINITE:
        raise ValueError(f"--on-nonfinite: expected one of {', '.join(ON_NONFINITE)}, got {args.on_nonfinite!r}")
    known = QUANTIZED_NAMES
    recipe_names = _split(args.recipes)
    for r in recipe_names:
        if r not in known:
            raise ValueError(f"--recipes: unknown recipe {r!r}; expected some of {', '.join(known)}")
    valid = all_variant_names(known)
    variants = _split(args.variants) if args.variants is not None else variant_names(recipe_names)
    if not variants:
        raise ValueError("--variants: empty list")
    for v in variants:
        if v not in valid:
            raise ValueError(f"--variants: unknown variant {v!r}; expected some of {', '.join(valid)}")
    variants = list(dict.fromkeys(variants))  # de-duplicated, order kept
    isolate = args.isolate if args.isolate is not None else device == "cuda" and args.rounds == 1
    static = [v for v in variants if v.endswith("-compile-static")]
    if static and not isolate:
        raise ValueError(f"--variants: {static[0]} runs in a process of its own (Inductor reads its launcher setting "
                         "from the environment when the process starts); pass --isolate")
    if isolate and args.rounds > 1:
        raise ValueError(f"--isolate: the variants of --rounds {args.rounds} alternate in one process; pass "
                         "--no-isolate or --rounds 1")
    return dict(device=device, model=model, variants=variants, compile_on_cpu=args.compile_on_cpu,
                size=None if device == "cpu" else args.size, on_nonfinite=args.on_nonfinite, rounds=args.rounds,
                fuse_mlp=args.fuse_mlp, fuse_qkv=args.fuse_qkv, isolate=isolate, **run)


# ------------------------------------------------------------------------------------------------
# the user's loop
# ------------------------------------------------------------------------------------------------
def build_model(m: dict, seq: int, device: str):
    """A random-init ``LlamaForCausalLM`` of shape ``m`` in FP32, from the fixed seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=m["vocab"], hidden_size=m["hidden"], intermediate_size=m["intermediate"],
                      num_hidden_layers=m["layers"], num_attention_heads=m["heads"],
                      num_key_value_heads=m["heads"], max_position_embeddings=seq, tie_word_embeddings=False,
                      attn_implementation="sdpa")
    torch.manual_seed(SEED)
    return LlamaForCausalLM(cfg).to(device)


def _torchao_convert(model):
    from torchao.float8 import convert_to_float8_training

    # lm_head stays high precision (as lowbit.convert keeps it, and as torchao's own examples filter it)
    convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: "lm_head" not in fqn)
    return model


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class _VariantRun:
    """One variant's model, optimizer and step times: :meth:`start` builds it and runs its warm-up steps,
    :meth:`steps` times more, :meth:`row` gives the measurements (or why not), :meth:`close` frees it. A failure in
    any of them is kept as the row's status (the benchmark goes on)."""

    def __init__(self, name: str, cfg: dict, ids: torch.Tensor, log):
        self.name, self.cfg, self.ids, self.log = name, cfg, ids, log
        self.graphs = name.endswith("-compile-graphs")
        self.compiled = self.graphs or name.endswith(("-compile", "-compile-static"))
        self.base = name.split("-compile")[0] if self.compiled else name
        self.recipe = from_name(self.base) if self.base not in ("bf16", "torchao") else None
        self.model = self.opt = self.fwd = self.loss = None
        self.step_s, self.host_s, self.failed, self.peak = [], [], None, None

    def _guard(self, fn, *a):
        if self.failed is not None:
            return
        try:
            fn(*a)
        except Exception as e:  # report the variant, never stop the benchmark
            msg = (str(e).strip().splitlines() or [""])[0].strip()
            self.failed = f"failed: {type(e).__name__}: {msg}"[:300]
            self.log(f"[bench model] {self.name}: {self.failed}")
            self.close()

    def start(self, reset: bool) -> None:
        """Build the variant (``reset``: from a clean torch.compile cache) and run its warm-up steps."""
        self._guard(self._start, reset)

    def _start(self, reset: bool) -> None:
        import lowbit.nn

        device = self.cfg["device"]
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        if self.compiled and reset:
            torch.compiler.reset()  # each variant compiles its own fresh model, from a clean cache
        self.model = build_model(self.cfg["model"], self.cfg["seq"], device)
        if self.recipe is not None:
            lowbit.nn.convert(self.model, recipe=self.recipe, fuse_mlp=self.cfg.get("fuse_mlp", False),
                              fuse_qkv=self.cfg.get("fuse_qkv", False))
        if self.base == "torchao":
            _torchao_convert(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=self.cfg["lr"], fused=device == "cuda")
        self.fwd = (torch.compile(self.model, mode="reduce-overhead" if self.graphs else None) if self.compiled
                    else self.model)
        self._steps(self.cfg["warmup"])

    def steps(self, n: int) -> None:
        """Time ``n`` more steps."""
        self._guard(self._steps, n)

    def _steps(self, n: int) -> None:
        import lowbit.nn

        cfg, device = self.cfg, self.cfg["device"]
        for _ in range(n):
            i = len(self.step_s)
            _sync(device)
            t0 = time.perf_counter()
            quant = (lowbit.nn.autocast(recipe=self.recipe, on_nonfinite=cfg["on_nonfinite"])
                     if self.recipe is not None else contextlib.nullcontext())
            with torch.autocast(device, dtype=torch.bfloat16), quant:
                self.loss = self.fwd(input_ids=self.ids, labels=self.ids).loss
            self.loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            t1 = time.perf_counter()
            _sync(device)
            t2 = time.perf_counter()
            self.step_s.append(t2 - t0)
            self.host_s.append(t1 - t0)
            self.log(f"[bench model] {self.name}: step {i + 1}/{cfg['steps']} {1e3 * (t2 - t0):.1f} ms (host "
                     f"{1e3 * (t1 - t0):.1f} ms){' (warm-up)' if i < cfg['warmup'] else ''}")
        if device == "cuda":
            self.peak = max(self.peak or 0.0, torch.cuda.max_memory_allocated() / 2**30)

    def row(self, peak: bool = True) -> dict:
        """The measurements (``peak``: with the peak memory, which other live variants would inflate)."""
        if self.failed is not None:
            return dict(variant=self.name, status=self.failed)
        cfg, timed = self.cfg, self.step_s[self.cfg["warmup"]:]
        med = statistics.median(timed)
        return dict(variant=self.name, status="ok", tokens_per_s=cfg["batch"] * cfg["seq"] / med, step_ms=1e3 * med,
                    host_ms=1e3 * statistics.median(self.host_s[cfg["warmup"]:]), first_step_s=self.step_s[0],
                    loss=float(self.loss.detach().float().item()), peak_gib=self.peak if peak else None,
                    static_launch=static_launch_on() if self.compiled else None)

    def close(self) -> None:
        self.model = self.opt = self.fwd = self.loss = None
        gc.collect()
        if self.cfg["device"] == "cuda":
            torch.cuda.empty_cache()


def _rounds(timed: int, rounds: int) -> list[int]:
    """``timed`` steps split into ``rounds`` near-equal parts (the earlier parts one longer)."""
    return [timed // rounds + (k < timed % rounds) for k in range(rounds)]


def run(cfg: dict, log=print) -> list[dict]:
    """Every variant of ``cfg`` (from :func:`resolve`) in order; rows with the ratios filled in. With
    ``cfg["rounds"]`` > 1 every variant is built and warmed up first, then their timed steps alternate in that many
    rounds (all variants live at once, so no peak memory is reported): drifts of the machine then land on every
    variant alike."""
    device = cfg["device"]
    ids = None if cfg.get("isolate") else _batch(cfg)
    rounds = cfg.get("rounds", 1)
    rows, runs = {}, []
    for name in cfg["variants"]:
        skip = None
        if name == "torchao-compile":
            try:
                import torchao.float8  # noqa: F401
            except Exception as e:
                skip = f"torchao not importable ({type(e).__name__})"
            if device == "cpu":
                skip = "torchao float8 is CUDA only"
        if skip is None and name.endswith("-compile") and device == "cpu" and not cfg["compile_on_cpu"]:
            skip = "compile variants off on CPU (--compile-on-cpu runs them)"
        if skip is not None:
            rows[name] = dict(variant=name, status=f"skipped: {skip}")
            log(f"[bench model] {name}: skipped: {skip}")
            continue
        log(f"[bench model] {name}: start")
        if cfg.get("isolate"):
            rows[name] = _run_in_process(cfg, name, log)  # (its process logs its row's line)
            continue
        r = _VariantRun(name, cfg, ids, log)
        if rounds == 1:  # (one variant at a time: each from a clean compile cache, its memory freed after it)
            r.start(reset=True)
            r.steps(cfg["steps"] - cfg["warmup"])
            rows[name] = _logged(r.row(), log)
            r.close()
        else:  # (one compile cache for all: a reset would drop the graphs of the variants built before)
            if not runs:
                torch.compiler.reset()
            r.start(reset=False)
            runs.append(r)
    for k, n in enumerate(_rounds(cfg["steps"] - cfg["warmup"], rounds) if runs else []):
        log(f"[bench model] round {k + 1}/{rounds}: {n} steps a variant")
        for r in runs:
            r.steps(n)
    for r in runs:
        rows[r.name] = _logged(r.row(peak=False), log)
        r.close()
    rows = [rows[name] for name in cfg["variants"]]
    refs = {r["variant"]: r["tokens_per_s"] for r in rows if r["status"] == "ok"}
    for r in rows:
        for ref in ("bf16", "bf16-compile", "torchao-compile"):
            if r["status"] == "ok" and ref in refs:
                r[f"x_{ref}"] = r["tokens_per_s"] / refs[ref]
    return rows


def _batch(cfg: dict) -> torch.Tensor:
    """The one seeded batch of token ids every step of every variant trains on."""
    g = torch.Generator().manual_seed(SEED)
    return torch.randint(0, cfg["model"]["vocab"], (cfg["batch"], cfg["seq"]), generator=g).to(cfg["device"])


ROW_PREFIX = "[bench model] row: "
"""The line a variant's own process ends its output with: its row as JSON."""


def _run_in_process(cfg: dict, name: str, log) -> dict:
    """The row of variant ``name`` run in a fresh Python process (:func:`variant_process_main`): its progress lines
    go to ``log`` as they come; a process that ends without its row is a failed row naming its exit status and its
    last line."""
    child = dict(cfg, variants=[name], isolate=False)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
               **(STATIC_LAUNCH_ENV if name.endswith("-compile-static") else {}))
    cmd = [sys.executable, "-c", "import sys; from lowbit.bench.model import variant_process_main as m; "
           "sys.exit(m())"]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    proc.stdin.write(json.dumps(child))
    proc.stdin.close()
    row, last = None, ""
    for line in proc.stdout:
        line = line.rstrip("\n")
        if line.startswith(ROW_PREFIX):
            row = json.loads(line[len(ROW_PREFIX):])
        elif line.strip():
            last = line.strip()
            log(line)
    rc = proc.wait()
    if row is None:
        row = dict(variant=name, status=f"failed: the variant's process exited with status {rc}: {last}"[:300])
    return row


def variant_process_main() -> int:
    """The body of one variant's own process (:func:`_run_in_process`): reads the config (JSON, one variant) from
    stdin, runs it, prints progress and then its row on a last line starting with :data:`ROW_PREFIX`."""
    cfg = json.loads(sys.stdin.read())
    row = run(cfg, log=lambda s: print(s, flush=True))[0]
    print(ROW_PREFIX + json.dumps(row), flush=True)
    return 0


def _logged(row: dict, log) -> dict:
    if row["status"] == "ok":
        log(f"[bench model] {row['variant']}: {row['tokens_per_s']:,.0f} tokens/s, step {row['step_ms']:.1f} ms, "
            f"host {row['host_ms']:.1f} ms, loss {row['loss']:.4f}"
            + (f", peak {row['peak_gib']:.2f} GiB" if row["peak_gib"] is not None else ""))
    return row


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------
def n_params(m: dict) -> int:
    h, f, v = m["hidden"], m["intermediate"], m["vocab"]
    return m["layers"] * (4 * h * h + 3 * h * f + 2 * h) + 2 * v * h + h


def header(cfg: dict) -> str:
    m = cfg["model"]
    if cfg["device"] == "cuda":
        dev = torch.cuda.get_device_name()
    else:
        dev = "cpu (smoke test: tiny model, timings mean nothing)"
    size = f"--size {cfg['size']}" if cfg["size"] else "tiny"
    return (f"## lowbit bench model — {dev}, torch {torch.__version__}, {datetime.date.today().isoformat()}, commit "
            f"{git_commit()}\n\nLlamaForCausalLM {size}: hidden {m['hidden']}, intermediate {m['intermediate']}, "
            f"{m['layers']} layers, {m['heads']} heads, vocab {m['vocab']} ({n_params(m) / 1e6:.1f}M parameters); "
            f"batch {cfg['batch']} x seq {cfg['seq']}; {cfg['steps']} steps, median over the last "
            f"{cfg['steps'] - cfg['warmup']}{_rounds_note(cfg)}; FP32 params, bf16 autocast, AdamW lr "
            f"{cfg['lr']:g}; lowbit's NaN sentry: on_nonfinite={cfg['on_nonfinite']!r}; "
            f"lowbit.convert fuse_mlp={cfg.get('fuse_mlp', False)}, fuse_qkv={cfg.get('fuse_qkv', False)}; "
            f"{_inductor_launcher(cfg)}")


def _rounds_note(cfg: dict) -> str:
    r = cfg.get("rounds", 1)
    if r > 1:
        return f" (timed in {r} rounds alternating between the variants)"
    return ", each variant in its own process" if cfg.get("isolate") else ", the variants in one process"


def static_launch_on() -> bool:
    """Whether Inductor launches user-defined Triton kernels (lowbit's blockwise quantizer under torch.compile) with
    its static launcher in this process: it takes less host time a launch than Triton's own, so the compiled rows
    depend on it."""
    from torch._inductor import config

    return bool(getattr(config, "use_static_cuda_launcher", False)
                and getattr(config, "static_launch_user_defined_triton_kernels", False))


def _inductor_launcher(cfg: dict) -> str:
    static = [v for v in cfg["variants"] if v.endswith("-compile-static")]
    return (f"Inductor's static launcher for user Triton kernels: {'on' if static_launch_on() else 'off'}"
            + (" (on in the -compile-static variants' processes)" if static else ""))


def markdown(cfg: dict, rows: list[dict]) -> str:
    refs = ["bf16", "bf16-compile"] + (["torchao-compile"] if any("x_torchao-compile" in r for r in rows) else [])
    cols = ["variant", "tokens/s", "step ms", "host ms", "first step s", "peak GiB", "loss"] + [f"x {r}" for r in refs]
    lines = [header(cfg), "", "| " + " | ".join(cols) + " |", "|" + "|".join(["---"] + ["---:"] * (len(cols) - 1))
             + "|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['variant']} | {r['status'].replace('|', '/')} |" + " |" * (len(cols) - 2))
            continue
        peak = "-" if r.get("peak_gib") is None else f"{r['peak_gib']:.2f}"
        first = f"{r['first_step_s']:.1f}" if "first_step_s" in r else "-"
        cells = [r["variant"], f"{r['tokens_per_s']:,.0f}", f"{r['step_ms']:.1f}", f"{r['host_ms']:.1f}", first, peak,
                 f"{r['loss']:.4f}"] + [f"{r[f'x_{ref}']:.2f}" if f"x_{ref}" in r else "-" for ref in refs]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """Run the benchmark; print progress, then the markdown table; returns the exit status (2: bad input)."""
    args = parse_args(argv)

    def body():
        cfg = resolve(args)
        rows = run(cfg, log=lambda s: print(s, flush=True))
        md = markdown(cfg, rows)
        print("\n" + md, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(md)
            with open(args.out + ".json", "w") as f:
                json.dump(dict(header=header(cfg), config={k: v for k, v in cfg.items()}, rows=rows), f, indent=1)
            print(f"[bench model] wrote {args.out} and {args.out}.json", flush=True)

    return exit_status(PROG, body)
