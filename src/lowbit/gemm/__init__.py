"""Scaled GEMMs on QuantizedTensors: ``scaled_mm`` dispatches to the fastest correct backend (NUMERICS §5).

Backends register themselves with :func:`register_backend` (cuBLAS through torch, Triton kernels);
the float64-exact reference runs everywhere else and is the spec.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..quant.schemes import BLOCK_SIZE, MXFP8, NVFP4, Float8Blockwise, Float8Rowwise, Float8Tensorwise
from ..quant.tensor import QuantizedTensor
from ..runtime import env
from ..runtime.checks import check_bool
from ..runtime.device import INTERPRET, TRITON_MISSING, triton_installed
from .reference import apply_epilogue, dequantize_exact, scaled_mm_reference

__all__ = ["scaled_mm", "wgrad_mm", "register_backend", "backend_for", "BACKENDS", "scaled_mm_reference",
           "dequantize_exact", "apply_epilogue", "not_capability", "run_after", "blockwise_1d2d_bf16"]

# name -> (supports(a, b, a_copy, b_copy, opts) -> bool, fn(a, b, a_copy=, b_copy=, out_dtype=, bias=, gelu=,
# accumulate=, out=)); opts["forced"] is set when the caller named the backend: a preference (e.g. a size threshold) may
# then yield.
BACKENDS: dict[str, tuple[Callable, Callable]] = {}

_FP8_SCHEMES = (Float8Tensorwise, Float8Rowwise, Float8Blockwise)
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


_CHOICE: dict = {}  # call signature -> backend fn (see scaled_mm)


def register_backend(name: str, supports: Callable, fn: Callable) -> None:
    """Register a GEMM backend; earlier registrations are preferred when several support a call."""
    BACKENDS[name] = (supports, fn)
    _CHOICE.clear()


def forget_choices() -> None:
    """Drop the memo of which backend runs each call signature: the next calls ask the backends' ``supports`` again
    (a backend whose support changed at run time calls this)."""
    _CHOICE.clear()


_NOT_CAPABILITY = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "illegal memory access", "device-side assert")


def not_capability(e: BaseException) -> bool:
    """Whether a backend's error says nothing about what the backend supports: out of memory, a CUDA runtime error (a
    faulted context: torch.AcceleratorError). Backends let these propagate, and remember any other refusal as a limit
    of theirs (a call it answers with the next backend). (Not every "CUDA error: ..." message: torch words cuBLAS's own
    refusals "CUDA error: CUBLAS_STATUS_NOT_SUPPORTED".)"""
    if isinstance(e, torch.OutOfMemoryError) or isinstance(e, getattr(torch, "AcceleratorError", ())):
        return True
    msg = str(e)
    return any(m in msg for m in _NOT_CAPABILITY)


def blockwise_1d2d_bf16(a_scheme, b_scheme, opts) -> bool:
    """Whether a call with operands under these schemes is fp8-block's forward / data-gradient pairing with nothing
    around it, what the sm_90 kernels of DeepGEMM and lowbit's CUDA backend take: A ``Float8Blockwise(block_dim=1)``,
    B ``Float8Blockwise(block_dim=2)``, both E4M3 with 128-element blocks; BF16 out, no bias, GELU, accumulation or
    ``out``."""
    def blockwise(sch, block_dim):
        return (isinstance(sch, Float8Blockwise) and sch.block_dim == block_dim and sch.fmt == "e4m3"
                and sch.block_size == BLOCK_SIZE)

    return (blockwise(a_scheme, 1) and blockwise(b_scheme, 2) and opts.get("out_dtype") == torch.bfloat16
            and opts.get("bias") is None and not opts.get("gelu") and not opts.get("accumulate")
            and opts.get("out") is None)


def _all():
    yield from BACKENDS.items()
    yield "reference", (lambda *a: True, scaled_mm_reference)


def gemm_dims(a, b, a_copy, b_copy) -> tuple[int, int, int]:
    """(M, N, K) of ``A · Bᵀ`` for these copies (no validation: see :func:`_validate`)."""
    M, K = (a.rows, a.cols) if a_copy == "rowwise" else (a.cols, a.rows)
    N = b.rows if b_copy == "rowwise" else b.cols
    return M, N, K


def check_k_contiguous(name: str, which: str, data: torch.Tensor, backend: str) -> None:
    """A GEMM kernel reads operand ``name``'s ``which`` copy as row-major (rows, K): refuse other strides, naming
    the operand (the backends' shared rule; the reference backend takes any strides)."""
    if not data.is_contiguous():
        raise ValueError(f"{name}: the {backend} GEMM needs {name}'s {which} data contiguous along K (row-major "
                         f"{tuple(data.shape)}), got strides {tuple(data.stride())}; call .contiguous() on it")


def _operand(t, name, copy):
    if not isinstance(t, QuantizedTensor):
        raise TypeError(f"{name}: expected a QuantizedTensor (see lowbit.quantize), got {type(t).__name__}")
    if copy not in ("rowwise", "columnwise"):
        raise ValueError(f"{name}_copy: expected 'rowwise' or 'columnwise', got {copy!r}")
    if getattr(t, copy) is None:
        raise ValueError(f"{name}: has no {copy} copy; quantize it with {copy}=True")
    t.validate(name, copy)  # (the used copy's data and scales: a kernel reads them blindly; metadata only)
    return (t.rows, t.cols) if copy == "rowwise" else (t.cols, t.rows)


def _validate(a, b, a_copy, b_copy, out_dtype, bias, gelu, accumulate, out):
    M, K = _operand(a, "a", a_copy)
    N, Kb = _operand(b, "b", b_copy)
    if K != Kb:
        raise ValueError(f"b: the contraction dims must match: a's {a_copy} copy is ({M}, {K}), b's {b_copy} copy "
                         f"is ({N}, {Kb})")
    da, db = getattr(a, a_copy).data.device, getattr(b, b_copy).data.device  # (the copies used)
    if da != db:
        raise ValueError(f"b: must be on the same device as a ({da}), got {db}")
    sa, sb = a.scheme, b.scheme
    if isinstance(sa, _FP8_SCHEMES) and isinstance(sb, _FP8_SCHEMES):
        if sa.fmt == "e5m2" and sb.fmt == "e5m2":
            raise NotImplementedError("a, b: E5M2 x E5M2 has no FP8 tensor-core instruction; supported: E4M3xE4M3, "
                                      "E4M3xE5M2, E5M2xE4M3")
        if type(sa) is not type(sb) and not (isinstance(sa, Float8Tensorwise) or isinstance(sb, Float8Tensorwise)):
            raise NotImplementedError(f"a, b: cannot pair scaling schemes {type(sa).__name__} x {type(sb).__name__}")
        if isinstance(sa, Float8Blockwise) and isinstance(sb, Float8Blockwise):
            if sa.block_dim == 2 and sb.block_dim == 2:
                raise NotImplementedError("a, b: blockwise 2D x 2D (128x128 x 128x128) is not supported; use 1D x 2D, "
                                          "2D x 1D or 1D x 1D")
            if sa.block_size != sb.block_size:
                raise ValueError(f"a, b: block sizes must match, got {sa.block_size} and {sb.block_size}")
    elif type(sa) is not type(sb) or not isinstance(sa, (MXFP8, NVFP4)):
        raise NotImplementedError(f"a, b: cannot pair scaling schemes {type(sa).__name__} x {type(sb).__name__}; MXFP8 "
                                  "and NVFP4 pair only with themselves")
    check_bool("gelu", gelu)
    check_bool("accumulate", accumulate)
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out: expected a torch.Tensor of shape (M, N) or None, got {type(out).__name__}")
        if out.dtype not in _OUT_DTYPES:
            raise TypeError(f"out: expected a float32, bfloat16 or float16 tensor (the result is written into it), "
                            f"got {out.dtype}")
        if out.shape != (M, N):
            raise ValueError(f"out: expected shape ({M}, {N}), got {tuple(out.shape)}")
        if out.device != a.device:
            raise ValueError(f"out: must be on {a.device}, got {out.device}")
        if gelu and accumulate:
            raise ValueError("gelu/accumulate: GELU followed by accumulation into out is not a supported epilogue")
    if not isinstance(out_dtype, torch.dtype) or out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype: expected one of {_OUT_DTYPES} or None, got {out_dtype!r}")
    if out is not None and out.dtype != out_dtype:
        raise ValueError(f"out_dtype: {out_dtype} disagrees with out's dtype {out.dtype}; pass the same dtype, or "
                         f"leave out_dtype None (it then follows out)")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias: expected a torch.Tensor of shape (N,) or None, got {type(bias).__name__}")
        if not bias.is_floating_point():
            raise TypeError(f"bias: expected a floating-point tensor, got {bias.dtype}")
        if bias.shape != (N,):
            raise ValueError(f"bias: expected a tensor of shape ({N},), got {tuple(bias.shape)}")
        if bias.device != a.device:
            raise ValueError(f"bias: must be on {a.device}, got {bias.device}")
    if accumulate and out is None:
        raise ValueError("out: accumulate=True adds into `out`, so `out` must be given")
    return M, N, K


def _default_out_dtype(out_dtype, out):
    """:func:`scaled_mm`'s ``out_dtype`` when None: ``out``'s dtype when ``out`` is given, else bfloat16 (a non-tensor
    ``out`` gives None, which :func:`_validate` names)."""
    if out_dtype is not None:
        return out_dtype
    return torch.bfloat16 if out is None else getattr(out, "dtype", None)


def backend_for(a, b, *, a_copy="rowwise", b_copy="rowwise", **opts) -> str:
    """Name of the backend :func:`scaled_mm` would run for these arguments (``out_dtype`` left out or None: its
    default, as :func:`scaled_mm` takes it)."""
    opts["out_dtype"] = _default_out_dtype(opts.get("out_dtype"), opts.get("out"))
    for name, (supports, _) in _all():
        if supports(a, b, a_copy, b_copy, opts):
            return name
    return "reference"


def run_after(name: str, a, b, *, a_copy: str, b_copy: str, **opts):
    """Run a call :func:`scaled_mm` dispatched to backend ``name`` on the first backend registered after it that
    supports the call (the reference last): for a backend that finds, once it runs, that it cannot take this one call.
    ``opts``: the backend function's keywords (``out_dtype``, ``bias``, ``gelu``, ``accumulate``, ``out``); returns
    what that backend's function returns."""
    passed = False
    for n, (supports, fn) in _all():
        if passed and supports(a, b, a_copy, b_copy, opts):
            return fn(a, b, a_copy=a_copy, b_copy=b_copy, **opts)
        passed = passed or n == name


def scaled_mm(
    a: QuantizedTensor,
    b: QuantizedTensor,
    *,
    a_copy: str = "rowwise",
    b_copy: str = "rowwise",
    out_dtype: torch.dtype | None = None,
    bias: torch.Tensor | None = None,
    gelu: bool = False,
    accumulate: bool = False,
    out: torch.Tensor | None = None,
    return_pre_gelu: bool = False,
    backend: str | None = None,
    check_operands: bool = True,
):
    """``y = A · Bᵀ`` on quantized operands, FP32 accumulation with per-block scale promotion, fused epilogue.

    Args:
        a, b: QuantizedTensors. A is ``a``'s ``a_copy`` as a 2D (M, K) matrix, B is ``b``'s ``b_copy``
            as (N, K) — both contiguous along K. fprop: (x rowwise, w rowwise); dgrad: (dy rowwise,
            w columnwise); wgrad: (dy columnwise, x columnwise).
        out_dtype: float32, bfloat16 or float16; None (default): ``out``'s dtype when ``out`` is given, else
            bfloat16. Given together with ``out``, it must equal ``out``'s dtype.
        bias: (N,) added before GELU.
        gelu: apply GELU (erf form) in the epilogue; with ``return_pre_gelu`` the pre-GELU values are
            returned too, for the backward.
        accumulate: ``out += y`` (beta = 1); ``out`` (M, N) required.
        out: a float32 / bfloat16 / float16 (M, N) tensor on the operands' device to write (or add) the result into.
        backend: force ``"reference"`` or a registered backend; default: the fastest that supports the call.
        check_operands: False skips the structural check of ``a`` and ``b`` (dtypes, shapes, scale layouts) on calls
            whose signature was seen and checked before. For operands ``lowbit.quantize`` has just made and nothing
            has changed since (what ``lowbit.nn`` passes); a malformed operand then fails inside the kernel or gives
            a wrong result.

    Returns:
        y (M, N) — or ``(y, pre_gelu)`` when ``return_pre_gelu``.
    """
    check_bool("return_pre_gelu", return_pre_gelu)
    check_bool("check_operands", check_operands)
    out_dtype = _default_out_dtype(out_dtype, out)
    opts = dict(out_dtype=out_dtype, bias=bias, gelu=gelu, accumulate=accumulate, out=out)
    if backend is None and isinstance(a, QuantizedTensor) and isinstance(b, QuantizedTensor):
        # Hot path: validity and the backend choice depend only on these properties, so a key seen before
        # skips both (the cuBLAS backend clears the memo when cuBLAS rejects a signature at run time).
        try:
            key = (a.device, b.device, a.scheme, b.scheme, a_copy, b_copy, a.rows, a.cols, b.rows, b.cols, out_dtype,
                   None if bias is None else (bias.shape, bias.device, bias.dtype), gelu.__class__, gelu,
                   accumulate.__class__, accumulate, None if out is None else (out.shape, out.device, out.dtype),
                   getattr(a, a_copy, None) is not None, getattr(b, b_copy, None) is not None,
                   env.get("LOWBIT_DEEPGEMM"), env.get("LOWBIT_CUDA_GEMM"))
            fn = _CHOICE.get(key)
        except (TypeError, AttributeError):  # unhashable, or a bias / out that is no tensor: _validate names it
            _validate(a, b, a_copy, b_copy, out_dtype, bias, gelu, accumulate, out)
            raise
        if fn is not None:
            if check_operands:
                # the key does not cover the tensors themselves: their structure is checked on every call (metadata
                # only); check_operands=False trusts operands lowbit.quantize has just made
                a.validate("a", a_copy)
                b.validate("b", b_copy)
        else:
            _validate(a, b, a_copy, b_copy, out_dtype, bias, gelu, accumulate, out)
            fn = dict(_all())[backend_for(a, b, a_copy=a_copy, b_copy=b_copy, **opts)][1]
            if len(_CHOICE) > 4096:
                _CHOICE.clear()
            _CHOICE[key] = fn
        y, pre = fn(a, b, a_copy=a_copy, b_copy=b_copy, **opts)
        return (y, pre) if return_pre_gelu else y
    _validate(a, b, a_copy, b_copy, out_dtype, bias, gelu, accumulate, out)
    table = dict(_all())
    if backend is not None:
        if backend == "triton" and "triton" not in table and not triton_installed():
            raise NotImplementedError(f"{TRITON_MISSING}; use backend='reference' or None")
        if not isinstance(backend, str) or backend not in table:
            raise ValueError(f"backend: expected one of {sorted(table)}, got {backend!r}")
        if not table[backend][0](a, b, a_copy, b_copy, dict(opts, forced=True)):
            raise NotImplementedError(f"backend: {backend!r} does not support this call ({a.scheme} x {b.scheme}, "
                                      f"{a.device}); use None to pick one")
        fn = table[backend][1]
    else:
        fn = table[backend_for(a, b, a_copy=a_copy, b_copy=b_copy, **opts)][1]
    y, pre = fn(a, b, a_copy=a_copy, b_copy=b_copy, **opts)
    return (y, pre) if return_pre_gelu else y


# wgrad_mm's candidates: dYᵀX as asked (the first: what runs without tuning), or (XᵀdY)ᵀ copied back
_WGRAD_ORDERS = [dict(ORDER="dy_x"), dict(ORDER="x_dy")]


def _order_tunable(dy: QuantizedTensor, x: QuantizedTensor) -> bool:
    """Whether :func:`wgrad_mm` may time the other operand order: 1D blockwise FP8 (1 x block_size) columnwise
    copies of both on one CUDA device (cuBLAS's 1x128 · 1x128 kernels, whose choice follows the operand shapes),
    outside Triton's interpreter, with the autotuner on."""
    sa, sb = dy.scheme, x.scheme
    cd, cx = dy.columnwise, x.columnwise
    if not (isinstance(sa, Float8Blockwise) and isinstance(sb, Float8Blockwise) and sa.block_dim == 1
            and sb.block_dim == 1 and cd is not None and cx is not None and cd.data.is_cuda
            and cd.data.device == cx.data.device):
        return False
    return env.get("LOWBIT_AUTOTUNE") and not INTERPRET


def wgrad_mm(dy: QuantizedTensor, x: QuantizedTensor, *, out_dtype: torch.dtype = torch.float32,
             check_operands: bool = True) -> torch.Tensor:
    """The weight gradient ``dW = dYᵀ · X`` from both operands' columnwise copies, contiguous (N, K).

    Args:
        dy: QuantizedTensor of the output gradient, (M tokens, N) logically; its columnwise copy (N, M) is read.
        x: QuantizedTensor of the layer input, (M, K) logically; its columnwise copy (K, M) is read.
        out_dtype: float32 (FP32 master weights), bfloat16 or float16.
        check_operands: as for :func:`scaled_mm`.

    Returns:
        (N, K) contiguous: ``scaled_mm(dy, x, a_copy="columnwise", b_copy="columnwise", out_dtype=out_dtype)``.

    For 1x128 blockwise copies on CUDA, with the autotuner on, the first call of each shape also times the other
    operand order, ``scaled_mm(x, dy, ...)`` (dWᵀ, K x N) followed by a transposing copy
    (:func:`lowbit.ops.transpose.transpose_2d`, a tiled kernel: torch's own ran at a quarter of copy speed), and keeps
    the faster.
    cuBLAS picks its kernel by the operand shapes, and the order alone can cost 1.4x: the 350m GPT's fc2 weight
    gradient (1024 x 2816 over 16,384 tokens) takes 168 us as dYᵀX, 117 us as XᵀdY and 138 us with the copy back
    (H200, GPU time from CUDA graphs, BENCHMARKS.md); on the other GPT shapes the first order wins or
    the copy costs more than the order saves. Both orders form the same block products and per-block promotions;
    the GPU test checks they are bit-identical on the shapes it runs. ``LOWBIT_AUTOTUNE=0`` keeps the first order.
    """
    def direct():
        return scaled_mm(dy, x, a_copy="columnwise", b_copy="columnwise", out_dtype=out_dtype,
                         check_operands=check_operands)

    if not (isinstance(dy, QuantizedTensor) and isinstance(x, QuantizedTensor) and _order_tunable(dy, x)):
        return direct()
    from ..runtime.autotune import tuned_launch
    from ..runtime.transpose import transpose_2d

    res = []

    def launch(c):
        res.clear()
        if c["ORDER"] == "dy_x":
            res.append(direct())
        else:
            res.append(transpose_2d(scaled_mm(x, dy, a_copy="columnwise", b_copy="columnwise", out_dtype=out_dtype,
                                              check_operands=check_operands)))

    key = (tuple(dy.columnwise.data.shape), tuple(x.columnwise.data.shape), dy.scheme, x.scheme, out_dtype,
           dy.columnwise.data.device)
    tuned_launch("wgrad_order", key, lambda: list(_WGRAD_ORDERS), launch)
    return res[0]


def _load_fast_backends() -> None:
    """Import the GEMM backends (DeepGEMM where it is installed, lowbit's CUDA kernel, cuBLAS through torch, Triton),
    which register what they support, in this order of preference."""
    import importlib.util

    for mod in ("lowbit.gemm.deepgemm", "lowbit.gemm.cuda_sm90", "lowbit.gemm.cublas", "lowbit.gemm.triton_backend"):
        if mod.endswith("triton_backend") and not triton_installed():
            continue
        if importlib.util.find_spec(mod) is not None:
            importlib.import_module(mod)


_load_fast_backends()
