"""Recipes: Transformer Engine's field names and defaults, validation, formats, predicates."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import torchte as te
from torchte import recipe
from torchte.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)

ALL_RECIPES = (
    DelayedScaling,
    Float8CurrentScaling,
    Float8BlockScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)


def test_delayed_scaling_defaults_match_transformer_engine():
    r = DelayedScaling()
    assert r.margin == 0
    assert r.fp8_format is Format.HYBRID
    assert r.amax_history_len == 1024
    assert r.amax_compute_algo == "max"
    assert r.scaling_factor_compute_algo is None
    assert r.reduce_amax is True
    assert r.fp8_dpa is False
    assert r.fp8_mha is False


def test_delayed_scaling_field_names_are_transformer_engines():
    names = [f.name for f in dataclasses.fields(DelayedScaling)]
    assert names == [
        "margin",
        "fp8_format",
        "amax_history_len",
        "amax_compute_algo",
        "scaling_factor_compute_algo",
        "reduce_amax",
        "fp8_dpa",
        "fp8_mha",
        "backward_override",
        "interval",  # the older ones clients still pass
        "override_linear_precision",
        "params_dtype",
        "device",
    ]


def test_predicates_are_class_methods():
    assert DelayedScaling.delayed() and DelayedScaling().float8_per_tensor_scaling()
    assert recipe.Float8CurrentScaling.float8_current_scaling()
    assert not recipe.Float8CurrentScaling().delayed()
    assert recipe.CustomRecipe.custom() and not DelayedScaling.custom()
    assert recipe.MXFP8BlockScaling.mxfp8() and recipe.NVFP4BlockScaling().nvfp4()
    assert recipe.Float8BlockScaling.float8_block_scaling()


def test_transformer_engine_2x_fields_are_accepted_at_construction():
    """backward_override (validated as Transformer Engine validates it), the block recipes' 2.x
    fields, the older DelayedScaling fields clients pass, and CustomRecipe: accepted when the
    recipe is built; what torchte cannot run is refused when a module first uses it."""
    current = recipe.Float8CurrentScaling(backward_override="high_precision")
    recipe.MXFP8BlockScaling(enable_2d_quantization=True, backward_override="dequantized")
    recipe.NVFP4BlockScaling(disable_stochastic_rounding=True, disable_rht=True)
    wgrad_hp = DelayedScaling(interval=1, override_linear_precision=(False, False, True))
    custom = recipe.CustomRecipe(qfactory=lambda role: None)
    with pytest.raises(ValueError, match="backward_override"):
        DelayedScaling(backward_override="high_precision")  # None only, as there
    with pytest.raises(ValueError, match="backward_override"):
        recipe.Float8CurrentScaling(backward_override="fp32")
    with pytest.raises(ValueError, match="override_linear_precision"):
        DelayedScaling(override_linear_precision=(False, True))
    with pytest.raises(ValueError, match="interval"):
        DelayedScaling(interval=0)
    with pytest.warns(UserWarning, match="params_dtype, device has no effect"):
        DelayedScaling(params_dtype=torch.bfloat16, device="cuda", margin=1)
    layer = te.Linear(16, 16, device="cpu")
    x = torch.randn(16, 16)
    with te.autocast(recipe=current):  # runs (tests/test_backward_override.py)
        assert layer(x).shape == (16, 16)
    for used, match in (
        (wgrad_hp, "override_linear_precision"),
        (custom, "CustomRecipe is not implemented"),
    ):
        with pytest.raises(NotImplementedError, match=match), te.autocast(recipe=used):
            layer(x)
    with te.autocast(recipe=DelayedScaling(override_linear_precision=(False, False, False))):
        assert layer(x).shape == (16, 16)


def test_delayed_scaling_accepts_keywords():
    algo = lambda history: history[0]  # noqa: E731
    r = DelayedScaling(
        margin=2,
        fp8_format=Format.E4M3,
        amax_history_len=16,
        amax_compute_algo=algo,
        reduce_amax=False,
    )
    assert (r.margin, r.fp8_format, r.amax_history_len) == (2, Format.E4M3, 16)
    assert r.amax_compute_algo is algo
    assert r.reduce_amax is False
    assert DelayedScaling(amax_compute_algo="most_recent").amax_compute_algo == "most_recent"


def test_float8_current_scaling_defaults():
    r = Float8CurrentScaling()
    assert r.fp8_format is Format.HYBRID
    assert r.use_power_2_scales is False
    assert r.amax_epsilon == 0.0
    assert r.fp8_dpa is False and r.fp8_mha is False


def test_block_recipe_defaults():
    assert Float8BlockScaling().fp8_format is Format.E4M3
    assert Float8BlockScaling().x_block_scaling_dim == 1
    assert Float8BlockScaling().w_block_scaling_dim == 2
    assert Float8BlockScaling().grad_block_scaling_dim == 1
    assert MXFP8BlockScaling().fp8_format is Format.E4M3
    assert MXFP8BlockScaling().margin == 0
    assert NVFP4BlockScaling().fp4_format is Format.E2M1
    assert NVFP4BlockScaling(fp4_format="E2M1").fp4_format is Format.E2M1  # older torchte's


@pytest.mark.parametrize("margin", [-1, 1.5, "0", None, True])
def test_delayed_scaling_rejects_bad_margin(margin):
    with pytest.raises(ValueError, match="margin"):
        DelayedScaling(margin=margin)


@pytest.mark.parametrize("fp8_format", [Format.E4M3, Format.HYBRID])
@pytest.mark.parametrize("margin", [15, 20, 100])
def test_delayed_scaling_rejects_a_margin_beyond_the_format(fp8_format, margin):
    """E4M3's largest value is 448 = 1.75 * 2**8, its smallest normal 2**-6: a margin above 14
    puts a tensor's amax below every normal E4M3 number."""
    with pytest.raises(ValueError, match="margin must be at most 14"):
        DelayedScaling(margin=margin, fp8_format=fp8_format)


