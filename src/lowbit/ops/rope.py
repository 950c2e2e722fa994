"""Rotate-half RoPE on a packed QKV tensor, fused: one kernel reads the (B, T, 3, H, D) output of the QKV
projection once and writes rotated Q, rotated K and V as separate (B, T, H, D) tensors (handed to attention as
(B, H, T, D) views); the backward is the same kernel with the rotation transposed, writing dQKV in the packed
layout. In the unfused torch form (x·cos + rotate_half(x)·sin on strided views) this was ~30% of a BF16 step
of the 350m GPT on an H200 (broadcast multiplies, a cat and copies on non-contiguous tensors).

Numerics (both paths): FP32 math, one rounding to the input dtype:
``out[:h] = x[:h]·cos[:h] − x[h:]·sin[:h]``, ``out[h:] = x[h:]·cos[h:] + x[:h]·sin[h:]`` (h = D/2).
The kernel may contract a·b ± c·d into FMAs, so it agrees with :func:`rope_qkv_reference` to within one
rounding of the output dtype (tests/ops/test_rope.py), not bit for bit.
"""

from __future__ import annotations

import os

import torch

__all__ = ["rope_qkv", "rope_qkv_reference", "apply_rope"]

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without Triton use the reference
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x`` (..., D) with ``cos``/``sin`` broadcastable to it: x·cos + rotate_half(x)·sin in
    FP32, one rounding to ``x.dtype`` (the math every RoPE path here follows)."""
    h = x.shape[-1] // 2
    xf = x.float()
    rot = torch.cat([-xf[..., h:], xf[..., :h]], dim=-1)
    return (xf * cos.float() + rot * sin.float()).to(x.dtype)


def rope_qkv_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The spec. ``qkv``: (B, T, 3, H, D); ``cos``/``sin``: (T, D) float32 (rotate-half tables, e.g.
    :func:`lowbit.models.gpt.rope_tables`). Returns q, k, v, each (B, H, T, D) in ``qkv.dtype``."""
    _check(qkv, cos, sin)
    T = qkv.shape[1]
    c, s = cos[None, :T, None, :], sin[None, :T, None, :]
    q, k, v = qkv.unbind(2)
    return apply_rope(q, c, s).transpose(1, 2), apply_rope(k, c, s).transpose(1, 2), v.transpose(1, 2)


def _check(qkv, cos, sin):
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"qkv: expected a (B, T, 3, H, D) tensor, got shape {tuple(getattr(qkv, 'shape', ()))}")
    if not qkv.is_floating_point():
        raise TypeError(f"qkv: expected a floating-point tensor, got {qkv.dtype}")
    B, T, _, H, D = qkv.shape
    if D % 2:
        raise ValueError(f"qkv: head_dim must be even for rotate-half RoPE, got {D}")
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] < T or t.shape[1] != D:
            raise ValueError(f"{name}: expected a (>= {T}, {D}) table, got shape {tuple(getattr(t, 'shape', ()))}")
        if t.device != qkv.device:
            raise ValueError(f"{name}: must be on {qkv.device}, got {t.device}")


