"""step_profile: the split of a step's wall time into compute, communication (exposed) and host time, from
synthetic chrome-trace events (CUDA kernels; the CPU's ATen ops and gloo work), and the loop's opt-in profiler."""

import pytest

from lowbit.train.loop import TrainConfig, train
from lowbit.train.step_profile import (
    FAMILY_CHARS,
    MARKER,
    TOP_GAPS,
    TOP_KERNELS,
    collective_kind,
    kernel_family,
    merge,
    split_step,
    split_trace,
    uncovered,
)


def _ev(name, ts, dur, cat="kernel", tid=1):
    return {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "tid": tid}


def test_merge_and_uncovered():
    a = merge([(5, 7), (0, 2), (1, 3), (6, 9)])
    assert a == [(0, 3), (5, 9)]
    b = merge([(2, 6), (8, 20)])
    assert uncovered(a, b) == pytest.approx(2 + 2)  # [0, 2) and [6, 8)
    assert uncovered(a, []) == 7 and uncovered([], b) == 0
    assert uncovered(b, a) == pytest.approx(2 + 11)  # [3, 5) and [9, 20)


@pytest.mark.parametrize("name, kind", [
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all_gather"),
    ("ncclKernel_ReduceScatter_RING_LL_Sum_float", "reduce_scatter"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "all_reduce"),
    ("gloo:all_gather", "all_gather"),
    ("gloo:all_reduce", "all_reduce"),
    ("void at::native::vectorized_elementwise_kernel<4>", None),
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT", None),
])
def test_collective_kind(name, kind):
    assert collective_kind(name) == kind


def test_split_cuda_step():
    # step 0..100 us; compute kernels [10, 40) and [50, 60); an all-gather [30, 55) (15 us hidden, 10 exposed) and a
    # reduce-scatter [70, 80) (exposed); a kernel outside the step is left out
    events = [_ev(MARKER, 0, 100, cat="user_annotation"), _ev("gemm", 10, 30), _ev("quantize", 50, 10),
              _ev("ncclDevKernel_AllGather_RING_LL", 30, 25), _ev("ncclDevKernel_ReduceScatter_Sum", 70, 10),
              _ev("gemm", 120, 10), _ev("aten::mm", 0, 100, cat="cpu_op")]
    # (the profiler draws the step's range on the GPU's timeline too: not a step of its own)
    events.append(_ev(MARKER, 3, 90, cat="gpu_user_annotation", tid=7))
    (r,) = split_trace(events, "cuda")
    assert r["wall_ms"] == pytest.approx(0.1)
    assert r["compute_ms"] == pytest.approx(0.040)
    assert r["concurrent_ms"] == pytest.approx(0.0)  # (one compute kernel at a time)
    assert r["comm_ms"] == pytest.approx(0.035)
    assert r["exposed_comm_ms"] == pytest.approx(0.020)  # [40, 50) and [70, 80)
    assert r["host_ms"] == pytest.approx(0.040)  # [0, 10), [60, 70), [80, 100)
    assert r["wall_ms"] == pytest.approx(r["compute_ms"] + r["exposed_comm_ms"] + r["host_ms"])
    assert r["comm_kinds_ms"] == pytest.approx({"all_gather": 0.025, "reduce_scatter": 0.010})
    # per kernel family, inside the step only (the second gemm is outside), most time first
    assert list(r["kernels_ms"]) == ["gemm", "ncclDevKernel_AllGather_RING_LL", "quantize",
                                     "ncclDevKernel_ReduceScatter_Sum"]
    assert r["kernels_ms"]["gemm"] == pytest.approx(0.030) and r["kernels_ms"]["quantize"] == pytest.approx(0.010)


