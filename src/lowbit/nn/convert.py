"""``lowbit.convert``: swap ``torch.nn.Linear`` (and visible Norm -> Linear pairs, transformers' ``Conv1D`` and, opt-in,
Hugging Face gated MLPs) for lowbit modules in place."""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field

import torch

from ..recipes import NVFP4BlockScaling, Recipe
from .base import name_modules
from .hf_modules import HF_RMSNORM_CLASSES, Conv1DLinear, DeferredRMSNorm, QKVLinear, SwiGLUMLP, is_hf_conv1d
from .layernorm_linear import LayerNormLinear
from .linear import Linear

__all__ = ["convert", "ConvertSummary", "DEFAULT_SKIP", "NVFP4_HIGH_PRECISION_TAIL", "GATED_MLP_CLASSES",
           "DECODER_LAYER_CLASSES", "ATTENTION_CLASSES", "NORM_NOT_FUSED", "QKV_NOT_FUSED"]

DEFAULT_SKIP = ("lm_head", "*.lm_head", "output_head", "*.output_head")
"""Name patterns kept in high precision by default (the output head)."""

NVFP4_HIGH_PRECISION_TAIL = 0.15
"""Fraction of the repeated blocks (the last ones) the NVFP4 recipe keeps in high precision by default."""

_NORM_TYPES = (torch.nn.LayerNorm,) + ((torch.nn.RMSNorm,) if hasattr(torch.nn, "RMSNorm") else ())

GATED_MLP_CLASSES = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "GemmaMLP", "Gemma2MLP", "Gemma3MLP")
"""transformers MLP classes (by name) whose forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: the ones
``fuse_mlp`` may fuse (where ``act_fn`` is SiLU)."""

DECODER_LAYER_CLASSES = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")
"""transformers decoder layers (by name) whose ``post_attention_layernorm`` output is read by their ``mlp`` alone
(``mlp(post_attention_layernorm(h))``) and whose ``input_layernorm`` output by their ``self_attn`` alone
(``self_attn(input_layernorm(h))``, which hands it to q_proj, k_proj and v_proj only: :data:`ATTENTION_CLASSES`):
with ``fuse_norms``, ``fuse_mlp`` moves the first into the fused MLP and ``fuse_qkv`` the second into the fused
QKV projection."""

NORM_NOT_FUSED = (
    "the RMSNorm before it is not fused: it is not the post_attention_layernorm (input_layernorm) of a "
    "DECODER_LAYER_CLASSES layer that feeds this MLP (attention) alone, of one of HF_RMSNORM_CLASSES (whose forward "
    "lowbit computes bit for bit), or fuse_norms is False"
)
"""Why :func:`convert` leaves a Hugging Face RMSNorm out of the fused MLP (and QKV) modules."""

ATTENTION_CLASSES = ("LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention")
"""transformers attention classes (by name) whose forward calls ``q_proj``, ``k_proj`` and ``v_proj`` once each on
one input, and reads nothing else of them: the ones ``fuse_qkv`` may fuse."""

QKV_NOT_FUSED = "QKV not fused: fuse_qkv is False (opt-in: q_proj's Parameters become one [q; k; v] copy)"
"""Why :func:`convert` leaves a Hugging Face attention's q/k/v projections apart without ``fuse_qkv`` (each is
converted as a Linear)."""


def _is_linear(m) -> bool:
    return type(m) is torch.nn.Linear or is_hf_conv1d(m)


def _modules(model: torch.nn.Module, names: list | None = None):
    """(name, module) for each of ``names`` (None: every module's) still in ``model``, looked up as it comes: a pass
    that replaces modules holds no reference to the ones it replaced (their Parameters are freed as it goes, not when
    it ends)."""
    for name in [n for n, _ in model.named_modules()] if names is None else names:
        try:
            yield name, model.get_submodule(name)
        except AttributeError:  # (inside a module replaced earlier in the pass)
            continue


def _is_norm(m) -> bool:
    return isinstance(m, _NORM_TYPES) or type(m).__name__.endswith(("RMSNorm", "LayerNorm"))


def _dims(m) -> tuple[int, int]:
    """(out, in) features of an ``nn.Linear`` or a transformers ``Conv1D`` (weight (in, out))."""
    if isinstance(m, torch.nn.Linear):
        return m.out_features, m.in_features
    k, n = m.weight.shape
    return n, k


def _is_silu(act) -> bool:
    t = type(act)
    return t is torch.nn.SiLU or (t.__name__ == "SiLUActivation" and t.__module__.startswith("transformers."))


