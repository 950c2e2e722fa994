"""FP32 attention reference: naive math, GQA, causal alignment, window, varlen, LSE."""
import math

import pytest
import torch

from lowbit.attention import attention_reference
from lowbit.attention.reference import visible_mask


def naive(q, k, v, causal=False, window=None, scale=None):
    """Float64 loop over (b, h, i): the textbook definition, bhsd only."""
    q, k, v = q.double(), k.double(), v.double()
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    scale = scale or 1 / math.sqrt(D)
    left, right = window or (-1, -1)
    if causal:
        right = 0
    out = torch.zeros(B, Hq, Sq, D, dtype=torch.float64)
    lse = torch.full((B, Hq, Sq), float("-inf"), dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            hk = h // (Hq // Hkv)
            for i in range(Sq):
                js = [j for j in range(Sk) if (right < 0 or j <= i + Sk - Sq + right)
                      and (left < 0 or j >= i + Sk - Sq - left)]
                if not js:
                    continue
                s = torch.stack([q[b, h, i] @ k[b, hk, j] for j in js]) * scale
                lse[b, h, i] = torch.logsumexp(s, 0)
                p = torch.softmax(s, 0)
                out[b, h, i] = sum(p[t] * v[b, hk, j] for t, j in enumerate(js))
    return out, lse


@pytest.mark.parametrize("Hq,Hkv", [(3, 3), (4, 2), (4, 1)])
@pytest.mark.parametrize("Sq,Sk", [(7, 7), (5, 9), (9, 4), (1, 17)])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (3, 2)), (True, (2, -1))])
def test_reference_matches_naive(Hq, Hkv, Sq, Sk, causal, window):
    g = torch.Generator().manual_seed(Hq * 100 + Sq * 10 + Sk)
    D = 8
    q = torch.randn(2, Hq, Sq, D, generator=g)
    k = torch.randn(2, Hkv, Sk, D, generator=g)
    v = torch.randn(2, Hkv, Sk, D, generator=g)
    out, lse = attention_reference(q, k, v, causal=causal, window=window, return_lse=True)
    o2, l2 = naive(q, k, v, causal, window)
    torch.testing.assert_close(out.double(), o2, atol=2e-6, rtol=2e-6)
    assert torch.equal(torch.isinf(lse), torch.isinf(l2))
    fin = torch.isfinite(l2)
    torch.testing.assert_close(lse.double()[fin], l2[fin], atol=2e-6, rtol=2e-6)


def test_causal_is_bottom_right_aligned():
    m = visible_mask(3, 5, causal=True)
    # row i sees keys 0 .. i + (5 - 3)
    assert m.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    m = visible_mask(4, 2, causal=True)  # more queries than keys: the first two rows see nothing
    assert m.sum(1).tolist() == [0, 0, 1, 2]


def test_fully_masked_rows_give_zero_and_neg_inf_lse():
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8)
    out, lse = attention_reference(q, k, v, causal=True, return_lse=True)
    assert torch.all(out[:, :, :2] == 0) and torch.all(torch.isneginf(lse[:, :, :2]))
    assert torch.isfinite(out).all()


def test_layouts_agree_and_gqa_equals_repeated_heads():
    q, k, v = torch.randn(2, 4, 11, 16), torch.randn(2, 2, 13, 16), torch.randn(2, 2, 13, 16)
    o1 = attention_reference(q, k, v, causal=True)
    o2 = attention_reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, layout="bshd")
    torch.testing.assert_close(o1, o2.transpose(1, 2))
    o3 = attention_reference(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), causal=True)
    torch.testing.assert_close(o1, o3)


def test_lse_and_default_scale():
    q, k, v = torch.randn(1, 2, 6, 32), torch.randn(1, 2, 6, 32), torch.randn(1, 2, 6, 32)
    out, lse = attention_reference(q, k, v, return_lse=True)
    s = q @ k.transpose(-1, -2) / math.sqrt(32)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1))
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v)
    out2 = attention_reference(q, k, v, softmax_scale=0.3)
    torch.testing.assert_close(out2, torch.softmax(q @ k.transpose(-1, -2) * 0.3, -1) @ v)


def test_varlen_equals_per_sequence_loop():
    lq, lk = [3, 1, 7, 5], [4, 6, 7, 2]
    cq = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), dtype=torch.int32)
    ck = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), dtype=torch.int32)
    q, k, v = torch.randn(sum(lq), 4, 16), torch.randn(sum(lk), 2, 16), torch.randn(sum(lk), 2, 16)
    out, lse = attention_reference(q, k, v, causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck, return_lse=True)
    assert out.shape == q.shape and lse.shape == (4, sum(lq))
    for b in range(4):
        qs, ks = slice(int(cq[b]), int(cq[b + 1])), slice(int(ck[b]), int(ck[b + 1]))
        o, l = attention_reference(q[qs][None], k[ks][None], v[ks][None], causal=True, layout="bshd", return_lse=True)
        torch.testing.assert_close(out[qs], o[0])
        torch.testing.assert_close(lse[:, qs], l[0])
