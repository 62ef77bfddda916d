"""te.checkpoint: a checkpointed block equals the same block kept, bit for bit, in every recipe:
outputs, gradients, and (delayed scaling) the scales and amax histories after each step, over
steps whose scales move between the forward and the recompute."""

from __future__ import annotations

import copy

import pytest
import torch
from tolerances import representable

import torchte as te
from torchte import recipe

pytestmark = pytest.mark.usefixtures("cpu_default_device")

RECIPES = {
    "bf16": None,
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "current": lambda: recipe.Float8CurrentScaling(),
    "calibrating": "calibrating",
}
SPLITS = [16, 0, 32, 16]


def _region(name):
    make = RECIPES[name]
    if make is None:
        return te.autocast(enabled=False)
    if make == "calibrating":
        return te.autocast(enabled=False, calibrating=True, recipe=recipe.DelayedScaling())
    return te.autocast(recipe=make())


def _block(kind: str):
    kw = {"params_dtype": torch.bfloat16}
    if kind == "Linear":
        return torch.nn.Sequential(te.Linear(64, 64, **kw), te.Linear(64, 64, **kw))
    if kind == "LayerNormMLP":
        return te.LayerNormMLP(64, 128, activation="swiglu", **kw)
    return te.ops.Sequential(
        te.ops.GroupedLinear(4, 64, 128, dtype=torch.bfloat16),
        te.ops.ScaledSwiGLU(),
        te.ops.GroupedLinear(4, 64, 64, dtype=torch.bfloat16, scale_bias=True),
    )


def _call(block, x, probs, checkpointed: bool):
    args = (x, SPLITS, probs, SPLITS, probs) if isinstance(block, te.ops.Sequential) else (x,)
    if checkpointed:
        return te.checkpoint(block, *args)
    return block(*args)


def _states(block):
    """Every delayed-scaling tensor of the block's te modules, in order."""
    out = []
    for module in block.modules():
        for pair in getattr(module, "_delayed_states", {}).values():
            for state in pair:
                out += [state.scale, state.amax_history]
    return out


@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP", "grouped MLP"])
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_checkpointed_equals_kept_bit_for_bit(kind, recipe_name):
    torch.manual_seed(0)
    block = _block(kind)
    twin = copy.deepcopy(block)
    for step in range(3):  # scales move at every step's end, before the recompute
        gen = torch.Generator().manual_seed(step)
        x = representable((64, 64), torch.bfloat16, generator=gen).to(torch.bfloat16)
        probs = representable(64, torch.bfloat16, generator=gen).abs()
        dy = representable((64, 64), torch.bfloat16, generator=gen).to(torch.bfloat16)
        results = []
        for module, checkpointed in ((block, True), (twin, False)):
            xi = x.clone().requires_grad_(True)
            pi = probs.clone().requires_grad_(True)
            with _region(recipe_name):
                y = _call(module, xi, pi, checkpointed)
            y.backward(dy)
            grads = [p.grad.clone() for p in module.parameters()]
            module.zero_grad(set_to_none=True)
            results.append((y.detach(), xi.grad, pi.grad, grads, _states(module)))
        got, want = results
        for a, b in zip(got[:3], want[:3], strict=True):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), step
        for a, b in zip(got[3] + got[4], want[3] + want[4], strict=True):
            assert torch.equal(a, b), step


def test_checkpoint_saves_less_and_passes_keyword_arguments():
    block = te.Linear(64, 64)
    x = torch.randn(8, 64, requires_grad=True)
    seen = []

    def function(inp, *, scale):
        seen.append(scale)
        return block(inp) * scale

    y = te.checkpoint(function, x, scale=2.0)
    y.sum().backward()
    assert seen == [2.0, 2.0]  # the forward, then the recompute
    torch.testing.assert_close(x.grad, 2.0 * block.weight.sum(0).expand(8, 64))


def test_checkpoint_replays_the_rng_tracker():
    class Tracker:
        def __init__(self) -> None:
            self.states = {"model-parallel": torch.get_rng_state()}

        def get_states(self):
            return dict(self.states)

        def set_states(self, states):
            self.states = dict(states)

    tracker = Tracker()
    draws = []

    def function(inp):
        generator = torch.Generator().set_state(tracker.states["model-parallel"])
        noise = torch.rand(inp.shape, generator=generator)
        tracker.states["model-parallel"] = generator.get_state()
        draws.append(noise)
        return inp * noise

    x = torch.randn(4, 4, requires_grad=True)
    te.checkpoint(function, x, get_rng_state_tracker=lambda: tracker).sum().backward()
    assert len(draws) == 2 and torch.equal(draws[0], draws[1])
    assert torch.equal(x.grad, draws[0])


def test_checkpoint_refuses_what_it_cannot_do(monkeypatch):
    import torchte.recompute as recompute

    group = object()  # stands for a process group of two ranks
    monkeypatch.setattr(recompute, "_group_size", lambda g: 2 if g is group else 1)
    with pytest.raises(NotImplementedError, match="distribute_saved_activations"):
        te.checkpoint(torch.sin, torch.ones(2), distribute_saved_activations=True, tp_group=group)
    # tp_group alone (Megatron-Core passes it on every call) and a one-rank distribution run
    x = torch.ones(2, requires_grad=True)
    assert torch.equal(te.checkpoint(torch.sin, x, tp_group=group), torch.sin(x))
    assert torch.equal(te.checkpoint(torch.sin, x, distribute_saved_activations=True), torch.sin(x))
    with pytest.raises(TypeError, match="callable"):
        te.checkpoint(3, torch.ones(2))
