"""Autocast state, delayed-scaling state and the NaN sentry (NUMERICS §6).

``with lowbit.autocast(recipe=...):`` sets the recipe lowbit modules quantize with. The state is
process-global (like TransformerEngine's), saved and restored by every ``autocast`` so contexts nest;
the backward of a module never reads it (each forward stores what its backward needs), so
``loss.backward()`` may run outside the context, as usual.

Delayed scaling: modules *observe* the amax of every tensor they quantize into their
:class:`DelayedScalingState` (a pending max). At the **outermost** autocast exit the pending amaxes
of every state that observed something — this step's forward (and any backward run inside the
context) and the previous backward (which usually runs after that step's exit, so its gradient
amaxes wait for this one) — are all-reduced (MAX) across the amax reduction group in one
collective, pushed to the histories once, and the scales recomputed.

The amaxes of work that failed never reach a history (a NaN would otherwise stay pending and mask the
next good step's amax, and an aborted step would count as a step):

* the outermost autocast exiting with an exception — any exception, including the NaN sentry's
  :class:`NonFiniteAmaxError` raised at that exit — drops the amaxes observed inside it; the previous
  backward's gradient amaxes stay pending for the next exit;
* a backward outside autocast whose sentry check raises :class:`NonFiniteAmaxError` drops the gradient
  amaxes waiting for the next exit (every backward since the last outermost exit).

A non-finite amax that raises nothing (``on_nonfinite="skip"`` / ``"ignore"``) is committed as 0: that
role's history records 0 for the step and its scale stays where it was. Both policies record a
:class:`NonFiniteEvent` (read with :func:`nonfinite_events`): "ignore" means "don't stop", never "hide".
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import threading
import warnings
import weakref
from dataclasses import dataclass, replace

import torch

from .. import distributed
from ..quant.scaling import AmaxHistory, record_pending_many
from ..quant.traceable import amax_value
from ..recipes import NAMES, DelayedScaling, Recipe
from ..runtime import env
from ..runtime.device import capability as _device_capability
from ..runtime.device import in_graph_pool
from ..runtime.log import warn_once

__all__ = [
    "autocast",
    "AutocastState",
    "get_state",
    "is_enabled",
    "get_recipe",
    "depth",
    "step",
    "check_recipe_support",
    "NonFiniteAmaxError",
    "NonFiniteEvent",
    "nonfinite_events",
    "check_nonfinite",
    "take_checks",
    "StepChecks",
    "DelayedScalingState",
    "state_key",
    "from_key",
    "sentry_off",
    "ON_NONFINITE",
    "SENTRY_SLOT_ROLES",
    "register_slot_holder",
    "slots_stale",
]

ON_NONFINITE = ("raise", "skip", "ignore", "off")
"""The NaN sentry's policies: what ``autocast(on_nonfinite=...)`` takes."""


# ------------------------------------------------------------------------------------------------
# state
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AutocastState:
    """What lowbit modules read in their forward.

    Attributes:
        enabled: quantize (True) or compute in high precision like torch (False).
        recipe: the active :class:`lowbit.recipes.Recipe` (None when disabled).
        amax_reduction_group: process group for the delayed-scaling amax reduction (None: world).
        on_nonfinite: ``"raise"`` (NonFiniteAmaxError), ``"skip"`` (record a :class:`NonFiniteEvent` for the loop
            to skip the step), ``"ignore"`` (record the event too, and go on) or ``"off"`` (no sentry: nothing
            recorded or checked).
        support: ``"native"``, ``"emulated"`` or ``"reference"`` (see :func:`check_recipe_support`).
        key: a string naming (recipe, on_nonfinite) (:func:`state_key`; ``""`` when disabled): what a compiled
            graph passes to lowbit's operators, and what ``torch.compile`` guards on, so another recipe recompiles.
    """

    enabled: bool = False
    recipe: Recipe | None = None
    amax_reduction_group: object = None
    on_nonfinite: str = "raise"
    support: str = "reference"
    key: str = ""


_state = AutocastState()
_depth = 0
_step = 0  # number of outermost autocast exits so far (the "step" in NaN-sentry events)
_lock = threading.Lock()
_pending: dict[int, "DelayedScalingState"] = {}  # states with pending amaxes, in first-observation order
# What was pending when the outermost autocast was entered (the previous backward's gradient amaxes), as
# {id: (state, {role: amax or None})}: a step that fails is rolled back to it. None outside autocast.
_carried: dict[int, tuple] | None = None
_carried_compiled: tuple | None = None  # the compiled states' device pending amaxes then (_snapshot_compiled)
_notices: set[str] = set()


_KEYS: dict[tuple, str] = {}  # (recipe, on_nonfinite) -> key; grows by one entry per distinct recipe used
_BY_KEY: dict[str, tuple] = {}


def state_key(recipe: Recipe, on_nonfinite: str) -> str:
    """The key of (recipe, on_nonfinite): equal recipes get the same key, for the life of the process."""
    k = (recipe, on_nonfinite)
    with _lock:
        key = _KEYS.get(k)
        if key is None:
            key = _KEYS[k] = f"{type(recipe).__name__}#{len(_KEYS)}:{on_nonfinite}"
            _BY_KEY[key] = k
    return key


def from_key(key: str) -> tuple[Recipe, str]:
    """(recipe, on_nonfinite) of a key made by :func:`state_key`."""
    try:
        return _BY_KEY[key]
    except KeyError:
        raise ValueError(f"key: {key!r} names no lowbit autocast state of this process") from None


def get_state() -> AutocastState:
    """The current autocast state (a frozen snapshot)."""
    return _state


def is_enabled() -> bool:
    """True inside an enabled :func:`autocast`."""
    return _state.enabled


def get_recipe() -> Recipe | None:
    """The active recipe, or None outside an enabled autocast."""
    return _state.recipe if _state.enabled else None


def depth() -> int:
    """How many autocast contexts are open (0 outside)."""
    return _depth


def step() -> int:
    """How many outermost autocast exits have happened in this process."""
    return _step


# ------------------------------------------------------------------------------------------------
# device support
# ------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _cuda_available() -> bool:
    return torch.cuda.is_available()


_NATIVE_FROM = {"per_tensor": (8, 9), "blockwise": (9, 0), "mxfp8": (10, 0), "nvfp4": (10, 0)}


