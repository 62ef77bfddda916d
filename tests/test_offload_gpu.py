"""CPU activation offloading on a GPU: gradients bit-identical, the offloaded layers'
activations off the GPU, and many steps of random sizes without a corrupted gradient."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
from test_offload import RECIPES, make_layers, train_step

import torchte as te

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("retain", [False, True])
@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("kind", ["linear", "mlp", "grouped"])
def test_offloaded_gradients_are_bit_identical(kind, recipe_name, retain):
    with torch.device("cuda"):
        layers, twins = make_layers(kind, 3), make_layers(kind, 3)
    context, sync = te.get_cpu_offload_context(
        enabled=True, num_layers=2, model_layers=3, retain_pinned_cpu_buffers=retain,
        min_offload_bytes=0,
    )  # fmt: skip
    for step in range(3):
        x = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
        want = train_step(twins, x, RECIPES[recipe_name])
        got = train_step(layers, x, RECIPES[recipe_name], context, sync)
        for a, b in zip(got, want, strict=True):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), step
    assert (context.handler.pooled_buffers() > 0) == retain


def test_retained_pinned_buffers_are_reused():
    with torch.device("cuda"):
        layers = make_layers("mlp", 3)
    context, sync = te.get_cpu_offload_context(
        enabled=True, num_layers=2, model_layers=3, retain_pinned_cpu_buffers=True,
        min_offload_bytes=0,
    )  # fmt: skip
    x = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    pools = []
    for _ in range(3):
        train_step(layers, x, None, context, sync)
        torch.cuda.synchronize()
        pool = context.handler._pool.values()
        pools.append(sorted(host.data_ptr() for free in pool for host, _ in free))
        assert all(host.is_pinned() for free in pool for host, _ in free)
    assert pools[0] and pools[1] == pools[0] and pools[2] == pools[0]


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_manual_synchronization_with_an_offload_stream(recipe_name):
    """Transformer Engine's manual pattern on one given stream: offload each layer after its
    forward, synchronize the stream, let go of the device copies, reload all, synchronize,
    backward. Gradients bit-identical; the device memory falls after the release."""
    with torch.device("cuda"):
        layers, twins = make_layers("mlp", 3), make_layers("mlp", 3)
    stream = torch.cuda.Stream()
    context, sync, handler = te.get_cpu_offload_context(
        enabled=True, model_layers=3, manual_synchronization=True, offload_stream=stream,
        min_offload_bytes=0,
    )  # fmt: skip
    fp8 = RECIPES[recipe_name]
    x = torch.randn(4096, 32, device="cuda", dtype=torch.bfloat16)
    want = train_step(twins, x, fp8)
    h = x.clone().requires_grad_()
    out = h
    with te.autocast(enabled=fp8 is not None, recipe=fp8):
        for i, layer in enumerate(layers):
            with context:
                out = layer(out)
            out = sync(out)
            handler.start_offload_layer(i)
    stream.synchronize()
    before = torch.cuda.memory_allocated()
    for i in range(3):
        handler.release_activation_forward_gpu_memory(i)
    freed = before - torch.cuda.memory_allocated()
    entries = [e for i in range(3) for e in handler.saved[i]]
    assert all(e.host.device.type == "cpu" and e.host.is_pinned() for e in entries)
    assert freed > 0
    for i in reversed(range(3)):
        handler.start_reload_layer(i)
    stream.synchronize()
    assert all(e.reloaded.is_cuda and torch.equal(e.reloaded, e.host.cuda()) for e in entries)
    out.float().square().mean().backward()
    got = [h.grad] + [p.grad for layer in layers for p in layer.parameters()]
    for a, b in zip(got, want, strict=True):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
    with pytest.raises(ValueError, match="offload_stream or copies"):
        te.get_cpu_offload_context(
            enabled=True, manual_synchronization=True, offload_stream=stream,
            copies=te.offload.SynchronousCopies(),
        )  # fmt: skip


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


@pytest.mark.parametrize("recipe_name", ["bf16", "current"])
def test_layers_drawing_dropout_through_the_rng_tracker_offload_bit_identical(recipe_name):
    """Transformer layers whose attention and hidden dropout draw from the model-parallel RNG
    tracker: offloading changes nothing the generators see, so outputs and gradients equal the
    run without offloading (same seeds), and every activation comes back."""
    fp8 = RECIPES[recipe_name]

    def build():
        tracker = te.distributed.CudaRNGStatesTracker()
        tracker.add("model-parallel-rng", 123)
        torch.manual_seed(0)
        layers = [
            te.TransformerLayer(
                128, 512, 4, hidden_dropout=0.1, attention_dropout=0.1,
                params_dtype=torch.bfloat16, device="cuda",
                get_rng_state_tracker=lambda: tracker,
            )
            for _ in range(2)
        ]  # fmt: skip
        return layers

    def run(layers, context=None, sync=None):
        torch.manual_seed(7)
        x = torch.randn(64, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out = x
        for layer in layers:
            offloading = context or contextlib.nullcontext()
            with offloading, te.autocast(enabled=fp8 is not None, recipe=fp8):
                out = layer(out)
            out = sync(out) if sync is not None else out
        out.float().square().mean().backward()
        return [out.detach(), x.grad] + [p.grad for layer in layers for p in layer.parameters()]

    context, sync = te.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2)
    got = run(build(), context, sync)
    want = run(build())
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), i
    assert not any(context.offload_synchronizer.saved.values())
