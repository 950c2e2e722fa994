"""Weight gradients on a side CUDA stream (lowbit.nn.functional.wgrad_on_side_stream): the same bits as on one
stream, eagerly and inside a captured CUDA graph, with and without gradient accumulation."""

from __future__ import annotations

import pytest
import torch
from testenv import group_process

import lowbit
from lowbit import recipes
from lowbit.nn.functional import _SIDE, _side_stream, wgrad_on_side_stream
from lowbit.runtime.device import stream_apart


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


class _PoolStream:
    """torch.cuda.Stream faked as torch's pool: ``size`` streams handed out in turn, equal where their slot is."""

    size, drawn = 32, 0

    def __init__(self, device=None):
        self.slot = _PoolStream.drawn % _PoolStream.size
        _PoolStream.drawn += 1

    def __eq__(self, other):
        return isinstance(other, _PoolStream) and other.slot == self.slot

    __hash__ = None


def test_side_stream_is_never_the_calling_stream(monkeypatch):
    """torch.cuda.Stream() hands out its pool's 32 streams in turn, so a stream drawn for the weight gradients can be
    the one the backward runs on (torch.cuda.graph's capture stream comes from the same pool), and the gradients then
    run after its work instead of beside it. With the pool faked: stream_apart draws past the streams to avoid; the
    cached side stream is drawn again where it is the calling stream; a pool of one stream raises."""
    monkeypatch.setattr(torch.cuda, "Stream", _PoolStream)
    monkeypatch.setattr(_PoolStream, "drawn", 5)
    main = _PoolStream()  # slot 5
    monkeypatch.setattr(_PoolStream, "drawn", 5 + 32)  # the pool's next stream is main again
    assert stream_apart("cuda:0", main).slot == 6
    monkeypatch.setattr(_PoolStream, "drawn", 6)
    a, b = _PoolStream(), _PoolStream()  # slots 6 and 7
    monkeypatch.setattr(_PoolStream, "drawn", 6 + 32)  # the next two are a and b
    assert stream_apart("cuda:0", a, b).slot == 8
    dev = torch.device("cuda", 0)
    monkeypatch.setitem(_SIDE["streams"], dev, main)
    monkeypatch.setattr(_PoolStream, "drawn", 5)
    side = _side_stream(dev, main)
    assert side != main and _SIDE["streams"][dev] is side
    assert _side_stream(dev, _PoolStream()) is side  # (cached while it is not the calling stream)
    monkeypatch.setattr(_PoolStream, "size", 1)
    with pytest.raises(RuntimeError, match="stream_apart: 2 streams drawn from torch's pool"):
        stream_apart("cuda:0", _PoolStream())


