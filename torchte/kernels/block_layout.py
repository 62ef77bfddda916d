"""Where the 128-token scale blocks of each group sit in a grouped 1x128 columnwise layout.

A grouped block-scaled value (G groups of rows of a (T, K) tensor, group g owning rows
[o_g, o_{g+1}), o = row_offsets (G + 1,) int32, o_0 = 0) keeps its columnwise copy as
data (K, T), group g's columns [o_g, o_{g+1}) the transpose of its rows, quantized in blocks of
128 tokens that start at o_g (its last block may be partial), and scales (BLOCKS_MAX, K) fp32,
group g's block j at row b_g + j: b = block_offsets (G + 1,) int32, the running sum of
ceil(m_g / 128). BLOCKS_MAX = ceil(T / 128) + G covers any split of T rows into G groups, so
the buffer is allocated without reading the sizes on the host. b comes from o on the device
(block_offsets), or from the sizes where the host has them (host_block_offsets: no launch, no
synchronization).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .host_values import to_device_async

BLOCK = 128

__all__ = ["BLOCK", "block_offsets", "check_offsets", "host_block_offsets", "max_blocks"]

# host_block_offsets keeps the GPU tensors of the last HOST_CACHE_SIZE distinct splits (a layer
# called with the same splits again skips the copy); each holds G + 1 ints.
HOST_CACHE_SIZE = 256
_HOST_CACHE: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def check_offsets(row_offsets, device: torch.device, what: str) -> None:
    """The host-side rules of row_offsets (G + 1,) int32 on the device of the tensor named
    `what` (their values are on the device: not checked)."""
    if not isinstance(row_offsets, torch.Tensor) or row_offsets.dtype != torch.int32:
        raise TypeError("row_offsets must be an int32 tensor (G + 1,)")
    if row_offsets.dim() != 1 or row_offsets.shape[0] < 2:
        raise ValueError(
            f"row_offsets must have shape (G + 1,) with G >= 1, got {tuple(row_offsets.shape)}"
        )
    if row_offsets.device != device:
        raise ValueError(f"row_offsets is on {row_offsets.device}, {what} on {device}: must match")


def max_blocks(total_rows: int, num_groups: int) -> int:
    """The scale rows a grouped columnwise layout of `total_rows` rows in `num_groups` groups
    may need (any split)."""
    return -(-total_rows // BLOCK) + num_groups


def block_offsets(row_offsets: torch.Tensor) -> torch.Tensor:
    """(G + 1,) int32 b with b_0 = 0 and b_{g+1} - b_g = ceil(m_g / 128), m_g = o_{g+1} - o_g,
    computed on row_offsets' device (no host sync)."""
    sizes = row_offsets[1:] - row_offsets[:-1]
    blocks = torch.div(sizes + (BLOCK - 1), BLOCK, rounding_mode="floor")
    out = torch.zeros_like(row_offsets, dtype=torch.int32)
    torch.cumsum(blocks, 0, out=out[1:])
    return out


def host_block_offsets(m_splits: Sequence[int], row_offsets: torch.Tensor) -> torch.Tensor:
    """block_offsets(row_offsets) for group sizes m_splits the host has (the same sizes as
    row_offsets (G + 1,) int32): (G + 1,) int32 on row_offsets' device, summed on the host. On
    a GPU made with a non-blocking copy from pinned memory (no synchronization) and cached per
    (sizes, device): shared, so callers must not modify it. While a CUDA graph is being
    captured, a split not cached yet is summed from row_offsets on the device instead (a copy
    captured now would run only at replay), and not cached."""
    device = row_offsets.device
    sizes = tuple(m_splits)
    if device.type != "cuda":
        return torch.tensor(_running_blocks(sizes), dtype=torch.int32, device=device)
    key = (sizes, device)
    cached = _HOST_CACHE.get(key)
    if cached is not None:
        return cached
    if torch.cuda.is_current_stream_capturing():
        return block_offsets(row_offsets)
    made = to_device_async(_running_blocks(sizes), torch.int32, device)
    if len(_HOST_CACHE) >= HOST_CACHE_SIZE:
        del _HOST_CACHE[next(iter(_HOST_CACHE))]  # the oldest entry
    _HOST_CACHE[key] = made
    return made


def _running_blocks(sizes: tuple[int, ...]) -> list[int]:
    """[0, then the running sum of ceil(m_g / 128)]."""
    out = [0]
    for m in sizes:
        out.append(out[-1] + -(-m // BLOCK))
    return out
