"""How much of the INT8·FP8 attention error is E4M3 itself: NRMSE against FP32 attention of each rounding alone,
on the bench's inputs (torch.randn BF16 q, k, v) and on inputs with a per-channel offset in V (as real values have).
CPU, pure torch (lowbit.attention.reference); issue 5's accuracy target. Usage: python scripts/attn_fp8_pv_floor.py
"""
import torch

from lowbit.attention.reference import E4M3_MAX, attention_reference, to_e4m3

torch.manual_seed(0)


def nrmse(a, b):
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def int8_rows(x, rows):
    """Per-block INT8 (SageAttention's per_block: one scale per `rows` rows), dequantized."""
    B, H, S, D = x.shape
    xb = x.reshape(B, H, S // rows, rows * D)
    s = xb.abs().amax(-1, keepdim=True) / 127
    return (torch.round(xb / s).clamp(-127, 127) * s).reshape(B, H, S, D)


def run(q, k, v, label):
    q, k, v = (t.float() for t in (q, k, v))
    D = q.shape[-1]
    ref = attention_reference(q, k, v)
    scale = D ** -0.5
    # P (normalised by the exact row max, as the online softmax's last tile) with optional E4M3 rounding of P and of
    # V (per-channel scale over the sequence, as quantize_v_fp8)
    def attn(qq, kk, p8, v8, smooth_v=False, l8=False):
        s = (qq @ kk.transpose(-1, -2)) * scale
        p = torch.exp(s - s.amax(-1, keepdim=True))
        l = p.sum(-1, keepdim=True)
        vv = v
        mean = vv.mean(-2, keepdim=True) if smooth_v else 0.0
        vv = vv - mean
        if p8:
            p = to_e4m3(p * E4M3_MAX).float() / E4M3_MAX
            if l8:  # divide by the sums of the rounded P (the P the P·V uses)
                l = p.sum(-1, keepdim=True)
        if v8:
            amax = vv.abs().amax(-2, keepdim=True).clamp_min(1e-30)
            vv = to_e4m3(vv * (E4M3_MAX / amax)).float() * (amax / E4M3_MAX)
        return (p @ vv) / l + mean
    kq = k - k.mean(-2, keepdim=True)  # K smoothing (exact: softmax is shift-invariant per row)
    qi, ki = int8_rows(q, 128), int8_rows(kq, 64)
    s16 = (q @ k.transpose(-1, -2)) * scale
    p16 = torch.exp(s16 - s16.amax(-1, keepdim=True))
    bf16_pv = (p16.bfloat16().float() @ v) / p16.sum(-1, keepdim=True)
    rows = [("BF16 P·V (P rounded to BF16)", nrmse(bf16_pv, ref)),
            ("exact Q·K, P in E4M3, V exact", nrmse(attn(q, k, True, False), ref)),
            ("exact Q·K, P exact, V in E4M3", nrmse(attn(q, k, False, True), ref)),
            ("exact Q·K, P and V in E4M3", nrmse(attn(q, k, True, True), ref)),
            ("exact Q·K, P and V in E4M3, V smoothed", nrmse(attn(q, k, True, True, True), ref)),
            ("INT8 Q·K (per block), P·V exact (sage 1.0.6's math, FP16 P·V)", nrmse(attn(qi, ki, False, False), ref)),
            ("INT8 Q·K, P and V in E4M3", nrmse(attn(qi, ki, True, True), ref)),
            ("INT8 Q·K, P and V in E4M3, V smoothed", nrmse(attn(qi, ki, True, True, True), ref)),
            ("INT8 Q·K, P and V in E4M3, divided by the sums of the E4M3 P",
             nrmse(attn(qi, ki, True, True, l8=True), ref))]
    print(f"\n{label}\n| rounding | NRMSE vs FP32 |\n|---|---:|")
    for name, e in rows:
        print(f"| {name} | {e:.2e} |")


B, H, S, D = 1, 8, 2048, 128
q, k, v = (torch.randn(B, H, S, D).bfloat16() for _ in range(3))
run(q, k, v, f"torch.randn q, k, v (the bench's inputs), B{B} H{H} S{S} D{D}")
off = 4 * torch.randn(1, H, 1, D)
run(q, k + off, v + off, "the same with a per-channel offset N(0, 4^2) added to K and V")
