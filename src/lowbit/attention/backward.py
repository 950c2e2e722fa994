"""Attention backward: the Triton flash-attention backward with FP8 gradient stores, the 16-bit forward that keeps
its LSE, autograd (the references: ``lowbit.attention.reference``).

Conventions (shared with ``lowbit.attention.reference``):

* Layouts: ``"bhsd"`` = (B, H, S, D), ``"bshd"`` = (B, S, H, D); varlen = packed (T, H, D) with
  ``cu_seqlens_q/k`` int32 (B + 1,).  Gradients come back in the layout of their input: 16-bit ones in its memory
  order (``torch.empty_like``; the Triton backward writes dV in K's), FP8 ones contiguous.
* GQA/MQA: ``Hq % Hkv == 0``; query head ``h`` reads kv head ``h // (Hq // Hkv)``; dK/dV of a kv head
  are the sum over the query heads of its group.
* Causal / sliding window are bottom-right aligned; ``window=(left, right)``, -1 = unbounded.
* LSE: FP32 natural log, (B, Hq, Sq) dense or (Hq, Tq) varlen, ``-inf`` for rows that see no key
  (such rows get zero gradients).
* Dropout (Philox, regenerated, never stored): element (b, h, i, j) of the attention matrix has the
  counter ``offset + ((b·Hq + h)·Sq + i)·Sk + j`` (varlen: Sq/Sk = max_seqlen_q/k, i/j within the
  sequence) and is **kept** iff ``(philox_randint(seed, counter) >> 8) · 2^-24 >= dropout_p``;
  kept probabilities are multiplied by ``1 / (1 - dropout_p)``.  ``reference.dropout_keep_mask`` is the
  torch generator of the same mask (``philox_randint`` equals ``tl.randint``).
* FP8 gradients (``grad_format="e4m3"|"e5m2"``) are :class:`lowbit.QuantizedTensor` s with a
  rowwise copy: data ``(rows, D)`` (rows = product of the gradient's leading dims in its layout),
  quantized from the kernel's FP32 accumulator in the epilogue:
    - ``scales=None`` -> ``Float8Rowwise``: one scale per row along head_dim,
      ``scale = fmax / amax_row`` (amax 0 -> 1), ``scale_inv`` (rows, 1) stored;
    - ``scales=(scale_dq, scale_dk, scale_dv)`` (FP32 (1,) each, delayed scaling) ->
      ``Float8Tensorwise``: ``q = sat_rne(g · scale)``, ``scale_inv = 1 / scale`` (1,), NaN when the gradient's
      amax is non-finite (NUMERICS §3, per-tensor delayed).
  Either way ``qt.amax`` is the gradient's amax (for the next step's delayed scale), and
  ``qt.dequantize()`` gives ``data · scale_inv``.  The codes equal
  ``lowbit.quantize(g_fp32, scheme, scale=...)`` applied to the same FP32 gradient.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ..quant import quantize
from ..quant.reference import delayed_scale_inv
from ..quant.schemes import Float8Rowwise, Float8Tensorwise
from ..quant.tensor import QuantizedCopy, QuantizedTensor
from ..runtime import env
from ..runtime.callable import make_callable
from ..runtime.device import INTERPRET
from ..runtime.log import declined
from . import reference as _ref
from ._checks import (
    GRAD_FORMATS,
    TRITON_HEAD_DIMS,
    check_cu_meta,
    check_dropout,
    check_grad_args,
    check_grad_sink,
    check_qkv,
    check_softmax_scale,
    check_tensor,
    check_triton,
    check_triton_installed,
    check_varlen,
    check_window,
    lse_shape,
    row_views,
    shape4,
    triton_ok,
    views,
)
from ._cudnn import cudnn_backward, cudnn_decline, cudnn_runtime_decline
from .reference import attention_backward_reference, attention_forward_reference

__all__ = [
    "backward",
    "backward_backend",
    "BACKWARD_BACKENDS",
    "attention_forward",
    "backward_write_bytes",
    "AttentionFunction",
    "attention_with_grad",
    "GRAD_FORMATS",
    "OP_SCHEMA_OPTIONS",
]

_FMT = {"e4m3": (1, 448.0, torch.float8_e4m3fn), "e5m2": (2, 57344.0, torch.float8_e5m2)}
BIG = 1 << 30
BACKWARD_BACKENDS = ("triton", "cudnn", "reference")
"""``backend`` values of :func:`backward` (None: :func:`backward_backend` picks)."""


# ============================================================================ validation
def _validate_forward(q, k, v, *, layout, cu_q, cu_k):
    """attention_forward's inputs: layout, shapes (batch, heads, lengths, head_dim, GQA), one float dtype, one
    device, cu_seqlens metadata (no values read). Returns the layout ("thd" for varlen)."""
    for n, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(n, t)
    varlen = cu_q is not None or cu_k is not None
    if varlen:
        if layout not in (None, "thd", "bhsd"):
            raise ValueError(f"with cu_seqlens the inputs are packed (total, heads, head_dim): layout must be "
                             f"'thd' or None, got {layout!r}")
        lay = "thd"
    else:
        if layout not in ("bhsd", "bshd"):
            raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
        lay = layout
    check_qkv(q, k, v, lay)
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"q/k/v must be float16/bfloat16 (or float32/float64 for the reference), got {q.dtype}")
    check_cu_meta(cu_q, cu_k, q, k)
    return lay


def _validate(do, q, k, v, o, lse, *, layout, cu_q, cu_k, mq, mk, grad_format, scales, grad_dtype):
    for n, t in (("do", do), ("q", q), ("k", k), ("v", v), ("o", o), ("lse", lse)):
        check_tensor(n, t)
    varlen = cu_q is not None or cu_k is not None
    if varlen:
        if cu_q is None or cu_k is None:
            raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together")
        if layout not in (None, "thd", "bhsd"):
            raise ValueError(f"with cu_seqlens the inputs are packed (total, heads, head_dim): layout must be "
                             f"'thd' or None, got {layout!r}")
        lay = "thd"  # (cu_seqlens themselves: _check_varlen below)
    else:
        if layout not in ("bhsd", "bshd"):
            raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
        lay = layout
    B, Hq, Sq, D = shape4("q", q, lay)
    Bk, Hkv, Sk, Dk = shape4("k", k, lay)
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    for n, t in (("do", do), ("o", o)):
        if tuple(t.shape) != tuple(q.shape):
            raise ValueError(f"{n} must have q's shape {tuple(q.shape)}, got {tuple(t.shape)}")
    if Dk != D:
        raise ValueError(f"head_dim must match: q {D}, k {Dk}")
    if not varlen and Bk != B:
        raise ValueError(f"batch sizes differ: q {B}, k {Bk}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"query heads must be a multiple of key/value heads (GQA/MQA): Hq={Hq}, Hkv={Hkv}")
    if varlen:
        exp_lse = (Hq, q.shape[0])
    else:
        exp_lse = (B, Hq, Sq)
    if lse.dtype != torch.float32 or tuple(lse.shape) != exp_lse:
        raise ValueError(f"lse must be float32 of shape {exp_lse} (natural log, from the forward), got "
                         f"{lse.dtype} {tuple(lse.shape)}")
    dts = {t.dtype for t in (do, q, k, v, o)}
    if len(dts) != 1:
        raise TypeError(f"do, q, k, v, o must share one dtype, got {[str(t.dtype) for t in (do, q, k, v, o)]}")
    for n, t in (("k", k), ("v", v), ("o", o), ("do", do), ("lse", lse)):
        if t.device != q.device:
            raise ValueError(f"{n} is on {t.device} but q is on {q.device}")
    sc = check_grad_args(grad_format, scales, grad_dtype, q.device)
    if varlen:
        mq, mk = check_varlen(cu_q, cu_k, q, k, mq, mk)
    return lay, varlen, (B, Hq, Sq, Hkv, Sk, D), mq, mk, sc


# ============================================================================ which backend runs the backward
def backward_backend(device, dtype: torch.dtype, *, batch: int, heads_q: int, heads_kv: int, seqlen_q: int,
                     seqlen_k: int, head_dim: int, causal: bool = False, window=None, varlen: bool = False,
                     dropout_p: float = 0.0, grad_format: Optional[str] = None,
                     grad_dtype: Optional[torch.dtype] = None, config=None, backend: Optional[str] = None) -> str:
    """The backend :func:`backward` runs for a call with this metadata (nothing is run or read from a tensor).

    ``backend`` given: that one ("cudnn" only where cuDNN computes the call's math, else ValueError naming the
    argument, the rule and the value). None: "cudnn" where cuDNN's attention computes the same math
    (``_cudnn.cudnn_decline``: dense, no window, causal only with seqlen_q == seqlen_k, no dropout, 16-bit gradients,
    Hq a multiple of Hkv, head_dim a multiple of 8 up to 128) and lowbit prefers it on the device
    (``_cudnn.cudnn_runtime_decline``: capability 9.x/10.x, cuDNN > 9.15, as torch's SDPA) — on an H100 its backward
    took at most 0.85x the time of lowbit's Triton backward at every shape measured, causal or not; otherwise
    "triton" on CUDA (or under Triton's interpreter), "reference" elsewhere."""
    return _backward_choice(torch.device(device), dtype, dict(
        batch=batch, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=head_dim,
        causal=causal, window=window, varlen=varlen, dropout_p=dropout_p, grad_format=grad_format,
        grad_dtype=grad_dtype, config=config), backend)[0]


def _backward_choice(device: torch.device, dtype, meta: dict, backend):
    """(backend, why cuDNN's was not taken: None where it runs or ``backend`` was given) for ``backward_backend``."""
    if backend is not None:
        if backend not in BACKWARD_BACKENDS:
            raise ValueError(f"backend must be one of {BACKWARD_BACKENDS} or None, got {backend!r}")
        if backend == "cudnn":
            why = cudnn_decline(device_type=device.type, dtype=dtype, **meta)
            if why is not None:
                raise ValueError(f"backend='cudnn' cannot run this call: {why}")
        return backend, None
    why = cudnn_decline(device_type=device.type, dtype=dtype, **meta)
    if why is None:
        why = cudnn_runtime_decline(device)
    if why is None:
        return "cudnn", None
    return ("triton" if device.type == "cuda" or INTERPRET else "reference"), why


# ============================================================================ the low-level backward
def backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, *, causal: bool = False,
             softmax_scale: Optional[float] = None, window=None, dropout_p: float = 0.0, seed: Optional[int] = None,
             offset: int = 0, grad_format: Optional[str] = None, scales=None, grad_dtype: Optional[torch.dtype] = None,
             layout: str = "bhsd", cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
             max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
             backend: Optional[str] = None, config=None):
    """Flash-attention backward: (dq, dk, dv) from dO, Q, K, V, O and the forward's LSE.

    Also reachable as ``lowbit.attention.backward(do, q, k, v, o, lse, ...)`` (the module is callable).

    Args:
        do, q, o: (B, Hq, Sq, D) for ``layout="bhsd"``, (B, Sq, Hq, D) for ``"bshd"``, or packed
            (Tq, Hq, D) with ``cu_seqlens_q/k``; any strides.  k, v: same with Hkv heads.  All
            bfloat16/float16 (one dtype) for the Triton backend; the reference backend takes any float.
        lse: float32 natural-log LSE of the forward, (B, Hq, Sq) or (Hq, Tq) varlen.
        causal, window, softmax_scale (default 1/sqrt(D)): as in the forward.
        dropout_p, seed, offset: the forward's Philox dropout (see module docstring).
        grad_format: None -> plain tensors in q's dtype (or ``grad_dtype``: torch.float32 returns the
            kernels' FP32 accumulators); "e4m3"/"e5m2" -> ``QuantizedTensor`` s quantized in the kernel
            epilogue (per-row scales along head_dim, or per-tensor given ``scales``).
        scales: None, or (scale_dq, scale_dk, scale_dv) / {"dq":, "dk":, "dv":}, FP32 (1,) each:
            ``scale`` multiplies the gradient on the way in (dequantized = data / scale); positive and finite
            (checked for CPU tensors; for CUDA tensors reading the values would sync, so they are the caller's
            contract).
        backend: None (:func:`backward_backend` picks: cuDNN's backward where it computes the same math and is
            faster, else Triton on CUDA, the reference elsewhere), "cudnn" (``aten::_scaled_dot_product_cudnn_
            attention_backward`` given this ``o`` and ``lse``; CUDA, dense, no window, causal only with Sq == Sk, no
            dropout, 16-bit gradients, Hq a multiple of Hkv, head_dim a multiple of 8 up to 128), "triton" (lowbit's
            kernels: CUDA, or CPU under TRITON_INTERPRET=1) or "reference" (explicit FP32 formulas +
            ``lowbit.quantize``). Where the default passes cuDNN by it says why (``lowbit.runtime.log.declined`` under
            "attention.backward.cudnn").
        config: ((BM, BN, warps, stages) for dK/dV, (BM, BN, warps, stages) for dQ) to force Triton's tiles;
            default autotuned (LOWBIT_AUTOTUNE=0: heuristic).

    Returns:
        (dq, dk, dv) in the layout of q/k/v, tensors in their input's memory order (``torch.empty_like``; the
        Triton backend's dV in K's, the reference backend's contiguous) or QuantizedTensors (contiguous data).
    """
    softmax_scale = check_softmax_scale(softmax_scale)
    check_dropout(dropout_p, seed)
    lay, varlen, dims, mq, mk, sc = _validate(do, q, k, v, o, lse, layout=layout, cu_q=cu_seqlens_q,
                                              cu_k=cu_seqlens_k, mq=max_seqlen_q, mk=max_seqlen_k,
                                              grad_format=grad_format, scales=scales, grad_dtype=grad_dtype)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(dims[-1])
    left, right = _ref.causal_window(causal, check_window(window))
    B, Hq, Sq, Hkv, Sk, D = dims
    backend, why = _backward_choice(q.device, q.dtype, dict(
        batch=cu_seqlens_q.numel() - 1 if varlen else B, heads_q=Hq, heads_kv=Hkv, seqlen_q=mq if varlen else Sq,
        seqlen_k=mk if varlen else Sk, head_dim=D, causal=causal, window=window, varlen=varlen, dropout_p=dropout_p,
        grad_format=grad_format, grad_dtype=grad_dtype, config=config), backend)
    if why is not None:
        declined("attention.backward.cudnn", why)
    if backend == "cudnn":
        return cudnn_backward(do, q, k, v, o, lse, causal=causal, softmax_scale=float(softmax_scale), layout=lay)
    if backend == "reference":
        g = attention_backward_reference(do, q, k, v, lse=lse, causal=causal, softmax_scale=softmax_scale,
                                         window=window, dropout_p=dropout_p, seed=seed, offset=offset,
                                         layout="bhsd" if varlen else lay, cu_seqlens_q=cu_seqlens_q,
                                         cu_seqlens_k=cu_seqlens_k, max_seqlen_q=mq, max_seqlen_k=mk)
        if grad_format is None:
            return tuple(x.to(grad_dtype or q.dtype) for x in g)
        if sc is None:
            return tuple(quantize(x, Float8Rowwise(grad_format), backend="reference") for x in g)
        return tuple(quantize(x, Float8Tensorwise(grad_format), scale=s, backend="reference")
                     for x, s in zip(g, sc))
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"the Triton backward needs bfloat16/float16 inputs, got {q.dtype}")
    if dims[-1] not in TRITON_HEAD_DIMS:
        raise NotImplementedError(f"the Triton backward supports head_dim in {TRITON_HEAD_DIMS}, got {dims[-1]} "
                                  f"(use backend='reference')")
    check_triton_installed()
    if not triton_ok(q):
        raise NotImplementedError("backend='triton' needs a CUDA device (or TRITON_INTERPRET=1 on CPU)")
    return _backward_triton(do, q, k, v, o, lse, lay=lay, varlen=varlen, dims=dims, mq=mq, mk=mk,
                            scale=float(softmax_scale), left=left, right=right, dropout_p=float(dropout_p),
                            seed=seed, offset=int(offset), grad_format=grad_format, sc=sc, grad_dtype=grad_dtype,
                            cu_q=cu_seqlens_q, cu_k=cu_seqlens_k, config=config)


