"""FP8 cast + transpose + amax of a grouped input: the tokens of G mixture-of-experts groups
stacked in one matrix, every group quantized with its own scale, all groups in one launch.

Shapes (T tokens, K features, G groups): x (T, K) fp32/bf16/fp16, contiguous; group g owns rows
[o_g, o_{g+1}) with o_0 = 0, o_G = T, m_g = o_{g+1} - o_g >= 0 (empty groups allowed), from the
host list m_splits. Outputs:
- rowwise (T, K) FP8: the rows of group g quantized with scale[g];
- columnwise (K * C,) FP8, flat, C = sum_g round_up(m_g, 16): group g's block starts at element
  K * c_g, c_g = sum_{j<g} round_up(m_j, 16), and is the (K, round_up(m_g, 16)) transpose of its
  rowwise bytes, zero-padded in its last columns (cast_transpose's columnwise layout, per group).
- scale, amax, scale_inv: fp32 (G,) on x's device; amax max-accumulated as cast_transpose does
  (int32 bit patterns, so a NaN reaches it), scale_inv = 1 / scale.
row_offsets and col_offsets are int32 (G + 1,) tensors on x's device holding o_g and c_g; see
grouped_offsets. The kernels trust them to agree with m_splits (checking would cost a sync).

How a program finds its group: the row tiles are numbered group by group (group g has
cdiv(m_g, BLOCK_M) of them; an empty group none), so the grid is (sum_g cdiv(m_g, BLOCK_M),
cdiv(K, BLOCK_N)), sized on the host from m_splits, with no idle programs however uneven the
split. Each program loads row_offsets (G + 1 ints, from L2), takes the running sum of the tile
counts, and counts the groups whose tiles all come before its own (_tile_group). A tile never
straddles two groups, so the tile code of cast_transpose runs unchanged on the group's slice.

Launches per call: quantize_grouped_delayed 1 (cast + transpose + amax + scale_inv of every
group); quantize_grouped_current 3 (zeroing the amax buffer, the amax of every group, then the
cast, whose programs each make their group's scale from its amax).
"""

from __future__ import annotations

import functools

import torch

from torchte._sizes import check_splits, round_up

from ._triton import FastLaunch, int_key, triton_available
from .cast_transpose import (
    CAST_CONFIG,
    COLUMNWISE_ALIGN,
    FP8_MAX,
    quantize_current_reference,
    quantize_delayed_reference,
    record_amax_reference,
)

# The amax pass of current scaling: (BLOCK_M, BLOCK_N, num_warps), 16K elements a program as in
# cast_transpose's AMAX_CONFIG; any BLOCK_M works (no columnwise output). Not yet tuned on a GPU.
GROUPED_AMAX_CONFIG = (64, 256, 8)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference runs
    triton = None

