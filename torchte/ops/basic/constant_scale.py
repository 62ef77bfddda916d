"""te.ops.ConstantScale: y = scale * x for a fixed Python number."""

from __future__ import annotations

from ..op import BasicOperation

__all__ = ["ConstantScale"]


class ConstantScale(BasicOperation):
    """y = scale * x; dx = scale * dy."""

    def __init__(self, scale: float, *, device=None) -> None:
        super().__init__(device, None)
        self.scale = float(scale)
        self._finish_init()

    def op_forward(self, ctx, x, extra_inputs, settings):
        return x * self.scale, ()

    def op_backward(self, ctx, dy, extra_output_grads):
        return dy * self.scale, (), ()

    def extra_repr(self) -> str:
        return f"scale={self.scale}"
