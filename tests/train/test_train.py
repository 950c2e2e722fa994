"""lowbit train / lowbit demo on the CPU: loss goes down, reports, resume, faults, bad input."""

import json
import math

import pytest
import torch
from testenv import child_env

from lowbit.train import checkpoint as ckpt
from lowbit.train.cli import run_train
from lowbit.train.loop import TrainConfig, train

QUIET = ("--no-progress",)


def _losses(summary):
    return [l for _, l in summary["history"]["train"]]


def test_train_tiny_20_steps_loss_goes_down(tmp_path, cache_dir, targs):
    """`lowbit train --model tiny --steps 20` on the default (standard-library) corpus."""
    s = run_train(targs("--model", "tiny", "--steps", 20, "--out-dir", tmp_path, "--cache-dir", cache_dir,
                        "--eval-windows", 16, *QUIET))
    ls = _losses(s)
    assert len(ls) == 20 and all(math.isfinite(v) for v in ls)
    assert sum(ls[-3:]) / 3 < sum(ls[:3]) / 3 - 0.8, ls  # starts near ln(256) = 5.5; bytes are easy early on
    assert s["final_val_loss"] < ls[0]
    assert s["data"]["source"].startswith("python-stdlib")
    assert (tmp_path / "summary.json").exists() and (tmp_path / "loss.png").exists()
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 20
    # the checkpoint is plain tensors + python values
    ck = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert ck["step"] == 20 and ck["model_config"]["d_model"] == 128


def test_train_fp8_block_loss_goes_down(tmp_path, small_text, cache_dir):
    s = train(TrainConfig(recipe="fp8-block", steps=12, batch_size=8, seq_len=64, data=small_text, cache_dir=cache_dir,
                          out_dir=str(tmp_path), eval_windows=8, progress=False, verbose=False))
    ls = _losses(s)
    assert sum(ls[-3:]) / 3 < sum(ls[:3]) / 3 - 0.5, ls
    assert s["weight_bytes_quantized"] < 0.6 * s["weight_bytes_bf16"]  # FP8 + 128x128 scales vs BF16
    assert not s["events"]


@pytest.mark.parametrize("recipe", ["fp8-delayed", "nvfp4"])
def test_kill_and_resume_equals_uninterrupted(tmp_path, small_text, cache_dir, recipe, monkeypatch):
    """Stop after step 5 (checkpoint at 4), resume: the trajectory is identical, bit for bit.

    fp8-delayed carries amax histories in its state; nvfp4 uses stochastic rounding (keyed by step).
    """
    base = dict(recipe=recipe, steps=8, batch_size=4, seq_len=64, data=small_text, cache_dir=cache_dir,
                eval_every=4, eval_windows=4, progress=False, verbose=False)
    full = train(TrainConfig(out_dir=str(tmp_path / "full"), **base))

    run = str(tmp_path / "killed")
    part = train(TrainConfig(out_dir=run, ckpt_every=4, stop_at_step=5, **base))
    assert part["stopped_early"] and part["steps"] == 5
    ck_file = tmp_path / "killed" / "checkpoint.pt"
    assert torch.load(ck_file, weights_only=True)["step"] == 4

    # a crash in the middle of writing the next checkpoint leaves the previous one intact
    real_save = torch.save

    def dying_save(obj, f, *a, **k):
        f.write(b"partial garbage")
        raise KeyboardInterrupt("killed mid-checkpoint")

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(ck_file, {"step": 99})
    monkeypatch.setattr(torch, "save", real_save)
    assert torch.load(ck_file, weights_only=True)["step"] == 4
    assert [p.name for p in ck_file.parent.iterdir() if p.name.startswith(".")] == []

    resumed = train(TrainConfig(out_dir=run, ckpt_every=4, resume="auto", **base))
    assert resumed["history"]["train"] == full["history"]["train"]
    assert resumed["history"]["val"] == full["history"]["val"]
    assert resumed["final_val_loss"] == full["final_val_loss"]


