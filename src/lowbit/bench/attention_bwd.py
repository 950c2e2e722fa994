"""Benchmark: attention backward (BF16 and FP8-gradient variants, lowbit's Triton kernels and cuDNN's backward from
lowbit's O and LSE) vs SDPA flash and cuDNN backward.

FLOP convention: forward = 4·B·H·Sq·Sk·D (two GEMMs), halved when causal; **backward = 2.5 × forward**
(five GEMM-sized products: S recompute, dP, dV, dQ, dK — the FlashAttention convention).  Our kernels
actually do seven (dQ runs in its own kernel, recomputing S and dP, so that every gradient is complete
in FP32 before its FP8 epilogue); TFLOP/s below are always by the 2.5× convention so the columns compare.

Timings are ``triton.testing.do_bench`` medians of the backward only (for SDPA: ``autograd.grad`` on a
retained graph, i.e. its backward kernels).  With ``--rounds N`` every variant of a shape is timed N times,
interleaved (round r starts at a rotated position of the variant list, so no variant is always timed
first): ``ms`` is then the median of the N medians, ``spread`` their (max - min) /
median, and ``vs_bf16`` the median over rounds of lowbit BF16's time / this variant's time *within the
round* (paired, so slow drifts of the clock cancel) with its min..max.  Run:
``python -m lowbit.bench.attention_bwd [--quick] [--rounds 10]``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import List, Optional

from . import median_ms
from . import nrmse as _nrmse

SHAPES = [(4, 32, 4096, 128), (2, 32, 8192, 128), (8, 16, 2048, 64)]


def flops_bwd(b, h, s, d, causal):
    f = 4.0 * b * h * s * s * d
    if causal:
        f *= 0.5
    return 2.5 * f


def _sdpa_bwd_fn(q, k, v, do, causal, backend):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
    grads = torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True)

    def run():
        return torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True)
    return run, grads


def _per_kernel(fns, names, n_calls, tag):
    """Median GPU time of each backward kernel per variant (CUPTI via torch.profiler), over ``n_calls`` interleaved
    calls with L2 flushed before each (as do_bench does): separates the dK/dV and dQ kernels' shares of a
    difference that the whole-backward timing only shows in sum."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(256 * 2 ** 20, dtype=torch.int8, device="cuda")
    kinds = (("dkdv", "_bwd_dkdv"), ("dq", "_bwd_dq"), ("pre", "_bwd_preprocess"))
    seq = []
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for r in range(n_calls):
            for i in range(len(names)):
                n = names[(i + r) % len(names)]
                flush.zero_()
                fns[n]()
                seq.append(n)
        torch.cuda.synchronize()
    per = {n: {k: [] for k, _ in kinds} for n in names}
    seen = {k: 0 for k, _ in kinds}
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):  # one launch of each kernel per call, in order
        for k, prefix in kinds:
            if e.name.startswith(prefix):
                per[seq[seen[k]]][k].append(e.time_range.elapsed_us())
                seen[k] += 1
    med = {n: {k: statistics.median(v) for k, v in per[n].items() if v} for n in names}
    base = med.get("lowbit_bf16")
    print(f"# per kernel, {tag}: median us over {n_calls} interleaved calls (vs lowbit_bf16)")
    for n in names:
        cells = [f"{k} {med[n][k]:.1f}" + (f" ({100 * (med[n][k] / base[k] - 1):+.2f}%)" if base else "")
                 for k, _ in kinds if k in med[n]]
        tot = sum(med[n].values())
        print(f"#   {n:28s} " + " | ".join(cells) + f" | sum {tot:.1f}"
              + (f" ({100 * (tot / sum(base.values()) - 1):+.2f}%)" if base else ""), flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="lowbit bench attention --backward", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small shapes (smoke test)")
    ap.add_argument("--shapes", default=None, help="B,H,S,D;B,H,S,D;... (default: the issue's three)")
    ap.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    ap.add_argument("--json", default=None, help="write the rows to this JSON file")
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
    ap.add_argument("--rounds", type=int, default=1, help="time every variant this many times, interleaved")
    ap.add_argument("--per-kernel", type=int, default=0, metavar="N",
                    help="also N interleaved calls per lowbit variant under torch.profiler: each kernel's GPU time")
    args = ap.parse_args(argv)

    import torch
    import triton
    from torch.nn.attention import SDPBackend

    from ..attention import backward as BW

    if not torch.cuda.is_available():
        print("attention_bwd bench needs a CUDA GPU", file=sys.stderr)
        return 2
    shapes = SHAPES
    if args.quick:
        shapes = [(2, 8, 1024, 128), (2, 8, 1024, 64)]
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")]
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    dev = torch.cuda.get_device_name()
    print(f"# attention backward, {dev}, torch {torch.__version__}, triton {triton.__version__}")
    print("# TFLOP/s by the backward = 2.5 x forward FLOPs convention; ratio = ours / peer time ratio inverted "
          "(>1: ours faster)")
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    hdr = ("B", "H", "S", "D", "causal", "variant", "ms", "spread", "TFLOP/s", "vs_flash", "vs_cudnn", "vs_bf16",
           "nrmse_dq_vs_flash")
    print(f"# {args.rounds} interleaved round(s) of do_bench(rep={args.rep}) per variant")
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    rows = []
    for (b, h, s, d) in shapes:
        for causal in causals:
            torch.manual_seed(0)
            q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            o, lse = BW.attention_forward(q, k, v, causal=causal)
            fl = flops_bwd(b, h, s, d, causal)
            fns, grads = {}, {}
            for name, be in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
                try:
                    fns[name], grads[name] = _sdpa_bwd_fn(q, k, v, do, causal, be)
                except Exception as e:  # backend not available for this shape / build
                    print(f"# {name} unavailable: {type(e).__name__}: {str(e)[:120]}")
            fmax = {"e4m3": 448.0, "e5m2": 57344.0}
            # lowbit_bf16: lowbit's Triton backward; lowbit_cudnn: cuDNN's backward given lowbit's O and LSE (what
            # ``backend=None`` runs where cuDNN computes the same math: ``lowbit.attention.backward.backward_backend``)
            variants = [("lowbit_bf16", {"backend": "triton"}), ("lowbit_cudnn", {"backend": "cudnn"}),
                        ("lowbit_fp8_e4m3_rowscale", {"grad_format": "e4m3"}),
                        ("lowbit_fp8_e4m3_tensorscale", {"grad_format": "e4m3", "scales": tuple(
                            torch.full((1,), fmax["e4m3"] / 4.0, device="cuda") for _ in range(3))})]
            for name, kw in variants:
                def fn(kw=kw, q=q, k=k, v=v, do=do, o=o, lse=lse):
                    return BW.backward(do, q, k, v, o, lse, causal=causal, **kw)
                try:
                    g = fn()  # compiles (and autotunes) outside the timed rounds
                except ValueError as e:  # backend="cudnn" where cuDNN cannot run the shape (head_dim > 128)
                    print(f"# {name} unavailable: {e}")
                    continue
                grads[name] = tuple(x.dequantize() if hasattr(x, "dequantize") else x for x in g)
                fns[name] = fn
            names = list(fns)
            times = {n: [] for n in names}
            for r in range(args.rounds):
                for i in range(len(names)):
                    n = names[(i + r) % len(names)]
                    times[n].append(median_ms(fns[n], rep=args.rep))
            med = {n: statistics.median(t) for n, t in times.items()}
            for name in names:
                ms, t = med[name], times[name]
                paired = ([a / c for a, c in zip(times["lowbit_bf16"], t)] if "lowbit_bf16" in times else None)
                r = dict(B=b, H=h, S=s, D=d, causal=causal, variant=name, ms=ms, times=t,
                         spread=(max(t) - min(t)) / ms, tflops=fl / ms / 1e9,
                         vs_flash=(med["sdpa_flash"] / ms) if "sdpa_flash" in med else None,
                         vs_cudnn=(med["sdpa_cudnn"] / ms) if "sdpa_cudnn" in med else None,
                         vs_bf16=statistics.median(paired) if paired else None,
                         vs_bf16_min=min(paired) if paired else None, vs_bf16_max=max(paired) if paired else None,
                         nrmse_dq_vs_flash=(_nrmse(grads[name][0], grads["sdpa_flash"][0])
                                            if "sdpa_flash" in grads else None))
                rows.append(r)
                vb = "-" if not paired else f"{r['vs_bf16']:.3f} ({r['vs_bf16_min']:.3f}..{r['vs_bf16_max']:.3f})"
                print(f"| {b} | {h} | {s} | {d} | {causal} | {name} | {ms:.3f} | {100 * r['spread']:.1f}% | "
                      f"{r['tflops']:.0f} | {fmt(r['vs_flash'], '.2f')} | {fmt(r['vs_cudnn'], '.2f')} | {vb} | "
                      f"{fmt(r['nrmse_dq_vs_flash'], '.2e')} |", flush=True)
            if args.per_kernel:
                _per_kernel(fns, [n for n in names if n.startswith("lowbit")], args.per_kernel, (b, h, s, d, causal))
            del q, k, v, do, o, lse, grads, fns
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
