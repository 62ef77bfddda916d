"""CPU activation offloading: the tensors autograd saves during forward go to pinned host memory
and come back for backward, overlapped with compute.

    ctx, sync = te.get_cpu_offload_context(enabled=True, num_layers=L - 1, model_layers=L)
    for layer in layers:
        with ctx:
            x = layer(x)
        x = sync(x)

Inside `ctx`, torch's saved_tensors_hooks see every tensor a layer saves for backward (FP8
values too: torchte's Functions save a Storage's data tensors one by one). The first
`num_layers` layers of each step offload what they save, unless it is a parameter (or another
leaf that requires grad, or a view of one), marked with mark_not_offload, smaller than
`min_offload_bytes`, or not on a GPU; tensors a layer saves over the same memory move once
(spans.py). `sync(x)` ends a layer: in
backward it starts bringing that layer's tensors back and prefetches the `prefetch_layers`
layers before it, so their copies overlap the backward of this one.

Manual synchronization (Transformer Engine's manual controller): every layer's saved tensors
stay on the device until the caller moves them, per layer, with the handler's
start_offload_layer(i) (copies out begin; the device tensors are still held),
release_activation_forward_gpu_memory(i) (the compute stream waits for those copies; the device
tensors are let go) and start_reload_layer(i) (copies back begin). A layer never offloaded
is used in place; one offloaded but not reloaded is copied back when backward needs it.

Streams and memory: copies run on side streams (torchte.offload.copies), ordered against the
compute stream by events; a tensor being copied out is recorded on the copy stream, so the
caching allocator does not hand its memory to anyone before the copy has read it. Host
buffers are let go once their tensor is back (torch's pinned-memory cache keeps them safe
from reuse until their copies ran), or, with retain_pinned_cpu_buffers=True, kept in a pool
by (shape, dtype) and reused by the next steps.

On a machine without a GPU nothing is offloaded (tensors on the CPU are kept as they are), so
code using the context runs unchanged.
"""

from __future__ import annotations

import contextlib
import operator
import warnings
from collections import defaultdict

import torch

from .copies import CudaCopies, SynchronousCopies
from .spans import SavedView, SpanIndex, byte_range, dense_span

__all__ = [
    "CudaCopies",
    "OffloadHandler",
    "SynchronousCopies",
    "get_cpu_offload_context",
    "mark_not_offload",
]

MIN_OFFLOAD_BYTES = 1 << 20  # smaller saved tensors stay where they are
_NO_OFFLOAD = "_torchte_no_offload"

# Where a layer's saved tensors are, in manual synchronization (one step of the model).
_ON_DEVICE = "on the device"  # nothing asked yet
_OFFLOADING = "being offloaded"  # start_offload_layer: copies out begun, device tensors held
_OFFLOADED = "offloaded"  # release_activation_forward_gpu_memory: device tensors let go
_RELOADING = "being reloaded"  # start_reload_layer: copies back begun
_MANUAL_ORDER = (
    "per layer and step: start_offload_layer, release_activation_forward_gpu_memory, "
    "start_reload_layer"
)


def mark_not_offload(*values) -> None:
    """Keep these tensors (or every data tensor of these quantized Storages) on their device.
    (Nothing to mark while torch.compile traces: a traced graph's tensors are not offloaded.)"""
    if torch.compiler.is_compiling():
        return
    for value in values:
        if isinstance(value, torch.Tensor):
            setattr(value, _NO_OFFLOAD, True)
        elif value is not None and hasattr(value, "get_data_tensors"):
            mark_not_offload(*value.get_data_tensors())


