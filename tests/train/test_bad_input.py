"""Bad input gives clear ValueErrors that name the argument, not tracebacks from deep inside."""

import re
import zipfile

import pytest
import torch

from lowbit.train.cli import main as train_main
from lowbit.train.data import load_corpus
from lowbit.train.loop import TrainConfig, train


def _cfg(tmp_path, **kw):
    base = dict(steps=2, batch_size=2, seq_len=32, eval_windows=2, out_dir=str(tmp_path / "run"),
                cache_dir=str(tmp_path / "cache"),
                progress=False, verbose=False)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("kw, pattern", [
    (dict(recipe="fp7"), r"recipe: unknown recipe 'fp7'.*fp8-block"),
    (dict(model="7b"), r"model: unknown preset '7b'.*tiny"),
    (dict(steps=0), r"steps: must be an integer >= 1, got 0"),
    (dict(on_nonfinite="ignore"), r"on_nonfinite: expected"),
    (dict(lr=-1.0), r"lr: must be a finite number > 0, got -1.0"),
    (dict(lr=float("nan")), r"lr: must be a finite number > 0, got nan"),
    (dict(compare="fp32"), r"compare: only 'bf16'"),
    (dict(weight_decay=-0.1), r"weight_decay: must be a finite number >= 0 .*got -0.1"),
    (dict(grad_clip=float("nan")), r"grad_clip: must be a finite number >= 0 \(0 = no clipping\), got nan"),
    (dict(grad_clip=float("inf")), r"grad_clip: .*got inf"),
    (dict(grad_clip=-1.0), r"grad_clip: .*got -1.0"),
    (dict(beta2=1.0), r"beta2: must be a finite number in \[0, 1\), got 1.0"),
    (dict(min_lr_ratio=2.0), r"min_lr_ratio: must be a finite number in \[0, 1\]"),
    (dict(seed=-1), r"seed: must be an integer in \[0, 2\*\*32\), got -1"),
    (dict(ckpt_every=-1), r"ckpt_every: must be an integer >= 0 \(0 = only at the end\), got -1"),
    (dict(batch_size=0), r"batch_size: must be an integer >= 1, got 0"),
])
def test_bad_arguments(tmp_path, kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        train(_cfg(tmp_path, **kw))


def test_zero_grad_clip_and_weight_decay_mean_off(tmp_path):
    TrainConfig(grad_clip=0.0, weight_decay=0.0).validate()  # documented: 0 turns clipping / decay off


def test_unusable_out_dir_and_cache_dir_fail_before_training(tmp_path, capsys):
    """--out-dir / --cache-dir that cannot be a writable folder: one line naming the argument, exit 2, no training."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    common = ["--steps", "2", "--batch-size", "2", "--seq-len", "32", "--no-progress"]
    f, sub = str(afile), str(afile / "sub")
    cases = [
        (["--out-dir", f, "--cache-dir", str(tmp_path / "c")], f"out_dir: must be a directory, but '{f}' exists"),
        (["--out-dir", sub], f"out_dir: cannot create the directory '{sub}': '{f}' is a file, not a directory"),
        (["--out-dir", str(tmp_path / "o"), "--cache-dir", f], f"cache_dir: must be a directory, but '{f}'"),
    ]
    for extra, line in cases:
        with pytest.raises(SystemExit) as e:
            train_main(common + extra)
        assert e.value.code == 2
        out, err = capsys.readouterr()
        assert err.startswith("lowbit train: error: " + line) and err.count("\n") == 1 and "Traceback" not in err, err
        assert "[lowbit] step" not in out and "cached" not in out, out


def test_os_error_at_top_level_is_one_line(monkeypatch, capsys):
    import lowbit.train.cli as cli
    import lowbit.train.demo as demo

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device", "runs/x/checkpoint.pt")

    monkeypatch.setattr(cli, "run_train", full_disk)
    with pytest.raises(SystemExit) as e:
        cli.main(["--no-progress"])
    assert e.value.code == 2
    assert capsys.readouterr().err == "lowbit train: error: 'runs/x/checkpoint.pt': No space left on device\n"
    monkeypatch.setattr(demo, "run_demo", full_disk)
    assert demo.main([]) == 2
    assert capsys.readouterr().err == "lowbit demo: error: 'runs/x/checkpoint.pt': No space left on device\n"


def test_checkpoint_write_failure_is_an_os_error_and_keeps_the_old_file(tmp_path, monkeypatch):
    """torch.save failing mid-write (its zip writer reports a full disk as "unexpected pos") becomes an OSError naming
    the checkpoint, torch's reason and the free space against the payload's size (ENOSPC where it is short), which
    the CLI prints as one line; the previous checkpoint and the folder stay as they were."""
    import errno
    import shutil
    from collections import namedtuple

    import torch

    import lowbit.train.checkpoint as ckpt
    from lowbit.train.cli import os_error_line

    path = tmp_path / "checkpoint.pt"
    ckpt.save_checkpoint(path, {"step": 4, "model": {"w": torch.ones(3)}})
    real_save = torch.save

    def failing_save(obj, f, *a, **k):
        f.write(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 9216 vs 9104")

    monkeypatch.setattr(torch, "save", failing_save)
    usage = namedtuple("usage", "total used free")
    for free, code, room in ((1000, errno.ENOSPC, "0.0 MB free"), (10**12, errno.EIO, "1000.00 GB free")):
        monkeypatch.setattr(shutil, "disk_usage", lambda p, free=free: usage(2 * free, free, free))
        with pytest.raises(OSError) as e:
            ckpt.save_checkpoint(path, {"step": 8, "model": {"w": torch.zeros(1000, 1000)}})
        assert e.value.errno == code and e.value.filename == str(path)
        line = os_error_line(e.value)
        assert line.startswith(f"{str(path)!r}: writing the checkpoint failed ([enforce fail at "
                               "inline_container.cc:672] . "
                               "unexpected pos 9216 vs 9104); "), line
        assert line.endswith(f"; {room} on its filesystem against ~4.0 MB needed; the previous checkpoint, if any, is "
                             "unchanged"), line
    monkeypatch.setattr(torch, "save", real_save)
    assert torch.load(path, weights_only=True)["step"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


@pytest.mark.parametrize("argv, pattern", [
    (["--steps", "0"], "argument --steps: expected an integer >= 1, got 0"),
    (["--batch-size", "-2"], "argument --batch-size: expected an integer >= 1, got -2"),
    (["--seq-len", "x"], "argument --seq-len: expected an integer, got 'x'"),
])
def test_demo_rejects_non_positive_sizes(argv, pattern, capsys):
    from lowbit.train.demo import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and pattern in capsys.readouterr().err


def test_demo_bad_model_and_out_before_banner(tmp_path, capsys):
    from lowbit.train.demo import main

    assert main(["--model", "7b", "--out", str(tmp_path / "r")]) == 2
    out, err = capsys.readouterr()
    assert "model: unknown preset '7b'; expected one of tiny" in err and "[lowbit demo]" not in out
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["--out", str(afile), "--steps", "1"]) == 2
    out, err = capsys.readouterr()
    assert f"out: must be a directory, but '{afile}'" in err and "[lowbit demo]" not in out


def test_missing_empty_and_unreadable_data(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="data: path does not exist"):
        load_corpus(tmp_path / "nope.txt", tmp_path / "c")
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="holds no text"):
        load_corpus(empty, tmp_path / "c")
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(ValueError, match="contains no files"):
        load_corpus(tmp_path / "emptydir", tmp_path / "c")
    binary = tmp_path / "bin"
    binary.mkdir()
    (binary / "a.bin").write_bytes(b"\0\1\2" * 100)
    with pytest.raises(ValueError, match="1 skipped as binary"):
        load_corpus(binary, tmp_path / "c")
    text = tmp_path / "t.txt"
    text.write_text("hello\n" * 100)
    from pathlib import Path

    def denied(self):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_bytes", denied)
    with pytest.raises(ValueError, match=r"data: cannot read .*t\.txt.*Permission denied"):
        load_corpus(text, tmp_path / "c")


def test_corpus_smaller_than_one_sequence(tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("def f():\n    return 1\n")  # 22 bytes
    with pytest.raises(ValueError, match=r"fewer than one sequence \(seq_len \+ 1 = 33\)"):
        train(_cfg(tmp_path, data=str(small)))
    mid = tmp_path / "mid.txt"
    mid.write_text("x = 1\n" * 20)  # 120 bytes: train split fits one sequence, the val split (12 bytes) does not
    with pytest.raises(ValueError, match=r"the val split .* has 12 bytes"):
        train(_cfg(tmp_path, data=str(mid)))


def test_checkpoint_of_other_model_shape(tmp_path, small_text):
    cfg = _cfg(tmp_path, data=small_text, steps=1)
    train(cfg)
    ck = tmp_path / "run" / "checkpoint.pt"
    assert torch.load(ck, weights_only=True)["step"] == 1
    with pytest.raises(ValueError, match=r"out_dir: .* already holds a checkpoint .*--resume.*--overwrite"):
        train(cfg)  # no silent replacement of an earlier run's checkpoint
    with pytest.raises(ValueError, match=r"resume: checkpoint .* different model shape .*mlp"):
        train(_cfg(tmp_path, data=small_text, steps=2, resume="auto", mlp="gelu"))
    with pytest.raises(ValueError, match=r"resume: these arguments differ .*seed"):
        train(_cfg(tmp_path, data=small_text, steps=1, resume="auto", seed=7))
    # loading weights of another shape directly (bypassing the config check) is caught too
    from lowbit.models import GPT, config_from_preset
    from lowbit.train.checkpoint import load_checkpoint

    with pytest.raises(ValueError, match=r"different model shape .*shape mismatches: .*blocks\.0\.mlp"):
        load_checkpoint(ck, GPT(config_from_preset("tiny", ffn_hidden=256)))
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=rf"resume: '{re.escape(str(bad))}' is not a torch.save checkpoint"):
        train(_cfg(tmp_path, data=small_text, resume=str(bad)))
    other_zip = tmp_path / "other.zip"
    with zipfile.ZipFile(other_zip, "w") as z:
        z.writestr("a.txt", "hello")
    with pytest.raises(ValueError, match=rf"resume: cannot read checkpoint '{re.escape(str(other_zip))}'"):
        train(_cfg(tmp_path, data=small_text, resume=str(other_zip)))
    with pytest.raises(ValueError, match=r"resume: .* is a folder; pass the checkpoint file"):
        train(_cfg(tmp_path, data=small_text, resume=str(tmp_path / "run")))
    with pytest.raises(ValueError, match="resume: no checkpoint at"):
        train(_cfg(tmp_path, data=small_text, resume=str(tmp_path / "missing.pt")))


def test_cli_reports_errors_without_traceback(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        train_main(["--recipe", "fp7", "--out-dir", str(tmp_path), "--no-progress"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "recipe: unknown recipe 'fp7'" in err and "Traceback" not in err


def test_more_ranks_than_gpus_is_a_clear_error(monkeypatch):
    """torchrun with more processes a node than CUDA GPUs: a ValueError naming the rank, the GPU count and the two
    ways out, not torch's "CUDA error: invalid device ordinal" from set_device."""
    from lowbit.train.loop import setup_distributed

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda *a: pytest.fail("set_device reached"))
    with pytest.raises(ValueError, match=r"local rank 1 .* 1 CUDA GPU.*nproc_per_node.*--device cpu"):
        setup_distributed("auto")
