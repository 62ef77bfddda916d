"""The Tensor forms of the block-scaled formats: Float8BlockwiseQTensor, MXFP8Tensor, NVFP4Tensor.

A BlockQuantizedTensor is a torch.Tensor wrapper subclass over a block-scaled Storage (the
contract in quantization/base.py): shape, device and nominal dtype (fp32 / bf16 / fp16) are the
value's, the bytes live in `_storage`. __torch_dispatch__, per kind of op:
- detach / alias / views keeping shape, strides and offset: a tensor over the same storage;
  other views (reshapes, slices, transposes) would change the blocking: plain dequantized copies.
- copy_ into one: a source of the same class laid out alike (data tensors of the same shapes and
  dtypes) is copied byte for byte, anything else requantized with `_quantizer`; in-place ops
  (add_, lerp_, ...: torch.optim's updates) run on the dequantized value, then requantize. Data
  tensors keep their addresses (CUDA graphs).
- clone copies the bytes; _to_copy moves them to another device, and to another float dtype
  only changes the nominal dtype; *_like / new_*: plain tensors; anything else: run on the
  dequantized values. Pickling (torch.save / torch.load, weights_only too) keeps the bytes, never
  dequantizing: the storage's slots, 1-byte floats (FP8, E8M0, FP4) as uint8 views (which plain
  pickle rebuilds), and the quantizer's settings where they are plain values (others: None).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from . import block_fsdp, block_state
from ._block_common import run_dequantized, run_in_place, written_args
from .base import QuantizedTensor, Quantizer

__all__ = [
    "BlockQuantizedTensor",
    "Float8BlockwiseQTensor",
    "MXFP8Tensor",
    "NVFP4Tensor",
    "block_tensor_class",
]

aten = torch.ops.aten
_TensorBase = torch._C.TensorBase
_NOMINAL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Subclass name -> class: what unpickling may rebuild (never a class named by the file).
_TENSOR_CLASSES: dict[str, type[BlockQuantizedTensor]] = {}


def _resolve(cls: type, kind: str) -> type:
    """cls's class of `kind` ("_storage" or "_quantizer"): its `{kind}_cls` attribute, else
    imported from its `{kind}_path` ("module:Class") and kept."""
    found = cls.__dict__.get(f"{kind}_cls")
    if found is None:
        module, name = getattr(cls, f"{kind}_path").split(":")
        found = getattr(importlib.import_module(module), name)
        setattr(cls, f"{kind}_cls", found)
    return found


def _te_storage_name(name: str, settable: bool = True) -> tuple:
    """(getter, setter) of a Tensor attribute that is its storage's attribute `name`."""

    def get(self):
        return getattr(self._storage, name)

    def set_(self, value) -> None:
        setattr(self._storage, name, value)

    get.__doc__ = f"The storage's {name} (Transformer Engine's name)."
    return (get, set_) if settable else (get,)


def _as_storage(value):
    """A quantizer's output as a Storage (internal=False quantizers give a tensor)."""
    return value._storage if isinstance(value, BlockQuantizedTensor) else value


def _same_layout(dst, src) -> bool:
    """Whether src holds each data tensor dst holds, of the same shape and dtype (so that
    copying the bytes is copying the value)."""
    pairs = zip(dst.get_data_tensors(), src.get_data_tensors(), strict=True)
    return all(
        x is None or (y is not None and (x.shape, x.dtype) == (y.shape, y.dtype)) for x, y in pairs
    )


def _usages(storage) -> tuple[bool, bool]:
    """Whether storage holds its (rowwise, columnwise) copies."""
    return storage.rowwise_data is not None, storage.columnwise_data is not None


