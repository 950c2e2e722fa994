"""Bad input to the public API: a clear TypeError / ValueError / NotImplementedError naming the argument (CPU).

The first part pins each case that used to pass silently or fail with a raw traceback; the second throws random
wrong types and values at the public constructors and functions (hypothesis) and accepts only those errors, with
the argument's name in the message, or a result.
"""

from __future__ import annotations

import numbers
import re
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lowbit
from lowbit import recipes
from lowbit.gemm import scaled_mm
from lowbit.quant import MXFP8, NVFP4, Float8Blockwise, Float8Rowwise, Float8Tensorwise, QuantizedTensor, quantize


def _q(shape, scheme=None, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(*shape, generator=g), scheme or Float8Tensorwise(), **kw)


# ------------------------------------------------------------------------------------------------ the cases
@pytest.mark.parametrize("make, exc, match", [
    (lambda: NVFP4(two_d="False"), TypeError, r"^two_d: expected a bool .*got str 'False'"),
    (lambda: NVFP4(rht=1), TypeError, r"^rht: expected a bool"),
    (lambda: NVFP4(stochastic_rounding=None), TypeError, r"^stochastic_rounding: expected a bool"),
    (lambda: NVFP4(rht_signs="x"), TypeError, r"^rht_signs: expected an int, got str 'x'"),
    (lambda: NVFP4(rht_signs=1.5), TypeError, r"^rht_signs: expected an int, got float 1.5"),
    (lambda: NVFP4(rht_signs=1 << 16), ValueError, r"^rht_signs: must be a 16-bit mask"),
    (lambda: NVFP4(rht_signs=-1), ValueError, r"^rht_signs: must be a 16-bit mask"),
    (lambda: Float8Rowwise(pow2="no"), TypeError, r"^pow2: expected a bool .*got str 'no'"),
    (lambda: Float8Blockwise(pow2=0), TypeError, r"^pow2: expected a bool"),
    (lambda: Float8Blockwise(eps="a"), TypeError, r"^eps: expected a real number >= 0, got str 'a'"),
    (lambda: Float8Blockwise(eps=-1e-3), ValueError, r"^eps: must be a finite real number >= 0"),
    (lambda: Float8Blockwise(eps=float("inf")), ValueError, r"^eps: must be a finite"),
    (lambda: Float8Blockwise(eps=float("nan")), ValueError, r"^eps: must be a finite"),
    (lambda: Float8Blockwise(block_dim=True), TypeError, r"^block_dim: expected an int, got bool"),
    (lambda: Float8Blockwise(block_dim=3), ValueError, r"^block_dim: must be 1 .* or 2"),
    (lambda: Float8Blockwise(block_size=96), ValueError, r"^block_size: must be a power of two in \[16, 4096\]"),
    (lambda: Float8Blockwise(block_size=1 << 20), ValueError, r"^block_size: must be a power of two"),
    (lambda: Float8Blockwise(block_size=128.0), TypeError, r"^block_size: expected an int, got float"),
    (lambda: MXFP8(block_size=32.0), TypeError, r"^block_size: expected an int"),
    (lambda: MXFP8(block_size=16), ValueError, r"^block_size: MXFP8 uses 32-element blocks"),
    (lambda: Float8Tensorwise(fmt=3), TypeError, r"^fmt: expected 'e4m3' or 'e5m2', got int 3"),
    (lambda: Float8Tensorwise(fmt="e2m1"), ValueError, r"^fmt: an FP8 scheme takes 'e4m3' or 'e5m2'"),
    (lambda: recipes.DelayedScaling(amax_history_len=2**40), ValueError, r"^amax_history_len: expected an int <= "
                                                                          r"65536 .*1024.*got 1099511627776"),
    (lambda: recipes.DelayedScaling(margin=10**6), ValueError, r"^margin: expected an int <= 126"),
    (lambda: recipes.Recipe(), TypeError, r"^Recipe: the base class .*use one of DelayedScaling, "
                                          r"Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling, "
                                          r"NVFP4BlockScaling"),
])
def test_constructors(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_scheme_values_that_stay_valid():
    assert Float8Blockwise(eps=1e-12).eps == 1e-12 and Float8Blockwise(eps=0).eps == 0
    assert NVFP4(rht_signs=0).rht_signs == 0 and Float8Blockwise(block_size=4096).block_size == 4096
    assert Float8Rowwise(pow2=True).pow2 is True
    assert recipes.DelayedScaling(amax_history_len=1 << 16).amax_history_len == 1 << 16


def test_quantize_arguments():
    x = torch.randn(16, 32)
    with pytest.raises(TypeError, match=r"^rowwise: expected a bool .*got str 'no'"):
        quantize(x, Float8Tensorwise(), rowwise="no")
    quantize(x, Float8Tensorwise())  # the memoized key for rowwise=True ...
    with pytest.raises(TypeError, match=r"^rowwise: expected a bool .*got int 1"):
        quantize(x, Float8Tensorwise(), rowwise=1)  # ... does not let 1 (== True) through
    with pytest.raises(TypeError, match=r"^columnwise: expected a bool"):
        quantize(x, Float8Tensorwise(), columnwise=[True])
    with pytest.raises(TypeError, match=r"^scheme: expected one of Float8Tensorwise, .*got list"):
        quantize(x, [1])
    with pytest.raises(TypeError, match=r"^scheme: expected one of"):
        quantize(x, "nvfp4")
    with pytest.raises(TypeError, match=r"^seed: expected an int .*got str"):
        quantize(x, NVFP4(stochastic_rounding=True), seed="s")
    with pytest.raises(TypeError, match=r"^seed: a tensor seed must be a one-element int64 tensor"):
        quantize(x, NVFP4(stochastic_rounding=True), seed=torch.zeros(2))
    with pytest.raises(TypeError, match=r"^backend: expected a backend name"):
        quantize(x, Float8Tensorwise(), backend=["reference"])


@pytest.fixture
def no_triton(monkeypatch):
    """``import triton`` fails (as without the lowbit[gpu] extra), and no Triton backend is registered."""
    import lowbit.gemm as G
    import lowbit.quant as Q
    from lowbit.runtime.device import triton_installed

    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setattr(Q, "BACKENDS", {})
    monkeypatch.setattr(G, "BACKENDS", {k: v for k, v in G.BACKENDS.items() if not k.startswith("triton")})
    triton_installed.cache_clear()
    yield
    triton_installed.cache_clear()  # (asked again once monkeypatch has put triton back)


_NO_TRITON = r"^backend: 'triton' needs the triton package, which is not installed \(pip install lowbit\[gpu\]\); use "


def test_triton_backend_without_triton_is_a_clear_error(no_triton, monkeypatch):
    """Without Triton: a clear error naming the package and what to use instead (before the device check), not an
    unknown-backend listing or a ModuleNotFoundError from inside lowbit."""
    x = torch.randn(4, 32)
    with pytest.raises(NotImplementedError, match=_NO_TRITON + "backend='reference' or None"):
        quantize(x, Float8Tensorwise(), backend="triton")
    a = _q((16, 32))
    with pytest.raises(NotImplementedError, match=_NO_TRITON + "backend='reference' or None"):
        scaled_mm(a, a, backend="triton")
    q = torch.randn(1, 1, 64, 64, dtype=torch.bfloat16)
    for qk in ("bf16", "int8"):
        with pytest.raises(NotImplementedError, match=_NO_TRITON + "backend='reference'"):
            lowbit.attention.attention(q, q, q, qk=qk, backend="triton")
    with pytest.raises(NotImplementedError, match=_NO_TRITON):
        lowbit.attention.quantize_qk(q, q, backend="triton")
    with pytest.raises(NotImplementedError, match=_NO_TRITON):
        lowbit.attention.backward(q, q, q, q, q, torch.zeros(1, 1, 64), backend="triton")
    # the default on CPU still runs (the reference); a client (transformers, sdpa_override) falls back, saying why
    assert lowbit.attention.attention(q, q, q, qk="int8").shape == q.shape
    import lowbit.attention.config as C

    monkeypatch.setattr(C, "triton_ok", lambda t: True)  # (as on CUDA)
    assert C.AttentionConfig(qk="int8", backend="triton").decline_reason(q, q, q) == \
        "backend 'triton' without the triton package (pip install lowbit[gpu])"


def test_scaled_mm_out_and_bias():
    a, b = _q((16, 32)), _q((8, 32), seed=1)
    ref = scaled_mm(a, b, out_dtype=torch.float32)
    with pytest.raises(TypeError, match=r"^out: expected a float32, bfloat16 or float16 tensor .*got torch.int32"):
        scaled_mm(a, b, out=torch.zeros(16, 8, dtype=torch.int32))
    out = torch.zeros(16, 8)
    scaled_mm(a, b, out=out, out_dtype=torch.float32)  # memoizes a float32 out of this shape ...
    with pytest.raises(TypeError, match=r"^out: .*got torch.int32"):  # ... which must not admit an int32 one
        scaled_mm(a, b, out=torch.zeros(16, 8, dtype=torch.int32), out_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"^out_dtype: torch.bfloat16 disagrees with out's dtype torch.float32"):
        scaled_mm(a, b, out=torch.zeros(16, 8), out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^out: expected shape \(16, 8\), got \(8, 16\)"):
        scaled_mm(a, b, out=torch.zeros(8, 16))
    with pytest.raises(TypeError, match=r"^out: expected a torch.Tensor"):
        scaled_mm(a, b, out=[[0.0] * 8] * 16)
    # out_dtype None follows out: the full FP32 result, not a BF16 rounding copied into it
    y = scaled_mm(a, b, out=torch.zeros(16, 8))
    assert y.dtype == torch.float32 and torch.equal(y, ref)
    assert scaled_mm(a, b).dtype == torch.bfloat16  # the default without out
    with pytest.raises(TypeError, match=r"^bias: expected a torch.Tensor of shape \(N,\) or None, got list"):
        scaled_mm(a, b, bias=[0.0] * 8)
    with pytest.raises(TypeError, match=r"^bias: expected a floating-point tensor, got torch.int64"):
        scaled_mm(a, b, bias=torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"^bias: expected a tensor of shape \(8,\), got \(9,\)"):
        scaled_mm(a, b, bias=torch.zeros(9))
    scaled_mm(a, b, gelu=True)
    with pytest.raises(TypeError, match=r"^gelu: expected a bool .*got int 1"):
        scaled_mm(a, b, gelu=1)
    with pytest.raises(TypeError, match=r"^return_pre_gelu: expected a bool"):
        scaled_mm(a, b, return_pre_gelu="yes")
    with pytest.raises(ValueError, match=r"^a_copy: expected 'rowwise' or 'columnwise', got \['x'\]"):
        scaled_mm(a, b, a_copy=["x"])
    with pytest.raises(ValueError, match=r"^out_dtype: expected one of"):
        scaled_mm(a, b, out_dtype=[1])


@pytest.mark.parametrize("qk", ["bf16", "int8", "fp8"])
def test_attention_empty_dims(qk):
    bf = torch.bfloat16
    q = torch.randn(1, 2, 8, 16, dtype=bf)
    with pytest.raises(ValueError, match=r"^q: head_dim must be >= 1, got q shape \(1, 2, 8, 0\)"):
        lowbit.attention(q[..., :0], q[..., :0], q[..., :0], qk=qk)
    with pytest.raises(ValueError, match=r"^k: attention needs at least one key .*k shape \(1, 2, 0, 16\)"):
        lowbit.attention(q, q[:, :, :0], q[:, :, :0], qk=qk)
    with pytest.raises(ValueError, match=r"^k: attention needs at least one key .*k shape \(1, 0, 2, 16\)"):
        lowbit.attention(q.transpose(1, 2), q[:, :, :0].transpose(1, 2), q[:, :, :0].transpose(1, 2), qk=qk,
                         layout="bshd")


def test_autocast_lifo():
    from lowbit.nn.state import get_state

    before = get_state()
    with pytest.raises(RuntimeError, match=r"^autocast: __exit__ without a matching __enter__"):
        lowbit.autocast().__exit__(None, None, None)
    outer, inner = lowbit.autocast(), lowbit.autocast(recipe=recipes.Float8CurrentScaling())
    outer.__enter__()
    inner.__enter__()
    st = get_state()
    with pytest.raises(RuntimeError, match=r"^autocast: contexts must exit in reverse order of entry \(LIFO\)"):
        outer.__exit__(None, None, None)
    assert get_state() is st  # nothing changed
    inner.__exit__(None, None, None)
    outer.__exit__(None, None, None)
    assert get_state() == before and lowbit.nn.state.depth() == 0
    # one object entered twice (nested) still unwinds
    a = lowbit.autocast()
    with a:
        with a:
            pass
    with pytest.raises(TypeError, match=r"^Recipe: the base class"):
        lowbit.autocast(recipe=recipes.Recipe())


# ------------------------------------------------------------------------------------------------ hypothesis
_TENSORS = st.builds(
    lambda dtype, shape: torch.zeros(shape, dtype=dtype),
    st.sampled_from([torch.int32, torch.int64, torch.bool, torch.float64, torch.float16, torch.uint8,
                     torch.float8_e4m3fn, torch.complex64]),
    st.lists(st.integers(0, 5), max_size=3).map(tuple),
)
BAD = st.one_of(
    st.none(), st.booleans(), st.text(max_size=6), st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(2**70), -1), st.integers(2**31, 2**70), st.integers(0, 300),
    st.lists(st.integers(-3, 3), max_size=3), st.tuples(st.integers(-3, 3), st.integers(-3, 3)), _TENSORS,
    st.sampled_from([torch.float32, torch.int8, "rowwise", "reference", "triton", "e4m3", "bhsd"]),
)
ALLOWED = (TypeError, ValueError, NotImplementedError)
FAST = settings(max_examples=50, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def _call(fn, name, kwargs):
    """``fn(**kwargs)``: a result, or an allowed error whose message names ``name`` (the argument given a random
    value); anything else fails."""
    try:
        return fn(**kwargs)
    except ALLOWED as e:
        names = {name, name.split("_")[0]} if name.startswith("cu_seqlens") else {name}
        assert any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])", str(e)) for n in names), (
            f"{type(e).__name__} for {name}={kwargs[name]!r} does not name {name!r}: {e}")
        return None