if triton is not None:
    from .cast_transpose import _cast_transpose_tile, _current_scale_inv, _scale_from_amax

    @triton.jit
    def _tile_group(
        row_offsets_ptr,  # (G + 1,) int32: o_g
        G,
        pid_m,
        BLOCK_M: tl.constexpr,
        G_BLOCK: tl.constexpr,  # a power of two >= G
    ):
        """(group, tile index within the group) of row tile pid_m, tiles numbered group by
        group; pid_m < the total tile count."""
        idx = tl.arange(0, G_BLOCK)
        in_range = idx < G
        starts = tl.load(row_offsets_ptr + idx, mask=in_range, other=0)
        ends = tl.load(row_offsets_ptr + idx + 1, mask=in_range, other=0)
        tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
        # Groups whose tiles all come before pid_m: exactly groups 0..g-1 (empty groups at the
        # boundary included), as the running tile count never decreases.
        before = tl.cumsum(tiles, 0) <= pid_m
        group = tl.sum(before.to(tl.int32), 0)
        first_tile = tl.sum(tl.where(before, tiles, 0), 0)
        return group, pid_m - first_tile

    @triton.jit
    def _grouped_cast_transpose_kernel(
        x_ptr,  # (T, K) fp32 / bf16 / fp16, contiguous
        row_offsets_ptr,  # (G + 1,) int32: o_g
        col_offsets_ptr,  # (G + 1,) int32: c_g, multiples of 16
        scale_ptr,  # (G,) fp32: the scales (delayed); unused when CURRENT
        amax_ptr,  # (G,) fp32: max-accumulated (delayed); read to make the scales (CURRENT)
        scale_inv_ptr,  # (G,) fp32: 1 / scale, written by program (0, 0)
        out_ptr,  # (T, K) fp8 rowwise data, written as uint8 bytes when ROWWISE
        out_t_ptr,  # (K * C,) fp8 columnwise blocks, (K, round_up(m_g, 16)) at element K * c_g
        K,
        G,
        amax_epsilon,  # fp32; used when CURRENT
        FP8_MAX: tl.constexpr,  # 448.0 (e4m3) or 57344.0 (e5m2)
        CURRENT: tl.constexpr,
        POWER_2: tl.constexpr,
        ROWWISE: tl.constexpr,
        COLUMNWISE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        G_BLOCK: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if (pid_m == 0) & (pid_n == 0):
            # Every group's scale_inv, empty groups included (they have no programs).
            idx = tl.arange(0, G_BLOCK)
            in_range = idx < G
            if CURRENT:
                amaxes = tl.load(amax_ptr + idx, mask=in_range, other=0.0)
                scales = _scale_from_amax(amaxes, amax_epsilon, FP8_MAX, POWER_2)
                scale_invs = _current_scale_inv(amaxes, scales)
            else:
                scales = tl.load(scale_ptr + idx, mask=in_range, other=1.0)
                scale_invs = tl.math.div_rn(1.0, scales)
            tl.store(scale_inv_ptr + idx, scale_invs, mask=in_range)
        group, tile = _tile_group(row_offsets_ptr, G, pid_m, BLOCK_M, G_BLOCK)
        row_start = tl.load(row_offsets_ptr + group)
        rows = tl.load(row_offsets_ptr + group + 1) - row_start
        col_start = tl.multiple_of(tl.load(col_offsets_ptr + group), 16)
        if CURRENT:
            scale = _scale_from_amax(tl.load(amax_ptr + group), amax_epsilon, FP8_MAX, POWER_2)
        else:
            scale = tl.load(scale_ptr + group)
        x_offset = row_start.to(tl.int64) * K
        out_t_group_ptr = out_t_ptr + col_start.to(tl.int64) * K
        bits = _cast_transpose_tile(
            x_ptr + x_offset, out_ptr + x_offset, out_t_group_ptr, rows, K, tile, pid_n, scale,
            FP8_MAX, not CURRENT, ROWWISE, COLUMNWISE, BLOCK_M, BLOCK_N,
        )  # fmt: skip
        if not CURRENT:
            tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32)) + group, bits, sem="relaxed")

    @triton.jit
    def _grouped_amax_kernel(
        x_ptr,  # (T, K) fp32 / bf16 / fp16, contiguous
        row_offsets_ptr,  # (G + 1,) int32: o_g
        amax_ptr,  # (G,) fp32, max-accumulated
        K,
        G,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        G_BLOCK: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        group, tile = _tile_group(row_offsets_ptr, G, pid_m, BLOCK_M, G_BLOCK)
        row_start = tl.load(row_offsets_ptr + group)
        rows = tl.load(row_offsets_ptr + group + 1) - row_start
        # The tile code with no output: only the int32 bits of the tile's max |x|.
        bits = _cast_transpose_tile(
            x_ptr + row_start.to(tl.int64) * K, x_ptr, x_ptr, rows, K, tile, pid_n, 1.0,
            448.0, True, False, False, BLOCK_M, BLOCK_N,
        )  # fmt: skip
        tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32)) + group, bits, sem="relaxed")

    _launch_grouped_cast_transpose = FastLaunch(_grouped_cast_transpose_kernel)
    _launch_grouped_amax_kernel = FastLaunch(_grouped_amax_kernel)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _grouped_offsets(m_splits: tuple[int, ...], device: torch.device):
    row_offsets, col_offsets = [0], [0]
    for rows in m_splits:
        row_offsets.append(row_offsets[-1] + rows)
        col_offsets.append(col_offsets[-1] + round_up(rows, COLUMNWISE_ALIGN))
    offsets = torch.tensor([row_offsets, col_offsets], dtype=torch.int32).to(device)
    return offsets[0], offsets[1]


