"""Triton quantization kernels against the reference quantizers (the spec): bit-identical data, scales
(in storage layout), amax and NVFP4 global scale.

* GPU (``@pytest.mark.gpu``): every scheme on odd shapes (rows/cols from 1, 17, 129, 1000, 4096 where
  the scheme allows), float32, bfloat16 and float16 inputs (float16 on fewer shapes), rowwise / columnwise /
  both; NaN and Inf inputs; the software-rounding path as well as the hardware-cast path. The reference runs on
  CPU copies.
* CPU: dispatch rules and error messages; kernel indexing and math on tiny shapes in Triton's
  interpreter (a subprocess with TRITON_INTERPRET=1, float32 and float16 inputs, finite: the interpreter's
  float->fp8 conversion is wrong for NaN, and the kernels use exact software rounding there).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from sm90_compile import compile_gluon_sm90, rowcol_regs_signature, sm90_sass

from lowbit.quant import MXFP8, NVFP4, Float8Blockwise, Float8Rowwise, Float8Tensorwise, backend_for, quantize
from lowbit.quant.reference import quantize_reference
from lowbit.runtime.autotune import forget_tuned

HAVE_TRITON = True
try:
    import triton
except ImportError:  # pragma: no cover
    HAVE_TRITON = False


def _same(a, b) -> bool:
    """Exact equality of two tensors (bit patterns for floats; NaN equals NaN)."""
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.cpu(), b.cpu()
    if a.dtype.is_floating_point:
        af, bf = a.float(), b.float()
        both_nan = af.isnan() & bf.isnan()
        return bool(((af == bf) & (af.signbit() == bf.signbit()) | both_nan).all())
    return torch.equal(a, b)


def compare(x, scheme, rowwise, columnwise, **kw):
    """Quantize x (on its device) with the triton backend and x.cpu() with the reference; list mismatches."""
    # a tensor seed (the key held on the device, as quantize draws it on CUDA) is the reference's int key
    kw_cpu = {k: ((int(v) if k == "seed" else v.cpu()) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    ref = quantize_reference(x.cpu(), scheme, rowwise=rowwise, columnwise=columnwise, **kw_cpu)
    from lowbit.quant.triton_backend import quantize_triton

    got = quantize_triton(x, scheme, rowwise=rowwise, columnwise=columnwise, **kw)
    return mismatches(ref, got)


def mismatches(ref, got):
    """Mismatches of two QuantizedTensors: every copy's data, scale_inv, amax and global_scale, bit for bit."""
    bad = []
    for which in ("rowwise", "columnwise"):
        r, g = getattr(ref, which), getattr(got, which)
        if (r is None) != (g is None):
            bad.append(f"{which}: present in one only")
            continue
        if r is None:
            continue
        for f in ("data", "scale_inv", "amax", "global_scale"):
            if not _same(getattr(r, f), getattr(g, f)):
                A, B = getattr(r, f), getattr(g, f)
                n = ("?" if A is None or B is None or A.shape != B.shape
                     else int((A.cpu().float() != B.cpu().float()).sum()))
                bad.append(f"{which}.{f}: {n} mismatches (ref {None if A is None else tuple(A.shape)}, got "
                           f"{None if B is None else tuple(B.shape)})")
        if not g.data.is_contiguous():
            bad.append(f"{which}.data not contiguous")
    return bad


FP8_SCHEMES = [
    Float8Tensorwise(),
    Float8Tensorwise("e5m2"),
    Float8Rowwise(),
    Float8Rowwise("e5m2", pow2=True),
    Float8Blockwise(),
    Float8Blockwise(fmt="e5m2", pow2=False),
    Float8Blockwise(block_dim=2),
    Float8Blockwise(block_dim=2, pow2=False, eps=1e-3),
    Float8Blockwise(block_size=32),
]
COPIES = [(True, False), (False, True), (True, True)]