def check_recipe_support(recipe: Recipe, device=None, *, allow_emulation: bool = True, capability=None) -> str:
    """How ``recipe`` runs on ``device``: ``"native"``, ``"emulated"`` or ``"reference"``.

    * CPU (and any non-CUDA device): ``"reference"`` — the exact pure-torch references, every recipe.
    * CUDA: per-tensor FP8 is native from sm_89, blockwise FP8 from sm_90 (Hopper), MXFP8 and NVFP4
      from sm_100; below that a recipe is emulated (Hopper: MXFP8/NVFP4 unpacked to BF16/FP8 math),
      which prints a one-time notice, or raises ``NotImplementedError`` when ``allow_emulation=False``.

    Args:
        device: default: the current CUDA device when CUDA is available, else CPU.
        capability: override the (major, minor) compute capability (for tests).
    """
    if not isinstance(recipe, Recipe):
        raise TypeError("recipe: expected a lowbit.recipes recipe (e.g. Float8CurrentScaling()), got "
                        f"{type(recipe).__name__}")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if _cuda_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type != "cuda" and capability is None:
        return "reference"
    cap = tuple(capability) if capability is not None else _device_capability(device)
    need = _NATIVE_FROM[recipe.kind]
    if cap >= need:
        return "native"
    if not allow_emulation:
        native = [k for k, v in _NATIVE_FROM.items() if cap >= v]
        raise NotImplementedError(
            f"recipe: {type(recipe).__name__} ({recipe.kind}) is not native on compute capability sm_{cap[0]}{cap[1]} "
            f"(needs sm_{need[0]}{need[1]}); natively supported here: {native or 'none'}. "
            "Pass allow_emulation=True to run it emulated."
        )
    key = f"{recipe.kind}@{cap}"
    if key not in _notices:
        _notices.add(key)
        warnings.warn(
            f"lowbit: {type(recipe).__name__} is emulated on sm_{cap[0]}{cap[1]} (native from sm_{need[0]}{need[1]}): "
            "same numbers, lower speed.",
            stacklevel=3,
        )
    return "emulated"


# ------------------------------------------------------------------------------------------------
# NaN sentry
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NonFiniteEvent:
    """A non-finite amax seen during quantization.

    Attributes:
        layer: qualified module name (set by :func:`lowbit.convert` / :func:`lowbit.nn.name_modules`),
            else a description of the module.
        role: ``"input"``, ``"weight"`` or ``"grad_output"``.
        phase: ``"forward"`` or ``"backward"``.
        step: :func:`step` when it happened (outermost autocast exits so far).
        amax: the amax value (nan or inf).
        policy: the ``on_nonfinite`` policy it was recorded under: ``"skip"`` (the loop should skip the step) or
            ``"ignore"`` (recorded only; nothing stops). ``"raise"`` for a raise-policy event that
            :func:`nonfinite_events` collected before it was raised.
    """

    layer: str
    role: str
    phase: str
    step: int
    amax: float
    policy: str = "skip"

    def __str__(self):
        return (f"non-finite amax ({self.amax}) of {self.role} in layer {self.layer!r} ({self.phase}, autocast step "
                f"{self.step})")


class NonFiniteAmaxError(FloatingPointError):
    """Raised when quantization measures a NaN/Inf amax and ``on_nonfinite="raise"``; ``.event`` has the details."""

    def __init__(self, event: NonFiniteEvent):
        self.event = event
        self.layer, self.role, self.phase, self.step = event.layer, event.role, event.phase, event.step
        super().__init__(
            f"{event}: the {event.role} tensor holds NaN or Inf. Use lowbit.autocast(on_nonfinite='skip') to record "
            "the event (lowbit.nn.nonfinite_events()) and skip the step instead."
        )


_events: list[NonFiniteEvent] = []


def nonfinite_events() -> list[NonFiniteEvent]:
    """Return and clear the non-finite amax events recorded with ``on_nonfinite="skip"`` or ``"ignore"``.

    A training loop calls it after the backward: an event whose ``policy`` is ``"skip"`` means "skip this optimizer
    step"; ``"ignore"`` events are the same record of what happened, for a loop that chose to go on (logging them).
    It waits for the pending checks (see :func:`check_nonfinite`); "ignore" adds no check of its own.
    """
    try:
        check_nonfinite()
    except NonFiniteAmaxError as e:  # raise-policy events still pending: report them as events here
        with _lock:
            _events.append(e.event)
    with _lock:
        out = list(_events)
        _events.clear()
        _maxes.clear()
    return _dropped_checks() + out


class _Taken:
    """What :func:`take_checks` took (the checks in flight, their events read already, deferred errors), shared by its
    :class:`StepChecks` and ``_TAKEN``, which keeps it for :func:`nonfinite_events` if the StepChecks is dropped
    unread (its events reported, not lost, and its pinned slots given back)."""

    __slots__ = ("queue", "events", "errors")

    def __init__(self, queue: list, events: list, errors: list):
        self.queue, self.events, self.errors = queue, events, errors

    def read(self) -> list:
        out = self.events + _read(self.queue, wait=True) + self.errors
        self.queue, self.events, self.errors = [], [], []
        return out


_TAKEN: list = []  # (weak reference to a StepChecks, its _Taken), while its events are unread


def _dropped_checks() -> list:
    """The events of the checks of every StepChecks garbage-collected unread (waits for them), oldest first."""
    with _lock:
        dead = [t for ref, t in _TAKEN if ref() is None]
        _TAKEN[:] = [(ref, t) for ref, t in _TAKEN if ref() is not None]
    out = []
    for t in dead:
        out += t.read()
    return out


class StepChecks:
    """The sentry's checks of one stretch of work (a training step), taken out of its queue by :func:`take_checks`.

    Attributes:
        amax_max: (1,) float32 on the checked amaxes' device, the max of every amax they checked: finite iff all
            are (the sentry's own test); None where nothing was checked. Nothing reads it: a skip decision made on
            the device (``found_inf`` of a fused optimizer) takes it as it is.
    """

    def __init__(self, amax_max, queue: list, events: list, errors: list):
        self.amax_max = amax_max
        self._taken = _Taken(queue, events, errors)
        if queue or events or errors:
            with _lock:
                _TAKEN.append((weakref.ref(self), self._taken))

    def events(self) -> list[NonFiniteEvent]:
        """Wait for these checks alone and return their events, as :func:`nonfinite_events` would have returned
        them (raise-policy ones included, never raised); later calls return nothing. A StepChecks dropped without
        this call loses nothing: the next :func:`nonfinite_events` reports its events."""
        with _lock:
            _TAKEN[:] = [(ref, t) for ref, t in _TAKEN if t is not self._taken]
        return self._taken.read()


def take_checks() -> StepChecks:
    """Take every check queued since the last :func:`take_checks` or :func:`nonfinite_events` (the records not
    checked yet are checked first) out of the sentry's queue, without waiting for the device, as a
    :class:`StepChecks`: its ``amax_max`` for a skip decision on the device now, its events read later. The checks
    queued after this call are not among them, so a loop may launch its next step before it reads this one's events.
    Not inside a CUDA-graph capture."""
    if _cuda_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("take_checks: called inside a CUDA-graph capture (nothing may be read back there)")
    recs = _take_unchecked()
    if recs:
        _launch_check(recs)
    _slots_check()
    with _lock:
        queue, events, maxes = list(_inflight), list(_events), list(_maxes)
        _inflight.clear()
        _events.clear()
        _maxes.clear()
        errors = list(_deferred_error)
        _deferred_error.clear()
    amax_max = None
    if maxes:
        amax_max = maxes[0] if len(maxes) == 1 else _max_of(maxes)
    return StepChecks(amax_max, queue, events, errors)


