"""cuBLAS GEMM backend through torch: ``torch._scaled_mm`` (tensorwise) and
``torch.nn.functional.scaled_mm`` (rowwise, blockwise 1x128·128x128 / 1x128·1x128).

Registered as ``"cublas"``, ahead of the Triton backends (it is the fastest where it applies).
What it takes (``supports``): CUDA, E4M3/E5M2 pairs (blockwise and rowwise: E4M3 only), M, N, K
multiples of 16 (blockwise: K multiple of 128 and 128-element blocks, and M / N multiples of 4 so
the stored 1x128 scales — (n_blocks, pad4(rows)) — are exactly the outer-dim-major (rows, n_blocks)
view cuBLAS checks for; a 128x128 B whose K/128 is not divisible by 4, a grid cuBLAS rejects, runs with K zero-padded
to a multiple of 512). Epilogues: cuBLAS produces the FP32 (tensorwise)
or BF16 product and
:func:`lowbit.gemm.reference.apply_epilogue` applies bias / GELU / accumulate in torch.

A pairing this torch/cuBLAS build rejects at run time is remembered: the call is answered by the
Triton backend (same numbers up to FP32 accumulation order) and ``supports`` declines it afterwards.
Only capability errors are remembered: non-contiguous data is refused up front (ValueError naming the
operand), data not 16-byte aligned goes to the Triton GEMM for that call only, and out-of-memory or
CUDA errors propagate unchanged.
Nothing here touches CUDA at import time.
"""

from __future__ import annotations

import torch

from .. import gemm as _gemm
from ..quant.schemes import BLOCK_SIZE, Float8Blockwise, Float8Rowwise, Float8Tensorwise
from ..runtime.device import triton_installed
from . import register_backend
from .reference import apply_epilogue

__all__ = ["supports", "schemes_supported", "scaled_mm_cublas", "scaled_mm_cublas_traceable", "REJECTED",
           "REJECTED_WHY", "V1_DECLINED"]

REJECTED: set = set()
V1_DECLINED: set = set()  # signatures torch._scaled_mm refuses (they take F.scaled_mm)
REJECTED_WHY: dict = {}  # signature -> the error cuBLAS / torch gave (for diagnostics: tools, lowbit info)
_F = torch.nn.functional
_HAS_F_SCALED_MM = hasattr(_F, "scaled_mm") and hasattr(_F, "ScalingType")


def _kind(sch) -> str:
    if isinstance(sch, Float8Tensorwise):
        return "tensor"
    if isinstance(sch, Float8Rowwise):
        return "row"
    if isinstance(sch, Float8Blockwise):
        return f"block{sch.block_dim}d"
    return "other"


def _sig(a, b, out_dtype, K):
    return _scheme_sig(a.scheme, b.scheme, out_dtype, K)


def _scheme_sig(sa, sb, out_dtype, K):
    # K % 512: whether the 128x128 scale grid's padded row stride (pad4(K/128)) equals K/128
    return (_kind(sa), _kind(sb), sa.fmt, sb.fmt, out_dtype, K % 512 == 0)


def supports(a, b, a_copy, b_copy, opts) -> bool:
    """:func:`schemes_supported` for the call, on CUDA; unless the call names this backend, a call that would run
    with K zero-padded (:func:`_needs_k_pad`) is left to the Triton backend where its Gluon kernel takes it: the
    padding copies both operands first, and the Gluon kernel ran the 350m GPT's fc2 forward 1.31x faster
    (BENCHMARKS.md, GEMM)."""
    if a.device.type != "cuda" or b.device.type != "cuda":
        return False
    M, N, K = _gemm.gemm_dims(a, b, a_copy, b_copy)
    if not schemes_supported(a.scheme, b.scheme, M, N, K, opts.get("out_dtype")):
        return False
    if _needs_k_pad(b.scheme, K) and not opts.get("forced") and triton_installed():
        from .triton_backend import gluon_takes

        return not gluon_takes(a, b, a_copy, b_copy)
    return True


def schemes_supported(sa, sb, M: int, N: int, K: int, out_dtype) -> bool:
    """Whether cuBLAS runs ``A · Bᵀ`` for A (M, K) under scheme ``sa`` and B (N, K) under ``sb`` (the rules of
    :func:`supports`, from the schemes and dims alone)."""
    ka, kb = _kind(sa), _kind(sb)
    if "other" in (ka, kb) or _scheme_sig(sa, sb, out_dtype, K) in REJECTED:
        return False
    if M % 16 or N % 16 or K % 16:
        return False
    if ka == kb == "tensor":
        return not (sa.fmt == "e5m2" and sb.fmt == "e5m2")
    if not _HAS_F_SCALED_MM or sa.fmt != "e4m3" or sb.fmt != "e4m3":
        return False
    if ka == kb == "row":
        return True
    if ka.startswith("block") and kb.startswith("block"):
        if sa.block_size != BLOCK_SIZE or sb.block_size != BLOCK_SIZE or K % BLOCK_SIZE:
            return False
        # 2D x 1D: F.scaled_mm on torch 2.11 wants another scale layout for A; the Triton GEMM takes it
        return (ka, kb) in (("block1d", "block2d"), ("block1d", "block1d"))
    return False


