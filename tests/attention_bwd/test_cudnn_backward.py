"""cuDNN's attention backward as a backend of ``lowbit.attention.backward``: the rule that picks it (CPU, on
metadata), and on the GPU its gradients from lowbit's O and LSE (and from cuDNN's own forward) against the FP32
reference, with the Triton backward's bound (BF16_TOL: BF16/FP16 rounding of P, dS and the gradients sets the floor),
and the public API's gradients after a quantized forward (straight-through: the 16-bit gradient)."""
import pytest
import torch
from bwd_common import BF16_TOL, make_inputs, nrmse

from lowbit.attention import _cudnn
from lowbit.attention import backward as BW
from lowbit.attention import reference as R
from lowbit.runtime.device import INTERPRET
from lowbit.runtime.log import declines

# a call cuDNN computes: dense MHA, head_dim a multiple of 8 up to 128, causal with Sq == Sk
META = dict(batch=2, heads_q=4, heads_kv=4, seqlen_q=1000, seqlen_k=1000, head_dim=64, causal=True)
NOT_CUDNN = "triton" if INTERPRET else "reference"  # the default on the CPU

# (change to META, words of the reason: the argument and the value)
DECLINED = [
    (dict(window=(64, 0)), ["window must be None", "(64, 0)"]),
    (dict(window=(-1, 5), causal=False), ["window must be None", "(-1, 5)"]),
    (dict(seqlen_k=1200), ["causal needs seqlen_q == seqlen_k", "seqlen_q=1000, seqlen_k=1200"]),
    (dict(varlen=True), ["cu_seqlens_q/cu_seqlens_k must be None"]),
    (dict(dropout_p=0.1), ["dropout_p must be 0", "0.1"]),
    (dict(grad_format="e4m3"), ["grad_format must be None", "'e4m3'"]),
    (dict(grad_dtype=torch.float32), ["grad_dtype must be None or the inputs' dtype", "torch.float32"]),
    (dict(config=((64, 64, 4, 2), (64, 64, 4, 2))), ["config must be None"]),
    (dict(heads_kv=3), ["query heads must be a multiple of the key/value heads", "Hq=4, Hkv=3"]),
    (dict(head_dim=100), ["head_dim must be a multiple of 8 and at most 128", "got 100"]),
    (dict(head_dim=256), ["head_dim must be a multiple of 8 and at most 128", "got 256"]),
    (dict(seqlen_k=1, causal=False), ["seqlen_k >= 2", "seqlen_k=1"]),
    (dict(seqlen_q=0, causal=False), ["seqlen_q >= 1", "seqlen_q=0"]),
    (dict(batch=70000), ["batch and heads in [1, 65535]", "batch=70000"]),
]


@pytest.fixture
def cudnn_preferred(monkeypatch):
    """The machine facts of an H100 with a recent cuDNN (``_cudnn.cudnn_runtime_decline`` says None)."""
    monkeypatch.setattr(BW, "cudnn_runtime_decline", lambda device: None)


def test_backward_backend_picks_cudnn_where_the_math_is_the_same(cudnn_preferred):
    bf, hf = torch.bfloat16, torch.float16
    assert BW.backward_backend("cuda", bf, **META) == "cudnn"
    assert BW.backward_backend("cuda", hf, **dict(META, causal=False, seqlen_k=777, head_dim=128)) == "cudnn"
    assert BW.backward_backend("cuda", bf, **dict(META, window=(-1, -1))) == "cudnn"  # (an unbounded window)
    assert BW.backward_backend("cuda", bf, **dict(META, causal=False, window=(-1, 0))) == "cudnn"  # (= causal)
    assert BW.backward_backend("cuda", bf, **dict(META, grad_dtype=bf)) == "cudnn"
    assert BW.backward_backend("cuda", bf, **dict(META, head_dim=8, seqlen_q=1, seqlen_k=1, causal=True)) == "triton"
    # given backends are returned as given; on the CPU the default is the reference
    assert BW.backward_backend("cuda", bf, **META, backend="triton") == "triton"
    assert BW.backward_backend("cpu", bf, **META) == NOT_CUDNN
    assert BW.backward_backend("cuda", torch.float32, **META) == "triton"
    with pytest.raises(ValueError, match=r"backend must be one of \('triton', 'cudnn', 'reference'\) or None, got "
                                         r"'sdpa'"):
        BW.backward_backend("cuda", bf, **META, backend="sdpa")


