"""CPU activation offloading: the bookkeeping (with SynchronousCopies, which move tensors in
program order on any device) and the behaviour on a machine without a GPU.

Offloading must lose nothing: gradients are bit-identical with and without it, for stacks of
te.Linear, te.LayerNormMLP and te.GroupedLinear under bf16 and both FP8 recipes.
"""

from __future__ import annotations

import pytest
import torch

import torchte as te
from torchte.offload import OffloadHandler, SynchronousCopies, _Offloaded
from torchte.recipe import DelayedScaling, Float8CurrentScaling

pytestmark = pytest.mark.usefixtures("cpu_default_device")

RECIPES = {"bf16": None, "delayed": DelayedScaling(), "current": Float8CurrentScaling()}
H = 32


class Counting(SynchronousCopies):
    """SynchronousCopies that counts the tensors it moved out (by dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.moved: list[torch.dtype] = []

    def to_host(self, tensor, host):
        self.moved.append(tensor.dtype)
        return super().to_host(tensor, host)


def make_layers(kind: str, count: int, seed: int = 0):
    torch.manual_seed(seed)
    kw = {"params_dtype": torch.bfloat16}
    if kind == "linear":
        return [te.Linear(H, H, **kw) for _ in range(count)]
    if kind == "mlp":
        return [te.LayerNormMLP(H, 2 * H, activation="swiglu", **kw) for _ in range(count)]
    return [te.GroupedLinear(3, H, H, **kw) for _ in range(count)]


def call(layer, x):
    if isinstance(layer, te.GroupedLinear):
        return layer(x, [5, 0, x.shape[0] - 5])
    return layer(x)


def train_step(layers, x, fp8_recipe, context=None, sync=None):
    """One forward+backward; (input grad, every parameter grad)."""
    x = x.clone().requires_grad_()
    h = x
    with te.autocast(enabled=fp8_recipe is not None, recipe=fp8_recipe):
        for layer in layers:
            if context is None:
                h = call(layer, h)
            else:
                with context:
                    h = call(layer, h)
                h = sync(h)
    h.float().square().mean().backward()
    grads = [x.grad] + [p.grad for layer in layers for p in layer.parameters()]
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("kind", ["linear", "mlp", "grouped"])
def test_offloaded_gradients_are_bit_identical(kind, recipe_name):
    layers, twins = make_layers(kind, 3), make_layers(kind, 3)
    copies = Counting()
    context, sync = te.get_cpu_offload_context(
        enabled=True, num_layers=2, model_layers=3, min_offload_bytes=0, copies=copies
    )
    fp8 = RECIPES[recipe_name]
    for step in range(3):
        x = torch.randn(16, H, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(step))
        want = train_step(twins, x, fp8)
        got = train_step(layers, x, fp8, context, sync)
        for a, b in zip(got, want, strict=True):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), step
    assert copies.moved, "nothing was offloaded"
    if fp8 is not None:
        assert any(dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for dtype in copies.moved)
    assert not any(context.handler.saved.values())  # every offloaded tensor came back


def test_nothing_offloaded_on_the_cpu_by_default():
    layers = make_layers("linear", 2)
    context, sync = te.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2)
    x = torch.randn(16, H, dtype=torch.bfloat16)
    got = train_step(layers, x, None, context, sync)
    want = train_step(layers, x, None)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert context.handler.pooled_buffers() == 0


def test_what_is_not_offloaded():
    handler = OffloadHandler(1, 2, min_offload_bytes=64, copies=SynchronousCopies())
    handler.begin_layer()
    big, small = torch.randn(64), torch.randn(4)
    param = torch.nn.Parameter(torch.randn(64))
    marked = torch.randn(64)
    te.offload.mark_not_offload(marked)
    assert isinstance(handler.pack(big), _Offloaded)
    for kept in (small, param, marked):
        assert handler.pack(kept) is kept
    handler.begin_layer()  # layer 1: not among the num_layers=1 offloaded ones
    assert handler.pack(torch.randn(64)).__class__ is torch.Tensor


def test_marking_a_storage_marks_its_data():
    from torchte.quantization.float8 import Float8CurrentScalingQuantizer

    q = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
    storage = q.quantize(torch.randn(32, 32), rowwise=True, columnwise=True)
    te.offload.mark_not_offload(storage)
    handler = OffloadHandler(1, 1, min_offload_bytes=0, copies=SynchronousCopies())
    handler.begin_layer()
    for t in storage.get_data_tensors():
        assert handler.pack(t) is t


def test_disabled_context_inside_an_enabled_one_offloads_nothing():
    copies = Counting()
    outer, sync = te.get_cpu_offload_context(
        enabled=True, num_layers=2, model_layers=2, min_offload_bytes=0, copies=copies
    )
    inner, _ = te.get_cpu_offload_context(enabled=False)
    layers = make_layers("linear", 2)
    x = torch.randn(16, H, dtype=torch.bfloat16, requires_grad=True)
    with outer:
        with inner:
            h = layers[0](x)
        moved_inside = len(copies.moved)
        h = layers[1](h)
    sync(h).float().sum().backward()
    assert moved_inside == 0 and len(copies.moved) > 0


def test_exception_mid_forward_leaves_nothing_pending():
    copies = Counting()
    context, sync = te.get_cpu_offload_context(
        enabled=True, num_layers=2, model_layers=2, min_offload_bytes=0, copies=copies
    )
    layer = te.Linear(H, H, params_dtype=torch.bfloat16)
    leaf = torch.randn(16, H, dtype=torch.bfloat16, requires_grad=True)
    x = leaf * 1  # an activation (a leaf that requires grad is its owner's: never offloaded)
    with pytest.raises(RuntimeError, match="boom"), context:
        layer(x)
        raise RuntimeError("boom")
    assert copies.moved and not context.handler.saved[context.handler.layer]
    assert context.handler.pooled_buffers() == len(copies.moved)  # all back in the pool
    # The next step starts clean and reuses the buffers.
    h = sync(layer(x))
    h.float().sum().backward()
    assert leaf.grad is not None


def test_host_buffers_are_reused_across_steps():
    layers = make_layers("linear", 3)
    context, sync = te.get_cpu_offload_context(
        enabled=True, num_layers=2, model_layers=3, min_offload_bytes=0, copies=Counting()
    )
    x = torch.randn(16, H, dtype=torch.bfloat16)
    train_step(layers, x, None, context, sync)
    pooled = context.handler.pooled_buffers()
    for _ in range(3):
        train_step(layers, x, None, context, sync)
    assert pooled > 0 and context.handler.pooled_buffers() == pooled


@pytest.mark.parametrize("manual", [False, True])
def test_manual_mode_reloads_only_when_asked(manual):
    context, sync, handler = te.get_cpu_offload_context(
        enabled=True, num_layers=2, model_layers=2, min_offload_bytes=0,
        copies=SynchronousCopies(), manual_synchronization=True,
    )  # fmt: skip
    handler.manual = manual  # False: what sync does without manual_synchronization
    layers = make_layers("linear", 2)
    leaf = torch.randn(16, H, dtype=torch.bfloat16, requires_grad=True)
    first = sync(_in_context(context, layers[0], leaf * 1))
    last = _in_context(context, layers[1], first)
    seen = []  # layer 0's entries reloaded, as seen right after the last sync's backward
    last.register_hook(lambda grad: seen.append([e.reloaded is not None for e in handler.saved[0]]))
    handler.start_reload(1)  # what a scheduler does before backward reaches layer 1
    assert all(e.reloaded is not None for e in handler.saved[1])
    sync(last).float().sum().backward()
    assert seen and seen[0] and all(seen[0]) != manual  # automatic mode prefetched layer 0
    assert not any(handler.saved.values()) and leaf.grad is not None


def _in_context(context, layer, x):
    with context:
        return layer(x)


def test_bad_arguments():
    with pytest.raises(NotImplementedError, match="offload_weights"):
        te.get_cpu_offload_context(enabled=True, offload_weights=True)
    with pytest.raises(ValueError, match="num_layers"):
        te.get_cpu_offload_context(enabled=True, num_layers=3, model_layers=2)
    context, _sync, handler = te.get_cpu_offload_context(
        enabled=True, num_layers=1, model_layers=2, manual_synchronization=True
    )
    assert handler is context.handler and isinstance(handler, OffloadHandler)


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_weights_and_their_fp8_copies_stay(recipe_name):
    """Parameters, the FP8 weight caches and the grouped weight view are saved for backward
    but never offloaded: they stay alive anyway, so copying them would free nothing."""
    copies = Counting()
    context, sync = te.get_cpu_offload_context(
        enabled=True, num_layers=3, model_layers=3, min_offload_bytes=0, copies=copies
    )
    layers = make_layers("linear", 1) + make_layers("grouped", 1) + make_layers("mlp", 1)
    x = torch.randn(16, H, dtype=torch.bfloat16)
    shapes = {tuple(p.shape) for layer in layers for p in layer.parameters()}
    shapes.add((3, H, H))  # the grouped layer's stacked weights
    for fp8 in (None, RECIPES[recipe_name]):
        moved_before = len(copies.moved)
        shapes_moved = []
        original = copies.to_host

        def spy(tensor, host, original=original, shapes_moved=shapes_moved):
            shapes_moved.append(tuple(tensor.shape))
            return original(tensor, host)

        copies.to_host = spy
        train_step(layers, x, fp8, context, sync)
        copies.to_host = original
        assert len(copies.moved) > moved_before
        weights_moved = [s for s in shapes_moved if s in shapes and s != (16, H)]
        assert not weights_moved, weights_moved
