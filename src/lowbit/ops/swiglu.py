"""SwiGLU ``silu(a) · b`` on the packed fc1 output ``[a | b]``, fused: one kernel forward (reads a and b once,
writes the product), one backward (writes d[a | b] in the packed layout). In torch this is a chunk, a silu, a
multiply and their backwards on strided halves (~7% of a BF16 350m GPT step).

Numerics: FP32 math, one rounding to the output dtype; ``sigmoid(a) = 1 / (1 + exp(-a))`` by the hardware's
approximate exp2 and reciprocal (``lowbit.quant.kernels.quant.sigmoid``). Agrees with
:func:`swiglu_reference` to within one rounding of the output dtype (the exponential and the products may
differ in the last FP32 bits), tests/ops/test_swiglu.py.
"""

from __future__ import annotations

import torch

from ..quant.schemes import BLOCK_SIZE, Float8Blockwise
from ..quant.tensor import QuantizedTensor
from ..runtime.autotune import bucket, tuned_launch
from ..runtime.device import INTERPRET
from ..runtime.launch import launcher, remember
from ..runtime.log import declined

__all__ = ["swiglu", "swiglu_reference", "swiglu_backward", "swiglu_backward_reference", "swiglu_op",
           "swiglu_backward_op", "swiglu_quantize_1x128", "swiglu_fused_quant_supported",
           "swiglu_backward_quantize_1x128", "swiglu_backward_fused_quant_supported"]

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:
    from ..quant.kernels.quant import bits_to_f32, compute_scale, fp8_cast, recip, rowcol_tile_1d, sigmoid
    from ..quant.triton_backend import (
        BlockwisePlan,
        blockwise_args,
        blockwise_buffers,
        packed_ok,
        regs_ok,
        rowcol_regs_prologue,
        set_copies,
    )


def swiglu_reference(h: torch.Tensor) -> torch.Tensor:
    """The spec: ``h`` (..., 2F) = [a | b] -> silu(a)·b (..., F), FP32 math, one rounding."""
    _check(h)
    a, b = h.float().chunk(2, dim=-1)
    return (a * torch.sigmoid(a) * b).to(h.dtype)


def _check(h):
    if not isinstance(h, torch.Tensor) or h.dim() < 1 or h.shape[-1] % 2:
        raise ValueError("h: expected (..., 2F) = [a | b] with an even last dim, got shape "
                         f"{tuple(getattr(h, 'shape', ()))}")
    if not h.is_floating_point():
        raise TypeError(f"h: expected a floating-point tensor, got {h.dtype}")


if triton is not None:

    @triton.jit
    def _silu(a):
        """(sigmoid(a), silu(a)) in FP32 — one place for the expressions, so the fused quantizer below quantizes
        exactly the values the SwiGLU kernel stores."""
        sig = sigmoid(a)
        return sig, a * sig

    @triton.jit
    def _swiglu_kernel(h_ptr, g_ptr, o_ptr, F, BLOCK: tl.constexpr, BACKWARD: tl.constexpr):
        """Row r of h (2F wide, contiguous); forward: o[r, :F] = silu(a)·b; backward: o[r, :2F] = d[a | b] from g[r,
        :F]."""
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = col < F
        a = tl.load(h_ptr + row * 2 * F + col, mask=m, other=0.0).to(tl.float32)
        b = tl.load(h_ptr + row * 2 * F + F + col, mask=m, other=0.0).to(tl.float32)
        sig, s = _silu(a)
        if BACKWARD:
            g = tl.load(g_ptr + row * F + col, mask=m, other=0.0).to(tl.float32)
            da = g * b * (sig * (1.0 + a * (1.0 - sig)))
            db = g * s
            tl.store(o_ptr + row * 2 * F + col, da.to(o_ptr.dtype.element_ty), mask=m)
            tl.store(o_ptr + row * 2 * F + F + col, db.to(o_ptr.dtype.element_ty), mask=m)
        else:
            tl.store(o_ptr + row * F + col, (s * b).to(o_ptr.dtype.element_ty), mask=m)


