"""The DeepGEMM backend (``lowbit.gemm.deepgemm``): which calls it takes, and that it hands DeepGEMM lowbit's operands
in the layouts DeepGEMM requires.

On the CPU through a stand-in for ``deep_gemm`` that keeps its operand contract (``fake_deep_gemm``); on the GPU, where
the real package imports, against the float64 reference under NUMERICS §5's bound, and bit for bit where every
partial sum is exact.
"""
from __future__ import annotations

import sys

import fake_deep_gemm
import pytest
import torch

from lowbit.gemm import backend_for, deepgemm, forget_choices, scaled_mm, scaled_mm_reference
from lowbit.quant import Float8Blockwise, quantize
from lowbit.runtime import env

ACT, WEIGHT = Float8Blockwise(), Float8Blockwise(block_dim=2)


@pytest.fixture
def fake(monkeypatch):
    """The stand-in as ``deep_gemm``, with the CPU taken for an sm_90 GPU; the backend's state and the dispatcher's
    memo fresh, and forgotten again after the test (no CPU call may stay memoized on the backend)."""
    mod = fake_deep_gemm.make()
    monkeypatch.setitem(sys.modules, "deep_gemm", mod)
    for name, fresh in (("_loaded", {}), ("_failed", {}), ("_compiled", set())):
        monkeypatch.setattr(deepgemm, name, fresh)
    monkeypatch.setattr(deepgemm, "_on_sm90", lambda device: True)
    forget_choices()
    yield mod
    forget_choices()


