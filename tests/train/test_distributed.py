"""2-process gloo DDP and FSDP2 (torchrun) reproduce the single-process run on the same global batch.

Tolerance: the first step's loss within 2e-5 absolute (the same weights and data: only the loss's summation order
differs), every later logged training loss and the final validation loss within 1e-3. Both runs compute in FP32 on
the CPU and differ only in summation order (the gradient all-reduce averages two half-batch means), but a gradient
that differs in its last bits can move an element across an FP8 rounding boundary, and that grows step by step: on
CI's 2-core machine the trajectories agree to ~1e-6, on a 16-core one (torch 2.11) up to 1.4e-4 by step
4 (1e-3 is 7x that). The losses fall by 0.3-0.4 a step here, so an update from another gradient shows well above it.
"""

import json
import re
import subprocess
import sys

import pytest
from testenv import child_env

from lowbit.train.loop import TrainConfig, train

TOL_FIRST, TOL = 2e-5, 1e-3


@pytest.mark.parametrize("mode", ["ddp", "fsdp", "fsdp-accum", "fsdp-keep"])
def test_two_processes_match_single_process(tmp_path, small_text, cache_dir, mode):
    """(fsdp-accum: each rank's 4 rows as 2 accumulated micro-batches: FSDP2 gathers the weights afresh for each;
    fsdp-keep: each block's gathered weights kept from its forward to its backward)"""
    recipe = "fp8-block"
    common = ["--recipe", recipe, "--steps", "4", "--seq-len", "64", "--data", small_text, "--cache-dir", cache_dir,
              # (gloo, also on a GPU machine)
              "--eval-every", "4", "--eval-windows", "8", "--no-progress", "--device", "cpu"]
    env = child_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "lowbit.train.cli", *common, "--out-dir", str(tmp_path / "ddp"),
           *(["--batch-size", "2", "--grad-accum", "2"] if mode == "fsdp-accum" else ["--batch-size", "4"]),
           *(["--fsdp"] if mode.startswith("fsdp") else []),
           *(["--fsdp-keep-gathered"] if mode == "fsdp-keep" else [])]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ddp = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert ddp["world_size"] == 2 and ddp["global_batch"] == 8 and ddp["fsdp"] == mode.startswith("fsdp")
    assert ddp["fsdp_reshard_after_forward"] == ({"fsdp-keep": False, "ddp": None}.get(mode, True))

    # one process, same global batch of 8: as one micro-batch, and as 2 accumulated micro-batches of 4
    base = dict(recipe=recipe, steps=4, seq_len=64, data=small_text, cache_dir=cache_dir, eval_every=4, eval_windows=8,
                progress=False, verbose=False, device="cpu")
    for kw in (dict(batch_size=8), dict(batch_size=4, grad_accum=2)):
        one = train(TrainConfig(out_dir=str(tmp_path / f"one{kw['batch_size']}"), **base, **kw))
        assert one["global_batch"] == 8
        a = [l for _, l in one["history"]["train"]]
        b = [l for _, l in ddp["history"]["train"]]
        assert len(a) == len(b) == 4
        assert abs(a[0] - b[0]) < TOL_FIRST, (kw, a, b)
        assert max(abs(x - y) for x, y in zip(a, b)) < TOL, (kw, a, b)
        assert abs(one["final_val_loss"] - ddp["final_val_loss"]) < TOL

    # the 2-rank checkpoint (gathered, written by rank 0) resumes in a single process
    res = train(TrainConfig(out_dir=str(tmp_path / "ddp"), resume="auto", **{**base, "steps": 4}, batch_size=8))
    assert res["history"]["train"] == ddp["history"]["train"]


def _two_process_runs(tmp_path, common: list[str], variants: dict[str, list[str]]) -> dict[str, dict]:
    """``lowbit train`` on 2 gloo processes (torchrun) with ``common`` and each variant's flags, out to
    ``tmp_path / name``: {name: its summary.json, with its stdout under "stdout"}."""
    env = child_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    runs = {}
    for name, extra in variants.items():
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "lowbit.train.cli", *common, *extra, "--out-dir", str(tmp_path / name)]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        runs[name] = json.loads((tmp_path / name / "summary.json").read_text())
        runs[name]["stdout"] = r.stdout
    return runs


