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
    (dict(recipe="bf16"), _d("cpu"), "not on CUDA"),
])
def test_auto_declines_with_a_reason_and_on_raises(cfg, dist, why):
    use, reason = _graph_decision(TrainConfig(**cfg), dist)
    assert not use and why in reason
    with pytest.raises(ValueError, match=f"cuda_graph: 'on' but CUDA graphs cannot be used here: .*{why}"):
        _graph_decision(TrainConfig(cuda_graph="on", **cfg), dist)


@pytest.mark.parametrize("fsdp", [False, True])
def test_ddp_and_fsdp_are_captured(monkeypatch, fsdp):
    """DDP and FSDP2 (several processes) run under graphs: their collectives are captured with the step; an NCCL too
    old to capture collectives (or none) declines with the versions, and "on" then raises."""
    from lowbit.train import loop

    monkeypatch.setattr(loop, "_nccl_version", lambda: (2, 27, 3))
    assert _graph_decision(TrainConfig(recipe="fp8-block", fsdp=fsdp), _d(world=2)) == (True, "")
    who = "FSDP2" if fsdp else "DDP"
    for old, shown in (((2, 9, 5), "2.9.5"), ((), "none")):
        monkeypatch.setattr(loop, "_nccl_version", lambda v=old: v)
        use, why = _graph_decision(TrainConfig(recipe="fp8-block", fsdp=fsdp), _d(world=2))
        assert not use and why == f"{who} needs NCCL >= 2.9.6 to capture its collectives, this torch has {shown}", why
        with pytest.raises(ValueError, match=f"cuda_graph: 'on' but CUDA graphs cannot be used here: {who} needs"):
            _graph_decision(TrainConfig(recipe="fp8-block", fsdp=fsdp, cuda_graph="on"), _d(world=2))
    # (one process: no NCCL needed; --fsdp alone there runs unsharded)
    assert _graph_decision(TrainConfig(recipe="fp8-block", fsdp=fsdp), _d()) == (True, "")


def test_off_and_bad_value():
    assert _graph_decision(TrainConfig(recipe="bf16", cuda_graph="off"), _d()) == (False, "--cuda-graph off")
    with pytest.raises(ValueError, match="cuda_graph: expected 'auto', 'on' or 'off'"):
        TrainConfig(cuda_graph="yes").validate()


def test_checkpoint_stores_a_float_lr_from_a_captured_update():
    """The update graph gives AdamW a device-tensor lr and capturable=True; checkpoints hold the plain values
    and the live optimizer keeps its own."""
    import torch

    from lowbit.train.checkpoint import gather_state

    m = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(m.parameters(), lr=torch.tensor(0.25), foreach=False)
    opt.param_groups[0]["capturable"] = True
    m(torch.randn(2, 4)).sum().backward()
    opt.param_groups[0]["capturable"] = False  # (the CPU step itself runs uncaptured)
    opt.step()
    opt.param_groups[0]["capturable"] = True
    _, osd = gather_state(m, opt)
    g = osd["param_groups"][0]
    assert type(g["lr"]) is float and g["lr"] == 0.25 and g["capturable"] is False
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor) and opt.param_groups[0]["capturable"] is True


def test_compile_replaces_the_step_graphs():
    use, why = _graph_decision(TrainConfig(recipe="fp8-block", compile=True), _d())
    assert not use and why == "--compile (torch.compile'd blocks)"
    with pytest.raises(ValueError, match="cuda_graph: 'on' together with compile"):
        TrainConfig(cuda_graph="on", compile=True).validate()
    with pytest.raises(TypeError, match="compile: expected a bool"):
        TrainConfig(compile="yes").validate()


def test_compile_mode_reaches_the_blocks_and_is_validated(monkeypatch):
    """``compile_mode`` is passed to each block's ``compile`` ("default": torch's own default, no mode argument), needs
    ``compile``, and ``"reduce-overhead"`` takes only graph-safe recipes and one micro-batch a step."""
    from lowbit.models import GPT, config_from_preset
    from lowbit.train import loop

    for mode, want in (("default", {}), ("reduce-overhead", {"mode": "reduce-overhead"}),
                       ("max-autotune-no-cudagraphs", {"mode": "max-autotune-no-cudagraphs"})):
        seen = []
        monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: seen.append(kw))
        c = TrainConfig(recipe="fp8-block", model="tiny", compile=True, compile_mode=mode)
        c.validate()
        model = GPT(config_from_preset("tiny"))
        loop._wrap(model, c, _d("cpu"))
        assert seen == [want] * len(model.blocks), (mode, seen)
    for kw, msg in ((dict(compile_mode="fast"), "compile_mode: expected one of default, reduce-overhead"),
                    (dict(compile_mode="reduce-overhead"), "needs compile=True"),
                    (dict(compile=True, compile_mode="reduce-overhead", recipe="fp8-delayed"), "fp8-delayed"),
                    (dict(compile=True, compile_mode="reduce-overhead", grad_accum=2), "needs grad_accum 1"),
                    (dict(compile=True, compile_mode="reduce-overhead", fsdp=True),
                     "'reduce-overhead' with fsdp=True: .* record again when a weight's address changes")):
        with pytest.raises(ValueError, match=msg):
            TrainConfig(**kw).validate()


def test_a_failed_capture_names_the_way_out(monkeypatch, tmp_path, small_text, cache_dir):
    """A CUDA-graph capture that fails (a CUDA error, a collective that cannot be captured) stops the run with the
    flag that trains eagerly; running out of memory stays itself."""
    from lowbit.train import loop

    class _Boom(loop._GraphedStep):
        def capture(self, warmup: int = 2) -> None:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(loop, "_GraphedStep", _Boom)
    monkeypatch.setattr(loop, "_graph_decision", lambda c, d: (True, ""))
    with pytest.raises(RuntimeError, match="capture of the training step failed: CUDA error.*--cuda-graph off"):
        loop.train(TrainConfig(recipe="bf16", model="tiny", steps=2, batch_size=2, seq_len=32, device="cpu",
                               data=small_text, cache_dir=cache_dir, out_dir=str(tmp_path), progress=False,
                               verbose=False, save_final=False, eval_windows=2))
