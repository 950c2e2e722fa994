"""Diagnostic (session 28): the layouts attention sees in a GPT block's forward and backward under each recipe, and
the kernels of one forward+backward. Prints q/k/v/o strides and the gradient dO as it reaches SDPA's backward.

    python scripts/attn_grad_layout.py [preset] [batch] [layers]
"""
import sys

import torch
import torch.nn.functional as F

import lowbit.nn as lnn
from lowbit.models.gpt import GPT, config_from_preset as preset
from lowbit.recipes import from_name

name = sys.argv[1] if len(sys.argv) > 1 else "350m"
bs = int(sys.argv[2]) if len(sys.argv) > 2 else 8
layers = int(sys.argv[3]) if len(sys.argv) > 3 else 2
_sdpa = F.scaled_dot_product_attention
seen = []


def spy(q, k, v, **kw):
    o = _sdpa(q, k, v, **kw)
    seen.append(("q", tuple(q.shape), q.stride()))
    seen.append(("o", tuple(o.shape), o.stride()))
    if o.requires_grad:
        o.register_hook(lambda g: seen.append(("dO", tuple(g.shape), g.stride())))
    return o


F.scaled_dot_product_attention = spy
for rname in ("bf16", "fp8-block"):
    torch.manual_seed(0)
    cfg = preset(name, n_layer=layers)
    model = GPT(cfg).cuda()
    recipe = from_name(rname)
    idx = torch.randint(0, cfg.vocab_size, (bs, 2048), device="cuda")
    ctx = (lambda: lnn.autocast(enabled=True, recipe=recipe)) if recipe is not None else None
    for it in range(3):
        seen.clear()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if ctx:
                with ctx():
                    _, loss = model(idx, idx)
            else:
                _, loss = model(idx, idx)
        if it == 2:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                loss.backward()
                torch.cuda.synchronize()
        else:
            loss.backward()
        model.zero_grad(set_to_none=True)
    print(f"== {name} {rname}: {seen[:3]} ... dO {[s for s in seen if s[0] == 'dO'][:1]}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=90))
