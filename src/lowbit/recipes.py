"""Recipes: which quantization each tensor role of a layer gets (NUMERICS §3, §6).

A recipe is a frozen dataclass with the field names and defaults TransformerEngine users know. It
maps the three tensor roles of a linear layer to :mod:`lowbit.quant` schemes:

* ``"input"``  (x):  rowwise copy for fprop (x · wᵀ), columnwise copy for wgrad (dyᵀ · x);
* ``"weight"`` (w):  rowwise copy for fprop, columnwise copy for dgrad (dy · w);
* ``"grad_output"`` (dy): rowwise copy for dgrad, columnwise copy for wgrad.

:meth:`Recipe.role` returns a :class:`RoleQuant` with the scheme and whether the per-tensor scale is
delayed (taken from an amax history) for that role. Pass a recipe to :func:`lowbit.autocast`.

``from_name`` maps the CLI names (``"bf16"``, ``"fp8-delayed"``, ``"fp8-current"``, ``"fp8-block"``,
``"mxfp8"``, ``"nvfp4"``) to recipes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .quant.schemes import MXFP8, NVFP4, Float8Blockwise, Float8Tensorwise, Scheme

__all__ = [
    "Format",
    "Recipe",
    "RoleQuant",
    "ROLES",
    "DelayedScaling",
    "Float8CurrentScaling",
    "Float8BlockScaling",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "from_name",
    "NAMES",
    "QUANTIZED_NAMES",
]

ROLES = ("input", "weight", "grad_output")
"""The tensor roles of a linear layer, in the order recipes and scaling state use them."""


class Format(enum.Enum):
    """FP8 element format(s) of a recipe.

    * ``E4M3``: every tensor in E4M3 (max 448, 3 mantissa bits).
    * ``E5M2``: every tensor in E5M2 — rejected by the recipes, since E5M2 x E5M2 has no tensor-core GEMM.
    * ``HYBRID``: E4M3 for the forward tensors (input, weight), E5M2 (max 57344) for gradients.
    """

    E4M3 = "e4m3"
    E5M2 = "e5m2"
    HYBRID = "hybrid"

    @property
    def fwd(self) -> str:
        """Element format of the forward roles (input, weight)."""
        return "e5m2" if self is Format.E5M2 else "e4m3"

    @property
    def bwd(self) -> str:
        """Element format of the gradient role (grad_output)."""
        return "e4m3" if self is Format.E4M3 else "e5m2"


@dataclass(frozen=True)
class RoleQuant:
    """How one tensor role is quantized under a recipe.

    Attributes:
        scheme: the :mod:`lowbit.quant` scheme.
        delayed: per-tensor scale taken from the layer's amax history (DelayedScaling) instead of the
            current tensor's amax.
    """

    scheme: Scheme
    delayed: bool = False


def _check_format(name: str, value, allowed) -> None:
    if not isinstance(value, Format):
        raise ValueError(f"{name}: expected a lowbit.recipes.Format "
                         f"({', '.join('Format.' + f.name for f in allowed)}), got {value!r}")
    if value not in allowed:
        raise ValueError(f"{name}: this recipe takes {', '.join('Format.' + f.name for f in allowed)}, got "
                         f"Format.{value.name}")


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected a bool, got {value!r}")


_ROLE_CACHE: dict = {}

MAX_AMAX_HISTORY_LEN = 1 << 16
"""The longest amax history :class:`DelayedScaling` takes (one FP32 per step per tensor role of every layer;
TransformerEngine's default is 1024)."""

MAX_MARGIN = 126
"""The largest :class:`DelayedScaling` margin (2**-margin stays a normal FP32 number)."""


def _concrete():
    """The concrete recipe classes, in :data:`NAMES`' order."""
    return [c for c in NAMES.values() if c is not None]



class Recipe:
    """Base class of all recipes (not instantiated directly)."""

    #: short name used by :func:`from_name` and in reports
    name: str = "?"

    def __new__(cls, *args, **kwargs):
        if cls is Recipe:
            raise TypeError("Recipe: the base class of the recipes is not a recipe itself; use one of "
                            + ", ".join(c.__name__ for c in _concrete()) + " (lowbit.recipes)")
        return super().__new__(cls)

    def __post_init__(self):
        self._check_fields()
        # the role table built with the recipe: torch.compile, tracing a first role() call, would otherwise insert
        # into _ROLE_CACHE, and Dynamo cannot guard a dict keyed by recipes
        self._cached_roles()

    def __setstate__(self, state):  # (unpickled: no __post_init__)
        self.__dict__.update(state)
        self._cached_roles()

    def _check_fields(self):
        """Raise on invalid field values (each recipe checks its own)."""

    def role(self, role: str) -> RoleQuant:
        """The :class:`RoleQuant` of ``role`` (``"input"``, ``"weight"`` or ``"grad_output"``)."""
        if role not in ROLES:
            raise ValueError(f"role: expected one of {ROLES}, got {role!r}")
        return self._cached_roles()[role]

    def roles(self) -> dict[str, RoleQuant]:
        """All three roles: ``{"input": ..., "weight": ..., "grad_output": ...}``."""
        return dict(self._cached_roles())

    def _cached_roles(self) -> dict[str, RoleQuant]:
        # recipes are frozen (and hashable): build the role table once per distinct recipe
        r = _ROLE_CACHE.get(self)
        if r is None:
            r = _ROLE_CACHE[self] = self._roles()
        return r

    def _roles(self) -> dict[str, RoleQuant]:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__}: a Recipe subclass must define _roles() (the scheme of "
                                  f"each role); use one of {', '.join(c.__name__ for c in _concrete())}")

    @property
    def divisibility(self) -> int:
        """Every GEMM dim (tokens, in_features, out_features) must be a multiple of this (1: any)."""
        return 1

    @property
    def delayed(self) -> bool:
        """Whether any role uses delayed (history-based) scaling."""
        return any(r.delayed for r in self._cached_roles().values())

    @property
    def kind(self) -> str:
        """``"per_tensor"``, ``"blockwise"``, ``"mxfp8"`` or ``"nvfp4"`` (what the device check looks at)."""
        raise NotImplementedError(f"{type(self).__name__}: a Recipe subclass must define the kind property "
                                  f"('per_tensor', 'blockwise', 'mxfp8' or 'nvfp4')")


