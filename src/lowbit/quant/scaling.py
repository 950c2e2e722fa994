"""Delayed-scaling state: an amax history and the scale derived from it (NUMERICS §3, per-tensor delayed)."""

from __future__ import annotations

import torch

from ..formats import get_format

__all__ = ["AmaxHistory", "fold_pending", "record_pending_many"]


class AmaxHistory:
    """Amax history of one tensor role and the scale it implies.

    ``scale = fmax / amax_h / 2**margin`` where ``amax_h`` is the max over the history
    (``algo="max"``) or its most recent entry (``algo="most_recent"``). A history amax that is 0 or
    non-finite leaves the previous scale in place (so one bad step does not poison the scale; the
    NaN sentry reports it).

    The state is plain float32 tensors, so it lives in a ``state_dict`` and loads with ``weights_only=True``:
    ``history`` (length,) and ``device_state`` (3,) = [scale, steps, pending], updated in place (a compiled graph,
    CUDA graphs included, reads and writes them at fixed addresses). ``scale`` is a view of ``device_state[0]``;
    ``steps`` counts the records (exact to 2**24); ``pending`` is the max amax a compiled graph observed since the
    last record (:meth:`observe`), -1 for none. :meth:`record` is the eager path (the caller knows an amax is there);
    :meth:`record_pending` records the pending amax where there is one, decided on the device with no sync. The
    methods write through ``.data``: a compiled backward that saved ``device_state`` (its pending max is the
    backward's to update) does not see its version move when a commit runs between the passes.
    """

    def __init__(self, length: int = 1024, algo: str = "max", margin: int = 0, fmt="e4m3", device=None):
        if not isinstance(length, int) or length < 1:
            raise ValueError(f"length: must be a positive int, got {length!r}")
        if algo not in ("max", "most_recent"):
            raise ValueError(f"algo: expected 'max' or 'most_recent', got {algo!r}")
        if not isinstance(margin, int) or margin < 0:
            raise ValueError(f"margin: must be a non-negative int, got {margin!r}")
        self.length, self.algo, self.margin, self.fmt = length, algo, margin, get_format(fmt)
        self.history = torch.zeros(length, dtype=torch.float32, device=device)
        self.device_state = torch.tensor([1.0, 0.0, -1.0], dtype=torch.float32, device=device)
        self._steps: int | None = 0  # (the host's count; None once the device counted records the host did not see)

    @property
    def scale(self) -> torch.Tensor:
        """The current delayed scale, float32 (1,): a view of ``device_state``, updated in place."""
        return self.device_state[0:1]

    @property
    def steps(self) -> int:
        """Records so far (reads the device count, one sync, after :meth:`record_pending`)."""
        if self._steps is None:
            self._steps = int(self.device_state[1].item())
        return self._steps

    def to(self, device) -> None:
        """Move the state to ``device`` (new tensors: a compiled graph reading the old ones is traced again)."""
        self.history, self.device_state = self.history.to(device), self.device_state.to(device)

    def record(self, amax: torch.Tensor) -> None:
        """Push this step's amax (float32 tensor with one element) to the front of the history."""
        a = amax.detach().to(self.history.device, torch.float32).reshape(1)
        self.history.data.copy_(torch.cat([a, self.history[:-1]]))
        self.device_state.data[1:2].add_(1.0)
        if self._steps is not None:
            self._steps += 1

    def update_scale(self) -> torch.Tensor:
        """Recompute ``scale`` from the history (in place); returns it."""
        self.device_state.data[0:1].copy_(self._new_scale(True))
        return self.scale

    def _new_scale(self, where) -> torch.Tensor:
        a = self.history.max().reshape(1) if self.algo == "max" else self.history[:1]
        return _scale_from(a, self.scale, self.fmt.max, self.margin, where)

    def observe(self, amax: torch.Tensor) -> None:
        """Fold ``amax`` (one element) into the pending max, in place (NaN propagates)."""
        fold_pending(self.device_state.data, amax.detach())

    def record_pending(self, amax: torch.Tensor | None = None) -> None:
        """Record the pending amax (folded with ``amax``, an eager observation, if given) where there is one, as
        :meth:`record` then :meth:`update_scale` would, a non-finite amax as 0; then clear it. Decided on the device:
        no sync. :func:`record_pending_many` does it for many histories in a few launches."""
        record_pending_many([(self, amax)])

    def state_dict(self) -> dict:
        return {"history": self.history.clone(), "scale": self.scale.clone(), "steps": torch.tensor(self.steps)}

    def load_state_dict(self, sd: dict) -> None:
        h = sd["history"]
        if h.shape != self.history.shape:
            raise ValueError(f"history: expected shape {tuple(self.history.shape)}, got {tuple(h.shape)}")
        s = sd["scale"]
        if not isinstance(s, torch.Tensor) or s.numel() != 1:
            raise ValueError(f"scale: expected a tensor with one element, got {getattr(s, 'shape', s)!r}")
        v = float(s.detach().reshape(()).float())  # (once, at load: this reads the value)
        if not (v > 0.0 and v != float("inf")):
            raise ValueError(f"scale: the stored delayed scale must be finite and > 0, got {v}")
        steps = int(sd["steps"])
        self.history.data.copy_(h.detach().to(self.history.device, torch.float32))
        self.device_state.data.copy_(torch.tensor([v, float(steps), -1.0], dtype=torch.float32))
        self._steps = steps

    def __repr__(self):
        return f"AmaxHistory(length={self.length}, algo={self.algo!r}, margin={self.margin}, fmt={self.fmt})"


