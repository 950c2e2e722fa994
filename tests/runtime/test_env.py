"""The switch registry: parsing with errors that name the variable, read once, overrides restored, unknown variables
reported; and the fast-path decline log."""

import logging
import subprocess
import sys
import uuid

import pytest

from lowbit.runtime import env, log


def test_parse_rules_name_the_variable():
    sw = env.SWITCHES
    assert sw["LOWBIT_AUTOTUNE"].parse("LOWBIT_AUTOTUNE", "off") is False
    assert sw["LOWBIT_AUTOTUNE"].parse("LOWBIT_AUTOTUNE", "YES") is True
    with pytest.raises(ValueError, match="LOWBIT_AUTOTUNE: expected 0/1.*got 'maybe'"):
        sw["LOWBIT_AUTOTUNE"].parse("LOWBIT_AUTOTUNE", "maybe")
    with pytest.raises(ValueError, match="LOWBIT_ATTN_GLUON: expected one of 1, 0, force, got 'yes'"):
        sw["LOWBIT_ATTN_GLUON"].parse("LOWBIT_ATTN_GLUON", "yes")
    assert sw["LOWBIT_UNFUSE"].parse("LOWBIT_UNFUSE", " residual, norm_quant ") == {"residual", "norm_quant"}
    assert sw["LOWBIT_UNFUSE"].parse("LOWBIT_UNFUSE", "all") == set(env.FUSIONS)
    with pytest.raises(ValueError, match="LOWBIT_UNFUSE: unknown fusion.*swiglu"):
        sw["LOWBIT_UNFUSE"].parse("LOWBIT_UNFUSE", "swiglu")
    with pytest.raises(ValueError, match="LOWBIT_WGRAD_SM_CARVEOUT: expected a number of SMs"):
        sw["LOWBIT_WGRAD_SM_CARVEOUT"].parse("LOWBIT_WGRAD_SM_CARVEOUT", "-3")


def test_override_is_scoped_and_parsed():
    before = env.get("LOWBIT_UNFUSE")
    with env.override(LOWBIT_UNFUSE="residual", LOWBIT_TMA=False):
        assert not env.fused("residual") and env.fused("norm_quant") and env.get("LOWBIT_TMA") is False
        with env.override(LOWBIT_UNFUSE="all"):
            assert not env.fused("norm_quant")
        assert env.fused("norm_quant")
    assert env.get("LOWBIT_UNFUSE") == before and env.get("LOWBIT_TMA") is True
    with pytest.raises(KeyError, match="LOWBIT_NOPE"):
        with env.override(LOWBIT_NOPE=1):
            pass
    with pytest.raises(ValueError, match="LOWBIT_SENTRY_SYNC"):
        with env.override(LOWBIT_SENTRY_SYNC="sometimes"):
            pass
    with pytest.raises(KeyError, match="not a fusion"):
        env.fused("rope")


def test_read_once_from_the_environment_and_unknown_names():
    """A fresh process: the value comes from the environment, a bad value raises on first use naming it, and an
    unknown LOWBIT_* variable is reported (lowbit info prints it)."""
    code = ("from lowbit.runtime import env; print(env.get('LOWBIT_UNFUSE') == {'residual'}, env.unknown()); "
            "import os; os.environ['LOWBIT_UNFUSE'] = 'all'; print(env.get('LOWBIT_UNFUSE') == {'residual'})")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path), "LOWBIT_UNFUSE": "residual",
                            "LOWBIT_TYPO": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["True ['LOWBIT_TYPO']", "True"]
    bad = subprocess.run([sys.executable, "-c", "from lowbit.runtime import env; env.get('LOWBIT_TMA')"],
                         capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path), "LOWBIT_TMA": "2"})
    assert bad.returncode != 0 and "LOWBIT_TMA: expected 0/1" in bad.stderr
    info = subprocess.run([sys.executable, "-m", "lowbit", "info"], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path), "LOWBIT_TMA": "2"})
    assert info.returncode == 0, info.stderr[-2000:]
    assert "LOWBIT_TMA=invalid: LOWBIT_TMA: expected 0/1" in info.stdout


def test_info_lists_every_switch(capsys):
    from lowbit.cli import main

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for name in env.SWITCHES:
        assert name in out
    assert len(env.SWITCHES) <= 12


def test_declined_logs_once_per_reason(caplog):
    caplog.set_level(logging.DEBUG, logger="lowbit")
    path = f"test.path.{uuid.uuid4().hex}"  # (a path no other test declined)
    for _ in range(3):
        log.declined(path, "reason a")
    log.declined(path, "reason b")
    counts = log.declines()
    assert counts[(path, "reason a")] == 3 and counts[(path, "reason b")] == 1
    msgs = [r.getMessage() for r in caplog.records if r.name == "lowbit"]
    assert msgs.count(f"{path} declined a call: reason a") == 1
    assert msgs.count(f"{path} declined a call: reason b") == 1


def test_first_read_of_a_switch_does_not_recompile_a_graph():
    """A fresh process: a compiled function that read one switch is not recompiled after another switch is read for
    the first time elsewhere (every switch is read at import: the cache's keys never change)."""
    code = ("import torch, torch._dynamo\n"
            "from lowbit.runtime import env\n"
            "torch._dynamo.config.error_on_recompile = True\n"
            "f = torch.compile(lambda x: x + 1 if env.get('LOWBIT_TMA') else x - 1, backend='eager', fullgraph=True)\n"
            "x = torch.ones(3)\n"
            "f(x)\n"
            "env.fused('norm_quant'); env.get('LOWBIT_LOG')\n"
            "print(f(x).tolist())\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[2.0, 2.0, 2.0]"
