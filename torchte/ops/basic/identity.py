"""te.ops.Identity: y = x."""

from __future__ import annotations

from ..op import BasicOperation

__all__ = ["Identity"]


class Identity(BasicOperation):
    """y = x; the gradient passes through."""

    def __init__(self, *, device=None) -> None:
        super().__init__(device, None)
        self._finish_init()

    def op_forward(self, ctx, x, extra_inputs, settings):
        return x, ()

    def op_backward(self, ctx, dy, extra_output_grads):
        return dy, (), ()
