"""lowbit.runtime.launch.CachedLaunch: the first call of a key goes through the JIT function, later calls reuse the
compiled kernel's launcher with the same arguments (all of them, constexprs included, as JITFunction.run passes them);
a launch hook or a kernel without the internals falls back to the normal path. Fakes stand in for Triton's objects."""
import threading
import types

import pytest

triton = pytest.importorskip("triton")
pytest.importorskip("triton.testing")  # (binds triton.testing: the tuner tests fake its do_bench)
from lowbit.runtime import autotune as at  # noqa: E402
from lowbit.runtime import env  # noqa: E402
from lowbit.runtime import launch as _launch  # noqa: E402


class _Compiled:
    def __init__(self):
        self.function, self.packed_metadata = "fn-handle", "meta"
        self.runs = []

    def run(self, *a):
        self.runs.append(a)


class _JIT:
    def __init__(self):
        self.calls = []
        self.compiled = _Compiled()

    def __getitem__(self, grid):
        def go(*args, **opts):
            self.calls.append((grid, args, opts))
            return self.compiled
        return go


@pytest.fixture
def fake_env(monkeypatch):
    drv = types.SimpleNamespace(active=types.SimpleNamespace(get_current_device=lambda: 0,
                                                             get_current_stream=lambda d: 1234))
    knobs = types.SimpleNamespace(runtime=types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None))
    monkeypatch.setattr(_launch, "_driver", drv, raising=False)
    monkeypatch.setattr(_launch, "_knobs", knobs, raising=False)
    monkeypatch.setattr(_launch, "_ENABLED", True)
    return knobs


def test_first_call_compiles_then_direct_launch(fake_env):
    jit = _JIT()
    cl = _launch.CachedLaunch(jit)
    args = ("x", "y", 7, 128, True)
    cl((3, 2), "k", *args, num_warps=4)
    assert len(jit.calls) == 1 and jit.calls[0] == ((3, 2), args, {"num_warps": 4})
    cl((5,), "k", *args, num_warps=4)
    assert len(jit.calls) == 1
    assert jit.compiled.runs == [(5, 1, 1, 1234, "fn-handle", "meta", None, None, None) + args]
    cl((5,), "other-key", *args, num_warps=4)  # a new specialization key compiles (JIT path) again
    assert len(jit.calls) == 2


def test_hooks_or_disabled_use_the_jit_path(fake_env, monkeypatch):
    jit = _JIT()
    cl = _launch.CachedLaunch(jit)
    cl((1,), "k", 1)
    fake_env.runtime.launch_enter_hook = object()  # e.g. a profiler
    cl((1,), "k", 1)
    assert len(jit.calls) == 2 and jit.compiled.runs == []
    fake_env.runtime.launch_enter_hook = None
    monkeypatch.setattr(_launch, "_ENABLED", False)
    cl((1,), "k", 1)
    assert len(jit.calls) == 3 and jit.compiled.runs == []


def test_empty_hook_chain_is_no_hook(fake_env):
    """Triton 3.6 keeps a HookChain in knobs.runtime.launch_enter_hook / launch_exit_hook even when no hook is
    installed: an empty chain takes the shortcut, a chain with a hook (a profiler) does not."""
    chain = types.SimpleNamespace(calls=[])
    fake_env.runtime.launch_enter_hook = chain
    fake_env.runtime.launch_exit_hook = types.SimpleNamespace(calls=[])
    jit = _JIT()
    cl = _launch.CachedLaunch(jit)
    cl((1,), "k", 1)
    cl((1,), "k", 1)
    assert len(jit.calls) == 1 and len(jit.compiled.runs) == 1
    chain.calls.append(print)
    cl((1,), "k", 1)
    assert len(jit.calls) == 2 and len(jit.compiled.runs) == 1


def test_launcher_signature_mismatch_disables_the_shortcut(fake_env, monkeypatch):
    jit = _JIT()
    cl = _launch.CachedLaunch(jit)
    cl((1,), "k", 1)

    def bad_run(*a):
        raise TypeError("launcher takes other arguments")

    jit.compiled.run = bad_run
    cl((1,), "k", 1)  # falls back to the JIT path and turns the shortcut off
    assert len(jit.calls) == 2 and _launch._ENABLED is False


class _Param:
    def __init__(self, name, constexpr=False, default=None, has_default=False):
        self.name, self.is_constexpr, self.default, self.has_default = name, constexpr, default, has_default


class _Tensor:
    def __init__(self, ptr, dtype="bf16"):
        self.ptr, self.dtype = ptr, dtype

    def data_ptr(self):
        return self.ptr


