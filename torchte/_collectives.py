"""The plain collectives of tensor and sequence parallelism, on torch.distributed.

`allreduce`, `reduce_scatter_along_first_dim` and `gather_rows` (the high-precision part of
`gather_along_first_dim`) each return (output, handle); the handle is None unless async_op.
NCCL gets torch's tensor collectives (one preallocated output), other backends (gloo, which
lacks reduce_scatter_tensor on some builds) one fallback: all_gather into a list, or all_reduce
and this rank's slice.

This module imports nothing of torchte and sits outside torchte/distributed/ (whose package
imports recompute, autocast and quantization), so that any layer (quantization/ included)
reaches the collectives at import time without an import circle; torchte.distributed
re-exports its public names.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "all_to_all_split",
    "allreduce",
    "gather_rows",
    "reduce_scatter_along_first_dim",
]


def world_size(group) -> int:
    """The ranks of `group` (1 without an initialized torch.distributed)."""
    if not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def is_native(group) -> bool:
    """Whether the group's backend has the tensor collectives (NCCL)."""
    return dist.get_backend(group) == "nccl"


class DoneHandle:
    """The handle of a collective that already finished (a fallback made of several)."""

    def wait(self) -> None:
        pass

    def is_completed(self) -> bool:
        return True


def gather_rows(
    inp: torch.Tensor,
    group,
    world: int,
    async_op: bool = False,
    output_tensor: torch.Tensor | None = None,
) -> tuple[torch.Tensor, object | None]:
    """(the ranks' inputs stacked along dim 0, handle): inp (M, ...) high precision on every
    rank of `group` (its `world` > 1 ranks) -> (W M, ...), rank r's rows at [r M, (r + 1) M),
    written into output_tensor when given ((W M, ...), inp's dtype and device)."""
    inp = inp.contiguous()
    out = _gather_output(inp, world, output_tensor)
    if is_native(group):
        handle = dist.all_gather_into_tensor(out, inp, group=group, async_op=async_op)
        return out, handle
    dist.all_gather(list(out.chunk(world)), inp, group=group)
    return out, DoneHandle() if async_op else None


def _gather_output(inp: torch.Tensor, world: int, given: torch.Tensor | None) -> torch.Tensor:
    """The (W M, ...) output of a high-precision gather: `given` (checked) or a new one."""
    shape = (world * inp.shape[0], *inp.shape[1:])
    if given is None:
        return torch.empty(shape, dtype=inp.dtype, device=inp.device)
    _check_output("output_tensor", given, shape, inp)
    return given


def _check_output(name: str, out: torch.Tensor, shape: tuple, inp: torch.Tensor) -> None:
    if tuple(out.shape) != tuple(shape) or out.dtype != inp.dtype or out.device != inp.device:
        raise ValueError(
            f"{name} must have shape {tuple(shape)}, dtype {inp.dtype} and device {inp.device}; "
            f"got {tuple(out.shape)}, {out.dtype}, {out.device}"
        )
    if not out.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def reduce_scatter_along_first_dim(
    inp: torch.Tensor,
    tp_group=None,
    async_op: bool = False,
    output: torch.Tensor | None = None,
) -> tuple[torch.Tensor, object | None]:
    """(this rank's slice of the sum over ranks, handle): inp (W M, ...) -> (M, ...), rank r
    gets rows [r M, (r + 1) M) of the sum, written into `output` when given ((M, ...), inp's
    dtype and device). With one rank, inp itself. ValueError unless W divides the first dim."""
    world = world_size(tp_group)
    if world == 1:
        return inp, None
    if inp.shape[0] % world:
        raise ValueError(
            f"reduce_scatter_along_first_dim: the first dim ({inp.shape[0]}) must be divisible "
            f"by the group's {world} ranks"
        )
    inp = inp.contiguous()
    rows = inp.shape[0] // world
    shape = (rows, *inp.shape[1:])
    if output is not None:
        _check_output("output", output, shape, inp)
    if is_native(tp_group):
        out = torch.empty(shape, dtype=inp.dtype, device=inp.device) if output is None else output
        handle = dist.reduce_scatter_tensor(out, inp, group=tp_group, async_op=async_op)
        return out, handle
    total = inp.clone()
    dist.all_reduce(total, group=tp_group)
    rank = dist.get_rank(tp_group)
    mine = total[rank * rows : (rank + 1) * rows]
    if output is not None:
        mine = output.copy_(mine)
    return mine, DoneHandle() if async_op else None


