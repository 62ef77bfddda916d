"""Argument checks and torch references of the grouped block-scaled FP8 GEMMs
(grouped_gemm_block.py, which re-exports the references): the operands dequantized to fp32 and
multiplied group by group in fp32, the offsets read on the host and checked."""

from __future__ import annotations

import torch

from . import block_layout
from .block_layout import BLOCK, max_blocks
from .grouped_gemm_fp8 import OUT_DTYPES, _check_fp8, _host_ranges

__all__ = [
    "ROW_ALIGN",
    "grouped_block_reduction_gemm_reference",
    "grouped_block_rows_gemm_reference",
]

ROW_ALIGN = 16  # R of a rows GEMM: FP8 rows of whole 16-byte vectors


def _check_tensor(name: str, tensor: torch.Tensor, dtype, shape: tuple, device) -> None:
    """ValueError unless tensor has this dtype and shape and lies on device."""
    if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
        raise ValueError(
            f"{name} must be {dtype} of shape {tuple(shape)}, got {tensor.dtype} of shape "
            f"{tuple(tensor.shape)}"
        )
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but the operands are on {device}")


def _check_common(row_offsets, tokens: int, groups: int, out_dtype, device) -> None:
    """ValueError unless row_offsets is int32 (G + 1,) on device, with G > 0 when there are
    tokens; TypeError unless out_dtype is bf16, fp16 or fp32."""
    _check_tensor("row_offsets", row_offsets, torch.int32, (groups + 1,), device)
    if groups == 0 and tokens > 0:
        raise ValueError(f"there are no groups, so there must be no tokens, got {tokens}")
    if out_dtype not in OUT_DTYPES:
        known = ", ".join(str(d) for d in OUT_DTYPES)
        raise TypeError(f"out_dtype must be one of {known}, got {out_dtype}")