def test_specialized_launch_keys_on_what_triton_specializes(fake_env):
    """SpecializedLaunch builds CachedLaunch's key itself: a tensor's dtype and 16-byte alignment, an integer's
    == 1 / % 16 / width, a constexpr's value, the launch options; other changes reuse the compiled kernel, and the
    launcher gets every parameter in order, defaults filled in."""
    jit = _JIT()
    jit.params = [_Param("x"), _Param("n"), _Param("s"), _Param("BLOCK", True), _Param("FLAG", True, False, True)]
    sl = _launch.SpecializedLaunch(jit)
    x = _Tensor(4096)
    sl[(2,)](x, 100, 0.5, BLOCK=64, num_warps=4)
    assert len(jit.calls) == 1 and jit.calls[0] == ((2,), (x, 100, 0.5, 64, False), {"num_warps": 4})
    y = _Tensor(8192)
    sl[(3,)](y, 36, 2.0, BLOCK=64, num_warps=4)  # same specialization: the compiled kernel
    assert len(jit.calls) == 1 and len(jit.compiled.runs) == 1
    assert jit.compiled.runs[0][:3] == (3, 1, 1) and jit.compiled.runs[0][-5:] == (y, 36, 2.0, 64, False)
    for args, kw in [((_Tensor(4100), 100, 0.5), {}),             # misaligned pointer
                     ((_Tensor(4096, "fp16"), 100, 0.5), {}),      # dtype
                     ((x, 1, 0.5), {}),                            # an integer equal to 1
                     ((x, 96, 0.5), {}),                           # divisible by 16
                     ((x, 2**40 + 3, 0.5), {}),                    # 64-bit
                     ((x, 100, 0.5), {"FLAG": True}),              # a constexpr's value
                     ((x, 100, 0.5), {"num_warps": 8})]:           # a launch option
        n = len(jit.calls)
        kw = {"BLOCK": 64, "num_warps": 4, **kw}
        sl[(1,)](*args, **kw)
        assert len(jit.calls) == n + 1, (args, kw)
        sl[(1,)](*args, **kw)
        assert len(jit.calls) == n + 1, (args, kw)


def test_keyed_launch_uses_the_callers_key(fake_env, monkeypatch):
    """SpecializedLaunch.keyed: the caller's key (with the current device) instead of the built one; the launcher gets
    the positional arguments, then every later parameter (kwargs, defaults filled in) in order; a new key compiles;
    its keys are apart from launch()'s; with the shortcut off it is the JIT call."""
    jit = _JIT()
    jit.params = [_Param("x"), _Param("n"), _Param("BLOCK", True), _Param("FLAG", True, False, True)]
    sl = _launch.SpecializedLaunch(jit)
    x, y = _Tensor(4096), _Tensor(4100)  # a misaligned y under the same key: the caller's key is trusted
    sl.keyed((2,), ("plan", 1), (x, 100), {"BLOCK": 64, "num_warps": 4})
    assert jit.calls == [((2,), (x, 100, 64, False), {"num_warps": 4})]
    sl.keyed((3,), ("plan", 1), (y, 7), {"BLOCK": 64, "num_warps": 4})
    assert len(jit.calls) == 1
    assert jit.compiled.runs[0][:3] == (3, 1, 1) and jit.compiled.runs[0][-4:] == (y, 7, 64, False)
    sl.keyed((3,), ("plan", 2), (y, 7), {"BLOCK": 64, "FLAG": True, "num_warps": 4})
    assert len(jit.calls) == 2 and jit.calls[1] == ((3,), (y, 7, 64, True), {"num_warps": 4})
    sl[(1,)](x, 100, BLOCK=64, num_warps=4)  # launch()'s own key: not one of keyed()'s
    assert len(jit.calls) == 3
    fake_env_dev = _launch._driver.active
    monkeypatch.setattr(fake_env_dev, "get_current_device", lambda: 1)  # another device: compiles there
    sl.keyed((3,), ("plan", 1), (y, 7), {"BLOCK": 64, "num_warps": 4})
    assert len(jit.calls) == 4
    monkeypatch.setattr(_launch, "_ENABLED", False)
    sl.keyed((3,), ("plan", 1), (y, 7), {"BLOCK": 64, "num_warps": 4})
    assert jit.calls[-1] == ((3,), (y, 7), {"BLOCK": 64, "num_warps": 4})


