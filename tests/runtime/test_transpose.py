"""lowbit.runtime.transpose.transpose_2d: bit-identical to ``x.t().contiguous()`` on odd shapes (tiles cut at both
edges,
one row, one column), every dtype width, every launch candidate on the GPU; bad input. On the CPU under Triton's
interpreter in a child process."""
import importlib

import pytest
import torch
from interp_helper import run_interpreted

T = importlib.import_module("lowbit.runtime.transpose")

# (rows, cols): a tile's edge cut in both dims, a single row / column, more rows than columns and the reverse, and
# the 350m fc2 weight gradient's shape (the XᵀdY order's output, transposed back)
SHAPES = [(1, 1), (1, 77), (93, 1), (17, 33), (130, 67), (64, 128), (257, 129)]
GPU_SHAPES = SHAPES + [(2816, 1024), (1000, 3001)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn, torch.bool, torch.float64,
          torch.int64]


def _rand(shape, dtype, device, gen):
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen, device="cpu").lt(0.5).to(device)
    if dtype in (torch.int8, torch.int64):
        return torch.randint(-100, 100, shape, generator=gen, device="cpu").to(dtype).to(device)
    x = torch.randn(shape, generator=gen, device="cpu") * 3
    return x.to(dtype).to(device)


def _same_bits(a, b):
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    v = T._BITS[a.element_size()]  # (the integer dtype of each element width)
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(v), b.view(v))


def check_transpose(device, shapes=SHAPES, dtypes=DTYPES):
    gen = torch.Generator().manual_seed(29)
    for shape in shapes:
        for dt in dtypes:
            x = _rand(shape, dt, device, gen)
            if dt == torch.float32:
                x.view(-1)[0] = float("nan")  # (bits, not values: a NaN and -0.0 go through unchanged)
                x.view(-1)[-1] = -0.0
            y = T.transpose_2d(x)
            ref = x.t().contiguous()
            assert y.is_contiguous() and y.device == x.device, (shape, dt)
            assert _same_bits(y, ref), (shape, dt)
    print("ok")


def check_bad_input(device):
    with pytest.raises(ValueError, match="x: expected a 2-D tensor, got 3-D"):
        T.transpose_2d(torch.zeros(2, 3, 4, device=device))
    with pytest.raises(ValueError, match="x: expected a contiguous tensor"):
        T.transpose_2d(torch.zeros(4, 6, device=device).t())
    with pytest.raises(NotImplementedError, match="x: dtype torch.complex64"):
        T.transpose_2d(torch.zeros(4, 4, dtype=torch.complex64, device=device))
    with pytest.raises(TypeError, match="x: expected a torch.Tensor"):
        T.transpose_2d([[1.0]])
    assert T.transpose_2d(torch.zeros(0, 5, device=device)).shape == (5, 0)
    print("ok")


def test_configs_pruned():
    for es in (1, 2, 4, 8):
        cfgs = T.transpose_configs(es)
        assert cfgs, es
        for c in cfgs:
            assert 1024 <= c["BLOCK_R"] * c["BLOCK_C"] <= 16384
            if es == 1:
                assert min(c["BLOCK_R"], c["BLOCK_C"]) >= 64


def test_transpose_interpreter_subprocess():
    pytest.importorskip("triton")
    run_interpreted(__file__, "check_transpose('cpu')")
    run_interpreted(__file__, "check_bad_input('cpu')")


def test_transpose_cpu():
    check_transpose("cpu")
    check_bad_input("cpu")


@pytest.mark.gpu
def test_transpose_gpu(cuda):
    check_transpose(cuda, GPU_SHAPES)
    check_bad_input(cuda)


@pytest.mark.gpu
def test_transpose_every_candidate_gpu(cuda, monkeypatch):
    """Each config of transpose_configs forced alone (the tuner sees one candidate), on shapes cut at both edges."""
    gen = torch.Generator().manual_seed(7)
    for es, dt in ((4, torch.float32), (2, torch.bfloat16), (1, torch.uint8)):
        for cfg in T.transpose_configs(es):
            monkeypatch.setattr(T, "transpose_configs", lambda _es, c=cfg: [c])
            for shape in ((257, 129), (1000, 3001)):
                x = _rand(shape, torch.float32, cuda, gen).to(dt) if dt != torch.uint8 else \
                    torch.randint(0, 256, shape, generator=gen).to(torch.uint8).to(cuda)
                y = T.transpose_2d(x)
                assert _same_bits(y, x.t().contiguous()), (cfg, shape, dt)
            monkeypatch.undo()
