"""Data-parallel gradient averaging that a CUDA graph can capture: ``lowbit train``'s DDP step under graphs.

``torch.nn.parallel.DistributedDataParallel`` keeps its reducer on the host (buckets rebuilt, unused parameters
searched, work handles queued to a watchdog), which a captured step would freeze half-way. :class:`GradAllReduce`
does the one thing the step needs: when the last micro-batch's backward has accumulated a parameter's gradient, that
gradient is averaged across the group (an all-reduce, ``ReduceOp.AVG``) behind the work that produced it, while the
backward goes on with the layers below. Every rank runs the same model, so its gradients become ready in the same
order and the collectives match rank for rank. Inside ``torch.cuda.graph`` the collectives are captured with the
rest of the step (NCCL supports capture): a replay runs forward, backward and the overlapped all-reduces from one
host call.

Gradients are reduced in buckets, as DDP does: each ready gradient joins the open bucket, and a bucket of at least
``bucket_mb`` MiB goes out as one coalesced collective (one NCCL launch for all its tensors, no copy into a flat
buffer). One all-reduce per gradient left the 350m GPT's DDP step under graphs idle between its last collectives,
2.6x the bucketed step's host time (2 H200s: BENCHMARKS.md).

The result is the same gradient DDP computes (the mean over ranks of each rank's gradient) up to the order of the
floating-point additions inside NCCL.
"""

from __future__ import annotations

import torch

from lowbit.nn.functional import wgrad_side_stream

__all__ = ["GradAllReduce", "broadcast_parameters", "bf16_average_hook"]


def broadcast_parameters(module: torch.nn.Module, group=None) -> None:
    """Copy rank 0's parameters and buffers to every rank of ``group`` (what DDP's constructor does)."""
    for t in list(module.parameters()) + list(module.buffers()):
        torch.distributed.broadcast(t.data, src=0, group=group)


def bf16_average_hook(group, bucket):
    """A ``DistributedDataParallel`` communication hook (``ddp.register_comm_hook(group, bf16_average_hook)``):
    each bucket's gradients rounded to BF16, summed across ``group`` (None: the default group) in BF16, divided by
    its size and written back into the bucket's buffer: the numerics of :class:`GradAllReduce` with
    ``reduce_dtype=torch.bfloat16``, on any backend (torch's ``bf16_compress_hook`` needs NCCL)."""
    buf = bucket.buffer()
    low = buf.to(torch.bfloat16)
    n = torch.distributed.get_world_size(group)
    fut = torch.distributed.all_reduce(low, group=group, async_op=True).get_future()

    def write_back(f):
        return buf.copy_(f.value()[0].div_(n))

    return fut.then(write_back)


BUCKET_MB = 25.0
"""The default bucket size of :class:`GradAllReduce`, DDP's own (8 and 25 MiB measured alike)."""


