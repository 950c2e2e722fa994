"""lowbit.nn: autocast, the quantized drop-in modules, convert() and the NaN sentry (NUMERICS §6).

* :func:`autocast` — the recipe context (nested, exception safe; amax reduction and delayed-scaling
  update at the outermost exit).
* :class:`MultiheadAttention` — (norm →) QKV projection → :func:`lowbit.attention` → output projection.
* :class:`Linear`, :class:`LayerNormLinear`, :class:`LayerNormMLP` — fprop, dgrad and wgrad quantized
  per the recipe inside autocast; bit-identical to their torch counterparts outside.
* :func:`convert` — swap a model's ``nn.Linear`` layers in place (and transformers' ``Conv1D`` for
  :class:`Conv1DLinear`; with ``fuse_mlp``, HF gated MLPs for :class:`SwiGLUMLP`, their RMSNorm moved in and a
  :class:`DeferredRMSNorm` in its place; with ``fuse_qkv``, HF attentions' q/k/v projections for one
  :class:`QKVLinear` and its :class:`QKVPart` s).
* :func:`fp8_all_gather` — FSDP2 gathers the FP8 copies of lowbit weights instead of their high-precision shards.
* :func:`bf16_all_gather` — FSDP2 gathers lowbit weights in BF16 for a BF16-autocast forward (no recipe).
* :class:`NonFiniteAmaxError`, :func:`nonfinite_events` — the NaN sentry.
"""

from .attention import MultiheadAttention
from .base import LowbitModule, cached_weights, name_modules
from .convert import ConvertSummary, convert
from .fsdp import bf16_all_gather, fp8_all_gather
from .functional import quantized_linear
from .hf_modules import Conv1DLinear, DeferredRMSNorm, QKVLinear, QKVPart, SwiGLUMLP
from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .linear import Linear
from .state import (
    AutocastState,
    NonFiniteAmaxError,
    NonFiniteEvent,
    autocast,
    check_nonfinite,
    check_recipe_support,
    get_recipe,
    get_state,
    is_enabled,
    nonfinite_events,
)

__all__ = [
    "autocast",
    "AutocastState",
    "get_state",
    "get_recipe",
    "is_enabled",
    "check_recipe_support",
    "Linear",
    "LayerNormLinear",
    "LayerNormMLP",
    "Conv1DLinear",
    "SwiGLUMLP",
    "QKVLinear",
    "QKVPart",
    "DeferredRMSNorm",
    "MultiheadAttention",
    "LowbitModule",
    "name_modules",
    "cached_weights",
    "convert",
    "ConvertSummary",
    "quantized_linear",
    "fp8_all_gather",
    "bf16_all_gather",
    "NonFiniteAmaxError",
    "NonFiniteEvent",
    "nonfinite_events",
    "check_nonfinite",
]
