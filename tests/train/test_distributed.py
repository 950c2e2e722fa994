"""2-process gloo DDP and FSDP2 (torchrun) reproduce the single-process run on the same global batch.

Tolerance: every logged training loss and the final validation loss within 2e-5 absolute. Both runs
compute in FP32 on the CPU; they differ only in summation order (the DDP gradient all-reduce averages
two half-batch means), so the trajectories agree to ~1e-6 over these few steps.
"""

import json
import os
import subprocess
import sys

import pytest

from lowbit.train.loop import TrainConfig, train
from testenv import child_env

TOL = 2e-5


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_processes_match_single_process(tmp_path, small_text, cache_dir, mode):
    recipe = "fp8-block"
    common = ["--recipe", recipe, "--steps", "4", "--seq-len", "64", "--data", small_text, "--cache-dir", cache_dir,
              "--eval-every", "4", "--eval-windows", "8", "--no-progress", "--device", "cpu"]  # (gloo, also on a GPU machine)
    env = child_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "lowbit.train.cli", *common, "--batch-size", "4", "--out-dir", str(tmp_path / "ddp"),
           *(["--fsdp"] if mode == "fsdp" else [])]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ddp = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert ddp["world_size"] == 2 and ddp["global_batch"] == 8 and ddp["fsdp"] == (mode == "fsdp")

    # one process, same global batch of 8: as one micro-batch, and as 2 accumulated micro-batches of 4
    base = dict(recipe=recipe, steps=4, seq_len=64, data=small_text, cache_dir=cache_dir, eval_every=4, eval_windows=8,
                progress=False, verbose=False, device="cpu")
    for kw in (dict(batch_size=8), dict(batch_size=4, grad_accum=2)):
        one = train(TrainConfig(out_dir=str(tmp_path / f"one{kw['batch_size']}"), **base, **kw))
        assert one["global_batch"] == 8
        a = [l for _, l in one["history"]["train"]]
        b = [l for _, l in ddp["history"]["train"]]
        assert len(a) == len(b) == 4
        assert max(abs(x - y) for x, y in zip(a, b)) < TOL, (kw, a, b)
        assert abs(one["final_val_loss"] - ddp["final_val_loss"]) < TOL

    # the 2-rank checkpoint (gathered, written by rank 0) resumes in a single process
    res = train(TrainConfig(out_dir=str(tmp_path / "ddp"), resume="auto", **{**base, "steps": 4}, batch_size=8))
    assert res["history"]["train"] == ddp["history"]["train"]
