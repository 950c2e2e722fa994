"""GPU kernel-time breakdown of one training step of a GPT preset, BF16 vs an FP8 recipe (diagnostic).
Usage: PYTHONPATH=src python scripts/profile_model.py 350m 4 2048 bf16,fp8-block"""
import os
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import lowbit
from lowbit import recipes
from lowbit.models import GPT, config_from_preset



def training_step(preset: str, bs: int, seq: int, recipe_name: str, dev):
    """One AdamW training step of a fresh GPT preset (seed 0) on random bytes under ``recipe_name`` ("bf16": torch
    autocast only), as a closure; also used by scripts/quant_calls.py."""
    torch.manual_seed(0)
    cfg = config_from_preset(preset, max_seq_len=max(seq, config_from_preset(preset).max_seq_len))
    model = GPT(cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    r = recipes.from_name(recipe_name)
    idx = torch.randint(0, 256, (bs, seq + 1), device=dev)
    x, y = idx[:, :-1], idx[:, 1:]

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if r is None:
                _, loss = model(x, y)
            else:
                with lowbit.autocast(recipe=r, on_nonfinite="skip"):
                    _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def group(name: str) -> str:
    n = name.lower()
    for key, g in (("swiglu_quant", "fused swiglu+quantize"), ("_swiglu", "swiglu"), ("rms_rstd", "norm"),
                   ("residual_add", "elementwise"), ("norm_residual", "norm"), ("_rope", "rope"), ("nvjet", "gemm fp8 (cublas)"), ("scaled_mm", "gemm fp8 (cublas)"), ("fp8_gemm", "gemm fp8 (triton)"),
                   ("gemm", "gemm (cublas bf16)"), ("cutlass", "gemm (cublas bf16)"), ("sm90_xmma", "gemm (cublas bf16)"),
                   ("rowcol_1x128", "quantize"), ("blockwise_kernel", "quantize"), ("tensorwise", "quantize"), ("amax", "quantize"), ("rowscale", "quantize"),
                   ("mxfp8", "quantize"), ("nvfp4", "quantize"),
                   ("attn", "attention"), ("flash", "attention"), ("fmha", "attention"), ("_fwd", "attention"), ("_bwd", "attention"),
                   ("norm", "norm"), ("softmax", "loss/softmax"), ("cross_entropy", "loss/softmax"), ("nll", "loss/softmax"),
                   ("adam", "optimizer"), ("elementwise", "elementwise"), ("reduce", "reduce"), ("copy", "copy/cast"),
                   ("cat", "copy/cast"), ("fill", "fill")):
        if key in n:
            return g
    return "other"


def main():
    preset, bs, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    out = os.environ.get("OUT", "/tmp")
    for rn in sys.argv[4].split(","):
        step = training_step(preset, bs, seq, rn, torch.device("cuda"))
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        tot = defaultdict(float)
        per = defaultdict(float)
        for e in prof.key_averages():
            t = e.self_device_time_total if hasattr(e, "self_device_time_total") else e.self_cuda_time_total
            if t <= 0:
                continue
            tot[group(e.key)] += t / 2
            per[e.key] += t / 2
        allt = sum(tot.values())
        print(f"=== {preset} {rn}: GPU kernel time per step {allt / 1e3:.2f} ms (bs {bs}, seq {seq})")
        for g, t in sorted(tot.items(), key=lambda kv: -kv[1]):
            print(f"   {g:24s} {t / 1e3:8.2f} ms  {100 * t / allt:5.1f}%")
        with open(f"{out}/kernels_{preset}_{rn}.txt", "w") as f:
            for k, t in sorted(per.items(), key=lambda kv: -kv[1])[:60]:
                f.write(f"{t / 1e3:9.3f} ms  {group(k):20s} {k[:150]}\n")
        del step
        torch.cuda.empty_cache()

    from lowbit.gemm import cublas as _cb

    for sig, why in _cb.REJECTED_WHY.items():
        print("cuBLAS rejected", sig, "->", why)


if __name__ == "__main__":
    main()
