"""Block-scaled FP8 casts (Float8BlockScaling): 1x128 and 128x128 blocks, one scale per block.

Layouts (x2d (M, K) high precision: fp32 / bf16 / fp16; scales fp32 scale_inv: value = data *
scale_inv):
- 1x128 (block_dim 1): rowwise data (M, K) + scale_inv (ceil(K/128), M), [j, m] the block of
  row m, K-block j; columnwise data (K, M) = x^T quantized in 1x128 blocks along M + scale_inv
  (ceil(M/128), K), [i, k] the block of column k, M-block i. The two copies are separate
  quantizations (different scales): neither is made from the other's bytes.
- 128x128 (block_dim 2): x (..., R, C), each trailing (R, C) matrix tiled on its own (a tile
  never straddles two). Rowwise data (..., R, C) + scale_inv (..., ceil(R/128),
  round_up(ceil(C/128), 4)) (padding columns 0); columnwise data (..., C, R): the transposed
  bytes, + scale_inv (..., ceil(C/128), round_up(ceil(R/128), 4)): the transposed scales.
- grouped 1x128: x (T, K) in G groups of rows (row_offsets (G + 1,) int32 on the device):
  rowwise as 1x128; columnwise in block_layout's grouped layout, data (K, T), scales
  (max_blocks(T, G), K), each group's blocks starting at its first row, unused rows 0.

The scale of a block is Transformer Engine's (compute_scale_from_amax): amax = max |x| over
the block, NaN values ignored (the GPU's fmaxf), floored at amax_epsilon; scale = fp8_max /
amax, rounded to nearest; 1 where amax is 0 or inf; the input dtype's largest finite value
where the quotient overflows; on request rounded down to a power of two (exponent bits kept).
scale_inv = 1 / scale. Values: x * scale in fp32, clamped to +-fp8_max, rounded to nearest even
(torch's bytes: on the GPU the conversion instruction, under the interpreter _fp8_codec's
integer encoder); a NaN as 0x7F whatever its sign (the one byte both devices give: torch's CPU
fp16 -> fp32 drops the sign, and on the GPU the product of a NaN is the canonical NaN).

On CUDA with Triton one kernel launch per call writes both usages, each 128 x 128 tile read
once into registers (_block_tiles.py); elsewhere the torch reference (block_cast_reference.py,
whose functions this module re-exports) gives the same bytes.
"""

from __future__ import annotations

import math

import torch

from torchte._sizes import round_up

from ._compile import compiled_as_op
from ._fp8_codec import FP8_MAX, check_fp8_dtype
from ._triton import (
    FastLaunch,
    int_key,
    next_power_of_2,
    ptr_key,
    sm_count,
    tl,
    triton,
    triton_available,
)
from .block_cast_reference import (
    block_dequantize,
    block_quantize_reference,
    block_scale_reference,
    grouped_block_quantize_reference,
    grouped_row_blocks,
    transpose_block2d,
    transpose_fp8,
    value_for_inf,
)
from .block_layout import BLOCK, check_offsets, max_blocks

__all__ = [
    "BLOCK",
    "CONFIG_1D",
    "CONFIG_2D",
    "CONFIG_GROUPED",
    "HP_DTYPES",
    "block_dequantize",
    "block_quantize",
    "block_quantize_reference",
    "block_scale_reference",
    "check_row_offsets",
    "grouped_block_quantize",
    "grouped_block_quantize_reference",
    "grouped_row_blocks",
    "transpose_block2d",
    "transpose_fp8",
    "value_for_inf",
]

