"""CPU activation offloading on a GPU: gradients bit-identical, the offloaded layers'
activations off the GPU, and many steps of random sizes without a corrupted gradient."""

from __future__ import annotations

import random

import pytest
import torch
from test_offload import RECIPES, make_layers, train_step

import torchte as te

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("kind", ["linear", "mlp", "grouped"])
def test_offloaded_gradients_are_bit_identical(kind, recipe_name):
    with torch.device("cuda"):
        layers, twins = make_layers(kind, 3), make_layers(kind, 3)
    context, sync = te.get_cpu_offload_context(
        enabled=True, num_layers=2, model_layers=3, min_offload_bytes=0
    )
    for step in range(3):
        x = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
        want = train_step(twins, x, RECIPES[recipe_name])
        got = train_step(layers, x, RECIPES[recipe_name], context, sync)
        for a, b in zip(got, want, strict=True):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), step
    assert context.handler.pooled_buffers() > 0


def test_offloaded_activations_leave_the_gpu():
    layers_count, tokens, hidden = 4, 4096, 1024
    with torch.device("cuda"):
        layers = [
            te.LayerNormMLP(hidden, 4 * hidden, params_dtype=torch.bfloat16)
            for _ in range(layers_count)
        ]
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def saved_bytes(offload: bool) -> int:
        context, sync = te.get_cpu_offload_context(
            enabled=offload, num_layers=layers_count - 1, model_layers=layers_count
        )
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        h = x
        for layer in layers:
            with context:
                h = layer(h)
            h = sync(h)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        h.float().sum().backward()
        return held

    without, with_offload = saved_bytes(False), saved_bytes(True)
    print(
        f"\nactivations held after forward: {without / 2**20:.0f} MiB without offloading, "
        f"{with_offload / 2**20:.0f} MiB with {layers_count - 1} of {layers_count} offloaded"
    )
    assert with_offload <= without / layers_count * 1.1 + 8 * 2**20


def test_stress_random_sizes_no_corruption():
    rng = random.Random(0)
    for step in range(20):
        count = rng.randint(2, 4)
        hidden = rng.choice([256, 512, 1024])
        tokens = rng.choice([512, 2048, 4096])
        with torch.device("cuda"):
            torch.manual_seed(step)
            layers = [te.Linear(hidden, hidden, params_dtype=torch.bfloat16) for _ in range(count)]
            torch.manual_seed(step)
            twins = [te.Linear(hidden, hidden, params_dtype=torch.bfloat16) for _ in range(count)]
        context, sync = te.get_cpu_offload_context(
            enabled=True, num_layers=count - 1, model_layers=count, min_offload_bytes=0
        )
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        for _ in range(2):
            want = train_step(twins, x, None)
            got = train_step(layers, x, None, context, sync)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), step