def fold_pending(device_state: torch.Tensor, amax: torch.Tensor) -> None:
    """``device_state[2]`` (an :attr:`AmaxHistory.device_state`'s pending amax) = max(itself, ``amax``), in place (NaN
    propagates): :meth:`AmaxHistory.observe`, and a compiled graph's update of the state it takes as an input."""
    p = device_state[2:3]
    p.copy_(torch.maximum(p, amax.to(torch.float32).reshape(1)))


def record_pending_many(items) -> None:
    """:meth:`AmaxHistory.record_pending` of each ``(history, amax or None)`` in ``items``, the histories of one
    setting (length, algo, margin, format, device) stacked: about twenty launches a setting, however many histories
    (a step's commit of every layer's three roles). Where ``amax`` is given an amax is there, and the host's step
    count stays known; elsewhere the device decides."""
    groups: dict = {}
    for h, a in items:
        groups.setdefault((h.length, h.algo, h.margin, h.fmt.max, h.history.device), []).append((h, a))
    for (_, algo, margin, fmax, dev), group in groups.items():
        hs = [h for h, _ in group]
        ds = torch.stack([h.device_state for h in hs])  # (n, 3): scale, steps, pending
        hist = torch.stack([h.history for h in hs])  # (n, L)
        p = ds[:, 2]
        if any(a is not None for _, a in group):
            neg = p.new_full((1,), -1.0)
            eager = torch.cat([neg if a is None else a.detach().to(dev, torch.float32).reshape(1) for _, a in group])
            p = torch.maximum(p, eager)
        present = ~(p < 0)  # (NaN is an observation)
        a = torch.nan_to_num(p, nan=0.0, posinf=0.0, neginf=0.0)
        hist = torch.where(present[:, None], torch.cat([a[:, None], hist[:, :-1]], dim=1), hist)
        ah = hist.amax(dim=1) if algo == "max" else hist[:, 0]
        out = torch.stack([_scale_from(ah, ds[:, 0], fmax, margin, present), ds[:, 1] + present.to(torch.float32),
                           torch.full_like(p, -1.0)], dim=1)
        torch._foreach_copy_([h.device_state.data for h in hs], list(out.unbind(0)))
        torch._foreach_copy_([h.history.data for h in hs], list(hist.unbind(0)))
        for h, e in group:
            h._steps = h._steps + 1 if (e is not None and h._steps is not None) else None


def _scale_from(amax_h: torch.Tensor, old: torch.Tensor, fmax: float, margin: int, where) -> torch.Tensor:
    """``fmax / amax_h / 2**margin`` element for element, ``old`` where that is not a finite positive scale from a
    finite positive amax, or where ``where`` is False."""
    new = torch.full_like(amax_h, fmax) / amax_h / (2.0**margin)  # (no host-to-device copy: no sync)
    # (new > 0: a huge amax divided by 2**margin can underflow to 0, which would zero the tensor)
    ok = torch.isfinite(amax_h) & (amax_h > 0) & torch.isfinite(new) & (new > 0) & where
    return torch.where(ok, new, old)
