"""Attention backward on the CPU: the reference (FP64 gradcheck, autograd agreement), the Triton kernels
under the interpreter on tiny odd shapes, Philox dropout, FP8 epilogues, bytes accounting, validation.

Thresholds (NRMSE against the FP32 reference; measured on these inputs, then given a margin):
* BF16 kernel gradients: measured 3.5e-3 .. 4.9e-3 -> bound 1e-2 (about 2x).  A mask / index bug
  gives O(0.1 .. 1).
* FP8 per-row-scaled gradients: E4M3 measured 2.1e-2 .. 2.5e-2 -> 3.5e-2; E5M2 4.4e-2 .. 5.2e-2 -> 7e-2
  (E4M3 has one more mantissa bit: half the step, so about half the error).
"""
import math
import os
import subprocess
import sys

import pytest
import torch
from bwd_common import (
    BF16_TOL,
    FP8_TOL,
    check_fp8_epilogue,
    fp8_bits,
    make_inputs,
    make_varlen,
    nrmse,
    triton_interpreted,
)

from lowbit.attention import backward as BW
from lowbit.attention import reference as R
from lowbit.attention.reference import attention_reference
from lowbit.formats import philox_randint
from lowbit.quant import Float8Rowwise, QuantizedTensor, quantize


# ----------------------------------------------------------------------------- reference
def test_reference_gradcheck_fp64():
    torch.manual_seed(1)
    q = torch.randn(1, 2, 5, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 7, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 7, 8, dtype=torch.float64, requires_grad=True)
    for causal, p in ((False, 0.0), (True, 0.0), (True, 0.4)):
        f = lambda q, k, v: R.attention_forward_reference(  # noqa: E731
            q, k, v, causal=causal, dropout_p=p, seed=7, dtype=torch.float64)[0]
        assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("causal,p,window", [(False, 0.0, None), (True, 0.0, None), (True, 0.25, None),
                                             (False, 0.25, (3, 2))])
def test_reference_backward_equals_autograd(causal, p, window):
    """Explicit formulas == autograd through the reference forward (FP64), GQA, Sq != Sk."""
    q, k, v, do = (x.double() for x in make_inputs(2, 4, 2, 11, 13, 16, dtype=torch.float64, seed=3))
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    out, _ = R.attention_forward_reference(qq, kk, vv, causal=causal, window=window, dropout_p=p, seed=99,
                                            dtype=torch.float64)
    ga = torch.autograd.grad(out, (qq, kk, vv), do)
    gr = R.attention_backward_reference(do, q, k, v, causal=causal, window=window, dropout_p=p, seed=99,
                                         dtype=torch.float64)
    for a, b in zip(gr, ga):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_reference_matches_forward_engineers_reference():
    """No dropout: our reference forward/backward == autograd of attention.reference (FP32)."""
    q, k, v, do = make_inputs(1, 4, 1, 9, 14, 16, dtype=torch.float32, seed=4, layout="bshd")
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    out = attention_reference(qq, kk, vv, causal=True, layout="bshd")
    ga = torch.autograd.grad(out, (qq, kk, vv), do)
    gr = R.attention_backward_reference(do, q, k, v, causal=True, layout="bshd")
    for a, b in zip(gr, ga):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- dropout mask
def test_dropout_mask_rule_and_rate():
    m = R.dropout_keep_mask(5, 11, (2, 3, 40, 50), 0.3)
    # the rule, element by element, for a few positions
    for (b, h, i, j) in [(0, 0, 0, 0), (1, 2, 39, 49), (1, 0, 7, 3)]:
        idx = 11 + ((b * 3 + h) * 40 + i) * 50 + j
        r = int(philox_randint(5, torch.tensor([idx]))[0])
        assert bool(m[b, h, i, j]) == (((r >> 8) * 2.0 ** -24) >= 0.3)
    rate = m.float().mean().item()
    n = m.numel()
    assert abs(rate - 0.7) < 5 * math.sqrt(0.21 / n)  # binomial, 5 sigma
    assert torch.equal(m, R.dropout_keep_mask(5, 11, (2, 3, 40, 50), 0.3))  # reproducible
    assert not torch.equal(m, R.dropout_keep_mask(6, 11, (2, 3, 40, 50), 0.3))
    # offset shifts the counter stream
    m2 = R.dropout_keep_mask(5, 11 + 50, (1, 1, 39, 50), 0.3)
    assert torch.equal(m2[0, 0], m[0, 0, 1:])


# ----------------------------------------------------------------------------- kernels (interpreter)
def _run(q, k, v, do, **kw):
    fkw = {n: kw[n] for n in ("causal", "window", "dropout_p", "seed", "layout", "cu_seqlens_q", "cu_seqlens_k")
           if n in kw}
    o, lse = BW.attention_forward(q, k, v, **fkw)
    g = BW.backward(do, q, k, v, o, lse, **kw)
    return o, lse, g


