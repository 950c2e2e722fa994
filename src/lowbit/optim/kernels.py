"""Triton kernel of :class:`lowbit.optim.AdamW`: the fused AdamW step of FP32 master weights that also writes the
weights' 128 x 128 blockwise FP8 copies (both, as the forward and dgrad GEMMs read them) while the updated values are
on chip. The launcher and the optimizer are in :mod:`lowbit.optim.adamw`; the spec is :mod:`lowbit.optim.reference`.

The update follows torch's fused CUDA AdamW (``torch._fused_adamw_``) operation for operation, including where it
computes in double precision (its hyperparameters are C++ doubles, so ``beta1 * exp_avg`` etc. are double products
rounded once to FP32); divisions and the square root are IEEE round-to-nearest (``div_rn``, ``sqrt_rn``) as nvcc
compiles them without fast math, and the kernel is launched with ``enable_fp_fusion=False`` so that no product and
sum fuse into an FMA the reference does not have. The quantization is :func:`lowbit.quant.reference.quantize_reference`
for ``Float8Blockwise(block_dim=2)``: one amax a 128 x 128 tile, its (power-of-two) scale, a saturating cast of
``w * scale``; the transposed copy carries the same scale in the transposed grid.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..quant.kernels.quant import abs_bits, bits_to_f32, compute_scale, fp8_prep, recip
from ..runtime.device import INTERPRET

# Triton's interpreter returns nothing from libdevice.pow: there the bias corrections take exp(step * log(beta)) in
# float64 (numpy), which is the same double as pow to within an ulp, i.e. the same FP32 value after the rounding
# that follows except at a rounding boundary; the CPU tests use fixed betas and steps, where it is checked.
_INTERP = tl.constexpr(INTERPRET)

# The launch table: one row of int64 addresses per tensor, in this column order (the kernel reads them by index).
TABLE_COLUMNS = ("p", "grad", "exp_avg", "exp_avg_sq", "rq", "rs", "cq", "cs", "step", "amax")
T_COLS = tl.constexpr(len(TABLE_COLUMNS))


@triton.jit
def _f64(bits):
    """The float64 whose bit pattern is the integer ``bits`` (hyperparameters arrive exactly this way: Triton would
    pass a Python float as FP32)."""
    return bits.to(tl.int64).to(tl.float64, bitcast=True)


@triton.jit
def _pow(b, e):
    if _INTERP:
        return tl.exp(e * tl.log(b))
    else:
        return tl.extra.cuda.libdevice.pow(b, e)


@triton.jit
def _ptr(row, col: tl.constexpr, dtype: tl.constexpr):
    # every address in the table is 16-byte aligned (checked by the launcher), which lets the loads vectorize
    return tl.multiple_of(tl.load(row + col).to(tl.pointer_type(dtype)), 16)


@triton.jit
def _adamw_tile_rows(p_ptr, g_ptr, m_ptr, v_ptr, offs, mask, lrwd, b1, omb1, b2, omb2, eps, gs, step_size, bc2s,
                     HAS_GS: tl.constexpr, WD: tl.constexpr, EVEN: tl.constexpr):
    """One chunk of rows through the AdamW update (torch._fused_adamw_'s arithmetic); stores p, exp_avg,
    exp_avg_sq and returns the new p (FP32)."""
    if EVEN:
        p = tl.load(p_ptr + offs)
        g = tl.load(g_ptr + offs, eviction_policy="evict_first")
        m = tl.load(m_ptr + offs, eviction_policy="evict_first")
        v = tl.load(v_ptr + offs, eviction_policy="evict_first")
    else:
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first")
        m = tl.load(m_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first")
        v = tl.load(v_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first")
    if HAS_GS:
        g = (g.to(tl.float64) / gs).to(tl.float32)  # grad /= double(*grad_scale)
    if WD:
        pd = p.to(tl.float64)
        p = (pd - lrwd * pd).to(tl.float32)  # param -= lr * weight_decay * param
    gd = g.to(tl.float64)
    m = (b1 * m.to(tl.float64) + omb1 * gd).to(tl.float32)
    v = (b2 * v.to(tl.float64) + omb2 * gd * gd).to(tl.float32)
    denom = (tl.math.div_rn(tl.math.sqrt_rn(v), bc2s).to(tl.float64) + eps).to(tl.float32)
    p = p - tl.math.div_rn(step_size * m, denom)
    if EVEN:
        tl.store(p_ptr + offs, p, eviction_policy="evict_last")  # read again for the FP8 copies: keep it in L2
        tl.store(m_ptr + offs, m, eviction_policy="evict_first")
        tl.store(v_ptr + offs, v, eviction_policy="evict_first")
    else:
        tl.store(p_ptr + offs, p, mask=mask, eviction_policy="evict_last")
        tl.store(m_ptr + offs, m, mask=mask, eviction_policy="evict_first")
        tl.store(v_ptr + offs, v, mask=mask, eviction_policy="evict_first")
    return p


@triton.jit
def adamw_fp8_128x128_kernel(tab_ptr, M, K, rs_ld, cs_ld, lr_ptr, lr_bits, b1_bits, b2_bits, wd_bits, eps_bits,
                             gs_ptr, fi_ptr,
                             FMAX: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr, POW2: tl.constexpr,
                             EPS: tl.constexpr, SW: tl.constexpr, E5M2: tl.constexpr,
                             ADAM: tl.constexpr, LR_PTR: tl.constexpr, HAS_GS: tl.constexpr, HAS_FI: tl.constexpr,
                             WD: tl.constexpr, CH: tl.constexpr, CH2: tl.constexpr, EVEN: tl.constexpr,
                             NS: tl.constexpr = 1):
    """One 128 x 128 tile of one tensor a program: grid (tiles of an (M, K) weight, tensors). Every tensor of a
    launch has the same shape; ``tab_ptr`` (tensors, T_COLS) int64 holds, per tensor, the addresses of:

    * p, g, exp_avg, exp_avg_sq: (M, K) FP32, contiguous; p, exp_avg and exp_avg_sq are updated in place;
    * rq (M, K) and cq (K, M): FP8 (E4M3, or E5M2 with ``E5M2``), the rowwise copy and the transposed columnwise one;
    * rs (cdiv(M, 128), rs_ld) and cs (cdiv(K, 128), cs_ld) FP32: scale_inv = 1 / scale of each tile, the
      second grid transposed (storage layout of ``Float8Blockwise(block_dim=2)``; pad columns are not written);
    * step: () FP32, the optimizer step count *after* this step's increment (torch keeps it on the device);
    * amax: int32, the bit pattern of max |p| after the step, accumulated by atomic max (zeroed by the caller).

    Hyperparameters arrive as float64 bit patterns (``*_bits``); the learning rate from ``lr_ptr`` (FP32, as
    torch's tensor lr) when ``LR_PTR``. ``gs_ptr`` (HAS_GS): FP32 grad_scale, the gradient is divided by it;
    ``fi_ptr`` (HAS_FI): FP32 found_inf, the whole step is skipped (nothing written) where it is 1.
    ``ADAM=False``: no update, only the FP8 copies of p as it is (used to prime the copies). ``CH``: rows a chunk of
    the update (registers: the moments and the double-precision temporaries); ``CH2``: rows a chunk of the cast,
    which is also the length of each row piece of the transposed copy it stores (64: two whole 32-byte sectors;
    16 wrote half sectors).
    ``NS``: software-pipelining stages of the update loop (1: none; more: the next chunks' loads are issued before
    this chunk's math, through shared memory).
    ``EVEN``: M and K are multiples of 128 (no masks). The chunks of p are re-read for the cast (stored with
    evict_last just before, so from L2) since the tile's scale needs its whole amax first.
    """
    DT: tl.constexpr = tl.float8e5 if E5M2 else tl.float8e4nv
    if HAS_FI:
        go = tl.load(fi_ptr) != 1.0
    else:
        go = True
    if go:
        _adamw_fp8_tile(tab_ptr, M, K, rs_ld, cs_ld, lr_ptr, lr_bits, b1_bits, b2_bits, wd_bits, eps_bits, gs_ptr,
                        FMAX, EMIN, MBITS, POW2, EPS, SW, DT, ADAM, LR_PTR, HAS_GS, WD, CH, CH2, EVEN, NS)


@triton.jit
def _adamw_fp8_tile(tab_ptr, M, K, rs_ld, cs_ld, lr_ptr, lr_bits, b1_bits, b2_bits, wd_bits, eps_bits, gs_ptr,
                    FMAX: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr, POW2: tl.constexpr,
                    EPS: tl.constexpr, SW: tl.constexpr, DT: tl.constexpr, ADAM: tl.constexpr, LR_PTR: tl.constexpr,
                    HAS_GS: tl.constexpr, WD: tl.constexpr, CH: tl.constexpr, CH2: tl.constexpr, EVEN: tl.constexpr,
                    NS: tl.constexpr):
    tid = tl.program_id(1).to(tl.int64)
    pid = tl.program_id(0)
    nkt = tl.cdiv(K, 128)
    tm = (pid // nkt).to(tl.int64)
    tk = (pid % nkt).to(tl.int64)
    row = tab_ptr + tid * T_COLS
    p_ptr = _ptr(row, 0, tl.float32)
    rq_ptr = _ptr(row, 4, DT)
    rs_ptr = tl.load(row + 5).to(tl.pointer_type(tl.float32))
    cq_ptr = _ptr(row, 6, DT)
    cs_ptr = tl.load(row + 7).to(tl.pointer_type(tl.float32))
    amax_ptr = tl.load(row + 9).to(tl.pointer_type(tl.int32))
    m0 = tm * 128
    k0 = tk * 128
    rr = tl.arange(0, CH)
    cc = tl.arange(0, 128)
    kmask = (k0 + cc) < K
    acc = tl.zeros((CH, 128), dtype=tl.int32)
    if ADAM:
        g_ptr = _ptr(row, 1, tl.float32)
        m_ptr = _ptr(row, 2, tl.float32)
        v_ptr = _ptr(row, 3, tl.float32)
        step = tl.load(tl.load(row + 8).to(tl.pointer_type(tl.float32))).to(tl.float64)
        if LR_PTR:
            lr = tl.load(lr_ptr).to(tl.float64)
        else:
            lr = _f64(lr_bits)
        b1 = _f64(b1_bits)
        b2 = _f64(b2_bits)
        eps = _f64(eps_bits)
        lrwd = lr * _f64(wd_bits)
        # torch: bias corrections in double, handed to the element math as FP32
        bc1 = (1.0 - _pow(b1, step)).to(tl.float32)
        bc2s = tl.sqrt(1.0 - _pow(b2, step)).to(tl.float32)  # (float64: sqrt.rn.f64, exact)
        step_size = (lr / bc1.to(tl.float64)).to(tl.float32)
        gs = tl.load(gs_ptr).to(tl.float64) if HAS_GS else 1.0
        for r0 in tl.range(0, 128, CH, num_stages=NS):
            offs = (m0 + r0 + rr)[:, None] * K + (k0 + cc)[None, :]
            mask = ((m0 + r0 + rr) < M)[:, None] & kmask[None, :]
            p = _adamw_tile_rows(p_ptr, g_ptr, m_ptr, v_ptr, offs, mask, lrwd, b1, 1.0 - b1, b2, 1.0 - b2, eps,
                                 gs, step_size, bc2s, HAS_GS, WD, EVEN)
            acc = tl.maximum(acc, abs_bits(p))
    else:
        for r0 in range(0, 128, CH):
            offs = (m0 + r0 + rr)[:, None] * K + (k0 + cc)[None, :]
            mask = ((m0 + r0 + rr) < M)[:, None] & kmask[None, :]
            if EVEN:
                p = tl.load(p_ptr + offs)
            else:
                p = tl.load(p_ptr + offs, mask=mask, other=0.0)
            acc = tl.maximum(acc, abs_bits(p))
    a = tl.max(tl.max(acc, axis=1), axis=0)
    tl.atomic_max(amax_ptr, a, sem="relaxed")
    s = compute_scale(bits_to_f32(a), FMAX, POW2, EPS)
    si = recip(s, POW2, FMAX)
    tl.store(rs_ptr + tm * rs_ld + tk, si)
    tl.store(cs_ptr + tk * cs_ld + tm, si)
    r2 = tl.arange(0, CH2)
    for r0 in range(0, 128, CH2):
        offs = (m0 + r0 + r2)[:, None] * K + (k0 + cc)[None, :]
        mask = ((m0 + r0 + r2) < M)[:, None] & kmask[None, :]
        toffs = (k0 + cc)[:, None] * M + (m0 + r0 + r2)[None, :]
        if EVEN:
            p = tl.load(p_ptr + offs, eviction_policy="evict_first")
        else:
            p = tl.load(p_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first")
        q = fp8_prep(p * s, FMAX, EMIN, MBITS, SW)
        if EVEN:
            tl.store(rq_ptr + offs, q.to(DT))
            tl.store(cq_ptr + toffs, tl.trans(q).to(DT))
        else:
            tl.store(rq_ptr + offs, q.to(DT), mask=mask)
            tl.store(cq_ptr + toffs, tl.trans(q).to(DT), mask=tl.trans(mask))
