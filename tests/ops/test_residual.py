"""The fused residual add (lowbit.ops.residual): kernel against its reference (the sum bit for bit, rstd against FP64),
every launch candidate, autograd, bad input; the GPT's blocks handing the statistics to the next fused norm; the
fused backward of residual add + the next RMSNorm (NormGradLink) against its FP64 reference and against autograd of
the unfused composition. On the CPU under Triton's interpreter in a child process."""
import contextlib
import importlib
import os

import pytest
import torch
from interp_helper import run_interpreted

import lowbit
from lowbit import recipes
from lowbit.runtime import env
from lowbit.runtime.autotune import forget_tuned

R = importlib.import_module("lowbit.ops.residual")
NQ = importlib.import_module("lowbit.ops.norm_quant")

SHAPES = [(3, 7, 256), (130, 200), (1, 128), (64, 2048)]


def check_kernel(device, shapes=SHAPES):
    """out bit-identical to x + y; rstd within 4 FP32 ulps of FP64; dx = g, dy = g in y's dtype."""
    for i, shape in enumerate(shapes):
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            g = torch.Generator().manual_seed(i)
            x = (torch.randn(*shape, generator=g) * 3).to(device)
            y = torch.randn(*shape, generator=g).to(device, dt)
            assert R.residual_add_supported(x, y), (shape, dt)
            out = R.residual_add(x, y)
            assert out.dtype == torch.float32 and torch.equal(out, x + y), (shape, dt)
            xx, yy = x.clone().requires_grad_(), y.clone().requires_grad_()
            out2, rstd = R.residual_add(xx, yy, rms_eps=1e-5)
            assert torch.equal(out2.detach(), out) and not rstd.requires_grad
            r64 = NQ.rmsnorm_rstd_reference(out.cpu(), 1e-5)
            ulps = ((rstd.cpu() - r64).abs() / torch.finfo(torch.float32).eps / r64).max()
            assert ulps <= 4, (shape, dt, float(ulps))
            go = torch.randn(*shape, generator=g).to(device)
            out2.backward(go)
            assert torch.equal(xx.grad, go) and yy.grad.dtype == dt and torch.equal(yy.grad, go.to(dt))
    print("ok")


def check_every_candidate(device):

    orig = R.row_reduce_configs
    try:
        for cfg in orig(2048):
            R.row_reduce_configs = lambda K, cfg=cfg: [cfg]
            forget_tuned()
            check_kernel(device, [(130, 200), (64, 2048), (3, 1000)])
    finally:
        R.row_reduce_configs = orig
        forget_tuned()
    print("ok")


def check_gpt(device):
    """A GPT under fp8-block: with the fused residual the blocks hand the next fused norm its statistics (each
    LayerNormLinear / LayerNormMLP after the first gets an input_rstd) and the loss and gradients match the run
    without the fused residual (the norms then compute rstd themselves: the same FP32 sums, maybe in another order)."""
    from lowbit.models import GPT, config_from_preset

    torch.manual_seed(0)
    m = GPT(config_from_preset("tiny", n_layer=3)).to(device)
    idx = torch.randint(0, 256, (2, 33), device=device)
    seen = []
    hooks = [mod.register_forward_pre_hook(lambda mod, a, kw: seen.append(kw.get("input_rstd") is not None),
                                           with_kwargs=True)
             for mod in m.modules() if isinstance(mod, (lowbit.nn.LayerNormLinear, lowbit.nn.LayerNormMLP))]
    res = []
    for fused in (True, False):
        seen.clear()
        m.zero_grad()
        with env.override(LOWBIT_UNFUSE="" if fused else "residual"):
            with lowbit.autocast(recipe=recipes.Float8BlockScaling()):
                _, loss = m(idx[:, :-1], idx[:, 1:])
            loss.backward()
        res.append((loss.detach(), [p.grad.clone() for p in m.parameters()], list(seen)))
    for h in hooks:
        h.remove()
    # qkv of block 0 computes its own; then mlp, qkv, mlp, qkv, mlp get statistics from the residual adds
    assert res[0][2] == [False, True, True, True, True, True], res[0][2]
    assert not any(res[1][2])
    # (an rstd one ulp apart can tip an FP8 rounding here and there: compare the loss and each gradient as a whole)
    torch.testing.assert_close(res[0][0], res[1][0], rtol=1e-4, atol=0)
    for a, b in zip(res[0][1], res[1][1]):
        assert float((a - b).norm() / b.norm()) < 1e-3, float((a - b).norm() / b.norm())
    print("ok")