def test_nonfinite_skip_and_rollback_report_layer_and_step(tmp_path, small_text, cache_dir):
    base = dict(recipe="fp8-block", steps=6, batch_size=4, seq_len=64, data=small_text, cache_dir=cache_dir,
                eval_every=6, eval_windows=4, progress=False, verbose=False, fault_steps=(3,))
    s = train(TrainConfig(out_dir=str(tmp_path / "skip"), on_nonfinite="skip", **base))
    assert s["events"], "the injected inf was not reported"
    assert {e["step"] for e in s["events"]} == {3}
    assert all(e["action"] == "skip" for e in s["events"])
    assert any(e["layer"].startswith("blocks.0.") for e in s["events"]), s["events"]
    assert [st for st, _ in s["history"]["train"]] == [1, 2, 3, 5, 6]  # step index 3 (the 4th step) skipped
    assert math.isfinite(s["final_val_loss"])

    r = train(TrainConfig(out_dir=str(tmp_path / "rb"), on_nonfinite="rollback", ckpt_every=2, **base))
    assert {e["action"] for e in r["events"]} == {"rollback to step 2"}
    assert math.isfinite(r["final_val_loss"])

    with pytest.raises(FloatingPointError, match="step 3"):
        train(TrainConfig(out_dir=str(tmp_path / "raise"), on_nonfinite="raise", **base))


def test_cli_raise_on_nonfinite_ends_with_one_line(tmp_path, small_text, cache_dir, capsys):
    """``lowbit train --on-nonfinite raise``: the fault ends the command with one line naming the step, exit 3."""
    from lowbit.train.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--model", "tiny", "--recipe", "fp8-current", "--steps", "3", "--batch-size", "2", "--seq-len", "32",
              "--data", small_text, "--cache-dir", cache_dir, "--eval-windows", "2", "--no-progress", "--no-save",
              "--device", "cpu", "--fault-steps", "1", "--on-nonfinite", "raise", "--out-dir", str(tmp_path)])
    assert e.value.code == 3
    err = capsys.readouterr().err
    assert "lowbit train: stopped: step 1: non-finite" in err and "Traceback" not in err, err


def test_nonfinite_gradient_norm_skips_the_step(tmp_path, small_text, cache_dir, monkeypatch):
    """A non-finite gradient norm with a finite loss (BF16: no amax sentry) skips the step instead of writing NaN
    into the weights, reported as gradients/grad_norm (the update graph decides the same on the device)."""
    real, calls = torch.nn.utils.clip_grad_norm_, []

    def clip(params, max_norm, *a, **kw):
        calls.append(1)
        total = real(params, max_norm, *a, **kw)
        return total * float("inf") if len(calls) == 3 else total

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    # (on the CPU: a CUDA run computes the norm inside its update graph, not through clip_grad_norm_)
    s = train(TrainConfig(recipe="bf16", steps=5, batch_size=4, seq_len=64, data=small_text, cache_dir=cache_dir,
                          device="cpu",
                          eval_every=5, eval_windows=4, progress=False, verbose=False, out_dir=str(tmp_path)))
    assert [(e["step"], e["layer"], e["role"], e["action"]) for e in s["events"]] == [(2, "gradients", "grad_norm",
                                                                                       "skip")]
    assert [st for st, _ in s["history"]["train"]] == [1, 2, 4, 5]
    assert math.isfinite(s["final_val_loss"])


def test_compare_bf16(tmp_path, small_text, cache_dir, targs):
    s = run_train(targs("--recipe", "fp8-current", "--compare", "bf16", "--steps", 4, "--batch-size", 4, "--seq-len",
                        64,
                        "--data", small_text, "--cache-dir", cache_dir, "--out-dir", tmp_path, "--eval-windows", 4,
                        *QUIET))
    b = s["compare"]["bf16"]
    assert b["recipe"] == "bf16" and len(b["history"]["train"]) == 4
    assert abs(s["val_loss_gap_pct"]) < 5
    assert (tmp_path / "compare-bf16").is_dir()


def _png_ok(path):
    import matplotlib.image as mpimg

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    assert float(img[..., :3].std()) > 0.01  # not a blank canvas


