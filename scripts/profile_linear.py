"""Where does an eager lowbit Linear step spend its time? (GPU diagnostic, not a test.)

For each shape and recipe: GPU-bound median (do_bench), host enqueue time per step (wall time of N
steps with no sync inside, on a shape small enough that the GPU is idle-waiting), hidden syncs
(torch.cuda.set_sync_debug_mode), a torch.profiler kernel table and a cProfile of the host path.
Writes to $OUT (or /tmp/lowbit-prof).  Usage: PYTHONPATH=src python scripts/profile_linear.py
"""
import cProfile
import io
import os
import pstats
import time
import warnings

import torch

import lowbit
from lowbit import recipes
from lowbit.bench import median_ms

OUT = os.environ.get("OUT", "/tmp/lowbit-prof")
os.makedirs(OUT, exist_ok=True)
dev = torch.device("cuda")
SHAPES = [tuple(int(v) for v in s.split("x")) for s in os.environ.get("SHAPES", "16384x4096x4096,8192x768x768").split(",")]
RECIPES = os.environ.get("RECIPES", "bf16,fp8-block,fp8-current").split(",")


def make(rn, M, K, N):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g).to(dev, torch.bfloat16).requires_grad_()
    dy = torch.randn(M, N, generator=g).to(dev, torch.bfloat16)
    if rn == "bf16":
        m = torch.nn.Linear(K, N, bias=False, device=dev, dtype=torch.bfloat16)
        fn = lambda: m(x).backward(dy)  # noqa: E731
    else:
        m = lowbit.nn.Linear(K, N, bias=False, device=dev, dtype=torch.bfloat16)
        r = recipes.from_name(rn)

        def fn():
            with lowbit.autocast(recipe=r):
                y = m(x)
            y.backward(dy)
    return fn, [x, m.weight]


def main():
    for (M, K, N) in SHAPES:
        for rn in RECIPES:
            fn, grads = make(rn, M, K, N)
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            med = median_ms(fn, warmup=10, rep=100, grad_to_none=grads)
            # host enqueue time: steps back to back, sync only at the end
            n = 50
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                for gq in grads:
                    gq.grad = None
                fn()
            t_host = (time.perf_counter() - t0) / n * 1e3
            torch.cuda.synchronize()
            t_all = (time.perf_counter() - t0) / n * 1e3
            # hidden syncs
            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                fn()
            torch.cuda.set_sync_debug_mode(0)
            syncs = [str(x.message)[:200] for x in w if "synchroniz" in str(x.message).lower()]
            print(f"{M}x{K}x{N} {rn}: do_bench median {med:.3f} ms; loop wall/step {t_all:.3f} ms, host enqueue/step {t_host:.3f} ms; syncs {len(syncs)}", flush=True)
            for s in syncs[:5]:
                print("   sync:", s)
            if rn == "bf16":
                continue
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
            tag = f"{M}x{K}x{N}_{rn}"
            with open(f"{OUT}/prof_{tag}.txt", "w") as f:
                f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
                f.write("\n\nCPU\n")
                f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            pr.disable()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(45)
            s.write("\n\n===== cumulative\n")
            pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(60)
            with open(f"{OUT}/cprof_{tag}.txt", "w") as f:
                f.write(s.getvalue())


if __name__ == "__main__":
    main()