EPS32 = torch.finfo(torch.float32).eps
BWD_SHAPES = [(1, 64), (17, 200), (130, 1000), (3, 5, 2048)]


def check_norm_backward(device, shapes=BWD_SHAPES):
    """norm_residual_backward against its FP64 reference: dx within 64 FP32 ulps of each term's size (the terms are
    single roundings and per-row sums of K products), dy bit for bit dx rounded to y's dtype, dw within (M + 64)
    ulps of sum|dn·x̂| (a sequential FP32 sum over at most M rows)."""
    for i, shape in enumerate(shapes):
        K = shape[-1]
        for dn_dt, y_dt, has_g in ((torch.float32, torch.bfloat16, True), (torch.bfloat16, torch.bfloat16, True),
                                   (torch.float16, torch.float32, False), (torch.float32, torch.float16, True)):
            g_ = torch.Generator().manual_seed(100 + i)
            out = (torch.randn(*shape, generator=g_) * 2 + 0.5).to(device)
            w = (torch.rand(K, generator=g_) + 0.5).to(device)
            dn = torch.randn(*shape, generator=g_).to(device, dn_dt)
            g = torch.randn(*shape, generator=g_).to(device) if has_g else None
            rstd = NQ.rmsnorm_rstd_reference(out.cpu(), 1e-5).to(device)
            dx, dy, dw = R.norm_residual_backward(g, dn, out, rstd, w, y_dt)
            rdx, rdy, rdw = R.norm_residual_backward_reference(g, dn, out, rstd, w, y_dt)
            assert dx.dtype == torch.float32 and dy.dtype == y_dt and dx.shape == out.shape and dy.shape == out.shape
            if os.environ.get("TRITON_INTERPRET") == "1":  # (the interpreter's float -> 16-bit cast truncates)
                assert bool(((dy.float() - dx).abs() <= dx.abs() * torch.finfo(y_dt).eps).all()), (shape, dn_dt, y_dt)
            else:
                assert torch.equal(dy, dx.to(y_dt)), (shape, dn_dt, y_dt)
            r = rstd.double().reshape(-1, 1).cpu()
            xh = out.double().reshape(-1, K).cpu() * r
            gw = dn.double().reshape(-1, K).cpu() * w.double().cpu()
            size = r * (gw.abs() + xh.abs() * (gw * xh).abs().mean(dim=1, keepdim=True))
            if g is not None:
                size = size + g.double().reshape(-1, K).cpu().abs()
            err = (dx.double().cpu() - rdx.double().cpu()).reshape(-1, K).abs()
            assert bool((err <= 64 * EPS32 * size).all()), (shape, dn_dt, float((err / size).max() / EPS32))
            M = out.numel() // K
            dsize = (dn.double().reshape(-1, K).cpu() * xh).abs().sum(0)
            derr = (dw.double().cpu() - rdw.double().cpu()).abs()
            assert dw.shape == (K,) and bool((derr <= (M + 64) * EPS32 * dsize).all()), (shape,
                                                                                         float((derr / dsize).max()))
            assert R.norm_residual_backward(g, dn, out, rstd, w, y_dt, need_dw=False)[2] is None
    print("ok")


