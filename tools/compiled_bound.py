"""What bounds lowbit's compiled ratio against torchao in the user's own loop: the GPU time of one compiled training
step of the ``lowbit bench model`` client, split by what the kernels do, and the best step each FP8 variant could
reach if its quantization cost nothing.

For each variant (``bf16-compile``, ``torchao-compile``, ``<recipe>-compile``; or eager: ``bf16``, ``<recipe>``) it
builds the client of ``lowbit bench model`` (HF Llama, random init, FP32 parameters, ``torch.autocast`` bf16, fused
AdamW; ``--fuse-mlp`` as there), compiles it with ``torch.compile(model)`` (the ``-compile`` variants), runs
``--warmup`` steps and ``--steps`` timed ones (step ms: their median, with a synchronize around each; host ms:
until the step is enqueued, as ``lowbit bench model`` measures), then profiles ``--steps`` more with
``torch.profiler`` and sums the device time of every kernel by the operator that launched it:

- ``fp8 gemm``: ``aten::_scaled_mm`` / ``aten::_scaled_mm_v2`` (cuBLAS FP8, tensorwise or blockwise scales);
- ``16-bit gemm``: ``aten::mm`` / ``addmm`` / ``bmm`` (the LM head, which every variant keeps in BF16);
- ``attention``: SDPA's kernels (cuDNN / flash / efficient);
- ``optimizer``: the fused AdamW step;
- ``quantizer``: lowbit's quantizer kernels that run in a pass of their own (:data:`QUANTIZER_KERNEL`);
- ``other``: everything else: norms, RoPE, SwiGLU, residual adds, the loss, casts, and the FP8 variants' other
  quantization (torchao's and per-tensor casts Inductor fuses, lowbit's quantizers fused into norms or SwiGLU).

The bound: an FP8 variant's step cannot take less GPU time than its own GEMMs, attention and optimizer plus the
least ``other`` time of any row measured (``bf16-compile``'s is the same model's norms, RoPE, SwiGLU and loss with
no quantization at all; a peer that fuses its casts may need less; ``quantizer`` is not in it): that is its step with
quantization free (fused into its neighbours at zero cost). ``best x torchao`` = torchao's measured step / that
bound: the most the variant could gain over torchao with the GEMM kernels it runs. A target above it needs faster
GEMMs (or fewer), not less quantization overhead.

Quantization is not free: every GEMM operand must be written in FP8 at least once per layout its GEMMs read. The
floors put that traffic back at the GPU's peak DRAM bandwidth (``--dram-tbps``; H100 3.35, H200 4.8 TB/s by
default): **floor** with each distinct operand quantized once in a pass of its own (read in the dtype it comes in,
two FP8 copies written: :func:`quant_traffic_bytes`), **fused floor** with the activations' and gradients' reads
fused away (the quantization inside the kernel that produces them; the FP32 weights are still read). A target above
``fused x torchao`` needs faster GEMMs, whatever the quantization does. ``floor x torchao GPU`` and ``fused x torchao
GPU`` divide torchao's GPU time instead of its step: the bounds where neither step waits on the host (CUDA graphs,
``mode="reduce-overhead"``). The floors are given for the rows whose quantization runs in passes of its own
(``quantizer`` > 0): a row whose casts are fused into ``other`` already counts them there.

An eager variant's bound is its GPU time: with no host time at all its step could not be shorter. ``best x bf16`` =
``bf16``'s measured step / that GPU time: the most the eager variant could gain over BF16 eager with its kernels.

    PYTHONPATH=src python tools/compiled_bound.py [--size 2048] [--layers N]
        [--variants bf16-compile,torchao-compile,fp8-current-compile,fp8-block-compile] [--steps 6] [--top N]
        [--host N] [--on-nonfinite raise|skip|ignore|off] [--fuse-mlp] [--dram-tbps T] [--one-process]
        [--out FILE]

``--host N`` also lists each variant's N largest host costs a step (self CPU time under the profiler, by operator,
Inductor kernel launcher or driver call): where a host-bound compiled step spends its time.

Each variant runs in a fresh Python process of its own (``--one-process``: all in this one), as in
``lowbit bench model``: a compiled step measured after another variant in the same process runs slower.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from lowbit.nn.state import ON_NONFINITE
from lowbit.recipes import QUANTIZED_NAMES

CLASSES = ("fp8 gemm", "16-bit gemm", "attention", "optimizer", "quantizer", "other")
QUANTIZER_KERNEL = re.compile(r"(amax|amax_rht|tensorwise|rowscale|blockwise|blockwise_persistent|mxfp8|nvfp4)_kernel")
"""lowbit's quantizer kernels, in a pass of their own (a quantization fused into a norm's, SwiGLU's or RoPE's kernel,
and Inductor's own casts, stay in ``other``)."""


