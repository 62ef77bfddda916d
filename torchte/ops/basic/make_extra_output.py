"""te.ops.MakeExtraOutput: y = x, and x again as an extra output (e.g. for a residual)."""

from __future__ import annotations

from ..op import BasicOperation

__all__ = ["MakeExtraOutput"]


class MakeExtraOutput(BasicOperation):
    """y = x, extra output = x; their gradients add up in backward."""

    num_extra_outputs = 1

    def __init__(self, in_place: bool = False, *, device=None) -> None:
        super().__init__(device, None)
        self.in_place = in_place
        self._finish_init()

    def op_forward(self, ctx, x, extra_inputs, settings):
        # Two tensors out of one Function must not be the same object: the extra one is a view.
        return x, (x.view(x.shape),)

    def op_backward(self, ctx, dy, extra_output_grads):
        (d_extra,) = extra_output_grads
        if d_extra is None:
            return dy, (), ()
        if dy is None:
            return d_extra, (), ()
        return dy + d_extra, (), ()