def test_small_case_finite(kdev):
    q, k, v, do = make_inputs(1, 1, 1, 16, 16, 64, device=kdev, seed=10)
    o, lse, g = _run(q, k, v, do)
    gr = R.attention_backward_reference(do, q, k, v)
    for a, b in zip(g, gr):
        assert a.dtype == torch.bfloat16 and torch.isfinite(a).all()
        assert nrmse(a.cpu(), b.cpu()) < BF16_TOL


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_kernel_vs_reference_dropout_causal(kdev, causal, p):
    """dropout on/off x causal on/off, GQA 4:2, Sq != Sk (ragged), against the reference with the same mask."""
    q, k, v, do = make_inputs(1, 4, 2, 37, 29, 32, device=kdev, seed=int(causal) * 2 + int(p > 0))
    kw = dict(causal=causal, dropout_p=p, seed=4242 if p else None)
    o, lse, g = _run(q, k, v, do, **kw)
    o_ref, lse_ref = R.attention_forward_reference(q, k, v, **kw)
    assert nrmse(o.cpu(), o_ref.cpu()) < BF16_TOL
    fin = torch.isfinite(lse_ref).cpu()
    assert torch.equal(torch.isfinite(lse).cpu(), fin)
    torch.testing.assert_close(lse.cpu()[fin], lse_ref.cpu()[fin], rtol=0, atol=1e-4)
    gr = R.attention_backward_reference(do, q, k, v, **kw)
    errs = [nrmse(a.cpu(), b.cpu()) for a, b in zip(g, gr)]
    assert max(errs) < BF16_TOL, errs
    if p:  # a different mask must be visible
        g2 = R.attention_backward_reference(do, q, k, v, causal=causal, dropout_p=p, seed=4243)
        assert nrmse(g[2].cpu(), g2[2].cpu()) > 0.3


def test_kernel_bshd_window_mqa(kdev):
    q, k, v, do = make_inputs(2, 3, 1, 45, 45, 16, device=kdev, layout="bshd", seed=12)
    kw = dict(window=(9, 4), layout="bshd")
    o, lse, g = _run(q, k, v, do, **kw)
    gr = R.attention_backward_reference(do, q, k, v, **kw)
    for a, b, x in zip(g, gr, (q, k, v)):
        assert a.shape == x.shape and a.is_contiguous()
        assert nrmse(a.cpu(), b.cpu()) < BF16_TOL


def test_kernel_varlen_ragged(kdev):
    q, k, v, do, cq, ck = make_varlen([17, 1, 40], [23, 5, 40], 2, 1, 16, device=kdev, seed=13)
    kw = dict(causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck, dropout_p=0.1, seed=3)
    o, lse, g = _run(q, k, v, do, layout="thd", **kw)
    o_ref, _ = R.attention_forward_reference(q, k, v, **kw)
    assert nrmse(o.cpu(), o_ref.cpu()) < BF16_TOL
    gr = R.attention_backward_reference(do, q, k, v, **kw)
    errs = [nrmse(a.cpu(), b.cpu()) for a, b in zip(g, gr)]
    assert max(errs) < BF16_TOL, errs


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_epilogue_bitexact_and_floors(kdev, fmt):
    """FP8 rowwise and given-scale gradients == lowbit.quantize of the kernel's own FP32 gradients
    (interpreter with the emulated cast; the hardware cast is checked on the GPU), and their error floors."""
    q, k, v, do = make_inputs(1, 4, 2, 33, 40, 32, device=kdev, seed=20)
    check_fp8_epilogue(q, k, v, do, dict(causal=True), ((16, 32, 4, 1), (32, 16, 4, 1)), fmt,
                       tensorwise_tol=FP8_TOL[fmt])


def test_fp8_e4m3_tighter_than_e5m2_reference_backend():
    q, k, v, do = make_inputs(2, 2, 2, 24, 24, 32, dtype=torch.float32, seed=21)
    o, lse = BW.attention_forward(q, k, v, backend="reference")
    gr = R.attention_backward_reference(do, q, k, v)
    e = {}
    for fmt in ("e4m3", "e5m2"):
        g = BW.backward(do, q, k, v, o, lse, grad_format=fmt, backend="reference")
        for a, x in zip(g, gr):  # the reference backend IS lowbit.quantize of the FP32 gradients
            assert torch.equal(fp8_bits(a), fp8_bits(quantize(x, Float8Rowwise(fmt), backend="reference")))
        e[fmt] = max(nrmse(a.dequantize(), x) for a, x in zip(g, gr))
    assert e["e4m3"] < FP8_TOL["e4m3"] and e["e5m2"] < FP8_TOL["e5m2"]
    assert e["e4m3"] < 0.7 * e["e5m2"], e


