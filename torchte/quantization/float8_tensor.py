"""Float8Tensor: an FP8 value a user holds (FP8 parameters, FP8 outputs), as a torch.Tensor.

A Float8Tensor is a wrapper subclass over a Float8Storage: its shape, nominal dtype (the
high-precision dtype it stands for: fp32, bf16 or fp16) and device are those of the value; its
bytes live in the storage's data tensors. Modules read `_storage` directly and skip quantizing.

What __torch_dispatch__ does, per kind of op:
- detach / alias / a view that keeps shape and strides: a Float8Tensor over the same storage;
  view, slice and split whose result over the rowwise bytes is contiguous (how FSDP2 shards a
  parameter along its rows): a Float8Tensor over those bytes, with the same scale_inv; new_zeros:
  a Float8Tensor of zero bytes (float8_fsdp.py, which also has the FSDP2 all-gather hooks).
- copy_ into a Float8Tensor: requantize in place (an FP8 source of the same fp8 dtype is copied
  byte for byte, so checkpoints load exactly).
- any op that writes a Float8Tensor argument (add_, mul_, addcdiv_, lerp_, zero_, fill_, ...;
  found from the op's schema): run on the dequantized value, then requantize in place. This is
  how torch.optim updates FP8 parameters.
- _to_copy: a new dtype gives the plain dequantized tensor; a new device only, a Float8Tensor.
- clone: a Float8Tensor with copied data. Anything else: run on the dequantized values and
  return plain tensors.
In-place requantization keeps the address of every data tensor (CUDA graphs, cached weights).

Pickling (pickle, torch.save / torch.load with weights_only=True) saves the FP8 data as uint8
views (torch cannot pickle fp8 tensors by themselves), scale_inv, the metadata, and the
quantizer where it is plain metadata (current scaling). A delayed-scaling quantizer reads views
into its owner's scaling state, which a pickled tensor cannot keep shared: it comes back as
None (current scaling), and the owning module attaches its own again. copy.deepcopy keeps it.
`__tensor_flatten__` / `__tensor_unflatten__` make the class a traceable wrapper subclass
(torch.compile) on the same terms.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import MappingProxyType
from typing import Any, NamedTuple

import torch
from torch._subclasses.fake_tensor import is_fake

from . import float8_fsdp
from ._block_common import run_dequantized, run_in_place, written_args
from .base import QuantizedTensor, Quantizer
from .float8 import Float8CurrentScalingQuantizer, Float8Storage
from .float8_tensor_te import Float8TensorTENames, te_storage

__all__ = ["Float8Tensor"]

aten = torch.ops.aten
_TensorBase = torch._C.TensorBase
_REPR_VALUES = 6


def _repr_values(storage: Float8Storage) -> str:
    """The first few values; or why there are none: the data was emptied, or it has no values
    (meta tensors, or the fake tensors torch.compile traces with, which logging may print)."""
    data = [t for t in (storage.rowwise_data, storage.columnwise_data) if t is not None]
    if not data:
        return "<no data>"
    if any(t.is_meta or is_fake(t) for t in (*data, storage.scale_inv)):
        return "<not materialized>"
    flat = storage.dequantize(torch.float32).reshape(-1)
    shown = ", ".join(f"{v:.4g}" for v in flat[:_REPR_VALUES].tolist())
    return f"[{shown}{', ...' if flat.numel() > _REPR_VALUES else ''}]"


class _Dequantize(torch.autograd.Function):
    """Float8Tensor -> plain tensor of `dtype`; the gradient passes straight through."""

    @staticmethod
    def forward(ctx, tensor: Float8Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.nominal_dtype = tensor.dtype
        return tensor._storage.dequantize(dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.nominal_dtype), None


class Float8Tensor(Float8TensorTENames, QuantizedTensor):
    """An FP8 value (Float8Storage) seen by torch as a tensor of its nominal dtype.

    Shape is the storage's shape, dtype the nominal high-precision dtype (fp32/bf16/fp16),
    device the storage's device. `_storage` holds the FP8 bytes (rowwise (M, N) and/or
    columnwise (N, Mp) data, scale_inv (1,) fp32); `_quantizer` requantizes it in place (None:
    current scaling in the storage's fp8 dtype). Works as an nn.Parameter; gradients are plain
    tensors of the nominal dtype. Transformer Engine's private-named members (`_data`,
    `_transpose`, `make_like`, `_reset_caches`, ...) come from Float8TensorTENames.
    """

    _storage: Float8Storage
    _quantizer: Quantizer | None

    __torch_function__ = torch._C._disabled_torch_function_impl

    # FSDP2 shards and gathers FP8 parameters as FP8 bytes (float8_fsdp.py).
    fsdp_pre_all_gather = float8_fsdp.fsdp_pre_all_gather
    fsdp_post_all_gather = float8_fsdp.fsdp_post_all_gather

    @staticmethod
    def __new__(
        cls,
        storage: Float8Storage | None = None,
        dtype: torch.dtype | None = None,
        quantizer: Quantizer | None = None,
        requires_grad: bool = False,
        **te_arguments,
    ) -> Float8Tensor:
        """Float8Tensor(storage, dtype, quantizer=None, requires_grad=False); or Transformer
        Engine's form Float8Tensor(shape, dtype, *, data, fp8_scale_inv, fp8_dtype,
        data_transpose=None, quantizer=None, requires_grad=False, device=None) (te_storage)."""
        if te_arguments or not isinstance(storage, Float8Storage):
            shape = te_arguments.pop("shape", storage)
            fake_dtype = te_arguments.pop("fake_dtype", None)  # get_metadata's name of dtype
            dtype = fake_dtype if dtype is None else dtype
            storage = te_storage(shape, **te_arguments)
        if dtype is None:
            dtype = torch.float32
        tensor = _TensorBase._make_wrapper_subclass(
            cls, storage.shape, dtype=dtype, device=storage.device, requires_grad=requires_grad
        )
        tensor._storage = storage
        tensor._quantizer = quantizer
        return tensor

    @classmethod
    def from_storage(
        cls, storage: Float8Storage, dtype: torch.dtype, quantizer: Quantizer | None
    ) -> Float8Tensor:
        """Wrap `storage` (no copy) as a Float8Tensor of nominal `dtype`; shape storage.shape."""
        tensor = _TensorBase._make_wrapper_subclass(
            cls, storage.shape, dtype=dtype, device=storage.scale_inv.device
        )
        tensor._storage = storage
        tensor._quantizer = quantizer
        return tensor

    @property
    def fp8_dtype(self) -> torch.dtype:
        """The FP8 dtype of the data (torch.float8_e4m3fn or torch.float8_e5m2)."""
        return self._storage.fp8_dtype

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The plain value, shape self.shape, in `dtype` (default: the nominal dtype).

        Differentiable: a gradient on the result flows to this tensor unchanged.
        """
        dtype = self.dtype if dtype is None else dtype
        if self.requires_grad and torch.is_grad_enabled():
            return _Dequantize.apply(self, dtype)
        return self._storage.dequantize(dtype)

    def quantize_(
        self, src_hp: torch.Tensor, *, noop_flag: torch.Tensor | None = None
    ) -> Float8Tensor:
        """Requantize `src_hp` (broadcastable to self.shape; plain or Float8Tensor) into self.

        Uses self's quantizer (current scaling when it has none) and keeps the addresses of
        the data tensors. `noop_flag` (a one-element tensor): where it holds 1 nothing changes
        (update_quantized; a quantized source is dequantized first). Returns self.
        """
        if noop_flag is not None:
            self._get_quantizer().update_quantized(src_hp, self, noop_flag=noop_flag)
            return self
        with torch.no_grad():
            self._requantize_(src_hp)
        torch.autograd.graph.increment_version(self)
        return self

    def _requantize_(self, src: torch.Tensor) -> None:
        storage = self._storage
        if isinstance(src, Float8Tensor):
            if src._storage.fp8_dtype == storage.fp8_dtype and src.shape == self.shape:
                # Same format: copy the bytes (and scale_inv), so the value is kept exactly.
                src_storage = _with_usages_of(src._storage, storage)
                storage.copy_from_(src_storage)
                return
            src = src._storage.dequantize(self.dtype)
        src = src.to(device=self.device, dtype=self.dtype)
        if src.shape != self.shape:
            src = src.expand(self.shape)
        quantizer = self._quantizer
        if quantizer is None:
            quantizer = Float8CurrentScalingQuantizer(storage.fp8_dtype)
        elif quantizer.fp8_dtype != storage.fp8_dtype:
            raise ValueError(
                f"Float8Tensor quantizer makes {quantizer.fp8_dtype} but the tensor holds "
                f"{storage.fp8_dtype}"
            )
        fresh = quantizer.quantize(
            src,
            rowwise=storage.rowwise_data is not None,
            columnwise=storage.columnwise_data is not None,
        )
        storage.copy_from_(fresh._storage if isinstance(fresh, Float8Tensor) else fresh)

    def _get_data(self) -> Float8Tensor:
        return _TensorBase.data.__get__(self, type(self))

    def _set_data(self, value: torch.Tensor) -> None:
        """`t.data = value`: self takes value's storage (a plain value is quantized first)."""
        if not isinstance(value, Float8Tensor):
            quantizer = self._quantizer or Float8CurrentScalingQuantizer(self.fp8_dtype)
            with torch.no_grad():
                fresh = quantizer.quantize(value.detach())
            if not isinstance(fresh, Float8Tensor):
                fresh = Float8Tensor.from_storage(fresh, value.dtype, quantizer)
            value = fresh
        if (value.shape, value.dtype, value.device) != (self.shape, self.dtype, self.device):
            # Change the wrapper's own metadata through torch's setter, then take the storage.
            meta = _TensorBase._make_wrapper_subclass(
                Float8Tensor, value.shape, dtype=value.dtype, device=value.device
            )
            _TensorBase.data.__set__(self, meta)
        self._storage = value._storage
        self._quantizer = value._quantizer

    data = property(_get_data, _set_data)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        storage = self._storage
        grad = ", requires_grad=True" if self.requires_grad else ""
        return (
            f"Float8Tensor(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"fp8_dtype={storage.fp8_dtype}, device={self.device}{grad}, "
            f"values={_repr_values(storage)})"
        )

    # -- pickling and the traceable-subclass protocol -------------------------------------------

    @property
    def _rowwise_data(self) -> torch.Tensor | None:
        """The storage's rowwise data (M, N) fp8, or None (an inner tensor for torch.compile)."""
        return self._storage.rowwise_data

    @property
    def _columnwise_data(self) -> torch.Tensor | None:
        """The storage's columnwise data (N, Mp) fp8, or None."""
        return self._storage.columnwise_data

    @property
    def _scale_inv(self) -> torch.Tensor:
        """The storage's scale_inv (1,) fp32."""
        return self._storage.scale_inv

    def __reduce_ex__(self, protocol: int) -> tuple[Callable[..., Float8Tensor], tuple]:
        """Pickle the FP8 data as uint8 views (torch 2.13 cannot unpickle an fp8 tensor on its
        own), scale_inv, the metadata and the quantizer's settings (see _quantizer_spec)."""
        storage = self._storage
        args = (
            _as_bytes(storage.rowwise_data),
            _as_bytes(storage.columnwise_data),
            storage.scale_inv,
            storage.fp8_dtype,
            tuple(storage.shape),
            self.dtype,
            self.requires_grad,
            bool(getattr(self, "_is_param", False)),
            _quantizer_spec(self._quantizer),
        )
        return _rebuild_float8_tensor, args

    def __tensor_flatten__(self) -> tuple[list[str], Float8TensorMeta]:
        """The names of the inner tensors that are not None, and the metadata to rebuild (the
        quantizer only as its settings, and only where it has no state: see _quantizer_spec)."""
        names = [n for n in _INNER_TENSORS if getattr(self, n) is not None]
        meta = Float8TensorMeta(
            self.fp8_dtype, tuple(self._storage.shape), self.dtype, _quantizer_spec(self._quantizer)
        )
        return names, meta

    @staticmethod
    def __tensor_unflatten__(
        inner_tensors: dict[str, torch.Tensor],
        meta: Float8TensorMeta,
        outer_size: tuple[int, ...] | None,
        outer_stride: tuple[int, ...] | None,
    ) -> Float8Tensor:
        """A Float8Tensor over `inner_tensors` (keyed as __tensor_flatten__ names them)."""
        shape = meta.shape if outer_size is None else tuple(outer_size)
        storage = Float8Storage(
            inner_tensors.get("_rowwise_data"),
            inner_tensors.get("_columnwise_data"),
            inner_tensors["_scale_inv"],
            meta.fp8_dtype,
            shape,
        )
        return Float8Tensor.from_storage(storage, meta.dtype, _quantizer_from_spec(meta.quantizer))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = {} if kwargs is None else kwargs
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(func, args, kwargs)
        written = written_args(func)
        if written:
            return _run_in_place(func, args, kwargs, written)
        return _run_dequantized(func, args, kwargs)


