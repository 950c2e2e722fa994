"""Distributed helpers: amax reduction across ranks (used by :func:`lowbit.autocast`)."""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["reduce_amax", "is_active", "any_rank", "any_rank_tensor"]


def is_active(group=None) -> bool:
    """True when ``torch.distributed`` is initialized and ``group`` (default: world) has more than one rank."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return dist.get_world_size(group) > 1


def reduce_amax(tensors: Sequence[torch.Tensor], group=None) -> list[torch.Tensor]:
    """All-reduce (MAX) a list of float32 amax tensors across ``group``, in place.

    The tensors are packed into one flat buffer, so one collective runs however many layers there
    are; every rank must pass the same number of tensors with the same sizes, in the same order.
    A NaN amax is turned into +inf before the reduction, so a non-finite amax on any rank makes the
    result non-finite on every rank (all ranks then agree to skip the step).

    Args:
        tensors: float32 tensors (any shape, typically (1,)), all on one device.
        group: a ``torch.distributed`` process group; None = the default (world) group.

    Returns:
        The same tensors (modified in place; returned for convenience). A no-op without an
        initialized process group or with a single rank.
    """
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            raise TypeError(f"tensors[{i}]: expected a float32 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if not tensors or not is_active(group):
        return tensors
    dev = tensors[0].device
    for i, t in enumerate(tensors):
        if t.device != dev:
            raise ValueError(f"tensors[{i}]: all amax tensors must be on one device ({dev}), got {t.device}")
    flat = torch.cat([t.reshape(-1) for t in tensors])
    flat = torch.where(torch.isnan(flat), torch.full_like(flat, float("inf")), flat)
    torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.MAX, group=group)
    off = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[off : off + n].reshape(t.shape))
        off += n
    return tensors


def any_rank(flag: bool, group=None, device=None) -> bool:
    """True if ``flag`` is true on any rank of ``group`` (e.g. "a non-finite amax was seen: skip the step"). One
    all-reduce and one read on the host. ``device``: where the flag travels; None: the current CUDA device where the
    group's backend is NCCL alone (it has no CPU transport), else the CPU.

    Under DDP or FSDP2 every rank's NaN sentry sees only its own tensors, so a loop that skips steps must agree on
    it, or the ranks that did not see the fault apply the update the others skip::

        if lowbit.distributed.any_rank(bool(lowbit.nn.nonfinite_events())):
            opt.zero_grad(set_to_none=True)  # every rank skips the step
    """
    if not is_active(group):
        return bool(flag)
    if device is None:
        backend = str(torch.distributed.get_backend(group))
        device = (torch.device("cuda", torch.cuda.current_device())
                  if "nccl" in backend and "cpu:" not in backend and "gloo" not in backend else "cpu")
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
    return bool(t.item() > 0)


def any_rank_tensor(flag: torch.Tensor, group=None) -> torch.Tensor:
    """:func:`any_rank` on the device: ``flag`` (float, 1.0 or 0.0) all-reduced (MAX) across ``group`` in place and
    returned, nothing read on the host (e.g. the ``found_inf`` of a fused optimizer, so every rank skips the step
    on the device)."""
    if is_active(group):
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
    return flag
