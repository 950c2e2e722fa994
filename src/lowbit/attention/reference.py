"""Pure-PyTorch references for attention (the spec the Triton kernels are tested against).

Conventions shared by every function here and by the kernels:

* Layouts: ``"bhsd"`` = (batch, heads, seq, head_dim), ``"bshd"`` = (batch, seq, heads, head_dim);
  variable-length batches are packed ``(total_tokens, heads, head_dim)`` ("thd") with
  ``cu_seqlens`` int32 of shape (batch + 1,), ``cu_seqlens[0] == 0``.
* GQA/MQA: ``Hq % Hkv == 0``; query head ``h`` reads key/value head ``h // (Hq // Hkv)``.
* Causal masking is **bottom-right aligned** (FlashAttention >= 2.1): query row ``i`` of a sequence
  with ``Sq`` queries and ``Sk`` keys sees key ``j`` iff ``j <= i + (Sk - Sq)``.  Sliding window
  ``(left, right)`` (-1 = unbounded) keeps ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``;
  ``causal=True`` is ``right = 0``.
* A query row that sees no key at all returns 0 and LSE ``-inf`` (logsumexp of an empty set).
* LSE is in natural log, fp32: dense (B, Hq, Sq); varlen (Hq, total_q).
* INT8/FP8 Q/K quantization (NUMERICS §3): Q is multiplied by ``softmax_scale * log2(e)`` in FP32
  first, so dequantized scores are in log2 units and the kernels use ``exp2``.  Scale = amax / qmax
  per block of rows (all head-dim channels), amax == 0 -> scale 1.  INT8 rounds half away from
  zero and clamps to ±127; FP8 E4M3 clamps to ±448 and rounds to nearest even.
  Per-warp Q scales split each ``block_q`` block into ``block_q // warp_q`` groups of consecutive
  rows, so row ``r`` uses ``q_scale[..., r // warp_q]`` (per-block: ``r // block_q``); key column
  ``c`` uses ``k_scale[..., c // block_k]``.
* Varlen quantization: scales are indexed per sequence with block 0 at each sequence start,
  ``q_scale`` (B, Hq, ceil(max_seqlen_q / block_q) * groups), ``k_scale`` (B, Hkv,
  ceil(max_seqlen_k / block_k)), unused trailing entries = 1; ``k_mean`` (B, Hkv, 1, D) is the
  per-sequence mean; ``v_scale`` (B, Hkv, D) per sequence.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..formats import philox_randint
from ._checks import check_blocks, check_dropout

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
INT8_MAX = 127.0
E4M3_MAX = 448.0
QMAX = {"int8": INT8_MAX, "fp8": E4M3_MAX}

__all__ = [
    "attention_reference",
    "attention_quantized_reference",
    "attention_prequantized_reference",
    "quantize_qk_reference",
    "quantize_v_fp8_reference",
    "quantize_v_fp16_reference",
    "v_fp16_scales",
    "QKQuantized",
    "round_half_away",
    "to_e4m3",
    "k_mean",
    "visible_mask",
    "lse_smoothing_shift",
    "QKInt8",
    "quantize_qk_int8",
    "dropout_keep_mask",
    "attention_forward_reference",
    "attention_backward_reference",
    "check_layout",
    "to_bhsd",
    "causal_window",
    "split_varlen",
    "default_scale",
    "n_q_groups",
    "LOG2E",
]


# ----------------------------------------------------------------------------- helpers
def round_half_away(x: Tensor) -> Tensor:
    """Round fp32 to the nearest integer, ties away from zero, exactly.

    ``floor(|x| + 0.5)`` can round up at |x| = 0.5 - 2^-25 because the add itself rounds; this
    form only uses exact operations (``|x| - floor(|x|)`` is exact), and the Triton prepass uses the
    identical sequence, so the two agree bit for bit.
    """
    a = x.abs()
    f = torch.floor(a)
    r = f + ((a - f) >= 0.5).to(x.dtype)
    return torch.where(x < 0, -r, r)


def to_e4m3(x: Tensor) -> Tensor:
    """Saturating round-to-nearest-even cast of fp32 to float8_e4m3fn (clamp first: torch's
    unclamped cast is not saturating)."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def check_layout(layout: str) -> None:
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd' for dense inputs, got {layout!r}")


def to_bhsd(x: Tensor, layout: str) -> Tensor:
    """A (B, H, S, D) *view* of a dense tensor in ``layout`` (no copy)."""
    return x if layout == "bhsd" else x.transpose(1, 2)


def causal_window(causal: bool, window) -> Tuple[int, int]:
    left, right = (-1, -1) if window is None else (int(window[0]), int(window[1]))
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def visible_mask(sq: int, sk: int, causal: bool = False, window=None, device=None) -> Tensor:
    """Bool (sq, sk): True where query row i may attend key j (bottom-right aligned)."""
    left, right = causal_window(causal, window)
    i = torch.arange(sq, device=device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=device)[None, :]
    m = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if right >= 0:
        m &= j <= i + right
    if left >= 0:
        m &= j >= i - left
    return m


def split_varlen(cu: Tensor):
    cu_l = [int(c) for c in cu.tolist()]
    return [(cu_l[b], cu_l[b + 1]) for b in range(len(cu_l) - 1)]


def default_scale(d: int, softmax_scale) -> float:
    return float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d)


