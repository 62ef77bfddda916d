"""fp32 master weights under torch.autocast(bf16) compute exactly what bf16 parameters compute.

With parameter values that bf16 holds exactly, a module whose parameters are fp32, run under
torch.autocast(dtype=bfloat16), must give the same output and input gradient, bit for bit, as
the same module with bf16 parameters run without it, in bf16 and under each FP8 recipe; its
parameter gradients are fp32 and round to the bf16 module's gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch

import torchte as te
from torchte import recipe

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
RECIPES = {
    "bf16": None,
    "delayed": recipe.DelayedScaling(),
    "current": recipe.Float8CurrentScaling(),
}
TOKENS, HIDDEN, OUT = 32, 64, 48
SPLITS = [16, 16]

MODULES = {
    "Linear": lambda: te.Linear(HIDDEN, OUT),
    "LayerNormLinear": lambda: te.LayerNormLinear(HIDDEN, OUT),
    "LayerNormMLP": lambda: te.LayerNormMLP(HIDDEN, 2 * HIDDEN),
    "GroupedLinear": lambda: te.GroupedLinear(len(SPLITS), HIDDEN, OUT),
    "LayerNorm": lambda: te.LayerNorm(HIDDEN),
    "RMSNorm": lambda: te.RMSNorm(HIDDEN),
}


def _run(module, x, fp8_recipe, master: bool):
    """(output, input gradient, {name: parameter gradient}) of one forward and backward."""
    x = x.detach().requires_grad_(True)
    with (
        torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=master),
        te.autocast(enabled=fp8_recipe is not None, recipe=fp8_recipe),
    ):
        y = module(x, SPLITS) if isinstance(module, te.GroupedLinear) else module(x)
    y.backward(torch.linspace(-1, 1, y.numel(), device=y.device).view_as(y).to(y.dtype))
    return y, x.grad, {name: p.grad for name, p in module.named_parameters()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("kind", list(MODULES))
def test_fp32_parameters_under_autocast_match_bf16_parameters(device, recipe_name, kind):
    torch.manual_seed(0)
    with torch.device(device):
        master = MODULES[kind]()
        x = torch.randn(TOKENS, HIDDEN).to(torch.bfloat16)
    with torch.no_grad():
        for p in master.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # norms: weights off 1, biases off 0
            p.copy_(p.to(torch.bfloat16))  # values bf16 holds exactly
    plain = copy.deepcopy(master).to(torch.bfloat16)
    if isinstance(plain, te.LayerNormLinear | te.LayerNormMLP):
        # Under torch.autocast these run their Function; without it, with bf16 parameters,
        # torch's own ops (their `_plain` shortcut), which round elsewhere: compare the
        # Function with itself.
        plain._fast_setattr("_plain", False)
    assert all(p.dtype == torch.float32 for p in master.parameters())
    fp8_recipe = RECIPES[recipe_name]
    for _ in range(2):  # the second step runs on delayed scales the first one set
        y_m, dx_m, grads_m = _run(master, x, fp8_recipe, master=True)
        y_p, dx_p, grads_p = _run(plain, x, fp8_recipe, master=False)
        assert y_m.dtype == y_p.dtype == torch.bfloat16 and dx_m.dtype == torch.bfloat16
        assert torch.equal(y_m, y_p)
        assert torch.equal(dx_m, dx_p)
        assert grads_m.keys() == grads_p.keys()
        for name, grad in grads_m.items():
            assert grad.dtype == torch.float32, name
            assert torch.equal(grad.to(torch.bfloat16), grads_p[name]), name
        for module in (master, plain):
            module.zero_grad(set_to_none=True)


@pytest.mark.parametrize("device", DEVICES)
def test_module_to_dtype_changes_the_compute_dtype_and_drops_fp8_weight_copies(device):
    fp8 = recipe.DelayedScaling()
    with torch.device(device):
        module = te.Linear(HIDDEN, OUT)
        x = torch.randn(TOKENS, HIDDEN)
    with te.autocast(recipe=fp8):
        assert module(x).dtype == torch.float32
    cache = module._fp8_setups[fp8].weight_cache[0]
    assert cache[0] is not None
    assert module.bfloat16() is module
    assert cache[0] is None and module.params_dtype == torch.bfloat16
    with te.autocast(recipe=fp8):
        y = module(x.bfloat16())
    assert y.dtype == torch.bfloat16 and cache[0] is not None
    assert module.half()(x.half()).dtype == torch.float16
