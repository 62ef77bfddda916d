"""te.ops.Reshape: y = x.reshape(shape)."""

from __future__ import annotations

from collections.abc import Sequence

from ..op import BasicOperation

__all__ = ["Reshape"]


class Reshape(BasicOperation):
    """y = x.reshape(shape) (one entry may be -1); backward reshapes the gradient back."""

    def __init__(self, shape: Sequence[int], *, device=None) -> None:
        super().__init__(device, None)
        self.shape = tuple(shape)
        self._finish_init()

    def output_features(self, features: int | None) -> int | None:
        last = self.shape[-1] if self.shape else None
        return None if last in (None, -1) else last

    def output_rows(self, rows: int | None) -> int | None:
        return None  # the last dimension may change

    def op_forward(self, ctx, x, extra_inputs, settings):
        ctx.input_shape = x.shape
        return x.reshape(self.shape), ()

    def op_backward(self, ctx, dy, extra_output_grads):
        return dy.reshape(ctx.input_shape), (), ()

    def extra_repr(self) -> str:
        return f"shape={self.shape}"
