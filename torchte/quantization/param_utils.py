"""FP8 parameters under a sharded optimizer: Transformer Engine's `tensor.utils` functions.

Megatron-Core's distributed optimizer with --fp8-param-gather keeps every FP8 parameter
(a Float8Tensor from quantized_model_init) whole on each data-parallel rank, its FP8 bytes
moved into one contiguous uint8 buffer (`replace_raw_data`), and fp32 master weights sharded
over the ranks: a rank's master of one parameter is the slice
`[start_offset : start_offset + numel]` of that parameter flattened, or None where the rank
holds none of it. After the optimizer step each rank casts its master slices into the bytes of
the parameters (`cast_master_weights_to_fp8` / `quantize_master_weights`), the buffer is
all-gathered, and `post_all_gather_processing` makes the transposes from the gathered bytes.

The scale follows the parameter's quantizer:
- delayed scaling casts with the quantizer's scale, records the slice's amax into the
  quantizer's amax (row 0 of the module's amax history), all-reduces those amaxes with MAX
  over `group`, and sets every parameter's scale_inv to 1 / scale;
- current scaling takes the amax of each parameter over the slices of all ranks (one MAX
  all-reduce over `group` of one value per parameter) and casts with the scale of that amax,
  so the gathered bytes equal quantizing the whole master weight.
The master is first cast to the parameter's nominal dtype (fp32 masters of bf16 parameters are
rounded to bf16 first), as Transformer Engine does. Without an initialized torch.distributed,
`group` is ignored (one rank).
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from torchte.kernels import cast_transpose as ct
from torchte.kernels.cast_spec import CastSpec

from .base import QuantizedTensor
from .float8 import Float8CurrentScalingQuantizer, Float8Quantizer
from .float8_fsdp import max_over
from .float8_tensor import Float8Tensor
from .float8_tensor_te import as_fp8_bytes

__all__ = [
    "cast_master_weights_to_fp8",
    "post_all_gather_processing",
    "quantize_master_weights",
    "replace_raw_data",
]


def replace_raw_data(tensor: QuantizedTensor, new_raw_data: torch.Tensor) -> None:
    """Move the FP8 bytes of `tensor` (a Float8Tensor) into `new_raw_data`, keeping its value.

    new_raw_data: uint8 (or the tensor's FP8 dtype), contiguous, tensor.numel() elements (any
    shape), on the tensor's device; typically a slice of one buffer holding many parameters.
    The bytes are copied into it and it becomes the tensor's rowwise data (aliased: a later
    write into the buffer changes the tensor). The columnwise copy, equal bytes, is kept.
    """
    if not isinstance(tensor, Float8Tensor):
        raise ValueError(
            f"replace_raw_data: tensor must be a torchte Float8Tensor, got {type(tensor).__name__}"
        )
    storage = tensor._storage
    numel = tensor.numel()
    flat = as_fp8_bytes(new_raw_data, storage.fp8_dtype, numel, "new_raw_data", storage.device)
    if storage.rowwise_data is None:
        storage.update_usage(rowwise_usage=True)
    flat.view(torch.uint8).copy_(storage.rowwise_data.view(torch.uint8).view(-1))
    tensor._data = flat


@dataclass(slots=True)
class _Cast:
    """One parameter to update: its master slice (flat, in the parameter's nominal dtype; None
    where this rank holds none), where the slice starts in the flattened parameter, and the FP8
    bytes (flat view) it is cast into when they are not the parameter's (FSDP shards)."""

    weight: Float8Tensor
    quantizer: Float8Quantizer | Float8CurrentScalingQuantizer
    master: torch.Tensor | None = None
    start: int = 0
    shard: torch.Tensor | None = None

    def target(self) -> torch.Tensor:
        """The flat FP8 bytes the master slice is cast into."""
        if self.shard is not None:
            return self.shard
        storage = self.weight._storage
        if storage.rowwise_data is None:  # columnwise only: the bytes are written rowwise
            storage.update_usage(rowwise_usage=True)
        return storage.rowwise_data.view(-1)[self.start : self.start + self.master.numel()]


