"""A small GPT built from lowbit modules: the reference model of ``lowbit train`` and ``lowbit demo``.

Shape (per block, pre-norm)::

    x = x + proj(attention(rope(qkv(x))))      qkv:  lowbit.nn.LayerNormLinear (norm fused in)
    x = x + mlp(x)                              proj: lowbit.nn.Linear
                                                mlp:  lowbit.nn.LayerNormMLP (norm, fc1, act, fc2)

The adds are :func:`lowbit.ops.residual.residual_add` (one kernel on CUDA); under a recipe whose input quantizer
takes the norm (1x128 blockwise), each add also returns the next norm's row statistics (``input_rstd``).

Token embedding, the final norm and the output head stay in high precision (as NUMERICS §6 asks of
``lowbit.convert``); the head shares the embedding matrix when ``tie_weights``. The vocabulary is
bytes (256), so the presets have fewer parameters than their names (which give the transformer
shape: ``125m`` is GPT-2 small's 12 x 768, ``350m`` 24 x 1024, ``1.3b`` 24 x 2048).

Outside ``lowbit.autocast`` the lowbit modules compute in high precision exactly like torch's, so
the same model is the BF16 baseline.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import nn

from ..nn.functional import rope_grad_sink
from ..ops.residual import norm_input_link, residual_add
from ..ops.rope import rope_qkv

__all__ = ["GPTConfig", "GPT", "PRESETS", "config_from_preset", "attend", "AttentionChoice", "attention_backend"]


@dataclass(frozen=True)
class GPTConfig:
    """Model shape and architecture switches (all plain values, so a checkpoint can store it)."""

    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    ffn_hidden: int = 384
    """Hidden width of the MLP (for SwiGLU: of each of the gate and up halves)."""
    vocab_size: int = 256
    max_seq_len: int = 256
    pos: str = "rope"
    """``"rope"`` (rotary, no parameters) or ``"learned"`` (an absolute position embedding)."""
    mlp: str = "swiglu"
    """``"swiglu"`` or ``"gelu"``."""
    norm: str = "RMSNorm"
    """``"RMSNorm"`` or ``"LayerNorm"``."""
    bias: bool = False
    tie_weights: bool = True
    norm_eps: float = 1e-5
    rope_base: float = 10000.0

    def __post_init__(self):
        for name in ("n_layer", "n_head", "d_model", "ffn_hidden", "vocab_size", "max_seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: must be a positive integer, got {v!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model: must be divisible by n_head ({self.n_head}), got {self.d_model}")
        if self.pos == "rope" and (self.d_model // self.n_head) % 2:
            raise ValueError(f"n_head: RoPE needs an even head dim, got d_model/n_head = {self.d_model // self.n_head}")
        choices = {"pos": ("rope", "learned"), "mlp": ("swiglu", "gelu"), "norm": ("RMSNorm", "LayerNorm")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}: expected one of {allowed}, got {getattr(self, name)!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"config: unknown GPTConfig fields {unknown}")
        return cls(**d)


# Hidden widths are multiples of 128 so every quantization block (1x16 ... 128x128) tiles them.
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=2, n_head=4, d_model=128, ffn_hidden=384, max_seq_len=256),
    "125m": GPTConfig(n_layer=12, n_head=12, d_model=768, ffn_hidden=2048, max_seq_len=1024),
    "350m": GPTConfig(n_layer=24, n_head=16, d_model=1024, ffn_hidden=2816, max_seq_len=2048),
    "1.3b": GPTConfig(n_layer=24, n_head=16, d_model=2048, ffn_hidden=5632, max_seq_len=2048),
}


def config_from_preset(name: str, **overrides) -> GPTConfig:
    """The preset's config with ``overrides`` (e.g. ``max_seq_len``, ``mlp="gelu"``) applied."""
    if name not in PRESETS:
        raise ValueError(f"model: unknown preset {name!r}; expected one of {sorted(PRESETS)}")
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return replace(PRESETS[name], **overrides)


# ------------------------------------------------------------------------------------------------
# Attention: one small function, so the kernel behind it is trivial to swap.
# ------------------------------------------------------------------------------------------------
ATTENTION_BACKENDS = ("auto", "lowbit", "sdpa")


