"""Numerics under faults: NaN and inf in inputs and gradients under both FP8 recipes.

Delayed scaling never takes a non-finite amax into its history (the slot keeps its history and
scale, and the skip is counted), so the next clean step is scaled as if the fault had not
happened. Current scaling makes a tensor holding NaN or inf quantize to NaN (its scale_inv is
NaN), so whatever is computed from it is non-finite, as in high precision, and a trainer's
usual skip-the-step check sees it.
"""

from __future__ import annotations

import math

import pytest
import torch

import torchte as te
from torchte.recipe import DelayedScaling, Float8CurrentScaling

pytestmark = pytest.mark.usefixtures("cpu_default_device")

H = 32


def relative_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    """||y - reference|| / ||reference|| in fp64."""
    return ((y.double() - reference.double()).norm() / reference.double().norm()).item()


def test_one_nan_does_not_freeze_the_delayed_scale():
    """The reproducer: one NaN batch, 20 clean steps, then inputs 100x larger. The scales
    follow the larger inputs from the step after they first appear (before the fix the NaN in
    the history kept the scale frozen for the history's length, 98% off)."""
    layer = te.Linear(H, H, bias=False)
    recipe = DelayedScaling()  # amax history of 1024
    x = torch.randn(16, H)
    bad = x.clone()
    bad[2, 3] = math.nan
    with torch.no_grad():
        for batch in [x, bad] + [x] * 20:
            with te.autocast(recipe=recipe):
                layer(batch)
        big = 100 * x
        for _ in range(2):  # the first saturates (its scale is from smaller amaxes)
            with te.autocast(recipe=recipe):
                y = layer(big)
    reference = big.double() @ layer.weight.double().t()
    # E4M3 keeps 3 mantissa bits: about 4% of the norm; a frozen scale saturates (98% off).
    assert relative_error(y, reference) < 0.1
    assert layer.nonfinite_amax_count() == 1


@pytest.mark.parametrize("special", [math.inf, -math.inf, math.nan])
def test_current_scaling_turns_a_nonfinite_input_into_nan_outputs(special):
    layer = te.Linear(H, H)
    x = torch.randn(16, H, requires_grad=True)
    with torch.no_grad():
        x[4, 7] = special
    with te.autocast(recipe=Float8CurrentScaling()):
        y = layer(x)
    assert torch.isnan(y).all()  # not a saturated, finite row
    y.sum().backward()
    assert torch.isnan(layer.weight.grad).all()


@pytest.mark.parametrize("special", [math.inf, math.nan])
def test_current_scaling_turns_a_nonfinite_gradient_into_nan_gradients(special):
    layer = te.Linear(H, H)
    x = torch.randn(16, H, requires_grad=True)
    with te.autocast(recipe=Float8CurrentScaling()):
        y = layer(x)
    dy = torch.randn_like(y)
    dy[0, 0] = special
    y.backward(dy)
    assert torch.isnan(x.grad).all() and torch.isnan(layer.weight.grad).all()


def test_delayed_scaling_counts_nonfinite_gradients_and_recovers():
    layer = te.Linear(H, H, bias=False)
    recipe = DelayedScaling(amax_history_len=8)
    x = torch.randn(16, H, requires_grad=True)
    for step, special in enumerate([None, math.inf, None, math.nan, None]):
        with te.autocast(recipe=recipe):
            y = layer(x)
        dy = torch.ones_like(y)
        if special is not None:
            dy[1, 1] = special
        y.backward(dy)
        _, bwd = layer._delayed_states[8]
        assert torch.isfinite(bwd.amax_history).all(), step
        assert torch.isfinite(bwd.scale).all() and (bwd.scale > 0).all(), step
    assert layer.nonfinite_amax_count() == 2
    # The grad_output scale comes from the clean gradients' amax (1.0) alone.
    assert bwd.scale[0].item() == 57344.0


def _model() -> torch.nn.Module:
    # Input and output layers without a norm or a bias: the faults reach their quantizers
    # directly (a norm turns inf into NaN, a bias gradient is summed in high precision).
    return torch.nn.Sequential(
        te.Linear(H, 2 * H, bias=False),
        te.LayerNormMLP(2 * H, 4 * H, activation="swiglu"),
        te.Linear(2 * H, H, bias=False),
    )


