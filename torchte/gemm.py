"""The one place that chooses a GEMM.

High precision: torch.nn.functional.linear / torch.mm / torch.addmm (fp32 output for wgrad
accumulation). FP8: torch._scaled_mm on a GPU; on a CPU the FP8 operands are multiplied in fp32
(products of FP8 values are exact there) and scaled after. torch._scaled_mm needs the shared
dim K and b's rows N divisible by 16 (a's rows M may be any number): fp8_gemm refuses other
shapes on both devices with the same ValueError, so a run on a laptop fails where the GPU would.

Every FP8 GEMM here takes both operands "K-major": a (M, K) and b (N, K), row-major, and gives
out (M, N) = (a * a_scale_inv) @ (b * b_scale_inv).T.

Block-scaled operands (GemmOperand: Float8BlockScaling's 1x128 / 128x128 FP8, the emulated
MXFP8 / NVFP4 values) go through operand_gemm: torch's block-scaled matmul on Hopper, else the
operands dequantized exactly and multiplied with fp32 accumulation.

Grouped (mixture-of-experts) GEMMs over G groups of rows, group g owning rows
[offs[g-1], offs[g]) of x (offs: int32 cumulative ends, offs[G-1] = T), run as one
torch._grouped_mm where grouped_mm_supported says it works (bf16 on sm90 and newer, probed once
per device and layout), else the callers loop over the groups.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ._gemm_util import empty_product as _empty_product
from ._gemm_util import fp32_mm
from ._group_splits import GroupSplits
from .gemm_block import (
    block_grouped_dgrad,
    block_grouped_fprop,
    block_grouped_wgrad,
    operand_gemm,
)
from .kernels.grouped_gemm_fp8 import (
    grouped_reduction_gemm,
    grouped_rows_gemm,
    rows_gemm_takes_tma,
)

__all__ = [
    "FP8_GEMM_ALIGN",
    "block_grouped_dgrad",
    "block_grouped_fprop",
    "block_grouped_wgrad",
    "fp8_gemm",
    "fp32_mm",
    "grouped_dgrad",
    "grouped_fprop",
    "grouped_mm_supported",
    "grouped_wgrad",
    "hp_linear",
    "hp_mm",
    "operand_gemm",
    "scaled_grouped_dgrad",
    "scaled_grouped_fprop",
    "scaled_grouped_mm_supported",
]


# torch._scaled_mm (per-tensor scales, on a GPU) needs K and N multiples of this; M is free.
FP8_GEMM_ALIGN = 16


def hp_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (M, K) @ w (N, K).T + bias (N,) -> (M, N), in x's dtype."""
    return F.linear(x, w, bias)


def hp_mm(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, accumulate: bool = False
) -> torch.Tensor:
    """a (M, K) @ b (K, N). With `out` (M, N) fp32: written (accumulate=False) or added to
    (accumulate=True) in place, products accumulated in fp32; without it, a's dtype."""
    if out is None:
        return torch.mm(a, b)
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        if accumulate:
            return torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    a32, b32 = a.float(), b.float()
    if accumulate:
        return out.addmm_(a32, b32)
    return torch.mm(a32, b32, out=out)


