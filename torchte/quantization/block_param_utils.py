"""Transformer Engine's `tensor.utils` for every quantized parameter: Float8Tensor (delegated to
param_utils.py) and the block-scaled ones, as Megatron-Core's distributed optimizer with
--fp8-param-gather calls them under fp8_recipe="blockwise" and "mxfp8".

Float8BlockwiseQTensor (128x128 blocks): each data-parallel rank holds an fp32 master slice
`[start, start + numel)` of a weight flattened, cut anywhere (not at blocks).
quantize_master_weights takes each 128x128 tile's amax over the slices of all ranks (one MAX
all-reduce of every tile of every weight), sets every weight's scale_inv from them, and casts
each rank's slice with its tiles' scales into the weight's rowwise bytes: after the all-gather
of the bytes the weight equals quantizing the whole master at once. post_all_gather_processing
then makes the columnwise copy (transposed bytes and scales).

MXFP8Tensor (E8M0 codes per 1x32 rowwise and 32x1 columnwise block, or per 32x32 block under
2-D quantization): the same scheme with both copies. Each rank's slice gives the partial amaxes
of the blocks it touches in both directions (one MAX all-reduce for every weight), every code of
both scale tensors is set from them, and each rank casts its slice into the same flat range of
the rowwise AND the columnwise data (both (M, K) row-major); post_all_gather_processing has
nothing to do. NVFP4Tensor masters: NotImplementedError.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from torchte.kernels import block_cast_reference as bcr
from torchte.kernels import mxfp8_cast as mx
from torchte.kernels.block_layout import BLOCK

from . import param_utils
from .block_tensor import BlockQuantizedTensor, Float8BlockwiseQTensor, MXFP8Tensor
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
    param_utils; 128x128-block Float8BlockwiseQTensors and MXFP8Tensors are cast here
    (fsdp_shard_model_weights: what this rank writes instead, per weight: the flat rowwise bytes
    of a 128x128-block weight; a pair (rowwise bytes, columnwise bytes) of an MXFP8 weight)."""
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
    for i in blocks:  # every block weight checked before any weight changes
        _check_block_weight(i, model_weights[i])
        master = master_weights[i]
        if master is not None and master.numel():
            numel = model_weights[i].numel()
            param_utils._checked_offset(i, start_offsets[i], master.numel(), numel)
    others = [i for i in range(len(model_weights)) if i not in set(blocks)]
    if others:

        def pick(values):
            return None if values is None else [values[i] for i in others]

        param_utils.quantize_master_weights(
            pick(model_weights), pick(master_weights), pick(start_offsets), group,
            pick(fsdp_shard_model_weights), manual_post_all_gather_processing,
        )  # fmt: skip
    shards = fsdp_shard_model_weights or [None] * len(model_weights)
    casts = [(model_weights[i], master_weights[i], start_offsets[i], shards[i]) for i in blocks]
    mxfp8 = [cast for cast in casts if isinstance(cast[0], MXFP8Tensor)]
    blockwise = [cast for cast in casts if not isinstance(cast[0], MXFP8Tensor)]
    if blockwise:
        _cast_blockwise(blockwise, group, manual_post_all_gather_processing)
    if mxfp8:
        _cast_mxfp8(mxfp8, group)


# Transformer Engine's older name of quantize_master_weights (the same arguments).
cast_master_weights_to_fp8 = quantize_master_weights


def _check_block_weight(i: int, weight: torch.Tensor) -> None:
    if isinstance(weight, MXFP8Tensor):
        _check_mxfp8_weight(i, weight)
        return
    if not isinstance(weight, Float8BlockwiseQTensor) or weight._storage.block_dim != 2:
        raise NotImplementedError(
            f"quantize_master_weights: model_weights[{i}] is a {type(weight).__name__}"
            f"{'' if not isinstance(weight, Float8BlockwiseQTensor) else ' with 1x128 blocks'}"
            "; only Float8Tensor, 128x128-block Float8BlockwiseQTensor and MXFP8Tensor are "
            "supported"
        )
    if weight.dim() != 2:
        raise ValueError(
            f"quantize_master_weights: model_weights[{i}] must be 2-D for blockwise scaling, "
            f"got shape {tuple(weight.shape)}"
        )
    weight._require_quantizer()


