"""The scaled activations (te.ops.ScaledSwiGLU ...): y = act(x) * s, s an extra input of one
value per row (the router's probabilities of a mixture-of-experts MLP), as Transformer Engine
takes them: x (..., K), s with one element per row of x ((T,) for x (T, K)).

The arithmetic is kernels/scaled_activation.py's; before a te.ops.GroupedLinear under FP8 the
fuser computes it inside the kernel that writes the GEMM's FP8 input (ops/fused/grouped_mlp.py).
"""

from __future__ import annotations

import torch

from torchte.kernels.scaled_activation import (
    scaled_activation_backward,
    scaled_activation_forward,
)
from torchte.module._norm_spec import rows_of

from ._row_scales import check_row_scales
from .activation import (
    GEGLU,
    GELU,
    GLU,
    QGEGLU,
    QGELU,
    ClampedSwiGLU,
    ReGLU,
    ReLU,
    SiLU,
    SReGLU,
    SReLU,
    SwiGLU,
)

__all__ = [
    "ScaledClampedSwiGLU",
    "ScaledGEGLU",
    "ScaledGELU",
    "ScaledGLU",
    "ScaledQGEGLU",
    "ScaledQGELU",
    "ScaledReGLU",
    "ScaledReLU",
    "ScaledSReGLU",
    "ScaledSReLU",
    "ScaledSiLU",
    "ScaledSwiGLU",
]


_WHAT = "its extra input (the per-row scales)"


class _Scaled:
    """Mixed in before an activation op: the per-row scales come as one extra input."""

    num_extra_inputs = 1

    def __init__(self, *args, gate_interleave_size: int | None = None, **kwargs) -> None:
        if gate_interleave_size is not None:
            raise NotImplementedError(
                f"te.ops.{type(self).__name__}: gate_interleave_size is not implemented in "
                "torchte yet (the two halves of the input are [activation | gate])"
            )
        super().__init__(*args, **kwargs)

    def check_extra_inputs(self, extra_inputs: tuple, rows: int | None) -> None:
        if rows is not None:
            check_row_scales(f"te.ops.{type(self).__name__}", _WHAT, extra_inputs[0], rows)

    def scales_of(self, x: torch.Tensor, scales) -> torch.Tensor:
        """The scales as (rows of x,): TypeError / ValueError naming the op when they do not
        fit x (one per row: shaped (rows,), x's leading dims, or those and a trailing 1)."""
        rows = x.numel() // x.shape[-1] if x.dim() else 0
        who = f"te.ops.{type(self).__name__}"
        check_row_scales(who, _WHAT, scales, rows, x.device)
        fitting = {(rows,), tuple(x.shape[:-1]), (*x.shape[:-1], 1)}
        if tuple(scales.shape) not in fitting:
            raise ValueError(
                f"{who}: {_WHAT} has shape {tuple(scales.shape)}, but the input has shape "
                f"{tuple(x.shape)}: one scale per row, shaped as its leading dims"
            )
        return scales.reshape(-1)

    def op_forward(self, ctx, x, extra_inputs, settings):
        s = self.scales_of(x, extra_inputs[0])
        x2d = rows_of(x if x.dtype == settings.dtype else x.to(settings.dtype))
        y2d = scaled_activation_forward(x2d, s, *self.activation())
        if settings.requires_grad:
            ctx.save_for_backward(x2d, s)
            ctx.scales_grad = extra_inputs[0].requires_grad
            ctx.scales_shape = extra_inputs[0].shape
        return y2d.view(*x.shape[:-1], y2d.shape[-1]), ()

    def op_backward(self, ctx, dy, extra_output_grads):
        x2d, s = ctx.saved
        dy2d = rows_of(dy)
        dx2d, ds = scaled_activation_backward(dy2d, x2d, s, *self.activation(), ctx.scales_grad)
        if ds is not None:
            ds = ds.view(ctx.scales_shape)
        return dx2d.view(*dy.shape[:-1], dx2d.shape[-1]), (ds,), ()


class ScaledGELU(_Scaled, GELU):
    """GELU (tanh approximation) times a per-row scale."""


class ScaledGEGLU(_Scaled, GEGLU):
    """GEGLU times a per-row scale."""


class ScaledGLU(_Scaled, GLU):
    """Sigmoid-gated linear unit (sigmoid of the first half) times a per-row scale."""


class ScaledQGELU(_Scaled, QGELU):
    """Quick GELU times a per-row scale."""


class ScaledQGEGLU(_Scaled, QGEGLU):
    """Quick-GELU-gated linear unit times a per-row scale."""


class ScaledReLU(_Scaled, ReLU):
    """ReLU times a per-row scale."""


class ScaledReGLU(_Scaled, ReGLU):
    """ReGLU times a per-row scale."""


class ScaledSReLU(_Scaled, SReLU):
    """Squared ReLU times a per-row scale."""


class ScaledSReGLU(_Scaled, SReGLU):
    """Squared-ReLU-gated linear unit times a per-row scale."""


class ScaledSiLU(_Scaled, SiLU):
    """SiLU times a per-row scale."""


class ScaledSwiGLU(_Scaled, SwiGLU):
    """SwiGLU times a per-row scale (the router's probabilities of an MoE MLP)."""


class ScaledClampedSwiGLU(_Scaled, ClampedSwiGLU):
    """Clamped SwiGLU times a per-row scale."""
