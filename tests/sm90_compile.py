"""Compile a Gluon kernel for Hopper (sm_90) on any machine — Triton's own toolchain, no GPU — and read its SASS:
the static checks of the Gluon kernels' tests (tests/test_quant_kernels.py, tests/test_gemm.py)."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import pytest


def compile_gluon_sm90(fn, sig: dict, constexprs: dict, divisible=(), **options):
    """The compiled kernel of Gluon function ``fn`` for sm_90.

    ``sig`` gives every parameter's type in order ("*bf16", "i32", "constexpr"), ``constexprs`` the constexpr
    values, ``options`` the compile options (num_warps, maxnreg). Pointers and the parameters named in ``divisible``
    are specialized as multiples of 16, as a launch on large aligned shapes is. Skips the test where this Triton has
    no Gluon or no usable ptxas."""
    pytest.importorskip("triton")
    try:
        from triton.experimental.gluon._runtime import GluonASTSource
    except ImportError:
        pytest.skip("this Triton has no Gluon")
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget

    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if sig[n].startswith("*") or n in divisible}
    src = GluonASTSource(fn=fn, signature=sig, attrs=attrs, constexprs=constexprs)
    try:
        return triton_compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    except RuntimeError as e:  # no ptxas usable here
        if "ptxas" in str(e).lower():
            pytest.skip(f"no ptxas: {e}")
        raise


def sm90_sass(k, triton_version: str | None = None):
    """(SASS text, registers a thread) of compiled kernel ``k``'s cubin, from the installed Triton's own nvdisasm and
    cuobjdump; None where the tools are missing, or where ``triton_version`` is given and the installed Triton's
    version does not start with it (register and spill checks that hold for the Triton a kernel was measured with)."""
    import triton

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    nvdisasm, cuobjdump = os.path.join(bin_dir, "nvdisasm"), os.path.join(bin_dir, "cuobjdump")
    if triton_version is not None and not triton.__version__.startswith(triton_version):
        return None
    if not (os.path.exists(nvdisasm) and os.path.exists(cuobjdump)):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return sass, int(re.search(r"REG:(\d+)", res).group(1))


def rowcol_regs_signature(x: str = "bf16", num_warps: int = 8, lanes_c: int = 8, **const):
    """(sig, constexprs) of quant_gluon.rowcol_1x128_regs for compile_gluon_sm90: every parameter in order, x of
    type ``x``, E4M3 pow2 outputs, the layouts of ``num_warps`` / ``lanes_c``, no prologue; ``const`` overrides
    constexpr values. A prologue's pointer and run-time parameters stay constexpr None / placeholders here: a test
    that compiles one sets their types in ``sig`` and drops them from the constexprs."""
    from lowbit.quant.kernels import quant_gluon as QG

    sig = dict(x_ptr="*" + x, rq_ptr="*fp8e4nv", rs_ptr="*fp32", cq_ptr="*fp8e4nv", cs_ptr="*fp32", amax_ptr="*i32",
               M="i32", K="i32", rs_ld="i32", cs_ld="i32", FMAX="constexpr", POW2="constexpr", EPS="constexpr",
               A="constexpr", B="constexpr", T="constexpr", COMPACT="constexpr", NORM="constexpr",
               SWIGLU="constexpr", abs_mask="i32", rstd_ptr="constexpr", nw_ptr="constexpr", SWIGLU_BWD="constexpr",
               g_ptr="constexpr", H="constexpr", ROPE_BWD="constexpr", gv_ptr="constexpr", cos_ptr="constexpr",
               sin_ptr="constexpr", rope_T="constexpr", tab_row="constexpr", HD="constexpr", DH="constexpr",
               AW="constexpr")
    consts = dict(FMAX=448.0, POW2=True, EPS=0.0, COMPACT=True, NORM=False, SWIGLU=False, rstd_ptr=None, nw_ptr=None,
                  SWIGLU_BWD=False, g_ptr=None, H=None, ROPE_BWD=False, gv_ptr=None, cos_ptr=None, sin_ptr=None,
                  rope_T=1, tab_row=0, HD=0, DH=None, AW=None,
                  **dict(zip("ABT", QG.rowcol_regs_layouts(num_warps, lanes_c))))
    consts.update(const)
    return sig, consts