# How each kernel runs: (num_warps, num_stages, programs_per_sm, group_m). num_stages 0: one
# program per 128 x 128 tile; >= 1: persistent programs (programs_per_sm per SM) looping over
# the tiles, Triton pipelining the tile loads num_stages deep through shared memory. group_m:
# the tile order (_tile_of: bands of group_m rows of tiles). Every program reads its tile once,
# into registers, as four slices of 32 rows (rows 4i + k), so the columnwise bytes of rows
# 4i..4i+3 pack into one int32 word and the transposed store writes 128-byte runs of words.
# From benchmarks/block_quantize.py on an H200 (2026-11-27; 8192^2 and 32768x4096 bf16, both
# usages): 4 warps, one program per tile, is best for every kernel (1x128: 0.81-0.85 of a
# device copy, 128x128: 0.89-0.92, grouped: 0.73 with group sizes multiples of 4, 0.09 with
# odd ones; measured before the grouped kernel's aligned-window tiles for T % 16 == 0, which
# store the columnwise copy in 16-byte runs whatever the group sizes: not measured yet).
CONFIG_1D = (4, 0, 0, 8)
CONFIG_2D = (4, 0, 0, 8)
CONFIG_GROUPED = (4, 0, 0, 8)
# Shared memory the pipelined tile loads of a persistent program may take (num_stages tiles).
_STAGE_BYTES = 160 * 1024

HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The bits (as fp32) of the largest finite value of each input dtype: Transformer Engine's
# scale where fp8_max / amax overflows fp32 (compute_scale_from_types' value_for_inf).
_INF_SCALE_BITS = {torch.float32: 0x7F7FFFFF, torch.bfloat16: 0x7F7F0000, torch.float16: 0x477FE000}