_SCHEME_FIELDS = {
    Float8Tensorwise: ["fmt"],
    Float8Rowwise: ["fmt", "pow2"],
    Float8Blockwise: ["fmt", "block_dim", "block_size", "pow2", "eps"],
    MXFP8: ["fmt", "block_size"],
    NVFP4: ["two_d", "rht", "stochastic_rounding", "rht_signs"],
}


@FAST
@given(cls=st.sampled_from(list(_SCHEME_FIELDS)), data=st.data(), value=BAD)
def test_fuzz_schemes(cls, data, value):
    name = data.draw(st.sampled_from(_SCHEME_FIELDS[cls]))
    sch = _call(cls, name, {name: value})
    if sch is not None:  # accepted: a working scheme
        want = numbers.Real if name == "eps" else type(getattr(cls(), name))
        assert isinstance(getattr(sch, name), want)
        qt = quantize(torch.randn(32, 64), sch, columnwise=not (isinstance(sch, NVFP4) and sch.rht))
        assert isinstance(qt, QuantizedTensor)


_RECIPE_FIELDS = {
    recipes.DelayedScaling: ["margin", "fp8_format", "amax_history_len", "amax_compute_algo", "reduce_amax",
                             "warmup_steps"],
    recipes.Float8CurrentScaling: ["fp8_format"],
    recipes.Float8BlockScaling: ["fp8_format", "pow2_scales", "x_block_scaling_dim", "w_block_scaling_dim",
                                 "grad_block_scaling_dim"],
    recipes.MXFP8BlockScaling: ["fp8_format"],
    recipes.NVFP4BlockScaling: ["disable_rht", "disable_stochastic_rounding", "disable_2d_quantization"],
}


