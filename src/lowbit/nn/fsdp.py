"""FP8 weight all-gather under FSDP2: ``fully_shard`` gathers the quantized copies of lowbit layers' weights instead
of their high-precision shards.

:func:`fp8_all_gather` (called before ``fully_shard``) makes each lowbit weight a :class:`Float8AllGatherWeight`, a
tensor subclass holding the high-precision shard and implementing FSDP2's all-gather extension
(``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``). Each rank quantizes its own shard; the gathered
:class:`GatheredFloat8Weight` holds the whole weight's rowwise copy, which the lowbit layers take instead of quantizing
the weight (:meth:`lowbit.nn.functional.GemmLayer.quantized_weight`); the columnwise copy for dgrad is the same
copy transposed (:func:`lowbit.quant.tensor.columnwise_from_rowwise`). Bit-identical to quantizing the unsharded
weight:

* ``Float8CurrentScaling`` (per-tensor, E4M3 weights): the shards' amaxes are all-reduced (MAX) across the shard
  group in the pre-all-gather hook, so every rank scales by ``fmax / amax`` of the whole weight; the data is gathered
  in FP8, the scale travels as metadata (it is the same on every rank). One all-reduce serves every per-tensor weight
  of a ``fully_shard`` unit: the first of the unit's hooks that FSDP2 calls for a gather reduces all of the unit's
  shard amaxes at once, and the unit's other hooks of that gather take theirs (:class:`AmaxBatches`).
* ``DelayedScaling`` (per-tensor): every rank casts its shard with its layer's delayed weight scale (the same on
  every rank: the weight amaxes each history records are the all-reduced whole-weight ones, gathered as above, and
  the layers' histories start equal), and the forward records the whole weight's amax in the history, as the
  unsharded forward does; during the recipe's warm-up the scale is the current one, as above.
* ``Float8BlockScaling`` with 128x128 weight tiles (``w_block_scaling_dim=2``): FSDP2 shards dim 0, so where every
  rank's shard is a whole number of 128-row tiles (out_features divisible by 128 x the shard count) each tile lies
  in one shard and needs no reduction; the FP8 data, the FP32 tile scales and each shard's amax are gathered. Where
  :class:`lowbit.optim.AdamW` updates the shard, its kernel also writes the shard's copies (``lowbit_fresh``), and the
  gather takes those as long as they hold the shard's values (the same bits: the same tiles quantized alike), so
  nothing quantizes the shard before it is gathered.

Everything else gathers in high precision, as FSDP2 does without this module, and says so once (a warning and
:func:`lowbit.runtime.log.declined`): a 128x128 weight whose shards are not whole tiles, 1x128 weight blocks (their
columnwise copy is not the rowwise one transposed), MXFP8, NVFP4, BF16, weights shared by two
modules. Gradients reduce-scatter in high precision, as FSDP2 does. The gathered weight holds no high-precision
values: only a lowbit layer under ``lowbit.autocast`` with the same recipe can use it (anything else raises).
Under torch.compile a layer holding such a weight runs eager (the subclass holds no values for Dynamo to trace):
the graph breaks at the layer's call, once per layer, and lowbit's log says why (:func:`lowbit.runtime.log.declined`).

BF16 training (no lowbit recipe, the forward under ``torch.autocast(dtype=torch.bfloat16)``): :func:`bf16_all_gather`
makes the lowbit layers' FP32 weights :class:`BF16AllGatherWeight`, whose gather moves each shard's BF16 cast; the
gathered :class:`GatheredBF16Weight` (FP32 dtype, BF16 values) gives autocast's cast those values, bit-identical to
casting the whole weight, and its gradient reaches FSDP2 in FP32. FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)``
would cast the FP32 norm weights the fused norms read as well.
"""

from __future__ import annotations

import copy
import math
import weakref

import torch
from torch.utils import _pytree as pytree

from .. import distributed
from ..quant import quantize
from ..quant.reference import amax_of, compute_scale, delayed_scale_inv
from ..quant.schemes import Float8Blockwise, Float8Tensorwise
from ..quant.tensor import QuantizedCopy, QuantizedTensor, scale_storage_shape
from ..recipes import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Recipe
from ..runtime.device import is_dtensor
from ..runtime.log import declined, warn_once
from . import state as _ac
from .base import LowbitModule

__all__ = ["fp8_all_gather", "fp8_gather_plan", "all_gather_bytes", "Float8AllGatherWeight", "GatheredFloat8Weight",
           "AmaxBatches", "bf16_all_gather", "BF16AllGatherWeight", "GatheredBF16Weight"]