def _recipe(sch):
    S = _F.ScalingType
    if isinstance(sch, Float8Tensorwise):
        return S.TensorWise
    if isinstance(sch, Float8Rowwise):
        return S.RowWise
    return S.BlockWise1x128 if sch.block_dim == 1 else S.BlockWise128x128


def _scales(t, which, rows):
    """Scale tensor in the layout cuBLAS expects for the (rows, K) operand (views of the stored layout)."""
    c = getattr(t, which)
    sch = t.scheme
    if isinstance(sch, Float8Tensorwise):
        return c.scale_inv.reshape(())
    if isinstance(sch, Float8Rowwise):
        return c.scale_inv.reshape(rows, 1)
    return t.logical_scales(which)  # 1x128: (rows, K/128) strides (1, rows); 128x128: (rows/128, K/128)


def _scaled_mm_v1(A, B, sa, sb, mm_dtype, sig, sch_a, sch_b):
    """Rowwise and blockwise through ``torch._scaled_mm``, which infers the scaling from the scale shapes: the same
    cuBLAS kernels as ``F.scaled_mm`` (bit-identical results, tested) at a quarter less host time a call. A pairing
    it refuses is remembered in ``V1_DECLINED`` and goes to ``F.scaled_mm``, which names the scaling explicitly."""
    if sig not in V1_DECLINED:
        try:
            return torch._scaled_mm(A, B.t(), scale_a=sa, scale_b=sb, out_dtype=mm_dtype)
        except (RuntimeError, ValueError) as e:
            if _gemm.not_capability(e):
                raise
            V1_DECLINED.add(sig)
    return _F.scaled_mm(A, B.t(), sa, _recipe(sch_a), sb, _recipe(sch_b), output_dtype=mm_dtype)


def _mm_dtype(tensorwise: bool, plain: bool, out_dtype: torch.dtype) -> torch.dtype:
    """The dtype cuBLAS writes the product in: the output's where no epilogue follows (blockwise: BF16 or FP32 only),
    else FP32 for the epilogue to round once (:func:`scaled_mm_cublas` and its traced form share this rule)."""
    if tensorwise:
        return out_dtype if plain else torch.float32
    return torch.bfloat16 if plain and out_dtype == torch.bfloat16 else torch.float32


