"""te.ops.LayerNorm and te.ops.RMSNorm over the trailing dimensions normalized_shape (one or
several, as Transformer Engine's ops), by the norm kernels of te.LayerNorm / te.RMSNorm
(module/_norm_spec.py's NormSpec) on the input seen as rows of size = prod(normalized_shape).
Before a BasicLinear under delayed scaling the fuser lets a norm over the last dimension write
the GEMM's FP8 input itself (ops/fused/norm_linear.py).

Legend: x, y (..., *normalized_shape); weight, bias normalized_shape; mean, rstd (M,) fp32, M
the rows of x seen as (M, size).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from torchte.module._lifecycle import ParameterInit, norm_inits
from torchte.module._norm_spec import NormSpec, rows_of
from torchte.module.norm import _hidden_size

from ..op import BasicOperation

__all__ = ["LayerNorm", "RMSNorm"]


class _NormOp(BasicOperation):
    """What both norms share; `kind` is "LayerNorm" or "RMSNorm"."""

    kind = "LayerNorm"
    # Transformer Engine's norm ops keep no FP8 state: no extra state in their state_dict.
    get_extra_state = nn.Module.get_extra_state
    set_extra_state = nn.Module.set_extra_state

    def __init__(
        self,
        normalized_shape,
        *,
        eps: float = 1e-5,
        device=None,
        dtype: torch.dtype | None = None,
        zero_centered_gamma: bool = False,
        sm_margin: int = 0,
    ) -> None:
        super().__init__(device, dtype)
        cls = f"ops.{self.kind}"
        self.normalized_shape = _normalized_shape(cls, normalized_shape)
        self.size = math.prod(self.normalized_shape)
        if not eps >= 0:
            raise ValueError(f"te.{cls}: eps must be >= 0, got {eps}")
        self.eps, self.zero_centered_gamma, self.sm_margin = (
            float(eps),
            zero_centered_gamma,
            sm_margin,
        )
        self.norm = NormSpec(self.kind, self.eps, zero_centered_gamma)
        kw = {"dtype": self.params_dtype, "device": self.device}
        gamma = torch.zeros if zero_centered_gamma else torch.ones
        self.weight = nn.Parameter(gamma(self.normalized_shape, **kw))
        if self.kind == "LayerNorm":
            self.bias = nn.Parameter(torch.zeros(self.normalized_shape, **kw))
        self._finish_init()

    @property
    def input_features(self) -> int:
        return self.normalized_shape[-1]

    @property
    def over_last_dim(self) -> bool:
        """Whether it normalizes over the last dimension only (a producer of a GEMM's input
        rows, which the norm_linear fusion needs)."""
        return len(self.normalized_shape) == 1

    def _parameter_inits(self) -> list[ParameterInit]:
        return norm_inits("weight", "bias", self.zero_centered_gamma)

    def _bias(self):
        bias = self._parameters.get("bias")
        return None if bias is None else bias.view(self.size)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., *normalized_shape) as (M, size) rows; ValueError naming the shapes unless
        x ends in normalized_shape."""
        n = len(self.normalized_shape)
        if tuple(x.shape[x.dim() - n :]) != self.normalized_shape:
            raise ValueError(
                f"te.ops.{self.kind}: the input's trailing dimensions must be "
                f"{self.normalized_shape}, got shape {tuple(x.shape)}"
            )
        return rows_of(x) if n == 1 else x.reshape(-1, self.size)

    def op_forward(self, ctx, x, extra_inputs, settings):
        x2d = self._rows(x if x.dtype == settings.dtype else x.to(settings.dtype))
        y, mean, rstd = self.norm.forward(x2d, self.weight.view(self.size), self._bias())
        if settings.requires_grad:
            ctx.save_for_backward(x2d, mean, rstd)
        return y.view(x.shape), ()

    def op_backward(self, ctx, dy, extra_output_grads):
        x2d, mean, rstd = ctx.saved
        dy2d = dy.reshape(x2d.shape).to(x2d.dtype)
        bias = self._bias()
        weight = self.weight.view(self.size)
        dx, dw, db = self.norm.backward(dy2d, x2d, weight, mean, rstd, bias is not None)
        shape = self.normalized_shape
        grads = (dw.view(shape),) if bias is None else (dw.view(shape), db.view(shape))
        return dx.view(dy.shape), (), grads

    def extra_repr(self) -> str:
        shape = self.normalized_shape[0] if self.over_last_dim else self.normalized_shape
        return f"{shape}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"


def _normalized_shape(cls: str, normalized_shape) -> tuple[int, ...]:
    """normalized_shape (an int or a sequence of positive ints) as a tuple."""
    if isinstance(normalized_shape, Sequence) and len(normalized_shape) > 1:
        dims = tuple(normalized_shape)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
            raise ValueError(f"te.{cls}: normalized_shape must hold positive ints, got {dims}")
        return dims
    return (_hidden_size(cls, None, normalized_shape),)


class LayerNorm(_NormOp):
    """y = (x - mean) / sqrt(var + eps) * g + b, g = weight (or 1 + weight, zero_centered)."""

    kind = "LayerNorm"


class RMSNorm(_NormOp):
    """y = x / sqrt(mean(x^2) + eps) * g, g = weight (or 1 + weight, zero_centered)."""

    kind = "RMSNorm"
