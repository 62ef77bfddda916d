"""Column sums of a tile-walking kernel's input, split over row blocks: how many row blocks a
column-block grid takes, and the launch that adds the row blocks' partial sums.

A kernel that walks columns [p BLOCK_N, (p + 1) BLOCK_N) over a block of rows and sums them
(kernels/activation_fp8's backward, kernels/cast_dbias) writes the full sums itself when one
row block covers the rows, else an fp32 row of partial sums per row block; sum_partials adds
those rows in their order (deterministic) and rounds once to the output dtype: one launch.
"""

from __future__ import annotations

import torch

from ._triton import FastLaunch, cdiv, tl, triton

__all__ = ["SUM_BLOCK_N", "row_split", "sum_partials"]

# Columns a program of _sum_partials_kernel adds up.
SUM_BLOCK_N = 256

if triton is not None:
    from ._fp8_codec import _round_as

    @triton.jit
    def _sum_partials_kernel(
        partial_ptr,  # (S, N) fp32, contiguous
        out_ptr,  # (N,) fp32 / bf16 / fp16: the sums over S, rounded once
        S,
        N,
        BLOCK_N: tl.constexpr,
    ):
        """out[c] = sum over s of partial[s, c], in order of s."""
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_in = cols < N
        acc = tl.zeros((BLOCK_N,), tl.float32)
        for s in range(0, S):
            acc += tl.load(partial_ptr + s * N + cols, mask=col_in, other=0.0)
        out = _round_as(acc, out_ptr).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + cols, out, mask=col_in)

    _launch_sum_partials = FastLaunch(_sum_partials_kernel)


def row_split(rows: int, col_blocks: int, block_m: int, sms: int) -> tuple[int, int]:
    """(rows per program, row blocks) of a (col_blocks, row blocks) grid walking BLOCK_M rows a
    step: enough programs for about 4 per SM; one row block (the sums written by the kernel
    itself, no second launch) when the column blocks alone fill the GPU or rows are few."""
    steps = cdiv(rows, block_m)
    want = max(1, cdiv(4 * sms, col_blocks))
    per = cdiv(steps, min(steps, want)) * block_m
    return per, cdiv(rows, per)


def sum_partials(partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(N,) in dtype: the column sums of partial (S, N) fp32 (contiguous), added in row order
    in fp32 and rounded once; one Triton launch (the kernels' launchers call it, also under
    Triton's CPU interpreter)."""
    splits, cols = partial.shape
    out = torch.empty(cols, dtype=dtype, device=partial.device)
    key = (dtype, splits == 1, splits & 15, cols == 1, cols & 15, cols >> 31)
    key += (partial.data_ptr() & 15, out.data_ptr() & 15)
    grid = (cdiv(cols, SUM_BLOCK_N), 1, 1)
    _launch_sum_partials(key, grid, 4, partial, out, splits, cols, SUM_BLOCK_N)
    return out
