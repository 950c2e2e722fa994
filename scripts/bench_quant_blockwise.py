"""Float8 blockwise quantization throughput against a device-to-device copy, on the GPU.

For each BF16 input (M, K): ``y.copy_(x)``; ``quantize`` with ``Float8Blockwise(block_dim=1)`` rowwise +
columnwise (fused cast + transpose), rowwise only, and ``Float8Blockwise(block_dim=2)`` both copies.
Times are ``triton.testing.do_bench`` medians of the whole ``quantize`` call (scale buffer zeroing included).
GB/s counts the input read once plus every output written (FP8 data + scales), as ``lowbit.bench.quant``
does; "of copy" = GB/s / the copy's GB/s (the copy moves 2 x the input's bytes).

    PYTHONPATH=src python scripts/bench_quant_blockwise.py [--shapes 16384x4096,8192x8192] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

SHAPES = [(16384, 4096), (8192, 8192), (16384, 14336)]


def run(shapes, rep: int = 100, label: str = ""):
    from lowbit.bench import median_ms
    from lowbit.quant import Float8Blockwise, quantize

    rows = []
    for M, K in shapes:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(x)
        cases = [
            ("copy", lambda: y.copy_(x)),
            ("1x128 row+col", lambda: quantize(x, Float8Blockwise(block_dim=1), True, True, backend="triton")),
            ("1x128 row", lambda: quantize(x, Float8Blockwise(block_dim=1), True, False, backend="triton")),
            ("128x128 row+col", lambda: quantize(x, Float8Blockwise(block_dim=2), True, True, backend="triton")),
        ]
        copy_bw = None
        for name, fn in cases:
            out = fn()  # first call: compile / autotune outside the timing
            torch.cuda.synchronize()
            moved = 2 * x.numel() * x.element_size() if name == "copy" else x.numel() * x.element_size() + out.nbytes
            t = median_ms(fn, rep=rep)
            bw = moved / t * 1e-6
            copy_bw = copy_bw or bw
            rows.append(dict(label=label, shape=f"{M}x{K}", case=name, us=t * 1e3, gbs=bw, of_copy=bw / copy_bw))
            print(f"{label}{M}x{K:<6} {name:16s} {t * 1e3:8.1f} us {bw:7.0f} GB/s {bw / copy_bw:5.2f} of copy", flush=True)
        del x, y
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=None, help="comma-separated MxK list")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time in ms")
    p.add_argument("--label", default="", help="prefix for the printed rows (e.g. before/after)")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    shapes = SHAPES if not a.shapes else [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = run(shapes, a.rep, a.label)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
