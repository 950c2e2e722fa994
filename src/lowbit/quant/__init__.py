"""Quantization: schemes, QuantizedTensor, and the one public entry :func:`quantize`.

``quantize`` dispatches to a registered fast kernel where one exists for the device and scheme,
and to the pure-torch reference (:mod:`lowbit.quant.reference`, the spec) everywhere else.
"""

from __future__ import annotations

import importlib.util
from typing import Callable

import torch

from ..runtime.checks import check_bool
from ..runtime.device import TRITON_MISSING, triton_installed
from . import reference  # noqa: F401 - lowbit.quant.reference, the spec
from .reference import quantize_reference
from .scaling import AmaxHistory
from .schemes import MXFP8, NVFP4, Float8Blockwise, Float8Rowwise, Float8Tensorwise, Scheme
from .tensor import QuantizedCopy, QuantizedTensor

__all__ = [
    "quantize",
    "quantize_reference",
    "QuantizedTensor",
    "QuantizedCopy",
    "AmaxHistory",
    "Float8Tensorwise",
    "Float8Rowwise",
    "Float8Blockwise",
    "MXFP8",
    "NVFP4",
    "register_backend",
    "backend_for",
    "BACKENDS",
]

# name -> (supports(x, scheme, rowwise, columnwise) -> bool, fn(x, scheme, *, rowwise, columnwise, scale, seed))
# Registered in priority order; "reference" is always last and supports everything.
BACKENDS: dict[str, tuple[Callable, Callable]] = {}


_CHOICE: dict = {}  # (device type, dtype, shape, contiguous, scheme, rowwise, columnwise) -> backend fn


def register_backend(name: str, supports: Callable, fn: Callable) -> None:
    """Register a fast quantization backend (e.g. Triton kernels). Earlier registrations win."""
    BACKENDS[name] = (supports, fn)
    _CHOICE.clear()


def _all_backends():
    yield from BACKENDS.items()
    yield "reference", (lambda *a: True, quantize_reference)


def backend_for(x: torch.Tensor, scheme: Scheme, rowwise: bool = True, columnwise: bool = False) -> str:
    """Name of the backend :func:`quantize` would run for these arguments."""
    for name, (supports, _) in _all_backends():
        if supports(x, scheme, rowwise, columnwise):
            return name
    return "reference"


def quantize(
    x: torch.Tensor,
    scheme: Scheme,
    rowwise: bool = True,
    columnwise: bool = False,
    *,
    scale: torch.Tensor | None = None,
    seed: int | None = None,
    backend: str | None = None,
) -> QuantizedTensor:
    """Quantize a high-precision tensor.

    Args:
        x: float32 / bfloat16 / float16 (/ float64) tensor of shape (..., K), any device. Viewed as a
            2D matrix (M, K) with M = prod(leading dims).
        scheme: a scheme from :mod:`lowbit.quant.schemes` (Float8Tensorwise, Float8Rowwise,
            Float8Blockwise, MXFP8, NVFP4).
        rowwise: produce the copy quantized along K (data (M, K)).
        columnwise: produce the transposed copy quantized along M (data (K, M)); both copies from
            one read of x where a fused kernel exists.
        scale: Float8Tensorwise only: a given (delayed) float32 scale of one element; the amax is
            still measured and stored for the next step's scale.
        seed: Philox seed for stochastic rounding (NVFP4 with ``stochastic_rounding``); default: drawn
            from torch's default generator.
        backend: force a backend by name (``"reference"``, or a registered kernel backend such as
            ``"triton"``); default: the fastest one that supports the request.

    Returns:
        :class:`QuantizedTensor` with the requested copies, their scales and amax. A non-finite amax
        is flagged by ``has_nonfinite_amax``.
    """
    check_bool("rowwise", rowwise)
    check_bool("columnwise", columnwise)
    if seed is not None and seed.__class__ is not int:
        _check_seed(seed)
    if backend is None and isinstance(x, torch.Tensor):
        if x.is_cuda and not x.is_contiguous():  # (the kernels read contiguous rows; the reference would be slow)
            x = x.contiguous()
        # Hot path (every quantized GEMM operand, every step): the backend choice depends only on these
        # properties, so it is looked up once per distinct key.
        key = (x.device.type, x.dtype, tuple(x.shape), x.is_contiguous(), scheme, rowwise, columnwise)
        try:
            fn = _CHOICE.get(key)
        except TypeError:  # an unhashable scheme: not a scheme
            _check_scheme(scheme)
            raise
        if fn is not None:  # this key ran before: its input checks passed then (a backend's `.checked` skips them)
            return fn(x, scheme, rowwise=rowwise, columnwise=columnwise, scale=scale, seed=seed)
        _check_scheme(scheme)
        fn = dict(_all_backends())[backend_for(x, scheme, rowwise, columnwise)][1]
        out = fn(x, scheme, rowwise=rowwise, columnwise=columnwise, scale=scale, seed=seed)
        if len(_CHOICE) > 4096:
            _CHOICE.clear()
        _CHOICE[key] = getattr(fn, "checked", fn)
        return out
    table = dict(_all_backends())
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend: expected a backend name (one of {sorted(table)}) or None, got "
                        f"{type(backend).__name__} {backend!r}")
    if backend is not None and backend not in table:
        if backend == "triton" and not triton_installed():
            raise NotImplementedError(f"{TRITON_MISSING}; use backend='reference' or None")
        raise ValueError(f"backend: expected one of {sorted(table)}, got {backend!r}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    _check_scheme(scheme)  # (before a backend's `supports` looks at it)
    if backend is None:
        backend = backend_for(x, scheme, rowwise, columnwise)
    elif not table[backend][0](x, scheme, rowwise, columnwise):
        raise NotImplementedError(
            f"backend: {backend!r} does not support scheme {scheme!r} on {getattr(x, 'device', '?')} "
            f"(rowwise={rowwise}, columnwise={columnwise}); use backend='reference' or None"
        )
    return table[backend][1](x, scheme, rowwise=rowwise, columnwise=columnwise, scale=scale, seed=seed)


_SCHEMES = (Float8Tensorwise, Float8Rowwise, Float8Blockwise, MXFP8, NVFP4)


def _check_scheme(scheme) -> None:
    if not isinstance(scheme, _SCHEMES):
        raise TypeError(f"scheme: expected one of {', '.join(c.__name__ for c in _SCHEMES)} (lowbit.quant), got "
                        f"{type(scheme).__name__} {scheme!r}")


def _check_seed(seed) -> None:
    """``seed``: an int, or the (1,) int64 tensor holding one (what a CUDA draw makes)."""
    if isinstance(seed, torch.Tensor):
        if seed.dtype != torch.int64 or seed.numel() != 1:
            raise TypeError(f"seed: a tensor seed must be a one-element int64 tensor, got {seed.dtype} of shape "
                            f"{tuple(seed.shape)}")
    elif isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed: expected an int (the Philox key) or None, got {type(seed).__name__} {seed!r}")


def _load_fast_backends() -> None:
    """Import the kernel backends, which call :func:`register_backend` for what they support.

    Only where Triton is installed; a kernel module that fails to import for another reason is a bug
    and raises.
    """
    if not triton_installed():
        return
    if importlib.util.find_spec("lowbit.quant.triton_backend") is not None:
        importlib.import_module("lowbit.quant.triton_backend")


_load_fast_backends()