def _randn(shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.exp(torch.randn(*shape, generator=g) * 2)  # wide dynamic range
    return x.to(dtype).to(device)


# ------------------------------------------------------------------------------------------------
# GPU: bit-identity
# ------------------------------------------------------------------------------------------------
GPU_SHAPES = [(1, 129), (17, 1000), (129, 17), (1000, 4096), (4096, 129), (2, 17, 257),
              # whole 128x128 tiles, where blockwise_persistent_kernel takes the uses in triton_backend._PERSISTENT:
              # a few tiles, and more tiles than the persistent grid has programs (144 > 132 SMs)
              (256, 384), (2048, 1152)]


# float16 (cheap: a few odd shapes and one of whole 128x128 tiles; no persistent-kernel use takes float16)
GPU_SHAPES_F16 = [(1, 129), (17, 1000), (129, 17), (2, 17, 257), (256, 384)]


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", FP8_SCHEMES, ids=repr)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_kernels_bit_identical(scheme, dtype, cuda):
    for i, shape in enumerate(GPU_SHAPES_F16 if dtype == torch.float16 else GPU_SHAPES):
        x = _randn(shape, dtype, cuda, seed=i)
        for rw, cw in COPIES:
            bad = compare(x, scheme, rw, cw)
            assert not bad, f"{scheme} {shape} {dtype} rowwise={rw} columnwise={cw}: {bad}"


@pytest.mark.gpu
def test_delayed_scaling_bit_identical(cuda):
    for i, shape in enumerate(GPU_SHAPES[:4]):
        x = _randn(shape, torch.bfloat16, cuda, seed=10 + i)
        for fmt in ("e4m3", "e5m2"):
            for s in (0.37, 3.0, 1e4):  # 1e4 saturates many elements
                bad = compare(x, Float8Tensorwise(fmt), True, True, scale=torch.tensor([s], device=cuda))
                assert not bad, f"delayed {fmt} scale={s} {shape}: {bad}"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_mxfp8_kernel_bit_identical(fmt, cuda):
    for i, shape in enumerate([(32, 4096), (1024, 96), (4096, 1024), (2, 48, 160)]):
        for dtype in (torch.float32, torch.bfloat16) + ((torch.float16,) if i != 2 else ()):
            x = _randn(shape, dtype, cuda, seed=20 + i)
            for rw, cw in COPIES:
                bad = compare(x, MXFP8(fmt), rw, cw)
                assert not bad, f"MXFP8 {fmt} {shape} {dtype} rowwise={rw} columnwise={cw}: {bad}"
    x = _randn((1, 4096), torch.float32, cuda, seed=3)  # rowwise only: 1 row
    assert not compare(x, MXFP8(fmt), True, False)


NVFP4_SCHEMES = [NVFP4(), NVFP4(two_d=True), NVFP4(stochastic_rounding=True), NVFP4(two_d=True,
                                                                                    stochastic_rounding=True),
                 NVFP4(rht=True), NVFP4(rht=True, stochastic_rounding=True)]


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", NVFP4_SCHEMES, ids=repr)
def test_nvfp4_kernel_bit_identical(scheme, cuda):
    shapes = [(16, 4096), (1008, 96), (1024, 1008), (2, 48, 160)] + ([] if scheme.two_d else [(1, 4096), (17, 1008)])
    for i, shape in enumerate(shapes):
        for dtype in (torch.float32, torch.bfloat16) + ((torch.float16,) if i != 2 else ()):
            x = _randn(shape, dtype, cuda, seed=30 + i)
            M = x.numel() // x.shape[-1]
            for rw, cw in COPIES:
                if (cw or scheme.two_d) and M % 16:
                    continue
                bad = compare(x, scheme, rw, cw, seed=(2**40 + 12345 * i) if scheme.stochastic_rounding else None)
                assert not bad, f"{scheme} {shape} {dtype} rowwise={rw} columnwise={cw}: {bad}"


RHT_SCHEMES = [NVFP4(rht=True), NVFP4(rht=True, stochastic_rounding=True, rht_signs=0x5A5A)]


@pytest.mark.gpu
def test_nvfp4_rht_fused_bit_identical(cuda):
    """The RHT'd columnwise copy transformed in registers (amax_rht_kernel + nvfp4_kernel RHT=True): odd shapes
    (M and K multiples of 16, not of the tiles), bf16 and fp32 input (fp16 on the smaller shapes), columnwise only and
    with the rowwise copy."""
    for i, shape in enumerate([(16, 16), (48, 1008), (2, 48, 160), (1008, 4096)]):
        for dtype in (torch.bfloat16, torch.float32) + ((torch.float16,) if i != 3 else ()):
            x = _randn(shape, dtype, cuda, seed=70 + i)
            for scheme in RHT_SCHEMES:
                for rw in (False, True):
                    bad = compare(x, scheme, rw, True, seed=2**40 + 7 * i)
                    assert not bad, f"{scheme} {shape} {dtype} rowwise={rw}: {bad}"
    # 4096 x 4096: three combinations (the CPU reference takes seconds, with SR tens of seconds)
    for dtype, scheme, rw in [(torch.bfloat16, RHT_SCHEMES[0], True), (torch.float32, RHT_SCHEMES[0], False),
                              (torch.bfloat16, RHT_SCHEMES[1], True)]:
        x = _randn((4096, 4096), dtype, cuda, seed=79)
        bad = compare(x, scheme, rw, True, seed=3)
        assert not bad, f"{scheme} (4096, 4096) {dtype} rowwise={rw}: {bad}"


@pytest.mark.gpu
def test_nvfp4_rht_every_tile_shape_bit_identical(cuda, monkeypatch):
    """Each tile shape of the fused RHT path (the autotuner may pick any), ragged in M and K."""
    import lowbit.quant.triton_backend as tb

    x = _randn((1008, 4080), torch.bfloat16, cuda, seed=81)
    scheme = RHT_SCHEMES[1]
    ref = quantize_reference(x.cpu(), scheme, rowwise=False, columnwise=True, seed=11)
    for bm, bk, w in [(16, 128, 4), (32, 64, 4), (64, 16, 4), (64, 128, 4), (64, 128, 8), (128, 64, 4), (128, 128, 8)]:
        forget_tuned()
        monkeypatch.setattr(tb, "_configs", lambda *a, bm=bm, bk=bk, w=w, **k: [dict(BM=bm, BK=bk, num_warps=w)])
        got = tb.quantize_triton(x, scheme, rowwise=False, columnwise=True, seed=11)
        bad = mismatches(ref, got)
        assert not bad, f"BM={bm} BK={bk} warps={w}: {bad}"


@pytest.mark.gpu
def test_nvfp4_device_seed_bit_identical_and_graph_safe(cuda):
    """seed=None with stochastic rounding on CUDA: the key is drawn on the device (no host round-trip) and the kernel
    reads it there — the same bits as the reference given that key; fresh keys per call, and per CUDA-graph replay."""
    from lowbit.quant.triton_backend import quantize_triton

    x = _randn((256, 512), torch.bfloat16, cuda, seed=90)
    for scheme in (NVFP4(stochastic_rounding=True), NVFP4(two_d=True, stochastic_rounding=True), RHT_SCHEMES[1]):
        torch.manual_seed(5)
        got = quantize_triton(x, scheme, rowwise=True, columnwise=True)
        key = got.meta["seed"]
        assert isinstance(key, torch.Tensor) and key.is_cuda and key.dtype == torch.int64
        ref = quantize_reference(x.cpu(), scheme, rowwise=True, columnwise=True, seed=int(key.item()))
        assert not mismatches(ref, got), (scheme, mismatches(ref, got))
        torch.manual_seed(5)  # reproducible under torch.manual_seed
        assert torch.equal(quantize_triton(x, scheme, rowwise=True, columnwise=True).rowwise.data, got.rowwise.data)
    scheme = RHT_SCHEMES[1]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (tuning) off the capture, as torch.cuda.graph asks
        quantize_triton(x, scheme, rowwise=True, columnwise=True)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        qt = quantize_triton(x, scheme, rowwise=True, columnwise=True)
    outs = []
    for _ in range(2):
        g.replay()
        torch.cuda.synchronize()
        key = int(qt.meta["seed"].item())
        ref = quantize_reference(x.cpu(), scheme, rowwise=True, columnwise=True, seed=key)
        assert not mismatches(ref, qt), mismatches(ref, qt)
        outs.append((key, qt.columnwise.data.clone()))
    assert outs[0][0] != outs[1][0] and not torch.equal(outs[0][1], outs[1][1])  # a fresh key at every replay


@pytest.mark.gpu
def test_nonfinite_inputs_bit_identical(cuda):
    x = _randn((256, 512), torch.float32, cuda, seed=7)
    x[3, 5] = float("nan")
    x[130, 7] = float("inf")
    x[200, 300] = -float("inf")
    x[9, 9] = -0.0
    for scheme in [Float8Tensorwise(), Float8Rowwise(), Float8Blockwise(), Float8Blockwise(block_dim=2), MXFP8(),
                   NVFP4()]:
        bad = compare(x, scheme, True, True)
        assert not bad, f"{scheme} with NaN/Inf: {bad}"
        q = quantize(x, scheme, rowwise=True, columnwise=True)
        assert q.has_nonfinite_amax


@pytest.mark.gpu
def test_nonfinite_stays_visible_bit_identical(cuda):
    """MXFP8: a block holding a NaN or +-Inf stores the E8M0 NaN (0xFF); delayed per-tensor scaling: a copy with a
    NaN or Inf stores scale_inv = NaN (one program's 1 / scale OR'd with every faulty tile's NaN bits) — both copies,
    every dtype, whole 128 x 128 tiles (the register-tile MXFP8 kernel's) and ragged ones, bit for bit; and the
    copies dequantize to NaN there."""
    for shape in [(256, 512), (96, 160)]:  # (96, 160): not whole 128 x 128 tiles -> mxfp8_kernel
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for bad in (float("inf"), -float("inf"), float("nan")):
                x = _randn(shape, dtype, cuda, seed=8)
                x[3, 37] = bad
                x[-1, 0] = -bad
                for scheme, kw in [(MXFP8(), {}), (MXFP8("e5m2"), {}),
                                   (Float8Tensorwise(), {"scale": torch.tensor([3.0], device=cuda)}),
                                   (Float8Tensorwise("e5m2"), {"scale": torch.tensor([0.5], device=cuda)})]:
                    for rw, cw in COPIES:
                        bad_ = compare(x, scheme, rw, cw, **kw)
                        assert not bad_, f"{scheme} {shape} {dtype} {bad} rowwise={rw} columnwise={cw}: {bad_}"
                    q = quantize(x, scheme, rowwise=True, columnwise=True, **kw)
                    d = q.dequantize("rowwise").float()
                    assert torch.isnan(d[3, 37]) and torch.isnan(q.dequantize("columnwise").float()[3, 37])
                    if isinstance(scheme, MXFP8):  # only the faulty blocks
                        assert int(q.rowwise.scale_inv.eq(255).sum()) == 2 and torch.isfinite(d[3, 64:]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", [Float8Blockwise(), Float8Blockwise(block_dim=2), Float8Rowwise(pow2=True),
                                    Float8Blockwise(fmt="e5m2"), Float8Blockwise(block_dim=2, fmt="e5m2")], ids=repr)
