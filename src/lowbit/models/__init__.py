"""Reference models: :class:`GPT` (used by ``lowbit train`` / ``lowbit demo`` and the tests)."""

from .gpt import (
    GPT,
    PRESETS,
    GPTConfig,
    attend,
    attention_backend,
    config_from_preset,
    set_attention,
    using_attention,
)

__all__ = ["GPT", "GPTConfig", "PRESETS", "config_from_preset", "attend", "attention_backend", "set_attention",
           "using_attention"]