def test_keyed_launch_keys_are_bounded(fake_env, monkeypatch):
    """Callers' keys hold shapes (a server sees every length): past KEYED_MAX they are dropped all at once, and a
    dropped key binds again (one JIT-path launch), the other launch's keys untouched."""
    monkeypatch.setattr(_launch, "KEYED_MAX", 3)
    jit = _JIT()
    jit.params = [_Param("x"), _Param("B", True)]
    sl = _launch.SpecializedLaunch(jit)
    sl[(1,)](_Tensor(4096), B=1)
    for i in range(3):
        sl.keyed((1,), i, (_Tensor(4096),), {"B": 1})
    assert len(jit.calls) == 4 and len(sl.compiled) == 4
    sl.keyed((1,), 3, (_Tensor(4096),), {"B": 1})  # the fourth key: the first three are dropped
    assert len(sl.compiled) == 2 and len(sl._tails) == 1
    sl.keyed((1,), 0, (_Tensor(4096),), {"B": 1})
    assert len(jit.calls) == 6
    sl[(1,)](_Tensor(4096), B=1)  # launch()'s key survived
    assert len(jit.calls) == 6


def test_unhashable_constexpr_takes_the_jit_path_every_call(fake_env):
    """A constexpr SpecializedLaunch cannot key on (an unhashable value) is passed to Triton's own launch, every
    call, with every parameter given: nothing cached under a partial key."""
    jit = _JIT()
    jit.params = [_Param("x"), _Param("L", True)]
    sl = _launch.SpecializedLaunch(jit)
    x = _Tensor(4096)
    for _ in range(2):
        sl[(1,)](x, L=[1, 2], num_warps=4)
    assert jit.calls == [((1,), (x, [1, 2]), {"num_warps": 4})] * 2 and not sl.compiled and not jit.compiled.runs


def test_launcher_is_one_per_kernel():
    """launcher(fn): the process's one SpecializedLaunch of each kernel, made at the first call."""
    a, b = _JIT(), _JIT()
    la = _launch.launcher(a)
    assert isinstance(la, _launch.SpecializedLaunch) and la.fn is a
    assert _launch.launcher(a) is la and _launch.launcher(b) is not la and _launch.launcher(b).fn is b


def test_specialized_launch_disabled_is_the_jit_call(fake_env, monkeypatch):
    jit = _JIT()  # no .params: never read while the shortcut is off (an interpreted kernel has none)
    monkeypatch.setattr(_launch, "_ENABLED", False)
    sl = _launch.SpecializedLaunch(jit)
    sl[(1,)](1, 2, BLOCK=3)
    sl[(1,)](1, 2, BLOCK=3)
    assert jit.calls == [((1,), (1, 2), {"BLOCK": 3})] * 2


def test_tuned_launch_times_once_per_key_and_says_so(monkeypatch, switches, capsys):
    """The autotuner (CPU: do_bench faked): the fastest candidate wins, is reused for the key without timing again,
    a failing candidate is skipped, and the first tuning of the process prints one notice."""

    switches(LOWBIT_AUTOTUNE=True)
    monkeypatch.setattr(at, "INTERPRET", False)
    monkeypatch.setattr(at, "_TUNED", {})
    monkeypatch.setattr(at, "_notice", threading.Event())
    cost = {"a": 3.0, "b": 1.0, "c": 2.0}
    ran, timed = [], []

    def fake_bench(fn, **kw):
        fn()
        timed.append(ran[-1])
        return cost[ran[-1]]

    def launch(cfg):
        if cfg["n"] == "bad":
            raise RuntimeError("out of shared memory")
        ran.append(cfg["n"])

    monkeypatch.setattr(triton.testing, "do_bench", fake_bench)
    cands = [{"n": "a"}, {"n": "bad"}, {"n": "b"}, {"n": "c"}]
    assert at.tuned_launch("k", (1,), cands, launch) == {"n": "b"}
    assert timed == ["a", "b", "c"] * 2 and ran[-1] == "b"  # two rounds; the failing candidate tried once
    built = []
    assert at.tuned_launch("k", (1,), lambda: built.append(1) or cands, launch) == {"n": "b"}
    assert timed == ["a", "b", "c"] * 2 and ran[-1] == "b" and not built  # reused: no timing, no candidate list built
    at.tuned_launch("k", (2,), cands, launch)  # a new key is tuned, silently this time
    err = capsys.readouterr().err
    assert err.count("[lowbit] autotuning") == 1 and "LOWBIT_AUTOTUNE=0" in err


