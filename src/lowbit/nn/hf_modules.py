"""lowbit stand-ins for Hugging Face transformers layers that :func:`lowbit.convert` swaps in.

* :class:`Conv1DLinear` — GPT-2's ``Conv1D`` (``y = x @ W + b``, W stored (in, out)).
* :class:`QKVLinear` — a Llama / Mistral / Qwen2 / Qwen3 attention's ``q_proj`` with ``k_proj`` and ``v_proj`` fused
  into it (one [q; k; v] GEMM inside autocast), ``k_proj`` / ``v_proj`` replaced by :class:`QKVPart` s that hand out
  their columns of that one output; optionally with the decoder layer's ``input_layernorm`` moved in
  (:meth:`QKVLinear.take_norm`).
* :class:`SwiGLUMLP` — the Llama / Mistral / Qwen2 gated MLP ``down(silu(gate(x)) * up(x))`` with gate and up as one
  fc1 = [gate; up], so the fused SwiGLU path of :class:`LayerNormMLP` applies inside autocast; optionally with the
  decoder layer's RMSNorm before it moved in (:meth:`SwiGLUMLP.take_norm`), its place held by a
  :class:`DeferredRMSNorm`.

All keep the Hugging Face modules' ``state_dict`` keys and shapes (a checkpoint of the original model loads into the
converted one and back); transformers is never imported (the original classes are recognised by name).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import state as _ac
from .base import LowbitModule
from .functional import check_microbatch_arg, linear_traces, norm_fuses, quantized_linear
from .layernorm_linear import check_module_args, check_norm_input
from .layernorm_mlp import quantized_swiglu_branch
from .linear import Linear

__all__ = ["Conv1DLinear", "DeferredRMSNorm", "HF_RMSNORM_CLASSES", "QKVLinear", "QKVPart", "SwiGLUMLP", "hf_rms_norm",
           "is_hf_conv1d"]

_EXTRA = "_extra_state"


def is_hf_conv1d(m) -> bool:
    """Whether ``m`` is transformers' ``Conv1D`` (GPT-2, GPT, ...), recognised by class name and module."""
    t = type(m)
    return t.__name__ == "Conv1D" and t.__module__.startswith("transformers.")


def _copy_into(dst: torch.Tensor, src, key: str, error_msgs: list) -> None:
    """``dst.copy_(src)`` with a shape check reported as ``load_state_dict`` reports its own."""
    if not isinstance(src, torch.Tensor):
        error_msgs.append(f'While copying the parameter named "{key}", expected torch.Tensor, got {type(src).__name__}')
    elif tuple(src.shape) != tuple(dst.shape):
        error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(src.shape)} from checkpoint, "
                          f"the shape in current model is {tuple(dst.shape)}.")
    else:
        with torch.no_grad():
            dst.copy_(src)


