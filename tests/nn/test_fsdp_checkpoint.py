"""Weights made FSDP2-gatherable by ``lowbit.nn.fp8_all_gather`` / ``bf16_all_gather`` save and load as plain tensors:
``torch.save`` of a state dict (one process) and ``torch.distributed.checkpoint`` of the sharded model (2 gloo
processes) round-trip the values bit for bit into a fresh model of the same kind; ``copy.deepcopy`` copies them."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from testenv import gloo_process

import lowbit

WORLD = 2
KINDS = ["bf16", "fp8-block"]


def _model(kind: str, seed: int, mesh=None):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(lowbit.nn.Linear(256, 256, bias=False), torch.nn.GELU(),
                            lowbit.nn.Linear(256, 256, bias=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (fp8-block on one process: its weights fit whole tiles, no fallback)
        if kind == "bf16":
            lowbit.nn.bf16_all_gather(m)
        else:
            lowbit.nn.fp8_all_gather(m, lowbit.recipes.from_name(kind), mesh if mesh is not None else 1)
    return m


def _values(m) -> list[torch.Tensor]:
    out = []
    for p in m.parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(getattr(t, "lowbit_hp", t).detach().clone())
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_saves_as_plain_tensors(kind):
    a, b = _model(kind, 0), _model(kind, 1)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert {type(sd[k]) for k in ("0.weight", "2.weight")} == {torch.Tensor}  # (beside the layers' _extra_state)
    b.load_state_dict(sd)
    assert all(torch.equal(x, y) for x, y in zip(_values(a), _values(b)))
    assert type(b[0].weight).__name__ in ("BF16AllGatherWeight", "Float8AllGatherWeight")  # (still gatherable)


@pytest.mark.parametrize("kind", KINDS)
def test_deepcopy_gives_independent_gatherable_parameters(kind):
    a = _model(kind, 0)
    b = copy.deepcopy(a)
    assert [type(p) for p in b.parameters()] == [type(p) for p in a.parameters()]
    assert all(isinstance(p, torch.nn.Parameter) and p.requires_grad for p in b.parameters())
    assert all(torch.equal(x, y) for x, y in zip(_values(a), _values(b)))
    x = torch.randn(4, 256)
    assert torch.equal(a(x), b(x))
    with torch.no_grad():
        b[0].weight.add_(1.0)  # (the copy's storage is its own)
    assert not torch.equal(_values(a)[0], _values(b)[0])
    assert b[0].weight.data_ptr() != a[0].weight.data_ptr()


def _dcp_worker(rank, tmp, kind):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    models = []
    for seed in (0, 1):
        m = _model(kind, seed, mesh)
        for layer in (m[0], m[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        models.append(m)
    a, b = models
    dcp.save(a.state_dict(), checkpoint_id=f"{tmp}/ckpt")
    sd = b.state_dict()
    dcp.load(sd, checkpoint_id=f"{tmp}/ckpt")
    b.load_state_dict(sd)
    torch.save(dict(a=_values(a), b=_values(b)), f"{tmp}/rank{rank}.pt")


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
@pytest.mark.parametrize("kind", KINDS)
def test_distributed_checkpoint_round_trips(tmp_path, kind):
    mp.spawn(gloo_process, args=(str(tmp_path), WORLD, _dcp_worker, kind), nprocs=WORLD, join=True)
    for r in range(WORLD):
        got = torch.load(tmp_path / f"rank{r}.pt", weights_only=True)
        assert len(got["a"]) == 2
        assert all(torch.equal(x, y) for x, y in zip(got["a"], got["b"])), f"rank {r}"
        assert not torch.equal(got["a"][0], _values(_model("bf16", 1))[0])  # (b started from other values)
