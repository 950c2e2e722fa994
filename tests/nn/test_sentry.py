"""NaN sentry: non-finite amax raises naming layer and role, or is recorded with on_nonfinite='skip' / 'ignore'."""

from __future__ import annotations

import math

import pytest
import torch

import lowbit
from lowbit import recipes
from lowbit.nn import NonFiniteAmaxError, nonfinite_events


def _model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.Linear(32, 16))
    lowbit.convert(m)  # names the converted layers "0", "2"; the last Linear (head) stays torch
    return m


@pytest.mark.parametrize("recipe", [recipes.Float8CurrentScaling(), recipes.NVFP4BlockScaling(),
                                    recipes.DelayedScaling()],
                         ids=["current", "nvfp4", "delayed"])
def test_raise_names_layer_and_role(recipe):
    m = _model()
    x = torch.randn(16, 32)
    x[3, 5] = float("nan")
    with pytest.raises(NonFiniteAmaxError, match=r"of input in layer '0' \(forward") as e:
        with lowbit.autocast(recipe=recipe):
            m(x)
    assert (e.value.layer, e.value.role, e.value.phase) == ("0", "input", "forward")
    with torch.no_grad():
        m[2].weight[0, 0] = float("inf")
    with pytest.raises(NonFiniteAmaxError, match="of weight in layer '2'"):
        with lowbit.autocast(recipe=recipe):
            m(torch.randn(16, 32))


def test_backward_gradient_sentry_and_unnamed_layer():
    lin = lowbit.nn.Linear(32, 16)
    x = torch.randn(16, 32, requires_grad=True)
    with lowbit.autocast(recipe=recipes.Float8CurrentScaling()):
        y = lin(x)
    with pytest.raises(NonFiniteAmaxError,
                       match=r"of grad_output in layer '<unnamed Linear weight \(16, 32\).*name_modules.*\(backward"):
        (y * float("inf")).sum().backward()


def test_skip_records_events_and_clears():
    m = _model()
    nonfinite_events()
    x = torch.randn(16, 32, requires_grad=True)
    with lowbit.autocast(recipe=recipes.Float8CurrentScaling(), on_nonfinite="skip"):
        y = m(x)
    assert nonfinite_events() == []
    step = lowbit.nn.state.step()
    with lowbit.autocast(recipe=recipes.Float8CurrentScaling(), on_nonfinite="skip"):
        y = m(torch.where(torch.arange(32) == 7, float("nan"), x))
    loss = y.sum()
    loss.backward()  # outside autocast: the backward uses its forward's policy (skip), no raise
    ev = nonfinite_events()
    got = {(e.layer, e.role, e.phase) for e in ev}
    assert ("0", "input", "forward") in got and ("2", "input", "forward") in got
    assert ("2", "grad_output", "backward") not in got  # dy of layer 2 comes through the finite head: finite
    assert ("0", "grad_output", "backward") in got  # dy of layer 0 passes GELU'(NaN): NaN
    # forward events carry the step of their autocast (it exits after them); the backward's come after that exit
    assert all(e.step == (step if e.phase == "forward" else step + 1) for e in ev)
    assert all(e.amax != e.amax or e.amax == float("inf") for e in ev)  # nan or inf
    assert nonfinite_events() == []  # cleared


def test_nonfinite_amax_does_not_poison_delayed_history():
    m = lowbit.nn.Linear(32, 16)
    r = recipes.DelayedScaling(amax_history_len=4)
    x = torch.randn(8, 32)
    with lowbit.autocast(recipe=r):
        m(x)
    scale = m._gemms[""].delayed.histories["input"].scale.clone()
    with lowbit.autocast(recipe=r, on_nonfinite="skip"):
        m(torch.full((8, 32), float("nan")))
    assert len(nonfinite_events()) == 1
    h = m._gemms[""].delayed.histories["input"]
    assert torch.isfinite(h.history).all() and torch.equal(h.scale, scale)
    with lowbit.autocast(recipe=r):
        m(x)  # and the next step quantizes with a finite scale again


