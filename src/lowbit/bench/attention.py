"""`lowbit bench attention`: quantized attention forward vs SDPA (flash, cuDNN) and sageattention.

For each (B, H, S, D) and causal flag: median time (triton.testing.do_bench) and TFLOP/s
(4·B·H·S²·D, halved when causal) of
  * peers: SDPA flash, SDPA cuDNN (BF16), sageattention ``sageattn`` if importable;
  * lowbit Triton kernel for qk/pv in bf16/bf16, int8/bf16, int8/fp16 (BF16 V carried in FP16, P·V in FP16),
    int8/fp8, fp8/fp8, kernel-only (operands quantized beforehand) and end-to-end (prepass included), and
    the prepass alone (``_triton.prepass_triton``, Q, K and V in three launches, timed from CUDA graph replays: its
    GPU time, without the host's); int8/fp8 runs the warp-specialized Gluon kernel on sm_90 (``_gluon.py``), and
    its ``_kernel_triton`` / ``_e2e_triton`` rows the Triton kernel (``LOWBIT_ATTN_GLUON=0``) in the same run;
and NRMSE vs an FP32 reference computed on batch 0, heads 0..3 (the kernels treat heads independently).
Writes a markdown table and JSON lines to --out.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os

import torch

from ..runtime.env import override
from . import git_commit, median_ms
from . import nrmse as _nrmse

SHAPES = [(4, 32, 4096, 128), (2, 32, 8192, 128), (8, 16, 2048, 64)]
MODES = [("bf16", "bf16"), ("int8", "bf16"), ("int8", "fp16"), ("int8", "fp8"), ("fp8", "fp8")]


def bench_case(B, H, S, D, causal, modes, rep_ms=200, pointer_tiles=False):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lowbit.attention import _triton as T
    from lowbit.attention import attention
    from lowbit.attention.reference import attention_reference

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
    hs = slice(0, min(4, H))
    ref = attention_reference(q[:1, hs], k[:1, hs], v[:1, hs], causal=causal)
    rows = []

    def run(name, fn, kind, acc_out=None):
        try:
            out = fn()
            ms = median_ms(fn, rep=rep_ms)
            err = _nrmse((acc_out() if acc_out else out)[:1, hs], ref)
            rows.append(dict(name=name, kind=kind, ms=ms, tflops=flops / ms * 1e-9, nrmse=err))
        except Exception as e:  # a missing backend must not kill the table
            rows.append(dict(name=name, kind=kind, ms=float("nan"), tflops=float("nan"), nrmse=float("nan"),
                             error=f"{type(e).__name__}: {str(e)[:120]}"))

    for nm, be in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        def f(be=be):
            with sdpa_kernel(be):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        run(nm, f, "peer")
    try:
        from sageattention import sageattn
        run("sageattention", lambda: sageattn(q, k, v, tensor_layout="HND", is_causal=causal), "peer")
    except ImportError:
        rows.append(dict(name="sageattention", kind="peer", ms=float("nan"), tflops=float("nan"),
                         nrmse=float("nan"), error="not installed"))

    from lowbit.attention.api import quantize_v_operand, resolve_pv, triton_operands

    for qk, pv in modes:
        tag = f"lowbit_{qk}_{pv}"
        pvr = resolve_pv(pv, qk, q.dtype)  # "fp8" / "fp16" convert V ("auto": api.AUTO_PV_QUANTIZED for int8/fp8)
        run(tag + "_e2e", lambda qk=qk, pv=pv: attention(q, k, v, causal=causal, qk=qk, pv=pv, backend="triton"),
            "end-to-end")
        # kernel-only: the operands quantized once outside the timed region by the end-to-end call's prepass (FP8 V
        # in the key order the call's kernel reads: the Gluon kernel's "wgmma32")
        pre = lambda qk=qk, pvr=pvr: triton_operands(q, k, v, qk=qk, pv=pvr, causal=causal)  # noqa: E731
        qa, ka, qs, ks, _, rows_q, va, vs, order = pre()
        if qk == "bf16" and pvr == "native":
            pre = None  # nothing to quantize: no prepass row
        kern = lambda qa=qa, ka=ka, va=va, qs=qs, ks=ks, vs=vs, r=rows_q, o=order: T.attention_fwd_triton(  # noqa: E731
            qa, ka, va, q_scale=qs, k_scale=ks, v_scale=vs, q_scale_rows=r, causal=causal, out_dtype=torch.bfloat16,
            v_key_order=o)
        if pointer_tiles:
            with override(LOWBIT_TMA=False):  # pointer tiles
                run(tag + "_kernel", kern, "kernel")
        with override(LOWBIT_TMA=True):  # the same kernel with K/V tiles by TMA descriptors (the default)
            run(tag + "_kernel_tma", kern, "kernel")
            if (qk, pv) == ("int8", "fp8"):  # the default above is the Gluon kernel on sm_90; the Triton one too
                va_n, vs_n = quantize_v_operand(pvr, v, "bhsd", None, None, "triton")  # natural key order
                with override(LOWBIT_ATTN_GLUON="0"):
                    run(tag + "_kernel_triton", lambda: T.attention_fwd_triton(
                        qa, ka, va_n, q_scale=qs, k_scale=ks, v_scale=vs_n, q_scale_rows=rows_q, causal=causal,
                        out_dtype=torch.bfloat16), "kernel")
                    run(tag + "_e2e_triton", lambda: attention(q, k, v, causal=causal, qk="int8", pv="fp8",
                                                               backend="triton"), "end-to-end")
        if pre is not None:  # the prepass as the end-to-end call runs it: its GPU time (graphed)
            from triton.testing import do_bench_cudagraph
            ms = float(do_bench_cudagraph(pre, rep=100))
            rows.append(dict(name=tag + "_prepass", kind="prepass (GPU)", ms=ms, tflops=float("nan"),
                             nrmse=float("nan")))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="lowbit bench attention", description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=";".join(",".join(map(str, s)) for s in SHAPES),
                    help="B,H,S,D;B,H,S,D;... (default: the three SHAPES)")
    ap.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    ap.add_argument("--modes", default=",".join(f"{a}/{b}" for a, b in MODES), help="qk/pv pairs, comma-separated")
    ap.add_argument("--rep-ms", type=int, default=200)
    ap.add_argument("--pointer-tiles", action="store_true", help="also time the kernel with pointer tiles (TMA off)")
    ap.add_argument("--out", default="bench_attention", help="directory for results.md / results.jsonl")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("lowbit bench attention: needs a CUDA GPU")
        return 2
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";") if s]
    modes = [tuple(m.split("/")) for m in args.modes.split(",") if m]
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    os.makedirs(args.out, exist_ok=True)
    dev_name = torch.cuda.get_device_name()
    head = (f"# attention forward benchmark\n\n{dev_name}, {datetime.date.today()}, commit {git_commit()}, "
            f"torch {torch.__version__}\n\n")
    lines = [head]
    with open(os.path.join(args.out, "results.jsonl"), "w") as jf:
        for (B, H, S, D) in shapes:
            for causal in causals:
                rows = bench_case(B, H, S, D, causal, modes, args.rep_ms, args.pointer_tiles)
                torch.cuda.empty_cache()  # the case's tensors died with bench_case's frame
                cud = next((r["ms"] for r in rows if r["name"] == "sdpa_cudnn"), float("nan"))
                fla = next((r["ms"] for r in rows if r["name"] == "sdpa_flash"), float("nan"))
                sage = next((r["ms"] for r in rows if r["name"] == "sageattention"), float("nan"))
                title = f"B={B} H={H} S={S} D={D} causal={causal}"
                lines.append(f"## {title}\n\n| impl | kind | ms | TFLOP/s | x cuDNN | x flash | x sage | "
                             "NRMSE vs FP32 |\n"
                             "|---|---|---:|---:|---:|---:|---:|---:|\n")
                for r in rows:
                    r.update(B=B, H=H, S=S, D=D, causal=causal, device=dev_name)
                    jf.write(json.dumps(r) + "\n")
                    lines.append(f"| {r['name']} | {r['kind']} | {r['ms']:.3f} | {r['tflops']:.0f} | "
                                 f"{cud / r['ms']:.2f} | "
                                 f"{fla / r['ms']:.2f} | {sage / r['ms']:.2f} | {r['nrmse']:.2e} |"
                                 + (f" {r['error']}" if "error" in r else "") + "\n")
                lines.append("\n")
                print("".join(lines[-len(rows) - 3:]), flush=True)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write("".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
