"""Where the INT8·FP8 attention prepass spends its time: each of its launches timed alone (CUDA graph replays,
triton.testing.do_bench_cudagraph), with the bytes each moves and GB/s, beside a device-to-device copy of Q.

    python scripts/attn_prepass_probe.py [--shapes "4,32,4096,128;2,32,8192,128"]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch  # noqa: E402
import triton  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4,32,4096,128;2,32,8192,128")
    args = ap.parse_args()
    from lowbit.attention import _triton as T
    from lowbit.attention import reference as R

    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    for shp in args.shapes.split(";"):
        B, H, S, D = (int(x) for x in shp.split(","))
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        n = q.numel()
        km = R.k_mean(k)
        part = torch.empty(B * H, -(-S // 64), D, device="cuda", dtype=torch.float32)
        vsc = torch.empty(B, H, D, device="cuda", dtype=torch.float32)
        inv = torch.empty_like(vsc)
        v8 = torch.empty(B, H, D, S, device="cuda", dtype=torch.float8_e4m3fn).permute(0, 1, 3, 2)
        bd = triton.next_power_of_2(D)
        views = T._views(v, "bhsd", False)
        cases = {  # name: (fn, bytes moved)
            "copy Q (read + write)": (lambda: q.clone(), 4 * n),
            "K mean (torch, fp32 sums)": (lambda: R.k_mean(k), 2 * n),
            "quantize_qk_triton (mean + Q + K)": (lambda: T.quantize_qk_triton(q, k), 2 * n + 3 * n + 3 * n),
            "V amax partials": (lambda: T._v_amax_kernel[(part.shape[1], B * H)](
                v, part, part, *views, H, S, part.shape[1], CHUNK=64, BLOCK_D=bd, D=D, VARLEN=False, num_warps=4),
                2 * n),
            "V scales": (lambda: T._v_scale_kernel[(B * H,)](part, vsc, inv, part.shape[1], D=D, BLOCK_D=bd, CH=8,
                                                             FP16=False, num_warps=4), part.numel() * 4),
            "V codes": (lambda: T._v_quant_kernel[(part.shape[1], B * H)](
                v, v8, inv, part, *views, *T._views(v8, "bhsd", False), H, S, CHUNK=64, BLOCK_D=bd, D=D,
                VARLEN=False, FP16=False, INTERPRET=False, KEY_PERM=True, num_warps=4), 3 * n),
            "quantize_v_fp8_triton (wgmma32)": (lambda: T.quantize_v_fp8_triton(v, key_order="wgmma32"), 5 * n),
        }
        print(f"B{B} H{H} S{S} D{D}")
        for name, (fn, nbytes) in cases.items():
            fn()
            ms = triton.testing.do_bench(fn, warmup=25, rep=200)
            print(f"  {name:36s} {ms * 1e3:8.1f} us {nbytes / ms * 1e-6:7.0f} GB/s")


if __name__ == "__main__":
    main()
