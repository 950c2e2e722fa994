"""``lowbit bench linear``: one Linear, forward + backward, BF16 vs lowbit recipes vs torchao.

For each (M, K, N) — M tokens, K in_features, N out_features — it times, in the same run:

* ``torch.nn.Linear`` in BF16 (the baseline every ratio refers to);
* :class:`lowbit.nn.Linear` under each requested recipe (eager), plus the time split of one step
  into its parts: quantize x (both copies), quantize w (both copies), quantize dy (both copies),
  and the three GEMMs (fprop, dgrad, wgrad) on pre-quantized operands;
* torchao, when importable: ``convert_to_float8_training`` tensorwise and rowwise (eager and
  ``torch.compile``d) and ``Float8BlockwiseLinear``.

Timing is the median of ``triton.testing.do_bench`` on CUDA (gradients reset to None each rep, for
every contender alike). All Linears are bias-free (torchao's blockwise Linear takes no bias).
FLOPs per fwd+bwd = 6·M·K·N. **host ms**: the time to enqueue one forward + backward, from back-to-back calls
without a synchronize (:func:`host_ms`); **host × BF16** its ratio to the BF16 Linear's (the eager-overhead target
is at most 1.5): run it at a shape the GPU finishes faster than the host enqueues (e.g. ``4096x1024x1024``).
``--device cpu`` with tiny shapes runs the references (a smoke test, not a benchmark).

Usage: ``python -m lowbit.bench.linear [--shapes 16384x4096x4096,16384x4096x14336] [--recipes ...]``
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time

import torch

from ..recipes import QUANTIZED_NAMES

DEFAULT_SHAPES = "16384x4096x4096,16384x4096x14336"
DEFAULT_RECIPES = ",".join(QUANTIZED_NAMES)

__all__ = ["main", "bench_shape", "host_ms"]


def _parse_shapes(s: str):
    out = []
    for part in s.split(","):
        try:
            m, k, n = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise ValueError(f"--shapes: expected MxKxN[,MxKxN...] with positive ints, got {part!r}") from None
        if min(m, k, n) < 1:
            raise ValueError(f"--shapes: dims must be positive, got {part!r}")
        out.append((m, k, n))
    return out


def _timer(device: torch.device, warmup: int, rep: int):
    """fn, grads -> median milliseconds."""
    if device.type == "cuda":
        try:
            import triton.testing  # noqa: F401 - median_ms needs it

            from . import median_ms

            def t(fn, grads=()):
                return median_ms(fn, warmup=warmup, rep=rep, grad_to_none=list(grads) or None)

            return t
        except ImportError:
            pass

    def t(fn, grads=()):
        run = _with_fresh_grads(fn, grads)
        for _ in range(2):
            run()
        times = []
        n = 0
        deadline = time.perf_counter() + rep / 1000.0
        while n < 3 or (time.perf_counter() < deadline and n < 1000):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
            n += 1
        return statistics.median(times)

    return t


def _with_fresh_grads(fn, grads):
    """``fn`` run after the ``.grad`` of each of ``grads`` is reset to None (every timed contender alike)."""
    def run():
        for g in grads:
            g.grad = None
        fn()

    return run


def host_ms(fn, grads=(), n: int = 50, device: torch.device | None = None) -> float:
    """Host time (ms) to enqueue one ``fn()`` — a forward + backward — measured over ``n`` back-to-back calls with no
    synchronize between them (after a warm-up): the time Python and the launch path take, which a GPU faster than
    the host cannot hide. On a GPU slower than the host this is the GPU time instead (the launch queue fills)."""
    run = _with_fresh_grads(fn, grads)
    for _ in range(3):
        run()
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(n):
        run()
    t1 = time.perf_counter()
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return (t1 - t0) * 1e3 / n


def _fwd_bwd(module, x, dy, ctx=None):
    def fn():
        if ctx is None:
            y = module(x)
        else:
            with ctx():
                y = module(x)
        y.backward(dy)

    return fn


def _torchao_contenders(make_linear, device):
    """(name, module) pairs for torchao, or [] (with the reason printed) when it is not importable."""
    out = []
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception as e:  # noqa: BLE001 - any import problem means "no torchao"
        print(f"# torchao.float8 not available ({type(e).__name__}: {e}); skipping torchao", file=sys.stderr)
        return out
    for rname in ("tensorwise", "rowwise"):
        try:
            cfg = Float8LinearConfig.from_recipe_name(rname)
            m = convert_to_float8_training(torch.nn.Sequential(make_linear()), config=cfg)
            out.append((f"torchao {rname} eager", m))
            mc = convert_to_float8_training(torch.nn.Sequential(make_linear()), config=cfg)
            out.append((f"torchao {rname} compiled", torch.compile(mc)))
        except Exception as e:  # noqa: BLE001
            print(f"# torchao {rname}: {type(e).__name__}: {e}", file=sys.stderr)
    try:
        from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear

        out.append(("torchao blockwise", Float8BlockwiseLinear.from_float(make_linear())))
    except Exception as e:  # noqa: BLE001
        print(f"# torchao blockwise: {type(e).__name__}: {e}", file=sys.stderr)
    return out


def _split(recipe, x, w, dy, timer):
    """Per-part times (ms) of one lowbit step: the three quantizations and the three GEMMs."""
    from lowbit.gemm import scaled_mm
    from lowbit.quant import quantize

    rx, rw, rg = (recipe.role(r).scheme for r in ("input", "weight", "grad_output"))
    qx = quantize(x, rx, rowwise=True, columnwise=True)
    qw = quantize(w, rw, rowwise=True, columnwise=True)
    qg = quantize(dy, rg, rowwise=True, columnwise=True)
    parts = {
        "quant x": timer(lambda: quantize(x, rx, rowwise=True, columnwise=True)),
        "quant w": timer(lambda: quantize(w, rw, rowwise=True, columnwise=True)),
        "quant dy": timer(lambda: quantize(dy, rg, rowwise=True, columnwise=True)),
        "fprop": timer(lambda: scaled_mm(qx, qw, out_dtype=x.dtype)),
        "dgrad": timer(lambda: scaled_mm(qg, qw, a_copy="rowwise", b_copy="columnwise", out_dtype=x.dtype)),
        "wgrad": timer(lambda: scaled_mm(qg, qx, a_copy="columnwise", b_copy="columnwise", out_dtype=torch.float32)),
    }
    return parts


def bench_shape(M, K, N, recipe_names, *, device, dtype=torch.bfloat16, warmup=25, rep=100, torchao=True, split=True):
    """Rows (dicts) for one shape: name, ms, speedup over BF16, TFLOP/s, and for lowbit the part split."""
    import lowbit.nn
    from lowbit import recipes

    timer = _timer(device, warmup, rep)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(M, K, generator=g).to(device, dtype).requires_grad_()
    dy = torch.randn(M, N, generator=g).to(device, dtype)
    w0 = (torch.randn(N, K, generator=g) / K**0.5).to(device, dtype)

    def make_linear(cls=torch.nn.Linear):
        m = cls(K, N, bias=False, device=device, dtype=dtype)
        with torch.no_grad():
            m.weight.copy_(w0)
        return m

    flops = 6.0 * M * K * N
    rows = []
    base = make_linear()
    t_bf16 = timer(_fwd_bwd(base, x, dy), [x, base.weight])
    rows.append(dict(name=f"torch.nn.Linear {str(dtype).replace('torch.', '')}", ms=t_bf16,
                     host_ms=host_ms(_fwd_bwd(base, x, dy), [x, base.weight], device=device)))
    for rn in recipe_names:
        recipe = recipes.from_name(rn)
        if recipe is None:
            continue
        m = make_linear(lowbit.nn.Linear)
        ctx = lambda r=recipe: lowbit.nn.autocast(recipe=r)  # noqa: E731
        try:
            t = timer(_fwd_bwd(m, x, dy, ctx), [x, m.weight])
        except (NotImplementedError, ValueError) as e:
            rows.append(dict(name=f"lowbit {rn}", ms=float("nan"), note=f"{type(e).__name__}: {e}"))
            continue
        row = dict(name=f"lowbit {rn}", ms=t, host_ms=host_ms(_fwd_bwd(m, x, dy, ctx), [x, m.weight], device=device))
        if split:
            row["parts"] = _split(recipe, x.detach(), m.weight.detach(), dy, timer)
        rows.append(row)
    if torchao and device.type == "cuda":
        for name, mod in _torchao_contenders(make_linear, device):
            try:
                w = next(mod.parameters())
                rows.append(dict(name=name, ms=timer(_fwd_bwd(mod, x, dy), [x, w]),
                                 host_ms=host_ms(_fwd_bwd(mod, x, dy), [x, w], device=device)))
            except Exception as e:  # noqa: BLE001 - report and go on
                rows.append(dict(name=name, ms=float("nan"), note=f"{type(e).__name__}: {e}"))
    for r in rows:
        r["speedup"] = t_bf16 / r["ms"] if r["ms"] == r["ms"] else float("nan")
        r["tflops"] = flops / (r["ms"] * 1e-3) / 1e12 if r["ms"] == r["ms"] else float("nan")
    return rows


def _format(M, K, N, rows) -> str:
    lines = [f"### Linear fwd+bwd, (M, K, N) = ({M}, {K}, {N})", "",
             "| contender | ms | × BF16 | TFLOP/s | host ms | host × BF16 | quantize ms (x / w / dy) | GEMM ms "
             "(fprop / dgrad / wgrad) | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    base_host = rows[0].get("host_ms", float("nan")) if rows else float("nan")
    for r in rows:
        p = r.get("parts")
        q = g = ""
        if p:
            q = (f"{p['quant x'] + p['quant w'] + p['quant dy']:.3f} "
                 f"({p['quant x']:.3f} / {p['quant w']:.3f} / {p['quant dy']:.3f})")
            g = f"{p['fprop'] + p['dgrad'] + p['wgrad']:.3f} ({p['fprop']:.3f} / {p['dgrad']:.3f} / {p['wgrad']:.3f})"
        h = r.get("host_ms", float("nan"))
        lines.append(f"| {r['name']} | {r['ms']:.3f} | {r['speedup']:.2f} | {r['tflops']:.1f} | {h:.3f} | "
                     f"{h / base_host:.2f} | {q} | {g} | {r.get('note', '')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Run the benchmark and print a Markdown table per shape; returns the exit status."""
    ap = argparse.ArgumentParser(prog="lowbit bench linear", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"MxKxN list (default {DEFAULT_SHAPES})")
    ap.add_argument("--recipes", default=DEFAULT_RECIPES, help=f"recipe names (default {DEFAULT_RECIPES})")
    ap.add_argument("--device", default="cuda", help="cuda (benchmark) or cpu (smoke test of the references)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warm-up time, ms")
    ap.add_argument("--rep", type=int, default=100, help="do_bench measuring time, ms")
    ap.add_argument("--no-torchao", action="store_true", help="skip the torchao contenders")
    ap.add_argument("--no-split", action="store_true", help="skip the quantize/GEMM time split")
    ap.add_argument("--out", default=None, help="also append the tables to this Markdown file")
    args = ap.parse_args(argv)
    from lowbit import recipes

    try:
        shapes = _parse_shapes(args.shapes)
        names = [n.strip() for n in args.recipes.split(",") if n.strip()]
        for n in names:
            recipes.from_name(n)
    except ValueError as e:
        ap.error(str(e))
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("lowbit bench linear: needs a CUDA GPU (pass --device cpu for a smoke test of the references)",
              file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (references; not a benchmark)"
    header = f"## lowbit bench linear — {dev_name}, torch {torch.__version__}, {datetime.date.today().isoformat()}"
    out = [header]
    print(header, flush=True)
    for M, K, N in shapes:
        rows = bench_shape(M, K, N, names, device=device, dtype=dtype, warmup=args.warmup, rep=args.rep,
                           torchao=not args.no_torchao, split=not args.no_split)
        table = _format(M, K, N, rows)
        print(table + "\n", flush=True)
        out.append(table)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
