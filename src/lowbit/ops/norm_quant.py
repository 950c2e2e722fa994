"""RMSNorm fused with 1x128 FP8 quantization of its output (the input of LayerNormLinear's / LayerNormMLP's GEMM).

Under a 1x128 blockwise recipe the norm's output y is read only by the quantizer (the GEMM wants its rowwise copy,
wgrad its columnwise one), so writing y in FP32 and reading it back costs 8 bytes an element for nothing. Here:

1. ``_rms_rstd_kernel``: one read of x, rstd = 1 / sqrt(mean(x²) + eps) per row (FP32 accumulation, IEEE sqrt
   and division);
2. the blockwise quantizer's slab walk (``quant.kernels.quant.blockwise_kernel`` with ``NORM``) quantizes
   y = (x · rstd) · w, computed from x on the fly with the same two FP32 products in both of its walks.

Numerics (the spec, :func:`rmsnorm_quantize_reference`): given the kernel's rstd, the copies, scales and amax are
bit-identical to ``quantize_reference((x.float() * rstd[:, None]) * w.float())``. rstd itself agrees with the FP64
value to FP32 rounding of a sum (its order is the kernel's); torch's own RMSNorm rounds the same math its own way,
so the fused and unfused LayerNormLinear agree to within that (and the FP8 rounding it can tip), not bit for bit.
The backward is torch's ``_fused_rms_norm_backward`` on the saved (x, rstd), as for ``F.rms_norm``.
"""

from __future__ import annotations

import torch

from ..quant.reference import quantize_reference
from ..quant.schemes import BLOCK_SIZE, Float8Blockwise
from ..quant.tensor import QuantizedTensor
from ..runtime import env
from ..runtime.autotune import bucket, tuned_launch
from ..runtime.device import INTERPRET
from ..runtime.launch import launcher, remember
from ..runtime.log import declined

__all__ = ["rmsnorm_quantize_1x128", "rmsnorm_quantize_reference", "rmsnorm_rstd_reference", "norm_quant_fusable",
           "rms_norm_backward"]

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:
    from ..quant.triton_backend import (
        REGS_CONFIGS,
        BlockwisePlan,
        blockwise_args,
        blockwise_buffers,
        regs_ok,
        set_copies,
    )

def _enabled() -> bool:
    return env.fused("norm_quant")


def rmsnorm_rstd_reference(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(x²) + eps) of each row of x (..., K), in FP64, returned as FP32 (M,)."""
    x2 = x.reshape(-1, x.shape[-1]).double()
    return (1.0 / torch.sqrt((x2 * x2).mean(dim=1) + eps)).float()


def rmsnorm_quantize_reference(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, scheme, *,
                               rowwise: bool = True,
                               columnwise: bool = True):
    """The spec of the fused kernel given its rstd (M,): quantize ``(x · rstd) · w`` (FP32 products) with
    ``scheme``."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    y = (x2 * rstd.float().reshape(-1, 1)) * weight.float()
    return quantize_reference(y.reshape(x.shape), scheme, rowwise=rowwise, columnwise=columnwise)


def _runs(device: torch.device, scheme) -> bool:
    return (triton is not None and isinstance(scheme, Float8Blockwise) and scheme.block_dim == 1
            and scheme.block_size == BLOCK_SIZE and (device.type == "cuda" or INTERPRET))


def norm_quant_fusable(x: torch.Tensor, weight: torch.Tensor, scheme) -> bool:
    """Whether :func:`rmsnorm_quantize_1x128` takes this input: the fusion on (not ``LOWBIT_UNFUSE=norm_quant``),
    Triton on CUDA (or its interpreter), a 1x128 Float8Blockwise scheme, x float32 contiguous and non-empty,
    the norm weight float32 of x's last dim (the GPT's FP32 residual stream; other dtypes keep the unfused path,
    whose norm output dtype they would have to reproduce). Where not, says why
    (:func:`lowbit.runtime.log.declined`)."""
    if (_enabled() and isinstance(x, torch.Tensor) and x.dim() >= 1 and x.numel() > 0 and x.dtype == torch.float32
            and x.is_contiguous() and isinstance(weight, torch.Tensor) and weight.dtype == torch.float32
            and weight.shape == (x.shape[-1],) and weight.device == x.device and _runs(x.device, scheme)):
        return True
    declined("ops.norm_quant", lambda: _why_not(x, weight, scheme))
    return False