@FAST
@given(cls=st.sampled_from(list(_RECIPE_FIELDS)), data=st.data(), value=BAD)
def test_fuzz_recipes(cls, data, value):
    name = data.draw(st.sampled_from(_RECIPE_FIELDS[cls]))
    r = _call(cls, name, {name: value})
    if r is not None:
        assert set(r.roles()) == set(recipes.ROLES)
        with lowbit.autocast(recipe=r):
            pass


_X = torch.randn(32, 64)


@FAST
@given(name=st.sampled_from(["x", "scheme", "rowwise", "columnwise", "scale", "seed", "backend"]), value=BAD,
       sr=st.booleans())
def test_fuzz_quantize(name, value, sr):
    kw = dict(x=_X, scheme=NVFP4(stochastic_rounding=True) if sr else Float8Tensorwise(), rowwise=True,
              columnwise=False, scale=None, seed=None, backend=None)
    kw[name] = value
    r = _call(quantize, name, kw)
    assert r is None or isinstance(r, QuantizedTensor)


_A, _B = _q((16, 32)), _q((8, 32), seed=1)


@FAST
@given(name=st.sampled_from(["a", "b", "a_copy", "b_copy", "out_dtype", "bias", "gelu", "accumulate", "out",
                             "return_pre_gelu", "backend"]), value=BAD)