def test_demo_writes_report(tmp_path, cache_dir, capsys):
    from lowbit.train.demo import run_demo

    out = tmp_path / "report"
    s = run_demo(["--steps", "4", "--batch-size", "4", "--seq-len", "128", "--eval-windows", "4", "--out", str(out),
                  "--cache-dir", cache_dir, "--no-progress", "--device", "cpu"])
    printed = capsys.readouterr().out
    for f in ("summary.json", "loss_curves.png", "table.md"):
        assert (out / f).is_file(), f
    _png_ok(out / "loss_curves.png")
    summ = json.loads((out / "summary.json").read_text())
    assert [r["recipe"] for r in summ["table"]] == ["bf16", "fp8-block", "nvfp4"]
    for name in ("bf16", "fp8-block", "nvfp4"):
        assert name in printed
    assert "gap vs bf16" in printed and "tokens/s" in printed
    rows = {r["recipe"]: r for r in summ["table"]}
    assert (rows["nvfp4"]["weight_bytes_quantized"] < rows["fp8-block"]["weight_bytes_quantized"]
            < rows["bf16"]["weight_bytes_quantized"])
    assert s["recipes"] == ["bf16", "fp8-block", "nvfp4"]


def test_demo_bad_recipe_list(capsys):
    from lowbit.train.demo import main

    assert main(["--recipes", "bf16,fp9"]) == 2
    assert "recipes: unknown recipe(s) ['fp9']" in capsys.readouterr().err


def test_train_png_valid(tmp_path, small_text, cache_dir, targs):
    run_train(targs("--steps", 3, "--batch-size", 2, "--seq-len", 32, "--data", small_text, "--cache-dir", cache_dir,
                    "--out-dir", tmp_path, "--eval-windows", 2, *QUIET))
    _png_ok(tmp_path / "loss.png")


# `lowbit <args>` whose checkpoint writer stalls at the rename of its second checkpoint.pt (the temporary file is
# complete), waiting to be killed
_STALL_SECOND_CHECKPOINT = """
import os, sys, time
import lowbit.train.checkpoint as ck
from lowbit.cli import main
renames = []
class _Os:
    def __getattr__(self, name):
        return getattr(os, name)
    @staticmethod
    def replace(src, dst):
        if os.path.basename(str(dst)) == "checkpoint.pt":
            renames.append(dst)
            while len(renames) == 2:
                time.sleep(1)
        return os.replace(src, dst)
ck.os = _Os()
sys.exit(main(sys.argv[1:]))
"""


def test_sigkill_mid_checkpoint_then_resume_equals_uninterrupted(tmp_path, small_text, cache_dir):
    """A real `lowbit train` process SIGKILLed while writing its step-6 checkpoint (the child's checkpoint module gets
    an ``os.replace`` that stalls at the second checkpoint's rename, after its temporary file is complete): the step-3
    checkpoint is intact, `--resume` continues from it, and the loss trajectory equals an uninterrupted run's."""
    import signal
    import subprocess
    import sys
    import time

    def cmd(out, *extra):
        return [sys.executable, "-m", "lowbit", "train", "--model", "tiny", "--recipe", "fp8-delayed", "--steps", "8",
                "--batch-size", "4", "--seq-len", "64", "--data", small_text, "--cache-dir", cache_dir, "--out-dir",
                str(tmp_path / out), "--eval-every", "4", "--eval-windows", "4", "--ckpt-every", "3", *QUIET, *extra]

    env = child_env(OMP_NUM_THREADS="1")
    logs = {n: open(tmp_path / f"{n}.log", "wb") for n in ("full", "killed", "resumed")}
    full = subprocess.Popen(cmd("full"), env=env, stdout=logs["full"], stderr=subprocess.STDOUT, cwd=tmp_path)
    killed = subprocess.Popen([sys.executable, "-c", _STALL_SECOND_CHECKPOINT, *cmd("killed")[3:]], env=env,
                              stdout=logs["killed"], stderr=subprocess.STDOUT, cwd=tmp_path)
    run = tmp_path / "killed"
    ck_file = run / "checkpoint.pt"
    try:
        deadline = time.monotonic() + 120
        while not (ck_file.exists() and list(run.glob(".checkpoint.pt.tmp*"))):
            assert killed.poll() is None, (tmp_path / "killed.log").read_text()
            assert time.monotonic() < deadline, "no stalled step-6 checkpoint write within 120 s"
            time.sleep(0.05)
        killed.send_signal(signal.SIGKILL)
        assert killed.wait(30) == -signal.SIGKILL
        assert full.wait(120) == 0, (tmp_path / "full.log").read_text()
    finally:
        for p in (full, killed):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert torch.load(ck_file, weights_only=True)["step"] == 3  # the previous checkpoint, intact
    assert not (run / "summary.json").exists()

    resumed = subprocess.run(cmd("killed", "--resume"), env=env, stdout=logs["resumed"], stderr=subprocess.STDOUT,
                             cwd=tmp_path, timeout=120)
    for f in logs.values():
        f.close()
    log = (tmp_path / "resumed.log").read_text()
    assert resumed.returncode == 0, log
    assert "resumed from" in log and "at step 3" in log, log
    assert [p.name for p in run.iterdir() if p.name.startswith(".")] == []  # the killed write's temp file is gone
    a = json.loads((tmp_path / "full" / "summary.json").read_text())
    b = json.loads((run / "summary.json").read_text())
    assert len(a["history"]["train"]) == 8
    assert b["history"]["train"] == a["history"]["train"]
    assert b["history"]["val"] == a["history"]["val"]
    assert torch.load(ck_file, weights_only=True)["step"] == 8


