"""The fused residual add (lowbit.ops.residual): kernel against its reference (the sum bit for bit, rstd against FP64),
every launch candidate, autograd, bad input; the GPT's blocks handing the statistics to the next fused norm. On the
CPU under Triton's interpreter in a child process."""
import importlib
import os

import pytest
import torch
from interp_helper import run_interpreted

import lowbit
from lowbit import recipes

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
    from lowbit.quant import triton_backend as tb

    orig = R.row_reduce_configs
    try:
        for cfg in orig(2048):
            R.row_reduce_configs = lambda K, cfg=cfg: [cfg]
            tb._TUNED.clear()
            check_kernel(device, [(130, 200), (64, 2048), (3, 1000)])
    finally:
        R.row_reduce_configs = orig
        tb._TUNED.clear()
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
    hooks = [mod.register_forward_pre_hook(lambda mod, a, kw: seen.append(kw.get("input_rstd") is not None), with_kwargs=True)
             for mod in m.modules() if isinstance(mod, (lowbit.nn.LayerNormLinear, lowbit.nn.LayerNormMLP))]
    res = []
    for fused in (True, False):
        os.environ["LOWBIT_FUSED_RESIDUAL"] = "1" if fused else "0"
        seen.clear()
        m.zero_grad()
        with lowbit.autocast(recipe=recipes.Float8BlockScaling()):
            _, loss = m(idx[:, :-1], idx[:, 1:])
        loss.backward()
        res.append((loss.detach(), [p.grad.clone() for p in m.parameters()], list(seen)))
    os.environ.pop("LOWBIT_FUSED_RESIDUAL", None)
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
    monkeypatch.setenv("LOWBIT_FUSED_RESIDUAL", "0")
    assert not R.residual_add_supported(x, y)
    for bad in (0.0, -1.0, True, "1e-5"):
        with pytest.raises(ValueError, match="rms_eps"):
            R.residual_add(x, y, rms_eps=bad)
    m = lowbit.nn.LayerNormLinear(64, 32, normalization="RMSNorm")
    with pytest.raises(ValueError, match=r"input_rstd: expected None or a float32 tensor of shape \(5,\)"):
        m(x, input_rstd=torch.ones(4))
