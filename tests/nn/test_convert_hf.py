"""lowbit.convert on tiny random-init Hugging Face models (nothing downloaded): GPT-2's Conv1D, the gated-MLP fusion of
Llama / Mistral / Qwen2 (Gemma's GELU-tanh MLP not fused), the unconverted numbers outside autocast, forward +
backward inside, state_dict round trips with the HF layout, the summary, and a full-graph compile."""

from __future__ import annotations

import copy

import pytest
import torch
from nn_helpers import lowbit_ops, recording_backend

import lowbit
from lowbit.nn.convert import NORM_NOT_FUSED, QKV_NOT_FUSED
from lowbit.recipes import from_name

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, max_position_embeddings=64)


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))


def _mistral():
    return transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL, sliding_window=None))


def _qwen2():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL))


def _gemma():
    return transformers.GemmaForCausalLM(transformers.GemmaConfig(**SMALL, head_dim=16))


def _qwen3():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SMALL, head_dim=16))


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128,
                                                                 n_positions=64, bos_token_id=0, eos_token_id=0))


MODELS = {"llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "gemma": _gemma, "gpt2": _gpt2}
QKV_MODELS = {"llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3}
GATED = ("llama", "mistral", "qwen2")


def _model(name):
    torch.manual_seed(0)
    m = {**MODELS, **QKV_MODELS}[name]()
    m.config.use_cache = False
    return m.eval()  # (no dropout: GPT-2's is 0.1 by default)


def _ids():
    return torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))


def _loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(MODELS))
def test_converted_equals_original_outside_autocast(name):
    ref = _model(name)
    model = copy.deepcopy(ref)
    s = lowbit.convert(model, fuse_mlp=True, fuse_qkv=True)
    ids = _ids()
    l_ref, l_new = _loss(ref, ids), _loss(model, ids)
    assert torch.equal(l_ref, l_new)
    assert torch.equal(ref(input_ids=ids).logits, model(input_ids=ids).logits)
    l_ref.backward()
    l_new.backward()
    g_ref, g_new = _grads(ref), _grads(model)
    # gradients bit-identical too: the HF layout of the converted model's state_dict maps them onto the original's
    g_new = _grads_in_hf_layout(model, g_new)
    assert g_new.keys() == g_ref.keys()
    for k, g in g_new.items():
        assert torch.equal(g, g_ref[k]), k
    assert s.converted and "lm_head" in dict(s.kept)


def _grads_in_hf_layout(model, grads):
    """The converted model's gradients under the original model's names and layouts."""
    out = {}
    for mname, m in model.named_modules():
        pre = f"{mname}." if mname else ""
        if isinstance(m, lowbit.nn.SwiGLUMLP):
            f = m.ffn_hidden_size
            g1 = grads.pop(pre + "fc1_weight")
            out[pre + "gate_proj.weight"], out[pre + "up_proj.weight"] = g1[:f], g1[f:]
            out[pre + "down_proj.weight"] = grads.pop(pre + "fc2_weight")
        elif isinstance(m, lowbit.nn.QKVLinear):
            g = grads.pop(pre + "weight")
            out[pre + "weight"] = g[m.rows(0)]
            par = mname.rpartition(".")[0]
            for i, n in ((1, "k_proj"), (2, "v_proj")):
                out[f"{par}.{n}.weight"] = g[m.rows(i)]
            if m.bias is not None:
                b = grads.pop(pre + "bias")
                for i, n in enumerate(("q_proj", "k_proj", "v_proj")):
                    out[f"{par}.{n}.bias"] = b[m.rows(i)]
        elif isinstance(m, lowbit.nn.Conv1DLinear):
            out[pre + "weight"] = grads.pop(pre + "weight").t()
    out.update(grads)
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_converted_trains_in_autocast(name):
    ref = _model(name)
    model = copy.deepcopy(ref)
    lowbit.convert(model, fuse_mlp=True)
    ids = _ids()
    l_ref, logits_ref = _loss(ref, ids), ref(input_ids=ids).logits
    with lowbit.autocast(recipe=from_name("fp8-block")):
        out = model(input_ids=ids, labels=ids)
    loss = out.loss
    loss.backward()
    assert torch.isfinite(loss)
    # E4M3 rounds each GEMM operand to 3 mantissa bits (RMS relative error ~2^-4/sqrt(3) = 3.6%, less after the
    # sums over K): the logits' NRMSE against the unconverted model measures 0.7% (Gemma) to 3.8% (Llama); 0.1 leaves
    # room for other BLAS / kernels while far below unrelated logits (~1.4: a wrong fusion or transposed weight).
    # The loss of a random-init model is ~ln(128) whatever the weights, so it is checked loosely (measured < 0.02%).
    nrmse = ((out.logits.float() - logits_ref).norm() / logits_ref.norm()).item()
    assert nrmse < 0.1, nrmse
    assert abs(loss.item() - l_ref.item()) < 1e-2 * l_ref.item()
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n