def test_tma_allocator_installed_per_thread(monkeypatch):
    """Triton's allocator lives in a ContextVar (per thread); the autograd engine runs backward kernels on its own
    threads, so ensure_tma_allocator must install it in whichever thread launches — and keep a user's own."""
    import threading

    from triton.runtime._allocation import _allocator

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    before = _allocator.get()
    seen = {}

    def worker(name, preset=None):
        if preset is not None:
            _allocator.set(preset)
        _launch.ensure_tma_allocator()
        seen[name] = _allocator.get()

    mine = lambda size, alignment, stream: None  # noqa: E731
    for name, preset in (("a", None), ("b", None), ("user", mine)):
        t = threading.Thread(target=worker, args=(name, preset))
        t.start()
        t.join()
    assert seen["a"] is _launch._torch_scratch and seen["b"] is _launch._torch_scratch
    assert seen["user"] is mine
    assert _allocator.get() is before  # the other threads' settings did not leak into this one


def test_tuned_launch_keeps_each_candidates_best_round(monkeypatch, switches):
    """A candidate timed slow in the first round (a GPU whose clocks are still ramping) is judged by its best round:
    round 1 says a < b, round 2 says b < a by more, so b wins."""

    switches(LOWBIT_AUTOTUNE=True)
    monkeypatch.setattr(at, "INTERPRET", False)
    monkeypatch.setattr(at, "_TUNED", {})
    monkeypatch.setattr(at, "_notice", threading.Event())
    at._notice.set()
    rounds = iter([2.0, 5.0, 1.9, 1.0])  # a, b in round 1; a, b in round 2
    ran = []

    def fake_bench(fn, **kw):
        fn()
        return next(rounds)

    monkeypatch.setattr(triton.testing, "do_bench", fake_bench)
    assert at.tuned_launch("k", (1,), [{"n": "a"}, {"n": "b"}], lambda c: ran.append(c["n"])) == {"n": "b"}
    assert ran == ["a", "b", "a", "b", "b"]


@pytest.mark.gpu
def test_tuner_times_gpu_work_not_host_work():
    """On CUDA the tuner times each candidate from a CUDA graph of one launch: a candidate with little GPU work and a
    slow host side (here a sleep) beats one with more GPU work, which an eager timing would rank the other way; a
    candidate that cannot be captured (a host sync) is timed eagerly, and capturing works again after it."""
    import time

    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")

    x = torch.randn(1 << 24, device="cuda")  # 64 MB: a few passes take a few hundred microseconds
    y = torch.empty_like(x)

    def slow_host(c=None):  # ~1 ms of host time, one cheap kernel
        time.sleep(1e-3)
        y[:1024].copy_(x[:1024])

    def busy_gpu(c=None):  # no host delay, eight 128 MB passes
        for _ in range(8):
            y.copy_(x)

    assert at._gpu_ms(slow_host) < 0.1 < 0.5 < triton.testing.do_bench(slow_host, warmup=3, rep=10)
    assert at._gpu_ms(busy_gpu) > 0.15
    old = dict(at._TUNED)
    try:
        with env.override(LOWBIT_AUTOTUNE=True):
                picked = at.tuned_launch("test_host_vs_gpu", (1,), [{"n": "gpu"}, {"n": "host"}],
                                     lambda c: (busy_gpu if c["n"] == "gpu" else slow_host)())
        assert picked == {"n": "host"}
    finally:
        at._TUNED.clear()
        at._TUNED.update(old)
    synced = []

    def syncs():  # not capturable: .item() waits for the GPU
        synced.append(float(x[:16].sum().item()))

    assert at._gpu_ms(syncs) > 0 and synced
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y.copy_(x)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x)


@pytest.mark.gpu
def test_tuner_inside_a_capture_takes_the_first_candidate(monkeypatch, switches):
    """An untuned key met inside a CUDA-graph capture (a graph, or another tuner timing a launch that calls this one)
    launches the first candidate untimed and records nothing; the next call outside a capture tunes."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")

    switches(LOWBIT_AUTOTUNE=True)
    monkeypatch.setattr(at, "_TUNED", {})
    x = torch.randn(1 << 20, device="cuda")
    y = torch.empty_like(x)
    ran = []

    def launch(c):
        ran.append(c["n"])
        y.copy_(x * c["m"])

    cands = [{"n": "first", "m": 1.0}, {"n": "second", "m": 2.0}]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        assert at.tuned_launch("test_in_capture", (1,), cands, launch) == cands[0]
    assert ran == ["first"] and ("test_in_capture", 1) not in at._TUNED
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x)
    at.tuned_launch("test_in_capture", (1,), cands, launch)
    assert ("test_in_capture", 1) in at._TUNED and len(ran) > 2