@dataclass
class ConvertSummary:
    """What :func:`convert` did.

    Attributes:
        converted: ``(qualified name, new module type)`` per converted layer.
        kept: ``(qualified name, reason)`` per module left in high precision (Linears, norms, embeddings).
        blocks: qualified name of the repeated-block container found (``None`` if none) and its length.
        high_precision_blocks: indices of the blocks kept in high precision.
        fused: ``(qualified name, what)`` per fused module (``fuse_mlp``: gate_proj + up_proj -> one fc1).
        not_fused: ``(qualified name, reason)`` per fusion considered and not made (``fuse_mlp=True`` only).
        new_parameters: qualified names of the modules whose Parameters are new objects (copies: a ``Conv1D``'s
            transposed weight, a fused MLP's fc1): an optimizer built before :func:`convert` misses them.
    """

    converted: list = field(default_factory=list)
    kept: list = field(default_factory=list)
    blocks: tuple | None = None
    high_precision_blocks: list = field(default_factory=list)
    fused: list = field(default_factory=list)
    not_fused: list = field(default_factory=list)
    new_parameters: list = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"converted {len(self.converted)} layer(s), kept {len(self.kept)} in high precision"]
        if self.blocks:
            lines.append(f"blocks: {self.blocks[0]!r} ({self.blocks[1]}); high precision: {self.high_precision_blocks}")
        lines += [f"  + {n}: {t}" for n, t in self.converted]
        lines += [f"  = {n}: {r}" for n, r in self.kept]
        if self.fused or self.not_fused:
            lines.append(f"fused {len(self.fused)}, not fused {len(self.not_fused)}")
            lines += [f"  * {n}: {w}" for n, w in self.fused]
            lines += [f"  - {n}: {r}" for n, r in self.not_fused]
        if self.new_parameters:
            lines.append(f"new Parameters (build the optimizer after convert): {len(self.new_parameters)} module(s)")
        return "\n".join(lines)


def _find_blocks(model: torch.nn.Module):
    """The largest ``nn.ModuleList`` / ``nn.Sequential`` of >= 2 children of one type (the transformer blocks)."""
    best = None
    for name, m in model.named_modules():
        if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)) and len(m) >= 2:
            kids = list(m)
            if len({type(k) for k in kids}) == 1 and not isinstance(kids[0], (torch.nn.Linear, *_NORM_TYPES)):
                if sum(1 for _ in kids[0].modules()) > 1 and (best is None or len(kids) > len(best[1])):
                    best = (name, m)
    return best


_KEEP_FORMS = "'auto', None, an int >= 0 (the last N blocks) or a sequence of int block indices"


def _check_keep(keep) -> None:
    """Validate the form of ``keep_high_precision_blocks`` before looking at the model, so a bad value is reported
    as such (and not as "no repeated-block container" on a model without blocks)."""
    if keep is None or (isinstance(keep, str) and keep == "auto"):
        return
    if isinstance(keep, bool) or isinstance(keep, str):  # (a str is a sequence, a bool an int: neither is meant)
        raise ValueError(f"keep_high_precision_blocks: expected {_KEEP_FORMS}, got {keep!r}")
    if isinstance(keep, int):
        if keep < 0:
            raise ValueError(f"keep_high_precision_blocks: an int keeps the last N blocks, N >= 0, got {keep}")
        return
    try:
        idx = list(keep)
    except TypeError:
        raise ValueError(f"keep_high_precision_blocks: expected {_KEEP_FORMS}, got {keep!r}") from None
    for i in idx:
        if not isinstance(i, int) or isinstance(i, bool):
            raise ValueError(f"keep_high_precision_blocks: block indices must be ints, got {i!r} in {keep!r}")


def _resolve_blocks(keep, n: int, recipe) -> list[int]:
    """Block indices to keep in high precision among ``n`` blocks (``keep`` already passed :func:`_check_keep`)."""
    if isinstance(keep, str):  # "auto"
        if isinstance(recipe, NVFP4BlockScaling) and n:
            k = math.ceil(NVFP4_HIGH_PRECISION_TAIL * n)
            return list(range(n - k, n))
        return []
    if keep is None:
        return []
    if isinstance(keep, int):
        if keep > n:
            raise ValueError(f"keep_high_precision_blocks: an int keeps the last N blocks, 0 <= N <= {n}, got {keep}")
        return list(range(n - keep, n))
    out = []
    for i in keep:
        if not -n <= i < n:
            raise ValueError(f"keep_high_precision_blocks: block index {i!r} out of range for {n} blocks")
        out.append(i % n)
    return sorted(set(out))


