"""GPU checks of the lowbit.nn modules (skipped without CUDA): the fast backends behind quantize /
scaled_mm give the numbers of the CPU references, and training state works on the device."""

from __future__ import annotations

import pytest
import torch
from nn_helpers import RECIPES, sqnr

import lowbit
from lowbit import recipes
from lowbit.runtime import env

pytestmark = pytest.mark.gpu


def _step(m, x, G, recipe):
    x = x.clone().requires_grad_()
    m.zero_grad()
    with lowbit.autocast(recipe=recipe):
        y = m(x)
    (y.float() * G).sum().backward()
    return y.detach(), x.grad.detach(), m.weight.grad.detach()


@pytest.mark.parametrize("rname", list(RECIPES))
def test_cuda_matches_cpu_reference(rname, cuda):
    """Deterministic recipes: GPU and CPU quantize identically, so outputs and gradients differ only by
    the FP32 accumulation order of the GEMM (NUMERICS §5) -> > 60 dB agreement (FP32 outputs)."""
    torch.manual_seed(0)
    recipe = RECIPES[rname]()
    if rname == "nvfp4":  # stochastic rounding draws its seeds from the device RNG: compare the RN variant
        recipe = recipes.NVFP4BlockScaling(disable_stochastic_rounding=True)
    m = lowbit.nn.Linear(256, 384)
    x = torch.randn(4, 64, 256)
    G = torch.randn(4, 64, 384)
    mc = lowbit.nn.Linear(256, 384, device=cuda)
    mc.load_state_dict(m.state_dict())  # before any step: both start from the same (empty) scaling state
    ref = _step(m, x, G, recipe)
    got = _step(mc, x.to(cuda), G.to(cuda), recipe)
    for name, a, b in zip(("y", "dx", "dw"), got, ref):
        s = sqnr(a.cpu(), b)
        assert s > 60, f"{rname} {name}: GPU vs CPU reference SQNR {s:.1f} dB"


@pytest.mark.parametrize("rname", list(RECIPES))
def test_cuda_bf16_against_high_precision(rname, cuda):
    torch.manual_seed(1)
    m = lowbit.nn.Linear(512, 768, device=cuda, dtype=torch.bfloat16)
    x = torch.randn(8, 128, 512, device=cuda, dtype=torch.bfloat16)
    G = torch.randn(8, 128, 768, device=cuda)
    y, dx, dw = _step(m, x, G, RECIPES[rname]())
    w = m.weight.detach().float()
    yr = x.float() @ w.t() + m.bias.detach().float()
    floor = {"nvfp4": 12.0}.get(rname, 21.0)  # CPU floors (fp32 I/O) minus ~1-3 dB for BF16 rounding of I/O
    assert sqnr(y.float(), yr) > floor
    assert sqnr(dx.float(), G @ w) > floor - 3
    assert sqnr(dw.float(), G.reshape(-1, 768).t() @ x.float().reshape(-1, 512)) > floor - 3


def test_cuda_delayed_state_and_sentry(cuda, tmp_path):
    m = lowbit.nn.Linear(128, 128, device=cuda)
    r = recipes.DelayedScaling(amax_history_len=4)
    for _ in range(3):
        _step(m, torch.randn(64, 128, device=cuda), torch.randn(64, 128, device=cuda), r)
    sd = m.state_dict()
    assert sd["_extra_state"]["input.history"].device.type == "cuda"
    torch.save(sd, tmp_path / "m.pt")
    m2 = lowbit.nn.Linear(128, 128, device=cuda)
    m2.load_state_dict(torch.load(tmp_path / "m.pt", weights_only=True))
    x = torch.randn(64, 128, device=cuda)
    with lowbit.autocast(recipe=r):
        assert torch.equal(m(x), m2(x))
    x[0, 0] = float("nan")
    # on CUDA the exit queues the check without waiting: the fault is raised there if the GPU has already
    # finished the step, else at a later check point; nonfinite_events() waits for every pending check
    from lowbit.nn import state

    raised = None
    try:
        with lowbit.autocast(recipe=r):
            m(x)
    except lowbit.nn.NonFiniteAmaxError as e:
        raised = e
    ev = lowbit.nn.nonfinite_events()
    got = [(raised.role, raised.phase)] if raised is not None else [(e.role, e.phase) for e in ev]
    assert got == [("input", "forward")] and state.pending_checks() == 0
    # LOWBIT_SENTRY_SYNC=1: each check waits, so the exit of the faulty step raises
    with env.override(LOWBIT_SENTRY_SYNC=True):
        with pytest.raises(lowbit.nn.NonFiniteAmaxError, match="of input"):
            with lowbit.autocast(recipe=r):
                m(x)
    # many steps in flight: the pinned slots are reused, nothing is lost
    for _ in range(3 * state._ring.n):
        with lowbit.autocast(recipe=r):
            m(torch.randn(64, 128, device=cuda))
    assert lowbit.nn.nonfinite_events() == [] and state.pending_checks() == 0


