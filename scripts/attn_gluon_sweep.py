"""The Gluon INT8·FP8 attention forward (lowbit.attention._gluon) against the Triton kernel and SDPA cuDNN, same run.

Kernel-only (operands quantized beforehand), median of triton.testing.do_bench; each Gluon variant (env switches
LOWBIT_ATTN_GLUON_STAGES, LOWBIT_ATTN_GLUON_PERSIST and LOWBIT_ATTN_GLUON_NAMED: ``stages=N``, ``persist=0|1``,
``named=auto|0|1``, joined with ``,``) is checked
against the first one's output (max abs difference).

    python scripts/attn_gluon_sweep.py [--shapes "4,32,4096,128;..."] [--variants "persist=0;persist=1,stages=4"]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch  # noqa: E402
import triton  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4,32,4096,128;2,32,8192,128;8,16,2048,64")
    ap.add_argument("--variants", default="persist=0;persist=1")
    ap.add_argument("--causal", default="no,yes")
    ap.add_argument("--once", action="store_true", help="one launch of each kernel on the first shape (Nsight Compute)")
    args = ap.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    from lowbit.attention import _gluon as G, _triton as T

    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    for shp in args.shapes.split(";"):
        B, H, S, D = (int(x) for x in shp.split(","))
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, H, S, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
        qq = T.quantize_qk_triton(q, k, dtype="int8")
        v8, vs = T.quantize_v_fp8_triton(v)  # natural key order: the Triton kernel's
        vp, _ = T.quantize_v_fp8_triton(v, key_order="wgmma32")  # the Gluon kernel's
        for causal in [c == "yes" for c in args.causal.split(",")]:
            flops = 4 * B * H * S * S * D * (0.5 if causal else 1.0)

            def kern():
                gl = os.environ.get("LOWBIT_ATTN_GLUON") != "0"
                return T.attention_fwd_triton(qq.q, qq.k, vp if gl else v8, q_scale=qq.q_scale, k_scale=qq.k_scale,
                                              v_scale=vs, q_scale_rows=qq.q_scale_rows, causal=causal,
                                              out_dtype=torch.bfloat16, v_key_order="wgmma32" if gl else "natural")

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

            if args.once:
                os.environ["LOWBIT_ATTN_GLUON"] = "0"
                kern()
                os.environ["LOWBIT_ATTN_GLUON"] = "force"
                kern()
                torch.cuda.synchronize()
                return
            res = {}
            res["cudnn"] = triton.testing.do_bench(cudnn, warmup=25, rep=200)
            os.environ["LOWBIT_ATTN_GLUON"] = "0"
            res["triton"] = triton.testing.do_bench(kern, warmup=25, rep=200)
            os.environ["LOWBIT_ATTN_GLUON"] = "force"
            first = None
            for n_var, var in enumerate(args.variants.split(";")):
                kv = dict(x.split("=") for x in var.split(","))
                os.environ["LOWBIT_ATTN_GLUON_STAGES"] = kv.get("stages", str(G.STAGES[D]))  # the kernel's default
                os.environ["LOWBIT_ATTN_GLUON_PERSIST"] = kv.get("persist", "1")
                os.environ["LOWBIT_ATTN_GLUON_NAMED"] = kv.get("named", "auto")
                try:
                    o = kern()
                    diff = 0.0 if first is None else (o.float() - first.float()).abs().max().item()
                    first = o if first is None else first
                    res[f"{n_var} gluon[{var}] d={diff:.1e}"] = triton.testing.do_bench(kern, warmup=25, rep=200)
                except Exception as e:  # noqa: BLE001
                    print(f"  {var}: {type(e).__name__}: {str(e)[:200]}")
            os.environ["LOWBIT_ATTN_GLUON"] = "1"
            print(f"B{B} H{H} S{S} D{D} causal={causal}")
            for name, ms in res.items():
                print(f"  {name:40s} {ms:7.3f} ms {flops / ms * 1e-9:6.0f} TFLOP/s  x cuDNN {res['cudnn'] / ms:.2f}")


if __name__ == "__main__":
    main()
