"""Weight gradients on a side CUDA stream (lowbit.nn.functional.wgrad_on_side_stream): the same bits as on one
stream, eagerly and inside a captured CUDA graph, with and without gradient accumulation; their norms taken there
(SideGradNorms) and combined with the other gradients' into the clipping norm (lowbit.train.loop._total_norm)."""

from __future__ import annotations

import pytest
import torch

import lowbit
from lowbit import recipes
from lowbit.nn.functional import _SIDE, SideGradNorms, wgrad_on_side_stream
from lowbit.train.loop import _GraphedStep, _total_norm


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


@pytest.mark.gpu
def test_side_stream_same_bits_eager_accumulated_and_captured(cuda):
    """fp8-block GPT, every parameter gradient: on the side stream equal to one stream bit for bit, eagerly (one
    micro-batch, and two accumulated: the second runs on the main stream, the weights' .grad being set) and from a
    CUDA graph captured with the side stream on (the lowbit train set-up: gradients None at capture), replayed."""
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


class _RecordingMatmul(torch.autograd.Function):
    """x·wᵀ whose backward records its weight gradient in a SideGradNorms, as _wgrad does on the side stream."""

    @staticmethod
    def forward(ctx, x, w, norms):
        ctx.save_for_backward(x, w)
        ctx.norms = norms
        return x @ w.t()

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dw = dy.t() @ x
        ctx.norms.record(w, dw)
        return dy @ w, dw, None


def test_side_grad_norms_keep_only_final_gradients():
    """SideGradNorms.final keeps a weight's recorded norm only where that gradient became its .grad unchanged: one
    use (kept, equal to the norm of .grad); two recorded GEMMs on one weight (dropped); the weight also used outside
    a recorded GEMM, so autograd sums another gradient into it, in place or into a new tensor (dropped); a second
    backward accumulating into .grad (dropped); no gradient, or a parameter never recorded (None)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4, generator=gen)
    ws = [torch.nn.Parameter(torch.randn(3, 4, generator=gen)) for _ in range(6)]
    once, twice, tied_after, tied_before, accumulated, no_grad = ws
    n = SideGradNorms()
    loss = (_RecordingMatmul.apply(x, once, n).sum()
            + _RecordingMatmul.apply(x, twice, n).sum() + _RecordingMatmul.apply(x, twice, n).square().sum()
            + _RecordingMatmul.apply(x, tied_after, n).sum() + (tied_after * 2).sum()
            + (tied_before * 2).sum() + _RecordingMatmul.apply(x, tied_before, n).sum()
            + _RecordingMatmul.apply(x, accumulated, n).sum())
    loss.backward()
    _RecordingMatmul.apply(x, accumulated, SideGradNorms()).sum().backward()  # a second micro-batch
    stranger = torch.nn.Parameter(torch.randn(3, 4, generator=gen))
    stranger.grad = torch.ones(3, 4)
    assert len(n) == 5
    got = n.final(ws + [stranger])
    assert got[0] is not None and got[0].dtype == torch.float32 and got[0].dim() == 0
    torch.testing.assert_close(got[0], torch.linalg.vector_norm(once.grad), rtol=0, atol=0)
    assert got[1:] == [None] * 6
    # (the partial gradients were finite and non-zero: a norm was dropped for the guard, not for want of one)
    assert all(w.grad is not None and bool(w.grad.abs().sum() > 0) for w in ws[:5]) and no_grad.grad is None


def test_side_grad_norms_record_nothing_off_cuda():
    """On the CPU no weight gradient runs on a side stream, so none is recorded; the context restores the previous
    collector on exit and refuses anything but a SideGradNorms."""
    recipe = recipes.from_name("fp8-block")
    idx = torch.randint(0, 256, (1, 129), generator=torch.Generator().manual_seed(1))
    n = SideGradNorms()
    m = _model("cpu")
    with wgrad_on_side_stream(True, grad_norms=n):
        assert _SIDE["norms"] is n
        with wgrad_on_side_stream(False):
            assert _SIDE["norms"] is None
        assert _SIDE["norms"] is n
        _fwd_bwd(m, idx, recipe)
    assert len(n) == 0 and _SIDE["norms"] is None
    assert n.final(list(m.parameters())) == [None] * len(list(m.parameters()))
    with pytest.raises(TypeError, match="grad_norms: expected a SideGradNorms"):
        wgrad_on_side_stream(True, grad_norms=[])


def test_total_norm_equals_get_total_norm():
    """The clipping norm from precomputed per-tensor norms plus the remaining gradients equals
    torch.nn.utils.get_total_norm over all of them (FP32: to the order of the reductions, rtol 1e-6); a None gradient
    counts for nothing, even with a norm given for it; mismatched lists are refused; no gradient at all is 0."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(64, 32), (7,), (128, 128), (3, 5, 9), (1,), (256,), (33, 17)]
    grads = [torch.randn(s, generator=gen) * 10.0 ** (i - 3) for i, s in enumerate(shapes)]
    ref = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
    for pick in ([], [0], [0, 2, 3], list(range(len(grads)))):
        norms = [torch.linalg.vector_norm(g) if i in pick else None for i, g in enumerate(grads)]
        got = _total_norm(grads, norms, torch.device("cpu"))
        assert got.dtype == torch.float32 and got.dim() == 0
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)
    with_none = grads + [None]
    got = _total_norm(with_none, [None, torch.linalg.vector_norm(grads[1])] + [None] * (len(grads) - 2) + [torch.ones(())],
                      torch.device("cpu"))
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="norms: expected one entry"):
        _total_norm(grads, [None], torch.device("cpu"))
    assert float(_total_norm([None, None], [None, torch.ones(())], torch.device("cpu"))) == 0.0