_INNER_TENSORS = ("_rowwise_data", "_columnwise_data", "_scale_inv")


class Float8TensorMeta(NamedTuple):
    """What __tensor_flatten__ keeps beside the inner tensors: plain values that compare by
    value (torch.compile deep-copies this and guards on equality with the next input's)."""

    fp8_dtype: torch.dtype
    shape: tuple[int, ...]
    dtype: torch.dtype
    quantizer: tuple | None


def _quantizer_spec(quantizer: Quantizer | None) -> tuple | None:
    """A quantizer as plain values, where it is nothing but its settings (current scaling).

    A delayed-scaling Float8Quantizer gives None: its scale and amax are views into the owning
    module's DelayedScalingState. pickle saves each tensor's storage on its own, so a pickled
    copy would quantize with a private scale that never moves; and torch.compile deep-copies
    flatten metadata and guards on its equality, which an object holding tensors never meets.
    """
    if isinstance(quantizer, Float8CurrentScalingQuantizer):
        return (
            "current",
            quantizer.fp8_dtype,
            quantizer.power_2_scale,
            quantizer.amax_epsilon,
            quantizer.internal,
        )
    return None


def _quantizer_from_spec(spec: tuple | None) -> Quantizer | None:
    if spec is None:
        return None
    kind, fp8_dtype, power_2_scale, amax_epsilon, internal = spec
    if kind != "current":
        raise ValueError(f"unknown Float8Tensor quantizer kind {kind!r}")
    return Float8CurrentScalingQuantizer(
        fp8_dtype, power_2_scale=power_2_scale, amax_epsilon=amax_epsilon, internal=internal
    )


