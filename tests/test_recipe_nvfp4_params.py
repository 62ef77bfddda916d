"""NVFP4BlockScaling's per-role QParams assigned as Transformer Engine's clients assign them."""

from __future__ import annotations

import pytest
import torch

import torchte as te
from torchte import recipe
from torchte.recipe import QParams

pytestmark = pytest.mark.usefixtures("cpu_default_device")


def run(layer, x, fp8_recipe):
    x = x.detach().clone().requires_grad_()
    with te.autocast(recipe=fp8_recipe):
        y = layer(x)
    y.float().pow(2).sum().backward()
    grads = (x.grad, layer.weight.grad)
    layer.weight.grad = None
    return (y, *grads)


def test_assigned_params_are_what_the_quantizers_use():
    """Roles assigned QParams() (no transform, no 2-D blocks, no stochastic rounding) give the
    bits of the recipe whose disable_* fields turn the same options off."""
    torch.manual_seed(0)
    layer = te.Linear(64, 64, params_dtype=torch.bfloat16)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    assigned = recipe.NVFP4BlockScaling()
    assigned.fp4_quant_fwd_inp = QParams()
    assigned.fp4_quant_fwd_weight = QParams()
    assigned.fp4_quant_bwd_grad = QParams()
    disabled = recipe.NVFP4BlockScaling(
        disable_rht=True, disable_stochastic_rounding=True, disable_2d_quantization=True
    )
    default = recipe.NVFP4BlockScaling(disable_stochastic_rounding=True)
    got, want, other = run(layer, x, assigned), run(layer, x, disabled), run(layer, x, default)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, b) for a, b in zip(got, other, strict=True))


def test_assignment_is_part_of_the_value_and_of_later_snapshots():
    r = recipe.NVFP4BlockScaling()
    before = r._frozen()
    assert r == recipe.NVFP4BlockScaling()
    r.fp4_quant_fwd_weight = QParams()
    assert r != recipe.NVFP4BlockScaling()
    assert r.fp4_quant_fwd_weight == QParams() and not r.disable_2d_quantization
    assert before.fp4_quant_fwd_weight.fp4_2d_quantization, "a taken snapshot keeps its values"
    assert r._frozen().fp4_quant_fwd_weight == QParams()
    with pytest.raises(TypeError, match="QParams"):
        r.fp4_quant_bwd_grad = {"stochastic_rounding": True}


def test_inconsistent_transforms_are_refused_at_use():
    """A Hadamard transform on the wgrad operands of one side only would give a wrong weight
    gradient: refused when a module first runs under it."""
    r = recipe.NVFP4BlockScaling()
    r.fp4_quant_bwd_grad = QParams(stochastic_rounding=True)  # inputs keep theirs
    layer = te.Linear(64, 64)
    with pytest.raises(NotImplementedError, match="Hadamard"), te.autocast(recipe=r):
        layer(torch.randn(16, 64))
    r.fp4_quant_fwd_weight = QParams(random_hadamard_transform=True)
    assert "fp4_quant_fwd_weight" in r._unsupported()
