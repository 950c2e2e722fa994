"""Rotate-half RoPE on a packed QKV tensor, fused: one kernel reads the (B, T, 3, H, D) output of the QKV
projection once and writes rotated Q, rotated K and V as separate (B, T, H, D) tensors (handed to attention as
(B, H, T, D) views); the backward is the same kernel with the rotation transposed, writing dQKV in the packed
layout. In the unfused torch form (x·cos + rotate_half(x)·sin on strided views) this was ~30% of a BF16 step
of the 350m GPT (broadcast multiplies, a cat and copies on non-contiguous tensors).

Numerics (both paths): FP32 math, one rounding to the input dtype:
``out[:h] = x[:h]·cos[:h] − x[h:]·sin[:h]``, ``out[h:] = x[h:]·cos[h:] + x[:h]·sin[h:]`` (h = D/2).
The kernel computes each output as one FMA over the other rounded product (fma(x2, ∓sin, x1·cos)), so it agrees
with :func:`rope_qkv_reference` to within one rounding of the output dtype (tests/ops/test_rope.py), not bit for
bit. Its backward can run inside the QKV projection's 1x128 grad_output quantizer instead
(:func:`rope_backward_quantize_1x128`, same bits): ``rope_qkv(..., grad_sink=...)``.
"""

from __future__ import annotations

import torch

from ..quant.schemes import BLOCK_SIZE, Float8Blockwise
from ..runtime.autotune import bucket
from ..runtime.device import INTERPRET
from ..runtime.launch import launcher
from ..runtime.log import declined

__all__ = ["rope_qkv", "rope_qkv_reference", "rope_qkv_backward_reference", "rope_qkv_op", "rope_qkv_backward_op",
           "apply_rope", "rope_backward_quantize_1x128", "rope_backward_fused_quant_supported"]

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without Triton use the reference
    triton = None

if triton is not None:
    from ..quant.triton_backend import regs_ok, rowcol_regs_prologue



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
    _check_tables(qkv.shape[1], qkv.shape[-1], qkv.device, cos, sin)


def _check_tables(T, D, device, cos, sin, what="qkv"):
    if D % 2:
        raise ValueError(f"{what}: head_dim must be even for rotate-half RoPE, got {D}")
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] < T or t.shape[1] != D:
            raise ValueError(f"{name}: expected a (>= {T}, {D}) table, got shape {tuple(getattr(t, 'shape', ()))}")
        if t.device != device:
            raise ValueError(f"{name}: must be on {device}, got {t.device}")


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
            # one explicit FMA an output (x·cos rounded, then the other product added in it): the fused
            # quantizer (quant_gluon._rope_bwd_half) computes the backward the same way, bit for bit
            if SIGN > 0:  # out = R x
                o1 = tl.fma(x2, -sn1, x1 * c1)
                o2 = tl.fma(x1, sn2, x2 * c2)
            else:  # dx = R^T g (sn* already negated)
                o1 = tl.fma(x2, -sn2, x1 * c1)
                o2 = tl.fma(x1, sn1, x2 * c2)
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
    launcher(_rope_kernel)[(rows,)](*srcs, *dsts, cos, sin, T, H, src_row, dst_row, cos.stride(0), D=D, HALF=half,
                                    BLOCK_H=bh, BLOCK_D=bd, SIGN=sign, num_warps=warps)


def _kernel_runs(t: torch.Tensor) -> bool:
    """Whether the fused kernel takes ``t``'s device: Triton on CUDA, or Triton's interpreter."""
    return triton is not None and (t.is_cuda or INTERPRET)


def _forward_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> list[torch.Tensor]:
    """q (rotated), k (rotated), v of a (B, T, 3, H, D) tensor as three new (B, T, H, D) contiguous tensors: the
    kernel (cos, sin float32 with unit column stride)."""
    B, T, _, H, D = qkv.shape
    qkv = qkv.contiguous()
    outs = [torch.empty(B, T, H, D, dtype=qkv.dtype, device=qkv.device) for _ in range(3)]
    _launch([qkv[:, :, i] for i in range(3)], outs, cos, sin, B * T, T, H, D, 3 * H * D, H * D, 1)
    return outs


