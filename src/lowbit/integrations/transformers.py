"""lowbit attention in HF transformers models: ``attn_implementation="lowbit"``.

::

    import lowbit.integrations.transformers as lbt
    from transformers import AutoModelForCausalLM

    lbt.register(lbt.AttentionConfig(qk="int8", pv="fp8"))              # the name "lowbit"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="lowbit")
    # or, per model: lbt.use(model, lbt.AttentionConfig(qk="int8", pv="fp16"))
    print(lbt.stats())                                                  # served calls, fallbacks and why

:func:`register` adds an attention function and its mask function (transformers' SDPA mask) to transformers'
``AttentionInterface`` / ``AttentionMaskInterface`` under a name, bound to one frozen :class:`AttentionConfig`: a
name never changes its numerics unless ``register(..., replace=True)`` says so. Works with the models that call
attention through that interface (Llama, Mistral, Qwen2/Qwen3, Gemma/Gemma2/Gemma3, ...).

What lowbit computes (:func:`lowbit.attention.attention`, GQA native, no K/V repeat):

* prefill / training without padding (no mask, q_len == kv_len): dense causal attention, with the layer's sliding
  window where it has one; modules with ``is_causal=False`` (encoders, cross-attention, any q_len > 1): full attention;
* padded batches: the boolean mask transformers builds is checked to be causal attention over each row's valid
  tokens (key padding only, where not causal), those tokens are packed and lowbit's varlen path runs (cu_seqlens);
  causal: padded query rows are zeros in the output (they never reach a valid token).

What goes to transformers' SDPA function (and is counted, and logged once per reason by
``lowbit.runtime.log.declined``): decode steps (q_len 1) and causal calls with q_len != kv_len (a KV cache: chunked
prefill, static caches); masks that are not causal + padding / key padding (packed sequences, custom or per-head
masks, float masks), and any mask while ``torch.compile`` traces (reading it would break the graph); calls
:meth:`AttentionConfig.decline_reason` refuses (device, dtype, head dim, dropout with quantized arithmetic);
``position_bias``. Logit soft-capping (``softcap``, Gemma2) runs eager attention (SDPA has none). Attention sinks
(``s_aux``) raise NotImplementedError.

transformers is imported by :func:`register` / :func:`use`, not by importing this module.
"""
from __future__ import annotations

import threading
import weakref
from typing import Optional

import torch
import torch.nn.functional as F

from ..attention import AttentionConfig, CallStats
from ..attention.api import attention as lowbit_attention  # (the function: the package object is not traceable)
from ..attention.reference import visible_mask

__all__ = ["AttentionConfig", "CallStats", "register", "use", "stats", "registered", "implementation_name",
           "attention_function"]

_BUILTIN = ("eager", "sdpa", "flex_attention", "paged|eager")
_lock = threading.Lock()
_registry: dict[str, tuple[AttentionConfig, CallStats]] = {}  # name -> (config, stats): one config per name


def implementation_name(config: Optional[AttentionConfig] = None) -> str:
    """The ``attn_implementation`` name :func:`use` gives ``config``: ``"lowbit"`` for the default config, else
    ``"lowbit-"`` and its settings (``"lowbit-int8-fp8-per_block"``), one name per distinct config."""
    config = _check_config(config)
    if config == AttentionConfig():
        return "lowbit"
    parts = [config.qk, config.pv, config.granularity]
    if not config.smooth_k:
        parts.append("nosmooth")
    if config.backend is not None:
        parts.append(config.backend)
    return "lowbit-" + "-".join(parts)


