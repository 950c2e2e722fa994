"""FP8 weight all-gather under FSDP2 (2 processes, gloo, CPU): ``lowbit.nn.fp8_all_gather`` then per-layer
``fully_shard`` (or one unit for the whole model); two SGD steps. The outputs, losses and gathered gradients equal one
process's unsharded run with the same recipe bit for bit (both ranks see the same batch, so the averaged gradient is
the single-process one), the all-gather moves the FP8 bytes (counted at the collective), per-tensor scaling runs one
amax all-reduce per unit gathered (counted at the collective) and a weight whose shards are not whole 128-row tiles
gathers in high precision."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from testenv import gloo_process, group_process

import lowbit
from lowbit.nn.fsdp import GatheredFloat8Weight, all_gather_bytes
from lowbit.recipes import from_name

WORLD = 2


def _model(shape):
    """Linear(K, N1) -> GELU -> Linear(N1, K), no biases (so the all-gather holds only the weights)."""
    torch.manual_seed(0)
    k, n1 = shape
    return torch.nn.Sequential(lowbit.nn.Linear(k, n1, bias=False), torch.nn.GELU(),
                               lowbit.nn.Linear(n1, k, bias=False))


def _run(model, recipe: str, n: int = 2, device="cpu", optimizer="sgd", after_first=None):
    """n SGD (or lowbit AdamW) steps on one batch: (outputs, losses, the first step's gradients by name), on the CPU
    as one batch of 32 tokens, on a GPU of 128 (the GEMM kernels' tile); ``after_first()`` runs after the first
    update."""
    if optimizer == "adamw":
        from lowbit.optim import AdamW

        opt = AdamW(model.parameters(), lr=2e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.5, foreach=False)
    torch.manual_seed(1)
    x = torch.randn(32 if device == "cpu" else 128, model[0].in_features).to(device)
    outs, losses, grads = [], [], None
    for step in range(n):
        with lowbit.autocast(recipe=from_name(recipe)):
            y = model(x)
            loss = y.square().mean()
        loss.backward()
        if grads is None:
            grads = {name: _full(p.grad).cpu() for name, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        if step == 0 and after_first is not None:
            after_first(opt)
        outs.append(y.detach().cpu())
        losses.append(loss.detach().cpu())
    return outs, losses, grads


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class _Count:
    """Bytes written by the all-gathers FSDP2 runs (``n``) and their number (``calls``): the outputs of
    ``dist.all_gather_single`` (torch 2.13) or ``dist.all_gather_into_tensor`` (earlier torch), whichever this torch has
    and FSDP2 calls; and the all-reduces with ``op=MAX`` (``amax_calls``: the weights' amax reductions)."""

    NAMES = ("all_gather_single", "all_gather_into_tensor", "all_reduce")

    def __init__(self):
        self.n, self.calls, self.amax_calls = 0, 0, 0
        self.orig = {k: getattr(dist, k) for k in self.NAMES if hasattr(dist, k)}

    def __enter__(self):
        for name, fn in self.orig.items():
            def counting(out, *a, _fn=fn, _name=name, **k):
                if _name == "all_reduce":
                    op = k.get("op", a[0] if a else None)
                    self.amax_calls += op == dist.ReduceOp.MAX
                else:
                    self.n += out.numel() * out.element_size()
                    self.calls += 1
                return _fn(out, *a, **k)

            setattr(dist, name, counting)
        return self

    def __exit__(self, *exc):
        for name, fn in self.orig.items():
            setattr(dist, name, fn)


def _worker(rank, tmp, recipe, shape, device="cpu", units="layers", optimizer="sgd"):
    """One rank's run (under ``group_process``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device, (WORLD,))
    model = _model(shape).to(device)
    tokens = 32 if device == "cpu" else 128
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = lowbit.nn.fp8_all_gather(model, from_name(recipe), mesh)
    for layer in model:
        if isinstance(layer, lowbit.nn.Linear) and units == "layers":
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # (units="root": one unit gathers both weights)
    kinds = {}

    def probe(m, args, i):  # what a layer's weight is inside its forward (after FSDP2's pre-forward all-gather)
        kinds.setdefault(i, type(m.weight).__name__)

    for i in (0, 2):
        model[i].register_forward_pre_hook(lambda m, args, i=i: probe(m, args, i))
    with _Count() as fp8_bytes:
        with lowbit.autocast(recipe=from_name(recipe)):
            model(torch.zeros(tokens, shape[0], device=device))
    # (FSDP2 keeps the root unit's weights gathered after a forward, for the backward; with no backward here,
    # reshard them, or the next step's update is lost: seen with plain torch.nn.Linear layers too)
    model.reshard()
    # the shards FSDP2's gathers quantize after the first update (lowbit AdamW writes their copies instead)
    quantized = {"on": False, "n": 0, "fused": None}
    import lowbit.nn.fsdp as fsdp_mod

    def counting(*a, _q=fsdp_mod.quantize, **k):
        quantized["n"] += quantized["on"]
        return _q(*a, **k)

    def after_first(opt):
        quantized["on"] = True
        quantized["fused"] = getattr(opt, "fused_tensors", None)

    fsdp_mod.quantize = counting
    with _Count() as steps:
        outs, losses, grads = _run(model, recipe, n=3 if optimizer == "adamw" else 2, device=device,
                                   optimizer=optimizer, after_first=after_first)
    # the BF16 gather of the same weights (FSDP2's mixed precision), for the byte count
    bf16 = _model(shape).to(device)
    for layer in bf16:
        if isinstance(layer, lowbit.nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    fully_shard(bf16, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    with _Count() as bf16_bytes, lowbit.autocast(recipe=from_name(recipe)):
        bf16(torch.zeros(tokens, shape[0], device=device))
    torch.save(dict(outs=outs, losses=losses, grads=grads, plan=plan, kinds=kinds, fp8_bytes=fp8_bytes.n,
                    bf16_bytes=bf16_bytes.n, warned=[str(w.message) for w in caught], gathers=steps.calls,
                    amax_reductions=steps.amax_calls, quantized_later=quantized["n"],
                    fused=quantized["fused"]), f"{tmp}/rank{rank}.pt")


def _spawn_and_compare(tmp_path, recipe, shape, device="cpu", units="layers", optimizer="sgd"):
    mp.spawn(group_process, args=(str(tmp_path), WORLD, device, _worker, recipe, shape, device, units, optimizer),
             nprocs=WORLD, join=True)
    ref = _model(shape).to(device)
    with lowbit.autocast(recipe=from_name(recipe)):  # the workers' probe forward (delayed scaling records it)
        ref(torch.zeros(32 if device == "cpu" else 128, shape[0], device=device))
    ref_outs, ref_losses, ref_grads = _run(ref, recipe, n=3 if optimizer == "adamw" else 2, device=device,
                                           optimizer=optimizer)
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for r, g in enumerate(got):
        for step, (a, b) in enumerate(zip(ref_outs, g["outs"])):
            assert torch.equal(a, b), f"rank {r} step {step}: outputs differ from the unsharded run"
        for step, (a, b) in enumerate(zip(ref_losses, g["losses"])):
            assert torch.equal(a, b), f"rank {r} step {step}: loss {b} vs {a}"
        for n, a in ref_grads.items():
            assert torch.equal(a, g["grads"][n]), f"rank {r}: gradient of {n} differs"
    return got


def _check_fp8_gather(tmp_path, recipe, device):
    shape = (256, 256)  # two (256, 256) weights: 128-row shards of whole 128x128 tiles
    got = _spawn_and_compare(tmp_path, recipe, shape, device)
    weights = [(shape[1], shape[0]), (shape[0], shape[1])]
    want = sum(all_gather_bytes(s, from_name(recipe), WORLD) for s in weights)
    for g in got:
        assert g["plan"] == {"0.weight": None, "2.weight": None}
        assert g["kinds"] == {0: GatheredFloat8Weight.__name__, 2: GatheredFloat8Weight.__name__}
        assert g["fp8_bytes"] == want  # data (+ tile scales and amaxes): what all_gather_bytes counts
        assert g["bf16_bytes"] == sum(all_gather_bytes(s, None, WORLD) for s in weights)
        assert g["fp8_bytes"] <= 0.55 * g["bf16_bytes"], (g["fp8_bytes"], g["bf16_bytes"])
        assert not g["warned"]
        # one amax all-reduce per unit gathered (per-tensor scaling), none for 128x128 tiles; delayed scaling adds
        # its histories' reduction at each of the two steps' autocast exits
        reductions = {"fp8-current": g["gathers"], "fp8-delayed": g["gathers"] + 2, "fp8-block": 0}[recipe]
        assert g["amax_reductions"] == reductions, g
        if recipe == "fp8-block":  # (SGD writes no copies: every later gather quantizes its shards)
            assert g["quantized_later"] > 0 and g["fused"] is None, g


def _check_adamw_copies_gathered(tmp_path, device):
    """lowbit AdamW on the FSDP2 shards: its kernel updates each shard and writes the shard's FP8 copies, which the
    later gathers move instead of quantizing the shard; three steps equal the unsharded run with the same optimizer
    (whose forward takes the copies it writes) bit for bit."""
    got = _spawn_and_compare(tmp_path, "fp8-block", (256, 256), device, optimizer="adamw")
    for g in got:
        assert g["fused"] == 2, g  # (both weights' shards updated in the quantizing kernel)
        assert g["quantized_later"] == 0, g


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
@pytest.mark.parametrize("recipe", ["fp8-block", "fp8-current", "fp8-delayed"])
def test_fp8_all_gather_matches_unsharded(tmp_path, recipe):
    _check_fp8_gather(tmp_path, recipe, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2 and dist.is_nccl_available()),
                    reason="needs 2 CUDA GPUs and NCCL")
@pytest.mark.parametrize("recipe", ["fp8-block", "fp8-current", "fp8-delayed"])
def test_fp8_all_gather_matches_unsharded_gpu(tmp_path, recipe):
    """The same over NCCL on 2 GPUs with lowbit's GPU quantizers and GEMMs (the reference run on cuda:0)."""
    _check_fp8_gather(tmp_path, recipe, "cuda")


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_adamw_writes_the_shard_copies_the_gather_takes(tmp_path):
    """On the CPU the quantizing AdamW kernel runs in Triton's interpreter: the check runs in a subprocess with
    TRITON_INTERPRET=1 (its gloo workers inherit it)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    here = os.path.dirname(__file__)  # (and tests/, for testenv)
    code = ("import sys, pathlib; sys.path[:0] = [%r, %r]; import test_fp8_all_gather as t; "
            "t._check_adamw_copies_gathered(pathlib.Path(%r), 'cpu'); print('ok')"
            % (here, os.path.dirname(here), str(tmp_path)))
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2 and dist.is_nccl_available()),
                    reason="needs 2 CUDA GPUs and NCCL")
def test_adamw_writes_the_shard_copies_the_gather_takes_gpu(tmp_path):
    _check_adamw_copies_gathered(tmp_path, "cuda")


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_fp8_current_reduces_amaxes_once_per_unit(tmp_path):
    """One ``fully_shard`` unit holding both weights: each gather runs one amax all-reduce for the two of them (a
    reduction per weight ran two), and the run stays bit-identical to the unsharded one."""
    got = _spawn_and_compare(tmp_path, "fp8-current", (256, 256), units="root")
    for g in got:
        assert g["plan"] == {"0.weight": None, "2.weight": None}
        assert g["kinds"] == {0: GatheredFloat8Weight.__name__, 2: GatheredFloat8Weight.__name__}
        assert g["gathers"] >= 2 and g["amax_reductions"] == g["gathers"], g  # (2 weights a gather)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_fp8_all_gather_falls_back_where_shards_are_not_whole_tiles(tmp_path):
    # fc1's weight (192, 256): 96-row shards cut 128x128 tiles -> high-precision gather; fc2's (256, 192): FP8
    got = _spawn_and_compare(tmp_path, "fp8-block", (256, 192))
    for g in got:
        assert g["plan"]["2.weight"] is None and "128-row tiles" in g["plan"]["0.weight"]
        assert g["kinds"] == {0: "Parameter", 2: GatheredFloat8Weight.__name__}
        assert any("high precision" in w and "(192, 256)" in w for w in g["warned"])
        r = from_name("fp8-block")
        assert g["fp8_bytes"] == all_gather_bytes((192, 256), r, WORLD) + all_gather_bytes((256, 192), r, WORLD)
        assert all_gather_bytes((192, 256), r, WORLD) == 192 * 256 * 4


def test_fp8_all_gather_declines_other_recipes_and_checks_args():
    m = _model((256, 256))
    with pytest.warns(UserWarning, match="high precision"):
        plan = lowbit.nn.fp8_all_gather(m, from_name("mxfp8"))
    assert "DelayedScaling" in plan["0.weight"]
    assert set(plan) == {"0.weight", "2.weight"} and all("MXFP8" in v for v in plan.values())
    assert type(m[0].weight) is torch.nn.Parameter
    with pytest.raises(TypeError, match="recipe"):
        lowbit.nn.fp8_all_gather(m, "fp8-block")
    with pytest.raises(TypeError, match="model"):
        lowbit.nn.fp8_all_gather(m.state_dict(), from_name("fp8-block"))


def test_fp8_all_gather_unsharded_model_is_unchanged():
    """The wrapped weights behave as the plain ones outside FSDP2 (one process): same outputs and gradients."""
    ref_outs, ref_losses, ref_grads = _run(_model((256, 256)), "fp8-block")
    m = _model((256, 256))
    plan = lowbit.nn.fp8_all_gather(m, from_name("fp8-block"), 1)
    assert plan == {"0.weight": None, "2.weight": None}
    outs, losses, grads = _run(m, "fp8-block")
    assert all(torch.equal(a, b) for a, b in zip(ref_outs + ref_losses, outs + losses))
    assert all(torch.equal(ref_grads[n], grads[n]) for n in ref_grads)


def _compile_worker(rank, tmp):
    """One rank's run (under ``gloo_process``)."""
    import torch._dynamo.utils as dynamo_utils
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(1))

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(lowbit.nn.LayerNormMLP(256, 256, normalization="RMSNorm", activation="swiglu",
                                                          bias=False))

    got = {}
    for kind, build in (("linear", lambda: _model((256, 256))), ("swiglu_mlp", mlp)):
        for mode in ("eager", "compile"):
            model = build()
            lowbit.nn.fp8_all_gather(model, from_name("fp8-current"), mesh)
            for layer in model:
                if isinstance(layer, lowbit.nn.base.LowbitModule):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            torch.compiler.reset()
            dynamo_utils.counters.clear()
            with lowbit.autocast(recipe=from_name("fp8-current")):
                y = (torch.compile(model) if mode == "compile" else model)(x)
            y.float().sum().backward()
            breaks = [str(k) for k in dynamo_utils.counters["graph_break"]]
            # (the gathered weights' gradients; an unfused RMSNorm's weight is Inductor's arithmetic when compiled)
            grads = [p.grad.full_tensor() for n, p in model.named_parameters() if "norm" not in n]
            got[kind, mode] = (y.detach(), grads, breaks)
    torch.save(got, f"{tmp}/rank{rank}.pt")


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_compiled_model_runs_gathered_layers_eager(tmp_path):
    """torch.compile over layers whose weights FSDP2 gathers as FP8 copies (a tensor subclass Dynamo cannot trace), a
    Linear pair and a SwiGLU LayerNormMLP: the graph breaks at one disabled call that runs the layer eager, named in
    Dynamo's graph-break reasons, and nothing inside lowbit breaks it elsewhere; outputs and the gathered weights'
    gradients equal the uncompiled run's."""
    mp.spawn(gloo_process, args=(str(tmp_path), WORLD, _compile_worker), nprocs=WORLD, join=True)
    for r in range(WORLD):
        got = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        for kind in ("linear", "swiglu_mlp"):
            (y0, g0, _), (y1, g1, breaks) = got[kind, "eager"], got[kind, "compile"]
            assert torch.equal(y0, y1) and len(g0) == len(g1) >= 2, (r, kind)
            assert all(torch.equal(a, b) for a, b in zip(g0, g1)), f"rank {r} {kind}: gradients differ from eager"
            ours = [b for b in breaks if "_gathered_fp8_weight_runs_eager" in b]
            fsdp = [b for b in breaks if "qualname: disable" in b]  # (FSDP2's own hooks: torch._dynamo.disable)
            assert len(ours) == 1 and len(ours) + len(fsdp) == len(breaks), (kind, breaks)


def test_optimizer_copies_box_is_shared_by_views_and_cleared_by_writes():
    """``Float8AllGatherWeight.lowbit_fresh``: the optimizer's copies and whether they hold the weight's values; views
    (what FSDP2 and ``DTensor.to_local`` make) share it, new tensors (clone, new_zeros) start empty, and an in-place
    write through torch clears ``valid`` for every view."""
    from lowbit.nn.fsdp import Float8AllGatherWeight

    sch = from_name("fp8-block").role("weight").scheme
    w = Float8AllGatherWeight(torch.randn(256, 128), sch)
    assert w.lowbit_fresh == [None, False]
    w.lowbit_fresh[:] = ["copies", True]
    v = w.view_as(w)
    n = w.narrow(0, 0, 128)
    assert v.lowbit_fresh is w.lowbit_fresh and n.lowbit_fresh is w.lowbit_fresh
    assert w.detach().lowbit_fresh is w.lowbit_fresh
    assert w.clone().lowbit_fresh == [None, False] and w.new_zeros(4, 4).lowbit_fresh == [None, False]
    with torch.no_grad():
        n.mul_(2.0)  # (a write through one view)
    assert w.lowbit_fresh == ["copies", False]
    w.lowbit_fresh[1] = True
    w.sum()  # (reads leave it)
    assert w.lowbit_fresh[1]
    with torch.no_grad():
        w.copy_(torch.zeros(256, 128))
    assert not v.lowbit_fresh[1]