class _RopeQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, grad_sink):
        B, T, _, H, D = qkv.shape
        outs = _forward_qkv(qkv, cos, sin)
        ctx.save_for_backward(cos, sin)
        ctx.shape = (B, T, H, D)
        ctx.grad_sink = grad_sink
        return tuple(o.transpose(1, 2) for o in outs)

    @staticmethod
    def backward(ctx, gq, gk, gv):
        cos, sin = ctx.saved_tensors
        B, T, H, D = ctx.shape
        if ctx.grad_sink is not None and all(g is not None for g in (gq, gk, gv)):
            gs = [g.transpose(1, 2) for g in (gq, gk, gv)]  # (B, T, H, D): contiguous as the attention writes them
            placeholder = ctx.grad_sink(*gs, cos, sin)
            if placeholder is not None:  # dqkv went to the QKV projection quantized: autograd gets a stand-in
                return placeholder.expand(B, T, 3, H, D), None, None, None
        gs = _dense_grads([None if g is None else g.transpose(1, 2) for g in (gq, gk, gv)], (B, T, H, D))
        return _backward_dqkv(gs, cos, sin), None, None, None


def _dense_grads(gs, shape) -> list[torch.Tensor]:
    """The gradients of q, k, v as (B, T, H, D) contiguous tensors, zeros for those autograd left None."""
    like = next(g for g in gs if g is not None)
    return [torch.zeros(shape, dtype=like.dtype, device=like.device) if g is None else g.contiguous() for g in gs]


def _backward_dqkv(gs, cos, sin) -> torch.Tensor:
    """dqkv (B, T, 3, H, D) from the gradients of rope_qkv's q, k, v as (B, T, H, D) contiguous tensors: the
    kernel with the rotation transposed."""
    B, T, H, D = gs[0].shape
    dqkv = torch.empty(B, T, 3, H, D, dtype=gs[0].dtype, device=gs[0].device)
    _launch(gs, [dqkv[:, :, i] for i in range(3)], cos, sin, B * T, T, H, D, H * D, 3 * H * D, -1)
    return dqkv


def rope_qkv_backward_reference(gq: torch.Tensor, gk: torch.Tensor, gv: torch.Tensor, cos: torch.Tensor,
                                sin: torch.Tensor) -> torch.Tensor:
    """The spec of the backward: dqkv (B, T, 3, H, D) in gq's dtype from the (B, T, H, D) gradients of q, k, v:
    ``dx[:h] = g[:h]·cos[:h] + g[h:]·sin[h:]``, ``dx[h:] = g[h:]·cos[h:] − g[:h]·sin[:h]`` (the rotation transposed)
    in FP32, one rounding; dv = gv. The values autograd computes through :func:`rope_qkv_reference` (the same two
    products and one sum an element)."""
    T, D = gq.shape[1], gq.shape[-1]
    h = D // 2
    c, s = cos[None, :T, None, :].float(), sin[None, :T, None, :].float()

    def rot_t(g):
        gf = g.float()
        return torch.cat([gf[..., :h] * c[..., :h] + gf[..., h:] * s[..., h:],
                          gf[..., h:] * c[..., h:] - gf[..., :h] * s[..., :h]], dim=-1).to(g.dtype)

    return torch.stack([rot_t(gq), rot_t(gk), gv.to(gq.dtype)], dim=2)


