"""Argument checks the public API shares, each raising an error that names the argument, the rule and the value."""

from __future__ import annotations

__all__ = ["check_bool"]


def check_bool(name: str, value) -> None:
    """``value`` must be a bool: 1, "no" or None silently meaning a flag is a TypeError naming ``name``."""
    if value.__class__ is not bool:
        raise TypeError(f"{name}: expected a bool (True or False), got {type(value).__name__} {value!r}")