def test_check_is_deferred_to_the_exit_and_skips_the_commit():
    """No device sync per quantized tensor: the forward's amaxes are checked once, at the outermost exit."""
    m = lowbit.nn.Linear(32, 16)
    r = recipes.DelayedScaling(amax_history_len=4)
    x = torch.randn(8, 32)
    x[0, 0] = float("inf")
    reached = False
    with pytest.raises(NonFiniteAmaxError, match="of input"):
        with lowbit.autocast(recipe=r):
            with lowbit.autocast(recipe=r):
                m(x)
            reached = True  # the inner exit does not check
    assert reached
    assert m._gemms[""].delayed.histories["input"].steps == 0  # the failed step updated no history
    assert lowbit.nn.state.depth() == 0 and not lowbit.nn.is_enabled()


def test_raised_nonfinite_step_does_not_mask_the_next_step():
    """After the sentry raised at the exit, the NaN amax is dropped with the step: the next good step records its own
    amax (not 0 from max(NaN, amax)) and, with "most_recent", moves the scale."""
    m = lowbit.nn.Linear(32, 16)
    r = recipes.DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent")
    x = torch.randn(8, 32)
    with lowbit.autocast(recipe=r):
        m(x)
    bad = x.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(NonFiniteAmaxError):
        with lowbit.autocast(recipe=r):
            m(bad)
    st = m._gemms[""].delayed
    assert not st.has_pending()
    with lowbit.autocast(recipe=r):
        m(4 * x)
    h = st.histories["input"]
    assert h.steps == 2 and h.history[0] == (4 * x).abs().max()
    assert torch.equal(h.scale, torch.tensor([448.0]) / (4 * x).abs().max())


def test_raised_backward_drops_its_gradient_amaxes():
    """A backward outside autocast that raises NonFiniteAmaxError drops the gradient amaxes waiting for the next
    exit: that exit records no grad_output entry, and the next good backward's amax is committed as measured."""
    m = lowbit.nn.Linear(32, 16)
    r = recipes.DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent")
    x = torch.randn(8, 32)
    with lowbit.autocast(recipe=r):
        y = m(x)
    with pytest.raises(NonFiniteAmaxError, match="of grad_output"):
        y.backward(torch.full_like(y, float("inf")))
    st = m._gemms[""].delayed
    assert st.pending["grad_output"] is None
    with lowbit.autocast(recipe=r):
        y = m(x)
    g = st.histories["grad_output"]
    assert g.steps == 0  # the failed backward pushed no entry
    y.backward(torch.full_like(y, 3.0))
    with lowbit.autocast(recipe=r):
        pass
    assert g.steps == 1 and g.history[0] == 3.0 and torch.equal(g.scale, torch.tensor([57344.0]) / 3.0)


def test_ignore_records_events_and_never_stops():
    """"ignore" means don't stop, never hide: nothing raises (forward exit, backward), the step's outputs stay NaN,
    and every event is recorded, marked policy="ignore" (a "skip" event is marked "skip")."""
    m = lowbit.nn.Linear(32, 16)
    m.lowbit_name = "lin"
    nonfinite_events()
    x = torch.randn(8, 32)
    x[1, 2] = float("nan")
    x.requires_grad_(True)
    step = lowbit.nn.state.step()
    with lowbit.autocast(recipe=recipes.Float8CurrentScaling(), on_nonfinite="ignore"):
        y = m(x)
    y.backward(y.detach())  # a NaN grad_output: the backward's check must not raise either
    assert torch.isnan(y).all()  # per-tensor scaling: a NaN amax makes the whole copy NaN
    ev = nonfinite_events()
    assert {(e.layer, e.role, e.phase, e.step, e.policy) for e in ev} == {
        ("lin", "input", "forward", step, "ignore"), ("lin", "grad_output", "backward", step + 1, "ignore")}
    assert nonfinite_events() == []
    with lowbit.autocast(recipe=recipes.Float8CurrentScaling(), on_nonfinite="skip"):
        m(x)
    assert [(e.role, e.policy) for e in nonfinite_events()] == [("input", "skip")]
    with lowbit.autocast(recipe=recipes.Float8CurrentScaling(), on_nonfinite="ignore"):
        m(x.detach().nan_to_num())
    assert nonfinite_events() == []  # a clean step records nothing