class _Offloaded:
    """A saved tensor the handler took: where it is (device tensor, host copy, reloaded copy)
    and the events ending its copies."""

    __slots__ = ("device", "done", "host", "layer", "ready", "reloaded", "tensor", "users")

    def __init__(self, tensor: torch.Tensor, layer: int) -> None:
        self.tensor: torch.Tensor | None = tensor  # the device tensor, while held
        self.users = 1  # saved tensors it serves (spans.py: tensors over the same bytes)
        self.device, self.layer = tensor.device, layer
        self.host: torch.Tensor | None = None  # the host copy, once copying out began
        self.done = None  # the event ending the copy out
        self.reloaded: torch.Tensor | None = None
        self.ready = None  # the event ending the copy back


class OffloadHandler:
    """The state of offloading over one model's layers; with manual synchronization, also the
    controller Transformer Engine returns (start_offload_layer, ...).

    Forward: begin_layer() before each layer (the context calls it); pack/unpack are the
    saved_tensors_hooks. Backward: start_reload(layer) starts bringing a layer's tensors back
    (sync's backward calls it for its layer and the one before); unpack waits for the copy it
    needs. Each forward of the model must be followed by its backward before the next one:
    a new step (layer 0 again) lets go of what the last step left unused.
    """

    def __init__(
        self,
        num_layers: int,
        model_layers: int,
        min_offload_bytes: int = MIN_OFFLOAD_BYTES,
        copies: CudaCopies | None = None,
        prefetch_layers: int = 1,
        manual: bool = False,
        retain_pinned_cpu_buffers: bool = False,
    ) -> None:
        # Manual synchronization: any layer may be offloaded; the caller says which.
        self.num_layers = model_layers if manual else num_layers
        self.model_layers = model_layers
        self.prefetch_layers = prefetch_layers
        self.manual = manual  # True: the caller moves each layer (start_offload_layer, ...)
        self.retain_pinned_cpu_buffers = retain_pinned_cpu_buffers
        self.min_offload_bytes = min_offload_bytes
        self.copies = CudaCopies() if copies is None else copies
        self.layer = -1  # the layer running forward (-1: none yet)
        self.saved: dict[int, list[_Offloaded]] = defaultdict(list)
        self._phase = [_ON_DEVICE] * model_layers  # manual synchronization's per-layer state
        # Retained host buffers by (shape, dtype), each with the event after which it is free.
        self._pool: dict[tuple, list[tuple[torch.Tensor, object]]] = defaultdict(list)
        self._spans = SpanIndex()  # the byte ranges offloaded this step (spans.py)

    # -- forward ----------------------------------------------------------------------------

    def begin_layer(self) -> None:
        self.layer += 1
        if self.layer >= self.model_layers:  # the next step
            self.layer = 0
        if self.layer == 0:
            for entries in list(self.saved.values()):
                for entry in entries:
                    self._release(entry)
            self.saved.clear()
            self._spans.clear()
            self._phase = [_ON_DEVICE] * self.model_layers

    def abort_layer(self) -> None:
        """Forget what the running layer saved (its forward failed): host buffers let go or
        back to the pool, nothing left pending."""
        for entry in self.saved.pop(self.layer, []):
            self._release(entry)
        self._spans.clear(self.layer)

    def offloads(self, tensor: torch.Tensor) -> bool:
        """Whether a saved tensor goes to host memory: not a parameter or another leaf that
        requires grad (held by its owner anyway: moving it would free nothing), nor a view of
        one, nor a tensor subclass, nor marked, nor small, and on a device `copies` handles."""
        base = tensor._base if tensor._base is not None else tensor
        return (
            0 <= self.layer < self.num_layers
            and type(tensor) is torch.Tensor
            and not (base.requires_grad and base.is_leaf)
            and not getattr(tensor, _NO_OFFLOAD, False)
            and tensor.numel() * tensor.element_size() >= self.min_offload_bytes
            and self.copies.handles(tensor)
        )

    def pack(self, tensor: torch.Tensor):
        if not self.offloads(tensor):
            return tensor
        if self.manual and self._phase[self.layer] in (_OFFLOADED, _RELOADING):
            return tensor  # saved after its layer was let go: it stays where it is
        span = dense_span(tensor)
        if span is not None:
            entry = self._spans.find(self.layer, tensor, span)
            if entry is not None:  # these bytes are moving already
                entry.users += 1
                return SavedView(entry, tensor, span[0])
        entry = _Offloaded(tensor if span is None else byte_range(tensor, span), self.layer)
        if not self.manual:
            self._copy_out(entry)
            entry.tensor = None  # recorded on the copy stream: its memory waits for the copy
        elif self._phase[self.layer] == _OFFLOADING:
            self._copy_out(entry)
        self.saved[self.layer].append(entry)
        if span is None:
            return entry
        self._spans.add(self.layer, tensor, span, entry)
        return SavedView(entry, tensor, span[0])

    def _copy_out(self, entry: _Offloaded) -> None:
        entry.host = self._host_buffer(entry.tensor)
        entry.done = self.copies.to_host(entry.tensor, entry.host)

    # -- backward -------------------------------------------------------------------------

    def start_reload(self, layer: int) -> None:
        """Begin copying `layer`'s offloaded tensors back (those not already on their way,
        nor still on the device); the compute stream is not blocked."""
        for entry in self.saved.get(layer, ()):
            if entry.reloaded is None and entry.host is not None and entry.tensor is None:
                entry.reloaded, entry.ready = self.copies.to_device(
                    entry.host, entry.device, entry.done
                )

    def unpack(self, packed):
        if isinstance(packed, SavedView):
            entry = packed.entry
            tensor = packed.rebuild(self._on_device(entry))
        elif isinstance(packed, _Offloaded):
            entry = packed
            tensor = self._on_device(entry)
        else:
            return packed
        entry.users -= 1
        if entry.users == 0:  # the last saved tensor it serves is back: let it go
            self._release(entry)
            entries = self.saved.get(entry.layer)
            if entries is not None and entry in entries:
                entries.remove(entry)
        return tensor

    def _on_device(self, entry: _Offloaded) -> torch.Tensor:
        """The entry's tensor on its device: still there (manual synchronization), or copied
        back (the compute stream waits for the copy)."""
        tensor = entry.tensor
        if tensor is not None:
            return tensor
        if entry.host is None and entry.reloaded is None:
            raise RuntimeError(
                "an offloaded activation was released before its backward ran: run each "
                "forward's backward before the next forward of the model"
            )
        if entry.reloaded is None:
            self.start_reload(entry.layer)
        self.copies.use(entry.reloaded, entry.ready)
        return entry.reloaded

    # -- manual synchronization (Transformer Engine's ManualOffloadSynchronizer) -------------

    def start_offload_layer(self, layer_id: int) -> None:
        """Begin copying layer `layer_id`'s saved tensors to host memory (asynchronously, on
        the offload stream); tensors it saves later are copied as they come. The device
        tensors stay held until release_activation_forward_gpu_memory(layer_id)."""
        layer = self._advance(layer_id, "start_offload_layer", _ON_DEVICE, _OFFLOADING)
        for entry in self.saved.get(layer, ()):
            self._copy_out(entry)

    def release_activation_forward_gpu_memory(self, layer_id: int) -> None:
        """Let go of layer `layer_id`'s device tensors: the compute stream waits for their
        copies out to finish (the host is not blocked), then their memory is free."""
        layer = self._advance(
            layer_id, "release_activation_forward_gpu_memory", _OFFLOADING, _OFFLOADED
        )
        for entry in self.saved.get(layer, ()):
            self.copies.wait(entry.device, entry.done)
            entry.tensor = None

    def start_reload_layer(self, layer_id: int) -> None:
        """Begin copying layer `layer_id`'s tensors back to their device (asynchronously);
        backward's use of each waits for its copy."""
        layer = self._advance(layer_id, "start_reload_layer", _OFFLOADED, _RELOADING)
        self.start_reload(layer)

    def _advance(self, layer_id, method: str, expected: str, then: str) -> int:
        """Check a manual call (mode, layer id, order) and move its layer on; the layer."""
        if not self.manual:
            raise RuntimeError(
                f"{method} needs get_cpu_offload_context(manual_synchronization=True); this "
                "handler offloads and reloads on its own"
            )
        layer = _layer_index(layer_id, self.model_layers)
        if self._phase[layer] != expected:
            raise RuntimeError(
                f"{method}({layer}): layer {layer} is {self._phase[layer]}, it must be "
                f"{expected}; the order is {_MANUAL_ORDER}"
            )
        self._phase[layer] = then
        return layer

    # -- host buffers -------------------------------------------------------------------------

    def _host_buffer(self, tensor: torch.Tensor) -> torch.Tensor:
        free = self._pool.get((tuple(tensor.shape), tensor.dtype), [])
        for i, (host, busy_until) in enumerate(free):
            if self.copies.finished(busy_until):
                del free[i]
                return host
        return self.copies.host_buffer(tensor)

    def _release(self, entry: _Offloaded) -> None:
        """Let go of everything the entry holds. Its host buffer goes back to the pool (free
        once its last copy ran) when buffers are retained; otherwise it is dropped."""
        host, entry.host = entry.host, None
        entry.tensor = entry.reloaded = None
        if host is not None and self.retain_pinned_cpu_buffers:
            last = entry.ready if entry.ready is not None else entry.done
            self._pool[(tuple(host.shape), host.dtype)].append((host, last))

    def pooled_buffers(self) -> int:
        """How many retained host buffers the pool holds (for tests and reports)."""
        return sum(len(free) for free in self._pool.values())

    def get_offloaded_total_size_mb(self) -> float:
        """MiB of host memory held now: offloaded tensors' copies and retained buffers."""
        held = [e.host for entries in self.saved.values() for e in entries if e.host is not None]
        held += [host for free in self._pool.values() for host, _ in free]
        return sum(host.numel() * host.element_size() for host in held) / 2**20


