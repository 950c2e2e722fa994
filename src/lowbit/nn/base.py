"""Shared machinery of the lowbit modules: per-GEMM state, extra state in the state_dict, naming."""

from __future__ import annotations

import torch

from ..runtime.device import in_graph_pool
from . import state as _ac
from .functional import GemmLayer

__all__ = ["LowbitModule", "cached_weights", "name_modules"]

_EXTRA = "_extra_state"


class LowbitModule:
    """Mixin for lowbit modules (used with ``torch.nn.Module``).

    * ``lowbit_name``: the qualified module name the NaN sentry reports (set by :func:`name_modules`
      and :func:`lowbit.convert`).
    * ``_gemms``: ``{suffix: GemmLayer}``, one per quantized GEMM.
    * The delayed-scaling state goes into ``state_dict()`` under ``<prefix>_extra_state`` as a flat
      dict of plain tensors (``"<gemm>.<role>.history"`` ...), so checkpoints never hold FP8 and load
      with ``torch.load(weights_only=True)``. A state_dict without that key (e.g. from a plain
      ``torch.nn.Linear``) loads too.
    """

    lowbit_name: str | None = None

    def _init_gemms(self, *suffixes: str) -> None:
        self._gemms = {s: GemmLayer(self, s) for s in suffixes}

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        for g in getattr(self, "_gemms", {}).values():  # (the weight may have moved: slots follow at next entry)
            _ac.slots_stale(g)
        return out

    def get_extra_state(self) -> dict:
        out = {}
        for s, g in self._gemms.items():
            for k, v in g.state_dict().items():
                out[f"{s}.{k}" if s else k] = v
        return out

    def set_extra_state(self, state) -> None:
        if state is None:
            return
        if not isinstance(state, dict):
            raise TypeError(f"state: lowbit extra state must be a dict of tensors, got {type(state).__name__}")
        for s, g in self._gemms.items():
            pre = f"{s}." if s else ""
            sub = {k[len(pre):]: v for k, v in state.items() if k.startswith(pre)} if s else {
                k: v for k, v in state.items() if k.split(".")[0] in ("input", "weight", "grad_output")}
            g.load_state_dict(sub)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        key = prefix + _EXTRA
        if key not in state_dict and key in missing_keys:  # checkpoint of a torch module: no scaling state is fine
            missing_keys.remove(key)

    def gemm_layer(self, attr: str):
        """The :class:`~lowbit.nn.functional.GemmLayer` that multiplies by the weight attribute ``attr``
        (``"weight"``, ``"fc1_weight"`` ...), or None."""
        suffix = attr[: -len("_weight")] if attr.endswith("_weight") else ("" if attr == "weight" else None)
        return None if suffix is None else self._gemms.get(suffix)

    def clear_weight_cache(self) -> None:
        """Drop cached quantized weights (they are rebuilt by the next ``is_first_microbatch=True`` call), and the
        kept copies recorded CUDA graphs read (replay none of those graphs after this: ``torch.compiler.reset()``)."""
        for g in self._gemms.values():
            g.wcache = None
            g.graph_pins = []


def name_modules(model: torch.nn.Module, prefix: str = "") -> int:
    """Set ``lowbit_name`` of every lowbit module in ``model`` to its qualified name; returns how many."""
    n = 0
    for name, m in model.named_modules(prefix=prefix):
        if isinstance(m, LowbitModule):
            m.lowbit_name = name or type(m).__name__
            n += 1
    return n