def _as_bytes(data: torch.Tensor | None) -> torch.Tensor | None:
    return None if data is None else data.view(torch.uint8)


def _from_bytes(data: torch.Tensor | None, fp8_dtype: torch.dtype) -> torch.Tensor | None:
    # Files written before the data was saved as bytes hold the fp8 tensors themselves.
    if data is None or data.dtype != torch.uint8:
        return data
    return data.view(fp8_dtype)


def _rebuild_float8_tensor(
    rowwise_bytes: torch.Tensor | None,
    columnwise_bytes: torch.Tensor | None,
    scale_inv: torch.Tensor,
    fp8_dtype: torch.dtype,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    requires_grad: bool,
    is_param: bool,
    quantizer_spec: tuple | None = None,
) -> Float8Tensor:
    """Unpickle a Float8Tensor: the data (uint8 views of the FP8 bytes) comes back on the
    device it was saved from, as torch's own tensors do; see _quantizer_spec for the quantizer.
    """
    storage = Float8Storage(
        _from_bytes(rowwise_bytes, fp8_dtype),
        _from_bytes(columnwise_bytes, fp8_dtype),
        scale_inv,
        fp8_dtype,
        shape,
    )
    quantizer = _quantizer_from_spec(quantizer_spec)
    tensor = Float8Tensor(storage, dtype, quantizer, requires_grad=requires_grad)
    if is_param:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor


# torch.load defaults to weights_only=True, which rebuilds only allow-listed callables.
torch.serialization.add_safe_globals([_rebuild_float8_tensor])


# ----------------------------------------------------------------------------------------------
# __torch_dispatch__ helpers
# ----------------------------------------------------------------------------------------------


def _map_storage(storage: Float8Storage, fn: Callable[[torch.Tensor], torch.Tensor]):
    """A new Float8Storage with fn applied to each data tensor (None stays None)."""
    row, col = storage.rowwise_data, storage.columnwise_data
    return Float8Storage(
        None if row is None else fn(row),
        None if col is None else fn(col),
        fn(storage.scale_inv),
        storage.fp8_dtype,
        storage.shape,
    )


def _with_usages_of(src: Float8Storage, dst: Float8Storage) -> Float8Storage:
    """src, or a shallow copy of it that also has every usage (rowwise/columnwise) dst has."""
    need_row = dst.rowwise_data is not None and src.rowwise_data is None
    need_col = dst.columnwise_data is not None and src.columnwise_data is None
    if not (need_row or need_col):
        return src
    copy = Float8Storage(
        src.rowwise_data, src.columnwise_data, src.scale_inv, src.fp8_dtype, src.shape
    )
    copy.update_usage(rowwise_usage=need_row or None, columnwise_usage=need_col or None)
    return copy


