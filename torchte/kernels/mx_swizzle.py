"""The blocked ("swizzled") layout of MXFP8 / NVFP4 block scales that cuBLAS reads on compute
capability 10+ (torch's SwizzleType.SWIZZLE_32_4_4), and its inverse.

Shapes: scales (R, C), one byte each (uint8, float8_e8m0fnu or float8_e4m3fn), R a multiple of
128 and C a multiple of 4: the compact, padded scale buffer of an operand of R' <= R rows
(the GEMM's outer dimension) and C' <= C scale columns along K, as Transformer Engine pads it
(rows to 128, scale columns to 4; mxfp8_cast.py and nvfp4_cast.py write it so). The swizzled
buffer has the same shape and the same bytes in another order:

    compact[r, c] -> flat position
        ((r // 128) * (C // 4) + c // 4) * 512      the 128 x 4 tile, tiles row-band major
      + (r % 32) * 16 + ((r % 128) // 32) * 4      row r of the tile: 32 groups of 4 rows
      + c % 4                                       column within the tile

read as (R, C) row-major. Each 128-row band of the compact buffer is one contiguous run of R
rows' worth of bytes in the swizzled one, so the bands of rows [128 i, 128 j) of a swizzled
buffer are its rows [128 i, 128 j) again (swizzled_rows relies on it).

One strided copy each way (a permute of a 5-D view), which torch runs in one launch on any
device: no Triton kernel. The reference is the formula above, in the tests.
"""

from __future__ import annotations

import torch

from torchte._sizes import round_up

__all__ = ["SCALE_TILE", "swizzle_block_scales", "swizzled_rows", "unswizzle_block_scales"]

# (rows, columns) of one swizzled tile of scale bytes; its rows are read in 4 groups of 32.
SCALE_TILE = (128, 4)
_GROUP = 32


def _check(scales: torch.Tensor, name: str) -> tuple[int, int]:
    """(R, C) of a scale buffer; ValueError unless 2-D, one byte an element, R % 128 == 0 and
    C % 4 == 0."""
    if not isinstance(scales, torch.Tensor) or scales.dim() != 2:
        shape = tuple(scales.shape) if isinstance(scales, torch.Tensor) else type(scales).__name__
        raise ValueError(f"{name} must be a 2-D tensor (R, C) of scale bytes, got {shape}")
    if scales.element_size() != 1:
        raise TypeError(f"{name} must hold one byte per scale (uint8 / FP8), got {scales.dtype}")
    rows, cols = scales.shape
    if rows % SCALE_TILE[0] or cols % SCALE_TILE[1]:
        raise ValueError(
            f"{name} of shape {(rows, cols)}: rows must be a multiple of {SCALE_TILE[0]} and "
            f"columns of {SCALE_TILE[1]} (pad the scale buffer as Transformer Engine does)"
        )
    return rows, cols


def swizzle_block_scales(scales: torch.Tensor) -> torch.Tensor:
    """The SWIZZLE_32_4_4 form (R, C), contiguous, new memory, of compact block scales (R, C)
    (any strides; module docstring), in their dtype."""
    rows, cols = _check(scales, "scales")
    u8 = scales.view(torch.uint8) if scales.dtype != torch.uint8 else scales
    tiles = u8.reshape(rows // 128, 128 // _GROUP, _GROUP, cols // 4, 4)
    out = torch.empty(rows, cols, dtype=torch.uint8, device=scales.device)
    # (band, column tile, row in group, group, column): the flat order of the formula.
    out.view(rows // 128, cols // 4, _GROUP, 128 // _GROUP, 4).copy_(tiles.permute(0, 3, 2, 1, 4))
    return out if scales.dtype == torch.uint8 else out.view(scales.dtype)


def unswizzle_block_scales(swizzled: torch.Tensor) -> torch.Tensor:
    """The compact block scales (R, C), contiguous, new memory, of a SWIZZLE_32_4_4 buffer (R,
    C) (contiguous), in its dtype: the inverse of swizzle_block_scales."""
    rows, cols = _check(swizzled, "swizzled")
    u8 = swizzled.view(torch.uint8) if swizzled.dtype != torch.uint8 else swizzled
    tiles = u8.contiguous().view(rows // 128, cols // 4, _GROUP, 128 // _GROUP, 4)
    out = torch.empty(rows, cols, dtype=torch.uint8, device=swizzled.device)
    out.view(rows // 128, 128 // _GROUP, _GROUP, cols // 4, 4).copy_(tiles.permute(0, 3, 2, 1, 4))
    return out if swizzled.dtype == torch.uint8 else out.view(swizzled.dtype)


def swizzled_rows(swizzled: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """The swizzled scales (round_up(stop - start, 128), C) of rows [start, stop) of the operand
    whose swizzled scales are `swizzled` (R, C), 0 <= start <= stop <= R: a view of its row bands
    when start is a multiple of 128 (the rows past `stop` in the last band are other rows'
    scales, which a GEMM of stop - start rows never reads); else the rows taken from the compact
    form, zero-padded and swizzled again (new memory)."""
    rows, cols = _check(swizzled, "swizzled")
    if not 0 <= start <= stop <= rows:
        raise ValueError(f"rows [{start}, {stop}) are not within the {rows} scale rows")
    padded = round_up(stop - start, SCALE_TILE[0])
    if start % SCALE_TILE[0] == 0:
        return swizzled[start : start + padded]
    compact = unswizzle_block_scales(swizzled)
    u8 = compact.view(torch.uint8) if compact.dtype != torch.uint8 else compact
    band = torch.zeros(padded, cols, dtype=torch.uint8, device=swizzled.device)
    band[: stop - start] = u8[start:stop]
    return swizzle_block_scales(band.view(swizzled.dtype))
