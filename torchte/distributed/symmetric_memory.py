"""The GEMMs that follow an all-gather or precede a reduce-scatter (sequence parallelism),
fused with them through torch's symmetric memory (micro-pipelined async tensor parallelism:
the collective runs in chunks under the GEMM) when switched on, on CUDA tensors of an NCCL
group with a torch that has the symmetric-memory ops; elsewhere, and while switched off, the
plain collective and the GEMM one after the other (through te.distributed's names, as every
caller's collectives, so that wrapping those sees them).
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

from torchte import distributed as te_dist

from .._collectives import is_native

__all__ = [
    "all_gather_matmul",
    "matmul_reduce_scatter",
    "symmetric_memory_enabled",
    "use_symmetric_memory",
]

# Whether the sequence-parallel GEMMs fuse their collectives through symmetric memory (the
# environment variable TORCHTE_SYMMETRIC_MEMORY=1 switches it on at import), and the groups
# whose symmetric-memory workspace is set up.
_SYMMETRIC = {"enabled": os.environ.get("TORCHTE_SYMMETRIC_MEMORY", "0") == "1"}
_SYMMETRIC_GROUPS: set[str] = set()


def use_symmetric_memory(enabled: bool = True) -> bool:
    """Switch the fused symmetric-memory collectives of sequence-parallel high-precision GEMMs
    (te.Linear column and row with sequence_parallel) on or off; returns the previous setting.
    They apply to CUDA tensors of NCCL groups where torch has the ops (torch.ops.symm_mem);
    elsewhere the plain collectives run. FP8 GEMMs keep the plain collectives (their gathers
    move FP8 bytes)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"use_symmetric_memory: enabled must be a bool, got {enabled!r}")
    previous, _SYMMETRIC["enabled"] = _SYMMETRIC["enabled"], enabled
    return previous


def symmetric_memory_enabled() -> bool:
    """Whether use_symmetric_memory switched the fused collectives on."""
    return _SYMMETRIC["enabled"]


def symmetric_group(t: torch.Tensor, group) -> str | None:
    """The name of `group` when t's GEMM can fuse its collective through symmetric memory (set
    up on first use), else None."""
    if not (_SYMMETRIC["enabled"] and t.is_cuda and is_native(group)):
        return None
    name = (group or dist.group.WORLD).group_name
    if name not in _SYMMETRIC_GROUPS:
        try:  # importing it registers torch.ops.symm_mem
            from torch.distributed import _symmetric_memory as symm_mem
        except ImportError:
            return None
        if not hasattr(torch.ops.symm_mem, "fused_all_gather_matmul"):
            return None
        with warnings.catch_warnings():  # deprecated (no longer needed) in newer torch
            warnings.simplefilter("ignore", FutureWarning)
            if not symm_mem.is_symm_mem_enabled_for_group(name):
                symm_mem.enable_symm_mem_for_group(name)
        _SYMMETRIC_GROUPS.add(name)
    return name


def all_gather_matmul(a_shard: torch.Tensor, b: torch.Tensor, process_group=None):
    """(a, a @ b): a_shard (M, K) on every rank gathered along dim 0 into a (W M, K), and its
    product with b (K, N); fused through symmetric memory when use_symmetric_memory is on."""
    name = symmetric_group(a_shard, process_group)
    if name is not None:
        a, (out,) = torch.ops.symm_mem.fused_all_gather_matmul(a_shard, [b], 0, name)
        return a, out
    a = te_dist.gather_along_first_dim(a_shard, process_group)[0]
    return a, torch.mm(a, b)


def matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, process_group=None) -> torch.Tensor:
    """This rank's rows of the sum over ranks of a @ b: a (W M, K), b (K, N) -> (M, N), rank r
    gets rows [r M, (r + 1) M); fused through symmetric memory when use_symmetric_memory is
    on."""
    name = symmetric_group(a, process_group)
    if name is not None:
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, name)
    return te_dist.reduce_scatter_along_first_dim(torch.mm(a, b), process_group)[0]