def test_pow2_scales_near_the_fp32_max_bit_identical(scheme, cuda):
    """Power-of-two scales of amaxes near the FP32 maximum take the floor 2**(floor(log2 fmax) - 127) (every kernel
    that quantizes with them: the plain, persistent and register-tile blockwise kernels, per-row): the reference's
    bits, and a finite dequantization."""
    fmax = torch.finfo(torch.float32).max
    for shape in [(256, 384), (129, 1000), (2048, 1152)]:
        g = torch.Generator().manual_seed(shape[0])
        x = (torch.rand(shape, generator=g) * 2 - 1) * fmax
        x[0, 0], x[-1, -1], x[5] = fmax, -fmax, 1.75 * 2.0**127
        for dtype in (torch.float32, torch.bfloat16):
            big = torch.finfo(dtype).max  # (BF16's max, (2 - 2**-7) * 2**127, is still above 1.9375 * 2**127)
            xc = x.clamp(-big, big).to(dtype).to(cuda)
            for rw, cw in COPIES:
                bad = compare(xc, scheme, rw, cw)
                assert not bad, f"{scheme} {shape} {dtype} rowwise={rw} columnwise={cw}: {bad}"
            q = quantize(xc, scheme, rowwise=True, columnwise=True)
            assert not q.has_nonfinite_amax
            assert torch.isfinite(q.dequantize("rowwise").float()).all()
            assert torch.isfinite(q.dequantize("columnwise").float()).all()


@pytest.mark.gpu
def test_software_rounding_path_bit_identical(cuda, monkeypatch):
    import lowbit.quant.triton_backend as tb

    monkeypatch.setattr(tb, "SW_ROUND", True)
    for i, shape in enumerate([(129, 1000), (1000, 129)]):
        x = _randn(shape, torch.bfloat16, cuda, seed=40 + i)
        for scheme in [Float8Blockwise(), Float8Blockwise(fmt="e5m2"), MXFP8(), NVFP4()]:
            if isinstance(scheme, (MXFP8, NVFP4)):
                x = x[:96, :96].contiguous()
            bad = compare(x, scheme, True, True)
            assert not bad, f"SW rounding {scheme} {shape}: {bad}"


@pytest.mark.gpu
def test_repeated_calls_fast_launch_path_bit_identical(cuda):
    """The second and later calls of a shape take the cached-plan / direct-launch path (lowbit._launch): fresh data
    each time, an input at a 16-byte-misaligned offset (another specialization), delayed scales — all bit-identical."""
    # (128, 384): 128x128 from BF16 takes blockwise_persistent_kernel where x is 16-byte aligned, blockwise_kernel
    # where it is not
    for M in (129, 128):
        base = _randn((2, M * 384 + 8), torch.bfloat16, cuda, seed=60)
        for scheme, kw in [(Float8Tensorwise(), {}), (Float8Tensorwise(), {"scale": torch.tensor([3.0], device=cuda)}),
                           (Float8Blockwise(), {}), (Float8Blockwise(block_dim=2), {})]:
            for i in range(3):
                x = _randn((M, 384), torch.bfloat16, cuda, seed=61 + i)
                bad = compare(x, scheme, True, True, **kw)
                assert not bad, f"{scheme} call {i}: {bad}"
            for off in (1, 8, 1):  # 2 and 16 bytes past an aligned start: unaligned, aligned, unaligned again
                x = base[0, off:off + M * 384].view(M, 384)
                bad = compare(x, scheme, True, True, **kw)
                assert not bad, f"{scheme} offset {off}: {bad}"


@pytest.mark.gpu
def test_blockwise_persistent_every_candidate_bit_identical(cuda, monkeypatch):
    """Each launch config the autotuner may pick for blockwise_persistent_kernel (not only the default), forced one
    at a time, in each use it has (triton_backend._PERSISTENT): a few tiles, several tiles per program, E4M3 pow2
    and E5M2 non-pow2 scales; and the inputs it must leave to blockwise_kernel (ragged, misaligned) still exact."""
    import lowbit.quant.triton_backend as tb

    for (two_d, rw, cw, dtype), cfgs in tb._PERSISTENT.items():
        schemes = [Float8Blockwise(block_dim=2 if two_d else 1), Float8Blockwise(block_dim=2 if two_d else 1,
                                                                                 fmt="e5m2", pow2=False)]
        for j, cfg in enumerate(cfgs):
            monkeypatch.setitem(tb._PERSISTENT, (two_d, rw, cw, dtype), [cfg])
            tb._BLOCKWISE_PLANS.clear()
            forget_tuned()
            for i, shape in enumerate([(256, 384), (2048, 1152)]):
                x = _randn(shape, dtype, cuda, seed=80 + i)
                assert tb._blockwise_persistent_configs(x, 128, two_d, rw, cw) == [dict(cfg, KIND="pers")]
                for sch in schemes[:2 if j == 0 else 1]:  # (E5M2 / non-pow2: the scale math, the same for every config)
                    bad = compare(x, sch, rw, cw)
                    assert not bad, f"{sch} {shape} {dtype} rowwise={rw} columnwise={cw} {cfg}: {bad}"
        base = _randn((256 * 384 + 8,), dtype, cuda, seed=90)
        assert not tb._blockwise_persistent_configs(base[1:1 + 256 * 384].view(256, 384), 128, two_d, rw, cw)
        assert not tb._blockwise_persistent_configs(_randn((256, 400), dtype, cuda, seed=91), 128, two_d, rw, cw)
    tb._BLOCKWISE_PLANS.clear()
    forget_tuned()


# The register-tile quantizers' every-candidate tests: E4M3 pow2, E5M2 non-pow2 and eps scales; one tile, a few, many
# (4096 x 1152: 288 programs), tall-narrow and wide-short panels.
REGS_SCHEMES = [Float8Blockwise(), Float8Blockwise(fmt="e5m2", pow2=False), Float8Blockwise(pow2=False, eps=1e-3)]
REGS_SHAPES = [(128, 128), (256, 384), (4096, 1152), (2048, 256), (128, 2048)]


def _skip_without_regs(tb, cuda):
    """Skip where the register-tile quantizers cannot run (GPU below sm_89, no Gluon)."""
    if not tb.regs_ok(torch.zeros(128, 128, dtype=torch.bfloat16, device=cuda), 128, False, True, True):
        pytest.skip("register-tile quantizer not available on this GPU / Triton")


def _special_values(x):
    """NaN, +-Inf and -0 in the first tiles, and a tile of zeros (scale 1), written into x (>= 256 x 384)."""
    x[0, 5], x[3, 200], x[130, 7], x[131, 8] = float("nan"), float("inf"), float("-inf"), -0.0
    x[128:256, 256:384] = 0


def _regs_cases(tb, x, i):
    """Each register-tile scheme on x (i: the shape's index in REGS_SHAPES; the large shapes run the first scheme
    only), both copies against the reference with a fresh plan cache: yields (scheme, mismatches, the plan taken)."""
    for sch in REGS_SCHEMES if i < 2 else REGS_SCHEMES[:1]:
        tb._BLOCKWISE_PLANS.clear()
        bad = compare(x, sch, True, True)
        plans = list(tb._BLOCKWISE_PLANS.values())
        yield sch, bad, (plans[-1] if plans else None)


