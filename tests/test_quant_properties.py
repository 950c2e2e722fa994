"""Property tests (hypothesis): invariants every quantizer must keep on arbitrary finite inputs."""

import math

import numpy as np
import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

from lowbit import MXFP8, NVFP4, Float8Blockwise, Float8Tensorwise, quantize  # noqa: E402
from lowbit.formats import E4M3, E5M2, round_to_format  # noqa: E402

ml_dtypes = pytest.importorskip("ml_dtypes")

finite32 = st.floats(allow_nan=False, allow_infinity=False, width=32)
matrices = hnp.arrays(np.float32, st.tuples(st.integers(1, 40), st.integers(1, 300)), elements=finite32)


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, st.integers(1, 500), elements=finite32))
def test_round_matches_ml_dtypes_on_any_finite_input(a):
    x = torch.from_numpy(a)
    for fmt, md in ((E4M3, ml_dtypes.float8_e4m3fn), (E5M2, ml_dtypes.float8_e5m2)):
        want = np.clip(a, -fmt.max, fmt.max).astype(md).astype(np.float32)
        got = round_to_format(x, fmt).numpy()
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def _half_step_bound(v: torch.Tensor, fmt) -> torch.Tensor:
    """Half the spacing of ``fmt`` at |v| (the largest round-to-nearest error)."""
    e = torch.floor(torch.log2(v.abs().clamp(min=fmt.min_normal)))
    return torch.exp2(e - fmt.mbits - 1)


@settings(max_examples=60, deadline=None)
@given(matrices, st.sampled_from([1, 2]))
def test_blockwise_pow2_invariants(a, block_dim):
    x = torch.from_numpy(a).double().float()
    q = quantize(x, Float8Blockwise(block_dim=block_dim), rowwise=True, columnwise=True)
    for which in ("rowwise", "columnwise"):
        s_inv = q.expanded_scale_inv(which)
        xs = x if which == "rowwise" else x.t()
        # scales are powers of two, so x * scale is exact: the only error is E4M3 rounding, <= half a step
        scaled = xs.double() / s_inv.double()
        # amax * scale <= 448, except for an amax above 1.75 * 2**127: there the scale stops at its floor (NUMERICS §3,
        # so that the copy dequantizes finite) and the values beyond 448 saturate to it
        sat = scaled.abs() > 448
        assert (xs.abs()[sat] > 1.75 * 2.0**127).all()
        assert (q.elements(which)[sat].abs() == 448).all()
        err = (q.elements(which).double() - scaled).abs()[~sat]
        assert (err <= _half_step_bound(scaled[~sat], E4M3).double() + 1e-300).all()
        assert torch.isfinite(q.dequantize(which)).all()
    assert q.amax.item() == x.abs().max().item()


@settings(max_examples=40, deadline=None)
@given(matrices)
def test_tensorwise_error_bound_and_saturation(a):
    x = torch.from_numpy(a)
    q = quantize(x, Float8Tensorwise(), rowwise=True, columnwise=True)
    assert q.rowwise.data.float().abs().max() <= 448
    assert torch.equal(q.columnwise.data.view(torch.uint8), q.rowwise.data.view(torch.uint8).t())
    deq = q.dequantize().double()
    amax = x.abs().max().item()
    if amax > 0 and math.isfinite(448 / amax):
        s = q.rowwise.scale_inv.double().item()
        # half a step at each value (scaled), plus the float32 rounding of x * scale (<= 2^-24 relative)
        bound = _half_step_bound((x.double() / s).float(), E4M3).double() * s + x.double().abs() * 2**-23
        assert ((deq - x.double()).abs() <= bound + 1e-300).all()


@settings(max_examples=30, deadline=None)
@given(hnp.arrays(np.float32, st.tuples(st.sampled_from([32, 64]), st.sampled_from([32, 64, 96])),
                  elements=st.floats(-1e4, 1e4, allow_nan=False, width=32)))
def test_mx_and_nvfp4_scales_bound_the_elements(a):
    x = torch.from_numpy(a)
    mx = quantize(x, MXFP8(), rowwise=True, columnwise=True)
    for which in ("rowwise", "columnwise"):
        assert mx.elements(which).abs().max() <= 448
    nv = quantize(x, NVFP4(), rowwise=True, columnwise=True)
    for which in ("rowwise", "columnwise"):
        assert nv.elements(which).abs().max() <= 6
        d = nv.logical_scales(which).float()
        assert (d <= 448).all() and torch.isfinite(d).all()
    if x.abs().max() == 0:
        assert torch.equal(nv.dequantize(), x)
