"""A real client: lowbit.convert on a HuggingFace transformers Llama (random init, nothing downloaded)."""

import pytest
import torch

import lowbit

transformers = pytest.importorskip("transformers")


def test_llama_converted_fp8_block_trains():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    recipe = lowbit.recipes.from_name("fp8-block")
    summary = lowbit.convert(model, recipe=recipe)
    converted = [n for n, _ in summary.converted]
    assert len(converted) == 2 * 7, summary  # q, k, v, o, gate, up, down per layer
    assert not any("lm_head" in n for n in converted)
    assert isinstance(model.model.layers[0].self_attn.q_proj, lowbit.nn.Linear)

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    # a learnable task: repeat a short random pattern
    pattern = torch.randint(0, 256, (8, 16), generator=g)
    ids = pattern.repeat(1, 4)
    losses = []
    for _ in range(8):
        with lowbit.autocast(recipe=recipe):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 1.0, losses
    assert not lowbit.nn.nonfinite_events()
