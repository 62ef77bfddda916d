"""FP8 cast + transpose + amax: one pass over a high-precision matrix.

Shapes: x (M, N) high precision (fp32/bf16/fp16), contiguous. Outputs: rowwise data (M, N) and
columnwise data (N, Mp) in an FP8 dtype, where Mp = M rounded up to a multiple of 16 and the
padding columns are zero (so a wgrad GEMM can take Mp as its inner dimension for any M).
Scalars are fp32 tensors of one element on x's device.

On CUDA with Triton the kernels below run; elsewhere the torch reference beside them, which
gives the same bytes.

Launches per call: quantize_delayed 1 (cast + transpose + amax + scale_inv); quantize_current 1
when x is small (small_tile: at most 64K elements; one program finds the amax, makes the scale,
then casts every tile), else 3 (zeroing the amax buffer, amax, cast); record_amax 1.

amax is max-accumulated as the int32 bit pattern of |x|: for non-negative floats the integer
order is the float order, and NaN (0x7FC00000 and up) sorts above inf, so a NaN in x reaches
amax as torch.maximum would carry it (a float atomic max drops NaN). The single-program path
takes the same maximum in registers, with no atomic and no zeroed buffer.

The FP8 bytes come from _fp8_code, which keeps an FP8-typed value only for the one conversion
instruction and bitcasts it at once to an integer byte: every store, transpose and repacking
moves uint8 bytes (rowwise) and int32 words of four bytes (columnwise). On an H200 with
Triton 3.6, kernels that carried tl.float8e4nv / tl.float8e5 values through a transpose or a
repacking stored wrong bytes (see triton-lang/triton#11111 for one such miscompile), while
integer code is safe. Under Triton's CPU interpreter, which mis-rounds FP8 conversions,
_fp8_code encodes in int32 arithmetic instead (the algorithm of torch's own conversion, c10's
fp8*_from_fp32_value); both give torch's bytes.
"""

from __future__ import annotations

import torch

from torchte._sizes import round_up

from ._compile import compiled_as_op
from ._triton import FastLaunch, triton_available

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
COLUMNWISE_ALIGN = 16

# Cast tile (BLOCK_M, BLOCK_N, num_warps) and amax block (BLOCK, num_warps); BLOCK_M must be a
# multiple of COLUMNWISE_ALIGN so the row tiles that cover M also cover the padding up to Mp.
# Measured on an H200 (benchmarks/quantize.py sweep, 8192 x 8192 bf16).
CAST_CONFIG = (32, 128, 4)
AMAX_CONFIG = (16384, 8)

# Current scaling of a small x runs as one program (see small_tile): tiles of SMALL_TILE elements,
# at most SMALL_MAX_TILES of them, so at most 64K elements (128 KiB of bf16) take that path.
# Chosen by the estimate in small_tile, not yet tuned on a GPU.
SMALL_TILE = 4096
SMALL_MAX_TILES = 16
SMALL_NUM_WARPS = 4

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference runs
    triton = None

