"""The 1x128 rowwise scales of a grouped block-scaled value, regrouped for per-group GEMMs.

A grouped 1x128 value (G groups of rows of a (T, K) tensor, group g owning rows [o_g, o_{g+1}),
o = row_offsets (G + 1,) int32, o_0 = 0, o_G = T) keeps its rowwise scales as one (KB, T) fp32
matrix, KB = ceil(K / 128): [j, t] the scale of row t's K-block j. cuBLAS's block-scaled GEMM
of group g wants that group's scales as an (m_g, KB) matrix with strides (1, m_g): a contiguous
(KB, m_g) block, which a slice of the (KB, T) matrix is not (its rows are T apart).

group_scales writes every group's block into one flat (KB * T,) buffer, group g's (KB, m_g)
block contiguous from element KB * o_g:

    out[KB * o_g + j * m_g + (t - o_g)] = scales[j, t]    for o_g <= t < o_{g+1}

so group g's GEMM operand is the view out[KB * o_g : KB * o_{g+1}].view(KB, m_g).t(), its
bounds known to the host from the host sizes. The offsets are read on the device (no host
synchronization). An exact copy: the same bytes on every path.

On CUDA with Triton one launch; elsewhere the torch reference below (one copy per group).
"""

from __future__ import annotations

import torch

from ._triton import FastLaunch, int_key, ptr_key, tl, triton, triton_available
from .block_layout import check_offsets
from .grouped_gemm_fp8 import _host_ranges

__all__ = ["CONFIG", "group_scales", "group_scales_reference"]

# (BLOCK_T tokens, BLOCK_J K-blocks, num_warps) of a program: 2048 scales. Not yet tuned on a
# GPU (the copy moves KB * T * 8 bytes: 8 MB for T = 32768, K = 4096).
CONFIG = (256, 8, 4)

if triton is not None:

    @triton.jit
    def _group_scales_kernel(
        scales_ptr,  # (KB, T) fp32, contiguous: [j, t] the scale of row t's K-block j
        row_offsets_ptr,  # (G + 1,) int32: o_g
        out_ptr,  # (KB * T,) fp32: group g's (KB, m_g) block from element KB * o_g
        T, KB, G,
        BLOCK_T: tl.constexpr, BLOCK_J: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
        in_t = t < T
        # The group of row t: the number of groups ending at or before it (an empty group ends
        # where the previous one does, so it is counted and skipped). A loop over G rather than
        # a (BLOCK_T, G) comparison: any G, and G scalar loads a program are nothing here.
        group = tl.zeros((BLOCK_T,), dtype=tl.int32)
        for g in range(G):
            end = tl.load(row_offsets_ptr + g + 1)
            group += (end <= t).to(tl.int32)
        start = tl.load(row_offsets_ptr + group, mask=in_t, other=0)
        size = tl.load(row_offsets_ptr + group + 1, mask=in_t, other=0) - start
        mask = (j < KB)[:, None] & in_t[None, :]
        rows = j.to(tl.int64)[:, None]
        src = rows * T + t[None, :]
        dst = start.to(tl.int64)[None, :] * KB + rows * size[None, :] + (t - start)[None, :]
        tl.store(out_ptr + dst, tl.load(scales_ptr + src, mask=mask), mask=mask)

    _launch_group_scales = FastLaunch(_group_scales_kernel)


# ----------------------------------------------------------------------------------------------
# Public function and launcher
# ----------------------------------------------------------------------------------------------


def group_scales(scales: torch.Tensor, row_offsets: torch.Tensor) -> torch.Tensor:
    """(KB * T,) fp32: the rowwise scales (KB, T) fp32 of a grouped 1x128 value, group g's
    (KB, m_g) block contiguous from element KB * o_g (row_offsets (G + 1,) int32 on scales'
    device, read there). One launch on CUDA (none for an empty value), the torch reference
    elsewhere."""
    _check(scales, row_offsets)
    if not (scales.is_cuda and triton_available()):
        return group_scales_reference(scales, row_offsets)
    return _group_scales(scales, row_offsets, CONFIG)


def _group_scales(scales: torch.Tensor, row_offsets: torch.Tensor, config) -> torch.Tensor:
    """Launch _group_scales_kernel over (token tiles, K-block tiles) with config (BLOCK_T,
    BLOCK_J, num_warps); no launch when there is nothing to copy."""
    blocks, tokens = scales.shape
    out = torch.empty(blocks * tokens, dtype=torch.float32, device=scales.device)
    if out.numel() == 0:
        return out
    scales, row_offsets = scales.contiguous(), row_offsets.contiguous()
    groups = row_offsets.shape[0] - 1
    block_t, block_j, num_warps = config
    grid = (-(-tokens // block_t), -(-blocks // block_j), 1)
    key = (config, *int_key(tokens), *int_key(blocks), *int_key(groups))
    key += ptr_key(scales, row_offsets, out)
    _launch_group_scales(
        key, grid, num_warps, scales, row_offsets, out, tokens, blocks, groups, block_t, block_j
    )
    return out


def _check(scales: torch.Tensor, row_offsets: torch.Tensor) -> None:
    """The host-side rules (the offsets' values are on the device: the reference checks them)."""
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 or scales.dim() != 2:
        what = f"{scales.dim()}-D {scales.dtype}" if isinstance(scales, torch.Tensor) else scales
        raise ValueError(f"scales must be a 2-D fp32 tensor (KB, T), got {what}")
    check_offsets(row_offsets, scales.device, "scales")


# ----------------------------------------------------------------------------------------------
# Torch reference: the same function, used on CPU and in tests
# ----------------------------------------------------------------------------------------------


def group_scales_reference(scales: torch.Tensor, row_offsets: torch.Tensor) -> torch.Tensor:
    """Torch reference of group_scales: one copy per group (reads row_offsets on the host and
    checks them: from 0, never decreasing, ending at T)."""
    _check(scales, row_offsets)
    blocks, tokens = scales.shape
    out = torch.empty(blocks * tokens, dtype=torch.float32, device=scales.device)
    for start, end in _host_ranges(row_offsets, tokens):
        out[blocks * start : blocks * end].view(blocks, end - start).copy_(scales[:, start:end])
    return out
