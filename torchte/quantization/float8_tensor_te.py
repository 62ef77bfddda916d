"""Transformer Engine's private-named members of Float8Tensor, which clients reach directly.

Megatron-Core (the distributed optimizer with --fp8-param-gather, Megatron-FSDP) and
Transformer Engine's own `tensor.utils` (torchte's `quantization/param_utils.py`) read and write
an FP8 parameter through these names: `_data` (the rowwise FP8 bytes as uint8, also assigned to
move them into a client's buffer), `_transpose`, `_get_quantizer()`, `update_usage()`,
`_reset_caches()` / `remove_caches()` (drop a transpose that a write to the bytes made stale),
`_create_transpose()` (make it again, in place), the classmethod `make_like()`, and `_fp8_dtype`
(the DType tag). `te_storage` reads the arguments of Transformer Engine's constructor
`Float8Tensor(shape, dtype, *, data, fp8_scale_inv, fp8_dtype, data_transpose, quantizer,
requires_grad, device)`.

Float8Tensor inherits them from `Float8TensorTENames`; they act on its `_storage`
(a Float8Storage: rowwise (M, N), columnwise (N, Mp) with Mp = M rounded up to 16, zero
padding, and scale_inv (1,) fp32).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from torchte._sizes import round_up
from torchte.constants import TE_DType
from torchte.kernels.cast_transpose import COLUMNWISE_ALIGN

from .base import Quantizer
from .float8 import Float8CurrentScalingQuantizer, Float8Storage, fp8_torch_dtype

__all__ = ["Float8TensorTENames", "as_fp8_bytes", "columnwise_of", "te_storage"]

_NOMINAL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def as_fp8_bytes(
    data: torch.Tensor, fp8_dtype: torch.dtype, numel: int, name: str, device: torch.device
) -> torch.Tensor:
    """`data` (uint8, or `fp8_dtype`; contiguous; `numel` elements; on `device`) as a flat
    `fp8_dtype` view of the same memory (detached). ValueError / TypeError naming `name` and
    the rule."""
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(data).__name__}")
    if data.device != device:
        raise ValueError(f"{name} must be on {device} (the tensor's device), got {data.device}")
    if data.dtype not in (torch.uint8, fp8_dtype):
        raise ValueError(
            f"{name} must hold the FP8 bytes as torch.uint8 (or {fp8_dtype}), got {data.dtype}"
        )
    if data.numel() != numel:
        raise ValueError(f"{name} must have {numel} elements, got {data.numel()}")
    if not data.is_contiguous():
        raise ValueError(f"{name} must be contiguous (its memory becomes the FP8 data)")
    return data.detach().view(fp8_dtype).view(-1)


def columnwise_of(
    transpose: torch.Tensor,
    fp8_dtype: torch.dtype,
    rows: int,
    cols: int,
    name: str = "make_like: data_transpose",
) -> torch.Tensor:
    """A transpose (N, M) (or already padded (N, Mp)), uint8 or FP8, as columnwise data
    (N, Mp): the same memory where it is contiguous with Mp columns, else a zero-padded copy.
    ValueError naming `name` otherwise."""
    rows_p = round_up(rows, COLUMNWISE_ALIGN)
    if not isinstance(transpose, torch.Tensor) or transpose.dtype not in (torch.uint8, fp8_dtype):
        raise ValueError(
            f"{name} must be torch.uint8 (or {fp8_dtype}), got "
            f"{getattr(transpose, 'dtype', type(transpose).__name__)}"
        )
    shape = tuple(transpose.shape)
    if shape not in ((cols, rows), (cols, rows_p)):
        raise ValueError(
            f"{name} must have shape ({cols}, {rows}) (or ({cols}, {rows_p}) padded), got {shape}"
        )
    transpose = transpose.detach()
    if shape[1] == rows_p and transpose.is_contiguous():
        return transpose.view(fp8_dtype)
    padded = torch.zeros(cols, rows_p, dtype=torch.uint8, device=transpose.device)
    padded[:, :rows] = transpose.view(torch.uint8)[:, :rows]
    return padded.view(fp8_dtype)


def te_storage(
    shape: Sequence[int],
    *,
    data: torch.Tensor | None = None,
    fp8_scale_inv: torch.Tensor,
    fp8_dtype=torch.float8_e4m3fn,
    data_transpose: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> Float8Storage:
    """The Float8Storage of Transformer Engine's Float8Tensor constructor arguments: `data`
    (uint8 or FP8, contiguous, prod(shape) values) the rowwise bytes, aliased;
    `data_transpose` ((N, M), (N, *shape[:-1]) or padded (N, Mp)) the columnwise ones;
    `fp8_scale_inv` a one-element fp32 tensor (kept, not copied); `fp8_dtype` a DType tag or
    torch FP8 dtype. ValueError / TypeError naming the argument."""
    if shape is None:
        raise TypeError("Float8Tensor: shape is required (or a Float8Storage as first argument)")
    shape = tuple(int(s) for s in (shape if isinstance(shape, Sequence) else [shape]))
    if not shape:
        raise ValueError("Float8Tensor: shape must have at least one dim")
    fp8_dtype = fp8_torch_dtype(fp8_dtype)
    if not isinstance(fp8_scale_inv, torch.Tensor) or fp8_scale_inv.numel() != 1:
        raise ValueError("Float8Tensor: fp8_scale_inv must be a one-element float32 tensor")
    if fp8_scale_inv.dtype != torch.float32:
        raise ValueError(f"Float8Tensor: fp8_scale_inv must be float32, got {fp8_scale_inv.dtype}")
    scale_inv = fp8_scale_inv if fp8_scale_inv.dim() == 1 else fp8_scale_inv.view(1)
    device = scale_inv.device if device is None else torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if scale_inv.device != device:
        raise ValueError(f"Float8Tensor: fp8_scale_inv is on {scale_inv.device}, not {device}")
    numel, cols = math.prod(shape), shape[-1]
    rows = numel // cols if cols else 0
    row = col = None
    if data is not None:
        row = as_fp8_bytes(data, fp8_dtype, numel, "Float8Tensor: data", device).view(rows, cols)
    if data_transpose is not None:
        if not isinstance(data_transpose, torch.Tensor) or data_transpose.device != device:
            raise ValueError(f"Float8Tensor: data_transpose must be a tensor on {device}")
        if data_transpose.dim() > 2 and data_transpose.is_contiguous():
            data_transpose = data_transpose.reshape(data_transpose.shape[0], -1)
        col = columnwise_of(data_transpose, fp8_dtype, rows, cols)
    if row is None and col is None:
        raise ValueError("Float8Tensor: data and data_transpose cannot both be None")
    return Float8Storage(row, col, scale_inv, fp8_dtype, shape)


class Float8TensorTENames:
    """Transformer Engine's private-named members of a Float8Tensor (mixed into it)."""

    __slots__ = ()

    _storage: Float8Storage
    _quantizer: Quantizer | None

    @property
    def _data(self) -> torch.Tensor | None:
        """The rowwise FP8 bytes (M, N) as a uint8 view (None without rowwise data).

        Assigning a tensor (uint8 or the FP8 dtype, contiguous, self.numel() elements, on the
        tensor's device) makes its memory the rowwise data, aliased and not copied
        (replace_raw_data copies the bytes first); a columnwise copy is kept as it was (see
        _reset_caches). Assigning None drops the rowwise data where a columnwise copy remains.
        """
        row = self._storage.rowwise_data
        return None if row is None else row.view(torch.uint8)

    @_data.setter
    def _data(self, data: torch.Tensor | None) -> None:
        storage = self._storage
        if data is None:
            if storage.columnwise_data is None:
                raise ValueError("Float8Tensor._data = None would leave the tensor without data")
            storage.rowwise_data = None
            return
        numel = math.prod(storage.shape)
        flat = as_fp8_bytes(data, storage.fp8_dtype, numel, "Float8Tensor._data", storage.device)
        storage.rowwise_data = flat.view(storage.num_rows, storage.shape[-1])

    @property
    def _transpose(self) -> torch.Tensor | None:
        """The transposed FP8 bytes as a uint8 view (N, M) of the value's last dim N by its M
        leading rows (the storage pads the rows to a multiple of 16 underneath); None without
        columnwise data."""
        cols = self._storage.columnwise_data
        return None if cols is None else cols[:, : self._storage.num_rows].view(torch.uint8)

    @property
    def _fp8_dtype(self):
        """The FP8 dtype as Transformer Engine's DType tag."""
        return TE_DType[self._storage.fp8_dtype]

    def prepare_for_saving(self) -> tuple[list[torch.Tensor | None], Float8TensorTENames]:
        """Its storage's data tensors (rowwise (M, N), columnwise (N, Mp), scale_inv), and
        itself with them removed (restore_from_saved gives them back)."""
        tensors, _ = self._storage.prepare_for_saving()
        return tensors, self

    def restore_from_saved(self, tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Take back (rowwise, columnwise, scale_inv) from the front of `tensors`; return the
        rest."""
        return self._storage.restore_from_saved(tensors)

    def get_metadata(self) -> dict:
        """Transformer Engine's constructor keywords that rebuild this tensor over the same
        bytes: `Float8Tensor(shape=t.shape, dtype=t.dtype, **t.get_metadata())`. "data" the
        rowwise bytes (uint8 view, or None), "data_transpose" the columnwise bytes as torchte
        holds them (uint8 (N, Mp), rows padded to 16, or None), "fp8_scale_inv" (the same
        tensor), "fp8_dtype" (DType tag), "quantizer", "fake_dtype" (the nominal dtype)."""
        storage = self._storage
        cols = storage.columnwise_data
        return {
            "data": self._data,
            "fp8_scale_inv": storage.scale_inv,
            "fp8_dtype": self._fp8_dtype,
            "data_transpose": None if cols is None else cols.view(torch.uint8),
            "quantizer": self._quantizer,
            "fake_dtype": self.dtype,
        }

    def _get_quantizer(self) -> Quantizer:
        """The quantizer that requantizes this tensor: its own, else current scaling in its FP8
        dtype."""
        if self._quantizer is not None:
            return self._quantizer
        return Float8CurrentScalingQuantizer(self._storage.fp8_dtype)

    def update_usage(
        self, rowwise_usage: bool | None = None, columnwise_usage: bool | None = None
    ) -> None:
        """Make (True) or drop (False) the rowwise / columnwise copies of the bytes, a missing
        one rebuilt exactly from the other; None leaves one as is."""
        self._storage.update_usage(rowwise_usage=rowwise_usage, columnwise_usage=columnwise_usage)

    def _reset_caches(self) -> None:
        """Drop the columnwise copy made from the rowwise bytes (a write into those bytes left it
        stale); it is made again when a GEMM needs it. Without rowwise data the columnwise copy
        is the value and is kept."""
        storage = self._storage
        if storage.rowwise_data is not None:
            storage.columnwise_data = None

    remove_caches = _reset_caches

    def _create_transpose(self) -> None:
        """Make the columnwise copy from the rowwise bytes again, into the existing columnwise
        buffer where there is one (its address kept, as CUDA graphs need); nothing without
        rowwise data."""
        storage = self._storage
        row = storage.rowwise_data
        if row is None:
            return
        cols = storage.columnwise_data
        if cols is None:
            storage.update_usage(columnwise_usage=True)
            return
        cols.view(torch.uint8)[:, : row.shape[0]].copy_(row.view(torch.uint8).t())

    @classmethod
    def make_like(
        cls,
        tensor: torch.Tensor,
        *,
        shape: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
        requires_grad: bool = False,
        data: torch.Tensor | None = None,
        data_transpose: torch.Tensor | None = None,
    ):
        """A new Float8Tensor with `tensor`'s FP8 dtype, scale_inv (the same tensor, shared) and
        quantizer, of nominal `dtype` (default tensor's) and `shape`.

        By default it shares tensor's data (shape: tensor's, or another with as many elements;
        a new last dim keeps only the rowwise bytes). `data` (uint8 or the FP8 dtype,
        contiguous; shape defaults to data.shape) becomes its rowwise bytes and
        `data_transpose` ((N, M) or padded (N, Mp)) its columnwise ones, aliased where the
        layout allows (an unpadded transpose whose M is not a multiple of 16 is copied).
        """
        if not isinstance(tensor, cls):
            raise TypeError(f"make_like: tensor must be a {cls.__name__}, got {type(tensor)}")
        src: Float8Storage = tensor._storage
        if shape is None:
            shape = data.shape if data is not None else tensor.shape
        shape = tuple(int(s) for s in shape)
        dtype = tensor.dtype if dtype is None else dtype
        if dtype not in _NOMINAL_DTYPES:
            raise ValueError(f"make_like: dtype must be one of {_NOMINAL_DTYPES}, got {dtype}")
        if len(shape) == 0:
            raise ValueError("make_like: shape must have at least one dim")
        numel, cols = math.prod(shape), shape[-1]
        rows = numel // cols if cols else 0
        same_layout = cols == src.shape[-1] and rows == src.num_rows
        if data is not None:
            flat = as_fp8_bytes(data, src.fp8_dtype, numel, "make_like: data", src.device)
            row = flat.view(rows, cols)
        elif src.rowwise_data is None:
            if not same_layout:  # the columnwise bytes hold one (N, M) layout
                raise ValueError(
                    f"make_like: tensor has only columnwise data, for its shape "
                    f"{tuple(tensor.shape)}; shape {shape} needs rowwise data or `data`"
                )
            row = None
        elif numel != src.rowwise_data.numel():
            raise ValueError(
                f"make_like: shape {shape} has {numel} elements, tensor has {tensor.numel()}"
            )
        else:
            row = src.rowwise_data.view(rows, cols)
        if data_transpose is not None:
            col = columnwise_of(data_transpose, src.fp8_dtype, rows, cols)
        else:
            col = src.columnwise_data if data is None and same_layout else None
        storage = Float8Storage(row, col, src.scale_inv, src.fp8_dtype, shape)
        return cls(storage, dtype, tensor._quantizer, requires_grad=requires_grad)
