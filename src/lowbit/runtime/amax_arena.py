"""The int32 amax accumulators of the blockwise quantize launches captured into one CUDA graph, from one buffer.

Each blockwise launch atomically maxes its tiles' maxima into a zeroed int32, so outside a graph every launch
zero-fills a small buffer first: one fill kernel a call, each with its launch gap in a graph. Inside
:class:`amax_arena` the launches take consecutive slots of one buffer instead, and the caller captures
:meth:`AmaxArena.reset` (one fill for all of them) before them.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["AmaxArena", "amax_arena", "arena_slot"]


class AmaxArena:
    """Slots for the int32 amax accumulators of the blockwise quantize launches captured into one CUDA graph.

    Every slot is zeroed at the start of each replay (the captured :meth:`reset`), before any launch that writes it,
    and holds its amax until the next replay: the lifetime of every other tensor in a graph's memory. Where a scale
    grid has padding (which must read 0), or the slots run out, a launch zero-fills its own buffer as outside a graph.
    """

    def __init__(self, n: int, device):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n: expected a positive int (slots), got {n!r}")
        self.buf = torch.zeros(n, dtype=torch.int32, device=device)
        self.used = 0
        self.missed = 0  # launches that found the arena full (they zero-filled their own buffers)

    def reset(self) -> None:
        """Zero every slot (capture this before the launches that take slots)."""
        self.buf.zero_()

    def take(self, device) -> torch.Tensor | None:
        """A zeroed (1,) int32 slot on ``device``, or None (another device, or full)."""
        if device != self.buf.device:
            return None
        if self.used >= self.buf.numel():
            self.missed += 1
            return None
        self.used += 1
        return self.buf[self.used - 1:self.used]


# The arena in force: process-wide, since the autograd engine runs backward launches on its own thread.
_active: dict = {"arena": None}
_lock = threading.Lock()


class amax_arena:
    """``with amax_arena(arena):`` blockwise quantize launches on the arena's device take their amax accumulators
    from ``arena`` while the current stream is capturing a CUDA graph; outside a capture they zero-fill their own."""

    def __init__(self, arena: AmaxArena):
        if not isinstance(arena, AmaxArena):
            raise TypeError(f"arena: expected an AmaxArena, got {type(arena).__name__}")
        self.arena, self.prev = arena, None

    def __enter__(self):
        with _lock:
            self.prev, _active["arena"] = _active["arena"], self.arena
        return self.arena

    def __exit__(self, *exc):
        with _lock:
            _active["arena"] = self.prev
        return False


def arena_slot(dev) -> torch.Tensor | None:
    """A zeroed int32 slot of the arena in force for a launch on ``dev`` inside a capture, else None."""
    a = _active["arena"]
    if a is None or dev.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        return None
    return a.take(dev)
