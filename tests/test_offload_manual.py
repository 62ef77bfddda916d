"""CPU offloading under manual synchronization: the handler's start_offload_layer,
release_activation_forward_gpu_memory and start_reload_layer each do what they say (with
SynchronousCopies, which run the bookkeeping on the CPU), in any mix per layer, and gradients
stay bit-identical to a run without offloading."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from test_offload import RECIPES, H, call, make_layers, train_step

import torchte as te
from torchte.offload import OffloadHandler, SynchronousCopies

pytestmark = pytest.mark.usefixtures("cpu_default_device")


class Watching(SynchronousCopies):
    """SynchronousCopies that remembers each copy out (a weak reference to the device tensor,
    the layer's host buffer) and counts the copies back."""

    def __init__(self) -> None:
        super().__init__()
        self.out: list[tuple[weakref.ref, torch.Tensor]] = []
        self.back = 0

    def to_host(self, tensor, host):
        self.out.append((weakref.ref(tensor), host))
        return super().to_host(tensor, host)

    def to_device(self, host, device, after):
        self.back += 1
        return super().to_device(host, device, after)


def manual_context(model_layers: int, copies=None, **kw):
    context, sync, handler = te.get_cpu_offload_context(
        enabled=True, model_layers=model_layers, manual_synchronization=True,
        min_offload_bytes=0, copies=SynchronousCopies() if copies is None else copies, **kw,
    )  # fmt: skip
    assert isinstance(handler, OffloadHandler) and handler is context.handler
    return context, sync, handler


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("kind", ["linear", "mlp", "grouped"])
def test_offload_all_then_reload_all_is_bit_identical(kind, recipe_name):
    """Transformer Engine's manual pattern: offload each layer after its forward, let go of
    the device copies, reload all before backward."""
    layers, twins = make_layers(kind, 3), make_layers(kind, 3)
    copies = Watching()
    context, sync, handler = manual_context(3, copies)
    fp8 = RECIPES[recipe_name]
    for step in range(2):
        x = torch.randn(16, H, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(step))
        want = train_step(twins, x, fp8)
        h = x.clone().requires_grad_()
        out = h
        with te.autocast(enabled=fp8 is not None, recipe=fp8):
            for i, layer in enumerate(layers):
                with context:
                    out = call(layer, out)
                out = sync(out)
                handler.start_offload_layer(i)
        for i in range(3):
            handler.release_activation_forward_gpu_memory(i)
        entries = [e for i in range(3) for e in handler.saved[i]]
        assert entries and all(e.tensor is None and e.host is not None for e in entries)
        for i in reversed(range(3)):
            handler.start_reload_layer(i)
        assert all(e.reloaded is not None for e in entries)
        out.float().square().mean().backward()
        got = [h.grad] + [p.grad for layer in layers for p in layer.parameters()]
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        for a, b in zip(got, want, strict=True):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), step
        assert copies.back == len(entries) and not any(handler.saved.values())
        copies.back = 0


def _sin_layer(x):
    """A layer whose saved tensor (sin's input) nobody else holds."""
    return (x * 1.5).sin()


def test_each_call_does_what_it_says():
    copies = Watching()
    context, sync, handler = manual_context(1, copies)
    x = torch.randn(64, 8, requires_grad=True)
    with context:
        out = sync(_sin_layer(x))
    (entry,) = handler.saved[0]
    values = entry.tensor.clone()
    assert entry.host is None and not copies.out  # saved: on the device, nothing copied

    handler.start_offload_layer(0)
    [(device_ref, host)] = copies.out
    assert entry.host is host and torch.equal(host, values)
    assert entry.tensor is device_ref() and host.data_ptr() != entry.tensor.data_ptr()

    handler.release_activation_forward_gpu_memory(0)
    gc.collect()
    assert entry.tensor is None and device_ref() is None  # the device memory is free
    assert torch.equal(entry.host, values) and copies.back == 0

    handler.start_reload_layer(0)
    reloaded = entry.reloaded
    assert copies.back == 1 and torch.equal(reloaded, values)
    assert reloaded.data_ptr() != host.data_ptr()

    out.sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    _sin_layer(x_ref).sum().backward()
    assert torch.equal(x.grad, x_ref.grad) and not handler.saved[0]


