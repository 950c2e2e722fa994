"""graph_profile.summarize: busy / idle split of a kernel timeline (CPU)."""
from lowbit.train.graph_profile import summarize


def test_summarize_splits_busy_and_idle():
    # kernels at [0, 10], [12, 20] (gap 2), [15, 25] overlapping the previous one, [30, 31] (gap 5)
    ks = [(0.0, 10.0, "a"), (12.0, 20.0, "b"), (15.0, 25.0, "a"), (30.0, 31.0, "c")]
    s = summarize(ks)
    assert s["kernels"] == 4
    assert s["span_us"] == 31.0
    assert s["busy_us"] == 10.0 + 13.0 + 1.0
    assert s["idle_us"] == 7.0 and s["gaps"] == 2
    assert s["kernel_sum_us"] == 10 + 8 + 10 + 1
    assert s["top"][0] == {"name": "a", "us": 20.0, "calls": 2}
    assert summarize([]) == {"kernels": 0}


def test_kernels_raw_rows_from_the_chrome_trace():
    """_kernels(prof, raw): the kernel events only, by start time, as [start, duration, stream, grid, name]."""
    import json

    from lowbit.train.graph_profile import _kernels

    events = [
        {"cat": "kernel", "ts": 20.0, "dur": 5.0, "name": "nvjet_gemm", "args": {"stream": 7, "grid": [2, 66, 1]}},
        {"cat": "cpu_op", "ts": 1.0, "dur": 50.0, "name": "aten::mm"},
        {"cat": "kernel", "ts": 10.0, "dur": 3.0, "name": "rowcol_1x128_regs", "args": {"stream": 7,
                                                                                        "grid": [1024, 1, 1]}},
    ]

    class Prof:
        def export_chrome_trace(self, path):
            with open(path, "w") as f:
                json.dump({"traceEvents": events}, f)

    raw = []
    ks = _kernels(Prof(), raw)
    assert ks == [(10.0, 13.0, "rowcol_1x128_regs"), (20.0, 25.0, "nvjet_gemm")]
    assert raw == [[10.0, 3.0, 7, [1024, 1, 1], "rowcol_1x128_regs"], [20.0, 5.0, 7, [2, 66, 1], "nvjet_gemm"]]


def test_transition_gaps_whole_gpu_idle_by_family():
    from lowbit.train.graph_profile import kernel_family, transition_gaps

    assert kernel_family("nvjet_sm90_qqtst_128x128") == "cublas"
    assert kernel_family("cudnn_generated_fort_native_sdpa") == "cudnn"
    assert kernel_family("lowbit_fp8_gemm_1x128_128x128_sm90") == "cuda:lowbit_fp8_gemm_1x128_128x128_sm90"
    assert kernel_family("void deep_gemm::sm90_fp8_gemm_1d2d_impl<0u, 2048u, 128u>(float*, int*)") == "deepgemm"
    assert kernel_family("void at::native::vectorized_elementwise_kernel<4>") == "torch"
    assert kernel_family("rowcol_1x128_regs") == "triton:rowcol_1x128_regs"
    trace = [  # stream 7: quant [0, 10] -> gemm [19, 39] (idle 9) -> quant [40, 45] (idle 1) -> gemm [53, 60] (idle 8)
        [0.0, 10.0, 7, None, "rowcol_1x128_regs"], [19.0, 20.0, 7, None, "nvjet_a"],
        [40.0, 5.0, 7, None, "rowcol_1x128_regs"], [53.0, 7.0, 7, None, "nvjet_b"],
        # stream 9: a GEMM covering [44, 50] (the 45-53 gap shrinks to 50-53, after it), then one after a 10 us gap
        [44.0, 6.0, 9, None, "nvjet_w"], [70.0, 1.0, 9, None, "_column_sum_kernel"],
    ]
    t = transition_gaps(trace)
    assert t[0] == {"from": "cublas", "to": "triton:_column_sum_kernel", "count": 1, "total_us": 10.0,
                    "median_us": 10.0}
    assert {"from": "triton:rowcol_1x128_regs", "to": "cublas", "count": 1, "total_us": 9.0, "median_us": 9.0} in t
    assert {"from": "cublas", "to": "triton:rowcol_1x128_regs", "count": 1, "total_us": 1.0, "median_us": 1.0} in t
    assert {"from": "cublas", "to": "cublas", "count": 1, "total_us": 3.0, "median_us": 3.0} in t
    assert len(t) == 4 and transition_gaps([]) == []
