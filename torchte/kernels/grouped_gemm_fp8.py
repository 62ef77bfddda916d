"""Grouped FP8 GEMMs of a mixture-of-experts linear layer whose group sizes live on the device
only (int32 offsets tensors): no size is read on the host, so a call never syncs and can be
captured in a CUDA graph. One launch per call.

Legend: G groups (experts), T tokens, R the reduced dimension of a rows GEMM, N its output
features; o_g = row_offsets[g] (o_0 = 0, o_G = T, group g owns rows [o_g, o_{g+1}), may be
empty); c_g = col_offsets[g] (c_0 = 0, w_g = c_{g+1} - c_g a multiple of 16, may be 0).
Every operand is FP8 (float8_e4m3fn or float8_e5m2, the two may differ) with one per-tensor
scale per group: value = FP8 value * scale_inv[g], scale_inv fp32 (G,). Products accumulate in
fp32, promoted from the tensor cores' FP8 accumulator every BLOCK_K products (as cuBLAS does
without fast accumulation), and the two scales multiply the fp32 sum once at the end.

- grouped_rows_gemm: a (T, R) row-major, b (G, N, R) row-major -> c (T, N),
  c[rows of g] = (a_g * a_scale_inv[g]) @ (b[g] * b_scale_inv[g]).T. The forward GEMM
  (a = x (T, K), b = weights (G, N, K)) and the input-gradient GEMM (a = dy (T, N),
  b = the weights' transposes (G, K, N)).
- grouped_reduction_gemm: group g's operands are the row-major blocks A_g (m, w_g) at element
  m * c_g of the flat a_cols and B_g (n, w_g) at element n * c_g of the flat b_cols (the
  columnwise layout of grouped_cast) -> out (G, m, n), out[g] = (A_g * a_scale_inv[g]) @
  (B_g * b_scale_inv[g]).T, zeros where w_g = 0. The weight-gradient GEMM: A_g = dy_g^T
  (N, tokens), B_g = x_g^T (K, tokens), out (G, N, K).

Both operands of every tile are loaded with the reduced dimension contiguous (K-major), the
layout Hopper's FP8 tensor-core instructions (wgmma) take.

The grids are worst cases, because the host knows only T and G. Rows GEMM: (cdiv(N, BLOCK_N),
cdiv(T, BLOCK_M) + G); row tiles are numbered group by group (group g has cdiv(m_g, BLOCK_M) of
them, see grouped_cast's _tile_group), any split of T rows into G groups has at most
cdiv(T, BLOCK_M) + G of them, and the programs past the split's own count find no group and
return at once. Reduction GEMM: (cdiv(m, BLOCK_M) * cdiv(n, BLOCK_N), G), each program looping
over its group's w_g columns. The kernels trust the offsets (checking them would cost a sync);
the references check them.
"""

from __future__ import annotations

import itertools

import torch

from ._fp8_codec import FP8_MAX
from ._triton import FastLaunch, int_key, ptr_key, tl, triton, triton_available
from .grouped_cast import _group_block
from .grouped_gemm_tma import reduction_gemm_tma, rows_gemm_tma, tma_available

__all__ = [
    "REDUCTION_CONFIG",
    "REDUCTION_TMA_CONFIG",
    "ROWS_CONFIG",
    "ROWS_CONFIG_SMALL",
    "ROWS_TMA_CONFIG",
    "grouped_reduction_gemm",
    "grouped_reduction_gemm_reference",
    "grouped_rows_gemm",
    "grouped_rows_gemm_reference",
    "rows_gemm_takes_tma",
]

