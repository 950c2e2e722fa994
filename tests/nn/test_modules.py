"""Linear / LayerNormLinear / LayerNormMLP: bit-identical to torch outside autocast; inside, outputs and
gradients (input, weights, biases, norm parameters) against the high-precision torch module per recipe."""

from __future__ import annotations

import copy

import pytest
import torch
from nn_helpers import RECIPES, grads_of, make_module, sqnr

import lowbit
from lowbit import recipes

MODULES = [
    ("Linear", {}),
    ("LayerNormLinear", {}),
    ("LayerNormLinear", {"normalization": "RMSNorm"}),
    ("LayerNormMLP", {}),
    ("LayerNormMLP", {"activation": "swiglu", "normalization": "RMSNorm"}),
]
K, N, F = 160, 96, 192  # 160: a full and a ragged 1x128 block; all multiples of 32 (MXFP8) and 16 (NVFP4)

# SQNR floors (dB) as (output floor, gradient floor); the gradient floor applies to dx and every parameter
# gradient. Measured over seeds 0..11 with these shapes (x (2, 48, 160), loss = sum(y · G), G ~ N(0, 1)):
# minimum over seeds (y; worst gradient):
#   Linear     delayed/current 28.5; 24.4   block 28.2; 28.1   mxfp8 27.7; 27.3   nvfp4 16.5; 14.9
#   LNLinear   delayed/current 28.5; 23.0   block 28.2; 26.5   mxfp8 27.6; 26.1   nvfp4 16.5; 14.0
#   LNMLP      delayed/current 24.2; 19.2   block 23.9; 22.2   mxfp8 23.1; 21.8   nvfp4 12.2;  9.8
# Floors = those minima - 2 dB (margin for seeds outside the measured set), rounded down to 0.5 dB.
FLOORS = {
    "Linear": {"fp8-delayed": (26.5, 22.0), "fp8-current": (26.5, 22.0), "fp8-block": (26.0, 26.0),
               "mxfp8": (25.5, 25.0), "nvfp4": (14.5, 12.5)},
    "LayerNormLinear": {"fp8-delayed": (26.5, 21.0), "fp8-current": (26.5, 21.0), "fp8-block": (26.0, 24.5),
                        "mxfp8": (25.5, 24.0), "nvfp4": (14.5, 12.0)},
    "LayerNormMLP": {"fp8-delayed": (22.0, 17.0), "fp8-current": (22.0, 17.0), "fp8-block": (21.5, 20.0),
                     "mxfp8": (21.0, 19.5), "nvfp4": (10.0, 7.5)},
}
EXACT_DB = 120.0  # gradients that do not pass through a quantized GEMM (Linear's bias) must match torch exactly


def _ids(p):
    kind, kw = p
    return kind + ("-" + "-".join(kw.values()) if kw else "")


@pytest.mark.parametrize("mod", MODULES, ids=_ids)
@pytest.mark.parametrize("shape", [(5, 7), (3,), ()], ids=["3d", "2d", "1d"])
def test_bit_identical_outside_autocast(mod, shape):
    kind, kw = mod
    torch.manual_seed(1)
    m, ref = make_module(kind, 48, 40, 56, **kw)
    x = torch.randn(*shape, 48)
    G = torch.randn(*shape, ref(x).shape[-1])
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = m(xa), ref(xb)
    assert torch.equal(ya, yb)
    (ya * G).sum().backward()
    (yb * G).sum().backward()
    assert torch.equal(xa.grad, xb.grad)
    for a, b in zip(grads_of(m), grads_of(ref)):
        assert torch.equal(a, b)
    with lowbit.autocast(enabled=False):  # an explicitly disabled autocast is the same
        assert torch.equal(m(x), ref(x))


def test_linear_is_drop_in():
    torch.manual_seed(0)
    a = lowbit.nn.Linear(12, 8, bias=False, dtype=torch.float64)
    torch.manual_seed(0)
    b = torch.nn.Linear(12, 8, bias=False, dtype=torch.float64)
    assert torch.equal(a.weight, b.weight) and a.bias is None  # same init from the same RNG state
    assert isinstance(a, torch.nn.Linear)
    assert set(a.state_dict()) - {"_extra_state"} == set(b.state_dict())
    a.load_state_dict(b.state_dict())  # a torch checkpoint (no scaling state) loads
    b.load_state_dict({k: v for k, v in a.state_dict().items() if k != "_extra_state"})
    assert [n for n, _ in a.named_parameters()] == ["weight"]
    # the documented ways into a plain nn.Linear (Linear's docstring, GUIDE §4): strict=False, or drop the key
    with pytest.raises(RuntimeError, match='Unexpected key.*"_extra_state"'):
        b.load_state_dict(a.state_dict())
    with torch.no_grad():
        a.weight.mul_(2)
    assert b.load_state_dict(a.state_dict(), strict=False).unexpected_keys == ["_extra_state"]
    assert torch.equal(b.weight, a.weight)


