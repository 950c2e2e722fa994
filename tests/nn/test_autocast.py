"""lowbit.autocast: nesting, depth, exception safety, device validation, delayed-scaling updates."""

from __future__ import annotations

import warnings

import pytest
import torch

import lowbit
from lowbit import recipes
from lowbit.nn import state


def test_nesting_depth_and_restore():
    a, b = recipes.Float8CurrentScaling(), recipes.Float8BlockScaling()
    assert state.depth() == 0 and not lowbit.nn.is_enabled() and lowbit.nn.get_recipe() is None
    with lowbit.autocast(recipe=a):
        assert state.depth() == 1 and lowbit.nn.get_recipe() is a
        with lowbit.autocast(recipe=b):
            assert state.depth() == 2 and lowbit.nn.get_recipe() is b
            with lowbit.autocast(enabled=False):
                assert state.depth() == 3 and not lowbit.nn.is_enabled()
                with lowbit.autocast():  # recipe=None inherits the enclosing recipe
                    assert lowbit.nn.get_recipe() is b
            assert lowbit.nn.get_recipe() is b
        assert lowbit.nn.get_recipe() is a and state.depth() == 1
    assert state.depth() == 0 and not lowbit.nn.is_enabled()
    with lowbit.autocast():
        assert lowbit.nn.get_recipe() == recipes.DelayedScaling()  # TransformerEngine's default


def test_exception_restores_state():
    a = recipes.Float8CurrentScaling()
    with lowbit.autocast(recipe=a, on_nonfinite="skip"):
        with pytest.raises(RuntimeError, match="boom"):
            with lowbit.autocast(recipe=recipes.MXFP8BlockScaling(), on_nonfinite="raise"):
                raise RuntimeError("boom")
        assert state.depth() == 1 and lowbit.nn.get_recipe() is a and state.get_state().on_nonfinite == "skip"
    with pytest.raises(KeyError):
        with lowbit.autocast(recipe=a):
            with lowbit.autocast(recipe=a):
                raise KeyError("x")
    assert state.depth() == 0 and not lowbit.nn.is_enabled()


def test_decorator():
    @lowbit.autocast(recipe=recipes.Float8CurrentScaling())
    def f():
        return lowbit.nn.get_recipe(), state.depth()

    assert f() == (recipes.Float8CurrentScaling(), 1)
    assert state.depth() == 0


def test_bad_arguments():
    with pytest.raises(TypeError, match="recipe: expected a lowbit.recipes recipe or None, got 'nvfp4' .*from_name"):
        lowbit.autocast(recipe="nvfp4")
    with pytest.raises(ValueError, match="on_nonfinite: expected one of .*'raise', 'skip', 'ignore'.*got 'warn'"):
        lowbit.autocast(on_nonfinite="warn")
    with pytest.raises(TypeError, match="enabled: expected a bool"):
        lowbit.autocast(enabled="yes")
    with pytest.raises(TypeError, match="allow_emulation: expected a bool, got 'no'"):
        lowbit.autocast(allow_emulation="no")
    with pytest.raises(TypeError,
                       match=r"amax_reduction_group: expected a torch.distributed.ProcessGroup .*or None, got "
                             r"list: \[0, 1\]"):
        lowbit.autocast(amax_reduction_group=[0, 1])  # ranks, not a group: would only fail at the exit's collective


def test_device_support(monkeypatch):
    monkeypatch.setattr(lowbit.nn.state, "_notices", set())  # (an earlier test may have printed the notice)
    chk = lowbit.nn.check_recipe_support
    assert chk(recipes.NVFP4BlockScaling(), "cpu") == "reference"
    hopper = (9, 0)
    assert chk(recipes.Float8CurrentScaling(), capability=hopper) == "native"
    assert chk(recipes.Float8BlockScaling(), capability=hopper) == "native"
    assert chk(recipes.Float8BlockScaling(), capability=(8, 9)) == "emulated"
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert chk(recipes.NVFP4BlockScaling(), capability=hopper) == "emulated"
        assert chk(recipes.NVFP4BlockScaling(), capability=hopper) == "emulated"
    notes = [x for x in w if "emulated" in str(x.message)]
    assert len(notes) == 1  # one-time notice
    with pytest.raises(NotImplementedError,
                       match=r"MXFP8BlockScaling \(mxfp8\) is not native on .*sm_90 .*needs sm_100.*natively supported "
                             r"here: \['per_tensor', 'blockwise'\]"):
        chk(recipes.MXFP8BlockScaling(), capability=hopper, allow_emulation=False)
    with pytest.raises(TypeError, match="recipe: expected a lowbit.recipes recipe"):
        chk("fp8")
    if not torch.cuda.is_available():  # on the CPU every recipe runs the reference, emulation flag or not
        with lowbit.autocast(recipe=recipes.NVFP4BlockScaling(), allow_emulation=False):
            assert state.get_state().support == "reference"
    elif torch.cuda.get_device_capability() < (10, 0):  # Hopper: NVFP4 is emulated
        with pytest.raises(NotImplementedError, match="allow_emulation=True"):
            with lowbit.autocast(recipe=recipes.NVFP4BlockScaling(), allow_emulation=False):
                pass
        assert state.depth() == 0


def _run(m, x, recipe, steps=1):
    for _ in range(steps):
        with lowbit.autocast(recipe=recipe):
            y = m(x)
        y.sum().backward()