def _autotune_enabled(BK) -> bool:
    return env.get("LOWBIT_AUTOTUNE") and not BK.INTERPRETED


def _backward_triton(do, q, k, v, o, lse, *, lay, varlen, dims, mq, mk, scale, left, right, dropout_p, seed,
                     offset, grad_format, sc, grad_dtype, cu_q, cu_k, config):
    import triton  # (Triton is optional: imported where a Triton backend runs)

    from . import backward_kernels as BK

    B, Hq, Sq, Hkv, Sk, D = dims
    if varlen:
        B = cu_q.numel() - 1
        Sq, Sk = mq, mk
    group = Hq // Hkv
    dev = q.device
    LOG2E = _ref.LOG2E
    # ---- preprocess: delta = rowsum(dO·O), lse2 = lse·log2e (+inf for empty rows)
    if varlen:
        delta = torch.empty(Hq, q.shape[0], device=dev, dtype=torch.float32)
        ds = (0, delta.stride(0), delta.stride(1))
        ls = (0, lse.stride(0), lse.stride(1))
    else:
        delta = torch.empty(B, Hq, Sq, device=dev, dtype=torch.float32)
        ds = delta.stride()
        ls = lse.stride()
    lse2 = torch.empty_like(delta)
    cu_dummy = delta
    cuq = cu_q if varlen else cu_dummy
    cuk = cu_k if varlen else cu_dummy
    if B * Hq > 0 and Sq > 0:
        BK.bwd_preprocess[(triton.cdiv(Sq, 64), B * Hq)](
            o, do, lse, delta, lse2, cuq, *views(o, lay, varlen), *views(do, lay, varlen), *ls, *ds,
            Hq, Sq, HEAD_DIM=D, BLOCK_M=64, VARLEN=varlen, num_warps=4)

    # ---- outputs
    if grad_format is None:
        qmode, fmt_id, fmax = 0, 0, 0.0
        gdt = grad_dtype or q.dtype
    else:
        fmt_id, fmax, gdt = _FMT[grad_format]
        qmode = 1 if sc is not None else 2
    if qmode == 0:  # (16-bit gradients in q's and k's memory order (dV takes dK's strides); FP8 data contiguous)
        dq, dk, dv = (torch.empty_like(t, dtype=gdt) for t in (q, k, k))
    else:
        dq, dk, dv = (torch.empty(t.shape, device=dev, dtype=gdt) for t in (q, k, k))
    if qmode == 2:
        rsq = torch.empty(q.shape[:-1], device=dev, dtype=torch.float32)
        rsk = torch.empty(k.shape[:-1], device=dev, dtype=torch.float32)
        rsv = torch.empty(k.shape[:-1], device=dev, dtype=torch.float32)
        rq, rk = row_views(rsq, lay, varlen), row_views(rsk, lay, varlen)
    else:
        rsq = rsk = rsv = delta
        rq = rk = (0, 0, 0)
    amax = torch.zeros(3, device=dev, dtype=torch.float32)
    if qmode == 1:
        scq, sck, scv = (s.reshape(1).contiguous() for s in sc)
    else:
        scq = sck = scv = amax
    win_l = BIG if left < 0 else left
    win_r = BIG if right < 0 else right
    dropout = dropout_p > 0.0
    drop_sq, drop_sk = Sq, Sk
    seed_v = int(seed) if dropout else 0
    common = [scale, scale * LOG2E, win_l, win_r, seed_v, offset, dropout_p,
              (1.0 / (1.0 - dropout_p)) if dropout else 1.0, drop_sq, drop_sk, triton.next_power_of_2(max(Sq, Sk, 1))]
    meta = dict(QMODE=qmode, FMT=fmt_id, FMAX=fmax, DROPOUT=dropout, VARLEN=varlen, HEAD_DIM=D,
                INTERPRET=BK.INTERPRETED)
    vq, vk, vv, vdo = (views(t, lay, varlen) for t in (q, k, v, do))
    strides_in = [*vq, *vk, *vv, *vdo]
    args_kv = [q, k, v, do, dk, dv, lse2, delta, cuq, cuk, sck, scv, rsk, rsv, amax[1:2], amax[2:3],
               *strides_in, *views(dk, lay, varlen), *rk, *ds, Hkv, group, Sq, Sk, *common]
    args_q = [q, k, v, do, dq, lse2, delta, cuq, cuk, scq, rsq, amax[0:1],
              *strides_in, *views(dq, lay, varlen), *rq, *ds, Hq, group, Sq, Sk, *common]
    if Sk > 0 and B * Hkv > 0:
        if config is None and _autotune_enabled(BK):
            BK.bwd_dkdv_tuned[lambda mt: (triton.cdiv(Sk, mt["BLOCK_N"]), B * Hkv)](*args_kv, **meta)
        else:
            bm, bn, w, st = (config or BK.heuristic_configs(D, max(Sq, Sk), causal=right == 0))[0]
            BK.bwd_dkdv[(triton.cdiv(Sk, bn), B * Hkv)](*args_kv, **meta, BLOCK_M=bm, BLOCK_N=bn, num_warps=w,
                                                       num_stages=st)
    if Sq > 0 and B * Hq > 0:
        if config is None and _autotune_enabled(BK):
            BK.bwd_dq_tuned[lambda mt: (triton.cdiv(Sq, mt["BLOCK_M"]), B * Hq)](*args_q, **meta)
        else:
            bm, bn, w, st = (config or BK.heuristic_configs(D, max(Sq, Sk), causal=right == 0))[1]
            BK.bwd_dq[(triton.cdiv(Sq, bm), B * Hq)](*args_q, **meta, BLOCK_M=bm, BLOCK_N=bn, num_warps=w,
                                                   num_stages=st)
    if qmode == 0:
        return dq, dk, dv
    scheme = Float8Rowwise(grad_format) if qmode == 2 else Float8Tensorwise(grad_format)
    out = []
    for i, (g, x, rs, s) in enumerate(((dq, q, rsq, scq), (dk, k, rsk, sck), (dv, k, rsv, scv))):
        rows = g.numel() // D if D else 0
        # (given scales: NaN where the gradient held a NaN / Inf, as lowbit.quantize with a delayed scale stores)
        scale_inv = rs.reshape(rows, 1) if qmode == 2 else delayed_scale_inv(s, amax[i:i + 1])
        qt = QuantizedTensor(shape=x.shape, dtype=x.dtype, scheme=scheme,
                             rowwise=QuantizedCopy(data=g.view(rows, D), scale_inv=scale_inv, amax=amax[i:i + 1]))
        qt.meta["layout"] = lay
        out.append(qt)
    return tuple(out)


