"""``lowbit train``: argument parsing and the run-and-report driver (wired into ``lowbit.cli``).

Also runnable on its own: ``python -m lowbit.train.cli --model tiny --steps 20`` or
``torchrun --nproc_per_node 2 -m lowbit.train.cli ...``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
from pathlib import Path

from .budget import check_activation_budget
from .loop import COMPILE_MODES, GRAD_REDUCE_DTYPES, PRESET_DEFAULTS, RECIPES, TrainConfig, TrainInterrupted, train
from .report import PLOT_NOTE, format_table, table_rows, try_plot_losses, write_json

__all__ = ["add_train_args", "run_train", "config_from_args", "main", "os_error_line", "exit_status", "resume_command",
           "command_errors"]


def positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {v}")
    return v


def nonneg_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v}")
    return v


def os_error_line(e: OSError) -> str:
    """One line for an OSError that reached the command's top level: what failed, on which path, and why."""
    what = e.strerror or str(e) or type(e).__name__
    paths = " -> ".join(repr(str(f)) for f in (e.filename, e.filename2) if f is not None)
    return f"{paths}: {what}" if paths else what


def exit_status(prog: str, body) -> int:
    """Run ``body()`` for a command that returns its status: 0, or 2 with one ``<prog>: error: ...`` line on stderr
    for bad input (ValueError) or a file-system error (OSError)."""
    try:
        body()
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"{prog}: error: {os_error_line(e)}", file=sys.stderr)
        return 2
    return 0


@contextlib.contextmanager
def command_errors(parser: argparse.ArgumentParser):
    """A command's top level: bad input (ValueError) and file-system errors (OSError) end it with one error line
    (exit status 2), a non-finite value under ``--on-nonfinite raise`` with one line (3), Ctrl-C with one line
    (130), all named by ``parser.prog``."""
    try:
        yield
    except KeyboardInterrupt:
        parser.exit(130, f"{parser.prog}: interrupted (Ctrl-C)\n")
    except FloatingPointError as e:
        parser.exit(3, f"{parser.prog}: stopped: {e} (--on-nonfinite raise; skip or rollback would go on)\n")
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    except OSError as e:
        parser.exit(2, f"{parser.prog}: error: {os_error_line(e)}\n")


