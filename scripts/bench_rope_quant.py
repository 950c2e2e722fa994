"""RoPE's backward fused into the QKV grad_output quantizer (lowbit.ops.rope.rope_backward_quantize_1x128): each
candidate forced alone, timed with triton.testing.do_bench (median), at the 1.3b and 350m training shapes.

    PYTHONPATH=src python scripts/bench_rope_quant.py [--shapes 4,2048,16,128;8,2048,16,64]
"""
import argparse

import torch
from triton.testing import do_bench

import lowbit.ops.rope as R
import lowbit.quant.triton_backend as tb
from lowbit.models.gpt import rope_tables
from lowbit.quant import Float8Blockwise


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4,2048,16,128;8,2048,16,64", help="B,T,H,D;...")
    a = ap.parse_args()
    tb.AUTOTUNE = False
    sch = Float8Blockwise()
    orig = list(R._ROPE_BWD_CONFIGS)
    print(torch.cuda.get_device_name(), torch.__version__)
    for s in a.shapes.split(";"):
        B, T, H, D = (int(v) for v in s.split(","))
        gs = [torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        cos, sin = (t.cuda() for t in rope_tables(T, D, 10000.0))
        nbytes = 3 * gs[0].numel() * 2 * 2  # the gradients read, both FP8 copies written (scales not counted)
        y = torch.empty_like(gs[0])
        copy_ms = do_bench(lambda: y.copy_(gs[0]), warmup=10, rep=60, return_mode="median")
        copy_bw = 2 * gs[0].numel() * 2 / copy_ms * 1e-6
        for cfg in orig:
            R._ROPE_BWD_CONFIGS = [cfg]
            ms = do_bench(lambda: R.rope_backward_quantize_1x128(*gs, cos, sin, sch), warmup=10, rep=60,
                          return_mode="median")
            bw = nbytes / ms * 1e-6
            print(f"  B{B} T{T} H{H} D{D} {str(cfg):75s} {ms * 1e3:8.1f} us {bw:6.0f} GB/s {bw / copy_bw:.2f} of copy")
        R._ROPE_BWD_CONFIGS = orig


if __name__ == "__main__":
    main()
