"""lowbit's CUDA backend (``lowbit.gemm.cuda_sm90``) and the NVRTC runtime under it (``lowbit.runtime.nvrtc``).

On the CPU: which calls the backend takes, that a kernel that cannot be built sends calls to the next backend with one
warning, the compile cache, and (where an NVRTC library is installed: it compiles without a GPU) that the kernel
compiles for sm_90a without spilling. On the GPU: against the float64 reference under NUMERICS §5's bound on odd
shapes, bit for bit where every partial sum is exact, inside a CUDA graph, and a corrupted cache file. The operator a
compiled linear calls (``scaled_mm_traceable``): where it is called, its fallbacks, opcheck.
"""
from __future__ import annotations

import re

import pytest
import torch
from test_gemm_deepgemm import _layer, replays_on_new_values  # (x and w quantized as an fp8-block Linear does)

from lowbit.gemm import backend_for, cuda_sm90, forget_choices, scaled_mm, scaled_mm_reference
from lowbit.gemm.kernels import fp8_1d2d_sm90 as K1D2D
from lowbit.quant import Float8Blockwise, quantize
from lowbit.runtime import env, nvrtc

ACT, WEIGHT = Float8Blockwise(), Float8Blockwise(block_dim=2)


def _nvrtc_or_skip():
    try:
        nvrtc.nvrtc_version()
    except nvrtc.KernelUnavailable as e:
        pytest.skip(str(e))


@pytest.fixture
def fresh(monkeypatch):
    """The backend's state fresh, the CPU taken for an sm_90 GPU, and the dispatcher's memo forgotten before and
    after."""
    monkeypatch.setattr(cuda_sm90, "_state", {})
    monkeypatch.setattr(cuda_sm90, "_on_sm90", lambda device: True)
    forget_choices()
    yield
    forget_choices()


def test_the_calls_it_takes(fresh, monkeypatch):
    """A plain BF16-out 1x128 · 128x128 E4M3 GEMM with K a multiple of 16 (at most MAX_K_BLOCKS blocks) and N of 8, of
    at least MIN_M rows unless named; nothing else, and nothing off sm_90."""
    monkeypatch.setattr(cuda_sm90, "MIN_M", 1)
    monkeypatch.setattr("lowbit.gemm.deepgemm._module", lambda: None)
    bf16 = torch.bfloat16
    qx, qw = _layer(256, 272, 264, seed=1)
    assert backend_for(qx, qw, out_dtype=bf16) == "cuda"
    for opts in [dict(out_dtype=torch.float32), dict(out_dtype=bf16, bias=torch.zeros(264)),
                 dict(out_dtype=bf16, gelu=True), dict(out_dtype=bf16, out=torch.empty(256, 264, dtype=bf16))]:
        assert backend_for(qx, qw, **opts) != "cuda", opts
    for sa, sb, (k, n) in [(ACT, ACT, (256, 256)), (Float8Blockwise(fmt="e5m2"), WEIGHT, (256, 256)),
                           (ACT, WEIGHT, (264, 256)), (ACT, WEIGHT, (256, 258))]:
        a = quantize(torch.randn(64, k).bfloat16(), sa)
        b = quantize(torch.randn(n, k).bfloat16(), sb)
        assert backend_for(a, b, out_dtype=bf16) != "cuda", (sa, sb, k, n)
    with env.override(LOWBIT_CUDA_GEMM=False):
        assert backend_for(qx, qw, out_dtype=bf16) != "cuda"
        assert cuda_sm90.status() == "off (LOWBIT_CUDA_GEMM=0)"
    assert backend_for(qx, qw, out_dtype=bf16) == "cuda"
    with monkeypatch.context() as m:  # more K blocks than B's scales have room for (K 272: three)
        m.setattr(K1D2D, "MAX_K_BLOCKS", 2)
        assert backend_for(qx, qw, out_dtype=bf16) != "cuda"
    assert backend_for(qx, qw, out_dtype=bf16) == "cuda"
    monkeypatch.setattr(cuda_sm90, "MIN_M", 512)
    assert backend_for(qx, qw, out_dtype=bf16) != "cuda"
    with pytest.raises(NotImplementedError, match="'cuda' does not support"):
        scaled_mm(qx, qw, out_dtype=torch.float32, backend="cuda")
    monkeypatch.setattr(cuda_sm90, "_on_sm90", lambda device: False)
    assert backend_for(qx, qw, out_dtype=bf16, backend=None) != "cuda"
    assert cuda_sm90.status(torch.device("cpu")) == "not used: cpu is not a CUDA device"