def grouped_offsets(
    m_splits: list[int] | tuple[int, ...], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row_offsets, col_offsets): int32 (G + 1,) tensors on device holding o_g (running sum of
    m_splits) and c_g (running sum of round_up(m_g, 16)). Cached per (m_splits, device): one
    host-to-device copy per new split; the tensors are shared, so callers must not modify them.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # the key names the device it is on
        device = torch.device("cuda", torch.cuda.current_device())
    return _grouped_offsets(tuple(m_splits), device)


def quantize_grouped_delayed(
    x: torch.Tensor,
    m_splits: list[int],
    row_offsets: torch.Tensor,
    col_offsets: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor,
    scale_inv: torch.Tensor,
    fp8_dtype: torch.dtype,
    rowwise: bool,
    columnwise: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Quantize the G groups of x (T, K), group g with scale[g] (scale (G,)); max-accumulate each
    group's max |x| into amax (G,); write 1/scale into scale_inv (G,). One launch on CUDA.
    Returns (rowwise (T, K) | None, columnwise (K * C,) | None), laid out as the module says."""
    per_group = {"scale": scale, "amax": amax, "scale_inv": scale_inv}
    _check_groups(x, m_splits, row_offsets, col_offsets, fp8_dtype, **per_group)
    if x.is_cuda and triton_available() and x.numel() > 0:
        return _grouped_cast_transpose(
            x, m_splits, row_offsets, col_offsets, scale, amax, scale_inv, fp8_dtype,
            rowwise, columnwise, False, 0.0, False,
        )  # fmt: skip
    return _delayed_reference(x, m_splits, scale, amax, scale_inv, fp8_dtype, rowwise, columnwise)


def quantize_grouped_current(
    x: torch.Tensor,
    m_splits: list[int],
    row_offsets: torch.Tensor,
    col_offsets: torch.Tensor,
    scale_inv: torch.Tensor,
    fp8_dtype: torch.dtype,
    amax_epsilon: float,
    power_2_scales: bool,
    rowwise: bool,
    columnwise: bool,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Quantize the G groups of x (T, K), group g with the scale made from its own amax (current
    scaling); write 1/scale into scale_inv (G,). amax (G,) fp32, if given, is overwritten with
    the groups' amaxes (else allocated). Three launches on CUDA (zero amax, amax, cast).
    Returns (rowwise (T, K) | None, columnwise (K * C,) | None, amax (G,))."""
    _check_groups(x, m_splits, row_offsets, col_offsets, fp8_dtype, scale_inv=scale_inv, amax=amax)
    if x.is_cuda and triton_available() and x.numel() > 0:
        amax = _zeroed_amax(amax, len(m_splits), x.device)
        _grouped_amax(x, m_splits, row_offsets, amax)
        current = (True, amax_epsilon, power_2_scales)
        data, data_t = _grouped_cast_transpose(
            x, m_splits, row_offsets, col_offsets, amax, amax, scale_inv, fp8_dtype,
            rowwise, columnwise, *current,
        )  # fmt: skip
        return data, data_t, amax
    current = (amax_epsilon, power_2_scales, rowwise, columnwise, amax)
    return _current_reference(x, m_splits, scale_inv, fp8_dtype, *current)


def _check_groups(x, m_splits, row_offsets, col_offsets, fp8_dtype, **per_group) -> None:
    """ValueError unless x is 2-D, m_splits (G ints >= 0) sums to x's rows, the offsets are int32
    (G + 1,), every per-group tensor (None skipped) has G elements, all on x's device, and
    fp8_dtype is an FP8 dtype."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (tokens, features), got shape {tuple(x.shape)}")
    groups = len(m_splits)
    for name, tensor in per_group.items():
        if tensor is not None and tensor.numel() != groups:
            raise ValueError(
                f"{name} has {tensor.numel()} elements but len(m_splits) = {groups}; "
                "they must match (one per group)"
            )
    check_splits(m_splits, x.shape[0])
    offsets = {"row_offsets": row_offsets, "col_offsets": col_offsets}
    for name, tensor in offsets.items():
        if tensor.dtype != torch.int32 or tensor.numel() != groups + 1:
            raise ValueError(
                f"{name} must be int32 with len(m_splits) + 1 = {groups + 1} elements, "
                f"got {tensor.dtype} with {tensor.numel()}"
            )
    for name, tensor in (*offsets.items(), *per_group.items()):
        if tensor is not None and tensor.device != x.device:
            raise ValueError(f"{name} is on {tensor.device} but x is on {x.device}")
    if fp8_dtype not in FP8_MAX:
        raise ValueError(f"fp8_dtype must be one of {list(FP8_MAX)}, got {fp8_dtype}")


def _zeroed_amax(amax: torch.Tensor | None, groups: int, device) -> torch.Tensor:
    """amax (G,) set to zero in place, or a new zero fp32 (G,) on device (one fill launch)."""
    if amax is None:
        return torch.zeros(groups, dtype=torch.float32, device=device)
    return amax.zero_()


def _row_tiles(m_splits: list[int], block_m: int) -> int:
    """The number of row tiles of all groups: the grid's first dimension."""
    return sum((rows + block_m - 1) // block_m for rows in m_splits)


def _group_block(groups: int) -> int:
    """G_BLOCK: the power of two >= G (at least 16, to compile fewer variants)."""
    return max(16, 1 << (groups - 1).bit_length())


def _grouped_cast_transpose(
    x, m_splits, row_offsets, col_offsets, scale, amax, scale_inv, fp8_dtype, rowwise,
    columnwise, current, amax_epsilon, power_2_scale, config=CAST_CONFIG,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """Launch _grouped_cast_transpose_kernel on x (T, K), T, K > 0. Delayed: scale (G,) is the
    scale and amax (G,) max-accumulated; current (`current=True`): amax is read and the scales
    made from it. Returns (rowwise (T, K) | None, columnwise (K * C,) | None)."""
    if not x.is_contiguous():
        x = x.contiguous()
    tokens, features = x.shape
    groups = len(m_splits)
    block_m, block_n, num_warps = config
    assert block_m % COLUMNWISE_ALIGN == 0, "row tiles must cover each group's padding"
    data = data_t = None
    if rowwise:
        data = torch.empty(tokens, features, dtype=fp8_dtype, device=x.device)
    if columnwise:
        data_t = torch.empty(features * _padded_rows(m_splits), dtype=fp8_dtype, device=x.device)
    # An output not asked for is never stored to: any pointer will do.
    out = scale_inv if data is None else data
    out_t = scale_inv if data_t is None else data_t
    grid = (_row_tiles(m_splits, block_m), (features + block_n - 1) // block_n, 1)
    g_block = _group_block(groups)
    pointers = (x, row_offsets, col_offsets, scale, amax, scale_inv, out, out_t)
    key = (x.dtype, fp8_dtype, rowwise, columnwise, current, power_2_scale, config, g_block)
    key += (*int_key(features), *int_key(groups), *(p.data_ptr() & 15 for p in pointers))
    _launch_grouped_cast_transpose(
        key, grid, num_warps, *pointers, features, groups, float(amax_epsilon),
        FP8_MAX[fp8_dtype], current, power_2_scale, rowwise, columnwise, block_m, block_n,
        g_block,
    )  # fmt: skip
    return data, data_t


def _grouped_amax(x, m_splits, row_offsets, amax, config=GROUPED_AMAX_CONFIG) -> None:
    """Launch _grouped_amax_kernel: amax[g] (G,) = max(amax[g], max |x| over group g's rows),
    for x (T, K), T, K > 0."""
    if not x.is_contiguous():
        x = x.contiguous()
    features = x.shape[1]
    groups = len(m_splits)
    block_m, block_n, num_warps = config
    grid = (_row_tiles(m_splits, block_m), (features + block_n - 1) // block_n, 1)
    g_block = _group_block(groups)
    key = (x.dtype, config, g_block, *int_key(features), *int_key(groups))
    key += (x.data_ptr() & 15, row_offsets.data_ptr() & 15, amax.data_ptr() & 15)
    _launch_grouped_amax_kernel(
        key, grid, num_warps, x, row_offsets, amax, features, groups, block_m, block_n, g_block
    )


def _padded_rows(m_splits: list[int]) -> int:
    """C = sum_g round_up(m_g, 16): the columns of all columnwise blocks together."""
    return sum(round_up(rows, COLUMNWISE_ALIGN) for rows in m_splits)


# ----------------------------------------------------------------------------------------------
# Torch reference: the same function, group by group through cast_transpose's references
# ----------------------------------------------------------------------------------------------


def quantize_grouped_delayed_reference(
    x: torch.Tensor,
    m_splits: list[int],
    row_offsets: torch.Tensor,
    col_offsets: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor,
    scale_inv: torch.Tensor,
    fp8_dtype: torch.dtype,
    rowwise: bool,
    columnwise: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Torch reference of quantize_grouped_delayed (row_offsets and col_offsets are checked,
    not read: the groups come from m_splits)."""
    per_group = {"scale": scale, "amax": amax, "scale_inv": scale_inv}
    _check_groups(x, m_splits, row_offsets, col_offsets, fp8_dtype, **per_group)
    return _delayed_reference(x, m_splits, scale, amax, scale_inv, fp8_dtype, rowwise, columnwise)


def quantize_grouped_current_reference(
    x: torch.Tensor,
    m_splits: list[int],
    row_offsets: torch.Tensor,
    col_offsets: torch.Tensor,
    scale_inv: torch.Tensor,
    fp8_dtype: torch.dtype,
    amax_epsilon: float,
    power_2_scales: bool,
    rowwise: bool,
    columnwise: bool,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Torch reference of quantize_grouped_current."""
    _check_groups(x, m_splits, row_offsets, col_offsets, fp8_dtype, scale_inv=scale_inv, amax=amax)
    current = (amax_epsilon, power_2_scales, rowwise, columnwise, amax)
    return _current_reference(x, m_splits, scale_inv, fp8_dtype, *current)


def _delayed_reference(x, m_splits, scale, amax, scale_inv, fp8_dtype, rowwise, columnwise):
    def quantize_group(g, x_g):
        usage = (rowwise, columnwise)
        group = (scale[g : g + 1], amax[g : g + 1], scale_inv[g : g + 1])
        return quantize_delayed_reference(x_g, *group, fp8_dtype, *usage)

    return _per_group(x, m_splits, fp8_dtype, rowwise, columnwise, quantize_group)


def _current_reference(
    x, m_splits, scale_inv, fp8_dtype, amax_epsilon, power_2_scales, rowwise, columnwise, amax
):
    amax = _zeroed_amax(amax, len(m_splits), x.device)

    def quantize_group(g, x_g):
        record_amax_reference(x_g, amax[g : g + 1])
        current = (amax_epsilon, power_2_scales, rowwise, columnwise)
        return quantize_current_reference(x_g, scale_inv[g : g + 1], fp8_dtype, *current)

    data, data_t = _per_group(x, m_splits, fp8_dtype, rowwise, columnwise, quantize_group)
    return data, data_t, amax


def _per_group(x, m_splits, fp8_dtype, rowwise, columnwise, quantize_group):
    """Run quantize_group(g, x_g) -> (rowwise (m_g, K) | None, columnwise (K, Mp_g) | None) for
    every group and lay the results out as the module says (bytes copied through uint8 views)."""
    tokens, features = x.shape
    data = torch.empty(tokens, features, dtype=fp8_dtype, device=x.device) if rowwise else None
    data_t = None
    if columnwise:
        data_t = torch.empty(features * _padded_rows(m_splits), dtype=fp8_dtype, device=x.device)
    row = col = 0
    for g, rows in enumerate(m_splits):
        data_g, data_t_g = quantize_group(g, x[row : row + rows])
        if data is not None:
            data.view(torch.uint8)[row : row + rows] = data_g.view(torch.uint8)
        if data_t is not None:
            block = features * round_up(rows, COLUMNWISE_ALIGN)
            data_t.view(torch.uint8)[col : col + block] = data_t_g.view(torch.uint8).reshape(-1)
            col += block
        row += rows
    return data, data_t
