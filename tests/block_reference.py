"""A plain-PyTorch reference of a GEMM under a block-scaled recipe (tests import it as
`from block_reference import ...`): each operand quantized and dequantized with the recipe's
own quantizers for the usage the GEMM reads, then multiplied in float64.

fprop reads x and W rowwise, dgrad dy rowwise and W columnwise, wgrad dy and x columnwise;
under 1x128 blocks the two copies of a tensor are separate quantizations (different values),
so the reference takes each from its own cast. NVFP4's columnwise copies carry a random
Hadamard transform along the tokens, which the two wgrad operands share: dequantize() undoes
it on each, and the product is the same.
"""

from __future__ import annotations

import torch

from torchte.quantization.block_setup import block_quantizer

__all__ = ["QDQLinear", "qdq"]


def _dtype(recipe, slot: str) -> torch.dtype:
    fmt = recipe.fp8_format
    return fmt.fwd_dtype if slot in ("input", "weight", "output") else fmt.bwd_dtype


def qdq(recipe, slot: str, t: torch.Tensor, usage: str) -> torch.Tensor:
    """t (..., K) quantized with the quantizer of `slot` keeping only `usage` ("rowwise" or
    "columnwise"), dequantized, in float64, shape (M, K)."""
    quantizer = block_quantizer(recipe, slot, _dtype(recipe, slot), True)
    t2d = t.detach().reshape(-1, t.shape[-1])
    value = quantizer.quantize(
        t2d, rowwise=usage == "rowwise", columnwise=usage == "columnwise"
    ).dequantize(torch.float32)
    return value.double().reshape(t2d.shape)


class QDQLinear(torch.autograd.Function):
    """y = x W^T (+ b) in float64 from the quantized-dequantized operands of each GEMM."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe):
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.has_bias = recipe, bias is not None
        y = qdq(recipe, "input", x, "rowwise") @ qdq(recipe, "weight", weight, "rowwise").t()
        if bias is not None:
            y = y + bias.double()
        return y.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        recipe = ctx.recipe
        dy2d = dy.reshape(-1, dy.shape[-1])
        w_cols = qdq(recipe, "weight", weight, "columnwise")
        dx = qdq(recipe, "grad_output", dy2d, "rowwise") @ w_cols
        dw = qdq(recipe, "grad_output", dy2d, "columnwise").t() @ qdq(
            recipe, "input", x, "columnwise"
        )
        db = dy2d.double().sum(0) if ctx.has_bias else None
        dx = dx.reshape(x.shape).to(x.dtype)
        return dx, dw.to(weight.dtype), None if db is None else db.to(weight.dtype), None