def test_gpt2_conv1d():
    ref = _model("gpt2")
    model = copy.deepcopy(ref)
    bias = model.transformer.h[0].attn.c_attn.bias
    s = lowbit.convert(model)
    c = model.transformer.h[0].attn.c_attn
    assert isinstance(c, lowbit.nn.Conv1DLinear) and c.lowbit_name == "transformer.h.0.attn.c_attn"
    assert c.weight.shape == (192, 64) and c.weight.is_contiguous() and c.bias is bias  # bias shared
    assert torch.equal(c.weight, ref.transformer.h[0].attn.c_attn.weight.t())
    assert isinstance(model.transformer.h[1].mlp.c_proj, lowbit.nn.Conv1DLinear)
    assert type(model.lm_head) is torch.nn.Linear  # the output head, tied to wte: kept
    conv = dict(s.converted)
    assert len(conv) == 2 * 4 and "weight copied transposed" in conv["transformer.h.0.attn.c_attn"]
    assert len(s.new_parameters) == 8 and "transformer.h.1.mlp.c_fc" in s.new_parameters
    assert "new Parameters (build the optimizer after convert): 8" in str(s)
    # state_dict: Conv1D's (in, out) layout, also for the square c_proj; loads both ways
    sd_ref, sd = ref.state_dict(), model.state_dict()
    assert {k for k in sd if not k.endswith("_extra_state")} == set(sd_ref)
    for k, v in sd_ref.items():
        assert torch.equal(sd[k], v), k
    other = _gpt2_other()
    lowbit.convert(other)
    other.load_state_dict(sd_ref, strict=False)  # an HF checkpoint into the converted model (no _extra_state keys)
    ids = _ids()
    assert torch.equal(other(input_ids=ids).logits, ref(input_ids=ids).logits)
    back = _gpt2_other()
    back.load_state_dict({k: v for k, v in other.state_dict().items() if not k.endswith("_extra_state")})
    assert torch.equal(back(input_ids=ids).logits, ref(input_ids=ids).logits)


def _gpt2_other():
    torch.manual_seed(123)  # different weights than _model("gpt2")
    return _gpt2().eval()


def test_conv1d_load_errors():
    model = _gpt2_other()
    lowbit.convert(model)
    sd = model.state_dict()
    sd["transformer.h.0.attn.c_attn.weight"] = sd["transformer.h.0.attn.c_attn.weight"].t()  # (out, in): wrong
    with pytest.raises(RuntimeError, match=r"Conv1DLinear loads Conv1D's \(in, out\) = \(64, 192\) layout, got "
                                           r"\(192, 64\)"):
        model.load_state_dict(sd)


@pytest.mark.parametrize("name", GATED)
def test_gated_mlp_fused_and_summary(name):
    model = _model(name)
    gate = model.model.layers[0].mlp.gate_proj.weight
    down = model.model.layers[0].mlp.down_proj.weight
    norm_weight = model.model.layers[0].post_attention_layernorm.weight
    s = lowbit.convert(model, fuse_mlp=True)
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp, lowbit.nn.SwiGLUMLP) and mlp.lowbit_name == "model.layers.0.mlp"
    assert mlp.fc1_weight.shape == (256, 64) and torch.equal(mlp.fc1_weight[:128], gate)
    assert mlp.fc2_weight is down  # down shared, fc1 a copy
    fused, not_fused = dict(s.fused), s.not_fused
    norms = {f"model.layers.{i}.post_attention_layernorm" for i in (0, 1)}
    assert set(fused) == {"model.layers.0.mlp", "model.layers.1.mlp"} | norms
    assert "RMSNorm moved into model.layers.0.mlp" in fused["model.layers.0.post_attention_layernorm"]
    assert s.new_parameters == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert [r for n, r in not_fused if n == "model.layers.0.mlp"] == []
    deferred = model.model.layers[0].post_attention_layernorm
    assert isinstance(deferred, lowbit.nn.DeferredRMSNorm) and mlp.norm is deferred
    assert deferred.weight is norm_weight and deferred.variance_epsilon == 1e-6
    assert "applied by the module after it" in repr(deferred) and "normalizes its input" in repr(mlp)
    assert dict(not_fused)["model.layers.0.self_attn"] == QKV_NOT_FUSED
    assert isinstance(model.model.layers[0].self_attn.q_proj, lowbit.nn.Linear)
    assert "model.layers.0.post_attention_layernorm" not in dict(s.kept)
    assert "norm" in dict(s.kept)["model.layers.0.input_layernorm"]
    text = str(s)
    assert "fused 4, not fused 2" in text and "* model.layers.1.mlp: gate_proj + up_proj" in text
    # fuse_norms=False: the norm stays, and the summary says why
    kept = _model(name)
    s3 = lowbit.convert(kept, fuse_mlp=True, fuse_norms=False)
    assert type(kept.model.layers[0].post_attention_layernorm).__name__.endswith("RMSNorm")
    assert kept.model.layers[0].mlp.norm is None
    assert [r for n, r in s3.not_fused if n == "model.layers.0.mlp"] == [NORM_NOT_FUSED]
    assert "RMSNorm before it is not fused" in NORM_NOT_FUSED
    # without fuse_mlp: only Linears, nothing fused or reported
    plain = _model(name)
    s2 = lowbit.convert(plain)
    assert isinstance(plain.model.layers[0].mlp.gate_proj, lowbit.nn.Linear)
    assert s2.fused == [] and s2.not_fused == [] and s2.new_parameters == []


