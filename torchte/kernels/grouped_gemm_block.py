"""Grouped block-scaled FP8 GEMMs of a mixture-of-experts linear layer (DeepSeek-V3's recipe:
1x128 scales on activations and gradients, 128x128 on weights), group sizes on the device only:
no size is read on the host, so a call never syncs and can be captured in a CUDA graph. One
launch per call.

Legend: G groups (experts), T tokens, R the reduced dimension of a rows GEMM, N its output
features; o_g = row_offsets[g] (o_0 = 0, o_G = T, group g owns rows [o_g, o_{g+1}), may be
empty); b_g = block_offsets[g] (block_layout.block_offsets: the running sum of ceil(m_g / 128)).
FP8 data is float8_e4m3fn or float8_e5m2 (the two operands may differ); every value is the FP8
value times its block's fp32 scale.

- grouped_block_rows_gemm: a (T, R) with a_scale (ceil(R/128), T) (a_scale[j, t]: row t,
  R-block j), b (G, N, R) with b_scale (G, ceil(N/128), round_up(ceil(R/128), 4)) (b_scale[g,
  i, j]: the 128x128 tile of N-block i, R-block j of b[g]) -> c (T, N), c[rows of g] = A_g @
  B_g^T of the dequantized values. The forward GEMM (a = x (T, K), b = the weights (G, N, K))
  and the input-gradient GEMM (a = dy (T, N), b = the weights' columnwise copies (G, K, N)).
  R must be a multiple of 16 (16-byte rows); N and T may be anything.
- grouped_block_reduction_gemm: a_cols (N, T) with a_scale (BLOCKS, N), b_cols (K, T) with
  b_scale (BLOCKS, K), BLOCKS = block_layout.max_blocks(T, G) (block_layout's grouped
  columnwise layout: group g's columns [o_g, o_{g+1}) in 128-token blocks from o_g, block j's
  scales in row b_g + j) -> out (G, N, K), out[g] = A_g @ B_g^T over group g's columns (the
  weight gradient dW_g = dy_g^T x_g), zeros for an empty group; or added to a given `out`
  (accumulate=True: Megatron's main_grad). N, K and T may be anything. Where T and a group's
  first column o_g are multiples of 16 (splits padded to 16, as FP8 MoE layers pad them), the
  group's whole blocks are pipelined 16-byte loads and its last, partial block is loaded in
  whole 16-byte chunks with the columns past the group zeroed in registers; other groups are
  loaded byte by byte, unpipelined (correct, slower).

Arithmetic, per 128-wide step of the reduced dimension: the FP8 tensor cores' product of the
two tiles (their own accumulator over these 128 products), times the scales of the step (a
row's scale times the tile's, or times the column's), added to an fp32 accumulator: DeepSeek's
promotion. BLOCK_K is 128, the scale block. A tile of BLOCK_N <= 128 columns sits in one
128-block of b; BLOCK_N = 256 runs as two 128-column slices sharing the tile of a, each with its
own accumulator, so that the tensor-core product of a step (a second register set) is never
wider than 128 columns.

Both operands of every tile are loaded with the reduced dimension contiguous (K-major), the
layout Hopper's FP8 tensor-core instructions (wgmma) take. The grids are worst cases, as in
grouped_gemm_fp8: rows GEMM (cdiv(N, BLOCK_N), cdiv(T, BLOCK_M) + G) with row tiles numbered
group by group (grouped_cast's _tile_group; programs past the split's own count return at
once); reduction GEMM (cdiv(N, BLOCK_M) * cdiv(K, BLOCK_N), G), each program looping over its
group's 128-token blocks. The kernels trust the offsets (checking them would cost a sync); the
references check them.
"""

from __future__ import annotations

import torch

from ._triton import FastLaunch, int_key, ptr_key, tl, triton, triton_available
from .block_layout import BLOCK
from .grouped_cast import _group_block
from .grouped_gemm_block_reference import (
    _check_reduction,
    _check_rows,
    grouped_block_reduction_gemm_reference,
    grouped_block_rows_gemm_reference,
)

__all__ = [
    "REDUCTION_CONFIG",
    "ROWS_CONFIG",
    "ROWS_CONFIG_SMALL",
    "grouped_block_reduction_gemm",
    "grouped_block_reduction_gemm_reference",
    "grouped_block_rows_gemm",
    "grouped_block_rows_gemm_reference",
]