@pytest.mark.gpu
def test_blockwise_regs_every_candidate_bit_identical(cuda, monkeypatch, switches):
    """The register-tile 1x128 row+col quantizer (quant_gluon.rowcol_1x128_regs), each launch candidate forced alone:
    one tile, a few, many (4096 x 1152: 288 programs), tall-narrow and wide-short panels; BF16, FP16 and FP32; E4M3
    pow2, E5M2 non-pow2 and eps scales; NaN / Inf / -0 and a zero tile. The inputs it must leave to the other kernels
    (ragged, one copy, 2D, other block sizes) are not routed to it."""
    import lowbit.quant.triton_backend as tb

    _skip_without_regs(tb, cuda)
    switches(LOWBIT_AUTOTUNE=False)
    monkeypatch.setattr(tb, "_PACKED_CONFIGS", [])  # (BF16's first candidates: their own test below)
    for cfg in tb.REGS_CONFIGS:
        monkeypatch.setattr(tb, "REGS_CONFIGS", [cfg])
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for i, shape in enumerate(REGS_SHAPES):
                x = _randn(shape, dtype, cuda, seed=160 + i)
                if i == 1:
                    _special_values(x)
                for sch, bad, plan in _regs_cases(tb, x, i):
                    assert plan and plan.fn is tb.QG.rowcol_1x128_regs \
                        and all(plan.cfg.get(k) == v for k, v in cfg.items() if k not in ("KIND", "LC")), \
                        f"{cfg} {shape}: not the register-tile kernel"
                    assert not bad, f"{sch} {shape} {dtype} {cfg}: {bad}"
                    # the plan is cached under its own key (shape first), so the next call finds it, not rebuilds it
                    assert [k[:3] for k in tb._BLOCKWISE_PLANS] == [(*shape, dtype)]
    y = _randn((256, 400), torch.bfloat16, cuda, seed=171)
    assert not tb.regs_ok(y, 128, False, True, True)  # ragged
    z = y[:, :384].contiguous()
    assert not tb.regs_ok(z, 128, True, True, True) and not tb.regs_ok(z, 128, False, True, False)
    assert not tb.regs_ok(z, 64, False, True, True)
    tb._BLOCKWISE_PLANS.clear()


@pytest.mark.gpu
def test_blockwise_regs_packed_every_candidate_bit_identical(cuda, monkeypatch, switches):
    """The BF16-pair form of the register-tile quantizer (quant_gluon.rowcol_1x128_regs_packed), each candidate forced
    alone, bit for bit against the reference: the shapes of the test above, E4M3 pow2, E5M2 non-pow2 and eps scales;
    NaN (three patterns), +-Inf, -0, subnormals, the largest finite BF16 and a zero tile, in even and odd columns
    (the low and high halves of a pair). FP16 and FP32 input never take it."""
    import lowbit.quant.triton_backend as tb

    _skip_without_regs(tb, cuda)
    switches(LOWBIT_AUTOTUNE=False)
    for cfg in tb._PACKED_CONFIGS:
        monkeypatch.setattr(tb, "_PACKED_CONFIGS", [cfg])
        for i, shape in enumerate(REGS_SHAPES):
            x = _randn(shape, torch.bfloat16, cuda, seed=180 + i)
            if i == 1:
                bits = x.view(torch.int16)
                _special_values(x)
                bits[7, 6] = 0x7FC1  # another NaN payload, an even column
                bits[9, 11] = -1  # 0xFFFF: a negative NaN, an odd column
                x[200, 129], x[201, 130] = 3.3895e38, -3.3895e38  # the largest finite BF16 (0x7F7F), both halves
                bits[250, 100], bits[251, 101] = 0x0001, -32767  # subnormals +-2^-133 (0x8001), outside the zero tile
            for sch, bad, plan in _regs_cases(tb, x, i):
                assert plan and plan.fn is tb.QG.rowcol_1x128_regs_packed \
                    and plan.cfg.get("maxnreg") == cfg.get("maxnreg"), f"{cfg} {shape}: not the packed kernel"
                assert not bad, f"{sch} {shape} {cfg}: {bad}"
    for dtype in (torch.float16, torch.float32):
        tb._BLOCKWISE_PLANS.clear()
        assert not compare(_randn((256, 384), dtype, cuda, seed=190), Float8Blockwise(), True, True)
        assert list(tb._BLOCKWISE_PLANS.values())[-1].fn is tb.QG.rowcol_1x128_regs
    # BF16 that is not 16-byte aligned (its int32 pair loads would fault) takes rowcol_1x128_regs, also after the
    # same shape ran aligned (the plan is keyed on it)
    base = _randn((256 * 384 + 8,), torch.bfloat16, cuda, seed=191)
    for off in (0, 1, 4, 8):
        forget_tuned()
        x = base[off:off + 256 * 384].view(256, 384)
        assert not compare(x, Float8Blockwise(), True, True), f"offset {off}"
        plan = [p for k, p in tb._BLOCKWISE_PLANS.items() if k[-1] == (off % 8 == 0)][-1]
        assert plan.fn is (tb.QG.rowcol_1x128_regs_packed if off % 8 == 0 else tb.QG.rowcol_1x128_regs), off
    tb._BLOCKWISE_PLANS.clear()


def test_blockwise_regs_packed_compiles_for_sm90():
    """The BF16-pair quantizer compiles for sm_90 on any machine: its block maxima are 16-bit pair maxima
    (VIMNMX.U16x2), and capped at its first candidate's 80 registers it fits three CTAs of 8 warps an SM."""
    import lowbit.quant.triton_backend as tb
    from lowbit.quant.kernels import quant_gluon as QG

    if not QG.GLUON:
        pytest.skip("this Triton has no Gluon")
    sig, consts = rowcol_regs_signature("bf16", 8)
    keep = ("x_ptr", "rq_ptr", "rs_ptr", "cq_ptr", "cs_ptr", "amax_ptr", "M", "K", "rs_ld", "cs_ld", "FMAX", "POW2",
            "EPS", "A", "B", "T")
    sig = dict({n: sig[n] for n in keep}, AW="constexpr", abs_mask="i32", SWIGLU="constexpr")
    consts = dict({n: consts[n] for n in keep if n in consts}, AW=QG.rowcol_regs_word_layout(8, 8), SWIGLU=False)
    c0 = tb._PACKED_CONFIGS[0]
    k = compile_gluon_sm90(QG.rowcol_1x128_regs_packed, sig, consts, divisible=("M", "K", "rs_ld", "cs_ld"),
                           num_warps=c0["num_warps"], maxnreg=c0["maxnreg"])
    assert "max.u16x2" in k.asm["ptx"] and "cvt.rn.satfinite.e4m3x2.f32" in k.asm["ptx"]
    got = sm90_sass(k)
    if got is not None:
        sass, regs = got
        assert "VIMNMX" in sass and "U16x2" in sass
        assert regs <= 80 and 3 * 8 * 32 * regs <= 65536
    # with the SwiGLU prologue, uncapped (ops.swiglu._SWIGLU_PACKED_CONFIGS' first): two CTAs an SM, no spills
    from lowbit.ops.swiglu import _SWIGLU_PACKED_CONFIGS

    c0 = _SWIGLU_PACKED_CONFIGS[0]
    k = compile_gluon_sm90(QG.rowcol_1x128_regs_packed, sig, dict(consts, SWIGLU=True),
                           divisible=("M", "K", "rs_ld", "cs_ld"), num_warps=c0["num_warps"],
                           **({"maxnreg": c0["maxnreg"]} if "maxnreg" in c0 else {}))
    assert "ex2.approx.ftz.f32" in k.asm["ptx"]
    got = sm90_sass(k, "3.6")
    if got is not None:
        assert "STL" not in got[0] and "LDL" not in got[0] and got[1] <= 128, got[1]


