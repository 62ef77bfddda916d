"""Code the quantized storages and Tensor subclasses share.

- BlockQuantizerMixin: the usage setter, the Storage-or-Tensor output and the
  sequence-parallel gather (quantize_gathered) the block-scaled quantizers (blockwise, MXFP8,
  NVFP4) share.
- SavedTensorsStorage: a storage mixin whose data tensors are the slots named by `_SAVED`
  (Transformer Engine's saving order): num_rows, device, get_data_tensors, prepare_for_saving
  and restore_from_saved.
- written_args / run_dequantized / run_in_place: the __torch_dispatch__ fallbacks of a
  quantized Tensor subclass (Float8Tensor, BlockQuantizedTensor), parametrised by the class and
  its dequantizing function.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch.utils._pytree import tree_map_only

__all__ = [
    "BlockQuantizerMixin",
    "SavedTensorsStorage",
    "run_dequantized",
    "run_in_place",
    "written_args",
]


_FP8_BYTES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _te_name(slot: str) -> tuple:
    """(getter, setter) of Transformer Engine's `_<slot>` for a storage's slot: FP8 data is
    read as uint8 (as Transformer Engine holds it) and assigned as uint8 or FP8 (kept as FP8:
    the same memory); AttributeError where the storage has no such slot."""

    def get(self):
        value = getattr(self, slot)
        return value.view(torch.uint8) if _is_fp8(value) else value

    def set_(self, value) -> None:
        if isinstance(value, torch.Tensor) and value.dtype == torch.uint8:
            current = getattr(self, slot)
            if _is_fp8(current):
                value = value.view(current.dtype)
            elif current is None and slot.endswith("_data") and self.fp8_dtype in _FP8_BYTES:
                value = value.view(self.fp8_dtype)
        setattr(self, slot, value)

    get.__doc__ = f"The storage's {slot} (Transformer Engine's name; FP8 as uint8)."
    return get, set_


def _is_fp8(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype in _FP8_BYTES


class SavedTensorsStorage:
    """Mixin: a storage whose data tensors are the attributes named by `_SAVED`, in order."""

    __slots__ = ()
    _SAVED: ClassVar[tuple[str, ...]] = ()
    # What the device error says after "<class> holds no data ".
    _EMPTY_HINT: ClassVar[str] = "(emptied by prepare_for_saving?)"
    # The data tensors whose device is the storage's: all of `_SAVED` when None.
    _HELD: ClassVar[tuple[str, ...] | None] = None
    shape: tuple[int, ...]

    @property
    def num_rows(self) -> int:
        """prod(shape[:-1]): the rows of the value as a matrix (R of its rowwise operand)."""
        return math.prod(self.shape[:-1])

    @property
    def device(self) -> torch.device:
        """The device of the tensors it holds (RuntimeError when it holds none)."""
        for name in self._SAVED if self._HELD is None else self._HELD:
            tensor = getattr(self, name)
            if tensor is not None:
                return tensor.device
        raise RuntimeError(f"{type(self).__name__} holds no data {self._EMPTY_HINT}")

    # Transformer Engine's private names of the data (Megatron-Core reads and assigns them).
    _rowwise_data = property(*_te_name("rowwise_data"))
    _rowwise_scale_inv = property(*_te_name("rowwise_scale_inv"))
    _columnwise_data = property(*_te_name("columnwise_data"))
    _columnwise_scale_inv = property(*_te_name("columnwise_scale_inv"))
    _amax_rowwise = property(*_te_name("amax_rowwise"))
    _amax_columnwise = property(*_te_name("amax_columnwise"))

    @property
    def _fp8_dtype(self):
        """The stored values' dtype as Transformer Engine's DType tag."""
        from torchte.constants import TE_DType

        return TE_DType.get(self.fp8_dtype, self.fp8_dtype)

    @property
    def _is_2D_scaled(self) -> bool:
        """Whether the blocks are 128x128 (Float8BlockScaling's storage only)."""
        return self.is_2D_scaled

    @property
    def _with_gemm_swizzled_scales(self) -> bool:
        """Whether the scales are in the GEMM-swizzled layout (MXFP8's storage only)."""
        return self.with_gemm_swizzled_scales

    def get_data_tensors(self) -> tuple[torch.Tensor | None, ...]:
        """The data tensors, in the order of `_SAVED`."""
        return tuple(getattr(self, name) for name in self._SAVED)

    def prepare_for_saving(self) -> tuple[list[torch.Tensor | None], Any]:
        """Its data tensors (get_data_tensors' order), and itself emptied of them."""
        tensors = list(self.get_data_tensors())
        for name in self._SAVED:
            setattr(self, name, None)
        return tensors, self

    def restore_from_saved(self, tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Take back the data tensors of prepare_for_saving from the front; return the rest."""
        count = len(self._SAVED)
        for name, tensor in zip(self._SAVED, tensors[:count], strict=True):
            setattr(self, name, tensor)
        return tensors[count:]


@functools.cache
def written_args(func) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument func's schema marks as written (Tensor(a!))."""
    arguments = enumerate(func._schema.arguments)
    return tuple((i, a.name) for i, a in arguments if a.alias_info and a.alias_info.is_write)


def run_dequantized(cls: type, dequantize: Callable[[Any], torch.Tensor], func, args, kwargs):
    """Fallback: run func with each `cls` argument replaced by dequantize(it); plain results."""
    args = tree_map_only(cls, dequantize, args)
    kwargs = tree_map_only(cls, dequantize, kwargs)
    return func(*args, **kwargs)


def run_in_place(cls: type, dequantize: Callable[[Any], torch.Tensor], func, args, kwargs, written):
    """An op writing `cls` arguments: run on their dequantized values, then requantize each in
    place (`_requantize_`); arguments it writes that are plain tensors are written as usual;
    results that are the stand-ins of `cls` arguments are replaced by them."""
    args, kwargs = list(args), dict(kwargs)
    targets: list[tuple[Any, torch.Tensor]] = []

    def stand_in(value):
        if isinstance(value, cls):
            targets.append((value, dequantize(value)))
            return targets[-1][1]
        if isinstance(value, list | tuple):
            return type(value)(stand_in(v) for v in value)
        return value

    for position, name in written:
        if position < len(args):
            args[position] = stand_in(args[position])
        elif name in kwargs:
            kwargs[name] = stand_in(kwargs[name])
    out = run_dequantized(cls, dequantize, func, args, kwargs)
    for tensor, hp in targets:
        tensor._requantize_(hp)
    if not targets:
        return out
    originals = {id(hp): tensor for tensor, hp in targets}
    return tree_map_only(torch.Tensor, lambda t: originals.get(id(t), t), out)


class BlockQuantizerMixin:
    """Mixin of the block-scaled quantizers: rowwise_usage / columnwise_usage set by
    set_usage, what quantize returns (the Storage, or with internal=False its Tensor),
    quantize_gathered (sequence parallelism), and the delayed-scaling hooks they answer with
    nothing (every block's scale comes from its own values)."""

    __slots__ = ()

    def record_amax(self, x_hp: torch.Tensor) -> None:
        """Block scaling keeps no amax between calls: nothing to record."""

    def prime_scale(self, x_hp: torch.Tensor, fp8_max: float, margin: int) -> None:
        """Block scaling has no stored scale: nothing to prime."""

    def set_usage(self, *, rowwise: bool | None = None, columnwise: bool | None = None) -> None:
        """Set the copies quantize makes when not told; None leaves one as is."""
        if rowwise is not None:
            self.rowwise_usage = bool(rowwise)
        if columnwise is not None:
            self.columnwise_usage = bool(columnwise)

    def quantize_gathered(self, x_hp: torch.Tensor, reduce_max, gather, columnwise: bool):
        """Sequence parallelism: x_hp (S_l, ..., K) is this rank's piece along dim 0 of a
        tensor split over P ranks; the result is that whole tensor (P S_l, ..., K) as this
        format's Storage, each rank's rows cast here and the bytes and scales gathered
        (quantization/block_gather.py: where the blocks of the columnwise copy straddle the
        ranks' pieces, the input is gathered in high precision with a warning). reduce_max(t)
        all-reduces t in place with MAX over the ranks; gather(t) all-gathers t along dim 0."""
        from .block_gather import quantize_gathered  # block_gather imports the formats

        return quantize_gathered(self, x_hp, reduce_max, gather, columnwise)

    def _output(self, storage, dtype: torch.dtype):
        """`storage` as quantize returns it: itself (internal), else the Tensor of its format
        of nominal `dtype` holding this quantizer."""
        if self.internal:
            return storage
        from .block_tensor import block_tensor_class  # block_tensor imports the formats

        return block_tensor_class(storage).from_storage(storage, dtype, self)