def test_gemma_mlp_not_fused():
    model = _model("gemma")
    s = lowbit.convert(model, fuse_mlp=True)
    assert type(model.model.layers[0].mlp).__name__ == "GemmaMLP"
    assert isinstance(model.model.layers[0].mlp.gate_proj, lowbit.nn.Linear)
    why = dict(s.not_fused)["model.layers.0.mlp"]
    assert why.startswith("gated MLP not fused: activation ") and "is not SiLU" in why and "GELU-tanh" in why
    assert s.fused == []


def test_mlp_with_a_kept_part_is_not_fused():
    model = _model("llama")
    s = lowbit.convert(model, fuse_mlp=True, skip="*.1.mlp.up_proj")
    assert isinstance(model.model.layers[0].mlp, lowbit.nn.SwiGLUMLP)
    assert type(model.model.layers[1].mlp).__name__ == "LlamaMLP"
    assert type(model.model.layers[1].mlp.up_proj) is torch.nn.Linear
    assert isinstance(model.model.layers[1].mlp.gate_proj, lowbit.nn.Linear)
    why = dict(s.not_fused)["model.layers.1.mlp"]
    assert "model.layers.1.mlp.up_proj kept in high precision: skip pattern" in why


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_fused_state_dict_round_trip(name):
    ref = _model(name)
    model = copy.deepcopy(ref)
    lowbit.convert(model, fuse_mlp=True)
    sd_ref, sd = ref.state_dict(), model.state_dict()
    assert {k for k in sd if not k.endswith("_extra_state")} == set(sd_ref)  # the HF keys and shapes
    for k, v in sd_ref.items():
        assert torch.equal(sd[k], v), k
    with lowbit.autocast(recipe=from_name("fp8-delayed")):
        _loss(model, _ids()).backward()
    sd = model.state_dict()
    assert "model.layers.0.mlp._extra_state" in sd
    # into a converted model of other weights (with the scaling state), and an HF checkpoint into a converted model
    torch.manual_seed(5)
    other = MODELS[name]().eval()
    lowbit.convert(other, fuse_mlp=True)
    other.load_state_dict(sd)
    ids = _ids()
    assert torch.equal(other(input_ids=ids).logits, model(input_ids=ids).logits)
    assert other.model.layers[0].mlp.get_extra_state().keys() == sd["model.layers.0.mlp._extra_state"].keys()
    torch.manual_seed(6)
    other = MODELS[name]().eval()
    lowbit.convert(other, fuse_mlp=True)
    other.load_state_dict(sd_ref, strict=False)
    assert torch.equal(other(input_ids=ids).logits, ref(input_ids=ids).logits)
    # strict: a missing or unexpected key is reported under its HF name
    bad = dict(sd_ref)
    del bad["model.layers.0.mlp.up_proj.weight"]
    bad["model.layers.0.mlp.fc1_weight"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*model\.layers\.0\.mlp\.up_proj\.weight(.|\n)*"
                                           r"Unexpected key\(s\).*model\.layers\.0\.mlp\.fc1_weight"):
        other.load_state_dict(bad)


