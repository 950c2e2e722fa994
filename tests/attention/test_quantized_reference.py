"""Q/K/V quantization prepass math and the quantized attention reference (CPU)."""
import math

import pytest
import torch

from lowbit.attention import attention_quantized_reference, attention_reference
from lowbit.attention.reference import (
    LOG2E,
    attention_prequantized_reference,
    quantize_qk_int8,
    quantize_qk_reference,
    quantize_v_fp8_reference,
    round_half_away,
)


def nrmse(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def rand(*shape, dtype=torch.bfloat16, seed=0, offset=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    if offset is not None:
        x = x + offset
    return x.to(dtype)


def test_round_half_away_is_exact():
    x = torch.tensor([0.5, -0.5, 1.5, -1.5, 2.5, 0.49999997, -0.49999997, 126.5, 3.4999998])
    assert round_half_away(x).tolist() == [1, -1, 2, -2, 3, 0, -0, 127, 3]


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("granularity", ["per_block", "per_warp"])
@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_quantize_qk_scales_and_error_bound(layout, granularity, dtype):
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 77, 45, 32
    q, k = rand(B, Hq, Sq, D, seed=1), rand(B, Hkv, Sk, D, seed=2, offset=torch.linspace(-3, 3, D))
    if layout == "bshd":
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
    r = quantize_qk_reference(q, k, dtype=dtype, granularity=granularity, block_q=32, block_k=16, warp_q=8,
                              layout=layout)
    nq = math.ceil(Sq / 32) * (4 if granularity == "per_warp" else 1)
    assert r.q_scale.shape == (B, Hq, nq) and r.k_scale.shape == (B, Hkv, math.ceil(Sk / 16))
    assert r.q.shape == q.shape and r.k.shape == k.shape and r.k_mean.shape == (B, Hkv, 1, D)
    qh = q if layout == "bhsd" else q.transpose(1, 2)
    codes = (r.q if layout == "bhsd" else r.q.transpose(1, 2)).float()
    rows = 8 if granularity == "per_warp" else 32
    sc = r.q_scale[:, :, torch.arange(Sq) // rows][..., None]
    x = qh.float() * float(torch.tensor(r.softmax_scale * LOG2E, dtype=torch.float32))
    err = (codes * sc - x).abs()
    if dtype == "int8":
        assert codes.abs().max() <= 127
        assert (err <= sc * 0.5 * (1 + 1e-5)).all()  # half a step
    else:
        assert (err <= x.abs() * 2 ** -4 + sc * 2 ** -10).all()  # half an E4M3 ulp (+ subnormal step)
    # each scale is amax/qmax of its group: the largest code of a group reaches the format max
    qmax = 127 if dtype == "int8" else 448
    grp = codes.abs().amax(-1)[:, :, : (Sq // rows) * rows].reshape(B, Hq, -1, rows).amax(-1)
    assert torch.all(grp == qmax)
    # per-warp trailing groups past the end of Sq keep scale 1
    if granularity == "per_warp":
        assert torch.all(r.q_scale[:, :, math.ceil(Sq / 8):] == 1)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("granularity", ["per_block", "per_warp"])
@pytest.mark.parametrize("smooth_k", [True, False])
def test_matches_lead_quant_reference_bit_exact(layout, granularity, smooth_k):
    q = rand(2, 4, 131, 64, seed=3, dtype=torch.float16)
    k = rand(2, 2, 97, 64, seed=4, dtype=torch.float16, offset=torch.linspace(-5, 5, 64))
    if layout == "bshd":
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
    a = quantize_qk_reference(q, k, granularity=granularity, smooth_k=smooth_k, layout=layout)
    b = quantize_qk_int8(q, k, granularity=granularity, smooth_k=smooth_k, layout=layout)
    assert torch.equal(a.q, b.q) and torch.equal(a.k, b.k)
    assert torch.equal(a.q_scale, b.q_scale) and torch.equal(a.k_scale, b.k_scale)
    assert (a.k_mean is None) == (b.k_mean is None)
    if smooth_k:
        assert torch.equal(a.k_mean, b.k_mean)
    v = rand(2, 2, 97, 64, seed=5) if layout == "bhsd" else rand(2, 97, 2, 64, seed=5)
    va, sa = quantize_v_fp8_reference(v, layout=layout)
    vb, sb = quantize_v_fp8_reference(v, layout=layout)
    assert torch.equal(va.view(torch.uint8), vb.view(torch.uint8)) and torch.equal(sa, sb)


def test_varlen_quantization_restarts_blocks_per_sequence():
    # sequence lengths: q 37, 5, 70; k 20, 33, 1
    cq = torch.tensor([0, 37, 42, 112], dtype=torch.int32)
    ck = torch.tensor([0, 20, 53, 54], dtype=torch.int32)
    q, k = rand(112, 4, 32, seed=6), rand(54, 2, 32, seed=7, offset=2.0)
    r = quantize_qk_reference(q, k, granularity="per_warp", block_q=32, warp_q=16, block_k=16,
                              cu_seqlens_q=cq, cu_seqlens_k=ck)
    assert r.q_scale.shape == (3, 4, math.ceil(70 / 32) * 2) and r.k_scale.shape == (3, 2, math.ceil(33 / 16))
    for b in range(3):
        qs, ks = slice(int(cq[b]), int(cq[b + 1])), slice(int(ck[b]), int(ck[b + 1]))
        d = quantize_qk_reference(q[qs][None], k[ks][None], granularity="per_warp", block_q=32, warp_q=16,
                                  block_k=16, layout="bshd")
        assert torch.equal(r.q[qs], d.q[0]) and torch.equal(r.k[ks], d.k[0])
        n = d.q_scale.shape[-1]
        assert torch.equal(r.q_scale[b, :, :n], d.q_scale[0]) and torch.all(r.q_scale[b, :, n:] == 1)
        n = d.k_scale.shape[-1]
        assert torch.equal(r.k_scale[b, :, :n], d.k_scale[0]) and torch.all(r.k_scale[b, :, n:] == 1)
        torch.testing.assert_close(r.k_mean[b], d.k_mean[0], rtol=1e-6, atol=1e-6)


def test_v_fp8_per_channel():
    v = rand(2, 3, 50, 16, seed=8) * torch.logspace(-2, 2, 16).to(torch.bfloat16)
    codes, scale = quantize_v_fp8_reference(v)
    assert scale.shape == (2, 3, 16) and codes.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(scale, v.float().abs().amax(2) / 448)
    assert torch.all(codes.float().abs().amax(2) == 448)
    rel = ((codes.float() * scale[:, :, None]) - v.float()).abs() / v.float().abs().clamp(min=1e-30)
    assert rel[v.float().abs() > scale[:, :, None] * 2 ** -6].max() <= 2 ** -4 + 1e-6


# NRMSE vs the FP32 reference on N(0,1) inputs: measured maxima over D in {64,128},
# S in {1,17,300,1000,4096}, causal or not (CPU, this reference): bf16 1.6e-3, int8/bf16 1.33e-2,
# int8/fp8 4.0e-2, fp8/fp8 5.4e-2, fp8/bf16 4.0e-2.  Floors below = ~1.5x those.
FLOORS = {("bf16", "bf16"): 2.5e-3, ("int8", "bf16"): 2e-2, ("int8", "fp8"): 6e-2, ("fp8", "fp8"): 8e-2,
          ("fp8", "bf16"): 6e-2}


@pytest.mark.parametrize("qk,pv", list(FLOORS))
@pytest.mark.parametrize("granularity", ["per_block", "per_warp"])
@pytest.mark.parametrize("causal", [False, True])
def test_quantized_reference_error_floor(qk, pv, granularity, causal):
    q, k, v = rand(1, 4, 257, 64, seed=9), rand(1, 2, 257, 64, seed=10), rand(1, 2, 257, 64, seed=11)
    ref = attention_reference(q, k, v, causal=causal)
    out = attention_quantized_reference(q, k, v, qk=qk, pv=pv, granularity=granularity, causal=causal)
    e = nrmse(out, ref)
    assert e < FLOORS[(qk, pv)], e
    # the tiled (online-softmax) variant only changes where P is rounded
    out_t = attention_quantized_reference(q, k, v, qk=qk, pv=pv, granularity=granularity, causal=causal, block_n=64)
    assert nrmse(out_t, ref) < FLOORS[(qk, pv)]


@pytest.mark.parametrize("qk", ["int8", "fp8"])
def test_smooth_k_cuts_error_with_channel_offsets(qk):
    # real LLM keys have large per-channel offsets; measured (S=300, offsets ~ N(0, 8^2)):
    # int8 1.2e-2 vs 4.8e-2, fp8 3.8e-2 vs 2.1e-1 -> require at least a 2.5x reduction.
    off = torch.randn(64, generator=torch.Generator().manual_seed(12)) * 8
    q, k, v = rand(2, 4, 300, 64, seed=13), rand(2, 2, 300, 64, seed=14, offset=off), rand(2, 2, 300, 64, seed=15)
    ref, lse = attention_reference(q, k, v, return_lse=True)
    o1, l1 = attention_quantized_reference(q, k, v, qk=qk, smooth_k=True, return_lse=True)
    o0, l0 = attention_quantized_reference(q, k, v, qk=qk, smooth_k=False, return_lse=True)
    assert nrmse(o1, ref) * 2.5 < nrmse(o0, ref)
    # LSE is corrected for smoothing: measured max |err| 8e-3 (int8), 2.8e-2 (fp8) vs 0.25 / 0.88 unsmoothed
    assert (l1 - lse).abs().max() < (0.02 if qk == "int8" else 0.06)


def test_prequantized_reference_index_mapping_explicit():
    """Dequantize with explicit loops (row r -> q_scale[r // rows], col c -> k_scale[c // block_k],
    q head h -> kv head h // group) and compare with the vectorized reference."""
    g = torch.Generator().manual_seed(16)
    B, Hq, Hkv, Sq, Sk, D, rows, bk = 2, 4, 2, 20, 24, 16, 4, 8
    qi = torch.randint(-127, 128, (B, Hq, Sq, D), generator=g, dtype=torch.int8)
    ki = torch.randint(-127, 128, (B, Hkv, Sk, D), generator=g, dtype=torch.int8)
    v = torch.randn(B, Hkv, Sk, D, generator=g).bfloat16()
    qs = 2.0 ** torch.randint(-12, -8, (B, Hq, Sq // rows), generator=g).float()
    ks = 2.0 ** torch.randint(-4, 0, (B, Hkv, Sk // bk), generator=g).float()
    out = attention_prequantized_reference(qi, ki, v, qs, ks, q_scale_rows=rows, k_scale_rows=bk)
    exp = torch.zeros(B, Hq, Sq, D)
    for b in range(B):
        for h in range(Hq):
            hk = h // (Hq // Hkv)
            for i in range(Sq):
                s = torch.stack([(qi[b, h, i].float() @ ki[b, hk, j].float())
                                 * (qs[b, h, i // rows] * ks[b, hk, j // bk])
                                 for j in range(Sk)])
                p = torch.exp2(s - s.max())
                exp[b, h, i] = (p.bfloat16().float() @ v[b, hk].float()) / p.sum()
    torch.testing.assert_close(out, exp, rtol=1e-5, atol=1e-5)


def test_v_fp16_scales_exact_and_in_range():
    """BF16 V carried in FP16 (pv="fp16"): per-channel power-of-two scales, exact conversion in FP16's normal range,
    no overflow even at BF16's extremes, and the scales undo the conversion exactly."""
    from lowbit.attention.reference import quantize_v_fp16_reference, v_fp16_scales

    v = rand(2, 3, 50, 16, seed=4)
    v[0, 0, :, 0] = 3.0e38  # BF16's top binade
    v[0, 1, :, 1] *= 2.0 ** -120  # far below FP16's range before scaling
    v[1, 2, :, 2] = 0.0
    v[1, 0, 7, 3] = 65280.0  # the largest scaled value a BF16 mantissa allows: 1.9921875 · 2^15
    for layout in ("bhsd", "bshd"):
        x = v if layout == "bhsd" else v.transpose(1, 2).contiguous()
        v16, sc = quantize_v_fp16_reference(x, layout=layout)
        assert v16.dtype == torch.float16 and v16.shape == x.shape and sc.shape == (2, 3, 16)
        assert torch.isfinite(v16).all()
        v16h = v16 if layout == "bhsd" else v16.transpose(1, 2)
        back = v16h.float() * sc[:, :, None, :]
        assert torch.equal(back, v.float()), "BF16 -> FP16 under a power-of-two scale must be exact here"
    m, e = torch.frexp(sc)
    assert torch.all(m == 0.5)  # powers of two
    amax = v.float().abs().amax(2)
    scaled = amax / sc
    assert torch.all(scaled <= 65280)
    full = (amax > 0) & (sc > 2.0 ** -126)  # e = 126 is the cap (channel 1 of head (0, 1) hits it)
    assert torch.all(scaled[full] >= 2 ** 15) and sc[0, 1, 1] == 2.0 ** -126
    assert sc[1, 2, 2] == 1 and v_fp16_scales(torch.zeros(1))[0].item() == 1.0


def test_fp16_pv_more_accurate_than_bf16_pv():
    """P in [0, 1] keeps 3 more mantissa bits in FP16: INT8 QK with FP16 P·V is closer to FP32 than with BF16."""
    q, k, v = rand(2, 4, 512, 64, seed=5), rand(2, 4, 512, 64, seed=6), rand(2, 4, 512, 64, seed=7)
    ref = attention_reference(q, k, v)
    e16 = nrmse(attention_quantized_reference(q, k, v, qk="int8", pv="fp16"), ref)
    ebf = nrmse(attention_quantized_reference(q, k, v, qk="int8", pv="bf16"), ref)
    assert e16 < ebf * 0.995, (e16, ebf)