@pytest.mark.parametrize("recipe", [recipes.Float8CurrentScaling(), recipes.DelayedScaling(amax_history_len=4)],
                         ids=["current", "delayed"])
def test_off_records_nothing_and_hides_no_value(recipe, monkeypatch):
    """"off": no amax reaches the sentry (forward, backward), nothing raises or is reported, the NaN stays visible in
    the outputs, and under delayed scaling the non-finite amax still never enters a history."""
    st = lowbit.nn.state
    seen = []
    monkeypatch.setattr(st, "_unchecked", _Recording(seen))
    m = lowbit.nn.Linear(32, 16)
    nonfinite_events()
    x = torch.randn(8, 32)
    with lowbit.autocast(recipe=recipe, on_nonfinite="off"):
        m(x)
    bad = x.clone()
    bad[1, 2] = float("nan")
    bad.requires_grad_(True)
    with lowbit.autocast(recipe=recipe, on_nonfinite="off"):
        y = m(bad)
    y.backward(y.detach())
    assert seen == [] and nonfinite_events() == []
    assert not torch.isfinite(y).all() and not torch.isfinite(m.weight.grad).all()
    if isinstance(recipe, recipes.DelayedScaling):
        h = m._gemms[""].delayed.histories["input"]
        assert torch.isfinite(h.history).all() and torch.isfinite(h.scale).all()
    with lowbit.autocast(recipe=recipe, on_nonfinite="raise"):
        m(x)
    assert len(seen) > 0  # (the recording stand-in does see the other policies' records)


class _SlotHolder:
    """A layer as the sentry's slots see it (what lowbit.nn.functional's GemmLayer provides)."""

    def __init__(self, name):
        self.name, self.sentry_slots, self.sentry_armed = name, None, ""
        self.w = torch.zeros(4)

    def weight(self):
        return self.w


def test_slot_holders_are_checked_once_and_not_kept_alive():
    """An armed holder's slots are allocated at the outermost entry, checked at the checks (a non-finite one named
    with its role and phase, once: the check zeroes them), and the sentry keeps no holder alive."""
    import gc
    import weakref

    st = lowbit.nn.state
    nonfinite_events()
    h = _SlotHolder("fake")
    st.register_slot_holder(h)
    with lowbit.autocast(recipe=recipes.Float8CurrentScaling(), on_nonfinite="skip"):
        pass
    assert [(t.shape, t.dtype) for t in h.sentry_slots] == [((1,), torch.int32)] * 3
    fwd, wgt, bwd = (t.view(torch.float32) for t in h.sentry_slots)  # (float32 bits)
    h.sentry_armed = "skip"
    bwd.fill_(float("inf"))
    wgt.fill_(3.0)
    assert [(e.layer, e.role, e.phase, e.amax) for e in nonfinite_events()] == [
        ("fake", "grad_output", "backward", float("inf"))]
    assert all(torch.equal(t, torch.zeros(1, dtype=torch.int32)) for t in h.sentry_slots) and nonfinite_events() == []
    fwd.fill_(float("nan"))
    h.sentry_armed = "raise"  # (the policy the graph armed it with)
    with pytest.raises(NonFiniteAmaxError, match="fake"):
        st.check_nonfinite()
    ref = weakref.ref(h)
    del h, fwd, wgt, bwd
    gc.collect()
    assert ref() is None
    st.check_nonfinite()  # (a plan of a holder that is gone is not used)
    assert nonfinite_events() == []


