"""Expert parallelism: the token dispatch and combine of a mixture-of-experts layer whose E
experts are split over the P ranks of a group (rank r holds experts [r E / P, (r + 1) E / P)).

Legend: T this rank's tokens, H hidden, E experts (global), El = E / P local experts, N = T k
rows this rank routes (its tokens' k copies, grouped by global expert), R rows this rank
receives (grouped by source rank, then by local expert), P padded rows (each local expert's
rows padded to a multiple of `align`).

A step, with split sizes on the host:
1. `exchange_counts`: one all-to-all of the per-expert counts (rank r sends each rank the
   counts of that rank's experts), then one read of them on the host (the step's one host
   synchronization, as the single-rank layer's host splits).
2. `DispatchPlan.make`: the row split sizes of both all-to-alls, each local expert's padded
   row count, and where each received row goes in the padded buffer.
3. `dispatch`: the all-to-all of the rows and their probabilities (asynchronous on NCCL: the
   caller runs other work, such as a shared expert, before `Pending.wait()`), then
   `pad_rows`: the rows regrouped by local expert and padded.
4. the experts, then `unpad_rows` and `combine`: the inverse all-to-all, back to the source
   rank's N rows in its order.
Every step is differentiable: the backward of an all-to-all is the all-to-all of the
gradients with the split sizes swapped; of the regrouping, its inverse.

All collectives go through collectives.all_to_all_split (NCCL: the tensors; gloo: their bytes).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .._collectives import all_to_all_split, is_native

__all__ = [
    "DispatchPlan",
    "ExpertParallel",
    "Pending",
    "combine",
    "dispatch",
    "exchange_counts",
    "pad_rows",
    "unpad_rows",
]


@dataclass(frozen=True)
class ExpertParallel:
    """Which experts this rank holds: `num_local` of them from `first` on, of `num_experts`
    split over the `size` ranks of `group` (this one `rank`)."""

    group: object
    size: int
    rank: int
    num_experts: int

    @classmethod
    def of(cls, group, num_experts: int) -> ExpertParallel:
        """The layout of `num_experts` experts over `group` (ValueError unless its ranks divide
        num_experts)."""
        size = dist.get_world_size(group)
        if num_experts % size:
            raise ValueError(
                f"expert parallelism: num_experts ({num_experts}) must be divisible by the "
                f"ep_group's {size} ranks"
            )
        return cls(group, size, dist.get_rank(group), num_experts)

    @property
    def num_local(self) -> int:
        """Experts this rank holds."""
        return self.num_experts // self.size

    @property
    def first(self) -> int:
        """The global index of this rank's first expert."""
        return self.rank * self.num_local


def exchange_counts(
    counts_E: torch.Tensor, ep: ExpertParallel, flag: torch.Tensor | None = None
) -> tuple[list[int], list[int], bool]:
    """(this rank's counts per global expert (E), the counts every rank sends this rank's
    experts ((P El): source rank major), whether any rank's `flag` is set): counts_E (E,)
    integer on the device -> host lists, in one all-to-all and one read (the call's host
    synchronization). flag: a one-element tensor (a NaN check) sent along with the counts, so
    that every rank learns it in the same read and all of them can stop together."""
    el, p = ep.num_local, ep.size
    flag_P1 = (flag if flag is not None else counts_E.new_zeros(())).reshape(1, 1)
    send_PC = torch.cat([counts_E.long().view(p, el), flag_P1.long().expand(p, 1)], dim=1)
    split = [1] * p  # one row of (El counts, flag) to each rank
    received_PC, _ = all_to_all_split(send_PC, split, split, ep.group)
    read = torch.cat([counts_E.long(), received_PC.flatten()]).tolist()
    e = ep.num_experts
    rows = [read[e + r * (el + 1) : e + (r + 1) * (el + 1)] for r in range(p)]
    received = [c for row in rows for c in row[:el]]
    return read[:e], received, any(row[el] for row in rows)


