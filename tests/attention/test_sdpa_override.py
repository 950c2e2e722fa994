"""lowbit.attention.sdpa_override: which F.scaled_dot_product_attention calls lowbit serves, what it passes to torch
and why, the results, and that torch's function comes back (on exit, on an exception, after nesting).

On the CPU lowbit serves calls with its references: ``qk="bf16"`` on float32 inputs is the FP32 reference (equal to
torch's SDPA up to summation order, so 1e-5), quantized modes are exactly ``lowbit.attention.attention`` of the same
call."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import lowbit.attention as A
from lowbit.attention import AttentionConfig, sdpa_override

TORCH_SDPA = F.scaled_dot_product_attention


def _qkv(b=2, hq=4, hk=2, sq=24, sk=24, d=32, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, s, d, generator=g).to(device=device, dtype=dtype)
               for h, s in ((hq, sq), (hk, sk), (hk, sk)))
    return q, k, v


def test_served_calls_match_torch_and_lowbit():
    q, k, v = _qkv()
    with sdpa_override(qk="bf16", pv="bf16") as st:
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        got_scaled = F.scaled_dot_product_attention(q, k, v, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(got, TORCH_SDPA(q, k, v, is_causal=True, enable_gqa=True), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_scaled, TORCH_SDPA(q, k, v, scale=0.3, enable_gqa=True), rtol=1e-5, atol=1e-5)
    assert st.served == 2 and not st.fallbacks and st.calls == 2
    with sdpa_override(qk="int8", pv="fp8", granularity="per_warp") as st:
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    exp = A.attention(q, k, v, causal=True, qk="int8", pv="fp8", granularity="per_warp")
    torch.testing.assert_close(got, exp, rtol=0, atol=0)
    assert st.served == 1
    ref = TORCH_SDPA(q, k, v, is_causal=True, enable_gqa=True)
    assert _nrmse(got, ref) < 6e-2  # E4M3 P costs ~2.5e-2 (NUMERICS §7)


def _nrmse(a, b):
    return ((a - b).float().norm() / b.float().norm()).item()


def test_fallbacks_are_torchs_results_with_reasons():
    q, k, v = _qkv()
    qs = q[:, :, :7]  # 7 queries, 24 keys
    kf, vf = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    mask = torch.rand(24, 24, generator=torch.Generator().manual_seed(1)) > 0.3
    mask.fill_diagonal_(True)
    calls = [
        ((q, k, v), dict(attn_mask=mask, enable_gqa=True), "attn_mask given (lowbit takes is_causal or a CausalBias)"),
        ((qs, k, v), dict(is_causal=True, enable_gqa=True),
         "is_causal with L != S (torch aligns it top-left, lowbit bottom-right)"),
        ((q[0], kf[0], vf[0]), dict(), "inputs not 4-D (B, H, S, D)"),
        ((q.double(), k.double(), v.double()), dict(enable_gqa=True),
         "dtype torch.float64 (lowbit takes float16 / bfloat16, float32 on the CPU)"),
        ((q, k[:1], v[:1]), dict(enable_gqa=True), "batch sizes differ (broadcast batch)"),
        ((q, k, v[..., :16]), dict(enable_gqa=True), "head dims differ (value's from query's)"),
        ((qs, k, v), dict(attn_mask=causal_upper_left(7, 24), enable_gqa=True),
         "upper-left CausalBias with L != S (lowbit's causal mask is lower-right)"),
    ]
    # (torch's results outside the override: inside it torch's builtin does not recognize a CausalBias call, see
    # test_declined_causal_bias_keeps_torchs_meaning)
    want = [TORCH_SDPA(*args, **kw) for args, kw, _ in calls]
    with sdpa_override(qk="int8", pv="fp8") as st:
        for (args, kw, _), w in zip(calls, want):
            torch.testing.assert_close(F.scaled_dot_product_attention(*args, **kw), w, rtol=0, atol=0)
        torch.manual_seed(5)
        got = F.scaled_dot_product_attention(q, kf, vf, dropout_p=0.5)
        torch.manual_seed(5)
        torch.testing.assert_close(got, TORCH_SDPA(q, kf, vf, dropout_p=0.5), rtol=0, atol=0)
        with pytest.raises(RuntimeError):  # torch's own error for what torch refuses (heads differ, no enable_gqa)
            F.scaled_dot_product_attention(q, k, v)
    reasons = [r for _, _, r in calls] + [
        "dropout_p=0.5 with quantized attention (qk='int8', pv='fp8'): lowbit's dropout runs 16-bit attention only",
        "query heads not a multiple of key/value heads with enable_gqa=True"]
    assert st.served == 0 and dict(st.fallbacks) == {r: 1 for r in reasons}


def test_causal_bias_lower_right_is_served():
    q, k, v = _qkv(sq=9, sk=24, hq=2)
    with sdpa_override(qk="bf16", pv="bf16") as st:
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(9, 24))
        sq = F.scaled_dot_product_attention(q[:, :, :5], k[:, :, :5], v[:, :, :5], attn_mask=causal_upper_left(5, 5))
    torch.testing.assert_close(got, TORCH_SDPA(q, k, v, attn_mask=causal_lower_right(9, 24)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sq, TORCH_SDPA(q[:, :, :5], k[:, :, :5], v[:, :, :5], is_causal=True), rtol=1e-5,
                               atol=1e-5)
    assert st.served == 2 and not st.fallbacks


def test_dropout_with_16_bit_arithmetic_is_served_by_lowbit():
    q, k, v = _qkv(hk=4)
    with sdpa_override(qk="bf16", pv="bf16") as st:
        torch.manual_seed(0)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.25)
        torch.manual_seed(0)
        b = A.attention(q, k, v, qk="bf16", pv="bf16", dropout_p=0.25)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert st.served == 1


def test_gradients_flow_through_served_calls():
    q, k, v = (t.requires_grad_() for t in _qkv())
    with sdpa_override(qk="bf16", pv="bf16") as st:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    TORCH_SDPA(q, k, v, is_causal=True, enable_gqa=True).square().sum().backward()
    for g, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(g, t.grad, rtol=1e-4, atol=1e-5)
    assert st.served == 1


def test_multihead_attention_is_served():
    """torch.nn.MultiheadAttention reaches F.scaled_dot_product_attention through torch's functional module."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(64, 4, batch_first=True).train()
    x = torch.randn(2, 10, 64)
    exp, _ = mha(x, x, x, need_weights=False, is_causal=False)
    with sdpa_override(qk="bf16", pv="bf16") as st:
        got, _ = mha(x, x, x, need_weights=False)
    torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-5)
    assert st.served == 1