# ============================================================================ bytes accounting
def backward_write_bytes(batch: int, heads_q: int, heads_kv: int, seqlen_q: int, seqlen_k: int, head_dim: int, *,
                         grad_format: Optional[str] = None, per_row_scales: bool = True, elem_bytes: int = 2) -> dict:
    """Bytes each backward kernel writes to global memory (what the launchers allocate and fill).

    ``preprocess``: delta + lse2 (FP32 per query row); ``dkdv``: dK + dV (+ per-row scales + amax);
    ``dq``: dQ (+ scales + amax).  ``gradients`` = dq + dk + dv data only; ``gradient_scales``:
    their scale/amax bytes.  16-bit gradients: ``elem_bytes`` (2) per element; FP8: 1.
    """
    nq = batch * heads_q * seqlen_q
    nk = batch * heads_kv * seqlen_k
    e = elem_bytes if grad_format is None else 1
    grad = (nq + 2 * nk) * head_dim * e
    if grad_format is None:
        sc_q = sc_k = 0
    elif per_row_scales:
        sc_q, sc_k = nq * 4 + 4, 2 * (nk * 4 + 4)
    else:
        sc_q, sc_k = 4, 2 * 4
    return {"preprocess": 2 * nq * 4, "dkdv": 2 * nk * head_dim * e + sc_k, "dq": nq * head_dim * e + sc_q,
            "gradients": grad, "gradient_scales": sc_q + sc_k}