@dataclass(frozen=True)
class DelayedScaling(Recipe):
    """Per-tensor FP8 with scales from an amax history (TransformerEngine's ``DelayedScaling``).

    ``scale = fmax / amax_h / 2**margin``, ``amax_h`` = max over the last ``amax_history_len`` amaxes
    (``"max"``) or the last one (``"most_recent"``). The amaxes measured in a step are reduced across
    the autocast's ``amax_reduction_group`` and pushed to the histories once, at the outermost
    autocast exit; gradient amaxes measured in a backward are pushed at the next outermost exit.
    Before anything is recorded the scale is 1 (as in TransformerEngine); use ``warmup_steps`` to
    scale from the current amax for the first steps instead.
    """

    margin: int = 0
    """Extra headroom: scales are divided by ``2**margin`` (int >= 0)."""
    fp8_format: Format = Format.HYBRID
    """E4M3 everywhere or HYBRID (E4M3 forward, E5M2 gradients)."""
    amax_history_len: int = 1024
    """Length of each amax history (int >= 1)."""
    amax_compute_algo: str = "max"
    """``"max"``: scale from the max of the history; ``"most_recent"``: from its newest entry."""
    reduce_amax: bool = True
    """All-reduce (MAX) the amaxes across the autocast's ``amax_reduction_group`` (default: the world
    group when ``torch.distributed`` is initialized) before they enter the histories."""
    warmup_steps: int = 0
    """For the first ``warmup_steps`` updates of a layer's history use current (just-in-time) scaling,
    since amax moves fastest early in training; delayed scaling afterwards. The amaxes are recorded
    during warm-up too, so the history is full when it takes over."""

    name = "fp8-delayed"

    def _check_fields(self):
        if not isinstance(self.margin, int) or isinstance(self.margin, bool) or self.margin < 0:
            raise ValueError(f"margin: expected an int >= 0, got {self.margin!r}")
        if self.margin > MAX_MARGIN:
            raise ValueError(f"margin: expected an int <= {MAX_MARGIN} (scales are divided by 2**margin; beyond that "
                             f"they underflow FP32), got {self.margin!r}")
        _check_format("fp8_format", self.fp8_format, (Format.E4M3, Format.HYBRID))
        if not isinstance(self.amax_history_len, int) or isinstance(self.amax_history_len,
                                                                    bool) or self.amax_history_len < 1:
            raise ValueError(f"amax_history_len: expected an int >= 1, got {self.amax_history_len!r}")
        if self.amax_history_len > MAX_AMAX_HISTORY_LEN:
            raise ValueError(f"amax_history_len: expected an int <= {MAX_AMAX_HISTORY_LEN} (one FP32 per step for "
                             f"each tensor of every layer; TransformerEngine's default is 1024), got "
                             f"{self.amax_history_len!r}")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo: expected 'max' or 'most_recent', got {self.amax_compute_algo!r}")
        _check_bool("reduce_amax", self.reduce_amax)
        if not isinstance(self.warmup_steps, int) or isinstance(self.warmup_steps, bool) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps: expected an int >= 0, got {self.warmup_steps!r}")

    def _roles(self):
        f = self.fp8_format
        return {
            "input": RoleQuant(Float8Tensorwise(f.fwd), delayed=True),
            "weight": RoleQuant(Float8Tensorwise(f.fwd), delayed=True),
            "grad_output": RoleQuant(Float8Tensorwise(f.bwd), delayed=True),
        }

    @property
    def kind(self):
        return "per_tensor"


