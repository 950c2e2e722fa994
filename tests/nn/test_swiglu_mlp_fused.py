"""LayerNormMLP(swiglu) under a 1x128 blockwise recipe runs SwiGLU inside the quantizers (quantized_swiglu_mlp):
output and every gradient equal the unfused path (separate SwiGLU kernel + quantizers) bit for bit. On the CPU this
runs under Triton's interpreter in a child process (the fused kernel is Triton); on CUDA compiled."""
import importlib
import math
import os
import subprocess
import sys

import pytest
import torch

import lowbit
from lowbit import recipes
from lowbit.runtime import env


def _run(m, x, dy, recipe, fused: bool, autocast16: bool):
    unfuse = env.override(LOWBIT_UNFUSE="" if fused else "swiglu_quant")
    unfuse.__enter__()
    try:
        for p in m.parameters():
            p.grad = None
        xx = x.clone().requires_grad_()
        calls = []
        import lowbit.nn.functional as F_

        real = F_._SwiGLUMLPFn.apply
        F_._SwiGLUMLPFn.apply = lambda *a: calls.append(1) or real(*a)
        try:
            with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast16):
                with lowbit.autocast(recipe=recipe):
                    y = m(xx)
            y.backward(dy.to(y.dtype))
        finally:
            F_._SwiGLUMLPFn.apply = real
        return [y.detach(), xx.grad] + [p.grad for p in m.parameters()], len(calls)
    finally:
        unfuse.__exit__(None, None, None)


CASES = [((3, 43), 256, 128, False, "RMSNorm", torch.bfloat16, False),
         ((130,), 128, 256, True, "LayerNorm", torch.float32, True)]
# whole 128-row tiles: on the GPU SwiGLU's backward runs inside fc1's grad_output quantizer too
# (swiglu_backward_quantize_1x128; the register-tile kernel, not in the interpreter)
GPU_CASES = CASES + [((2, 128), 256, 384, False, "RMSNorm", torch.bfloat16, False),
                     ((256,), 128, 256, False, "RMSNorm", torch.float32, True)]


def check(device: str, cases=CASES):
    torch.manual_seed(0)
    recipe = recipes.Float8BlockScaling()
    S = importlib.import_module("lowbit.ops.swiglu")
    bwd_calls = []
    real_bwd = S.swiglu_backward_quantize_1x128
    S.swiglu_backward_quantize_1x128 = lambda *a: bwd_calls.append(1) or real_bwd(*a)
    try:
        _check(device, recipe, cases)
    finally:
        S.swiglu_backward_quantize_1x128 = real_bwd
    if device != "cpu":
        assert len(bwd_calls) == sum(1 for c in cases if math.prod(c[0]) % 128 == 0), bwd_calls
    print("ok")


def _check(device, recipe, cases):
    for lead, hidden, ffn, bias, norm, dtype, ac in cases:
        m = lowbit.nn.LayerNormMLP(hidden, ffn, bias=bias, activation="swiglu", normalization=norm).to(device)
        if bias:  # fc1 bias: the fusion steps aside (its gradient needs the 16-bit d[a | b]); use fc2's only
            m.fc1_bias = None
            m.fc2_bias.data.normal_()
        m = m.to(dtype)
        x = torch.randn(*lead, hidden, device=device, dtype=dtype) * 2
        dy = torch.randn(*lead, hidden, device=device, dtype=dtype)
        got, n_fused = _run(m, x, dy, recipe, True, ac)
        want, n_plain = _run(m, x, dy, recipe, False, ac)
        assert (n_fused, n_plain) == (1, 0), (n_fused, n_plain)
        for i, (a, b) in enumerate(zip(got, want)):
            assert (a is None) == (b is None), i
            if a is not None:
                assert a.dtype == b.dtype and torch.equal(a, b), (i, lead, (a.float() - b.float()).abs().max())


def test_fused_equals_unfused_interpreter_subprocess():
    pytest.importorskip("triton")
    code = ("import sys; sys.path.insert(0, %r); import test_swiglu_mlp_fused as t; t.check('cpu')"
            % os.path.dirname(__file__))
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


def test_not_fused_on_cpu_without_triton_or_for_other_recipes(monkeypatch):
    S = importlib.import_module("lowbit.ops.swiglu")  # (lowbit.ops.swiglu as an attribute is the function)
    from lowbit.nn.functional import swiglu_mlp_fusable

    w1 = torch.zeros(256, 64)
    x = torch.zeros(4, 64)
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert not swiglu_mlp_fusable(x, w1, None, recipes.Float8BlockScaling(), torch.bfloat16)  # CPU: reference path
    # past the device check (as under the interpreter), so that the other recipes are refused for their schemes
    monkeypatch.setattr(S, "INTERPRET", True)
    assert swiglu_mlp_fusable(x, w1, None, recipes.Float8BlockScaling(), torch.bfloat16)
    for r in (recipes.Float8CurrentScaling(), recipes.DelayedScaling(), recipes.MXFP8BlockScaling()):
        assert not swiglu_mlp_fusable(x, w1, None, r, torch.bfloat16)


@pytest.mark.gpu
def test_fused_equals_unfused_gpu(cuda):
    check(cuda, GPU_CASES)
