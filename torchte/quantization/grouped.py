"""Grouped FP8 values of a mixture-of-experts layer: GroupedStorage inside, GroupedTensor outside.

G groups (experts) of T rows in all share one FP8 dtype but each has its own per-tensor scale.
Shapes (m_splits: G host ints >= 0 summing to T; group g owns rows [o_g, o_{g+1})):
- rowwise_data (T, K): the groups' rows stacked.
- columnwise_data (K * C,) flat, C = sum_g Mp_g, Mp_g = round_up(m_g, 16): group g's block
  starts at element K * c_g (c_g = sum_{j<g} Mp_j) and is the contiguous (K, Mp_g) transpose of
  its rows, zero-padded in the last columns (Float8Storage's columnwise layout, per group).
- scale_inv (G,) fp32: value of group g = its data * scale_inv[g].
Grouped kernels produce this layout directly; `group(g)` takes views of it, never copies.

Group sizes known only on the device (a device split tensor, a CUDA graph): m_splits is None
and `offsets` holds o_g and c_g as int32 (G + 1,) device tensors; columnwise_data then has room
for the worst case, C_max = T + 15 G columns (kernels/grouped_cast.grouped_columns), its tail
unused. The grouped GEMMs read the offsets on the device; whatever needs the sizes on the host
(group views, dequantize, a usage rebuilt) reads them back once (a synchronization).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from torchte._sizes import check_splits, round_up
from torchte.kernels.cast_transpose import COLUMNWISE_ALIGN
from torchte.kernels.grouped_cast import grouped_columns, grouped_offsets

from .base import TwoUsageStorage
from .float8 import Float8Storage
from .float8_tensor import Float8Tensor, _Dequantize, _written_args

__all__ = ["GroupedStorage", "GroupedTensor"]

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_REPR_VALUES = 6


class GroupedStorage(TwoUsageStorage):
    """The FP8 values of G groups in one buffer per usage; a plain object, no Tensor subclass.

    rowwise_data (T, K) and/or columnwise_data (K * C,) in `fp8_dtype`, scale_inv (G,) fp32;
    see the module docstring for the layout. Either data tensor may be None (usage dropped).
    """

    __slots__ = (
        "_col_offsets",
        "_columns",
        "_m_splits",
        "_num_groups",
        "_row_offsets",
        "columnwise_data",
        "fp8_dtype",
        "offsets",
        "rowwise_data",
        "scale_inv",
        "shape",
    )

    def __init__(
        self,
        rowwise_data: torch.Tensor | None,
        columnwise_data: torch.Tensor | None,
        scale_inv: torch.Tensor,
        fp8_dtype: torch.dtype,
        m_splits: Sequence[int] | None,
        shape: tuple[int, int] | torch.Size,
        offsets: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """m_splits None: the sizes are on the device, in offsets (see the module docstring);
        with m_splits, offsets (the same values on the device) may be given or not."""
        self.shape = tuple(int(s) for s in shape)
        if len(self.shape) != 2:
            raise ValueError(f"GroupedStorage: shape must be (T, K), got {self.shape}")
        if fp8_dtype not in _FP8_DTYPES:
            raise ValueError(f"GroupedStorage: fp8_dtype must be one of {_FP8_DTYPES}")
        self.offsets = offsets
        self._m_splits = self._row_offsets = self._col_offsets = None
        if m_splits is None:
            if offsets is None or offsets[0].numel() < 2 or offsets[0].shape != offsets[1].shape:
                raise ValueError(
                    "GroupedStorage: without m_splits, offsets must be two (G + 1,) tensors"
                )
            self._num_groups = offsets[0].numel() - 1
            self._columns = grouped_columns(None, self.shape[0], self._num_groups)
        else:
            self._set_sizes(tuple(int(m) for m in m_splits))
            self._num_groups, self._columns = len(m_splits), self._col_offsets[-1]
        self.rowwise_data = rowwise_data
        self.columnwise_data = columnwise_data
        self.scale_inv = scale_inv
        self.fp8_dtype = fp8_dtype
        self._check_tensors()

    def _set_sizes(self, m_splits: tuple[int, ...]) -> None:
        if not m_splits:
            raise ValueError("GroupedStorage: m_splits must name at least one group")
        check_splits(m_splits, self.shape[0])
        self._m_splits = m_splits
        self._row_offsets = (0, *accumulate(m_splits))
        padded = (round_up(m, COLUMNWISE_ALIGN) for m in m_splits)
        self._col_offsets = (0, *accumulate(padded))

    def _host_sizes(self) -> tuple[int, ...]:
        """m_splits, read back from the device offsets the first time (one synchronization)."""
        if self._m_splits is None:
            self._set_sizes(tuple(torch.diff(self.offsets[0]).tolist()))
        return self._m_splits

    def _check_tensors(self) -> None:
        """Shapes and dtypes of the data tensors against the layout; ValueError naming one."""
        rows, k = self.shape
        expected = {
            "rowwise_data": ((rows, k), self.fp8_dtype),
            "columnwise_data": ((k * self._columns,), self.fp8_dtype),
            "scale_inv": ((self.num_groups,), torch.float32),
        }
        for name, (shape, dtype) in expected.items():
            t = getattr(self, name)
            if t is not None and (tuple(t.shape) != shape or t.dtype != dtype):
                raise ValueError(
                    f"GroupedStorage: {name} must be {dtype} of shape {shape}, "
                    f"got {t.dtype} of shape {tuple(t.shape)}"
                )
        if self.scale_inv is None:
            raise ValueError("GroupedStorage: scale_inv is required")

    def __copy__(self) -> GroupedStorage:
        """A shallow copy sharing every data tensor (what save_for_backward saves)."""
        copy = object.__new__(GroupedStorage)
        for name in GroupedStorage.__slots__:
            setattr(copy, name, getattr(self, name))
        return copy

    @classmethod
    def from_groups(
        cls, storages: Sequence[Float8Storage], fp8_dtype: torch.dtype
    ) -> GroupedStorage:
        """Copy per-group Float8Storage values (each (m_g, K), scale_inv (1,)) into one layout.

        A usage (rowwise / columnwise) is kept when every group has it; ValueError when the
        groups share none, or disagree on K, fp8 dtype or device.
        """
        if not storages:
            raise ValueError("GroupedStorage.from_groups: needs at least one group")
        k, device = storages[0].shape[-1], storages[0].device
        for g, s in enumerate(storages):
            if (s.shape[-1], s.fp8_dtype, s.device) != (k, fp8_dtype, device):
                raise ValueError(
                    f"GroupedStorage.from_groups: group {g} is {s.fp8_dtype} with K="
                    f"{s.shape[-1]} on {s.device}; group 0 sets {fp8_dtype}, K={k}, {device}"
                )
        m_splits = [s.num_rows for s in storages]
        rowwise = all(s.rowwise_data is not None for s in storages)
        columnwise = all(s.columnwise_data is not None for s in storages)
        if not (rowwise or columnwise):
            raise ValueError(
                "GroupedStorage.from_groups: the groups have no usage in common (all rowwise or "
                "all columnwise); call update_usage on them first"
            )
        scale_inv = torch.cat([s.scale_inv.reshape(1).float() for s in storages])
        out = cls(None, None, scale_inv, fp8_dtype, m_splits, (sum(m_splits), k))
        if rowwise:
            rows = [s.rowwise_data.view(torch.uint8).reshape(-1, k) for s in storages]
            out.rowwise_data = torch.cat(rows).view(fp8_dtype)
        if columnwise:
            columnwise_data = out._empty_columnwise()
            for g, s in enumerate(storages):
                if tuple(s.columnwise_data.shape) != (k, round_up(m_splits[g], COLUMNWISE_ALIGN)):
                    raise ValueError(
                        f"GroupedStorage.from_groups: group {g}'s columnwise data has shape "
                        f"{tuple(s.columnwise_data.shape)}, not (K, round_up(m_g, 16))"
                    )
                block = out._columnwise_block(g, columnwise_data).view(torch.uint8)
                block[:, : m_splits[g]] = s.columnwise_data.view(torch.uint8)[:, : m_splits[g]]
            out.columnwise_data = columnwise_data
        return out

    @property
    def num_groups(self) -> int:
        return self._num_groups

    @property
    def m_splits(self) -> tuple[int, ...]:
        """Rows of each group, (G,) host ints (read back once when they are on the device)."""
        return self._host_sizes()

    @property
    def sizes_on_host(self) -> bool:
        """Whether m_splits is known without reading the device."""
        return self._m_splits is not None

    def device_offsets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(o_g, c_g) as int32 (G + 1,) tensors on the data's device, what the grouped kernels
        and GEMMs read (from the host sizes, cached, when there are no device offsets)."""
        if self.offsets is None:
            self.offsets = grouped_offsets(self._m_splits, self.device)
        return self.offsets

    @property
    def device(self) -> torch.device:
        return self.scale_inv.device

    def row_offsets(self) -> list[int]:
        """o_g: the first row of each group, and T last (G + 1 host ints)."""
        self._host_sizes()
        return list(self._row_offsets)

    def col_offsets(self) -> list[int]:
        """c_g: the first padded column of each group's columnwise block, and C last (G + 1)."""
        self._host_sizes()
        return list(self._col_offsets)

    def _check_index(self, g: int) -> None:
        if not 0 <= g < self.num_groups:
            raise IndexError(f"GroupedStorage: group {g} out of range for {self.num_groups}")

    def _columnwise_block(self, g: int, columnwise: torch.Tensor | None = None) -> torch.Tensor:
        """Group g's (K, Mp_g) block of `columnwise` (default: columnwise_data), a view."""
        columnwise = self.columnwise_data if columnwise is None else columnwise
        self._host_sizes()
        k, start, end = self.shape[1], self._col_offsets[g], self._col_offsets[g + 1]
        return columnwise[k * start : k * end].view(k, end - start)

    def _empty_columnwise(self) -> torch.Tensor:
        # Zeros: the padding columns of every block must read as zero.
        numel = self.shape[1] * self._columns
        return torch.zeros(numel, dtype=torch.uint8, device=self.device).view(self.fp8_dtype)

    def group(self, g: int) -> Float8Storage:
        """Group g as a Float8Storage of shape (m_g, K) whose tensors are views (no copy)."""
        self._check_index(g)
        self._host_sizes()
        if self.scale_inv is None:
            raise RuntimeError("GroupedStorage holds no data (emptied by prepare_for_saving?)")
        row = self.rowwise_data
        if row is not None:
            row = row[self._row_offsets[g] : self._row_offsets[g + 1]]
        col = None if self.columnwise_data is None else self._columnwise_block(g)
        shape = (self._m_splits[g], self.shape[1])
        return Float8Storage(row, col, self.scale_inv[g : g + 1], self.fp8_dtype, shape)

    def groups(self) -> list[Float8Storage]:
        """Every group, as group(g) gives it."""
        return [self.group(g) for g in range(self.num_groups)]

    def gemm_operands(self) -> tuple[list, list, list[torch.Tensor]]:
        """What per-group FP8 GEMMs take, in few calls (the hot path): each group's rowwise
        rows (m_g, K) and columnwise block (K, Mp_g) as views (None for a dropped usage), and
        its scale_inv as a (1,) tensor at a 16-byte aligned address, which cuBLAS requires of
        FP8 scale pointers (scale_inv[g] itself sits at 4 g bytes): one padded copy."""
        num_groups, k = self.num_groups, self.shape[1]
        m_splits = self._host_sizes()
        rows = [None] * num_groups
        if self.rowwise_data is not None:
            rows = self.rowwise_data.split(m_splits)
        cols = [None] * num_groups
        if self.columnwise_data is not None:
            widths = [end - start for start, end in itertools.pairwise(self._col_offsets)]
            used = self.columnwise_data[: k * self._col_offsets[-1]]
            blocks = used.split([k * w for w in widths])
            cols = [block.view(k, w) for block, w in zip(blocks, widths, strict=True)]
        padded = torch.nn.functional.pad(self.scale_inv[:, None], (0, 3))
        return rows, cols, padded[:, :1].unbind(0)

    def _rowwise_from_columnwise(self) -> torch.Tensor:
        """(T, K) rowwise data rebuilt from the columnwise blocks: an exact byte transpose."""
        out = torch.empty(self.shape, dtype=torch.uint8, device=self.device)
        for g, m in enumerate(self._host_sizes()):
            rows = out[self._row_offsets[g] : self._row_offsets[g + 1]]
            rows.copy_(self._columnwise_block(g).view(torch.uint8)[:, :m].t())
        return out.view(self.fp8_dtype)

    def _columnwise_from_rowwise(self) -> torch.Tensor:
        """(K * C,) columnwise data rebuilt from the rowwise rows: an exact byte transpose."""
        out = self._empty_columnwise()
        src = self.rowwise_data.view(torch.uint8)
        for g, m in enumerate(self._host_sizes()):
            block = self._columnwise_block(g, out).view(torch.uint8)
            block[:, :m] = src[self._row_offsets[g] : self._row_offsets[g + 1]].t()
        return out

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The high-precision value (T, K) in `dtype`: each group's rows times its scale_inv."""
        if self.rowwise_data is not None:
            data = self.rowwise_data
        elif self.columnwise_data is not None:
            data = self._rowwise_from_columnwise()
        else:
            raise RuntimeError("GroupedStorage holds no data (emptied by prepare_for_saving?)")
        repeats = torch.tensor(self._host_sizes(), device=self.device)
        row_scale = torch.repeat_interleave(self.scale_inv, repeats, output_size=self.shape[0])
        return (data.float() * row_scale[:, None]).to(dtype)

    def __repr__(self) -> str:
        usage = [n for n in ("rowwise", "columnwise") if getattr(self, f"{n}_data") is not None]
        return (
            f"GroupedStorage(shape={self.shape}, m_splits={self._m_splits or 'on the device'}, "
            f"dtype={self.fp8_dtype}, usage={usage})"
        )


