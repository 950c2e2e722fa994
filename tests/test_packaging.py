"""`pip install lowbit` without extras: the CLI runs without tqdm and matplotlib (one-line notes, no traceback),
every module but the Triton kernels imports without triton, progress goes to log lines off a terminal,
`lowbit --version`, the SPDX license, and the activation-memory check."""

import io
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # (Python >= 3.11)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def no_extras(tmp_path_factory):
    """A PYTHONPATH entry under which `import tqdm` and `import matplotlib` raise ImportError."""
    d = tmp_path_factory.mktemp("no-extras")
    (d / "tqdm.py").write_text("raise ImportError('tqdm is hidden by the test')\n")
    (d / "matplotlib").mkdir()
    (d / "matplotlib" / "__init__.py").write_text("raise ImportError('matplotlib is hidden by the test')\n")
    return d


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = Path(sysconfig.get_paths()["stdlib"])
    p = tmp_path_factory.mktemp("text") / "corpus.txt"
    p.write_bytes(b"\n".join((root / n).read_bytes() for n in ("argparse.py", "enum.py")))
    return str(p)


def _lowbit(args, no_extras, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWBIT_")}
    env["PYTHONPATH"] = os.pathsep.join([str(no_extras), str(ROOT / "src")])
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-m", "lowbit", *map(str, args)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def test_hidden_extras_really_are_hidden(no_extras, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(no_extras)}
    for mod in ("tqdm", "matplotlib"):
        r = subprocess.run([sys.executable, "-c", f"import {mod}"], env=env, capture_output=True, text=True)
        assert r.returncode != 0 and "hidden by the test" in r.stderr


def test_train_without_tqdm_and_matplotlib(no_extras, corpus, tmp_path):
    out = tmp_path / "run"
    r = _lowbit(["train", "--model", "tiny", "--steps", 3, "--batch-size", 2, "--seq-len", 32, "--eval-windows", 2,
                 "--data", corpus, "--cache-dir", tmp_path / "cache", "--out-dir", out], no_extras, tmp_path)
    text = r.stdout + r.stderr
    assert r.returncode == 0, text
    assert "Traceback" not in text
    assert "no loss plot (matplotlib is not installed" in r.stdout and "pip install lowbit[train]" in r.stdout
    assert r.stdout.count("matplotlib is not installed") == 1
    # stdout is a pipe: progress as log lines (the last step at least), not a bar
    assert "[lowbit] tiny/bf16 step 3/3 (100%)" in r.stdout and "\r" not in text
    summ = json.loads((out / "summary.json").read_text())
    assert summ["report"]["plot"] is None and summ["steps"] == 3
    assert not (out / "loss.png").exists()


def test_demo_without_tqdm_and_matplotlib(no_extras, corpus, tmp_path):
    out = tmp_path / "report"
    r = _lowbit(["demo", "--recipes", "bf16,fp8-block", "--steps", 2, "--batch-size", 2, "--seq-len", 128,
                 "--eval-windows", 2, "--device", "cpu", "--data", corpus, "--cache-dir", tmp_path / "cache",
                 "--out", out], no_extras, tmp_path)
    text = r.stdout + r.stderr
    assert r.returncode == 0, text
    assert "Traceback" not in text
    assert r.stdout.count("no loss plot (matplotlib is not installed") == 1
    summ = json.loads((out / "summary.json").read_text())
    assert summ["files"]["plot"] is None and [row["recipe"] for row in summ["table"]] == ["bf16", "fp8-block"]
    assert (out / "table.md").is_file() and not (out / "loss_curves.png").exists()
    assert "gap vs bf16" in r.stdout


def test_failed_demo_leaves_no_empty_report_dir(tmp_path, monkeypatch):
    from lowbit.train import demo

    def boom(*a, **k):
        raise ValueError("data: boom")

    monkeypatch.setattr(demo, "train", boom)
    out = tmp_path / "a" / "report"
    assert demo.main(["--steps", "1", "--out", str(out), "--device", "cpu", "--no-progress"]) == 2
    assert not (tmp_path / "a").exists()
    kept = tmp_path / "kept"
    (kept / "old.txt").parent.mkdir()
    (kept / "old.txt").write_text("x")
    assert demo.main(["--steps", "1", "--out", str(kept), "--device", "cpu", "--no-progress"]) == 2
    assert sorted(p.name for p in kept.iterdir()) == ["old.txt"]  # an existing folder and its files stay


_WITHOUT_TRITON = r"""
import importlib, pkgutil, re, sys
sys.modules["triton"] = None  # import triton -> ImportError, as without the lowbit[gpu] extra
import torch
import lowbit
failed = []
for m in pkgutil.walk_packages(lowbit.__path__, "lowbit."):
    if not re.search(r"kernels|triton", m.name):  # (the Triton kernels themselves need it)
        try:
            importlib.import_module(m.name)
        except Exception as e:
            failed.append(f"{m.name}: {type(e).__name__}: {e}")
import lowbit.optim
p, ref = (torch.nn.Parameter(torch.linspace(-1, 1, 128 * 128).reshape(128, 128)) for _ in range(2))
for w, opt in ((p, lowbit.optim.AdamW), (ref, torch.optim.AdamW)):
    w.grad = torch.cos(torch.arange(128 * 128.0)).reshape(128, 128)
    opt([w], lr=0.5).step()
assert torch.equal(p, ref) and not torch.equal(p, torch.linspace(-1, 1, 128 * 128).reshape(128, 128))
print("failed:", failed)
"""


def test_modules_import_and_adamw_steps_without_triton(tmp_path):
    """Without triton every module but the Triton kernels imports (a missing package is a clear error where a Triton
    backend is asked for, tested in test_bad_input_api), and lowbit.optim.AdamW steps like torch's."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    env["PYTHONPATH"], env["OMP_NUM_THREADS"] = str(ROOT / "src"), "1"
    r = subprocess.run([sys.executable, "-c", _WITHOUT_TRITON], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "failed: []", r.stdout + r.stderr


class _Stream(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


def test_progress_log_lines_off_a_terminal():
    from lowbit.train.progress import Progress

    s = _Stream(tty=False)
    p = Progress(total=100, desc="tiny/bf16", stream=s)
    assert not p.uses_bar
    for i in range(1, 101):
        p.update(i, loss="1.0000")
    p.write("[lowbit] a message")
    p.close()
    p.close()
    lines = s.getvalue().splitlines()
    steps = [ln for ln in lines if " step " in ln]
    assert len(steps) == 10 and steps[-1].startswith("[lowbit] tiny/bf16 step 100/100 (100%)  loss 1.0000")
    assert lines[-1] == "[lowbit] a message" and "\r" not in s.getvalue()
    s = _Stream(tty=False)  # a resumed run with a custom interval: the last step is always logged
    p = Progress(total=7, initial=4, every=2, stream=s)
    for i in (5, 6, 7):
        p.update(i)
    assert [ln.split(" (")[0] for ln in s.getvalue().splitlines()] == ["[lowbit] step 6/7", "[lowbit] step 7/7"]


def test_progress_without_tqdm_on_a_terminal(monkeypatch):
    from lowbit.train import progress

    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm -> ImportError
    monkeypatch.setattr(progress, "_NOTED", [])
    s = _Stream(tty=True)
    p = progress.Progress(total=4, stream=s, bar=True)
    assert not p.uses_bar
    assert s.getvalue().splitlines() == [progress.TQDM_NOTE]
    progress.Progress(total=4, stream=s, bar=True)  # a second run (lowbit demo): no second note
    assert s.getvalue().splitlines() == [progress.TQDM_NOTE]


def test_progress_uses_tqdm_on_a_terminal(monkeypatch):
    pytest.importorskip("tqdm")
    from lowbit.train import progress

    monkeypatch.setattr(sys, "stderr", _Stream(tty=True))
    p = progress.Progress(total=3, stream=_Stream(tty=True))
    try:
        assert p.uses_bar
        p.update(2, loss="1.0")
        assert p.step == 2
    finally:
        p.close()


def test_version(capsys):
    import lowbit
    from lowbit.cli import main

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"lowbit {lowbit.__version__}\n"
    assert lowbit.__version__ == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_pyproject_spdx_license():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"
    req = next(r for r in meta["build-system"]["requires"] if r.startswith("setuptools"))
    assert req == "setuptools>=77"  # the first setuptools that reads an SPDX license string


def test_activation_budget_refuses_a_run_that_cannot_fit(capsys):
    from lowbit.train.budget import activation_bytes, device_memory_bytes
    from lowbit.train.cli import main

    small = activation_bytes("tiny", 16, 128)
    assert 0 < small < 2**30
    assert activation_bytes("tiny", 8, 2000) == 2 * activation_bytes("tiny", 4, 2000)
    # the T**2 term only for lowbit.attention's reference on CPU
    assert activation_bytes("tiny", 1, 4096, attn_qk="int8") > activation_bytes("tiny", 1, 4096) \
        == activation_bytes("tiny", 1, 4096, device="cuda", attn_qk="int8")
    have = device_memory_bytes("cpu")
    seq = 10_000_000
    assert activation_bytes("tiny", 8, seq) > have
    with pytest.raises(SystemExit) as e:
        main(["--model", "tiny", "--seq-len", str(seq), "--batch-size", "8", "--device", "cpu", "--steps", "2"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--seq-len {seq} x --batch-size 8 needs ~" in err and "GiB of activations" in err
    assert f"the device has {have / 2**30:,.1f} GiB" in err and "Traceback" not in err
