"""FP8 parameters (Float8Tensor, te.quantized_model_init) under FSDP2: shards of FP8 bytes.

FSDP2 shards a parameter along its rows with split / new_zeros / slice / copy_ / view on it,
then gathers it through the parameter's fsdp_pre_all_gather / fsdp_post_all_gather. For a
Float8Tensor with rowwise data those ops act on its bytes (row_view, new_zeros): a shard is a
Float8Tensor over a block of rows of the FP8 bytes, with the whole tensor's scale_inv and
quantizer. The all-gather moves the bytes (one per value) and gives the module a Float8Tensor
of the whole weight, which its GEMMs read as they are. The optimizer updates each shard in
place (dequantize, step, requantize); under current scaling the quantizer then takes the amax
over the data-parallel ranks (its amax_reduction, set at the first all-gather), so every rank
casts its rows with the same scale, as the gathered tensor's one scale_inv needs. Delayed
scaling casts with the module's scale, the same on every rank while their amax histories are
reduced over the group (te.autocast's amax_reduction_group).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from torchte._collectives import allreduce

from .float8 import Float8CurrentScalingQuantizer, Float8Storage

__all__ = [
    "fsdp_post_all_gather",
    "fsdp_pre_all_gather",
    "max_over",
    "new_zeros",
    "pad_rows",
    "row_view",
]


def row_view(tensor, func, args, kwargs):
    """A view op (split along dim 0, slice, view) of a Float8Tensor applied to its rowwise
    bytes: Float8Tensors with the same scale_inv and quantizer; None where it does not apply
    (no rowwise data, or a result that is not contiguous). tensor's columnwise copy is dropped
    (made again from the rowwise bytes when needed): a write through the view would leave it
    stale."""
    from .float8_tensor import Float8Tensor

    storage = tensor._storage
    if storage.rowwise_data is None:
        return None
    out = func(storage.rowwise_data.view(storage.shape), *args[1:], **kwargs)
    results = out if isinstance(out, list | tuple) else [out]
    if not all(t.is_contiguous() for t in results):
        return None
    storage.columnwise_data = None
    wrapped = [
        Float8Tensor.from_storage(
            Float8Storage(t, None, storage.scale_inv, storage.fp8_dtype, tuple(t.shape)),
            tensor.dtype,
            tensor._quantizer,
        )
        for t in results
    ]
    return wrapped if isinstance(out, list | tuple) else wrapped[0]


def new_zeros(tensor, size, **kwargs):
    """A Float8Tensor of `size` whose bytes are zero, with a copy of tensor's scale_inv (FSDP2's
    padded shard, into which it copies the rows)."""
    from .float8_tensor import Float8Tensor

    storage = tensor._storage
    data = torch.zeros(size, dtype=storage.fp8_dtype, device=tensor.device)
    zeros = Float8Storage(data, None, storage.scale_inv.clone(), storage.fp8_dtype, tuple(size))
    return Float8Tensor.from_storage(zeros, tensor.dtype, tensor._quantizer)


def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
    """This rank's rows of FP8 bytes (as uint8, padded to FSDP2's padded shard rows), and what
    makes them a Float8Tensor again."""
    quantizer = self._quantizer
    if isinstance(quantizer, Float8CurrentScalingQuantizer) and quantizer.amax_reduction is None:
        quantizer.amax_reduction = max_over(mesh.get_group())
    storage = self._storage
    if storage.rowwise_data is None:
        storage.update_usage(rowwise_usage=True)
    data = pad_rows(storage.rowwise_data, outer_size, mesh.size(), self.device)
    meta = (storage.scale_inv.clone(), tuple(outer_size), storage.fp8_dtype, quantizer)
    return (data,), meta


def max_over(group) -> Callable[[torch.Tensor], object]:
    """A function all-reducing a tensor in place with MAX over `group`, through
    te.distributed's collectives (the amaxes of a tensor whose rows the ranks hold)."""
    return functools.partial(allreduce, tp_group=group, op=dist.ReduceOp.MAX)


def pad_rows(shard: torch.Tensor | None, outer_size, ranks: int, device) -> torch.Tensor:
    """A rank's FP8 shard (rows of a weight of outer_size; None: no rows) as uint8 with
    FSDP2's padded shard rows, ceil(rows / ranks), zero-filled past its own."""
    rows = math.ceil(outer_size[0] / ranks)
    if shard is not None:
        data = shard.view(torch.uint8).reshape(-1, *outer_size[1:])
        if data.shape[0] == rows:
            return data
    padded = torch.zeros(rows, *outer_size[1:], dtype=torch.uint8, device=device)
    if shard is not None:
        padded[: data.shape[0]] = data
    return padded


def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
    """The gathered bytes (the ranks' padded shards one after the other: the weight is their
    first rows) as a Float8Tensor of nominal param_dtype; metadata (scale_inv, shape, fp8
    dtype, quantizer). With out (a re-gather into the tensor made before), out takes them in
    a new storage (an older one may be saved for a backward). Also te.fsdp's."""
    from .float8_tensor import Float8Tensor

    (data,) = all_gather_outputs
    scale_inv, shape, fp8_dtype, quantizer = metadata
    rows = data.view(fp8_dtype).view(-1, *shape[1:])[: shape[0]]
    storage = Float8Storage(rows, None, scale_inv, fp8_dtype, shape)
    if out is not None:
        out._storage = storage
        return None
    return Float8Tensor.from_storage(storage, param_dtype, quantizer), (data,)