# ------------------------------------------------------------------------------------------------
# rope_qkv as torch.library operators: what torch.compile traces (eager calls run _RopeQKV)
# ------------------------------------------------------------------------------------------------
@torch.library.custom_op("lowbit::rope_qkv", mutates_args=())
def rope_qkv_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor]:
    """Rotate-half RoPE on a packed ``qkv`` (B, T, 3, H, D) with (>= T, D) ``cos``/``sin`` tables: q (rotated),
    k (rotated), v, each a new (B, T, H, D) contiguous tensor in qkv's dtype. The fused kernel on CUDA (or under
    Triton's interpreter), the bits :func:`rope_qkv` computes there; elsewhere :func:`rope_qkv_reference`.
    Differentiable: the backward is ``lowbit::rope_qkv_backward``."""
    _check(qkv, cos, sin)
    if _kernel_runs(qkv):
        return tuple(_forward_qkv(qkv, cos.float().contiguous(), sin.float().contiguous()))
    T = qkv.shape[1]
    c, s = cos[None, :T, None, :], sin[None, :T, None, :]
    return (apply_rope(qkv[:, :, 0], c, s).contiguous(), apply_rope(qkv[:, :, 1], c, s).contiguous(),
            qkv[:, :, 2].clone(memory_format=torch.contiguous_format))


@rope_qkv_op.register_fake
def _(qkv, cos, sin):
    _check(qkv, cos, sin)
    B, T, _, H, D = qkv.shape
    return tuple(qkv.new_empty((B, T, H, D)) for _ in range(3))


@torch.library.custom_op("lowbit::rope_qkv_backward", mutates_args=())
def rope_qkv_backward_op(gq: torch.Tensor, gk: torch.Tensor, gv: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor) -> torch.Tensor:
    """The gradient dqkv (B, T, 3, H, D), a new contiguous tensor in gq's dtype, of ``lowbit::rope_qkv`` from the
    (B, T, H, D) gradients of its q, k, v (one shape and dtype; any strides): the kernel with the rotation transposed
    on CUDA (or under Triton's interpreter), the bits rope_qkv's eager backward computes there; elsewhere
    :func:`rope_qkv_backward_reference`."""
    _check_grads(gq, gk, gv, cos, sin)
    if _kernel_runs(gq):
        return _backward_dqkv([g.contiguous() for g in (gq, gk, gv)], cos.float().contiguous(),
                              sin.float().contiguous())
    return rope_qkv_backward_reference(gq, gk, gv, cos, sin)


@rope_qkv_backward_op.register_fake
def _(gq, gk, gv, cos, sin):
    _check_grads(gq, gk, gv, cos, sin)
    B, T, H, D = gq.shape
    return gq.new_empty((B, T, 3, H, D))


def _check_grads(gq, gk, gv, cos, sin):
    gs = (gq, gk, gv)
    if not all(isinstance(g, torch.Tensor) for g in gs) or gq.dim() != 4:
        raise ValueError(f"gq, gk, gv: expected (B, T, H, D) tensors, got shape {tuple(getattr(gq, 'shape', ()))}")
    if any(g.shape != gq.shape or g.dtype != gq.dtype or g.device != gq.device for g in gs):
        raise ValueError("gq, gk, gv: expected one shape, dtype and device, got "
                         + ", ".join(f"{g.dtype} {tuple(g.shape)} on {g.device}" for g in gs))
    if not gq.is_floating_point():
        raise TypeError(f"gq, gk, gv: expected floating-point tensors, got {gq.dtype}")
    _check_tables(gq.shape[1], gq.shape[-1], gq.device, cos, sin, "gq, gk, gv")


def _rope_setup(ctx, inputs, output):
    _, cos, sin = inputs
    ctx.save_for_backward(cos, sin)
    ctx.shape = tuple(output[0].shape)


def _rope_backward(ctx, gq, gk, gv):
    cos, sin = ctx.saved_tensors
    gs = _dense_grads([gq, gk, gv], ctx.shape)
    return rope_qkv_backward_op(*gs, cos, sin), None, None


