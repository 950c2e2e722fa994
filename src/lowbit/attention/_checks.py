"""Input validation shared by the attention entry points (``api``, ``backward``) and launchers (``_triton``).

Layouts: ``"bhsd"`` = (B, H, S, D), ``"bshd"`` = (B, S, H, D), ``"thd"`` = packed varlen (T, H, D) with
``cu_seqlens_q/k``. Nothing here imports another module of the package.
"""
from __future__ import annotations

import math
import numbers
from typing import Optional

import torch
from torch import Tensor

from ..runtime.checks import check_bool
from ..runtime.device import INTERPRET, TRITON_MISSING, triton_installed

__all__ = [
    "TRITON_HEAD_DIMS",
    "QUANT_QK_MIN_HEAD_DIM",
    "GRAD_FORMATS",
    "check_tensor",
    "check_bool",
    "check_half",
    "layout_of",
    "shape4",
    "lse_shape",
    "check_qkv",
    "views",
    "row_views",
    "check_cu_meta",
    "check_varlen",
    "check_window",
    "check_softmax_scale",
    "check_dropout_p",
    "check_dropout",
    "check_blocks",
    "check_triton",
    "check_triton_installed",
    "triton_ok",
    "check_grad_args",
    "check_grad_sink",
]

TRITON_HEAD_DIMS = (16, 32, 64, 128, 256)
"""Head dims the Triton forward and backward kernels compile for."""
QUANT_QK_MIN_HEAD_DIM = 32
"""Smallest head dim of INT8 / FP8 Q·Kᵀ on the Triton kernel: an 8-bit MMA reduces over K >= 32."""
GRAD_FORMATS = (None, "e4m3", "e5m2")
"""``grad_format`` values of the backward: 16-bit gradients, or FP8 E4M3 / E5M2 ``QuantizedTensor`` s."""


def check_tensor(name, x):
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def check_half(name, x):
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"{name} must be float16 or bfloat16 for this path, got {x.dtype}")


def layout_of(layout, varlen: bool) -> str:
    """The layout of a call: "thd" for varlen (``layout`` None or "thd"), else "bhsd" (None) or "bshd"."""
    if varlen:
        if layout not in (None, "thd"):
            raise ValueError(f"with cu_seqlens the inputs are packed (total, heads, head_dim): layout must be None or "
                             f"'thd', got {layout!r}")
        return "thd"
    if layout is None:
        return "bhsd"
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd' (or None), got {layout!r}")
    return layout


def shape4(name, x, layout):
    """(B, H, S, D) of a dense / packed tensor after checking its rank (B is None for packed)."""
    if layout == "thd":
        if x.dim() != 3:
            raise ValueError(f"{name}: varlen inputs must be 3-D (total, heads, head_dim), got shape {tuple(x.shape)}")
        return None, x.shape[1], x.shape[0], x.shape[2]
    if x.dim() != 4:
        raise ValueError(f"{name} must be 4-D ({layout}), got shape {tuple(x.shape)}")
    if layout == "bhsd":
        return tuple(x.shape)
    b, s, h, d = x.shape
    return b, h, s, d


def lse_shape(q, layout):
    """The shape of the LSE of attention with queries ``q``: (B, Hq, Sq), or (Hq, Tq) for packed ("thd") inputs."""
    b, h, s, _ = shape4("q", q, layout)
    return (h, s) if layout == "thd" else (b, h, s)


