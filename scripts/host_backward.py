"""Where does the host time of a lowbit Linear backward go? (GPU diagnostic.) Wraps the pieces of
lowbit.nn.functional with perf_counter timers and compares with the measured step."""
import threading
import time
from collections import defaultdict

import torch

import lowbit
from lowbit import recipes
from lowbit.bench import host_us
from lowbit.nn import functional as F_

dev = torch.device("cuda")
M = K = N = 256
T = defaultdict(float)
C = defaultdict(int)


def wrap(obj, name, label):
    f = getattr(obj, name)

    def g(*a, **k):
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            T[label] += time.perf_counter() - t0
            C[label] += 1

    setattr(obj, name, g)


wrap(F_, "scaled_mm", "scaled_mm")
wrap(F_, "quantize", "quantize (lowbit.quant)")
import lowbit.quant.triton_backend as TB  # noqa: E402
wrap(TB, "_blockwise", "triton_backend._blockwise")
import lowbit.gemm.cublas as CB  # noqa: E402
wrap(CB.torch.nn.functional, "scaled_mm", "F.scaled_mm (torch)")
wrap(F_._ac, "sentry", "sentry")
wrap(F_.GemmLayer, "quantize", "GemmLayer.quantize")
wrap(F_.GemmLayer, "quantized_weight", "GemmLayer.quantized_weight")
wrap(F_._QuantizedLinearFn, "backward", "Fn.backward (total)")
wrap(F_._QuantizedLinearFn, "forward", "Fn.forward (total)")
F_._QuantizedLinearFn.forward = staticmethod(F_._QuantizedLinearFn.forward)
F_._QuantizedLinearFn.backward = staticmethod(F_._QuantizedLinearFn.backward)
from lowbit.nn import state as S  # noqa: E402

wrap(S, "check_nonfinite", "check_nonfinite")
wrap(S, "_launch_check", "_launch_check")
wrap(S, "_drain", "_drain")

x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
m = lowbit.nn.Linear(K, N, bias=False, device=dev, dtype=torch.bfloat16)
r = recipes.from_name("fp8-block")


def step(policy="raise"):
    t0 = time.perf_counter()
    with lowbit.autocast(recipe=r, on_nonfinite=policy):
        y = m(x)
    t1 = time.perf_counter()
    y.backward(dy)
    t2 = time.perf_counter()
    T["step fwd (incl autocast)"] += t1 - t0
    T["step bwd (y.backward)"] += t2 - t1
    C["step fwd (incl autocast)"] += 1
    C["step bwd (y.backward)"] += 1


for policy in ("raise", "ignore", "raise", "ignore"):
    for _ in range(30):
        step(policy)
    torch.cuda.synchronize()
    T.clear()
    C.clear()
    n = 300
    for _ in range(n):
        step(policy)
    torch.cuda.synchronize()
    print(f"--- sentry policy {policy}: us per step")
    for k in sorted(T):
        print(f"  {k:32s} {T[k] / n * 1e6:8.1f}   ({C[k] / n:.1f} calls/step)")

# the same quantize + 2 GEMMs from the main thread vs from another thread
from lowbit.quant import quantize  # noqa: E402
from lowbit.gemm import scaled_mm  # noqa: E402

sch = r.role("grad_output").scheme
qw = quantize(m.weight.detach(), r.role("weight").scheme, rowwise=True, columnwise=True)
qx = quantize(x.detach(), r.role("input").scheme, rowwise=True, columnwise=True)


def bwd_body():
    q = quantize(dy, sch, rowwise=True, columnwise=True)
    scaled_mm(q, qw, a_copy="rowwise", b_copy="columnwise", out_dtype=torch.bfloat16)
    scaled_mm(q, qx, a_copy="columnwise", b_copy="columnwise", out_dtype=torch.bfloat16)


def timed():
    return host_us(bwd_body)


print(f"backward body on main thread: {timed():.1f} us")
res = {}
th = threading.Thread(target=lambda: res.setdefault("t", timed()))
th.start()
th.join()
print(f"backward body on another thread: {res['t']:.1f} us")
