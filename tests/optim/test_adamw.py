"""lowbit.optim.AdamW: the fused update + FP8 128x128 copies kernel against the reference (adamw_step_reference and
quantize_reference), the bookkeeping (skip, grad_scale, tensor lr, refresh, stale copies), and on the GPU the
agreement with torch.optim.AdamW(fused=True) and the forward taking the copies.

CPU: the kernel runs under Triton's interpreter in a child process (software FP8 rounding there, so bit-exact too).
"""

import os
import subprocess
import sys

import pytest
import torch

from lowbit.nn.functional import GemmLayer, record_weight_layer
from lowbit.optim import AdamW
from lowbit.optim.reference import adamw_step_reference
from lowbit.quant.reference import quantize_reference
from lowbit.quant.schemes import Float8Blockwise

SCH = Float8Blockwise("e4m3", block_dim=2, pow2=True)
# (shapes of the weights, several of one shape so that a launch holds more than one tensor); ragged ones too
SHAPES = [(256, 384), (256, 384), (130, 200), (128, 128)]


class _Owner:
    lowbit_name = "w"


def _params(device, shapes, gen, sch=SCH):
    ps, layers = [], []
    for i, s in enumerate(shapes):
        p = torch.nn.Parameter(torch.randn(*s, generator=gen).mul_(0.05 * (i + 1)).to(device))
        layer = GemmLayer(_Owner())
        record_weight_layer(p, layer, sch)  # what a lowbit forward records
        ps.append(p)
        layers.append(layer)
    return ps, layers


def _grads(ps, gen, scale=1.0):
    for p in ps:
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-2 * scale).to(p.device)


def _check_copies(p, layer, sch=SCH):
    f = layer.fresh
    assert f is not None and f.valid_for(p, sch)
    ref = quantize_reference(p.detach().clone(), sch, rowwise=True, columnwise=True)
    for got, exp in ((f.q.rowwise, ref.rowwise), (f.q.columnwise, ref.columnwise)):
        assert torch.equal(got.data.view(torch.uint8), exp.data.view(torch.uint8))
        assert torch.equal(got.scale_inv, exp.scale_inv)
        assert torch.equal(got.amax.reshape(()), exp.amax.reshape(()))


def _check_kernel(device: str, seed: int = 0, sch=SCH):
    """Three steps (plain; weight decay + grad_scale; tensor lr), a skipped step, and a refresh, on SHAPES plus a 1D
    parameter that takes torch's path: everything bit-exact against adamw_step_reference / quantize_reference."""
    gen = torch.Generator().manual_seed(seed)
    ps, layers = _params(device, SHAPES, gen, sch)
    bias = torch.nn.Parameter(torch.randn(7, generator=gen).to(device))
    hp = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt = AdamW([{"params": ps}, {"params": [bias], "weight_decay": 0.0}], fused=True, **hp)
    twin = torch.nn.Parameter(bias.detach().clone())
    topt = torch.optim.AdamW([twin], fused=True, **dict(hp, weight_decay=0.0))
    ref = [(p.detach().clone(), torch.zeros_like(p), torch.zeros_like(p)) for p in ps]
    for step in (1, 2, 3):
        _grads(ps + [bias], gen, scale=10.0 ** (step - 2))
        twin.grad = bias.grad.clone()
        gs = None
        if step == 2:  # grad_scale as torch's fused kernels read it (clipping in lowbit's training graph)
            gs = float(torch.tensor(1.7, dtype=torch.float32))  # (torch reads grad_scale as FP32)
            opt.grad_scale = torch.tensor(gs, device=device)
            opt.found_inf = torch.zeros((), device=device)
        if step == 3:
            for g in opt.param_groups:
                g["lr"] = torch.tensor(2e-3, device=device)
        lr = float(torch.tensor(2e-3, dtype=torch.float32)) if step == 3 else hp["lr"]  # (a tensor lr is FP32)
        new = []
        for p, (rp, rm, rv) in zip(ps, ref):
            new.append(adamw_step_reference(rp, p.grad.cpu().to(rp.device), rm, rv, step=step, lr=lr, beta1=0.9,
                                            beta2=0.95, weight_decay=0.1, eps=1e-8, grad_scale=gs))
        ref = new
        opt.step()
        if step == 2:
            del opt.grad_scale, opt.found_inf
        assert opt.fused_tensors == len(ps)
        for p, layer, (rp, rm, rv) in zip(ps, layers, ref):
            st = opt.state[p]
            assert float(st["step"]) == step
            assert torch.equal(p.detach(), rp), (step, (p.detach() - rp).abs().max())
            assert torch.equal(st["exp_avg"], rm) and torch.equal(st["exp_avg_sq"], rv)
            _check_copies(p, layer, sch)
        if step != 3:
            if step == 2:
                topt.grad_scale, topt.found_inf = torch.tensor(gs, device=device), torch.zeros((), device=device)
            topt.step()
            assert torch.equal(bias.detach(), twin.detach())  # the 1D parameter: torch's own step
    # a skipped step (found_inf = 1): nothing changes, the copies (and their amax) stay valid
    before = [(p.detach().clone(), opt.state[p]["exp_avg"].clone(), l.fresh.q.rowwise.amax.clone())
              for p, l in zip(ps, layers)]
    _grads(ps + [bias], gen)
    opt.grad_scale, opt.found_inf = torch.tensor(1.0, device=device), torch.ones((), device=device)
    opt.step()
    del opt.grad_scale, opt.found_inf
    for p, layer, (bp, bm, ba) in zip(ps, layers, before):
        assert torch.equal(p.detach(), bp) and torch.equal(opt.state[p]["exp_avg"], bm)
        assert float(opt.state[p]["step"]) == 3
        assert torch.equal(layer.fresh.q.rowwise.amax, ba)
        _check_copies(p, layer, sch)
    # an in-place change through torch makes the copies stale; refresh_weight_copies writes them again
    with torch.no_grad():
        ps[0].mul_(-3.0)
    assert not layers[0].fresh.valid_for(ps[0], sch)
    assert opt.refresh_weight_copies() == len(ps)
    for p, layer in zip(ps, layers):
        _check_copies(p, layer, sch)
    # and an update after the refresh writes the same buffers (amax included)
    _grads(ps + [bias], gen)
    opt.step()
    for p, layer in zip(ps, layers):
        _check_copies(p, layer, sch)