# Deferred checks: quantization only records (layer, role, phase, step, policy, amax tensors) — no device
# work and no sync per tensor. The forward's records are checked once at the outermost autocast exit, the
# backward's once at the end of the backward pass (an autograd-engine callback). On CUDA that check is
# itself asynchronous: one cat + max over all recorded amaxes, copied to a pinned host slot with an event;
# the result is read at a later check point once the GPU has passed the event (or at once by
# nonfinite_events() / check_nonfinite(wait=True), which wait for it). LOWBIT_SENTRY_SYNC=1 makes every
# check wait (the error then surfaces at the exit of the step that produced it, at one sync per check).
_unchecked: list[tuple] = []
_boundary_queued = False  # a check is queued for the end of the running backward pass
_inflight: list[tuple] = []  # (records, max of their amaxes (1,) on the host, cuda event or None, ring slot or None,
#   their amaxes flattened at the check), oldest first
_maxes: list = []  # the device max of every check queued since the last take_checks() / nonfinite_events()
_MAXES_KEPT = 64  # more are folded into one (a program that never reads its events keeps no more than this)


def _take_unchecked() -> list[tuple]:
    """The records not checked yet, taken out of ``_unchecked`` for a check; any check clears ``_boundary_queued``
    (see :func:`sentry`)."""
    global _boundary_queued
    _boundary_queued = False
    with _lock:
        recs = list(_unchecked)
        _unchecked.clear()
    return recs


def sentry(amax, *, layer: str, role: str, phase: str, policy: str) -> None:
    """Record amaxes measured by quantization for the NaN sentry (checked later, see :func:`check_nonfinite`).

    ``amax``: a float32 tensor, or a list/tuple of them (e.g. one per quantized copy); not read here.
    ``layer``: the layer's name, or an object with a ``.name`` (read only if a fault is found; the record holds a weak
    reference to it, so a queued check keeps no layer, and no model, alive).
    ``policy``: ``"raise"``, ``"skip"``, ``"ignore"`` (all three recorded and checked alike; only the outcome
    differs), or one of them under :func:`graph_policy` (an operator inside torch.compile's CUDA graphs: the amaxes
    go to the device's board); ``"off"`` records nothing (:func:`sentry_off`).
    """
    if sentry_off(policy):
        return
    amaxes = tuple(amax) if isinstance(amax, (list, tuple)) else (amax,)
    if policy.startswith(GRAPH_PREFIX):  # (an operator inside torch.compile's CUDA graphs: graph_policy)
        _board_record(amaxes, layer, role, phase, policy[len(GRAPH_PREFIX):])
        return
    if not isinstance(layer, str):
        # (a check stays queued until a later check point reads it: a model freed before then must be freed; a
        # GemmLayer holds its module, and the module its weights)
        try:
            layer = weakref.ref(layer)
        except TypeError:  # (an object that takes no weak reference: its name now)
            layer = layer.name
    with _lock:
        _unchecked.append((layer, role, phase, _step, policy, amaxes))
    global _boundary_queued
    if phase == "backward" and not _boundary_queued:
        # Checked when this backward pass ends (every GEMM's records at once): one callback per backward
        # (any check clears the flag, so a backward that failed before its callback ran cannot leave it set).
        try:
            torch.autograd.Variable._execution_engine.queue_callback(_check_at_boundary)
            _boundary_queued = True
        except RuntimeError:  # not inside a backward pass (a direct call): check now
            check_nonfinite()


def _record_name(layer) -> str:
    """The layer name of a record: a name as given, or the name of the layer its weak reference points to."""
    if isinstance(layer, str):
        return layer
    obj = layer()
    return "<a layer freed before its check was read>" if obj is None else obj.name


def _check_at_boundary() -> None:
    try:
        check_nonfinite(wait=env.get("LOWBIT_SENTRY_SYNC"))
    except NonFiniteAmaxError:
        if _depth == 0:
            # A failed backward's gradient amaxes (NaN/Inf among them) must not wait for the next exit: a NaN
            # pending max would mask the next step's finite amaxes. Inside autocast the exception leaves the
            # context, whose exit drops the step's amaxes instead.
            _drop_pending({})
        raise


class _PinnedRing:
    """Reusable pinned host slots for the sentry's asynchronous device-to-host copies.

    Allocating pinned memory (cudaHostAlloc) synchronizes the device, so slots are allocated once and
    reused after the check that used them was read (see :func:`_drain`).
    """

    def __init__(self, n: int = 64):
        self.n = n
        self.buf: torch.Tensor | None = None
        self.free: list[int] = []

    def take(self) -> tuple[torch.Tensor, int] | None:
        if self.buf is None:
            with torch.inference_mode(False):  # (a first check under inference_mode: later ones copy in outside it)
                self.buf = torch.empty(self.n, dtype=torch.float32, pin_memory=True)
            self.free = list(range(self.n))
        if not self.free:
            return None
        i = self.free.pop()
        return self.buf[i:i + 1], i

    def give(self, i: int) -> None:
        self.free.append(i)


_ring = _PinnedRing()


def _flat(parts: list) -> torch.Tensor:
    """The amax tensors ``parts`` flattened into one 1-D tensor, in order."""
    try:  # the usual case: float32 (1,) amaxes on one device -> one cat (1-D ones as they are: no op a part)
        return torch.cat([p if p.dim() == 1 and not p.requires_grad else p.detach().reshape(-1) for p in parts])
    except RuntimeError:  # mixed devices / dtypes
        dev = parts[0].device
        return torch.cat([p.detach().reshape(-1).to(dev, torch.float32) for p in parts])


