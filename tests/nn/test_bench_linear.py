"""The Linear benchmark runs end to end (CPU smoke test with tiny shapes; timings are meaningless here)."""

import pytest

from lowbit.bench import linear


def test_bench_linear_cpu_smoke(capsys):
    rc = linear.main(["--device", "cpu", "--shapes", "64x64x32", "--recipes", "bf16,fp8-current,nvfp4", "--rep", "1",
                      "--warmup", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "| lowbit fp8-current |" in out and "| lowbit nvfp4 |" in out and "torch.nn.Linear bfloat16" in out
    assert "host × BF16" in out


def test_bench_linear_bad_args():
    with pytest.raises(SystemExit):
        linear.main(["--shapes", "64x64"])
    with pytest.raises(SystemExit):
        linear.main(["--recipes", "fp4"])


def test_host_ms_counts_each_call():
    """host_ms is the mean enqueue time of one call: a function that sleeps 2 ms measures about 2 ms."""
    import time

    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.002)

    ms = linear.host_ms(fn, n=10)
    assert len(calls) == 13  # three warm-up calls, then ten timed
    assert 1.9 < ms < 10.0
