"""Operators with a side effect and no output a compiled graph keeps.

torch.compile drops an operator call whose results nothing reads, unless the operator is registered as having an
effect: AOTAutograd then threads an ordering token through each call (``with_effects``), which Inductor keeps and
runs in program order. torch spells the registration differently across releases; :func:`register_ordered` is the
one place lowbit makes it.
"""

from __future__ import annotations

import torch

__all__ = ["register_ordered"]


def register_ordered(op: torch._ops.OpOverload) -> None:
    """Register ``op`` (an operator overload with no aliasing outputs) as having an ordered side effect: kept by
    torch.compile even when it returns nothing, and ordered against other calls of ordered operators."""
    from torch._higher_order_ops import effects

    effects._register_effectful_op(op, effects._EffectType.ORDERED)
