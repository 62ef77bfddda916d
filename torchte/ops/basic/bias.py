"""te.ops.Bias: y = x + b over the last dimension. Legend: x, y (..., local_size), b (local_size,)
with local_size = size, or size / P with tensor_parallel over P ranks (the features split as a
column-parallel linear op splits its output)."""

from __future__ import annotations

import torch
from torch import nn

from torchte.module._lifecycle import ParameterInit, fill

from ..op import BasicOperation
from ._parallel import group_size

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
        if size <= 0:
            raise ValueError(f"size must be positive, got {size}")
        ranks = 1
        if tensor_parallel:
            ranks = group_size("te.ops.Bias(tensor_parallel=True)", tensor_parallel_group)
        if size % ranks:
            raise ValueError(
                f"te.ops.Bias: size={size} must be divisible by the {ranks} tensor-parallel ranks"
            )
        self.tensor_parallel = ranks > 1
        self.tensor_parallel_group = tensor_parallel_group if ranks > 1 else None
        self.tensor_parallel_size = ranks
        self.size, self.local_size = size, size // ranks
        self.bias = nn.Parameter(
            torch.zeros(self.local_size, dtype=self.params_dtype, device=self.device)
        )
        self._finish_init()

    @property
    def input_features(self) -> int:
        return self.local_size

    def _parameter_inits(self) -> list[ParameterInit]:
        return [ParameterInit(("bias",), fill(0.0))]

    def _check_parameter(self, name: str, param) -> None:
        if name == "bias" and tuple(param.shape) != (self.local_size,):
            raise ValueError(
                f"te.ops.Bias: the bias must have shape ({self.local_size},), got "
                f"{tuple(param.shape)}"
            )

    def op_forward(self, ctx, x, extra_inputs, settings):
        dtype = settings.dtype
        b = self.bias if self.bias.dtype == dtype else self.bias.to(dtype)
        return (x if x.dtype == dtype else x.to(dtype)) + b, ()

    def op_backward(self, ctx, dy, extra_output_grads):
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if self.bias.requires_grad else None
        return dy, (), (db,)

    def extra_repr(self) -> str:
        local = f", local_size={self.local_size}" if self.tensor_parallel else ""
        return f"size={self.size}{local}"
