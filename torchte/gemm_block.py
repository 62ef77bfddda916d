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
from .gemm_mx import MX_KINDS, mx_operand_mm
from .kernels.gemm_epilogue import scale_epilogue
from .kernels.group_scales import group_scales
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
    16), the bias added in its epilogue; two MXFP8 ("mx") or NVFP4 ("nvfp4") operands, which
    their storages make only where those GEMMs run natively (compute capability 10+, untested
    here), as torch's MX-scaled matmul (gemm_mx.py; ValueError for a mixed pair); otherwise
    (the CPU, other GPUs, unaligned shapes, the emulated formats' "values") the operands are
    dequantized exactly and multiplied with fp32 accumulation, scaled by their factors and the
    bias added before the one rounding.
    """
    m, n = a.data.shape[0], b.data.shape[0]
    if m == 0 or n == 0 or a.data.shape[1] == 0:
        return empty_product(m, n, a.data.device, out_dtype, bias, out, accumulate)
    gemm_dtype = out_dtype if out is None else torch.float32
    result = None
    if a.kind in MX_KINDS or b.kind in MX_KINDS:  # native MXFP8 / NVFP4 (capability 10+)
        result = mx_operand_mm(a, b, gemm_dtype, bias)
    elif a.data.is_cuda and a.kind != "values" and b.kind != "values":
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
    kb = -(-k // _BLOCK)
    if (
        a.kind == "block1d"
        and b.kind == "block2d"
        and (out is None or kb % 4)
        and _has_e5m2(a.data, b.data)
    ):
        # F.scaled_mm (the path below) refuses E5M2: the tiles as 1x128 strips instead.
        b = GemmOperand("block1d", b.data, tiles_as_strips(b.scale, b.data.shape[0], kb))
    fused = bias.to(out_dtype) if bias is not None and out_dtype != torch.float32 else None
    if out is not None:
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


def _has_e5m2(*data: torch.Tensor) -> bool:
    """Whether any of the operands' FP8 data is E5M2: F.scaled_mm refuses it in its
    block-scaled pairings, torch._scaled_mm takes it."""
    return any(d.dtype == torch.float8_e5m2 for d in data)


def tiles_as_strips(tile_scales: torch.Tensor, rows: int, kb: int) -> torch.Tensor:
    """The scales (..., KB, rows) fp32, contiguous, of an operand (..., rows, K) in 128x128 tiles
    (tile_scales (..., ceil(rows / 128), >= KB)) read as 1x128 strips along K, each strip taking
    its tile's scale: the same values, in the form torch._scaled_mm multiplies as 1x128 x 1x128,
    for the pairs with an E5M2 operand that only F.scaled_mm would take as tiles (which it
    refuses)."""
    strips = tile_scales[..., :kb].repeat_interleave(_BLOCK, dim=-2)[..., :rows, :]
    return strips.transpose(-1, -2).contiguous()


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
    data, scales = w_q.rowwise_data, w_q.rowwise_scale_inv
    sizes = _cublas_group_sizes(x_q, data.shape[1], x_q.shape[1])
    if sizes is None:
        return grouped_block_rows_gemm(
            x_q.rowwise_data, x_q.rowwise_scale_inv, data, scales, x_q.row_offsets, out_dtype
        )
    return _per_group_rows(x_q, data, scales, sizes, out_dtype)


def block_grouped_dgrad(dy_q, w_q, out_dtype) -> torch.Tensor:
    """dx (T, K): per group dy_g W_g, from dy's rowwise copy and the weights' columnwise tiles
    (G, K, N); per group on cuBLAS or one Triton launch, as block_grouped_fprop."""
    data, scales = w_q.columnwise_data, w_q.columnwise_scale_inv
    sizes = _cublas_group_sizes(dy_q, data.shape[1], dy_q.shape[1])
    if sizes is None:
        return grouped_block_rows_gemm(
            dy_q.rowwise_data, dy_q.rowwise_scale_inv, data, scales, dy_q.row_offsets, out_dtype
        )
    return _per_group_rows(dy_q, data, scales, sizes, out_dtype)


def block_grouped_wgrad(dy_q, x_q, out_dtype) -> torch.Tensor:
    """dW (G, N, K): per group dy_g^T x_g over the group's tokens, from the columnwise copies
    of dy (N, T) and x (K, T) with their per-group 128-token blocks, zeros for a group without
    rows; per group on cuBLAS or one Triton launch, as block_grouped_fprop."""
    sizes = _cublas_group_sizes(dy_q, dy_q.shape[1], x_q.shape[1])
    if sizes is None:
        return grouped_block_reduction_gemm(
            dy_q.columnwise_data, dy_q.columnwise_scale_inv, x_q.columnwise_data,
            x_q.columnwise_scale_inv, dy_q.row_offsets, dy_q.block_offsets, out_dtype,
        )  # fmt: skip
    return _per_group_wgrad(dy_q, x_q, sizes, out_dtype)


def _per_group_wgrad(dy_q, x_q, sizes, out_dtype) -> torch.Tensor:
    """(G, N, K): out[g] = dy_g^T x_g, one cuBLAS GEMM per non-empty group (1x128 x 1x128
    along the group's tokens, written in place), zeros for an empty one. Every group's views
    of an operand come from one split; scale rows past the last group's are padding."""
    n, k = dy_q.shape[1], x_q.shape[1]
    out = torch.empty(len(sizes), n, k, dtype=out_dtype, device=dy_q.columnwise_data.device)
    blocks = [-(-m // _BLOCK) for m in sizes]
    used = sum(blocks)
    dy_scales = dy_q.columnwise_scale_inv[:used].t().split(blocks, 1)  # (N, blocks_g)
    x_scales = x_q.columnwise_scale_inv[:used].split(blocks)  # (blocks_g, K)
    dy_cols = dy_q.columnwise_data.split(sizes, 1)  # (N, m_g)
    x_rows = x_q.columnwise_data.t().split(sizes)  # (m_g, K)
    for out_g, m, a, b, a_scale, b_scale in zip(
        out.unbind(0), sizes, dy_cols, x_rows, dy_scales, x_scales, strict=True
    ):
        if m:
            torch._scaled_mm(a, b, a_scale, b_scale, out_dtype=out_dtype, out=out_g)
        else:
            out_g.zero_()
    return out


def _cublas_group_sizes(q, *dims: int) -> list[int] | None:
    """The group sizes of grouped storage q where its GEMMs run group by group on cuBLAS's
    block-scaled GEMM (sizes on the host, every group, the token count and the GEMM's other
    dimensions `dims` multiples of 16, Hopper), else None (the Triton kernels)."""
    sizes = q.m_splits
    data = q.rowwise_data if q.rowwise_data is not None else q.columnwise_data
    if sizes is None or not data.is_cuda or q.shape[0] % _BLOCK_ALIGN:
        return None
    if any(d % _BLOCK_ALIGN for d in dims) or any(m % _BLOCK_ALIGN for m in sizes):
        return None
    return sizes if block_gemm_native("Float8BlockScaling", data.device)[0] else None


def _per_group_rows(a_q, data, scales, sizes, out_dtype) -> torch.Tensor:
    """(T, N): rows of group g = A_g B_g^T, A the 1x128 rowwise copy of a_q, B_g = tile g of
    data (G, N, R) FP8 with scales (G, ceil(N/128), round_up(ceil(R/128), 4)); one cuBLAS GEMM
    per non-empty group, each writing its rows of the output.

    Group g's 1x128 scales must be an (m_g, KB) matrix with strides (1, m_g): one launch
    (kernels/group_scales.py) lays every group's (KB, m_g) block out contiguously, and the
    GEMMs take views of it. torch._scaled_mm takes the 128x128 operand's scales only without
    padding (KB a multiple of 4); otherwise F.scaled_mm pads them, into a new output copied
    into the rows."""
    a_data, a_scale = a_q.rowwise_data, a_q.rowwise_scale_inv
    kb = a_scale.shape[0]
    out = torch.empty(a_data.shape[0], data.shape[1], dtype=out_dtype, device=data.device)
    if (kb == 1 or len(sizes) == 1) and a_scale.is_contiguous():
        flat = a_scale.view(-1)  # the (KB, T) matrix is that layout already
    else:
        flat = group_scales(a_scale, a_q.row_offsets)
    base = flat.storage_offset()  # as_strided's offset counts from the storage's start
    direct = kb % 4 == 0
    if direct:  # (KB, NB): the tiles' scales without the padding columns
        b_scales = scales[:, :, :kb].transpose(1, 2).unbind(0)
    elif _has_e5m2(a_data, data):  # (KB, N): as 1x128 strips
        b_scales = tiles_as_strips(scales, data.shape[1], kb).unbind(0)
        direct = True
    else:  # (round_up(KB, 4), NB)
        b_scales = scales.transpose(1, 2).unbind(0)
    b_data = data.transpose(1, 2).unbind(0)  # (R, N)
    start = 0
    for out_g, m, a, b, b_scale in zip(
        out.split(sizes), sizes, a_data.split(sizes), b_data, b_scales, strict=True
    ):
        if m:
            a_scale_g = flat.as_strided((m, kb), (1, m), base + kb * start)
            if direct:
                torch._scaled_mm(a, b, a_scale_g, b_scale, out_dtype=out_dtype, out=out_g)
            else:
                out_g.copy_(_padded_scales_mm(a, b, a_scale_g, b_scale, out_dtype))
        start += m
    return out


def _padded_scales_mm(a, b, a_scale, b_scale, out_dtype) -> torch.Tensor:
    """a (m, R) in 1x128 blocks with a_scale (m, KB) times b (R, N) in 128x128 tiles with
    b_scale (round_up(KB, 4), NB): what _block_scaled_mm runs for such a pair without `out`
    (F.scaled_mm, no bias)."""
    scaling = F.ScalingType
    return F.scaled_mm(
        a, b, a_scale, scaling.BlockWise1x128, b_scale, scaling.BlockWise128x128, bias=None,
        output_dtype=out_dtype,
    )  # fmt: skip
