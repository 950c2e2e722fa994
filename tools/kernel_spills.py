"""Register spills of lowbit's hot Triton kernels compiled for sm_90 — on any machine, no GPU needed.

Compiles each kernel with Triton's own toolchain for an H100/H200 target and counts the spill stores/loads
(STL/LDL) and the tensor-core instructions (HGMMA: 16-bit, QGMMA: FP8, IGMMA/IMMA: INT8) in the SASS that
Triton's bundled nvdisasm prints. A static fact, not a timing: a kernel that spills in its inner loop is slow,
one that does not may still be slow for other reasons.

    PYTHONPATH=src python tools/kernel_spills.py     # attention forward / backward, FP8 and BF16 GEMMs, quantize
    PYTHONPATH=src python tools/kernel_spills.py --no-specialize   # without divisibility specialization
    PYTHONPATH=src python tools/kernel_spills.py --only fp8_gemm,quantize_1x128    # some kernel groups

A real launch on large, aligned shapes specializes pointers and integer arguments that are multiples of 16
("tt.divisibility" 16), which changes vectorization and register use: without it the counts overstate the attention
backward's spills (checked against the device's own register counts). By default every pointer and every size /
stride argument is marked so; --no-specialize compiles them generic.
"""
from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile

SPECIALIZE = True  # set by main() from --no-specialize
_SIZE_NAMES = re.compile(r"^(s[a-z]+|M|N|K|Sq|Sk|lda_s|ldb_s|rs_ld|cs_ld|ld_s|stride_\w+)$")


def _divisibility_attrs(fn, signature: dict) -> dict:
    names = list(inspect.signature(fn.fn).parameters)
    return {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
            if str(signature.get(n, "")).startswith("*") or (signature.get(n) == "i32" and _SIZE_NAMES.match(n))}


def sass_counts(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int) -> dict:
    """{STL, LDL, HGMMA, QGMMA, IMMA: count} in the SASS of ``fn`` compiled for sm_90 with these arguments."""
    import triton
    from triton.backends.compiler import GPUTarget

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    attrs = _divisibility_attrs(fn, signature) if SPECIALIZE else None
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    return {name: len(re.findall(pat, sass)) for name, pat in
            (("STL", r"\bSTL"), ("LDL", r"\bLDL"), ("HGMMA", r"HGMMA"), ("QGMMA", r"QGMMA"), ("IMMA", r"IGMMA|IMMA"))}


def _signature(fn, pointers: dict, floats=(), ones=()):
    sig, const = {}, {}
    for p, prm in inspect.signature(fn.fn).parameters.items():
        if p in pointers:
            sig[p] = pointers[p]
        elif p in floats:
            sig[p] = "fp32"
        elif "constexpr" in str(prm.annotation):
            sig[p] = "constexpr"
        else:
            sig[p] = "i32"
    for p in ones:  # unit strides, as Triton specializes them at launch
        sig[p], const[p] = "constexpr", 1
    return sig, const


def attention_forward():
    from lowbit.attention import forward_kernel

    print("attention forward (lowbit.attention.forward_kernel), D=128, dense bhsd")
    for qk, pv, name in ((0, False, "bf16 QK / bf16 PV"), (1, False, "int8 QK / bf16 PV"),
                         (1, True, "int8 QK / fp8 PV"), (2, True, "fp8 QK / fp8 PV")):
        qdt = {0: "*bf16", 1: "*i8", 2: "*fp8e4nv"}[qk]
        ptrs = dict(Q=qdt, K=qdt, V="*fp8e4nv" if pv else "*bf16", O="*bf16", LSE="*fp32", QS="*fp32", KS="*fp32",
                    VS="*fp32", KM="*fp32", CUQ="*i32", CUK="*i32")
        for bm, bn, w, st in ((128, 64, 8, 3), (128, 128, 8, 2)):
            for tma in (False, True):
                sig, const = _signature(forward_kernel, ptrs, floats=("sm_scale_log2",),
                                        ones=("sqd", "skd", "sod", "svs" if pv else "svd"))
                const.update(QK_MODE=qk, PV_FP8=pv, Q_SCALE_ROWS=128, K_SCALE_ROWS=64, HAS_KMEAN=False,
                             RETURN_LSE=False, VARLEN=False, REVERSE_M=False, HEAD_DIM=128, BLOCK_M=bm, BLOCK_N=bn,
                             INTERPRET=False, TMA=tma)
                c = sass_counts(forward_kernel, sig, const, w, st)
                print(f"  {name:18s} {bm}x{bn} {w} warps {st} stages  {'TMA    ' if tma else 'pointer'}  {c}")


