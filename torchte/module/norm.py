"""te.LayerNorm and te.RMSNorm: normalization over the trailing dimensions normalized_shape (the
last one, or several), Transformer Engine's API.

Legend: x (..., *S) input, S = normalized_shape, H = hidden_size = prod(S), M = prod(...) rows;
weight, bias S in params_dtype; y (..., *S). Over the last dimension (S = (H,)) x is seen as its
(M, H) rows directly; over several, x and the parameters are viewed as (M, H) and (H,) first,
so that both run the same kernels. The compute dtype is torch's autocast dtype when autocast
is on, else params_dtype, as in Transformer Engine: the input is cast to it and y comes out in
it; the parameters are used in their own dtype (the kernels read fp32 parameters next to bf16
x).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from ._functorch import apply
from ._lifecycle import ExtraStateError, ParameterInit, norm_inits
from ._norm_spec import NormSpec, rows_of
from ._te_extra_state import check_te_norm_extra_state
from .base import TransformerEngineBaseModule

__all__ = ["LayerNorm", "RMSNorm"]


class _NormFunction(torch.autograd.Function):
    """LayerNorm / RMSNorm forward and backward on (..., H) inputs (over several trailing
    dimensions: the (M, H) rows) and (H,) parameters; `norm` is the module's."""

    @staticmethod
    def forward(ctx, inp, weight, bias, norm: NormSpec):
        x2d = rows_of(inp)
        y, mean, rstd = norm.forward(x2d, weight, bias)
        ctx.save_for_backward(x2d, weight, mean, rstd)
        ctx.norm, ctx.has_bias = norm, bias is not None
        return y.view(inp.shape)

    @staticmethod
    def backward(ctx, grad_out):
        x2d, weight, mean, rstd = ctx.saved_tensors
        dy = rows_of(grad_out)
        dx, dw, db = ctx.norm.backward(dy, x2d, weight, mean, rstd, has_bias=ctx.has_bias)
        return dx.view(grad_out.shape), dw, db, None


def _normalized_shape(cls: str, hidden_size, normalized_shape) -> tuple[int, ...]:
    """The normalized trailing dimensions from hidden_size or normalized_shape (an int, or an
    iterable of positive ints such as a tuple, a list or a torch.Size)."""
    if (hidden_size is None) == (normalized_shape is None):
        raise TypeError(f"te.{cls}: give exactly one of hidden_size and normalized_shape")
    shape = hidden_size if hidden_size is not None else normalized_shape
    if not isinstance(shape, Iterable):
        shape = (shape,)
    dims = tuple(shape)
    if not dims:
        raise ValueError(f"te.{cls}: normalized_shape must have at least one dimension, got ()")
    if len(dims) == 1:
        size = dims[0]
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"te.{cls}: hidden_size must be a positive int, got {size!r}")
    elif not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
        raise ValueError(f"te.{cls}: normalized_shape must hold positive ints, got {dims}")
    return dims


def _hidden_size(cls: str, hidden_size, normalized_shape) -> int:
    """The one normalized size from hidden_size or normalized_shape (an int or a 1-sequence):
    te.ops' norms over the last dimension."""
    dims = _normalized_shape(cls, hidden_size, normalized_shape)
    if len(dims) != 1:
        raise ValueError(f"te.{cls}: expected one normalized dimension, got {dims}")
    return dims[0]


def _params_dtype(cls: str, params_dtype, dtype):
    """params_dtype, or Transformer Engine's other name for it, dtype; ValueError if both are
    given and differ."""
    if dtype is None:
        return params_dtype
    if params_dtype is not None and params_dtype != dtype:
        raise ValueError(
            f"te.{cls}: params_dtype={params_dtype} and dtype={dtype} disagree; give one"
        )
    return dtype


