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
nothing to do.

NVFP4Tensor with 16x16 tiles (NVFP4BlockScaling's weights; no Hadamard transform, no
stochastic rounding): the per-tensor amax and every tile's amax are agreed over the ranks' slices
(one MAX all-reduce), the E4M3 tile scales and the amax are set on every rank, and each rank
encodes its slice into the rowwise data. Offsets count values, as in Transformer Engine; two
values share a byte (value 2j in the low nibble of byte j), so a slice [start, end) owns the
bytes [start // 2, ceil(end / 2)), and where start or end is odd it writes only its nibble of
the shared byte (read-modify-write; the other rank writes the other nibble).
post_all_gather_processing then makes the columnwise copy, the exact transpose.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from torchte.kernels import block_cast_reference as bcr
from torchte.kernels import mxfp8_cast as mx
from torchte.kernels import nvfp4_cast as nv
from torchte.kernels._fp4_codec import (
    E4M3_MAX,
    FLT_MAX,
    RCP_6,
    fp4_codes_reference,
    global_scales_reference,
)
from torchte.kernels.block_layout import BLOCK

from . import param_utils
from .block_tensor import BlockQuantizedTensor, Float8BlockwiseQTensor, MXFP8Tensor, NVFP4Tensor
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
    (param_utils); the columnwise copy of a 128x128-block weight or of a 16x16-tile NVFP4
    weight made again from them (an NVFP4 weight that cannot have it: ValueError). Other
    tensors: nothing to do."""
    weights = list(model_weights) if isinstance(model_weights, list | tuple) else [model_weights]
    float8 = [w for w in weights if not isinstance(w, BlockQuantizedTensor)]
    param_utils.post_all_gather_processing(float8)
    for weight in weights:
        if isinstance(weight, Float8BlockwiseQTensor) and weight._storage.block_dim == 2:
            storage = weight._storage
            storage.update_usage(columnwise_usage=False)
            storage.update_usage(columnwise_usage=True)
        elif isinstance(weight, NVFP4Tensor):
            _nvfp4_columnwise(weight)


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
    param_utils; 128x128-block Float8BlockwiseQTensors, MXFP8Tensors and 16x16-tile
    NVFP4Tensors are cast here (fsdp_shard_model_weights: what this rank writes instead, per
    weight: the flat rowwise bytes of a 128x128-block weight; a pair (rowwise bytes, columnwise
    bytes) of an MXFP8 weight; the uint8 bytes [start // 2, ceil(end / 2)) of an NVFP4
    weight's rowwise data)."""
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
            start = param_utils._checked_offset(i, start_offsets[i], master.numel(), numel)
            if isinstance(model_weights[i], NVFP4Tensor) and fsdp_shard_model_weights is not None:
                shard = fsdp_shard_model_weights[i]
                _nvfp4_fragment(model_weights[i]._storage, shard, start, master.numel())
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
    nvfp4 = [cast for cast in casts if isinstance(cast[0], NVFP4Tensor)]
    blockwise = [cast for cast in casts if isinstance(cast[0], Float8BlockwiseQTensor)]
    if blockwise:
        _cast_blockwise(blockwise, group, manual_post_all_gather_processing)
    if mxfp8:
        _cast_mxfp8(mxfp8, group)
    if nvfp4:
        _cast_nvfp4(nvfp4, group, manual_post_all_gather_processing)


# Transformer Engine's older name of quantize_master_weights (the same arguments).
cast_master_weights_to_fp8 = quantize_master_weights


def _check_block_weight(i: int, weight: torch.Tensor) -> None:
    if isinstance(weight, MXFP8Tensor):
        _check_mxfp8_weight(i, weight)
        return
    if isinstance(weight, NVFP4Tensor):
        _check_nvfp4_weight(f"quantize_master_weights: model_weights[{i}] (NVFP4Tensor)", weight)
        return
    if not isinstance(weight, Float8BlockwiseQTensor) or weight._storage.block_dim != 2:
        raise NotImplementedError(
            f"quantize_master_weights: model_weights[{i}] is a {type(weight).__name__}"
            f"{'' if not isinstance(weight, Float8BlockwiseQTensor) else ' with 1x128 blocks'}"
            "; only Float8Tensor, 128x128-block Float8BlockwiseQTensor, MXFP8Tensor and "
            "16x16-tile NVFP4Tensor are supported"
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


# -- NVFP4, 16x16 tiles: per-tensor and tile amaxes agreed, each rank's nibbles of the rowwise data

_FP4 = nv.FP4_BLOCK


def _check_nvfp4_weight(name: str, weight: NVFP4Tensor) -> None:
    """ValueError (starting with `name`, the weight) unless weight is 2-D, quantized with
    16x16 tiles, without the Hadamard transform or stochastic rounding, and holds data."""
    storage, quantizer = weight._storage, weight._quantizer
    if weight.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(weight.shape)}")
    if not storage.with_2d_quantization or not getattr(quantizer, "with_2d_quantization", True):
        raise ValueError(
            f"{name} must use 2-D (16x16) quantization (NVFP4BlockScaling's weight quantizer, "
            "with_2d_quantization=True): with 1x16 blocks the columnwise copy's scales belong "
            "to other blocks, which no rank's slice gives"
        )
    if storage.rht_sign_mask is not None or getattr(quantizer, "with_rht", False):
        raise ValueError(
            f"{name} uses the random Hadamard transform: its columnwise copy cannot be made "
            "from the rowwise bytes (weights take no RHT)"
        )
    if getattr(quantizer, "stochastic_rounding", False):
        raise ValueError(
            f"{name} uses stochastic rounding: a slice's cast would not equal the whole "
            "weight's (weights are rounded to nearest)"
        )
    if storage.rowwise_data is None and storage.columnwise_data is None:
        raise ValueError(f"{name} holds no data (emptied by prepare_for_saving?)")


def _nvfp4_fragment(storage, shard, start: int, count: int) -> torch.Tensor:
    """The flat uint8 bytes [start // 2, ceil((start + count) / 2)) the slice of values
    [start, start + count) is written into: the weight's own rowwise data, or `shard`
    (fsdp_shard_model_weights: uint8, contiguous, that many bytes, on the weight's device)."""
    first, stop = start // 2, (start + count + 1) // 2
    if shard is None:
        return storage.rowwise_data.view(-1)[first:stop]
    if isinstance(shard, NVFP4Tensor):
        shard = shard._storage.rowwise_data
    name = "quantize_master_weights: fsdp_shard_model_weights of an NVFP4 weight"
    if not isinstance(shard, torch.Tensor) or shard.dtype != torch.uint8:
        what = shard.dtype if isinstance(shard, torch.Tensor) else type(shard).__name__
        raise TypeError(f"{name} must be a torch.uint8 tensor (two FP4 values a byte), got {what}")
    if shard.numel() != stop - first or not shard.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous with {stop - first} bytes (values [{start}, "
            f"{start + count}) are bytes [{first}, {stop})), got {shard.numel()} elements"
        )
    if shard.device != storage.device:
        raise ValueError(f"{name} must be on {storage.device}, got {shard.device}")
    return shard.detach().view(-1)


def _nvfp4_partial_amax(weight, master, start: int, amax: torch.Tensor):
    """Write amax (1 + M/16 * K/16,) fp32: the per-tensor amax of this rank's slice, then the
    amaxes of the 16x16 tiles it touches (NaN skipped, as the cast does; others 0); return
    the slice's window (first row, fp32 values (R', K)) or None."""
    if master is None or master.numel() == 0:
        return None
    param_utils._checked_offset(0, start, master.numel(), weight.numel())
    first, values = _window(weight, master.detach(), start, _FP4)
    tiles = nv._block_amax_reference(values, True)[::_FP4]  # (R'/16, K/16)
    tile_amax = amax[1:].view(weight.shape[0] // _FP4, -1)
    tile_amax[first // _FP4 : first // _FP4 + tiles.shape[0]] = tiles
    amax[0] = tiles.max()
    return first, values


def _cast_nvfp4(casts: list, group, manual: bool) -> None:
    """The per-tensor and tile amaxes over all ranks' slices (one MAX all-reduce), every
    weight's tile scales and amax, each rank's slice encoded into its rowwise bytes."""
    device = casts[0][0].device
    sizes = [1 + w.numel() // (_FP4 * _FP4) for w, *_ in casts]
    packed = torch.zeros(sum(sizes), dtype=torch.float32, device=device)
    amaxes = packed.split(sizes)
    windows = []
    for (weight, master, start, _), amax in zip(casts, amaxes, strict=True):
        windows.append(_nvfp4_partial_amax(weight, master, start, amax))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(packed, op=torch.distributed.ReduceOp.MAX, group=group)
    with torch.no_grad():
        for (weight, master, start, shard), amax, window in zip(
            casts, amaxes, windows, strict=True
        ):
            storage = weight._storage
            if storage.rowwise_data is None:  # made from the columnwise copy (the transpose)
                storage.update_usage(rowwise_usage=True)
            encode = _nvfp4_scales(storage, amax[0:1], amax[1:].view(weight.shape[0] // _FP4, -1))
            if window is not None:
                target = _nvfp4_fragment(storage, shard, start, master.numel())
                _write_nvfp4(start, master.numel(), encode, window, target)
            if not manual:
                storage.update_usage(columnwise_usage=False)
            torch.autograd.graph.increment_version(weight)


def _nvfp4_scales(storage, amax: torch.Tensor, tile_amax: torch.Tensor) -> torch.Tensor:
    """Write the E4M3 scales of the tiles (tile_amax (M/16, K/16) fp32; each repeated on its
    16 rows) and the per-tensor amax (1,) into the rowwise copy, with the cast's arithmetic
    (kernels/nvfp4_cast.py's _encode_reference); return the tiles' fp32 encode factors."""
    s_enc, s_dec = global_scales_reference(amax)
    s = tile_amax * (s_enc * RCP_6)  # fp32 products, as the cast's
    s = torch.where(s < FLT_MAX, s, FLT_MAX).clamp(max=E4M3_MAX)
    code = s.to(torch.float8_e4m3fn)
    encode = torch.ones_like(s) / (code.float() * s_dec)
    rows, cols = tile_amax.shape
    scale = storage.rowwise_scale_inv
    scale[: rows * _FP4, :cols] = code.view(torch.uint8).repeat_interleave(_FP4, dim=0)
    if storage.amax_rowwise is None:
        storage.amax_rowwise = amax.clone()
    else:
        storage.amax_rowwise.copy_(amax)
    return torch.where(encode < FLT_MAX, encode, FLT_MAX)


def _write_nvfp4(start: int, count: int, encode, window, target: torch.Tensor) -> None:
    """Encode the slice's values [start, start + count) (in its window) with the tiles' encode
    factors (M/16, K/16) into target, the bytes [start // 2, ceil((start + count) / 2)):
    only this slice's nibbles change (a shared first or last byte keeps the other one)."""
    first, values = window
    rows, cols = values.shape
    tile_encode = encode[first // _FP4 : (first + rows) // _FP4]
    y = values.view(rows // _FP4, _FP4, cols // _FP4, _FP4) * tile_encode[:, None, :, None]
    offset = start - first * cols
    codes = fp4_codes_reference(y, None).reshape(-1)[offset : offset + count]
    nibbles = torch.stack((target & 15, target >> 4), dim=-1).reshape(-1).long()
    nibbles[start % 2 : start % 2 + count] = codes
    pairs = nibbles.view(-1, 2)
    target.copy_(pairs[:, 0] | (pairs[:, 1] << 4))


def _nvfp4_columnwise(weight: NVFP4Tensor) -> None:
    """Make an NVFP4 weight's columnwise copy again from its rowwise one (the exact transpose
    of 16x16-tile data), into the copy's existing tensors where it has them."""
    _check_nvfp4_weight("post_all_gather_processing: an NVFP4Tensor", weight)
    storage = weight._storage
    if storage.rowwise_data is None:
        return  # nothing gathered: the columnwise copy is all there is
    names = ("columnwise_data", "columnwise_scale_inv", "amax_columnwise")
    old = [getattr(storage, name) for name in names]
    storage.update_usage(columnwise_usage=False)
    storage.update_usage(columnwise_usage=True)
    if all(t is not None for t in old):  # keep the addresses (CUDA graphs, FSDP buffers)
        for name, tensor in zip(names, old, strict=True):
            tensor.copy_(getattr(storage, name))
            setattr(storage, name, tensor)
