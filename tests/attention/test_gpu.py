"""GPU tests: Triton prepass and forward kernels against the quantized reference (tight) and the FP32
reference (cos-sim, rel-L1, NRMSE floors).  Metrics are appended to $ATTN_METRICS_LOG (JSON lines)
when set, for the report."""
import json
import os
import zlib

import pytest
import torch
from prepass_check import qk_pair

import lowbit.attention as A
from lowbit.attention import reference as R

pytestmark = pytest.mark.gpu

# vs the FP32 reference on N(0,1) data: CPU-measured floors of the same math (see
# test_quantized_reference.FLOORS) x ~1.5, plus bf16/fp16 output rounding (~1.1e-3 NRMSE for bf16).
FLOOR = {("bf16", "bf16"): 4e-3, ("int8", "bf16"): 2e-2, ("int8", "fp16"): 2e-2, ("int8", "fp8"): 6e-2,
         ("fp8", "fp8"): 8e-2, ("fp8", "bf16"): 6e-2, ("fp8", "fp16"): 6e-2}
COS = {("bf16", "bf16"): 0.99999, ("int8", "bf16"): 0.9997, ("int8", "fp16"): 0.9997, ("int8", "fp8"): 0.997,
       ("fp8", "fp8"): 0.995, ("fp8", "bf16"): 0.998, ("fp8", "fp16"): 0.998}
# kernel (fp32 output) vs the tiled quantized reference run on the same quantized operands: only
# exp2.approx / summation order and the rare P rounding flip they cause (interpreter: 6e-8 .. 2e-4).
TIGHT = 2e-3


def _log(rec):
    path = os.environ.get("ATTN_METRICS_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")


def metrics(out, ref):
    o, r = out.float().flatten(), ref.float().flatten()
    return dict(nrmse=((o - r).norm() / r.norm()).item(), rel_l1=((o - r).abs().sum() / r.abs().sum()).item(),
                cos=torch.nn.functional.cosine_similarity(o, r, dim=0).item())


