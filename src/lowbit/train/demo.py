"""``lowbit demo``: the tiny GPT trained briefly under BF16, FP8 blockwise and NVFP4, side by side.

On a CPU (the reference kernels) it trains the ``tiny`` preset for a few dozen steps — under five
minutes on two cores; with a CUDA GPU it picks the ``125m`` preset and more steps. It prints the
results table (final validation loss, gap to BF16, tokens/s, peak memory, bytes of the quantized
weights against BF16) and writes ``report/``: ``summary.json``, ``loss_curves.png``, ``table.md``.
"""

from __future__ import annotations

import argparse
import time

import torch

from .cli import os_error_line, positive_int
from .data import check_writable_dir
from .loop import PRESET_DEFAULTS, RECIPES, TrainConfig, train
from .report import format_table, plot_losses, table_rows, write_json

__all__ = ["run_demo", "main", "build_parser", "DEFAULT_RECIPES"]

DEFAULT_RECIPES = ("bf16", "fp8-block", "nvfp4")
# device -> (model, steps, batch_size, seq_len, eval_windows)
_AUTO = {"cpu": ("tiny", 100, 8, 128, 32), "cuda": ("125m", 300, 8, 1024, 64)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lowbit demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="report", help="report folder (default report/)")
    p.add_argument("--recipes", default=",".join(DEFAULT_RECIPES),
                   help=f"comma-separated, from {', '.join(RECIPES)} (default %(default)s)")
    p.add_argument("--model", default=None,
                   help=f"preset ({', '.join(PRESET_DEFAULTS)}); default tiny on CPU, 125m on a GPU")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="steps per recipe (default 100 on CPU, 300 on a GPU)")
    p.add_argument("--batch-size", type=positive_int, default=None)
    p.add_argument("--seq-len", type=positive_int, default=None)
    p.add_argument("--eval-windows", type=positive_int, default=None)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="text file or folder (default: the Python standard library)")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--no-progress", action="store_true")
    return p


def run_demo(argv=None) -> dict:
    """Run the demo (``argv``: its command-line arguments, default ``sys.argv[1:]``); returns the summary dict."""
    p = build_parser()
    a = p.parse_args(argv)
    recipes = [r.strip() for r in a.recipes.split(",") if r.strip()]
    bad = [r for r in recipes if r not in RECIPES]
    if bad or not recipes:
        raise ValueError(f"recipes: unknown recipe(s) {bad or a.recipes!r}; expected a comma-separated list from "
                         f"{', '.join(RECIPES)}")
    if "bf16" in recipes:  # the baseline first, so the gaps can be read as the runs finish
        recipes = ["bf16"] + [r for r in recipes if r != "bf16"]
    if a.model is not None and a.model not in PRESET_DEFAULTS:
        raise ValueError(f"model: unknown preset {a.model!r}; expected one of {', '.join(PRESET_DEFAULTS)}")
    dev = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    model, steps, bs, seq, ew = _AUTO[dev]
    model = a.model or model
    if a.model and a.model != _AUTO[dev][0]:  # another preset: its own sequence length and batch
        seq, bs = PRESET_DEFAULTS[model][:2]
    cfg = dict(model=model, steps=a.steps or steps, batch_size=a.batch_size or bs, seq_len=a.seq_len or seq,
               eval_windows=a.eval_windows or ew, device=dev, data=a.data, cache_dir=a.cache_dir, seed=a.seed,
               progress=not a.no_progress)
    cfg["eval_every"] = max(1, cfg["steps"] // 8)
    TrainConfig(**cfg).validate()  # every argument checked before the banner and the first run
    out = check_writable_dir(a.out, "out")  # the report is written after all the runs: check the folder first
    print(f"[lowbit demo] {model} on {dev}: {', '.join(recipes)}; {cfg['steps']} steps of "
          f"{cfg['batch_size']} x {cfg['seq_len']} tokens each -> {out}/", flush=True)
    t0 = time.perf_counter()
    runs = {}
    for r in recipes:
        runs[r] = train(TrainConfig(recipe=r, out_dir=str(out / "runs" / r), ckpt_every=0, save_final=False, **cfg))
    elapsed = time.perf_counter() - t0
    rows = table_rows(runs)
    table = format_table(rows)
    print("\n" + table, flush=True)
    summary = {"model": model, "device": runs[recipes[0]]["device"], "recipes": recipes, "config": cfg,
               "elapsed_s": elapsed, "table": rows, "runs": runs,
               "files": {"summary": str(out / "summary.json"), "plot": str(out / "loss_curves.png"),
                         "table": str(out / "table.md")}}
    plot_losses(runs, out / "loss_curves.png",
                title=f"lowbit demo: {model} on {summary['device']}, {cfg['steps']} steps")
    (out / "table.md").write_text(format_table(rows, markdown=True) + "\n")
    write_json(out / "summary.json", summary)
    print(f"\n[lowbit demo] done in {elapsed:.0f} s; wrote {out / 'summary.json'}, {out / 'loss_curves.png'}, "
          f"{out / 'table.md'}", flush=True)
    return summary


def main(argv=None) -> int:
    """Command entry: like :func:`run_demo`, but bad input and file-system errors print one error line and return 2."""
    import sys

    try:
        run_demo(argv)
    except ValueError as e:
        print(f"lowbit demo: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"lowbit demo: error: {os_error_line(e)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