def _window(
    weight, master: torch.Tensor, start: int, block: int = BLOCK
) -> tuple[int, torch.Tensor]:
    """(first block row, values): the whole `block`-row blocks the master slice touches, fp32
    (R', C) in the weight's nominal dtype's values, zero outside the slice."""
    rows, cols = weight.shape
    first = start // cols // block * block
    last = min(rows, -(-(start + master.numel()) // (cols * block)) * block)
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
        tile_amax = bcr._abs_no_nan(_tiles(values)).amax(dim=(1, 3))  # inf kept, NaN 0
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


# -- MXFP8: E8M0 codes per 1x32 and 32x1 block (or 32x32), both copies written by every rank ----

_MX_USAGES = ("rowwise", "columnwise")


def _check_mxfp8_weight(i: int, weight: MXFP8Tensor) -> None:
    """ValueError unless weight is 2-D and holds both copies (under 2-D quantization one copy
    is enough: the other is the same bytes, made before the cast)."""
    if weight.dim() != 2:
        raise ValueError(
            f"quantize_master_weights: model_weights[{i}] must be 2-D for MXFP8 scaling, "
            f"got shape {tuple(weight.shape)}"
        )
    storage = weight._storage
    missing = [u for u in _MX_USAGES if getattr(storage, f"{u}_data") is None]
    if len(missing) == 2 or (missing and not storage.two_d):
        raise ValueError(
            f"quantize_master_weights: model_weights[{i}] (MXFP8Tensor) has no {missing[0]} "
            "data: both the rowwise and the columnwise copy must exist (their 1x32 and 32x1 "
            "blocks have different scales, so each rank writes its slice of both)"
        )


def _mxfp8_partial_amax(weight, master, start, amax_r: torch.Tensor, amax_c: torch.Tensor):
    """Write the amaxes of the 1x32 blocks (amax_r (M, K/32)) and 32x1 blocks (amax_c
    (M/32, K)) that this rank's slice touches, over its values only (NaN ignored, as the cast
    does); return the slice's window (first row, fp32 values (R', K)) or None."""
    if master is None or master.numel() == 0:
        return None
    param_utils._checked_offset(0, start, master.numel(), weight.numel())
    first, values = _window(weight, master.detach(), start, mx.BLOCK)
    rows, cols = values.shape
    mag = values.view(rows // mx.BLOCK, mx.BLOCK, cols // mx.BLOCK, mx.BLOCK).abs()
    mag = torch.where(torch.isnan(mag), 0.0, mag)
    amax_r[first : first + rows] = mag.amax(dim=3).reshape(rows, -1)
    first_block = first // mx.BLOCK
    amax_c[first_block : first_block + rows // mx.BLOCK] = mag.amax(dim=1).reshape(-1, cols)
    return first, values


def _cast_mxfp8(casts: list, group) -> None:
    """Every block's amax over all ranks' slices (one MAX all-reduce), every weight's E8M0
    codes, each rank's slice cast into both copies."""
    device = casts[0][0].device
    counts = [w.numel() // mx.BLOCK for w, *_ in casts]  # 1x32 blocks = 32x1 blocks
    packed = torch.zeros(2 * sum(counts), dtype=torch.float32, device=device)
    pieces = packed.split([n for n in counts for _ in range(2)])
    amaxes, windows, targets = [], [], []
    for k, (weight, master, start, shard) in enumerate(casts):
        if weight._storage.two_d:  # make a missing copy (the same bytes): both get the slice
            weight._storage.update_usage(rowwise_usage=True, columnwise_usage=True)
        rows, cols = weight.shape
        amax_r = pieces[2 * k].view(rows, cols // mx.BLOCK)
        amax_c = pieces[2 * k + 1].view(rows // mx.BLOCK, cols)
        amaxes.append((amax_r, amax_c))
        windows.append(_mxfp8_partial_amax(weight, master, start, amax_r, amax_c))
        if windows[-1] is not None:  # checked before the all-reduce: a bad shard fails early
            targets.append(_mxfp8_targets(weight._storage, shard, start, master.numel()))
        else:
            targets.append(None)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(packed, op=torch.distributed.ReduceOp.MAX, group=group)
    with torch.no_grad():
        for (weight, _, start, _), amax, window, target in zip(
            casts, amaxes, windows, targets, strict=True
        ):
            _write_mxfp8(weight, start, amax, window, target)
            torch.autograd.graph.increment_version(weight)


def _mxfp8_codes(storage, amax_r: torch.Tensor, amax_c: torch.Tensor):
    """int32 E8M0 codes (M, K/32) and (M/32, K) of the agreed amaxes (under 2-D quantization
    both from each 32x32 block's amax), written into the storage's scale tensors."""
    if storage.two_d:
        mb, cols = amax_c.shape
        amax_2d = amax_c.view(mb, cols // mx.BLOCK, mx.BLOCK).amax(dim=2)  # (M/32, K/32)
        amax_r = amax_2d.repeat_interleave(mx.BLOCK, dim=0)
        amax_c = amax_2d.repeat_interleave(mx.BLOCK, dim=1)
    code_r = mx._e8m0_reference(amax_r, storage.fp8_dtype)
    code_c = mx._e8m0_reference(amax_c, storage.fp8_dtype)
    storage.rowwise_scale_inv[: code_r.shape[0], : code_r.shape[1]] = code_r.to(torch.uint8)
    storage.columnwise_scale_inv[: code_c.shape[0], : code_c.shape[1]] = code_c.to(torch.uint8)
    return code_r, code_c


def _mxfp8_targets(storage, shard, start: int, count: int):
    """(rowwise, columnwise) flat FP8 views this rank's slice is written to: the weight's own
    bytes [start, start + count), or the fsdp_shard_model_weights pair (Transformer Engine's
    (rowwise fragment, columnwise fragment), each `count` uint8 or FP8 elements)."""
    if shard is None:
        return tuple(
            getattr(storage, f"{u}_data").view(-1)[start : start + count] for u in _MX_USAGES
        )
    name = "quantize_master_weights: fsdp_shard_model_weights"
    if not isinstance(shard, list | tuple) or len(shard) != 2:
        raise TypeError(
            f"{name} of an MXFP8 weight must be a pair (rowwise bytes, columnwise bytes), got "
            f"{type(shard).__name__}"
        )
    return tuple(
        as_fp8_bytes(part, storage.fp8_dtype, count, f"{name} ({u})", storage.device)
        for part, u in zip(shard, _MX_USAGES, strict=True)
    )


def _write_mxfp8(weight, start: int, amax, window, targets) -> None:
    """Set weight's codes from the agreed amaxes; cast this rank's slice (its window) into
    both copies' targets."""
    code_r, code_c = _mxfp8_codes(weight._storage, *amax)
    if window is None:
        return
    first, values = window
    rows, cols = values.shape
    x4 = values.view(rows // mx.BLOCK, mx.BLOCK, cols // mx.BLOCK, mx.BLOCK)
    first_block = first // mx.BLOCK
    code_r = code_r[first : first + rows].view(x4.shape[:3])[:, :, :, None]
    code_c = code_c[first_block : first_block + x4.shape[0]].view(x4.shape[0], 1, *x4.shape[2:])
    offset = start - first * cols
    for code, target in zip((code_r, code_c), targets, strict=True):
        data = mx._encode_reference(x4, code, weight._storage.fp8_dtype)
        target.copy_(data.reshape(-1)[offset : offset + target.numel()])