class _Gather:
    """A snapshot plan for a fixed list of (1,) float32 amax tensors that are views into a few buffers (a captured
    graph's records: the amax arena's slots, the optimizer's slots): one slice a run of consecutive elements, so a
    snapshot is one cat of a few slices instead of one input a tensor (288 in a 1.3b step: five cat kernels and a
    Python loop over the parts, every step). :meth:`values` maps a snapshot back to the parts' order (the error
    path). Parts that are not all such views keep the plain cat of :func:`_flat`."""

    def __init__(self, parts: list):
        self.parts, self.slices, self.index = parts, None, None
        where, runs = [], {}
        for p in parts:
            if not (isinstance(p, torch.Tensor) and p.dtype == torch.float32 and p.numel() == 1):
                return
            st = p.untyped_storage()
            off = p.data_ptr() - st.data_ptr()
            if off % 4:
                return
            key = (st.data_ptr(), p.device)
            runs.setdefault(key, (st, set()))[1].add(off // 4)
            where.append((key, off // 4))
        slices, pos, at = [], {}, 0
        for key, (st, elems) in runs.items():
            base = torch.empty(0, dtype=torch.float32, device=key[1]).set_(st, 0, (st.nbytes() // 4,), (1,))
            es = sorted(elems)
            lo = prev = es[0]
            for e in es[1:] + [None]:  # maximal runs of consecutive elements
                if e is not None and e == prev + 1:
                    prev = e
                    continue
                slices.append(base[lo:prev + 1])
                for k in range(lo, prev + 1):
                    pos[(key, k)] = at + k - lo
                at += prev + 1 - lo
                if e is not None:
                    lo = prev = e
        self.slices = slices
        self.index = torch.tensor([pos[w] for w in where], dtype=torch.int64)

    def snapshot(self) -> torch.Tensor:
        """The amaxes' current values, copied (1-D; in the parts' order only without a plan)."""
        if self.slices is None:
            return _flat(self.parts)
        return torch.cat(self.slices) if len(self.slices) > 1 else self.slices[0].clone()

    def values(self, snap: torch.Tensor) -> torch.Tensor:
        """A snapshot on the host, in the parts' order."""
        return snap if self.index is None else snap[self.index]


class _Snap:
    """A check's snapshot with its plan (see :class:`_Gather`)."""

    __slots__ = ("snap", "gather")

    def __init__(self, snap, gather):
        self.snap, self.gather = snap, gather


def _max_of(parts: list) -> torch.Tensor:
    """(1,) float32: the max of the amax tensors ``parts`` (finite iff all are: NaN propagates through max, amaxes
    are >= 0)."""
    return _flat(parts).max().reshape(1)


def _launch_check(recs: list, gather: "_Gather | None" = None) -> None:
    """Queue one finiteness check over every amax of ``recs``: the max of all of them (NaN propagates
    through max, amaxes are >= 0, so the max is finite iff all are), copied asynchronously on CUDA. The
    flattened amaxes are kept with the check: a fault is attributed to its layers from these values, which
    later work cannot change (a CUDA graph's next replay rewrites the recorded tensors, possibly before the host
    reads this check)."""
    if gather is not None:
        snap = gather.snapshot()
        mx, flat = snap.max().reshape(1), _Snap(snap, gather)
    else:
        flat = _flat([a for r in recs for a in r[5]])
        mx = flat.max().reshape(1)
    with _lock:
        _maxes.append(mx)
        if len(_maxes) > _MAXES_KEPT:
            _maxes[:] = [_max_of(_maxes)]
    if mx.is_cuda:
        slot = _ring.take()
        if slot is None:  # every slot in flight: read the oldest checks first (this waits)
            _drain(True, raise_errors=False)
            slot = _ring.take()
        if slot is None:  # every slot held by checks take_checks() took: one more (allocating it synchronizes)
            with torch.inference_mode(False):
                slot = torch.empty(1, dtype=torch.float32, pin_memory=True), None
        host, i = slot
        host.copy_(mx, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        _inflight.append((recs, host, ev, i, flat))
    else:
        _inflight.append((recs, mx, None, None, flat))


_deferred_error: list = []  # a "raise" event read while draining for a free slot, raised at the next check


def _drain(wait: bool, raise_errors: bool = True) -> None:
    """Read the finished checks (all of them when ``wait``), oldest first; raise the first "raise" event."""
    first_error = _deferred_error.pop(0) if (raise_errors and _deferred_error) else None
    for ev_ in _read(_inflight, wait):
        if ev_.policy == "raise":
            first_error = first_error or ev_
        else:
            with _lock:
                _events.append(ev_)
    if first_error is not None:
        if raise_errors:
            raise NonFiniteAmaxError(first_error)
        _deferred_error.append(first_error)


def _read(queue: list, wait: bool) -> list[NonFiniteEvent]:
    """Read the finished checks of ``queue`` (all of them when ``wait``), oldest first, taking them out of it; the
    events of their non-finite amaxes, every policy."""
    out = []
    while True:
        with _lock:
            if not queue:
                break
            recs, mx, ev, slot, flat = queue[0]
            if ev is not None and not wait and not ev.query():
                break
            queue.pop(0)
        if ev is not None:
            ev.synchronize()  # no-op when query() said done
        finite = math.isfinite(float(mx[0]))
        if slot is not None:
            _ring.give(slot)
        if finite:
            continue
        # (the error path reads the checked values: a copy, only when one is non-finite)
        flat = flat.gather.values(flat.snap.float().cpu()) if isinstance(flat, _Snap) else flat.float().cpu()
        at = 0
        for layer, role, phase, step_, policy, amaxes in recs:
            n = sum(a.numel() for a in amaxes)
            vals, at = flat[at:at + n], at + n
            vals = vals[~torch.isfinite(vals)]
            if not vals.numel():
                continue
            out.append(NonFiniteEvent(layer=_record_name(layer), role=role,
                                      phase=phase, step=step_, amax=float(vals.abs().max()), policy=policy))
    return out


def check_nonfinite(wait: bool = True) -> None:
    """Check every recorded amax: a non-finite one raises :class:`NonFiniteAmaxError` (policy ``"raise"``)
    or becomes a :class:`NonFiniteEvent` (policies ``"skip"`` and ``"ignore"``).

    Args:
        wait: wait for the GPU to finish the checked work (one sync). False queues the check and reports
            only the checks the GPU has already finished; the rest are reported by a later call.
            CPU tensors are always checked at once.
    """
    recs = _take_unchecked()
    if _cuda_available() and torch.cuda.is_current_stream_capturing():
        # Inside CUDA-graph capture nothing may be read back, not even whether an earlier check has finished (an
        # event query invalidates the capture): keep the records; every replay rewrites the same amax tensors,
        # which check_captured() checks after each replay. Earlier checks are read at the next call outside.
        if recs:
            with _lock:
                _captured.extend(recs)
                _captured_gather[0] = None
        return
    if recs:
        _launch_check(recs)
    _slots_check()
    _drain(wait)


_captured: list[tuple] = []
_captured_gather: list = [None]  # the _Gather of _captured's amaxes, built at the first check after a change


def _gather_captured() -> "_Gather | None":
    """The snapshot plan of the captured records' amaxes (None without records); call under _lock."""
    g = _captured_gather[0]
    if g is None:
        parts = [a for rec in _captured for a in rec[5]]
        if not parts:
            return None
        g = _captured_gather[0] = _Gather(parts)
    return g


def check_captured(wait: bool = True) -> None:
    """After a CUDA-graph replay: check the amaxes recorded while the graph was captured (their tensors
    hold the replay's values), like :func:`check_nonfinite`."""
    with _lock:
        recs = list(_captured)
        gather = _gather_captured()
    if recs:
        _launch_check(recs, gather)
    _drain(wait)


def captured_amax_max() -> torch.Tensor | None:
    """(1,) float32, the max of the amaxes recorded while a CUDA graph was captured (each replay rewrites them),
    finite iff all are, as the sentry's own check computes it; None without records. For a device-side skip
    decision inside a later graph (``lowbit train``'s captured optimizer step)."""
    with _lock:
        gather = _gather_captured()
    return None if gather is None else gather.snapshot().max().reshape(1)


def clear_captured() -> None:
    """Forget the records of a captured graph (when the graph is dropped)."""
    with _lock:
        _captured.clear()
        _captured_gather[0] = None


def pending_checks() -> int:
    """Number of queued sentry checks the GPU has not been waited for (see :func:`check_nonfinite`)."""
    with _lock:
        return len(_inflight) + (1 if _unchecked else 0)


# ------------------------------------------------------------------------------------------------
# the sentry inside torch.compile's CUDA graphs
# ------------------------------------------------------------------------------------------------
# An operator replayed from torch.compile's CUDA graph trees (mode="reduce-overhead") runs no Python, and a tensor it
# allocates must not outlive the graph. So there the sentry copies each amax into a slot of a per-device board
# allocated outside any graph (at the outermost autocast entry), one slot per (layer, role, phase, copy): the graph
# rewrites its slots at every replay, and every outermost autocast exit checks the whole board (one check, as for
# the eager records) and zeroes it. A backward's slots are checked at the next exit (one step late).
BOARD_SLOTS = 4096  # amaxes a device's board holds (a 1.3b model's step records about 300)
_boards: dict = {}  # device index -> float32 (BOARD_SLOTS,) board
_board_slots: dict = {}  # (device index, id(layer), role, phase) -> (record's first slot, layer ref, policy, count)
_board_parts: list = [None]  # [(records without their step, their _Gather)], rebuilt when a slot is taken or freed
_board_free: dict = {}  # device index -> [[first slot, count], ...]: ranges of layers that were freed
_board_next: dict = {}  # device index -> the first slot no layer has taken yet
_board_dead: list = []  # keys of layers garbage-collected since (appended by their weakref callbacks)
GRAPH_PREFIX = "graph-"
_OFF = ("off", GRAPH_PREFIX + "off")


def sentry_off(policy: str) -> bool:
    """Whether ``policy`` (an ``on_nonfinite``, or one under :func:`graph_policy`) records nothing: ``"off"``."""
    return policy in _OFF


def graph_policy(policy: str) -> str:
    """The sentry policy an operator passes while torch.compile's CUDA graphs record it (``policy`` applies to what
    the board's check finds): its amaxes go to the board instead of the eager records."""
    return GRAPH_PREFIX + policy


def prepare_board() -> None:
    """Allocate the current CUDA device's board (once CUDA is initialized) unless it exists or a CUDA graph pool is
    allocating now; called at the outermost autocast entry."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    idx = torch.cuda.current_device()
    dev = torch.device("cuda", idx)
    if idx in _boards or in_graph_pool(dev):
        return
    with torch.inference_mode(False):  # (an entry under inference_mode: graphs recorded outside it write the board)
        _boards[idx] = torch.zeros(BOARD_SLOTS, dtype=torch.float32, device=dev)


def _board_layer_ref(layer, key):
    """What a board slot keeps of its layer: a weak reference (the slots must not keep a model alive; its key is freed
    when the layer goes), or the layer's name where it is one."""
    if isinstance(layer, str):
        return layer
    return weakref.ref(layer, lambda _r, k=key: _board_dead.append(k))


def _board_layer(ref):
    """The layer (or name) a slot's reference points to, None once the layer is gone."""
    return ref if isinstance(ref, str) else ref()


def _board_purge() -> None:
    """Free the slots of garbage-collected layers (under ``_lock``); a freed range is reused by later layers."""
    while _board_dead:
        key = _board_dead.pop()
        ent = _board_slots.pop(key, None)
        if ent is not None:
            _board_free.setdefault(key[0], []).append([ent[0], ent[3]])
            _board_parts[0] = None


def _board_take(idx: int, n: int) -> int | None:
    """The first of ``n`` free consecutive slots of device ``idx``'s board (under ``_lock``), or None: full."""
    for r in _board_free.get(idx, ()):
        if r[1] >= n:
            at = r[0]
            r[0], r[1] = r[0] + n, r[1] - n
            if not r[1]:
                _board_free[idx].remove(r)
            return at
    at = _board_next.get(idx, 0)
    if at + n > BOARD_SLOTS:
        return None
    _board_next[idx] = at + n
    return at


def _board_record(amaxes, layer, role: str, phase: str, policy: str) -> None:
    """Copy ``amaxes`` into their slots of the board (taking the slots at the first call of this layer, role and
    phase): the graph being recorded repeats the copies at every replay."""
    dev = amaxes[0].device
    idx = dev.index
    board = _boards.get(idx)
    if board is None:
        warn_once(f"lowbit: the NaN sentry is off inside torch.compile's CUDA graphs on cuda:{idx}: no "
                   "lowbit.autocast was entered with that device current before the graphs were recorded")
        return
    key = (idx, id(layer), role, phase)
    with _lock:
        _board_purge()
        ent = _board_slots.get(key)
        if ent is None:
            at = _board_take(idx, len(amaxes))
            if at is not None:
                ent = _board_slots[key] = (at, _board_layer_ref(layer, key), policy, len(amaxes))
                _board_parts[0] = None
    if ent is None:
        warn_once(f"lowbit: the NaN sentry's board inside CUDA graphs on cuda:{idx} is full ({BOARD_SLOTS} "
                   "amaxes): the layers recorded after that are not checked")
        return
    at = ent[0]
    for i, a in enumerate(amaxes):  # (1-D maxima, e.g. one a kernel program: their max, NaN above Inf)
        board[at + i:at + i + 1].copy_(a.reshape(1) if a.numel() == 1 else amax_value(a.detach()))


def _board_check() -> None:
    """Queue one check of every board slot taken (records with the current step), then zero the boards."""
    with _lock:
        _board_purge()
        parts = _board_parts[0]
        if parts is None:
            recs = []
            for (idx, _, role, phase), (at, ref, policy, n) in _board_slots.items():
                layer = _board_layer(ref)
                if layer is None:  # (gone since the purge above: its callback runs next time)
                    continue
                b = _boards[idx]  # (the records name their layer: they must not keep it alive)
                recs.append((layer if isinstance(layer, str) else layer.name, role, phase, policy,
                             tuple(b[at + i:at + i + 1] for i in range(n))))
            parts = _board_parts[0] = (recs, _Gather([a for r in recs for a in r[4]]))
    recs, gather = parts
    if not recs:  # (every slot's layer is gone: nothing to check)
        return
    _launch_check([(layer, role, phase, _step, policy, a) for layer, role, phase, policy, a in recs], gather)
    for b in _boards.values():
        b.zero_()  # (after the check's snapshot, in stream order)


# ------------------------------------------------------------------------------------------------
# slots: the amaxes a compiled graph records in itself
# ------------------------------------------------------------------------------------------------
# A layer that torch.compile traces (lowbit.nn.functional's traced linear) records its amaxes inside the graph: each
# role's amax max-accumulated into the layer's own int32 (1,) slot for that role (float32 bits; blockwise: by the
# quantize kernel's own atomic max, no launch of its own), no Python per call, a running max until a check zeroes it
# (a layer called twice, or two backwards, before a check: every call is checked). A holder (the layer's GemmLayer)
# registers once; its slots are allocated at the next outermost autocast entry on its weight's device (before any
# graph is traced: a graph must find them there) and again after its module moves (:func:`slots_stale`). The traced
# code sets the holder's ``sentry_armed`` to its policy (Dynamo replays that assignment every call); every check (the
# outermost exit, the end of a backward, ``nonfinite_events``, ``take_checks``) snapshots the armed holders' slots in
# one cat and zeroes them, so each amax is checked once: the forward's at the exit, the backward's at the next check
# after it.
SENTRY_SLOT_ROLES = (("input", "forward"), ("weight", "forward"), ("grad_output", "backward"))
"""(role, phase) of each of a holder's slot tensors ``sentry_slots`` (int32 (1,) each: float32 bits)."""
_slot_holders: "weakref.WeakSet" = weakref.WeakSet()
_slots_new: "weakref.WeakSet" = weakref.WeakSet()
_delayed_new: "weakref.WeakSet" = weakref.WeakSet()  # holders whose delayed-scaling state may be missing or moved
_holder_seq: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # holder -> registration order


def register_slot_holder(holder) -> None:
    """Register ``holder`` (an object with ``sentry_slots`` (None, or a tensor per :data:`SENTRY_SLOT_ROLES` entry),
    ``sentry_armed``, ``name`` and ``weight()``): its slots are allocated at the next outermost autocast entry."""
    with _lock:
        _slot_holders.add(holder)
        _slots_new.add(holder)
        _delayed_new.add(holder)
        _holder_seq[holder] = next(_delayed_seq)


def slots_stale(holder) -> None:
    """``holder``'s weight may have moved (its module's ``.to()``): allocate its slots again at the next entry."""
    with _lock:
        if holder in _slot_holders:
            _slots_new.add(holder)
            _delayed_new.add(holder)


def _prepare_slots() -> None:
    """Allocate the slots of the holders registered or moved since the last entry, on their weights' devices."""
    if not _slots_new:
        return
    with _lock:
        todo = list(_slots_new)
    for h in todo:
        w = h.weight()
        if not isinstance(w, torch.Tensor) or w.device.type == "meta" or in_graph_pool(w.device):
            continue
        slots = h.sentry_slots
        if slots is None or slots[0].device != w.device:
            with torch.inference_mode(False):  # (an entry under inference_mode: the checks zero them outside it)
                slots = tuple(torch.zeros(1, dtype=torch.int32, device=w.device) for _ in SENTRY_SLOT_ROLES)
            if w.is_cuda:  # (a graph that writes them keeps its CUDA graphs: inputs at fixed addresses)
                for t in slots:
                    torch._dynamo.mark_static_address(t)
            h.sentry_slots = slots
        with _lock:
            _slots_new.discard(h)


def _prepare_delayed(recipe: DelayedScaling) -> None:
    """Give each holder registered or moved since the last DelayedScaling entry its delayed-scaling state on its
    weight's device (``holder.delayed_state``), in registration order: a compiled graph reads the state's tensors and
    cannot allocate them."""
    if not _delayed_new:
        return
    with _lock:
        todo = sorted(_delayed_new, key=lambda h: _holder_seq.get(h, 0))
    for h in todo:
        w = h.weight()
        if not isinstance(w, torch.Tensor) or w.device.type == "meta" or in_graph_pool(w.device):
            continue
        st = h.delayed
        if st is None:
            with torch.inference_mode(False):
                st = h.delayed_state(recipe, w.device)
        elif st.device != w.device:
            st._to(w.device)
        if w.is_cuda:  # (graph inputs a CUDA graph mutates: static, as the sentry's slots, or torch skips the graphs)
            for hist in st.histories.values():
                torch._dynamo.mark_static_address(hist.device_state)
        with _lock:
            _delayed_new.discard(h)


_slots_plan: list = [None]  # (holders' weak references, their policies, their slot tuples, [(records without their
#   step, _Gather, the slots' .data) per device]): rebuilt when the armed holders, their policies or their slot
#   tensors change


def _slots_plan_for(armed: list) -> list:
    plan = _slots_plan[0]
    if plan is not None and len(plan[0]) == len(armed) and all(
            r() is h and p == h.sentry_armed and t is h.sentry_slots
            for r, p, t, h in zip(plan[0], plan[1], plan[2], armed)):
        return plan[3]
    by_device: dict = {}
    for h in armed:
        by_device.setdefault(h.sentry_slots[0].device, []).append(h)
    groups = []
    for hs in by_device.values():  # (one check a device: a snapshot is one cat)
        recs = [(h.name, role, phase, h.sentry_armed, (t.view(torch.float32),))  # (names, as the board's: no layer
                for h in hs for t, (role, phase) in zip(h.sentry_slots, SENTRY_SLOT_ROLES)]  # kept)
        # (.data: its own version counter. A graph saves the backward's slots for its backward, which only
        # updates them in place; zeroing them through the tensor itself would bump the version that backward checks)
        groups.append((recs, _Gather([r[4][0] for r in recs]), [t.data for h in hs for t in h.sentry_slots]))
    _slots_plan[0] = ([weakref.ref(h) for h in armed], [h.sentry_armed for h in armed],
                      [h.sentry_slots for h in armed], groups)
    return groups


def _slots_check() -> None:
    """Queue one check of the armed holders' slots a device (records with the current step), then zero them."""
    armed = [h for h in list(_slot_holders) if h.sentry_armed and h.sentry_slots is not None]
    if not armed:
        return
    for recs, gather, data in _slots_plan_for(armed):
        _launch_check([(h, role, phase, _step, policy, a) for h, role, phase, policy, a in recs], gather)
        torch._foreach_zero_(data)  # (after the check's snapshot, in stream order)


# ------------------------------------------------------------------------------------------------
# delayed scaling state
# ------------------------------------------------------------------------------------------------
class DelayedScalingState:
    """Amax histories of the three roles of one GEMM layer under :class:`DelayedScaling`.

    ``histories[role]`` is an :class:`lowbit.AmaxHistory` (float32 ``history`` (L,), ``device_state`` (3,) =
    [scale, steps, pending], updated in place); ``pending[role]`` the max amax observed eagerly since the last commit
    (float32 (1,)) or None. ``compiled``: a compiled graph (the traced linear) reads the scales and folds its amaxes
    into the histories' device ``pending`` itself, with no Python per call; from then on every outermost autocast
    exit commits them on the device, where there are any (:meth:`AmaxHistory.record_pending`).
    """

    def __init__(self, recipe: DelayedScaling, device=None):
        self.recipe = recipe
        self.histories = {
            role: AmaxHistory(recipe.amax_history_len, recipe.amax_compute_algo, recipe.margin, rq.scheme.fmt,
                              device=device)
            for role, rq in recipe.roles().items()
        }
        self.pending: dict[str, torch.Tensor | None] = {r: None for r in self.histories}
        self.compiled = False
        self.seq = next(_delayed_seq)
        _delayed_states.add(self)

    def __setstate__(self, state: dict) -> None:
        """A copy (``copy.deepcopy`` of its module, unpickling) is a state of its own: registered, with its own place
        in the commit order."""
        self.__dict__.update(state)
        self.seq = next(_delayed_seq)
        _delayed_states.add(self)

    @property
    def device(self) -> torch.device:
        return next(iter(self.histories.values())).history.device

    def compatible(self, recipe: DelayedScaling) -> bool:
        r = self.recipe
        return (r.amax_history_len, r.amax_compute_algo, r.margin, r.fp8_format) == (
            recipe.amax_history_len, recipe.amax_compute_algo, recipe.margin, recipe.fp8_format)

    def retarget(self, recipe: DelayedScaling) -> None:
        """Adopt ``recipe`` (same history settings; e.g. another warm-up or reduce_amax)."""
        self.recipe = recipe

    def _to(self, device) -> None:
        for h in self.histories.values():
            if h.history.device != device:
                h.to(device)

    def scale(self, role: str, device) -> torch.Tensor | None:
        """The delayed scale for ``role`` (float32 (1,)), or None while warming up (use current scaling)."""
        h = self.histories[role]
        if h.steps < self.recipe.warmup_steps:
            return None
        self._to(device)
        return h.scale

    def observe(self, role: str, amax: torch.Tensor) -> None:
        """Fold an amax measured now into the pending max (NaN propagates; the sentry reports it)."""
        a = amax.detach().float().reshape(1)
        p = self.pending[role]
        self.pending[role] = a.clone() if p is None else torch.maximum(p, a.to(p.device))
        with _lock:
            _pending.setdefault(id(self), self)

    def has_pending(self) -> bool:
        return any(p is not None for p in self.pending.values())

    def _commits(self, amaxes: dict[str, torch.Tensor]) -> list:
        """``(history, amax or None)`` of each role to record with :func:`lowbit.quant.scaling.record_pending_many`
        (every role of a compiled state: its device pending amaxes decide; a non-finite amax is recorded as 0, the
        scale staying where it was); the eager pending amaxes are dropped."""
        out = [(h, amaxes.get(role)) for role, h in self.histories.items() if self.compiled or role in amaxes]
        self.pending = dict.fromkeys(self.pending)
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Plain tensors: ``{role}.history``, ``{role}.scale``, ``{role}.steps``, ``{role}.pending`` (NaN-free; -1 =
        none)."""
        out = {}
        for role, h in self.histories.items():
            for k, v in h.state_dict().items():
                out[f"{role}.{k}"] = v
            p = h.device_state[2:3]
            if self.pending[role] is not None:
                p = torch.maximum(p, self.pending[role].to(p.device))
            out[f"{role}.pending"] = p.detach().cpu().clone()
        return out

    def load_state_dict(self, sd: dict) -> None:
        for role, h in self.histories.items():
            try:
                h.load_state_dict({k: sd[f"{role}.{k}"] for k in ("history", "scale", "steps")})
            except KeyError as e:
                raise ValueError(f"state: missing delayed-scaling entry {e.args[0]!r}") from None
            p = sd.get(f"{role}.pending")
            self.pending[role] = None if p is None or float(p.reshape(-1)[0]) < 0 else p.float().reshape(1).clone()
        if self.has_pending():
            with _lock:
                _pending.setdefault(id(self), self)
                if _carried is not None:
                    # Loaded inside a step (a checkpoint's state is built lazily by the first forward after
                    # the load): the checkpoint's pending amaxes belong to the steps before, so they survive
                    # this step failing like any other carried amax.
                    _carried[id(self)] = (self, dict(self.pending))


_delayed_states: "weakref.WeakSet[DelayedScalingState]" = weakref.WeakSet()
_delayed_seq = itertools.count()


def _compiled_states() -> list[DelayedScalingState]:
    """The compiled states in creation order (the same on every rank: they are made in the layers' order)."""
    return sorted((st for st in list(_delayed_states) if st.compiled), key=lambda st: st.seq)


def _snapshot_compiled() -> tuple | None:
    """The compiled states' device pending amaxes now (one copy), to restore if the step fails."""
    views = [h.device_state.data[2:3] for st in _compiled_states() for h in st.histories.values()]
    return (views, torch.cat(views)) if views else None


def _restore_compiled(snap: tuple | None) -> None:
    if snap is not None:
        views, saved = snap
        torch._foreach_copy_(views, list(saved.split(1)))


def _snapshot_pending() -> dict[int, tuple]:
    """What is pending now, to roll back to with :func:`_drop_pending` (observe() never modifies a pending
    tensor in place, so keeping the references is enough)."""
    with _lock:
        return {k: (st, dict(st.pending)) for k, st in _pending.items()}


def _drop_pending(keep: dict[int, tuple]) -> None:
    """Forget every pending amax observed since ``keep`` (a :func:`_snapshot_pending`; ``{}``: all of them)."""
    with _lock:
        states = list(_pending.values())
        _pending.clear()
        for st in states:
            st.pending = dict.fromkeys(st.pending)
        for k, (st, saved) in keep.items():  # in the snapshot's order: the collective's order on every rank
            st.pending = dict(saved)
            _pending[k] = st


def _commit_pending(group) -> None:
    """Outermost exit: reduce the pending amaxes across ``group`` (one collective) and update the histories: the eager
    ones observed since the last commit, and every compiled state's device pending amaxes (where there are any)."""
    with _lock:
        states = list(_pending.values())
        _pending.clear()
    compiled = _compiled_states()
    entries = [(st, role) for st in states for role, p in st.pending.items() if p is not None]
    if not entries and not compiled:
        return
    amaxes = [st.pending[role] for st, role in entries]  # (observe() made them fresh tensors; commit drops them)
    # (every rank reduces the same list in the same order: eager states in observation order, compiled ones in
    # creation order, their pending amaxes in place, -1 where none)
    reduced = [(st, a) for (st, _), a in zip(entries, amaxes)] + [
        (st, h.device_state.data[2:3]) for st in compiled for h in st.histories.values()]
    idx = [i for i, (st, _) in enumerate(reduced) if st.recipe.reduce_amax]
    if idx:
        # States whose recipe opted out are left out of the collective (every rank runs the same layers).
        ts = [reduced[i][1] for i in idx]
        dev = ts[0].device
        moved = [t if t.device == dev else t.to(dev) for t in ts]  # pack on one device
        distributed.reduce_amax(moved, group)
        for t, m in zip(ts, moved):
            if m is not t:
                t.copy_(m)
    by_state: dict[int, tuple[DelayedScalingState, dict]] = {id(st): (st, {}) for st in compiled}
    for (st, role), a in zip(entries, amaxes):
        by_state.setdefault(id(st), (st, {}))[1][role] = a
    record_pending_many([c for st, d in by_state.values() for c in st._commits(d)])  # (one stacked update)


# ------------------------------------------------------------------------------------------------
# the context manager
# ------------------------------------------------------------------------------------------------
class autocast(contextlib.ContextDecorator):
    """Quantize lowbit modules per ``recipe`` inside the context (also usable as a decorator).

    Args:
        enabled: False runs lowbit modules in high precision (bit-identical to torch) inside the context.
        recipe: a :mod:`lowbit.recipes` recipe; None: the enclosing autocast's recipe, or
            ``DelayedScaling()`` (TransformerEngine's default) at the outermost level.
        amax_reduction_group: ``torch.distributed`` group whose ranks share delayed-scaling amaxes
            (all-reduce MAX at the outermost exit); None: the enclosing one's, or the world group when
            ``torch.distributed`` is initialized.
        on_nonfinite: ``"raise"`` a :class:`NonFiniteAmaxError` when a quantized tensor has a NaN/Inf
            amax, or ``"skip"``: record it (see :func:`nonfinite_events`) so the loop can skip the step.
            None: the enclosing one's, else ``"raise"``. The backward uses the policy of its forward.
            The amaxes are checked without a device sync per tensor: the forward's all at once at the
            outermost exit (which raises from the ``with`` statement and skips the delayed-scaling
            update), the backward's at the end of the backward pass (raising from ``backward()``).
            On CUDA these checks do not wait for the GPU either: a fault is reported at the first such
            check point after the GPU has finished the faulty step (the event names its step), and
            :func:`nonfinite_events` waits for every pending check. ``LOWBIT_SENTRY_SYNC=1`` makes each
            check wait, so the error surfaces at the exit of the step itself (one sync per check).
            ``"ignore"``: don't stop, never hide. The sentry checks as under ``"skip"`` (the same deferred
            checks, no extra sync) and records every event, with ``policy="ignore"``, in
            :func:`nonfinite_events`; nothing raises and nothing asks the loop to skip. Non-finite amaxes
            still never enter a delayed-scaling history, and no value is hidden: a quantized NaN / Inf
            dequantizes to NaN under every recipe (NUMERICS §3), so the step's outputs and loss show it.
            ``"off"``: no sentry at all: no amax is recorded or checked and no event is reported (a compiled graph
            holds no record of them). Non-finite values still show in the outputs and the loss, as under
            ``"ignore"``, and never enter a delayed-scaling history; only the report naming the layer, role and step
            is lost.
            Under ``torch.compile`` a traced current-scaling linear records its amaxes inside the graph (no Python
            per call): its forward's are checked at the outermost exit as above, its backward's at the next check
            after the backward (:func:`nonfinite_events`, :func:`take_checks`, :func:`check_nonfinite` or the next
            step's exit), so a ``"raise"`` fault of a backward raises there, not from ``backward()``.
        allow_emulation: allow recipes the device runs only emulated (see :func:`check_recipe_support`).

    Contexts nest: each one saves the state it found and restores it on exit, also on exceptions.
    At the outermost exit (and only when leaving without an exception) the pending delayed-scaling
    amaxes are reduced and the histories updated, once: this step's forward amaxes and the gradient
    amaxes of the backward(s) run since the previous outermost exit (a backward run after the exit
    is committed at the next one). When the outermost exit sees an exception, or the NaN sentry
    raises there, the amaxes observed inside the context are dropped (the earlier backward's stay
    pending); a backward outside autocast that raises :class:`NonFiniteAmaxError` drops the gradient
    amaxes waiting for the next exit. See the module docstring.
    """

    def __init__(self, enabled: bool = True, recipe: Recipe | None = None, amax_reduction_group=None,
                 on_nonfinite: str | None = None, *, allow_emulation: bool = True):
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled: expected a bool, got {enabled!r}")
        if recipe is not None and (not isinstance(recipe, Recipe) or type(recipe) is Recipe):
            hint = " (use lowbit.recipes.from_name for a name)" if isinstance(recipe, str) else ""
            kinds = ", ".join(c.__name__ for c in NAMES.values() if c is not None)
            raise TypeError(f"recipe: expected a lowbit.recipes recipe or None, got {recipe!r}{hint}; the recipes: "
                            f"{kinds}")
        if on_nonfinite is not None and on_nonfinite not in ON_NONFINITE:
            raise ValueError(f"on_nonfinite: expected one of {ON_NONFINITE}, got {on_nonfinite!r}")
        if not isinstance(allow_emulation, bool):
            raise TypeError(f"allow_emulation: expected a bool, got {allow_emulation!r}")
        _check_group(amax_reduction_group)
        self.enabled, self.recipe, self.group = enabled, recipe, amax_reduction_group
        self.on_nonfinite, self.allow_emulation = on_nonfinite, allow_emulation
        self._saved: list[tuple[AutocastState, AutocastState]] = []  # (the state found, the state installed)

    def __enter__(self):
        global _state, _depth, _carried, _carried_compiled
        outer = _state
        recipe = self.recipe or (outer.recipe if outer.recipe is not None
                                 else (DelayedScaling() if self.enabled else None))
        support = outer.support
        if self.enabled:
            support = check_recipe_support(recipe, allow_emulation=self.allow_emulation)
        policy = self.on_nonfinite or (outer.on_nonfinite if _depth else "raise")
        new = replace(
            outer,
            enabled=self.enabled,
            recipe=recipe,
            amax_reduction_group=self.group if self.group is not None else outer.amax_reduction_group,
            on_nonfinite=policy,
            support=support,
            key=state_key(recipe, policy) if self.enabled else "",
        )
        self._saved.append((outer, new))
        _state = new
        if _depth == 0:
            _carried = _snapshot_pending()
            _carried_compiled = _snapshot_compiled()
            if self.enabled:
                prepare_board()
                _prepare_slots()
                if isinstance(recipe, DelayedScaling):
                    _prepare_delayed(recipe)
        _depth += 1
        return self

    def __exit__(self, exc_type, exc, tb):
        global _state, _depth, _step, _carried, _carried_compiled
        if not self._saved:
            raise RuntimeError("autocast: __exit__ without a matching __enter__ (this context is not active); use it "
                               "as `with lowbit.autocast(...):` or call __enter__ first")
        if _state is not self._saved[-1][1]:
            raise RuntimeError("autocast: contexts must exit in reverse order of entry (LIFO): this context is not the "
                               "innermost active one; exit the inner autocast first (the state is left unchanged)")
        group = _state.amax_reduction_group
        _state = self._saved.pop()[0]
        _depth -= 1
        if _depth == 0:
            _state = AutocastState()
            carried, _carried = _carried or {}, None
            compiled, _carried_compiled = _carried_compiled, None
            if exc_type is None:
                try:
                    # may raise NonFiniteAmaxError (policy "raise"): the step is not committed. On CUDA this
                    # queues the check and reports earlier checks the GPU has finished (no sync).
                    if _board_slots and not (_cuda_available() and torch.cuda.is_current_stream_capturing()):
                        _board_check()  # (a capture reads nothing back; the board is checked at an exit outside it)
                    check_nonfinite(wait=env.get("LOWBIT_SENTRY_SYNC"))
                except NonFiniteAmaxError:
                    _drop_pending(carried)  # else the NaN stays pending and masks the next step's amax
                    _restore_compiled(compiled)
                    _step += 1
                    raise
                _commit_pending(group)
                _step += 1
            else:
                with _lock:  # the failed step's records are dropped with it
                    _unchecked.clear()
                _drop_pending(carried)  # and its amaxes: the update happens only on a clean exit
                _restore_compiled(compiled)
        return False


def _check_group(group) -> None:
    """``amax_reduction_group`` must be a ``torch.distributed`` process group or None: anything else would
    only fail inside the collective at the outermost exit, after the whole step ran."""
    if group is None:
        return
    dist = torch.distributed
    pg = getattr(dist, "ProcessGroup", None) if dist.is_available() else None
    if pg is None or not isinstance(group, pg):
        raise TypeError(
            f"amax_reduction_group: expected a torch.distributed.ProcessGroup (e.g. from dist.new_group) or None, "
            f"got {type(group).__name__}: {group!r}"
        )
