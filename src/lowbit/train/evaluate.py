"""``lowbit eval``: the validation loss of a ``lowbit train`` checkpoint under each attention variant.

The accuracy cost of quantized attention, measured on a trained model: the checkpoint is read once and its model
evaluated on the same validation windows once per attention variant (SDPA, INT8·BF16, INT8·FP8, FP8·FP8, ...),
under the run's own recipe (the GEMMs quantized as in training), and each loss is compared with SDPA's. The
windows, batches and forward context are ``lowbit train``'s validation (:func:`lowbit.train.loop.validation_loss`):
with the run's data, ``--eval-windows``, ``--batch-size`` and dtype, the ``sdpa`` row is the validation loss a
one-process run reported at its last step (a delayed-scaling run's checkpoint holds the amax histories its last
validation updated, so there it is close, not equal).

Every variant starts from the checkpoint's state (a delayed-scaling recipe updates its amax histories in every
forward), and its timed pass follows one untimed batch (kernel compilation, autotuning). Off CUDA, and for FP32
inputs, the quantized variants run ``lowbit.attention``'s reference backend: the kernels' quantization, in torch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from .. import recipes as lrecipes
from ..attention import select_backend
from ..models import GPT, AttentionChoice, GPTConfig
from . import checkpoint as ckpt
from .cli import command_errors, positive_int
from .data import check_writable_dir, load_corpus
from .loop import (
    PRESET_DEFAULTS,
    RECIPES,
    TrainConfig,
    check_divisible,
    computes_in_bf16,
    forward_contexts,
    setup_distributed,
    validation_loss,
)
from .report import text_table, write_json

__all__ = ["ATTENTION_VARIANTS", "BASELINE", "DEFAULT_VARIANTS", "parse_variants", "read_eval_checkpoint",
           "evaluate_attention", "format_eval_table", "add_eval_args", "run_eval", "main"]

ATTENTION_VARIANTS = {
    "sdpa": ("sdpa", "bf16", "bf16"),
    "int8-bf16": ("lowbit", "int8", "bf16"),
    "int8-fp8": ("lowbit", "int8", "fp8"),
    "fp8-bf16": ("lowbit", "fp8", "bf16"),
    "fp8-fp8": ("lowbit", "fp8", "fp8"),
    "bf16-fp8": ("lowbit", "bf16", "fp8"),
}
"""Variant name (``<qk>-<pv>``, or ``sdpa``) -> the ``(backend, qk, pv)`` of :class:`lowbit.models.AttentionChoice`,
which ``lowbit train --attention --attn-qk --attn-pv`` set."""

BASELINE = "sdpa"
"""The variant every gap is measured against; always evaluated, first."""

DEFAULT_VARIANTS = ("sdpa", "int8-bf16", "int8-fp8", "fp8-fp8")

# the fields of the checkpoint's ``train`` record that the evaluation reads
_TRAIN_KEYS = ("recipe", "model", "seq_len")


def parse_variants(variants) -> tuple[str, ...]:
    """The variant names of ``variants`` (a sequence of names or one comma-separated string), checked, with
    :data:`BASELINE` first (added where missing)."""
    names = variants.split(",") if isinstance(variants, str) else list(variants)
    names = [n.strip() if isinstance(n, str) else n for n in names]
    expected = f"a comma-separated list of {', '.join(ATTENTION_VARIANTS)}"
    if not names or names == [""]:
        raise ValueError(f"attention_variants: must be {expected}, got {variants!r}")
    for n in names:
        if n not in ATTENTION_VARIANTS:
            raise ValueError(f"attention_variants: unknown variant {n!r}; expected {expected}")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"attention_variants: each variant once, got {', '.join(map(repr, twice))} more than once")
    return (BASELINE, *(n for n in names if n != BASELINE))


def read_eval_checkpoint(path: str | os.PathLike, warn=print) -> tuple[dict, Path]:
    """``(checkpoint, its file)`` for ``path``: a run's out-dir gives its newest good checkpoint (``checkpoint.pt``,
    else the newest good one kept beside it, as ``lowbit train --resume`` reads it; what was skipped goes to
    ``warn``); a file gives that checkpoint or a ValueError (with the newest good one kept beside it), never another.
    Every check of :func:`lowbit.train.checkpoint.read_checkpoint` applies, and the fields evaluation reads."""
    path = Path(path)
    kw = dict(train_keys=_TRAIN_KEYS, warn=warn, arg="checkpoint")
    if path.is_dir():
        ck, path, skipped = ckpt.read_good_checkpoint(path / "checkpoint.pt", **kw)
        if skipped:
            warn(f"[lowbit] eval: skipped {' | '.join(skipped)}; using {path} (step {ck['step']})")
    else:
        ck = ckpt.read_named_checkpoint(path, **kw)
    where = f"checkpoint: checkpoint {str(path)!r}"
    recipe, seq_len = ck["train"]["recipe"], ck["train"]["seq_len"]
    if recipe not in RECIPES:
        raise ValueError(f"{where}: field 'train/recipe' must be one of {', '.join(RECIPES)}, got {recipe!r}")
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"{where}: field 'train/seq_len' must be an integer >= 1, got {seq_len!r}")
    try:
        GPTConfig.from_dict(ck["model_config"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: field 'model_config' is not a GPT config: {e}") from None
    return ck, path


def evaluate_attention(checkpoint: str | os.PathLike, variants=DEFAULT_VARIANTS, *, eval_windows: int = 64,
                       seq_len: int | None = None, batch_size: int | None = None, data: str | None = None,
                       cache_dir: str | None = None, device: str = "auto", dtype: str = "auto",
                       progress: bool = True, verbose: bool = True) -> dict:
    """Evaluate the checkpoint (a file, or a run's out-dir: :func:`read_eval_checkpoint`) under each attention
    variant (:data:`ATTENTION_VARIANTS`; :data:`BASELINE` always runs, first) on the same ``eval_windows`` validation
    windows of ``data`` (None: the standard-library corpus ``lowbit train`` defaults to) and return the results (what
    ``lowbit eval --json`` writes): one entry per variant in ``"variants"``, with its validation loss, its gap to the
    baseline in percent, its wall time and throughput. ``seq_len``: default the run's; ``batch_size``: windows per
    forward, default the model preset's (a run's validation batches are its ``--batch-size``); ``device``/``dtype``:
    as ``lowbit train``'s. Bad input is a ValueError naming the argument (or the checkpoint field), the rule and the
    value."""
    import lowbit.nn as lnn

    variants = parse_variants(variants)
    # the options lowbit train has too, under its rules (and error messages)
    TrainConfig(eval_windows=eval_windows, seq_len=seq_len, batch_size=batch_size, device=device,
                dtype=dtype).validate()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("WORLD_SIZE: lowbit eval runs in one process; start it without torchrun")
    bar = None
    say = print if verbose else (lambda msg: None)
    ck, path = read_eval_checkpoint(checkpoint, warn=say)
    recipe_name, preset = ck["train"]["recipe"], ck["train"]["model"]
    mcfg = GPTConfig.from_dict(ck["model_config"])
    seq_len = seq_len or ck["train"]["seq_len"]
    if seq_len > mcfg.max_seq_len:
        raise ValueError(f"seq_len: must be <= the model's max_seq_len ({mcfg.max_seq_len}), got {seq_len}")
    if batch_size is None:
        if preset not in PRESET_DEFAULTS:
            raise ValueError(f"batch_size: the checkpoint's model {preset!r} is not a preset with a default batch "
                             "size; pass --batch-size")
        batch_size = PRESET_DEFAULTS[preset][1]
    recipe = lrecipes.from_name(recipe_name)
    d = setup_distributed(device)
    bf16 = computes_in_bf16(dtype, d.device)
    corpus = load_corpus(data, cache_dir, verbose=verbose)
    corpus.check_seq_len(seq_len)
    offsets = corpus.val_offsets(eval_windows, seq_len)
    rows = {min(batch_size, len(offsets)), len(offsets) % batch_size} - {0}  # the windows of a full and a last batch
    check_divisible(recipe_name, recipe, {f"seq_len x {r} windows (tokens per batch)": seq_len * r for r in rows})

    model = GPT(mcfg).to(d.device)
    ckpt.apply_state(model, None, ck["model"], None)  # (a model of another shape fails here, before any work)
    amp, quantized = forward_contexts(recipe, d.device, bf16)
    n_batches = -(-len(offsets) // batch_size)
    tokens = len(offsets) * seq_len
    say(f"[lowbit] eval {path} (step {ck['step']}, model {preset}, recipe {recipe_name}) on {d.device}, "
        f"{'bf16' if bf16 else 'fp32'}: {len(offsets)} validation windows x {seq_len} tokens of "
        f"{corpus.meta['source']}, attention {', '.join(variants)}")
    if progress and verbose:
        from .progress import Progress

        bar = Progress(total=len(variants) * n_batches, desc="eval", unit="batch")
        say = bar.write

    def sync():
        if d.device.type == "cuda":
            torch.cuda.synchronize(d.device)

    results = []
    try:
        for j, name in enumerate(variants):
            backend, qk, pv = ATTENTION_VARIANTS[name]
            kernel = backend if backend == "sdpa" else select_backend(
                d.device, qk, pv, varlen=False, window=None, return_lse=False,
                dtype=torch.bfloat16 if bf16 else torch.float32)

            def tick(i, n, j=j, name=name):
                if bar is not None:
                    sync()  # (the bar shows finished batches, not queued ones)
                    bar.update(j * n + i, attention=name)

            with model.using_attention(AttentionChoice(backend, qk, pv)):
                validation_loss(model, corpus, offsets[:batch_size], seq_len, batch_size, d, amp, quantized)
                ckpt.apply_state(model, None, ck["model"], None)
                if recipe is not None:
                    lnn.nonfinite_events()  # (the warm-up's)
                torch.manual_seed(0)  # the same random draws, if any, for every variant
                sync()
                t0 = time.perf_counter()
                loss = validation_loss(model, corpus, offsets, seq_len, batch_size, d, amp, quantized, on_batch=tick)
                seconds = time.perf_counter() - t0
                events = len(lnn.nonfinite_events()) if recipe is not None else 0
            base = results[0]["val_loss"] if results else loss
            gap = 100.0 * (loss - base) / base if base else None
            results.append({"variant": name, "backend": backend, "qk": qk, "pv": pv, "kernel": kernel,
                            "val_loss": loss, "gap_pct": gap, "seconds": seconds, "tokens_per_s": tokens / seconds,
                            "nonfinite_events": events})
            gap_text = "" if name == BASELINE or gap is None else f" ({gap:+.4f}% vs {BASELINE})"
            say(f"[lowbit] eval {name}: val loss {loss:.6f}{gap_text} in {seconds:.2f} s"
                + (f"; {events} non-finite amax events" if events else ""))
    finally:
        if bar is not None:
            bar.close()
    return {
        "checkpoint": str(path), "step": ck["step"], "model": preset, "recipe": recipe_name,
        "model_config": mcfg.to_dict(), "device": str(d.device) if d.device.type == "cpu"
        else torch.cuda.get_device_name(d.device), "compute_dtype": "bf16" if bf16 else "fp32",
        "seq_len": seq_len, "batch_size": batch_size, "windows": len(offsets), "tokens": tokens, "data": corpus.meta,
        "baseline": BASELINE, "variants": results,
    }


def format_eval_table(result: dict) -> str:
    """The results of :func:`evaluate_attention` as an aligned text table."""
    head = ["attention", "kernel", "val loss", f"gap vs {result['baseline']}", "time", "tokens/s"]
    body = [[r["variant"], r["kernel"], f"{r['val_loss']:.6f}",
             "—" if r["variant"] == result["baseline"] or r["gap_pct"] is None else f"{r['gap_pct']:+.4f}%",
             f"{r['seconds']:.2f} s", f"{r['tokens_per_s']:,.0f}"] for r in result["variants"]]
    return text_table(head, body, left=2)


def add_eval_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``lowbit eval`` arguments to ``parser`` (returns it)."""
    p = parser
    p.add_argument("checkpoint", metavar="CKPT_OR_RUN_DIR",
                   help="a checkpoint written by lowbit train, or its out-dir (its newest good checkpoint)")
    p.add_argument("--attention-variants", default=",".join(DEFAULT_VARIANTS), metavar="LIST",
                   help=f"comma-separated, of {', '.join(ATTENTION_VARIANTS)} (<qk>-<pv>: lowbit.attention; "
                        f"{BASELINE}, the baseline of the gaps, always runs; default {','.join(DEFAULT_VARIANTS)})")
    p.add_argument("--eval-windows", type=positive_int, default=64, help="validation sequences (default 64)")
    p.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sequence (default: the run's)")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="sequences per forward (default: the model preset's, as lowbit train's)")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="the run's --data (default: the Python standard library's .py files, as lowbit train's)")
    p.add_argument("--cache-dir", default=None, help="token cache folder (default $LOWBIT_CACHE or ~/.cache/lowbit)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="compute dtype of the unquantized parts (auto: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the results to this JSON file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def run_eval(args: argparse.Namespace) -> dict:
    """Run ``lowbit eval`` from parsed arguments: evaluate, print the table, write ``--json``. Returns the results."""
    if args.json is not None:  # fail now, not after the evaluation, when the file cannot be written
        out = Path(args.json)
        if out.is_dir():
            raise ValueError(f"json: {str(out)!r} is a folder; pass a file name")
        check_writable_dir(out.parent, "json")
    result = evaluate_attention(args.checkpoint, args.attention_variants, eval_windows=args.eval_windows,
                                seq_len=args.seq_len, batch_size=args.batch_size, data=args.data,
                                cache_dir=args.cache_dir, device=args.device, dtype=args.dtype,
                                progress=not args.no_progress)
    print(format_eval_table(result), flush=True)
    if args.json is not None:
        write_json(args.json, result)
        print(f"[lowbit] results: {args.json}", flush=True)
    return result


def main(argv=None) -> int:
    """Command entry (``lowbit eval``): bad input and file-system errors are one error line, exit status 2."""
    p = add_eval_args(argparse.ArgumentParser(
        prog="lowbit eval", description="Validation loss of a lowbit train checkpoint with its attention forward "
                                        "swapped to each variant, and the gap to SDPA's."))
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    with command_errors(p):
        run_eval(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