def _scaling_states(model):
    return [s for m in model.modules() for pair in getattr(m, "_delayed_states", {}).values()
            for s in pair]  # fmt: skip


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=16), Float8CurrentScaling()])
def test_fault_injection_training(recipe):
    """50 SGD steps with NaN or inf put into an input or an output gradient at random steps.
    The trainer skips a step whose loss or gradients are not finite (what loss scalers do).
    No parameter ever receives a non-finite value; after a fault, the next clean step's
    scaling state is finite and its outputs are as accurate as before the fault."""
    gen = torch.Generator().manual_seed(11)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    probe = torch.randn(32, H, generator=gen)
    target = torch.randn(32, H, generator=gen)
    # Ten faulty steps at random places, each kind (NaN or inf; input or gradient) in turn.
    fault_steps = torch.randperm(50, generator=gen)[:10].tolist()
    faults = {step: i % 4 for i, step in enumerate(fault_steps)}
    skipped, after_fault = 0, False
    for step in range(50):
        x = torch.randn(32, H, generator=gen)
        kind = faults.get(step)
        special = (math.nan, math.inf, -math.inf, math.nan)[kind] if kind is not None else None
        if kind is not None and kind < 2:
            x[step % 32, step % H] = special
        with te.autocast(recipe=recipe):
            y = model(x)
        if kind is not None and kind >= 2:
            y.register_hook(lambda g, s=special: g.index_put((torch.tensor(0),), torch.tensor(s)))
        loss = torch.nn.functional.mse_loss(y.float(), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grads_finite = all(torch.isfinite(p.grad).all() for p in model.parameters())
        if torch.isfinite(loss) and grads_finite:
            optimizer.step()
        else:
            skipped += 1
            assert kind is not None, f"step {step} without a fault was skipped"
        for name, p in model.named_parameters():
            assert torch.isfinite(p).all(), (step, name)
        if kind is None and after_fault:
            _check_recovered(model, recipe, probe, step)
        after_fault = kind is not None
    assert skipped >= 1
    if isinstance(recipe, Float8CurrentScaling):
        assert skipped == len(faults)  # every fault made its step non-finite
    else:
        assert sum(int(m.nonfinite_amax_count()) for m in model if hasattr(m, "_delayed_states"))


def _check_recovered(model, recipe, probe, step):
    for state in _scaling_states(model):
        assert torch.isfinite(state.amax_history).all(), step
        assert torch.isfinite(state.scale).all() and (state.scale > 0).all(), step
    with torch.no_grad():
        with te.autocast(enabled=False):
            y_hp = model(probe)
        with te.autocast(recipe=recipe):
            y_fp8 = model(probe)
    assert torch.isfinite(y_fp8).all(), step
    assert relative_error(y_fp8, y_hp) < 0.1, step


@pytest.mark.gpu
@pytest.mark.parametrize("special", [math.inf, math.nan])
def test_nonfinite_inputs_on_gpu(special):
    """The Triton kernels and torch._scaled_mm: current scaling gives NaN outputs, delayed
    scaling counts the skipped amax and keeps its scale, as on the CPU."""
    x = torch.randn(32, H, device="cuda", dtype=torch.bfloat16)
    x[3, 5] = special
    current = te.Linear(H, H, device="cuda", params_dtype=torch.bfloat16)
    with torch.no_grad(), te.autocast(recipe=Float8CurrentScaling()):
        assert torch.isnan(current(x)).all()
    delayed = te.Linear(H, H, device="cuda", params_dtype=torch.bfloat16)
    recipe = DelayedScaling(amax_history_len=4)
    clean = torch.randn_like(x)
    with torch.no_grad():
        for batch in (clean, x, clean):
            with te.autocast(recipe=recipe):
                delayed(batch)
    fwd, _ = delayed._delayed_states[4]
    assert delayed.nonfinite_amax_count() == 1
    assert torch.isfinite(fwd.amax_history).all() and torch.isfinite(fwd.scale).all()
    amax = clean.abs().max().float()
    assert fwd.scale[0].item() == torch.tensor(448.0, device="cuda").div(amax).item()
