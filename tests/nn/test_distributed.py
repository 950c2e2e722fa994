"""Amax reduction across 2 processes (torch.distributed, gloo): both ranks end with the same histories
and scales, equal to the single-process amax over the union of their data."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import lowbit
from lowbit import recipes

WORLD = 2


def _data(rank):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(16, 32, generator=g) * (1 + 3 * rank)  # rank 1 has the larger input amax
    G = torch.randn(16, 24, generator=g) * (5 - 4 * rank)  # rank 0 has the larger gradient amax
    return x, G


def _worker(rank, tmp):
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)  # same weights on both ranks (as DDP ensures)
        m = lowbit.nn.Linear(32, 24)
        with torch.no_grad():
            m.weight.mul_(1 + rank)  # ... except here, so the weight amax differs too
        x, G = _data(rank)
        r = recipes.DelayedScaling(amax_history_len=8)
        with lowbit.autocast(recipe=r):  # group None: the world group
            y = m(x)
        y.backward(G)
        with lowbit.autocast(recipe=r):  # the gradient amax is reduced at the next outermost exit
            pass
        sd = m.get_extra_state()
        # a recipe that opts out of the reduction keeps local amaxes
        m2 = lowbit.nn.Linear(32, 24)
        with lowbit.autocast(recipe=recipes.DelayedScaling(amax_history_len=8, reduce_amax=False)):
            m2(x)
        sd["local.input.history"] = m2.get_extra_state()["input.history"]
        # an explicit amax_reduction_group is the one used: a group over both ranks reduces like the world;
        # each rank's own one-rank group (every rank creates every group, in the same order) keeps local amaxes
        both = dist.new_group(ranks=[0, 1])
        own = [dist.new_group(ranks=[r]) for r in range(WORLD)][rank]
        for name, group in (("group", both), ("own", own)):
            m3 = lowbit.nn.Linear(32, 24)
            with lowbit.autocast(recipe=r, amax_reduction_group=group):
                with lowbit.autocast(recipe=r):  # an inner context without a group keeps the outer one
                    m3(x)
            sd[f"{name}.input.history"] = m3.get_extra_state()["input.history"]
        sd["local.own.input.history"] = sd.pop("own.input.history")
        # the skip agreement of a user's loop: an Inf only on rank 1's input, "skip" on both; each rank's sentry
        # sees its own tensors, any_rank makes both skip
        lowbit.nn.nonfinite_events()
        bad = x.clone()
        if rank == 1:
            bad[2, 3] = float("inf")
        with lowbit.autocast(recipe=recipes.Float8CurrentScaling(), on_nonfinite="skip"):
            lowbit.nn.Linear(32, 24)(bad)
        local = lowbit.nn.nonfinite_events()
        sd["events"] = torch.tensor([len(local)])
        sd["skip"] = torch.tensor([lowbit.distributed.any_rank(bool(local))])
        sd["clean"] = torch.tensor([lowbit.distributed.any_rank(False)])
        # the helper itself, NaN on one rank -> inf on all
        t = [torch.tensor([float("nan") if rank == 0 else 1.0]), torch.tensor([2.0 + rank])]
        lowbit.distributed.reduce_amax(t)
        sd["nan"], sd["max"] = t[0], t[1]
        torch.save(sd, f"{tmp}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_amax_reduction_two_ranks(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path),), nprocs=WORLD, join=True)
    sds = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    assert [int(sd["events"]) for sd in sds] == [0, 1]  # (each rank's own sentry)
    assert all(bool(sd["skip"]) and not bool(sd["clean"]) for sd in sds)  # (agreed: both skip; nothing: neither)
    for k in sds[0]:
        if not k.startswith("local") and k != "events":
            assert torch.equal(sds[0][k], sds[1][k]), f"{k} differs between ranks"
    xs, Gs = zip(*(_data(r) for r in range(WORLD)))
    torch.manual_seed(0)
    w = torch.nn.Linear(32, 24).weight.detach()
    amax = {
        "input": torch.cat(xs).abs().max(),
        "weight": torch.maximum(w.abs().max(), (2 * w).abs().max()),
        "grad_output": torch.cat(Gs).abs().max(),
    }
    fmax = {"input": 448.0, "weight": 448.0, "grad_output": 57344.0}
    for role, a in amax.items():
        sd = sds[0]
        assert sd[f"{role}.history"][0] == a, role
        assert torch.equal(sd[f"{role}.scale"], torch.tensor([fmax[role]]) / a.reshape(1)), role
    assert sds[0]["group.input.history"][0] == amax["input"]  # the explicit two-rank group reduced
    for r in range(WORLD):  # no reduction (opted out, or a one-rank group): each rank's own amax
        assert sds[r]["local.input.history"][0] == xs[r].abs().max()
        assert sds[r]["local.own.input.history"][0] == xs[r].abs().max()
    assert sds[0]["nan"].item() == float("inf") and sds[0]["max"].item() == 3.0
