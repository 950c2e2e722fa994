"""``lowbit bench prefill``: time to first token of a HuggingFace ``LlamaForCausalLM`` with lowbit's attention
(``attn_implementation`` through :mod:`lowbit.integrations.transformers`), with and without lowbit's FP8 linears,
against the same model on transformers' SDPA, in one run.

The call timed is the prefill ``generate()`` makes: ``model(input_ids, use_cache=True, logits_to_keep=1)`` under
``torch.inference_mode()``, one batch of ``--batch`` prompts of ``--seq-len`` random tokens, on a random-init BF16
model built from a fixed seed (nothing downloaded; Llama 3 shapes, GQA). Every variant builds its model afresh.

Variants (``--variants``, comma-separated; each ``[<recipe>[:fused][:cached]+]<attention>``):

* attention ``sdpa``: transformers' SDPA (torch picks cuDNN or flash); ``int8-fp8`` / ``int8-bf16``: lowbit's
  attention with INT8 Q·Kᵀ and FP8 / BF16 P·V (:func:`lowbit.integrations.transformers.use`);
* ``<recipe>+``: ``lowbit.convert(model)`` and the forward inside ``lowbit.autocast(recipe=<recipe>)`` (the linears'
  GEMMs in FP8 or FP4; the weights are quantized at every call, as an inference user without cached copies has them);
  ``<recipe>:fused+``: the same with ``lowbit.convert(model, fuse_mlp=True, fuse_qkv=True)`` (one GEMM for each
  attention's Q, K, V and for each MLP's gate and up, lowbit's fused SwiGLU); ``:cached``: every call inside one
  ``lowbit.nn.cached_weights(model)`` block (the weights quantized once, in the first untimed call, as a server that
  keeps them between prompts).

Columns: **TTFT ms**: median over ``--reps`` calls, each waited for; **queued ms**: the mean of ``--reps`` calls back
to back; **host ms**: the median time until Python has enqueued one call (before its wait); **x sdpa**: the ``sdpa``
variant's TTFT over this one's (above 1 is faster); **served**: calls lowbit's attention computed / attention calls
(the rest went to SDPA, see :func:`lowbit.integrations.transformers.stats`); **logits NRMSE**: the last token's logits
against the ``sdpa`` variant's; **peak GiB**.

The bound: a second table times one layer's attention alone at the model's shape (causal, GQA: SDPA with
``enable_gqa``, ``lowbit.attention``), and gives the share of the ``sdpa`` TTFT spent in attention (layers x that
time) and the most a faster attention can give the prefill, ``1 / (1 - share x (1 - t / t_sdpa))``.

``--device cpu`` (the default without CUDA) runs a tiny model: a smoke test of the code path, its timings mean
nothing (lowbit's attention and linears run their PyTorch references there).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import json
import statistics
import sys
import time

import torch

from . import git_commit, median_ms, nrmse

PROG = "lowbit bench prefill"
SEED = 1234
SIZES = {
    "1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab=128256),
    "3b": dict(hidden=3072, layers=28, heads=24, kv_heads=8, intermediate=8192, vocab=128256),
    "8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256),
    "tiny": dict(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256, vocab=512),
}
"""Model shapes (Llama 3.2 1B / 3B, Llama 3 8B; ``tiny`` for the CPU)."""
ATTENTIONS = {"sdpa": None, "int8-fp8": ("int8", "fp8"), "int8-bf16": ("int8", "bf16")}
"""Attention variants: None (transformers' SDPA) or lowbit's (qk, pv)."""
DEFAULT_VARIANTS = "sdpa,int8-fp8,int8-bf16,fp8-block+sdpa,fp8-block+int8-fp8"


VARIANT_OPTIONS = ("fused", "cached")
"""What may follow a variant's recipe, each after a colon."""


def parse_variant(v: str) -> tuple[str | None, str, bool, bool]:
    """``"[<recipe>[:fused][:cached]+]<attention>"`` -> (recipe or None, attention, fused, cached); ValueError naming
    the rule otherwise."""
    from ..recipes import QUANTIZED_NAMES

    recipe, _, attn = v.rpartition("+")
    if attn not in ATTENTIONS:
        raise ValueError(f"--variants: {v!r}: the attention must be one of {', '.join(ATTENTIONS)}, got {attn!r}")
    recipe, *opts = recipe.split(":")
    bad = [o for o in opts if o not in VARIANT_OPTIONS]
    if bad or len(set(opts)) != len(opts):
        raise ValueError(f"--variants: {v!r}: after the recipe only {', '.join(':' + o for o in VARIANT_OPTIONS)} "
                         f"may follow, each once, got {':' + ':'.join(opts)!r}")
    if (recipe or opts) and recipe not in QUANTIZED_NAMES:
        raise ValueError(f"--variants: {v!r}: the recipe must be one of {', '.join(QUANTIZED_NAMES)}, got {recipe!r}")
    return recipe or None, attn, "fused" in opts, "cached" in opts


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=SIZES, default=None, help="model shape (default 1b; cpu: tiny)")
    p.add_argument("--seq-len", type=int, default=None, help="prompt tokens (default 8192; cpu 64)")
    p.add_argument("--batch", type=int, default=1, help="prompts a call (default 1)")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma-separated (default {DEFAULT_VARIANTS})")
    p.add_argument("--reps", type=int, default=20, help="timed calls a variant (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first (default 3: kernels compile there)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="cuda (default when present) or cpu")
    p.add_argument("--out", default=None, help="write the tables (markdown) to this file, and FILE.json")
    return p.parse_args(argv)


def resolve(args: argparse.Namespace) -> dict:
    """The run's settings from the arguments, every one checked (ValueError naming it)."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device: cuda asked for, but torch sees no CUDA GPU")
    size = args.size or ("1b" if device == "cuda" else "tiny")
    if device == "cpu" and size != "tiny":
        raise ValueError(f"--size: on the CPU only 'tiny' runs (a smoke test of the path: a {size} model's FP32 "
                         f"initialisation alone would take minutes and GiBs), got {size!r}")
    seq = args.seq_len or (8192 if device == "cuda" else 64)
    for name, v, lo in (("--seq-len", seq, 2), ("--batch", args.batch, 1), ("--reps", args.reps, 1),
                        ("--warmup", args.warmup, 0)):
        if v < lo:
            raise ValueError(f"{name}: must be at least {lo}, got {v}")
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not names:
        raise ValueError(f"--variants: no variant named in {args.variants!r}")
    for v in names:
        parse_variant(v)
    return dict(device=device, size=size, model=SIZES[size], seq=seq, batch=args.batch, variants=names,
                reps=args.reps, warmup=args.warmup)


def build_model(m: dict, seq: int, device: str):
    """A random-init BF16 ``LlamaForCausalLM`` of shape ``m`` on ``device``, from the fixed seed, on SDPA."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=m["vocab"], hidden_size=m["hidden"], intermediate_size=m["intermediate"],
                      num_hidden_layers=m["layers"], num_attention_heads=m["heads"],
                      num_key_value_heads=m["kv_heads"], max_position_embeddings=seq, rope_theta=500000.0,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(SEED)
    with torch.device(device):  # (initialised where it runs: an 8B model's FP32 init on the CPU takes minutes)
        model = LlamaForCausalLM(cfg)
    return model.to(torch.bfloat16).eval()


def checked_config(prog: str, resolve, args: argparse.Namespace) -> tuple[dict | None, int]:
    """(``resolve(args)``, 0), or (None, the exit code) once it says why not on stderr: a bad argument (2) or no
    transformers installed (1). The HF benches' (prefill, decode) shared start."""
    try:
        cfg = resolve(args)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return None, 2
    try:
        import transformers  # noqa: F401
    except ImportError:
        print(f"{prog}: needs transformers (pip install transformers)", file=sys.stderr)
        return None, 1
    return cfg, 0


def failed_status(e: Exception) -> str:
    """A failed variant's row status: the exception's type and first line."""
    return f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def release(device: str) -> None:
    """Free what a variant's model held before the next one is built (lowbit modules and their GEMM state are
    reference cycles: collected here, so each variant's peak memory is its own)."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_variant(name: str, cfg: dict, ids: torch.Tensor, log) -> dict:
    """Build, warm up and time one variant; its row (``status`` "ok", or why it failed) and last-token logits."""
    from ..integrations import transformers as lbt
    from ..nn import autocast, cached_weights, convert
    from ..recipes import from_name

    recipe, attn, fused, cached = parse_variant(name)
    dev = cfg["device"]
    row = {"variant": name, "recipe": recipe, "attention": attn}
    model = None
    try:
        model = build_model(cfg["model"], cfg["seq"], dev)
        ctx = contextlib.nullcontext
        if recipe is not None:
            summary = convert(model, fuse_mlp=fused, fuse_qkv=fused)
            row["converted"] = len(summary.converted)
            if fused:
                row["fused"] = len(summary.fused)
            ctx = functools.partial(autocast, recipe=from_name(recipe))
        stats = None
        if ATTENTIONS[attn] is not None:
            qk, pv = ATTENTIONS[attn]
            impl = lbt.use(model, lbt.AttentionConfig(qk=qk, pv=pv))
            stats = lbt.stats(impl)

        def call():
            with torch.inference_mode(), ctx():
                return model(input_ids=ids, use_cache=True, logits_to_keep=1).logits

        keep = cached_weights(model) if cached else contextlib.nullcontext()
        with keep:  # (:cached: the weights quantized in the first warm-up call, kept for the timed ones)
            if dev == "cuda":
                torch.cuda.reset_peak_memory_stats()
            for _ in range(cfg["warmup"]):
                call()
            _sync(dev)
            before = (stats.served, stats.calls) if stats is not None else None
            ttft, host = [], []
            logits = None
            for _ in range(cfg["reps"]):
                t0 = time.perf_counter()
                logits = call()
                host.append(time.perf_counter() - t0)
                _sync(dev)
                ttft.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for _ in range(cfg["reps"]):
                call()
            _sync(dev)
            queued = (time.perf_counter() - t0) / cfg["reps"]
        if cached:
            row["weights_reused"] = keep.reused
        row.update(status="ok", ttft_ms=statistics.median(ttft) * 1e3, host_ms=statistics.median(host) * 1e3,
                   queued_ms=queued * 1e3)
        if stats is not None:
            row["served"] = stats.served - before[0]
            row["attention_calls"] = stats.calls - before[1]
        if dev == "cuda":
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        row["logits"] = logits[:, -1].float().cpu()
        log(f"[bench prefill] {name}: TTFT {row['ttft_ms']:.2f} ms (host {row['host_ms']:.2f} ms)")
    except Exception as e:  # noqa: BLE001 - a failed variant is a row; the others still run
        row.update(status=failed_status(e))
        log(f"[bench prefill] {name}: {row['status']}")
    finally:
        model = None
        release(dev)
    return row


def attention_alone(cfg: dict) -> dict:
    """One layer's attention at the model's shape on CUDA, ms: SDPA (``enable_gqa``) and each lowbit arithmetic."""
    import torch.nn.functional as F

    from ..attention.api import attention

    m, b, s = cfg["model"], cfg["batch"], cfg["seq"]
    d = m["hidden"] // m["heads"]
    g = torch.Generator(device="cuda").manual_seed(SEED)
    q = torch.randn(b, m["heads"], s, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, m["kv_heads"], s, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    out = {"sdpa": median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))}
    for name, arith in ATTENTIONS.items():
        if arith is not None:
            out[name] = median_ms(lambda a=arith: attention(q, k, v, causal=True, qk=a[0], pv=a[1]))
    return out


def sdpa_row(rows: list[dict]) -> dict | None:
    """The ``sdpa`` variant's row where it ran (every ratio's baseline), else None."""
    return next((r for r in rows if r["variant"] == "sdpa" and r["status"] == "ok"), None)


def bound_rows(rows: list[dict], alone: dict, layers: int) -> list[dict]:
    """Per lowbit attention: its time alone against SDPA's, SDPA's share of the ``sdpa`` variant's TTFT, and the
    best TTFT ratio that attention can give there (everything else unchanged)."""
    base = sdpa_row(rows)
    out = []
    for name, t in alone.items():
        if name == "sdpa":
            continue
        r = {"attention": name, "ms": t, "sdpa_ms": alone["sdpa"], "x_sdpa": alone["sdpa"] / t}
        if base is not None:
            share = layers * alone["sdpa"] / base["ttft_ms"]
            r.update(share=share, bound=1.0 / (1.0 - share * (1.0 - t / alone["sdpa"])))
        out.append(r)
    return out


def header(cfg: dict) -> str:
    m = cfg["model"]
    dev = torch.cuda.get_device_name() if cfg["device"] == "cuda" else "CPU"
    return (f"## {PROG} — {dev}, torch {torch.__version__}, commit {git_commit()}\n\n"
            f"LlamaForCausalLM {cfg['size']} (hidden {m['hidden']}, {m['layers']} layers, {m['heads']} heads, "
            f"{m['kv_heads']} KV heads, head dim {m['hidden'] // m['heads']}), BF16, batch {cfg['batch']} x "
            f"{cfg['seq']} prompt tokens, logits of the last token only; {cfg['reps']} timed calls a variant after "
            f"{cfg['warmup']} untimed")


def markdown(cfg: dict, rows: list[dict], bounds: list[dict]) -> str:
    base = sdpa_row(rows)
    lines = [header(cfg), "",
             "| variant | TTFT ms | x sdpa | queued ms | host ms | served | logits NRMSE | peak GiB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['variant']} | {r['status']} | | | | | | |")
            continue
        x = f"{base['ttft_ms'] / r['ttft_ms']:.3f}" if base else "-"
        served = f"{r['served']}/{r['attention_calls']}" if "served" in r else "-"
        err = f"{r['nrmse']:.2e}" if r.get("nrmse") is not None else "-"
        peak = f"{r['peak_gib']:.2f}" if "peak_gib" in r else "-"
        lines.append(f"| {r['variant']} | {r['ttft_ms']:.2f} | {x} | {r['queued_ms']:.2f} | {r['host_ms']:.2f} | "
                     f"{served} | {err} | {peak} |")
    if bounds:
        lines += ["", "One layer's attention alone (causal, GQA), and the most it can give the prefill:", "",
                  "| attention | ms | SDPA ms | x SDPA | SDPA's share of the sdpa TTFT | TTFT bound (x sdpa) |",
                  "|---|---:|---:|---:|---:|---:|"]
        for b in bounds:
            share = f"{b['share']:.1%}" if "share" in b else "-"
            bound = f"{b['bound']:.3f}" if "bound" in b else "-"
            lines.append(f"| {b['attention']} | {b['ms']:.3f} | {b['sdpa_ms']:.3f} | {b['x_sdpa']:.3f} | {share} | "
                         f"{bound} |")
    return "\n".join(lines)


def run(cfg: dict, log=print) -> tuple[list[dict], list[dict]]:
    """Every variant's row, then (CUDA) the bound rows."""
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(cfg["model"]["vocab"], (cfg["batch"], cfg["seq"]), generator=g).to(cfg["device"])
    log(f"[bench prefill] {len(cfg['variants'])} variants, {cfg['size']}, {cfg['batch']} x {cfg['seq']} tokens, "
        f"on {cfg['device']}")
    rows = [run_variant(v, cfg, ids, log) for v in cfg["variants"]]
    base = sdpa_row(rows)
    ref = base["logits"] if base is not None else None
    for r in rows:
        lg = r.pop("logits", None)
        r["nrmse"] = nrmse(lg, ref) if ref is not None and lg is not None and r is not base else None
    bounds = bound_rows(rows, attention_alone(cfg), cfg["model"]["layers"]) if cfg["device"] == "cuda" else []
    return rows, bounds


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg, rc = checked_config(PROG, resolve, args)
    if cfg is None:
        return rc
    rows, bounds = run(cfg)
    md = markdown(cfg, rows, bounds)
    print("\n" + md, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(md + "\n")
        with open(args.out + ".json", "w") as f:
            json.dump(dict(header=header(cfg), config=cfg, rows=rows, bounds=bounds,
                           date=datetime.date.today().isoformat()), f, indent=1)
        print(f"[bench prefill] wrote {args.out} and {args.out}.json", flush=True)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
