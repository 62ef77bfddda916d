"""Saved tensors that share memory are offloaded once.

A saved tensor whose elements fill one byte range of its storage exactly (any dense layout:
contiguous, transposed, permuted) moves as that range's bytes. Another tensor the same layer
saves over the same range of the same storage, unchanged since (the same version), reuses that
copy and is rebuilt over the bytes that come back with its own dtype, shape and strides.
Attention saves its output for backward and the projection after it saves the same memory as
its input: one host copy instead of two. Tensors with gaps or overlaps move as they are.
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["SavedView", "SpanIndex", "byte_range", "dense_span"]


def dense_span(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(first byte, byte count) of the storage range the tensor's elements fill exactly; None
    where they leave gaps or overlap (or there are none)."""
    if tensor.numel() == 0:
        return None
    dims = sorted(
        ((stride, size) for stride, size in zip(tensor.stride(), tensor.shape, strict=True)
         if size != 1),
        reverse=True,
    )  # fmt: skip
    expected = 1
    for stride, size in reversed(dims):
        if stride != expected:
            return None
        expected *= size
    itemsize = tensor.element_size()
    return tensor.storage_offset() * itemsize, tensor.numel() * itemsize


def byte_range(tensor: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
    """The bytes of `span` in the tensor's storage, as a 1-D uint8 tensor over that storage."""
    start, nbytes = span
    out = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return out.set_(tensor.untyped_storage(), start, (nbytes,))


class SavedView:
    """What autograd keeps for a tensor offloaded as a byte range: the entry moving the bytes
    and how to rebuild the tensor over them."""

    __slots__ = ("dtype", "entry", "itemsize", "offset", "size", "stride")

    def __init__(self, entry, tensor: torch.Tensor, span_start: int) -> None:
        self.entry = entry
        self.dtype, self.size, self.stride = tensor.dtype, tensor.shape, tensor.stride()
        self.itemsize = tensor.element_size()
        self.offset = tensor.storage_offset() - span_start // self.itemsize  # within the range

    def rebuild(self, data: torch.Tensor) -> torch.Tensor:
        """The tensor over `data` (the range's bytes on the device, 1-D uint8)."""
        start = data.storage_offset() // self.itemsize + self.offset
        out = torch.empty(0, dtype=self.dtype, device=data.device)
        return out.set_(data.untyped_storage(), start, self.size, self.stride)


class SpanIndex:
    """The byte ranges each layer offloaded this step, to find a range saved again: by
    (storage address, first byte, byte count), checked against the storage itself (a weak
    reference: a freed storage whose address came back is another one) and its version."""

    __slots__ = ("_layers",)

    def __init__(self) -> None:
        self._layers: dict[int, dict[tuple, tuple]] = {}

    def find(self, layer: int, tensor: torch.Tensor, span: tuple[int, int]):
        """The entry already moving this range of the tensor's storage, or None."""
        storage = tensor.untyped_storage()
        found = self._layers.get(layer, {}).get((storage.data_ptr(), *span))
        if found is None:
            return None
        storage_ref, version, entry = found
        if storage_ref() is not storage or version != tensor._version:
            return None
        return entry

    def add(self, layer: int, tensor: torch.Tensor, span: tuple[int, int], entry) -> None:
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), *span)
        self._layers.setdefault(layer, {})[key] = (weakref.ref(storage), tensor._version, entry)

    def clear(self, layer: int | None = None) -> None:
        """Forget one layer's ranges (None: every layer's)."""
        if layer is None:
            self._layers.clear()
        else:
            self._layers.pop(layer, None)