if triton is not None:

    @triton.jit
    def _rope_kernel(s0, s1, s2, d0, d1, d2, cos_ptr, sin_ptr, T, H, src_row, dst_row, tab_row,
                     D: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                     SIGN: tl.constexpr):
        """One token row: parts 0 and 1 rotated (SIGN=+1 forward, -1 backward = the transposed rotation),
        part 2 copied. Sources/destinations: three pointers each, rows ``src_row`` / ``dst_row`` elements
        apart, heads contiguous inside a row (h * D + d)."""
        row = tl.program_id(0).to(tl.int64)
        t = row % T
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h[:, None] < H) & (offs_d[None, :] < HALF)
        c1 = tl.load(cos_ptr + t * tab_row + offs_d, mask=offs_d < HALF, other=0.0)[None, :]
        c2 = tl.load(cos_ptr + t * tab_row + HALF + offs_d, mask=offs_d < HALF, other=0.0)[None, :]
        sn1 = tl.load(sin_ptr + t * tab_row + offs_d, mask=offs_d < HALF, other=0.0)[None, :] * SIGN
        sn2 = tl.load(sin_ptr + t * tab_row + HALF + offs_d, mask=offs_d < HALF, other=0.0)[None, :] * SIGN
        inner = offs_h[:, None] * D + offs_d[None, :]
        src = row * src_row + inner
        dst = row * dst_row + inner
        for p in tl.static_range(2):
            sp = s0 if p == 0 else s1
            dp = d0 if p == 0 else d1
            x1 = tl.load(sp + src, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(sp + src + HALF, mask=mask, other=0.0).to(tl.float32)
            if SIGN > 0:  # out = R x
                o1 = x1 * c1 - x2 * sn1
                o2 = x2 * c2 + x1 * sn2
            else:  # dx = R^T g (sn* already negated)
                o1 = x1 * c1 - x2 * sn2
                o2 = x2 * c2 + x1 * sn1
            tl.store(dp + dst, o1.to(dp.dtype.element_ty), mask=mask)
            tl.store(dp + dst + HALF, o2.to(dp.dtype.element_ty), mask=mask)
        v1 = tl.load(s2 + src, mask=mask, other=0.0)
        v2 = tl.load(s2 + src + HALF, mask=mask, other=0.0)
        tl.store(d2 + dst, v1, mask=mask)
        tl.store(d2 + dst + HALF, v2, mask=mask)


def _launch(srcs, dsts, cos, sin, rows, T, H, D, src_row, dst_row, sign):
    half = D // 2
    bh = triton.next_power_of_2(H)
    bd = triton.next_power_of_2(half)
    warps = 4 if bh * bd <= 2048 else 8
    _rope_kernel[(rows,)](*srcs, *dsts, cos, sin, T, H, src_row, dst_row, cos.stride(0), D=D, HALF=half,
                          BLOCK_H=bh, BLOCK_D=bd, SIGN=sign, num_warps=warps)


class _RopeQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin):
        B, T, _, H, D = qkv.shape
        qkv = qkv.contiguous()
        outs = [torch.empty(B, T, H, D, dtype=qkv.dtype, device=qkv.device) for _ in range(3)]
        _launch([qkv[:, :, i] for i in range(3)], outs, cos, sin, B * T, T, H, D, 3 * H * D, H * D, 1)
        ctx.save_for_backward(cos, sin)
        ctx.shape = (B, T, H, D)
        return tuple(o.transpose(1, 2) for o in outs)

    @staticmethod
    def backward(ctx, gq, gk, gv):
        cos, sin = ctx.saved_tensors
        B, T, H, D = ctx.shape
        like = next(g for g in (gq, gk, gv) if g is not None)
        gs = [torch.zeros(B, T, H, D, dtype=like.dtype, device=like.device) if g is None else g.transpose(1, 2).contiguous()
              for g in (gq, gk, gv)]
        dqkv = torch.empty(B, T, 3, H, D, dtype=like.dtype, device=like.device)
        _launch(gs, [dqkv[:, :, i] for i in range(3)], cos, sin, B * T, T, H, D, H * D, 3 * H * D, -1)
        return dqkv, None, None


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate-half RoPE on Q and K of a packed QKV tensor; differentiable.

    Args:
        qkv: (B, T, 3, H, D) float32 / bfloat16 / float16 — the QKV projection's output viewed as
            (tokens, [q|k|v], heads, head_dim).
        cos, sin: (>= T, D) float32 tables (row t used for position t).

    Returns:
        q, k, v: (B, H, T, D) views of (B, T, H, D)-contiguous tensors in ``qkv.dtype``; q and k rotated.

    On CUDA with Triton: one fused kernel each way; elsewhere :func:`rope_qkv_reference`.
    """
    _check(qkv, cos, sin)
    if triton is None or not (qkv.is_cuda or INTERPRET):
        return rope_qkv_reference(qkv, cos, sin)
    cos = cos.float().contiguous()
    sin = sin.float().contiguous()
    return _RopeQKV.apply(qkv, cos, sin)
