"""FP8 cast + transpose + amax of a grouped input: the tokens of G mixture-of-experts groups
stacked in one matrix, every group quantized with its own scale, all groups in one launch.

Shapes (T tokens, K features, G groups): x (T, K) fp32/bf16/fp16, contiguous; group g owns rows
[o_g, o_{g+1}) with o_0 = 0, o_G = T, m_g = o_{g+1} - o_g >= 0 (empty groups allowed), from the
host list m_splits, or with m_splits None from the device offsets alone (below). Outputs:
- rowwise (T, K) FP8: the rows of group g quantized with scale[g];
- columnwise (K * C,) FP8, flat, C = sum_g round_up(m_g, 16): group g's block starts at element
  K * c_g, c_g = sum_{j<g} round_up(m_j, 16), and is the (K, round_up(m_g, 16)) transpose of its
  rowwise bytes, zero-padded in its last columns (cast_transpose's columnwise layout, per group).
- scale_inv: fp32 (G,) on x's device. How the groups are scaled comes in a CastSpec whose scale
  and amax, when given, are fp32 (G,) on x's device: delayed (spec.scale given), group g is
  multiplied by scale[g] and its max |x| max-accumulated into amax[g] (int32 bit patterns, so a
  NaN reaches it), scale_inv = 1 / scale; current (spec.scale None), group g's scale comes from
  its own amax, which overwrites spec.amax[g] when spec.amax is given.
row_offsets and col_offsets are int32 (G + 1,) tensors on x's device holding o_g and c_g; see
grouped_offsets. The kernels trust them to agree with m_splits (checking would cost a sync).

Group sizes known only on the device (m_splits None: a device split tensor, a CUDA graph
replayed with new splits): the offsets come from device_grouped_offsets, the grid is sized for
the worst case (cdiv(T, BLOCK_M) + G row tiles: each group adds at most one partial tile) and
the columnwise output has room for the worst case, C_max = T + 15 G columns (grouped_columns);
group g's block still starts at element K * c_g, and the tail past c_G is never written or
read. A program past the last real tile finds itself past the last group's rows
(_tile_group_or_last) and stores nothing.

How a program finds its group: the row tiles are numbered group by group (group g has
cdiv(m_g, BLOCK_M) of them; an empty group none), so the grid is (sum_g cdiv(m_g, BLOCK_M),
cdiv(K, BLOCK_N)), sized on the host from m_splits, with no idle programs however uneven the
split. Each program loads row_offsets (G + 1 ints, from L2), takes the running sum of the tile
counts, and counts the groups whose tiles all come before its own (_tile_group). A tile never
straddles two groups, so the tile code of cast_transpose runs unchanged on the group's slice.

Launches per call of quantize_grouped: delayed 1 (cast + transpose + amax + scale_inv of every
group); current 3 (zeroing the amax buffer, the amax of every group, then the cast, whose
programs each make their group's scale from its amax).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import torch

from torchte._sizes import check_splits, round_up

from ._fp8_codec import (
    CAST_CONFIG,
    COLUMNWISE_ALIGN,
    FP8_MAX,
    check_fp8_dtype,
    compute_scale_reference,
    current_scale_inv_reference,
    encode_reference,
    record_amax_reference,
)
from ._triton import FastLaunch, int_key, ptr_key, tl, triton, triton_available
from .cast_spec import CastSpec
from .host_values import to_device_async

__all__ = [
    "GROUPED_AMAX_CONFIG",
    "device_grouped_offsets",
    "gather_rows_reference",
    "grouped_columns",
    "grouped_offsets",
    "quantize_grouped",
    "quantize_grouped_reference",
]

# The amax pass of current scaling: (BLOCK_M, BLOCK_N, num_warps), 16K elements a program as in
# cast_transpose's AMAX_CONFIG; any BLOCK_M works (no columnwise output). Not yet tuned on a GPU.
GROUPED_AMAX_CONFIG = (64, 256, 8)

if triton is not None:
    from ._fp8_codec import _cast_transpose_tile, _current_scale_inv, _scale_from_amax

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
    def _tile_group_or_last(
        row_offsets_ptr, G, pid_m, BLOCK_M: tl.constexpr, G_BLOCK: tl.constexpr
    ):
        """_tile_group, except that a program past the last real tile (a worst-case grid) gets
        the last group and a tile past its rows, so every row it touches is masked off."""
        group, tile = _tile_group(row_offsets_ptr, G, pid_m, BLOCK_M, G_BLOCK)
        last = G - 1
        idx = tl.arange(0, G_BLOCK)
        starts = tl.load(row_offsets_ptr + idx, mask=idx == last, other=0)
        ends = tl.load(row_offsets_ptr + idx + 1, mask=idx == last, other=0)
        last_tiles = tl.sum((ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
        over = group > last
        return tl.where(over, last, group), tl.where(over, tile + last_tiles, tile)

    @triton.jit
    def store_scale_invs(
        scale_ptr, amax_ptr, scale_inv_ptr, G, amax_epsilon,
        FP8_MAX: tl.constexpr, CURRENT: tl.constexpr, POWER_2: tl.constexpr,
        G_BLOCK: tl.constexpr,
    ):  # fmt: skip
        """Every group's scale_inv (G,), empty groups included (they have no programs): from
        the amaxes (CURRENT) or the delayed scales."""
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

    @triton.jit
    def _grouped_cast_transpose_kernel(
        x_ptr,  # (T, K) fp32 / bf16 / fp16, contiguous; (T_src, K) when GATHER
        src_ptr,  # (T,) int32 when GATHER: the row of x each row comes from (-1: zeros)
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
        GATHER: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if (pid_m == 0) & (pid_n == 0):
            store_scale_invs(
                scale_ptr, amax_ptr, scale_inv_ptr, G, amax_epsilon, FP8_MAX, CURRENT, POWER_2,
                G_BLOCK,
            )  # fmt: skip
        group, tile = _tile_group_or_last(row_offsets_ptr, G, pid_m, BLOCK_M, G_BLOCK)
        row_start = tl.load(row_offsets_ptr + group)
        rows = tl.load(row_offsets_ptr + group + 1) - row_start
        col_start = tl.multiple_of(tl.load(col_offsets_ptr + group), 16)
        if CURRENT:
            scale = _scale_from_amax(tl.load(amax_ptr + group), amax_epsilon, FP8_MAX, POWER_2)
        else:
            scale = tl.load(scale_ptr + group)
        x_offset = row_start.to(tl.int64) * K
        out_t_group_ptr = out_t_ptr + col_start.to(tl.int64) * K
        x_group_ptr = x_ptr if GATHER else x_ptr + x_offset
        bits = _cast_transpose_tile(
            x_group_ptr, out_ptr + x_offset, out_t_group_ptr, rows, K, tile, pid_n, scale,
            FP8_MAX, not CURRENT, ROWWISE, COLUMNWISE, BLOCK_M, BLOCK_N, src_ptr + row_start,
            GATHER,
        )  # fmt: skip
        if not CURRENT:
            tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32)) + group, bits, sem="relaxed")

    @triton.jit
    def _grouped_amax_kernel(
        x_ptr,  # (T, K) fp32 / bf16 / fp16, contiguous; (T_src, K) when GATHER
        src_ptr,  # (T,) int32 when GATHER: the row of x each row comes from (-1: zeros)
        row_offsets_ptr,  # (G + 1,) int32: o_g
        amax_ptr,  # (G,) fp32, max-accumulated
        K,
        G,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        G_BLOCK: tl.constexpr,
        GATHER: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        group, tile = _tile_group_or_last(row_offsets_ptr, G, pid_m, BLOCK_M, G_BLOCK)
        row_start = tl.load(row_offsets_ptr + group)
        rows = tl.load(row_offsets_ptr + group + 1) - row_start
        x_group_ptr = x_ptr if GATHER else x_ptr + row_start.to(tl.int64) * K
        # The tile code with no output: only the int32 bits of the tile's max |x|.
        bits = _cast_transpose_tile(
            x_group_ptr, x_ptr, x_ptr, rows, K, tile, pid_n, 1.0, 448.0, True, False, False,
            BLOCK_M, BLOCK_N, src_ptr + row_start, GATHER,
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
    offsets = to_device_async([row_offsets, col_offsets], torch.int32, device)
    return offsets[0], offsets[1]


def grouped_offsets(
    m_splits: list[int] | tuple[int, ...], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row_offsets, col_offsets): int32 (G + 1,) tensors on device holding o_g (running sum of
    m_splits) and c_g (running sum of round_up(m_g, 16)). Cached per (m_splits, device): one
    host-to-device copy per new split, which the host does not wait for; the tensors are
    shared, so callers must not modify them.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # the key names the device it is on
        device = torch.device("cuda", torch.cuda.current_device())
    return _grouped_offsets(tuple(m_splits), device)


def device_grouped_offsets(sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row_offsets, col_offsets) as grouped_offsets gives them, computed on sizes' device from
    an integer (G,) tensor of group sizes (no host synchronization; a few small launches)."""
    counts = sizes.to(torch.int32)
    padded = (counts + (COLUMNWISE_ALIGN - 1)) // COLUMNWISE_ALIGN * COLUMNWISE_ALIGN
    ends = torch.stack([counts, padded]).cumsum(1, dtype=torch.int32)
    offsets = torch.nn.functional.pad(ends, (1, 0))
    return offsets[0], offsets[1]