@dataclass(frozen=True)
class AttentionChoice:
    """Which attention a :class:`GPT` runs (its ``attention`` attribute; ``lowbit train --attention --attn-qk
    --attn-pv``). A bad value is a ValueError naming the field."""

    backend: str = "auto"
    """``"lowbit"`` (lowbit.attention), ``"sdpa"`` (torch's), or ``"auto"``: lowbit.attention when ``qk``/``pv`` ask for
    quantized attention, else SDPA (the same 16-bit math)."""
    qk: str = "bf16"
    """The Q·Kᵀ arithmetic lowbit.attention runs: ``"bf16"``, ``"int8"`` or ``"fp8"``."""
    pv: str = "bf16"
    """The P·V arithmetic lowbit.attention runs: ``"bf16"`` or ``"fp8"``."""

    def __post_init__(self):
        if self.backend not in ATTENTION_BACKENDS:
            raise ValueError(f"backend: expected one of {ATTENTION_BACKENDS}, got {self.backend!r}")
        if self.qk not in ("bf16", "int8", "fp8"):
            raise ValueError(f"qk: expected 'bf16', 'int8' or 'fp8', got {self.qk!r}")
        if self.pv not in ("bf16", "fp8"):
            raise ValueError(f"pv: expected 'bf16' or 'fp8', got {self.pv!r}")
        if (self.qk, self.pv) != ("bf16", "bf16") and self.backend == "sdpa":
            raise ValueError(f"backend: 'sdpa' cannot run quantized attention (qk={self.qk!r}, pv={self.pv!r}); use "
                             "'auto' or 'lowbit'")

    @property
    def runs(self) -> str:
        """The attention :func:`attend` runs for this choice: ``"lowbit"`` or ``"sdpa"``."""
        if self.backend == "auto":  # 16-bit attention is the same math either way; SDPA has the fused backward
            return "lowbit" if (self.qk, self.pv) != ("bf16", "bf16") else "sdpa"
        return self.backend


def attention_backend(backend: str = "auto", qk: str = "bf16", pv: str = "bf16") -> str:
    """The attention :func:`attend` runs for these :class:`AttentionChoice` fields: ``"lowbit"`` or ``"sdpa"``."""
    return AttentionChoice(backend, qk, pv).runs


def _lowbit_attention():
    """lowbit.attention.attention (imported on first use: the model module stays light to import; from the plain
    submodule, which torch 2.11's Dynamo can trace an import of)."""
    from ..attention.api import attention

    return attention


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, choice: AttentionChoice | None = None) -> torch.Tensor:
    """Causal attention on (batch, heads, seq, head_dim) tensors, by ``choice`` (None: the default
    :class:`AttentionChoice`, SDPA)."""
    choice = choice or AttentionChoice()
    if choice.runs == "lowbit":
        return _lowbit_attention()(q, k, v, causal=True, layout="bhsd", qk=choice.qk, pv=choice.pv)
    # torch's own backend order (not lowbit.attention's explicit cuDNN-first one): on H100/H200 with cuDNN >= 9.9
    # torch puts cuDNN first itself
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


