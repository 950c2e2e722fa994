"""The attention prepass's launch parameters swept (``_triton._STAT_CHUNK`` / ``_STAT_SUB`` / ``_STATS_WARPS`` /
``_CODES_WARPS`` / ``_STAT_SPLIT``): the whole INT8·FP8 prepass from CUDA graph replays and its two big kernels
from the torch profiler, then each part alone (Q's codes, the K/V statistics) with the defaults.

    python scripts/attn_prepass_sweep.py [--shapes "4,32,4096,128;8,16,2048,64"]
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import triton  # noqa: E402

from attn_prepass_probe import kernel_times  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4,32,4096,128;8,16,2048,64")
    ap.add_argument("--chunks", default="64,128,256")
    ap.add_argument("--subs", default="16,32,64")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--splits", default="0,1", help="_STAT_SPLIT values")
    args = ap.parse_args()
    from lowbit.attention import _triton as T

    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    for shp in args.shapes.split(";"):
        B, H, S, D = ints(shp)
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        n = q.numel()
        copy = triton.testing.do_bench_cudagraph(lambda: q.clone(), rep=100)
        print(f"B{B} H{H} S{S} D{D}: copy of Q {copy * 1e3:.1f} us ({4 * n / copy * 1e-6:.0f} GB/s); "
              f"the prepass at copy speed {13 / 4 * copy * 1e3:.0f} us")  # 13 bytes an element against the copy's 4
        fused = lambda: T.prepass_triton(q, k, v, qk="int8", pv="fp8", key_order="wgmma32")  # noqa: E731
        names = ("_STAT_CHUNK", "_STAT_SUB", "_STATS_WARPS", "_CODES_WARPS", "_STAT_SPLIT")
        rows, defaults = [], [getattr(T, x) for x in names]
        for cfg in itertools.product(ints(args.chunks), ints(args.subs), ints(args.warps), ints(args.warps),
                                     ints(args.splits)):
            if cfg[1] > cfg[0]:
                continue
            for x, val in zip(names, cfg):
                setattr(T, x, val)
            fused()
            ms = triton.testing.do_bench_cudagraph(fused, rep=100)
            kt = kernel_times(fused, iters=10)
            rows.append((ms, cfg, kt.get("_prepass_stats_kernel", 0), kt.get("_prepass_codes_kernel", 0),
                         sum(t for n, t in kt.items() if not n.startswith("_prepass"))))
        rows.sort()
        print("  chunk sub stats_warps codes_warps split |   total us | stats us | codes us | other us")
        for ms, cfg, st, co, ot in rows:
            print("  {:5d} {:3d} {:11d} {:11d} {:5d}".format(*cfg)
                  + f" | {ms * 1e3:10.1f} | {st:8.1f} | {co:8.1f} | {ot:8.1f}")
        for x, val in zip(names, defaults):
            setattr(T, x, val)
        parts = {
            "Q codes alone (stats launch, DO_Q only) + K codes":
                lambda: T.prepass_triton(q, k, None, qk="int8", smooth_k=False),
            "V alone (amax, finalize, codes)": lambda: T.prepass_triton(None, None, v, pv="fp8", key_order="wgmma32"),
        }
        for name, fn in parts.items():
            fn()
            ms = triton.testing.do_bench_cudagraph(fn, rep=100)
            kt = ", ".join(f"{a} {b:.1f}" for a, b in sorted(kernel_times(fn, iters=10).items()))
            print(f"  {name:52s} {ms * 1e3:8.1f} us  [{kt}]")


if __name__ == "__main__":
    main()
