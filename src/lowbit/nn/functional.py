"""The quantized linear op: fprop, dgrad and wgrad as quantized ``scaled_mm`` calls (NUMERICS §4–§6).

``y = x · wᵀ + b`` (optionally GELU'd) where, per the active recipe's roles:

* fprop  ``y  = x · wᵀ``  : x rowwise,  w rowwise
* dgrad  ``dx = dy · w``  : dy rowwise, w columnwise
* wgrad  ``dw = dyᵀ · x`` : dy columnwise, x columnwise

The forward saves only the *quantized* columnwise copy of x (and the weight's quantized copies),
never a high-precision x. Per-layer state (delayed scaling, the cached quantized weight, the name the
NaN sentry reports) lives in a :class:`GemmLayer` owned by the module.
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

from ..gemm import scaled_mm as _checked_scaled_mm
from ..gemm import wgrad_mm as _checked_wgrad_mm
from ..quant import quantize
from ..quant.schemes import Float8Blockwise, Float8Tensorwise
from ..quant.tensor import (
    QuantizedTensor,
    columnwise_from_rowwise,
    copy_from_tensors,
    copy_tensors,
    empty_copy_tensors,
    n_copy_tensors,
)
from ..recipes import DelayedScaling, Recipe
from ..runtime import env
from ..runtime.device import INTERPRET as _INTERPRET
from ..runtime.device import in_graph_pool, in_graph_tree, num_sms, stream_apart
from ..runtime.effects import register_ordered
from . import state as _ac

# Every operand this module hands the GEMMs is one lowbit built (its quantizer, the optimizer's fused update, FSDP2's
# gathered copies, a handed-over grad_output), whose structure follows from the call's signature: it is checked at the
# first call of each signature, not on every call.
scaled_mm = functools.partial(_checked_scaled_mm, check_operands=False)
wgrad_mm = functools.partial(_checked_wgrad_mm, check_operands=False)

__all__ = ["GemmLayer", "FreshWeight", "quantized_linear", "quantized_swiglu_mlp", "swiglu_mlp_fusable",
           "check_microbatch_arg", "linear_traces", "weight_layer", "wgrad_on_side_stream", "wgrad_side_stream",
           "join_wgrad_side_stream", "fsdp_wgrad_joins"]

_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_microbatch_arg(is_first_microbatch) -> None:
    if is_first_microbatch is not None and not isinstance(is_first_microbatch, bool):
        raise TypeError(f"is_first_microbatch: expected None, True or False, got {is_first_microbatch!r}")




def fresh_weight_scheme(w: torch.Tensor, recipe: Recipe):
    """The weight role's scheme where an optimizer may write ``w``'s quantized copies itself (see
    :class:`FreshWeight`): 128 x 128 blockwise FP8 with current scaling of a contiguous 2D FP32 CUDA weight; else
    None."""
    rq = recipe.role("weight")
    sch = rq.scheme
    if (rq.delayed or not isinstance(sch, Float8Blockwise) or sch.block_dim != 2 or sch.block_size != 128
            or w.dtype != torch.float32 or w.dim() != 2 or not (w.is_cuda or _INTERPRET) or not w.is_contiguous()):
        return None
    return sch


# weight tensor -> (a weak reference to the GemmLayer that quantizes it, the scheme), recorded by the forward where
# fresh_weight_scheme allows; lowbit.optim.AdamW looks its parameters up here. Keyed by identity, held weakly, and the
# layer held weakly too: its module holds the weight, so a strong reference from the value would keep the key, the
# layer and the whole module alive for the life of the process (every model trained under fp8-block leaked).
_WEIGHT_LAYERS = WeakIdKeyDictionary()


def weight_layer(w: torch.Tensor):
    """``(GemmLayer, scheme)`` of a weight a lowbit forward quantized with a scheme an optimizer may write itself
    (:func:`fresh_weight_scheme`), or None (never recorded, or its layer is gone)."""
    e = _WEIGHT_LAYERS.get(w)
    if e is None:
        return None
    layer = e[0]()
    return None if layer is None else (layer, e[1])


def record_weight_layer(w: torch.Tensor, layer: "GemmLayer", scheme) -> None:
    """Record that ``layer`` quantizes weight ``w`` with ``scheme`` (what a forward does; for benchmarks that step an
    optimizer over weights no forward has seen). The record holds neither: it lasts while both are alive."""
    if not (isinstance(scheme, Float8Blockwise) and scheme.block_dim == 2):
        raise ValueError(f"scheme: an optimizer writes 128x128 blockwise FP8 copies only, got {scheme!r}")
    _WEIGHT_LAYERS[w] = (weakref.ref(layer), scheme)


class FreshWeight:
    """Quantized copies of a weight written by its optimizer in the same kernel as the update
    (:class:`lowbit.optim.AdamW`), which the forward takes instead of quantizing the weight again.

    Attributes:
        q: the :class:`QuantizedTensor` (both copies; its buffers are rewritten in place by every update, so a
            CUDA graph that reads them reads each step's).
        scheme: the scheme q was made with.
        version, ptr: ``w._version`` and ``w.data_ptr()`` when q was last written; the forward uses q only while both
            still match (any in-place change of the weight through torch bumps its version; so does the optimizer,
            after writing q).
    """

    __slots__ = ("q", "scheme", "version", "ptr")

    def __init__(self, q: QuantizedTensor, scheme):
        self.q, self.scheme, self.version, self.ptr = q, scheme, -1, 0

    def mark(self, w: torch.Tensor) -> None:
        """q now holds the copies of ``w`` as it is."""
        self.version, self.ptr = w._version, w.data_ptr()

    def valid_for(self, w: torch.Tensor, scheme) -> bool:
        return self.version == w._version and self.ptr == w.data_ptr() and self.scheme == scheme


def _copy_parts(q: QuantizedTensor) -> list[tuple[str, list[torch.Tensor]]]:
    """(direction, [data, scale_inv, amax, global_scale?]) of each copy ``q`` has."""
    out = []
    for which in ("rowwise", "columnwise"):
        c = getattr(q, which)
        if c is not None:
            out.append((which, [c.data, c.scale_inv, c.amax] + ([c.global_scale] if c.global_scale is not None
                                                                  else [])))
    return out


def _alike(ts: list[torch.Tensor] | None, us: list[torch.Tensor]) -> bool:
    """Whether two copies' tensor lists match tensor for tensor in shape and dtype (``ts`` None: no such copy)."""
    return ts is not None and len(ts) == len(us) and all(t.shape == u.shape and t.dtype == u.dtype
                                                         for t, u in zip(ts, us))


def _same_copies(dst: QuantizedTensor, src: QuantizedTensor) -> bool:
    """Whether ``src`` has exactly ``dst``'s copies, tensor for tensor of the same shape and dtype."""
    a, b = _copy_parts(dst), dict(_copy_parts(src))
    return len(a) == len(b) and all(_alike(b.get(which), ts) for which, ts in a)


def _write_copies(dst: QuantizedTensor, src: QuantizedTensor) -> bool:
    """Copy each of ``dst``'s copies from ``src``'s of the same direction, in place (False, nothing written, unless
    ``src`` has every one of them with the same tensors' shapes and dtypes)."""
    have = dict(_copy_parts(src))
    pairs = []
    for which, ts in _copy_parts(dst):
        us = have.get(which)
        if not _alike(us, ts):
            return False
        pairs += zip(ts, us)
    with torch.inference_mode():  # (a pinned copy made under inference_mode is an inference tensor; others allow it)
        for t, u in pairs:
            if t is not u:
                t.copy_(u)
    return True


class GemmLayer:
    """Per-GEMM state of a lowbit module (not an nn.Module; owned by one).

    Attributes:
        suffix: name of this GEMM inside its module (``""``, ``"fc1"``, ``"fc2"``).
        delayed: :class:`~lowbit.nn.state.DelayedScalingState` once a DelayedScaling forward ran
            (or a checkpoint with one was loaded).
        wcache: ``(recipe, weight version, weight data_ptr, QuantizedTensor)`` of the last weight
            quantized with ``is_first_microbatch=True`` (or kept by :class:`lowbit.nn.cached_weights`).
        keep_weights: how many open :class:`lowbit.nn.cached_weights` blocks cover this layer: while > 0 an eager
            forward with ``is_first_microbatch=None`` reuses ``wcache`` where it is still the weight's, else
            quantizes and keeps the weight.
        kept_uses: how many forwards took a kept weight.
        graph_pins: ``[recipe, weight version, weight data_ptr, QuantizedTensor]`` of each kept copy a CUDA graph
            recorded inside a block reads at every replay, held here so that leaving the block or keeping a newer
            copy never frees it under the graph (dropped by ``clear_weight_cache``, after which such graphs must not
            replay: ``torch.compiler.reset()``). A later eager call in a block takes a pinned copy that is still the
            weight's, and one that quantizes a changed weight writes the new copy into the pinned ones in place
            (:meth:`refresh_pins`; so does entering a block), so replays read the weight as it is then.
        fresh: :class:`FreshWeight`, the weight's copies as its optimizer wrote them (None: none does).
        fresh_uses: how many forwards took them.
        sentry_slots: (input's, weight's, grad_output's) int32 (1,) tensors on the weight's device, the amaxes (as
            float32 bits) a compiled traced call max-accumulates inside its graph for the NaN sentry (None until the
            first outermost autocast entry; :mod:`lowbit.nn.state` allocates, checks and zeroes them).
        sentry_armed: the NaN-sentry policy of the compiled call that writes the slots ("" before any).
    """

    def __init__(self, owner, suffix: str = ""):
        self._owner_ref = owner  # plain attribute: the module keeps GemmLayers in a dict, no cycle issue for GC
        self.suffix = suffix
        _LAYERS.add(self)
        self.delayed: _ac.DelayedScalingState | None = None
        self._loaded: dict | None = None  # delayed state loaded before a DelayedScaling forward built it
        self.wcache = None
        self.keep_weights = 0
        self.kept_uses = 0
        self.graph_pins: list = []  # kept copies a recorded CUDA graph reads (see quantized_weight)
        self.fresh: FreshWeight | None = None
        self.fresh_uses = 0
        # FP8 grad_output handed over by the next op (see offer_grad_output)
        self._offered_dy: QuantizedTensor | None = None
        self._stand_in: torch.Tensor | None = None  # what autograd delivers in its place, where it replaces dy
        self.handoffs = 0  # how many backward passes used a handed-over FP8 grad_output
        self.sentry_slots: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.sentry_armed = ""
        _ac.register_slot_holder(self)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["graph_pins"] = []  # (a copy records no graph: the pinned copies are not copied with it)
        return state

    def __setstate__(self, state: dict) -> None:
        # a copy (copy.deepcopy of its module, unpickling) is a layer of its own: layer_of must find it, or a compiled
        # graph's operators would keep its delayed-scaling state and NaN-sentry name on an anonymous layer
        self.__dict__.update(state)
        _LAYERS.add(self)
        self.sentry_slots, self.sentry_armed = None, ""  # (its own, allocated at the next entry)
        self.keep_weights = 0  # (the blocks that cover the original do not cover the copy)
        self.graph_pins = []
        self.__dict__.setdefault("kept_uses", 0)  # (a layer pickled before the counter existed)
        _ac.register_slot_holder(self)

    # -- FP8 grad_output hand-off -----------------------------------------------------------------
    def offer_grad_output(self, q: QuantizedTensor, stand_in: torch.Tensor | None = None) -> None:
        """Hand this GEMM's next backward an already-quantized grad_output (e.g. FP8 dQ/dK/dV written by the
        attention backward with this layer's delayed grad_output scale), so it is not quantized again.

        ``q``: Float8Tensorwise, rowwise copy (tokens, out_features); it must equal what autograd delivers as
        dy (dequantized) — it is used only if its scheme is the recipe's delayed grad_output scheme and its
        shape matches; otherwise the backward quantizes dy as usual.

        With ``stand_in`` (a one-element tensor): ``q`` (a 1x128 Float8Blockwise current-scaling grad_output, both
        copies) *is* the gradient, and autograd delivers ``stand_in`` expanded in its place (lowbit.ops.rope_qkv's
        grad_sink, :func:`rope_grad_sink`). The backward takes ``q`` exactly when its dy is that stand-in, and raises
        if it cannot use it (the stand-in holds no values).
        """
        self._offered_dy = q
        self._stand_in = stand_in

    def take_grad_output(self, dy2: torch.Tensor, recipe: Recipe, *, need_dgrad: bool, need_wgrad: bool,
                         phase: str, policy: str) -> QuantizedTensor | None:
        q, self._offered_dy = self._offered_dy, None
        ph, self._stand_in = self._stand_in, None
        if q is None:
            return None
        rq = recipe.role("grad_output")
        if ph is not None:  # q is the gradient itself, for the dy that is its stand-in (and for no other)
            if not (dy2.data_ptr() == ph.data_ptr() and all(st == 0 for st in dy2.stride())):
                return None
            sch = rq.scheme
            if not (not rq.delayed and isinstance(sch, Float8Blockwise) and sch.block_dim == 1 and q.scheme == sch
                    and (q.rows, q.cols) == tuple(dy2.shape) and (q.rowwise is not None or not need_dgrad)
                    and (q.columnwise is not None or not need_wgrad)):
                raise RuntimeError(f"{self.name}: a quantized grad_output handed over in place of the gradient does "
                                   f"not fit this backward (scheme {q.scheme!r} against the recipe's {sch!r}, shape "
                                   f"{(q.rows, q.cols)} against {tuple(dy2.shape)})")
            _ac.sentry([c.amax for c in q._copies()], layer=self, role="grad_output", phase=phase, policy=policy)
            self.handoffs += 1
            return q
        if not (rq.delayed and isinstance(rq.scheme, Float8Tensorwise) and q.scheme == rq.scheme
                and q.rowwise is not None and (q.rows, q.cols) == tuple(dy2.shape)):
            return None
        if need_wgrad and q.columnwise is None:  # one scale per tensor: the columnwise copy is the transpose
            q.columnwise = columnwise_from_rowwise(q)
        _ac.sentry(q.amax.reshape(1), layer=self, role="grad_output", phase=phase, policy=policy)
        self._observe(self.delayed_state(recipe, dy2.device), "grad_output", q.amax)
        self.handoffs += 1
        return q

    # -- naming ---------------------------------------------------------------------------------
    def weight(self) -> torch.Tensor | None:
        """The weight this GEMM multiplies by: its module's ``weight`` (or ``<suffix>_weight``), or None."""
        return getattr(self._owner_ref, f"{self.suffix}_weight" if self.suffix else "weight", None)

    @property
    def name(self) -> str:
        o = self._owner_ref
        base = getattr(o, "lowbit_name", None)
        if not base:
            w = getattr(o, "weight", None) if not self.suffix else getattr(o, f"{self.suffix}_weight", None)
            shape = f"{tuple(w.shape)}" if w is not None else "?"
            base = f"<unnamed {type(o).__name__} weight {shape}; name it with lowbit.nn.name_modules(model)>"
        return f"{base}.{self.suffix}" if self.suffix else base

    # -- delayed scaling ------------------------------------------------------------------------
    def delayed_state(self, recipe: DelayedScaling, device) -> _ac.DelayedScalingState:
        st = self.delayed
        if (st is None or not st.compatible(recipe) or st.device != device) and in_graph_pool(device):
            raise NotImplementedError(
                f"recipe: layer {self.name!r} has no delayed-scaling state for {type(recipe).__name__} on {device} "
                "yet, and a CUDA graph being recorded cannot allocate it (it would live in the graph's pool); enter "
                "lowbit.autocast with this recipe once with the model on its device before the graph records (the "
                "outermost entry makes every layer's state)")
        if st is None or not st.compatible(recipe):
            if st is not None and any(h.steps for h in st.histories.values()):
                raise ValueError(
                    f"recipe: layer {self.name!r} holds delayed-scaling state for {st.recipe} but the active recipe "
                    f"is {recipe}; "
                    "amax_history_len, amax_compute_algo, margin and fp8_format must stay the same across steps"
                )
            st = _ac.DelayedScalingState(recipe, device=device)
            if self._loaded is not None:
                st.load_state_dict(self._loaded)
                self._loaded = None
            self.delayed = st
        else:
            st.retarget(recipe)
        return st

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self.delayed is not None:
            return self.delayed.state_dict()
        return dict(self._loaded or {})

    def load_state_dict(self, sd: dict) -> None:
        if not sd:
            return
        if self.delayed is not None:
            self.delayed.load_state_dict(sd)
        else:
            need = {f"{r}.{k}" for r in ("input", "weight", "grad_output") for k in ("history", "scale", "steps")}
            if not need <= set(sd):
                raise ValueError(f"state: lowbit extra state for layer {self.name!r} lacks {sorted(need - set(sd))}")
            self._loaded = dict(sd)  # built into a DelayedScalingState by the next DelayedScaling forward

    # -- quantization of one role ---------------------------------------------------------------
    def quantize(self, t: torch.Tensor, role: str, recipe: Recipe, *, rowwise: bool, columnwise: bool,
                 phase: str, policy: str) -> QuantizedTensor:
        rq = recipe.role(role)
        scale = None
        st = None
        if rq.delayed:
            st = self.delayed_state(recipe, t.device)
            scale = (self._graph_delayed_scale(st, role, t, recipe) if in_graph_pool(t.device)
                     else st.scale(role, t.device))
        q = quantize(t, rq.scheme, rowwise=rowwise, columnwise=columnwise, scale=scale)
        # every copy's amax (the RHT copy's is measured after the transform); NaN/Inf in any -> the sentry
        # fires (checked at the outermost autocast exit / the end of the backward, one sync for all)
        _ac.sentry([c.amax for c in q._copies()], layer=self, role=role, phase=phase, policy=policy)
        if st is not None:
            self._observe(st, role, q.amax)
        return q

    @staticmethod
    def _graph_delayed_scale(st: _ac.DelayedScalingState, role: str, t: torch.Tensor, recipe: Recipe) -> torch.Tensor:
        """The scale to cast ``t`` with under delayed scaling while a CUDA graph records this call: chosen on the
        device (:func:`lowbit.quant.traceable.delayed_scale`: the history's scale once its record count reaches the
        warm-up, else ``t``'s current scale), since a replay runs no Python."""
        from ..quant.reference import amax_of
        from ..quant.traceable import delayed_scale

        h = st.histories[role]
        scale, _ = delayed_scale(amax_of(t), h.scale, h.device_state[1:2], recipe.warmup_steps,
                                 recipe.role(role).scheme.format.max)
        return scale

    @staticmethod
    def _observe(st: _ac.DelayedScalingState, role: str, amax: torch.Tensor) -> None:
        """Fold ``amax`` into the role's pending amax: eagerly (:meth:`DelayedScalingState.observe`), or, while a
        CUDA graph records, into the history's device pending max in place (a replay updates it; the state then
        commits on the device)."""
        if in_graph_pool(amax.device):
            st.histories[role].observe(amax)
            st.compiled = True
        else:
            st.observe(role, amax)

    def quantize_rmsnorm(self, x2: torch.Tensor, w: torch.Tensor, eps: float, recipe: Recipe, *, columnwise: bool,
                         policy: str, rstd: torch.Tensor | None = None) -> tuple[QuantizedTensor, torch.Tensor]:
        """The "input" role's copies of RMSNorm(x2) by the fused norm + 1x128 quantize kernel
        (:func:`lowbit.ops.norm_quant.rmsnorm_quantize_1x128`; the caller checked ``norm_quant_fusable``), and rstd
        (``rstd`` given: x2's row statistics computed already)."""
        from ..ops.norm_quant import rmsnorm_quantize_1x128

        q, rstd = rmsnorm_quantize_1x128(x2, w, eps, recipe.role("input").scheme, rowwise=True, columnwise=columnwise,
                                         rstd=rstd)
        _ac.sentry([c.amax for c in q._copies()], layer=self, role="input", phase="forward", policy=policy)
        return q, rstd

    def quantized_weight(self, w: torch.Tensor, recipe: Recipe, is_first_microbatch, *, columnwise: bool,
                         policy: str) -> QuantizedTensor:
        """The weight's quantized copies: fresh (None), quantized and cached (True) or from the cache (False); or,
        for a weight FSDP2 all-gathered as its quantized copies (:func:`lowbit.nn.fp8_all_gather`), those copies,
        whatever ``is_first_microbatch`` says (they are what quantizing the whole weight gives)."""
        if w.__class__ is not torch.Tensor and w.__class__ is not torch.nn.Parameter:
            gq = getattr(w, "lowbit_gathered", None)
            if gq is not None:
                return self._gathered_weight(gq, recipe, columnwise, policy)
        pooled_miss = refresh = False
        if is_first_microbatch is None and self.keep_weights and self._may_keep(w):
            if self._cache_fault(w, recipe, columnwise) is None:
                self.kept_uses += 1
                c = self.wcache
                if in_graph_pool(w.device) and not any(p[3] is c[3] for p in self.graph_pins):
                    self.graph_pins.append(list(c))  # (a recorded graph reads it at every replay: never freed under it)
                return c[3]
            if in_graph_pool(w.device):  # quantize for this call inside the graph; keep nothing, drop nothing
                pooled_miss = True
            else:
                pin = self._pin_for(w, recipe, columnwise)
                if pin is not None:  # a copy a graph reads is still the weight's: keep it again
                    self.wcache = tuple(pin)
                    self.kept_uses += 1
                    return pin[3]
                is_first_microbatch = True  # quantize and keep (the copies the weight's GEMMs may need, as True does)
                refresh = True
        if is_first_microbatch is False:
            fault = self._cache_fault(w, recipe, columnwise)
            if fault == "missing":
                raise ValueError(
                    "is_first_microbatch: False needs a quantized weight cached by an earlier call with True "
                    "in this step; "
                    f"layer {self.name!r} has none. Pass True on the first microbatch of each step (or None "
                    "to not cache)."
                )
            if fault == "recipe":
                raise ValueError(
                    f"is_first_microbatch: False reuses the weight cached under {self.wcache[0]}, but the active "
                    f"recipe is {recipe}; "
                    f"pass True when the recipe changes (layer {self.name!r})"
                )
            if fault == "modified":
                raise ValueError(
                    f"is_first_microbatch: False, but the weight of layer {self.name!r} was modified since "
                    "it was cached "
                    "(optimizer step?); pass True on the first microbatch after each weight update"
                )
            if fault == "no columnwise":
                raise ValueError(
                    f"is_first_microbatch: the cached weight of layer {self.name!r} was quantized without gradients "
                    "(no columnwise copy for dgrad); pass True under autograd first"
                )
            return self.wcache[3]
        cache = is_first_microbatch is True
        sch = fresh_weight_scheme(w, recipe)
        if sch is not None:
            e = _WEIGHT_LAYERS.get(w)  # (every forward: the record read as stored, no tuple made)
            if e is None or e[0]() is not self or e[1] != sch:
                record_weight_layer(w, self, sch)
            f = self.fresh
            if f is not None and f.valid_for(w, sch):
                q = f.q
                _ac.sentry([c.amax for c in q._copies()], layer=self, role="weight", phase="forward", policy=policy)
                self.fresh_uses += 1
                if not pooled_miss:
                    self.wcache = (recipe, w._version, w.data_ptr(), q) if cache else None
                return self._refreshed(w, recipe, q, policy) if refresh else q
        q = self.quantize(w.detach(), "weight", recipe, rowwise=True,
                          columnwise=columnwise or (cache and torch.is_grad_enabled()),
                          phase="forward", policy=policy)
        if not pooled_miss:
            self.wcache = (recipe, w._version, w.data_ptr(), q) if cache else None
        return self._refreshed(w, recipe, q, policy) if refresh else q

    # -- copies recorded CUDA graphs read (graph_pins) -------------------------------------------------------------
    @staticmethod
    def _pin_holds(p: list, w: torch.Tensor, recipe: Recipe | None = None) -> bool:
        """Whether pinned copy ``p`` holds ``w`` as it is now (its version and storage), under ``recipe`` if given."""
        return p[1] == w._version and p[2] == w.data_ptr() and (recipe is None or p[0] == recipe)

    def _pin_for(self, w: torch.Tensor, recipe: Recipe, columnwise: bool) -> list | None:
        """A pinned copy holding ``w`` as it is now under ``recipe`` (with a columnwise copy where asked), or None."""
        for p in self.graph_pins:
            if self._pin_holds(p, w, recipe) and (not columnwise or p[3].columnwise is not None):
                return p
        return None

    def _refreshed(self, w: torch.Tensor, recipe: Recipe, q: QuantizedTensor, policy: str) -> QuantizedTensor:
        """After an eager call in a block quantized the changed ``w`` into ``q`` and kept it: the pinned copies
        written with the weight as it is (:meth:`refresh_pins`, from ``q`` where its copies match), and the kept copy
        made the pinned one where they match (no second copy held); returns the copy the call takes."""
        try:
            self.refresh_pins(w, policy, src=(recipe, q))
        except BaseException:
            self.wcache = None  # (the next call must not take a kept copy while a pinned one is stale)
            raise
        for p in self.graph_pins:
            if self._pin_holds(p, w, recipe) and _same_copies(p[3], q):
                if self.wcache is not None and self.wcache[3] is q:
                    self.wcache = tuple(p)
                return p[3]
        return q

    def refresh_pins(self, w: torch.Tensor, policy: str = "off", src=None) -> list[torch.Tensor]:
        """Write ``w`` (this layer's weight), quantized under each pinned copy's own recipe, into every pinned copy
        that no longer holds it, in place, so recorded CUDA graphs replay the weight as it is; ``src``: (recipe,
        QuantizedTensor) of ``w`` already quantized, taken where its copies match. ``policy``: the NaN sentry's for
        the quantizations made here (a DelayedScaling copy takes the layer's current scale, and its amax is recorded
        as a forward's). Returns the amaxes of what was written (none: nothing was stale).
        :class:`lowbit.nn.cached_weights` calls it on entry, for weights changed between blocks (an optimizer step
        between two evaluations that replay the same graphs)."""
        amaxes = []
        f = self.fresh
        for p in self.graph_pins:
            if self._pin_holds(p, w):
                continue
            if f is not None and p[3] is f.q and f.valid_for(w, fresh_weight_scheme(w, p[0])):
                pass  # (the optimizer's own copies, which it wrote with the weight: current already)
            elif src is None or src[0] != p[0] or not _write_copies(p[3], src[1]):
                with torch.no_grad():
                    q = self.quantize(w.detach(), "weight", p[0], rowwise=p[3].rowwise is not None,
                                      columnwise=p[3].columnwise is not None, phase="forward", policy=policy)
                if not _write_copies(p[3], q):
                    raise RuntimeError(f"layer {self.name!r}: the weight's shape changed since a CUDA graph recorded "
                                       "its kept copy; call clear_weight_cache() and torch.compiler.reset()")
            p[1], p[2] = w._version, w.data_ptr()
            amaxes += [c.amax for c in p[3]._copies()]
        return amaxes

    def mark_pins_stale(self) -> None:
        """Make every pinned copy count as not holding the weight (the next entry or keeping call writes it again)."""
        for p in self.graph_pins:
            p[1] = -1

    def _cache_fault(self, w: torch.Tensor, recipe: Recipe, columnwise: bool) -> str | None:
        """Why ``wcache`` is not ``w``'s copies for this call ("missing", "recipe", "modified": its version or
        storage moved, "no columnwise": a dgrad needs one), or None where it is: the one rule for
        ``is_first_microbatch=False`` and :class:`lowbit.nn.cached_weights`."""
        c = self.wcache
        if c is None:
            return "missing"
        if c[0] != recipe:
            return "recipe"
        if c[1] != w._version or c[2] != w.data_ptr():
            return "modified"
        if columnwise and c[3].columnwise is None:
            return "no columnwise"
        return None

    @staticmethod
    def _may_keep(w: torch.Tensor) -> bool:
        """Whether a kept copy of ``w`` can be checked against it when a call takes it: not while Dynamo traces (the
        check would run once, at tracing), and a weight with a version counter (an inference tensor has none: an
        in-place change could not be seen). A CUDA-graph capture, or torch.compile's graph trees warming up or
        recording (:func:`~lowbit.runtime.device.in_graph_pool`), takes a kept copy made before it, checked then,
        and does not keep one of its own (it would live in the graph's private pool); its replays read the copy
        whatever the weight holds by then."""
        return not (torch.compiler.is_compiling() or w.is_inference())

    def _gathered_weight(self, q: QuantizedTensor, recipe: Recipe, columnwise: bool, policy: str) -> QuantizedTensor:
        """The copies FSDP2 gathered (rowwise; the columnwise one is made from it where dgrad needs it:
        :func:`lowbit.quant.tensor.columnwise_from_rowwise`), checked against the active recipe's weight role."""
        rq = recipe.role("weight")
        gathered_delayed = bool(q.meta.get("delayed", False))
        if rq.scheme != q.scheme or rq.delayed != gathered_delayed:
            how = lambda sch, d: f"{sch}{' with delayed scaling' if d else ''}"  # noqa: E731
            raise ValueError(
                f"recipe: the weight of layer {self.name!r} was all-gathered by FSDP2 as its "
                f"{how(q.scheme, gathered_delayed)} copies (lowbit.nn.fp8_all_gather), but the active recipe "
                f"{type(recipe).__name__} quantizes weights as {how(rq.scheme, rq.delayed)}; run the forward under "
                "the recipe given to fp8_all_gather"
            )
        if columnwise and q.columnwise is None:
            q = QuantizedTensor(q.shape, q.dtype, q.scheme, rowwise=q.rowwise, columnwise=columnwise_from_rowwise(q))
        _ac.sentry([c.amax for c in q._copies()], layer=self, role="weight", phase="forward", policy=policy)
        if rq.delayed:  # (the whole weight's amax, all-reduced by the gather: what the unsharded forward records)
            self._observe(self.delayed_state(recipe, q.rowwise.data.device), "weight", q.amax)
        return q


_LAYERS: "weakref.WeakSet[GemmLayer]" = weakref.WeakSet()  # every live GemmLayer (for layer_of)
_BY_PTR: dict = {}  # weight data_ptr -> weakref to the GemmLayer that multiplies by it (a cache of layer_of)


def layer_of(w: torch.Tensor) -> GemmLayer:
    """The :class:`GemmLayer` whose module's weight is stored where ``w`` is (what lowbit's operators get: the
    weight, not the module). A weight no lowbit module holds gets a layer of its own, named by its shape."""
    ptr = w.data_ptr()
    ref = _BY_PTR.get(ptr)
    g = ref() if ref is not None else None
    if g is not None:
        gw = g.weight()
        if gw is not None and gw.data_ptr() == ptr:
            return g
    for g in list(_LAYERS):
        gw = g.weight()
        if isinstance(gw, torch.Tensor) and gw.data_ptr() == ptr and gw.shape == w.shape:
            if len(_BY_PTR) > 4096:  # (weights gathered into fresh memory each step, e.g. FSDP2: bounded)
                _BY_PTR.clear()
            _BY_PTR[ptr] = weakref.ref(g)
            return g
    key = (ptr, tuple(w.shape))
    e = _ANON.get(key)
    if e is None or (e[0] is not None and e[0].expired()):
        # (an expired entry: the storage it was made for is gone and this is other memory at the same address,
        # whose layer must not inherit the old one's delayed-scaling history)
        if len(_ANON) > 1024:
            _ANON.clear()
        e = _ANON[key] = (_storage_ref(w), GemmLayer(_Anonymous(w), ""))
    return e[1]


def _storage_ref(w: torch.Tensor):
    """A weak reference to ``w``'s storage (shared by its views and detached aliases), or None where the tensor has
    none to take (then the entry is never taken for stale)."""
    try:
        from torch.multiprocessing.reductions import StorageWeakRef

        return StorageWeakRef(w.untyped_storage())
    except Exception:  # noqa: BLE001 - a tensor subclass without a plain storage
        return None


_ANON: dict = {}  # (data_ptr, shape) -> (weak ref to the storage, the layer of a weight no lowbit module holds)


class _Anonymous:
    """The owner of a layer made for a weight no lowbit module holds (:func:`layer_of`); it keeps no reference to
    the weight."""

    def __init__(self, w: torch.Tensor):
        self.lowbit_name = f"<weight {tuple(w.shape)} at {w.data_ptr():#x}>"


def _check_dims(layer: GemmLayer, recipe: Recipe, x: torch.Tensor, w: torch.Tensor) -> None:
    m = recipe.divisibility
    if m == 1:
        return
    M = x.numel() // x.shape[-1]
    N, K = w.shape
    for what, v in (("tokens (product of the input's leading dims)", M), ("in_features", K), ("out_features", N)):
        if v % m:
            raise ValueError(
                f"input: {type(recipe).__name__} needs every GEMM dim divisible by {m}; layer {layer.name!r} has "
                f"{what} = {v} (input shape {tuple(x.shape)}, weight shape {tuple(w.shape)}). "
                f"Pad the batch, or keep this layer in high precision (lowbit.convert(skip=...))"
            )


def _gelu_grad(pre: torch.Tensor) -> torch.Tensor:
    """d/dz GELU(z) = Φ(z) + z·φ(z) (erf form), float32."""
    z = pre.float()
    cdf = 0.5 * (1.0 + torch.erf(z * (1.0 / math.sqrt(2.0))))
    pdf = torch.exp(-0.5 * z * z) * (1.0 / math.sqrt(2.0 * math.pi))
    return cdf + z * pdf


def _columnwise_only(q: QuantizedTensor) -> QuantizedTensor:
    """``q`` with its columnwise copy only: what a wgrad GEMM reads, kept for the backward (the rowwise one is
freed)."""
    return QuantizedTensor(q.shape, q.dtype, q.scheme, rowwise=None, columnwise=q.columnwise, meta=q.meta)


# ------------------------------------------------------------------------------------------------
# weight gradients on a side stream
# ------------------------------------------------------------------------------------------------
# The weight gradient dW = dYᵀX is off the backward's critical path (only the optimizer reads it), while the data
# gradient and everything after it (the norm backward, the quantizers, the attention backward) are on it. Inside
# `wgrad_on_side_stream()` the backward runs a weight-gradient GEMM on a second CUDA stream where nothing on the
# first can read its output before the backward ends: the weight's .grad is None (autograd's AccumulateGrad then
# takes the tensor as it is, no kernel), and no gradient graph is being built. The streams join once, when the
# backward pass ends. `lowbit train` captures its forward+backward graph this way (CUDA graphs keep the two
# streams as parallel branches); elsewhere (hooks reading .grad during the backward, DDP's reducer) it is not safe,
# so it is opt-in. FSDP2 reads each unit's gradients in the backward: fsdp_wgrad_joins makes it wait for them.
_SIDE = {"on": False, "streams": {}, "join": None}
# The side stream's weight-gradient GEMMs are cuBLAS's persistent kernels: one CTA an SM holding its whole register
# file, for the length of the GEMM. Launched beside the main stream's memory-bound kernels (the quantizers, the norm
# backward), they took every SM and the main stream's next kernel waited for the GEMM to finish (a 20 us quantizer
# took 162 us). cuBLAS is asked to leave this many SMs free for the main stream (torch's SM carveout, set around the
# side-stream call only): 32 of 132 SMs gave ~2% more tokens/s on the 350m and 1.3b GPTs; 16 and 48 gave less.
# The default keeps that fraction on other GPUs; LOWBIT_WGRAD_SM_CARVEOUT=N asks for N SMs (0 turns it off).
_HAS_CARVEOUT = hasattr(torch._C, "_set_sm_carveout_experimental") and hasattr(torch._C,
                                                                               "_get_sm_carveout_experimental")


def side_carveout(n_sms: int) -> int:
    """SMs the side-stream weight-gradient GEMMs leave to the main stream on a GPU of ``n_sms`` SMs: 32/132 of them
    (32 on an H100 SXM / H200), or ``LOWBIT_WGRAD_SM_CARVEOUT``; at most half the SMs, 0 = none."""
    n = env.get("LOWBIT_WGRAD_SM_CARVEOUT")
    if n is None:
        return min(round(n_sms * 32 / 132), n_sms // 2)
    return min(n, n_sms // 2)


@contextlib.contextmanager
def _cublas_sm_carveout(n: int):
    """cuBLAS GEMMs called inside leave ``n`` SMs unused (torch's SM carveout; nothing where n is 0 or this torch has
    no carveout), the previous setting restored after."""
    if not n or not _HAS_CARVEOUT:
        yield
        return
    import warnings

    def put(v):
        with warnings.catch_warnings():  # (torch warns once that the setting is experimental)
            warnings.simplefilter("ignore")
            torch._C._set_sm_carveout_experimental(v)

    prev = torch._C._get_sm_carveout_experimental()
    put(n)
    try:
        yield
    finally:
        put(prev)


class wgrad_on_side_stream:
    """Context manager: within it, a quantized layer's backward computes its weight gradient on a side CUDA stream
    where that is safe (the weight's ``.grad`` is None, no ``create_graph``), joined back into the calling stream
    when the backward pass ends. The same bits as without (the same block products and promotions, only their order on
    the GPU and the number of SMs cuBLAS spreads them over change: ``LOWBIT_WGRAD_SM_CARVEOUT`` SMs, by default 32 of
    132 (:func:`side_carveout`), are left to the calling stream's kernels).

    Use it only where nothing reads a weight's gradient before the backward has returned (no DDP reducer, no
    gradient hooks), or where what reads it waits for :func:`wgrad_side_stream` (FSDP2 after
    :func:`fsdp_wgrad_joins`): ``lowbit train`` uses it for its captured step."""

    def __init__(self, enabled: bool = True):
        self.enabled = bool(enabled)

    def __enter__(self):
        self.prev, _SIDE["on"] = _SIDE["on"], self.enabled
        return self

    def __exit__(self, *exc):
        _SIDE["on"] = self.prev
        return False


def _side_stream(dev: torch.device, main: torch.cuda.Stream) -> torch.cuda.Stream:
    """The side stream on ``dev``, never ``main``, the stream the backward runs on (a stream drawn from torch's pool
    can be it: the weight gradients would then run after the main stream's work, not beside it)."""
    st = _SIDE["streams"].get(dev)
    if st is None or st == main:
        st = _SIDE["streams"][dev] = stream_apart(dev, main)
    return st


def wgrad_side_stream(dev: torch.device) -> torch.cuda.Stream | None:
    """The stream weight gradients run on inside :class:`wgrad_on_side_stream` on ``dev`` (None where it is off or
    none ran there): work that reads a weight's ``.grad`` before the backward ends waits for it too."""
    return _SIDE["streams"].get(dev) if _SIDE["on"] else None


def _join_side(main: torch.cuda.Stream, side: torch.cuda.Stream) -> None:
    _SIDE["join"] = None
    main.wait_stream(side)


class _JoinWgradSide(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        side = wgrad_side_stream(g.device)  # (None off CUDA: no side stream ran there)
        if side is not None:
            torch.cuda.current_stream(g.device).wait_stream(side)
        return g


def join_wgrad_side_stream(x: torch.Tensor) -> torch.Tensor:
    """``x`` unchanged. In the backward, once x's gradient is computed, the calling stream waits for the weight
    gradients queued on the side stream so far (:class:`wgrad_on_side_stream`; nothing where it is off): whatever
    autograd runs after x's gradient may read the ``.grad`` of every weight used after x in the forward."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a tensor, got {type(x).__name__}")
    return _JoinWgradSide.apply(x) if x.requires_grad and torch.is_grad_enabled() else x


def fsdp_wgrad_joins(model: torch.nn.Module) -> list:
    """Makes FSDP2's units safe for :class:`wgrad_on_side_stream`. Call it after ``fully_shard``; returns the hooks'
    handles.

    FSDP2 reads a unit's gradients in the unit's post-backward (its reduce-scatter's copy-in, on the calling stream),
    which autograd runs as soon as the gradients of the unit's inputs are computed. A forward pre-hook on every
    ``fully_shard`` unit passes the unit's inputs through :func:`join_wgrad_side_stream` after FSDP2's own pre-hook
    has registered the post-backward on them. The post-backward then runs after the unit's weight gradients, which
    still overlap the rest of that unit's backward. A unit whose inputs need no gradient (the root, fed token ids) is
    reduced in FSDP2's final callback instead, which runs before the side stream joins: its own lowbit layers (those
    in no nested unit) compute their weight gradients on the calling stream (``lowbit_wgrad_here`` set on their
    weights)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        raise ValueError("model: no fully_shard unit in it (call fsdp_wgrad_joins after fully_shard)")

    def own_modules(unit):  # the unit and its submodules outside nested units
        todo, out = [unit], []
        while todo:
            m = todo.pop()
            out.append(m)
            todo += [c for c in m.children() if not isinstance(c, FSDPModule)]
        return out

    @torch.compiler.disable  # (as FSDP2's own hooks: a compiled unit breaks its graph here, the hook runs eager)
    def hook(unit, args, kwargs):
        if not torch.is_grad_enabled():
            return None
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves):
            # (FSDP2 has swapped the unsharded parameters in: those are the tensors the layers' backward sees)
            for m in own_modules(unit):  # (walked here: a list held by the hook would keep the modules alive)
                for p in m.parameters(recurse=False):
                    p.lowbit_wgrad_here = True
            return None
        leaves = [join_wgrad_side_stream(t) if isinstance(t, torch.Tensor) and t.requires_grad else t
                  for t in leaves]
        return pytree.tree_unflatten(leaves, spec)

    return [u.register_forward_pre_hook(hook, with_kwargs=True) for u in units]


def _wgrad(qdy: QuantizedTensor, qx: QuantizedTensor, out_dtype: torch.dtype, weight: torch.Tensor) -> torch.Tensor:
    """dW = dYᵀX (:func:`lowbit.gemm.wgrad_mm`), on the side stream where :class:`wgrad_on_side_stream` allows."""
    dev = qdy.device
    if not (_SIDE["on"] and dev.type == "cuda" and weight.grad is None and not torch.is_grad_enabled()
            and not getattr(weight, "lowbit_wgrad_here", False)):
        return wgrad_mm(qdy, qx, out_dtype=out_dtype)
    main = torch.cuda.current_stream(dev)
    side = _side_stream(dev, main)
    side.wait_stream(main)
    # (cuBLAS leaves SMs to the main stream's kernels: see side_carveout)
    with torch.cuda.stream(side), _cublas_sm_carveout(side_carveout(num_sms(dev))):
        dw = wgrad_mm(qdy, qx, out_dtype=out_dtype)
    # the inputs were made on the main stream, which frees them after this backward returns: their memory must
    # not be handed out again before the side stream has read it
    for q in (qdy, qx):
        for c in q._copies():
            for t in (c.data, c.scale_inv, c.amax, c.global_scale):
                if t is not None:
                    t.record_stream(side)
    if _SIDE["join"] is None:
        _SIDE["join"] = (main, side)
        try:
            torch.autograd.Variable._execution_engine.queue_callback(lambda: _join_side(main, side))
        except RuntimeError:  # not inside a backward pass (a direct call): join now
            _join_side(main, side)
    return dw


@dataclass
class _Cfg:
    layer: GemmLayer
    recipe: Recipe
    is_first_microbatch: bool | None
    gelu: bool
    policy: str
    out_dtype: torch.dtype
    norm_eps: float | None = None  # set: the input is the pre-norm x, RMSNorm fused into its quantizer
    norm_rstd: torch.Tensor | None = None  # the norm's row statistics computed already (or None: computed here)
    norm_link: object = None  # a lowbit.ops.residual.NormGradLink: the norm's backward runs in the residual add's


def _quantize_input(cfg: _Cfg, x2: torch.Tensor, norm_weight, columnwise: bool):
    """(the input's QuantizedTensor, saved tensors of the norm's backward): x2 quantized as is, or (cfg.norm_eps set)
    RMSNorm(x2) by the fused kernel, with (x2, rstd, norm weight) for :func:`_norm_backward`."""
    layer, recipe = cfg.layer, cfg.recipe
    if cfg.norm_eps is None:
        q = layer.quantize(x2, "input", recipe, rowwise=True, columnwise=columnwise, phase="forward", policy=cfg.policy)
        return q, (None, None, None)
    q, rstd = layer.quantize_rmsnorm(x2, norm_weight, cfg.norm_eps, recipe, columnwise=columnwise, policy=cfg.policy,
                                     rstd=cfg.norm_rstd)
    return q, (x2, rstd, norm_weight)


def _norm_backward(dln: torch.Tensor, saved, need_dx: bool, need_dnw: bool, cfg: _Cfg, x_shape):
    """(dx, d norm weight) from the gradient of the fused RMSNorm's output (either None where not needed); with a
    norm link, both None: the gradient goes to the link and the residual add's backward computes them."""
    from ..ops.norm_quant import rms_norm_backward

    x2, rstd, nw = saved
    if cfg.norm_link is not None:
        cfg.norm_link.put(dln.reshape(x_shape), rstd)
        return None, None
    dx, dnw = rms_norm_backward(dln, x2, rstd, nw, need_dnw)
    return (dx if need_dx else None), dnw


def norm_fuses(x: torch.Tensor, norm_weight: torch.Tensor, recipe: Recipe) -> bool:
    """Whether RMSNorm(x) with ``norm_weight`` runs inside the input quantizer under ``recipe``: a current-scaling
    input role and :func:`lowbit.ops.norm_quant.norm_quant_fusable` (the one place this is decided)."""
    from ..ops.norm_quant import norm_quant_fusable

    rq = recipe.role("input")
    return not rq.delayed and norm_quant_fusable(x, norm_weight, rq.scheme)


def _norm_inputs(x: torch.Tensor, norm_weight, norm_eps, recipe: Recipe, norm_link=None):
    """``(x, norm_weight, norm_eps)`` for the Functions: unchanged where the RMSNorm can run inside the input
    quantizer (:func:`lowbit.ops.norm_quant.norm_quant_fusable` and a current-scaling input role), else
    ``(F.rms_norm(x), None, None)``: the norm applied first, as the modules' unfused path does (its backward in the
    residual add's where ``norm_link`` is given: :func:`lowbit.ops.residual.rms_norm_linked`). Validates the pair
    and the link."""
    if (norm_weight is None) != (norm_eps is None):
        raise ValueError(f"norm_weight, norm_eps: give both (RMSNorm fused into the input quantizer) or neither; got "
                         f"norm_weight {'None' if norm_weight is None else tuple(norm_weight.shape)}, norm_eps "
                         f"{norm_eps!r}")
    if norm_weight is None:
        if norm_link is not None:
            raise ValueError("norm_link: given without norm_weight / norm_eps (it links a fused RMSNorm's backward)")
        return x, None, None
    if not isinstance(norm_eps, (int, float)) or isinstance(norm_eps, bool) or not norm_eps > 0:
        raise ValueError(f"norm_eps: expected a float > 0, got {norm_eps!r}")
    if not isinstance(norm_weight, torch.Tensor) or tuple(norm_weight.shape) != (x.shape[-1],):
        got = tuple(norm_weight.shape) if isinstance(norm_weight, torch.Tensor) else type(norm_weight).__name__
        raise ValueError(f"norm_weight: expected a tensor of shape ({x.shape[-1]},) (the input's last dim), got {got}")
    if norm_link is not None:
        norm_link.check(x, norm_weight, norm_eps)
    if norm_fuses(x, norm_weight, recipe):
        return x, norm_weight, float(norm_eps)
    from ..ops.residual import rms_norm_linked

    return rms_norm_linked(x, norm_weight, norm_eps, norm_link), None, None


def _linear_forward(cfg: _Cfg, x2, weight, bias, norm_weight, need_dgrad: bool, need_wgrad: bool):
    """The forward of the quantized linear on 2D x2, shared by :class:`_QuantizedLinearFn` and
    :func:`quantized_linear_op`: ``(y, pre-GELU or None, x's QuantizedTensor, the weight's, the norm's saved
    tensors)``."""
    qx, norm_saved = _quantize_input(cfg, x2, norm_weight, need_wgrad)
    qw = cfg.layer.quantized_weight(weight, cfg.recipe, cfg.is_first_microbatch, columnwise=need_dgrad,
                                    policy=cfg.policy)
    b = None if bias is None else bias.detach()
    y, pre = scaled_mm(qx, qw, out_dtype=cfg.out_dtype, bias=b, gelu=cfg.gelu, return_pre_gelu=True)
    return y, pre, qx, qw, norm_saved


class _QuantizedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, norm_weight, cfg: _Cfg):
        K = x.shape[-1]
        x2 = x.reshape(-1, K)
        need_dgrad = ctx.needs_input_grad[0] or ctx.needs_input_grad[3]  # (the norm weight's gradient needs it too)
        need_wgrad = ctx.needs_input_grad[1]
        y, pre, qx, qw, norm_saved = _linear_forward(cfg, x2, weight, bias, norm_weight, need_dgrad, need_wgrad)
        # Keep only what the backward reads: x's columnwise (wgrad) copy and the weight's QuantizedTensor (its
        # columnwise copy for dgrad; the whole object, which may be the cross-microbatch cache entry).
        ctx.qx = _columnwise_only(qx) if need_wgrad else None
        ctx.qw = qw if need_dgrad else None
        ctx.cfg = cfg
        ctx.weight = weight  # (its .grad decides where the weight gradient may run: _wgrad)
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(pre if cfg.gelu else None, *norm_saved)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        cfg = ctx.cfg
        layer, recipe = cfg.layer, cfg.recipe
        pre, *norm_saved = ctx.saved_tensors
        N = dy.shape[-1]
        dy2 = dy.reshape(-1, N)
        if cfg.gelu:
            dy2 = (dy2.float() * _gelu_grad(pre)).to(dy.dtype)
        need_dgrad, need_wgrad = ctx.needs_input_grad[0] or ctx.needs_input_grad[3], ctx.needs_input_grad[1]
        dx = dw = db = dnw = None
        if need_dgrad or need_wgrad:
            qdy = None if cfg.gelu else layer.take_grad_output(dy2, recipe, need_dgrad=need_dgrad,
                                                               need_wgrad=need_wgrad,
                                                                phase="backward", policy=cfg.policy)
            if qdy is None:
                qdy = layer.quantize(dy2, "grad_output", recipe, rowwise=need_dgrad, columnwise=need_wgrad,
                                     phase="backward", policy=cfg.policy)
            if need_dgrad:
                dx = scaled_mm(qdy, ctx.qw, a_copy="rowwise", b_copy="columnwise", out_dtype=ctx.x_dtype)
                if cfg.norm_eps is not None:
                    dx, dnw = _norm_backward(dx, norm_saved, ctx.needs_input_grad[0], ctx.needs_input_grad[3], cfg,
                                             ctx.x_shape)
                dx = None if dx is None else dx.reshape(ctx.x_shape)
            if need_wgrad:
                dw = _wgrad(qdy, ctx.qx, ctx.w_dtype, ctx.weight)
        if ctx.needs_input_grad[2]:
            db = dy2.float().sum(0).to(ctx.bias_dtype)
        return dx, dw, db, dnw, None


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a quantized GEMM on input ``x`` outputs: torch.autocast's dtype where it is on, else x's."""
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: GemmLayer,
                     is_first_microbatch=None, *, gelu: bool = False, state: _ac.AutocastState | None = None,
                     norm_weight: torch.Tensor | None = None, norm_eps: float | None = None,
                     norm_rstd: torch.Tensor | None = None, norm_link=None) -> torch.Tensor:
    """``x · wᵀ + b`` (then GELU, erf form, if ``gelu``) with all three GEMMs quantized per the active recipe.

    Args:
        x: (..., K) float32 / bfloat16 / float16 (under ``torch.autocast`` the autocast dtype is used for the output).
        weight: (N, K) master weight (any float dtype the GEMM can output: float32 / bfloat16 / float16).
        bias: (N,) or None.
        layer: the module's :class:`GemmLayer` (name, delayed scaling, weight cache).
        is_first_microbatch: None: quantize the weight now; True: quantize and cache it; False: use the cache.
        norm_weight, norm_eps: given, the GEMM's input is ``RMSNorm(x)`` (weight (K,), epsilon): computed inside the
            input quantizer where it can be (:func:`lowbit.ops.norm_quant.norm_quant_fusable`, current-scaling input
            role: :func:`~lowbit.ops.norm_quant.rmsnorm_quantize_1x128`), else by ``F.rms_norm`` first; the gradient
            reaches x and norm_weight either way. norm_rstd: (M,) float32 row statistics of x for this norm computed
            already (:func:`lowbit.ops.residual.residual_add`), used where the norm is fused, else ignored.
            norm_link: a :class:`lowbit.ops.residual.NormGradLink` from the residual add that made x (for this
            norm_weight / norm_eps): the norm's backward then runs inside the add's; its rstd is used as norm_rstd.

    Returns:
        (..., N) in x's dtype (or the torch.autocast dtype).
    """
    st = state or _ac.get_state()
    recipe = st.recipe
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"input: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"input: last dim must be in_features = {weight.shape[1]} for layer {layer.name!r}, got shape "
                         f"{tuple(x.shape)}")
    if x.numel() == 0:
        raise ValueError(f"input: empty tensor (shape {tuple(x.shape)}) for layer {layer.name!r}")
    x, norm_weight, norm_eps = _norm_inputs(x, norm_weight, norm_eps, recipe, norm_link)
    norm_rstd, norm_link = _linked_rstd(norm_eps, norm_rstd, norm_link)
    out_dtype = _out_dtype(x)
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"input: quantized layers take float32, bfloat16 or float16 inputs, got {x.dtype} (layer "
                        f"{layer.name!r})")
    if weight.dtype not in _OUT_DTYPES:
        raise TypeError(f"weight: quantized layers need a float32, bfloat16 or float16 weight, got {weight.dtype} "
                        f"(layer {layer.name!r})")
    _check_dims(layer, recipe, x, weight)
    cfg = _Cfg(layer, recipe, is_first_microbatch, gelu, st.on_nonfinite, out_dtype, norm_eps, norm_rstd, norm_link)
    if torch.compiler.is_compiling():
        _no_link_when_compiling(norm_link)
        if _fp8_gathered(weight):
            return _gathered_fp8_weight_runs_eager(_QuantizedLinearFn, x, weight, bias, norm_weight, cfg)
        if _traced_linear_fits(x, weight, recipe, cfg):
            return _traced_linear(x, weight, bias, cfg, st.key)
        return _compiled_linear(x, weight, bias, norm_weight, cfg, st.key)
    return _QuantizedLinearFn.apply(x, weight, bias, norm_weight, cfg)


# ------------------------------------------------------------------------------------------------
# The quantized linear as torch.library operators: what torch.compile traces
# ------------------------------------------------------------------------------------------------
# Eager calls run _QuantizedLinearFn; inside torch.compile the same steps run as two operators, opaque to Dynamo and
# Inductor: lowbit::quantized_linear (the forward; returns y and what the backward reads) and
# lowbit::quantized_linear_backward, with fake implementations (shapes only) and registered autograd. The autocast
# state crosses as its key (a string: another recipe is another key, so a compiled graph is never reused for it);
# the layer (its name for the NaN sentry, delayed-scaling state, weight cache) is found from the weight at run time
# (layer_of). What differs from eager: no FP8 grad_output hand-off between layers, no norm link, no side-stream
# weight gradient (each needs an object to cross between operators); the bits of every output are the same.
def _own(outs: list[torch.Tensor], inputs) -> list[torch.Tensor]:
    """``outs`` as an operator may return them: a tensor that shares storage with an input or an earlier output, or
    is a part of a larger allocation (a scale in an amax buffer: CUDA graphs track whole allocations), is copied."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
    res = []
    for t in outs:
        st = t.untyped_storage()
        p = st.data_ptr()
        if p in seen or t.data_ptr() != p or st.nbytes() != t.numel() * t.element_size():
            t = t.clone()
            p = t.untyped_storage().data_ptr()
        seen.add(p)
        res.append(t)
    return res


_MICROBATCH = {-1: None, 0: False, 1: True}  # an operator's int argument -> is_first_microbatch


def _microbatch_code(is_first_microbatch) -> int:
    return -1 if is_first_microbatch is None else int(is_first_microbatch)


def _op_state(key: str, weight: torch.Tensor, microbatch: int = -1) -> tuple[Recipe, str]:
    """(recipe, NaN-sentry policy) of an operator call. Under torch.compile's CUDA graphs (``mode="reduce-overhead"``)
    the call runs from the graph's private memory pool, where nothing allocated may outlive the call, and its Python
    runs only while the graph is recorded: a weight cached across calls (``is_first_microbatch``) raises; delayed
    scaling keeps its choice of scale and its pending amaxes on the device (:meth:`GemmLayer.quantize`); the sentry
    copies its amaxes into a board outside the graph (:mod:`lowbit.nn.state`)."""
    recipe, policy = _ac.from_key(key)
    if not weight.is_cuda:
        return recipe, policy
    tree = in_graph_tree(weight.device)  # (asked once: it looks up torch's graph-tree manager)
    if tree or torch.cuda.is_current_stream_capturing():
        if microbatch != -1:
            raise NotImplementedError(
                f"is_first_microbatch: {_MICROBATCH[microbatch]} caches the quantized weight across calls, which "
                "torch.compile's CUDA graphs (mode='reduce-overhead') cannot carry; pass None there")
    if tree:
        policy = _ac.graph_policy(policy)
    return recipe, policy


@torch.library.custom_op("lowbit::quantized_linear", mutates_args=())
def quantized_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                        norm_weight: Optional[torch.Tensor], norm_rstd: Optional[torch.Tensor], key: str, gelu: bool,
                        norm_eps: float, out_dtype: torch.dtype, microbatch: int, need_dgrad: bool,
                        need_wgrad: bool) -> list[torch.Tensor]:
    """The forward of :func:`quantized_linear` on a 2D input x (M, K): ``[y (M, N)]`` followed by what its backward
    reads: x's columnwise copy (``need_wgrad``), the weight's columnwise copy (``need_dgrad``), the pre-GELU output
    (``gelu``) and the RMSNorm's row statistics (``norm_weight`` given: RMSNorm(x) fused into the input quantizer
    with ``norm_eps``). ``key``: the autocast state's key; ``microbatch``: -1 / 0 / 1 for ``is_first_microbatch``
    None / False / True."""
    recipe, policy = _op_state(key, weight, microbatch)
    layer = layer_of(weight)
    mb = _MICROBATCH[microbatch]
    cfg = _Cfg(layer, recipe, mb, gelu, policy, out_dtype, None if norm_weight is None else norm_eps, norm_rstd)
    y, pre, qx, qw, norm_saved = _linear_forward(cfg, x, weight, bias, norm_weight, need_dgrad, need_wgrad)
    out = [y]
    if need_wgrad:
        out += copy_tensors(qx, "columnwise")
    if need_dgrad:
        out += copy_tensors(qw, "columnwise")
    if gelu:
        out.append(pre)
    if norm_weight is not None:
        out.append(norm_saved[1])
    return _own(out, (x, weight, bias, norm_weight, norm_rstd))


@quantized_linear_op.register_fake
def _(x, weight, bias, norm_weight, norm_rstd, key, gelu, norm_eps, out_dtype, microbatch, need_dgrad, need_wgrad):
    recipe, _ = _ac.from_key(key)
    (M, K), N = x.shape, weight.shape[0]
    out = [x.new_empty((M, N), dtype=out_dtype)]
    if need_wgrad:
        out += empty_copy_tensors(recipe.role("input").scheme, (M, K), "columnwise", x.device)
    if need_dgrad:
        out += empty_copy_tensors(recipe.role("weight").scheme, (N, K), "columnwise", x.device)
    if gelu:
        out.append(x.new_empty((M, N), dtype=out_dtype))
    if norm_weight is not None:
        out.append(x.new_empty((M,), dtype=torch.float32))
    return out


@torch.library.custom_op("lowbit::quantized_linear_backward", mutates_args=())
def quantized_linear_backward_op(dy: torch.Tensor, x: Optional[torch.Tensor], weight: torch.Tensor,
                                 bias: Optional[torch.Tensor], norm_weight: Optional[torch.Tensor],
                                 saved: list[torch.Tensor], key: str, gelu: bool, norm_eps: float, x_dtype: torch.dtype,
                                 need_dx: bool, need_dw: bool, need_dnw: bool, need_db: bool) -> list[torch.Tensor]:
    """The backward of :func:`quantized_linear_op` for dy (M, N) and its ``saved`` outputs (x: the 2D input, given
    where the RMSNorm is fused): ``[dx (M, K)]`` if ``need_dx``, ``[dw]`` if ``need_dw``, ``[d norm_weight]`` if
    ``need_dnw``, ``[d bias]`` if ``need_db``."""
    recipe, policy = _op_state(key, weight)
    layer = layer_of(weight)
    (M, N), K = dy.shape, weight.shape[1]
    need_dgrad = need_dx or need_dnw
    cfg = _Cfg(layer, recipe, None, gelu, policy, x_dtype, None if norm_weight is None else norm_eps)
    sin, sw = recipe.role("input").scheme, recipe.role("weight").scheme
    i = 0
    qx = qw = pre = rstd = None
    if need_dw:
        qx = copy_from_tensors(saved[i:i + n_copy_tensors(sin)], sin, (M, K), x_dtype, "columnwise")
        i += n_copy_tensors(sin)
    if need_dgrad:
        qw = copy_from_tensors(saved[i:i + n_copy_tensors(sw)], sw, (N, K), weight.dtype, "columnwise")
        i += n_copy_tensors(sw)
    if gelu:
        pre, i = saved[i], i + 1
        dy = (dy.float() * _gelu_grad(pre)).to(dy.dtype)
    if norm_weight is not None:
        rstd = saved[i]
    out = []
    if need_dgrad or need_dw:
        qdy = layer.quantize(dy, "grad_output", recipe, rowwise=need_dgrad, columnwise=need_dw, phase="backward",
                             policy=policy)
    if need_dgrad:
        dx = scaled_mm(qdy, qw, a_copy="rowwise", b_copy="columnwise", out_dtype=x_dtype)
        dnw = None
        if norm_weight is not None:
            dx, dnw = _norm_backward(dx, (x, rstd, norm_weight), need_dx, need_dnw, cfg, x.shape)
        if need_dx:
            out.append(dx)
        if need_dnw:
            out.append(dnw)
    if need_dw:
        out.insert(1 if need_dx else 0, wgrad_mm(qdy, qx, out_dtype=weight.dtype))
    if need_db:
        out.append(dy.float().sum(0).to(bias.dtype))
    return _own(out, (dy, x, weight, bias, norm_weight, *saved))


@quantized_linear_backward_op.register_fake
def _(dy, x, weight, bias, norm_weight, saved, key, gelu, norm_eps, x_dtype, need_dx, need_dw, need_dnw, need_db):
    M, (N, K) = dy.shape[0], weight.shape
    out = []
    if need_dx:
        out.append(dy.new_empty((M, K), dtype=x_dtype))
    if need_dw:
        out.append(dy.new_empty((N, K), dtype=weight.dtype))
    if need_dnw:
        out.append(dy.new_empty((K,), dtype=norm_weight.dtype))
    if need_db:
        out.append(dy.new_empty((N,), dtype=bias.dtype))
    return out


def _linear_setup(ctx, inputs, output):
    x, weight, bias, norm_weight, _, key, gelu, norm_eps, _, _, need_dgrad, need_wgrad = inputs
    ctx.mark_non_differentiable(*output[1:])
    ctx.save_for_backward(x if norm_weight is not None else None, weight, bias, norm_weight, *output[1:])
    ctx.key, ctx.gelu, ctx.norm_eps, ctx.x_dtype = key, gelu, norm_eps, x.dtype
    ctx.fwd_need = (need_dgrad, need_wgrad)


def _linear_backward(ctx, grads):
    x, weight, bias, norm_weight, *saved = ctx.saved_tensors
    dy = grads[0]
    need_dx, need_dw, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
    need_dnw = norm_weight is not None and ctx.needs_input_grad[3]
    need_dx, need_dw = need_dx and ctx.fwd_need[0], need_dw and ctx.fwd_need[1]
    need_dnw = need_dnw and ctx.fwd_need[0]
    dx = dw = db = dnw = None
    # (the bias gradient too: torch's sum, as eager, not a reduction Inductor would order its own way)
    if need_dx or need_dw or need_dnw or need_db:
        res = list(quantized_linear_backward_op(dy, x, weight, bias, norm_weight, saved, ctx.key, ctx.gelu,
                                                ctx.norm_eps, ctx.x_dtype, need_dx, need_dw, need_dnw, need_db))
        dx = res.pop(0) if need_dx else None
        dw = res.pop(0) if need_dw else None
        dnw = res.pop(0) if need_dnw else None
        db = res.pop(0) if need_db else None
    return dx, dw, db, dnw, None, None, None, None, None, None, None, None


quantized_linear_op.register_autograd(_linear_backward, setup_context=_linear_setup)


def _compiled_linear(x: torch.Tensor, weight: torch.Tensor, bias, norm_weight, cfg: _Cfg, key: str) -> torch.Tensor:
    """:func:`quantized_linear` through :func:`quantized_linear_op` (inside torch.compile)."""
    K = x.shape[-1]
    grad = torch.is_grad_enabled()
    need_dgrad = grad and (x.requires_grad or (norm_weight is not None and norm_weight.requires_grad))
    need_wgrad = grad and weight.requires_grad
    mb = _microbatch_code(cfg.is_first_microbatch)
    outs = quantized_linear_op(x.reshape(-1, K), weight, bias, norm_weight, cfg.norm_rstd, key,
                               cfg.gelu, 0.0 if cfg.norm_eps is None else cfg.norm_eps, cfg.out_dtype, mb,
                               need_dgrad, need_wgrad)
    y = outs[0]
    return y.reshape(*x.shape[:-1], y.shape[-1])


# ------------------------------------------------------------------------------------------------
# The quantized linear traced (inside torch.compile, FP8)
# ------------------------------------------------------------------------------------------------
# Where the recipe quantizes every role under Float8Tensorwise or Float8Blockwise with current scaling (fp8-current,
# fp8-block), or per tensor with delayed scaling (fp8-delayed), and the GEMMs are cuBLAS's, the compiled graph holds the
# layer itself instead of one opaque operator: per-tensor quantization as torch operations Inductor fuses, each
# blockwise tensor's copies from one operator over lowbit's kernels (lowbit.quant.traceable has both), the GEMMs as
# eager runs them (cuBLAS's aten calls, lowbit.gemm.cublas.scaled_mm_cublas_traceable; the forward and data gradient as
# lowbit's CUDA kernel's operator where that backend takes the call, lowbit.gemm.cuda_sm90), the NaN sentry's amaxes
# max-accumulated into the layer's slot tensors inside the graph (GemmLayer.sentry_slots, by the blockwise kernel
# itself; lowbit.nn.state checks them; no launch of their own under fp8-block). Delayed scaling reads each role's scale
# and record count from its AmaxHistory's device_state (a graph input, allocated at the outermost autocast entry) and
# folds the amax into its pending max in place; the outermost exit commits them on the device (lowbit.nn.state). The
# input reaches the quantizers N-D, as it came. Per call no lowbit Python runs but for a layer whose slots are not
# allocated yet (the sentry's record operators) and the CUDA GEMM's operator (its launch); the bits are eager's. Not
# traced (the operators above run): a GELU or RMSNorm fused into the layer, a weight cached across micro-batches, dims
# the GEMMs or blocks do not divide. A weight FSDP2 gathers as FP8 copies runs the layer eager (a graph break:
# _gathered_fp8_weight_runs_eager).
#
# Where they run, the sentry's records run once per layer and pass: they are defined with
# torch.library.Library, whose call reaches the Python kernel directly, not through torch.library.custom_op's Python
# autograd and backend wrappers (about 9 us of host time a call less; they take no gradient: called inside the
# Function's passes). The forward's record returns nothing and is kept in the graph by an ordered effect; the
# backward's returns copies of the GEMMs' scales, which keep it there by data dependence (an effectful operator in a
# backward graph breaks the partitioner in some torch releases: pytorch/pytorch#172248).
_LIB = torch.library.Library("lowbit", "FRAGMENT")
_LIB.define("sentry_record(Tensor[] amaxes, Tensor weight, str key, str roles, str phase) -> ()",
            tags=(torch.Tag.pt2_compliant_tag,))
_LIB.define("sentry_pass(Tensor[] scales, Tensor[] amaxes, Tensor weight, str key, str roles, str phase) -> Tensor[]",
            tags=(torch.Tag.pt2_compliant_tag,))


def _copies(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Fresh copies of the tensors ``ts`` (one device; as ``clone`` makes them), made by one launch."""
    out = [torch.empty_like(t) for t in ts]
    if out:
        torch._foreach_copy_(out, ts)
    return out


def _copies_kept(policy: str) -> bool:
    """Whether an operator records copies of its amaxes for the sentry's later check (:func:`_kept`). A compiled
    graph owns its operators' inputs and reuses their memory for later buffers once the call returns (a kept input
    would be read back overwritten). Under torch.compile's CUDA graphs the sentry copies them into its board at once;
    with the sentry off nothing keeps them."""
    return not (policy.startswith(_ac.GRAPH_PREFIX) or _ac.sentry_off(policy))


def _kept(amaxes: list[torch.Tensor], policy: str) -> list[torch.Tensor]:
    """``amaxes`` as an operator may keep them for the sentry's later check: a copy in one launch where
    :func:`_copies_kept`, else as they are."""
    return _copies([a.detach() for a in amaxes]) if _copies_kept(policy) else amaxes


def _record(kept: list[torch.Tensor], weight: torch.Tensor, roles: str, phase: str, policy: str) -> None:
    layer = layer_of(weight)
    for role, a in zip(roles.split(","), kept):
        _ac.sentry(a, layer=layer, role=role, phase=phase, policy=policy)


def _sentry_record(amaxes: list[torch.Tensor], weight: torch.Tensor, key: str, roles: str, phase: str) -> None:
    """Record ``amaxes`` (one 1-D tensor of maxima per comma-separated role in ``roles``) of the layer that owns
    ``weight`` for the NaN sentry, under the policy of the autocast state ``key`` (a copy of them: :func:`_kept`)."""
    _, policy = _op_state(key, weight)
    _record(_kept(amaxes, policy), weight, roles, phase, policy)


def _sentry_pass(scales: list[torch.Tensor], amaxes: list[torch.Tensor], weight: torch.Tensor, key: str,
                 roles: str, phase: str) -> list[torch.Tensor]:
    """:func:`_sentry_record`, returning copies of ``scales``, which the GEMMs then read (the kept amaxes and the
    scales copied by one launch)."""
    _, policy = _op_state(key, weight)
    own = _copies_kept(policy)
    out = _copies(list(scales) + ([a.detach() for a in amaxes] if own else []))
    _record(out[len(scales):] if own else amaxes, weight, roles, phase, policy)
    return out[:len(scales)]


_LIB.impl("sentry_record", _sentry_record, "CompositeExplicitAutograd")
_LIB.impl("sentry_pass", _sentry_pass, "CompositeExplicitAutograd")


@torch.library.register_fake("lowbit::sentry_record", lib=_LIB)
def _(amaxes, weight, key, roles, phase):
    return None


@torch.library.register_fake("lowbit::sentry_pass", lib=_LIB)
def _(scales, amaxes, weight, key, roles, phase):
    return [torch.empty_like(s) for s in scales]


register_ordered(torch.ops.lowbit.sentry_record.default)
sentry_record_op = torch.ops.lowbit.sentry_record.default
sentry_pass_op = torch.ops.lowbit.sentry_pass.default




_ROLES = ("input", "weight", "grad_output")


def linear_traces(x: torch.Tensor, weight: torch.Tensor, recipe: Recipe, is_first_microbatch=None,
                  layer: "GemmLayer | None" = None) -> bool:
    """Whether :func:`quantized_linear` of ``x`` by ``weight`` under ``recipe`` (no fused norm, no GELU), called now,
    runs as torch operations in the compiled graph (the traced Function; no lowbit Python per call but the CUDA GEMM
    operator's launch, lowbit.gemm.cuda_sm90): inside
    torch.compile, on plain CUDA tensors, within :func:`traced_linear_rules`. A fused module (a norm inside the input
    quantizer, the SwiGLU MLP) asks this to leave its fusions to Inductor where the plain linear traces: its fused
    form is an operator whose Python runs every call. ``layer``: the GEMM's layer (inside a
    :class:`lowbit.nn.cached_weights` block the linear runs as the operator, which takes the kept copy)."""
    if not torch.compiler.is_compiling() or _fp8_gathered(weight):
        return False
    cfg = _Cfg(layer, recipe, is_first_microbatch, False, "raise", _out_dtype(x))
    return _traced_linear_fits(x, weight, recipe, cfg)


def _traced_linear_fits(x: torch.Tensor, weight: torch.Tensor, recipe: Recipe, cfg: _Cfg) -> bool:
    """Whether the compiled graph can hold this call as torch operations (:class:`_TracedLinearFn`): plain CUDA
    tensors and :func:`traced_linear_rules`."""
    if not x.is_cuda or weight.__class__ not in (torch.Tensor, torch.nn.Parameter) or x.__class__ is not torch.Tensor:
        return False
    (N, K), M = weight.shape, x.numel() // x.shape[-1]
    return traced_linear_rules(recipe, cfg, M, N, K, x.dtype, weight.dtype)


def traced_linear_rules(recipe: Recipe, cfg: _Cfg, M: int, N: int, K: int, x_dtype: torch.dtype,
                        w_dtype: torch.dtype) -> bool:
    """The recipe, epilogue and shape rules of the traced linear, for x (M, K) and a weight (N, K): no GELU, fused
    norm or weight cached across micro-batches or kept by :class:`lowbit.nn.cached_weights`; every role FP8 that
    :mod:`lowbit.quant.traceable` covers for its copies, current-scaled, or all three per-tensor with delayed scaling;
    the three GEMMs cuBLAS's (:func:`lowbit.gemm.cublas.schemes_supported`)."""
    from ..gemm.cublas import schemes_supported
    from ..quant.traceable import traceable_fits

    if cfg.gelu or cfg.norm_eps is not None or cfg.is_first_microbatch is not None:
        return False
    if cfg.layer is not None and cfg.layer.keep_weights:  # (the operator takes the copy cached_weights keeps)
        return False
    sin, sw, sg = (recipe.role(r).scheme for r in _ROLES)
    delayed = [recipe.role(r).delayed for r in _ROLES]
    if any(delayed) and not (all(delayed) and all(isinstance(c, Float8Tensorwise) for c in (sin, sw, sg))):
        return False
    return (traceable_fits(sin, M, K) and traceable_fits(sw, N, K) and traceable_fits(sg, M, N)
            and schemes_supported(sin, sw, M, N, K, cfg.out_dtype)  # fprop: x (M, K) . w (N, K)
            and schemes_supported(sg, sw, M, K, N, x_dtype)  # dgrad: dy (M, N) . w's columnwise copy (K, N)
            and schemes_supported(sg, sin, N, K, M, w_dtype))  # wgrad: dy's (N, M) . x's (K, M) copies


class _TracedLinearFn(torch.autograd.Function):
    """:func:`quantized_linear` as torch operations (see above), x (..., K) read as 2D; the autocast state crosses as
    its key; x_slot, w_slot, dy_slot: the layer's sentry slots (None: the sentry's operators record)."""

    @staticmethod
    def forward(ctx, x, weight, bias, key: str, out_dtype: torch.dtype, need_dgrad: bool, need_wgrad: bool,
                x_slot: torch.Tensor | None, w_slot: torch.Tensor | None, dy_slot: torch.Tensor | None,
                x_state: torch.Tensor | None, w_state: torch.Tensor | None, dy_state: torch.Tensor | None):
        from ..gemm.cuda_sm90 import scaled_mm_traceable

        recipe, _ = _ac.from_key(key)
        sin, sw = recipe.role("input").scheme, recipe.role("weight").scheme
        items = [(x, sin, True, need_wgrad, "input", x_slot, x_state),
                 (weight, sw, True, need_dgrad, "weight", w_slot, w_state)]
        qx, qw = _recorded_copies(items, weight, key, "forward")
        y = scaled_mm_traceable(qx.rowwise, qw.rowwise, qx.row_scale_inv, qw.row_scale_inv, a_scheme=sin, b_scheme=sw,
                                out_dtype=out_dtype, bias=bias)
        ctx.save_for_backward(qx.columnwise, qx.col_scale_inv, qw.columnwise, qw.col_scale_inv, weight, dy_slot,
                              dy_state)
        ctx.key, ctx.need = key, (need_dgrad, need_wgrad)
        ctx.x_dtype, ctx.x_shape, ctx.bias_dtype = x.dtype, x.shape, None if bias is None else bias.dtype
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        from ..gemm.cuda_sm90 import scaled_mm_traceable

        xc, xcs, wc, wcs, weight, slot, state = ctx.saved_tensors
        recipe, _ = _ac.from_key(ctx.key)
        sin, sw, sg = (recipe.role(r).scheme for r in _ROLES)
        need_dgrad, need_wgrad = ctx.need
        need_dgrad, need_wgrad = need_dgrad and ctx.needs_input_grad[0], need_wgrad and ctx.needs_input_grad[1]
        dx = dw = db = None
        if need_dgrad or need_wgrad:
            (q,) = _recorded_copies([(dy, sg, need_dgrad, need_wgrad, "grad_output", slot, state)], weight, ctx.key,
                                    "backward")
            if need_dgrad:
                dx = scaled_mm_traceable(q.rowwise, wc, q.row_scale_inv, wcs, a_scheme=sg, b_scheme=sw,
                                         out_dtype=ctx.x_dtype).reshape(ctx.x_shape)
            if need_wgrad:
                dw = scaled_mm_traceable(q.columnwise, xc, q.col_scale_inv, xcs, a_scheme=sg, b_scheme=sin,
                                         out_dtype=weight.dtype)
        if ctx.needs_input_grad[2]:
            db = column_sum_op(dy.reshape(-1, dy.shape[-1]), ctx.bias_dtype)
        return dx, dw, db, None, None, None, None, None, None, None, None, None, None


def _delayed_copies(t: torch.Tensor, sch, rowwise: bool, columnwise: bool, slot, state: torch.Tensor, warmup: int):
    """The per-tensor copies of ``t`` (read as 2D) under delayed scaling, inside the graph: the scale from the role's
    history (``state``, :attr:`lowbit.AmaxHistory.device_state`; the current scale during warm-up,
    :func:`lowbit.quant.traceable.delayed_scale`), the amax folded into the history's pending max in place and, given
    ``slot``, into the sentry's slot."""
    from ..quant.reference import amax_of
    from ..quant.scaling import fold_pending
    from ..quant.traceable import delayed_scale, tensorwise_copies

    t2 = t.reshape(-1, t.shape[-1])  # (inside the Function's passes: no autograd to detach from)
    a = amax_of(t2)
    s, si = delayed_scale(a, state[0:1], state[1:2], warmup, sch.format.max)
    fold_pending(state, a)  # (AmaxHistory.observe, on the graph's input)
    return tensorwise_copies(t2, sch, a, s, si, rowwise=rowwise, columnwise=columnwise, amax_into=slot)


def _recorded_copies(items, weight: torch.Tensor, key: str, phase: str) -> list:
    """The copies of each ``(tensor, scheme, rowwise, columnwise, role, slot, state)`` in ``items``: current scaling
    (:func:`lowbit.quant.traceable.quantize_traceable`), or delayed from the role's history ``state``
    (:func:`_delayed_copies`; every item has one, or none does); every amax recorded for the NaN sentry: given the
    role's ``slot`` (of :attr:`GemmLayer.sentry_slots`; every item has one, or none does), max-accumulated into it
    inside the graph, a running max until the next check zeroes it (so every call since then is checked, two
    backwards before a check too); else by one operator: in the forward :func:`sentry_record_op`, in the backward
    :func:`sentry_pass_op`, whose copies of the scales the GEMMs then read. None with ``on_nonfinite="off"``."""
    from ..quant.traceable import quantize_traceable

    recipe, policy = _ac.from_key(key)
    if items[0][6] is not None:
        warmup = recipe.warmup_steps
        out = [_delayed_copies(t, sch, r, c, slot, state, warmup) for t, sch, r, c, _, slot, state in items]
    else:
        out = [quantize_traceable(t, sch, rowwise=r, columnwise=c, amax_into=slot)
               for t, sch, r, c, _, slot, _ in items]
    if items[0][5] is not None or _ac.sentry_off(policy):  # (slots, or on_nonfinite="off": no record)
        return out
    amaxes, roles = [q.amax for q in out], ",".join(i[4] for i in items)
    if phase == "forward":
        sentry_record_op(amaxes, weight, key, roles, phase)
        return out
    scales = [s for q in out for s in (q.row_scale_inv, q.col_scale_inv) if s is not None]
    scales = iter(sentry_pass_op(scales, amaxes, weight, key, roles, phase))
    return [q._replace(row_scale_inv=None if q.row_scale_inv is None else next(scales),
                       col_scale_inv=None if q.col_scale_inv is None else next(scales)) for q in out]


def _traced_linear(x: torch.Tensor, weight: torch.Tensor, bias, cfg: _Cfg, key: str) -> torch.Tensor:
    """:func:`quantized_linear` through :class:`_TracedLinearFn` (inside torch.compile)."""
    K = x.shape[-1]
    grad = torch.is_grad_enabled()
    layer, slots = cfg.layer, cfg.layer.sentry_slots
    states = (None, None, None)
    if cfg.recipe.role("input").delayed:
        st = layer.delayed
        if st is None or not st.compatible(cfg.recipe) or st.device != x.device:
            # (its state is made at the outermost autocast entry, outside the graph: a layer first seen inside it,
            # or one whose state does not fit this recipe, runs the operator, which raises the error eager raises)
            return _compiled_linear(x, weight, bias, None, cfg, key)
        st.compiled = True  # (as below: replayed at every call; the state's pending amaxes commit on the device)
        states = tuple(st.histories[r].device_state for r in _ROLES)
    if slots is None or slots[0].device != x.device or _ac.sentry_off(cfg.policy):
        slots = (None, None, None)  # (the sentry's operators record instead)
    else:
        layer.sentry_armed = cfg.policy  # (Dynamo replays the assignment at every call of the graph)
    x_nd = x.reshape(1, K) if x.dim() == 1 else x  # (read as 2D by the quantizers; N-D as it came)
    y = _TracedLinearFn.apply(x_nd, weight, bias, key, cfg.out_dtype, grad and x.requires_grad,
                              grad and weight.requires_grad, *slots, *states)
    return y.reshape(-1) if x.dim() == 1 else y


def _no_link_when_compiling(norm_link) -> None:
    """A norm link hands the norm's gradient to the residual add's backward outside autograd: no operator can carry
    it, so a compiled graph must not be given one (``lowbit.ops.residual_add`` makes none under torch.compile)."""
    if norm_link is not None:
        raise NotImplementedError("norm_link: a NormGradLink cannot cross torch.compile's operators; under "
                                  "torch.compile call without it (lowbit.ops.residual_add returns none there)")


def _fp8_gathered(*weights) -> bool:
    """Whether a weight is one FSDP2 gathered as FP8 copies (``lowbit.nn.fp8_all_gather``'s tensor subclass, marked
    by a class attribute: this module does not import that one)."""
    return any(getattr(type(w), "lowbit_fp8_gathered", False) for w in weights)


@torch.compiler.disable
def _gathered_fp8_weight_runs_eager(fn, *args):
    """``fn.apply(*args)``: the eager layer (autograd Function ``fn``), for a layer inside a compiled region whose
    weight FSDP2 gathered as FP8 copies, a tensor subclass holding no values, which Dynamo cannot trace. Disabled for
    torch.compile: Dynamo breaks the graph at the call and runs it (and what it calls) eager."""
    from ..runtime.log import declined

    declined("torch.compile", "a weight gathered by FSDP2 as FP8 copies (lowbit.nn.fp8_all_gather): the layer runs "
             "eager")
    return fn.apply(*args)


def _linked_rstd(norm_eps, norm_rstd, norm_link):
    """(norm_rstd, norm_link) for a Function's config: both None where the norm is not fused (it ran first, with
    the link if any); a link's rstd replaces the given one (the backward must use the statistics of the forward)."""
    if norm_eps is None:
        return None, None
    return (norm_link.rstd if norm_link is not None else norm_rstd), norm_link


# ------------------------------------------------------------------------------------------------
# fc1 -> SwiGLU -> fc2 under a 1x128 blockwise recipe, with SwiGLU fused into fc2's input quantizer
# ------------------------------------------------------------------------------------------------
def swiglu_mlp_fusable(x: torch.Tensor, w1: torch.Tensor, b1, recipe: Recipe,
                       out_dtype: torch.dtype | None = None) -> bool:
    """Whether :func:`quantized_swiglu_mlp` can run this MLP: fc1 without bias (kept on the unfused path, which
    computes its gradient), input and grad_output roles quantized 1x128 Float8Blockwise with
    current scaling, a 16-bit fc1 output on CUDA, ffn a multiple of 128. ``LOWBIT_UNFUSE=swiglu_quant`` turns
    the fusion off (the modules then run SwiGLU and the quantizers as separate kernels, same bits)."""
    from ..ops.swiglu import fused_quant_runs

    if b1 is not None or not env.fused("swiglu_quant"):
        return False
    out_dtype = _out_dtype(x) if out_dtype is None else out_dtype  # u's dtype: fc1's output
    for role in ("input", "grad_output"):
        rq = recipe.role(role)
        if rq.delayed or not fused_quant_runs(x.device, out_dtype, w1.shape[0], rq.scheme):
            return False
    return True


def _fused_swiglu_bwd() -> bool:
    """SwiGLU's backward fused into fc1's grad_output quantizer where it can run
    (:func:`lowbit.ops.swiglu.swiglu_backward_quantize_1x128`; same bits as the two kernels);
    ``LOWBIT_UNFUSE=swiglu_bwd_quant`` turns it off."""
    return env.fused("swiglu_bwd_quant")


def _swiglu_mlp_forward(cfg1: _Cfg, g2: GemmLayer, x2, w1, w2, b2, norm_weight, need_dx: bool, need_dw1: bool,
                        need_dw2: bool):
    """The forward of the fused SwiGLU MLP on 2D x2, shared by :class:`_SwiGLUMLPFn` and
    :func:`quantized_swiglu_mlp_op` (fc2 quantizes with fc1's recipe, policy and microbatch flag in ``cfg1``):
    ``(y, u, qx, qh, qw1, qw2, the norm's saved tensors)``."""
    from ..ops.swiglu import swiglu_quantize_1x128

    recipe, policy, mb = cfg1.recipe, cfg1.policy, cfg1.is_first_microbatch
    qx, norm_saved = _quantize_input(cfg1, x2, norm_weight, need_dw1)
    qw1 = cfg1.layer.quantized_weight(w1, recipe, mb, columnwise=need_dx, policy=policy)
    u = scaled_mm(qx, qw1, out_dtype=cfg1.out_dtype)
    qh = swiglu_quantize_1x128(u, recipe.role("input").scheme, rowwise=True, columnwise=need_dw2)
    _ac.sentry([c.amax for c in qh._copies()], layer=g2, role="input", phase="forward", policy=policy)
    qw2 = g2.quantized_weight(w2, recipe, mb, columnwise=need_dx or need_dw1, policy=policy)
    y = scaled_mm(qh, qw2, out_dtype=cfg1.out_dtype, bias=None if b2 is None else b2.detach())
    return y, u, qx, qh, qw1, qw2, norm_saved


class _SwiGLUMLPFn(torch.autograd.Function):
    """``fc2(silu(a)·b)`` with ``[a | b] = fc1(x)``: the six quantized GEMMs of :class:`_QuantizedLinearFn` (twice,
    less fc1's bias), with SwiGLU fused into fc2's input quantizer (forward) by
    :func:`lowbit.ops.swiglu.swiglu_quantize_1x128`; the backward runs SwiGLU's backward inside fc1's grad_output
    quantizer where it can (:func:`lowbit.ops.swiglu.swiglu_backward_quantize_1x128`: whole 128-row tiles, both
    copies wanted), else SwiGLU's backward kernel and the quantizer, as the unfused path does. Saves x's and h's
    columnwise copies, the weights' QuantizedTensors and the 16-bit fc1 output u (the SwiGLU backward reads it)."""

    @staticmethod
    def forward(ctx, x, w1, w2, b2, norm_weight, cfg1: _Cfg, cfg2: _Cfg):
        g2 = cfg2.layer
        K = x.shape[-1]
        x2 = x.reshape(-1, K)
        need_dx = ctx.needs_input_grad[0] or ctx.needs_input_grad[4]  # (the norm weight's gradient needs dx too)
        need_dw1, need_dw2 = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        need_du = need_dx or need_dw1
        y, u, qx, qh, qw1, qw2, norm_saved = _swiglu_mlp_forward(cfg1, g2, x2, w1, w2, b2, norm_weight, need_dx,
                                                                 need_dw1, need_dw2)
        ctx.qx = _columnwise_only(qx) if need_dw1 else None
        ctx.qh = _columnwise_only(qh) if need_dw2 else None
        ctx.qw1 = qw1 if need_dx else None
        ctx.qw2 = qw2 if need_du else None
        ctx.cfg1, ctx.cfg2 = cfg1, cfg2
        ctx.w1, ctx.w2 = w1, w2  # (their .grad decides where the weight gradients may run: _wgrad)
        ctx.x_shape, ctx.x_dtype, ctx.w1_dtype, ctx.w2_dtype = x.shape, x.dtype, w1.dtype, w2.dtype
        ctx.b2_dtype = None if b2 is None else b2.dtype
        ctx.save_for_backward(u if need_du else None, *norm_saved)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        from ..ops.swiglu import swiglu_backward, swiglu_backward_fused_quant_supported, swiglu_backward_quantize_1x128

        cfg1, cfg2 = ctx.cfg1, ctx.cfg2
        g1, g2, recipe = cfg1.layer, cfg2.layer, cfg1.recipe
        u, *norm_saved = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        need_dx = ctx.needs_input_grad[0] or ctx.needs_input_grad[4]
        need_dw1, need_dw2 = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        need_du = need_dx or need_dw1
        dx = dw1 = dw2 = db2 = dnw = None
        if need_du or need_dw2:
            qdy = g2.quantize(dy2, "grad_output", recipe, rowwise=need_du, columnwise=need_dw2, phase="backward",
                              policy=cfg2.policy)
            if need_du:
                dh = scaled_mm(qdy, ctx.qw2, a_copy="rowwise", b_copy="columnwise", out_dtype=u.dtype)
            # (after fc2's data gradient: on a side stream it then overlaps the memory-bound kernels below)
            if need_dw2:
                dw2 = _wgrad(qdy, ctx.qh, ctx.w2_dtype, ctx.w2)
            if need_du:
                sch1 = recipe.role("grad_output").scheme
                if need_dx and need_dw1 and _fused_swiglu_bwd() and swiglu_backward_fused_quant_supported(u, dh, sch1):
                    # SwiGLU's backward inside fc1's grad_output quantizer: du is never written in 16 bits
                    qdu = swiglu_backward_quantize_1x128(u, dh, sch1)
                    _ac.sentry([c.amax for c in qdu._copies()], layer=g1, role="grad_output", phase="backward",
                               policy=cfg1.policy)
                else:
                    du = swiglu_backward(u, dh)
                    qdu = g1.quantize(du, "grad_output", recipe, rowwise=need_dx, columnwise=need_dw1,
                                      phase="backward", policy=cfg1.policy)
                    del du
                del dh
                if need_dx:
                    dx = scaled_mm(qdu, ctx.qw1, a_copy="rowwise", b_copy="columnwise", out_dtype=ctx.x_dtype)
                    if cfg1.norm_eps is not None:
                        dx, dnw = _norm_backward(dx, norm_saved, ctx.needs_input_grad[0], ctx.needs_input_grad[4], cfg1,
                                                 ctx.x_shape)
                    dx = None if dx is None else dx.reshape(ctx.x_shape)
                if need_dw1:
                    dw1 = _wgrad(qdu, ctx.qx, ctx.w1_dtype, ctx.w1)
        if ctx.needs_input_grad[3]:
            db2 = dy2.float().sum(0).to(ctx.b2_dtype)
        return dx, dw1, dw2, db2, dnw, None, None


def quantized_swiglu_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor | None,
                         layer1: GemmLayer, layer2: GemmLayer, is_first_microbatch=None, *,
                         state: _ac.AutocastState | None = None, norm_weight: torch.Tensor | None = None,
                         norm_eps: float | None = None, norm_rstd: torch.Tensor | None = None,
                         norm_link=None) -> torch.Tensor:
    """``fc2(silu(a)·b)`` with ``[a | b] = x · w1ᵀ`` (no fc1 bias), all GEMMs quantized per the active 1x128
    blockwise recipe and SwiGLU fused into fc2's input quantizer (see :func:`swiglu_mlp_fusable`, which the caller
    checks first). Same results, bit for bit, as ``quantized_linear(swiglu(quantized_linear(x, w1)), w2, b2)``.

    Args:
        x: (..., K) input; w1: (2F, K) fc1 weight; w2: (N, F) fc2 weight; b2: (N,) or None.
        layer1, layer2: the fc1 / fc2 :class:`GemmLayer`; is_first_microbatch, norm_weight, norm_eps, norm_rstd,
            norm_link: as :func:`quantized_linear` (the RMSNorm fused into fc1's input quantizer).
    """
    st = state or _ac.get_state()
    recipe = st.recipe
    x, norm_weight, norm_eps = _norm_inputs(x, norm_weight, norm_eps, recipe, norm_link)
    norm_rstd, norm_link = _linked_rstd(norm_eps, norm_rstd, norm_link)
    out_dtype = _out_dtype(x)
    _check_dims(layer1, recipe, x, w1)
    cfg1 = _Cfg(layer1, recipe, is_first_microbatch, False, st.on_nonfinite, out_dtype, norm_eps, norm_rstd, norm_link)
    if torch.compiler.is_compiling():
        _no_link_when_compiling(norm_link)
        if not _fp8_gathered(w1, w2):
            return _compiled_swiglu_mlp(x, w1, w2, b2, norm_weight, cfg1, st.key)
    cfg2 = _Cfg(layer2, recipe, is_first_microbatch, False, st.on_nonfinite, out_dtype)
    if torch.compiler.is_compiling():  # (a weight gathered as FP8 copies: eager, behind a graph break)
        return _gathered_fp8_weight_runs_eager(_SwiGLUMLPFn, x, w1, w2, b2, norm_weight, cfg1, cfg2)
    return _SwiGLUMLPFn.apply(x, w1, w2, b2, norm_weight, cfg1, cfg2)