class _Recording(list):
    """A stand-in for the sentry's record list that also notes every record appended."""

    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def append(self, rec):
        self.seen.append(rec)
        super().append(rec)


def test_graph_policy_goes_to_the_board_not_the_eager_records():
    """An operator inside torch.compile's CUDA graphs (graph_policy) records into the device's board, never into the
    eager records (which would keep graph-pool tensors alive); with no board for the device it says so once."""
    nonfinite_events()
    bad = torch.tensor([float("inf")])
    with pytest.warns(UserWarning, match="NaN sentry is off inside torch.compile's CUDA graphs"):
        lowbit.nn.state.sentry(bad, layer="a", role="input", phase="forward",
                               policy=lowbit.nn.state.graph_policy("ignore"))
    lowbit.nn.state.check_nonfinite()
    assert nonfinite_events() == []
    lowbit.nn.state.sentry(bad, layer="a", role="input", phase="forward", policy="ignore")
    assert [(e.layer, e.amax, e.policy) for e in nonfinite_events()] == [("a", float("inf"), "ignore")]


def test_board_slots_do_not_keep_layers_alive_and_are_reused(monkeypatch):
    """The board of torch.compile's CUDA graphs (here a CPU board standing in for a device's) keeps no layer alive: a
    layer's slots are freed when it is garbage-collected and taken by the next layer, and a non-finite amax is named
    by its layer."""
    import gc
    import weakref

    st = lowbit.nn.state
    for name, value in (("_boards", {None: torch.zeros(st.BOARD_SLOTS)}), ("_board_slots", {}), ("_board_free", {}),
                        ("_board_next", {}), ("_board_dead", []), ("_board_parts", [None])):
        monkeypatch.setattr(st, name, value)

    class Layer:
        def __init__(self, name):
            self.name = name

    nonfinite_events()
    a, b = Layer("a"), Layer("b")
    st.sentry([torch.tensor([1.0]), torch.tensor([2.0])], layer=a, role="input", phase="forward",
              policy=st.graph_policy("skip"))
    st.sentry(torch.tensor([3.0]), layer=b, role="weight", phase="forward", policy=st.graph_policy("skip"))
    slots = {k[1]: v[0] for k, v in st._board_slots.items()}
    assert slots == {id(a): 0, id(b): 2}
    st._board_check()
    st.check_nonfinite()
    assert nonfinite_events() == []
    gone = weakref.ref(a)
    del a
    gc.collect()
    assert gone() is None  # the board held no reference to it
    c = Layer("c")
    st.sentry(torch.tensor([float("nan")]), layer=c, role="input", phase="forward", policy=st.graph_policy("skip"))
    assert st._board_slots[(None, id(c), "input", "forward")][0] == 0  # the first of a's two freed slots
    assert st._board_free[None] == [[1, 1]]
    assert len(st._board_slots) == 2
    st._board_check()
    st.check_nonfinite()
    assert [(e.layer, e.role) for e in nonfinite_events()] == [("c", "input")]


def test_board_check_with_every_slot_layer_gone(monkeypatch):
    """A board check that finds only layers collected since its purge (a collection can run between the purge and the
    records' walk) checks nothing and raises nothing."""
    import weakref

    st = lowbit.nn.state

    class Layer:
        name = "a"

    a = Layer()
    ref = weakref.ref(a)  # (no callback: the slot is not queued for the purge)
    del a
    for name, value in (("_boards", {None: torch.zeros(st.BOARD_SLOTS)}), ("_board_free", {}), ("_board_next", {}),
                        ("_board_dead", []), ("_board_parts", [None]),
                        ("_board_slots", {(None, 0, "input", "forward"): (0, ref, "raise", 1)})):
        monkeypatch.setattr(st, name, value)
    st._board_check()
    st.check_nonfinite()
    assert nonfinite_events() == []


