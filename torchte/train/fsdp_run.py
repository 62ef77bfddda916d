"""The training example with sharded data parallelism: `torchrun --nproc-per-node N -m
torchte.train --fsdp` trains one model over N ranks with PyTorch's FSDP2 (fully_shard): every
parameter and its AdamW state sharded over the ranks, each transformer block gathered whole just
before it runs. Every rank draws the same global batch from the seed and trains on its share of
the rows (rank r the r-th of N equal slices) and back-propagates its loss / N; the gradients
are summed over the ranks, so a step is the one-process step on the whole batch. The group and
the quiet ranks are parallel.py's (launched_run); checkpoints go through
torch.distributed.checkpoint (fsdp_state.py).

--fsdp always runs under torchrun, also over one rank (`--nproc-per-node 1`): a launch without it
is refused with the command to use, as a --tp launch is. With --tp M (2-D): the N ranks form a
(N / M, M) DeviceMesh; each row of M ranks splits the model Megatron-style (tensor
parallelism), FSDP shards those pieces over the N / M ranks of each column, and the batch is
split over the N / M data-parallel ranks.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from torchte.distributed import fsdp as te_fsdp

__all__ = [
    "DataParallel",
    "check_fsdp",
    "data_parallel",
    "data_parallel_ranks",
    "local_rows",
    "shard_model",
]


def check_fsdp(
    fsdp: bool,
    fp8_all_gather: bool,
    tp: int,
    batch_size: int,
    gather_dtype: str = "fp32",
    keep_gathered: bool = False,
) -> str | None:
    """Why the --fsdp options cannot run in this process (None when they can): --fsdp needs
    torchrun and a --batch-size its ranks divide; --fp8-all-gather, --fsdp-keep-gathered and a
    --fsdp-gather-dtype other than fp32 need --fsdp."""
    if fp8_all_gather and not fsdp:
        return "--fp8-all-gather shards FP8 weights under FSDP: it needs --fsdp"
    if gather_dtype != "fp32" and not fsdp:
        return "--fsdp-gather-dtype chooses what FSDP2 gathers: it needs --fsdp"
    if keep_gathered and not fsdp:
        return "--fsdp-keep-gathered keeps what FSDP2 gathers: it needs --fsdp"
    if not fsdp:
        return None
    world = os.environ.get("WORLD_SIZE")
    if world is None:
        return (
            "--fsdp trains over the processes torchrun starts (not under torchrun): launch it "
            "with torchrun --nproc-per-node N -m torchte.train --fsdp ... (N = 1 runs FSDP over "
            "one process)"
        )
    if int(world) % tp:
        return (
            f"--fsdp with --tp {tp}: the {world} processes must be a multiple of {tp} (each "
            f"group of {tp} splits the model, FSDP shards over the groups)"
        )
    ranks = int(world) // tp
    if batch_size % ranks:
        return (
            f"--fsdp splits each batch over the {ranks} data-parallel ranks: --batch-size "
            f"{batch_size} must be a multiple of {ranks}"
        )
    return None


def data_parallel_ranks(fsdp: bool, tp: int = 1) -> int:
    """The ranks a batch is split over: torchrun's WORLD_SIZE / tp under --fsdp (checked by
    check_fsdp), else 1."""
    return int(os.environ["WORLD_SIZE"]) // tp if fsdp else 1


@dataclass(frozen=True)
class DataParallel:
    """The ranks of a --fsdp run: each trains on its share of every batch."""

    mesh: DeviceMesh
    """The 1-D mesh FSDP shards over."""
    group: dist.ProcessGroup
    """Its process group: losses are averaged over it, delayed-scaling amaxes reduced."""
    rank: int
    """This rank's index in the group: which slice of the batch's rows it trains on."""
    size: int
    """Ranks in the group."""
    tp_group: dist.ProcessGroup | None = None
    """This rank's tensor-parallel group under --tp (2-D), else None."""


def data_parallel(device: str, tp: int = 1) -> DataParallel:
    """The data-parallel layout over every rank of the initialized default group: the ranks
    in groups of `tp` consecutive ones that split the model, FSDP over the groups."""
    world = dist.get_world_size()
    if tp == 1:
        mesh = init_device_mesh(device, (world,), mesh_dim_names=("dp",))
        dp_mesh, tp_group = mesh, None
    else:
        mesh = init_device_mesh(device, (world // tp, tp), mesh_dim_names=("dp", "tp"))
        dp_mesh, tp_group = mesh["dp"], mesh.get_group("tp")
    group = dp_mesh.get_group()
    return DataParallel(dp_mesh, group, dist.get_rank(group), dist.get_world_size(group), tp_group)


def local_rows(batch: torch.Tensor, index: int, parts: int) -> torch.Tensor:
    """Rows index * B / parts up to (index + 1) * B / parts of a (B, ...) batch (B divisible)."""
    rows = batch.shape[0] // parts
    return batch[index * rows : (index + 1) * rows]


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh,
    fp8_all_gather: bool,
    gather_dtype: str = "fp32",
    prefetch: bool = True,
    keep_gathered: bool = False,
    ignored: set[nn.Parameter] | None = None,
) -> None:
    """Shard `model` (a GPT) in place with fully_shard: each block, then the whole model (the
    embeddings, final norm and head). `fp8_all_gather`: first let its te modules shard and
    gather their weights as FP8 (torchte.fsdp.enable_fp8_all_gather). `gather_dtype` "bf16":
    the parameters are cast to bf16 before the all-gather and the gradients reduced in fp32
    (FSDP2's MixedPrecisionPolicy); "fp32": gathered as they are. The gradients are summed
    over the ranks, not averaged: each rank back-propagates its loss divided by the ranks
    (loop.Trainer._backward), so that its gradients, and their FP8 casts, have the values of
    one process training on the whole batch. `prefetch`: each block starts the all-gather of
    the next one in its forward (of the one before in its backward), so the gather runs under
    the block's GEMMs even when the host is not ahead of the GPU. `keep_gathered`: each block
    keeps its gathered parameters from its forward to its backward (reshard_after_forward
    False), which then gathers nothing. `ignored`: parameters FSDP leaves whole on each rank
    (expert parallelism's experts, each rank its own)."""
    policy = MixedPrecisionPolicy()
    if gather_dtype == "bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif gather_dtype != "fp32":
        raise ValueError(f"shard_model: gather_dtype must be 'fp32' or 'bf16', got {gather_dtype}")
    if fp8_all_gather:
        te_fsdp.enable_fp8_all_gather(model)
    blocks = list(model.blocks)
    # fully_shard replaces each parameter by a new one: its marks (tensor_model_parallel, ...)
    # are carried over, as the clipping norm and the optimizer read them
    marks = {name: dict(vars(p)) for name, p in model.named_parameters() if vars(p)}
    common = {"mesh": mesh, "mp_policy": policy, "ignored_params": ignored}
    for block in blocks:
        fully_shard(block, reshard_after_forward=not keep_gathered, **common)
    fully_shard(model, **common)
    for name, attributes in marks.items():
        param = model.get_parameter(name)
        for attr, value in attributes.items():
            if not hasattr(param, attr):
                setattr(param, attr, value)
    for module in (*blocks, model):  # sum the ranks' gradients: the loss is divided instead
        module.set_gradient_divide_factor(1.0)
        if hasattr(module, "set_force_sum_reduction_for_comms"):  # else NCCL's PREMUL_SUM(1)
            module.set_force_sum_reduction_for_comms(True)
    if prefetch:
        for before, after in itertools.pairwise(blocks):
            before.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([before])
