"""Sequence-parallel GEMMs with their collectives hidden under them (tensor parallelism).

Legend: W ranks in the group, r this rank, M rows a rank holds, K / N a GEMM's inner / output
features; a "rows GEMM" is gemm_rows(operand, rows, out): the GEMM of the operand's row range
`rows` written into `out` (len(rows), N).

- All-gather then GEMM (a column GEMM's sequence-parallel input; a row GEMM's output gradient in
  backward): the gather starts asynchronously (`RowsInFlight`), the GEMM of this rank's own M
  rows runs while the other ranks' rows travel, then the GEMM of the rest.
- GEMM then reduce-scatter (a row GEMM's sequence-parallel output): a ring over W steps; each
  step makes the partial rows of one rank's chunk, adds what the previous rank sent for that
  chunk and sends the sum on, while the next chunk's GEMM runs (`gemm_reduce_scatter`). The last
  step's chunk is this rank's own: the sum over all ranks.

Both give the plain path's values: the same GEMM per output row, and (at W = 2) the same one
addition per reduced value; at W > 2 the ring adds in another order than the collective.
Switched by `overlap_tp_comm` (on for high-precision GEMMs by default; FP8 ones opt in; the
environment variable TORCHTE_TP_OVERLAP=0 / 1 / all sets it at import).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from torchte import distributed as te_dist

from .._collectives import send_recv, wait_all, world_size

__all__ = [
    "RowsInFlight",
    "gather_in_flight",
    "gemm_reduce_scatter",
    "overlap_tp_comm",
    "tp_overlap_enabled",
]

# "1" (default): high-precision GEMMs overlapped, FP8 ones plain (measured slower overlapped on
# 2 H100s: docs/benchmarks.md); "all": FP8 ones too; "0": none.
_MODE = os.environ.get("TORCHTE_TP_OVERLAP", "1")
_OVERLAP = {"enabled": _MODE != "0", "fp8": _MODE == "all"}

RowsGemm = Callable[[object, slice, torch.Tensor], None]


def overlap_tp_comm(enabled: bool = True, *, fp8: bool | None = None) -> bool:
    """Switch the overlapped sequence-parallel GEMMs (this module) on or off; returns the
    previous setting of `enabled`. fp8 (None: unchanged; default False) also overlaps the FP8
    GEMMs, which ran slower overlapped than plain on 2 NVLinked H100s (their collectives are
    short and the concurrent NCCL kernels slow the GEMMs by more). Off: the collective, then the
    GEMM (or the reverse), one after the other."""
    if not isinstance(enabled, bool) or not isinstance(fp8, bool | None):
        raise TypeError(f"overlap_tp_comm: enabled and fp8 must be bools, got {enabled!r}, {fp8!r}")
    previous, _OVERLAP["enabled"] = _OVERLAP["enabled"], enabled
    if fp8 is not None:
        _OVERLAP["fp8"] = fp8
    return previous


def tp_overlap_enabled(fp8: bool = False) -> bool:
    """Whether overlap_tp_comm switched the overlapped GEMMs on (for FP8 GEMMs when fp8)."""
    return _OVERLAP["enabled"] and (_OVERLAP["fp8"] or not fp8)


class RowsInFlight:
    """An all-gather along dim 0 still in flight: `local` is this rank's operand (M rows, usable
    now), `finish()` waits and returns the whole operand (W M rows, rank r's at [r M, (r+1) M))."""

    __slots__ = ("_finish", "local", "rank", "rows", "world")

    def __init__(self, local, rows: int, group, finish: Callable[[], object]) -> None:
        self.local, self.rows, self._finish = local, rows, finish
        self.world, self.rank = world_size(group), dist.get_rank(group)

    @property
    def total_rows(self) -> int:
        return self.rows * self.world

    def gemm(self, gemm_rows: RowsGemm, n: int, dtype: torch.dtype, device) -> tuple:
        """((W M, N) the GEMM of the whole operand, the whole operand): this rank's rows first,
        the rest once the gather lands."""
        m, r = self.rows, self.rank
        y = torch.empty((self.total_rows, n), dtype=dtype, device=device)
        gemm_rows(self.local, slice(0, m), y[r * m : (r + 1) * m])
        whole = self._finish()
        if r > 0:
            gemm_rows(whole, slice(0, r * m), y[: r * m])
        if r < self.world - 1:
            gemm_rows(whole, slice((r + 1) * m, self.total_rows), y[(r + 1) * m :])
        return y, whole


def gather_in_flight(local_rows: torch.Tensor, group, local, make_whole) -> RowsInFlight:
    """Start gathering local_rows (S, ..., K) along dim 0 over `group` (as 2-D rows: M = its
    numel / K); `local` is the operand of this rank's rows, make_whole(gathered (W S, ..., K))
    the whole operand once the gather lands."""
    # through te.distributed's name, as every gather (wrapping it sees them all)
    gathered, handle = te_dist.gather_along_first_dim(local_rows, group, async_op=True)

    def finish():
        handle.wait()
        return make_whole(gathered)

    rows = local_rows.numel() // max(local_rows.shape[-1], 1) if local_rows.dim() > 1 else 1
    return RowsInFlight(local, rows, group, finish)


def gemm_reduce_scatter(
    gemm_rows: Callable[[slice, torch.Tensor], None], total_rows: int, n: int, dtype, device, group
) -> torch.Tensor:
    """This rank's rows (M, N) of the sum over the ranks of a (W M, N) GEMM each rank makes on
    its own operand; gemm_rows(rows, out) writes the GEMM's rows into out (module docstring)."""
    world, rank = world_size(group), dist.get_rank(group)
    if total_rows % world:
        raise ValueError(
            f"sequence_parallel: the GEMM's {total_rows} rows must be divisible by the "
            f"{world} tensor-parallel ranks"
        )
    m = total_rows // world
    to_next = dist.get_global_rank(group, (rank + 1) % world)
    from_prev = dist.get_global_rank(group, (rank - 1) % world)
    pending, sent = None, []  # the sent chunks are kept until their sends are waited on
    for step in range(world):
        chunk = (rank - step - 1) % world
        part = torch.empty((m, n), dtype=dtype, device=device)
        gemm_rows(slice(chunk * m, (chunk + 1) * m), part)
        if pending is not None:  # the sum of the previous ranks' rows of this chunk
            received, handles = pending
            wait_all(handles)
            part.add_(received)
        if step == world - 1:  # every send was waited on with its step's receive
            return part
        received = torch.empty_like(part)
        pending = (received, send_recv([part], [received], to_next, from_prev, group))
        sent.append(part)
    raise AssertionError("unreachable")
