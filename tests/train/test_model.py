"""The reference GPT: presets, variants, attention swap, lowbit modules inside."""

import pytest
import torch

import lowbit
from lowbit.models import GPT, AttentionChoice, GPTConfig, config_from_preset
from lowbit.models import gpt as gpt_mod


def test_presets_shapes_on_meta():
    expected = {"125m": (70e6, 100e6), "350m": (280e6, 330e6), "1.3b": (1.1e9, 1.3e9)}
    for name, (lo, hi) in expected.items():
        with torch.device("meta"):
            m = GPT(config_from_preset(name))
        n = m.num_params()
        assert lo < n < hi, (name, n)
        for d in (m.config.d_model, m.config.ffn_hidden):
            assert d % 128 == 0  # every recipe's block size tiles the GEMM dims


def test_blocks_are_lowbit_modules():
    m = GPT(config_from_preset("tiny"))
    blk = m.blocks[0]
    assert isinstance(blk.qkv, lowbit.nn.LayerNormLinear)
    assert isinstance(blk.proj, lowbit.nn.Linear)
    assert isinstance(blk.mlp, lowbit.nn.LayerNormMLP)
    assert m.head.weight is m.wte.weight  # tied by default
    assert blk.qkv.lowbit_name == "blocks.0.qkv"


@pytest.mark.parametrize("pos, mlp, norm, tie", [("rope", "swiglu", "RMSNorm", True), ("learned", "gelu", "LayerNorm",
                                                                                       False)])
def test_variants_forward_backward(pos, mlp, norm, tie):
    torch.manual_seed(0)
    m = GPT(config_from_preset("tiny", pos=pos, mlp=mlp, norm=norm, tie_weights=tie))
    x = torch.randint(0, 256, (2, 32))
    logits, loss = m(x, x)
    assert logits.shape == (2, 32, 256) and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in m.parameters())
    with lowbit.autocast(recipe=lowbit.recipes.from_name("fp8-block")):
        qlogits, _ = m(x, x)
    # the quantized forward tracks the high-precision one (the loss at init is too flat to tell): logits SQNR
    # measured 28.8-29.1 dB on these two variants -> floor 25 dB
    err = (qlogits.detach().double() - logits.detach().double()).pow(2).sum()
    assert 10 * torch.log10(logits.detach().double().pow(2).sum() / err) > 25


def test_bad_config():
    with pytest.raises(ValueError, match="d_model: must be divisible by n_head"):
        GPTConfig(d_model=100, n_head=3)
    with pytest.raises(ValueError, match="mlp: expected one of"):
        config_from_preset("tiny", mlp="relu")
    with pytest.raises(ValueError, match="model: unknown preset 'huge'"):
        config_from_preset("huge")
    m = GPT(config_from_preset("tiny", max_seq_len=16))
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len 16"):
        m(torch.zeros(1, 17, dtype=torch.long))


def test_attention_swap_matches_sdpa():
    """The model's attention is its own attribute: two models, one on SDPA and one on lowbit.attention, give the same
    16-bit math; a bad choice is a ValueError naming the field."""
    torch.manual_seed(0)
    m = GPT(config_from_preset("tiny"))
    x = torch.randint(0, 256, (2, 64))
    assert m.attention == AttentionChoice() and m.attention.runs == "sdpa"
    ref, _ = m(x)
    other = GPT(config_from_preset("tiny"), attention=AttentionChoice("lowbit"))
    other.load_state_dict(m.state_dict())
    assert other.attention.runs == "lowbit" and m.attention.runs == "sdpa"  # (no state shared between models)
    got, _ = other(x)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert gpt_mod.attention_backend("auto", "int8", "fp8") == "lowbit"
    with pytest.raises(ValueError, match="'sdpa' cannot run quantized attention"):
        AttentionChoice("sdpa", qk="int8")
    with pytest.raises(ValueError, match="backend: expected one of .*, got 'flash'"):
        AttentionChoice("flash")
    with pytest.raises(ValueError, match="qk: expected 'bf16', 'int8' or 'fp8', got 'int4'"):
        AttentionChoice("lowbit", qk="int4")
    with pytest.raises(ValueError, match="pv: expected 'bf16' or 'fp8', got 'fp4'"):
        AttentionChoice(pv="fp4")


def test_using_attention_restores_the_choice():
    m = GPT(config_from_preset("tiny"))
    with pytest.raises(RuntimeError), m.using_attention(AttentionChoice("lowbit", "int8", "fp8")):
        assert m.attention.runs == "lowbit"
        raise RuntimeError
    assert m.attention == AttentionChoice()
    with pytest.raises(TypeError, match="attention: expected an AttentionChoice, got tuple"):
        with m.using_attention(("lowbit", "int8", "fp8")):
            pass
    assert m.attention == AttentionChoice()
