"""The activation ops (te.ops.GELU ... te.ops.ClampedSwiGLU) over the last dimension, by the
activation kernels of te.LayerNormMLP. A gated activation takes x (..., 2N) and gives
act(x[..., :N]) * x[..., N:] (..., N); the others keep the shape. Before a BasicLinear under
delayed scaling the fuser lets the activation write the GEMM's FP8 input itself
(ops/fused/activation_linear.py).
"""

from __future__ import annotations

from torchte.kernels import activation as act_kernels
from torchte.module._norm_spec import rows_of

from ..op import BasicOperation

__all__ = [
    "GEGLU",
    "GELU",
    "GLU",
    "QGEGLU",
    "QGELU",
    "ClampedSwiGLU",
    "ReGLU",
    "ReLU",
    "SReGLU",
    "SReLU",
    "SiLU",
    "SwiGLU",
]


class _Activation(BasicOperation):
    """y = act(x); `name` is the kernel's name of the activation, `gated` whether it halves."""

    name = "gelu"
    gated = False

    def __init__(self, *, cache_quantized_input: bool = False, device=None) -> None:
        super().__init__(device, None)
        if cache_quantized_input:
            raise NotImplementedError(
                f"te.ops.{type(self).__name__}: cache_quantized_input is not implemented in "
                "torchte yet"
            )
        self.limit, self.alpha = 7.0, 1.702
        self._finish_init()

    def output_features(self, features: int | None) -> int | None:
        if features is None or not self.gated:
            return features
        if features % 2:
            raise ValueError(
                f"te.ops.{type(self).__name__} is gated: its input's last dimension must be even "
                f"(two halves), but the ops before it make {features}"
            )
        return features // 2

    def activation(self) -> tuple[str, float, float]:
        """(kernel name, limit, alpha): the arguments of the activation kernels."""
        return self.name, self.limit, self.alpha

    def op_forward(self, ctx, x, extra_inputs, settings):
        x2d = rows_of(x if x.dtype == settings.dtype else x.to(settings.dtype))
        y2d = act_kernels.activation_forward(x2d, *self.activation())
        if settings.requires_grad:
            ctx.save_for_backward(x2d)
        return y2d.view(*x.shape[:-1], y2d.shape[-1]), ()

    def op_backward(self, ctx, dy, extra_output_grads):
        (x2d,) = ctx.saved
        dy2d = rows_of(dy).to(x2d.dtype)
        dx2d = act_kernels.activation_backward(dy2d, x2d, *self.activation())
        return dx2d.view(*dy.shape[:-1], dx2d.shape[-1]), (), ()


class GELU(_Activation):
    """GELU (tanh approximation)."""

    name = "gelu"


class GEGLU(_Activation):
    """GELU-gated linear unit."""

    name, gated = "geglu", True


class GLU(_Activation):
    """Sigmoid-gated linear unit: sigmoid(a) * b for x = [a, b]. The sigmoid is of the first
    half, as in Transformer Engine (torch.nn.functional.glu gates the second half)."""

    name, gated = "glu", True


class QGELU(_Activation):
    """Quick GELU: x * sigmoid(1.702 x)."""

    name = "qgelu"


class QGEGLU(_Activation):
    """Quick-GELU-gated linear unit."""

    name, gated = "qgeglu", True


class ReLU(_Activation):
    """ReLU."""

    name = "relu"


class ReGLU(_Activation):
    """ReLU-gated linear unit."""

    name, gated = "reglu", True


class SReLU(_Activation):
    """Squared ReLU."""

    name = "srelu"


class SReGLU(_Activation):
    """Squared-ReLU-gated linear unit."""

    name, gated = "sreglu", True


class SiLU(_Activation):
    """SiLU (swish)."""

    name = "silu"


class SwiGLU(_Activation):
    """SiLU-gated linear unit."""

    name, gated = "swiglu", True


class ClampedSwiGLU(_Activation):
    """SwiGLU with the gate input clamped to [-limit, limit] and x * sigmoid(alpha x)."""

    name, gated = "clamped_swiglu", True

    def __init__(
        self,
        *,
        limit: float = 7.0,
        alpha: float = 1.702,
        cache_quantized_input: bool = False,
        device=None,
    ) -> None:
        super().__init__(cache_quantized_input=cache_quantized_input, device=device)
        if not limit > 0:
            raise ValueError(f"te.ops.ClampedSwiGLU: limit must be > 0, got {limit}")
        self.__dict__.update(limit=float(limit), alpha=float(alpha))
