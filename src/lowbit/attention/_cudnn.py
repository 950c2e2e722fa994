"""cuDNN's fused attention, reached through torch's SDPA operators ``aten::_scaled_dot_product_cudnn_attention`` and
``aten::_scaled_dot_product_cudnn_attention_backward`` (the one module that calls them): its forward with the LSE,
and its backward from any forward's O and LSE.

The backward needs only the forward's output and its natural-log LSE, which lowbit's forwards compute with the same
values as cuDNN's, so it runs after lowbit's 16-bit forward as well as after cuDNN's. torch's dense path takes:
(B, H, S, D) views of any strides with a unit last stride (lowbit passes those dense in bhsd or bshd memory order as
they are; O, dQ, dK, dV come back in their inputs' memory order, and dO must be in O's), the LSE as (B, H, Sq, 1) FP32,
no bias, no cumulative lengths (dense), and a Philox seed and offset it reads only with dropout. ``is_causal`` is
top-left aligned there, bottom-right in lowbit: the two agree where Sq == Sk.

:func:`cudnn_decline` says why a call's math is not cuDNN's (argument, rule, value) or None where it is;
:func:`cudnn_runtime_decline` why lowbit does not pick cuDNN by default on this machine (as torch's own SDPA
priority, it prefers cuDNN's attention on compute capability 9.x / 10.x with cuDNN newer than 9.15).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..runtime.device import capability
from .reference import causal_window, to_bhsd

__all__ = ["CUDNN_MAX_HEAD_DIM", "CUDNN_MAX_BATCH_HEADS", "CUDNN_MIN_VERSION", "cudnn_decline", "cudnn_runtime_decline",
           "cudnn_inputs", "cudnn_forward", "cudnn_backward"]

CUDNN_MAX_HEAD_DIM = 128
"""Largest head dim lowbit sends to cuDNN (torch's cuDNN SDPA: a multiple of 8, at most 128 for the backward on every
cuDNN 9 release it supports)."""
CUDNN_MAX_BATCH_HEADS = 65535
"""Largest batch size and head count cuDNN's attention takes (torch's check_cudnn_tensor_shapes)."""
CUDNN_MIN_VERSION = 91500
"""cuDNN versions above this one are lowbit's default for the backward (torch's ``check_prefer_cudnn_attention``:
older releases mishandle query lengths that are not a multiple of 128)."""


def cudnn_decline(*, device_type: str, dtype: torch.dtype, batch: int, heads_q: int, heads_kv: int, seqlen_q: int,
                  seqlen_k: int, head_dim: int, causal: bool = False, window=None, varlen: bool = False,
                  dropout_p: float = 0.0, grad_format: Optional[str] = None,
                  grad_dtype: Optional[torch.dtype] = None, config=None) -> Optional[str]:
    """Why cuDNN's attention does not compute this call's math, naming the argument, the rule and the value; None
    where it does: CUDA, float16/bfloat16, dense (no ``cu_seqlens``), no sliding window, causal only with
    ``seqlen_q == seqlen_k`` (lowbit's causal is bottom-right aligned, cuDNN's top-left), no dropout (lowbit's
    Philox mask is its own), gradients in the inputs' dtype (FP8 ``grad_format`` is quantized in lowbit's kernel
    epilogue), no ``config`` (lowbit's tiles), Hq a multiple of Hkv (GQA/MQA: dK, dV come back summed over each group),
    head_dim a multiple of 8 up to
    :data:`CUDNN_MAX_HEAD_DIM`, seqlen_q >= 1, seqlen_k >= 2 and batch, heads up to :data:`CUDNN_MAX_BATCH_HEADS`."""
    if device_type != "cuda":
        return f"the tensors must be on CUDA for cuDNN, got device type {device_type!r}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"the inputs must be float16 or bfloat16 for cuDNN, got {dtype}"
    if varlen:
        return "cu_seqlens_q/cu_seqlens_k must be None for cuDNN (dense inputs only), got packed varlen inputs"
    left, right = causal_window(causal, window)
    if left >= 0 or right > 0:
        return f"window must be None for cuDNN (no sliding window; causal is the only mask), got {tuple(window)}"
    if right == 0 and seqlen_q != seqlen_k:
        return (f"causal needs seqlen_q == seqlen_k for cuDNN (its causal mask is top-left aligned, lowbit's "
                f"bottom-right), got seqlen_q={seqlen_q}, seqlen_k={seqlen_k}")
    if dropout_p > 0.0:
        return f"dropout_p must be 0 for cuDNN (lowbit's Philox dropout mask is its own), got {dropout_p}"
    if grad_format is not None:
        return (f"grad_format must be None for cuDNN (FP8 gradients are quantized in lowbit's kernel epilogue), "
                f"got {grad_format!r}")
    if grad_dtype is not None and grad_dtype != dtype:
        return f"grad_dtype must be None or the inputs' dtype {dtype} for cuDNN, got {grad_dtype}"
    if config is not None:
        return f"config must be None for cuDNN (it sets lowbit's kernel tiles), got {config!r}"
    if heads_kv < 1 or heads_q % heads_kv:
        return f"query heads must be a multiple of the key/value heads for cuDNN, got Hq={heads_q}, Hkv={heads_kv}"
    if head_dim % 8 or head_dim > CUDNN_MAX_HEAD_DIM:
        return f"head_dim must be a multiple of 8 and at most {CUDNN_MAX_HEAD_DIM} for cuDNN, got {head_dim}"
    if seqlen_q < 1 or seqlen_k < 2:
        return f"cuDNN needs seqlen_q >= 1 and seqlen_k >= 2, got seqlen_q={seqlen_q}, seqlen_k={seqlen_k}"
    if not (1 <= batch <= CUDNN_MAX_BATCH_HEADS and 1 <= heads_q <= CUDNN_MAX_BATCH_HEADS):
        return f"cuDNN takes batch and heads in [1, {CUDNN_MAX_BATCH_HEADS}], got batch={batch}, heads={heads_q}"
    return None


@torch.compiler.assume_constant_result
def cudnn_runtime_decline(device: torch.device) -> Optional[str]:
    """Why lowbit does not pick cuDNN's attention by default on CUDA ``device``, or None where it does: torch built
    with cuDNN newer than :data:`CUDNN_MIN_VERSION`, compute capability 9.x or 10.x, cuDNN SDPA left enabled
    (``torch.backends.cuda.enable_cudnn_sdp``), and no strict ``torch.use_deterministic_algorithms`` (torch calls
    cuDNN's attention backward non-deterministic). Under ``torch.compile`` asked once, while tracing."""
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if version is None:
        return "torch was built without cuDNN"
    if version <= CUDNN_MIN_VERSION:
        return f"cuDNN {version} (lowbit prefers cuDNN's attention above {CUDNN_MIN_VERSION}, as torch does)"
    major, minor = capability(device)
    if major not in (9, 10):
        return f"compute capability {major}.{minor} (cuDNN's attention is lowbit's default on 9.x and 10.x)"
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return "cuDNN SDPA is disabled (torch.backends.cuda.enable_cudnn_sdp(False))"
    if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
        return "torch.use_deterministic_algorithms(True): cuDNN's attention backward is not deterministic"
    return None


def _cudnn_order(xb: Tensor) -> bool:
    """Whether the (B, H, S, D) view ``xb`` is dense in bhsd or bshd memory order and 16-byte aligned."""
    return (xb.is_contiguous() or xb.transpose(1, 2).is_contiguous()) and xb.data_ptr() % 16 == 0


def _bhsd(x: Tensor, layout: str) -> Tensor:
    """``x`` in ``layout`` ("bhsd" / "bshd") as a (B, H, S, D) view cuDNN takes: as it is where it is dense in bhsd or
    bshd memory order and aligned (a model's projections hand attention (B, H, S, D) views of (B, S, H, D) tensors),
    else copied: into the dense order of its own strides (``torch.empty_like``, the order its gradient goes back in)
    where that is one of the two, otherwise contiguous in ``layout``."""
    xb = to_bhsd(x, layout)
    if _cudnn_order(xb):
        return xb
    y = torch.empty_like(xb)
    if _cudnn_order(y):
        return y.copy_(xb)
    return to_bhsd(x.contiguous(), layout)


def _back(x: Tensor, layout: str) -> Tensor:
    """A (B, H, S, D) result of cuDNN's in ``layout``, a view in the memory order cuDNN gave it (its O and dQ, dK, dV
    take their inputs' order; ``to_bhsd``'s transpose undoes itself)."""
    return to_bhsd(x, layout)


def cudnn_inputs(*xs: Tensor, layout: str) -> tuple:
    """``xs`` in ``layout`` as cuDNN takes them (as they are where they already are; see ``_bhsd``): for a caller that
    hands the same tensors to :func:`cudnn_forward` and :func:`cudnn_backward`, so any copy is made once."""
    return tuple(_back(_bhsd(x, layout), layout) for x in xs)


def cudnn_forward(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, softmax_scale: float, layout: str):
    """cuDNN's attention forward with its LSE (the call must pass :func:`cudnn_decline`): (out in q's layout and memory
    order; LSE FP32 natural log (B, H, Sq), a view of cuDNN's (B, H, Sq, 1))."""
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        _bhsd(q, layout), _bhsd(k, layout), _bhsd(v, layout), None, True, 0.0, bool(causal), False,
        scale=float(softmax_scale))[:2]
    return _back(out, layout), lse.squeeze(-1)


def cudnn_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, *, causal: bool,
                   softmax_scale: float, layout: str):
    """cuDNN's attention backward from the forward's ``o`` and FP32 natural-log ``lse`` (B, H, Sq) (the call must
    pass :func:`cudnn_decline`): (dq, dk, dv) in ``layout``, each in its input's memory order, in q's dtype. cuDNN reads
    dO in O's memory order: a dO in another is copied into it."""
    qb, kb, vb, ob = (_bhsd(x, layout) for x in (q, k, v, o))
    dob = to_bhsd(do, layout)
    if dob.stride() != ob.stride():
        dob = torch.empty_like(ob).copy_(dob)
    unused = torch.empty((), dtype=torch.int64, device=q.device)  # (the Philox seed and offset: read with dropout)
    grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dob, qb, kb, vb, ob, lse.contiguous().unsqueeze(-1), unused, unused, None, None, None, qb.shape[2],
        kb.shape[2], 0.0, bool(causal), scale=float(softmax_scale))
    return tuple(_back(g, layout) for g in grads)
