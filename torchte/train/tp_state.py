"""Checkpoints of a tensor- or expert-parallel run in the one-process format: whatever the number
of ranks that saved it, a checkpoint holds the whole model's state_dict and AdamW state, so it
resumes in one process or over any `--tp` / `--ep` (model.shard_index says which piece of each
parameter a tensor-parallel rank holds; expert_index the experts an expert-parallel rank holds).

whole_state gathers the pieces on every rank (rank 0 writes the file); split_state takes this
rank's pieces out of a whole state. AdamW's state is indexed by the parameters' order in its
groups, the same in the split and the whole model. What is not split (the FP8 scaling state,
whose amaxes the ranks reduce; AdamW's step counts) is the same on every rank and kept as is.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from .ep_run import expert_rows, is_expert
from .model import GPT, piece_index

__all__ = ["expert_index", "split_state", "whole_state"]

_MOMENTS = ("exp_avg", "exp_avg_sq")


def _tensor_parallel_index(model: GPT, name: str, rank: int, size: int) -> tuple:
    """model.piece_index: tensor-parallel pieces, and experts split over the same ranks."""
    return piece_index(model.get_parameter(name), name, model.config, rank, size)


def expert_index(model: GPT, name: str, rank: int, size: int) -> tuple:
    """Where rank `rank`'s piece of parameter `name` sits in the whole one under expert
    parallelism over `size` ranks: its E / size experts' rows of an expert weight or bias
    (Megatron-Core's `allreduce` = False marks those), everything else whole."""
    param = model.get_parameter(name)
    return expert_rows(param, rank) if is_expert(param) else (slice(None),)


def whole_state(
    model: GPT, optimizer: torch.optim.Optimizer, group, index=_tensor_parallel_index
) -> tuple[dict, dict]:
    """(the whole model's state_dict, the whole AdamW state_dict), on every rank; index(model,
    name, rank, size): where a rank's piece of a parameter sits (tensor parallelism's by
    default, expert_index for expert parallelism)."""
    where = functools.partial(index, model)
    state = model.state_dict()
    for name, _ in model.named_parameters():
        state[name] = _whole(state[name], name, where, group)
    optim = optimizer.state_dict()
    # state_dict() hands out AdamW's own per-parameter dicts: replaced, not written into, so
    # that training goes on with this rank's pieces after a save
    optim["state"] = {index: dict(moments) for index, moments in optim["state"].items()}
    names = _optimizer_order(model, optimizer)
    for index, moments in optim["state"].items():
        for key in _MOMENTS:
            moments[key] = _whole(moments[key], names[index], where, group)
    return state, optim


def split_state(
    model: GPT, optimizer: torch.optim.Optimizer, state: dict, optim: dict, group,
    index=_tensor_parallel_index,
) -> tuple[dict, dict]:  # fmt: skip
    """(model state_dict, AdamW state_dict) of this rank, from whole ones (index: as in
    whole_state)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    state = dict(state)
    for name, _ in model.named_parameters():
        state[name] = state[name][index(model, name, rank, size)]
    names = _optimizer_order(model, optimizer)
    pieces = {}
    for number, moments in optim["state"].items():
        where = index(model, names[number], rank, size)
        pieces[number] = {k: v[where] if k in _MOMENTS else v for k, v in moments.items()}
    return state, {"state": pieces, "param_groups": optim["param_groups"]}


def _optimizer_order(model: GPT, optimizer: torch.optim.Optimizer) -> list[str]:
    """The parameter names in the order of the optimizer's groups (its state's indices)."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _whole(piece: torch.Tensor, name: str, index, group) -> torch.Tensor:
    """The whole parameter (or AdamW moment) from every rank's piece of it (index(name, rank,
    size): where a rank's piece sits)."""
    size = dist.get_world_size(group)
    where = [index(name, r, size) for r in range(size)]
    if where[0] == (slice(None),):  # not split: the same on every rank
        return piece
    pieces = [torch.empty_like(piece) for _ in range(size)]
    dist.all_gather(pieces, piece.contiguous(), group=group)
    shape = list(piece.shape)
    shape[len(where[0]) - 1] *= size  # the split dim: rows (one index) or columns (two)
    whole = piece.new_empty(shape)
    for index, part in zip(where, pieces, strict=True):
        whole[index] = part
    return whole