def quantize_master_weights(
    model_weights: Sequence[torch.Tensor],
    master_weights: Sequence[torch.Tensor | None],
    start_offsets: Sequence[int | None],
    group,
    fsdp_shard_model_weights: Sequence[torch.Tensor | None] | None = None,
    manual_post_all_gather_processing: bool = False,
) -> None:
    """Cast each rank's master-weight slices into its FP8 parameters (see the module docstring).

    model_weights: Float8Tensors (FP8 parameters), the same list on every rank of `group`.
    master_weights: per parameter, this rank's slice (any float dtype, numel elements, on the
    parameter's device), or None. start_offsets: per parameter, where the slice starts in the
    flattened parameter (None where the master is None). group: the data-parallel process group
    the amaxes are reduced over (None: the default group). fsdp_shard_model_weights: where the
    parameters are sharded (Megatron-FSDP), per parameter the tensor that holds this rank's
    bytes (a Float8Tensor, or uint8 / FP8 bytes of numel elements): the slice is written there
    instead of into the parameter. manual_post_all_gather_processing: keep the columnwise
    copies (the caller calls post_all_gather_processing after the all-gather); False drops
    them, to be made again when next needed. Every argument is checked before anything changes.
    """
    casts = _checked_casts(model_weights, master_weights, start_offsets, fsdp_shard_model_weights)
    for cast in casts:  # the master weights exist now: the initial values are not needed
        clear = getattr(cast.weight, "clear_high_precision_init_val", None)
        if clear is not None:
            clear()
    with torch.no_grad():
        delayed = [c for c in casts if isinstance(c.quantizer, Float8Quantizer)]
        current = [c for c in casts if isinstance(c.quantizer, Float8CurrentScalingQuantizer)]
        if delayed:
            _cast_delayed(delayed, group)
        if current:
            _cast_current(current, group)
        for cast in casts:
            if not manual_post_all_gather_processing:
                cast.weight._reset_caches()
            torch.autograd.graph.increment_version(cast.weight)


# Transformer Engine's older name of quantize_master_weights (the same arguments).
cast_master_weights_to_fp8 = quantize_master_weights


def post_all_gather_processing(model_weights: torch.Tensor | Sequence[torch.Tensor]) -> None:
    """After the FP8 bytes of `model_weights` (one tensor or a list) were all-gathered, make the
    transpose of each Float8Tensor from them (into its columnwise buffer where it has one, the
    address kept). Plain tensors: nothing to do."""
    if not isinstance(model_weights, list | tuple):
        model_weights = [model_weights]
    for i, weight in enumerate(model_weights):
        if isinstance(weight, Float8Tensor):
            weight._create_transpose()
        elif isinstance(weight, QuantizedTensor):
            raise ValueError(
                f"post_all_gather_processing: {type(weight).__name__} is not supported"
            )
        elif not isinstance(weight, torch.Tensor):
            raise TypeError(
                f"post_all_gather_processing: model_weights[{i}] must be a tensor, "
                f"got {type(weight).__name__}"
            )


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------


def _checked_casts(model_weights, master_weights, start_offsets, fsdp_shards) -> list[_Cast]:
    """The casts the arguments ask for, every one checked (nothing changed yet)."""
    lists = {"master_weights": master_weights, "start_offsets": start_offsets}
    if fsdp_shards is not None:
        lists["fsdp_shard_model_weights"] = fsdp_shards
    for name, values in lists.items():
        if len(values) != len(model_weights):
            raise ValueError(
                f"quantize_master_weights: {name} has {len(values)} entries, model_weights "
                f"{len(model_weights)}: one per model weight"
            )
    casts = []
    for i, weight in enumerate(model_weights):
        shard = None if fsdp_shards is None else fsdp_shards[i]
        casts.append(
            _checked_cast(i, weight, master_weights[i], start_offsets[i], fsdp_shards, shard)
        )
    return casts


def _checked_cast(i, weight, master, start, fsdp_shards, shard) -> _Cast:
    if not isinstance(weight, Float8Tensor):
        raise ValueError(
            f"quantize_master_weights: model_weights[{i}] must be a torchte Float8Tensor, "
            f"got {type(weight).__name__}"
        )
    quantizer = weight._get_quantizer()
    if not isinstance(quantizer, Float8Quantizer | Float8CurrentScalingQuantizer):
        raise ValueError(
            f"quantize_master_weights: model_weights[{i}] has a {type(quantizer).__name__}, "
            "which is not supported (delayed or current per-tensor scaling only)"
        )
    storage = weight._storage
    if quantizer.fp8_dtype != storage.fp8_dtype:
        raise ValueError(
            f"quantize_master_weights: model_weights[{i}]'s quantizer makes "
            f"{quantizer.fp8_dtype} but the tensor holds {storage.fp8_dtype}"
        )
    if master is None:
        return _Cast(weight, quantizer)
    if not isinstance(master, torch.Tensor) or not master.is_floating_point():
        raise TypeError(
            f"quantize_master_weights: master_weights[{i}] must be a floating-point tensor or "
            f"None, got {getattr(master, 'dtype', type(master).__name__)}"
        )
    if master.device != weight.device:
        raise ValueError(
            f"quantize_master_weights: master_weights[{i}] is on {master.device}, its model "
            f"weight on {weight.device}"
        )
    numel = master.numel()
    start = _checked_offset(i, start, numel, weight.numel())
    if fsdp_shards is not None:
        shard = _shard_bytes(i, shard, storage.fp8_dtype, numel, storage.device)
    master = master.detach().reshape(-1).to(weight.dtype)
    return _Cast(weight, quantizer, master, start, shard)


