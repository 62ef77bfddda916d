"""The contracts every quantized value and quantizer follows.

A Quantizer turns a high-precision tensor into a quantized value. With `internal=True` it makes
a Storage (a plain object with __slots__, what autograd Functions save); with `internal=False` a
QuantizedTensor (a torch.Tensor wrapper subclass a user can hold). The offloader and
checkpointing reach the data of any Storage only through the QuantizedStorage methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

__all__ = [
    "BLOCK",
    "GemmOperand",
    "QuantizedStorage",
    "QuantizedTensor",
    "Quantizer",
    "TwoUsageStorage",
]


@runtime_checkable
class QuantizedStorage(Protocol):
    """What every quantized value answers, whatever its recipe."""

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The high-precision value, of the original shape."""
        ...

    def update_usage(
        self, rowwise_usage: bool | None = None, columnwise_usage: bool | None = None
    ) -> None:
        """Make (True) or drop (False) the rowwise / columnwise copies; None leaves one as is."""
        ...

    def prepare_for_saving(self) -> tuple[list[torch.Tensor | None], QuantizedStorage]:
        """Its data tensors, and itself with them removed (to be restored later)."""
        ...

    def restore_from_saved(self, tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Take back the data tensors from the front of `tensors`; return the rest."""
        ...

    def get_data_tensors(self) -> tuple[torch.Tensor | None, ...]:
        """Every tensor it holds, in a fixed order."""
        ...


class TwoUsageStorage:
    """The part of an FP8 Storage with rowwise and columnwise copies of its data that does not
    depend on their layout: making and dropping copies, saving and restoring. A subclass holds
    rowwise_data, columnwise_data, scale_inv in its __slots__ and gives the two byte-exact
    conversions `_rowwise_from_columnwise` and `_columnwise_from_rowwise`."""

    __slots__ = ()

    def update_usage(
        self, rowwise_usage: bool | None = None, columnwise_usage: bool | None = None
    ) -> None:
        """Make (True) or drop (False) the rowwise / columnwise copies, a missing one rebuilt
        exactly from the other; None leaves one as is. RuntimeError when both are gone."""
        if rowwise_usage and self.rowwise_data is None:
            self._require_data("rowwise")
            self.rowwise_data = self._rowwise_from_columnwise()
        if columnwise_usage and self.columnwise_data is None:
            self._require_data("columnwise")
            self.columnwise_data = self._columnwise_from_rowwise()
        if rowwise_usage is False:
            self.rowwise_data = None
        if columnwise_usage is False:
            self.columnwise_data = None

    def _require_data(self, wanted: str) -> None:
        if self.rowwise_data is None and self.columnwise_data is None:
            name = type(self).__name__
            raise RuntimeError(f"cannot make {wanted} FP8 data: the {name} holds none")

    def prepare_for_saving(self):
        """Its data tensors (rowwise, columnwise, scale_inv), and itself emptied of them."""
        tensors = [self.rowwise_data, self.columnwise_data, self.scale_inv]
        self.rowwise_data = self.columnwise_data = self.scale_inv = None
        return tensors, self

    def restore_from_saved(self, tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Take back (rowwise, columnwise, scale_inv) from the front of tensors; return the rest."""
        self.rowwise_data, self.columnwise_data, self.scale_inv = tensors[:3]
        return tensors[3:]

    def get_data_tensors(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """(rowwise_data, columnwise_data, scale_inv)."""
        return self.rowwise_data, self.columnwise_data, self.scale_inv


class QuantizedTensor(torch.Tensor):
    """The base class of torchte's quantized tensors (Float8Tensor): a torch.Tensor wrapper
    subclass of the shape, device and nominal high-precision dtype of the value it holds in
    quantized form. `isinstance(t, QuantizedTensor)` tells any quantized tensor, as in
    Transformer Engine; a subclass holds the bytes and answers dequantize."""

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The plain value, of self's shape, in `dtype` (default: the nominal dtype)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement dequantize")


class Quantizer:
    """Makes quantized values from high-precision tensors; subclasses carry a recipe's choices.

    `internal` chooses what `quantize` returns: a Storage (True) or a QuantizedTensor (False).
    """

    __slots__ = ("fp8_dtype", "internal")

    def __init__(self, fp8_dtype: torch.dtype, internal: bool = True) -> None:
        self.fp8_dtype = fp8_dtype
        self.internal = internal

    def quantize(
        self, x_hp: torch.Tensor, *, rowwise: bool = True, columnwise: bool = True
    ) -> QuantizedStorage:
        raise NotImplementedError

    def record_amax(self, x_hp: torch.Tensor) -> None:
        """Record x's amax as quantizing it would, without quantizing (calibration)."""
        raise NotImplementedError


# The side of a scaling block of the block-scaled FP8 formats (Float8BlockScaling).
BLOCK = 128


@dataclass(frozen=True, slots=True)
class GemmOperand:
    """One operand of a K-major GEMM, logically an (R, K) matrix (R: rows of the GEMM's output
    side, K: the reduced dimension), as a block-scaled storage hands it to gemm.py.

    kind:
    - "block1d": data (R, K) fp8 row-major; scale (ceil(K/128), R) fp32 contiguous, scale of
      row r, K-block j at [j, r] (1x128 blocks along K): value = data * scale.
    - "block2d": data (R, K) fp8 row-major; scale (ceil(R/128), round_up(ceil(K/128), 4)) fp32
      contiguous, scale of tile (i, j) at [i, j] (128x128 tiles; the padding columns unused).
    - "values": data (R, K) high precision (bf16 or fp32) holding the exact dequantized values
      of an emulated format, possibly a transposed view; scale (1,) fp32 that multiplies every
      product of a GEMM with this operand (NVFP4's per-tensor factor), or None.
    """

    kind: str
    data: torch.Tensor
    scale: torch.Tensor | None

    def rows(self, rows: slice) -> GemmOperand:
        """The operand of rows `rows` (a slice of R) only, scales made to match the layout."""
        if rows == slice(None):
            return self
        if self.kind == "block1d":
            return GemmOperand("block1d", self.data[rows], self.scale[:, rows].contiguous())
        if self.kind == "block2d":
            start, stop, _ = rows.indices(self.data.shape[0])
            if start % BLOCK:
                raise ValueError(f"block2d operand: rows must start at a multiple of {BLOCK}")
            tiles = slice(start // BLOCK, -(-stop // BLOCK))
            return GemmOperand("block2d", self.data[rows], self.scale[tiles])
        return GemmOperand(self.kind, self.data[rows], self.scale)