# Pointer kernels (GPUs without TMA, and up to SMALL_ROWS tokens): (BLOCK_M, BLOCK_N, BLOCK_K,
# num_warps, num_stages), from a sweep on an H100 (8 groups, K and N 1024 to 4096): 64-row
# tiles win up to SMALL_ROWS tokens, where 128-row ones leave SMs idle.
ROWS_CONFIG = (128, 128, 128, 8, 4)
ROWS_CONFIG_SMALL = (64, 128, 128, 4, 4)
SMALL_ROWS = 4096
REDUCTION_CONFIG = (128, 128, 128, 8, 4)
# The persistent TMA kernels (grouped_gemm_tma.py) past SMALL_ROWS tokens on GPUs with TMA:
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, GROUP_M, TMA store), the fastest of
# benchmarks/grouped_fp8_sweep.py on an H200 at the MoE MLP's shapes (docs/benchmarks.md).
ROWS_TMA_CONFIG = (256, 128, 128, 8, 3, 8, True)
REDUCTION_TMA_CONFIG = (256, 128, 128, 8, 3, 8, False)

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

if triton is not None:
    from .grouped_cast import _tile_group
    from .grouped_gemm_tma import _masked_store as _store_tile

    @triton.jit
    def _fp8_tile_product(
        a_ptr, b_ptr, stride, a_rows, b_rows, depth,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        NUM_STAGES: tl.constexpr,
    ):  # fmt: skip
        """fp32 (BLOCK_M, BLOCK_N) = A @ B.T over `depth` columns: A the row-major FP8 tile at
        a_ptr (rows < a_rows), B the one at b_ptr (rows < b_rows), both of row stride `stride`;
        masked elements read as zero."""
        a_rows_in = tl.arange(0, BLOCK_M) < a_rows
        b_rows_in = tl.arange(0, BLOCK_N) < b_rows
        cols = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + tl.arange(0, BLOCK_M)[:, None] * stride + cols[None, :]
        b_ptrs = b_ptr + tl.arange(0, BLOCK_N)[:, None] * stride + cols[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k in tl.range(0, tl.cdiv(depth, BLOCK_K), num_stages=NUM_STAGES):
            cols_in = cols < depth - k * BLOCK_K
            a = tl.load(a_ptrs, mask=a_rows_in[:, None] & cols_in[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=b_rows_in[:, None] & cols_in[None, :], other=0.0)
            # Promote the tensor cores' FP8 accumulator to fp32 once per BLOCK_K products.
            acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BLOCK_K)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        return acc

    @triton.jit
    def _grouped_rows_gemm_kernel(
        a_ptr,  # (T, R) fp8
        a_scale_inv_ptr,  # (G,) fp32
        b_ptr,  # (G, N, R) fp8
        b_scale_inv_ptr,  # (G,) fp32
        c_ptr,  # (T, N) bf16 / fp16 / fp32
        row_offsets_ptr,  # (G + 1,) int32: o_g
        N,
        R,
        G,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        NUM_STAGES: tl.constexpr,
        G_BLOCK: tl.constexpr,  # a power of two >= G
    ):
        # Consecutive programs share a row tile of a: one wave of the grid reads a once.
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        group, tile = _tile_group(row_offsets_ptr, G, pid_m, BLOCK_M, G_BLOCK)
        # Past the split's last tile, _tile_group counts every group (and its G_BLOCK padding)
        # as coming before: an idle program of the worst-case grid.
        if group >= G:
            return
        row_start = tl.load(row_offsets_ptr + group)
        rows_left = tl.load(row_offsets_ptr + group + 1) - row_start - tile * BLOCK_M
        first_row = (row_start + tile * BLOCK_M).to(tl.int64)
        first_col = pid_n * BLOCK_N
        b_tile_ptr = b_ptr + (group.to(tl.int64) * N + first_col) * R
        acc = _fp8_tile_product(
            a_ptr + first_row * R, b_tile_ptr, R, rows_left, N - first_col, R,
            BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES,
        )  # fmt: skip
        acc *= tl.load(a_scale_inv_ptr + group) * tl.load(b_scale_inv_ptr + group)
        c_tile_ptr = c_ptr + first_row * N + first_col
        _store_tile(c_tile_ptr, N, rows_left, N - first_col, acc, BLOCK_M, BLOCK_N)

    @triton.jit
    def _grouped_reduction_gemm_kernel(
        a_ptr,  # flat fp8: (m, w_g) row-major blocks at element m * c_g
        a_scale_inv_ptr,  # (G,) fp32
        b_ptr,  # flat fp8: (n, w_g) row-major blocks at element n * c_g
        b_scale_inv_ptr,  # (G,) fp32
        out_ptr,  # (G, m, n) bf16 / fp16 / fp32
        col_offsets_ptr,  # (G + 1,) int32: c_g, multiples of 16
        M,
        N,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        NUM_STAGES: tl.constexpr,
    ):
        pid = tl.program_id(0)
        group = tl.program_id(1)
        tiles_n = tl.cdiv(N, BLOCK_N)
        first_row = (pid // tiles_n) * BLOCK_M
        first_col = (pid % tiles_n) * BLOCK_N
        col_start = tl.multiple_of(tl.load(col_offsets_ptr + group), 16)
        # The row stride of both blocks: a multiple of 16 makes the loads 16-byte vectors.
        width = tl.multiple_of(tl.load(col_offsets_ptr + group + 1) - col_start, 16)
        a_tile_ptr = a_ptr + col_start.to(tl.int64) * M + first_row.to(tl.int64) * width
        b_tile_ptr = b_ptr + col_start.to(tl.int64) * N + first_col.to(tl.int64) * width
        acc = _fp8_tile_product(
            a_tile_ptr, b_tile_ptr, width, M - first_row, N - first_col, width,
            BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES,
        )  # fmt: skip
        acc *= tl.load(a_scale_inv_ptr + group) * tl.load(b_scale_inv_ptr + group)
        out_tile_ptr = out_ptr + (group.to(tl.int64) * M + first_row) * N + first_col
        _store_tile(out_tile_ptr, N, M - first_row, N - first_col, acc, BLOCK_M, BLOCK_N)

    _launch_rows_gemm = FastLaunch(_grouped_rows_gemm_kernel)
    _launch_reduction_gemm = FastLaunch(_grouped_reduction_gemm_kernel)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def grouped_rows_gemm(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    row_offsets: torch.Tensor,
    out_dtype: torch.dtype,
    fast_accum: bool = False,
) -> torch.Tensor:
    """c (T, N) out_dtype = per group g, (a[o_g:o_{g+1}] * a_scale_inv[g]) @ (b[g] *
    b_scale_inv[g]).T, for a (T, R) fp8, b (G, N, R) fp8, scale_invs (G,) fp32, row_offsets
    int32 (G + 1,). One launch on CUDA; the torch reference elsewhere. fast_accum allows the
    FP8 tensor cores' accumulator throughout (as torch._scaled_mm's use_fast_accum; the TMA
    kernel takes it, the pointer kernels always promote)."""
    _check_rows(a, a_scale_inv, b, b_scale_inv, row_offsets, out_dtype)
    if not (a.is_cuda and triton_available()):
        return grouped_rows_gemm_reference(a, a_scale_inv, b, b_scale_inv, row_offsets, out_dtype)
    tokens, reduced = a.shape
    features = b.shape[1]
    if tokens == 0 or features == 0 or reduced == 0:
        return torch.zeros(tokens, features, dtype=out_dtype, device=a.device)
    a, b = a.contiguous(), b.contiguous()
    if rows_gemm_takes_tma(a, b):
        return rows_gemm_tma(
            a, a_scale_inv, b, b_scale_inv, row_offsets, out_dtype, ROWS_TMA_CONFIG,
            _group_block(b.shape[0]), fast_accum,
        )  # fmt: skip
    config = ROWS_CONFIG_SMALL if tokens <= SMALL_ROWS else ROWS_CONFIG
    return _rows_gemm(a, a_scale_inv, b, b_scale_inv, row_offsets, out_dtype, config)


def grouped_reduction_gemm(
    a_cols: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b_cols: torch.Tensor,
    b_scale_inv: torch.Tensor,
    col_offsets: torch.Tensor,
    m: int,
    n: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """out (G, m, n) out_dtype = per group g, (A_g * a_scale_inv[g]) @ (B_g * b_scale_inv[g]).T,
    A_g the (m, w_g) block of the flat fp8 a_cols at element m * c_g, B_g the (n, w_g) block of
    b_cols at n * c_g, col_offsets int32 (G + 1,), scale_invs (G,) fp32; zeros where w_g = 0.
    One launch on CUDA; the torch reference elsewhere."""
    _check_reduction(a_cols, a_scale_inv, b_cols, b_scale_inv, col_offsets, m, n, out_dtype)
    if not (a_cols.is_cuda and triton_available()):
        return grouped_reduction_gemm_reference(
            a_cols, a_scale_inv, b_cols, b_scale_inv, col_offsets, m, n, out_dtype
        )
    groups = col_offsets.numel() - 1
    if groups == 0 or m == 0 or n == 0:
        return torch.zeros(groups, m, n, dtype=out_dtype, device=a_cols.device)
    a_cols, b_cols = a_cols.contiguous(), b_cols.contiguous()
    operands = (a_cols, a_scale_inv, b_cols, b_scale_inv, col_offsets, m, n, out_dtype)
    if _tma_fits(a_cols, b_cols):  # row strides w_g: multiples of 16 always
        return reduction_gemm_tma(*operands, REDUCTION_TMA_CONFIG)
    return _reduction_gemm(*operands, REDUCTION_CONFIG)


def rows_gemm_takes_tma(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether grouped_rows_gemm runs the TMA kernel on these operands (a (T, R) and b, the
    (G, N, R) weights in any contiguous shape, FP8 on a GPU with TMA, more than SMALL_ROWS
    tokens, R a multiple of 16, aligned bases)."""
    if not (a.is_cuda and triton_available()) or a.shape[0] <= SMALL_ROWS or a.shape[1] % 16:
        return False
    return a.is_contiguous() and b.is_contiguous() and _tma_fits(a, b)


def _tma_fits(*operands: torch.Tensor) -> bool:
    """Whether the TMA kernels can read these FP8 operands: a GPU with TMA, 16-byte aligned
    bases (their row strides the callers check)."""
    if not tma_available(operands[0].device.index):
        return False
    return all(t.data_ptr() % 16 == 0 for t in operands)


def _rows_gemm(a, a_scale_inv, b, b_scale_inv, row_offsets, out_dtype, config) -> torch.Tensor:
    """Launch _grouped_rows_gemm_kernel with config (BLOCK_M, BLOCK_N, BLOCK_K, num_warps,
    num_stages) on a (T, R), b (G, N, R) (copied if not contiguous), T, N, R, G > 0. Returns
    c (T, N)."""
    a, b = a.contiguous(), b.contiguous()
    tokens, reduced = a.shape
    groups, features = b.shape[0], b.shape[1]
    block_m, block_n, block_k, num_warps, num_stages = config
    # Any split of T rows into G groups has at most cdiv(T, BLOCK_M) + G row tiles.
    grid = ((features + block_n - 1) // block_n, (tokens + block_m - 1) // block_m + groups, 1)
    if grid[1] > 65535:  # CUDA's limit on a grid's second dimension
        raise ValueError(f"{tokens} tokens need {grid[1]} row tiles, more than 65535")
    c = torch.empty(tokens, features, dtype=out_dtype, device=a.device)
    g_block = _group_block(groups)
    pointers = (a, a_scale_inv, b, b_scale_inv, c, row_offsets)
    key = (a.dtype, b.dtype, out_dtype, config, g_block)
    key += (*int_key(features), *int_key(reduced), *int_key(groups), *ptr_key(*pointers))
    _launch_rows_gemm(
        key, grid, num_warps, *pointers, features, reduced, groups,
        block_m, block_n, block_k, num_stages, g_block,
    )  # fmt: skip
    return c


def _reduction_gemm(
    a_cols, a_scale_inv, b_cols, b_scale_inv, col_offsets, m, n, out_dtype, config
) -> torch.Tensor:
    """Launch _grouped_reduction_gemm_kernel with config (BLOCK_M, BLOCK_N, BLOCK_K, num_warps,
    num_stages), G, m, n > 0. Returns out (G, m, n)."""
    a_cols, b_cols = a_cols.contiguous(), b_cols.contiguous()
    groups = col_offsets.numel() - 1
    block_m, block_n, block_k, num_warps, num_stages = config
    out = torch.empty(groups, m, n, dtype=out_dtype, device=a_cols.device)
    grid = (((m + block_m - 1) // block_m) * ((n + block_n - 1) // block_n), groups, 1)
    pointers = (a_cols, a_scale_inv, b_cols, b_scale_inv, out, col_offsets)
    key = (a_cols.dtype, b_cols.dtype, out_dtype, config, *int_key(m), *int_key(n))
    key += ptr_key(*pointers)
    _launch_reduction_gemm(
        key, grid, num_warps, *pointers, m, n, block_m, block_n, block_k, num_stages
    )
    return out


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------


def _check_fp8(name: str, tensor: torch.Tensor, dims: int) -> None:
    """TypeError unless tensor is FP8; ValueError unless it has `dims` dimensions."""
    if tensor.dtype not in FP8_MAX:
        known = ", ".join(str(d) for d in FP8_MAX)
        raise TypeError(f"{name} must be one of {known}, got {tensor.dtype}")
    if tensor.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(tensor.shape)}")


def _check_groups(device, groups: int, out_dtype, **per_group: torch.Tensor) -> None:
    """ValueError unless the offsets are int32 (G + 1,) and the scale_invs fp32 (G,), all on
    device; TypeError unless out_dtype is bf16, fp16 or fp32."""
    for name, tensor in per_group.items():
        offsets = name.endswith("offsets")
        dtype, size = (torch.int32, groups + 1) if offsets else (torch.float32, groups)
        if tensor.dtype != dtype or tuple(tensor.shape) != (size,):
            raise ValueError(
                f"{name} must be {dtype} of shape ({size},), got {tensor.dtype} of shape "
                f"{tuple(tensor.shape)}"
            )
        if tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device} but the operands are on {device}")
    if out_dtype not in OUT_DTYPES:
        known = ", ".join(str(d) for d in OUT_DTYPES)
        raise TypeError(f"out_dtype must be one of {known}, got {out_dtype}")


def _check_rows(a, a_scale_inv, b, b_scale_inv, row_offsets, out_dtype) -> None:
    """The argument rules of grouped_rows_gemm (see _check_fp8 and _check_groups)."""
    _check_fp8("a", a, 2)
    _check_fp8("b", b, 3)
    if b.shape[2] != a.shape[1]:
        raise ValueError(
            f"b (G, N, R) must have a's R = {a.shape[1]} as its last dimension, got shape "
            f"{tuple(b.shape)}"
        )
    if b.device != a.device:
        raise ValueError(f"b is on {b.device} but a is on {a.device}")
    if b.shape[0] == 0 and a.shape[0] > 0:
        raise ValueError(f"b has no groups, so a must have no rows, got {a.shape[0]}")
    _check_groups(
        a.device, b.shape[0], out_dtype,
        a_scale_inv=a_scale_inv, b_scale_inv=b_scale_inv, row_offsets=row_offsets,
    )  # fmt: skip


def _check_reduction(a_cols, a_scale_inv, b_cols, b_scale_inv, col_offsets, m, n, out_dtype):
    """The argument rules of grouped_reduction_gemm (see _check_fp8 and _check_groups)."""
    _check_fp8("a_cols", a_cols, 1)
    _check_fp8("b_cols", b_cols, 1)
    if b_cols.device != a_cols.device:
        raise ValueError(f"b_cols is on {b_cols.device} but a_cols is on {a_cols.device}")
    if m < 0 or n < 0:
        raise ValueError(f"m and n must be non-negative, got m = {m}, n = {n}")
    if col_offsets.dim() != 1 or col_offsets.numel() == 0:
        raise ValueError(f"col_offsets must be 1-D (G + 1,), got shape {tuple(col_offsets.shape)}")
    _check_groups(
        a_cols.device, col_offsets.numel() - 1, out_dtype,
        a_scale_inv=a_scale_inv, b_scale_inv=b_scale_inv, col_offsets=col_offsets,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Torch references: each group dequantized to fp32 and multiplied in fp32
# ----------------------------------------------------------------------------------------------


def grouped_rows_gemm_reference(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    row_offsets: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Torch reference of grouped_rows_gemm (reads row_offsets on the host, and checks them)."""
    _check_rows(a, a_scale_inv, b, b_scale_inv, row_offsets, out_dtype)
    c = torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    for g, (start, end) in enumerate(_host_ranges(row_offsets, a.shape[0])):
        c[start:end] = _dequantized_mm(a[start:end], a_scale_inv[g], b[g], b_scale_inv[g])
    return c


def grouped_reduction_gemm_reference(
    a_cols: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b_cols: torch.Tensor,
    b_scale_inv: torch.Tensor,
    col_offsets: torch.Tensor,
    m: int,
    n: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Torch reference of grouped_reduction_gemm (reads col_offsets on the host, and checks
    them: multiples of 16, within both flat operands)."""
    _check_reduction(a_cols, a_scale_inv, b_cols, b_scale_inv, col_offsets, m, n, out_dtype)
    ranges = _host_ranges(col_offsets, None)
    columns = ranges[-1][1] if ranges else 0
    if any(start % 16 for start, _ in ranges) or columns % 16:
        raise ValueError(f"col_offsets must be multiples of 16, got {col_offsets.tolist()}")
    for name, flat, rows in (("a_cols", a_cols, m), ("b_cols", b_cols, n)):
        if flat.numel() < rows * columns:
            raise ValueError(
                f"{name} has {flat.numel()} elements, fewer than {rows} * col_offsets[G] = "
                f"{rows * columns}"
            )
    out = torch.zeros(len(ranges), m, n, dtype=out_dtype, device=a_cols.device)
    for g, (start, end) in enumerate(ranges):
        a_g = a_cols[m * start : m * end].view(m, end - start)
        b_g = b_cols[n * start : n * end].view(n, end - start)
        out[g] = _dequantized_mm(a_g, a_scale_inv[g], b_g, b_scale_inv[g])
    return out


def _host_ranges(offsets: torch.Tensor, last: int | None) -> list[tuple[int, int]]:
    """The (start, end) of each group, read from offsets (G + 1,) on the host; ValueError
    unless they start at 0, never decrease and (when `last` is given) end at last."""
    values = offsets.tolist()
    ranges = list(itertools.pairwise(values))
    if values[0] != 0 or any(start > end for start, end in ranges):
        raise ValueError(f"offsets must start at 0 and never decrease, got {values}")
    if last is not None and values[-1] != last:
        raise ValueError(f"offsets must end at the token count {last}, got {values}")
    return ranges


def _dequantized_mm(a_fp8, a_scale_inv, b_fp8, b_scale_inv) -> torch.Tensor:
    """fp32 (a_fp8 * a_scale_inv) @ (b_fp8 * b_scale_inv).T for FP8 a (M, K), b (N, K), as the
    kernel (and gemm.fp8_gemm's CPU path) computes it: the product of the FP8 values, then
    times both scales at once."""
    with torch.autocast(a_fp8.device.type, enabled=False):
        return torch.mm(a_fp8.float(), b_fp8.float().t()) * (a_scale_inv * b_scale_inv)
