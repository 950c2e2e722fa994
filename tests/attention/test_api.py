"""Entry points on the CPU: dispatch to the references, validation errors, autograd."""

import pytest
import torch

import lowbit.attention as A
from lowbit.attention import attention, attention_qk_int8, attention_reference, quantize_qk


def rand(*shape, seed=0, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def qkv(B=2, Hq=4, Hkv=2, Sq=33, Sk=41, D=32, dtype=torch.bfloat16, layout="bhsd"):
    q, k, v = rand(B, Hq, Sq, D, seed=1, dtype=dtype), rand(B, Hkv, Sk, D, seed=2,
                                                            dtype=dtype), rand(B, Hkv, Sk, D, seed=3, dtype=dtype)
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    return q, k, v


@pytest.mark.parametrize("qk,pv", [("bf16", "bf16"), ("int8", "bf16"), ("int8", "fp8"), ("fp8", "fp8")])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_cpu_attention_runs_reference(qk, pv, layout):
    q, k, v = qkv(layout=layout)
    out, lse = attention(q, k, v, causal=True, qk=qk, pv=pv, layout=layout, return_lse=True)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == (2, 4, 33)
    if qk == "bf16":
        exp, el = attention_reference(q, k, v, causal=True, layout=layout, return_lse=True)
    else:
        exp, el = A.attention_quantized_reference(q, k, v, qk=qk, pv=pv, causal=True, layout=layout, return_lse=True)
    # the CPU path runs these very references: identical, not merely close
    torch.testing.assert_close(out, exp.to(out.dtype), rtol=0, atol=0)
    torch.testing.assert_close(lse, el, rtol=0, atol=0)
    assert A.select_backend(q.device, qk, pv, varlen=False, window=None, return_lse=False) == "reference"


def test_attention_qk_int8_matches_attention():
    q, k, v = qkv()
    qq = quantize_qk(q, k, granularity="per_warp")
    o1 = attention_qk_int8(qq.q, qq.k, v, qq.q_scale, qq.k_scale, granularity="per_warp", causal=True)
    o2 = attention(q, k, v, qk="int8", granularity="per_warp", causal=True)
    torch.testing.assert_close(o1, o2, rtol=0, atol=0)


def test_sdpa_backend_bottom_right_causal_and_gqa():
    q, k, v = qkv(Sq=9, Sk=21)
    o = attention(q, k, v, causal=True, backend="sdpa")
    r = attention_reference(q, k, v, causal=True)
    assert ((o.float() - r).norm() / r.norm()) < 1e-2


def test_varlen_attention_cpu():
    cq = torch.tensor([0, 5, 17, 18], dtype=torch.int32)
    ck = torch.tensor([0, 9, 20, 30], dtype=torch.int32)
    q, k, v = rand(18, 4, 32, seed=4), rand(30, 2, 32, seed=5), rand(30, 2, 32, seed=6)
    out, lse = attention(q, k, v, qk="int8", pv="fp8", causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck, return_lse=True)
    assert out.shape == q.shape and lse.shape == (4, 18)
    ref = attention_reference(q, k, v, causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck)
    assert ((out.float() - ref).norm() / ref.norm()) < 6e-2


def test_backward_uses_fp32_reference_math():
    q, k, v = (t.float().requires_grad_() for t in qkv(dtype=torch.float32))
    out = attention(q, k, v, qk="int8", pv="fp8", causal=True)
    g = torch.randn_like(out)
    out.backward(g)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    attention_reference(q2, k2, v2, causal=True).backward(g)
    for a, b in ((q, q2), (k, k2), (v, v2)):
        torch.testing.assert_close(a.grad, b.grad)


def _raises(exc, match, fn, *a, **kw):
    with pytest.raises(exc, match=match):
        fn(*a, **kw)


def test_attention_validation_errors():
    q, k, v = qkv()
    _raises(ValueError, "multiple of key/value heads", attention, q, rand(2, 3, 41, 32), rand(2, 3, 41, 32))
    _raises(ValueError, "layout must be", attention, q, k, v, layout="sbhd")
    _raises(ValueError, "qk must be one of", attention, q, k, v, qk="int4")
    _raises(ValueError, "pv must be one of", attention, q, k, v, pv="int8")
    _raises(TypeError, "share one dtype", attention, q, k.half(), v)
    _raises(TypeError, "float16, bfloat16", attention, q.int(), k.int(), v.int())
    _raises(ValueError, "head_dim must match", attention, q, rand(2, 2, 41, 16), v)
    _raises(NotImplementedError, "dropout", attention, q, k, v, qk="int8", dropout_p=0.1)
    _raises(ValueError, "granularity", attention, q, k, v, granularity="per_thread")
    _raises(ValueError, "block_q % warp_q", attention, q, k, v, granularity="per_warp", block_q=128, warp_q=48)
    _raises(ValueError, "window must be", attention, q, k, v, window=(3,))
    _raises(NotImplementedError, "backend='sdpa' supports only", attention, q, k, v, qk="int8", backend="sdpa")
    q16, k16 = rand(2, 2, 41, 16), rand(2, 2, 41, 16)
    for qk in ("int8", "fp8"):  # an 8-bit MMA reduces over K >= 32: a clear error, not a Triton compile failure
        _raises(NotImplementedError, f"qk='{qk}' on the Triton attention kernel needs head_dim >= 32 .*, got 16",
                attention, q16, k16, k16, qk=qk, backend="triton")
    _raises(ValueError, "backend must be one of", attention, q, k, v, backend="cuda")
    _raises(ValueError, "4-D", attention, q[0], k[0], v[0])
    cu = torch.tensor([0, 33], dtype=torch.int64)
    _raises(TypeError, "int32", attention, q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
            cu_seqlens_q=cu, cu_seqlens_k=cu)
    cu = torch.tensor([0, 30], dtype=torch.int32)
    _raises(ValueError, "must equal the packed lengths", attention, q[0].transpose(0, 1), k[0].transpose(0, 1),
            v[0].transpose(0, 1), cu_seqlens_q=cu, cu_seqlens_k=cu)
    _raises(ValueError, "packed", attention, q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
            cu_seqlens_q=torch.tensor([0, 33], dtype=torch.int32), cu_seqlens_k=torch.tensor([0, 41],
                                                                                             dtype=torch.int32),
            layout="bhsd")


def test_attention_qk_int8_validation_errors():
    q, k, v = qkv(Sq=200, Sk=100, D=64)
    qq = quantize_qk(q, k, granularity="per_warp")
    good = (qq.q, qq.k, v, qq.q_scale, qq.k_scale)
    attention_qk_int8(*good, granularity="per_warp")  # accepted
    _raises(TypeError, "must be torch.int8", attention_qk_int8, q, qq.k, v, qq.q_scale, qq.k_scale)
    _raises(TypeError, "float16 or bfloat16", attention_qk_int8, qq.q, qq.k, v.float(), qq.q_scale, qq.k_scale)
    # per_warp scales passed as per_block: expected (2, 4, 2), got (2, 4, 8)
    _raises(ValueError, r"q_scale shape mismatch: expected \(2, 4, 2\) for granularity='per_block'.*got \(2, 4, 8\)",
            attention_qk_int8, *good)
    _raises(ValueError, r"k_scale shape mismatch: expected \(2, 2, 4\) for block_k=32, got \(2, 2, 2\)",
            attention_qk_int8, *good, granularity="per_warp", block_k=32)
    _raises(TypeError, "q_scale must be float32", attention_qk_int8, qq.q, qq.k, v, qq.q_scale.half(), qq.k_scale,
            granularity="per_warp")
    _raises(ValueError, "multiple of key/value heads", attention_qk_int8, qq.q[:, :3], qq.k, v, qq.q_scale[:, :3],
            qq.k_scale, granularity="per_warp")
    q2, k2, v2 = qkv(Sq=20, Sk=20, D=24)
    qq2 = quantize_qk(q2, k2)
    _raises(ValueError, "multiple of 16", attention_qk_int8, qq2.q, qq2.k, v2, qq2.q_scale, qq2.k_scale)
    _raises(ValueError, "k_mean must be float32 of shape", attention_qk_int8, *good, granularity="per_warp",
            k_mean=torch.zeros(2, 2, 64))


def test_lowbit_info_hook():
    assert A.backend_for(device="cpu", qk="int8", pv="fp8") == "reference"


def test_attention_dropout_and_quantized_backward_cpu():
    """dropout_p > 0 routes to the Philox dropout path (same mask in backward); INT8 forwards are differentiable."""
    from lowbit.attention.reference import attention_forward_reference

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 19, 64, generator=g, requires_grad=True) for _ in range(3))
    torch.manual_seed(11)
    out = attention(q, k, v, dropout_p=0.2, causal=True)
    torch.manual_seed(11)  # the same seed draw -> the same mask
    seed = int(torch.randint(0, 2**62, (1,)).item())
    ref, _ = attention_forward_reference(q, k, v, dropout_p=0.2, seed=seed, causal=True)
    assert torch.allclose(out.float(), ref.float(), atol=1e-5)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    for t in (q, k, v):
        t.grad = None
    attention(q, k, v, qk="int8").sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))
    with pytest.raises(ValueError):
        attention(q, k, v, dropout_p=1.5)