def classify(op_name: str, kernel_name: str = "") -> str:
    """The class of the kernel ``kernel_name`` launched by the operator (or Inductor kernel) named ``op_name``."""
    n = op_name.lower()
    if "_scaled_mm" in n:
        return "fp8 gemm"
    if n in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul"):
        return "16-bit gemm"
    if "attention" in n or "flash" in n or "cudnn" in n or "fmha" in n:
        return "attention"
    if "adam" in n or "multi_tensor" in n or "optimizer" in n:
        return "optimizer"
    return "quantizer" if QUANTIZER_KERNEL.fullmatch(kernel_name) else "other"


def kernel_split(prof, steps: int) -> tuple[dict[str, float], dict[tuple[str, str], list]]:
    """(device milliseconds a step of each class, ``{(class, kernel name): [ms a step, launches a step]}``) from a
    finished ``torch.profiler.profile``."""
    out = dict.fromkeys(CLASSES, 0.0)
    per_kernel: dict[tuple[str, str], list] = {}
    for evt in prof.events():
        kernels = getattr(evt, "kernels", None) or []
        for k in kernels:
            c = classify(evt.name, k.name)
            out[c] += k.duration / 1e3  # (us -> ms)
            acc = per_kernel.setdefault((c, k.name), [0.0, 0])
            acc[0] += k.duration / 1e3 / steps
            acc[1] += 1 / steps
    return {c: v / steps for c, v in out.items()}, per_kernel


def top_kernels(per_kernel: dict[tuple[str, str], list], cls: str, n: int) -> list[dict]:
    """The ``n`` kernels of class ``cls`` with the most device time a step, largest first."""
    rows = [dict(kernel=name, ms=ms, launches=launches) for (c, name), (ms, launches) in per_kernel.items()
            if c == cls]
    return sorted(rows, key=lambda r: -r["ms"])[:n]


def host_top(averages, steps: int, n: int) -> list[dict]:
    """The ``n`` host (CPU) costs of a profiled step with the most self time, largest first: ``{name, ms, calls}`` a
    step, from ``torch.profiler``'s ``key_averages()`` (operators, Inductor's kernel launchers, the CUDA driver's
    launch calls, Dynamo's guard evaluation; self time: a caller's line leaves out what its callees' lines show)."""
    rows = [dict(name=e.key, ms=e.self_cpu_time_total / 1e3 / steps, calls=e.count / steps) for e in averages]
    return sorted(rows, key=lambda r: -r["ms"])[:n]


def build(variant: str, size: int, layers: int | None, fuse_mlp: bool = False):
    """(model, compiled where ``variant`` ends in ``-compile``; its recipe or None; optimizer; bench config) of
    ``variant`` on CUDA."""
    import torch

    import lowbit
    from lowbit.bench import model as bench_model
    from lowbit.recipes import from_name

    args = ["--size", str(size)] + (["--layers", str(layers)] if layers else [])
    cfg = bench_model.resolve(bench_model.parse_args(args))
    model = bench_model.build_model(cfg["model"], cfg["seq"], "cuda")
    base = variant.removesuffix("-compile")
    recipe = None
    if base == "torchao":
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, module_filter_fn=lambda m, name: name != "lm_head")
    elif base != "bf16":
        recipe = from_name(base)
        lowbit.convert(model, recipe=recipe, fuse_mlp=fuse_mlp)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    return (torch.compile(model) if variant.endswith("-compile") else model), recipe, opt, cfg