def test_idle_gaps_by_the_kernels_around_them():
    # step [0, 100): gemm [10, 40), a concurrent kernel [20, 50), an all-reduce [60, 65), another [70, 75), gemm
    # [90, 95): idle [0, 10), [50, 60) after the concurrent one, [65, 70) and [75, 90) between collectives and
    # gemm, [95, 100) at the end
    events = [_ev(MARKER, 0, 100, cat="user_annotation"), _ev("gemm", 10, 30), _ev("side", 20, 30, tid=2),
              _ev("ncclDevKernel_AllReduce", 60, 5), _ev("ncclDevKernel_AllReduce", 70, 5), _ev("gemm", 90, 5)]
    (r,) = split_trace(events, "cuda")
    idle = {k: (round(v[0], 9), v[1]) for k, v in r["idle"].items()}
    assert idle == {"ncclDevKernel_AllReduce | gemm": (0.015, 1), "<step start> | gemm": (0.010, 1),
                    "side | ncclDevKernel_AllReduce": (0.010, 1),
                    "ncclDevKernel_AllReduce | ncclDevKernel_AllReduce": (0.005, 1), "gemm | <step end>": (0.005, 1)}
    assert list(idle)[0] == "ncclDevKernel_AllReduce | gemm"  # (the largest first)
    assert sum(v[0] for v in idle.values()) == pytest.approx(r["host_ms"])
    # the mean over steps: per step, pairs of either step
    from lowbit.train.step_profile import _mean

    other = dict(r, idle={"gemm | <step end>": (0.025, 3)})
    m = _mean([r, other])
    assert tuple(m["idle"]["gemm | <step end>"]) == pytest.approx((0.015, 2))
    assert tuple(m["idle"]["<step start> | gemm"]) == pytest.approx((0.005, 0.5))
    # a step of many gaps keeps the largest TOP_GAPS pairs
    many = [_ev(MARKER, 0, 10_000, cat="user_annotation")] + [_ev(f"k{i}", 100 * i, 100 - i) for i in range(40)]
    (r2,) = split_trace(many, "cuda")
    assert len(r2["idle"]) == TOP_GAPS and next(iter(r2["idle"])) == "k39 | <step end>"


def test_kernels_per_family_sum_overlaps_and_keep_the_top():
    # two kernels on concurrent streams both count; a kernel clipped by the step's end counts its
    # part inside; only the TOP_KERNELS most expensive families are kept
    events = [_ev(MARKER, 0, 1000, cat="user_annotation"),
              _ev("void at::native::elementwise_kernel<128, 2, Lambda<float>>(int, Lambda<float>)", 0, 40),
              _ev("void at::native::elementwise_kernel<128, 4, Lambda<c10::BFloat16>>(int)", 20, 40, tid=2),
              _ev("nvjet_tst_128x256", 980, 50)]
    events += [_ev(f"k{i}", 100 + i, 1) for i in range(TOP_KERNELS + 5)]
    (r,) = split_trace(events, "cuda")
    k = r["kernels_ms"]
    assert len(k) == TOP_KERNELS
    assert k["at::native::elementwise_kernel<128, 2, Lambda<float>>"] == pytest.approx(0.040)
    assert k["at::native::elementwise_kernel<128, 4, Lambda<c10::BFloat16>>"] == pytest.approx(0.040)
    assert k["nvjet_tst_128x256"] == pytest.approx(0.020)
    assert r["compute_ms"] == pytest.approx(0.060 + 0.020 + 0.001 * (TOP_KERNELS + 5))
    # [20, 40): the two elementwise kernels ran beside each other
    assert r["concurrent_ms"] == pytest.approx(0.020)


def test_concurrent_time_and_its_mean():
    """concurrent: compute kernels' summed time minus compute (three at once count twice over their shared time);
    collectives beside compute are not counted (comm's hidden share says that); None on the CPU and in a mean with a
    CPU step."""
    from lowbit.train.step_profile import _mean

    events = [_ev(MARKER, 0, 100, cat="user_annotation"), _ev("gemm", 0, 50), _ev("wgrad", 10, 20, tid=2),
              _ev("q", 15, 10, tid=3), _ev("ncclDevKernel_ReduceScatter_Sum", 0, 60, tid=4)]
    (r,) = split_trace(events, "cuda")
    assert r["compute_ms"] == pytest.approx(0.050) and r["concurrent_ms"] == pytest.approx(0.030)
    cpu = split_step([_ev(MARKER, 0, 10, cat="user_annotation"), _ev("aten::mm", 0, 5, "cpu_op")],
                     _ev(MARKER, 0, 10, cat="user_annotation"), "cpu")
    assert cpu["concurrent_ms"] is None
    assert _mean([r, dict(r, concurrent_ms=0.010)])["concurrent_ms"] == pytest.approx(0.020)
    assert _mean([r, cpu])["concurrent_ms"] is None