@pytest.mark.parametrize("policy", ["ignore", "skip"])
def test_ignore_hides_no_value_under_delayed_scaling(policy):
    """Delayed scaling with an Inf in the input: the cast alone would saturate it to 448 · scale_inv and the output
    would be finite. The input copy's scale_inv is NaN instead, so the output (and the loss) is non-finite; both
    policies raise nothing and record the event (marked with the policy); either way the Inf amax is committed as 0
    (the history and scale do not move) and the next clean step is finite again."""
    torch.manual_seed(0)
    m = lowbit.nn.Linear(32, 16)
    r = recipes.DelayedScaling(amax_history_len=4)
    x = torch.randn(8, 32)
    nonfinite_events()
    with lowbit.autocast(recipe=r, on_nonfinite=policy):
        m(x)  # the first scale is 1
    with lowbit.autocast(recipe=r, on_nonfinite=policy):
        m(x)  # now the scale is 448 / amax(x)
    h = m._gemms[""].delayed.histories["input"]
    scale, steps = h.scale.clone(), h.steps
    assert torch.isfinite(scale).all() and scale.item() != 1.0
    bad = x.clone().requires_grad_(True)
    with torch.no_grad():
        bad[2, 5] = float("inf")
    with lowbit.autocast(recipe=r, on_nonfinite=policy):
        y = m(bad)
    assert not torch.isfinite(y).any()  # the whole per-tensor GEMM: NaN, not a finite row
    y.sum().backward()
    assert not torch.isfinite(m.weight.grad).all()  # wgrad saw the Inf's row too
    events = nonfinite_events()
    assert ("input", "forward", policy) in {(e.role, e.phase, e.policy) for e in events}
    assert h.steps == steps + 1 and h.history[0] == 0 and torch.equal(h.scale, scale)
    with lowbit.autocast(recipe=r, on_nonfinite=policy):
        assert torch.isfinite(m(x)).all()


class _FakeEvent:
    """Stands in for a CUDA event: query() says whether the GPU has passed it."""

    def __init__(self):
        self.done = False
        self.waited = False

    def query(self):
        return self.done

    def synchronize(self):
        self.waited = True
        self.done = True


def test_async_check_reports_once_the_gpu_has_passed_it():
    """The CUDA path's bookkeeping, with a fake event: a queued check is read only when its event is done (no wait),
    or when asked to wait (nonfinite_events); oldest first; the error names the faulty step's layer and role."""
    from lowbit.nn import state

    nonfinite_events()
    ev = _FakeEvent()
    rec = ("blocks.3.qkv", "grad_output", "backward", 41, "raise", (torch.tensor([float("nan")]),))
    with state._lock:
        state._inflight.append(([rec], torch.tensor([float("nan")]), ev, None, torch.tensor([float("nan")])))
    state.check_nonfinite(wait=False)  # the GPU has not passed the event: nothing read, nothing raised
    assert state.pending_checks() == 1 and not ev.waited
    ev.done = True
    with pytest.raises(NonFiniteAmaxError,
                       match=r"of grad_output in layer 'blocks.3.qkv' \(backward, autocast step 41\)"):
        state.check_nonfinite(wait=False)
    assert state.pending_checks() == 0
    # "skip" records become events; nonfinite_events() waits for the event
    ev2 = _FakeEvent()
    rec2 = ("fc", "input", "forward", 7, "skip", (torch.tensor([float("inf")]),))
    with state._lock:
        state._inflight.append(([rec2], torch.tensor([float("inf")]), ev2, None, torch.tensor([float("inf")])))
    got = nonfinite_events()
    assert ev2.waited and [(e.layer, e.role, e.step, e.amax) for e in got] == [("fc", "input", 7, float("inf"))]


