"""``lowbit demo``: the tiny GPT trained briefly under BF16, FP8 blockwise and NVFP4, side by side.

On a CPU (the reference kernels) it trains the ``tiny`` preset for a few dozen steps — under five
minutes on two cores; with a CUDA GPU it picks the ``125m`` preset and more steps. It prints the
results table (final validation loss, gap to BF16, tokens/s, peak memory, bytes of the quantized
weights against BF16) and writes ``report/``: ``summary.json``, ``loss_curves.png``, ``table.md``
(the PNG only with matplotlib: ``pip install lowbit[train]``). A run that fails leaves no empty ``report/``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from .budget import check_activation_budget
from .cli import exit_status, positive_int
from .data import check_writable_dir
from .loop import PRESET_DEFAULTS, RECIPES, TrainConfig, train
from .report import PLOT_NOTE, format_table, table_rows, try_plot_losses, write_json

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
    check_activation_budget(TrainConfig(**cfg))
    made = _missing_dirs(Path(a.out) / "runs")  # the folders this demo creates: removed again if it fails, if empty
    out = check_writable_dir(a.out, "out")  # the report is written after all the runs: check the folder first
    try:
        return _run(out, model, recipes, cfg)
    except BaseException:  # (Ctrl-C included) no empty report/ left behind
        _remove_empty(made)
        raise


def _missing_dirs(path) -> list[Path]:
    """``path`` and those of its parents that do not exist yet (deepest first)."""
    p = Path(path).absolute()
    return [q for q in (p, *p.parents) if not q.exists()]


def _remove_empty(dirs: list[Path]) -> None:
    """Remove the folders in ``dirs`` (deepest first) that hold nothing but empty folders; keep any with a file."""
    for d in dirs:
        if not d.is_dir():
            continue
        for root, _subdirs, _files in os.walk(d, topdown=False):
            try:
                os.rmdir(root)  # fails (and is left) when it still holds something
            except OSError:
                pass


def _run(out: Path, model: str, recipes: list, cfg: dict) -> dict:
    print(f"[lowbit demo] {model} on {cfg['device']}: {', '.join(recipes)}; {cfg['steps']} steps of "
          f"{cfg['batch_size']} x {cfg['seq_len']} tokens each -> {out}/", flush=True)
    t0 = time.perf_counter()
    runs = {}
    for r in recipes:
        runs[r] = train(TrainConfig(recipe=r, out_dir=str(out / "runs" / r), ckpt_every=0, save_final=False, **cfg))
    elapsed = time.perf_counter() - t0
    rows = table_rows(runs)
    table = format_table(rows)
    print("\n" + table, flush=True)
    device = runs[recipes[0]]["device"]
    png = try_plot_losses(runs, out / "loss_curves.png",
                          title=f"lowbit demo: {model} on {device}, {cfg['steps']} steps")
    summary = {"model": model, "device": device, "recipes": recipes, "config": cfg,
               "elapsed_s": elapsed, "table": rows, "runs": runs,
               "files": {"summary": str(out / "summary.json"), "plot": None if png is None else str(png),
                         "table": str(out / "table.md")}}
    (out / "table.md").write_text(format_table(rows, markdown=True) + "\n")
    write_json(out / "summary.json", summary)
    if png is None:
        print(PLOT_NOTE, flush=True)
    wrote = [out / "summary.json", *([] if png is None else [png]), out / "table.md"]
    print(f"\n[lowbit demo] done in {elapsed:.0f} s; wrote {', '.join(map(str, wrote))}", flush=True)
    return summary


def main(argv=None) -> int:
    """Command entry: like :func:`run_demo`, but bad input and file-system errors print one error line and return 2."""
    return exit_status("lowbit demo", lambda: run_demo(argv))


if __name__ == "__main__":
    raise SystemExit(main())