def test_restored_on_exit_on_exception_and_after_nesting():
    q, k, v = _qkv(hk=4)
    with pytest.raises(ZeroDivisionError):
        with sdpa_override():
            assert F.scaled_dot_product_attention is not TORCH_SDPA
            1 / 0
    assert F.scaled_dot_product_attention is TORCH_SDPA
    outer, inner = sdpa_override(qk="bf16", pv="bf16"), sdpa_override(qk="int8", pv="fp8")
    with outer as so:
        with inner as si:
            got_inner = F.scaled_dot_product_attention(q, k, v)
            with outer:  # re-entering an active override: it is the innermost again
                F.scaled_dot_product_attention(q, k, v)
            F.scaled_dot_product_attention(q, k, v)
        got_outer = F.scaled_dot_product_attention(q, k, v)
        assert F.scaled_dot_product_attention is not TORCH_SDPA
    assert F.scaled_dot_product_attention is TORCH_SDPA
    assert (so.served, si.served) == (2, 2)
    torch.testing.assert_close(got_inner, A.attention(q, k, v, qk="int8", pv="fp8"), rtol=0, atol=0)
    torch.testing.assert_close(got_outer, TORCH_SDPA(q, k, v), rtol=1e-5, atol=1e-5)
    F.scaled_dot_product_attention(q, k, v)  # outside: nothing counted
    assert (so.served, si.served) == (2, 2) and not so.fallbacks and not si.fallbacks


def test_other_threads_go_to_torch():
    q, k, v = _qkv(hk=4)
    seen = {}

    def other():
        seen["out"] = F.scaled_dot_product_attention(q, k, v)
        with sdpa_override(qk="bf16", pv="bf16") as st2:  # an override of its own, entered on that thread
            F.scaled_dot_product_attention(q, k, v)
        seen["st2"] = st2.served

    with sdpa_override(qk="int8", pv="fp8") as st:
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert F.scaled_dot_product_attention is not TORCH_SDPA
    assert F.scaled_dot_product_attention is TORCH_SDPA
    assert st.served == 0 and seen["st2"] == 1
    torch.testing.assert_close(seen["out"], TORCH_SDPA(q, k, v), rtol=0, atol=0)


