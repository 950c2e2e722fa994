"""SwiGLU fused with 1x128 FP8 quantization vs the two kernels it replaces (diagnostic; GPU).
Usage: PYTHONPATH=src python scripts/bench_swiglu_quant.py [M,F ...]   (default: the 1.3b and 350m MLPs)"""
import sys

import torch
from triton.testing import do_bench

from lowbit import quantize
from lowbit.ops.swiglu import swiglu, swiglu_quantize_1x128
from lowbit.quant.schemes import Float8Blockwise

sch = Float8Blockwise()
shapes = [tuple(int(v) for v in s.split(",")) for s in sys.argv[1:]] or [(8192, 5632), (16384, 2816), (16384, 5632)]
print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; median of do_bench; bytes = ideal traffic of the fused kernel")
print("| M | F | pass | unfused ms | fused ms | speedup | fused GB/s |")
print("|---|---|---|---:|---:|---:|---:|")
for M, F in shapes:
    u = torch.randn(M, 2 * F, device="cuda", dtype=torch.bfloat16)
    plain = lambda: quantize(swiglu(u), sch, rowwise=True, columnwise=True)  # noqa: E731
    fused = lambda: swiglu_quantize_1x128(u, sch)  # noqa: E731
    for _ in range(2):  # compile, and tune both before timing
        plain()
        fused()
    nbytes = M * 2 * F * 2 + 2 * M * F  # u read once, both FP8 copies written
    tp = do_bench(plain, warmup=25, rep=100, return_mode="median")
    tf = do_bench(fused, warmup=25, rep=100, return_mode="median")
    print(f"| {M} | {F} | fwd | {tp:.3f} | {tf:.3f} | {tp / tf:.2f} | {nbytes / tf / 1e6:.0f} |")

# SwiGLU's backward fused into fc1's grad_output quantizer: every candidate forced alone against the two kernels
import importlib  # noqa: E402

S = importlib.import_module("lowbit.ops.swiglu")  # (lowbit.ops.swiglu as an attribute is the function)
from lowbit.ops.swiglu import swiglu_backward, swiglu_backward_quantize_1x128  # noqa: E402
from lowbit.quant import triton_backend as tb  # noqa: E402

configs = list(S._SWIGLU_BWD_CONFIGS)
print("\n| M | F | backward: swiglu_backward + quantize ms | " + " | ".join(
    ("two kernels (the tuner's fallback)" if c["KIND"] == "two" else
     f"fused {c['num_warps']}w" + (f" cap {c['maxnreg']}" if c.get("maxnreg") else "") + (" compact" if c["COMPACT"] else ""))
    + " ms (GB/s)" for c in configs) + " |")
print("|---|---|---:|" + "---:|" * len(configs))
for M, F in shapes:
    u = torch.randn(M, 2 * F, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(M, F, device="cuda", dtype=torch.bfloat16)
    nbytes = M * 2 * F * 2 + M * F * 2 + 2 * M * 2 * F  # u and g read once, both FP8 copies of du written
    plain = lambda: quantize(swiglu_backward(u, g), sch, rowwise=True, columnwise=True)  # noqa: E731
    for _ in range(2):
        plain()
    cells = [f"{do_bench(plain, warmup=25, rep=100, return_mode='median'):.3f}"]
    for c in configs:
        S._SWIGLU_BWD_CONFIGS = [c]
        tb._TUNED.clear()
        f = lambda: swiglu_backward_quantize_1x128(u, g, sch)  # noqa: E731
        f()
        t = do_bench(f, warmup=25, rep=100, return_mode="median")
        cells.append(f"{t:.3f} ({nbytes / t / 1e6:.0f})")
    S._SWIGLU_BWD_CONFIGS = configs
    print(f"| {M} | {F} | " + " | ".join(cells) + " |")