class Conv1DLinear(Linear):
    """:class:`lowbit.nn.Linear` standing in for transformers' ``Conv1D`` (``y = x @ W + b``, W of shape (in, out)).

    ``weight`` is (out, in), contiguous, as lowbit's GEMMs take it: :meth:`from_conv1d` *copies* ``Wᵀ`` into a new
    Parameter (a transposed view is not contiguous), so the Conv1D's weight Parameter is replaced (build the
    optimizer after converting); the bias Parameter is shared.

    Outside autocast ``forward`` is Conv1D's own ``torch.addmm(b, x, W)`` on ``weight.t().contiguous()`` (W with
    Conv1D's memory layout: bit-identical to Conv1D, values and gradients, for one weight-sized copy per call;
    ``F.linear`` on the (out, in) weight picks another BLAS layout and can differ in the last bit). Inside autocast it
    quantizes like any :class:`Linear`.

    ``state_dict()`` stores ``weight`` as Conv1D does, (in, out), and ``load_state_dict`` takes it so: a checkpoint of
    the Hugging Face model loads into the converted one and back (square weights included, where the shape could not
    tell the layouts apart).
    """

    @classmethod
    def from_conv1d(cls, conv) -> "Conv1DLinear":
        """A Conv1DLinear computing what ``conv`` (a transformers ``Conv1D``) does: weight copied transposed, bias
        shared, RNG untouched."""
        w = getattr(conv, "weight", None)
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            raise TypeError(f"conv: expected a transformers Conv1D (a 2-D weight (in, out)), got {type(conv).__name__}")
        m = cls.__new__(cls)
        torch.nn.Module.__init__(m)
        m.in_features, m.out_features = w.shape
        m.weight = torch.nn.Parameter(w.detach().t().contiguous(), requires_grad=w.requires_grad)
        m.bias = conv.bias
        m.train(conv.training)
        m._init_gemms("")
        return m

    def forward(self, input: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        """As :meth:`Linear.forward`; outside autocast, Conv1D's ``addmm`` (see the class)."""
        check_microbatch_arg(is_first_microbatch)
        st = _ac.get_state()
        if st.enabled:
            return quantized_linear(input, self.weight, self.bias, self._gemms[""], is_first_microbatch, state=st)
        w_io = self.weight.t().contiguous()
        x2 = input.reshape(-1, input.shape[-1])
        y = torch.addmm(self.bias, x2, w_io) if self.bias is not None else x2 @ w_io
        return y.view(*input.shape[:-1], self.out_features)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        w = self.weight if keep_vars else self.weight.detach()
        destination[prefix + "weight"] = w.t()  # Conv1D's (in, out) layout (a view: no copy)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "weight"
        v = state_dict.get(key)
        if not isinstance(v, torch.Tensor):
            return super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                                 unexpected_keys, error_msgs)
        if tuple(v.shape) != (self.in_features, self.out_features):
            error_msgs.append(f"size mismatch for {key}: Conv1DLinear loads Conv1D's (in, out) = "
                              f"{(self.in_features, self.out_features)} layout, got {tuple(v.shape)}")
            v_t = None
        else:
            assign = local_metadata.get("assign_to_params_buffers", False)
            v_t = v.t().contiguous() if assign else v.t()  # (an assigned weight must be contiguous)
        try:  # (the transposed view for the duration of the load only: the caller's dict is left as it was)
            if v_t is None:
                del state_dict[key]
            else:
                state_dict[key] = v_t
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                          error_msgs)
            if v_t is None and key in missing_keys:
                missing_keys.remove(key)  # (reported as the size mismatch above)
        finally:
            state_dict[key] = v

    def extra_repr(self) -> str:
        return super().extra_repr() + ", from Conv1D (state_dict weight (in, out))"


class _MovedNorm:
    """Mixin of the modules a Hugging Face RMSNorm can move into (``take_norm``): ``_norm`` holds its
    :class:`DeferredRMSNorm` (a tuple: not a submodule, so the weight's state_dict key stays the norm's), or ()."""

    _norm: tuple = ()

    def _take_norm(self, norm: torch.nn.Module, width: int, name: str) -> "DeferredRMSNorm":
        """Take ``norm`` in (one of :data:`HF_RMSNORM_CLASSES` of input width ``width``, this module's argument
        ``name``; else TypeError / ValueError): its :class:`DeferredRMSNorm`, which holds its Parameter and epsilon."""
        if type(norm).__name__ not in HF_RMSNORM_CLASSES:
            raise TypeError(f"norm: expected one of {HF_RMSNORM_CLASSES}, got {type(norm).__name__}")
        w, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
        if not isinstance(w, torch.nn.Parameter) or tuple(w.shape) != (width,) or not isinstance(eps, float):
            raise ValueError(f"norm: expected weight ({width},) (the {name}) and a float variance_epsilon, got "
                             f"{tuple(getattr(w, 'shape', ()))} and {eps!r}")
        deferred = DeferredRMSNorm(w, eps, type(norm).__name__)
        self._norm = (deferred,)
        return deferred

    @property
    def norm(self) -> "DeferredRMSNorm | None":
        """The place of the RMSNorm moved in by ``take_norm`` (its weight and epsilon), or None."""
        return self._norm[0] if self._norm else None

    def _normalize(self, input: torch.Tensor, st, weight: torch.Tensor, layer, is_first_microbatch) -> tuple:
        """(input for the GEMM by ``weight``, its norm arguments): ``(input, {norm_weight, norm_eps})`` where the
        moved norm runs inside the GEMM's input quantizer (autocast, :func:`lowbit.nn.functional.norm_fuses`, and
        not where the GEMM traces inside torch.compile: HF's norm is then torch's, which Inductor compiles), else
        ``(hf_rms_norm(input), {})``."""
        w, eps = self._norm[0].weight, self._norm[0].variance_epsilon
        if (st.enabled and norm_fuses(input, w, st.recipe)
                and not linear_traces(input, weight, st.recipe, is_first_microbatch, layer)):
            return input, dict(norm_weight=w, norm_eps=eps)
        return hf_rms_norm(input, w, eps), {}


