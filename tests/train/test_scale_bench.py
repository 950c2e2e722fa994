"""``lowbit bench scale`` on the CPU: one and two gloo processes of ``lowbit train`` (tiny preset, a few steps) end to
end through the CLI; the table's arithmetic on made-up summaries; bad input."""

import json

import pytest
from testenv import child_env

from lowbit.bench import scale
from lowbit.cli import main


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, small_text, cache_dir):
    """One run of the bench: fp8-block, FSDP2 on 2 processes against 1 (and the grad-accum 2 loss check)."""
    out = tmp_path_factory.mktemp("scale")
    argv = ["bench", "scale", "--device", "cpu", "--recipes", "fp8-block", "--modes", "fsdp", "--gpus", "2",
            "--steps", "4", "--step-profile", "1", "--data", small_text, "--cache-dir", cache_dir, "--out", str(out)]
    return out, argv


def test_smoke_run_end_to_end(smoke, capsys, monkeypatch):
    out, argv = smoke
    for k, v in child_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore").items():
        monkeypatch.setenv(k, v)
    assert main(argv) == 0
    text = capsys.readouterr().out
    for line in ("[bench scale] 4 runs of lowbit train", "run 1/4: fp8-block eager on 1 process",
                 "run 2/4: fp8-block fsdp on 2 processes", "run 3/4: fp8-block grad-accum 2 on 1 process",
                 "run 4/4: fp8-block batch 8 x grad-accum 1 on 1 process",
                 "[lowbit] step profile (steps 3-3, mean of 2 rank(s))", "| fp8-block | fsdp | 2 |"):
        assert line in text, line
    data = json.loads((out / "scaling.json").read_text())
    assert (out / "scaling.md").read_text().startswith("## lowbit bench scale") and data["complete"] is True
    rows = {(r["mode"], r["gpus"]): r for r in data["rows"]}
    assert set(rows) == {("1 GPU eager", 1), ("fsdp", 2)}
    one, two = rows[("1 GPU eager", 1)], rows[("fsdp", 2)]
    assert one["status"] == two["status"] == "ok"
    assert one["world_size"] == 1 and two["world_size"] == 2 and two["fsdp"]
    assert two["tokens_per_s_per_gpu"] == pytest.approx(two["tokens_per_s"] / 2)
    assert two["x_eager"] == pytest.approx(two["tokens_per_s"] / one["tokens_per_s"])
    assert two["eff_eager"] == pytest.approx(two["x_eager"] / 2)
    assert "x_graph" not in two  # (no CUDA graphs on the CPU)
    assert two["max_loss_diff"] is not None and two["max_loss_diff"] < 1e-3  # same global batch as grad-accum 2
    assert two["loss_floor"] is not None and two["loss_floor"] < 1e-3  # (the same batch in one micro-batch)
    sp = two["step_profile"]
    assert sp["comm_ms"] > 0 and sp["compute_ms"] > 0 and "all_gather" in sp["comm_kinds_ms"]
    assert sp["wall_ms"] == pytest.approx(sp["compute_ms"] + sp["exposed_comm_ms"] + sp["host_ms"])
    for d in ("fp8-block/1gpu-accum2", "fp8-block/1gpu-floor2"):  # (the loss check is not profiled)
        assert "--step-profile" not in data["commands"][d]
    floor = data["commands"]["fp8-block/1gpu-floor2"]
    assert " --batch-size 8 --grad-accum 1 " in floor  # (after the per-GPU --batch-size 4: it wins)
    assert "--no-save" in data["commands"]["fp8-block/fsdp-2gpu"] and not list(out.rglob("checkpoint*.pt"))
    if data["plot"] is not None:
        assert (out / "scaling.png").stat().st_size > 0

    # --reuse keeps the runs made with the same command lines; --report-only rebuilds the table from them
    assert main(argv + ["--reuse"]) == 0
    text = capsys.readouterr().out
    assert text.count(": reused ") == 4 and "run 1/4" not in text
    assert main(argv + ["--report-only"]) == 0
    again = json.loads((out / "scaling.json").read_text())
    assert [r["tokens_per_s"] for r in again["rows"]] == [r["tokens_per_s"] for r in data["rows"]]


def _summary(tps, losses, world=1, profile=None):
    return {"status": "ok", "tokens_per_s": tps, "world_size": world, "history": {"train": list(enumerate(losses, 1))},
            "final_train_loss": losses[-1], "final_val_loss": losses[-1], "peak_memory_bytes": 2**30,
            "step_profile": {"mean": profile} if profile else None}


