"""Host (CPU) cost per call of each piece of an eager lowbit Linear step, on tiny CUDA shapes where the
GPU never limits (GPU diagnostic; prints microseconds per call)."""
import os

import torch

import lowbit
from lowbit import recipes
from lowbit.bench import host_us
from lowbit.gemm import scaled_mm
from lowbit.quant import quantize
from lowbit.quant.schemes import Float8Blockwise

dev = torch.device("cuda")
M = K = N = int(os.environ.get("HOST_N", "256"))


x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
w = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
s1 = Float8Blockwise(block_dim=1)
s2 = Float8Blockwise(block_dim=2)
qx = quantize(x, s1, rowwise=True, columnwise=True)
qw = quantize(w, s2, rowwise=True, columnwise=True)
qg = quantize(dy, s1, rowwise=True, columnwise=True)
rows = {
    "torch.empty": lambda: torch.empty(M, K, device=dev),
    "torch.zeros(1)": lambda: torch.zeros(1, device=dev),
    "x.add_(0) (1 aten launch)": lambda: x.add_(0),
    "quantize 1x128 both": lambda: quantize(x, s1, rowwise=True, columnwise=True),
    "quantize 1x128 rowwise": lambda: quantize(x, s1, rowwise=True, columnwise=False),
    "quantize 128x128 both": lambda: quantize(w, s2, rowwise=True, columnwise=True),
    "scaled_mm fprop": lambda: scaled_mm(qx, qw, out_dtype=torch.bfloat16),
    "scaled_mm dgrad": lambda: scaled_mm(qg, qw, a_copy="rowwise", b_copy="columnwise", out_dtype=torch.bfloat16),
    "scaled_mm wgrad": lambda: scaled_mm(qg, qx, a_copy="columnwise", b_copy="columnwise", out_dtype=torch.bfloat16),
    "torch.mm bf16": lambda: x @ w.t(),
}
# raw Triton launch of the same quantize kernel (args prebuilt)
from lowbit.quant.kernels import quant as KQ  # noqa: E402
from lowbit.quant import triton_backend as TB  # noqa: E402

rq = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=dev)
cq = torch.empty(K, M, dtype=torch.float8_e4m3fn, device=dev)
rs = torch.zeros(K // 128, M, device=dev)
cs = torch.zeros(M // 128, K, device=dev)
am = torch.zeros(1, dtype=torch.int32, device=dev)
fa = TB._fmt_args(s1.format)


def raw():
    KQ.blockwise_kernel[(M // 128, K // 128)](x, rq, rs, cq, cs, am, M, K, rs.shape[1], cs.shape[1], **fa, POW2=True,
                                              EPS=float(s1.eps), TWO_D=False, ROW=True, COL=True, SW=False, BM=128, BS=128,
                                              num_warps=8)


rows["raw triton launch (blockwise_kernel)"] = raw
for rn in ("bf16", "fp8-block", "fp8-current", "fp8-delayed"):
    xg = x.clone().requires_grad_()
    if rn == "bf16":
        m = torch.nn.Linear(K, N, bias=False, device=dev, dtype=torch.bfloat16)

        def fb(m=m, xg=xg):
            m(xg).backward(dy)

        def f(m=m):
            with torch.no_grad():
                m(x)
    else:
        m = lowbit.nn.Linear(K, N, bias=False, device=dev, dtype=torch.bfloat16)
        r = recipes.from_name(rn)

        def fb(m=m, r=r, xg=xg):
            with lowbit.autocast(recipe=r):
                y = m(xg)
            y.backward(dy)

        def f(m=m, r=r):
            with torch.no_grad(), lowbit.autocast(recipe=r):
                m(x)
    rows[f"Linear {rn} fwd (no grad)"] = f
    rows[f"Linear {rn} fwd+bwd"] = fb
# pieces of the backward and of the sentry check
class _PyFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return a * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


xa = x.clone().requires_grad_()
rows["python autograd.Function fwd+bwd (1 op each)"] = lambda: _PyFn.apply(xa).backward(x)
rows["cuda Event() + record"] = lambda: torch.cuda.Event().record()
_evq = torch.cuda.Event()
_evq.record()
rows["event.query()"] = lambda: _evq.query()
_pin = torch.empty(4, pin_memory=True)
_one = torch.zeros(1, device=dev)
rows["pinned copy_ non_blocking"] = lambda: _pin[:1].copy_(_one, non_blocking=True)
_am = [torch.zeros(1, device=dev) for _ in range(6)]
rows["cat(6 x (1,)) + max"] = lambda: torch.cat(_am).max()
for rn in ("fp8-block",):
    r = recipes.from_name(rn)
    m = lowbit.nn.Linear(K, N, bias=False, device=dev, dtype=torch.bfloat16)
    xg = x.clone().requires_grad_()

    def fg(m=m, r=r, xg=xg):
        with lowbit.autocast(recipe=r):
            m(xg)

    def fbi(m=m, r=r, xg=xg):
        with lowbit.autocast(recipe=r, on_nonfinite="ignore"):
            y = m(xg)
        y.backward(dy)

    def fb_noacc(m=m, r=r, xg=xg):
        with lowbit.autocast(recipe=r, on_nonfinite="ignore"):
            y = m(xg)
        torch.autograd.grad(y, [xg, m.weight], dy)

    rows[f"Linear {rn} fwd (with grad, no bwd)"] = fg
    rows[f"Linear {rn} fwd+bwd sentry off"] = fbi
    rows[f"Linear {rn} autograd.grad sentry off"] = fb_noacc
for k, fn in rows.items():
    print(f"{k:45s} {host_us(fn):8.1f} us/call", flush=True)
