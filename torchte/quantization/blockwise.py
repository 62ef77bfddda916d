"""Float8BlockScaling's values: Float8BlockQuantizer, Float8BlockwiseQTensorStorage and, for
mixture-of-experts layers whose group sizes live on the device, GroupedBlockwiseStorage.

Layouts (kernels/block_cast.py), for a value of shape (..., K) with M = prod(...) rows:
- 1x128 blocks (block_dim 1: activations, gradients): rowwise data (M, K) fp8 + scale_inv
  (ceil(K/128), M) fp32; columnwise data (K, M) (x^T quantized in 1x128 blocks along M) +
  scale_inv (ceil(M/128), K). Two separate quantizations: neither copy is made from the other.
- 128x128 blocks (block_dim 2: weights): each trailing matrix (R, C) tiled on its own, a value
  of shape (G, N, K) being G experts' weights: rowwise data (..., R, C) + scale_inv (...,
  ceil(R/128), round_up(ceil(C/128), 4)); columnwise data (..., C, R) + scale_inv (...,
  ceil(C/128), round_up(ceil(R/128), 4)): the same bytes and scales transposed. A 1-D value
  (K,) is one row (1, K).
- grouped 1x128 (T, K) in G groups of rows: rowwise as 1x128; columnwise in
  kernels/block_layout.py's grouped layout (data (K, T), scales (max_blocks(T, G), K)).
value = data * scale_inv, block by block.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from torchte._sizes import check_splits
from torchte.constants import TE_DType_To_Torch
from torchte.kernels import block_cast as bc
from torchte.kernels.block_layout import BLOCK, block_offsets, host_block_offsets

from ._block_common import BlockQuantizerMixin, SavedTensorsStorage
from .base import GemmOperand, Quantizer
from .quantizer_te import TEQuantizerMethods

__all__ = ["Float8BlockQuantizer", "Float8BlockwiseQTensorStorage", "GroupedBlockwiseStorage"]

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_NAMES = ("rowwise_data", "columnwise_data", "rowwise_scale_inv", "columnwise_scale_inv")


def _fp8_dtype(fp8_dtype) -> torch.dtype:
    """A torch FP8 dtype from a torch dtype or Transformer Engine's DType tag."""
    if not isinstance(fp8_dtype, torch.dtype) and fp8_dtype in TE_DType_To_Torch:
        fp8_dtype = TE_DType_To_Torch[fp8_dtype]
    if fp8_dtype not in _FP8_DTYPES:
        raise TypeError(f"fp8_dtype must be one of {_FP8_DTYPES} (or its DType), got {fp8_dtype}")
    return fp8_dtype


class _BlockStorage(SavedTensorsStorage):
    """What both block-scaled storages share: their four data tensors (the two copies and
    their scales) and the rules for dropping, saving, restoring and overwriting them."""

    __slots__ = ()
    _SAVED = _NAMES
    _HELD = _NAMES
    _EMPTY_HINT = "(emptied or both usages dropped)"

    def _usage(self) -> list[str]:
        """The copies held, by name (for __repr__)."""
        return [u for u in ("rowwise", "columnwise") if getattr(self, f"{u}_data") is not None]

    def _drop(self, rowwise_usage: bool | None, columnwise_usage: bool | None) -> None:
        if rowwise_usage is False:
            self.rowwise_data = self.rowwise_scale_inv = None
        if columnwise_usage is False:
            self.columnwise_data = self.columnwise_scale_inv = None

    def _cannot_make(self, wanted: str) -> RuntimeError:
        other = "columnwise" if wanted == "rowwise" else "rowwise"
        return RuntimeError(
            f"cannot make the {wanted} copy of a {type(self).__name__} with 1x128 blocks from "
            f"its {other} copy: the two are separate quantizations (different blocks and "
            "scales); quantize again with that usage"
        )

    def _data_for(self, usage: str) -> tuple[torch.Tensor, torch.Tensor]:
        if usage not in ("rowwise", "columnwise"):
            raise ValueError(f"usage must be 'rowwise' or 'columnwise', got {usage!r}")
        data, scale = getattr(self, f"{usage}_data"), getattr(self, f"{usage}_scale_inv")
        if data is None:
            raise RuntimeError(f"{type(self).__name__} holds no {usage} data (usage dropped?)")
        return data, scale

    def _check_copy_source(self, src) -> None:
        if type(src) is not type(self):
            raise TypeError(f"copy_from_ needs a {type(self).__name__}, got {type(src).__name__}")
        if src.fp8_dtype != self.fp8_dtype or tuple(src.shape) != tuple(self.shape):
            raise ValueError(
                f"copy_from_: source {src.fp8_dtype} {tuple(src.shape)} differs from "
                f"destination {self.fp8_dtype} {tuple(self.shape)}"
            )

    def _copy_tensors(self, src, names: Sequence[str]) -> None:
        """Overwrite each of this value's tensors `names` in place with src's (every address
        kept); RuntimeError where src lacks one this value holds."""
        for name in names:
            dst_t, src_t = getattr(self, name), getattr(src, name)
            if dst_t is None:
                continue
            if src_t is None:
                raise RuntimeError(f"cannot copy {name}: the source {type(src).__name__} has none")
            dst_t.copy_(src_t)


