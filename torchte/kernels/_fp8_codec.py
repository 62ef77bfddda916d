"""The FP8 byte encoder of every kernel that writes FP8 (cast_transpose, grouped_cast, norm_fp8,
activation_fp8): the Triton device functions that turn fp32 values into FP8 bytes and store
them, the layout of the outputs and their allocation, and the torch reference of the same cast.

Layout of an FP8 output of x (M, N): rowwise data (M, N) and columnwise data (N, Mp), where
Mp = M rounded up to a multiple of COLUMNWISE_ALIGN and the padding columns are zero (so a
wgrad GEMM can take Mp as its inner dimension for any M). A kernel reads its tile as four
slices, rows 4i + k for k = 0..3 (_encode_slice), so the columnwise bytes of rows 4i..4i+3 pack
into one int32 word (little endian) and the transpose moves 32-bit words, never 8-bit values.

amax is max-accumulated as the int32 bit pattern of |x|: for non-negative floats the integer
order is the float order, and NaN (0x7FC00000 and up) sorts above inf, so a NaN in x reaches
amax as torch.maximum would carry it (a float atomic max drops NaN).

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

from ._triton import tl, triton
from .cast_spec import CastSpec

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
COLUMNWISE_ALIGN = 16

# The tile (BLOCK_M, BLOCK_N, num_warps) of _cast_transpose_tile; BLOCK_M must be a multiple of
# COLUMNWISE_ALIGN so the row tiles that cover M also cover the padding up to Mp. Measured on
# an H200 (benchmarks/quantize.py sweep, 8192 x 8192 bf16).
CAST_CONFIG = (32, 128, 4)

if triton is not None:
    # FP8 bytes from the GPU's conversion instruction; under Triton's CPU interpreter, which
    # mis-rounds that conversion, from the integer encoder (both give torch's bytes).
    _HARDWARE_FP8 = tl.constexpr(not triton.knobs.runtime.interpret)
    # bf16 rounding (_round_as) by the GPU's conversion, one instruction where the integer
    # steps take seven.
    _HARDWARE_ROUND = tl.constexpr(not triton.knobs.runtime.interpret)
    # The GPU's FP8 conversion saturates (cvt.rn.satfinite): finite values and infinities past
    # the FP8 range come out as +-FP8_MAX, what the clamp before it gives.
    _SATURATING_CONVERT = tl.constexpr(not triton.knobs.runtime.interpret)

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
    def _encode(v, row_in, scale, FP8_MAX: tl.constexpr):
        """FP8 bytes (int32, 0..255) of fp32 v * scale, clamped to the FP8 range (NaN passes,
        as in torch.clamp; on a GPU by the saturating conversion itself), rounded to nearest
        even; zero in the rows past M (row_in False: the columnwise padding), whatever the
        scale."""
        y = v * scale
        if not _SATURATING_CONVERT:
            y = tl.where(y > FP8_MAX, FP8_MAX, y)
            y = tl.where(y < -FP8_MAX, -FP8_MAX, y)
        return _fp8_code(tl.where(row_in[:, None], y, 0.0), FP8_MAX)

    @triton.jit
    def _store_bytes(out_ptr, offs, code, mask):
        """Store FP8 bytes code (int32, 0..255) at out + offs as uint8."""
        tl.store(out_ptr.to(tl.pointer_type(tl.uint8)) + offs, code.to(tl.uint8), mask=mask)

    @triton.jit
    def _store_words(out_t_ptr, words, cols, col_in, word0, M, BLOCK_M: tl.constexpr):
        """Store words (BLOCK_M // 4, BLOCK_N) int32, word i of column c packing the bytes of
        rows 4i..4i+3 (little endian), into out_t (K, Mp) seen as int32 words (K, Mp // 4): rows
        `cols`, word columns word0 + i. A transpose of 32-bit words, never of 8-bit values."""
        words_per_row = tl.multiple_of(tl.cdiv(M, 16) * 4, 4)
        word_cols = word0 + tl.arange(0, BLOCK_M // 4)
        offs = cols.to(tl.int64)[:, None] * words_per_row + word_cols[None, :]
        mask = col_in[:, None] & (word_cols < words_per_row)[None, :]
        tl.store(out_t_ptr.to(tl.pointer_type(tl.int32)) + offs, tl.trans(words), mask=mask)

    @triton.jit
    def _encode_slice(
        v, k, row_in, offs, mask, scale, bits, words, out_ptr,
        FP8_MAX: tl.constexpr, AMAX: tl.constexpr, ROWWISE: tl.constexpr,
        COLUMNWISE: tl.constexpr,
    ):  # fmt: skip
        """Slice k (rows 4i + k) of a tile of fp32 values v: max |v| into bits (int32 bit
        patterns) when AMAX; the FP8 bytes of v * scale stored at out + offs (rowwise) when
        ROWWISE and packed into byte k of words (columnwise) when COLUMNWISE. (bits, words)."""
        if AMAX:
            bits = tl.maximum(bits, _abs_bits(v))
        if ROWWISE or COLUMNWISE:
            code = _encode(v, row_in, scale, FP8_MAX)
            if ROWWISE:
                _store_bytes(out_ptr, offs, code, mask)
            if COLUMNWISE:
                words = words | (code << (8 * k))
        return bits, words

    @triton.jit
    def _delayed_scale(scale_ptr, scale_inv_ptr, first):
        """The delayed scale (fp32 scalar) at scale; writes 1 / scale to scale_inv where `first`
        (true in one program only)."""
        scale = tl.load(scale_ptr)
        tl.store(scale_inv_ptr, tl.math.div_rn(1.0, scale), mask=first)
        return scale

    @triton.jit
    def _round_as(v, ptr):
        """fp32 v rounded to ptr's element type (fp32 / bf16 / fp16), back in fp32: the value a
        store to ptr and a load back would give. bf16: the GPU's conversion (to nearest even,
        NaN made the canonical 0x7FFF); under Triton's CPU interpreter, which truncates, the
        same rounding in integer arithmetic."""
        if ptr.dtype.element_ty == tl.bfloat16 and _HARDWARE_ROUND:
            v = v.to(tl.bfloat16).to(tl.float32)
        elif ptr.dtype.element_ty == tl.bfloat16:
            bits = v.to(tl.int32, bitcast=True)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            rounded = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FFF0000, rounded)
            v = rounded.to(tl.float32, bitcast=True)
        elif ptr.dtype.element_ty == tl.float16:
            v = v.to(tl.float16).to(tl.float32)
        return v

    @triton.jit
    def _scale_from_amax(amax, amax_epsilon, FP8_MAX: tl.constexpr, POWER_2: tl.constexpr):
        """compute_scale_reference on fp32 amax >= 0 or NaN (a scalar or a vector)."""
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
    def _tensor_scale(
        scale_ptr, amax_ptr, scale_inv_ptr, first, amax_epsilon, FP8_MAX: tl.constexpr,
        CURRENT: tl.constexpr, POWER_2: tl.constexpr,
    ):  # fmt: skip
        """The one scale a kernel casts a whole tensor with (fp32 scalar): delayed, the given
        scale; CURRENT, the one made from the amax (1,) an amax pass wrote. Writes scale_inv
        where `first` (true in one program only)."""
        if CURRENT:
            amax = tl.load(amax_ptr)
            scale = _scale_from_amax(amax, amax_epsilon, FP8_MAX, POWER_2)
            tl.store(scale_inv_ptr, _current_scale_inv(amax, scale), mask=first)
        else:
            scale = _delayed_scale(scale_ptr, scale_inv_ptr, first)
        return scale

    @triton.jit
    def _current_scale_inv(amax, scale):
        """scale_inv of a tensor quantized under current scaling: 1 / scale, or NaN when its
        amax is NaN or inf, so that what is computed from it is non-finite as the input was
        (current_scale_inv_reference)."""
        amax_finite = (amax.to(tl.int32, bitcast=True) & 0x7F800000) != 0x7F800000
        return tl.where(amax_finite, tl.math.div_rn(1.0, scale), float("nan"))

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
        src_ptr=None,  # (M,) int32 when GATHER: the row of x each row comes from, -1: zeros
        GATHER: tl.constexpr = False,
    ):
        """Cast + transpose tile (pid_m, pid_n) of x; returns the int32 bits of the tile's max |x|
        when AMAX (0 otherwise). The padding columns M..Mp of out_t get zero bytes. GATHER:
        row r of the tile's matrix is row src[r] of x (zeros where src[r] < 0); the outputs
        are laid out by r."""
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
            if GATHER:
                src = tl.load(src_ptr + rows, mask=row_in, other=-1)
                src_offs = src.to(tl.int64)[:, None] * N + cols[None, :]
                x = tl.load(x_ptr + src_offs, mask=mask & (src >= 0)[:, None], other=0.0)
                x = x.to(tl.float32)
            else:
                x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            bits, words = _encode_slice(
                x, k, row_in, offs, mask, scale, bits, words, out_ptr, FP8_MAX, AMAX, ROWWISE,
                COLUMNWISE,
            )  # fmt: skip
        if COLUMNWISE:
            _store_words(out_t_ptr, words, cols, col_in, pid_m * (BLOCK_M // 4), M, BLOCK_M)
        return tl.max(bits)


# ----------------------------------------------------------------------------------------------
# Host side: checks and allocation
# ----------------------------------------------------------------------------------------------


def check_fp8_dtype(fp8_dtype: torch.dtype, error: type[Exception] = TypeError) -> None:
    """`error` (TypeError unless the caller's argument checks raise another) unless fp8_dtype
    is one of FP8_MAX's dtypes."""
    if fp8_dtype not in FP8_MAX:
        known = ", ".join(str(d) for d in FP8_MAX)
        raise error(f"fp8_dtype must be one of {known}, got {fp8_dtype}")


def check_producer_spec(
    spec: CastSpec, op: str, needs_rowwise: bool, current: bool = False
) -> None:
    """The CastSpec rules of a fused producer (norm -> FP8, activation -> FP8): TypeError
    unless spec.fp8_dtype is an FP8 dtype; ValueError unless the scaling is delayed (spec.scale
    given: the scale known before the values exist) or `current` says the producer also takes
    current scaling (an amax pass first), and, when `needs_rowwise`, unless spec.rowwise (the
    kernel always writes the rowwise data)."""
    if spec.fp8_dtype not in FP8_MAX:
        check_fp8_dtype(spec.fp8_dtype)
    if spec.scale is None and not current:
        raise ValueError(
            f"{op} supports delayed scaling only (spec.scale given: the scale must be known "
            f"before the values exist), got {spec!r}"
        )
    if needs_rowwise and not spec.rowwise:
        raise ValueError(
            f"{op} always writes rowwise data: spec.rowwise must be True, got {spec!r}"
        )


def alloc_outputs(
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


# ----------------------------------------------------------------------------------------------
# Torch reference of the cast: used on CPU and in tests
# ----------------------------------------------------------------------------------------------


def fp8_transpose(data: torch.Tensor) -> torch.Tensor:
    """Rowwise FP8 data (M, N) -> columnwise (N, Mp), zero-padded; an exact byte copy."""
    rows, cols = data.shape
    out = torch.zeros(
        (cols, round_up(rows, COLUMNWISE_ALIGN)), dtype=torch.uint8, device=data.device
    )
    out[:, :rows] = data.view(torch.uint8).t()
    return out.view(data.dtype)


def record_amax_reference(x: torch.Tensor, amax: torch.Tensor) -> None:
    """amax (1,) = max(amax, max |x|), in place; NaN carried (torch.maximum)."""
    if x.numel() > 0:
        torch.maximum(amax, x.detach().abs().max().float().reshape(1), out=amax)


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


def current_scale_inv_reference(amax: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """scale_inv of a tensor quantized under current scaling: 1 / scale, or NaN where its amax
    is NaN or inf. The FP8 bytes are cast with scale 1 then (saturated, NaN kept), so every
    value computed from the tensor comes out NaN: a NaN or inf input is never turned into a
    finite result that training would step on."""
    return torch.where(torch.isfinite(amax), torch.reciprocal(scale), torch.nan)


def cast_reference(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """x * scale in fp32, clamped to the FP8 range, rounded to nearest even."""
    fp8_max = FP8_MAX[fp8_dtype]
    return (x.float() * scale).clamp(-fp8_max, fp8_max).to(fp8_dtype)


def encode_reference(
    x: torch.Tensor, spec: CastSpec
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """The cast of x (M, N) with one scale as spec says, in torch: (rowwise (M, N) | None,
    columnwise (N, Mp) | None, scale_inv (1,) fp32). Delayed (spec.scale (1,) given): max |x|
    max-accumulated into spec.amax (1,) in place, scale_inv = 1 / scale. Current (spec.scale
    None; spec.amax not used): the scale made from x's own amax (compute_scale_reference),
    scale_inv as current_scale_inv_reference."""
    scale = spec.scale
    if scale is not None:
        record_amax_reference(x, spec.amax)
        scale_inv = torch.reciprocal(scale)
    else:
        found = torch.zeros(1, dtype=torch.float32, device=x.device)
        record_amax_reference(x, found)
        fp8_max = FP8_MAX[spec.fp8_dtype]
        scale = compute_scale_reference(found, fp8_max, spec.amax_epsilon, spec.power_2_scale)
        scale_inv = current_scale_inv_reference(found, scale)
    data = cast_reference(x, scale, spec.fp8_dtype)
    rowwise = data if spec.rowwise else None
    return rowwise, (fp8_transpose(data) if spec.columnwise else None), scale_inv
