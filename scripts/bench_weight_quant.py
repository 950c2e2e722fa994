"""128 x 128 blockwise quantization of FP32 master weights into both FP8 copies (the weights of Float8BlockScaling,
quantized every step): the register-tile kernel (quant_gluon.rowcol_1x128_regs, TWO_D) against the kernels the
tuner had before it (blockwise_kernel / blockwise_persistent_kernel), each call timed from a CUDA graph of 20 calls
(GPU time, as training replays graphs) and checked bit for bit against the other. GPU only.

    PYTHONPATH=src python scripts/bench_weight_quant.py [N,K ...]   (default: the 1.3b and 350m weights, 8192^2)
"""
import statistics
import sys

import torch

import lowbit.quant.triton_backend as tb
from lowbit import quantize
from lowbit.quant import Float8Blockwise


def graphed_ms(fn, n=20, reps=5):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / n)
    return statistics.median(ts)


shapes = [tuple(int(v) for v in s.split(",")) for s in sys.argv[1:]] or [
    (6144, 2048), (2048, 2048), (11264, 2048), (2048, 5632), (3072, 1024), (5632, 1024), (1024, 2816), (8192, 8192)]
sch = Float8Blockwise(block_dim=2)
regs_ok = tb._regs_ok
print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; CUDA-graph replay, median of 5 x 20 calls")
print("| weight N x K | dtype | before (tuner without the register tile) | register tile (TWO_D) | speedup | GB/s | bit-identical |")
print("|---|---|---:|---:|---:|---:|---|")
for dtype in (torch.float32, torch.bfloat16):
    for N, K in shapes:
        w = torch.randn(N, K, device="cuda", dtype=dtype)
        res = {}
        for label, ok in (("before", lambda x2, bs, two_d, *a: (not two_d) and regs_ok(x2, bs, two_d, *a)),
                          ("regs", regs_ok)):
            tb._regs_ok = ok
            tb._BLOCKWISE_PLANS.clear()
            tb._TUNED.clear()
            q = quantize(w, sch, rowwise=True, columnwise=True)
            plan = list(tb._BLOCKWISE_PLANS.values())[-1]
            res[label] = (graphed_ms(lambda: quantize(w, sch, rowwise=True, columnwise=True)), q, plan.fn)
        tb._regs_ok = regs_ok
        (tb0, q0, f0), (tr, qr, fr) = res["before"], res["regs"]
        same = all(torch.equal(getattr(q0, c).data.view(torch.uint8), getattr(qr, c).data.view(torch.uint8))
                   and torch.equal(getattr(q0, c).scale_inv, getattr(qr, c).scale_inv) for c in ("rowwise", "columnwise"))
        same = same and torch.equal(q0.rowwise.amax, qr.rowwise.amax)
        nbytes = N * K * (w.element_size() + 2)
        print(f"| {N} x {K} | {str(dtype)[6:]} | {tb0 * 1e3:.1f} us ({getattr(f0, '__name__', type(f0).__name__)}) | "
              f"{tr * 1e3:.1f} us ({getattr(fr, 'fn', fr).__name__ if hasattr(getattr(fr, 'fn', fr), '__name__') else 'regs'}) | "
              f"{tb0 / tr:.2f} | {nbytes / tr / 1e6:.0f} | {same} |")
