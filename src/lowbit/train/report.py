"""Reports: JSON summaries (atomic), the loss-curve PNG (matplotlib, Agg canvas) and the results table.

matplotlib is optional (``pip install lowbit[train]``): :func:`try_plot_losses` skips the PNG without it, and the
commands print :data:`PLOT_NOTE` once; the JSON and the table need nothing beyond the standard library.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

__all__ = ["write_json", "plot_losses", "try_plot_losses", "PLOT_NOTE", "format_table", "table_rows", "text_table"]

PLOT_NOTE = "[lowbit] note: no loss plot (matplotlib is not installed; the PNG needs `pip install lowbit[train]`)"


def write_json(path: str | os.PathLike, obj) -> Path:
    """Write ``obj`` as indented JSON via a temp file + rename (non-finite floats become strings)."""

    def clean(o):
        if isinstance(o, float) and not math.isfinite(o):
            return str(o)
        if isinstance(o, dict):
            return {str(k): clean(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [clean(v) for v in o]
        return o

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(clean(obj), indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)
    return path


def _smooth(ys, k):
    out, acc = [], []
    for y in ys:
        acc.append(y)
        if len(acc) > k:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def plot_losses(runs: dict, path: str | os.PathLike, title: str = "") -> Path:
    """Plot train (smoothed) and validation loss against step for each run summary in ``runs`` (name -> summary).

    Uses an Agg canvas directly (no pyplot, no global backend switch), so it works headless.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax_t, ax_v = fig.subplots(1, 2)
    for i, (name, s) in enumerate(runs.items()):
        color = f"C{i}"
        tr = s.get("history", {}).get("train", [])
        if tr:
            xs, ys = zip(*tr)
            ax_t.plot(xs, _smooth(ys, max(1, len(ys) // 25)), color=color, label=name, lw=1.4)
        va = s.get("history", {}).get("val", [])
        if va:
            xs, ys = zip(*va)
            ax_v.plot(xs, ys, "o-", color=color, label=name, ms=3, lw=1.4)
    ax_t.set(title="train loss (smoothed)", xlabel="step", ylabel="cross-entropy (nats/byte)")
    ax_v.set(title="validation loss", xlabel="step", ylabel="cross-entropy (nats/byte)")
    for ax in (ax_t, ax_v):
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.png")
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)
    return path


def try_plot_losses(runs: dict, path: str | os.PathLike, title: str = "") -> Path | None:
    """:func:`plot_losses`, or ``None`` (nothing written) when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
    except ImportError:
        return None
    return plot_losses(runs, path, title=title)


def _mib(n):
    return "n/a" if n is None else f"{n / 2**20:,.1f} MiB"


def table_rows(runs: dict, baseline: str = "bf16") -> list[dict]:
    """One row per run: final val loss, gap to the baseline (%), tokens/s, peak memory, weight bytes."""
    base = runs.get(baseline, {}).get("final_val_loss")
    rows = []
    for name, s in runs.items():
        vl = s.get("final_val_loss")
        gap = None if (vl is None or not base) else 100.0 * (vl - base) / base
        rows.append({
            "recipe": name, "final_val_loss": vl, "gap_pct": gap, "tokens_per_s": s.get("tokens_per_s"),
            "peak_memory_bytes": s.get("peak_memory_bytes"), "weight_bytes_quantized": s.get("weight_bytes_quantized"),
            "weight_bytes_bf16": s.get("weight_bytes_bf16"), "events": len(s.get("events", [])),
        })
    return rows


def format_table(rows: list[dict], markdown: bool = False) -> str:
    """The results table as aligned text (or GitHub markdown)."""
    head = ["recipe", "val loss", "gap vs bf16", "tokens/s", "peak mem", "weights (quant/bf16)", "nonfinite"]
    body = []
    for r in rows:
        ratio = (r["weight_bytes_quantized"] / r["weight_bytes_bf16"]) if r.get("weight_bytes_bf16") else None
        body.append([
            r["recipe"],
            "n/a" if r["final_val_loss"] is None else f"{r['final_val_loss']:.4f}",
            "—" if r["gap_pct"] is None or r["recipe"] == "bf16" else f"{r['gap_pct']:+.2f}%",
            "n/a" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:,.0f}",
            _mib(r["peak_memory_bytes"]),
            "n/a" if ratio is None
                     else f"{_mib(r['weight_bytes_quantized'])} / {_mib(r['weight_bytes_bf16'])} ({ratio:.2f}x)",
            str(r["events"]),
        ])
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        return "\n".join(lines)
    return text_table(head, body)


def text_table(head: list[str], body: list[list[str]], left: int = 1) -> str:
    """``head`` over a dashed rule and the rows of ``body`` (at least one), in aligned columns: the first ``left``
    left-justified, the others right-justified."""
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(head)]

    def fmt(row):
        return "  ".join(v.ljust(w) if i < left else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths)))

    return "\n".join([fmt(head), "  ".join("-" * w for w in widths), *map(fmt, body)])
