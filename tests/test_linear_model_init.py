"""te.Linear built under te.quantized_model_init: FP8-only weights that train."""

from __future__ import annotations

import io

import pytest
import torch
from tolerances import assert_close, representable

import torchte as te
from torchte import recipe

pytestmark = pytest.mark.usefixtures("cpu_default_device")

RECIPES = [recipe.DelayedScaling(amax_history_len=8), recipe.Float8CurrentScaling()]


@pytest.mark.parametrize("fp8_recipe", RECIPES, ids=["delayed", "current"])
def test_weights_are_float8_and_forward_uses_them(fp8_recipe):
    with te.quantized_model_init(recipe=fp8_recipe):
        layer = te.Linear(64, 32, params_dtype=torch.bfloat16)
    assert isinstance(layer.weight, te.Float8Tensor)
    assert isinstance(layer.weight, torch.nn.Parameter) or layer.weight._is_param
    assert layer.weight.dtype == torch.bfloat16
    assert not isinstance(layer.bias, te.Float8Tensor)
    # The FP8 weight keeps the init's spread (a scale of 1 would flush it to subnormals).
    w = layer.weight.dequantize().float()
    assert 0.015 < w.std().item() < 0.031
    x = representable((5, 64), torch.bfloat16).bfloat16()
    with te.autocast(recipe=fp8_recipe):
        y = layer(x)
    expected = x.double() @ w.double().t() + layer.bias.double()
    assert_close(y, expected, torch.float8_e4m3fn)


@pytest.mark.parametrize("fp8_recipe", RECIPES, ids=["delayed", "current"])
def test_optimizer_trains_fp8_weights(fp8_recipe):
    torch.manual_seed(0)
    with te.quantized_model_init(recipe=fp8_recipe):
        layer = te.Linear(32, 16, params_dtype=torch.float32)
    teacher = torch.randn(16, 32) * 0.1
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    x = torch.randn(64, 32)
    target = x @ teacher.t()
    data_ptr = layer.weight._storage.rowwise_data.data_ptr()
    losses = []
    for _ in range(25):
        with te.autocast(recipe=fp8_recipe):
            loss = torch.nn.functional.mse_loss(layer(x), target)
        opt.zero_grad()
        loss.backward()
        assert layer.weight.grad is not None and not isinstance(layer.weight.grad, te.Float8Tensor)
        opt.step()
        losses.append(loss.item())
    assert isinstance(layer.weight, te.Float8Tensor)
    assert layer.weight._storage.rowwise_data.data_ptr() == data_ptr
    assert losses[-1] < 0.5 * losses[0]


def test_preserve_high_precision_init_val():
    torch.manual_seed(3)
    with te.quantized_model_init(preserve_high_precision_init_val=True):
        layer = te.Linear(32, 16, params_dtype=torch.bfloat16)
    hp = layer.weight.get_high_precision_init_val()
    assert hp is not None and hp.device.type == "cpu" and hp.dtype == torch.bfloat16
    assert_close(layer.weight.dequantize(), hp, torch.float8_e4m3fn)
    layer.weight.clear_high_precision_init_val()
    assert layer.weight.get_high_precision_init_val() is None


def test_state_dict_round_trip_keeps_fp8_bytes():
    with te.quantized_model_init():
        src = te.Linear(32, 16)
        dst = te.Linear(32, 16)
    with te.autocast():
        src(torch.randn(4, 32)).sum().backward()
    buf = io.BytesIO()
    torch.save(src.state_dict(), buf)
    buf.seek(0)
    dst.load_state_dict(torch.load(buf))
    assert isinstance(dst.weight, te.Float8Tensor)
    a, b = src.weight._storage, dst.weight._storage
    assert torch.equal(a.rowwise_data.view(torch.uint8), b.rowwise_data.view(torch.uint8))
    assert torch.equal(a.scale_inv, b.scale_inv)


def test_parameters_split_under_model_init():
    with te.quantized_model_init(recipe=recipe.Float8CurrentScaling()):
        layer = te.Linear(32, 48, parameters_split=("query_", "key_", "value_"))
    names = [n for n, _ in layer.named_parameters()]
    assert names == [
        "query_weight",
        "query_bias",
        "key_weight",
        "key_bias",
        "value_weight",
        "value_bias",
    ]
    x = representable((3, 32), torch.bfloat16)
    with te.autocast(recipe=recipe.Float8CurrentScaling()):
        y = layer(x)
    y.sum().backward()
    w = torch.cat([getattr(layer, f"{n}_weight").dequantize() for n in ("query", "key", "value")])
    assert_close(y, x.double() @ w.double().t(), torch.float8_e4m3fn)
    assert layer.key_weight.grad.shape == (16, 32)