@pytest.mark.parametrize("change,words", DECLINED)
def test_backward_backend_declines_other_math(cudnn_preferred, change, words):
    """Each rule: the default runs lowbit's Triton backward, and backend="cudnn" is a ValueError naming the argument,
    the rule and the value."""
    meta = dict(META, **change)
    assert BW.backward_backend("cuda", torch.bfloat16, **meta) == "triton"
    why = _cudnn.cudnn_decline(device_type="cuda", dtype=torch.bfloat16, **meta)
    assert why is not None and all(w in why for w in words), why
    with pytest.raises(ValueError, match="^backend='cudnn' cannot run this call: ") as e:
        BW.backward_backend("cuda", torch.bfloat16, **meta, backend="cudnn")
    assert all(w in str(e.value) for w in words), str(e.value)


def test_cudnn_declines_devices_and_dtypes():
    assert "device type 'cpu'" in _cudnn.cudnn_decline(device_type="cpu", dtype=torch.bfloat16, **META)
    assert "float16 or bfloat16" in _cudnn.cudnn_decline(device_type="cuda", dtype=torch.float32, **META)
    assert _cudnn.cudnn_decline(device_type="cuda", dtype=torch.float16, **META) is None


def test_machine_rule_without_cudnn(monkeypatch):
    """Where the machine's cuDNN is not lowbit's default (none, or too old), the default is Triton and says why."""
    if torch.backends.cudnn.is_available():
        monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 90100)
        monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
        assert "cuDNN 90100" in _cudnn.cudnn_runtime_decline(torch.device("cuda"))
    else:
        assert _cudnn.cudnn_runtime_decline(torch.device("cuda")) == "torch was built without cuDNN"
    assert BW.backward_backend("cuda", torch.bfloat16, **META) == "triton"


def test_backend_cudnn_refused_on_the_cpu_and_the_default_says_why():
    q, k, v, do = make_inputs(1, 2, 2, 8, 8, 16)
    o, lse = BW.attention_forward(q, k, v, backend="reference")
    with pytest.raises(ValueError, match="^backend='cudnn' cannot run this call: the tensors must be on CUDA for "
                                         "cuDNN, got device type 'cpu'"):
        BW.backward(do, q, k, v, o, lse, backend="cudnn")
    with pytest.raises(ValueError, match=r"^backend must be one of \('triton', 'cudnn', 'reference'\) or None"):
        BW.backward(do, q, k, v, o, lse, backend="sdpa")
    key = ("attention.backward.cudnn", "the tensors must be on CUDA for cuDNN, got device type 'cpu'")
    before = declines().get(key, 0)  # (earlier CPU backwards in this process count under the same key)
    BW.backward(do, q, k, v, o, lse)  # the default: the reference here
    assert declines().get(key, 0) == before + 1


