"""Write traffic of the attention backward, BF16 vs FP8 gradients, by Nsight Compute's counters (issue 6).

    python scripts/ncu_attention_bwd.py [--shape B,H,S,D] [--out DIR]     # runs ncu itself (needs a GPU + ncu)

It profiles one backward per variant (BF16, FP8 E4M3 per-row scales, FP8 E4M3 given per-tensor scales; autotune
off, so each kernel launches once) with ``ncu --clock-control none --cache-control none -k regex:_bwd`` and
prints, per variant and kernel, the bytes ``lowbit.attention.backward.backward_write_bytes`` counts against

* ``lts__t_sectors_op_write.sum`` x 32: the bytes the kernel's stores wrote into L2 (exact per kernel), and
* ``dram__bytes_write.sum``: the bytes that reached DRAM.  A kernel's dirty lines still in L2 when it ends are
  written back during the *next* kernel, so per kernel this is shifted; summed over the variant's chain
  (preprocess, dK/dV, dQ, and an L2 flush kernel that only reads 2x the L2 size, ``_bwd_l2_flush``, launched
  after it) it is the variant's whole write traffic.  ``--cache-control none`` keeps ncu from flushing the
  L2 itself between kernels (that write-back would be counted nowhere).

The ratio FP8 / BF16 of the gradient bytes is 1/2 by construction (1-byte codes); the per-row scales add
4 bytes per 128-element row (D=128: +3.1% of the FP8 bytes).  ``--workload`` is the profiled program.
"""
from __future__ import annotations

import argparse
import csv
import io
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

VARIANTS = ("bf16", "fp8_e4m3_rowscale", "fp8_e4m3_tensorscale")
METRICS = ("dram__bytes_write.sum", "lts__t_sectors_op_write.sum")