def check_qkv(q, k, v, layout):
    """(B, Hq, Sq, Hkv, Sk, D) of q, k, v after checking that their shapes and devices fit together."""
    bq, hq, sq, d = shape4("q", q, layout)
    bk, hk, sk, dk = shape4("k", k, layout)
    bv, hv, sv, dv = shape4("v", v, layout)
    if (bq != bk or bq != bv) and layout != "thd":
        raise ValueError(f"batch sizes differ: q {bq}, k {bk}, v {bv}")
    if dk != d or dv != d:
        raise ValueError(f"head_dim must match: q {d}, k {dk}, v {dv} (different V head dim is not supported)")
    if d < 1:
        raise ValueError(f"q: head_dim must be >= 1, got q shape {tuple(q.shape)} (layout {layout!r})")
    if hk != hv or sk != sv:
        raise ValueError(f"k and v must have the same heads and length: k (H={hk}, S={sk}), v (H={hv}, S={sv})")
    if hk == 0 or hq % hk:
        raise ValueError(f"query heads must be a multiple of key/value heads (GQA/MQA): Hq={hq}, Hkv={hk}")
    if sk < 1:
        raise ValueError(f"k: attention needs at least one key (the softmax over no keys is undefined), got k shape "
                         f"{tuple(k.shape)} (layout {layout!r})")
    for n, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise ValueError(f"{n} is on {t.device} but q is on {q.device}")
    return bq, hq, sq, hk, sk, d


def views(x: Tensor, layout: str, varlen: bool):
    """(stride_b, stride_h, stride_s, stride_d) of a dense bhsd/bshd or packed thd tensor."""
    if varlen:
        return 0, x.stride(1), x.stride(0), x.stride(2)
    if layout == "bhsd":
        return x.stride(0), x.stride(1), x.stride(2), x.stride(3)
    return x.stride(0), x.stride(2), x.stride(1), x.stride(3)


def row_views(x: Tensor, layout: str, varlen: bool):
    """(stride_b, stride_h, stride_s) of a per-row buffer shaped like a gradient without its last dim."""
    if varlen:
        return 0, x.stride(1), x.stride(0)
    if layout == "bhsd":
        return x.stride(0), x.stride(1), x.stride(2)
    return x.stride(0), x.stride(2), x.stride(1)


def check_cu_meta(cu_q, cu_k, q, k):
    """cu_seqlens_q/k given together, 1-D int32 of one length (>= 2), on the tensors' device: no values read."""
    if (cu_q is None) != (cu_k is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together")
    if cu_q is None:
        return
    for n, cu, x in (("cu_seqlens_q", cu_q, q), ("cu_seqlens_k", cu_k, k)):
        check_tensor(n, cu)
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
            raise TypeError(f"{n} must be a 1-D int32 tensor of length batch+1, got dtype {cu.dtype}, "
                            f"shape {tuple(cu.shape)}")
        if cu.device != x.device:
            raise ValueError(f"{n} is on {cu.device} but the tensors are on {x.device}")
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length, got {cu_q.numel()} and "
                         f"{cu_k.numel()}")


def check_varlen(cu_q, cu_k, q, k, max_q, max_k):
    """``check_cu_meta``, then the values (one device sync each on CUDA): (max_seqlen_q, max_seqlen_k), or
    (None, None) for dense inputs. While ``torch.compile`` traces, the values are not read: (max_q, max_k) come
    back as given, and the custom operator that runs the call checks the values when it runs."""
    check_cu_meta(cu_q, cu_k, q, k)
    if cu_q is None:
        return None, None
    for n, m in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
            raise ValueError(f"{n} must be None or an int >= 0, got {m!r}")
    if torch.compiler.is_compiling():
        return max_q, max_k
    cq, ck = cu_q.tolist(), cu_k.tolist()
    lq = [b - a for a, b in zip(cq, cq[1:])]
    lk = [b - a for a, b in zip(ck, ck[1:])]
    if cq[0] != 0 or ck[0] != 0 or min(lq) < 0 or min(lk) < 0:
        raise ValueError("cu_seqlens must start at 0 and be non-decreasing")
    if cq[-1] != q.shape[0] or ck[-1] != k.shape[0]:
        raise ValueError(f"cu_seqlens_q[-1]={cq[-1]} / cu_seqlens_k[-1]={ck[-1]} must equal the "
                         f"packed lengths q.shape[0]={q.shape[0]} / k.shape[0]={k.shape[0]}")
    mq, mk = max(lq), max(lk)
    if max_q is not None and int(max_q) < mq:
        raise ValueError(f"max_seqlen_q={max_q} is smaller than the longest query sequence {mq}")
    if max_k is not None and int(max_k) < mk:
        raise ValueError(f"max_seqlen_k={max_k} is smaller than the longest key sequence {mk}")
    return (int(max_q) if max_q is not None else mq), (int(max_k) if max_k is not None else mk)


