"""Benchmark: attention backward (BF16 and FP8-gradient variants) vs SDPA flash and cuDNN backward.

FLOP convention: forward = 4·B·H·Sq·Sk·D (two GEMMs), halved when causal; **backward = 2.5 × forward**
(five GEMM-sized products: S recompute, dP, dV, dQ, dK — the FlashAttention convention).  Our kernels
actually do seven (dQ runs in its own kernel, recomputing S and dP, so that every gradient is complete
in FP32 before its FP8 epilogue); TFLOP/s below are always by the 2.5× convention so the columns compare.

Timings are ``triton.testing.do_bench`` medians of the backward only (for SDPA: ``autograd.grad`` on a
retained graph, i.e. its backward kernels).  Run: ``python -m lowbit.bench.attention_bwd [--quick]``.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from . import env, median_ms
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


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="lowbit bench attention --backward", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small shapes (smoke test)")
    ap.add_argument("--shapes", default=None, help="B,H,S,D;B,H,S,D;... (default: the issue's three)")
    ap.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    ap.add_argument("--json", default=None, help="write the rows to this JSON file")
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
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
    hdr = ("B", "H", "S", "D", "causal", "variant", "ms", "TFLOP/s", "vs_flash", "vs_cudnn", "nrmse_dq_vs_flash")
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    rows = []
    for (b, h, s, d) in shapes:
        for causal in causals:
            torch.manual_seed(0)
            q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            o, lse = BW.attention_forward(q, k, v, causal=causal)
            fl = flops_bwd(b, h, s, d, causal)
            res = {}
            grads = {}
            for name, be in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
                try:
                    fn, g = _sdpa_bwd_fn(q, k, v, do, causal, be)
                    res[name] = median_ms(fn, rep=args.rep)
                    grads[name] = g
                    del fn
                except Exception as e:  # backend not available for this shape / build
                    print(f"# {name} unavailable: {type(e).__name__}: {str(e)[:120]}")
            fmax = {"e4m3": 448.0, "e5m2": 57344.0}
            variants = [("lowbit_bf16", {}), ("lowbit_fp8_e4m3_rowscale", {"grad_format": "e4m3"}),
                        ("lowbit_fp8_e4m3_tensorscale", {"grad_format": "e4m3", "scales": tuple(
                            torch.full((1,), fmax["e4m3"] / 4.0, device="cuda") for _ in range(3))})]
            # each lowbit variant also with its tiles loaded by TMA descriptors (LOWBIT_ATTN_BWD_TMA, opt-in)
            variants += [(name + "_tma", dict(kw, _tma=True)) for name, kw in variants]
            for name, kw in variants:
                kw = dict(kw)
                with env("LOWBIT_ATTN_BWD_TMA", "1" if kw.pop("_tma", False) else "0"):
                    fn = (lambda kw=kw: BW.backward(do, q, k, v, o, lse, causal=causal, **kw))
                    g = fn()
                    res[name] = median_ms(fn, rep=args.rep)
                grads[name] = tuple(x.dequantize() if hasattr(x, "dequantize") else x for x in g)
            for name, ms in res.items():
                r = dict(B=b, H=h, S=s, D=d, causal=causal, variant=name, ms=ms, tflops=fl / ms / 1e9,
                         vs_flash=(res["sdpa_flash"] / ms) if "sdpa_flash" in res else None,
                         vs_cudnn=(res["sdpa_cudnn"] / ms) if "sdpa_cudnn" in res else None,
                         nrmse_dq_vs_flash=(_nrmse(grads[name][0], grads["sdpa_flash"][0])
                                            if "sdpa_flash" in grads else None))
                rows.append(r)
                fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
                print(f"| {b} | {h} | {s} | {d} | {causal} | {name} | {ms:.3f} | {r['tflops']:.0f} | "
                      f"{fmt(r['vs_flash'], '.2f')} | {fmt(r['vs_cudnn'], '.2f')} | "
                      f"{fmt(r['nrmse_dq_vs_flash'], '.2e')} |", flush=True)
            del q, k, v, do, o, lse, grads
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