def _needs_k_pad(b_scheme, K: int) -> bool:
    """Whether the call runs with K zero-padded (:func:`_pad_k`): a 128x128 B whose K/128 is not divisible by 4.
    cuBLAS on torch 2.11 rejects that scale grid (measured for K = 2816, an MLP's fc2: 22 blocks; both as the padded
    stored view and as a dense copy)."""
    return isinstance(b_scheme, Float8Blockwise) and b_scheme.block_dim == 2 and bool((K // BLOCK_SIZE) % 4)


def _pad_k(A, B, sa, sb, a_scheme, b_scheme):
    """``A`` (M, K), ``B`` (N, K) and their logical scale grids (rows, K/128) with K zero-padded to a multiple of 512,
    the grids in the layouts cuBLAS reads (:func:`_stored_layout`). The padded blocks hold zeros (their scales one):
    each adds an exact zero to every sum, so the product is the unpadded one's."""
    K = A.shape[1]
    pad = -K % 512
    A = torch.cat([A, A.new_zeros(A.shape[0], pad)], 1)
    B = torch.cat([B, B.new_zeros(B.shape[0], pad)], 1)
    sa = torch.cat([sa, sa.new_ones(sa.shape[0], pad // BLOCK_SIZE)], 1)
    sb = torch.cat([sb, sb.new_ones(sb.shape[0], pad // BLOCK_SIZE)], 1)
    return A, B, _stored_layout(sa, a_scheme), _stored_layout(sb, b_scheme)


def _triton(a, b, **kw):
    from .triton_backend import scaled_mm_triton

    return scaled_mm_triton(a, b, **kw)


def scaled_mm_cublas(a, b, *, a_copy, b_copy, out_dtype, bias=None, gelu=False, accumulate=False, out=None):
    """``A · Bᵀ`` through cuBLAS (see :func:`lowbit.gemm.scaled_mm`); returns ``(y, pre_gelu or None)``."""
    A = getattr(a, a_copy).data
    B = getattr(b, b_copy).data
    kw = dict(a_copy=a_copy, b_copy=b_copy, out_dtype=out_dtype, bias=bias, gelu=gelu, accumulate=accumulate, out=out)
    # Layout rules checked here, so that cuBLAS's refusal of a layout is never taken for a capability limit
    # (REJECTED is process-wide: one odd tensor must not move every later call of its signature off cuBLAS)
    _gemm.check_k_contiguous("a", a_copy, A, "cuBLAS")
    _gemm.check_k_contiguous("b", b_copy, B, "cuBLAS")
    if A.data_ptr() % 16 or B.data_ptr() % 16:  # cuBLAS wants 16-byte aligned operands; the Triton GEMM does not
        return _triton(a, b, **kw)
    M, K = A.shape
    N = B.shape[0]
    tensorwise = isinstance(a.scheme, Float8Tensorwise) and isinstance(b.scheme, Float8Tensorwise)
    plain = bias is None and not gelu and not accumulate and out is None
    try:
        mm_dtype = _mm_dtype(tensorwise, plain, out_dtype)
        if tensorwise:
            acc = torch._scaled_mm(A, B.t(), scale_a=_scales(a, a_copy, M), scale_b=_scales(b, b_copy, N),
                                   out_dtype=mm_dtype)
        else:
            sa = _scales(a, a_copy, M)
            sb = _scales(b, b_copy, N)
            if _needs_k_pad(b.scheme, K):
                A, B, sa, sb = _pad_k(A, B, sa, sb, a.scheme, b.scheme)
            if not (isinstance(b.scheme, Float8Blockwise) and b.scheme.block_dim == 1):
                # rowwise: (1, N); 128x128: the grid of Bᵀ. A 1x128 B takes (N, K/128) outer-dim-major as stored
                sb = sb.t()
            acc = _scaled_mm_v1(A, B, sa, sb, mm_dtype, _sig(a, b, out_dtype, K), a.scheme, b.scheme)
    except (RuntimeError, ValueError) as e:
        if _gemm.not_capability(e):
            raise
        sig = _sig(a, b, out_dtype, K)
        REJECTED.add(sig)
        REJECTED_WHY[sig] = f"{type(e).__name__}: {str(e)[:400]}"
        _gemm.forget_choices()  # the dispatcher's memo re-asks supports(), which now declines this signature
        return _triton(a, b, **kw)
    if plain and acc.dtype == out_dtype:
        return acc, None
    # (a blockwise GEMM's float16 output: cuBLAS sums in FP32 here, rounded once to float16 by the epilogue)
    return apply_epilogue(acc.float(), out_dtype=out_dtype, bias=bias.float() if bias is not None else None, gelu=gelu,
                          accumulate=accumulate, out=out)


def _stored_layout(s: torch.Tensor, sch) -> torch.Tensor:
    """A logical (rows, blocks) scale grid in the layout :func:`lowbit.quant.tensor.scale_storage` gives cuBLAS: 1x128
    outer-dim-major; 128x128 row-major (whole multiples of 4 blocks a row: :func:`_pad_k` pads K where not);
    tensorwise a 0-dim tensor."""
    if isinstance(sch, Float8Tensorwise):
        return s.reshape(())
    return s.t().contiguous().t() if sch.block_dim == 1 else s.contiguous()


def scaled_mm_cublas_traceable(A: torch.Tensor, B: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, *, a_scheme,
                               b_scheme, out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``A · Bᵀ (+ bias)`` as :func:`scaled_mm_cublas` computes it, in torch operations a compiled graph traces (the
    same cuBLAS call on the same operands and scale layouts: the same bits, tested on the GPU).

    Args:
        A: (M, K) FP8, row-major, under ``a_scheme``; B: (N, K) FP8, row-major, under ``b_scheme``
            (:func:`schemes_supported` holds for the pair).
        sa, sb: their logical scale grids, (rows, K / 128) (tensorwise: one element).
        out_dtype: the output's dtype; bias: (N,) or None, added in FP32 before the cast.
    """
    plain = bias is None
    tensorwise = isinstance(a_scheme, Float8Tensorwise) and isinstance(b_scheme, Float8Tensorwise)
    mm_dtype = _mm_dtype(tensorwise, plain, out_dtype)
    if tensorwise:
        acc = torch._scaled_mm(A, B.t(), scale_a=sa.reshape(()), scale_b=sb.reshape(()), out_dtype=mm_dtype)
    else:
        if _needs_k_pad(b_scheme, A.shape[1]):
            A, B, la, lb = _pad_k(A, B, sa, sb, a_scheme, b_scheme)
        else:
            la, lb = _stored_layout(sa, a_scheme), _stored_layout(sb, b_scheme)
        if b_scheme.block_dim == 1:
            # 1x128 . 1x128: torch._scaled_mm declines the pairing on the torch this was measured with and
            # scaled_mm_cublas answers with F.scaled_mm (V1_DECLINED); both are the same cuBLAS kernel
            # (the aten operator: torch.compile does not trace torch._scaled_mm_v2, which F.scaled_mm calls)
            acc = torch.ops.aten._scaled_mm_v2.default(A, B.t(), [la], [_recipe(a_scheme).value], [], [lb],
                                                       [_recipe(b_scheme).value], [], None, mm_dtype)
        else:
            acc = torch._scaled_mm(A, B.t(), scale_a=la, scale_b=lb.t(), out_dtype=mm_dtype)
    if plain and acc.dtype == out_dtype:
        return acc
    return apply_epilogue(acc.float(), out_dtype=out_dtype, bias=None if plain else bias.float())[0]


register_backend("cublas", supports, scaled_mm_cublas)