def test_table_arithmetic():
    cfg = dict(device="cuda", gpus=[1, 2, 4], recipes=["bf16", "fp8-block"], modes=["fsdp", "fsdp-fp8ag"],
               refs=["graph", "eager"], loss_check=True, step_profile=2, model="350m", steps=50, batch_size=4,
               seq_len=2048)
    runs = scale.plan(cfg)
    assert {r["dir"] for r in runs if r["kind"] == "ref"} == {"bf16/1gpu-graph", "bf16/1gpu-eager",
                                                                  "fp8-block/1gpu-graph", "fp8-block/1gpu-eager"}
    assert next(r for r in runs if r["dir"] == "bf16/fsdp-fp8ag-2gpu")["skip"]  # (bf16 gathers no FP8)
    prof = dict(wall_ms=10.0, compute_ms=6.0, comm_ms=4.0, exposed_comm_ms=1.0, host_ms=3.0, overlap_pct=75.0,
                comm_kinds_ms={"all_gather": 4.0}, concurrent_ms=1.5)
    res = {"bf16/1gpu-graph": _summary(100.0, [2.0, 1.0]), "bf16/1gpu-eager": _summary(50.0, [2.0, 1.0]),
           "bf16/fsdp-2gpu": _summary(190.0, [2.0, 1.001], 2, prof), "bf16/fsdp-4gpu": _summary(300.0, [2, 1], 4),
           "bf16/1gpu-accum2": _summary(1.0, [2.0, 1.0]), "bf16/1gpu-accum4": _summary(1.0, [2.0, 1.0]),
           "fp8-block/1gpu-graph": _summary(120.0, [2.0, 1.0]), "fp8-block/fsdp-2gpu": _summary(228.0, [2.1, 1.0], 2),
           "fp8-block/1gpu-accum2": _summary(1.0, [2.0, 1.0]), "bf16/1gpu-floor2": _summary(1.0, [2.0, 1.02]),
           "bf16/1gpu-floor4": _summary(1.0, [2.0, 1.0])}
    floors = {r["dir"]: r["flags"] for r in runs if r["kind"] == "floor"}  # (per-GPU batch 4)
    assert floors["bf16/1gpu-floor2"] == ["--batch-size", "8", "--grad-accum", "1"]
    assert floors["bf16/1gpu-floor4"] == ["--batch-size", "8", "--grad-accum", "2"]
    assert scale.plan({**cfg, "gpus": [3]})[-1]["flags"] == ["--batch-size", "12", "--grad-accum", "1"]
    table = scale.rows(cfg, runs, res)
    row = {(r["recipe"], r["mode"], r["gpus"]): r for r in table}
    b2 = row[("bf16", "fsdp", 2)]
    assert b2["x_graph"] == pytest.approx(1.9) and b2["eff_graph"] == pytest.approx(0.95) and b2["target_met"]
    assert b2["x_eager"] == pytest.approx(3.8) and b2["max_loss_diff"] == pytest.approx(0.001)
    assert b2["loss_floor"] == pytest.approx(0.02) and row[("bf16", "fsdp", 4)]["loss_floor"] == 0
    assert "loss_floor" not in row[("fp8-block", "fsdp", 2)]  # (its floor run did not run)
    b4 = row[("bf16", "fsdp", 4)]
    assert b4["x_graph"] == pytest.approx(3.0) and not b4["target_met"] and b4["target"] == 3.6
    f2 = row[("fp8-block", "fsdp", 2)]
    assert f2["x_bf16"] == pytest.approx(228 / 190) and f2["max_loss_diff"] == pytest.approx(0.05)
    assert "x_eager" not in f2  # (its eager reference did not run)
    assert row[("fp8-block", "1 GPU graph", 1)]["x_bf16"] == pytest.approx(1.2)
    assert row[("bf16", "fsdp-fp8ag", 2)]["status"].startswith("skipped:")
    assert row[("fp8-block", "fsdp", 4)]["status"] == "skipped: not run"
    md = scale.markdown(cfg, table)
    assert "every run with" not in md
    assert "; every run with `--grad-reduce-dtype bfloat16`." in scale.markdown(
        {**cfg, "train_args": ["--grad-reduce-dtype", "bfloat16"]}, table)
    assert "| bf16 | fsdp | 2 | 190 | 95 | 1.90 (met) | 95% | 3.80 | 190% | - | - | 1.00 |" in md
    assert "| 0.100% | 2.000% | 6.0 (1.5) | 1.0 | 3.0 | 4.0 (75%) |" in md and "5.000% (> target) | - |" in md
    assert "grew" not in md  # (no run profiled its kernels)


