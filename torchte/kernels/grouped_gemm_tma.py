"""The grouped FP8 GEMMs of grouped_gemm_fp8.py as persistent kernels with TMA loads, for GPUs
that have the tensor memory accelerator (compute capability 9.0 and newer: Hopper, Blackwell).

Same functions, operands, legend and numerics as grouped_gemm_fp8.py (fp32 accumulation
promoted every BLOCK_K products, both scales applied once at the end; the rows GEMM may instead
accumulate in the tensor cores' own precision throughout, fast_accum, as te.Linear's forward
GEMM does); only the way tiles are scheduled, loaded and stored differs:

- Persistent: one program per streaming multiprocessor, each walking the tiles tile_id =
  pid, pid + NUM_SMS, ... of the call. The tile count is computed on the device from the
  offsets (no host sync): rows GEMM sum_g cdiv(m_g, BLOCK_M) row tiles x cdiv(N, BLOCK_N);
  reduction GEMM G x cdiv(m, BLOCK_M) x cdiv(n, BLOCK_N). No program of a worst-case grid
  idles. (Triton's loop flattening, which would overlap a tile's epilogue with the next one's
  loads, measured 2.5x slower for 128x256 tiles on an H200: not used.)
- Row tiles in bands of GROUP_M: consecutive tiles walk down GROUP_M row tiles before moving to
  the next column tile, so a band's weight tiles are read from L2, not HBM, by the SMs that
  share them (row tiles are numbered group by group, as in grouped_cast's _tile_group).
- Loads through TMA descriptors made on the device (tl.make_tensor_descriptor; they live in
  Triton's global scratch, which scratch_allocator provides from torch's caching allocator, so
  a CUDA graph captures it like any temporary). Rows GEMM: one descriptor over all of a (T, R)
  and one over b as (G * N, R). A tile whose rows run past its group's end loads the next
  group's rows (or TMA's zeros past T): the products of those rows are never stored. Columns
  past R read as zeros. Reduction GEMM: group g's blocks have their own row stride w_g, so each
  tile makes the two descriptors of its group (shape (m, w_g) and (n, w_g)); TMA's zero fill
  past w_g replaces the masks.
- Stores (TMA store): a rows-GEMM tile wholly inside its group's rows leaves through a TMA
  descriptor over c (16-bit outputs; an fp32 tile's staging does not fit in shared memory
  beside the operand stages), the last, partial tile of a group by a masked store; the
  reduction GEMM's tiles through one over out as (G * m, n) when m is a multiple of BLOCK_M.
  Masked stores otherwise, as in grouped_gemm_fp8.py.

TMA needs 16-byte aligned bases and row strides: R a multiple of 16 (rows GEMM), c_g and w_g
multiples of 16 (the reduction GEMM's columnwise layout, always). grouped_gemm_fp8._tma_fits
says whether a call qualifies; grouped_gemm_fp8 falls back to its pointer kernels otherwise.
"""

from __future__ import annotations

import functools

import torch

from ._triton import FastLaunch, int_key, ptr_key, sm_count, tl, triton

__all__ = ["reduction_gemm_tma", "rows_gemm_tma", "scratch_allocator", "tma_available"]


@functools.cache
def tma_available(device_index: int) -> bool:
    """Whether the device has TMA (compute capability 9.0 or newer) and Triton can make
    descriptors on the device (checked once per device)."""
    if triton is None or not hasattr(tl, "make_tensor_descriptor"):
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def scratch_allocator(size: int, alignment: int, stream) -> torch.Tensor:
    """Triton's global scratch (where device-made TMA descriptors live) from torch's caching
    allocator on the current device: freed when the launch returns, reused in stream order."""
    del alignment, stream  # torch's blocks are 512-byte aligned, on the current stream
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _programs(device: torch.device) -> int:
    """The persistent grid: one program per SM (4 under Triton's CPU interpreter)."""
    if device.type != "cuda":
        return 4
    return sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _use_scratch_allocator() -> None:
    """Make scratch_allocator Triton's allocator in this thread's context unless one is set
    (autograd's backward runs in its own thread, with its own context)."""
    current = triton.runtime._allocation._allocator.get()
    if isinstance(current, triton.runtime._allocation.NullAllocator):
        triton.set_allocator(scratch_allocator)