def _checked_offset(i: int, start, numel: int, weight_numel: int) -> int:
    """start_offsets[i] as an int, checked to place numel elements inside the weight."""
    if start is None:
        raise ValueError(
            f"quantize_master_weights: start_offsets[{i}] is None but master_weights[{i}] is "
            "given: the offset of the master slice in the flattened weight is needed"
        )
    try:
        start = operator.index(start)
    except TypeError:
        raise TypeError(
            f"quantize_master_weights: start_offsets[{i}] must be an int, got {start!r}"
        ) from None
    if start < 0 or start + numel > weight_numel:
        raise ValueError(
            f"quantize_master_weights: start_offsets[{i}] = {start} with a master of {numel} "
            f"elements must lie in [0, {weight_numel}] (model_weights[{i}]'s elements)"
        )
    return start


def _shard_bytes(i: int, shard, fp8_dtype: torch.dtype, numel: int, device) -> torch.Tensor:
    """The flat FP8 view of fsdp_shard_model_weights[i] (a Float8Tensor or its bytes)."""
    name = f"quantize_master_weights: fsdp_shard_model_weights[{i}]"
    if shard is None:
        raise ValueError(f"{name} is None but master_weights[{i}] is given")
    if isinstance(shard, Float8Tensor):
        if shard._storage.fp8_dtype != fp8_dtype:
            raise ValueError(f"{name} holds {shard._storage.fp8_dtype}, the weight {fp8_dtype}")
        if shard._storage.rowwise_data is None:
            raise ValueError(f"{name} has no rowwise data to write")
        shard = shard._storage.rowwise_data
    return as_fp8_bytes(shard, fp8_dtype, numel, name, device)


# ----------------------------------------------------------------------------------------------
# The casts
# ----------------------------------------------------------------------------------------------


def _write_slice(cast: _Cast, scale: torch.Tensor, amax: torch.Tensor) -> None:
    """Cast cast.master with `scale` (1,) into cast.target, max-accumulating its amax."""
    if cast.master is None or cast.master.numel() == 0:
        return
    spec = CastSpec(cast.quantizer.fp8_dtype, True, False, scale, amax)
    data, _, _ = ct.quantize(cast.master.view(1, -1), spec)
    cast.target().copy_(data.view(-1))


def _cast_delayed(casts: list[_Cast], group) -> None:
    """Delayed scaling: cast with each quantizer's scale, amaxes recorded then MAX-reduced over
    group, scale_inv = 1 / scale for every weight."""
    for cast in casts:
        _write_slice(cast, cast.quantizer.scale, cast.quantizer.amax)
    amaxes = [c.quantizer.amax for c in casts]
    packed = torch.cat(amaxes)
    max_over(group)(packed)
    torch._foreach_copy_(amaxes, list(packed.split(1)))
    scales = [c.quantizer.scale for c in casts]
    torch._foreach_copy_(
        [c.weight._storage.scale_inv for c in casts], torch._foreach_reciprocal(scales)
    )


def _cast_current(casts: list[_Cast], group) -> None:
    """Current scaling: each weight's amax over the slices of all ranks (one MAX all-reduce of
    one value per weight), its scale and scale_inv from that amax, then the casts."""
    device = casts[0].weight.device
    amaxes = torch.zeros(len(casts), dtype=torch.float32, device=device)
    for i, cast in enumerate(casts):
        if cast.master is not None:
            ct.record_amax(cast.master.view(1, -1), amaxes[i : i + 1])
    max_over(group)(amaxes)
    scales = torch.empty_like(amaxes)
    scale_invs = torch.empty_like(amaxes)
    by_setting = defaultdict(list)
    for i, cast in enumerate(casts):
        q = cast.quantizer
        by_setting[(q.fp8_dtype, q.amax_epsilon, q.power_2_scale)].append(i)
    for (fp8_dtype, eps, power_2), index in by_setting.items():
        index = torch.tensor(index, device=device)
        amax = amaxes[index]
        scale = ct.compute_scale_reference(amax, ct.FP8_MAX[fp8_dtype], eps, power_2)
        scales[index] = scale
        scale_invs[index] = ct.current_scale_inv_reference(amax, scale)
    targets = [c.weight._storage.scale_inv for c in casts]
    torch._foreach_copy_(targets, list(scale_invs.split(1)))
    scratch = torch.zeros(1, dtype=torch.float32, device=device)
    for i, cast in enumerate(casts):
        _write_slice(cast, scales[i : i + 1], scratch)
