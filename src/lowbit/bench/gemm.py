"""``lowbit bench gemm``: scaled GEMM throughput against its peers, all measured in the same run.

For each (M, K, N): BF16 ``torch.mm``; cuBLAS FP8 tensorwise (``torch._scaled_mm``); cuBLAS FP8
blockwise 1x128·128x128 (``F.scaled_mm``, where this torch offers it); torchao's Triton blockwise
kernel (only if torchao is importable); lowbit's Triton blockwise GEMM (1x128 · 128x128, BF16 out);
lowbit's NVFP4 and MXFP8 emulated GEMMs (dequantize-then-BF16-GEMM and the fused per-tile unpack). Median time by
``triton.testing.do_bench``; TFLOP/s = 2·M·N·K / t; ratios against BF16 and cuBLAS blockwise.

``--layers 350m,1.3b`` times instead the three GEMMs of each linear layer of those GPT presets over the tokens of one
``lowbit train`` step (``--tokens``), as the fp8-block recipe pairs them: fprop Y = X·Wᵀ and dgrad dX = dY·W (1x128
activations or gradients against the 128x128 weight, BF16 out), wgrad dW = dYᵀ·X (1x128 against 1x128 along the
tokens, FP32 out). Each against BF16 ``torch.mm``, cuBLAS FP8 tensorwise, cuBLAS blockwise (lowbit's ``cublas``
backend), torchao's Triton kernels (``1x128_128x128``, and ``1x128_128x1`` for wgrad), lowbit's Triton backend and
DeepGEMM's SM90 kernels (only if ``deep_gemm`` is importable: it is built from source); wgrad also as
``lowbit.gemm.wgrad_mm`` runs it (its operand-order choice); fprop and dgrad also as ``lowbit.scaled_mm`` picks the
backend ("lowbit fp8-block"). GPU time of a CUDA-graph replay of each call (the small layer GEMMs would otherwise
show the host). Last, for each preset, all its GEMMs back to back in one graph, in a step's order, for BF16, cuBLAS
per-tensor and blockwise, lowbit's fp8-block and DeepGEMM: a GEMM replayed alone may read operands its previous
replay left in L2.

``--layers 4096,8192,16384`` (square sizes, alone or among the presets) times the same three GEMMs of one square
layer over as many tokens: the three pairings at M = K = N.

``--layers 1.3b --decode 1,16,64`` times instead the forward GEMM of each linear layer at those token counts, as a
decode step runs it (the weight quantized once, as ``lowbit.nn.cached_weights`` keeps it): BF16 ``torch.mm``, cuBLAS
FP8 tensorwise and blockwise (token counts that are multiples of 16: ``torch._scaled_mm``'s rule), lowbit's
fp8-block GEMM as ``lowbit.scaled_mm`` dispatches it, and that GEMM with the activation's 1x128 quantization before
it. GPU time of CUDA-graph replays; the last rows of each token count add up a layer.
"""

from __future__ import annotations

import datetime
import sys

import torch

from ..runtime.env import override
from . import git_commit, median_ms, table_main

SHAPES = [(8192, 8192, 8192), (16384, 4096, 4096), (16384, 4096, 14336), (16384, 14336, 4096), (4096, 4096, 4096)]
LAYER_TOKENS = {"350m": 8 * 2048, "1.3b": 4 * 2048}
"""Tokens of one ``lowbit train`` step of each preset (batch x 2048, as BENCHMARKS runs them)."""


SQUARE_SIZES = (256, 32768)
"""The square sizes ``--layers`` takes besides the presets (multiples of 128 in this range)."""


def layer_shapes(preset: str) -> list[tuple[str, int, int]]:
    """(layer, out features, in features) of the linear layers of one block of the GPT ``preset``, or for a square
    size (``"8192"``) the one square layer of that many outputs and inputs."""
    if preset.isdigit():
        return [("square", int(preset), int(preset))]
    from lowbit.models.gpt import config_from_preset

    c = config_from_preset(preset)
    d, f = c.d_model, c.ffn_hidden
    return [("qkv", 3 * d, d), ("proj", d, d), ("fc1", 2 * f, d), ("fc2", d, f)]


