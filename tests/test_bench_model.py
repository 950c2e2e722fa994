"""``lowbit bench model`` on the CPU: the smoke run end to end through the CLI, and bad input."""

import json
import math
import re

import pytest

pytest.importorskip("transformers")

from lowbit.cli import main  # noqa: E402


def test_smoke_run_end_to_end(tmp_path, capsys):
    out = tmp_path / "model.md"
    rc = main(["bench", "model", "--device", "cpu", "--recipes", "fp8-current,fp8-block", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    for v in ("bf16", "bf16-compile", "fp8-current", "fp8-current-compile", "fp8-block", "fp8-block-compile",
              "torchao-compile"):
        assert f"| {v} |" in text, v
    assert "[bench model] fp8-block: step 3/3" in text
    assert "x bf16 | x bf16-compile" in text
    assert out.read_text().startswith("## lowbit bench model")
    data = json.loads((tmp_path / "model.md.json").read_text())
    rows = {r["variant"]: r for r in data["rows"]}
    assert rows["bf16-compile"]["status"].startswith("skipped:")  # compile is off on CPU by default
    assert rows["torchao-compile"]["status"].startswith("skipped:")
    initial = math.log(data["config"]["model"]["vocab"])  # the loss of a random-init model ~ log(vocab)
    ref = rows["bf16"]
    assert ref["status"] == "ok" and math.isfinite(ref["loss"]) and ref["loss"] < initial - 0.1
    for v in ("fp8-current", "fp8-block"):
        r = rows[v]
        assert r["status"] == "ok", r["status"]
        assert math.isfinite(r["loss"]) and r["loss"] < initial - 0.1
        assert abs(r["loss"] - ref["loss"]) / ref["loss"] < 0.1  # FP8 tracks BF16 after the same steps
        assert r["tokens_per_s"] > 0 and r["host_ms"] <= r["step_ms"] + 1e-6
        assert r["x_bf16"] == pytest.approx(r["tokens_per_s"] / ref["tokens_per_s"])


def test_failed_variant_is_a_row_not_a_crash(capsys, monkeypatch):
    from lowbit.bench import model as bm

    def broken(*a, **k):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(bm, "build_model", broken)
    rc = main(["bench", "model", "--device", "cpu", "--variants", "bf16", "--steps", "2"])
    text = capsys.readouterr().out
    assert rc == 0
    assert "| bf16 | failed: RuntimeError: boom |" in text
    assert "second line" not in text


def test_variant_failing_mid_rounds_is_a_row_and_the_others_finish(capsys, monkeypatch):
    """--rounds: a variant that raises in its second round is a failed row (its model freed); the other variant
    still times every step."""
    import lowbit.nn

    real, calls = lowbit.nn.autocast, []

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == 3:  # (fp8-current's warm-up step, then its first round's step, then this)
            raise RuntimeError("mid-run fault")
        return real(*a, **k)

    monkeypatch.setattr(lowbit.nn, "autocast", flaky)
    rc = main(["bench", "model", "--device", "cpu", "--variants", "fp8-current,bf16", "--steps", "4", "--warmup", "1",
               "--rounds", "3"])
    text = capsys.readouterr().out
    assert rc == 0 and "| fp8-current | failed: RuntimeError: mid-run fault |" in text
    assert re.search(r"\| bf16 \| [\d,]+ \|", text) and "bf16: step 4/4" in text
    assert "fp8-current: step 3/4" not in text


def test_on_nonfinite_reaches_the_lowbit_variants(capsys, monkeypatch):
    """--on-nonfinite is the policy the lowbit variants' autocast gets, and the table's header names it."""
    import lowbit.nn

    policies = []
    real = lowbit.nn.autocast

    def spy(*a, **k):
        policies.append(k.get("on_nonfinite"))
        return real(*a, **k)

    monkeypatch.setattr(lowbit.nn, "autocast", spy)
    rc = main(["bench", "model", "--device", "cpu", "--variants", "bf16,fp8-current", "--steps", "2",
               "--on-nonfinite", "off"])
    text = capsys.readouterr().out
    assert rc == 0 and "| fp8-current |" in text and "on_nonfinite='off'" in text
    assert policies == ["off", "off"]  # (one autocast a step of the lowbit variant; none for bf16)


def test_fuse_flags_reach_convert(capsys, monkeypatch):
    """--fuse-mlp / --fuse-qkv convert the lowbit variants with fuse_mlp / fuse_qkv (their MLPs SwiGLUMLPs with the
    norm moved in, their attentions' projections QKVLinears), and the header says so; without them convert's
    defaults."""
    import lowbit.nn

    seen = []
    real = lowbit.nn.convert

    def spy(model, *a, **k):
        s = real(model, *a, **k)
        seen.append((k.get("fuse_mlp"), k.get("fuse_qkv"),
                     sum(isinstance(m, lowbit.nn.SwiGLUMLP) and m.norm is not None for m in model.modules()),
                     sum(isinstance(m, lowbit.nn.QKVLinear) for m in model.modules())))
        return s

    monkeypatch.setattr(lowbit.nn, "convert", spy)
    for flags in ([], ["--fuse-mlp"], ["--fuse-qkv"]):
        rc = main(["bench", "model", "--device", "cpu", "--variants", "fp8-current", "--steps", "2", *flags])
        text = capsys.readouterr().out
        assert rc == 0 and "| fp8-current |" in text
        assert f"fuse_mlp={'--fuse-mlp' in flags}, fuse_qkv={'--fuse-qkv' in flags}" in text
    assert seen[0] == (False, False, 0, 0)
    assert seen[1][:2] == (True, False) and seen[1][2] > 0 and seen[1][3] == 0
    assert seen[2][:2] == (False, True) and seen[2][2] == 0 and seen[2][3] > 0


def test_rounds_alternate_the_variants(capsys):
    """--rounds: every variant warms up first, then the timed steps alternate between them round by round; every
    variant still times all of its steps, and the header says so."""
    rc = main(["bench", "model", "--device", "cpu", "--variants", "bf16,fp8-current", "--steps", "4", "--warmup", "1",
               "--rounds", "2"])
    text = capsys.readouterr().out
    assert rc == 0 and "| bf16 |" in text and "| fp8-current |" in text and "failed" not in text
    order = [(m.group(1), int(m.group(2))) for m in re.finditer(r"\] (\S+): step (\d+)/4", text)]
    assert order == [("bf16", 1), ("fp8-current", 1), ("bf16", 2), ("bf16", 3), ("fp8-current", 2),
                     ("fp8-current", 3), ("bf16", 4), ("fp8-current", 4)], order
    assert "(timed in 2 rounds alternating between the variants)" in text


@pytest.mark.parametrize("static", [False, True])
def test_header_names_inductors_launcher_for_user_kernels(static):
    """The header says whether Inductor launches lowbit's quantizer kernel statically (it moves the compiled rows'
    host time)."""
    from torch._inductor import config

    import lowbit.bench.model as bm

    cfg = bm.resolve(bm.parse_args(["--device", "cpu", "--variants", "bf16"]))
    with config.patch(use_static_cuda_launcher=True, static_launch_user_defined_triton_kernels=static):
        text = bm.header(cfg)
    assert text.endswith(f"Inductor's static launcher for user Triton kernels: {'on' if static else 'off'}")


@pytest.mark.parametrize("args, msg", [
    (["--variants", "bf16,fp9"], "unknown variant 'fp9'"),
    (["--recipes", "fp8-nope"], "unknown recipe 'fp8-nope'"),
    (["--batch", "0"], "--batch: expected an integer >= 1"),
    (["--seq", "-4"], "--seq: expected an integer >= 1"),
    (["--layers", "0"], "--layers: expected an integer >= 1"),
    (["--steps", "3", "--warmup", "3"], "--warmup"),
    (["--on-nonfinite", "warn"], "--on-nonfinite: expected one of raise, skip, ignore, off, got 'warn'"),
    (["--rounds", "0"], "--rounds: expected 1 <= rounds <= the timed steps"),
    (["--steps", "3", "--warmup", "1", "--rounds", "3"], "--rounds: expected 1 <= rounds <= the timed steps (2)"),
])
def test_bad_input_exits_2_with_one_line(args, msg, capsys):
    rc = main(["bench", "model", "--device", "cpu", *args])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("lowbit bench model: error: ") and msg in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_isolated_variants_run_in_their_own_processes(tmp_path, capsys):
    """--isolate: each variant runs in a fresh process of its own; its progress comes through, its row is the table's
    and the ratios are taken across the processes; the header says so. The same seed gives the same loss as in one
    process."""
    import lowbit.bench.model as bm

    rc = main(["bench", "model", "--device", "cpu", "--variants", "bf16,fp8-current", "--steps", "2", "--isolate",
               "--out", str(tmp_path / "m.md")])
    text = capsys.readouterr().out
    assert rc == 0 and "each variant in its own process" in text
    assert "[bench model] fp8-current: step 2/2" in text and bm.ROW_PREFIX not in text
    rows = {r["variant"]: r for r in json.loads((tmp_path / "m.md.json").read_text())["rows"]}
    assert rows["bf16"]["status"] == "ok" and rows["fp8-current"]["status"] == "ok"
    assert rows["fp8-current"]["x_bf16"] == pytest.approx(rows["fp8-current"]["tokens_per_s"] /
                                                          rows["bf16"]["tokens_per_s"])
    cfg = bm.resolve(bm.parse_args(["--device", "cpu", "--variants", "bf16", "--steps", "2"]))
    assert not cfg["isolate"]  # (the CPU default)
    assert bm.run(cfg, log=lambda s: None)[0]["loss"] == rows["bf16"]["loss"]


def test_isolated_variant_whose_process_dies_is_a_failed_row():
    """A variant process that ends without its row (here: a variant name its process cannot build) is a failed row
    naming the exit status and the process's last line."""
    import lowbit.bench.model as bm

    cfg = bm.resolve(bm.parse_args(["--device", "cpu", "--variants", "bf16", "--steps", "2"]))
    lines = []
    row = bm._run_in_process(cfg, "fp9", lines.append)
    assert row["variant"] == "fp9" and row["status"].startswith("failed: the variant's process exited with status 1:")
    assert "fp9" in row["status"] and lines  # (its traceback came through the log)


def test_isolate_with_rounds_is_bad_input(capsys):
    rc = main(["bench", "model", "--device", "cpu", "--isolate", "--rounds", "2", "--steps", "4", "--warmup", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "--isolate: the variants of --rounds 2 alternate in one process" in err


def test_compile_static_variant_starts_its_process_with_the_static_launcher(monkeypatch):
    """A -compile-static variant's own process starts with Inductor's static launcher for user Triton kernels in its
    environment (read when Inductor is imported); other variants' processes do not; without --isolate it is bad
    input, and the header names the variants that have it."""
    import io
    import os
    import subprocess

    import lowbit.bench.model as bm

    envs = {}

    class Stdin(io.StringIO):  # (on close: the variant's config is in; its process answers with a row at once)
        def __init__(self, proc):
            super().__init__()
            self.proc = proc

        def close(self):
            name = json.loads(self.getvalue())["variants"][0]
            envs[name] = self.proc.env
            self.proc.stdout = iter([bm.ROW_PREFIX + json.dumps(dict(variant=name, status="skipped: fake")) + "\n"])
            super().close()

    class FakePopen:  # (records the environment a variant's process would start with)
        def __init__(self, cmd, *, env, **kw):
            self.env, self.stdin, self.stdout = env, Stdin(self), None

        def wait(self):
            return 0

    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    cfg = bm.resolve(bm.parse_args(["--device", "cpu", "--compile-on-cpu", "--isolate", "--steps", "2",
                                    "--variants", "fp8-block-compile,fp8-block-compile-static"]))
    rows = bm.run(cfg, log=lambda s: None)
    assert [r["variant"] for r in rows] == ["fp8-block-compile", "fp8-block-compile-static"]
    key = "TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS"
    assert envs["fp8-block-compile-static"][key] == "1"
    assert envs["fp8-block-compile"].get(key) == os.environ.get(key)
    assert "(on in the -compile-static variants' processes)" in bm.header(cfg)
    with pytest.raises(ValueError, match="fp8-block-compile-static runs in a process of its own"):
        bm.resolve(bm.parse_args(["--device", "cpu", "--variants", "fp8-block-compile-static"]))


def test_static_launch_is_read_from_inductors_config():
    from torch._inductor import config

    import lowbit.bench.model as bm

    with config.patch(use_static_cuda_launcher=True, static_launch_user_defined_triton_kernels=True):
        assert bm.static_launch_on()
    with config.patch(static_launch_user_defined_triton_kernels=False):
        assert not bm.static_launch_on()
