"""lowbit.integrations.transformers: ``attn_implementation="lowbit"`` on tiny random-init HF models (nothing
downloaded), against the same weights under transformers' eager / SDPA attention.

Tolerances. ``qk="bf16"``, ``pv="bf16"`` on float32 CPU inputs runs lowbit's FP32 reference: it differs from eager
attention by summation order only (~2e-7 relative on the logits), so 1e-5. Quantized modes: lowbit's CPU path *is*
the quantized reference, so the served attention equals ``attention_quantized_reference`` of each sequence exactly
(tested below); against FP32 attention the error is the quantization's own: E4M3 P alone costs ~2.5e-2 NRMSE on an
attention output (docs/NUMERICS.md §7), and two layers of it measure 2e-2..4e-2 on these models' logits, so INT8·FP8
is held to 1e-1; INT8 Q·Kᵀ with FP32 P·V (pv="bf16" on float32 inputs keeps V's own dtype) measures ~1e-4, held to
2e-3.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import lowbit.integrations.transformers as lbt  # noqa: E402
from lowbit.attention import AttentionConfig, attention_quantized_reference, attention_reference  # noqa: E402

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)


def _configs():
    t = transformers
    return {
        "llama": lambda: t.LlamaConfig(**COMMON),
        "mistral": lambda: t.MistralConfig(**COMMON, sliding_window=5),  # the window binds at 12 tokens
        "qwen2": lambda: t.Qwen2Config(**COMMON),
        "qwen3": lambda: t.Qwen3Config(**COMMON, head_dim=16),
        "gemma": lambda: t.GemmaConfig(**COMMON, head_dim=16),
        "gemma3": lambda: t.Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=5,
                                             layer_types=["sliding_attention", "full_attention"]),
    }


MODELS = sorted(_configs())
BF16 = AttentionConfig(qk="bf16", pv="bf16")
INT8_FP8 = AttentionConfig(qk="int8", pv="fp8")
INT8 = AttentionConfig(qk="int8", pv="bf16")
TOL = {BF16: 1e-5, INT8_FP8: 1e-1, INT8: 1e-2}


@pytest.fixture(scope="module")
def names():
    return {c: lbt.register(c, name=f"lowbit-test-{c.qk}-{c.pv}") for c in (BF16, INT8_FP8, INT8)}


def _model(cfg, impl, like=None, train=False, auto=None):
    torch.manual_seed(0)
    auto = transformers.AutoModelForCausalLM if auto is None else auto
    m = auto.from_config(copy.deepcopy(cfg), attn_implementation=impl)
    if like is not None:
        m.load_state_dict(like.state_dict())
    return m.train(train)


def _nrmse(a, b):
    return ((a - b).float().norm() / b.float().norm()).item()


def _ids(b=3, s=12, seed=1):
    return torch.randint(0, COMMON["vocab_size"], (b, s), generator=torch.Generator().manual_seed(seed))


def _padding(kind, b=3, s=12):
    """A (b, s) attention mask: row 0 full, row 1 padded on the left or right (or both kinds: row 2 the other)."""
    am = torch.ones(b, s, dtype=torch.long)
    if kind in ("left", "both"):
        am[1, :4] = 0
    if kind in ("right", "both"):
        am[2 if kind == "both" else 1, 9:] = 0
    return am


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("config", [BF16, INT8_FP8, INT8], ids=["bf16", "int8-fp8", "int8-bf16"])
def test_matches_eager_and_sdpa(model, config, names):
    cfg = _configs()[model]()
    ref = _model(cfg, "eager")
    sdpa = _model(cfg, "sdpa", like=ref)
    m = _model(cfg, names[config], like=ref)
    st = lbt.stats(names[config])
    before = st.served
    ids, am = _ids(), _padding("both")
    valid = am.bool()
    with torch.no_grad():
        e = ref(ids).logits
        assert _nrmse(m(ids).logits, e) < TOL[config]
        e, es = ref(ids, attention_mask=am).logits, sdpa(ids, attention_mask=am).logits
        got = m(ids, attention_mask=am).logits
    assert _nrmse(got[valid], e[valid]) < TOL[config]
    assert _nrmse(got[valid], es[valid]) < TOL[config]
    assert st.served - before == 2 * COMMON["num_hidden_layers"]  # every layer of both forwards ran lowbit


@pytest.mark.parametrize("config", [BF16, INT8_FP8], ids=["bf16", "int8-fp8"])
@pytest.mark.parametrize("model", ["llama", "gemma3"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_equals_per_sequence_runs(model, config, side, names):
    """Packed varlen attention: each padded row gives what the row alone (unpadded, no mask) gives. Positions are
    passed so that both see the same RoPE angles (the quantized modes see the same values, hence the same codes)."""
    m = _model(_configs()[model](), names[config])
    ids, am = _ids(), _padding(side)
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        batch = m(ids, attention_mask=am, position_ids=pos).logits
        for r in range(ids.shape[0]):
            keep = am[r].bool()
            alone = m(ids[r:r + 1, keep]).logits[0]
            torch.testing.assert_close(batch[r, keep], alone, rtol=1e-5, atol=1e-5)
    assert not lbt.stats(names[config]).fallbacks


@pytest.mark.parametrize("config", [INT8_FP8, BF16], ids=["int8-fp8", "bf16"])
def test_served_attention_is_the_reference_of_each_sequence(config):
    """The function transformers calls, on a padded causal mask: the valid rows equal lowbit's reference of each
    sequence (quantized: ``attention_quantized_reference``; 16-bit: ``attention_reference``) exactly; padded query
    rows are zeros; GQA (4 query heads on 2 KV heads) runs without repeating K/V."""
    fn = lbt.attention_function(config)
    g = torch.Generator().manual_seed(3)
    b, s, d = 3, 40, 32
    q, k, v = torch.randn(b, 4, s, d, generator=g), torch.randn(b, 2, s, d, generator=g), torch.randn(b, 2, s, d,
                                                                                                      generator=g)
    valid = torch.zeros(b, s, dtype=torch.bool)
    valid[0] = True
    valid[1, s - 23:] = True  # left padding
    valid[2, :31] = True  # right padding
    mask = (valid[:, None, None, :] & torch.ones(s, s, dtype=torch.bool).tril())

    class Module:
        is_causal = True
        training = False

    out, weights = fn(Module(), q, k, v, mask, scaling=0.2, dropout=0.0)
    assert weights is None and out.shape == (b, s, 4, d)
    for r in range(b):
        sel = valid[r]
        args = (q[r:r + 1, :, sel], k[r:r + 1, :, sel], v[r:r + 1, :, sel])
        if config.qk == "bf16":
            exp = attention_reference(*args, causal=True, softmax_scale=0.2)
        else:
            exp = attention_quantized_reference(*args, qk=config.qk, pv=config.pv, causal=True, softmax_scale=0.2)
        torch.testing.assert_close(out[r, sel], exp[0].transpose(0, 1), rtol=0, atol=1e-6)
        assert not out[r, ~sel].any()
    assert fn.stats.served == 1 and not fn.stats.fallbacks


def test_generate_sends_decode_steps_to_sdpa_and_says_so_once(caplog):
    cfg = _configs()["llama"]()
    name = lbt.register(BF16, name="lowbit-test-generate")
    sdpa = _model(cfg, "sdpa")
    m = _model(cfg, name, like=sdpa)
    ids, am = _ids(), _padding("left")
    new = 5
    caplog.set_level(logging.DEBUG, logger="lowbit")
    with torch.no_grad():
        got = m.generate(ids, attention_mask=am, max_new_tokens=new, do_sample=False)
        exp = sdpa.generate(ids, attention_mask=am, max_new_tokens=new, do_sample=False)
    assert torch.equal(got, exp)
    st = lbt.stats(name)
    layers = COMMON["num_hidden_layers"]
    assert st.served == layers  # the prefill
    assert st.fallbacks == {"decode step (q_len 1 with a KV cache)": (new - 1) * layers}
    said = [r for r in caplog.records if "decode step" in r.getMessage()]
    assert len(said) == 1 and "lowbit-test-generate" in said[0].getMessage()


@pytest.mark.parametrize("config", [BF16, INT8_FP8], ids=["bf16", "int8-fp8"])
def test_backward(config, names):
    """loss.backward() through the dense and the packed (padded) path: the gradient is the 16-bit attention's at
    lowbit's inputs (straight-through for quantized forwards), so under bf16 it equals eager's; under INT8·FP8 the
    whole gradient is as far from eager's as the forward's logits are (~2e-2 measured, held to the forward's 1e-1)."""
    cfg = _configs()["llama"]()
    ref = _model(cfg, "eager", train=True)
    m = _model(cfg, names[config], like=ref, train=True)
    ids = _ids()
    for am in (None, _padding("both")):
        # padded positions are no tokens: no loss at them, nor where they would predict the first real token
        labels = ids if am is None else ids.masked_fill((am == 0) | (F.pad(am[:, :-1], (1, 0), value=1) == 0), -100)
        for model in (ref, m):
            model.zero_grad()
            model(ids, attention_mask=am, labels=labels).loss.backward()
        for (n, pr), (_, pm) in zip(ref.named_parameters(), m.named_parameters()):
            assert pm.grad is not None and torch.isfinite(pm.grad).all(), n
            if config == BF16:
                torch.testing.assert_close(pm.grad, pr.grad, rtol=1e-4, atol=1e-6, msg=n)
        flat = [torch.cat([p.grad.flatten() for p in x.parameters()]) for x in (m, ref)]
        assert _nrmse(*flat) < TOL[config]


@pytest.mark.parametrize("config", [BF16, INT8_FP8], ids=["bf16", "int8-fp8"])
def test_encoder_and_cross_attention(config, names):
    """Modules with is_causal=False: a padded BERT encoder (key padding, every query row computed) and BART's
    encoder, causal decoder and cross-attention (q_len != kv_len, the encoder's padding)."""
    t = transformers
    am = _padding("both")
    dims = dict(vocab_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    bert = t.BertConfig(hidden_size=64, **dims)
    ref = _model(bert, "eager", auto=t.AutoModel)
    m = _model(bert, names[config], like=ref, auto=t.AutoModel)
    st = lbt.stats(names[config])
    before = st.served
    with torch.no_grad():
        got, exp = (x(_ids(), attention_mask=am).last_hidden_state for x in (m, ref))
    assert _nrmse(got, exp) < TOL[config]  # every position, padded ones included
    bart = t.BartConfig(vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128)
    ref = _model(bart, "eager", auto=t.AutoModelForSeq2SeqLM)
    m = _model(bart, names[config], like=ref, auto=t.AutoModelForSeq2SeqLM)
    dec = _ids(s=7, seed=2)
    with torch.no_grad():
        got, exp = (x(_ids(), attention_mask=am, decoder_input_ids=dec).logits for x in (m, ref))
    assert _nrmse(got, exp) < TOL[config]
    assert st.served - before == 2 + 3 * 2 and not st.fallbacks  # BERT 2 layers; BART 2 x (enc, dec, cross)


def test_set_attn_implementation_and_use(names):
    cfg = _configs()["qwen2"]()
    m = _model(cfg, "sdpa")
    ids = _ids()
    with torch.no_grad():
        exp = m(ids).logits
        m.set_attn_implementation(names[BF16])
        st = lbt.stats(names[BF16])
        before = st.served
        torch.testing.assert_close(m(ids).logits, exp, rtol=1e-5, atol=1e-5)
        assert st.served == before + COMMON["num_hidden_layers"]
        cfg2 = AttentionConfig(qk="fp8", pv="fp8", granularity="per_warp")
        assert lbt.use(m, cfg2) == lbt.implementation_name(cfg2) == "lowbit-fp8-fp8-per_warp"
        assert m.config._attn_implementation == "lowbit-fp8-fp8-per_warp"
        assert _nrmse(m(ids).logits, exp) < TOL[INT8_FP8]
    assert lbt.stats("lowbit-fp8-fp8-per_warp").served == COMMON["num_hidden_layers"]
    assert lbt.registered()["lowbit-fp8-fp8-per_warp"] == cfg2
    assert lbt.implementation_name() == "lowbit"


def test_fallbacks_and_their_reasons(names):
    name = lbt.register(INT8_FP8, name="lowbit-test-fallbacks")
    st = lbt.stats(name)
    layers = COMMON["num_hidden_layers"]
    # dropout in training with quantized arithmetic: SDPA
    cfg = _configs()["llama"]()
    cfg.attention_dropout = 0.1
    m = _model(cfg, name, train=True)
    m(_ids()).logits.sum().backward()
    assert st.served == 0 and sum(st.fallbacks.values()) == layers
    (reason,) = st.fallbacks
    assert "dropout_p=0.1" in reason and "16-bit" in reason
    # packed sequences (position_ids restarting, no mask, no cache): transformers builds a block-diagonal mask
    st.reset()
    m = _model(_configs()["llama"](), name)
    ref = _model(_configs()["llama"](), "sdpa", like=m)
    ids = _ids(b=1)
    pos = torch.cat([torch.arange(5), torch.arange(7)])[None]
    with torch.no_grad():
        got, exp = (x(ids, position_ids=pos, use_cache=False).logits for x in (m, ref))
    torch.testing.assert_close(got, exp)
    assert st.fallbacks == {"a mask that is not causal + padding (packed sequences or a custom mask)": layers}
    # a custom 4-D float mask
    st.reset()
    mask = torch.zeros(1, 1, 12, 12).masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))
    with torch.no_grad():
        got, exp = (x(ids, attention_mask=mask).logits for x in (m, ref))
    torch.testing.assert_close(got, exp)
    assert st.fallbacks == {"a float (additive) mask": layers}


