"""The Triton prepass's Q/K codes against the reference, for the CPU interpreter tests and the GPU tests."""
import torch

from lowbit.attention import reference as R


def qk_pair(prepass, q, k, **kw):
    """(``prepass(q, k, **kw)``, ``quantize_qk_reference(q, k, **kw)`` run on the prepass's K mean).

    The prepass sums K in its own FP32 order. Its mean is checked against ``reference.k_mean`` to FP32 rounding
    (|diff| <= 2^-18 · the channel's mean |k|: 64 ulps of the terms' mean magnitude, above both
    orders' rounding over the sequence lengths tested; a wrong length, chunk or row is off by far more), and the
    reference is then given that mean, so the codes and scales compare bit for bit."""
    a = prepass(q, k, **kw)
    km = None
    if a.k_mean is not None:
        lay = {n: kw[n] for n in ("layout", "cu_seqlens_k", "max_seqlen_k") if n in kw}
        want, mag = R.k_mean(k, **lay), R.k_mean(k.abs(), **lay)
        assert a.k_mean.shape == want.shape and a.k_mean.dtype == torch.float32
        err = (a.k_mean - want).abs()
        assert bool((err <= mag * 2.0 ** -18).all()), f"k_mean off by up to {err.max().item():.3g}"
        km = a.k_mean
    return a, R.quantize_qk_reference(q, k, **kw, k_mean=km)
