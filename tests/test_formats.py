"""Number formats: bit-exact casts, E2M1 table and packing, E8M0, INT8, Philox stochastic rounding."""

import math

import numpy as np
import pytest
import torch

ml_dtypes = pytest.importorskip("ml_dtypes")

from lowbit.formats import (  # noqa: E402
    E2M1,
    E4M3,
    E5M2,
    cast_to_format,
    e2m1_decode,
    e2m1_encode,
    e8m0_decode,
    e8m0_encode,
    pack_e2m1,
    philox_randint,
    philox_uniform,
    quantize_int8_symmetric,
    round_to_format,
    unpack_e2m1,
)

ML = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2, "e2m1": ml_dtypes.float4_e2m1fn}


def _expected(xf: np.ndarray, fmt) -> np.ndarray:
    """ml_dtypes' RNE cast after our saturation convention.

    Convention (NUMERICS §2): finite values beyond ±max and ±Inf saturate to ±max. ml_dtypes instead
    overflows to Inf/NaN, so we compare against ml_dtypes(clip(x, ±max)) — clipping first is exactly
    saturation because every value beyond max rounds (or would overflow) to max or beyond.
    NaN stays NaN for the FP8 formats; E2M1 has no NaN (checked separately).
    """
    return np.clip(xf, -fmt.max, fmt.max).astype(ML[fmt.name]).astype(np.float32)


def _all_bf16() -> torch.Tensor:
    return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


@pytest.mark.parametrize("fmt", [E4M3, E5M2, E2M1], ids=lambda f: f.name)
def test_all_bf16_bit_patterns_round_exactly(fmt):
    x = _all_bf16()
    got = round_to_format(x, fmt).numpy()
    xf = x.float().numpy()
    finite_or_inf = ~np.isnan(xf)
    exp = _expected(xf, fmt)
    assert np.array_equal(got[finite_or_inf].view(np.uint32), exp[finite_or_inf].view(np.uint32))
    # NaN stays NaN in the rounded values (the E2M1 *encoding* maps it to +0: see test_e2m1_nan_encoding)
    assert np.isnan(got[~finite_or_inf]).all()
    # storage bits for the FP8 formats equal ml_dtypes' bits (NaN patterns excluded: torch and ml_dtypes pick different
    # NaNs)
    if fmt.torch_dtype is not None:
        store = cast_to_format(x, fmt).view(torch.uint8).numpy()
        ref = np.clip(xf, -fmt.max, fmt.max).astype(ML[fmt.name]).view(np.uint8)
        assert np.array_equal(store[finite_or_inf], ref[finite_or_inf])
    else:
        codes = cast_to_format(x, fmt).numpy()
        ref = np.clip(xf, -6, 6).astype(ML["e2m1"]).view(np.uint8) & 0xF
        assert np.array_equal(codes[finite_or_inf], ref[finite_or_inf])


@pytest.mark.parametrize("fmt", [E4M3, E5M2, E2M1], ids=lambda f: f.name)
def test_random_fp32_sample_rounds_exactly(fmt):
    g = torch.Generator().manual_seed(1234)
    n = 400_000
    # log-uniform magnitudes over the whole useful range (subnormals to far beyond max), random signs,
    # plus exact midpoints between neighbours to exercise ties-to-even
    mag = torch.exp2(torch.rand(n, generator=g) * 60 - 30)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    x = mag * sign
    grid = torch.tensor(sorted({float(v) for v in round_to_format(torch.linspace(0, fmt.max, 20000), fmt)}))
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([x, mids, -mids, grid, torch.tensor([0.0, -0.0, float("inf"), -float("inf")])])
    got = round_to_format(x, fmt).numpy()
    exp = _expected(x.numpy(), fmt)
    assert np.array_equal(got.view(np.uint32), exp.view(np.uint32))


def test_float64_input_rounds_without_double_rounding():
    # 1 + 2**-4 + 2**-40 is just above the E4M3 midpoint 1.0625 between 1.0 and 1.125: it must round up.
    # Through float32 it would first become exactly the midpoint and round to even (1.0).
    x = torch.tensor([1 + 2**-4 + 2**-40], dtype=torch.float64)
    assert round_to_format(x, E4M3).item() == 1.125
    assert round_to_format(x.float(), E4M3).item() == 1.0


def test_e2m1_rounding_table():
    table = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0, 7.0: 6.0}
    x = torch.tensor(list(table) + [-v for v in table])
    want = torch.tensor(list(table.values()) + [-v for v in table.values()])
    got = round_to_format(x, E2M1)
    assert torch.equal(got.abs(), want.abs()) and torch.equal(torch.signbit(got), torch.signbit(x))


def test_e2m1_codes_and_packing():
    vals = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    codes = e2m1_encode(vals)
    assert codes.tolist() == list(range(16))
    assert torch.equal(e2m1_decode(codes), vals)
    packed = pack_e2m1(codes.reshape(2, 8))
    # element 2i in the low nibble, 2i+1 in the high nibble
    assert packed[0, 0].item() == (0 | (1 << 4)) and packed[1, 3].item() == (14 | (15 << 4))
    assert torch.equal(unpack_e2m1(packed), codes.reshape(2, 8))
    with pytest.raises(ValueError, match="even"):
        pack_e2m1(torch.zeros(3, dtype=torch.uint8))