def register(config: Optional[AttentionConfig] = None, *, name: str = "lowbit", replace: bool = False) -> str:
    """Register lowbit attention with transformers under ``name`` (default ``"lowbit"``) with ``config`` (default
    ``AttentionConfig()``); returns ``name``. Then ``from_pretrained(..., attn_implementation=name)``,
    ``from_config(...)`` or ``model.set_attn_implementation(name)`` use it.

    Registering a name again with an equal config does nothing; with another config it raises ValueError unless
    ``replace=True`` (models already using the name then compute with the new config)."""
    config = _check_config(config)
    if not isinstance(name, str) or not name or name in _BUILTIN or "flash" in name or "/" in name or "|" in name:
        raise ValueError(f"register: name must be a non-empty string other than transformers' own implementations "
                         f"{_BUILTIN}, without 'flash', '/' or '|' (transformers gives those other meanings); "
                         f"got {name!r}")
    if replace.__class__ is not bool:
        raise TypeError(f"register: replace must be a bool, got {type(replace).__name__} {replace!r}")
    attn_interface, mask_interface = _interfaces()
    with _lock:
        old = _registry.get(name)
        if old is not None and old[0] == config:
            return name
        if old is not None and not replace:
            raise ValueError(f"register: {name!r} is registered with {old[0]}; registering it with {config} would "
                             f"change the numerics of every model using it. Pass replace=True, or another name "
                             f"(use(model, config) names each config: {implementation_name(config)!r})")
        if old is None and name in attn_interface and not replace:
            raise ValueError(f"register: transformers already has an attention implementation {name!r} that lowbit "
                             f"did not register; pass replace=True to replace it, or another name")
        st = old[1] if old is not None else CallStats(f"integrations.transformers[{name}]")
        fn = attention_function(config, st, sdpa=attn_interface["sdpa"])
        type(attn_interface).register(name, fn)
        type(mask_interface).register(name, mask_interface["sdpa"])
        _registry[name] = (config, st)
    return name


def use(model, config: Optional[AttentionConfig] = None, *, name: Optional[str] = None) -> str:
    """Register ``config`` (under ``name``, default :func:`implementation_name`) and switch ``model``'s attention to
    it (``model.set_attn_implementation``); returns the name. ``model.set_attn_implementation("sdpa")`` undoes it."""
    config = _check_config(config)
    name = implementation_name(config) if name is None else name
    register(config, name=name)
    if not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"use: model must be a transformers PreTrainedModel (with set_attn_implementation), got "
                        f"{type(model).__name__}")
    model.set_attn_implementation(name)
    return name


def stats(name: str = "lowbit") -> CallStats:
    """The :class:`CallStats` of the implementation registered as ``name``: ``served``, ``fallbacks`` (reasons)."""
    with _lock:
        if name not in _registry:
            raise KeyError(f"stats: no lowbit attention is registered as {name!r} (registered: {sorted(_registry)})")
        return _registry[name][1]


def registered() -> dict[str, AttentionConfig]:
    """{name: config} of every implementation lowbit registered with transformers."""
    with _lock:
        return {n: c for n, (c, _) in _registry.items()}


def _check_config(config) -> AttentionConfig:
    if config is None:
        return AttentionConfig()
    if not isinstance(config, AttentionConfig):
        raise TypeError(f"config must be a lowbit.attention.AttentionConfig (or None), got {type(config).__name__}")
    return config


def _interfaces():
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
    except ImportError as e:
        raise ImportError("lowbit.integrations.transformers needs transformers (pip install transformers) with "
                          "AttentionInterface and AttentionMaskInterface") from e
    return AttentionInterface(), AttentionMaskInterface()


# ----------------------------------------------------------------------------- the attention function
def attention_function(config: AttentionConfig, stats: Optional[CallStats] = None, *, sdpa=None):
    """The function transformers calls, ``fn(module, query, key, value, attention_mask, scaling=None,
    dropout=0.0, **kwargs) -> (attn_output (B, S, Hq, D), None)``, for ``config``; query (B, Hq, S, D), key / value
    (B, Hkv, S_kv, D). ``sdpa``: the function calls lowbit passes on go to (default: transformers' SDPA attention).
    :func:`register` makes and registers it; this is for wiring it yourself."""
    config = _check_config(config)
    st = stats if stats is not None else CallStats("integrations.transformers")
    if sdpa is None:
        sdpa = _interfaces()[0]["sdpa"]

    def lowbit_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if kwargs.get("s_aux") is not None:
            raise NotImplementedError("lowbit attention: attention sinks (s_aux) are not supported; use "
                                      "attn_implementation='eager' for this model")
        plan = _plan(config, module, query, key, value, attention_mask, scaling, dropout, kwargs)
        if isinstance(plan, str):
            st.record_fallback(plan)
            if kwargs.get("softcap") is not None:
                return _eager_softcap(module, query, key, value, attention_mask, scaling, dropout, kwargs)
            return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        out = _run(config, query, key, value, scaling, dropout, plan)
        st.record_served()
        return out, None

    lowbit_attention_forward.config = config
    lowbit_attention_forward.stats = st
    return lowbit_attention_forward


