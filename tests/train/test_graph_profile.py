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