def fp8_gemm():
    from lowbit.gemm.kernels import gemm as G

    print("FP8 GEMM (fp8_gemm_kernel), 1x128 x 128x128 scales, BF16 out")
    ptrs = dict(a_ptr="*fp8e4nv", b_ptr="*fp8e4nv", sa_ptr="*fp32", sb_ptr="*fp32", c_ptr="*bf16", pre_ptr="*bf16",
                bias_ptr="*bf16", ws_ptr="*fp32")
    for bm, bn, w, st in ((128, 128, 8, 3), (128, 256, 8, 3), (64, 128, 4, 4)):
        for tma in (False, True):
            sig, const = _signature(G.fp8_gemm_kernel, ptrs)
            const.update(SA=2, SB=3, BS=128, HAS_BIAS=False, GELU=False, ACCUM=False, BM=bm, BN=bn, GROUP_M=8, TMA=tma)
            c = sass_counts(G.fp8_gemm_kernel, sig, const, w, st)
            print(f"  {bm}x{bn} {w} warps {st} stages  {'TMA    ' if tma else 'pointer'}  {c}")


def dequant_bf16_gemm():
    from lowbit.gemm.kernels import gemm as G

    print("BF16 GEMM behind the dequantized NVFP4 / MXFP8 path (emu_gemm_kernel PRE), BK=64")
    ptrs = dict(a_ptr="*bf16", b_ptr="*bf16", sa_ptr="*fp32", sb_ptr="*fp32", gsa_ptr="*fp32", gsb_ptr="*fp32",
                c_ptr="*bf16", pre_ptr="*bf16", bias_ptr="*bf16")
    for bm, bn, w, st in ((128, 256, 8, 3), (128, 128, 8, 4)):
        for tma in (False, True):
            sig, const = _signature(G.emu_gemm_kernel, ptrs)
            const.update(NV=True, A2D=False, B2D=True, F32=False, PRE=True, HAS_BIAS=False, GELU=False, ACCUM=False,
                         BM=bm, BN=bn, BK=64, GROUP_M=8, TMA=tma)
            c = sass_counts(G.emu_gemm_kernel, sig, const, w, st)
            print(f"  {bm}x{bn} {w} warps {st} stages  {'TMA    ' if tma else 'pointer'}  {c}")


