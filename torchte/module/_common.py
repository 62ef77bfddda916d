"""Pieces every module's autograd.Function uses: saving FP8 values, reaching main_grad, splits."""

from __future__ import annotations

import copy
import weakref
from collections.abc import Sequence

import torch

from torchte.gemm import fp32_mm
from torchte.offload import mark_not_offload
from torchte.quantization.base import QuantizedStorage
from torchte.quantization.float8 import Float8Storage

__all__ = [
    "MainGradTarget",
    "NoopCat",
    "absent_output",
    "given_grad",
    "restore_saved",
    "save_for_backward",
    "split_parameter_names",
    "stack_parameters",
    "stacked_view",
]


def save_for_backward(ctx, *values: torch.Tensor | QuantizedStorage | None) -> None:
    """Save tensors and quantized storages so that saved_tensors_hooks see every data tensor.

    A storage (any object with prepare_for_saving: Float8Storage, GroupedStorage) is saved as a
    shallow copy (the original, e.g. a cached FP8 weight, stays whole); its data tensors go
    through ctx.save_for_backward.
    """
    tensors: list[torch.Tensor | None] = []
    layout: list[QuantizedStorage | None] = []
    for value in values:
        if value is None or isinstance(value, torch.Tensor):
            tensors.append(value)
            layout.append(None)
        else:
            data, emptied = _shallow_copy(value).prepare_for_saving()
            tensors.extend(data)
            layout.append(emptied)
    ctx.save_for_backward(*tensors)
    ctx.saved_layout = layout


def _shallow_copy(storage: QuantizedStorage) -> QuantizedStorage:
    """A copy of storage sharing its data tensors."""
    if type(storage) is Float8Storage:
        # The hot path: the constructor costs a tenth of copy.copy.
        return Float8Storage(
            storage.rowwise_data,
            storage.columnwise_data,
            storage.scale_inv,
            storage.fp8_dtype,
            storage.shape,
        )
    if not hasattr(storage, "prepare_for_saving"):
        raise TypeError(
            f"save_for_backward: {type(storage).__name__} is neither a tensor nor a quantized "
            "storage (no prepare_for_saving)"
        )
    return copy.copy(storage)


def restore_saved(ctx) -> list[torch.Tensor | QuantizedStorage | None]:
    """The values given to save_for_backward, in order, storages refilled. Each storage is a
    fresh copy of the emptied one saved (which stays as it was: a backward run again, or traced
    by torch.compile, must not write to objects the forward made)."""
    tensors = list(ctx.saved_tensors)
    values: list[torch.Tensor | QuantizedStorage | None] = []
    for shell in ctx.saved_layout:
        if shell is None:
            values.append(tensors.pop(0))
        else:
            storage = _shallow_copy(shell)
            tensors = storage.restore_from_saved(tensors)
            values.append(storage)
    return values


def absent_output(like: torch.Tensor) -> torch.Tensor:
    """What a Function returns for an output it did not make this time (the norm's output where
    the norm wrote the GEMM's FP8 input): an empty 1-D tensor, never None, since torch.compile's
    trace of a backward takes every output's gradient as a tensor."""
    return like.new_empty(0)


def given_grad(grad: torch.Tensor | None) -> torch.Tensor | None:
    """The gradient of a Function output, or None where there is none: an unused output, or
    one that was an absent_output (a real output is never an empty 1-D tensor)."""
    return None if grad is None or grad.shape == (0,) else grad


