"""Transformer Engine's `tensor.utils` for every quantized parameter: Float8Tensor (delegated to
param_utils.py) and the block-scaled ones, as Megatron-Core's distributed optimizer with
--fp8-param-gather calls them under fp8_recipe="blockwise".

Float8BlockwiseQTensor (128x128 blocks): each data-parallel rank holds an fp32 master slice
`[start, start + numel)` of a weight flattened, cut anywhere (not at blocks).
quantize_master_weights takes each 128x128 tile's amax over the slices of all ranks (one MAX
all-reduce of every tile of every weight), sets every weight's scale_inv from them, and casts
each rank's slice with its tiles' scales into the weight's rowwise bytes: after the all-gather
of the bytes the weight equals quantizing the whole master at once. post_all_gather_processing
then makes the columnwise copy (transposed bytes and scales). MXFP8Tensor and NVFP4Tensor
masters: NotImplementedError (a 1x32 block cut by a slice needs its amax agreed the same way).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from torchte.kernels import block_cast_reference as bcr
from torchte.kernels.block_layout import BLOCK

from . import param_utils
from .block_tensor import BlockQuantizedTensor, Float8BlockwiseQTensor
from .float8_tensor import Float8Tensor
from .float8_tensor_te import as_fp8_bytes

__all__ = [
    "cast_master_weights_to_fp8",
    "post_all_gather_processing",
    "quantize_master_weights",
    "replace_raw_data",
]


def replace_raw_data(tensor: torch.Tensor, new_raw_data: torch.Tensor) -> None:
    """Move the rowwise bytes of `tensor` into `new_raw_data` (uint8 or the FP8 dtype,
    contiguous, as many bytes as the rowwise data; typically a slice of one buffer holding many
    parameters), keeping its value: the buffer becomes the rowwise data (aliased). Float8Tensor:
    param_utils.replace_raw_data; MXFP8Tensor: NotImplementedError (as in Transformer Engine)."""
    if isinstance(tensor, Float8Tensor):
        param_utils.replace_raw_data(tensor, new_raw_data)
        return
    if not isinstance(tensor, BlockQuantizedTensor) or type(tensor).__name__ == "MXFP8Tensor":
        what = type(tensor).__name__
        raise NotImplementedError(f"replace_raw_data: {what} is not supported")
    storage = tensor._storage
    if storage.rowwise_data is None:
        storage.update_usage(rowwise_usage=True)
    old = storage.rowwise_data
    flat = as_fp8_bytes(new_raw_data, old.dtype, old.numel(), "new_raw_data", old.device)
    flat.view(torch.uint8).copy_(old.reshape(-1).view(torch.uint8))
    storage.rowwise_data = flat.view(old.shape)


def post_all_gather_processing(model_weights: torch.Tensor | Sequence[torch.Tensor]) -> None:
    """After the rowwise bytes of `model_weights` were all-gathered: Float8Tensor's transpose
    (param_utils); a 128x128-block weight's columnwise copy made again from them. Other
    tensors: nothing to do."""
    weights = list(model_weights) if isinstance(model_weights, list | tuple) else [model_weights]
    float8 = [w for w in weights if not isinstance(w, BlockQuantizedTensor)]
    param_utils.post_all_gather_processing(float8)
    for weight in weights:
        if isinstance(weight, Float8BlockwiseQTensor) and weight._storage.block_dim == 2:
            storage = weight._storage
            storage.update_usage(columnwise_usage=False)
            storage.update_usage(columnwise_usage=True)


def quantize_master_weights(
    model_weights: Sequence[torch.Tensor],
    master_weights: Sequence[torch.Tensor | None],
    start_offsets: Sequence[int | None],
    group,
    fsdp_shard_model_weights: Sequence[torch.Tensor | None] | None = None,
    manual_post_all_gather_processing: bool = False,
) -> None:
    """Cast each rank's master-weight slices into its quantized parameters (see the module
    docstring; arguments as param_utils.quantize_master_weights). Float8Tensors go to
    param_utils; 128x128-block Float8BlockwiseQTensors are cast here (fsdp_shard_model_weights:
    the flat rowwise bytes this rank writes instead, per weight)."""
    lists = {"master_weights": master_weights, "start_offsets": start_offsets}
    if fsdp_shard_model_weights is not None:
        lists["fsdp_shard_model_weights"] = fsdp_shard_model_weights
    for name, values in lists.items():
        if len(values) != len(model_weights):
            raise ValueError(
                f"quantize_master_weights: {name} has {len(values)} entries, model_weights "
                f"{len(model_weights)}: one per model weight"
            )
    blocks = [i for i, w in enumerate(model_weights) if isinstance(w, BlockQuantizedTensor)]
    for i in blocks:
        _check_block_weight(i, model_weights[i])
    others = [i for i in range(len(model_weights)) if i not in set(blocks)]
    if others:

        def pick(values):
            return None if values is None else [values[i] for i in others]

        param_utils.quantize_master_weights(
            pick(model_weights), pick(master_weights), pick(start_offsets), group,
            pick(fsdp_shard_model_weights), manual_post_all_gather_processing,
        )  # fmt: skip
    if blocks:
        shards = fsdp_shard_model_weights or [None] * len(model_weights)
        casts = [(model_weights[i], master_weights[i], start_offsets[i], shards[i]) for i in blocks]
        _cast_blockwise(casts, group, manual_post_all_gather_processing)


# Transformer Engine's older name of quantize_master_weights (the same arguments).
cast_master_weights_to_fp8 = quantize_master_weights


def _check_block_weight(i: int, weight: torch.Tensor) -> None:
    if not isinstance(weight, Float8BlockwiseQTensor) or weight._storage.block_dim != 2:
        raise NotImplementedError(
            f"quantize_master_weights: model_weights[{i}] is a {type(weight).__name__}"
            f"{'' if not isinstance(weight, Float8BlockwiseQTensor) else ' with 1x128 blocks'}"
            "; only Float8Tensor and 128x128-block Float8BlockwiseQTensor are supported"
        )
    if weight.dim() != 2:
        raise ValueError(
            f"quantize_master_weights: model_weights[{i}] must be 2-D for blockwise scaling, "
            f"got shape {tuple(weight.shape)}"
        )
    weight._require_quantizer()


def _window(weight, master: torch.Tensor, start: int) -> tuple[int, torch.Tensor]:
    """(first block row, values): the whole 128-row blocks the master slice touches, fp32
    (R', C) in the weight's nominal dtype's values, zero outside the slice."""
    rows, cols = weight.shape
    first = start // cols // BLOCK * BLOCK
    last = min(rows, math.ceil((start + master.numel()) / cols / BLOCK) * BLOCK)
    values = torch.zeros((last - first) * cols, dtype=torch.float32, device=master.device)
    offset = start - first * cols
    values[offset : offset + master.numel()] = master.reshape(-1).to(weight.dtype).float()
    return first, values.view(last - first, cols)


def _tiles(values: torch.Tensor) -> torch.Tensor:
    """values (r, C) as (ceil(r/128), 128, ceil(C/128), 128), zero-padded."""
    rows, cols = values.shape
    n_r, n_c = -(-rows // BLOCK), -(-cols // BLOCK)
    padded = F.pad(values, (0, n_c * BLOCK - cols, 0, n_r * BLOCK - rows))
    return padded.view(n_r, BLOCK, n_c, BLOCK)


def _cast_blockwise(casts: list, group, manual: bool) -> None:
    """The tiles' amaxes over all ranks' slices, every weight's scale_inv, each slice's cast."""
    device = casts[0][0].device
    grids = [(-(-w.shape[0] // BLOCK), -(-w.shape[1] // BLOCK)) for w, *_ in casts]
    packed = torch.zeros(sum(r * c for r, c in grids), dtype=torch.float32, device=device)
    amaxes = list(packed.split([r * c for r, c in grids]))
    windows = []
    for (weight, master, start, _), amax, grid in zip(casts, amaxes, grids, strict=True):
        if master is None or master.numel() == 0:
            windows.append(None)
            continue
        param_utils._checked_offset(0, start, master.numel(), weight.numel())
        first, values = _window(weight, master.detach(), start)
        tile_amax = _tiles(values).abs().nan_to_num(nan=0.0).amax(dim=(1, 3))
        amax.view(grid)[first // BLOCK : first // BLOCK + tile_amax.shape[0]] = tile_amax
        windows.append((first, values))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(packed, op=torch.distributed.ReduceOp.MAX, group=group)
    with torch.no_grad():
        for (weight, master, start, shard), amax, grid, window in zip(
            casts, amaxes, grids, windows, strict=True
        ):
            _write(weight, master, start, shard, amax.view(grid), window)
            if not manual:
                weight._storage.update_usage(columnwise_usage=False)
            torch.autograd.graph.increment_version(weight)


def _write(weight, master, start, shard, amax: torch.Tensor, window) -> None:
    """Set weight's scale_inv from the agreed tile amaxes; cast this rank's slice."""
    quantizer, storage = weight._require_quantizer(), weight._storage
    if storage.rowwise_data is None:
        storage.update_usage(rowwise_usage=True)
    fp8_max = bcr.FP8_MAX[storage.fp8_dtype]
    inf_scale = bcr.value_for_inf(weight.dtype)
    scale = bcr.block_scale_reference(
        amax, fp8_max, quantizer.amax_epsilon, quantizer.force_pow_2_scales, inf_scale
    )
    storage.rowwise_scale_inv[:, : scale.shape[1]] = torch.reciprocal(scale)
    if window is None:
        return
    first, values = window
    tiles = _tiles(values)
    block_scale = scale[first // BLOCK : first // BLOCK + tiles.shape[0]]
    data = bcr._cast(tiles, block_scale[:, None, :, None], storage.fp8_dtype)
    data = data.view(tiles.shape[0] * BLOCK, -1)[: values.shape[0], : values.shape[1]]
    offset, count = start - first * weight.shape[1], master.numel()
    flat = data.reshape(-1)[offset : offset + count]
    if shard is None:
        target = storage.rowwise_data.view(-1)[start : start + count]
    else:
        if isinstance(shard, BlockQuantizedTensor):
            shard = shard._storage.rowwise_data
        name = "quantize_master_weights: fsdp_shard_model_weights"
        target = as_fp8_bytes(shard, storage.fp8_dtype, count, name, storage.device)
    target.copy_(flat)
