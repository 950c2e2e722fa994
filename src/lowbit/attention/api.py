"""Public entry points: ``attention``, ``attention_qk_int8``, ``quantize_qk``, ``quantize_v_fp8``, ``quantize_v_fp16``.

Backends (``backend=``):
* ``"reference"`` — pure torch (any device; the default on CPU): the quantized reference for
  quantized modes, the FP32 reference for ``qk=pv="bf16"``.
* ``"triton"`` — the Triton prepass + forward kernel (CUDA, or CPU under TRITON_INTERPRET=1).
* ``"sdpa"`` — ``torch.nn.functional.scaled_dot_product_attention`` (16-bit only, dense).
Default on CUDA: ``"triton"`` for quantized modes; for plain 16-bit attention ``"sdpa"`` when the
request fits it (dense, no window, no LSE) because cuDNN/flash beat a Triton BF16 kernel on
Hopper (lowbit asks SDPA for cuDNN first, then flash), otherwise ``"triton"``.  ``select_backend`` returns the choice
without running anything.
"""
from __future__ import annotations

import contextlib
import functools
import math
import operator
from typing import Optional

import torch
from torch import Tensor

from . import reference as _ref
from ._checks import (
    check_blocks,
    check_bool,
    check_cu_meta,
    check_dropout_p,
    check_grad_args,
    check_grad_sink,
    check_half,
    check_qkv,
    check_softmax_scale,
    check_tensor,
    check_triton,
    check_triton_installed,
    check_varlen,
    check_window,
    layout_of,
    lse_shape,
    shape4,
    triton_ok,
)
from ._cudnn import cudnn_decline, cudnn_forward, cudnn_inputs
from .backward import OP_SCHEMA_OPTIONS, attention_forward, attention_with_grad, backward_backend
from .backward import backward as attention_backward
from .reference import QKQuantized, n_q_groups

QK_MODES = ("bf16", "fp16", "int8", "fp8")
"""The ``qk`` values of ``attention``: the Q·Kᵀ arithmetic."""
PV_MODES = ("auto", "bf16", "fp16", "fp8")
"""The ``pv`` values of ``attention``: the P·V arithmetic (``resolve_pv``)."""
_QK, _PV = QK_MODES, PV_MODES
# What pv="auto" means for quantized Q·Kᵀ ("int8"/"fp8") on BF16 inputs. "fp16" is the more accurate choice (P keeps
# 11 significant bits); it becomes the default once measured end to end at least as fast as "bf16" (the V
# conversion adds one pass over V).
AUTO_PV_QUANTIZED = "bf16"
_BACKENDS = ("reference", "triton", "sdpa")


def resolve_pv(pv: str, qk: str, dtype: Optional[torch.dtype]) -> str:
    """The P·V arithmetic ``pv`` asks for, given ``qk`` and the inputs' dtype: "native" (P rounded to V's own
    dtype, V untouched), "fp16" (BF16 V carried in FP16 under power-of-two scales, P rounded to FP16) or "fp8".

    * "fp16": FP16 P·V. BF16 V is converted (``quantize_v_fp16``: exact up to FP16 subnormals); FP16 V as is.
    * "bf16": P·V in BF16 for BF16 inputs; FP16 inputs keep FP16 (converting V to BF16 would only drop bits).
    * "auto" (default): ``AUTO_PV_QUANTIZED`` when Q·Kᵀ is quantized ("int8"/"fp8") — meant to be "fp16" (P in
      [0, 1] keeps 3 more mantissa bits in FP16 than in BF16, SageAttention's choice) once measured as fast; "bf16"
      until then — else the inputs' own dtype (plain attention dispatches to SDPA as before)."""
    if pv not in _PV:
        raise ValueError(f"pv must be one of {_PV}, got {pv!r}")
    if pv == "fp8":
        return "fp8"
    if pv == "auto":
        pv = AUTO_PV_QUANTIZED if qk in ("int8", "fp8") else "bf16"
    return "fp16" if pv == "fp16" and dtype == torch.bfloat16 else "native"


def select_backend(device: torch.device, qk: str, pv: str, *, varlen: bool, window, return_lse: bool,
                   backend: Optional[str] = None, dtype: Optional[torch.dtype] = None) -> str:
    """The backend ``attention`` will use (see module docstring); FP32 inputs run the FP32 reference anywhere."""
    if backend is not None:
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS} or None, got {backend!r}")
        return backend
    if device.type != "cuda" or dtype == torch.float32:
        return "reference"
    native = pv == "native" or (pv in _PV and resolve_pv(pv, qk, dtype) == "native")
    if qk in ("bf16", "fp16") and native and not varlen and window is None and not return_lse:
        return "sdpa"
    return "triton"