class _Named:
    def __init__(self, name):
        self.name = name
        self.weight = torch.zeros(4, 4)  # (what a GemmLayer holds through its module)


class _SlottedName:
    __slots__ = ("name",)  # (no weak reference to it)

    def __init__(self, name):
        self.name = name


def test_queued_checks_keep_no_layer_alive():
    """A check queued on the GPU stays queued until a later check point reads it; its records must not keep the layer
    (and so its module and weights) alive: a model dropped between two autocast regions is freed. A fault of a layer
    freed since is still reported; a living layer is named."""
    import gc
    import weakref

    from lowbit.nn import state

    nonfinite_events()
    gone, alive = _Named("blocks.0.fc1"), _Named("blocks.1.fc2")
    state.sentry(torch.tensor([float("inf")]), layer=gone, role="input", phase="forward", policy="skip")
    state.sentry(torch.tensor([float("nan")]), layer=alive, role="weight", phase="forward", policy="skip")
    state.sentry(torch.tensor([float("nan")]), layer=_SlottedName("head"), role="input", phase="forward",
                 policy="skip")
    recs = state._take_unchecked()
    ev = _FakeEvent()
    flat = torch.cat([a for r in recs for a in r[5]])
    with state._lock:  # (queued as the CUDA path queues it: read once the GPU has passed its event)
        state._inflight.append((recs, flat.max().reshape(1), ev, None, flat))
    ref = weakref.ref(gone)
    del gone, recs
    gc.collect()
    assert ref() is None
    ev.done = True
    got = nonfinite_events()
    assert [(e.layer, e.role) for e in got] == [("<a layer freed before its check was read>", "input"),
                                                ("blocks.1.fc2", "weight"), ("head", "input")]


def test_fault_is_attributed_from_the_values_checked_not_the_live_tensors():
    """A queued check names its layers from the amaxes as they were when it was queued: a CUDA graph's next replay
    rewrites the recorded tensors, possibly before the host reads the check."""
    from lowbit.nn import state

    nonfinite_events()
    a, b = torch.tensor([1.0]), torch.tensor([2.0, 3.0])
    good, bad = torch.tensor([4.0]), torch.tensor([float("nan")])
    recs = [("l0", "input", "forward", 5, "skip", (a, b)), ("l1", "input", "forward", 5, "skip", (good,)),
            ("l2", "grad_output", "backward", 5, "skip", (bad,))]
    state._launch_check(recs)
    bad.fill_(1.0)  # the next step rewrote the amax: the check still reports what it checked
    a.fill_(float("inf"))
    got = nonfinite_events()
    assert [(e.layer, e.role, e.step) for e in got] == [("l2", "grad_output", 5)]
    assert math.isnan(got[0].amax)


def test_captured_amaxes_snapshotted_by_runs_of_their_buffers():
    """A captured graph's amaxes are views into a few buffers (the amax arena's slots, the optimizer's): the check
    snapshots them as one slice a run of consecutive elements (gaps, a shared slot, two buffers, an int32 buffer seen
    as float32), and still names the faulty layer from the values it checked; parts that are not (1,) float32 views
    keep the plain cat."""
    from lowbit.nn import state

    nonfinite_events()
    arena = torch.zeros(16, dtype=torch.int32).view(torch.float32)  # (as AmaxArena's slots are read)
    opt = torch.zeros(4)
    arena[:] = torch.arange(1, 17, dtype=torch.float32)
    opt[:] = torch.tensor([100.0, 101.0, 102.0, 103.0])
    w = opt[2:3]
    parts = [arena[0:1], arena[1:2], arena[5:6], w, w, arena[2:3], opt[0:1], arena[9:10]]
    g = state._Gather(parts)
    assert g.slices is not None and len(g.slices) == 5  # arena 0-2, 5, 9; opt 0, 2
    snap = g.snapshot()
    assert torch.equal(g.values(snap), state._flat(parts))
    assert float(snap.max()) == 102.0
    arena[1] = 50.0  # a snapshot is a copy
    assert torch.equal(g.values(snap), torch.tensor([1.0, 2.0, 6.0, 102.0, 102.0, 3.0, 100.0, 10.0]))
    assert state._Gather([arena[0:1], torch.tensor([1.0], dtype=torch.float64)]).slices is None
    assert state._Gather([arena[0:2]]).slices is None

    recs = [("l0", "input", "forward", 7, "skip", (parts[0], parts[1])), ("l1", "weight", "forward", 7, "skip", (w, w)),
            ("l2", "grad_output", "backward", 7, "skip", (parts[2],))]
    with state._lock:
        state._captured.extend(recs)
        state._captured_gather[0] = None
    try:
        assert float(state.captured_amax_max()[0]) == 102.0
        arena[5] = float("nan")
        assert math.isnan(float(state.captured_amax_max()[0]))
        state.check_captured(wait=False)
        arena[5] = 1.0  # rewritten before the host reads the check
        got = nonfinite_events()
        assert [(e.layer, e.role, e.step) for e in got] == [("l2", "grad_output", 7)]
    finally:
        state.clear_captured()


