"""Where lowbit.optim.AdamW's kernel and torch.optim.AdamW(fused=True) differ (GPU): per step and tensor, how many
values differ, by how much (in ulps of torch's value, and for p of max(|p before the step|, lr)), with the betas as
given and rounded to FP32 first on lowbit's side; and the kernel against adamw_step_reference."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from lowbit.nn.functional import _WEIGHT_LAYERS, GemmLayer  # noqa: E402
from lowbit.optim import AdamW  # noqa: E402
from lowbit.optim.reference import adamw_step_reference  # noqa: E402
from lowbit.quant.schemes import Float8Blockwise  # noqa: E402


def ulp(x):
    return torch.finfo(torch.float32).eps * x.abs().clamp_min(1e-30)


def main():
    dev = "cuda"
    sch = Float8Blockwise(block_dim=2)
    # torch's betas as given, then rounded to FP32 first in lowbit's optimizer only (does torch round them?)
    for betas in ((0.9, 0.95), (float(torch.tensor(0.9)), float(torch.tensor(0.95)))):
        gen = torch.Generator(device=dev).manual_seed(1)
        p = torch.nn.Parameter(torch.randn(2048, 6144, device=dev, generator=gen) * 0.02)
        _WEIGHT_LAYERS[p] = (GemmLayer(object()), sch)
        t = torch.nn.Parameter(p.detach().clone())
        kw = dict(lr=torch.tensor(1e-3, device=dev), betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True,
                  capturable=True)
        opt = AdamW([p], **dict(kw, betas=betas))  # (torch's own betas stay 0.9, 0.95)
        topt = torch.optim.AdamW([t], **dict(kw, lr=torch.tensor(1e-3, device=dev)))
        rp, rm, rv = p.detach().clone(), torch.zeros_like(p), torch.zeros_like(p)
        for step in range(1, 4):
            g = torch.randn(p.shape, device=dev, generator=gen) * 1e-3
            p.grad, t.grad = g.clone(), g.clone()
            old = p.detach().clone()
            for o in (opt, topt):
                o.grad_scale, o.found_inf = torch.tensor(1.3, device=dev), torch.zeros((), device=dev)
                o.step()
                del o.grad_scale, o.found_inf
            gs = float(torch.tensor(1.3, dtype=torch.float32))
            rp, rm, rv = adamw_step_reference(rp, g, rm, rv, step=step, lr=float(torch.tensor(1e-3)), beta1=betas[0],
                                              beta2=betas[1], weight_decay=0.1, eps=1e-8, grad_scale=gs)
            for name, a, b, r, scale in (("p", p.detach(), t.detach(), rp, old.abs()),
                                         ("m", opt.state[p]["exp_avg"], topt.state[t]["exp_avg"], rm, None),
                                         ("v", opt.state[p]["exp_avg_sq"], topt.state[t]["exp_avg_sq"], rv, None)):
                d = a != b
                sc = ulp(b)
                print(f"betas={betas} step {step} {name}: vs torch {int(d.sum())} of {a.numel()} differ, "
                      f"max |diff| {float((a - b).abs().max()):.3g} = {float(((a - b).abs() / sc).max()):.2f} ulp of the "
                      f"torch value / of max(|old p|, lr) {float(((a - b).abs() / ulp(torch.maximum(scale, torch.full_like(scale, 1e-3)))).max()) if scale is not None else 0:.2f}; vs reference {int((a != r).sum())} differ", flush=True)
                if d.any() and name != "p":
                    i = d.nonzero()[0]
                    print("   e.g.", a[tuple(i)].item(), b[tuple(i)].item(), "g", g[tuple(i)].item())


if __name__ == "__main__":
    main()