def test_softcap_runs_eager_attention(names):
    """Gemma2's logit soft-capping: SDPA has none, so those calls run eager attention, equal to eager's."""
    cfg = transformers.Gemma2Config(**COMMON, head_dim=16, sliding_window=5)
    ref = _model(cfg, "eager")
    m = _model(cfg, names[BF16], like=ref)
    ids, am = _ids(), _padding("left")
    with torch.no_grad():
        torch.testing.assert_close(m(ids, attention_mask=am).logits, ref(ids, attention_mask=am).logits)
    assert lbt.stats(names[BF16]).fallbacks["softcap (logit soft-capping): eager attention"] >= 2


def test_compiles_with_fullgraph(names):
    """Without a mask the attention function traces (lowbit's custom operators; nothing counted while tracing);
    with one it passes the call to SDPA while tracing rather than read the mask."""
    m = _model(_configs()["llama"](), names[BF16])
    ids = _ids()
    with torch.no_grad():
        exp = m(ids, use_cache=False).logits
        compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
        got = compiled(ids, use_cache=False).logits
        am = _padding("both")
        exp_masked = m(ids, attention_mask=am, use_cache=False).logits
        got_masked = compiled(ids, attention_mask=am, use_cache=False).logits
    torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_masked[am.bool()], exp_masked[am.bool()], rtol=1e-5, atol=1e-5)


