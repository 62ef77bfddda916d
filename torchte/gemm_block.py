"""Block-scaled GEMMs (gemm.py's part for Float8BlockScaling and the emulated MXFP8 / NVFP4):
two GemmOperands (quantization/base.py) through torch's block-scaled matmul on Hopper, else
their exact dequantized values with fp32 accumulation; the grouped GEMMs of a mixture-of-experts
layer under Float8BlockScaling, per group on cuBLAS when the host has the sizes, else one Triton
launch reading them on the device. Reached through gemm.py, which re-exports these names.

Every GEMM here is "K-major": a (M, K) and b (N, K) give (M, N) = a @ b^T.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._device import block_gemm_native
from ._gemm_util import empty_product, fp32_mm
from .kernels.gemm_epilogue import scale_epilogue
from .kernels.grouped_gemm_block import grouped_block_reduction_gemm, grouped_block_rows_gemm
from .quantization.base import GemmOperand

__all__ = [
    "block_grouped_dgrad",
    "block_grouped_fprop",
    "block_grouped_wgrad",
    "operand_gemm",
]


# ----------------------------------------------------------------------------------------------
# Block-scaled operands
# ----------------------------------------------------------------------------------------------

_BLOCK = 128
# torch's block-scaled matmul reads FP8 rows in 16-byte steps: every dimension a multiple of 16.
_BLOCK_ALIGN = 16


def operand_gemm(a, b, out_dtype, bias=None, out=None, accumulate=False) -> torch.Tensor:
    """(M, N) = a (M, K) @ b (N, K)^T for two GemmOperands (quantization/base.py), + bias (N,);
    with `out` (M, N) fp32 written into it, or added to it (accumulate=True).

    Two block-scaled FP8 operands run as one torch block-scaled matmul where the device has it
    (Hopper: 1x128 x 128x128, 128x128 x 1x128 and 1x128 x 1x128, every dimension a multiple of
    16), the bias added in its epilogue; otherwise (the CPU, other GPUs, unaligned shapes, the
    emulated formats' "values") the operands are dequantized exactly and multiplied with fp32
    accumulation, scaled by their factors and the bias added before the one rounding.
    """
    m, n = a.data.shape[0], b.data.shape[0]
    if m == 0 or n == 0 or a.data.shape[1] == 0:
        return empty_product(m, n, a.data.device, out_dtype, bias, out, accumulate)
    gemm_dtype = out_dtype if out is None else torch.float32
    result = None
    if a.data.is_cuda and a.kind != "values" and b.kind != "values":
        result = _block_scaled_mm(a, b, gemm_dtype, bias)
    if result is None:
        result = _dequantized_mm(a, b, gemm_dtype, bias)
    if out is None:
        return result
    return out.add_(result) if accumulate else out.copy_(result)


def _block_scaled_mm(a, b, out_dtype, bias, out=None):
    """torch's block-scaled FP8 matmul of two block operands (+ bias), or None where it cannot
    run (device, shapes, a 2-D x 2-D pair). `out` (M, N) of out_dtype: written in place (no
    bias), through torch._scaled_mm where it takes the pair (1x128 x 1x128; a 2-D operand
    whose K-blocks are a multiple of 4, where its scales need no padding), else copied."""
    if not block_gemm_native("Float8BlockScaling", a.data.device)[0]:
        return None
    k = a.data.shape[1]
    if any(d % _BLOCK_ALIGN for d in (a.data.shape[0], b.data.shape[0], k)):
        return None
    if a.kind == "block2d" and b.kind == "block2d":
        return None
    fused = bias.to(out_dtype) if bias is not None and out_dtype != torch.float32 else None
    if out is not None:
        kb = -(-k // _BLOCK)
        if a.kind == "block1d" and (b.kind == "block1d" or kb % 4 == 0):
            b_scale = b.scale if b.kind == "block1d" else b.scale[:, :kb].t()
            torch._scaled_mm(a.data, b.data.t(), a.scale.t(), b_scale, out_dtype=out_dtype, out=out)
            return out
        return out.copy_(_block_scaled_mm(a, b, out_dtype, None))
    if a.kind == "block1d" and b.kind == "block1d":
        result = torch._scaled_mm(
            a.data, b.data.t(), a.scale.t(), b.scale, bias=fused, out_dtype=out_dtype
        )
    else:
        scaling = F.ScalingType
        kinds = {"block1d": scaling.BlockWise1x128, "block2d": scaling.BlockWise128x128}
        result = F.scaled_mm(
            a.data, b.data.t(), a.scale.t(), kinds[a.kind], b.scale.t(), kinds[b.kind],
            bias=fused, output_dtype=out_dtype,
        )  # fmt: skip
    if bias is not None and fused is None:
        result = result.add_(bias)
    return result


def _dequantized_mm(a, b, out_dtype, bias):
    """a @ b^T (+ bias) from the operands' exact values: fp32 on the CPU; on a GPU in the
    values' dtype (bf16 for the emulated formats) with fp32 accumulation; then, in one pass
    (kernels/gemm_epilogue.py), times a's factor, times b's factor, the bias added in fp32,
    one rounding to out_dtype."""
    av, bv = _operand_values(a), _operand_values(b)
    if not av.is_cuda or av.dtype != bv.dtype:
        av, bv = av.float(), bv.float()
    if av.is_cuda and av.dtype in (torch.bfloat16, torch.float16):
        result = torch.mm(av, bv.t(), out_dtype=torch.float32)
    else:
        result = fp32_mm(av.float(), bv.float().t())
    factor_a = a.scale if a.kind == "values" else None
    factor_b = b.scale if b.kind == "values" else None
    return scale_epilogue(result, factor_a, factor_b, bias, out_dtype)


def _operand_values(op) -> torch.Tensor:
    """The (R, K) values of a GemmOperand: its data for "values", else its FP8 data times the
    block scales (fp32)."""
    if op.kind == "values":
        return op.data
    rows, k = op.data.shape
    if op.kind == "block1d":
        scale = op.scale.t().repeat_interleave(_BLOCK, 1)[:, :k]
    else:
        kb = -(-k // _BLOCK)
        scale = op.scale[:, :kb].repeat_interleave(_BLOCK, 0)[:rows]
        scale = scale.repeat_interleave(_BLOCK, 1)[:, :k]
    return op.data.float() * scale


# ----------------------------------------------------------------------------------------------
# Grouped GEMMs (block-scaled FP8: 1x128 activations and gradients, 128x128 weights)
# ----------------------------------------------------------------------------------------------


def block_grouped_fprop(x_q, w_q, out_dtype) -> torch.Tensor:
    """y (T, N): per group x_g W_g^T, x_q a grouped 1x128 storage (rowwise (T, K), row_offsets
    on the device), w_q a 128x128 storage of the G weights (rowwise (G, N, K)). With the sizes
    on the host (x_q.m_splits) and cuBLAS's block-scaled GEMM on the device: one per group,
    each writing its rows of y; else one Triton launch reading the sizes on the device."""
    sizes = _cublas_group_sizes(x_q)
    if sizes is None:
        return grouped_block_rows_gemm(
            x_q.rowwise_data, x_q.rowwise_scale_inv, w_q.rowwise_data, w_q.rowwise_scale_inv,
            x_q.row_offsets, out_dtype,
        )  # fmt: skip
    weights = (w_q.rowwise_data, w_q.rowwise_scale_inv)
    return _per_group_rows(x_q, weights, sizes, out_dtype)


def block_grouped_dgrad(dy_q, w_q, out_dtype) -> torch.Tensor:
    """dx (T, K): per group dy_g W_g, from dy's rowwise copy and the weights' columnwise tiles
    (G, K, N); per group on cuBLAS or one Triton launch, as block_grouped_fprop."""
    sizes = _cublas_group_sizes(dy_q)
    if sizes is None:
        return grouped_block_rows_gemm(
            dy_q.rowwise_data, dy_q.rowwise_scale_inv, w_q.columnwise_data,
            w_q.columnwise_scale_inv, dy_q.row_offsets, out_dtype,
        )  # fmt: skip
    weights = (w_q.columnwise_data, w_q.columnwise_scale_inv)
    return _per_group_rows(dy_q, weights, sizes, out_dtype)


def block_grouped_wgrad(dy_q, x_q, out_dtype) -> torch.Tensor:
    """dW (G, N, K): per group dy_g^T x_g over the group's tokens, from the columnwise copies
    of dy (N, T) and x (K, T) with their per-group 128-token blocks, zeros for a group without
    rows; per group on cuBLAS or one Triton launch, as block_grouped_fprop."""
    sizes = _cublas_group_sizes(dy_q)
    if sizes is None:
        return grouped_block_reduction_gemm(
            dy_q.columnwise_data, dy_q.columnwise_scale_inv, x_q.columnwise_data,
            x_q.columnwise_scale_inv, dy_q.row_offsets, dy_q.block_offsets, out_dtype,
        )  # fmt: skip
    n, k = dy_q.shape[1], x_q.shape[1]
    out = torch.empty(len(sizes), n, k, dtype=out_dtype, device=dy_q.columnwise_data.device)
    start = block = 0
    for g, m in enumerate(sizes):
        if m == 0:
            out[g].zero_()
            continue
        tokens, blocks = slice(start, start + m), slice(block, block + -(-m // _BLOCK))
        a = GemmOperand(
            "block1d", dy_q.columnwise_data[:, tokens], dy_q.columnwise_scale_inv[blocks]
        )
        b = GemmOperand("block1d", x_q.columnwise_data[:, tokens], x_q.columnwise_scale_inv[blocks])
        _block_scaled_mm(a, b, out_dtype, None, out=out[g])
        start, block = start + m, blocks.stop
    return out


def _cublas_group_sizes(q) -> list[int] | None:
    """The group sizes of grouped storage q where its GEMMs run group by group on cuBLAS's
    block-scaled GEMM (sizes on the host, every group and the token count multiples of 16,
    Hopper), else None (the Triton kernels)."""
    sizes = q.m_splits
    data = q.rowwise_data if q.rowwise_data is not None else q.columnwise_data
    if sizes is None or not data.is_cuda or q.shape[0] % _BLOCK_ALIGN:
        return None
    if any(m % _BLOCK_ALIGN for m in sizes):
        return None
    return list(sizes) if block_gemm_native("Float8BlockScaling", data.device)[0] else None


def _per_group_rows(a_q, weights, sizes, out_dtype) -> torch.Tensor:
    """(T, N): rows of group g = A_g B_g^T, A the 1x128 rowwise copy of a_q, B_g = weights'
    (data (G, N, R), scales (G, ...)) tile g; one cuBLAS GEMM per non-empty group, each
    writing its rows of the output."""
    data, scales = weights
    out = torch.empty(a_q.shape[0], data.shape[1], dtype=out_dtype, device=data.device)
    start = 0
    for g, m in enumerate(sizes):
        if m:
            rows = slice(start, start + m)
            part = a_q.rowwise_scale_inv[:, rows]
            # A fresh (K-blocks, m) buffer: .contiguous() keeps a view whose one K-block row
            # still has the full tensor's stride, which cuBLAS's layout check refuses.
            a_scale = torch.empty(part.shape, dtype=part.dtype, device=part.device).copy_(part)
            a = GemmOperand("block1d", a_q.rowwise_data[rows], a_scale)
            _block_scaled_mm(
                a, GemmOperand("block2d", data[g], scales[g]), out_dtype, None, out[rows]
            )
        start += m
    return out
