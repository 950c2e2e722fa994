"""RoPE in the QKV projection's forward GEMM (lowbit.gemm.scaled_mm_rope_qkv) against the two kernels it replaces
(the GEMM, then rope_qkv's kernel), at the 1.3b and 350m training shapes; triton.testing.do_bench medians.

Rows: cuBLAS blockwise GEMM + RoPE kernel (what training ran before), the Gluon warp-specialized GEMM + RoPE kernel,
the Gluon GEMM with RoPE in its epilogue, each config forced alone (its output checked bit for bit against the
Gluon GEMM + RoPE kernel first), and each GEMM alone. Each is timed as a CUDA graph of REPS calls (per call:
as in training's graphs, without the host's launch overhead, which timing single eager calls adds).

    PYTHONPATH=src python scripts/bench_rope_gemm.py [--shapes 4,2048,16,128,2048;8,2048,16,64,1024] [--rounds 2]
"""
import argparse
import os
import statistics

import torch
from triton.testing import do_bench

import lowbit.gemm.triton_backend as gtb
import lowbit.quant.triton_backend as qtb
from lowbit.gemm import scaled_mm, scaled_mm_rope_qkv
from lowbit.models.gpt import rope_tables
from lowbit.ops.rope import rope_qkv
from lowbit.quant import Float8Blockwise, quantize


REPS = 10  # calls captured in one CUDA graph: timed without the host's launch overhead, as training runs them


def _graph(fn):
    fn()  # compile / tune outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPS):
            fn()
    return g


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4,2048,16,128,2048;8,2048,16,64,1024", help="B,T,H,D,K;...")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    qtb.AUTOTUNE = False  # each forced list's first candidate is what runs
    print(torch.cuda.get_device_name(), torch.__version__)
    configs = list(gtb._WS_CONFIGS)
    for s in a.shapes.split(";"):
        B, T, H, D, K = (int(v) for v in s.split(","))
        M, N = B * T, 3 * H * D
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.05
        qx, qw = quantize(x, Float8Blockwise()), quantize(w, Float8Blockwise(block_dim=2))
        cos, sin = (t.cuda() for t in rope_tables(T, D, 10000.0))

        def two(backend):
            def run():
                y = scaled_mm(qx, qw, out_dtype=torch.bfloat16, backend=backend)
                return rope_qkv(y.view(B, T, 3, H, D), cos, sin)
            return run

        def gluon_two():
            os.environ["LOWBIT_GEMM_GLUON"] = "ws"
            try:
                return two("triton")()
            finally:
                os.environ.pop("LOWBIT_GEMM_GLUON", None)

        def fused(cfg):
            def run():
                gtb._WS_CONFIGS[:] = [cfg]
                try:
                    return scaled_mm_rope_qkv(qx, qw, cos, sin, seq_len=T, head_dim=D)
                finally:
                    gtb._WS_CONFIGS[:] = configs
            return run

        ref = gluon_two()
        fns = {"cuBLAS GEMM + RoPE kernel": two("cublas"), "Gluon GEMM + RoPE kernel": gluon_two}
        for cfg in configs:
            got = fused(cfg)()
            ok = all(torch.equal(got[j].view(B, T, H, D), ref[j].transpose(1, 2)) for j in range(3))
            fns[f"Gluon GEMM, RoPE in the epilogue, {cfg['STAGES']} stages" + ("" if ok else " (MISMATCH)")] = fused(cfg)
        fns["cuBLAS GEMM alone"] = lambda: scaled_mm(qx, qw, out_dtype=torch.bfloat16, backend="cublas")

        def gluon_alone():
            os.environ["LOWBIT_GEMM_GLUON"] = "ws"
            try:
                return scaled_mm(qx, qw, out_dtype=torch.bfloat16, backend="triton")
            finally:
                os.environ.pop("LOWBIT_GEMM_GLUON", None)
        fns["Gluon GEMM alone"] = gluon_alone
        res = {k: [] for k in fns}
        with torch.no_grad():
            graphs = {k: _graph(f) for k, f in fns.items()}
            for _ in range(a.rounds):
                for k, g in graphs.items():
                    res[k].append(do_bench(g.replay, warmup=5, rep=60, return_mode="median") / REPS)
        print(f"[B={B} T={T} H={H} D={D} K={K}: M={M} N={N}] us (rounds), TFLOP/s of the GEMM")
        for k, v in res.items():
            ms = statistics.median(v)
            print(f"  {k:52s} {ms * 1e3:7.1f}  {[round(t * 1e3, 1) for t in v]}  {2 * M * N * K / ms * 1e-9:6.0f}")


if __name__ == "__main__":
    main()
