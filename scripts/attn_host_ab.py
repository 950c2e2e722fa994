"""Host time of one quantized attention call (INT8 Q·Kᵀ + FP8 P·V, B8 H16 S2048) under two versions of lowbit in ONE
process, calls alternating: the host's speed drifts by up to 2x between runs on the device machine, so only
interleaved calls compare. The other version is a copy of a commit's ``src/lowbit`` (e.g. ``git archive``), imported
under another package name (lowbit imports itself relatively).

    python scripts/attn_host_ab.py ab_old/src/lowbit [--shapes "8,16,2048,64;8,16,2048,128;1,32,1024,128"]
"""
import argparse
import importlib
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import torch  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("other", help="the other version's src/lowbit folder")
    ap.add_argument("--shapes", default="8,16,2048,64;8,16,2048,128;1,32,1024,128")
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp()
    shutil.copytree(args.other, os.path.join(tmp, "lowbit_other"))
    sys.path.insert(0, tmp)
    new = importlib.import_module("lowbit.attention").attention
    old = importlib.import_module("lowbit_other.attention").attention
    for shp in args.shapes.split(";"):
        B, H, S, D = (int(x) for x in shp.split(","))
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        fns = {"other": lambda: old(q, k, v, qk="int8", pv="fp8"), "this": lambda: new(q, k, v, qk="int8", pv="fp8")}
        for f in fns.values():
            for _ in range(10):
                f()
        torch.cuda.synchronize()
        host = {n: [] for n in fns}
        for i in range(2 * args.calls):
            n = "other" if i % 2 else "this"
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fns[n]()
            host[n].append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        med = {n: statistics.median(x) * 1e6 for n, x in host.items()}
        print(f"B{B} H{H} S{S} D{D}: host time of one call, medians of {args.calls} alternating: "
              f"this {med['this']:.0f} us, other {med['other']:.0f} us ({med['other'] / med['this']:.2f}x)")


if __name__ == "__main__":
    main()