# ============================================================================ forward with LSE + autograd
def attention_forward(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, softmax_scale: Optional[float] = None,
                      window=None, dropout_p: float = 0.0, seed: Optional[int] = None, offset: int = 0,
                      layout: str = "bhsd", cu_seqlens_q: Optional[Tensor] = None,
                      cu_seqlens_k: Optional[Tensor] = None, max_seqlen_q: Optional[int] = None,
                      max_seqlen_k: Optional[int] = None, backend: Optional[str] = None, config=None):
    """16-bit forward returning (out in q's dtype/layout, LSE FP32) for the backward; the Triton kernel's out in q's
    memory order.

    backend: "triton" — without dropout the forward engineer's kernel
    (``lowbit.attention._triton.attention_fwd_triton``), with dropout this module's
    ``backward_kernels.fwd_dropout`` kernel (same Philox counters as the backward); "reference" —
    ``attention_forward_reference`` in FP32.  Default: triton on CUDA / interpreter.
    """
    check_dropout(dropout_p, seed)
    lay = _validate_forward(q, k, v, layout=layout, cu_q=cu_seqlens_q, cu_k=cu_seqlens_k)
    varlen = lay == "thd"
    left, right = _ref.causal_window(causal, check_window(window))
    softmax_scale = check_softmax_scale(softmax_scale)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    if backend is None:
        backend = "triton" if triton_ok(q) else "reference"
    if backend not in ("triton", "reference"):
        raise ValueError(f"backend must be 'triton', 'reference' or None, got {backend!r}")
    if backend == "triton":
        if q.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"the Triton forward needs bfloat16/float16 inputs, got {q.dtype}")
        check_triton(q.shape[-1], q.device)
    if varlen:
        lq = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
        lk = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
        mq = int(max_seqlen_q) if max_seqlen_q is not None else int(lq.max())
        mk = int(max_seqlen_k) if max_seqlen_k is not None else int(lk.max())
    else:
        mq = mk = None
    if backend == "reference":
        o, lse = attention_forward_reference(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window,
                                             dropout_p=dropout_p, seed=seed, offset=offset, layout=layout,
                                             cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                             max_seqlen_q=mq, max_seqlen_k=mk)
        return o.to(q.dtype), lse.float()
    if dropout_p == 0.0 and config is None and q.is_cuda:
        from ._triton import attention_fwd_triton  # (Triton is optional: imported where a Triton backend runs)

        return attention_fwd_triton(q, k, v, softmax_scale=softmax_scale, causal=causal, window=window,
                                    layout="bhsd" if varlen else layout, cu_seqlens_q=cu_seqlens_q,
                                    cu_seqlens_k=cu_seqlens_k, max_seqlen_q=mq, max_seqlen_k=mk,
                                    return_lse=True, out_dtype=q.dtype, out_like=q)
    import triton

    from . import backward_kernels as BK

    B, Hq, Sq, D = shape4("q", q, lay)
    _, Hkv, Sk, _ = shape4("k", k, lay)
    if varlen:
        B, Sq, Sk = cu_seqlens_q.numel() - 1, mq, mk
    o = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    if varlen:
        lse = torch.empty(Hq, q.shape[0], device=q.device, dtype=torch.float32)
        sl = (0, lse.stride(0), lse.stride(1))
    else:
        lse = torch.empty(B, Hq, Sq, device=q.device, dtype=torch.float32)
        sl = lse.stride()
    dropout = dropout_p > 0.0
    bm, bn, w, st = config or ((16, 16, 4, 1) if BK.INTERPRETED else (128, 64, 8, 2) if D <= 128 else (64, 32, 4, 2))
    cu = lse
    BK.fwd_dropout[(triton.cdiv(max(Sq, 1), bm), B * Hq)](
        q, k, v, o, lse, cu_seqlens_q if varlen else cu, cu_seqlens_k if varlen else cu,
        *views(q, lay, varlen), *views(k, lay, varlen), *views(v, lay, varlen), *views(o, lay, varlen), *sl,
        Hq, Hq // Hkv, Sq, Sk, softmax_scale * _ref.LOG2E,
        BIG if left < 0 else left, BIG if right < 0 else right,
        int(seed) if dropout else 0, int(offset), float(dropout_p), (1.0 / (1.0 - dropout_p)) if dropout else 1.0,
        Sq, Sk, DROPOUT=dropout, VARLEN=varlen, HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, INTERPRET=BK.INTERPRETED,
        num_warps=w, num_stages=st)
    return o, lse