def test_delayed_history_updated_once_per_outermost_exit():
    torch.manual_seed(0)
    m = lowbit.nn.Linear(32, 16)
    r = recipes.DelayedScaling(amax_history_len=4)
    x = torch.randn(8, 32)
    with lowbit.autocast(recipe=r):
        with lowbit.autocast(recipe=r):
            y1 = m(x)
            y2 = m(2 * x)  # a second microbatch / call in the same step: one history entry (the max)
        st = m._gemms[""].delayed
        assert st.histories["input"].steps == 0  # nothing committed at an inner exit
        with lowbit.autocast(recipe=r):
            m(x)
        assert st.histories["input"].steps == 0
    h = st.histories
    assert h["input"].steps == 1 and h["weight"].steps == 1 and h["grad_output"].steps == 0
    assert h["input"].history[0] == (2 * x).abs().max()
    assert h["weight"].history[0] == m.weight.abs().max()
    assert torch.equal(h["input"].scale, torch.tensor([448.0]) / (2 * x).abs().max())
    (y1.sum() + 3 * y2.sum()).backward()  # grad amax (3) is pending until the next outermost exit
    assert h["grad_output"].steps == 0 and st.pending["grad_output"].item() == 3.0
    with lowbit.autocast(recipe=r):
        pass
    assert h["grad_output"].steps == 1 and h["grad_output"].history[0] == 3.0
    assert torch.equal(h["grad_output"].scale, torch.tensor([57344.0]) / 3.0)  # E5M2 max / amax, float32
    assert h["input"].steps == 1  # the empty step pushed nothing for the forward roles


def test_delayed_scale_is_used_and_warmup():
    torch.manual_seed(0)
    x = torch.randn(8, 32)
    for warm, expect_current in ((0, False), (2, True)):
        m = lowbit.nn.Linear(32, 16)
        r = recipes.DelayedScaling(amax_history_len=8, warmup_steps=warm)
        _run(m, x, r, steps=1)
        with lowbit.autocast(recipe=r):
            y = m(10 * x)  # amax grew 10x: delayed scaling saturates, current scaling does not
        qx = y.grad_fn.qx
        scale_used = 1 / qx.columnwise.scale_inv
        if expect_current:
            assert torch.equal(scale_used, torch.tensor([448.0]) / (10 * x).abs().max())
        else:
            assert torch.equal(scale_used, torch.tensor([448.0]) / x.abs().max())


def test_exception_skips_the_update():
    """A step that raises is dropped with its amaxes: they neither update the history at its exit nor leak into
    the next step's entry (the docstring's "only when leaving without an exception")."""
    m = lowbit.nn.Linear(32, 16)
    r = recipes.DelayedScaling(amax_history_len=4)
    with pytest.raises(RuntimeError):
        with lowbit.autocast(recipe=r):
            m(100 * torch.randn(4, 32))
            raise RuntimeError("step failed")
    st = m._gemms[""].delayed
    assert st.histories["input"].steps == 0 and not st.has_pending()
    with lowbit.autocast(recipe=r):
        pass
    assert st.histories["input"].steps == 0  # an empty step after the failure commits nothing
    x = torch.randn(4, 32)
    with lowbit.autocast(recipe=r):
        m(x)
    h = st.histories["input"]
    assert h.steps == 1 and h.history[0] == x.abs().max()  # not the failed step's 100x amax
    assert torch.equal(h.scale, torch.tensor([448.0]) / x.abs().max())


def test_failed_step_keeps_the_previous_backward_amaxes():
    """The gradient amaxes of the backward before a failed step belong to the step before it: they stay pending
    and are committed at the next clean exit; the failed step's own backward (run inside it) is dropped."""
    torch.manual_seed(0)
    m = lowbit.nn.Linear(32, 16)
    r = recipes.DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent")
    x = torch.randn(8, 32)
    with lowbit.autocast(recipe=r):
        y = m(x)
    y.backward(torch.full_like(y, 3.0))  # outside autocast: pending until the next outermost exit
    st = m._gemms[""].delayed
    with pytest.raises(RuntimeError):
        with lowbit.autocast(recipe=r):
            y2 = m(x)
            y2.backward(torch.full_like(y2, 50.0))  # a backward inside the failing step
            raise RuntimeError("step failed")
    assert st.pending["grad_output"].item() == 3.0 and st.pending["input"] is None
    with lowbit.autocast(recipe=r):
        pass
    g = st.histories["grad_output"]
    assert g.steps == 1 and g.history[0] == 3.0 and st.histories["input"].steps == 1


def test_checkpoint_pending_survives_a_failed_first_step():
    """A loaded checkpoint's pending gradient amax (its state is built by the first forward, inside the step) is
    carried like the previous backward's: a failure of that first step does not drop it."""
    torch.manual_seed(0)
    r = recipes.DelayedScaling(amax_history_len=4)
    m = lowbit.nn.Linear(32, 16)
    with lowbit.autocast(recipe=r):
        y = m(torch.randn(8, 32))
    y.backward(torch.full_like(y, 3.0))
    sd = m.state_dict()
    m2 = lowbit.nn.Linear(32, 16)
    m2.load_state_dict(sd)
    with pytest.raises(RuntimeError):
        with lowbit.autocast(recipe=r):
            m2(torch.randn(8, 32))
            raise RuntimeError("step failed")
    st = m2._gemms[""].delayed
    assert st.pending["grad_output"].item() == 3.0 and st.pending["input"] is None


def test_changing_delayed_history_settings_is_an_error():
    m = lowbit.nn.Linear(32, 16)
    m.lowbit_name = "l0"
    _run(m, torch.randn(4, 32), recipes.DelayedScaling(amax_history_len=4))
    with pytest.raises(ValueError, match="recipe: layer 'l0' holds delayed-scaling state"):
        with lowbit.autocast(recipe=recipes.DelayedScaling(amax_history_len=8)):
            m(torch.randn(4, 32))
