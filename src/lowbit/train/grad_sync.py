"""Data-parallel gradient averaging that a CUDA graph can capture: ``lowbit train``'s DDP step under graphs.

``torch.nn.parallel.DistributedDataParallel`` keeps its reducer on the host (buckets rebuilt, unused parameters
searched, work handles queued to a watchdog), which a captured step would freeze half-way. :class:`GradAllReduce`
does the one thing the step needs: when the last micro-batch's backward has accumulated a parameter's gradient, that
gradient is averaged across the group (an all-reduce, ``ReduceOp.AVG``) behind the work that produced it, while the
backward goes on with the layers below. Every rank runs the same model, so its gradients become ready in the same
order and the collectives match rank for rank. Inside ``torch.cuda.graph`` the collectives are captured with the
rest of the step (NCCL supports capture): a replay runs forward, backward and the overlapped all-reduces from one
host call.

The result is the same gradient DDP computes (the mean over ranks of each rank's gradient) up to the order of the
floating-point additions inside NCCL.
"""

from __future__ import annotations

import torch

from lowbit.nn.functional import wgrad_side_stream

__all__ = ["GradAllReduce", "broadcast_parameters"]


def broadcast_parameters(module: torch.nn.Module, group=None) -> None:
    """Copy rank 0's parameters and buffers to every rank of ``group`` (what DDP's constructor does)."""
    for t in list(module.parameters()) + list(module.buffers()):
        torch.distributed.broadcast(t.data, src=0, group=group)


class GradAllReduce:
    """Average the gradients of ``params`` across ``group`` as the backward produces them.

    Call :meth:`arm` before the backward of a step's last micro-batch (the earlier micro-batches only accumulate) and
    :meth:`finish` after it: it reduces the gradients no hook saw (parameters the backward did not reach keep None),
    sums ``loss`` across the group in place, and joins the collectives into the current stream. Every rank must make
    the same calls. On a CPU group (gloo) the collectives run as the hooks fire; on CUDA they are queued on a stream of
    their own behind the stream that made the gradient (and the weight-gradient side stream of
    :class:`lowbit.nn.functional.wgrad_on_side_stream`), so the backward does not wait for them.
    """

    def __init__(self, params: list[torch.nn.Parameter], group=None):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("params: no parameter requires a gradient; there is nothing to average")
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
        self.armed, self.done, self.works = True, set(), []

    def _reduce(self, g: torch.Tensor) -> None:
        op = torch.distributed.ReduceOp
        if self.stream is None:  # (gloo has no AVG)
            torch.distributed.all_reduce(g, op=op.SUM, group=self.group)
            g.div_(torch.distributed.get_world_size(self.group))
            return
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)
        side = wgrad_side_stream(self.device)
        if side is not None:
            self.stream.wait_stream(side)
        g.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            self.works.append(torch.distributed.all_reduce(g, op=op.AVG, group=self.group, async_op=True))

    def _reduce_once(self, p: torch.nn.Parameter) -> None:
        if p.grad is not None and id(p) not in self.done:
            self.done.add(id(p))
            self._reduce(p.grad)

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
        if self.stream is not None:
            main = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(self.stream):
                for w in self.works:
                    w.wait()  # (the side stream waits for the collective's own stream)
            main.wait_stream(self.stream)
        if loss is not None:
            torch.distributed.all_reduce(loss, op=torch.distributed.ReduceOp.SUM, group=self.group)
        self.armed, self.works = False, []