def test_e2m1_nan_encoding():
    # E2M1 has no NaN: the element encodes as +0; NVFP4 carries the NaN in the block scale (test_quant_reference).
    assert e2m1_encode(torch.tensor([float("nan")])).item() == 0


def test_e8m0_roundtrip():
    X = torch.arange(-127, 128)
    b = e8m0_encode(X)
    assert b.dtype == torch.uint8 and b[0].item() == 0 and b[-1].item() == 254
    assert torch.equal(e8m0_decode(b), torch.ldexp(torch.ones(255), X.float()))
    assert torch.isnan(e8m0_decode(torch.tensor([255], dtype=torch.uint8))).all()
    assert e8m0_encode(torch.tensor([500])).item() == 254  # clamped


def test_int8_round_half_away_and_clamp():
    x = torch.tensor([0.5, -0.5, 1.5, -1.5, 2.5, 126.5, 200.0, -200.0, 0.49999997, float("nan")])
    q = quantize_int8_symmetric(x, torch.tensor(1.0))
    assert q.tolist() == [1, -1, 2, -2, 3, 127, 127, -127, 0, 0]


def test_philox_is_counter_based_and_uniform():
    idx = torch.arange(100_000)
    a = philox_randint(42, idx)
    assert torch.equal(a, philox_randint(42, idx))
    assert not torch.equal(a, philox_randint(43, idx))
    # counter-based: element i depends only on (seed, i)
    assert torch.equal(a[5000:5010], philox_randint(42, torch.arange(5000, 5010)))
    u = philox_uniform(42, idx)
    assert 0 <= u.min() and u.max() < 1
    # mean of 1e5 uniforms: sd = sqrt(1/12/1e5) ~ 9.1e-4; 5 sd bound
    assert abs(u.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / 1e5)


_PHILOX_SCRIPT = """
import torch, triton, triton.language as tl
from lowbit.formats import philox_randint

@triton.jit
def k(out, seed, N: tl.constexpr):
    i = tl.arange(0, N).to(tl.int64) + 5_000_000_000
    tl.store(out + tl.arange(0, N), tl.randint(seed, i))

out = torch.zeros(256, dtype=torch.int32)
k[(1,)](out, 987654321, 256)
ref = philox_randint(987654321, torch.arange(256) + 5_000_000_000)
assert torch.equal(out.to(torch.int64) & 0xFFFFFFFF, ref)
print("OK")
"""


def test_philox_matches_triton_randint_interpreter():
    """Our Philox equals tl.randint (Triton's interpreter on the CPU; the GPU test below on the device)."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", _PHILOX_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-2000:]


@pytest.mark.gpu
def test_philox_matches_triton_randint_gpu():
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def k(out, seed, N: tl.constexpr):
        i = tl.arange(0, N).to(tl.int64) + 5_000_000_000
        tl.store(out + tl.arange(0, N), tl.randint(seed, i))

    dev = "cuda"
    out = torch.zeros(256, dtype=torch.int32, device=dev)
    k[(1,)](out, 987654321, 256)
    ref = philox_randint(987654321, torch.arange(256) + 5_000_000_000)
    assert torch.equal(out.cpu().to(torch.int64) & 0xFFFFFFFF, ref)


@pytest.mark.parametrize("fmt", [E4M3, E2M1], ids=lambda f: f.name)
def test_stochastic_rounding_reproducible_and_unbiased(fmt):
    g = torch.Generator().manual_seed(7)
    v = (torch.rand(64, generator=g) * 0.9 + 0.05) * (fmt.max / 4)
    n = 4000
    x = v.repeat(n, 1)
    idx = torch.arange(x.numel()).reshape(x.shape)
    r1 = round_to_format(x, fmt, stochastic=True, seed=11, index=idx)
    r2 = round_to_format(x, fmt, stochastic=True, seed=11, index=idx)
    assert torch.equal(r1, r2)
    assert not torch.equal(r1, round_to_format(x, fmt, stochastic=True, seed=12, index=idx))
    gap = torch.ldexp(torch.ones_like(v), torch.frexp(v)[1].float() - 1 - fmt.mbits).clamp(min=fmt.min_subnormal)
    lo = torch.floor(v / gap) * gap
    # every draw is one of the two neighbours, and both occur
    assert ((r1 == lo) | (r1 == lo + gap)).all()
    assert ((r1 == lo).any(dim=0) & (r1 == lo + gap).any(dim=0)).all()
    # each draw is lo or hi, a Bernoulli scaled by the gap: sd of the mean <= gap / (2 sqrt(n)); bound at 5 sd
    mean = r1.mean(dim=0)
    assert ((mean - v).abs() <= 5 * gap / (2 * math.sqrt(n))).all()


def test_bad_input():
    with pytest.raises(TypeError, match="floating-point"):
        round_to_format(torch.arange(4), E4M3)
    with pytest.raises(ValueError, match="fmt"):
        round_to_format(torch.ones(2), "e3m4")
