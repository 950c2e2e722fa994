"""Where the host time of one quantized Linear forward + backward goes: a cProfile of the eager call path.

``lowbit bench linear`` says how long the host takes to enqueue a ``lowbit.nn.Linear`` forward + backward against
``torch.nn.Linear`` (its host ms column); this tool says where that time goes. For each recipe it runs the user's
set-up (FP32 parameters, ``torch.autocast`` bfloat16, ``lowbit.autocast`` around the forward, ``backward`` with a
contiguous gradient), prints the host ms per call next to BF16's, then the functions with the most own time and the
most cumulative time over ``--calls`` profiled calls. Run it on the GPU machine at a shape the GPU finishes faster
than the host enqueues (the default).

``--layers L`` stacks L Linears (K -> N, then N -> N) under one ``lowbit.autocast`` and one backward, as a model
does: the per-step costs (the autocast's entry and exit, the NaN sentry's two checks) are then shared, and the
times printed are per Linear.

``--inference`` profiles the forward alone under ``torch.inference_mode`` (a prefill or decode step of an inference
server or ``generate()``; ``--shape 1x2048x2048`` is one decode token).

``--floor`` prints, before the profiles, the host time of the parts any quantized Linear forward + backward is made
of, each alone: the three GEMMs as bare ``torch._scaled_mm`` calls on ready FP8 operands, an empty autograd Function,
and lowbit's three quantizations and three GEMMs per recipe. Their sum against 1.5x BF16 is the bound on how cheap an
eager quantized Linear can be with these calls.

Usage: ``python tools/host_profile.py [--shape 4096x1024x1024] [--recipes fp8-current,fp8-block] [--top 30]
[--floor] [--inference]`` (``--device cpu`` profiles the reference path: a smoke test, not the GPU path).
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


def _step(module, x, dy, recipe, inference=False):
    if inference:
        def fwd():
            with torch.inference_mode(), torch.autocast(x.device.type, dtype=torch.bfloat16):
                if recipe is None:
                    module(x)
                else:
                    with lowbit.autocast(recipe=recipe):
                        module(x)

        return fwd

    def fn():
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            if recipe is None:
                y = module(x)
            else:
                with lowbit.autocast(recipe=recipe):
                    y = module(x)
        y.backward(dy)

    return fn


class _Empty(torch.autograd.Function):
    """An autograd Function that does no work: the engine's and the Function's own host cost."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.k = x.shape[1]
        return x.new_empty(x.shape[0], w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        return dy.new_empty(dy.shape[0], ctx.k), None


def _floor(M, K, N, recipes, dev, t_bf16):
    """Host ms of the parts of one quantized Linear forward + backward, each alone (see the module docstring)."""
    from lowbit.gemm import scaled_mm
    from lowbit.quant import quantize

    def per_call(fn):
        return host_ms(fn, n=200, device=dev)

    f8 = torch.float8_e4m3fn
    a, b = torch.randn(M, K, device=dev).to(f8), torch.randn(N, K, device=dev).to(f8)
    g, bt = torch.randn(M, N, device=dev).to(f8), torch.randn(K, N, device=dev).to(f8)
    ct, xt = torch.randn(N, M, device=dev).to(f8), torch.randn(K, M, device=dev).to(f8)
    one = torch.ones((), device=dev)

    def three_mm():
        torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16)
        torch._scaled_mm(g, bt.t(), one, one, out_dtype=torch.bfloat16)
        torch._scaled_mm(ct, xt.t(), one, one, out_dtype=torch.float32)

    x = torch.randn(M, K, device=dev, requires_grad=True)
    w = torch.randn(N, K, device=dev)
    dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)

    def empty_fn():
        _Empty.apply(x, w).backward(dy)

    rows = [("3 x torch._scaled_mm, per-tensor scales, ready FP8 operands", per_call(three_mm)),
            ("an empty autograd Function, forward + backward", per_call(empty_fn))]
    xb, wb = x.detach().bfloat16(), w
    for name, recipe in recipes:
        sx, sw, sg = (recipe.role(r).scheme for r in ("input", "weight", "grad_output"))
        qx, qw, qg = quantize(xb, sx, True, True), quantize(wb, sw, True, True), quantize(dy, sg, True, True)
        rows.append((f"{name}: lowbit.quantize of x, w, dy (rowwise + columnwise)",
                     per_call(lambda: (quantize(xb, sx, True, True), quantize(wb, sw, True, True),
                                       quantize(dy, sg, True, True)))))
        rows.append((f"{name}: lowbit.scaled_mm fprop, dgrad, wgrad",
                     per_call(lambda: (scaled_mm(qx, qw, out_dtype=torch.bfloat16),
                                       scaled_mm(qg, qw, b_copy="columnwise", out_dtype=torch.bfloat16),
                                       scaled_mm(qg, qx, a_copy="columnwise", b_copy="columnwise",
                                                 out_dtype=torch.float32)))))
    print(f"\n## host floor at {M}x{K}x{N}: each part alone, ms per call (BF16 nn.Linear fwd + bwd {t_bf16:.3f}; "
          f"1.5x BF16 = {1.5 * t_bf16:.3f})")
    for what, t in rows:
        print(f"| {what} | {t:.3f} | {t / t_bf16:.2f}x BF16 |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="4096x1024x1024", help="MxKxN: tokens, in_features, out_features")
    ap.add_argument("--recipes", default="fp8-current,fp8-block", help=f"any of {', '.join(QUANTIZED_NAMES)}")
    ap.add_argument("--calls", type=int, default=20, help="profiled calls per recipe")
    ap.add_argument("--top", type=int, default=30, help="functions listed per ordering")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--floor", action="store_true", help="first, the host time of each part alone (CUDA only)")
    ap.add_argument("--layers", type=int, default=1, help="Linears in the profiled stack (times are per Linear)")
    ap.add_argument("--inference", action="store_true", help="the forward alone, under torch.inference_mode")
    args = ap.parse_args(argv)
    try:
        M, K, N = (int(v) for v in args.shape.lower().split("x"))
        recipes = [(n, from_name(n)) for n in args.recipes.split(",") if n.strip()]
    except ValueError as e:
        ap.error(f"--shape / --recipes: {e}")
    if args.layers < 1:
        ap.error(f"--layers: expected an int >= 1, got {args.layers}")
    L = args.layers
    dev = torch.device(args.device)
    torch.manual_seed(0)
    x = torch.randn(M, K, device=dev, requires_grad=True)
    dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)

    def stack(make):
        return torch.nn.Sequential(*[make(K if i == 0 else N, N) for i in range(L)])

    base = stack(lambda k, n: torch.nn.Linear(k, n, bias=False, device=dev))
    what = "forward (inference_mode)" if args.inference else "forward + backward"
    t_bf16 = host_ms(_step(base, x, dy, None, args.inference), [x, *base.parameters()], device=dev) / L
    print(f"torch.nn.Linear (FP32 params, autocast bf16): host {t_bf16:.3f} ms per {what}"
          + (f" (a stack of {L})" if L > 1 else ""))
    if args.floor and dev.type == "cuda" and not args.inference:
        _floor(M, K, N, recipes, dev, t_bf16)
    for name, recipe in recipes:
        lin = stack(lambda k, n: lowbit.nn.Linear(k, n, bias=False, device=dev))
        fn = _step(lin, x, dy, recipe, args.inference)
        t = host_ms(fn, [x, *lin.parameters()], device=dev) / L
        print(f"\n## {name}: host {t:.3f} ms per {what} ({t / t_bf16:.2f}x BF16)")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            x.grad = None
            lin.zero_grad(set_to_none=True)
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
