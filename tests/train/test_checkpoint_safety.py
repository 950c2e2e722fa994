"""Checkpoint safety: digests, field validation, kept checkpoints with fallback, the out-dir lock and
Ctrl-C. CPU, the tiny preset, a few steps."""

import os
import re
import signal
import subprocess
import sys
import time
import zipfile

import pytest
import torch
from testenv import child_env

from lowbit.train import checkpoint as ckpt
from lowbit.train.loop import TrainConfig, train


def _cfg(tmp_path, data, **kw):
    base = dict(steps=2, batch_size=2, seq_len=32, eval_windows=2, data=data, out_dir=str(tmp_path / "run"),
                cache_dir=str(tmp_path / "cache"), progress=False, verbose=False)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture
def run2(tmp_path, small_text):
    """A 2-step run checkpointed at every step (keep 2): checkpoint.pt (step 2), checkpoint-step{1,2}.pt."""
    train(_cfg(tmp_path, small_text, ckpt_every=1))
    return tmp_path / "run"


def test_digest_names_the_corrupt_tensor_or_field(run2, tmp_path):
    path = run2 / "checkpoint.pt"
    ck = torch.load(path, weights_only=True)
    assert set(ck["digest"]) == {"algorithm", "tensors", "fields"} and ck["digest"]["algorithm"] == "sha256"
    key = sorted(k for k, v in ck["model"].items() if isinstance(v, torch.Tensor))[0]
    assert f"model/{key}" in ck["digest"]["tensors"] and "step" in ck["digest"]["fields"]
    ckpt.read_checkpoint(path)  # intact

    bad = tmp_path / "bad.pt"
    ck["model"][key] = ck["model"][key].clone()
    ck["model"][key].view(-1)[0] += 1
    torch.save(ck, bad)
    with pytest.raises(ValueError, match=rf"'{re.escape(str(bad))}': tensor model/{re.escape(key)} does not match"):
        ckpt.read_checkpoint(bad)
    ck = torch.load(path, weights_only=True)
    ck["step"] = 1
    torch.save(ck, bad)
    with pytest.raises(ValueError, match=r"field 'step' does not match its SHA-256 digest"):
        ckpt.read_checkpoint(bad)

    # a flipped byte inside a stored tensor (torch.load does not check the zip's CRCs of mmapped storages)
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    raw[start + info.file_size // 2] ^= 0xFF
    bad.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"(tensor \S+ does not match|cannot read checkpoint)"):
        ckpt.read_checkpoint(bad)

    # a checkpoint written before digests: accepted, with one warning line
    ck = torch.load(path, weights_only=True)
    del ck["digest"]
    torch.save(ck, bad)
    said = []
    assert ckpt.read_checkpoint(bad, warn=said.append)["step"] == 2
    assert len(said) == 1 and "has no digest" in said[0] and "\n" not in said[0]


def _resave(src, dst, **changes):
    """``src``'s payload with ``changes`` (None: drop the key), written with a fresh (valid) digest."""
    ck = dict(torch.load(src, weights_only=True))
    for k, v in changes.items():
        if v is None:
            ck.pop(k)
        else:
            ck[k] = v
    ckpt.save_checkpoint(dst, ck)
    return dst


@pytest.mark.parametrize("changes, pattern", [
    (dict(step=-3), r"field 'step' must be an integer >= 0 and <= 2 \(this run's --steps\), got -3"),
    (dict(step=10**9), r"field 'step' must be an integer >= 0 and <= 2 .*got 1000000000"),
    (dict(step="2"), r"field 'step' must be an integer .*got '2'"),
    (dict(optimizer=None), r"required field 'optimizer' is missing"),
    (dict(model=None), r"required field 'model' is missing"),
    (dict(train=None), r"required field 'train' is missing"),
    (dict(train=[1, 2]), r"field 'train' must be a dict, got 'list'"),
    (dict(train={"seed": 1337}), r"field 'train' lacks the arguments \['recipe', 'model', "),
    (dict(optimizer={"state": {}}), r"required field 'optimizer/param_groups' is missing"),
    (dict(history={"train": [[1]]}), r"field 'history/train' must be a list of \[step, value\] pairs"),
])
def test_every_field_is_validated_before_use(run2, tmp_path, small_text, changes, pattern):
    bad = _resave(run2 / "checkpoint.pt", tmp_path / "bad.pt", **changes)
    with pytest.raises(ValueError, match=rf"^resume: checkpoint '{re.escape(str(bad))}': {pattern}"):
        train(_cfg(tmp_path, small_text, resume=str(bad)))