def quantize_1x128():
    from lowbit.quant.kernels import quant as Q

    print("1x128 quantize (blockwise_kernel), BF16 in, rowwise + columnwise, E4M3, pow2 scales: "
          "the autotuner's candidates")
    ptrs = dict(x_ptr="*bf16", rq_ptr="*fp8e4nv", rs_ptr="*fp32", cq_ptr="*fp8e4nv", cs_ptr="*fp32", amax_ptr="*i32")
    from lowbit.quant.triton_backend import blockwise_configs

    for cfg in blockwise_configs(8192, 8192, 128, False, True, True):
        cfg = dict(cfg)
        bm, w = cfg.pop("BM"), cfg.pop("num_warps")
        sig, const = _signature(Q.blockwise_kernel, ptrs)
        sig["abs_mask"] = "i32"
        const.update(FMAX=448.0, EMIN=-6, MBITS=3, POW2=True, EPS=0.0, TWO_D=False, ROW=True, COL=True, SW=False,
                     BS=128, BM=bm, SATCVT=True, EVEN=True, WIDE=False, KMAJOR=True, NORM=False, SLAB2=0, ROW2=False,
                     SCR=False, UNROLL=1)
        const.update(cfg)
        print(f"  BM={bm} {w} warps {cfg}  {sass_counts(Q.blockwise_kernel, sig, const, w, 3)}")
    print("blockwise_persistent_kernel (1 CTA an SM, whole 128x128 tiles in registers): two of its uses")
    for xdt, two_d, row, col, bm, w, pf in (("*bf16", True, True, True, 128, 16, 1),
                                            ("*fp32", False, True, False, 64, 4, 1)):
        ptrs = dict(x_ptr=xdt, rq_ptr="*fp8e4nv", rs_ptr="*fp32", cq_ptr="*fp8e4nv", cs_ptr="*fp32", amax_ptr="*i32")
        sig, const = _signature(Q.blockwise_persistent_kernel, ptrs)
        sig["abs_mask"] = "i32"
        const.update(FMAX=448.0, EMIN=-6, MBITS=3, POW2=True, EPS=0.0, TWO_D=two_d, ROW=row, COL=col, SW=False,
                     BS=128, BM=bm, SATCVT=True, EVEN=True, WIDE=False, PREFETCH=pf)
        c = sass_counts(Q.blockwise_persistent_kernel, sig, const, w, 1)
        print(f"  {xdt[1:]} {'128x128' if two_d else '1x128'} row={row} col={col} BM={bm} {w} warps prefetch {pf}  {c}")


def attention_backward():
    from lowbit.attention import backward_kernels as BK

    kernels = (  # (kernel, what it loads in its loop, BLOCK_M x BLOCK_N of its D=128 default, its gradient pointers)
        (BK.bwd_dkdv, "dK/dV (Q/dO tiles)", (32, 128), ("DK", "DV", "SCK", "SCV", "RSK", "RSV", "AMK", "AMV")),
        (BK.bwd_dq, "dQ (K/V tiles)", (128, 64), ("DQ", "SCQ", "RSQ", "AMQ")),
    )
    for fn, what, (bm, bn), grads in kernels:
        print(f"attention backward {what}, D=128, {bm}x{bn} tiles, 8 warps, 3 stages (the D=128 default)")
        for qmode, name in ((0, "BF16 grads"), (2, "FP8 grads, per-row scales")):
            ptrs = dict(Q="*bf16", K="*bf16", V="*bf16", DO="*bf16", LSE2="*fp32", DELTA="*fp32", CUQ="*i32",
                        CUK="*i32")
            ptrs.update({g: ("*fp32" if g[0] in "SRA" else "*bf16" if qmode == 0 else "*fp8e4nv") for g in grads})
            sig, const = _signature(fn, ptrs, floats=("sm_scale", "sm_scale_log2", "p_drop", "drop_scale"),
                                    ones=("sqd", "skd", "svd", "sdod", "sgd"))
            const.update(QMODE=qmode, FMT=1, FMAX=448.0, DROPOUT=False, VARLEN=False, HEAD_DIM=128,
                         INTERPRET=False, BLOCK_M=bm, BLOCK_N=bn)
            c = sass_counts(fn, sig, const, 8, 3)
            print(f"  {name:26s} pointer  {c}")


GROUPS = {"attention_forward": attention_forward, "attention_backward": attention_backward, "fp8_gemm": fp8_gemm,
          "dequant_bf16_gemm": dequant_bf16_gemm, "quantize_1x128": quantize_1x128}


def main(argv=None) -> int:
    global SPECIALIZE
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-specialize", action="store_true",
                   help="compile pointers and sizes without the divisibility-by-16 specialization of a real launch")
    p.add_argument("--only", default=",".join(GROUPS),
                   help="comma-separated kernel groups to compile, of: " + ", ".join(GROUPS) + " (default: all)")
    args = p.parse_args(argv)
    groups = [g.strip() for g in args.only.split(",") if g.strip()]
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        p.error(f"--only: unknown group(s) {', '.join(unknown)}; expected of {', '.join(GROUPS)}")
    SPECIALIZE = not args.no_specialize
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    import triton

    print(f"triton {triton.__version__}, target sm_90")
    for g in groups:
        GROUPS[g]()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