_FWD_KEYS = ("causal", "softmax_scale", "window", "dropout_p", "seed", "offset", "layout", "cu_seqlens_q",
             "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "backend")


def _with_seed(opts: dict) -> dict:
    """``opts`` with a Philox seed drawn from torch's default generator when dropout has none."""
    o = dict(opts)
    if o.get("dropout_p", 0.0) > 0.0 and o.get("seed") is None:
        o["seed"] = int(torch.randint(0, 2 ** 62, (1,)).item())
    return o


def _forward_kw(o: dict) -> dict:
    """The ``attention_forward`` keywords of ``AttentionFunction``'s options (those that are set)."""
    return {n: o[n] for n in _FWD_KEYS if o.get(n) is not None}


def _backward_with_opts(g_out, q, k, v, out, lse, o: dict):
    """(dq, dk, dv) of ``AttentionFunction`` for its options ``o`` (seed drawn): ``backward``, FP8 gradients put
    into ``o["grad_sink"]`` (a dict) and returned dequantized."""
    kw = _forward_kw(o)
    if kw.get("layout") is None or kw.get("cu_seqlens_q") is not None:
        kw["layout"] = "thd" if kw.get("cu_seqlens_q") is not None else "bhsd"
    grads = backward(g_out.contiguous(), q, k, v, out, lse, grad_format=o.get("grad_format"),
                     scales=o.get("scales"), config=o.get("config"), **kw)
    sink = o.get("grad_sink")
    if o.get("grad_format") is not None:
        if isinstance(sink, dict):
            sink.update(dq=grads[0], dk=grads[1], dv=grads[2])
        grads = tuple(g.dequantize() for g in grads)
    return grads


class AttentionFunction(torch.autograd.Function):
    """Differentiable 16-bit attention: ``attention_forward`` + this module's ``backward``.

    ``AttentionFunction.apply(q, k, v, opts)`` with ``opts`` a dict of the keyword arguments of
    :func:`attention_with_grad` (use that wrapper).  With ``grad_format`` set, autograd receives the
    dequantized FP8 gradients (in q's dtype) and, if ``opts["grad_sink"]`` is a dict, the
    ``QuantizedTensor`` s themselves are stored there under "dq", "dk", "dv" so a QKV projection's
    dgrad/wgrad GEMMs can consume them without re-quantizing.  Forwards that quantize Q/K/V
    (INT8/FP8) should save their high-precision inputs and call this backward: it runs in BF16.
    Under ``torch.compile`` the custom operators ``lowbit::attention16_fwd`` / ``lowbit::attention16_bwd`` run the
    same functions.
    """

    @staticmethod
    def forward(ctx, q, k, v, opts):
        o = _with_seed(opts)
        out, lse = attention_forward(q, k, v, **_forward_kw(o))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.opts = o
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, g_out, g_lse=None):
        q, k, v, out, lse = ctx.saved_tensors
        grads = _backward_with_opts(g_out, q, k, v, out, lse, ctx.opts)
        return grads[0], grads[1], grads[2], None