def test_fp8_over_the_fastest_bf16_peer():
    """fp8/bf16 of a low-precision-gather mode divides by the fastest BF16 run among that mode's peers (BF16's own
    gather, FSDP2's plain one) on as many GPUs; other modes by BF16 in the same mode only."""
    cfg = dict(device="cuda", gpus=[1, 2], recipes=["bf16", "fp8-block"],
               modes=["fsdp-keep", "fsdp-bf16ag-keep", "fsdp-fp8ag-keep", "ddp"], refs=["graph"], loss_check=False,
               step_profile=0, model="350m", steps=20, batch_size=4, seq_len=2048)
    runs = scale.plan(cfg)
    skipped = {r["dir"] for r in runs if r.get("skip")}
    assert skipped == {"bf16/fsdp-fp8ag-keep-2gpu", "fp8-block/fsdp-bf16ag-keep-2gpu"}
    res = {"bf16/1gpu-graph": _summary(100.0, [2.0, 1.0]), "bf16/fsdp-keep-2gpu": _summary(180.0, [2, 1], 2),
           "bf16/fsdp-bf16ag-keep-2gpu": _summary(186.0, [2, 1], 2), "bf16/ddp-2gpu": _summary(185.0, [2, 1], 2),
           "fp8-block/1gpu-graph": _summary(117.0, [2.0, 1.0]),
           "fp8-block/fsdp-fp8ag-keep-2gpu": _summary(217.0, [2, 1], 2),
           "fp8-block/fsdp-keep-2gpu": _summary(210.0, [2, 1], 2), "fp8-block/ddp-2gpu": _summary(222.0, [2, 1], 2)}
    row = {(r["recipe"], r["mode"], r["gpus"]): r for r in scale.rows(cfg, runs, res)}
    assert row[("fp8-block", "fsdp-fp8ag-keep", 2)]["x_bf16"] == pytest.approx(217 / 186)
    assert row[("fp8-block", "fsdp-keep", 2)]["x_bf16"] == pytest.approx(210 / 180)
    assert row[("fp8-block", "ddp", 2)]["x_bf16"] == pytest.approx(222 / 185)
    assert scale.peer_modes("fsdp-fp8ag") == {"fsdp-fp8ag", "fsdp-bf16ag", "fsdp"}


def test_kernel_growth_over_one_gpu():
    cfg = dict(device="cuda", gpus=[1, 2], recipes=["fp8-block"], modes=["fsdp", "ddp"], refs=["graph"],
               loss_check=False, step_profile=2, model="350m", steps=50, batch_size=4, seq_len=2048)
    runs = scale.plan(cfg)

    def prof(kernels, idle=None):
        return dict(wall_ms=10.0, compute_ms=6.0, comm_ms=0.0, exposed_comm_ms=0.0, host_ms=4.0, overlap_pct=None,
                    comm_kinds_ms={}, kernels_ms=kernels, idle=idle or {})

    res = {"fp8-block/1gpu-graph": _summary(100.0, [2.0, 1.0], 1, prof({"gemm": 5.0, "quantize": 1.0, "rope": 0.5})),
           "fp8-block/fsdp-2gpu": _summary(150.0, [2.0, 1.0], 2, prof(
               {"gemm": 5.5, "quantize": 2.25, "ncclDevKernel_AllGather": 3.0, "copy": 0.25},
               {"nccl | nccl": [2.5, 14], "gemm | <step end>": [0.5, 1], "a | b": [0.25, 2], "c | d": [0.125, 1]})),
           "fp8-block/ddp-2gpu": _summary(190.0, [2.0, 1.0], 2)}  # (no kernels: no line)
    table = scale.rows(cfg, runs, res)
    ((row, items),) = scale.kernel_growth(table, top=3)
    assert row["mode"] == "fsdp"
    assert items == [("ncclDevKernel_AllGather", 3.0), ("quantize", 1.25), ("gemm", 0.5)]
    md = scale.markdown(cfg, table)
    assert "- fp8-block fsdp (2 GPUs): `ncclDevKernel_AllGather` +3.00, `quantize` +1.25, `gemm` +0.50" in md
    # the idle time by the kernels around it: the largest IDLE_TOP pairs of each run that has them
    assert "- fp8-block fsdp (2 GPUs): `nccl | nccl` 2.50 (14), `gemm | <step end>` 0.50 (1), `a | b` 0.25 (2)\n" in md
    assert md.count("`nccl | nccl`") == 1 and "`c | d`" not in md


def test_table_takes_non_finite_losses():
    """summary.json holds a non-finite loss as a string ("nan"): the table shows it."""
    cfg = dict(device="cpu", gpus=[1], recipes=["bf16"], modes=[], refs=["eager"], loss_check=False, step_profile=0,
               model="tiny", steps=6, batch_size=4, seq_len=64)
    runs = scale.plan(cfg)
    res = {"bf16/1gpu-eager": {**_summary(10.0, [2.0, 1.0]), "final_train_loss": "nan", "final_val_loss": "inf"}}
    md = scale.markdown(cfg, scale.rows(cfg, runs, res))
    assert "| bf16 | 1 GPU eager | 1 | 10 | 10 |" in md and "| nan | inf |" in md


