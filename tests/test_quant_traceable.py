"""lowbit.quant.traceable (FP8 quantization in the form a compiled graph holds: tensorwise as torch operations,
blockwise as an operator over lowbit's kernels) against the reference, bit for bit: called, compiled, and through
torch.library.opcheck, over random data with the edge cases the scale rules name; on CUDA through Inductor's and
lowbit's Triton kernels."""

import pytest
import torch

from lowbit.quant import quantize_reference
from lowbit.quant.reference import compute_scale
from lowbit.quant.schemes import Float8Blockwise, Float8Rowwise, Float8Tensorwise
from lowbit.quant.traceable import (
    amax_value,
    current_scale,
    quantize_blockwise_into_op,
    quantize_blockwise_op,
    quantize_traceable,
    traceable_fits,
)

SCHEMES = [
    Float8Tensorwise("e4m3"),
    Float8Tensorwise("e5m2"),
    Float8Blockwise("e4m3", block_dim=1),
    Float8Blockwise("e5m2", block_dim=1),
    Float8Blockwise("e4m3", block_dim=2),
    Float8Blockwise("e4m3", block_dim=1, pow2=False),
    Float8Blockwise("e4m3", block_dim=2, pow2=False, eps=1e-3),
    Float8Blockwise("e4m3", block_dim=1, block_size=32),
]


def _data(rows, cols, dtype, seed):
    """Random rows at scales 2**-30 .. 2**30, with a zero block, a tiny block and FP32-max-sized values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-30, 31, (rows, 1), generator=g).float())
    x[:128, :128] = 0
    x[-1, :64] = 1e-30
    if dtype == torch.float32:
        x[1, 200] = 3e38
    return x.to(dtype)


def _same(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                       b.view(torch.uint8) if b.element_size() == 1 else b), what


COPIES = [(True, True), (True, False), (False, True)]


def _check(x, sch, got, rowwise=True, columnwise=True):
    """The copies asked for, their scale grids and the amax of ``got`` against the reference's quantization of x."""
    ref = quantize_reference(x, sch, rowwise=rowwise, columnwise=columnwise)
    for which, data, si in (("rowwise", got.rowwise, got.row_scale_inv),
                            ("columnwise", got.columnwise, got.col_scale_inv)):
        if getattr(ref, which) is None:
            assert data is None and si is None, which
            continue
        _same(data, getattr(ref, which).data, f"{which} data")
        _same(si, ref.logical_scales(which).to(si.device), f"{which} scales")
    assert got.amax.dim() == 1 and got.amax.dtype == torch.float32
    _same(amax_value(got.amax), ref.amax.reshape(1).to(got.amax.device), "amax")


