"""lowbit: low-precision (FP8, NVFP4, INT8) training and inference for transformers on NVIDIA Hopper.

Public surface: number formats (:mod:`lowbit.formats`), :func:`quantize` and the scaling schemes,
:class:`QuantizedTensor`, :func:`scaled_mm`, recipes and :func:`autocast`, the drop-in modules in
:mod:`lowbit.nn` and :func:`convert`, and quantized :func:`attention`. Higher layers are imported
lazily so ``import lowbit`` stays cheap and the data flow stays one-way
(formats -> quant -> gemm/attention -> nn -> models/train).
"""

import importlib

from . import formats
from .quant import (
    MXFP8,
    NVFP4,
    AmaxHistory,
    Float8Blockwise,
    Float8Rowwise,
    Float8Tensorwise,
    QuantizedTensor,
    quantize,
)


def _package_version(fallback: str = "0.1.0") -> str:
    """The installed distribution's version (pyproject.toml's), or ``fallback`` when running from a source tree."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover (Python >= 3.8 has it)
        return fallback
    try:
        return version("lowbit")
    except PackageNotFoundError:
        return fallback


__version__ = _package_version()

# attribute -> (module, name in module); resolved on first access
_LAZY = {
    "scaled_mm": ("lowbit.gemm", "scaled_mm"),
    "gemm": ("lowbit.gemm", None),
    "recipes": ("lowbit.recipes", None),
    "autocast": ("lowbit.nn", "autocast"),
    "convert": ("lowbit.nn", "convert"),
    "nn": ("lowbit.nn", None),
    "optim": ("lowbit.optim", None),
    "attention": ("lowbit.attention", None),  # the package is callable: lowbit.attention(q, k, v) == attention(...)
    "attention_qk_int8": ("lowbit.attention", "attention_qk_int8"),
    "models": ("lowbit.models", None),
}


def __getattr__(name):
    if name in _LAZY:
        mod, attr = _LAZY[name]
        m = importlib.import_module(mod)
        return m if attr is None else getattr(m, attr)
    raise AttributeError(f"module 'lowbit' has no attribute {name!r}")


__all__ = [
    "formats",
    "quantize",
    "QuantizedTensor",
    "AmaxHistory",
    "Float8Tensorwise",
    "Float8Rowwise",
    "Float8Blockwise",
    "MXFP8",
    "NVFP4",
    "__version__",
]  # the lazy names (scaled_mm, autocast, ...) are left out so `import *` stays cheap


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
