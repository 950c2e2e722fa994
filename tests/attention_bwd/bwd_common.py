"""Shared helpers for the attention-backward tests (imported by name: pytest puts this dir on sys.path)."""
from __future__ import annotations

import torch

# NRMSE bounds against the FP32 reference (measured, then a margin: see the test modules' docstrings)
BF16_TOL = 1e-2
FP8_TOL = {"e4m3": 3.5e-2, "e5m2": 7e-2}


def nrmse(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


def triton_interpreted() -> bool:
    """True when Triton itself was imported under TRITON_INTERPRET=1 (its standard library, e.g.
    ``tl.zeros``, is then interpreted too; setting the variable later is not enough)."""
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction
    except Exception:
        return False
    return isinstance(tl.zeros, InterpretedFunction)


def kernels_device():
    """'cuda' on a GPU box, 'cpu' in a process whose Triton runs interpreted, else None."""
    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if triton_interpreted() else None


def make_inputs(b, hq, hkv, sq, sk, d, *, dtype=torch.bfloat16, device="cpu", layout="bhsd", seed=0, scale_do=1.0):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def r(h, s):
        shape = (b, h, s, d) if layout == "bhsd" else (b, s, h, d)
        return torch.randn(shape, generator=g).to(dtype).to(device)

    q, k, v = r(hq, sq), r(hkv, sk), r(hkv, sk)
    do = (r(hq, sq).float() * scale_do).to(dtype)
    return q, k, v, do


def make_varlen(lens_q, lens_k, hq, hkv, d, *, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq, hq, d, generator=g).to(dtype).to(device)
    k = torch.randn(tk, hkv, d, generator=g).to(dtype).to(device)
    v = torch.randn(tk, hkv, d, generator=g).to(dtype).to(device)
    do = torch.randn(tq, hq, d, generator=g).to(dtype).to(device)
    cu = lambda ls: torch.tensor([0] + list(torch.tensor(ls).cumsum(0)), dtype=torch.int32, device=device)  # noqa
    return q, k, v, do, cu(lens_q), cu(lens_k)


def fp8_bits(qt):
    return qt.rowwise.data.view(torch.uint8)
