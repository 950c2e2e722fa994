"""Serving attention calls made outside lowbit: the settings (:class:`AttentionConfig`), which calls lowbit takes
(:meth:`AttentionConfig.decline_reason`) and the count of what it served and what it passed on (:class:`CallStats`).

Used by :func:`lowbit.attention.sdpa_override` (calls to ``torch.nn.functional.scaled_dot_product_attention``) and
by :mod:`lowbit.integrations.transformers` (HF transformers' attention interface).
"""
from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import torch

from ..runtime.checks import check_bool
from ..runtime.device import triton_installed
from ..runtime.log import declined
from ._checks import QUANT_QK_MIN_HEAD_DIM, TRITON_HEAD_DIMS, triton_ok
from .api import PV_MODES, QK_MODES, resolve_pv, select_backend

__all__ = ["AttentionConfig", "CallStats", "GRANULARITIES", "CONFIG_BACKENDS"]

GRANULARITIES = ("per_block", "per_warp")
"""Scale groups of the INT8 / FP8 Q and K codes: one scale per block of queries / keys, or per warp of queries."""
CONFIG_BACKENDS = (None, "reference", "triton")
"""``AttentionConfig.backend`` values: lowbit's own choice, the pure-torch reference, the Triton kernels."""


@dataclass(frozen=True)
class AttentionConfig:
    """How lowbit computes the attention calls it serves for another library. Frozen: a served call's numerics are
    those of the config object it was given, never of a setting changed elsewhere.

    The fields are :func:`lowbit.attention.attention`'s arguments of the same names (docs/GUIDE.md §3d)."""

    qk: str = "int8"
    """Q·Kᵀ arithmetic: ``"int8"`` (INT8 codes, per-block or per-warp scales, K smoothed; SageAttention's scheme),
    ``"fp8"`` (E4M3 codes, the same scales), or ``"bf16"`` / ``"fp16"`` (the inputs' own 16-bit dtype; on the CPU,
    float32 inputs then run the exact FP32 reference)."""
    pv: str = "auto"
    """P·V arithmetic: ``"auto"`` (lowbit's default for ``qk``), ``"fp16"``, ``"bf16"`` or ``"fp8"`` (E4M3 P and
    per-channel-scaled E4M3 V); see :func:`lowbit.attention.api.resolve_pv`."""
    granularity: str = "per_block"
    """Scale groups of quantized Q (``"per_block"``: one scale per 128 queries; ``"per_warp"``: per 32)."""
    smooth_k: bool = True
    """Subtract the mean of K over the sequence before quantizing it (softmax-invariant; keeps INT8 K accurate)."""
    backend: Optional[str] = None
    """None: lowbit picks (Triton kernels on CUDA, the reference on the CPU); ``"reference"``: the pure-torch
    reference anywhere (slow: it materializes the scores); ``"triton"``: the Triton kernels."""

    def __post_init__(self):
        for name, value, allowed in (("qk", self.qk, QK_MODES), ("pv", self.pv, PV_MODES),
                                     ("granularity", self.granularity, GRANULARITIES),
                                     ("backend", self.backend, CONFIG_BACKENDS)):
            if value not in allowed:
                raise ValueError(f"AttentionConfig.{name} must be one of {allowed}, got {value!r}")
        check_bool("AttentionConfig.smooth_k", self.smooth_k)

    def attention_kwargs(self) -> dict:
        """The keyword arguments of :func:`lowbit.attention.attention` this config sets."""
        return dict(qk=self.qk, pv=self.pv, granularity=self.granularity, smooth_k=self.smooth_k,
                    backend=self.backend)

    def decline_reason(self, q, k, v, *, dropout_p: float = 0.0, varlen: bool = False,
                       window=None) -> Optional[str]:
        """Why lowbit should not serve attention on these (B, H, S, D) inputs under this config, or None where it
        serves them: devices other than CUDA and the CPU; dtypes its kernels do not take (float32 on CUDA: the FP32
        reference there would materialize the scores); head dims the Triton kernels do not compile for; dropout
        with quantized arithmetic (lowbit's dropout runs 16-bit attention only)."""
        dev = q.device
        if dev.type not in ("cuda", "cpu"):
            return f"device type {dev.type!r} (lowbit serves CUDA and the CPU)"
        if any(t.dtype != q.dtype for t in (k, v)):
            return f"mixed dtypes q {q.dtype}, k {k.dtype}, v {v.dtype}"
        if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"dtype {q.dtype} (lowbit takes float16 / bfloat16, float32 on the CPU)"
        if dev.type == "cuda" and q.dtype == torch.float32 and self.backend != "reference":
            return "float32 inputs on CUDA (lowbit's kernels take float16 / bfloat16)"
        if dropout_p > 0.0 and (self.qk in ("int8", "fp8") or resolve_pv(self.pv, self.qk, q.dtype) != "native"):
            return (f"dropout_p={dropout_p} with quantized attention (qk={self.qk!r}, pv={self.pv!r}): lowbit's "
                    f"dropout runs 16-bit attention only")
        be = select_backend(dev, self.qk, self.pv, varlen=varlen, window=window, return_lse=False,
                            backend=self.backend, dtype=q.dtype)
        if be == "triton":
            d = q.shape[-1]
            if d not in TRITON_HEAD_DIMS:
                return f"head_dim {d} (the Triton kernels take {TRITON_HEAD_DIMS})"
            if self.qk in ("int8", "fp8") and d < QUANT_QK_MIN_HEAD_DIM:
                return f"head_dim {d} with qk={self.qk!r} (8-bit Q·K^T needs head_dim >= {QUANT_QK_MIN_HEAD_DIM})"
            if not triton_ok(q):
                return f"backend 'triton' on device type {dev.type!r}"
            if not triton_installed():
                return "backend 'triton' without the triton package (pip install lowbit[gpu])"
        return None


class CallStats:
    """Counts of the calls a lowbit client was offered: ``served`` (computed by lowbit) and ``fallbacks`` (a
    Counter of reasons; those calls went to the library's own implementation). Each reason is also reported once
    through ``lowbit.runtime.log.declined(path, reason)`` (``LOWBIT_LOG=debug`` prints it). Updates are locked:
    one object may count calls from several threads. Calls made while ``torch.compile`` traces are not counted."""

    def __init__(self, path: str):
        self.path = path
        """The name under which fallbacks are logged."""
        self.served = 0
        self.fallbacks: Counter = Counter()
        self._lock = threading.Lock()

    @property
    def calls(self) -> int:
        """Every call counted: served plus fallbacks."""
        with self._lock:
            return self.served + sum(self.fallbacks.values())

    def record_served(self) -> None:
        if torch.compiler.is_compiling():
            return
        with self._lock:
            self.served += 1

    def record_fallback(self, reason: str) -> None:
        """Count a call passed on for ``reason`` (logged the first time it is seen)."""
        if torch.compiler.is_compiling():
            return
        with self._lock:
            self.fallbacks[reason] += 1
        declined(self.path, reason)

    def reset(self) -> None:
        with self._lock:
            self.served = 0
            self.fallbacks.clear()

    def __repr__(self) -> str:
        with self._lock:
            return f"CallStats({self.path!r}, served={self.served}, fallbacks={dict(self.fallbacks)})"