class MainGradTarget:
    """Where a weight's gradient is accumulated with fuse_wgrad_accumulation (rule 9).

    Holds weakrefs to the weight parameter(s), so saved-tensor hooks that replace saved tensors
    cannot break it, and the row range of each parameter within the full weight.
    """

    __slots__ = ("_dummy", "parts")

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.parts = []
        start = 0
        for param in params:
            self.parts.append((weakref.ref(param), start, start + param.shape[0]))
            start += param.shape[0]
        self._dummy: torch.Tensor | None = None

    def params(self) -> list[tuple[torch.nn.Parameter, int, int]]:
        """(parameter, first row, end row) for each part; raises if a parameter is gone."""
        out = []
        for ref, start, end in self.parts:
            param = ref()
            if param is None:
                raise RuntimeError("the weight parameter was freed before its backward ran")
            if getattr(param, "main_grad", None) is None:
                raise RuntimeError(
                    "fuse_wgrad_accumulation=True needs weight.main_grad (an fp32 tensor of the "
                    "weight's shape) set before backward"
                )
            out.append((param, start, end))
        return out

    def finish(
        self, shape: torch.Size, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor | None:
        """After accumulating: mark the parameters and give autograd a grad for the weight.

        Where the parameters have `grad_added_to_main_grad`, it is set and a cached dummy
        tensor is returned (Megatron ignores .grad then); otherwise None (no .grad).
        """
        marked = False
        for param, _, _ in self.params():
            if hasattr(param, "grad_added_to_main_grad"):
                param.grad_added_to_main_grad = True
                marked = True
        if not marked:
            return None
        dummy = self._dummy
        if dummy is None or dummy.shape != shape or dummy.dtype != dtype:
            dummy = torch.empty(shape, dtype=dtype, device=device)
            self._dummy = dummy
        return dummy


def should_overwrite(param: torch.nn.Parameter, is_first_microbatch: bool | None) -> bool:
    """main_grad is overwritten (not added to) on the first microbatch or when asked."""
    return bool(is_first_microbatch) or bool(getattr(param, "overwrite_main_grad", False))


class NoopCat(torch.autograd.Function):
    """Concatenate parameters along dim 0; a view, not a copy, when they are adjacent in memory.

    Used for parameters_split, where the split parameters are views of one buffer.
    """

    @staticmethod
    def forward(ctx, *parts: torch.Tensor) -> torch.Tensor:
        ctx.set_materialize_grads(False)  # a None grad (fused wgrad) stays None per part
        ctx.sizes = [p.shape[0] for p in parts]
        first = parts[0]
        shape = (sum(ctx.sizes), *first.shape[1:])
        if _adjacent(parts):
            return first.as_strided(shape, _contiguous_strides(shape), first.storage_offset())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if grad is None:
            return (None,) * len(ctx.sizes)
        return tuple(grad.split(ctx.sizes))


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _adjacent(parts: Sequence[torch.Tensor]) -> bool:
    if type(parts[0]) is not torch.nn.Parameter and type(parts[0]) is not torch.Tensor:
        return False
    storage = parts[0].untyped_storage().data_ptr()
    expected = parts[0].data_ptr()
    for part in parts:
        if (
            not part.is_contiguous()
            or part.data_ptr() != expected
            or part.untyped_storage().data_ptr() != storage
        ):
            return False
        expected += part.numel() * part.element_size()
    return True


def split_parameter_names(
    parameters_split: Sequence[str] | dict[str, int] | None, size: int, what: str
) -> list[tuple[str, int]]:
    """[(name prefix, rows)] for Transformer Engine's parameters_split along dim 0.

    A sequence of names splits `size` evenly; a dict gives each name its size. Trailing
    underscores are stripped ("query_" -> "query").
    """
    if parameters_split is None:
        return [("", size)]
    if isinstance(parameters_split, dict):
        splits = [(name.rstrip("_"), int(rows)) for name, rows in parameters_split.items()]
    else:
        names = [name.rstrip("_") for name in parameters_split]
        if not names or size % len(names) != 0:
            raise ValueError(
                f"parameters_split with {len(names)} names cannot split {what}={size} evenly"
            )
        splits = [(name, size // len(names)) for name in names]
    if sum(rows for _, rows in splits) != size or any(rows <= 0 for _, rows in splits):
        raise ValueError(
            f"parameters_split sizes {[rows for _, rows in splits]} must be positive and sum "
            f"to {what}={size}"
        )
    if len({name for name, _ in splits}) != len(splits) or any(not n for n, _ in splits):
        raise ValueError(f"parameters_split names must be distinct and non-empty: {splits}")
    return splits


def stacked_view(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The (len(parts), *shape) tensor the equal-shaped contiguous `parts` form as consecutive
    blocks of memory (a view of the first one's storage, no copy), or None when they do not.
    Checked by addresses alone (cheap: it runs per call): memory at an address belongs to one
    allocation, and a view reaching past the first part's storage is refused by as_strided."""
    first = parts[0]
    shape, base = first.shape, first.data_ptr()
    step = first.numel() * first.element_size()
    for i, part in enumerate(parts):
        if part.data_ptr() != base + i * step or part.shape != shape or not part.is_contiguous():
            return None
    stacked_shape = (len(parts), *shape)
    try:
        return first.as_strided(
            stacked_shape, _contiguous_strides(stacked_shape), first.storage_offset()
        )
    except RuntimeError:
        return None


def stack_parameters(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """(len(parts), *shape): stacked_view where the parts are consecutive blocks of memory (as
    a grouped module's parameters are made; marked not to be offloaded, as the parameters it
    shows are not), else a stacked copy."""
    stacked = stacked_view(parts)
    if stacked is None:
        return torch.stack(list(parts))
    mark_not_offload(stacked)
    return stacked


_UNSAFE_VIEW = torch.ops.aten._unsafe_view.default


def as_output(y: torch.Tensor, shape) -> torch.Tensor:
    """A GEMM's output y (contiguous, its elements in `shape`'s order) as a module's output
    of `shape`: y itself when it has that shape, else a tensor on y's memory that autograd does
    not mark as a view (FSDP2 warns about module outputs that are views: an in-place op on one
    would drop its backward hooks)."""
    if y.shape == shape:
        return y
    return _UNSAFE_VIEW(y, shape)


def no_view(y: torch.Tensor) -> torch.Tensor:
    """An alias of y (contiguous) that autograd does not mark as a view (see as_output)."""
    return _UNSAFE_VIEW(y, y.shape)


def group_bias_rows(biases: Sequence[torch.Tensor], splits, dtype: torch.dtype) -> torch.Tensor:
    """(T, N) in dtype: row t holds the bias (N,) of its group (biases, one per group; splits a
    GroupSplits), to add to a grouped GEMM's output inside an autograd Function (the stacked
    view is not linked to the parameters in autograd); no host synchronization."""
    stacked = stack_parameters(biases)
    if stacked.dtype != dtype:
        stacked = stacked.to(dtype)
    return stacked.index_select(0, splits.row_groups())


def group_sums(dy: torch.Tensor, splits) -> torch.Tensor:
    """(G, N) fp32: the column sums of each group's rows of dy (T, N), splits a GroupSplits, as
    one GEMM with a one-hot (G, T) matrix: the same order every run, no atomics, no host
    synchronization."""
    one_hot = splits.one_hot(dy.dtype)
    if dy.is_cuda and dy.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(one_hot, dy, out_dtype=torch.float32)
    return fp32_mm(one_hot.float(), dy.float())
