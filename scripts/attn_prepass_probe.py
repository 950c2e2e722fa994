"""Where the INT8·FP8 attention prepass spends its time: the whole prepass of one ``lowbit.attention(q, k, v,
qk="int8", pv="fp8")`` call (``_triton.prepass_triton``: Q, K and V in three launches) timed from CUDA graph replays,
each of its kernels' time from the torch profiler, and the bytes each moves in GB/s, beside a device-to-device copy
of Q; ``--separate`` adds ``quantize_qk_triton`` + ``quantize_v_fp8_triton`` called one after the other.

    python scripts/attn_prepass_probe.py [--shapes "4,32,4096,128;2,32,8192,128"] [--separate]
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch  # noqa: E402
import triton  # noqa: E402


def kernel_times(fn, iters=20):
    """{kernel name: mean µs a call} of ``fn`` over ``iters`` calls, from the torch profiler."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = defaultdict(float)
    for e in prof.events():
        if e.device_type.name == "CUDA":
            out[e.name] += e.device_time / iters if hasattr(e, "device_time") else e.cuda_time / iters
    return dict(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4,32,4096,128;2,32,8192,128")
    ap.add_argument("--separate", action="store_true", help="also time quantize_qk_triton + quantize_v_fp8_triton")
    args = ap.parse_args()
    from lowbit.attention import _triton as T

    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    for shp in args.shapes.split(";"):
        B, H, S, D = (int(x) for x in shp.split(","))
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        n = q.numel()
        fused = lambda: T.prepass_triton(q, k, v, qk="int8", pv="fp8", key_order="wgmma32")  # noqa: E731
        cases = {  # name: (fn, bytes moved)
            "copy Q (read + write)": (lambda: q.clone(), 4 * n),
            "prepass, fused (Q, K, V)": (fused, 3 * 2 * n + 2 * 2 * n + 3 * n),
        }
        if args.separate:
            cases["quantize_qk_triton + quantize_v_fp8_triton"] = (
                lambda: (T.quantize_qk_triton(q, k), T.quantize_v_fp8_triton(v, key_order="wgmma32")), None)
        print(f"B{B} H{H} S{S} D{D}  (the fused prepass reads Q, K, V, then K and V again, and writes three codes)")
        for name, (fn, nbytes) in cases.items():
            fn()
            ms = triton.testing.do_bench_cudagraph(fn, rep=200)
            bw = f"{nbytes / ms * 1e-6:7.0f} GB/s" if nbytes else ""
            print(f"  {name:44s} {ms * 1e3:8.1f} us {bw}")
        stat_bytes = 2 * n * 3 + n  # Q, K, V read, Q codes written
        moved = {"_prepass_stats_kernel": stat_bytes, "_prepass_codes_kernel": 2 * 2 * n + 2 * n}
        for name, us in sorted(kernel_times(fused).items(), key=lambda kv: -kv[1]):
            bw = f"{moved[name] / us * 1e-3:7.0f} GB/s" if name in moved else ""
            print(f"    kernel {name:40s} {us:8.1f} us {bw}")


if __name__ == "__main__":
    main()
