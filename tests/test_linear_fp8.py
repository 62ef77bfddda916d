"""te.Linear under FP8 (DelayedScaling, Float8CurrentScaling) on the CPU emulation.

Numerics are checked two ways: against an fp64 reference built from the dequantized operands
(each operand quantized here with the quantizer classes and the layer's own scales, so the only
difference left is fp32 accumulation and the output rounding), and against the high-precision
reference with the FP8 tolerance (e4m3 forward; e5m2 gradients under HYBRID).
"""

from __future__ import annotations

import io

import pytest
import torch
from tolerances import assert_close, representable

import torchte as te
import torchte.module._linear_core as linear_module
from torchte import _nvtx
from torchte.autocast import autocast_state
from torchte.quantization.float8 import Float8CurrentScalingQuantizer, Float8Quantizer
from torchte.recipe import DelayedScaling, Float8CurrentScaling

pytestmark = pytest.mark.usefixtures("cpu_default_device")


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = [DelayedScaling(amax_history_len=4), Float8CurrentScaling()]
RECIPE_IDS = ["delayed", "current"]
FP8_SHAPES = [(16, 16, 1), (32, 48, 3), (48, 32, 17), (64, 16, 127)]


def make_layer(in_f, out_f, dtype=torch.float32, bias=True, **kwargs):
    layer = te.Linear(in_f, out_f, bias=bias, params_dtype=dtype, **kwargs)
    with torch.no_grad():
        layer.weight.copy_(representable((out_f, in_f), torch.bfloat16, scale=0.125))
        if bias:
            layer.bias.copy_(representable(out_f, torch.bfloat16))
    return layer


