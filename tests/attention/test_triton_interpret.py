"""The Triton prepass and forward kernels under TRITON_INTERPRET=1 on tiny shapes (CPU).

Forward outputs are compared with ``attention_prequantized_reference(block_n=BLOCK_N)``, which follows
the kernel's online softmax tile by tile, so agreement is at FP32 rounding level (measured ~6e-8
NRMSE) except where exp2's last-ulp difference flips the rounding of one P element to bf16/E4M3
(measured 2e-4 once, on a 21x50 case): bound TIGHT = 2e-3, still 5-40x below the FP32 floors."""
import os
import subprocess
import sys

import pytest
import torch
from prepass_check import qk_pair

from lowbit.attention import reference as R

CFG = (16, 16, 4, 1)  # BLOCK_M, BLOCK_N, warps, stages: small tiles so several tiles and masks are exercised
TIGHT = 2e-3


def rand(*shape, seed=0, dtype=torch.bfloat16, offset=None):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return (x if offset is None else x + offset).to(dtype)


def nrmse(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype,granularity,layout", [("int8", "per_block", "bhsd"), ("int8", "per_warp", "bshd"),
                                                     ("fp8", "per_warp", "bhsd")])
def test_prepass_bit_exact(tri, dtype, granularity, layout):
    q = rand(2, 4, 45, 32, seed=1, dtype=torch.float16)
    k = rand(2, 2, 37, 32, seed=2, dtype=torch.float16, offset=torch.linspace(-4, 4, 32))
    v = rand(2, 2, 37, 32, seed=3)
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    kw = dict(dtype=dtype, granularity=granularity, block_q=32, warp_q=16, block_k=16, layout=layout)
    a, r = qk_pair(tri.quantize_qk_triton, q, k, **kw)
    assert torch.equal(a.q.view(torch.int8), r.q.view(torch.int8)) and torch.equal(a.k.view(torch.int8),
                                                                                   r.k.view(torch.int8))
    assert torch.equal(a.q_scale, r.q_scale) and torch.equal(a.k_scale, r.k_scale)
    v8, vs = tri.quantize_v_fp8_triton(v, layout=layout)
    r8, rs = R.quantize_v_fp8_reference(v, layout=layout)
    assert torch.equal(v8.float(), r8.float()) and torch.equal(vs, rs)
    v16, vs = tri.quantize_v_fp16_triton(v, layout=layout)
    r16, rs = R.quantize_v_fp16_reference(v, layout=layout)
    assert v16.dtype == torch.float16 and v16.stride() == v.stride()
    assert torch.equal(v16, r16) and torch.equal(vs, rs)