def test_fuzz_scaled_mm(name, value):
    kw = dict(a=_A, b=_B)
    kw[name] = value
    r = _call(lambda a, b, **k: scaled_mm(a, b, **k), name, kw)
    if r is not None:
        y = r[0] if isinstance(r, tuple) else r
        assert isinstance(y, torch.Tensor) and y.shape == (16, 8)


_QKV = torch.randn(1, 2, 8, 16)
_ATTN_ARGS = ["q", "k", "v", "causal", "softmax_scale", "layout", "qk", "pv", "granularity", "smooth_k", "window",
              "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "return_lse", "backend", "dropout_p",
              "grad_format", "scales", "grad_sink", "block_q", "block_k", "warp_q"]


@FAST
@given(name=st.sampled_from(_ATTN_ARGS), value=BAD)
def test_fuzz_attention(name, value):
    kw = dict(q=_QKV, k=_QKV, v=_QKV)
    kw[name] = value
    r = _call(lambda q, k, v, **o: lowbit.attention(q, k, v, **o), name, kw)
    if r is not None:
        out = r[0] if isinstance(r, tuple) else r
        assert isinstance(out, torch.Tensor)


_MODULES = {
    "Linear": (lambda **k: lowbit.nn.Linear(**{"in_features": 32, "out_features": 16, **k}),
               ["in_features", "out_features", "bias", "device", "dtype"]),
    "LayerNormLinear": (lambda **k: lowbit.nn.LayerNormLinear(**{"in_features": 32, "out_features": 16, **k}),
                        ["in_features", "out_features", "bias", "normalization", "eps", "return_layernorm_output",
                         "device", "dtype"]),
    "LayerNormMLP": (lambda **k: lowbit.nn.LayerNormMLP(**{"hidden_size": 32, "ffn_hidden_size": 16, **k}),
                     ["hidden_size", "ffn_hidden_size", "bias", "normalization", "activation", "eps", "fused_swiglu",
                      "device", "dtype"]),
}


