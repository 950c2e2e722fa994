"""The scripts in examples/ run: each on 2 gloo processes (torchrun, CPU), tiny sizes."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from testenv import child_env

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("recipe", ["fp8-block", "bf16"])
def test_fsdp2_own_loop(recipe):
    """FSDP2 with the low-precision all-gather in a user's loop: every weight gathers in FP8 (BF16), and the loss
    falls over 6 steps."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(EXAMPLES / "fsdp2_own_loop.py"), "--device", "cpu", "--recipe", recipe, "--dim", "256", "--tokens",
           "256", "--steps", "6"]
    r = subprocess.run(cmd, env=child_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"{recipe}: 8 of 8 weights gather in low precision" in r.stdout, r.stdout
    losses = [float(v) for v in re.findall(r"step \d+: loss ([0-9.]+)", r.stdout)]
    assert len(losses) == 6 and losses[-1] < losses[0], r.stdout


def test_hf_generate():
    """FP8 prefill and BF16 decode of a tiny random-init Llama: lowbit's attention serves the prefills (2 layers x 3
    prompts), the decode steps (q_len 1) go to SDPA, and the second and third prompts reuse the 4 quantized weights
    of each layer."""
    pytest.importorskip("transformers")
    cmd = [sys.executable, str(EXAMPLES / "hf_generate.py"), "--device", "cpu", "--tiny", "--prompt-len", "40",
           "--new-tokens", "5"]
    r = subprocess.run(cmd, env=child_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert len(re.findall(r"prompt \d: prefill 40 tokens in [0-9.]+ ms, 5 tokens in", r.stdout)) == 3, r.stdout
    assert "attention: 6 calls served by lowbit, 24 passed to SDPA" in r.stdout, r.stdout
    assert "weights: 16 quantized copies reused" in r.stdout, r.stdout