@pytest.mark.parametrize("S,layout", [(37, "bhsd"), (64, "bshd"), (17, "bshd")])
def test_v_fp8_wgmma32_key_order(tri, S, layout):
    """key_order="wgmma32": the same codes as the natural order, key s stored at wgmma32_position(s) (a bijection of
    each 32-key chunk), the last chunk's unused positions zero; _v_natural_order undoes it bit for bit; a forward call
    that cannot run the Gluon kernel (here: the interpreter) reads it through that fallback with the natural order's
    output, bit for bit."""
    pos = tri.wgmma32_position(torch.arange(64))
    assert sorted(pos.tolist()) == list(range(64)) and pos[8].item() == 2 and pos[6].item() == 12
    v = rand(2, 2, S, 32, seed=9)
    if layout == "bshd":
        v = v.transpose(1, 2).contiguous()
    n8, ns = tri.quantize_v_fp8_triton(v, layout=layout)
    p8, ps = tri.quantize_v_fp8_triton(v, layout=layout, key_order="wgmma32")
    assert torch.equal(ns, ps)
    st = lambda t: t.permute(0, 1, 3, 2) if layout == "bhsd" else t.permute(0, 2, 3, 1)  # noqa: E731  (B,H,D,S)
    s32 = -(-S // 32) * 32
    full = st(p8).as_strided(st(p8).shape[:3] + (s32,), st(p8).stride()).view(torch.uint8)
    idx = tri.wgmma32_position(torch.arange(S))
    assert torch.equal(full[..., idx], st(n8).view(torch.uint8))
    unused = sorted(set(range(s32)) - set(idx.tolist()))
    assert not full[..., unused].any()
    assert torch.equal(tri._v_natural_order(p8, layout).view(torch.uint8), n8.view(torch.uint8))
    q, k = rand(2, 4, 21, 32, seed=10), rand(2, 2, S, 32, seed=11, offset=1.0)
    if layout == "bshd":
        q, k = (t.transpose(1, 2).contiguous() for t in (q, k))
    a = R.quantize_qk_reference(q, k, dtype="int8", block_q=32, block_k=16, layout=layout)
    kw = dict(q_scale=a.q_scale, k_scale=a.k_scale, q_scale_rows=a.q_scale_rows, k_scale_rows=16, layout=layout,
              causal=True, config=CFG)
    on = tri.attention_fwd_triton(a.q, a.k, n8, v_scale=ns, **kw)
    op = tri.attention_fwd_triton(a.q, a.k, p8, v_scale=ps, v_key_order="wgmma32", **kw)
    assert torch.equal(on, op)
    with pytest.raises(ValueError, match="key_order"):
        tri.quantize_v_fp8_triton(v, layout=layout, key_order="mma")
    with pytest.raises(ValueError, match="dense"):
        tri.quantize_v_fp8_triton(v.reshape(-1, *v.shape[2:]) if layout == "bshd" else v[0].transpose(0, 1),
                                  cu_seqlens_k=torch.tensor([0, S], dtype=torch.int32), key_order="wgmma32")
    with pytest.raises(ValueError, match="FP8 V"):
        tri.attention_fwd_triton(a.q, a.k, v, v_scale=ns, v_key_order="wgmma32", **kw)
    if -(-S // 16) * 16 < s32:  # a natural-order buffer (padded to 16) labelled wgmma32: the kernels would read past it
        with pytest.raises(ValueError, match="padded to whole 32-key chunks"):
            tri.attention_fwd_triton(a.q, a.k, n8, v_scale=ns, v_key_order="wgmma32", **kw)


def test_prepass_non_power_of_two_blocks(tri):
    """block_k / block_q / warp_q need not be powers of two (the kernel pads its row range and masks)."""
    q, k = rand(1, 2, 50, 32, seed=7), rand(1, 2, 41, 32, seed=8, offset=2.0)
    for kw in (dict(block_k=12, block_q=24), dict(granularity="per_warp", block_q=24, warp_q=12, block_k=20)):
        a, r = qk_pair(tri.quantize_qk_triton, q, k, **kw)
        assert torch.equal(a.q, r.q) and torch.equal(a.k, r.k), kw
        assert torch.equal(a.q_scale, r.q_scale) and torch.equal(a.k_scale, r.k_scale), kw


def test_prepass_varlen_bit_exact(tri):
    cq = torch.tensor([0, 20, 21, 60], dtype=torch.int32)
    ck = torch.tensor([0, 7, 40, 52], dtype=torch.int32)
    q, k, v = rand(60, 4, 32, seed=4), rand(52, 2, 32, seed=5, offset=1.5), rand(52, 2, 32, seed=6)
    kw = dict(granularity="per_warp", block_q=32, warp_q=16, block_k=16, cu_seqlens_q=cq, cu_seqlens_k=ck,
              max_seqlen_q=39, max_seqlen_k=33)
    a, r = qk_pair(tri.quantize_qk_triton, q, k, **kw)
    assert torch.equal(a.q, r.q) and torch.equal(a.k, r.k)
    assert torch.equal(a.q_scale, r.q_scale) and torch.equal(a.k_scale, r.k_scale)
    v8, vs = tri.quantize_v_fp8_triton(v, cu_seqlens_k=ck, max_seqlen_k=33)
    r8, rs = R.quantize_v_fp8_reference(v, cu_seqlens_k=ck)
    assert torch.equal(v8.float(), r8.float()) and torch.equal(vs, rs)
    v16, vs = tri.quantize_v_fp16_triton(v * 1000, cu_seqlens_k=ck, max_seqlen_k=33)
    r16, rs = R.quantize_v_fp16_reference(v * 1000, cu_seqlens_k=ck)
    assert torch.equal(v16, r16) and torch.equal(vs, rs)


@pytest.mark.parametrize("pv,layout,varlen", [("fp8", "bhsd", False), ("fp8", "bshd", False), ("fp16", "bshd", False),
                                               ("fp8", "bhsd", True)])
def test_fused_prepass_equals_separate(tri, pv, layout, varlen):
    """``prepass_triton`` (Q, K and V in three launches) gives what ``quantize_qk_triton`` and ``quantize_v_*_triton``
    give, bit for bit, and both equal the references (on the prepass's K mean). 300 keys: three statistics chunks,
    the last one partial; GQA; K with channel offsets so the mean matters."""
    if varlen:
        cq, ck = torch.tensor([0, 45, 46, 90], dtype=torch.int32), torch.tensor([0, 300, 301, 430], dtype=torch.int32)
        q, k, v = rand(90, 4, 32, seed=31), rand(430, 2, 32, seed=32, offset=3.0), rand(430, 2, 32, seed=33)
        kw = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=45, max_seqlen_k=300)
        vkw = dict(cu_seqlens_k=ck, max_seqlen_k=300)
    else:
        q, k, v = rand(2, 4, 45, 32, seed=31), rand(2, 2, 300, 32, seed=32, offset=3.0), rand(2, 2, 300, 32, seed=33)
        if layout == "bshd":
            q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        kw = vkw = dict(layout=layout)
    qkw = dict(granularity="per_warp", block_q=32, warp_q=16, block_k=16, **kw)
    qq, vo, vs, order = tri.prepass_triton(q, k, v, qk="int8", pv=pv, key_order="auto", **qkw)
    assert order == "natural"  # the interpreter has no Gluon kernel
    a, r = qk_pair(tri.quantize_qk_triton, q, k, **qkw)
    for name in ("q", "k", "q_scale", "k_scale", "k_mean"):
        assert torch.equal(getattr(qq, name), getattr(a, name)), name
    assert torch.equal(qq.q, r.q) and torch.equal(qq.k, r.k)
    assert torch.equal(qq.q_scale, r.q_scale) and torch.equal(qq.k_scale, r.k_scale)
    sep = (tri.quantize_v_fp8_triton if pv == "fp8" else tri.quantize_v_fp16_triton)(v, **vkw)
    ref = (R.quantize_v_fp8_reference if pv == "fp8" else R.quantize_v_fp16_reference)(
        v, **{n: x for n, x in vkw.items() if n != "max_seqlen_k"})
    for got in (sep, ref):
        assert torch.equal(vo.float(), got[0].float()) and torch.equal(vs, got[1])
    assert vo.stride() == sep[0].stride()  # the same (sequence-contiguous for FP8) storage
    if pv == "fp8" and not varlen:  # the Gluon kernel's key order, with K groups (16 rows) narrower than a 32-key chunk
        _, p8, ps, _ = tri.prepass_triton(q, k, v, qk="int8", pv="fp8", key_order="wgmma32", **qkw)
        assert torch.equal(ps, vs) and torch.equal(tri._v_natural_order(p8, layout).float(), vo.float())
        st = lambda t: t.permute(0, 1, 3, 2) if layout == "bhsd" else t.permute(0, 2, 3, 1)  # noqa: E731  (B,H,D,S)
        full = st(p8).as_strided(st(p8).shape[:3] + (320,), st(p8).stride()).view(torch.uint8)
        assert not full[..., sorted(set(range(320)) - set(tri.wgmma32_position(torch.arange(300)).tolist()))].any()
    with pytest.raises(ValueError, match="nothing to quantize"):
        tri.prepass_triton(q, k, v)


def _prepare(tri, q, k, v, qk, pv, layout="bhsd", **vl):
    if qk == "bf16":
        qa, ka, qs, ks, km, rows = q, k, None, None, None, 128
    else:
        a = R.quantize_qk_reference(q, k, dtype=qk, granularity="per_warp", block_q=32, warp_q=16, block_k=16,
                                    layout=layout, **vl)
        qa, ka, qs, ks, km, rows = a.q, a.k, a.q_scale, a.k_scale, a.k_mean, a.q_scale_rows
    if pv == "fp8":
        va, vs = tri.quantize_v_fp8_triton(v, layout=layout, cu_seqlens_k=vl.get("cu_seqlens_k"))
    elif pv == "fp16":
        va, vs = tri.quantize_v_fp16_triton(v, layout=layout, cu_seqlens_k=vl.get("cu_seqlens_k"))
    else:
        va, vs = v, None
    return dict(q=qa, k=ka, v=va, q_scale=qs, k_scale=ks, v_scale=vs, k_mean=km, q_scale_rows=rows, k_scale_rows=16)


CASES = [  # (qk, pv, Sq, Sk, causal, window, layout)
    ("bf16", "bf16", 37, 37, True, None, "bhsd"),
    ("int8", "bf16", 21, 50, False, None, "bshd"),
    ("int8", "bf16", 40, 29, True, None, "bhsd"),      # Sq > Sk: leading rows see nothing
    ("int8", "fp8", 33, 47, False, (9, 3), "bhsd"),
    ("int8", "fp16", 40, 29, True, None, "bshd"),     # BF16 V carried in FP16 under power-of-two scales
    ("bf16", "fp16", 37, 37, False, None, "bhsd"),
    ("fp8", "fp8", 1, 17, True, None, "bshd"),
    ("fp8", "bf16", 26, 26, False, (-1, 4), "bhsd"),
]


@pytest.mark.parametrize("qk,pv,Sq,Sk,causal,window,layout", CASES)
def test_forward_matches_tiled_reference(tri, qk, pv, Sq, Sk, causal, window, layout):
    q, k, v = rand(1, 4, Sq, 32, seed=7), rand(1, 2, Sk, 32, seed=8, offset=0.5), rand(1, 2, Sk, 32, seed=9)
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    ops = _prepare(tri, q, k, v, qk, pv, layout)
    o, lse = tri.attention_fwd_triton(**ops, causal=causal, window=window, layout=layout, return_lse=True,
                                      out_dtype=torch.float32, config=CFG)
    ro, rl = R.attention_prequantized_reference(ops["q"], ops["k"], ops["v"], ops["q_scale"], ops["k_scale"],
                                                v_scale=ops["v_scale"], k_mean=ops["k_mean"],
                                                q_scale_rows=ops["q_scale_rows"], k_scale_rows=16, causal=causal,
                                                window=window, layout=layout, return_lse=True, block_n=16)
    assert nrmse(o, ro) < TIGHT
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rl))
    fin = torch.isfinite(rl)
    assert (lse[fin] - rl[fin]).abs().max() < 1e-5
    ref = R.attention_reference(q, k, v, causal=causal, window=window, layout=layout)
    assert nrmse(o, ref) < {"bf16": 3e-3, "int8": 3e-2, "fp8": 8e-2}[qk if pv != "fp8" else "fp8"]


