"""Delayed-scaling state: an amax history and the scale derived from it (NUMERICS §3, per-tensor delayed)."""

from __future__ import annotations

import torch

from ..formats import get_format

__all__ = ["AmaxHistory"]


class AmaxHistory:
    """Amax history of one tensor role and the scale it implies.

    ``scale = fmax / amax_h / 2**margin`` where ``amax_h`` is the max over the history
    (``algo="max"``) or its most recent entry (``algo="most_recent"``). A history amax that is 0 or
    non-finite leaves the previous scale in place (so one bad step does not poison the scale; the
    NaN sentry reports it).

    The state is plain float32 tensors (``history`` (length,), ``scale`` (1,)), so it lives in a
    ``state_dict`` and loads with ``weights_only=True``.
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
        self.scale = torch.ones(1, dtype=torch.float32, device=device)
        self.steps = 0

    def record(self, amax: torch.Tensor) -> None:
        """Push this step's amax (float32 tensor with one element) to the front of the history."""
        a = amax.detach().to(self.history.device, torch.float32).reshape(1)
        self.history = torch.cat([a, self.history[:-1]])
        self.steps += 1

    def update_scale(self) -> torch.Tensor:
        """Recompute ``scale`` from the history; returns it."""
        a = self.history.max().reshape(1) if self.algo == "max" else self.history[:1]
        new = a.new_full((1,), self.fmt.max) / a / (2.0**self.margin)  # (no host-to-device copy: no sync)
        # (new > 0: a huge amax divided by 2**margin can underflow to 0, which would zero the tensor)
        ok = torch.isfinite(a) & (a > 0) & torch.isfinite(new) & (new > 0)
        self.scale = torch.where(ok, new, self.scale)
        return self.scale

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
        self.history = h.to(self.history.device, torch.float32).clone()
        self.scale = s.detach().to(self.scale.device, torch.float32).reshape(1).clone()
        self.steps = int(sd["steps"])

    def __repr__(self):
        return f"AmaxHistory(length={self.length}, algo={self.algo!r}, margin={self.margin}, fmt={self.fmt})"
