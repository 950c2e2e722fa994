"""Fused SwiGLU: kernel (interpreter subprocess on CPU, compiled on the GPU) against the FP32 reference, forward
and backward (the backward against autograd through the FP32 reference)."""
import importlib
import math
import os
import subprocess
import sys

import pytest
import torch

from lowbit.ops.swiglu import swiglu, swiglu_reference
from lowbit.runtime.autotune import forget_tuned


def _bound(ref, dtype, k=1):
    eps = torch.finfo(dtype).eps
    return k * eps * ref.float().abs() + k * eps * 1e-2


def _check_kernel(device, shapes, dtypes):
    for shape, dtype in zip(shapes, dtypes):
        g = torch.Generator().manual_seed(sum(shape))
        h = (3 * torch.randn(*shape, generator=g)).to(device, dtype)
        a = h.clone().requires_grad_()
        r = h.float().clone().requires_grad_()
        y = swiglu(a)
        yr = swiglu_reference(r)  # FP32 in -> FP32 out: the exact-math value, rounded once below
        assert y.shape == (*shape[:-1], shape[-1] // 2) and y.dtype == dtype
        assert bool(((y.float() - yr.to(dtype).float()).abs() <= _bound(yr, dtype)).all()), (shape, dtype)
        go = torch.randn(y.shape, generator=g).to(device, dtype)
        y.backward(go)
        yr.backward(go.float())
        diff = (a.grad.float() - r.grad).abs()
        assert bool((diff <= _bound(r.grad, dtype, 2)).all()), (shape, dtype, diff.max())


SHAPES = [(1, 2), (3, 5, 34), (17, 130), (2, 2100)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.bfloat16]


def test_reference_and_bad_input():
    h = torch.tensor([[0.0, 2.0, 3.0, 4.0]])
    torch.testing.assert_close(swiglu_reference(h),
                               torch.tensor([[0.0, 2.0 / (1 + torch.exp(torch.tensor(-2.0))) * 4.0]]))
    with pytest.raises(ValueError, match="even last dim"):
        swiglu(torch.zeros(3, 5))


def _interpreted(call: str, timeout: int):
    """Run ``t.<call>`` (this module as t) in a child process with Triton's interpreter on from the start."""
    code = ("import sys; sys.path.insert(0, %r); import test_swiglu as t; t.%s; print('ok')"
            % (os.path.dirname(__file__), call))
    return subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True,
                          text=True, timeout=timeout)


