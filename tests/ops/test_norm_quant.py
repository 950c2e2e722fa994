"""RMSNorm fused with 1x128 FP8 quantization (lowbit.ops.norm_quant): the kernel against its reference (bit for bit
given the kernel's rstd; rstd against FP64), every launch candidate, bad input; LayerNormLinear / LayerNormMLP with
the fusion against the same modules without it. On the CPU under Triton's interpreter in a child process."""
import importlib
import os
import sys

import pytest
import torch
from interp_helper import run_interpreted

import lowbit
from lowbit import recipes
from lowbit.quant.schemes import Float8Blockwise, Float8Tensorwise
from lowbit.runtime import env
from lowbit.runtime.autotune import forget_tuned

NQ = importlib.import_module("lowbit.ops.norm_quant")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from test_quant_kernels import mismatches  # noqa: E402

COPIES = [(True, True), (True, False), (False, True)]
# ragged rows and columns (masks), whole 128 x 128 tiles (EVEN), leading dims, one row
KERNEL_SHAPES = [(200, 384), (130, 200), (3, 5, 256), (1, 128), (256, 256)]


def _inputs(shape, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.exp(torch.randn(shape[-1], generator=g))  # per-channel spread
    x.view(-1, shape[-1])[0, :3] = 0.0
    w = torch.randn(shape[-1], generator=g) * 0.5 + 1.0
    return x.to(device), w.to(device)


def check_kernel(device, shapes=KERNEL_SHAPES, schemes=(Float8Blockwise(), Float8Blockwise(fmt="e5m2", pow2=False))):
    """Copies, scales, amax bit-identical to rmsnorm_quantize_reference with the kernel's rstd; rstd within 4 FP32
    ulps of the FP64 value (an FP32 sum of K squares, then IEEE sqrt and division)."""
    for i, shape in enumerate(shapes):
        x, w = _inputs(shape, device, seed=i)
        for sch in schemes:
            for rw, cw in COPIES:
                q, rstd = NQ.rmsnorm_quantize_1x128(x, w, 1e-5, sch, rowwise=rw, columnwise=cw)
                assert q.shape == x.shape and q.dtype == torch.float32 and rstd.shape == (x.numel() // shape[-1],)
                ref = NQ.rmsnorm_quantize_reference(x.cpu(), w.cpu(), rstd.cpu(), sch, rowwise=rw, columnwise=cw)
                bad = mismatches(ref, q)
                assert not bad, (shape, sch, rw, cw, bad)
                r64 = NQ.rmsnorm_rstd_reference(x.cpu(), 1e-5)
                ulps = ((rstd.cpu() - r64).abs() / torch.finfo(torch.float32).eps / r64).max()
                assert ulps <= 4, (shape, float(ulps))
    print("ok")


def check_every_candidate(device):
    """Each quantize and rstd launch config the autotuner may pick, forced alone: the slab walk's, and on a GPU with
    Gluon the register-tile kernel's (both copies of whole tiles only)."""
    from lowbit.quant import triton_backend as tb

    qc, rc, regs = NQ._quant_configs, NQ.row_reduce_configs, NQ.REGS_CONFIGS
    try:
        NQ.REGS_CONFIGS = []
        for rw, cw in COPIES:
            for cfg in qc(rw, cw):
                NQ._quant_configs = lambda r, c, cfg=cfg: [cfg]
                forget_tuned()
                check_kernel(device, [(200, 384), (256, 256)], (Float8Blockwise(),))
        if tb.regs_ok(torch.zeros(128, 128, device=device), 128, False, True, True):
            NQ._quant_configs = lambda r, c: []
            for cfg in regs:
                NQ.REGS_CONFIGS = [cfg]
                forget_tuned()
                for shape in ((256, 256), (384, 1024), (3, 128, 256)):
                    x, w = _inputs(shape, device, seed=7)
                    q, rstd = NQ.rmsnorm_quantize_1x128(x, w, 1e-5, Float8Blockwise())
                    ref = NQ.rmsnorm_quantize_reference(x.cpu(), w.cpu(), rstd.cpu(), Float8Blockwise())
                    bad = mismatches(ref, q)
                    assert not bad, (shape, cfg, bad)
        NQ.REGS_CONFIGS = regs
        NQ._quant_configs = qc
        for cfg in rc(2048):
            NQ.row_reduce_configs = lambda k, cfg=cfg: [cfg]
            forget_tuned()
            check_kernel(device, [(200, 384), (64, 2048), (3, 1000)], (Float8Blockwise(),))
    finally:
        NQ._quant_configs, NQ.row_reduce_configs, NQ.REGS_CONFIGS = qc, rc, regs
        forget_tuned()
    print("ok")


def test_kernel_interpreter_subprocess():
    pytest.importorskip("triton")
    run_interpreted(__file__, "check_kernel('cpu')")


@pytest.mark.gpu
def test_kernel_gpu(cuda):
    check_kernel(cuda, KERNEL_SHAPES + [(8192, 2048), (1000, 4096)])


@pytest.mark.gpu
def test_every_candidate_gpu(cuda):
    check_every_candidate(cuda)


def test_rstd_configs_fit_every_width(monkeypatch):
    """The rstd kernel's candidates (GPU list) exist for narrow rows too, none wider than the row needs."""
    pytest.importorskip("triton")
    monkeypatch.setattr(NQ, "INTERPRET", False)
    for K in (1, 16, 100, 128, 384, 2048, 5000):
        cands = NQ.row_reduce_configs(K)
        assert cands and len(cands) == len({tuple(sorted(c.items())) for c in cands}), K
        assert all(c["BLOCK"] <= max(16, 1 << (K - 1).bit_length()) for c in cands), K


def test_bad_input_and_fusability(monkeypatch):
    x, w = torch.zeros(4, 256), torch.ones(256)
    monkeypatch.setattr(NQ, "INTERPRET", True)  # past the device check, so each refusal below has its own reason
    if NQ.triton is not None:
        assert NQ.norm_quant_fusable(x, w, Float8Blockwise())
        with pytest.raises(ValueError, match="eps"):
            NQ.rmsnorm_quantize_1x128(x, w, 0.0, Float8Blockwise())
        with pytest.raises(ValueError, match="at least one copy"):
            NQ.rmsnorm_quantize_1x128(x, w, 1e-5, Float8Blockwise(), rowwise=False, columnwise=False)
    assert not NQ.norm_quant_fusable(x, w, Float8Tensorwise())
    assert not NQ.norm_quant_fusable(x, w, Float8Blockwise(block_dim=2))
    assert not NQ.norm_quant_fusable(x.bfloat16(), w, Float8Blockwise())
    assert not NQ.norm_quant_fusable(x, w.bfloat16(), Float8Blockwise())
    assert not NQ.norm_quant_fusable(x, torch.ones(128), Float8Blockwise())
    assert not NQ.norm_quant_fusable(x.t(), torch.ones(4), Float8Blockwise())  # not contiguous
    assert not NQ.norm_quant_fusable(torch.zeros(0, 256), w, Float8Blockwise())
    with env.override(LOWBIT_UNFUSE="norm_quant"):
        assert not NQ.norm_quant_fusable(x, w, Float8Blockwise())
        with pytest.raises(NotImplementedError, match="LOWBIT_UNFUSE has norm_quant"):
            NQ.rmsnorm_quantize_1x128(x, w, 1e-5, Float8Blockwise())
    monkeypatch.undo()
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert not NQ.norm_quant_fusable(x, w, Float8Blockwise())  # a CPU tensor without the interpreter
        with pytest.raises(NotImplementedError, match="1x128 Float8Blockwise"):
            NQ.rmsnorm_quantize_1x128(x, w, 1e-5, Float8Blockwise())


# ---- the modules ------------------------------------------------------------------------------------------------
def _run(m, x, dy, fused: bool):
    """(output, input grad, parameter grads) of m under fp8-block with the fusion on or off, and how many fused
    norm+quantize calls ran."""
    unfuse = env.override(LOWBIT_UNFUSE="" if fused else "norm_quant")
    unfuse.__enter__()
    calls = []
    real = NQ.rmsnorm_quantize_1x128
    NQ.rmsnorm_quantize_1x128 = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        for p in m.parameters():
            p.grad = None
        xx = x.clone().requires_grad_()
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            with lowbit.autocast(recipe=recipes.Float8BlockScaling()):
                y = m(xx)
        y.backward(dy.to(y.dtype))
        return y.detach(), xx.grad, {n: p.grad for n, p in m.named_parameters()}, len(calls)
    finally:
        NQ.rmsnorm_quantize_1x128 = real
        unfuse.__exit__(None, None, None)


def _composed(m, x):
    """LayerNormLinear's output computed the unfused way from the norm output (x·rstd)·w with the fused kernel's
    rstd: the fused forward must equal it bit for bit."""
    from lowbit.nn import state as _ac
    from lowbit.nn.functional import quantized_linear

    _, rstd = NQ.rmsnorm_quantize_1x128(x, m.layer_norm_weight.detach(), m.eps, Float8Blockwise())
    ln = (x.reshape(-1, x.shape[-1]) * rstd[:, None]) * m.layer_norm_weight.detach()
    with torch.autocast(x.device.type, dtype=torch.bfloat16), torch.no_grad():
        with lowbit.autocast(recipe=recipes.Float8BlockScaling()):
            y = quantized_linear(ln.reshape(x.shape), m.weight, m.bias, m._gemms[""], state=_ac.get_state())
    return y


def check_modules(device):
    """Fused vs unfused: LayerNormLinear's forward bit-identical to the composition with the kernel's rstd; every
    gradient (x, norm weight, GEMM weights, biases) of LayerNormLinear and LayerNormMLP (SwiGLU fused path, GELU)
    equal to the unfused modules' within FP32 rounding (rtol 1e-4: torch's unfused norm rounds rstd its own way,
    a few FP32 ulps, which the norm backward and the FP8 roundings it can tip carry into the gradients)."""
    torch.manual_seed(0)
    mods = [lowbit.nn.LayerNormLinear(256, 384, bias=True, normalization="RMSNorm"),
            lowbit.nn.LayerNormMLP(256, 128, bias=False, normalization="RMSNorm", activation="swiglu",
                                   fused_swiglu=True),
            lowbit.nn.LayerNormMLP(128, 256, bias=True, normalization="RMSNorm", activation="gelu")]
    for m in mods:
        m = m.to(device)
        with torch.no_grad():
            m.layer_norm_weight.normal_(1.0, 0.2)
        hidden = m.layer_norm_weight.shape[0]
        x = torch.randn(3, 43, hidden, device=device) * 2
        dy = torch.randn(3, 43, hidden if isinstance(m, lowbit.nn.LayerNormMLP) else 384, device=device)
        yf, dxf, gf, nf = _run(m, x, dy, True)
        yu, dxu, gu, nu = _run(m, x, dy, False)
        assert (nf, nu) == (1, 0), (type(m).__name__, nf, nu)
        if isinstance(m, lowbit.nn.LayerNormLinear):
            assert torch.equal(yf, _composed(m, x))
        torch.testing.assert_close(yf.float(), yu.float(), rtol=1e-2, atol=1e-2)  # (BF16 outputs)
        torch.testing.assert_close(dxf, dxu, rtol=1e-4, atol=1e-6)
        for n in gf:
            assert gf[n] is not None and gu[n] is not None, n
            torch.testing.assert_close(gf[n], gu[n], rtol=1e-4, atol=1e-6,
                                       msg=lambda s, n=n: f"{type(m).__name__}.{n}: {s}")
    # not fused: LayerNorm, return_layernorm_output, a BF16 input
    m = lowbit.nn.LayerNormLinear(256, 128, normalization="LayerNorm").to(device)
    assert _run(m, torch.randn(4, 256, device=device), torch.randn(4, 128, device=device), True)[3] == 0
    m = lowbit.nn.LayerNormLinear(256, 128, normalization="RMSNorm", return_layernorm_output=True).to(device)
    with lowbit.autocast(recipe=recipes.Float8BlockScaling()):
        y, ln = m(torch.randn(4, 256, device=device))
    assert ln.shape == (4, 256)
    m = lowbit.nn.LayerNormLinear(256, 128, normalization="RMSNorm").to(device)
    assert _run(m, torch.randn(4, 256, device=device).bfloat16(), torch.randn(4, 128, device=device), True)[3] == 0
    print("ok")


def test_modules_interpreter_subprocess():
    pytest.importorskip("triton")
    run_interpreted(__file__, "check_modules('cpu')", 1200)


@pytest.mark.gpu
def test_modules_gpu(cuda):
    check_modules(cuda)


def test_rms_norm_backward_matches_autograd():
    """rms_norm_backward (the CPU fallback math here; torch's fused kernel on CUDA) against autograd through
    F.rms_norm, with rstd from its FP64 reference."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 200, generator=g, dtype=torch.float64)
    w = torch.randn(200, generator=g, dtype=torch.float64)
    dy = torch.randn(37, 200, generator=g, dtype=torch.float64)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch.nn.functional.rms_norm(xa, (200,), wa, 1e-5).backward(dy)
    rstd = NQ.rmsnorm_rstd_reference(x, 1e-5).double()
    dx, dw = NQ.rms_norm_backward(dy, x, rstd, w, True)
    torch.testing.assert_close(dx, xa.grad, rtol=1e-5, atol=1e-6)  # (rstd rounded to FP32: ~1e-7 relative, dx ~ 1)
    torch.testing.assert_close(dw, wa.grad, rtol=1e-5, atol=1e-6)
    assert NQ.rms_norm_backward(dy, x, rstd, w, False)[1] is None


def test_quantized_linear_norm_args_fall_back_and_validate():
    """quantized_linear(..., norm_weight, norm_eps) where the fused kernel cannot run (here: a CPU tensor) applies
    F.rms_norm first: the same output and gradients, bit for bit, as passing the norm output; bad pairs raise."""
    from lowbit.nn import state as _ac
    from lowbit.nn.functional import quantized_linear

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter would take the fused path")
    torch.manual_seed(5)
    m = lowbit.nn.LayerNormLinear(256, 128, normalization="RMSNorm")
    with torch.no_grad():
        m.layer_norm_weight.normal_(1.0, 0.2)
    x = torch.randn(4, 7, 256)
    dy = torch.randn(4, 7, 128)
    outs = []
    for fused_args in (True, False):
        xx = x.clone().requires_grad_()
        nw = m.layer_norm_weight.detach().clone().requires_grad_()
        with lowbit.autocast(recipe=recipes.Float8BlockScaling()):
            st = _ac.get_state()
            if fused_args:
                y = quantized_linear(xx, m.weight, m.bias, m._gemms[""], state=st, norm_weight=nw, norm_eps=1e-5)
            else:
                ln = torch.nn.functional.rms_norm(xx, (256,), nw, 1e-5)
                y = quantized_linear(ln, m.weight, m.bias, m._gemms[""], state=st)
        y.backward(dy)
        outs.append((y.detach(), xx.grad, nw.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    with lowbit.autocast(recipe=recipes.Float8BlockScaling()):
        st = _ac.get_state()
        with pytest.raises(ValueError, match="give both"):
            quantized_linear(x, m.weight, m.bias, m._gemms[""], state=st, norm_weight=m.layer_norm_weight)
        with pytest.raises(ValueError, match="norm_eps"):
            quantized_linear(x, m.weight, m.bias, m._gemms[""], state=st, norm_weight=m.layer_norm_weight,
                             norm_eps=-1.0)
        with pytest.raises(ValueError, match=r"norm_weight: expected a tensor of shape \(256,\)"):
            quantized_linear(x, m.weight, m.bias, m._gemms[""], state=st, norm_weight=torch.ones(128), norm_eps=1e-5)
