"""The ``lowbit`` command: ``info``, ``demo``, ``train``, ``eval``, ``bench``, ``quant-demo``.

Subcommands delegate to the packages that own them (``lowbit.train``, ``lowbit.bench``); this file
only parses the first word and prints.
"""

from __future__ import annotations

import argparse
import importlib
import platform
import sys

import torch

BENCHES = {
    "quant": "lowbit.bench.quant",
    "gemm": "lowbit.bench.gemm",
    "linear": "lowbit.bench.linear",
    "attention": "lowbit.bench.attention",
    "optim": "lowbit.bench.optim",
    "model": "lowbit.bench.model",
    "prefill": "lowbit.bench.prefill",
    "decode": "lowbit.bench.decode",
    "scale": "lowbit.bench.scale",
}


def _version(mod: str) -> str:
    try:
        return importlib.import_module(mod).__version__
    except Exception:
        return "not installed"


# ------------------------------------------------------------------------------------------------
# info
# ------------------------------------------------------------------------------------------------
def cmd_info(argv=None) -> int:
    import lowbit
    from lowbit import MXFP8, NVFP4, Float8Blockwise, Float8Rowwise, Float8Tensorwise, quant

    print(f"lowbit {lowbit.__version__}")
    print(f"python {platform.python_version()}  torch {torch.__version__}  triton {_version('triton')}  numpy "
          f"{_version('numpy')}")
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        p = torch.cuda.get_device_properties(dev)
        cap = torch.cuda.get_device_capability(dev)
        print(f"device: {p.name}  capability sm_{cap[0]}{cap[1]}  {p.multi_processor_count} SMs  "
              f"{p.total_memory / 2**30:.0f} GiB")
        native = cap >= (9, 0)
        print(f"FP8 tensor cores: {'yes' if native else 'no'}  (MXFP8 and NVFP4 are emulated on Hopper)")
    else:
        dev = torch.device("cpu")
        print("device: cpu (no CUDA): every op runs its pure-torch reference")
    x = torch.zeros(256, 256, device=dev)
    print("\nquantize backends:")
    for s in (Float8Tensorwise(), Float8Rowwise(), Float8Blockwise(), Float8Blockwise(block_dim=2), MXFP8(), NVFP4(),
              NVFP4(two_d=True)):
        print(f"  {s!r:<90} -> {quant.backend_for(x, s, True, True)}")
    from lowbit import gemm

    print("\nscaled_mm backends (probe: 256x256 operands; the choice can depend on shape, e.g. NVFP4/MXFP8 take\n"
          "  triton_emulated below M or N = 256, and a pairing cuBLAS rejects at run time falls back to triton):")
    pairs = [
        (Float8Tensorwise(), Float8Tensorwise()),
        (Float8Rowwise(), Float8Rowwise()),
        (Float8Blockwise(), Float8Blockwise(block_dim=2)),
        (Float8Blockwise(), Float8Blockwise()),
        (Float8Blockwise(block_dim=2), Float8Blockwise()),
        (MXFP8(), MXFP8()),
        (NVFP4(), NVFP4(two_d=True)),
    ]
    for sa, sb in pairs:
        a = quant.quantize(x.normal_(), sa, True, True, backend="reference")
        b = quant.quantize(x.normal_(), sb, True, True, backend="reference")
        name = (f"{type(sa).__name__}{'' if not hasattr(sa, 'block_dim') else f'[{sa.block_dim}D]'} x "
                f"{type(sb).__name__}{'' if not hasattr(sb, 'block_dim') else f'[{sb.block_dim}D]'}")
        print(f"  {name:<50} -> {gemm.backend_for(a, b)}")
    from lowbit.gemm import cuda_sm90, deepgemm

    print(f"  deepgemm: {deepgemm.status(dev if dev.type == 'cuda' else None)}")
    print(f"  cuda: {cuda_sm90.status(dev if dev.type == 'cuda' else None)}")
    print("\nrecipes (lowbit train --recipe NAME):")
    import warnings

    from lowbit import recipes
    from lowbit.nn import check_recipe_support
    from lowbit.train.loop import GRAPH_RECIPES

    for name in recipes.QUANTIZED_NAMES:
        r = recipes.from_name(name)
        with warnings.catch_warnings():  # the one-time emulation notice is for training runs, not this table
            warnings.simplefilter("ignore")
            how = check_recipe_support(r, dev)
        graph = "CUDA graph" if name in GRAPH_RECIPES else "eager (not graph-safe yet)"
        print(f"  {name:<12} {type(r).__name__:<22} -> {how:<10} lowbit train on one GPU or DDP: {graph}")
    print("\nattention:")
    att = importlib.import_module("lowbit.attention")
    for qk, pv in (("bf16", "bf16"), ("int8", "bf16"), ("int8", "fp8"), ("fp8", "fp8")):
        try:
            be = att.backend_for(device=dev, qk=qk, pv=pv)
            note = " (cuDNN first, then flash)" if be == "sdpa" else ""
            if (qk, pv) == ("int8", "fp8") and be == "triton":
                if att.gluon_by_default(dev, 128):
                    note = (" (dense, head dim 128 (64 on the persistent grid), causal or no mask: the "
                            "warp-specialized Gluon kernel; otherwise the Triton one)")
            print(f"  qk={qk} pv={pv} -> {be}{note}")
        except Exception as e:  # report, do not crash info
            print(f"  qk={qk} pv={pv} -> unavailable ({e})")
    try:  # the backward of every variant: the 16-bit gradient (lowbit.attention.backward.backward_backend)
        bwd = att.backward.backward_backend(dev, torch.bfloat16, batch=1, heads_q=8, heads_kv=8, seqlen_q=2048,
                                            seqlen_k=2048, head_dim=128, causal=True)
        print(f"  backward, dense MHA, head dim 128 -> {bwd}" + (" (cuDNN's, from lowbit's O and LSE; "
              "GQA, windows, varlen, dropout, FP8 gradients: Triton)" if bwd == "cudnn" else ""))
    except Exception as e:  # report, do not crash info
        print(f"  backward -> unavailable ({e})")
    print("\nswitches (environment variables; lowbit.runtime.env):")
    from lowbit.runtime import env

    for name, value, default, doc in env.describe():
        shown = ",".join(sorted(value)) if isinstance(value, frozenset) else int(value) if isinstance(value, bool) \
            else value
        print(f"  {name}={'' if shown is None else shown}{' (default)' if value == default else ''}")
        print(f"      {doc}")
    for name in env.unknown():
        print(f"  {name}: not a lowbit switch, ignored (a typo, or a switch that was removed)")
    return 0