if triton is not None:
    from ._block_tiles import (
        _grouped_tile,
        _grouped_tile_16,
        _quantize_1x128_tile,
        _quantize_2d_tile,
        _tile_of,
    )

    @triton.jit
    def _block_1d_kernel(
        x_ptr,  # (M, K) fp32 / bf16 / fp16, contiguous
        out_ptr,  # (M, K) fp8 rowwise data
        s_ptr,  # (ceil(K/128), M) fp32 rowwise scale_inv
        out_t_ptr,  # (K, M) fp8 columnwise data
        s_t_ptr,  # (ceil(M/128), K) fp32 columnwise scale_inv
        M,
        K,
        eps,  # fp32 amax floor
        FP8_MAX: tl.constexpr,  # 448.0 (e4m3) or 57344.0 (e5m2)
        INF_BITS: tl.constexpr,  # bits of the scale where fp8_max / amax overflows
        POWER_2: tl.constexpr,
        ROWWISE: tl.constexpr,
        COLUMNWISE: tl.constexpr,
        BLOCK: tl.constexpr,  # 128
        WORDS: tl.constexpr,  # M % 4 == 0: columnwise bytes stored as int32 words
        STAGES: tl.constexpr,  # 0: one tile per program; else persistent, pipelined
        GROUP_M: tl.constexpr,  # the tile order (_tile_of)
    ):
        """Program p: tile p in _tile_of's order (STAGES 0), or tiles p, p + programs, ..."""
        n_m = tl.cdiv(M, BLOCK)
        n_k = tl.cdiv(K, BLOCK)
        if STAGES == 0:  # grid (GROUP_M, n_k, bands): the same order, no division
            pid_m = tl.program_id(2) * GROUP_M + tl.program_id(0)
            if pid_m < n_m:
                _quantize_1x128_tile(
                    x_ptr, out_ptr, s_ptr, out_t_ptr, s_t_ptr, M, K, pid_m * BLOCK,
                    M - pid_m * BLOCK, pid_m, tl.program_id(1) * BLOCK, eps, FP8_MAX, INF_BITS,
                    POWER_2, ROWWISE, COLUMNWISE, BLOCK, WORDS,
                )  # fmt: skip
        else:
            tiles = n_m * n_k
            for t in tl.range(tl.program_id(0), tiles, tl.num_programs(0), num_stages=STAGES):
                pid_m, pid_k = _tile_of(t, n_m, n_k, GROUP_M)
                _quantize_1x128_tile(
                    x_ptr, out_ptr, s_ptr, out_t_ptr, s_t_ptr, M, K, pid_m * BLOCK,
                    M - pid_m * BLOCK, pid_m, pid_k * BLOCK, eps, FP8_MAX, INF_BITS, POWER_2,
                    ROWWISE, COLUMNWISE, BLOCK, WORDS,
                )  # fmt: skip

    @triton.jit
    def _grouped_block_1d_kernel(
        x_ptr,  # (T, K) fp32 / bf16 / fp16, contiguous
        row_offsets_ptr,  # (G + 1,) int32: group g owns rows [o_g, o_{g+1})
        out_ptr,  # (T, K) fp8 rowwise data
        s_ptr,  # (ceil(K/128), T) fp32 rowwise scale_inv
        out_t_ptr,  # (K, T) fp8 columnwise data
        s_t_ptr,  # (max_blocks(T, G), K) fp32 columnwise scale_inv (block_layout)
        T,
        K,
        G,
        eps,
        FP8_MAX: tl.constexpr,
        INF_BITS: tl.constexpr,
        POWER_2: tl.constexpr,
        ROWWISE: tl.constexpr,
        COLUMNWISE: tl.constexpr,
        BLOCK: tl.constexpr,  # 128
        WORDS: tl.constexpr,  # 2: T % 16 == 0 (_grouped_tile_16); 1: T % 4 == 0; 0: neither
        STAGES: tl.constexpr,  # 0: one tile per program; else persistent, pipelined
        GROUP_M: tl.constexpr,  # the tile order (_tile_of)
        BLOCK_G: tl.constexpr,  # a power of two >= G
    ):
        """Tiles (scale row b of the grouped layout, K-block k) as _block_1d_kernel's: rows of
        group g's block b - b_g, found from the offsets on the device; past the last group's
        blocks, no rows (zero scales). Where T % 16 == 0 (WORDS 2) a tile's columnwise bytes go
        out in aligned 16-byte stores but for the 16-row chunks it shares with a neighbouring
        block (_grouped_tile_16); otherwise as words where T, its first row and its row count
        are multiples of 4, else byte by byte (_grouped_tile)."""
        n_b = tl.cdiv(T, BLOCK) + G
        n_k = tl.cdiv(K, BLOCK)
        if STAGES == 0:  # grid (GROUP_M, n_k, bands): the same order, no division
            pid_b = tl.program_id(2) * GROUP_M + tl.program_id(0)
            if pid_b < n_b:
                _grouped_any_tile(
                    x_ptr, row_offsets_ptr, out_ptr, s_ptr, out_t_ptr, s_t_ptr, T, K, G, pid_b,
                    tl.program_id(1), eps, FP8_MAX, INF_BITS, POWER_2, ROWWISE, COLUMNWISE,
                    BLOCK, WORDS, BLOCK_G,
                )  # fmt: skip
        else:
            tiles = n_b * n_k
            for t in tl.range(tl.program_id(0), tiles, tl.num_programs(0), num_stages=STAGES):
                pid_b, pid_k = _tile_of(t, n_b, n_k, GROUP_M)
                _grouped_any_tile(
                    x_ptr, row_offsets_ptr, out_ptr, s_ptr, out_t_ptr, s_t_ptr, T, K, G, pid_b,
                    pid_k, eps, FP8_MAX, INF_BITS, POWER_2, ROWWISE, COLUMNWISE, BLOCK, WORDS,
                    BLOCK_G,
                )  # fmt: skip

    @triton.jit
    def _grouped_any_tile(
        x_ptr, row_offsets_ptr, out_ptr, s_ptr, out_t_ptr, s_t_ptr, T, K, G, pid_b, pid_k, eps,
        FP8_MAX: tl.constexpr, INF_BITS: tl.constexpr, POWER_2: tl.constexpr,
        ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr, BLOCK: tl.constexpr,
        WORDS: tl.constexpr, BLOCK_G: tl.constexpr,
    ):  # fmt: skip
        """Tile (pid_b, pid_k) of the grouped cast: _grouped_tile_16 where WORDS is 2, else
        _grouped_tile."""
        if WORDS == 2:
            _grouped_tile_16(
                x_ptr, row_offsets_ptr, out_ptr, s_ptr, out_t_ptr, s_t_ptr, T, K, G, pid_b, pid_k,
                eps, FP8_MAX, INF_BITS, POWER_2, ROWWISE, COLUMNWISE, BLOCK, BLOCK_G,
            )  # fmt: skip
        else:
            _grouped_tile(
                x_ptr, row_offsets_ptr, out_ptr, s_ptr, out_t_ptr, s_t_ptr, T, K, G, pid_b, pid_k,
                eps, FP8_MAX, INF_BITS, POWER_2, ROWWISE, COLUMNWISE, BLOCK, WORDS, BLOCK_G,
            )  # fmt: skip

    @triton.jit
    def _block_2d_kernel(
        x_ptr,  # (B, R, C) fp32 / bf16 / fp16, contiguous
        out_ptr,  # (B, R, C) fp8 rowwise data
        s_ptr,  # (B, ceil(R/128), round_up(ceil(C/128), 4)) fp32 rowwise scale_inv
        out_t_ptr,  # (B, C, R) fp8 columnwise data
        s_t_ptr,  # (B, ceil(C/128), round_up(ceil(R/128), 4)) fp32 columnwise scale_inv
        R,
        C,
        B,
        eps,
        FP8_MAX: tl.constexpr,
        INF_BITS: tl.constexpr,
        POWER_2: tl.constexpr,
        ROWWISE: tl.constexpr,
        COLUMNWISE: tl.constexpr,
        BLOCK: tl.constexpr,  # 128
        WORDS: tl.constexpr,  # R % 4 == 0: columnwise bytes stored as int32 words
        STAGES: tl.constexpr,  # 0: one tile per program; else persistent, pipelined
        GROUP_M: tl.constexpr,  # the tile order within a matrix (_tile_of)
    ):
        """Tiles of the B matrices one matrix after another, as _block_1d_kernel's."""
        n_r = tl.cdiv(R, BLOCK)
        n_c = tl.cdiv(C, BLOCK)
        if STAGES == 0:  # grid (B * GROUP_M, n_c, bands): no division by a runtime value
            pid_r = tl.program_id(2) * GROUP_M + tl.program_id(0) % GROUP_M
            if pid_r < n_r:
                _quantize_2d_tile(
                    x_ptr, out_ptr, s_ptr, out_t_ptr, s_t_ptr, R, C, tl.program_id(0) // GROUP_M,
                    pid_r, tl.program_id(1), eps, FP8_MAX, INF_BITS, POWER_2, ROWWISE,
                    COLUMNWISE, BLOCK, WORDS,
                )  # fmt: skip
        else:
            tiles = B * n_r * n_c
            for t in tl.range(tl.program_id(0), tiles, tl.num_programs(0), num_stages=STAGES):
                pid_r, pid_c = _tile_of(t % (n_r * n_c), n_r, n_c, GROUP_M)
                _quantize_2d_tile(
                    x_ptr, out_ptr, s_ptr, out_t_ptr, s_t_ptr, R, C, t // (n_r * n_c), pid_r,
                    pid_c, eps, FP8_MAX, INF_BITS, POWER_2, ROWWISE, COLUMNWISE, BLOCK, WORDS,
                )  # fmt: skip

    _launch_1d = FastLaunch(_block_1d_kernel)
    _launch_grouped = FastLaunch(_grouped_block_1d_kernel)
    _launch_2d = FastLaunch(_block_2d_kernel)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def _check_cast(x: torch.Tensor, fp8_dtype, rowwise: bool, columnwise: bool, amax_epsilon) -> None:
    """The argument rules every quantize launcher shares (before any kernel runs)."""
    if not isinstance(x, torch.Tensor) or x.dtype not in HP_DTYPES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"x must be a float32, bfloat16 or float16 tensor, got {got}")
    check_fp8_dtype(fp8_dtype)
    if not (rowwise or columnwise):
        raise ValueError("at least one of rowwise and columnwise must be True")
    eps = float(amax_epsilon)
    if not (math.isfinite(eps) and eps >= 0.0):
        raise ValueError(f"amax_epsilon must be finite and >= 0, got {amax_epsilon}")


