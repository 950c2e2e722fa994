"""One launch of a fused 1x128 row+col quantizer under its default register-tile candidate, for Nsight Compute
(diagnostic): ``plain`` (lowbit.quantize of a BF16 (M, K)), ``swiglu`` (swiglu_quantize_1x128 of u (M, 2F)) or
``swiglu_bwd`` (swiglu_backward_quantize_1x128 of u (M, 2F) and dh (M, F)).

    ncu --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \\
        -k regex:rowcol python scripts/ncu_fused_quant.py swiglu 8192x5632
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch  # noqa: E402

import lowbit.quant.triton_backend as tb  # noqa: E402
from lowbit import quantize  # noqa: E402
from lowbit.ops import swiglu as _  # noqa: E402,F401
from lowbit.quant import Float8Blockwise  # noqa: E402

S = sys.modules["lowbit.ops.swiglu"]
tb.AUTOTUNE = False  # the first candidate of each: the register-tile kernel
kind, shape = sys.argv[1], sys.argv[2]
M, N = (int(v) for v in shape.split("x"))
sch = Float8Blockwise()
if kind == "plain":
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    fn = lambda: quantize(x, sch, rowwise=True, columnwise=True)  # noqa: E731
elif kind == "swiglu":
    u = torch.randn(M, 2 * N, device="cuda", dtype=torch.bfloat16)
    fn = lambda: S.swiglu_quantize_1x128(u, sch)  # noqa: E731
else:
    u = torch.randn(M, 2 * N, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    fn = lambda: S.swiglu_backward_quantize_1x128(u, g, sch)  # noqa: E731
fn()
torch.cuda.synchronize()
