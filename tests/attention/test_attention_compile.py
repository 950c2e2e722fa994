"""``lowbit.attention`` under ``torch.compile``: the custom operators (``lowbit::attention_fwd`` / ``attention_bwd``,
``attention16_fwd`` / ``attention16_bwd``, ``attention_qk_int8``) pass ``torch.library.opcheck``, and compiled calls
(``fullgraph=True``: no graph break) give eager's bits for outputs, LSE and gradients."""

import pytest
import torch

from lowbit.attention import attention, attention_qk_int8, quantize_qk

OPS = torch.ops.lowbit


def rand(*shape, seed=0, dtype=torch.bfloat16, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


def qkv(B=2, Hq=4, Hkv=2, Sq=13, Sk=19, D=16, dtype=torch.bfloat16, layout="bhsd", device="cpu"):
    q, k, v = (rand(B, h, s, D, seed=i, dtype=dtype, device=device)
               for i, (h, s) in enumerate(((Hq, Sq), (Hkv, Sk), (Hkv, Sk)), 1))
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    return q, k, v


def varlen_qkv(dtype=torch.bfloat16, device="cpu", D=16):
    cq = torch.tensor([0, 5, 17, 18], dtype=torch.int32, device=device)
    ck = torch.tensor([0, 9, 20, 30], dtype=torch.int32, device=device)
    q, k, v = (rand(t, h, D, seed=s, dtype=dtype, device=device) for t, h, s in ((18, 4, 4), (30, 2, 5), (30, 2, 6)))
    return q, k, v, dict(cu_seqlens_q=cq, cu_seqlens_k=ck)


def run(fn, ins, needs=(True, True, True), seed=0):
    """fn(*ins) with the inputs that ``needs`` names requiring grad, backward from a fixed dO when any does:
    [outputs..., grads...]."""
    ins = [t.clone().requires_grad_(n) for t, n in zip(ins, needs)]
    torch.manual_seed(seed)  # (dropout draws its seed from the default generator)
    res = fn(*ins)
    res = list(res) if isinstance(res, tuple) else [res]
    if any(needs):
        res[0].backward(rand(*res[0].shape, seed=99, dtype=res[0].dtype, device=res[0].device))
    return res + [t.grad for t in ins if t.requires_grad]


def assert_bits(got, exp):
    assert len(got) == len(exp)
    for g, e in zip(got, exp):
        assert g.dtype == e.dtype and g.shape == e.shape
        assert torch.equal(g, e), (g.float() - e.float()).abs().max()


def compiled_matches_eager(fn, ins, backend, needs=(True, True, True), **compile_kw):
    torch._dynamo.reset()
    exp = run(fn, ins, needs)
    got = run(torch.compile(fn, fullgraph=True, backend=backend, **compile_kw), ins, needs)
    assert_bits(got, exp)


def graph_ops(fn, *args):
    """The ``lowbit::`` operators in the graph Dynamo captures for fn(*args) (fullgraph)."""
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target).removesuffix(".default") for n in gm.graph.nodes
                    if n.op == "call_function" and "lowbit" in str(n.target))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, fullgraph=True, backend=backend)(*args)
    return seen


# ----------------------------------------------------------------------------- compiled == eager, bit for bit
CASES = {
    "bf16": dict(),
    "bf16-causal-lse": dict(causal=True, return_lse=True),
    "bf16-pv-fp16": dict(pv="fp16", causal=True),
    "sdpa-causal": dict(backend="sdpa", causal=True),  # (traces the choice of the backward: cuDNN's or not)
    "fp16": dict(qk="fp16", dtype=torch.float16),
    "fp32": dict(dtype=torch.float32, causal=True),
    "int8": dict(qk="int8"),
    "int8-fp8-causal": dict(qk="int8", pv="fp8", causal=True),
    "int8-fp16-per-warp-lse": dict(qk="int8", pv="fp16", granularity="per_warp", block_q=16, warp_q=8,
                                   return_lse=True),
    "int8-no-smooth": dict(qk="int8", smooth_k=False, softmax_scale=0.3),
    "fp8": dict(qk="fp8", pv="fp8", return_lse=True),
    "fp8-bf16-bshd": dict(qk="fp8", pv="bf16", layout="bshd", causal=True),
    "fp16-int8": dict(qk="int8", pv="fp16", dtype=torch.float16, causal=True),
    "window": dict(window=(4, 0), qk="int8"),
    "mqa": dict(qk="int8", pv="fp8", Hkv=1),
    "dropout": dict(dropout_p=0.25, causal=True),
    "grad-e4m3": dict(grad_format="e4m3"),
    "grad-e5m2-scales": dict(grad_format="e5m2", scales=(torch.tensor([64.0]), torch.tensor([32.0]),
                                                          torch.tensor([16.0]))),
    "int8-grad-e4m3": dict(qk="int8", grad_format="e4m3", causal=True),
}
_SHAPE_KEYS = ("dtype", "layout", "Hkv")


