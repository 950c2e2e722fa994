"""MultiheadAttention: (norm →) fused QKV projection → lowbit.attention → output projection.

The two projections are lowbit modules (quantized per the active recipe inside ``autocast``, high
precision outside); the attention core is :func:`lowbit.attention.attention` with its own
quantization settings (``qk``, ``pv``), which are independent of the recipe: INT8/FP8 attention is
an inference/training choice of its own, as in SageAttention.
"""

from __future__ import annotations

import torch

from .layernorm_linear import LayerNormLinear
from .linear import Linear

__all__ = ["MultiheadAttention"]

_QK = ("bf16", "fp16", "int8", "fp8")
_PV = ("auto", "bf16", "fp16", "fp8")


class MultiheadAttention(torch.nn.Module):
    """Self-attention block with grouped-query heads.

    Args:
        hidden_size: model width H (input and output features).
        num_attention_heads: query heads; ``hidden_size`` must be divisible by it (head_dim = H / heads).
        num_gqa_groups: key/value heads (GQA/MQA); default = ``num_attention_heads``; must divide it.
        bias: biases on both projections.
        normalization: ``None`` (plain ``Linear`` QKV), ``"LayerNorm"`` or ``"RMSNorm"`` (pre-norm fused
            into a ``LayerNormLinear`` QKV projection).
        causal: causal mask (bottom-right aligned when query and key lengths differ).
        attention_dropout: dropout on the attention probabilities in training (16-bit attention only).
        qk, pv: attention math: ``qk`` in "bf16"/"fp16"/"int8"/"fp8", ``pv`` in "auto"/"bf16"/"fp16"/"fp8"
            (see :func:`lowbit.attention.attention`).
        granularity: INT8 Q scale granularity, "per_block" or "per_warp".
        eps: norm epsilon.
        fp8_grad_handoff: under a recipe with delayed per-tensor gradient scaling (``DelayedScaling``)
            and 16-bit attention, the attention backward writes dQ, dK, dV straight to FP8 with the QKV
            projection's grad_output scale, and the projection's dgrad and wgrad GEMMs consume those
            bytes as they are (no dequantize / re-quantize; the amax is recorded into the projection's
            history). Other recipes quantize the gradient in the projection as usual.

    ``forward(x, is_first_microbatch=None, rotary_pos_emb=None)``: x (B, S, H) → (B, S, H), same dtype.
    The QKV projection's output is laid out as [q heads | k heads | v heads], each head_dim wide.
    ``rotary_pos_emb``: optional ``(cos, sin)``, each (S, head_dim) (or broadcastable to (B, S, 1,
    head_dim)), applied to q and k in the rotate-half convention: x·cos + rotate_half(x)·sin.
    """

    def __init__(self, hidden_size: int, num_attention_heads: int, num_gqa_groups: int | None = None, *,
                 bias: bool = True, normalization: str | None = None, causal: bool = True,
                 attention_dropout: float = 0.0, qk: str = "bf16", pv: str = "bf16", granularity: str = "per_block",
                 eps: float = 1e-5, fp8_grad_handoff: bool = True, device=None, dtype=None):
        super().__init__()
        for name, v in (("hidden_size", hidden_size), ("num_attention_heads", num_attention_heads)):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name}: must be a positive int, got {v!r}")
        if hidden_size % num_attention_heads:
            raise ValueError(f"num_attention_heads: must divide hidden_size ({hidden_size}), got {num_attention_heads}")
        kv = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        if not isinstance(kv, int) or kv <= 0 or num_attention_heads % kv:
            raise ValueError("num_gqa_groups: must be a positive divisor of num_attention_heads "
                             f"({num_attention_heads}), got {num_gqa_groups!r}")
        if normalization not in (None, "LayerNorm", "RMSNorm"):
            raise ValueError(f"normalization: expected None, 'LayerNorm' or 'RMSNorm', got {normalization!r}")
        if qk not in _QK:
            raise ValueError(f"qk: expected one of {_QK}, got {qk!r}")
        if pv not in _PV:
            raise ValueError(f"pv: expected one of {_PV}, got {pv!r}")
        if not (0.0 <= attention_dropout < 1.0):
            raise ValueError(f"attention_dropout: must be in [0, 1), got {attention_dropout!r}")
        if attention_dropout > 0 and not _sixteen_bit(qk, pv):
            raise NotImplementedError("attention_dropout: dropout runs with 16-bit attention only, got "
                                      f"qk={qk!r}, pv={pv!r}")
        self.hidden_size, self.num_heads, self.num_kv_heads = hidden_size, num_attention_heads, kv
        self.head_dim = hidden_size // num_attention_heads
        self.causal, self.attention_dropout = bool(causal), float(attention_dropout)
        self.qk, self.pv, self.granularity = qk, pv, granularity
        self.fp8_grad_handoff = bool(fp8_grad_handoff)
        qkv_out = (num_attention_heads + 2 * kv) * self.head_dim
        fk = dict(device=device, dtype=dtype)
        if normalization is None:
            self.qkv = Linear(hidden_size, qkv_out, bias=bias, **fk)
        else:
            self.qkv = LayerNormLinear(hidden_size, qkv_out, bias=bias, normalization=normalization, eps=eps, **fk)
        self.proj = Linear(hidden_size, hidden_size, bias=bias, **fk)

    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None, rotary_pos_emb=None) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x: expected (batch, seq, {self.hidden_size}), got shape {tuple(x.shape)}")
        # lower layer, imported late to keep `import lowbit.nn` light; from the plain submodule (torch 2.11's Dynamo
        # cannot trace an import of the callable package module)
        from ..attention.api import attention

        B, S, _ = x.shape
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(x, is_first_microbatch=is_first_microbatch)
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        # (B, S, H·D) -> (B, S, H, D): the "bshd" layout, read by the attention kernels through strides
        q, k, v = (t.reshape(B, S, -1, d) for t in (q, k, v))
        if rotary_pos_emb is not None:
            q, k = (_rotate(t, rotary_pos_emb, S, d) for t in (q, k))
        dropout_p = self.attention_dropout if self.training else 0.0
        # (no hand-off under torch.compile: the QuantizedTensors cannot leave the attention operator; same bits)
        handoff = self._handoff_scale(x) if torch.is_grad_enabled() and not torch.compiler.is_compiling() else None
        grad = {}
        if handoff is not None:  # the backward writes FP8 dQ/dK/dV with the projection's scale, handed to its GEMMs
            layer, fmt, scale = handoff
            grad = dict(grad_format=fmt, scales=(scale, scale, scale), grad_sink=_HandOff(layer, B * S))
        o = attention(q, k, v, causal=self.causal, layout="bshd", qk=self.qk, pv=self.pv, granularity=self.granularity,
                      dropout_p=dropout_p, **grad)
        return self.proj(o.reshape(B, S, hq * d), is_first_microbatch=is_first_microbatch)

    def _handoff_scale(self, x):
        """(qkv GemmLayer, grad format, delayed grad_output scale) when the FP8 hand-off applies, else None."""
        from ..quant.schemes import Float8Tensorwise
        from . import state as _ac

        if not self.fp8_grad_handoff or not _sixteen_bit(self.qk, self.pv):
            return None
        st = _ac.get_state()
        if not st.enabled or st.recipe is None:
            return None
        rq = st.recipe.role("grad_output")
        if not (rq.delayed and isinstance(rq.scheme, Float8Tensorwise)):
            return None
        layer = self.qkv._gemms[""]
        scale = layer.delayed_state(st.recipe, x.device).scale("grad_output", x.device)
        if scale is None:  # delayed-scaling warm-up: current scaling, no scale known ahead
            return None
        # (a copy: the history updates its scale in place at the outermost exit, before this backward runs)
        return layer, rq.scheme.fmt, scale.detach().clone()

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
                f"causal={self.causal}, qk={self.qk!r}, pv={self.pv!r}")


