"""The environment switches users may set, declared once.

Every ``LOWBIT_*`` variable the library reads is a :class:`Switch` in :data:`SWITCHES`: name, parser, default and
what it does. Every switch is read from the environment once, when lowbit is imported; a bad value raises a
``ValueError`` naming the variable, the rule and the value where the switch is first used. ``lowbit info`` lists
every switch with its value.

Code reads a switch with :func:`get`. Tests (and callers that need a block with another value) use
:func:`override`, which changes the value in this process only, never ``os.environ``.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

__all__ = ["Switch", "SWITCHES", "FUSIONS", "get", "override", "describe", "unknown", "fused", "cache_root"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _bool(name: str, raw: str) -> bool:
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{name}: expected 0/1 (or true/false, yes/no, on/off), got {raw!r}")


def _choice(*choices: str) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        v = raw.strip().lower()
        if v not in choices:
            raise ValueError(f"{name}: expected one of {', '.join(choices)}, got {raw!r}")
        return v

    return parse


def _path(name: str, raw: str) -> str | None:
    return raw or None


def _sms(name: str, raw: str) -> int | None:
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"{name}: expected a number of SMs (an integer >= 0), got {raw!r}")
    return n


# The fused kernels :data:`LOWBIT_UNFUSE` can turn off, each replaced by its unfused path (same bits; norm_quant
# and norm_backward to FP32 rounding: their sums run in another order).
FUSIONS = {
    "norm_quant": "RMSNorm inside the 1x128 input quantizer of LayerNormLinear / LayerNormMLP",
    "residual": "the residual add as one kernel (with the next RMSNorm's statistics)",
    "norm_backward": "the RMSNorm backward inside the residual add's backward",
    "swiglu_quant": "SwiGLU inside fc2's input quantizer",
    "swiglu_bwd_quant": "SwiGLU's backward inside fc1's grad_output quantizer",
    "rope_bwd_quant": "RoPE's backward inside the QKV projection's grad_output quantizer",
    "adamw_quant": "the AdamW step writing the FP8 weight copies (lowbit train)",
}


def _fusions(name: str, raw: str) -> frozenset:
    items = {s.strip().lower() for s in raw.split(",") if s.strip()}
    if "all" in items:
        return frozenset(FUSIONS)
    bad = sorted(items - set(FUSIONS))
    if bad:
        raise ValueError(f"{name}: unknown fusion(s) {', '.join(bad)}; expected a comma-separated subset of "
                         f"{', '.join(FUSIONS)} or 'all', got {raw!r}")
    return frozenset(items)


@dataclass(frozen=True)
class Switch:
    """One environment switch."""

    name: str
    """The environment variable, ``LOWBIT_*``."""
    parse: Callable[[str, str], Any]
    """``parse(name, raw)``: the value of a set variable; raises ValueError naming the variable on a bad one."""
    default: Any
    """The value when the variable is unset (or empty)."""
    doc: str
    """What it does, one or two sentences (shown by ``lowbit info``)."""


def _switches(*items: Switch) -> dict[str, Switch]:
    return {s.name: s for s in items}


SWITCHES: dict[str, Switch] = _switches(
    Switch("LOWBIT_AUTOTUNE", _bool, True,
           "Time each Triton kernel's candidate launch configs once per shape bucket and keep the fastest; "
           "0: always the first config (faster start, used by the GPU tests)."),
    Switch("LOWBIT_FAST_LAUNCH", _bool, True,
           "Relaunch compiled Triton kernels without Triton's per-call argument binding; 0: Triton's own launch "
           "every call (for launch hooks and debuggers)."),
    Switch("LOWBIT_TMA", _bool, True,
           "Tile loads through TMA tensor descriptors in the attention forward and the Triton GEMMs where the "
           "shape allows; 0: pointer loads (same bits)."),
    Switch("LOWBIT_ATTN_GLUON", _choice("1", "0", "force"), "1",
           "The warp-specialized Gluon INT8·FP8 attention forward on sm_90: 1 where a call fits it, 0 never, "
           "force: raise where a call does not fit."),
    Switch("LOWBIT_GEMM_GLUON", _choice("1", "0", "force", "ws"), "1",
           "The Gluon FP8 blockwise GEMMs on sm_90: 1 as autotune candidates, 0 never, force / ws: only the "
           "one-tile / warp-specialized kernel."),
    Switch("LOWBIT_DEEPGEMM", _bool, True,
           "DeepGEMM's sm_90 kernel for the blockwise FP8 forward and data-gradient GEMMs of at least 8192 tokens "
           "(1x128 x 128x128, BF16 out) where the deep_gemm package imports; 0: never (cuBLAS and the Gluon kernel "
           "take them)."),
    Switch("LOWBIT_CUDA_GEMM", _bool, True,
           "lowbit's CUDA kernel (compiled at run time by NVRTC) for the blockwise FP8 forward and data-gradient "
           "GEMMs of at least 4096 tokens on sm_90; 0: never (cuBLAS takes them)."),
    Switch("LOWBIT_UNFUSE", _fusions, frozenset(),
           "Comma-separated fused kernels to replace by their unfused path (same bits; norm_quant and "
           "norm_backward to FP32 rounding), or 'all': "
           + ", ".join(FUSIONS) + "."),
    Switch("LOWBIT_WGRAD_SM_CARVEOUT", _sms, None,
           "SMs the side-stream weight-gradient GEMMs leave to the main stream (default 32 of 132, scaled to the "
           "GPU; 0: none)."),
    Switch("LOWBIT_SENTRY_SYNC", _bool, False,
           "Every NaN-sentry check waits for the GPU, so a non-finite value raises at the exit of the step that "
           "made it (one sync per check)."),
    Switch("LOWBIT_CACHE", _path, None,
           "Directory of the training corpus cache and of the compiled CUDA kernels (kernels/) (default "
           "$XDG_CACHE_HOME/lowbit or ~/.cache/lowbit)."),
    Switch("LOWBIT_LOG", _choice("warning", "info", "debug"), "warning",
           "Level of the 'lowbit' logger; debug says why a fast path declined a call."),
)

class _Invalid:
    """A switch whose environment value did not parse: :func:`get` raises its error."""

    def __init__(self, error: ValueError):
        self.error = error


def _read(name: str) -> Any:
    sw = SWITCHES[name]
    raw = os.environ.get(name, "")
    try:
        return sw.parse(name, raw) if raw != "" else sw.default
    except ValueError as e:
        return _Invalid(e)


_lock = threading.Lock()
# Every switch read and parsed once, at import: the dict's keys never change afterwards (only override() changes
# values), so a compiled graph's guards on it hold whichever switch a later call reads first.
_values: dict[str, Any] = {name: _read(name) for name in SWITCHES}


def get(name: str) -> Any:
    """The value of switch ``name``, read from the environment when lowbit was imported; a value that did not parse
    raises here, naming its variable."""
    try:
        value = _values[name]
    except KeyError:
        raise KeyError(f"name: {name!r} is not a lowbit switch; known: {', '.join(SWITCHES)}") from None
    if value.__class__ is _Invalid:
        raise ValueError(str(value.error))
    return value


def cache_root() -> Path:
    """lowbit's cache directory: ``$LOWBIT_CACHE``, else ``$XDG_CACHE_HOME/lowbit``, else ``~/.cache/lowbit``."""
    if get("LOWBIT_CACHE"):
        return Path(get("LOWBIT_CACHE"))
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")) / "lowbit"