@pytest.mark.parametrize("recipe", ["fp8-block", "fp8-current", "fp8-delayed"])
def test_fsdp_fp8_all_gather_matches_fsdp(tmp_path, small_text, cache_dir, recipe):
    """``--fp8-all-gather`` moves the FP8 copies instead of the FP32 shards and changes no bit of the run: the
    training and validation losses equal the plain FSDP2 run's exactly (fp8-current: each block's four weights take
    their amaxes from one all-reduce, LayerNormMLP's two among them)."""
    common = ["--recipe", recipe, "--steps", "2", "--seq-len", "64", "--data", small_text, "--cache-dir",
              cache_dir, "--eval-every", "2", "--eval-windows", "4", "--no-progress", "--device", "cpu",
              "--batch-size", "4", "--fsdp"]
    runs = _two_process_runs(tmp_path, common, {"fsdp": [], "fp8ag": ["--fp8-all-gather"]})
    assert runs["fp8ag"]["fp8_all_gather"] and not runs["fsdp"]["fp8_all_gather"]
    m = re.search(r"--fp8-all-gather: (\d+) weights gather in FP8", runs["fp8ag"]["stdout"])
    assert m and int(m.group(1)) > 0, runs["fp8ag"]["stdout"][-2000:]
    assert runs["fp8ag"]["history"]["train"] == runs["fsdp"]["history"]["train"]
    assert runs["fp8ag"]["final_val_loss"] == runs["fsdp"]["final_val_loss"]


@pytest.mark.parametrize("keep", [False, True])
def test_fsdp_bf16_all_gather_matches_fsdp(tmp_path, small_text, cache_dir, keep):
    """``--bf16-all-gather`` (recipe bf16, BF16 autocast on the CPU) moves the linear weights' BF16 casts instead of
    their FP32 shards and changes no bit of the run: the training and validation losses equal the plain FSDP2
    run's exactly, with each block's weights gathered again for its backward or kept from its forward."""
    common = ["--recipe", "bf16", "--dtype", "bf16", "--steps", "3", "--seq-len", "64", "--data", small_text,
              "--cache-dir", cache_dir, "--eval-every", "3", "--eval-windows", "4", "--no-progress", "--device", "cpu",
              "--batch-size", "4", "--fsdp", *(["--fsdp-keep-gathered"] if keep else [])]
    runs = _two_process_runs(tmp_path, common, {"fsdp": [], "bf16ag": ["--bf16-all-gather"]})
    assert runs["bf16ag"]["bf16_all_gather"] and not runs["fsdp"]["bf16_all_gather"]
    m = re.search(r"--bf16-all-gather: (\d+) weights gather in BF16, (\d+) in FP32", runs["bf16ag"]["stdout"])
    assert m and int(m.group(1)) > 0, runs["bf16ag"]["stdout"][-2000:]
    assert runs["bf16ag"]["history"]["train"] == runs["fsdp"]["history"]["train"]
    assert runs["bf16ag"]["final_val_loss"] == runs["fsdp"]["final_val_loss"]


