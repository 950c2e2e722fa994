"""How fast can a transposed copy be written on this GPU? torch's own transposes (BF16 -> BF16, FP8 bytes -> bytes)
against a plain device copy, the same bytes each (diagnostic for the 1x128 columnwise quantizer, session 9).

    PYTHONPATH=src python scripts/transpose_roofline.py [8192x8192,8192x11264]
"""
import sys

import torch
from triton.testing import do_bench

shapes = [tuple(int(v) for v in s.split("x")) for s in (sys.argv[1] if len(sys.argv) > 1 else "8192x8192,8192x11264").split(",")]
print(torch.cuda.get_device_name(), torch.__version__)
for M, K in shapes:
    for dt in (torch.bfloat16, torch.uint8):
        x = (torch.randn(M, K, device="cuda") * 10).to(dt)
        y = torch.empty_like(x)
        yt = torch.empty(K, M, device="cuda", dtype=dt)
        nbytes = 2 * x.numel() * x.element_size()
        tc = do_bench(lambda: y.copy_(x), warmup=10, rep=60, return_mode="median")
        tt = do_bench(lambda: yt.copy_(x.t()), warmup=10, rep=60, return_mode="median")
        print(f"{M}x{K} {str(dt):15s} copy {tc * 1e3:7.1f} us {nbytes / tc * 1e-6:6.0f} GB/s | transposed copy "
              f"{tt * 1e3:7.1f} us {nbytes / tt * 1e-6:6.0f} GB/s = {tc / tt:.2f} of copy", flush=True)
