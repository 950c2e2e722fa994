"""``lowbit bench quant``: quantization throughput (GB/s of bytes read + written) against a
device-to-device copy of the same input, measured in the same run.

Per input (M, K) in BF16: copy (``y.copy_(x)``: 2 × bytes); lowbit Triton 1x128 rowwise, 1x128
rowwise+columnwise (fused cast + transpose), 128x128 (both copies), per-tensor current scaling
(amax pass + cast), MXFP8 both copies, NVFP4 1x16 rowwise; torchao's 1x128 quantizer when importable; the
quantizers a ``torch.compile``'d fp8-current / fp8-block linear holds (tensorwise: Inductor's kernels; blockwise:
the operator over lowbit's), compiled alone.
The same input in FP32 (as LayerNorm outputs and FP32 master weights reach the quantizer in training): copy,
1x128 rowwise+columnwise, 128x128 both copies; their fraction is of the FP32 copy.
Bytes moved count the input read once per pass plus every output written (data + scales).

Two times per kernel: the eager call (``quantize(...)`` from Python: kernel plus host time, which bounds small
inputs on a slow host), and the same call captured in a CUDA graph and replayed (GPU time only, as in training,
whose steps replay graphs). GB/s and the fraction of a copy are of the graphed time (the copy graphed too); where a
call cannot be captured, of the eager one.
"""

from __future__ import annotations

import datetime

import torch

from . import capture, git_commit, table_main
from .gemm import time_ms


def _graphed(fn, rep):
    """Median ms of ``fn`` captured once in a CUDA graph and replayed (its outputs live in the graph's pool), or
    None where it cannot be captured."""
    try:
        g = capture(fn)
    except Exception as e:  # noqa: BLE001 - reported, the eager time stands
        print(f"    (not graphed: {type(e).__name__}: {str(e).splitlines()[0][:120]})")
        return None
    return time_ms(g.replay, rep)

SHAPES = [(8192, 8192), (16384, 4096), (16384, 14336), (4096, 4096)]


def _run_shape(M, K, rep, rows):
    """Times every quantizer on one (M, K) input and appends its rows; the inputs die with this frame."""
    from lowbit.quant import MXFP8, NVFP4, Float8Blockwise, Float8Tensorwise, quantize

    dev = torch.device("cuda")
    print(f"[quant] M={M} K={K} bf16 ({M * K * 2 / 2**20:.0f} MiB)", flush=True)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    x32 = x.float()
    y32 = torch.empty_like(x32)
    inb = x.numel() * 2
    cases = [
        ("copy (device to device)", lambda: y.copy_(x), None),
        ("1x128 rowwise", lambda: quantize(x, Float8Blockwise(), True, False, backend="triton"), None),
        ("1x128 rowwise+columnwise", lambda: quantize(x, Float8Blockwise(), True, True, backend="triton"), None),
        ("128x128 rowwise+columnwise", lambda: quantize(x, Float8Blockwise(block_dim=2), True, True, backend="triton"),
         None),
        ("tensorwise current row+col", lambda: quantize(x, Float8Tensorwise(), True, True, backend="triton"), 2),
        ("MXFP8 rowwise+columnwise", lambda: quantize(x, MXFP8(), True, True, backend="triton"), None),
        ("NVFP4 1x16 rowwise", lambda: quantize(x, NVFP4(), True, False, backend="triton"), 2),
    ]
    try:
        from torchao.prototype.blockwise_fp8_training.kernels import triton_fp8_blockwise_act_quant_lhs  # type: ignore

        cases.append(("torchao 1x128 rowwise", lambda: triton_fp8_blockwise_act_quant_lhs(x, 128), None))
    except Exception as e:  # noqa: BLE001 - the peer is optional; say why its row is missing
        print(f"    (torchao not importable: {type(e).__name__}: {str(e).splitlines()[0][:120]})")
    cases += [
        ("copy fp32", lambda: y32.copy_(x32), None),
        ("fp32 1x128 rowwise+columnwise", lambda: quantize(x32, Float8Blockwise(), True, True, backend="triton"), None),
        ("fp32 128x128 rowwise+columnwise", lambda: quantize(x32, Float8Blockwise(block_dim=2), True, True,
                                                             backend="triton"), None),
    ]
    traced16, traced32 = _traced_cases(x, x32)
    cases[-3:-3] = traced16  # (each group before the next copy row: fractions are of its own input dtype's copy)
    cases += traced32
    copy_bw = None
    for name, fn, passes in cases:
        te = time_ms(fn, rep)
        if te is None:
            continue
        tg = _graphed(fn, rep)
        t = tg if tg is not None else te
        n_in = 2 * inb if name.startswith("fp32") or name == "copy fp32" else inb  # (FP32 input: twice the bytes)
        if name.startswith("copy"):
            moved = 2 * n_in
        else:
            q = fn()
            moved = n_in * (passes or 1) + (q.nbytes if hasattr(q, "nbytes") else sum(v.numel() * v.element_size()
                                                                                      for v in q))
        bw = moved / t * 1e-6
        if name.startswith("copy"):  # fractions are of the copy of the same input dtype
            copy_bw = bw
        rows.append((f"{M}x{K}", name, te, tg, moved / 2**20, bw, bw / copy_bw))
        g = f"{tg * 1e3:8.1f}" if tg is not None else "       —"
        print(f"    {name:30s} call {te * 1e3:8.1f} us  graphed {g} us {bw:8.0f} GB/s  {bw / copy_bw:.2f} of copy",
              flush=True)