def _taking_steps():
    """A step of ``_model()`` under current scaling with ``on_nonfinite="skip"`` returning ``take_checks()`` (the
    sentry's queue emptied first)."""
    from lowbit.nn import state

    m = _model()
    nonfinite_events()
    rec = recipes.Float8CurrentScaling()

    def run(x):
        with lowbit.autocast(recipe=rec, on_nonfinite="skip"):
            y = m(x)
        y.sum().backward()
        return state.take_checks()

    return run


def test_take_checks_keeps_a_step_apart_from_the_next():
    """take_checks(): a step's checks taken out of the queue with the device max of their amaxes (nothing read), their
    events read after the next step ran, which keeps its own; nonfinite_events() sees neither."""
    from lowbit.nn import state

    run = _taking_steps()
    x = torch.randn(16, 32)
    bad = run(torch.where(torch.arange(32) == 7, float("nan"), x))
    good = run(x)
    assert good.amax_max.shape == (1,) and math.isfinite(float(good.amax_max))
    assert not math.isfinite(float(bad.amax_max))
    assert nonfinite_events() == []
    got = {(e.layer, e.role, e.phase) for e in bad.events()}
    assert ("0", "input", "forward") in got and ("0", "grad_output", "backward") in got
    assert good.events() == [] and bad.events() == []  # (read once)
    assert state.take_checks().amax_max is None  # nothing queued since

    # a check still on the GPU (a fake event): taken, and waited for by events() only
    ev = _FakeEvent()
    r = ("fc", "input", "forward", 3, "skip", (torch.tensor([float("inf")]),))
    with state._lock:
        state._inflight.append(([r], torch.tensor([float("inf")]), ev, None, torch.tensor([float("inf")])))
    taken = state.take_checks()
    state.check_nonfinite(wait=True)
    assert not ev.waited and nonfinite_events() == []
    assert [(e.layer, e.step) for e in taken.events()] == [("fc", 3)] and ev.waited


def test_take_checks_folds_many_maxes_into_one():
    """A program that queues checks and never reads them keeps a bounded list of their maxes, whose max is still
    non-finite where one of them was."""
    from lowbit.nn import state

    nonfinite_events()
    for i in range(3 * state._MAXES_KEPT):
        a = torch.tensor([float("nan") if i == 5 else 1.0])
        state._launch_check([("l", "input", "forward", i, "skip", (a,))])
        assert len(state._maxes) <= state._MAXES_KEPT
    taken = state.take_checks()
    assert math.isnan(float(taken.amax_max))
    assert [e.step for e in taken.events()] == [5]


