"""FP8 cast + transpose + amax: one pass over a high-precision matrix.

Shapes: x (M, N) high precision (fp32/bf16/fp16), contiguous. Outputs: rowwise data (M, N) and
columnwise data (N, Mp) in an FP8 dtype, where Mp = M rounded up to a multiple of 16 and the
padding columns are zero (_fp8_codec's layout), and scale_inv (1,) fp32 on x's device. How the
output is written (FP8 dtype, usages, delayed or current scaling) comes in a CastSpec.

On CUDA with Triton the kernels below run; elsewhere the torch reference beside them, which
gives the same bytes. The FP8 bytes and the amax (as int32 bit patterns, so a NaN reaches it)
come from _fp8_codec's encoder.

Launches per call: quantize under delayed scaling 1 (cast + transpose + amax + scale_inv);
under current scaling 1 when x is small (small_tile: at most 64K elements; one program finds
the amax, makes the scale, then casts every tile), else 3 (zeroing the amax buffer, amax,
cast); record_amax 1. The single-program path takes the amax in registers, with no atomic and
no zeroed buffer.
"""

from __future__ import annotations

import torch

from ._compile import compiled_as_op
from ._fp8_codec import (
    CAST_CONFIG,
    COLUMNWISE_ALIGN,
    FP8_MAX,
    alloc_outputs,
    cast_reference,
    compute_scale_reference,
    current_scale_inv_reference,
    encode_reference,
    fp8_transpose,
    record_amax_reference,
)
from ._triton import FastLaunch, tl, triton, triton_available
from .cast_spec import CastSpec

# COLUMNWISE_ALIGN, FP8_MAX, CAST_CONFIG, fp8_transpose and the reference helpers live in
# _fp8_codec (shared by every FP8-writing kernel) and are importable from here as well.
__all__ = [
    "AMAX_CONFIG",
    "CAST_CONFIG",
    "COLUMNWISE_ALIGN",
    "FP8_MAX",
    "cast_reference",
    "compute_scale_reference",
    "current_scale_inv_reference",
    "fp8_transpose",
    "quantize",
    "quantize_reference",
    "record_amax",
    "record_amax_reference",
    "small_tile",
]

# The amax block (BLOCK, num_warps). Measured on an H200 (benchmarks/quantize.py sweep,
# 8192 x 8192 bf16); the cast tile is _fp8_codec's CAST_CONFIG.
AMAX_CONFIG = (16384, 8)

# Current scaling of a small x runs as one program (see small_tile): tiles of SMALL_TILE elements,
# at most SMALL_MAX_TILES of them, so at most 64K elements (128 KiB of bf16) take that path.
# Chosen by the estimate in small_tile, not yet tuned on a GPU.
SMALL_TILE = 4096
SMALL_MAX_TILES = 16
SMALL_NUM_WARPS = 4

