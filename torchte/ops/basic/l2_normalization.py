"""te.ops.L2Normalization: each vector along the last dimension scaled to unit L2 norm, without
parameters (the query / key normalization of attention, qk_norm_type="L2Normalization").

    y = x / sqrt(sum_i x_i^2 + eps)        r = 1 / sqrt(sum_i x_i^2 + eps)
    dx = r (dy - x r^2 sum_i x_i dy_i)

Computed in fp32 whatever the input's dtype, y returned in it (torch.autocast does not apply),
as Transformer Engine's op computes it. x (..., N) -> y (..., N); backward keeps x and r
(..., 1) fp32.
"""

from __future__ import annotations

import torch

from ..op import BasicOperation

__all__ = ["L2Normalization", "l2_normalize", "l2_normalize_backward"]


def l2_normalize(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y in x's dtype, r (..., 1) fp32) for x (..., N)."""
    x32 = x.float()
    r = torch.rsqrt(x32.square().sum(-1, keepdim=True) + eps)
    return (x32 * r).to(x.dtype), r


def l2_normalize_backward(dy: torch.Tensor, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """dx in x's dtype for dy, x (..., N) and l2_normalize's r."""
    x32, dy32 = x.float(), dy.float()
    dot = (x32 * dy32).sum(-1, keepdim=True)
    return (r * (dy32 - x32 * (dot * r * r))).to(x.dtype)


class L2Normalization(BasicOperation):
    """y = x / sqrt(sum(x^2) + eps) over the last dimension; Transformer Engine's arguments
    (seq_length and micro_batch_size only size its JIT warm-up: accepted, unused here)."""

    def __init__(
        self,
        *,
        eps: float = 1e-6,
        seq_length: int | None = None,
        micro_batch_size: int | None = None,
        device=None,
    ) -> None:
        if not eps >= 0:
            raise ValueError(f"te.ops.L2Normalization: eps must be >= 0, got {eps}")
        super().__init__(device, None)
        self.eps = float(eps)
        self._finish_init()

    def op_forward(self, ctx, x, extra_inputs, settings):
        y, r = l2_normalize(x, self.eps)
        if settings.requires_grad:
            ctx.save_for_backward(x, r)
        return y, ()

    def op_backward(self, ctx, dy, extra_output_grads):
        x, r = ctx.saved
        return l2_normalize_backward(dy, x, r), (), ()

    def extra_repr(self) -> str:
        return f"eps={self.eps}"
