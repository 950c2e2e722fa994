"""``lowbit.convert``: swap ``torch.nn.Linear`` (and visible Norm -> Linear pairs) for lowbit modules in place."""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field

import torch

from ..recipes import NVFP4BlockScaling, Recipe
from .base import name_modules
from .layernorm_linear import LayerNormLinear
from .linear import Linear

__all__ = ["convert", "ConvertSummary", "DEFAULT_SKIP", "NVFP4_HIGH_PRECISION_TAIL"]

DEFAULT_SKIP = ("lm_head", "*.lm_head", "output_head", "*.output_head")
"""Name patterns kept in high precision by default (the output head)."""

NVFP4_HIGH_PRECISION_TAIL = 0.15
"""Fraction of the repeated blocks (the last ones) the NVFP4 recipe keeps in high precision by default."""

_NORM_TYPES = (torch.nn.LayerNorm,) + ((torch.nn.RMSNorm,) if hasattr(torch.nn, "RMSNorm") else ())


@dataclass
class ConvertSummary:
    """What :func:`convert` did.

    Attributes:
        converted: ``(qualified name, new module type)`` per converted layer.
        kept: ``(qualified name, reason)`` per module left in high precision (Linears, norms, embeddings).
        blocks: qualified name of the repeated-block container found (``None`` if none) and its length.
        high_precision_blocks: indices of the blocks kept in high precision.
    """

    converted: list = field(default_factory=list)
    kept: list = field(default_factory=list)
    blocks: tuple | None = None
    high_precision_blocks: list = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"converted {len(self.converted)} layer(s), kept {len(self.kept)} in high precision"]
        if self.blocks:
            lines.append(f"blocks: {self.blocks[0]!r} ({self.blocks[1]}); high precision: {self.high_precision_blocks}")
        lines += [f"  + {n}: {t}" for n, t in self.converted]
        lines += [f"  = {n}: {r}" for n, r in self.kept]
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
            *, keep_output_head: bool = True, fuse_norms: bool = True) -> ConvertSummary:
    """Swap the ``torch.nn.Linear`` layers of ``model`` for :class:`lowbit.nn.Linear`, in place.

    Parameters are *shared*, not copied (the optimizer, tied weights and the RNG are untouched); the
    converted model computes exactly what it did until it runs inside :func:`lowbit.autocast`.

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
        a :class:`ConvertSummary`; the converted modules are named for the NaN sentry.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"recipe: expected a lowbit.recipes recipe or None, got {recipe!r}")
    if isinstance(skip, str):
        skip = (skip,)
    skip = tuple(skip)
    for p in skip:
        if not isinstance(p, str):
            raise TypeError(f"skip: expected name patterns (str), got {p!r}")
    for name, v in (("keep_output_head", keep_output_head), ("fuse_norms", fuse_norms)):
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

    linears = [(n, m) for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    head = None
    if keep_output_head:
        heads = [n for n, _ in linears if _matches(n, DEFAULT_SKIP)]
        head = set(heads) if heads else ({linears[-1][0]} if linears else set())
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
            if lin.in_features % m or lin.out_features % m:
                return f"dims ({lin.out_features}, {lin.in_features}) not multiples of {m} ({type(recipe).__name__})"
        return None

    def parent_of(name: str):
        if "." not in name:
            return model, name
        p, _, c = name.rpartition(".")
        return model.get_submodule(p), c

    # Norm -> Linear pairs inside Sequentials
    fused = set()
    if fuse_norms:
        for sname, seq in list(model.named_modules()):
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

    for name, lin in linears:
        if name in fused:
            continue
        why = reason_to_keep(name, lin)
        if why:
            summary.kept.append((name, why))
            continue
        parent, child = parent_of(name)
        setattr(parent, child, Linear.from_linear(lin))
        summary.converted.append((name, "Linear"))

    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Embedding):
            summary.kept.append((name, "embedding (high precision by default)"))
        elif isinstance(m, _NORM_TYPES):
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
