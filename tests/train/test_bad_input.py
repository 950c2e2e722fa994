"""Bad input gives clear ValueErrors that name the argument, not tracebacks from deep inside."""

import pytest
import torch

from lowbit.train.cli import main as train_main
from lowbit.train.data import load_corpus
from lowbit.train.loop import TrainConfig, train


def _cfg(tmp_path, **kw):
    base = dict(steps=2, batch_size=2, seq_len=32, eval_windows=2, out_dir=str(tmp_path / "run"), cache_dir=str(tmp_path / "cache"),
                progress=False, verbose=False)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("kw, pattern", [
    (dict(recipe="fp7"), r"recipe: unknown recipe 'fp7'.*fp8-block"),
    (dict(model="7b"), r"model: unknown preset '7b'.*tiny"),
    (dict(steps=0), r"steps: must be an integer >= 1, got 0"),
    (dict(on_nonfinite="ignore"), r"on_nonfinite: expected"),
    (dict(lr=-1.0), r"lr: must be a positive"),
    (dict(compare="fp32"), r"compare: only 'bf16'"),
])
def test_bad_arguments(tmp_path, kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        train(_cfg(tmp_path, **kw))


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
    with pytest.raises(ValueError, match="resume: cannot read checkpoint"):
        train(_cfg(tmp_path, data=small_text, resume=str(bad)))
    with pytest.raises(ValueError, match="resume: no checkpoint at"):
        train(_cfg(tmp_path, data=small_text, resume=str(tmp_path / "missing.pt")))


def test_cli_reports_errors_without_traceback(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        train_main(["--recipe", "fp7", "--out-dir", str(tmp_path), "--no-progress"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "recipe: unknown recipe 'fp7'" in err and "Traceback" not in err