@dataclass(frozen=True)
class Float8CurrentScaling(Recipe):
    """Per-tensor FP8 with the scale from each tensor's own amax, computed just in time."""

    fp8_format: Format = Format.HYBRID
    """E4M3 everywhere or HYBRID (E4M3 forward, E5M2 gradients)."""

    name = "fp8-current"

    def _check_fields(self):
        _check_format("fp8_format", self.fp8_format, (Format.E4M3, Format.HYBRID))

    def _roles(self):
        f = self.fp8_format
        return {
            "input": RoleQuant(Float8Tensorwise(f.fwd)),
            "weight": RoleQuant(Float8Tensorwise(f.fwd)),
            "grad_output": RoleQuant(Float8Tensorwise(f.bwd)),
        }

    @property
    def kind(self):
        return "per_tensor"


@dataclass(frozen=True)
class Float8BlockScaling(Recipe):
    """DeepSeek-V3 style blockwise FP8: 1x128 segments or 128x128 tiles, FP32 (optionally power-of-two) scales.

    Each ``*_block_scaling_dim`` is 1 (1x128 along the contraction dim of each copy) or 2 (128x128
    tiles). Every GEMM pairs two roles (fprop: input x weight, dgrad: grad x weight, wgrad: grad x
    input); a pair of two 2D roles has no kernel and is rejected.
    """

    fp8_format: Format = Format.E4M3
    """E4M3 everywhere (default) or HYBRID (E5M2 gradients)."""
    pow2_scales: bool = True
    """Round every block scale down to a power of two (exact scaling, amax·scale ≤ fmax kept)."""
    x_block_scaling_dim: int = 1
    """Input (activation) blocks: 1 = 1x128, 2 = 128x128."""
    w_block_scaling_dim: int = 2
    """Weight blocks: 1 = 1x128, 2 = 128x128."""
    grad_block_scaling_dim: int = 1
    """Gradient blocks: 1 = 1x128, 2 = 128x128."""

    name = "fp8-block"

    def _check_fields(self):
        _check_format("fp8_format", self.fp8_format, (Format.E4M3, Format.HYBRID))
        _check_bool("pow2_scales", self.pow2_scales)
        dims = {}
        for n in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
            v = getattr(self, n)
            if isinstance(v, bool) or not isinstance(v, int) or v not in (1, 2):
                raise ValueError(f"{n}: expected 1 (1x128) or 2 (128x128), got {v!r}")
            dims[n] = v
        x, w, g = dims.values()
        for gemm, (a, an), (b, bn) in (
            ("fprop", (x, "x_block_scaling_dim"), (w, "w_block_scaling_dim")),
            ("dgrad", (g, "grad_block_scaling_dim"), (w, "w_block_scaling_dim")),
            ("wgrad", (g, "grad_block_scaling_dim"), (x, "x_block_scaling_dim")),
        ):
            if a == 2 and b == 2:
                raise ValueError(
                    f"{an}, {bn}: both 2 makes the {gemm} GEMM 128x128 x 128x128 (2D x 2D), which has no kernel; "
                    "use 1D x 2D, 2D x 1D or 1D x 1D"
                )

    def _roles(self):
        f = self.fp8_format
        mk = lambda fmt, dim: RoleQuant(Float8Blockwise(fmt, block_dim=dim, pow2=self.pow2_scales))  # noqa: E731
        return {
            "input": mk(f.fwd, self.x_block_scaling_dim),
            "weight": mk(f.fwd, self.w_block_scaling_dim),
            "grad_output": mk(f.bwd, self.grad_block_scaling_dim),
        }

    @property
    def kind(self):
        return "blockwise"