def _dequantize_arg(tensor: Float8Tensor) -> torch.Tensor:
    return tensor._storage.dequantize(tensor.dtype)


# grouped.py imports it under this name.
_written_args = written_args


def _run_dequantized(func, args, kwargs):
    """Fallback: run func on the dequantized values; the results are plain tensors."""
    return run_dequantized(Float8Tensor, _dequantize_arg, func, args, kwargs)


def _run_in_place(func, args, kwargs, written):
    """An op that writes Float8Tensor arguments: run on their dequantized values, requantize.

    Arguments it writes that are plain tensors are written as usual; returned values that are
    the stand-ins of Float8Tensors are replaced by those Float8Tensors.
    """
    return run_in_place(Float8Tensor, _dequantize_arg, func, args, kwargs, written)


def _alias(tensor: Float8Tensor) -> Float8Tensor:
    return Float8Tensor.from_storage(tensor._storage, tensor.dtype, tensor._quantizer)


def _handle_alias(func, args, kwargs):
    return _alias(args[0])


def _handle_view(func, args, kwargs):
    """A view op: an alias when it keeps shape, strides and offset; else the plain result."""
    self = args[0]
    meta = torch.empty_strided(self.shape, self.stride(), dtype=self.dtype, device="meta")
    out = func(meta, *args[1:], **kwargs)
    if (
        isinstance(out, torch.Tensor)
        and out.shape == self.shape
        and out.stride() == self.stride()
        and out.storage_offset() == 0
    ):
        return _alias(self)
    if func in _RESHAPES and isinstance(out, torch.Tensor) and out.dim() > 0:
        return _reshaped(self, tuple(out.shape))
    if func in _ROW_VIEWS:
        rows = float8_fsdp.row_view(self, func, args, kwargs)
        if rows is not None:
            return rows
    return _run_dequantized(func, args, kwargs)


def _reshaped(self: Float8Tensor, shape: tuple[int, ...]) -> Float8Tensor:
    """self seen in another shape of as many values (view, reshape), as Transformer Engine
    does: a Float8Tensor over the same bytes and scale_inv; the columnwise copy kept where
    the last dim is unchanged (its (N, Mp) layout is the same), dropped otherwise."""
    storage = self._storage
    same_last = shape[-1] == storage.shape[-1]
    row, col = storage.rowwise_data, storage.columnwise_data if same_last else None
    if row is None and col is None:
        raise NotImplementedError(
            f"Float8Tensor of shape {tuple(storage.shape)} holds only its columnwise (transposed) "
            f"bytes, which have no layout for shape {shape}: make the rowwise copy first "
            "(update_usage(rowwise_usage=True))"
        )
    if row is not None:
        row = row.view(math.prod(shape[:-1]), shape[-1])
    view = Float8Storage(row, col, storage.scale_inv, storage.fp8_dtype, shape)
    return Float8Tensor.from_storage(view, self.dtype, self._quantizer)