class GradAllReduce:
    """Average the gradients of ``params`` across ``group`` as the backward produces them, in buckets.

    Call :meth:`arm` before the backward of a step's last micro-batch (the earlier micro-batches only accumulate) and
    :meth:`finish` after it: it reduces the gradients no hook saw (parameters the backward did not reach keep None)
    and the last bucket, sums ``loss`` across the group in place, and joins the collectives into the current stream.
    Every rank must make the same calls (the buckets then hold the same gradients on every rank: the backward makes
    them ready in the same order). On a CPU group (gloo) the collectives run as the buckets close; on CUDA they are
    queued on a stream of their own behind the stream that made the gradients (and the weight-gradient side stream of
    :class:`lowbit.nn.functional.wgrad_on_side_stream`), so the backward does not wait for them.

    Args:
        params: the parameters whose gradients are averaged (those that require none are left out).
        group: the process group (None: the default one).
        bucket_mb: a bucket goes out once its gradients hold at least this many MiB (> 0; :data:`BUCKET_MB`).
        reduce_dtype: the dtype the gradients are averaged in (None: their own). ``torch.bfloat16``: each bucket's
            gradients are cast into one BF16 buffer (half the bytes of FP32), averaged, and cast back into the
            gradients when the collective is done (each gradient rounded to BF16 before the sum).
    """

    def __init__(self, params: list[torch.nn.Parameter], group=None, bucket_mb: float = BUCKET_MB,
                 reduce_dtype: torch.dtype | None = None):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("params: no parameter requires a gradient; there is nothing to average")
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0:
            raise ValueError(f"bucket_mb: expected a number of MiB > 0, got {bucket_mb!r}")
        if reduce_dtype is not None and reduce_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"reduce_dtype: expected None, torch.float32 or torch.bfloat16, got {reduce_dtype!r}")
        self.reduce_dtype = reduce_dtype
        self.casts: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []  # (views of a reduced buffer, gradients)
        self.bucket_bytes = float(bucket_mb) * 2**20
        self.bucket: list[torch.Tensor] = []
        self.bucket_size = 0
        self.buckets_sent = 0  # collectives the last armed backward launched (for tests and diagnostics)
        self.group = group
        self.device = self.params[0].device
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.armed = False
        self.done: set[int] = set()
        self.works: list = []
        self.hooks = [p.register_post_accumulate_grad_hook(self._ready) for p in self.params]

    def remove(self) -> None:
        """Remove the hooks (the parameters' gradients are then left alone)."""
        for h in self.hooks:
            h.remove()
        self.hooks = []

    def arm(self) -> None:
        """The next backward is the step's last: reduce each gradient once it is accumulated."""
        self.armed, self.done, self.works, self.casts = True, set(), [], []
        self.bucket, self.bucket_size, self.buckets_sent = [], 0, 0

    def _all_reduce(self, ts: list[torch.Tensor], op) -> None:
        """One collective over ``ts`` (in place): a plain all-reduce for one tensor, else coalesced."""
        if len(ts) == 1:
            work = torch.distributed.all_reduce(ts[0], op=op, group=self.group, async_op=self.stream is not None)
        else:
            opts = torch.distributed.AllreduceCoalescedOptions()
            opts.reduceOp = op
            pg = self.group if self.group is not None else torch.distributed.group.WORLD
            work = pg.allreduce_coalesced(ts, opts)
            if self.stream is None:
                work.wait()
        if self.stream is not None:
            self.works.append(work)

    def _cast(self, ts: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors to reduce for the gradients ``ts``: themselves, or (``reduce_dtype`` another dtype) one flat
        buffer of their values in it, noted for :meth:`_cast_back`."""
        if self.reduce_dtype is None or all(g.dtype == self.reduce_dtype for g in ts):
            return ts
        flat = torch.empty(sum(g.numel() for g in ts), dtype=self.reduce_dtype, device=ts[0].device)
        views = [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in ts]), ts)]
        torch._foreach_copy_(views, ts)  # (the cast and the packing in one pass)
        self.casts.append((views, ts))
        return [flat]

    def _cast_back(self) -> None:
        """Write the reduced buffers back into their gradients (each cast to the gradient's dtype)."""
        for views, ts in self.casts:
            torch._foreach_copy_(ts, views)
        self.casts = []

    def _send(self) -> None:
        """Average the open bucket's gradients across the group (one collective) and open a new bucket."""
        ts, self.bucket, self.bucket_size = self.bucket, [], 0
        if not ts:
            return
        self.buckets_sent += 1
        op = torch.distributed.ReduceOp
        if self.stream is None:  # (gloo has no AVG)
            red = self._cast(ts)
            self._all_reduce(red, op.SUM)
            n = torch.distributed.get_world_size(self.group)
            for g in red:
                g.div_(n)
            self._cast_back()
            return
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)
        side = wgrad_side_stream(self.device)
        if side is not None:
            self.stream.wait_stream(side)
        for g in ts:
            g.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            self._all_reduce(self._cast(ts), op.AVG)

    def _reduce_once(self, p: torch.nn.Parameter) -> None:
        g = p.grad
        if g is not None and id(p) not in self.done:
            self.done.add(id(p))
            if self.bucket and (g.dtype != self.bucket[0].dtype or g.device != self.bucket[0].device):
                self._send()  # (a coalesced collective takes one dtype and device)
            self.bucket.append(g)
            self.bucket_size += g.numel() * g.element_size()
            if self.bucket_size >= self.bucket_bytes:
                self._send()

    def _ready(self, p: torch.nn.Parameter) -> None:
        if self.armed:
            self._reduce_once(p)

    def finish(self, loss: torch.Tensor | None = None) -> None:
        """After the last backward: reduce what is left, sum ``loss`` (in place) and wait, on the current stream, for
        every collective."""
        if not self.armed:
            raise RuntimeError("GradAllReduce.finish: arm() was not called before the backward")
        for p in self.params:  # (same order on every rank)
            self._reduce_once(p)
        self._send()
        if self.stream is not None:
            main = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(self.stream):
                for w in self.works:
                    w.wait()  # (the side stream waits for the collective's own stream)
                self._cast_back()
            main.wait_stream(self.stream)
        if loss is not None:
            torch.distributed.all_reduce(loss, op=torch.distributed.ReduceOp.SUM, group=self.group)
        self.armed, self.works = False, []
