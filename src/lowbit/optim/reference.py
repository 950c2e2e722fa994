"""The spec of :class:`lowbit.optim.AdamW`'s fused kernel, in plain torch ops on any device.

:func:`adamw_step_reference` is one step of torch's fused AdamW (``torch._fused_adamw_``, the CUDA kernel behind
``torch.optim.AdamW(fused=True)``) for FP32 tensors, written out with the same roundings: torch's hyperparameters
are C++ doubles, so the weight decay, both moment updates, the step size and the ``+ eps`` are computed in float64
and rounded once to FP32; the square root and the divisions of FP32 values are FP32, IEEE round-to-nearest (as
CUDA compiles them without fast math). The FP8 copies of the updated weight are
:func:`lowbit.quant.reference.quantize_reference` of it.
"""

from __future__ import annotations

import math

import torch

__all__ = ["adamw_step_reference", "bias_corrections"]


def bias_corrections(beta1: float, beta2: float, step: float) -> tuple[float, float]:
    """(1 - beta1**step, sqrt(1 - beta2**step)) in double, each rounded to FP32 (as torch hands them to its
    element math); returned as Python floats holding FP32 values."""
    f32 = lambda x: float(torch.tensor(x, dtype=torch.float64).to(torch.float32))  # noqa: E731
    return f32(1.0 - beta1 ** step), f32(math.sqrt(1.0 - beta2 ** step))


def adamw_step_reference(p: torch.Tensor, g: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                         step: float, lr: float, beta1: float, beta2: float, weight_decay: float, eps: float,
                         grad_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One AdamW step, returned as new tensors ``(p, exp_avg, exp_avg_sq)`` (FP32, the inputs' shape).

    Args:
        p, g, exp_avg, exp_avg_sq: FP32 tensors of one shape (weight, gradient, moments before the step).
        step: the step count after this step's increment (1 on the first step).
        lr: the learning rate as a double (torch reads a tensor lr as FP32 and widens it: pass that value).
        beta1, beta2, weight_decay, eps: AdamW's hyperparameters (doubles).
        grad_scale: the gradient is divided by it first (torch's ``grad_scale``), in double.
    """
    for name, t in (("p", p), ("g", g), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32:
            raise TypeError(f"{name}: expected float32, got {t.dtype}")
        if t.shape != p.shape:
            raise ValueError(f"{name}: expected the shape of p {tuple(p.shape)}, got {tuple(t.shape)}")
    f32, f64 = torch.float32, torch.float64
    if grad_scale is not None:
        g = (g.to(f64) / float(grad_scale)).to(f32)
    if weight_decay != 0:
        pd = p.to(f64)
        p = (pd - (lr * weight_decay) * pd).to(f32)
    gd = g.to(f64)
    m = (beta1 * exp_avg.to(f64) + (1.0 - beta1) * gd).to(f32)
    v = (beta2 * exp_avg_sq.to(f64) + (1.0 - beta2) * gd * gd).to(f32)
    bc1, bc2s = bias_corrections(beta1, beta2, step)
    # (the scalars as tensors on p's device: torch's CUDA division by a CPU scalar multiplies by its reciprocal)
    step_size = torch.tensor(lr / bc1, dtype=f64, device=p.device).to(f32)
    # sqrt(v) correctly rounded, as CUDA's sqrtf: through float64 (exact for FP32 inputs). torch's own FP32 sqrt on
    # x86 CPUs with AVX-512 is not (about 1 in 5 results are 1 ulp off)
    denom = ((torch.sqrt(v.to(f64)).to(f32) / torch.tensor(bc2s, dtype=f32, device=p.device)).to(f64) + eps).to(f32)
    p = p - (step_size * m) / denom
    return p, m, v