def check_linked_autograd(device, recipe=None):
    """Autograd through residual_add(..., norm_weight=) + the linked norm (rms_norm_linked, or LayerNormLinear /
    LayerNormMLP under ``recipe``) against the same graph without the link: the forward bit for bit, the gradients of
    x, y and the norm weight to FP32 rounding of the reductions (the link must have been used)."""
    torch.manual_seed(0)
    B, T, C = 2, 65, 256
    x0 = torch.randn(B, T, C, device=device) * 2
    y0 = torch.randn(B, T, C, device=device).bfloat16()
    lin = lowbit.nn.LayerNormLinear(C, 128, normalization="RMSNorm", eps=1e-5).to(device)
    mlp = lowbit.nn.LayerNormMLP(C, 256, normalization="RMSNorm", activation="swiglu", eps=1e-5).to(device)
    with torch.no_grad():
        lin.layer_norm_weight.uniform_(0.5, 1.5)
        mlp.layer_norm_weight.copy_(lin.layer_norm_weight)
    used = []
    take = R.NormGradLink.take

    def spy(self):
        p = take(self)
        used.append(p is not None)
        return p

    R.NormGradLink.take = spy
    try:
        res = []
        for linked in (True, False):
            for mod in (lin, mlp):
                x, y = x0.clone().requires_grad_(), y0.clone().requires_grad_()
                mod.zero_grad()
                with lowbit.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext():
                    if linked:
                        out, rstd, link = R.residual_add(x, y, rms_eps=mod.eps, norm_weight=mod.layer_norm_weight)
                        assert link is not None
                        o = mod(out, input_rstd=rstd if mod.fuses_norm(out) else None, input_norm_link=link)
                    else:
                        out = R.residual_add(x, y)
                        o = mod(out)
                    loss = (o.float() * torch.linspace(-1, 1, o.shape[-1], device=device)).sum() + (out * 0.01).sum()
                loss.backward()
                res.append((o.detach(), x.grad, y.grad, mod.layer_norm_weight.grad.clone()))
    finally:
        R.NormGradLink.take = take
    assert used[:2] == [True, True] and not any(used[2:]), used
    for a, b in zip(res[:2], res[2:]):
        assert torch.equal(a[0], b[0])
        for u, v in (a[1], b[1]), (a[3], b[3]):  # x's and the norm weight's gradients, FP32
            rel = float((u.double() - v.double()).norm() / v.double().norm())
            assert rel < 2e-5, rel
        # y's: the same FP32 value to rounding, then rounded to BF16: at most one BF16 step apart (two where the
        # interpreter truncates instead of rounding)
        assert a[2].dtype == torch.bfloat16
        steps = 2 if os.environ.get("TRITON_INTERPRET") == "1" else 1
        assert bool(((a[2].float() - b[2].float()).abs() <= steps * b[2].float().abs() * 2 ** -7 + 1e-30).all())
    print("ok")


