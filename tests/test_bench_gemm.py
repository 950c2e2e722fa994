"""``lowbit bench gemm --layers``: the presets' three GEMMs a linear layer, and its argument rules (CPU; the timing
itself needs a GPU)."""
import fake_deep_gemm
import pytest

from lowbit.bench import gemm


def test_layer_gemms_are_the_three_pairings_of_each_layer():
    """350m (d_model 1024, ffn 2816): fprop (tokens, in, out), dgrad (tokens, out, in), wgrad (out, tokens, in)."""
    g = gemm.layer_gemms("350m", 16384)
    assert len(g) == 12
    by = {(layer, pairing): (M, K, N) for layer, pairing, M, K, N in g}
    assert by[("qkv", "fprop")] == (16384, 1024, 3072)
    assert by[("qkv", "dgrad")] == (16384, 3072, 1024)
    assert by[("qkv", "wgrad")] == (3072, 16384, 1024)
    assert by[("fc1", "fprop")] == (16384, 1024, 5632)
    assert by[("fc2", "wgrad")] == (1024, 16384, 2816)
    # every pairing of a layer does the same work: tokens x out x in
    shapes = {layer: n_out * k_in for layer, n_out, k_in in gemm.layer_shapes("1.3b")}
    for layer, _, M, K, N in gemm.layer_gemms("1.3b", 8192):
        assert M * K * N == 8192 * shapes[layer], layer

def test_square_layers_are_the_three_pairings_at_m_k_n():
    """A square size in --layers is one layer of that many outputs and inputs, over as many tokens: each pairing
    runs at M = K = N; presets and squares mix."""
    assert gemm.layer_shapes("8192") == [("square", 8192, 8192)]
    assert [(p, M, K, N) for _, p, M, K, N in gemm.layer_gemms("4096", 4096)] == [
        ("fprop", 4096, 4096, 4096), ("dgrad", 4096, 4096, 4096), ("wgrad", 4096, 4096, 4096)]
    assert gemm.parse_layers(["--layers", "350m,16384"]) == (["350m", "16384"], None, [])


@pytest.mark.parametrize("argv,msg", [
    (["--layers", "7b"], "--layers: expected presets from 350m, 1.3b or square sizes .* got '7b'"),
    (["--layers", ""], "--layers: expected presets from 350m, 1.3b or square sizes .* got ''"),
    (["--layers", "350m,4000"], r"--layers: .*square sizes \(multiples of 128 from 256 to 32768\), got '350m,4000'"),
    (["--layers", "65536"], "--layers: .* got '65536'"),
    (["--tokens", "8192"], "--tokens: needs --layers"),
    (["--layers", "350m", "--tokens", "1000"], "--tokens: expected a positive multiple of 128 .* got 1000"),
])
def test_bad_layer_arguments_name_the_rule(argv, msg, capsys):
    with pytest.raises(ValueError, match=msg):
        gemm.parse_layers(argv)
    assert gemm.main(argv) == 2
    assert "lowbit bench gemm: error: --" in capsys.readouterr().err


def test_layer_arguments_pass_the_rest_on():
    assert gemm.parse_layers(["--layers", "350m,1.3b", "--rep", "20"]) == (["350m", "1.3b"], None, ["--rep", "20"])
    assert gemm.parse_layers(["--shapes", "128x128x128"]) == (None, None, ["--shapes", "128x128x128"])


@pytest.mark.parametrize("flag", ["--markdown", "--out"])
def test_table_is_written_after_each_shape(tmp_path, monkeypatch, flag):
    """The table benchmarks (gemm, quant) rewrite their --markdown / --out file after each shape: a run cut short
    keeps the rows it finished, and a finished run's file is the table it prints."""
    import torch

    from lowbit.bench import table_main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    out = tmp_path / "t.md"
    markdown = lambda rows: "".join(f"| {r} |\n" for r in rows)  # noqa: E731

    def run(shapes, rep, rows, done):
        for s in shapes:
            if s == (3, 3):
                raise KeyboardInterrupt  # (a time limit or Ctrl-C in the third shape)
            rows.append(s)
            done()

    with pytest.raises(KeyboardInterrupt):
        table_main([flag, str(out), "--shapes", "1x1,2x2,3x3"], prog="t", description="t", default_shapes=[],
                   shapes_help="", run=run, markdown=markdown)
    assert out.read_text() == "| (1, 1) |\n| (2, 2) |\n"
    assert table_main([flag, str(out), "--shapes", "4x4"], prog="t", description="t", default_shapes=[],
                      shapes_help="", run=run, markdown=markdown) == 0
    assert out.read_text() == "| (4, 4) |\n"


