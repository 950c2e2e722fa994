"""``lowbit.optim.AdamW``: torch's fused AdamW whose step also writes the FP8 copies the next forward needs.

Under a recipe whose weights are 128 x 128 blockwise FP8 with current scaling (``fp8-block``), every forward
quantizes every weight: one more read of the FP32 master weights (and a launch per weight) right after the optimizer
wrote them. This optimizer updates those weights in a Triton kernel that quantizes each 128 x 128 tile while it is
on chip (:mod:`lowbit.optim.kernels`) into buffers the layer keeps (:class:`lowbit.nn.functional.FreshWeight`); the
forward takes them as long as the weight was not modified since. Under FSDP2 with :func:`lowbit.nn.fp8_all_gather`
the parameters are DTensor shards of such weights: the kernel updates each rank's shard and writes the shard's
copies, which FSDP2's all-gather then moves instead of quantizing the shard (``Float8AllGatherWeight.lowbit_fresh``).
Everything else (other parameters, other recipes, AMSGrad / maximize groups, other DTensor parameters) goes through
``torch.optim.AdamW`` unchanged.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from ..nn.fsdp import Float8AllGatherWeight, fp8_gather_plan
from ..nn.functional import FreshWeight, weight_layer
from ..quant.schemes import Float8Blockwise
from ..quant.tensor import QuantizedCopy, QuantizedTensor, scale_storage_shape
from ..runtime.device import INTERPRET, is_dtensor, triton_installed

__all__ = ["AdamW"]



def _bits(x: float) -> int:
    """The IEEE binary64 bit pattern of ``x`` as a signed int64 (how the kernel receives a double)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


@dataclass(frozen=True)
class KernelConfig:
    """Launch config of the quantizing AdamW kernel. In-place kernels cannot be autotuned by timing repeated
    launches, so it is fixed; ``lowbit bench optim --configs`` times others."""

    rows_update: int = 8
    """Rows of a 128x128 tile the update loop handles a chunk."""
    rows_cast: int = 32
    """Rows a chunk of the FP8 cast (the tile's values re-read from L2)."""
    num_warps: int = 8
    """Warps a program."""
    stages: int = 3
    """Update-loop chunks in flight (software pipelining through shared memory)."""


