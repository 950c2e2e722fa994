"""A memory sanity check before a training run: refuse ``--seq-len`` / ``--batch-size`` whose activations alone
cannot fit the device, instead of growing for minutes and then dying (or swapping the machine to a halt)."""

from __future__ import annotations

import os

import torch

from ..models.gpt import attention_backend, config_from_preset
from ..runtime.device import memory_bytes

__all__ = ["activation_bytes", "device_memory_bytes", "check_activation_budget", "ACT_VALUES_PER_DIM"]

ACT_VALUES_PER_DIM = 16
"""Values kept for the backward per token, per layer, per unit of ``d_model`` (norm inputs, QKV, attention output,
projection, the MLP's hidden activations at ~3x ``d_model``...): a deliberately low round number, so a refusal is
never a false alarm."""


def activation_bytes(model: str, batch_size: int, seq_len: int, *, device: str = "cpu", bf16: bool = False,
                     attention: str = "auto", attn_qk: str = "bf16", attn_pv: str = "bf16") -> int:
    """Estimated bytes of activations one micro-batch keeps for its backward (gradient accumulation does not add:
    each micro-batch's backward frees its own). With ``L`` layers, ``B`` batch, ``T`` sequence length, ``D`` d_model,
    ``H`` heads, ``V`` vocabulary and ``e`` bytes per element (2 under bf16 autocast, else 4)::

        L * B * T * D * 16 * e          # the blocks (ACT_VALUES_PER_DIM = 16 values per token and unit of D)
      + B * T * V * 4 * 3               # FP32 logits, their log-softmax and its gradient
      + L * B * H * T**2 * 4 * 3        # only on CPU with lowbit.attention (its pure-torch reference
                                        # materializes scores, probabilities and their gradient in FP32)

    SDPA (torch's fused CPU and CUDA kernels) and lowbit's CUDA attention kernels keep no ``T**2`` tensor.
    Weights, gradients and optimizer state are not counted: the estimate is a lower bound of the run's memory.
    """
    cfg = config_from_preset(model)
    L, D, H, V = cfg.n_layer, cfg.d_model, cfg.n_head, cfg.vocab_size
    B, T = int(batch_size), int(seq_len)
    e = 2 if bf16 else 4
    total = L * B * T * D * ACT_VALUES_PER_DIM * e + B * T * V * 4 * 3
    if device == "cpu" and attention_backend(attention, attn_qk, attn_pv) == "lowbit":
        total += L * B * H * T * T * 4 * 3
    return total


def device_memory_bytes(device: str) -> int | None:
    """Total memory of ``device`` ("cpu" or "cuda"): the GPU's (this process's local rank under torchrun), or the
    machine's physical memory; ``None`` where it cannot be read."""
    if device == "cuda":
        idx = int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count())
        return memory_bytes(torch.device("cuda", idx))
    return memory_bytes("cpu")


def check_activation_budget(config) -> int:
    """Raise a ValueError when the activations of ``config`` (a :class:`lowbit.train.loop.TrainConfig`; unset
    fields take the preset's defaults) exceed the memory of the device it runs on; returns the estimate (bytes)."""
    c = config.resolved()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if c.device == "auto" else c.device
    bf16 = c.dtype == "bf16" or (c.dtype == "auto" and device == "cuda")
    need = activation_bytes(c.model, c.batch_size, c.seq_len, device=device, bf16=bf16, attention=c.attention,
                            attn_qk=c.attn_qk, attn_pv=c.attn_pv)
    have = device_memory_bytes(device)
    if have is not None and need > have:
        raise ValueError(f"--seq-len {c.seq_len} x --batch-size {c.batch_size} needs ~{need / 2**30:,.1f} GiB of "
                         f"activations ({c.model} on {device}); the device has {have / 2**30:,.1f} GiB: lower "
                         "--seq-len or --batch-size (--grad-accum keeps the tokens per step)")
    return need
