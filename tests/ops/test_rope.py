"""Fused RoPE on packed QKV: the kernel (interpreter subprocess on CPU, compiled on the GPU) against the FP32
reference, forward and backward, odd shapes; the reference against the textbook rotation."""
import os
import subprocess
import sys

import pytest
import torch

from lowbit.models.gpt import rope_tables
from lowbit.ops.rope import rope_qkv, rope_qkv_reference


def _inputs(B, T, H, D, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, T, 3, H, D, generator=g).to(device, dtype)
    cos, sin = rope_tables(T + 3, D, 10000.0)
    return qkv, cos.to(device), sin.to(device)


def _ulp_close(a, b, dtype):
    """|a - b| within one rounding of ``dtype`` at b's magnitude (plus a floor for values near zero)."""
    eps = torch.finfo(dtype).eps
    return bool(((a.float() - b.float()).abs() <= eps * b.float().abs() + eps * 1e-2).all())


def test_reference_is_the_rotation():
    """Each (x_i, x_{i+h}) pair is rotated by angle t·θ_i: norms kept, angle added (FP32)."""
    qkv, cos, sin = _inputs(2, 5, 3, 8, torch.float32)
    q, k, v = rope_qkv_reference(qkv, cos, sin)
    x = qkv[:, :, 0].transpose(1, 2)  # (B, H, T, D)
    z_in = torch.complex(x[..., :4], x[..., 4:])
    z_out = torch.complex(q[..., :4], q[..., 4:])
    ang = torch.complex(cos[:5, :4], sin[:5, :4])
    torch.testing.assert_close(z_out, z_in * ang, rtol=1e-6, atol=1e-6)
    assert torch.equal(v, qkv[:, :, 2].transpose(1, 2))


def test_bad_input():
    qkv, cos, sin = _inputs(1, 4, 2, 8, torch.float32)
    with pytest.raises(ValueError, match=r"qkv: expected a \(B, T, 3, H, D\)"):
        rope_qkv(qkv[:, :, :2], cos, sin)
    with pytest.raises(ValueError, match="cos: expected a"):
        rope_qkv(qkv, cos[:3], sin)
    with pytest.raises(ValueError, match="head_dim must be even"):
        rope_qkv(torch.zeros(1, 4, 3, 2, 7), torch.zeros(4, 7), torch.zeros(4, 7))


def _check_kernel(device, shapes, dtypes):
    for (B, T, H, D), dtype in zip(shapes, dtypes):
        qkv, cos, sin = _inputs(B, T, H, D, dtype, device, seed=B * 7 + T)
        a = qkv.clone().requires_grad_()
        r = qkv.clone().requires_grad_()
        outs = rope_qkv(a, cos, sin)
        refs = rope_qkv_reference(r, cos, sin)
        for o, e in zip(outs, refs):
            assert o.shape == e.shape and _ulp_close(o, e, dtype), (B, T, H, D, dtype,
                                                                    (o.float() - e.float()).abs().max())
        gs = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i)).to(device, dtype)
              for i, o in enumerate(outs)]
        torch.autograd.backward(outs, gs)
        torch.autograd.backward(refs, gs)
        # the backward rotates by -angle in FP32 with one rounding: same bound against the reference's autograd
        # (which rounds once per op), doubled
        diff = (a.grad.float() - r.grad.float()).abs()
        assert bool((diff <= 2 * torch.finfo(dtype).eps * r.grad.float().abs() + 2
                     * torch.finfo(dtype).eps).all()), diff.max()


SHAPES = [(1, 1, 1, 8), (2, 17, 3, 32), (1, 33, 5, 64), (2, 9, 4, 12)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.bfloat16]


def test_kernel_interpreter_subprocess():
    pytest.importorskip("triton")
    code = ("import torch, sys; sys.path.insert(0, %r); import test_rope as t; "
            "t._check_kernel('cpu', t.SHAPES, t.DTYPES); print('ok')" % os.path.dirname(__file__))
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