def check_norm_input_link(device):
    """norm_input_link (the norm's backward at its input's node, for a norm no linked add feeds): against the
    residual add's link on the same sum, x's and the norm weight's gradients bit for bit (the same kernel on the
    same operands; y's on CUDA too, the interpreter truncating its cast); against no link, the same output and the
    gradients to FP32 rounding; under fp8-block (the norm inside the quantizer) and autocast off (torch's norm)."""
    torch.manual_seed(0)
    B, T, C = 2, 65, 256
    x0 = torch.randn(B, T, C, device=device) * 2
    y0 = torch.randn(B, T, C, device=device).bfloat16()
    lin = lowbit.nn.LayerNormLinear(C, 128, normalization="RMSNorm", eps=1e-5).to(device)
    with torch.no_grad():
        lin.layer_norm_weight.uniform_(0.5, 1.5)
    for recipe in (recipes.Float8BlockScaling(), None):
        res = {}
        for how in ("add", "input", "none"):
            x, y = x0.clone().requires_grad_(), y0.clone().requires_grad_()
            lin.zero_grad()
            with lowbit.autocast(enabled=recipe is not None, recipe=recipe or recipes.Float8BlockScaling()):
                if how == "add":
                    out, rstd, link = R.residual_add(x, y, rms_eps=lin.eps, norm_weight=lin.layer_norm_weight)
                else:
                    out, rstd = R.residual_add(x, y, rms_eps=lin.eps)
                    link = None
                    if how == "input":
                        out, link = R.norm_input_link(out, lin.layer_norm_weight, lin.eps, rstd)
                assert (link is None) == (how == "none")
                o = lin(out, input_rstd=rstd if lin.fuses_norm(out) else None, input_norm_link=link)
                loss = (o.float() * torch.linspace(-1, 1, o.shape[-1], device=device)).sum() + (out * 0.01).sum()
            loss.backward()
            assert link is None or link.take() is None  # (taken by the backward)
            res[how] = (o.detach(), x.grad, y.grad, lin.layer_norm_weight.grad.clone())
        a, i, n = res["add"], res["input"], res["none"]
        assert torch.equal(a[0], i[0]) and torch.equal(a[0], n[0])
        assert torch.equal(a[1], i[1]) and torch.equal(a[3], i[3]), recipe
        if device != "cpu":
            assert torch.equal(a[2], i[2])
        for u, v in (i[1], n[1]), (i[3], n[3]):
            rel = float((u.double() - v.double()).norm() / v.double().norm())
            assert rel < 2e-5, rel
    # where the fused backward does not run: no link, x as it was
    x = x0.clone().requires_grad_()
    with env.override(LOWBIT_UNFUSE="norm_backward"):
        assert R.norm_input_link(x, lin.layer_norm_weight, 1e-5) == (x, None)
    with torch.no_grad():
        assert R.norm_input_link(x, lin.layer_norm_weight, 1e-5) == (x, None)
    with pytest.raises(ValueError, match="rms_eps: expected a float > 0, got 0"):
        R.norm_input_link(x, lin.layer_norm_weight, 0)
    with pytest.raises(ValueError, match=r"norm_weight: expected a float32 tensor of shape \(256,\)"):
        R.norm_input_link(x, lin.layer_norm_weight[:8], 1e-5)
    with pytest.raises(TypeError, match="x, norm_weight: expected tensors"):
        R.norm_input_link(x, None, 1e-5)
    print("ok")


def check_norm_backward_candidates(device):

    orig = R._bwd_configs
    try:
        for cfg in orig(2048):
            R._bwd_configs = lambda K, cfg=cfg: [dict(cfg, BLOCK_K=max(16, R.triton.next_power_of_2(K)))]
            forget_tuned()
            check_norm_backward(device, [(130, 1000), (1000, 2048)])
    finally:
        R._bwd_configs = orig
        forget_tuned()
    print("ok")


def check_column_sum(device):
    """column_sum against an FP64 sum: within R FP32 ulps of sum|p| per column (a sequential FP32 sum over R rows,
    in another order), on odd shapes (partial row and column blocks) and the norm backward's own sizes."""
    for i, (rows, cols) in enumerate([(1, 1), (7, 3), (37, 1000), (33, 65), (528, 2048)]):
        p = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(i)) * 3).to(device)
        got = R.column_sum(p)
        ref = p.double().cpu().sum(0)
        tol = rows * EPS32 * p.double().abs().cpu().sum(0) + 1e-30
        assert got.dtype == torch.float32 and got.shape == (cols,) and got.device == p.device
        assert bool(((got.double().cpu() - ref).abs() <= tol).all()), (rows, cols)
    with pytest.raises(ValueError, match="p: expected a contiguous 2-D float32 tensor"):
        R.column_sum(torch.ones(4, 4, device=device).t())
    with pytest.raises(ValueError, match="p: expected a contiguous 2-D float32 tensor"):
        R.column_sum(torch.ones(4, 4, device=device, dtype=torch.float64))
    print("ok")


def test_column_sum_interpreter_subprocess():
    pytest.importorskip("triton")
    run_interpreted(__file__, "check_column_sum('cpu')")


