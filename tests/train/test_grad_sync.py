"""GradAllReduce (DDP's gradient averaging inside ``lowbit train``'s captured step) against the mean of the ranks'
own gradients: 2 gloo processes on the CPU, two accumulated micro-batches, a parameter the backward never reaches,
buckets of one gradient each and of all of them (one coalesced collective)."""

import os

import pytest
import torch
import torch.multiprocessing as mp

from lowbit.train.grad_sync import GradAllReduce, broadcast_parameters


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(13, 7)
        self.b = torch.nn.Linear(7, 3)
        self.unused = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _worker(rank: int, world: int, init: str, out: str, bucket_mb: float, reduce_dtype=None) -> None:
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.manual_seed(100 + rank)  # different weights per rank: broadcast_parameters makes them rank 0's
        net = _Net()
        broadcast_parameters(net)
        ref = _Net()
        ref.load_state_dict(net.state_dict())
        xs = [torch.randn(5, 13, generator=torch.Generator().manual_seed(7 * rank + m)) for m in range(2)]
        red = GradAllReduce(list(net.parameters()), bucket_mb=bucket_mb, reduce_dtype=reduce_dtype)
        loss = torch.zeros((), dtype=torch.float64)
        for m, x in enumerate(xs):
            if m == 1:
                red.arm()
            lm = net(x).square().mean()
            lm.backward()
            loss += lm.detach().double()
        red.finish(loss)
        for x in xs:  # this rank's own accumulated gradients, then their mean over the ranks by all_gather
            ref(x).square().mean().backward()
        mean = {}
        for n, p in ref.named_parameters():
            if p.grad is None:
                continue
            parts = [torch.empty_like(p.grad) for _ in range(world)]
            torch.distributed.all_gather(parts, p.grad)
            if reduce_dtype is None:
                mean[n] = torch.stack(parts).sum(0) / world
            else:  # each rank's gradient rounded, their sum rounded (two terms: one rounding), halved exactly
                mean[n] = ((parts[0].to(reduce_dtype) + parts[1].to(reduce_dtype)) / world).float()
        own = torch.zeros((), dtype=torch.float64)
        for x in xs:
            own += ref(x).square().mean().detach().double()
        torch.distributed.all_reduce(own)
        torch.save({"grads": {n: p.grad for n, p in net.named_parameters()}, "mean": mean, "loss": loss,
                    "own_loss": own, "w0": net.a.weight.detach().clone(), "sent": red.buckets_sent},
                   os.path.join(out, f"{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("bucket_mb, sent, reduce_dtype", [(1e-9, 4, None), (25.0, 1, None), (1e-9, 4, torch.bfloat16),
                                                      (25.0, 1, torch.bfloat16)])
def test_gradients_are_the_mean_over_ranks(tmp_path, bucket_mb, sent, reduce_dtype):
    """(reduce_dtype BF16: each bucket averaged as one BF16 buffer, the mean of the ranks' BF16-rounded gradients
    written back into the FP32 gradients)"""
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_worker, args=(2, init, str(tmp_path), bucket_mb, reduce_dtype), nprocs=2, join=True)
    r = [torch.load(tmp_path / f"{i}.pt") for i in range(2)]
    assert [res["sent"] for res in r] == [sent, sent]  # (the four gradients the backward reaches)
    assert torch.equal(r[0]["w0"], r[1]["w0"])  # rank 0's weights everywhere
    for res in r:
        assert res["grads"]["unused.weight"] is None and res["grads"]["unused.bias"] is None
        for n, m in res["mean"].items():
            # the same two-term sum divided by 2 on either side: equal to the last bit
            assert res["grads"][n].dtype == torch.float32 and torch.equal(res["grads"][n], m), n
            if reduce_dtype is not None:  # (the values are BF16's: rounding them again changes nothing)
                assert torch.equal(m, m.to(reduce_dtype).float()), n
        assert res["loss"] == res["own_loss"]
    assert all(torch.equal(r[0]["grads"][n], r[1]["grads"][n]) for n in r[0]["mean"])


def test_finish_without_arm_is_an_error():
    net = _Net()
    with pytest.raises(ValueError, match="params: no parameter requires a gradient"):
        GradAllReduce([p for p in net.parameters() if not p.requires_grad])
    for bad in (0, -1.0, True, "25"):
        with pytest.raises(ValueError, match="bucket_mb: expected a number of MiB > 0"):
            GradAllReduce(list(net.parameters()), bucket_mb=bad)
    with pytest.raises(ValueError, match="reduce_dtype: expected None, torch.float32 or torch.bfloat16, got "
                                         "torch.float16"):
        GradAllReduce(list(net.parameters()), reduce_dtype=torch.float16)
    red = GradAllReduce(list(net.parameters()))
    with pytest.raises(RuntimeError, match="arm"):
        red.finish()
    red.remove()
    assert not red.hooks