def layer_gemm_dims(pairing: str, tokens: int, n_out: int, k_in: int) -> tuple[int, int, int]:
    """(M, K, N) of one GEMM of a linear layer of ``n_out`` outputs and ``k_in`` inputs over ``tokens``: fprop
    (tokens, in, out), dgrad (tokens, out, in), wgrad (out, tokens, in)."""
    return {"fprop": (tokens, k_in, n_out), "dgrad": (tokens, n_out, k_in), "wgrad": (n_out, tokens, k_in)}[pairing]


def layer_gemms(preset: str, tokens: int) -> list[tuple[str, str, int, int, int]]:
    """(layer, pairing, M, K, N) of the three GEMMs (:func:`layer_gemm_dims`) of each linear layer of one block of the
    GPT ``preset`` over ``tokens``."""
    return [(name, pairing, *layer_gemm_dims(pairing, tokens, n_out, k_in))
            for name, n_out, k_in in layer_shapes(preset) for pairing in ("fprop", "dgrad", "wgrad")]


def layer_operands(tokens: int, n_out: int, k_in: int, dev):
    """(x, dy, w, qx, qdy, qw) for a linear layer of ``n_out`` outputs and ``k_in`` inputs over ``tokens``: random
    BF16 X (tokens, in), dY (tokens, out) and W (out, in), and their fp8-block copies (1x128 activations, 128x128
    weight; both copies each)."""
    from lowbit.quant import Float8Blockwise, quantize

    act = Float8Blockwise()
    x = torch.randn(tokens, k_in, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(tokens, n_out, device=dev, dtype=torch.bfloat16) * 1e-3
    w = torch.randn(n_out, k_in, device=dev, dtype=torch.bfloat16)
    return (x, dy, w, quantize(x, act, rowwise=True, columnwise=True), quantize(dy, act, rowwise=True, columnwise=True),
            quantize(w, Float8Blockwise(block_dim=2), rowwise=True, columnwise=True))


def _skipped(e: Exception) -> None:
    """Report a kernel that could not be timed (the peer is then unavailable; the run goes on)."""
    print(f"    (skipped: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})")


def time_ms(fn, rep=100) -> float | None:
    try:
        fn()
        torch.cuda.synchronize()
        return median_ms(fn, rep=rep)
    except Exception as e:  # noqa: BLE001 - report the peer as unavailable rather than abort the run
        _skipped(e)
        return None


def _run_shape(M, K, N, rep, rows):
    """Times every kernel on one (M, K, N) and appends its rows; the inputs die with this frame."""
    from lowbit.gemm import scaled_mm
    from lowbit.quant import MXFP8, NVFP4, Float8Blockwise, quantize

    F = torch.nn.functional
    dev = torch.device("cuda")
    print(f"[gemm] M={M} K={K} N={N}", flush=True)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
    flops = 2.0 * M * N * K
    res = {}
    res["bf16 torch.mm"] = time_ms(lambda: torch.mm(x, w.t()), rep)
    res["cuBLAS fp8 tensorwise"] = time_ms(_tensorwise(x, w, torch.bfloat16), rep)
    qa = quantize(x, Float8Blockwise())
    qb = quantize(w, Float8Blockwise(block_dim=2))
    if hasattr(F, "scaled_mm"):
        sa = qa.logical_scales()
        sb = qb.logical_scales()
        S = F.ScalingType
        res["cuBLAS fp8 blockwise"] = time_ms(lambda: F.scaled_mm(qa.rowwise.data, qb.rowwise.data.t(), sa,
                                                                 S.BlockWise1x128,
                                                                 sb.t(), S.BlockWise128x128,
                                                                 output_dtype=torch.bfloat16), rep)
    try:
        from torchao.prototype.blockwise_fp8_training.kernels import triton_fp8_gemm_1x128_128x128 as ao_gemm  # type: ignore

        res["torchao triton blockwise"] = time_ms(lambda: ao_gemm(qa.rowwise.data, qb.rowwise.data.t(),
                                                                 qa.logical_scales(),
                                                                 qb.logical_scales().t()), rep)
    except Exception as e:  # noqa: BLE001 - any import/run problem means "no torchao row"
        print(f"# torchao triton blockwise: {type(e).__name__}: {e}", file=sys.stderr)
    # pointer tiles, then the same kernel with TMA operand tiles (LOWBIT_TMA, the default)
    # and the Gluon kernel among the TMA candidates (LOWBIT_GEMM_GLUON=1, the default)
    # and each Gluon kernel alone: one tile a CTA ("force"), persistent warp-specialized ("ws")
    for name, tma, gl in (("lowbit triton blockwise", "0", "0"), ("lowbit triton blockwise (TMA, no Gluon)", "1", "0"),
                          ("lowbit triton blockwise (TMA + Gluon)", "1", "1"), ("lowbit Gluon, one tile a CTA", "1",
                                                                                "force"),
                          ("lowbit Gluon, persistent warp-specialized", "1", "ws")):
        with override(LOWBIT_TMA=tma, LOWBIT_GEMM_GLUON=gl):
            res[name] = time_ms(lambda: scaled_mm(qa, qb, out_dtype=torch.bfloat16, backend="triton"), rep)
    na, nb = quantize(x, NVFP4()), quantize(w, NVFP4(two_d=True))
    # the dequantized path autotunes its core GEMM: the faster of cuBLAS and Triton's (pointer / TMA tiles)
    for name, tma in (("lowbit nvfp4 dequant+bf16", "0"), ("lowbit nvfp4 dequant+bf16 (TMA)", "1")):
        with override(LOWBIT_TMA=tma):
            res[name] = time_ms(lambda: scaled_mm(na, nb, out_dtype=torch.bfloat16, backend="triton_dequant"), rep)
    res["lowbit nvfp4 fused emulated"] = time_ms(lambda: scaled_mm(na, nb, out_dtype=torch.bfloat16,
                                                                  backend="triton_emulated"), rep)
    ma, mb = quantize(x, MXFP8()), quantize(w, MXFP8())
    res["lowbit mxfp8 dequant+bf16"] = time_ms(lambda: scaled_mm(ma, mb, out_dtype=torch.bfloat16,
                                                                backend="triton_dequant"), rep)
    res["lowbit mxfp8 fused emulated"] = time_ms(lambda: scaled_mm(ma, mb, out_dtype=torch.bfloat16,
                                                                  backend="triton_emulated"), rep)
    _append_rows(rows, f"{M}x{K}x{N}", flops, res)


def _graph_ms(fn, rep) -> float | None:
    """GPU time of ``fn`` replayed from a CUDA graph (None, with the reason printed, where it fails)."""
    from . import capture

    try:
        g = capture(fn)
        return median_ms(g.replay, rep=rep)
    except Exception as e:  # noqa: BLE001 - report the peer as unavailable rather than abort the run
        _skipped(e)
        return None


def _tensorwise(a, bt, out_dtype):
    """cuBLAS's FP8 tensorwise ``a · btᵀ`` as a call (E4M3 codes made here, outside the timing; unit scales: the time
    does not depend on the values)."""
    one = torch.ones((), device=a.device)
    qa, qb = a.to(torch.float8_e4m3fn).contiguous(), bt.to(torch.float8_e4m3fn).contiguous()
    return lambda: torch._scaled_mm(qa, qb.t(), scale_a=one, scale_b=one, out_dtype=out_dtype)


def _layer_calls(x, dy, w, qx, qdy, qw):
    """{pairing: {kernel: fn}} for one linear layer's operands (codes and scales made here, outside the timing)."""
    from lowbit.gemm import scaled_mm, wgrad_mm

    bf16, f32 = torch.bfloat16, torch.float32
    calls = {
        "fprop": {"bf16 torch.mm": lambda: torch.mm(x, w.t()),
                  "cuBLAS fp8 tensorwise": _tensorwise(x, w, bf16),
                  "cuBLAS fp8 blockwise": lambda: scaled_mm(qx, qw, out_dtype=bf16, backend="cublas"),
                  "lowbit triton blockwise": lambda: scaled_mm(qx, qw, out_dtype=bf16, backend="triton"),
                  "lowbit fp8-block": lambda: scaled_mm(qx, qw, out_dtype=bf16)},
        "dgrad": {"bf16 torch.mm": lambda: torch.mm(dy, w),
                  "cuBLAS fp8 tensorwise": _tensorwise(dy, w.t(), bf16),
                  "cuBLAS fp8 blockwise": lambda: scaled_mm(qdy, qw, b_copy="columnwise", out_dtype=bf16,
                                                            backend="cublas"),
                  "lowbit triton blockwise": lambda: scaled_mm(qdy, qw, b_copy="columnwise", out_dtype=bf16,
                                                               backend="triton"),
                  "lowbit fp8-block": lambda: scaled_mm(qdy, qw, b_copy="columnwise", out_dtype=bf16)},
        "wgrad": {"bf16 torch.mm": lambda: torch.mm(dy.t(), x),
                  "cuBLAS fp8 tensorwise": _tensorwise(dy.t(), x.t(), f32),
                  "cuBLAS fp8 blockwise": lambda: scaled_mm(qdy, qx, a_copy="columnwise", b_copy="columnwise",
                                                            out_dtype=f32, backend="cublas"),
                  "lowbit triton blockwise": lambda: scaled_mm(qdy, qx, a_copy="columnwise", b_copy="columnwise",
                                                               out_dtype=f32, backend="triton"),
                  "lowbit wgrad_mm": lambda: wgrad_mm(qdy, qx, out_dtype=f32)},
    }
    try:  # torchao's Triton kernels, in the layouts they assert (row-major A, column-major B, their scale layouts)
        from torchao.prototype.blockwise_fp8_training.kernels import (  # type: ignore
            triton_fp8_gemm_1x128_128x1,
            triton_fp8_gemm_1x128_128x128,
        )

        def col_major(t):
            return t.t().contiguous().t()

        calls["fprop"]["torchao triton blockwise"] = lambda: triton_fp8_gemm_1x128_128x128(
            qx.rowwise.data, qw.rowwise.data.t(), qx.logical_scales(), qw.logical_scales().t())
        calls["dgrad"]["torchao triton blockwise"] = lambda: triton_fp8_gemm_1x128_128x128(
            qdy.rowwise.data, qw.columnwise.data.t(), qdy.logical_scales(), qw.logical_scales("columnwise").t())
        a_s = col_major(qdy.logical_scales("columnwise"))
        b_s = qx.logical_scales("columnwise").t().contiguous()
        calls["wgrad"]["torchao triton blockwise"] = lambda: triton_fp8_gemm_1x128_128x1(
            qdy.columnwise.data, qx.columnwise.data.t(), a_s, b_s)
    except Exception as e:  # noqa: BLE001 - any import problem means "no torchao rows"
        print(f"# torchao triton blockwise: {type(e).__name__}: {e}", file=sys.stderr)
    from lowbit.gemm import BACKENDS

    if "cuda" in BACKENDS:  # lowbit's NVRTC-compiled 1x128 · 128x128 kernel (sm_90)
        calls["fprop"]["lowbit cuda blockwise"] = lambda: scaled_mm(qx, qw, out_dtype=bf16, backend="cuda")
        calls["dgrad"]["lowbit cuda blockwise"] = lambda: scaled_mm(qdy, qw, b_copy="columnwise", out_dtype=bf16,
                                                                    backend="cuda")
    for pairing, fns in _deepgemm_calls(qx, qdy, qw).items():
        calls[pairing].update(fns)
    return calls


def _deepgemm_calls(qx, qdy, qw):
    """{pairing: {kernel: fn}} of DeepGEMM's SM90 kernels on the same codes and scales, where ``deep_gemm`` is
    importable (it is built from source; no rows otherwise): 1x128 · 128x128 (its "1D2D" kernel, BF16 out) for fprop
    and dgrad, 1x128 · 1x128 ("1D1D", accumulating into an FP32 output, the only FP32 form it has) for wgrad. The 1x128
    scales are put in the MN-major, TMA-aligned layout it requires outside the timing."""
    try:
        import deep_gemm  # type: ignore
    except Exception as e:  # noqa: BLE001 - any import problem means "no DeepGEMM rows"
        if not isinstance(e, ModuleNotFoundError):
            print(f"# deepgemm: {type(e).__name__}: {e}", file=sys.stderr)
        return {}
    mm, aligned = deep_gemm.fp8_fp4_gemm_nt, deep_gemm.get_mn_major_tma_aligned_tensor

    def operand(q, copy, align):
        s = q.logical_scales(copy).float().clone(memory_format=torch.contiguous_format)  # (packed by strides)
        return q.rowwise.data if copy == "rowwise" else q.columnwise.data, aligned(s) if align else s

    def call(a, b, d, recipe, c=None):
        def fn():
            mm(a, b, d, c=c, recipe=recipe, disable_ue8m0_cast=True)
            return d
        return fn

    fa, fb = operand(qx, "rowwise", True), operand(qw, "rowwise", False)
    da, db = operand(qdy, "rowwise", True), operand(qw, "columnwise", False)
    wa, wb = operand(qdy, "columnwise", True), operand(qx, "columnwise", True)
    dev, (T, n_out), k_in = qx.rowwise.data.device, qdy.shape, qx.shape[1]
    y, dx = (torch.empty(T, n, device=dev, dtype=torch.bfloat16) for n in (n_out, k_in))
    dw = torch.zeros(n_out, k_in, device=dev, dtype=torch.float32)
    block, rows = (1, 128, 128), (1, 1, 128)
    return {"fprop": {"DeepGEMM 1d2d": call(fa, fb, y, block)},
            "dgrad": {"DeepGEMM 1d2d": call(da, db, dx, block)},
            "wgrad": {"DeepGEMM 1d1d, += fp32": call(wa, wb, dw, rows, c=dw)}}


BLOCK_FAMILIES = {
    "bf16 torch.mm": ("bf16 torch.mm",) * 3,
    "cuBLAS fp8 tensorwise": ("cuBLAS fp8 tensorwise",) * 3,
    "cuBLAS fp8 blockwise": ("cuBLAS fp8 blockwise",) * 3,
    "lowbit fp8-block": ("lowbit fp8-block", "lowbit fp8-block", "lowbit wgrad_mm"),
    "DeepGEMM": ("DeepGEMM 1d2d", "DeepGEMM 1d2d", "DeepGEMM 1d1d, += fp32"),
}
"""The back-to-back rows' kernels: {row name: its (fprop, dgrad, wgrad) kernels among the per-GEMM rows}."""


def block_calls(layers) -> dict:
    """{row name: fn} for the back-to-back rows: ``fn`` runs every GEMM of ``layers`` (:func:`_layer_calls` results,
    in layer order) in a step's order, the forwards in layer order, then each layer's dgrad and wgrad from the last
    layer back, each GEMM with its own operands; one entry for each :data:`BLOCK_FAMILIES` row every layer has."""
    out = {}
    for name, (fprop, dgrad, wgrad) in BLOCK_FAMILIES.items():
        seq = [layer["fprop"].get(fprop) for layer in layers]
        seq += [layer[p].get(k) for layer in reversed(layers) for p, k in (("dgrad", dgrad), ("wgrad", wgrad))]
        if layers and all(seq):
            out[name] = lambda seq=tuple(seq): [fn() for fn in seq]
    return out


def run_layers(presets, tokens, rep=100, rows=None, done=None):
    """Rows of :func:`markdown` for the three GEMMs of each linear layer of ``presets``, then for all of a preset's
    GEMMs back to back (:func:`block_calls`: per call the GEMMs may find their operands in L2, in a step they
    mostly do not), appended to ``rows``; ``done()`` after each row group."""
    rows = [] if rows is None else rows
    dev = torch.device("cuda")
    for preset in presets:
        T = tokens or LAYER_TOKENS.get(preset) or int(preset)  # (a square layer runs over as many tokens)
        layers, flops = [], 0.0
        for layer, n_out, k_in in layer_shapes(preset):
            layers.append(_layer_calls(*layer_operands(T, n_out, k_in, dev)))
            for pairing, fns in layers[-1].items():
                M, K, N = layer_gemm_dims(pairing, T, n_out, k_in)
                label = f"{preset} {layer} {pairing} {M}x{K}x{N}"
                print(f"[gemm] {label}", flush=True)
                res = {k: _graph_ms(fn, rep) for k, fn in fns.items()}
                _append_rows(rows, label, 2.0 * M * N * K, res)
                flops += 2.0 * M * N * K
                if done is not None:
                    done()
        label = f"{preset} all {3 * len(layers)} GEMMs back to back"
        print(f"[gemm] {label}", flush=True)
        _append_rows(rows, label, flops, {k: _graph_ms(fn, rep) for k, fn in block_calls(layers).items()})
        if done is not None:
            done()
        del layers
        torch.cuda.empty_cache()  # (the preset's operands died with its calls)
    return rows


def _decode_calls(x, w, qw):
    """{kernel: fn} for one layer's forward GEMM at decode sizes: x (tokens, in) BF16, w (out, in) BF16, qw its
    128x128 blockwise copy (made once, outside the timing)."""
    from lowbit.gemm import scaled_mm
    from lowbit.quant import Float8Blockwise, quantize

    bf16, M = torch.bfloat16, x.shape[0]
    qx = quantize(x, Float8Blockwise())
    calls = {"bf16 torch.mm": lambda: torch.mm(x, w.t())}
    if M % 16 == 0:  # (torch._scaled_mm takes dims that are multiples of 16 only)
        calls["cuBLAS fp8 tensorwise"] = _tensorwise(x, w, bf16)
        calls["cuBLAS fp8 blockwise"] = lambda: scaled_mm(qx, qw, out_dtype=bf16, backend="cublas")
    else:
        print(f"    (cuBLAS fp8 rows skipped: {M} tokens, not a multiple of 16)", flush=True)
    calls["lowbit fp8-block"] = lambda: scaled_mm(qx, qw, out_dtype=bf16)
    calls["lowbit fp8-block, quantize x + GEMM"] = lambda: scaled_mm(quantize(x, Float8Blockwise()), qw,
                                                                     out_dtype=bf16)
    return calls


def run_decode(presets, tokens_list, rep=100, rows=None, done=None):
    """Rows of :func:`markdown` for the forward GEMM of each linear layer of ``presets`` at each token count of
    ``tokens_list``, then a row a kernel for the layer's sum (kernels timed on every GEMM of the layer); ``done()``
    after each token count."""
    from lowbit.quant import Float8Blockwise, quantize

    rows = [] if rows is None else rows
    dev = torch.device("cuda")
    for preset in presets:
        for T in tokens_list:
            total: dict = {}
            flops = 0.0
            for layer, n_out, k_in in layer_shapes(preset):
                x = torch.randn(T, k_in, device=dev, dtype=torch.bfloat16)
                w = torch.randn(n_out, k_in, device=dev, dtype=torch.bfloat16) * 0.02
                label = f"{preset} {layer} decode {T}x{k_in}x{n_out}"
                print(f"[gemm] {label}", flush=True)
                qw = quantize(w, Float8Blockwise(block_dim=2))
                res = {k: _graph_ms(fn, rep) for k, fn in _decode_calls(x, w, qw).items()}
                _append_rows(rows, label, 2.0 * T * n_out * k_in, res)
                flops += 2.0 * T * n_out * k_in
                for k, t in res.items():  # (a kernel that failed on one GEMM has no layer sum)
                    total[k] = None if t is None or total.get(k, 0.0) is None else total.get(k, 0.0) + t
            _append_rows(rows, f"{preset} a layer, decode {T} tokens", flops, total)
            torch.cuda.empty_cache()
            if done is not None:
                done()
    return rows


def _append_rows(rows, label, flops, res):
    bf = res.get("bf16 torch.mm")
    cb = res.get("cuBLAS fp8 blockwise")
    for name, t in res.items():
        if t is None:
            continue
        tf = flops / t * 1e-9
        rows.append((label, name, t, tf, bf / t if bf else None, cb / t if cb else None))
        print(f"    {name:28s} {t * 1e3:9.1f} us {tf:8.1f} TFLOP/s  x{(bf / t) if bf else float('nan'):.2f} vs bf16"
              f"  x{(cb / t) if cb else float('nan'):.2f} vs cuBLAS blockwise", flush=True)


def run(shapes, rep=100, rows=None, done=None):
    """Rows of :func:`markdown` for ``shapes``, appended to ``rows``; ``done()`` after each shape."""
    rows = [] if rows is None else rows
    for M, K, N in shapes:
        _run_shape(M, K, N, rep, rows)
        torch.cuda.empty_cache()
        if done is not None:
            done()
    return rows


def markdown(rows) -> str:
    dev = torch.cuda.get_device_name()
    out = [f"Device: {dev}; torch {torch.__version__}; date {datetime.date.today().isoformat()}; commit {git_commit()}",
           "",
           "| M x K x N | kernel | time (us) | TFLOP/s | vs BF16 torch.mm | vs cuBLAS FP8 blockwise |",
           "|---|---|---:|---:|---:|---:|"]
    for shape, name, t, tf, rb, rc in rows:
        out.append(f"| {shape} | {name} | {t * 1e3:.1f} | {tf:.0f} | {'' if rb is None else f'{rb:.2f}'} | "
                   f"{'' if rc is None else f'{rc:.2f}'} |")
    return "\n".join(out) + "\n"


def parse_layers(argv=None):
    """(the ``--layers`` presets or None, ``--tokens`` or None, the other arguments); ValueError naming a bad one.
    ``--decode`` is read by :func:`parse_decode` (and left in the other arguments here)."""
    import argparse

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--layers", default=None)
    p.add_argument("--tokens", type=int, default=None)
    args, rest = p.parse_known_args(argv)
    presets = None
    if args.layers is not None:
        presets = [v.strip() for v in args.layers.split(",") if v.strip()]
        lo, hi = SQUARE_SIZES
        bad = [v for v in presets if v not in LAYER_TOKENS
               and not (v.isdigit() and lo <= int(v) <= hi and int(v) % 128 == 0)]
        if bad or not presets:
            raise ValueError(f"--layers: expected presets from {', '.join(LAYER_TOKENS)} or square sizes (multiples "
                             f"of 128 from {lo} to {hi}), got {args.layers!r}")
    if args.tokens is not None:
        if presets is None:
            raise ValueError("--tokens: needs --layers (it is the GEMMs' token count there)")
        if args.tokens < 128 or args.tokens % 128:
            raise ValueError(f"--tokens: expected a positive multiple of 128 (the 1x128 blocks run along it in "
                             f"wgrad), got {args.tokens}")
    return presets, args.tokens, rest


DECODE_MAX_TOKENS = 1024
"""``--decode``'s largest token count (a decode step or a small batch of them; prefills are ``--tokens``')."""


def parse_decode(presets, tokens, argv):
    """(the ``--decode`` token counts or None, the other arguments) of ``argv`` (the arguments :func:`parse_layers`
    left); ValueError naming a bad one: the counts positive integers up to ``DECODE_MAX_TOKENS``, with ``--layers``
    and not with ``--tokens``."""
    import argparse

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--decode", default=None)
    args, rest = p.parse_known_args(argv)
    if args.decode is None:
        return None, rest
    if presets is None:
        raise ValueError("--decode: needs --layers (the presets whose layers it times)")
    if tokens is not None:
        raise ValueError("--decode: its own token counts replace --tokens; pass one of them")
    try:
        counts = [int(v) for v in args.decode.split(",") if v.strip()]
    except ValueError:
        counts = []
    if not counts or any(not 1 <= c <= DECODE_MAX_TOKENS for c in counts):
        raise ValueError(f"--decode: expected comma-separated token counts from 1 to {DECODE_MAX_TOKENS}, got "
                         f"{args.decode!r}")
    return counts, rest


def main(argv=None) -> int:
    try:
        presets, tokens, rest = parse_layers(sys.argv[1:] if argv is None else argv)
        decode, rest = parse_decode(presets, tokens, rest)
    except ValueError as e:
        print(f"lowbit bench gemm: error: {e}", file=sys.stderr)
        return 2
    if decode is not None:
        return table_main(rest, prog="lowbit bench gemm", description=__doc__.splitlines()[0], default_shapes=[None],
                          shapes_help="(not with --decode)",
                          run=lambda shapes, rep, rows, done: run_decode(presets, decode, rep, rows, done),
                          markdown=markdown)
    if presets is not None:
        return table_main(rest, prog="lowbit bench gemm", description=__doc__.splitlines()[0], default_shapes=[None],
                          shapes_help="(not with --layers)",
                          run=lambda shapes, rep, rows, done: run_layers(presets, tokens, rep, rows, done),
                          markdown=markdown)
    return table_main(rest, prog="lowbit bench gemm", description=__doc__.splitlines()[0], default_shapes=SHAPES,
                      shapes_help="comma-separated MxKxN list (default: five GPT-sized shapes); --layers 350m,1.3b "
                                  "[--tokens N]: the presets' fprop / dgrad / wgrad GEMMs instead (square sizes too: "
                                  "--layers 4096,16384); --layers P --decode 1,16,64: their forward GEMMs at decode "
                                  "sizes",
                      run=run, markdown=markdown)


if __name__ == "__main__":
    raise SystemExit(main())