# ----------------------------------------------------------------------------- bytes
def test_fp8_writes_half_the_gradient_bytes():
    shape = (4, 32, 8, 4096, 4096, 128)
    b16 = BW.backward_write_bytes(*shape)
    b8 = BW.backward_write_bytes(*shape, grad_format="e4m3")
    b8t = BW.backward_write_bytes(*shape, grad_format="e4m3", per_row_scales=False)
    assert b8["gradients"] * 2 == b16["gradients"]
    assert b8t["gradients"] + b8t["gradient_scales"] < 0.5001 * b16["gradients"]
    # per-row scales add 4 bytes per 128-byte FP8 row: 1/32 of the FP8 data (1/64 of the BF16 bytes)
    assert b8["gradient_scales"] / b8["gradients"] < 1 / 32 + 1e-6
    assert b8["dq"] + b8["dkdv"] < 0.516 * (b16["dq"] + b16["dkdv"])


def test_returned_gradient_bytes_half(kdev):
    q, k, v, do = make_inputs(1, 2, 1, 20, 24, 32, device=kdev, seed=22)
    o, lse = BW.attention_forward(q, k, v)
    g16 = BW.backward(do, q, k, v, o, lse)
    g8 = BW.backward(do, q, k, v, o, lse, grad_format="e5m2")
    n16 = sum(x.numel() * x.element_size() for x in g16)
    n8 = sum(x.data_nbytes for x in g8)
    assert n8 * 2 == n16
    acc = BW.backward_write_bytes(1, 2, 1, 20, 24, 32, grad_format="e5m2")
    assert n8 == acc["gradients"] and sum(x.nbytes for x in g8) == acc["gradients"] + acc["gradient_scales"] - 12


# ----------------------------------------------------------------------------- autograd + API
def test_autograd_function_reference_backend_and_sink():
    q, k, v, do = make_inputs(1, 2, 2, 12, 12, 16, dtype=torch.float32, seed=23)
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    out = BW.attention_with_grad(qq, kk, vv, causal=True, dropout_p=0.1, seed=5, backend="reference")
    out.backward(do)
    gr = R.attention_backward_reference(do, q, k, v, causal=True, dropout_p=0.1, seed=5)
    for x, r in zip((qq, kk, vv), gr):
        torch.testing.assert_close(x.grad, r, rtol=1e-4, atol=1e-5)
    sink = {}
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    BW.attention_with_grad(qq, kk, vv, grad_format="e4m3", grad_sink=sink, backend="reference").backward(do)
    assert set(sink) == {"dq", "dk", "dv"} and isinstance(sink["dq"], QuantizedTensor)
    torch.testing.assert_close(qq.grad, sink["dq"].dequantize())


def test_autograd_function_kernels(kdev):
    q, k, v, do = make_inputs(1, 2, 1, 19, 19, 16, device=kdev, seed=24)
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    out = BW.attention_with_grad(qq, kk, vv, causal=True)
    out.backward(do)
    gr = R.attention_backward_reference(do, q, k, v, causal=True)
    for x, r in zip((qq, kk, vv), gr):
        assert nrmse(x.grad.cpu(), r.cpu()) < BF16_TOL


def test_validation_errors():
    q, k, v, do = make_inputs(1, 2, 1, 8, 8, 16, dtype=torch.float32)
    lse = torch.zeros(1, 2, 8)
    bw = lambda **kw: BW.backward(do, q, k, v, q, lse, backend="reference", **kw)  # noqa: E731
    with pytest.raises(ValueError, match="grad_format"):
        bw(grad_format="e3m4")
    with pytest.raises(ValueError, match="dropout_p"):
        bw(dropout_p=1.0)
    with pytest.raises(ValueError, match="seed"):
        bw(dropout_p=0.1)
    with pytest.raises(ValueError, match="layout"):
        bw(layout="sbhd")
    with pytest.raises(ValueError, match="scale_dk"):
        bw(grad_format="e4m3", scales=(torch.ones(1), torch.ones(2), torch.ones(1)))
    with pytest.raises(TypeError, match="scales"):
        bw(grad_format="e4m3", scales=torch.ones(1))
    with pytest.raises(ValueError, match="lse must be float32 of shape"):
        BW.backward(do, q, k, v, q, torch.zeros(1, 2, 7), backend="reference")
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        BW.backward(do, q, k.repeat(1, 3, 1, 1)[:, :3], v.repeat(1, 3, 1, 1)[:, :3], q, lse, backend="reference")
    with pytest.raises(TypeError, match="share one dtype"):
        BW.backward(do.bfloat16(), q, k, v, q, lse, backend="reference")
    with pytest.raises(ValueError, match="window"):
        bw(window=(2,))
    with pytest.raises(TypeError, match="bfloat16/float16"):
        BW.backward(do, q, k, v, q, lse, backend="triton")


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_scale_value_validation(bad):
    """Given per-tensor scales must be positive and finite (a zero scale made scale_inv = inf and the dequantized
    gradients inf/NaN). Checked for CPU tensors; CUDA values are the caller's contract (no device sync)."""
    q, k, v, do = make_inputs(1, 2, 1, 8, 8, 16, dtype=torch.float32)
    o, lse = BW.attention_forward(q, k, v, backend="reference")
    one = torch.ones(1)
    for i, name in enumerate(("scale_dq", "scale_dk", "scale_dv")):
        sc = [one, one, one]
        sc[i] = torch.tensor([bad])
        with pytest.raises(ValueError, match=f"{name} must be positive and finite .*got {bad!r}"):
            BW.backward(do, q, k, v, o, lse, grad_format="e4m3", scales=tuple(sc), backend="reference")
        with pytest.raises(ValueError, match=f"{name} must be positive and finite"):
            BW.attention_with_grad(q, k, v, grad_format="e5m2", scales=dict(zip(("dq", "dk", "dv"), sc)),
                                   backend="reference")
    g = BW.backward(do, q, k, v, o, lse, grad_format="e4m3", scales=(one, one * 2, one * 0.5), backend="reference")
    assert all(torch.isfinite(x.dequantize()).all() for x in g)


