"""The contracts every quantized value and quantizer follows.

A Quantizer turns a high-precision tensor into a quantized value. With `internal=True` it makes
a Storage (a plain object with __slots__, what autograd Functions save); with `internal=False` a
QuantizedTensor (a torch.Tensor wrapper subclass a user can hold). The offloader and
checkpointing reach the data of any Storage only through the QuantizedStorage methods.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = ["QuantizedStorage", "Quantizer", "round_up"]


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= value."""
    return (value + multiple - 1) // multiple * multiple


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
