"""FSDP2 + torch.compile over lowbit layers (2 processes, gloo, CPU): per-layer ``fully_shard``, the model compiled,
two steps; the losses and the gathered gradients equal one process's eager run bit for bit (both ranks see the same
batch, so the averaged gradient is the single-process one). Delayed scaling reduces its amaxes across the ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from testenv import gloo_process

import lowbit
from lowbit.recipes import from_name

WORLD = 2


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(lowbit.nn.Linear(64, 128), torch.nn.GELU(), lowbit.nn.Linear(128, 64))


def _steps(model, recipe: str, n: int = 2) -> list[torch.Tensor]:
    torch.manual_seed(1)
    x = torch.randn(32, 64)
    losses = []
    for _ in range(n):
        with lowbit.autocast(recipe=from_name(recipe)):
            loss = model(x).square().mean()
        loss.backward()
        losses.append(loss.detach())
    return losses


def _worker(rank, tmp, recipe):
    """One rank's run (under ``gloo_process``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    model = _model()
    for layer in model:
        if isinstance(layer, lowbit.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    losses = _steps(torch.compile(model, backend="aot_eager"), recipe)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    torch.save(dict(losses=losses, grads=grads), f"{tmp}/rank{rank}.pt")


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
@pytest.mark.parametrize("recipe", ["fp8-block", "fp8-delayed"])
def test_fsdp2_compiled_matches_one_process(tmp_path, recipe):
    mp.spawn(gloo_process, args=(str(tmp_path), WORLD, _worker, recipe), nprocs=WORLD, join=True)
    ref = _model()
    ref_losses = _steps(ref, recipe)
    for r in range(WORLD):
        got = torch.load(tmp_path / f"rank{r}.pt", weights_only=True)
        for step, (a, b) in enumerate(zip(ref_losses, got["losses"])):
            assert torch.equal(a, b), f"rank {r} step {step}: loss {b} vs {a}"
        for n, p in ref.named_parameters():
            assert torch.equal(p.grad, got["grads"][n]), f"rank {r}: gradient of {n} differs"
