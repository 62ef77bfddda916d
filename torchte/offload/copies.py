"""How offloaded activations move between a device and host memory: CudaCopies (side streams,
events, pinned host buffers; the default) and SynchronousCopies (plain copies in program order,
on any device: the bookkeeping of offloading without streams, which tests run on the CPU).

The offload handler (torchte.offload) decides what moves and when; these objects only copy,
and order the copies against the compute stream.
"""

from __future__ import annotations

import torch

__all__ = ["CudaCopies", "SynchronousCopies"]


class CudaCopies:
    """Copies on side streams of each device (device-to-host and host-to-device), ordered
    against the compute stream by events; host buffers are pinned.

    stream: one CUDA stream to run both directions on (Transformer Engine's `offload_stream`:
    a caller that synchronizes it knows every copy it was given has run); None: two streams per
    device, made on first use.
    """

    def __init__(self, stream: torch.cuda.Stream | None = None) -> None:
        self._stream = stream
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
        """(tensor, event): host copied back to `device` on the reload stream, after `after`
        (the event ending the copy out). The tensor is allocated on the reload stream, so
        nothing queued on the compute stream needs to finish first."""
        _, in_stream = self._streams_of(device)
        with torch.cuda.stream(in_stream):
            if after is not None:
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

    def wait(self, device: torch.device, event) -> None:
        """Make the compute stream of `device` wait for `event` (a copy's end)."""
        if event is not None:
            torch.cuda.current_stream(device).wait_event(event)

    @staticmethod
    def finished(event) -> bool:
        return event is None or event.query()

    def _streams_of(self, device: torch.device):
        if self._stream is not None:
            if self._stream.device != device:
                raise ValueError(
                    f"offload_stream is on {self._stream.device}, but a tensor to move is on "
                    f"{device}: give a stream of the device the layers run on"
                )
            return self._stream, self._stream
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

    def wait(self, device, event) -> None:
        pass
