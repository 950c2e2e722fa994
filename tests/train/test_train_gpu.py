"""GPU smoke tests of the training job (run where CUDA is present)."""

import pytest

from lowbit.train.loop import TrainConfig, train


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["bf16", "fp8-block", "nvfp4"])
def test_gpu_tiny_trains(tmp_path, small_text, cache_dir, recipe):
    s = train(TrainConfig(recipe=recipe, steps=30, batch_size=16, seq_len=128, data=small_text, cache_dir=cache_dir,
                          out_dir=str(tmp_path), eval_windows=16, device="cuda", progress=False, verbose=False))
    ls = [l for _, l in s["history"]["train"]]
    assert s["compute_dtype"] == "bf16" and s["device"] != "cpu"
    assert sum(ls[-3:]) / 3 < sum(ls[:3]) / 3 - 1.0, ls
    assert not s["events"]
    assert s["peak_memory_bytes"] > 0 and s["tokens_per_s"] > 0
