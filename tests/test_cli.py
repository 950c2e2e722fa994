"""The `lowbit` command: info, quant-demo, usage errors."""

import subprocess
import sys

from lowbit.cli import main


def test_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "quantize backends" in out and "scaled_mm backends" in out
    assert "recipes" in out and "fp8-block" in out and "attention:" in out


def test_quant_demo(capsys):
    assert main(["quant-demo", "--rows", "64", "--cols", "128"]) == 0
    out = capsys.readouterr().out
    assert "NVFP4 1x16" in out and "FP8 E4M3 1x128" in out


def test_unknown_command(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_bench_usage(capsys):
    assert main(["bench"]) == 2
    assert main(["bench", "nope"]) == 2


def test_module_entry_point():
    r = subprocess.run([sys.executable, "-m", "lowbit", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "commands" in r.stdout
