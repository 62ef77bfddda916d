"""te.ops.Dropout: in training, zero each element with probability p and scale the rest by
1 / (1 - p); in eval mode, y = x."""

from __future__ import annotations

import torch

from ..op import BasicOperation

__all__ = ["Dropout"]


class Dropout(BasicOperation):
    """Dropout with probability p (0 <= p < 1); the mask is kept (as bool) for backward."""

    def __init__(self, p: float, *, device=None) -> None:
        super().__init__(device, None)
        if not 0.0 <= p < 1.0:
            raise ValueError(f"te.ops.Dropout: p must be in [0, 1), got {p}")
        self.p = float(p)
        self._finish_init()

    def op_forward(self, ctx, x, extra_inputs, settings):
        if not self.training or self.p == 0.0:
            ctx.scale = None
            return x, ()
        keep = torch.rand(x.shape, device=x.device) >= self.p
        ctx.scale = 1.0 / (1.0 - self.p)
        if settings.requires_grad:
            ctx.save_for_backward(keep)
        return x * keep * ctx.scale, ()

    def op_backward(self, ctx, dy, extra_output_grads):
        if ctx.scale is None:
            return dy, (), ()
        (keep,) = ctx.saved
        return dy * keep * ctx.scale, (), ()

    def extra_repr(self) -> str:
        return f"p={self.p}"
