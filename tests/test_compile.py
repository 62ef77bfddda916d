"""torch.compile of te modules under FP8: the forward and backward of te.Linear,
te.LayerNormLinear and te.LayerNormMLP compile as one graph each (fullgraph=True: a graph
break is an error) under delayed and current scaling, and train with the same numbers as eager.

Under compile the kernels run as opaque torchte:: custom ops and the FP8 weight is quantized
in the graph at every call. Delayed scaling's backward scales are updated at the next
autocast exit instead of at the end of the backward pass (a compiled backward cannot run the
end-of-pass callback); every backward still quantizes with the same scales as in eager mode,
and the states agree again after the next forward.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import torchte as te
from torchte.recipe import DelayedScaling, Float8CurrentScaling

pytestmark = pytest.mark.usefixtures("cpu_default_device")

H, FFN, TOKENS = 32, 64, 16
RECIPES = [DelayedScaling(), Float8CurrentScaling()]
RECIPE_IDS = ["delayed", "current"]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch (no cache limit reached across tests)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def build(kind: str, device=None) -> torch.nn.Module:
    if kind == "Linear":
        return te.Linear(H, FFN, device=device)
    if kind == "LayerNormLinear":
        return te.LayerNormLinear(H, FFN, device=device)
    if kind == "LayerNormMLP":
        return te.LayerNormMLP(H, FFN, activation="swiglu", device=device)
    return te.LayerNormMLP(  # "LayerNormMLP-checkpoint"
        H, FFN, normalization="RMSNorm", activation="gelu", checkpoint=True, device=device
    )


KINDS = ["Linear", "LayerNormLinear", "LayerNormMLP", "LayerNormMLP-checkpoint"]


def train_side_by_side(module, recipe, steps=3, backend="aot_eager", autocast_inside=True):
    """Train `module` compiled and an eager copy on the same batches with SGD; assert outputs
    and all gradients bit-identical at every step. Returns (compiled module, eager copy)."""
    eager = copy.deepcopy(module)
    device = next(module.parameters()).device
    opt_c = torch.optim.SGD(module.parameters(), lr=0.1)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)

    def step(mod, x):
        if autocast_inside:
            with te.autocast(recipe=recipe):
                return mod(x)
        return mod(x)

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    gen = torch.Generator().manual_seed(0)
    for i in range(steps):
        x = (torch.randn(TOKENS, H, generator=gen) * (i + 1)).to(device)
        x_c, x_e = x.clone().requires_grad_(), x.clone().requires_grad_()
        with te.autocast(recipe=recipe, enabled=not autocast_inside):
            y_c = compiled(module, x_c)
        with te.autocast(recipe=recipe):
            y_e = eager(x_e)
        assert torch.equal(y_c, y_e), f"step {i}: outputs differ"
        (y_c.float() ** 2).mean().backward()
        (y_e.float() ** 2).mean().backward()
        assert torch.equal(x_c.grad, x_e.grad), f"step {i}: input gradients differ"
        for (name, p), q in zip(module.named_parameters(), eager.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), f"step {i}: {name}.grad differs"
        opt_c.step()
        opt_e.step()
        opt_c.zero_grad()
        opt_e.zero_grad()
    return module, eager


def assert_same_scaling_state(a, b) -> None:
    for pair_a, pair_b in zip(a._delayed_states.values(), b._delayed_states.values(), strict=True):
        for s, t in zip(pair_a, pair_b, strict=True):
            assert torch.equal(s.scale, t.scale)
            assert torch.equal(s.amax_history.amax(0), t.amax_history.amax(0))


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("kind", KINDS)
def test_fp8_training_compiles_fullgraph_with_eager_numbers(kind, recipe):
    torch.manual_seed(0)
    compiled, eager = train_side_by_side(build(kind), recipe)
    # One more training forward each: its autocast exit applies the last backward's amaxes in
    # the compiled module too, so the scaling states agree again.
    x = torch.randn(TOKENS, H, requires_grad=True)
    with te.autocast(recipe=recipe):
        y_c = torch.compile(compiled, fullgraph=True, backend="aot_eager")(x)
    with te.autocast(recipe=recipe):
        y_e = eager(x)
    assert torch.equal(y_c, y_e)
    assert_same_scaling_state(compiled, eager)


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_autocast_outside_the_compiled_region(recipe):
    torch.manual_seed(1)
    train_side_by_side(te.Linear(H, FFN), recipe, autocast_inside=False)


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_fp8_weights_from_quantized_model_init(recipe):
    torch.manual_seed(2)
    with te.quantized_model_init(recipe=recipe):
        module = te.Linear(H, FFN)
    assert isinstance(module.weight, te.Float8Tensor)

    def step(mod, x):
        with te.autocast(recipe=recipe):
            return mod(x)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    eager = copy.deepcopy(module)
    for i in range(2):
        x = torch.randn(TOKENS, H) * (i + 1)
        x_c, x_e = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_c, y_e = compiled(module, x_c), step(eager, x_e)
        assert torch.equal(y_c, y_e)
        y_c.sum().backward()
        y_e.sum().backward()
        assert torch.equal(x_c.grad, x_e.grad)


def test_recompiles_once_then_reuses_the_graph():
    module = te.Linear(H, FFN)
    frames = []

    def backend(gm, example_inputs):
        frames.append(gm)
        return gm.forward

    def step(x):
        with te.autocast(recipe=Float8CurrentScaling()):
            return module(x)

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    for _ in range(5):
        compiled(torch.randn(TOKENS, H, requires_grad=True)).sum().backward()
    # The first call builds the module's plan for the setting; from the second on it is reused.
    assert len(frames) <= 2


def test_a_change_of_recipe_is_not_served_by_a_stale_graph():
    module = te.Linear(H, FFN)
    state = {"fp8": True}

    def step(x):
        with te.autocast(enabled=state["fp8"], recipe=Float8CurrentScaling()):
            return module(x)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    x = torch.randn(TOKENS, H)
    with torch.no_grad():
        y_fp8 = compiled(x)
        state["fp8"] = False
        y_hp = compiled(x)
    assert torch.equal(y_hp, F.linear(x, module.weight, module.bias))
    assert not torch.equal(y_fp8, y_hp)


def test_a_new_history_length_needs_one_eager_step_first():
    module = te.Linear(H, FFN)
    recipe = DelayedScaling(amax_history_len=16)

    def step(x):
        with te.autocast(recipe=recipe):
            return module(x)

    x = torch.randn(TOKENS, H, requires_grad=True)
    with pytest.raises(Exception, match="run one step eagerly"):
        torch.compile(step, fullgraph=True, backend="aot_eager")(x)
    step(x).sum().backward()  # eagerly: the state of that history length now exists
    torch._dynamo.reset()
    y = torch.compile(step, fullgraph=True, backend="aot_eager")(x)
    y.sum().backward()


def test_inductor():
    """A real compiler (inductor's C++ backend here) gives the eager numbers too."""
    torch.manual_seed(3)
    train_side_by_side(te.LayerNormMLP(H, FFN), Float8CurrentScaling(), steps=2,
                       backend="inductor")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("kind", KINDS)
def test_fp8_training_compiles_fullgraph_on_gpu(kind, recipe):
    """On a GPU the Triton kernels run as the custom ops' implementations; inductor compiles
    the rest. The numbers are eager's: the FP8 bytes come from the same kernels."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        module = build(kind, device="cuda").bfloat16()
    train_side_by_side(module, recipe, backend="inductor")