def test_config_and_registration_errors(names):
    with pytest.raises(ValueError, match=r"AttentionConfig.qk must be one of .*'int4'"):
        AttentionConfig(qk="int4")
    with pytest.raises(ValueError, match=r"AttentionConfig.granularity"):
        AttentionConfig(granularity="per_row")
    with pytest.raises(ValueError, match=r"AttentionConfig.backend"):
        AttentionConfig(backend="sdpa")
    with pytest.raises(TypeError, match=r"smooth_k: expected a bool"):
        AttentionConfig(smooth_k=1)
    with pytest.raises(Exception):  # frozen
        BF16.qk = "int8"
    with pytest.raises(ValueError, match="transformers' own"):
        lbt.register(BF16, name="sdpa")
    with pytest.raises(ValueError, match="without 'flash'"):
        lbt.register(BF16, name="lowbit_flash")
    with pytest.raises(TypeError, match="AttentionConfig"):
        lbt.register({"qk": "int8"})
    assert lbt.register(BF16, name=names[BF16]) == names[BF16]  # the same config again: nothing changes
    with pytest.raises(ValueError, match="replace=True"):
        lbt.register(INT8_FP8, name=names[BF16])
    lbt.register(INT8_FP8, name="lowbit-test-replace")
    lbt.register(BF16, name="lowbit-test-replace", replace=True)
    assert lbt.registered()["lowbit-test-replace"] == BF16
    transformers.AttentionInterface.register("lowbit-test-foreign", transformers.AttentionInterface()["sdpa"])
    with pytest.raises(ValueError, match="did not register"):
        lbt.register(BF16, name="lowbit-test-foreign")
    with pytest.raises(KeyError, match="no lowbit attention is registered as 'nope'"):
        lbt.stats("nope")
    with pytest.raises(TypeError, match="set_attn_implementation"):
        lbt.use(torch.nn.Linear(2, 2), BF16)
    fn = lbt.attention_function(BF16)
    with pytest.raises(NotImplementedError, match="s_aux"):
        fn(None, torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), None, s_aux=torch.zeros(2))