def _why_not(x, weight, scheme) -> str:
    """The first rule of :func:`norm_quant_fusable` this input breaks."""
    if not _enabled():
        return "LOWBIT_UNFUSE has norm_quant"
    if triton is None:
        return "Triton is not installed"
    if not (isinstance(scheme, Float8Blockwise) and scheme.block_dim == 1 and scheme.block_size == BLOCK_SIZE):
        return f"scheme {scheme!r} is not 1x{BLOCK_SIZE} Float8Blockwise"
    if not (isinstance(x, torch.Tensor) and x.dim() >= 1 and x.numel() > 0):
        return "x is not a non-empty tensor"
    if x.dtype != torch.float32:
        return f"x dtype {x.dtype} (float32 only)"
    if not x.is_contiguous():
        return "x is not contiguous"
    if not (isinstance(weight, torch.Tensor) and weight.dtype == torch.float32 and weight.shape == (x.shape[-1],)):
        return "the norm weight is not float32 of x's last dim"
    if weight.device != x.device:
        return "the norm weight is on another device"
    return f"device {x.device.type} (CUDA, or Triton's interpreter)"


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor,
                      need_weight_grad: bool):
    """(dx, dw) of y = (x · rstd) · w for x (M, K), rstd (M,): on CUDA torch's own fused RMSNorm backward (the kernel
    F.rms_norm's autograd runs there), elsewhere (no CPU kernel of it) the same math in FP32 torch ops:
    dx = rstd · (g - x̂ · mean(g · x̂)) with g = dy · w, x̂ = x · rstd; dw = Σ_rows dy · x̂. dw is None unless asked
    for."""
    K = x.shape[-1]
    dy = dy.reshape(-1, K).to(x.dtype)
    if x.is_cuda and hasattr(torch.ops.aten, "_fused_rms_norm_backward"):
        dx, dw = torch.ops.aten._fused_rms_norm_backward(dy, x, [K], rstd.reshape(-1, 1), weight, [True,
                                                                                                   need_weight_grad])
        return dx, (dw if need_weight_grad else None)
    r = rstd.reshape(-1, 1).float()
    xh = x.float() * r
    g = dy.float() * weight.float()
    dx = (r * (g - xh * (g * xh).mean(dim=1, keepdim=True))).to(x.dtype)
    dw = (dy.float() * xh).sum(0).to(weight.dtype) if need_weight_grad else None
    return dx, dw


if triton is not None:

    @triton.jit
    def rstd_of_sumsq(acc, K, eps):
        """rstd of each row from its (ROWS, BLOCK) elementwise partial sums of squares: one tree sum a row, then
        1 / sqrt(sum / K + eps) with IEEE division and sqrt (shared with lowbit.ops.residual's kernel)."""
        ms = tl.math.div_rn(tl.sum(acc, axis=1), K.to(tl.float32))
        return tl.math.div_rn(tl.full(ms.shape, 1.0, tl.float32), tl.sqrt_rn(ms + eps))

    @triton.jit
    def _rms_rstd_kernel(x_ptr, rstd_ptr, M, K, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        """rstd[m] = 1 / sqrt(sum_k x[m, k]² / K + eps) for ROWS rows a program (x (M, K) row-major FP32); the
        elementwise partial sums run over BLOCK-wide chunks, then one tree sum a row."""
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        rmask = rows < M
        acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=rmask[:, None] & (cols < K)[None, :], other=0.0)
            acc += x * x
        tl.store(rstd_ptr + rows, rstd_of_sumsq(acc, K, eps), mask=rmask)


def row_reduce_configs(K: int) -> list[dict]:
    """Candidates of a row-reduction kernel over rows of K (rows a program x chunk width, the first the default),
    chunks no wider than the row (rounded up to a power of two); shared with lowbit.ops.residual."""
    kp = max(16, triton.next_power_of_2(K))
    if INTERPRET:
        return [dict(ROWS=4, BLOCK=min(128, kp), num_warps=4)]
    out = []
    for rows, block, warps in ((4, 512, 4), (2, 1024, 4), (8, 256, 4), (1, 2048, 8), (16, 256, 8), (4, 1024, 8)):
        c = dict(ROWS=rows, BLOCK=min(block, kp), num_warps=warps)
        if c not in out:
            out.append(c)
    return out


def _quant_configs(rowwise: bool, columnwise: bool) -> list[dict]:
    """Slab-walk candidates of blockwise_kernel for the NORM prologue (the whole-tile path has none)."""
    if columnwise and rowwise:
        return [dict(BM=128, SLAB=32, SLAB2=64, num_warps=4, UNROLL=2, SCR=True, ROW2=True),
                dict(BM=128, SLAB=64, num_warps=4, SCR=True)]
    if columnwise:
        return [dict(BM=128, SLAB=64, num_warps=4, SCR=True), dict(BM=128, SLAB=32, num_warps=4, SCR=True)]
    return [dict(BM=128, SLAB=32, num_warps=4), dict(BM=128, SLAB=32, num_warps=4, UNROLL=4)]


_PLANS: dict = {}  # (M, K, scheme, rowwise, columnwise) -> (BlockwisePlan, regs_ok): bounded (runtime.launch.remember)