@pytest.mark.gpu
@pytest.mark.parametrize("qk,pv", [("bf16", "bf16"), ("int8", "fp8")])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_autograd_uses_fused_backward_cuda(qk, pv, causal):
    """On CUDA the backward is the fused Triton kernel (straight-through for quantized forwards):
    gradients match the FP32 reference's within BF16 backward error."""
    from lowbit.attention.reference import attention_reference

    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(2, 4, 333, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    k = k[:, :2].contiguous()
    v = v[:, :2].contiguous()
    do = torch.randn(2, 4, 333, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    attention(*ins, causal=causal, qk=qk, pv=pv).backward(do)
    ref_in = [t.float().requires_grad_() for t in (q, k, v)]
    attention_reference(*ref_in, causal=causal).backward(do.float())
    for a, r in zip(ins, ref_in):
        nrmse = ((a.grad.float() - r.grad).norm() / r.grad.norm()).item()
        assert nrmse < 1.5e-2, nrmse  # BF16 backward measured ~4e-3 (tests/attention_bwd); quantized fwd does not enter


def test_lowbit_attention_is_callable_after_submodule_imports():
    import lowbit
    import lowbit.attention.backward  # noqa: F401  (binds the package to lowbit.attention)

    q, k, v = (torch.randn(1, 2, 9, 32) for _ in range(3))
    assert torch.allclose(lowbit.attention(q, k, v), attention(q, k, v))
    assert lowbit.attention.attention is attention


def test_pv_resolution_and_fp16_path_cpu():
    """pv="auto" is AUTO_PV_QUANTIZED for quantized Q·Kᵀ and the inputs' dtype otherwise; "fp16" carries BF16 V in
    FP16; "bf16" keeps BF16; FP16 inputs never convert. The CPU path runs the quantized reference with the same V
    conversion."""
    from lowbit.attention import api
    from lowbit.attention.api import resolve_pv

    bf, hf = torch.bfloat16, torch.float16
    auto = "fp16" if api.AUTO_PV_QUANTIZED == "fp16" else "native"
    assert resolve_pv("auto", "int8", bf) == auto and resolve_pv("auto", "fp8", bf) == auto
    assert resolve_pv("auto", "bf16", bf) == "native" and resolve_pv("bf16", "int8", bf) == "native"
    assert resolve_pv("fp16", "bf16", bf) == "fp16" and resolve_pv("fp16", "int8", hf) == "native"
    assert resolve_pv("auto", "int8", hf) == "native" and resolve_pv("fp8", "int8", bf) == "fp8"
    with pytest.raises(ValueError, match=r"pv must be one of \('auto', 'bf16', 'fp16', 'fp8'\), got 'e5m2'"):
        resolve_pv("e5m2", "int8", bf)
    q, k, v = qkv()
    o_auto = attention(q, k, v, qk="int8", causal=True)
    o16 = attention(q, k, v, qk="int8", pv="fp16", causal=True)
    ref16 = A.attention_quantized_reference(q, k, v, qk="int8", pv="fp16", causal=True)
    torch.testing.assert_close(o_auto, attention(q, k, v, qk="int8", pv=api.AUTO_PV_QUANTIZED, causal=True),
                               rtol=0, atol=0)
    torch.testing.assert_close(o16, ref16.to(bf), rtol=0, atol=0)
    obf = attention(q, k, v, qk="int8", pv="bf16", causal=True)
    assert not torch.equal(obf, o16)
    # 16-bit Q·Kᵀ with pv="fp16" on BF16 inputs runs the quantized reference (V converted), not the FP32 one
    o = attention(q, k, v, pv="fp16")
    torch.testing.assert_close(o, A.attention_quantized_reference(q, k, v, qk="bf16", pv="fp16").to(bf), rtol=0, atol=0)
    # pre-quantized entry point: same default, same FP16 path
    qq = quantize_qk(q, k)
    o2 = attention_qk_int8(qq.q, qq.k, v, qq.q_scale, qq.k_scale, causal=True)
    torch.testing.assert_close(o2, o_auto, rtol=0, atol=0)
    o3 = attention_qk_int8(qq.q, qq.k, v, qq.q_scale, qq.k_scale, causal=True, pv="fp16")
    torch.testing.assert_close(o3, o16, rtol=0, atol=0)
    with pytest.raises(TypeError, match="quantize_v_fp16: v must be bfloat16"):
        A.api.quantize_v_fp16(v.half())


def test_dropout_path_validates_like_the_plain_path():
    """dropout_p > 0 runs the same q/k/v, dtype, window, varlen and backend checks as dropout_p = 0 (it used to skip
    them: a batch-2 k broadcast against a batch-1 q, mixed dtypes ran, backend='sdpa' was silently ignored)."""
    q, k, v = qkv(B=1, Sq=9, Sk=9)
    d = dict(dropout_p=0.1)
    k2, v2 = k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1)
    _raises(ValueError, r"batch sizes differ: q 1, k 2, v 2", attention, q, k2, v2, **d)
    _raises(TypeError, "share one dtype", attention, q, k.half(), v, **d)
    _raises(TypeError, "float16, bfloat16", attention, q.int(), k.int(), v.int(), **d)
    _raises(ValueError, "head_dim must match: q 32, k 16", attention, q, k[..., :16], v, **d)
    _raises(ValueError, "multiple of key/value heads.*Hq=4, Hkv=3", attention, q, rand(1, 3, 9, 32), rand(1, 3, 9, 32),
            **d)
    _raises(ValueError, r"window must be None or a pair of ints.*\(1,\)", attention, q, k, v, window=(1,), **d)
    _raises(ValueError, "window must be", attention, q, k, v, window=(True, 1), **d)
    _raises(ValueError, "backend='sdpa' cannot run dropout_p=0.1", attention, q, k, v, backend="sdpa", **d)
    _raises(ValueError, "backend must be one of", attention, q, k, v, backend="cuda", **d)
    _raises(ValueError, "layout must be", attention, q, k, v, layout="sbhd", **d)
    # pv="fp16" on BF16 inputs is a converted-V P·V the dropout forward does not run: refused, not downgraded
    _raises(NotImplementedError, "dropout runs with 16-bit attention only", attention, q, k, v, pv="fp16", **d)
    _raises(NotImplementedError, "return_lse", attention, q, k, v, return_lse=True, **d)
    _raises(TypeError, "dropout_p must be a real number", attention, q, k, v, dropout_p="0.1")
    _raises(ValueError, r"dropout_p must be a real number in \[0, 1\), got nan", attention, q, k, v,
            dropout_p=float("nan"))
    tq, tk = q[0].transpose(0, 1), k[0].transpose(0, 1)
    _raises(TypeError, "int32", attention, tq, tk, tk, cu_seqlens_q=torch.tensor([0, 9]),
            cu_seqlens_k=torch.tensor([0, 9]), **d)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    _raises(ValueError, "must equal the packed lengths", attention, tq, tk, tk, cu_seqlens_q=cu, cu_seqlens_k=cu, **d)
    if not torch.cuda.is_available():  # backend='triton' on a CPU without the interpreter
        from lowbit.attention._checks import triton_ok as _triton_ok

        if not _triton_ok(q):
            _raises(NotImplementedError, "needs a CUDA device", attention, q, k, v, backend="triton", **d)


@pytest.mark.parametrize("bad,exc", [(0.0, ValueError), (-0.125, ValueError), (float("nan"), ValueError),
                                     (float("inf"), ValueError), ("0.1", TypeError), (True, TypeError),
                                     (torch.tensor(0.1), TypeError)])
def test_softmax_scale_must_be_positive_finite(bad, exc):
    from lowbit.attention import backward as BW

    q, k, v = qkv(B=1, Sq=9, Sk=9)
    m = "softmax_scale must be a positive finite real number or None"
    _raises(exc, m, attention, q, k, v, softmax_scale=bad)
    _raises(exc, m, attention, q, k, v, softmax_scale=bad, qk="int8")
    _raises(exc, m, attention, q, k, v, softmax_scale=bad, dropout_p=0.1)
    _raises(exc, m, quantize_qk, q, k, softmax_scale=bad)
    _raises(exc, m, BW.attention_forward, q, k, v, softmax_scale=bad, backend="reference")
    o, lse = BW.attention_forward(q, k, v, backend="reference")
    _raises(exc, m, BW.backward, o, q, k, v, o, lse, softmax_scale=bad, backend="reference")


def test_softmax_scale_accepts_real_numbers():
    q, k, v = qkv(B=1, Sq=9, Sk=9, dtype=torch.float32)
    ref = attention_reference(q, k, v, softmax_scale=0.5)
    torch.testing.assert_close(attention(q, k, v, softmax_scale=0.5), ref, rtol=0, atol=0)
    torch.testing.assert_close(attention(q, k, v, softmax_scale=1), attention_reference(q, k, v, softmax_scale=1.0),
                               rtol=0, atol=0)


def _fp8_grads_direct(q, k, v, do, *, grad_format, scales=None, causal=True):
    """The FP8 gradients lowbit.attention.backward computes (reference backend) from the FP32-reference forward."""
    from lowbit.attention import backward as BW

    o, lse = BW.attention_forward(q, k, v, causal=causal, backend="reference")
    return BW.backward(do, q, k, v, o, lse, causal=causal, grad_format=grad_format, scales=scales, backend="reference")


@pytest.mark.parametrize("qk,pv", [("bf16", "bf16"), ("int8", "bf16"), ("bf16", "fp16")])
@pytest.mark.parametrize("grad_format,given", [("e4m3", False), ("e5m2", True)])
def test_attention_grad_format_cpu(qk, pv, grad_format, given):
    """lowbit.attention(..., grad_format=, scales=, grad_sink=): out unchanged; autograd gets the FP8 gradients
    dequantized; grad_sink the QuantizedTensors, the same codes lowbit.attention.backward gives. For the INT8 and
    converted-V forwards too (their backward is the 16-bit one from the saved inputs)."""
    from lowbit.quant import Float8Rowwise, Float8Tensorwise, QuantizedTensor

    q, k, v = qkv(B=1, Sq=17, Sk=17, D=16)
    do = rand(*q.shape, seed=9)
    scales = (torch.tensor([64.0]), torch.tensor([32.0]), torch.tensor([16.0])) if given else None
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    sink = {}
    kw = dict(causal=True, qk=qk, pv=pv, backend="reference")
    out = attention(*ins, grad_format=grad_format, scales=scales, grad_sink=sink, **kw)
    torch.testing.assert_close(out, attention(q, k, v, **kw), rtol=0, atol=0)
    out.backward(do)
    assert set(sink) == {"dq", "dk", "dv"}
    exp = _fp8_grads_direct(q, k, v, do, grad_format=grad_format, scales=scales)
    for t, name, e in zip(ins, ("dq", "dk", "dv"), exp):
        qt = sink[name]
        assert isinstance(qt, QuantizedTensor) and isinstance(qt.scheme, Float8Tensorwise if given else Float8Rowwise)
        assert qt.scheme.fmt == grad_format and qt.shape == t.shape
        assert torch.equal(qt.rowwise.data.view(torch.uint8), e.rowwise.data.view(torch.uint8))
        assert torch.equal(qt.rowwise.amax, e.rowwise.amax)
        assert t.grad.dtype == t.dtype and torch.equal(t.grad, qt.dequantize().to(t.dtype))
    # the gradients are the attention gradient (FP8 error only)
    ref_in = [t.float().requires_grad_() for t in (q, k, v)]
    attention_reference(*ref_in, causal=True).backward(do.float())
    for t, r in zip(ins, ref_in):
        assert ((t.grad.float() - r.grad).norm() / r.grad.norm()) < 0.1
    # without a gradient to compute the options only get checked
    with torch.no_grad():
        o2 = attention(*ins, grad_format=grad_format, scales=scales, grad_sink={}, **kw)
    torch.testing.assert_close(o2, out.detach(), rtol=0, atol=0)


def test_attention_grad_format_with_dropout_and_varlen_cpu():
    from lowbit.attention import backward as BW

    cq = torch.tensor([0, 5, 17], dtype=torch.int32)
    ck = torch.tensor([0, 9, 20], dtype=torch.int32)
    q, k, v = rand(17, 4, 32, seed=4), rand(20, 2, 32, seed=5), rand(20, 2, 32, seed=6)
    do = rand(17, 4, 32, seed=7)
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    sink = {}
    torch.manual_seed(3)
    attention(*ins, cu_seqlens_q=cq, cu_seqlens_k=ck, dropout_p=0.2, grad_format="e4m3", grad_sink=sink,
              backend="reference").backward(do)
    torch.manual_seed(3)  # the same seed draw -> the same mask
    seed = int(torch.randint(0, 2 ** 62, (1,)).item())
    vl = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, dropout_p=0.2, seed=seed)
    o, lse = BW.attention_forward(q, k, v, backend="reference", **vl)
    exp = A.backward(do, q, k, v, o, lse, grad_format="e4m3", backend="reference", **vl)
    for t, name, e in zip(ins, ("dq", "dk", "dv"), exp):
        assert torch.equal(sink[name].rowwise.data.view(torch.uint8), e.rowwise.data.view(torch.uint8))
        assert torch.equal(t.grad, sink[name].dequantize().to(t.dtype))