if triton is not None:
    from ._fp8_codec import (
        _abs_bits,
        _cast_transpose_tile,
        _current_scale_inv,
        _scale_from_amax,
        _tensor_scale,
    )

    @triton.jit
    def _cast_transpose_kernel(
        x_ptr,  # (M, N) fp32 / bf16 / fp16, contiguous
        scale_ptr,  # (1,) fp32: the scale (delayed); unused when CURRENT
        amax_ptr,  # (1,) fp32: max-accumulated (delayed); read to make the scale (CURRENT)
        scale_inv_ptr,  # (1,) fp32: 1 / scale, written by program (0, 0)
        out_ptr,  # (M, N) fp8 rowwise data, written as uint8 bytes when ROWWISE
        out_t_ptr,  # (N, Mp) fp8 columnwise data, Mp = round_up(M, 16), written as int32 words
        M,
        N,
        amax_epsilon,  # fp32; used when CURRENT
        FP8_MAX: tl.constexpr,  # 448.0 (e4m3) or 57344.0 (e5m2)
        CURRENT: tl.constexpr,
        POWER_2: tl.constexpr,
        ROWWISE: tl.constexpr,
        COLUMNWISE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        first = (pid_m == 0) & (pid_n == 0)
        scale = _tensor_scale(
            scale_ptr, amax_ptr, scale_inv_ptr, first, amax_epsilon, FP8_MAX, CURRENT, POWER_2
        )
        bits = _cast_transpose_tile(
            x_ptr, out_ptr, out_t_ptr, M, N, pid_m, pid_n, scale,
            FP8_MAX, not CURRENT, ROWWISE, COLUMNWISE, BLOCK_M, BLOCK_N,
        )  # fmt: skip
        if not CURRENT:
            tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32)), bits, sem="relaxed")

    @triton.jit
    def _quantize_current_small_kernel(
        x_ptr,  # (M, N) fp32 / bf16 / fp16, contiguous
        scale_inv_ptr,  # (1,) fp32: 1 / scale
        out_ptr,  # (M, N) fp8 rowwise data, written as uint8 bytes when ROWWISE
        out_t_ptr,  # (N, Mp) fp8 columnwise data, Mp = round_up(M, 16), written as int32 words
        M,
        N,
        amax_epsilon,  # fp32
        FP8_MAX: tl.constexpr,  # 448.0 (e4m3) or 57344.0 (e5m2)
        POWER_2: tl.constexpr,
        ROWWISE: tl.constexpr,
        COLUMNWISE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """Current scaling in one program (grid (1, 1, 1)): amax over all of x, the scale, then
        every tile; no atomics and no zeroed amax buffer."""
        numel = M * N  # small by construction (see small_tile): no int32 overflow
        bits = tl.zeros((BLOCK_M * BLOCK_N,), tl.int32)
        for start in range(0, numel, BLOCK_M * BLOCK_N):
            offs = start + tl.arange(0, BLOCK_M * BLOCK_N)
            x = tl.load(x_ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
            bits = tl.maximum(bits, _abs_bits(x))
        amax = tl.max(bits).to(tl.float32, bitcast=True)
        scale = _scale_from_amax(amax, amax_epsilon, FP8_MAX, POWER_2)
        tl.store(scale_inv_ptr, _current_scale_inv(amax, scale))
        for pid_m in range(0, tl.cdiv(M, BLOCK_M)):
            for pid_n in range(0, tl.cdiv(N, BLOCK_N)):
                _cast_transpose_tile(
                    x_ptr, out_ptr, out_t_ptr, M, N, pid_m, pid_n, scale,
                    FP8_MAX, False, ROWWISE, COLUMNWISE, BLOCK_M, BLOCK_N,
                )  # fmt: skip

    @triton.jit
    def _amax_kernel(
        x_ptr,  # (numel,) fp32 / bf16 / fp16, contiguous
        amax_ptr,  # (1,) fp32, max-accumulated
        numel,
        BLOCK: tl.constexpr,
    ):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
        bits = tl.max(_abs_bits(x))
        tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32)), bits, sem="relaxed")


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


if triton is not None:
    _launch_cast_transpose = FastLaunch(_cast_transpose_kernel)
    _launch_quantize_current_small = FastLaunch(_quantize_current_small_kernel)
    _launch_amax_kernel = FastLaunch(_amax_kernel)