def test_attention_forward_validation():
    """attention_forward checks shapes, dtypes and head_dim itself (a batch-2 k used to broadcast against a batch-1
    q into a wrong answer; a head_dim or GQA mismatch was a bare RuntimeError)."""
    q, k, v, _ = make_inputs(1, 4, 2, 8, 9, 16, dtype=torch.float32)
    fwd = lambda *a, **kw: BW.attention_forward(*a, **dict(dict(backend="reference"), **kw))  # noqa: E731
    k2, v2 = k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1)
    with pytest.raises(ValueError, match="batch sizes differ: q 1, k 2, v 2"):
        fwd(q, k2, v2)
    with pytest.raises(ValueError, match="head_dim must match: q 16, k 8"):
        fwd(q, k[..., :8], v)
    with pytest.raises(ValueError, match="multiple of key/value heads.*Hq=4, Hkv=3"):
        fwd(q, k.repeat(1, 2, 1, 1)[:, :3], v.repeat(1, 2, 1, 1)[:, :3])
    with pytest.raises(ValueError, match="k and v must have the same heads and length"):
        fwd(q, k, v[:, :, :5])
    with pytest.raises(TypeError, match="share one dtype"):
        fwd(q, k.double(), v)
    with pytest.raises(TypeError, match="float16/bfloat16"):
        fwd(q.int(), k.int(), v.int())
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        fwd(q.tolist(), k, v)
    with pytest.raises(ValueError, match="window"):
        fwd(q, k, v, window=(1,))
    with pytest.raises(ValueError, match="layout"):
        fwd(q, k, v, layout="sbhd")
    with pytest.raises(ValueError, match="backend must be"):
        fwd(q, k, v, backend="sdpa")
    with pytest.raises(TypeError, match="the Triton forward needs bfloat16/float16"):
        fwd(q, k, v, backend="triton")
    qb, kb, vb = (t.bfloat16() for t in (q[..., :8], k[..., :8], v[..., :8]))
    with pytest.raises(NotImplementedError, match="head_dim in"):
        fwd(qb, kb, vb, backend="triton")
    tq, tk = q[0].transpose(0, 1), k[0].transpose(0, 1)
    with pytest.raises(TypeError, match="int32"):
        fwd(tq, tk, tk, cu_seqlens_q=torch.tensor([0, 8]), cu_seqlens_k=torch.tensor([0, 9]))
    with pytest.raises(ValueError, match="given together"):
        fwd(tq, tk, tk, cu_seqlens_q=torch.tensor([0, 8], dtype=torch.int32))


# ----------------------------------------------------------------------------- interpreter subprocess
@pytest.mark.skipif(torch.cuda.is_available() or triton_interpreted(),
                    reason="kernels run in this process already (GPU or interpreted Triton)")
def test_interpreter_subprocess():
    """The Triton interpreter needs TRITON_INTERPRET=1 before Triton is imported (its standard library is
    interpreted too), so the kernel tests of this file run in a child process with it set."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env["PYTHONPATH"] = os.path.abspath(src) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                        "-k", "not interpreter_subprocess and not reference and not dropout_mask and not validation"
                        " and not half_the_gradient and not tighter"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and " passed" in r.stdout and "skipped" not in r.stdout.split("\n")[-2], \
        r.stdout[-6000:] + r.stderr[-3000:]
