"""Every Gluon FP8 GEMM config forced alone, against cuBLAS and torchao.

FP8 1x128 · 128x128 blockwise GEMM: each Gluon candidate (the one-tile kernel and each entry of
``lowbit.gemm.triton_backend.WS_CONFIGS``) forced alone, against cuBLAS blockwise and torchao's Triton kernel; the
dequantized NVFP4 GEMM with cuBLAS (FP32 out + scale epilogue) or each warp-specialized Gluon config
(``WS_BF16_CONFIGS``) as its core, against BF16 torch.mm; interleaved rounds on the same inputs. Each candidate's
output is checked against the first one's (they compute the same per-block sums; a few FP32 ulps of reduction
order apart at most). Needs an sm_90 GPU.

    PYTHONPATH=src python tools/gemm_sweep.py [--shapes 8192x8192x8192,...] [--rounds 2]

Prints TFLOP/s (2·M·N·K / median time of triton.testing.do_bench) per round and the median over rounds.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys

SHAPES = "8192x8192x8192,16384x4096x4096,16384x4096x14336,16384x14336x4096,4096x4096x4096"


@contextlib.contextmanager
def candidates(name: str, configs: list):
    """Within the block, ``lowbit.gemm.triton_backend.<name>`` (a candidate list) holds only ``configs``."""
    import lowbit.gemm.triton_backend as tb

    lst = getattr(tb, name)
    saved = list(lst)
    lst[:] = configs
    try:
        yield
    finally:
        lst[:] = saved


@contextlib.contextmanager
def dequant_core(core: str):
    """Within the block, the dequantized path's core GEMM is ``core`` ("cublas", "gluon" or "triton")."""
    import lowbit.gemm.triton_backend as tb

    saved, tb.DEQUANT_GEMM = tb.DEQUANT_GEMM, core
    try:
        yield
    finally:
        tb.DEQUANT_GEMM = saved


def _forced(cfg):
    """A launch of exactly this Gluon config through scaled_mm's own launch path (the autotuner bypassed)."""
    import torch

    from lowbit import scaled_mm
    from lowbit.runtime import env

    def run(qa, qb):
        if cfg.get("WS"):
            with candidates("WS_CONFIGS", [cfg]), env.override(LOWBIT_GEMM_GLUON="ws"):
                return scaled_mm(qa, qb, out_dtype=torch.bfloat16, backend="triton")
        with env.override(LOWBIT_GEMM_GLUON="force"):
            return scaled_mm(qa, qb, out_dtype=torch.bfloat16, backend="triton")
    return run


def _nvfp4(core, cfg=None):
    """The dequantized NVFP4 path with its core GEMM forced: cuBLAS (FP32 out + scale epilogue) or one Gluon config."""
    import torch

    from lowbit import scaled_mm

    def run(na, nb):
        with dequant_core(core), contextlib.ExitStack() as stack:
            if cfg is not None:
                stack.enter_context(candidates("WS_BF16_CONFIGS", [cfg]))
            return scaled_mm(na, nb, out_dtype=torch.bfloat16, backend="triton_dequant")
    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=SHAPES)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    from lowbit.runtime import env

    with env.override(LOWBIT_AUTOTUNE=False):  # the first candidate of each forced list is the one launched
        return _sweep(args)


def _sweep(args) -> int:
    import torch

    try:
        from torchao.prototype.blockwise_fp8_training.kernels import (  # type: ignore
            triton_fp8_gemm_1x128_128x128 as ao_gemm,
        )
    except Exception as e:  # noqa: BLE001
        print(f"# torchao: {type(e).__name__}: {e}")
        ao_gemm = None
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    for shape in args.shapes.split(","):
        _shape(shape, args.rounds, ao_gemm)
        torch.cuda.empty_cache()
    return 0


def _shape(shape: str, rounds: int, ao_gemm) -> None:
    """Times every candidate on one MxKxN shape and prints the table."""
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    import lowbit.gemm.triton_backend as tb
    from lowbit import quantize
    from lowbit.quant import NVFP4, Float8Blockwise

    dev = torch.device("cuda")
    M, K, N = (int(v) for v in shape.split("x"))
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
    qa, qb = quantize(x, Float8Blockwise()), quantize(w, Float8Blockwise(block_dim=2))
    sa, sb = qa.logical_scales(), qb.logical_scales()
    fns = {"cuBLAS blockwise": lambda: F.scaled_mm(
        qa.rowwise.data, qb.rowwise.data.t(), sa, F.ScalingType.BlockWise1x128, sb.t(),
        F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)}
    if ao_gemm is not None:
        fns["torchao triton blockwise"] = lambda: ao_gemm(qa.rowwise.data, qb.rowwise.data.t(), sa, sb.t())
    cfgs = [dict(GLUON=True, BM=128, BN=128, num_warps=8, STAGES=4)] + list(tb.WS_CONFIGS)
    ref = None
    for cfg in cfgs:
        name = ("ws stages=%(STAGES)d" % cfg) if cfg.get("WS") else "one tile a CTA, 8 warps, 4 stages"
        run = _forced(cfg)
        y = run(qa, qb)  # compile + check
        if ref is None:
            ref = y.float()
        else:
            d = (y.float() - ref).abs().max().item()
            scale = ref.abs().max().item()
            if d > 1e-2 * scale:
                print(f"  MISMATCH {name}: max |diff| {d:.3g} (max |y| {scale:.3g})")
        fns[name] = (lambda r=run: r(qa, qb))  # (host work of a few us a call: the GPU work is >= 100 us)
    fns["bf16 torch.mm"] = lambda: torch.mm(x, w.t())
    na, nb = quantize(x, NVFP4()), quantize(w, NVFP4(two_d=True))
    y0 = _nvfp4("cublas")(na, nb).float()
    fns["nvfp4 dequant + cuBLAS + epilogue"] = lambda: _nvfp4("cublas")(na, nb)
    for cfg in tb.WS_BF16_CONFIGS:
        run = _nvfp4("gluon", cfg)
        d = (run(na, nb).float() - y0).abs().max().item()
        if d > 1e-2 * y0.abs().max().item():
            print(f"  MISMATCH nvfp4 gluon {cfg}: max |diff| {d:.3g}")
        fns["nvfp4 dequant + Gluon ws BN=%(BN)d stages=%(STAGES)d" % cfg] = (lambda r=run: r(na, nb))
    flops = 2.0 * M * N * K
    res = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            res[k].append(flops / do_bench(fn, warmup=10, rep=80, return_mode="median") * 1e-9)
    print(f"[{M}x{K}x{N}] TFLOP/s per round -> median")
    ao = statistics.median(res["torchao triton blockwise"]) if "torchao triton blockwise" in res else None
    bf = statistics.median(res["bf16 torch.mm"])
    for k, v in res.items():
        m = statistics.median(v)
        extra = f"  x{m / bf:.2f} bf16" if k.startswith("nvfp4") else (f"  x{m / ao:.2f} torchao" if ao else "")
        print(f"  {k:40s} {' '.join(f'{t:7.1f}' for t in v)} -> {m:7.1f}{extra}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
