"""Weight gradients on a side CUDA stream (lowbit.nn.functional.wgrad_on_side_stream): the same bits as on one
stream, eagerly and inside a captured CUDA graph, with and without gradient accumulation."""

from __future__ import annotations

import pytest
import torch

import lowbit
from lowbit import recipes
from lowbit.nn.functional import _SIDE, wgrad_on_side_stream


def _model(device):
    from lowbit.models import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, n_layer=2, n_head=4, d_model=256, ffn_hidden=512, max_seq_len=256)
    return GPT(cfg).to(device)


def _fwd_bwd(model, idx, recipe):
    with torch.autocast(idx.device.type, dtype=torch.bfloat16), lowbit.autocast(recipe=recipe):
        _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    return loss.detach()


def test_context_nests_and_changes_nothing_off_cuda():
    """On the CPU the context is inert (the same gradients); it restores the previous setting on exit, nested too."""
    recipe = recipes.from_name("fp8-block")
    idx = torch.randint(0, 256, (1, 129), generator=torch.Generator().manual_seed(1))
    grads = {}
    for on in (False, True):
        m = _model("cpu")
        with wgrad_on_side_stream(on):
            _fwd_bwd(m, idx, recipe)
        grads[on] = [p.grad for p in m.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))
    assert _SIDE["on"] is False
    with wgrad_on_side_stream():
        with wgrad_on_side_stream(False):
            assert _SIDE["on"] is False
        assert _SIDE["on"] is True
    assert _SIDE["on"] is False and _SIDE["join"] is None


def test_side_carveout_default_and_setting(switches):
    """The SMs the side-stream weight gradients leave to the main stream: 32 of 132 by default (as measured on Hopper)
    and the same fraction elsewhere, LOWBIT_WGRAD_SM_CARVEOUT=N as given, at most half the SMs, bad values named."""
    from lowbit.nn.functional import side_carveout

    switches(LOWBIT_WGRAD_SM_CARVEOUT=None)
    assert side_carveout(132) == 32 and side_carveout(114) == 28 and side_carveout(78) == 19 and side_carveout(1) == 0
    switches(LOWBIT_WGRAD_SM_CARVEOUT="0")
    assert side_carveout(132) == 0
    switches(LOWBIT_WGRAD_SM_CARVEOUT="16")
    assert side_carveout(132) == 16
    switches(LOWBIT_WGRAD_SM_CARVEOUT="100")
    assert side_carveout(132) == 66
    for bad in ("-1", "many", "1.5"):
        with pytest.raises(ValueError, match="LOWBIT_WGRAD_SM_CARVEOUT: expected a number of SMs"):
            switches(LOWBIT_WGRAD_SM_CARVEOUT=bad)


@pytest.mark.gpu
def test_side_stream_same_bits_eager_accumulated_and_captured(cuda):
    """fp8-block GPT, every parameter gradient: on the side stream equal to one stream bit for bit, eagerly (one
    micro-batch, and two accumulated: the second runs on the main stream, the weights' .grad being set) and from a
    CUDA graph captured with the side stream on (the lowbit train set-up: gradients None at capture), replayed. The
    side-stream GEMMs run with cuBLAS's SM carveout (default 32 SMs left out): other kernels, the same bits."""
    recipe = recipes.from_name("fp8-block")
    gen = torch.Generator(cuda).manual_seed(1)
    idx = [torch.randint(0, 256, (2, 257), device=cuda, generator=gen) for _ in range(2)]

    def eager(side, n):
        m = _model(cuda)
        for i in range(n):
            with wgrad_on_side_stream(side):
                _fwd_bwd(m, idx[i], recipe)
        torch.cuda.synchronize()
        return {k: p.grad.clone() for k, p in m.named_parameters()}

    for n in (1, 2):
        ref, got = eager(False, n), eager(True, n)
        for k in ref:
            assert torch.equal(ref[k], got[k]), (n, k)
    assert _SIDE["join"] is None

    ref = eager(False, 1)
    m = _model(cuda)
    static = idx[0].clone()
    s = torch.cuda.Stream(cuda)
    s.wait_stream(torch.cuda.current_stream(cuda))
    with torch.cuda.stream(s):
        for _ in range(2):  # warm-up (autotuning, plan caches) off the capture
            _fwd_bwd(m, static, recipe)
            for p in m.parameters():
                p.grad = None
    torch.cuda.current_stream(cuda).wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), wgrad_on_side_stream():
        _fwd_bwd(m, static, recipe)
    for _ in range(2):
        g.replay()
        torch.cuda.synchronize()
        for k, p in m.named_parameters():
            assert torch.equal(ref[k], p.grad), k
    lowbit.nn.nonfinite_events()
    # the SM carveout asked of cuBLAS for the side-stream GEMMs (LOWBIT_WGRAD_SM_CARVEOUT) is undone after each one:
    # the main stream's GEMMs keep every SM
    assert torch._C._get_sm_carveout_experimental() is None