# ----------------------------------------------------------------------------------------------
# GroupedTensor
# ----------------------------------------------------------------------------------------------

aten = torch.ops.aten
_TensorBase = torch._C.TensorBase


class GroupedTensor(torch.Tensor):
    """A GroupedStorage seen by torch as a (T, K) tensor of a nominal high-precision dtype.

    `_storage` holds the FP8 bytes (read by modules directly). detach / alias share it, clone
    and device moves copy it, a new dtype dequantizes; any other op runs on the dequantized
    value and gives plain tensors. Ops that would write into a GroupedTensor raise: there is
    no grouped quantizer here to requantize with.
    """

    _storage: GroupedStorage

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(
        cls, storage: GroupedStorage, dtype: torch.dtype, requires_grad: bool = False
    ) -> GroupedTensor:
        tensor = _TensorBase._make_wrapper_subclass(
            cls, storage.shape, dtype=dtype, device=storage.device, requires_grad=requires_grad
        )
        tensor._storage = storage
        return tensor

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self._storage.fp8_dtype

    @property
    def m_splits(self) -> tuple[int, ...]:
        return self._storage.m_splits

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The plain value (T, K) in `dtype` (default: the nominal dtype); the gradient of the
        result flows to this tensor unchanged."""
        dtype = self.dtype if dtype is None else dtype
        if self.requires_grad and torch.is_grad_enabled():
            return _Dequantize.apply(self, dtype)
        return self._storage.dequantize(dtype)

    def split_groups(self) -> list[Float8Tensor]:
        """Each group as a Float8Tensor (m_g, K) of the nominal dtype over views of the buffers."""
        return [Float8Tensor.from_storage(s, self.dtype, None) for s in self._storage.groups()]

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        try:
            flat = self._storage.dequantize(torch.float32).reshape(-1)
        except RuntimeError:
            values = "<no data>"
        else:
            shown = ", ".join(f"{v:.4g}" for v in flat[:_REPR_VALUES].tolist())
            values = f"[{shown}{', ...' if flat.numel() > _REPR_VALUES else ''}]"
        return (
            f"GroupedTensor(shape={tuple(self.shape)}, m_splits={self.m_splits}, "
            f"dtype={self.dtype}, fp8_dtype={self.fp8_dtype}, device={self.device}, "
            f"values={values})"
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = {} if kwargs is None else kwargs
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(args, kwargs)
        for position, name in _written_args(func):
            target = args[position] if position < len(args) else kwargs.get(name)
            if isinstance(target, GroupedTensor):
                raise NotImplementedError(
                    f"{func}: a GroupedTensor cannot be written in place; dequantize it first"
                )
        return _run_dequantized(func, args, kwargs)


def _map_storage(storage: GroupedStorage, fn: Callable[[torch.Tensor], torch.Tensor]):
    """A new GroupedStorage with fn applied to each data tensor (None stays None)."""
    row, col = storage.rowwise_data, storage.columnwise_data
    offsets = storage.offsets
    return GroupedStorage(
        None if row is None else fn(row),
        None if col is None else fn(col),
        fn(storage.scale_inv),
        storage.fp8_dtype,
        storage._m_splits,
        storage.shape,
        None if offsets is None else (fn(offsets[0]), fn(offsets[1])),
    )


def _dequantize_arg(tensor: GroupedTensor) -> torch.Tensor:
    return tensor._storage.dequantize(tensor.dtype)


def _run_dequantized(func, args, kwargs):
    """Fallback: run func on the dequantized values; the results are plain tensors."""
    args, kwargs = tree_map_only(GroupedTensor, _dequantize_arg, (args, kwargs))
    return func(*args, **kwargs)


def _handle_alias(args, kwargs):
    self = args[0]
    return GroupedTensor(self._storage, self.dtype)


def _handle_clone(args, kwargs):
    self = args[0]
    return GroupedTensor(_map_storage(self._storage, torch.clone), self.dtype)


def _handle_to_copy(args, kwargs):
    """A new dtype: the plain dequantized tensor; otherwise a GroupedTensor copy (maybe moved)."""
    self = args[0]
    dtype = kwargs.get("dtype")
    if dtype is not None and dtype != self.dtype:
        return _run_dequantized(aten._to_copy.default, args, kwargs)
    device = kwargs.get("device")
    device = self.device if device is None else torch.device(device)
    non_blocking = bool(kwargs.get("non_blocking", False))
    storage = _map_storage(
        self._storage, lambda t: t.to(device=device, non_blocking=non_blocking, copy=True)
    )
    return GroupedTensor(storage, self.dtype)


_HANDLERS = {
    aten.detach.default: _handle_alias,
    aten.alias.default: _handle_alias,
    aten.clone.default: _handle_clone,
    aten._to_copy.default: _handle_to_copy,
}
