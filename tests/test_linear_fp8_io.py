"""FP8 values across layer boundaries: fp8_output (a Float8Tensor activation) and fp8_grad."""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_close, representable

import torchte as te
from torchte import recipe

RECIPES = [recipe.DelayedScaling(amax_history_len=4), recipe.Float8CurrentScaling()]


pytestmark = pytest.mark.usefixtures("cpu_default_device")


def _layers():
    l1 = te.Linear(32, 48, params_dtype=torch.float32)
    l2 = te.Linear(48, 16, params_dtype=torch.float32)
    with torch.no_grad():
        for layer in (l1, l2):
            layer.weight.copy_(representable(layer.weight.shape, torch.float8_e4m3fn, scale=0.25))
            layer.bias.copy_(representable(layer.bias.shape, torch.bfloat16, scale=0.25))
    return l1, l2


@pytest.mark.parametrize("fp8_recipe", RECIPES, ids=["delayed", "current"])
def test_fp8_output_is_a_float8_tensor_the_next_layer_consumes(fp8_recipe):
    l1, l2 = _layers()
    x = representable((7, 32), torch.float8_e4m3fn).requires_grad_()
    with te.autocast(recipe=fp8_recipe):
        h = l1(x, fp8_output=True)
        y = l2(h)
    assert isinstance(h, te.Float8Tensor)
    assert h.dtype == torch.float32 and h.shape == (7, 48)
    h_ref = torch.nn.functional.linear(x.double(), l1.weight.double(), l1.bias.double())
    assert_close(h.dequantize(), h_ref, torch.float8_e4m3fn)
    # The second layer reads h's FP8 bytes as they are: its output is the hp product of the
    # dequantized h with its (FP8-rounded) weight.
    y_ref = torch.nn.functional.linear(
        h.dequantize().double(), l2.weight.double(), l2.bias.double()
    )
    assert_close(y, y_ref, torch.float8_e4m3fn)
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    dx_ref = torch.ones(7, 16, dtype=torch.float64) @ l2.weight.double() @ l1.weight.double()
    assert_close(x.grad, dx_ref, torch.float8_e5m2)


@pytest.mark.parametrize("fp8_recipe", RECIPES, ids=["delayed", "current"])
def test_fp8_grad_hands_a_float8_gradient_to_the_previous_layer(fp8_recipe):
    l1, l2 = _layers()
    seen = []

    class Spy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, grad):
            seen.append(type(grad))
            return grad

    x = representable((5, 32), torch.float8_e4m3fn).requires_grad_()
    dy = representable((5, 16), torch.float8_e5m2)
    with te.autocast(recipe=fp8_recipe):
        h = Spy.apply(l1(x))
        y = l2(h, fp8_grad=True)
    y.backward(dy)
    assert seen == [te.Float8Tensor]
    dx_ref = dy.double() @ l2.weight.double() @ l1.weight.double()
    assert_close(x.grad, dx_ref, torch.float8_e5m2)
    dw1_ref = (dy.double() @ l2.weight.double()).t() @ x.double()
    assert_close(l1.weight.grad, dw1_ref, torch.float8_e5m2)


def test_fp8_output_outside_autocast_is_an_error():
    layer = te.Linear(32, 16)
    with pytest.raises(ValueError, match="fp8_output and fp8_grad need FP8"):
        layer(torch.randn(2, 32), fp8_output=True)
