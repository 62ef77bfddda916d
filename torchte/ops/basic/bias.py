"""te.ops.Bias: y = x + b over the last dimension. Legend: x, y (..., size), b (size,)."""

from __future__ import annotations

import torch
from torch import nn

from torchte.module._lifecycle import ParameterInit, fill

from ..op import BasicOperation

__all__ = ["Bias"]


class Bias(BasicOperation):
    """y = x + b, b initialized to zero; computed in the run's compute dtype."""

    def __init__(
        self,
        size: int,
        *,
        device=None,
        dtype: torch.dtype | None = None,
        tensor_parallel: bool = False,
        tensor_parallel_group=None,
    ) -> None:
        super().__init__(device, dtype)
        if tensor_parallel or tensor_parallel_group is not None:
            raise NotImplementedError(
                "te.ops.Bias: tensor_parallel is not implemented in torchte yet"
            )
        if size <= 0:
            raise ValueError(f"size must be positive, got {size}")
        self.size = size
        self.bias = nn.Parameter(torch.zeros(size, dtype=self.params_dtype, device=self.device))
        self._finish_init()

    @property
    def input_features(self) -> int:
        return self.size

    def _parameter_inits(self) -> list[ParameterInit]:
        return [ParameterInit(("bias",), fill(0.0))]

    def op_forward(self, ctx, x, extra_inputs, settings):
        dtype = settings.dtype
        b = self.bias if self.bias.dtype == dtype else self.bias.to(dtype)
        return (x if x.dtype == dtype else x.to(dtype)) + b, ()

    def op_backward(self, ctx, dy, extra_output_grads):
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if self.bias.requires_grad else None
        return dy, (), (db,)

    def extra_repr(self) -> str:
        return f"size={self.size}"