def test_largest_margin_still_trains():
    import torchte as te

    torch.manual_seed(0)
    layer = te.Linear(32, 16, bias=False, device="cpu")
    x = torch.randn(64, 32)
    reference = x.double() @ layer.weight.double().t()
    fp8 = DelayedScaling(margin=recipe.max_margin(Format.HYBRID))
    for _ in range(2):  # the second step uses the scales made from the first one's amaxes
        with te.autocast(recipe=fp8):
            y = layer(x)
    # Few bits of precision are left, but no value flushes to zero and none is lost.
    assert torch.isfinite(y).all()
    rel = (y.double() - reference).norm() / reference.norm()
    assert rel < 0.25


@pytest.mark.parametrize("length", [0, -3, 2.0, None])
def test_delayed_scaling_rejects_bad_history_len(length):
    with pytest.raises(ValueError, match="amax_history_len"):
        DelayedScaling(amax_history_len=length)


@pytest.mark.parametrize("algo", ["mean", "MAX", "", None, 3])
def test_delayed_scaling_rejects_bad_amax_compute_algo(algo):
    with pytest.raises(ValueError, match="amax_compute_algo"):
        DelayedScaling(amax_compute_algo=algo)


def test_delayed_scaling_rejects_non_callable_scaling_factor_algo():
    with pytest.raises(ValueError, match="scaling_factor_compute_algo"):
        DelayedScaling(scaling_factor_compute_algo="max")


@pytest.mark.parametrize("cls", [DelayedScaling, Float8CurrentScaling])
def test_e5m2_format_rejected(cls):
    with pytest.raises(ValueError, match="E5M2"):
        cls(fp8_format=Format.E5M2)


@pytest.mark.parametrize("cls", [DelayedScaling, Float8CurrentScaling])
@pytest.mark.parametrize("fmt", ["HYBRID", 1, None])
def test_format_must_be_a_format(cls, fmt):
    with pytest.raises(TypeError, match="fp8_format"):
        cls(fp8_format=fmt)


@pytest.mark.parametrize("cls", [DelayedScaling, Float8CurrentScaling])
@pytest.mark.parametrize("fmt", [Format.E4M3, Format.HYBRID])
def test_e4m3_and_hybrid_accepted(cls, fmt):
    assert cls(fp8_format=fmt).fp8_format is fmt


def test_current_scaling_rejects_negative_epsilon():
    with pytest.raises(ValueError, match="amax_epsilon"):
        Float8CurrentScaling(amax_epsilon=-1e-3)
    assert Float8CurrentScaling(amax_epsilon=1e-6).amax_epsilon == 1e-6