LONG = "sm90_xmma_gemm_e4m3e4m3_bf16f32_f32_tn_n_tilesize128x128x128_warpgroupsize2x1x1_execute_segment_k_off" * 2


@pytest.mark.parametrize("name, family", [
    ("void at::native::vectorized_elementwise_kernel<4, at::native::AbsFunctor<float>>(int, float*)",
     "at::native::vectorized_elementwise_kernel<4, at::native::AbsFunctor<float>>"),
    ("_quantize_rowwise_kernel", "_quantize_rowwise_kernel"),
    (LONG + "__5x_cublas", LONG[:FAMILY_CHARS]),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4>>(int, float)",
     "at::native::multi_tensor_apply_kernel<at::native::TensorListMetadata<4>, at::native::FusedAdamMathFunctor<float, "
     "4>>"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "ncclDevKernel_AllGather_RING_LL"),
])
def test_kernel_family(name, family):
    assert kernel_family(name) == family


def test_split_cpu_step():
    # the step thread (tid 1): ATen ops [0, 30) (nested [5, 10)) and [60, 70); gloo's thread: an all-reduce [20, 80)
    events = [_ev(MARKER, 0, 100, cat="user_annotation", tid=1), _ev("aten::mm", 0, 30, "cpu_op"),
              _ev("aten::add", 5, 5, "cpu_op"), _ev("aten::mul", 60, 10, "cpu_op"),
              _ev("aten::mm", 0, 50, "cpu_op", tid=7),  # another thread's op: not this step's compute
              _ev("FSDP::all_gather", 0, 90, "user_annotation"), _ev("gloo:all_reduce", 20, 60, "user_annotation", 9)]
    r = split_step(events, events[0], "cpu")
    assert r["compute_ms"] == pytest.approx(0.040)
    assert r["comm_ms"] == pytest.approx(0.060) and r["exposed_comm_ms"] == pytest.approx(0.040)  # [30, 60), [70, 80)
    assert r["host_ms"] == pytest.approx(0.020)  # [80, 100)


def test_step_profile_in_summary(tmp_path, small_text, cache_dir):
    """One process on the CPU: steps 3 and 4 of 5 profiled (step 2 warms the profiler up), left out of tokens/s."""
    s = train(TrainConfig(recipe="fp8-block", steps=5, seq_len=64, batch_size=2, data=small_text, cache_dir=cache_dir,
                          eval_every=5, eval_windows=2, progress=False, verbose=False, device="cpu",
                          out_dir=str(tmp_path), step_profile=2, save_final=False))
    sp = s["step_profile"]
    assert sp["steps"] == [3, 4] and len(sp["ranks"]) == 1
    m = sp["mean"]
    assert m["wall_ms"] > 0 and m["compute_ms"] > 0 and m["comm_ms"] == 0 and m["overlap_pct"] is None
    assert m["wall_ms"] == pytest.approx(m["compute_ms"] + m["exposed_comm_ms"] + m["host_ms"])
    assert len(sp["ranks"][0]["per_step"]) == 2
    assert m["kernels_ms"] == {} and m["idle"] == {}  # (per kernel on CUDA only)
    assert s["tokens_per_s"] > 0  # (step 5 alone was timed: step 1 warms up, 2 the profiler)
    short = train(TrainConfig(recipe="bf16", steps=3, seq_len=64, batch_size=2, data=small_text, cache_dir=cache_dir,
                              eval_every=3, eval_windows=2, progress=False, verbose=False, device="cpu",
                              out_dir=str(tmp_path / "short"), step_profile=2, save_final=False))
    assert "needs 4 steps" in short["step_profile"]["ranks"][0]["skipped"]
    assert short["step_profile"]["mean"] is None
    with pytest.raises(ValueError, match="step_profile"):
        TrainConfig(step_profile=-1).validate()