def measure(variant: str, size: int, layers: int | None, warmup: int, steps: int, log, top: int = 0,
            on_nonfinite: str = "raise", host: int = 0, fuse_mlp: bool = False) -> dict:
    """The row of ``variant``: median step ms (warm, unprofiled) and the profiled GPU split (with ``top``: its
    ``top`` largest "other" kernels under ``other_top``; with ``host``: its ``host`` largest host costs under
    ``host_top``)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import lowbit

    torch.compiler.reset()
    fwd, recipe, opt, cfg = build(variant, size, layers, fuse_mlp)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["model"]["vocab"], (cfg["batch"], cfg["seq"]), generator=g).cuda()

    def step():
        quant = (lowbit.autocast(recipe=recipe, on_nonfinite=on_nonfinite) if recipe is not None
                 else contextlib.nullcontext())
        with torch.autocast("cuda", dtype=torch.bfloat16), quant:
            loss = fwd(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times, enqueued = [], []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        enqueued.append(1e3 * (time.perf_counter() - t0))
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
        log(f"[compiled_bound] {variant}: step {i + 1}/{warmup + steps} {times[-1]:.1f} ms "
            f"(host {enqueued[-1]:.1f} ms)")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    split, per_kernel = kernel_split(prof, steps)
    row = dict(variant=variant, step_ms=statistics.median(times[warmup:]), host_ms=statistics.median(enqueued[warmup:]),
               gpu_ms=sum(split.values()), **split)
    if top:
        row["other_top"] = top_kernels(per_kernel, "other", top)
    if host:
        row["host_top"] = host_top(prof.key_averages(), steps, host)
    return row


PEAK_DRAM_TBPS = {"H100": 3.35, "H200": 4.8}
"""Peak DRAM bandwidth in TB/s by GPU model (H100 SXM, HBM3; H200, HBM3e), matched in the device's name."""


def quant_traffic_bytes(model: dict, tokens: int, fused: bool) -> int:
    """The least DRAM traffic of one training step's FP8 quantization in the bench-model client (HF Llama, FP32
    parameters under bf16 autocast), for a recipe that writes two FP8 copies of every GEMM operand (one per layout its
    GEMMs read; 1 byte an element, scales left out). Each distinct operand is quantized once (q, k and v share their
    input, gate and up theirs). ``fused=False`` adds one read of each operand in the dtype it comes in: the norms'
    outputs and the weights FP32, attention's and SwiGLU's outputs and all output gradients BF16; ``fused=True``
    leaves out the reads of the activations and gradients (quantized inside the kernels that produce them), the
    weights' stay (the optimizer writes them in FP32)."""
    h, f, t = model["hidden"], model["intermediate"], tokens
    kv = h * model.get("kv_heads", model["heads"]) // model["heads"]
    # (elements, bytes an element as it comes in)
    acts = [(t * h, 4), (t * h, 2), (t * h, 4), (t * f, 2)]  # attention's norm, attention, the MLP's norm, SwiGLU
    # the output gradients of q, k, v, o, gate, up, down
    grads = [(t * h, 2), (t * kv, 2), (t * kv, 2), (t * h, 2), (t * f, 2), (t * f, 2), (t * h, 2)]
    weights = [(h * h, 4), (kv * h, 4), (kv * h, 4), (h * h, 4), (f * h, 4), (f * h, 4), (h * f, 4)]
    per_layer = sum(2 * n + (0 if fused else n * b) for n, b in acts + grads) + sum(2 * n + n * b for n, b in weights)
    return model["layers"] * per_layer