def rand(*shape, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cuda").to(dtype)


def _prep(tri, q, k, v, qk, pv, granularity, layout="bhsd", **vl):
    if qk == "bf16":
        qa, ka, qs, ks, km, rows = q, k, None, None, None, 128
    else:
        t, r = qk_pair(tri.quantize_qk_triton, q, k, dtype=qk, granularity=granularity, layout=layout, **vl)
        # prepass: bit-identical codes and scales (on the prepass's K mean; div.rn; same rounding steps)
        assert torch.equal(t.q.view(torch.int8), r.q.view(torch.int8)), "q codes differ"
        assert torch.equal(t.k.view(torch.int8), r.k.view(torch.int8)), "k codes differ"
        assert torch.equal(t.q_scale, r.q_scale) and torch.equal(t.k_scale, r.k_scale)
        qa, ka, qs, ks, km, rows = t.q, t.k, t.q_scale, t.k_scale, t.k_mean, t.q_scale_rows
    if pv == "fp8":
        va, vs = tri.quantize_v_fp8_triton(v, layout=layout, cu_seqlens_k=vl.get("cu_seqlens_k"),
                                           max_seqlen_k=vl.get("max_seqlen_k"))
        r8, rs = R.quantize_v_fp8_reference(v, layout=layout, cu_seqlens_k=vl.get("cu_seqlens_k"))
        assert torch.equal(va.float(), r8.float()) and torch.equal(vs, rs), "v fp8 differs"
    elif pv == "fp16" and v.dtype == torch.bfloat16:
        va, vs = tri.quantize_v_fp16_triton(v, layout=layout, cu_seqlens_k=vl.get("cu_seqlens_k"),
                                            max_seqlen_k=vl.get("max_seqlen_k"))
        r16, rs = R.quantize_v_fp16_reference(v, layout=layout, cu_seqlens_k=vl.get("cu_seqlens_k"))
        assert torch.equal(va, r16) and torch.equal(vs, rs), "v fp16 differs"
    else:
        va, vs = v, None
    return qa, ka, va, qs, ks, vs, km, rows


MODES = [("bf16", "bf16", "per_block"), ("int8", "bf16", "per_block"), ("int8", "bf16", "per_warp"),
         ("int8", "fp16", "per_block"), ("int8", "fp8", "per_block"), ("fp8", "fp8", "per_block")]
# kernel output (q's dtype) vs the tiled quantized reference on bit-identical quantized operands: the
# output rounding (bf16 ~1.5e-3 NRMSE, fp16 ~2e-4) plus exp2.approx / summation-order P flips.
# Measured on the int8 paths: max 2.05e-3 (bf16), 6.3e-4 (fp16).
TIGHT_OUT = {torch.bfloat16: 3e-3, torch.float16: 1e-3}
# FP8 Q·Kᵀ: the tensor cores' FP8 products are not summed in IEEE FP32 inside one MMA (DeepSeek-V3 §3.3),
# so S differs slightly from the reference's FP32 sums and more P codes flip. Measured: max 3.1e-3
# (bf16 output), 2.3e-3 (fp16) over the cases below; the FP32-reference floors still apply in full.
TIGHT_OUT_FP8_QK = {torch.bfloat16: 4.5e-3, torch.float16: 3.5e-3}


@pytest.mark.parametrize("qk,pv,granularity", MODES)
@pytest.mark.parametrize("D,dtype", [(64, torch.bfloat16), (128, torch.bfloat16), (128, torch.float16)])
@pytest.mark.parametrize("S", [1, 17, 1000, 4096])
@pytest.mark.parametrize("causal", [False, True])
def test_kernel_vs_references(qk, pv, granularity, D, dtype, S, causal, switches):
    switches(LOWBIT_AUTOTUNE=False)  # the reference tiles by the heuristic config's key block (_block_n)
    Hq, Hkv = (4, 2) if causal else (4, 4)  # GQA and MHA both covered
    seed = zlib.crc32(repr((qk, pv, granularity, D, S, causal, str(dtype))).encode()) % 1000
    _kernel_vs_references(qk, pv, granularity, D, dtype, S, causal, Hq, Hkv, seed)


# Mode combinations test_kernel_vs_references leaves out: FP8 Q·Kᵀ with BF16 and FP16 P·V,
# per-warp Q scales with FP8 P·V, FP16 inputs at D = 64, GQA / MQA without the causal mask. FLOOR / COS of
# ("fp8", "bf16" | "fp16"): the quantized reference's error on these very cases (CPU: NRMSE 2.5e-2 .. 3.9e-2,
# cos >= 0.99923) x ~1.5; the kernel-vs-quantized-reference bounds are the existing ones.
MORE_CASES = [  # (qk, pv, granularity, D, dtype, S, causal, Hq, Hkv)
    ("fp8", "bf16", "per_block", 128, torch.bfloat16, 1000, True, 4, 2),
    ("fp8", "fp16", "per_block", 128, torch.bfloat16, 1000, False, 4, 2),   # FP8 Q·Kᵀ, BF16 V carried in FP16
    ("fp8", "bf16", "per_warp", 64, torch.float16, 17, False, 4, 4),
    ("fp8", "fp16", "per_warp", 64, torch.bfloat16, 17, True, 4, 2),
    ("int8", "fp8", "per_warp", 128, torch.bfloat16, 1000, True, 4, 2),     # per-warp Q scales + FP8 P·V
    ("int8", "fp8", "per_warp", 64, torch.bfloat16, 17, False, 4, 2),
    ("int8", "bf16", "per_block", 64, torch.float16, 1000, False, 4, 4),    # FP16 V at D = 64 (FP16 P·V)
    ("int8", "fp16", "per_block", 64, torch.float16, 1000, True, 4, 2),
    ("bf16", "bf16", "per_block", 64, torch.float16, 1000, False, 4, 4),
    ("fp8", "fp8", "per_block", 64, torch.float16, 1000, False, 4, 2),      # GQA non-causal
    ("bf16", "bf16", "per_block", 128, torch.bfloat16, 1000, False, 8, 2),
    ("int8", "fp8", "per_block", 64, torch.bfloat16, 1000, False, 4, 1),    # MQA non-causal
]


@pytest.mark.parametrize("qk,pv,granularity,D,dtype,S,causal,Hq,Hkv", MORE_CASES)
def test_kernel_vs_references_more_modes(qk, pv, granularity, D, dtype, S, causal, Hq, Hkv, switches):
    switches(LOWBIT_AUTOTUNE=False)  # the reference tiles by the heuristic config's key block (_block_n)
    seed = zlib.crc32(repr((qk, pv, granularity, D, S, causal, Hq, Hkv)).encode()) % 1000
    _kernel_vs_references(qk, pv, granularity, D, dtype, S, causal, Hq, Hkv, seed)


def _block_n(tri, qk, pv, S, D):
    """The key-tile width of the kernel a dense call runs: the Gluon INT8·FP8 kernel's 128 where it applies (sm_90,
    LOWBIT_ATTN_GLUON not 0), else the Triton kernel's heuristic config (its callers set LOWBIT_AUTOTUNE=0)."""
    from lowbit.attention import _gluon as G
    if (qk, pv) == ("int8", "fp8") and G.runs_by_default("cuda", D):
        return G.BLOCK_N
    return tri.heuristic_config(S, D)[1]


def _kernel_vs_references(qk, pv, granularity, D, dtype, S, causal, Hq, Hkv, seed):
    tri = pytest.importorskip("lowbit.attention._triton")
    B = 2
    q, k, v = rand(B, Hq, S, D, dtype=dtype, seed=seed), rand(B, Hkv, S, D, dtype=dtype, seed=seed + 1), \
        rand(B, Hkv, S, D, dtype=dtype, seed=seed + 2)
    if S == 1000:  # prepass bit-exactness on GPU (Triton vs torch on the same device)
        _prep(tri, q, k, v, qk, pv, granularity)
    bn = _block_n(tri, qk, pv, S, D)
    out, lse = A.attention(q, k, v, causal=causal, qk=qk, pv=pv, granularity=granularity, backend="triton",
                           return_lse=True)
    assert out.dtype == dtype and out.shape == q.shape
    ro, rl = R.attention_quantized_reference(q, k, v, qk=qk, pv=pv, granularity=granularity, causal=causal,
                                             return_lse=True, block_n=bn)
    tight = metrics(out, ro)
    lse_err = (lse - rl).abs().max().item()
    ref, rlse = R.attention_reference(q, k, v, causal=causal, return_lse=True)
    m = metrics(out, ref)
    _log(dict(test="kernel", qk=qk, pv=pv, granularity=granularity, D=D, S=S, causal=causal, dtype=str(dtype),
              Hq=Hq, Hkv=Hkv, tight_nrmse=tight["nrmse"], lse_err=lse_err,
              lse_vs_fp32=(lse - rlse).abs().max().item(), **m))
    assert tight["nrmse"] < (TIGHT_OUT_FP8_QK if qk == "fp8" else TIGHT_OUT)[dtype], tight
    assert lse_err < 1e-3
    assert m["nrmse"] < FLOOR[(qk, pv)] and m["cos"] > COS[(qk, pv)], m
    assert m["rel_l1"] < FLOOR[(qk, pv)], m


@pytest.mark.parametrize("qk,pv,granularity", MODES)
@pytest.mark.parametrize("D,S,layout", [(64, 1000, "bhsd"), (128, 4096, "bshd"), (128, 17, "bhsd")])
def test_tma_descriptors_same_as_pointers(qk, pv, granularity, D, S, layout, monkeypatch, switches):
    """LOWBIT_TMA=1 (K/V tiles by TMA descriptors; compiled for sm_90 it removes the pointer path's register
    spills) gives the pointer path's output bit for bit, causal and not, ragged S."""
    tri = pytest.importorskip("lowbit.attention._triton")
    # one launch config for both paths; the Triton kernel's two tile paths (INT8·FP8 would go to Gluon)
    switches(LOWBIT_AUTOTUNE=False, LOWBIT_ATTN_GLUON="0")
    shape = (2, 4, S, D) if layout == "bhsd" else (2, S, 4, D)
    q, k, v = (rand(*shape, dtype=torch.bfloat16, seed=s) for s in (1, 2, 3))
    for causal in (False, True):
        kw = dict(causal=causal, qk=qk, pv=pv, granularity=granularity, layout=layout, backend="triton",
                  return_lse=True)
        switches(LOWBIT_TMA=False)
        o0, l0 = A.attention(q, k, v, **kw)
        used = []
        real = tri.tma_enabled
        monkeypatch.setattr(tri, "tma_enabled", lambda *a: used.append(real(*a)) or used[-1])
        switches(LOWBIT_TMA=True)
        o1, l1 = A.attention(q, k, v, **kw)
        monkeypatch.setattr(tri, "tma_enabled", real)
        assert used == [True], used
        assert torch.equal(o0, o1) and torch.equal(l0, l1), (causal, (o0.float() - o1.float()).abs().max().item())


@pytest.mark.parametrize("qk,pv,D", [("int8", "bf16", 64), ("fp8", "fp8", 128), ("bf16", "bf16", 64)])
@pytest.mark.parametrize("Hq,Hkv,Sq,Sk", [(8, 2, 1000, 1000), (4, 4, 300, 1100), (6, 3, 2100, 700)])
def test_triton_heavy_first_same_bits(qk, pv, D, Hq, Hkv, Sq, Sk):
    """The compiled Triton forward, causal: the grid launched heaviest first across heads gives the head-by-head
    grid's output and LSE bit for bit (GQA, Sq < Sk and Sq > Sk), with 128- and 64-row query blocks."""
    from lowbit.attention import _triton as T
    from lowbit.attention.api import resolve_pv, triton_operands
    q = rand(2, Hq, Sq, D, dtype=torch.bfloat16, seed=Sq)
    k, v = rand(2, Hkv, Sk, D, dtype=torch.bfloat16, seed=Sk), rand(2, Hkv, Sk, D, dtype=torch.bfloat16, seed=7)
    qa, ka, qs, ks, km, rows, va, vs, order = (
        (q, k, None, None, None, 128, v, None, "natural") if qk == "bf16"
        else triton_operands(q, k, v, qk=qk, pv=resolve_pv(pv, qk, q.dtype), causal=True))
    kw = dict(q_scale=qs, k_scale=ks, v_scale=vs, k_mean=km, q_scale_rows=rows, causal=True, return_lse=True,
              out_dtype=torch.float32, v_key_order=order)
    for cfg in (T.heuristic_config(Sq, D), (64, 64, 4, 2)):
        o0, l0 = T.attention_fwd_triton(qa, ka, va, config=cfg, heavy_first=False, **kw)
        o1, l1 = T.attention_fwd_triton(qa, ka, va, config=cfg, heavy_first=True, **kw)
        assert torch.equal(o0, o1) and torch.equal(l0, l1), cfg


@pytest.mark.parametrize("qk,pv", [("bf16", "bf16"), ("int8", "bf16"), ("int8", "fp16"), ("int8", "fp8")])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_kernel(qk, pv, causal):
    tri = pytest.importorskip("lowbit.attention._triton")
    lq, lk = [1, 17, 1000, 300], [5, 17, 1200, 300]
    cq = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), dtype=torch.int32, device="cuda")
    ck = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), dtype=torch.int32, device="cuda")
    q, k, v = rand(sum(lq), 8, 128, dtype=torch.bfloat16, seed=1), rand(sum(lk), 2, 128, dtype=torch.bfloat16,
                                                                        seed=2), \
        rand(sum(lk), 2, 128, dtype=torch.bfloat16, seed=3)
    vl = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=1000, max_seqlen_k=1200)
    qa, ka, va, qs, ks, vs, km, rows = _prep(tri, q, k, v, qk, pv, "per_warp", **vl)
    cfg = tri.heuristic_config(1000, 128)
    o32, lse = tri.attention_fwd_triton(qa, ka, va, q_scale=qs, k_scale=ks, v_scale=vs, k_mean=km, q_scale_rows=rows,
                                        causal=causal, return_lse=True, out_dtype=torch.float32, config=cfg, **vl)
    ro, rl = R.attention_prequantized_reference(qa, ka, va, qs, ks, v_scale=vs, k_mean=km, q_scale_rows=rows,
                                                causal=causal, return_lse=True, block_n=cfg[1], cu_seqlens_q=cq,
                                                cu_seqlens_k=ck)
    tight = metrics(o32, ro)
    out, lse2 = A.attention(q, k, v, causal=causal, qk=qk, pv=pv, granularity="per_warp", return_lse=True, **vl)
    ref, rlse = R.attention_reference(q, k, v, causal=causal, cu_seqlens_q=cq, cu_seqlens_k=ck, return_lse=True)
    m = metrics(out, ref)
    _log(dict(test="varlen", qk=qk, pv=pv, causal=causal, tight_nrmse=tight["nrmse"],
              lse_vs_fp32=(lse2 - rlse).abs().max().item(), **m))
    assert tight["nrmse"] < TIGHT and (lse - rl).abs().max() < 1e-3
    assert m["nrmse"] < FLOOR[(qk, pv)]
    assert (lse2 - rlse).abs().max() < 0.05  # exact smoothing correction: measured 8e-3 on CPU (S=300)