def test_attention_grad_format_validation():
    q, k, v = qkv(B=1, Sq=9, Sk=9)
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    one = torch.ones(1)
    _raises(ValueError, r"grad_format must be one of \(None, 'e4m3', 'e5m2'\), got 'e3m4'", attention, *ins,
            grad_format="e3m4")
    _raises(ValueError, "scales are only meaningful", attention, *ins, scales=(one, one, one))
    _raises(ValueError, "scale_dk must be positive and finite.*got 0.0", attention, *ins, grad_format="e4m3",
            scales=(one, torch.zeros(1), one))
    _raises(ValueError, "scale_dv must be a float32 tensor of shape", attention, *ins, grad_format="e4m3",
            scales=(one, one, torch.ones(2)))
    _raises(TypeError, "grad_sink must be None or a dict", attention, *ins, grad_format="e4m3", grad_sink=[])
    _raises(ValueError, "grad_sink receives FP8 gradients", attention, *ins, grad_sink={})
    _raises(ValueError, "backend='sdpa' cannot run grad_format='e4m3'", attention, *ins, grad_format="e4m3",
            backend="sdpa")


def test_lowbit_attention_backward_is_callable():
    """NUMERICS §7's low-level call: lowbit.attention.backward(do, q, k, v, o, lse, ..., grad_format=, scales=)
    returns QuantizedTensors (dequantize() ≈ the gradient); the module stays importable as a module."""
    import lowbit
    import lowbit.attention.backward as mod
    from lowbit.attention.reference import attention_backward_reference

    assert lowbit.attention.backward is mod and A.backward is mod and callable(mod)
    q, k, v = qkv(B=1, Sq=13, Sk=15, D=16, dtype=torch.float32)
    do = rand(*q.shape, seed=8, dtype=torch.float32)
    o, lse = mod.attention_forward(q, k, v, causal=True, backend="reference")
    ref = attention_backward_reference(do, q, k, v, causal=True)
    sc = tuple((448.0 / r.abs().amax()).reshape(1) for r in ref)  # delayed-scaling style, from a known amax
    g8 = lowbit.attention.backward(do, q, k, v, o, lse, causal=True, grad_format="e4m3", scales=sc,
                                   backend="reference")
    g = mod.backward(do, q, k, v, o, lse, causal=True, grad_format="e4m3", scales=sc, backend="reference")
    for a, b, r, s in zip(g8, g, ref, sc):
        assert torch.equal(a.rowwise.data.view(torch.uint8), b.rowwise.data.view(torch.uint8))
        assert torch.equal(a.rowwise.scale_inv, 1.0 / s)
        assert ((a.dequantize() - r).norm() / r.norm()) < 3.5e-2  # measured 2.5e-2 .. 2.8e-2
    g16 = A.backward(do, q, k, v, o, lse, causal=True, backend="reference")
    for a, r in zip(g16, ref):
        torch.testing.assert_close(a, r)