@dataclass(frozen=True)
class DispatchPlan:
    """The host-side sizes of one dispatch and combine, and where received rows go.

    send_splits (P): rows this rank sends each rank; recv_splits (P): rows it receives from
    each; m_splits (El): each local expert's padded rows; dest (R,) int64: each received row's
    row in the padded (P, ...) buffer; rows: P."""

    group: object
    send_splits: list[int]
    recv_splits: list[int]
    m_splits: list[int]
    dest: torch.Tensor
    rows: int

    @classmethod
    def make(
        cls, counts: list[int], received: list[int], ep: ExpertParallel, align: int, device
    ) -> DispatchPlan:
        """The plan from exchange_counts' first two lists; each local expert's rows padded to
        a multiple of `align`."""
        el, p = ep.num_local, ep.size
        send = [sum(counts[r * el : (r + 1) * el]) for r in range(p)]
        chunks = [received[r * el : (r + 1) * el] for r in range(p)]  # [source][local expert]
        recv = [sum(c) for c in chunks]
        totals = [sum(chunks[r][j] for r in range(p)) for j in range(el)]
        m_splits = [-(-t // align) * align for t in totals]
        bases = [0, *itertools.accumulate(m_splits)][:-1]
        # chunk (r, j) arrives at src_start and goes to its expert's base plus the rows of
        # the ranks before r: one shift per chunk, repeated over its rows
        shifts, sizes, src_start = [], [], 0
        below = [0] * el
        for r in range(p):
            for j in range(el):
                size = chunks[r][j]
                shifts.append(bases[j] + below[j] - src_start)
                sizes.append(size)
                below[j] += size
                src_start += size
        total = sum(recv)
        meta = torch.tensor([shifts, sizes], dtype=torch.int64).to(device, non_blocking=True)
        dest = torch.arange(total, device=device) + torch.repeat_interleave(
            meta[0], meta[1], output_size=total
        )
        return cls(ep.group, send, recv, m_splits, dest, sum(m_splits))


@dataclass
class Pending:
    """The handles of an all-to-all started asynchronously; wait() before reading its
    outputs."""

    handles: list = field(default_factory=list)

    def wait(self) -> None:
        """Make the caller's stream (the host, on gloo) wait for the all-to-all."""
        for handle in self.handles:
            if handle is not None:
                handle.wait()
        self.handles.clear()


@dataclass(frozen=True)
class _Exchange:
    """An all-to-all of one Function call: splits to receive and to send, the group, and
    where an asynchronous call leaves its handles (None: synchronous)."""

    out_splits: list[int]
    in_splits: list[int]
    group: object
    pending: Pending | None = None


class _AllToAll(torch.autograd.Function):
    """tensors (sum(in_splits), ...) each -> (sum(out_splits), ...) each: the all-to-all of
    every tensor's rows; backward: the all-to-all of the gradients, splits swapped."""

    @staticmethod
    def forward(ctx, spec: _Exchange, *tensors: torch.Tensor):
        ctx.spec = spec
        outs = []
        for t in tensors:
            out, handle = all_to_all_split(
                t, spec.out_splits, spec.in_splits, spec.group, spec.pending is not None
            )
            if spec.pending is not None:
                spec.pending.handles.append(handle)
            outs.append(out)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        spec = ctx.spec
        back = [
            all_to_all_split(g.contiguous(), spec.in_splits, spec.out_splits, spec.group)[0]
            for g in grads
        ]
        return (None, *back)


def dispatch(
    x_NH: torch.Tensor, probs_N: torch.Tensor, plan: DispatchPlan, async_op: bool = False
) -> tuple[torch.Tensor, torch.Tensor, Pending]:
    """(x_RH, probs_R, pending): this rank's routed rows (N, H) and their probabilities (N,)
    sent to the ranks holding their experts; with async_op (NCCL) the outputs are written
    only once pending.wait() has been called, so that other work runs meanwhile."""
    pending = Pending()
    spec = _Exchange(plan.recv_splits, plan.send_splits, plan.group, pending if async_op else None)
    x_RH, probs_R = _AllToAll.apply(spec, x_NH, probs_N)
    if not async_op:
        pending.handles.clear()
    return x_RH, probs_R, pending


def combine(y_RH: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """y_NH: the experts' outputs for the received rows (R, H) sent back to their source ranks,
    each in its dispatch order (N, H)."""
    spec = _Exchange(plan.send_splits, plan.recv_splits, plan.group)
    return _AllToAll.apply(spec, y_RH)[0]


def pad_rows(x_R: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """x_P: received rows (R, ...) regrouped by local expert into the padded buffer (P, ...),
    zero rows in the padding."""
    out = x_R.new_zeros((plan.rows, *x_R.shape[1:]))
    return out.index_copy(0, plan.dest, x_R)


def unpad_rows(y_P: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """y_R: the padded buffer's rows (P, ...) back in the received order (R, ...)."""
    return y_P.index_select(0, plan.dest)


def overlaps(group) -> bool:
    """Whether an asynchronous dispatch can run under other work (NCCL; gloo's fallback moves
    the rows synchronously)."""
    return is_native(group)