@FAST
@given(module=st.sampled_from(list(_MODULES)), data=st.data(), value=BAD)
def test_fuzz_modules(module, data, value):
    """The module constructors check every argument before allocating (torch.nn.Linear checks none of bias, device,
    dtype or the size): only lowbit's own errors naming the argument, or a module that runs."""
    make, names = _MODULES[module]
    name = data.draw(st.sampled_from(names))
    m = _call(make, name, {name: value})
    if m is not None:
        p = next(m.parameters())
        size = m.in_features if module == "LayerNormLinear" else getattr(m, "in_features", None) or m.hidden_size
        y = m(torch.randn(4, size, dtype=p.dtype, device=p.device))
        y = y[0] if isinstance(y, tuple) else y
        assert y.shape[0] == 4 and y.dtype == p.dtype


@pytest.mark.parametrize("make, exc, match", [
    (lambda: lowbit.nn.Linear(32, 16, bias="no"), TypeError, r"^bias: expected a bool .*got str 'no'"),
    (lambda: lowbit.nn.Linear(32, 16, bias=0), TypeError, r"^bias: expected a bool .*got int 0"),
    (lambda: lowbit.nn.Linear(32, 16, device="gpu0"), ValueError, r"^device: not a device: 'gpu0'"),
    (lambda: lowbit.nn.Linear(32, 16, device=1.5), TypeError, r"^device: expected None, a torch.device, .*got float"),
    (lambda: lowbit.nn.Linear(32, 16, dtype=torch.int32), ValueError,
     r"^dtype: the high-precision parameters must be one of torch.float32, .*got torch.int32"),
    (lambda: lowbit.nn.Linear(32, 16, dtype="float32"), TypeError, r"^dtype: expected None or a torch.dtype"),
    (lambda: lowbit.nn.Linear(2**40, 2**20), ValueError,
     r"^in_features/out_features: the parameters must fit the device's memory; in_features=1099511627776, "
     r"out_features=1048576 need .* GiB .* but cpu has"),
    (lambda: lowbit.nn.Linear(2**40, 2**40, device="meta"), ValueError,
     r"^in_features/out_features: the parameters must have at most 2\*\*63 - 1 elements"),
    (lambda: lowbit.nn.Linear("32", 16), TypeError, r"^in_features: expected a positive int, got str '32'"),
    (lambda: lowbit.nn.Linear(32, -1), ValueError, r"^out_features: expected a positive int, got -1"),
    (lambda: lowbit.nn.LayerNormLinear(32, 16, bias=None), TypeError, r"^bias: expected a bool"),
    (lambda: lowbit.nn.LayerNormLinear(32, 16, dtype=torch.float8_e4m3fn), ValueError, r"^dtype: "),
    (lambda: lowbit.nn.LayerNormMLP(2**30, 2**30), ValueError, r"^hidden_size/ffn_hidden_size: the parameters must "
                                                               r"fit"),
    (lambda: lowbit.nn.LayerNormMLP(32, 16, device="cpu:x"), ValueError, r"^device: not a device: 'cpu:x'"),
    (lambda: lowbit.nn.LayerNormMLP(32, 16, fused_swiglu=1), TypeError, r"^fused_swiglu: expected None, True or "
                                                                         r"False, got int 1"),
])
def test_module_constructors(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_module_constructor_values_that_stay_valid():
    m = lowbit.nn.Linear(32, 16, bias=False, device=torch.device("cpu"), dtype=torch.bfloat16)
    assert m.bias is None and m.weight.dtype == torch.bfloat16
    assert lowbit.nn.Linear(32, 16, device="meta").weight.is_meta
    assert lowbit.nn.LayerNormMLP(32, 16, activation="swiglu", dtype=torch.float64).fc1_weight.shape == (32, 32)
