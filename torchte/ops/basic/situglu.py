"""te.ops.SiTUGLU and te.ops.ScaledSiTUGLU: the soft-capped SiLU-gated unit of Transformer
Engine, y = beta1 tanh(a / beta1) sigmoid(a) * beta2 tanh(b / beta2) for x = [a, b] (the scaled
form times one scale per row, as te.ops.ScaledSwiGLU).

The arithmetic is kernels/activation_situ.py's (fp32 torch ops, no Triton kernel), so these ops
are not among the activations the fusions fold into the next GEMM's FP8 cast: under FP8 they
write their output in high precision and the next op quantizes it (the same bytes, one launch
more); the grouped MLP runs op by op around them.
"""

from __future__ import annotations

import math

import torch

from torchte.kernels.activation_situ import situglu_backward, situglu_forward
from torchte.kernels.scaled_activation import row_dots

from .activation import _ActivationOp, _check_interleave
from .scaled_activation import _check_gated_options, _Scaled

__all__ = ["ScaledSiTUGLU", "SiTUGLU"]


def _check_beta(name: str, value: float) -> float:
    value = float(value)
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"{name} must be finite and positive, got {value}")
    return value


class SiTUGLU(_ActivationOp):
    """Soft-capped SiLU-gated unit: x (..., 2N) = [a, b] -> (..., N),
    beta1 tanh(a / beta1) sigmoid(a) * beta2 tanh(b / beta2) (Transformer Engine's arguments:
    beta1, beta2 > 0, cache_quantized_input, glu_interleave_size)."""

    gated = True

    def __init__(
        self,
        *,
        beta1: float = 4.0,
        beta2: float = 25.0,
        cache_quantized_input: bool = False,
        glu_interleave_size: int | None = None,
        device=None,
    ) -> None:
        size = _check_interleave(f"te.ops.{type(self).__name__}", glu_interleave_size)
        beta1, beta2 = _check_beta("beta1", beta1), _check_beta("beta2", beta2)
        super().__init__(cache_quantized_input=cache_quantized_input, device=device)
        self.__dict__.update(glu_interleave_size=size, beta1=beta1, beta2=beta2)

    def act_forward(self, x2d: torch.Tensor) -> torch.Tensor:
        return situglu_forward(x2d, self.beta1, self.beta2)

    def act_backward(self, dy2d: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
        return situglu_backward(dy2d, x2d, self.beta1, self.beta2)

    def extra_repr(self) -> str:
        return f"beta1={self.beta1}, beta2={self.beta2}"


class ScaledSiTUGLU(_Scaled, SiTUGLU):
    """SiTUGLU times a per-row scale (an extra input, as te.ops.ScaledSwiGLU's); Transformer
    Engine's ScaledSiTUGLU(glu_interleave_size, *, activation_recompute_in_mlp, beta1, beta2).
    The arithmetic of the other scaled activations: a = act(x) in x's dtype, y = a * s (s
    rounded to x's dtype), dx = act'(dy * s), ds the row sums of dy * a."""

    def __init__(
        self,
        glu_interleave_size: int | None = None,
        *,
        activation_recompute_in_mlp: bool = False,
        beta1: float = 4.0,
        beta2: float = 25.0,
        device=None,
    ) -> None:
        _check_gated_options(type(self).__name__, activation_recompute_in_mlp)
        super().__init__(
            beta1=beta1, beta2=beta2, glu_interleave_size=glu_interleave_size, device=device
        )

    def scaled_forward(self, x2d: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return self.act_forward(x2d).mul_(s.to(x2d.dtype)[:, None])

    def scaled_backward(self, dy2d, x2d, s, need_ds: bool):
        dy2d = dy2d.to(x2d.dtype)
        dx2d = self.act_backward(dy2d * s.to(x2d.dtype)[:, None], x2d)
        ds = row_dots(dy2d, self.act_forward(x2d)).to(s.dtype) if need_ds else None
        return dx2d, ds