def test_bench_runs_on_cuda(cuda, capsys):
    from lowbit.bench import linear

    assert linear.main(["--shapes", "256x256x512", "--rep", "5", "--warmup", "2", "--no-torchao"]) == 0
    out = capsys.readouterr().out
    assert "| lowbit fp8-block |" in out


@pytest.mark.parametrize("rname", ["fp8-current", "fp8-block", "mxfp8"])
def test_cuda_cached_weights(rname, cuda):
    """lowbit.nn.cached_weights on the GPU path (Triton / cuBLAS): BF16 weights as an inference model has them,
    kept copies give the bits of fresh ones; an in-place update is seen."""
    torch.manual_seed(0)
    m = lowbit.nn.LayerNormMLP(256, 384, activation="swiglu", normalization="RMSNorm", device=cuda,
                               dtype=torch.bfloat16)
    x = torch.randn(3, 32, 256, device=cuda, dtype=torch.bfloat16)  # (MXFP8: tokens a multiple of 32)
    r = recipes.from_name(rname)

    def run():
        with torch.inference_mode(), lowbit.autocast(recipe=r):
            return m(x)

    fresh = run()
    with lowbit.nn.cached_weights(m) as kept:
        a, b = run(), run()
        with torch.no_grad():
            m.fc1_weight.mul_(0.5)
        c = run()
    assert kept.reused == 2 + 1  # both GEMMs on the second call; fc2 on the third
    assert torch.equal(a, fresh) and torch.equal(b, fresh)
    assert torch.equal(c, run()) and not torch.equal(c, fresh)


def test_cuda_cached_weights_compiled_graphs(cuda):
    """cached_weights under torch.compile(mode="reduce-overhead") (CUDA graph trees): warm-up, recording and replays
    take the copy the block's eager call kept (its bits); a weight changed between blocks is written into the copy
    the graph replays when the next block is entered, with no eager call in that block; one pinned copy throughout."""
    torch.manual_seed(0)
    m = lowbit.nn.Linear(256, 384, device=cuda, dtype=torch.bfloat16)
    r = recipes.from_name("fp8-block")
    x = torch.randn(16, 256, device=cuda, dtype=torch.bfloat16)
    f = torch.compile(m, mode="reduce-overhead")
    g = m._gemms[""]

    def call(fn):
        with torch.no_grad(), lowbit.autocast(recipe=r):
            return fn(x).clone()

    torch.compiler.reset()
    try:
        with lowbit.nn.cached_weights(m) as kept:
            ref = call(m)  # eager: quantized and kept
            outs = [call(f) for _ in range(4)]  # warm-up, recording, replays
        assert kept.reused >= 2 and all(torch.equal(o, ref) for o in outs) and len(g.graph_pins) == 1
        quantized, real = [0], g.quantize

        def counted(*a, **k):
            quantized[0] += 1
            return real(*a, **k)

        for _ in range(2):
            with torch.no_grad():
                m.weight.mul_(-0.5)  # an optimizer step between two evaluations
            fresh = call(m)  # outside a block: quantized afresh
            g.quantize, quantized[0] = counted, 0
            with lowbit.nn.cached_weights(m):
                outs = [call(f) for _ in range(2)]  # replays only
            del g.quantize
            assert quantized[0] == 1  # the pinned copy written on entry; no graph recorded again (it would quantize)
            assert all(torch.equal(o, fresh) for o in outs) and not torch.equal(fresh, ref)
            assert len(g.graph_pins) == 1
    finally:
        m.clear_weight_cache()
        torch.compiler.reset()
