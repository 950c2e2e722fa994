"""Host time of one quantized attention call (lowbit.attention, INT8 Q·Kᵀ + FP8 P·V, B8 H16 S2048): a single call
(host / until the GPU is done, medians of 200), the back-to-back rate, and a cProfile of the host side at D = 64.

    python scripts/attn_host_time.py
"""
import cProfile
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import torch
from lowbit.attention import attention
for D in (64, 128):
    B, H, S = 8, 16, 2048
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    f = lambda: attention(q, k, v, qk="int8", pv="fp8")
    for _ in range(20): f()
    torch.cuda.synchronize()
    hs, ws = [], []
    for _ in range(200):
        torch.cuda.synchronize()
        t0 = time.perf_counter(); f(); t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
        hs.append(t1 - t0); ws.append(t2 - t0)
    loops = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(100): f()
        torch.cuda.synchronize()
        loops.append((time.perf_counter() - t) / 100)
    print(f"D={D} one call: host {statistics.median(hs)*1e6:.0f} us (min {min(hs)*1e6:.0f}), to sync "
          f"{statistics.median(ws)*1e6:.0f} us; back to back {min(loops)*1e6:.0f} us/call (best of 3 x 100)")
    # the launch shortcut on and off in alternate calls (same process, interleaved: the host's speed drifts by 2x
    # between runs on the device machine, so separate runs do not compare)
    from lowbit import _launch
    on, off = [], []
    for i in range(400):
        _launch._ENABLED = i % 2 == 0
        torch.cuda.synchronize()
        t0 = time.perf_counter(); f(); t1 = time.perf_counter()
        (on if i % 2 == 0 else off).append(t1 - t0)
    _launch._ENABLED = True
    print(f"D={D} launch shortcut on / off, interleaved: host {statistics.median(on)*1e6:.0f} / "
          f"{statistics.median(off)*1e6:.0f} us a call (medians of 200)")
    if D == 64 and os.environ.get("TOP", "12") != "0":
        pr = cProfile.Profile(); pr.enable()
        for _ in range(100): f()
        pr.disable(); torch.cuda.synchronize()
        pstats.Stats(pr).sort_stats("tottime").print_stats(int(os.environ.get("TOP", "12")))
