"""An output gradient's FP8 cast with its bias gradient: one pass over dy for both.

Legend: dy (M, N) high precision (fp32 / bf16 / fp16), contiguous; dbias (N,) = dy's column
sums in dy's dtype, summed in fp32 over dy's values. FP8 data is laid out as in _fp8_codec:
rowwise (M, N) and columnwise (N, Mp), Mp = round_up(M, 16), the padding columns zero; scale_inv
(1,) fp32. How it is written comes in a CastSpec of one scale for the whole tensor: delayed
(spec.scale given, max |dy| max-accumulated into spec.amax) or current (the scale made from
dy's own amax).

The pair it replaces, cast_transpose.quantize(dy, spec) and dy.sum(0), reads dy twice; here the
cast's tiles also sum their columns. The bytes, amax and scale_inv are the cast's; dbias is
summed in fp32 and rounded once, where dy.sum(0) in bf16 also accumulates in fp32 (in another
order: an ulp of dy's dtype apart at most, in a few columns).

Grid: (column tiles, row blocks). A program walks its row block's tiles one after another and
keeps its columns' sums in registers. With one row block (few rows, or column tiles enough to
fill the GPU; column_sums.row_split) it writes dbias itself; with more, each row block writes
fp32 partial sums, which a second launch (column_sums.sum_partials) adds up in the row blocks'
order (deterministic) and rounds once to dbias.

Launches per call (non-empty dy): delayed scaling 1 (+1 with row blocks); current scaling,
when dy is small (cast_transpose.small_tile: at most 64K elements), 1: every program reads all
of dy for its amax first (from L2; no atomic, no zeroed buffer); else 3 (zeroing the amax, the
amax, the cast) (+1 with row blocks).

On CUDA with Triton the kernel runs; elsewhere (and for an empty dy) the torch reference below.
"""

from __future__ import annotations

import torch

from ._compile import compiled_as_op
from ._fp8_codec import CAST_CONFIG, FP8_MAX, alloc_outputs, check_fp8_dtype, encode_reference
from ._triton import FastLaunch, sm_count, tl, triton, triton_available
from .cast_spec import CastSpec
from .cast_transpose import _launch_amax, small_tile
from .column_sums import row_split, sum_partials

__all__ = ["quantize_dbias", "quantize_dbias_reference"]

# Scaling modes of the kernel (a constexpr).
DELAYED, CURRENT, CURRENT_INLINE = 0, 1, 2

