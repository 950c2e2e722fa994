"""Fused RoPE on packed QKV: the kernel (interpreter subprocess on CPU, compiled on the GPU) against the FP32
reference, forward and backward, odd shapes; the reference against the textbook rotation."""
import os
import subprocess
import sys

import pytest
import torch

from lowbit.models.gpt import rope_tables
from lowbit.ops.rope import rope_qkv, rope_qkv_reference


def _inputs(B, T, H, D, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, T, 3, H, D, generator=g).to(device, dtype)
    cos, sin = rope_tables(T + 3, D, 10000.0)
    return qkv, cos.to(device), sin.to(device)


def _ulp_close(a, b, dtype):
    """|a - b| within one rounding of ``dtype`` at b's magnitude (plus a floor for values near zero)."""
    eps = torch.finfo(dtype).eps
    return bool(((a.float() - b.float()).abs() <= eps * b.float().abs() + eps * 1e-2).all())


def test_reference_is_the_rotation():
    """Each (x_i, x_{i+h}) pair is rotated by angle t·θ_i: norms kept, angle added (FP32)."""
    qkv, cos, sin = _inputs(2, 5, 3, 8, torch.float32)
    q, k, v = rope_qkv_reference(qkv, cos, sin)
    x = qkv[:, :, 0].transpose(1, 2)  # (B, H, T, D)
    z_in = torch.complex(x[..., :4], x[..., 4:])
    z_out = torch.complex(q[..., :4], q[..., 4:])
    ang = torch.complex(cos[:5, :4], sin[:5, :4])
    torch.testing.assert_close(z_out, z_in * ang, rtol=1e-6, atol=1e-6)
    assert torch.equal(v, qkv[:, :, 2].transpose(1, 2))


def test_bad_input():
    qkv, cos, sin = _inputs(1, 4, 2, 8, torch.float32)
    with pytest.raises(ValueError, match=r"qkv: expected a \(B, T, 3, H, D\)"):
        rope_qkv(qkv[:, :, :2], cos, sin)
    with pytest.raises(ValueError, match="cos: expected a"):
        rope_qkv(qkv, cos[:3], sin)
    with pytest.raises(ValueError, match="head_dim must be even"):
        rope_qkv(torch.zeros(1, 4, 3, 2, 7), torch.zeros(4, 7), torch.zeros(4, 7))


def _check_kernel(device, shapes, dtypes):
    for (B, T, H, D), dtype in zip(shapes, dtypes):
        qkv, cos, sin = _inputs(B, T, H, D, dtype, device, seed=B * 7 + T)
        a = qkv.clone().requires_grad_()
        r = qkv.clone().requires_grad_()
        outs = rope_qkv(a, cos, sin)
        refs = rope_qkv_reference(r, cos, sin)
        for o, e in zip(outs, refs):
            assert o.shape == e.shape and _ulp_close(o, e, dtype), (B, T, H, D, dtype, (o.float() - e.float()).abs().max())
        gs = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i)).to(device, dtype) for i, o in enumerate(outs)]
        torch.autograd.backward(outs, gs)
        torch.autograd.backward(refs, gs)
        # the backward rotates by -angle in FP32 with one rounding: same bound against the reference's autograd
        # (which rounds once per op), doubled
        diff = (a.grad.float() - r.grad.float()).abs()
        assert bool((diff <= 2 * torch.finfo(dtype).eps * r.grad.float().abs() + 2 * torch.finfo(dtype).eps).all()), diff.max()


SHAPES = [(1, 1, 1, 8), (2, 17, 3, 32), (1, 33, 5, 64), (2, 9, 4, 12)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.bfloat16]


def test_kernel_interpreter_subprocess():
    pytest.importorskip("triton")
    code = ("import torch, sys; sys.path.insert(0, %r); import test_rope as t; "
            "t._check_kernel('cpu', t.SHAPES, t.DTYPES); print('ok')" % os.path.dirname(__file__))
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


@pytest.mark.gpu
def test_kernel_gpu(cuda):
    _check_kernel(cuda, SHAPES + [(4, 2048, 16, 64), (2, 1000, 16, 128)], DTYPES + [torch.bfloat16, torch.bfloat16])