def _flush_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _bwd_l2_flush(X, OUT, N, BLOCK: tl.constexpr):
        """Read-only sweep over a buffer of 2x the L2: evicts (writes back) every dirty line left in L2."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(X + offs, mask=offs < N, other=0)
        tl.store(OUT + tl.program_id(0), tl.sum(x, 0))  # 4 bytes per program, so the loads are not dead

    return _bwd_l2_flush


def workload(shape):
    os.environ["LOWBIT_ATTN_AUTOTUNE"] = "0"  # one launch per kernel (the autotuner would launch each config)
    os.environ["LOWBIT_ATTN_BWD_TMA"] = "0"
    import torch
    import triton

    from lowbit.attention import backward as BW

    b, h, s, d = shape
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    o, lse = BW.attention_forward(q, k, v)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    n = 2 * l2 // 4
    buf = torch.ones(n, device="cuda", dtype=torch.int32)
    out = torch.empty(triton.cdiv(n, 4096), device="cuda", dtype=torch.int32)
    flush = _flush_kernel()

    def l2_flush():
        flush[(triton.cdiv(n, 4096),)](buf, out, n, BLOCK=4096)

    scales = tuple(torch.full((1,), 448.0 / 4, device="cuda") for _ in range(3))
    kw = {"bf16": {}, "fp8_e4m3_rowscale": {"grad_format": "e4m3"},
          "fp8_e4m3_tensorscale": {"grad_format": "e4m3", "scales": scales}}
    for name in VARIANTS:  # compile every variant before the profiled sequence (no launches while compiling)
        BW.backward(do, q, k, v, o, lse, **kw[name])
    torch.cuda.synchronize()
    l2_flush()
    for name in VARIANTS:  # profiled: preprocess, dkdv, dq, flush per variant, in this order
        BW.backward(do, q, k, v, o, lse, **kw[name])
        l2_flush()
    torch.cuda.synchronize()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="2,32,4096,128")
    ap.add_argument("--workload", action="store_true", help="(internal) the program ncu profiles")
    ap.add_argument("--ncu", default="ncu")
    ap.add_argument("--out", default=None, help="keep ncu's CSV here")
    args = ap.parse_args(argv)
    shape = tuple(int(x) for x in args.shape.split(","))
    if args.workload:
        workload(shape)
        return 0
    from lowbit.attention.backward import backward_write_bytes

    b, h, s, d = shape
    rows = {}
    for metric in METRICS:  # one ncu run per metric: a name this ncu does not know fails only its own run
        cmd = [args.ncu, "--clock-control", "none", "--cache-control", "none", "-k", "regex:_bwd", "--metrics", metric,
               "--csv", "--page", "raw", "--print-units", "base", sys.executable, os.path.abspath(__file__), "--workload", "--shape", args.shape]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"ncu_{metric}.csv"), "w") as f:
                f.write(r.stdout + "\n# stderr\n" + r.stderr)
        text = r.stdout[r.stdout.find('"ID"'):] if '"ID"' in r.stdout else ""
        recs = [x for x in csv.DictReader(io.StringIO(text)) if x.get("Kernel Name")]
        recs = [x for x in recs if x.get(metric, "").replace(",", "").replace(".", "").isdigit()]
        if not recs:
            print(f"# ncu {metric}: no rows (rc {r.returncode}): {r.stderr[-800:]}")
            continue
        # the last 1 + 4 * len(VARIANTS) launches are the profiled sequence (flush, then bwd x3 + flush per variant)
        seq = recs[-(4 * len(VARIANTS)):]
        unit = 32 if metric.startswith("lts__t_sectors") else 1
        for i, name in enumerate(VARIANTS):
            chain = seq[4 * i:4 * i + 4]
            names = [c["Kernel Name"] for c in chain]
            vals = [float(c[metric].replace(",", "")) * unit for c in chain]
            rows.setdefault(name, {})[metric] = dict(zip(("preprocess", "dkdv", "dq", "flush"), vals), names=names)
    print(f"# attention backward write bytes, (B,H,S,D)=({b},{h},{s},{d}) non-causal, MB = 1e6 bytes")
    print("| variant | kernel | counted | L2 writes (lts sectors x 32) | DRAM writes | DRAM / counted |")
    print("|---|---|---:|---:|---:|---:|")
    totals = {}
    for name in VARIANTS:
        acc = backward_write_bytes(b, h, h, s, s, d, grad_format=None if name == "bf16" else "e4m3",
                                   per_row_scales=name.endswith("rowscale"))
        m = rows.get(name, {})
        lts, dram = m.get(METRICS[1], {}), m.get(METRICS[0], {})
        for kern in ("preprocess", "dkdv", "dq", "flush"):
            c = acc.get(kern, 0)
            lv, dv = lts.get(kern), dram.get(kern)
            print(f"| {name} | {kern} | {c / 1e6:.2f} | {'-' if lv is None else f'{lv / 1e6:.2f}'} | "
                  f"{'-' if dv is None else f'{dv / 1e6:.2f}'} | {'-' if dv is None or not c else f'{dv / c:.3f}'} |")
        c = acc["preprocess"] + acc["dkdv"] + acc["dq"]
        lt = sum(lts.get(x, 0.0) for x in ("preprocess", "dkdv", "dq")) if lts else None
        dt = sum(dram.get(x, 0.0) for x in ("preprocess", "dkdv", "dq", "flush")) if dram else None
        totals[name] = (c, lt, dt, lts.get("dkdv"), lts.get("dq"))
        print(f"| {name} | **all (DRAM: + flush)** | {c / 1e6:.2f} | {'-' if lt is None else f'{lt / 1e6:.2f}'} | "
              f"{'-' if dt is None else f'{dt / 1e6:.2f}'} | {'-' if dt is None else f'{dt / c:.3f}'} |")
    base = totals.get("bf16")
    for name in VARIANTS[1:]:
        t = totals.get(name)
        if base and t:
            r = [f"{x / y:.3f}" if x and y else "-" for x, y in zip(t, base)]
            print(f"# {name} / bf16: counted {r[0]}, L2 writes {r[1]} (dK/dV kernel {r[3]}, dQ kernel {r[4]}), "
                  f"DRAM writes {r[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