def test_a_kernel_that_cannot_be_built_sends_calls_on(fresh, monkeypatch):
    """No NVRTC (or a source it rejects): one warning naming what is missing, the call answered by the next backend
    (the reference here), the backend off from then on and ``status`` saying why."""
    def missing():
        raise nvrtc.KernelUnavailable("NVRTC (libnvrtc.so.13) was not found: pip install nvidia-cuda-nvrtc")

    monkeypatch.setattr(cuda_sm90, "_kernel", missing)
    qx, qw = _layer(200, 384, 264, seed=2)
    with pytest.warns(UserWarning, match=r"CUDA GEMM kernel is unavailable \(NVRTC \(libnvrtc.so.13\) was not found"):
        y = scaled_mm(qx, qw, out_dtype=torch.bfloat16, backend="cuda")
    assert torch.equal(y, scaled_mm_reference(qx, qw, out_dtype=torch.bfloat16)[0])
    assert backend_for(qx, qw, out_dtype=torch.bfloat16) != "cuda"
    assert cuda_sm90.status().startswith("off: NVRTC (libnvrtc.so.13) was not found")


def test_unaligned_operands_go_to_the_next_backend(fresh, monkeypatch):
    """Codes that are a view one byte into a buffer (TMA needs 16-byte aligned rows) run on the next backend."""
    monkeypatch.setattr(cuda_sm90, "_kernel", lambda: pytest.fail("the kernel was asked for an unaligned operand"))
    qx, qw = _layer(64, 256, 128, seed=3)
    buf = torch.empty(64 * 256 + 1, dtype=torch.uint8)
    view = buf[1:].view(qx.rowwise.data.dtype).view(64, 256)
    view.copy_(qx.rowwise.data)
    qx.rowwise.data = view
    y = scaled_mm(qx, qw, out_dtype=torch.bfloat16, backend="cuda")
    assert torch.equal(y, scaled_mm_reference(qx, qw, out_dtype=torch.bfloat16)[0])


def test_the_operator_called_directly_declines_a_k_too_long(fresh, monkeypatch):
    """The traced operator called with more K blocks than the kernel holds B's scales for answers with cuBLAS's call
    and never launches the kernel."""
    from lowbit.gemm import cublas

    monkeypatch.setattr(cuda_sm90, "_kernel", lambda: pytest.fail("the kernel was asked for too long a K"))
    cublas_y = torch.full((256, 384), 2.0)
    monkeypatch.setattr(cublas, "scaled_mm_cublas_traceable", lambda *a, **k: cublas_y)
    monkeypatch.setattr(K1D2D, "MAX_K_BLOCKS", 3)  # (K 512: four)
    qx, qw = _layer(256, 512, 384, seed=8)
    args = (qx.rowwise.data, qw.rowwise.data, qx.logical_scales("rowwise"), qw.logical_scales("rowwise"))
    assert torch.ops.lowbit.fp8_gemm_1x128_128x128_bf16(*args) is cublas_y


