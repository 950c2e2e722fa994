"""scaled_mm's structural checks of its operands and the GEMM backends' layout errors (CPU).

A QuantizedTensor whose data or scales do not match its scheme and logical shape must be refused with a
ValueError naming the operand (a / b), the copy, the rule and what was found — never multiplied: the
reference would read a wrong-shaped grid silently (or fail with a bare torch error), a kernel out of bounds.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lowbit.gemm import scaled_mm
from lowbit.quant import MXFP8, NVFP4, Float8Blockwise, Float8Rowwise, Float8Tensorwise, quantize
from lowbit.quant.tensor import QuantizedCopy, QuantizedTensor

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # pragma: no cover
    HAVE_TRITON = False


def _q(shape, scheme, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(*shape, generator=g), scheme, **kw)


def _with(qt: QuantizedTensor, which="rowwise", **fields) -> QuantizedTensor:
    """A copy of ``qt`` whose ``which`` copy has ``fields`` replaced."""
    out = dataclasses.replace(qt)
    setattr(out, which, dataclasses.replace(getattr(qt, which), **fields))
    return out


def test_wrong_scale_grid_shape_is_refused_not_read():
    a = _q((64, 256), Float8Blockwise())  # 1x128 over K = 256: storage (2, pad4(64)) = (2, 64)
    b = _q((32, 256), Float8Blockwise(block_dim=2), seed=1)
    other = _q((64, 512), Float8Blockwise(), seed=2).rowwise.scale_inv  # a (4, 64) grid: the reference read it silently
    assert other.shape == (4, 64)
    with pytest.raises(ValueError, match=r"^a: the rowwise copy \(64, 256\).*scale_inv must have the storage shape "
                                         r"\(2, 64\) \(1x128: .*got \(4, 64\)"):
        scaled_mm(_with(a, scale_inv=other), b)
    small = b.rowwise.scale_inv[:, :1].contiguous()  # a too-small 128x128 grid (torch raised a bare RuntimeError)
    with pytest.raises(ValueError, match=r"^b: the rowwise copy \(32, 256\).*storage shape \(1, 4\).*got \(1, 1\)"):
        scaled_mm(a, _with(b, scale_inv=small))
    with pytest.raises(ValueError, match=r"^b: .*scale_inv must be torch.float32, got torch.float64"):
        scaled_mm(a, _with(b, scale_inv=b.rowwise.scale_inv.double()))
    strided = torch.zeros(2, 128)[:, ::2]  # the right shape, not the storage layout
    with pytest.raises(ValueError, match=r"^a: .*scale_inv must be contiguous"):
        scaled_mm(_with(a, scale_inv=strided), b)


def test_data_format_and_shape_must_match_the_scheme():
    a = _q((48, 128), Float8Tensorwise())
    b = _q((16, 128), Float8Tensorwise(), seed=1)
    e5 = a.rowwise.data.float().to(torch.float8_e5m2)  # E5M2 bytes under an E4M3 scheme: read as E4M3 before
    with pytest.raises(ValueError, match=r"^a: the rowwise copy \(48, 128\) under Float8Tensorwise\(fmt='e4m3'\): "
                                         r"data must be torch.float8_e4m3fn, got torch.float8_e5m2"):
        scaled_mm(_with(a, data=e5), b)
    with pytest.raises(ValueError, match=r"^b: .*data must have shape \(16, 128\), got \(16, 64\)"):
        scaled_mm(a, _with(b, data=b.rowwise.data[:, :64]))
    with pytest.raises(ValueError, match=r"^b: .*scale_inv must have the storage shape \(1,\) \(tensorwise"):
        scaled_mm(a, _with(b, scale_inv=torch.ones(16, 1)))
    # the columnwise copy is named as such (wgrad: both operands columnwise)
    ac = _q((48, 128), Float8Rowwise(), columnwise=True, rowwise=False)
    bc = _q((48, 32), Float8Rowwise(), columnwise=True, rowwise=False, seed=3)
    bad = _with(bc, "columnwise", scale_inv=torch.ones(48, 1))  # the rowwise copy's shape, not the columnwise one's
    with pytest.raises(ValueError,
                       match=r"^b: the columnwise copy \(32, 48\).*\(32, 1\) \(rowwise: \(rows, 1\)\).*got \(48, 1\)"):
        scaled_mm(ac, bad, a_copy="columnwise", b_copy="columnwise")


def test_nvfp4_and_mxfp8_layouts():
    a, b = _q((32, 64), NVFP4()), _q((16, 64), NVFP4(two_d=True), seed=1)
    scaled_mm(a, b)  # well formed
    with pytest.raises(ValueError,
                       match=r"^a: .*data must have shape \(32, 32\) \(two E2M1 codes a byte\), got \(32, 64\)"):
        scaled_mm(_with(a, data=torch.zeros(32, 64, dtype=torch.uint8)), b)
    with pytest.raises(ValueError, match=r"^b: .*storage shape \(1, 4\) \(NVFP4 16x16"):
        scaled_mm(a, _with(b, scale_inv=a.rowwise.scale_inv[:16].contiguous()))  # a 1x16 grid under 16x16 tiles
    with pytest.raises(ValueError, match=r"^a: .*global_scale must be a float32 \(1,\)"):
        scaled_mm(_with(a, global_scale=None), b)
    m, n = _q((32, 64), MXFP8()), _q((32, 64), MXFP8(), seed=1)
    with pytest.raises(ValueError, match=r"^b: .*scale_inv must be torch.uint8, got torch.float32"):
        scaled_mm(m, _with(n, scale_inv=n.rowwise.scale_inv.float()))


def test_memoized_dispatch_still_checks_every_call():
    # scaled_mm remembers its validation per (schemes, shapes, ...) key; the tensors themselves change every call
    a = _q((64, 256), Float8Blockwise())
    b = _q((32, 256), Float8Blockwise(block_dim=2), seed=1)
    scaled_mm(a, b)
    scaled_mm(a, b)  # (a memo hit)
    bad = _with(a, data=a.rowwise.data.float().to(torch.float8_e5m2))
    with pytest.raises(ValueError, match=r"^a: .*got torch.float8_e5m2"):
        scaled_mm(bad, b)
    bad_b = _with(b, scale_inv=torch.ones(1, 1))
    with pytest.raises(ValueError, match=r"^b: .*storage shape \(1, 4\)"):
        scaled_mm(a, bad_b)


def test_quantized_tensor_validate():
    for sch in (Float8Tensorwise(), Float8Rowwise(), Float8Blockwise(), Float8Blockwise(block_dim=2, block_size=16),
                MXFP8(), NVFP4(), NVFP4(two_d=True), NVFP4(rht=True)):
        _q((2, 32, 64), sch, rowwise=True, columnwise=True).validate()
    _q((33, 200), Float8Blockwise(block_dim=2), rowwise=True, columnwise=True).validate()
    q = _q((32, 64), Float8Blockwise(), rowwise=True, columnwise=True)
    bad = _with(q, "columnwise", data=q.rowwise.data)
    with pytest.raises(ValueError,
                       match=r"^w: the columnwise copy \(64, 32\).*data must have shape \(64, 32\), got \(32, 64\)"):
        bad.validate("w")
    with pytest.raises(ValueError, match="neither"):
        QuantizedTensor(shape=torch.Size((4, 4)), dtype=torch.float32, scheme=Float8Tensorwise()).validate()


# ------------------------------------------------------------------------------------------------
# cuBLAS backend: layout errors are the caller's, not cuBLAS capability limits
# ------------------------------------------------------------------------------------------------
def _tw_pair():
    return _q((32, 64), Float8Tensorwise()), _q((16, 64), Float8Tensorwise(), seed=1)


def _call_cublas(a, b):
    from lowbit.gemm.cublas import scaled_mm_cublas

    return scaled_mm_cublas(a, b, a_copy="rowwise", b_copy="rowwise", out_dtype=torch.float32)


@pytest.fixture
def cublas_state():
    from lowbit.gemm import cublas

    before, why = set(cublas.REJECTED), dict(cublas.REJECTED_WHY)
    yield cublas
    cublas.REJECTED.clear()
    cublas.REJECTED.update(before)
    cublas.REJECTED_WHY.clear()
    cublas.REJECTED_WHY.update(why)


def test_cublas_refuses_noncontiguous_data_without_rejecting_the_signature(cublas_state, monkeypatch):
    called = []
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: called.append(1) or (_ for _ in ()).throw(
        RuntimeError("expected mat1 to be row-major")))
    a, b = _tw_pair()
    before = set(cublas_state.REJECTED)
    nc = _with(a, data=a.rowwise.data.t().contiguous().t())  # (32, 64), strides (1, 32)
    with pytest.raises(ValueError,
                       match=r"^a: the cuBLAS GEMM needs a's rowwise data contiguous along K.*strides \(1, 32\)"):
        _call_cublas(nc, b)
    with pytest.raises(ValueError, match=r"^b: the cuBLAS GEMM needs b's rowwise data contiguous"):
        _call_cublas(a, _with(b, data=b.rowwise.data.t().contiguous().t()))
    assert not called and cublas_state.REJECTED == before


def test_cublas_out_of_memory_propagates_and_is_not_remembered(cublas_state, monkeypatch):
    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(torch, "_scaled_mm", oom)
    a, b = _tw_pair()
    before = set(cublas_state.REJECTED)
    with pytest.raises(torch.OutOfMemoryError):
        _call_cublas(a, b)
    assert cublas_state.REJECTED == before

    def alloc(*a, **k):
        raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasLtMatmul(...)`")

    monkeypatch.setattr(torch, "_scaled_mm", alloc)
    with pytest.raises(RuntimeError, match="ALLOC_FAILED"):
        _call_cublas(a, b)
    assert cublas_state.REJECTED == before


def test_cublas_capability_error_is_remembered_and_answered_by_triton(cublas_state, monkeypatch):
    def no(*a, **k):  # (torch words cuBLAS's refusals as "CUDA error: CUBLAS_STATUS_...": still a capability limit)
        raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasLtMatmul( ltHandle, ...)`")

    monkeypatch.setattr(torch, "_scaled_mm", no)
    sentinel = (torch.zeros(1), None)
    monkeypatch.setattr(cublas_state, "_triton", lambda a, b, **kw: sentinel)
    a, b = _tw_pair()
    assert _call_cublas(a, b) is sentinel
    assert cublas_state._sig(a, b, torch.float32, 64) in cublas_state.REJECTED


def test_cublas_misaligned_data_goes_to_triton_for_that_call_only(cublas_state, monkeypatch):
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: pytest.fail("cuBLAS called with misaligned data"))
    sentinel = (torch.zeros(1), None)
    monkeypatch.setattr(cublas_state, "_triton", lambda a, b, **kw: sentinel)
    a, b = _tw_pair()
    buf = torch.empty(32 * 64 + 1, dtype=torch.float8_e4m3fn)
    mis = buf[1:].view(32, 64)  # contiguous, 1 byte off
    mis.copy_(a.rowwise.data)
    before = set(cublas_state.REJECTED)
    assert _call_cublas(_with(a, data=mis), b) is sentinel
    assert cublas_state.REJECTED == before


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
def test_triton_gemm_names_the_noncontiguous_operand():
    from lowbit.gemm.triton_backend import scaled_mm_emulated, scaled_mm_triton

    a, b = _tw_pair()
    kw = dict(a_copy="rowwise", b_copy="rowwise", out_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"^b: the triton GEMM needs b's rowwise data contiguous along K"):
        scaled_mm_triton(a, _with(b, data=b.rowwise.data.t().contiguous().t()), **kw)
    m, n = _q((32, 64), MXFP8()), _q((32, 64), MXFP8(), seed=1)
    with pytest.raises(ValueError, match=r"^a: the triton GEMM needs a's rowwise data contiguous along K"):
        scaled_mm_emulated(_with(m, data=m.rowwise.data.t().contiguous().t()), n, **kw)


def test_copies_on_two_devices_are_refused():
    a, b = _tw_pair()
    meta = _with(a, data=torch.empty(32, 64, dtype=torch.float8_e4m3fn, device="meta"),
                 scale_inv=torch.empty(1, device="meta"))
    two = dataclasses.replace(a, columnwise=QuantizedCopy(data=a.rowwise.data.t().contiguous(),
                                                          scale_inv=a.rowwise.scale_inv, amax=a.rowwise.amax))
    two.rowwise = meta.rowwise
    with pytest.raises(ValueError, match=r"^a: the rowwise copy is on meta but the columnwise copy on cpu"):
        scaled_mm(two, b, a_copy="columnwise")


def test_check_operands_false_skips_every_check_on_a_seen_signature(monkeypatch):
    """``check_operands=False`` (what lowbit.nn passes for operands lowbit.quantize has just made) validates and picks
    the backend on a signature's first call only; later calls run no check at all (nor the backend choice) and give
    the same result. With ``check_operands=True`` every call still checks the operands' structure."""
    import lowbit.gemm as G

    a = _q((64, 256), Float8Blockwise(), seed=11)
    b = _q((48, 256), Float8Blockwise(block_dim=2), seed=12)
    want = scaled_mm(a, b, out_dtype=torch.float32)
    calls = {"validate": 0, "backend_for": 0, "structure": 0}
    real_validate, real_backend_for, real_struct = G._validate, G.backend_for, QuantizedTensor.validate

    def count(name, fn):
        def f(*args, **kw):
            calls[name] += 1
            return fn(*args, **kw)
        return f

    monkeypatch.setattr(G, "_validate", count("validate", real_validate))
    monkeypatch.setattr(G, "backend_for", count("backend_for", real_backend_for))
    monkeypatch.setattr(QuantizedTensor, "validate", count("structure", real_struct))
    for _ in range(3):
        got = scaled_mm(a, b, out_dtype=torch.float32, check_operands=False)
        assert torch.equal(got, want)
    assert calls == {"validate": 0, "backend_for": 0, "structure": 0}, calls
    scaled_mm(a, b, out_dtype=torch.float32)
    assert calls["structure"] == 2 and calls["validate"] == 0, calls
