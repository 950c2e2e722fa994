"""How fast can the GPT presets' twelve GEMMs a layer get in FP8? BF16 against FP8 tensorwise and FP8 blockwise
(the bound on the fp8-block / BF16 step ratio).

For each linear layer of a block (qkv, proj, fc1, fc2) it times the forward (Y = X·Wᵀ), data-gradient (dX = dY·W)
and weight-gradient (dW = dYᵀ·X) GEMMs over the step's tokens, each from a CUDA graph:

- ``bf16``: ``torch.mm`` in BF16, the BF16 recipe's GEMMs.
- ``fp8 tensor``: ``torch._scaled_mm`` with one scale a tensor (E4M3, operands pre-transposed so every call is
  cuBLAS's TN layout). One multiply a tile, no per-block promotion: what any scaled FP8 GEMM could at best reach.
- ``fp8 block``: what lowbit's fp8-block recipe runs (``lowbit.scaled_mm`` with its default dispatch, 1x128 · 128x128
  for forward and data gradient, ``lowbit.gemm.wgrad_mm`` 1x128 · 1x128 for the weight gradient).

The per-layer sums say how much of a step the GEMMs can save. ``--common-us`` (the step's non-GEMM GPU time a layer,
which both recipes pay: attention, norms, residual adds, RoPE, SwiGLU and their quantize / cast kernels, from a graph
profile) turns them into the step ratio BF16 / FP8 each FP8 column would give with that common time.

    PYTHONPATH=src python tools/gemm_bound.py [--preset 350m,1.3b] [--rounds 2] [--common-us 350m=1640,1.3b=...]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

COLUMNS = ("bf16", "fp8 tensor", "fp8 block")

def _e4m3(t):
    """(E4M3 codes of t, contiguous; the FP32 scale-inverse) with one scale for the tensor."""
    import torch

    s = (448.0 / t.abs().amax().float().clamp_min(1e-12))
    return (t.float() * s).to(torch.float8_e4m3fn).contiguous(), (1.0 / s).reshape(())


def _tensorwise(a, bt, out_dtype):
    """A (m, k) · Bt (n, k)ᵀ as one tensorwise cuBLAS call (codes and scales made here, outside the timing)."""
    import torch

    qa, sa = _e4m3(a)
    qb, sb = _e4m3(bt)
    return lambda: torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)


def _parse_common(s: str) -> dict:
    out = {}
    for part in filter(None, s.split(",")):
        k, _, v = part.partition("=")
        if not v:
            raise ValueError(f"--common-us: expected PRESET=MICROSECONDS items, got {part!r}")
        out[k] = float(v)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="350m,1.3b")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--common-us", default="", help="PRESET=US,...: non-GEMM GPU time a layer, both recipes")
    args = p.parse_args(argv)
    common = _parse_common(args.common_us)
    presets = args.preset.split(",")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    # (tokens a step: batch x seq of the training pairs in BENCHMARKS.md; the presets' layers and their operands)
    from lowbit.bench.gemm import LAYER_TOKENS as TOKENS
    from lowbit.bench.gemm import layer_operands, layer_shapes

    for preset in presets:
        if preset not in TOKENS:
            raise ValueError(f"--preset: expected names from {sorted(TOKENS)}, got {preset!r}")
    import torch

    from lowbit import scaled_mm
    from lowbit.bench import capture, median_ms
    from lowbit.gemm import wgrad_mm

    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    for preset in presets:
        T, layers = TOKENS[preset], layer_shapes(preset)
        tot = {c: 0.0 for c in COLUMNS}
        flops_layer = 0.0
        print(f"[{preset}] tokens {T}; us (TFLOP/s), median of {args.rounds} rounds of graph replays")
        print(f"  {'GEMM':14s} {'M x N x K':>20s} " + " ".join(f"{c:>18s}" for c in COLUMNS) + "   block/bf16")
        for name, N, K in layers:
            x, dy, w, qx, qdy, qw = layer_operands(T, N, K, dev)
            wt, dyt, xt = w.t().contiguous(), dy.t().contiguous(), x.t().contiguous()
            gemms = {  # (M, N, K of the product, {column: fn})
                "fprop": ((T, N, K), {
                    "bf16": lambda: torch.mm(x, w.t()),
                    "fp8 tensor": _tensorwise(x, w, torch.bfloat16),
                    "fp8 block": lambda: scaled_mm(qx, qw, out_dtype=torch.bfloat16)}),
                "dgrad": ((T, K, N), {
                    "bf16": lambda: torch.mm(dy, w),
                    "fp8 tensor": _tensorwise(dy, wt, torch.bfloat16),
                    "fp8 block": lambda: scaled_mm(qdy, qw, a_copy="rowwise", b_copy="columnwise",
                                                   out_dtype=torch.bfloat16)}),
                "wgrad": ((N, K, T), {
                    "bf16": lambda: torch.mm(dy.t(), x),
                    "fp8 tensor": _tensorwise(dyt, xt, torch.float32),
                    "fp8 block": lambda: wgrad_mm(qdy, qx, out_dtype=torch.float32)}),
            }
            for role, ((m, n, k), fns) in gemms.items():
                for fn in fns.values():  # compile / tune outside the capture
                    fn()
                graphs = {c: capture(fn) for c, fn in fns.items()}
                times = {c: [] for c in fns}
                for _ in range(args.rounds):
                    for c, g in graphs.items():
                        times[c].append(median_ms(g.replay, warmup=10, rep=60))
                fl = 2.0 * m * n * k
                flops_layer += fl
                cells = []
                for c in COLUMNS:
                    ms = statistics.median(times[c])
                    tot[c] += ms
                    cells.append(f"{ms * 1e3:8.1f} ({fl / ms * 1e-9:5.0f})")
                ratio = statistics.median(times["bf16"]) / statistics.median(times["fp8 block"])
                print(f"  {name + ' ' + role:14s} {f'{m}x{n}x{k}':>20s} " + " ".join(f"{s:>18s}" for s in cells)
                      + f"   {ratio:.2f}x")
        print(f"  {'layer':14s} {'':>20s} " + " ".join(
            f"{f'{tot[c] * 1e3:8.0f} ({flops_layer / tot[c] * 1e-9:5.0f})':>18s}" for c in COLUMNS)
              + f"   {tot['bf16'] / tot['fp8 block']:.2f}x")
        if preset in common:
            cu = common[preset] / 1e3
            need = (tot["bf16"] + cu) / 1.3 - cu  # FP8 GEMM ms a layer for a 1.3x step
            print(f"  with {common[preset]:.0f} us a layer of common non-GEMM time: step ratio BF16 / FP8 = "
                  + ", ".join(f"{c} {(tot['bf16'] + cu) / (tot[c] + cu):.3f}" for c in COLUMNS[1:])
                  + f"; FP8 GEMMs a layer needed for 1.3x: {need * 1e3:.0f} us "
                  f"({flops_layer / need * 1e-9:.0f} TFLOP/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