_aten = torch.ops.aten
_PATH = "fp8_all_gather"
def _say_fallback(reason: str) -> None:
    declined(_PATH, reason)
    warn_once(f"lowbit fp8_all_gather: gathering in high precision: {reason}", stacklevel=4)


def recipe_weight_scheme(recipe: Recipe):
    """``(scheme, None)``: the weight scheme ``recipe`` gathers in FP8, or ``(None, reason)``."""
    if isinstance(recipe, (Float8CurrentScaling, DelayedScaling)):
        return recipe.role("weight").scheme, None
    if isinstance(recipe, Float8BlockScaling):
        sch = recipe.role("weight").scheme
        if sch.block_dim == 2:
            return sch, None
        return None, ("fp8-block with 1x128 weight blocks (w_block_scaling_dim=1): their columnwise copy is not the "
                      "rowwise one transposed")
    return None, (f"recipe {type(recipe).__name__}: FP8 all-gather covers Float8CurrentScaling and DelayedScaling "
                  "(per-tensor) and Float8BlockScaling with 128x128 weight tiles")


def fp8_gather_plan(scheme, shape, world: int) -> str | None:
    """None where a weight of ``shape`` sharded over ``world`` ranks on dim 0 (FSDP2's ``torch.chunk``) gathers its
    ``scheme`` copies bit-identically to quantizing it whole; else why it gathers in high precision."""
    if len(shape) != 2:
        return f"a {len(shape)}-D weight {tuple(shape)} (FP8 all-gather takes 2-D weights)"
    if isinstance(scheme, Float8Tensorwise):
        return None
    if isinstance(scheme, Float8Blockwise) and scheme.block_dim == 2:
        n, bs = shape[0], scheme.block_size
        if n % world or (n // world) % bs:
            return (f"weight {tuple(shape)} over {world} shards: each shard must be a whole number of {bs}-row tiles "
                    f"(out_features divisible by {bs} x {world})")
        return None
    return f"scheme {scheme!r}"


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    out = t.new_zeros((rows, *t.shape[1:]))
    out[: t.shape[0]].copy_(t)
    return out


def _in_param_dtype(hp: torch.Tensor, mp_policy) -> torch.Tensor:
    """``hp`` in ``mp_policy.param_dtype`` (FSDP2's ``MixedPrecisionPolicy``), the dtype the gather quantizes from."""
    pd = getattr(mp_policy, "param_dtype", None)
    return hp.to(pd) if pd is not None and pd != hp.dtype else hp


class AmaxBatches:
    """The per-tensor (``Float8CurrentScaling``) weights of one :func:`fp8_all_gather` call, grouped by the
    ``fully_shard`` unit that gathers them: one all-reduce (MAX) gives every weight of a unit its whole-weight amax.

    FSDP2 gathers all parameters of a unit together, calling each one's ``fsdp_pre_all_gather`` in turn. The first
    call of a gather finds no amax waiting for its weight: it takes the shard amax of every weight of its unit (each
    in the unit's ``param_dtype``, as that weight's own hook would), all-reduces them in one collective
    (:func:`lowbit.distributed.reduce_amax`) and leaves the others waiting; each later call of the gather takes its
    own. Every rank makes the same calls in the same order, so the collectives match, and MAX is exact: the amaxes
    are the ones a reduction per weight gives. A waiting amax is taken only while its parameter is unchanged (its
    version counter), and the next reduction drops whatever still waits, so no amax outlives its weights.

    The units are found at the first gather, from the module tree: a weight belongs to the nearest module (its own or
    an ancestor) that ``fully_shard`` was applied to, FSDP2's own grouping where each ``fully_shard`` call takes one
    module (``fully_shard([m1, m2])`` is reduced once per module: still exact). Only sharded weights (DTensor
    parameters) take part.
    """

    def __init__(self, root: torch.nn.Module):
        self._root = weakref.ref(root)
        self._names: list[tuple[str, str]] = []  # (module name under root, weight attribute) of each member
        self._units: dict | None = None  # (id(module), attr) -> [(module weakref, attr)] of its unit, in tree order
        self._waiting: dict = {}  # (id(module), attr) -> (all-reduced amax, param dtype, parameter version)

    def add(self, module_name: str, attr: str) -> None:
        """Count ``root.<module_name>.<attr>`` in (before the first gather)."""
        self._names.append((module_name, attr))
        self._units = None

    def _resolve(self) -> dict:
        from torch.distributed.fsdp import FSDPModule

        root, by_unit, units = self._root(), {}, {}
        if root is None:
            return units
        for mname, attr in self._names:
            parts = mname.split(".") if mname else []
            chain = [root.get_submodule(".".join(parts[:i])) for i in range(len(parts) + 1)]  # root ... the module
            unit = next((m for m in reversed(chain) if isinstance(m, FSDPModule)), chain[-1])  # nearest fully_shard
            members = by_unit.setdefault(id(unit), [])
            members.append((weakref.ref(chain[-1]), attr))
            units[(id(chain[-1]), attr)] = members
        return units

    def amax(self, module: torch.nn.Module, attr: str, hp: torch.Tensor, mp_policy, group) -> torch.Tensor:
        """The whole weight's amax for ``hp``, this rank's shard of ``module.<attr>`` in the param dtype: the one
        waiting from this gather's first call, or (the first call) all-reduced now with the rest of its unit's."""
        key = (id(module), attr)
        version = getattr(getattr(module, attr, None), "_version", None)
        got = self._waiting.pop(key, None)
        if got is not None and got[1] == hp.dtype and got[2] == version:
            return got[0]
        if self._units is None:
            self._units = self._resolve()
        keys, amaxes, waiting = [key], [amax_of(hp)], []
        for ref, a in self._units.get(key, ()):
            m = ref()
            p = getattr(m, a, None) if m is not None else None
            if (id(m), a) == key or not is_dtensor(p):
                continue
            with torch.no_grad():
                shard = p.to_local()
            shard = _in_param_dtype(_plain(shard), mp_policy)
            keys.append((id(m), a))
            amaxes.append(amax_of(shard))
            waiting.append((shard.dtype, p._version))
        distributed.reduce_amax(amaxes, group=group)  # MAX over the shards: each whole weight's amax
        self._waiting = {k: (amax, dt, v) for k, amax, (dt, v) in zip(keys[1:], amaxes[1:], waiting)}
        return amaxes[0]


class _ShardWrapper(torch.Tensor):
    """A weight (or FSDP2's shard of it) whose FSDP2 all-gather moves a low-precision form of it: a wrapper with no
    storage of its own around the high-precision tensor ``lowbit_hp``, which every op other than the gather runs on.
    Saved (``torch.save``, ``torch.distributed.checkpoint``) as that plain tensor: a loaded state dict needs only the
    values. Deep-copied as :meth:`_rewrap` of a copy of it (torch's own deep copy reaches for the missing storage)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, hp: torch.Tensor, *args, **kwargs):
        return torch.Tensor._make_wrapper_subclass(cls, hp.size(), strides=hp.stride(),
                                                   storage_offset=hp.storage_offset(), dtype=hp.dtype,
                                                   layout=hp.layout, device=hp.device, requires_grad=hp.requires_grad)

    def data_ptr(self) -> int:
        return self.lowbit_hp.data_ptr()

    def _rewrap(self, hp: torch.Tensor) -> "_ShardWrapper":
        """A wrapper of ``hp`` like this one, for a copied model."""
        raise NotImplementedError

    def __reduce_ex__(self, protocol):
        return self.lowbit_hp.__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        new = self._rewrap(copy.deepcopy(self.lowbit_hp, memo))
        new.requires_grad_(self.requires_grad)
        if getattr(self, "_is_param", False):  # (a module's parameter: the mark that makes the copy one too)
            new._is_param = True
        memo[id(self)] = new
        return new


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t``'s high-precision tensor where it is a :class:`_ShardWrapper`."""
    return t.lowbit_hp if isinstance(t, _ShardWrapper) else t


_SHAPE_ONLY = {_aten.empty_like.default, _aten.zeros_like.default, _aten.new_zeros.default, _aten.new_empty.default}
"""Ops a gathered weight answers from its shape alone (FSDP2's zero gradients)."""


def _self_alias(func, me: torch.Tensor, args) -> bool:
    """Whether ``func(*args)`` is ``me`` again (a detach, an alias, or a view / as_strided of its own shape): a gathered
    weight answers those with itself over the same values."""
    return func in (_aten.detach.default, _aten.alias.default) or (
        func in (_aten.as_strided.default, _aten.view.default) and tuple(args[1]) == tuple(me.shape))


def _on_stand_in(func, me: torch.Tensor, args, kwargs):
    """``func`` (one of :data:`_SHAPE_ONLY`) on an empty tensor of ``me``'s shape, dtype and device."""
    return func(torch.empty(me.shape, dtype=me.dtype, device=me.device), *args[1:], **kwargs)


# ops whose outputs stay weights FSDP2 may gather (it pads, views, chunks and copies its shards with them)
_KEEP = {_aten.empty_like.default, _aten.new_zeros.default, _aten.new_empty.default, _aten.slice.Tensor,
         _aten.copy_.default, _aten.view.default, _aten.as_strided.default, _aten._to_copy.default,
         _aten.split.Tensor, _aten.clone.default, _aten.narrow.default, _aten.alias.default}
# those whose outputs hold the same values as their first weight argument (views of it, or it written in place): they
# share its optimizer-written copies (lowbit_fresh); the others' outputs are new tensors and start without
_SAME_VALUES = {_aten.slice.Tensor, _aten.copy_.default, _aten.view.default, _aten.as_strided.default,
                _aten.split.Tensor, _aten.narrow.default, _aten.alias.default}


class Float8AllGatherWeight(_ShardWrapper):
    """A lowbit layer's high-precision weight (or FSDP2's shard of it) whose FSDP2 all-gather moves its quantized
    copies (:func:`fp8_all_gather`). Every op other than FSDP2's all-gather runs on the high-precision tensor
    (``lowbit_hp``) as on a plain tensor; views, copies and chunks stay this type.

    Attributes:
        lowbit_hp: the high-precision tensor.
        lowbit_scheme: the weight scheme gathered (Float8Tensorwise, or Float8Blockwise with 128x128 tiles).
        lowbit_batch: ``(AmaxBatches, attribute name)``: the :class:`AmaxBatches` that reduces this per-tensor
            weight's amax with the rest of its ``fully_shard`` unit's, and the weight's attribute on its module; or
            None (one all-reduce of its own).
        lowbit_delayed: under ``DelayedScaling``, the weight's attribute on its module (whose
            :class:`~lowbit.nn.functional.GemmLayer` holds the scale every rank casts its shard with); else None.
        lowbit_fresh: ``[FreshWeight or None, valid]``: the copies :class:`lowbit.optim.AdamW` writes for this
            (sharded) weight (:class:`~lowbit.nn.functional.FreshWeight`) and whether they hold its values. Shared by
            the weight's views (``DTensor.to_local`` may return one), so the optimizer and FSDP2's gather see the same.
            The optimizer sets ``valid`` after writing them; any in-place write through torch (a checkpoint load,
            another optimizer) clears it. (Versions cannot tell: a view made below autograd counts its own.)
    """

    def __init__(self, hp: torch.Tensor, scheme, batch: tuple | None = None, delayed: str | None = None,
                 fresh: list | None = None):
        self.lowbit_hp = hp
        self.lowbit_scheme = scheme
        self.lowbit_batch = batch
        self.lowbit_delayed = delayed
        self.lowbit_fresh = fresh if fresh is not None else [None, False]

    def lowbit_optimizer_copies(self, scheme):
        """The :class:`~lowbit.nn.functional.FreshWeight` ``lowbit_fresh`` holds where it is valid for this weight's
        values (written for this storage, under ``scheme``), else None."""
        f, valid = self.lowbit_fresh
        return f if valid and f is not None and f.ptr == self.lowbit_hp.data_ptr() and f.scheme == scheme else None

    def __repr__(self):
        return f"Float8AllGatherWeight({self.lowbit_scheme}, {self.lowbit_hp!r})"

    def _rewrap(self, hp: torch.Tensor) -> "Float8AllGatherWeight":
        # (a copied model is another tree: its weights reduce their amaxes one by one, and start without copies)
        return type(self)(hp, self.lowbit_scheme, None, self.lowbit_delayed)

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        if func is _aten.detach.default:
            me = args[0]
            return cls(me.lowbit_hp.detach(), me.lowbit_scheme, me.lowbit_batch, me.lowbit_delayed, me.lowbit_fresh)
        src = next(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, cls))
        if func._schema.is_mutable:  # (an in-place or out= op: the copies of a weight it writes no longer hold)
            for a, arg in zip(args, func._schema.arguments):
                if isinstance(a, cls) and arg.alias_info is not None and arg.alias_info.is_write:
                    a.lowbit_fresh[1] = False
        args, kwargs = pytree.tree_map_only(cls, _plain, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP:
            return out
        fresh = src.lowbit_fresh if func in _SAME_VALUES else None
        return pytree.tree_map_only(
            torch.Tensor, lambda t: cls(t, src.lowbit_scheme, src.lowbit_batch, src.lowbit_delayed, fresh), out)

    def __tensor_flatten__(self):
        return ["lowbit_hp"], (self.lowbit_scheme, self.lowbit_delayed)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return Float8AllGatherWeight(inner["lowbit_hp"], ctx[0], None, ctx[1])

    # -- FSDP2's all-gather extension -------------------------------------------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """This rank's all-gather inputs: its shard's FP8 data (uint8 bytes, padded to FSDP2's shard rows) and, for
        128x128 tiles, its tile scales and amax; or the high-precision shard where :func:`fp8_gather_plan` says."""
        hp = _in_param_dtype(self.lowbit_hp, mp_policy)
        n, world = outer_size[0], mesh.size()
        rows = -(-n // world)  # FSDP2's padded shard rows
        sch = self.lowbit_scheme
        why = fp8_gather_plan(sch, tuple(outer_size), world)
        if why is not None:
            _say_fallback(why)
            return (_pad_rows(hp, rows),), ("hp", n)
        if isinstance(sch, Float8Tensorwise):
            if self.lowbit_batch is not None:  # one all-reduce for the whole fully_shard unit
                batches, attr = self.lowbit_batch
                amax = batches.amax(module, attr, hp, mp_policy, mesh.get_group())
            else:
                amax = amax_of(hp)
                distributed.reduce_amax([amax], group=mesh.get_group())  # MAX over the shards: the weight's amax
            scale = self._delayed_scale(module, hp.device)
            if scale is None:  # current scaling (or a delayed recipe's warm-up): fmax / the whole weight's amax
                scale = compute_scale(amax, sch.format.max)
                scale_inv = (1.0 / scale).reshape(1)
            else:
                scale_inv = delayed_scale_inv(scale, amax)
            if hp.numel():
                data = quantize(hp, sch, rowwise=True, scale=scale).rowwise.data.view(torch.uint8)
            else:
                data = torch.zeros(hp.shape, dtype=torch.uint8, device=hp.device)
            return (_pad_rows(data, rows),), ("tensorwise", n, scale_inv, amax)
        f = self.lowbit_optimizer_copies(sch) if hp is self.lowbit_hp else None
        # (the optimizer's copies of this shard are what quantizing it gives)
        c = f.q.rowwise if f is not None else quantize(hp, sch, rowwise=True).rowwise
        return (c.data.view(torch.uint8), c.scale_inv, c.amax.reshape(1)), ("tiles", n)

    def _delayed_scale(self, module, device) -> torch.Tensor | None:
        """The delayed scale of this weight's layer (what the unsharded forward casts it with), or None: current
        scaling (not a delayed recipe, its warm-up, or a gather outside autocast before any forward)."""
        if self.lowbit_delayed is None:
            return None
        layer = module.gemm_layer(self.lowbit_delayed) if isinstance(module, LowbitModule) else None
        if layer is None:
            raise ValueError(f"module: FSDP2 gathers the delayed-scaling weight {self.lowbit_delayed!r} for "
                             f"{type(module).__name__}, which is not the lowbit module fp8_all_gather wrapped it for")
        st = _ac.get_state()
        if st.enabled:  # (another recipe: the forward refuses the copies, see GemmLayer._gathered_weight)
            return layer.delayed_state(st.recipe, device).scale("weight", device) if isinstance(
                st.recipe, DelayedScaling) else None
        # (a gather outside autocast: FSDP2's backward re-gather, whose copies the backward does not read)
        return None if layer.delayed is None else layer.delayed.scale("weight", device)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The whole weight from the gathered inputs: a :class:`GatheredFloat8Weight` holding its rowwise copy, or
        the high-precision weight."""
        kind, n = metadata[0], metadata[1]
        if kind == "hp":
            if out is not None:  # (FSDP2 gathers into the same buffer every time: the view already holds it)
                return None
            t = all_gather_outputs[0]
            return (t if t.shape[0] == n else t[:n]), ()
        sch = self.lowbit_scheme
        data = all_gather_outputs[0].view(sch.format.torch_dtype)[:n]
        if kind == "tensorwise":
            scale_inv, amax = metadata[2], metadata[3]
        else:
            scale_inv, amax = all_gather_outputs[1], all_gather_outputs[2].max().reshape(1)
        q = QuantizedTensor(torch.Size(data.shape), param_dtype, sch,
                            rowwise=QuantizedCopy(data=data, scale_inv=scale_inv, amax=amax))
        q.meta["delayed"] = self.lowbit_delayed is not None  # (gathered for a DelayedScaling forward)
        if out is not None:
            out.lowbit_box[0] = q
            return None
        # (the data are views of FSDP2's all-gather buffers, which FSDP2 frees and reallocates itself)
        return GatheredFloat8Weight([q]), ()


class GatheredFloat8Weight(torch.Tensor):
    """The unsharded weight FSDP2 all-gathered as quantized copies (:func:`fp8_all_gather`): a tensor of the weight's
    shape and dtype holding no high-precision values. ``lowbit_gathered`` is the :class:`QuantizedTensor` (rowwise
    copy) a lowbit layer multiplies by; other ops (``F.linear`` outside autocast, reading the values) raise."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    lowbit_fp8_gathered = True
    """Marks the class for lowbit's layers (which do not import this module): a compiled layer refuses it."""

    @staticmethod
    def __new__(cls, box: list):
        q = box[0]
        return torch.Tensor._make_wrapper_subclass(cls, q.shape, dtype=q.dtype, device=q.device, requires_grad=False)

    def __init__(self, box: list):
        self.lowbit_box = box  # one-element list shared by every alias FSDP2 makes (as_strided, the Parameter)

    @property
    def lowbit_gathered(self) -> QuantizedTensor:
        return self.lowbit_box[0]

    def __repr__(self):
        return f"GatheredFloat8Weight({self.lowbit_box[0]!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        kwargs = kwargs or {}
        me = args[0]
        if _self_alias(func, me, args):
            return cls(me.lowbit_box)
        if func in _SHAPE_ONLY:
            return _on_stand_in(func, me, args, kwargs)
        raise NotImplementedError(
            f"{func}: this weight was all-gathered by FSDP2 as its {me.lowbit_box[0].scheme} FP8 copies "
            "(lowbit.nn.fp8_all_gather) and holds no high-precision values; only a lowbit layer under "
            "lowbit.autocast with the recipe given to fp8_all_gather can use it"
        )


def fp8_all_gather(model: torch.nn.Module, recipe: Recipe, mesh=None) -> dict[str, str | None]:
    """Make FSDP2 all-gather the FP8 copies of ``model``'s lowbit weights (see the module docstring for the
    numerics). Call it before ``fully_shard`` and before building the optimizer: each lowbit weight becomes a new
    ``nn.Parameter`` holding a :class:`Float8AllGatherWeight` (same values, same storage). Run the forward under
    ``lowbit.autocast(recipe=recipe)``.

    Args:
        model: the module tree; only weights of lowbit modules (``lowbit.nn.Linear`` ...) change.
        recipe: ``Float8CurrentScaling``, ``DelayedScaling`` or ``Float8BlockScaling`` with
            ``w_block_scaling_dim=2``; any other recipe changes nothing and says so once (the gather stays high
            precision).
        mesh: the ``DeviceMesh`` (or an int: the shard count) ``fully_shard`` will use, only to say which weights
            gather in high precision (default: the world size where torch.distributed is initialized); the hooks
            decide from the mesh they run on.

    Returns:
        ``{weight name: None (gathered in FP8) or why it gathers in high precision}``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe: expected a lowbit.recipes recipe (Float8CurrentScaling or Float8BlockScaling), "
                        f"got {type(recipe).__name__}")
    if isinstance(mesh, int) and not isinstance(mesh, bool):
        world = mesh
    elif mesh is not None:
        world = mesh.size()
    elif distributed.is_active() or (torch.distributed.is_available() and torch.distributed.is_initialized()):
        world = torch.distributed.get_world_size()
    else:
        world = 1
    if world < 1:
        raise ValueError(f"mesh: the shard count must be >= 1, got {world}")
    scheme, why_not = recipe_weight_scheme(recipe)
    batches = AmaxBatches(model) if isinstance(scheme, Float8Tensorwise) else None
    plan: dict[str, str | None] = {}
    for m, mname, attr, p, name, shared in _gemm_weights(model, "fp8_all_gather"):
        if isinstance(p, Float8AllGatherWeight):
            if p.lowbit_scheme != scheme or (p.lowbit_delayed is None) != (not isinstance(recipe, DelayedScaling)):
                raise ValueError(f"recipe: {name} gathers {p.lowbit_scheme} copies already (an earlier "
                                 f"fp8_all_gather), not {recipe}'s")
            plan[name] = None
            continue
        why = why_not
        if why is None and shared:
            why = f"{name} is shared by several modules (tied weights)"
        if why is None and p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            why = f"{name} is {p.dtype}"
        if why is None and p.dim() != 2:
            why = fp8_gather_plan(scheme, tuple(p.shape), world)
        if why is None:  # (whether the shards are whole tiles, the hooks decide by the mesh they run on)
            batch = None
            if batches is not None:
                batches.add(mname, attr)
                batch = (batches, attr)
            delayed = attr if isinstance(recipe, DelayedScaling) else None
            setattr(m, attr, torch.nn.Parameter(Float8AllGatherWeight(p.detach(), scheme, batch, delayed),
                                                requires_grad=p.requires_grad))
            why = fp8_gather_plan(scheme, tuple(p.shape), world)
        plan[name] = why
        if why is not None:
            _say_fallback(why)
    return plan


def _gemm_weights(model: torch.nn.Module, caller: str):
    """``(module, module name, attribute, parameter, full name, shared)`` for each GEMM weight of ``model``'s lowbit
    modules (``shared``: a tied weight, used by more than one module), the walk :func:`fp8_all_gather` and
    :func:`bf16_all_gather` make; a weight FSDP2 sharded already raises, naming ``caller``."""
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    for mname, m in model.named_modules():
        if not isinstance(m, LowbitModule):
            continue
        for suffix in getattr(m, "_gemms", {}):
            attr = f"{suffix}_weight" if suffix else "weight"
            p = getattr(m, attr, None)
            if not isinstance(p, torch.nn.Parameter):
                continue
            name = f"{mname}.{attr}" if mname else attr
            if is_dtensor(p):
                raise ValueError(f"model: {name} is sharded already; call {caller} before fully_shard")
            yield m, mname, attr, p, name, uses.get(id(p), 0) > 1


def all_gather_bytes(shape, recipe: Recipe | None, world: int) -> int:
    """Bytes one FSDP2 all-gather of a weight of ``shape`` over ``world`` ranks writes into its output (every rank's
    input, padded shards included): with ``recipe`` (what :func:`fp8_all_gather` gathers: FP8 data, plus the 128x128
    tile scales and one amax a shard, or the high-precision fallback in FP32), or None: the BF16 gather of the same
    weight."""
    n, k = shape
    rows = -(-n // world)
    if recipe is None:
        return world * rows * k * 2
    scheme, why = recipe_weight_scheme(recipe)
    if why is not None or fp8_gather_plan(scheme, tuple(shape), world) is not None:
        return world * rows * k * 4
    if isinstance(scheme, Float8Tensorwise):
        return world * rows * k
    return world * (rows * k + math.prod(scale_storage_shape(scheme, rows, k)) * 4 + 4)  # (the tile grid as stored)


# -- BF16 weight all-gather (torch.autocast BF16, no lowbit recipe) -------------------------------------------------


class BF16AllGatherWeight(_ShardWrapper):
    """A lowbit layer's FP32 weight (or FSDP2's shard of it) whose FSDP2 all-gather moves its BF16 cast
    (:func:`bf16_all_gather`). Every op other than FSDP2's all-gather runs on the FP32 tensor (``lowbit_hp``) as on a
    plain tensor (the optimizer updates it); views, copies and chunks stay this type."""

    def __init__(self, hp: torch.Tensor):
        self.lowbit_hp = hp

    def __repr__(self):
        return f"BF16AllGatherWeight({self.lowbit_hp!r})"

    def _rewrap(self, hp: torch.Tensor) -> "BF16AllGatherWeight":
        return type(self)(hp)

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        if func is _aten.detach.default:
            return cls(args[0].lowbit_hp.detach())
        args, kwargs = pytree.tree_map_only(cls, _plain, (args, kwargs or {}))
        out = func(*args, **kwargs)
        return pytree.tree_map_only(torch.Tensor, cls, out) if func in _KEEP else out

    def __tensor_flatten__(self):
        return ["lowbit_hp"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return BF16AllGatherWeight(inner["lowbit_hp"])

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """This rank's all-gather input: its shard cast to BF16 (padded to FSDP2's shard rows), the cast
        ``torch.autocast`` makes of the whole weight, element by element."""
        rows = -(-outer_size[0] // mesh.size())  # FSDP2's padded shard rows
        return (_pad_rows(self.lowbit_hp.to(torch.bfloat16), rows),), (outer_size[0],)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The whole weight: a :class:`GatheredBF16Weight` of the weight's dtype over the gathered BF16 values (a plain
        BF16 tensor where FSDP2's ``param_dtype`` is BF16)."""
        if out is not None:  # (FSDP2 gathers into the same buffer every time: the view already holds it)
            return None
        n = metadata[0]
        t = all_gather_outputs[0]
        t = t if t.shape[0] == n else t[:n]
        if param_dtype == torch.bfloat16:
            return t, ()
        # (the values are views of FSDP2's all-gather buffers, which FSDP2 frees and refills itself)
        return GatheredBF16Weight(t, param_dtype or self.dtype), ()