@pytest.mark.gpu
def test_amax_arena_in_a_cuda_graph(cuda):
    """Blockwise quantize launches captured in a CUDA graph under amax_arena take their amax accumulators from the
    arena (one fill a replay, captured first) and fill no scale grid without padding. Replayed on fresh inputs, every
    output equals the reference bit for bit — amax included, on a second replay whose maxima are far below the
    first's (an accumulator not re-zeroed would keep the first replay's). Padded grids and a full arena fall back to
    their own zero-filled buffers; outside a capture the arena is not touched."""
    from lowbit.runtime import amax_arena as AA

    cases = [((512, 384), torch.bfloat16, Float8Blockwise()),  # 1x128, whole tiles (the register-tile kernel)
             ((512, 512), torch.float32, Float8Blockwise(block_dim=2)),  # the weights of Float8BlockScaling
             ((130, 256), torch.bfloat16, Float8Blockwise()),  # 130 rows: the rowwise grid is padded (pad4 = 132)
             ((256, 2816), torch.float32, Float8Blockwise(block_dim=2)),  # 22 column blocks, padded to 24
             # ragged, no padding (100, 260 % 4 == 0)
             ((100, 260), torch.bfloat16, Float8Blockwise(fmt="e5m2", pow2=False))]
    xs = [torch.zeros(shape, dtype=dt, device=cuda) for shape, dt, _ in cases]
    for x, (shape, dt, sch) in zip(xs, cases):  # warm-up outside the capture: tuning, plans
        quantize(x.copy_(_randn(shape, dt, cuda, seed=7)), sch, rowwise=True, columnwise=True)
    arena = AA.AmaxArena(3, cuda)
    with AA.amax_arena(arena):  # not capturing: no slots taken
        quantize(xs[0], cases[0][2], rowwise=True, columnwise=True)
    assert arena.used == 0
    side = torch.cuda.Stream(cuda)

    def capture_and_replay(slots, seed):
        """Capture every case's quantize under an arena of `slots`, then replay twice (maxima 1000x lower the
        second time) and check every output against the reference."""
        arena = AA.AmaxArena(slots, cuda)
        side.wait_stream(torch.cuda.current_stream(cuda))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side), torch.cuda.graph(g):
            arena.reset()
            with AA.amax_arena(arena):
                outs = [quantize(x, sch, rowwise=True, columnwise=True) for x, (_, _, sch) in zip(xs, cases)]
        torch.cuda.current_stream(cuda).wait_stream(side)
        for rep, scale in ((0, 1.0), (1, 1e-3)):
            for i, (x, (shape, dt, _)) in enumerate(zip(xs, cases)):
                x.copy_(_randn(shape, dt, cuda, seed=seed + 10 * rep + i) * scale)
            g.replay()
            torch.cuda.synchronize(cuda)
            for x, q, (shape, dt, sch) in zip(xs, outs, cases):
                bad = mismatches(quantize_reference(x.cpu(), sch, rowwise=True, columnwise=True), q)
                assert not bad, f"{slots} slots, replay {rep}, {shape} {dt} {sch}: {bad}"
        return arena, outs

    arena, outs = capture_and_replay(1, 100)  # one slot for three unpadded calls: the other two fall back
    assert arena.used == 1 and arena.missed == 2
    assert outs[0].rowwise.amax.data_ptr() == arena.buf.data_ptr()
    arena, _ = capture_and_replay(8, 200)
    assert arena.used == 3 and arena.missed == 0  # the three unpadded cases; the two padded ones fill their own


def test_amax_arena_bookkeeping():
    """AmaxArena hands out consecutive zeroed (1,) int32 slots on its own device only, counts the calls that found it
    full, and rejects a non-positive size; amax_arena restores the previous arena on exit."""
    from lowbit.runtime import amax_arena as AA

    a = AA.AmaxArena(2, "cpu")
    s0, s1 = a.take(torch.device("cpu")), a.take(torch.device("cpu"))
    assert s0.dtype == torch.int32 and s0.shape == (1,) and s1.data_ptr() == s0.data_ptr() + 4 and int(s1) == 0
    assert a.take(torch.device("cpu")) is None and a.missed == 1
    assert AA.AmaxArena(1, "cpu").take(torch.device("meta")) is None
    with pytest.raises(ValueError, match="positive int"):
        AA.AmaxArena(0, "cpu")
    b = AA.AmaxArena(1, "cpu")
    with AA.amax_arena(a) as got_a:
        with AA.amax_arena(b) as got_b:
            assert got_b is b
        assert got_a is a
        assert AA.arena_slot(torch.device("cpu")) is None  # CPU tensors: never a slot


@pytest.mark.gpu
def test_mxfp8_regs_every_candidate_bit_identical(cuda, monkeypatch, switches):
    """The MXFP8 register-tile quantizer (quant_gluon.mxfp8_rowcol_regs), each candidate forced alone, against the
    reference: BF16 / FP16 / FP32, E4M3 and E5M2, one tile to many, NaN / Inf / -0, a zero block, subnormal and
    huge blocks (codes clamped); the shapes it must leave to mxfp8_kernel (ragged, one copy) still exact."""
    import lowbit.quant.triton_backend as tb

    _skip_without_regs(tb, cuda)
    switches(LOWBIT_AUTOTUNE=False)
    launched = []
    orig = tb.QG.mxfp8_rowcol_regs

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return orig[grid]

    monkeypatch.setattr(tb.QG, "mxfp8_rowcol_regs", Spy())
    for cfg in tb._MX_REGS_CONFIGS:
        monkeypatch.setattr(tb, "_MX_REGS_CONFIGS", [cfg])
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for i, shape in enumerate([(128, 128), (256, 384), (1024, 1152), (128, 1024)]):
                x = _randn(shape, dtype, cuda, seed=180 + i)
                if i == 1:
                    x[0, 5], x[3, 200], x[130, 7], x[131, 8] = float("nan"), float("inf"), float("-inf"), -0.0
                    x[32:64, 256:288] = 0  # a zero block both ways
                    x[64:96, 0:32] *= 1e-30 if dtype == torch.float32 else 1e-3
                    x[96:128, 32:64] *= 1e30 if dtype == torch.float32 else 1e3
                for sch in (MXFP8(), MXFP8(fmt="e5m2")) if i < 2 else (MXFP8(),):
                    n = len(launched)
                    forget_tuned()
                    bad = compare(x, sch, True, True)
                    assert len(launched) == n + 1, f"{cfg} {shape}: not the register-tile kernel"
                    assert not bad, f"{sch} {shape} {dtype} {cfg}: {bad}"
    n = len(launched)
    for shape, rw, cw in [((160, 256), True, True), ((256, 384), True, False), ((256, 384), False, True)]:
        forget_tuned()
        bad = compare(_randn(shape, torch.bfloat16, cuda, seed=190), MXFP8(), rw, cw)
        assert not bad, (shape, rw, cw, bad)
    assert len(launched) == n
    forget_tuned()