def test_what_cudnn_is_handed_on_strides_alone():
    """``_cudnn._bhsd``: (B, H, S, D) views dense in bhsd or bshd memory order pass as they are (no copy); a packed
    projection's slice is copied into the dense order of its own strides, a tensor without a unit last stride
    contiguous in its layout, a misaligned one to an aligned copy; the values never change."""
    x = torch.randn(2, 40, 3, 16, dtype=torch.bfloat16)  # (B, S, H, D)
    for t, lay in ((x, "bshd"), (x.transpose(1, 2), "bhsd"), (x.transpose(1, 2).contiguous(), "bhsd")):
        got = _cudnn._bhsd(t, lay)
        assert got.data_ptr() == t.data_ptr() and torch.equal(got, R.to_bhsd(t, lay))
        assert _cudnn._back(got, lay).stride() == t.stride()
    packed = torch.randn(2, 40, 3, 3, 16, dtype=torch.bfloat16).unbind(2)[0]  # (B, S, H, D), heads 48 apart
    got = _cudnn._bhsd(packed, "bshd")
    assert got.data_ptr() != packed.data_ptr() and got.transpose(1, 2).is_contiguous()
    assert torch.equal(got, R.to_bhsd(packed, "bshd"))
    dlast = x.transpose(1, 3).contiguous().transpose(1, 3)  # head_dim not unit-stride
    got = _cudnn._bhsd(dlast, "bshd")
    assert got.transpose(1, 2).is_contiguous() and torch.equal(got, R.to_bhsd(dlast, "bshd"))
    same, copied = _cudnn.cudnn_inputs(x, packed, layout="bshd")  # (what a caller hands both cuDNN calls)
    assert same.data_ptr() == x.data_ptr() and same.stride() == x.stride()
    assert copied.is_contiguous() and torch.equal(copied, packed)
    assert _cudnn._bhsd(copied, "bshd").data_ptr() == copied.data_ptr()  # (no second copy)
    off = torch.randn(2 * 40 * 3 * 16 + 1, dtype=torch.bfloat16)[1:].view(2, 40, 3, 16)  # 2 bytes past alignment
    got = _cudnn._bhsd(off, "bshd")
    assert got.data_ptr() % 16 == 0 and torch.equal(got, R.to_bhsd(off, "bshd"))


# ----------------------------------------------------------------------------- GPU
def _cudnn_default_or_skip():
    why = _cudnn.cudnn_runtime_decline(torch.device("cuda"))
    if why is not None:
        pytest.skip(f"cuDNN is not lowbit's default backward on this machine: {why}")


def _check_grads(g, gr, ins, what):
    errs = [nrmse(a, r) for a, r in zip(g, gr)]
    print(what, ["%.2e" % e for e in errs])
    for a, x in zip(g, ins):  # (each gradient in its input's memory order, as torch.empty_like gives it)
        assert a.shape == x.shape and a.dtype == x.dtype and torch.isfinite(a).all()
        assert a.stride() == torch.empty_like(x).stride(), (a.stride(), x.stride())
    assert max(errs) < BF16_TOL, errs


@pytest.mark.gpu
@pytest.mark.parametrize("b,h,sq,sk,d,causal,layout,dtype,scale", [
    (2, 4, 1000, 1000, 64, True, "bhsd", torch.bfloat16, None),
    (2, 4, 1000, 1000, 128, False, "bhsd", torch.float16, None),
    (1, 8, 1000, 1000, 128, True, "bshd", torch.bfloat16, 0.3),
    (2, 3, 1000, 777, 64, False, "bshd", torch.float16, None),
    (1, 2, 17, 1000, 128, False, "bhsd", torch.bfloat16, None),
    (3, 5, 129, 129, 64, True, "bshd", torch.float16, None),
])
def test_cudnn_backward_vs_reference(b, h, sq, sk, d, causal, layout, dtype, scale):
    """cuDNN's backward given lowbit's 16-bit forward O and LSE, and given cuDNN's own forward's, against the FP32
    reference (BF16_TOL, the Triton backward's bound) and against lowbit's Triton backward."""
    q, k, v, do = make_inputs(b, h, h, sq, sk, d, dtype=dtype, device="cuda", layout=layout, seed=sq + d)
    kw = dict(causal=causal, layout=layout, softmax_scale=scale)
    o, lse = BW.attention_forward(q, k, v, **kw)
    g = BW.backward(do, q, k, v, o, lse, backend="cudnn", **kw)
    gr = R.attention_backward_reference(do, q, k, v, **kw)
    _check_grads(g, gr, (q, k, v), f"cudnn, lowbit's O/LSE {(b, h, sq, sk, d, causal, layout, dtype, scale)}")
    gt = BW.backward(do, q, k, v, o, lse, backend="triton", **kw)
    assert max(nrmse(a, t) for a, t in zip(g, gt)) < BF16_TOL
    o2, lse2 = _cudnn.cudnn_forward(q, k, v, causal=causal, layout=layout,
                                    softmax_scale=scale or d ** -0.5)
    assert o2.shape == o.shape and o2.is_contiguous() and lse2.shape == lse.shape
    assert nrmse(o2, o) < BF16_TOL and float((lse2 - lse).abs().max()) < 1e-3
    g2 = BW.backward(do, q, k, v, o2, lse2, backend="cudnn", **kw)
    _check_grads(g2, gr, (q, k, v), "cudnn, cuDNN's O/LSE")


