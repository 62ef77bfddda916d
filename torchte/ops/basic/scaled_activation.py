"""The scaled activations (te.ops.ScaledSwiGLU ...): y = act(x) * s, s an extra input of one
value per row (the router's probabilities of a mixture-of-experts MLP), as Transformer Engine
takes them: x (..., K), s with one element per row of x ((T,) for x (T, K)).

Transformer Engine's are ScaledSwiGLU, ScaledClampedQGeGLU (glu_interleave_size,
activation_recompute_in_mlp, limit / alpha / glu_linear_offset) and ScaledSReLU
(activation_recompute_in_mlp); torchte adds the scaled form of every other activation. A client
that sets `_grouped_mlp_unit_activation_scale = True` on an op (Megatron-Core's shared experts:
not router-gated) may give one scale for all rows, s of one element.

The arithmetic is kernels/scaled_activation.py's; before a te.ops.GroupedLinear under FP8 the
fuser computes it inside the kernel that writes the GEMM's FP8 input (ops/fused/grouped_mlp.py).
"""

from __future__ import annotations

import torch

from torchte.kernels.scaled_activation import (
    scaled_activation_backward,
    scaled_activation_forward,
)

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
    check_clamp,
)

__all__ = [
    "ScaledClampedQGeGLU",
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
    client_attributes = frozenset({"_grouped_mlp_unit_activation_scale"})
    _grouped_mlp_unit_activation_scale = False
    activation_recompute_in_mlp = False

    def _one_scale(self, scales, rows: int) -> bool:
        """Whether `scales` is the one scale of every row a unit-scale op may take."""
        unit = self.__dict__.get("_grouped_mlp_unit_activation_scale", False)
        return bool(unit) and isinstance(scales, torch.Tensor) and scales.numel() == 1 != rows

    def check_extra_inputs(self, extra_inputs: tuple, rows: int | None) -> None:
        if rows is not None and not self._one_scale(extra_inputs[0], rows):
            check_row_scales(f"te.ops.{type(self).__name__}", _WHAT, extra_inputs[0], rows)

    def scales_of(self, x: torch.Tensor, scales) -> torch.Tensor:
        """The scales as (rows of x,): TypeError / ValueError naming the op when they do not
        fit x (one per row: shaped (rows,), x's leading dims, or those and a trailing 1; or one
        for all rows where the op is marked unit-scale)."""
        rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
        who = f"te.ops.{type(self).__name__}"
        if self._one_scale(scales, rows):
            check_row_scales(who, _WHAT, scales, 1, x.device)
            return scales.reshape(1).expand(rows).contiguous()
        check_row_scales(who, _WHAT, scales, rows, x.device)
        fitting = {(rows,), tuple(x.shape[:-1]), (*x.shape[:-1], 1)}
        if tuple(scales.shape) not in fitting:
            raise ValueError(
                f"{who}: {_WHAT} has shape {tuple(scales.shape)}, but the input has shape "
                f"{tuple(x.shape)}: one scale per row, shaped as its leading dims"
            )
        return scales.reshape(-1)

    def save_scales(self, ctx, scales: torch.Tensor) -> None:
        """Record on ctx what scales_grad needs of the extra input `scales`."""
        ctx.scales_grad, ctx.scales_shape = scales.requires_grad, scales.shape

    @staticmethod
    def scales_grad(ctx, ds: torch.Tensor | None) -> torch.Tensor | None:
        """The gradient of the extra input from the per-row ds (M,): summed where one scale
        stood for every row."""
        if ds is None:
            return None
        if ds.numel() != ctx.scales_shape.numel():
            ds = ds.sum().reshape(1)
        return ds.view(ctx.scales_shape)

    def scaled_forward(self, x2d: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """y = act(x2d) * s: x2d (M, K), s (M,) -> (M, N) in x2d's dtype."""
        return scaled_activation_forward(x2d, s, *self.activation())

    def scaled_backward(self, dy2d, x2d, s, need_ds: bool):
        """(dx (M, K) in x2d's dtype, ds (M,) in s's dtype or None unless need_ds)."""
        return scaled_activation_backward(dy2d, x2d, s, *self.activation(), need_ds)

    def op_forward(self, ctx, x, extra_inputs, settings):
        s = self.scales_of(x, extra_inputs[0])
        x2d = self.kernel_input(x, settings.dtype)
        y2d = self.scaled_forward(x2d, s)
        if settings.requires_grad:
            ctx.save_for_backward(x2d, s)
            self.save_scales(ctx, extra_inputs[0])
        return y2d.view(*x.shape[:-1], y2d.shape[-1]), ()

    def op_backward(self, ctx, dy, extra_output_grads):
        x2d, s = ctx.saved
        dy2d = dy.reshape(-1, dy.shape[-1])
        dx2d, ds = self.scaled_backward(dy2d, x2d, s, ctx.scales_grad)
        dx2d = self.input_grad(dx2d)
        return dx2d.view(*dy.shape[:-1], dx2d.shape[-1]), (self.scales_grad(ctx, ds),), ()


class _ScaledGated(_Scaled):
    """A scaled gated activation with Transformer Engine's arguments (ScaledSwiGLU's)."""

    def __init__(
        self,
        glu_interleave_size: int | None = None,
        *,
        activation_recompute_in_mlp: bool = False,
        device=None,
    ) -> None:
        _check_gated_options(type(self).__name__, activation_recompute_in_mlp)
        super().__init__(glu_interleave_size=glu_interleave_size, device=device)


class _ScaledUnary(_Scaled):
    """A scaled elementwise activation with Transformer Engine's arguments (ScaledSReLU's)."""

    def __init__(self, *, activation_recompute_in_mlp: bool = False, device=None) -> None:
        if activation_recompute_in_mlp:
            raise NotImplementedError(
                f"te.ops.{type(self).__name__}: activation_recompute_in_mlp=True (the activation "
                "recomputed for the second GEMM's weight gradient instead of kept) is not "
                "implemented in torchte"
            )
        super().__init__(device=device)


def _check_gated_options(name: str, recompute: bool) -> None:
    """Transformer Engine's refusal of activation_recompute_in_mlp for its scaled GLUs."""
    if recompute:
        raise ValueError(
            f"te.ops.{name} does not support activation recomputation in the fused grouped MLP "
            "(activation_recompute_in_mlp must be False)"
        )


class ScaledGELU(_ScaledUnary, GELU):
    """GELU (tanh approximation) times a per-row scale."""


class ScaledGEGLU(_ScaledGated, GEGLU):
    """GEGLU times a per-row scale."""


class ScaledGLU(_ScaledGated, GLU):
    """Sigmoid-gated linear unit (sigmoid of the first half) times a per-row scale."""


class ScaledQGELU(_ScaledUnary, QGELU):
    """Quick GELU times a per-row scale."""


class ScaledQGEGLU(_ScaledGated, QGEGLU):
    """Quick-GELU-gated linear unit times a per-row scale."""


class ScaledReLU(_ScaledUnary, ReLU):
    """ReLU times a per-row scale."""


class ScaledReGLU(_ScaledGated, ReGLU):
    """ReGLU times a per-row scale."""


class ScaledSReLU(_ScaledUnary, SReLU):
    """Squared ReLU times a per-row scale (Transformer Engine's ScaledSReLU)."""


class ScaledSReGLU(_ScaledGated, SReGLU):
    """Squared-ReLU-gated linear unit times a per-row scale."""


class ScaledSiLU(_ScaledUnary, SiLU):
    """SiLU times a per-row scale."""


class ScaledSwiGLU(_ScaledGated, SwiGLU):
    """SwiGLU times a per-row scale (the router's probabilities of an MoE MLP); Transformer
    Engine's ScaledSwiGLU(glu_interleave_size, activation_recompute_in_mlp)."""


class ScaledClampedSwiGLU(_Scaled, ClampedSwiGLU):
    """Clamped SwiGLU (see te.ops.ClampedSwiGLU) times a per-row scale."""

    def __init__(
        self,
        glu_interleave_size: int | None = None,
        *,
        activation_recompute_in_mlp: bool = False,
        limit: float = 7.0,
        alpha: float = 1.702,
        glu_linear_offset: float = 1.0,
        device=None,
    ) -> None:
        _check_gated_options(type(self).__name__, activation_recompute_in_mlp)
        check_clamp(type(self).__name__, limit, glu_linear_offset)
        super().__init__(
            limit=limit,
            alpha=alpha,
            glu_linear_offset=glu_linear_offset,
            glu_interleave_size=glu_interleave_size,
            device=device,
        )


class ScaledClampedQGeGLU(ScaledClampedSwiGLU):
    """Transformer Engine's clamped quick-GEGLU times a per-row scale: ClampedSwiGLU's
    arithmetic (a_c sigmoid(alpha a_c) (b_c + 1), alpha = 1.702 by default: quick GELU of the
    clamped gate input), with its arguments (glu_interleave_size, activation_recompute_in_mlp,
    limit, alpha, glu_linear_offset)."""
