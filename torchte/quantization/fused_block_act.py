"""Float8BlockScaling's 1x128 values written by the kernel that produces them: the activation
of LayerNormMLP (forward: a = act(h); backward: dh = da * act'(h) with fc1's bias gradient) and
a GEMM's output gradient with its bias gradient (quantize_with_dbias).

The same signatures and returns as quantization/fused.py's activation_to_fp8 and
activation_grad_to_fp8, for a quantizer that is a Float8BlockQuantizer with 1x128 blocks
(block_scaling_dim 1; `fusable_1x128` tells). Each takes the quantizer's settings (FP8 dtype,
amax_epsilon, force_pow_2_scales) as a CastSpec of the current form, runs the fused kernel
(kernels/activation_block.py) and wraps what it wrote in a Float8BlockwiseQTensorStorage.
The bytes and scales equal the unfused path's (the activation kernel's output in h's dtype,
then quantizer.quantize) bit for bit; dbias equals the unfused dh.sum(0) within the tolerance
table's entry for its dtype (bit-equal where the fp32 column sums are exact): see
kernels/activation_block.py. Shapes: h (M, K) with K = 2N for gated activations (else N);
a (M, N); da (M, N); dy (M, C); `shape` the value's shape as the module sees it.
"""

from __future__ import annotations

import math

import torch

from torchte.kernels import activation_block
from torchte.kernels.activation import is_gated
from torchte.kernels.cast_spec import CastSpec

from .blockwise import Float8BlockQuantizer, Float8BlockwiseQTensorStorage

__all__ = [
    "activation_grad_to_block",
    "activation_to_block",
    "fusable_1x128",
    "quantize_with_dbias",
]


def fusable_1x128(quantizer) -> bool:
    """Whether `quantizer` is one these functions write for: a Float8BlockQuantizer with 1x128
    blocks (block_scaling_dim 1)."""
    return isinstance(quantizer, Float8BlockQuantizer) and quantizer.block_scaling_dim == 1


def activation_to_block(
    quantizer, h, activation: str, limit: float, alpha: float, columnwise: bool, shape
) -> Float8BlockwiseQTensorStorage:
    """a = activation(h) written in 1x128-block FP8 by the activation kernel (rowwise, and
    columnwise when asked): a Float8BlockwiseQTensorStorage of `shape` (M rows, N columns)."""
    spec = _spec(quantizer, True, columnwise, "activation_to_block")
    shape = _checked_shape(shape, h, is_gated(activation), "activation_to_block")
    out = activation_block.activation_forward_block(h, activation, limit, alpha, spec)
    return Float8BlockwiseQTensorStorage(*out, quantizer.fp8_dtype, shape, 1)


def activation_grad_to_block(
    quantizer, da, h, activation: str, limit: float, alpha: float, usage, shape
) -> tuple[Float8BlockwiseQTensorStorage, torch.Tensor]:
    """dh = da * activation'(h) written in 1x128-block FP8 by the activation's backward kernel,
    da (M, N), with its column sums (the bias gradient of the GEMM that made h): (dh as a
    Float8BlockwiseQTensorStorage of `shape`, dbias (K,) in da's dtype). usage = (rowwise,
    columnwise); both False makes a storage holding no copy (dbias alone)."""
    spec = _spec(quantizer, *usage, "activation_grad_to_block")
    shape = _checked_shape(shape, h, False, "activation_grad_to_block")
    *out, dbias = activation_block.activation_backward_block(da, h, activation, limit, alpha, spec)
    return Float8BlockwiseQTensorStorage(*out, quantizer.fp8_dtype, shape, 1), dbias


def quantize_with_dbias(
    quantizer, dy, usage, shape
) -> tuple[Float8BlockwiseQTensorStorage, torch.Tensor]:
    """A GEMM's output gradient dy (..., C) quantized in 1x128 blocks with its bias gradient,
    one tile pass: (dy as a Float8BlockwiseQTensorStorage of `shape`, dbias (C,) = dy's column
    sums in dy's dtype). usage = (rowwise, columnwise); the same bytes as
    quantizer.quantize(dy, rowwise=..., columnwise=...)."""
    spec = _spec(quantizer, *usage, "quantize_with_dbias")
    shape = _checked_shape(shape, dy, False, "quantize_with_dbias")
    *out, dbias = activation_block.block_quantize_dbias(dy, spec)
    return Float8BlockwiseQTensorStorage(*out, quantizer.fp8_dtype, shape, 1), dbias


def _spec(quantizer, rowwise: bool, columnwise: bool, op: str) -> CastSpec:
    """The CastSpec (current form) of a 1x128 Float8BlockQuantizer; TypeError for another."""
    if not fusable_1x128(quantizer):
        raise TypeError(
            f"{op} writes Float8BlockScaling's 1x128 blocks: quantizer must be a "
            f"Float8BlockQuantizer with block_scaling_dim=1, got {quantizer!r}"
        )
    return CastSpec(
        quantizer.fp8_dtype, bool(rowwise), bool(columnwise),
        amax_epsilon=quantizer.amax_epsilon, power_2_scale=quantizer.force_pow_2_scales,
    )  # fmt: skip


def _checked_shape(shape, x: torch.Tensor, half: bool, op: str) -> tuple[int, ...]:
    """`shape` as a tuple, after checking (before any kernel runs) that it holds the values
    made from x (..., C): prod(x.shape[:-1]) rows of C (C // 2 when `half`: a gated
    activation's output) columns."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        raise TypeError(f"{op}: the input must be a tensor (..., C), got {type(x).__name__}")
    shape = tuple(int(s) for s in shape)
    rows, cols = math.prod(x.shape[:-1]), x.shape[-1] // 2 if half else x.shape[-1]
    if not shape or (math.prod(shape[:-1]), shape[-1]) != (rows, cols):
        raise ValueError(
            f"{op}: shape {shape} must hold {rows} rows of {cols} values (from the input "
            f"{tuple(x.shape)}): its leading dims' product {rows}, its last dim {cols}"
        )
    return shape
