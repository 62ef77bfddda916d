"""te.fsdp: FSDP2 (torch.distributed.fsdp.fully_shard) gathers torchte's GEMM weights in FP8.

`enable_fp8_all_gather(model)`, called before fully_shard, turns the weight of every GEMM of
the torchte modules in `model` into an `FP8GatheredWeight`: the same high-precision master
weight (the optimizer steps it, checkpoints hold it), whose FSDP2 shard is cast to FP8 e4m3
before the all-gather (torch's fsdp_pre_all_gather / fsdp_post_all_gather extension), so the
all-gather moves one byte per value instead of two or four. Every rank casts its shard with the
scale of the whole weight's amax, agreed over the data-parallel group; the gathered bytes
become the module's weight as a Float8Tensor, which the GEMM reads as it is (no dequantize and
requantize). `precompute_fp8_scales(model)` after each optimizer step agrees on the scales of
all weights with one all-reduce; a weight whose scale was not precomputed since it last changed
all-reduces its own amax in its all-gather. It also casts every weight's shard to FP8 right
there, all of them in one launch (kernels/multi_cast.py, after one launch for all their
amaxes): the all-gathers, in the forward and again in the backward, send those bytes without
a cast of their own. The bytes stay until the next call: one byte a parameter of the rank's
shard.

The gathered weight is FP8 for every forward, also outside te.autocast (then dequantized for
the high-precision GEMM), and under delayed scaling too (the weight's scale is then its own
amax's, not its amax history's). te.GroupedLinear casts the gathered weights again with its
grouped quantizer (the same bytes under current scaling). te.ops modules keep gathering in
high precision.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

from torchte.kernels import cast_transpose as ct
from torchte.kernels import multi_cast
from torchte.kernels.cast_spec import CastSpec
from torchte.quantization import float8_fsdp
from torchte.quantization.float8 import Float8CurrentScalingQuantizer
from torchte.quantization.float8_fsdp import max_over, pad_rows
from torchte.quantization.float8_tensor import Float8Tensor

__all__ = ["FP8GatheredWeight", "enable_fp8_all_gather", "precompute_fp8_scales"]

aten = torch.ops.aten
FP8_DTYPE = torch.float8_e4m3fn

# Ops whose results stay FP8-gathered weights: how FSDP2 makes, pads and views the shards, and
# how a copy or a move keeps one. Any other op sees the plain master weight.
_KEEP = {
    aten.alias.default,
    aten.as_strided.default,
    aten.clone.default,
    aten.copy_.default,
    aten.detach.default,
    aten.empty_like.default,
    aten.new_zeros.default,
    aten.slice.Tensor,
    aten.split.Tensor,
    aten.view.default,
    aten._pin_memory.default,
    aten._to_copy.default,
}


class _Scale:
    """The agreed scale of one weight ((1,) fp32 scale and scale_inv, views of
    precompute_fp8_scales' vectors), the shard's FP8 bytes cast with it (None where not cast
    in advance), and the master data version they were made for."""

    __slots__ = ("data", "scale", "scale_inv", "version")

    def __init__(self) -> None:
        self.scale: torch.Tensor | None = None
        self.scale_inv: torch.Tensor | None = None
        self.data: torch.Tensor | None = None
        self.version = -1


# The cast of a shard whose scale is not precomputed: the whole weight's amax (MAX over the
# ranks) makes it. Current scaling keeps no state: one quantizer serves every weight.
_QUANTIZER = Float8CurrentScalingQuantizer(FP8_DTYPE)
_GATHERED_QUANTIZER = Float8CurrentScalingQuantizer(FP8_DTYPE, internal=False)


class FP8GatheredWeight(torch.Tensor):
    """A high-precision master weight that FSDP2 gathers in FP8 (see the module docstring).
    Every op but FSDP2's sharding ones runs on the plain master tensor and returns plain
    tensors; in-place ones (the optimizer's) update it."""

    _data: torch.Tensor
    _scale: _Scale

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: _Scale | None = None) -> FP8GatheredWeight:
        tensor = torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            layout=data.layout,
            device=data.device,
            requires_grad=data.requires_grad,
        )
        tensor._data = data
        tensor._scale = scale if scale is not None else _Scale()
        return tensor

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"FP8GatheredWeight({self._data!r})"

    def __tensor_flatten__(self):
        return ["_data"], self._scale

    @staticmethod
    def __tensor_unflatten__(inner, scale, outer_size, outer_stride):
        return FP8GatheredWeight(inner["_data"], scale)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        plain_args, plain_kwargs = tree_map_only(cls, lambda t: t._data, (args, kwargs or {}))
        out = func(*plain_args, **plain_kwargs)
        if func not in _KEEP:
            return out
        scale = next(t._scale for t in tree_leaves((args, kwargs)) if isinstance(t, cls))
        return tree_map_only(torch.Tensor, lambda t: cls(t, scale), out)

    # -- FSDP2's all-gather extension --------------------------------------------------------

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """This rank's shard cast to FP8 (as uint8, padded to FSDP2's padded shard rows) with
        the scale of the whole weight's amax over the mesh's ranks, and that scale's inverse:
        the bytes precompute_fp8_scales cast (or a cast with its scale) unless the master
        changed since."""
        shard = self._data.reshape(-1, *outer_size[1:])
        agreed = self._scale
        if agreed.version == self._data._version:
            scale_inv, data = agreed.scale_inv, agreed.data
            if data is None and shard.numel():
                amax = torch.empty_like(agreed.scale)
                data = ct.quantize(shard, CastSpec(FP8_DTYPE, True, False, agreed.scale, amax))[0]
        else:
            reduce_max = max_over(mesh.get_group())
            data, _, scale_inv = _QUANTIZER._cast_agreed(shard, reduce_max, True, False)
        meta = (scale_inv, tuple(outer_size), FP8_DTYPE, _GATHERED_QUANTIZER)
        return (pad_rows(data, outer_size, mesh.size(), self.device),), meta

    # The gathered bytes become a Float8Tensor as an FP8 parameter's do.
    fsdp_post_all_gather = float8_fsdp.fsdp_post_all_gather