def test_fsdp_bf16_all_gather_checkpoint_resumes(tmp_path, small_text, cache_dir):
    """A --bf16-all-gather run stopped at step 2 (its checkpoint gathered from the BF16AllGatherWeight shards) and
    resumed under FSDP2 again ends with the uninterrupted run's losses bit for bit; resumed in one process (batch 8:
    the two ranks' batch in one mean), within the module's tolerance."""
    common = ["--recipe", "bf16", "--dtype", "bf16", "--steps", "4", "--seq-len", "64", "--data", small_text,
              "--cache-dir", cache_dir, "--eval-every", "4", "--eval-windows", "4", "--no-progress", "--device", "cpu",
              "--warmup", "0", "--ckpt-every", "2"]
    env = child_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    two = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "lowbit.train.cli", *common, "--batch-size", "4", "--fsdp", "--bf16-all-gather"]
    for extra in (["--out-dir", str(tmp_path / "full")], ["--out-dir", str(tmp_path / "part"), "--stop-at-step", "2"],
                  ["--out-dir", str(tmp_path / "part"), "--resume", "auto"]):
        r = subprocess.run([*two, *extra], env=env, capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    full = json.loads((tmp_path / "full" / "summary.json").read_text())
    part = json.loads((tmp_path / "part" / "summary.json").read_text())
    assert part["history"]["train"] == full["history"]["train"] and part["final_val_loss"] == full["final_val_loss"]
    one = train(TrainConfig(recipe="bf16", dtype="bf16", steps=4, seq_len=64, batch_size=8, data=small_text,
                            cache_dir=cache_dir, eval_every=4, eval_windows=4, progress=False, device="cpu", warmup=0,
                            out_dir=str(tmp_path / "one"), resume=str(tmp_path / "part" / "checkpoint-step2.pt")))
    assert one["history"]["train"][:2] == full["history"]["train"][:2]  # (the checkpoint's)
    assert [s for s, _ in one["history"]["train"]] == [1, 2, 3, 4]
    for (_, a), (_, b) in zip(one["history"]["train"][2:], full["history"]["train"][2:]):
        assert abs(a - b) < TOL, (one["history"]["train"], full["history"]["train"])
    assert abs(one["final_val_loss"] - full["final_val_loss"]) < TOL, (one["final_val_loss"], full["final_val_loss"])


def test_bf16_all_gather_needs_bf16_compute(tmp_path, small_text, cache_dir):
    """dtype 'auto' computes in FP32 on the CPU, where the gathered weights (their BF16 casts only) cannot serve:
    refused before anything is built."""
    with pytest.raises(ValueError, match="bf16_all_gather: True needs the BF16 compute dtype; dtype='auto'"):
        train(TrainConfig(recipe="bf16", fsdp=True, bf16_all_gather=True, steps=1, seq_len=32, batch_size=2,
                          data=small_text, cache_dir=cache_dir, progress=False, device="cpu",
                          out_dir=str(tmp_path / "one")))


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_grad_reduce_dtype_bfloat16(tmp_path, small_text, cache_dir, mode):
    """``--grad-reduce-dtype bfloat16``: the gradients are averaged across the ranks in BF16 (FSDP2's reduce dtype;
    DDP, eager on the CPU: the DDP hook grad_sync.bf16_average_hook). The first step's loss (before any update)
    equals the FP32 reduce's bit for bit; the later ones differ (each gradient rounded to BF16 before the sum: the
    setting took effect) but stay within 2e-3 of them over 4 steps (4e-4 seen; the losses fall by 0.3-0.4 a
    step)."""
    common = ["--recipe", "fp8-block", "--steps", "4", "--seq-len", "64", "--data", small_text, "--cache-dir",
              cache_dir, "--eval-every", "4", "--eval-windows", "4", "--no-progress", "--device", "cpu",
              "--batch-size", "4", "--grad-accum", "2", *(["--fsdp"] if mode == "fsdp" else [])]
    runs = _two_process_runs(tmp_path, common, {n: ["--grad-reduce-dtype", n] for n in ("float32", "bfloat16")})
    assert runs["bfloat16"]["grad_reduce_dtype"] == "bfloat16" and runs["float32"]["grad_reduce_dtype"] == "float32"
    said = "--grad-reduce-dtype bfloat16: FSDP2 accumulates the 2 micro-batches' gradients in it too"
    assert (said in runs["bfloat16"]["stdout"]) == (mode == "fsdp")
    a = [l for _, l in runs["float32"]["history"]["train"]]
    b = [l for _, l in runs["bfloat16"]["history"]["train"]]
    assert a[0] == b[0] and a[1:] != b[1:], (a, b)
    assert max(abs(x - y) for x, y in zip(a, b)) < 2e-3, (a, b)


def test_grad_reduce_dtype_one_process_says_so(tmp_path, small_text, cache_dir):
    r = train(TrainConfig(recipe="bf16", steps=1, seq_len=32, batch_size=2, data=small_text, cache_dir=cache_dir,
                          eval_every=1, eval_windows=1, progress=False, device="cpu", grad_reduce_dtype="bfloat16",
                          out_dir=str(tmp_path / "one")))
    assert r["grad_reduce_dtype"] is None and r["world_size"] == 1


@pytest.mark.parametrize("kw, match", [
    (dict(fp8_all_gather=True), "needs fsdp=True"),
    (dict(fp8_all_gather=True, fsdp=True, recipe="mxfp8"), "recipe 'mxfp8'"),
    (dict(fp8_all_gather=True, fsdp=True, compile=True), "compile=True"),
    (dict(fp8_all_gather=1, fsdp=True), "expected a bool"),
    (dict(bf16_all_gather=True, recipe="bf16"), "bf16_all_gather: True needs fsdp=True"),
    (dict(bf16_all_gather=True, fsdp=True), "bf16_all_gather: True takes recipe 'bf16'"),
    (dict(bf16_all_gather=True, fsdp=True, recipe="bf16", dtype="fp32"), "needs the BF16 compute dtype"),
    (dict(bf16_all_gather=True, fsdp=True, recipe="bf16", compile=True), "bf16_all_gather: True with compile=True"),
    (dict(bf16_all_gather="yes", fsdp=True, recipe="bf16"), "bf16_all_gather: expected a bool"),
    (dict(fsdp_reshard_after_forward=False), "fsdp_reshard_after_forward: False needs fsdp=True"),
    (dict(fsdp_reshard_after_forward=0, fsdp=True), "fsdp_reshard_after_forward: expected a bool, got 0"),
    (dict(grad_reduce_dtype="bf16"), "grad_reduce_dtype: expected one of float32, bfloat16, got 'bf16'"),
])
def test_fsdp_config_errors(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        TrainConfig(**{"recipe": "fp8-block", **kw}).validate()