def test_swiglu_mlp_module():
    torch.manual_seed(0)
    m = lowbit.nn.SwiGLUMLP(64, 96, bias=True)
    assert m.fc1_weight.shape == (192, 64) and m.fc1_bias.shape == (192,) and m.fc2_weight.shape == (64, 96)
    x = torch.randn(3, 64)
    g, u = m.fc1_weight.chunk(2)
    bg, bu = m.fc1_bias.chunk(2)
    ref = torch.nn.functional.linear(torch.nn.functional.silu(x @ g.t() + bg) * (x @ u.t() + bu), m.fc2_weight,
                                     m.fc2_bias)
    torch.testing.assert_close(m(x), ref)
    assert set(m.state_dict()) == {"gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias",
                                   "down_proj.weight", "down_proj.bias", "_extra_state"}
    with pytest.raises(ValueError, match="input: last dim must be hidden_size = 64, got 32"):
        m(torch.randn(2, 32))
    with pytest.raises(TypeError, match="bias: expected a bool"):
        lowbit.nn.SwiGLUMLP(64, 96, bias="no")
    with pytest.raises(TypeError, match="mlp: expected gate_proj, up_proj and down_proj nn.Linear"):
        lowbit.nn.SwiGLUMLP.from_gated(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="conv: expected a transformers Conv1D"):
        lowbit.nn.Conv1DLinear.from_conv1d(torch.nn.ReLU())


def test_fuse_mlp_must_be_bool():
    with pytest.raises(TypeError, match="fuse_mlp: expected a bool, got 'yes'"):
        lowbit.convert(_model("llama"), fuse_mlp="yes")


def test_fused_llama_compiles():
    torch.compiler.reset()
    model = _model("llama")
    lowbit.convert(model, fuse_mlp=True)
    ids = _ids()
    recipe = from_name("fp8-block")
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with lowbit.autocast(recipe=recipe):
        eager = model(input_ids=ids).logits
        comp = compiled(input_ids=ids).logits
    assert torch.equal(eager, comp)
    torch.compiler.reset()