def backend_for(device=None, qk: str = "bf16", pv: str = "bf16", *, varlen: bool = False, window=None,
                return_lse: bool = False) -> str:
    """Which backend ``attention`` picks by default (for ``lowbit info``)."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return select_backend(dev, qk, pv, varlen=varlen, window=window, return_lse=return_lse)


def gluon_by_default(device=None, head_dim: int = 128) -> bool:
    """Whether a dense INT8·FP8 call of this head dim (contiguous Q/K, causal or no mask) runs the warp-specialized
    Gluon forward kernel on ``device`` by default (``lowbit info``); otherwise the Triton kernel runs it."""
    from . import _gluon  # (Triton is optional: imported where a Triton backend runs)

    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return _gluon.runs_by_default(dev, head_dim)


# ----------------------------------------------------------------------------- prepass
def quantize_qk(q: Tensor, k: Tensor, *, dtype: str = "int8", granularity: str = "per_block", smooth_k: bool = True,
                block_q: int = 128, block_k: int = 64, warp_q: int = 32, softmax_scale: Optional[float] = None,
                layout: Optional[str] = None, cu_seqlens_q: Optional[Tensor] = None,
                cu_seqlens_k: Optional[Tensor] = None, max_seqlen_q: Optional[int] = None,
                max_seqlen_k: Optional[int] = None, backend: Optional[str] = None) -> QKQuantized:
    """Quantize Q/K to INT8 (or FP8 E4M3) with per-block / per-warp scales and K smoothing.

    Returns ``QKQuantized`` (see ``reference`` module docstring for shapes and the varlen
    convention).  CUDA -> fused Triton kernel, otherwise the torch reference: the same codes and scales bit for bit
    given the same K mean (the kernel sums K in its own FP32 order, so the two means agree to FP32 rounding;
    ``reference.quantize_qk_reference(..., k_mean=)`` takes the kernel's).
    """
    check_tensor("q", q)
    check_tensor("k", k)
    check_cu_meta(cu_seqlens_q, cu_seqlens_k, q, k)
    check_bool("smooth_k", smooth_k)
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    lay = layout_of(layout, varlen)
    check_half("q", q)
    check_half("k", k)
    softmax_scale = check_softmax_scale(softmax_scale)
    if dtype not in ("int8", "fp8"):
        raise ValueError(f"dtype must be 'int8' or 'fp8', got {dtype!r}")
    check_blocks(granularity, block_q, block_k, warp_q)
    mq, mk = check_varlen(cu_seqlens_q, cu_seqlens_k, q, k, max_seqlen_q, max_seqlen_k)
    kw = dict(dtype=dtype, granularity=granularity, smooth_k=smooth_k, block_q=block_q, block_k=block_k,
              warp_q=warp_q, softmax_scale=softmax_scale, layout="bhsd" if lay == "thd" else lay,
              cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=mq, max_seqlen_k=mk)
    be = backend or ("triton" if q.is_cuda else "reference")
    if be == "triton":
        check_triton_installed()
        from . import _triton
        return _triton.quantize_qk_triton(q, k, **kw)
    return _ref.quantize_qk_reference(q, k, **kw)


def _kernel_layout(layout, cu_seqlens_k) -> str:
    """The layout the V quantizers take: the user's, with packed varlen ("thd") passed as "bhsd"."""
    lay = layout_of(layout, cu_seqlens_k is not None)
    return "bhsd" if lay == "thd" else lay


def quantize_v_operand(kind: str, v: Tensor, lay: str, cu_seqlens_k, max_seqlen_k, backend,
                       key_order: str = "natural"):
    """(V for the P·V MMA, per-channel scales) for a resolved ``pv`` (``kind``): "fp8" or "fp16" convert V (Triton
    prepass or reference), "native" keeps it. ``lay``: "bhsd" / "bshd" ("bhsd" for packed varlen). ``key_order``:
    the Triton prepass's FP8 key order (``_triton.fp8_v_key_order``)."""
    if kind == "native":
        return v, None
    if (backend or ("triton" if v.is_cuda else "reference")) == "triton":
        check_triton_installed()
        from . import _triton
        if kind == "fp8":
            return _triton.quantize_v_fp8_triton(v, layout=lay, cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k,
                                                 key_order=key_order)
        return _triton.quantize_v_fp16_triton(v, layout=lay, cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k)
    fn = _ref.quantize_v_fp8_reference if kind == "fp8" else _ref.quantize_v_fp16_reference
    return fn(v, layout=lay, cu_seqlens_k=cu_seqlens_k)


def quantize_v_fp16(v: Tensor, *, layout: Optional[str] = None, cu_seqlens_k: Optional[Tensor] = None,
                    max_seqlen_k: Optional[int] = None, backend: Optional[str] = None):
    """BF16 V -> (float16 V with v's shape and layout, fp32 power-of-two scales (B, Hkv, D)) for FP16 P·V.

    Per (batch, head, channel) v is multiplied by 2^e with e = 15 - floor(log2 amax) (amax lands in
    [2^15, 65280], below FP16's 65504) and rounded to FP16: exact unless the product is an FP16 subnormal.
    Dequantize with v16 · scale (scale = 2^-e, exact)."""
    check_tensor("v", v)
    if v.dtype != torch.bfloat16:
        raise TypeError(f"quantize_v_fp16: v must be bfloat16 (FP16 V needs no conversion), got {v.dtype}")
    return quantize_v_operand("fp16", v, _kernel_layout(layout, cu_seqlens_k), cu_seqlens_k, max_seqlen_k, backend)


def quantize_v_fp8(v: Tensor, *, layout: Optional[str] = None, cu_seqlens_k: Optional[Tensor] = None,
                   max_seqlen_k: Optional[int] = None, backend: Optional[str] = None):
    """V -> (float8_e4m3fn codes with v's shape, fp32 scales (B, Hkv, D) = amax/448 per channel).

    The Triton path stores the codes sequence-contiguous (a transposed view) for the FP8 P·V MMA."""
    check_tensor("v", v)
    check_half("v", v)
    return quantize_v_operand("fp8", v, _kernel_layout(layout, cu_seqlens_k), cu_seqlens_k, max_seqlen_k, backend)


# ----------------------------------------------------------------------------- forward implementations
_SDPA_ORDER = None


def _sdpa_order():
    """SDPA backends in the order lowbit wants them: cuDNN first (on Hopper about 1.7x flash's TFLOP/s forward and
    backward), then flash, memory-efficient, math; each call
    takes the first that supports its inputs (e.g. GQA or odd shapes fall through to flash)."""
    global _SDPA_ORDER
    if _SDPA_ORDER is None:
        from torch.nn.attention import SDPBackend
        _SDPA_ORDER = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                       SDPBackend.MATH]
    return _SDPA_ORDER


def _sdpa(q, k, v, *, causal, scale, layout):
    from torch.nn.attention import sdpa_kernel
    try:
        ctx = sdpa_kernel(_sdpa_order(), set_priority=True)
    except TypeError:  # a torch without set_priority: its own order
        import contextlib
        ctx = contextlib.nullcontext()
    with ctx:
        return _sdpa_call(q, k, v, causal=causal, scale=scale, layout=layout)


def _sdpa_call(q, k, v, *, causal, scale, layout):
    import torch.nn.functional as F
    qh, kh, vh = (_ref.to_bhsd(t, layout) for t in (q, k, v))
    sq, sk = qh.shape[2], kh.shape[2]
    kw = {}
    if kh.shape[1] != qh.shape[1]:
        kw["enable_gqa"] = True
    if causal and sq != sk:
        from torch.nn.attention.bias import causal_lower_right
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(sq, sk), scale=scale, **kw)
    else:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale, **kw)
    return o if layout == "bhsd" else o.transpose(1, 2)