@pytest.mark.parametrize("args, msg", [
    (["--recipes", "fp9"], "unknown recipe 'fp9'"),
    (["--modes", "zero3"], "unknown mode 'zero3'"),
    (["--gpus", "1,x"], "--gpus: expected comma-separated integers"),
    (["--gpus", "0"], "--gpus: each count must be >= 1"),
    (["--steps", "3"], "--steps: must exceed the untimed steps"),
    (["--model", "7b"], "unknown preset '7b'"),
    (["--train-args", "'--lr"], "--train-args"),
    (["--refs", "graph"], "--refs: graph needs CUDA"),
    (["--refs", "eager,fast"], "unknown reference 'fast'"),
])
def test_bad_input(args, msg, capsys):
    assert main(["bench", "scale", "--device", "cpu", *args]) == 2
    assert msg in capsys.readouterr().err


def test_table_written_after_each_run(tmp_path, monkeypatch, capsys):
    """A sweep cut short keeps the table of the runs that finished: it is rewritten after each run (marked
    incomplete until the end)."""
    calls = []

    def fake_launch(cmd, run_dir, timeout, log):
        calls.append(run_dir)
        if len(calls) == 2:
            raise ValueError("stopped here")
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "summary.json").write_text(json.dumps(_summary(123.0, [2.0, 1.0])))
        return 0, ""

    monkeypatch.setattr(scale, "launch", fake_launch)
    argv = ["bench", "scale", "--device", "cpu", "--recipes", "fp8-block", "--modes", "fsdp", "--gpus", "2",
            "--no-loss-check", "--out", str(tmp_path)]
    assert main(argv) == 2 and "stopped here" in capsys.readouterr().err
    assert len(calls) == 2
    assert "| fp8-block | 1 GPU eager | 1 | 123 | 123 |" in (tmp_path / "scaling.md").read_text()
    data = json.loads((tmp_path / "scaling.json").read_text())
    assert data["complete"] is False and data["plot"] is None
    assert [r["status"] for r in data["rows"]] == ["ok", "skipped: not run"]


def test_train_args_take_a_lone_flag():
    """``--train-args --deterministic`` (one flag, no space: argparse would take it for an option of its own)."""
    assert scale.parse_args(["--train-args", "--deterministic", "--gpus", "2"]).train_args == "--deterministic"
    assert scale.parse_args(["--train-args", "--attention sdpa"]).train_args == "--attention sdpa"
    assert scale.parse_args(["--train-args=--compile"]).train_args == "--compile"


def test_compiled_modes_take_the_compiled_reference_and_valid_train_flags():
    """A compile mode adds the one-GPU compiled reference by default, and each mode's flags are a valid lowbit train
    configuration."""
    import argparse

    from lowbit.train.cli import add_train_args, config_from_args

    def config(flags, recipe="fp8-block"):
        c = config_from_args(add_train_args(argparse.ArgumentParser()).parse_args(["--recipe", recipe, *flags]))
        c.validate()
        return c

    cfg = scale.resolve(scale.parse_args(["--device", "cpu", "--modes", "fsdp-compile", "--gpus", "2"]))
    assert cfg["refs"] == ["eager", "compile"]
    for mode, flags in scale.MODES.items():
        c = config(flags, "bf16" if "bf16ag" in mode else "fp8-block")
        assert c.fsdp == ("--fsdp" in flags) and c.compile == ("--compile" in flags), mode
    bf16ag = config(scale.MODES["fsdp-bf16ag-keep"], "bf16")
    assert bf16ag.bf16_all_gather and not bf16ag.fsdp_reshard_after_forward
    fp8_runs = scale.plan(dict(cfg, recipes=["fp8-block"], modes=["fsdp-bf16ag"], loss_check=False))
    assert [r["skip"] for r in fp8_runs if r["kind"] == "mode"] == ["--bf16-all-gather takes bf16"]
    assert config(scale.MODES["fsdp-eager"]).cuda_graph == config(scale.MODES["ddp-eager"]).cuda_graph == "off"
    both = config(scale.MODES["fsdp-fp8ag-keep"])
    assert both.fp8_all_gather and not both.fsdp_reshard_after_forward
    bf16_runs = scale.plan(dict(cfg, recipes=["bf16"], modes=["fsdp-fp8ag-keep"], loss_check=False))
    assert [r["skip"] for r in bf16_runs if r["kind"] == "mode"] == ["--fp8-all-gather takes fp8-block or fp8-current "
                                                                      "or fp8-delayed"]
