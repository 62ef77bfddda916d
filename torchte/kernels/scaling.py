"""Delayed-scaling update: amax from the history, new scale, history rolled, in one pass.

Shapes: amax_history (L, n) fp32, scale (n,) fp32, nonfinite (n,) int32, all updated in place
(views into them stay valid). Column j is one tensor's history; row 0 is the amax being
recorded this iteration.

A non-finite amax in row 0 (a NaN or inf in the tensor quantized this iteration) never enters
the history: that column is not rolled (its row 0 is cleared, the rest stays as it was), its
scale is kept, and nonfinite[j] counts the skip. So one bad batch does not freeze the scale for
the history's length: the next finite amax is scaled from as usual.

On CUDA with Triton one kernel launch does the whole update: one program per block of
COLUMNS_PER_PROGRAM columns (the columns are independent, so the programs share nothing) walks
its columns' history in chunks of rows, so any L and n work. The history of a default recipe
(L = 1024) is one chunk. A single program walking every column took 27 us a call in the graphed
training example on an H200 (grouped layers have a column per expert, so n reaches dozens), a
program per 8 columns 15 us. In a sweep of calls queued back to back (bound by the host's
launches at about 12 us), 4 columns and 8 warps a program took 12-13 us at L = 1024 for 2 to 24
columns, 8 columns up to 19 us and 16 columns up to 34 us with 4 warps; inside the graphed
example that shape takes 7 us a launch.
"""

from __future__ import annotations

import functools

import torch

from ._compile import compiled_as_op
from ._triton import FastLaunch, cdiv, next_power_of_2, triton_available

# Columns a program takes, elements of the history one chunk holds (BLOCK_L * BLOCK_N), and the
# warps of a program.
COLUMNS_PER_PROGRAM = 4
CHUNK_ELEMENTS = 8192
NUM_WARPS = 8

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference runs
    triton = None

if triton is not None:

    @triton.jit
    def _update_delayed_scaling_kernel(
        history_ptr,  # (L, n) fp32, contiguous: amax history, rolled up by one row in place
        scale_ptr,  # (n,) fp32: scales, replaced where the amax is finite and > 0
        nonfinite_ptr,  # (n,) int32: incremented where row 0 is NaN or inf (column skipped)
        L,
        n,
        fp8_max,  # fp32
        margin_div,  # fp32: 2**margin
        MOST_RECENT: tl.constexpr,
        BLOCK_L: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_in = cols < n
        row0 = tl.load(history_ptr + cols, mask=col_in, other=0.0)
        # Exponent all ones: inf or NaN. Such a column keeps its history and its scale.
        skip = (row0.to(tl.int32, bitcast=True) & 0x7F800000) == 0x7F800000
        amax = row0
        has_nan = row0 != row0
        for start in range(0, L, BLOCK_L):
            rows = start + tl.arange(0, BLOCK_L)
            # The new row i is the old row i + 1; the old row 0 (held in row0) becomes row L - 1.
            src_in = (rows + 1) < L
            mask = src_in[:, None] & col_in[None, :]
            old = tl.load(history_ptr + (rows + 1)[:, None] * n + cols[None, :], mask=mask)
            if not MOST_RECENT:
                # tl.max may drop NaN: amax keeps the largest number, has_nan says if any was NaN.
                amax = tl.maximum(amax, tl.max(tl.where(mask, old, -float("inf")), axis=0))
                has_nan = has_nan | (tl.max(((old != old) & mask).to(tl.int32), axis=0) > 0)
            new = tl.where(rows[:, None] == L - 1, row0[None, :], old)
            # A skipped column is written back as it was (not rolled); only it is read twice.
            dst_mask = (rows < L)[:, None] & col_in[None, :]
            kept = tl.load(history_ptr + rows[:, None] * n + cols[None, :],
                           mask=dst_mask & skip[None, :])  # fmt: skip
            new = tl.where(skip[None, :], kept, new)
            new = tl.where(rows[:, None] == 0, 0.0, new)
            # Every thread has read the rows this chunk shifts before any thread overwrites one
            # (a row read here by one warp is written, one row down, by another).
            tl.debug_barrier()
            tl.store(history_ptr + rows[:, None] * n + cols[None, :], new, mask=dst_mask)
        new_scale = tl.math.div_rn(tl.math.div_rn(fp8_max, amax), margin_div)
        # amax < inf is False for inf and NaN; has_nan catches a NaN tl.maximum let through.
        update = (amax > 0) & (amax < float("inf")) & ~has_nan & ~skip
        tl.store(scale_ptr + cols, new_scale, mask=col_in & update)
        count = tl.load(nonfinite_ptr + cols, mask=col_in & skip, other=0)
        tl.store(nonfinite_ptr + cols, count + 1, mask=col_in & skip)


if triton is not None:
    _launch_update_kernel = FastLaunch(_update_delayed_scaling_kernel)


@functools.cache
def _blocks(rows: int, cols: int) -> tuple[int, int]:
    """(BLOCK_L, BLOCK_N) for a history of (rows, cols): a program's columns, rows in chunks."""
    block_n = min(next_power_of_2(cols), COLUMNS_PER_PROGRAM)
    block_l = min(next_power_of_2(rows), max(CHUNK_ELEMENTS // block_n, 1))
    return block_l, block_n


@compiled_as_op(
    "(Tensor(a!) amax_history, Tensor(b!) scale, Tensor(c!) nonfinite, float fp8_max, "
    "int margin, str algo) -> ()"
)
def update_delayed_scaling(
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    nonfinite: torch.Tensor,
    fp8_max: float,
    margin: int,
    algo: str,
) -> None:
    """For each column j whose row 0 is finite: amax = max over the history ("max") or row 0
    ("most_recent"); scale[j] = fp8_max / amax / 2**margin where amax is finite and > 0, else
    unchanged; the column is rolled up by one row (row 0 moves to the end). A column whose row 0
    is NaN or inf keeps its history and scale, and nonfinite[j] is incremented. Row 0 is zeroed.
    """
    if amax_history.is_cuda and triton_available():
        _launch_update(amax_history, scale, nonfinite, fp8_max, margin, algo)
        return
    update_delayed_scaling_reference(amax_history, scale, nonfinite, fp8_max, margin, algo)


def _launch_update(
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    nonfinite: torch.Tensor,
    fp8_max: float,
    margin: int,
    algo: str,
) -> None:
    """One launch of _update_delayed_scaling_kernel (a program per block of columns) on a
    contiguous history."""
    rows, cols = amax_history.shape
    if rows == 0 or cols == 0:
        return
    tensors = (amax_history, scale, nonfinite)
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError(
            "update_delayed_scaling: amax_history, scale and nonfinite must be contiguous"
        )
    block_l, block_n = _blocks(rows, cols)
    most_recent = algo != "max"
    key = (rows == 1, rows & 15, cols == 1, cols & 15, most_recent, block_l, block_n)
    key += tuple(t.data_ptr() & 15 for t in tensors)
    _launch_update_kernel(
        key, (cdiv(cols, block_n), 1, 1), NUM_WARPS, amax_history, scale, nonfinite,
        rows, cols, float(fp8_max), float(2**margin), most_recent, block_l, block_n,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Torch reference: the same function, used on CPU and in tests
# ----------------------------------------------------------------------------------------------


def update_delayed_scaling_reference(
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    nonfinite: torch.Tensor,
    fp8_max: float,
    margin: int,
    algo: str,
) -> None:
    """Torch reference of update_delayed_scaling."""
    skip = nonfinite_row0(amax_history)
    amax = amax_history.amax(dim=0) if algo == "max" else amax_history[0].clone()
    new_scale = scale_from_amax_reference(amax, scale, fp8_max, margin)
    scale.copy_(torch.where(skip, scale, new_scale))
    roll_history_reference(amax_history, skip, nonfinite)


def nonfinite_row0(amax_history: torch.Tensor) -> torch.Tensor:
    """(n,) bool: the columns whose amax recorded this iteration (row 0) is NaN or inf."""
    return ~torch.isfinite(amax_history[0])


def scale_from_amax_reference(
    amax: torch.Tensor, scale: torch.Tensor, fp8_max: float, margin: int
) -> torch.Tensor:
    """fp8_max / amax / 2**margin where amax is finite and > 0; the old scale elsewhere."""
    new_scale = (torch.full_like(amax, fp8_max) / amax) / float(2**margin)
    keep = ~(amax > 0) | ~torch.isfinite(amax)
    return torch.where(keep, scale, new_scale)


def roll_history_reference(
    amax_history: torch.Tensor, skip: torch.Tensor, nonfinite: torch.Tensor
) -> None:
    """Roll the history up by one row in place, except the columns `skip` (n,) bool, which keep
    theirs and are counted in nonfinite (n,) int32; zero row 0."""
    if amax_history.shape[0] > 1:
        rolled = torch.roll(amax_history, -1, 0)
        amax_history.copy_(torch.where(skip, amax_history, rolled))
    amax_history[0].zero_()
    nonfinite.add_(skip.to(nonfinite.dtype))
