"""te.ops.LayerNorm and te.ops.RMSNorm over the last dimension, by the norm kernels of
te.LayerNorm / te.RMSNorm (module/_norm_spec.py's NormSpec). Before a BasicLinear under
delayed scaling the fuser lets the norm write the GEMM's FP8 input itself
(ops/fused/norm_linear.py).

Legend: x, y (..., size); weight, bias (size,); mean, rstd (M,) fp32, M the rows of x.
"""

from __future__ import annotations

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
        self.size = _hidden_size(cls, None, normalized_shape)
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
        self.weight = nn.Parameter(gamma(self.size, **kw))
        if self.kind == "LayerNorm":
            self.bias = nn.Parameter(torch.zeros(self.size, **kw))
        self._finish_init()

    @property
    def input_features(self) -> int:
        return self.size

    def _parameter_inits(self) -> list[ParameterInit]:
        return norm_inits("weight", "bias", self.zero_centered_gamma)

    def _bias(self):
        return self._parameters.get("bias")

    def op_forward(self, ctx, x, extra_inputs, settings):
        x2d = rows_of(x if x.dtype == settings.dtype else x.to(settings.dtype))
        weight = self.weight
        y, mean, rstd = self.norm.forward(x2d, weight, self._bias())
        if settings.requires_grad:
            ctx.save_for_backward(x2d, mean, rstd)
        return y.view(x.shape), ()

    def op_backward(self, ctx, dy, extra_output_grads):
        x2d, mean, rstd = ctx.saved
        dy2d = rows_of(dy).to(x2d.dtype)
        bias = self._bias()
        dx, dw, db = self.norm.backward(dy2d, x2d, self.weight, mean, rstd, bias is not None)
        grads = (dw,) if bias is None else (dw, db)
        return dx.view(dy.shape), (), grads

    def extra_repr(self) -> str:
        return f"{self.size}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"


class LayerNorm(_NormOp):
    """y = (x - mean) / sqrt(var + eps) * g + b, g = weight (or 1 + weight, zero_centered)."""

    kind = "LayerNorm"


class RMSNorm(_NormOp):
    """y = x / sqrt(mean(x^2) + eps) * g, g = weight (or 1 + weight, zero_centered)."""

    kind = "RMSNorm"