@pytest.mark.parametrize("argv,msg", [
    (["--decode", "1"], "--decode: needs --layers"),
    (["--layers", "1.3b", "--decode", "0,16"], "--decode: expected comma-separated token counts from 1 to 1024, "
                                              "got '0,16'"),
    (["--layers", "1.3b", "--decode", "1,x"], "--decode: expected comma-separated token counts .* got '1,x'"),
    (["--layers", "1.3b", "--decode", "2048"], "--decode: expected .* got '2048'"),
    (["--layers", "1.3b", "--decode", ""], "--decode: expected .* got ''"),
    (["--layers", "1.3b", "--tokens", "8192", "--decode", "1"], "--decode: its own token counts replace --tokens"),
])
def test_bad_decode_arguments_name_the_rule(argv, msg, capsys):
    presets, tokens, rest = gemm.parse_layers(argv)
    with pytest.raises(ValueError, match=msg):
        gemm.parse_decode(presets, tokens, rest)
    assert gemm.main(argv) == 2
    assert "lowbit bench gemm: error: --decode" in capsys.readouterr().err


def test_decode_arguments():
    presets, tokens, rest = gemm.parse_layers(["--layers", "350m", "--decode", "1,16,64", "--rep", "5"])
    assert gemm.parse_decode(presets, tokens, rest) == ([1, 16, 64], ["--rep", "5"])
    assert gemm.parse_decode(None, None, ["--rep", "5"]) == (None, ["--rep", "5"])


@pytest.mark.parametrize("tokens", [1, 16])
def test_decode_calls_time_the_forward_as_a_decode_step_runs_it(tokens):
    """The decode rows' calls (CPU here): BF16 torch.mm; cuBLAS's FP8 rows only where the token count is a multiple of
    16; lowbit's GEMM on the weight quantized once, and with the activation's quantization in the call, which gives
    the same bits."""
    import torch

    from lowbit.quant import Float8Blockwise, quantize

    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 256, generator=g).bfloat16()
    w = (torch.randn(384, 256, generator=g) * 0.02).bfloat16()
    calls = gemm._decode_calls(x, w, quantize(w, Float8Blockwise(block_dim=2)))
    cublas = ["cuBLAS fp8 tensorwise", "cuBLAS fp8 blockwise"] if tokens % 16 == 0 else []
    assert list(calls) == ["bf16 torch.mm", *cublas, "lowbit fp8-block", "lowbit fp8-block, quantize x + GEMM"]
    assert calls["bf16 torch.mm"]().shape == (tokens, 384)
    y = calls["lowbit fp8-block"]()
    assert y.shape == (tokens, 384) and y.dtype == torch.bfloat16
    assert torch.equal(calls["lowbit fp8-block, quantize x + GEMM"](), y)


