"""``lowbit bench optim``: the optimizer step of a GPT preset's weights with their FP8 copies, as a training step
needs it, against torch in the same run.

* torch: ``torch.optim.AdamW(fused=True, capturable=True)`` with ``grad_scale`` / ``found_inf`` set (how lowbit's
  training graph clips and skips), then ``lowbit.quantize`` of every weight to 128 x 128 blockwise FP8, both copies
  (what each forward of ``fp8-block`` does first);
* lowbit: ``lowbit.optim.AdamW`` (the same update; its kernel writes the copies), for each kernel config asked.

Each is captured in a CUDA graph and replayed (GPU time only, as in training). Bytes moved by the lowbit kernel:
p, grad, exp_avg, exp_avg_sq read (16 B an element), p and both moments written (12 B), two FP8 copies (2 B) and
the scales; GB/s against a device-to-device copy measured in the same run.
"""

from __future__ import annotations

import argparse
import datetime

import torch

from . import capture, git_commit, median_ms


def weight_shapes(preset: str, layers: int | None = None) -> list[tuple[int, int]]:
    """The 2D GEMM weights of a GPT preset (SwiGLU MLP): QKV, output projection, fc1 (both halves), fc2
    (:func:`lowbit.bench.gemm.layer_shapes`) per layer."""
    from lowbit.models.gpt import config_from_preset

    from .gemm import layer_shapes

    return [(n_out, k_in) for _, n_out, k_in in layer_shapes(preset)] * (layers or config_from_preset(preset).n_layer)


def run(preset: str, layers: int | None, configs: list[tuple[int, ...]], rep: int = 20) -> list[dict]:
    """Rows {case, ms, ...} for the torch baseline and each (CH, CH2, warps[, stages]) config of lowbit's kernel."""
    from lowbit.nn.functional import GemmLayer, record_weight_layer
    from lowbit.optim import AdamW
    from lowbit.optim.adamw import KernelConfig
    from lowbit.quant import Float8Blockwise, quantize

    dev = torch.device("cuda")
    sch = Float8Blockwise(block_dim=2)
    shapes = weight_shapes(preset, layers)
    n = sum(a * b for a, b in shapes)
    print(f"[optim] {preset}: {len(shapes)} weights, {n / 1e9:.3f}e9 elements", flush=True)
    gen = torch.Generator(device=dev).manual_seed(0)
    ps, layers = [], []  # (the registry holds the layers weakly: kept alive here)
    for a, b in shapes:
        p = torch.nn.Parameter(torch.randn(a, b, device=dev, generator=gen) * 0.02)
        p.grad = torch.randn(a, b, device=dev, generator=gen) * 1e-3
        layers.append(GemmLayer(object()))
        record_weight_layer(p, layers[-1], sch)
        ps.append(p)
    big = torch.empty(2**28, device=dev)  # 1 GiB FP32
    big2 = torch.empty_like(big)
    copy_ms = median_ms(lambda: big2.copy_(big), rep=rep)
    copy_gbs = 2 * big.numel() * 4 / copy_ms / 1e6
    rows = [{"case": "copy (device to device)", "ms": copy_ms, "GB/s": copy_gbs}]
    gs, fi = torch.tensor(1.25, device=dev), torch.zeros((), device=dev)

    def setup(opt):  # as lowbit's update graph runs it: device lr, clipping as grad_scale, device-side skip
        for g in opt.param_groups:
            g["lr"] = torch.tensor(1e-4, device=dev)
            g["capturable"] = True
        opt.grad_scale, opt.found_inf = gs, fi

    kw = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    topt = torch.optim.AdamW(ps, lr=1e-4, **kw)
    topt.step()  # (state first: the capturable step needs it)
    setup(topt)
    t_step = median_ms(capture(topt.step).replay, rep=rep)
    t_quant = median_ms(capture(lambda: [quantize(p.detach(), sch, True, True, backend="triton") for p in ps]).replay,
                        rep=rep)
    base = t_step + t_quant
    rows += [{"case": "torch fused AdamW step", "ms": t_step}, {"case": "lowbit.quantize 128x128 row+col (each weight)",
                                                                  "ms": t_quant},
             {"case": "torch: step + quantize", "ms": base}]
    del topt
    opt = AdamW(ps, lr=1e-4, **kw)
    opt.step()
    setup(opt)
    moved = n * 30 + 2 * sum(-(-a // 128) * -(-b // 128) * 4 for a, b in shapes)
    for cfg in configs:
        opt.kernel_config = KernelConfig(*cfg)
        ch, ch2, w, ns = cfg if len(cfg) == 4 else (*cfg, KernelConfig.stages)
        t = median_ms(capture(opt.step).replay, rep=rep)
        gbs = moved / t / 1e6
        rows.append({"case": f"lowbit.optim.AdamW (CH={ch}, CH2={ch2}, {w} warps, {ns} stages)", "ms": t, "GB/s": gbs,
                     "of copy": gbs / copy_gbs, "vs torch": base / t})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="lowbit bench optim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="1.3b", help="GPT preset whose weight shapes are stepped (default 1.3b)")
    ap.add_argument("--layers", type=int, default=None, help="number of layers (default: the preset's)")
    ap.add_argument("--configs", default="8,32,8,3",
                    help="kernel configs 'CH,CH2,WARPS[,STAGES];...' (default 8,32,8,3, the kernel's default)")
    ap.add_argument("--rep", type=int, default=20)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("lowbit bench optim needs a CUDA GPU")
        return 1
    configs = [tuple(int(v) for v in c.split(",")) for c in a.configs.split(";") if c]
    rows = run(a.model, a.layers, configs, a.rep)
    print(f"\n{torch.cuda.get_device_name()}  {datetime.date.today()}  commit {git_commit()}  preset {a.model}")
    for r in rows:
        extra = "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()
                          if k not in ("case", "ms"))
        print(f"  {r['case']:50s} {r['ms']:8.3f} ms  {extra}")
    return 0
