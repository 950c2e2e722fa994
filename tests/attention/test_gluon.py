"""The warp-specialized Gluon INT8·FP8 forward kernel (lowbit.attention._gluon) against the quantized reference.

GPU tests (sm_90) run the kernel forced (LOWBIT_ATTN_GLUON=force) on prequantized operands and compare with
``attention_prequantized_reference(..., block_n=128)``: the reference's online softmax over the kernel's 128-key
tiles, so only exp2.approx, summation order and the rare P rounding flip they cause separate the two (FP32 output,
``TIGHT`` as for the Triton kernel). CPU tests cover the dispatch rules.
"""
import zlib

import pytest
import torch

import lowbit.attention as A
from lowbit.attention import _gluon as G
from lowbit.attention import reference as R
from lowbit.runtime.device import num_sms

TIGHT = 2e-3  # as tests/attention/test_gpu.py: FP32 output vs the tiled quantized reference
LSE_TOL = 1e-3


gpu = pytest.mark.gpu
needs_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or G.machine_why_not("cuda") is not None,
                                reason="needs an sm_90 GPU and Gluon")


def _nrmse(o, r):
    o, r = o.float(), r.float()
    return ((o - r).norm() / r.norm()).item()


def _rand(*shape, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cuda").to(dtype)


CASES = [  # B, Hq, Hkv, Sq, Sk, D, causal, layout, granularity, return_lse
    (2, 4, 4, 4096, 4096, 128, False, "bhsd", "per_block", True),
    (2, 4, 2, 1000, 1000, 128, True, "bhsd", "per_warp", True),     # GQA, ragged, causal
    (1, 4, 1, 17, 17, 64, False, "bshd", "per_block", True),       # MQA, one partial tile, bshd
    (2, 4, 4, 1, 1, 128, True, "bhsd", "per_block", False),
    (1, 8, 2, 300, 1000, 128, True, "bshd", "per_block", True),    # Sq < Sk: causal bottom-right aligned
    (1, 4, 4, 1000, 300, 64, True, "bhsd", "per_warp", True),      # Sq > Sk: the first rows see no key
    (2, 2, 2, 2048, 2176, 64, False, "bhsd", "per_block", False),   # Sk past a whole tile by 128
    (1, 4, 2, 17, 1, 128, False, "bhsd", "per_block", True),       # one key (Sk == 1 specialized gave NaN)
]


@gpu
@needs_sm90
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,causal,layout,granularity,return_lse", CASES)
def test_gluon_vs_quantized_reference(B, Hq, Hkv, Sq, Sk, D, causal, layout, granularity, return_lse, switches):
    from lowbit.attention import _triton as T
    switches(LOWBIT_ATTN_GLUON="force")
    seed = zlib.crc32(repr((B, Hq, Sq, Sk, D, causal, layout)).encode()) % 1000
    shq = (B, Hq, Sq, D) if layout == "bhsd" else (B, Sq, Hq, D)
    shk = (B, Hkv, Sk, D) if layout == "bhsd" else (B, Sk, Hkv, D)
    q = _rand(*shq, dtype=torch.bfloat16, seed=seed)
    k = (_rand(*shk, dtype=torch.float32, seed=seed + 1) + 3 * torch.randn(D, device="cuda")).bfloat16()
    v = _rand(*shk, dtype=torch.bfloat16, seed=seed + 2)
    qq = T.quantize_qk_triton(q, k, dtype="int8", granularity=granularity, layout=layout)
    v8, vs = T.quantize_v_fp8_triton(v, layout=layout)  # natural key order: the reference's
    vp, _ = T.quantize_v_fp8_triton(v, layout=layout, key_order="wgmma32")  # the kernel's
    kw = dict(q_scale_rows=qq.q_scale_rows, k_scale_rows=qq.block_k, causal=causal, layout=layout)
    res = T.attention_fwd_triton(qq.q, qq.k, vp, q_scale=qq.q_scale, k_scale=qq.k_scale, v_scale=vs, k_mean=qq.k_mean,
                                 return_lse=return_lse, out_dtype=torch.float32, v_key_order="wgmma32", **kw)
    o, lse = res if return_lse else (res, None)
    ro, rl = R.attention_prequantized_reference(qq.q, qq.k, v8, qq.q_scale, qq.k_scale, v_scale=vs, k_mean=qq.k_mean,
                                                return_lse=True, block_n=G.BLOCK_N, **kw)
    assert o.shape == q.shape and o.dtype == torch.float32
    assert _nrmse(o, ro) < TIGHT
    if return_lse:
        fin = torch.isfinite(rl)
        assert torch.equal(fin, torch.isfinite(lse))  # rows that see no key: -inf in both
        assert (lse[fin] - rl[fin]).abs().max().item() < LSE_TOL
    # BF16 output: the same numbers rounded once
    ob = T.attention_fwd_triton(qq.q, qq.k, vp, q_scale=qq.q_scale, k_scale=qq.k_scale, v_scale=vs,
                                out_dtype=torch.bfloat16, v_key_order="wgmma32", **kw)
    assert torch.equal(ob, o.bfloat16())
    # a V in natural key order is outside the kernel's scope: force raises, naming the rule
    with pytest.raises(RuntimeError, match="natural order"):
        T.attention_fwd_triton(qq.q, qq.k, v8, q_scale=qq.q_scale, k_scale=qq.k_scale, v_scale=vs, **kw)


PERSIST_CASES = [  # B, Hq, Hkv, Sq, Sk, causal: more work tiles than SMs, so CTAs take several in turn
    (2, 8, 8, 2000, 2000, False),
    (3, 8, 2, 1000, 1500, True),    # GQA, ragged, causal with Sq < Sk
    (4, 16, 4, 700, 700, True),
]


@gpu
@needs_sm90
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,causal", PERSIST_CASES + [(1, 2, 1, 17, 300, False)])
@pytest.mark.parametrize("persist", [False, True])
def test_gluon_named_barrier_hand_back(B, Hq, Hkv, Sq, Sk, causal, D, persist, monkeypatch, switches):
    """The K/V stages and Q buffers handed back to the loader through named barriers (every math thread arrives,
    GluonOptions(named=True)) give the same bits as through mbarriers, on both grids (persistent: the ring runs on
    across work tiles and the loader drains the last hand-backs), GQA, ragged and causal, with the LSE."""
    from lowbit.attention import _triton as T
    switches(LOWBIT_ATTN_GLUON="force")
    g = torch.Generator(device="cuda").manual_seed(B * 1000 + Sq + D)
    q = torch.randn(B, Hq, Sq, D, generator=g, device="cuda").bfloat16()
    k = (torch.randn(B, Hkv, Sk, D, generator=g, device="cuda") + 2).bfloat16()
    v = torch.randn(B, Hkv, Sk, D, generator=g, device="cuda").bfloat16()
    qq = T.quantize_qk_triton(q, k, dtype="int8")
    vp, vs = T.quantize_v_fp8_triton(v, key_order="wgmma32")
    kw = dict(q_scale=qq.q_scale, k_scale=qq.k_scale, v_scale=vs, q_scale_rows=qq.q_scale_rows, causal=causal,
              out_dtype=torch.float32, v_key_order="wgmma32", return_lse=True)
    o0, l0 = T.attention_fwd_triton(qq.q, qq.k, vp, gluon_options=G.GluonOptions(named=False, persistent=persist),
                                    **kw)
    o1, l1 = T.attention_fwd_triton(qq.q, qq.k, vp, gluon_options=G.GluonOptions(named=True, persistent=persist),
                                    **kw)
    torch.cuda.synchronize()
    assert torch.equal(o1, o0) and torch.equal(l1, l0)
    ro = R.attention_prequantized_reference(qq.q, qq.k, T._v_natural_order(vp, "bhsd"), qq.q_scale, qq.k_scale,
                                            v_scale=vs, q_scale_rows=qq.q_scale_rows, causal=causal,
                                            block_n=G.BLOCK_N)
    assert _nrmse(o1, ro) < TIGHT


@gpu
@needs_sm90
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,causal", PERSIST_CASES)
def test_gluon_persistent_grid_and_flat_descriptors(B, Hq, Hkv, Sq, Sk, causal, monkeypatch, switches):
    """The persistent grid (each CTA several work tiles, the next tile's Q and keys loaded during the last one) and
    the one-CTA-a-tile grid give the same bits; so do the all-heads TMA descriptors (FLAT, contiguous Q/K/V, rows of
    the next head read past Sq / Sk and masked) and the per-head ones (a Q, K and V with padded head strides), and,
    causal, the work tiles taken head by head and heaviest first across all heads."""
    from lowbit.attention import _triton as T
    switches(LOWBIT_ATTN_GLUON="force")
    g = torch.Generator(device="cuda").manual_seed(B * 1000 + Sq)
    q = torch.randn(B, Hq, Sq, 128, generator=g, device="cuda").bfloat16()
    k = (torch.randn(B, Hkv, Sk, 128, generator=g, device="cuda") + 2).bfloat16()
    v = torch.randn(B, Hkv, Sk, 128, generator=g, device="cuda").bfloat16()
    qq = T.quantize_qk_triton(q, k, dtype="int8")
    vp, vs = T.quantize_v_fp8_triton(v, key_order="wgmma32")
    kw = dict(q_scale=qq.q_scale, k_scale=qq.k_scale, v_scale=vs, q_scale_rows=qq.q_scale_rows, causal=causal,
              out_dtype=torch.float32, v_key_order="wgmma32", return_lse=True)
    qv, kv, vv = (tuple(t.stride()) for t in (qq.q, qq.k, vp))
    assert G._flat(qv, kv, vv, B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=Sk, D=128)
    assert num_sms("cuda") < -(-Sq // G.BLOCK_M) * B * Hq
    o1, l1 = T.attention_fwd_triton(qq.q, qq.k, vp, **kw)
    o0, l0 = T.attention_fwd_triton(qq.q, qq.k, vp, gluon_options=G.GluonOptions(persistent=False), **kw)
    # the same codes behind padded head strides: per-head descriptors
    qpad = torch.zeros(B, Hq, Sq + 3, 128, dtype=torch.int8, device="cuda")[:, :, :Sq]
    qpad.copy_(qq.q)
    kpad = torch.zeros(B, Hkv, Sk + 5, 128, dtype=torch.int8, device="cuda")[:, :, :Sk]
    kpad.copy_(qq.k)
    assert not G._flat(tuple(qpad.stride()), tuple(kpad.stride()), vv, B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=Sk, D=128)
    op, lp = T.attention_fwd_triton(qpad, kpad, vp, **kw)
    ro = R.attention_prequantized_reference(qq.q, qq.k, T._v_natural_order(vp, "bhsd"), qq.q_scale, qq.k_scale,
                                            v_scale=vs, q_scale_rows=qq.q_scale_rows, causal=causal,
                                            block_n=G.BLOCK_N)
    assert _nrmse(o1, ro) < TIGHT
    assert torch.equal(o1, o0) and torch.equal(o1, op)
    assert torch.equal(l1, l0) and torch.equal(l1, lp)
    if causal:  # both orders of the work tiles (the default picks one by the size of the K and V codes)
        for heavy in (False, True):
            oh, lh = T.attention_fwd_triton(qq.q, qq.k, vp, gluon_options=G.GluonOptions(heavy_first=heavy), **kw)
            assert torch.equal(o1, oh) and torch.equal(l1, lh)


@gpu
@needs_sm90
@pytest.mark.parametrize("D,causal,granularity", [(128, False, "per_block"), (64, True, "per_warp")])
def test_launches_without_triton_binding_are_the_same(D, causal, granularity, monkeypatch, switches):
    """The quantized call's four launches (the prepass's three and the forward) reuse their compiled kernels by
    specialization key (lowbit.runtime.launch.SpecializedLaunch): a second call with new data of the same shape goes
    through that shortcut, and its output and LSE equal, bit for bit, those of Triton's own launch path."""
    from lowbit.attention import _triton as T
    from lowbit.runtime import launch as _launch
    g = torch.Generator(device="cuda").manual_seed(D)
    shape = (2, 4, 555, D)
    first = [torch.randn(*shape, generator=g, device="cuda").bfloat16() for _ in range(3)]
    again = [torch.randn(*shape, generator=g, device="cuda").bfloat16() for _ in range(3)]
    kw = dict(causal=causal, qk="int8", pv="fp8", granularity=granularity, return_lse=True)
    A.attention(*first, **kw)
    launches = [T._PREPASS_STATS, T._PREPASS_FINALIZE, T._PREPASS_CODES, G._LAUNCHER]
    sizes = [len(x.compiled) for x in launches]
    assert all(sizes), sizes  # each launch went through the shortcut's first call
    jit_runs = []
    for x in launches:  # count the launches that go through Triton's own path (JITFunction.run)
        monkeypatch.setattr(x.fn, "run", (lambda run: lambda *a, **k: jit_runs.append(1) or run(*a, **k))(x.fn.run))
    o1, l1 = A.attention(*again, **kw)
    assert [len(x.compiled) for x in launches] == sizes  # same keys: no new compiled kernels
    assert not jit_runs and _launch._ENABLED  # every launch took the shortcut
    monkeypatch.setattr(_launch, "_ENABLED", False)
    o0, l0 = A.attention(*again, **kw)
    assert len(jit_runs) == 4  # statistics + Q, finalize, K/V codes, the forward: Triton's path
    assert torch.equal(o1, o0) and torch.equal(l1, l0)


@gpu
@needs_sm90
def test_signature_caches_do_not_cross_calls(monkeypatch, switches):
    """The dense call's cached decisions (the prepass's key order, the Gluon kernel's why_not, its launch plan and
    keyed launches) are per signature: calls of the same shape that differ in strides, alignment, mask or window
    each get their own, interleaved in one process, and give what the same call gives with every cache bypassed
    (the launch shortcut off, the Gluon decision and plans recomputed: Triton's own path), bit for bit."""
    from lowbit.attention import _triton as T
    from lowbit.runtime import launch as _launch
    B, H, S, D = 2, 4, 555, 128
    q, k, v = (_rand(B, H, S, D, dtype=torch.bfloat16, seed=s) for s in (1, 2, 3))
    wide = _rand(B, H, S, D + 16, dtype=torch.bfloat16, seed=4)
    wide[..., :D] = k
    off16, off2 = (torch.empty(B * H * S * D + 8, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    off16[8:] = q.flatten()
    off2[1:1 + q.numel()] = q.flatten()
    calls = {
        "plain": (dict(q=q, k=k, v=v), dict(causal=False)),
        "causal": (dict(q=q, k=k, v=v), dict(causal=True)),
        "window": (dict(q=q, k=k, v=v), dict(causal=True, window=(100, 0))),  # the Triton kernel
        "k strided": (dict(q=q, k=wide[..., :D], v=v), dict(causal=True)),
        "q 16-byte offset": (dict(q=off16[8:].view(B, H, S, D), k=k, v=v), dict(causal=True)),
        "q 2-byte offset": (dict(q=off2[1:1 + q.numel()].view(B, H, S, D), k=k, v=v), dict(causal=True)),
    }
    def run(name):
        return A.attention(**calls[name][0], qk="int8", pv="fp8", return_lse=True, **calls[name][1])
    got = {}
    for name in list(calls) * 2:  # interleaved, twice: the second round runs from the caches
        o, lse = run(name)
        if name in got:
            assert torch.equal(o, got[name][0]) and torch.equal(lse, got[name][1]), name
        got[name] = (o, lse)
    monkeypatch.setattr(_launch, "_ENABLED", False)
    for name in calls:
        for cache in (T._WHY_NOT, T._ORDERS, G._PLANS):
            cache.clear()
        o, lse = run(name)
        assert torch.equal(o, got[name][0]) and torch.equal(lse, got[name][1]), name
    # the prepass writes fresh aligned codes whatever q / k look like: the same forward for the same values
    for name in ("k strided", "q 16-byte offset", "q 2-byte offset"):
        assert torch.equal(got[name][0], got["causal"][0]), name
    for a, b in (("plain", "causal"), ("causal", "window")):
        assert not torch.equal(got[a][0], got[b][0]), (a, b)


def test_flat_rule():
    """FLAT needs every head's rows one evenly strided sequence: contiguous Q/K (B, H, S, D) and V's (B, H, D, S_pad)
    buffer; a padded head stride or the bshd layout is not."""
    B, H, S, D = 2, 4, 100, 128
    q = (H * S * D, S * D, D, 1)
    v = (H * D * 128, D * 128, 1, 128)
    assert G._flat(q, q, v, B=B, Hq=H, Hkv=H, Sq=S, Sk=S, D=D)
    assert not G._flat((H * (S + 1) * D, (S + 1) * D, D, 1), q, v, B=B, Hq=H, Hkv=H, Sq=S, Sk=S, D=D)
    bshd = (S * H * D, D, H * D, 1)
    assert not G._flat(q, bshd, v, B=B, Hq=H, Hkv=H, Sq=S, Sk=S, D=D)
    assert not G._flat(q, q, (H * D * 128, D * 130, 1, 128), B=B, Hq=H, Hkv=H, Sq=S, Sk=S, D=D)


@gpu
@needs_sm90
@pytest.mark.parametrize("k_scale_rows,q_scale_rows", [(64, 32), (128, 128), (192, 64)])
def test_gluon_scale_index_mapping(k_scale_rows, q_scale_rows, monkeypatch, switches):
    """(query row, key) -> (q_scale, k_scale): power-of-two scales spread over 2^-12 .. 2^-1 per Q group and K block,
    so a wrong index moves the output far past the tolerance (checked with the K scales reversed)."""
    from lowbit.attention import _triton as T
    switches(LOWBIT_ATTN_GLUON="force")
    g = torch.Generator(device="cuda").manual_seed(5)
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 200, 520, 128
    qi = torch.randint(-127, 128, (B, Hq, Sq, D), generator=g, dtype=torch.int8, device="cuda")
    ki = torch.randint(-127, 128, (B, Hkv, Sk, D), generator=g, dtype=torch.int8, device="cuda")
    vb = torch.randn(B, Hkv, Sk, D, generator=g, device="cuda").bfloat16()
    v8, vs = T.quantize_v_fp8_triton(vb)
    vp, _ = T.quantize_v_fp8_triton(vb, key_order="wgmma32")
    nq, nk = -(-Sq // q_scale_rows), -(-Sk // k_scale_rows)
    qs = 2.0 ** torch.randint(-12, -8, (B, Hq, nq), generator=g, device="cuda").float()
    ks = 2.0 ** torch.randint(-4, -1, (B, Hkv, nk), generator=g, device="cuda").float()
    kw = dict(q_scale_rows=q_scale_rows, k_scale_rows=k_scale_rows)
    o = T.attention_fwd_triton(qi, ki, vp, q_scale=qs, k_scale=ks, v_scale=vs, out_dtype=torch.float32,
                               v_key_order="wgmma32", **kw)
    ro = R.attention_prequantized_reference(qi, ki, v8, qs, ks, v_scale=vs, block_n=G.BLOCK_N, **kw)
    assert _nrmse(o, ro) < TIGHT
    bad = R.attention_prequantized_reference(qi, ki, v8, qs, ks.flip(-1), v_scale=vs, block_n=G.BLOCK_N, **kw)
    assert _nrmse(bad, ro) > 0.1


@gpu
@needs_sm90
def test_gluon_end_to_end_and_force(monkeypatch, switches):
    """lowbit.attention(qk="int8", pv="fp8") runs the Gluon kernel by default on sm_90 (the same output as forcing
    it); LOWBIT_ATTN_GLUON=0 runs the Triton kernel (within the FP32-reference floor too); force on a call outside the
    kernel's scope (a sliding window) raises."""
    q, k, v = (_rand(2, 4, 1000, 128, dtype=torch.bfloat16, seed=s) for s in (31, 32, 33))
    ref = R.attention_reference(q, k, v, causal=True)
    switches(LOWBIT_ATTN_GLUON="force")
    of = A.attention(q, k, v, causal=True, qk="int8", pv="fp8", backend="triton")
    switches(LOWBIT_ATTN_GLUON="1")
    od = A.attention(q, k, v, causal=True, qk="int8", pv="fp8", backend="triton")
    switches(LOWBIT_ATTN_GLUON="0")
    ot = A.attention(q, k, v, causal=True, qk="int8", pv="fp8", backend="triton")
    assert torch.equal(of, od)
    assert _nrmse(of, ref) < 6e-2 and _nrmse(ot, ref) < 6e-2  # FLOOR[("int8", "fp8")] of test_gpu.py
    switches(LOWBIT_ATTN_GLUON="force")
    with pytest.raises(RuntimeError, match="sliding window"):
        A.attention(q, k, v, window=(100, 0), qk="int8", pv="fp8", backend="triton")


def test_mode_rejects_unknown_value():
    from lowbit.runtime import env

    with pytest.raises(ValueError, match="LOWBIT_ATTN_GLUON"):
        with env.override(LOWBIT_ATTN_GLUON="yes"):
            pass


def test_why_not_names_the_rule():
    """The dispatch rules on CPU tensors (no kernel runs): each refusal names its rule; a call inside the scope is
    refused on a CPU for the machine only."""
    q = torch.zeros(1, 2, 16, 128, dtype=torch.int8)
    v = torch.zeros(1, 2, 16, 128, dtype=torch.float8_e4m3fn)
    st = tuple(q.stride())
    big = 1 << 30
    base = dict(qk_mode=1, pv_fp8=True, v_scaled=True, varlen=False, left=big, right=big, big=big, k_scale_rows=64,
                qv=st, kv=st, vv=(st[0], st[1], 1, 16), ov=st, device=q.device, v_key_order="wgmma32")

    def why(q=q, k=q, v=v, **kw):
        return G.why_not(q, k, v, **dict(base, **kw))

    assert "INT8" in why(qk_mode=2) and "INT8" in why(pv_fp8=False) and "INT8" in why(v_scaled=False)
    assert why(varlen=True) == "varlen"
    assert "window" in why(left=100) and "window" in why(right=5)
    assert why(right=0) in ("not an sm_90 GPU", "this Triton has no Gluon warp_specialize")  # causal is in scope
    q96 = torch.zeros(1, 2, 16, 96, dtype=torch.int8)
    assert "head dim 96" in why(q=q96)
    assert "multiple of 64" in why(k_scale_rows=32)
    assert "k's strides" in why(kv=(st[0], st[1], st[2], 2))
    assert "v's strides" in why(vv=(st[0], st[1], 1, 8))  # 8-byte channel stride: not TMA-able
    assert "output" in why(ov=(st[0], st[1], st[2], 2))
    assert "natural order" in why(v_key_order="natural")
    assert why() in ("not an sm_90 GPU", "this Triton has no Gluon warp_specialize")


def test_head_dim_64_needs_the_persistent_grid(monkeypatch, switches):
    """At head dim 64 the kernel runs by default only on the persistent grid (dense Q/K/V): else the Triton kernel is
    faster, and the refusal says so."""
    switches(LOWBIT_ATTN_GLUON="1")
    q = torch.zeros(2, 4, 100, 64, dtype=torch.int8)
    vbuf = torch.zeros(2, 4, 64, 128, dtype=torch.float8_e4m3fn)
    v = vbuf[..., :100].permute(0, 1, 3, 2)
    st = tuple(q.stride())
    big = 1 << 30
    base = dict(qk_mode=1, pv_fp8=True, v_scaled=True, varlen=False, left=big, right=0, big=big, k_scale_rows=64,
                qv=st, kv=st, vv=tuple(v.stride()), ov=st, device=q.device, v_key_order="wgmma32")
    machine = ("not an sm_90 GPU", "this Triton has no Gluon warp_specialize")
    assert G.why_not(q, q, v, **base) in machine
    qp = torch.zeros(2, 4, 101, 64, dtype=torch.int8)[:, :, :100]
    assert "persistent grid" in G.why_not(qp, qp, v, **dict(base, qv=tuple(qp.stride()), kv=tuple(qp.stride())))
    vp = torch.zeros(2, 5, 64, 128, dtype=torch.float8_e4m3fn)[:, :4, :, :100].permute(0, 1, 3, 2)  # padded heads
    assert "persistent grid" in G.why_not(q, q, vp, **dict(base, vv=tuple(vp.stride())))
    off = G.GluonOptions(persistent=False)
    assert "persistent grid" in G.why_not(q, q, v, **base, options=off)
    assert not G.runs_by_default("cpu", 64)
    assert not G.runs_by_default("cpu", 64, off)


def _key_tile_loops(sass: str) -> list:
    """The SASS of every innermost loop that runs the softmax (MUFU.EX2): from a label to the branch back to it."""
    import re
    lines = sass.splitlines()
    at = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^\s*(\.L_x_\d+):", line))}
    spans = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m and at.get(m.group(1), i) < i:
            spans.append((at[m.group(1)], i))
    inner = [(a, b) for a, b in spans if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans)]
    loops = [body for a, b in inner if "MUFU.EX2" in (body := "\n".join(lines[a:b + 1]))]
    assert loops, "no key-tile loop found"
    return loops


@pytest.mark.parametrize("variant", ["plain", "causal_lse_kmean", "d64", "d64_causal_heavy_first"])
def test_gluon_attention_compiles_for_sm90(variant):
    """The kernel compiles for Hopper here (no GPU: Triton's own ptxas). With the Triton the kernel was measured
    with (3.6): no spills, the P·V wgmmas take P from registers (QGMMA with a register A operand, no shared-memory
    round trip), and the mask-free row maxima use the 3-input VIMNMX3 on the INT32 scores."""
    import inspect
    import re

    from sm90_compile import compile_gluon_sm90, sm90_sass

    if not G.GLUON_WS:
        pytest.skip("this Triton has no Gluon warp_specialize")
    const = dict(Q_SCALE_ROWS=128, K_SCALE_ROWS=64, HAS_KMEAN=False, RETURN_LSE=False, REVERSE_M=False, HEAD_DIM=128,
                 STAGES=G.STAGES[128], FLAT=True, LOAD_REGS=G._LAUNCH["LOAD_REGS"],
                 MATH_REGS=G._LAUNCH["MATH_REGS"], HEAVY_FIRST=False)
    if variant == "causal_lse_kmean":
        const.update(REVERSE_M=True, RETURN_LSE=True, HAS_KMEAN=True, FLAT=False)
    elif variant == "d64":
        const.update(HEAD_DIM=64, STAGES=G.STAGES[64])
    elif variant == "d64_causal_heavy_first":
        const.update(HEAD_DIM=64, STAGES=G.STAGES[64], REVERSE_M=True, HEAVY_FIRST=True)
    const["NAMED"] = G.DEFAULT_OPTIONS.named_at(const["HEAD_DIM"])  # the default: named-barrier hand-back at D = 64
    ptrs = dict(Q="*i8", K="*i8", V="*fp8e4nv", O="*bf16")
    sig = {}
    for n in inspect.signature(G.attn_fwd_int8_fp8_ws.fn).parameters:
        sig[n] = "constexpr" if n in const else ptrs.get(n, "*fp32" if n in ("LSE", "QS", "KS", "VS", "KM") else "i32")
    strides = [n for n in sig if sig[n] == "i32" and n.startswith("s") and n[-1] in "bhsd"]
    k = compile_gluon_sm90(G.attn_fwd_int8_fp8_ws, sig, const, divisible=strides,
                           num_warps=G._LAUNCH["num_warps"], maxnreg=G._LAUNCH["maxnreg"])
    # the named-barrier hand-back's ids (NB_BASE and up) are not among those Triton's own barriers use
    triton_ids = {int(i) for i in re.findall(r"\b(?:bar|barrier)\.(?:sync|arrive)(?:\.aligned)?\s+(\d+)", k.asm["ptx"])}
    assert triton_ids and max(triton_ids) < G.NAMED_BARRIER_BASE, triton_ids
    res = sm90_sass(k, triton_version="3.6")
    if res is None:
        return  # compiled; the SASS claims are for the Triton it was measured with
    sass, _ = res
    if variant == "plain":
        assert not re.search(r"\b(STL|LDL)\b", sass), "spills"
    else:  # the LSE's epilogue spills a few loop-invariant values once a work tile; never inside the key-tile loops
        assert all(not re.search(r"\b(STL|LDL)\b", body) for body in _key_tile_loops(sass)), "spills in a key loop"
        assert len(re.findall(r"\b(STL|LDL)\b", sass)) < 32
    assert re.search(r"QGMMA\.64x\d+x32\.F32\.E4M3\.E4M3 R\d+, R\d+, gdesc", sass), "P·V without a register A operand"
    assert "VIMNMX3" in sass
    # a key tile's warpgroup barriers: Triton 3.6 puts one before the wait on the tile's `ready` mbarrier; the
    # mbarrier hand-back adds the single-thread arrive's, the named one (bar.arrive) none
    for body in _key_tile_loops(sass):
        assert len(re.findall(r"\bBAR\.SYNC\b", body)) == (1 if const["NAMED"] else 2)
        assert ("BAR.ARV" in body) == const["NAMED"]


@gpu
@needs_sm90
def test_named_rejects_too_many_stages(monkeypatch, switches):
    """A CTA has 16 named barriers: the hand-back takes one a stage and one a Q buffer from NAMED_BARRIER_BASE, so a
    stage count past that is refused before anything launches, naming both options."""
    from lowbit.attention import _triton as T
    switches(LOWBIT_ATTN_GLUON="force")
    stages = 16 - G.NAMED_BARRIER_BASE - 1  # one more than the ids allow
    opts = G.GluonOptions(named=True, stages=stages)
    q = torch.randn(1, 2, 200, 64, device="cuda").bfloat16()
    qq = T.quantize_qk_triton(q, q, dtype="int8")
    vp, vs = T.quantize_v_fp8_triton(q, key_order="wgmma32")
    with pytest.raises(ValueError, match=f"GluonOptions.stages={stages} with the named-barrier hand-back"):
        T.attention_fwd_triton(qq.q, qq.k, vp, q_scale=qq.q_scale, k_scale=qq.k_scale, v_scale=vs,
                               q_scale_rows=qq.q_scale_rows, out_dtype=torch.float32, v_key_order="wgmma32",
                               gluon_options=opts)


def test_gluon_options_defaults():
    """GluonOptions' defaults: the named-barrier hand-back at NAMED_DIMS only, STAGES per head dim, persistent."""
    o = G.GluonOptions()
    assert o.named_at(64) and not o.named_at(128) and o.persistent and o.heavy_first is None
    assert not G.GluonOptions(named=False).named_at(64) and G.GluonOptions(named=True).named_at(128)
    assert o.stages_at(128) == G.STAGES[128] and G.GluonOptions(stages=2).stages_at(128) == 2


@pytest.mark.parametrize("B,H,S,D,faster", [  # causal, H200 (132 SMs, 60 MiB L2): heavy first / head by head
    (8, 16, 2048, 64, 1.029), (4, 16, 2048, 64, 1.103), (16, 16, 2048, 64, 0.954), (4, 32, 4096, 64, 0.977),
    (2, 16, 4096, 128, 1.158), (4, 32, 4096, 128, 0.920), (1, 32, 8192, 128, 1.109), (2, 32, 2048, 128, 1.072)])
def test_heavy_first_rule_picks_the_faster_order_measured(B, H, S, D, faster, monkeypatch):
    """The default work-tile order of a causal call is the one measured faster at each of these shapes."""
    monkeypatch.setattr(G, "l2_bytes", lambda device: 60 << 20)
    n_tiles = -(-S // G.BLOCK_M) * B * H
    assert G.heavy_first_pays(B=B, Hq=H, Hkv=H, Sq=S, Sk=S, D=D, grid=min(n_tiles, 132), device="cuda") == (faster > 1)


def test_causal_makespan_model():
    """The CTA balance model: a tile costs its key tiles plus one (one tile a CTA: the dearest over the mean); the
    head-by-head order leaves a CTA with a class of query blocks (132 CTAs, 16 blocks a head: 10.6% over the mean),
    heaviest first evens it out; Sq < Sk (bottom-right) costs more keys; the snake hands odd rounds out reversed."""
    f = G.causal_makespan_over_mean
    kw = dict(n_m=16, n_bh=128, Sq=2048, Sk=2048)
    for heavy in (False, True):
        assert f(n_m=4, n_bh=2, grid=8, Sq=512, Sk=512, heavy_first=heavy) == 5 / 3.5
    assert f(**kw, grid=132, heavy_first=False) == pytest.approx(1.106, abs=1e-3)
    assert f(**kw, grid=132, heavy_first=True) == pytest.approx(1.031, abs=1e-3)
    assert f(n_m=2, n_bh=1, grid=2, Sq=256, Sk=256, heavy_first=True) == 3 / 2.5
    assert f(n_m=2, n_bh=1, grid=2, Sq=256, Sk=512, heavy_first=True) == 5 / 4.5
    # 3 blocks x 2 heads on 2 CTAs, heaviest first: costs 4 4 | 3 3 | 2 2; round 1 reversed changes nothing here,
    # head by head: 4 3 | 2 4 | 3 2 with round 1 reversed to 2 4 -> 4 2: CTA 0 gets 4 + 4 + 3 = 11 of 18
    assert f(n_m=3, n_bh=2, grid=2, Sq=384, Sk=384, heavy_first=True) == 1.0
    assert f(n_m=3, n_bh=2, grid=2, Sq=384, Sk=384, heavy_first=False) == 11 / 9


def test_heavy_first_rule_edges(monkeypatch):
    """No heavy-first order for an empty call, a one-CTA grid, more than HEAVY_FIRST_MAX_ROUNDS tiles a CTA (the
    model would cost host time for nothing) or K and V past HEAVY_FIRST_MAX_L2_CACHES L2 caches."""
    monkeypatch.setattr(G, "l2_bytes", lambda device: 60 << 20)
    kw = dict(Hq=16, Hkv=16, D=64, device="cuda")
    assert G.heavy_first_pays(B=8, Sq=2048, Sk=2048, grid=132, **kw)
    assert not G.heavy_first_pays(B=0, Sq=2048, Sk=2048, grid=0, **kw)
    assert not G.heavy_first_pays(B=8, Sq=0, Sk=2048, grid=0, **kw)
    assert not G.heavy_first_pays(B=8, Sq=2048, Sk=2048, grid=1, **kw)
    assert not G.heavy_first_pays(B=8, Sq=2048, Sk=2048, grid=16, **kw)  # 128 tiles a CTA
    monkeypatch.setattr(G, "l2_bytes", lambda device: 12 << 20)  # 32 MiB of K and V over 2.5 x 12 MiB
    assert not G.heavy_first_pays(B=8, Sq=2048, Sk=2048, grid=132, **kw)


def test_key_order_cache_is_per_signature_and_bounded(monkeypatch, switches):
    """The prepass's cached FP8 key-order decision (``_triton._auto_key_order``) is keyed on what decides it (the
    shapes, layout, mask, window, K scale rows, the Gluon switches) and bounded by KEYED_MAX (then cleared). CPU
    tensors: the machine rule answers "natural" here, which is what gets cached."""
    pytest.importorskip("triton")
    from lowbit.attention import _triton as T
    if T.INTERPRETED:
        pytest.skip("the interpreter path is not cached")
    from lowbit.runtime import launch as _launch
    monkeypatch.setattr(_launch, "KEYED_MAX", 3)
    monkeypatch.setattr(T, "_ORDERS", {})
    qc = torch.zeros(1, 2, 64, 128, dtype=torch.int8)
    for s in (64, 128, 192):
        kc = torch.zeros(1, 2, s, 128, dtype=torch.int8)
        assert T._auto_key_order(qc, kc, "int8", "fp8", "bhsd", False, True, None, 64) == "natural"
    assert len(T._ORDERS) == 3
    T._auto_key_order(qc, kc, "int8", "fp8", "bhsd", False, True, None, 64)  # the same signature: no new entry
    assert len(T._ORDERS) == 3
    T._auto_key_order(qc, kc, "int8", "fp8", "bhsd", False, False, None, 64)  # another mask: a new key, past the bound
    assert len(T._ORDERS) == 1
    assert T._auto_key_order(qc, kc, "int8", "fp16", "bhsd", False, True, None, 64) == "natural"  # not FP8 V: no entry
    assert len(T._ORDERS) == 1