def test_deepgemm_rows_compute_the_pairings_on_the_same_codes(monkeypatch):
    """Where ``deep_gemm`` imports, each pairing gets a DeepGEMM row whose call computes that pairing from the same
    codes and scales as lowbit's (checked here against the float64 reference through a stand-in that keeps
    DeepGEMM's operand contract); without it, no rows."""
    import sys

    import torch

    from lowbit.gemm.reference import scaled_mm_reference
    from lowbit.quant import Float8Blockwise, quantize

    g = torch.Generator().manual_seed(3)
    x, dy, w = (torch.randn(*shape, generator=g) for shape in ((256, 384), (256, 640), (640, 384)))
    act = Float8Blockwise()
    qx, qdy = (quantize(t.bfloat16(), act, rowwise=True, columnwise=True) for t in (x, dy))
    qw = quantize(w.bfloat16(), Float8Blockwise(block_dim=2), rowwise=True, columnwise=True)
    monkeypatch.setitem(sys.modules, "deep_gemm", None)
    assert gemm._deepgemm_calls(qx, qdy, qw) == {}
    monkeypatch.setitem(sys.modules, "deep_gemm", fake_deep_gemm.make())
    calls = gemm._deepgemm_calls(qx, qdy, qw)
    assert {p: list(f) for p, f in calls.items()} == {
        "fprop": ["DeepGEMM 1d2d"], "dgrad": ["DeepGEMM 1d2d"], "wgrad": ["DeepGEMM 1d1d, += fp32"]}
    bf16 = torch.bfloat16
    ref = {"fprop": scaled_mm_reference(qx, qw, out_dtype=bf16)[0],
           "dgrad": scaled_mm_reference(qdy, qw, b_copy="columnwise", out_dtype=bf16)[0],
           "wgrad": scaled_mm_reference(qdy, qx, a_copy="columnwise", b_copy="columnwise")[0]}
    for pairing, fns in calls.items():
        (fn,) = fns.values()
        assert torch.equal(fn(), ref[pairing]), pairing
    assert torch.equal(calls["wgrad"]["DeepGEMM 1d1d, += fp32"](), 2 * ref["wgrad"])  # (it accumulates)


def test_back_to_back_rows_run_a_steps_gemms_in_order():
    """The back-to-back rows run each family's GEMMs in a step's order (forwards in layer order, then dgrad and wgrad
    from the last layer back), each layer's own call; a family missing from any layer gets no row."""
    ran = []

    def layer(i, with_deepgemm):
        calls = {p: {k: (lambda i=i, p=p, k=k: ran.append((i, p, k))) for k in
                     ("bf16 torch.mm", "cuBLAS fp8 tensorwise", "cuBLAS fp8 blockwise")}
                 for p in ("fprop", "dgrad", "wgrad")}
        calls["fprop"]["lowbit fp8-block"] = calls["dgrad"]["lowbit fp8-block"] = lambda i=i: ran.append((i, "lb"))
        calls["wgrad"]["lowbit wgrad_mm"] = lambda i=i: ran.append((i, "wgrad_mm"))
        if with_deepgemm:
            calls["fprop"]["DeepGEMM 1d2d"] = lambda: None
        return calls

    rows = gemm.block_calls([layer(0, True), layer(1, False)])
    assert list(rows) == ["bf16 torch.mm", "cuBLAS fp8 tensorwise", "cuBLAS fp8 blockwise", "lowbit fp8-block"]
    rows["cuBLAS fp8 blockwise"]()
    k = "cuBLAS fp8 blockwise"
    assert ran == [(0, "fprop", k), (1, "fprop", k), (1, "dgrad", k), (1, "wgrad", k), (0, "dgrad", k), (0, "wgrad", k)]
    ran.clear()
    rows["lowbit fp8-block"]()
    assert ran == [(0, "lb"), (1, "lb"), (1, "lb"), (1, "wgrad_mm"), (0, "lb"), (0, "wgrad_mm")]
    assert gemm.block_calls([]) == {}


def test_lowbit_fp8_block_rows_are_what_scaled_mm_picks():
    """The per-GEMM rows' "lowbit fp8-block" calls are ``scaled_mm`` with no backend named: fprop and dgrad give the
    float64 reference's bits wherever they run (here on the CPU, the reference itself)."""
    import torch

    from lowbit.gemm.reference import scaled_mm_reference

    torch.manual_seed(5)
    x, dy, w, qx, qdy, qw = gemm.layer_operands(128, 256, 384, torch.device("cpu"))
    calls = gemm._layer_calls(x, dy, w, qx, qdy, qw)
    bf16 = torch.bfloat16
    assert torch.equal(calls["fprop"]["lowbit fp8-block"](), scaled_mm_reference(qx, qw, out_dtype=bf16)[0])
    assert torch.equal(calls["dgrad"]["lowbit fp8-block"](),
                       scaled_mm_reference(qdy, qw, b_copy="columnwise", out_dtype=bf16)[0])
