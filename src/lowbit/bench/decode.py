"""``lowbit bench decode``: ``generate()`` tokens/s of a HuggingFace ``LlamaForCausalLM``, BF16 against lowbit's FP8
linears, eager and compiled, in one run.

Each variant builds the random-init BF16 model of :mod:`lowbit.bench.prefill` afresh (nothing downloaded), then
times ``model.generate(prompt, max_new_tokens=N)`` (greedy, exactly N new tokens) of one batch of ``--batch``
prompts of ``--prompt`` random tokens. Variants (``--variants``, comma-separated; each ``<recipe>[:compiled]``):

* ``bf16``: the model as built; ``fp8-block`` (any lowbit recipe name): ``lowbit.convert(model, fuse_qkv=True,
  fuse_mlp=True)``, ``generate()`` inside ``lowbit.autocast(recipe=...)`` and one ``lowbit.nn.cached_weights``
  block (the weights quantized once, by the first untimed call's prefill, as a server keeps them);
* ``:compiled``: a static KV cache (``cache_implementation="static"``), with which transformers compiles the decode
  step itself (its ``CompileConfig``: ``torch.compile(mode="reduce-overhead")``, CUDA graphs). CUDA only.

Columns: **tokens/s**: new tokens (batch x N) over the median time of ``--reps`` calls, each waited for (the prefill
included, as a user's call has it); **x bf16**: against the ``bf16`` variant of the same mode (eager or compiled);
**same tokens**: the share of the new tokens equal to that variant's (a random-init model's logits are
nearly flat, so FP8's roundings change its greedy path from the first token: near 0% is expected there);
**kept**: forwards whose Python took a kept weight (a compiled variant's graph replays are not counted);
**peak GiB**. ``--device cpu`` runs a tiny model, eager only: a smoke test of the code path.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import time

import torch

from . import git_commit
from .prefill import SEED, SIZES, build_model, checked_config, failed_status, release

PROG = "lowbit bench decode"
DEFAULT_VARIANTS = "bf16,fp8-block,bf16:compiled,fp8-block:compiled"


def parse_variant(v: str) -> tuple[str, bool]:
    """``"<recipe>[:compiled]"`` -> (recipe name, compiled); ValueError naming the rule otherwise."""
    from ..recipes import NAMES

    name, _, opt = v.partition(":")
    if name not in NAMES or opt not in ("", "compiled"):
        raise ValueError(f"--variants: expected <recipe>[:compiled] with a recipe from {', '.join(NAMES)}, "
                         f"got {v!r}")
    return name, opt == "compiled"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=SIZES, default=None, help="model shape (default 1b; cpu: tiny)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 256; cpu 16)")
    p.add_argument("--new", type=int, default=None, help="new tokens a call (default 128; cpu 8)")
    p.add_argument("--batch", type=int, default=1, help="prompts a call (default 1)")
    p.add_argument("--variants", default=None, help=f"comma-separated (default {DEFAULT_VARIANTS}; cpu: the eager "
                                                    "ones)")
    p.add_argument("--reps", type=int, default=5, help="timed calls a variant (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls first (default 2: kernels and graphs compile)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="cuda (default when present) or cpu")
    return p.parse_args(argv)


def resolve(args: argparse.Namespace) -> dict:
    """The run's settings from the arguments, every one checked (ValueError naming it)."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device: cuda asked for, but torch sees no CUDA GPU")
    cpu = device == "cpu"
    size = args.size or ("tiny" if cpu else "1b")
    if cpu and size != "tiny":
        raise ValueError(f"--size: on the CPU only 'tiny' runs (a smoke test of the path), got {size!r}")
    prompt = args.prompt if args.prompt is not None else (16 if cpu else 256)
    new = args.new if args.new is not None else (8 if cpu else 128)
    for name, v, lo in (("--prompt", prompt, 1), ("--new", new, 1), ("--batch", args.batch, 1),
                        ("--reps", args.reps, 1), ("--warmup", args.warmup, 1)):
        if v < lo:
            raise ValueError(f"{name}: must be at least {lo}, got {v}")
    text = args.variants or (DEFAULT_VARIANTS if not cpu else "bf16,fp8-block")
    names = [v.strip() for v in text.split(",") if v.strip()]
    if not names:
        raise ValueError(f"--variants: no variant named in {text!r}")
    for v in names:
        if parse_variant(v)[1] and cpu:
            raise ValueError(f"--variants: {v!r} compiles CUDA graphs; on the CPU only eager variants run")
    return dict(device=device, size=size, model=SIZES[size], prompt=prompt, new=new, batch=args.batch,
                variants=names, reps=args.reps, warmup=args.warmup)


