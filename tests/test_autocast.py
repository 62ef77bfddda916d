"""te.autocast: the active recipe, nesting, and when delayed-scaling amaxes and scales move.

Delayed-scaling expectations are computed in fp64 from the recorded amaxes and rounded once to
fp32 (a quotient of fp32 values rounded to fp64 then fp32 is correctly rounded), so the scales
are compared exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchte as te
from torchte.autocast import autocast_state, default_recipe, pending_backward_updates
from torchte.recipe import DelayedScaling, Float8CurrentScaling, Format

pytestmark = pytest.mark.usefixtures("cpu_default_device")


E4M3_MAX = 448.0
E5M2_MAX = 57344.0
IN, OUT = 32, 16


def f32(value: float) -> float:
    """value rounded once to fp32."""
    return torch.tensor(value, dtype=torch.float64).float().item()


def make_layer(bias: bool = False) -> te.Linear:
    return te.Linear(IN, OUT, bias=bias)


def states(layer: te.Linear, history_len: int):
    """The (forward, backward) DelayedScalingState of `layer` for `history_len`."""
    return layer._delayed_states[history_len]


def amax(t: torch.Tensor) -> float:
    return t.detach().abs().max().item()


def assert_clean_state() -> None:
    state = autocast_state()
    assert state.enabled is False
    assert state.calibrating is False
    assert state.depth == 0
    assert state.pending_forward == {}


# -- the active recipe ----------------------------------------------------------------------------


def test_default_recipe_is_delayed_scaling_defaults():
    assert default_recipe() == DelayedScaling()
    with te.autocast():
        state = autocast_state()
        assert state.enabled is True
        assert state.recipe == DelayedScaling()
        assert isinstance(state.recipe, DelayedScaling)
    assert_clean_state()


def test_outside_autocast_fp8_is_off():
    assert_clean_state()


def test_nesting_restores_each_level():
    outer_recipe = DelayedScaling(amax_history_len=8)
    inner_recipe = Float8CurrentScaling()
    state = autocast_state()
    with te.autocast(recipe=outer_recipe):
        assert (state.enabled, state.recipe, state.depth) == (True, outer_recipe, 1)
        with te.autocast(enabled=False, calibrating=True, recipe=inner_recipe):
            assert (state.enabled, state.calibrating) == (False, True)
            assert state.recipe == inner_recipe
            assert state.depth == 2
            with te.autocast(recipe=outer_recipe):
                assert state.depth == 3 and state.enabled and not state.calibrating
            assert (state.enabled, state.calibrating, state.depth) == (False, True, 2)
        assert (state.enabled, state.calibrating) == (True, False)
        assert state.recipe == outer_recipe
        assert state.depth == 1
    assert_clean_state()


def test_exception_restores_state():
    state = autocast_state()
    with (
        pytest.raises(KeyError),
        te.autocast(recipe=Float8CurrentScaling()),
        te.autocast(enabled=False),
    ):
        raise KeyError("boom")
    assert_clean_state()
    assert state.recipe == DelayedScaling()


def test_fp8_autocast_alias_arguments():
    r = DelayedScaling(margin=1)
    state = autocast_state()
    with te.fp8_autocast(enabled=True, fp8_recipe=r, fp8_group=None):
        assert state.enabled is True
        assert state.recipe is r._frozen() and state.recipe == r  # its snapshot
        assert state.group is None
    with te.fp8_autocast(False, True, Float8CurrentScaling()):
        assert (state.enabled, state.calibrating) == (False, True)
        assert state.recipe == Float8CurrentScaling()
    with te.fp8_autocast():
        assert state.recipe == DelayedScaling()
    assert_clean_state()


@pytest.mark.parametrize("bad", ["delayed", DelayedScaling, 3, Format.HYBRID])
def test_non_recipe_raises_type_error(bad):
    with pytest.raises(TypeError, match="recipe"), te.autocast(recipe=bad):
        pass
    with pytest.raises(TypeError, match="recipe"), te.fp8_autocast(fp8_recipe=bad):
        pass
    assert_clean_state()


def test_is_fp8_available_returns_a_bool_and_a_reason_on_request():
    """Transformer Engine's convention: a bool (so `if te.is_fp8_available():` means it), and
    (bool, reason) with return_reason=True."""
    available = te.is_fp8_available()
    assert isinstance(available, bool)
    answer = te.is_fp8_available(return_reason=True)
    assert isinstance(answer, tuple) and answer[0] is available and isinstance(answer[1], str)
    if not torch.cuda.is_available():
        assert available is True and "CPU" in answer[1]  # emulated on the CPU


@pytest.mark.parametrize(
    "check", ["is_mxfp8_available", "is_fp8_block_scaling_available", "is_nvfp4_available"]
)
def test_block_recipes_say_whether_they_run_natively_or_emulated(check):
    assert getattr(te, check)() is True
    available, reason = getattr(te, check)(return_reason=True)
    assert available is True and reason.startswith(("native: ", "emulated: "))
    if not torch.cuda.is_available():
        assert reason.startswith("emulated: ") and "CPU" in reason


def test_bf16_and_compute_capability():
    assert isinstance(te.is_bf16_available(), bool)
    assert te.is_bf16_available(return_reason=True)[0] == te.is_bf16_available()
    capability = te.get_device_compute_capability()
    assert isinstance(capability, tuple) and len(capability) == 2
    if torch.cuda.is_available():
        assert capability == torch.cuda.get_device_capability()
    else:
        assert capability == (0, 0) and te.is_bf16_available() is True


# -- delayed scaling: when amaxes are recorded and scales move ----------------------------------


def test_forward_scale_changes_only_when_outermost_autocast_exits():
    layer = make_layer()
    x = torch.randn(5, IN)
    recipe = DelayedScaling(amax_history_len=4)
    with te.autocast(recipe=recipe):
        with te.autocast(recipe=recipe):
            layer(x)
            fwd, _ = states(layer, 4)
            assert fwd.amax_history[0].tolist() == [amax(x), amax(layer.weight), 0.0]
            assert fwd.scale.tolist() == [1.0, 1.0, 1.0]
        # The inner region exited: still nothing applied.
        assert fwd.scale.tolist() == [1.0, 1.0, 1.0]
        assert fwd.amax_history[0].tolist() == [amax(x), amax(layer.weight), 0.0]
        assert fwd.amax_history[1:].abs().sum().item() == 0.0
    expected = [f32(E4M3_MAX / amax(x)), f32(E4M3_MAX / amax(layer.weight)), 1.0]
    assert fwd.scale.tolist() == expected
    # Rolled: the recorded row is now the last one, row 0 is zero for the next step.
    assert fwd.amax_history[0].tolist() == [0.0, 0.0, 0.0]
    assert fwd.amax_history[-1].tolist() == [amax(x), amax(layer.weight), 0.0]
    assert_clean_state()


def test_two_forwards_in_one_region_record_the_max():
    layer = make_layer()
    x1, x2 = torch.randn(3, IN), 4 * torch.randn(3, IN)
    recipe = DelayedScaling(amax_history_len=2)
    with te.autocast(recipe=recipe):
        layer(x1)
        layer(x2)
    fwd, _ = states(layer, 2)
    assert fwd.scale[0].item() == f32(E4M3_MAX / max(amax(x1), amax(x2)))


def test_backward_scales_update_when_backward_ends():
    layer = make_layer()
    x = torch.randn(4, IN, requires_grad=True)
    dy = torch.randn(4, OUT) * 3
    recipe = DelayedScaling(amax_history_len=4)
    with te.autocast(recipe=recipe):
        y = layer(x)
    _, bwd = states(layer, 4)
    seen = {}

    def during_backward(grad):
        # Runs inside the backward pass, after te.Linear's backward recorded its amaxes.
        seen["scale"] = bwd.scale.clone()
        seen["row0"] = bwd.amax_history[0].clone()
        return grad

    x.register_hook(during_backward)
    assert bwd.scale.tolist() == [1.0, 1.0]
    y.backward(dy)
    assert seen["scale"].tolist() == [1.0, 1.0]
    assert seen["row0"].tolist() == [amax(dy), 0.0]
    assert bwd.scale.tolist() == [f32(E5M2_MAX / amax(dy)), 1.0]
    assert bwd.amax_history[0].tolist() == [0.0, 0.0]
    assert bwd.amax_history[-1].tolist() == [amax(dy), 0.0]
    assert pending_backward_updates() == {}


def _model_update(rows, recorded, scale, fp8_max, algo="max", margin=0):
    """fp64 model of one delayed-scaling update: (new rows, new scale) as lists."""
    rows = [list(r) for r in rows]
    rows[0] = list(recorded)
    new_scale = list(scale)
    for j in range(len(scale)):
        column = [r[j] for r in rows]
        a = max(column) if algo == "max" else column[0]
        if a > 0:
            new_scale[j] = f32(f32(fp8_max / a) / 2.0**margin)
    rows = rows[1:] + rows[:1]
    rows[0] = [0.0] * len(scale)
    return rows, new_scale


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
def test_several_steps_roll_history_and_follow_amax(algo, margin):
    length = 3
    layer = make_layer()
    recipe = DelayedScaling(amax_history_len=length, amax_compute_algo=algo, margin=margin)
    fwd_rows = [[0.0] * 3 for _ in range(length)]
    bwd_rows = [[0.0] * 2 for _ in range(length)]
    fwd_scale, bwd_scale = [1.0] * 3, [1.0] * 2
    # Input amaxes rise then fall, so "max" and "most_recent" disagree.
    for step, x_scale in enumerate([1.0, 8.0, 2.0, 0.5, 0.25]):
        x = torch.randn(6, IN) * x_scale
        dy = torch.randn(6, OUT) * (step + 1)
        with te.autocast(recipe=recipe):
            y = layer(x.requires_grad_())
        y.backward(dy)
        fwd, bwd = states(layer, length)
        recorded = [amax(x), amax(layer.weight), 0.0]
        fwd_rows, fwd_scale = _model_update(fwd_rows, recorded, fwd_scale, E4M3_MAX, algo, margin)
        bwd_rows, bwd_scale = _model_update(
            bwd_rows, [amax(dy), 0.0], bwd_scale, E5M2_MAX, algo, margin
        )
        assert fwd.amax_history.tolist() == fwd_rows, f"step {step}"
        assert fwd.scale.tolist() == fwd_scale, f"step {step}"
        assert bwd.amax_history.tolist() == bwd_rows, f"step {step}"
        assert bwd.scale.tolist() == bwd_scale, f"step {step}"
    # The input slot follows its own amax: 448 / amax(input) (most recent) or the history max.
    assert fwd.scale[1].item() == f32(f32(E4M3_MAX / amax(layer.weight)) / 2.0**margin)


def test_max_and_most_recent_differ_after_a_drop():
    results = {}
    for algo in ("max", "most_recent"):
        torch.manual_seed(0)
        layer = make_layer()
        recipe = DelayedScaling(amax_history_len=8, amax_compute_algo=algo)
        big, small = torch.full((2, IN), 4.0), torch.full((2, IN), 0.5)
        for x in (big, small):
            with te.autocast(recipe=recipe):
                layer(x)
        results[algo] = states(layer, 8)[0].scale[0].item()
    assert results["max"] == E4M3_MAX / 4.0
    assert results["most_recent"] == E4M3_MAX / 0.5


def test_callable_amax_compute_algo_receives_history():
    calls = []

    def twice_row0(history: torch.Tensor) -> torch.Tensor:
        calls.append(history.clone())
        return history[0] * 2

    layer = make_layer()
    recipe = DelayedScaling(amax_history_len=4, amax_compute_algo=twice_row0)
    x = torch.randn(3, IN)
    with te.autocast(recipe=recipe):
        layer(x)
    fwd, _ = states(layer, 4)
    assert len(calls) == 1
    assert calls[0].shape == (4, 3)
    assert calls[0][0].tolist() == [amax(x), amax(layer.weight), 0.0]
    assert fwd.scale.tolist() == [
        f32(E4M3_MAX / (2 * amax(x))),
        f32(E4M3_MAX / (2 * amax(layer.weight))),
        1.0,
    ]
    assert fwd.amax_history[-1].tolist() == [amax(x), amax(layer.weight), 0.0]


def test_scaling_factor_compute_algo_is_used():
    def quarter(amax_t, scale, fp8_max, recipe):
        assert fp8_max == E4M3_MAX
        assert isinstance(recipe, DelayedScaling)
        return torch.where(amax_t > 0, torch.full_like(scale, 0.25), scale)

    layer = make_layer()
    recipe = DelayedScaling(amax_history_len=2, scaling_factor_compute_algo=quarter)
    with te.autocast(recipe=recipe):
        layer(torch.randn(3, IN))
    assert states(layer, 2)[0].scale.tolist() == [0.25, 0.25, 1.0]


def test_margin_divides_scale():
    layer = make_layer()
    x = torch.randn(3, IN)
    with te.autocast(recipe=DelayedScaling(amax_history_len=2, margin=3)):
        layer(x)
    assert states(layer, 2)[0].scale[0].item() == f32(f32(E4M3_MAX / amax(x)) / 8.0)


def test_calibration_computes_in_high_precision_and_records_amaxes():
    layer = te.Linear(IN, OUT, bias=True)
    with torch.no_grad():
        layer.bias.normal_()
    x = torch.randn(7, IN, requires_grad=True)
    recipe = DelayedScaling(amax_history_len=4)
    with te.autocast(enabled=False, calibrating=True, recipe=recipe):
        y = layer(x)
        fwd, _ = states(layer, 4)
        assert fwd.amax_history[0].tolist() == [amax(x), amax(layer.weight), 0.0]
        assert fwd.scale.tolist() == [1.0, 1.0, 1.0]
    assert torch.equal(y, F.linear(x, layer.weight, layer.bias))
    assert fwd.scale.tolist() == [
        f32(E4M3_MAX / amax(x)),
        f32(E4M3_MAX / amax(layer.weight)),
        1.0,
    ]
    # The backward is plain high precision too.
    dy = torch.randn(7, OUT)
    y.backward(dy)
    assert torch.allclose(x.grad, dy @ layer.weight.detach(), rtol=1e-6, atol=1e-6)
    assert torch.allclose(layer.weight.grad, dy.t() @ x.detach(), rtol=1e-6, atol=1e-6)


def test_calibrated_scales_are_used_by_the_next_fp8_forward():
    layer = make_layer()
    x = torch.randn(4, IN)
    recipe = DelayedScaling(amax_history_len=4)
    with te.autocast(enabled=False, calibrating=True, recipe=recipe):
        layer(x)
    fwd, _ = states(layer, 4)
    with te.autocast(recipe=recipe):
        layer(x)
        # The FP8 forward quantized with the calibrated scale and recorded new amaxes.
        assert fwd.scale[0].item() == f32(E4M3_MAX / amax(x))
        assert fwd.amax_history[0, 0].item() == amax(x)


def test_exception_in_body_discards_pending_amaxes():
    layer = make_layer()
    recipe = DelayedScaling(amax_history_len=4)
    with pytest.raises(RuntimeError, match="step failed"), te.autocast(recipe=recipe):
        layer(torch.randn(3, IN))
        fwd, _ = states(layer, 4)
        assert fwd.amax_history[0, 0].item() > 0
        raise RuntimeError("step failed")
    assert fwd.amax_history.abs().sum().item() == 0.0
    assert fwd.scale.tolist() == [1.0, 1.0, 1.0]
    assert_clean_state()
    # The next step records and applies normally.
    x = torch.randn(3, IN)
    with te.autocast(recipe=recipe):
        layer(x)
    assert fwd.scale[0].item() == f32(E4M3_MAX / amax(x))


def test_step_after_a_discarded_one_records_the_weight_amax():
    """Discarded amaxes include the weight's: its FP8 copy cached in the failed step must be
    remade (recording the amax again), or the next scale update misses the weight."""
    layer = make_layer()
    recipe = DelayedScaling(amax_history_len=1)
    x = torch.randn(3, IN)
    with pytest.raises(RuntimeError, match="step failed"), te.autocast(recipe=recipe):
        layer(x)
        raise RuntimeError("step failed")
    with te.autocast(recipe=recipe):
        layer(x)
        fwd, _ = states(layer, 1)
        assert fwd.amax_history[0].tolist() == [amax(x), amax(layer.weight), 0.0]
    assert fwd.scale[1].item() == f32(E4M3_MAX / amax(layer.weight))


def test_disabled_region_inside_fp8_region_runs_high_precision():
    layer = te.Linear(IN, OUT, bias=True)
    x = torch.randn(4, IN)
    recipe = DelayedScaling(amax_history_len=4)
    with te.autocast(recipe=recipe):
        with te.autocast(enabled=False):
            y_hp = layer(x)
        y_fp8 = layer(x)
    assert torch.equal(y_hp, F.linear(x, layer.weight, layer.bias))
    assert not torch.equal(y_fp8, y_hp)
    # Only the FP8 forward recorded: its amaxes, not the disabled region's, made the scales.
    fwd, _ = states(layer, 4)
    assert fwd.scale[0].item() == f32(E4M3_MAX / amax(x))


def delayed_state_untouched(layer) -> bool:
    """Whether no forward or backward recorded into or updated any delayed-scaling state of
    `layer` (the default history length's state is made with the module)."""
    states = [s for pair in layer._delayed_states.values() for s in pair]
    return layer.get_extra_state().numel() == 0 and all(
        not s.amax_history.any() and bool((s.scale == 1).all()) and s.generation == 0
        for s in states
    )


def test_current_scaling_keeps_no_delayed_state():
    layer = make_layer()
    assert delayed_state_untouched(layer)
    with te.autocast(recipe=Float8CurrentScaling()):
        layer(torch.randn(3, IN))
        assert autocast_state().pending_forward == {}
    assert delayed_state_untouched(layer)


# -- threads ---------------------------------------------------------------------------------------


def test_autocast_is_per_thread():
    """A region entered in one thread leaves another thread's modules in high precision, and
    the other way round; each thread sees its own depth and recipe."""
    import threading

    layer = make_layer(bias=True)
    x = torch.randn(16, IN)
    y_hp = F.linear(x, layer.weight, layer.bias)
    inside, release = threading.Event(), threading.Event()
    seen = {}

    def holder():
        with te.autocast(recipe=Float8CurrentScaling()):
            seen["holder_enabled"] = autocast_state().enabled
            seen["holder_y"] = layer(x)
            inside.set()
            release.wait(timeout=30)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert inside.wait(timeout=30)
        state = autocast_state()
        assert (state.enabled, state.depth) == (False, 0)
        with torch.no_grad():
            assert torch.equal(layer(x), y_hp)
        assert delayed_state_untouched(layer)
    finally:
        release.set()
        thread.join()
    assert seen["holder_enabled"] is True
    assert not torch.equal(seen["holder_y"], y_hp)  # the holder's own module call ran FP8
    assert_clean_state()


def test_backward_update_after_threaded_backward():
    """A delayed-scaling backward run from another thread still updates the backward scales
    at the end of its pass."""
    import threading

    layer = make_layer()
    x = torch.randn(16, IN, requires_grad=True)
    with te.autocast(recipe=DelayedScaling(amax_history_len=2)):
        y = layer(x)
    dy = torch.randn_like(y)
    thread = threading.Thread(target=y.backward, args=(dy,))
    thread.start()
    thread.join()
    _, bwd = states(layer, 2)
    assert bwd.scale[0].item() == f32(E5M2_MAX / amax(dy))
    assert pending_backward_updates() == {}
