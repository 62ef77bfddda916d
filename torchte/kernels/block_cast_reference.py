"""The torch reference of the block-scaled FP8 casts (kernels/block_cast.py): the same bytes
and scales as the Triton kernels, used on the CPU (and on a GPU without Triton), in tests, and
as the fake of the casts' custom ops under torch.compile; with the layout helpers both sides
share (dequantize, the 128x128 transpose, the grouped layout's row blocks). No function here
synchronizes with the host. Layouts and scale rule: see kernels/block_cast.py.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from torchte._sizes import round_up

from ._fp8_codec import FP8_MAX
from .block_layout import BLOCK, block_offsets, max_blocks

__all__ = [
    "block_dequantize",
    "block_quantize_reference",
    "block_scale_reference",
    "grouped_block_quantize_reference",
    "grouped_row_blocks",
    "transpose_block2d",
    "transpose_fp8",
    "value_for_inf",
]


def block_dequantize(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    block_dim: int,
    shape: tuple[int, ...] | torch.Size,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The values data * scale_inv of one copy in the layout block_quantize writes (data (M, K)
    with 1x128 scales (ceil(K/128), M), or data (..., R, C) with 128x128 scales (..., ceil(R/128),
    >= ceil(C/128))), in `dtype` (computed in fp32), reshaped to `shape`."""
    if block_dim not in (1, 2):
        raise ValueError(f"block_dim must be 1 or 2, got {block_dim}")
    if data.dim() < 2:
        raise ValueError(f"data must be at least 2-D, got shape {tuple(data.shape)}")
    rows, cols = data.shape[-2:]
    if block_dim == 1:
        per_value = scale_inv.t().repeat_interleave(BLOCK, dim=1)[:, :cols]
    else:
        n_c = -(-cols // BLOCK)
        tiles = scale_inv[..., :n_c]
        per_value = tiles.repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)
        per_value = per_value[..., :rows, :cols]
    return (data.float() * per_value).to(dtype).reshape(shape)


def value_for_inf(dtype: torch.dtype) -> float:
    """The scale where fp8_max / amax overflows fp32: the largest finite value of the input
    dtype (Transformer Engine's compute_scale_from_types)."""
    return torch.finfo(dtype).max


def block_scale_reference(
    amax: torch.Tensor, fp8_max: float, amax_epsilon: float, power_2_scale: bool, inf_scale: float
) -> torch.Tensor:
    """Transformer Engine's compute_scale_from_amax, elementwise on fp32 amax >= 0: floored at
    amax_epsilon (as fp32), fp8_max / amax rounded to nearest in fp32, `inf_scale` where that
    overflows, exponent bits only when power_2_scale, 1 where amax is 0, inf or NaN."""
    amax = amax.float()
    eps = torch.tensor(amax_epsilon, dtype=torch.float32, device=amax.device)
    amax = torch.where(amax < eps, eps, amax)
    scale = torch.full_like(amax, fp8_max) / amax
    scale = torch.where(torch.isinf(scale), inf_scale, scale)
    if power_2_scale:
        scale = (scale.view(torch.int32) & 0x7F800000).view(torch.float32)
    return torch.where((amax == 0) | ~torch.isfinite(amax), 1.0, scale)


def _abs_no_nan(x: torch.Tensor) -> torch.Tensor:
    """|x| in fp32 with NaN as 0 (a block's amax ignores NaN values, as fmaxf does)."""
    mag = x.float().abs()
    return torch.where(torch.isnan(mag), 0.0, mag)


