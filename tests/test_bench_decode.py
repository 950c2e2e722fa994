"""``lowbit bench decode``: argument rules, and the code path on the CPU (a tiny model, eager variants)."""
import pytest

pytest.importorskip("transformers")

from lowbit.bench import decode  # noqa: E402


@pytest.mark.parametrize("argv,msg", [
    (["--device", "cpu", "--variants", "fp9"], "--variants: expected <recipe>\\[:compiled\\] .* got 'fp9'"),
    (["--device", "cpu", "--variants", "fp8-block:fused"], "got 'fp8-block:fused'"),
    (["--device", "cpu", "--variants", "bf16:compiled"], "compiles CUDA graphs; on the CPU only eager"),
    (["--device", "cpu", "--size", "1b"], "--size: on the CPU only 'tiny' runs"),
    (["--device", "cpu", "--new", "0"], "--new: must be at least 1, got 0"),
    (["--device", "cpu", "--variants", " , "], "--variants: no variant named"),
])
def test_bad_arguments_name_the_rule(argv, msg, capsys):
    with pytest.raises(ValueError, match=msg):
        decode.resolve(decode.parse_args(argv))
    assert decode.main(argv) == 2
    assert f"{decode.PROG}: error: --" in capsys.readouterr().err


def test_runs_on_the_cpu(capsys):
    """BF16 and fp8-block eager on the tiny model: both rows ok, the FP8 one against BF16's, its decode steps taking
    the weights the first call's prefill kept."""
    assert decode.main(["--device", "cpu", "--prompt", "8", "--new", "3", "--reps", "1", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| bf16 |") or line.startswith("| fp8-block |")]
    assert len(rows) == 2, out
    cells = rows[1].split("|")
    assert float(cells[3]) > 0 and cells[4].strip().endswith("%") and int(cells[5]) > 0, rows[1]