def test_keep_last_n_and_fall_back_from_a_bad_latest(tmp_path, small_text, capsys):
    run = tmp_path / "run"
    train(_cfg(tmp_path, small_text, steps=4, ckpt_every=1, keep_checkpoints=3))
    names = sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint"))
    assert names == ["checkpoint-step2.pt", "checkpoint-step3.pt", "checkpoint-step4.pt", "checkpoint.pt"]
    assert os.path.samefile(run / "checkpoint.pt", run / "checkpoint-step4.pt")  # a hard link, not a copy
    assert not (run / ".lock").exists()  # released at the end of the run

    # the latest is corrupted in place (its kept link with it): --resume falls back to step 3 and says so
    with open(run / "checkpoint.pt", "r+b") as f:
        f.seek(os.path.getsize(run / "checkpoint.pt") // 2)
        f.write(b"\0garbage\0" * 64)
    capsys.readouterr()
    s = train(_cfg(tmp_path, small_text, steps=4, ckpt_every=1, keep_checkpoints=3, resume="auto", verbose=True))
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "resume: skipped" in ln)
    assert "checkpoint.pt: " in line and f"using {run / 'checkpoint-step3.pt'} (step 3)" in line, line
    assert "resumed from" in out and "at step 3" in out
    assert [st for st, _ in s["history"]["train"]] == [1, 2, 3, 4]
    ckpt.read_checkpoint(run / "checkpoint.pt")  # rewritten, good

    # none good: refused, with every file's reason
    for p in run.glob("checkpoint*.pt"):
        p.write_bytes(b"junk")
    with pytest.raises(ValueError, match=r"resume: no good checkpoint in .*checkpoint\.pt: .*not a torch\.save "
                                         r"checkpoint.*checkpoint-step3\.pt: .*checkpoint-step2\.pt: "):
        train(_cfg(tmp_path, small_text, steps=4, resume="auto"))

    # keep 1: only checkpoint.pt; a fresh (--overwrite) run drops the earlier run's kept files
    train(_cfg(tmp_path, small_text, steps=2, ckpt_every=1, keep_checkpoints=1, overwrite=True))
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint.pt"]