# The views that only reshape: _reshaped.
_RESHAPES = frozenset((aten.view.default, aten._unsafe_view.default, aten._reshape_alias.default))

# Views whose result, where contiguous, is a Float8Tensor over the rowwise bytes (how FSDP2
# shards a parameter: float8_fsdp.py).
_ROW_VIEWS = frozenset((aten.view.default, aten.slice.Tensor, aten.split.Tensor))


def _handle_new_zeros(func, args, kwargs):
    """A Float8Tensor of zero bytes (float8_fsdp.new_zeros) in the same nominal dtype; else the
    plain tensor."""
    self, size = args[0], args[1]
    if kwargs.get("dtype", self.dtype) == self.dtype and self._storage.rowwise_data is not None:
        return float8_fsdp.new_zeros(self, size)
    return _handle_like(func, args, kwargs)


def _handle_copy(func, args, kwargs):
    dst = args[0]
    if not isinstance(dst, Float8Tensor):
        return _run_dequantized(func, args, kwargs)
    dst._requantize_(args[1])
    return dst


def _handle_clone(func, args, kwargs):
    self = args[0]
    storage = _map_storage(self._storage, torch.clone)
    return Float8Tensor.from_storage(storage, self.dtype, self._quantizer)


def _handle_to_copy(func, args, kwargs):
    """A new dtype: the plain dequantized tensor; otherwise a Float8Tensor copy (maybe moved)."""
    self = args[0]
    dtype = kwargs.get("dtype")
    if dtype is not None and dtype != self.dtype:
        return _run_dequantized(func, args, kwargs)
    device = kwargs.get("device")
    device = self.device if device is None else torch.device(device)
    non_blocking = bool(kwargs.get("non_blocking", False))
    storage = _map_storage(
        self._storage, lambda t: t.to(device=device, non_blocking=non_blocking, copy=True)
    )
    return Float8Tensor.from_storage(storage, self.dtype, self._quantizer)


def _handle_like(func, args, kwargs):
    """empty_like, zeros_like, new_zeros, ...: only metadata is read, so skip dequantizing."""
    self = args[0]
    if isinstance(self, Float8Tensor):
        placeholder = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        args = (placeholder, *args[1:])
    return _run_dequantized(func, args, kwargs)


def _build_handlers() -> MappingProxyType:
    handlers: dict[Any, Callable] = {
        aten.detach.default: _handle_alias,
        aten.alias.default: _handle_alias,
        aten.copy_.default: _handle_copy,
        aten.clone.default: _handle_clone,
        aten._to_copy.default: _handle_to_copy,
    }
    views = (
        aten.view.default,
        aten._unsafe_view.default,
        aten._reshape_alias.default,
        aten.expand.default,
        aten.slice.Tensor,
        aten.as_strided.default,
        aten.squeeze.default,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.permute.default,
        aten.transpose.int,
        aten.t.default,
        aten.split.Tensor,
    )
    likes = (
        aten.empty_like.default,
        aten.zeros_like.default,
        aten.ones_like.default,
        aten.full_like.default,
        aten.rand_like.default,
        aten.randn_like.default,
        aten.new_empty.default,
        aten.new_empty_strided.default,
        aten.new_zeros.default,
        aten.new_ones.default,
        aten.new_full.default,
    )
    handlers.update(dict.fromkeys(views, _handle_view))
    handlers.update(dict.fromkeys(likes, _handle_like))
    handlers[aten.new_zeros.default] = _handle_new_zeros
    return MappingProxyType(handlers)


_HANDLERS = _build_handlers()