if triton is not None:
    from .grouped_cast import _tile_group

    @triton.jit
    def _banded_tile(tile_id, tiles_m, tiles_n, GROUP_M: tl.constexpr):
        """(row tile, column tile) of tile_id: bands of GROUP_M row tiles, each walked down
        its rows first, column by column."""
        per_band = GROUP_M * tiles_n
        band_first = (tile_id // per_band) * GROUP_M
        band_rows = tl.minimum(tiles_m - band_first, GROUP_M)
        within = tile_id % per_band
        return band_first + within % band_rows, within // band_rows

    @triton.jit
    def _tma_product(a_desc, a_row, b_desc, b_row, k_tiles, BLOCK_M, BLOCK_N, BLOCK_K, FAST_ACCUM):
        """fp32 (BLOCK_M, BLOCK_N) = A @ B.T over k_tiles * BLOCK_K columns, A the tile of
        a_desc at row a_row, B that of b_desc at b_row."""
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k in range(k_tiles):
            a = a_desc.load([a_row, k * BLOCK_K])
            b = b_desc.load([b_row, k * BLOCK_K])
            if FAST_ACCUM:  # the tensor cores' own accumulator throughout
                acc = tl.dot(a, tl.trans(b), acc)
            else:  # promoted to fp32 once per BLOCK_K products
                acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BLOCK_K)
        return acc

    @triton.jit
    def _masked_store(out_ptr, stride, rows_left, cols_left, acc, BLOCK_M, BLOCK_N):
        """acc (fp32) stored at the row-major out_ptr in out's dtype, rows < rows_left and
        columns < cols_left."""
        rows = tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        mask = (rows < rows_left)[:, None] & (cols < cols_left)[None, :]
        ptrs = out_ptr + rows[:, None].to(tl.int64) * stride + cols[None, :]
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rows_gemm_tma_kernel(
        a_ptr, a_scale_inv_ptr, b_ptr, b_scale_inv_ptr, c_ptr, row_offsets_ptr,
        T, N, R, G,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, G_BLOCK: tl.constexpr,
        TMA_STORE: tl.constexpr, FAST_ACCUM: tl.constexpr,
    ):  # fmt: skip
        a_desc = tl.make_tensor_descriptor(a_ptr, [T, R], [R, 1], [BLOCK_M, BLOCK_K])
        b_desc = tl.make_tensor_descriptor(b_ptr, [G * N, R], [R, 1], [BLOCK_N, BLOCK_K])
        if TMA_STORE:
            c_desc = tl.make_tensor_descriptor(c_ptr, [T, N], [N, 1], [BLOCK_M, BLOCK_N])
        groups = tl.arange(0, G_BLOCK)
        starts = tl.load(row_offsets_ptr + groups, mask=groups < G, other=0)
        ends = tl.load(row_offsets_ptr + groups + 1, mask=groups < G, other=0)
        tiles_m = tl.sum((ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
        tiles_n = tl.cdiv(N, BLOCK_N)
        k_tiles = tl.cdiv(R, BLOCK_K)
        for tile_id in tl.range(tl.program_id(0), tiles_m * tiles_n, NUM_SMS):
            pid_m, pid_n = _banded_tile(tile_id, tiles_m, tiles_n, GROUP_M)
            group, tile = _tile_group(row_offsets_ptr, G, pid_m, BLOCK_M, G_BLOCK)
            first_row = tl.load(row_offsets_ptr + group) + tile * BLOCK_M
            rows_left = tl.load(row_offsets_ptr + group + 1) - first_row
            first_col = pid_n * BLOCK_N
            acc = _tma_product(
                a_desc, first_row, b_desc, group * N + first_col, k_tiles,
                BLOCK_M, BLOCK_N, BLOCK_K, FAST_ACCUM,
            )  # fmt: skip
            acc *= tl.load(a_scale_inv_ptr + group) * tl.load(b_scale_inv_ptr + group)
            if TMA_STORE and rows_left >= BLOCK_M:  # a whole tile of the group's rows
                c_desc.store([first_row, first_col], acc.to(c_ptr.dtype.element_ty))
            else:  # TMA would store the rows past the group's end too
                c_tile = c_ptr + first_row.to(tl.int64) * N + first_col
                _masked_store(c_tile, N, rows_left, N - first_col, acc, BLOCK_M, BLOCK_N)

    @triton.jit
    def _reduction_gemm_tma_kernel(
        a_ptr, a_scale_inv_ptr, b_ptr, b_scale_inv_ptr, out_ptr, col_offsets_ptr,
        M, N, G,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, TMA_STORE: tl.constexpr,
    ):  # fmt: skip
        if TMA_STORE:  # M a multiple of BLOCK_M: no tile runs into the next group's rows
            out_desc = tl.make_tensor_descriptor(out_ptr, [G * M, N], [N, 1], [BLOCK_M, BLOCK_N])
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        per_group = tiles_m * tiles_n
        for tile_id in tl.range(tl.program_id(0), G * per_group, NUM_SMS):
            group = tile_id // per_group
            pid_m, pid_n = _banded_tile(tile_id % per_group, tiles_m, tiles_n, GROUP_M)
            first_row = pid_m * BLOCK_M
            first_col = pid_n * BLOCK_N
            col_start = tl.load(col_offsets_ptr + group)
            width = tl.load(col_offsets_ptr + group + 1) - col_start
            # An empty group runs no k step (its zeros are stored); its descriptors, never
            # read, get a valid row stride.
            stride = tl.maximum(width, 16)
            a_base = a_ptr + col_start.to(tl.int64) * M
            b_base = b_ptr + col_start.to(tl.int64) * N
            a_desc = tl.make_tensor_descriptor(a_base, [M, width], [stride, 1], [BLOCK_M, BLOCK_K])
            b_desc = tl.make_tensor_descriptor(b_base, [N, width], [stride, 1], [BLOCK_N, BLOCK_K])
            k_tiles = tl.cdiv(width, BLOCK_K)
            acc = _tma_product(
                a_desc, first_row, b_desc, first_col, k_tiles, BLOCK_M, BLOCK_N, BLOCK_K, False
            )
            acc *= tl.load(a_scale_inv_ptr + group) * tl.load(b_scale_inv_ptr + group)
            if TMA_STORE:
                out_desc.store([group * M + first_row, first_col], acc.to(out_ptr.dtype.element_ty))
            else:
                out_tile = out_ptr + (group.to(tl.int64) * M + first_row) * N + first_col
                _masked_store(out_tile, N, M - first_row, N - first_col, acc, BLOCK_M, BLOCK_N)

    _launch_rows = FastLaunch(_rows_gemm_tma_kernel)
    _launch_reduction = FastLaunch(_reduction_gemm_tma_kernel)


def rows_gemm_tma(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    row_offsets: torch.Tensor,
    out_dtype: torch.dtype,
    config: tuple,
    g_block: int,
    fast_accum: bool = False,
) -> torch.Tensor:
    """grouped_gemm_fp8.grouped_rows_gemm's kernel with TMA loads: a (T, R) and b (G, N, R)
    contiguous FP8, R a multiple of 16, T, N, R, G > 0. config (BLOCK_M, BLOCK_N, BLOCK_K,
    num_warps, num_stages, GROUP_M, TMA store); fast_accum: the FP8 tensor cores' accumulator
    throughout (te.Linear's forward GEMM), else promoted to fp32 every BLOCK_K products.
    Returns c (T, N) out_dtype."""
    tokens, reduced = a.shape
    groups, features = b.shape[0], b.shape[1]
    block_m, block_n, block_k, num_warps, num_stages, group_m, tma_store = config
    num_sms = _programs(a.device)
    c = torch.empty(tokens, features, dtype=out_dtype, device=a.device)
    # TMA's row stride rule; an fp32 tile's staging does not fit beside the operands' stages
    tma_store = tma_store and features * c.element_size() % 16 == 0 and c.element_size() <= 2
    config = (*config[:-1], tma_store)
    pointers = (a, a_scale_inv, b, b_scale_inv, c, row_offsets)
    key = (a.dtype, b.dtype, out_dtype, config, g_block, fast_accum, *ptr_key(*pointers))
    key += (*int_key(tokens), *int_key(features), *int_key(reduced), *int_key(groups))
    _use_scratch_allocator()
    _launch_rows(
        key, (num_sms, 1, 1), num_warps, *pointers, tokens, features, reduced, groups,
        block_m, block_n, block_k, group_m, num_sms, g_block, tma_store, fast_accum,
        num_stages=num_stages,
    )  # fmt: skip
    return c


def reduction_gemm_tma(
    a_cols: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b_cols: torch.Tensor,
    b_scale_inv: torch.Tensor,
    col_offsets: torch.Tensor,
    m: int,
    n: int,
    out_dtype: torch.dtype,
    config: tuple,
) -> torch.Tensor:
    """grouped_gemm_fp8.grouped_reduction_gemm's kernel with TMA loads (flat contiguous FP8
    operands, G, m, n > 0); config (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages,
    GROUP_M). Returns out (G, m, n) out_dtype."""
    groups = col_offsets.numel() - 1
    block_m, block_n, block_k, num_warps, num_stages, group_m, tma_store = config
    num_sms = _programs(a_cols.device)
    out = torch.empty(groups, m, n, dtype=out_dtype, device=a_cols.device)
    # TMA's row stride rule; whole tiles within each group's rows
    tma_store = tma_store and n * out.element_size() % 16 == 0 and m % block_m == 0
    config = (*config[:-1], tma_store)
    pointers = (a_cols, a_scale_inv, b_cols, b_scale_inv, out, col_offsets)
    key = (a_cols.dtype, b_cols.dtype, out_dtype, config, *ptr_key(*pointers))
    key += (*int_key(m), *int_key(n), *int_key(groups))
    _use_scratch_allocator()
    _launch_reduction(
        key, (num_sms, 1, 1), num_warps, *pointers, m, n, groups,
        block_m, block_n, block_k, group_m, num_sms, tma_store, num_stages=num_stages,
    )  # fmt: skip
    return out