class Float8BlockwiseQTensorStorage(_BlockStorage):
    """A block-scaled FP8 value inside autograd (1x128 or 128x128 blocks, block_dim 1 or 2;
    see the module docstring for the layouts). A plain object, no Tensor subclass; either copy
    (data with its scale_inv) may be None."""

    __slots__ = (
        "block_dim",
        "columnwise_data",
        "columnwise_scale_inv",
        "fp8_dtype",
        "rowwise_data",
        "rowwise_scale_inv",
        "shape",
    )

    def __init__(
        self,
        rowwise_data: torch.Tensor | None,
        rowwise_scale_inv: torch.Tensor | None,
        columnwise_data: torch.Tensor | None,
        columnwise_scale_inv: torch.Tensor | None,
        fp8_dtype: torch.dtype,
        shape: tuple[int, ...] | torch.Size,
        block_dim: int,
    ) -> None:
        if block_dim not in (1, 2):
            raise ValueError(f"block_dim must be 1 (1x128) or 2 (128x128), got {block_dim}")
        self.rowwise_data, self.rowwise_scale_inv = rowwise_data, rowwise_scale_inv
        self.columnwise_data, self.columnwise_scale_inv = columnwise_data, columnwise_scale_inv
        self.fp8_dtype = _fp8_dtype(fp8_dtype)
        self.shape = tuple(int(s) for s in shape)
        self.block_dim = block_dim

    @property
    def is_2D_scaled(self) -> bool:
        """Whether the blocks are 128x128 (Transformer Engine's flag)."""
        return self.block_dim == 2

    def _matrix(self) -> tuple[tuple[int, ...], int, int]:
        """(batch dims, R, C) of the 128x128 layout: a 1-D value is one row."""
        shape = self.shape if len(self.shape) >= 2 else (1, *self.shape)
        return shape[:-2], shape[-2], shape[-1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The high-precision value (shape `self.shape`, `dtype`), from the rowwise copy if held,
        else from the columnwise one."""
        if self.rowwise_data is not None:
            data, scale = self.rowwise_data, self.rowwise_scale_inv
            return bc.block_dequantize(data, scale, self.block_dim, self.shape, dtype)
        data, scale = self._data_for("columnwise")
        values_t = bc.block_dequantize(data, scale, self.block_dim, data.shape, dtype)
        return values_t.transpose(-1, -2).reshape(self.shape)

    def update_usage(
        self, rowwise_usage: bool | None = None, columnwise_usage: bool | None = None
    ) -> None:
        """Drop (False) or make (True) a copy; None leaves it as is. 128x128 blocks make a
        missing copy from the other exactly (transposed bytes and scales); 1x128 blocks cannot
        (RuntimeError: the copies are separate quantizations), nor can a value holding neither."""
        for wanted, other in (("rowwise", "columnwise"), ("columnwise", "rowwise")):
            asked = rowwise_usage if wanted == "rowwise" else columnwise_usage
            if not asked or getattr(self, f"{wanted}_data") is not None:
                continue
            if self.block_dim == 1:
                raise self._cannot_make(wanted)
            data, scale = getattr(self, f"{other}_data"), getattr(self, f"{other}_scale_inv")
            if data is None:
                raise RuntimeError(f"cannot make {wanted} FP8 data: the storage holds none")
            made = bc.transpose_block2d(data, scale)
            setattr(self, f"{wanted}_data", made[0])
            setattr(self, f"{wanted}_scale_inv", made[1])
        self._drop(rowwise_usage, columnwise_usage)

    def copy_from_(self, src: Float8BlockwiseQTensorStorage) -> None:
        """Overwrite this value's bytes and scales with src's, keeping every tensor's address.
        src must have the same shape, FP8 dtype and blocks, and every copy this value holds."""
        self._check_copy_source(src)
        if src.block_dim != self.block_dim:
            raise ValueError(f"copy_from_: block_dim {src.block_dim} into {self.block_dim}")
        self._copy_tensors(src, _NAMES)

    def gemm_operand(self, usage: str) -> GemmOperand:
        """The (num_rows, K) operand of the rowwise copy ("rowwise") or the (K, num_rows)
        operand of the columnwise copy ("columnwise"): kind "block1d" or "block2d". A batch of
        128x128-tiled matrices (G, N, K) is one operand only where that is exact (rowwise with
        N a multiple of 128, columnwise with G = 1); else take expert(g)'s."""
        data, scale = self._data_for(usage)
        if self.block_dim == 1:
            return GemmOperand("block1d", data, scale)
        batch, rows, cols = self._matrix()
        count = math.prod(batch)
        if usage == "rowwise" and count > 1 and rows % BLOCK:
            raise ValueError(
                f"a batch of {count} matrices ({rows}, {cols}) is one block2d operand only when "
                f"their rows ({rows}) are a multiple of {BLOCK}: use expert(g)'s operand"
            )
        if usage == "columnwise" and count > 1:
            raise ValueError(
                f"the columnwise copies of a batch of {count} matrices are no single operand "
                "(each is transposed on its own): use expert(g)'s operand"
            )
        return GemmOperand("block2d", data.reshape(-1, data.shape[-1]), scale.flatten(0, -2))

    def expert(self, g: int) -> Float8BlockwiseQTensorStorage:
        """Matrix g (a (N, K) storage) of a 128x128-tiled batch of shape (G, N, K): views of
        this value's tensors, no copies."""
        if self.block_dim != 2 or len(self.shape) != 3:
            raise ValueError(
                f"expert(g) takes matrix g of a 128x128-block value of shape (G, N, K), this "
                f"one has block_dim {self.block_dim} and shape {self.shape}"
            )
        if not 0 <= g < self.shape[0]:
            raise IndexError(f"expert index {g} out of range for {self.shape[0]} experts")
        views = [None if t is None else t[g] for t in self.get_data_tensors()]
        rowwise, columnwise, rowwise_scale, columnwise_scale = views
        return Float8BlockwiseQTensorStorage(
            rowwise, rowwise_scale, columnwise, columnwise_scale, self.fp8_dtype,
            self.shape[1:], 2,
        )  # fmt: skip

    def __repr__(self) -> str:
        usage = self._usage()
        blocks = "1x128" if self.block_dim == 1 else "128x128"
        return (
            f"Float8BlockwiseQTensorStorage(shape={self.shape}, dtype={self.fp8_dtype}, "
            f"blocks={blocks}, usage={usage})"
        )


class GroupedBlockwiseStorage(_BlockStorage):
    """The 1x128-block FP8 values of G groups of rows of a (T, K) tensor (mixture-of-experts
    tokens), sizes possibly on the device only.

    rowwise_data (T, K) + rowwise_scale_inv (ceil(K/128), T): the rows' 1x128 blocks, as
    Float8BlockwiseQTensorStorage's. columnwise_data (K, T) + columnwise_scale_inv
    (max_blocks(T, G), K): each group's columns quantized in blocks of 128 tokens from the
    group's first row (kernels/block_layout.py). row_offsets (G + 1,) and block_offsets (G + 1,)
    int32 on the device; m_splits the G sizes on the host, or None when only the device has
    them. Either copy may be None.
    """

    __slots__ = (
        "block_offsets",
        "columnwise_data",
        "columnwise_scale_inv",
        "fp8_dtype",
        "m_splits",
        "row_offsets",
        "rowwise_data",
        "rowwise_scale_inv",
        "shape",
    )

    _SAVED = (*_NAMES, "row_offsets", "block_offsets")

    def __init__(
        self,
        rowwise_data: torch.Tensor | None,
        rowwise_scale_inv: torch.Tensor | None,
        columnwise_data: torch.Tensor | None,
        columnwise_scale_inv: torch.Tensor | None,
        fp8_dtype: torch.dtype,
        shape: tuple[int, int] | torch.Size,
        row_offsets: torch.Tensor,
        block_offsets: torch.Tensor,
        m_splits: Sequence[int] | None = None,
    ) -> None:
        self.shape = tuple(int(s) for s in shape)
        if len(self.shape) != 2:
            raise ValueError(f"GroupedBlockwiseStorage: shape must be (T, K), got {self.shape}")
        self.rowwise_data, self.rowwise_scale_inv = rowwise_data, rowwise_scale_inv
        self.columnwise_data, self.columnwise_scale_inv = columnwise_data, columnwise_scale_inv
        self.fp8_dtype = _fp8_dtype(fp8_dtype)
        self.row_offsets, self.block_offsets = row_offsets, block_offsets
        self.m_splits = None if m_splits is None else [int(m) for m in m_splits]

    @property
    def num_groups(self) -> int:
        """G, the number of groups."""
        if self.m_splits is not None:
            return len(self.m_splits)
        return self.row_offsets.shape[0] - 1

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The (T, K) high-precision value in `dtype`, from the rowwise copy if held, else
        from the columnwise one (each token's scale row found on the device)."""
        if self.rowwise_data is not None:
            data, scale = self.rowwise_data, self.rowwise_scale_inv
            return bc.block_dequantize(data, scale, 1, self.shape, dtype)
        data, scale = self._data_for("columnwise")
        row_blocks = bc.grouped_row_blocks(self.row_offsets, self.shape[0])
        return (data.float().t() * scale[row_blocks]).to(dtype)

    def update_usage(
        self, rowwise_usage: bool | None = None, columnwise_usage: bool | None = None
    ) -> None:
        """Drop (False) a copy; None leaves it as is. True for a missing copy raises
        RuntimeError: 1x128 copies are separate quantizations."""
        if rowwise_usage and self.rowwise_data is None:
            raise self._cannot_make("rowwise")
        if columnwise_usage and self.columnwise_data is None:
            raise self._cannot_make("columnwise")
        self._drop(rowwise_usage, columnwise_usage)

    def copy_from_(self, src: GroupedBlockwiseStorage) -> None:
        """Overwrite this value's bytes, scales and offsets with src's, keeping every address;
        m_splits taken from src."""
        self._check_copy_source(src)
        if src.num_groups != self.num_groups:
            raise ValueError(f"copy_from_: {src.num_groups} groups into {self.num_groups}")
        self._copy_tensors(src, self._SAVED)
        self.m_splits = None if src.m_splits is None else list(src.m_splits)

    def __repr__(self) -> str:
        usage = self._usage()
        return (
            f"GroupedBlockwiseStorage(shape={self.shape}, groups={self.num_groups}, "
            f"dtype={self.fp8_dtype}, m_splits={self.m_splits}, usage={usage})"
        )


class Float8BlockQuantizer(BlockQuantizerMixin, TEQuantizerMethods, Quantizer):
    """Float8BlockScaling's quantizer (Transformer Engine's keywords): FP8 in 1x128 blocks
    (block_scaling_dim=1) or 128x128 blocks (2), each block's scale from its own amax
    (floored at amax_epsilon; a power of two with force_pow_2_scales). No state between calls.

    internal=False: quantize gives a Float8BlockwiseQTensor (quantization/block_tensor.py).
    rowwise / columnwise: the usages quantize makes when not told (set_usage changes them).
    all_gather_usage: accepted for Transformer Engine's callers; the layout is the same either
    way (the GEMM-ready one). amax_reduction: settable, unused (every block's scale comes from
    its own values, which no rank shares).
    """

    __slots__ = (
        "all_gather_usage",
        "amax_epsilon",
        "amax_reduction",
        "block_len",
        "block_scaling_dim",
        "columnwise_usage",
        "force_pow_2_scales",
        "rowwise_usage",
    )

    @property
    def fusable(self) -> bool:
        """Whether a producer (norm, activation, a gradient's cast with its bias gradient)
        writes this quantizer's values itself: 1x128 blocks, whose scales come from values one
        tile holds (quantization/fused.py)."""
        return self.block_scaling_dim == 1

    def __init__(
        self,
        fp8_dtype: torch.dtype,
        *,
        rowwise: bool = True,
        columnwise: bool = True,
        amax_epsilon: float = 0.0,
        force_pow_2_scales: bool = True,
        block_scaling_dim: int = 2,
        all_gather_usage: bool = False,
        internal: bool = True,
    ) -> None:
        super().__init__(_fp8_dtype(fp8_dtype), internal)
        if block_scaling_dim not in (1, 2):
            raise ValueError(
                f"block_scaling_dim must be 1 (1x128) or 2 (128x128), got {block_scaling_dim}"
            )
        eps = float(amax_epsilon)
        if not (math.isfinite(eps) and eps >= 0.0):
            raise ValueError(f"amax_epsilon must be finite and >= 0, got {amax_epsilon}")
        self.rowwise_usage, self.columnwise_usage = bool(rowwise), bool(columnwise)
        self.amax_epsilon = eps
        self.force_pow_2_scales = bool(force_pow_2_scales)
        self.block_scaling_dim = block_scaling_dim
        self.block_len = BLOCK
        self.all_gather_usage = bool(all_gather_usage)
        self.amax_reduction = None

    def copy(self) -> Float8BlockQuantizer:
        """A quantizer with the same settings (amax_reduction included)."""
        quantizer = Float8BlockQuantizer(
            self.fp8_dtype, rowwise=self.rowwise_usage, columnwise=self.columnwise_usage,
            amax_epsilon=self.amax_epsilon, force_pow_2_scales=self.force_pow_2_scales,
            block_scaling_dim=self.block_scaling_dim, all_gather_usage=self.all_gather_usage,
            internal=self.internal,
        )  # fmt: skip
        quantizer.amax_reduction = self.amax_reduction
        return quantizer

    def is_quantizable(self, inp: torch.Tensor) -> bool:
        """Transformer Engine's rule for this format: at least 2-D, the last dim and the
        product of the others multiples of the block length (128)."""
        shape = tuple(inp.shape)
        if len(shape) < 2:
            return False
        return shape[-1] % self.block_len == 0 and math.prod(shape[:-1]) % self.block_len == 0

    def _usages(self, rowwise: bool | None, columnwise: bool | None) -> tuple[bool, bool]:
        return (
            self.rowwise_usage if rowwise is None else bool(rowwise),
            self.columnwise_usage if columnwise is None else bool(columnwise),
        )

    def quantize(
        self, x_hp: torch.Tensor, *, rowwise: bool | None = None, columnwise: bool | None = None
    ) -> Float8BlockwiseQTensorStorage | torch.Tensor:
        """x_hp (..., K) fp32 / bf16 / fp16 -> Float8BlockwiseQTensorStorage of x_hp's shape
        (a Float8BlockwiseQTensor over it when not internal), with the copies asked for (None:
        the quantizer's usage). 1x128: x_hp as (M, K); 128x128: each trailing matrix tiled on
        its own (x_hp (G, N, K): G experts' weights). One kernel launch on CUDA (none when no
        copy is asked for)."""
        if not isinstance(x_hp, torch.Tensor) or x_hp.dim() == 0:
            raise ValueError("x_hp must be a tensor of at least one dimension (..., K)")
        rowwise, columnwise = self._usages(rowwise, columnwise)
        shape, dim = tuple(x_hp.shape), self.block_scaling_dim
        out = (None, None, None, None)
        if rowwise or columnwise:
            x = x_hp.detach()
            if dim == 1:
                x = x.reshape(math.prod(shape[:-1]), shape[-1])
            elif len(shape) == 1:
                x = x.reshape(1, shape[0])
            out = bc.block_quantize(
                x, self.fp8_dtype, dim, rowwise, columnwise, self.force_pow_2_scales,
                self.amax_epsilon,
            )  # fmt: skip
        storage = Float8BlockwiseQTensorStorage(*out, self.fp8_dtype, shape, dim)
        return self._output(storage, x_hp.dtype)

    def __call__(self, x_hp: torch.Tensor) -> Float8BlockwiseQTensorStorage:
        """quantize(x_hp) with this quantizer's usages (Transformer Engine's call form)."""
        return self.quantize(x_hp)

    def quantize_grouped(
        self,
        x: torch.Tensor,
        row_offsets: torch.Tensor,
        m_splits: Sequence[int] | None = None,
        rowwise: bool = True,
        columnwise: bool = True,
    ) -> GroupedBlockwiseStorage:
        """x (T, K) in G groups of rows (row_offsets (G + 1,) int32 on x's device; m_splits
        the same sizes on the host, or None) -> GroupedBlockwiseStorage in 1x128 blocks
        (block_scaling_dim must be 1). One kernel launch on CUDA, no host synchronization; the
        block offsets from m_splits where given (block_layout.host_block_offsets: a tensor
        shared by the calls with the same sizes), else from row_offsets on the device."""
        if self.block_scaling_dim != 1:
            raise ValueError(
                "quantize_grouped makes the grouped 1x128 layout: needs block_scaling_dim=1, "
                f"this quantizer has {self.block_scaling_dim}"
            )
        bc.check_row_offsets(x, row_offsets)
        groups = row_offsets.shape[0] - 1
        if m_splits is not None:
            if len(m_splits) != groups:
                raise ValueError(f"m_splits has {len(m_splits)} sizes, row_offsets {groups}")
            check_splits(m_splits, x.shape[0])
        if rowwise or columnwise:
            out = bc.grouped_block_quantize(
                x.detach(), row_offsets, self.fp8_dtype, rowwise, columnwise,
                self.force_pow_2_scales, self.amax_epsilon,
            )  # fmt: skip
        else:
            out = (None, None, None, None)
        if m_splits is None:
            blocks = block_offsets(row_offsets)
        else:  # summed on the host: no launches (cached on a GPU)
            blocks = host_block_offsets(m_splits, row_offsets)
        shape = tuple(x.shape)
        return GroupedBlockwiseStorage(*out, self.fp8_dtype, shape, row_offsets, blocks, m_splits)

    def __repr__(self) -> str:
        return (
            f"Float8BlockQuantizer(fp8_dtype={self.fp8_dtype}, "
            f"block_scaling_dim={self.block_scaling_dim}, "
            f"force_pow_2_scales={self.force_pow_2_scales}, amax_epsilon={self.amax_epsilon}, "
            f"rowwise={self.rowwise_usage}, columnwise={self.columnwise_usage})"
        )