def dequantized(t: torch.Tensor, recipe, fp8_dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """fp64 value of `t` (..., K) quantized as the layer does: data * scale_inv, reshaped 2-D."""
    if isinstance(recipe, DelayedScaling):
        quantizer = Float8Quantizer(scale.clone().reshape(1), torch.zeros(1), fp8_dtype)
    else:
        quantizer = Float8CurrentScalingQuantizer(
            fp8_dtype, power_2_scale=recipe.use_power_2_scales, amax_epsilon=recipe.amax_epsilon
        )
    q = quantizer.quantize(t.reshape(-1, t.shape[-1]), rowwise=True, columnwise=False)
    return q.rowwise_data.double() * q.scale_inv.double()


def scales(layer, recipe):
    """(input, weight, grad_output) scales the next step will use (None under current scaling)."""
    if not isinstance(recipe, DelayedScaling):
        return None, None, None
    if recipe.amax_history_len not in layer._delayed_states:
        return torch.ones(1), torch.ones(1), torch.ones(1)  # the state a first step starts from
    fwd, bwd = layer._delayed_states[recipe.amax_history_len]
    return fwd.scale[0].clone(), fwd.scale[1].clone(), bwd.scale[0].clone()


def fp8_step(layer, x, dy, recipe, **forward_kwargs):
    """One FP8 forward (under autocast) and backward: (y, dx, dW, db)."""
    x = x.detach().requires_grad_()
    with te.autocast(recipe=recipe):
        y = layer(x, **forward_kwargs)
    y.backward(dy)
    bias = layer.bias.grad if layer.bias is not None else None
    return y, x.grad, layer.weight.grad, bias


def check_step(layer, recipe, x, dy, dtype):
    """Run one step and compare with the dequantized fp64 reference and the hp reference."""
    x_scale, w_scale, dy_scale = scales(layer, recipe)
    fwd_dtype, bwd_dtype = recipe.fp8_format.fwd_dtype, recipe.fp8_format.bwd_dtype
    weight = layer.weight.detach().clone()
    bias = layer.bias.detach().clone() if layer.bias is not None else None
    xq = dequantized(x, recipe, fwd_dtype, x_scale)
    wq = dequantized(weight, recipe, fwd_dtype, w_scale)
    dyq = dequantized(dy, recipe, bwd_dtype, dy_scale)

    layer.zero_grad()
    y, dx, dw, db = fp8_step(layer, x, dy, recipe)
    assert y.dtype == dtype and y.shape == (*x.shape[:-1], weight.shape[0])
    assert dx.shape == x.shape and dw.dtype == dtype

    # Within the output dtype's tolerance of the dequantized fp64 reference.
    y_ref = xq @ wq.t() + (bias.double() if bias is not None else 0)
    assert_close(y.reshape(-1, y.shape[-1]), y_ref, dtype, msg="forward vs dequantized")
    assert_close(dx.reshape(-1, x.shape[-1]), dyq @ wq, dtype, msg="dgrad vs dequantized")
    assert_close(dw, dyq.t() @ xq, dtype, msg="wgrad vs dequantized")
    # Within the FP8 tolerance of the high-precision reference.
    x64, w64, dy64 = x.double(), weight.double(), dy.double()
    hp_y = x64 @ w64.t() + (bias.double() if bias is not None else 0)
    assert_close(y, hp_y, fwd_dtype, msg="forward vs hp")
    assert_close(dx, dy64 @ w64, bwd_dtype, msg="dgrad vs hp")
    dy2d, x2d = dy64.reshape(-1, dy64.shape[-1]), x64.reshape(-1, x64.shape[-1])
    assert_close(dw, dy2d.t() @ x2d, bwd_dtype, msg="wgrad vs hp")
    if bias is not None:
        # The bias gradient is taken from the high-precision dy.
        assert_close(db, dy2d.sum(0), dtype, msg="bias grad")


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("in_f,out_f,tokens", FP8_SHAPES)
def test_fp8_numerics(recipe, dtype, in_f, out_f, tokens):
    layer = make_layer(in_f, out_f, dtype)
    # Three steps: under delayed scaling the later ones use scales from the amax history. The
    # input shrinks (a growing one would saturate under the older, larger delayed scale).
    for step in range(3):
        x = representable((tokens, in_f), torch.bfloat16, scale=2.0**-step).to(dtype)
        dy = representable((tokens, out_f), torch.bfloat16, scale=2.0**-4).to(dtype)
        check_step(layer, recipe, x, dy, dtype)
    if isinstance(recipe, DelayedScaling):
        assert scales(layer, recipe)[0].item() != 1.0  # the later steps did use new scales


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_fp8_extra_leading_dims(recipe):
    layer = make_layer(32, 16)
    for _ in range(2):
        x = representable((2, 3, 32), torch.bfloat16)
        dy = representable((2, 3, 16), torch.bfloat16, scale=0.25)
        check_step(layer, recipe, x, dy, torch.float32)


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_zero_tokens(recipe, dtype):
    layer = make_layer(32, 16, dtype)
    x = torch.empty(0, 32, dtype=dtype)
    y, dx, dw, db = fp8_step(layer, x, torch.empty(0, 16, dtype=dtype), recipe)
    assert y.shape == (0, 16) and y.dtype == dtype
    assert dx.shape == (0, 32)
    assert torch.equal(dw, torch.zeros(16, 32, dtype=dtype))
    assert torch.equal(db, torch.zeros(16, dtype=dtype))
    # Empty tensors record no amax: the input and grad_output scales are kept (the weight's
    # amax was recorded when it was quantized).
    if isinstance(recipe, DelayedScaling):
        x_scale, w_scale, dy_scale = scales(layer, recipe)
        assert (x_scale.item(), dy_scale.item()) == (1.0, 1.0)
        assert w_scale.item() == 448.0 / layer.weight.abs().max().item()
    # A following non-empty step still works.
    x = representable((3, 32), torch.bfloat16).to(dtype)
    check_step(layer, recipe, x, representable((3, 16), torch.bfloat16).to(dtype), dtype)


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_fp8_one_token(recipe):
    layer = make_layer(16, 32)
    for _ in range(2):
        x = representable((1, 16), torch.bfloat16)
        check_step(layer, recipe, x, representable((1, 32), torch.bfloat16), torch.float32)


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_fp8_without_bias_and_input_without_grad(recipe):
    layer = make_layer(32, 16, bias=False)
    x = representable((5, 32), torch.bfloat16)
    with te.autocast(recipe=recipe):
        y = layer(x)  # x needs no grad: no dgrad, wgrad only
    y.backward(torch.ones(5, 16))
    assert layer.weight.grad is not None
    assert_close(layer.weight.grad, torch.ones(16, 5).double() @ x.double(), E5M2)


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_fp8_return_bias(recipe):
    layer = make_layer(32, 16, return_bias=True)
    x = representable((3, 32), torch.bfloat16)
    with te.autocast(recipe=recipe):
        out, bias = layer(x)
    assert bias is layer.bias
    assert_close(out, x.double() @ layer.weight.double().t(), E4M3)


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_fp8_no_grad_forward(recipe):
    layer = make_layer(32, 16)
    x = representable((3, 32), torch.bfloat16)
    with torch.no_grad(), te.autocast(recipe=recipe):
        y = layer(x)
    assert not y.requires_grad
    assert_close(y, x.double() @ layer.weight.double().t() + layer.bias.double(), E4M3)


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_fp8_one_dimensional_and_non_contiguous_input(recipe):
    layer = make_layer(32, 16)
    x1 = representable(32, torch.bfloat16).requires_grad_()
    with te.autocast(recipe=recipe):
        y1 = layer(x1)
    y1.backward(torch.ones(16))
    assert y1.shape == (16,) and x1.grad.shape == (32,)
    assert_close(y1, layer.weight.double() @ x1.double() + layer.bias.double(), E4M3)
    x_t = representable((32, 5), torch.bfloat16).t()  # (5, 32), not contiguous
    with te.autocast(recipe=recipe):
        y_t = layer(x_t)
    assert_close(y_t, x_t.double() @ layer.weight.double().t() + layer.bias.double(), E4M3)


def test_default_autocast_uses_delayed_scaling():
    layer = make_layer(32, 16)
    with te.autocast():
        layer(torch.randn(3, 32))
    assert list(layer._fp8_setups) == [DelayedScaling()]
    fwd, _ = layer._delayed_states[1024]
    assert fwd.amax_history.shape == (1024, 3)
    assert fwd.scale[0].item() != 1.0


# -- exception safety -----------------------------------------------------------------------------


def failing_gemm(*args, **kwargs):
    raise RuntimeError("gemm failed")


def test_exception_in_delayed_forward_leaves_no_trace(monkeypatch):
    monkeypatch.setattr(_nvtx, "ENABLED", True)
    recipe = DelayedScaling(amax_history_len=4)
    layer = make_layer(32, 16)
    x = representable((3, 32), torch.bfloat16)
    with te.autocast(recipe=recipe):
        layer(x)  # a first step gives non-trivial scales
    fwd, _ = layer._delayed_states[4]
    scale_before, history_before = fwd.scale.clone(), fwd.amax_history.clone()
    assert _nvtx.open_ranges() == 0

    seen_at_gemm = []

    def recording_failing_gemm(*args, **kwargs):
        seen_at_gemm.append(fwd.amax_history[0].clone())
        raise RuntimeError("gemm failed")

    with monkeypatch.context() as patch:
        patch.setattr(linear_module, "fp8_gemm", recording_failing_gemm)
        with pytest.raises(RuntimeError, match="gemm failed"), te.autocast(recipe=recipe):
            layer(4 * x)
    # The GEMM failed after the input was quantized: its amax had been recorded.
    assert seen_at_gemm[0][0].item() == 4 * x.abs().max().item()

    assert fwd.amax_history[0].abs().sum().item() == 0.0
    assert torch.equal(fwd.amax_history, history_before)
    assert torch.equal(fwd.scale, scale_before)
    state = autocast_state()
    assert state.enabled is False and state.depth == 0 and state.pending_forward == {}
    assert _nvtx.open_ranges() == 0
    # The next forward works and records as usual.
    with te.autocast(recipe=recipe):
        y = layer(x)
        assert fwd.amax_history[0, 0].item() == x.abs().max().item()
    assert_close(y, x.double() @ layer.weight.double().t() + layer.bias.double(), E4M3)
    assert _nvtx.open_ranges() == 0


def test_forward_after_a_failed_one_records_the_weight_amax(monkeypatch):
    """The failed forward's amaxes are discarded, so its cached FP8 weight must not be reused
    without recording the weight's amax: the next step's weight scale must come out right."""
    recipe = DelayedScaling(amax_history_len=1)
    layer = make_layer(32, 16)
    x = representable((3, 32), torch.bfloat16)
    with monkeypatch.context() as patch:
        patch.setattr(linear_module, "fp8_gemm", failing_gemm)
        with pytest.raises(RuntimeError, match="gemm failed"), te.autocast(recipe=recipe):
            layer(x)
    with te.autocast(recipe=recipe):
        layer(x)
        fwd, _ = layer._delayed_states[1]
        assert fwd.amax_history[0, 1].item() == layer.weight.abs().max().item()
    expected = torch.tensor(448.0, dtype=torch.float64) / layer.weight.abs().max().double()
    assert fwd.scale[1].item() == expected.float().item()


def test_exception_in_second_forward_of_a_step_drops_the_step_amaxes(monkeypatch):
    """A failed forward caught inside the step leaves none of its amaxes in the history: the
    module's amaxes of that step are dropped whole and its scales stay as they were."""
    recipe = DelayedScaling(amax_history_len=4)
    layer = make_layer(32, 16)
    x_small = representable((3, 32), torch.bfloat16)
    x_large = 64 * x_small
    with te.autocast(recipe=recipe):
        layer(x_small)
    fwd, _ = layer._delayed_states[4]
    scale_before = fwd.scale.clone()
    history_before = fwd.amax_history.clone()
    with te.autocast(recipe=recipe):
        layer(x_small)
        with monkeypatch.context() as patch:
            patch.setattr(linear_module, "fp8_gemm", failing_gemm)
            with pytest.raises(RuntimeError, match="gemm failed"):
                layer(x_large)
    assert torch.equal(fwd.scale, scale_before)
    assert torch.equal(fwd.amax_history, history_before)
    assert not fwd.amax_history[0].any()
    # The next step records and updates again, from the small input only.
    with te.autocast(recipe=recipe):
        layer(x_small)
    expected = torch.tensor(448.0, dtype=torch.float64) / x_small.abs().max().double()
    assert fwd.scale[0].item() == expected.float().item()


# -- weight FP8 cache -----------------------------------------------------------------------------


@pytest.fixture
def weight_quantize_calls(monkeypatch):
    """Counts quantize() calls whose argument is a te.Linear weight parameter."""
    calls = []
    for cls in (Float8Quantizer, Float8CurrentScalingQuantizer):
        original = cls.quantize

        def spy(self, x_hp, *, _original=original, **kwargs):
            if isinstance(x_hp, torch.nn.Parameter):
                calls.append(x_hp)
            return _original(self, x_hp, **kwargs)

        monkeypatch.setattr(cls, "quantize", spy)
    return calls


def test_weight_quantized_once_per_change_current_scaling(weight_quantize_calls):
    recipe = Float8CurrentScaling()
    layer = make_layer(32, 16)
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    x = representable((3, 32), torch.bfloat16)
    with te.autocast(recipe=recipe):
        y1 = layer(x)
        y2 = layer(x)
    (y1 + y2).sum().backward()
    assert len(weight_quantize_calls) == 1
    assert weight_quantize_calls[0] is layer.weight
    assert torch.equal(y1, y2)
    opt.step()  # an in-place change of the weight: requantize
    with te.autocast(recipe=recipe):
        y3 = layer(x)
        assert len(weight_quantize_calls) == 2
        layer(x)
        assert len(weight_quantize_calls) == 2
    # The forward used the new weight.
    assert_close(y3, x.double() @ layer.weight.double().t() + layer.bias.double(), E4M3)
    assert not torch.equal(y3, y1)


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("how", ["data", "detach", "no_grad"])
def test_weight_change_between_steps_is_seen(recipe, how):
    """However a training loop writes the weight between steps, the next FP8 forward uses the
    new value (Megatron-style optimizers and manual inits write through `.data`)."""
    layer = make_layer(32, 16, bias=False)
    x = representable((3, 32), torch.bfloat16)
    with te.autocast(recipe=recipe):
        layer(x)
    # Smaller than before, so a delayed scale from the old weight does not saturate it.
    new_weight = -0.5 * layer.weight.detach().clone()
    if how == "data":
        layer.weight.data.copy_(new_weight)
    elif how == "detach":
        layer.weight.detach().copy_(new_weight)
    else:
        with torch.no_grad():
            layer.weight.copy_(new_weight)
    with te.autocast(recipe=recipe):
        y = layer(x)
    assert_close(y, x.double() @ new_weight.double().t(), E4M3)


def test_weight_cache_within_and_across_delayed_steps(weight_quantize_calls):
    recipe = DelayedScaling(amax_history_len=4)
    layer = make_layer(32, 16)
    x = representable((3, 32), torch.bfloat16)
    with te.autocast(recipe=recipe):
        layer(x)
        layer(x)
        layer(x)
    assert len(weight_quantize_calls) == 1
    # The scales moved when the step ended: the cached copy is stale.
    with te.autocast(recipe=recipe):
        layer(x)
    assert len(weight_quantize_calls) == 2


def test_is_first_microbatch_controls_requantization(weight_quantize_calls):
    recipe = Float8CurrentScaling()
    layer = make_layer(32, 16)
    x = representable((3, 32), torch.bfloat16)
    with te.autocast(recipe=recipe):
        y1 = layer(x, is_first_microbatch=True)
        layer(x, is_first_microbatch=False)
        assert len(weight_quantize_calls) == 1
        with torch.no_grad():
            layer.weight.mul_(2)
        # False: reuse the cached copy even though the weight changed (microbatches of a step).
        y_reused = layer(x, is_first_microbatch=False)
        assert len(weight_quantize_calls) == 1
        assert torch.equal(y_reused, y1)
        # True: always requantize.
        y_new = layer(x, is_first_microbatch=True)
        assert len(weight_quantize_calls) == 2
        layer(x, is_first_microbatch=True)
        assert len(weight_quantize_calls) == 3
    assert not torch.equal(y_new, y1)


# -- state_dict and checkpoint resume ------------------------------------------------------------


def test_state_dict_holds_delayed_scaling_state():
    recipe = DelayedScaling(amax_history_len=4)
    layer = make_layer(32, 16)
    assert layer.state_dict()["_extra_state"].numel() == 0
    fp8_step(layer, torch.randn(3, 32), torch.randn(3, 16), recipe)
    saved = layer.state_dict()["_extra_state"]
    assert saved.dtype == torch.uint8  # Transformer Engine's form, read back below
    reader = make_layer(32, 16)
    reader.set_extra_state(saved)
    extra = reader._scaling_state()
    fwd, bwd = layer._delayed_states[4]
    assert extra["amax_history_len"] == 4
    assert torch.equal(extra["fwd_scale"], fwd.scale)
    assert torch.equal(extra["fwd_amax_history"], fwd.amax_history)
    assert torch.equal(extra["bwd_scale"], bwd.scale)
    assert torch.equal(extra["bwd_amax_history"], bwd.amax_history)
    assert extra["fwd_scale"][0].item() != 1.0 and extra["bwd_scale"][0].item() != 1.0
    # A copy: later steps do not change a saved state_dict.
    fp8_step(layer, 8 * torch.randn(3, 32), torch.randn(3, 16), recipe)
    assert not torch.equal(extra["fwd_scale"], fwd.scale)


def test_state_dict_saves_the_last_used_history_length():
    layer = make_layer(32, 16)
    for length in (4, 8, 4):
        with te.autocast(recipe=DelayedScaling(amax_history_len=length)):
            layer(torch.randn(3, 32))
    extra = layer._scaling_state()
    assert extra["amax_history_len"] == 4
    assert torch.equal(extra["fwd_scale"], layer._delayed_states[4][0].scale)


def two_layer_model() -> torch.nn.Sequential:
    return torch.nn.Sequential(te.Linear(32, 64), torch.nn.GELU(), te.Linear(64, 16))


def train_steps(model, opt, recipe, batches) -> list[float]:
    losses = []
    for x, target in batches:
        with te.autocast(recipe=recipe):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_checkpoint_resume_is_bit_identical():
    recipe = DelayedScaling(amax_history_len=4)
    batches = [(torch.randn(8, 32), torch.randn(8, 16)) for _ in range(6)]
    model = two_layer_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_steps(model, opt, recipe, batches[:3])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    losses = train_steps(model, opt, recipe, batches[3:])

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    torch.manual_seed(99)  # different initial weights, overwritten by the checkpoint
    fresh = two_layer_model()
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    fresh.load_state_dict(saved["model"])
    fresh_opt.load_state_dict(saved["opt"])
    fresh_losses = train_steps(fresh, fresh_opt, recipe, batches[3:])

    assert fresh_losses == losses
    for (name, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    for a, b in zip(model, fresh, strict=True):
        if isinstance(a, te.Linear):
            for s, t in zip(a._delayed_states[4], b._delayed_states[4], strict=True):
                assert torch.equal(s.scale, t.scale)
                assert torch.equal(s.amax_history, t.amax_history)


# -- convergence smoke ----------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=16), Float8CurrentScaling()])
def test_sgd_reduces_loss(recipe):
    true_w = torch.randn(16, 32) * 0.3
    x = torch.randn(64, 32)
    target = x @ true_w.t()
    model = te.Linear(32, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = train_steps(model, opt, recipe, [(x, target)] * 20)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0]
