"""Kernels per call of every te layer under bf16 and each FP8 recipe, at the host-overhead
benchmark's sizes: a number, not a time, so a fusion lost shows up here as a larger count and
an FP8 step lost (a missing amax or scale update) as a smaller one.

Each step starts from fresh gradients (no accumulation launches) and runs inside its own
te.autocast region, as a training step does; the first call compiles and fills the caches.
"""

from __future__ import annotations

import pytest
import torch
from launches import count_device_ops

import torchte as te
from torchte.recipe import DelayedScaling, Float8CurrentScaling

pytestmark = pytest.mark.gpu

H, FFN, EXPERTS = 1024, 4096, 8
SPLITS = [16, 0, 32, 16, 16, 16, 16, 16]  # 128 tokens, one expert without any
RECIPES = {"bf16": None, "delayed": DelayedScaling, "current": Float8CurrentScaling}

# (layer, recipe, phase) -> launches. What they are made of is written in docs/benchmarks.md
# (host overhead) beside the benchmark's figures.
EXPECTED = {
    ("Linear", "bf16", "fwd"): 1,
    ("Linear", "delayed", "fwd"): 4,
    ("Linear", "current", "fwd"): 5,
    ("Linear", "bf16", "fwdbwd"): 4,
    ("Linear", "delayed", "fwdbwd"): 8,
    ("Linear", "current", "fwdbwd"): 8,
    ("LayerNormLinear", "bf16", "fwd"): 2,
    ("LayerNormLinear", "delayed", "fwd"): 4,
    ("LayerNormLinear", "current", "fwd"): 6,
    ("LayerNormLinear", "bf16", "fwdbwd"): 7,
    ("LayerNormLinear", "delayed", "fwdbwd"): 10,
    ("LayerNormLinear", "current", "fwdbwd"): 11,
    ("LayerNormMLP", "bf16", "fwd"): 5,
    ("LayerNormMLP", "delayed", "fwd"): 7,
    ("LayerNormMLP", "current", "fwd"): 12,
    ("LayerNormMLP", "bf16", "fwdbwd"): 15,
    ("LayerNormMLP", "delayed", "fwdbwd"): 16,
    ("LayerNormMLP", "current", "fwdbwd"): 21,
    ("GroupedLinear", "bf16", "fwd"): 4,
    ("GroupedLinear", "delayed", "fwd"): 9,
    ("GroupedLinear", "current", "fwd"): 12,
    ("GroupedLinear", "bf16", "fwdbwd"): 10,
    ("GroupedLinear", "delayed", "fwdbwd"): 40,
    ("GroupedLinear", "current", "fwdbwd"): 44,
    ("GroupedMLP", "bf16", "fwd"): 7,
    ("GroupedMLP", "delayed", "fwd"): 14,
    ("GroupedMLP", "current", "fwd"): 20,
    ("GroupedMLP", "bf16", "fwdbwd"): 21,
    ("GroupedMLP", "delayed", "fwdbwd"): 76,
    ("GroupedMLP", "current", "fwdbwd"): 84,
}


def make_layer(kind: str):
    """(module, tokens, extra forward arguments)."""
    kw = {"params_dtype": torch.bfloat16, "device": "cuda"}
    if kind == "Linear":
        return te.Linear(H, H, **kw), 16, ()
    if kind == "LayerNormLinear":
        return te.LayerNormLinear(H, H, **kw), 16, ()
    if kind == "LayerNormMLP":
        return te.LayerNormMLP(H, FFN, **kw), 16, ()
    if kind == "GroupedLinear":
        return te.GroupedLinear(EXPERTS, H, H, **kw), sum(SPLITS), (SPLITS,)
    # te.ops' fused grouped MLP: grouped FC1 -> SwiGLU times probabilities -> grouped FC2
    kw = {"dtype": torch.bfloat16, "device": "cuda", "bias": False}
    mlp = te.ops.Sequential(
        te.ops.GroupedLinear(EXPERTS, H, 2 * FFN, **kw),
        te.ops.ScaledSwiGLU(),
        te.ops.GroupedLinear(EXPERTS, FFN, H, **kw),
    )
    probs = torch.rand(sum(SPLITS), device="cuda", requires_grad=True)
    return mlp, sum(SPLITS), (SPLITS, probs, SPLITS)


@pytest.mark.parametrize("phase", ["fwd", "fwdbwd"])
@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize(
    "kind", ["Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear", "GroupedMLP"]
)
def test_launch_count(kind, recipe_name, phase):
    layer, tokens, extra = make_layer(kind)
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
    make_recipe = RECIPES[recipe_name]
    fp8 = make_recipe() if make_recipe else None
    params = list(layer.parameters())

    def step():
        for p in params:
            p.grad = None
        x.grad = None
        with te.autocast(enabled=fp8 is not None, recipe=fp8):
            y = layer(x, *extra)
        if phase == "fwdbwd":
            y.backward(dy)

    step()
    step()
    count = count_device_ops(step)
    print(f"launches {kind} {recipe_name} {phase}: {count}")
    assert count == EXPECTED[(kind, recipe_name, phase)], count