@pytest.mark.parametrize("rname", list(RECIPES))
@pytest.mark.parametrize("mod", MODULES, ids=_ids)
def test_gradients_against_high_precision(mod, rname):
    kind, kw = mod
    torch.manual_seed(2024)
    m, ref = make_module(kind, K, N, F, **kw)
    x = torch.randn(2, 48, K)
    out_f = N if kind != "LayerNormMLP" else K
    G = torch.randn(2, 48, out_f)
    xr = x.clone().requires_grad_()
    (ref(xr) * G).sum().backward()
    recipe = RECIPES[rname]()
    xq = x.clone().requires_grad_()
    for _ in range(2 if rname == "fp8-delayed" else 1):  # delayed: the second step scales from the history
        m.zero_grad()
        xq.grad = None
        with lowbit.autocast(recipe=recipe):
            y = m(xq)
        (y * G).sum().backward()
    fy, fg = FLOORS[kind][rname]
    s = sqnr(y, ref(x))
    assert s > fy, f"output SQNR {s:.1f} dB <= floor {fy}"
    s = sqnr(xq.grad, xr.grad)
    assert s > fg, f"input-gradient SQNR {s:.1f} dB <= floor {fg}"
    for (name, p), g in zip(m.named_parameters(), grads_of(ref)):
        floor = EXACT_DB if (kind != "LayerNormMLP" and name == "bias") else fg
        s = sqnr(p.grad, g)
        assert s > floor, f"{name} gradient SQNR {s:.1f} dB <= floor {floor}"
    assert y.shape == (2, 48, out_f) and y.dtype == x.dtype