@pytest.mark.parametrize("copies", COPIES, ids=["both", "rowwise", "columnwise"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sch", SCHEMES, ids=repr)
def test_traceable_equals_reference(sch, dtype, copies):
    x = _data(384, 256, dtype, seed=hash((repr(sch), str(dtype))) % 1000)
    _check(x, sch, quantize_traceable(x, sch, rowwise=copies[0], columnwise=copies[1]), *copies)
    _check(x.t(), sch, quantize_traceable(x.t(), sch, rowwise=copies[0], columnwise=copies[1]), *copies)


@pytest.mark.parametrize("sch", [SCHEMES[0], SCHEMES[2], SCHEMES[4]], ids=repr)
def test_traceable_compiled_equals_reference(sch):
    """Compiled by Inductor (fullgraph; blockwise: the operator and views of its scale grids) the same bits."""
    torch.compiler.reset()
    x = _data(256, 384, torch.bfloat16, seed=7)
    fn = torch.compile(lambda t: quantize_traceable(t, sch, rowwise=True, columnwise=True), fullgraph=True)
    _check(x, sch, fn(x))


@pytest.mark.parametrize("sch", [SCHEMES[3], SCHEMES[4], SCHEMES[6]], ids=repr)
def test_quantize_blockwise_op_opcheck(sch):
    """The operators' registrations: the fake implementations' shapes, dtypes and strides, schemas, aliasing and the
    declared mutation of ``amax_into``; 2D and 3D inputs."""
    x = _data(256, 384, torch.float32, seed=5)
    for rowwise, columnwise in COPIES:
        for t in (x, x.reshape(2, 128, 384)):
            args = (t, sch.fmt, sch.block_dim, sch.block_size, sch.pow2, float(sch.eps), rowwise, columnwise)
            torch.library.opcheck(quantize_blockwise_op, args)
            torch.library.opcheck(quantize_blockwise_into_op, (*args, torch.zeros(1, dtype=torch.int32)))


def test_current_scale_edge_values():
    """NaN, Inf, 0, subnormal and FP32-max amaxes."""
    a = torch.tensor([0.0, 1e-45, 1e-38, 1e-30, 0.37, 1.0, 448.0, 449.0, 1e30, 3.4e38, float("inf"), float("nan")])
    a = torch.cat([a, torch.rand(1000) * torch.exp2(torch.randint(-126, 127, (1000,)).float())])
    for fmax in (448.0, 57344.0):
        got, ref = current_scale(a, fmax), compute_scale(a, fmax)
        assert torch.equal(got.isnan(), ref.isnan())
        assert torch.equal(got[~got.isnan()], ref[~ref.isnan()]), fmax


def test_traceable_covers_and_refuses():
    assert traceable_fits(Float8Tensorwise(), 3, 5)
    assert traceable_fits(Float8Blockwise(block_dim=2), 256, 128)
    assert not traceable_fits(Float8Blockwise(block_dim=1), 256, 200)
    assert not traceable_fits(Float8Rowwise(), 256, 256)
    with pytest.raises(NotImplementedError, match="scheme: quantize_traceable covers"):
        quantize_traceable(torch.zeros(256, 200), Float8Blockwise())
    with pytest.raises(ValueError, match="x: expected a tensor of at least 2 dims"):
        quantize_traceable(torch.zeros(256), Float8Blockwise())
    with pytest.raises(NotImplementedError, match=r"for shape \(6, 128\)"):  # (read as 2D: 6 rows)
        quantize_traceable(torch.zeros(2, 3, 128), Float8Blockwise())
    with pytest.raises(ValueError, match="at least one copy"):
        quantize_traceable(torch.zeros(256, 256), Float8Blockwise(), rowwise=False)
    for bad, what in ((torch.zeros(256, 256, dtype=torch.int32), "torch.int32"), ([1.0], "list")):
        for sch in (Float8Tensorwise(), Float8Blockwise()):
            with pytest.raises(TypeError, match=f"x: expected a float32, .* got {what}"):
                quantize_traceable(bad, sch)
    x = torch.zeros(256, 256)
    for bad, err, what in ((torch.zeros(1), ValueError, "int32 tensor of shape \\(1,\\)"),
                           (torch.zeros(2, dtype=torch.int32), ValueError, "got torch.int32 \\(2,\\)"),
                           (torch.zeros(1, dtype=torch.int32, device="meta"), ValueError, "on x's device"),
                           (1.0, TypeError, "expected a tensor or None")):
        with pytest.raises(err, match=f"amax_into: .*{what}"):
            quantize_traceable(x, Float8Blockwise(), amax_into=bad)


@pytest.mark.parametrize("sch", SCHEMES, ids=repr)
def test_nd_input_is_read_as_2d(sch):
    """An N-D tensor's copies are those of its (product of leading dims, last dim) reshape, bit for bit."""
    x = _data(384, 256, torch.bfloat16, seed=13)
    got = quantize_traceable(x.reshape(3, 128, 256), sch, rowwise=True, columnwise=True)
    _check(x, sch, got)


@pytest.mark.parametrize("sch", [SCHEMES[0], SCHEMES[2], SCHEMES[4]], ids=repr)
def test_amax_into_keeps_a_running_max(sch):
    """With ``amax_into`` the copies are the same bits, the returned amax is None and the slot holds the running max
    of the amaxes of every call since it was zeroed (NaN above Inf above finite; a smaller amax later does not lower
    it), called and compiled."""
    fn = torch.compile(lambda t, s: quantize_traceable(t, sch, rowwise=True, columnwise=True, amax_into=s),
                       fullgraph=True)
    for call in (lambda t, s: quantize_traceable(t, sch, rowwise=True, columnwise=True, amax_into=s), fn):
        slot = torch.zeros(1, dtype=torch.int32)
        big, small = _data(256, 384, torch.float32, seed=7), _data(256, 384, torch.float32, seed=8) * 1e-3
        got = call(big, slot)
        assert got.amax is None
        plain = quantize_traceable(big, sch, rowwise=True, columnwise=True)
        for a, b in ((got.rowwise, plain.rowwise), (got.columnwise, plain.columnwise),
                     (got.row_scale_inv, plain.row_scale_inv), (got.col_scale_inv, plain.col_scale_inv)):
            _same(a, b, "copies")
        want = big.abs().amax().reshape(1)
        assert torch.equal(slot.view(torch.float32), want)
        call(small, slot)
        assert torch.equal(slot.view(torch.float32), want)
        inf = small.clone()
        inf[5, 7] = -float("inf")
        call(inf, slot)
        assert slot.view(torch.float32).isinf().item()
        nan = small.clone()
        nan[9, 3] = float("nan")
        call(nan, slot)
        call(inf, slot)
        assert slot.view(torch.float32).isnan().item()


@pytest.mark.gpu
@pytest.mark.parametrize("copies", COPIES, ids=["both", "rowwise", "columnwise"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sch", SCHEMES, ids=repr)
def test_gpu_traceable_kernels_equal_reference(sch, dtype, copies):
    """On CUDA (tensorwise: Inductor's Triton kernels; blockwise: lowbit's, launched by Inductor), called and
    compiled: the reference's bits, for a strided input too."""
    torch.compiler.reset()
    x = _data(1024, 1152, dtype, seed=3).cuda()
    fn = torch.compile(lambda t: quantize_traceable(t, sch, rowwise=copies[0], columnwise=copies[1]),
                       fullgraph=True)
    _check(x, sch, fn(x), *copies)
    _check(x, sch, quantize_traceable(x, sch, rowwise=copies[0], columnwise=copies[1]), *copies)
    xt = x.t()  # strided, as a gradient may reach the operator: the kernels' bits, not the reference's path
    _check(xt, sch, quantize_traceable(xt, sch, rowwise=copies[0], columnwise=copies[1]), *copies)
    _check(xt, sch, fn(xt), *copies)


@pytest.mark.gpu
def test_gpu_blockwise_kernel_launched_by_inductor():
    """Compiled, the blockwise operator's kernel is launched from Inductor's own code (no opaque operator, no lowbit
    Python a call)."""
    from torch._inductor.utils import run_and_get_code

    torch.compiler.reset()
    x = torch.randn(512, 384, device="cuda", dtype=torch.bfloat16)
    fn = torch.compile(lambda t: quantize_traceable(t, SCHEMES[2], rowwise=True, columnwise=True), fullgraph=True)
    got, codes = run_and_get_code(fn, x)
    code = "\n".join(codes)
    assert "blockwise_kernel" in code and "quantize_fp8_blockwise_opaque" not in code, code[:3000]
    _check(x, SCHEMES[2], got)


@pytest.mark.gpu
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_gpu_blockwise_operator_amax_of_each_program_orders_nonfinite(bad):
    """Compiled, the kernel leaves one amax a program (no zero-filled accumulator); their reduced value is the
    tensor's, NaN above Inf above finite, wherever the bad value sits (first, middle and last tile)."""
    torch.compiler.reset()
    fn = torch.compile(lambda t: quantize_traceable(t, SCHEMES[2], rowwise=True, columnwise=True), fullgraph=True)
    for at in ((0, 0), (300, 700), (-1, -1)):
        x = _data(1024, 1152, torch.bfloat16, seed=11).cuda()
        x[at] = bad
        got = fn(x)
        assert got.amax.numel() == (1024 // 128) * (1152 // 128)
        v = amax_value(got.amax)
        assert (v.isnan() if bad != bad else v.isinf() & ~v.isnan()).item(), (at, v)
    x[at] = float("inf")
    x[0, 5] = float("nan")
    assert amax_value(fn(x).amax).isnan().item()


@pytest.mark.gpu
@pytest.mark.parametrize("sch", [SCHEMES[2], SCHEMES[4]], ids=repr)
def test_gpu_blockwise_into_kernel_accumulates_in_place(sch):
    """Compiled, ``amax_into`` is the kernel's own accumulator (Inductor reinplaces the slot: as many launches as
    without it, and no copy of the slot); called and compiled it holds the running max, NaN above Inf above
    finite."""
    import re

    from torch._inductor.utils import run_and_get_code

    torch.compiler.reset()
    x = _data(1024, 1152, torch.bfloat16, seed=17).cuda()
    plain = torch.compile(lambda t: quantize_traceable(t, sch, rowwise=True, columnwise=True), fullgraph=True)
    into = torch.compile(lambda t, s: quantize_traceable(t, sch, rowwise=True, columnwise=True, amax_into=s),
                         fullgraph=True)
    _, plain_codes = run_and_get_code(plain, x)
    slot = torch.zeros(1, dtype=torch.int32, device="cuda")
    got, codes = run_and_get_code(into, x, slot)
    code = "\n".join(codes)
    launches = len(re.findall(r"\.run\(", code))
    assert launches == len(re.findall(r"\.run\(", "\n".join(plain_codes))) and "copy_" not in code, code[:4000]
    _check(x, sch, got._replace(amax=slot.view(torch.float32)))
    for call in (into, lambda t, s: quantize_traceable(t, sch, rowwise=True, columnwise=True, amax_into=s)):
        slot.zero_()
        call(x, slot)
        call(x * 1e-3, slot)
        assert torch.equal(slot.view(torch.float32).cpu(), x.float().abs().amax().reshape(1).cpu())
        bad = x.clone()
        bad[700, 3] = -float("inf")
        call(bad, slot)
        assert slot.view(torch.float32).isinf().item()
        bad[5, 1000] = float("nan")
        call(bad, slot)
        call(x, slot)
        assert slot.view(torch.float32).isnan().item()


@pytest.mark.gpu
def test_gpu_blockwise_operator_dynamic_shapes():
    """Compiled with dynamic dims (as Dynamo turns them on by itself at a second shape): the operator specializes
    each shape and keeps the reference's bits."""
    torch.compiler.reset()
    for sch in (SCHEMES[2], SCHEMES[4]):
        fn = torch.compile(lambda t, s=sch: quantize_traceable(t, s, rowwise=True, columnwise=True), dynamic=True)
        for i, (rows, cols) in enumerate(((256, 384), (384, 1152), (640, 256))):
            x = _data(rows, cols, torch.bfloat16, seed=i).cuda()
            _check(x, sch, fn(x))


@pytest.mark.parametrize("sch", [SCHEMES[2], SCHEMES[4], SCHEMES[7]], ids=repr)
def test_wrapped_launch_names_every_kernel_parameter(sch):
    """Inductor launches the wrapped blockwise kernel with exactly the arguments given (it fills no default): the
    launch names every parameter after the tensors and sizes, and nothing else but launch options."""
    from lowbit.quant import triton_backend as TB

    fn = TB.K.blockwise_kernel
    if not hasattr(fn, "params"):
        pytest.skip("an interpreted kernel lists no parameters")
    for (rowwise, columnwise), each in ((c, e) for c in COPIES for e in (True, False)):
        plan, kern, grid, extra, tail = TB._wrapped_launch(1024, 1152, torch.bfloat16, sch, rowwise, columnwise,
                                                           torch.device("cpu"), each)
        names = [p.name for p in kern.params]
        assert set(tail) - set(names) <= {"num_warps", "num_stages"}
        assert [n for n in names if n in tail] == names[10 + len(extra):]
        assert len(grid) == 2 and all(isinstance(g, int) and g > 0 for g in grid)
        assert tail["AMAX_EACH"] is each  # (False: the programs max-accumulate into one given int32)