class QKVLinear(_MovedNorm, Linear):
    """:class:`lowbit.nn.Linear` standing in for a Hugging Face attention's ``q_proj``, with ``k_proj`` and ``v_proj``
    fused into it: ``weight`` = [Wq; Wk; Wv] ((nq + nk + nv, hidden), a copy: a new Parameter), ``bias`` likewise.
    The attention's ``k_proj`` and ``v_proj`` become :class:`QKVPart` s that read from it (:meth:`fuse`).

    The attention forward calls ``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)`` on one ``x``. Inside autocast the first of
    the three calls runs one quantized GEMM for all three (``x`` quantized once) and each call returns its columns
    of that output (a view); the output is dropped once all three have taken theirs, and a call on another input (or
    a second call of the same part) runs the GEMM again. Outside autocast each part is ``F.linear`` on its rows of the
    weight (contiguous slices: the GEMMs of the Hugging Face modules, bit-identical values and gradients). With the
    decoder layer's norm moved in (:meth:`take_norm`), ``x`` is the norm's input, normalized once for the three.

    ``state_dict()`` keeps the Hugging Face keys and shapes: ``weight`` / ``bias`` here are q_proj's rows (plus
    ``_extra_state``), the parts store theirs under their own names.
    """

    def __init__(self, in_features: int, sizes, bias: bool = True, device=None, dtype=None):
        """A fresh one (``torch.nn.Linear``'s init) of ``in_features`` inputs and ``sizes`` = (nq, nk, nv) output
        features; :meth:`fuse` builds one from three existing projections."""
        if not (isinstance(sizes, (tuple, list)) and len(sizes) == 3
                and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes)):
            raise ValueError(f"sizes: expected three positive ints (nq, nk, nv), got {sizes!r}")
        super().__init__(in_features, sum(sizes), bias=bias, device=device, dtype=dtype)
        self.sizes, self._pending = tuple(sizes), None

    @classmethod
    def from_linear(cls, lin):
        raise TypeError("QKVLinear.from_linear: a QKVLinear is made of three projections: use QKVLinear.fuse(q, k, v)")

    @classmethod
    def fuse(cls, q: torch.nn.Linear, k: torch.nn.Linear, v: torch.nn.Linear):
        """(QKVLinear, k part, v part) for three ``nn.Linear`` of one input width, all with bias or none: the weights
        (and biases) copied into one, requires_grad kept; RNG untouched."""
        lins = (q, k, v)
        if not all(type(m) is torch.nn.Linear for m in lins):
            raise TypeError(f"q, k, v: expected three torch.nn.Linear, got {[type(m).__name__ for m in lins]}")
        if len({m.in_features for m in lins}) != 1 or len({m.bias is None for m in lins}) != 1:
            raise ValueError(f"q, k, v: expected one input width and a bias on all or none, got in_features "
                             f"{[m.in_features for m in lins]}, biases {[m.bias is not None for m in lins]}")
        if len({(m.weight.dtype, m.weight.device) for m in lins}) != 1:
            raise ValueError(f"q, k, v: expected one dtype and device, got "
                             f"{[(str(m.weight.dtype), str(m.weight.device)) for m in lins]}")
        m = cls.__new__(cls)
        torch.nn.Module.__init__(m)
        m.sizes = tuple(x.out_features for x in lins)
        m.in_features, m.out_features = q.in_features, sum(m.sizes)
        with torch.no_grad():
            m.weight = torch.nn.Parameter(torch.cat([x.weight for x in lins]), requires_grad=q.weight.requires_grad)
            m.bias = None if q.bias is None else torch.nn.Parameter(torch.cat([x.bias for x in lins]),
                                                                    requires_grad=q.bias.requires_grad)
        m._pending = None
        m.train(q.training)
        m._init_gemms("")
        return m, QKVPart(m, 1), QKVPart(m, 2)

    def rows(self, part: int) -> slice:
        """The rows of ``weight`` (and ``bias``) of part 0 (q), 1 (k) or 2 (v)."""
        start = sum(self.sizes[:part])
        return slice(start, start + self.sizes[part])

    def take_norm(self, norm: torch.nn.Module) -> "DeferredRMSNorm":
        """Move a Hugging Face RMSNorm whose output only this attention's q, k and v projections read (the decoder
        layer's ``input_layernorm``) into it, as :meth:`SwiGLUMLP.take_norm` does for an MLP: the parts then take the
        norm's input, normalized once for the three (by :func:`hf_rms_norm`, bit for bit, or inside autocast where
        :func:`lowbit.nn.functional.norm_fuses`, inside the input quantizer of the one GEMM). Returns the
        :class:`DeferredRMSNorm` to put in the norm's place."""
        return self._take_norm(norm, self.in_features, "in_features")

    def forward(self, input: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        """q_proj's output (see the class); ``is_first_microbatch`` as :meth:`Linear.forward`."""
        return self.part(input, 0, is_first_microbatch)

    def part(self, input: torch.Tensor, part: int, is_first_microbatch: bool | None = None) -> torch.Tensor:
        """The output of part 0 (q), 1 (k) or 2 (v) for ``input`` (see the class)."""
        check_microbatch_arg(is_first_microbatch)
        st = _ac.get_state()
        r = self.rows(part)
        if not st.enabled and not self._norm:
            return F.linear(input, self.weight[r], None if self.bias is None else self.bias[r])
        pending = self._pending
        if pending is None or pending[0] is not input or pending[2][part] or pending[3] != st.enabled:
            # the work the three parts share, once: the quantized GEMM's output split in three (one split: the
            # three gradients meet in one backward node, concatenated once into dy), or outside autocast the
            # moved norm's output
            x, nkw = input, {}
            if self._norm:
                check_norm_input(input, self.in_features, "in_features")
                x, nkw = self._normalize(input, st, self.weight, self._gemms[""], is_first_microbatch)
            if st.enabled:
                y = quantized_linear(x, self.weight, self.bias, self._gemms[""], is_first_microbatch, state=st, **nkw)
                shared = y.split(self.sizes, dim=-1)
            else:
                shared = x
            pending = (input, shared, (False, False, False), st.enabled)
        done = tuple(d or i == part for i, d in enumerate(pending[2]))
        self._pending = None if all(done) else (pending[0], pending[1], done, pending[3])
        if st.enabled:
            return pending[1][part]
        return F.linear(pending[1], self.weight[r], None if self.bias is None else self.bias[r])

    def _hf_tensors(self, part: int) -> dict:
        """HF state_dict key (relative to the part's module) -> the view of ``weight`` / ``bias`` it maps to."""
        r = self.rows(part)
        out = {"weight": self.weight[r]}
        if self.bias is not None:
            out["bias"] = self.bias[r]
        return out

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        _save_views(self, self._hf_tensors(0), destination, prefix, keep_vars)

    def _load_from_state_dict(self, *args):
        _load_views(self, self._hf_tensors(0), *args)

    def extra_repr(self) -> str:
        moved = f", normalizes its input ({self.norm.norm_type})" if self._norm else ""
        return (f"in_features={self.in_features}, q/k/v out_features={self.sizes}, bias={self.bias is not None} "
                f"(q_proj with k_proj and v_proj fused in; HF state_dict){moved}")


class QKVPart(torch.nn.Module):
    """``k_proj`` (part 1) or ``v_proj`` (part 2) of a :class:`QKVLinear`: calling it returns that part's columns of
    the fused projection (see :class:`QKVLinear`). It holds no Parameter (its rows are the QKVLinear's); its
    ``state_dict`` keeps the Hugging Face ``weight`` / ``bias`` keys and shapes, read from and written to those rows."""

    def __init__(self, fused: QKVLinear, part: int):
        super().__init__()
        if part not in (1, 2):
            raise ValueError(f"part: expected 1 (k_proj) or 2 (v_proj), got {part!r}")
        self._fused = (fused,)  # (a tuple: not a submodule, so the Parameters have one owner)
        self.part = part
        self.in_features, self.out_features = fused.in_features, fused.sizes[part]

    @property
    def fused(self) -> QKVLinear:
        """The :class:`QKVLinear` whose rows this part is."""
        return self._fused[0]

    def forward(self, input: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        return self.fused.part(input, self.part, is_first_microbatch)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        _save_views(self, self.fused._hf_tensors(self.part), destination, prefix, keep_vars)

    def _load_from_state_dict(self, *args):
        _load_views(self, self.fused._hf_tensors(self.part), *args)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{('k', 'v')[self.part - 1]} rows of the q_proj QKVLinear")


def _save_views(module, tensors: dict, destination, prefix: str, keep_vars: bool) -> None:
    """``module``'s ``state_dict`` entries: ``prefix + key`` for each view of its Parameters in ``tensors`` (detached
    unless ``keep_vars``), and a lowbit module's ``_extra_state``."""
    for k, t in tensors.items():
        destination[prefix + k] = t if keep_vars else t.detach()
    if isinstance(module, LowbitModule):
        destination[prefix + _EXTRA] = module.get_extra_state()


def _load_views(module, tensors: dict, state_dict, prefix: str, local_metadata, strict: bool, missing_keys,
                unexpected_keys, error_msgs) -> None:
    """``module._load_from_state_dict`` for a module whose state is ``tensors`` (views of Parameters, by relative
    key): its load pre-hooks run, each ``prefix + key`` is copied in (shape mismatches reported as torch reports its
    own), a lowbit module's ``_extra_state`` is set, and missing and (strict) unexpected keys under ``prefix`` are
    reported (the module has no children: every other key there is its own)."""
    for hook in module._load_state_dict_pre_hooks.values():
        hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
    for k, t in tensors.items():
        key = prefix + k
        if key in state_dict:
            _copy_into(t, state_dict[key], key, error_msgs)
        elif strict:
            missing_keys.append(key)
    if isinstance(module, LowbitModule) and prefix + _EXTRA in state_dict:
        module.set_extra_state(state_dict[prefix + _EXTRA])
    if strict:
        known = set(tensors) | {_EXTRA}
        unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k[len(prefix):] not in known)


class SwiGLUMLP(_MovedNorm, LowbitModule, torch.nn.Module):
    """``y = down(silu(gate(x)) · up(x))`` — the gated MLP of Llama / Mistral / Qwen2 — with fc1 = [gate; up] as one
    weight so that inside autocast it runs as :class:`LayerNormMLP`'s SwiGLU does (one fc1 GEMM, the fused SwiGLU,
    inside fc2's input quantizer under 1x128 blockwise recipes with no bias). It has no norm: HF's RMSNorm is not
    bit-identical to torch's / lowbit's (see :func:`lowbit.convert`), so the norm before it stays the model's.

    Args:
        hidden_size, ffn_hidden_size, bias, device, dtype: as :class:`LayerNormMLP` (``activation="swiglu"``).

    Parameters: ``fc1_weight`` (2·ffn, hidden) = [gate; up], ``fc1_bias`` (2·ffn,), ``fc2_weight`` (hidden, ffn),
    ``fc2_bias`` (hidden,). :meth:`from_gated` copies an HF MLP's weights in (new Parameters: build the optimizer
    after converting).

    Outside autocast it computes ``F.linear`` on the gate and up rows of fc1 separately (contiguous slices: the same
    GEMMs as the HF module's), then ``F.silu(g) * u`` and the down projection: bit-identical to the HF MLP, values
    and gradients.

    ``state_dict()`` has the HF module's keys and shapes (``gate_proj.weight``, ``up_proj.weight``,
    ``down_proj.weight`` [and ``.bias``], plus ``_extra_state``): HF checkpoints load into it and back.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, bias: bool = False, device=None, dtype=None):
        super().__init__()
        check_module_args(dict(hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size),
                          lambda: (3 * hidden_size + 2) * ffn_hidden_size + hidden_size, bias, device, dtype)
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        fk = dict(device=device, dtype=dtype)
        lin = [torch.nn.Linear(hidden_size, ffn_hidden_size, bias=bias, **fk) for _ in range(2)]
        down = torch.nn.Linear(ffn_hidden_size, hidden_size, bias=bias, **fk)
        self._set(lin[0], lin[1], down)

    def _set(self, gate, up, down) -> None:
        with torch.no_grad():
            self.fc1_weight = torch.nn.Parameter(torch.cat([gate.weight, up.weight]),
                                                 requires_grad=gate.weight.requires_grad)
            b = None if gate.bias is None else torch.cat([gate.bias, up.bias])
            self.fc1_bias = None if b is None else torch.nn.Parameter(b, requires_grad=gate.bias.requires_grad)
        self.fc2_weight, self.fc2_bias = down.weight, down.bias  # shared
        self._init_gemms("fc1", "fc2")

    @classmethod
    def from_gated(cls, mlp: torch.nn.Module) -> "SwiGLUMLP":
        """The SwiGLUMLP of an HF gated MLP (``gate_proj``, ``up_proj``, ``down_proj`` ``nn.Linear``; the caller
        checked that its activation is SiLU): gate and up copied into fc1, down's Parameters shared."""
        lins = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if not all(type(m) is torch.nn.Linear for m in lins):
            raise TypeError(f"mlp: expected gate_proj, up_proj and down_proj nn.Linear, got {type(mlp).__name__}")
        gate, up, down = lins
        f, h = gate.weight.shape
        if (tuple(up.weight.shape) != (f, h) or tuple(down.weight.shape) != (h, f)
                or (gate.bias is None) != (up.bias is None) or (gate.bias is None) != (down.bias is None)):
            raise ValueError(f"mlp: gate {tuple(gate.weight.shape)}, up {tuple(up.weight.shape)} and down "
                             f"{tuple(down.weight.shape)} are not one gated MLP's (same biases, (ffn, hidden) x2, "
                             "(hidden, ffn))")
        m = cls.__new__(cls)
        torch.nn.Module.__init__(m)
        m.hidden_size, m.ffn_hidden_size = h, f
        m._set(gate, up, down)
        m.train(mlp.training)
        return m

    def take_norm(self, norm: torch.nn.Module) -> "DeferredRMSNorm":
        """Move a Hugging Face RMSNorm (``weight`` (hidden_size,), ``variance_epsilon``; one of
        :data:`HF_RMSNORM_CLASSES`) whose output only this MLP reads into it: the MLP then takes the norm's input and
        normalizes it itself, by :func:`hf_rms_norm` (those classes' forward, bit for bit), or, inside autocast where
        :func:`lowbit.nn.functional.norm_fuses` (a 1x128 blockwise recipe, an FP32 input on CUDA), inside fc1's input
        quantizer, where the normalized input is never written (the same two FP32 products as HF's RMSNorm on an FP32
        input; its row statistics rounded as the kernel's). Returns the :class:`DeferredRMSNorm` to put in the
        norm's place: it owns the norm's Parameter, which this MLP reads from it at every call."""
        return self._take_norm(norm, self.hidden_size, "hidden_size")

    def forward(self, input: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        """``input`` (..., hidden_size) -> (..., hidden_size) (with a norm moved in: the norm's input);
        ``is_first_microbatch`` as :meth:`Linear.forward`."""
        check_microbatch_arg(is_first_microbatch)
        check_norm_input(input, self.hidden_size, "hidden_size")
        st = _ac.get_state()
        nkw = {}
        if self._norm:
            input, nkw = self._normalize(input, st, self.fc1_weight, self._gemms["fc1"], is_first_microbatch)
        if st.enabled:
            return quantized_swiglu_branch(input, self.fc1_weight, self.fc1_bias, self.fc2_weight, self.fc2_bias,
                                           self._gemms["fc1"], self._gemms["fc2"], is_first_microbatch, st, None,
                                           **nkw)
        (wg, wu), (bg, bu) = self._halves(self.fc1_weight), self._halves(self.fc1_bias)
        return F.linear(F.silu(F.linear(input, wg, bg)) * F.linear(input, wu, bu), self.fc2_weight, self.fc2_bias)

    def _halves(self, t):
        f = self.ffn_hidden_size
        return (None, None) if t is None else (t[:f], t[f:])

    def _hf_tensors(self) -> dict:
        """HF state_dict key (relative) -> the tensor (a view of fc1 / fc2 Parameters) it is read from / written to."""
        (wg, wu), (bg, bu) = self._halves(self.fc1_weight), self._halves(self.fc1_bias)
        out = {"gate_proj.weight": wg, "up_proj.weight": wu, "down_proj.weight": self.fc2_weight}
        if self.fc1_bias is not None:
            out.update({"gate_proj.bias": bg, "up_proj.bias": bu, "down_proj.bias": self.fc2_bias})
        return out

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        _save_views(self, self._hf_tensors(), destination, prefix, keep_vars)

    def _load_from_state_dict(self, *args):
        _load_views(self, self._hf_tensors(), *args)

    def extra_repr(self) -> str:
        moved = f", normalizes its input ({self.norm.norm_type})" if self._norm else ""
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"bias={self.fc1_bias is not None}, activation=swiglu (HF gate_proj/up_proj/down_proj state_dict)"
                f"{moved}")


class DeferredRMSNorm(torch.nn.Module):
    """The place of a Hugging Face RMSNorm moved into the module that alone reads its output (a :class:`SwiGLUMLP`,
    :meth:`SwiGLUMLP.take_norm`, or a :class:`QKVLinear`, :meth:`QKVLinear.take_norm`): ``forward`` returns its input
    unchanged, for that module to normalize. It owns the norm's ``weight`` (the same Parameter) and keeps its
    ``variance_epsilon``, so the model's ``state_dict`` keys, its checkpoints, its optimizer and FSDP2's sharding of
    the weight are unchanged. Do not call it for a normalized output: there is none here."""

    def __init__(self, weight: torch.nn.Parameter, variance_epsilon: float, norm_type: str):
        super().__init__()
        self.weight, self.variance_epsilon, self.norm_type = weight, variance_epsilon, norm_type

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states

    def extra_repr(self) -> str:
        return (f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, {self.norm_type} applied by the module "
                "after it")


HF_RMSNORM_CLASSES = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
"""transformers RMSNorm classes (by name) whose forward is :func:`hf_rms_norm`."""


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The forward of :data:`HF_RMSNORM_CLASSES`, operation for operation: normalized in FP32, rounded to the input's
    dtype, then multiplied by the weight."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)