def test_train_on_a_folder_of_text_files(tmp_path, cache_dir, targs):
    """`--data FOLDER`: every text file below it (sorted, hidden ones left out, binary ones skipped and counted)."""
    import sysconfig
    from pathlib import Path

    root = Path(sysconfig.get_paths()["stdlib"])
    data = tmp_path / "texts"
    (data / "sub").mkdir(parents=True)
    texts = {"a.py": "argparse.py", "b.txt": "enum.py", "sub/c.py": "dataclasses.py"}
    for name, src in texts.items():
        (data / name).write_bytes((root / src).read_bytes())
    (data / "blob.bin").write_bytes(b"\0\1\2\3" * 1000)
    (data / ".hidden.txt").write_text("never read\n" * 1000)
    s = run_train(targs("--steps", 4, "--batch-size", 4, "--seq-len", 64, "--data", data, "--cache-dir", cache_dir,
                        "--out-dir", tmp_path / "run", "--eval-windows", 4, *QUIET))
    meta = s["data"]
    assert meta["source"] == str(data) and meta["files"] == 3 and meta["skipped_binary"] == 1
    expect = sum(len(b) + (not b.endswith(b"\n")) for b in ((data / n).read_bytes() for n in texts))
    assert meta["bytes"] == expect == meta["train_bytes"] + meta["val_bytes"]
    ls = _losses(s)
    assert len(ls) == 4 and all(math.isfinite(v) for v in ls) and ls[-1] < ls[0], ls
    assert math.isfinite(s["final_val_loss"])


def test_train_compiled_blocks_equal_eager(tmp_path, small_text, cache_dir):
    """`--compile`: every block torch.compile'd (one shared graph); fp8-block losses equal the eager run's to FP32
    rounding (Inductor compiles the norms, attention and residual arithmetic around lowbit's operators itself)."""
    import shutil

    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("Inductor on the CPU needs a C++ compiler")
    torch.compiler.reset()
    runs = {}
    for comp in (False, True):
        s = train(TrainConfig(recipe="fp8-block", steps=3, batch_size=4, seq_len=64, data=small_text,
                              cache_dir=cache_dir, out_dir=str(tmp_path / str(comp)), eval_windows=2, progress=False,
                              verbose=False, compile=comp, save_final=False))
        runs[comp] = _losses(s)
        assert s["compile"] is comp
    torch.compiler.reset()
    assert runs[True] == pytest.approx(runs[False], rel=1e-4), runs


