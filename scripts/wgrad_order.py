"""Weight-gradient GEMM (1x128 · 1x128, FP32 out) through cuBLAS in both operand orders, and the fprop GEMM
(1x128 · 128x128) through cuBLAS and the Gluon kernel, on the GPT presets' shapes (issue 7 diagnostic).

dW = dYᵀ·X is computed as scaled_mm(dy, x) (N_out x K_in) or as its transpose scaled_mm(x, dy) (K_in x N_out):
the same products and the same per-block scale promotion, only cuBLAS's tile walk differs. The transpose copied back
to (N_out, K_in) is what lowbit.gemm.wgrad_mm times against the first order (its pick is printed).

    PYTHONPATH=src python scripts/wgrad_order.py [--preset 1.3b,350m] [--rounds 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch  # noqa: E402

from lowbit import quantize, scaled_mm  # noqa: E402
from lowbit.bench import capture, median_ms  # noqa: E402
from lowbit.gemm import wgrad_mm  # noqa: E402
from lowbit.ops.transpose import transpose_2d  # noqa: E402
from lowbit.quant import Float8Blockwise  # noqa: E402

# tokens a step, (name, out features, in features)
PRESETS = {
    "1.3b": (8192, [("qkv", 6144, 2048), ("proj", 2048, 2048), ("fc1", 11264, 2048), ("fc2", 2048, 5632)]),
    "350m": (16384, [("qkv", 3072, 1024), ("proj", 1024, 1024), ("fc1", 5632, 1024), ("fc2", 1024, 2816)]),
}


def layer_operands(T: int, N: int, K: int, dev):
    """(x, dy, w, qx, qdy, qw) for a linear layer of N outputs, K inputs over T tokens: random BF16 X (T, K),
    dY (T, N) and W (N, K), and their fp8-block copies (1x128 activations, 128x128 weight; both copies each)."""
    act = Float8Blockwise()
    x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(T, N, device=dev, dtype=torch.bfloat16) * 1e-3
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
    return (x, dy, w, quantize(x, act, rowwise=True, columnwise=True), quantize(dy, act, rowwise=True, columnwise=True),
            quantize(w, Float8Blockwise(block_dim=2), rowwise=True, columnwise=True))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="1.3b,350m")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    for preset in args.preset.split(","):
        T, layers = PRESETS[preset]
        tot = {}
        for name, N, K in layers:
            x, dy, w, qx, qdy, qw = layer_operands(T, N, K, dev)
            dwt = torch.randn(K, N, device=dev)  # (the XᵀdY order's output, to be transposed)
            fns = {
                "wgrad dY^T X (cuBLAS)": lambda: scaled_mm(qdy, qx, a_copy="columnwise", b_copy="columnwise",
                                                            out_dtype=torch.float32, backend="cublas"),
                "wgrad X^T dY (cuBLAS)": lambda: scaled_mm(qx, qdy, a_copy="columnwise", b_copy="columnwise",
                                                            out_dtype=torch.float32, backend="cublas"),
                "wgrad (X^T dY)^T copied": lambda: scaled_mm(qx, qdy, a_copy="columnwise", b_copy="columnwise",
                                                              out_dtype=torch.float32, backend="cublas").t().contiguous(),
                "wgrad (X^T dY) transpose_2d": lambda: transpose_2d(scaled_mm(qx, qdy, a_copy="columnwise",
                                                                              b_copy="columnwise", out_dtype=torch.float32,
                                                                              backend="cublas")),
                "transpose: torch .t().contiguous()": lambda: dwt.t().contiguous(),
                "transpose: transpose_2d": lambda: transpose_2d(dwt),
                "wgrad_mm (tuned order)": lambda: wgrad_mm(qdy, qx, out_dtype=torch.float32),
                "fprop (cuBLAS)": lambda: scaled_mm(qx, qw, out_dtype=torch.bfloat16, backend="cublas"),
                "fprop (Triton/Gluon)": lambda: scaled_mm(qx, qw, out_dtype=torch.bfloat16, backend="triton"),
                "dgrad (cuBLAS)": lambda: scaled_mm(qdy, qw, a_copy="rowwise", b_copy="columnwise",
                                                     out_dtype=torch.bfloat16, backend="cublas"),
            }
            outs = {}
            for k in list(fns):  # (one call each: compiles, and drops a row whose backend declines the shape, e.g.
                try:             # cuBLAS blockwise with K / 128 not a multiple of 4)
                    outs[k] = fns[k]().float()
                except NotImplementedError as e:
                    print(f"  ({k}: {str(e).splitlines()[0][:100]})")
                    del fns[k]

            def maxdiff(k1, k2, t=False):
                if k1 not in outs or k2 not in outs:
                    return float("nan")
                b = outs[k2].t() if t else outs[k2]
                return (outs[k1] - b).abs().max().item() / max(outs[k1].abs().max().item(), 1e-30)
            d = maxdiff("wgrad dY^T X (cuBLAS)", "wgrad X^T dY (cuBLAS)", t=True)
            df = maxdiff("fprop (cuBLAS)", "fprop (Triton/Gluon)")
            flops = 2.0 * T * N * K
            # GPU time from CUDA graphs: eager do_bench of a ~50-200 us GEMM called from Python also times the host
            # (session 20: 350m proj's weight gradient read 189 us eagerly, 53 us replayed)
            graphs = {k: capture(fn) for k, fn in fns.items()}
            res = {k: [] for k in fns}
            for _ in range(args.rounds):
                for k, g in graphs.items():
                    res[k].append(median_ms(g.replay, warmup=10, rep=60))
            import lowbit.quant.triton_backend as tb
            pick = [v["ORDER"] for k, v in tb._TUNED.items() if k[0] == "wgrad_order" and k[1] == (N, T)
                    and k[2] == (K, T)]
            print(f"[{preset} {name}: T={T} N={N} K={K}] wgrad orders rel diff {d:.2g}; fprop rel diff {df:.2g}; "
                  f"wgrad_mm's order: {pick[0] if pick else '(not tuned)'}")
            for k, v in res.items():
                ms = statistics.median(v)
                tot[k] = (tot.get(k, (0.0, 0))[0] + ms, tot.get(k, (0.0, 0))[1] + 1)
                rate = (f"{8.0 * K * N / ms * 1e-6:7.0f} GB/s   " if k.startswith("transpose") else
                        f"{flops / ms * 1e-9:7.0f} TFLOP/s")
                print(f"  {k:34s} {ms * 1e3:8.1f} us  {rate}  rounds {[round(t * 1e3, 1) for t in v]}")
        print(f"[{preset}] per layer, us: " + ", ".join(
            f"{k} {t * 1e3:.0f}" + ("" if n == len(layers) else f" ({n} of {len(layers)} GEMMs)") for k, (t, n) in tot.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
