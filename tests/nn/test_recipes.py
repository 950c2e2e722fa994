"""lowbit.recipes: defaults, validation, role mapping, names, environment flags."""

from __future__ import annotations

import dataclasses

import pytest

from lowbit import recipes
from lowbit.quant import MXFP8, NVFP4, Float8Blockwise, Float8Tensorwise
from lowbit.recipes import Format


def test_defaults_match_transformer_engine():
    d = recipes.DelayedScaling()
    assert (d.margin, d.fp8_format, d.amax_history_len, d.amax_compute_algo, d.reduce_amax, d.warmup_steps) == (
        0, Format.HYBRID, 1024, "max", True, 0)
    assert recipes.Float8CurrentScaling().fp8_format is Format.HYBRID
    b = recipes.Float8BlockScaling()
    assert (b.fp8_format, b.pow2_scales, b.x_block_scaling_dim, b.w_block_scaling_dim,
            b.grad_block_scaling_dim) == (Format.E4M3, True, 1, 2, 1)
    n = recipes.NVFP4BlockScaling()
    assert (n.disable_rht, n.disable_stochastic_rounding, n.disable_2d_quantization) == (False, False, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.margin = 1


def test_roles():
    r = recipes.DelayedScaling().roles()
    assert r["input"].scheme == Float8Tensorwise("e4m3") and r["input"].delayed
    assert r["grad_output"].scheme == Float8Tensorwise("e5m2")
    assert recipes.Float8CurrentScaling(fp8_format=Format.E4M3).role("grad_output").scheme == Float8Tensorwise("e4m3")
    assert not recipes.Float8CurrentScaling().delayed
    b = recipes.Float8BlockScaling().roles()
    assert (b["input"].scheme == Float8Blockwise("e4m3", block_dim=1)
            and b["weight"].scheme == Float8Blockwise("e4m3", block_dim=2))
    assert recipes.Float8BlockScaling(fp8_format=Format.HYBRID).role("grad_output").scheme.fmt == "e5m2"
    assert recipes.MXFP8BlockScaling().role("weight").scheme == MXFP8("e4m3")
    n = recipes.NVFP4BlockScaling().roles()
    assert n["input"].scheme == NVFP4(two_d=False, rht=True, stochastic_rounding=False)
    assert n["weight"].scheme == NVFP4(two_d=True, rht=False, stochastic_rounding=False)
    assert n["grad_output"].scheme == NVFP4(two_d=False, rht=True, stochastic_rounding=True)
    n = recipes.NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True,
                                  disable_2d_quantization=True).roles()
    assert n["grad_output"].scheme == NVFP4() and n["weight"].scheme == NVFP4()
    with pytest.raises(ValueError, match="role: expected one of"):
        recipes.Float8CurrentScaling().role("bias")


@pytest.mark.parametrize("make, match", [
    (lambda: recipes.DelayedScaling(margin=-1), "margin: expected an int >= 0, got -1"),
    (lambda: recipes.DelayedScaling(amax_history_len=0), "amax_history_len: expected an int >= 1, got 0"),
    (lambda: recipes.DelayedScaling(amax_compute_algo="mean"),
     "amax_compute_algo: expected 'max' or 'most_recent', got 'mean'"),
    (lambda: recipes.DelayedScaling(fp8_format="hybrid"), "fp8_format: expected a lowbit.recipes.Format"),
    (lambda: recipes.DelayedScaling(fp8_format=Format.E5M2),
     "fp8_format: this recipe takes Format.E4M3, Format.HYBRID, got Format.E5M2"),
    (lambda: recipes.DelayedScaling(reduce_amax=1), "reduce_amax: expected a bool, got 1"),
    (lambda: recipes.DelayedScaling(warmup_steps=-3), "warmup_steps: expected an int >= 0, got -3"),
    (lambda: recipes.Float8BlockScaling(x_block_scaling_dim=3), "x_block_scaling_dim: expected 1 .* or 2 .*, got 3"),
    (lambda: recipes.Float8BlockScaling(x_block_scaling_dim=2),
     r"x_block_scaling_dim, w_block_scaling_dim: both 2 makes the fprop GEMM .*2D x 2D"),
    (lambda: recipes.Float8BlockScaling(w_block_scaling_dim=1, grad_block_scaling_dim=2, x_block_scaling_dim=2),
     "wgrad GEMM"),
    (lambda: recipes.Float8BlockScaling(grad_block_scaling_dim=2), "dgrad GEMM"),
    (lambda: recipes.NVFP4BlockScaling(disable_rht="yes"), "disable_rht: expected a bool, got 'yes'"),
])
def test_invalid_values(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_block_1d_2d_combinations_allowed():
    recipes.Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1, grad_block_scaling_dim=1)
    recipes.Float8BlockScaling(w_block_scaling_dim=1)


def test_from_name():
    assert recipes.from_name("bf16") is None
    assert recipes.from_name("fp8-delayed") == recipes.DelayedScaling()
    assert isinstance(recipes.from_name("fp8-current"), recipes.Float8CurrentScaling)
    assert isinstance(recipes.from_name("fp8-block"), recipes.Float8BlockScaling)
    assert isinstance(recipes.from_name("mxfp8"), recipes.MXFP8BlockScaling)
    assert isinstance(recipes.from_name("nvfp4"), recipes.NVFP4BlockScaling)
    with pytest.raises(ValueError,
                       match="unknown recipe 'fp4'; valid names: bf16, fp8-delayed, fp8-current, fp8-block, "
                             "mxfp8, nvfp4"):
        recipes.from_name("fp4")


def test_nvfp4_flags_are_explicit_fields(monkeypatch):
    """The NVFP4 switches are fields (no environment variable changes a recipe); each one changes its role's scheme;
    a non-bool is a TypeError or ValueError naming the field."""
    monkeypatch.setenv("LOWBIT_NVFP4_DISABLE_RHT", "1")  # (a removed switch: ignored)
    r = recipes.NVFP4BlockScaling()
    assert not (r.disable_rht or r.disable_stochastic_rounding or r.disable_2d_quantization)
    assert r.role("input").scheme.rht and r.role("weight").scheme.two_d
    assert r.role("grad_output").scheme.stochastic_rounding
    off = recipes.NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True, disable_2d_quantization=True)
    assert not off.role("input").scheme.rht and not off.role("grad_output").scheme.rht
    assert not off.role("weight").scheme.two_d and not off.role("grad_output").scheme.stochastic_rounding
    with pytest.raises((TypeError, ValueError), match="disable_rht"):
        recipes.NVFP4BlockScaling(disable_rht="yes")


def test_recipe_names_are_one_list():
    assert recipes.QUANTIZED_NAMES == tuple(n for n in recipes.NAMES if n != "bf16")
    for n in recipes.QUANTIZED_NAMES:
        assert recipes.from_name(n).name == n
