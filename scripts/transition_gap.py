"""The idle time between two kernels in a CUDA graph, by producer and consumer (issue 7 diagnostic, session 29).

The 1.3b fp8-block step's trace (`LOWBIT_PROFILE_TRACE=1`) shows ~9 us of idle GPU before each cuBLAS / cuDNN kernel
that follows a Triton kernel, and 0.3-0.6 us between every other pair. This script captures R repetitions of
[producer; consumer] in one CUDA graph, replays it under torch.profiler, and prints the median gap (consumer start
minus producer end, :func:`lowbit.train.graph_profile.transition_gaps`) for each pair of kernel families that
follow each other. Producers: cuBLAS FP8 blockwise, a
Triton copy kernel with the whole L1 preferred as shared memory, a torch elementwise kernel, a plain Triton copy
kernel, the same kernel ending in ``griddepcontrol.launch_dependents`` (the PDL trigger), lowbit's 1x128 quantizer.
Consumers: cuBLAS FP8 blockwise, cuBLAS BF16, cuDNN attention, torch elementwise, the Triton copy.

H200, 2026-11-25 (BENCHMARKS.md session 29): 3.6-5.0 us before every cuBLAS / cuDNN kernel whatever the producer
(cuBLAS included), 0.3-0.6 us before a Triton or torch elementwise kernel.

    PYTHONPATH=src python scripts/transition_gap.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from lowbit import quantize  # noqa: E402
from lowbit.bench import capture  # noqa: E402
from lowbit.quant import Float8Blockwise  # noqa: E402
from lowbit.train.graph_profile import kernel_trace, transition_gaps  # noqa: E402


@triton.jit
def _copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr, TRIGGER: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)
    if TRIGGER:
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _copy2(x_ptr, y_ptr, n, BLOCK: tl.constexpr, TRIGGER: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def main() -> int:
    dev = torch.device("cuda")
    R = 20
    M, K, N = 8192, 2048, 2048
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
    qa = quantize(x, Float8Blockwise())
    qb = quantize(w, Float8Blockwise(block_dim=2))
    sa, sb = qa.logical_scales(), qb.logical_scales()
    q = torch.randn(4, 16, 2048, 128, device=dev, dtype=torch.bfloat16)
    n = x.numel()

    def tcopy(trigger=False):
        _copy[(triton.cdiv(n, 4096),)](x, y, n, BLOCK=4096, TRIGGER=trigger, num_warps=4)

    fp8 = lambda: F.scaled_mm(qa.rowwise.data, qb.rowwise.data.t(), sa, F.ScalingType.BlockWise1x128,  # noqa: E731
                              sb.t(), F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
    # the same copy kernel, compiled under another name, with the whole L1 preferred as shared memory
    ck = _copy2[(triton.cdiv(n, 4096),)](x, y, n, BLOCK=4096, TRIGGER=False, num_warps=4)
    import ctypes

    lib = ctypes.CDLL("libcuda.so.1")
    rc = lib.cuFuncSetAttribute(ctypes.c_void_p(int(ck.function)), 9, 100)
    print(f"cuFuncSetAttribute(PREFERRED_SHARED_MEMORY_CARVEOUT, 100) -> {rc}")
    producers = {
        "cuBLAS FP8 blockwise": fp8,
        "triton copy, carveout 100": lambda: _copy2[(triton.cdiv(n, 4096),)](x, y, n, BLOCK=4096, TRIGGER=False,
                                                                              num_warps=4),
        "torch elementwise": lambda: y.mul_(1.0),
        "triton copy": lambda: tcopy(False),
        "triton copy + PDL trigger": lambda: tcopy(True),
        "lowbit 1x128 quantize": lambda: quantize(x, Float8Blockwise(), rowwise=True, columnwise=True),
    }
    consumers = {
        "cuBLAS FP8 blockwise": fp8,
        "cuBLAS BF16": lambda: torch.mm(x, w.t()),
        "cuDNN attention": lambda: _sdpa(q),
        "torch elementwise": lambda: y.mul_(1.0),
        "triton copy": lambda: tcopy(False),
    }
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"{'producer':28s} {'consumer':22s} idle before the next kernel")
    for pn, pf in producers.items():
        for cn, cf in consumers.items():
            def body():
                for _ in range(R):
                    pf()
                    cf()
            g = capture(body)
            g.replay()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                g.replay()
                torch.cuda.synchronize()
            # the whole GPU's idle time by the families of the kernels around it (one stream here: each gap is
            # between two consecutive kernels); the producer -> consumer rows and back
            for t in transition_gaps(kernel_trace(prof)):
                if t["count"] >= R // 2:
                    print(f"{pn:28s} {cn:22s} {t['median_us']:6.2f} us median, {t['total_us'] / t['count']:6.2f} mean   "
                          f"{t['from']} -> {t['to']} ({t['count']})", flush=True)
    return 0


def _sdpa(q):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)


if __name__ == "__main__":
    raise SystemExit(main())