def bounds(rows: list[dict], floors_ms: tuple[float, float] | None = None) -> list[dict]:
    """Each FP8 row with its bound. A compiled row: ``bound_ms`` (its step with free quantization, see the module
    docstring) and ``best_x_torchao``, from the bf16-compile and torchao-compile rows; with ``floors_ms`` (the
    quantization's traffic time unfused and fused, ms) a lowbit row also gets ``floor_ms`` / ``floor_x_torchao`` and
    ``fused_floor_ms`` / ``fused_x_torchao``: its bound plus that time, against torchao's step; and
    ``floor_x_torchao_gpu`` / ``fused_x_torchao_gpu``, against torchao's GPU time: the most it could gain where
    neither step waits on the host (CUDA graphs). An eager row: ``best_x_bf16``,
    the ``bf16`` row's step over the row's GPU time (the most it could gain over BF16 eager with no host time at
    all), and ``x_bf16``."""
    by = {r["variant"]: r for r in rows}
    compiled = [r for r in rows if r["variant"].endswith("-compile")]
    ao = by.get("torchao-compile")
    if compiled and ("bf16-compile" not in by or ao is None):
        raise ValueError("--variants: the compiled bound needs bf16-compile and torchao-compile")
    eager = [r for r in rows if not r["variant"].endswith("-compile") and r["variant"] != "bf16"]
    if eager and "bf16" not in by:
        raise ValueError("--variants: an eager variant's bound needs bf16")
    least_other = min((r["other"] for r in compiled), default=0.0)
    for r in compiled:
        if r["variant"] == "bf16-compile":
            continue
        r["bound_ms"] = r["fp8 gemm"] + r["16-bit gemm"] + r["attention"] + r["optimizer"] + least_other
        r["best_x_torchao"] = ao["step_ms"] / r["bound_ms"]
        r["x_torchao"] = ao["step_ms"] / r["step_ms"]
        if floors_ms is not None and r.get("quantizer", 0.0) > 0:
            r["floor_ms"] = r["bound_ms"] + floors_ms[0]
            r["floor_x_torchao"] = ao["step_ms"] / r["floor_ms"]
            r["fused_floor_ms"] = r["bound_ms"] + floors_ms[1]
            r["fused_x_torchao"] = ao["step_ms"] / r["fused_floor_ms"]
            r["floor_x_torchao_gpu"] = ao["gpu_ms"] / r["floor_ms"]
            r["fused_x_torchao_gpu"] = ao["gpu_ms"] / r["fused_floor_ms"]
    for r in eager:
        r["best_x_bf16"] = by["bf16"]["step_ms"] / r["gpu_ms"]
        r["x_bf16"] = by["bf16"]["step_ms"] / r["step_ms"]
    return rows


def _cell(r: dict, key: str) -> str:
    return f"{r[key]:.2f}" if key in r else ""