rope_qkv_op.register_autograd(_rope_backward, setup_context=_rope_setup)


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, grad_sink=None):
    """Rotate-half RoPE on Q and K of a packed QKV tensor; differentiable.

    Args:
        qkv: (B, T, 3, H, D) float32 / bfloat16 / float16 — the QKV projection's output viewed as
            (tokens, [q|k|v], heads, head_dim).
        cos, sin: (>= T, D) float32 tables (row t used for position t).
        grad_sink: optional ``f(gq, gk, gv, cos, sin)`` called by the backward (CUDA path) with the gradients of
            q, k, v as (B, T, H, D) views: it may deliver qkv's gradient itself (e.g. quantized, to the projection
            that made qkv: :func:`lowbit.nn.functional.rope_grad_sink`) and return a one-element tensor, which
            autograd then gets expanded to qkv's shape in place of the gradient (the receiving layer must not read
            it); None: the backward computes dqkv as usual. Not called under torch.compile (the backward there is
            the ``lowbit::rope_qkv_backward`` operator, which computes dqkv itself: the same gradient).

    Returns:
        q, k, v: (B, H, T, D) views of (B, T, H, D)-contiguous tensors in ``qkv.dtype``; q and k rotated.

    On CUDA with Triton: one fused kernel each way (inside torch.compile, the ``lowbit::rope_qkv`` and
    ``lowbit::rope_qkv_backward`` operators, the same kernels); elsewhere :func:`rope_qkv_reference`.
    """
    _check(qkv, cos, sin)
    if not _kernel_runs(qkv):
        return rope_qkv_reference(qkv, cos, sin)
    if torch.compiler.is_compiling():
        return tuple(o.transpose(1, 2) for o in rope_qkv_op(qkv, cos, sin))
    cos = cos.float().contiguous()
    sin = sin.float().contiguous()
    return _RopeQKV.apply(qkv, cos, sin, grad_sink)


# RoPE's backward inside the QKV projection's grad_output quantizer (the register-tile kernel's ROPE_BWD prologue,
# quant_gluon._rope_bwd_half): dqkv (B·T, 3·H·D) is never written in 16 bits. Candidates: the fused kernel (each
# scale by every thread of its row / column; what ptxas picks: 128 registers at head_dim 128, ~165 at 64 (Triton
# 3.6), or capped at 128 (a few spills)), timed against the two kernels it replaces (KIND "two": this module's
# backward kernel, then the plain register-tile quantizer); the autotuner keeps the fastest. Whole 128-row tiles,
# H·D a multiple of 128, head_dim 64 or 128, both copies.
# PACK (BF16 only): the computed dqkv tile packed into BF16 pairs and quantized as rowcol_1x128_regs_packed does,
# 1,952 SASS instructions a thread against 2,328 (Triton 3.6): 6-13% faster on the H200.
_ROPE_BWD_CONFIGS = [dict(KIND="regs", COMPACT=False, LC=8, num_warps=8, PACK=True),
                     dict(KIND="regs", COMPACT=False, LC=8, num_warps=8),
                     dict(KIND="regs", COMPACT=False, LC=8, num_warps=8, maxnreg=128),
                     dict(KIND="two")]