def test_blockwise_regs_compiles_for_sm90():
    """The register-tile quantizer compiles for Hopper (sm_90) with the installed Triton, on any machine: both
    copies from 16-byte loads, 8-byte stores of each copy (the transposed one too: nothing goes through shared
    memory but the maxima), hardware FP8 casts; under Triton 3.6 (the GPU machine's), at most 128 registers at 8
    warps (two CTAs an SM) and no spills."""
    from lowbit.quant.kernels import quant_gluon as QG

    if not QG.GLUON:
        pytest.skip("this Triton has no Gluon")
    for xt in ("bf16", "fp32"):
        sig, const = rowcol_regs_signature(xt)
        k = compile_gluon_sm90(QG.rowcol_1x128_regs, sig, const, divisible=("M", "K", "rs_ld", "cs_ld"), num_warps=8)
        ptx = k.asm["ptx"]
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
        assert ptx.count("st.global.v2.b32") == 16  # 8 rows of rq, 8 rows of cq a thread, 8 bytes each
        assert ptx.count("ld.global.v4.b32") == (8 if xt == "bf16" else 16)
        got = sm90_sass(k, "3.6")
        if got is not None:
            assert "STL" not in got[0] and "LDL" not in got[0]
            assert got[1] <= 128, f"{xt}: {got[1]} registers"
    # with SwiGLU's backward as its prologue (ops.swiglu.swiglu_backward_quantize_1x128, its first candidate): a, g
    # and b read with 16-byte loads in two halves, the same stores; within 128 registers without spills (Triton 3.6)
    sig.update(x_ptr="*bf16", g_ptr="*bf16")
    const.update(SWIGLU_BWD=True, COMPACT=False, H=QG.rowcol_regs_half_layout(8))
    del const["g_ptr"]
    k = compile_gluon_sm90(QG.rowcol_1x128_regs, sig, const, divisible=("M", "K", "rs_ld", "cs_ld"), num_warps=8,
                           maxnreg=128)
    ptx = k.asm["ptx"]
    # the sigmoid as two MUFU operations (quant.sigmoid), without the non-ftz range fix-ups of tl.exp / division
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "ex2.approx.ftz.f32" in ptx and "rcp.approx.ftz.f32" in ptx
    assert "div.full.f32" not in ptx and "div.rn.f32" not in ptx and "ex2.approx.f32" not in ptx
    assert ptx.count("st.global.v2.b32") == 16 and ptx.count("ld.global.v4.b32") == 24
    got = sm90_sass(k, "3.6")
    if got is not None:
        assert "STL" not in got[0] and "LDL" not in got[0]
        assert got[1] <= 128
        # the fix-ups' thresholds (exp2 input below -126, reciprocal of a number above 2^126) are gone: 2,407 SASS
        # instructions a thread, 2,919 with them (Triton 3.6); 2,280 since the branch-free da / db expression
        assert "-126" not in got[0] and "8.50705917302346158658e+37" not in got[0]
    # with the SwiGLU forward as its prologue, the fused quantizer's first candidate (ops.swiglu._SWIGLU_REGS_CONFIGS):
    # within 128 registers without spills, so two CTAs run on an SM (the plain quantizer's first candidate compiles to
    # 130 there: one CTA an SM, 1.4x slower)
    from lowbit.ops.swiglu import _SWIGLU_REGS_CONFIGS

    c0 = _SWIGLU_REGS_CONFIGS[0]
    sig, const = rowcol_regs_signature(lanes_c=c0["LC"], SWIGLU=True, COMPACT=c0["COMPACT"])
    k = compile_gluon_sm90(QG.rowcol_1x128_regs, sig, const, divisible=("M", "K", "rs_ld", "cs_ld"),
                           num_warps=c0["num_warps"], **({"maxnreg": c0["maxnreg"]} if "maxnreg" in c0 else {}))
    assert "ex2.approx.ftz.f32" in k.asm["ptx"] and "cvt.rn.satfinite.e4m3x2.f32" in k.asm["ptx"]
    got = sm90_sass(k, "3.6")
    if got is not None:
        assert "STL" not in got[0] and "LDL" not in got[0] and got[1] <= 128, got[1]
    # the MXFP8 one at its two candidates (triton_backend._MX_REGS_CONFIGS): capped at 128 registers, and uncapped
    # without spills (Triton 3.6: 148 registers; at the cap ptxas spills a few values)
    sig = dict(x_ptr="*bf16", rq_ptr="*fp8e4nv", rs_ptr="*u8", cq_ptr="*fp8e4nv", cs_ptr="*u8", amax_ptr="*i32",
               M="i32", K="i32", EMAX="constexpr", A="constexpr", B="constexpr", T="constexpr", abs_mask="i32")
    layouts = dict(zip("ABT", QG.rowcol_regs_layouts(8)))
    for cap in (128, None):
        k = compile_gluon_sm90(QG.mxfp8_rowcol_regs, sig, dict(EMAX=8, **layouts), divisible=("M", "K"), num_warps=8,
                               maxnreg=cap)
        ptx = k.asm["ptx"]
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and ptx.count("st.global.v2.b32") == 16
        got = sm90_sass(k, "3.6")
        if got is not None:
            assert got[1] <= 128 if cap else ("STL" not in got[0] and "LDL" not in got[0]), (cap, got[1])


@pytest.mark.gpu
def test_blockwise_kernel_every_candidate_bit_identical(cuda, monkeypatch):
    """Each blockwise_kernel launch config the autotuner may pick (triton_backend.blockwise_configs), forced one at
    a time (the persistent kernel kept out), for BF16 and FP32 input, 1D and 2D, every copy combination: ragged and
    whole tiles."""
    import lowbit.quant.triton_backend as tb

    monkeypatch.setattr(tb, "_persistent_ok", lambda *a, **k: False)
    monkeypatch.setattr(tb, "regs_ok", lambda *a, **k: False)
    orig = tb.blockwise_configs
    for dtype in (torch.bfloat16, torch.float32):
        for i, shape in enumerate([(256, 384), (129, 257)]):  # whole tiles (EVEN), ragged
            x = _randn(shape, dtype, cuda, seed=120 + i)
            for sch in (Float8Blockwise(), Float8Blockwise(block_dim=2)):
                for rw, cw in COPIES:
                    for cfg in orig(*shape, 128, sch.block_dim == 2, rw, cw, dtype):
                        monkeypatch.setattr(tb, "blockwise_configs", lambda *a, cfg=cfg, **k: [cfg])
                        tb._BLOCKWISE_PLANS.clear()
                        forget_tuned()
                        bad = compare(x, sch, rw, cw)
                        assert not bad, f"{sch} {shape} {dtype} rowwise={rw} columnwise={cw} {cfg}: {bad}"
    tb._BLOCKWISE_PLANS.clear()
    forget_tuned()


@pytest.mark.gpu
def test_dispatch_on_gpu_picks_triton_and_reports(cuda):
    x = torch.randn(256, 256, device=cuda)
    assert backend_for(x, Float8Blockwise(), True, True) == "triton"
    assert backend_for(x, NVFP4(rht=True), True, True) == "triton"  # RHT columnwise: in the kernel
    assert backend_for(x.t(), Float8Blockwise(), True, False) == "reference"  # non-contiguous
    from lowbit.quant.triton_backend import quantize_triton

    with pytest.raises(ValueError, match="contiguous"):
        quantize_triton(x.t(), Float8Blockwise())
    with pytest.raises(ValueError, match="scale"):
        quantize(x, Float8Tensorwise(), scale=torch.tensor([1.0]), backend="triton")  # CPU scale for a GPU x