# ------------------------------------------------------------------------------------------------
# quantization demo (also the fallback of `lowbit demo` before the training job exists)
# ------------------------------------------------------------------------------------------------
def cmd_quant_demo(argv=None) -> int:
    """Print per-format error (SQNR) and memory tables on Gaussian and outlier-heavy data."""
    from lowbit import MXFP8, NVFP4, Float8Blockwise, Float8Tensorwise, quantize

    p = argparse.ArgumentParser(prog="lowbit quant-demo", description=cmd_quant_demo.__doc__)
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--cols", type=int, default=768)
    a = p.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)
    gauss = torch.randn(a.rows, a.cols, generator=g, device=dev)
    heavy = torch.randn(a.rows, a.cols, generator=g, device=dev) / torch.rand(a.rows, a.cols, generator=g,
                                                                              device=dev).clamp(min=0.05).sqrt()
    heavy[:: max(1, a.rows // 2)] *= 1e4  # two "massive activation" rows
    schemes = {
        "FP8 E4M3 per-tensor": Float8Tensorwise(),
        "FP8 E5M2 per-tensor": Float8Tensorwise("e5m2"),
        "FP8 E4M3 1x128 (pow2)": Float8Blockwise(),
        "FP8 E4M3 128x128 (pow2)": Float8Blockwise(block_dim=2),
        "MXFP8 E4M3 1x32": MXFP8(),
        "NVFP4 1x16": NVFP4(),
        "NVFP4 16x16": NVFP4(two_d=True),
    }

    def sqnr(x, y):
        return (10 * torch.log10(x.double().pow(2).sum() / (x.double() - y.double()).pow(2).sum())).item()

    bf16_bytes = gauss.numel() * 2
    print(f"tensor [{a.rows}, {a.cols}] on {dev}; SQNR in dB (higher is better); bytes for one rowwise copy vs BF16 "
          f"({bf16_bytes:,})")
    print(f"{'scheme':<26}{'gaussian':>10}{'outliers*':>11}{'bytes':>12}{'vs bf16':>9}")
    keep = torch.ones(a.rows, dtype=torch.bool, device=dev)
    keep[:: max(1, a.rows // 2)] = False
    for name, s in schemes.items():
        qg = quantize(gauss, s)
        qh = quantize(heavy, s)
        sg = sqnr(gauss, qg.dequantize())
        sh = sqnr(heavy[keep], qh.dequantize()[keep])
        print(f"{name:<26}{sg:>10.2f}{sh:>11.2f}{qg.nbytes:>12,}{qg.nbytes / bf16_bytes:>9.3f}")
    print("* SQNR over the ordinary rows of a tensor with two rows scaled by 1e4: per-tensor scales starve them.")
    return 0


# ------------------------------------------------------------------------------------------------
# delegation
# ------------------------------------------------------------------------------------------------
def cmd_demo(argv=None) -> int:
    return int(importlib.import_module("lowbit.train.demo").main(argv) or 0)


def cmd_train(argv=None) -> int:
    # lowbit.train.cli.main parses, prints one clear line for bad input (exit 2) and tears down the process group
    return int(importlib.import_module("lowbit.train.cli").main(argv) or 0)


def cmd_eval(argv=None) -> int:
    return int(importlib.import_module("lowbit.train.evaluate").main(argv) or 0)


def cmd_bench(argv=None) -> int:
    argv = list(argv or [])
    if not argv or argv[0] not in BENCHES:
        print(f"usage: lowbit bench {{{','.join(BENCHES)}}} [options]", file=sys.stderr)
        return 2
    mod = BENCHES[argv[0]]
    if argv[0] == "attention" and "--backward" in argv:
        mod = "lowbit.bench.attention_bwd"
        argv = [a for a in argv if a != "--backward"]
    r = importlib.import_module(mod).main(argv[1:])
    return int(r or 0)


COMMANDS = {
    "info": (cmd_info, "versions, device, and which backend runs each op"),
    "demo": (cmd_demo, "the embedded default: short training runs under BF16 / FP8 / NVFP4, with a report"),
    "train": (cmd_train, "train a GPT under a recipe (see `lowbit train --help`)"),
    "eval": (cmd_eval, "a checkpoint's validation loss with each attention variant (SDPA, INT8, FP8) and the gaps"),
    "bench": (cmd_bench, "GPU benchmarks against peers: quant, gemm, linear, attention, optim, model, prefill, decode; "
                         "scale: lowbit train over GPUs"),
    "quant-demo": (cmd_quant_demo, "per-format quantization error and memory tables"),
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-V"]):
        import lowbit

        print(f"lowbit {lowbit.__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: lowbit [--version] <command> [options]\n\ncommands:")
        for k, (_, h) in COMMANDS.items():
            print(f"  {k:<12}{h}")
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"lowbit: unknown command {argv[0]!r}; expected one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]][0](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
