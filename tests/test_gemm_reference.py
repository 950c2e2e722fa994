"""scaled_mm on the CPU: the float64-exact reference, epilogues, dispatch and validation."""

import pytest
import torch

from lowbit import MXFP8, NVFP4, Float8Blockwise, Float8Tensorwise, quantize, scaled_mm
from lowbit.gemm import backend_for


def rnd(*s, seed=0):
    return torch.randn(*s, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "sa,sb",
    [
        (Float8Blockwise(), Float8Blockwise(block_dim=2)),
        (Float8Blockwise(block_dim=2), Float8Blockwise()),
        (Float8Blockwise(), Float8Blockwise(fmt="e5m2")),
        (Float8Tensorwise(), Float8Tensorwise("e5m2")),
        (MXFP8(), MXFP8()),
        (NVFP4(), NVFP4(two_d=True)),
    ],
    ids=repr,
)
def test_reference_equals_dequantize_then_matmul(sa, sb):
    x, w = rnd(48, 160, seed=1), rnd(80, 160, seed=2)
    qa, qb = quantize(x, sa), quantize(w, sb)
    y = scaled_mm(qa, qb, out_dtype=torch.float32, backend="reference")
    ref = (qa.dequantize(dtype=torch.float64) @ qb.dequantize(dtype=torch.float64).t()).float()
    # the only difference: the fp32 rounding of the dequantized operands (NVFP4's d/S): measured <= 7.6e-8 of the
    # largest output (0 for the blockwise pairs and MXFP8) -> bound 1e-6
    assert torch.allclose(y, ref, rtol=0, atol=1e-6 * ref.abs().max().item())


def test_three_gemms_use_the_right_copies():
    x, w, dy = rnd(64, 96, seed=3), rnd(32, 96, seed=4), rnd(64, 32, seed=5)
    s = Float8Blockwise()
    qx, qw, qdy = (quantize(t, s, rowwise=True, columnwise=True) for t in (x, w, dy))
    y = scaled_mm(qx, qw, out_dtype=torch.float32)  # fprop x·wᵀ
    dx = scaled_mm(qdy, qw, b_copy="columnwise", out_dtype=torch.float32)  # dgrad dy·w
    dw = scaled_mm(qdy, qx, a_copy="columnwise", b_copy="columnwise", out_dtype=torch.float32)  # wgrad dyᵀ·x
    for got, want in ((y, x @ w.t()), (dx, dy @ w), (dw, dy.t() @ x)):
        assert got.shape == want.shape
        assert (got - want).norm() / want.norm() < 0.06  # two E4M3 operands: ~3% each


def test_epilogues():
    x, w = rnd(16, 128, seed=6), rnd(24, 128, seed=7)
    qa, qb = quantize(x, Float8Blockwise()), quantize(w, Float8Blockwise(block_dim=2))
    base = scaled_mm(qa, qb, out_dtype=torch.float32)
    bias = rnd(24, seed=8)
    y, pre = scaled_mm(qa, qb, out_dtype=torch.float32, bias=bias, gelu=True, return_pre_gelu=True)
    assert torch.allclose(pre, base + bias, atol=1e-5)
    assert torch.allclose(y, torch.nn.functional.gelu(base + bias), atol=1e-5)
    out = rnd(16, 24, seed=9)
    o0 = out.clone()
    r = scaled_mm(qa, qb, out_dtype=torch.float32, accumulate=True, out=out)
    assert r is out and torch.allclose(out, o0 + base, atol=1e-5)
    assert scaled_mm(qa, qb, out_dtype=torch.bfloat16).dtype == torch.bfloat16


def test_exact_on_representable_inputs():
    # small integers (exact in E4M3) with power-of-two scales: every partial sum is an exact integer
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-8, 9, (33, 256), generator=g).float()
    w = torch.randint(-8, 9, (17, 256), generator=g).float()
    x[:, ::128] = 448.0 / 2**5  # block amax 14 -> pow2 scale 32 (exact)
    y = scaled_mm(quantize(x, Float8Blockwise()), quantize(w, Float8Blockwise(block_dim=2)), out_dtype=torch.float32)
    assert torch.equal(y, x @ w.t())


def test_dispatch_on_cpu_is_reference():
    qa = quantize(rnd(4, 32), Float8Blockwise())
    assert backend_for(qa, qa) == "reference"


def test_bad_input():
    qa = quantize(rnd(4, 32), Float8Blockwise())
    qb = quantize(rnd(4, 64), Float8Blockwise(block_dim=2))
    with pytest.raises(ValueError, match="contraction"):
        scaled_mm(qa, qb)
    with pytest.raises(NotImplementedError, match="E5M2 x E5M2"):
        q5 = quantize(rnd(4, 32), Float8Tensorwise("e5m2"))
        scaled_mm(q5, q5)
    with pytest.raises(NotImplementedError, match="2D x 2D"):
        q2 = quantize(rnd(4, 32), Float8Blockwise(block_dim=2))
        scaled_mm(q2, q2)
    with pytest.raises(NotImplementedError, match="MXFP8"):
        scaled_mm(quantize(rnd(32, 32), MXFP8()), qa)
    with pytest.raises(ValueError, match="columnwise"):
        scaled_mm(qa, qa, b_copy="columnwise")
    with pytest.raises(TypeError, match="QuantizedTensor"):
        scaled_mm(rnd(4, 32), qa)
    with pytest.raises(ValueError, match="bias"):
        scaled_mm(qa, qa, bias=torch.ones(5))
    with pytest.raises(ValueError, match="accumulate"):
        scaled_mm(qa, qa, accumulate=True)
    with pytest.raises(ValueError, match="backend"):
        scaled_mm(qa, qa, backend="nope")