class cached_weights:
    """Reuse each lowbit layer's quantized weight between calls while the weight is unchanged (eager inference,
    ``generate()``, several forwards between optimizer steps)::

        with torch.inference_mode(), lowbit.autocast(recipe), lowbit.nn.cached_weights(model) as kept:
            out = model.generate(ids, max_new_tokens=64)
        print(kept.reused)

    Inside the block a forward with ``is_first_microbatch=None`` (what HF and most code pass) quantizes each weight
    once and keeps the copies; later forwards take them as long as the recipe is the same and the weight has not
    changed: its version counter (bumped by every in-place update, ``copy_`` and optimizer steps included) and its
    storage are checked on every call, and a changed weight is quantized again. As ``is_first_microbatch=False``,
    a kept weight is not re-checked by the NaN sentry, and a DelayedScaling weight keeps the scale it was quantized
    with (its amax is recorded only then). A write the version counter does not see (in place through ``.data``) is
    not detected: quantize again by leaving and re-entering the block (where compiled calls recorded CUDA graphs in a
    block: ``clear_weight_cache()`` and ``torch.compiler.reset()``).

    Costs the quantized copies' memory (about one byte a parameter for FP8) until the block exits, where they are
    dropped. Under ``torch.compile`` a layer inside the block runs as lowbit's operator, which keeps and checks the
    copies as an eager call does. CUDA graphs (a capture, or ``torch.compile(mode="reduce-overhead")``) take the
    copies an earlier call of the block kept (``generate()``'s eager prefill is one) and keep none of their own; the
    layer holds such a copy for as long as the graph may replay (``clear_weight_cache`` drops it). A replay reads the
    copy without checking the weight: a weight changed since is written into the copy (in place, on the current
    stream: replay on that stream) when a block is entered and when an eager forward inside a block with
    ``is_first_microbatch=None`` quantizes it, but not between two replays. So inside a block, after changing a
    weight, make one such eager call before the compiled ones (or leave and re-enter the block).
    Inference-tensor weights (made under ``torch.inference_mode``) quantize as usual. Blocks nest.
    ``model``: a module holding lowbit modules (after :func:`lowbit.convert`); ``reused``: how many forwards inside
    the block took a kept weight.
    """

    def __init__(self, model: torch.nn.Module):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        # (each GEMM with its module and weight attribute: "" multiplies by "weight", "fc1" by "fc1_weight")
        self._weights = [(g, m, "weight" if s == "" else f"{s}_weight") for m in model.modules()
                         if isinstance(m, LowbitModule) for s, g in getattr(m, "_gemms", {}).items()]
        self._layers = [g for g, _, _ in self._weights]
        if not self._layers:
            raise ValueError(f"model: a {type(model).__name__} with no lowbit modules has no quantized weights to "
                             "keep; convert it first (lowbit.convert)")
        self._start = None  # (the layers' reuse count at entry while the block is open)
        self._reused = 0

    def __enter__(self) -> "cached_weights":
        if self._start is not None:
            raise RuntimeError("cached_weights: this block is already open (make one object per with-statement)")
        self._refresh_pins()
        for g in self._layers:
            g.keep_weights += 1
        self._start = sum(g.kept_uses for g in self._layers)
        return self

    def __exit__(self, *exc) -> None:
        for g in self._layers:
            g.keep_weights -= 1
            if g.keep_weights == 0:
                g.wcache = None
        self._reused = self.reused
        self._start = None

    def _refresh_pins(self) -> None:
        """Write each weight changed since a CUDA graph recorded its kept copy into that copy (in place: the graph
        replays it); a non-finite amax among them raises (one device sync, only where a copy was written)."""
        if torch.compiler.is_compiling():
            return
        amaxes = []
        for g, m, attr in self._weights:
            w = getattr(m, attr, None) if g.graph_pins else None
            if isinstance(w, torch.Tensor) and not in_graph_pool(w.device):  # (not written into a graph capturing)
                amaxes += [(g, a) for a in g.refresh_pins(w)]
        if amaxes and not bool(torch.isfinite(torch.cat([a.reshape(-1) for _, a in amaxes])).all()):
            bad = {g for g, a in amaxes if not bool(torch.isfinite(a).all())}
            for g in bad:
                g.mark_pins_stale()  # (written and checked again at the next entry)
            bad = sorted(g.name for g in bad)
            raise ValueError(f"cached_weights: the weights of {', '.join(bad)} hold NaN or Inf; their FP8 copies that "
                             "recorded CUDA graphs read were written with them")

    @property
    def reused(self) -> int:
        """Forwards inside this block (so far, or until it exited) that took a kept weight."""
        if self._start is None:
            return self._reused
        return sum(g.kept_uses for g in self._layers) - self._start
