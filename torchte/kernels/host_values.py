"""Small host values (group sizes, offsets) moved to a GPU without making the host wait."""

from __future__ import annotations

import torch

__all__ = ["to_device_async"]


def to_device_async(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of `values` (nested lists of numbers, or a CPU tensor) with `dtype` on `device`.
    On a GPU the copy goes from pinned memory, ordered on the current stream, and the host does
    not wait for the GPU (a copy from pageable memory would synchronize); elsewhere a plain
    tensor. While a CUDA graph is being captured the copy is a plain one, as before this
    helper (a captured copy from pinned memory would, at replay, read the buffer after its
    reuse)."""
    if isinstance(values, torch.Tensor):
        host = values.to(dtype)
    else:  # on the CPU whatever torch's default device is
        host = torch.tensor(values, dtype=dtype, device="cpu")
    on_host = host.device.type == "cpu"
    if (
        torch.device(device).type != "cuda"
        or not on_host
        or torch.cuda.is_current_stream_capturing()
    ):
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
