"""Where the host time of one quantized Linear forward + backward goes: a cProfile of the eager call path.

``lowbit bench linear`` says how long the host takes to enqueue a ``lowbit.nn.Linear`` forward + backward against
``torch.nn.Linear`` (its host ms column); this tool says where that time goes. For each recipe it runs the user's
set-up (FP32 parameters, ``torch.autocast`` bfloat16, ``lowbit.autocast`` around the forward, ``backward`` with a
contiguous gradient), prints the host ms per call next to BF16's, then the functions with the most own time and the
most cumulative time over ``--calls`` profiled calls. Run it on the GPU machine at a shape the GPU finishes faster
than the host enqueues (the default).

Usage: ``python tools/host_profile.py [--shape 4096x1024x1024] [--recipes fp8-current,fp8-block] [--top 30]``
(``--device cpu`` profiles the reference path: a smoke test, not the GPU path).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys

import torch

import lowbit
from lowbit.bench.linear import host_ms
from lowbit.recipes import QUANTIZED_NAMES, from_name


def _step(module, x, dy, recipe):
    def fn():
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            if recipe is None:
                y = module(x)
            else:
                with lowbit.autocast(recipe=recipe):
                    y = module(x)
        y.backward(dy)

    return fn


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="4096x1024x1024", help="MxKxN: tokens, in_features, out_features")
    ap.add_argument("--recipes", default="fp8-current,fp8-block", help=f"any of {', '.join(QUANTIZED_NAMES)}")
    ap.add_argument("--calls", type=int, default=20, help="profiled calls per recipe")
    ap.add_argument("--top", type=int, default=30, help="functions listed per ordering")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    try:
        M, K, N = (int(v) for v in args.shape.lower().split("x"))
        recipes = [(n, from_name(n)) for n in args.recipes.split(",") if n.strip()]
    except ValueError as e:
        ap.error(f"--shape / --recipes: {e}")
    dev = torch.device(args.device)
    torch.manual_seed(0)
    x = torch.randn(M, K, device=dev, requires_grad=True)
    dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    base = torch.nn.Linear(K, N, bias=False, device=dev)
    t_bf16 = host_ms(_step(base, x, dy, None), [x, base.weight], device=dev)
    print(f"torch.nn.Linear (FP32 params, autocast bf16): host {t_bf16:.3f} ms per forward + backward")
    for name, recipe in recipes:
        lin = lowbit.nn.Linear(K, N, bias=False, device=dev)
        fn = _step(lin, x, dy, recipe)
        t = host_ms(fn, [x, lin.weight], device=dev)
        print(f"\n## {name}: host {t:.3f} ms per forward + backward ({t / t_bf16:.2f}x BF16)")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            x.grad = lin.weight.grad = None
            fn()
        prof.disable()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        for order in ("tottime", "cumulative"):
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats(order).print_stats(args.top)
            print(f"### by {order} ({args.calls} calls)\n{out.getvalue()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