def test_saves_quantized_activations_only():
    torch.manual_seed(0)
    m = lowbit.nn.Linear(64, 32)
    x = torch.randn(4, 16, 64, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with lowbit.autocast(recipe=recipes.Float8CurrentScaling()):
            y = m(x)
    assert not any(t is not None and t.numel() >= x.numel() and t.is_floating_point() and t.element_size() > 1
                   for t in saved)
    ctx = y.grad_fn
    assert ctx.qx.rowwise is None and ctx.qx.columnwise.data.dtype == torch.float8_e4m3fn  # only the wgrad copy
    assert ctx.qx.columnwise.data.shape == (64, 64)
    assert ctx.qw.columnwise is not None
    y.sum().backward()
    assert x.grad is not None and m.weight.grad is not None


def _quantized_gemm_nodes(y):
    """The quantized-GEMM autograd nodes of y's graph (the lowbit Functions keep their quantized copies as ``qx``)."""
    out, todo, seen = [], [y.grad_fn], set()
    while todo:
        n = todo.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        if hasattr(n, "qx"):
            out.append(n)
        todo.extend(f for f, _ in n.next_functions)
    return out


def _copies_of(saved, tensors):
    """The saved tensors that hold one of ``tensors`` (the same memory, or equal values; as (tokens, features)
    matrices, since the GEMMs see the flattened view)."""
    flat = lambda t: t.reshape(-1, t.shape[-1]) if t.dim() else t  # noqa: E731
    return [t for t in saved for g in tensors if t.numel() == g.numel() and t.shape[-1:] == g.shape[-1:]
            and (t.data_ptr() == g.data_ptr() or torch.equal(flat(t), flat(g)))]


@pytest.mark.parametrize("kind, kw", [
    ("LayerNormLinear", {}),
    ("LayerNormLinear", {"normalization": "RMSNorm"}),
    ("LayerNormMLP", {}),
    ("LayerNormMLP", {"activation": "swiglu", "normalization": "RMSNorm", "bias": False}),
], ids=["ln-linear", "rms-linear", "ln-mlp-gelu", "rms-mlp-swiglu"])
def test_norm_modules_save_quantized_gemm_inputs_only(kind, kw, monkeypatch):
    """LayerNormLinear / LayerNormMLP under a recipe: no GEMM input (the norm output; fc2's input, the activation
    output) is saved in high precision for the backward, only its quantized wgrad copy; what is saved in high
    precision is what the norm and activation backwards read (the norm input x, mean/rstd, RMSNorm's x·rstd on
    torch's composite CPU kernel, the fc1 output)."""
    from lowbit.nn import layernorm_linear, layernorm_mlp

    torch.manual_seed(0)
    m = getattr(lowbit.nn, kind)(64, 96, **kw)
    with torch.no_grad():
        m.layer_norm_weight.uniform_(0.5, 1.5)  # (with weight 1 the norm output would equal RMSNorm's saved x·rstd)
    x = torch.randn(4, 16, 64, requires_grad=True)
    # record every tensor the module hands to a quantized GEMM as its input
    ns = layernorm_linear if kind == "LayerNormLinear" else layernorm_mlp
    gemm_inputs, orig = [], ns.quantized_linear
    monkeypatch.setattr(ns, "quantized_linear", lambda a, *r, **k: (gemm_inputs.append(a), orig(a, *r, **k))[1])
    saved = []

    def pack(t):
        if t is not None:
            saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with lowbit.autocast(recipe=recipes.Float8CurrentScaling()):
            y = m(x)
    assert len(gemm_inputs) == (1 if kind == "LayerNormLinear" else 2)
    assert _copies_of(saved, gemm_inputs) == []
    nodes = _quantized_gemm_nodes(y)
    assert len(nodes) == len(gemm_inputs)
    for n in nodes:  # per GEMM: x's columnwise (wgrad) FP8 copy only, and the weight's copies for dgrad
        assert n.qx.rowwise is None and n.qx.columnwise.data.dtype == torch.float8_e4m3fn
        assert n.qx.columnwise.data.shape == (n.qx.shape[-1], 64) and n.qw.columnwise is not None
    assert any(t.data_ptr() == x.data_ptr() for t in saved)  # the norm's input (its backward reads it)
    y.sum().backward()
    assert x.grad is not None and m.layer_norm_weight.grad is not None
    if kind == "LayerNormLinear":  # the check itself: outside autocast F.linear saves the norm output, and it is found
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            m(x)
        ln = layernorm_linear.apply_norm(x, m.normalization, (64,), m.layer_norm_weight, m.layer_norm_bias, m.eps)
        assert len(_copies_of(saved, [ln])) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_dtypes(dtype):
    torch.manual_seed(0)
    m = lowbit.nn.Linear(64, 32, dtype=dtype)
    x = torch.randn(32, 64, dtype=dtype, requires_grad=True)
    with lowbit.autocast(recipe=recipes.Float8BlockScaling()):
        y = m(x)
    y.float().sum().backward()
    assert y.dtype == dtype and x.grad.dtype == dtype and m.weight.grad.dtype == dtype and m.bias.grad.dtype == dtype
    ref = torch.nn.functional.linear(x.float(), m.weight.float(), m.bias.float())
    assert sqnr(y.float(), ref) > 22  # measured 26.5 dB; bf16 output rounding costs a little


def test_no_grad_forward_and_frozen_weight():
    torch.manual_seed(0)
    m = lowbit.nn.Linear(64, 32)
    x = torch.randn(16, 64)
    with torch.no_grad(), lowbit.autocast(recipe=recipes.Float8CurrentScaling()):
        y = m(x)
    assert y.grad_fn is None
    m.weight.requires_grad_(False)
    xg = x.clone().requires_grad_()
    with lowbit.autocast(recipe=recipes.Float8CurrentScaling()):
        y = m(xg)
    y.sum().backward()
    assert m.weight.grad is None and xg.grad is not None and m.bias.grad is not None
    assert y.grad_fn.qx is None  # no wgrad: x is not kept at all


def test_weight_cache_across_microbatches():
    torch.manual_seed(0)
    m = lowbit.nn.LayerNormMLP(64, 96)
    xs = [torch.randn(2, 16, 64) for _ in range(3)]
    r = recipes.Float8CurrentScaling()
    ref_grads = None
    outs = []
    for first in (None, "cache"):
        m.zero_grad()
        ys = []
        for i, x in enumerate(xs):
            with lowbit.autocast(recipe=r):
                y = m(x, is_first_microbatch=None if first is None else i == 0)
            y.square().sum().backward()
            ys.append(y)
            if first == "cache" and i > 0:
                assert y.grad_fn.qw is ys[0].grad_fn.qw  # fc2's cached weight copies reused
        outs.append(ys)
        g = grads_of(m)
        if ref_grads is None:
            ref_grads = g
        else:  # caching changes nothing numerically (current scaling of an unchanged weight)
            assert all(torch.equal(a, b) for a, b in zip(g, ref_grads))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_weight_cache_misuse():
    torch.manual_seed(0)
    m = lowbit.nn.Linear(32, 32)
    m.lowbit_name = "blocks.0.proj"
    x = torch.randn(16, 32)
    r = recipes.Float8CurrentScaling()
    with lowbit.autocast(recipe=r):
        with pytest.raises(ValueError, match=r"is_first_microbatch: False needs .*'blocks.0.proj'"):
            m(x, is_first_microbatch=False)
        with pytest.raises(TypeError, match="is_first_microbatch: expected None, True or False, got 1"):
            m(x, is_first_microbatch=1)
        m(x, is_first_microbatch=True)
        m(x, is_first_microbatch=False)
    with torch.no_grad():
        m.weight.add_(1.0)  # "optimizer step"
    with lowbit.autocast(recipe=r):
        with pytest.raises(ValueError, match="was modified since it was cached"):
            m(x, is_first_microbatch=False)
        m(x, is_first_microbatch=True)
    m.weight.data = m.weight.data * 2  # a new tensor through .data (its storage changed): refused too
    with lowbit.autocast(recipe=r):
        with pytest.raises(ValueError, match="was modified since it was cached"):
            m(x, is_first_microbatch=False)
    with lowbit.autocast(recipe=recipes.Float8BlockScaling()):
        m(x, is_first_microbatch=True)
    with lowbit.autocast(recipe=r):
        with pytest.raises(ValueError, match="active recipe is"):
            m(x, is_first_microbatch=False)


@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-block"])
def test_cached_weights_reuse_and_invalidation(recipe):
    """Inside lowbit.nn.cached_weights a forward with is_first_microbatch=None quantizes each weight once and later
    forwards take the kept copies, with the same bits as quantizing afresh; an in-place update, a weight replaced
    through .data, another recipe and a forward that needs the columnwise copy each quantize again; the copies are
    dropped when the outermost block exits."""
    torch.manual_seed(1)
    m = lowbit.nn.LayerNormMLP(160, 96, activation="swiglu", normalization="RMSNorm")
    r = recipes.from_name(recipe)
    xs = [torch.randn(2, 24, 160) for _ in range(3)]
    def run(x, grad=False, mod=None):
        with lowbit.autocast(recipe=r):
            if grad:
                return (mod or m)(x)
            with torch.no_grad():
                return (mod or m)(x)

    def fresh(x):  # the same weights quantized afresh: a copy the block does not cover
        c = copy.deepcopy(m)
        assert all(g.keep_weights == 0 for g in c._gemms.values())
        return run(x, mod=c)

    gemms = list(m._gemms.values())
    with lowbit.nn.cached_weights(m) as kept:
        for x in xs:
            assert torch.equal(run(x), fresh(x))
        assert kept.reused == 2 * len(gemms)  # the second and third forward of each GEMM
        assert all(g.wcache is not None for g in gemms)
        with torch.no_grad():
            m.fc2_weight.add_(0.5)  # an "optimizer step" on one weight: only its GEMM quantizes again
        assert torch.equal(run(xs[0]), fresh(xs[0]))
        assert kept.reused == 3 * len(gemms) - 1
        m.fc1_weight.data = m.fc1_weight.data * 2  # new storage through .data
        assert torch.equal(run(xs[0]), fresh(xs[0]))
        assert kept.reused == 3 * len(gemms)  # fc2's copies (quantized again above) reused, fc1's not
        with lowbit.autocast(recipe=recipes.from_name("fp8-current" if recipe == "fp8-block" else "fp8-block")):
            with torch.no_grad():
                m(xs[0])  # another recipe: quantized afresh (and kept under it)
        assert kept.reused == 3 * len(gemms)
        ref = copy.deepcopy(m)
        run(xs[1], grad=True).square().sum().backward()  # needs the columnwise copies: quantized again
        run(xs[1], grad=True, mod=ref).square().sum().backward()
        assert all(torch.equal(a, b) for a, b in zip(grads_of(m), grads_of(ref)))
        with lowbit.nn.cached_weights(m) as inner:  # nested: the outer block's copies stay
            assert torch.equal(run(xs[1]), fresh(xs[1]))
            assert inner.reused == len(gemms)
        assert all(g.wcache is not None for g in gemms)
    assert all(g.wcache is None and g.keep_weights == 0 for g in gemms)
    assert kept.reused == 4 * len(gemms)


@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-block"])
def test_cached_weights_inside_a_graph_pool(recipe, monkeypatch):
    """While a CUDA graph records (here: in_graph_pool faked on the CPU) a call takes the copy an earlier call of the
    block kept, which the layer then holds for the graph's replays (past the block's exit, until
    clear_weight_cache), and keeps none of its own: a weight changed since is quantized afresh for that call, the
    kept copy neither replaced nor dropped there; the next call outside the pool keeps a new copy."""
    from lowbit.nn import functional as fn

    torch.manual_seed(2)
    m = lowbit.nn.Linear(128, 64)
    r = recipes.from_name(recipe)
    x = torch.randn(16, 128)

    def run(mod=None):
        with lowbit.autocast(recipe=r), torch.no_grad():
            return (mod or m)(x)

    g = m._gemms[""]
    pool = [False]
    monkeypatch.setattr(fn, "in_graph_pool", lambda device: pool[0])
    with lowbit.nn.cached_weights(m) as kept:
        a = run()  # outside a pool: quantized and kept
        kept_copy = g.wcache
        pool[0] = True
        assert torch.equal(run(), a) and kept.reused == 1 and g.wcache is kept_copy  # taken inside the pool
        with torch.no_grad():
            m.weight.mul_(0.5)
        assert len(g.graph_pins) == 1 and g.graph_pins[0][3] is kept_copy[3]  # held for the graph's replays
        b = run()  # changed: quantized afresh for this call; nothing kept from the pool, nothing dropped
        assert torch.equal(b, run(copy.deepcopy(m))) and not torch.equal(b, a)
        assert kept.reused == 1 and g.wcache is kept_copy
        pool[0] = False
        # outside: quantized again and written into the pinned copy (what the graph replays), which is kept
        assert torch.equal(run(), b) and g.wcache is not kept_copy and kept.reused == 1
        assert g.wcache[3] is kept_copy[3] and len(g.graph_pins) == 1 and _holds(g, m.weight, r)
        assert torch.equal(run(), b) and kept.reused == 2
    assert g.wcache is None and len(g.graph_pins) == 1  # the block's exit does not free what a graph reads
    n_copied = _tensors_deep_copied(m, monkeypatch)
    assert not copy.deepcopy(m)._gemms[""].graph_pins  # (a copy records no graph: it holds none)
    m.clear_weight_cache()
    assert g.graph_pins == []
    assert _tensors_deep_copied(m, monkeypatch) == n_copied  # the pinned copy was not copied with the module


def _tensors_deep_copied(m, monkeypatch) -> int:
    """How many tensors ``copy.deepcopy(m)`` copies."""
    n, real = [0], torch.Tensor.__deepcopy__

    def spy(self, memo):
        n[0] += 1
        return real(self, memo)

    monkeypatch.setattr(torch.Tensor, "__deepcopy__", spy)
    copy.deepcopy(m)
    monkeypatch.setattr(torch.Tensor, "__deepcopy__", real)
    return n[0]


def _holds(g, w, r) -> bool:
    """Whether every pinned copy of layer ``g`` holds ``w`` quantized under ``r`` now (bit for bit)."""
    q = g.quantize(w.detach(), "weight", r, rowwise=True, columnwise=False, phase="forward", policy="off")
    return all(p[1] == w._version and p[2] == w.data_ptr() and torch.equal(p[3].rowwise.data.view(torch.uint8),
                                                                        q.rowwise.data.view(torch.uint8))
               and torch.equal(p[3].rowwise.scale_inv, q.rowwise.scale_inv) for p in g.graph_pins)


@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-block"])
def test_cached_weights_pins_across_blocks(recipe, monkeypatch):
    """A copy a CUDA graph recorded in one block (in_graph_pool faked) is taken again by the next block's eager call
    while the weight is unchanged (no second copy, however many blocks record); a weight changed between blocks is
    written into it when the next block is entered (the graph replays the new weight); a NaN weight raises there."""
    from lowbit.nn import functional as fn

    torch.manual_seed(3)
    m = lowbit.nn.Linear(128, 64)
    r = recipes.from_name(recipe)
    x = torch.randn(8, 128)
    g = m._gemms[""]
    pool = [False]
    monkeypatch.setattr(fn, "in_graph_pool", lambda device: pool[0])

    def block():
        with lowbit.nn.cached_weights(m) as kept, lowbit.autocast(recipe=r), torch.no_grad():
            pool[0] = False
            y = m(x)  # eager (a prefill): keeps a copy, or takes the pinned one
            pool[0] = True
            assert torch.equal(m(x), y)  # a graph records: pins the kept copy
            pool[0] = False
        return kept.reused

    assert block() == 1 and len(g.graph_pins) == 1
    pinned = g.graph_pins[0][3]
    assert block() == 2 and len(g.graph_pins) == 1 and g.graph_pins[0][3] is pinned  # taken again, not copied
    with torch.no_grad():
        m.weight.mul_(-0.75)  # an optimizer step between two evaluations
    assert not _holds(g, m.weight, r)
    with lowbit.nn.cached_weights(m):
        assert _holds(g, m.weight, r) and g.graph_pins[0][3] is pinned  # written in place on entry
    with torch.no_grad():
        m.weight[3, 5] = float("nan")
    for _ in range(2):  # (and again at the next entry: the copy stays stale until a finite weight is written)
        with pytest.raises(ValueError, match=r"hold NaN or Inf"):
            with lowbit.nn.cached_weights(m):
                pass
    assert g.keep_weights == 0


def test_cached_weights_pins_made_under_inference_mode(monkeypatch):
    """Copies pinned inside torch.inference_mode (inference tensors) are written outside it, on entry and by an
    eager call; a write that fails leaves no kept copy behind (the next call quantizes again, it does not take one
    while the pinned copy is stale)."""
    from lowbit.nn import functional as fn

    torch.manual_seed(4)
    m = lowbit.nn.Linear(128, 64)
    r = recipes.from_name("fp8-block")
    x = torch.randn(8, 128)
    g = m._gemms[""]
    pool = [False]
    monkeypatch.setattr(fn, "in_graph_pool", lambda device: pool[0])
    with torch.inference_mode(), lowbit.nn.cached_weights(m), lowbit.autocast(recipe=r):
        m(x)
        pool[0] = True
        m(x)
        pool[0] = False
    assert len(g.graph_pins) == 1 and g.graph_pins[0][3].rowwise.data.is_inference()
    with torch.no_grad():
        m.weight.mul_(2.0)
    with lowbit.nn.cached_weights(m):
        assert _holds(g, m.weight, r)
    with lowbit.nn.cached_weights(m), lowbit.autocast(recipe=r), torch.no_grad():
        m(x)  # keeps the pinned copy
        m.weight.mul_(0.5)
        m(x)  # quantizes the changed weight and writes it into the inference-tensor copy
        assert _holds(g, m.weight, r) and g.wcache[3] is g.graph_pins[0][3]
        m.weight.mul_(3.0)

        def broken(*a, **k):
            raise RuntimeError("write failed")

        monkeypatch.setattr(g, "refresh_pins", broken)
        with pytest.raises(RuntimeError, match="write failed"):
            m(x)
        assert g.wcache is None


def test_cached_weights_rejects_and_skips():
    torch.manual_seed(0)
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module, got list"):
        lowbit.nn.cached_weights([])
    with pytest.raises(ValueError, match="no lowbit modules.*lowbit.convert"):
        lowbit.nn.cached_weights(torch.nn.Linear(4, 4))
    m = lowbit.nn.Linear(32, 32)
    block = lowbit.nn.cached_weights(m)
    x = torch.randn(8, 32)
    r = recipes.Float8CurrentScaling()
    with block:
        with pytest.raises(RuntimeError, match="already open"):
            block.__enter__()
        with torch.inference_mode():
            w = m.weight.detach().clone()  # an inference tensor: no version counter, never kept
        m.weight = torch.nn.Parameter(w, requires_grad=False)
        with lowbit.autocast(recipe=r), torch.inference_mode():
            a, b = m(x), m(x)
        assert block.reused == 0 and m._gemms[""].wcache is None
    assert torch.equal(a, b)


def test_bad_inputs():
    torch.manual_seed(0)
    m = lowbit.nn.Linear(48, 32)
    m.lowbit_name = "mlp.up"
    with lowbit.autocast(recipe=recipes.NVFP4BlockScaling()):
        with pytest.raises(ValueError, match=r"divisible by 16.*'mlp.up'.*tokens .* = 20"):
            m(torch.randn(20, 48))
    with lowbit.autocast(recipe=recipes.MXFP8BlockScaling()):
        with pytest.raises(ValueError, match=r"divisible by 32.*in_features = 48"):
            m(torch.randn(32, 48))
        with pytest.raises(ValueError, match=r"input: last dim must be in_features = 48"):
            m(torch.randn(32, 47))
    with lowbit.autocast(recipe=recipes.Float8CurrentScaling()):
        with pytest.raises(TypeError, match="float32, bfloat16 or float16 inputs, got torch.float64"):
            m(torch.randn(4, 48, dtype=torch.float64))
    with pytest.raises(ValueError, match="in_features: expected a positive int, got 0"):
        lowbit.nn.Linear(0, 4)
    with pytest.raises(ValueError, match="normalization: expected one of"):
        lowbit.nn.LayerNormLinear(8, 8, normalization="BatchNorm")
    with pytest.raises(ValueError, match="activation: expected one of"):
        lowbit.nn.LayerNormMLP(8, 8, activation="relu")
    with pytest.raises(ValueError, match="eps: expected a finite float > 0"):
        lowbit.nn.LayerNormMLP(8, 8, eps=0)
    with pytest.raises(TypeError, match="return_layernorm_output: expected a bool, got 'no'"):
        lowbit.nn.LayerNormLinear(8, 8, return_layernorm_output="no")  # bool("no") is True
    # a wrong last dim: a lowbit ValueError naming both sizes (not F.layer_norm's RuntimeError), in and out of autocast
    ln_lin, ln_mlp = lowbit.nn.LayerNormLinear(32, 16), lowbit.nn.LayerNormMLP(32, 48, normalization="RMSNorm")
    for enabled in (False, True):
        with lowbit.autocast(enabled=enabled, recipe=recipes.Float8CurrentScaling()):
            with pytest.raises(ValueError,
                               match=r"input: last dim must be in_features = 32, got 31 \(input shape \(2, 4, 31\)\)"):
                ln_lin(torch.randn(2, 4, 31))
            with pytest.raises(ValueError,
                               match=r"input: last dim must be hidden_size = 32, got 64 \(input shape \(4, 64\)\)"):
                ln_mlp(torch.randn(4, 64))
            with pytest.raises(ValueError, match=r"input: last dim must be in_features = 32, got a 0-dim tensor"):
                ln_lin(torch.tensor(1.0))


def test_return_layernorm_output():
    torch.manual_seed(0)
    m = lowbit.nn.LayerNormLinear(32, 16, return_layernorm_output=True)
    x = torch.randn(3, 32)
    y, ln = m(x)
    assert torch.equal(ln, torch.nn.functional.layer_norm(x, (32,), m.layer_norm_weight, m.layer_norm_bias, 1e-5))
    with lowbit.autocast(recipe=recipes.Float8CurrentScaling()):
        yq, lnq = m(torch.randn(16, 32))
    assert yq.shape == (16, 16) and lnq.shape == (16, 32)


def test_layernorm_mlp_fused_swiglu_flag():
    """fused_swiglu=None: torch's silu(a)*b outside autocast (bit for bit); True: lowbit.ops.swiglu (FP32 math, one
    rounding) outside autocast too; bad values rejected."""
    import torch.nn.functional as F

    from lowbit.ops import swiglu_reference

    torch.manual_seed(0)
    x = torch.randn(6, 32, dtype=torch.bfloat16)
    m = lowbit.nn.LayerNormMLP(32, 48, activation="swiglu", normalization="RMSNorm", dtype=torch.bfloat16)
    ln = F.rms_norm(x, (32,), m.layer_norm_weight, m.eps)
    h = F.linear(ln, m.fc1_weight, m.fc1_bias)
    a, b = h.chunk(2, dim=-1)
    assert torch.equal(m(x), F.linear(F.silu(a) * b, m.fc2_weight, m.fc2_bias))
    m.fused_swiglu = True
    assert torch.equal(m(x), F.linear(swiglu_reference(h), m.fc2_weight, m.fc2_bias))
    with pytest.raises(TypeError, match="fused_swiglu"):
        lowbit.nn.LayerNormMLP(32, 48, activation="swiglu", fused_swiglu="yes")