def triton_operands(q, k, v, *, qk, pv, granularity="per_block", smooth_k=True, block_q=128, block_k=64, warp_q=32,
                     softmax_scale=None, causal=False, window=None, **kw):
    """What ``_triton.attention_fwd_triton`` takes for one call: (q, k, q_scale, k_scale, k_mean, q_scale_rows, v,
    v_scale, v_key_order), everything the call quantizes (``qk`` "int8" / "fp8", ``pv`` resolved: "fp8" / "fp16")
    made by one ``_triton.prepass_triton`` (FP8 V in the key order the forward kernel reads), the rest as given.
    ``kw``: layout and varlen arguments, as prepass_triton takes them."""
    from . import _triton

    quant_qk = qk in ("int8", "fp8")
    if not quant_qk and pv == "native":
        return q, k, None, None, None, block_q, v, None, "natural"
    qq, vq, vs, order = _triton.prepass_triton(
        q, k, v, qk=qk if quant_qk else None, pv=None if pv == "native" else pv, granularity=granularity,
        smooth_k=smooth_k, block_q=block_q, block_k=block_k, warp_q=warp_q, softmax_scale=softmax_scale,
        key_order="auto", causal=causal, window=window, **kw)
    qa, ka, qs, ks, km, rows = (q, k, None, None, None, block_q) if qq is None else (
        qq.q, qq.k, qq.q_scale, qq.k_scale, qq.k_mean, qq.q_scale_rows)
    return qa, ka, qs, ks, km, rows, (v if vq is None else vq), vs, order


def _like(x: Tensor, ref: Tensor) -> Tensor:
    """``x`` in the memory order ``torch.empty_like(ref)`` gives (``ref``'s own where it is dense): as it is where it
    already has it, else copied. Attention's outputs and gradients follow their inputs' order this way, eager and
    compiled (the operators' fakes are ``torch.empty_like``), so a model's (B, H, S, D) views of (B, S, H, D) tensors
    get (B, S, H, D) memory back and its transpose to (B, S, H·D) stays a view."""
    if x.stride() == ref.stride() or x.numel() <= 1:
        return x
    y = torch.empty_like(ref, dtype=x.dtype)
    return x if y.stride() == x.stride() else y.copy_(x)


def _forward(q, k, v, **opts):
    """(out in q's memory order (``_like``), LSE or None) of ``attention`` for its checked options."""
    out, lse = _run_forward(q, k, v, **opts)
    return _like(out, q), lse


def _run_forward(q, k, v, *, causal, softmax_scale, layout, qk, pv, granularity, smooth_k, window, cu_q, cu_k, mq, mk,
                 return_lse, backend, block_q, block_k, warp_q):
    lay = "bhsd" if layout == "thd" else layout
    quant_qk = qk in ("int8", "fp8")
    out_dtype = q.dtype
    if backend == "sdpa":
        _check_sdpa(qk, pv, cu_q is not None, window, False)
        if not return_lse:
            return _sdpa(q, k, v, causal=causal, scale=softmax_scale, layout=lay), None
        # (asked only by an autograd forward that keeps O and LSE for cuDNN's backward, ``_keeps_out_lse``)
        why = cudnn_decline(device_type=q.device.type, dtype=q.dtype, causal=causal, **_cudnn_shapes(q, k, lay))
        if why is not None:
            raise NotImplementedError(f"backend='sdpa' gives an LSE only through cuDNN's attention, which cannot run "
                                      f"this call: {why}")
        return cudnn_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, layout=lay)
    if backend == "reference":
        if not quant_qk and pv == "native":
            res = _ref.attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window,
                                           layout=lay, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True)
        else:
            res = _ref.attention_quantized_reference(
                q, k, v, qk=qk if quant_qk else "bf16", pv=pv, granularity=granularity, smooth_k=smooth_k,
                block_q=block_q, block_k=block_k, warp_q=warp_q, causal=causal, softmax_scale=softmax_scale,
                window=window, layout=lay, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=mq, max_seqlen_k=mk,
                return_lse=True)
        return res[0].to(out_dtype), res[1]
    # triton
    check_triton(q.shape[-1], q.device, qk)
    from . import _triton
    kw = dict(layout=lay, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=mq, max_seqlen_k=mk)
    qa, ka, qs, ks, km, rows, va, vs, order = triton_operands(
        q, k, v, qk=qk, pv=pv, granularity=granularity, smooth_k=smooth_k, block_q=block_q, block_k=block_k,
        warp_q=warp_q, softmax_scale=softmax_scale, causal=causal, window=window, **kw)
    # k_mean is not passed: the LSE shift is added below from the unquantized q (more accurate than
    # the kernel's dequantized-q correction, which attention_qk_int8 uses since it has no q).
    res = _triton.attention_fwd_triton(qa, ka, va, q_scale=qs, k_scale=ks, v_scale=vs, k_mean=None, q_scale_rows=rows,
                                       k_scale_rows=block_k, softmax_scale=softmax_scale, causal=causal, window=window,
                                       return_lse=return_lse, out_dtype=out_dtype, v_key_order=order, out_like=q,
                                       **kw)
    if not return_lse:
        return res, None
    out, lse = res
    if km is not None:
        lse = lse + _ref.lse_smoothing_shift(q, km, softmax_scale, layout=lay, cu_seqlens_q=cu_q)
    return out, lse


def _check_sdpa(qk: str, pv: str, varlen: bool, window, return_lse: bool) -> None:
    """NotImplementedError where ``backend="sdpa"`` cannot run a call (SDPA computes 16-bit dense attention)."""
    if qk in ("int8", "fp8") or pv != "native" or varlen or window is not None or return_lse:
        raise NotImplementedError("backend='sdpa' supports only qk/pv 16-bit, dense inputs, no window and no "
                                  f"return_lse; got qk={qk!r}, pv={pv!r}, varlen={varlen}, window={window!r}, "
                                  f"return_lse={return_lse}")


def _cudnn_shapes(q, k, layout: str) -> dict:
    """The shape arguments of ``cudnn_decline`` / ``backward_backend`` for q, k in ``layout`` (batch 0 when packed)."""
    B, Hq, Sq, D = shape4("q", q, layout)
    _, Hkv, Sk, _ = shape4("k", k, layout)
    return dict(batch=B or 0, heads_q=Hq, heads_kv=Hkv, seqlen_q=Sq, seqlen_k=Sk, head_dim=D)


def _cudnn_backward_default(q, k, *, layout: str, causal: bool, window, varlen: bool, grad_format) -> bool:
    """Whether the backward of this call runs cuDNN's attention backward by default (``backward_backend``): then the
    O and LSE it needs, where the forward keeps none of lowbit's, come from cuDNN's forward too."""
    return backward_backend(q.device, q.dtype, causal=causal, window=window, varlen=varlen, grad_format=grad_format,
                            **_cudnn_shapes(q, k, layout)) == "cudnn"


def _keeps_out_lse(backend: str, qk: str, pv: str, cudnn: bool) -> bool:
    """Whether the autograd forward keeps O and LSE for the fused backward: a 16-bit Triton forward computes them
    anyway (the LSE costs one FP32 per query row); a 16-bit SDPA forward whose backward is cuDNN's (``cudnn``) runs
    cuDNN's forward with its LSE, as SDPA would; other forwards leave the backward to recompute them."""
    if qk in ("int8", "fp8") or pv != "native":
        return False
    return backend == "triton" or (backend == "sdpa" and cudnn)