def test_named_resume_is_refused_with_the_good_older_checkpoint(tmp_path, small_text):
    """``--resume PATH``: that file or nothing. A bad one is refused with its reason and the newest good older
    checkpoint kept beside it (never a newer one), or why there is none; the named one then resumes."""
    run = tmp_path / "run"
    train(_cfg(tmp_path, small_text, steps=4, ckpt_every=1, keep_checkpoints=3))
    latest, s2, s3 = run / "checkpoint.pt", run / "checkpoint-step2.pt", run / "checkpoint-step3.pt"
    with open(latest, "r+b") as f:  # corrupted in place: its kept link checkpoint-step4.pt with it
        f.seek(os.path.getsize(latest) // 2)
        f.write(b"\0garbage\0" * 64)
    want = (rf"^resume: checkpoint '{re.escape(str(latest))}': .*; the newest good checkpoint kept beside it is "
            rf"'{re.escape(str(s3))}' \(step 3\): pass --resume {re.escape(str(s3))} to continue from there$")
    with pytest.raises(ValueError, match=want):
        train(_cfg(tmp_path, small_text, steps=4, keep_checkpoints=3, resume=str(latest)))

    # a named older one that is bad points further back, never to a newer one
    good3 = s3.read_bytes()
    s3.write_bytes(b"junk")
    with pytest.raises(ValueError, match=rf"^resume: '{re.escape(str(s3))}' is not a torch.save checkpoint .*; "
                                         rf"the newest good checkpoint kept beside it is '{re.escape(str(s2))}' "
                                         r"\(step 2\)"):
        train(_cfg(tmp_path, small_text, steps=4, keep_checkpoints=3, resume=str(s3)))
    s2.write_bytes(b"junk")
    with pytest.raises(ValueError, match=r"none of the older checkpoints kept beside it passes its checks either: "
                                         r"checkpoint-step2\.pt: .*not a torch\.save checkpoint"):
        train(_cfg(tmp_path, small_text, steps=4, keep_checkpoints=3, resume=str(s3)))

    # the suggested one resumes (and the run goes on from it)
    s3.write_bytes(good3)
    s = train(_cfg(tmp_path, small_text, steps=4, ckpt_every=1, keep_checkpoints=3, resume=str(s3)))
    assert [st for st, _ in s["history"]["train"]] == [1, 2, 3, 4]
    ckpt.read_checkpoint(latest)

    # nothing kept beside it (keep 1)
    for p in run.glob("checkpoint-step*.pt"):
        p.unlink()
    latest.write_bytes(b"junk")
    with pytest.raises(ValueError, match=r"not a torch\.save checkpoint .*; no older checkpoint is kept beside it "
                                         r"\(--keep-checkpoints N keeps the last N\)$"):
        train(_cfg(tmp_path, small_text, steps=4, resume=str(latest)))


def test_one_writer_per_out_dir_and_live_temp_files_are_kept(tmp_path, small_text):
    run = tmp_path / "run"
    run.mkdir()
    holder = ckpt.lock_out_dir(run)
    try:
        with pytest.raises(ValueError, match=rf"out_dir: '{re.escape(str(run))}' is in use by process {os.getpid()} "
                                             r"on \S+ \(lock .*\.lock'\); one lowbit train per out-dir"):
            train(_cfg(tmp_path, small_text))
    finally:
        holder.release()
    assert not (run / ".lock").exists()

    # stale temporary files: a dead process's is removed by the next write, a live one's is left alone
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for pid in (dead.pid, live.pid):
            (run / f".checkpoint.pt.tmp{pid}").write_bytes(b"partial")
        train(_cfg(tmp_path, small_text, ckpt_every=1))
        assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == [f".checkpoint.pt.tmp{live.pid}"]
    finally:
        live.kill()
        live.wait()


def test_ctrl_c_checkpoints_prints_the_resume_command_and_exits_130(tmp_path, small_text):
    """A real `lowbit train`: SIGINT after the first logged step stops at the end of a step with a checkpoint, a
    resume hint and status 130, no traceback; `--resume` continues from there."""
    out = tmp_path / "run"
    args = ["--model", "tiny", "--steps", "1000", "--batch-size", "2", "--seq-len", "32", "--data", small_text,
            "--cache-dir", str(tmp_path / "cache"), "--out-dir", str(out), "--eval-every", "1", "--eval-windows", "2",
            "--no-progress"]
    env = child_env(OMP_NUM_THREADS="1")
    log = tmp_path / "run.log"
    with open(log, "wb") as f:  # (SIGINT back to its default: a test runner's worker may ignore it)
        p = subprocess.Popen([sys.executable, "-m", "lowbit", "train", *args], env=env, stdout=f,
                             stderr=subprocess.STDOUT, cwd=tmp_path,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            deadline = time.monotonic() + 120
            while "[lowbit] step 1: train loss" not in log.read_text():
                assert p.poll() is None, log.read_text()
                assert time.monotonic() < deadline, "no logged step within 120 s"
                time.sleep(0.05)
            p.send_signal(signal.SIGINT)
            rc = p.wait(60)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    text = log.read_text()
    assert rc == 130, text
    assert "Traceback" not in text, text
    m = re.search(r"lowbit train: interrupted \(Ctrl-C\) after step (\d+); checkpoint (\S+)\n", text)
    assert m and m.group(2) == str(out / "checkpoint.pt"), text
    step = int(m.group(1))
    assert 1 <= step < 1000
    assert ckpt.read_checkpoint(out / "checkpoint.pt")["step"] == step
    hint = re.search(r"lowbit train: to resume: (.*)\n", text).group(1)
    assert hint.startswith("lowbit train --model tiny --steps 1000 ") and hint.endswith(" --no-progress --resume")
    assert not (out / ".lock").exists()

    r = subprocess.run([sys.executable, "-m", "lowbit", "train", *args, "--resume", "--ckpt-every", "1",
                        "--stop-at-step", str(step + 2)],
                       env=env, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"at step {step}" in r.stdout
    assert ckpt.read_checkpoint(out / "checkpoint.pt")["step"] == step + 2