def test_column_sum_cpu():
    check_column_sum("cpu")


@pytest.mark.gpu
def test_column_sum_gpu(cuda):
    check_column_sum(cuda)


def test_norm_backward_interpreter_subprocess():
    pytest.importorskip("triton")
    run_interpreted(__file__, "check_norm_backward('cpu')")


def test_norm_input_link_interpreter_subprocess():
    pytest.importorskip("triton")
    run_interpreted(__file__, "check_norm_input_link('cpu')")


@pytest.mark.gpu
def test_norm_input_link_gpu(cuda):
    check_norm_input_link(cuda)


def check_one_tuning(device):
    """The residual add's fused backward (dy stored in y's dtype) and the norm input's (dx only, y float32) take one
    launch key, so one tuning serves both (a tuning compiles and times every candidate). On CUDA, with tuning on: one
    tuned config after both calls."""
    from lowbit.runtime.autotune import tuned_configs

    keys, real = [], R.tuned_launch

    def spy(name, key, candidates, launch):
        keys.append((name, key))
        return real(name, key, candidates, launch)

    forget_tuned("norm_residual_bwd")
    R.tuned_launch = spy
    tuning = env.override(LOWBIT_AUTOTUNE="1")
    tuning.__enter__()
    try:
        g = torch.Generator().manual_seed(3)
        out = torch.randn(300, 512, generator=g).to(device)
        dn, gx = torch.randn(300, 512, generator=g).to(device, torch.bfloat16), torch.randn(300, 512).to(device)
        w = torch.randn(512, generator=g).to(device)
        rstd = NQ.rmsnorm_rstd_reference(out, 1e-5).float()
        for y_dtype in (torch.bfloat16, torch.float32):
            dx, dy, dw = R.norm_residual_backward(gx, dn, out, rstd, w, y_dtype)
            ref = R.norm_residual_backward_reference(gx, dn, out, rstd, w, y_dtype)
            assert dy.dtype == y_dtype and torch.allclose(dx, ref[0].to(device), rtol=1e-5, atol=1e-5)
    finally:
        R.tuned_launch = real
        tuning.__exit__(None, None, None)
    assert len(keys) == 2 and keys[0] == keys[1], keys
    if out.is_cuda:
        assert len(tuned_configs("norm_residual_bwd")) == 1, tuned_configs("norm_residual_bwd")
    print("ok")


def test_one_tuning_interpreter_subprocess():
    pytest.importorskip("triton")
    run_interpreted(__file__, "check_one_tuning('cpu')")


@pytest.mark.gpu
def test_one_tuning_gpu(cuda):
    check_one_tuning(cuda)


def test_norm_input_link_without_kernel_cpu():
    """On the CPU (no interpreter) the fused backward does not run: no link, the tensor returned as it was."""
    x = torch.randn(3, 256, requires_grad=True)
    assert R.norm_input_link(x, torch.ones(256), 1e-5) == (x, None)


def test_linked_autograd_interpreter_subprocess():
    pytest.importorskip("triton")
    run_interpreted(__file__, "check_linked_autograd('cpu')")


@pytest.mark.gpu
def test_norm_backward_gpu(cuda):
    check_norm_backward(cuda, BWD_SHAPES + [(8192, 2048), (4, 1000, 4096)])
    check_norm_backward_candidates(cuda)


@pytest.mark.gpu
def test_linked_autograd_gpu(cuda):
    check_linked_autograd(cuda)
    check_linked_autograd(cuda, recipes.Float8BlockScaling())