def add_train_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``lowbit train`` options to ``parser`` (returns it)."""
    p = parser
    g = p.add_argument_group("run")
    g.add_argument("--recipe", default="bf16",
                   help=f"quantization recipe: {', '.join(RECIPES)} (default bf16 = no quantization)")
    g.add_argument("--model", default="tiny", help=f"model preset: {', '.join(PRESET_DEFAULTS)} (default tiny)")
    g.add_argument("--steps", type=positive_int, default=200, help="optimizer steps (default 200)")
    g.add_argument("--batch-size", type=positive_int, default=None,
                   help="sequences per micro-batch per rank (default: per preset)")
    g.add_argument("--seq-len", type=positive_int, default=None,
                   help="tokens (bytes) per sequence (default: per preset)")
    g.add_argument("--grad-accum", type=positive_int, default=1, help="micro-batches per step (default 1)")
    g.add_argument("--lr", type=float, default=None, help="peak learning rate (default: per preset)")
    g.add_argument("--warmup", type=nonneg_int, default=None, help="warm-up steps (default min(100, steps/10))")
    g.add_argument("--weight-decay", type=float, default=0.1,
                   help="AdamW weight decay of the matrices, >= 0 (0: off; default 0.1)")
    g.add_argument("--grad-clip", type=float, default=1.0,
                   help="clip the global gradient norm to this, >= 0 (0: off; default 1.0)")
    g.add_argument("--seed", type=int, default=1337, help="0 <= seed < 2**32 (default 1337)")
    g = p.add_argument_group("data and output")
    g.add_argument("--data", default=None, metavar="PATH",
                   help="text file or folder of text files (default: the Python standard library's .py files)")
    g.add_argument("--cache-dir", default=None, help="token cache folder (default $LOWBIT_CACHE or ~/.cache/lowbit)")
    g.add_argument("--out-dir", default=None, help="checkpoint and report folder (default runs/<model>-<recipe>)")
    g.add_argument("--eval-every", type=positive_int, default=None, help="validate every N steps (default steps/10)")
    g.add_argument("--eval-windows", type=positive_int, default=64, help="validation sequences (default 64)")
    g.add_argument("--ckpt-every", type=nonneg_int, default=0,
                   help="checkpoint every N steps (default 0: at the end only)")
    g.add_argument("--keep-checkpoints", type=positive_int, default=2, metavar="N",
                   help="keep the last N checkpoints (checkpoint.pt and checkpoint-step<S>.pt); --resume falls back "
                        "from a bad latest one to the newest good one (default 2)")
    g.add_argument("--resume", nargs="?", const="auto", default=None, metavar="CKPT",
                   help="continue from out-dir/checkpoint.pt, falling back to the newest good kept one (or from the "
                        "given checkpoint, which must pass its checks: a bad one is refused, naming a good older one)")
    g.add_argument("--overwrite", action="store_true", help="start afresh even if the out-dir holds a checkpoint")
    g.add_argument("--no-save", action="store_true",
                   help="write no checkpoint at the end (benchmark runs; --ckpt-every still writes its own)")
    g.add_argument("--on-nonfinite", choices=("skip", "rollback", "raise"), default="skip",
                   help="on a non-finite amax, loss or gradient norm (the last with --grad-clip > 0): skip the step, "
                        "roll back to the last checkpoint, or stop (default skip)")
    g.add_argument("--compare", choices=("bf16",), default=None,
                   help="also run the BF16 baseline on the same data and seed")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g = p.add_argument_group("hardware")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    g.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="compute dtype of the unquantized parts (auto: bf16 on CUDA, fp32 on CPU)")
    g.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (fully_shard) under torchrun instead of DDP")
    g.add_argument("--fp8-all-gather", action="store_true",
                   help="with --fsdp: all-gather the FP8 weight copies (fp8-block: 128x128 tiles, fp8-current and "
                        "fp8-delayed: per-tensor) instead of FP32 shards, bit-identical to quantizing the whole weight")
    g.add_argument("--bf16-all-gather", action="store_true",
                   help="with --fsdp and --recipe bf16: all-gather the linear weights in BF16 instead of FP32 (half "
                        "the bytes), bit-identical to autocast's cast of the whole weight")
    g.add_argument("--fsdp-keep-gathered", action="store_true",
                   help="with --fsdp: keep each block's gathered weights from its forward to its backward (one "
                        "all-gather a block a step instead of two; the unsharded weights held through the step)")
    g.add_argument("--grad-reduce-dtype", choices=GRAD_REDUCE_DTYPES, default="float32",
                   help="several processes (FSDP2 or DDP): the dtype the gradients are averaged across ranks in "
                        "(bfloat16: half the bytes, each gradient rounded to BF16 before the sum; default float32)")
    g.add_argument("--cuda-graph", choices=("auto", "on", "off"), default="auto",
                   help="replay each step as CUDA graphs (auto: on CUDA, one GPU, DDP or FSDP2, their collectives "
                        "captured; recipes bf16/fp8-current/fp8-block/mxfp8/nvfp4; removes the per-kernel host cost "
                        "of the eager path)")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer block (one shared graph; before FSDP2 sharding) instead of "
                        "lowbit's own CUDA graphs")
    g.add_argument("--compile-mode", choices=COMPILE_MODES, default="default",
                   help="torch.compile's mode for the blocks with --compile (reduce-overhead: torch's CUDA graphs per "
                        "block; current-scaling recipes, --grad-accum 1)")
    g.add_argument("--attention", choices=("auto", "lowbit", "sdpa"), default="auto")
    g.add_argument("--attn-qk", choices=("bf16", "int8", "fp8"), default="bf16")
    g.add_argument("--attn-pv", choices=("bf16", "fp8"), default="bf16")
    g = p.add_argument_group("model variants")
    g.add_argument("--mlp", choices=("swiglu", "gelu"), default=None)
    g.add_argument("--pos", choices=("rope", "learned"), default=None)
    g.add_argument("--norm", choices=("RMSNorm", "LayerNorm"), default=None)
    g.add_argument("--no-tie", dest="tie_weights", action="store_const", const=False, default=None,
                   help="untie embedding and output head")
    g = p.add_argument_group("diagnostics")
    g.add_argument("--step-phases", action="store_true",
                   help="report the host wall time of each phase of a step, and the GPU time between them")
    g.add_argument("--profile-graphs", default=None, metavar="DIR",
                   help="replay the fourth step's CUDA graphs under torch.profiler; kernel times, gaps and the trace "
                        "go to DIR/<recipe>/graph_profile.json")
    g.add_argument("--step-profile", type=positive_int, nargs="?", const=2, default=0, metavar="N",
                   help="run torch.profiler over N steps after warm-up (default 2) and split each one's time into "
                        "compute, communication (exposed and hidden) and host time, per rank, into summary.json "
                        "(those steps are left out of tokens/s)")
    g.add_argument("--deterministic", action="store_true",
                   help="bit-reproducible runs (loss checks, debugging; slower): torch's deterministic algorithms "
                        "(an operation without one raises, naming it), cuDNN deterministic, lowbit's autotuning off, "
                        "CUBLAS_WORKSPACE_CONFIG=:4096:8 where unset")
    g.add_argument("--no-lookahead", action="store_true",
                   help="read and wait for every step on the host before the next one (by default, with --on-nonfinite "
                        "skip, a step's skip is decided on the device and read one step later; the same results)")
    # testing hooks (hidden)
    p.add_argument("--stop-at-step", type=positive_int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--fault-steps", type=lambda s: tuple(int(v) for v in s.split(",") if v), default=(),
                   help=argparse.SUPPRESS)
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Map parsed arguments to a :class:`TrainConfig`."""
    return TrainConfig(
        recipe=args.recipe, model=args.model, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
        grad_accum=args.grad_accum, lr=args.lr, warmup=args.warmup, weight_decay=args.weight_decay,
        grad_clip=args.grad_clip, seed=args.seed, data=args.data, cache_dir=args.cache_dir, out_dir=args.out_dir,
        eval_every=args.eval_every, eval_windows=args.eval_windows, ckpt_every=args.ckpt_every,
        keep_checkpoints=args.keep_checkpoints, resume=args.resume, save_final=not args.no_save,
        overwrite=args.overwrite, on_nonfinite=args.on_nonfinite, compare=args.compare, device=args.device,
        dtype=args.dtype, fsdp=args.fsdp, fp8_all_gather=args.fp8_all_gather, bf16_all_gather=args.bf16_all_gather,
        fsdp_reshard_after_forward=not args.fsdp_keep_gathered, grad_reduce_dtype=args.grad_reduce_dtype,
        cuda_graph=args.cuda_graph,
        compile=args.compile, compile_mode=args.compile_mode,
        attention=args.attention, attn_qk=args.attn_qk, attn_pv=args.attn_pv, mlp=args.mlp, pos=args.pos,
        norm=args.norm, tie_weights=args.tie_weights, progress=not args.no_progress,
        stop_at_step=args.stop_at_step, fault_steps=tuple(args.fault_steps), step_phases=args.step_phases,
        profile_graphs=args.profile_graphs, step_profile=args.step_profile, lookahead=not args.no_lookahead,
        deterministic=args.deterministic,
    )


