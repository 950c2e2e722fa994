"""``sdpa_override``: serve ``torch.nn.functional.scaled_dot_product_attention`` calls with lowbit attention.

For code that calls ``F.scaled_dot_product_attention`` itself (diffusers pipelines, timm, custom models,
``torch.nn.MultiheadAttention``)::

    with lowbit.attention.sdpa_override(qk="int8", pv="fp8") as stats:
        images = pipe(prompt)
    print(stats.served, stats.fallbacks)        # fallbacks: Counter of reasons

How it works: while at least one override is active, the attribute ``torch.nn.functional.scaled_dot_product_attention``
is a lowbit function; when the last one exits (normally or by an exception) torch's function is put back. A call
that lowbit supports runs :func:`lowbit.attention.attention` with the override's :class:`AttentionConfig`; any other
call goes to torch's function with exactly the arguments it was given, and its reason is counted.

Served: 4-D (B, H, S, D) query, key and value with one batch size and one head dim, ``attn_mask`` None or a
``torch.nn.attention.bias.CausalBias`` lower-right (upper-left where L == S), ``is_causal`` where L == S (torch
aligns the causal mask top-left, lowbit bottom-right: they agree only there), GQA with ``enable_gqa=True``, a
positive ``scale``, and what :meth:`AttentionConfig.decline_reason` accepts (CUDA float16 / bfloat16 with a head dim
the Triton kernels take, or the CPU, where the reference runs; dropout only with 16-bit arithmetic).
Passed to torch: explicit mask tensors, other shapes, dtypes, head dims and devices, dropout with quantized
arithmetic, and calls made while ``torch.compile`` traces (not counted there).

Threads: an override serves the calls made on the thread that entered it; other threads' calls go straight to torch.
Overrides nest (the innermost active one on a thread serves its calls) and may be entered on several threads at once;
entering and leaving are locked. The patch itself is process-wide, so a library that binds
``scaled_dot_product_attention`` by name before the override (``from torch.nn.functional import
scaled_dot_product_attention``) keeps torch's function, and one that patches the same attribute while an override is
active should be undone before the override exits.
"""
from __future__ import annotations

import functools
import math
import threading
from typing import Optional

import torch
import torch.nn.functional as F

from .api import attention
from .config import AttentionConfig, CallStats

__all__ = ["sdpa_override", "SDPAOverride"]

_lock = threading.Lock()
_local = threading.local()  # .stack: the overrides this thread entered and has not left; .busy: inside lowbit
_active = 0  # overrides entered and not left, all threads
_torch_sdpa = None  # torch's function, as found when the first override patched it
_patched = None  # the function the override installs


class SDPAOverride:
    """The context manager :func:`sdpa_override` returns; entering it returns its :class:`CallStats` (``served``,
    ``fallbacks``), which keep counting across re-entries of this object."""

    def __init__(self, config: AttentionConfig):
        if not isinstance(config, AttentionConfig):
            raise TypeError(f"config must be a lowbit.attention.AttentionConfig, got {type(config).__name__}")
        self.config = config
        self.stats = CallStats("attention.sdpa_override")
        self._entries: list = []  # the thread stacks this object was pushed on, innermost last

    def __enter__(self) -> CallStats:
        _install()
        stack = _thread_stack()
        stack.append(self)
        with _lock:
            self._entries.append(stack)
        return self.stats

    def __exit__(self, *exc) -> None:
        with _lock:  # this thread's entry, else (left on another thread) the latest one
            here = _thread_stack()
            j = next((i for i in range(len(self._entries) - 1, -1, -1) if self._entries[i] is here),
                     len(self._entries) - 1)
            stack = self._entries.pop(j)
        for i in range(len(stack) - 1, -1, -1):  # (not necessarily innermost: remove this entry)
            if stack[i] is self:
                del stack[i]
                break
        _uninstall()

    def __repr__(self) -> str:
        return f"SDPAOverride({self.config!r}, {self.stats!r})"


def sdpa_override(config: Optional[AttentionConfig] = None, **settings) -> SDPAOverride:
    """A context manager that serves supported ``torch.nn.functional.scaled_dot_product_attention`` calls with
    lowbit attention and passes the rest to torch (module docstring: which calls, threads, nesting).

    ``config``: an :class:`AttentionConfig`; or its fields as keyword arguments (``qk``, ``pv``, ``granularity``,
    ``smooth_k``, ``backend``), e.g. ``sdpa_override(qk="int8", pv="fp8")``. ``with ... as stats``: ``stats.served``,
    ``stats.fallbacks`` (a Counter of reasons), ``stats.calls``."""
    if config is not None and settings:
        raise TypeError(f"sdpa_override: pass an AttentionConfig or its fields, not both (got config and "
                        f"{sorted(settings)})")
    if config is None:
        config = AttentionConfig(**settings)
    return SDPAOverride(config)


