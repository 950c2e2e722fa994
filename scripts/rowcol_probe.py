"""Where does the 1x128 row+col quantizer lose time? Stripped-down probe kernels against the real one (issue 3).

Each probe keeps one part of blockwise_kernel's work and drops the rest, so the fractions of a copy say what each
part costs on the GPU: one pass or two over the tile, the rowwise store, the transposed store, slab height (64-byte
or 128-byte pieces of each transposed row), the scales. The probes' outputs are not quantized data (fixed scale);
only their time matters. Diagnostic, not a library kernel.

    PYTHONPATH=src python scripts/rowcol_probe.py [--shapes 8192x8192,8192x11264]

Fraction = (bytes this probe moves / its time) / (copy bytes / copy time), the copy timed in the same run.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from lowbit import quantize  # noqa: E402
from lowbit.quant import Float8Blockwise  # noqa: E402


@triton.jit
def probe_kernel(x_ptr, rq_ptr, cq_ptr, M, K, ROW: tl.constexpr, COL: tl.constexpr, TWO_PASS: tl.constexpr,
                 BM: tl.constexpr, BS: tl.constexpr, SLAB: tl.constexpr, UNROLL: tl.constexpr):
    """x (M, K) BF16, M and K multiples of BM and BS; rq (M, K) and cq (K, M) FP8 E4M3. One BM x BS tile a program.
    ROW / COL: which copies; TWO_PASS: a first walk over the tile loads it and keeps an elementwise maximum (as the
    real kernel must before any column scale is known), and the columnwise copy uses its column maxima."""
    pid_k = tl.program_id(0).to(tl.int64)
    pid_m = tl.program_id(1).to(tl.int64)
    m0 = pid_m * BM
    k0 = pid_k * BS
    xb = x_ptr + m0 * K + k0
    rqb = rq_ptr + m0 * K + k0
    cqb = cq_ptr + k0 * M + m0
    ck = tl.arange(0, BS)
    mult = tl.full((1, BS), 1.0, tl.float32)
    if TWO_PASS:  # walk 1: loads and an elementwise max (the column scales' input), no stores
        acc = tl.zeros((SLAB, BS), dtype=tl.int32)
        for r0 in tl.range(0, BM, SLAB, loop_unroll_factor=UNROLL):
            r = r0 + tl.arange(0, SLAB)
            x = tl.load(xb + r[:, None] * K + ck[None, :]).to(tl.float32)
            acc = tl.maximum(acc, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
        cm = tl.max(acc, axis=0).to(tl.float32, bitcast=True)
        mult = (448.0 / tl.maximum(cm, 1e-30))[None, :]
    for r0 in tl.range(0, BM, SLAB, loop_unroll_factor=UNROLL):
        r = r0 + tl.arange(0, SLAB)
        x = tl.load(xb + r[:, None] * K + ck[None, :]).to(tl.float32)
        if ROW:
            tl.store(rqb + r[:, None] * K + ck[None, :], tl.clamp(x, -448.0, 448.0).to(tl.float8e4nv))
        if COL:
            q = tl.clamp(x * mult, -448.0, 448.0).to(tl.float8e4nv)
            tl.store(cqb + ck[:, None] * M + r[None, :], tl.trans(q))


def _bench(fn):
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def once(M, K):
    if M % 128 or K % 128:
        raise ValueError(f"--shapes: the probes take whole 128x128 tiles (M and K multiples of 128), got {M}x{K}")
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    quantize(x, Float8Blockwise(), rowwise=True, columnwise=True)
    rq = torch.empty(M, K, dtype=torch.float8_e4m3fn, device="cuda")
    cq = torch.empty(K, M, dtype=torch.float8_e4m3fn, device="cuda")
    for two in (False, True):
        probe_kernel[(K // 128, M // 128)](x, rq, cq, M, K, ROW=True, COL=True, TWO_PASS=two, BM=128, BS=128, SLAB=64,
                                           UNROLL=1, num_warps=4)
    torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8192x8192,8192x11264")
    ap.add_argument("--once", action="store_true", help="launch the quantizer and two probes once each (for ncu)")
    args = ap.parse_args()
    if args.once:
        return once(*(int(v) for v in args.shapes.split(",")[0].split("x")))
    for s in args.shapes.split(","):
        M, K = (int(v) for v in s.split("x"))
        if M % 128 or K % 128:
            raise ValueError(f"--shapes: the probes take whole 128x128 tiles (M and K multiples of 128), got {M}x{K}")
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(x)
        tc = _bench(lambda: y.copy_(x))
        copy_bw = 4 * x.numel() / tc * 1e-6
        print(f"\n== {M}x{K} BF16, copy {tc * 1e3:.1f} us {copy_bw:.0f} GB/s", flush=True)
        sch = Float8Blockwise()
        t = _bench(lambda: quantize(x, sch, rowwise=True, columnwise=True))
        print(f"  {'lowbit.quantize 1x128 row+col (autotuned)':60s} {t * 1e3:7.1f} us  {tc / t:.2f}", flush=True)
        rq = torch.empty(M, K, dtype=torch.float8_e4m3fn, device="cuda")
        cq = torch.empty(K, M, dtype=torch.float8_e4m3fn, device="cuda")
        for row, col, two in ((True, True, False), (True, True, True), (False, True, False), (False, True, True),
                              (True, False, False)):
            for slab, warps, unroll in ((64, 4, 1), (64, 4, 2), (128, 4, 1), (128, 8, 1), (32, 4, 2)):
                if two and slab == 128:
                    continue
                grid = (K // 128, M // 128)
                fn = lambda: probe_kernel[grid](x, rq, cq, M, K, ROW=row, COL=col, TWO_PASS=two, BM=128,  # noqa: E731
                                                BS=128, SLAB=slab, UNROLL=unroll, num_warps=warps)
                t = _bench(fn)
                nbytes = x.numel() * (2 + row + col)
                name = f"{'row' if row else ''}{'+' if row and col else ''}{'col' if col else ''} " \
                       f"{'2 passes' if two else '1 pass'} slab {slab} warps {warps} unroll {unroll}"
                print(f"  {name:60s} {t * 1e3:7.1f} us  {nbytes / t * 1e-6 / copy_bw:.2f}", flush=True)


if __name__ == "__main__":
    main()