@dataclass(frozen=True)
class MXFP8BlockScaling(Recipe):
    """OCP MXFP8: 1x32 blocks with E8M0 (power-of-two) scales along the contraction dim of every copy.

    Every GEMM dim (tokens, in_features, out_features) must be a multiple of 32. Emulated on Hopper.
    """

    fp8_format: Format = Format.E4M3
    """E4M3 everywhere (default) or HYBRID (E5M2 gradients)."""

    name = "mxfp8"

    def _check_fields(self):
        _check_format("fp8_format", self.fp8_format, (Format.E4M3, Format.HYBRID))

    def _roles(self):
        f = self.fp8_format
        return {"input": RoleQuant(MXFP8(f.fwd)), "weight": RoleQuant(MXFP8(f.fwd)),
                "grad_output": RoleQuant(MXFP8(f.bwd))}

    @property
    def divisibility(self):
        return 32

    @property
    def kind(self):
        return "mxfp8"


@dataclass(frozen=True)
class NVFP4BlockScaling(Recipe):
    """NVFP4: E2M1 elements, E4M3 scales per 16 elements, an FP32 per-tensor scale (NUMERICS §3).

    Roles: inputs 1x16 with the Random Hadamard Transform on the wgrad (columnwise) copy; weights
    16x16 tiles without RHT; gradients 1x16 with RHT on the wgrad copy and stochastic rounding.
    Every GEMM dim must be a multiple of 16. Emulated on Hopper. The three flags are TransformerEngine's
    ``NVTE_NVFP4_DISABLE_*`` switches, as explicit fields.
    """

    disable_rht: bool = False
    """No Random Hadamard Transform on the wgrad operands."""
    disable_stochastic_rounding: bool = False
    """Round gradients to nearest instead of stochastically."""
    disable_2d_quantization: bool = False
    """Quantize weights in 1x16 blocks (separately per copy) instead of 16x16 tiles."""

    name = "nvfp4"

    def _check_fields(self):
        for n in ("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization"):
            _check_bool(n, getattr(self, n))

    def _roles(self):
        rht = not self.disable_rht
        return {
            "input": RoleQuant(NVFP4(two_d=False, rht=rht)),
            "weight": RoleQuant(NVFP4(two_d=not self.disable_2d_quantization, rht=False)),
            "grad_output": RoleQuant(NVFP4(two_d=False, rht=rht,
                                           stochastic_rounding=not self.disable_stochastic_rounding)),
        }

    @property
    def divisibility(self):
        return 16

    @property
    def kind(self):
        return "nvfp4"


NAMES = {
    "bf16": None,
    "fp8-delayed": DelayedScaling,
    "fp8-current": Float8CurrentScaling,
    "fp8-block": Float8BlockScaling,
    "mxfp8": MXFP8BlockScaling,
    "nvfp4": NVFP4BlockScaling,
}
"""Recipe names (``--recipe``, :func:`from_name`) -> recipe classes (``"bf16"``: no recipe, high precision): the one
list of names; everything that lists recipes derives from it."""

QUANTIZED_NAMES = tuple(n for n, cls in NAMES.items() if cls is not None)
"""The names of the quantizing recipes, in :data:`NAMES`' order."""


def from_name(name: str) -> Recipe | None:
    """The default recipe for a CLI name; ``"bf16"`` returns None (no quantization).

    Raises:
        ValueError: unknown name (the message lists the valid ones).
    """
    if not isinstance(name, str) or name.strip().lower() not in NAMES:
        raise ValueError(f"name: unknown recipe {name!r}; valid names: {', '.join(NAMES)}")
    cls = NAMES[name.strip().lower()]
    return None if cls is None else cls()