if triton is not None:
    from ._fp8_codec import (
        _abs_bits,
        _current_scale_inv,
        _delayed_scale,
        _encode_slice,
        _round_as,
        _scale_from_amax,
        _store_words,
    )

    @triton.jit
    def _all_amax(x_ptr, numel, BLOCK: tl.constexpr):
        """max |x| over x (numel,) as fp32 (a NaN anywhere gives NaN), one program."""
        bits = tl.zeros((BLOCK,), tl.int32)
        for start in range(0, numel, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
            bits = tl.maximum(bits, _abs_bits(x))
        return tl.max(bits).to(tl.float32, bitcast=True)

    @triton.jit
    def _cast_dbias_kernel(
        x_ptr,  # (M, N) fp32 / bf16 / fp16, contiguous
        scale_ptr,  # (1,) fp32: the scale (DELAYED); unused otherwise
        amax_ptr,  # (1,) fp32: max-accumulated (DELAYED); read for the scale (CURRENT)
        scale_inv_ptr,  # (1,) fp32: 1 / scale, written by program (0, 0)
        out_ptr,  # (M, N) fp8 rowwise data, written as uint8 bytes when ROWWISE
        out_t_ptr,  # (N, Mp) fp8 columnwise data, written as int32 words when COLUMNWISE
        dbias_ptr,  # (N,) x's dtype: the column sums (one row block)
        partial_ptr,  # (row blocks, N) fp32: each row block's column sums (SPLIT)
        M,
        N,
        rows_per_program,  # a multiple of BLOCK_M
        amax_epsilon,  # fp32; current scaling
        FP8_MAX: tl.constexpr,  # 448.0 (e4m3) or 57344.0 (e5m2)
        SCALING: tl.constexpr,  # DELAYED, CURRENT or CURRENT_INLINE
        POWER_2: tl.constexpr,
        ROWWISE: tl.constexpr,
        COLUMNWISE: tl.constexpr,
        SPLIT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """Program (p, q): columns [p BLOCK_N, (p + 1) BLOCK_N) over rows [q rows_per_program,
        (q + 1) rows_per_program), cast tile by tile and summed."""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        first = (pid_n == 0) & (pid_m == 0)
        if SCALING == 0:
            scale = _delayed_scale(scale_ptr, scale_inv_ptr, first)
        else:
            if SCALING == 2:  # noqa: SIM108 (Triton: a constexpr branch, not an expression)
                amax = _all_amax(x_ptr, M * N, BLOCK_M * BLOCK_N)
            else:
                amax = tl.load(amax_ptr)
            scale = _scale_from_amax(amax, amax_epsilon, FP8_MAX, POWER_2)
            tl.store(scale_inv_ptr, _current_scale_inv(amax, scale), mask=first)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_in = cols < N
        bits = tl.zeros((BLOCK_M // 4, BLOCK_N), tl.int32)
        sums = tl.zeros((BLOCK_M // 4, BLOCK_N), tl.float32)
        # Steps of BLOCK_M rows (a multiple of 16): the last one also covers the padding to Mp.
        row0 = pid_m * rows_per_program
        for start in range(row0, tl.minimum(row0 + rows_per_program, M), BLOCK_M):
            group = start + 4 * tl.arange(0, BLOCK_M // 4)
            words = tl.zeros((BLOCK_M // 4, BLOCK_N), tl.int32)
            for k in tl.static_range(4):
                rows = group + k
                row_in = rows < M
                mask = row_in[:, None] & col_in[None, :]
                offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
                x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                sums += x
                bits, words = _encode_slice(
                    x, k, row_in, offs, mask, scale, bits, words, out_ptr, FP8_MAX,
                    SCALING == 0, ROWWISE, COLUMNWISE,
                )  # fmt: skip
            if COLUMNWISE:
                _store_words(out_t_ptr, words, cols, col_in, start // 4, M, BLOCK_M)
        if SPLIT:
            part = partial_ptr + pid_m.to(tl.int64) * N
            tl.store(part + cols, tl.sum(sums, 0), mask=col_in)
        else:
            # Rounded in fp32 first, so the cast is exact (the interpreter's cast truncates).
            dbias = _round_as(tl.sum(sums, 0), dbias_ptr).to(dbias_ptr.dtype.element_ty)
            tl.store(dbias_ptr + cols, dbias, mask=col_in)
        if SCALING == 0:
            tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32)), tl.max(bits), sem="relaxed")

    _launch_cast_dbias = FastLaunch(_cast_dbias_kernel)


@compiled_as_op("(Tensor dy, CastSpec spec) -> (Tensor, Tensor, Tensor, Tensor)")
def quantize_dbias(
    dy: torch.Tensor, spec: CastSpec
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """dy (M, N) quantized as spec says, and its column sums: (rowwise (M, N) | None,
    columnwise (N, Mp) | None, scale_inv (1,) fp32, dbias (N,) in dy's dtype). Delayed
    scaling (spec.scale given) max-accumulates max |dy| into spec.amax; current scaling makes
    the scale from dy's own amax. The bytes, amax and scale_inv are cast_transpose.quantize's."""
    check_fp8_dtype(spec.fp8_dtype)
    if dy.dim() != 2:
        raise ValueError(f"quantize_dbias: dy must be 2-D (M, N), got shape {tuple(dy.shape)}")
    if dy.is_cuda and triton_available() and dy.numel() > 0:
        return _cast_dbias_triton(dy if dy.is_contiguous() else dy.contiguous(), spec)
    return quantize_dbias_reference(dy, spec)


def _cast_dbias_triton(
    dy: torch.Tensor,
    spec: CastSpec,
    config: tuple[int, int, int] = CAST_CONFIG,
    sms: int | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Launch _cast_dbias_kernel on a contiguous, non-empty dy (M, N) (after the amax pass
    where current scaling needs one). sms: the SM count the row blocks are chosen for (the
    device's by default; the interpreter's tests pass one to get several row blocks)."""
    rows, cols = dy.shape
    block_m, block_n, num_warps = config
    fp8_dtype, rowwise, columnwise = spec.fp8_dtype, spec.rowwise, spec.columnwise
    scale_inv = torch.empty(1, dtype=torch.float32, device=dy.device)
    if spec.scale is not None:
        scaling, scale, amax = DELAYED, spec.scale, spec.amax
    elif small_tile(rows, cols) is not None:
        scaling, scale, amax = CURRENT_INLINE, scale_inv, scale_inv  # neither is read
    else:
        scaling = CURRENT
        amax = torch.zeros(1, dtype=torch.float32, device=dy.device)
        _launch_amax(dy, amax)
        scale = amax  # not read
    col_blocks = (cols + block_n - 1) // block_n
    if sms is None:  # current scaling: twice the programs (measured 10% faster on an H200)
        sms = sm_count(dy.device.index) * (1 if scaling == DELAYED else 2)
    rows_per, splits = row_split(rows, col_blocks, block_m, sms)
    data, data_t = alloc_outputs(rows, cols, fp8_dtype, dy.device, rowwise, columnwise)
    split = splits > 1
    if split:
        partial = dbias = torch.empty(splits, cols, dtype=torch.float32, device=dy.device)
    else:
        partial = dbias = torch.empty(cols, dtype=dy.dtype, device=dy.device)
    out = scale_inv if data is None else data  # never stored to when not asked for
    out_t = scale_inv if data_t is None else data_t
    eps, power_2 = float(spec.amax_epsilon), bool(spec.power_2_scale)
    key = (
        dy.dtype, fp8_dtype, scaling, power_2, rowwise, columnwise, split, config,
        rows == 1, rows & 15, rows >> 31, cols == 1, cols & 15, cols >> 31, rows_per & 15,
        dy.data_ptr() & 15, scale.data_ptr() & 15, amax.data_ptr() & 15,
        scale_inv.data_ptr() & 15, out.data_ptr() & 15, out_t.data_ptr() & 15,
        dbias.data_ptr() & 15,
    )  # fmt: skip
    _launch_cast_dbias(
        key, (col_blocks, splits, 1), num_warps, dy, scale, amax, scale_inv, out, out_t, dbias,
        partial, rows, cols, rows_per, eps, FP8_MAX[fp8_dtype], scaling, power_2, rowwise,
        columnwise, split, block_m, block_n,
    )  # fmt: skip
    if split:
        dbias = sum_partials(partial, dy.dtype)
    return data, data_t, scale_inv, dbias


def quantize_dbias_reference(
    dy: torch.Tensor, spec: CastSpec
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Torch reference of quantize_dbias: _fp8_codec's cast, and the column sums in fp32
    rounded to dy's dtype."""
    data, data_t, scale_inv = encode_reference(dy, spec)
    return data, data_t, scale_inv, dy.float().sum(0).to(dy.dtype)