def table(rows: list[dict]) -> str:
    head = ("| variant | step ms | host ms | GPU ms | " + " | ".join(CLASSES) + " | bound ms | x torchao | "
            "best x torchao | floor x torchao | fused x torchao | floor x torchao GPU | fused x torchao GPU | x bf16 | "
            "best x bf16 |\n|---|" + "---:|" * (len(CLASSES) + 12) + "\n")
    lines = []
    for r in rows:
        cells = [f"{r['step_ms']:.1f}", f"{r['host_ms']:.1f}", f"{r['gpu_ms']:.1f}"] + [f"{r[c]:.1f}" for c in CLASSES]
        cells += [f"{r['bound_ms']:.1f}" if "bound_ms" in r else ""]
        cells += [_cell(r, k) for k in ("x_torchao", "best_x_torchao", "floor_x_torchao", "fused_x_torchao",
                                        "floor_x_torchao_gpu", "fused_x_torchao_gpu", "x_bf16", "best_x_bf16")]
        lines.append(f"| {r['variant']} | " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"


def floors(size: int, layers: int | None, tbps: float | None, device_name: str) -> tuple[float, float] | None:
    """(unfused, fused) quantization traffic of one step of the bench-model client (``--size``, ``--layers``) in ms
    at ``tbps`` TB/s (None: the GPU's peak by name), or None where that is not known."""
    from lowbit.bench import model as bench_model

    tbps = tbps or next((v for k, v in PEAK_DRAM_TBPS.items() if k in device_name), None)
    if tbps is None:
        return None
    model = dict(bench_model.PRESETS[size], **({"layers": layers} if layers else {}))
    tokens = bench_model.CUDA_RUN["batch"] * bench_model.CUDA_RUN["seq"]
    return tuple(quant_traffic_bytes(model, tokens, fused) / (tbps * 1e12) * 1e3 for fused in (False, True))


def row_in_process(argv: list[str], variant: str) -> dict:
    """The row of ``variant`` measured by this tool in a fresh Python process (``argv`` with ``--variants variant``
    and a temporary ``--out``); its progress lines pass through. Raises RuntimeError if the process fails."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        r = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--variants", variant, "--out", out])
        if r.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"compiled_bound: the process of variant {variant!r} exited with status {r.returncode}")
        with open(out) as f:
            return json.load(f)["rows"][0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=2048, help="the bench-model preset (hidden size; default 2048)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's)")
    p.add_argument("--variants", default="bf16-compile,torchao-compile,fp8-current-compile,fp8-block-compile",
                   help="comma-separated variants: <name>-compile (compiled; bf16-compile and torchao-compile are "
                        "needed) or <name> (eager; bf16 is needed)")
    p.add_argument("--warmup", type=int, default=4, help="steps before the timed ones (the first compiles)")
    p.add_argument("--steps", type=int, default=6, help="timed steps (their median), then as many profiled")
    p.add_argument("--top", type=int, default=0, help="also list each variant's N largest \"other\" kernels")
    p.add_argument("--host", type=int, default=0, help="also list each variant's N largest host (CPU) costs a step "
                   "(self time by operator or call; under the profiler, which adds its own)")
    p.add_argument("--on-nonfinite", default="raise", choices=ON_NONFINITE,
                   help="the lowbit variants' NaN-sentry policy (default raise, lowbit's default)")
    p.add_argument("--fuse-mlp", action="store_true",
                   help="convert the lowbit variants with lowbit.convert(..., fuse_mlp=True), as bench model does")
    p.add_argument("--dram-tbps", type=float, default=None,
                   help="the GPU's peak DRAM bandwidth in TB/s for the floors (default: by name, "
                        + ", ".join(f"{k} {v}" for k, v in PEAK_DRAM_TBPS.items()) + "; else no floors)")
    p.add_argument("--one-process", action="store_true",
                   help="measure every variant in this process (default: each in a fresh process of its own, as "
                        "lowbit bench model does: a compiled step measured after another variant runs slower)")
    p.add_argument("--out", default=None, help="write the rows as JSON to this file")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("compiled_bound: needs a CUDA GPU", file=sys.stderr)
        return 2
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    known = {n for r in ("bf16", *QUANTIZED_NAMES) for n in (r, f"{r}-compile")} | {"torchao-compile"}
    bad = [v for v in variants if v not in known]
    if bad:
        raise ValueError(f"--variants: unknown {bad}; expected some of {', '.join(sorted(known))}")
    if args.one_process or len(variants) == 1:
        rows = [measure(v, args.size, args.layers, args.warmup, args.steps, lambda m: print(m, flush=True),
                        args.top, args.on_nonfinite, args.host, args.fuse_mlp) for v in variants]
    else:
        rows = [row_in_process(argv if argv is not None else sys.argv[1:], v) for v in variants]
    if len(variants) > 1:
        rows = bounds(rows, floors(args.size, args.layers, args.dram_tbps, torch.cuda.get_device_name()))
    print(f"{torch.cuda.get_device_name()}, size {args.size}, layers {args.layers or 'preset'}, lowbit "
          f"on_nonfinite={args.on_nonfinite!r}, fuse_mlp={args.fuse_mlp}")
    print(table(rows))
    for r in rows:
        for k in r.get("other_top", []):
            print(f"{r['variant']}: other {k['ms']:7.3f} ms {k['launches']:6.1f} launches  {k['kernel'][:110]}")
    for r in rows:
        for h in r.get("host_top", []):
            print(f"{r['variant']}: host {h['ms']:7.3f} ms {h['calls']:6.1f} calls  {h['name'][:110]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), size=args.size, layers=args.layers,
                           on_nonfinite=args.on_nonfinite, fuse_mlp=args.fuse_mlp, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