def test_fused_llama_traces_its_mlp_where_its_linears_trace(monkeypatch):
    """Inside torch.compile, where the plain linear traces as torch operations (forced on the CPU) and the moved
    norm would run inside fc1's quantizer (asked for: a CUDA path), the converted MLP leaves the norm to torch and
    traces its linears: no lowbit::quantized_linear / quantized_swiglu_mlp operator in the graphs."""
    from lowbit.nn import functional as fn
    from lowbit.nn import hf_modules, layernorm_mlp

    monkeypatch.setattr(fn, "_traced_linear_fits", lambda x, w, r, c: fn.traced_linear_rules(
        r, c, x.numel() // x.shape[-1], w.shape[0], w.shape[1], x.dtype, w.dtype))
    for mod in (fn, hf_modules):
        monkeypatch.setattr(mod, "norm_fuses", lambda x, w, r: True)
    monkeypatch.setattr(layernorm_mlp, "swiglu_mlp_fusable", lambda *a, **k: True)
    torch.compiler.reset()
    model = _model("llama")
    lowbit.convert(model, fuse_mlp=True)
    codes = []
    compiled = torch.compile(model, backend=recording_backend(codes), fullgraph=True)
    ids = _ids()
    with lowbit.autocast(recipe=from_name("fp8-current")):
        out = compiled(input_ids=ids, labels=ids)
    out.loss.backward()
    torch.compiler.reset()
    ops = lowbit_ops(codes)
    assert not ops & {"quantized_linear", "quantized_swiglu_mlp"}, sorted(ops)
    assert "_scaled_mm" in "\n".join(codes) and torch.isfinite(out.loss)
    assert model.model.layers[0].post_attention_layernorm.weight.grad is not None


def test_hf_rmsnorm_is_not_torch_rmsnorm_in_bf16():
    """Why fuse_mlp leaves the RMSNorm out: HF's LlamaRMSNorm rounds the normalized input to bfloat16, then
    multiplies by the weight (a second rounding); F.rms_norm (what lowbit's norms run) rounds once. FP32 agrees."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    norm = LlamaRMSNorm(64, eps=1e-6)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(4, 32, 64)
    assert torch.equal(norm(x), torch.nn.functional.rms_norm(x, (64,), norm.weight, 1e-6))
    norm, x = norm.bfloat16(), x.bfloat16()
    assert not torch.equal(norm(x), torch.nn.functional.rms_norm(x, (64,), norm.weight, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", GATED + ("qwen3",))
def test_hf_rms_norm_is_the_classes_forward(name, dtype):
    """lowbit's hf_rms_norm is each HF_RMSNORM_CLASSES forward bit for bit, values and gradients."""
    import importlib

    from lowbit.nn.hf_modules import HF_RMSNORM_CLASSES, hf_rms_norm

    cls_name = {"llama": "LlamaRMSNorm", "mistral": "MistralRMSNorm", "qwen2": "Qwen2RMSNorm",
                "qwen3": "Qwen3RMSNorm"}[name]
    assert cls_name in HF_RMSNORM_CLASSES
    cls = getattr(importlib.import_module(f"transformers.models.{name}.modeling_{name}"), cls_name)
    torch.manual_seed(0)
    norm = cls(64, eps=1e-5)
    torch.nn.init.normal_(norm.weight)
    x = (torch.randn(3, 17, 64) * 5).to(dtype).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    w2 = norm.weight.detach().clone().requires_grad_()
    a, b = norm(x), hf_rms_norm(x2, w2, 1e-5)
    assert a.dtype == b.dtype and torch.equal(a, b)
    g = torch.randn(a.shape)
    a.backward(g)
    b.backward(g)
    assert torch.equal(x.grad, x2.grad) and torch.equal(norm.weight.grad, w2.grad)


@pytest.mark.parametrize("name", GATED)
def test_moved_norm_trains_as_the_kept_norm(name):
    """Inside autocast where the norm cannot run in the quantizer (here: the CPU), the MLP with its norm moved in
    computes what the MLP after HF's norm computes, bit for bit: loss, logits and every gradient (the norm's weight
    included, under its HF name); and a deep copy keeps the moved norm's weight in one Parameter."""
    a, b = _model(name), _model(name)
    lowbit.convert(a, fuse_mlp=True, fuse_qkv=True)
    lowbit.convert(b, fuse_mlp=True, fuse_qkv=True, fuse_norms=False)
    assert isinstance(a.model.layers[0].input_layernorm, lowbit.nn.DeferredRMSNorm)
    assert not isinstance(b.model.layers[0].input_layernorm, lowbit.nn.DeferredRMSNorm)
    ids = _ids()
    for recipe in ("fp8-block", "fp8-current"):
        outs = []
        for m in (a, b):
            m.zero_grad(set_to_none=True)
            with lowbit.autocast(recipe=from_name(recipe)):
                out = m(input_ids=ids, labels=ids)
            out.loss.backward()
            outs.append((out.loss, out.logits, _grads(m)))
        (la, ga_logits, ga), (lb, gb_logits, gb) = outs
        assert torch.equal(la, lb) and torch.equal(ga_logits, gb_logits), recipe
        assert ga.keys() == gb.keys() and "model.layers.0.post_attention_layernorm.weight" in ga
        assert "model.layers.0.input_layernorm.weight" in ga
        for k in ga:
            assert torch.equal(ga[k], gb[k]), (recipe, k)
    c = copy.deepcopy(a)
    layer = c.model.layers[1]
    assert layer.mlp.norm is layer.post_attention_layernorm
    assert layer.mlp.norm.weight is dict(c.named_parameters())["model.layers.1.post_attention_layernorm.weight"]
    assert layer.self_attn.q_proj.norm is layer.input_layernorm
    assert layer.self_attn.q_proj.norm.weight is dict(c.named_parameters())["model.layers.1.input_layernorm.weight"]


def test_take_norm_errors():
    mlp = lowbit.nn.SwiGLUMLP(64, 96)
    with pytest.raises(TypeError, match="norm: expected one of .*LlamaRMSNorm.*, got LayerNorm"):
        mlp.take_norm(torch.nn.LayerNorm(64))
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    with pytest.raises(ValueError, match=r"norm: expected weight \(64,\) \(the hidden_size\) and a float "
                                         r"variance_epsilon, got \(32,\)"):
        mlp.take_norm(LlamaRMSNorm(32))
    assert mlp.norm is None
    qkv, _, _ = lowbit.nn.QKVLinear.fuse(*(torch.nn.Linear(64, n) for n in (64, 32, 32)))
    with pytest.raises(ValueError, match=r"norm: expected weight \(64,\) \(the in_features\)"):
        qkv.take_norm(LlamaRMSNorm(32))
    with pytest.raises(TypeError, match="norm: expected one of"):
        qkv.take_norm(torch.nn.RMSNorm(64))
    assert qkv.norm is None


def _same_with_gradients(a, b, pairs):
    """``a`` equals ``b`` bit for bit, and after the same backward through both so does each pair's ``.grad``."""
    assert torch.equal(a, b)
    g = torch.randn_like(a)
    a.backward(g)
    b.backward(g)
    for u, v in pairs:
        assert torch.equal(u.grad, v.grad)


def _qkv_with_norm(device, dtype=torch.float32):
    """A QKVLinear (64 q, 32 k, 32 v rows of width 256, no bias) with a LlamaRMSNorm moved in, and lowbit's
    LayerNormLinear(RMSNorm) with the same weights."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    lins = [torch.nn.Linear(256, n, bias=False, device=device, dtype=dtype) for n in (128, 64, 64)]
    norm = LlamaRMSNorm(256, eps=1e-5).to(device)
    torch.nn.init.normal_(norm.weight, 1.0, 0.1)
    qkv, kp, vp = lowbit.nn.QKVLinear.fuse(*lins)
    qkv.take_norm(norm)
    ref = lowbit.nn.LayerNormLinear(256, 256, eps=1e-5, normalization="RMSNorm", bias=False, device=device)
    with torch.no_grad():
        ref.layer_norm_weight.copy_(norm.weight)
        ref.weight.copy_(qkv.weight)
    return qkv, kp, vp, norm, ref


def check_moved_qkv_norm_in_the_quantizer(device):
    """With an FP32 input under fp8-block where the norm runs inside the input quantizer (CUDA, or Triton's
    interpreter), the QKV parts with the input norm moved in equal lowbit's LayerNormLinear(RMSNorm) with the same
    weights bit for bit (the same fused call), gradients too; the norm is computed once for the three parts."""
    from lowbit.ops import norm_quant

    qkv, kp, vp, norm, ref = _qkv_with_norm(device)
    x = torch.randn(3, 128, 256, device=device, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    calls, real = [], norm_quant.rmsnorm_quantize_1x128
    norm_quant.rmsnorm_quantize_1x128 = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        with lowbit.autocast(recipe=from_name("fp8-block")):
            assert ref.fuses_norm(x2)
            parts = [qkv(x), kp(x), vp(x)]
            assert len(calls) == 1  # the norm inside the one GEMM's input quantizer, once for the three parts
            b = ref(x2)
    finally:
        norm_quant.rmsnorm_quantize_1x128 = real
    _same_with_gradients(torch.cat(parts, -1), b, [(x, x2), (norm.weight, ref.layer_norm_weight),
                                                   (qkv.weight, ref.weight)])
    print("ok")


def test_moved_qkv_norm_in_the_quantizer_interpreted():
    pytest.importorskip("triton")
    from interp_helper import run_interpreted

    run_interpreted(__file__, "check_moved_qkv_norm_in_the_quantizer('cpu')")


@pytest.mark.gpu
def test_gpu_moved_qkv_norm_runs_in_the_quantizer():
    check_moved_qkv_norm_in_the_quantizer("cuda")


@pytest.mark.gpu
def test_gpu_moved_norm_runs_in_the_quantizer():
    """On CUDA with an FP32 input under fp8-block the moved norm runs inside fc1's input quantizer: the MLP equals
    lowbit's LayerNormMLP(RMSNorm, swiglu) with the same weights bit for bit (the same fused call), gradients too."""
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816)
    hf_mlp, norm = LlamaMLP(cfg).cuda(), LlamaRMSNorm(1024, eps=1e-5).cuda()
    torch.nn.init.normal_(norm.weight, 1.0, 0.1)
    mlp = lowbit.nn.SwiGLUMLP.from_gated(hf_mlp)
    mlp.take_norm(norm)
    ref = lowbit.nn.LayerNormMLP(1024, 2816, eps=1e-5, normalization="RMSNorm", activation="swiglu", bias=False,
                                 device="cuda")
    with torch.no_grad():
        ref.layer_norm_weight.copy_(norm.weight)
        ref.fc1_weight.copy_(mlp.fc1_weight)
        ref.fc2_weight.copy_(mlp.fc2_weight)
    x = torch.randn(4, 512, 1024, device="cuda", requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    with lowbit.autocast(recipe=from_name("fp8-block")):
        assert ref.fuses_norm(x)
        a, b = mlp(x), ref(x2)
    _same_with_gradients(a, b, [(x, x2), (norm.weight, ref.layer_norm_weight), (mlp.fc1_weight, ref.fc1_weight)])


# ----------------------------------------------------------------------------- fuse_qkv
@pytest.mark.parametrize("name", list(QKV_MODELS))
def test_qkv_fused_equals_original_outside_autocast(name):
    """``fuse_qkv``: outside autocast the three parts are the HF GEMMs (bit-identical logits and gradients, each
    gradient in its rows of the fused weight); the state_dict keeps the HF keys both ways."""
    ref = _model(name)
    model = copy.deepcopy(ref)
    q = model.model.layers[0].self_attn.q_proj.weight
    s = lowbit.convert(model, fuse_qkv=True)
    at = model.model.layers[0].self_attn
    assert isinstance(at.q_proj, lowbit.nn.QKVLinear) and isinstance(at.k_proj, lowbit.nn.QKVPart)
    assert at.k_proj.fused is at.q_proj and at.q_proj.sizes == (64, 32, 32) and at.q_proj.weight is not q
    assert ("model.layers.0.self_attn", "q_proj + k_proj + v_proj -> one QKVLinear (one GEMM inside autocast)") in (
        s.fused)
    assert "model.layers.0.self_attn.q_proj" in s.new_parameters and s.not_fused == []
    ids = _ids()
    l_ref, l_new = _loss(ref, ids), _loss(model, ids)
    assert torch.equal(l_ref, l_new)
    l_ref.backward()
    l_new.backward()
    g_ref, g_new = _grads(ref), _grads_in_hf_layout(model, _grads(model))
    assert g_new.keys() == g_ref.keys()
    for k, g in g_new.items():
        assert torch.equal(g, g_ref[k]), k
    sd_ref, sd = ref.state_dict(), model.state_dict()
    assert {k for k in sd if not k.endswith("_extra_state")} == set(sd_ref)
    for k, v in sd_ref.items():
        assert torch.equal(sd[k], v), k
    torch.manual_seed(7)
    other = QKV_MODELS[name]().eval()
    lowbit.convert(other, fuse_qkv=True)
    other.load_state_dict(sd_ref, strict=False)  # an HF checkpoint into a fused model
    back = QKV_MODELS[name]().eval()
    back.load_state_dict({k: v for k, v in other.state_dict().items() if not k.endswith("_extra_state")})
    assert torch.equal(back(input_ids=ids).logits, ref(input_ids=ids).logits)
    bad = dict(sd_ref)
    del bad["model.layers.0.self_attn.k_proj.weight"]
    bad["model.layers.0.self_attn.v_proj.weight"] = torch.zeros(3, 64)
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*self_attn\.k_proj\.weight(.|\n)*size mismatch for "
                                           r"model\.layers\.0\.self_attn\.v_proj\.weight"):
        other.load_state_dict(bad)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_qkv_fused_runs_one_gemm_inside_autocast(name, monkeypatch):
    """Inside autocast the attention's three projections run as one quantized GEMM a layer (its input quantized once),
    the parts take their columns of it, and nothing is held after the forward; it trains (finite gradients, logits
    near the unconverted model's, as ``test_converted_trains_in_autocast`` bounds them)."""
    from lowbit.nn import hf_modules

    ref = _model(name)
    model = copy.deepcopy(ref)
    lowbit.convert(model, fuse_qkv=True)
    calls = []
    real = hf_modules.quantized_linear
    monkeypatch.setattr(hf_modules, "quantized_linear", lambda x, w, *a, **k: calls.append(tuple(w.shape))
                        or real(x, w, *a, **k))
    ids = _ids()
    with lowbit.autocast(recipe=from_name("fp8-block")):
        out = model(input_ids=ids, labels=ids)
    assert calls == [(128, 64)] * 2  # one [q; k; v] GEMM in each of the two layers
    assert all(layer.self_attn.q_proj._pending is None for layer in model.model.layers)
    nodes, todo = set(), [out.loss.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is not None and fn not in nodes:
            nodes.add(fn)
            todo += [f for f, _ in fn.next_functions]
    # (the three parts' gradients meet in one split's backward a layer: one concatenation into dy, no zero-filled
    # slices summed)
    assert sum(type(fn).__name__ == "SplitWithSizesBackward0" for fn in nodes) == 2
    out.loss.backward()
    logits_ref = ref(input_ids=ids).logits
    assert ((out.logits.float() - logits_ref).norm() / logits_ref.norm()).item() < 0.1
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
    # a part called on another input, or twice, runs the GEMM again (never a stale output)
    at = model.model.layers[0].self_attn
    x, y = torch.randn(2, 5, 64), torch.randn(2, 5, 64)
    calls.clear()
    with lowbit.autocast(recipe=from_name("fp8-block")):
        q = at.q_proj(x)
        k = at.k_proj(y)
        k2 = at.k_proj(y)
        v = at.v_proj(y)
    assert len(calls) == 3 and at.q_proj._pending is not None  # (x's q taken; y's output still waits for its q)
    nrm = at.q_proj.norm  # (the layer's input_layernorm, moved in: the parts normalize their input)
    with lowbit.autocast(recipe=from_name("fp8-block")):
        fused_y = hf_modules.quantized_linear(hf_modules.hf_rms_norm(y, nrm.weight, nrm.variance_epsilon),
                                              at.q_proj.weight, at.q_proj.bias, at.q_proj._gemms[""])
    assert q.shape == (2, 5, 64) and torch.equal(k, fused_y[..., 64:96]) and torch.equal(k2, k)
    assert torch.equal(v, fused_y[..., 96:])


def test_qkv_not_fused_reasons():
    s = lowbit.convert(_model("gemma"), fuse_qkv=True)
    assert dict(s.not_fused)["model.layers.0.self_attn"].startswith("QKV not fused: GemmaAttention is not one of "
                                                                    "ATTENTION_CLASSES")
    model = _model("llama")
    s = lowbit.convert(model, fuse_qkv=True, skip="*.1.self_attn.k_proj")
    assert isinstance(model.model.layers[0].self_attn.q_proj, lowbit.nn.QKVLinear)
    assert type(model.model.layers[1].self_attn.k_proj) is torch.nn.Linear
    assert isinstance(model.model.layers[1].self_attn.q_proj, lowbit.nn.Linear)
    assert dict(s.not_fused)["model.layers.1.self_attn"] == ("QKV not fused: model.layers.1.self_attn.k_proj kept in "
                                                             "high precision: skip pattern '*.1.self_attn.k_proj'")
    assert lowbit.convert(_model("llama")).not_fused == []  # (nothing asked, nothing reported)
    with pytest.raises(TypeError, match="fuse_qkv: expected a bool, got 1"):
        lowbit.convert(_model("llama"), fuse_qkv=1)
    lin = torch.nn.Linear(8, 4)
    with pytest.raises(ValueError, match=r"q, k, v: expected one input width and a bias on all or none, got "
                                         r"in_features \[8, 8, 6\]"):
        lowbit.nn.QKVLinear.fuse(lin, lin, torch.nn.Linear(6, 4))
    with pytest.raises(TypeError, match="q, k, v: expected three torch.nn.Linear"):
        lowbit.nn.QKVLinear.fuse(lin, lin, torch.nn.ReLU())
    fresh = lowbit.nn.QKVLinear(8, (4, 2, 2))
    x = torch.randn(3, 8)
    assert fresh.weight.shape == (8, 8) and fresh.sizes == (4, 2, 2)
    assert torch.equal(lowbit.nn.QKVPart(fresh, 2)(x), torch.nn.functional.linear(x, fresh.weight[6:], fresh.bias[6:]))
    with pytest.raises(ValueError, match=r"sizes: expected three positive ints \(nq, nk, nv\), got \(4, 0, 2\)"):
        lowbit.nn.QKVLinear(8, (4, 0, 2))
    with pytest.raises(TypeError, match="use QKVLinear.fuse"):
        lowbit.nn.QKVLinear.from_linear(lin)
    with pytest.raises(ValueError, match="part: expected 1 \\(k_proj\\) or 2 \\(v_proj\\), got 0"):
        lowbit.nn.QKVPart(lowbit.nn.QKVLinear.fuse(lin, lin, lin)[0], 0)


def test_qkv_fused_llama_compiles():
    torch.compiler.reset()
    model = _model("llama")
    lowbit.convert(model, fuse_mlp=True, fuse_qkv=True)
    ids = _ids()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with lowbit.autocast(recipe=from_name("fp8-block")):
        eager = model(input_ids=ids).logits
        comp = compiled(input_ids=ids).logits
    assert torch.equal(eager, comp)
    assert all(layer.self_attn.q_proj._pending is None for layer in model.model.layers)
    torch.compiler.reset()


@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-block"])
def test_generate_with_cached_weights(recipe):
    """generate() of a converted, fused Llama under lowbit.nn.cached_weights: every weight quantized once for the
    prompt and the decode steps, the same tokens and scores as without the block."""
    model = _model("llama")
    lowbit.convert(model, fuse_mlp=True, fuse_qkv=True)
    ids = _ids()[:1, :12]
    kw = dict(max_new_tokens=6, do_sample=False, use_cache=True, output_scores=True, return_dict_in_generate=True,
              pad_token_id=0)

    def gen():
        with torch.inference_mode(), lowbit.autocast(recipe=from_name(recipe)):
            return model.generate(ids, **kw)

    plain = gen()
    with lowbit.nn.cached_weights(model) as kept:
        cached = gen()
    layers = [g for m in model.modules() if isinstance(m, lowbit.nn.LowbitModule) for g in m._gemms.values()]
    assert kept.reused == len(layers) * (kw["max_new_tokens"] - 1)  # each forward after the first
    assert torch.equal(plain.sequences, cached.sequences)
    assert all(torch.equal(a, b) for a, b in zip(plain.scores, cached.scores))