def test_bshd_window_layout():
    q, k, v = (rand(2, 1000, 4, 64, dtype=torch.bfloat16, seed=s) for s in (4, 5, 6))
    for qk, pv in (("int8", "fp8"), ("bf16", "bf16")):
        out = A.attention(q, k, v, layout="bshd", window=(100, 20), qk=qk, pv=pv, backend="triton")
        ref = R.attention_reference(q, k, v, layout="bshd", window=(100, 20))
        m = metrics(out, ref)
        _log(dict(test="bshd_window", qk=qk, pv=pv, **m))
        assert m["nrmse"] < FLOOR[(qk, pv)], m


def test_scale_index_mapping_gpu():
    """(m_block, n_block) -> (q_scale, k_scale) on a tiny GQA case; the kernel's 64-wide key tiles span
    four 16-row K scale blocks and 8-row Q scale groups, scales spread over 2^-12 .. 2^-2."""
    tri = pytest.importorskip("lowbit.attention._triton")
    g = torch.Generator(device="cuda").manual_seed(13)
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 72, 80, 64
    qi = torch.randint(-127, 128, (B, Hq, Sq, D), generator=g, dtype=torch.int8, device="cuda")
    ki = torch.randint(-127, 128, (B, Hkv, Sk, D), generator=g, dtype=torch.int8, device="cuda")
    v = torch.randn(B, Hkv, Sk, D, generator=g, device="cuda").bfloat16()
    qs = 2.0 ** torch.randint(-12, -8, (B, Hq, 9), generator=g, device="cuda").float()
    ks = 2.0 ** torch.randint(-4, -1, (B, Hkv, 5), generator=g, device="cuda").float()
    o = tri.attention_fwd_triton(qi, ki, v, q_scale=qs, k_scale=ks, q_scale_rows=8, k_scale_rows=16,
                                 out_dtype=torch.float32, config=tri.heuristic_config(Sq, D))
    ro = R.attention_prequantized_reference(qi, ki, v, qs, ks, q_scale_rows=8, k_scale_rows=16,
                                            block_n=tri.heuristic_config(Sq, D)[1])
    assert metrics(o, ro)["nrmse"] < TIGHT
    bad = R.attention_prequantized_reference(qi, ki, v, qs, ks.flip(-1), q_scale_rows=8, k_scale_rows=16)
    assert metrics(bad, ro)["nrmse"] > 0.1
    # through the validated entry point: per_warp, block_q=64, warp_q=8 -> ceil(72/64)*8 = 16 groups
    qs2 = torch.cat([qs, torch.ones(B, Hq, 7, device="cuda")], -1)
    o2 = A.attention_qk_int8(qi, ki, v, qs2, ks, granularity="per_warp", block_q=64, warp_q=8, block_k=16)
    assert metrics(o2, ro)["nrmse"] < 5e-3  # bf16 output rounding