class _Dense:
    def __init__(self, causal, window):
        self.causal, self.window = causal, window


class _Varlen(_Dense):
    """Packed inputs: the query rows ``q_index`` (None: every row) and key rows ``k_index`` of the flattened
    (batch x length) tokens, and their cu_seqlens / max_seqlen."""

    def __init__(self, causal, window, q_index, k_index, cu_q, cu_k, max_q, max_k):
        super().__init__(causal, window)
        self.q_index, self.k_index, self.cu_q, self.cu_k, self.max_q, self.max_k = (q_index, k_index, cu_q, cu_k,
                                                                                    max_q, max_k)


def _plan(config, module, query, key, value, mask, scaling, dropout, kwargs):
    """A ``_Dense`` / ``_Varlen`` plan for a lowbit call, or the reason the call goes to SDPA (eager for softcap)."""
    if kwargs.get("softcap") is not None:
        return "softcap (logit soft-capping): eager attention"
    if kwargs.get("position_bias") is not None:
        return "position_bias (an additive bias)"
    b, _, sq, _ = query.shape
    sk = key.shape[2]
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    if not isinstance(causal, bool):
        return "is_causal not a bool"
    if sq == 1 and sk > 1:
        return "decode step (q_len 1 with a KV cache)"
    if sq != sk and causal:
        return "causal q_len != kv_len (a KV cache: chunked prefill or a static cache)"
    sw = kwargs.get("sliding_window")
    window = None
    if sw is not None and sw < sk:
        if not causal:
            return "sliding window without causal masking"
        window = (int(sw) - 1, 0)  # transformers: key j visible from query i iff j > i - sliding_window
    if mask is None:
        plan = _Dense(causal, window)
    elif torch.compiler.is_compiling():
        return "a mask under torch.compile (reading it would break the graph)"
    else:
        plan = _MASKS.plan(mask, b, sq, sk, causal, window)
        if isinstance(plan, str):
            return plan
    reason = config.decline_reason(query, key, value, dropout_p=float(dropout), varlen=isinstance(plan, _Varlen),
                                   window=window)
    return reason if reason is not None else plan


def _run(config, query, key, value, scaling, dropout, plan):
    kw = dict(causal=plan.causal, softmax_scale=scaling, window=plan.window, dropout_p=float(dropout),
              **config.attention_kwargs())
    if not isinstance(plan, _Varlen):
        return lowbit_attention(query, key, value, **kw).transpose(1, 2).contiguous()
    b, hq, sq, d = query.shape

    def pack(t, index):  # (B, H, S, D) -> (tokens, H, D), the rows ``index`` (None: all)
        t = t.transpose(1, 2).reshape(b * t.shape[2], t.shape[1], d)
        return t if index is None else t.index_select(0, index)

    out = lowbit_attention(pack(query, plan.q_index), pack(key, plan.k_index), pack(value, plan.k_index),
                           cu_seqlens_q=plan.cu_q, cu_seqlens_k=plan.cu_k, max_seqlen_q=plan.max_q,
                           max_seqlen_k=plan.max_k, **kw)
    if plan.q_index is not None:
        out = out.new_zeros(b * sq, hq, d).index_copy(0, plan.q_index, out)
    return out.view(b, sq, hq, d)


class _MaskPlans:
    """The plan of a 4-D boolean mask, kept for the last few masks seen: every layer of a forward gets the same mask
    object, so it is read (one device sync) once per forward, not once per layer."""

    SIZE = 8

    def __init__(self):
        self._lock = threading.Lock()
        self._entries: dict = {}  # id(mask) -> (weakref, version, (batch, sq, sk, causal, window), plan)

    def plan(self, mask, *args):
        version = _version(mask)
        with self._lock:
            hit = self._entries.get(id(mask))
        if hit is not None and hit[0]() is mask and hit[1] == version and version is not None and hit[2] == args:
            return hit[3]
        plan = _mask_plan(mask, *args)
        if version is not None:
            try:
                ref = weakref.ref(mask)
            except TypeError:
                return plan
            with self._lock:
                self._entries[id(mask)] = (ref, version, args, plan)
                while len(self._entries) > self.SIZE:
                    del self._entries[next(iter(self._entries))]
        return plan


