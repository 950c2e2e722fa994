"""BF16 weight all-gather under FSDP2 (2 processes, gloo, CPU): ``lowbit.nn.bf16_all_gather`` then per-layer
``fully_shard``; two SGD steps under ``torch.autocast(bfloat16)``. The outputs, losses and gradients equal one
process's unsharded run bit for bit (both ranks see the same batch, so the averaged gradient is the single-process
one), the linear weights' all-gather moves BF16 bytes (counted at the collective) and the norm weight of the same
unit gathers in FP32."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from testenv import gloo_process

import lowbit
from lowbit.nn.fsdp import BF16AllGatherWeight, GatheredBF16Weight, all_gather_bytes

WORLD = 2
K, N1, TOKENS = 96, 160, 24  # (160 rows: 80 a shard; 96 rows pad nothing)


def _model():
    """LayerNormLinear(K, N1) (an RMSNorm weight beside the linear weight in one unit) -> GELU -> Linear(N1, K)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(lowbit.nn.LayerNormLinear(K, N1, bias=True, normalization="RMSNorm"),
                               torch.nn.GELU(), lowbit.nn.Linear(N1, K, bias=False))


def _run(model, n: int = 2):
    """n SGD steps on one batch under BF16 autocast: (outputs, losses, the first step's gradients by name)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5, foreach=False)
    torch.manual_seed(1)
    x = torch.randn(TOKENS, K)
    outs, losses, grads = [], [], None
    for _ in range(n):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
            loss = y.float().square().mean()
        loss.backward()
        if grads is None:
            grads = {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                     for name, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        outs.append(y.detach())
        losses.append(loss.detach())
    return outs, losses, grads


def _worker(rank, tmp, gather_bf16):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    model = _model()
    plan = lowbit.nn.bf16_all_gather(model) if gather_bf16 else {}
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    kinds, sizes = {}, []

    def probe(m, args, i):  # what a layer's weight is inside its forward (after FSDP2's all-gather)
        kinds.setdefault(i, type(m.weight).__name__)

    for i in (0, 2):
        model[i].register_forward_pre_hook(lambda m, args, i=i: probe(m, args, i))
    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    saved = {n: getattr(dist, n) for n in names}

    def counting(out, *a, _fn=None, **k):
        sizes.append((out.dtype, out.numel() * out.element_size()))
        return _fn(out, *a, **k)

    for n in names:
        setattr(dist, n, lambda out, *a, _fn=saved[n], **k: counting(out, *a, _fn=_fn, **k))
    try:
        outs, losses, grads = _run(model)
    finally:
        for n in names:
            setattr(dist, n, saved[n])
    torch.save(dict(outs=outs, losses=losses, grads=grads, plan=plan, kinds=kinds, sizes=sizes),
               f"{tmp}/rank{rank}.pt")


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_bf16_all_gather_matches_unsharded(tmp_path):
    mp.spawn(gloo_process, args=(str(tmp_path), WORLD, _worker, True), nprocs=WORLD, join=True)
    ref_outs, ref_losses, ref_grads = _run(_model())
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for r, g in enumerate(got):
        assert g["plan"] == {"0.weight": None, "2.weight": None}
        assert g["kinds"] == {0: GatheredBF16Weight.__name__, 2: GatheredBF16Weight.__name__}
        for step, (a, b) in enumerate(zip(ref_outs, g["outs"])):
            assert torch.equal(a, b), f"rank {r} step {step}: outputs differ from the unsharded run"
        for step, (a, b) in enumerate(zip(ref_losses, g["losses"])):
            assert torch.equal(a, b), f"rank {r} step {step}: loss {b} vs {a}"
        assert set(g["grads"]) == set(ref_grads)
        for n, a in ref_grads.items():
            assert g["grads"][n].dtype == torch.float32, n
            assert torch.equal(a, g["grads"][n]), f"rank {r}: gradient of {n} differs"
        # two steps, each layer gathered for its forward and again for its backward: the linear weights in BF16;
        # the first layer's FP32 norm weight and bias travel in the same gather (FSDP2 moves mixed dtypes as bytes)
        first = all_gather_bytes((N1, K), None, WORLD) + 4 * (K + N1)
        second = all_gather_bytes((K, N1), None, WORLD)
        assert sorted(g["sizes"], key=str) == sorted([(torch.uint8, first)] * 4 + [(torch.bfloat16, second)] * 4,
                                                     key=str), g["sizes"]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_fsdp_without_it_gathers_fp32_with_the_same_bits(tmp_path):
    """The control: FSDP2's FP32 gather of the same model gives the same outputs (what the BF16 gather must keep)."""
    mp.spawn(gloo_process, args=(str(tmp_path), WORLD, _worker, False), nprocs=WORLD, join=True)
    ref_outs, _, _ = _run(_model())
    g = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert g["kinds"] == {0: "Parameter", 2: "Parameter"}
    assert all(torch.equal(a, b) for a, b in zip(ref_outs, g["outs"]))
    assert {dt for dt, _ in g["sizes"]} == {torch.float32}


def test_bf16_all_gather_plan_and_bad_input():
    m = _model()
    w = m[0].weight
    plan = lowbit.nn.bf16_all_gather(m)
    assert plan == {"0.weight": None, "2.weight": None}
    assert isinstance(m[0].weight, BF16AllGatherWeight) and isinstance(m[0].weight, torch.nn.Parameter)
    assert m[0].weight.data_ptr() == w.data_ptr()  # the same storage: nothing copied
    assert type(m[0].layer_norm_weight) is torch.nn.Parameter and type(m[0].bias) is torch.nn.Parameter
    # unsharded, the wrapped model computes as before (every op on the FP32 tensor)
    ref = _model()
    x = torch.randn(5, K)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(m(x), ref(x))
    assert torch.equal(m(x), ref(x))
    assert lowbit.nn.bf16_all_gather(m) == plan  # again: a no-op
    with pytest.raises(TypeError, match="model"):
        lowbit.nn.bf16_all_gather("not a model")
    tied = torch.nn.Sequential(lowbit.nn.Linear(8, 8, bias=False), lowbit.nn.Linear(8, 8, bias=False))
    tied[1].weight = tied[0].weight
    assert lowbit.nn.bf16_all_gather(tied) == {"0.weight": "0.weight is shared by several modules (tied weights)",
                                               "1.weight": "1.weight is shared by several modules (tied weights)"}
    half = lowbit.nn.Linear(8, 8, bias=False).to(torch.bfloat16)
    assert "torch.bfloat16" in lowbit.nn.bf16_all_gather(half)["weight"]
    fp8 = torch.nn.Sequential(lowbit.nn.Linear(256, 256, bias=False))
    lowbit.nn.fp8_all_gather(fp8, lowbit.recipes.from_name("fp8-block"), 1)
    with pytest.raises(ValueError, match="fp8_all_gather"):
        lowbit.nn.bf16_all_gather(fp8)


def test_gathered_weight_takes_only_the_bf16_cast():
    w = torch.randn(6, 4)
    g = GatheredBF16Weight(w.to(torch.bfloat16), torch.float32)
    assert g.dtype == torch.float32 and g.shape == w.shape
    assert torch.equal(g.to(torch.bfloat16), w.to(torch.bfloat16))
    for use in (lambda: g + 1, lambda: g.float().sum(), lambda: torch.nn.functional.linear(torch.randn(2, 4), g)):
        with pytest.raises(NotImplementedError, match="bf16_all_gather"):
            use()