def test_default_dispatch_on_cuda():
    q, k, v = (rand(2, 4, 256, 128, dtype=torch.bfloat16, seed=s) for s in (7, 8, 9))
    assert A.select_backend(q.device, "bf16", "bf16", varlen=False, window=None, return_lse=False) == "sdpa"
    assert A.select_backend(q.device, "int8", "fp8", varlen=False, window=None, return_lse=False) == "triton"
    ref = R.attention_reference(q, k, v, causal=True)
    for qk, pv in (("bf16", "bf16"), ("int8", "bf16")):
        out = A.attention(q, k, v, causal=True, qk=qk, pv=pv)
        assert metrics(out, ref)["nrmse"] < FLOOR[(qk, pv)]


def test_smooth_k_gpu():
    off = torch.randn(128, device="cuda") * 8
    q = rand(2, 8, 2048, 128, dtype=torch.bfloat16, seed=10)
    k = (rand(2, 8, 2048, 128, dtype=torch.float32, seed=11) + off).bfloat16()
    v = rand(2, 8, 2048, 128, dtype=torch.bfloat16, seed=12)
    ref = R.attention_reference(q, k, v)
    e1 = metrics(A.attention(q, k, v, qk="int8", smooth_k=True), ref)["nrmse"]
    e0 = metrics(A.attention(q, k, v, qk="int8", smooth_k=False), ref)["nrmse"]
    _log(dict(test="smooth_k", smooth=e1, no_smooth=e0))
    assert e1 * 2.5 < e0


