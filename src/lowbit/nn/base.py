"""Shared machinery of the lowbit modules: per-GEMM state, extra state in the state_dict, naming."""

from __future__ import annotations

import torch

from . import state as _ac
from .functional import GemmLayer

__all__ = ["LowbitModule", "name_modules"]

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
        """Drop cached quantized weights (they are rebuilt by the next ``is_first_microbatch=True`` call)."""
        for g in self._gemms.values():
            g.wcache = None


def name_modules(model: torch.nn.Module, prefix: str = "") -> int:
    """Set ``lowbit_name`` of every lowbit module in ``model`` to its qualified name; returns how many."""
    n = 0
    for name, m in model.named_modules(prefix=prefix):
        if isinstance(m, LowbitModule):
            m.lowbit_name = name or type(m).__name__
            n += 1
    return n
