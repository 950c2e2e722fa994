"""1x128 rowwise+columnwise quantize launch sweep (issues 3, 7): blockwise_kernel's candidates (slab walk; FP32 also
whole tiles and blockwise_persistent_kernel), the register-tile kernel's (quant_gluon.rowcol_1x128_regs; checked
against the slab walk), with --whole the whole-tile persistent kernel's variants (warps, prefetch), and the fused
SwiGLU quantizer's candidates (register tile, slab walk, whole tile), each checked bit for bit against the first
config and timed against a device-to-device copy of the same input in the same run.

    PYTHONPATH=src python scripts/rowcol_sweep.py [--shapes 8192x8192,...] [--swiglu 8192x5632,...] [--whole]

GB/s = (input read once + FP8 data + scales written) / median time (triton.testing.do_bench, outputs allocated
once for the quantizer; the SwiGLU one goes through swiglu_quantize_1x128 with the config forced).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import lowbit.quant.triton_backend as tb  # noqa: E402
from lowbit.quant import Float8Blockwise  # noqa: E402
from quant_blockwise_sweep import mism, moved, prepared  # noqa: E402


def _bench(fn):
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def pers_variants():
    """blockwise_persistent_kernel on 1x128 row+col: warps x prefetch (session 7 also tried 16-bit maxima, BITS16)."""
    return [dict(KIND="pers", BM=128, CTAS=1, PREFETCH=pf, num_warps=w) for w in (16, 8) for pf in (1, 2)]


WHOLE = False  # --whole: also the whole-tile persistent variants (session 7: all slower, 0.28-0.57)


def _copy_bw(x):
    """GB/s of a device-to-device copy of x (bytes read + written), timed now."""
    y = torch.empty_like(x)
    return 2 * x.numel() * x.element_size() / _bench(lambda: y.copy_(x)) * 1e-6


def _sweep(cands, prepare, copy_bw):
    """Time each candidate (``prepare(cfg)`` -> (launch, QuantizedTensor, bytes moved)), each checked bit for bit
    against the first; print one row each and the best."""
    ref, res = None, []
    for cfg in cands:
        try:
            launch, qt, nbytes = prepare(cfg)
        except Exception as e:  # noqa: BLE001
            print(f"  {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        torch.cuda.synchronize()
        bad = [] if ref is None else mism(ref, qt)
        ref = ref if ref is not None else qt
        t = _bench(launch)
        bw = nbytes / t * 1e-6
        res.append((t, cfg))
        print(f"  {str(cfg):100s} {t * 1e3:8.1f} us {bw:6.0f} GB/s {bw / copy_bw:.2f}"
              f"{'  MISMATCH ' + str(bad) if bad else ''}", flush=True)
    t, cfg = min(res, key=lambda r: r[0])
    print(f"  best: {cfg} {t * 1e3:.1f} us ({res[0][0] / t:.2f}x the first)", flush=True)


def quant(shapes):
    sch = Float8Blockwise()
    for M, Kd in shapes:
        for dt in (torch.bfloat16, torch.float32):
            x = torch.randn(M, Kd, device="cuda", dtype=dt) * torch.exp(torch.randn(M, Kd, device="cuda") * 2).to(dt)
            copy_bw = _copy_bw(x)
            print(f"\n== 1x128 row+col {M}x{Kd} {dt} copy {copy_bw:.0f} GB/s", flush=True)
            cands = tb._blockwise_configs(M, Kd, 128, False, True, True, dt)
            if dt == torch.float32:
                cands = cands[:1] + [dict(c, KIND="pers") for c in tb._PERSISTENT.get((False, True, True, dt), [])] + cands[1:]
            cands = cands + (pers_variants() if WHOLE else [])
            if tb._gluon_ok(x, 128, False, True, True):  # the Gluon quantizer (LOWBIT_QUANT_GLUON=1), checked against the first
                cands = cands[:1] + list(tb._GLUON_CONFIGS) + cands[1:]
            # the register-tile kernels, checked against the slab walk
            if tb._regs_ok(x, 128, False, True, True):
                cands = cands[:1] + (list(tb._PACKED_CONFIGS) if dt == torch.bfloat16 else []) + list(tb._REGS_CONFIGS) + cands[1:]

            def prepare(cfg, x=x):
                launch, qt = prepared(x, sch, True, True, cfg)
                return launch, qt, moved(x, qt)

            _sweep(cands, prepare, copy_bw)
            del x
            torch.cuda.empty_cache()


def swiglu(shapes):
    S = importlib.import_module("lowbit.ops.swiglu")
    sch = Float8Blockwise()
    orig = S._swiglu_quant_candidates
    for M, F in shapes:
        u = torch.randn(M, 2 * F, device="cuda", dtype=torch.bfloat16) * 3
        copy_bw = _copy_bw(u)
        print(f"\n== swiglu_quantize_1x128 {M}x{F} (u {M}x{2 * F} bf16) copy of u {copy_bw:.0f} GB/s", flush=True)

        def prepare(cfg, u=u):
            S._swiglu_quant_candidates = lambda *a, cfg=cfg: [cfg]
            tb._TUNED.clear()
            fn = lambda: S.swiglu_quantize_1x128(u, sch)  # noqa: E731
            return fn, fn(), u.numel() * 2 + 2 * M * F + 2 * (M * F // 128) * 4

        try:
            _sweep(orig(u, S._regs_runs(u, True, True)), prepare, copy_bw)
        finally:
            S._swiglu_quant_candidates = orig
        del u
        torch.cuda.empty_cache()


def split(shapes):
    """--split: the rowwise-only and the columnwise-only 1x128 copy of a BF16 input (autotuned as in training), each
    as a fraction of a copy at the bytes it moves: where the row+col kernel's shortfall is (session 9)."""
    from lowbit.quant import quantize

    sch = Float8Blockwise()
    for M, Kd in shapes:
        x = torch.randn(M, Kd, device="cuda", dtype=torch.bfloat16)
        copy_bw = _copy_bw(x)
        for rw, cw in ((True, False), (False, True), (True, True)):
            quantize(x, sch, rowwise=rw, columnwise=cw)  # (tunes once)
            qt = quantize(x, sch, rowwise=rw, columnwise=cw)
            t = _bench(lambda: quantize(x, sch, rowwise=rw, columnwise=cw))
            bw = moved(x, qt) / t * 1e-6
            print(f"  {M}x{Kd} bf16 rowwise={rw} columnwise={cw}: {t * 1e3:7.1f} us {bw:6.0f} GB/s {bw / copy_bw:.2f} of copy",
                  flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--whole", action="store_true")
    ap.add_argument("--split", action="store_true", help="only the rowwise-only / columnwise-only / both comparison")
    ap.add_argument("--shapes", default="8192x8192,8192x2048,8192x11264")
    ap.add_argument("--swiglu", default="8192x5632,16384x2816")
    a = ap.parse_args()
    global WHOLE
    WHOLE = a.whole
    parse = lambda s: [tuple(int(v) for v in t.split("x")) for t in s.split(",") if t]  # noqa: E731
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    if a.split:
        split(parse(a.shapes))
        return
    swiglu(parse(a.swiglu))
    quant(parse(a.shapes))


if __name__ == "__main__":
    main()
