"""The number formats lowbit quantizes to, and their exact rounding rules (NUMERICS §2).

Every cast here is written in plain torch arithmetic so that it runs on any device and is the
specification the GPU kernels are tested against bit for bit:

* **Float formats (E4M3, E5M2, E2M1)**: round to nearest, ties to even; finite values beyond the
  range saturate to ±max; ±Inf saturates to ±max (the amax that produced the scale is then
  non-finite and the quantizer reports it); NaN stays NaN (E2M1 has no NaN encoding: a NaN element
  is encoded as +0 and the NaN is carried by the block scale, see :func:`e2m1_encode`).
* **Stochastic rounding**: a value between neighbours lo < hi rounds to hi with probability
  (v - lo) / (hi - lo). The uniform number for element ``i`` is
  ``(philox(seed, i)[0] >> 8) * 2**-24`` where ``philox`` is Philox-4x32-10 with the counter
  ``(i_lo, i_hi, 0, 0)`` and key ``(seed_lo, seed_hi)`` — the same stream Triton's
  ``tl.randint(seed, i)`` produces, so a kernel reproduces the reference bit for bit.
* **E8M0**: a power of two 2**X stored as the byte X + 127 (0xFF = NaN).
* **INT8**: symmetric, round half away from zero, clamp to ±127.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "FloatFormat",
    "E4M3",
    "E5M2",
    "E2M1",
    "FORMATS",
    "get_format",
    "round_to_format",
    "cast_to_format",
    "e2m1_encode",
    "e2m1_decode",
    "pack_e2m1",
    "unpack_e2m1",
    "e8m0_encode",
    "e8m0_decode",
    "quantize_int8_symmetric",
    "philox_uniform",
    "philox_randint",
    "INT8_MAX",
    "FP32_MAX",
]

FP32_MAX = torch.finfo(torch.float32).max
INT8_MAX = 127


@dataclass(frozen=True)
class FloatFormat:
    """A small IEEE-like floating-point format.

    Attributes:
        name: short name (``"e4m3"``, ``"e5m2"``, ``"e2m1"``).
        ebits: exponent bits.
        mbits: explicit mantissa bits.
        emin: exponent of the smallest normal number (unbiased); subnormals have quantum
            ``2**(emin - mbits)``.
        max: largest finite value.
        torch_dtype: the torch storage dtype, or ``None`` where torch has none usable (E2M1 is
            stored as 4-bit codes packed two per ``uint8``).
    """

    name: str
    ebits: int
    mbits: int
    emin: int
    max: float
    torch_dtype: torch.dtype | None

    @property
    def min_normal(self) -> float:
        return 2.0**self.emin

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.emin - self.mbits)

    @property
    def emax(self) -> int:
        """Exponent of the largest power of two in range (8 for E4M3, 15 for E5M2, 2 for E2M1)."""
        return int(math.floor(math.log2(self.max)))

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits

    def __repr__(self) -> str:  # short, for error messages and tables
        return self.name.upper()


E4M3 = FloatFormat("e4m3", 4, 3, -6, 448.0, torch.float8_e4m3fn)
E5M2 = FloatFormat("e5m2", 5, 2, -14, 57344.0, torch.float8_e5m2)
E2M1 = FloatFormat("e2m1", 2, 1, 0, 6.0, None)
FORMATS = {f.name: f for f in (E4M3, E5M2, E2M1)}


def get_format(fmt: str | FloatFormat) -> FloatFormat:
    """Return the :class:`FloatFormat` for a name (``"e4m3"``, ``"e5m2"``, ``"e2m1"``) or pass one through."""
    if isinstance(fmt, FloatFormat):
        return fmt
    if isinstance(fmt, str) and fmt.lower() in FORMATS:
        return FORMATS[fmt.lower()]
    raise ValueError(f"fmt: expected one of {sorted(FORMATS)} or a FloatFormat, got {fmt!r}")


def _check_float(x: torch.Tensor, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(
            f"{name}: expected a floating-point tensor (float32, bfloat16, float16 or float64), got {x.dtype}"
        )
    if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"{name}: expected a high-precision floating-point tensor, got already-quantized {x.dtype}")


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    # float64 input is rounded in float64 (no double rounding through float32); everything else in float32,
    # where bf16/fp16 values are exact.
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------------------------
# Philox-4x32-10, matching triton.language.randint (counter = (idx_lo, idx_hi, 0, 0), key = seed)
# ----------------------------------------------------------------------------------------------
_M32 = 0xFFFFFFFF


def _umulhi32(a: int, b: torch.Tensor) -> torch.Tensor:
    """High 32 bits of the 64-bit product of a uint32 constant and uint32 values held in int64.

    The int64 product wraps modulo 2**64 (two's complement), which keeps all 64 bits of the
    unsigned product; an arithmetic shift and a mask recover the high word.
    """
    return ((a * b) >> 32) & _M32


def philox_randint(seed: int, index: torch.Tensor) -> torch.Tensor:
    """First 32-bit output of Philox-4x32-10 for each counter in ``index`` (int64 tensor), as int64 in [0, 2**32).

    Equal to ``tl.randint(seed, index)`` reinterpreted as unsigned.
    """
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    index = index.to(torch.int64)
    c0 = index & _M32
    c1 = (index >> 32) & _M32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    A, B = 0xD2511F53, 0xCD9E8D57
    for _ in range(10):
        _c0, _c2 = c0, c2
        c0 = _umulhi32(B, _c2) ^ c1 ^ k0
        c2 = _umulhi32(A, _c0) ^ c3 ^ k1
        c1 = (B * _c2) & _M32
        c3 = (A * _c0) & _M32
        k0 = (k0 + 0x9E3779B9) & _M32
        k1 = (k1 + 0xBB67AE85) & _M32
    return c0


def philox_uniform(seed: int, index: torch.Tensor) -> torch.Tensor:
    """Uniform float32 numbers in [0, 1) with 24 random bits: ``(philox_randint(seed, i) >> 8) * 2**-24``."""
    r = philox_randint(seed, index)
    return (r >> 8).to(torch.float32) * (2.0**-24)


# ----------------------------------------------------------------------------------------------
# Float rounding
# ----------------------------------------------------------------------------------------------
def round_to_format(
    x: torch.Tensor,
    fmt: str | FloatFormat,
    *,
    stochastic: bool = False,
    seed: int = 0,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Round ``x`` onto the grid of ``fmt`` and return the rounded values in float32 (float64 for float64 input).

    Round-to-nearest-even, saturating (finite and infinite values beyond ±max become ±max), NaN kept.
    With ``stochastic=True`` the magnitude rounds up with probability equal to its distance from the
    lower neighbour over the gap, using :func:`philox_uniform` of ``seed`` at ``index`` (default: the
    row-major element index of ``x``).
    """
    _check_float(x)
    fmt = get_format(fmt)
    wd = _work_dtype(x)
    xf = x.to(wd)
    a = torch.minimum(xf.abs(), torch.tensor(fmt.max, dtype=wd, device=x.device))  # NaN propagates
    if wd == torch.float32:
        # binade exponent straight from the float32 bits (subnormal fp32 inputs land below emin anyway)
        e = ((a.view(torch.int32) >> 23) & 0xFF) - 127
        e = torch.clamp(e, min=fmt.emin)
        quantum = ((e - fmt.mbits + 127) << 23).view(torch.float32)
    else:
        _, e = torch.frexp(a)  # a = m * 2**e, m in [0.5, 1) -> floor(log2 a) = e - 1
        e = torch.clamp(e.to(torch.int32) - 1, min=fmt.emin)
        quantum = torch.ldexp(torch.ones_like(a), (e - fmt.mbits).to(wd))
    t = a / quantum  # exact: division by a power of two
    if stochastic:
        if index is None:
            index = torch.arange(x.numel(), device=x.device, dtype=torch.int64).reshape(x.shape)
        u = philox_uniform(seed, index).to(wd)
        fl = torch.floor(t)
        n = fl + (u < (t - fl)).to(wd)
    else:
        n = torch.round(t)  # round half to even
    r = torch.minimum(n * quantum, torch.tensor(fmt.max, dtype=wd, device=x.device))
    r = torch.copysign(r, xf)  # keeps -0 and the sign of values that round to zero
    return torch.where(torch.isnan(xf), xf, r)


def cast_to_format(x: torch.Tensor, fmt: str | FloatFormat, **rounding) -> torch.Tensor:
    """Saturating cast of ``x`` to ``fmt``'s storage: a float8 tensor, or unpacked uint8 E2M1 codes (0..15).

    ``rounding`` is passed to :func:`round_to_format` (``stochastic``, ``seed``, ``index``).
    """
    fmt = get_format(fmt)
    r = round_to_format(x, fmt, **rounding)
    if fmt.torch_dtype is None:
        return e2m1_encode(r)
    # r is on the format's grid, so torch's cast is exact here whatever its own rounding/overflow rules are.
    return r.to(torch.float32).to(fmt.torch_dtype)


# ----------------------------------------------------------------------------------------------
# E2M1 codes and packing
# ----------------------------------------------------------------------------------------------
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of unpacked E2M1 codes (uint8 0..15: bit 3 sign, bits 0-2 magnitude index)."""
    lut = torch.tensor(_E2M1_VALUES + tuple(-v for v in _E2M1_VALUES), dtype=torch.float32, device=codes.device)
    return lut[codes.to(torch.int64) & 0xF]


def e2m1_encode(values: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes for values already on the E2M1 grid (see :func:`round_to_format`).

    E2M1 has no NaN: NaN encodes as +0 (the NaN is carried by the block scale in NVFP4); -0 keeps its sign bit.
    """
    v = values.to(torch.float32)
    a = torch.nan_to_num(v.abs(), nan=0.0)
    # magnitude index: 0,0.5,1,1.5,2,3,4,6 -> 0..7
    idx = torch.where(a < 2, a * 2, torch.where(a < 4, a + 2, torch.where(a < 6, torch.full_like(a, 6),
                                                                          torch.full_like(a, 7))))
    idx = idx.to(torch.uint8)
    sign = (torch.signbit(v) & ~torch.isnan(v)).to(torch.uint8) << 3
    return sign | idx


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 E2M1 codes two per byte along the last dim: element 2i in the low nibble, 2i+1 in the high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"codes: the last dim must be even to pack two E2M1 values per byte, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_e2m1`: uint8 (..., n) -> uint8 codes (..., 2n)."""
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# ----------------------------------------------------------------------------------------------
# E8M0 (MX block scales)
# ----------------------------------------------------------------------------------------------
def e8m0_encode(exponent: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 byte for integer exponents X in [-127, 127] (clamped): byte = X + 127."""
    return (torch.clamp(exponent.to(torch.int32), -127, 127) + 127).to(torch.uint8)


def e8m0_decode(byte: torch.Tensor) -> torch.Tensor:
    """float32 2**(byte - 127); byte 0xFF decodes to NaN."""
    b = byte.to(torch.int32)
    v = torch.ldexp(torch.ones(b.shape, dtype=torch.float32, device=b.device), (b - 127).to(torch.float32))
    return torch.where(b == 255, torch.full_like(v, float("nan")), v)


# ----------------------------------------------------------------------------------------------
# INT8
# ----------------------------------------------------------------------------------------------
def quantize_int8_symmetric(x: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """int8 of ``x / scale_inv``: round half away from zero, clamp to ±127 (NaN -> 0).

    ``scale_inv`` broadcasts against ``x``; the division is done in float32 (a true division, as the kernels do).
    """
    t = x.to(torch.float32) / scale_inv.to(torch.float32)
    a = t.abs()
    # trunc + (frac >= 0.5) is exact; floor(a + 0.5) is not (0.49999997 + 0.5 rounds to 1.0 in float32).
    ti = torch.trunc(a)
    r = torch.copysign(ti + (a - ti >= 0.5).to(torch.float32), t)
    r = torch.nan_to_num(r, nan=0.0)
    return torch.clamp(r, -INT8_MAX, INT8_MAX).to(torch.int8)
