"""lowbit._carveout: lowbit's kernels ask for the whole unified L1 as shared memory as they load (a driver preference
that keeps the SMs from being reconfigured before each cuBLAS / cuDNN kernel). CPU: the hook's filtering and the
setting's parsing with a fake driver library; GPU: the attribute really set on a loaded kernel, and only there."""
import pytest

pytest.importorskip("triton")
import torch  # noqa: E402

from lowbit import _carveout  # noqa: E402
from lowbit import _launch  # noqa: E402,F401  (installs the hook)


class _FakeLib:
    def __init__(self):
        self.calls = []

    def cuFuncSetAttribute(self, fn, attr, value):  # noqa: N802 - the driver's name
        self.calls.append((fn.value, attr, value))
        return 0


@pytest.fixture
def fake_lib(monkeypatch):
    lib = _FakeLib()
    monkeypatch.setitem(_carveout._STATE, "lib", lib)
    monkeypatch.setitem(_carveout._STATE, "names", None)
    return lib


def test_percent_parsing(monkeypatch):
    monkeypatch.delenv("LOWBIT_SMEM_CARVEOUT", raising=False)
    assert _carveout.carveout_percent() == 100
    for off in ("off", "OFF", "none", "default"):
        monkeypatch.setenv("LOWBIT_SMEM_CARVEOUT", off)
        assert _carveout.carveout_percent() is None
    monkeypatch.setenv("LOWBIT_SMEM_CARVEOUT", "50")
    assert _carveout.carveout_percent() == 50
    for bad in ("101", "-1", "max", "1.5"):
        monkeypatch.setenv("LOWBIT_SMEM_CARVEOUT", bad)
        with pytest.raises(ValueError, match="LOWBIT_SMEM_CARVEOUT.*0-100.*" + bad.replace(".", r"\.")):
            _carveout.carveout_percent()


def test_hook_installed():
    from triton import knobs

    assert _carveout._on_load in knobs.runtime.kernel_load_end_hook.calls


def test_names_cover_lowbit_kernels():
    import lowbit.ops.residual  # noqa: F401
    import lowbit.quant.kernels.quant_gluon  # noqa: F401

    names = _carveout.lowbit_kernel_names()
    # a plain @triton.jit kernel, an autotuned / heuristics-wrapped one's core, and a Gluon kernel
    assert {"_residual_add_kernel", "_column_sum_kernel", "rowcol_1x128_regs"} <= names


def test_hook_sets_lowbit_kernels_only(fake_lib, monkeypatch):
    import lowbit.ops.residual  # noqa: F401

    monkeypatch.delenv("LOWBIT_SMEM_CARVEOUT", raising=False)
    _carveout._on_load(None, 0x1234, "_residual_add_kernel", {}, "h")
    _carveout._on_load(None, 0x5678, "someone_elses_kernel", {}, "h")
    _carveout._on_load(None, None, "_residual_add_kernel", {}, "h")  # (the start hook's shape: no function yet)
    assert fake_lib.calls == [(0x1234, _carveout.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)]
    monkeypatch.setenv("LOWBIT_SMEM_CARVEOUT", "25")
    _carveout._on_load(None, 0x9, "_column_sum_kernel", {}, "h")
    assert fake_lib.calls[-1] == (0x9, 9, 25)
    monkeypatch.setenv("LOWBIT_SMEM_CARVEOUT", "off")
    _carveout._on_load(None, 0xA, "_column_sum_kernel", {}, "h")
    assert len(fake_lib.calls) == 2


def test_name_scan_refreshes_on_a_new_module(fake_lib, monkeypatch):
    """A kernel from a lowbit module imported after the last scan is still recognised (the scan re-runs on a miss)."""
    import sys
    import types

    import triton

    monkeypatch.setitem(_carveout._STATE, "names", {"_residual_add_kernel"})

    @triton.jit
    def _late_kernel_for_test(x):
        pass

    mod = types.ModuleType("lowbit._late_test_module")
    mod.k = _late_kernel_for_test
    monkeypatch.setitem(sys.modules, "lowbit._late_test_module", mod)
    _carveout._on_load(None, 0x77, "_late_kernel_for_test", {}, "h")
    assert fake_lib.calls == [(0x77, 9, 100)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_attribute_set_on_load(monkeypatch):
    """On the driver: a lowbit kernel loaded now carries carveout 100; a foreign kernel keeps the default (-1)."""
    import sys
    import types

    import triton
    import triton.language as tl

    monkeypatch.delenv("LOWBIT_SMEM_CARVEOUT", raising=False)

    @triton.jit
    def _carveout_probe_lowbit(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1.0, mask=offs < n)

    @triton.jit
    def _carveout_probe_foreign(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1.0, mask=offs < n)

    mod = types.ModuleType("lowbit._carveout_probe")
    mod.k = _carveout_probe_lowbit
    monkeypatch.setitem(sys.modules, "lowbit._carveout_probe", mod)
    x = torch.zeros(100, device="cuda")
    ck = _carveout_probe_lowbit[(1,)](x, 100, BLOCK=128)
    cf = _carveout_probe_foreign[(1,)](x, 100, BLOCK=128)
    torch.cuda.synchronize()
    assert torch.equal(x, torch.full_like(x, 2.0))
    assert _carveout.function_carveout(ck.function) == 100
    assert _carveout.function_carveout(cf.function) == -1