def test_fp16_pv_beats_bf16_pv_gpu():
    """pv="fp16": more accurate than BF16 P·V on the same quantized Q/K; pv="auto" follows AUTO_PV_QUANTIZED."""
    q, k, v = (rand(2, 8, 4096, 128, dtype=torch.bfloat16, seed=s) for s in (21, 22, 23))
    ref = R.attention_reference(q, k, v)
    e16 = metrics(A.attention(q, k, v, qk="int8", pv="fp16"), ref)["nrmse"]
    ebf = metrics(A.attention(q, k, v, qk="int8", pv="bf16"), ref)["nrmse"]
    eauto = metrics(A.attention(q, k, v, qk="int8"), ref)["nrmse"]
    _log(dict(test="fp16_pv", fp16=e16, bf16=ebf))
    from lowbit.attention.api import AUTO_PV_QUANTIZED
    assert eauto == (e16 if AUTO_PV_QUANTIZED == "fp16" else ebf) and e16 < ebf * 0.995, (e16, ebf)


def _rounding_edge_keys(dt, device):
    """K values (1, 1, n/64, 64) of dtype ``dt`` whose INT8 scale is exactly 1 (amax 127; K gets no softmax
    multiplier): every integer and every tie n + 1/2 in [-126.5, 126.5], the dtype's next values below and above
    each of them (bits -1 / +1: one ulp smaller / larger magnitude), and ±127; zero-padded to whole rows."""
    grid = (torch.arange(-253, 254, dtype=torch.float32) / 2).to(dt)
    nz = grid[grid != 0]
    bits = nz.view(torch.int16)
    x = torch.cat([grid, (bits - 1).view(dt), (bits + 1).view(dt), torch.tensor([127.0, -127.0]).to(dt)])
    n = -(-x.numel() // 64) * 64
    k = torch.zeros(n, dtype=dt)
    k[:x.numel()] = x
    return k.view(1, 1, n // 64, 64).to(device), x


FUSED_CASES = [  # (qk, pv, layout, B, Hq, Hkv, Sq, Sk, D, dtype, varlen lengths or None)
    ("int8", "fp8", "bhsd", 2, 8, 2, 1000, 1000, 128, torch.bfloat16, None),
    ("int8", "fp8", "bshd", 1, 4, 4, 4113, 4113, 64, torch.float16, None),
    ("int8", "fp16", "bhsd", 2, 4, 2, 17, 300, 128, torch.bfloat16, None),
    ("fp8", "fp8", "bhsd", 1, 4, 1, 129, 129, 128, torch.bfloat16, None),
    ("int8", "fp8", "bhsd", 3, 4, 2, 0, 0, 128, torch.bfloat16, [1000, 1, 3000]),
]


@pytest.mark.parametrize("qk,pv,layout,B,Hq,Hkv,Sq,Sk,D,dtype,lens", FUSED_CASES)
def test_fused_prepass_equals_separate_gpu(qk, pv, layout, B, Hq, Hkv, Sq, Sk, D, dtype, lens):
    """``prepass_triton`` (three launches for Q, K and V) equals ``quantize_qk_triton`` + ``quantize_v_*_triton`` and
    the references (on its K mean) bit for bit, in the key order the forward kernel wants ("wgmma32" where the Gluon
    kernel takes the call); K with channel offsets up to 8, as real keys have."""
    tri = pytest.importorskip("lowbit.attention._triton")
    off = torch.linspace(-8, 8, D, device="cuda")
    kw, vkw = dict(layout=layout), dict(layout=layout)
    if lens is not None:
        cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
        T, m = int(cu[-1]), max(lens)
        q, k, v = rand(T, Hq, D, dtype=dtype, seed=1), (rand(T, Hkv, D, dtype=torch.float32, seed=2) + off).to(dtype), \
            rand(T, Hkv, D, dtype=dtype, seed=3)
        kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m, max_seqlen_k=m)
        vkw = dict(cu_seqlens_k=cu, max_seqlen_k=m)
    else:
        q, k, v = rand(B, Hq, Sq, D, dtype=dtype, seed=1), \
            (rand(B, Hkv, Sk, D, dtype=torch.float32, seed=2) + off).to(dtype), rand(B, Hkv, Sk, D, dtype=dtype, seed=3)
        if layout == "bshd":
            q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    junk = torch.full((B * Hkv * D * (Sk + 32),), 0x7F, dtype=torch.uint8, device="cuda")  # freed: the caching
    del junk  # allocator hands its block out again, so unwritten bytes of a fresh buffer would show as 0x7F
    qq, vo, vs, order = tri.prepass_triton(q, k, v, qk=qk, pv=pv, key_order="auto", causal=True, **kw)
    want = "natural" if pv != "fp8" else tri.fp8_v_key_order(qq.q, qq.k, layout=layout, varlen=lens is not None,
                                                              causal=True)
    assert order == want
    a, r = qk_pair(tri.quantize_qk_triton, q, k, dtype=qk, **kw)
    bits = lambda t: t.view(torch.int8) if t.element_size() == 1 else t  # noqa: E731 - FP8 codes compared as bytes
    for name in ("q", "k", "q_scale", "k_scale", "k_mean"):
        assert torch.equal(bits(getattr(qq, name)), bits(getattr(a, name))), name
    for name in ("q", "k", "q_scale", "k_scale"):
        assert torch.equal(bits(getattr(qq, name)), bits(getattr(r, name))), name
    if pv == "fp8":
        sep = tri.quantize_v_fp8_triton(v, key_order=order, **vkw)
        ref = R.quantize_v_fp8_reference(v, **{n: x for n, x in vkw.items() if n != "max_seqlen_k"})
        assert torch.equal(vo.float(), sep[0].float()) and torch.equal(vs, sep[1])
        nat = vo if order == "natural" else tri._v_natural_order(vo, layout)
        assert torch.equal(nat.float(), ref[0].float()) and torch.equal(vs, ref[1])
        if order == "wgmma32":  # every position of the last 32-key chunk written, 0 past the last key
            full = tri._wgmma32_storage(vo, layout).view(torch.uint8)
            used = tri.wgmma32_position(torch.arange(Sk, device="cuda"))
            mask = torch.ones(full.shape[-1], dtype=torch.bool, device="cuda")
            mask[used] = False
            assert not full[..., mask].any()
    else:
        sep = tri.quantize_v_fp16_triton(v, **vkw)
        ref = R.quantize_v_fp16_reference(v, **{n: x for n, x in vkw.items() if n != "max_seqlen_k"})
        for got in (sep, ref):
            assert torch.equal(vo, got[0]) and torch.equal(vs, got[1])


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_int8_prepass_rounding_edges_gpu(dt):
    """The compiled INT8 rounding (no FRND/F2I: rz adds and integer sign) on the ties n + 1/2 and on the input
    dtype's neighbours of every tie and integer (FP16: 1/16 apart near 127; BF16: 1/2 near 127, finer below),
    against the reference, bit for bit. Sanity: the scale is exactly 1, and 0.5 rounds up while the value just
    under it rounds to 0, so the boundary itself is exercised."""
    tri = pytest.importorskip("lowbit.attention._triton")
    k, x = _rounding_edge_keys(dt, "cuda")
    rows = k.shape[2]
    t = tri.quantize_qk_triton(k, k, smooth_k=False, block_k=rows, block_q=128)
    r = R.quantize_qk_reference(k, k, smooth_k=False, block_k=rows, block_q=128)
    assert torch.equal(r.k_scale, torch.ones_like(r.k_scale))
    flat = r.k.flatten()[:x.numel()].cpu()
    half = torch.tensor(0.5, dtype=dt)
    below = (half.view(torch.int16) - 1).view(dt)
    assert flat[(x == half).nonzero()[0]].item() == 1 and flat[(x == below).nonzero()[0]].item() == 0
    mism = (t.k != r.k).sum().item()
    assert mism == 0 and torch.equal(t.k_scale, r.k_scale), f"{mism} INT8 codes differ from the reference"
    assert torch.equal(t.q, r.q) and torch.equal(t.q_scale, r.q_scale)