@pytest.mark.gpu
def test_stream_pool_wraps_and_the_side_stream_avoids_it(cuda):
    """The premise on the GPU: the 33rd stream drawn from torch's pool is the first again, and stream_apart skips it.
    A backward running on the very stream cached as the side stream puts its weight gradients on another one, with
    the same gradients as one stream."""
    dev = torch.device("cuda", torch.cuda.current_device())
    s0 = torch.cuda.Stream(dev)
    for _ in range(31):
        torch.cuda.Stream(dev)
    assert torch.cuda.Stream(dev) == s0  # (torch's pool: 32 streams a priority, in turn)
    for _ in range(31):
        torch.cuda.Stream(dev)
    assert stream_apart(dev, s0) != s0
    recipe = recipes.from_name("fp8-block")
    idx = torch.randint(0, 256, (2, 257), device=dev, generator=torch.Generator(dev).manual_seed(2))
    grads = []
    for side in (False, True):
        m = _model(dev)
        saved = _SIDE["streams"].get(dev)
        _SIDE["streams"][dev] = s0
        try:
            s0.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(s0), wgrad_on_side_stream(side):
                _fwd_bwd(m, idx, recipe)
            torch.cuda.synchronize()
            assert (_SIDE["streams"][dev] != s0) == side
        finally:
            if saved is None:
                _SIDE["streams"].pop(dev, None)
            else:
                _SIDE["streams"][dev] = saved
        grads.append([p.grad.clone() for p in m.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    lowbit.nn.nonfinite_events()


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


# ------------------------------------------------------------------------------------------------
# FSDP2: each unit's post-backward waits for its weight gradients (fsdp_wgrad_joins)
# ------------------------------------------------------------------------------------------------
WORLD = 2


def test_join_and_fsdp_joins_check_their_arguments():
    from lowbit.nn.functional import fsdp_wgrad_joins, join_wgrad_side_stream

    with pytest.raises(TypeError, match="x: expected a tensor, got list"):
        join_wgrad_side_stream([1.0])
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module, got dict"):
        fsdp_wgrad_joins({})
    with pytest.raises(ValueError, match="no fully_shard unit"):
        fsdp_wgrad_joins(torch.nn.Linear(4, 4))
    x = torch.randn(3, 5, requires_grad=True)
    y = join_wgrad_side_stream(x)
    assert type(y.grad_fn).__name__ == "_JoinWgradSideBackward" and torch.equal(y, x)
    (y * 2).sum().backward()  # (off CUDA, and with the side stream off, the backward passes the gradient on)
    assert torch.equal(x.grad, torch.full_like(x, 2.0))
    z = torch.randn(2)
    assert join_wgrad_side_stream(z) is z  # (nothing to join where no gradient flows)


def _fsdp_worker(rank, tmp, device, sleep_cycles):
    """One rank's run (under ``group_process``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import lowbit.nn.functional as F

    if sleep_cycles:  # every weight-gradient GEMM starts late: a post-backward not waiting for it reads garbage
        orig = F.wgrad_mm

        def late(*a, **k):
            torch.cuda._sleep(sleep_cycles)
            return orig(*a, **k)

        F.wgrad_mm = late
    mesh = init_device_mesh(device, (WORLD,))
    recipe = recipes.from_name("fp8-block")
    idx = torch.randint(0, 256, (2, 129), generator=torch.Generator().manual_seed(1 + rank)).to(device)
    out = {}
    for name, side, joins in (("ref", False, False), ("side", True, True), ("unjoined", True, False)):
        if name == "unjoined" and not sleep_cycles:
            continue
        m = _model(device)
        for blk in m.blocks:
            fully_shard(blk, mesh=mesh)
        fully_shard(m, mesh=mesh)
        seen = {}
        if joins:
            F.fsdp_wgrad_joins(m)
            # (registered after the joins: sees what the block's forward gets)
            def probe(mod, args):
                seen.setdefault("grad_fn", type(args[0].grad_fn).__name__)
                # (the unsharded parameters FSDP2 has swapped in: the root's and this block's)
                seen.setdefault("here", sorted(
                    f"{mn}.{pn}" for mn, sub in m.named_modules() for pn, p in sub.named_parameters(recurse=False)
                    if getattr(p, "lowbit_wgrad_here", False)))

            m.blocks[0].register_forward_pre_hook(probe)
        for _ in range(2):
            with wgrad_on_side_stream(side):
                _fwd_bwd(m, idx, recipe)
            if device == "cuda":
                torch.cuda.synchronize()
            grads = {k: p.grad.to_local().clone() for k, p in m.named_parameters()}
            for p in m.parameters():
                p.grad = None
        out[name] = dict(grads=grads, seen=seen,
                         root_own=sorted(k for k, _ in m.named_parameters(remove_duplicate=False)
                                        if not k.startswith("blocks.")))
    torch.save(out, f"{tmp}/rank{rank}.pt")


def _fsdp_joins_check(tmp_path, device, sleep_cycles=0):
    import torch.multiprocessing as mp

    mp.spawn(group_process, args=(str(tmp_path), WORLD, device, _fsdp_worker, device, sleep_cycles), nprocs=WORLD,
             join=True)
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for g in got:
        ref, side = g["ref"]["grads"], g["side"]["grads"]
        assert ref.keys() == side.keys()
        for k in ref:
            assert torch.equal(ref[k], side[k]), k
        assert g["side"]["seen"]["grad_fn"] == "_JoinWgradSideBackward"
        assert g["side"]["seen"]["here"] == g["side"]["root_own"] and g["side"]["root_own"], g["side"]["seen"]
    return got


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available")
def test_fsdp_wgrad_joins_change_no_bits_on_cpu(tmp_path):
    """FSDP2 (2 gloo processes), a GPT with each block and the root sharded: with the joins the gradients are those
    without, bit for bit; each block's forward gets its input through the join; the root's own parameters (fed token
    ids, it is reduced in FSDP2's final callback) are flagged to keep their weight gradients on the calling stream,
    no block's are."""
    _fsdp_joins_check(tmp_path, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2), reason="needs 2 CUDA GPUs")
def test_fsdp_post_backward_waits_for_side_stream_gradients_gpu(tmp_path):
    """The same over NCCL on 2 GPUs with the weight gradients on the side stream, each GEMM delayed (~10 ms of
    spinning first): FSDP2's reduce-scattered gradients equal the one-stream run's bit for bit with the joins, and
    differ without them (its post-backward then reads gradients not yet written)."""
    got = _fsdp_joins_check(tmp_path, "cuda", sleep_cycles=20_000_000)
    for g in got:
        ref, bad = g["ref"]["grads"], g["unjoined"]["grads"]
        assert any(not torch.equal(ref[k], bad[k]) for k in ref), "the delayed GEMMs were waited for without joins"