# ---------------------------------------------------------------------------- torch.compile: custom operators
def _op_opts(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale_dq, scale_dk, scale_dv, causal,
             softmax_scale, window, dropout_p, seed, offset, layout, backend, grad_format) -> dict:
    """``AttentionFunction``'s options rebuilt from an operator's arguments (the cu_seqlens values checked)."""
    mq, mk = check_varlen(cu_seqlens_q, cu_seqlens_k, q, k, max_seqlen_q, max_seqlen_k)
    return dict(causal=causal, softmax_scale=softmax_scale, window=check_window(window),
                dropout_p=dropout_p, seed=seed, offset=offset, layout=layout, cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k, max_seqlen_q=mq, max_seqlen_k=mk, grad_format=grad_format,
                scales=None if scale_dq is None else (scale_dq, scale_dk, scale_dv), backend=backend)


OP_SCHEMA_OPTIONS = ("Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, SymInt? max_seqlen_q, SymInt? max_seqlen_k, "
                     "Tensor? scale_dq, Tensor? scale_dk, Tensor? scale_dv, bool causal, float? softmax_scale, "
                     "SymInt[]? window")
"""The arguments the attention operators take after their tensors, in their schemas: varlen metadata (max_seqlen
None: from cu_seqlens), the backward's per-tensor FP8 gradient scales, the mask, the softmax scale (None:
1/sqrt(D))."""
_FWD16_SCHEMA = (f"(Tensor q, Tensor k, Tensor v, {OP_SCHEMA_OPTIONS}, float dropout_p, SymInt? seed, SymInt offset, "
                 "str layout, str? backend, str? grad_format) -> (Tensor, Tensor, Tensor)")