# ------------------------------------------------------------------------------------------------
def rope_tables(seq_len: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (seq_len, head_dim) for rotate-half RoPE, in float32."""
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().float(), ang.sin().float()


def _residual(x: torch.Tensor, y: torch.Tensor, norm, is_first_microbatch=None):
    """(x + y, rstd, link) for ``norm``, the module whose RMSNorm reads the sum next (or None): rstd the sum's RMSNorm
    statistics where that norm runs inside its quantizer (else None), link the
    :class:`~lowbit.ops.residual.NormGradLink` that moves the norm's backward into the add's (None where the fused
    add does not run or ``LOWBIT_UNFUSE=norm_backward``)."""
    if norm is not None and norm.normalization == "RMSNorm":
        fuses = norm.fuses_norm(x, is_first_microbatch)  # (what the norm's own forward will decide)
        # (inside torch.compile no link crosses operators: statistics no fused norm reads are not computed there)
        if fuses or not torch.compiler.is_compiling():
            out, rstd, link = residual_add(x, y, rms_eps=norm.eps, norm_weight=norm.layer_norm_weight)
            return out, (rstd if fuses else None), link
    return residual_add(x, y), None, None


class Block(nn.Module):
    """Pre-norm transformer block: LayerNormLinear (QKV) -> attention -> Linear, then LayerNormMLP."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        import lowbit.nn as lnn

        self.n_head = cfg.n_head
        self.qkv = lnn.LayerNormLinear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias, normalization=cfg.norm,
                                       eps=cfg.norm_eps)
        self.proj = lnn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        # the same fused SwiGLU kernel under every recipe (BF16 included), so recipe comparisons compare GEMMs
        self.mlp = lnn.LayerNormMLP(cfg.d_model, cfg.ffn_hidden, bias=cfg.bias, normalization=cfg.norm,
                                    activation=cfg.mlp,
                                    fused_swiglu=True)

    def forward(self, x, rope=None, is_first_microbatch=None, rstd=None, next_norm=None, link=None, attention=None):
        """x (B, T, C) -> (x', rstd', link'): ``rstd`` / ``link`` optional RMSNorm statistics of x and the norm-backward
        link for ``qkv``'s norm; ``next_norm``: the module whose norm reads x' next (the next block's ``qkv``), for
        which rstd' and link' are made (see :func:`_residual`); ``attention``: the :class:`AttentionChoice` (None:
        the default). The residual adds are
        :func:`lowbit.ops.residual.residual_add` (one kernel on CUDA, with the statistics and link when asked for;
        its backward then runs the following norm's backward too)."""
        B, T, C = x.shape
        if link is None and self.qkv.normalization == "RMSNorm":
            # (no add made x with the link: the first block, or FSDP2's unit boundary, where the previous add ran
            # while this block's norm weight was still sharded) the norm's backward then runs at x's node
            x, link = norm_input_link(x, self.qkv.layer_norm_weight, self.qkv.eps, rstd)
        qkv = self.qkv(x, is_first_microbatch=is_first_microbatch, input_rstd=rstd, input_norm_link=link)
        qkv = qkv.view(B, T, 3, self.n_head, C // self.n_head)
        if rope is not None:  # one fused kernel on CUDA (lowbit.ops.rope_qkv), the FP32 reference elsewhere
            # (under a 1x128 blockwise recipe its backward runs inside qkv's grad_output quantizer: rope_grad_sink)
            q, k, v = rope_qkv(qkv, *rope, grad_sink=rope_grad_sink(self.qkv))
        else:
            q, k, v = qkv.permute(2, 0, 3, 1, 4)
        y = attend(q, k, v, attention).transpose(1, 2).reshape(B, T, C)
        fm = is_first_microbatch
        x, rstd, link = _residual(x, self.proj(y, is_first_microbatch=fm), self.mlp, fm)
        return _residual(x, self.mlp(x, is_first_microbatch=fm, input_rstd=rstd, input_norm_link=link), next_norm, fm)


class GPT(nn.Module):
    """Decoder-only transformer over bytes. ``forward(idx, targets=None)`` returns ``(logits, loss)``.

    ``attention``: the :class:`AttentionChoice` every block runs (None: the default, SDPA); a plain attribute, set it
    or use :meth:`using_attention` to swap it (not part of the weights or of ``config``)."""

    def __init__(self, cfg: GPTConfig, attention: AttentionChoice | None = None):
        super().__init__()
        self.config = cfg
        self.attention = attention or AttentionChoice()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.pos == "learned" else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm_f = nn.RMSNorm(cfg.d_model,
                                 eps=cfg.norm_eps) if cfg.norm == "RMSNorm" else nn.LayerNorm(cfg.d_model,
                                                                                              eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.wte.weight
        if cfg.pos == "rope":
            cos, sin = rope_tables(cfg.max_seq_len, cfg.head_dim, cfg.rope_base)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()
        import lowbit.nn as lnn

        lnn.name_modules(self)  # qualified names for the NaN sentry's events ("blocks.0.qkv", ...)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02) matrices, zero biases, unit norms; residual outputs scaled by 1/sqrt(2·n_layer)."""
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, 0.0, std)
            elif "norm" in name or name.endswith("weight"):
                nn.init.ones_(p)
            else:
                nn.init.zeros_(p)
        out_std = std / math.sqrt(2 * self.config.n_layer)
        for blk in self.blocks:
            nn.init.normal_(blk.proj.weight, 0.0, out_std)
            for p in blk.mlp.parameters():  # the output projection of the MLP: (d_model, ffn_hidden)
                if p.dim() == 2 and tuple(p.shape) == (self.config.d_model, self.config.ffn_hidden):
                    nn.init.normal_(p, 0.0, out_std)

    @contextlib.contextmanager
    def using_attention(self, attention: AttentionChoice):
        """``attention`` for the body of a ``with`` block; the choice in force before is put back on exit, exceptions
        included."""
        if not isinstance(attention, AttentionChoice):
            raise TypeError(f"attention: expected an AttentionChoice, got {type(attention).__name__}")
        before = self.attention
        self.attention = attention
        try:
            yield
        finally:
            self.attention = before

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.wte.weight.numel() + (self.wpe.weight.numel() if self.wpe is not None else 0)
        return n

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, is_first_microbatch: bool | None = None):
        B, T = idx.shape
        if T > self.config.max_seq_len:
            raise ValueError(f"idx: sequence length {T} exceeds the model's max_seq_len {self.config.max_seq_len}")
        x = self.wte(idx)
        rope = None
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(T, device=idx.device))
        else:
            rope = (self.rope_cos[:T], self.rope_sin[:T])
        rstd = link = None
        for i, blk in enumerate(self.blocks):
            nxt = self.blocks[i + 1].qkv if i + 1 < len(self.blocks) else None
            x, rstd, link = blk(x, rope, is_first_microbatch, rstd, nxt, link, self.attention)
        logits = self.head(self.norm_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss
