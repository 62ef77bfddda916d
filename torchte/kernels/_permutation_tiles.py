"""The @triton.jit pieces that torchte/kernels/permutation.py's kernels share: a token's routes
read from a row-id map, float bit patterns, and the zeroing of the output rows that no route
writes.

Shape legend: N tokens, H hidden, E experts, K routes per token, R output rows. Maps:
kernels/permutation_maps.py's layouts (a mask map (N, 2E+1) int32, unused slots -1; an index
map (K*N,) int32).

Which rows no route writes (the permute kernels zero them, nothing else does; `ZERO` picks):
  ZERO_NONE      every row is written (or there are none)
  ZERO_FROM_PTR  rows [counts[zero_lo], R): a mask map without padding, its routed-row count
                 given (mask_row_id_map's counts: their last entry is the sum)
  ZERO_FROM_MAP  the same, the count summed from the map's column 2E here
  ZERO_FROM_INT  rows [zero_lo, R): an index map's rows past its N K routes
  ZERO_GAPS      a mask map with pad_offsets: expert e's rows are [S_e + pad_e, S_{e+1} +
                 pad_e) (S_e: the routes of experts before e, from per-expert counts given as
                 c_blocks rows of E that are summed), so with non-decreasing offsets the free
                 rows are the gaps before each expert's block and after the last
                 ([S_e + pad_{e-1}, S_e + pad_e), [S_E + pad_{E-1}, R)); other offsets (never
                 made by moe_permute_and_pad_with_probs, accepted all the same) fall back to
                 testing every row against every expert's block.
The zeroing runs in the first Z_PROGRAMS programs of the kernel's grid, beside the token
programs (first, so that they start early): rows in tiles of ZROWS taken in turn, and their
permuted probs where the kernel writes probs. No whole-buffer fill: only those rows are stored.
"""

from __future__ import annotations

import torch

from ._triton import tl, triton
from .permutation_maps import mask_map_block_counts

__all__ = [
    "ZERO_FROM_INT",
    "ZERO_FROM_MAP",
    "ZERO_FROM_PTR",
    "ZERO_GAPS",
    "ZERO_NONE",
    "from_bits",
    "int_bits",
    "route_count",
    "route_scalar",
    "route_tile",
    "zero_plan",
    "zero_unwritten",
]

# The values zero_unwritten's ZERO compares with (literals there: a jit function reads no globals).
ZERO_NONE, ZERO_FROM_PTR, ZERO_FROM_MAP, ZERO_FROM_INT, ZERO_GAPS = 0, 1, 2, 3, 4

if triton is not None:

    @triton.jit
    def route_count(map_ptr, t, routes, INDEX_MAP: tl.constexpr):
        """How many routes token t (int64) has: K, or column 2E of its mask-map row."""
        count = routes if INDEX_MAP else tl.load(map_ptr + t * (2 * routes + 1) + 2 * routes)
        return count

    @triton.jit
    def route_tile(
        map_ptr, t, r0, n, routes, count, BLOCK_R: tl.constexpr, INDEX_MAP: tl.constexpr
    ):
        """(rows, experts, live), (BLOCK_R,) each: routes r0 .. r0 + BLOCK_R - 1 of token t
        (int64): their rows (int32, before padding), experts (mask map) or k (index map), and
        whether they are routes of the token (r < count). The loads are masked by the map's
        row length, not by count, so that they need not wait for count's load (a mask map's
        slots past count hold -1)."""
        r = r0 + tl.arange(0, BLOCK_R)
        in_row = r < routes
        if INDEX_MAP:
            rows = tl.load(map_ptr + r.to(tl.int64) * n + t, mask=in_row, other=-1)
            experts = r
        else:
            base = map_ptr + t * (2 * routes + 1)
            rows = tl.load(base + r, mask=in_row, other=-1)
            experts = tl.load(base + routes + r, mask=in_row, other=0)
        return rows, experts, r < count

    @triton.jit
    def route_scalar(map_ptr, t, r, n, routes, INDEX_MAP: tl.constexpr):
        """(row, expert or k) of route r of token t (int64); r < routes (a mask map's slots
        past the token's count hold -1)."""
        if INDEX_MAP:
            row = tl.load(map_ptr + r * n + t)
            expert = r
        else:
            base = map_ptr + t * (2 * routes + 1)
            row = tl.load(base + r)
            expert = tl.load(base + routes + r)
        return row, expert

    @triton.jit
    def int_bits(v):
        """v's bit pattern as an int64 (its width's signed integer, widened)."""
        if v.dtype.primitive_bitwidth == 16:
            bits = v.to(tl.int16, bitcast=True)
        elif v.dtype.primitive_bitwidth == 32:
            bits = v.to(tl.int32, bitcast=True)
        else:
            bits = v.to(tl.int64, bitcast=True)
        return bits.to(tl.int64)

    @triton.jit
    def from_bits(bits, dtype: tl.constexpr):
        """The inverse of int_bits: int64 bits -> dtype values."""
        if dtype.primitive_bitwidth == 16:
            v = bits.to(tl.int16).to(dtype, bitcast=True)
        elif dtype.primitive_bitwidth == 32:
            v = bits.to(tl.int32).to(dtype, bitcast=True)
        else:
            v = bits.to(dtype, bitcast=True)
        return v

    @triton.jit
    def _zero_rows(
        y_ptr, yp_ptr, rows, free, h, c_start, c_end, HAS_YP: tl.constexpr, BLOCK_H: tl.constexpr
    ):
        """Zeros to rows (ZROWS,) of y (R, H) where free, columns [c_start, c_end) (c_start a
        multiple of BLOCK_H); and to those of yp (R,) when HAS_YP, from the first span only."""
        y_rows = y_ptr + rows.to(tl.int64) * h
        for c0 in range(c_start, c_end, BLOCK_H):
            cols = c0 + tl.arange(0, BLOCK_H)
            tl.store(y_rows[:, None] + cols[None, :], 0, mask=free[:, None] & (cols < h)[None, :])
        if HAS_YP:
            tl.store(yp_ptr + rows, 0, mask=free & (c_start == 0))

    @triton.jit
    def _zero_from(
        lo, pid, num_out, y_ptr, yp_ptr, h, c_start, c_end, Z_PROGRAMS: tl.constexpr,
        ZROWS: tl.constexpr, HAS_YP: tl.constexpr, BLOCK_H: tl.constexpr,
    ):  # fmt: skip
        """Zero rows [lo, num_out): program pid of Z_PROGRAMS takes every Z_PROGRAMS-th tile."""
        for r0 in range(lo + pid * ZROWS, num_out, Z_PROGRAMS * ZROWS):
            rows = r0 + tl.arange(0, ZROWS)
            _zero_rows(y_ptr, yp_ptr, rows, rows < num_out, h, c_start, c_end, HAS_YP, BLOCK_H)

    @triton.jit
    def _routed_rows(map_ptr, n, e, BLOCK: tl.constexpr):
        """The rows a mask map (N, 2E+1) routes to: its column 2E summed (int32)."""
        total = tl.zeros((BLOCK,), tl.int32)
        for t0 in range(0, n, BLOCK):
            t = t0 + tl.arange(0, BLOCK)
            total += tl.load(map_ptr + t.to(tl.int64) * (2 * e + 1) + 2 * e, mask=t < n, other=0)
        return tl.sum(total, axis=0)

    @triton.jit
    def _zero_gaps(
        pid, counts_ptr, c_blocks, c_stride, pad_ptr, e, num_out, y_ptr, yp_ptr, h, c_start,
        c_end, Z_PROGRAMS: tl.constexpr, ZROWS: tl.constexpr, HAS_YP: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_E1: tl.constexpr, CB: tl.constexpr,
    ):  # fmt: skip
        """Zero the rows no expert's padded block covers (ZERO_GAPS in the module doc)."""
        x = tl.arange(0, BLOCK_E1)  # experts 0 .. E-1, and E: the rows after the last block
        counts = tl.zeros((BLOCK_E1,), tl.int32)
        for b0 in range(0, c_blocks, CB):
            b = b0 + tl.arange(0, CB)
            m = (b < c_blocks)[:, None] & (x < e)[None, :]
            part = tl.load(counts_ptr + b[:, None] * c_stride + x[None, :], mask=m, other=0)
            counts += tl.sum(part, axis=0)
        first = tl.cumsum(counts, axis=0) - counts  # S_x, unpadded; S_E: all routes
        pad = tl.load(pad_ptr + x, mask=x < e, other=0).to(tl.int32)
        pad_before = tl.load(pad_ptr + x - 1, mask=(x >= 1) & (x <= e), other=0).to(tl.int32)
        if tl.min(tl.where(x < e, pad - pad_before, 0), axis=0) >= 0:
            # Gap x: from the end of expert x-1's block to the start of expert x's (x = E: to
            # num_out). Rows j of the gaps laid end to end map to rows j + shift of their gap.
            lo = tl.minimum(first + pad_before, num_out)
            hi = tl.minimum(tl.where(x < e, first + pad, num_out), num_out)
            size = tl.where(x <= e, tl.maximum(hi - lo, 0), 0)
            ends = tl.cumsum(size, axis=0)
            shift = lo - (ends - size)
            total = tl.sum(size, axis=0)
            for j0 in range(pid * ZROWS, total, Z_PROGRAMS * ZROWS):
                j = j0 + tl.arange(0, ZROWS)
                gap = tl.sum((ends[None, :] <= j[:, None]).to(tl.int32), axis=1)
                rows = j + tl.sum(tl.where(x[None, :] == gap[:, None], shift[None, :], 0), axis=1)
                _zero_rows(y_ptr, yp_ptr, rows, j < total, h, c_start, c_end, HAS_YP, BLOCK_H)
        else:
            start = first + pad
            end = tl.where(x < e, start + counts, start)  # no block past the experts
            for r0 in range(pid * ZROWS, num_out, Z_PROGRAMS * ZROWS):
                rows = r0 + tl.arange(0, ZROWS)
                inside = (rows[:, None] >= start[None, :]) & (rows[:, None] < end[None, :])
                free = (tl.max(inside.to(tl.int32), axis=1) == 0) & (rows < num_out)
                if tl.max(free.to(tl.int32), axis=0) > 0:
                    _zero_rows(y_ptr, yp_ptr, rows, free, h, c_start, c_end, HAS_YP, BLOCK_H)

    @triton.jit
    def zero_unwritten(
        pid, map_ptr, counts_ptr, pad_ptr, y_ptr, yp_ptr, n, e, num_out, h, c_start, c_end,
        zero_lo, c_blocks, c_stride, ZERO: tl.constexpr, Z_PROGRAMS: tl.constexpr,
        ZROWS: tl.constexpr, HAS_YP: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_E1: tl.constexpr,
    ):  # fmt: skip
        """Zeroing program pid (< Z_PROGRAMS): the rows of y (R = num_out, H) and yp that no
        route writes, as ZERO says (module doc); e is E (mask maps)."""
        if ZERO == 1:  # ZERO_FROM_PTR
            lo = tl.load(counts_ptr + zero_lo)
            _zero_from(
                lo, pid, num_out, y_ptr, yp_ptr, h, c_start, c_end, Z_PROGRAMS, ZROWS, HAS_YP,
                BLOCK_H,
            )  # fmt: skip
        elif ZERO == 2:  # ZERO_FROM_MAP: the count column summed 4096 tokens at a time
            lo = _routed_rows(map_ptr, n, e, 4096)
            _zero_from(
                lo, pid, num_out, y_ptr, yp_ptr, h, c_start, c_end, Z_PROGRAMS, ZROWS, HAS_YP,
                BLOCK_H,
            )  # fmt: skip
        elif ZERO == 3:  # ZERO_FROM_INT
            _zero_from(
                zero_lo, pid, num_out, y_ptr, yp_ptr, h, c_start, c_end, Z_PROGRAMS, ZROWS,
                HAS_YP, BLOCK_H,
            )  # fmt: skip
        elif ZERO == 4:  # ZERO_GAPS: the counts summed 16 rows at a time
            _zero_gaps(
                pid, counts_ptr, c_blocks, c_stride, pad_ptr, e, num_out, y_ptr, yp_ptr, h,
                c_start, c_end, Z_PROGRAMS, ZROWS, HAS_YP, BLOCK_H, BLOCK_E1, 16,
            )  # fmt: skip


def zero_plan(
    row_id_map: torch.Tensor,
    index_topk: int,
    pad_offsets: torch.Tensor | None,
    row_counts: torch.Tensor | None,
    rows: int,
    n: int,
) -> tuple[int, int, torch.Tensor, int, int]:
    """How a launch writing `rows` output rows, one per route, finds the rows no route writes:
    (ZERO mode, zero_lo, counts tensor (row_id_map where unread), c_blocks, c_stride), the
    modes of the module doc. row_counts: permute_rows's (None, (1,) or (E+1,) int32)."""
    if rows == 0:
        return ZERO_NONE, 0, row_id_map, 0, 0
    if index_topk:
        if rows > n * index_topk:
            return ZERO_FROM_INT, n * index_topk, row_id_map, 0, 0
        return ZERO_NONE, 0, row_id_map, 0, 0
    e = (row_id_map.shape[1] - 1) // 2
    if pad_offsets is None:
        if row_counts is None:
            return ZERO_FROM_MAP, 0, row_id_map, 0, 0
        return ZERO_FROM_PTR, row_counts.numel() - 1, row_counts, 0, 0
    if row_counts is not None and row_counts.numel() == e + 1:
        return ZERO_GAPS, 0, row_counts, 1, e + 1
    # The counts per expert are gone (unpermute's backward): read back per block of tokens.
    ws = mask_map_block_counts(row_id_map)
    return ZERO_GAPS, 0, ws, ws.shape[0], e