class GatheredBF16Weight(torch.Tensor):
    """The unsharded weight FSDP2 all-gathered in BF16 (:func:`bf16_all_gather`): a tensor of the weight's shape and
    dtype (FP32) that holds only its BF16 cast (``lowbit_bf16``). ``torch.autocast``'s cast to BF16 takes those values
    (the cast of the FP32 weight, bit for bit), and its backward returns the gradient in the weight's dtype, so FSDP2
    reduces FP32 gradients as without the gather. Any other use of the values raises: they are not the FP32 ones."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, bf16: torch.Tensor, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, bf16.shape, dtype=dtype, device=bf16.device,
                                                   requires_grad=False)

    def __init__(self, bf16: torch.Tensor, dtype: torch.dtype):
        self.lowbit_bf16 = bf16

    def __repr__(self):
        return f"GatheredBF16Weight({self.lowbit_bf16!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        kwargs = kwargs or {}
        me = args[0]
        if _self_alias(func, me, args):
            return cls(me.lowbit_bf16, me.dtype)
        if func is _aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16 and set(kwargs) <= {
                "dtype", "device", "layout"} and kwargs.get("device", me.device) == me.device:
            return me.lowbit_bf16.detach()  # (a new alias: autograd gives each cast its own node)
        if func in _SHAPE_ONLY:
            return _on_stand_in(func, me, args, kwargs)
        raise NotImplementedError(
            f"{func}: this weight was all-gathered by FSDP2 in BF16 (lowbit.nn.bf16_all_gather) and holds no "
            f"{me.dtype} values; only its cast to BF16 (torch.autocast(dtype=torch.bfloat16) around the forward) can "
            "use it")


def bf16_all_gather(model: torch.nn.Module) -> dict[str, str | None]:
    """Make FSDP2 all-gather the lowbit layers' FP32 weights as BF16, for a forward under
    ``torch.autocast(dtype=torch.bfloat16)`` without a lowbit recipe (the ``bf16`` training recipe): half the bytes
    of the FP32 gather, and each rank casts only its shard. Bit-identical: autocast's cast to BF16 takes the gathered
    values, which are the cast of the whole weight, element by element; the weight gradients reach FSDP2 in FP32 as
    before (autocast's cast backward), so the reduce-scatter and the optimizer's FP32 update are unchanged. Norm
    weights, biases, embeddings and tied weights gather as before (the fused norms read FP32 weights). Call it before
    ``fully_shard`` and before building the optimizer: each weight becomes a new ``nn.Parameter`` holding a
    :class:`BF16AllGatherWeight` (same values, same storage). A layer used outside BF16 autocast, or under
    ``lowbit.autocast``, raises (the gathered weight holds no FP32 values).

    Returns:
        ``{weight name: None (gathered in BF16) or why it gathers as before}``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    plan: dict[str, str | None] = {}
    for m, _, attr, p, name, shared in _gemm_weights(model, "bf16_all_gather"):
        if isinstance(p, Float8AllGatherWeight):
            raise ValueError(f"model: {name} gathers FP8 copies already (fp8_all_gather); a weight takes one of the "
                             "two")
        why = None
        if shared:
            why = f"{name} is shared by several modules (tied weights)"
        elif p.dtype != torch.float32:
            why = f"{name} is {p.dtype} (the BF16 gather takes FP32 weights)"
        elif not isinstance(p, BF16AllGatherWeight):  # (an earlier call's are kept)
            setattr(m, attr, torch.nn.Parameter(BF16AllGatherWeight(p.detach()), requires_grad=p.requires_grad))
        plan[name] = why
    return plan