def _layer_index(layer_id, model_layers: int) -> int:
    """`layer_id` as a layer index in [0, model_layers), or a TypeError / ValueError."""
    try:
        layer = None if isinstance(layer_id, bool) else operator.index(layer_id)
    except TypeError:
        layer = None
    if layer is None:
        raise TypeError(f"layer_id must be an int, got {layer_id!r}")
    if not 0 <= layer < model_layers:
        raise ValueError(f"layer_id must be in [0, model_layers={model_layers}), got {layer}")
    return layer


class _LayerContext(contextlib.ContextDecorator):
    """`with ctx:` around one layer's forward (or `@ctx` on a layer's function): the hooks on,
    the layer counted."""

    def __init__(self, handler: OffloadHandler | None) -> None:
        self.handler = handler
        self._hooks: list[contextlib.AbstractContextManager] = []

    @property
    def offload_synchronizer(self) -> OffloadHandler | None:
        """Transformer Engine's name of the object that moves the layers' tensors (its
        get_offloaded_total_size_mb() says how much host memory they hold); None when
        offloading is off."""
        return self.handler

    def __enter__(self):
        handler = self.handler
        if handler is None:  # enabled=False: whatever an outer context does, nothing here
            hooks = torch.autograd.graph.saved_tensors_hooks(_identity, _identity)
        else:
            handler.begin_layer()
            hooks = torch.autograd.graph.saved_tensors_hooks(handler.pack, handler.unpack)
        hooks.__enter__()
        self._hooks.append(hooks)
        return self

    def __exit__(self, exc_type, exc, tb):
        self._hooks.pop().__exit__(exc_type, exc, tb)
        if self.handler is not None and exc_type is not None:
            self.handler.abort_layer()
        return False


