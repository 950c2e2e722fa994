"""Non-finite values stay visible, and the bounds where finite values vanish (NUMERICS §2, §3, §5), on the reference
(CPU): MXFP8's E8M0 NaN for a block with a NaN or Inf, delayed scaling's NaN scale_inv, power-of-two scales near
the FP32 maximum, and the underflow bounds of each scheme. The Triton kernels are held to the same bits in
test_quant_kernels.py (interpreter and GPU) and the GEMMs in test_gemm.py."""

from __future__ import annotations

import pytest
import torch

from lowbit.formats import FP32_MAX
from lowbit.gemm import scaled_mm
from lowbit.quant import MXFP8, NVFP4, Float8Blockwise, Float8Rowwise, Float8Tensorwise, quantize
from lowbit.quant.reference import compute_scale, pow2_scale_floor

INF = float("inf")


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _up(v: float) -> float:
    return torch.nextafter(torch.tensor(v), torch.tensor(INF)).item()


# ------------------------------------------------------------------------------------------------ MXFP8
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("bad", [INF, -INF, float("nan")], ids=["+inf", "-inf", "nan"])
def test_mxfp8_block_with_a_nonfinite_value_is_nan(fmt, bad):
    """The block holding the value stores 0xFF (the E8M0 NaN) in the copy along whose blocks it lies and dequantizes
    to NaN; every other block is what it is without the value."""
    x = _randn(64, 96)
    x[5, 40] = bad  # rowwise block (5, 1); columnwise block (40, 0)
    clean = x.clone()
    clean[5, 40] = 0.0
    q = quantize(x, MXFP8(fmt), rowwise=True, columnwise=True)
    c = quantize(clean, MXFP8(fmt), rowwise=True, columnwise=True)
    assert q.has_nonfinite_amax
    for which, (r, b) in (("rowwise", (5, 1)), ("columnwise", (40, 0))):
        s, sc = getattr(q, which).scale_inv, getattr(c, which).scale_inv
        nan_block = torch.zeros_like(s, dtype=torch.bool)
        nan_block[r, b] = True
        assert torch.equal(s == 255, nan_block)
        assert torch.equal(s[~nan_block], sc[~nan_block])
        d, dc = q.dequantize(which), c.dequantize(which)
        faulty = torch.zeros_like(d, dtype=torch.bool)
        if which == "rowwise":
            faulty[5, 32:64] = True
        else:
            faulty[0:32, 40] = True
        assert torch.isnan(d[faulty]).all()
        assert torch.equal(d[~faulty], dc[~faulty])


def test_mxfp8_scaled_mm_returns_nan_where_the_true_result_is_not_finite():
    """One +Inf in x: that row of y (the true value is ±Inf or NaN) is NaN, not a finite number; the other rows equal
    the GEMM of the clean operands."""
    x, w = _randn(32, 64), _randn(48, 64, seed=1)
    x[7, 3] = INF
    clean = x.clone()
    clean[7, 3] = 0.0
    wq = quantize(w, MXFP8())
    y = scaled_mm(quantize(x, MXFP8()), wq, out_dtype=torch.float32)
    yc = scaled_mm(quantize(clean, MXFP8()), wq, out_dtype=torch.float32)
    assert torch.isnan(y[7]).all()
    rows = torch.arange(32) != 7
    assert torch.equal(y[rows], yc[rows])


# ------------------------------------------------------------------------------------------------ pow2 near FP32 max
POW2_SCHEMES = [Float8Blockwise(), Float8Blockwise(block_dim=2), Float8Rowwise(pow2=True), Float8Blockwise(fmt="e5m2"),
                Float8Blockwise(block_dim=2, fmt="e5m2", block_size=32)]


@pytest.mark.parametrize("scheme", POW2_SCHEMES, ids=repr)
def test_pow2_scale_near_the_fp32_max_dequantizes_finite(scheme):
    """Values up to the FP32 maximum: the scale is at least pow2_scale_floor, so dequantize() is finite (it was Inf:
    a power-of-two scale keeps the mantissa, and the top values rounded up to 2**128) and nothing is flagged; values
    up to 1.75 * 2**127 keep the format's rounding error, larger ones saturate to 1.75 * 2**127."""
    fmt = scheme.format
    g = torch.Generator().manual_seed(3)
    x = (torch.rand(256, 384, generator=g) * 2 - 1) * FP32_MAX
    x[0, 0], x[1, 1], x[2, :] = FP32_MAX, -FP32_MAX, 1.99 * 2.0**127
    q = quantize(x, scheme, rowwise=True, columnwise=True)
    assert not q.has_nonfinite_amax
    top = 1.75 * 2.0**127
    for which in ("rowwise", "columnwise"):
        d = q.dequantize(which)
        assert torch.isfinite(d).all()
        big = x.abs() > top
        assert torch.equal(d[big], torch.copysign(torch.full_like(d[big], top), x[big]))
        rel = ((d - x).abs() / x.abs())[~big & (x.abs() > 2.0**120)]
        assert rel.max() <= 2.0 ** -(fmt.mbits + 1)  # half an ulp of the format
        # every scale at or above the floor: scale_inv at most 1 / floor (a scale below it was the fault)
        assert (q.logical_scales(which).float() <= 1.0 / pow2_scale_floor(fmt.max)).all()


