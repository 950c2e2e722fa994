"""A CPU stand-in for the ``deep_gemm`` package (float64) that keeps the operand contract of the two SM90 calls lowbit
makes, so the CPU tests check what lowbit passes: ``fp8_fp4_gemm_nt((A, sfa), (B, sfb), d, c=, recipe=,
disable_ue8m0_cast=True)`` writes d = (A·sfa)(B·sfb)ᵀ (+ c) with

- both codes K-major; float32 scales;
- sfa one scale per row and 128 K-elements, (M, K/128), MN-major with the column stride padded to 4 rows (TMA-aligned);
- sfb for ``recipe=(1, 128, 128)`` one scale per 128x128 block, (N/128, K/128), its strides those of a packed
  row- or column-major grid (checked as strides, as DeepGEMM does);
  for ``(1, 1, 128)`` laid out as sfa;
- ``(1, 128, 128)`` writes BF16 without accumulation; ``(1, 1, 128)`` accumulates into FP32 (c is d).

``get_mn_major_tma_aligned_tensor`` returns that TMA-aligned layout (a copy unless it is already so). ``calls`` counts
the GEMM calls."""
from __future__ import annotations

import types

import torch


def _pad4(n: int) -> int:
    return -(-n // 4) * 4


def _check_mn_major(s, rows, k, what):
    assert s.dtype == torch.float32, f"{what}: float32 scales"
    assert s.shape == (rows, -(-k // 128)), f"{what}: (rows, K/128)"
    assert s.stride(0) == 1 and s.stride(1) == _pad4(rows), f"{what}: MN-major, TMA-aligned, got {s.stride()}"


def make():
    """A fresh stand-in module."""
    calls = {"n": 0}

    def aligned(s):
        m, k = s.shape
        if s.stride(0) == 1 and s.stride(1) == _pad4(m):
            return s
        out = torch.empty_strided((m, k), (1, _pad4(m)), dtype=s.dtype, device=s.device)
        out.copy_(s)
        return out

    def expand(s, rows, k, per_block_rows):
        s = s.double().repeat_interleave(128, 1)[:, :k]
        return s.repeat_interleave(128, 0)[:rows] if per_block_rows else s

    def fp8_fp4_gemm_nt(a, b, d, c=None, recipe=None, disable_ue8m0_cast=False):
        (A, sa), (B, sb) = a, b
        assert disable_ue8m0_cast and recipe in ((1, 128, 128), (1, 1, 128))
        assert A.dtype == B.dtype == torch.float8_e4m3fn, "E4M3 codes"
        blocks = recipe[1] == 128  # the 1D2D kernel: BF16 out, no accumulation; 1D1D: FP32 accumulated
        assert (c is None and d.dtype == torch.bfloat16) if blocks else (c is d and d.dtype == torch.float32)
        (m, k), n = A.shape, B.shape[0]
        assert A.stride(1) == 1 and B.stride(1) == 1, "K-major codes"
        assert d.shape == (m, n) and d.is_contiguous()
        _check_mn_major(sa, m, k, "sfa")
        if blocks:
            assert sb.dtype == torch.float32 and sb.shape == (-(-n // 128), -(-k // 128)), "sfb: (N/128, K/128)"
            packed = (sb.stride(1) == 1 and sb.stride(0) == sb.shape[1]) or (sb.stride(0) == 1
                                                                              and sb.stride(1) == sb.shape[0])
            assert packed, f"sfb: packed row- or column-major (DeepGEMM checks the strides), got {sb.stride()}"
        else:
            _check_mn_major(sb, n, k, "sfb")
        acc = (A.double() * expand(sa, m, k, False)) @ (B.double() * expand(sb, n, k, blocks)).t()
        d.copy_(acc + (c.double() if c is not None else 0))
        calls["n"] += 1

    return types.SimpleNamespace(fp8_fp4_gemm_nt=fp8_fp4_gemm_nt, get_mn_major_tma_aligned_tensor=aligned,
                                 __version__="2.6.1 (stand-in)", calls=calls)
