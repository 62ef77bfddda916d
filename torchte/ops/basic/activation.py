"""The activation ops (te.ops.GELU ... te.ops.ClampedSwiGLU) over the last dimension, by the
activation kernels of te.LayerNormMLP. A gated activation takes x (..., 2N) and gives
act(x[..., :N]) * x[..., N:] (..., N); the others keep the shape. Before a BasicLinear under
delayed scaling the fuser lets the activation write the GEMM's FP8 input itself
(ops/fused/activation_linear.py).

glu_interleave_size (gated activations, Transformer Engine's argument): the input's last
dimension holds blocks of that many activation inputs and gates in turn,
[a_0..a_{s-1}, b_0..b_{s-1}, a_s.., b_s.., ...], instead of [all a, all b]. The op reorders it
to [a, b] (a copy) before the kernel, and the gradient back. cache_quantized_input: the input
kept for backward is cast to FP8 (E4M3, current scaling) and cast back there: less memory, the
gradient from the rounded input.
"""

from __future__ import annotations

import torch

from torchte.kernels import activation as act_kernels
from torchte.module._norm_spec import rows_of
from torchte.quantization.float8 import Float8CurrentScalingQuantizer

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
    "deinterleave",
    "interleave",
]


def deinterleave(x2d: torch.Tensor, size: int) -> torch.Tensor:
    """(M, 2N) with blocks [a (size), b (size), a, b, ...] -> (M, 2N) [all a, all b] (a copy)."""
    m, k = x2d.shape
    return x2d.view(m, k // (2 * size), 2, size).transpose(1, 2).reshape(m, k)


def interleave(x2d: torch.Tensor, size: int) -> torch.Tensor:
    """The inverse of deinterleave: (M, 2N) [all a, all b] -> blocks [a, b, a, b, ...]."""
    m, k = x2d.shape
    return x2d.view(m, 2, k // (2 * size), size).transpose(1, 2).reshape(m, k)


def _check_interleave(who: str, size) -> int | None:
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ValueError(f"{who}: glu_interleave_size must be a positive int or None, got {size!r}")
    return size


class _ActivationOp(BasicOperation):
    """y = act(x) over the last dimension: the layout (gated halves, glu_interleave_size), what
    is saved for backward (cache_quantized_input) and the calls; subclasses give act_forward
    and act_backward on the (M, K) kernel input."""

    gated = False
    glu_interleave_size: int | None = None

    def __init__(self, *, cache_quantized_input: bool = False, device=None) -> None:
        super().__init__(device, None)
        self.cache_quantized_input = bool(cache_quantized_input)
        self._finish_init()

    def act_forward(self, x2d: torch.Tensor) -> torch.Tensor:
        """x2d (M, K) -> y (M, N) in x2d's dtype."""
        raise NotImplementedError

    def act_backward(self, dy2d: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
        """dy2d (M, N), x2d (M, K) -> dx (M, K) in x2d's dtype."""
        raise NotImplementedError

    def output_features(self, features: int | None) -> int | None:
        if features is None or not self.gated:
            return features
        self._check_width(features, "the ops before it make")
        return features // 2

    def _check_width(self, features: int, what: str) -> None:
        """ValueError unless a gated input's last dimension splits into its halves (and its
        interleaved blocks)."""
        size = self.glu_interleave_size
        who = f"te.ops.{type(self).__name__}"
        if features % 2:
            raise ValueError(
                f"{who} is gated: its input's last dimension must be even (two halves), but "
                f"{what} {features}"
            )
        if size is not None and features % (2 * size):
            raise ValueError(
                f"{who}: with glu_interleave_size={size} the input's last dimension must be a "
                f"multiple of {2 * size}, but {what} {features}"
            )

    def kernel_input(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """x (..., K) as the kernels' (M, K) input in dtype, halves [a, b] (de-interleaved)."""
        x2d = rows_of(x if x.dtype == dtype else x.to(dtype))
        if self.gated and x2d.shape[-1]:
            self._check_width(x2d.shape[-1], "the input has")
        if self.glu_interleave_size is not None:
            x2d = deinterleave(x2d, self.glu_interleave_size)
        return x2d

    def input_grad(self, dx2d: torch.Tensor) -> torch.Tensor:
        """The kernels' input gradient (M, K) in the input's layout (interleaved again)."""
        if self.glu_interleave_size is not None:
            return interleave(dx2d, self.glu_interleave_size)
        return dx2d

    def op_forward(self, ctx, x, extra_inputs, settings):
        x2d = self.kernel_input(x, settings.dtype)
        y2d = self.act_forward(x2d)
        if settings.requires_grad:
            if self.cache_quantized_input:
                quantizer = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
                ctx.save_for_backward(quantizer.quantize(x2d, rowwise=True, columnwise=False))
                ctx.dtype = x2d.dtype
            else:
                ctx.save_for_backward(x2d)
        return y2d.view(*x.shape[:-1], y2d.shape[-1]), ()

    def saved_input(self, ctx) -> torch.Tensor:
        """The (M, K) kernel input op_forward saved (cast back from FP8 where it was cached so)."""
        (x2d,) = ctx.saved
        if isinstance(x2d, torch.Tensor):
            return x2d
        return x2d.dequantize(ctx.dtype)

    def op_backward(self, ctx, dy, extra_output_grads):
        x2d = self.saved_input(ctx)
        dy2d = rows_of(dy).to(x2d.dtype)
        dx2d = self.input_grad(self.act_backward(dy2d, x2d))
        return dx2d.view(*dy.shape[:-1], dx2d.shape[-1]), (), ()


class _Activation(_ActivationOp):
    """An activation of the shared activation kernels: `name` is the kernels' name of it (the
    fusions write the next GEMM's FP8 input with the same kernels)."""

    name = "gelu"

    def __init__(self, *, cache_quantized_input: bool = False, device=None) -> None:
        super().__init__(cache_quantized_input=cache_quantized_input, device=device)
        self.__dict__.update(limit=7.0, alpha=1.702)

    def activation(self) -> tuple[str, float, float]:
        """(kernel name, limit, alpha): the arguments of the activation kernels."""
        return self.name, self.limit, self.alpha

    def act_forward(self, x2d: torch.Tensor) -> torch.Tensor:
        return act_kernels.activation_forward(x2d, *self.activation())

    def act_backward(self, dy2d: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
        return act_kernels.activation_backward(dy2d, x2d, *self.activation())


class _GatedActivation(_Activation):
    """A gated activation: Transformer Engine's glu_interleave_size layout is accepted."""

    gated = True

    def __init__(
        self,
        *,
        cache_quantized_input: bool = False,
        glu_interleave_size: int | None = None,
        device=None,
    ) -> None:
        size = _check_interleave(f"te.ops.{type(self).__name__}", glu_interleave_size)
        super().__init__(cache_quantized_input=cache_quantized_input, device=device)
        self.__dict__["glu_interleave_size"] = size


class GELU(_Activation):
    """GELU (tanh approximation)."""

    name = "gelu"


class GEGLU(_GatedActivation):
    """GELU-gated linear unit."""

    name = "geglu"


class GLU(_GatedActivation):
    """Sigmoid-gated linear unit: sigmoid(a) * b for x = [a, b]. The sigmoid is of the first
    half, as in Transformer Engine (torch.nn.functional.glu gates the second half)."""

    name = "glu"


class QGELU(_Activation):
    """Quick GELU: x * sigmoid(1.702 x)."""

    name = "qgelu"


class QGEGLU(_GatedActivation):
    """Quick-GELU-gated linear unit."""

    name = "qgeglu"


class ReLU(_Activation):
    """ReLU."""

    name = "relu"


class ReGLU(_GatedActivation):
    """ReLU-gated linear unit."""

    name = "reglu"


class SReLU(_Activation):
    """Squared ReLU."""

    name = "srelu"


class SReGLU(_GatedActivation):
    """Squared-ReLU-gated linear unit."""

    name = "sreglu"


class SiLU(_Activation):
    """SiLU (swish)."""

    name = "silu"


class SwiGLU(_GatedActivation):
    """SiLU-gated linear unit."""

    name = "swiglu"


class ClampedSwiGLU(_GatedActivation):
    """GPT-OSS's SwiGLU: a_c = min(a, limit), b_c = clamp(b, -limit, limit),
    y = a_c sigmoid(alpha a_c) (b_c + glu_linear_offset). glu_linear_offset: Transformer
    Engine's argument; only its default 1.0 is implemented."""

    name = "clamped_swiglu"

    def __init__(
        self,
        *,
        limit: float = 7.0,
        alpha: float = 1.702,
        glu_linear_offset: float = 1.0,
        cache_quantized_input: bool = False,
        glu_interleave_size: int | None = None,
        device=None,
    ) -> None:
        super().__init__(
            cache_quantized_input=cache_quantized_input,
            glu_interleave_size=glu_interleave_size,
            device=device,
        )
        check_clamp(type(self).__name__, limit, glu_linear_offset)
        self.__dict__.update(limit=float(limit), alpha=float(alpha), glu_linear_offset=1.0)


def check_clamp(name: str, limit: float, glu_linear_offset: float) -> None:
    """ValueError unless limit > 0; NotImplementedError for a glu_linear_offset other than 1
    (the kernels add 1 to the clamped gate)."""
    if not limit > 0:
        raise ValueError(f"te.ops.{name}: limit must be > 0, got {limit}")
    if glu_linear_offset != 1.0:
        raise NotImplementedError(
            f"te.ops.{name}: glu_linear_offset={glu_linear_offset} is not implemented in torchte "
            "(the activation kernels add 1.0, Transformer Engine's default)"
        )