def test_a_run_inherits_no_fault_of_one_that_raised(tmp_path, small_text, cache_dir):
    """A run that raised on an injected inf leaves sentry records behind in the process; the next run in the same
    process starts with none of them (its first step is not skipped for the other run's fault)."""
    base = dict(recipe="fp8-block", batch_size=4, seq_len=64, data=small_text, cache_dir=cache_dir, eval_windows=4,
                progress=False, verbose=False)
    with pytest.raises(FloatingPointError, match="step 1"):
        train(TrainConfig(out_dir=str(tmp_path / "raise"), steps=3, eval_every=3, on_nonfinite="raise",
                          fault_steps=(1,), **base))
    s = train(TrainConfig(out_dir=str(tmp_path / "next"), steps=2, eval_every=2, on_nonfinite="skip", **base))
    assert not s["events"], s["events"]
    assert [st for st, _ in s["history"]["train"]] == [1, 2]


def test_deterministic_mode_is_set_for_the_run_and_restored(tmp_path, small_text, cache_dir):
    """--deterministic: torch's deterministic algorithms (strict), cuDNN deterministic, lowbit's autotuning off and
    CUBLAS_WORKSPACE_CONFIG for the run, all restored after; two runs give the same losses to the last bit; the summary
    says so; a bad value is refused."""
    import os

    from lowbit.runtime import env
    from lowbit.train import loop

    seen = {}
    real = loop._train_run

    def spy(c, stop):
        seen.update(strict=torch.are_deterministic_algorithms_enabled()
                    and not torch.is_deterministic_algorithms_warn_only_enabled(),
                    cudnn=torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark,
                    autotune=env.get("LOWBIT_AUTOTUNE"), cublas=os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
        return real(c, stop)

    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              env.get("LOWBIT_AUTOTUNE"), os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    runs = []
    for i in range(2):
        cfg = TrainConfig(recipe="fp8-block", steps=3, batch_size=4, seq_len=64, data=small_text, cache_dir=cache_dir,
                          eval_every=3, eval_windows=2, progress=False, verbose=False, device="cpu",
                          out_dir=str(tmp_path / str(i)), save_final=False, deterministic=True)
        loop._train_run = spy
        try:
            runs.append(train(cfg))
        finally:
            loop._train_run = real
        assert seen == dict(strict=True, cudnn=True, autotune=False, cublas=before[3] or loop.CUBLAS_DETERMINISTIC)
        assert (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
                env.get("LOWBIT_AUTOTUNE"), os.environ.get("CUBLAS_WORKSPACE_CONFIG")) == before
    assert runs[0]["deterministic"] is True and math.isfinite(runs[0]["final_val_loss"])
    assert runs[0]["history"]["train"] == runs[1]["history"]["train"]
    assert runs[0]["final_val_loss"] == runs[1]["final_val_loss"]
    with pytest.raises(TypeError, match="deterministic: expected a bool"):
        TrainConfig(deterministic=1).validate()
    import argparse

    from lowbit.train.cli import add_train_args, config_from_args

    parse = add_train_args(argparse.ArgumentParser()).parse_args
    assert config_from_args(parse(["--deterministic"])).deterministic
    assert not config_from_args(parse([])).deterministic


def test_train_with_quantized_attention_and_a_bad_choice(tmp_path, small_text, cache_dir):
    """`attention="lowbit", attn_qk="int8"`: the run's model runs lowbit.attention (the summary says which) and its loss
    goes down; a choice the model cannot run fails before any work with a ValueError naming the field."""
    s = train(TrainConfig(steps=4, batch_size=2, seq_len=32, data=small_text, cache_dir=cache_dir,
                          out_dir=str(tmp_path / "q"), eval_windows=1, progress=False, verbose=False, save_final=False,
                          attention="lowbit", attn_qk="int8"))
    assert s["attention"] == "lowbit"
    ls = _losses(s)
    assert all(math.isfinite(v) for v in ls) and ls[-1] < ls[0], ls
    with pytest.raises(ValueError, match="backend: 'sdpa' cannot run quantized attention"):
        train(TrainConfig(steps=1, data=small_text, cache_dir=cache_dir, out_dir=str(tmp_path / "bad"),
                          progress=False, verbose=False, attention="sdpa", attn_qk="int8"))
