"""quantized_model_init / fp8_model_init and make_fp8_parameter."""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_close, representable

from torchte.quantization.float8 import Float8CurrentScalingQuantizer, Float8Quantizer
from torchte.quantization.float8_tensor import Float8Tensor
from torchte.quantization.model_init import (
    ModelInitSettings,
    fp8_model_init,
    make_fp8_parameter,
    model_init_settings,
    quantized_model_init,
)
from torchte.recipe import DelayedScaling, Float8CurrentScaling, Format

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]


# ----------------------------------------------------------------------------------------------
# The context manager
# ----------------------------------------------------------------------------------------------


def test_settings_are_none_outside():
    assert model_init_settings() is None


def test_default_recipe_is_delayed_scaling():
    with quantized_model_init():
        settings = model_init_settings()
        assert isinstance(settings, ModelInitSettings)
        assert settings.recipe == DelayedScaling()
        assert settings.preserve_high_precision_init_val is False
    assert model_init_settings() is None


def test_settings_carry_the_arguments_and_are_frozen():
    recipe = Float8CurrentScaling(fp8_format=Format.E4M3)
    with quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True):
        settings = model_init_settings()
        assert settings.recipe is recipe._frozen()
        assert settings.preserve_high_precision_init_val is True
        with pytest.raises(AttributeError):
            settings.recipe = DelayedScaling()


def test_nesting_restores_the_outer_settings():
    outer_recipe, inner_recipe = DelayedScaling(margin=1), Float8CurrentScaling()
    with quantized_model_init(recipe=outer_recipe):
        outer = model_init_settings()
        with quantized_model_init(recipe=inner_recipe, preserve_high_precision_init_val=True):
            assert model_init_settings().recipe is inner_recipe._frozen()
            with quantized_model_init(enabled=False):
                assert model_init_settings() is None
            assert model_init_settings().recipe is inner_recipe._frozen()
        assert model_init_settings() is outer
        assert outer.recipe is outer_recipe._frozen()
    assert model_init_settings() is None


def test_settings_are_restored_after_an_exception():
    with quantized_model_init(recipe=DelayedScaling(margin=2)):
        outer = model_init_settings()
        with pytest.raises(ValueError, match="boom"), quantized_model_init(recipe=None):
            assert model_init_settings() is not outer
            raise ValueError("boom")
        assert model_init_settings() is outer
    assert model_init_settings() is None


def test_fp8_model_init_is_the_same_context_manager():
    recipe = Float8CurrentScaling()
    with fp8_model_init(recipe=recipe, preserve_high_precision_init_val=True):
        settings = model_init_settings()
        assert settings.recipe is recipe._frozen() and settings.preserve_high_precision_init_val
        with fp8_model_init(enabled=False):
            assert model_init_settings() is None
    assert model_init_settings() is None


def test_bad_arguments_raise_and_leave_state_alone():
    with pytest.raises(TypeError, match="recipe"), quantized_model_init(recipe="delayed"):
        pass
    with (
        pytest.raises(TypeError, match="preserve_high_precision_init_val"),
        quantized_model_init(preserve_high_precision_init_val="yes"),
    ):
        pass
    assert model_init_settings() is None


# ----------------------------------------------------------------------------------------------
# make_fp8_parameter
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("internal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_make_fp8_parameter(fp8_dtype, dtype, internal):
    w_hp = representable((17, 48), fp8_dtype, scale=2.0).to(dtype)
    quantizer = Float8CurrentScalingQuantizer(fp8_dtype, power_2_scale=True, internal=internal)
    param = make_fp8_parameter(w_hp, quantizer, preserve_high_precision_init_val=False)
    assert type(param) is Float8Tensor and isinstance(param, torch.nn.Parameter)
    assert (param.shape, param.dtype, param.fp8_dtype) == (w_hp.shape, dtype, fp8_dtype)
    assert param.requires_grad and param.grad_fn is None
    assert param._quantizer is quantizer
    assert param._storage.rowwise_data is not None
    assert param._storage.columnwise_data is not None
    assert_close(param.dequantize(), w_hp.double(), fp8_dtype)
    assert torch.equal(param.dequantize(), w_hp)
    assert not hasattr(param, "get_high_precision_init_val")
    assert not hasattr(param, "clear_high_precision_init_val")


def test_make_fp8_parameter_from_a_parameter_that_requires_grad():
    w_hp = torch.nn.Parameter(torch.randn(8, 16))
    quantizer = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
    param = make_fp8_parameter(w_hp, quantizer, False, requires_grad=False)
    assert type(param) is Float8Tensor and not param.requires_grad
    assert_close(param.dequantize(), w_hp.double(), torch.float8_e4m3fn)


def test_make_fp8_parameter_with_delayed_scaling_quantizer():
    scale, amax = torch.tensor([8.0]), torch.zeros(1)
    quantizer = Float8Quantizer(scale, amax, torch.float8_e4m3fn, internal=True)
    w_hp = representable((4, 32), torch.float8_e4m3fn, scale=4.0)
    param = make_fp8_parameter(w_hp, quantizer, False)
    assert param._storage.scale_inv.item() == 1 / 8
    assert amax.item() == w_hp.abs().max().item()
    assert torch.equal(param.dequantize(), w_hp)


def test_preserved_high_precision_init_val():
    w_hp = torch.randn(12, 20, dtype=torch.bfloat16)
    expected = w_hp.clone()
    quantizer = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
    param = make_fp8_parameter(w_hp, quantizer, preserve_high_precision_init_val=True)
    w_hp.zero_()  # the kept value is a copy
    init_val = param.get_high_precision_init_val()
    assert type(init_val) is torch.Tensor and init_val.device.type == "cpu"
    assert init_val.dtype == torch.bfloat16 and not init_val.requires_grad
    assert torch.equal(init_val, expected)
    assert not torch.equal(param.dequantize(), expected)  # FP8 rounding shows, not the hp copy
    assert_close(param.dequantize(), expected.double(), torch.float8_e4m3fn)
    param.clear_high_precision_init_val()
    assert param.get_high_precision_init_val() is None


def test_fp8_parameter_trains_in_a_module():
    quantizer = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
    linear = torch.nn.Linear(16, 8, bias=False)
    linear.weight = make_fp8_parameter(linear.weight, quantizer, False)
    assert [name for name, _ in linear.named_parameters()] == ["weight"]
    weight = linear.weight
    before = weight.dequantize()
    opt = torch.optim.SGD(linear.parameters(), lr=1.0)
    linear(torch.randn(4, 16)).square().sum().backward()
    assert type(weight.grad) is torch.Tensor
    opt.step()
    assert linear.weight is weight and type(weight) is Float8Tensor
    assert not torch.equal(weight.dequantize(), before)
    assert_close(weight.dequantize(), before.double() - weight.grad.double(), torch.float8_e4m3fn)