# ------------------------------------------------------------------------------------------------
# CPU: dispatch and the interpreter
# ------------------------------------------------------------------------------------------------
def test_cpu_tensors_use_the_reference():
    x = torch.randn(32, 64)
    for scheme in FP8_SCHEMES + [MXFP8(), NVFP4()]:
        assert backend_for(x, scheme, True, True) == "reference"
    if HAVE_TRITON:
        with pytest.raises(NotImplementedError, match="does not support"):
            quantize(x, Float8Blockwise(), backend="triton")


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
def test_triton_backend_rejects_bad_input_clearly():
    from lowbit.quant.triton_backend import quantize_triton

    with pytest.raises(ValueError, match="x: the triton backend runs on CUDA"):
        quantize_triton(torch.randn(4, 32), Float8Blockwise())
    with pytest.raises(TypeError, match="x: "):
        quantize_triton(torch.randn(4, 32).to(torch.float8_e4m3fn), Float8Blockwise())
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_triton(torch.randn(4, 48), MXFP8())


# ------------------------------------------------------------------------------------------------
# The scale rule (compute_scale / recip) alone: the division-free power-of-two path against the reference
# ------------------------------------------------------------------------------------------------
if HAVE_TRITON:
    import triton.language as tl

    from lowbit.quant.kernels.quant import compute_scale, recip

    @triton.jit
    def _scale_rule_kernel(a_ptr, s_ptr, si_ptr, N, FMAX: tl.constexpr, POW2: tl.constexpr, EPS: tl.constexpr,
                           BLOCK: tl.constexpr):
        """The quantizers' own scale helpers applied to a vector of amax values."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        a = tl.load(a_ptr + offs, mask=offs < N, other=0.0)
        s = compute_scale(a, FMAX, POW2, EPS)
        tl.store(s_ptr + offs, s, mask=offs < N)
        tl.store(si_ptr + offs, recip(s, POW2, FMAX), mask=offs < N)


def _scale_rule_amaxes(n_random: int) -> torch.Tensor:
    """amax values where a wrong exponent rule would show: 0, NaN, Inf, subnormals, the smallest normal, FP32 max,
    and for each FMAX mantissa (1.75: E4M3 448 / E5M2 57344; 1.0; 1.5: 6; 1.984375: 127) the mantissa itself and its
    neighbours at every exponent, plus random bit patterns over all finite positive floats."""
    special = [0.0, float("nan"), float("inf"), 1e-45, 2.0**-149, 2.0**-127, 2.0**-126 * (1 - 2.0**-23), 2.0**-126,
               3.4028234663852886e38, 1.0, 2.0 - 2.0**-23]
    vals = torch.tensor(special, dtype=torch.float32)
    ex = torch.arange(-126, 128, dtype=torch.float32)
    mants = []
    for m in (1.75, 1.0, 1.5, 1.984375):
        mb = torch.tensor([m], dtype=torch.float32).view(torch.int32)
        mants.append((mb + torch.tensor([-1, 0, 1], dtype=torch.int32)).view(torch.float32))
    mants = torch.cat(mants).clamp(min=1.0, max=2.0 - 2.0**-23)
    grid = (mants[None, :] * torch.exp2(ex)[:, None]).reshape(-1)
    g = torch.Generator().manual_seed(11)
    bits = torch.randint(1, 0x7F800000, (n_random,), generator=g, dtype=torch.int32)
    return torch.cat([vals, grid[torch.isfinite(grid)], bits.view(torch.float32)])


def _scale_rule_mismatches(device) -> list:
    from lowbit.quant.reference import compute_scale

    a = _scale_rule_amaxes(4096)
    bad = []
    for fmax in (448.0, 57344.0, 6.0, 127.0):  # E4M3, E5M2, E2M1, INT8: every format's FMAX is >= 4
        for pow2 in (True, False):
            for eps in (0.0, 1e-12):
                s = torch.empty_like(a, device=device)
                si = torch.empty_like(s)
                _scale_rule_kernel[(triton.cdiv(a.numel(), 1024),)](a.to(device), s, si, a.numel(), FMAX=fmax,
                                                                    POW2=pow2,
                                                                  EPS=eps, BLOCK=1024)
                rs = compute_scale(a, fmax, pow2=pow2, eps=eps)
                for name, got, ref in (("scale", s, rs), ("scale_inv", si, 1.0 / rs)):
                    ok = (got.cpu().view(torch.int32) == ref.view(torch.int32)) | (got.cpu().isnan() & ref.isnan())
                    if not bool(ok.all()):
                        i = int((~ok).nonzero()[0])
                        bad.append(f"fmax={fmax} pow2={pow2} eps={eps} {name}: {int((~ok).sum())} differ, e.g. amax "
                                   f"{a[i].item()!r}: got {got[i].item()!r}, reference {ref[i].item()!r}")
    return bad


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
def test_scale_rule_in_interpreter_matches_reference():
    """compute_scale and recip (the power-of-two path takes no division: exponent arithmetic on the bits) give the
    reference's scale and 1/scale bit for bit on every exponent and at the rounding boundary of each FMAX."""
    _run_interp("--interp-scales")


@pytest.mark.gpu
def test_scale_rule_compiled_matches_reference(cuda):
    assert not _scale_rule_mismatches(cuda)


def _interp_cases():
    # (shape, scheme, rowwise, columnwise, kwargs): tiny shapes that still cover ragged tiles and every branch
    cases = []
    for sch in [Float8Tensorwise(), Float8Rowwise(pow2=True), Float8Blockwise(block_size=32),
                Float8Blockwise(block_size=16, fmt="e5m2", pow2=False), Float8Blockwise(block_dim=2, block_size=16)]:
        for rw, cw in COPIES:
            cases.append(((19, 40), sch, rw, cw, {}))
    cases.append(((19, 40), Float8Tensorwise("e5m2"), True, True, {"scale": torch.tensor([3.5])}))
    for rw, cw in COPIES:
        cases.append(((64, 96), MXFP8(), rw, cw, {}))
        cases.append(((32, 48), NVFP4(), rw, cw, {}))
        cases.append(((32, 48), NVFP4(two_d=True, stochastic_rounding=True), rw, cw, {"seed": 2**40 + 3}))
        cases.append(((48, 32), NVFP4(stochastic_rounding=True), rw, cw, {"seed": 5}))
        cases.append(((48, 32), NVFP4(rht=True, stochastic_rounding=True), rw, cw, {"seed": 9}))
        # the key read by the kernel from memory (SEED_PTR), as for seeds drawn on the device
        cases.append(((48, 32), NVFP4(rht=True, stochastic_rounding=True), rw, cw, {"seed": torch.tensor([2**40 + 9])}))
    # float16 input (every scheme takes it; the kernels load it as they load bfloat16): both copies at once
    f16 = {"_dtype": torch.float16}
    for sch, shape, kw in [(Float8Tensorwise(), (19, 40), {}), (Float8Rowwise(pow2=True), (19, 40), {}),
                           (Float8Blockwise(block_size=32), (19, 40), {}),
                           (Float8Blockwise(block_dim=2, block_size=16, fmt="e5m2"), (19, 40), {}),
                           (Float8Tensorwise("e5m2"), (19, 40), {"scale": torch.tensor([3.5])}),
                           (MXFP8(), (64, 96), {}), (NVFP4(two_d=True), (32, 48), {}),
                           (NVFP4(stochastic_rounding=True), (48, 32), {"seed": 5}),
                           (NVFP4(rht=True, stochastic_rounding=True), (48, 32), {"seed": 9})]:
        cases.append((shape, sch, True, True, {**kw, **f16}))
    cases.append(((19, 40), Float8Blockwise(block_size=32), True, False, f16))
    # non-finite values and values near the FP32 maximum ("_fill", see _special_input; finite FP8 codes only: the
    # interpreter's float->fp8 cast is wrong for NaN, and an Inf saturates before the cast): the MXFP8 block with an
    # Inf gets the E8M0 NaN, a delayed copy with an Inf the NaN scale_inv, power-of-two scales stay >= their floor
    for rw, cw in COPIES:
        cases.append(((64, 96), MXFP8(), rw, cw, {"_fill": "inf"}))
        cases.append(((64, 64), MXFP8("e5m2"), rw, cw, {"_fill": "inf"}))
        cases.append(((19, 40), Float8Tensorwise(), rw, cw, {"scale": torch.tensor([3.5]), "_fill": "inf"}))
        cases.append(((40, 19), Float8Tensorwise("e5m2"), rw, cw, {"scale": torch.tensor([0.5]), "_fill": "inf"}))
        for sch in [Float8Blockwise(block_size=32), Float8Blockwise(block_dim=2, block_size=16),
                    Float8Rowwise(pow2=True), Float8Blockwise(block_size=16, fmt="e5m2")]:
            cases.append(((19, 40), sch, rw, cw, {"_fill": "huge"}))
    return cases


