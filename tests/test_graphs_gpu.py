"""te.make_graphed_callables on a GPU: graphed and eager training give the same losses and
gradients over several steps (delayed scaling's scales move between them)."""

from __future__ import annotations

import pytest
import torch

import torchte as te
from torchte.recipe import DelayedScaling, Float8CurrentScaling

pytestmark = pytest.mark.gpu

RECIPES = {
    "bf16": None,
    "delayed": DelayedScaling(amax_history_len=4),
    "current": Float8CurrentScaling(),
}


def make(kind: str):
    torch.manual_seed(0)
    kw = {"params_dtype": torch.bfloat16, "device": "cuda"}
    if kind == "linear":
        return te.Linear(256, 256, **kw)
    return te.LayerNormMLP(256, 1024, **kw)


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_graphed_training_equals_eager(kind, recipe_name):
    fp8 = RECIPES[recipe_name]
    eager, graphed = make(kind), make(kind)
    sample = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed = te.make_graphed_callables(
        graphed, (sample,), fp8_enabled=fp8 is not None, fp8_recipe=fp8
    )
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_g = torch.optim.SGD(graphed.parameters(), lr=0.1)
    for step in range(5):
        x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
        with te.autocast(enabled=fp8 is not None, recipe=fp8):
            loss_e = eager(x.clone().requires_grad_()).float().square().mean()
        loss_g = graphed(x.clone().requires_grad_()).float().square().mean()
        loss_e.backward()
        loss_g.backward()
        assert torch.equal(loss_e, loss_g), step
        for pe, pg in zip(eager.parameters(), graphed.parameters(), strict=True):
            assert torch.equal(pe.grad, pg.grad), step
        opt_e.step()
        opt_g.step()
        opt_e.zero_grad(set_to_none=False)
        opt_g.zero_grad(set_to_none=False)
