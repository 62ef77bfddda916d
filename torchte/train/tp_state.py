"""Checkpoints of a tensor-parallel run in the one-process format: whatever the number of ranks
that saved it, a checkpoint holds the whole model's state_dict and AdamW state, so it resumes in
one process or over any `--tp` (model.shard_index says which piece of each parameter a rank
holds).

whole_state gathers the pieces on every rank (rank 0 writes the file); split_state takes this
rank's pieces out of a whole state. AdamW's state is indexed by the parameters' order in its
groups, the same in the split and the whole model. What is not split (the FP8 scaling state,
whose amaxes the ranks reduce; AdamW's step counts) is the same on every rank and kept as is.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .model import GPT, shard_index

__all__ = ["split_state", "whole_state"]

_MOMENTS = ("exp_avg", "exp_avg_sq")


def whole_state(model: GPT, optimizer: torch.optim.Optimizer, group) -> tuple[dict, dict]:
    """(the whole model's state_dict, the whole AdamW state_dict), on every rank."""
    state = model.state_dict()
    for name, _ in model.named_parameters():
        state[name] = _whole(state[name], name, model, group)
    optim = optimizer.state_dict()
    # state_dict() hands out AdamW's own per-parameter dicts: replaced, not written into, so
    # that training goes on with this rank's pieces after a save
    optim["state"] = {index: dict(moments) for index, moments in optim["state"].items()}
    names = _optimizer_order(model, optimizer)
    for index, moments in optim["state"].items():
        for key in _MOMENTS:
            moments[key] = _whole(moments[key], names[index], model, group)
    return state, optim


def split_state(
    model: GPT, optimizer: torch.optim.Optimizer, state: dict, optim: dict, group
) -> tuple[dict, dict]:
    """(model state_dict, AdamW state_dict) of this rank, from whole ones."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    state = dict(state)
    for name, _ in model.named_parameters():
        state[name] = state[name][shard_index(name, model.config, rank, size)]
    names = _optimizer_order(model, optimizer)
    pieces = {}
    for index, moments in optim["state"].items():
        where = shard_index(names[index], model.config, rank, size)
        pieces[index] = {k: v[where] if k in _MOMENTS else v for k, v in moments.items()}
    return state, {"state": pieces, "param_groups": optim["param_groups"]}


def _optimizer_order(model: GPT, optimizer: torch.optim.Optimizer) -> list[str]:
    """The parameter names in the order of the optimizer's groups (its state's indices)."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _whole(piece: torch.Tensor, name: str, model: GPT, group) -> torch.Tensor:
    """The whole parameter (or AdamW moment) from every rank's piece of it."""
    size = dist.get_world_size(group)
    where = [shard_index(name, model.config, r, size) for r in range(size)]
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