def rope_backward_fused_quant_supported(gq, gk, gv, cos, sin, scheme) -> bool:
    """Whether :func:`rope_backward_quantize_1x128` can take these: a 1x128 Float8Blockwise scheme; gq, gk, gv
    (B, T, H, D) contiguous 16-bit tensors of one dtype and shape on a CUDA sm_89+ GPU with Gluon; D 64 or 128,
    H·D and B·T multiples of 128; cos, sin (>= T, D) float32 with unit column stride on the same device. Where not,
    says why (:func:`lowbit.runtime.log.declined`)."""
    if triton is None or INTERPRET:
        declined("ops.rope_bwd_quant", "no Triton, or Triton's interpreter")
        return False
    if not (isinstance(scheme, Float8Blockwise) and scheme.block_dim == 1 and scheme.block_size == BLOCK_SIZE):
        declined("ops.rope_bwd_quant", lambda: f"scheme {scheme!r} is not 1x{BLOCK_SIZE} Float8Blockwise")
        return False
    ts = (gq, gk, gv)
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 and t.is_cuda and t.is_contiguous() for t in ts):
        declined("ops.rope_bwd_quant", "gq/gk/gv are not contiguous 4-dim CUDA tensors")
        return False
    if not (gk.shape == gq.shape == gv.shape and gk.dtype == gq.dtype == gv.dtype
            and gq.dtype in (torch.bfloat16, torch.float16) and gk.device == gq.device == gv.device):
        declined("ops.rope_bwd_quant", "gq/gk/gv differ in shape, dtype or device, or are not 16-bit")
        return False
    B, T, H, D = gq.shape
    for t in (cos, sin):
        if not (t.dtype == torch.float32 and t.dim() == 2 and t.shape[0] >= T and t.shape[1] == D
                and t.stride(1) == 1 and t.device == gq.device):
            declined("ops.rope_bwd_quant", "cos/sin are not float32 (>= T, D) tables with unit column stride")
            return False
    if D not in (64, 128) or (H * D) % BLOCK_SIZE or (B * T) % BLOCK_SIZE or BLOCK_SIZE * 3 * H * D >= 2**31:
        declined("ops.rope_bwd_quant", f"head_dim {D}, H*D {H * D}, B*T {B * T}: needs D 64 or 128 and whole "
                                       f"{BLOCK_SIZE}x{BLOCK_SIZE} tiles")
        return False
    # (the quantizer's own conditions on the (B·T, 3·H·D) output; its width checked above, in-tile offsets in int32)
    return regs_ok(gq.view(B * T, H * D), BLOCK_SIZE, False, True, True)


def rope_backward_quantize_1x128(gq, gk, gv, cos, sin, scheme):
    """Both 1x128 FP8 copies of the gradient of a packed QKV tensor through :func:`rope_qkv`, from the gradients of
    its outputs, without writing that gradient in 16 bits.

    Args:
        gq, gk, gv: (B, T, H, D) the gradients of rope_qkv's q, k, v (as (B, T, H, D) tensors: its outputs are
            (B, H, T, D) views of these), contiguous, bfloat16 / float16.
        cos, sin: the (>= T, D) float32 tables the forward used.
        scheme: ``Float8Blockwise(block_dim=1, block_size=128)``.

    Returns:
        A :class:`~lowbit.quant.tensor.QuantizedTensor` of shape (B·T, 3·H·D) (the QKV projection's output rows),
        dtype gq.dtype, with both copies, bit-identical to ``quantize(dqkv.view(B·T, 3·H·D), scheme, rowwise=True,
        columnwise=True)`` where dqkv is what rope_qkv's backward returns.
    """
    if not rope_backward_fused_quant_supported(gq, gk, gv, cos, sin, scheme):
        raise NotImplementedError(
            "rope_backward_quantize_1x128: needs a 1x128 Float8Blockwise scheme, contiguous (B, T, H, D) 16-bit CUDA "
            "gq/gk/gv of one dtype and shape with D in (64, 128) and H*D, B*T multiples of 128, and float32 (>= T, D) "
            f"cos/sin on their device; got scheme {scheme!r}, gq {getattr(gq, 'dtype', None)} "
            f"{tuple(getattr(gq, 'shape', ()))}, cos {getattr(cos, 'dtype', None)} {tuple(getattr(cos, 'shape', ()))}")
    B, T, H, D = gq.shape
    M, W = B * T, 3 * H * D
    return rowcol_regs_prologue(
        "rope_bwd_quant", (gq.dtype, D, bucket(M), bucket(W)), (M, W), scheme,
        lambda: list(_ROPE_BWD_CONFIGS), gq,
        lambda c: dict(ROPE_BWD=True, g_ptr=gk, gv_ptr=gv, cos_ptr=cos, sin_ptr=sin, rope_T=T, tab_row=cos.stride(0),
                       HD=H * D, DH=D),
        lambda: _backward_dqkv((gq, gk, gv), cos, sin).view(M, W))