def check_window(window):
    """None, or ``window`` as a tuple (left, right) of ints >= -1 (-1: unbounded)."""
    if window is None:
        return None
    if not (isinstance(window, (tuple, list)) and len(window) == 2
            and all(isinstance(w, int) and not isinstance(w, bool) for w in window)):
        raise ValueError(f"window must be None or a pair of ints (left, right), -1 = unbounded; got {window!r}")
    if any(w < -1 for w in window):
        raise ValueError(f"window sizes must be >= -1, got {window!r}")
    return tuple(window)


def check_softmax_scale(softmax_scale) -> Optional[float]:
    """None, or ``softmax_scale`` as a float once it is checked to be a positive finite real number."""
    if softmax_scale is None:
        return None
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a positive finite real number or None, got "
                        f"{type(softmax_scale).__name__} {softmax_scale!r}")
    s = float(softmax_scale)
    if not (math.isfinite(s) and s > 0.0):
        raise ValueError(f"softmax_scale must be a positive finite real number or None, got {softmax_scale!r}")
    return s


def check_dropout_p(dropout_p) -> float:
    """``dropout_p`` of ``lowbit.attention`` as a float in [0, 1)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a real number in [0, 1), got {type(dropout_p).__name__} {dropout_p!r}")
    if not (0.0 <= float(dropout_p) < 1.0):
        raise ValueError(f"dropout_p must be a real number in [0, 1), got {dropout_p!r}")
    return float(dropout_p)


def check_dropout(dropout_p, seed):
    """The backward's and the references' dropout arguments: p in [0, 1), and a seed in [0, 2**63) when p > 0."""
    if not isinstance(dropout_p, (int, float)) or not (0.0 <= float(dropout_p) < 1.0):
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if dropout_p > 0.0:
        if isinstance(seed, bool) or not isinstance(seed, int) or not (0 <= seed < 2 ** 63):
            raise ValueError(f"seed must be an int in [0, 2**63) when dropout_p > 0, got {seed!r}")


def check_blocks(granularity: str, block_q: int, block_k: int, warp_q: int) -> None:
    """The Q/K quantizer's scale groups: granularity "per_block" / "per_warp", positive block sizes."""
    if granularity not in ("per_block", "per_warp"):
        raise ValueError(f"granularity must be 'per_block' or 'per_warp', got {granularity!r}")
    for name, val in (("block_q", block_q), ("block_k", block_k), ("warp_q", warp_q)):
        if not isinstance(val, int) or val <= 0:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    if granularity == "per_warp" and block_q % warp_q:
        raise ValueError(f"per_warp needs block_q % warp_q == 0, got block_q={block_q}, warp_q={warp_q}")


def triton_ok(q: Tensor) -> bool:
    """Whether the Triton kernels can run on ``q``'s device (CUDA, or any device under the interpreter)."""
    return q.is_cuda or INTERPRET


def check_triton_installed() -> None:
    """NotImplementedError when the Triton backend is asked for (or is CUDA's default) but triton is not installed."""
    if not triton_installed():
        raise NotImplementedError(f"{TRITON_MISSING}; use backend='reference' (or 'sdpa' for 16-bit Q·Kᵀ and P·V)")