def _matches(name: str, patterns) -> str | None:
    for p in patterns:
        if fnmatch.fnmatchcase(name, p):
            return p
    return None


def convert(model: torch.nn.Module, recipe: Recipe | None = None, skip=(), keep_high_precision_blocks="auto",
            *, keep_output_head: bool = True, fuse_norms: bool = True, fuse_mlp: bool = False,
            fuse_qkv: bool = False) -> ConvertSummary:
    """Swap the ``torch.nn.Linear`` layers of ``model`` for :class:`lowbit.nn.Linear`, in place.

    Parameters are *shared*, not copied (the optimizer, tied weights and the RNG are untouched), except where a
    layout must change (listed in ``summary.new_parameters``: build the optimizer after ``convert``); the
    converted model computes exactly what it did, bit for bit, until it runs inside :func:`lowbit.autocast`.

    Hugging Face transformers models (Llama, Mistral, Qwen2, Gemma, GPT-2; transformers is not imported):

    * GPT-2's ``Conv1D`` (``y = x @ W + b``, W (in, out)) becomes :class:`lowbit.nn.Conv1DLinear`: the weight is
      *copied* transposed into a new (out, in) contiguous Parameter (lowbit's GEMMs take that layout; a transposed
      view is not contiguous), the bias is shared. Its ``state_dict`` keeps Conv1D's (in, out) layout, so HF
      checkpoints load into the converted model (before or after ``convert``) and back.
    * ``fuse_mlp=True`` (opt-in: it replaces Parameters) turns each gated MLP of :data:`GATED_MLP_CLASSES`
      (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``) whose ``act_fn`` is exactly SiLU into a
      :class:`lowbit.nn.SwiGLUMLP` (fc1 = [gate; up], copied; down shared), which inside autocast runs lowbit's
      fused SwiGLU path; its ``state_dict`` keeps the HF keys. With ``fuse_norms`` too, the decoder layer's
      ``post_attention_layernorm`` before it (:data:`DECODER_LAYER_CLASSES`, an RMSNorm of
      ``lowbit.nn.hf_modules.HF_RMSNORM_CLASSES``) moves into the SwiGLUMLP (:meth:`lowbit.nn.SwiGLUMLP.take_norm`:
      outside autocast HF's arithmetic bit for bit; inside, where the recipe allows, in fc1's input quantizer, its
      FP32 output never written) and a :class:`lowbit.nn.DeferredRMSNorm` holding its weight takes its place (the
      state_dict keys stay). Not fused, with the reason in ``summary.not_fused``: Gemma's MLPs (GELU-tanh, not SiLU:
      lowbit's fused gate is silu(a)·b), MLPs with a part kept in high precision, other norms
      (:data:`NORM_NOT_FUSED`).
    * ``fuse_qkv=True`` (opt-in: it replaces Parameters) fuses the ``q_proj``, ``k_proj`` and ``v_proj`` of each
      attention of :data:`ATTENTION_CLASSES` into one :class:`lowbit.nn.QKVLinear` (weight [q; k; v], copied; in
      ``q_proj``'s place, ``k_proj`` and ``v_proj`` :class:`lowbit.nn.QKVPart` s reading its rows): inside autocast
      the attention's three projections of one input run as one quantized GEMM, the input quantized once; outside,
      bit-identical to the three; the ``state_dict`` keeps the HF keys. With ``fuse_norms`` too, the decoder layer's
      ``input_layernorm`` moves into the QKVLinear as ``post_attention_layernorm`` into a SwiGLUMLP
      (:meth:`lowbit.nn.QKVLinear.take_norm`: normalized once for the three projections). Not fused, with the reason
      in ``summary.not_fused`` (with ``fuse_mlp`` or ``fuse_qkv``): other attention classes, a part kept in high
      precision, or without ``fuse_qkv`` (:data:`QKV_NOT_FUSED`).

    Kept in high precision (and listed in the summary with the reason):

    * embeddings and norms (never converted), attention softmax (not a Linear);
    * the output head: modules matching :data:`DEFAULT_SKIP` (``lm_head``), or, when none does, the
      last ``nn.Linear`` in registration order (``keep_output_head=False`` converts it);
    * every module whose qualified name matches a pattern in ``skip`` (``fnmatch``, e.g. ``"*.attn.*"``;
      a plain name also matches the module of that name and everything inside it);
    * the blocks chosen by ``keep_high_precision_blocks`` inside the model's repeated-block container
      (the largest ModuleList/Sequential of same-type children): ``"auto"`` = the recipe's default
      (NVFP4: the last 15%, rounded up; others: none), an int N = the last N blocks, or a sequence
      of block indices (negative from the end), or None;
    * Linears whose dims the recipe cannot take (NVFP4: multiples of 16, MXFP8: of 32).

    With ``fuse_norms``, a ``LayerNorm``/``RMSNorm`` immediately followed by an ``nn.Linear`` inside an
    ``nn.Sequential`` becomes ``Identity`` + :class:`LayerNormLinear` (same numbers; the Linear's
    parameters and the norm's weight/bias are shared; note the state_dict keys move).

    Returns:
        a :class:`ConvertSummary` (converted, kept, fused, not fused and why, new Parameters); the converted modules
        are named for the NaN sentry.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"recipe: expected a lowbit.recipes recipe or None, got {recipe!r}")
    if isinstance(skip, str):
        skip = (skip,)
    try:
        skip = tuple(skip)
    except TypeError:
        raise TypeError(f"skip: expected a name pattern (str) or several, got {skip!r}") from None
    for p in skip:
        if not isinstance(p, str):
            raise TypeError(f"skip: expected name patterns (str), got {p!r}")
    for name, v in (("keep_output_head", keep_output_head), ("fuse_norms", fuse_norms), ("fuse_mlp", fuse_mlp),
                    ("fuse_qkv", fuse_qkv)):
        if not isinstance(v, bool):  # a truthy non-bool (e.g. "no") would silently mean True
            raise TypeError(f"{name}: expected a bool, got {v!r}")
    _check_keep(keep_high_precision_blocks)
    if not isinstance(keep_high_precision_blocks, (str, int, type(None))):
        keep_high_precision_blocks = list(keep_high_precision_blocks)  # (an iterator is read once)
    patterns = tuple(skip) + tuple(f"{p}.*" for p in skip if not any(c in p for c in "*?["))
    summary = ConvertSummary()

    blocks = _find_blocks(model)
    hp_prefixes = []
    if blocks is not None:
        bname, bmod = blocks
        summary.blocks = (bname, len(bmod))
        summary.high_precision_blocks = _resolve_blocks(keep_high_precision_blocks, len(bmod), recipe)
        hp_prefixes = [f"{bname}.{i}" if bname else str(i) for i in summary.high_precision_blocks]
    elif keep_high_precision_blocks not in ("auto", None, 0, []):
        raise ValueError(
            "keep_high_precision_blocks: model has no repeated-block container (ModuleList/Sequential of >= 2 blocks "
            f"of one type) to pick blocks from, got {keep_high_precision_blocks!r}"
        )

    names = [n for n, m in model.named_modules() if _is_linear(m)]  # (names only: fused modules are freed as they go)
    head = None
    if keep_output_head:
        heads = [n for n in names if _matches(n, DEFAULT_SKIP)]
        head = set(heads) if heads else ({names[-1]} if names else set())
    else:
        head = set()

    def reason_to_keep(name: str, lin: torch.nn.Linear) -> str | None:
        if name in head:
            return "output head (keep_output_head=True)"
        p = _matches(name, patterns)
        if p:
            return f"skip pattern {p!r}"
        for pre in hp_prefixes:
            if name == pre or name.startswith(pre + "."):
                return f"high-precision block {pre!r} (keep_high_precision_blocks)"
        if recipe is not None and recipe.divisibility > 1:
            m = recipe.divisibility
            n_out, n_in = _dims(lin)
            if n_in % m or n_out % m:
                return f"dims ({n_out}, {n_in}) not multiples of {m} ({type(recipe).__name__})"
        return None

    def parent_of(name: str):
        if "." not in name:
            return model, name
        p, _, c = name.rpartition(".")
        return model.get_submodule(p), c

    # Norm -> Linear pairs inside Sequentials
    fused = set()
    if fuse_norms:
        for sname, seq in _modules(model):
            if not isinstance(seq, torch.nn.Sequential):
                continue
            kids = list(seq._modules.items())
            for (k1, a), (k2, b) in zip(kids, kids[1:]):
                lname = f"{sname}.{k2}" if sname else k2
                nname = f"{sname}.{k1}" if sname else k1
                if type(a) in _NORM_TYPES and type(b) is torch.nn.Linear and reason_to_keep(lname, b) is None:
                    shape = a.normalized_shape
                    if len(shape) != 1 or shape[0] != b.in_features or not getattr(a, "elementwise_affine", True):
                        continue
                    if isinstance(a, torch.nn.LayerNorm) and a.bias is None:
                        continue
                    new = _fuse(a, b)
                    seq._modules[k1] = torch.nn.Identity()
                    seq._modules[k2] = new
                    fused.add(lname)
                    summary.converted.append((lname, f"LayerNormLinear (fused with {nname}, now Identity)"))

    if fuse_mlp:
        fused |= _fuse_gated_mlps(model, summary, reason_to_keep, parent_of, fuse_norms)
    if fuse_mlp or fuse_qkv:
        fused |= _fuse_qkvs(model, summary, reason_to_keep, parent_of, fuse_qkv, fuse_norms)

    for name, lin in _modules(model, names):
        if name in fused or not _is_linear(lin):
            continue
        why = reason_to_keep(name, lin)
        if why:
            summary.kept.append((name, why))
            continue
        parent, child = parent_of(name)
        if is_hf_conv1d(lin):
            setattr(parent, child, Conv1DLinear.from_conv1d(lin))
            summary.converted.append((name, "Conv1DLinear (from Conv1D: weight copied transposed, a new Parameter)"))
            summary.new_parameters.append(name)
        else:
            setattr(parent, child, Linear.from_linear(lin))
            summary.converted.append((name, "Linear"))

    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Embedding):
            summary.kept.append((name, "embedding (high precision by default)"))
        elif _is_norm(m) and not isinstance(m, DeferredRMSNorm):
            summary.kept.append((name, "norm (high precision by default)"))
    name_modules(model)
    return summary


def _fuse(norm, lin: torch.nn.Linear) -> LayerNormLinear:
    normalization = "LayerNorm" if isinstance(norm, torch.nn.LayerNorm) else "RMSNorm"
    eps = norm.eps
    if eps is None:  # RMSNorm(eps=None) uses the dtype's machine epsilon
        eps = torch.finfo(lin.weight.dtype).eps
    m = LayerNormLinear.__new__(LayerNormLinear)
    torch.nn.Module.__init__(m)
    m.in_features, m.out_features = lin.in_features, lin.out_features
    m.normalization, m.eps, m.return_layernorm_output = normalization, float(eps), False
    m.layer_norm_weight = norm.weight
    m.layer_norm_bias = norm.bias if normalization == "LayerNorm" else None
    m.weight, m.bias = lin.weight, lin.bias
    m.train(lin.training)
    m._init_gemms("")
    return m


def _linear_groups(model: torch.nn.Module, attrs: tuple):
    """(name, module, qualified names of its children ``attrs``, those children) for each module of ``model`` whose
    ``attrs`` are all plain ``nn.Linear`` s (looked up as :func:`_modules` does)."""
    for name, m in _modules(model):
        lins = [getattr(m, n, None) for n in attrs]
        if all(type(p) is torch.nn.Linear for p in lins):
            yield name, m, [f"{name}.{n}" if name else n for n in attrs], lins


def _kept(sub: list, lins: list, reason_to_keep) -> str | None:
    """"<name> kept in high precision: <reason>" for the first of the Linears ``lins`` (named ``sub``) convert keeps,
    or None."""
    for n, p in zip(sub, lins):
        r = reason_to_keep(n, p)
        if r:
            return f"{n} kept in high precision: {r}"
    return None


def _fuse_gated_mlps(model, summary: ConvertSummary, reason_to_keep, parent_of, fuse_norms: bool) -> set:
    """``fuse_mlp``: each HF gated MLP that can be fused becomes a :class:`SwiGLUMLP`; the qualified names of the
    Linears it absorbed (the others, with the reason in ``summary.not_fused``, stay for the Linear pass)."""
    done = set()
    for name, m, sub, parts in _linear_groups(model, ("gate_proj", "up_proj", "down_proj")):
        cls = type(m).__name__
        act = getattr(m, "act_fn", None)
        if cls not in GATED_MLP_CLASSES:
            why = f"{cls} is not one of GATED_MLP_CLASSES (forward not known to be down(act(gate(x)) * up(x)))"
        elif not _is_silu(act):
            why = (f"activation {type(act).__name__} is not SiLU (lowbit's fused gate computes silu(a)·b; "
                   "Gemma uses GELU-tanh)")
        else:
            why = _kept(sub, parts, reason_to_keep)
        if why:
            summary.not_fused.append((name, "gated MLP not fused: " + why))
            continue
        new = SwiGLUMLP.from_gated(m)
        parent, child = parent_of(name)
        setattr(parent, child, new)
        done.update(sub)
        summary.converted.append((name, f"SwiGLUMLP (fused from {cls})"))
        summary.fused.append((name, "gate_proj + up_proj -> fc1 of a SwiGLUMLP (fused SwiGLU inside autocast)"))
        _move_norm(summary, fuse_norms, parent, child, "mlp", "post_attention_layernorm", new, name,
                   "inside autocast: fc1's input quantizer where it can run there")
        summary.new_parameters.append(name)
    return done


def _move_norm(summary: ConvertSummary, fuse_norms: bool, parent, child: str, reader: str, norm_attr: str,
               fused, fused_name: str, how: str, reported_at: str | None = None) -> None:
    """Where ``fuse_norms``, ``parent`` is a :data:`DECODER_LAYER_CLASSES` layer, ``child`` its ``reader``
    (``"mlp"``, ``"self_attn"``) and its ``norm_attr`` one of ``HF_RMSNORM_CLASSES``: move that norm into the
    ``fused`` module (``take_norm``; its :class:`DeferredRMSNorm` takes the norm's place) and list it in
    ``summary.fused``; else list why not (:data:`NORM_NOT_FUSED`) under ``reported_at`` (default ``fused_name``)."""
    norm = getattr(parent, norm_attr, None)
    if not (fuse_norms and child == reader and type(parent).__name__ in DECODER_LAYER_CLASSES
            and type(norm).__name__ in HF_RMSNORM_CLASSES):
        summary.not_fused.append((reported_at or fused_name, NORM_NOT_FUSED))
        return
    setattr(parent, norm_attr, fused.take_norm(norm))
    pname = (reported_at or fused_name).rpartition(".")[0]
    summary.fused.append((f"{pname}.{norm_attr}" if pname else norm_attr,
                          f"{type(norm).__name__} moved into {fused_name} ({how}; the norm's place keeps its weight)"))


def _fuse_qkvs(model, summary: ConvertSummary, reason_to_keep, parent_of, enabled: bool, fuse_norms: bool) -> set:
    """Each HF attention with ``q_proj``, ``k_proj``, ``v_proj`` ``nn.Linear`` s: fused into a :class:`QKVLinear`
    where ``enabled`` (``fuse_qkv``) and it can be, else the reason in ``summary.not_fused``, with its decoder layer's
    ``input_layernorm`` moved in where ``fuse_norms`` and it is one (:data:`DECODER_LAYER_CLASSES`); the qualified
    names of the Linears fused (the others stay for the Linear pass)."""
    done = set()
    for name, m, sub, lins in _linear_groups(model, ("q_proj", "k_proj", "v_proj")):
        cls = type(m).__name__
        if not enabled:
            why = QKV_NOT_FUSED
        elif cls not in ATTENTION_CLASSES:
            why = (f"QKV not fused: {cls} is not one of ATTENTION_CLASSES (forward not known to call q_proj, k_proj "
                   "and v_proj once each on one input)")
        elif kept := _kept(sub, lins, reason_to_keep):
            why = f"QKV not fused: {kept}"
        elif len({p.in_features for p in lins}) != 1 or len({p.bias is None for p in lins}) != 1:
            why = "QKV not fused: q_proj, k_proj and v_proj differ in input width or in having a bias"
        else:
            why = None
        if why:
            summary.not_fused.append((name, why))
            continue
        qkv, m.k_proj, m.v_proj = QKVLinear.fuse(*lins)
        m.q_proj = qkv
        done.update(sub)
        summary.converted.append((sub[0], "QKVLinear (q_proj with k_proj and v_proj fused in, a new Parameter)"))
        summary.converted += [(n, "QKVPart (its rows of the QKVLinear)") for n in sub[1:]]
        summary.fused.append((name, "q_proj + k_proj + v_proj -> one QKVLinear (one GEMM inside autocast)"))
        parent, child = parent_of(name)
        _move_norm(summary, fuse_norms, parent, child, "self_attn", "input_layernorm", qkv, sub[0],
                   "normalized once for q, k and v; inside autocast: the GEMM's input quantizer where it can run there",
                   reported_at=name)
        summary.new_parameters.append(sub[0])
    return done
