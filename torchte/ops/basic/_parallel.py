"""Tensor-parallel arguments of the ops, read as Transformer Engine's ops read them: a process
group of None means the world group; a group of one rank means no parallelism at all. The
collectives themselves are torchte.distributed's (through module/_tensor_parallel.py's
TensorParallel for the linear ops)."""

from __future__ import annotations

import torch.distributed as dist

from torchte.module._tensor_parallel import NO_TP, TensorParallel

__all__ = ["group_size", "op_tensor_parallel"]

_MODES = (None, "column", "row")


def group_size(who: str, process_group) -> int:
    """The ranks of `process_group` (None: the world group); RuntimeError naming `who` when
    torch.distributed is not initialized."""
    if not dist.is_initialized():
        raise RuntimeError(
            f"{who}: a collective op needs torch.distributed initialized (call "
            "torch.distributed.init_process_group first)"
        )
    return dist.get_world_size(process_group)


def op_tensor_parallel(who: str, mode: str | None, group, sequence_parallel: bool):
    """The TensorParallel setting of a linear op: mode None or a group of one rank -> no
    parallelism (and no sequence parallelism); else the group (the world group for None) and
    its size. ValueError for a mode outside {None, "column", "row"}."""
    if mode not in _MODES:
        raise ValueError(
            f"{who}: tensor_parallel_mode must be None, 'column' or 'row', got {mode!r}"
        )
    if mode is None:
        return NO_TP
    size = group_size(f"{who}(tensor_parallel_mode={mode!r})", group)
    if size == 1:
        return NO_TP
    group = dist.group.WORLD if group is None else group
    return TensorParallel(mode, group, size, bool(sequence_parallel))