# ----------------------------------------------------------------------------- FP32 reference
def attention_reference(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                        softmax_scale: Optional[float] = None, window=None, layout: str = "bhsd",
                        cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
                        return_lse: bool = False):
    """FP32 ``softmax(q kᵀ · softmax_scale) v`` — the accuracy baseline.

    q: (B, Hq, Sq, D) / (B, Sq, Hq, D) per ``layout``, or packed (Tq, Hq, D) with ``cu_seqlens_q``.
    k, v: same with Hkv heads (Hq % Hkv == 0).  Any float dtype; computed in FP32.
    ``softmax_scale`` defaults to 1/sqrt(D).  Returns the output in FP32 in the input's layout,
    and with ``return_lse`` also the natural-log LSE (B, Hq, Sq) or (Hq, Tq).
    Differentiable (plain torch ops), so it also serves as the high-precision backward.
    """
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        outs, lses = [], []
        for (qs, qe), (ks, ke) in zip(split_varlen(cu_seqlens_q), split_varlen(cu_seqlens_k)):
            o, l = attention_reference(q[qs:qe].unsqueeze(0), k[ks:ke].unsqueeze(0), v[ks:ke].unsqueeze(0),
                                       causal=causal, softmax_scale=softmax_scale, window=window,
                                       layout="bshd", return_lse=True)
            outs.append(o[0])
            lses.append(l[0])
        out = torch.cat(outs, 0)
        lse = torch.cat(lses, 1)
        return (out, lse) if return_lse else out
    check_layout(layout)
    qh, kh, vh = (to_bhsd(t, layout).float() for t in (q, k, v))
    hq, hkv = qh.shape[1], kh.shape[1]
    if hq != hkv:
        kh = kh.repeat_interleave(hq // hkv, dim=1)
        vh = vh.repeat_interleave(hq // hkv, dim=1)
    scale = default_scale(q.shape[-1], softmax_scale)
    s = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    sq, sk = s.shape[-2], s.shape[-1]
    mask = visible_mask(sq, sk, causal, window, device=s.device)
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # -inf for rows that see nothing
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    out = torch.matmul(p, vh)
    out = out if layout == "bhsd" else out.transpose(1, 2)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- quantization
@dataclass
class QKQuantized:
    """Quantized Q/K (the fields of :class:`QKInt8`, plus the settings).

    q, k: int8 or float8_e4m3fn, same shape/layout as the inputs (k after smoothing).
    q_scale: fp32 (B, Hq, n_q_groups); k_scale: fp32 (B, Hkv, n_k_blocks); dequantized
    ``q·q_scale`` is ``q_in · softmax_scale · log2(e)``.  k_mean: fp32 (B, Hkv, 1, D) or None.
    """
    q: Tensor
    k: Tensor
    q_scale: Tensor
    k_scale: Tensor
    k_mean: Optional[Tensor]
    softmax_scale: float
    dtype: str = "int8"
    granularity: str = "per_block"
    block_q: int = 128
    block_k: int = 64
    warp_q: int = 32

    @property
    def q_scale_rows(self) -> int:
        """Consecutive query rows sharing one q_scale entry."""
        return self.warp_q if self.granularity == "per_warp" else self.block_q


def k_mean(k: Tensor, *, layout: str = "bhsd", cu_seqlens_k: Optional[Tensor] = None,
           max_seqlen_k: Optional[int] = None) -> Tensor:
    """Mean of K over the sequence in FP32: (B, Hkv, 1, D) (a packed sequence of length 0: zeros).

    The Triton prepass computes the same mean with its own FP32 summation order (``_triton.prepass_triton``: sums of
    chunks of rows added in order), so the two agree to FP32 rounding; ``quantize_qk_reference(..., k_mean=...)`` takes
    the prepass's mean where codes are compared bit for bit.
    """
    if cu_seqlens_k is not None:
        nb = cu_seqlens_k.numel() - 1
        lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()
        seg = torch.repeat_interleave(torch.arange(nb, device=k.device), lens, output_size=k.shape[0])
        pos = torch.arange(k.shape[0], device=k.device) - cu_seqlens_k.long()[seg]
        smax = int(max_seqlen_k) if max_seqlen_k is not None else int(lens.max())
        dense = k.new_zeros((nb, smax, k.shape[1], k.shape[2]), dtype=torch.float32)
        dense[seg, pos] = k.float()  # unique indices: deterministic
        s = dense.sum(dim=1)  # (B, H, D)
        return (s / lens.clamp(min=1).to(torch.float32)[:, None, None]).unsqueeze(2)
    # dtype= sums in FP32 while reading K in its own dtype (no FP32 copy of K, which cost as much as the quantization)
    return to_bhsd(k, layout).mean(dim=2, keepdim=True, dtype=torch.float32)


_k_mean = k_mean  # the name quantize_qk_reference reaches past its k_mean argument


def _quant_rows(x: Tensor, rows: int, qmax: float, dtype: str):
    """x fp32 (B, H, S, D): per group of ``rows`` rows scale = amax/qmax (0 -> 1).

    Returns codes (B, H, S, D) and scales (B, H, ceil(S/rows))."""
    b, h, s, d = x.shape
    ng = -(-s // rows)
    pad = ng * rows - s
    xp = torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x
    amax = xp.reshape(b, h, ng, rows * d).abs().amax(dim=-1)
    # tensor / tensor: on CUDA, torch divides by a Python scalar via its reciprocal (not correctly
    # rounded); the Triton prepass uses div.rn, so both must be true IEEE divisions.
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / torch.full_like(amax, qmax))
    # the quantizer multiplies by qmax / amax (NUMERICS §3: the scale multiplies x on the way in); one division
    # per group instead of one per element (the Triton prepass was bound by its per-element divisions)
    inv = torch.where(amax == 0, torch.ones_like(amax), torch.full_like(amax, qmax) / amax)
    y = x * inv.repeat_interleave(rows, dim=2)[:, :, :s, None]
    if dtype == "int8":
        codes = round_half_away(y).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    else:
        codes = to_e4m3(y)
    return codes, scale


def n_q_groups(seqlen_q: int, granularity: str, block_q: int, warp_q: int) -> int:
    """Number of q_scale entries per (batch, head) for ``seqlen_q`` rows (NUMERICS §3)."""
    nb = -(-seqlen_q // block_q)
    return nb * (block_q // warp_q) if granularity == "per_warp" else nb


def quantize_qk_reference(q: Tensor, k: Tensor, *, dtype: str = "int8", granularity: str = "per_block",
                          smooth_k: bool = True, block_q: int = 128, block_k: int = 64, warp_q: int = 32,
                          softmax_scale: Optional[float] = None, layout: str = "bhsd",
                          cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
                          max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                          k_mean: Optional[Tensor] = None) -> QKQuantized:
    """Quantize Q and K to INT8 (or FP8 E4M3) with SageAttention's scale shapes (module docstring).

    Dense: q (B, Hq, Sq, D)/(B, Sq, Hq, D), k likewise.  Varlen: packed (T, H, D) + cu_seqlens.
    ``k_mean`` (smooth_k, fp32 (B, Hkv, 1, D)): the mean to subtract instead of ``k_mean(k)``, e.g. the one a
    prepass computed, whose FP32 sum runs in another order (the codes then compare bit for bit).
    """
    if dtype not in QMAX:
        raise ValueError(f"dtype must be 'int8' or 'fp8', got {dtype!r}")
    check_blocks(granularity, block_q, block_k, warp_q)
    scale = default_scale(q.shape[-1], softmax_scale)
    qmax = QMAX[dtype]
    # Python float -> fp32 scalar, exactly as the Triton launcher passes it.
    mult = float(torch.tensor(scale * LOG2E, dtype=torch.float32))
    qrows = warp_q if granularity == "per_warp" else block_q
    if not smooth_k:
        km = None
    elif k_mean is not None:
        km = k_mean
    else:
        km = _k_mean(k, layout=layout, cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k)
    code_dtype = torch.int8 if dtype == "int8" else torch.float8_e4m3fn
    if cu_seqlens_q is not None:
        segs_q, segs_k = split_varlen(cu_seqlens_q), split_varlen(cu_seqlens_k)
        nb = len(segs_q)
        mq = max_seqlen_q or max(e - s for s, e in segs_q)
        mk = max_seqlen_k or max(e - s for s, e in segs_k)
        qs = torch.ones(nb, q.shape[1], n_q_groups(mq, granularity, block_q, warp_q), device=q.device)
        ks = torch.ones(nb, k.shape[1], -(-mk // block_k), device=q.device)
        qc = torch.empty_like(q, dtype=code_dtype)
        kc = torch.empty_like(k, dtype=code_dtype)
        for b, ((a0, a1), (c0, c1)) in enumerate(zip(segs_q, segs_k)):
            xq = q[a0:a1].transpose(0, 1).unsqueeze(0).float() * mult
            codes, sc = _quant_rows(xq, qrows, qmax, dtype)
            qc[a0:a1] = codes[0].transpose(0, 1)
            qs[b, :, : sc.shape[-1]] = sc[0]
            xk = k[c0:c1].transpose(0, 1).unsqueeze(0).float()
            if km is not None:
                xk = xk - km[b:b + 1]
            codes, sc = _quant_rows(xk, block_k, qmax, dtype)
            kc[c0:c1] = codes[0].transpose(0, 1)
            ks[b, :, : sc.shape[-1]] = sc[0]
        return QKQuantized(qc, kc, qs, ks, km, scale, dtype, granularity, block_q, block_k, warp_q)
    check_layout(layout)
    xq = to_bhsd(q, layout).float() * mult
    sq = xq.shape[2]
    # per-warp: pad to whole blocks first so trailing warp groups of the last block exist (scale 1)
    qcodes, qs = _quant_rows(xq, qrows, qmax, dtype)
    ng = n_q_groups(sq, granularity, block_q, warp_q)
    if qs.shape[-1] < ng:
        qs = torch.cat([qs, qs.new_ones(*qs.shape[:2], ng - qs.shape[-1])], dim=-1)
    xk = to_bhsd(k, layout).float()
    if km is not None:
        xk = xk - km
    kcodes, ks = _quant_rows(xk, block_k, qmax, dtype)
    if layout == "bshd":
        qcodes, kcodes = qcodes.transpose(1, 2), kcodes.transpose(1, 2)
    return QKQuantized(qcodes.contiguous(), kcodes.contiguous(), qs, ks, km, scale, dtype, granularity,
                       block_q, block_k, warp_q)


def _v_per_sequence(fn, v: Tensor, cu_seqlens_k: Tensor, dtype: torch.dtype):
    """Varlen V (packed (Tk, Hkv, D)) through the dense per-channel quantizer ``fn``, one sequence at a time:
    (converted V packed like v, scales (B, Hkv, D))."""
    out = torch.empty_like(v, dtype=dtype)
    scales = []
    for s0, s1 in split_varlen(cu_seqlens_k):
        o, sc = fn(v[s0:s1].unsqueeze(0), layout="bshd")
        out[s0:s1] = o[0]
        scales.append(sc[0])
    return out, torch.stack(scales, 0)


def quantize_v_fp8_reference(v: Tensor, *, layout: str = "bhsd", cu_seqlens_k: Optional[Tensor] = None):
    """V -> (float8_e4m3fn codes same shape/layout, fp32 scale (B, Hkv, D)).

    scale = amax over the sequence per (batch, head, channel) / 448 (amax == 0 -> 1);
    code = sat_rne(v · (448 / amax)).  Dequant: code * scale.  Varlen: per sequence.
    """
    if not isinstance(v, Tensor) or not v.is_floating_point():
        raise TypeError(f"v: expected a float16/bfloat16/float32 tensor, got {getattr(v, 'dtype', type(v))}")
    if cu_seqlens_k is not None:
        return _v_per_sequence(quantize_v_fp8_reference, v, cu_seqlens_k, torch.float8_e4m3fn)
    check_layout(layout)
    vh = to_bhsd(v, layout).float()
    amax = vh.abs().amax(dim=2)
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / torch.full_like(amax, E4M3_MAX))  # see _quant_rows
    inv = torch.where(amax == 0, torch.ones_like(amax), torch.full_like(amax, E4M3_MAX) / amax)
    codes = to_e4m3(vh * inv[:, :, None, :])
    if layout == "bshd":
        codes = codes.transpose(1, 2)
    return codes.contiguous(), scale


def v_fp16_scales(amax: Tensor) -> Tuple[Tensor, Tensor]:
    """(scale, multiplier) = (2^-e, 2^e) per channel for carrying BF16 V in FP16: e = 15 - floor(log2 amax),
    at most 126 (amax == 0 -> e = 0).  amax·2^e lies in [2^15, 2^16) and a BF16 mantissa is at most 1.9921875, so
    amax·2^e <= 65280 < 65504: no overflow; every value whose scaled magnitude is >= 2^-14 converts exactly."""
    ebits = (amax.contiguous().view(torch.int32) >> 23) & 0xFF
    e = torch.clamp(15 - (ebits - 127), max=126)
    e = torch.where(amax == 0, torch.zeros_like(e), e)
    mult = ((e + 127) << 23).view(torch.float32)
    scale = ((127 - e) << 23).view(torch.float32)
    return scale, mult


def quantize_v_fp16_reference(v: Tensor, *, layout: str = "bhsd", cu_seqlens_k: Optional[Tensor] = None):
    """BF16 V -> (float16 V same shape/layout, fp32 power-of-two scale (B, Hkv, D)) for FP16 P·V.

    v16 = fp16_rne(v · 2^e) per (batch, head, channel) with ``v_fp16_scales``; v ≈ v16 · scale exactly unless
    v·2^e falls below FP16's normal range (then round to nearest even).  Varlen: per sequence."""
    if cu_seqlens_k is not None:
        return _v_per_sequence(quantize_v_fp16_reference, v, cu_seqlens_k, torch.float16)
    check_layout(layout)
    vh = to_bhsd(v, layout).float()
    scale, mult = v_fp16_scales(vh.abs().amax(dim=2))
    v16 = (vh * mult[:, :, None, :]).to(torch.float16)
    if layout == "bshd":
        v16 = v16.transpose(1, 2)
    return v16.contiguous(), scale


def lse_smoothing_shift(q: Tensor, k_mean: Tensor, softmax_scale: float, *, layout: str = "bhsd",
                        cu_seqlens_q: Optional[Tensor] = None) -> Tensor:
    """``q · mean(k) · softmax_scale`` (natural-log units) from the *unquantized* q: what K smoothing
    removed from every score of a row, so ``LSE_true = LSE_smoothed + shift``.

    Returns (B, Hq, Sq) dense or (Hq, Tq) varlen, fp32.  (The kernel can only use the dequantized q;
    with the original q at hand this is the more accurate correction.)"""
    if cu_seqlens_q is not None:
        hq, hkv = q.shape[1], k_mean.shape[1]
        lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
        seg = torch.repeat_interleave(torch.arange(lens.numel(), device=q.device), lens, output_size=q.shape[0])
        km = k_mean[:, :, 0, :].repeat_interleave(hq // hkv, dim=1)[seg]  # (T, Hq, D)
        return ((q.float() * km).sum(-1) * softmax_scale).transpose(0, 1)
    qh = to_bhsd(q, layout).float()
    km = k_mean.repeat_interleave(qh.shape[1] // k_mean.shape[1], dim=1)
    return (qh * km).sum(-1) * softmax_scale


# ----------------------------------------------------------------------------- quantized attention
def attention_prequantized_reference(q: Tensor, k: Tensor, v: Tensor, q_scale: Optional[Tensor],
                                     k_scale: Optional[Tensor], *, v_scale: Optional[Tensor] = None,
                                     k_mean: Optional[Tensor] = None, q_scale_rows: int = 128,
                                     k_scale_rows: int = 64, softmax_scale: Optional[float] = None,
                                     causal: bool = False, window=None, layout: str = "bhsd",
                                     cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
                                     return_lse: bool = False, block_n: Optional[int] = None):
    """Attention on already-quantized operands, following the kernel's math step by step.

    * q, k int8 / float8_e4m3fn with q_scale, k_scale (scores = q·k · q_scale[row] · k_scale[col],
      in log2 units; ``softmax_scale`` is ignored) — or 16-bit q, k with q_scale = k_scale = None
      (scores = q·k · softmax_scale · log2 e in FP32).
    * v 16-bit (P rounded to v's dtype before P·V), or float8_e4m3fn with ``v_scale`` (B, Hkv, D):
      P·448 rounded to E4M3, output = (P8·V8) / l · v_scale / 448; or float16 with ``v_scale`` (BF16 V carried
      in FP16, ``quantize_v_fp16_reference``): P rounded to FP16, output = (P16·V16) / l · v_scale.
    * scores: s·c with c = q_scale[row]·k_scale[col] (or the 16-bit c), p = exp2(s·c - m), m = max(s·c): the
      kernel takes the max as c·max(s) (the same number) and fuses s·c - m into one FMA (differs in the last bit).
    * ``block_n``: None = exact softmax (row max over all keys); an int = the kernel's online
      softmax over key tiles of that width (P is quantized relative to the running max), so a
      kernel run with the same BLOCK_N matches to FP32-rounding level.
    * LSE (natural log) is corrected for K smoothing with the dequantized q, as the kernel does when
      given k_mean: + (q·q_scale)·k_mean · ln 2.
    Returns the output in FP32 (input layout) and optionally LSE.
    """
    if cu_seqlens_q is not None:
        outs, lses = [], []
        for b, ((qs0, qs1), (ks0, ks1)) in enumerate(zip(split_varlen(cu_seqlens_q), split_varlen(cu_seqlens_k))):
            def sl(t):
                return None if t is None else t[b:b + 1]
            o, l = attention_prequantized_reference(
                q[qs0:qs1].unsqueeze(0), k[ks0:ks1].unsqueeze(0), v[ks0:ks1].unsqueeze(0), sl(q_scale), sl(k_scale),
                v_scale=sl(v_scale), k_mean=sl(k_mean), q_scale_rows=q_scale_rows, k_scale_rows=k_scale_rows,
                softmax_scale=softmax_scale, causal=causal, window=window, layout="bshd", return_lse=True,
                block_n=block_n)
            outs.append(o[0])
            lses.append(l[0])
        out, lse = torch.cat(outs, 0), torch.cat(lses, 1)
        return (out, lse) if return_lse else out
    check_layout(layout)
    qh, kh, vh = (to_bhsd(t, layout) for t in (q, k, v))
    b, hq, sq, d = qh.shape
    hkv, sk = kh.shape[1], kh.shape[2]
    g = hq // hkv
    quant_qk = q_scale is not None
    qf = qh.float()
    kf = kh.float().repeat_interleave(g, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2))  # exact for int8 (|sum| < 2^24)
    if quant_qk:
        qs_row = q_scale[:, :, torch.arange(sq, device=q.device) // q_scale_rows]  # (B, Hq, Sq)
        ks_col = k_scale.repeat_interleave(g, dim=1)[:, :, torch.arange(sk, device=q.device) // k_scale_rows]
        s = s * (qs_row[..., :, None] * ks_col[..., None, :])
    else:
        c = float(torch.tensor(default_scale(d, softmax_scale) * LOG2E, dtype=torch.float32))
        s = s * c
    mask = visible_mask(sq, sk, causal, window, device=s.device)
    s = s.masked_fill(~mask, float("-inf"))
    pv_fp8 = v.dtype == torch.float8_e4m3fn
    vf = vh.float().repeat_interleave(g, dim=1)

    def p_round(p):
        return to_e4m3(p * E4M3_MAX).float() if pv_fp8 else p.to(v.dtype).float()

    if block_n is None:
        m = s.amax(dim=-1)
        m_use = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp2(s - m_use[..., None])
        l_sum = p.sum(-1)
        acc = torch.matmul(p_round(p), vf)
    else:
        m = torch.full((b, hq, sq), float("-inf"), device=s.device)
        l_sum = torch.zeros_like(m)
        acc = torch.zeros(b, hq, sq, d, device=s.device)
        for n0 in range(0, sk, block_n):
            st = s[..., n0:n0 + block_n]
            m_new = torch.maximum(m, st.amax(-1))
            m_use = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp2(st - m_use[..., None])
            alpha = torch.exp2(m - m_use)
            l_sum = l_sum * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + torch.matmul(p_round(p), vf[..., n0:n0 + block_n, :])
            m = m_new
    out = acc / torch.where(l_sum == 0, torch.ones_like(l_sum), l_sum)[..., None]
    if v_scale is not None:  # FP8 V, or BF16 V carried in FP16
        vsc = (v_scale / E4M3_MAX if pv_fp8 else v_scale).repeat_interleave(g, dim=1)  # (B, Hq, D)
        out = out * vsc[:, :, None, :]
    lse2 = m + torch.log2(l_sum)
    if k_mean is not None and quant_qk:
        corr = (qf * k_mean.repeat_interleave(g, dim=1)).sum(-1) * qs_row
        lse2 = lse2 + corr
    lse = lse2 * LN2
    out = out if layout == "bhsd" else out.transpose(1, 2)
    return (out, lse) if return_lse else out


def attention_quantized_reference(q: Tensor, k: Tensor, v: Tensor, *, qk: str = "int8", pv: str = "bf16",
                                  granularity: str = "per_block", smooth_k: bool = True, block_q: int = 128,
                                  block_k: int = 64, warp_q: int = 32, causal: bool = False,
                                  softmax_scale: Optional[float] = None, window=None, layout: str = "bhsd",
                                  cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
                                  max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                                  return_lse: bool = False, block_n: Optional[int] = None):
    """Quantize (prepass reference) then run ``attention_prequantized_reference``.

    qk: "int8" | "fp8" | "bf16" (16-bit: the inputs' own dtype); pv: "bf16" (V in its own dtype: P rounded to
    it) | "fp16" (BF16 V carried in FP16 under power-of-two scales; FP16 V as is) | "fp8".
    q, k, v: 16-bit float tensors (fp32 also accepted here).  Output FP32.
    """
    varlen = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    if qk in ("int8", "fp8"):
        qq = quantize_qk_reference(q, k, dtype=qk, granularity=granularity, smooth_k=smooth_k, block_q=block_q,
                                   block_k=block_k, warp_q=warp_q, softmax_scale=softmax_scale, layout=layout,
                                   max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, **varlen)
        qa, ka, qs, ks, km, rows = qq.q, qq.k, qq.q_scale, qq.k_scale, qq.k_mean, qq.q_scale_rows
    else:
        qa, ka, qs, ks, km, rows = q, k, None, None, None, block_q
    if pv == "fp8":
        va, vs = quantize_v_fp8_reference(v, layout=layout, cu_seqlens_k=cu_seqlens_k)
    elif pv == "fp16" and v.dtype == torch.bfloat16:
        va, vs = quantize_v_fp16_reference(v, layout=layout, cu_seqlens_k=cu_seqlens_k)
    else:
        va, vs = v, None
    res = attention_prequantized_reference(qa, ka, va, qs, ks, v_scale=vs, k_mean=None, q_scale_rows=rows,
                                           k_scale_rows=block_k, softmax_scale=softmax_scale, causal=causal,
                                           window=window, layout=layout, return_lse=return_lse, block_n=block_n,
                                           **varlen)
    if not return_lse:
        return res
    out, lse = res
    if km is not None:  # exact smoothing correction from the unquantized q (as ``attention`` does)
        lse = lse + lse_smoothing_shift(q, km, default_scale(q.shape[-1], softmax_scale), layout=layout,
                                        cu_seqlens_q=cu_seqlens_q)
    return out, lse


# ----------------------------------------------------------------------------- dropout (Philox) and the 16-bit
# forward / backward with it (``lowbit.attention.backward``'s references)
def dropout_keep_mask(seed: int, offset: int, shape, p: float, *, device=None, batch_start: int = 0,
                      index_seqlens: Optional[Tuple[int, int]] = None) -> Tensor:
    """Bool keep-mask (B, H, Sq, Sk) of the Philox dropout rule in the module docstring.

    ``index_seqlens=(Sq_idx, Sk_idx)`` sets the counter geometry when it differs from the mask's
    own (Sq, Sk) (varlen: the max sequence lengths); ``batch_start`` shifts the batch index.
    """
    b, h, sq, sk = (int(x) for x in shape)
    isq, isk = index_seqlens if index_seqlens is not None else (sq, sk)
    bi = torch.arange(batch_start, batch_start + b, device=device, dtype=torch.int64).view(b, 1, 1, 1)
    hi = torch.arange(h, device=device, dtype=torch.int64).view(1, h, 1, 1)
    ii = torch.arange(sq, device=device, dtype=torch.int64).view(1, 1, sq, 1)
    jj = torch.arange(sk, device=device, dtype=torch.int64).view(1, 1, 1, sk)
    idx = int(offset) + ((bi * h + hi) * isq + ii) * isk + jj
    r = philox_randint(int(seed), idx)
    u = (r >> 8).to(torch.float32) * (2.0 ** -24)
    return u >= torch.tensor(float(p), dtype=torch.float32, device=device)


def _dense_forward_ref(q, k, v, *, causal, scale, window, dropout_p, seed, offset, dtype, batch_start=0,
                       index_seqlens=None, hq_total=None):
    """(B, H, S, D) tensors -> (out, lse, p, keep).  Differentiable."""
    qh, kh, vh = (t.to(dtype) for t in (q, k, v))
    hq, hkv = qh.shape[1], kh.shape[1]
    if hq != hkv:
        kh = kh.repeat_interleave(hq // hkv, dim=1)
        vh = vh.repeat_interleave(hq // hkv, dim=1)
    s = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    sq, sk = s.shape[-2], s.shape[-1]
    mask = visible_mask(sq, sk, causal, window, device=s.device)
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).detach()
    p = torch.exp(s - safe[..., None])
    # normalise explicitly (gradient flows through the sum, not through the detached shift)
    denom = p.sum(-1, keepdim=True)
    p = p / torch.where(denom == 0, torch.ones_like(denom), denom)
    keep = None
    pd = p
    if dropout_p > 0.0:
        keep = dropout_keep_mask(seed, offset, s.shape, dropout_p, device=s.device, batch_start=batch_start,
                                 index_seqlens=index_seqlens)
        pd = p * keep.to(dtype) * (1.0 / (1.0 - dropout_p))
    out = torch.matmul(pd, vh)
    return out, lse, p, keep


def attention_forward_reference(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                                softmax_scale: Optional[float] = None, window=None, dropout_p: float = 0.0,
                                seed: Optional[int] = None, offset: int = 0, layout: str = "bhsd",
                                cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
                                max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                                dtype: torch.dtype = torch.float32):
    """Reference forward with Philox dropout, computed in ``dtype`` (FP32 or FP64), differentiable.

    Shapes/layouts as ``attention_reference``.  Returns (out in ``dtype`` and the input layout,
    LSE (B, Hq, Sq) / (Hq, Tq) in ``dtype``, natural log, of the un-dropped softmax).
    """
    check_dropout(dropout_p, seed)
    scale = default_scale(q.shape[-1], softmax_scale)
    if cu_seqlens_q is not None:
        segs_q, segs_k = split_varlen(cu_seqlens_q), split_varlen(cu_seqlens_k)
        mq = max_seqlen_q or max(e - s for s, e in segs_q)
        mk = max_seqlen_k or max(e - s for s, e in segs_k)
        outs, lses = [], []
        for b, ((a0, a1), (c0, c1)) in enumerate(zip(segs_q, segs_k)):
            o, l, _, _ = _dense_forward_ref(q[a0:a1].transpose(0, 1)[None], k[c0:c1].transpose(0, 1)[None],
                                            v[c0:c1].transpose(0, 1)[None], causal=causal, scale=scale,
                                            window=window, dropout_p=dropout_p, seed=seed, offset=offset,
                                            dtype=dtype, batch_start=b, index_seqlens=(mq, mk))
            outs.append(o[0].transpose(0, 1))
            lses.append(l[0])
        return torch.cat(outs, 0), torch.cat(lses, 1)
    check_layout(layout)
    qh, kh, vh = (to_bhsd(t, layout) for t in (q, k, v))
    out, lse, _, _ = _dense_forward_ref(qh, kh, vh, causal=causal, scale=scale, window=window, dropout_p=dropout_p,
                                        seed=seed, offset=offset, dtype=dtype)
    return (out if layout == "bhsd" else out.transpose(1, 2)), lse


def _dense_backward_ref(do, q, k, v, lse, *, causal, scale, window, dropout_p, seed, offset, dtype,
                        batch_start=0, index_seqlens=None):
    """Explicit FlashAttention backward formulas on (B, H, S, D) tensors, in ``dtype``."""
    qh, kh, vh, doh = (t.to(dtype) for t in (q, k, v, do))
    hq, hkv = qh.shape[1], kh.shape[1]
    g = hq // hkv
    kr = kh.repeat_interleave(g, dim=1) if g > 1 else kh
    vr = vh.repeat_interleave(g, dim=1) if g > 1 else vh
    s = torch.matmul(qh, kr.transpose(-1, -2)) * scale
    sq, sk = s.shape[-2], s.shape[-1]
    mask = visible_mask(sq, sk, causal, window, device=s.device)
    if lse is None:
        lse = torch.logsumexp(s.masked_fill(~mask, float("-inf")), dim=-1)
    lse = lse.to(dtype)
    safe = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse)
    p = torch.exp(s - safe[..., None]).masked_fill(~mask, 0.0)  # P = exp(S - LSE)
    dp = torch.matmul(doh, vr.transpose(-1, -2))
    pd = p
    if dropout_p > 0.0:
        keep = dropout_keep_mask(seed, offset, s.shape, dropout_p, device=s.device, batch_start=batch_start,
                                 index_seqlens=index_seqlens).to(dtype)
        c = 1.0 / (1.0 - dropout_p)
        pd = p * keep * c
        dp = dp * keep * c
    dv = torch.matmul(pd.transpose(-1, -2), doh)
    delta = (p * dp).sum(-1, keepdim=True)  # = rowsum(dO · O)
    ds = p * (dp - delta)
    dq = torch.matmul(ds, kr) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qh) * scale
    if g > 1:
        b, _, skk, d = dk.shape
        dk = dk.view(b, hkv, g, skk, d).sum(2)
        dv = dv.view(b, hkv, g, skk, d).sum(2)
    return dq, dk, dv


def attention_backward_reference(do: Tensor, q: Tensor, k: Tensor, v: Tensor, *, lse: Optional[Tensor] = None,
                                 causal: bool = False, softmax_scale: Optional[float] = None, window=None,
                                 dropout_p: float = 0.0, seed: Optional[int] = None, offset: int = 0,
                                 layout: str = "bhsd", cu_seqlens_q: Optional[Tensor] = None,
                                 cu_seqlens_k: Optional[Tensor] = None, max_seqlen_q: Optional[int] = None,
                                 max_seqlen_k: Optional[int] = None, dtype: torch.dtype = torch.float32):
    """(dq, dk, dv) of ``attention_forward_reference`` by the explicit backward formulas, in ``dtype``.

    ``P = exp(S·scale - LSE)`` (masked, ``keep``-scaled for dropout), ``dV = Pdᵀ dO``,
    ``dP = (dO Vᵀ) ∘ keep / (1-p)``, ``dS = P ∘ (dP - rowsum(P ∘ dP))``, ``dQ = scale·dS K``,
    ``dK = scale·dSᵀ Q`` (dK/dV summed over each GQA group).  With ``lse`` given (the forward's
    LSE) P is built from it, as the kernels do; otherwise from the exact softmax.
    Inputs in any float dtype; outputs in the input layout.
    """
    check_dropout(dropout_p, seed)
    scale = default_scale(q.shape[-1], softmax_scale)
    kw = dict(causal=causal, scale=scale, window=window, dropout_p=dropout_p, seed=seed, offset=offset, dtype=dtype)
    if cu_seqlens_q is not None:
        segs_q, segs_k = split_varlen(cu_seqlens_q), split_varlen(cu_seqlens_k)
        mq = max_seqlen_q or max(e - s for s, e in segs_q)
        mk = max_seqlen_k or max(e - s for s, e in segs_k)
        dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
        dk = torch.zeros(k.shape, dtype=dtype, device=q.device)
        dv = torch.zeros(v.shape, dtype=dtype, device=q.device)
        for b, ((a0, a1), (c0, c1)) in enumerate(zip(segs_q, segs_k)):
            t = lambda x, s0, s1: x[s0:s1].transpose(0, 1)[None]  # noqa: E731
            l_b = None if lse is None else lse[:, a0:a1][None]
            gq, gk, gv = _dense_backward_ref(t(do, a0, a1), t(q, a0, a1), t(k, c0, c1), t(v, c0, c1), l_b,
                                             batch_start=b, index_seqlens=(mq, mk), **kw)
            dq[a0:a1] = gq[0].transpose(0, 1)
            dk[c0:c1] = gk[0].transpose(0, 1)
            dv[c0:c1] = gv[0].transpose(0, 1)
        return dq, dk, dv
    check_layout(layout)
    bh = lambda x: to_bhsd(x, layout)  # noqa: E731
    gq, gk, gv = _dense_backward_ref(bh(do), bh(q), bh(k), bh(v), lse, **kw)
    if layout == "bshd":
        gq, gk, gv = (x.transpose(1, 2).contiguous() for x in (gq, gk, gv))
    return gq, gk, gv


# ----------------------------------------------------------------------------- dense INT8 Q/K with typed checks
@dataclass
class QKInt8:
    """Result of :func:`quantize_qk_int8`.

    Attributes:
        q: int8, same shape and layout as the input q (q · softmax_scale · log2(e), quantized).
        k: int8, same shape and layout as the input k (after subtracting ``k_mean`` when smoothing).
        q_scale: float32 (B, Hq, ceil(Sq/block_q)·(block_q/warp_q)) per_warp, (B, Hq, ceil(Sq/block_q)) per_block.
        k_scale: float32 (B, Hkv, ceil(Sk/block_k)).
        k_mean: float32 (B, Hkv, 1, D), mean of K over the sequence, or None without smoothing.
        softmax_scale: the softmax scale folded into q (with log2(e)), so q·q_scale · k·k_scale is a score in log2
            units.
        granularity, block_q, block_k, warp_q: the settings used.
    """

    q: torch.Tensor
    k: torch.Tensor
    q_scale: torch.Tensor
    k_scale: torch.Tensor
    k_mean: Optional[Tensor]
    softmax_scale: float
    granularity: str = "per_block"
    block_q: int = 128
    block_k: int = 64
    warp_q: int = 32


def _checked_bhsd(t: torch.Tensor, layout: str, name: str) -> torch.Tensor:
    if t.dim() != 4:
        raise ValueError(f"{name}: expected a 4-D tensor in layout {layout!r}, got shape {tuple(t.shape)}")
    if layout == "bhsd":
        return t
    if layout == "bshd":
        return t.transpose(1, 2)
    raise ValueError(f"layout: expected 'bhsd' or 'bshd', got {layout!r}")


def quantize_qk_int8(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    granularity: str = "per_block",
    smooth_k: bool = True,
    block_q: int = 128,
    block_k: int = 64,
    warp_q: int = 32,
    softmax_scale: Optional[float] = None,
    layout: str = "bhsd",
) -> QKInt8:
    """INT8 quantization of Q and K for attention (SageAttention conventions, NUMERICS §3) — the reference.

    This is the spec the kernels are tested against and runs in PyTorch on any device; the fused Triton prepass
    (one launch each for Q and K on CUDA, bit-identical to this) is :func:`lowbit.attention.quantize_qk`.

    Args:
        q: (B, Hq, Sq, D) for ``layout="bhsd"`` or (B, Sq, Hq, D) for ``"bshd"``; float16/bfloat16/float32.
        k: (B, Hkv, Sk, D) / (B, Sk, Hkv, D); Hq must be divisible by Hkv.
        granularity: ``"per_block"`` (one scale per ``block_q`` query rows) or ``"per_warp"`` (one per ``warp_q`` rows).
        smooth_k: subtract the per-(b, h, channel) mean of K over the sequence before quantizing
            (softmax is unchanged; the LSE shifts by q·k_mean·softmax_scale).
        softmax_scale: default 1/sqrt(D). Q is multiplied by ``softmax_scale · log2(e)`` (float32) first.

    Scales are amax / 127 over the group (amax = 0 -> 1); INT8 rounds half away from zero.
    """
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name}: expected a float16/bfloat16/float32 tensor, got {getattr(t, 'dtype', type(t))}")
    qb, kb = _checked_bhsd(q, layout, "q"), _checked_bhsd(k, layout, "k")
    B, Hq, Sq, D = qb.shape
    if kb.shape[0] != B or kb.shape[3] != D:
        raise ValueError(f"k: batch and head dim must match q's ({B}, {D}), got shape {tuple(k.shape)} "
                         f"(layout {layout})")
    Hkv = kb.shape[1]
    if Hq % Hkv:
        raise ValueError(f"k: the number of query heads ({Hq}) must be divisible by the number of key/value heads, "
                         f"got {Hkv}")
    if granularity not in ("per_block", "per_warp"):
        raise ValueError(f"granularity: expected 'per_block' or 'per_warp', got {granularity!r}")
    if granularity == "per_warp" and (warp_q <= 0 or block_q % warp_q):
        raise ValueError(f"warp_q: must divide block_q ({block_q}), got {warp_q}")
    r = quantize_qk_reference(q, k, dtype="int8", granularity=granularity, smooth_k=smooth_k, block_q=block_q,
                              block_k=block_k, warp_q=warp_q, softmax_scale=softmax_scale, layout=layout)
    return QKInt8(q=r.q, k=r.k, q_scale=r.q_scale, k_scale=r.k_scale, k_mean=r.k_mean, softmax_scale=r.softmax_scale,
                  granularity=granularity, block_q=block_q, block_k=block_k, warp_q=warp_q)