def _gemm_weights(model: nn.Module):
    """(module, parameter name) of each GEMM weight of the torchte modules in model."""
    from torchte.module.base import TransformerEngineBaseModule

    for module in model.modules():
        if isinstance(module, TransformerEngineBaseModule):
            for name, _gemm in module._fp8_weight_slots():
                if module._parameters.get(name) is not None:
                    yield module, name


def enable_fp8_all_gather(model: nn.Module) -> nn.Module:
    """Make every GEMM weight of the torchte modules in model an FP8GatheredWeight (in place;
    returns model). Call it before fully_shard. ValueError for an FP8 parameter (made under
    te.quantized_model_init: FSDP2 gathers those in FP8 already) or a weight that fully_shard
    already sharded."""
    from torch.distributed.tensor import DTensor

    for module, name in _gemm_weights(model):
        param = module._parameters[name]
        if isinstance(param, FP8GatheredWeight):
            continue
        if isinstance(param, (Float8Tensor, DTensor)):
            kind = "an FP8 parameter" if isinstance(param, Float8Tensor) else "already sharded"
            raise ValueError(
                f"enable_fp8_all_gather: {type(module).__name__}.{name} is {kind}; call it on "
                "a high-precision model before fully_shard"
            )
        weight = nn.Parameter(FP8GatheredWeight(param.detach()), requires_grad=param.requires_grad)
        for attr, value in vars(param).items():  # Megatron-style marks
            setattr(weight, attr, value)
        module.register_parameter(name, weight)
        module._parameters_replaced()
    return model


def precompute_fp8_scales(model: nn.Module) -> None:
    """Agree on the FP8 scale of every FP8GatheredWeight of model (after fully_shard, after an
    optimizer step) with one all-reduce of their amaxes over their data-parallel group, and
    cast their shards with it (all in one launch, see the module docstring), so the next
    all-gathers send those bytes."""
    shards, groups = [], set()
    for module, name in _gemm_weights(model):
        param = module._parameters[name]
        local = getattr(param, "_local_tensor", param)
        if isinstance(local, FP8GatheredWeight):
            shards.append(local)
            groups.add(param.device_mesh.get_group() if hasattr(param, "device_mesh") else None)
    if not shards:
        return
    if len(groups) != 1:
        raise ValueError(
            "precompute_fp8_scales: the weights are sharded over different groups; call it "
            "on each data-parallel group's part of the model"
        )
    datas = [s._data.detach() for s in shards]
    # One launch for all (fp32 or bf16 masters, contiguous) on a GPU; torch's ops elsewhere.
    dtypes = {d.dtype for d in datas}
    together = dtypes in ({torch.float32}, {torch.bfloat16})
    together = together and all(d.is_contiguous() for d in datas)
    cuda = datas[0].is_cuda
    if together:
        amaxes = (multi_cast.amaxes if cuda else multi_cast.amaxes_reference)(datas)
    else:
        amaxes = multi_cast.amaxes_reference([d.float().contiguous() for d in datas])
    max_over(groups.pop())(amaxes)
    scales = ct.compute_scale_reference(amaxes, ct.FP8_MAX[FP8_DTYPE], 0.0, False)
    # One row of 4 fp32 a weight: each scale (1,) starts 16-byte aligned, as cuBLAS's FP8
    # GEMM needs its scale pointers.
    table = torch.zeros(len(shards), 2, 4, dtype=torch.float32, device=amaxes.device)
    table[:, 0, 0], table[:, 1, 0] = scales, ct.current_scale_inv_reference(amaxes, scales)
    fp8 = [None] * len(shards)
    if together:
        cast = multi_cast.quantize if cuda else multi_cast.quantize_reference
        fp8 = cast(datas, scales, FP8_DTYPE)
    for i, shard in enumerate(shards):
        agreed = shard._scale
        agreed.scale, agreed.scale_inv = table[i, 0, :1], table[i, 1, :1]
        agreed.data = fp8[i]
        agreed.version = shard._data._version
