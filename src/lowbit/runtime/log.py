"""The ``lowbit`` logger, and why a fast path declined a call.

A fast path (a fused kernel, a Gluon kernel, a TMA tile load) that does not take a call says why through
:func:`declined`: once per (path, reason) at DEBUG level on the ``lowbit`` logger, so a run with ``LOWBIT_LOG=debug``
shows every fallback, and :func:`declines` returns the counts (``lowbit info`` prints them for its own probe calls).
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections import Counter

import torch

from . import env

__all__ = ["logger", "declined", "declines", "info", "warn_once"]

logger = logging.getLogger("lowbit")
_counts: Counter = Counter()
_lock = threading.Lock()
_configured = threading.Event()


def _configure() -> None:
    """Apply ``LOWBIT_LOG`` once where it is set: the level, and a stderr handler where the application installed
    none. Unset, the logger is left to the application's logging configuration."""
    if _configured.is_set():
        return
    _configured.set()
    if env.get("LOWBIT_LOG") == env.SWITCHES["LOWBIT_LOG"].default:
        return
    level = getattr(logging, env.get("LOWBIT_LOG").upper())
    logger.setLevel(level)
    if level < logging.WARNING and not logger.handlers and not logging.getLogger().handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("[lowbit] %(message)s"))
        logger.addHandler(h)


def declined(path: str, reason) -> None:
    """Record that fast path ``path`` declined a call for ``reason`` (a string, or a function making it: called
    only here), logged at DEBUG the first time. Not while ``torch.compile`` traces: the decision is made once there,
    and Dynamo cannot trace the lock."""
    if torch.compiler.is_compiling():
        return
    if callable(reason):
        reason = reason()
    key = (path, reason)
    with _lock:
        first = key not in _counts
        _counts[key] += 1
    if first:
        _configure()
        logger.debug("%s declined a call: %s", path, reason)


def info(msg: str, *args) -> None:
    """``msg % args`` at INFO on the ``lowbit`` logger (``LOWBIT_LOG=info`` shows it): a slow first-time event, such
    as a kernel compiled on first use."""
    _configure()
    logger.info(msg, *args)


_warned: set = set()


def warn_once(msg: str, stacklevel: int = 3) -> None:
    """``warnings.warn(msg)`` the first time this process sees ``msg`` (a degraded path the user should know of, not
    a per-call notice); later calls with the same text are silent."""
    with _lock:
        first = msg not in _warned
        _warned.add(msg)
    if first:
        warnings.warn(msg, stacklevel=stacklevel)


def declines() -> dict[tuple[str, str], int]:
    """{(path, reason): times} since the process started."""
    with _lock:
        return dict(_counts)