def _plain_value(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """tensor's value as a plain tensor of dtype (quantized tensors dequantized, no autograd)."""
    if isinstance(tensor, QuantizedTensor):
        with torch.no_grad():
            return tensor.dequantize(dtype)
    return tensor


def _dequantized(storage, dtype: torch.dtype) -> torch.Tensor:
    """storage's value in dtype (any float dtype: others through fp32, exact for these formats)."""
    if dtype in _NOMINAL_DTYPES:
        return storage.dequantize(dtype)
    return storage.dequantize(torch.float32).to(dtype)


class _Dequantize(torch.autograd.Function):
    """BlockQuantizedTensor -> plain tensor of `dtype`; the gradient passes straight through."""

    @staticmethod
    def forward(ctx, tensor: BlockQuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.nominal_dtype = tensor.dtype
        return _dequantized(tensor._storage, dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.nominal_dtype), None


class BlockQuantizedTensor(QuantizedTensor):
    """A block-scaled value (a Storage of the subclass's format) seen by torch as a tensor of
    its nominal dtype (fp32 / bf16 / fp16), shape storage.shape, on storage.device.

    `_storage` holds the bytes; `_quantizer` requantizes in place (copy_, optimizer updates,
    quantize_, the `data` setter). Works as an nn.Parameter; gradients are plain tensors of the
    nominal dtype. Subclasses set `_storage_path` and `_quantizer_path` ("module:Class").
    """

    _storage_path: ClassVar[str] = ""
    _quantizer_path: ClassVar[str] = ""
    _storage: Any
    _quantizer: Quantizer | None

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        _TENSOR_CLASSES[cls.__name__] = cls

    @classmethod
    def storage_class(cls) -> type:
        """The Storage class this tensor wraps (imported on first use)."""
        return _resolve(cls, "_storage")

    @classmethod
    def quantizer_class(cls) -> type:
        """The Quantizer class of this format (imported on first use)."""
        return _resolve(cls, "_quantizer")

    @staticmethod
    def __new__(
        cls,
        storage: Any,
        dtype: torch.dtype,
        quantizer: Quantizer | None = None,
        requires_grad: bool = False,
    ) -> BlockQuantizedTensor:
        if not isinstance(storage, cls.storage_class()):
            raise TypeError(
                f"{cls.__name__}: storage must be a {cls.storage_class().__name__}, "
                f"got {type(storage).__name__}"
            )
        if dtype not in _NOMINAL_DTYPES:
            raise TypeError(f"{cls.__name__}: dtype must be fp32, bf16 or fp16, got {dtype}")
        tensor = _TensorBase._make_wrapper_subclass(
            cls, storage.shape, dtype=dtype, device=storage.device, requires_grad=requires_grad
        )
        tensor._storage = storage
        tensor._quantizer = quantizer
        return tensor

    @classmethod
    def from_storage(
        cls, storage: Any, dtype: torch.dtype, quantizer: Quantizer | None = None
    ) -> BlockQuantizedTensor:
        """Wrap `storage` (no copy) as a tensor of nominal `dtype`; shape storage.shape."""
        return cls(storage, dtype, quantizer)

    # FSDP2 shards and gathers block-scaled parameters as their bytes (block_fsdp.py).
    fsdp_pre_all_gather = block_fsdp.fsdp_pre_all_gather
    fsdp_post_all_gather = block_fsdp.fsdp_post_all_gather

    @property
    def fp8_dtype(self) -> torch.dtype:
        """The dtype of the stored values (the storage's fp8_dtype)."""
        return self._storage.fp8_dtype

    # Transformer Engine's private names (Megatron-Core reads and assigns them): the storage's.
    _rowwise_data = property(*_te_storage_name("_rowwise_data"))
    _rowwise_scale_inv = property(*_te_storage_name("_rowwise_scale_inv"))
    _columnwise_data = property(*_te_storage_name("_columnwise_data"))
    _columnwise_scale_inv = property(*_te_storage_name("_columnwise_scale_inv"))
    _fp8_dtype = property(*_te_storage_name("_fp8_dtype", settable=False))

    def _get_quantizer(self) -> Quantizer:
        """The quantizer that requantizes this tensor (RuntimeError when it has none)."""
        return self._require_quantizer()

    def update_usage(
        self, rowwise_usage: bool | None = None, columnwise_usage: bool | None = None
    ) -> None:
        """The storage's update_usage (make / drop the rowwise or columnwise copy)."""
        self._storage.update_usage(rowwise_usage=rowwise_usage, columnwise_usage=columnwise_usage)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The plain value, shape self.shape, in `dtype` (default: the nominal dtype).

        Differentiable: a gradient on the result flows to this tensor unchanged.
        """
        dtype = self.dtype if dtype is None else dtype
        if self.requires_grad and torch.is_grad_enabled():
            return _Dequantize.apply(self, dtype)
        return _dequantized(self._storage, dtype)

    def quantize_(self, src: torch.Tensor) -> BlockQuantizedTensor:
        """Requantize `src` (broadcastable to self.shape; plain or quantized) into self, keeping
        the addresses of the data tensors. Returns self."""
        with torch.no_grad():
            self._requantize_(src)
        torch.autograd.graph.increment_version(self)
        return self

    def _require_quantizer(self) -> Quantizer:
        if self._quantizer is None:
            raise RuntimeError(
                f"{type(self).__name__} has no quantizer to requantize with (set `_quantizer`, "
                "as a module built under quantized_model_init does)"
            )
        return self._quantizer

    def _requantize_(self, src: torch.Tensor) -> None:
        storage = self._storage
        if type(src) is type(self) and src.shape == self.shape and self._copy_bytes_(src._storage):
            return
        src = _plain_value(src, self.dtype).to(device=self.device, dtype=self.dtype)
        if src.shape != self.shape:
            src = src.expand(self.shape)
        rowwise, columnwise = _usages(storage)
        if not (rowwise or columnwise):
            raise RuntimeError(f"cannot requantize into {storage!r}: it holds no data")
        fresh = self._require_quantizer().quantize(
            src.contiguous(), rowwise=rowwise, columnwise=columnwise
        )
        storage.copy_from_(_as_storage(fresh))

    def _copy_bytes_(self, src) -> bool:
        """Copy src's bytes into self's storage, where they are laid out alike; False if not
        (then the caller requantizes src's value)."""
        (want_row, want_col), (has_row, has_col) = _usages(self._storage), _usages(src)
        make_row, make_col = want_row and not has_row, want_col and not has_col
        if make_row or make_col:  # on a shallow copy: the source is left as it was
            src = block_state.map_storage(src, lambda t: t)
            try:
                src.update_usage(rowwise_usage=make_row or None, columnwise_usage=make_col or None)
            except RuntimeError:  # not byte-exact in this format
                return False
        if not _same_layout(self._storage, src):
            return False
        self._storage.copy_from_(src)
        return True

    def _get_data(self) -> BlockQuantizedTensor:
        return _TensorBase.data.__get__(self, type(self))

    def _set_data(self, value: torch.Tensor) -> None:
        """`t.data = value`: self takes value's storage (anything else is quantized first)."""
        if type(value) is not type(self):
            hp = _plain_value(value, value.dtype).detach()
            with torch.no_grad():
                fresh = _as_storage(self._require_quantizer().quantize(hp))
            value = type(self).from_storage(fresh, hp.dtype, self._quantizer)
        if (value.shape, value.dtype, value.device) != (self.shape, self.dtype, self.device):
            # Change the wrapper's own metadata through torch's setter, then take the storage.
            meta = _TensorBase._make_wrapper_subclass(
                type(self), value.shape, dtype=value.dtype, device=value.device
            )
            _TensorBase.data.__set__(self, meta)
        self._storage = value._storage
        self._quantizer = value._quantizer

    data = property(_get_data, _set_data)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        grad = ", requires_grad=True" if self.requires_grad else ""
        return (
            f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"fp8_dtype={self._storage.fp8_dtype}, device={self.device}{grad}, "
            f"values={block_state.repr_values(self._storage)})"
        )

    def __reduce_ex__(self, protocol: int) -> tuple[Callable[..., BlockQuantizedTensor], tuple]:
        """Pickle the storage's attributes (bytes, not values) and the quantizer's settings."""
        quantizer = self._quantizer
        if quantizer is not None and type(quantizer) is not type(self).quantizer_class():
            quantizer = None
        args = (
            type(self).__name__,
            *block_state.pickled_storage(self._storage),
            self.dtype,
            self.requires_grad,
            bool(getattr(self, "_is_param", False)),
            None if quantizer is None else block_state.pickled_quantizer(quantizer),
        )
        return _rebuild_block_tensor, args

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


class Float8BlockwiseQTensor(BlockQuantizedTensor):
    """Float8BlockScaling's value (Float8BlockwiseQTensorStorage: 1x128 or 128x128 blocks)."""

    _storage_path = "torchte.quantization.blockwise:Float8BlockwiseQTensorStorage"
    _quantizer_path = "torchte.quantization.blockwise:Float8BlockQuantizer"
    _is_2D_scaled = property(*_te_storage_name("_is_2D_scaled", settable=False))


class MXFP8Tensor(BlockQuantizedTensor):
    """MXFP8BlockScaling's value (MXFP8TensorStorage: FP8 with an E8M0 scale per 32 values)."""

    _storage_path = "torchte.quantization.mxfp8:MXFP8TensorStorage"
    _quantizer_path = "torchte.quantization.mxfp8:MXFP8Quantizer"
    _with_gemm_swizzled_scales = property(
        *_te_storage_name("_with_gemm_swizzled_scales", settable=False)
    )


class NVFP4Tensor(BlockQuantizedTensor):
    """NVFP4BlockScaling's value (NVFP4TensorStorage: FP4 with an FP8 scale per 16 values)."""

    _storage_path = "torchte.quantization.nvfp4:NVFP4TensorStorage"
    _quantizer_path = "torchte.quantization.nvfp4:NVFP4Quantizer"
    _amax_rowwise = property(*_te_storage_name("_amax_rowwise"))
    _amax_columnwise = property(*_te_storage_name("_amax_columnwise"))


_FORMATS = (Float8BlockwiseQTensor, MXFP8Tensor, NVFP4Tensor)


def block_tensor_class(storage: Any) -> type[BlockQuantizedTensor] | None:
    """The Tensor class of a block-scaled Storage (Float8BlockwiseQTensor, MXFP8Tensor,
    NVFP4Tensor); None for any other value."""
    for cls in _FORMATS:
        # The name first: a format whose file is not imported yet cannot be this storage's.
        name = cls._storage_path.rpartition(":")[2]
        if type(storage).__name__ == name and type(storage) is cls.storage_class():
            return cls
    return None


def _rebuild_block_tensor(
    class_name: str,
    state: dict[str, Any],
    byte_dtypes: dict[str, torch.dtype],
    dtype: torch.dtype,
    requires_grad: bool,
    is_param: bool,
    quantizer_state: dict[str, Any] | None,
) -> BlockQuantizedTensor:
    """Unpickle a BlockQuantizedTensor: the bytes come back on the device they were saved from,
    as torch's own tensors do."""
    cls = _TENSOR_CLASSES.get(class_name)
    if cls is None:
        raise ValueError(f"unknown block-scaled tensor class {class_name!r}")
    storage = block_state.unpickled_storage(cls.storage_class(), state, byte_dtypes)
    quantizer = None
    if quantizer_state is not None:
        quantizer = block_state.build(cls.quantizer_class(), quantizer_state)
    tensor = cls(storage, dtype, quantizer, requires_grad=requires_grad)
    if is_param:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor


# torch.load defaults to weights_only=True, which rebuilds only allow-listed callables.
torch.serialization.add_safe_globals([_rebuild_block_tensor])


# -- __torch_dispatch__ handlers ----------------------------------------------------------------


def _dequantize_arg(tensor: BlockQuantizedTensor) -> torch.Tensor:
    return _dequantized(tensor._storage, tensor.dtype)


def _run_dequantized(func, args, kwargs):
    """Fallback: run func on the dequantized values; the results are plain tensors."""
    return run_dequantized(BlockQuantizedTensor, _dequantize_arg, func, args, kwargs)


def _run_in_place(func, args, kwargs, written):
    """An op writing BlockQuantizedTensor arguments: run on their dequantized values, then
    requantize each in place; results that are their stand-ins are replaced by them."""
    return run_in_place(BlockQuantizedTensor, _dequantize_arg, func, args, kwargs, written)


def _alias(tensor: BlockQuantizedTensor) -> BlockQuantizedTensor:
    return type(tensor).from_storage(tensor._storage, tensor.dtype, tensor._quantizer)


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
    if func is aten.split.Tensor:  # FSDP2's shards: pieces of whole blocks stay quantized
        dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
        pieces = block_fsdp.split_rows(self, args[1], dim)
        if pieces is not None:
            return pieces
    elif func is aten.view.default:
        flat = block_fsdp.flat_view(self, args[1])
        if flat is not None:
            return flat
    return _run_dequantized(func, args, kwargs)


def _handle_new_zeros(func, args, kwargs):
    """A tensor of the same class of zero bytes (FSDP2's padded shard: block_fsdp.new_zeros)
    where the size is whole blocks of its rows; else a plain tensor."""
    self = args[0]
    if kwargs.get("dtype", self.dtype) == self.dtype:
        zeros = block_fsdp.new_zeros(self, args[1])
        if zeros is not None:
            return zeros
    return _handle_like(func, args, kwargs)


def _handle_copy(func, args, kwargs):
    dst = args[0]
    if not isinstance(dst, BlockQuantizedTensor):
        return _run_dequantized(func, args, kwargs)
    dst._requantize_(args[1])
    return dst


def _handle_clone(func, args, kwargs):
    self = args[0]
    storage = block_state.map_storage(self._storage, torch.clone)
    return type(self).from_storage(storage, self.dtype, self._quantizer)


def _handle_to_copy(func, args, kwargs):
    """Another device moves the bytes; another floating dtype changes the nominal dtype only;
    any other dtype gives the plain dequantized tensor."""
    self = args[0]
    dtype = kwargs.get("dtype") or self.dtype
    if dtype not in _NOMINAL_DTYPES:
        return _run_dequantized(func, args, kwargs)
    device = kwargs.get("device")
    device = self.device if device is None else torch.device(device)
    non_blocking = bool(kwargs.get("non_blocking", False))
    storage = block_state.map_storage(
        self._storage, lambda t: t.to(device=device, non_blocking=non_blocking, copy=True)
    )
    return type(self).from_storage(storage, dtype, self._quantizer)


def _handle_like(func, args, kwargs):
    """empty_like, zeros_like, new_zeros, ...: only metadata is read, so skip dequantizing."""
    self = args[0]
    if isinstance(self, BlockQuantizedTensor):
        placeholder = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        args = (placeholder, *args[1:])
    return _run_dequantized(func, args, kwargs)


def _ops(names: str) -> list:
    """The aten overloads named "op.overload" in `names` (whitespace-separated)."""
    return [getattr(getattr(aten, n.split(".")[0]), n.split(".")[1]) for n in names.split()]


_HANDLERS: dict[Any, Callable] = {
    **dict.fromkeys(_ops("detach.default alias.default"), lambda func, args, kw: _alias(args[0])),
    aten.copy_.default: _handle_copy,
    aten.clone.default: _handle_clone,
    aten._to_copy.default: _handle_to_copy,
    **dict.fromkeys(
        _ops(
            "view.default _unsafe_view.default _reshape_alias.default expand.default "
            "slice.Tensor select.int as_strided.default squeeze.default squeeze.dim "
            "squeeze.dims unsqueeze.default permute.default transpose.int t.default split.Tensor"
        ),
        _handle_view,
    ),
    **dict.fromkeys(
        _ops(
            "empty_like.default zeros_like.default ones_like.default full_like.default "
            "rand_like.default randn_like.default new_empty.default new_empty_strided.default "
            "new_zeros.default new_ones.default new_full.default"
        ),
        _handle_like,
    ),
    aten.new_zeros.default: _handle_new_zeros,
}