def _cast(v: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """v * scale in fp32, clamped to the FP8 range, rounded to nearest even; NaN as 0x7F (the
    sign of a NaN dropped: torch's CPU fp16 -> fp32 conversion drops it, the GPU's keeps it)."""
    fp8_max = FP8_MAX[fp8_dtype]
    y = (v * scale).clamp(-fp8_max, fp8_max)
    return torch.where(torch.isnan(y), y.abs(), y).to(fp8_dtype)


def _rows_1x128(x2d: torch.Tensor, fp8_dtype, power_2_scale, amax_epsilon, inf_scale):
    """(data (M, K), scale_inv (ceil(K/128), M)) of x2d (M, K) in 1x128 blocks along K."""
    rows, cols = x2d.shape
    n_k = -(-cols // BLOCK)
    tiles = F.pad(x2d.float(), (0, n_k * BLOCK - cols)).view(rows, n_k, BLOCK)
    amax = _abs_no_nan(tiles).amax(dim=-1)
    scale = block_scale_reference(amax, FP8_MAX[fp8_dtype], amax_epsilon, power_2_scale, inf_scale)
    data = _cast(tiles, scale[..., None], fp8_dtype).view(rows, n_k * BLOCK)[:, :cols]
    return data.contiguous(), torch.reciprocal(scale).t().contiguous()


def _tiles_2d(x3d: torch.Tensor, fp8_dtype, power_2_scale, amax_epsilon, inf_scale):
    """(data (B, R, C), scale_inv (B, ceil(R/128), ceil(C/128))) of x3d in 128x128 tiles."""
    batch, rows, cols = x3d.shape
    n_r, n_c = -(-rows // BLOCK), -(-cols // BLOCK)
    padded = F.pad(x3d.float(), (0, n_c * BLOCK - cols, 0, n_r * BLOCK - rows))
    tiles = padded.view(batch, n_r, BLOCK, n_c, BLOCK)
    if tiles.numel():
        amax = _abs_no_nan(tiles).amax(dim=(2, 4))
    else:
        amax = tiles.new_zeros(batch, n_r, n_c)
    scale = block_scale_reference(amax, FP8_MAX[fp8_dtype], amax_epsilon, power_2_scale, inf_scale)
    data = _cast(tiles, scale[:, :, None, :, None], fp8_dtype)
    data = data.view(batch, n_r * BLOCK, n_c * BLOCK)[:, :rows, :cols].contiguous()
    return data, torch.reciprocal(scale)


def transpose_fp8(data: torch.Tensor) -> torch.Tensor:
    """FP8 data (..., R, C) -> (..., C, R), contiguous: an exact byte copy."""
    return data.view(torch.uint8).transpose(-1, -2).contiguous().view(data.dtype)


def transpose_block2d(
    data: torch.Tensor, scale_inv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The other copy of a 128x128-block value, exactly: data (..., R, C) with scale_inv
    (..., ceil(R/128), >= ceil(C/128)) -> data (..., C, R) with scale_inv (..., ceil(C/128),
    round_up(ceil(R/128), 4)), padding columns 0. Either direction (rowwise <-> columnwise)."""
    n_c = -(-data.shape[-1] // BLOCK)
    n_r = scale_inv.shape[-2]
    scale_t = scale_inv[..., :n_c].transpose(-1, -2)
    return transpose_fp8(data), F.pad(scale_t, (0, round_up(n_r, 4) - n_r)).contiguous()


def block_quantize_reference(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    block_dim: int,
    rowwise: bool,
    columnwise: bool,
    power_2_scale: bool,
    amax_epsilon: float,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Torch reference of block_quantize: the same bytes and scales."""
    inf_scale = value_for_inf(x.dtype)
    args = (fp8_dtype, power_2_scale, amax_epsilon, inf_scale)
    if block_dim == 1:
        data, scale = _rows_1x128(x, *args) if rowwise else (None, None)
        data_t, scale_t = _rows_1x128(x.t(), *args) if columnwise else (None, None)
        return data, scale, data_t, scale_t
    *batch, rows, cols = x.shape
    data, scale = _tiles_2d(x.reshape(math.prod(batch), rows, cols), *args)
    n_r, n_c = scale.shape[1:]
    data = data.view(*batch, rows, cols)
    scale = F.pad(scale, (0, round_up(n_c, 4) - n_c)).view(*batch, n_r, round_up(n_c, 4))
    data_t, scale_t = transpose_block2d(data, scale) if columnwise else (None, None)
    return (data, scale, data_t, scale_t) if rowwise else (None, None, data_t, scale_t)


def grouped_row_blocks(row_offsets: torch.Tensor, total_rows: int) -> torch.Tensor:
    """(T,) int64: the row of the grouped columnwise scales (block_layout) holding each of the
    T rows' scale, computed on row_offsets' device without a host synchronization."""
    offsets = row_offsets.long()
    rows = torch.arange(total_rows, device=row_offsets.device)
    group = torch.searchsorted(offsets[1:], rows, right=True)
    first = block_offsets(row_offsets).long()
    return first[group] + torch.div(rows - offsets[group], BLOCK, rounding_mode="floor")


def grouped_block_quantize_reference(
    x: torch.Tensor,
    row_offsets: torch.Tensor,
    fp8_dtype: torch.dtype,
    rowwise: bool,
    columnwise: bool,
    power_2_scale: bool,
    amax_epsilon: float,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Torch reference of grouped_block_quantize (no host synchronization either): each row's
    scale row from grouped_row_blocks, the blocks' amaxes by scatter_reduce."""
    rows, cols = x.shape
    inf_scale = value_for_inf(x.dtype)
    data = scale = data_t = scale_t = None
    if rowwise:
        data, scale = _rows_1x128(x, fp8_dtype, power_2_scale, amax_epsilon, inf_scale)
    if columnwise:
        blocks = max_blocks(rows, row_offsets.shape[0] - 1)
        row_block = grouped_row_blocks(row_offsets, rows)
        amax = torch.zeros(blocks, cols, dtype=torch.float32, device=x.device)
        index = row_block[:, None].expand(rows, cols)
        amax.scatter_reduce_(0, index, _abs_no_nan(x), "amax")
        fp8_max = FP8_MAX[fp8_dtype]
        block_scale = block_scale_reference(amax, fp8_max, amax_epsilon, power_2_scale, inf_scale)
        data_t = transpose_fp8(_cast(x.float(), block_scale[row_block], fp8_dtype))
        used = torch.arange(blocks, device=x.device) < block_offsets(row_offsets)[-1]
        scale_t = torch.where(used[:, None], torch.reciprocal(block_scale), 0.0)
    return data, scale, data_t, scale_t
