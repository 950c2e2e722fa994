"""Scaling schemes: frozen descriptions of *how* a tensor is quantized (NUMERICS §3).

A scheme says nothing about which tensor it is applied to; recipes (``lowbit.recipes``) map the
tensor roles of a layer (input, weight, grad_output) to schemes.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from ..formats import E2M1, E4M3, E5M2, FloatFormat, get_format
from ..runtime.checks import check_bool

__all__ = [
    "BLOCK_SIZE",
    "Float8Tensorwise",
    "Float8Rowwise",
    "Float8Blockwise",
    "MXFP8",
    "NVFP4",
    "Scheme",
    "DEFAULT_RHT_SIGNS",
]

# The fixed ±1 diagonal of the Random Hadamard Transform (bit i set -> sign -1). Fixed so that two
# runs (and the GPU kernel and this reference) agree; a recipe may seed another one.
DEFAULT_RHT_SIGNS = 0b1011_0011_1000_1101

BLOCK_SIZE = 128
"""The FP8 blockwise scaling block (1x128 segments, 128x128 tiles: DeepSeek-V3's and cuBLAS's): the default of
:class:`Float8Blockwise` and the only block size the fused and Gluon fast paths take."""


MAX_BLOCK_SIZE = 4096
"""The largest :class:`Float8Blockwise` block edge (tensors are padded to whole blocks: a larger one only wastes
memory, and no kernel takes it)."""


def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")


class _FP8Scheme:
    """Shared by the FP8 schemes: ``fmt`` must name E4M3 or E5M2; ``format`` is its FloatFormat."""

    def __post_init__(self):
        if not isinstance(self.fmt, (str, FloatFormat)):
            raise TypeError(f"fmt: expected 'e4m3' or 'e5m2', got {type(self.fmt).__name__} {self.fmt!r}")
        fmt = get_format(self.fmt)
        if fmt not in (E4M3, E5M2):
            raise ValueError(f"fmt: an FP8 scheme takes 'e4m3' or 'e5m2', got {self.fmt!r}")
        # one spelling, so every `scheme.fmt == "e5m2"` check (and equality / hashing of schemes) sees the same value
        object.__setattr__(self, "fmt", fmt.name)

    @property
    def format(self) -> FloatFormat:
        return get_format(self.fmt)


@dataclass(frozen=True)
class Float8Tensorwise(_FP8Scheme):
    """One FP32 scale for the whole tensor.

    Current scaling by default (scale = fmax / amax of this tensor); pass ``scale=`` to
    :func:`lowbit.quantize` for delayed scaling (the amax is still measured and returned).
    """

    fmt: str = "e4m3"
    """FP8 element format: ``"e4m3"`` (forward tensors) or ``"e5m2"`` (gradients)."""


@dataclass(frozen=True)
class Float8Rowwise(_FP8Scheme):
    """One FP32 scale per row of each copy (per output channel for weights; cuBLAS "rowwise" scaling)."""

    fmt: str = "e4m3"
    """FP8 element format: ``"e4m3"`` or ``"e5m2"``."""
    pow2: bool = False
    """Round each scale down to a power of two."""

    def __post_init__(self):
        super().__post_init__()
        check_bool("pow2", self.pow2)


@dataclass(frozen=True)
class Float8Blockwise(_FP8Scheme):
    """DeepSeek-V3 style blockwise FP8: 1x128 row segments (``block_dim=1``) or 128x128 tiles (``block_dim=2``)."""

    fmt: str = "e4m3"
    """FP8 element format: ``"e4m3"`` or ``"e5m2"``."""
    block_dim: int = 1
    """1: one scale per 1 x ``block_size`` segment of a row; 2: one scale per ``block_size`` square tile."""
    block_size: int = BLOCK_SIZE
    """Block edge length (128 in DeepSeek-V3 and cuBLAS; other powers of two are allowed for experiments)."""
    pow2: bool = True
    """Round each scale *down* to a power of two, so amax·scale ≤ fmax still holds and scaling is exact."""
    eps: float = 0.0
    """Lower bound on a block's amax before the scale is computed (0: an all-zero block gets scale 1)."""

    def __post_init__(self):
        super().__post_init__()
        _check_int("block_dim", self.block_dim)
        _check_int("block_size", self.block_size)
        if self.block_dim not in (1, 2):
            raise ValueError(f"block_dim: must be 1 (1 x block_size segments) or 2 (block_size square tiles), "
                             f"got {self.block_dim!r}")
        bs = self.block_size
        if bs < 16 or bs > MAX_BLOCK_SIZE or bs & (bs - 1):
            raise ValueError(f"block_size: must be a power of two in [16, {MAX_BLOCK_SIZE}], got {bs!r}")
        check_bool("pow2", self.pow2)
        if isinstance(self.eps, bool) or not isinstance(self.eps, numbers.Real):
            raise TypeError(f"eps: expected a real number >= 0, got {type(self.eps).__name__} {self.eps!r}")
        try:
            eps = float(self.eps)
        except OverflowError:
            eps = math.inf
        if not (0.0 <= eps < math.inf):
            raise ValueError(f"eps: must be a finite real number >= 0, got {self.eps!r}")


@dataclass(frozen=True)
class MXFP8(_FP8Scheme):
    """OCP MX v1.0 FP8: 1x32 blocks along the last dim of each copy, E8M0 (power-of-two) scales."""

    fmt: str = "e4m3"
    """FP8 element format: ``"e4m3"`` or ``"e5m2"``."""
    block_size: int = 32
    """Elements per scale (32 in the OCP spec)."""

    def __post_init__(self):
        super().__post_init__()
        _check_int("block_size", self.block_size)
        if self.block_size != 32:
            raise ValueError(f"block_size: MXFP8 uses 32-element blocks, got {self.block_size!r}")


@dataclass(frozen=True)
class NVFP4:
    """NVFP4: E2M1 elements, an E4M3 scale per 16 elements (1x16, or 16x16 tiles) and an FP32 global scale."""

    two_d: bool = False
    """Use 16x16 tiles (weights), so the columnwise copy is the exact transpose of the rowwise copy."""
    rht: bool = False
    """Apply the 16-point Random Hadamard Transform to the columnwise copy (the wgrad operand) before quantizing."""
    stochastic_rounding: bool = False
    """Round E2M1 elements stochastically (Philox, reproducible from the seed given to quantize())."""
    rht_signs: int = DEFAULT_RHT_SIGNS
    """16-bit mask of the RHT sign diagonal (bit i set -> -1)."""

    def __post_init__(self):
        for name in ("two_d", "rht", "stochastic_rounding"):
            check_bool(name, getattr(self, name))
        _check_int("rht_signs", self.rht_signs)
        if self.two_d and self.rht:
            raise ValueError(
                "rht: the Random Hadamard Transform applies to 1x16 blocks of the columnwise copy; "
                "it cannot be combined with two_d=True (16x16 tiles, whose columnwise copy is the plain transpose)"
            )
        if not (0 <= self.rht_signs < 1 << 16):
            raise ValueError(f"rht_signs: must be a 16-bit mask (an int in [0, 65535]), got {self.rht_signs!r}")

    @property
    def format(self) -> FloatFormat:
        return E2M1

    @property
    def block_size(self) -> int:
        """Elements per E4M3 block scale along each quantized dim (16)."""
        return 16


Scheme = Float8Tensorwise | Float8Rowwise | Float8Blockwise | MXFP8 | NVFP4