def test_kernel_interpreter_subprocess():
    pytest.importorskip("triton")
    r = _interpreted("_check_kernel('cpu', t.SHAPES, t.DTYPES)", 600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


@pytest.mark.gpu
def test_kernel_gpu(cuda):
    _check_kernel(cuda, SHAPES + [(8192, 5632)], DTYPES + [torch.bfloat16])


# ---- SwiGLU fused with 1x128 FP8 quantization -----------------------------------------------------------------
def _fused_quant_cases(device, cases, force=None):
    """swiglu_quantize_1x128 equals the reference quantizer applied to the unfused kernel's 16-bit output h, bit for
    bit: data, scales (storage layout), amax. ``force``: launch only this candidate config (no tuning)."""
    from lowbit import quantize
    from lowbit.ops.swiglu import swiglu_quantize_1x128
    from lowbit.quant.schemes import Float8Blockwise

    if force is not None:
        S = importlib.import_module("lowbit.ops.swiglu")
        S._swiglu_quant_candidates = lambda *a: [force]
        forget_tuned()

    for (lead, F, dtype, fmt, rowwise, columnwise) in cases:
        g = torch.Generator().manual_seed(F + sum(lead))
        u = (3 * torch.randn(*lead, 2 * F, generator=g)).to(device, dtype)
        u.view(-1)[5] = 0.0  # an exact zero, and large values in the last row (their blocks' scales shrink)
        u.view(-1, 2 * F)[-1, :7] = 300.0
        sch = Float8Blockwise(fmt=fmt)
        fused = swiglu_quantize_1x128(u, sch, rowwise=rowwise, columnwise=columnwise)
        ref = quantize(swiglu(u), sch, rowwise=rowwise, columnwise=columnwise, backend="reference")
        assert fused.shape == ref.shape and fused.dtype == ref.dtype, (fused.shape, ref.shape)
        for name in ("rowwise", "columnwise"):
            a, b = getattr(fused, name), getattr(ref, name)
            assert (a is None) == (b is None), name
            if a is None:
                continue
            assert torch.equal(a.data.view(torch.uint8).cpu(), b.data.view(torch.uint8).cpu()), (name, lead, F)
            assert torch.equal(a.scale_inv.cpu(), b.scale_inv.cpu()), (name, lead, F)
            assert torch.equal(a.amax.cpu(), b.amax.cpu()), (name, a.amax, b.amax)

FUSED_CASES = [((1,), 128, torch.bfloat16, "e4m3", True, True), ((17,), 256, torch.bfloat16, "e4m3", True, True),
               ((2, 70), 128, torch.float16, "e5m2", True, True), ((129,), 128, torch.bfloat16, "e4m3", False, True),
               ((40,), 128, torch.bfloat16, "e4m3", True, False)]


def test_fused_quant_interpreter_subprocess():
    pytest.importorskip("triton")
    r = _interpreted("_fused_quant_cases('cpu', t.FUSED_CASES)", 900)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


def test_fused_quant_whole_tile_kernel_interpreter_subprocess():
    """The whole-tile persistent kernel (a GPU autotune candidate): one program walks every tile (the CPU's
    'SM count' is 1), ragged last row panel included; 16-bit maxima on and off."""
    pytest.importorskip("triton")
    cfg = dict(KIND="tile", CTAS=1, num_warps=4, BITS16=True)
    cases = [c for c in FUSED_CASES if c[2] == torch.bfloat16] + [((300,), 256, torch.bfloat16, "e4m3", True, True)]
    r = _interpreted(f"_fused_quant_cases('cpu', {cases!r}, force={cfg!r})".replace("torch.", "t.torch."), 900)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr
    cfg16 = dict(KIND="tile", CTAS=1, num_warps=4)
    r = _interpreted(f"_fused_quant_cases('cpu', t.FUSED_CASES[2:3], force={cfg16!r})", 900)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


def test_fused_quant_rejects_what_it_cannot_take(monkeypatch):
    S = importlib.import_module("lowbit.ops.swiglu")  # (lowbit.ops.swiglu as an attribute is the function)
    from lowbit.ops.swiglu import swiglu_fused_quant_supported, swiglu_quantize_1x128
    from lowbit.quant.schemes import Float8Blockwise, Float8Tensorwise

    u = torch.zeros(4, 256, dtype=torch.bfloat16)
    # a CPU u is refused for its device alone: pass that check (as the interpreter does), so that each refusal
    # below has its own reason
    monkeypatch.setattr(S, "INTERPRET", True)
    if S.triton is not None:
        assert swiglu_fused_quant_supported(u, Float8Blockwise())
    assert not swiglu_fused_quant_supported(u, Float8Tensorwise())
    assert not swiglu_fused_quant_supported(torch.zeros(4, 384, dtype=torch.bfloat16), Float8Blockwise())  # F = 192
    assert not swiglu_fused_quant_supported(u.float(), Float8Blockwise())
    assert not swiglu_fused_quant_supported(u, Float8Blockwise(block_dim=2))
    monkeypatch.undo()
    if not u.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(NotImplementedError, match="1x128 Float8Blockwise"):
            swiglu_quantize_1x128(u, Float8Blockwise())


GPU_FUSED_CASES = FUSED_CASES + [((8192,), 5632, torch.bfloat16, "e4m3", True, True),
                                 ((3, 1000), 1408, torch.bfloat16, "e4m3", True, True),
                                 ((130,), 256, torch.bfloat16, "e4m3", True, True)]


# whole 128-row tiles with both copies (the register-tile quantizer's inputs), BF16 and FP16, both formats
REGS_CASES = [((256,), 384, torch.bfloat16, "e4m3", True, True), ((2, 128), 256, torch.float16, "e5m2", True, True),
              ((1024,), 1408, torch.float16, "e4m3", True, True)]


@pytest.mark.gpu
def test_fused_quant_gpu(cuda):
    _fused_quant_cases(cuda, GPU_FUSED_CASES)


@pytest.mark.gpu
def test_fused_quant_every_candidate_gpu(cuda, monkeypatch):
    """Each launch config the autotuner may pick, forced alone, bit-identical to the reference."""
    S = importlib.import_module("lowbit.ops.swiglu")

    for dtype in (torch.bfloat16, torch.float16):
        # (128 rows: the register-tile quantizer's candidates too, which take both copies of whole 128-row tiles)
        u = torch.empty(128, 256, dtype=dtype, device=cuda)
        for cfg in S._swiglu_quant_candidates(u, S._regs_runs(u, True, True)):
            forget_tuned()
            monkeypatch.setattr(S, "_swiglu_quant_candidates", lambda *a, cfg=cfg: [cfg])
            cases = [c for c in GPU_FUSED_CASES + REGS_CASES if c[2] == dtype]
            if cfg.get("KIND") in ("regs", "packed"):
                cases = [c for c in cases if c[4] and c[5] and math.prod(c[0]) % 128 == 0]
                assert cases
            _fused_quant_cases(cuda, cases)
            monkeypatch.undo()


# ---- SwiGLU's backward fused with 1x128 FP8 quantization (fc1's grad_output) -------------------------------------
def _bwd_fused_cases(device, cases):
    """swiglu_backward_quantize_1x128 equals the reference quantizer applied to the backward kernel's 16-bit du, bit
    for bit: data, scales (storage layout), amax."""
    from lowbit import quantize
    from lowbit.ops.swiglu import swiglu_backward, swiglu_backward_quantize_1x128
    from lowbit.quant.schemes import Float8Blockwise

    for (lead, F, dtype, fmt, pow2) in cases:
        gen = torch.Generator().manual_seed(F + sum(lead))
        u = (3 * torch.randn(*lead, 2 * F, generator=gen)).to(device, dtype)
        g = torch.randn(*lead, F, generator=gen).to(device, dtype)
        u2, g2 = u.view(-1, 2 * F), g.view(-1, F)
        u2[0, :5] = 0.0          # a zero in a, and in b, and a whole zero row of du's first tile (g = 0)
        u2[0, F:F + 3] = 0.0
        g2[1] = 0.0
        u2[-1, :7] = 300.0       # large values in the last row (their blocks' scales shrink), in both halves
        g2[-1, -5:] = 4000.0
        u2[2, 2 * F - 1] = -80.0  # silu(a) of a very negative a underflows to -0
        # a = -0: db = g * (sig * a) = -+0 keeps its sign (the branch-free form's fma(a, 1, c) needs c = -0, which a
        # -0.0 literal does not give in Triton: it folds to +0)
        u2[3, :3] = -0.0
        sch = Float8Blockwise(fmt=fmt, pow2=pow2)
        fused = swiglu_backward_quantize_1x128(u, g, sch)
        ref = quantize(swiglu_backward(u, g), sch, rowwise=True, columnwise=True, backend="reference")
        assert fused.shape == ref.shape == u.shape and fused.dtype == ref.dtype
        for name in ("rowwise", "columnwise"):
            a, b = getattr(fused, name), getattr(ref, name)
            assert torch.equal(a.data.view(torch.uint8).cpu(), b.data.view(torch.uint8).cpu()), (name, lead, F, fmt)
            # (bit patterns: a NaN scale or amax would not equal itself)
            assert torch.equal(a.scale_inv.view(torch.int32).cpu(),
                               b.scale_inv.view(torch.int32).cpu()), (name, lead, F, fmt)
            assert torch.equal(a.amax.view(torch.int32).cpu(), b.amax.view(torch.int32).cpu()), (name, a.amax, b.amax)


BWD_CASES = [((128,), 128, torch.bfloat16, "e4m3", True), ((2, 128), 384, torch.bfloat16, "e4m3", False),
             ((384,), 256, torch.float16, "e5m2", True), ((1024,), 1408, torch.bfloat16, "e4m3", True),
             ((8192,), 5632, torch.bfloat16, "e4m3", True)]


def test_backward_fused_quant_rejects_what_it_cannot_take():
    from lowbit.ops.swiglu import swiglu_backward_fused_quant_supported, swiglu_backward_quantize_1x128
    from lowbit.quant.schemes import Float8Blockwise, Float8Tensorwise

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    u = torch.zeros(128, 256, dtype=torch.bfloat16, device=dev)
    g = torch.zeros(128, 128, dtype=torch.bfloat16, device=dev)
    sch = Float8Blockwise()
    for uu, gg, s in ((u, g, Float8Tensorwise()), (u, g, Float8Blockwise(block_dim=2)), (u, g.half(), sch),
                      (u, g[:, :64], sch), (u[:100], g[:100], sch), (u.float(), g.float(), sch),
                      (u[:, :192].contiguous(), g[:, :96].contiguous(), sch), (u.t(), g, sch), (u, "g", sch)):
        assert not swiglu_backward_fused_quant_supported(uu, gg, s)
    if dev == "cpu":  # (the whole-tile kernel is Gluon: CUDA only, never the interpreter)
        assert not swiglu_backward_fused_quant_supported(u, g, sch)
        with pytest.raises(NotImplementedError, match="swiglu_backward_quantize_1x128: needs a 1x128"):
            swiglu_backward_quantize_1x128(u, g, sch)


@pytest.mark.gpu
def test_backward_fused_quant_every_candidate_gpu(cuda, monkeypatch):
    """Each launch candidate the autotuner may pick (the fused kernel under a 128-register cap, the fused kernel with
    compact scales uncapped, and the two separate kernels), forced alone, bit-identical to the reference."""
    S = importlib.import_module("lowbit.ops.swiglu")
    from lowbit.quant import triton_backend as tb

    if tb.capability(torch.device(cuda)) < (8, 9):
        pytest.skip("the register-tile quantizer needs sm_89+")
    from lowbit.quant.schemes import Float8Blockwise

    assert S.swiglu_backward_fused_quant_supported(torch.empty(128, 256, dtype=torch.bfloat16, device=cuda),
                                                   torch.empty(128, 128, dtype=torch.bfloat16, device=cuda),
                                                   Float8Blockwise())
    for cfg in list(S._SWIGLU_BWD_CONFIGS):
        forget_tuned()
        monkeypatch.setattr(S, "_SWIGLU_BWD_CONFIGS", [cfg])
        _bwd_fused_cases(cuda, BWD_CASES)
        monkeypatch.undo()