def _layer(M, K, N, seed, device="cpu"):
    """x (M, K) and w (N, K) quantized as an fp8-block Linear does: both copies of each."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.exp(torch.randn(M, 1, generator=g))
    w = torch.randn(N, K, generator=g) * torch.exp(torch.randn(N, 1, generator=g))
    qx = quantize(x.bfloat16().to(device), ACT, rowwise=True, columnwise=True)
    qw = quantize(w.bfloat16().to(device), WEIGHT, rowwise=True, columnwise=True)
    return qx, qw


# (M, K, N): M not a multiple of 4 or 128 (padded scale columns); K / 128 of 3 and 22 (the 128x128 grid's stored rows
# padded to 4 and 24: a packed copy goes in; with N = 128 a one-row grid, which torch calls contiguous whatever its
# stride) and of 4; N a multiple of 8 only, and of 128 (dgrad contracts over N: 3 blocks, padded again, 8 and 1)
SHAPES = [(200, 384, 264), (130, 2816, 384), (64, 512, 1024), (72, 384, 128)]


@pytest.mark.parametrize("M,K,N", SHAPES)
def test_fprop_and_dgrad_on_deepgemm_with_its_layouts(fake, M, K, N):
    """The forward (x · wᵀ) and the data gradient (dy · w, w's columnwise copy), the backend named (these M are
    below MIN_M), give the float64 reference's bits (the stand-in computes exactly; it asserts DeepGEMM's operand
    layouts)."""
    qx, qw = _layer(M, K, N, seed=M)
    y = scaled_mm(qx, qw, out_dtype=torch.bfloat16, backend="deepgemm")
    assert fake.calls["n"] == 1
    assert torch.equal(y, scaled_mm_reference(qx, qw, out_dtype=torch.bfloat16)[0])
    g = torch.Generator().manual_seed(M + 1)
    qdy = quantize(torch.randn(M, N, generator=g).bfloat16(), ACT)
    if N % 128:  # dgrad contracts over N: DeepGEMM needs whole 128-blocks of it
        with pytest.raises(NotImplementedError, match="'deepgemm' does not support"):
            scaled_mm(qdy, qw, b_copy="columnwise", out_dtype=torch.bfloat16, backend="deepgemm")
        return
    dx = scaled_mm(qdy, qw, b_copy="columnwise", out_dtype=torch.bfloat16, backend="deepgemm")
    assert fake.calls["n"] == 2
    assert torch.equal(dx, scaled_mm_reference(qdy, qw, b_copy="columnwise", out_dtype=torch.bfloat16)[0])


def test_training_sized_calls_pick_it_by_default(fake):
    """Unasked, it takes calls of at least MIN_M rows (BF16 out being the default out_dtype), not fewer."""
    M = deepgemm.MIN_M
    qx, qw = _layer(M, 256, 136, seed=9)
    assert backend_for(qx, qw, out_dtype=torch.bfloat16) == backend_for(qx, qw) == "deepgemm"
    y = scaled_mm(qx, qw)
    assert fake.calls["n"] == 1 and torch.equal(y, scaled_mm_reference(qx, qw, out_dtype=torch.bfloat16)[0])
    short, _ = _layer(M - 8, 256, 136, seed=10)
    assert backend_for(short, qw) != "deepgemm"


def test_the_first_call_of_a_shape_is_logged_once(fake, monkeypatch, caplog, capsys):
    """DeepGEMM compiles a kernel on the first call of each GEMM shape: the process's first such call prints a notice
    to stderr, and each shape's first call is logged at INFO, once; a shape first seen inside a CUDA-graph capture
    runs on the next backend (no compile there), and DeepGEMM takes it once seen outside one."""
    import logging

    caplog.set_level(logging.INFO, logger="lowbit")
    monkeypatch.setattr(deepgemm, "MIN_M", 1)
    qx, qw = _layer(128, 384, 256, seed=3)
    qx2, qw2 = _layer(64, 256, 128, seed=4)
    for _ in range(2):
        scaled_mm(qx, qw, out_dtype=torch.bfloat16)
        scaled_mm(qx2, qw2, out_dtype=torch.bfloat16)
    assert fake.calls["n"] == 4
    msgs = [r.getMessage() for r in caplog.records if r.name == "lowbit" and "DeepGEMM" in r.getMessage()]
    assert msgs == [f"DeepGEMM: first call with M={m}, N={n}, K={k} on cpu (it compiles a kernel for it unless cached)"
                    for m, n, k in ((128, 256, 384), (64, 128, 256))]
    err = capsys.readouterr().err
    assert err.count("[lowbit] DeepGEMM runs the blockwise FP8") == 1 and "LOWBIT_DEEPGEMM=0" in err
    qx3, _ = _layer(96, 384, 256, seed=5)
    monkeypatch.setattr(deepgemm, "_capturing", lambda t: True)
    y = scaled_mm(qx3, qw, out_dtype=torch.bfloat16)
    assert fake.calls["n"] == 4 and torch.equal(y, scaled_mm_reference(qx3, qw, out_dtype=torch.bfloat16)[0])
    scaled_mm(qx, qw, out_dtype=torch.bfloat16)  # (a shape seen before: DeepGEMM, captured or not)
    assert fake.calls["n"] == 5
    monkeypatch.setattr(deepgemm, "_capturing", lambda t: False)
    scaled_mm(qx3, qw, out_dtype=torch.bfloat16)
    assert fake.calls["n"] == 6


def test_a_shape_deepgemm_fails_on_goes_to_the_next_backend(fake, monkeypatch):
    """DeepGEMM raising for an (N, K) (here: no nvcc to compile its kernel) is warned about once; that call and later
    ones of the same (N, K) get the next backend's result (the reference, on the CPU), other shapes stay on DeepGEMM.
    Out of memory propagates and marks nothing."""
    real = fake.fp8_fp4_gemm_nt

    def failing(a, b, d, **kw):
        if b[0].shape[0] == 256:
            raise RuntimeError("Assertion error (csrc/jit/compiler.hpp:175): std::filesystem::exists(nvcc_path)")
        if b[0].shape[0] == 384:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        real(a, b, d, **kw)

    monkeypatch.setattr(fake, "fp8_fp4_gemm_nt", failing)
    monkeypatch.setattr(deepgemm, "MIN_M", 1)
    bf16 = torch.bfloat16
    qx, qw = _layer(128, 384, 256, seed=5)
    with pytest.warns(UserWarning, match=r"DeepGEMM failed on a GEMM with N=256, K=384 \(RuntimeError: .*nvcc_path"):
        y = scaled_mm(qx, qw, out_dtype=bf16)
    assert torch.equal(y, scaled_mm_reference(qx, qw, out_dtype=bf16)[0])
    assert backend_for(qx, qw, out_dtype=bf16) != "deepgemm"
    assert torch.equal(scaled_mm(qx, qw, out_dtype=bf16), y)
    qx2, qw2 = _layer(128, 384, 128, seed=6)
    assert backend_for(qx2, qw2, out_dtype=bf16) == "deepgemm"
    qx3, qw3 = _layer(128, 256, 384, seed=7)
    with pytest.raises(torch.OutOfMemoryError):
        scaled_mm(qx3, qw3, out_dtype=bf16)
    assert backend_for(qx3, qw3, out_dtype=bf16) == "deepgemm"


def test_the_calls_it_declines(fake, monkeypatch):
    """Anything but a plain BF16-out 1x128 · 128x128 E4M3 GEMM with K a multiple of 128 and N of 8 goes to the next
    backend, and so does everything with the switch off (in a call the dispatcher has memoized too), without the
    package, or off sm_90."""
    monkeypatch.setattr(deepgemm, "MIN_M", 1)
    qx, qw = _layer(256, 256, 256, seed=1)
    bf16 = torch.bfloat16
    assert backend_for(qx, qw, out_dtype=bf16) == "deepgemm"
    declined = [
        dict(out_dtype=torch.float32), dict(out_dtype=torch.float16), dict(out_dtype=bf16, bias=torch.zeros(256)),
        dict(out_dtype=bf16, gelu=True), dict(out_dtype=bf16, accumulate=True),
        dict(out_dtype=bf16, out=torch.empty(256, 256, dtype=bf16)),
    ]
    for opts in declined:
        assert backend_for(qx, qw, **opts) != "deepgemm", opts
    x = torch.randn(256, 256).bfloat16()
    for sa, sb, shape in [(ACT, ACT, None), (Float8Blockwise(fmt="e5m2"), WEIGHT, None),
                          (Float8Blockwise(block_size=64), Float8Blockwise(block_size=64, block_dim=2), None),
                          (ACT, WEIGHT, (256, 320)), (ACT, WEIGHT, (260, 256))]:
        a = quantize(x if shape is None else torch.randn(256, shape[1]).bfloat16(), sa)
        b = quantize(x if shape is None else torch.randn(*shape).bfloat16(), sb)
        assert backend_for(a, b, out_dtype=bf16) != "deepgemm", (sa, sb, shape)
    scaled_mm(qx, qw, out_dtype=bf16)
    assert fake.calls["n"] == 1
    with env.override(LOWBIT_DEEPGEMM=False):
        assert backend_for(qx, qw, out_dtype=bf16) != "deepgemm"
        assert deepgemm.status() == "off (LOWBIT_DEEPGEMM=0)"
        scaled_mm(qx, qw, out_dtype=bf16)
    assert fake.calls["n"] == 1
    with pytest.raises(NotImplementedError, match="'deepgemm' does not support"):
        scaled_mm(qx, qw, out_dtype=torch.float32, backend="deepgemm")
    monkeypatch.setattr(deepgemm, "_on_sm90", lambda device: False)
    assert backend_for(qx, qw, out_dtype=bf16) != "deepgemm"


def test_without_a_usable_package_it_says_why(monkeypatch):
    """No package, a package that fails to import (warned about once), or a DeepGEMM without the 2.x API: the backend
    takes nothing and ``status`` (``lowbit info``) says why."""
    monkeypatch.setattr(deepgemm, "_on_sm90", lambda device: True)
    monkeypatch.setattr(deepgemm, "MIN_M", 1)
    qx, qw = _layer(128, 256, 128, seed=2)
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # (import raises ModuleNotFoundError)
    monkeypatch.setattr(deepgemm, "_loaded", {})
    assert backend_for(qx, qw, out_dtype=torch.bfloat16) != "deepgemm"
    assert "not installed" in deepgemm.status(torch.device("cpu"))

    import importlib

    real = importlib.import_module

    def failing(name, *a, **k):
        if name == "deep_gemm":
            raise ImportError("deep_gemm/_C.so: undefined symbol: _ZN3c10")
        return real(name, *a, **k)

    monkeypatch.setattr(deepgemm.importlib, "import_module", failing)
    monkeypatch.setattr(deepgemm, "_loaded", {})
    with pytest.warns(UserWarning, match="does not import: ImportError: deep_gemm/_C.so"):
        assert backend_for(qx, qw, out_dtype=torch.bfloat16) != "deepgemm"
    assert "undefined symbol" in deepgemm.status(torch.device("cpu"))
    monkeypatch.setattr(deepgemm.importlib, "import_module", real)
    old = type(sys)("deep_gemm")
    old.gemm_fp8_fp8_bf16_nt = lambda *a: None  # DeepGEMM 1.x's entry point
    monkeypatch.setitem(sys.modules, "deep_gemm", old)
    monkeypatch.setattr(deepgemm, "_loaded", {})
    assert backend_for(qx, qw, out_dtype=torch.bfloat16) != "deepgemm"
    assert "no fp8_fp4_gemm_nt" in deepgemm.status(torch.device("cpu"))


def _real_deepgemm(cuda):
    pytest.importorskip("deep_gemm", reason="DeepGEMM is not installed (tools/deepgemm_build.sh)")
    if not deepgemm._on_sm90(cuda):
        pytest.skip("DeepGEMM's kernels are sm_90's")
    deepgemm._loaded.clear()
    if deepgemm._module() is None:
        pytest.skip(deepgemm.status(cuda))


@pytest.mark.gpu
@pytest.mark.parametrize("M,K,N", SHAPES + [(1040, 2048, 2832), (4096, 1024, 3072), (8192, 512, 264)])
def test_gpu_deepgemm_vs_reference(M, K, N, cuda):
    """The real kernel within NUMERICS §5's bound of the float64 reference (the test_gemm bound: one K-block
    truncation, a rounding per promotion, one BF16 rounding) on random data; bit for bit on small integers with
    power-of-two scales, where every partial sum is exact; chosen unasked at M >= MIN_M."""
    _real_deepgemm(cuda)
    from test_gemm import _check, _operands

    a, b = _operands(M, N, K, ACT, WEIGHT, "rowwise", "rowwise", cuda, seed=K)
    assert (backend_for(a, b) == "deepgemm") == (M >= deepgemm.MIN_M)
    _check(a, b, "rowwise", "rowwise", "deepgemm", out_dtype=torch.bfloat16)
    pow2 = Float8Blockwise(pow2=True), Float8Blockwise(block_dim=2, pow2=True)
    a, b = _operands(M, N, K, *pow2, "rowwise", "rowwise", cuda, seed=K + 1, ints=True)
    y = scaled_mm(a, b, out_dtype=torch.bfloat16, backend="deepgemm")
    assert torch.equal(y, scaled_mm_reference(a, b, out_dtype=torch.bfloat16)[0].to(cuda))
    if N % 128 == 0:  # dgrad: the weight's columnwise copy
        a, b = _operands(M, K, N, ACT, WEIGHT, "rowwise", "columnwise", cuda, seed=N)
        _check(a, b, "rowwise", "columnwise", "deepgemm", out_dtype=torch.bfloat16)


def replays_on_new_values(backend, cuda, also=None):
    """A BF16 ``scaled_mm`` on ``backend`` captured in a CUDA graph (with ``also(qw)`` captured after it, where given)
    replays on new values of its activation's codes and scales with the bits of an eager call on them, which differ
    from the first values'. Returns ``(qx, qw, y, also's result)``: the operands (now holding the new values), the
    captured output."""
    bf16 = torch.bfloat16
    qx, qw = _layer(512, 1024, 768, seed=7, device=cuda)
    y0 = scaled_mm(qx, qw, out_dtype=bf16, backend=backend)  # (a first call outside the capture: compiles there)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = scaled_mm(qx, qw, out_dtype=bf16, backend=backend)
        extra = None if also is None else also(qw)
    nx, _ = _layer(512, 1024, 768, seed=8, device=cuda)
    qx.rowwise.data.copy_(nx.rowwise.data)
    qx.rowwise.scale_inv.copy_(nx.rowwise.scale_inv)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, scaled_mm(nx, qw, out_dtype=bf16, backend=backend)) and not torch.equal(y, y0)
    return qx, qw, y, extra


@pytest.mark.gpu
def test_gpu_deepgemm_in_a_cuda_graph(cuda):
    """A call captured in a CUDA graph replays on new operand values with the bits of an eager call on them; a shape
    first seen inside the capture runs on the next backend there (here cuBLAS: the bits of cuBLAS's call)."""
    _real_deepgemm(cuda)
    bf16 = torch.bfloat16
    fresh, _ = _layer(528, 1024, 768, seed=9, device=cuda)  # (M a multiple of 16: cuBLAS takes it)
    _, qw, _, z = replays_on_new_values("deepgemm", cuda,
                                        also=lambda qw: scaled_mm(fresh, qw, out_dtype=bf16, backend="deepgemm"))
    assert torch.equal(z, scaled_mm(fresh, qw, out_dtype=bf16, backend="cublas"))