def test_no_read_back_inside_a_capture(monkeypatch):
    """Inside a CUDA-graph capture (faked here on the CPU) a check reads nothing back, not even whether an earlier
    in-flight check has finished: the event query would invalidate the capture. The records go to the captured list;
    the earlier check is read at the next call outside the capture."""
    from lowbit.nn import state as st

    class _Event:
        queried = 0

        def query(self):
            _Event.queried += 1
            raise AssertionError("an event was queried inside the capture")

    ev = _Event()
    entry = ([], torch.zeros(1), ev, None, torch.zeros(1))
    st._inflight.append(entry)
    captured_before = len(st._captured)
    try:
        monkeypatch.setattr(st, "_cuda_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        st.check_nonfinite(wait=False)  # nothing recorded
        st.sentry(torch.zeros(1), layer="fc", role="input", phase="forward", policy="skip")
        st.check_nonfinite(wait=False)  # one record: kept for the replays
        assert _Event.queried == 0 and entry in st._inflight
        assert len(st._captured) == captured_before + 1 and st._captured[-1][0] == "fc"
    finally:
        if entry in st._inflight:
            st._inflight.remove(entry)
        del st._captured[captured_before:]
        st._captured_gather[0] = None


def test_dropped_step_checks_are_reported_not_lost():
    """A StepChecks garbage-collected without events(): the next nonfinite_events() reports its events (and gives its
    pinned slots back), once; one read with events() is not reported again."""
    import gc

    from lowbit.nn import state

    run = _taking_steps()
    x = torch.randn(16, 32)
    bad = run(torch.where(torch.arange(32) == 7, float("nan"), x))
    del bad
    gc.collect()
    got = {(e.layer, e.role, e.phase) for e in nonfinite_events()}
    assert ("0", "input", "forward") in got and ("0", "grad_output", "backward") in got
    assert nonfinite_events() == []
    read = run(torch.where(torch.arange(32) == 7, float("nan"), x))
    assert read.events()
    del read
    gc.collect()
    assert nonfinite_events() == [] and not state._TAKEN


@pytest.mark.gpu
def test_converted_model_is_freed_after_inference_on_cuda():
    """On CUDA the sentry's last check of an autocast region stays queued until the next check point: the converted
    model (its layers, modules and weights) must be freed as soon as the caller drops it, not at the next autocast
    region (a benchmark building one model after another peaked with the previous one still held)."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512))
    model = model.to("cuda", torch.bfloat16)
    lowbit.convert(model)
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode(), lowbit.autocast(recipe=recipes.Float8BlockScaling()):
        model(x)
    refs = [weakref.ref(model), weakref.ref(model[0].weight)]
    del model
    gc.collect()
    assert [r() for r in refs] == [None, None]
    nonfinite_events()


_INFERENCE_FIRST = """
import torch, lowbit
from lowbit import recipes
from lowbit.nn import NonFiniteAmaxError
model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512)).cuda()
lowbit.convert(model)
x = torch.randn(256, 512, device="cuda")
with torch.inference_mode(), lowbit.autocast(recipe=recipes.Float8BlockScaling()):
    model(x)
for _ in range(3):
    with lowbit.autocast(recipe=recipes.Float8BlockScaling()):
        y = model(x)
    y.float().sum().backward()
lowbit.nn.check_nonfinite()
try:
    with lowbit.autocast(recipe=recipes.Float8BlockScaling()):
        model(torch.full_like(x, float("nan")))
    lowbit.nn.check_nonfinite()
except NonFiniteAmaxError as e:
    print("raised", e.event.layer, e.event.role)
"""


@pytest.mark.gpu
def test_inference_mode_first_then_training_on_cuda():
    """The sentry's host slots and graph board are made at the first autocast region: when that region runs under
    ``torch.inference_mode`` (a ``generate()`` before training, in a fresh process), they must still take the
    checks of the training steps after it, and a NaN there must still raise."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _INFERENCE_FIRST], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "raised 0 input" in r.stdout, r.stdout + r.stderr[-3000:]