@pytest.mark.parametrize("qk,pv,Sq,Sk,causal,window,layout", CASES)
def test_forward_tma_descriptors_same_as_pointers(tri, qk, pv, Sq, Sk, causal, window, layout, monkeypatch,
                                                  switches):
    """LOWBIT_TMA=1: K/V tiles through tensor descriptors (TMA on the GPU) give the pointer path's output
    bit for bit (the same math; ragged Sk tiles rely on the descriptor's zero fill past Sk)."""
    q, k, v = rand(1, 4, Sq, 32, seed=7), rand(1, 2, Sk, 32, seed=8, offset=0.5), rand(1, 2, Sk, 32, seed=9)
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    ops = _prepare(tri, q, k, v, qk, pv, layout)
    kw = dict(causal=causal, window=window, layout=layout, return_lse=True, out_dtype=torch.float32, config=CFG)
    switches(LOWBIT_TMA=False)
    o0, l0 = tri.attention_fwd_triton(**ops, **kw)
    used = []
    real = tri.tma_enabled
    monkeypatch.setattr(tri, "tma_enabled", lambda *a: used.append(real(*a)) or used[-1])
    switches(LOWBIT_TMA=True)
    o1, l1 = tri.attention_fwd_triton(**ops, **kw)
    assert used == [True]
    assert torch.equal(o0, o1) and torch.equal(l0, l1)