def grouped_columns(m_splits: list[int] | None, tokens: int, groups: int) -> int:
    """C, the columns of the columnwise blocks: sum_g round_up(m_g, 16) for host sizes; for
    sizes on the device (m_splits None) the most any split can need, T + 15 G."""
    if m_splits is None:
        return tokens + (COLUMNWISE_ALIGN - 1) * groups
    return _padded_rows(m_splits)


def quantize_grouped(
    x: torch.Tensor,
    m_splits: list[int] | None,
    row_offsets: torch.Tensor,
    col_offsets: torch.Tensor,
    spec: CastSpec,
    reduce_max: Callable[[torch.Tensor], None] | None = None,
    src_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Quantize the G groups of x (T, K) as spec says (see the module docstring): delayed with
    spec.scale (G,), max |x| of each group max-accumulated into spec.amax (G,); current with
    each group's own amax (written to spec.amax (G,) when given), all-reduced first by
    reduce_max (in place, MAX over the ranks holding pieces of each group: tensor parallelism)
    when given. One launch on CUDA under delayed scaling, three under current. Returns (rowwise
    (T, K) | None, columnwise (K * C,) | None, scale_inv (G,) fp32), laid out as the module
    says; m_splits None: the sizes come from the offsets on the device, C =
    grouped_columns(None, T, G).

    src_rows: an int32 (T,) tensor on x's device; the matrix quantized is then x[src_rows]
    (zeros where src_rows < 0), gathered as the kernels read it, never written in high
    precision: a permutation of tokens to experts and their quantization in one pass. x is
    any (T_src, K); the indices are trusted (checking would cost a sync)."""
    rows = _check_gather(x, src_rows)
    _check_groups(x, m_splits, row_offsets, col_offsets, spec, rows)
    if not (x.is_cuda and triton_available() and x.numel() > 0 and rows > 0):
        if src_rows is not None:
            x = gather_rows_reference(x, src_rows)
        return _reference(x, m_splits, row_offsets, spec, reduce_max)
    if spec.delayed:
        return _grouped_cast_transpose(x, m_splits, row_offsets, col_offsets, spec, src=src_rows)
    amax = _zeroed_amax(spec.amax, row_offsets.numel() - 1, x.device)
    _grouped_amax(x, m_splits, row_offsets, amax, src=src_rows)
    if reduce_max is not None:
        reduce_max(amax)
    return _grouped_cast_transpose(x, m_splits, row_offsets, col_offsets, spec, amax, src=src_rows)


def gather_rows_reference(x: torch.Tensor, src_rows: torch.Tensor) -> torch.Tensor:
    """x[src_rows] with zero rows where src_rows < 0: (T, K) from x (T_src, K)."""
    padded = torch.cat([x, x.new_zeros(1, x.shape[1])])
    index = torch.where(src_rows >= 0, src_rows, x.shape[0]).long()
    return padded.index_select(0, index)


def _check_gather(x: torch.Tensor, src_rows: torch.Tensor | None) -> int:
    """The rows of the matrix quantized: x's, or src_rows' count (ValueError unless src_rows is
    an int32 vector on x's device)."""
    if src_rows is None:
        return x.shape[0] if x.dim() == 2 else 0
    if src_rows.dtype != torch.int32 or src_rows.dim() != 1 or src_rows.device != x.device:
        raise ValueError(
            f"src_rows must be a 1-D int32 tensor on {x.device}, got {src_rows.dtype} "
            f"{tuple(src_rows.shape)} on {src_rows.device}"
        )
    return src_rows.numel()


def _check_groups(x, m_splits, row_offsets, col_offsets, spec: CastSpec, rows=None) -> None:
    """ValueError unless x is 2-D, m_splits (G ints >= 0, or None: sizes on the device) sums to
    x's rows (or `rows`, when given: a gathered matrix's), the offsets are int32 (G + 1,),
    spec's scale and amax (where given) have G elements, all on x's device; TypeError unless
    spec.fp8_dtype is an FP8 dtype."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (tokens, features), got shape {tuple(x.shape)}")
    groups = row_offsets.numel() - 1 if m_splits is None else len(m_splits)
    per_group = {"scale": spec.scale, "amax": spec.amax}
    for name, tensor in per_group.items():
        if tensor is not None and tensor.numel() != groups:
            raise ValueError(
                f"spec.{name} has {tensor.numel()} elements but there are {groups} groups; "
                "they must match (one per group)"
            )
    if m_splits is not None:
        check_splits(m_splits, x.shape[0] if rows is None else rows)
    offsets = {"row_offsets": row_offsets, "col_offsets": col_offsets}
    for name, tensor in offsets.items():
        if tensor.dtype != torch.int32 or tensor.numel() != groups + 1:
            raise ValueError(
                f"{name} must be int32 with one entry per group and one more = {groups + 1} "
                f"elements, got {tensor.dtype} with {tensor.numel()}"
            )
    for name, tensor in (*offsets.items(), *per_group.items()):
        if tensor is not None and tensor.device != x.device:
            raise ValueError(f"{name} is on {tensor.device} but x is on {x.device}")
    check_fp8_dtype(spec.fp8_dtype, ValueError)


def _zeroed_amax(amax: torch.Tensor | None, groups: int, device) -> torch.Tensor:
    """amax (G,) set to zero in place, or a new zero fp32 (G,) on device (one fill launch)."""
    if amax is None:
        return torch.zeros(groups, dtype=torch.float32, device=device)
    return amax.zero_()


def _row_tiles(m_splits: list[int] | None, block_m: int, tokens: int, groups: int) -> int:
    """The number of row tiles of all groups: the grid's first dimension; for sizes on the
    device (m_splits None) the most any split of `tokens` rows into `groups` can have."""
    if m_splits is None:
        return (tokens + block_m - 1) // block_m + groups
    return sum((rows + block_m - 1) // block_m for rows in m_splits)


def _group_block(groups: int) -> int:
    """G_BLOCK: the power of two >= G (at least 16, to compile fewer variants)."""
    return max(16, 1 << (groups - 1).bit_length())


def _grouped_cast_transpose(
    x, m_splits, row_offsets, col_offsets, spec: CastSpec, current_amax=None, config=CAST_CONFIG,
    src=None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:  # fmt: skip
    """Launch _grouped_cast_transpose_kernel on x (T, K), T, K > 0 (x[src], src (T,) int32,
    when src is given). Delayed (current_amax None): spec.scale (G,) is the scale and
    spec.amax (G,) max-accumulated; current: the scales are made from current_amax (G,).
    Returns (rowwise (T, K) | None, columnwise (K * C,) | None, scale_inv (G,))."""
    if not x.is_contiguous():
        x = x.contiguous()
    features = x.shape[1]
    tokens = x.shape[0] if src is None else src.numel()
    groups = row_offsets.numel() - 1
    block_m, block_n, num_warps = config
    assert block_m % COLUMNWISE_ALIGN == 0, "row tiles must cover each group's padding"
    fp8_dtype, rowwise, columnwise = spec.fp8_dtype, spec.rowwise, spec.columnwise
    current = current_amax is not None
    scale, amax = (current_amax, current_amax) if current else (spec.scale, spec.amax)
    scale_inv = torch.empty(groups, dtype=torch.float32, device=x.device)
    data = data_t = None
    if rowwise:
        data = torch.empty(tokens, features, dtype=fp8_dtype, device=x.device)
    if columnwise:
        columns = grouped_columns(m_splits, tokens, groups)
        data_t = torch.empty(features * columns, dtype=fp8_dtype, device=x.device)
    # An output not asked for is never stored to: any pointer will do.
    out = scale_inv if data is None else data
    out_t = scale_inv if data_t is None else data_t
    grid = (_row_tiles(m_splits, block_m, tokens, groups), (features + block_n - 1) // block_n, 1)
    g_block = _group_block(groups)
    power_2 = spec.power_2_scale
    gather = src is not None
    pointers = (x, src if gather else x, row_offsets, col_offsets, scale, amax, scale_inv, out)
    pointers += (out_t,)
    key = (x.dtype, fp8_dtype, rowwise, columnwise, current, power_2, config, g_block, gather)
    key += (*int_key(features), *int_key(groups), *ptr_key(*pointers))
    _launch_grouped_cast_transpose(
        key, grid, num_warps, *pointers, features, groups, float(spec.amax_epsilon),
        FP8_MAX[fp8_dtype], current, power_2, rowwise, columnwise, block_m, block_n, g_block,
        gather,
    )  # fmt: skip
    return data, data_t, scale_inv


def _grouped_amax(x, m_splits, row_offsets, amax, config=GROUPED_AMAX_CONFIG, src=None) -> None:
    """Launch _grouped_amax_kernel: amax[g] (G,) = max(amax[g], max |x| over group g's rows),
    for x (T, K), T, K > 0 (x[src], src (T,) int32, when src is given)."""
    if not x.is_contiguous():
        x = x.contiguous()
    features = x.shape[1]
    tokens = x.shape[0] if src is None else src.numel()
    groups = row_offsets.numel() - 1
    block_m, block_n, num_warps = config
    grid = (_row_tiles(m_splits, block_m, tokens, groups), (features + block_n - 1) // block_n, 1)
    g_block = _group_block(groups)
    gather = src is not None
    src = src if gather else x
    key = (x.dtype, config, g_block, gather, *int_key(features), *int_key(groups))
    key += (x.data_ptr() & 15, src.data_ptr() & 15, row_offsets.data_ptr() & 15)
    key += (amax.data_ptr() & 15,)
    _launch_grouped_amax_kernel(
        key, grid, num_warps, x, src, row_offsets, amax, features, groups, block_m, block_n,
        g_block, gather,
    )  # fmt: skip


def _padded_rows(m_splits: list[int]) -> int:
    """C = sum_g round_up(m_g, 16): the columns of all columnwise blocks together."""
    return sum(round_up(rows, COLUMNWISE_ALIGN) for rows in m_splits)


# ----------------------------------------------------------------------------------------------
# Torch reference: the same function, group by group through _fp8_codec's one-tensor cast
# ----------------------------------------------------------------------------------------------


def quantize_grouped_reference(
    x: torch.Tensor,
    m_splits: list[int],
    row_offsets: torch.Tensor,
    col_offsets: torch.Tensor,
    spec: CastSpec,
    reduce_max: Callable[[torch.Tensor], None] | None = None,
    src_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Torch reference of quantize_grouped (row_offsets and col_offsets are checked, not read:
    the groups come from m_splits)."""
    _check_groups(x, m_splits, row_offsets, col_offsets, spec)
    return _reference(x, m_splits, row_offsets, spec, reduce_max)


def _reference(x, m_splits, row_offsets, spec: CastSpec, reduce_max=None):
    """Each group through encode_reference, laid out as the module says (bytes copied through
    uint8 views; m_splits None: the sizes read from row_offsets, the columnwise tail zero).
    Current scaling: every group's amax first (reduce_max'd), each group then cast with the
    scale its amax gives, as the kernels do."""
    tokens, features = x.shape
    fp8_dtype, rowwise, columnwise = spec.fp8_dtype, spec.rowwise, spec.columnwise
    data = torch.empty(tokens, features, dtype=fp8_dtype, device=x.device) if rowwise else None
    data_t = None
    if columnwise:
        columns = grouped_columns(m_splits, tokens, row_offsets.numel() - 1)
        data_t = torch.zeros(features * columns, dtype=torch.uint8, device=x.device)
        data_t = data_t.view(fp8_dtype)
    if m_splits is None:
        m_splits = torch.diff(row_offsets).tolist()
    starts = [0, *itertools.accumulate(m_splits)]
    scale, amax = spec.scale, spec.amax
    if not spec.delayed:
        amax = _zeroed_amax(amax, len(m_splits), x.device)
        for g, rows in enumerate(m_splits):
            record_amax_reference(x[starts[g] : starts[g] + rows], amax[g : g + 1])
        if reduce_max is not None:
            reduce_max(amax)
        eps, power_2 = spec.amax_epsilon, spec.power_2_scale
        scale = compute_scale_reference(amax, FP8_MAX[fp8_dtype], eps, power_2)
    scale_inv = torch.empty(len(m_splits), dtype=torch.float32, device=x.device)
    # Current scaling casts with the scale found above; its amaxes are not accumulated again.
    scratch = torch.zeros_like(scale) if not spec.delayed else amax
    col = 0
    for g, rows in enumerate(m_splits):
        x_g, one = x[starts[g] : starts[g] + rows], slice(g, g + 1)
        spec_g = CastSpec(fp8_dtype, rowwise, columnwise, scale[one], scratch[one])
        data_g, data_t_g, scale_inv[one] = encode_reference(x_g, spec_g)
        if data is not None:
            data.view(torch.uint8)[starts[g] : starts[g] + rows] = data_g.view(torch.uint8)
        if data_t is not None:
            block = features * round_up(rows, COLUMNWISE_ALIGN)
            data_t.view(torch.uint8)[col : col + block] = data_t_g.view(torch.uint8).reshape(-1)
            col += block
    if not spec.delayed:
        scale_inv = current_scale_inv_reference(amax, scale)
    return data, data_t, scale_inv
