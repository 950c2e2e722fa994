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


def check_fp8_epilogue(q, k, v, do, kw, cfg, fmt, *, tensorwise_tol):
    """FP8 dQ/dK/dV (per-row scales, and given per-tensor scales) equal ``lowbit.quantize`` of the kernel's own FP32
    gradients bit for bit; their NRMSE against the FP32 reference and the 16-bit kernel stays under the format's
    floor (``tensorwise_tol`` for the given-scale variant) and clearly above the 16-bit kernel's own error."""
    from lowbit.attention import backward as BW
    from lowbit.attention import reference as R
    from lowbit.quant import Float8Rowwise, Float8Tensorwise, QuantizedTensor, quantize

    o, lse = BW.attention_forward(q, k, v, **kw)
    g32 = BW.backward(do, q, k, v, o, lse, grad_dtype=torch.float32, config=cfg, **kw)
    g16 = BW.backward(do, q, k, v, o, lse, config=cfg, **kw)
    gr = R.attention_backward_reference(do, q, k, v, **kw)
    g8 = BW.backward(do, q, k, v, o, lse, grad_format=fmt, config=cfg, **kw)
    fmax = BW._FMT[fmt][1]
    scales = tuple((fmax / x.abs().amax()).reshape(1).float() / 2 for x in g32)
    g8t = BW.backward(do, q, k, v, o, lse, grad_format=fmt, scales=scales, config=cfg, **kw)
    # given scales 16x the ones above (8 fmax / amax): every gradient's largest values overflow the format and must
    # come out as +-fmax, as lowbit.quantize saturates (the kernel has no clamp of its own: the GPU's FP8 convert
    # saturates, the interpreter's emulation clamps)
    sat = tuple(s * 16 for s in scales)
    g8s = BW.backward(do, q, k, v, o, lse, grad_format=fmt, scales=sat, config=cfg, **kw)
    for name, a, x32, s in zip("qkv", g8s, g32, sat):
        r = quantize(x32, Float8Tensorwise(fmt), scale=s, backend="reference")
        mism = int((fp8_bits(a) != fp8_bits(r)).sum())
        assert mism == 0, f"d{name}: {mism} FP8 codes differ from lowbit.quantize (saturating given scale)"
        assert torch.equal(a.amax, r.amax)
        n_sat = int((a.rowwise.data.float().abs() == fmax).sum())
        assert n_sat > 0, f"d{name}: no value saturated"
    for name, a, at, x32, x16, ref, s in zip("qkv", g8, g8t, g32, g16, gr, scales):
        assert isinstance(a, QuantizedTensor) and isinstance(a.scheme, Float8Rowwise)
        r = quantize(x32, Float8Rowwise(fmt), backend="reference")
        mism = int((fp8_bits(a) != fp8_bits(r)).sum())
        assert mism == 0, f"d{name}: {mism} FP8 codes differ from lowbit.quantize (rowwise)"
        assert torch.equal(a.rowwise.scale_inv, r.rowwise.scale_inv) and torch.equal(a.amax, r.amax)
        rt = quantize(x32, Float8Tensorwise(fmt), scale=s, backend="reference")
        assert isinstance(at.scheme, Float8Tensorwise)
        mism = int((fp8_bits(at) != fp8_bits(rt)).sum())
        assert mism == 0, f"d{name}: {mism} FP8 codes differ from lowbit.quantize (tensorwise)"
        assert torch.equal(at.amax, rt.amax) and torch.equal(at.rowwise.scale_inv, rt.rowwise.scale_inv)
        deq = a.dequantize()
        assert deq.shape == ref.shape
        e_ref, e_16 = nrmse(deq.cpu(), ref.cpu()), nrmse(deq.cpu(), x16.cpu())
        e_t = nrmse(at.dequantize().cpu(), ref.cpu())
        print(f"fp8 {fmt} d{name}: rowwise vs fp32 {e_ref:.3e} vs 16-bit {e_16:.3e}; tensorwise vs fp32 {e_t:.3e}; "
              f"16-bit vs fp32 {nrmse(x16.cpu(), ref.cpu()):.3e}")
        assert e_ref < FP8_TOL[fmt] and e_16 < FP8_TOL[fmt] and e_t < tensorwise_tol, (e_ref, e_16, e_t)
        assert e_ref > 2 * nrmse(x16.cpu(), ref.cpu())  # the format's loss dominates (floor can fail)