def check_triton(d, device, qk: str = "bf16"):
    """NotImplementedError where the Triton kernels cannot run: the triton package, head dim ``d`` (for ``qk``
    quantized, at least :data:`QUANT_QK_MIN_HEAD_DIM`) or ``device``."""
    check_triton_installed()
    if d not in TRITON_HEAD_DIMS:
        raise NotImplementedError(f"the Triton attention kernel supports head_dim in {TRITON_HEAD_DIMS}, got {d} "
                                  f"(use backend='reference')")
    if qk in ("int8", "fp8") and d < QUANT_QK_MIN_HEAD_DIM:
        raise NotImplementedError(f"qk={qk!r} on the Triton attention kernel needs head_dim >= "
                                  f"{QUANT_QK_MIN_HEAD_DIM} (an 8-bit tensor-core product takes K >= 32), got {d}; "
                                  "use qk='bf16' or backend='reference'")
    if device.type != "cuda" and not INTERPRET:
        raise NotImplementedError("backend='triton' needs a CUDA device (or TRITON_INTERPRET=1 on CPU)")


def check_grad_args(grad_format, scales, grad_dtype, device):
    """``grad_format`` / ``scales`` / ``grad_dtype`` checked; returns the scales as (scale_dq, scale_dk, scale_dv) or
    None. Scale values must be positive and finite (a zero scale gives scale_inv = inf): checked for CPU tensors
    (while ``torch.compile`` traces, by the custom operator when it runs); for CUDA tensors that would be a device
    sync per call, so there the values are the caller's contract."""
    if grad_format not in GRAD_FORMATS:
        raise ValueError(f"grad_format must be one of {GRAD_FORMATS}, got {grad_format!r}")
    if grad_format is None and scales is not None:
        raise ValueError("scales are only meaningful with grad_format='e4m3' or 'e5m2'")
    if grad_format is not None and grad_dtype is not None:
        raise ValueError("grad_dtype applies to unquantized gradients only (grad_format=None)")
    if grad_dtype is not None and grad_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"grad_dtype must be torch.float32, torch.bfloat16 or torch.float16, got {grad_dtype}")
    sc = None
    if scales is not None:
        if isinstance(scales, dict):
            missing = {"dq", "dk", "dv"} - set(scales)
            if missing:
                raise ValueError(f"scales dict needs keys 'dq', 'dk', 'dv'; missing {sorted(missing)}")
            sc = (scales["dq"], scales["dk"], scales["dv"])
        elif isinstance(scales, (tuple, list)) and len(scales) == 3:
            sc = tuple(scales)
        else:
            raise TypeError(f"scales must be None (per-row scales), a 3-tuple (scale_dq, scale_dk, scale_dv) or a "
                            f"dict with keys dq/dk/dv; got {type(scales).__name__}")
        for n, s in zip(("scale_dq", "scale_dk", "scale_dv"), sc):
            check_tensor(n, s)
            if s.dtype != torch.float32 or s.numel() != 1:
                raise ValueError(f"{n} must be a float32 tensor of shape (1,), got {s.dtype} {tuple(s.shape)}")
            if s.device != device:
                raise ValueError(f"{n} is on {s.device} but q is on {device}")
            if (s.device.type == "cpu" and not torch.compiler.is_compiling()
                    and not bool(torch.isfinite(s).all() & (s > 0).all())):
                raise ValueError(f"{n} must be positive and finite (dequantized = data / scale), got {s.item()!r}")
    return sc


def check_grad_sink(grad_sink, grad_format):
    """``grad_sink``: None, or a dict (with ``grad_format`` set) that the backward fills with the FP8 gradients;
    NotImplementedError under ``torch.compile``, whose custom operators return tensors only."""
    if grad_sink is None:
        return
    if not isinstance(grad_sink, dict):
        raise TypeError(f"grad_sink must be None or a dict (it receives the FP8 gradients under 'dq', 'dk', 'dv'), "
                        f"got {type(grad_sink).__name__}")
    if grad_format is None:
        raise ValueError("grad_sink receives FP8 gradients: it needs grad_format='e4m3' or 'e5m2' (got None)")
    if torch.compiler.is_compiling():
        raise NotImplementedError("grad_sink is not supported under torch.compile: the backward's QuantizedTensors "
                                  "cannot leave a custom operator (autograd still gets the dequantized gradients; "
                                  "call without grad_sink, or run this call eagerly)")