def _grid(rows, F):
    block = min(1024, triton.next_power_of_2(F))
    return (rows, triton.cdiv(F, block)), block, 4 if block <= 512 else 8


def _kernel_runs(h: torch.Tensor) -> bool:
    """Whether the fused kernels take ``h``: Triton on CUDA (or its interpreter), not empty."""
    return triton is not None and (h.is_cuda or INTERPRET) and h.numel() > 0


def _forward(h: torch.Tensor) -> torch.Tensor:
    """silu(a)·b (..., F), a new contiguous tensor, of a contiguous ``h`` (..., 2F): the forward kernel."""
    F = h.shape[-1] // 2
    rows = h.numel() // (2 * F)
    out = torch.empty(*h.shape[:-1], F, dtype=h.dtype, device=h.device)
    grid, block, warps = _grid(rows, F)
    launcher(_swiglu_kernel)[grid](h, h, out, F, BLOCK=block, BACKWARD=False, num_warps=warps)
    return out


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        h = h.contiguous()
        ctx.save_for_backward(h)
        return _forward(h)

    @staticmethod
    def backward(ctx, g):
        (h,) = ctx.saved_tensors
        return swiglu_backward(h, g)


def swiglu_backward(h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """d[a | b] (same shape and dtype as ``h``) from ``h = [a | b]`` (contiguous, CUDA or interpreter) and the
    gradient ``g`` (..., F) of silu(a)·b: the fused backward kernel, FP32 math, one rounding."""
    F = h.shape[-1] // 2
    rows = h.numel() // (2 * F)
    dh = torch.empty_like(h)
    grid, block, warps = _grid(rows, F)
    launcher(_swiglu_kernel)[grid](h, g.contiguous(), dh, F, BLOCK=block, BACKWARD=True, num_warps=warps)
    return dh


def swiglu_backward_reference(h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The spec of the backward: d[a | b] (h's shape and dtype) from ``h = [a | b]`` and the gradient ``g`` (..., F)
    of silu(a)·b, with the kernel's expressions in FP32 (torch's sigmoid), one rounding:
    ``da = g·b·σ(a)·(1 + a·(1 − σ(a)))``, ``db = g·silu(a)``."""
    a, b = h.float().chunk(2, dim=-1)
    gf = g.float()
    sig = torch.sigmoid(a)
    return torch.cat([gf * b * (sig * (1.0 + a * (1.0 - sig))), gf * (a * sig)], dim=-1).to(h.dtype)


def _check_backward(h, g):
    _check(h)
    if not (isinstance(g, torch.Tensor) and g.shape == (*h.shape[:-1], h.shape[-1] // 2) and g.dtype == h.dtype
            and g.device == h.device):
        raise ValueError(f"g: expected {h.dtype} of shape {(*h.shape[:-1], h.shape[-1] // 2)} on {h.device} "
                         f"(h's rows, half its width), got {getattr(g, 'dtype', type(g).__name__)} "
                         f"{tuple(getattr(g, 'shape', ()))} on {getattr(g, 'device', None)}")


# ------------------------------------------------------------------------------------------------
# swiglu as torch.library operators: what torch.compile traces (eager calls run _SwiGLU)
# ------------------------------------------------------------------------------------------------
@torch.library.custom_op("lowbit::swiglu", mutates_args=())
def swiglu_op(h: torch.Tensor) -> torch.Tensor:
    """silu(a)·b of ``h`` (..., 2F) = [a | b]: a new contiguous (..., F) tensor in h's dtype. The fused kernel on
    CUDA (or under Triton's interpreter), the bits :func:`swiglu` computes there; elsewhere
    :func:`swiglu_reference`. Differentiable: the backward is ``lowbit::swiglu_backward``."""
    _check(h)
    if _kernel_runs(h):
        return _forward(h.contiguous())
    return swiglu_reference(h).contiguous()


@swiglu_op.register_fake
def _(h):
    _check(h)
    return h.new_empty((*h.shape[:-1], h.shape[-1] // 2))


@torch.library.custom_op("lowbit::swiglu_backward", mutates_args=())
def swiglu_backward_op(h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """d[a | b], a new contiguous tensor of h's shape and dtype, from ``h`` (..., 2F) = [a | b] and the gradient
    ``g`` (..., F) of silu(a)·b (h's dtype): the fused backward kernel on CUDA (or under Triton's interpreter), the
    bits swiglu's eager backward computes there; elsewhere :func:`swiglu_backward_reference`."""
    _check_backward(h, g)
    if _kernel_runs(h):
        return swiglu_backward(h.contiguous(), g)
    return swiglu_backward_reference(h, g)


@swiglu_backward_op.register_fake
def _(h, g):
    _check_backward(h, g)
    return h.new_empty(h.shape)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _swiglu_grad(ctx, g):
    (h,) = ctx.saved_tensors
    return swiglu_backward_op(h, g)


swiglu_op.register_autograd(_swiglu_grad, setup_context=_swiglu_setup)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """``silu(a) · b`` for ``h = [a | b]`` along the last dim; differentiable.

    Args:
        h: (..., 2F) float32 / bfloat16 / float16 (the fc1 output of a SwiGLU MLP).

    Returns:
        (..., F) in ``h.dtype``. One fused kernel each way on CUDA with Triton (inside torch.compile, the
        ``lowbit::swiglu`` and ``lowbit::swiglu_backward`` operators, the same kernels); elsewhere
        :func:`swiglu_reference` (autograd through torch).
    """
    _check(h)
    if not _kernel_runs(h):
        return swiglu_reference(h)
    if torch.compiler.is_compiling():
        return swiglu_op(h)
    return _SwiGLU.apply(h)


# ================================================================================================
# SwiGLU fused with 1x128 FP8 quantization of its output (the fc2 input)
# ================================================================================================
# In an FP8-blockwise MLP the SwiGLU output h is read only by the quantizer (fc2's fprop wants its rowwise copy,
# fc2's wgrad its columnwise one). Fusing them saves writing and re-reading h (M x F, 16-bit). The values
# quantized are exactly those the unfused kernel stores (the same FP32 expressions, rounded to the 16-bit dtype
# first), so the result is bit-identical to ``quantize(swiglu(u))``. (The same fusion for the backward, SwiGLU's
# d[a | b] into fc1's grad_output quantizer, as a slab walk lost to the separate kernels once the blockwise
# quantizer was rewritten; it is below on the register-tile quantizer: swiglu_backward_quantize_1x128.)


def fused_quant_runs(device: torch.device, dtype: torch.dtype, width: int, scheme) -> bool:
    """The kernel's own conditions on a u of ``width`` = 2F columns: Triton, CUDA (or its interpreter), a 16-bit
    dtype, F a multiple of BLOCK_SIZE, a 1x128 Float8Blockwise scheme. Where not, says why
    (:func:`lowbit.runtime.log.declined`)."""
    if (triton is not None and isinstance(scheme, Float8Blockwise) and scheme.block_dim == 1
            and scheme.block_size == BLOCK_SIZE and (device.type == "cuda" or INTERPRET)
            and dtype in (torch.bfloat16, torch.float16) and width % (2 * BLOCK_SIZE) == 0):
        return True
    if triton is None:
        declined("ops.swiglu_quant", "Triton is not installed")
    elif not (isinstance(scheme, Float8Blockwise) and scheme.block_dim == 1 and scheme.block_size == BLOCK_SIZE):
        declined("ops.swiglu_quant", lambda: f"scheme {scheme!r} is not 1x{BLOCK_SIZE} Float8Blockwise")
    elif not (device.type == "cuda" or INTERPRET):
        declined("ops.swiglu_quant", f"device {device.type} (CUDA, or Triton's interpreter)")
    elif dtype not in (torch.bfloat16, torch.float16):
        declined("ops.swiglu_quant", f"dtype {dtype} (bfloat16 or float16 only)")
    else:
        declined("ops.swiglu_quant", f"F = {width // 2} is not a multiple of {BLOCK_SIZE}")
    return False


def swiglu_fused_quant_supported(u: torch.Tensor, scheme) -> bool:
    """Whether :func:`swiglu_quantize_1x128` can take ``u`` (..., 2F) under ``scheme``: a 1x128 Float8Blockwise
    scheme, a contiguous 16-bit CUDA tensor (or Triton's interpreter), F a multiple of 128."""
    return (u.dim() >= 1 and u.is_contiguous() and u.numel() > 0
            and fused_quant_runs(u.device, u.dtype, u.shape[-1], scheme))


if triton is not None:

    @triton.jit
    def _swiglu_h(a, b, DT: tl.constexpr):
        """h = silu(a)·b from the 16-bit a and b, in DT, exactly as the unfused kernel stores it (FP32 math, one
        rounding): what both fused quantizers quantize."""
        _, s = _silu(a.to(tl.float32))
        return (s * b.to(tl.float32)).to(DT)

    @triton.jit
    def _swiglu_vals(u_ptr, rows, cols, M, F, DT: tl.constexpr):
        """FP32 values (rounded to DT first, as the unfused kernel stores them) of the (rows, cols) tile of
        h = silu(a)·b."""
        m = (rows[:, None] < M) & (cols[None, :] < F)
        off = rows[:, None] * (2 * F) + cols[None, :]
        a = tl.load(u_ptr + off, mask=m, other=0.0)
        b = tl.load(u_ptr + off + F, mask=m, other=0.0)
        return _swiglu_h(a, b, DT).to(tl.float32)

    @triton.jit
    def _swiglu_quant_kernel(u_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr, amax_ptr, M, F, rs_ld, cs_ld,
                             FMAX: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr, POW2: tl.constexpr,
                             EPS: tl.constexpr, SW: tl.constexpr, SATCVT: tl.constexpr, DT: tl.constexpr,
                             ROW: tl.constexpr, COL: tl.constexpr, SLAB: tl.constexpr,
                             UNROLL: tl.constexpr = 1, abs_mask=0x7FFFFFFF):
        """One 128 x 128 tile of h (M, F), walked in SLAB-row slabs twice (as quant.kernels.quant.blockwise_kernel's
        slab walk): walk 1 makes the rowwise copy (1x128 scales along F) and keeps the column maxima; walk 2
        recomputes the slabs (their inputs are in L2 now) and writes the columnwise copy (transposed, 1x128 scales
        along M). Scales stored as scale_inv in the GEMM's layout: rs[fb, m] (ld rs_ld), cs[mb, f] (ld cs_ld).
        ``abs_mask`` is a run-time 0x7FFFFFFF (see blockwise_kernel: a constant would let ptxas turn bits & mask
        into a half-precision |x| that rewrites NaN payloads)."""
        BS: tl.constexpr = 128
        FDT: tl.constexpr = rq_ptr.dtype.element_ty
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1).to(tl.int64)
        cn = pid_n * BS + tl.arange(0, BS)
        m0 = pid_m * BS
        acc = tl.zeros((SLAB, BS), dtype=tl.int32)
        for r0 in tl.range(0, BS, SLAB, loop_unroll_factor=UNROLL):
            rows = m0 + r0 + tl.arange(0, SLAB).to(tl.int64)
            x = _swiglu_vals(u_ptr, rows, cn, M, F, DT)
            ab = x.to(tl.int32, bitcast=True) & abs_mask
            acc = tl.maximum(acc, ab)
            if ROW:
                sr = compute_scale(bits_to_f32(tl.max(ab, axis=1)), FMAX, POW2, EPS)
                rmask = rows < M
                tl.store(rs_ptr + pid_n * rs_ld + rows, recip(sr, POW2, FMAX), mask=rmask)
                q = fp8_cast(x * sr[:, None], FDT, FMAX, EMIN, MBITS, SW, SATCVT)
                tl.store(rq_ptr + rows[:, None] * F + cn[None, :], q, mask=rmask[:, None])
        col_max = tl.max(acc, axis=0)
        tl.atomic_max(amax_ptr, tl.max(col_max, axis=0), sem="relaxed")
        if COL:
            sc = compute_scale(bits_to_f32(col_max), FMAX, POW2, EPS)
            tl.store(cs_ptr + pid_m * cs_ld + cn, recip(sc, POW2, FMAX))
            for r0 in tl.range(0, BS, SLAB, loop_unroll_factor=UNROLL):
                rows = m0 + r0 + tl.arange(0, SLAB).to(tl.int64)
                x = _swiglu_vals(u_ptr, rows, cn, M, F, DT)
                q = fp8_cast(x * sc[None, :], FDT, FMAX, EMIN, MBITS, SW, SATCVT)
                tl.store(cq_ptr + cn.to(tl.int64)[:, None] * M + rows[None, :], tl.trans(q), mask=(rows < M)[None, :])


    @triton.jit
    def _swiglu_raw(u_ptr, t, nkt, M, F, EVEN: tl.constexpr):
        """The a and b halves (16-bit, as stored) of tile t (row-panel order) of h's (M, F) 128 x 128 tile grid."""
        pm = t // nkt
        m0 = pm * 128
        f0 = (t - pm * nkt) * 128
        r = tl.arange(0, 128)
        c = tl.arange(0, 128)
        ptrs = u_ptr + (m0.to(tl.int64) * (2 * F) + f0) + (r[:, None] * (2 * F) + c[None, :])
        if EVEN:
            return tl.load(ptrs), tl.load(ptrs + F)
        else:
            m = (r < M - m0)[:, None]  # (columns: F is a multiple of 128)
            return tl.load(ptrs, mask=m, other=0.0), tl.load(ptrs + F, mask=m, other=0.0)

    @triton.jit
    def _swiglu_quant_tile_kernel(u_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr, amax_ptr, M, F, rs_ld, cs_ld, n_prog,
                                  FMAX: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr, POW2: tl.constexpr,
                                  EPS: tl.constexpr, SW: tl.constexpr, SATCVT: tl.constexpr, DT: tl.constexpr,
                                  ROW: tl.constexpr, COL: tl.constexpr, EVEN: tl.constexpr = False,
                                  BITS16: tl.constexpr = False, abs_mask=0x7FFFFFFF):
        """_swiglu_quant_kernel's outputs from a persistent grid of ``n_prog`` programs that each hold a whole
        128 x 128 tile of h in registers (computed once: no second walk re-reading u), as the blockwise quantizer's
        blockwise_persistent_kernel does: program p takes tiles p, p + n_prog, ... in row-panel order, with the next
        tile's a and b loaded before the current one is computed. EVEN: M % 128 == 0 (no masks).
        BITS16: see quant.kernels.quant.rowcol_tile_1d."""
        FDT: tl.constexpr = rq_ptr.dtype.element_ty
        pid = tl.program_id(0)
        nkt = F // 128
        n_tiles = tl.cdiv(M, 128) * nkt
        last = n_tiles - 1
        an, bn = _swiglu_raw(u_ptr, tl.minimum(pid, last), nkt, M, F, EVEN)
        amax = tl.zeros((), dtype=tl.int32)
        for t in range(pid, n_tiles, n_prog):
            ac, bc = an, bn
            an, bn = _swiglu_raw(u_ptr, tl.minimum(t + n_prog, last), nkt, M, F, EVEN)
            pm = t // nkt
            pk = t - pm * nkt
            m0 = pm * 128
            f0 = pk * 128
            a = rowcol_tile_1d(_swiglu_h(ac, bc, DT), rq_ptr + (m0.to(tl.int64) * F + f0),
                               rs_ptr + pk.to(tl.int64) * rs_ld + m0,
                                cq_ptr + (f0.to(tl.int64) * M + m0), cs_ptr + pm.to(tl.int64) * cs_ld + f0,
                                M, F, M - m0, F - f0, FMAX, EMIN, MBITS, POW2, EPS, SW, SATCVT, FDT, ROW, COL, EVEN,
                                False, BITS16, abs_mask)
            amax = tl.maximum(amax, a)
        tl.atomic_max(amax_ptr, amax, sem="relaxed")


# (M, F, dtype, scheme, rowwise, columnwise) -> (the quantizer's BlockwisePlan for h, whether _regs_runs); bounded by
# runtime.launch.remember (a server sees every length)
_PLANS: dict = {}

# slab rows, warps, unroll of the two walks (the first is the default without autotuning / in the interpreter)
_SWIGLU_QUANT_CONFIGS = ([dict(SLAB=16, num_warps=4)] if INTERPRET else
                         [dict(SLAB=32, num_warps=4), dict(SLAB=32, num_warps=4, UNROLL=2), dict(SLAB=64, num_warps=8),
                          dict(SLAB=16, num_warps=4, UNROLL=2), dict(SLAB=64, num_warps=4)])


# whole-tile candidates (_swiglu_quant_tile_kernel), tried on the GPU only: 8 warps with BITS16 beat the best slab
# walk; 16 warps and two programs an SM were slower (not kept).
_SWIGLU_TILE_CONFIGS = [dict(KIND="tile", CTAS=1, num_warps=8, BITS16=True),
                        dict(KIND="tile", CTAS=1, num_warps=8)]


# register-tile candidates with the SWIGLU prologue (quant_gluon.rowcol_1x128_regs), all within 128 registers (two
# CTAs an SM). The plain quantizer's first candidate (compact scales, 8 lanes along the columns) compiles to 130 here
# and runs one CTA an SM, 1.4x slower, so it is capped.
# Before them for BF16 u (16-byte aligned), the BF16-pair form (quant_gluon.rowcol_1x128_regs_packed with SWIGLU):
# h made and reduced as BF16 pairs, 1,408 SASS instructions a thread against 1,872 (Triton 3.6), 107 registers (two
# CTAs an SM), a few percent faster; capped at 80 registers (three CTAs, spilling) it was slower, so that form is
# not a candidate.
_SWIGLU_PACKED_CONFIGS = [dict(KIND="packed", LC=8, num_warps=8)]
_SWIGLU_REGS_CONFIGS = [dict(KIND="regs", COMPACT=False, LC=8, num_warps=8),
                        dict(KIND="regs", COMPACT=True, LC=8, num_warps=8, maxnreg=128),
                        dict(KIND="regs", COMPACT=True, LC=4, num_warps=8)]


def _regs_runs(u: torch.Tensor, rowwise: bool, columnwise: bool) -> bool:
    """Whether the register-tile quantizer (quant_gluon.rowcol_1x128_regs with its SWIGLU or SWIGLU_BWD prologue)
    may take u: both copies, and the quantizer's own conditions (triton_backend.regs_ok: CUDA sm_89+, not the
    interpreter, whole 128 x 128 tiles) on the (M, 2F) input."""
    return rowwise and columnwise and regs_ok(u.view(-1, u.shape[-1]), BLOCK_SIZE, False, True, True)


def _swiglu_quant_candidates(u: torch.Tensor, regs: bool, packed: bool | None = None) -> list[dict]:
    """The launch candidates for ``u`` (the first is the default without autotuning): on the GPU, where the
    register-tile quantizer may run (``regs``: :func:`_regs_runs`), its candidates first (its BF16-pair form's before
    them where ``packed``, by default where triton_backend.packed_ok takes u: the fastest order measured), then the
    slab walk's, then the whole-tile kernel's (BITS16 only where u is BF16)."""
    if INTERPRET or not u.is_cuda:
        return list(_SWIGLU_QUANT_CONFIGS)
    if packed is None:
        packed = regs and packed_ok(u)
    return (list(_SWIGLU_PACKED_CONFIGS) if packed else []) + (list(_SWIGLU_REGS_CONFIGS) if regs else []) \
        + list(_SWIGLU_QUANT_CONFIGS) + [
        c for c in _SWIGLU_TILE_CONFIGS if u.dtype == torch.bfloat16 or not c.get("BITS16")]


def swiglu_quantize_1x128(u: torch.Tensor, scheme, *, rowwise: bool = True, columnwise: bool = True):
    """Quantize SwiGLU's output h = silu(a)·b with a 1x128 FP8 scheme without writing h in 16 bits.

    Args:
        u: (..., 2F) = [a | b], the fc1 output, bfloat16 / float16, contiguous; F % 128 == 0.
        scheme: ``Float8Blockwise(block_dim=1, block_size=128)`` (any FP8 format, pow2, eps).
        rowwise, columnwise: which copies (as :func:`lowbit.quantize`).

    Returns:
        A :class:`~lowbit.quant.tensor.QuantizedTensor` of shape (..., F), dtype u.dtype, bit-identical to
        ``quantize(swiglu(u), scheme, rowwise=..., columnwise=...)``.
    """
    if not swiglu_fused_quant_supported(u, scheme):
        raise NotImplementedError(
            "swiglu_quantize_1x128: needs a 1x128 Float8Blockwise scheme and a contiguous bfloat16/float16 "
            "CUDA u with "
            f"its last dim a multiple of 256; got scheme {scheme!r}, u {u.dtype} {tuple(u.shape)} on {u.device}")
    if not (rowwise or columnwise):
        raise ValueError("rowwise, columnwise: at least one copy must be asked for")
    F = u.shape[-1] // 2
    M = u.numel() // (2 * F)
    key = (M, F, u.dtype, scheme, rowwise, columnwise)
    entry = _PLANS.get(key)
    if entry is None:  # the blockwise quantizer's plan: the same output layouts and kernel constants for h (M, F)
        plan = BlockwisePlan(M, F, scheme, rowwise, columnwise, u.device)
        plan.kw = {k: v for k, v in plan.kw.items() if k not in ("TWO_D", "BS")}  # (1x128 here)
        plan.kw["DT"] = tl.bfloat16 if u.dtype == torch.bfloat16 else tl.float16
        entry = remember(_PLANS, key, (plan, _regs_runs(u, rowwise, columnwise)))
    plan, regs = entry
    bufs = blockwise_buffers(plan, scheme.format, u.device, rowwise, columnwise)
    args = (u, *blockwise_args(plan, *bufs))
    grid = (F // 128, triton.cdiv(M, 128))
    n_tiles = triton.cdiv(M, 128) * (F // 128)

    def launch(c):
        kw = {k: v for k, v in c.items() if k not in ("KIND", "CTAS")}
        if c.get("KIND") in ("regs", "packed"):
            fn, g, _, kw = plan.launch_args(c)  # quant_gluon.rowcol_1x128_regs(_packed) on h's (M, F) tile grid
            launcher(fn)[g](*args, **kw, SWIGLU=True)
        elif c.get("KIND") == "tile":
            n_prog = min(n_tiles, plan.nsm * c["CTAS"])
            launcher(_swiglu_quant_tile_kernel)[(n_prog,)](*args, n_prog, **plan.kw, EVEN=M % 128 == 0, **kw)
        else:
            launcher(_swiglu_quant_kernel)[grid](*args, **plan.kw, **kw)

    packed = regs and packed_ok(u)  # (u's alignment: not in the plan's key)
    tuned_launch("swiglu_quant", (rowwise, columnwise, u.dtype, bucket(M), bucket(F), regs, packed),
                 lambda: _swiglu_quant_candidates(u, regs, packed), launch)
    qt = QuantizedTensor(shape=(*u.shape[:-1], F), dtype=u.dtype, scheme=scheme)
    set_copies(qt, *bufs)
    return qt


# ================================================================================================
# SwiGLU's backward fused with 1x128 FP8 quantization of its output (fc1's grad_output)
# ================================================================================================
# fc1's dgrad and wgrad read du = d[a | b] only through its two 1x128 copies. Computing du inside the register-tile
# quantizer (its SWIGLU_BWD prologue) saves writing du in 16 bits and reading it back: u and dh are read, the FP8
# copies written. The values quantized are those swiglu_backward stores (the same FP32 operations, one rounding to
# u's dtype), so the result is bit-identical to quantize(swiglu_backward(u, dh)). Each program computes one 128 x 128
# tile of du from three 16-bit tiles (a, b, dh), in two halves of 64 rows so that they are not all held at once:
# with each scale computed by every thread of its row / column (COMPACT off) that fits the plain quantizer's 128
# registers (two CTAs an SM) without spills (Triton 3.6, sm_90; whole tiles in one piece took 253 registers, and
# spilled under a cap). The candidates are timed against the two kernels it replaces (KIND "two":
# swiglu_backward, then the register-tile quantizer on du), and the autotuner keeps the fastest (the fused kernel,
# about 10% faster). Whole 128 x 128 tiles and both copies
# only (the MLP's backward with dx and dw1 both wanted); everything else runs the two kernels.
# PACK (BF16 only): the computed du tile packed into BF16 pairs and quantized as rowcol_1x128_regs_packed does,
# 1,976 SASS instructions a thread against 2,280 at the same 128 registers (Triton 3.6): a few percent faster.
_SWIGLU_BWD_CONFIGS = [dict(KIND="regs", COMPACT=False, LC=8, num_warps=8, maxnreg=128, PACK=True),
                       dict(KIND="regs", COMPACT=False, LC=8, num_warps=8, maxnreg=128),
                       dict(KIND="regs", COMPACT=True, LC=8, num_warps=8),
                       dict(KIND="two")]


def swiglu_backward_fused_quant_supported(u: torch.Tensor, g: torch.Tensor, scheme) -> bool:
    """Whether :func:`swiglu_backward_quantize_1x128` can take ``u`` (..., 2F) and ``g`` (..., F) under ``scheme``:
    a 1x128 Float8Blockwise scheme, contiguous 16-bit CUDA tensors of one dtype on an sm_89+ GPU with Gluon, F a
    multiple of 128 and the rows (the product of the leading dims) a multiple of 128 (whole tiles); both copies."""
    if not (isinstance(u, torch.Tensor) and isinstance(g, torch.Tensor) and u.dim() >= 1 and u.numel() > 0
            and u.is_contiguous() and g.is_contiguous() and g.dtype == u.dtype and g.device == u.device
            and u.shape[-1] % 2 == 0 and g.shape == (*u.shape[:-1], u.shape[-1] // 2)):
        return False
    return fused_quant_runs(u.device, u.dtype, u.shape[-1], scheme) and _regs_runs(u, True, True)


def swiglu_backward_quantize_1x128(u: torch.Tensor, g: torch.Tensor, scheme):
    """Both 1x128 FP8 copies of SwiGLU's input gradient du = d[a | b], without writing du in 16 bits.

    Args:
        u: (..., 2F) = [a | b], the fc1 output saved by the forward, bfloat16 / float16, contiguous.
        g: (..., F), the gradient of h = silu(a)·b, u's dtype, contiguous. F % 128 == 0 and the rows (product of
            the leading dims) % 128 == 0 (see :func:`swiglu_backward_fused_quant_supported`).
        scheme: ``Float8Blockwise(block_dim=1, block_size=128)`` (any FP8 format, pow2, eps).

    Returns:
        A :class:`~lowbit.quant.tensor.QuantizedTensor` of shape (..., 2F), dtype u.dtype, with both copies,
        bit-identical to ``quantize(swiglu_backward(u, g), scheme, rowwise=True, columnwise=True)``.
    """
    if not swiglu_backward_fused_quant_supported(u, g, scheme):
        raise NotImplementedError(
            f"swiglu_backward_quantize_1x128: needs a 1x128 Float8Blockwise scheme, contiguous bfloat16/float16 CUDA u "
            f"(..., 2F) and g (..., F) of one dtype on an sm_89+ GPU, F and the rows multiples of 128; got scheme "
            f"{scheme!r}, u {u.dtype} {tuple(u.shape)} on {u.device}, g {getattr(g, 'dtype', None)} "
            f"{tuple(getattr(g, 'shape', ()))}")
    W = u.shape[-1]
    M = u.numel() // W
    return rowcol_regs_prologue(
        "swiglu_bwd_quant", (u.dtype, bucket(M), bucket(W)), u.shape, scheme,
        lambda: list(_SWIGLU_BWD_CONFIGS), u,
        lambda c: dict(SWIGLU_BWD=True, g_ptr=g),
        lambda: swiglu_backward(u, g))
