"""The residual add of a pre-norm transformer, ``out = x + y`` (x the FP32 residual stream, y a branch output in any
float dtype), fused: one kernel reads x and y once and writes out, and can also return the RMSNorm statistics of
``out`` that the next block's fused norm + quantizer (:mod:`lowbit.ops.norm_quant`) would otherwise read ``out``
again to compute.

Numerics: ``out = x + float(y)`` in FP32, one rounding: bit for bit torch's ``x + y`` with type promotion.
``rstd = 1 / sqrt(mean(out²) + eps)`` per row, FP32 accumulation in the kernel's order (as
:func:`lowbit.ops.norm_quant.rmsnorm_rstd_reference`, to FP32 rounding of a sum). Backward: ``dx = g``,
``dy = g`` rounded to y's dtype (torch's add backward); rstd carries no gradient (the norm's own backward
accounts for its dependence on x).

In torch the add of an FP32 and a BF16 tensor runs the non-vectorized mixed-dtype elementwise kernel (about
2.5 TB/s, 3.1 ms of a 1.3b GPT step).

The backward can take over the next RMSNorm's backward (``norm_weight=``, a :class:`NormGradLink`): the module
whose norm reads ``out`` hands the gradient of its norm output ``dn`` to the link instead of computing the norm's
backward itself, and the add's backward then runs, in one kernel, what autograd would otherwise run as four
(torch's RMSNorm backward, its weight-gradient reduction, the sum of the two gradients of ``out`` and the cast of
that sum to y's dtype): with x̂ = out·rstd and gw = dn·w,

    d_out = g + rstd · (gw − x̂ · mean(gw · x̂))      (g: the gradient of out from its other uses)
    dx = d_out (FP32),  dy = d_out rounded to y's dtype,  d w = Σ_rows dn · x̂

in FP32 (per-row sums in the kernel's order, the weight gradient as per-program partial sums, then
:func:`column_sum`).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..runtime import env
from ..runtime.autotune import bucket, tuned_launch
from ..runtime.device import INTERPRET, is_dtensor, num_sms
from ..runtime.log import declined
from .norm_quant import rms_norm_backward, rmsnorm_rstd_reference, row_reduce_configs

__all__ = ["residual_add", "residual_add_reference", "residual_add_supported", "residual_add_op", "NormGradLink",
           "norm_input_link", "rms_norm_linked", "norm_residual_backward", "norm_residual_backward_reference"]

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None



def residual_add_reference(x: torch.Tensor, y: torch.Tensor, rms_eps: float | None = None):
    """The spec: ``x + y`` (FP32), and with ``rms_eps`` also rstd (M,) of the sum in FP64, rounded to FP32 (the
    kernel's to within FP32 rounding of its sum)."""
    out = x + y.float()
    if rms_eps is None:
        return out
    return out, rmsnorm_rstd_reference(out, rms_eps)


def norm_residual_backward_reference(g: torch.Tensor | None, dn: torch.Tensor, out: torch.Tensor, rstd: torch.Tensor,
                                     weight: torch.Tensor, y_dtype: torch.dtype):
    """The spec of the fused backward (module docstring) in FP64: ``(dx float32, dy y_dtype, dw float32)`` for
    out (M, K) float32, dn (M, K) any float, g (M, K) float32 or None, rstd (M,), weight (K,). dy is dx's FP32 value
    rounded to y_dtype, as the kernel rounds it."""
    K = out.shape[-1]
    xh = out.reshape(-1, K).double() * rstd.reshape(-1, 1).double()
    dn2 = dn.reshape(-1, K).double()
    gw = dn2 * weight.double()
    d = rstd.reshape(-1, 1).double() * (gw - xh * (gw * xh).mean(dim=1, keepdim=True))
    if g is not None:
        d = d + g.reshape(-1, K).double()
    dx = d.float().reshape(out.shape)
    return dx, dx.to(y_dtype), (dn2 * xh).sum(0).float()


def residual_add_supported(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether the kernel takes (x, y): the fusion on (not ``LOWBIT_UNFUSE=residual``), Triton on CUDA (or its
    interpreter), x float32 and y float32 / bfloat16 / float16 of x's shape, both contiguous, non-empty, same device.
    Where not, says why (:func:`lowbit.runtime.log.declined`)."""
    if (env.fused("residual") and triton is not None
            and isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == torch.float32
            and y.dtype in (torch.float32, torch.bfloat16, torch.float16) and x.shape == y.shape and x.dim() >= 1
            and x.numel() > 0 and x.is_contiguous() and y.is_contiguous() and x.device == y.device
            and (x.is_cuda or INTERPRET)):
        return True
    if not env.fused("residual"):
        declined("ops.residual", "LOWBIT_UNFUSE has residual")
    elif triton is None:
        declined("ops.residual", "Triton is not installed")
    elif not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == torch.float32
              and y.dtype in (torch.float32, torch.bfloat16, torch.float16)):
        declined("ops.residual", "x is not float32, or y not float32 / bfloat16 / float16")
    elif not (x.shape == y.shape and x.dim() >= 1 and x.numel() > 0 and x.device == y.device):
        declined("ops.residual", "x and y differ in shape or device, or are empty")
    elif not (x.is_contiguous() and y.is_contiguous()):
        declined("ops.residual", "x or y is not contiguous")
    else:
        declined("ops.residual", f"device {x.device.type} (CUDA, or Triton's interpreter)")
    return False


if triton is not None:
    from .norm_quant import rstd_of_sumsq  # (a @triton.jit helper: defined only with Triton)

    @triton.jit
    def _residual_add_kernel(x_ptr, y_ptr, o_ptr, rstd_ptr, M, K, eps, STATS: tl.constexpr, ROWS: tl.constexpr,
                             BLOCK: tl.constexpr):
        """ROWS rows a program, BLOCK columns at a time: o = x + y (FP32); STATS: rstd of o's rows (elementwise
        partial sums of squares over the chunks, then norm_quant.rstd_of_sumsq, as the rstd kernel)."""
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        rmask = rows < M
        acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            m = rmask[:, None] & (cols < K)[None, :]
            off = rows[:, None] * K + cols[None, :]
            o = tl.load(x_ptr + off, mask=m, other=0.0) + tl.load(y_ptr + off, mask=m, other=0.0).to(tl.float32)
            tl.store(o_ptr + off, o, mask=m)
            if STATS:
                acc += o * o
        if STATS:
            tl.store(rstd_ptr + rows, rstd_of_sumsq(acc, K, eps), mask=rmask)

    @triton.jit
    def _norm_residual_bwd_kernel(g_ptr, dn_ptr, o_ptr, rstd_ptr, w_ptr, dx_ptr, dy_ptr, dwp_ptr, M, K,
                                  HAS_G: tl.constexpr, STORE_DY: tl.constexpr, NEED_DW: tl.constexpr,
                                  ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
        """The fused backward of residual add + RMSNorm (module docstring). Whole rows in registers (BLOCK_K >= K),
        ROWS rows at a time; program p takes row groups p, p + P, ... (P programs) and writes its weight-gradient
        partial sums to dwp[p, :] (summed by the launcher)."""
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_K)
        cmask = cols < K
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        dw = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
        for grp in range(pid, tl.cdiv(M, ROWS), tl.num_programs(0)):
            rows = (grp * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # (< M + ROWS: int32 is enough before the cast)
            rmask = rows < M
            m = rmask[:, None] & cmask[None, :]
            off = rows[:, None] * K + cols[None, :]
            r = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
            xh = tl.load(o_ptr + off, mask=m, other=0.0) * r[:, None]
            dn = tl.load(dn_ptr + off, mask=m, other=0.0).to(tl.float32)
            gw = dn * w[None, :]
            c = tl.math.div_rn(tl.sum(gw * xh, axis=1), K.to(tl.float32))
            d = r[:, None] * (gw - xh * c[:, None])
            if HAS_G:
                d += tl.load(g_ptr + off, mask=m, other=0.0)
            tl.store(dx_ptr + off, d, mask=m)
            if STORE_DY:
                tl.store(dy_ptr + off, d.to(dy_ptr.dtype.element_ty), mask=m)
            if NEED_DW:
                dw += dn * xh
        if NEED_DW:
            tl.store(dwp_ptr + pid.to(tl.int64) * K + cols, tl.sum(dw, axis=0), mask=cmask)

    @triton.jit
    def _column_sum_kernel(p_ptr, o_ptr, R, K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        """o[k] = sum over r of p[r, k] (p (R, K) contiguous FP32): program i takes columns i·BLOCK_K.., walking the
        rows BLOCK_R at a time (one accumulator a column and row lane, folded once at the end: a fixed order)."""
        cols = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
        cmask = cols < K
        acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            rows = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
            acc += tl.load(p_ptr + rows[:, None] * K + cols[None, :], mask=(rows < R)[:, None] & cmask[None, :],
                           other=0.0)
        tl.store(o_ptr + cols, tl.sum(acc, axis=0), mask=cmask)


def _launch(x, y, out, rstd, eps, stats: bool):

    K = x.shape[-1]
    M = x.numel() // K
    # (candidates: the rstd kernel's, the same row walk)
    tuned_launch("residual_add", (stats, y.dtype, bucket(M), bucket(K)), lambda: row_reduce_configs(K),
                 lambda c: _residual_add_kernel[(triton.cdiv(M, c["ROWS"]),)](x, y, out, rstd, M, K, float(eps),
                                                                             STATS=stats, **c))


def _bwd_configs(K: int) -> list[dict]:
    """Candidates of the fused backward (rows a program step, warps, programs an SM; the first the default), whole
    rows in registers: at most 32 FP32 values of each row tile a thread."""
    kp = max(16, triton.next_power_of_2(K))
    if INTERPRET:
        return [dict(ROWS=2, BLOCK_K=kp, num_warps=4, PER_SM=1)]
    out = []
    for rows, warps, per_sm in ((2, 8, 4), (1, 4, 8), (4, 8, 2), (1, 8, 4), (2, 4, 8), (4, 16, 2)):
        if rows * kp <= 32 * 32 * warps:
            out.append(dict(ROWS=rows, BLOCK_K=kp, num_warps=warps, PER_SM=per_sm))
    return out


def column_sum(p: torch.Tensor) -> torch.Tensor:
    """``p.sum(0)`` of a contiguous (R, K) float32 tensor of partial sums, as (K,) float32: one Triton kernel on CUDA
    (and under the interpreter), a program a 64-column strip, so a few hundred partial rows cost a few microseconds.
    torch's reduction over the leading dim runs at about a tenth of the copy speed on the norm backward's partials
    (up to 2.3 ms of kernel time a 1.3b step). Same terms, another order: FP32 rounding of the sum."""
    if p.dim() != 2 or p.dtype != torch.float32 or not p.is_contiguous():
        raise ValueError(f"p: expected a contiguous 2-D float32 tensor, got {p.dtype} {tuple(p.shape)} "
                         f"(contiguous: {p.is_contiguous()})")
    if triton is None or not (p.is_cuda or INTERPRET) or p.numel() == 0:
        return p.sum(0)
    R, K = p.shape
    out = torch.empty(K, dtype=torch.float32, device=p.device)
    bk = 64 if not INTERPRET else 16
    _column_sum_kernel[(triton.cdiv(K, bk),)](p, out, R, K, BLOCK_R=32 if not INTERPRET else 8, BLOCK_K=bk,
                                              num_warps=4)
    return out


NORM_BACKWARD_MAX_K = 16384  # whole rows in registers: wider rows take the composition of torch ops


def norm_residual_backward(g: torch.Tensor | None, dn: torch.Tensor, out: torch.Tensor, rstd: torch.Tensor,
                           weight: torch.Tensor, y_dtype: torch.dtype, need_dw: bool = True):
    """The fused backward of ``out = x + y`` followed by ``RMSNorm(out)`` (module docstring).

    Args:
        g: (M, K)-shaped (any leading dims) float32 gradient of ``out`` from its other uses, or None (zero).
        dn: ``out``'s shape, float32 / bfloat16 / float16: the gradient of the norm output RMSNorm(out).
        out: (..., K) float32 contiguous: the residual sum, the norm's input.
        rstd: (M,) float32: the norm's row statistics, the ones its forward used.
        weight: (K,) float32 norm weight.
        y_dtype: the dtype of the add's y (its gradient is returned in it).
        need_dw: compute the norm weight's gradient.

    Returns:
        ``(dx, dy, dw)``: dx (out's shape, float32) the gradient of x, dy the same rounded to ``y_dtype`` (dx itself
        where that is float32), dw (K,) float32 or None. One Triton kernel on CUDA (and under the interpreter) for
        K <= NORM_BACKWARD_MAX_K, else the same math in torch ops.
    """
    K = out.shape[-1]
    M = out.numel() // K
    for name, t, dts in (("dn", dn, (torch.float32, torch.bfloat16, torch.float16)), ("g", g, (torch.float32,))):
        if t is None:
            continue
        if t.dtype not in dts or tuple(t.shape) != tuple(out.shape) or t.device != out.device:
            raise ValueError(f"{name}: expected {'/'.join(str(d) for d in dts)} of shape {tuple(out.shape)} on "
                             f"{out.device} "
                             f"(out's), got {t.dtype} {tuple(t.shape)} on {t.device}")
    if out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous float32 tensor, got {out.dtype} (contiguous: "
                         f"{out.is_contiguous()})")
    if not (rstd.dtype == torch.float32 and rstd.numel() == M and rstd.device == out.device):
        raise ValueError(f"rstd: expected float32 with {M} elements (one per row of out) on {out.device}, got "
                         f"{rstd.dtype} "
                         f"{tuple(rstd.shape)} on {rstd.device}")
    if not (weight.dtype == torch.float32 and tuple(weight.shape) == (K,)):
        raise ValueError(f"weight: expected float32 of shape ({K},), got {weight.dtype} {tuple(weight.shape)}")
    if triton is None or not (out.is_cuda or INTERPRET) or K > NORM_BACKWARD_MAX_K or M == 0:
        return _norm_residual_backward_torch(g, dn, out, rstd, weight, y_dtype, need_dw)

    dn = dn.contiguous()
    g = None if g is None else g.contiguous()
    rstd = rstd.reshape(-1).contiguous()
    dx = torch.empty_like(out)
    store_dy = y_dtype != torch.float32
    dy = torch.empty(out.shape, dtype=y_dtype, device=out.device) if store_dy else dx
    n_sm = num_sms(out.device) if out.is_cuda else 1
    part = {}

    def launch(c):
        grid = max(1, min(triton.cdiv(M, c["ROWS"]), n_sm * c["PER_SM"]))
        dwp = torch.empty((grid, K), dtype=torch.float32, device=out.device) if need_dw else dx
        kw = {k: v for k, v in c.items() if k != "PER_SM"}
        _norm_residual_bwd_kernel[(grid,)](dx if g is None else g, dn, out, rstd, weight.detach(), dx, dy, dwp, M, K,
                                          HAS_G=g is not None, STORE_DY=store_dy, NEED_DW=need_dw, **kw)
        # (the partials' sum inside the tuned launch: a config with more programs writes more partial rows)
        part["dw"] = column_sum(dwp) if need_dw else None

    # (not keyed by y's dtype, which adds or drops one store: the residual add's backward and the norm input's
    # share one tuning)
    tuned_launch("norm_residual_bwd", (g is not None, dn.dtype, need_dw, bucket(M), bucket(K)),
                 lambda: _bwd_configs(K), launch)
    return dx, dy, part["dw"]


def _norm_residual_backward_torch(g, dn, out, rstd, weight, y_dtype, need_dw):
    """The same math without the kernel: norm_quant.rms_norm_backward (torch's RMSNorm backward on CUDA), then the
    sum and the cast."""
    K = out.shape[-1]
    dx, dw = rms_norm_backward(dn, out.reshape(-1, K), rstd.reshape(-1), weight, need_dw)
    if g is not None:
        dx = dx + g.reshape(-1, K)
    dx = dx.reshape(out.shape)
    return dx, dx.to(y_dtype), dw


class NormGradLink:
    """Hands the gradient of an RMSNorm's output from the module running that norm back to the residual add whose
    sum the norm reads, so the add's backward runs the norm's backward fused with its own
    (:func:`norm_residual_backward`). Made by :func:`residual_add` (``norm_weight=``) and passed to that one norm
    (``LayerNormLinear`` / ``LayerNormMLP``'s ``input_norm_link``); a module that cannot use it (another norm, a path
    without RMSNorm) leaves it alone and computes its norm's backward itself, which is the same gradient.

    Attributes: ``weight`` / ``eps`` the norm's, ``rstd`` the sum's row statistics for that eps. (The sum itself is
    known by address and shape only: holding it would make a reference cycle through its autograd node.)
    """

    __slots__ = ("out_key", "weight", "eps", "rstd", "_pending")

    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight, self.eps = weight, eps
        self.out_key = self.rstd = self._pending = None

    def check(self, input: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        """Raise ValueError unless this link belongs to a norm of ``input`` with ``weight`` and ``eps``."""
        key = (input.data_ptr(), tuple(input.shape), input.dtype) if isinstance(input, torch.Tensor) else None
        if key != self.out_key:
            raise ValueError("input_norm_link: made by residual_add for another tensor; pass the link with the sum it "
                             f"came with (link's sum {self.out_key and self.out_key[1]}, input "
                             f"{tuple(getattr(input, 'shape', ()))})")
        if weight is not self.weight or float(eps) != self.eps:
            raise ValueError("input_norm_link: made for another norm (weight or eps differ: link eps "
                             f"{self.eps}, module eps "
                             f"{eps}); residual_add(..., norm_weight=) must name this module's norm weight and eps")

    def put(self, dn: torch.Tensor, rstd: torch.Tensor) -> None:
        """Called by the norm's module in its backward: dn the gradient of the norm output, rstd the statistics its
        forward used."""
        if self._pending is not None:
            raise RuntimeError("NormGradLink: a second norm-output gradient before the residual add's "
                               "backward took the "
                               "first; one link serves one norm")
        self._pending = (dn, rstd)

    def take(self):
        p, self._pending = self._pending, None
        return p


class _ResidualAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, eps, norm_weight, make_link):  # make_link: a NormGradLink to fill, or None
        out = torch.empty_like(x)
        stats = eps is not None
        rstd = torch.empty(x.numel() // x.shape[-1], dtype=torch.float32, device=x.device) if stats else out
        _launch(x, y, out, rstd, eps if stats else 1.0, stats)
        ctx.y_dtype = y.dtype
        ctx.link = None
        if not stats:
            return out
        ctx.mark_non_differentiable(rstd)
        if not make_link:
            return out, rstd
        ctx.link = make_link
        make_link.out_key, make_link.rstd = (out.data_ptr(), tuple(out.shape), out.dtype), rstd
        ctx.save_for_backward(out, norm_weight)
        return out, rstd

    @staticmethod
    def backward(ctx, g, *_):
        p = ctx.link.take() if ctx.link is not None else None
        if p is None:  # no linked norm ran its backward: the add's own
            return g, g.to(ctx.y_dtype), None, None, None
        out, w = ctx.saved_tensors
        dn, rstd = p
        dx, dy, dw = norm_residual_backward(g, dn, out, rstd, w, ctx.y_dtype, need_dw=ctx.needs_input_grad[3])
        return dx, dy, None, dw, None


class _NormInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, norm_weight, link):
        ctx.link = link
        ctx.save_for_backward(x, norm_weight)
        link.out_key = (x.data_ptr(), tuple(x.shape), x.dtype)
        return x

    @staticmethod
    def backward(ctx, g):
        p = ctx.link.take()
        if p is None:  # no linked norm ran its backward
            return g, None, None
        x, w = ctx.saved_tensors
        dn, rstd = p
        dx, _, dw = norm_residual_backward(g, dn, x, rstd, w, torch.float32, need_dw=ctx.needs_input_grad[1])
        return dx, dw, None


def norm_input_link(x: torch.Tensor, norm_weight: torch.Tensor, rms_eps: float, rstd: torch.Tensor | None = None):
    """``(x, link)``: ``x`` unchanged (for autograd, a new node) and a :class:`NormGradLink` for the RMSNorm that
    reads it (``norm_weight``, ``rms_eps``), whose backward then runs in x's node: the gradient of x from its other
    uses plus the norm's, and the norm weight's gradient, in one kernel (:func:`norm_residual_backward`, y's dtype
    FP32: the same dx bits as the link of :func:`residual_add`). For a norm whose input no linked residual add
    made: the first block's, or under FSDP2 every block's, where the add that made x belongs to the previous
    ``fully_shard`` unit, which the norm weight's gradient must not wait for. ``rstd``: the statistics already
    computed for this norm (the link's, as ``residual_add`` sets them), or None. Link None (x returned as is)
    where the fused backward does not run: off (``LOWBIT_UNFUSE=norm_backward``), inside torch.compile, no
    gradient, or x not float32 contiguous on CUDA (or Triton's interpreter)."""
    if not (isinstance(x, torch.Tensor) and isinstance(norm_weight, torch.Tensor)):
        raise TypeError(f"x, norm_weight: expected tensors, got {type(x).__name__}, {type(norm_weight).__name__}")
    if not (isinstance(rms_eps, (int, float)) and not isinstance(rms_eps, bool) and rms_eps > 0):
        raise ValueError(f"rms_eps: expected a float > 0, got {rms_eps!r}")
    if not (norm_weight.dtype == torch.float32 and tuple(norm_weight.shape) == (x.shape[-1],)):
        raise ValueError(f"norm_weight: expected a float32 tensor of shape ({x.shape[-1]},), got {norm_weight.dtype} "
                         f"{tuple(norm_weight.shape)}")
    if (not _fused_norm_backward_on() or torch.compiler.is_compiling() or not torch.is_grad_enabled()
            or not (x.requires_grad or norm_weight.requires_grad) or is_dtensor(norm_weight) or triton is None
            or x.dtype != torch.float32 or not x.is_contiguous() or x.numel() == 0
            or not (x.is_cuda or INTERPRET)):
        return x, None
    link = NormGradLink(norm_weight, float(rms_eps))
    link.rstd = rstd
    return _NormInput.apply(x, norm_weight, link), link


class _LinkedRMSNorm(torch.autograd.Function):
    """RMSNorm whose backward is handed to a :class:`NormGradLink` (the residual add's backward runs it)."""

    @staticmethod
    def forward(ctx, x, weight, eps, link):
        y, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
        ctx.link = link
        ctx.save_for_backward(rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        (rstd,) = ctx.saved_tensors
        ctx.link.put(dy, rstd.reshape(-1))
        return None, None, None, None


def rms_norm_linked(x: torch.Tensor, weight: torch.Tensor, eps: float, link: NormGradLink | None) -> torch.Tensor:
    """``F.rms_norm(x, (K,), weight, eps)`` (the same forward bits, torch's kernel), whose backward runs inside the
    residual add that made ``link`` (checked to belong to x, weight and eps); without a link (or without torch's
    ``_fused_rms_norm``, or inside torch.compile, where the link cannot cross between operators), plain
    ``F.rms_norm``, which computes the same gradient itself."""
    if link is None or not hasattr(torch.ops.aten, "_fused_rms_norm") or torch.compiler.is_compiling():
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    link.check(x, weight, eps)
    return _LinkedRMSNorm.apply(x, weight, float(eps), link)


# ------------------------------------------------------------------------------------------------
# residual_add as a torch.library operator: what torch.compile traces (eager calls run _ResidualAdd)
# ------------------------------------------------------------------------------------------------
@torch.library.custom_op("lowbit::residual_add", mutates_args=())
def residual_add_op(x: torch.Tensor, y: torch.Tensor, rms_eps: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """``out = x + y`` (x float32, y float32 / bfloat16 / float16 of x's shape; FP32, one rounding) as a new
    contiguous float32 tensor, and with ``rms_eps`` the RMSNorm statistics rstd (M,) float32 of out's rows for that
    epsilon (else an empty (0,) float32 tensor). The kernel where :func:`residual_add_supported`, the bits
    :func:`residual_add` computes there; elsewhere torch's ``x + y`` and :func:`rmsnorm_rstd_reference`.
    Differentiable in x and y (dx = d out, dy = d out in y's dtype); rstd carries no gradient."""
    _check_op_args(x, y, rms_eps)
    x, y = x.contiguous(), y.contiguous()
    stats = rms_eps is not None
    M = x.numel() // x.shape[-1]
    if not residual_add_supported(x, y):
        out = (x + y).contiguous()
        rstd = rmsnorm_rstd_reference(out, rms_eps) if stats else out.new_empty((0,))
        return out, rstd
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    rstd = torch.empty(M if stats else 0, dtype=torch.float32, device=x.device)
    _launch(x, y, out, rstd if stats else out, rms_eps if stats else 1.0, stats)
    return out, rstd


@residual_add_op.register_fake
def _(x, y, rms_eps):
    _check_op_args(x, y, rms_eps)
    M = x.numel() // x.shape[-1]
    return x.new_empty(x.shape), x.new_empty((M if rms_eps is not None else 0,))


def _check_op_args(x, y, rms_eps):
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == torch.float32
            and y.dtype in (torch.float32, torch.bfloat16, torch.float16) and x.shape == y.shape and x.dim() >= 1
            and x.device == y.device):
        raise ValueError(f"x, y: expected x float32 and y float32 / bfloat16 / float16 of x's shape on its device, "
                         f"got x {getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}, y "
                         f"{getattr(y, 'dtype', type(y).__name__)} {tuple(getattr(y, 'shape', ()))}")
    if rms_eps is not None and not rms_eps > 0:
        raise ValueError(f"rms_eps: expected None or a float > 0, got {rms_eps!r}")


def _residual_setup(ctx, inputs, output):
    ctx.y_dtype = inputs[1].dtype
    ctx.mark_non_differentiable(output[1])


def _residual_grad(ctx, g, _):
    if g is None:
        return None, None, None
    return g, g.to(ctx.y_dtype), None


residual_add_op.register_autograd(_residual_grad, setup_context=_residual_setup)


def _fused_norm_backward_on() -> bool:
    return env.fused("norm_backward")


def residual_add(x: torch.Tensor, y: torch.Tensor, *, rms_eps: float | None = None,
                 norm_weight: torch.Tensor | None = None):
    """``x + y`` for the residual stream (see the module docstring); differentiable.

    Args:
        x: (..., K) float32, the residual stream.
        y: x's shape, float32 / bfloat16 / float16: the branch output added to it.
        rms_eps: given (> 0), also return rstd (M,) float32 of the sum's rows, M = prod(x.shape[:-1]), for a
            following RMSNorm with this epsilon (``LayerNormLinear`` / ``LayerNormMLP``'s ``input_rstd``).
        norm_weight: (K,) float32, that following RMSNorm's weight (needs ``rms_eps``): also return a
            :class:`NormGradLink` for the norm's module (``input_norm_link``), whose backward then runs inside this
            add's (``LOWBIT_UNFUSE=norm_backward`` turns that off, and a DTensor weight (FSDP2's shard) gets none,
            nor does a call inside torch.compile: the link is None).

    Returns:
        ``out`` (x's shape, float32); ``(out, rstd)`` with ``rms_eps``; ``(out, rstd, link)`` with ``norm_weight``.
        One Triton kernel where :func:`residual_add_supported` (inside torch.compile: with ``rms_eps`` the
        ``lowbit::residual_add`` operator, the same kernel; without, torch's ``x + y``, the same bits, which Inductor
        fuses with its neighbours); else torch's ``x + y``, and rstd and link None (a
        following fused norm then computes its statistics itself: nothing is gained by computing them here apart
        from the sum).
    """
    if rms_eps is not None and (not isinstance(rms_eps, (int, float)) or isinstance(rms_eps, bool) or not rms_eps > 0):
        raise ValueError(f"rms_eps: expected None or a float > 0, got {rms_eps!r}")
    if norm_weight is not None:
        if rms_eps is None:
            raise ValueError("norm_weight: needs rms_eps (the norm's epsilon)")
        if not (isinstance(norm_weight, torch.Tensor) and norm_weight.dtype == torch.float32
                and tuple(norm_weight.shape) == (x.shape[-1],)):
            raise ValueError(f"norm_weight: expected a float32 tensor of shape ({x.shape[-1]},), got "
                             f"{getattr(norm_weight, 'dtype', type(norm_weight).__name__)} "
                             f"{tuple(getattr(norm_weight, 'shape', ()))}")
    if not residual_add_supported(x, y):
        if rms_eps is None:
            return x + y
        return (x + y, None) if norm_weight is None else (x + y, None, None)
    if torch.compiler.is_compiling():  # (no link: it cannot cross between operators; the norm runs its backward)
        if rms_eps is None:  # (the kernel's bits: one FP32 add of x and y read exactly; Inductor fuses it)
            return x + y
        out, rstd = residual_add_op(x, y, float(rms_eps))
        return (out, rstd) if norm_weight is None else (out, rstd, None)
    if rms_eps is None:
        return _ResidualAdd.apply(x, y, None, None, None)
    # (no link to a DTensor: FSDP2 holds a module's weight sharded until that module's forward gathers it, and the
    # gathered tensor is another object, which the link's check would refuse; that norm runs its own backward)
    link = NormGradLink(norm_weight, float(rms_eps)) if (norm_weight is not None and _fused_norm_backward_on()
                                                         and not is_dtensor(norm_weight)) else None
    out, rstd = _ResidualAdd.apply(x, y, float(rms_eps), norm_weight if link is not None else None, link)
    return (out, rstd) if norm_weight is None else (out, rstd, link)