@torch.library.custom_op("lowbit::bias_grad", mutates_args=())
def column_sum_op(dy: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``dy.float().sum(0).to(dtype)``: a bias gradient as eager computes it (torch's reduction order, which a
    compiled graph would otherwise choose itself)."""
    return dy.float().sum(0).to(dtype)


@column_sum_op.register_fake
def _(dy, dtype):
    return dy.new_empty((dy.shape[1],), dtype=dtype)


@torch.library.custom_op("lowbit::quantized_swiglu_mlp", mutates_args=())
def quantized_swiglu_mlp_op(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, b2: Optional[torch.Tensor],
                            norm_weight: Optional[torch.Tensor], norm_rstd: Optional[torch.Tensor], key: str,
                            norm_eps: float, out_dtype: torch.dtype, microbatch: int, need_dx: bool, need_dw1: bool,
                            need_dw2: bool) -> list[torch.Tensor]:
    """The forward of :func:`quantized_swiglu_mlp` on a 2D input x (M, K): ``[y (M, N)]`` followed by what its
    backward reads: x's columnwise copy (``need_dw1``), h's columnwise copy (``need_dw2``), fc1's weight's columnwise
    copy (``need_dx``), fc2's (``need_dx or need_dw1``), fc1's output u (the same) and the RMSNorm's row statistics
    (``norm_weight`` given). Arguments as :func:`quantized_linear_op`; ``need_dx`` covers the norm weight's
    gradient."""
    recipe, policy = _op_state(key, w1, microbatch)
    g1, g2 = layer_of(w1), layer_of(w2)
    mb = _MICROBATCH[microbatch]
    need_du = need_dx or need_dw1
    cfg1 = _Cfg(g1, recipe, mb, False, policy, out_dtype, None if norm_weight is None else norm_eps, norm_rstd)
    y, u, qx, qh, qw1, qw2, norm_saved = _swiglu_mlp_forward(cfg1, g2, x, w1, w2, b2, norm_weight, need_dx, need_dw1,
                                                             need_dw2)
    out = [y]
    if need_dw1:
        out += copy_tensors(qx, "columnwise")
    if need_dw2:
        out += copy_tensors(qh, "columnwise")
    if need_dx:
        out += copy_tensors(qw1, "columnwise")
    if need_du:
        out += copy_tensors(qw2, "columnwise")
        out.append(u)
    if norm_weight is not None:
        out.append(norm_saved[1])
    return _own(out, (x, w1, w2, b2, norm_weight, norm_rstd))


@quantized_swiglu_mlp_op.register_fake
def _(x, w1, w2, b2, norm_weight, norm_rstd, key, norm_eps, out_dtype, microbatch, need_dx, need_dw1, need_dw2):
    recipe, _ = _ac.from_key(key)
    (M, K), (F2, N) = x.shape, (w1.shape[0], w2.shape[0])
    sin, sw = recipe.role("input").scheme, recipe.role("weight").scheme
    out = [x.new_empty((M, N), dtype=out_dtype)]
    if need_dw1:
        out += empty_copy_tensors(sin, (M, K), "columnwise", x.device)
    if need_dw2:
        out += empty_copy_tensors(sin, (M, F2 // 2), "columnwise", x.device)
    if need_dx:
        out += empty_copy_tensors(sw, (F2, K), "columnwise", x.device)
    if need_dx or need_dw1:
        out += empty_copy_tensors(sw, (N, F2 // 2), "columnwise", x.device)
        out.append(x.new_empty((M, F2), dtype=out_dtype))
    if norm_weight is not None:
        out.append(x.new_empty((M,), dtype=torch.float32))
    return out


@torch.library.custom_op("lowbit::quantized_swiglu_mlp_backward", mutates_args=())
def quantized_swiglu_mlp_backward_op(dy: torch.Tensor, x: Optional[torch.Tensor], w1: torch.Tensor,
                                     w2: torch.Tensor, norm_weight: Optional[torch.Tensor],
                                     saved: list[torch.Tensor], key: str, norm_eps: float, x_dtype: torch.dtype,
                                     need_dx: bool, need_dw1: bool, need_dw2: bool,
                                     need_dnw: bool) -> list[torch.Tensor]:
    """The backward of :func:`quantized_swiglu_mlp_op` for dy (M, N) and its ``saved`` outputs: ``[dx]`` if
    ``need_dx``, ``[dw1]``, ``[dw2]``, ``[d norm_weight]`` where asked (x: the 2D input, given where the RMSNorm
    is fused). The forward's ``need_dx`` is ``need_dx or need_dnw`` here."""
    from ..ops.swiglu import swiglu_backward, swiglu_backward_fused_quant_supported, swiglu_backward_quantize_1x128

    recipe, policy = _op_state(key, w1)
    g1, g2 = layer_of(w1), layer_of(w2)
    (M, N), K, F2 = dy.shape, w1.shape[1], w1.shape[0]
    need_in = need_dx or need_dnw  # (the forward's need_dx)
    need_du = need_in or need_dw1
    cfg1 = _Cfg(g1, recipe, None, False, policy, x_dtype, None if norm_weight is None else norm_eps)
    sin, sw = recipe.role("input").scheme, recipe.role("weight").scheme
    parts, i = {}, 0
    for name, on, sch, shape, dt in (("qx", need_dw1, sin, (M, K), x_dtype),
                                     ("qh", need_dw2, sin, (M, F2 // 2), dy.dtype),
                                     ("qw1", need_in, sw, (F2, K), w1.dtype),
                                     ("qw2", need_du, sw, (N, F2 // 2), w2.dtype)):
        if on:
            n = n_copy_tensors(sch)
            parts[name] = copy_from_tensors(saved[i:i + n], sch, shape, dt, "columnwise")
            i += n
    u = None
    if need_du:
        u, i = saved[i], i + 1
    rstd = saved[i] if norm_weight is not None else None
    dx = dw1 = dw2 = dnw = None
    qdy = g2.quantize(dy, "grad_output", recipe, rowwise=need_du, columnwise=need_dw2, phase="backward",
                      policy=policy)
    if need_du:
        dh = scaled_mm(qdy, parts["qw2"], a_copy="rowwise", b_copy="columnwise", out_dtype=u.dtype)
    if need_dw2:
        dw2 = wgrad_mm(qdy, parts["qh"], out_dtype=w2.dtype)
    if need_du:
        sch1 = recipe.role("grad_output").scheme
        if need_in and need_dw1 and _fused_swiglu_bwd() and swiglu_backward_fused_quant_supported(u, dh, sch1):
            qdu = swiglu_backward_quantize_1x128(u, dh, sch1)
            _ac.sentry([c.amax for c in qdu._copies()], layer=g1, role="grad_output", phase="backward",
                       policy=policy)
        else:
            du = swiglu_backward(u, dh)
            qdu = g1.quantize(du, "grad_output", recipe, rowwise=need_in, columnwise=need_dw1, phase="backward",
                              policy=policy)
            del du
        del dh
        if need_in:
            dx = scaled_mm(qdu, parts["qw1"], a_copy="rowwise", b_copy="columnwise", out_dtype=x_dtype)
            if norm_weight is not None:
                dx, dnw = _norm_backward(dx, (x, rstd, norm_weight), need_dx, need_dnw, cfg1, x.shape)
        if need_dw1:
            dw1 = wgrad_mm(qdu, parts["qx"], out_dtype=w1.dtype)
    out = [t for t, on in ((dx, need_dx), (dw1, need_dw1), (dw2, need_dw2), (dnw, need_dnw)) if on]
    return _own(out, (dy, x, w1, w2, norm_weight, *saved))


@quantized_swiglu_mlp_backward_op.register_fake
def _(dy, x, w1, w2, norm_weight, saved, key, norm_eps, x_dtype, need_dx, need_dw1, need_dw2, need_dnw):
    M, K = dy.shape[0], w1.shape[1]
    out = []
    if need_dx:
        out.append(dy.new_empty((M, K), dtype=x_dtype))
    if need_dw1:
        out.append(torch.empty_like(w1, memory_format=torch.contiguous_format))
    if need_dw2:
        out.append(torch.empty_like(w2, memory_format=torch.contiguous_format))
    if need_dnw:
        out.append(torch.empty_like(norm_weight, memory_format=torch.contiguous_format))
    return out


def _mlp_setup(ctx, inputs, output):
    x, w1, w2, b2, norm_weight, _, key, norm_eps, _, _, need_dx, need_dw1, need_dw2 = inputs
    ctx.mark_non_differentiable(*output[1:])
    ctx.save_for_backward(x if norm_weight is not None else None, w1, w2, b2, norm_weight, *output[1:])
    ctx.key, ctx.norm_eps, ctx.x_dtype = key, norm_eps, x.dtype
    ctx.fwd_need = (need_dx, need_dw1, need_dw2)


def _mlp_backward(ctx, grads):
    x, w1, w2, b2, norm_weight, *saved = ctx.saved_tensors
    dy = grads[0]
    fx, f1, f2 = ctx.fwd_need
    need_dx, need_dw1, need_dw2 = (ctx.needs_input_grad[0] and fx, ctx.needs_input_grad[1] and f1,
                                   ctx.needs_input_grad[2] and f2)
    need_dnw = norm_weight is not None and ctx.needs_input_grad[4] and fx
    dx = dw1 = dw2 = db2 = dnw = None
    if need_dx or need_dw1 or need_dw2 or need_dnw:
        res = list(quantized_swiglu_mlp_backward_op(dy, x, w1, w2, norm_weight, saved, ctx.key, ctx.norm_eps,
                                                    ctx.x_dtype, need_dx, need_dw1, need_dw2, need_dnw))
        dx = res.pop(0) if need_dx else None
        dw1 = res.pop(0) if need_dw1 else None
        dw2 = res.pop(0) if need_dw2 else None
        dnw = res.pop(0) if need_dnw else None
    if ctx.needs_input_grad[3]:
        db2 = column_sum_op(dy, b2.dtype)
    return dx, dw1, dw2, db2, dnw, None, None, None, None, None, None, None, None


quantized_swiglu_mlp_op.register_autograd(_mlp_backward, setup_context=_mlp_setup)


def _compiled_swiglu_mlp(x, w1, w2, b2, norm_weight, cfg1: _Cfg, key: str) -> torch.Tensor:
    """:func:`quantized_swiglu_mlp` through :func:`quantized_swiglu_mlp_op` (inside torch.compile)."""
    K = x.shape[-1]
    grad = torch.is_grad_enabled()
    need_dx = grad and (x.requires_grad or (norm_weight is not None and norm_weight.requires_grad))
    mb = _microbatch_code(cfg1.is_first_microbatch)
    outs = quantized_swiglu_mlp_op(x.reshape(-1, K), w1, w2, b2, norm_weight, cfg1.norm_rstd, key,
                                   0.0 if cfg1.norm_eps is None else cfg1.norm_eps, cfg1.out_dtype, mb, need_dx,
                                   grad and w1.requires_grad, grad and w2.requires_grad)
    y = outs[0]
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _fused_rope_bwd() -> bool:
    """RoPE's backward fused into the QKV projection's grad_output quantizer where it can run
    (:func:`rope_grad_sink`); ``LOWBIT_UNFUSE=rope_bwd_quant`` turns it off."""
    return env.fused("rope_bwd_quant")


def rope_grad_sink(module):
    """A ``grad_sink`` for :func:`lowbit.ops.rope.rope_qkv` applied to the output of ``module`` (a lowbit
    ``Linear`` / ``LayerNormLinear`` without bias, called in this forward under a lowbit recipe with 1x128
    Float8Blockwise current-scaling gradients), or None where that does not apply.

    In the backward, the sink runs RoPE's backward inside the module's grad_output quantizer
    (:func:`lowbit.ops.rope.rope_backward_quantize_1x128`: the 16-bit dqkv is never written), hands the quantized
    gradient to the module's GEMM layer and returns the stand-in autograd delivers in its place
    (:meth:`GemmLayer.offer_grad_output`); where the kernel cannot take the gradients (shapes, dtypes, device) it
    returns None and the backward runs unfused. Call it in the forward, where the recipe is known. None inside
    torch.compile: the hand-off cannot cross between operators (``lowbit::rope_qkv_backward`` computes dqkv, and the
    projection quantizes it: the same bits)."""
    if not _fused_rope_bwd() or not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return None
    st = _ac.get_state()
    if not st.enabled or st.recipe is None:
        return None
    rq = st.recipe.role("grad_output")
    sch = rq.scheme
    if rq.delayed or not (isinstance(sch, Float8Blockwise) and sch.block_dim == 1 and sch.block_size == 128):
        return None
    gemms = getattr(module, "_gemms", None)
    if getattr(module, "bias", None) is not None or not gemms or list(gemms) != [""]:
        return None
    layer = gemms[""]

    def sink(gq, gk, gv, cos, sin):
        from ..ops.rope import rope_backward_fused_quant_supported, rope_backward_quantize_1x128

        if not rope_backward_fused_quant_supported(gq, gk, gv, cos, sin, sch):
            return None
        qt = rope_backward_quantize_1x128(gq, gk, gv, cos, sin, sch)
        stand_in = torch.empty(1, dtype=gq.dtype, device=gq.device)
        layer.offer_grad_output(qt, stand_in=stand_in)
        return stand_in

    return sink
