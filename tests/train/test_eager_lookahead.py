"""The eager step decided on the device and read one step later (``TrainConfig.lookahead``, the default with
``--on-nonfinite skip``) against every step read and waited for on the host (``lookahead=False``): 2 gloo processes
under DDP and FSDP2, and one process, give the same per-step losses, validation losses, events and final weights bit
for bit, a fault included (skipped on every rank, reported with the same text at its own step); and between a step's
backward and its optimizer step nothing is read on the host.

"fused": torch's fused AdamW on the CPU (the optimizer every CUDA run has), which takes the skip as ``found_inf``;
without it the CPU's for-loop AdamW reads the flag (on the CPU a read waits for nothing)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.multiprocessing as mp
from testenv import group_process

from lowbit.train import checkpoint as ckpt
from lowbit.train import loop
from lowbit.train.loop import TrainConfig, train

WORLD = 2
READS = ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy")


def _fused(plain):
    """``plain`` (the loop's optimizer factory) making torch's fused AdamW of the same groups (on the CPU too)."""
    def make(model, c):
        groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in plain(model, c).param_groups]
        opt = torch.optim.AdamW(groups, lr=c.lr, betas=(c.beta1, c.beta2), eps=1e-8, fused=True)
        assert all(g["fused"] for g in opt.param_groups)
        return opt
    return make


class _Trace:
    """Logs "B" when a backward returns, "S" when an optimizer step starts (of any class in ``opt_classes``), "R" at
    every read of a tensor on the host (the reads that wait for the GPU on CUDA)."""

    def __init__(self, *opt_classes):
        self.log: list[str] = []
        self.opt_classes = opt_classes

    def __enter__(self):
        self.saved = {n: getattr(torch.Tensor, n) for n in (*READS, "backward")}
        self.saved_steps = [(cls.step, "step" in cls.__dict__) for cls in self.opt_classes]

        def reader(name):
            orig = self.saved[name]

            def f(t, *a, **k):
                self.log.append("R")
                return orig(t, *a, **k)
            return f

        for n in READS:
            setattr(torch.Tensor, n, reader(n))
        back = self.saved["backward"]

        def backward(t, *a, **k):
            out = back(t, *a, **k)
            self.log.append("B")
            return out

        torch.Tensor.backward = backward

        def logged(step):
            def opt_step(o, *a, **k):
                self.log.append("S")
                return step(o, *a, **k)
            return opt_step

        for cls, (step, _) in zip(self.opt_classes, self.saved_steps):
            cls.step = logged(step)
        return self

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(torch.Tensor, n, f)
        for cls, (step, own) in zip(self.opt_classes, self.saved_steps):
            if own:
                cls.step = step
            else:  # (inherited: torch's AdamW is an Adam)
                del cls.step

    def reads_before_update(self) -> list[int]:
        """Per optimizer step: the host reads between the backward before it and it."""
        out, n = [], None
        for e in self.log:
            if e == "B":
                n = 0
            elif e == "R" and n is not None:
                n += 1
            elif e == "S" and n is not None:
                out.append(n)
                n = None
        return out


def _config(tmp, small_text, cache_dir, la: bool, **kw) -> TrainConfig:
    base = dict(recipe="fp8-block", steps=5, seq_len=64, batch_size=4, data=small_text, cache_dir=cache_dir,
                eval_every=5, eval_windows=4, progress=False, verbose=False, device="cpu", overwrite=True,
                out_dir=os.path.join(tmp, f"la{int(la)}"), lookahead=la)
    return TrainConfig(**{**base, **kw})


def _amax_fault_at(step: int, build):
    """``build`` (the loop's model builder) whose model records a non-finite amax with the NaN sentry in the first
    block's forward of ``step`` (nothing else changes: the loss stays finite)."""
    from lowbit.nn import state

    def make(c, d):
        mcfg, model = build(c, d)
        calls = [0]

        def hook(module, args):
            if calls[0] == step:
                state.sentry(torch.full((1,), float("inf"), device=args[0].device), layer="fake", role="input",
                             phase="forward", policy="skip")
            calls[0] += 1

        model.blocks[0].register_forward_pre_hook(hook)
        return mcfg, model
    return make


def _worker(rank, tmp, small_text, cache_dir, mode, fused, device="cpu"):
    """One rank's runs (under ``group_process``)."""
    os.environ.update(WORLD_SIZE=str(WORLD), RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    plain, build = loop._optimizer, loop._build
    classes = [torch.optim.AdamW]
    if device == "cuda":
        from lowbit.optim import AdamW

        classes.append(AdamW)
    try:
        if fused and device == "cpu":  # (on CUDA the run's own AdamW is fused)
            loop._optimizer = _fused(plain)
        if rank == 1:  # a non-finite amax at step 3 on rank 1 alone, its loss finite: rank 0 skips on the agreed flag
            loop._build = _amax_fault_at(3, build)
        out = {}
        for la in (True, False):
            # --fault-steps 2 on rank 1 only: rank 0 sees it in the all-reduced loss
            # (cuda_graph off: the eager step is what is tested; DDP on CUDA would otherwise be captured, and the
            # fault hook above counts Python calls, which a replay makes none of)
            c = _config(tmp, small_text, cache_dir, la, steps=6, eval_every=6, fsdp=mode == "fsdp", device=device,
                        fault_steps=(2,) if rank == 1 else (), cuda_graph="off")
            with _Trace(*classes) as tr:
                s = train(c)
            out[str(la)] = {"history": s["history"], "events": s["events"], "final_val_loss": s["final_val_loss"],
                            "reads": tr.reads_before_update()}
        with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
    finally:
        loop._optimizer, loop._build = plain, build


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def _same_weights(a: str, b: str) -> bool:
    """The final checkpoints' weights (and the recipe's state beside them) are equal bit for bit."""
    return _equal(*(torch.load(os.path.join(d, "checkpoint.pt"), weights_only=False)["model"] for d in (a, b)))


def _two_processes(tmp_path, small_text, cache_dir, mode, fused, device):
    mp.spawn(group_process, args=(str(tmp_path), WORLD, device, _worker, small_text, cache_dir, mode, fused, device),
             nprocs=WORLD, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r, got in enumerate(ranks):
        on, off = got["True"], got["False"]
        assert on["history"] == off["history"], (r, on["history"], off["history"])
        assert on["events"] == off["events"], (r, on["events"], off["events"])
        assert on["final_val_loss"] == off["final_val_loss"]
        # steps 2 and 3 skipped on every rank, reported at their own steps
        assert [s for s, _ in on["history"]["train"]] == [1, 2, 5, 6], on["history"]["train"]
        assert {e["step"] for e in on["events"]} == {2, 3} and {e["action"] for e in on["events"]} == {"skip"}
        if fused or device == "cuda":  # the device-side skip: nothing read between the backward and the update
            assert on["reads"] == [0] * 6, on["reads"]
        assert any(off["reads"]), off["reads"]  # (the trace sees the synchronous step's reads)
    # rank 1 names its faulty layers; rank 0, whose own amaxes are finite, the loss
    assert {(e["step"], e["layer"]) for e in ranks[0]["True"]["events"]} == {(2, "loss"), (3, "loss")}
    assert any(e["step"] == 2 and e["layer"].startswith("blocks.0.") for e in ranks[1]["True"]["events"])
    assert [e["layer"] for e in ranks[1]["True"]["events"] if e["step"] == 3] == ["fake"]
    assert _same_weights(tmp_path / "la1", tmp_path / "la0")


@pytest.mark.parametrize("mode, fused", [("ddp", True), ("fsdp", True), ("ddp", False)])
def test_two_processes_same_bits_with_and_without_lookahead(tmp_path, small_text, cache_dir, mode, fused):
    _two_processes(tmp_path, small_text, cache_dir, mode, fused, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_gpus_same_bits_with_and_without_lookahead(tmp_path, small_text, cache_dir, mode):
    """The same on 2 GPUs over NCCL with the run's own fused AdamW (lowbit.optim.AdamW under DDP): there a read
    between the backward and the update is a wait for the GPU."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    _two_processes(tmp_path, small_text, cache_dir, mode, True, "cuda")


def test_one_process_same_bits_and_no_read_before_the_update(tmp_path, small_text, cache_dir, monkeypatch):
    """One process, eager (the CPU: no CUDA graphs), torch's fused AdamW: the same bits either way, faults at the first
    step and at a validation step and gradient accumulation included, and with lookahead no host read between the
    last backward and the update."""
    monkeypatch.setattr(loop, "_optimizer", _fused(loop._optimizer))
    runs = {}
    for la in (True, False):
        with _Trace(torch.optim.AdamW) as tr:
            s = train(_config(str(tmp_path), small_text, cache_dir, la, steps=6, eval_every=3, grad_accum=2,
                              fault_steps=(0, 2)))
        runs[la] = (s, tr.reads_before_update())
    (on, reads_on), (off, reads_off) = runs[True], runs[False]
    assert on["history"] == off["history"] and on["events"] == off["events"]
    assert [st for st, _ in on["history"]["train"]] == [2, 4, 5, 6]
    assert reads_on == [0] * 6 and any(reads_off), (reads_on, reads_off)
    assert _same_weights(tmp_path / "la1", tmp_path / "la0")


def test_ctrl_c_behind_a_step_ahead_stops_at_the_next(tmp_path, small_text, cache_dir, monkeypatch):
    """Ctrl-C during a step's forward, while the step before waits to be finished behind it: the run stops after the
    interrupted step with one checkpoint holding exactly its weights (not at the step behind it, whose finish comes
    after the update of the next one was queued), and a resume follows the uninterrupted run's trajectory."""
    import signal

    from lowbit.train.loop import TrainInterrupted

    if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, None):
        pytest.skip("SIGINT is ignored in this process")
    build = loop._build

    def with_ctrl_c(c, d):
        mcfg, model = build(c, d)
        calls = [0]

        def hook(module, args):
            calls[0] += 1
            if calls[0] == 4:  # step 3's forward
                os.kill(os.getpid(), signal.SIGINT)

        model.blocks[0].register_forward_pre_hook(hook)
        return mcfg, model

    full = train(_config(str(tmp_path / "full"), small_text, cache_dir, True, steps=6, eval_every=6))
    monkeypatch.setattr(loop, "_build", with_ctrl_c)
    with pytest.raises(TrainInterrupted) as e:
        train(_config(str(tmp_path / "cut"), small_text, cache_dir, True, steps=6, eval_every=6))
    monkeypatch.setattr(loop, "_build", build)
    assert e.value.step == 4
    ck = tmp_path / "cut" / "la1" / "checkpoint.pt"
    assert ckpt.read_checkpoint(ck)["step"] == 4 and [s for s, _ in ckpt.previous_checkpoints(ck)] == [4]
    res = train(_config(str(tmp_path / "cut"), small_text, cache_dir, True, steps=6, eval_every=6, resume="auto",
                        overwrite=False))
    assert res["history"] == full["history"]