def fused(name: str) -> bool:
    """Whether the fusion ``name`` (a key of :data:`FUSIONS`) is on: not listed in ``LOWBIT_UNFUSE``."""
    if name not in FUSIONS:
        raise KeyError(f"name: {name!r} is not a fusion; known: {', '.join(FUSIONS)}")
    return name not in get("LOWBIT_UNFUSE")


@contextlib.contextmanager
def override(**values: Any):
    """``with override(LOWBIT_TMA=False, LOWBIT_UNFUSE="residual"):`` the switches take these values in this process
    for the block (strings are parsed as the environment's would be), then their previous values again."""
    new = {}
    for name, v in values.items():
        if name not in SWITCHES:
            raise KeyError(f"{name!r} is not a lowbit switch; known: {', '.join(SWITCHES)}")
        new[name] = SWITCHES[name].parse(name, v) if isinstance(v, str) else v
    saved = {name: _values[name] for name in new}
    with _lock:
        _values.update(new)
    try:
        yield
    finally:
        with _lock:
            _values.update(saved)


def describe() -> list[tuple[str, Any, Any, str]]:
    """(name, value, default, doc) for every switch, in declaration order (``lowbit info``); a value that did not
    parse is given as ``"invalid: <the error>"``."""
    def shown(name):
        v = _values[name]
        return f"invalid: {v.error}" if v.__class__ is _Invalid else v

    return [(s.name, shown(s.name), s.default, s.doc) for s in SWITCHES.values()]


def unknown() -> list[str]:
    """``LOWBIT_*`` variables set in the environment that are not switches (a typo, or a removed switch)."""
    return sorted(k for k in os.environ if k.startswith("LOWBIT_") and k not in SWITCHES)
