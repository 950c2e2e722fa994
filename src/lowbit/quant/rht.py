"""The Random Hadamard Transform of NVFP4's columnwise copies, in blocks of 16 (the spec: the kernels reproduce
:func:`rht_blocks` bit for bit). Below :mod:`lowbit.quant.tensor` (dequantization undoes it) and
:mod:`lowbit.quant.reference` (which re-exports these names).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["hadamard_16", "rht_signs_vector", "rht_blocks", "rht_matrix"]


def hadamard_16(device=None) -> torch.Tensor:
    """The 16x16 Sylvester Hadamard matrix (entries ±1), float32."""
    h = torch.ones(1, 1)
    for _ in range(4):
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h.to(device=device, dtype=torch.float32)


@functools.lru_cache(maxsize=64)
def rht_signs_vector(signs: int, device=None) -> torch.Tensor:
    """float32 (16,) ±1 sign diagonal of the RHT (bit i of ``signs`` set -> -1). Cached per (signs, device) — it is
    needed for every RHT'd operand of every step, and building it is a host-to-device copy; read it only."""
    return torch.tensor([-1.0 if (signs >> i) & 1 else 1.0 for i in range(16)], dtype=torch.float32, device=device)


def rht_blocks(x: torch.Tensor, signs: int, dim: int = -1) -> torch.Tensor:
    """Random Hadamard Transform of ``x`` (float32) in blocks of 16 along ``dim``: v -> (v ⊙ s) · H / 4.

    Computed as a fixed-order butterfly (4 stages of a+b / a-b, then ×1/4, exact), so every device —
    and any kernel that does the same stages — gets the same bits; a matmul with :func:`rht_matrix`
    agrees to FP32 rounding but leaves the summation order to the library.
    """
    n = x.shape[dim]
    if n % 16:
        raise ValueError(f"x: the RHT needs dim {dim} divisible by 16, got {n}")
    y = x.to(torch.float32).movedim(dim, -1)
    lead = y.shape[:-1]
    y = y.reshape(*lead, n // 16, 16) * rht_signs_vector(signs, device=x.device)
    for h in (1, 2, 4, 8):  # Sylvester order: pairs (j, j + h) inside each group of 2h
        y = y.reshape(*lead, n // 16, 16 // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack([a + b, a - b], dim=-2)
    y = y.reshape(*lead, n) * 0.25
    return y.movedim(-1, dim)


def rht_matrix(signs: int, device=None) -> torch.Tensor:
    """R = diag(s) · H / 4 (16x16, float32, orthogonal: R·Rᵀ = I); a 16-vector v (row) transforms as v · R.

    ``signs``: 16-bit mask, bit i set -> s_i = -1.
    """
    return (rht_signs_vector(signs)[:, None] * hadamard_16() / 4.0).to(device)