def test_traced_call_runs_the_operator_where_eager_runs_the_kernel(fresh, monkeypatch):
    """``scaled_mm_traceable`` (what a compiled fp8-block linear calls) calls the backend's operator exactly where
    eager's dispatch picks this backend (DeepGEMM absent), and cuBLAS's traceable calls elsewhere; the kernel reads
    the scales as stored (no copy; a row-major logical grid is copied into that layout); the operator answers a call
    the kernel declines at run time, strided operands and a backend turned off with cuBLAS's result; on meta tensors
    it is shape-only."""
    from lowbit.gemm import cublas

    qx, qw = _layer(256, 512, 384, seed=5)
    A, B, sa, sb = qx.rowwise.data, qw.rowwise.data, qx.logical_scales("rowwise"), qw.logical_scales("rowwise")
    kernel_y, cublas_y = torch.full((256, 384), 1.0), torch.full((256, 384), 2.0)
    seen = []

    def launch(a, b, sa_stored, sb_stored):
        seen.append((sa_stored, sb_stored))
        return kernel_y

    monkeypatch.setattr(cuda_sm90, "_launch", launch)
    monkeypatch.setattr(cublas, "scaled_mm_cublas_traceable", lambda *a, **k: cublas_y)
    monkeypatch.setattr(cuda_sm90, "MIN_M", 256)
    kw = dict(a_scheme=ACT, b_scheme=WEIGHT, out_dtype=torch.bfloat16)
    with env.override(LOWBIT_DEEPGEMM=False):
        assert backend_for(qx, qw, out_dtype=torch.bfloat16) == "cuda"
    assert cuda_sm90.scaled_mm_traceable(A, B, sa, sb, **kw) is kernel_y
    (sa_k, sb_k), = seen  # (A's scales K-block-major: the stored grid itself)
    stored_a, stored_b = qx.rowwise.scale_inv, qw.rowwise.scale_inv
    assert sa_k.shape == (512 // 128, 256) and sa_k.data_ptr() == stored_a.data_ptr()
    assert sa_k.stride() == stored_a.stride() and sb_k.data_ptr() == stored_b.data_ptr()
    seen.clear()
    assert cuda_sm90.scaled_mm_traceable(A, B, sa.contiguous(), sb, **kw) is kernel_y
    assert seen[0][0].stride(1) == 1 and torch.equal(seen[0][0], sa_k)
    for other in (dict(kw, out_dtype=torch.float32), dict(kw, bias=torch.zeros(384)), dict(kw, a_scheme=WEIGHT)):
        assert cuda_sm90.scaled_mm_traceable(A, B, sa, sb, **other) is cublas_y, other
    monkeypatch.setattr(cuda_sm90, "MIN_M", 512)
    assert backend_for(qx, qw, out_dtype=torch.bfloat16) != "cuda"
    assert cuda_sm90.scaled_mm_traceable(A, B, sa, sb, **kw) is cublas_y
    monkeypatch.setattr(cuda_sm90, "MIN_M", 256)
    with env.override(LOWBIT_CUDA_GEMM=False):
        assert cuda_sm90.scaled_mm_traceable(A, B, sa, sb, **kw) is cublas_y
    op = torch.ops.lowbit.fp8_gemm_1x128_128x128_bf16
    assert op(A.t().contiguous().t(), B, sa, sb) is cublas_y  # (a column-major A: not what the kernel reads)
    monkeypatch.setitem(cuda_sm90._state, "why", "NVRTC was not found")
    assert op(A, B, sa, sb) is cublas_y
    del cuda_sm90._state["why"]
    monkeypatch.setattr(cuda_sm90, "_launch", lambda *a: None)
    assert cuda_sm90.scaled_mm_traceable(A, B, sa, sb, **kw) is cublas_y
    meta = [t.to("meta") for t in (A, B, sa, sb)]
    y = torch.ops.lowbit.fp8_gemm_1x128_128x128_bf16(*meta)
    assert y.device.type == "meta" and y.shape == (256, 384) and y.dtype == torch.bfloat16


def test_traced_operator_passes_opcheck(fresh, monkeypatch):
    """torch.library.opcheck on the traced call's operator: its fake agrees with what it returns (shape, dtype,
    strides), eager and through AOTAutograd with static and dynamic shapes (the launch replaced by an FP32 product on
    the CPU; the schema check runs FP8 operations the CPU lacks)."""
    monkeypatch.setattr(cuda_sm90, "_launch", lambda a, b, sa, sb: (a.float() @ b.float().t()).bfloat16())
    qx, qw = _layer(256, 512, 384, seed=6)
    args = (qx.rowwise.data, qw.rowwise.data, qx.logical_scales("rowwise"), qw.logical_scales("rowwise"))
    torch.library.opcheck(torch.ops.lowbit.fp8_gemm_1x128_128x128_bf16.default, args,
                          test_utils=("test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic"))


def test_tensor_maps_refuse_what_tma_cannot_read():
    """A TMA descriptor's rules, checked before the driver is asked: 16-byte aligned data and row pitch, boxes of
    1-256 elements a side."""
    t = torch.empty(64, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="16-byte aligned data"):
        nvrtc.tensor_map_2d(t[:, 1:], nvrtc.U8, 64, 63, 64, 64, 64, nvrtc.SWIZZLE_NONE)
    with pytest.raises(ValueError, match="row_stride_bytes: .*multiple of 16, got 40"):
        nvrtc.tensor_map_2d(t, nvrtc.U8, 64, 40, 40, 64, 64, nvrtc.SWIZZLE_NONE)
    with pytest.raises(ValueError, match="box_rows, box_cols: .*got 512 x 64"):
        nvrtc.tensor_map_2d(t, nvrtc.U8, 64, 64, 64, 512, 64, nvrtc.SWIZZLE_NONE)


def test_source_rejects_a_tile_wgmma_lacks():
    for bad in (0, 24, 272):
        with pytest.raises(ValueError, match=f"block_n: expected a multiple of 16 in \\[16, 128\\].*got {bad}"):
            K1D2D.source(128, bad, 4, 8)
    with pytest.raises(ValueError, match="block_m: expected 128 or 256.*got 64"):
        K1D2D.source(64, 128, 4, 8)
    with pytest.raises(ValueError, match="stages, group_m: expected at least 2 and 1, got 1 and 8"):
        K1D2D.source(256, 128, 1, 8)
    with pytest.raises(ValueError, match="cluster: expected 1 or 2.*got 4"):
        K1D2D.source(256, 128, 3, 8, cluster=4)


def test_the_kernel_compiles_for_sm90a_without_spills():
    """NVRTC compiles without a GPU: the kernel at the backend's tile builds for sm_90a, and ptxas reports no spills
    (the math warpgroups' 232 registers hold two 64 x 128 FP32 accumulators and a wgmma's 64 x 128 partial)."""
    _nvrtc_or_skip()
    src = K1D2D.source(**cuda_sm90.TILE)
    _, log = nvrtc.compile_cubin(src, K1D2D.KERNEL_NAME, "sm_90a", ("--ptxas-options=-v",), cache=False)
    assert re.search(r"Compiling entry function '" + K1D2D.KERNEL_NAME, log), log
    assert "0 bytes spill stores, 0 bytes spill loads" in log, log


def test_compiled_kernels_are_cached_on_disk(tmp_path):
    """The first compile writes the cubin under the cache directory; a second gets those bytes back without NVRTC's
    log; a source NVRTC rejects raises KernelUnavailable with its log."""
    _nvrtc_or_skip()
    src = 'extern "C" __global__ void lowbit_probe(float* x) { x[threadIdx.x] += 1.f; }\n'
    with env.override(LOWBIT_CACHE=str(tmp_path)):
        cubin, log = nvrtc.compile_cubin(src, "lowbit_probe", "sm_90a", ("--ptxas-options=-v",))
        files = list((tmp_path / "kernels").glob("lowbit_probe-*.cubin"))
        assert len(files) == 1 and files[0].read_bytes() == cubin and "lowbit_probe" in log
        again, log2 = nvrtc.compile_cubin(src, "lowbit_probe", "sm_90a", ("--ptxas-options=-v",))
        assert again == cubin and log2 == ""
        other, _ = nvrtc.compile_cubin(src, "lowbit_probe", "sm_90a")  # other options: another key
        assert len(list((tmp_path / "kernels").glob("lowbit_probe-*.cubin"))) == 2 and other
        with pytest.raises(nvrtc.KernelUnavailable, match=r"could not compile lowbit_bad.*\n.*error"):
            nvrtc.compile_cubin("this is not CUDA", "lowbit_bad", "sm_90a")
        # a cache entry that cannot be read (here a directory in its place) is a miss, and cannot be written: skipped
        src2 = src.replace("+= 1.f", "+= 3.f")
        before = set((tmp_path / "kernels").glob("*.cubin"))
        key_file = nvrtc.compile_cubin(src2, "lowbit_probe", "sm_90a")[0]
        (entry,) = set((tmp_path / "kernels").glob("*.cubin")) - before
        entry.unlink()
        entry.mkdir()
        assert nvrtc.compile_cubin(src2, "lowbit_probe", "sm_90a")[0] == key_file and entry.is_dir()
        assert not list((tmp_path / "kernels").glob("*.tmp"))


# (M, K, N): M below one tile, ragged and above a wave of tiles; K a multiple of 16 but not of 128 (the last block
# zero-filled by TMA), K / 128 of 3 and 22 (the 128x128 grid's rows padded); N a multiple of 8, not of 128 (an odd
# number of column blocks: the cluster's second CTA computes past N and stores nothing)
GPU_SHAPES = [(72, 384, 128), (200, 400, 264), (1040, 2816, 2832), (4096, 1024, 3072), (8192, 512, 264),
              (130, 144, 1024), (8192, 384, 2832)]


def _sm90(cuda):
    if not cuda_sm90._on_sm90(cuda):
        pytest.skip("the kernel is sm_90's")


@pytest.mark.gpu
@pytest.mark.parametrize("M,K,N", GPU_SHAPES)
def test_gpu_cuda_vs_reference(M, K, N, cuda):
    """The kernel within NUMERICS §5's bound of the float64 reference (the test_gemm bound) on random data, forward
    and data gradient; bit for bit on small integers with power-of-two scales, where every partial sum is exact."""
    _sm90(cuda)
    from test_gemm import _check, _operands

    a, b = _operands(M, N, K, ACT, WEIGHT, "rowwise", "rowwise", cuda, seed=K)
    _check(a, b, "rowwise", "rowwise", "cuda", out_dtype=torch.bfloat16)
    pow2 = Float8Blockwise(pow2=True), Float8Blockwise(block_dim=2, pow2=True)
    a, b = _operands(M, N, K, *pow2, "rowwise", "rowwise", cuda, seed=K + 1, ints=True)
    y = scaled_mm(a, b, out_dtype=torch.bfloat16, backend="cuda")
    assert torch.equal(y, scaled_mm_reference(a, b, out_dtype=torch.bfloat16)[0].to(cuda))
    if N % 16 == 0:  # the data gradient contracts over N
        a, b = _operands(M, K, N, ACT, WEIGHT, "rowwise", "columnwise", cuda, seed=N)
        _check(a, b, "rowwise", "columnwise", "cuda", out_dtype=torch.bfloat16)


@pytest.mark.gpu
def test_gpu_cuda_in_a_cuda_graph_and_from_a_corrupted_cache(cuda, tmp_path, monkeypatch):
    """A first call inside a capture runs on the next backend (cuBLAS); a captured call replays on new operand values
    with the bits of an eager call on them; a cache file that is not a cubin is compiled afresh (and rewritten) rather
    than failing the call."""
    _sm90(cuda)
    bf16 = torch.bfloat16
    with env.override(LOWBIT_CACHE=str(tmp_path)):
        monkeypatch.setattr(cuda_sm90, "_state", {})
        qx, qw = _layer(512, 1024, 768, seed=7, device=cuda)
        first = torch.cuda.CUDAGraph()  # the first call inside a capture: no compile there, cuBLAS runs it
        with torch.cuda.graph(first):
            z = scaled_mm(qx, qw, out_dtype=bf16, backend="cuda")
        first.replay()
        torch.cuda.synchronize()
        assert not cuda_sm90._kernel().loaded(cuda.index or 0)
        assert torch.equal(z, scaled_mm(qx, qw, out_dtype=bf16, backend="cublas"))
        qx, qw, y, _ = replays_on_new_values("cuda", cuda)
        (cached,) = (tmp_path / "kernels").glob("*.cubin")
        good = cached.read_bytes()
        cached.write_bytes(b"not a cubin")
        monkeypatch.setattr(cuda_sm90, "_state", {})
        assert torch.equal(scaled_mm(qx, qw, out_dtype=bf16, backend="cuda"), y)
        assert cached.read_bytes() == good


def test_a_fresh_compile_rewrites_the_cached_file(tmp_path):
    """``fresh=True`` (what the loader asks for when the driver rejects a cached cubin) compiles again and replaces
    the cached file."""
    _nvrtc_or_skip()
    src = 'extern "C" __global__ void lowbit_probe2(float* x) { x[threadIdx.x] *= 2.f; }\n'
    with env.override(LOWBIT_CACHE=str(tmp_path)):
        good, _ = nvrtc.compile_cubin(src, "lowbit_probe2", "sm_90a")
        (cached,) = (tmp_path / "kernels").glob("lowbit_probe2-*.cubin")
        cached.write_bytes(b"not a cubin")
        assert nvrtc.compile_cubin(src, "lowbit_probe2", "sm_90a")[0] == b"not a cubin"
        assert nvrtc.compile_cubin(src, "lowbit_probe2", "sm_90a", fresh=True)[0] == good == cached.read_bytes()


@pytest.mark.gpu
@pytest.mark.parametrize("M,K,N", [(8192, 1024, 3072), (8192, 2816, 1024), (4096, 2048, 5632), (2048, 11264, 2048)])
def test_gpu_cuda_gives_cublas_bits(M, K, N, cuda):
    """On the GPT layer shapes it forms the same block sums and promotes them in the same order as cuBLAS's blockwise
    kernel: the same bits, forward and data gradient, so a call the kernel declines (cuBLAS runs it, eager or as the
    traced operator's fallback) gives the bits the kernel would have."""
    _sm90(cuda)
    qx, qw = _layer(M, K, N, seed=M + K, device=cuda)
    bf16 = torch.bfloat16
    assert torch.equal(scaled_mm(qx, qw, out_dtype=bf16, backend="cuda"),
                       scaled_mm(qx, qw, out_dtype=bf16, backend="cublas"))
    g = torch.Generator().manual_seed(N)
    qdy = quantize(torch.randn(M, N, generator=g).bfloat16().to(cuda), ACT)
    assert torch.equal(scaled_mm(qdy, qw, b_copy="columnwise", out_dtype=bf16, backend="cuda"),
                       scaled_mm(qdy, qw, b_copy="columnwise", out_dtype=bf16, backend="cublas"))