def test_pow2_scale_floor_is_the_smallest_scale_with_a_finite_range():
    for fmax in (448.0, 57344.0, 6.0, 127.0):
        f = pow2_scale_floor(fmax)
        assert fmax / f < FP32_MAX < fmax / (f / 2)  # finite at the floor, not one power of two below
        a = torch.tensor([FP32_MAX, 1.75 * 2.0**127 * 1.01, fmax / f, 1.0, 0.0, INF, float("nan")])
        s = compute_scale(a, fmax, pow2=True)
        assert s[0] == s[1] == f and s[2] == f and s[3] == 2.0 ** int(torch.log2(torch.tensor(fmax)).floor())
        assert s[4] == 1 and s[5] == 0 and torch.isnan(s[6])  # 0, Inf and NaN amax keep their rules


# ------------------------------------------------------------------------------------------------ delayed scaling
@pytest.mark.parametrize("bad", [INF, -INF, float("nan")], ids=["+inf", "-inf", "nan"])
def test_delayed_scale_inv_is_nan_when_the_copy_holds_a_nonfinite_value(bad):
    """The cast alone would saturate an Inf to ±fmax, which dequantizes to a finite fmax / scale: the copy's
    scale_inv is NaN instead (both copies), so it dequantizes to NaN as a current scale makes it; the codes are the
    saturating cast's; a finite copy keeps 1 / scale exactly."""
    scale = torch.tensor([3.0])
    x = _randn(16, 32)
    q = quantize(x, Float8Tensorwise(), scale=scale, columnwise=True)
    assert torch.equal(q.rowwise.scale_inv, 1.0 / scale) and torch.isfinite(q.dequantize()).all()
    x[2, 9] = bad
    q = quantize(x, Float8Tensorwise(), scale=scale, columnwise=True)
    assert torch.isnan(q.rowwise.scale_inv).all() and torch.isnan(q.columnwise.scale_inv).all()
    assert torch.isnan(q.dequantize()).all() and torch.isnan(q.dequantize("columnwise")).all()
    assert q.has_nonfinite_amax
    if bad != bad:
        assert torch.isnan(q.rowwise.data[2, 9].float())
    else:
        assert q.rowwise.data[2, 9].float() == (448.0 if bad > 0 else -448.0)  # saturated, as §2 casts


# ------------------------------------------------------------------------------------------------ underflow bounds
@pytest.mark.parametrize("scheme, bound", [
    (Float8Tensorwise(), 2.0**-138), (Float8Tensorwise("e5m2"), 2.0**-145), (Float8Rowwise(), 2.0**-138),
    (Float8Blockwise(pow2=False), 2.0**-138), (Float8Blockwise(), 2.0**-137), (Float8Blockwise(block_dim=2), 2.0**-137),
    (Float8Rowwise(pow2=True), 2.0**-137), (Float8Blockwise(fmt="e5m2"), 2.0**-144), (MXFP8(), 2.0**-137),
    (MXFP8("e5m2"), 2.0**-144), (NVFP4(), 2.0**-130), (NVFP4(two_d=True), 2.0**-130),
], ids=repr)
def test_a_group_below_the_documented_bound_quantizes_to_zeros(scheme, bound):
    """NUMERICS §3, subnormals and underflow: a group whose nonzero amax is at the bound dequantizes to ±0 (its amax
    stored as measured, nothing flagged); one FP32 step above it, its largest elements survive."""
    for amax, zero in ((bound, True), (_up(bound), False)):
        x = torch.zeros(32, 128)
        x[3, 5], x[20, 100] = amax, -amax
        q = quantize(x, scheme, rowwise=True, columnwise=not (isinstance(scheme, NVFP4) and scheme.rht))
        assert not q.has_nonfinite_amax and q.amax.item() == amax
        for which in ("rowwise", "columnwise"):
            d = q.dequantize(which)
            assert bool((d == 0).all()) is zero, (which, amax)
            if not zero:
                assert d[3, 5] > 0 and d[20, 100] < 0


def test_nvfp4_block_below_the_block_dynamic_range_is_zero():
    """NVFP4: a block with amax_block · (S / 6) ≤ 2**-10 gets the block scale 0 (amax_block ≲ 2.2e-6 · the tensor's
    amax, S not capped); just above, its largest element survives."""
    b = 2.0**-10 / 448  # S / 6 = 448 for a tensor amax of 1
    for v, zero in ((b * (1 - 1e-6), True), (b * (1 + 1e-6), False)):
        x = torch.zeros(16, 32)
        x[0, 0], x[3, 20] = 1.0, v
        q = quantize(x, NVFP4())
        assert bool((q.dequantize()[3, 16:] == 0).all()) is zero
        assert (q.rowwise.scale_inv[3, 1].float() == 0).item() is zero
