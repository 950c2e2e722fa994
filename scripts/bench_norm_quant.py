"""RMSNorm fused into the 1x128 input quantizer (lowbit.ops.norm_quant.rmsnorm_quantize_1x128), FP32 x as the GPT's
residual stream hands it over, rstd given (the residual kernel computes it): each candidate forced alone, then the
autotuner's pick, each one call captured in a CUDA graph (a Python call of this op costs more host time than the
kernel takes) and replayed under triton.testing.do_bench (median), against a device-to-device copy of x.

    PYTHONPATH=src python scripts/bench_norm_quant.py [--shapes 8192x2048,16384x1024]
"""
import argparse

import torch
from triton.testing import do_bench

from lowbit.bench import capture

import lowbit.ops.norm_quant as NQ
import lowbit.quant.triton_backend as tb
from lowbit.quant import Float8Blockwise


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8192x2048,16384x1024", help="MxK,...")
    ap.add_argument("--gpt", default="", help="PRESET,BATCH: first print the tuner's picks after two training steps")
    a = ap.parse_args()
    if a.gpt:
        import sys, os
        sys.path.insert(0, os.path.dirname(__file__))
        from profile_model import training_step

        preset, bs = a.gpt.split(",")
        step = training_step(preset, int(bs), 2048, "fp8-block", torch.device("cuda"))
        step()
        step()
        torch.cuda.synchronize()
        for k, v in sorted(tb._TUNED.items(), key=str):
            print("  tuned", k, v)
        del step
        torch.cuda.empty_cache()
    sch = Float8Blockwise()
    regs0, quant0 = list(tb._REGS_CONFIGS), NQ._quant_configs
    print(torch.cuda.get_device_name(), torch.__version__)
    for s in a.shapes.split(","):
        M, K = (int(v) for v in s.split("x"))
        x = torch.randn(M, K, device="cuda", dtype=torch.float32)
        w = 1 + 0.1 * torch.randn(K, device="cuda", dtype=torch.float32)
        rstd = torch.rsqrt(x.pow(2).mean(-1) + 1e-5)
        nbytes = M * K * (4 + 2)  # x read, both FP8 copies written (scales not counted)
        y = torch.empty_like(x)
        copy_ms = do_bench(lambda: y.copy_(x), warmup=10, rep=60, return_mode="median")
        copy_bw = 2 * x.numel() * 4 / copy_ms * 1e-6
        print(f"{M}x{K} FP32: copy {copy_ms * 1e3:.1f} us, {copy_bw:.0f} GB/s")
        cands = list(regs0) + quant0(True, True)
        tb.AUTOTUNE = False
        try:
            for c in cands:
                tb._REGS_CONFIGS = [c] if c.get("KIND") == "regs" else []
                NQ._quant_configs = (lambda c: lambda r, cc: [] if c.get("KIND") == "regs" else [c])(c)
                NQ._PLANS.clear()
                g = capture(lambda: NQ.rmsnorm_quantize_1x128(x, w, 1e-5, sch, rowwise=True, columnwise=True, rstd=rstd))
                ms = do_bench(g.replay, warmup=10, rep=60, return_mode="median")
                bw = nbytes / ms * 1e-6
                print(f"  forced {str(c):70s} {ms * 1e3:7.1f} us {bw:6.0f} GB/s {bw / copy_bw:.2f} of copy")
        finally:
            tb._REGS_CONFIGS, NQ._quant_configs = regs0, quant0
            tb.AUTOTUNE = True
        for _ in range(3):  # the tuner's pick, three fresh tunings
            for k in [k for k in tb._TUNED if k[0] == "rms_quant"]:
                del tb._TUNED[k]
            NQ._PLANS.clear()
            NQ.rmsnorm_quantize_1x128(x, w, 1e-5, sch, rowwise=True, columnwise=True, rstd=rstd)
            print("  fresh tuning picked", [v for k, v in tb._TUNED.items() if k[0] == "rms_quant"])
        picks = {k: v for k, v in tb._TUNED.items() if k[0] == "rms_quant"}
        g = capture(lambda: NQ.rmsnorm_quantize_1x128(x, w, 1e-5, sch, rowwise=True, columnwise=True, rstd=rstd))
        ms = do_bench(g.replay, warmup=10, rep=60, return_mode="median")
        print(f"  tuned {picks}: {ms * 1e3:.1f} us, {nbytes / ms * 1e-6 / copy_bw:.2f} of copy")
        import lowbit

        g = capture(lambda: lowbit.quantize(x, sch, rowwise=True, columnwise=True))
        ms = do_bench(g.replay, warmup=10, rep=60, return_mode="median")
        print(f"  plain 1x128 quantize of x (no norm): {ms * 1e3:.1f} us, {nbytes / ms * 1e-6 / copy_bw:.2f} of copy")


if __name__ == "__main__":
    main()