def rmsnorm_quantize_1x128(x: torch.Tensor, weight: torch.Tensor, eps: float, scheme, *, rowwise: bool = True,
                           columnwise: bool = True, rstd: torch.Tensor | None = None):
    """RMSNorm of x then 1x128 FP8 quantization of the result, without writing the norm output.

    Args:
        x: (..., K) float32, contiguous, on CUDA (or under Triton's interpreter): the norm input.
        weight: (K,) float32 norm weight.
        eps: the norm's epsilon (> 0).
        scheme: ``Float8Blockwise(block_dim=1, block_size=128)`` (any FP8 format, pow2, eps).
        rowwise, columnwise: which copies (as :func:`lowbit.quantize`).
        rstd: (M,) float32 on x's device, x's row statistics for this eps computed already (e.g. by
            :func:`lowbit.ops.residual.residual_add` with ``rms_eps``): the rstd kernel is skipped and this is used.

    Returns:
        ``(q, rstd)``: q a :class:`~lowbit.quant.tensor.QuantizedTensor` of x's shape and dtype holding the
        quantized norm output (see the module docstring for its exact value), rstd (M,) float32 with
        M = prod(x.shape[:-1]) — what the backward (:func:`rms_norm_backward`) needs besides x and the weight.
    """
    if not norm_quant_fusable(x, weight, scheme):
        raise NotImplementedError(
            "rmsnorm_quantize_1x128: needs a 1x128 Float8Blockwise scheme, a contiguous non-empty float32 x "
            "on CUDA and a "
            f"float32 weight of shape (x.shape[-1],) on its device; got scheme {scheme!r}, x "
            f"{getattr(x, 'dtype', None)} "
            f"{tuple(getattr(x, 'shape', ()))} on {getattr(x, 'device', None)}, weight "
            f"{getattr(weight, 'dtype', None)} "
            f"{tuple(getattr(weight, 'shape', ()))}" + ("" if _enabled() else " (LOWBIT_UNFUSE has norm_quant)"))
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise ValueError(f"eps: expected a float > 0, got {eps!r}")
    if not (rowwise or columnwise):
        raise ValueError("rowwise, columnwise: at least one copy must be asked for")
    Kd = x.shape[-1]
    M = x.numel() // Kd
    if rstd is None:
        rstd = torch.empty(M, dtype=torch.float32, device=x.device)
        tuned_launch("rms_rstd", (bucket(M), bucket(Kd)), lambda: row_reduce_configs(Kd),
                     lambda c: launcher(_rms_rstd_kernel)[(triton.cdiv(M, c["ROWS"]),)](x, rstd, M, Kd, float(eps),
                                                                                       **c))
    elif not (isinstance(rstd, torch.Tensor) and rstd.dtype == torch.float32 and tuple(rstd.shape) == (M,)
              and rstd.device == x.device and rstd.is_contiguous()):
        raise ValueError(f"rstd: expected a contiguous float32 tensor of shape ({M},) on {x.device} (one per "
                         "row of x), got "
                         f"{getattr(rstd, 'dtype', type(rstd).__name__)} {tuple(getattr(rstd, 'shape', ()))} on "
                         f"{getattr(rstd, 'device', None)}")
    key = (M, Kd, scheme, rowwise, columnwise)
    entry = _PLANS.get(key)
    if entry is None:  # (the plan, and whether the register-tile kernel may run: both follow from the key)
        entry = remember(_PLANS, key, (BlockwisePlan(M, Kd, scheme, rowwise, columnwise, x.device),
                                       regs_ok(x.view(M, Kd), scheme.block_size, scheme.block_dim == 2, rowwise,
                                               columnwise)))
    plan, regs = entry
    bufs = blockwise_buffers(plan, scheme.format, x.device, rowwise, columnwise)
    args = blockwise_args(plan, *bufs)
    w = weight.detach()

    # both copies of whole 128 x 128 tiles (regs): the register-tile kernel first (quant_gluon.rowcol_1x128_regs;
    # on the H200 0.93 of an FP32 copy's bandwidth, above the slab walk)
    def launch(c):
        fn, grid, extra, kw = plan.launch_args(c)  # rowcol_1x128_regs, or blockwise_kernel's slab configs
        launcher(fn)[grid](x, *args, *extra, **kw, NORM=True, rstd_ptr=rstd, nw_ptr=w)

    tuned_launch("rms_quant", (rowwise, columnwise, regs, bucket(M), bucket(Kd)),
                 lambda: (list(REGS_CONFIGS) if regs else []) + _quant_configs(rowwise, columnwise), launch)
    qt = QuantizedTensor(shape=tuple(x.shape), dtype=x.dtype, scheme=scheme)
    set_copies(qt, *bufs)
    return qt, rstd