def _traced_cases(x, x32) -> tuple[list, list]:
    """The quantizers a compiled graph holds (:mod:`lowbit.quant.traceable`), each compiled alone: what a
    ``torch.compile``'d fp8-current / fp8-block linear pays per quantization, host time included, next to lowbit's
    direct calls (bytes counted as for lowbit's row of the same scheme, so the GB/s compare the times)."""
    from lowbit.quant import Float8Blockwise, Float8Tensorwise
    from lowbit.quant.traceable import quantize_traceable

    def compiled(t, sch):
        fn = torch.compile(lambda v: quantize_traceable(v, sch, rowwise=True, columnwise=True), fullgraph=True)
        return lambda: tuple(c for c in fn(t) if c is not None)

    return ([("compiled 1x128 rowwise+columnwise", compiled(x, Float8Blockwise()), None),
             ("compiled 128x128 rowwise+columnwise", compiled(x, Float8Blockwise(block_dim=2)), None),
             ("compiled (Inductor) tensorwise row+col", compiled(x, Float8Tensorwise()), 2)],
            [("fp32 compiled 1x128 rowwise+columnwise", compiled(x32, Float8Blockwise()), None),
             ("fp32 compiled 128x128 rowwise+columnwise", compiled(x32, Float8Blockwise(block_dim=2)), None)])


def run(shapes, rep=100, rows=None, done=None):
    """Rows of :func:`markdown` for ``shapes``, appended to ``rows``; ``done()`` after each shape."""
    rows = [] if rows is None else rows
    for M, K in shapes:
        _run_shape(M, K, rep, rows)
        torch.cuda.empty_cache()
        if done is not None:
            done()
    return rows


def markdown(rows) -> str:
    out = [f"Device: {torch.cuda.get_device_name()}; torch {torch.__version__}; date "
           f"{datetime.date.today().isoformat()}; commit {git_commit()}", "",
           "| input | kernel | call (us) | graphed (us) | MiB moved | GB/s | fraction of copy |",
           "|---|---|---:|---:|---:|---:|---:|"]
    for shape, name, te, tg, mib, bw, r in rows:
        g = f"{tg * 1e3:.1f}" if tg is not None else "—"
        out.append(f"| {shape} | {name} | {te * 1e3:.1f} | {g} | {mib:.0f} | {bw:.0f} | {r:.2f} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    return table_main(argv, prog="lowbit bench quant", description=__doc__.splitlines()[0], default_shapes=SHAPES,
                      shapes_help="comma-separated MxK list (default: four GPT-sized activation shapes)", run=run,
                      markdown=markdown)


if __name__ == "__main__":
    raise SystemExit(main())
