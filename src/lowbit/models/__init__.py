"""Reference models: :class:`GPT` (used by ``lowbit train`` / ``lowbit demo`` and the tests)."""

from .gpt import (
    GPT,
    PRESETS,
    AttentionChoice,
    GPTConfig,
    attend,
    attention_backend,
    config_from_preset,
)

__all__ = ["GPT", "GPTConfig", "PRESETS", "config_from_preset", "attend", "AttentionChoice", "attention_backend"]
