"""CPU activation offloading: the bookkeeping (with SynchronousCopies, which move tensors in
program order on any device) and the behaviour on a machine without a GPU.

Offloading must lose nothing: gradients are bit-identical with and without it, for stacks of
te.Linear, te.LayerNormMLP and te.GroupedLinear under bf16 and both FP8 recipes.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import torchte as te
from torchte.offload import OffloadHandler, SynchronousCopies
from torchte.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)

pytestmark = pytest.mark.usefixtures("cpu_default_device")

RECIPES = {"bf16": None, "delayed": DelayedScaling(), "current": Float8CurrentScaling()}
# The block-scaled formats save their own storages (1x128 / 128x128 FP8, MXFP8, NVFP4 bytes).
BLOCK_RECIPES = {
    "block": Float8BlockScaling(),
    "mxfp8": MXFP8BlockScaling(),
    "nvfp4": NVFP4BlockScaling(),
}
H = 32


def offloaded_tensors(handler) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """(dtype, shape) of every saved tensor `handler` takes off the device from now on (what
    the copies see may be a byte range holding several of them)."""
    seen = []
    pack = handler.pack

    def recording(tensor):
        packed = pack(tensor)
        if packed is not tensor:
            seen.append((tensor.dtype, tuple(tensor.shape)))
        return packed

    handler.pack = recording
    return seen


class Counting(SynchronousCopies):
    """SynchronousCopies that counts the copies it made to the host (by dtype)."""

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
    if isinstance(layer, te.GroupedLinear):  # block formats: groups of whole 32-row blocks
        first = 32 if x.shape[0] == 64 else 5
        return layer(x, [first, 0, x.shape[0] - first])
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
    offloaded = offloaded_tensors(context.handler)
    for step in range(3):
        x = torch.randn(16, H, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(step))
        want = train_step(twins, x, fp8)
        got = train_step(layers, x, fp8, context, sync)
        for a, b in zip(got, want, strict=True):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), step
    assert copies.moved, "nothing was offloaded"
    if fp8 is not None:
        fp8_dtypes = (torch.float8_e4m3fn, torch.float8_e5m2)
        assert any(dtype in fp8_dtypes for dtype, _ in offloaded), offloaded
    assert not any(context.handler.saved.values())  # every offloaded tensor came back


@pytest.mark.parametrize("recipe_name", list(BLOCK_RECIPES))
@pytest.mark.parametrize("kind", ["linear", "mlp", "grouped"])
def test_block_scaled_storages_offload_bit_identical(kind, recipe_name):
    """The block-scaled formats' saved storages (bytes and scales) go to the host and come
    back: gradients bit-identical to the layers kept on the device, quantized bytes among
    what moved (uint8 for MXFP8 scales and NVFP4 codes), nothing left behind."""
    layers, twins = make_layers(kind, 3), make_layers(kind, 3)
    copies = Counting()
    context, sync = te.get_cpu_offload_context(
        enabled=True, num_layers=2, model_layers=3, min_offload_bytes=0, copies=copies
    )
    fp8 = BLOCK_RECIPES[recipe_name]
    offloaded = offloaded_tensors(context.handler)
    for step in range(2):
        x = torch.randn(64, H, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(step))
        torch.manual_seed(step)  # NVFP4's stochastic rounding draws the same bits in both
        want = train_step(twins, x, fp8)
        torch.manual_seed(step)
        got = train_step(layers, x, fp8, context, sync)
        for a, b in zip(got, want, strict=True):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), step
    quantized = (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8)
    assert any(dtype in quantized for dtype, _ in offloaded), offloaded
    assert not any(context.handler.saved.values())


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
    assert handler.pack(big) is not big
    for kept in (small, param, marked):
        assert handler.pack(kept) is kept
    handler.begin_layer()  # layer 1: not among the num_layers=1 offloaded ones
    assert handler.pack(torch.randn(64)).__class__ is torch.Tensor


def test_tensors_over_the_same_memory_are_copied_once():
    """Two saved tensors over the same bytes (a tensor and its transposed view, as attention's
    output and the projection's input are) make one host copy; each comes back as it was
    saved, and the copy goes once both are back."""
    copies = Counting()
    handler = OffloadHandler(1, 1, min_offload_bytes=0, copies=copies)
    handler.begin_layer()
    x = torch.randn(8, 6)
    rows, cols = handler.pack(x), handler.pack(x.t())
    gapped = handler.pack(x[:, ::2])  # elements with gaps: moved on its own, as it is
    assert len(copies.moved) == 2 and copies.moved[0] == torch.uint8
    got = handler.unpack(cols)
    assert torch.equal(got, x.t()) and got.stride() == x.t().stride()
    assert handler.saved[0], "the copy stays while a tensor over it is still out"
    assert torch.equal(handler.unpack(rows), x)
    assert torch.equal(handler.unpack(gapped), x[:, ::2])
    assert not handler.saved[0]


def test_memory_changed_in_place_between_saves_is_copied_again():
    copies = Counting()
    handler = OffloadHandler(1, 1, min_offload_bytes=0, copies=copies)
    handler.begin_layer()
    x = torch.randn(8, 6)
    before = x.clone()
    first = handler.pack(x)
    x.mul_(2)
    second = handler.pack(x)
    assert len(copies.moved) == 2
    assert torch.equal(handler.unpack(second), before * 2)
    assert torch.equal(handler.unpack(first), before)


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


@pytest.mark.parametrize("retain", [False, True])
def test_exception_mid_forward_leaves_nothing_pending(retain):
    copies = Counting()
    context, sync = te.get_cpu_offload_context(
        enabled=True, num_layers=2, model_layers=2, retain_pinned_cpu_buffers=retain,
        min_offload_bytes=0, copies=copies,
    )  # fmt: skip
    layer = te.Linear(H, H, params_dtype=torch.bfloat16)
    leaf = torch.randn(16, H, dtype=torch.bfloat16, requires_grad=True)
    x = leaf * 1  # an activation (a leaf that requires grad is its owner's: never offloaded)
    with pytest.raises(RuntimeError, match="boom"), context:
        layer(x)
        raise RuntimeError("boom")
    assert copies.moved and not context.handler.saved[context.handler.layer]
    # Retained: all back in the pool; otherwise let go.
    assert context.handler.pooled_buffers() == (len(copies.moved) if retain else 0)
    # The next step starts clean (and reuses the retained buffers).
    h = sync(layer(x))
    h.float().sum().backward()
    assert leaf.grad is not None


class Tracking(SynchronousCopies):
    """SynchronousCopies that counts the host buffers it makes and keeps a weak reference to
    each host buffer it copied into."""

    def __init__(self) -> None:
        super().__init__()
        self.made = 0
        self.hosts: list[weakref.ref] = []

    def host_buffer(self, tensor):
        self.made += 1
        return super().host_buffer(tensor)

    def to_host(self, tensor, host):
        self.hosts.append(weakref.ref(host))
        return super().to_host(tensor, host)


def test_retained_host_buffers_are_reused_across_steps():
    layers = make_layers("mlp", 3)
    copies = Tracking()
    context, sync = te.get_cpu_offload_context(
        enabled=True, num_layers=2, model_layers=3, retain_pinned_cpu_buffers=True,
        min_offload_bytes=0, copies=copies,
    )  # fmt: skip
    x = torch.randn(16, H, dtype=torch.bfloat16)
    want = train_step(make_layers("mlp", 3), x, None)
    pointers, pooled, made, held = [], [], [], []
    for _ in range(3):
        copies.hosts.clear()
        got = train_step(layers, x, None, context, sync)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        pointers.append(sorted(ref().data_ptr() for ref in copies.hosts))
        pooled.append(context.handler.pooled_buffers())
        made.append(copies.made)
        held.append(context.offload_synchronizer.get_offloaded_total_size_mb())
    assert pointers[0] and pointers[1] == pointers[0] and pointers[2] == pointers[0]
    assert pooled[0] == len(pointers[0]) and pooled == [pooled[0]] * 3
    assert made == [len(pointers[0])] * 3  # no buffer made after the first step
    bytes_moved = sum(ref().numel() * ref().element_size() for ref in copies.hosts)
    assert held == [bytes_moved / 2**20] * 3


def test_host_buffers_are_let_go_when_not_retained():
    layers = make_layers("linear", 3)
    copies = Tracking()
    context, sync = te.get_cpu_offload_context(
        enabled=True, num_layers=2, model_layers=3, min_offload_bytes=0, copies=copies
    )
    x = torch.randn(16, H, dtype=torch.bfloat16)
    for step in range(2):
        copies.hosts.clear()
        train_step(layers, x, None, context, sync)
        gc.collect()
        assert copies.hosts and all(ref() is None for ref in copies.hosts), step
        assert context.handler.pooled_buffers() == 0
        assert context.handler.get_offloaded_total_size_mb() == 0
    assert copies.made == 2 * len(copies.hosts)  # a new buffer for every tensor, every step


def test_the_context_is_also_a_decorator():
    layers, twins = make_layers("linear", 2), make_layers("linear", 2)
    copies = Counting()
    context, sync = te.get_cpu_offload_context(
        enabled=True, num_layers=2, model_layers=2, min_offload_bytes=0, copies=copies
    )

    @context
    def run(layer, h):
        return layer(h)

    x = torch.randn(16, H, dtype=torch.bfloat16)
    h = x.clone().requires_grad_()
    out = sync(run(layers[1], sync(run(layers[0], h))))
    out.float().square().mean().backward()
    got = [h.grad] + [p.grad for layer in layers for p in layer.parameters()]
    want = train_step(twins, x, None)
    assert copies.moved and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_layers"):
        te.get_cpu_offload_context(enabled=True, num_layers=3, model_layers=2)
    with pytest.raises(ValueError, match="num_layers=None"):
        te.get_cpu_offload_context(enabled=True, num_layers=None, model_layers=2)
    with pytest.raises(ValueError, match="model_layers"):
        te.get_cpu_offload_context(enabled=True, num_layers=0, model_layers=0)
    with pytest.raises(ValueError, match="prefetch_layers"):
        te.get_cpu_offload_context(enabled=True, prefetch_layers=-1)
    with pytest.raises(TypeError):  # torchte's own arguments are keyword-only
        te.get_cpu_offload_context(True, 1, 1, True, False, False, False, False, None, 0)


def test_offload_weights_is_deprecated_and_changes_nothing():
    """As in Transformer Engine: a DeprecationWarning, and activations offload as before."""
    copies = Counting()
    with pytest.warns(DeprecationWarning, match="offload_weights"):
        context, sync = te.get_cpu_offload_context(
            True, 2, 2, True, True, min_offload_bytes=0, copies=copies
        )
    x = torch.randn(16, H, dtype=torch.bfloat16)
    layers = make_layers("linear", 2)
    got = train_step(layers, x, None, context, sync)
    want = train_step(make_layers("linear", 2), x, None)
    assert copies.moved and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


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
    offloaded = offloaded_tensors(context.handler)
    for fp8 in (None, RECIPES[recipe_name]):
        moved_before = len(copies.moved)
        offloaded.clear()
        train_step(layers, x, fp8, context, sync)
        assert len(copies.moved) > moved_before
        weights_moved = [s for _, s in offloaded if s in shapes and s != (16, H)]
        assert offloaded and not weights_moved, weights_moved
