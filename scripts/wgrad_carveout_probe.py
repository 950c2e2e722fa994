"""Does torch's SM carveout (``torch._C._set_sm_carveout_experimental``) reach cuBLAS's blockwise FP8 GEMM? The 350m
fc1 weight gradient (1x128 · 1x128, FP32 out) timed from a CUDA graph with 0 / 16 / 32 / 66 SMs left out, and the
grid of its kernel (issue 7 diagnostic, session 29).

    PYTHONPATH=src python scripts/wgrad_carveout_probe.py
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from lowbit import quantize, scaled_mm  # noqa: E402
from lowbit.bench import capture, median_ms  # noqa: E402
from lowbit.quant import Float8Blockwise  # noqa: E402
from lowbit.train.graph_profile import kernel_trace  # noqa: E402

T, N, K = 16384, 5632, 1024
dev = torch.device("cuda")
qx = quantize(torch.randn(T, K, device=dev, dtype=torch.bfloat16), Float8Blockwise(), rowwise=True, columnwise=True)
qdy = quantize(torch.randn(T, N, device=dev, dtype=torch.bfloat16), Float8Blockwise(), rowwise=True, columnwise=True)
ref = None
for carve in (None, 16, 32, 66):
    torch._C._set_sm_carveout_experimental(carve)
    fn = lambda: scaled_mm(qdy, qx, a_copy="columnwise", b_copy="columnwise", out_dtype=torch.float32, backend="cublas")  # noqa: E731
    y = fn()
    ref = y if ref is None else ref
    g = capture(fn)
    ms = median_ms(g.replay, warmup=10, rep=60)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    grids = [(name[:50], grid) for _, _, _, grid, name in kernel_trace(prof)]
    print(f"carveout {carve}: {ms * 1e3:7.1f} us  {2 * T * N * K / ms * 1e-9:6.0f} TFLOP/s  same bits {torch.equal(y, ref)}  "
          f"kernels {grids}", flush=True)
torch._C._set_sm_carveout_experimental(None)
