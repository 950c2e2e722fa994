"""When `lowbit train` uses CUDA graphs (decided without touching CUDA, so testable on the CPU)."""
import pytest
import torch

from lowbit.train.loop import Dist, TrainConfig, _graph_decision


def _d(device="cuda", world=1):
    return Dist(device=torch.device(device), world=world, rank=0)


@pytest.mark.parametrize("recipe", ["bf16", "fp8-current", "fp8-block", "mxfp8", "nvfp4"])
def test_auto_uses_graphs_for_stateless_recipes_on_one_gpu(recipe):
    assert _graph_decision(TrainConfig(recipe=recipe), _d()) == (True, "")


@pytest.mark.parametrize("cfg,dist,why", [
    (dict(recipe="fp8-delayed"), _d(), "keeps per-step host state"),
    (dict(recipe="bf16"), _d(world=2), "more than one process"),
    (dict(recipe="bf16"), _d("cpu"), "not on CUDA"),
    (dict(recipe="bf16", fault_steps=(3,)), _d(), "fault injection"),
])
def test_auto_declines_with_a_reason_and_on_raises(cfg, dist, why):
    use, reason = _graph_decision(TrainConfig(**cfg), dist)
    assert not use and why in reason
    with pytest.raises(ValueError, match=f"cuda_graph: 'on' but CUDA graphs cannot be used here: .*{why}"):
        _graph_decision(TrainConfig(cuda_graph="on", **cfg), dist)


def test_off_and_bad_value():
    assert _graph_decision(TrainConfig(recipe="bf16", cuda_graph="off"), _d()) == (False, "--cuda-graph off")
    with pytest.raises(ValueError, match="cuda_graph: expected 'auto', 'on' or 'off'"):
        TrainConfig(cuda_graph="yes").validate()