# ----------------------------------------------------------------------------- GPU
def _gpu_model(cfg, impl, like=None):
    m = _model(cfg, impl, like=like)
    return m.to(device="cuda", dtype=torch.bfloat16).eval()


GPU_COMMON = dict(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2)


@pytest.mark.gpu
@pytest.mark.parametrize("config,tol", [(BF16, 2e-2), (INT8, 3e-2), (INT8_FP8, 1e-1)],
                         ids=["bf16", "int8-bf16", "int8-fp8"])
@pytest.mark.parametrize("model", ["llama", "qwen3", "gemma"])
def test_gpu_matches_sdpa(model, config, tol):
    t = transformers
    cfg = {"llama": t.LlamaConfig, "qwen3": t.Qwen3Config, "gemma": t.GemmaConfig}[model](**GPU_COMMON, head_dim=64)
    name = lbt.register(config, name=f"lowbit-gpu-{config.qk}-{config.pv}")
    ref = _gpu_model(cfg, "sdpa")
    m = _gpu_model(cfg, name, like=ref)
    ids = _ids(b=4, s=300).cuda()
    am = torch.ones_like(ids)
    am[1, :100] = 0
    am[2, 250:] = 0
    valid = am.bool()
    st = lbt.stats(name)
    before = st.served
    with torch.no_grad():
        assert _nrmse(m(ids).logits, ref(ids).logits) < tol
        assert _nrmse(m(ids, attention_mask=am).logits[valid], ref(ids, attention_mask=am).logits[valid]) < tol
    assert st.served - before == 2 * GPU_COMMON["num_hidden_layers"]


