"""`lowbit eval`: a checkpoint's validation loss with its attention swapped to each variant. CPU, the tiny preset:
the quantized variants run lowbit.attention's reference backend."""

import json
import math
import re

import pytest
import torch

from lowbit.train.cli import add_train_args
from lowbit.train.evaluate import DEFAULT_VARIANTS, evaluate_attention, main, parse_variants

WINDOWS, BATCH, SEQ = 4, 4, 64


@pytest.fixture(scope="module")
def run(tmp_path_factory, small_text, cache_dir):
    """A 2-step fp8-current run (its checkpoint's recipe quantizes the GEMMs of every evaluation): its summary."""
    import argparse

    from lowbit.train.cli import run_train

    out = tmp_path_factory.mktemp("eval-run")
    args = add_train_args(argparse.ArgumentParser()).parse_args(
        ["--recipe", "fp8-current", "--steps", "2", "--batch-size", str(BATCH), "--seq-len", str(SEQ),
         "--eval-windows", str(WINDOWS), "--data", small_text, "--cache-dir", cache_dir, "--out-dir", str(out),
         "--device", "cpu", "--no-progress"])
    return run_train(args)


def _eval_args(run, small_text, cache_dir, *extra):
    return [run["out_dir"], "--eval-windows", str(WINDOWS), "--batch-size", str(BATCH), "--data", small_text,
            "--cache-dir", cache_dir, "--device", "cpu", *map(str, extra)]


def test_eval_cli_sdpa_is_the_runs_val_loss_and_quantized_attention_is_close(run, small_text, cache_dir, tmp_path,
                                                                            capsys):
    out = tmp_path / "eval.json"
    assert main(_eval_args(run, small_text, cache_dir, "--json", out, "--no-progress")) == 0
    text = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["recipe"] == "fp8-current" and r["step"] == 2 and r["windows"] == WINDOWS and r["seq_len"] == SEQ
    assert r["baseline"] == "sdpa" and [v["variant"] for v in r["variants"]] == list(DEFAULT_VARIANTS)
    sdpa, *quantized = r["variants"]
    # the same windows, batches and forward (the run's recipe) as the run's last validation: the same bits
    assert sdpa["val_loss"] == run["final_val_loss"] and sdpa["kernel"] == "sdpa"
    for v in quantized:
        assert v["kernel"] == "reference" and math.isfinite(v["val_loss"])
        assert v["val_loss"] != sdpa["val_loss"]  # the attention was swapped
        assert abs(v["gap_pct"]) < 0.5  # (the guide's bar for INT8·FP8 on a 350m model; here ~0.01%)
        assert v["gap_pct"] == pytest.approx(100 * (v["val_loss"] - sdpa["val_loss"]) / sdpa["val_loss"])
        assert v["seconds"] > 0 and v["nonfinite_events"] == 0
        row = rf"^{v['variant']} +reference +{v['val_loss']:.6f} +{re.escape(format(v['gap_pct'], '+.4f'))}% "
        assert re.search(row, text, re.M), text
    assert re.search(rf"^sdpa +sdpa +{sdpa['val_loss']:.6f} +— ", text, re.M)


def test_eval_api_adds_the_baseline_and_reads_a_named_file(run, small_text, cache_dir, capsys):
    r = evaluate_attention(f"{run['out_dir']}/checkpoint-step2.pt", "int8-bf16", eval_windows=1, seq_len=32,
                           batch_size=1, data=small_text, cache_dir=cache_dir, device="cpu")
    assert [v["variant"] for v in r["variants"]] == ["sdpa", "int8-bf16"] and r["seq_len"] == 32
    assert r["checkpoint"].endswith("checkpoint-step2.pt") and r["windows"] == 1 and r["tokens"] == 32
    assert abs(r["variants"][1]["gap_pct"]) < 0.5
    out = capsys.readouterr().out
    assert "[lowbit] eval sdpa: val loss" in out and "[lowbit] eval int8-bf16: val loss" in out
    assert "[lowbit] eval batch 2/2 (100%)  attention int8-bf16" in out  # progress (log lines: not a terminal)


@pytest.mark.parametrize("variants, pattern", [
    ("int4-bf16", r"attention_variants: unknown variant 'int4-bf16'; expected a comma-separated list of sdpa, "),
    ("", r"attention_variants: must be a comma-separated list of .*, got ''"),
    ("int8-fp8,sdpa,int8-fp8", r"attention_variants: each variant once, got 'int8-fp8' more than once"),
])
def test_bad_variants(variants, pattern):
    with pytest.raises(ValueError, match=pattern):
        parse_variants(variants)


def test_parse_variants_puts_the_baseline_first():
    assert parse_variants("int8-fp8, sdpa") == ("sdpa", "int8-fp8")
    assert parse_variants(["fp8-fp8"]) == ("sdpa", "fp8-fp8")


def test_bad_input_is_one_error_line(run, small_text, cache_dir, tmp_path, capsys):
    def error(*argv):
        with pytest.raises(SystemExit) as e:
            main([str(a) for a in argv])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("lowbit eval: error: ") and err.count("\n") == 1, err
        return err

    ck = f"{run['out_dir']}/checkpoint.pt"
    assert "unknown variant 'fp4-fp4'" in error(ck, "--attention-variants", "sdpa,fp4-fp4")
    assert f"checkpoint: no checkpoint at '{tmp_path / 'missing.pt'}'" in error(tmp_path / "missing.pt")
    assert f"checkpoint: no checkpoint at '{tmp_path / 'checkpoint.pt'}'" in error(tmp_path)  # a folder without one
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    assert f"checkpoint: '{bad}' is not a torch.save checkpoint" in error(bad)
    c = torch.load(ck, weights_only=True)
    c["step"] = 1  # changed after its digest was taken
    torch.save(c, bad)
    assert re.search(r"checkpoint: checkpoint .*bad\.pt': field 'step' does not match its SHA-256 digest",
                     error(bad))
    assert "seq_len: must be <= the model's max_seq_len (256), got 512" in error(
        *_eval_args(run, small_text, cache_dir, "--seq-len", 512))
    assert f"json: '{tmp_path}' is a folder" in error(ck, "--json", tmp_path)
    with pytest.raises(SystemExit):  # (argparse: the usage, then the error)
        main([ck, "--eval-windows", "0"])
    assert "argument --eval-windows: expected an integer >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"^eval_windows: must be an integer >= 1, got 0$"):
        evaluate_attention(ck, eval_windows=0)