def _opts_cudnn(q, k, o: dict) -> bool:
    """``_cudnn_backward_default`` for the options ``o`` of ``_AttentionFn`` / the attention operators."""
    grad = o.get("grad")
    return _cudnn_backward_default(q, k, layout=o["layout"], causal=o["causal"], window=o["window"],
                                   varlen=o["cu_q"] is not None, grad_format=None if grad is None else grad[0])


@contextlib.contextmanager
def _autograd_recording():
    """``torch.enable_grad()`` that also records inside a custom operator's kernel, where the dispatcher has
    switched autograd off (the reference backward differentiates the FP32 reference there too)."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    include = torch._C._dispatch_tls_local_include_set()
    with torch._C._ForceDispatchKeyGuard(include, exclude - _AUTOGRAD_KEYS), torch.enable_grad():
        yield


_AUTOGRAD_KEYS = functools.reduce(operator.or_, (torch._C.DispatchKeySet(k) for k in (
    torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.AutogradOther,
    torch._C.DispatchKey.AutogradNestedTensor, torch._C.DispatchKey.ADInplaceOrView)))


def _backward(g_out, q, k, v, out, lse, o, needs):
    """(dq, dk, dv) of ``_AttentionFn`` for the forward's options ``o``, each in its input's memory order (``_like``);
    None where ``needs`` (q, k, v) is False. ``out``/``lse``: the forward's, where it kept them (``_keeps_out_lse``),
    else None."""
    grads = _run_backward(g_out, q, k, v, out, lse, o, needs)
    return [None if g is None else _like(g, t) for g, t in zip(grads, (q, k, v))]


def _run_backward(g_out, q, k, v, out, lse, o, needs):
    fused = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
    if fused or o.get("grad") is not None:
        return _fused_backward(q, k, v, g_out, o, needs, out=out, lse=lse, backend=None if fused else "reference")
    with _autograd_recording():
        qd, kd, vd = (t.detach().requires_grad_(n) for t, n in zip((q, k, v), needs))
        ref = _ref.attention_reference(qd, kd, vd, causal=o["causal"], softmax_scale=o["softmax_scale"],
                                       window=o["window"], layout="bhsd" if o["layout"] == "thd" else o["layout"],
                                       cu_seqlens_q=o["cu_q"], cu_seqlens_k=o["cu_k"])
        ins = [t for t in (qd, kd, vd) if t.requires_grad]
        grads = torch.autograd.grad(ref, ins, g_out.float().contiguous())
    it = iter(grads)
    return [next(it).to(t.dtype) if n else None for t, n in zip((q, k, v), needs)]


class _AttentionFn(torch.autograd.Function):
    """Forward = the requested (possibly quantized) kernel.  Backward, straight-through for the
    quantizers (the gradient of 16-bit attention at the high-precision inputs):

    * CUDA, float16/bfloat16: ``lowbit.attention.backward`` — cuDNN's backward where it computes the same math
      and lowbit prefers it (``backward_backend``), else the fused Triton flash backward — with the O and LSE of
      a 16-bit Triton forward, of cuDNN's forward (a 16-bit SDPA forward whose backward is cuDNN's runs cuDNN's
      forward with its LSE), or — after a quantized or other SDPA forward — of a recomputed 16-bit forward (one
      extra forward, O(S) memory: cuDNN's where its backward runs, else lowbit's);
    * with ``grad_format`` elsewhere: ``lowbit.attention.backward``'s reference backend (FP32 formulas, then the
      FP8 quantizer) on a recomputed FP32-reference forward;
    * otherwise: autograd through the FP32 reference (materializes the (Sq, Sk) scores).
    ``opts["grad"]``: (grad_format, scales, grad_sink) — FP8 gradients, handed to autograd dequantized.
    Under ``torch.compile`` the custom operators ``lowbit::attention_fwd`` / ``lowbit::attention_bwd`` run the
    same two functions (``_forward``, ``_backward``)."""

    @staticmethod
    def forward(ctx, q, k, v, opts):
        keep = _keeps_out_lse(opts["backend"], opts["qk"], opts["pv"],
                              opts["backend"] == "sdpa" and _opts_cudnn(q, k, opts))
        fwd = {n: x for n, x in opts.items() if n != "grad"}
        out, lse = _forward(q, k, v, **dict(fwd, return_lse=opts["return_lse"] or keep))
        ctx.save_for_backward(q, k, v, out if keep else None, lse if keep else None)
        ctx.opts = opts
        if opts["return_lse"]:
            ctx.mark_non_differentiable(lse)
            return out, lse
        return out, None

    @staticmethod
    def backward(ctx, g_out, g_lse=None):
        q, k, v, out, lse = ctx.saved_tensors
        return (*_backward(g_out, q, k, v, out, lse, ctx.opts, ctx.needs_input_grad[:3]), None)


def _fused_backward(q, k, v, g_out, o, needs, *, out=None, lse=None, backend=None):
    """(dq, dk, dv) by ``lowbit.attention.backward`` (the Triton flash backward; ``backend="reference"``: its FP32
    formulas; None: ``backward_backend`` picks, cuDNN's backward where it runs); None where ``needs`` (q, k, v) is
    False. ``out``/``lse``: the 16-bit forward's, when the forward kept them; otherwise that forward is recomputed
    here (cuDNN's, with its LSE, where cuDNN's backward runs; else lowbit's). With ``o["grad"] = (grad_format,
    scales, grad_sink)`` the gradients are FP8 QuantizedTensors: put into ``grad_sink`` (a dict) and returned
    dequantized."""
    common = dict(causal=o["causal"], softmax_scale=o["softmax_scale"], window=o["window"], cu_seqlens_q=o["cu_q"],
                  cu_seqlens_k=o["cu_k"], max_seqlen_q=o["mq"], max_seqlen_k=o["mk"], backend=backend)
    if out is None or lse is None:
        if backend is None and _opts_cudnn(q, k, o):
            q, k, v = cudnn_inputs(q, k, v, layout=o["layout"])  # (copied, where at all, once for both calls)
            out, lse = cudnn_forward(q, k, v, causal=o["causal"], softmax_scale=o["softmax_scale"], layout=o["layout"])
        else:
            out, lse = attention_forward(q, k, v, layout=o["layout"], **common)
    grad_format, scales, sink = o.get("grad") or (None, None, None)
    # (dO as it comes: the Triton backward reads any strides, cuDNN's is handed dO in O's memory order)
    grads = attention_backward(g_out, q, k, v, out, lse, layout=o["layout"], grad_format=grad_format, scales=scales,
                               **common)  # ("thd" when varlen)
    if grad_format is not None:
        if sink is not None:
            sink.update(dq=grads[0], dk=grads[1], dv=grads[2])
        grads = [g.dequantize() for g in grads]
    return [g.to(t.dtype) if n else None for g, t, n in zip(grads, (q, k, v), needs)]


# ----------------------------------------------------------------------------- torch.compile: custom operators
# Under torch.compile, ``attention`` and ``attention_qk_int8`` validate their arguments while tracing (shapes,
# dtypes and devices only) and run through these operators, which call the functions the eager path calls, so both
# give the same bits. Tensor values (cu_seqlens, CPU gradient scales) are checked when the operator runs.
def _lse_or_empty(lse, q, want: bool) -> Tensor:
    return lse.contiguous() if want else torch.empty(0, dtype=torch.float32, device=q.device)


def _scales_of(scale_dq, scale_dk, scale_dv):
    return None if scale_dq is None else (scale_dq, scale_dk, scale_dv)


def _op_opts(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window, layout):
    """The options ``attention`` hands ``_forward``/``_backward``, rebuilt from an operator's arguments (the
    cu_seqlens values checked, the default softmax scale filled in)."""
    mq, mk = check_varlen(cu_seqlens_q, cu_seqlens_k, q, k, max_seqlen_q, max_seqlen_k)
    return dict(causal=causal, softmax_scale=1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale,
                layout=layout, window=check_window(window), cu_q=cu_seqlens_q, cu_k=cu_seqlens_k, mq=mq, mk=mk)


_FWD_SCHEMA = (f"(Tensor q, Tensor k, Tensor v, {OP_SCHEMA_OPTIONS}, str layout, str qk, str pv, str granularity, "
               "bool smooth_k, SymInt block_q, SymInt block_k, SymInt warp_q, str backend, bool return_lse, "
               "str? grad_format) -> (Tensor, Tensor)")


@torch.library.custom_op("lowbit::attention_fwd", mutates_args=(), schema=_FWD_SCHEMA)
def attention_fwd_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale_dq, scale_dk, scale_dv,
                     causal, softmax_scale, window, layout, qk, pv, granularity, smooth_k, block_q, block_k, warp_q,
                     backend, return_lse, grad_format):
    """Attention forward with the Q·Kᵀ arithmetic ``qk`` and the resolved P·V arithmetic ``pv`` ("native" / "fp16" /
    "fp8") on ``backend`` ("reference" / "triton" / "sdpa"): (out in q's dtype and ``layout`` ("thd" when packed),
    in q's memory order (``_like``); LSE fp32 natural log, (B, Hq, Sq) / (Hq, Tq), or an empty tensor when
    ``return_lse`` is False).
    softmax_scale None: 1/sqrt(D). ``scale_d*`` / ``grad_format``: the backward's FP8 gradient options (the forward
    only checks the scale values). Differentiable: the backward is ``lowbit::attention_bwd``."""
    o = _op_opts(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window, layout)
    if scale_dq is not None:
        check_grad_args(grad_format, _scales_of(scale_dq, scale_dk, scale_dv), None, q.device)
    out, lse = _forward(q, k, v, **o, qk=qk, pv=pv, granularity=granularity, smooth_k=smooth_k,
                        return_lse=return_lse, backend=backend, block_q=block_q, block_k=block_k, warp_q=warp_q)
    return out, _lse_or_empty(lse, q, return_lse)


@attention_fwd_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale_dq, scale_dk, scale_dv, causal,
      softmax_scale, window, layout, qk, pv, granularity, smooth_k, block_q, block_k, warp_q, backend, return_lse,
      grad_format):
    lse = q.new_empty(lse_shape(q, layout) if return_lse else (0,), dtype=torch.float32)
    return torch.empty_like(q), lse


def _attention_fwd_setup(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, mq, mk, sdq, sdk, sdv, causal, softmax_scale, window, layout, qk, pv, _, _, _, _, _,
     backend, return_lse, grad_format) = inputs
    out, lse = output
    keep = return_lse and _keeps_out_lse(backend, qk, pv, True)  # (an SDPA forward's LSE is only ever cuDNN's)
    ctx.save_for_backward(q, k, v, out if keep else None, lse if keep else None, cu_q, cu_k, sdq, sdk, sdv)
    ctx.args = (mq, mk, causal, softmax_scale, window, layout, grad_format)
    ctx.mark_non_differentiable(lse)


def _attention_fwd_backward(ctx, g_out, g_lse):
    q, k, v, out, lse, cu_q, cu_k, sdq, sdk, sdv = ctx.saved_tensors
    mq, mk, causal, softmax_scale, window, layout, grad_format = ctx.args
    needs = list(ctx.needs_input_grad[:3])
    grads = torch.ops.lowbit.attention_bwd(g_out, q, k, v, out, lse, cu_q, cu_k, mq, mk, sdq, sdk, sdv, causal,
                                           softmax_scale, window, layout, grad_format, needs)
    return (*(g if n else None for g, n in zip(grads, needs)),) + (None,) * 21


attention_fwd_op.register_autograd(_attention_fwd_backward, setup_context=_attention_fwd_setup)

_BWD_SCHEMA = (f"(Tensor g_out, Tensor q, Tensor k, Tensor v, Tensor? out, Tensor? lse, {OP_SCHEMA_OPTIONS}, "
               "str layout, str? grad_format, bool[] output_mask) -> (Tensor, Tensor, Tensor)")


@torch.library.custom_op("lowbit::attention_bwd", mutates_args=(), schema=_BWD_SCHEMA)
def attention_bwd_op(g_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale_dq,
                     scale_dk, scale_dv, causal, softmax_scale, window, layout, grad_format, output_mask):
    """The gradient of 16-bit attention at q, k, v given dO = ``g_out`` (straight-through for a quantized forward):
    (dq, dk, dv), each in its input's shape, dtype and memory order, or an empty tensor where ``output_mask`` is
    False.
    ``out``/``lse``: the forward's when it kept them (else recomputed). CUDA float16/bfloat16 or ``grad_format``:
    the fused flash backward (FP8 gradients quantized, then dequantized); otherwise autograd through the FP32
    reference."""
    o = _op_opts(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window, layout)
    if grad_format is not None:
        o["grad"] = (grad_format, _scales_of(scale_dq, scale_dk, scale_dv), None)
    grads = _backward(g_out, q, k, v, out, lse, o, tuple(output_mask))
    return tuple(q.new_empty(0) if g is None else g for g in grads)


@attention_bwd_op.register_fake
def _(g_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale_dq, scale_dk, scale_dv,
      causal, softmax_scale, window, layout, grad_format, output_mask):
    return tuple(torch.empty_like(t) if n else t.new_empty(0) for t, n in zip((q, k, v), output_mask))


_QK_INT8_SCHEMA = ("(Tensor q_int8, Tensor k_int8, Tensor v, Tensor q_scale, Tensor k_scale, Tensor? k_mean, "
                   "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, SymInt? max_seqlen_q, SymInt? max_seqlen_k, "
                   "bool causal, str layout, str granularity, SymInt block_q, SymInt block_k, SymInt warp_q, str pv, "
                   "SymInt[]? window, bool return_lse, str backend) -> (Tensor, Tensor)")


@torch.library.custom_op("lowbit::attention_qk_int8", mutates_args=(), schema=_QK_INT8_SCHEMA)
def attention_qk_int8_op(q_int8, k_int8, v, q_scale, k_scale, k_mean, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                         max_seqlen_k, causal, layout, granularity, block_q, block_k, warp_q, pv, window, return_lse,
                         backend):
    """Attention on pre-quantized INT8 Q/K (``attention_qk_int8``) with the resolved P·V arithmetic ``pv`` on
    ``backend`` ("reference" / "triton"): (out in v's dtype, q's ``layout`` ("thd" when packed), contiguous; LSE
    fp32 (B, Hq, Sq) / (Hq, Tq), or an empty tensor when ``return_lse`` is False). Not differentiable."""
    mq, mk = check_varlen(cu_seqlens_q, cu_seqlens_k, q_int8, k_int8, max_seqlen_q, max_seqlen_k)
    if cu_seqlens_q is not None:
        _check_qk_scales(q_int8, k_int8, q_scale, k_scale, layout, mq, mk, cu_seqlens_q, granularity, block_q,
                         block_k, warp_q)
    out, lse = _qk_int8_forward(q_int8, k_int8, v, q_scale, k_scale, k_mean, cu_seqlens_q, cu_seqlens_k, mq, mk,
                                causal=causal, lay=layout, granularity=granularity, block_q=block_q, block_k=block_k,
                                warp_q=warp_q, pv=pv, window=check_window(window), return_lse=return_lse, be=backend)
    return out.contiguous(), _lse_or_empty(lse, q_int8, return_lse)


@attention_qk_int8_op.register_fake
def _(q_int8, k_int8, v, q_scale, k_scale, k_mean, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
      layout, granularity, block_q, block_k, warp_q, pv, window, return_lse, backend):
    lse = q_int8.new_empty(lse_shape(q_int8, layout) if return_lse else (0,), dtype=torch.float32)
    return q_int8.new_empty(q_int8.shape, dtype=v.dtype), lse


# ----------------------------------------------------------------------------- public entry points
def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, softmax_scale: Optional[float] = None,
              layout: Optional[str] = None, qk: str = "bf16", pv: str = "auto", granularity: str = "per_block",
              smooth_k: bool = True, window=None, cu_seqlens_q: Optional[Tensor] = None,
              cu_seqlens_k: Optional[Tensor] = None, max_seqlen_q: Optional[int] = None,
              max_seqlen_k: Optional[int] = None, return_lse: bool = False, backend: Optional[str] = None,
              dropout_p: float = 0.0, grad_format: Optional[str] = None, scales=None,
              grad_sink: Optional[dict] = None, block_q: int = 128, block_k: int = 64, warp_q: int = 32):
    """Scaled dot-product attention with optional INT8/FP8 Q·Kᵀ and FP8 P·V.

    q: (B, Hq, Sq, D) ("bhsd", default) or (B, Sq, Hq, D) ("bshd"); packed (Tq, Hq, D) with
    ``cu_seqlens_q/k`` (int32, (B+1,)).  k, v: same with Hkv heads, Hq % Hkv == 0.  float16/bfloat16
    (float32 runs the FP32 reference backend, its default for float32 inputs).  softmax_scale (a positive finite
    number) defaults to 1/sqrt(D).
    qk: "bf16"/"fp16" (16-bit, the inputs' dtype), "int8" (per-block/per-warp scales, INT32 MMA), "fp8";
    pv: the P·V MMA: "auto" (default: ``AUTO_PV_QUANTIZED`` when qk is "int8"/"fp8", else the inputs' dtype),
    "fp16" (BF16 V carried in FP16 under exact power-of-two per-channel scales, P rounded to FP16), "bf16" (BF16 P·V
    for BF16 inputs; FP16 inputs stay FP16), "fp8" (E4M3 P and per-channel-scaled V) — see ``resolve_pv``.
    smooth_k subtracts mean(K) before quantizing (softmax-invariant; LSE corrected).  causal is bottom-right aligned;
    window=(left, right) sliding window, -1 unbounded.
    backend: None (see ``select_backend``), "reference", "triton" or "sdpa" (16-bit, dense, no window/LSE; not
    with ``dropout_p > 0`` or ``grad_format``, which need lowbit's own forward).
    Returns out (q's dtype, layout and memory order: for (B, H, S, D) views of (B, S, H, D) tensors, a view of the
    same kind; no input is copied for its strides on the Triton and cuDNN paths) and, with ``return_lse``, LSE fp32
    natural-log (B, Hq, Sq) / (Hq, Tq).  Gradients come back in their inputs' memory order.  Differentiable for
    every variant; for INT8/FP8 forwards the backward is straight-through: it computes the BF16/FP16 attention
    gradient from the saved high-precision q, k, v (on CUDA cuDNN's backward where it computes the same math,
    else lowbit's fused Triton backward: ``lowbit.attention.backward.backward_backend``; FP32 reference math
    elsewhere).  ``dropout_p > 0`` (16-bit only, no ``return_lse``) draws a Philox seed from torch's default
    generator and regenerates the same mask in the backward (see ``lowbit.attention.backward``).

    FP8 gradients (NUMERICS §7): ``grad_format="e4m3"|"e5m2"`` makes the backward quantize dQ, dK, dV to FP8 in its
    epilogue — ``scales=None``: one scale per row along head_dim computed there; ``scales=(scale_dq, scale_dk,
    scale_dv)`` (or a dict with keys dq/dk/dv), FP32 (1,) tensors, positive and finite: given per-tensor scales
    (delayed scaling; values are checked for CPU tensors, a CUDA tensor's values are the caller's contract since
    reading them would sync).  The return value does not change: autograd receives the gradients dequantized to
    the inputs' dtype (``q.grad`` = dQ's data · scale_inv); pass ``grad_sink={}`` to receive the
    ``lowbit.QuantizedTensor`` s themselves under "dq", "dk", "dv" (each with ``.amax`` for the next step's
    delayed scale).  16-bit forwards run ``lowbit.attention.backward.attention_with_grad``; quantized forwards
    the same backward from the saved inputs.  Without a gradient to compute (no input requires grad, or
    ``torch.no_grad``) the options are checked and have no effect.
    """
    for n, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(n, t)
    check_cu_meta(cu_seqlens_q, cu_seqlens_k, q, k)  # (before the shapes, which depend on whether they are given)
    for n, f in (("causal", causal), ("smooth_k", smooth_k), ("return_lse", return_lse)):
        check_bool(n, f)
    if qk not in _QK:
        raise ValueError(f"qk must be one of {_QK}, got {qk!r}")
    pv = resolve_pv(pv, qk, q.dtype)
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    lay = layout_of(layout, varlen)
    check_qkv(q, k, v, lay)
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"q/k/v must be float16, bfloat16 (or float32 for the reference), got {q.dtype}")
    check_blocks(granularity, block_q, block_k, warp_q)
    window = check_window(window)
    softmax_scale = check_softmax_scale(softmax_scale)
    dropout_p = check_dropout_p(dropout_p)
    sc = check_grad_args(grad_format, scales, None, q.device)
    check_grad_sink(grad_sink, grad_format)
    if backend is not None and backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS} or None, got {backend!r}")
    mq, mk = check_varlen(cu_seqlens_q, cu_seqlens_k, q, k, max_seqlen_q, max_seqlen_k)  # (as given when compiling)
    sixteen = qk in ("bf16", "fp16") and pv == "native"
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if dropout_p > 0.0 or (grad_format is not None and needs_grad and sixteen):
        # lowbit's own 16-bit forward (Philox dropout; keeps O and LSE) + the fused backward
        what = f"dropout_p={dropout_p}" if dropout_p > 0.0 else f"grad_format={grad_format!r}"
        if not sixteen or (dropout_p > 0.0 and return_lse):
            raise NotImplementedError(
                f"{what}: dropout runs with 16-bit attention only (qk 'bf16'/'fp16' and pv resolving to the inputs' "
                f"own dtype, no return_lse); got qk={qk!r}, pv resolved to {pv!r}, return_lse={return_lse}")
        if backend == "sdpa":
            raise ValueError(f"backend='sdpa' cannot run {what}: SDPA has neither lowbit's Philox dropout nor the LSE "
                             f"the fused backward needs; use backend='triton', 'reference' or None")
        # (attention_forward checks what backend="triton" needs: dtype, head_dim, device)
        be = backend or ("triton" if triton_ok(q) and q.dtype != torch.float32 else "reference")
        return attention_with_grad(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window,
                                   dropout_p=dropout_p, layout="bhsd" if lay == "thd" else lay,
                                   cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=mq,
                                   max_seqlen_k=mk, grad_format=grad_format, scales=scales, grad_sink=grad_sink,
                                   backend=be, return_lse=return_lse)
    be = select_backend(q.device, qk, pv, varlen=varlen, window=window, return_lse=return_lse, backend=backend,
                        dtype=q.dtype)
    if be != "reference" and q.dtype == torch.float32:
        raise TypeError(f"backend {be!r} needs float16/bfloat16 inputs, got float32")
    if be == "sdpa":
        _check_sdpa(qk, pv, varlen, window, return_lse)
    if torch.compiler.is_compiling():
        keep = needs_grad and _keeps_out_lse(be, qk, pv, be == "sdpa" and _cudnn_backward_default(
            q, k, layout=lay, causal=causal, window=window, varlen=varlen, grad_format=grad_format))
        out, lse = torch.ops.lowbit.attention_fwd(
            q, k, v, cu_seqlens_q, cu_seqlens_k, mq, mk, *(sc or (None, None, None)), causal, softmax_scale,
            None if window is None else list(window), lay, qk, pv, granularity, smooth_k, block_q, block_k, warp_q, be,
            return_lse or keep, grad_format)
        return (out, lse) if return_lse else out
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    opts = dict(causal=bool(causal), softmax_scale=float(softmax_scale), layout=lay, qk=qk, pv=pv,
                granularity=granularity, smooth_k=bool(smooth_k), window=window, cu_q=cu_seqlens_q, cu_k=cu_seqlens_k,
                mq=mq, mk=mk, return_lse=bool(return_lse), backend=be, block_q=block_q, block_k=block_k,
                warp_q=warp_q)
    if needs_grad:
        if grad_format is not None:
            opts["grad"] = (grad_format, scales, grad_sink)
        out, lse = _AttentionFn.apply(q, k, v, opts)
    else:
        out, lse = _forward(q, k, v, **opts)
    return (out, lse) if return_lse else out


def attention_qk_int8(q_int8: Tensor, k_int8: Tensor, v: Tensor, q_scale: Tensor, k_scale: Tensor, *,
                      k_mean: Optional[Tensor] = None, causal: bool = False, layout: Optional[str] = None,
                      granularity: str = "per_block", block_q: int = 128, block_k: int = 64, warp_q: int = 32,
                      pv: str = "auto", window=None, cu_seqlens_q: Optional[Tensor] = None,
                      cu_seqlens_k: Optional[Tensor] = None, max_seqlen_q: Optional[int] = None,
                      max_seqlen_k: Optional[int] = None, return_lse: bool = False, backend: Optional[str] = None):
    """Attention on pre-quantized INT8 Q/K (SageAttention conventions, NUMERICS §3).

    q_int8 (B, Hq, Sq, D) / (B, Sq, Hq, D) / packed (Tq, Hq, D), int8, already multiplied by
    softmax_scale·log2(e) before quantizing (so there is no softmax_scale argument);
    k_int8 likewise with Hkv heads (after smoothing); v float16/bfloat16 (pv="fp8" quantizes it
    per channel inside; pv="fp16" carries BF16 V in FP16, pv="bf16" keeps it BF16, "auto": ``resolve_pv``).
    q_scale fp32 (B, Hq, ceil(Sq/block_q)·(block_q/warp_q)) per_warp, (B, Hq, ceil(Sq/block_q)) per_block;
    k_scale fp32 (B, Hkv, ceil(Sk/block_k)); varlen: Sq/Sk are max_seqlen_q/k and blocks restart at each sequence.
    k_mean fp32 (B, Hkv, 1, D), only used
    to correct the returned LSE.  Output in v's dtype.
    """
    for n, t in (("q_int8", q_int8), ("k_int8", k_int8), ("v", v), ("q_scale", q_scale), ("k_scale", k_scale)):
        check_tensor(n, t)
    check_cu_meta(cu_seqlens_q, cu_seqlens_k, q_int8, k_int8)
    check_bool("causal", causal)
    check_bool("return_lse", return_lse)
    if q_int8.dtype != torch.int8 or k_int8.dtype != torch.int8:
        raise TypeError(f"q_int8 and k_int8 must be torch.int8, got q {q_int8.dtype}, k {k_int8.dtype}")
    check_half("v", v)
    pv = resolve_pv(pv, "int8", v.dtype)
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    lay = layout_of(layout, varlen)
    B, Hq, Sq, Hkv, Sk, D = check_qkv(q_int8, k_int8, v, lay)
    if D % 16:
        raise ValueError(f"head_dim must be a multiple of 16 for INT8 MMA, got {D}")
    check_blocks(granularity, block_q, block_k, warp_q)
    window = check_window(window)
    mq, mk = check_varlen(cu_seqlens_q, cu_seqlens_k, q_int8, k_int8, max_seqlen_q, max_seqlen_k)
    if varlen:
        B = cu_seqlens_q.numel() - 1
    if not varlen or (mq is not None and mk is not None):  # (compiling with max_seqlen None: the operator checks)
        _check_qk_scales(q_int8, k_int8, q_scale, k_scale, lay, mq, mk, cu_seqlens_q, granularity, block_q, block_k,
                         warp_q)
    if k_mean is not None:
        check_tensor("k_mean", k_mean)
        if k_mean.dtype != torch.float32 or tuple(k_mean.shape) != (B, Hkv, 1, D):
            raise ValueError(f"k_mean must be float32 of shape {(B, Hkv, 1, D)}, got {k_mean.dtype} "
                             f"{tuple(k_mean.shape)}")
    be = backend or ("triton" if q_int8.is_cuda else "reference")
    if be not in ("reference", "triton"):
        raise ValueError(f"backend must be 'reference', 'triton' or None, got {be!r}")
    if be == "triton":
        check_triton(D, q_int8.device, "int8")
    if torch.compiler.is_compiling():
        if torch.is_grad_enabled() and v.requires_grad:
            raise NotImplementedError("attention_qk_int8 under torch.compile is not differentiable (its custom "
                                      "operator has no backward): v requires grad; detach v or run it eagerly")
        out, lse = torch.ops.lowbit.attention_qk_int8(
            q_int8, k_int8, v, q_scale, k_scale, k_mean, cu_seqlens_q, cu_seqlens_k, mq, mk, causal, lay, granularity,
            block_q, block_k, warp_q, pv, None if window is None else list(window), return_lse, be)
    else:
        out, lse = _qk_int8_forward(q_int8, k_int8, v, q_scale, k_scale, k_mean, cu_seqlens_q, cu_seqlens_k, mq, mk,
                                    causal=causal, lay=lay, granularity=granularity, block_q=block_q, block_k=block_k,
                                    warp_q=warp_q, pv=pv, window=window, return_lse=return_lse, be=be)
    return (out, lse) if return_lse else out


def _check_qk_scales(q_int8, k_int8, q_scale, k_scale, lay, mq, mk, cu_seqlens_q, granularity, block_q, block_k,
                     warp_q):
    """q_scale / k_scale: float32, one scale per quantization group of q_int8 / k_int8 (varlen: of
    max_seqlen_q/k = ``mq``/``mk``, per sequence), on q_int8's device."""
    B, Hq, Sq, D = shape4("q_int8", q_int8, lay)
    _, Hkv, Sk, _ = shape4("k_int8", k_int8, lay)
    if cu_seqlens_q is not None:
        B, Sq, Sk = cu_seqlens_q.numel() - 1, mq, mk
    exp_q = (B, Hq, n_q_groups(Sq, granularity, block_q, warp_q))
    exp_k = (B, Hkv, -(-Sk // block_k))
    for n, s, exp in (("q_scale", q_scale, exp_q), ("k_scale", k_scale, exp_k)):
        if s.dtype != torch.float32:
            raise TypeError(f"{n} must be float32, got {s.dtype}")
        if tuple(s.shape) != exp:
            detail = (f"granularity={granularity!r}, block_q={block_q}, warp_q={warp_q}" if n == "q_scale"
                      else f"block_k={block_k}")
            raise ValueError(f"{n} shape mismatch: expected {exp} for {detail}, got {tuple(s.shape)}")
        if s.device != q_int8.device:
            raise ValueError(f"{n} is on {s.device} but q_int8 is on {q_int8.device}")


def _qk_int8_forward(q_int8, k_int8, v, q_scale, k_scale, k_mean, cu_seqlens_q, cu_seqlens_k, mq, mk, *, causal, lay,
                     granularity, block_q, block_k, warp_q, pv, window, return_lse, be):
    """(out, LSE or None) of ``attention_qk_int8`` once its arguments are checked (``pv`` resolved, ``lay`` the
    call's layout, ``be`` "reference" / "triton")."""
    rows = warp_q if granularity == "per_warp" else block_q
    lay2 = "bhsd" if lay == "thd" else lay
    if be == "reference":
        va, vs = quantize_v_operand(pv, v, lay2, cu_seqlens_k, None, "reference")
        out, lse = _ref.attention_prequantized_reference(
            q_int8, k_int8, va, q_scale, k_scale, v_scale=vs, k_mean=k_mean, q_scale_rows=rows, k_scale_rows=block_k,
            causal=causal, window=window, layout=lay2, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            return_lse=True)
        return out.to(v.dtype), lse
    from . import _triton
    kw = dict(layout=lay2, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=mq, max_seqlen_k=mk)
    order = (_triton.fp8_v_key_order(q_int8, k_int8, layout=lay2, varlen=cu_seqlens_q is not None,
                                     causal=causal, window=window, k_scale_rows=block_k)
             if pv == "fp8" else "natural")
    va, vs = quantize_v_operand(pv, v, lay2, cu_seqlens_k, mk, "triton", key_order=order)
    res = _triton.attention_fwd_triton(q_int8, k_int8, va, q_scale=q_scale, k_scale=k_scale, v_scale=vs,
                                       k_mean=k_mean, q_scale_rows=rows, k_scale_rows=block_k, causal=causal,
                                       window=window, return_lse=return_lse, out_dtype=v.dtype,
                                       v_key_order=order, **kw)
    return res if return_lse else (res, None)
