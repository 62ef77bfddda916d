"""te.ops.AddExtraInput: y = x + extra (a residual), extra an extra input of x's shape."""

from __future__ import annotations

from ..op import BasicOperation

__all__ = ["AddExtraInput"]


class AddExtraInput(BasicOperation):
    """y = x + extra; in_place adds into extra's storage (no new buffer), as Transformer
    Engine's option does."""

    num_extra_inputs = 1

    def __init__(self, in_place: bool = False, *, device=None) -> None:
        super().__init__(device, None)
        self.in_place = in_place
        self._finish_init()

    def op_forward(self, ctx, x, extra_inputs, settings):
        (extra,) = extra_inputs
        if extra.shape != x.shape:
            raise ValueError(
                f"te.ops.AddExtraInput: the extra input has shape {tuple(extra.shape)}, but the "
                f"op's input has {tuple(x.shape)}; they must match"
            )
        if self.in_place and not settings.requires_grad:
            return extra.add_(x), ()
        return x + extra, ()

    def op_backward(self, ctx, dy, extra_output_grads):
        return dy, (dy,), ()