def _special_input(shape, dtype, seed, fill):
    """``_randn`` with, for ``fill="inf"``, a +Inf and a -Inf in different rows and blocks; for ``"huge"``, magnitudes
    up to the FP32 maximum (the maximum itself, both signs, and a row just above 1.75 * 2**127)."""
    x = _randn(shape, torch.float32, "cpu", seed)
    if fill == "inf":
        x[3, 5] = float("inf")
        x[-2, -3] = -float("inf")
    elif fill == "huge":
        g = torch.Generator().manual_seed(seed)
        x = (torch.rand(shape, generator=g) * 2 - 1) * torch.finfo(torch.float32).max
        x[0, 0], x[-1, -1] = torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max
        x[1] = 1.75 * 2.0**127 * 1.01
    return x.to(dtype)


def _interp_rht_cases():
    # NVFP4 with the RHT'd columnwise copy (amax_rht_kernel + nvfp4_kernel RHT=True); kwargs "_tile" forces
    # one tile shape (BM, BK) on both kernels: ragged in M (80 rows in 32- or 64-row tiles) and in K (48 in 32).
    cases = []
    for shape in [(32, 32), (48, 64), (80, 48)]:
        for sch, kw in [(NVFP4(rht=True), {}), (NVFP4(rht=True, stochastic_rounding=True), {"seed": 2**63 + 5})]:
            for rw in (False, True):
                cases.append((shape, sch, rw, True, kw))
    for tile in [(32, 32), (64, 16), (16, 32)]:
        cases.append(((80, 48), NVFP4(rht=True, stochastic_rounding=True, rht_signs=0xFFFF), True, True,
                      {"seed": 1, "_tile": tile}))
    cases.append(((80, 48), NVFP4(rht=True, rht_signs=1), False, True, {"_tile": (64, 32)}))
    return cases


def _interp_main(cases) -> int:  # runs in the subprocess
    import lowbit.quant.triton_backend as tb

    configs = tb._configs
    failures = 0
    for i, (shape, sch, rw, cw, kw) in enumerate(cases):
        kw = dict(kw)
        tile = kw.pop("_tile", None)
        dtype = kw.pop("_dtype", torch.float32)
        fill = kw.pop("_fill", None)
        tb._configs = configs if tile is None else (lambda *a, **k: [dict(BM=tile[0], BK=tile[1], num_warps=4)])
        x = _randn(shape, dtype, "cpu", seed=i) if fill is None else _special_input(shape, dtype, i, fill)
        bad = compare(x, sch, rw, cw, **kw)
        if bad:
            failures += 1
            print("FAIL", sch, shape, rw, cw, dtype, kw, tile, bad)
    print(f"interp cases: {len(cases)}, failures: {failures}")
    return 1 if failures else 0


def _run_interp(flag: str):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    src = os.path.join(os.path.dirname(__file__), "..", "src")
    env["PYTHONPATH"] = os.path.abspath(src) + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, __file__, flag], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "failures: 0" in p.stdout


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
def test_kernels_in_interpreter_match_reference():
    _run_interp("--interp")


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
def test_nvfp4_rht_fused_in_interpreter_match_reference():
    _run_interp("--interp-rht")


def _interp_persistent_main() -> int:  # runs in the subprocess
    """blockwise_persistent_kernel launched directly (the backend keeps it off in the interpreter): 2x3 ragged
    tiles and 2x1 whole ones walked by 2 persistent programs, every copy combination, 1D and 2D, prefetch 1 and 2
    (the kernel supports ragged tiles; the backend uses it on whole tiles only, see _PERSISTENT)."""
    import lowbit.quant.triton_backend as tb
    from lowbit.quant.kernels import quant as QK
    from lowbit.quant.tensor import QuantizedTensor

    failures = n = 0
    for shape in [(144, 272), (256, 128)]:
        for sch in [Float8Blockwise(), Float8Blockwise(block_dim=2), Float8Blockwise(fmt="e5m2", pow2=False)]:
            for rw, cw in COPIES:
                for dtype in (torch.float32, torch.bfloat16):
                    for prefetch in (1, 2):
                        x = _randn(shape, dtype, "cpu", seed=n)
                        M, Kd = shape
                        plan = tb.BlockwisePlan(M, Kd, sch, rw, cw, x.device)
                        bufs = tb.blockwise_buffers(plan, sch.format, x.device, rw, cw)
                        bm = 64 if sch.block_dim == 1 and not cw else 128
                        QK.blockwise_persistent_kernel[(2,)](x, *tb.blockwise_args(plan, *bufs), 2,
                                                             **dict(plan.kw, BM=bm, PREFETCH=prefetch,
                                                                    EVEN=M % bm == 0 and Kd % 128 == 0))
                        got = QuantizedTensor(shape=x.shape, dtype=x.dtype, scheme=sch)
                        tb.set_copies(got, *bufs)
                        bad = mismatches(quantize_reference(x, sch, rowwise=rw, columnwise=cw), got)
                        n += 1
                        if bad:
                            failures += 1
                            print("FAIL", prefetch, sch, shape, rw, cw, dtype, bad)
    print(f"interp cases: {n}, failures: {failures}")
    return 1 if failures else 0


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
def test_blockwise_persistent_kernels_in_interpreter_match_reference():
    _run_interp("--interp-persistent")


if __name__ == "__main__" and "--interp" in sys.argv:
    sys.exit(_interp_main(_interp_cases()))
if __name__ == "__main__" and "--interp-rht" in sys.argv:
    sys.exit(_interp_main(_interp_rht_cases()))
if __name__ == "__main__" and "--interp-scales" in sys.argv:
    _bad = _scale_rule_mismatches("cpu")
    print("\n".join(_bad[:20]))
    print(f"interp cases: scale rules, failures: {len(_bad)}")
    sys.exit(1 if _bad else 0)
if __name__ == "__main__" and "--interp-persistent" in sys.argv:
    sys.exit(_interp_persistent_main())


def test_bf16_pack_candidates():
    """The prologue quantizers' PACK candidates (BF16 pairs) are offered for BF16 only; a PACK candidate forced
    alone stays (rowcol_regs_prologue runs it without packing on other dtypes)."""
    from lowbit.quant.triton_backend import bf16_pack_candidates

    cands = [dict(KIND="regs", PACK=True), dict(KIND="regs"), dict(KIND="two")]
    assert bf16_pack_candidates(cands, torch.bfloat16) == cands
    assert bf16_pack_candidates(cands, torch.float16) == cands[1:]
    assert bf16_pack_candidates(cands[:1], torch.float16) == cands[:1]