@pytest.mark.gpu
def test_norm_backward_against_torch_gpu(cuda):
    """The kernel against what autograd ran before: torch's fused RMSNorm backward + the add + the cast."""
    torch.manual_seed(1)
    M, K = 8192, 2048
    out, dn, g = torch.randn(M, K, device=cuda), torch.randn(M, K, device=cuda), torch.randn(M, K, device=cuda)
    w = torch.rand(K, device=cuda) + 0.5
    _, rstd = torch.ops.aten._fused_rms_norm(out, [K], w, 1e-5)
    tdx, tdw = torch.ops.aten._fused_rms_norm_backward(dn, out, [K], rstd, w, [True, True])
    dx, dy, dw = R.norm_residual_backward(g, dn, out, rstd.reshape(-1), w, torch.bfloat16)
    torch.testing.assert_close(dx, tdx + g, rtol=1e-5, atol=1e-5)
    assert float((dw - tdw).norm() / tdw.norm()) < 1e-5


def check_gpt_linked(device):
    """A GPT with the norms' backward fused into the residual adds (not in LOWBIT_UNFUSE, the default)
    against without: the same loss bit for bit (the forward does not change), every gradient to FP32 rounding; under
    fp8-block (norm inside the quantizer) and with lowbit's autocast off (torch's RMSNorm forward). Every norm hands
    its gradient over (6 of 6 in 3 blocks: the first block's at its input, norm_input_link)."""
    from lowbit.models import GPT, config_from_preset

    torch.manual_seed(0)
    m = GPT(config_from_preset("tiny", n_layer=3)).to(device)
    idx = torch.randint(0, 256, (2, 65), device=device)
    take = R.NormGradLink.take
    for recipe in (recipes.Float8BlockScaling(), None):
        res = []
        for on in ("1", "0"):
            used = []
            R.NormGradLink.take = lambda self: (used.append(1), take(self))[1]
            unfuse = env.override(LOWBIT_UNFUSE="" if on == "1" else "norm_backward")
            unfuse.__enter__()
            try:
                m.zero_grad()
                with lowbit.autocast(enabled=recipe is not None, recipe=recipe or recipes.Float8BlockScaling()):
                    _, loss = m(idx[:, :-1], idx[:, 1:])
                loss.backward()
            finally:
                R.NormGradLink.take = take
                unfuse.__exit__(None, None, None)
            res.append((loss.detach(), [p.grad.clone() for p in m.parameters()], len(used)))
        assert res[0][2] == 6 and res[1][2] == 0, (res[0][2], res[1][2])
        assert torch.equal(res[0][0], res[1][0])
        for a, b in zip(res[0][1], res[1][1]):
            rel = float((a - b).norm() / b.norm())
            assert rel < (1e-3 if recipe is not None else 1e-5), rel  # (FP8: a last-bit change can tip a rounding)
    print("ok")


def test_gpt_linked_interpreter_subprocess():
    pytest.importorskip("triton")
    run_interpreted(__file__, "check_gpt_linked('cpu')", 1200)


@pytest.mark.gpu
def test_gpt_linked_gpu(cuda):
    check_gpt_linked(cuda)


def test_kernel_interpreter_subprocess():
    pytest.importorskip("triton")
    run_interpreted(__file__, "check_kernel('cpu')")


def test_gpt_interpreter_subprocess():
    pytest.importorskip("triton")
    run_interpreted(__file__, "check_gpt('cpu')", 1200)


@pytest.mark.gpu
def test_kernel_gpu(cuda):
    check_kernel(cuda, SHAPES + [(8192, 2048)])


@pytest.mark.gpu
def test_every_candidate_gpu(cuda):
    check_every_candidate(cuda)


@pytest.mark.gpu
def test_gpt_gpu(cuda):
    check_gpt(cuda)


def test_norm_backward_torch_path():
    """Without the kernel (a CPU tensor outside the interpreter, or rows wider than NORM_BACKWARD_MAX_K) the same
    math in torch ops, against the FP64 reference."""
    torch.manual_seed(3)
    out, dn, g = torch.randn(7, 300) * 2, torch.randn(7, 300).bfloat16(), torch.randn(7, 300)
    w, rstd = torch.rand(300) + 0.5, NQ.rmsnorm_rstd_reference(out, 1e-5)
    dx, dy, dw = R._norm_residual_backward_torch(g, dn, out, rstd, w, torch.bfloat16, True)
    rdx, _, rdw = R.norm_residual_backward_reference(g, dn, out, rstd, w, torch.bfloat16)
    torch.testing.assert_close(dx, rdx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw, rdw, rtol=1e-5, atol=1e-5)
    assert torch.equal(dy, dx.to(torch.bfloat16))