def run_variant(name: str, cfg: dict, ids: torch.Tensor, log) -> dict:
    """Build, warm up and time one variant: its row (``status`` "ok", or why it failed) and its new tokens."""
    from ..nn import autocast, cached_weights, convert
    from ..recipes import from_name

    recipe, compiled = parse_variant(name)
    dev, n = cfg["device"], cfg["new"]
    row = {"variant": name, "recipe": recipe, "compiled": compiled}
    model = None
    try:
        model = build_model(cfg["model"], cfg["prompt"] + n, dev)
        ctx, keep = contextlib.nullcontext, contextlib.nullcontext()
        if recipe != "bf16":
            convert(model, fuse_mlp=True, fuse_qkv=True)
            ctx = functools.partial(autocast, recipe=from_name(recipe))
            keep = cached_weights(model)
        kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        if compiled:
            kw["cache_implementation"] = "static"  # (transformers then compiles the decode step: CUDA graphs)

        def call():
            with ctx():
                return model.generate(ids, **kw)

        with keep:
            if dev == "cuda":
                torch.cuda.reset_peak_memory_stats()
            for _ in range(cfg["warmup"]):
                call()
            times, out = [], None
            for _ in range(cfg["reps"]):
                if dev == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = call()
                if dev == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
        if recipe != "bf16":
            row["kept"] = keep.reused
        row.update(status="ok", tokens_per_s=cfg["batch"] * n / statistics.median(times))
        if dev == "cuda":
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        row["tokens"] = out[:, ids.shape[1]:].cpu()
        log(f"[bench decode] {name}: {row['tokens_per_s']:.1f} tokens/s")
    except Exception as e:  # noqa: BLE001 - a failed variant is a row; the others still run
        row.update(status=failed_status(e))
        log(f"[bench decode] {name}: {row['status']}")
    finally:
        model = None
        torch.compiler.reset()  # (each variant compiles its own model; its graphs' pool goes with them)
        release(dev)
    return row


def compare(rows: list[dict]) -> None:
    """Each row's ``x_bf16`` and ``same_tokens`` against the ``bf16`` row of its mode."""
    base = {r["compiled"]: r for r in rows if r["recipe"] == "bf16" and r["status"] == "ok"}
    for r in rows:
        b = base.get(r["compiled"])
        if r["status"] != "ok" or b is None:
            continue
        r["x_bf16"] = r["tokens_per_s"] / b["tokens_per_s"]
        r["same_tokens"] = (r["tokens"] == b["tokens"]).float().mean().item()


def markdown(cfg: dict, rows: list[dict]) -> str:
    m = cfg["model"]
    dev = torch.cuda.get_device_name() if cfg["device"] == "cuda" else "CPU"
    lines = [f"## {PROG} — {dev}, torch {torch.__version__}, commit {git_commit()}", "",
             f"LlamaForCausalLM {cfg['size']} (hidden {m['hidden']}, {m['layers']} layers), BF16, batch "
             f"{cfg['batch']} x {cfg['prompt']} prompt tokens, {cfg['new']} new tokens a call; median of "
             f"{cfg['reps']} calls after {cfg['warmup']} untimed", "",
             "| variant | tokens/s | x bf16 | same tokens | kept | peak GiB |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['variant']} | {r['status']} | | | | |")
            continue
        x = f"{r['x_bf16']:.3f}" if "x_bf16" in r else "-"
        same = f"{r['same_tokens']:.1%}" if "same_tokens" in r else "-"
        peak = f"{r['peak_gib']:.2f}" if "peak_gib" in r else "-"
        lines.append(f"| {r['variant']} | {r['tokens_per_s']:.1f} | {x} | {same} | {r.get('kept', '-')} | {peak} |")
    return "\n".join(lines)


def run(cfg: dict, log=print) -> list[dict]:
    """Every variant's row (their new tokens dropped after the comparison)."""
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(1, cfg["model"]["vocab"], (cfg["batch"], cfg["prompt"]), generator=g).to(cfg["device"])
    log(f"[bench decode] {len(cfg['variants'])} variants, {cfg['size']}, {cfg['batch']} x {cfg['prompt']} prompt "
        f"tokens, {cfg['new']} new, on {cfg['device']}")
    rows = [run_variant(v, cfg, ids, log) for v in cfg["variants"]]
    compare(rows)
    for r in rows:
        r.pop("tokens", None)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg, rc = checked_config(PROG, resolve, args)
    if cfg is None:
        return rc
    rows = run(cfg)
    print("\n" + markdown(cfg, rows), flush=True)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