@pytest.mark.gpu
def test_kernel_gpu(cuda):
    _check_kernel(cuda, SHAPES + [(4, 2048, 16, 64), (2, 1000, 16, 128)], DTYPES + [torch.bfloat16, torch.bfloat16])


# ---- RoPE's backward inside the QKV projection's 1x128 grad_output quantizer ----------------------------------

def _bwd_case(B, T, H, D, dtype, device, seed, tab_extra=5):
    g = torch.Generator().manual_seed(seed)
    # wide dynamic range (the quantizer's scales differ block to block), in (B, T, H, D) as the attention writes them
    gs = [(torch.randn(B, T, H, D, generator=g) * torch.exp(torch.randn(B, T, H, D, generator=g))).to(device, dtype)
          for _ in range(3)]
    cos, sin = rope_tables(T + tab_extra, D, 10000.0)
    return gs, cos.to(device), sin.to(device)


@pytest.mark.gpu
def test_backward_quantize_every_candidate_bit_identical(cuda, monkeypatch, switches):
    """rope_backward_quantize_1x128, each candidate forced alone, equals RoPE's backward kernel (through autograd)
    followed by the reference 1x128 quantizer, bit for bit (data, scales, amax): head dims 64 and 128, BF16 and
    FP16, sequences shorter than a tile (T = 64: a tile's rows wrap into the next sequence's table rows), tables
    longer than T, several heads and batches, E4M3 pow2 and E5M2 non-pow2 scales."""
    import lowbit.ops.rope as R
    from lowbit.quant import Float8Blockwise
    from lowbit.quant.reference import quantize_reference

    switches(LOWBIT_AUTOTUNE=False)
    configs = list(R._ROPE_BWD_CONFIGS)
    cases = [(2, 128, 16, 128, torch.bfloat16), (1, 384, 2, 64, torch.bfloat16), (4, 64, 2, 128, torch.float16),
             (3, 256, 6, 64, torch.bfloat16)]
    schemes = [Float8Blockwise(), Float8Blockwise(fmt="e5m2", pow2=False)]
    for i, (B, T, H, D, dt) in enumerate(cases):
        gs, cos, sin = _bwd_case(B, T, H, D, dt, cuda, 300 + i)
        assert R.rope_backward_fused_quant_supported(*gs, cos, sin, schemes[0])
        # the unfused gradient: rope_qkv's backward kernel through autograd
        qkv = torch.zeros(B, T, 3, H, D, dtype=dt, device=cuda, requires_grad=True)
        q, k, v = rope_qkv(qkv, cos, sin)
        torch.autograd.backward((q, k, v), [g.transpose(1, 2) for g in gs])
        dqkv = qkv.grad.reshape(B * T, 3 * H * D)
        for sch in schemes:
            ref = quantize_reference(dqkv.cpu(), sch, rowwise=True, columnwise=True)
            for cfg in configs:
                monkeypatch.setattr(R, "_ROPE_BWD_CONFIGS", [cfg])
                got = R.rope_backward_quantize_1x128(*gs, cos, sin, sch)
                assert got.shape == (B * T, 3 * H * D)
                for w in ("rowwise", "columnwise"):
                    a, b = getattr(ref, w), getattr(got, w)
                    assert torch.equal(a.data.view(torch.uint8), b.data.cpu().view(torch.uint8)), (cfg, w, B, T, H, D)
                    assert torch.equal(a.scale_inv, b.scale_inv.cpu()), (cfg, w, "scales")
                    assert torch.equal(a.amax.reshape(()), b.amax.cpu().reshape(())), (cfg, w, "amax")


