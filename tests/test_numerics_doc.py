"""The statements of docs/numerics.md that other test files do not already hold, each checked on
a te.Linear whose weight is the identity (so every output is one quantized input value).

- Delayed scaling's first step quantizes with scale 1: inputs past E4M3's 448 saturate, tiny
  gradients flush to zero; the next step is scaled from the first one's amaxes.
- Calibration readies the forward scales only.
- Under delayed scaling an inf input gives a saturated, finite output and is counted in
  nonfinite_amax_count; a NaN stays NaN; the slot keeps its scale.
- Current scaling is scaled from the first step on.
"""

from __future__ import annotations

import math

import pytest
import torch

import torchte as te
from torchte.recipe import DelayedScaling, Float8CurrentScaling

pytestmark = pytest.mark.usefixtures("cpu_default_device")

H = 32
E4M3_MAX = 448.0


def identity_layer() -> te.Linear:
    layer = te.Linear(H, H, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.eye(H))
    return layer


def forward_state(layer: te.Linear):
    return layer._delayed_states[DelayedScaling().amax_history_len][0]


def test_the_first_delayed_step_saturates_large_inputs():
    layer, x = identity_layer(), torch.full((4, H), 1000.0)
    outputs = []
    for _ in range(2):
        with torch.no_grad(), te.autocast(recipe=DelayedScaling()):
            outputs.append(layer(x))
    assert torch.equal(outputs[0], torch.full((4, H), E4M3_MAX))  # scale 1: saturated
    assert forward_state(layer).scale[0].item() == pytest.approx(E4M3_MAX / 1000.0)
    assert torch.equal(outputs[1], x)  # 1000 * 0.448 = 448 is exact in E4M3


def test_the_first_delayed_backward_flushes_tiny_gradients_to_zero():
    layer = te.Linear(H, H, bias=False)
    x, dy = torch.randn(16, H), torch.randn(16, H) * 1e-6
    reference = dy.double().t() @ x.double()
    grads = []
    for _ in range(2):
        layer.weight.grad = None
        with te.autocast(recipe=DelayedScaling()):
            y = layer(x)
        y.backward(dy)
        grads.append(layer.weight.grad.double())
    assert torch.equal(grads[0], torch.zeros(H, H, dtype=torch.float64))  # below E5M2's range
    assert ((grads[1] - reference).norm() / reference.norm()).item() < 0.1


def test_calibration_readies_the_forward_scales_only():
    layer = te.Linear(H, H)
    x = torch.randn(4, H, requires_grad=True)
    with te.autocast(enabled=False, calibrating=True, recipe=DelayedScaling()):
        y = layer(x)
    y.sum().backward()
    forward, backward = layer._delayed_states[DelayedScaling().amax_history_len]
    assert forward.scale[0].item() == pytest.approx(E4M3_MAX / x.abs().max().item())
    assert backward.scale.tolist() == [1.0, 1.0]


def test_delayed_scaling_saturates_inf_keeps_nan_and_counts_both():
    layer, x = identity_layer(), torch.ones(4, H)
    x[0, 0], x[1, 1] = math.inf, math.nan
    with torch.no_grad(), te.autocast(recipe=DelayedScaling()):
        y = layer(x)
    assert y[0, 0].item() == E4M3_MAX  # finite: a loss computed from it stays finite
    assert math.isnan(y[1, 1].item())
    assert torch.isfinite(y[2:]).all()
    assert layer.nonfinite_amax_count() == 1  # one tensor (the input) held NaN / inf
    assert forward_state(layer).scale[0].item() == 1.0  # kept, not taken from the bad amax


def test_current_scaling_is_scaled_from_the_first_step():
    layer, x = identity_layer(), torch.full((4, H), 1000.0)
    with torch.no_grad(), te.autocast(recipe=Float8CurrentScaling()):
        assert torch.equal(layer(x), x)