def allreduce(
    inp: torch.Tensor, tp_group=None, async_op: bool = False, *, op=dist.ReduceOp.SUM
) -> tuple[torch.Tensor, object | None]:
    """(the sum over ranks, or another `op` (torch.distributed.ReduceOp), in inp's storage,
    handle)."""
    if world_size(tp_group) == 1:
        return inp, None
    handle = dist.all_reduce(inp, op=op, group=tp_group, async_op=async_op)
    return inp, handle


def all_to_all_split(
    inp: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group,
    async_op: bool = False,
) -> tuple[torch.Tensor, object | None]:
    """(the rows received from every rank, handle): inp (sum(in_splits), ...) of which rows
    [sum(in_splits[:r]), sum(in_splits[:r + 1])) go to rank r -> (sum(out_splits), ...), rank
    r's rows at [sum(out_splits[:r]), ...) (the all-to-all with row split sizes held on the
    host). NCCL moves the tensor itself; other backends (gloo) move its bytes as uint8 rows,
    so that any dtype (bf16, FP8) crosses, synchronously (the handle is then done)."""
    inp = inp.contiguous()
    out = inp.new_empty((sum(out_splits), *inp.shape[1:]))
    if is_native(group):
        handle = dist.all_to_all_single(out, inp, out_splits, in_splits, group, async_op)
        return out, handle
    dist.all_to_all_single(_as_bytes(out), _as_bytes(inp), out_splits, in_splits, group)
    return out, DoneHandle() if async_op else None


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous (N, ...) tensor's bytes as (N, row bytes) uint8 (a view)."""
    width = 1
    for size in t.shape[1:]:
        width *= size
    return t.reshape(t.shape[0], width).view(torch.uint8)


def send_recv(
    sends: list[torch.Tensor], recvs: list[torch.Tensor], dst: int, src: int, group
) -> list:
    """Post the sends of `sends` to global rank `dst` and the receives into `recvs` from global
    rank `src` as one batch (NCCL runs them in one group, so two ranks that exchange with each
    other cannot deadlock); returns the works to wait on. The tensors must be contiguous and
    left untouched until the works are waited on."""
    ops = [dist.P2POp(dist.isend, x, dst, group) for x in sends]
    ops += [dist.P2POp(dist.irecv, x, src, group) for x in recvs]
    return dist.batch_isend_irecv(ops)


def wait_all(works: list | None) -> None:
    """Wait on each work of a send_recv (None: nothing posted)."""
    for work in works or ():
        work.wait()


def all_to_all_rows(inp: torch.Tensor, group, world: int) -> torch.Tensor:
    """All-to-all along dim 0: inp (W, ...) on each of the W ranks -> out (W, ...) where out[i]
    is rank i's inp[this rank]. A backend without all_to_all_single gets all_gather and the
    rows meant for this rank."""
    inp = inp.contiguous()
    out = torch.empty_like(inp)
    try:
        dist.all_to_all_single(out, inp, group=group)
    except RuntimeError as err:  # a backend without alltoall: gather everything, keep ours
        if "alltoall" not in str(err).lower() and "all_to_all" not in str(err).lower():
            raise
        gathered = torch.empty((world, *inp.shape), dtype=inp.dtype, device=inp.device)
        dist.all_gather(list(gathered.unbind(0)), inp, group=group)
        out.copy_(gathered[:, dist.get_rank(group)])
    return out