@pytest.mark.gpu
def test_gpt_fused_rope_backward_matches_unfused(cuda, switches):
    """A GPT step under fp8-block: every parameter gradient with RoPE's backward inside qkv's grad_output
    quantizer equals the unfused path's (LOWBIT_UNFUSE=rope_bwd_quant) bit for bit, and the fused path ran (the
    qkv layers took the handed-over gradient)."""
    import lowbit
    from lowbit import recipes
    from lowbit.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=256, n_layer=2, n_head=4, d_model=256, ffn_hidden=512, max_seq_len=256)
    grads = {}
    for fused in ("1", "0"):
        switches(LOWBIT_UNFUSE="" if fused == "1" else "rope_bwd_quant")
        torch.manual_seed(0)
        model = GPT(cfg).to(cuda)
        idx = torch.randint(0, 256, (2, 257), device=cuda, generator=torch.Generator(cuda).manual_seed(1))
        with torch.autocast("cuda", dtype=torch.bfloat16), lowbit.autocast(recipe=recipes.from_name("fp8-block")):
            _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        grads[fused] = {n: p.grad.clone() for n, p in model.named_parameters()}
        taken = sum(b.qkv._gemms[""].handoffs for b in model.blocks)
        assert taken == (2 if fused == "1" else 0), (fused, taken)
    for n, g in grads["1"].items():
        assert torch.equal(g, grads["0"][n]), n


def test_backward_fused_not_supported_off_gpu():
    """Off the GPU (or on shapes the kernel does not take) the sink declines and the call refuses clearly."""
    from lowbit.ops.rope import rope_backward_fused_quant_supported, rope_backward_quantize_1x128
    from lowbit.quant import Float8Blockwise

    gs, cos, sin = _bwd_case(1, 128, 2, 64, torch.bfloat16, "cpu", 0)
    assert not rope_backward_fused_quant_supported(*gs, cos, sin, Float8Blockwise())
    with pytest.raises(NotImplementedError, match="rope_backward_quantize_1x128"):
        rope_backward_quantize_1x128(*gs, cos, sin, Float8Blockwise())


def test_backward_quantize_compiles_for_sm90():
    """The fused kernel (quant_gluon.rowcol_1x128_regs with ROPE_BWD, the first candidate) compiles for Hopper with
    the installed Triton on any machine: 16-byte loads of the three gradients and of the tables (no scalar loads),
    one FMA an output; under Triton 3.6 at head_dim 128 at most 128 registers and no spills."""
    import re

    from sm90_compile import compile_gluon_sm90, rowcol_regs_signature, sm90_sass

    from lowbit.ops.rope import _ROPE_BWD_CONFIGS
    from lowbit.quant.kernels import quant_gluon as QG

    if not QG.GLUON:
        pytest.skip("this Triton has no Gluon")
    c = _ROPE_BWD_CONFIGS[0]
    for dh in (128, 64):
        sig, const = rowcol_regs_signature("bf16", c["num_warps"], c["LC"], COMPACT=c["COMPACT"], ROPE_BWD=True,
                                           DH=dh, H=QG.rowcol_regs_half_layout(c["num_warps"], c["LC"]),
                                           AW=QG.rowcol_regs_word_layout(c["num_warps"], c["LC"]) if c.get("PACK")
                                           else None)
        # the prologue's pointers and run-time arguments, typed
        sig.update(g_ptr="*bf16", gv_ptr="*bf16", cos_ptr="*fp32", sin_ptr="*fp32", rope_T="i32", tab_row="i32",
                   HD="i32")
        for n in ("g_ptr", "gv_ptr", "cos_ptr", "sin_ptr", "rope_T", "tab_row", "HD"):
            del const[n]
        k = compile_gluon_sm90(QG.rowcol_1x128_regs, sig, const, divisible=("M", "K", "rs_ld", "cs_ld", "HD",
                                                                            "tab_row"),
                               num_warps=c["num_warps"])
        ptx = k.asm["ptx"]
        loads = set(re.findall(r"ld\.global[\.\w]*", ptx))
        assert loads == {"ld.global.v4.b32"}, loads
        assert "fma.rn.f32" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx
        assert ptx.count("st.global.v2.b32") == 16
        got = sm90_sass(k, "3.6")
        if got is not None and dh == 128:
            assert "STL" not in got[0] and "LDL" not in got[0]
            assert got[1] <= 128, got[1]