class _Norm(TransformerEngineBaseModule):
    """What LayerNorm and RMSNorm share: parameters, checks, the compute dtype."""

    # No FP8 state: the state_dict is weight (and bias) only. Undo the base class's override.
    get_extra_state = nn.Module.get_extra_state
    set_extra_state = nn.Module.set_extra_state

    def _load_from_state_dict(self, state_dict, prefix, metadata, strict, missing, unexpected, *a):
        super()._load_from_state_dict(state_dict, prefix, metadata, strict, missing, unexpected, *a)
        key = prefix + "_extra_state"
        if key in unexpected:  # Transformer Engine 2.x's norms (fuser ops) save one: dropped
            try:
                check_te_norm_extra_state(state_dict[key], f"te.{type(self).__name__}")
            except ExtraStateError as err:
                raise ExtraStateError(f"cannot load {key}: {err}") from None
            unexpected.remove(key)

    def __init__(
        self,
        cls: str,
        hidden_size,
        normalized_shape,
        eps: float,
        sequence_parallel: bool | None,
        params_dtype: torch.dtype | None,
        zero_centered_gamma: bool,
        device,
        has_bias: bool,
    ) -> None:
        super().__init__(device, params_dtype)
        self.normalized_shape = _normalized_shape(cls, hidden_size, normalized_shape)
        self.hidden_size = math.prod(self.normalized_shape)
        self._over_last_dim = len(self.normalized_shape) == 1
        if not eps >= 0:
            raise ValueError(f"te.{cls}: eps must be >= 0, got {eps}")
        self.eps = float(eps)
        self.zero_centered_gamma = bool(zero_centered_gamma)
        # Sequence parallelism changes no arithmetic here: it only marks the parameters, whose
        # gradients Megatron-style trainers then all-reduce across the tensor-parallel group.
        self.sequence_parallel = bool(sequence_parallel)
        kw = {"dtype": self.params_dtype, "device": self.device}
        self.weight = nn.Parameter(torch.empty(self.normalized_shape, **kw))
        if has_bias:
            self.bias = nn.Parameter(torch.empty(self.normalized_shape, **kw))
        else:
            self.register_parameter("bias", None)
        for param in self.parameters():
            param.sequence_parallel = self.sequence_parallel
        self.reset_parameters(defer_init=self.device.type == "meta")  # meta: left empty
        self._norm = NormSpec(cls, self.eps, self.zero_centered_gamma)
        self._finish_init()

    def _parameter_inits(self) -> list[ParameterInit]:
        """weight = 0 under zero_centered_gamma, else 1; bias = 0."""
        return norm_inits("weight", "bias", self.zero_centered_gamma)

    def _input(self, inp: torch.Tensor) -> torch.Tensor:
        """inp checked and cast to the compute dtype (see the module docstring)."""
        self._check_input(inp, self.hidden_size, "hidden_size")
        dtype = self._compute_dtype()
        return inp if inp.dtype is dtype else inp.to(dtype)

    def _check_trailing_dims(self, inp: torch.Tensor) -> None:
        """ValueError naming both shapes unless inp ends in normalized_shape; then the checks
        every module makes (a tensor, its dtype, its device)."""
        shape = self.normalized_shape
        if isinstance(inp, torch.Tensor) and tuple(inp.shape[-len(shape) :]) != shape:
            raise ValueError(
                f"te.{type(self).__name__}: the input's trailing dimensions must be "
                f"{shape}, got shape {tuple(inp.shape)}"
            )
        self._check_input(inp, shape[-1], "normalized_shape[-1]")

    def _forward_over_trailing_dims(self, inp, weight, bias) -> torch.Tensor:
        """inp (..., *S), checked and cast as in the last-dimension path, through the kernels
        as its (M, H) rows, with weight and bias viewed as (H,); autograd takes the gradients
        back to the shapes of inp and S."""
        self._check_trailing_dims(inp)
        dtype = self._compute_dtype()
        x = inp if inp.dtype is dtype else inp.to(dtype)
        size = self.hidden_size
        x2d = x.reshape(-1, size)
        weight = weight.reshape(size)
        bias = None if bias is None else bias.reshape(size)
        if torch.is_grad_enabled() and (
            x2d.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
        ):
            y2d = apply(_NormFunction, x2d, weight, bias, self._norm)
        else:
            y2d = self._norm.forward(rows_of(x2d), weight, bias)[0]
        return y2d.view(x.shape)

    def extra_repr(self) -> str:
        shape = self.hidden_size if self._over_last_dim else self.normalized_shape
        return (
            f"{shape}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"
            f", params_dtype={self.params_dtype}, device={self.device}"
        )