def _thread_stack() -> list:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def _install() -> None:
    global _active, _torch_sdpa, _patched
    with _lock:
        if _active == 0:
            current = F.scaled_dot_product_attention
            if _patched is None or current is not _patched:
                _torch_sdpa = current
                _patched = functools.wraps(current)(_dispatch)
            F.scaled_dot_product_attention = _patched
        _active += 1


def _uninstall() -> None:
    global _active
    with _lock:
        _active -= 1
        if _active == 0 and F.scaled_dot_product_attention is _patched:
            F.scaled_dot_product_attention = _torch_sdpa


def _dispatch(*args, **kwargs):
    """The installed ``scaled_dot_product_attention``."""
    if torch.compiler.is_compiling():
        return _torch_fallback(args, kwargs)
    stack = getattr(_local, "stack", None)
    if not stack or getattr(_local, "busy", False):  # no override on this thread; lowbit's own SDPA calls
        return _torch_fallback(args, kwargs)
    ov = stack[-1]
    try:
        call = _parse(*args, **kwargs)
    except TypeError:
        call = "arguments torch's signature does not bind"
    if isinstance(call, str):
        reason = call
    else:
        reason = ov.config.decline_reason(call["q"], call["k"], call["v"], dropout_p=call["dropout_p"])
    if reason is None:
        _local.busy = True
        try:
            out = attention(call["q"], call["k"], call["v"], causal=call["causal"], softmax_scale=call["scale"],
                            dropout_p=call["dropout_p"], **ov.config.attention_kwargs())
        except NotImplementedError as e:
            reason = f"lowbit: {e}"
        finally:
            _local.busy = False
        if reason is None:
            ov.stats.record_served()
            return out
    ov.stats.record_fallback(reason)
    return _torch_fallback(args, kwargs)


def _torch_fallback(args: tuple, kwargs: dict):
    """torch's SDPA for a call lowbit does not serve. A ``CausalBias`` mask goes to its own ``__torch_function__``
    under the name torch compares the call against (the installed function): handed torch's builtin instead, it does
    not recognize the call, and torch would read the bias object's uninitialized memory as a dense mask. Its inner
    SDPA call reaches torch directly (the thread is marked busy)."""
    from torch.nn.attention.bias import CausalBias

    mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
    if not isinstance(mask, CausalBias):
        return _torch_sdpa(*args, **kwargs)
    busy = getattr(_local, "busy", False)
    _local.busy = True
    try:
        return type(mask).__torch_function__(F.scaled_dot_product_attention, (type(mask),), args, kwargs)
    finally:
        _local.busy = busy


def _parse(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """The lowbit call for torch's arguments (dict q, k, v, causal, scale, dropout_p), or why there is none."""
    if not all(isinstance(t, torch.Tensor) for t in (query, key, value)):
        return "query/key/value not all tensors"
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "inputs not 4-D (B, H, S, D)"
    (b, hq, sq, d), (bk, hk, sk, dk), (bv, hv, sv, dv) = query.shape, key.shape, value.shape
    if not b == bk == bv:
        return "batch sizes differ (broadcast batch)"
    if hk != hv or sk != sv:
        return "key and value shapes differ"
    if not d == dk == dv:
        return "head dims differ (value's from query's)"
    if hq != hk and (enable_gqa is not True or hq % hk):
        return "query heads not a multiple of key/value heads with enable_gqa=True"
    if query.numel() == 0 or key.numel() == 0:
        return "empty inputs"
    if not isinstance(is_causal, bool):
        return "is_causal not a bool"
    causal = is_causal
    if attn_mask is not None:
        from torch.nn.attention.bias import CausalBias, CausalVariant

        if is_causal or not isinstance(attn_mask, CausalBias):
            return "attn_mask given (lowbit takes is_causal or a CausalBias)"
        if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (sq, sk):
            return "CausalBias sized for other sequence lengths"
        if attn_mask.variant != CausalVariant.LOWER_RIGHT and sq != sk:
            return "upper-left CausalBias with L != S (lowbit's causal mask is lower-right)"
        causal = True
    elif is_causal and sq != sk:
        return "is_causal with L != S (torch aligns it top-left, lowbit bottom-right)"
    if causal and sq > sk:
        return "causal with L > S (query rows that see no key)"
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not (math.isfinite(scale) and scale > 0)):
        return "scale not a positive finite number"
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        return "dropout_p not in [0, 1)"
    return dict(q=query, k=key, v=value, causal=causal, scale=None if scale is None else float(scale),
                dropout_p=float(dropout_p))