def _aligned(*ts) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in ts)


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor holding ``t``'s values on this rank: a DTensor's local shard, a ``Float8AllGatherWeight``'s
    high-precision tensor; ``t`` itself otherwise."""
    if t is not None and is_dtensor(t):
        t = t.to_local()
    return t.lowbit_hp if isinstance(t, Float8AllGatherWeight) else t


class _ShardHolder:
    """Where the copies of a FSDP2 shard live for the update: its ``Float8AllGatherWeight``'s ``lowbit_fresh``, which
    the all-gather reads (a GemmLayer plays this part for an unsharded weight: ``.fresh``)."""

    __slots__ = ("local",)

    def __init__(self, local: Float8AllGatherWeight):
        self.local = local

    @property
    def fresh(self):
        return self.local.lowbit_fresh[0]

    @fresh.setter
    def fresh(self, f):
        self.local.lowbit_fresh[:] = [f, False]


def _mark(holder, f: FreshWeight, w: torch.Tensor) -> None:
    """``f`` now holds the copies of ``w`` as it is."""
    f.mark(w)
    if isinstance(holder, _ShardHolder):
        holder.local.lowbit_fresh[1] = True


def _valid(holder, f: FreshWeight, w: torch.Tensor) -> bool:
    """Whether ``f`` holds the copies of ``w`` as it is (a shard's: the rule its all-gather applies)."""
    if isinstance(holder, _ShardHolder):
        return holder.local.lowbit_optimizer_copies(f.scheme) is f
    return f.valid_for(w, f.scheme)


def _sharded_target(p: torch.Tensor):
    """``(holder, scheme, local tensor)`` where ``p`` is FSDP2's DTensor shard of a weight it gathers as 128x128
    blockwise FP8 copies (:func:`lowbit.nn.fp8_all_gather`, current scaling, shards of whole tiles: the rule its
    all-gather applies), else None."""
    if not is_dtensor(p):
        return None
    local = p.to_local()
    if not isinstance(local, Float8AllGatherWeight) or local.lowbit_delayed is not None:
        return None
    sch = local.lowbit_scheme
    if not (isinstance(sch, Float8Blockwise) and sch.block_dim == 2):
        return None
    if fp8_gather_plan(sch, tuple(p.shape), p.device_mesh.size()) is not None:
        return None
    return _ShardHolder(local), sch, local.lowbit_hp


class _Bucket:
    """The tensors of one launch: same shape, scheme and device; the int64 address table and the amax slots."""

    __slots__ = ("key", "owners", "table", "host", "amax")

    def __init__(self, key, owners, table, host, amax):
        self.key, self.owners, self.table, self.host, self.amax = key, owners, table, host, amax


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` (same arguments, state and checkpoints) whose step writes the FP8 copies of the weights
    a lowbit forward quantized with a 128 x 128 blockwise current-scaling scheme, in the kernel that updates them.

    For each such weight (recorded by the forward: :func:`lowbit.nn.functional.weight_layer`), in a group with
    ``fused=True`` and neither ``amsgrad`` nor ``maximize``, with FP32 contiguous 16-byte aligned parameter and
    gradient: the update is torch's fused AdamW arithmetic (:func:`lowbit.optim.reference.adamw_step_reference`),
    and the same kernel writes the weight's rowwise and columnwise FP8 copies, their scales and amax into buffers
    its layer keeps (:class:`lowbit.nn.functional.FreshWeight`); the next forward reads them instead of quantizing
    the weight. Everything else is stepped by ``torch.optim.AdamW.step``.

    Without the triton package (the ``lowbit[gpu]`` extra) no weight is taken: every step is torch's.

    Differences from ``torch.optim.AdamW(fused=True)`` for those weights: with ``grad_scale`` set (the attribute
    torch's fused optimizers read, as ``GradScaler`` and lowbit's training graph use it) the unscaled gradient is
    not written back into ``.grad``. With ``found_inf`` set (a step the device may skip) the copies that do not hold
    their weight yet are written from it first, so a skipped step leaves copies of the weights as they are.

    The copies stay valid while the weight is not modified: an in-place change through torch (``copy_``,
    ``load_state_dict``) bumps the weight's version and the forward quantizes it again; a change through
    ``.data`` is invisible to that check, so call :meth:`refresh_weight_copies` after one.

    Args:
        params, lr, betas, eps, weight_decay, amsgrad, maximize, capturable, fused: as ``torch.optim.AdamW``
            (``fused`` defaults to True for CUDA parameters here).
        quantized_weights: False: behave exactly as ``torch.optim.AdamW`` (no copies written).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *, amsgrad: bool = False,
                 maximize: bool = False, capturable: bool = False, fused: bool | None = None,
                 quantized_weights: bool = True, **kw):
        params = list(params)
        if fused is None:
            first = (params[0]["params"][0] if params and isinstance(params[0], dict)
                     else (params[0] if params else None))
            fused = bool(first is not None and first.is_cuda)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         maximize=maximize, capturable=capturable, fused=fused, **kw)
        if not isinstance(quantized_weights, bool):
            raise TypeError(f"quantized_weights: expected a bool, got {quantized_weights!r}")
        self.quantized_weights = quantized_weights
        self.kernel_config = KernelConfig()
        self._buckets: dict = {}  # (param group, bucket, update or prime) -> _Bucket
        self._amax: dict = {}  # ids of a launch's FreshWeights -> its int32 amax slots
        self.fused_tensors = 0  # tensors the last step updated in the quantizing kernel

    # -- which parameters the kernel takes ------------------------------------------------------------
    @staticmethod
    def _group_ok(g: dict) -> bool:
        return bool(g.get("fused")) and not g.get("amsgrad") and not g.get("maximize") \
            and not g.get("differentiable") and all(isinstance(b, float) for b in g["betas"])

    def _targets(self, need_grad: bool = True) -> list[list]:
        """Per param group, ``[(p, w, holder, scheme)]`` the kernel updates (or, need_grad=False, primes): ``w`` the
        tensor it writes (``p``, or a FSDP2 shard's local values), ``holder`` keeps the copies in ``.fresh`` (the
        weight's GemmLayer, or the shard's :class:`_ShardHolder`)."""
        out = []
        for g in self.param_groups:
            mine = []
            if self.quantized_weights and self._group_ok(g) and triton_installed():
                for p in g["params"]:
                    e = _sharded_target(p)
                    if e is None:
                        e = weight_layer(p)
                        if e is None or type(p.data) is not torch.Tensor:
                            continue
                        e = (*e, p)
                    holder, sch, w = e
                    if w.dtype != torch.float32 or not (w.is_cuda or INTERPRET) or not w.is_contiguous() \
                            or not _aligned(w):
                        continue
                    if need_grad:
                        gr = _local(p.grad)
                        if gr is None or gr.dtype != torch.float32 or gr.shape != w.shape or not gr.is_contiguous() \
                                or not _aligned(gr) or gr.is_sparse:
                            continue
                    mine.append((p, w, holder, sch))
            out.append(mine)
        return out

    # -- the FP8 buffers a layer keeps ----------------------------------------------------------------
    @staticmethod
    def _fresh(p: torch.Tensor, layer, sch) -> FreshWeight:
        """The copies' buffers of ``p`` (the tensor the kernel updates) kept by ``layer`` (its holder), made once."""
        f = layer.fresh
        if f is not None and f.scheme == sch and f.q.shape == tuple(p.shape) and f.q.device == p.device:
            return f
        M, Kd = p.shape
        dt = sch.format.torch_dtype
        amax = torch.zeros(1, dtype=torch.int32, device=p.device).view(torch.float32)  # (rebound to a bucket slot)
        q = QuantizedTensor(shape=tuple(p.shape), dtype=p.dtype, scheme=sch)
        q.rowwise = QuantizedCopy(data=torch.empty(M, Kd, dtype=dt, device=p.device),
                                  scale_inv=torch.zeros(scale_storage_shape(sch, M, Kd), dtype=torch.float32,
                                                        device=p.device),
                                  amax=amax)
        q.columnwise = QuantizedCopy(data=torch.empty(Kd, M, dtype=dt, device=p.device),
                                     scale_inv=torch.zeros(scale_storage_shape(sch, Kd, M), dtype=torch.float32,
                                                           device=p.device), amax=amax)
        f = layer.fresh = FreshWeight(q, sch)
        return f

    def _bucket(self, bid: tuple, items: list, adam: bool) -> _Bucket:
        """The launch table of ``items`` [(p, w, FreshWeight, holder)] (one shape and scheme), cached on every address
        in it."""
        rows = []  # one row per tensor, columns in kernels.TABLE_COLUMNS order (the amax slot appended below)
        for p, w, f, _ in items:
            st = self.state[p] if adam else None
            r, c = f.q.rowwise, f.q.columnwise
            rows.append((w.data_ptr(), _local(p.grad).data_ptr() if adam else 0,
                         _local(st["exp_avg"]).data_ptr() if adam else 0,
                         _local(st["exp_avg_sq"]).data_ptr() if adam else 0, r.data.data_ptr(), r.scale_inv.data_ptr(),
                         c.data.data_ptr(), c.scale_inv.data_ptr(), st["step"].data_ptr() if adam else 0))
        owners = tuple(id(f) for _, _, f, _ in items)
        key = tuple(rows)
        b = self._buckets.get(bid)
        if b is not None and b.key == key and b.owners == owners:
            return b
        dev = items[0][1].device
        # the amax slots belong to the weights (the update and the priming launches share them, and other gradients
        # keep them): a captured forward reads them by address
        amax = self._amax.get(owners)
        if amax is None:
            amax = self._amax[owners] = torch.zeros(len(items), dtype=torch.int32, device=dev)
        # every copy's amax is this launch's slot; bound on every (re)build, so a FreshWeight that took the id of a
        # collected one (the key is ids) still gets its slot (rebinding to the same slot changes nothing)
        for i, (_, _, f, _) in enumerate(items):
            f.q.rowwise.amax = f.q.columnwise.amax = amax[i:i + 1].view(torch.float32)
        host = torch.tensor([r + (amax.data_ptr() + 4 * i,) for i, r in enumerate(rows)], dtype=torch.int64)
        if dev.type == "cuda":
            # (a copy from pinned memory may be captured into a CUDA graph; the bucket keeps the source alive)
            host = host.pin_memory()
            table = host.to(dev, non_blocking=True)
        else:
            table = host
        b = self._buckets[bid] = _Bucket(key, owners, table, host, amax)
        return b

    def _launch(self, bid: tuple, g: dict, items: list, adam: bool) -> None:
        _, w0, f0, _ = items[0]
        sch = f0.scheme
        M, Kd = w0.shape
        b = self._bucket(bid, items, adam)
        gs = getattr(self, "grad_scale", None) if adam else None
        fi = getattr(self, "found_inf", None) if adam else None
        if fi is not None:  # a skipped step keeps the copies, so it keeps their amax: zero the slots only when not
            b.amax.mul_((fi == 1.0).to(torch.int32))
        else:
            b.amax.zero_()
        lr = g["lr"]
        lr_ptr = lr if isinstance(lr, torch.Tensor) and lr.device.type != "cpu" else None
        lr_val = 0.0 if lr_ptr is not None else float(lr)
        fmt = sch.format
        kc = self.kernel_config
        ch, ch2, warps, ns = kc.rows_update, kc.rows_cast, kc.num_warps, kc.stages
        dummy = b.amax  # an unused pointer argument
        from . import kernels as K  # (Triton is optional: imported where the kernel runs)

        K.adamw_fp8_128x128_kernel[(-(-M // 128) * -(-Kd // 128), len(items))](
            b.table, M, Kd, f0.q.rowwise.scale_inv.shape[1], f0.q.columnwise.scale_inv.shape[1],
            lr_ptr if lr_ptr is not None else dummy, _bits(lr_val), _bits(g["betas"][0]), _bits(g["betas"][1]),
            _bits(g["weight_decay"]), _bits(g["eps"]), gs if gs is not None else dummy, fi if fi is not None else dummy,
            FMAX=float(fmt.max), EMIN=fmt.emin, MBITS=fmt.mbits, POW2=sch.pow2, EPS=float(sch.eps), SW=INTERPRET,
            E5M2=fmt.name.lower() == "e5m2", ADAM=adam, LR_PTR=lr_ptr is not None, HAS_GS=gs is not None,
            HAS_FI=fi is not None, WD=g["weight_decay"] != 0, CH=ch, CH2=ch2, EVEN=M % 128 == 0 and Kd % 128 == 0,
            NS=ns, num_warps=warps, enable_fp_fusion=False)

    def _run(self, targets: list[list], adam: bool) -> None:
        n = 0
        for gi, (g, mine) in enumerate(zip(self.param_groups, targets)):
            buckets: dict = {}
            for p, w, holder, sch in mine:
                f = self._fresh(w, holder, sch)
                buckets.setdefault((tuple(w.shape), sch, w.device), []).append((p, w, f, holder))
            for bi, items in enumerate(buckets.values()):
                if adam:
                    for p, *_ in items:
                        st = self.state[p]
                        if len(st) == 0:  # torch's fused AdamW state: the step count on the device
                            st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    steps = [self.state[p]["step"] for p, *_ in items]
                    torch._foreach_add_(steps, 1)
                    if getattr(self, "found_inf", None) is not None and not all(
                            _valid(holder, f, w) for _, w, f, holder in items):
                        # a step skipped on the device writes no copies yet marks them valid: first write them from
                        # the weights as they are (new buffers, a weight changed since), which an update overwrites
                        self._launch((gi, bi, False), g, items, False)
                self._launch((gi, bi, adam), g, items, adam)
                if adam:
                    fi = getattr(self, "found_inf", None)
                    if fi is not None:
                        torch._foreach_sub_(steps, [fi] * len(steps))
                for p, w, f, holder in items:
                    if adam:  # an in-place update, as torch's would be: autograd's version check sees it
                        torch.autograd.graph.increment_version(p)
                    _mark(holder, f, w)
                n += len(items)
        self.fused_tensors = n

    # -- the optimizer API ----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        targets = self._targets()
        if not any(targets):
            self.fused_tensors = 0
            super().step()
            return loss
        saved = [g["params"] for g in self.param_groups]
        try:
            for g, mine in zip(self.param_groups, targets):
                if mine:
                    ids = {id(p) for p, *_ in mine}
                    g["params"] = [p for p in g["params"] if id(p) not in ids]
            super().step()
        finally:
            for g, s in zip(self.param_groups, saved):
                g["params"] = s
        self._run(targets, adam=True)
        return loss

    @torch.no_grad()
    def refresh_weight_copies(self) -> int:
        """Write the FP8 copies of every weight this optimizer would update in its kernel from the weights as they
        are (after a checkpoint load, a rollback, or edits through ``.data``), so the next forward takes them;
        returns how many. Before a CUDA-graph capture it makes the captured forward read the copies."""
        targets = self._targets(need_grad=False)
        n = sum(len(t) for t in targets)
        if n:
            self._run(targets, adam=False)
        return n