def _version(mask):
    try:
        return mask._version
    except (AttributeError, RuntimeError):  # (inference tensors have no version counter: no caching)
        return None


_MASKS = _MaskPlans()


def _mask_plan(mask, batch, sq, sk, causal, window):
    """The plan for transformers' mask ``mask`` (True = attend), else the reason there is none.

    Causal (self-attention, sq == sk): a token is valid where it attends to itself; each valid query row must see
    exactly the causal (and window) pattern over the valid tokens; the valid tokens are packed, padded query rows get
    zeros. Not causal (encoders, cross-attention): every query row must see the same keys (key padding); the valid
    keys are packed, every query row is computed."""
    if not isinstance(mask, torch.Tensor):
        return f"a {type(mask).__name__} mask"
    if mask.dtype != torch.bool:
        return "a float (additive) mask"
    if mask.dim() != 4 or tuple(mask.shape[-2:]) != (sq, sk) or mask.shape[0] not in (1, batch):
        return "a mask not shaped (batch or 1, heads or 1, q_len, kv_len)"
    if mask.shape[1] != 1:
        return "a per-head mask"
    m = mask[:, 0].expand(batch, sq, sk)
    if causal:
        valid = m.diagonal(dim1=-2, dim2=-1)  # (B, S)
        expected = valid[:, None, :] & visible_mask(sq, sk, True, window, device=m.device)
        mismatch = ((m != expected) & valid[:, :, None]).any()
    else:
        valid = m[:, 0]
        mismatch = (m != valid[:, None, :]).any()
    lengths = valid.sum(-1)
    runs = (valid[:, 1:] & ~valid[:, :-1]).sum(-1) + valid[:, 0]  # runs of valid tokens per row
    bad, max_len, min_len, max_runs = torch.stack([mismatch.long(), lengths.max(), lengths.min(), runs.max()]).tolist()
    if bad:
        return ("a mask that is not causal + padding (packed sequences or a custom mask)" if causal else
                "a mask that is not key padding (a custom mask)")
    if min_len == sk:
        return _Dense(causal, window)
    if min_len == 0:
        return "a fully padded sequence"
    if window is not None and max_runs > 1:
        return "padding inside a sequence with a sliding window"
    k_index = valid.reshape(-1).nonzero().squeeze(1)
    cu_k = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    if causal:
        return _Varlen(True, window, k_index, k_index, cu_k, cu_k, int(max_len), int(max_len))
    cu_q = torch.arange(0, (batch + 1) * sq, sq, dtype=torch.int32, device=m.device)
    return _Varlen(False, None, None, k_index, cu_q, cu_k, sq, int(max_len))


def _eager_softcap(module, query, key, value, mask, scaling, dropout, kwargs):
    """Eager attention with logit soft-capping (transformers' Gemma2 eager formula): SDPA has no softcap."""
    softcap = kwargs["softcap"]
    rep = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(rep, dim=1)
    v = value.repeat_interleave(rep, dim=1)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    s = torch.matmul(query, k.transpose(2, 3)) * scale
    s = torch.tanh(s / softcap) * softcap
    sq, sk = s.shape[-2:]
    if mask is not None:
        mask = mask[..., :sk]
        s = s.masked_fill(~mask, torch.finfo(s.dtype).min) if mask.dtype == torch.bool else s + mask
    elif getattr(module, "is_causal", True) and sq > 1:
        s = s.masked_fill(~visible_mask(sq, sk, True, None, device=s.device), torch.finfo(s.dtype).min)
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(query.dtype)
    p = F.dropout(p, p=float(dropout), training=module.training)
    return torch.matmul(p, v).transpose(1, 2).contiguous(), None
