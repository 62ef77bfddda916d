"""The training example with expert parallelism: `torchrun --nproc-per-node N -m torchte.train
--experts E --ep N` splits each MoE layer's E experts over the N ranks (rank r holds experts
[r E / N, (r + 1) E / N); te.moe.MoELayer(ep_group=...) sends each token to the ranks of its
experts and back). Everything else (attention, norms, routers, embeddings, head) is whole on
every rank and trained data-parallel: every rank draws the same batch from the seed and trains
on its share of the rows (rank r the r-th of N equal slices), back-propagating its loss / N.

The gradients then have the one-process run's values: a dense parameter's are this rank's part
of the sum, all-reduced (summed) over the ranks (reduce_dense_grads); an expert's are already
whole, since every rank's tokens for that expert reached it through the all-to-all (Megatron-
Core's `allreduce` = False marks them, as MoELayer sets it). The gradient norm for clipping
counts each dense gradient once and sums the experts' over the ranks (loop.clip_grad_norm).

The model starts from the one-process model's weights of the seed (shard_experts_from), so that
`--ep N` trains as one process does on the whole batch, within rounding. `--save` writes the
one-process format (rank 0, every expert gathered: tp_state.expert_index), which `--resume`
loads in one process or over any `--ep`.

With --tp N --sequence-parallel the same N ranks split the attention Megatron-style and the
experts: each rank's MoE layer takes its rows of the batch (sequence parallelism keeps them
apart between the split layers) and sends them to the experts' ranks. The experts are not split
further (no expert tensor parallelism); their gradients are whole, the norms' and routers' are
summed over the ranks as sequence parallelism sums every whole parameter's. Checkpoints are the
one-process format (tp_state.py takes both kinds of pieces).

With --fsdp the same N ranks are both: FSDP2 shards every dense parameter over them (the
experts are left out of fully_shard, `ignored_params`: each rank's stay whole on it), the batch
is split over them once, and FSDP2 sums the dense gradients. The optimizer step treats the
experts as this rank's own pieces: their squares and the dense shards' are summed over the
ranks for the clipping norm (ClippedAdamW's sharded step). Checkpoints are --fsdp folders, in
which each rank's experts are its Shard(0) piece of the (E, ...) weights (fsdp_state.py), so a
folder resumes over any --ep, or under --fsdp without it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .parallel import launch_mismatch

__all__ = ["check_ep", "expert_rows", "is_expert", "reduce_dense_grads", "shard_experts_from"]


def check_ep(args) -> str | None:
    """Why the --ep options cannot run in this process (None when they can)."""
    ep = args.ep
    if ep < 1:
        return f"--ep must be at least 1, got {ep}"
    if ep == 1:
        return None
    if not args.experts:
        return f"--ep {ep} splits the experts over {ep} ranks: it needs --experts E"
    if args.experts % ep:
        return f"--ep {ep} must divide --experts ({args.experts}): each rank holds E / N experts"
    if args.tp > 1 and (args.tp != ep or not args.sequence_parallel or args.fsdp):
        return (
            f"--ep {ep} with --tp {args.tp} runs over the same ranks with sequence parallelism "
            f"only (--tp {ep} --sequence-parallel, without --fsdp): each rank's experts then take "
            "its rows of the batch"
        )
    if args.fsdp and args.fp8_all_gather:
        return (
            "--ep with --fp8-all-gather is not supported (the experts' grouped weights stay "
            "on their ranks, outside FSDP; the dense weights gather in --fsdp-gather-dtype)"
        )
    flags = f"--experts {args.experts} {'--fsdp ' if args.fsdp else ''}"
    flags += f"--tp {ep} --sequence-parallel " if args.tp > 1 else ""
    return launch_mismatch("--ep", ep, flags)


def is_expert(param: nn.Parameter) -> bool:
    """Whether `param` belongs to the experts held by this rank (Megatron-Core's marker)."""
    return not getattr(param, "allreduce", True)


def expert_rows(param: nn.Parameter, rank: int) -> tuple[slice]:
    """Where rank `rank`'s experts (the rows of `param`, one of them) sit in the (E, ...)
    parameter of every expert: rows rank * E / size up to (rank + 1) * E / size."""
    local = param.shape[0]
    return (slice(rank * local, (rank + 1) * local),)


@torch.no_grad()
def shard_experts_from(model: nn.Module, whole: nn.Module, rank: int, size: int) -> None:
    """Copy a whole (one-rank) model's weights into `model`, whose MoE layers hold their
    experts' slice of rank `rank` of `size`: the experts' (E / size, ...) rows of each
    (E, ...) grouped weight and bias, everything else whole."""
    wholes = dict(whole.named_parameters())
    for name, param in model.named_parameters():
        source = wholes[name]
        if is_expert(param):
            source = source[expert_rows(param, rank)]
        param.copy_(source)


def reduce_dense_grads(model: nn.Module, group) -> None:
    """Sum the dense parameters' gradients over `group` (each rank holds its part of the
    batch's); the experts' are left as they are (whole already), in one all-reduce."""
    grads = [p.grad for p in model.parameters() if p.grad is not None and not is_expert(p)]
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