def _split(case):
    shape = {n: case[n] for n in _SHAPE_KEYS if n in case}
    return shape, {n: x for n, x in case.items() if n not in ("dtype", "Hkv")}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_attention_matches_eager(name, backend):
    shape, kw = _split(CASES[name])
    compiled_matches_eager(lambda q, k, v: attention(q, k, v, **kw), qkv(**shape), backend)


@pytest.mark.parametrize("qk,pv", [("bf16", "auto"), ("int8", "fp8"), ("fp8", "fp16")])
@pytest.mark.parametrize("max_seqlen", [None, (12, 11)])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_varlen_matches_eager(qk, pv, max_seqlen, backend):
    q, k, v, cu = varlen_qkv()
    mq, mk = max_seqlen or (None, None)
    compiled_matches_eager(lambda q, k, v: attention(q, k, v, qk=qk, pv=pv, causal=True, max_seqlen_q=mq,
                                                     max_seqlen_k=mk, return_lse=True, **cu), (q, k, v), backend)


def test_compiled_varlen_dropout_grad_format_matches_eager():
    q, k, v, cu = varlen_qkv()
    compiled_matches_eager(lambda q, k, v: attention(q, k, v, dropout_p=0.2, grad_format="e4m3", **cu), (q, k, v),
                           "aot_eager")


@pytest.mark.parametrize("needs", [(True, False, False), (False, True, True), (False, False, False)])
@pytest.mark.parametrize("qk", ["bf16", "int8"])
def test_compiled_partial_and_no_grad(needs, qk):
    compiled_matches_eager(lambda q, k, v: attention(q, k, v, qk=qk, causal=True), qkv(), "aot_eager", needs=needs)


def test_compiled_under_no_grad_and_dynamic_shapes():
    fn = torch.compile(lambda q, k, v: attention(q, k, v, qk="int8", pv="fp8", return_lse=True), fullgraph=True,
                       backend="aot_eager", dynamic=True)
    torch._dynamo.reset()
    for sq, sk in ((13, 19), (21, 30)):
        ins = qkv(Sq=sq, Sk=sk)
        with torch.no_grad():
            assert_bits(list(fn(*ins)), list(attention(*ins, qk="int8", pv="fp8", return_lse=True)))


def model_views(**kw):
    """q, k, v as a model's projections hand them over: (B, H, S, D) views of (B, S, H, D)-contiguous tensors."""
    return tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in qkv(**kw))


@pytest.mark.parametrize("qk,pv", [("bf16", "auto"), ("int8", "fp8")])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_model_layout_views_keep_memory_order(qk, pv, backend):
    """(B, H, S, D) views of (B, S, H, D) tensors and a dO of the same kind (the gradient of the model's transpose
    back to (B, S, H·D)): the output and every gradient come back in their input's memory order, eager and compiled
    (the operators' fakes agree with what runs), and compiled gives eager's bits."""
    torch._dynamo.reset()
    fn = lambda q, k, v: attention(q, k, v, qk=qk, pv=pv, causal=True)  # noqa: E731
    got = []
    for f in (fn, torch.compile(fn, fullgraph=True, backend=backend)):
        ins = [t.clone().requires_grad_() for t in model_views(Sq=19)]
        out = f(*ins)
        do = rand(out.shape[0], out.shape[2], out.shape[1], out.shape[3], seed=99).transpose(1, 2)
        grads = torch.autograd.grad(out, ins, do)
        assert out.stride() == ins[0].stride()
        assert [g.stride() for g in grads] == [t.stride() for t in ins]
        got.append([out, *grads])
    assert_bits(got[1], got[0])


def test_compiled_inductor_cpu():
    compiled_matches_eager(lambda q, k, v: attention(q, k, v, qk="int8", pv="fp8", causal=True), qkv(), "inductor")