@compiled_as_op("(Tensor x, CastSpec spec) -> (Tensor, Tensor, Tensor)")
def quantize(
    x: torch.Tensor, spec: CastSpec
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Quantize x (M, N) as spec says: with spec.scale (1,) when given (delayed scaling; max |x|
    max-accumulated into spec.amax (1,) in place), else with the scale made from x's own amax
    (current scaling: spec.amax_epsilon, spec.power_2_scale; spec.amax not used). Returns
    (rowwise (M, N) | None, columnwise (N, Mp) | None, scale_inv (1,) fp32)."""
    scale = spec.scale
    if x.is_cuda and triton_available() and x.numel() > 0:
        fp8_dtype, rowwise, columnwise = spec.fp8_dtype, spec.rowwise, spec.columnwise
        if scale is not None:
            return _cast_transpose(
                x, scale, spec.amax, fp8_dtype, rowwise, columnwise, False, 0.0, False
            )
        current = (spec.amax_epsilon, spec.power_2_scale)
        tile = small_tile(*x.shape)
        if tile is not None:
            return _quantize_current_small(x, fp8_dtype, rowwise, columnwise, *current, tile)
        amax = torch.zeros(1, dtype=torch.float32, device=x.device)
        _launch_amax(x, amax)
        return _cast_transpose(x, amax, amax, fp8_dtype, rowwise, columnwise, True, *current)
    return encode_reference(x, spec)


@compiled_as_op("(Tensor x, Tensor(a!) amax) -> ()")
def record_amax(x: torch.Tensor, amax: torch.Tensor) -> None:
    """amax (1,) = max(amax, max |x|), in place (calibration: amax without quantizing)."""
    if x.is_cuda and triton_available():
        if x.numel() > 0:
            _launch_amax(x, amax)
        return
    record_amax_reference(x, amax)


def small_tile(rows: int, cols: int) -> tuple[int, int] | None:
    """(BLOCK_M, BLOCK_N) for quantizing x (rows, cols) in one program, or None when x is too
    large for one program: more than SMALL_MAX_TILES tiles of SMALL_TILE elements.

    One program walks its tiles one after another on one SM, each step about one memory round
    trip, so its GPU time grows with the tile count. At the bound (64K elements: 16 amax steps
    and 16 cast steps, an estimated 10-15 us) that is about the GPU time of the three launches
    it replaces and below the host time they cost (torch.zeros 10.7 us + a launch 7 us on the
    H200 host); larger inputs take the 3-launch path, which spreads the work over every SM. The
    tile is as wide as cols needs (16 to 256 columns; BLOCK_M = SMALL_TILE // BLOCK_N, a
    multiple of 16 so the row tiles cover the padding up to Mp), so short or narrow inputs do
    not spend their steps on masked lanes.
    """
    if rows * cols > SMALL_TILE * SMALL_MAX_TILES:
        return None
    block_n = min(max(1 << (cols - 1).bit_length(), 16), 256)
    block_m = SMALL_TILE // block_n
    if -(-rows // block_m) * -(-cols // block_n) > SMALL_MAX_TILES:
        return None
    return block_m, block_n


def _cast_transpose(
    x: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor,
    fp8_dtype: torch.dtype,
    rowwise: bool,
    columnwise: bool,
    current: bool,
    amax_epsilon: float,
    power_2_scale: bool,
    config: tuple[int, int, int] = CAST_CONFIG,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Launch _cast_transpose_kernel on x (M, N), M, N > 0. Delayed: scale is the scale and amax
    is max-accumulated; current (`current=True`): amax is read and the scale made from it.
    Returns (rowwise | None, columnwise | None, scale_inv (1,))."""
    if not x.is_contiguous():
        x = x.contiguous()
    rows, cols = x.shape
    block_m, block_n, num_warps = config
    scale_inv = torch.empty(1, dtype=torch.float32, device=x.device)
    data, data_t = alloc_outputs(rows, cols, fp8_dtype, x.device, rowwise, columnwise)
    # An output not asked for is never stored to: any pointer will do.
    out = scale_inv if data is None else data
    out_t = scale_inv if data_t is None else data_t
    grid = ((rows + block_m - 1) // block_m, (cols + block_n - 1) // block_n, 1)
    key = (
        x.dtype, fp8_dtype, rowwise, columnwise, current, power_2_scale, config,
        rows == 1, rows & 15, rows >> 31, cols == 1, cols & 15, cols >> 31,
        x.data_ptr() & 15, scale.data_ptr() & 15, amax.data_ptr() & 15,
        scale_inv.data_ptr() & 15, out.data_ptr() & 15, out_t.data_ptr() & 15,
    )  # fmt: skip
    _launch_cast_transpose(
        key, grid, num_warps, x, scale, amax, scale_inv, out, out_t, rows, cols,
        float(amax_epsilon), FP8_MAX[fp8_dtype], current, power_2_scale, rowwise, columnwise,
        block_m, block_n,
    )  # fmt: skip
    return data, data_t, scale_inv


def _quantize_current_small(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    rowwise: bool,
    columnwise: bool,
    amax_epsilon: float,
    power_2_scale: bool,
    tile: tuple[int, int],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Launch _quantize_current_small_kernel (one program) on x (M, N), M, N > 0; tile is
    small_tile(M, N). Returns (rowwise (M, N) | None, columnwise (N, Mp) | None, scale_inv
    (1,))."""
    if not x.is_contiguous():
        x = x.contiguous()
    rows, cols = x.shape
    scale_inv = torch.empty(1, dtype=torch.float32, device=x.device)
    data, data_t = alloc_outputs(rows, cols, fp8_dtype, x.device, rowwise, columnwise)
    out = scale_inv if data is None else data
    out_t = scale_inv if data_t is None else data_t
    key = (
        x.dtype, fp8_dtype, rowwise, columnwise, power_2_scale, tile,
        rows == 1, rows & 15, cols == 1, cols & 15,
        x.data_ptr() & 15, scale_inv.data_ptr() & 15, out.data_ptr() & 15, out_t.data_ptr() & 15,
    )  # fmt: skip
    _launch_quantize_current_small(
        key, (1, 1, 1), SMALL_NUM_WARPS, x, scale_inv, out, out_t, rows, cols,
        float(amax_epsilon), FP8_MAX[fp8_dtype], power_2_scale, rowwise, columnwise, *tile,
    )  # fmt: skip
    return data, data_t, scale_inv


def _launch_amax(
    x: torch.Tensor, amax: torch.Tensor, config: tuple[int, int] = AMAX_CONFIG
) -> None:
    """Launch _amax_kernel: amax (1,) = max(amax, max |x|) for a non-empty x."""
    if not x.is_contiguous():
        x = x.contiguous()
    numel = x.numel()
    block, num_warps = config
    key = (x.dtype, config, numel == 1, numel & 15, numel >> 31)
    key += (x.data_ptr() & 15, amax.data_ptr() & 15)
    _launch_amax_kernel(key, ((numel + block - 1) // block, 1, 1), num_warps, x, amax, numel, block)


# ----------------------------------------------------------------------------------------------
# Torch reference: the same function, used on CPU and in tests (_fp8_codec's cast)
# ----------------------------------------------------------------------------------------------


def quantize_reference(
    x: torch.Tensor, spec: CastSpec
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Torch reference of quantize."""
    return encode_reference(x, spec)