def _sixteen_bit(qk: str, pv: str) -> bool:
    """Whether the attention math is 16-bit throughout (what dropout and the FP8 gradient hand-off need): a 16-bit
    Q·Kᵀ, and a 16-bit P·V — which pv="auto" is whenever Q·Kᵀ is (``lowbit.attention.api.resolve_pv``)."""
    return qk in ("bf16", "fp16") and pv in ("auto", "bf16", "fp16")


def _rotate(t: torch.Tensor, rope, S: int, d: int) -> torch.Tensor:
    """Rotate-half RoPE on (B, S, H, D): t·cos + rotate_half(t)·sin with cos/sin (S, D) broadcast over B and H."""
    if not (isinstance(rope, (tuple, list)) and len(rope) == 2):
        raise ValueError(f"rotary_pos_emb: expected a (cos, sin) pair, got {type(rope).__name__}")
    cos, sin = rope
    if cos.shape != sin.shape or cos.shape[-1] != d or (cos.dim() == 2 and cos.shape[0] != S):
        raise ValueError(f"rotary_pos_emb: cos and sin must be ({S}, {d}) (or broadcastable to (B, {S}, 1, {d})), "
                         f"got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.dim() == 2:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    h = d // 2
    rot = torch.cat([-t[..., h:], t[..., :h]], dim=-1)
    return t * cos.to(t.dtype) + rot * sin.to(t.dtype)


class _HandOff(dict):
    """grad_sink for the attention backward: joins FP8 dQ | dK | dV (one per-tensor scale) into the QKV
    projection's grad_output (tokens, (Hq + 2·Hkv)·D) and offers it to that projection's backward."""

    def __init__(self, layer, tokens: int):
        super().__init__()
        self.layer, self.tokens = layer, tokens

    def update(self, *a, **kw):
        super().update(*a, **kw)
        from ..quant.tensor import QuantizedCopy, QuantizedTensor

        dq, dk, dv = self["dq"], self["dk"], self["dv"]
        T = self.tokens
        # each gradient is (B, S, H, D) in the bshd layout: its rowwise data (B·S·H, D) is (T, H·D) row-major
        data = torch.cat([g.rowwise.data.reshape(T, -1) for g in (dq, dk, dv)], dim=1)
        amax = torch.stack([g.rowwise.amax.reshape(()) for g in (dq, dk, dv)]).amax().reshape(1)
        qt = QuantizedTensor(shape=torch.Size((T, data.shape[1])), dtype=dq.dtype, scheme=dq.scheme,
                             rowwise=QuantizedCopy(data=data, scale_inv=dq.rowwise.scale_inv, amax=amax))
        self.layer.offer_grad_output(qt)