@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_attention_qk_int8_matches_eager(return_lse, varlen, backend):
    if varlen:
        q, k, v, cu = varlen_qkv()
        qq = quantize_qk(q, k, granularity="per_warp", **cu)
        cu = dict(cu, max_seqlen_q=12, max_seqlen_k=11)
    else:
        q, k, v = qkv()
        qq, cu = quantize_qk(q, k, granularity="per_warp"), {}

    def fn(v):
        return attention_qk_int8(qq.q, qq.k, v, qq.q_scale, qq.k_scale, k_mean=qq.k_mean, granularity="per_warp",
                                 causal=True, pv="fp8", return_lse=return_lse, **cu)

    torch._dynamo.reset()
    exp = fn(v)
    got = torch.compile(fn, fullgraph=True, backend=backend)(v)
    assert_bits(list(got) if return_lse else [got], list(exp) if return_lse else [exp])


@pytest.mark.parametrize("kw,ops", [
    (dict(qk="int8"), {"lowbit.attention_fwd"}),
    (dict(dropout_p=0.1), {"lowbit.attention16_fwd"}),
    (dict(grad_format="e4m3"), {"lowbit.attention16_fwd"}),
])
def test_compiled_graph_holds_the_operator(kw, ops):
    ins = [t.requires_grad_() for t in qkv()]
    assert set(graph_ops(lambda q, k, v: attention(q, k, v, **kw), *ins)) == ops


# ----------------------------------------------------------------------------- what compiles differently
def test_compile_errors():
    """The argument checks run while tracing: with fullgraph=True Dynamo reports the error it observed (its
    Unsupported, naming the original error), otherwise the call falls back to eager, which raises it."""
    q, k, v = (t.requires_grad_() for t in qkv())
    qq = quantize_qk(q.detach(), k.detach())
    for fn, exc, match in (
        (lambda q, k, v: attention(q, k, v, grad_format="e4m3", grad_sink={}), NotImplementedError,
         "grad_sink is not supported under torch.compile"),
        (lambda q, k, v: attention(q, k, v, qk="int4"), ValueError, "qk must be one of"),
        (lambda q, k, v: attention_qk_int8(qq.q, qq.k, v, qq.q_scale, qq.k_scale), NotImplementedError,
         "attention_qk_int8 under torch.compile is not differentiable"),
    ):
        torch._dynamo.reset()
        with pytest.raises((torch._dynamo.exc.Unsupported, exc), match=match):
            torch.compile(fn, fullgraph=True, backend="eager")(q, k, v)
        if exc is ValueError:
            torch._dynamo.reset()
            with pytest.raises(exc, match=match):
                torch.compile(fn, backend="eager")(q, k, v)


def test_compile_checks_values_when_the_operator_runs():
    """cu_seqlens and CPU gradient-scale values are not read while tracing: the operator checks them (same
    errors as eager)."""
    q, k, v, cu = varlen_qkv()
    bad = dict(cu, cu_seqlens_k=torch.tensor([0, 9, 20, 31], dtype=torch.int32))
    torch._dynamo.reset()
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\]=18 / cu_seqlens_k\[-1\]=31 must equal"):
        torch.compile(lambda q, k, v: attention(q, k, v, **bad), fullgraph=True, backend="aot_eager")(q, k, v)
    q, k, v = (t.requires_grad_() for t in qkv())
    zero = (torch.ones(1), torch.zeros(1), torch.ones(1))
    for qk in ("bf16", "int8"):
        torch._dynamo.reset()
        with pytest.raises(ValueError, match="scale_dk must be positive and finite"):
            torch.compile(lambda q, k, v: attention(q, k, v, qk=qk, grad_format="e4m3", scales=zero), fullgraph=True,
                          backend="aot_eager")(q, k, v)


# ----------------------------------------------------------------------------- opcheck
def fwd_args(q, k, v, *, cu=(None, None), max_seqlen=(None, None), scales=(None, None, None), causal=False,
             softmax_scale=None, window=None, layout="bhsd", qk="bf16", pv="native", granularity="per_block",
             smooth_k=True, blocks=(128, 64, 32), backend="reference", return_lse=True, grad_format=None):
    return (q, k, v, *cu, *max_seqlen, *scales, causal, softmax_scale, window, layout, qk, pv, granularity, smooth_k,
            *blocks, backend, return_lse, grad_format)


def bwd_args(g, q, k, v, *, out=None, lse=None, cu=(None, None), max_seqlen=(None, None), scales=(None, None, None),
             causal=False, softmax_scale=None, window=None, layout="bhsd", grad_format=None, mask=(True, True, True)):
    return (g, q, k, v, out, lse, *cu, *max_seqlen, *scales, causal, softmax_scale, window, layout, grad_format,
            list(mask))


def fwd16_args(q, k, v, *, cu=(None, None), max_seqlen=(None, None), scales=(None, None, None), causal=False,
               softmax_scale=None, window=None, dropout_p=0.0, seed=None, offset=0, layout="bhsd",
               backend="reference", grad_format=None):
    return (q, k, v, *cu, *max_seqlen, *scales, causal, softmax_scale, window, dropout_p, seed, offset, layout,
            backend, grad_format)


def _grad(ts):
    return [t.detach().clone().requires_grad_() for t in ts]


def _vl():
    q, k, v, cu = varlen_qkv()
    return (q, k, v), dict(cu=(cu["cu_seqlens_q"], cu["cu_seqlens_k"]), layout="thd")


ONE = torch.ones(1)
FWD_OPCHECK = {
    "bf16": lambda: (qkv(Sq=7, Sk=9), dict()),
    "bf16-causal-window": lambda: (qkv(Sq=7, Sk=9), dict(causal=True, window=[3, -1], softmax_scale=0.3)),
    "int8-per-warp": lambda: (qkv(Sq=7, Sk=9), dict(qk="int8", granularity="per_warp", blocks=(16, 16, 8))),
    "int8-fp8-bshd": lambda: (qkv(Sq=7, Sk=9, layout="bshd"), dict(qk="int8", pv="fp8", layout="bshd")),
    "int8-fp8-model-views": lambda: (model_views(Sq=7, Sk=9), dict(qk="int8", pv="fp8", causal=True)),
    "fp8-fp16-no-lse": lambda: (qkv(Sq=7, Sk=9), dict(qk="fp8", pv="fp16", return_lse=False, causal=True)),
    "fp32": lambda: (qkv(Sq=5, Sk=3, dtype=torch.float32), dict(causal=True)),
    "varlen-int8": lambda: (_vl()[0], dict(_vl()[1], qk="int8", pv="fp8", max_seqlen=(12, 11))),
    "grad-scales": lambda: (qkv(Sq=7, Sk=9), dict(qk="int8", scales=(ONE, ONE, ONE), grad_format="e4m3")),
}


@pytest.mark.parametrize("name", list(FWD_OPCHECK))
def test_opcheck_attention_fwd(name):
    ins, kw = FWD_OPCHECK[name]()
    torch.library.opcheck(OPS.attention_fwd.default, fwd_args(*_grad(ins), **kw))


@pytest.mark.parametrize("mask", [(True, True, True), (False, True, False)])
@pytest.mark.parametrize("grad_format", [None, "e5m2"])
@pytest.mark.parametrize("inputs", ["bhsd", "varlen", "model-views"])
def test_opcheck_attention_bwd(mask, grad_format, inputs):
    (q, k, v), kw = {"bhsd": lambda: (qkv(Sq=7, Sk=9), {}), "varlen": _vl,
                     "model-views": lambda: (model_views(Sq=7, Sk=9), {})}[inputs]()
    g = rand(*q.shape, seed=7)
    torch.library.opcheck(OPS.attention_bwd.default,
                          bwd_args(g, q, k, v, causal=True, grad_format=grad_format, mask=mask, **kw))


@pytest.mark.parametrize("kw", [dict(), dict(causal=True, dropout_p=0.3, seed=1234),
                                dict(grad_format="e4m3", scales=(ONE, ONE, ONE), window=[2, 2])])
@pytest.mark.parametrize("varlen", [False, True])
def test_opcheck_attention16(kw, varlen):
    (q, k, v), vk = _vl() if varlen else (qkv(Sq=7, Sk=9), {})
    args = fwd16_args(*_grad((q, k, v)), **vk, **kw)
    torch.library.opcheck(OPS.attention16_fwd.default, args)
    out, lse, seed = OPS.attention16_fwd(q, k, v, *args[3:])
    bwd = (rand(*q.shape, seed=7), q, k, v, out, lse, seed) + args[3:]
    torch.library.opcheck(OPS.attention16_bwd.default, bwd)


@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("varlen", [False, True])
def test_opcheck_attention_qk_int8(return_lse, varlen):
    if varlen:
        (q, k, v), kw = _vl()
        cu = kw["cu"]
        qq = quantize_qk(q, k, cu_seqlens_q=cu[0], cu_seqlens_k=cu[1])
    else:
        q, k, v = qkv(Sq=7, Sk=9)
        qq, cu = quantize_qk(q, k), (None, None)
    args = (qq.q, qq.k, v, qq.q_scale, qq.k_scale, qq.k_mean, *cu, None, None, True, "thd" if varlen else "bhsd",
            "per_block", 128, 64, 32, "fp8", None, return_lse, "reference")
    torch.library.opcheck(OPS.attention_qk_int8.default, args)


# ----------------------------------------------------------------------------- GPU: inductor
GPU_CASES = {
    "bf16": dict(),  # SDPA forward, fused Triton backward
    "bf16-causal-lse": dict(causal=True, return_lse=True),  # Triton forward keeps O and LSE
    "fp16-window": dict(qk="fp16", dtype=torch.float16, window=(64, 0)),
    "bf16-pv-fp16": dict(pv="fp16", causal=True),
    "int8": dict(qk="int8"),
    "int8-fp8-causal-per-warp": dict(qk="int8", pv="fp8", causal=True, granularity="per_warp"),
    "int8-fp16-lse": dict(qk="int8", pv="fp16", return_lse=True),
    "fp8-fp8-bshd": dict(qk="fp8", pv="fp8", layout="bshd", causal=True),
    "mqa-int8": dict(qk="int8", Hkv=1),
    "dropout": dict(dropout_p=0.1, causal=True),
    "grad-e4m3": dict(grad_format="e4m3"),
    "int8-grad-e5m2": dict(qk="int8", grad_format="e5m2", causal=True),
    "reference": dict(qk="int8", backend="reference"),
}


def _no_cudnn_sdp():
    """cuDNN's SDPA off for a block (lowbit's backward then runs its Triton kernels): cuDNN's attention backward sums
    dQ in an order that changes from run to run, so two runs of it are not bit-identical."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_compiled_attention_inductor_cuda(name):
    shape, kw = _split(GPU_CASES[name])
    ins = qkv(Sq=200, Sk=333, D=64, device="cuda", **shape)
    with _no_cudnn_sdp():
        compiled_matches_eager(lambda q, k, v: attention(q, k, v, **kw), ins, "inductor")


@pytest.mark.gpu
@pytest.mark.parametrize("qk", ["bf16", "int8"])
def test_compiled_attention_cudnn_backward_cuda(qk):
    """Where the backward is cuDNN's (non-causal, dense, 16-bit gradients), compiled equals eager bit for bit in O, dK
    and dV; dQ, which cuDNN sums in a run-dependent order, within two BF16 rounding steps of eager's."""
    from lowbit.attention.backward import backward_backend

    q, k, v = qkv(Sq=200, Sk=333, D=64, device="cuda")
    assert backward_backend(q.device, q.dtype, batch=2, heads_q=4, heads_kv=2, seqlen_q=200, seqlen_k=333,
                            head_dim=64) == "cudnn"
    fn = lambda q, k, v: attention(q, k, v, qk=qk)  # noqa: E731
    torch._dynamo.reset()
    exp = run(fn, (q, k, v))
    got = run(torch.compile(fn, fullgraph=True), (q, k, v))
    assert_bits([got[0], got[2], got[3]], [exp[0], exp[2], exp[3]])
    torch.testing.assert_close(got[1], exp[1], rtol=2**-7, atol=2**-12 * exp[1].abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [dict(), dict(qk="int8", pv="fp8", return_lse=True), dict(dropout_p=0.1)])
def test_compiled_varlen_inductor_cuda(kw):
    q, k, v, cu = varlen_qkv(device="cuda", D=32)  # (8-bit Q·K^T on the Triton kernel needs head_dim >= 32)
    compiled_matches_eager(lambda q, k, v: attention(q, k, v, causal=True, **cu, **kw), (q, k, v), "inductor")


@pytest.mark.gpu
@pytest.mark.parametrize("pv", ["bf16", "fp16", "fp8"])
def test_compiled_attention_qk_int8_inductor_cuda(pv):
    q, k, v = qkv(Sq=200, Sk=333, D=64, device="cuda")
    qq = quantize_qk(q, k, granularity="per_warp")

    def fn(v):
        return attention_qk_int8(qq.q, qq.k, v, qq.q_scale, qq.k_scale, k_mean=qq.k_mean, granularity="per_warp",
                                 causal=True, pv=pv, return_lse=True)

    torch._dynamo.reset()
    assert_bits(list(torch.compile(fn, fullgraph=True)(v)), list(fn(v)))