@torch.library.custom_op("lowbit::attention16_fwd", mutates_args=(), schema=_FWD16_SCHEMA)
def attention16_fwd_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale_dq, scale_dk, scale_dv,
                       causal, softmax_scale, window, dropout_p, seed, offset, layout, backend, grad_format):
    """16-bit attention forward with Philox dropout (``attention_forward``): (out in q's dtype and layout,
    contiguous; LSE fp32 (B, Hq, Sq) / (Hq, Tq); the dropout seed, int64 (1,) on the CPU — drawn from torch's
    default generator when ``seed`` is None — or an empty tensor without dropout). ``layout`` "thd" when packed.
    ``scale_d*`` / ``grad_format``: the backward's FP8 gradient options (the forward only checks the scale values).
    Differentiable: the backward is ``lowbit::attention16_bwd``."""
    o = _with_seed(_op_opts(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale_dq, scale_dk,
                            scale_dv, causal, softmax_scale, window, dropout_p, seed, offset, layout, backend,
                            grad_format))
    check_grad_args(grad_format, o["scales"], None, q.device)
    out, lse = attention_forward(q, k, v, **_forward_kw(o))
    seed_t = torch.tensor([o["seed"]] if dropout_p > 0.0 else [], dtype=torch.int64)
    return out.contiguous(), lse.contiguous(), seed_t


@attention16_fwd_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale_dq, scale_dk, scale_dv, causal,
      softmax_scale, window, dropout_p, seed, offset, layout, backend, grad_format):
    seed_t = torch.empty(1 if dropout_p > 0.0 else 0, dtype=torch.int64, device="cpu")
    return q.new_empty(q.shape), q.new_empty(lse_shape(q, layout), dtype=torch.float32), seed_t