@pytest.mark.gpu
@pytest.mark.parametrize("config,tol", [(BF16, 2e-2), (INT8_FP8, 5e-2)], ids=["bf16", "int8-fp8"])
def test_gpu_padded_equals_per_sequence_generate_and_backward(config, tol):
    """BF16 activations: the padded batch and the lone row differ by rounding (other GEMM shapes upstream; the varlen
    Triton kernel against the dense path), which quantization amplifies where a code flips."""
    cfg = transformers.LlamaConfig(**GPU_COMMON, head_dim=64)
    name = lbt.register(config, name=f"lowbit-gpu-{config.qk}-{config.pv}")
    m = _gpu_model(cfg, name)
    ids = _ids(b=3, s=200).cuda()
    am = torch.ones_like(ids)
    am[1, :60] = 0
    am[2, 150:] = 0
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        batch = m(ids, attention_mask=am, position_ids=pos).logits
        for r in range(3):
            keep = am[r].bool()
            alone = m(ids[r:r + 1, keep]).logits[0]
            assert _nrmse(batch[r, keep], alone) < tol
        out = m.generate(ids, attention_mask=am, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape == (3, 204)
    assert lbt.stats(name).fallbacks["decode step (q_len 1 with a KV cache)"] >= 3 * GPU_COMMON["num_hidden_layers"]
    m.train()
    loss = m(ids, attention_mask=am, labels=ids).loss
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters() if p.requires_grad)


@pytest.mark.gpu
def test_gpu_declines_float32_and_odd_head_dims():
    cfg = transformers.LlamaConfig(**{**GPU_COMMON, "hidden_size": 480, "num_attention_heads": 8}, head_dim=60)
    name = lbt.register(INT8_FP8, name="lowbit-gpu-declines")
    m = _gpu_model(cfg, name)
    with torch.no_grad():
        m(_ids(b=2, s=64).cuda())
        m.float()(_ids(b=2, s=64).cuda())
    f = lbt.stats(name).fallbacks
    assert any("head_dim 60" in r for r in f) and any("float32 inputs on CUDA" in r for r in f)
