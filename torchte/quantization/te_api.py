"""Transformer Engine 2.x's quantizer API over torchte's quantizers (what
`transformer_engine.pytorch.quantized_tensor` and `.tensor.float8_tensor` hand out, and the
top-level `te.Float8Quantizer`, ...).

- `Float8Quantizer`, `Float8CurrentScalingQuantizer`, `Float8BlockQuantizer`,
  `MXFP8Quantizer`, `NVFP4Quantizer`: torchte's quantizers with Transformer Engine's defaults:
  `internal=False`, so `q(x)` gives a quantized Tensor. Any torchte quantizer of the same kind
  passes `isinstance` against them (a module's quantizers, a tensor's `_quantizer`): they are
  the same quantizers, made with other defaults.
- `QuantizedTensorStorage`: what `isinstance` tells of any quantized value, a Storage or a
  QuantizedTensor. `Float8TensorStorage` is torchte's Float8Storage; the block formats'
  Storages keep their names.
- `prepare_for_saving` / `restore_from_saved` / `restore_from_func_ctx`: saving a mix of tensors
  and Storages through `ctx.save_for_backward`, in Transformer Engine's order.
- `QuantizerRole`: the name of the tensor a quantizer is asked for (module type, tensor type,
  module instance name), as custom-recipe factories receive it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import blockwise, float8, mxfp8, nvfp4
from .base import QuantizedStorage, QuantizedTensor, Quantizer
from .blockwise import Float8BlockwiseQTensorStorage
from .float8 import Float8Storage
from .mxfp8 import MXFP8TensorStorage
from .nvfp4 import NVFP4TensorStorage

__all__ = [
    "Float8BlockQuantizer",
    "Float8BlockwiseQTensorStorage",
    "Float8CurrentScalingQuantizer",
    "Float8Quantizer",
    "Float8TensorStorage",
    "MXFP8Quantizer",
    "MXFP8TensorStorage",
    "NVFP4Quantizer",
    "NVFP4TensorStorage",
    "QuantizedTensorStorage",
    "Quantizer",
    "QuantizerRole",
    "prepare_for_saving",
    "restore_from_func_ctx",
    "restore_from_saved",
]

Float8TensorStorage = Float8Storage


class _SameQuantizer(type):
    """Metaclass of a class that only changes the constructor defaults of its base: isinstance
    and issubclass against it answer as against the base."""

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, cls.__mro__[1])

    def __subclasscheck__(cls, sub) -> bool:
        return issubclass(sub, cls.__mro__[1])


class Float8Quantizer(float8.Float8Quantizer, metaclass=_SameQuantizer):
    """Delayed scaling with Transformer Engine's constructor: scale and amax one-element fp32
    tensors read and written in place, fp8_dtype a DType tag or torch FP8 dtype; q(x) gives a
    Float8Tensor unless `internal` is set."""

    __slots__ = ()

    def __init__(
        self,
        scale: torch.Tensor,
        amax: torch.Tensor,
        fp8_dtype,
        *,
        rowwise: bool = True,
        columnwise: bool = True,
        internal: bool = False,
    ) -> None:
        super().__init__(scale, amax, fp8_dtype, internal, rowwise=rowwise, columnwise=columnwise)


class Float8CurrentScalingQuantizer(float8.Float8CurrentScalingQuantizer, metaclass=_SameQuantizer):
    """Current scaling with Transformer Engine's constructor `(fp8_dtype, device, *, rowwise,
    columnwise, with_amax_reduction, amax_reduction_group, force_pow_2_scales, amax_epsilon,
    ...)`; q(x) gives a Float8Tensor unless `internal` is set."""

    __slots__ = ()

    def __init__(self, fp8_dtype, device=None, *, internal: bool = False, **options) -> None:
        super().__init__(fp8_dtype, device, internal=internal, **options)


class Float8BlockQuantizer(blockwise.Float8BlockQuantizer, metaclass=_SameQuantizer):
    """Float8BlockScaling's quantizer with Transformer Engine's constructor `(fp8_dtype, *,
    rowwise, columnwise, amax_epsilon=0.0, force_pow_2_scales=True, block_scaling_dim=2,
    all_gather_usage=False)`; q(x) gives a Float8BlockwiseQTensor unless `internal` is set."""

    __slots__ = ()

    def __init__(self, fp8_dtype, *, internal: bool = False, **options) -> None:
        super().__init__(fp8_dtype, internal=internal, **options)


class MXFP8Quantizer(mxfp8.MXFP8Quantizer, metaclass=_SameQuantizer):
    """MXFP8's quantizer with Transformer Engine's constructor `(fp8_dtype, *, rowwise=True,
    columnwise=True, with_2d_quantization=False)`; q(x) gives an MXFP8Tensor unless
    `internal` is set."""

    __slots__ = ()

    def __init__(self, fp8_dtype, *, internal: bool = False, **options) -> None:
        super().__init__(fp8_dtype, internal=internal, **options)


class NVFP4Quantizer(nvfp4.NVFP4Quantizer, metaclass=_SameQuantizer):
    """NVFP4's quantizer with Transformer Engine's constructor `(fp4_dtype, rowwise,
    columnwise, with_amax_reduction, amax_reduction_group, with_rht, with_post_rht_amax,
    with_2d_quantization, stochastic_rounding, ...)`; q(x) gives an NVFP4Tensor unless
    `internal` is set."""

    __slots__ = ()

    def __init__(self, *args, internal: bool = False, **options) -> None:
        super().__init__(*args, internal=internal, **options)


class _AnyQuantizedValue(type):
    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, QuantizedTensor | QuantizedStorage)


class QuantizedTensorStorage(metaclass=_AnyQuantizedValue):
    """`isinstance(x, QuantizedTensorStorage)`: x is a quantized value, a torchte Storage
    (Float8Storage, the block formats' storages, GroupedStorage) or a QuantizedTensor."""

    __slots__ = ()

    def __new__(cls, *args, **kwargs):
        raise TypeError(
            "QuantizedTensorStorage is not made directly: a quantizer makes Storages "
            "(internal=True) and QuantizedTensors"
        )


@dataclass(frozen=True)
class QuantizerRole:
    """Which tensor a quantizer is asked for: `module_type` ("linear", "grouped_linear",
    "dpa", ...), `tensor_type` ("input", "weight", "grad_output", ...) and `name` (the module
    instance's, given by the framework); an empty string where not known."""

    module_type: str = ""
    tensor_type: str = ""
    name: str = ""

    def __str__(self) -> str:
        parts = [f"{field}={value}" for field, value in self._fields() if value]
        return "|".join(parts) if parts else "QuantizerRole()"

    def _fields(self) -> tuple[tuple[str, str], ...]:
        return (
            ("module_type", self.module_type),
            ("tensor_type", self.tensor_type),
            ("name", self.name),
        )


def prepare_for_saving(*values) -> tuple[list, list]:
    """(tensors to hand to ctx.save_for_backward, objects): a tensor or None is kept as is (its
    object None); a Storage gives its data tensors and itself emptied (the object that
    restore_from_saved refills)."""
    tensors: list[torch.Tensor | None] = []
    objects: list = []
    for value in values:
        if value is None or isinstance(value, torch.Tensor):
            tensors.append(value)
            objects.append(None)
        else:
            data, emptied = value.prepare_for_saving()
            tensors.extend(data)
            objects.append(emptied)
    return tensors, objects


def restore_from_saved(objects: list, saved_tensors, return_saved_tensors: bool = False):
    """The values given to prepare_for_saving, in order: where `objects` holds None the next
    saved tensor, else that Storage refilled from the saved tensors. With return_saved_tensors,
    also the saved tensors left over."""
    saved = list(saved_tensors)
    values = []
    for obj in objects:
        if obj is None or isinstance(obj, torch.Tensor):
            values.append(saved.pop(0))
        else:
            saved = obj.restore_from_saved(saved)
            values.append(obj)
    return (values, saved) if return_saved_tensors else values


def restore_from_func_ctx(ctx, return_saved_tensors: bool = False):
    """restore_from_saved(ctx.tensor_objects, ctx.saved_tensors), then ctx.tensor_objects set
    to None (the Storages are not kept alive by the context). AttributeError without them."""
    objects = getattr(ctx, "tensor_objects", None)
    if objects is None:
        raise AttributeError("restore_from_func_ctx: ctx has no tensor_objects to restore")
    values = restore_from_saved(objects, ctx.saved_tensors, return_saved_tensors)
    ctx.tensor_objects = None
    return values
