"""Every quantize call of one training step of a GPT preset, grouped by signature and timed alone (diagnostic).

Records (shape, dtype, scheme, rowwise, columnwise) of each ``lowbit.quantize`` call the quantized layers make in
one step (and each fused SwiGLU quantize), then times one real input of each signature with do_bench and prints
the per-step total, GB/s (bytes read + FP8 data written) and the fraction of a same-size device copy.

Usage: PYTHONPATH=src python scripts/quant_calls.py 1.3b 4 2048 fp8-block
"""
import importlib
import sys
from collections import OrderedDict

import torch
import triton

from lowbit.models import config_from_preset
from lowbit.nn import functional as fn
from profile_model import training_step  # (scripts/ is sys.path[0] when this runs as a script)

preset, bs, seq, rn = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
dev = torch.device("cuda")
sw = importlib.import_module("lowbit.ops.swiglu")  # the module (lowbit.ops.swiglu the attribute is the function)
calls: "OrderedDict[tuple, list]" = OrderedDict()
recording = [False]
orig_q, orig_sw = fn.quantize, sw.swiglu_quantize_1x128


def rec_q(t, scheme, rowwise=True, columnwise=False, **kw):
    if recording[0]:
        key = ("quantize", tuple(t.shape), str(t.dtype).replace("torch.", ""), type(scheme).__name__,
               getattr(scheme, "block_size", None), getattr(scheme, "block_dim", 1) == 2, rowwise, columnwise)
        calls.setdefault(key, [0, None, (scheme, kw)])
        calls[key][0] += 1
        if calls[key][1] is None:
            calls[key][1] = t.detach().clone()
    return orig_q(t, scheme, rowwise=rowwise, columnwise=columnwise, **kw)


def rec_sw(u, scheme, rowwise=True, columnwise=False, **kw):
    if recording[0]:
        key = ("swiglu_quantize_1x128", tuple(u.shape), str(u.dtype).replace("torch.", ""), type(scheme).__name__,
               None, None, rowwise, columnwise)
        calls.setdefault(key, [0, None, (scheme, kw)])
        calls[key][0] += 1
        if calls[key][1] is None:
            calls[key][1] = u.detach().clone()
    return orig_sw(u, scheme, rowwise=rowwise, columnwise=columnwise, **kw)


fn.quantize = rec_q
sw.swiglu_quantize_1x128 = rec_sw

step = training_step(preset, bs, seq, rn, dev)
for _ in range(2):
    step()
recording[0] = True
step()
recording[0] = False
torch.cuda.synchronize()

print(f"=== {preset} {rn} bs {bs} seq {seq}: {sum(v[0] for v in calls.values())} quantize calls a step")
print(f"{'op':22s} {'shape':>14s} {'dtype':>8s} {'scheme':>18s} {'row':>4s} {'col':>4s} {'n':>3s} "
      f"{'us/call':>8s} {'ms/step':>8s} {'GB/s':>7s} {'x copy':>6s}")
total = 0.0
for key, (n, t, (scheme, kw)) in calls.items():
    op, shape, dt, sname, bsz, two_d, rw, cw = key
    if op == "quantize":
        f = lambda: orig_q(t, scheme, rowwise=rw, columnwise=cw, **kw)  # noqa: E731
    else:
        f = lambda: orig_sw(t, scheme, rowwise=rw, columnwise=cw, **kw)  # noqa: E731
    f()
    ms = triton.testing.do_bench(f, rep=50)
    dst = torch.empty_like(t)
    cms = triton.testing.do_bench(lambda: dst.copy_(t), rep=50)
    nel = t.numel() if op == "quantize" else t.numel() // 2
    moved = t.numel() * t.element_size() + nel * (int(rw) + int(cw))
    copy_moved = 2 * t.numel() * t.element_size()
    gbs = moved / ms / 1e6
    frac = gbs / (copy_moved / cms / 1e6)
    total += n * ms
    label = f"{sname}{'' if bsz is None else bsz}{'/2D' if two_d else ''}"
    print(f"{op:22s} {'x'.join(map(str, shape)):>14s} {dt:>8s} {label:>18s} {str(rw)[0]:>4s} {str(cw)[0]:>4s} {n:3d} "
          f"{ms * 1e3:8.1f} {n * ms:8.3f} {gbs:7.0f} {frac:6.2f}")
print(f"total, each call timed alone: {total:.2f} ms a step")

# the RMSNorm the quantized input comes from (FP32 in, FP32 out under autocast)
cfg = config_from_preset(preset)
d = cfg.d_model
xx = torch.randn(bs * seq, d, device=dev)
w = torch.ones(d, device=dev)
with torch.autocast("cuda", dtype=torch.bfloat16):
    ms = triton.testing.do_bench(lambda: torch.nn.functional.rms_norm(xx, (d,), w, 1e-5), rep=50)
    print(f"F.rms_norm fwd {bs * seq}x{d} fp32 under autocast: {ms * 1e3:.1f} us "
          f"(out {torch.nn.functional.rms_norm(xx, (d,), w, 1e-5).dtype}), x{2 * cfg.n_layer} a step = {2 * cfg.n_layer * ms:.2f} ms")