def _check_rows(a, a_scale, b, b_scale, row_offsets, out_dtype) -> None:
    """The argument rules of grouped_block_rows_gemm."""
    _check_fp8("a", a, 2)
    _check_fp8("b", b, 3)
    tokens, reduced = a.shape
    if b.shape[2] != reduced:
        raise ValueError(
            f"b (G, N, R) must have a's R = {reduced} as its last dimension, got shape "
            f"{tuple(b.shape)}"
        )
    if reduced % ROW_ALIGN:
        raise ValueError(f"R (a's last dimension) must be a multiple of {ROW_ALIGN}, got {reduced}")
    if b.device != a.device:
        raise ValueError(f"b is on {b.device} but a is on {a.device}")
    groups, features = b.shape[0], b.shape[1]
    _check_common(row_offsets, tokens, groups, out_dtype, a.device)
    r_blocks = -(-reduced // BLOCK)
    _check_tensor("a_scale", a_scale, torch.float32, (r_blocks, tokens), a.device)
    b_scale_shape = (groups, -(-features // BLOCK), -(-r_blocks // 4) * 4)
    _check_tensor("b_scale", b_scale, torch.float32, b_scale_shape, a.device)


def _check_reduction(
    a_cols, a_scale, b_cols, b_scale, row_offsets, block_offsets, out_dtype, out, accumulate
) -> None:
    """The argument rules of grouped_block_reduction_gemm."""
    _check_fp8("a_cols", a_cols, 2)
    _check_fp8("b_cols", b_cols, 2)
    (features, tokens), reduced = a_cols.shape, b_cols.shape[0]
    if b_cols.shape[1] != tokens:
        raise ValueError(
            f"b_cols (K, T) must have a_cols' T = {tokens} columns, got shape {tuple(b_cols.shape)}"
        )
    device = a_cols.device
    if b_cols.device != device:
        raise ValueError(f"b_cols is on {b_cols.device} but a_cols is on {device}")
    if row_offsets.dim() != 1 or row_offsets.numel() == 0:
        raise ValueError(f"row_offsets must be 1-D (G + 1,), got shape {tuple(row_offsets.shape)}")
    groups = row_offsets.numel() - 1
    _check_common(row_offsets, tokens, groups, out_dtype, device)
    _check_tensor("block_offsets", block_offsets, torch.int32, (groups + 1,), device)
    blocks = max_blocks(tokens, groups)
    _check_tensor("a_scale", a_scale, torch.float32, (blocks, features), device)
    _check_tensor("b_scale", b_scale, torch.float32, (blocks, reduced), device)
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs `out`, the tensor to add to")
        return
    _check_tensor("out", out, out_dtype, (groups, features, reduced), device)
    if not out.is_contiguous():
        raise ValueError(f"out must be contiguous, got strides {out.stride()}")


# ----------------------------------------------------------------------------------------------
# Torch references: the operands dequantized to fp32, multiplied group by group in fp32
# ----------------------------------------------------------------------------------------------


def grouped_block_rows_gemm_reference(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    row_offsets: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Torch reference of grouped_block_rows_gemm (reads row_offsets on the host; checks them)."""
    _check_rows(a, a_scale, b, b_scale, row_offsets, out_dtype)
    (tokens, reduced), features = a.shape, b.shape[1]
    ranges = _host_ranges(row_offsets, tokens)
    c = torch.zeros(tokens, features, dtype=out_dtype, device=a.device)
    if c.numel() == 0:
        return c
    a_values = a.float() * _along_columns(a_scale.t(), reduced)
    for g, (start, end) in enumerate(ranges):
        if end > start:
            b_tiles = _along_columns(b_scale[g], reduced).repeat_interleave(BLOCK, 0)
            b_values = b[g].float() * b_tiles[:features]
            c[start:end] = _fp32_mm(a_values[start:end], b_values)
    return c


def grouped_block_reduction_gemm_reference(
    a_cols: torch.Tensor,
    a_scale: torch.Tensor,
    b_cols: torch.Tensor,
    b_scale: torch.Tensor,
    row_offsets: torch.Tensor,
    block_offsets: torch.Tensor,
    out_dtype: torch.dtype,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """Torch reference of grouped_block_reduction_gemm (reads both offsets on the host, and
    checks them: block_offsets must be block_layout.block_offsets(row_offsets))."""
    args = (a_cols, a_scale, b_cols, b_scale, row_offsets, block_offsets)
    _check_reduction(*args, out_dtype, out, accumulate)
    ranges = _host_ranges(row_offsets, a_cols.shape[1])
    first_blocks = block_offsets.tolist()
    want = block_layout.block_offsets(row_offsets).tolist()
    if first_blocks != want:
        raise ValueError(
            f"block_offsets must be the running sum of ceil(m_g / {BLOCK}), {want} for these "
            f"row_offsets, got {first_blocks}"
        )
    result = torch.zeros(len(ranges), a_cols.shape[0], b_cols.shape[0], device=a_cols.device)
    for g, (start, end) in enumerate(ranges):
        if end > start:  # block j of the group: its 128 columns from start, scale row b_g + j
            blocks = slice(first_blocks[g], first_blocks[g + 1])
            a_g = a_cols[:, start:end].float() * _along_columns(a_scale[blocks].t(), end - start)
            b_g = b_cols[:, start:end].float() * _along_columns(b_scale[blocks].t(), end - start)
            result[g] = _fp32_mm(a_g, b_g)
    if out is None:
        return result.to(out_dtype)
    if accumulate:
        result += out.float()
    return out.copy_(result)


def _along_columns(scale: torch.Tensor, columns: int) -> torch.Tensor:
    """scale (r, c), one per 128-wide block of columns -> (r, columns), one per column."""
    return scale.repeat_interleave(BLOCK, 1)[:, :columns]


def _fp32_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 a (M, K) @ b (N, K)^T, autocast off."""
    with torch.autocast(a.device.type, enabled=False):
        return torch.mm(a, b.t())
