"""Shared helpers for the lowbit.nn tests: recipes, reference torch modules, SQNR, compiled-graph recording."""

from __future__ import annotations

import re

import torch

import lowbit
from lowbit import recipes

RECIPES = {
    "fp8-delayed": lambda: recipes.DelayedScaling(),
    "fp8-current": lambda: recipes.Float8CurrentScaling(),
    "fp8-block": lambda: recipes.Float8BlockScaling(),
    "mxfp8": lambda: recipes.MXFP8BlockScaling(),
    "nvfp4": lambda: recipes.NVFP4BlockScaling(),
}


def sqnr(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 10·log10(‖ref‖² / ‖out − ref‖²) (inf when equal)."""
    ref = ref.detach().double()
    err = (out.detach().double() - ref).pow(2).sum()
    if err == 0:
        return float("inf")
    return float(10 * torch.log10(ref.pow(2).sum() / err))


def make_module(kind: str, K: int, N: int, F: int, **kw):
    """A lowbit module and the torch module computing the same thing (parameters copied)."""
    if kind == "Linear":
        m = lowbit.nn.Linear(K, N)
        ref = torch.nn.Linear(K, N)
        ref.load_state_dict({"weight": m.weight.detach().clone(), "bias": m.bias.detach().clone()})
        return m, ref
    norm_cls = torch.nn.LayerNorm if kw.get("normalization", "LayerNorm") == "LayerNorm" else torch.nn.RMSNorm
    if kind == "LayerNormLinear":
        m = lowbit.nn.LayerNormLinear(K, N, **kw)
        with torch.no_grad():
            m.layer_norm_weight.uniform_(0.5, 1.5)
            if m.layer_norm_bias is not None:
                m.layer_norm_bias.uniform_(-0.2, 0.2)
        norm = norm_cls(K, eps=m.eps)
        lin = torch.nn.Linear(K, N)
        with torch.no_grad():
            norm.weight.copy_(m.layer_norm_weight)
            if m.layer_norm_bias is not None:
                norm.bias.copy_(m.layer_norm_bias)
            lin.weight.copy_(m.weight)
            lin.bias.copy_(m.bias)
        return m, torch.nn.Sequential(norm, lin)
    if kind == "LayerNormMLP":
        m = lowbit.nn.LayerNormMLP(K, F, **kw)
        with torch.no_grad():
            m.layer_norm_weight.uniform_(0.5, 1.5)
        return m, _TorchMLP(m)
    raise ValueError(kind)


class _TorchMLP(torch.nn.Module):
    """Plain torch LayerNorm/RMSNorm -> Linear -> GELU/SwiGLU -> Linear with a copy of a LayerNormMLP's parameters."""

    def __init__(self, m):
        super().__init__()
        norm_cls = torch.nn.LayerNorm if m.normalization == "LayerNorm" else torch.nn.RMSNorm
        self.norm = norm_cls(m.hidden_size, eps=m.eps)
        self.fc1 = torch.nn.Linear(m.hidden_size, m.fc1_weight.shape[0])
        self.fc2 = torch.nn.Linear(m.ffn_hidden_size, m.hidden_size)
        self.act = m.activation
        with torch.no_grad():
            self.norm.weight.copy_(m.layer_norm_weight)
            if m.layer_norm_bias is not None:
                self.norm.bias.copy_(m.layer_norm_bias)
            self.fc1.weight.copy_(m.fc1_weight)
            self.fc1.bias.copy_(m.fc1_bias)
            self.fc2.weight.copy_(m.fc2_weight)
            self.fc2.bias.copy_(m.fc2_bias)

    def forward(self, x):
        h = self.fc1(self.norm(x))
        if self.act == "gelu":
            h = torch.nn.functional.gelu(h)
        else:
            a, b = h.chunk(2, dim=-1)
            h = torch.nn.functional.silu(a) * b
        return self.fc2(h)


def grads_of(m):
    return [p.grad.detach().clone() for p in m.parameters()]


def recording_backend(codes: list):
    """A torch.compile backend that appends each Dynamo graph's readable code to ``codes`` and runs it as is."""
    def backend(gm, inputs):
        codes.append(gm.print_readable(print_output=False))
        return gm.forward
    return backend


def lowbit_ops(codes: list) -> set:
    """The ``torch.ops.lowbit`` operators named in recorded graph code."""
    return set(re.findall(r"torch\.ops\.lowbit\.(\w+)", "\n".join(codes)))