def test_one_override_entered_on_two_threads():
    """Entries are per thread: a thread leaving does not end the override on another thread still inside it."""
    q, k, v = _qkv(hk=4)
    ov = sdpa_override(qk="bf16", pv="bf16")
    entered, main_entered = threading.Event(), threading.Event()

    def other():
        with ov:
            entered.set()
            main_entered.wait()
            F.scaled_dot_product_attention(q, k, v)

    t = threading.Thread(target=other)
    t.start()
    entered.wait()
    with ov as st:
        main_entered.set()
        t.join()  # the other thread has left
        F.scaled_dot_product_attention(q, k, v)
        assert F.scaled_dot_product_attention is not TORCH_SDPA
    assert F.scaled_dot_product_attention is TORCH_SDPA
    assert st.served == 2


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"AttentionConfig.pv must be one of .*'fp4'"):
        sdpa_override(pv="fp4")
    with pytest.raises(TypeError, match="not both"):
        sdpa_override(AttentionConfig(), qk="int8")
    with pytest.raises(TypeError, match="unexpected keyword"):
        sdpa_override(block_q=64)
    with pytest.raises(TypeError, match="AttentionConfig"):
        sdpa_override("int8")
    assert F.scaled_dot_product_attention is TORCH_SDPA


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("qk,pv,tol", [("bf16", "bf16", 1e-2), ("int8", "bf16", 2e-2), ("int8", "fp8", 6e-2)])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_served_matches_torch(qk, pv, tol, causal):
    q, k, v = _qkv(b=2, hq=8, hk=2, sq=1000, sk=1000, d=128, dtype=torch.bfloat16, device="cuda")
    ref = TORCH_SDPA(q, k, v, is_causal=causal, enable_gqa=True)
    with sdpa_override(qk=qk, pv=pv) as st:  # (16-bit: lowbit's own SDPA dispatch reaches torch's function)
        got = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    assert st.served == 1 and not st.fallbacks
    assert _nrmse(got, ref) < tol
    if qk != "bf16":
        torch.testing.assert_close(got, A.attention(q, k, v, causal=causal, qk=qk, pv=pv), rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_declines_float32_and_odd_head_dims():
    with sdpa_override(qk="int8", pv="fp8") as st:
        F.scaled_dot_product_attention(*_qkv(hk=4, device="cuda"))
        F.scaled_dot_product_attention(*_qkv(hk=4, d=80, dtype=torch.bfloat16, device="cuda"))
    assert set(st.fallbacks) == {"float32 inputs on CUDA (lowbit's kernels take float16 / bfloat16)",
                                 "head_dim 80 (the Triton kernels take (16, 32, 64, 128, 256))"}


def test_declined_causal_bias_keeps_torchs_meaning():
    """A CausalBias call lowbit declines goes to torch as a CausalBias call: torch's result, a plain tensor (handed
    to torch's builtin while the override is installed, the bias was not recognized and its uninitialized memory was
    read as a dense mask: NaN rows now and then, and a CausalBias-typed output)."""
    q, k, v = _qkv()
    qs = q[:, :, :7]
    cases = [((qs, k, v), dict(attn_mask=causal_upper_left(7, 24), enable_gqa=True)),  # upper-left, L != S
             ((qs.double(), k.double(), v.double()), dict(attn_mask=causal_lower_right(7, 24), enable_gqa=True)),
             ((q.double(), k.double(), v.double()), dict(attn_mask=causal_upper_left(24, 24), enable_gqa=True))]
    want = [TORCH_SDPA(*a, **kw) for a, kw in cases]
    with sdpa_override(qk="int8", pv="fp8") as st:
        got = [F.scaled_dot_product_attention(*a, **kw) for a, kw in cases]
    assert st.fallbacks and st.calls == len(cases) and not st.served
    for g, w in zip(got, want):
        assert type(g) is torch.Tensor and type(w) is torch.Tensor
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    torch.testing.assert_close(got[0], TORCH_SDPA(qs, k, v, is_causal=True, enable_gqa=True), rtol=0, atol=0)


def test_causal_bias_under_torch_compile():
    """Inside torch.compile the override passes calls to torch; a CausalBias one too, with torch's meaning (handed to
    torch's builtin, tracing failed in AOTAutograd: "Multiple dispatch failed for aten.add")."""
    q, k, v = _qkv(hk=4)
    qs = q[:, :, :7].contiguous()

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_upper_left(7, 24))

    want = f(qs, k, v)
    with sdpa_override(qk="int8", pv="fp8"):
        got = torch.compile(f, backend="aot_eager", fullgraph=False)(qs, k, v)
    assert type(got) is torch.Tensor
    torch.testing.assert_close(got, want, rtol=0, atol=0)