def fp8_gemm(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """a (M, K) fp8, b (N, K) fp8, scale_invs (1,) fp32 -> (M, N) in out_dtype (+ bias (N,)).

    With `out` (M, N) fp32 the result is written into it, or added to it (accumulate=True).
    K and N must be multiples of 16 (any M), on the CPU as on a GPU: ValueError otherwise.
    """
    m, k = a.shape
    n = b.shape[0]
    if m == 0 or n == 0 or k == 0:
        return _empty_product(m, n, a.device, out_dtype, bias, out, accumulate)
    if k % FP8_GEMM_ALIGN or n % FP8_GEMM_ALIGN:
        raise ValueError(
            f"fp8_gemm: FP8 GEMMs need the shared dim K and b's rows N divisible by "
            f"{FP8_GEMM_ALIGN} (torch._scaled_mm's rule on a GPU, kept on the CPU), got a "
            f"{tuple(a.shape)} and b {tuple(b.shape)}; a's rows M may be any number"
        )
    if a.is_cuda:
        return _scaled_mm_cuda(
            a, a_scale_inv, b, b_scale_inv, out_dtype, bias, out, accumulate, use_fast_accum
        )
    prod = fp32_mm(a.float(), b.float().t()) * (a_scale_inv * b_scale_inv)
    if bias is not None:
        prod = prod + bias.float()
    if out is None:
        return prod.to(out_dtype)
    return out.add_(prod) if accumulate else out.copy_(prod)


def _scaled_mm_cuda(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, out, accumulate, fast):
    fused_bias = bias if (bias is not None and out_dtype != torch.float32) else None
    if out is not None and not accumulate:
        torch._scaled_mm(
            a, b.t(), a_scale_inv, b_scale_inv, fused_bias, None, out_dtype, fast, out=out
        )
        result = out
    else:
        result = torch._scaled_mm(
            a, b.t(), a_scale_inv, b_scale_inv, fused_bias, None, out_dtype, fast
        )
        if out is not None:
            # cuBLAS could add in place (beta = 1); torch._scaled_mm does not expose it.
            result = out.add_(result)
    if bias is not None and fused_bias is None:
        result = result.add_(bias)
    return result


# ----------------------------------------------------------------------------------------------
# Grouped GEMMs (high precision)
# ----------------------------------------------------------------------------------------------


def grouped_fprop(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x (T, K), w (G, N, K) -> y (T, N): y[rows of g] = x[rows of g] @ w[g].T."""
    return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)


def grouped_dgrad(dy: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """dy (T, N), w (G, N, K) -> dx (T, K): dx[rows of g] = dy[rows of g] @ w[g]."""
    return torch._grouped_mm(dy, w, offs=offs)


def grouped_wgrad(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """dy (T, N), x (T, K) -> dw (G, N, K), one buffer: dw[g] = dy[rows of g].T @ x[rows of g]
    (zeros for a group without rows)."""
    return torch._grouped_mm(dy.t(), x, offs=offs)


# Group sizes of the capability probes: multiples of 16 (what FP8 MoE layers pad to) and ragged.
PROBE_SIZES = {False: [16, 0, 32], True: [13, 0, 35]}


@functools.cache
def grouped_mm_supported(device: torch.device, dtype: torch.dtype, ragged: bool = True) -> bool:
    """Whether the three grouped GEMMs above run on `device` for `dtype` and agree with a loop
    of matmuls (checked once on a small problem with an empty group; ragged: group sizes that
    are not multiples of 16). CUDA only: on the CPU the callers' loop is the same arithmetic
    as te.Linear, which the tests hold it to."""
    if device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    try:
        with torch.autocast(device.type, enabled=False):  # the fp32 reference stays fp32
            return _grouped_mm_agrees(device, dtype, PROBE_SIZES[ragged])
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def _grouped_mm_agrees(device: torch.device, dtype: torch.dtype, sizes: list[int]) -> bool:
    gen = torch.Generator().manual_seed(0)
    k, n = 64, 48
    x = torch.randn(sum(sizes), k, generator=gen).to(device, dtype)
    dy = torch.randn(sum(sizes), n, generator=gen).to(device, dtype)
    w = torch.randn(len(sizes), n, k, generator=gen).to(device, dtype)
    offs = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
    got = (grouped_fprop(x, w, offs), grouped_dgrad(dy, w, offs), grouped_wgrad(dy, x, offs))
    xs, dys = x.float().split(sizes), dy.float().split(sizes)
    want = (
        torch.cat([xg @ wg.t() for xg, wg in zip(xs, w.float(), strict=True)]),
        torch.cat([dg @ wg for dg, wg in zip(dys, w.float(), strict=True)]),
        torch.stack([dg.t() @ xg for dg, xg in zip(dys, xs, strict=True)]),
    )
    tol = 5e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
    return all(
        g.shape == v.shape and torch.allclose(g.float(), v, rtol=tol, atol=tol)
        for g, v in zip(got, want, strict=True)
    )


# ----------------------------------------------------------------------------------------------
# Grouped GEMMs (FP8)
# ----------------------------------------------------------------------------------------------


def scaled_grouped_fprop(x_fp8, w_fp8, splits, out_dtype: torch.dtype) -> torch.Tensor:
    """y (T, N) = per group (x_g * x_scale_inv[g]) @ (w_g * w_scale_inv[g]).T as one
    torch._scaled_grouped_mm: x_fp8 a GroupedStorage (rowwise (T, K)), w_fp8 a GroupedStorage
    of G groups of N rows (rowwise (G * N, K)), splits the GroupSplits."""
    num_groups, n = len(w_fp8.m_splits), w_fp8.m_splits[0]
    weights = w_fp8.rowwise_data.view(num_groups, n, -1)
    return _scaled_grouped(x_fp8, weights.transpose(1, 2), w_fp8.scale_inv, splits, out_dtype)


def scaled_grouped_dgrad(dy_fp8, w_fp8, splits, out_dtype: torch.dtype) -> torch.Tensor:
    """dx (T, K) = per group (dy_g * dy_scale_inv[g]) @ (w_g * w_scale_inv[g]) as one
    torch._scaled_grouped_mm: dy_fp8 a GroupedStorage (rowwise (T, N)), w_fp8 one of G groups
    of N rows with its columnwise data (G blocks of (K, N): N is a multiple of 16, so no
    padding), which is the column-major (G, N, K) operand."""
    num_groups, n = len(w_fp8.m_splits), w_fp8.m_splits[0]
    weights_t = w_fp8.columnwise_data.view(num_groups, -1, n)  # (G, K, N) row-major
    return _scaled_grouped(dy_fp8, weights_t.transpose(1, 2), w_fp8.scale_inv, splits, out_dtype)


def device_grouped_rows(
    a_fp8, b: torch.Tensor, b_scale_inv, out_dtype, fast_accum: bool = False
) -> torch.Tensor:
    """(T, O): per group (a_g * a_scale_inv[g]) @ (b[g] * b_scale_inv[g]).T for a_fp8 a
    GroupedStorage (rowwise (T, I)) and b (G, O, I) fp8, as one Triton kernel that reads the
    group sizes on the device (kernels/grouped_gemm_fp8.py): any FP8 dtypes, any out_dtype.
    fprop with b the weights (G, N, K); dgrad with b their columnwise blocks (G, K, N)."""
    row_offsets, _ = a_fp8.device_offsets()
    a, a_scale_inv = a_fp8.rowwise_data, a_fp8.scale_inv
    return grouped_rows_gemm(a, a_scale_inv, b, b_scale_inv, row_offsets, out_dtype, fast_accum)


def grouped_fprop_takes_tma(x_fp8, w_fp8) -> bool:
    """Whether device_grouped_rows runs the persistent TMA kernel for the forward GEMM of these
    operands (x_fp8 a GroupedStorage (T, K), w_fp8 G groups of N rows): on a GPU with TMA past
    kernels/grouped_gemm_fp8.SMALL_ROWS tokens. Measured on an H200 at the MoE MLP's shapes
    (docs/benchmarks.md), with fast accumulation it takes 0.96x / 1.09x the time of the same
    GEMMs as per-expert cuBLAS calls and 0.82x that of torch._scaled_grouped_mm."""
    return rows_gemm_takes_tma(x_fp8.rowwise_data, w_fp8.rowwise_data)


def device_grouped_wgrad(dy_fp8, x_fp8, out_dtype) -> torch.Tensor:
    """(G, N, K): per group dy_g^T x_g from the columnwise blocks of two GroupedStorages of the
    same splits (dy (T, N), x (T, K)), as one Triton kernel reading the offsets on the device;
    zeros for a group without rows."""
    _, col_offsets = dy_fp8.device_offsets()
    n, k = dy_fp8.shape[1], x_fp8.shape[1]
    dy_cols, x_cols = dy_fp8.columnwise_data, x_fp8.columnwise_data
    dy_si, x_si = dy_fp8.scale_inv, x_fp8.scale_inv
    return grouped_reduction_gemm(dy_cols, dy_si, x_cols, x_si, col_offsets, n, k, out_dtype)


def _scaled_grouped(a_fp8, b, b_scale_inv, splits, out_dtype) -> torch.Tensor:
    """a (T, I) rowwise of a GroupedStorage @ b (G, I, O) per group, b column-major (stride 1
    along I, as torch._scaled_grouped_mm wants it): the per-tensor scales made the row scales
    it takes, a's scale_inv of each row's group and b's repeated over its O columns."""
    num_groups, n = b.shape[0], b.shape[2]
    row_scale = a_fp8.scale_inv.index_select(0, splits.row_groups())
    col_scale = b_scale_inv[:, None].expand(num_groups, n).contiguous()
    return torch._scaled_grouped_mm(
        a_fp8.rowwise_data, b, row_scale, col_scale, offs=splits.offsets(),
        out_dtype=out_dtype, use_fast_accum=True,
    )  # fmt: skip


@functools.cache
def scaled_grouped_mm_supported(device: torch.device, a_dtype, b_dtype, ragged=True) -> bool:
    """Whether scaled_grouped_fprop runs on `device` for these FP8 dtypes and agrees with a
    loop of fp8_gemm (checked once on a small problem with an empty group; ragged as for
    grouped_mm_supported)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_grouped_mm"):
        return False
    try:
        with torch.autocast(device.type, enabled=False):
            return _scaled_grouped_agrees(device, a_dtype, b_dtype, PROBE_SIZES[ragged])
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False


def _scaled_grouped_agrees(device, a_dtype, b_dtype, sizes: list[int]) -> bool:
    from torchte.quantization.grouped import GroupedStorage  # gemm's operands: imported late

    gen = torch.Generator().manual_seed(0)
    k, n = 64, 48
    x = (torch.randn(sum(sizes), k, generator=gen) * 4).to(device, a_dtype)
    x_scale = torch.tensor([0.5, 1.0, 0.25], device=device)
    x_fp8 = GroupedStorage(x, None, x_scale, a_dtype, sizes, (sum(sizes), k))
    groups = len(sizes)
    w = (torch.randn(groups * n, k, generator=gen) * 4).to(device, b_dtype)
    w_scale = torch.tensor([0.125 * (g + 1) for g in range(groups)], device=device)
    w_fp8 = GroupedStorage(w, None, w_scale, b_dtype, [n] * groups, (groups * n, k))
    splits = GroupSplits(list(sizes), None, groups, sum(sizes), device)
    got = scaled_grouped_fprop(x_fp8, w_fp8, splits, torch.bfloat16)
    want = torch.cat([
        fp8_gemm(x_fp8.group(g).rowwise_data, x_scale[g : g + 1].clone(),
                 w_fp8.group(g).rowwise_data, w_scale[g : g + 1].clone(), torch.bfloat16,
                 use_fast_accum=True)
        for g in range(groups)
    ])  # fmt: skip
    return got.shape == want.shape and torch.allclose(got.float(), want.float(), rtol=2e-2, atol=1)