def _attention16_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, mq, mk, sdq, sdk, sdv = inputs[:10]
    out, lse, seed_t = output
    ctx.save_for_backward(q, k, v, out, lse, seed_t, cu_q, cu_k, sdq, sdk, sdv)
    ctx.args = (mq, mk) + tuple(inputs[10:])
    ctx.mark_non_differentiable(lse, seed_t)


def _attention16_backward(ctx, g_out, g_lse, g_seed):
    q, k, v, out, lse, seed_t, cu_q, cu_k, sdq, sdk, sdv = ctx.saved_tensors
    mq, mk, *rest = ctx.args
    grads = torch.ops.lowbit.attention16_bwd(g_out, q, k, v, out, lse, seed_t, cu_q, cu_k, mq, mk, sdq, sdk, sdv,
                                             *rest)
    return (*grads,) + (None,) * 16


attention16_fwd_op.register_autograd(_attention16_backward, setup_context=_attention16_setup)

_BWD16_SCHEMA = ("(Tensor g_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor seed, "
                 f"{OP_SCHEMA_OPTIONS}, float dropout_p, SymInt? seed_arg, SymInt offset, str layout, str? backend, "
                 "str? grad_format) -> (Tensor, Tensor, Tensor)")


@torch.library.custom_op("lowbit::attention16_bwd", mutates_args=(), schema=_BWD16_SCHEMA)
def attention16_bwd_op(g_out, q, k, v, out, lse, seed, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       scale_dq, scale_dk, scale_dv, causal, softmax_scale, window, dropout_p, seed_arg, offset,
                       layout, backend, grad_format):
    """The flash-attention backward of ``lowbit::attention16_fwd`` (``backward``, with the forward's O, LSE and
    dropout ``seed`` tensor): (dq, dk, dv) in q's dtype, each contiguous in its input's shape; with ``grad_format``
    quantized to FP8 in the kernel epilogue and returned dequantized (in q's dtype, as autograd hands them on).
    ``seed_arg``: the forward's ``seed`` argument (unused: ``seed`` holds the one the forward ran)."""
    o = _op_opts(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale_dq, scale_dk, scale_dv, causal,
                 softmax_scale, window, dropout_p, int(seed.item()) if seed.numel() else None, offset, layout, backend,
                 grad_format)
    return tuple(g.to(q.dtype).contiguous() for g in _backward_with_opts(g_out, q, k, v, out, lse, o))


@attention16_bwd_op.register_fake
def _(g_out, q, k, v, out, lse, seed, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale_dq, scale_dk,
      scale_dv, causal, softmax_scale, window, dropout_p, seed_arg, offset, layout, backend, grad_format):
    return q.new_empty(q.shape), q.new_empty(k.shape), q.new_empty(v.shape)


def attention_with_grad(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                        softmax_scale: Optional[float] = None, window=None, dropout_p: float = 0.0,
                        seed: Optional[int] = None, offset: int = 0, layout: str = "bhsd",
                        cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
                        max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                        grad_format: Optional[str] = None, scales=None, grad_sink: Optional[dict] = None,
                        backend: Optional[str] = None, return_lse: bool = False):
    """Differentiable attention through :class:`AttentionFunction` (forward + fused backward).

    q (B, Hq, Sq, D) / (B, Sq, Hq, D) / packed (Tq, Hq, D); k, v with Hkv heads; bf16/fp16 for the
    Triton path.  dropout_p > 0 without a seed draws one from torch's default generator.
    Returns out (q's dtype/layout) and with ``return_lse`` the FP32 LSE.
    """
    check_dropout(dropout_p, seed if seed is not None else 0)
    check_tensor("q", q)
    sc = check_grad_args(grad_format, scales, None, q.device)
    check_grad_sink(grad_sink, grad_format)
    if torch.compiler.is_compiling():
        out, lse, _ = torch.ops.lowbit.attention16_fwd(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *(sc or (None, None, None)), causal,
            softmax_scale, None if window is None else list(window), float(dropout_p), seed, offset,
            "thd" if cu_seqlens_q is not None else layout, backend, grad_format)
        return (out, lse) if return_lse else out
    opts = dict(causal=causal, softmax_scale=softmax_scale, window=window, dropout_p=float(dropout_p), seed=seed,
                offset=offset, layout="thd" if cu_seqlens_q is not None else layout, cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                grad_format=grad_format, scales=scales, grad_sink=grad_sink, backend=backend)
    out, lse = AttentionFunction.apply(q, k, v, opts)
    return (out, lse) if return_lse else out


# ============================================================================ `lowbit.attention.backward(...)`
# This module, called, is its function backward (NUMERICS §7's ``lowbit.attention.backward(do, q, k, v, o, lse, ...,
# grad_format=..., scales=...)``), the way ``lowbit.attention`` is both a package and lowbit.attention.attention;
# ``import lowbit.attention.backward`` and ``from lowbit.attention import backward`` keep giving the module.
make_callable(__name__, "backward")
