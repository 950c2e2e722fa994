"""``lowbit bench prefill`` on the CPU: the tiny model's variants run, lowbit's attention serves the calls, the
quantized variants' logits differ from SDPA's (and SDPA's own row has no error), and the bound's arithmetic."""
import json
import math

import pytest

from lowbit.bench import prefill


def test_cpu_run_writes_rows(tmp_path):
    out = tmp_path / "prefill.md"
    rc = prefill.main(["--device", "cpu", "--reps", "1", "--warmup", "1", "--seq-len", "48",
                       "--variants", "sdpa,int8-bf16,fp8-block+sdpa,fp8-block:fused+sdpa,fp8-block:fused:cached+sdpa",
                       "--out", str(out)])
    assert rc == 0
    data = json.loads((tmp_path / "prefill.md.json").read_text())
    rows = {r["variant"]: r for r in data["rows"]}
    assert all(r["status"] == "ok" and r["ttft_ms"] > 0 for r in rows.values()), rows
    assert rows["sdpa"]["nrmse"] is None and "served" not in rows["sdpa"]
    # tiny: 2 layers, one attention call each a forward; 1 timed call + 1 queued after the snapshot
    assert rows["int8-bf16"]["served"] == rows["int8-bf16"]["attention_calls"] == 4
    assert rows["fp8-block+sdpa"]["converted"] > 0 and "fused" not in rows["fp8-block+sdpa"]
    assert rows["fp8-block:fused+sdpa"]["fused"] == 4 * 2  # each layer's QKV and MLP, and both its norms moved in
    # :cached: each layer's 4 GEMMs (QKV, O, gate/up, down) quantized in the warm-up call, kept for the 2 timed calls
    assert rows["fp8-block:fused:cached+sdpa"]["weights_reused"] == 2 * 4 * 2
    assert rows["fp8-block:fused:cached+sdpa"]["nrmse"] == rows["fp8-block:fused+sdpa"]["nrmse"]  # the same bits
    # (the last token's logits against SDPA's: INT8 Q·Kᵀ measures 5e-3 here, FP8 linears 5.5e-2)
    for v, most in (("int8-bf16", 2e-2), ("fp8-block+sdpa", 0.15), ("fp8-block:fused+sdpa", 0.15)):
        assert 0 < rows[v]["nrmse"] < most, rows[v]
    assert data["bounds"] == []  # (CUDA only)
    assert "| int8-bf16 |" in out.read_text()


@pytest.mark.parametrize("variant,msg", [
    ("flash", "the attention must be one of sdpa, int8-fp8, int8-bf16, got 'flash'"),
    ("fp9+sdpa", "the recipe must be one of .*got 'fp9'"),
    (":fused+sdpa", "the recipe must be one of .*got ''"),
    ("fp8-block:fast+sdpa", "after the recipe only :fused, :cached may follow, each once, got ':fast'"),
    ("fp8-block:fused:fused+sdpa", "after the recipe only :fused, :cached may follow, each once, got ':fused:fused'")])
def test_bad_variant_names_the_rule(variant, msg):
    with pytest.raises(ValueError, match=f"--variants: '{variant.replace('+', '[+]')}': {msg}"):
        prefill.resolve(prefill.parse_args(["--device", "cpu", "--variants", variant]))


def test_bad_numbers_and_exit_status(capsys):
    assert prefill.main(["--device", "cpu", "--seq-len", "1"]) == 2
    assert "--seq-len: must be at least 2, got 1" in capsys.readouterr().err
    assert prefill.main(["--device", "cpu", "--size", "8b"]) == 2
    assert "--size: on the CPU only 'tiny' runs" in capsys.readouterr().err


def test_bound_is_amdahl():
    """Attention at half SDPA's time, SDPA's attention 40% of the TTFT: the prefill can gain at most 1/(1-0.2)."""
    rows = [{"variant": "sdpa", "status": "ok", "ttft_ms": 100.0}]
    b = prefill.bound_rows(rows, {"sdpa": 2.0, "int8-fp8": 1.0}, layers=20)
    assert len(b) == 1 and b[0]["x_sdpa"] == 2.0
    assert math.isclose(b[0]["share"], 0.4) and math.isclose(b[0]["bound"], 1 / 0.8)