def test_any_mix_per_layer_is_bit_identical():
    """Layer 0: the full cycle; 1: never offloaded (used in place); 2: released, never
    reloaded (copied back when backward needs it); 3: offloaded, never released (used in
    place). num_layers (default 1) is ignored: the calls say which layers move."""
    layers, twins = make_layers("linear", 4), make_layers("linear", 4)
    copies = Watching()
    context, sync, handler = manual_context(4, copies)
    x = torch.randn(16, H, dtype=torch.bfloat16)
    want = train_step(twins, x, None)
    h = x.clone().requires_grad_()
    out = h
    for layer in layers:
        with context:
            out = layer(out)
        out = sync(out)
    for i in (0, 2, 3):
        handler.start_offload_layer(i)
    for i in (0, 2):
        handler.release_activation_forward_gpu_memory(i)
    handler.start_reload_layer(0)
    saved = {i: list(handler.saved[i]) for i in range(4)}
    assert all(e.host is None and e.tensor is not None for e in saved[1])
    assert all(e.host is not None and e.tensor is not None for e in saved[3])
    assert copies.back == len(saved[0])
    out.float().square().mean().backward()
    got = [h.grad] + [p.grad for layer in layers for p in layer.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert copies.back == len(saved[0]) + len(saved[2])  # layer 2 came back on demand
    assert len(copies.out) == len(saved[0]) + len(saved[2]) + len(saved[3])
    assert not any(handler.saved.values())


def test_tensors_saved_after_start_offload_are_copied_as_they_come():
    copies = Watching()
    context, sync, handler = manual_context(1, copies, retain_pinned_cpu_buffers=True)
    x = torch.randn(64, 8, requires_grad=True)
    with context:
        first = _sin_layer(x)
        handler.start_offload_layer(0)
        assert len(copies.out) == 1
        out = sync(_sin_layer(first))
    assert len(copies.out) == 2 and all(e.host is not None for e in handler.saved[0])
    handler.release_activation_forward_gpu_memory(0)
    handler.start_reload_layer(0)
    out.sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    _sin_layer(_sin_layer(x_ref)).sum().backward()
    assert torch.equal(x.grad, x_ref.grad)
    assert handler.pooled_buffers() == 2  # retained for the next step


def test_bad_layer_ids_and_out_of_order_calls_raise():
    context, sync, handler = manual_context(2)
    with context:
        sync(_sin_layer(torch.randn(8, requires_grad=True)))
    for bad, error in ((-1, ValueError), (2, ValueError), ("0", TypeError), (True, TypeError)):
        with pytest.raises(error, match="layer_id"):
            handler.start_offload_layer(bad)
    with pytest.raises(TypeError, match="layer_id"):
        handler.start_reload_layer(1.0)
    with pytest.raises(RuntimeError, match="must be being offloaded"):
        handler.release_activation_forward_gpu_memory(0)
    with pytest.raises(RuntimeError, match="must be offloaded"):
        handler.start_reload_layer(0)
    handler.start_offload_layer(0)  # the failed calls changed nothing
    with pytest.raises(RuntimeError, match="is being offloaded, it must be on the device"):
        handler.start_offload_layer(0)
    with pytest.raises(RuntimeError, match="must be offloaded"):
        handler.start_reload_layer(0)
    handler.release_activation_forward_gpu_memory(0)
    handler.start_reload_layer(torch.tensor(0))  # any integer index
    assert all(e.reloaded is not None for e in handler.saved[0])


def test_manual_calls_need_manual_synchronization():
    context, _sync = te.get_cpu_offload_context(
        enabled=True, num_layers=1, model_layers=2, copies=SynchronousCopies()
    )
    with pytest.raises(RuntimeError, match="manual_synchronization=True"):
        context.handler.start_offload_layer(0)


def test_manual_arguments():
    context, sync, handler = te.get_cpu_offload_context(
        enabled=False, model_layers=2, manual_synchronization=True
    )
    assert handler is None and context.handler is None
    x = torch.randn(4, requires_grad=True)
    assert sync(x) is x
    # num_layers is ignored (None allowed) with manual synchronization, as in Transformer Engine
    _, _, handler = manual_context(2, num_layers=None)
    assert handler.num_layers == 2
    with pytest.raises(ValueError, match="offload_stream"):
        te.get_cpu_offload_context(enabled=True, offload_stream=object())
    with pytest.raises(TypeError, match="offload_stream"):
        te.get_cpu_offload_context(
            enabled=True, manual_synchronization=True, offload_stream=object()
        )
