"""The training loop behind ``lowbit train``: GPT + recipe + AdamW on FP32 master weights.

One step = ``grad_accum`` micro-batches per rank, each a forward under ``lowbit.autocast(recipe)``
(and ``torch.autocast`` to BF16 on CUDA) and a backward; then a NaN check (non-finite amax events
from ``lowbit.nn.nonfinite_events`` and a non-finite loss, agreed across ranks), gradient clipping
and the AdamW update. With ``--on-nonfinite skip`` the check is made on the device (the update skipped
there) and read on the host one step later (``TrainConfig.lookahead``). The global batch of a step is
drawn from the data by ``(seed, step)`` alone, so a resumed run follows the uninterrupted trajectory and
N ranks reproduce one rank.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .. import distributed
from .. import recipes as _recipes
from ..models import GPT, AttentionChoice, config_from_preset
from ..runtime import env
from . import checkpoint as ckpt
from .data import check_writable_dir, load_corpus
from .step_profile import StepProfiler

__all__ = ["TrainConfig", "train", "TrainInterrupted", "PRESET_DEFAULTS", "RECIPES", "validation_loss",
           "forward_contexts", "computes_in_bf16", "check_divisible", "setup_distributed", "Dist"]

RECIPES = tuple(_recipes.NAMES)  # (the one list of recipe names: lowbit.recipes.NAMES)

# Per-preset defaults for what the user leaves unset: (seq_len, batch_size, lr)
PRESET_DEFAULTS = {
    "tiny": (128, 16, 2e-3),
    "125m": (1024, 8, 6e-4),
    "350m": (2048, 4, 3e-4),
    "1.3b": (2048, 2, 2e-4),
}


@dataclass
class TrainConfig:
    """Everything a training run depends on (the CLI fills it from ``lowbit train`` arguments)."""

    recipe: str = "bf16"
    model: str = "tiny"
    steps: int = 200
    batch_size: int | None = None
    """Sequences per micro-batch per rank (default: per preset)."""
    seq_len: int | None = None
    grad_accum: int = 1
    lr: float | None = None
    min_lr_ratio: float = 0.1
    warmup: int | None = None
    """Linear warm-up steps (default: min(100, steps // 10))."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay of the matrices (finite, >= 0; 0: none)."""
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (finite, >= 0; 0: no clipping)."""
    seed: int = 1337
    """Seeds the initialization, the batches and the stochastic rounding (an integer in [0, 2**32))."""
    data: str | None = None
    cache_dir: str | None = None
    out_dir: str | None = None
    eval_every: int | None = None
    eval_windows: int = 64
    ckpt_every: int = 0
    """Checkpoint every N steps (0: only at the end); always atomic."""
    keep_checkpoints: int = 2
    """Keep the last N checkpoints (``checkpoint.pt``, the latest, also kept as ``checkpoint-step<S>.pt``, and the
    N-1 before it); a resume whose latest is bad (digest mismatch, unreadable, invalid fields) falls back to the
    newest good one. 1: only ``checkpoint.pt``. A checkpoint named with ``resume=PATH`` is not replaced: a bad one
    is refused, naming the newest good older checkpoint kept beside it."""
    save_final: bool = True
    overwrite: bool = False
    """Start afresh even if ``out_dir`` holds a checkpoint (which the first save then replaces)."""
    resume: str | None = None
    """None, ``"auto"`` (``out_dir/checkpoint.pt``) or a checkpoint path."""
    on_nonfinite: str = "skip"
    compare: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    """Compute dtype of the high-precision parts: ``"bf16"`` (torch.autocast), ``"fp32"``; auto: bf16 on CUDA,
    fp32 on CPU."""
    fsdp: bool = False
    fp8_all_gather: bool = False
    """With ``fsdp``: FSDP2 all-gathers the FP8 copies of the lowbit weights (per-tensor for fp8-current, 128x128 tiles
    for fp8-block) instead of their FP32 shards, bit-identical to quantizing the whole weight
    (:func:`lowbit.nn.fp8_all_gather`; a weight whose shards are not whole 128-row tiles, or a tied one, gathers in
    FP32). Recipes fp8-block and fp8-current only; not with ``compile``."""
    bf16_all_gather: bool = False
    """With ``fsdp`` and recipe ``bf16`` computing in BF16: FSDP2 all-gathers the lowbit layers' weights as BF16
    instead of FP32 (half the bytes; each rank casts its shard), bit-identical to autocast's cast of the whole weight
    (:func:`lowbit.nn.bf16_all_gather`; norm weights, biases, embeddings and tied weights gather in FP32). Not with
    ``compile``."""
    fsdp_reshard_after_forward: bool = True
    """With ``fsdp``: free each block's gathered weights after its forward and gather them again for its backward
    (FSDP2's default, the least memory); False keeps them from the forward to the backward (one all-gather a block a
    step instead of two, the block's unsharded weights held through the step, as ZeRO-2 holds them)."""
    grad_reduce_dtype: str = "float32"
    """Several processes: the dtype the gradients are averaged across ranks in: ``"float32"``, the gradients' own,
    or ``"bfloat16"``: half the bytes of the step's largest collective, each gradient rounded to BF16 before the sum
    (kept in BF16 between the collective's hops), the mean cast back to FP32 for the optimizer. FSDP2's
    ``MixedPrecisionPolicy.reduce_dtype`` (with ``grad_accum`` > 1 FSDP2 also accumulates the micro-batches in BF16:
    the run says so); under DDP, lowbit's captured all-reduce (BF16 buckets) or, eager, a torch DDP communication
    hook (:func:`lowbit.train.grad_sync.bf16_average_hook`)."""
    cuda_graph: str = "auto"
    """Replay each step's forward+backward as one captured CUDA graph (no per-kernel host cost):
    ``"auto"`` where it is safe (on CUDA: one process, or DDP or FSDP2 with an NCCL that captures collectives, the
    collectives captured with the step; recipes bf16, fp8-current, fp8-block, mxfp8, nvfp4 — whose
    stochastic-rounding keys are drawn on the device, fresh at every replay — but not fp8-delayed, whose amax
    histories live in host objects), ``"on"`` (error if it cannot be used), ``"off"``."""
    compile: bool = False
    """``torch.compile`` each transformer block (the torchtitan pattern: one graph shared by every block, before any
    FSDP2 sharding), in place of ``lowbit train``'s own CUDA graphs (``cuda_graph`` must not be ``"on"``)."""
    compile_mode: str = "default"
    """``torch.compile``'s mode for the blocks (with ``compile``): ``"default"``, ``"reduce-overhead"`` (each block's
    forward and backward replayed from torch's CUDA graphs: no per-kernel host cost; current-scaling recipes and
    ``grad_accum`` 1 only, as :mod:`lowbit.nn` documents for that mode) or ``"max-autotune-no-cudagraphs"``."""
    attention: str = "auto"
    attn_qk: str = "bf16"
    attn_pv: str = "bf16"
    mlp: str | None = None
    pos: str | None = None
    norm: str | None = None
    tie_weights: bool | None = None
    progress: bool = True
    verbose: bool = True
    stop_at_step: int | None = None
    """Testing: end the run (as if killed) after this step, before ``steps``."""
    fault_steps: tuple = field(default_factory=tuple)
    """Testing: put +inf into the first block's input at these steps (a transient fault)."""
    step_phases: bool = False
    """Diagnostic: report the host wall time of each phase of a step (and the GPU time between its marks)."""
    profile_graphs: str | None = None
    """Diagnostic: a folder; the fourth step's CUDA graphs are replayed under torch.profiler and their kernel times,
    gaps and trace written to ``<folder>/<recipe>/graph_profile.json``."""
    deterministic: bool = False
    """Bit-reproducible runs, for loss checks (1 against N GPUs) and debugging, slower: for the run,
    ``torch.use_deterministic_algorithms(True)`` (strict: an operation without a deterministic kernel raises, naming
    it; lowbit's 16-bit attention then runs its own backward, not cuDNN's), cuDNN deterministic without benchmarking,
    lowbit's autotuning off (every run the same kernel configs) and ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` where unset
    (it must be set before the process's first cuBLAS call; ``lowbit train`` sets it first). lowbit's own kernels
    reduce only by max, which is order-free."""
    lookahead: bool = True
    """With ``on_nonfinite="skip"``: decide a step's skip on the device (CUDA graphs: in the update graph; eager steps,
    DDP and FSDP2 among them: the loss, the amaxes and the gradient norm reduced across ranks there and fed to the
    fused AdamW as ``found_inf``) and finish it on the host after the next one is launched (off: every step is read
    and waited for on the host; the same results)."""
    step_profile: int = 0
    """Diagnostic: run ``torch.profiler`` over this many steps after warm-up (0: off) and split each one's wall time
    into compute, communication, the communication no compute hides (exposed) and host time, per rank, into the
    summary's ``step_profile`` (:mod:`lowbit.train.step_profile`); those steps and the one before them are left out
    of tokens/s. Needs ``step_profile + 2`` steps."""

    def validate(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"recipe: unknown recipe {self.recipe!r}; expected one of {', '.join(RECIPES)}")
        if self.model not in PRESET_DEFAULTS:
            raise ValueError(f"model: unknown preset {self.model!r}; expected one of {', '.join(PRESET_DEFAULTS)}")

        def integer(name: str, lo: int, optional: bool = False, note: str = "") -> None:
            v = getattr(self, name)
            if v is None and optional:
                return
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{name}: must be an integer >= {lo}{note}, got {v!r}")

        def number(name: str, ok, rule: str, optional: bool = False) -> None:
            v = getattr(self, name)
            if v is None and optional:
                return
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v):
                raise ValueError(f"{name}: must be a finite number {rule}, got {v!r}")

        for name in ("steps", "grad_accum", "eval_windows"):
            integer(name, 1)
        for name in ("batch_size", "seq_len", "eval_every"):
            integer(name, 1, optional=True)
        integer("warmup", 0, optional=True)
        integer("ckpt_every", 0, note=" (0 = only at the end)")
        integer("step_profile", 0, note=" (0 = off)")
        integer("keep_checkpoints", 1)
        integer("stop_at_step", 1, optional=True)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**32:
            raise ValueError(f"seed: must be an integer in [0, 2**32), got {self.seed!r}")
        number("lr", lambda v: v > 0, "> 0", optional=True)
        number("min_lr_ratio", lambda v: 0 <= v <= 1, "in [0, 1]")
        number("weight_decay", lambda v: v >= 0, ">= 0 (0 = no weight decay)")
        number("grad_clip", lambda v: v >= 0, ">= 0 (0 = no clipping)")
        number("beta1", lambda v: 0 <= v < 1, "in [0, 1)")
        number("beta2", lambda v: 0 <= v < 1, "in [0, 1)")
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in self.fault_steps):
            raise ValueError(f"fault_steps: must be integers, got {self.fault_steps!r}")
        if self.on_nonfinite not in ("skip", "rollback", "raise"):
            raise ValueError(f"on_nonfinite: expected 'skip', 'rollback' or 'raise', got {self.on_nonfinite!r}")
        if self.compare not in (None, "bf16"):
            raise ValueError(f"compare: only 'bf16' is supported, got {self.compare!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device: expected 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device: 'cuda' asked for, but torch sees no CUDA GPU")
        if self.dtype not in ("auto", "bf16", "fp32"):
            raise ValueError(f"dtype: expected 'auto', 'bf16' or 'fp32', got {self.dtype!r}")
        if self.cuda_graph not in ("auto", "on", "off"):
            raise ValueError(f"cuda_graph: expected 'auto', 'on' or 'off', got {self.cuda_graph!r}")
        if not isinstance(self.compile, bool):
            raise TypeError(f"compile: expected a bool, got {self.compile!r}")
        if not isinstance(self.fp8_all_gather, bool):
            raise TypeError(f"fp8_all_gather: expected a bool, got {self.fp8_all_gather!r}")
        if self.fp8_all_gather:
            if not self.fsdp:
                raise ValueError("fp8_all_gather: True needs fsdp=True (it changes what FSDP2's all-gather moves); "
                                 "got fsdp=False")
            if self.recipe not in FP8_ALL_GATHER_RECIPES:
                raise ValueError(f"fp8_all_gather: True takes recipe {' or '.join(FP8_ALL_GATHER_RECIPES)} (per-tensor "
                                 f"or 128x128 FP8 weight copies), got recipe {self.recipe!r}")
            if self.compile:
                raise ValueError("fp8_all_gather: True with compile=True is not supported (torch.compile cannot trace "
                                 "the gathered FP8 weights); drop one of them")
        if not isinstance(self.bf16_all_gather, bool):
            raise TypeError(f"bf16_all_gather: expected a bool, got {self.bf16_all_gather!r}")
        if self.bf16_all_gather:
            if not self.fsdp:
                raise ValueError("bf16_all_gather: True needs fsdp=True (it changes what FSDP2's all-gather moves); "
                                 "got fsdp=False")
            if self.recipe != "bf16":
                raise ValueError(f"bf16_all_gather: True takes recipe 'bf16' (a quantized recipe quantizes the FP32 "
                                 f"weight, or gathers its FP8 copies: fp8_all_gather), got recipe {self.recipe!r}")
            if self.dtype == "fp32":
                raise ValueError("bf16_all_gather: True needs the BF16 compute dtype (the gathered weights hold only "
                                 "their BF16 cast), got dtype='fp32'")
            if self.compile:
                raise ValueError("bf16_all_gather: True with compile=True is not supported (torch.compile cannot trace "
                                 "the gathered BF16 weights); drop one of them")
        if not isinstance(self.deterministic, bool):
            raise TypeError(f"deterministic: expected a bool, got {self.deterministic!r}")
        if self.grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
            raise ValueError(f"grad_reduce_dtype: expected one of {', '.join(GRAD_REDUCE_DTYPES)}, got "
                             f"{self.grad_reduce_dtype!r}")
        if not isinstance(self.fsdp_reshard_after_forward, bool):
            raise TypeError(f"fsdp_reshard_after_forward: expected a bool, got {self.fsdp_reshard_after_forward!r}")
        if not self.fsdp_reshard_after_forward and not self.fsdp:
            raise ValueError("fsdp_reshard_after_forward: False needs fsdp=True (it is FSDP2's setting); got "
                             "fsdp=False")
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode: expected one of {', '.join(COMPILE_MODES)}, got {self.compile_mode!r}")
        if self.compile_mode != "default":
            if not self.compile:
                raise ValueError(f"compile_mode: {self.compile_mode!r} needs compile=True (--compile)")
            if self.compile_mode == "reduce-overhead":
                if self.recipe not in GRAPH_RECIPES:
                    raise ValueError(f"compile_mode: 'reduce-overhead' replays CUDA graphs, which cannot carry recipe "
                                     f"{self.recipe!r}'s per-step host state (graph-safe: {', '.join(GRAPH_RECIPES)})")
                if self.grad_accum != 1:
                    raise ValueError(f"compile_mode: 'reduce-overhead' needs grad_accum 1 (the weight quantized once "
                                     f"and reused across micro-batches cannot live in its CUDA graphs), got "
                                     f"{self.grad_accum}")
                if self.fsdp:
                    raise ValueError("compile_mode: 'reduce-overhead' with fsdp=True: FSDP2 gathers each block's "
                                     "weights into memory of its own every step, and torch's CUDA graphs record again "
                                     "when a weight's address changes (0.05x one CUDA-graphed GPU measured); run "
                                     "FSDP2 in lowbit train's own CUDA graphs (--fsdp without --compile) or compile "
                                     "in the default mode")
        if self.compile and self.cuda_graph == "on":
            raise ValueError("cuda_graph: 'on' together with compile; torch.compile'd blocks run without lowbit's "
                             "own step graphs (use --cuda-graph auto or off with --compile)")

    def resolved(self) -> "TrainConfig":
        """A copy with the per-preset defaults filled in."""
        self.validate()
        seq, bs, lr = PRESET_DEFAULTS[self.model]
        c = TrainConfig(**asdict(self))
        c.fault_steps = tuple(self.fault_steps)
        c.seq_len = c.seq_len or seq
        c.batch_size = c.batch_size or bs
        c.lr = c.lr or lr
        c.warmup = min(100, c.steps // 10) if c.warmup is None else c.warmup
        c.eval_every = c.eval_every or max(1, c.steps // 10)
        c.out_dir = c.out_dir or os.path.join("runs", f"{c.model}-{c.recipe}")
        return c


# ------------------------------------------------------------------------------------------------
# distributed setup
# ------------------------------------------------------------------------------------------------
@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    group: object = None

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1


def setup_distributed(device_arg: str) -> Dist:
    """Initialize torch.distributed from torchrun's environment (nccl on CUDA, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = torch.cuda.is_available() if device_arg == "auto" else device_arg == "cuda"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        n = torch.cuda.device_count()
        if local_rank >= n:  # (torch's own error here is "CUDA error: invalid device ordinal")
            raise ValueError(f"--device: this process is local rank {local_rank} (LOCAL_RANK) but the machine has {n} "
                             f"CUDA GPU(s), one a rank needed: start at most {n} per node (torchrun --nproc_per_node), "
                             f"or run on the CPU with --device cpu (gloo)")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world <= 1:
        return Dist(device=device)
    dist = torch.distributed
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", device_id=device if use_cuda else None)
    return Dist(rank=dist.get_rank(), world=dist.get_world_size(), local_rank=local_rank, device=device,
                group=dist.group.WORLD)


def _all_sum(t: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.active:
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
    return t


# ------------------------------------------------------------------------------------------------
# memory
# ------------------------------------------------------------------------------------------------
def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # Linux: writing 5 to clear_refs resets the peak RSS (VmHWM)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak(device: torch.device) -> tuple[int | None, str]:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda max_memory_allocated"
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024, "process peak RSS"
    except OSError:
        pass
    return None, "unavailable"


# ------------------------------------------------------------------------------------------------
def lr_at(step: int, c: TrainConfig) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``lr · min_lr_ratio`` at the last step."""
    if step < c.warmup:
        return c.lr * (step + 1) / c.warmup
    span = max(1, c.steps - c.warmup)
    t = min(1.0, (step - c.warmup) / span)
    return c.lr * (c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def quantized_weight_bytes(model, recipe) -> tuple[int, int]:
    """(bytes of the lowbit modules' weights quantized per ``recipe`` (rowwise copy: data + scales),
    bytes of the same weights in BF16). Without a recipe both are the BF16 size."""
    import lowbit.nn as lnn
    from lowbit.quant import quantize

    kinds = tuple(getattr(lnn, n) for n in ("Linear", "LayerNormLinear", "LayerNormMLP") if hasattr(lnn, n))
    q = bf = 0
    for mod in model.modules():
        if not isinstance(mod, kinds):
            continue
        for _, p in mod.named_parameters(recurse=False):
            if p.dim() != 2:
                continue
            w = p.detach()
            if hasattr(w, "full_tensor"):
                w = w.full_tensor()
            bf += w.numel() * 2
            if recipe is None:
                q += w.numel() * 2
            else:
                q += quantize(w.float(), recipe.role("weight").scheme, rowwise=True, columnwise=False).nbytes
    return q, bf


def computes_in_bf16(dtype: str, device: torch.device) -> bool:
    """Whether the unquantized parts compute in BF16 (``torch.autocast``) for ``--dtype``: "bf16", or "auto" on
    CUDA (FP32 otherwise)."""
    return dtype == "bf16" or (dtype == "auto" and device.type == "cuda")


def forward_contexts(recipe, device: torch.device, bf16: bool, *, cache_enabled: bool = True, group=None,
                     on_nonfinite: str = "skip"):
    """``(amp, quantized)``: the two context factories every forward of a run enters, in that order.
    ``amp()``: ``torch.autocast`` to BF16 where ``bf16`` (``cache_enabled=False`` under CUDA-graph capture, where
    the cached casts would be freed memory); ``quantized()``: ``lowbit.autocast(recipe)`` where ``recipe`` is not
    None (``group``: the amax reduction group). Each is a no-op otherwise."""
    import lowbit.nn as lnn

    amp = ((lambda: torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=cache_enabled)) if bf16
           else contextlib.nullcontext)

    def quantized():
        if recipe is None:
            return contextlib.nullcontext()
        return lnn.autocast(enabled=True, recipe=recipe, amax_reduction_group=group, on_nonfinite=on_nonfinite)

    return amp, quantized


def check_divisible(recipe_name: str, recipe, dims: dict) -> None:
    """A ValueError naming the first of ``dims`` (name -> size) that is not a multiple of what ``recipe``'s GEMMs
    need (:attr:`lowbit.recipes.Recipe.divisibility`; None or 1: any size)."""
    k = 1 if recipe is None else recipe.divisibility
    for name, v in dims.items():
        if k > 1 and v % k:
            raise ValueError(f"{name}: recipe {recipe_name!r} needs multiples of {k}, got {v}")


@torch.no_grad()
def validation_loss(model, corpus, offsets, seq_len: int, batch_size: int, d: Dist, amp, quantized,
                    on_batch=None) -> float:
    """The mean cross-entropy (nats per token) of ``model`` on the validation windows of ``corpus`` that start at
    ``offsets``, every forward under ``amp()`` and ``quantized()`` (:func:`forward_contexts`). Each of the ``d.world``
    ranks takes every world-th window in batches of ``batch_size`` and the sums are reduced over the ranks; every rank
    runs the same number of batches (FSDP's collectives need it), a rank out of windows a padding batch that does not
    count. ``on_batch(i, n)``: called after the i-th of the n batches (progress)."""
    _reshard(model)  # (the first forward gathers the weights as they are now: see _reshard)
    mine = offsets[d.rank::d.world]
    n_batches = -(-len(offsets) // (d.world * batch_size))
    tot = torch.zeros(2, dtype=torch.float64, device=d.device)
    for i in range(n_batches):
        off = mine[i * batch_size:(i + 1) * batch_size]
        weight = 1.0
        if len(off) == 0:  # padding batch: run it (collectives must match) but do not count it
            off, weight = offsets[:1], 0.0
        x, y = corpus.windows("val", off, seq_len, d.device)
        with amp(), quantized():
            _, loss = model(x, y)
        tot[0] += weight * loss.double() * y.numel()
        tot[1] += weight * y.numel()
        if on_batch is not None:
            on_batch(i + 1, n_batches)
    _all_sum(tot, d)
    _reshard(model)
    return float(tot[0] / tot[1])


def _reshard(model) -> None:
    """Free FSDP2's gathered weights of ``model`` (a no-op elsewhere). FSDP2 keeps the root's weights gathered after
    a forward, for its backward, and gathers them again only once a backward has freed them; an evaluation has no
    backward, and a replayed CUDA-graph step runs none of FSDP2's hooks, so without this the next evaluation would run
    on the weights gathered for the last one, before the steps in between updated them. An evaluation also starts
    with it: weights a captured step left marked gathered live in the graph's memory, which later replays reuse."""
    if not torch.distributed.is_available():  # (a torch built without distributed has no FSDP2 either)
        return
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _say(d: Dist, c: TrainConfig, msg: str, bar=None) -> None:
    if d.main and c.verbose:
        if bar is not None:
            bar.write(msg)
        else:
            print(msg, flush=True)


# ------------------------------------------------------------------------------------------------
def train(config: TrainConfig) -> dict:
    """Run one training run (and its ``--compare bf16`` baseline); returns the JSON summary dict."""
    c = config.resolved()
    summary = _train_one(c)
    if c.compare == "bf16" and c.recipe != "bf16" and not summary.get("stopped_early"):
        base = TrainConfig(**{**asdict(c), "recipe": "bf16", "compare": None, "fp8_all_gather": False,
                              "resume": None, "overwrite": True,
                              "out_dir": os.path.join(c.out_dir, "compare-bf16"), "fault_steps": ()})
        b = _train_one(base.resolved())
        summary["compare"] = {"bf16": b}
        if b.get("final_val_loss") and summary.get("final_val_loss") is not None:
            summary["val_loss_gap_pct"] = 100.0 * (summary["final_val_loss"]
                                                   - b["final_val_loss"]) / b["final_val_loss"]
    return summary


def _attention_choice(c: TrainConfig) -> AttentionChoice:
    """The model's attention from ``attention`` / ``attn_qk`` / ``attn_pv`` (a ValueError naming the bad one)."""
    return AttentionChoice(c.attention, c.attn_qk, c.attn_pv)


def _build(c: TrainConfig, d: Dist):
    mcfg = config_from_preset(c.model, max_seq_len=max(c.seq_len, config_from_preset(c.model).max_seq_len),
                              mlp=c.mlp, pos=c.pos, norm=c.norm, tie_weights=c.tie_weights)
    torch.manual_seed(c.seed)
    model = GPT(mcfg, attention=_attention_choice(c)).to(d.device)
    return mcfg, model


def _wrap(model, c: TrainConfig, d: Dist, use_graph: bool = False):
    """The model as the step runs it: compiled blocks, FSDP2's shards, torch DDP, or (DDP under CUDA graphs) the bare
    model with rank 0's weights, its gradients averaged by :class:`~lowbit.train.grad_sync.GradAllReduce` inside the
    captured step."""
    if c.compile:
        for blk in model.blocks:  # (before fully_shard, as torchtitan does: FSDP2's hooks stay outside the graph)
            blk.compile(**({} if c.compile_mode == "default" else {"mode": c.compile_mode}))
    if not d.active:
        return model
    if c.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # the mesh on the run's device type: FSDP2's default mesh takes CUDA wherever it is present, and a CPU (gloo)
        # run on a GPU machine then failed in set_device (or ran ranks on one GPU)
        mesh = init_device_mesh(d.device.type, (d.world,))
        if c.fp8_all_gather:  # (before fully_shard: the weights become the tensors whose all-gather moves FP8)
            import lowbit.nn as lnn

            plan = lnn.fp8_all_gather(model, _recipes.from_name(c.recipe), mesh)
            n_hp = sum(v is not None for v in plan.values())
            _say(d, c, f"[lowbit] --fp8-all-gather: {len(plan) - n_hp} weights gather in FP8, {n_hp} in FP32")
        if c.bf16_all_gather:  # (before fully_shard, as above)
            import lowbit.nn as lnn

            plan = lnn.bf16_all_gather(model)
            n_hp = sum(v is not None for v in plan.values())
            _say(d, c, f"[lowbit] --bf16-all-gather: {len(plan) - n_hp} weights gather in BF16, {n_hp} in FP32")
        mp = {}
        if c.grad_reduce_dtype != "float32":
            from torch.distributed.fsdp import MixedPrecisionPolicy

            mp["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=getattr(torch, c.grad_reduce_dtype))
            if c.grad_accum > 1:
                _say(d, c, f"[lowbit] --grad-reduce-dtype {c.grad_reduce_dtype}: FSDP2 accumulates the "
                           f"{c.grad_accum} micro-batches' gradients in it too")
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh, reshard_after_forward=c.fsdp_reshard_after_forward, **mp)
        fully_shard(model, mesh=mesh, **mp)
        # each block's post-backward waits for its weight gradients on the captured step's side stream
        from lowbit.nn.functional import fsdp_wgrad_joins

        fsdp_wgrad_joins(model)
        return model
    if use_graph:
        from .grad_sync import broadcast_parameters

        broadcast_parameters(model, d.group)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, device_ids=[d.device.index] if d.device.type == "cuda" else None)
    if c.grad_reduce_dtype == "bfloat16":
        from .grad_sync import bf16_average_hook

        ddp.register_comm_hook(d.group, bf16_average_hook)
    return ddp


def _optimizer(model, c: TrainConfig):
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": c.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if next(model.parameters()).device.type != "cuda":
        return torch.optim.AdamW(groups, lr=c.lr, betas=(c.beta1, c.beta2), eps=1e-8)
    cls = torch.optim.AdamW
    if env.fused("adamw_quant"):
        # torch's fused AdamW, whose step also writes the FP8 copies of the 128x128 blockwise weights (fp8-block)
        # that the next forward would otherwise quantize (under --fp8-all-gather: each shard's, which FSDP2 gathers);
        # any other recipe: torch's step unchanged
        from lowbit.optim import AdamW as cls
    return cls(groups, lr=c.lr, betas=(c.beta1, c.beta2), eps=1e-8, fused=True)


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
"""The ``torch.compile`` modes ``TrainConfig.compile_mode`` takes."""

FP8_ALL_GATHER_RECIPES = ("fp8-block", "fp8-current", "fp8-delayed")
"""The recipes whose weight copies FSDP2 can all-gather in FP8 (``TrainConfig.fp8_all_gather``)."""
GRAD_REDUCE_DTYPES = ("float32", "bfloat16")
"""The dtypes the gradients can be averaged across ranks in (``TrainConfig.grad_reduce_dtype``)."""

GRAPH_RECIPES = tuple(n for n in RECIPES if _recipes.NAMES[n] is None or not _recipes.from_name(n).delayed)
"""The recipes a step can be captured under: delayed scaling keeps per-step host state."""


NCCL_CAPTURE = (2, 9, 6)
"""The NCCL that CUDA graphs can capture collectives with (DDP's all-reduces, FSDP2's all-gathers and reduce-scatters
inside ``lowbit train``'s graphs)."""


def _nccl_version() -> tuple:
    """This torch's NCCL (major, minor, patch), or () without one."""
    try:
        return tuple(int(v) for v in torch.cuda.nccl.version()[:3])
    except Exception:  # noqa: BLE001 - a build without NCCL
        return ()


def _graph_decision(c: TrainConfig, d: Dist) -> tuple[bool, str]:
    """(use CUDA graphs, why not) for this run."""
    if c.cuda_graph == "off":
        return False, "--cuda-graph off"
    if c.compile:
        return False, "--compile (torch.compile'd blocks)"
    why = None
    if d.device.type != "cuda":
        why = "not on CUDA"
    elif d.active and _nccl_version() < NCCL_CAPTURE:
        what = "FSDP2 needs" if c.fsdp else "DDP needs"
        why = (f"{what} NCCL >= {'.'.join(map(str, NCCL_CAPTURE))} to capture its collectives, this torch has "
               f"{'.'.join(map(str, _nccl_version())) or 'none'}")
    elif c.recipe not in GRAPH_RECIPES:
        why = f"recipe {c.recipe!r} keeps per-step host state (graph-safe: {', '.join(GRAPH_RECIPES)})"
    if why is not None and c.cuda_graph == "on":
        raise ValueError(f"cuda_graph: 'on' but CUDA graphs cannot be used here: {why}")
    return why is None, why or ""


class _Phases:
    """Host wall time per phase of a training step, averaged over the steps after the first (diagnostic:
    ``TrainConfig.step_phases``); where the host waits on the GPU the phase is named "wait ..."."""

    def __init__(self, on: bool):
        self.on, self.n, self.t, self.acc = on, -1, 0.0, {}
        self.events: list = []  # (name, CUDA event) of this step: GPU time between consecutive ones

    def start(self, t0: float) -> None:
        if self.on:
            self.n += 1
            self.t = t0

    def gpu_mark(self, name: str) -> None:
        """Record a CUDA event; the GPU time from the previous mark to this one is reported as "gpu <name>"."""
        if self.on and self.n > 0:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.events.append((name, ev))

    def end_step(self) -> None:
        """After the step's synchronize: add up the GPU intervals of its marks."""
        for (_, a), (name, b) in zip(self.events, self.events[1:]):
            self.acc["gpu " + name] = self.acc.get("gpu " + name, 0.0) + a.elapsed_time(b) / 1e3
        self.events = []

    def mark(self, name: str) -> None:
        if self.on and self.n > 0:
            now = time.perf_counter()
            self.acc[name] = self.acc.get(name, 0.0) + now - self.t
            self.t = now
        elif self.on:
            self.t = time.perf_counter()

    def report(self, say) -> None:
        if self.on and self.n > 0:
            parts = ", ".join(f"{k} {1e3 * v / self.n:.2f}" for k, v in self.acc.items())
            say(f"[lowbit] step phases (ms, mean of {self.n} steps): {parts}")


def _amax_arena(device):
    """An AmaxArena for the forward+backward graph, or None where the Triton quantizers are not in use. 4,096 slots:
    a 1.3b GPT step takes 288."""
    try:
        from lowbit.runtime.amax_arena import AmaxArena
    except ImportError:  # no Triton: the reference quantizers allocate their own amaxes
        return None
    return AmaxArena(4096, device)


class _GraphedStep:
    """The micro-batch loop of one step (forwards + backwards into ``.grad``) captured as one CUDA graph, and,
    once the optimizer has state, the update (gradient clipping + the fused AdamW step) as a second graph.

    Inputs are copied into static buffers before each replay; gradients live in the graph's memory and
    are rewritten by every replay (so they are never set to None between steps). The loss read and the
    NaN checks stay on the host. The update graph replays right behind the first (the GPU never waits for
    the host between them) and decides on the device whether to skip the step: the fused AdamW kernel's
    ``found_inf`` is set when the loss, a recorded amax or the gradient norm is non-finite: the steps the eager
    loop skips (a non-finite norm alone is reported as the event ``gradients/grad_norm``). Clipping passes
    ``1 / min(1, max_norm / (norm + 1e-6))`` as the kernel's ``grad_scale`` (it divides the gradients by it)
    instead of a separate pass multiplying every gradient: the same clipped gradient to one rounding. The learning rate
    becomes a device tensor the loop refills each step.

    With several ranks (``group`` given) ``run_micro`` sums the loss across them inside the first graph and makes
    the gradients every rank's: DDP averages them (:class:`~lowbit.train.grad_sync.GradAllReduce`), FSDP2's own
    hooks all-gather each block's weights and reduce-scatter its gradients as they run (captured with the step on
    FSDP2's streams, which the graph keeps as parallel branches). The update graph agrees on the skip by an
    all-reduce MAX: every rank replays the same collectives. The weight gradients run on a side stream
    (:class:`lowbit.nn.functional.wgrad_on_side_stream`), where nothing reads a gradient before the backward ends
    but hooks that wait for that stream (DDP's all-reduce; FSDP2's post-backward, after
    :func:`lowbit.nn.functional.fsdp_wgrad_joins`).
    """

    def __init__(self, run_micro, n_micro: int, batch: int, seq_len: int, params: list, device,
                 quantized: bool = True, prime=None, group=None):
        self.run_micro = run_micro
        self.group = group  # several ranks: the update graph's skip decision is agreed across it
        # (several ranks: the process group's watchdog thread queries CUDA events while this thread captures;
        # "global" capture mode would fail those queries)
        self.capture_mode = "thread_local" if group is not None else "global"
        self.prime = prime  # called between the warm-up and the capture (lowbit.optim.AdamW.refresh_weight_copies)
        self.quantized = quantized  # the step quantizes (a recipe is active): its graph gets an amax arena
        self.params = params
        self.xs = torch.zeros(n_micro, batch, seq_len, dtype=torch.int64, device=device)
        self.ys = torch.zeros_like(self.xs)
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.graph = None
        self.update = None  # the update graph
        self.arena = None  # the AmaxArena the graph's quantize launches took their amax slots from (kept alive with it)
        self.primed = 0  # weights whose optimizer-written FP8 copies the captured forward reads
        self.opt = None
        self.lr = None  # (), float32: the learning rate the captured update reads
        self.skip = None  # (), float32: 1.0 where the last replayed update skipped the step
        self.device = device

    def load(self, m: int, x: torch.Tensor, y: torch.Tensor) -> None:
        self.xs[m].copy_(x, non_blocking=True)
        self.ys[m].copy_(y, non_blocking=True)

    def capture(self, warmup: int = 2) -> None:
        import lowbit.nn as lnn

        # Warm-up on a side stream (autotuning, plan caches, cuBLAS workspaces) as torch.cuda.graph asks.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self.run_micro(self.xs, self.ys, self.loss_sum)
                for p in self.params:
                    p.grad = None
        torch.cuda.current_stream(self.device).wait_stream(side)
        lnn.nonfinite_events()  # warm-up passes on this step's batch: the replay reports its own faults
        lnn.state.clear_captured()
        if self.prime is not None:
            # the warm-up forwards recorded which weights the optimizer writes the FP8 copies of: write them now, so
            # the captured forward reads those buffers (rewritten by every update) instead of quantizing
            self.primed = self.prime()
        g = torch.cuda.CUDAGraph()
        arena = _amax_arena(self.device) if self.quantized else None
        # the weight gradients as a parallel branch of the graph (nn.functional.wgrad_on_side_stream: the gradients
        # are None at capture; what reads them waits for that stream: DDP's all-reduce, FSDP2's post-backward)
        from lowbit.nn.functional import wgrad_on_side_stream

        side = wgrad_on_side_stream()
        with torch.cuda.graph(g, capture_error_mode=self.capture_mode), side:
            if arena is None:
                self.run_micro(self.xs, self.ys, self.loss_sum)
            else:
                # the blockwise quantizers' amax accumulators: one fill a replay instead of one a launch
                from lowbit.runtime.amax_arena import amax_arena

                arena.reset()
                with amax_arena(arena):
                    self.run_micro(self.xs, self.ys, self.loss_sum)
        self.graph, self.arena = g, arena

    @staticmethod
    def update_capturable(opt) -> bool:
        """Whether ``opt`` can run inside the update graph: a fused AdamW (``_optimizer`` on CUDA) whose state
        exists (AdamW creates it in its first step, which therefore runs eagerly)."""
        if not isinstance(opt, torch.optim.AdamW) or not all(g.get("fused") for g in opt.param_groups):
            return False
        return all("exp_avg" in opt.state.get(p, {}) for g in opt.param_groups for p in g["params"])

    def capture_update(self, opt, grad_clip: float, lr: float) -> None:
        """Capture gradient clipping and ``opt.step()`` (see the class docstring); needs :meth:`capture` first and
        :meth:`update_capturable`. Nothing runs until :meth:`replay`."""
        import lowbit.nn as lnn

        self.lr = torch.full((), lr, dtype=torch.float32, device=self.device)
        for g in opt.param_groups:  # (drop() puts floats back; checkpoints store floats, see checkpoint.gather_state)
            g["lr"] = self.lr
            g["capturable"] = True
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode=self.capture_mode):
            bad = ~torch.isfinite(self.loss_sum)
            mx = lnn.state.captured_amax_max()  # (captured here: each replay reduces the replayed amaxes)
            if mx is not None:
                bad = bad | ~torch.isfinite(mx[0])
            scale = None
            if grad_clip > 0:
                norm = torch.nn.utils.get_total_norm([p.grad for p in self.params], 2.0, foreach=True)
                if hasattr(norm, "full_tensor"):  # (FSDP2's sharded gradients: the norm over every rank's shards)
                    norm = norm.full_tensor()
                bad = bad | ~torch.isfinite(norm)
                scale = 1.0 / torch.clamp(grad_clip / (norm + 1e-6), max=1.0)
            self.skip = distributed.any_rank_tensor(bad.float(), self.group)
            opt.grad_scale, opt.found_inf = scale, self.skip
            try:
                opt.step()
            finally:
                del opt.grad_scale, opt.found_inf
        self.update, self.opt = graph, opt

    def set_lr(self, lr: float) -> None:
        self.lr.fill_(lr)

    def replay(self, mark=None) -> torch.Tensor:
        """Replay the step; ``mark(name)`` (diagnostics) is called before, between and after the graphs."""
        mark = mark or (lambda name: None)
        mark("start")
        self.graph.replay()
        mark("forward+backward")
        if self.update is not None:
            self.update.replay()
            mark("update")
        return self.loss_sum

    def skipped(self) -> bool:
        """Whether the last replay's update graph skipped the optimizer step (reads the device flag)."""
        return self.update is not None and bool(self.skip)

    def drop(self) -> None:
        """Forget the graphs (the next step captures afresh) and the sentry's references into their memory pools."""
        import lowbit.nn as lnn

        self.graph = self.arena = None
        if self.update is not None:
            lr = float(self.lr)
            for g in self.opt.param_groups:
                if g["lr"] is self.lr:
                    g["lr"] = lr
                g["capturable"] = False
        self.update, self.opt, self.lr, self.skip = None, None, None, None
        lnn.state.clear_captured()


# Arguments that change the trajectory: a resumed run must use the same values.
# (The global batch must match, not its split into ranks x micro-batches: any world size may resume.)
_MATCH_ON_RESUME = ("recipe", "model", "steps", "global_batch", "seq_len", "lr", "min_lr_ratio", "warmup",
                    "weight_decay", "beta1", "beta2", "grad_clip", "seed", "mlp", "pos", "norm", "tie_weights")


class TrainInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) stopped a single-process run at the end of step ``step``; ``checkpoint``: the checkpoint
    written there (None where the run writes none)."""

    def __init__(self, step: int, checkpoint: str | None):
        super().__init__(f"interrupted after step {step}")
        self.step, self.checkpoint = step, checkpoint


class _StopRequest:
    """A SIGINT handler for one process (not under torchrun, only from the main thread, not where SIGINT is ignored):
    once the steps run (``armed``), Ctrl-C asks the loop to stop at the end of the current step; before that, or a
    second time, it interrupts at once (KeyboardInterrupt)."""

    def __init__(self):
        self.requested, self.armed, self.at_step, self.prev = False, False, None, None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread() or int(os.environ.get("WORLD_SIZE", "1")) > 1:
            return
        prev = signal.getsignal(signal.SIGINT)
        if prev in (signal.SIG_IGN, None):
            return
        self.prev = prev
        signal.signal(signal.SIGINT, self._handler)

    def _handler(self, signum, frame) -> None:
        if not self.armed or self.requested:
            raise KeyboardInterrupt
        self.requested = True  # (no printing here: it may interrupt a write to the same stream)

    def restore(self) -> None:
        if self.prev is not None:
            signal.signal(signal.SIGINT, self.prev)
            self.prev = None


def _train_one(c: TrainConfig) -> dict:
    """One run: holds the out-dir's writer lock (rank 0, where the run writes checkpoints) and, in one process, the
    Ctrl-C handler, around :func:`_train_run`."""
    lock = None
    if (c.ckpt_every or c.save_final) and int(os.environ.get("RANK", "0")) == 0:
        check_writable_dir(c.out_dir, "out_dir")
        lock = ckpt.lock_out_dir(c.out_dir)
    stop = _StopRequest()
    try:
        stop.install()
        with deterministic_mode(c.deterministic):
            return _train_run(c, stop)
    finally:
        stop.restore()
        if lock is not None:
            lock.release()


CUBLAS_DETERMINISTIC = ":4096:8"
"""The ``CUBLAS_WORKSPACE_CONFIG`` :func:`deterministic_mode` sets where none is (cuBLAS's reproducible setting)."""


@contextlib.contextmanager
def deterministic_mode(on: bool = True):
    """Within the block (``on``): ``torch.use_deterministic_algorithms(True)``, ``torch.backends.cudnn.deterministic``
    without ``benchmark``, lowbit's ``LOWBIT_AUTOTUNE`` off and ``CUBLAS_WORKSPACE_CONFIG`` set where it is not; every
    one restored after (``TrainConfig.deterministic``). ``on=False``: nothing changes."""
    if not on:
        yield
        return
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    set_env = "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    if set_env:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        with env.override(LOWBIT_AUTOTUNE=False):
            yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]
        if set_env:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def _train_run(c: TrainConfig, stop: _StopRequest) -> dict:
    import lowbit.nn as lnn
    import lowbit.recipes as lrec

    recipe = lrec.from_name(c.recipe)
    d = setup_distributed(c.device)
    fsdp = c.fsdp and d.active  # (FSDP2 shards only across several processes)
    if c.fsdp and not d.active:
        _say(d, c, "[lowbit] --fsdp: a single process has nothing to shard; running unsharded")
    if c.grad_reduce_dtype != "float32" and not d.active:
        _say(d, c, "[lowbit] --grad-reduce-dtype: a single process averages no gradients across ranks")
    if c.bf16_all_gather and not computes_in_bf16(c.dtype, d.device):
        raise ValueError(f"bf16_all_gather: True needs the BF16 compute dtype; dtype={c.dtype!r} computes in FP32 on "
                         f"{d.device.type} (pass dtype='bf16')")
    _attention_choice(c)  # (a bad choice fails here, before any work)
    if c.ckpt_every or c.save_final:  # fail now, not after the run, when the checkpoint cannot be written
        check_writable_dir(c.out_dir, "out_dir")
    corpus = load_corpus(c.data, c.cache_dir, verbose=c.verbose and d.main)
    corpus.check_seq_len(c.seq_len)
    mcfg, raw = _build(c, d)
    check_divisible(c.recipe, recipe, {"seq_len x batch_size (tokens per micro-batch)": c.seq_len * c.batch_size,
                                       "d_model": mcfg.d_model, "ffn_hidden": mcfg.ffn_hidden})
    use_graph, no_graph_why = _graph_decision(c, d)
    model = _wrap(raw, c, d, use_graph)
    opt = _optimizer(model, c)
    out = Path(c.out_dir)
    ck_path = out / "checkpoint.pt"
    use_bf16 = computes_in_bf16(c.dtype, d.device)
    amp, lowbit_ctx = forward_contexts(recipe, d.device, use_bf16, cache_enabled=not use_graph,
                                       group=d.group if d.active else None,
                                       on_nonfinite="raise" if c.on_nonfinite == "raise" else "skip")

    rows_per_rank = c.batch_size * c.grad_accum
    global_batch = rows_per_rank * d.world
    tokens_per_step = global_batch * c.seq_len

    def train_state() -> dict:
        return {k: global_batch if k == "global_batch" else getattr(c, k) for k in _MATCH_ON_RESUME}

    history = {"train": [], "val": [], "lr": []}
    events: list[dict] = []
    if recipe is not None:  # (what code before this run left to the NaN sentry, a run that raised, is not this run's)
        lnn.nonfinite_events()
    start = 0
    own_ckpt = [bool(c.resume)]  # rollback only to a checkpoint of this run (not one --overwrite replaces)
    if (not c.resume and not c.overwrite and (c.ckpt_every or c.save_final)
            and (ck_path.exists() or ckpt.previous_checkpoints(ck_path))):
        raise ValueError(f"out_dir: {str(out)!r} already holds a checkpoint ({ck_path.name}); pass --resume "
                         "to continue "
                         "that run, --overwrite to replace it, or another --out-dir")
    # every field checked before use: the step within this run's, and ``train`` holding every argument compared below
    read_kw = dict(max_step=c.steps, train_keys=_MATCH_ON_RESUME, warn=lambda msg: _say(d, c, msg))
    if c.resume:
        if c.resume == "auto":  # the newest good one of the out-dir's kept checkpoints
            ck, path, skipped = ckpt.read_good_checkpoint(ck_path, **read_kw)
            if skipped:
                _say(d, c, f"[lowbit] resume: skipped {' | '.join(skipped)}; using {path} (step {ck['step']})")
        else:  # a file the user named: never swapped for another; a bad one's error names a good older kept one
            path = Path(c.resume)
            ck = ckpt.read_named_checkpoint(path, **read_kw)
        if ck["model_config"] != mcfg.to_dict():
            diff = {k: (ck["model_config"].get(k), v) for k, v in mcfg.to_dict().items()
                    if ck["model_config"].get(k) != v}
            raise ValueError(f"resume: checkpoint {str(path)!r} was saved for a different model shape "
                             f"(field: (checkpoint, this run)) {diff}")
        saved = ck["train"]  # (validated: a dict holding every key of _MATCH_ON_RESUME)
        now = train_state()
        diff = {k: (saved[k], now[k]) for k in _MATCH_ON_RESUME if saved[k] != now[k]}
        if diff:
            raise ValueError(f"resume: these arguments differ from the checkpointed run (checkpoint, now): {diff}; "
                             "pass the same values or start a new --out-dir")
        ckpt.apply_state(model, opt, ck["model"], ck["optimizer"])
        start = int(ck["step"])
        history = {k: [list(x) if isinstance(x, (list, tuple)) else x for x in v]
                   for k, v in ck.get("history", history).items()}
        events = list(ck.get("events", []))
        _say(d, c, f"[lowbit] resumed from {path} at step {start}")
        del ck

    val_off = corpus.val_offsets(c.eval_windows, c.seq_len)

    def save(step: int):
        msd, osd = ckpt.gather_state(model, opt)
        if d.main:
            ckpt.save_checkpoint(ck_path, {
                "step": step, "model_config": mcfg.to_dict(), "recipe": c.recipe,
                "model": msd, "optimizer": osd,
                "train": train_state(),
                "history": history, "events": events, "world_size": d.world,
            }, keep=c.keep_checkpoints, fresh=not own_ckpt[0])  # (fresh: drop an earlier run's kept ones)
        own_ckpt[0] = True
        if d.active:
            torch.distributed.barrier()

    def evaluate() -> float:
        if fault_poison is not None:  # (the last step's fault is not the validation's)
            fault_poison.zero_()
        vl = validation_loss(model, corpus, val_off, c.seq_len, c.batch_size, d, amp, lowbit_ctx)
        if recipe is not None:
            lnn.nonfinite_events()  # evaluation faults are not training events
        return vl

    bar = None
    if d.main and c.progress:
        from .progress import Progress  # a tqdm bar on a terminal (when installed), else log lines

        bar = Progress(total=c.steps, initial=start, desc=f"{c.model}/{c.recipe}")
    _say(d, c, f"[lowbit] train {c.model} ({raw.num_params() / 1e6:.2f}M non-embedding params) recipe={c.recipe} "
               f"device={d.device} world={d.world}{' fsdp' if fsdp else ''} "
               f"attention={raw.attention.runs} "
               f"tokens/step={tokens_per_step} steps={start}->{c.steps}", bar)

    # the weights quantized once a step and reused by its later micro-batches (is_first_microbatch); not under
    # FSDP2, which gathers every weight afresh for each micro-batch
    reuse_weights = c.grad_accum > 1 and not fsdp

    def micro_step(x, y, m: int) -> torch.Tensor:
        """Forward and backward of micro-batch ``m`` (gradients accumulate); returns its loss (float64, detached)."""
        if c.compile_mode == "reduce-overhead":  # (torch's graphs may overwrite the last replay's outputs from here)
            torch.compiler.cudagraph_mark_step_begin()
        with amp(), lowbit_ctx():
            _, loss = model(x, y, is_first_microbatch=(m == 0) if reuse_weights else None)
        (loss / c.grad_accum).backward()
        return loss.detach().double()

    # DDP under CUDA graphs: each gradient averaged across ranks as the last micro-batch's backward makes it, the
    # loss summed, all inside the captured step (grad_sync.GradAllReduce); FSDP2 under CUDA graphs: its hooks'
    # all-gathers and reduce-scatters captured as they run, the loss summed at the end
    reducer = None
    if use_graph and d.active and not fsdp:
        from .grad_sync import GradAllReduce

        reducer = GradAllReduce(list(model.parameters()), d.group, reduce_dtype=getattr(torch, c.grad_reduce_dtype))

    def run_micro(xs, ys, loss_sum):
        """The graph's body: every micro-batch's forward and backward from the static inputs (with several ranks,
        the gradients averaged (DDP) or reduce-scattered (FSDP2), and the loss summed across them)."""
        loss_sum.zero_()
        for m in range(c.grad_accum):
            if reducer is not None and m == c.grad_accum - 1:
                reducer.arm()
            if fsdp:  # (the earlier micro-batches accumulate unsharded gradients; the last one reduce-scatters)
                model.set_requires_gradient_sync(m == c.grad_accum - 1)
            loss_sum += micro_step(xs[m], ys[m], m)
        if reducer is not None:
            reducer.finish(loss_sum)
        elif fsdp:
            _all_sum(loss_sum, d)

    graphed = None
    if use_graph:
        graphed = _GraphedStep(run_micro, c.grad_accum, c.batch_size, c.seq_len,
                               [p for p in model.parameters() if p.requires_grad], d.device,
                               quantized=recipe is not None,
                               prime=getattr(opt, "refresh_weight_copies", None) if recipe is not None else None,
                               group=d.group if d.active else None)
    _say(d, c,
         f"[lowbit] CUDA graphs: {'on (captured at the first step)' if use_graph else 'off (' + no_graph_why + ')'}"
         + (" with the gradient all-reduce inside" if reducer is not None else "")
         + (" with FSDP2's all-gathers and reduce-scatters inside" if use_graph and fsdp else ""),
         bar)

    # (testing) --fault-steps: the first block's input plus a device scalar, inf at those steps and 0 elsewhere
    # (adding 0 changes no value), so a captured graph injects the fault too: launch() refills it before each step
    fault_poison = None
    if c.fault_steps:
        fault_poison = torch.zeros((), dtype=torch.float32, device=d.device)
        raw.blocks[0].register_forward_pre_hook(lambda module, args: (args[0] + fault_poison,) + tuple(args[1:]))

    _reset_peak(d.device)
    timed_tokens, timed_s = 0, 0.0
    last_train_loss = float("nan")
    stopped_early = False
    step = start
    phases = _Phases(c.step_phases)
    sprof = StepProfiler(c.step_profile, start, c.steps, d.device)
    if sprof.skipped:
        _say(d, c, f"[lowbit] step profile skipped: {sprof.skipped}", bar)
    profile_dir = c.profile_graphs  # (diagnostic: graph_profile.profile_step, 4th step)
    prefetched: dict = {}  # step -> its micro-batches on the device (batches are keyed by (seed, step) only)
    # One step ahead: a replayed step whose update runs on the device (the skip decided there) is finished on the
    # host (loss read, sentry events, reporting) only after the next step has been launched, so the GPU runs the
    # next step while the host reads the last one's results instead of idling for the host's turnaround. Only where
    # that changes nothing but the time: --on-nonfinite skip (rollback and raise act before the next step), never
    # across a validation, a checkpoint or the end of the run. The step's loss and skip flag reach the host by
    # non-blocking copies into pinned slots, waited for by an event: reading a device tensor (.item()) would wait for
    # everything queued on the stream, the next step included, and the lookahead would gain
    # nothing. TrainConfig.lookahead=False turns it off; the step-phase and profile diagnostics run without it.
    lookahead = (graphed is not None and c.on_nonfinite == "skip" and not phases.on and not profile_dir
                 and c.lookahead)
    # The eager step (DDP, FSDP2, one process without graphs) the same way: its skip decided on the device from the
    # all-reduced loss, the sentry's max of the step's amaxes (lowbit.nn.state.take_checks) and the clipped gradient
    # norm, agreed across ranks by one all-reduce MAX and passed to the fused AdamW as found_inf (decide()); the
    # loss, the flag and the norm's finiteness reach the host through a pinned slot, the events through the taken
    # checks, read one step later. Every collective and kernel of the synchronous step runs in the same order on the
    # same values: the same bits.
    eager_ahead = graphed is None and c.on_nonfinite == "skip" and not phases.on and c.lookahead
    # (allocating pinned memory synchronizes the device: the slots are made once; two, as two steps are in flight)
    host_slots = ([torch.zeros(3, dtype=torch.float64, pin_memory=True) for _ in range(2)]
                  if (lookahead or eager_ahead) and d.device.type == "cuda" else None)
    t_mark = [time.perf_counter()]  # where the next step's wall time starts: the last step's end, after its eval/save

    def boundary(done: int) -> bool:
        """Whether the host acts on the model after step ``done`` (validation, checkpoint, stop, the end)."""
        return (done % c.eval_every == 0 or done >= c.steps or bool(c.ckpt_every and done % c.ckpt_every == 0)
                or (c.stop_at_step is not None and done >= c.stop_at_step) or stop.requested)

    def graph_batches(step: int) -> list:
        r0 = d.rank * rows_per_rank
        return [corpus.train_batch(c.seed, step, slice(r0 + m * c.batch_size, r0 + (m + 1) * c.batch_size),
                                   global_batch, c.seq_len, d.device) for m in range(c.grad_accum)]

    def to_host(step: int, *vals: torch.Tensor) -> tuple:
        """Send step ``step``'s device scalars ``vals`` to the host without waiting: on CUDA copied (float64) into its
        pinned slot behind an event, read by :func:`read_host` once the copy is done, not the work queued after it."""
        vals = torch.stack(vals).double()
        if host_slots is None:  # (the CPU: reading waits for nothing)
            return vals, None
        slot = host_slots[step % 2][:len(vals)]
        slot.copy_(vals, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return slot, ready

    def read_host(sent: tuple) -> list[float]:
        """The values :func:`to_host` sent (waits for their copy alone)."""
        vals, ready = sent
        if ready is not None:
            ready.synchronize()
        return vals.tolist()

    def decide(step: int, loss_sum: torch.Tensor) -> dict:
        """The end of an eager step on the device (``eager_ahead``): the loss reduced, the gradients clipped, the skip
        agreed across ranks and the update run or skipped by the fused AdamW, nothing read on the host; returns what
        finish() reads (the taken sentry checks; (loss sum, skip, norm non-finite) sent by :func:`to_host`)."""
        checks = lnn.state.take_checks() if recipe is not None else None
        loss_sum = _all_sum(loss_sum, d)
        bad = ~torch.isfinite(loss_sum)
        if checks is not None and checks.amax_max is not None:
            bad = bad | ~torch.isfinite(checks.amax_max[0])
        norm_bad = torch.zeros((), dtype=torch.bool, device=d.device)
        if c.grad_clip > 0:  # (the norm and the clipping scale stay on the device: error_if_nonfinite is off)
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip)
            total = total.full_tensor() if hasattr(total, "full_tensor") else total
            norm_bad = ~torch.isfinite(total)
        skip = distributed.any_rank_tensor((bad | norm_bad).float(), d.group if d.active else None)
        if all(g.get("fused") for g in opt.param_groups):
            opt.found_inf = skip
            try:
                opt.step()
            finally:
                del opt.found_inf
        elif not bool(skip):  # (an unfused AdamW, the CPU's, takes no found_inf: a CPU tensor's read waits for nothing)
            opt.step()
        opt.zero_grad(set_to_none=True)
        return {"checks": checks, "host": to_host(step, loss_sum, skip, norm_bad)}

    def launch(step: int) -> dict:
        """Queue step ``step``'s work: the graphs' replay (or the eager micro-batches, which run as they go, and with
        ``eager_ahead`` the update)."""
        sprof.begin(step)
        phases.start(time.perf_counter())
        lr = lr_at(step, c)
        if graphed is not None and graphed.update is not None:
            graphed.set_lr(lr)
        else:
            for g in opt.param_groups:
                g["lr"] = lr
        step_key = c.seed * 1_000_003 + step * 1009 + d.rank
        torch.manual_seed(step_key)  # stochastic rounding etc.: keyed by step
        if fault_poison is not None:
            fault_poison.fill_(float("inf") if step in c.fault_steps else 0.0)
        skip = host = decided = None
        try:
            if graphed is not None:
                batches = prefetched.pop(step, None) or graph_batches(step)
                for m, (x, y) in enumerate(batches):
                    graphed.load(m, x, y)
                if graphed.graph is None:
                    try:
                        graphed.capture()
                    except RuntimeError as e:  # (CUDA errors included; not running out of memory)
                        if isinstance(e, torch.OutOfMemoryError):
                            raise
                        raise RuntimeError(
                            f"CUDA-graph capture of the {('FSDP2 ' if fsdp else 'DDP ') if d.active else ''}training "
                            f"step failed: {e}. Run with --cuda-graph off to train eagerly"
                            + (" (torch's DDP)" if d.active and not fsdp else "")) from e
                    if graphed.arena is not None and step == start and graphed.arena.used + graphed.arena.missed:
                        a = graphed.arena
                        _say(d, c,
                             f"[lowbit] CUDA graph captured: {a.used} quantize amax accumulators zeroed by one fill"
                                   + (f" ({a.missed} launches found the arena full)" if a.missed else "")
                                   + (f"; {graphed.primed} weights' FP8 copies written by the optimizer"
                                      if graphed.primed else ""),
                             bar)
                    # warm-up and capture drew random numbers: re-key, so the replay (which reads the CUDA
                    # generator's seed and offset when it starts) draws what an eager step would
                    torch.manual_seed(step_key)
                phases.mark("data+launch")
                if profile_dir and graphed.update is not None and step == start + 3:
                    # (diagnostic) this step's replay, one graph at a time under the profiler: same work, same order
                    from .graph_profile import profile_step

                    profile_step(graphed, os.path.join(profile_dir, c.recipe), lambda msg: _say(d, c, msg, bar))
                    loss_sum = graphed.loss_sum.clone()
                else:
                    loss_sum = graphed.replay(phases.gpu_mark).clone()
                if graphed.update is not None:
                    skip = graphed.skip
                    if lookahead:  # the values this step reads on the host, copied out before the next replay
                        host = to_host(step, loss_sum, skip)
                if step + 1 < c.steps:  # the next step's batch, read and copied while the GPU runs this one
                    prefetched[step + 1] = graph_batches(step + 1)
                phases.mark("replay launch")
            else:
                loss_sum = torch.zeros((), dtype=torch.float64, device=d.device)
                for m in range(c.grad_accum):
                    r0 = d.rank * rows_per_rank + m * c.batch_size
                    x, y = corpus.train_batch(c.seed, step, slice(r0, r0 + c.batch_size), global_batch, c.seq_len,
                                              d.device)
                    sync = contextlib.nullcontext()
                    if d.active and not fsdp and m < c.grad_accum - 1:
                        sync = model.no_sync()
                    elif fsdp:
                        model.set_requires_gradient_sync(m == c.grad_accum - 1)
                    with sync:
                        loss_sum += micro_step(x, y, m)
                if eager_ahead:
                    decided = decide(step, loss_sum)
        except lnn.NonFiniteAmaxError as e:  # --on-nonfinite raise
            raise FloatingPointError(f"step {step}: {e}") from e
        # skip / decided: the update graph / the eager update ran (or skipped the step) on the device
        updated = skip is not None or decided is not None
        # (a profiled step, and the one before it, is waited for: its time is its own)
        ahead = ((host is not None or decided is not None) and not boundary(step + 1) and not sprof.covers(step)
                 and not sprof.covers(step + 1))
        return {"step": step, "lr": lr, "loss_sum": loss_sum, "skip": skip, "updated": updated, "host": host,
                "decided": decided, "ahead": ahead}

    def queue_check(rec: dict) -> None:
        """Queue the sentry's check of the amaxes the replay of ``rec`` wrote, behind it (and before the next replay
        rewrites them); after the last step's finish(), whose nonfinite_events() waits for every queued check."""
        if graphed is not None and recipe is not None:
            lnn.state.check_captured(wait=False)

    def finish(rec: dict) -> bool:
        """The host's part of a launched step: wait for it, read its loss and faults, skip / roll back / update
        (eagerly where the update is not a graph), report, validate, checkpoint. True: stop the run here."""
        nonlocal timed_tokens, timed_s, last_train_loss
        step, lr, loss_sum, updated, dec = rec["step"], rec["lr"], rec["loss_sum"], rec["updated"], rec["decided"]
        if dec is not None:  # the eager step decided on the device: its values (waits for this step only)
            found = dec["checks"].events() if dec["checks"] is not None else []
            loss_total, skip_flag, norm_flag = read_host(dec["host"])
            step_loss = loss_total / (c.grad_accum * d.world)
            grads_bad = not found and math.isfinite(step_loss) and norm_flag > 0
            bad = skip_flag > 0
        else:
            found = lnn.nonfinite_events() if recipe is not None else []  # (waits; reports, never raises)
            phases.mark("wait fwd+bwd (nonfinite check)")
            # (a graphed step has summed its loss across ranks already)
            if rec["host"] is not None:  # this step's values, not the queue's end
                loss_total, skip_flag = read_host(rec["host"])
                step_loss, skipped = loss_total / (c.grad_accum * d.world), skip_flag > 0
            else:
                loss_sum = loss_sum if graphed is not None else _all_sum(loss_sum, d)
                step_loss = float(loss_sum) / (c.grad_accum * d.world)
                skipped = updated and bool(rec["skip"])
            grads_bad = False  # a non-finite gradient norm where the loss and the amaxes are finite
            if updated:
                grads_bad = not found and math.isfinite(step_loss) and skipped
            elif c.grad_clip > 0:  # every rank clips (a collective under FSDP2); a non-finite norm skips the step too
                total = torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip)
                total = total.full_tensor() if hasattr(total, "full_tensor") else total
                grads_bad = not found and math.isfinite(step_loss) and not math.isfinite(float(total))
                phases.mark("clip")
            if updated and d.active:  # the update graph agreed on the skip across ranks (no collective here: it
                bad = skipped  # would queue behind the next step's replay)
            else:
                bad = distributed.any_rank(bool(found) or not math.isfinite(step_loss) or grads_bad, d.group,
                                           d.device)
            phases.mark("loss read")
        if bad:
            # (a graph's gradients are rewritten by its next replay; decide() has dropped an eager update's)
            if graphed is None and dec is None:
                opt.zero_grad(set_to_none=True)
            where = ([{"layer": e.layer, "role": e.role} for e in found]
                     or [{"layer": "gradients", "role": "grad_norm"} if grads_bad else {"layer": "loss",
                                                                                        "role": "loss"}])
            action = c.on_nonfinite
            if action == "raise":
                raise FloatingPointError(f"step {step}: non-finite values in {where}")
            if action == "rollback":
                if own_ckpt[0] and (ck_path.exists() or ckpt.previous_checkpoints(ck_path)):
                    ck = ckpt.read_good_checkpoint(ck_path, **read_kw)[0]
                    ckpt.apply_state(model, opt, ck["model"], ck["optimizer"])
                    action = f"rollback to step {ck['step']}"
                    if graphed is not None:  # loading may re-create .grad tensors: capture afresh next step
                        graphed.drop()
                    del ck
                else:
                    action = "skip (no checkpoint to roll back to)"
            for w in where:
                events.append({"step": step, "action": action, **w, "loss": step_loss if math.isfinite(step_loss)
                               else str(step_loss)})
            _say(d, c,
                 f"[lowbit] step {step}: non-finite "
                 f"{', '.join(w['layer'] + '/' + w['role'] for w in where)} -> {action}", bar)
        else:
            if not updated:
                opt.step()
                phases.mark("optimizer launch")
            if step == start and getattr(opt, "fused_tensors", 0):  # (every step updates the same weights)
                _say(d, c,
                     f"[lowbit] optimizer: lowbit.optim.AdamW updates {opt.fused_tensors} weights and writes their "
                           "FP8 copies for the next forward in one kernel", bar)
            if not updated and graphed is not None and graphed.graph is not None and graphed.update_capturable(opt):
                # the optimizer has state now: capture the update graph here, in the (untimed) first step
                # (capturing synchronizes and collects garbage: tens of ms), replayed from the next step on
                graphed.capture_update(opt, c.grad_clip, lr)
            if graphed is None and dec is None:
                opt.zero_grad(set_to_none=True)
            last_train_loss = step_loss
            history["train"].append([step + 1, step_loss])
            history["lr"].append([step + 1, lr])
        if d.device.type == "cuda" and not rec["ahead"]:  # (ahead: the next step is queued behind this one)
            torch.cuda.synchronize(d.device)
        phases.mark("wait clip+optimizer")
        phases.end_step()
        sprof.end(step)
        now = time.perf_counter()
        dt, t_mark[0] = now - t_mark[0], now
        if step > start and not sprof.covers(step):  # the first step of a process includes warm-up / compilation
            timed_tokens += tokens_per_step
            timed_s += dt
        done = step + 1
        if bar is not None:
            tps = timed_tokens / timed_s if timed_s else tokens_per_step / dt
            bar.update(done, loss=f"{step_loss:.4f}", tok_s=f"{tps:,.0f}")
        if done % c.eval_every == 0 or done == c.steps:
            vl = evaluate()
            history["val"].append([done, vl])
            _say(d, c, f"[lowbit] step {done}: train loss {step_loss:.4f}  val loss {vl:.4f}", bar)
            t_mark[0] = time.perf_counter()
        saved = (c.ckpt_every and done % c.ckpt_every == 0) or (done == c.steps and c.save_final)
        if saved:
            save(done)
            t_mark[0] = time.perf_counter()
        # Ctrl-C: a checkpoint here (where the run writes any), then stop; not at a step finished behind the next one,
        # whose update is already queued (the first step launched after the request is not ahead: it stops there)
        if stop.requested and done < c.steps and not rec["ahead"]:
            if not saved and (c.ckpt_every or c.save_final):
                save(done)
            stop.at_step = done
            return True
        return c.stop_at_step is not None and done >= c.stop_at_step and done < c.steps

    pending = None  # a launched step finished after the next one is launched (lookahead)
    stop.armed = True
    for step in range(start, c.steps):
        rec = launch(step)
        if pending is not None:  # (never a boundary: nothing it does acts on the model)
            finish(pending)
            pending = None
        queue_check(rec)
        if rec["ahead"]:
            pending = rec
            continue
        if finish(rec):
            stopped_early = True
            break
    if pending is not None:  # (unreachable: the last step is a boundary; kept so no step goes unreported)
        finish(pending)
    if bar is not None:
        bar.close()
    phases.report(lambda msg: _say(d, c, msg))
    sprof.close()  # (where the run stopped inside the profiled steps)
    step_profile = sprof.gather(d.group if d.active else None)
    if step_profile is not None and step_profile["mean"] is not None:
        m = step_profile["mean"]
        _say(d, c, f"[lowbit] step profile (steps {step_profile['steps'][0]}-{step_profile['steps'][-1]}, "
                   f"mean of {d.world} rank(s)): wall {m['wall_ms']:.2f} ms = compute {m['compute_ms']:.2f}"
                   + (f" ({m['concurrent_ms']:.2f} of it concurrent)" if m.get("concurrent_ms") is not None else "")
                   + f" + exposed comm {m['exposed_comm_ms']:.2f} + host {m['host_ms']:.2f}; comm {m['comm_ms']:.2f} ms"
                   + (f", {m['overlap_pct']:.0f}% hidden" if m["overlap_pct"] is not None else "")
                   + "".join(f"; idle most between {k.replace(' | ', ' and ')}: {v[0]:.2f} ms"
                             for k, v in list(m.get("idle", {}).items())[:1]))
    if graphed is not None:
        graphed.drop()
    stop.armed = False
    if stop.at_step is not None:
        raise TrainInterrupted(stop.at_step, str(ck_path) if c.ckpt_every or c.save_final else None)
    peak, peak_kind = _peak(d.device)
    qbytes, bfbytes = quantized_weight_bytes(raw, recipe)
    summary = {
        "recipe": c.recipe, "model": c.model, "model_config": mcfg.to_dict(),
        "params": sum(p.numel() for p in raw.parameters()), "non_embedding_params": raw.num_params(),
        "steps": step + 1 if c.steps > start else start, "target_steps": c.steps, "stopped_early": stopped_early,
        "tokens_per_step": tokens_per_step, "seq_len": c.seq_len, "global_batch": global_batch,
        "final_train_loss": last_train_loss,
        "final_val_loss": history["val"][-1][1] if history["val"] else None,
        "tokens_per_s": (timed_tokens / timed_s) if timed_s else None,
        "peak_memory_bytes": peak, "peak_memory_kind": peak_kind,
        "weight_bytes_quantized": qbytes, "weight_bytes_bf16": bfbytes,
        "history": history, "events": events,
        "device": str(d.device) if d.device.type == "cpu" else torch.cuda.get_device_name(d.device),
        "world_size": d.world, "fsdp": fsdp,
        "fsdp_reshard_after_forward": c.fsdp_reshard_after_forward if fsdp else None,
        "grad_reduce_dtype": c.grad_reduce_dtype if d.active else None,
        "fp8_all_gather": bool(c.fp8_all_gather and fsdp),
        "bf16_all_gather": bool(c.bf16_all_gather and fsdp), "compile": c.compile, "deterministic": c.deterministic,
        "compile_mode": c.compile_mode,
        "attention": raw.attention.runs,
        "compute_dtype": "bf16" if use_bf16 else "fp32", "cuda_graph": use_graph, "step_profile": step_profile,
        "checkpoint": str(ck_path) if ck_path.exists() else None, "out_dir": str(out),
        "data": corpus.meta,
    }
    return summary