def _identity(value):
    return value


class _LayerSync(torch.autograd.Function):
    """Marks the end of a layer on its output: in backward, the gradient reaching it means the
    layer's backward is next, so its tensors come back and the previous layer's start to."""

    @staticmethod
    def forward(ctx, x, handler: OffloadHandler):
        ctx.handler, ctx.layer = handler, handler.layer
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        handler: OffloadHandler = ctx.handler
        if not handler.manual:
            for layer in range(ctx.layer, max(ctx.layer - handler.prefetch_layers, 0) - 1, -1):
                handler.start_reload(layer)
        return grad, None


def get_cpu_offload_context(
    enabled: bool = False,
    num_layers: int | None = 1,
    model_layers: int = 1,
    offload_activations: bool = True,
    offload_weights: bool = False,
    double_buffering: bool = False,
    manual_synchronization: bool = False,
    retain_pinned_cpu_buffers: bool = False,
    offload_stream: torch.cuda.Stream | None = None,
    *,
    min_offload_bytes: int = MIN_OFFLOAD_BYTES,
    copies: CudaCopies | None = None,
    prefetch_layers: int = 1,
):
    """(context, sync) as in Transformer Engine; with manual_synchronization, also the
    OffloadHandler (None when not enabled) whose start_offload_layer,
    release_activation_forward_gpu_memory and start_reload_layer move each layer (num_layers
    is then ignored, and sync's backward prefetches nothing).

    num_layers: how many of the model_layers layers (the first ones of each step) offload;
    offload_weights: deprecated, no effect (parameters are never offloaded: their owner holds
    them); double_buffering: no effect; retain_pinned_cpu_buffers: keep host buffers for the
    next steps (same shapes reuse the same buffers) instead of letting them go;
    offload_stream: the one CUDA stream all copies run on (manual synchronization only).
    torchte's own: min_offload_bytes: smaller saved tensors stay; copies: how tensors move
    (CudaCopies, or SynchronousCopies to run the bookkeeping on any device); prefetch_layers:
    how many layers before the one starting backward are brought back already.
    """
    _check_arguments(
        num_layers, model_layers, manual_synchronization, offload_stream, copies, prefetch_layers
    )
    if offload_weights:
        warnings.warn(
            "get_cpu_offload_context(offload_weights=True) has no effect: weights are never "
            "offloaded (their module holds them anyway)",
            DeprecationWarning,
            stacklevel=2,
        )
    handler = None
    if enabled and offload_activations:
        if offload_stream is not None:
            copies = CudaCopies(offload_stream)
        handler = OffloadHandler(
            num_layers,
            model_layers,
            min_offload_bytes,
            copies,
            prefetch_layers,
            manual=manual_synchronization,
            retain_pinned_cpu_buffers=retain_pinned_cpu_buffers,
        )

    def sync(x: torch.Tensor) -> torch.Tensor:
        if handler is None or not torch.is_grad_enabled():
            return x
        return _LayerSync.apply(x, handler)

    context = _LayerContext(handler)
    if manual_synchronization:
        return context, sync, handler
    return context, sync


def _check_arguments(num_layers, model_layers, manual, offload_stream, copies, prefetch) -> None:
    """Bad arguments of get_cpu_offload_context, refused by name."""
    if isinstance(model_layers, bool) or not isinstance(model_layers, int) or model_layers < 1:
        raise ValueError(f"model_layers must be an int >= 1, got {model_layers!r}")
    if num_layers is None and not manual:
        raise ValueError("num_layers=None needs manual_synchronization=True")
    if not manual and not 0 <= num_layers <= model_layers:
        raise ValueError(
            f"need 0 <= num_layers <= model_layers, got num_layers={num_layers}, "
            f"model_layers={model_layers}"
        )
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch_layers must be an int >= 0, got {prefetch!r}")
    if offload_stream is None:
        return
    if not manual:
        raise ValueError("offload_stream can be given only with manual_synchronization=True")
    if not isinstance(offload_stream, torch.cuda.Stream):
        raise TypeError(f"offload_stream must be a torch.cuda.Stream, got {offload_stream!r}")
    if copies is not None:
        raise ValueError("give offload_stream or copies, not both: the stream is for CudaCopies")
