"""te.GroupedLinear built under te.quantized_model_init: G FP8 weight parameters (Float8Tensor,
each made by its GEMM's weight quantizer as te.Linear makes its own), their bytes one grouped
buffer that the grouped FP8 path reads in place. Against G te.Linear built under the same
setting from the same seed: the same FP8 bytes, and output, input gradient and parameter
gradients bit for bit over training steps in which an optimizer updates the FP8 weights.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from tolerances import representable

import torchte as te
from torchte.recipe import DelayedScaling, Float8CurrentScaling

pytestmark = pytest.mark.usefixtures("cpu_default_device")

K, N = 32, 48
RECIPES = {"delayed": DelayedScaling(amax_history_len=4), "current": Float8CurrentScaling()}
SPLITS = [5, 0, 11, 3]


def make_pair(fp8_recipe, dtype=torch.bfloat16, seed=3, **kwargs):
    """A GroupedLinear and G te.Linear built under quantized_model_init(fp8_recipe) from one
    seed (the same weight draws), biases set to the same nonzero values; kwargs go to both."""
    groups = len(SPLITS)
    with te.quantized_model_init(recipe=fp8_recipe):
        torch.manual_seed(seed)
        grouped = te.GroupedLinear(groups, K, N, params_dtype=dtype, **kwargs)
        torch.manual_seed(seed)
        stack = [te.Linear(K, N, params_dtype=dtype, **kwargs) for _ in range(groups)]
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for g, layer in enumerate(stack):
            b = representable(N, torch.bfloat16, generator=gen).to(dtype)
            getattr(grouped, f"bias{g}").copy_(b)
            layer.bias.copy_(b)
    return grouped, stack


def fp8_bytes(weight) -> tuple[torch.Tensor, torch.Tensor]:
    storage = weight._storage
    return storage.rowwise_data.view(torch.uint8), storage.scale_inv


def weights(grouped) -> list:
    return [getattr(grouped, f"weight{g}") for g in range(grouped.num_gemms)]


def step(grouped, stack, fp8_recipe, x, dy):
    """One forward and backward of both; (grouped results, stack results), each
    (y, dx, [weight grads], [bias grads])."""
    out = []
    for which in (grouped, stack):
        xi = x.clone().requires_grad_()
        with te.autocast(enabled=fp8_recipe is not None, recipe=fp8_recipe):
            if which is grouped:
                y = grouped(xi, SPLITS)
            else:
                parts = xi.split(SPLITS)
                y = torch.cat([layer(p) for layer, p in zip(stack, parts, strict=True)])
        y.backward(dy)
        layers = [grouped] if which is grouped else stack
        params = [p for layer in layers for p in layer.parameters()]
        w = [p.grad for p in params if isinstance(p, te.Float8Tensor)]
        b = [p.grad for p in params if not isinstance(p, te.Float8Tensor)]
        out.append((y.detach(), xi.grad, w, b))
    return out


def assert_identical(got, want, what: str) -> None:
    for name, a, b in zip(("y", "dx", "dw", "db")[: len(got)], got, want, strict=True):
        a, b = (a, b) if isinstance(a, list) else ([a], [b])
        for i, (ta, tb) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(ta, tb), f"{what}: {name}[{i}] differs"


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_fp8_weights_in_one_buffer(recipe_name):
    grouped, stack = make_pair(RECIPES[recipe_name])
    ws = weights(grouped)
    assert all(isinstance(w, te.Float8Tensor) and w.dtype == torch.bfloat16 for w in ws)
    assert not any(isinstance(getattr(grouped, f"bias{g}"), te.Float8Tensor) for g in range(4))
    rows = [w._storage.rowwise_data.data_ptr() for w in ws]
    assert rows == [rows[0] + g * N * K for g in range(len(ws))]  # one (G * N, K) buffer
    scales = [w._storage.scale_inv.data_ptr() for w in ws]
    assert scales == [scales[0] + 4 * g for g in range(len(ws))]
    for w, layer in zip(ws, stack, strict=True):  # te.Linear's bytes and scales
        for a, b in zip(fp8_bytes(w), fp8_bytes(layer.weight), strict=True):
            assert torch.equal(a, b)
    assert 0.015 < ws[0].dequantize().float().std().item() < 0.031  # the init's spread


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_trains_as_a_stack_of_linear(recipe_name):
    """Steps with SGD updates of the FP8 weights in between (requantized in place): every
    result bit for bit as the stack's, the forward reading the parameters' own bytes."""
    fp8_recipe = RECIPES[recipe_name]
    grouped, stack = make_pair(fp8_recipe)
    assert grouped._plan(torch.bfloat16, None, False, False).mode == "per_group"
    opts = [torch.optim.SGD(m.parameters(), lr=0.25) for m in (grouped, *stack)]
    address = weights(grouped)[0]._storage.rowwise_data.data_ptr()
    for i in range(3):
        x = representable((sum(SPLITS), K), torch.bfloat16).bfloat16()
        dy = representable((sum(SPLITS), N), torch.bfloat16, scale=0.25).bfloat16()
        got, want = step(grouped, stack, fp8_recipe, x, dy)
        assert_identical(got, want, f"{recipe_name} step {i}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
    ws = weights(grouped)
    assert ws[0]._storage.rowwise_data.data_ptr() == address  # updated in place
    _, viewed = grouped._fp8_weight_group[0]
    assert viewed.rowwise_data.data_ptr() == address  # the grouped GEMMs read them in place
    for w, layer in zip(ws, stack, strict=True):
        for a, b in zip(fp8_bytes(w), fp8_bytes(layer.weight), strict=True):
            assert torch.equal(a, b)


def test_high_precision_and_fused_wgrad():
    """Outside te.autocast (the weights dequantized, per group) and with main_grad: as the
    stack."""
    fp8_recipe = RECIPES["current"]
    grouped, stack = make_pair(fp8_recipe, dtype=torch.float32, fuse_wgrad_accumulation=True)
    for w in [*weights(grouped), *(layer.weight for layer in stack)]:
        w.main_grad = torch.zeros(w.shape)
    for recipe_on in (None, fp8_recipe):
        x = representable((sum(SPLITS), K), torch.bfloat16)
        dy = representable((sum(SPLITS), N), torch.bfloat16, scale=0.25)
        got, want = step(grouped, stack, recipe_on, x, dy)
        assert_identical(got[:2], want[:2], f"recipe {recipe_on}")  # dw: into main_grad
        assert all(torch.equal(a, b) for a, b in zip(got[3], want[3], strict=True))
    for w, layer, rows in zip(weights(grouped), stack, SPLITS, strict=True):
        assert torch.equal(w.main_grad, layer.weight.main_grad)
        assert (w.main_grad.abs().sum() > 0) == (rows > 0)


def test_scattered_weights_are_copied_or_regrouped():
    """Weights no longer one buffer (one replaced by hand; a deep copy): the forward copies
    them into one group (the same result), and a copy of the module packs them again."""
    fp8_recipe = RECIPES["current"]
    grouped, _ = make_pair(fp8_recipe)
    x = representable((sum(SPLITS), K), torch.bfloat16).bfloat16()
    with te.autocast(recipe=fp8_recipe):
        want = grouped(x, SPLITS)
    clone = copy.deepcopy(grouped)
    storage = weights(grouped)[1]._storage
    storage.rowwise_data = storage.rowwise_data.clone()  # bytes kept, buffer left
    with te.autocast(recipe=fp8_recipe):
        assert torch.equal(grouped(x, SPLITS), want)
        assert torch.equal(clone(x, SPLITS), want)
    rows = [w._storage.rowwise_data.data_ptr() for w in weights(clone)]
    assert rows == [rows[0] + g * N * K for g in range(len(rows))]


def test_state_dict_and_reset_parameters():
    fp8_recipe = RECIPES["delayed"]
    src, _ = make_pair(fp8_recipe, seed=1)
    dst, _ = make_pair(fp8_recipe, seed=2)
    buf = io.BytesIO()
    torch.save(src.state_dict(), buf)
    buf.seek(0)
    dst.load_state_dict(torch.load(buf))
    for a, b in zip(weights(src), weights(dst), strict=True):
        assert torch.equal(fp8_bytes(a)[0], fp8_bytes(b)[0])
    address = weights(dst)[0]._storage.rowwise_data.data_ptr()
    torch.manual_seed(3)
    dst.reset_parameters()
    fresh, _ = make_pair(fp8_recipe, seed=3)  # the same draws, made at construction
    for a, b in zip(weights(dst), weights(fresh), strict=True):
        assert torch.equal(fp8_bytes(a)[0], fp8_bytes(b)[0])
    assert weights(dst)[0]._storage.rowwise_data.data_ptr() == address