def _check_block_dim(x: torch.Tensor, block_dim: int) -> None:
    if block_dim not in (1, 2):
        raise ValueError(f"block_dim must be 1 (1x128 blocks) or 2 (128x128), got {block_dim}")
    if block_dim == 1 and x.dim() != 2:
        raise ValueError(f"block_dim 1 quantizes a 2-D x (M, K), got shape {tuple(x.shape)}")
    if block_dim == 2 and x.dim() < 2:
        raise ValueError(f"block_dim 2 quantizes x (..., R, C), got shape {tuple(x.shape)}")


def _alloc_1x128(x: torch.Tensor, fp8_dtype, rowwise: bool, columnwise: bool, scale_t_rows: int):
    """Uninitialized 1x128 outputs of x (M, K): (data, scale_inv, data_t, scale_inv_t), a usage
    not asked for as Nones; the columnwise scales have `scale_t_rows` rows."""
    rows, cols = x.shape
    dev = x.device
    data = scale = data_t = scale_t = None
    if rowwise:
        data = torch.empty(rows, cols, dtype=fp8_dtype, device=dev)
        scale = torch.empty(-(-cols // BLOCK), rows, dtype=torch.float32, device=dev)
    if columnwise:
        data_t = torch.empty(cols, rows, dtype=fp8_dtype, device=dev)
        scale_t = torch.empty(scale_t_rows, cols, dtype=torch.float32, device=dev)
    return data, scale, data_t, scale_t


def _alloc_2d(x: torch.Tensor, fp8_dtype, rowwise: bool, columnwise: bool):
    """Uninitialized 128x128 outputs of x (..., R, C): (data, scale_inv, data_t, scale_inv_t),
    a usage not asked for as Nones."""
    *batch, rows, cols = x.shape
    n_r, n_c = -(-rows // BLOCK), -(-cols // BLOCK)
    dev = x.device
    data = scale = data_t = scale_t = None
    if rowwise:
        data = torch.empty(*batch, rows, cols, dtype=fp8_dtype, device=dev)
        scale = torch.empty(*batch, n_r, round_up(n_c, 4), dtype=torch.float32, device=dev)
    if columnwise:
        data_t = torch.empty(*batch, cols, rows, dtype=fp8_dtype, device=dev)
        scale_t = torch.empty(*batch, n_c, round_up(n_r, 4), dtype=torch.float32, device=dev)
    return data, scale, data_t, scale_t


def _constexprs(x: torch.Tensor, fp8_dtype, power_2_scale: bool, rowwise: bool, columnwise: bool):
    """The constexprs every kernel takes first: FP8_MAX, INF_BITS, POWER_2, ROWWISE,
    COLUMNWISE."""
    fp8_max, inf_bits = FP8_MAX[fp8_dtype], _INF_SCALE_BITS[x.dtype]
    return fp8_max, inf_bits, bool(power_2_scale), bool(rowwise), bool(columnwise)


def _launch_config(x: torch.Tensor, config: tuple[int, int, int, int], n_m: int, n_k: int):
    """(num_warps, (num_stages, group_m), grid) of a kernel on x whose tiles form n_m x n_k
    (per matrix; x (..., R, C): a batch of matrices) under `config` (CONFIG_1D's form). One
    program per tile (num_stages 0): grid (group_m * matrices, n_k, bands of group_m rows of
    tiles), group_m raised where the bands would pass grid axis 2's limit. Persistent:
    programs_per_sm per SM (at most one per tile), num_stages lowered where x's tiles would
    not fit _STAGE_BYTES (an fp32 tile is 64 KiB)."""
    num_warps, stages, per_sm, group_m = config
    matrices = math.prod(x.shape[:-2])
    if stages == 0:
        group_m = max(group_m, -(-n_m // 65535))
        return num_warps, (0, group_m), (group_m * matrices, n_k, -(-n_m // group_m))
    stages = max(1, min(stages, _STAGE_BYTES // (BLOCK * BLOCK * x.element_size())))
    programs = max(1, min(n_m * n_k * matrices, per_sm * sm_count(x.device.index)))
    return num_warps, (stages, group_m), (programs, 1, 1)


@compiled_as_op(
    "(Tensor x, ScalarType fp8_dtype, int block_dim, bool rowwise, bool columnwise, "
    "bool power_2_scale, float amax_epsilon) -> (Tensor, Tensor, Tensor, Tensor)"
)
def block_quantize(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    block_dim: int,
    rowwise: bool,
    columnwise: bool,
    power_2_scale: bool,
    amax_epsilon: float,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Quantize x in 1x128 (block_dim 1, x (M, K)) or 128x128 (block_dim 2, x (..., R, C))
    blocks: (data | None, scale_inv | None, data_t | None, scale_inv_t | None) in the module
    docstring's layouts, a usage not asked for as Nones. One launch on CUDA."""
    _check_cast(x, fp8_dtype, rowwise, columnwise, amax_epsilon)
    _check_block_dim(x, block_dim)
    if not (x.is_cuda and triton_available() and x.numel() > 0):
        return block_quantize_reference(
            x, fp8_dtype, block_dim, rowwise, columnwise, power_2_scale, amax_epsilon
        )
    _check_kernel_sizes(x)
    if not x.is_contiguous():
        x = x.contiguous()
    consts = _constexprs(x, fp8_dtype, power_2_scale, rowwise, columnwise)
    if block_dim == 1:
        return _quantize_1d(x, fp8_dtype, amax_epsilon, consts, CONFIG_1D)
    return _quantize_2d(x, fp8_dtype, amax_epsilon, consts, CONFIG_2D)


def _check_kernel_sizes(x: torch.Tensor) -> None:
    """The kernels index inside a tile in int32: 128 * (a matrix dimension) < 2**31; the
    column blocks of a matrix are grid axis 1 (at most 65535); the matrices of a batch, at
    most 65535."""
    if max(x.shape[-2:]) >= 2**24 or x.shape[-1] > 65535 * BLOCK:
        raise ValueError(
            "block casts on the GPU take matrix dimensions below 2**24 and at most "
            f"{65535 * BLOCK} columns, got {tuple(x.shape)}"
        )
    if math.prod(x.shape[:-2]) > 65535:
        raise ValueError(f"block casts on the GPU take at most 65535 matrices, got {x.shape}")


def _quantize_1d(x: torch.Tensor, fp8_dtype, amax_epsilon, consts, config):
    """Launch _block_1d_kernel on x (M, K), M, K > 0, contiguous, under `config` (CONFIG_1D's
    form); consts from _constexprs."""
    rows, cols = x.shape
    out = _alloc_1x128(x, fp8_dtype, consts[3], consts[4], -(-rows // BLOCK))
    warps, order, grid = _launch_config(x, config, -(-rows // BLOCK), -(-cols // BLOCK))
    consts = (*consts, BLOCK, rows % 4 == 0, *order)
    _launch(_launch_1d, warps, grid, (x,), out, (rows, cols), amax_epsilon, consts)
    return out


def _quantize_2d(x: torch.Tensor, fp8_dtype, amax_epsilon, consts, config):
    """Launch _block_2d_kernel on x (..., R, C), R, C > 0, contiguous, under `config`
    (CONFIG_2D's form); consts from _constexprs."""
    *batch, rows, cols = x.shape
    out = _alloc_2d(x, fp8_dtype, consts[3], consts[4])
    count = math.prod(batch)
    warps, order, grid = _launch_config(x, config, -(-rows // BLOCK), -(-cols // BLOCK))
    consts = (*consts, BLOCK, rows % 4 == 0, *order)
    _launch(_launch_2d, warps, grid, (x,), out, (rows, cols, count), amax_epsilon, consts)
    return out


def _launch(launcher, num_warps: int, grid, inputs, out, ints, amax_epsilon, consts) -> None:
    """Launch one of the kernels on `inputs` (x, and row_offsets for the grouped one) and the
    four outputs (x in place of one not asked for: never stored to), with the int arguments,
    eps and the constexprs (_constexprs', then BLOCK, WORDS, STAGES, GROUP_M, and for the
    grouped kernel BLOCK_G)."""
    x = inputs[0]
    outs = [x if t is None else t for t in out]
    key = (x.dtype, outs[0].dtype, outs[2].dtype, consts, num_warps)
    key += ptr_key(*inputs, *outs) + tuple(int_key(n) for n in ints)
    launcher(key, grid, num_warps, *inputs, *outs, *ints, float(amax_epsilon), *consts)


@compiled_as_op(
    "(Tensor x, Tensor row_offsets, ScalarType fp8_dtype, bool rowwise, bool columnwise, "
    "bool power_2_scale, float amax_epsilon) -> (Tensor, Tensor, Tensor, Tensor)"
)
def grouped_block_quantize(
    x: torch.Tensor,
    row_offsets: torch.Tensor,
    fp8_dtype: torch.dtype,
    rowwise: bool,
    columnwise: bool,
    power_2_scale: bool,
    amax_epsilon: float,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Quantize x (T, K), G groups of rows (row_offsets (G + 1,) int32 on x's device: o_0 = 0,
    non-decreasing, o_G = T; not checked on the device) in 1x128 blocks: (data (T, K),
    scale_inv (ceil(K/128), T), data_t (K, T), scale_inv_t (max_blocks(T, G), K)), the
    columnwise copy in block_layout's grouped layout; a usage not asked for as Nones. One
    launch on CUDA, no host synchronization."""
    _check_cast(x, fp8_dtype, rowwise, columnwise, amax_epsilon)
    check_row_offsets(x, row_offsets)
    if not (x.is_cuda and triton_available() and x.numel() > 0):
        return grouped_block_quantize_reference(
            x, row_offsets, fp8_dtype, rowwise, columnwise, power_2_scale, amax_epsilon
        )
    _check_kernel_sizes(x)
    if not x.is_contiguous():
        x = x.contiguous()
    consts = _constexprs(x, fp8_dtype, power_2_scale, rowwise, columnwise)
    return _quantize_grouped(x, row_offsets, fp8_dtype, amax_epsilon, consts, CONFIG_GROUPED)


def _quantize_grouped(x, row_offsets, fp8_dtype, amax_epsilon, consts, config):
    """Launch _grouped_block_1d_kernel on x (T, K), T, K > 0, contiguous, under `config`
    (CONFIG_GROUPED's form); consts from _constexprs."""
    rows, cols = x.shape
    groups = row_offsets.shape[0] - 1
    blocks = max_blocks(rows, groups)
    out = _alloc_1x128(x, fp8_dtype, consts[3], consts[4], blocks)
    block_g = max(next_power_of_2(groups), 2)
    warps, order, grid = _launch_config(x, config, blocks, -(-cols // BLOCK))
    words = 2 if rows % 16 == 0 else int(rows % 4 == 0)
    consts = (*consts, BLOCK, words, *order, block_g)
    inputs = (x, row_offsets.contiguous())
    ints = (rows, cols, groups)
    _launch(_launch_grouped, warps, grid, inputs, out, ints, amax_epsilon, consts)
    return out


def check_row_offsets(x: torch.Tensor, row_offsets: torch.Tensor) -> None:
    """The host-side rules of a grouped cast's x (T, K) and row_offsets (G + 1,) int32 (their
    values are on the device: not checked)."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (T, K), got shape {tuple(x.shape)}")
    check_offsets(row_offsets, x.device, "x")
