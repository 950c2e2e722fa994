"""Fused SwiGLU: kernel (interpreter subprocess on CPU, compiled on the GPU) against the FP32 reference, forward
and backward (the backward against autograd through the FP32 reference)."""
import os
import subprocess
import sys

import pytest
import torch

from lowbit.ops.swiglu import swiglu, swiglu_reference


def _bound(ref, dtype, k=1):
    eps = torch.finfo(dtype).eps
    return k * eps * ref.float().abs() + k * eps * 1e-2


def _check_kernel(device, shapes, dtypes):
    for shape, dtype in zip(shapes, dtypes):
        g = torch.Generator().manual_seed(sum(shape))
        h = (3 * torch.randn(*shape, generator=g)).to(device, dtype)
        a = h.clone().requires_grad_()
        r = h.float().clone().requires_grad_()
        y = swiglu(a)
        yr = swiglu_reference(r)  # FP32 in -> FP32 out: the exact-math value, rounded once below
        assert y.shape == (*shape[:-1], shape[-1] // 2) and y.dtype == dtype
        assert bool(((y.float() - yr.to(dtype).float()).abs() <= _bound(yr, dtype)).all()), (shape, dtype)
        go = torch.randn(y.shape, generator=g).to(device, dtype)
        y.backward(go)
        yr.backward(go.float())
        diff = (a.grad.float() - r.grad).abs()
        assert bool((diff <= _bound(r.grad, dtype, 2)).all()), (shape, dtype, diff.max())


SHAPES = [(1, 2), (3, 5, 34), (17, 130), (2, 2100)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.bfloat16]


def test_reference_and_bad_input():
    h = torch.tensor([[0.0, 2.0, 3.0, 4.0]])
    torch.testing.assert_close(swiglu_reference(h), torch.tensor([[0.0, 2.0 / (1 + torch.exp(torch.tensor(-2.0))) * 4.0]]))
    with pytest.raises(ValueError, match="even last dim"):
        swiglu(torch.zeros(3, 5))


def test_kernel_interpreter_subprocess():
    pytest.importorskip("triton")
    code = ("import sys; sys.path.insert(0, %r); import test_swiglu as t; "
            "t._check_kernel('cpu', t.SHAPES, t.DTYPES); print('ok')" % os.path.dirname(__file__))
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


@pytest.mark.gpu
def test_kernel_gpu(cuda):
    _check_kernel(cuda, SHAPES + [(8192, 5632)], DTYPES + [torch.bfloat16])
