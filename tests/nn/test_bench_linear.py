"""The Linear benchmark runs end to end (CPU smoke test with tiny shapes; timings are meaningless here)."""

import pytest

from lowbit.bench import linear


def test_bench_linear_cpu_smoke(capsys):
    rc = linear.main(["--device", "cpu", "--shapes", "64x64x32", "--recipes", "bf16,fp8-current,nvfp4", "--rep", "1",
                      "--warmup", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "| lowbit fp8-current |" in out and "| lowbit nvfp4 |" in out and "torch.nn.Linear bfloat16" in out


def test_bench_linear_bad_args():
    with pytest.raises(SystemExit):
        linear.main(["--shapes", "64x64"])
    with pytest.raises(SystemExit):
        linear.main(["--recipes", "fp4"])