@pytest.mark.parametrize("qk,pv,Sq,Sk,causal,window,layout", [c for c in CASES if c[4] or c[5]])
def test_forward_heavy_first_same_bits(tri, qk, pv, Sq, Sk, causal, window, layout, monkeypatch):
    """``heavy_first=True`` (grid (heads, query blocks): every head's last query block first) gives the head-by-head
    order's output bit for bit, GQA, Sq > Sk and Sq < Sk included; off the GPU the default is head by head; a
    sliding window keeps the head-by-head grid whatever is asked."""
    q, k, v = rand(2, 4, Sq, 32, seed=17), rand(2, 2, Sk, 32, seed=18, offset=0.5), rand(2, 2, Sk, 32, seed=19)
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    ops = _prepare(tri, q, k, v, qk, pv, layout)
    kw = dict(causal=causal, window=window, layout=layout, return_lse=True, out_dtype=torch.float32, config=CFG)
    o0, l0 = tri.attention_fwd_triton(**ops, **kw, heavy_first=False)
    grids = []
    real = tri._ATTN_FWD.__getitem__
    monkeypatch.setattr(type(tri._ATTN_FWD), "__getitem__", lambda self, g: grids.append(g) or real(g))
    o1, l1 = tri.attention_fwd_triton(**ops, **kw, heavy_first=True)
    monkeypatch.undo()
    o2, l2 = tri.attention_fwd_triton(**ops, **kw)
    heads = 2 * 4
    assert grids == [(heads, -(-Sq // CFG[0])) if window is None else (-(-Sq // CFG[0]), heads)]
    assert torch.equal(o0, o1) and torch.equal(l0, l1)
    assert torch.equal(o0, o2) and torch.equal(l0, l2)
    assert not tri.heavy_first_pays(ops["k"], ops["v"], B=2, Hkv=2, Sk=Sk, varlen=False, device=q.device)


@pytest.mark.parametrize("B,H,S,D,int8_bf16,fp8_fp8", [  # causal, H200 (60 MiB L2): heavy first / head by head
    (8, 16, 2048, 64, 1.089, 1.041), (4, 16, 2048, 64, 1.178, 1.095), (16, 16, 2048, 64, 1.032, 1.000),
    (4, 32, 4096, 64, 1.049, 1.013), (2, 16, 4096, 128, 1.103, 1.107), (4, 32, 4096, 128, 0.988, 1.014),
    (1, 32, 8192, 128, 1.073, 1.044), (2, 32, 2048, 128, 1.078, 1.086)])
def test_heavy_first_rule_against_measured(tri, B, H, S, D, int8_bf16, fp8_fp8, monkeypatch):
    """The Triton kernel's default order at measured shapes (INT8 Q·Kᵀ with BF16 V carried in FP16, and FP8 / FP8):
    heavy first wherever it measured at least as fast, head by head where it measured slower; varlen head by head."""
    monkeypatch.setattr(tri._gluon, "l2_bytes", lambda device: 60 << 20)
    cuda = torch.device("cuda")
    for (kd, vd), faster in (((torch.int8, torch.float16), int8_bf16),
                             ((torch.float8_e4m3fn, torch.float8_e4m3fn), fp8_fp8)):
        k, v = torch.empty(1, 1, 1, D, dtype=kd, device="meta"), torch.empty(1, 1, 1, D, dtype=vd, device="meta")
        assert tri.heavy_first_pays(k, v, B=B, Hkv=H, Sk=S, varlen=False, device=cuda) == (faster >= 1), (kd, faster)
    assert not tri.heavy_first_pays(k, v, B=1, Hkv=1, Sk=64, varlen=True, device=cuda)


@pytest.mark.parametrize("qk,pv", [("int8", "fp8"), ("bf16", "bf16")])
def test_forward_out_like_writes_model_layout(tri, qk, pv):
    """``out_like``: q, k, v as (B, H, S, D) views of (B, S, H, D) tensors (what a model's projections give) and the
    output written in that memory order, with the bits of the contiguous call; a mismatched ``out_like`` is refused."""
    q, k, v = (rand(2, 3, 29, 32, seed=s, offset=o) for s, o in ((21, None), (22, 0.5), (23, None)))
    views = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    kw = dict(causal=True, return_lse=True, out_dtype=torch.bfloat16, config=CFG)
    o0, l0 = tri.attention_fwd_triton(**_prepare(tri, q, k, v, qk, pv), **kw)
    o1, l1 = tri.attention_fwd_triton(**_prepare(tri, *views, qk, pv), out_like=views[0], **kw)
    assert o0.is_contiguous() and o1.stride() == views[0].stride()
    assert torch.equal(o0, o1) and torch.equal(l0, l1)
    with pytest.raises(ValueError, match="out_like must have q's shape"):
        tri.attention_fwd_triton(**_prepare(tri, q, k, v, qk, pv), out_like=q[:, :2], **kw)


def test_tma_refused_where_its_rules_do_not_hold(tri, switches):
    switches(LOWBIT_TMA=True)
    k = torch.zeros(1, 2, 40, 32, dtype=torch.bfloat16)
    views = lambda t: (t.stride(0), t.stride(1), t.stride(2), t.stride(3))  # noqa: E731
    assert tri.tma_enabled(k, k, views(k), views(k), False, False)
    assert not tri.tma_enabled(k, k, views(k), views(k), True, True)  # varlen FP8 V: sequences start anywhere
    odd = torch.zeros(1, 2, 40, 36, dtype=torch.int8)  # a 36-byte row stride is not a multiple of 16
    assert not tri.tma_enabled(odd, k, views(odd), views(k), False, False)
    kt = k.transpose(2, 3)  # head_dim not unit-stride
    assert not tri.tma_enabled(kt, k, views(kt), views(k), False, False)
    switches(LOWBIT_TMA=False)
    assert not tri.tma_enabled(k, k, views(k), views(k), False, False)
    from lowbit.runtime import env

    assert env.SWITCHES["LOWBIT_TMA"].default is True  # on by default


def test_forward_varlen_gqa(tri):
    cq = torch.tensor([0, 20, 21, 60], dtype=torch.int32)
    ck = torch.tensor([0, 7, 40, 52], dtype=torch.int32)
    q, k, v = rand(60, 4, 32, seed=10), rand(52, 2, 32, seed=11), rand(52, 2, 32, seed=12)
    vl = dict(cu_seqlens_q=cq, cu_seqlens_k=ck)
    ops = _prepare(tri, q, k, v, "int8", "fp8", **vl)
    o, lse = tri.attention_fwd_triton(**ops, causal=True, return_lse=True, out_dtype=torch.float32, config=CFG,
                                      max_seqlen_q=39, max_seqlen_k=33, **vl)
    ro, rl = R.attention_prequantized_reference(ops["q"], ops["k"], ops["v"], ops["q_scale"], ops["k_scale"],
                                                v_scale=ops["v_scale"], k_mean=ops["k_mean"], q_scale_rows=16,
                                                k_scale_rows=16, causal=True, return_lse=True, block_n=16, **vl)
    assert nrmse(o, ro) < TIGHT
    fin = torch.isfinite(rl)
    assert torch.equal(torch.isfinite(lse), fin) and (lse[fin] - rl[fin]).abs().max() < 1e-5


def test_scale_index_mapping(tri):
    """Tiny GQA case with scales spread over 2^-12 .. 2^-1 so that reading the wrong (m_block,
    n_block) -> (q_scale, k_scale) entry, or the q head instead of the kv head, changes the output."""
    g = torch.Generator().manual_seed(13)
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 40, 48, 32
    qi = torch.randint(-127, 128, (B, Hq, Sq, D), generator=g, dtype=torch.int8)
    ki = torch.randint(-127, 128, (B, Hkv, Sk, D), generator=g, dtype=torch.int8)
    v = torch.randn(B, Hkv, Sk, D, generator=g).bfloat16()
    qs = 2.0 ** torch.randint(-12, -8, (B, Hq, 6), generator=g).float()   # per-warp rows=8 over 48 padded rows
    ks = 2.0 ** torch.randint(-4, -1, (B, Hkv, 3), generator=g).float()   # block_k = 16
    o = tri.attention_fwd_triton(qi, ki, v, q_scale=qs, k_scale=ks, q_scale_rows=8, k_scale_rows=16,
                                 out_dtype=torch.float32, config=CFG)
    ro = R.attention_prequantized_reference(qi, ki, v, qs, ks, q_scale_rows=8, k_scale_rows=16, block_n=16)
    assert nrmse(o, ro) < TIGHT
    # the same data with the k-scale blocks permuted is far away: the mapping is observable
    bad = R.attention_prequantized_reference(qi, ki, v, qs, ks.flip(-1), q_scale_rows=8, k_scale_rows=16, block_n=16)
    assert nrmse(bad, ro) > 0.1


# (qk, pv, granularity, input dtype, causal): variants that differ in one dtype or one switch at a time
VARIANTS = {
    "A": ("int8", "bf16", "per_warp", torch.bfloat16, True),
    "B": ("int8", "fp8", "per_warp", torch.bfloat16, True),     # FP8 V (PV_FP8, V_SCALED; prepass: FP8 V codes)
    "C": ("int8", "fp16", "per_warp", torch.bfloat16, True),    # BF16 V carried in FP16 (V dtype, V_SCALED)
    "D": ("int8", "bf16", "per_block", torch.bfloat16, True),   # Q_SCALE_ROWS only
    "E": ("fp8", "bf16", "per_warp", torch.bfloat16, True),     # QK_MODE (prepass: TO_FP8, QMAX)
    "F": ("bf16", "bf16", "per_block", torch.bfloat16, True),   # 16-bit Q·Kᵀ: no scales, no k_mean
    "G": ("int8", "bf16", "per_warp", torch.float16, True),     # FP16 inputs: V and O dtypes only
    "H": ("int8", "bf16", "per_warp", torch.bfloat16, False),   # no mask (REVERSE_M)
}


def _run_variant(tri, name):
    """(kernel output, the tiled quantized reference) of one variant on the same 40-row, 4-head GQA shapes; the Triton
    prepass is checked bit for bit against the reference quantizers on the way."""
    qk, pv, granularity, dtype, causal = VARIANTS[name]
    q, k, v = (rand(1, 4, 40, 32, seed=21, dtype=dtype), rand(1, 2, 40, 32, seed=22, dtype=dtype, offset=0.5),
               rand(1, 2, 40, 32, seed=23, dtype=dtype))
    if qk == "bf16":
        qa, ka, qs, ks, km, rows = q, k, None, None, None, 128
    else:
        kw = dict(dtype=qk, granularity=granularity, block_q=32, warp_q=16, block_k=16)
        a, r = qk_pair(tri.quantize_qk_triton, q, k, **kw)
        assert torch.equal(a.q.view(torch.int8), r.q.view(torch.int8)), name
        assert torch.equal(a.k.view(torch.int8), r.k.view(torch.int8)), name
        assert torch.equal(a.q_scale, r.q_scale) and torch.equal(a.k_scale, r.k_scale), name
        qa, ka, qs, ks, km, rows = a.q, a.k, a.q_scale, a.k_scale, a.k_mean, a.q_scale_rows
    va, vs = v, None
    if pv == "fp8":
        (va, vs), (rv, rs) = tri.quantize_v_fp8_triton(v), R.quantize_v_fp8_reference(v)
        assert torch.equal(va.float(), rv.float()) and torch.equal(vs, rs), name
    elif pv == "fp16":
        (va, vs), (rv, rs) = tri.quantize_v_fp16_triton(v), R.quantize_v_fp16_reference(v)
        assert torch.equal(va, rv) and torch.equal(vs, rs), name
    o = tri.attention_fwd_triton(qa, ka, va, q_scale=qs, k_scale=ks, v_scale=vs, k_mean=km, q_scale_rows=rows,
                                 k_scale_rows=16, causal=causal, out_dtype=torch.float32, config=CFG)
    ref = R.attention_prequantized_reference(qa, ka, va, qs, ks, v_scale=vs, k_mean=km, q_scale_rows=rows,
                                             k_scale_rows=16, causal=causal, block_n=16)
    return o, ref


def test_kernel_variants_never_reused_across_ab_runs(tri):
    """Compiled-kernel caches are keyed on every dtype and quantization setting, so A/B runs never reuse
    the wrong variant. Variants are interleaved on the same shapes (A B A C A ... : int8/bf16 -> int8/fp8 ->
    int8/bf16 ...); every run must (1) give bit for bit what that variant gave on its first run and (2) match its
    own tiled quantized reference far more closely than any other variant's (the references of the two closest
    variants, int8 with BF16 vs FP16 P·V, are 1e-3 NRMSE apart; a kernel is within 2e-4 of its own, typically
    1e-7), so a reused variant fails even on a variant's first run, which is what a fresh process would give.
    Under the interpreter nothing is compiled: this checks that the launchers derive every dtype-dependent switch
    per call; on a GPU, Triton keys its compiled kernels on those switches and the argument dtypes."""
    first, refs = {}, {}
    for name in "ABACADAEBFGAHA":
        o, ref = _run_variant(tri, name)
        refs.setdefault(name, ref)
        if name in first:
            assert torch.equal(o, first[name]), f"variant {name} changed after other variants ran"
        else:
            first[name] = o
    for name, o in first.items():
        own = nrmse(o, refs[name])
        nearest = min(nrmse(o, r) for n, r in refs.items() if n != name)
        assert own < TIGHT and own * 3 < nearest, (name, own, nearest)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="already in the interpreter process")
def test_interpreter_subprocess():
    """Run this file's kernel tests in a child process that starts with TRITON_INTERPRET=1."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", __file__],
                       env=env, capture_output=True, text=True, timeout=600)
    tail = (r.stdout + r.stderr)[-4000:]
    if r.returncode == 5 or " passed" not in r.stdout:  # nothing ran: interpreter missing
        pytest.skip(f"interpreter tests did not run:\n{tail}")
    assert r.returncode == 0, tail