@pytest.mark.gpu
def test_side_grad_norms_in_the_captured_step(cuda, monkeypatch):
    """fp8-block GPT through _GraphedStep (the lowbit train set-up: one micro-batch, the first update eager, then the
    update graph with clipping active) with the side-stream norms on and off (LOWBIT_SIDE_GRAD_NORM): on, every
    quantized weight's norm (2 layers x qkv, proj, fc1, fc2) is taken on the side stream and equals the norm of its
    .grad after each replay of the forward+backward graph; the gradients are bit for bit those of the off run (the
    same kernels; only a norm is added on the side stream); the clipping norm equals the off run's to FP32 reduction
    order (rtol 1e-5: both are sums of the same squares in different orders, each norm over ~1e5 elements, error of
    order log2(n) * 6e-8), and so do the parameters after the captured update (the clip scale differs by that
    rounding; AdamW's step then moves a parameter by lr * (1 + 1e-5) at most: a few FP32 ulps, rtol 1e-6)."""
    recipe = recipes.from_name("fp8-block")
    idx = torch.randint(0, 256, (2, 257), device=cuda, generator=torch.Generator(cuda).manual_seed(1))
    clip, lrs = 0.05, [1e-3, 2e-3, 3e-3]
    runs = {}
    for on in ("1", "0"):
        monkeypatch.setenv("LOWBIT_SIDE_GRAD_NORM", on)
        m = _model(cuda)
        params = list(m.parameters())
        opt = torch.optim.AdamW(params, lr=lrs[0], weight_decay=0.1, fused=True)

        def run_micro(xs, ys, loss_sum, m=m):
            loss_sum.zero_()
            loss_sum += _fwd_bwd(m, idx, recipe).double()

        gs = _GraphedStep(run_micro, 1, 2, 256, params, cuda)
        gs.capture()
        gs.replay()  # the loop's first step: the update eager (it creates AdamW's state)
        assert float(torch.nn.utils.clip_grad_norm_(params, clip)) > clip  # clipping is active
        opt.step()
        gs.capture_update(opt, clip, lrs[1])
        r = runs[on] = {"side": gs.side_norms(), "grads": [], "norm": [], "params": [], "loss": []}
        for lr in lrs[1:]:
            gs.set_lr(lr)
            gs.graph.replay()  # (the fused AdamW divides the gradients by the clip scale in place: read them first)
            torch.cuda.synchronize()
            r["grads"].append([p.grad.clone() for p in params])
            r["loss"].append(float(gs.loss_sum))
            if on == "1":
                for p, n in zip(params, gs.grad_norms):
                    if n is not None:
                        torch.testing.assert_close(n, torch.linalg.vector_norm(p.grad), rtol=1e-6, atol=0)
            gs.update.replay()
            torch.cuda.synchronize()
            assert not gs.skipped()
            r["norm"].append(gs.grad_norm.clone())
            r["params"].append([p.detach().clone() for p in params])
        gs.drop()
        assert gs.grad_norms is None and gs.grad_norm is None
    lowbit.nn.nonfinite_events()
    assert runs["1"]["side"] == 8 and runs["0"]["side"] == 0
    on, off = runs["1"], runs["0"]
    for a, b in zip(on["grads"][0], off["grads"][0]):  # (the first captured step: the same parameters)
        assert torch.equal(a, b)
    assert on["loss"][0] == off["loss"][0]
    torch.testing.assert_close(on["norm"][0], off["norm"][0], rtol=1e-5, atol=0)
    ref = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in off["grads"][0]]))
    torch.testing.assert_close(on["norm"][0].double(), ref, rtol=1e-5, atol=0)
    for a, b in zip(on["params"][0], off["params"][0]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)
