"""lowbit: low-precision (FP8, NVFP4, INT8) training and inference for transformers on NVIDIA Hopper.

Public surface: number formats (:mod:`lowbit.formats`), :func:`quantize` and the schemes,
:class:`QuantizedTensor`. Recipes, autocast, modules, ``scaled_mm`` and attention join as they land.
"""

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

__version__ = "0.1.0"

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
]
