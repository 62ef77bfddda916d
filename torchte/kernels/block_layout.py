"""Where the 128-token scale blocks of each group sit in a grouped 1x128 columnwise layout.

A grouped block-scaled value (G groups of rows of a (T, K) tensor, group g owning rows
[o_g, o_{g+1}), o = row_offsets (G + 1,) int32, o_0 = 0) keeps its columnwise copy as
data (K, T), group g's columns [o_g, o_{g+1}) the transpose of its rows, quantized in blocks of
128 tokens that start at o_g (its last block may be partial), and scales (BLOCKS_MAX, K) fp32,
group g's block j at row b_g + j: b = block_offsets (G + 1,) int32, the running sum of
ceil(m_g / 128). BLOCKS_MAX = ceil(T / 128) + G covers any split of T rows into G groups, so
the buffer is allocated without reading the sizes on the host.
"""

from __future__ import annotations

import torch

BLOCK = 128

__all__ = ["BLOCK", "block_offsets", "max_blocks"]


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