# (BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_K is the scale block, 128; BLOCK_N a power
# of two up to 128, or 256 (two 128-column slices). Not yet timed (benchmarks/
# grouped_block_gemm.py --sweep): 128x128 tiles on two warpgroups, 4 stages of 32 KB, as the
# per-tensor kernels; 64-row tiles up to SMALL_ROWS tokens. Compiled for sm_90a (Triton 3.6,
# ptxas): rows 128x128/8 warps 200 registers, 130 KB shared; 64x128/4 warps 214, 97 KB (two
# CTAs fit an SM); reduction 128x128/8 warps 255, 131 KB; no spills.
ROWS_CONFIG = (128, 128, 8, 4)
ROWS_CONFIG_SMALL = (64, 128, 4, 4)
SMALL_ROWS = 4096
REDUCTION_CONFIG = (128, 128, 8, 4)


if triton is not None:
    from .grouped_cast import _tile_group

    # How the reduction GEMM loads a 128-token block (see _reduction_step).
    WHOLE, CHUNKS, PIECES = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)

    @triton.jit
    def _store_slice(
        out_ptr, stride, rows_left, cols_left, acc,
        BLOCK_M: tl.constexpr, SLICE_N: tl.constexpr, ACCUMULATE: tl.constexpr,
    ):  # fmt: skip
        """Store (or with ACCUMULATE add to what is there) fp32 acc (BLOCK_M, SLICE_N) at the
        row-major out_ptr (row stride `stride`), in out's dtype, rows < rows_left and columns
        < cols_left."""
        rows = tl.arange(0, BLOCK_M)
        cols = tl.arange(0, SLICE_N)
        mask = (rows < rows_left)[:, None] & (cols < cols_left)[None, :]
        ptrs = out_ptr + rows[:, None] * stride + cols[None, :]
        if ACCUMULATE:
            acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _grouped_block_rows_kernel(
        a_ptr,  # (T, R) fp8
        a_scale_ptr,  # (cdiv(R, 128), T) fp32
        b_ptr,  # (G, N, R) fp8
        b_scale_ptr,  # (G, cdiv(N, 128), round_up(cdiv(R, 128), 4)) fp32
        c_ptr,  # (T, N) bf16 / fp16 / fp32
        row_offsets_ptr,  # (G + 1,) int32: o_g
        T,
        N,
        R,  # a multiple of 16
        G,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SLICE_N: tl.constexpr,  # BLOCK_N, or 128 when BLOCK_N = 256 (two slices)
        NUM_STAGES: tl.constexpr,
        G_BLOCK: tl.constexpr,  # a power of two >= G
    ):
        BLOCK_K: tl.constexpr = 128
        # Consecutive programs share a row tile of a: one wave of the grid reads a once.
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        group, tile = _tile_group(row_offsets_ptr, G, pid_m, BLOCK_M, G_BLOCK)
        if group >= G:  # past the split's last tile: an idle program of the worst-case grid
            return
        row_start = tl.load(row_offsets_ptr + group)
        rows_left = tl.load(row_offsets_ptr + group + 1) - row_start - tile * BLOCK_M
        first_row = row_start + tile * BLOCK_M
        first_col = pid_n * BLOCK_N
        rows = tl.arange(0, BLOCK_M)
        cols = tl.arange(0, SLICE_N)
        depth = tl.arange(0, BLOCK_K)
        row_in = rows < rows_left
        col_in = cols < N - first_col
        col2_in = cols < N - first_col - BLOCK_K
        a_ptrs = a_ptr + first_row.to(tl.int64) * R + (rows[:, None] * R + depth[None, :])
        b_ptrs = b_ptr + (group.to(tl.int64) * N + first_col) * R
        b_ptrs += cols[:, None] * R + depth[None, :]
        a_scale_ptrs = a_scale_ptr + first_row + rows
        r_blocks = tl.cdiv(R, BLOCK_K)
        scale_row = (r_blocks + 3) // 4 * 4
        b_scale_ptr += (group * tl.cdiv(N, BLOCK_K) + first_col // BLOCK_K) * scale_row
        acc = tl.zeros((BLOCK_M, SLICE_N), tl.float32)
        acc2 = tl.zeros((BLOCK_M, SLICE_N), tl.float32)
        for k in tl.range(0, r_blocks, num_stages=NUM_STAGES):
            depth_in = (depth < R - k * BLOCK_K)[None, :]
            a = tl.load(a_ptrs, mask=row_in[:, None] & depth_in, other=0.0)
            a_scale = tl.load(a_scale_ptrs, mask=row_in, other=0.0)
            b = tl.load(b_ptrs, mask=col_in[:, None] & depth_in, other=0.0)
            # The tensor cores' sum of 128 products, promoted to fp32 with the step's scales.
            scale = a_scale * tl.load(b_scale_ptr + k)
            acc += tl.dot(a, tl.trans(b)) * scale[:, None]
            if BLOCK_N > SLICE_N:  # columns first_col + 128.., in the next 128-block of b
                b = tl.load(b_ptrs + BLOCK_K * R, mask=col2_in[:, None] & depth_in, other=0.0)
                b_scale = tl.load(b_scale_ptr + scale_row + k, mask=first_col + 128 < N, other=0.0)
                acc2 += tl.dot(a, tl.trans(b)) * (a_scale * b_scale)[:, None]
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
            a_scale_ptrs += T
        c_ptr += first_row.to(tl.int64) * N + first_col
        _store_slice(c_ptr, N, rows_left, N - first_col, acc, BLOCK_M, SLICE_N, False)
        if BLOCK_N > SLICE_N:
            cols_left = N - first_col - BLOCK_K
            _store_slice(c_ptr + BLOCK_K, N, rows_left, cols_left, acc2, BLOCK_M, SLICE_N, False)

    @triton.jit
    def _load_block(base, rows, rows_in, T, width, CHUNKS: tl.constexpr):
        """The FP8 tile (rows, 128) of the row-major (., T) matrix at base, rows where rows_in:
        every column, or (CHUNKS: a group's last block, base and T multiples of 16) columns <
        width, loaded in 16-byte chunks (a column mask of unknown alignment would split the
        loads into bytes), the columns past width zeroed in registers as bytes (FP8 values are
        only bitcast)."""
        depth = tl.arange(0, 128)
        ptrs = base + (rows[:, None] * T + depth[None, :])
        if CHUNKS:
            chunks_in = (depth < (width + 15) // 16 * 16)[None, :]
            tile = tl.load(ptrs, mask=rows_in[:, None] & chunks_in, other=0.0)
            bits = tile.to(tl.uint8, bitcast=True)
            bits = tl.where((depth < width)[None, :], bits, tl.zeros_like(bits))
            tile = bits.to(tile.dtype, bitcast=True)
        else:
            tile = tl.load(ptrs, mask=rows_in[:, None], other=0.0)
        return tile

    @triton.jit
    def _product_in_pieces(
        a_base, b_base, rows, cols, rows_in, cols_in, T, width,
        BLOCK_M: tl.constexpr, SLICE_N: tl.constexpr,
    ):  # fmt: skip
        """fp32 A @ B^T over columns [0, min(width, 128)) of the (., T) matrices at a_base
        (rows) and b_base (cols), of unknown alignment: loaded byte by byte, 32 columns at a
        time (bytes take a register each), the tensor cores accumulating the 128 columns'
        products as in one step."""
        product = tl.zeros((BLOCK_M, SLICE_N), tl.float32)
        for piece in tl.range(0, 4, num_stages=1):  # not unrolled: one piece's bytes live
            depth = piece * 32 + tl.arange(0, 32)
            in_block = (depth < width)[None, :]
            a_ptrs = a_base + (rows[:, None] * T + depth[None, :])
            a = tl.load(a_ptrs, mask=rows_in[:, None] & in_block, other=0.0)
            b_ptrs = b_base + (cols[:, None] * T + depth[None, :])
            b = tl.load(b_ptrs, mask=cols_in[:, None] & in_block, other=0.0)
            product = tl.dot(a, tl.trans(b), product)
        return product

    @triton.jit
    def _reduction_step(
        acc, acc2, a_base, b_base, a_scale_ptrs, b_scale_ptrs, rows, cols, row_in, col_in,
        col2_in, T, width,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SLICE_N: tl.constexpr,
        MODE: tl.constexpr,
    ):  # fmt: skip
        """(acc, acc2) plus the products of one 128-token block of A (N, T) at a_base (rows
        `rows`) and B (K, T) at b_base (rows `cols`; for acc2, cols + 128), each promoted with
        the block's scales. MODE: WHOLE (all 128 columns), CHUNKS (a last block of `width`
        columns, 16-byte aligned) or PIECES (`width` columns, alignment unknown)."""
        a_scale = tl.load(a_scale_ptrs, mask=row_in, other=0.0)[:, None]
        b_scale = tl.load(b_scale_ptrs, mask=col_in, other=0.0)[None, :]
        if MODE == PIECES:
            product = _product_in_pieces(
                a_base, b_base, rows, cols, row_in, col_in, T, width, BLOCK_M, SLICE_N
            )
            acc += product * a_scale * b_scale
            if BLOCK_N > SLICE_N:
                b_scale = tl.load(b_scale_ptrs + 128, mask=col2_in, other=0.0)[None, :]
                product = _product_in_pieces(
                    a_base, b_base + 128 * T, rows, cols, row_in, col2_in, T, width,
                    BLOCK_M, SLICE_N,
                )  # fmt: skip
                acc2 += product * a_scale * b_scale
        else:
            a = _load_block(a_base, rows, row_in, T, width, MODE == CHUNKS)
            b = _load_block(b_base, cols, col_in, T, width, MODE == CHUNKS)
            # The tensor cores' sum of 128 products, promoted to fp32 with the block's scales.
            acc += tl.dot(a, tl.trans(b)) * a_scale * b_scale
            if BLOCK_N > SLICE_N:
                b = _load_block(b_base + 128 * T, cols, col2_in, T, width, MODE == CHUNKS)
                b_scale = tl.load(b_scale_ptrs + 128, mask=col2_in, other=0.0)[None, :]
                acc2 += tl.dot(a, tl.trans(b)) * a_scale * b_scale
        return acc, acc2

    @triton.jit
    def _reduction_tile(
        a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, start, end, first_block, first_row, first_col,
        T, N, K,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SLICE_N: tl.constexpr,
        NUM_STAGES: tl.constexpr, ALIGNED: tl.constexpr,
    ):  # fmt: skip
        """fp32 (acc, acc2), each (BLOCK_M, SLICE_N): the sum over the 128-token blocks j of
        columns [start, end) of A[rows] @ B[cols]^T * a_scale[first_block + j, rows] *
        b_scale[first_block + j, cols], rows from first_row, cols from first_col (acc2: from
        first_col + 128, zeros unless BLOCK_N = 256). A (N, T), B (K, T) row-major FP8.
        ALIGNED: start and T are multiples of 16."""
        rows = tl.arange(0, BLOCK_M)
        cols = tl.arange(0, SLICE_N)
        row_in = rows < N - first_row
        col_in = cols < K - first_col
        col2_in = cols < K - first_col - 128
        a_base = a_ptr + start + first_row.to(tl.int64) * T
        b_base = b_ptr + start + first_col.to(tl.int64) * T
        a_scale_ptrs = a_scale_ptr + first_block * N + first_row + rows
        b_scale_ptrs = b_scale_ptr + first_block * K + first_col + cols
        acc = tl.zeros((BLOCK_M, SLICE_N), tl.float32)
        acc2 = tl.zeros((BLOCK_M, SLICE_N), tl.float32)
        width = end - start
        if ALIGNED:
            # The whole blocks, pipelined, then the group's last block if partial (its columns
            # past `end` are the next group's).
            for k in tl.range(0, width // 128, num_stages=NUM_STAGES):
                acc, acc2 = _reduction_step(
                    acc, acc2, a_base + k * 128, b_base + k * 128, a_scale_ptrs + k * N,
                    b_scale_ptrs + k * K, rows, cols, row_in, col_in, col2_in, T, 128,
                    BLOCK_M, BLOCK_N, SLICE_N, WHOLE,
                )  # fmt: skip
            done = width // 128 * 128
            if done < width:
                acc, acc2 = _reduction_step(
                    acc, acc2, a_base + done, b_base + done, a_scale_ptrs + done // 128 * N,
                    b_scale_ptrs + done // 128 * K, rows, cols, row_in, col_in, col2_in, T,
                    width - done, BLOCK_M, BLOCK_N, SLICE_N, CHUNKS,
                )  # fmt: skip
        else:
            # Byte loads cannot be asynchronous copies: nothing to pipeline.
            for k in tl.range(0, tl.cdiv(width, 128), num_stages=1):
                acc, acc2 = _reduction_step(
                    acc, acc2, a_base + k * 128, b_base + k * 128, a_scale_ptrs + k * N,
                    b_scale_ptrs + k * K, rows, cols, row_in, col_in, col2_in, T,
                    width - k * 128, BLOCK_M, BLOCK_N, SLICE_N, PIECES,
                )  # fmt: skip
        return acc, acc2

    @triton.jit
    def _grouped_block_reduction_kernel(
        a_ptr,  # (N, T) fp8
        a_scale_ptr,  # (BLOCKS, N) fp32
        b_ptr,  # (K, T) fp8
        b_scale_ptr,  # (BLOCKS, K) fp32
        out_ptr,  # (G, N, K) bf16 / fp16 / fp32
        row_offsets_ptr,  # (G + 1,) int32: o_g
        block_offsets_ptr,  # (G + 1,) int32: b_g
        T,
        N,
        K,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SLICE_N: tl.constexpr,  # BLOCK_N, or 128 when BLOCK_N = 256 (two slices)
        NUM_STAGES: tl.constexpr,
        ACCUMULATE: tl.constexpr,
    ):
        pid = tl.program_id(0)
        group = tl.program_id(1)
        tiles_n = tl.cdiv(K, BLOCK_N)
        first_row = (pid // tiles_n) * BLOCK_M
        first_col = (pid % tiles_n) * BLOCK_N
        start = tl.load(row_offsets_ptr + group)
        end = tl.load(row_offsets_ptr + group + 1)
        first_block = tl.load(block_offsets_ptr + group)
        # Two copies of the loops: where the group's rows start on 16-byte boundaries its loads
        # are 16-byte vectors (the compiler must be told so), elsewhere bytes.
        if (start % 16 == 0) & (T % 16 == 0):
            acc, acc2 = _reduction_tile(
                a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, tl.multiple_of(start, 16), end,
                first_block, first_row, first_col, T, N, K,
                BLOCK_M, BLOCK_N, SLICE_N, NUM_STAGES, True,
            )  # fmt: skip
        else:
            acc, acc2 = _reduction_tile(
                a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, start, end,
                first_block, first_row, first_col, T, N, K,
                BLOCK_M, BLOCK_N, SLICE_N, NUM_STAGES, False,
            )  # fmt: skip
        out_ptr += (group.to(tl.int64) * N + first_row) * K + first_col
        rows_left = N - first_row
        _store_slice(out_ptr, K, rows_left, K - first_col, acc, BLOCK_M, SLICE_N, ACCUMULATE)
        if BLOCK_N > SLICE_N:
            cols_left = K - first_col - SLICE_N
            _store_slice(
                out_ptr + SLICE_N, K, rows_left, cols_left, acc2, BLOCK_M, SLICE_N, ACCUMULATE
            )

    _launch_rows_gemm = FastLaunch(_grouped_block_rows_kernel)
    _launch_reduction_gemm = FastLaunch(_grouped_block_reduction_kernel)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def grouped_block_rows_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    row_offsets: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """c (T, N) out_dtype: c[o_g:o_{g+1}] = A_g @ B_g^T of the dequantized values, for a (T, R)
    FP8 with a_scale (ceil(R/128), T) fp32 (1x128 blocks), b (G, N, R) FP8 with b_scale (G,
    ceil(N/128), round_up(ceil(R/128), 4)) fp32 (128x128 tiles), row_offsets (G + 1,) int32;
    R a multiple of 16. One launch on CUDA; the torch reference elsewhere."""
    _check_rows(a, a_scale, b, b_scale, row_offsets, out_dtype)
    if not (a.is_cuda and triton_available()):
        return grouped_block_rows_gemm_reference(a, a_scale, b, b_scale, row_offsets, out_dtype)
    (tokens, reduced), features = a.shape, b.shape[1]
    if tokens == 0 or features == 0 or reduced == 0:
        return torch.zeros(tokens, features, dtype=out_dtype, device=a.device)
    config = ROWS_CONFIG_SMALL if tokens <= SMALL_ROWS else ROWS_CONFIG
    return _rows_gemm(a, a_scale, b, b_scale, row_offsets, out_dtype, config)


def grouped_block_reduction_gemm(
    a_cols: torch.Tensor,
    a_scale: torch.Tensor,
    b_cols: torch.Tensor,
    b_scale: torch.Tensor,
    row_offsets: torch.Tensor,
    block_offsets: torch.Tensor,
    out_dtype: torch.dtype,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """out (G, N, K): out[g] = A_g @ B_g^T of the dequantized values over group g's columns
    [o_g, o_{g+1}), for a_cols (N, T) FP8 with a_scale (BLOCKS, N) fp32, b_cols (K, T) FP8 with
    b_scale (BLOCKS, K) fp32, BLOCKS = max_blocks(T, G), group g's 128-token block j scaled by
    row block_offsets[g] + j; row_offsets and block_offsets (G + 1,) int32. Zeros for an empty
    group. `out` (G, N, K) of out_dtype, contiguous: written, or with accumulate=True added to
    (summed in fp32, rounded once). One launch on CUDA; the torch reference elsewhere."""
    args = (a_cols, a_scale, b_cols, b_scale, row_offsets, block_offsets)
    _check_reduction(*args, out_dtype, out, accumulate)
    if not (a_cols.is_cuda and triton_available()):
        return grouped_block_reduction_gemm_reference(*args, out_dtype, out, accumulate)
    if out is None:
        shape = (row_offsets.numel() - 1, a_cols.shape[0], b_cols.shape[0])
        out = torch.empty(shape, dtype=out_dtype, device=a_cols.device)
    if out.numel() > 0:
        _reduction_gemm(*args, out, accumulate, REDUCTION_CONFIG)
    return out


def _slices(block_n: int) -> int:
    """SLICE_N, the width of one accumulator of a tile BLOCK_N wide: ValueError unless
    BLOCK_N is a power of two up to 128 (one slice), or 256 (two)."""
    if block_n <= 0 or block_n & (block_n - 1) or block_n > 2 * BLOCK:
        raise ValueError(f"BLOCK_N must be a power of two up to {2 * BLOCK}, got {block_n}")
    return min(block_n, BLOCK)


def _rows_gemm(a, a_scale, b, b_scale, row_offsets, out_dtype, config) -> torch.Tensor:
    """Launch _grouped_block_rows_kernel with config (BLOCK_M, BLOCK_N, num_warps, num_stages)
    on a (T, R), b (G, N, R), T, N, R, G > 0 (operands copied if not contiguous). Returns c."""
    a, a_scale = a.contiguous(), a_scale.contiguous()
    b, b_scale = b.contiguous(), b_scale.contiguous()
    tokens, reduced = a.shape
    groups, features = b.shape[0], b.shape[1]
    block_m, block_n, num_warps, num_stages = config
    slice_n = _slices(block_n)
    # Any split of T rows into G groups has at most cdiv(T, BLOCK_M) + G row tiles.
    grid = (-(-features // block_n), -(-tokens // block_m) + groups, 1)
    if grid[1] > 65535:  # CUDA's limit on a grid's second dimension
        raise ValueError(f"{tokens} tokens need {grid[1]} row tiles, more than 65535")
    c = torch.empty(tokens, features, dtype=out_dtype, device=a.device)
    g_block = _group_block(groups)
    pointers = (a, a_scale, b, b_scale, c, row_offsets)
    key = (a.dtype, b.dtype, out_dtype, config, g_block, *int_key(tokens), *int_key(features))
    key += (*int_key(reduced), *int_key(groups), *ptr_key(*pointers))
    _launch_rows_gemm(
        key, grid, num_warps, *pointers, tokens, features, reduced, groups,
        block_m, block_n, slice_n, num_stages, g_block,
    )  # fmt: skip
    return c


def _reduction_gemm(
    a_cols, a_scale, b_cols, b_scale, row_offsets, block_offsets, out, accumulate, config
) -> None:
    """Launch _grouped_block_reduction_kernel with config (BLOCK_M, BLOCK_N, num_warps,
    num_stages) into out (G, N, K) contiguous, G, N, K > 0."""
    a_cols, a_scale = a_cols.contiguous(), a_scale.contiguous()
    b_cols, b_scale = b_cols.contiguous(), b_scale.contiguous()
    groups, features, reduced = out.shape
    tokens = a_cols.shape[1]
    block_m, block_n, num_warps, num_stages = config
    slice_n = _slices(block_n)
    grid = (-(-features // block_m) * -(-reduced // block_n), groups, 1)
    pointers = (a_cols, a_scale, b_cols, b_scale, out, row_offsets, block_offsets)
    key = (a_cols.dtype, b_cols.dtype, out.dtype, config, accumulate, *int_key(tokens))
    key += (*int_key(features), *int_key(reduced), *ptr_key(*pointers))
    _launch_reduction_gemm(
        key, grid, num_warps, *pointers, tokens, features, reduced,
        block_m, block_n, slice_n, num_stages, accumulate,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------