@pytest.mark.gpu
def test_cudnn_backward_strided_inputs():
    """q, k, v as views of one packed (B, S, 3, H, D) projection (not dense), dO in another memory order than O: the
    gradients come back contiguous in the inputs' layout (their dense order) and equal those of contiguous inputs."""
    g = torch.Generator(device="cuda").manual_seed(3)
    qkv = torch.randn(2, 300, 3, 4, 64, generator=g, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    do = torch.randn(2, 4, 300, 64, generator=g, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    kw = dict(causal=True, layout="bshd")
    o, lse = BW.attention_forward(q, k, v, **kw)
    got = BW.backward(do, q, k, v, o, lse, backend="cudnn", **kw)
    exp = BW.backward(do.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), o, lse, backend="cudnn", **kw)
    for a, e in zip(got, exp):
        assert a.is_contiguous() and a.shape == q.shape
        assert nrmse(a, e) < 1e-3
    _check_grads(got, R.attention_backward_reference(do, q, k, v, **kw), (q, k, v), "strided")


@pytest.mark.gpu
def test_default_backward_is_cudnn_where_eligible(monkeypatch):
    """The default picks cuDNN for dense MHA and GQA calls (dK, dV summed over each group), within BF16_TOL."""
    _cudnn_default_or_skip()
    ran = []
    real = BW.cudnn_backward
    monkeypatch.setattr(BW, "cudnn_backward", lambda *a, **k: ran.append(1) or real(*a, **k))
    for hkv in (4, 2, 1):
        ran.clear()
        q, k, v, do = make_inputs(2, 4, hkv, 1000, 1000, 128, device="cuda", seed=hkv)
        o, lse = BW.attention_forward(q, k, v, causal=True)
        g = BW.backward(do, q, k, v, o, lse, causal=True)
        assert ran == [1]
        _check_grads(g, R.attention_backward_reference(do, q, k, v, causal=True), (q, k, v), f"default Hkv={hkv}")


@pytest.mark.gpu
@pytest.mark.parametrize("qk,pv", [("int8", "fp8"), ("fp8", "bf16"), ("int8", "fp16"), ("bf16", "auto")])
@pytest.mark.parametrize("causal,layout,dtype", [(True, "bhsd", torch.bfloat16), (False, "bshd", torch.bfloat16),
                                                 (True, "bshd", torch.float16)])
def test_public_api_gradients_through_cudnn(monkeypatch, qk, pv, causal, layout, dtype):
    """``lowbit.attention`` with grad, dense MHA: cuDNN's forward gives the backward its O and LSE (recomputed after a
    quantized forward, kept from the forward for 16-bit attention, which SDPA would run on cuDNN anyway) and cuDNN's
    backward the gradients: the straight-through 16-bit gradients of the FP32 reference, within BF16_TOL."""
    _cudnn_default_or_skip()
    from lowbit.attention import api, attention

    fwd, bwd = [], []
    real_f, real_b = api.cudnn_forward, BW.cudnn_backward
    monkeypatch.setattr(api, "cudnn_forward", lambda *a, **k: fwd.append(1) or real_f(*a, **k))
    monkeypatch.setattr(BW, "cudnn_backward", lambda *a, **k: bwd.append(1) or real_b(*a, **k))
    q, k, v, do = make_inputs(2, 4, 4, 1000, 1000, 128, dtype=dtype, device="cuda", layout=layout, seed=21)
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    attention(*ins, causal=causal, qk=qk, pv=pv, layout=layout).backward(do)
    assert fwd == [1] and bwd == [1]
    gr = R.attention_backward_reference(do, q, k, v, causal=causal, layout=layout)
    _check_grads([t.grad for t in ins], gr, (q, k, v), f"api {qk}/{pv} causal={causal} {layout} {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [dict(qk="int8"), dict(), dict(qk="int8", pv="fp8", causal=True, Sk=200)])
def test_compiled_cudnn_paths_inductor_cuda(kw):
    """Under torch.compile (inductor) the cuDNN forward/backward run inside lowbit's operators: the outputs equal
    eager's; the gradients equal eager's to cuDNN's own run-to-run differences (torch calls its backward
    non-deterministic), printed as a bit-for-bit flag."""
    _cudnn_default_or_skip()
    from lowbit.attention import attention

    kw = dict(kw)
    sk = kw.pop("Sk", 333)
    q, k, v, do = make_inputs(2, 4, 4, 200, sk, 64, device="cuda", seed=5)

    def run(fn):
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*ins)
        out.backward(do)
        return out, [t.grad for t in ins]

    def fn(q, k, v):
        return attention(q, k, v, **kw)

    torch._dynamo.reset()
    out_e, g_e = run(fn)
    out_c, g_c = run(torch.compile(fn, fullgraph=True))
    assert torch.equal(out_c, out_e)
    print("compiled grads bit for bit:", all(torch.equal(a, b) for a, b in zip(g_c, g_e)))
    assert max(nrmse(a, b) for a, b in zip(g_c, g_e)) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_model_layout_views_run_without_copies(compiled):
    """INT8·FP8 attention with grad where a model calls it: q, k, v (B, H, S, D) views of (B, S, H, D) tensors, and
    the output transposed back to (B, S, H·D) (a view, since the output keeps q's memory order). No kernel copies a
    tensor for its strides (the profiler sees no copy or clone kernel), eager and under torch.compile; the output
    equals the contiguous call's bit for bit, the gradients (in their inputs' memory order) the FP32 reference's
    within BF16_TOL. (Attention's own output as a compiled graph's output would have its gradient made contiguous
    by AOTAutograd, which traces tangents contiguous: inside a model's graph it is not one.)"""
    _cudnn_default_or_skip()
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from lowbit.attention import attention

    g = torch.Generator(device="cuda").manual_seed(5)
    B, S, H, D = 2, 1024, 8, 128
    base = [torch.randn(B, S, H, D, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    views, do = [t.transpose(1, 2) for t in base[:3]], base[3].reshape(B, S, H * D)

    def fn(q, k, v):
        return attention(q, k, v, causal=True, qk="int8", pv="fp8").transpose(1, 2).reshape(B, S, H * D)

    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True)
    ins = [t.detach().requires_grad_() for t in views]
    torch.autograd.grad(fn(*ins), ins, do)  # (warm-up: autotuning, compiling)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = fn(*ins)
        grads = torch.autograd.grad(out, ins, do)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    copies = [n for n in kernels if "copy" in n.lower() or "clone" in n.lower()]
    assert kernels and not copies, copies
    with torch.no_grad():
        exp = attention(*(t.contiguous() for t in views), causal=True, qk="int8", pv="fp8")
    assert torch.equal(out, exp.transpose(1, 2).reshape(B, S, H * D))
    gr = R.attention_backward_reference(base[3].transpose(1, 2), *views, causal=True)
    _check_grads(grads, gr, views, f"model-layout views, compiled={compiled}")