def resume_command(argv) -> str:
    """The command line that continues a run started with ``argv``: the same arguments less ``--resume [CKPT]`` and
    ``--overwrite``, plus ``--resume`` (the out-dir's checkpoint)."""
    out, it = [], iter(argv)
    for a in it:
        if a == "--overwrite" or a.startswith("--resume="):
            continue
        if a == "--resume":
            nxt = next(it, None)
            if nxt is not None and (nxt.startswith("-") and nxt != "-"):
                out.append(nxt)  # (a flag, not --resume's CKPT)
            continue
        out.append(a)
    return shlex.join(["lowbit", "train", *out, "--resume"])


def _is_main() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def run_train(args: argparse.Namespace) -> dict:
    """Run ``lowbit train`` from parsed arguments: train, then (rank 0) write ``summary.json`` and
    ``loss.png`` into the out-dir and print the results table. Returns the summary dict."""
    check_activation_budget(config_from_args(args))  # refuse a --seq-len x --batch-size the device cannot hold
    summary = train(config_from_args(args))
    if _is_main():
        out = Path(summary["out_dir"])
        runs = {summary["recipe"]: summary}
        if "compare" in summary:
            runs = {"bf16": summary["compare"]["bf16"], **runs}
        png = try_plot_losses(runs, out / "loss.png", title=f"{summary['model']} on {summary['device']}")
        summary["report"] = {"summary": str(out / "summary.json"), "plot": None if png is None else str(png)}
        write_json(out / "summary.json", summary)
        print(format_table(table_rows(runs)), flush=True)
        for e in summary["events"]:
            print(f"[lowbit] non-finite at step {e['step']}: layer {e['layer']} ({e['role']}) -> {e['action']}")
        if png is None:
            print(PLOT_NOTE, flush=True)
        print(f"[lowbit] report: {out / 'summary.json'}{'' if png is None else f', {png}'}", flush=True)
    return summary


def main(argv=None) -> int:
    """Command entry (``python -m lowbit.train.cli``; ``lowbit train`` may delegate here): parses ``argv``,
    runs, prints bad input and file-system errors (an unwritable or full out-dir, say) as one error line
    (exit status 2) and tears down the process group."""
    p = add_train_args(argparse.ArgumentParser(prog="lowbit train",
                                               description="Train the reference GPT under a lowbit recipe."))
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    try:
        with command_errors(p):
            try:
                run_train(args)
                import torch.distributed as dist

                if dist.is_available() and dist.is_initialized():
                    # every rank reaches the teardown together: rank 0 still writes the report while the others
                    # finish, and tearing down gloo under a peer still in it aborts a rank now and then (seen with
                    # FSDP)
                    dist.barrier()
            except TrainInterrupted as e:  # Ctrl-C in one process: stopped at the end of a step, checkpoint written
                where = (f"checkpoint {e.checkpoint}\nlowbit train: to resume: {resume_command(argv)}"
                         if e.checkpoint else "no checkpoint (this run writes none)")
                p.exit(130, f"lowbit train: interrupted (Ctrl-C) after step {e.step}; {where}\n")
    finally:
        import gc

        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            # Free the run's objects (FSDP2's modules hold the process group through reference cycles) while the
            # group and its threads are still alive: left to interpreter teardown, a rank aborted now and then with
            # "terminate called without an active exception" after a successful run (gloo, CPU, under load)
            gc.collect()
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
