"""``lowbit bench gemm``: scaled GEMM throughput against its peers, all measured in the same run.

For each (M, K, N): BF16 ``torch.mm``; cuBLAS FP8 tensorwise (``torch._scaled_mm``); cuBLAS FP8
blockwise 1x128·128x128 (``F.scaled_mm``, where this torch offers it); torchao's Triton blockwise
kernel (only if torchao is importable); lowbit's Triton blockwise GEMM (1x128 · 128x128, BF16 out);
lowbit's NVFP4 and MXFP8 emulated GEMMs (dequantize-then-BF16-GEMM and the fused per-tile unpack). Median time by
``triton.testing.do_bench``; TFLOP/s = 2·M·N·K / t; ratios against BF16 and cuBLAS blockwise.
"""

from __future__ import annotations

import datetime
import sys

import torch

from ..runtime.env import override
from . import git_commit, median_ms, table_main

SHAPES = [(8192, 8192, 8192), (16384, 4096, 4096), (16384, 4096, 14336), (16384, 14336, 4096), (4096, 4096, 4096)]


def time_ms(fn, rep=100) -> float | None:
    try:
        fn()
        torch.cuda.synchronize()
        return median_ms(fn, rep=rep)
    except Exception as e:  # report the peer as unavailable rather than abort the run
        print(f"    (skipped: {type(e).__name__}: {str(e).splitlines()[0][:160]})")
        return None


def _run_shape(M, K, N, rep, rows):
    """Times every kernel on one (M, K, N) and appends its rows; the inputs die with this frame."""
    from lowbit.gemm import scaled_mm
    from lowbit.quant import MXFP8, NVFP4, Float8Blockwise, quantize

    F = torch.nn.functional
    dev = torch.device("cuda")
    print(f"[gemm] M={M} K={K} N={N}", flush=True)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
    flops = 2.0 * M * N * K
    res = {}
    res["bf16 torch.mm"] = time_ms(lambda: torch.mm(x, w.t()), rep)
    xa = x.to(torch.float8_e4m3fn)
    wa = w.to(torch.float8_e4m3fn)
    one = torch.ones((), device=dev)
    res["cuBLAS fp8 tensorwise"] = time_ms(lambda: torch._scaled_mm(xa, wa.t(), scale_a=one, scale_b=one,
                                                                   out_dtype=torch.bfloat16), rep)
    qa = quantize(x, Float8Blockwise())
    qb = quantize(w, Float8Blockwise(block_dim=2))
    if hasattr(F, "scaled_mm"):
        sa = qa.logical_scales()
        sb = qb.logical_scales()
        S = F.ScalingType
        res["cuBLAS fp8 blockwise"] = time_ms(lambda: F.scaled_mm(qa.rowwise.data, qb.rowwise.data.t(), sa,
                                                                 S.BlockWise1x128,
                                                                 sb.t(), S.BlockWise128x128,
                                                                 output_dtype=torch.bfloat16), rep)
    try:
        from torchao.prototype.blockwise_fp8_training.kernels import triton_fp8_gemm_1x128_128x128 as ao_gemm  # type: ignore

        res["torchao triton blockwise"] = time_ms(lambda: ao_gemm(qa.rowwise.data, qb.rowwise.data.t(),
                                                                 qa.logical_scales(),
                                                                 qb.logical_scales().t()), rep)
    except Exception as e:  # noqa: BLE001 - any import/run problem means "no torchao row"
        print(f"# torchao triton blockwise: {type(e).__name__}: {e}", file=sys.stderr)
    # pointer tiles, then the same kernel with TMA operand tiles (LOWBIT_TMA, the default)
    # and the Gluon kernel among the TMA candidates (LOWBIT_GEMM_GLUON=1, the default)
    # and each Gluon kernel alone: one tile a CTA ("force"), persistent warp-specialized ("ws")
    for name, tma, gl in (("lowbit triton blockwise", "0", "0"), ("lowbit triton blockwise (TMA, no Gluon)", "1", "0"),
                          ("lowbit triton blockwise (TMA + Gluon)", "1", "1"), ("lowbit Gluon, one tile a CTA", "1",
                                                                                "force"),
                          ("lowbit Gluon, persistent warp-specialized", "1", "ws")):
        with override(LOWBIT_TMA=tma, LOWBIT_GEMM_GLUON=gl):
            res[name] = time_ms(lambda: scaled_mm(qa, qb, out_dtype=torch.bfloat16, backend="triton"), rep)
    na, nb = quantize(x, NVFP4()), quantize(w, NVFP4(two_d=True))
    # the dequantized path autotunes its core GEMM: the faster of cuBLAS and Triton's (pointer / TMA tiles)
    for name, tma in (("lowbit nvfp4 dequant+bf16", "0"), ("lowbit nvfp4 dequant+bf16 (TMA)", "1")):
        with override(LOWBIT_TMA=tma):
            res[name] = time_ms(lambda: scaled_mm(na, nb, out_dtype=torch.bfloat16, backend="triton_dequant"), rep)
    res["lowbit nvfp4 fused emulated"] = time_ms(lambda: scaled_mm(na, nb, out_dtype=torch.bfloat16,
                                                                  backend="triton_emulated"), rep)
    ma, mb = quantize(x, MXFP8()), quantize(w, MXFP8())
    res["lowbit mxfp8 dequant+bf16"] = time_ms(lambda: scaled_mm(ma, mb, out_dtype=torch.bfloat16,
                                                                backend="triton_dequant"), rep)
    res["lowbit mxfp8 fused emulated"] = time_ms(lambda: scaled_mm(ma, mb, out_dtype=torch.bfloat16,
                                                                  backend="triton_emulated"), rep)
    bf = res.get("bf16 torch.mm")
    cb = res.get("cuBLAS fp8 blockwise")
    for name, t in res.items():
        if t is None:
            continue
        tf = flops / t * 1e-9
        rows.append((f"{M}x{K}x{N}", name, t, tf, bf / t if bf else None, cb / t if cb else None))
        print(f"    {name:28s} {t * 1e3:9.1f} us {tf:8.1f} TFLOP/s  x{(bf / t) if bf else float('nan'):.2f} vs bf16"
              f"  x{(cb / t) if cb else float('nan'):.2f} vs cuBLAS blockwise", flush=True)


def run(shapes, rep=100):
    rows = []
    for M, K, N in shapes:
        _run_shape(M, K, N, rep, rows)
        torch.cuda.empty_cache()
    return rows


def markdown(rows) -> str:
    dev = torch.cuda.get_device_name()
    out = [f"Device: {dev}; torch {torch.__version__}; date {datetime.date.today().isoformat()}; commit {git_commit()}",
           "",
           "| M x K x N | kernel | time (us) | TFLOP/s | vs BF16 torch.mm | vs cuBLAS FP8 blockwise |",
           "|---|---|---:|---:|---:|---:|"]
    for shape, name, t, tf, rb, rc in rows:
        out.append(f"| {shape} | {name} | {t * 1e3:.1f} | {tf:.0f} | {'' if rb is None else f'{rb:.2f}'} | "
                   f"{'' if rc is None else f'{rc:.2f}'} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    return table_main(argv, prog="lowbit bench gemm", description=__doc__.splitlines()[0], default_shapes=SHAPES,
                      shapes_help="comma-separated MxKxN list (default: five GPT-sized shapes)", run=run,
                      markdown=markdown)


if __name__ == "__main__":
    raise SystemExit(main())
