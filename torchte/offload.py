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
`min_offload_bytes`, or not on a GPU. `sync(x)` ends a layer: in
backward it starts bringing that layer's tensors back and prefetches the `prefetch_layers`
layers before it, so their copies overlap the backward of this one.

Streams and memory: copies run on two side streams (device-to-host and host-to-device), ordered
against the compute stream by events. A tensor being copied out is recorded on the copy
stream (Tensor.record_stream), so the caching allocator does not hand its memory to anyone
before the copy has read it; a reloaded tensor is recorded on the compute stream that uses it.
Pinned host buffers are kept in a pool by (shape, dtype) and reused across steps.

On a machine without a GPU nothing is offloaded (tensors on the CPU are kept as they are), so
code using the context runs unchanged.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch

__all__ = [
    "CudaCopies",
    "OffloadHandler",
    "SynchronousCopies",
    "get_cpu_offload_context",
    "mark_not_offload",
]

MIN_OFFLOAD_BYTES = 1 << 20  # smaller saved tensors stay where they are
_NO_OFFLOAD = "_torchte_no_offload"


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


class CudaCopies:
    """How offloaded tensors move: side streams, events, pinned host buffers (the default)."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}

    def handles(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cuda

    def host_buffer(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)

    def to_host(self, tensor: torch.Tensor, host: torch.Tensor):
        """Copy tensor into host on the offload stream; the event marking the copy's end."""
        out_stream, _ = self._streams_of(tensor.device)
        out_stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(out_stream):
            host.copy_(tensor, non_blocking=True)
            done = torch.cuda.Event()
            done.record(out_stream)
        tensor.record_stream(out_stream)  # its memory is not reused before the copy read it
        return done

    def to_device(self, host: torch.Tensor, device: torch.device, after):
        """(tensor, event): host copied back to `device` on the reload stream, after `after`."""
        _, in_stream = self._streams_of(device)
        with torch.cuda.stream(in_stream):
            in_stream.wait_event(after)
            tensor = torch.empty(host.shape, dtype=host.dtype, device=device)
            tensor.copy_(host, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(in_stream)
        return tensor, ready

    def use(self, tensor: torch.Tensor, ready) -> None:
        """Make the compute stream wait for `ready` and own the reloaded tensor."""
        compute = torch.cuda.current_stream(tensor.device)
        compute.wait_event(ready)
        tensor.record_stream(compute)  # allocated on the reload stream, used here

    @staticmethod
    def finished(event) -> bool:
        return event is None or event.query()

    def _streams_of(self, device: torch.device):
        streams = self._streams.get(device)
        if streams is None:
            streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
            self._streams[device] = streams
        return streams


class SynchronousCopies(CudaCopies):
    """Plain copies in program order, for any device: the bookkeeping of offloading without
    streams (tests exercise it on the CPU; host buffers are ordinary CPU tensors)."""

    def handles(self, tensor: torch.Tensor) -> bool:
        return True

    def host_buffer(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.empty(tensor.shape, dtype=tensor.dtype)

    def to_host(self, tensor, host):
        host.copy_(tensor)
        return None

    def to_device(self, host, device, after):
        return host.to(device, copy=True), None

    def use(self, tensor, ready) -> None:
        pass


class _Offloaded:
    """A saved tensor that went to host memory: where it is and how to bring it back."""

    __slots__ = ("device", "done", "host", "layer", "ready", "reloaded")

    def __init__(self, host: torch.Tensor, device: torch.device, layer: int, done) -> None:
        self.host, self.device, self.layer, self.done = host, device, layer, done
        self.reloaded: torch.Tensor | None = None
        self.ready = None  # the event ending the copy back


class OffloadHandler:
    """The state of offloading over one model's layers (also the manual-mode controller).

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
    ) -> None:
        self.num_layers, self.model_layers = num_layers, model_layers
        self.prefetch_layers = prefetch_layers
        self.manual = False  # True: only start_reload calls (and unpack on demand) reload
        self.min_offload_bytes = min_offload_bytes
        self.copies = CudaCopies() if copies is None else copies
        self.layer = -1  # the layer running forward (-1: none yet)
        self.saved: dict[int, list[_Offloaded]] = defaultdict(list)
        # Host buffers by (shape, dtype), each with the event after which it is free again.
        self._pool: dict[tuple, list[tuple[torch.Tensor, object]]] = defaultdict(list)

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

    def abort_layer(self) -> None:
        """Forget what the running layer offloaded (its forward failed): buffers back to the
        pool, nothing left pending."""
        for entry in self.saved.pop(self.layer, []):
            self._release(entry)

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
        host = self._host_buffer(tensor)
        entry = _Offloaded(host, tensor.device, self.layer, self.copies.to_host(tensor, host))
        self.saved[self.layer].append(entry)
        return entry

    # -- backward -------------------------------------------------------------------------

    def start_reload(self, layer: int) -> None:
        """Begin copying `layer`'s offloaded tensors back (those not already on their way);
        the compute stream is not blocked."""
        for entry in self.saved.get(layer, ()):
            if entry.reloaded is None and entry.host is not None:
                entry.reloaded, entry.ready = self.copies.to_device(
                    entry.host, entry.device, entry.done
                )

    def unpack(self, packed):
        if not isinstance(packed, _Offloaded):
            return packed
        if packed.host is None and packed.reloaded is None:
            raise RuntimeError(
                "an offloaded activation was released before its backward ran: run each "
                "forward's backward before the next forward of the model"
            )
        if packed.reloaded is None:
            self.start_reload(packed.layer)
        tensor, packed.reloaded = packed.reloaded, None
        self.copies.use(tensor, packed.ready)
        self._release(packed)
        entries = self.saved.get(packed.layer)
        if entries is not None and packed in entries:
            entries.remove(packed)
        return tensor

    # -- host buffers -------------------------------------------------------------------------

    def _host_buffer(self, tensor: torch.Tensor) -> torch.Tensor:
        free = self._pool[(tuple(tensor.shape), tensor.dtype)]
        for i, (host, busy_until) in enumerate(free):
            if self.copies.finished(busy_until):
                del free[i]
                return host
        return self.copies.host_buffer(tensor)

    def _release(self, entry: _Offloaded) -> None:
        """Give the entry's host buffer back to the pool: free once its last copy has run."""
        host, entry.host = entry.host, None
        if host is not None:
            last = entry.ready if entry.ready is not None else entry.done
            self._pool[(tuple(host.shape), host.dtype)].append((host, last))

    def pooled_buffers(self) -> int:
        """How many host buffers the pool holds (for tests and reports)."""
        return sum(len(free) for free in self._pool.values())


class _LayerContext:
    """`with ctx:` around one layer's forward: the hooks on, the layer counted."""

    def __init__(self, handler: OffloadHandler | None) -> None:
        self.handler = handler
        self._hooks: list[contextlib.AbstractContextManager] = []

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
    num_layers: int = 1,
    model_layers: int = 1,
    offload_activations: bool = True,
    offload_weights: bool = False,
    double_buffering: bool = False,
    manual_synchronization: bool = False,
    min_offload_bytes: int = MIN_OFFLOAD_BYTES,
    copies: CudaCopies | None = None,
    prefetch_layers: int = 1,
):
    """(context, sync) as in Transformer Engine. With manual_synchronization, also the
    OffloadHandler, and sync's backward prefetches nothing: a scheduler calls
    handler.start_reload(layer) when it wants a layer's tensors on their way back (a tensor
    not yet reloaded when backward needs it is copied back then).

    num_layers: how many of the model_layers layers (the first ones of each step) offload;
    min_offload_bytes: smaller saved tensors stay; copies: how tensors move (CudaCopies, or
    SynchronousCopies to run the bookkeeping on any device); prefetch_layers: how many layers
    before the one starting backward are brought back already (more overlap, more memory).
    """
    if offload_weights:
        raise NotImplementedError("offload_weights is not implemented: parameters stay put")
    if not 0 <= num_layers <= model_layers or model_layers < 1:
        raise ValueError(
            f"need 0 <= num_layers <= model_layers and model_layers >= 1, got num_layers="
            f"{num_layers}, model_layers={model_layers}"
        )
    handler = None
    if enabled and offload_activations:
        handler = OffloadHandler(
            num_layers, model_layers, min_offload_bytes, copies, prefetch_layers
        )

    def sync(x: torch.Tensor) -> torch.Tensor:
        if handler is None or not torch.is_grad_enabled():
            return x
        return _LayerSync.apply(x, handler)

    context = _LayerContext(handler)
    if manual_synchronization:
        if handler is not None:
            handler.manual = True
        return context, sync, handler
    return context, sync
