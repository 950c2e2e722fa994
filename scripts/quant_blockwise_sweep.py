"""Blockwise quantize launch sweep on the GPU (issue 3): blockwise_kernel's default config and every candidate of
blockwise_persistent_kernel (those the backend uses, triton_backend._PERSISTENT, and the ones it does not, EXTRA),
per (input dtype, copies, 1D / 2D), timed against a device-to-device copy of the same input and torchao's
quantizers in the same run, each candidate checked bit for bit against blockwise_kernel.

    PYTHONPATH=src python scripts/quant_blockwise_sweep.py [--shapes 8192x8192,16384x4096] [--diag]

GB/s = (bytes read + bytes written: input once, FP8 data, scales) / median time (triton.testing.do_bench).
--diag: the pointer kernel's slab walk (blockwise_kernel SLAB > 0) on FP32 input against the reference, per output.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import lowbit.quant.triton_backend as tb  # noqa: E402
from lowbit.quant import Float8Blockwise  # noqa: E402
from lowbit.quant.tensor import QuantizedTensor  # noqa: E402


def _bench(fn):
    return do_bench(fn, warmup=10, rep=60, return_mode="median")  # ms


def prepared(x2, sch, rw, cw, cfg, plan=None):
    """(launch, QuantizedTensor) with cfg forced (on ``plan`` if given); outputs allocated once (kernel time only)."""
    M, Kd = x2.shape
    plan = plan if plan is not None else tb._BlockwisePlan(M, Kd, sch, rw, cw, x2.device)
    bufs = tb._blockwise_buffers(plan, sch.format, x2.device, rw, cw)
    args = tb._blockwise_args(plan, *bufs)
    fn, grid, extra, kw = plan.launch_args(cfg)

    def launch():
        fn[grid](x2, *args, *extra, **kw)

    launch()
    qt = QuantizedTensor(shape=x2.shape, dtype=x2.dtype, scheme=sch)
    tb._set_copies(qt, *bufs)
    return launch, qt


def moved(x2, qt):
    n = x2.numel() * x2.element_size()
    for c in (qt.rowwise, qt.columnwise):
        if c is not None:
            n += c.data.numel() + c.scale_inv.numel() * 4
    return n


def mism(ref, got):
    bad = []
    for w in ("rowwise", "columnwise"):
        r, g = getattr(ref, w), getattr(got, w)
        if r is None:
            continue
        for f in ("data", "scale_inv", "amax"):
            A, B = getattr(r, f), getattr(g, f)
            if A.dtype != B.dtype or A.shape != B.shape:
                bad.append(f"{w}.{f}: dtype/shape {A.dtype}{tuple(A.shape)} vs {B.dtype}{tuple(B.shape)}")
                continue
            ai, bi = A.cpu().contiguous().view(torch.uint8), B.cpu().contiguous().view(torch.uint8)
            n = int((ai != bi).sum())
            if n:
                bad.append(f"{w}.{f}: {n} bytes differ")
    return bad


def sweep(shapes):
    CASES = [("1x128 row+col", Float8Blockwise(), True, True), ("1x128 row", Float8Blockwise(), True, False),
             ("128x128 row+col", Float8Blockwise(block_dim=2), True, True)]
    try:
        from torchao.prototype.blockwise_fp8_training import kernels as tao  # type: ignore
    except Exception as e:  # noqa: BLE001
        print("torchao not importable:", e)
        tao = None
    for M, Kd in shapes:
        for dt in (torch.bfloat16, torch.float32):
            x = torch.randn(M, Kd, device="cuda", dtype=dt) * torch.exp(torch.randn(M, Kd, device="cuda") * 2).to(dt)
            y = torch.empty_like(x)
            tc = _bench(lambda: y.copy_(x))
            copy_bw = 2 * x.numel() * x.element_size() / tc * 1e-6
            print(f"\n== {M}x{Kd} {dt} copy {tc * 1e3:.1f} us {copy_bw:.0f} GB/s", flush=True)
            if tao is not None and dt == torch.bfloat16:
                peers = [("torchao 1x128 row (lhs)", lambda: tao.triton_fp8_blockwise_act_quant_lhs(x, 128),
                          x.numel() * 3 + M * (Kd // 128) * 4),
                         ("torchao 1x128 col (transposed_lhs)", lambda: tao.triton_fp8_blockwise_act_quant_transposed_lhs(x, 128),
                          x.numel() * 3 + Kd * (M // 128) * 4),
                         ("torchao 128x128 (weight rhs)", lambda: tao.triton_fp8_blockwise_weight_quant_rhs(x, 128),
                          x.numel() * 3 + (M // 128) * (Kd // 128) * 4)]
                for name, fn, nb in peers:
                    try:
                        t = _bench(fn)
                    except Exception as e:  # noqa: BLE001
                        print(f"  {name}: {type(e).__name__} {e}")
                        continue
                    bw = nb / t * 1e-6
                    print(f"  {name:40s} {t * 1e3:8.1f} us {bw:6.0f} GB/s {bw / copy_bw:.2f}", flush=True)
            for cname, sch, rw, cw in CASES:
                two_d = sch.block_dim == 2
                old = tb._blockwise_configs(M, Kd, 128, two_d, rw, cw, dt)[0]
                pers = [dict(c, KIND="pers") for c in tb._PERSISTENT.get((two_d, rw, cw, dt), [])]
                cands = [old] + pers + [dict(c, KIND="pers") for c in EXTRA.get((two_d, rw, cw, dt), [])]
                ref = None
                for cfg in cands:
                    try:
                        launch, qt = prepared(x, sch, rw, cw, cfg)
                    except Exception as e:  # noqa: BLE001
                        print(f"  {cname:16s} {cfg}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                        continue
                    torch.cuda.synchronize()
                    bad = []
                    if ref is None:
                        ref = qt
                    else:
                        bad = mism(ref, qt)
                    t = _bench(launch)
                    bw = moved(x, qt) / t * 1e-6
                    tag = cfg.get("KIND") or "old"
                    c2 = {k: v for k, v in cfg.items() if k != "KIND"}
                    print(f"  {cname:16s} {tag} {str(c2):70s} {t * 1e3:8.1f} us {bw:6.0f} GB/s {bw / copy_bw:.2f}"
                          f"{'  MISMATCH ' + str(bad) if bad else ''}", flush=True)
                    del launch, qt
            del x, y
            torch.cuda.empty_cache()


EXTRA = {  # blockwise_persistent_kernel candidates measured here but not used by the backend (slower, or wrong)
    (False, True, True, torch.bfloat16): [dict(BM=128, CTAS=1, PREFETCH=1, num_warps=8), dict(BM=128, CTAS=2, PREFETCH=1, num_warps=8),
                                          dict(BM=128, CTAS=1, PREFETCH=1, num_warps=16)],
    (False, True, False, torch.bfloat16): [dict(BM=64, CTAS=2, PREFETCH=1, num_warps=4)],
    (True, True, True, torch.float32): [dict(BM=128, CTAS=1, PREFETCH=1, num_warps=16)],  # columnwise data wrong (Triton 3.6)
}


def e2e(shapes):
    """lowbit.quantize end to end (allocations, zero fill, plan lookup, launch) with the default config."""
    from lowbit.quant import quantize

    for M, Kd in shapes:
        for dt in (torch.bfloat16, torch.float32):
            x = torch.randn(M, Kd, device="cuda", dtype=dt)
            for cname, sch, rw, cw in [("1x128 row+col", Float8Blockwise(), True, True), ("1x128 row", Float8Blockwise(), True, False),
                                       ("128x128 row+col", Float8Blockwise(block_dim=2), True, True)]:
                fn = lambda: quantize(x, sch, rw, cw, backend="triton")  # noqa: E731
                qt = fn()
                t = _bench(fn)
                print(f"  e2e {M}x{Kd} {str(dt):15s} {cname:16s} {t * 1e3:8.1f} us {moved(x, qt) / t * 1e-6:6.0f} GB/s", flush=True)
            del x
            torch.cuda.empty_cache()


def diag():
    """The slab walk (SLAB > 0) on FP32 input against the reference, per output field; SATCVT on and off."""
    from lowbit.quant.reference import quantize_reference

    g = torch.Generator().manual_seed(0)
    for shape in [(1000, 4096)]:
        xc = torch.randn(*shape, generator=g) * torch.exp(torch.randn(*shape, generator=g) * 2)
        x = xc.cuda()
        for sch, cfgs in [(Float8Blockwise(), [dict(BM=128, SLAB=64, num_warps=4, SCR=True)]),
                          (Float8Blockwise(block_dim=2), [dict(BM=128, SLAB=64, num_warps=4)])]:
            ref = quantize_reference(xc, sch, rowwise=True, columnwise=True)
            for cfg in cfgs:
                for satcvt in (True, False):
                    plan_kw = dict(cfg)
                    launch, qt = prepared_ptr(x, sch, plan_kw, satcvt)
                    torch.cuda.synchronize()
                    bad = mism(ref, qt)
                    detail = ""
                    if bad:
                        for w in ("rowwise", "columnwise"):
                            r, gq = getattr(ref, w), getattr(qt, w)
                            d = (r.data.cpu().view(torch.uint8) != gq.data.cpu().view(torch.uint8)).nonzero()
                            if len(d):
                                i, j = d[0].tolist()
                                detail += (f" {w} first diff at {i},{j}: ref {r.data[i, j].float().item()} got "
                                           f"{gq.data.cpu()[i, j].float().item()} (n={len(d)}, rows {d[:, 0].unique()[:8].tolist()})")
                    print(f"  diag fp32 {shape} {sch} {cfg} SATCVT={satcvt}: {bad or 'identical'}{detail}", flush=True)


def prepared_ptr(x, sch, cfg, satcvt):
    M, Kd = x.shape
    plan = tb._BlockwisePlan(M, Kd, sch, True, True, x.device)
    plan.kw["SATCVT"] = satcvt
    return prepared(x, sch, True, True, cfg, plan)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8192x8192,16384x4096,16384x14336")
    ap.add_argument("--diag", action="store_true")
    ap.add_argument("--e2e", action="store_true")
    a = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",") if s]
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    if a.diag:
        diag()
    if shapes:
        sweep(shapes)
    if a.e2e:
        e2e(shapes)


if __name__ == "__main__":
    main()
