"""lowbit in HF Trainer's loop, as the GUIDE gives it: a converted tiny random-init Llama trained by a
``transformers.Trainer`` whose ``compute_loss`` runs inside ``lowbit.autocast`` (the backward after it, as in a loop
written by hand). The quantized layers run (one outermost autocast exit a micro-batch), the logged losses are finite
and differ from the same Trainer without lowbit by the quantization's error only (under 5e-3 relative; they measure
2-4e-4 here): without the autocast a converted model computes exactly what torch does, so equal losses would mean
lowbit never ran."""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # (Trainer needs it)

import lowbit  # noqa: E402
from lowbit.nn.state import step as autocast_steps  # noqa: E402

CFG = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2)


def _data():
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": r, "labels": r} for r in torch.randint(256, (8, 64), generator=g)]


def _train(tmp_path, recipe, accum=1):
    """(logged losses, outermost lowbit.autocast exits during training) of a 3-step Trainer run."""
    from transformers import Trainer

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG))
    cls = Trainer
    if recipe is not None:
        lowbit.convert(model)  # (before the Trainer: it builds the optimizer over the converted model's parameters)

        class LowbitTrainer(Trainer):
            def compute_loss(self, model, inputs, *args, **kwargs):
                with lowbit.autocast(recipe=recipe):
                    return super().compute_loss(model, inputs, *args, **kwargs)

        cls = LowbitTrainer
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=accum, max_steps=3,
        learning_rate=1e-3, lr_scheduler_type="constant", report_to=[], use_cpu=True, save_strategy="no",
        logging_steps=1, seed=0, disable_tqdm=True)
    trainer = cls(model=model, args=args, train_dataset=_data())
    before = autocast_steps()
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], autocast_steps() - before


@pytest.mark.parametrize("accum", [1, 2])
def test_trainer_with_lowbit_autocast(tmp_path, accum):
    recipe = lowbit.recipes.from_name("fp8-block")
    quant, exits = _train(tmp_path / "lowbit", recipe, accum)
    plain, none = _train(tmp_path / "plain", None, accum)
    assert exits == 3 * accum and none == 0
    assert len(quant) == len(plain) == 3 and all(math.isfinite(v) for v in quant)
    assert quant != plain
    assert max(abs(a - b) / abs(b) for a, b in zip(quant, plain)) < 5e-3, (quant, plain)