@pytest.mark.parametrize(
    "fmt,fwd,bwd,max_fwd,max_bwd",
    [
        (Format.E4M3, torch.float8_e4m3fn, torch.float8_e4m3fn, 448.0, 448.0),
        (Format.E5M2, torch.float8_e5m2, torch.float8_e5m2, 57344.0, 57344.0),
        (Format.HYBRID, torch.float8_e4m3fn, torch.float8_e5m2, 448.0, 57344.0),
    ],
)
def test_format_dtypes_and_maxima(fmt, fwd, bwd, max_fwd, max_bwd):
    assert fmt.fwd_dtype is fwd
    assert fmt.bwd_dtype is bwd
    assert fmt.value.max_fwd == max_fwd
    assert fmt.value.max_bwd == max_bwd
    # The maxima are the dtypes' own largest finite values.
    assert torch.finfo(fwd).max == max_fwd
    assert torch.finfo(bwd).max == max_bwd


def test_format_members():
    assert {f.name for f in Format} == {"E2M1", "E4M3", "E5M2", "HYBRID"}
    assert Format.E2M1.value.max_fwd == 6.0 and Format.E2M1.fwd_dtype is torch.float4_e2m1fn_x2


PREDICATES = (
    "delayed",
    "float8_current_scaling",
    "float8_per_tensor_scaling",
    "float8_block_scaling",
    "mxfp8",
    "nvfp4",
)
EXPECTED_TRUE = {
    DelayedScaling: {"delayed", "float8_per_tensor_scaling"},
    Float8CurrentScaling: {"float8_current_scaling", "float8_per_tensor_scaling"},
    Float8BlockScaling: {"float8_block_scaling"},
    MXFP8BlockScaling: {"mxfp8"},
    NVFP4BlockScaling: {"nvfp4"},
}


@pytest.mark.parametrize("cls", ALL_RECIPES)
def test_predicates(cls):
    r = cls()
    assert isinstance(r, Recipe)
    truths = {name for name in PREDICATES if getattr(r, name)()}
    assert truths == EXPECTED_TRUE[cls]


@pytest.mark.parametrize("cls", ALL_RECIPES)
def test_recipes_are_mutable_with_validation(cls):
    """As in Transformer Engine, fields are set after construction; an invalid value is
    refused and the old one kept; unknown names are refused."""
    r = cls()
    r.backward_override = None
    with pytest.raises(ValueError, match="backward_override"):
        r.backward_override = "fp32"
    assert r.backward_override is None
    with pytest.raises(AttributeError, match="no field 'marginn'"):
        r.marginn = 1


def test_a_changed_recipe_takes_effect_at_the_next_region():
    """te.autocast works from a frozen snapshot: the same object while the recipe is unchanged
    (no new module state per region), a new one after a change, which a module then uses."""
    r = DelayedScaling(amax_history_len=4)
    snapshot = r._frozen()
    assert r._frozen() is snapshot and snapshot == r
    with pytest.raises(dataclasses.FrozenInstanceError):
        snapshot.margin = 1
    r.margin = 1
    assert r._frozen() is not snapshot and r._frozen().margin == 1 and snapshot.margin == 0
    r.amax_history_len = 8
    layer = te.Linear(16, 16, device="cpu")
    with te.autocast(recipe=r):
        layer(torch.randn(16, 16))
    assert 8 in layer._delayed_states and 4 not in layer._delayed_states


@pytest.mark.parametrize("cls", ALL_RECIPES)
def test_recipes_compare_and_hash_by_value(cls):
    assert cls() == cls()
    assert hash(cls()) == hash(cls())
    assert len({cls(), cls()}) == 1


def test_different_recipes_differ():
    assert DelayedScaling() != DelayedScaling(margin=1)
    assert DelayedScaling(amax_history_len=4) != DelayedScaling(amax_history_len=8)
    assert Float8CurrentScaling() != Float8CurrentScaling(fp8_format=Format.E4M3)


def test_module_exports():
    for name in (
        "DelayedScaling",
        "Float8CurrentScaling",
        "Float8BlockScaling",
        "MXFP8BlockScaling",
        "NVFP4BlockScaling",
        "Format",
        "Recipe",
    ):
        assert name in recipe.__all__
        assert hasattr(recipe, name)