if triton is not None:
    # FP8 bytes from the GPU's conversion instruction; under Triton's CPU interpreter, which
    # mis-rounds that conversion, from the integer encoder (both give torch's bytes).
    _HARDWARE_FP8 = tl.constexpr(not triton.knobs.runtime.interpret)

    @triton.jit
    def _scale_from_amax(amax, amax_epsilon, FP8_MAX: tl.constexpr, POWER_2: tl.constexpr):
        """compute_scale_reference on one fp32 scalar (amax >= 0 or NaN)."""
        # amax >= 0, so clamping it by an epsilon <= 0 changes nothing, as in the reference;
        # a NaN amax fails the comparison and stays NaN.
        amax = tl.where(amax < amax_epsilon, amax_epsilon, amax)
        scale = tl.math.div_rn(FP8_MAX, amax)
        # Special values by their bits: exponent all ones is inf or NaN.
        fp32_max = tl.full((), 0x7F7FFFFF, tl.int32).to(tl.float32, bitcast=True)
        scale_bits = scale.to(tl.int32, bitcast=True)
        scale = tl.where((scale_bits & 0x7FFFFFFF) == 0x7F800000, fp32_max, scale)
        amax_finite = (amax.to(tl.int32, bitcast=True) & 0x7F800000) != 0x7F800000
        scale = tl.where((amax == 0) | ~amax_finite, 1.0, scale)
        if POWER_2:
            scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
        return scale

    @triton.jit
    def _current_scale_inv(amax, scale):
        """scale_inv of a tensor quantized under current scaling: 1 / scale, or NaN when its
        amax is NaN or inf, so that what is computed from it is non-finite as the input was
        (current_scale_inv_reference)."""
        amax_finite = (amax.to(tl.int32, bitcast=True) & 0x7F800000) != 0x7F800000
        return tl.where(amax_finite, tl.math.div_rn(1.0, scale), float("nan"))

    @triton.jit
    def _abs_bits(x):
        """The int32 bit pattern of |x| for fp32 x (see the module docstring)."""
        return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF

    @triton.jit
    def _fp8_code(y, FP8_MAX: tl.constexpr):
        """The FP8 byte (0..255, in an int32) of fp32 y, |y| <= FP8_MAX or NaN: round to nearest
        even, NaN to 0x7F with y's sign; exactly torch's conversion (c10). On a GPU the
        hardware converts (one instruction); under the interpreter, integer steps."""
        bits = y.to(tl.int32, bitcast=True)
        mag = bits & 0x7FFFFFFF
        if _HARDWARE_FP8:
            if FP8_MAX == 448.0:
                code = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
            else:
                code = y.to(tl.float8e5).to(tl.uint8, bitcast=True).to(tl.int32)
            return tl.where(mag > 0x7F800000, 0x7F | ((bits >> 24) & 0x80), code)
        if FP8_MAX == 448.0:  # e4m3: bias 7, 3 mantissa bits, normal from 2**-6
            mant_odd = (mag >> 20) & 1
            normal = (mag - (120 << 23) + 0x7FFFF + mant_odd) >> 20
            # Below 2**-6: adding 2**14 leaves |y| rounded (by the fp32 add, to nearest even)
            # to a multiple of 2**-9, the smallest subnormal, in the low mantissa bits.
            sub = (mag.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True)
            code = tl.where(mag < (121 << 23), sub - (141 << 23), normal)
        else:  # e5m2: bias 15, 2 mantissa bits, normal from 2**-14; subnormals of 2**-16
            mant_odd = (mag >> 21) & 1
            normal = (mag - (112 << 23) + 0xFFFFF + mant_odd) >> 21
            sub = (mag.to(tl.float32, bitcast=True) + 128.0).to(tl.int32, bitcast=True)
            code = tl.where(mag < (113 << 23), sub - (134 << 23), normal)
        code = tl.where(mag > 0x7F800000, 0x7F, code)
        return code | ((bits >> 24) & 0x80)

    @triton.jit
    def _cast_transpose_tile(
        x_ptr,  # (M, N) fp32 / bf16 / fp16, contiguous
        out_ptr,  # (M, N) fp8 rowwise data, written as uint8 bytes when ROWWISE
        out_t_ptr,  # (N, Mp) fp8 columnwise data, Mp = round_up(M, 16), written as int32 words
        M,
        N,
        pid_m,
        pid_n,
        scale,  # fp32 scalar
        FP8_MAX: tl.constexpr,
        AMAX: tl.constexpr,
        ROWWISE: tl.constexpr,
        COLUMNWISE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """Cast + transpose tile (pid_m, pid_n) of x; returns the int32 bits of the tile's max |x|
        when AMAX (0 otherwise). The padding columns M..Mp of out_t get zero bytes."""
        # The tile is read as four (BLOCK_M // 4, BLOCK_N) slices, rows 4i + k for k = 0..3, so
        # the columnwise bytes of rows 4i..4i+3 pack into one int32 word (little endian) and the
        # transpose moves 32-bit words, never 8-bit values.
        group = pid_m * BLOCK_M + 4 * tl.arange(0, BLOCK_M // 4)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_in = cols < N
        bits = tl.zeros((BLOCK_M // 4, BLOCK_N), tl.int32)
        words = tl.zeros((BLOCK_M // 4, BLOCK_N), tl.int32)
        for k in tl.static_range(4):
            rows = group + k
            row_in = rows < M
            mask = row_in[:, None] & col_in[None, :]
            offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            if AMAX:
                bits = tl.maximum(bits, _abs_bits(x))
            if ROWWISE or COLUMNWISE:
                # Clamp with comparisons: NaN passes through, as in torch.clamp.
                y = x * scale
                y = tl.where(y > FP8_MAX, FP8_MAX, y)
                y = tl.where(y < -FP8_MAX, -FP8_MAX, y)
                # Rows past M are the columnwise padding: zero bytes whatever the scale.
                code = _fp8_code(tl.where(row_in[:, None], y, 0.0), FP8_MAX)
                if ROWWISE:
                    out_bytes_ptr = out_ptr.to(tl.pointer_type(tl.uint8))
                    tl.store(out_bytes_ptr + offs, code.to(tl.uint8), mask=mask)
                if COLUMNWISE:
                    words = words | (code << (8 * k))
        if COLUMNWISE:
            # out_t as int32 words: (N, Mp // 4); word w of row n holds rows 4w..4w+3.
            words_per_row = tl.multiple_of(tl.cdiv(M, 16) * 4, 4)
            word_cols = pid_m * (BLOCK_M // 4) + tl.arange(0, BLOCK_M // 4)
            offs_t = cols.to(tl.int64)[:, None] * words_per_row + word_cols[None, :]
            mask_t = col_in[:, None] & (word_cols < words_per_row)[None, :]
            out_words_ptr = out_t_ptr.to(tl.pointer_type(tl.int32))
            tl.store(out_words_ptr + offs_t, tl.trans(words), mask=mask_t)
        return tl.max(bits)

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
        if CURRENT:
            amax = tl.load(amax_ptr)
            scale = _scale_from_amax(amax, amax_epsilon, FP8_MAX, POWER_2)
            tl.store(scale_inv_ptr, _current_scale_inv(amax, scale), mask=first)
        else:
            scale = tl.load(scale_ptr)
            tl.store(scale_inv_ptr, tl.math.div_rn(1.0, scale), mask=first)
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


@compiled_as_op(
    "(Tensor x, Tensor scale, Tensor(a!) amax, Tensor(b!) scale_inv, ScalarType "
    "fp8_dtype, bool rowwise, bool columnwise) -> (Tensor, Tensor)"
)
def quantize_delayed(
    x: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor,
    scale_inv: torch.Tensor,
    fp8_dtype: torch.dtype,
    rowwise: bool,
    columnwise: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Quantize x (M, N) with a given scale (1,); max-accumulate |x| into amax (1,) in place;
    write 1/scale into scale_inv (1,). Returns (rowwise (M, N) | None, columnwise (N, Mp) | None).
    """
    if x.is_cuda and triton_available() and x.numel() > 0:
        return _cast_transpose(
            x, scale, amax, scale_inv, fp8_dtype, rowwise, columnwise, False, 0.0, False
        )
    return quantize_delayed_reference(x, scale, amax, scale_inv, fp8_dtype, rowwise, columnwise)


@compiled_as_op(
    "(Tensor x, Tensor(a!) scale_inv, ScalarType fp8_dtype, float amax_epsilon, bool "
    "power_2_scale, bool rowwise, bool columnwise) -> (Tensor, Tensor)"
)
def quantize_current(
    x: torch.Tensor,
    scale_inv: torch.Tensor,
    fp8_dtype: torch.dtype,
    amax_epsilon: float,
    power_2_scale: bool,
    rowwise: bool,
    columnwise: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Quantize x (M, N) with the scale computed from its own amax (current scaling); write
    1/scale into scale_inv (1,). Returns (rowwise (M, N) | None, columnwise (N, Mp) | None).
    """
    if x.is_cuda and triton_available() and x.numel() > 0:
        tile = small_tile(*x.shape)
        if tile is not None:
            current = (amax_epsilon, power_2_scale, rowwise, columnwise)
            return _quantize_current_small(x, scale_inv, fp8_dtype, *current, tile)
        amax = torch.zeros(1, dtype=torch.float32, device=x.device)
        _launch_amax(x, amax)
        current = (True, amax_epsilon, power_2_scale)
        return _cast_transpose(x, amax, amax, scale_inv, fp8_dtype, rowwise, columnwise, *current)
    return quantize_current_reference(
        x, scale_inv, fp8_dtype, amax_epsilon, power_2_scale, rowwise, columnwise
    )


@compiled_as_op("(Tensor x, Tensor(a!) amax) -> ()")
def record_amax(x: torch.Tensor, amax: torch.Tensor) -> None:
    """amax (1,) = max(amax, max |x|), in place (calibration: amax without quantizing)."""
    if x.is_cuda and triton_available():
        if x.numel() > 0:
            _launch_amax(x, amax)
        return
    record_amax_reference(x, amax)


def fp8_transpose(data: torch.Tensor) -> torch.Tensor:
    """Rowwise FP8 data (M, N) -> columnwise (N, Mp), zero-padded; an exact byte copy."""
    rows, cols = data.shape
    out = torch.zeros(
        (cols, round_up(rows, COLUMNWISE_ALIGN)), dtype=torch.uint8, device=data.device
    )
    out[:, :rows] = data.view(torch.uint8).t()
    return out.view(data.dtype)


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


def _alloc_outputs(
    rows: int, cols: int, fp8_dtype: torch.dtype, device, rowwise: bool, columnwise: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Uninitialized rowwise (rows, cols) and columnwise (cols, Mp) FP8 outputs, each None when
    not asked for.

    Two allocations, not views into one buffer: timed on CPU tensors, the two views cost more
    (as_strided: about 0.8 + 1.0 us; slice + view + view(dtype): 2.0 us each) than the
    torch.empty they would replace (1.0 us), and a shared buffer would keep the rowwise bytes
    alive after a caller drops them (te.Linear saves only the columnwise input for wgrad).
    Sizes go as separate ints: torch.empty(a, b) parses about 0.4 us faster than
    torch.empty((a, b)).
    """
    rows_p = (rows + COLUMNWISE_ALIGN - 1) // COLUMNWISE_ALIGN * COLUMNWISE_ALIGN
    data = torch.empty(rows, cols, dtype=fp8_dtype, device=device) if rowwise else None
    data_t = torch.empty(cols, rows_p, dtype=fp8_dtype, device=device) if columnwise else None
    return data, data_t


def _cast_transpose(
    x: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor,
    scale_inv: torch.Tensor,
    fp8_dtype: torch.dtype,
    rowwise: bool,
    columnwise: bool,
    current: bool,
    amax_epsilon: float,
    power_2_scale: bool,
    config: tuple[int, int, int] = CAST_CONFIG,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Launch _cast_transpose_kernel on x (M, N), M, N > 0. Delayed: scale is the scale and amax
    is max-accumulated; current (`current=True`): amax is read and the scale made from it."""
    if not x.is_contiguous():
        x = x.contiguous()
    rows, cols = x.shape
    block_m, block_n, num_warps = config
    data, data_t = _alloc_outputs(rows, cols, fp8_dtype, x.device, rowwise, columnwise)
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
    return data, data_t


def _quantize_current_small(
    x: torch.Tensor,
    scale_inv: torch.Tensor,
    fp8_dtype: torch.dtype,
    amax_epsilon: float,
    power_2_scale: bool,
    rowwise: bool,
    columnwise: bool,
    tile: tuple[int, int],
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Launch _quantize_current_small_kernel (one program) on x (M, N), M, N > 0; tile is
    small_tile(M, N). Writes scale_inv (1,); returns (rowwise (M, N), columnwise (N, Mp))."""
    if not x.is_contiguous():
        x = x.contiguous()
    rows, cols = x.shape
    data, data_t = _alloc_outputs(rows, cols, fp8_dtype, x.device, rowwise, columnwise)
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
    return data, data_t


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
# Torch reference: the same function, used on CPU and in tests
# ----------------------------------------------------------------------------------------------


def compute_scale_reference(
    amax: torch.Tensor, fp8_max: float, amax_epsilon: float, power_2_scale: bool
) -> torch.Tensor:
    """scale (1,) fp32 = fp8_max / max(amax, eps); 1 where that amax is 0 or not finite; the
    largest finite fp32 where the quotient overflows; rounded down to a power of two on request.
    """
    amax = amax.float()
    if amax_epsilon > 0:
        amax = torch.clamp_min(amax, amax_epsilon)
    scale = torch.full_like(amax, fp8_max) / amax
    scale = torch.where(torch.isinf(scale), torch.finfo(torch.float32).max, scale)
    scale = torch.where((amax == 0) | ~torch.isfinite(amax), 1.0, scale)
    if power_2_scale:
        # Keep only the exponent bits: the largest power of two <= scale (scale is normal).
        scale = (scale.view(torch.int32) & 0x7F800000).view(torch.float32)
    return scale


def cast_reference(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """x * scale in fp32, clamped to the FP8 range, rounded to nearest even."""
    fp8_max = FP8_MAX[fp8_dtype]
    return (x.float() * scale).clamp(-fp8_max, fp8_max).to(fp8_dtype)


def _outputs(
    data: torch.Tensor, rowwise: bool, columnwise: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return (data if rowwise else None), (fp8_transpose(data) if columnwise else None)


def quantize_delayed_reference(
    x, scale, amax, scale_inv, fp8_dtype, rowwise, columnwise
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Torch reference of quantize_delayed."""
    record_amax_reference(x, amax)
    torch.reciprocal(scale, out=scale_inv)
    return _outputs(cast_reference(x, scale, fp8_dtype), rowwise, columnwise)


def quantize_current_reference(
    x, scale_inv, fp8_dtype, amax_epsilon, power_2_scale, rowwise, columnwise
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Torch reference of quantize_current."""
    amax = torch.zeros(1, dtype=torch.float32, device=x.device)
    record_amax_reference(x, amax)
    scale = compute_scale_reference(amax, FP8_MAX[fp8_dtype], amax_epsilon, power_2_scale)
    scale_inv.copy_(current_scale_inv_reference(amax, scale))
    return _outputs(cast_reference(x, scale, fp8_dtype), rowwise, columnwise)


def current_scale_inv_reference(amax: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """scale_inv of a tensor quantized under current scaling: 1 / scale, or NaN where its amax
    is NaN or inf. The FP8 bytes are cast with scale 1 then (saturated, NaN kept), so every
    value computed from the tensor comes out NaN: a NaN or inf input is never turned into a
    finite result that training would step on."""
    return torch.where(torch.isfinite(amax), torch.reciprocal(scale), torch.nan)


def record_amax_reference(x: torch.Tensor, amax: torch.Tensor) -> None:
    """Torch reference of record_amax."""
    if x.numel() > 0:
        torch.maximum(amax, x.detach().abs().max().float().reshape(1), out=amax)
