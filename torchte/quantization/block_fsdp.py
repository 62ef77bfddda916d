"""Block-scaled parameters (Float8BlockwiseQTensor, MXFP8Tensor) under FSDP2: shards of bytes.

FSDP2 (`fully_shard`) shards a parameter along dim 0: torch.chunk (aten.split) into one piece a
rank, new_zeros for the padded shard, copy_ of the piece into it, view(-1) of it. On a
block-scaled parameter these ops act on its bytes where the pieces are whole blocks: a piece is
a tensor of the same class over the rows of each data tensor (views, no copies) and of the
scales of those rows, with the parameter's quantizer. The all-gather moves the bytes and scales
(`fsdp_pre_all_gather` / `fsdp_post_all_gather`) and gives the module a tensor of the whole
weight, the same bytes as the unsharded parameter's. The optimizer updates each shard in place
(dequantize, step, requantize): every block lies on one rank, so the requantized shards are the
blocks of the whole weight quantized at once.

Per format (rows: dim 0 of the value, or of its (M, K) matrix):
- Float8BlockwiseQTensor, 128x128 blocks: the rowwise bytes and the scales of their 128-row
  tiles; the columnwise copy is made after the gather where the module needs it (transposed
  bytes and scales, exact). A 3-D value (G, N, K) tiles each matrix on its own: any split of G.
- Float8BlockwiseQTensor, 1x128 blocks, and MXFP8Tensor: both copies (neither is made exactly
  from the other), their scales' row axis sliced alike.
- NVFP4Tensor, blocks of 16 (16 x 16 tiles for 2-D weights): a shard is a value of its rows on
  its own (its scales padded as a value of that many rows is; copies, not views) holding the
  whole weight's per-tensor amax. The rowwise bytes and the scales of their rows are gathered,
  with each rank's amax (equal on all ranks: the first is kept); the columnwise copy is made
  after the gather (2-D blocks without RHT: the exact transpose), else both copies are
  gathered. A shard's quantizer is a copy that all-reduces the amax with MAX over FSDP2's
  shard group (set when the shard is made, chained after any reduction the quantizer had),
  so an optimizer step requantizes every shard with the amax of the whole updated weight.
A piece is whole blocks when it starts at a multiple of 128 matrix rows (16 for NVFP4; 1 index
of G for 3-D 128x128 values) and ends at one or at the end. FSDP2's shards are ceil(rows /
ranks) rows; where they are not all whole and equal (rows not a multiple of 128 (NVFP4: 16) x
ranks), the parameter is sharded and gathered in high precision, with a one-time warning.
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import Any

import torch

from . import block_state

__all__ = [
    "flat_view",
    "fsdp_post_all_gather",
    "fsdp_pre_all_gather",
    "in_fsdp_sharding",
    "new_zeros",
    "row_layout",
    "split_rows",
]

# Matrix rows a piece must start at a multiple of (the blocks' and scale paddings' rows).
ALIGN = 128
# NVFP4's: its blocks' rows (a shard's scales are padded on their own, so 16 suffices).
NVFP4_ALIGN = 16
# NVFP4's copies: {slot: (axis, matrix rows per index of that axis)}; the scales' padding.
_NVFP4_ROWWISE = {"rowwise_data": (0, 1), "rowwise_scale_inv": (0, 1)}
_NVFP4_COLUMNWISE = {"columnwise_data": (1, 2), "columnwise_scale_inv": (1, 16)}
_NVFP4_PADS = {"rowwise_scale_inv": 128, "columnwise_scale_inv": 4}
# How many frames up in_fsdp_sharding looks for FSDP2's sharding functions.
_STACK_DEPTH = 16
_FSDP_SHARDING = frozenset(("_init_sharded_param", "reset_sharded_param"))
_warned: set[tuple] = set()


class RowLayout:
    """How the data tensors of a block-scaled value lie along its rows.

    per_index: matrix rows per index of dim 0; align: matrix rows a piece starts at a multiple
    of; tensors: {slot name: (axis, rows per index of that axis)} of the tensors a shard keeps
    (the others are dropped: made again from these where needed); total: the matrix rows.
    pads: {slot: multiple} of the tensors whose row axis is padded to that multiple (a piece
    pads its own; the wire carries the rows alone); shared: the slots every piece holds whole
    (NVFP4's per-tensor amaxes). A layout with pads makes pieces that are copies.
    """

    __slots__ = ("align", "pads", "per_index", "shared", "tensors", "total")

    def __init__(
        self,
        per_index: int,
        align: int,
        tensors: dict,
        total: int,
        pads: dict | None = None,
        shared: tuple = (),
    ) -> None:
        self.per_index, self.align, self.tensors, self.total = per_index, align, tensors, total
        self.pads, self.shared = pads or {}, shared

    def whole(self, start: int, stop: int, rows: int) -> bool:
        """Whether dim-0 indices [start, stop) of a value with `rows` indices are whole blocks."""
        m0, m1 = start * self.per_index, stop * self.per_index
        return m0 % self.align == 0 and (m1 % self.align == 0 or stop == rows)

    def even(self, rows: int, chunk: int) -> bool:
        """Whether `rows` split in pieces of `chunk` gives equal pieces of whole blocks."""
        return chunk > 0 and rows % chunk == 0 and (chunk * self.per_index) % self.align == 0


def row_layout(tensor) -> RowLayout | str:
    """The RowLayout of a block-scaled tensor's storage, or why its rows cannot be split into
    block-scaled pieces (a string)."""
    storage, shape = tensor._storage, tuple(tensor.shape)
    kind = type(storage).__name__
    if len(shape) < 2:
        return "a 1-D value is one row of blocks"
    if kind == "NVFP4TensorStorage":
        return _nvfp4_layout(storage, shape)
    if getattr(storage, "block_dim", None) == 2:
        rowwise = {"rowwise_data": (0, 1)}
        if len(shape) >= 3:  # each matrix tiled on its own: a piece is whole matrices
            return RowLayout(1, 1, {**rowwise, "rowwise_scale_inv": (0, 1)}, shape[0])
        return RowLayout(1, ALIGN, {**rowwise, "rowwise_scale_inv": (0, ALIGN)}, shape[0])
    per_index = math.prod(shape[1:-1])
    total = per_index * shape[0]
    if kind == "Float8BlockwiseQTensorStorage":  # 1x128: scale (K/128, M), columnwise (K, M)
        axes = {"rowwise_data": (0, 1), "rowwise_scale_inv": (1, 1)}
        axes.update(columnwise_data=(1, 1), columnwise_scale_inv=(0, ALIGN))
    else:  # MXFP8: both copies (M, K), codes per row and per 32 rows
        axes = {"rowwise_data": (0, 1), "rowwise_scale_inv": (0, 1)}
        axes.update(columnwise_data=(0, 1), columnwise_scale_inv=(0, 32))
    held = {n: a for n, a in axes.items() if getattr(storage, n) is not None}
    return RowLayout(per_index, ALIGN, held, total)


def _nvfp4_layout(storage, shape: tuple) -> RowLayout:
    """NVFP4's RowLayout: the rowwise copy, and the columnwise one unless it is the rowwise
    one's exact transpose (2-D blocks without RHT); the amaxes of the copies kept, shared."""
    per_index = math.prod(shape[1:-1])
    if storage.with_2d_quantization and storage.rht_sign_mask is None:
        held = dict(_NVFP4_ROWWISE)  # made from the columnwise copy where missing
    else:
        axes = {**_NVFP4_ROWWISE, **_NVFP4_COLUMNWISE}
        held = {n: a for n, a in axes.items() if getattr(storage, n) is not None}
    pads = {n: p for n, p in _NVFP4_PADS.items() if n in held}
    shared = tuple(f"amax_{n[: -len('_data')]}" for n in held if n.endswith("_data"))
    return RowLayout(per_index, NVFP4_ALIGN, held, per_index * shape[0], pads, shared)


def _require_rowwise(tensor, layout: RowLayout) -> None:
    """Make the rowwise copy a shard keeps where the value holds only the columnwise one."""
    storage = tensor._storage
    if "rowwise_data" in layout.tensors and storage.rowwise_data is None:
        storage.update_usage(rowwise_usage=True)


def _piece(tensor, layout: RowLayout, start: int, stop: int):
    """A tensor of tensor's class over dim-0 indices [start, stop): views of the rows of each
    tensor the layout keeps (the others None), the same quantizer."""
    storage = tensor._storage
    state = block_state.slot_state(storage)
    m0, m1 = start * layout.per_index, stop * layout.per_index
    for name in storage._SAVED:
        state[name] = None
    for name, (axis, per) in layout.tensors.items():
        data = getattr(storage, name)
        if name in layout.pads:  # the piece's own padding: a value of its rows on its own
            rows = data.narrow(axis, m0 // per, (m1 - m0) // per)
            state[name] = _pad_axis(rows, axis, layout.pads[name])
            continue
        end = data.shape[axis] if m1 == layout.total else m1 // per
        state[name] = data.narrow(axis, m0 // per, end - m0 // per)
        if layout.pads:  # all copies: a write through the piece must not reach half of tensor
            state[name] = state[name].clone()
    for name in layout.shared:
        state[name] = getattr(storage, name).clone()
    state["shape"] = (stop - start, *tensor.shape[1:])
    piece = block_state.build(type(storage), state)
    return type(tensor).from_storage(piece, tensor.dtype, tensor._quantizer)


def _pad_axis(t: torch.Tensor, axis: int, multiple: int) -> torch.Tensor:
    """A zero-padded copy of t whose length along axis is rounded up to `multiple`."""
    size = list(t.shape)
    size[axis] = -(-size[axis] // multiple) * multiple
    padded = torch.zeros(size, dtype=t.dtype, device=t.device)
    padded.narrow(axis, 0, t.shape[axis]).copy_(t)
    return padded


def _sharding_frame():
    """The frame of FSDP2's _init_sharded_param or reset_sharded_param on the stack, or None."""
    frame = sys._getframe(2)
    for _ in range(_STACK_DEPTH):
        if frame is None:
            return None
        code = frame.f_code.co_name
        if code in _FSDP_SHARDING and "fsdp" in frame.f_globals.get("__name__", ""):
            return frame
        frame = frame.f_back
    return None


def in_fsdp_sharding() -> bool:
    """Whether FSDP2 is sharding a parameter (its _init_sharded_param or reset_sharded_param
    is on the stack)."""
    return _sharding_frame() is not None


def _sharding_group():
    """The shard process group of the parameter FSDP2 is sharding (its FSDPParam's
    mesh_info.shard_process_group); None outside FSDP2's sharding or without one."""
    frame = _sharding_frame()
    fsdp_param = None if frame is None else frame.f_locals.get("self")
    return getattr(getattr(fsdp_param, "mesh_info", None), "shard_process_group", None)


def _agreeing_quantizer(quantizer, group):
    """quantizer, or for NVFP4 (a per-tensor amax) a copy that all-reduces the amax with MAX
    over `group` (after any reduction quantizer had), so that the ranks' shards are
    requantized with the amax of the whole weight; the same quantizer where group is None."""
    from .float8_fsdp import max_over
    from .nvfp4 import NVFP4Quantizer

    if group is None or not isinstance(quantizer, NVFP4Quantizer):
        return quantizer
    agreeing = quantizer.copy()
    over_group = max_over(group)
    before = quantizer.amax_reduction
    agreeing.amax_reduction = over_group if before is None else _chained(before, over_group)
    agreeing.with_amax_reduction = True
    if before is None:
        agreeing.amax_reduction_group = group
    return agreeing


def _chained(first, second):
    """A function applying first, then second, to its argument (two MAX all-reductions)."""

    def both(amax: torch.Tensor) -> None:
        first(amax)
        second(amax)

    return both


def _fallback(tensor, why: str) -> None:
    """Under FSDP2's sharding: warn once (per class, shape and reason) that tensor is sharded
    in high precision."""
    if not in_fsdp_sharding():
        return
    name = type(tensor).__name__
    key = (name, tuple(tensor.shape), why)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(
            f"FSDP2 shards this {name} parameter of shape {tuple(tensor.shape)} in high "
            f"precision (it is gathered and stepped as plain values): {why}",
            UserWarning,
            stacklevel=2,
        )


def split_rows(tensor, split_size: int, dim: int):
    """aten.split along dim 0 as block-scaled pieces (views of tensor's bytes) where the pieces
    are equal and whole blocks; None where they are not (the caller dequantizes). A derivable
    columnwise copy of tensor is dropped (made again when needed): a write through a piece
    would leave it stale."""
    if dim not in (0, -tensor.dim()) or tensor.dim() == 0:
        return None
    layout = row_layout(tensor)
    rows = tensor.shape[0]
    if isinstance(layout, str):
        _fallback(tensor, layout)
        return None
    if not layout.even(rows, split_size):
        why = (
            f"its pieces of {split_size} of {rows} rows are not equal pieces of whole "
            f"{layout.align // layout.per_index}-row blocks; make dim 0 a multiple of "
            f"{layout.align // layout.per_index} x the number of ranks to shard it in FP8"
        )
        _fallback(tensor, why)
        return None
    _require_rowwise(tensor, layout)
    storage = tensor._storage
    if "columnwise_data" not in layout.tensors and storage.columnwise_data is not None:
        storage.update_usage(columnwise_usage=False)
    return [_piece(tensor, layout, s, s + split_size) for s in range(0, rows, split_size)]


def new_zeros(tensor, size) -> Any:
    """tensor.new_zeros(size) as a value of tensor's class whose bytes and scales are zero
    (FSDP2's padded shard, into which it copies a piece): where size is an even piece of whole
    blocks of tensor's rows; None otherwise (the caller makes a plain tensor)."""
    size = tuple(size)
    if tensor.dim() == 0 or len(size) != tensor.dim() or size[1:] != tuple(tensor.shape[1:]):
        return None
    layout = row_layout(tensor)
    if isinstance(layout, str) or not layout.even(tensor.shape[0], size[0]):
        return None
    _require_rowwise(tensor, layout)
    piece = _piece(tensor, layout, 0, size[0])
    zeros = block_state.map_storage(piece._storage, torch.zeros_like)
    quantizer = tensor._quantizer
    if layout.shared:  # the padded shard FSDP2 keeps: its steps agree on the amax
        quantizer = _agreeing_quantizer(quantizer, _sharding_group())
    return type(tensor).from_storage(zeros, tensor.dtype, quantizer)


class _FlatView(torch.Tensor):
    """A read-only 1-D view of a block-scaled tensor (FSDP2 keeps padded_shard.view(-1) beside
    the shard): an op reads the base's dequantized values, flattened; writes raise."""

    _base_tensor: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, base: torch.Tensor) -> _FlatView:
        view = torch.Tensor._make_wrapper_subclass(
            cls, (base.numel(),), dtype=base.dtype, device=base.device
        )
        view._base_tensor = base
        return view

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"_FlatView(of {type(self._base_tensor).__name__} {tuple(self._base_tensor.shape)})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_map_only

        from ._block_common import written_args

        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            return cls(args[0]._base_tensor)
        if written_args(func):
            raise NotImplementedError(f"{func}: the 1-D view of a block-scaled tensor is read-only")

        def values(view: _FlatView) -> torch.Tensor:
            return view._base_tensor.dequantize().reshape(-1)

        args, kwargs = tree_map_only(cls, values, (args, kwargs or {}))
        return func(*args, **kwargs)


def flat_view(tensor, shape) -> _FlatView | None:
    """view(-1) of a block-scaled tensor while FSDP2 shards it: a _FlatView (no copy); None
    otherwise (the caller dequantizes)."""
    if len(shape) == 1 and shape[0] in (-1, tensor.numel()) and in_fsdp_sharding():
        return _FlatView(tensor)
    return None


# -- FSDP2's all-gather extension -------------------------------------------------------------

_ONE_BYTE = (torch.uint8, torch.int8)


def _wire(t: torch.Tensor, axis: int) -> torch.Tensor:
    """t with its row axis first, contiguous, 1-byte floats as uint8 (what the ranks gather)."""
    t = t.movedim(axis, 0).contiguous()
    return t.view(torch.uint8) if t.dtype.itemsize == 1 and t.dtype not in _ONE_BYTE else t


def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
    """This rank's shard as the tensors to gather (its bytes and scales, row axis first,
    without padding; the shared amaxes whole), and what makes the gathered ones a tensor of
    the whole weight."""
    layout = row_layout(self)
    if isinstance(layout, str):  # split_rows made no such shard: a tensor built by hand
        raise NotImplementedError(f"FSDP2 all-gather of {type(self).__name__}: {layout}")
    _require_rowwise(self, layout)
    if layout.shared and getattr(self._quantizer, "amax_reduction", None) is None:
        self._quantizer = _agreeing_quantizer(self._quantizer, mesh.get_group())
    storage = self._storage
    names = (*layout.tensors, *layout.shared)
    axes = tuple(layout.tensors.get(n, (0, 1))[0] for n in names)
    inputs = []
    for name, axis in zip(names, axes, strict=True):
        data = getattr(storage, name)
        if name in layout.pads:  # the rows alone: every rank sends as many
            data = data.narrow(axis, 0, layout.total // layout.tensors[name][1])
        inputs.append(_wire(data, axis))
    state = {k: v for k, v in block_state.slot_state(storage).items() if k not in storage._SAVED}
    state["shape"] = tuple(outer_size)
    dtypes = tuple(getattr(storage, n).dtype for n in names)
    meta = (type(self), type(storage), state, names, axes, dtypes, self._quantizer)
    return tuple(inputs), (*meta, layout.pads, layout.shared)


def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
    """The gathered bytes and scales (the ranks' shards one after the other along each row
    axis; padded scales padded again for the whole weight; NVFP4's amax: the first rank's) as
    a tensor of the whole weight of nominal param_dtype; with out (a re-gather into
    the tensor made before), out takes them in a new storage (an older one may be saved for a
    backward)."""
    cls, storage_cls, state, names, axes, dtypes, quantizer, pads, shared = metadata
    state = dict(state)
    for name in storage_cls._SAVED:
        state[name] = None
    for name, axis, dtype, gathered in zip(names, axes, dtypes, all_gather_outputs, strict=True):
        t = gathered.view(dtype)
        if name in shared:  # each rank's copy of one amax, equal on all: the first
            state[name] = t[:1]
            continue
        t = t if axis == 0 else t.movedim(0, axis).contiguous()
        state[name] = _pad_axis(t, axis, pads[name]) if name in pads else t
    storage = block_state.build(storage_cls, state)
    if out is not None:
        out._storage = storage
        return None
    return cls.from_storage(storage, param_dtype, quantizer), tuple(all_gather_outputs)