class LayerNorm(_Norm):
    """y = (x - mean) / sqrt(var + eps) * g + b over the trailing dimensions normalized_shape
    (an int: the last one), g = weight (or 1 + weight with zero_centered_gamma); Transformer
    Engine's arguments.

    x (..., *normalized_shape) fp32/bf16/fp16 -> y of the same shape, in params_dtype (or
    torch's autocast dtype). Parameters `weight` and `bias` of shape normalized_shape.
    """

    def __init__(
        self,
        hidden_size: int | Sequence[int] | None = None,
        eps: float = 1e-5,
        sequence_parallel: bool | None = None,
        params_dtype: torch.dtype | None = None,
        zero_centered_gamma: bool = False,
        device: torch.device | str | None = None,
        normalization: str = "LayerNorm",
        *,
        normalized_shape: int | Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if normalization != "LayerNorm":
            raise ValueError(
                f"te.LayerNorm: normalization must be 'LayerNorm', got {normalization!r}; "
                "use te.RMSNorm for RMSNorm"
            )
        params_dtype = _params_dtype("LayerNorm", params_dtype, dtype)
        super().__init__(
            "LayerNorm", hidden_size, normalized_shape, eps, sequence_parallel, params_dtype,
            zero_centered_gamma, device, has_bias=True,
        )  # fmt: skip

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        """inp (..., *normalized_shape) -> the same shape."""
        params = self._parameters
        weight, bias = params["weight"], params["bias"]
        if not self._over_last_dim:
            return self._forward_over_trailing_dims(inp, weight, bias)
        x = self._input(inp)
        if torch.is_grad_enabled() and (
            x.requires_grad or weight.requires_grad or bias.requires_grad
        ):
            return apply(_NormFunction, x, weight, bias, self._norm)
        return self._norm.forward(rows_of(x), weight, bias)[0].view(x.shape)


class RMSNorm(_Norm):
    """y = x / sqrt(mean(x^2) + eps) * g over the trailing dimensions normalized_shape (an
    int: the last one), g = weight (or 1 + weight with zero_centered_gamma); Transformer
    Engine's arguments.

    x (..., *normalized_shape) fp32/bf16/fp16 -> y of the same shape, in params_dtype (or
    torch's autocast dtype). Parameter `weight` of shape normalized_shape.
    """

    def __init__(
        self,
        hidden_size: int | Sequence[int] | None = None,
        eps: float = 1e-5,
        sequence_parallel: bool | None = None,
        params_dtype: torch.dtype | None = None,
        zero_centered_gamma: bool = False,
        device: torch.device | str | None = None,
        *,
        normalized_shape: int | Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        params_dtype = _params_dtype("RMSNorm", params_dtype, dtype)
        super().__init__(
            "RMSNorm", hidden_size, normalized_shape, eps, sequence_parallel, params_dtype,
            zero_centered_gamma, device, has_bias=False,
        )  # fmt: skip

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        """inp (..., *normalized_shape) -> the same shape."""
        weight = self._parameters["weight"]
        if not self._over_last_dim:
            return self._forward_over_trailing_dims(inp, weight, None)
        x = self._input(inp)
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            return apply(_NormFunction, x, weight, None, self._norm)
        return self._norm.forward(rows_of(x), weight, None)[0].view(x.shape)
