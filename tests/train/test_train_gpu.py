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


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["bf16", "fp8-block", "nvfp4"])
def test_cuda_graph_matches_eager(tmp_path, small_text, cache_dir, recipe):
    """The captured step replays the eager step: same loss trajectory (kernel configs autotuned separately in
    the two runs may change FP32 accumulation order, so not bit for bit), with grad accumulation."""
    runs = {}
    for mode in ("off", "on"):
        runs[mode] = train(TrainConfig(recipe=recipe, steps=8, batch_size=8, seq_len=128, grad_accum=2, data=small_text,
                                       cache_dir=cache_dir, out_dir=str(tmp_path / mode), eval_windows=8, device="cuda",
                                       cuda_graph=mode, progress=False, verbose=False))
    assert runs["on"]["cuda_graph"] and not runs["off"]["cuda_graph"]
    a = [l for _, l in runs["off"]["history"]["train"]]
    b = [l for _, l in runs["on"]["history"]["train"]]
    assert len(a) == len(b) == 8
    for x, y in zip(a, b):
        assert abs(x - y) <= 2e-3 * abs(x), (a, b)
    assert abs(runs["on"]["final_val_loss"] - runs["off"]["final_val_loss"]) <= 2e-3 * runs["off"]["final_val_loss"]


@pytest.mark.gpu
def test_cuda_graph_refused_where_unsafe(tmp_path, small_text, cache_dir):
    with pytest.raises(ValueError, match="cuda_graph: 'on' but.*fp8-delayed"):
        train(TrainConfig(recipe="fp8-delayed", steps=2, batch_size=8, seq_len=128, data=small_text, cache_dir=cache_dir,
                          out_dir=str(tmp_path), device="cuda", cuda_graph="on", progress=False, verbose=False))
    s = train(TrainConfig(recipe="fp8-delayed", steps=2, batch_size=8, seq_len=128, data=small_text, cache_dir=cache_dir,
                          out_dir=str(tmp_path / "n"), eval_windows=8, device="cuda", progress=False, verbose=False))
    assert s["cuda_graph"] is False