def test_fallback_and_bad_input(monkeypatch):
    x, y = torch.randn(5, 64), torch.randn(5, 64).bfloat16()
    if os.environ.get("TRITON_INTERPRET") != "1":  # a CPU tensor without the interpreter: torch's add
        assert not R.residual_add_supported(x, y)
        out, rstd = R.residual_add(x, y, rms_eps=1e-5)
        assert torch.equal(out, x + y) and rstd is None  # (the norm then computes its own)
        assert torch.equal(R.residual_add_reference(x, y, 1e-5)[1], NQ.rmsnorm_rstd_reference(x + y, 1e-5))
    monkeypatch.setattr(R, "INTERPRET", True)
    if R.triton is not None:
        assert R.residual_add_supported(x, y)
    assert not R.residual_add_supported(x.bfloat16(), y)  # the stream must be FP32
    assert not R.residual_add_supported(x, y[:, :32])
    assert not R.residual_add_supported(x, y.t().contiguous().t())  # not contiguous
    assert not R.residual_add_supported(x, y.to(torch.int32))
    with env.override(LOWBIT_UNFUSE="residual"):
        assert not R.residual_add_supported(x, y)
    for bad in (0.0, -1.0, True, "1e-5"):
        with pytest.raises(ValueError, match="rms_eps"):
            R.residual_add(x, y, rms_eps=bad)
    m = lowbit.nn.LayerNormLinear(64, 32, normalization="RMSNorm")
    with pytest.raises(ValueError, match=r"input_rstd: expected None or a float32 tensor of shape \(5,\)"):
        m(x, input_rstd=torch.ones(4))
    with pytest.raises(ValueError, match="norm_weight: needs rms_eps"):
        R.residual_add(x, y, norm_weight=m.layer_norm_weight)
    with pytest.raises(ValueError, match=r"norm_weight: expected a float32 tensor of shape \(64,\)"):
        R.residual_add(x, y, rms_eps=1e-5, norm_weight=torch.ones(32))
    with pytest.raises(TypeError, match="input_norm_link: expected None or a lowbit.ops.residual.NormGradLink"):
        m(x, input_norm_link="link")
    link = R.NormGradLink(m.layer_norm_weight, m.eps)
    link.out_key = (x.data_ptr() + 4, tuple(x.shape), x.dtype)
    with pytest.raises(ValueError, match="input_norm_link: made by residual_add for another tensor"):
        m(x, input_norm_link=link)
    link.out_key = (x.data_ptr(), tuple(x.shape), x.dtype)
    with pytest.raises(ValueError, match="input_norm_link: made for another norm"):
        lowbit.nn.LayerNormLinear(64, 32, normalization="RMSNorm", eps=1e-6)(x, input_norm_link=link)
    with pytest.raises(ValueError, match="input_norm_link: links an RMSNorm's backward"):
        lowbit.nn.LayerNormLinear(64, 32, normalization="LayerNorm")(x, input_norm_link=link)
    link.put(torch.ones(5, 64), torch.ones(5))
    with pytest.raises(RuntimeError, match="a second norm-output gradient"):
        link.put(torch.ones(5, 64), torch.ones(5))
    with pytest.raises(ValueError, match=r"dn: expected .* of shape \(5, 64\)"):
        R.norm_residual_backward(None, torch.ones(5, 32), x, torch.ones(5), torch.ones(64), torch.bfloat16)
    with pytest.raises(ValueError, match=r"rstd: expected float32 with 5 elements"):
        R.norm_residual_backward(None, torch.ones(5, 64), x, torch.ones(4), torch.ones(64), torch.bfloat16)