def _check_skipped_first_step(device: str):
    """A first step skipped on the device (found_inf = 1, no copies written before): nothing is updated and the copies
    the next forward takes hold the weights as they are; the next step (found_inf = 0) is the reference's first."""
    gen = torch.Generator().manual_seed(5)
    ps, layers = _params(device, SHAPES[:2], gen)
    before = [p.detach().clone() for p in ps]
    opt = AdamW(ps, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    for skip in (1.0, 0.0):
        _grads(ps, gen)
        opt.found_inf = torch.full((), skip, device=device)
        opt.step()
        del opt.found_inf
        for p, layer, b in zip(ps, layers, before):
            if skip:
                assert torch.equal(p.detach(), b) and float(opt.state[p]["step"]) == 0
            else:
                rp, _, _ = adamw_step_reference(b, p.grad.cpu().to(b.device), torch.zeros_like(b), torch.zeros_like(b),
                                                step=1, lr=3e-3, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8)
                assert torch.equal(p.detach(), rp)
            _check_copies(p, layer)


def test_kernel_interpreter_subprocess():
    pytest.importorskip("triton")
    code = ("import sys; sys.path.insert(0, %r); import test_adamw as t; t._check_kernel('cpu'); "
            "t._check_kernel('cpu', 1, t.SCH_E5M2); t._check_skipped_first_step('cpu'); print('ok')"
            % os.path.dirname(__file__))
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


SCH_E5M2 = Float8Blockwise("e5m2", block_dim=2, pow2=False)


def test_reference_matches_torch_cpu_fused_math_shape():
    """The reference is one AdamW step: against torch's single-tensor CPU AdamW (FP32 throughout, its own operation
    order): within 2 ulp of p (the final rounding of p - update, twice) + 1e-8 (FP32 error of an update of size lr,
    1e-2 here; a wrong formula is off by ~lr)."""
    gen = torch.Generator().manual_seed(3)
    p = torch.randn(64, 48, generator=gen)
    g = torch.randn(64, 48, generator=gen) * 1e-2
    tp = torch.nn.Parameter(p.clone())
    tp.grad = g.clone()
    torch.optim.AdamW([tp], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False).step()
    rp, rm, rv = adamw_step_reference(p, g, torch.zeros_like(p), torch.zeros_like(p), step=1, lr=1e-2, beta1=0.9,
                                      beta2=0.95, weight_decay=0.1, eps=1e-8)
    torch.testing.assert_close(rp, tp.detach(), rtol=2.4e-7, atol=1e-8)
    with pytest.raises(TypeError, match="float32"):
        adamw_step_reference(p.double(), g, p, p, step=1, lr=1e-3, beta1=0.9, beta2=0.9, weight_decay=0, eps=1e-8)


def test_non_targets_follow_torch():
    """Parameters no lowbit forward recorded (and quantized_weights=False) are stepped by torch.optim.AdamW."""
    gen = torch.Generator().manual_seed(4)
    w = torch.nn.Parameter(torch.randn(8, 8, generator=gen))
    t = torch.nn.Parameter(w.detach().clone())
    opt, topt = AdamW([w], lr=1e-2), torch.optim.AdamW([t], lr=1e-2)
    for _ in range(2):
        w.grad = torch.randn(8, 8, generator=gen)
        t.grad = w.grad.clone()
        opt.step()
        topt.step()
    assert opt.fused_tensors == 0 and torch.equal(w.detach(), t.detach())
    with pytest.raises(TypeError, match="quantized_weights"):
        AdamW([w], quantized_weights="yes")


# -- GPU ---------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_gpu(seed):
    _check_kernel("cuda", seed)
    _check_kernel("cuda", seed + 10, SCH_E5M2)
    _check_skipped_first_step("cuda")


@pytest.mark.gpu
def test_close_to_torch_fused_adamw_gpu():
    """Against torch.optim.AdamW(fused=True, capturable=True) on the same tensors, three steps with a tensor lr and
    grad_scale. Not bit for bit: lowbit's kernel follows the published CUDA source of torch's fused AdamW (double
    hyperparameters: one rounding to FP32 a moment), each step from the same state, while torch 2.11's CUDA build
    rounds the betas to FP32 and rounds the moment products in FP32 (measured: with the betas rounded the
    first exp_avg matches exactly, exp_avg_sq is 1 ulp off in a quarter of the elements). Bounds from that run (three
    steps, drift included): moments within 8 ulp of the size of their terms (about 2x the 3-4 ulp seen), the
    parameter within 2^-18 = 32 ulp of max(|p before the step|, lr) (about 4x the 8.3 seen; the update is ~lr, a wrong
    formula is off by that much)."""
    gen = torch.Generator().manual_seed(7)
    shapes = [(2048, 6144), (2048, 2048), (300, 260)]
    ps, layers = _params("cuda", shapes, gen)
    tw = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    kw = dict(lr=torch.tensor(1e-3, device="cuda"), betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True,
              capturable=True)
    opt, topt = AdamW(ps, **kw), torch.optim.AdamW(tw, **dict(kw, lr=torch.tensor(1e-3, device="cuda")))
    eps32 = torch.finfo(torch.float32).eps
    for step in range(3):
        _grads(ps, gen)
        if step:  # each step from the same state: the bounds are of one step's roundings, not of drift
            with torch.no_grad():
                for p, t in zip(ps, tw):
                    p.copy_(t)
                    for k in ("exp_avg", "exp_avg_sq"):
                        opt.state[p][k].copy_(topt.state[t][k])
        old = [t.detach().clone() for t in tw]
        old_m = [topt.state[t]["exp_avg"].clone() if t in topt.state else torch.zeros_like(t) for t in tw]
        for p, t in zip(ps, tw):
            t.grad = p.grad.clone()
        for o in (opt, topt):
            o.grad_scale, o.found_inf = torch.tensor(1.3, device="cuda"), torch.zeros((), device="cuda")
            o.step()
            del o.grad_scale, o.found_inf
        for p, t, o, om in zip(ps, tw, old, old_m):
            d = (p.detach() - t.detach()).abs()
            assert bool((d <= 2.0**-18 * torch.clamp(o.abs(), min=1e-3)).all()), float(d.max())
            # exp_avg = 0.9 m + 0.1 g/1.3 may cancel: bound by the size of its terms; exp_avg_sq is a sum of positives
            m_scale = 0.9 * om.abs() + 0.1 * p.grad.abs() / 1.3
            v = topt.state[t]["exp_avg_sq"]
            for k, scale in (("exp_avg", m_scale), ("exp_avg_sq", v)):
                a, b = opt.state[p][k], topt.state[t][k]
                assert bool(((a - b).abs() <= 8 * eps32 * scale).all()), (k, float((a - b).abs().max()))
        for p, layer in zip(ps, layers):
            _check_copies(p, layer)


@pytest.mark.gpu
def test_forward_takes_the_copies_gpu():
    """A lowbit model under fp8-block with lowbit.optim.AdamW: the forwards after the first step take the optimizer's
    copies (no weight quantization), and they compute exactly what quantizing the weight would (the same forward
    with the copies made stale by a version bump)."""
    import lowbit.nn as lnn
    from lowbit.recipes import from_name

    recipe = from_name("fp8-block")
    torch.manual_seed(0)
    model = torch.nn.Sequential(lnn.Linear(256, 384), lnn.Linear(384, 256)).cuda()
    lnn.name_modules(model)
    opt = AdamW(model.parameters(), lr=1e-3, fused=True)
    x = torch.randn(256, 256, device="cuda")
    gemms = [g for m in model for g in m._gemms.values()]
    for step in range(4):
        uses = sum(g.fresh_uses for g in gemms)
        with lnn.autocast(recipe=recipe):
            y = model(x)
        assert sum(g.fresh_uses for g in gemms) - uses == (2 if step else 0)
        if step:
            with torch.no_grad(), lnn.autocast(recipe=recipe):
                for g in gemms:
                    g.fresh.version = -1  # stale: the forward quantizes the weights itself
                y2 = model(x)
                for m, g in zip(model, gemms):
                    g.fresh.mark(m.weight)
            assert torch.equal(y.detach(), y2)
        y.float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert opt.fused_tensors == 2


def test_kernel_compiles_for_sm90():
    """The kernel compiles for Hopper (sm_90) on any machine (Triton's own toolchain) as the launcher builds it: IEEE
    division and square root (no approximate forms), no FP32 FMA contraction (enable_fp_fusion=False), 16-byte loads
    of the FP32 tensors (the update's through cp.async where its loop is pipelined); under Triton 3.6 (the GPU
    machine's) at most 128 registers at the default config, no spills."""
    pytest.importorskip("triton")
    import inspect
    import re

    import triton
    from sm90_compile import sm90_sass
    from triton.backends.compiler import GPUTarget

    from lowbit.optim import kernels as K
    from lowbit.optim.adamw import KernelConfig

    fn = K.adamw_fp8_128x128_kernel
    ptrs = dict(tab_ptr="*i64", lr_ptr="*fp32", gs_ptr="*fp32", fi_ptr="*fp32")
    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: ptrs.get(n) or ("constexpr" if "constexpr" in str(p.annotation) else "i64" if n.endswith("_bits")
                              else "i32")
           for n, p in inspect.signature(fn.fn).parameters.items()}
    kc = KernelConfig()
    ch, ch2, warps, ns = kc.rows_update, kc.rows_cast, kc.num_warps, kc.stages
    const = dict(FMAX=448.0, EMIN=-6, MBITS=3, POW2=True, EPS=0.0, SW=False, E5M2=False, ADAM=True, LR_PTR=True,
                 HAS_GS=True, HAS_FI=True, WD=True, CH=ch, CH2=ch2, EVEN=True, NS=ns)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n].startswith("*") or n in ("M", "K", "rs_ld", "cs_ld")}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    try:
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, enable_fp_fusion=False))
    except RuntimeError as e:
        if "ptxas" in str(e).lower():
            pytest.skip(f"no ptxas: {e}")
        raise
    ptx = k.asm["ptx"]
    assert "div.rn.f32" in ptx and "sqrt.rn.f32" in ptx and "sqrt.rn.f64" in ptx
    assert "div.full.f32" not in ptx and "div.approx.f32" not in ptx and "sqrt.approx" not in ptx
    assert "fma.rn.f32" not in ptx
    if ns > 1:  # the update loop pipelined: p, g, exp_avg, exp_avg_sq copied to shared memory 16 bytes at a time
        # (Triton 3.6 writes 12 such instructions at the default config, 3.9 three)
        assert len(re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^]]+\], \[[^]]+\], 0x10", ptx)) >= 3
        assert len(re.findall(r"ld\.global\S*\.v4\.b32", ptx)) >= 4  # p again, for the cast
    else:
        assert len(re.findall(r"ld\.global\S*\.v4\.b32", ptx)) >= 8  # p (update and cast), g, exp_avg, exp_avg_sq
    got = sm90_sass(k, "3.6")
    if got is not None:
        assert "STL" not in got[0] and "LDL" not in got[0]
        assert got[1] <= 128, f"{got[1]} registers"


def test_weight_registry_keeps_no_model_alive():
    """The weight -> layer record an optimizer reads (what an fp8-block forward makes for an FP32 CUDA weight) holds
    neither: while the module lives, the record gives its layer; once the module is dropped, the module, its layer
    and its weight are freed (a strong reference to the layer kept every such model alive for the whole process)."""
    import gc
    import weakref

    import lowbit.nn as lnn
    from lowbit.nn.functional import weight_layer

    lin = lnn.Linear(256, 128)
    layer = next(iter(lin._gemms.values()))
    record_weight_layer(lin.weight, layer, SCH)
    assert weight_layer(lin.weight) == (layer, SCH)
    refs = [weakref.ref(o) for o in (lin, layer, lin.weight)]
    del lin, layer
    gc.collect()
    assert [r() is None for r in refs] == [True, True, True]
