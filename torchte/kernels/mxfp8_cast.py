"""MXFP8 cast and dequantize: FP8 values with one E8M0 (power-of-two) scale per 32 values, as
Transformer Engine's MXFP8 kernels write them (its "compact", unswizzled scale layout).

Shapes: x (M, K) fp32 / bf16 / fp16, M and K multiples of 32 (Transformer Engine refuses other
sizes). Outputs, each written only when its usage is asked for:
- rowwise data (M, K) FP8 and rowwise scale_inv (round_up(M, 128), round_up(K / 32, 4)) uint8:
  row r, columns 32j..32j+31 (a 1x32 block) share the E8M0 code at [r, j];
- columnwise data (M, K) FP8, NOT transposed (the same layout as x), and columnwise scale_inv
  (round_up(M / 32, 4), round_up(K, 128)) uint8: column c, rows 32i..32i+31 (a 32x1 block)
  share the code at [i, c].
The scale padding (Transformer Engine's shapes: rows to 128 and columns to 4 on the rowwise
side, rows to 4 and columns to 128 on the columnwise side) holds code 0 here, what an all-zero
block gets; Transformer Engine leaves it uninitialized. Its GEMM-swizzled form
(`with_gemm_swizzled_scales`, what cuBLAS reads on Blackwell) keeps the same codes in the same
padded buffers but reorders them: each 128x4 tile of rowwise codes (4x128 columnwise) is made
contiguous and its 128 four-byte rows interleaved as 0, 32, 64, 96, 1, 33, ... Hopper has no
MXFP8 GEMM, so only the compact form exists here.

Per block of 32 values (Transformer Engine's quantize_mxfp8 kernel and ptx float_to_e8m0 /
exp2f_rcp, the Blackwell instruction semantics):
  amax = max |x| over the block, NaN ignored (a NaN never wins the max; an all-NaN block has
         amax 0), inf kept;
  code = float_to_e8m0(amax * r): r = fp32(1 / fp8_max), the product rounded to fp32; the code
         is that value's exponent, rounded up to the next power of two when it is not one
         (cvt.rp.satfinite.ue8m0): 0 for 0 (and for values up to 2**-127), 254 for inf (and
         anything above 2**127), 255 for NaN (never: amax is not NaN);
  data = FP8(x * exp2f_rcp(code)): 2**(127 - code) in fp32 (2**-127 for code 254, NaN for
         255), the product rounded to fp32, saturated to +-fp8_max (an inf becomes fp8_max), NaN
         as 0x7F whatever its sign (the GPU's conversion drops it), else rounded to nearest
         even. These are the bytes of
         Transformer Engine's generic kernel and of its C++ test reference; its specialized
         bf16/fp16 kernels (whole 128-column chunks) compute x * s + 0 with an fma, which
         writes -0.0 as +0 (0x00 instead of 0x80); every other byte is the same.
Dequantized: value = FP8 value * 2**(code - 127) in fp32 (2**-127 for code 0, NaN for 255;
exact there), then rounded to the output dtype: exact in bf16 wherever the value is in bf16's
range. With two_d (Transformer Engine's `with_2d_quantization`) every 32x32 block has one code,
from the amax of all its 1024 values, written to both scale layouts; the two data copies are
then the same bytes.

On CUDA with Triton one kernel writes both usages in one pass over x (one read of x, one write
of each output, the scale padding included: its grid covers round_up(M, 128) x round_up(K, 128)
so no buffer needs zeroing); dequantize is one kernel too. Elsewhere the torch references
beside them run, which give the same bytes. FP8 bytes come from _fp8_codec's encoder, bf16 is
read and written as bits, the FP8 decode is integer arithmetic, and a scale factor of 2**-127
is applied as two normal factors (which rounds the same), never as a subnormal operand.
"""

from __future__ import annotations

import struct

import torch

from torchte._sizes import round_up

from ._compile import compiled_as_op
from ._fp8_codec import FP8_MAX, check_fp8_dtype
from ._triton import FastLaunch, cdiv, tl, triton, triton_available

__all__ = [
    "BLOCK",
    "DEQUANTIZE_CONFIG",
    "QUANTIZE_CONFIG",
    "check_mxfp8_shape",
    "mxfp8_dequantize",
    "mxfp8_dequantize_reference",
    "mxfp8_quantize",
    "mxfp8_quantize_reference",
    "scale_shape",
]

# Values per scaling block (Transformer Engine's MXFP8_BLOCK_SCALING_SIZE).
BLOCK = 32
_HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# (BLOCK_M, BLOCK_K, num_warps) of the quantize and dequantize tiles. The quantize tile sides
# must be 32, 64 or 128 (powers of two dividing 128), so that its grid covers the padded scale
# buffers exactly; the dequantize tile any multiples of 32 that are powers of two. Not yet tuned
# on a GPU.
QUANTIZE_CONFIG = (64, 128, 4)
DEQUANTIZE_CONFIG = (64, 128, 4)


def _f32_bits(value: float) -> int:
    return struct.unpack("<i", struct.pack("<f", value))[0]


# fp32(1 / fp8_max) as int32 bits: Transformer Engine's Quantized_Limits<T>::max_norm_rcp.
_RCP_BITS = {dtype: _f32_bits(1.0 / fp8_max) for dtype, fp8_max in FP8_MAX.items()}

if triton is not None:
    from ._fp8_codec import _fp8_code

    @triton.jit
    def _e8m0(amax_bits, RCP_BITS: tl.constexpr):
        """E8M0 codes (int32, 0..255) of blocks whose amax has the int32 bits amax_bits (>= 0):
        float_to_e8m0(amax * fp32(1 / fp8_max))."""
        rcp = tl.full((), RCP_BITS, tl.int32).to(tl.float32, bitcast=True)
        val = (amax_bits.to(tl.float32, bitcast=True) * rcp).to(tl.int32, bitcast=True)
        exp = val >> 23
        mant = val & 0x7FFFFF
        up = (mant > 0) & (exp != 254) & ~((exp == 0) & (mant <= 0x400000))
        code = exp + up.to(tl.int32)
        return tl.where(exp == 255, tl.where(mant == 0, 254, 255), code)

    @triton.jit
    def _rcp_factors(code):
        """(pre, post) fp32 with pre * post = exp2f_rcp(code) = 2**(127 - code) (2**-127 at
        254 as 0.5 * 2**-126; NaN at 255), both normal: x * pre * post rounds as x * 2**(127 -
        code) would."""
        post_bits = tl.where(code >= 254, tl.where(code == 255, 0x7FFFFFFF, 1 << 23), 0)
        post_bits = tl.where(code < 254, (254 - code) << 23, post_bits)
        pre = tl.where(code == 254, 0.5, 1.0)
        return pre, post_bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _mxfp8_bytes(x, pre, post, FP8_MAX: tl.constexpr):
        """FP8 bytes (int32, 0..255) of fp32 x * pre * post, saturated to +-FP8_MAX; NaN as
        0x7F whatever its sign (the GPU's conversion drops a NaN's sign)."""
        y = x * pre * post
        y = tl.where(y > FP8_MAX, FP8_MAX, y)
        y = tl.where(y < -FP8_MAX, -FP8_MAX, y)
        nan = (y.to(tl.int32, bitcast=True) & 0x7FFFFFFF) > 0x7F800000
        return tl.where(nan, 0x7F, _fp8_code(y, FP8_MAX))

    @triton.jit
    def _load_f32(x_ptr, offs, mask):
        """x at offs as fp32 (0 where masked); bf16 widened from its bits, exact also for
        subnormals, which Triton's CPU interpreter loses when it converts bf16."""
        if x_ptr.dtype.element_ty == tl.bfloat16:
            raw = tl.load(x_ptr.to(tl.pointer_type(tl.int16)) + offs, mask=mask, other=0)
            return (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        return tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _mxfp8_quantize_kernel(
        x_ptr,  # (M, K) fp32 / bf16 / fp16, contiguous
        data_ptr,  # (M, K) uint8: rowwise FP8 bytes, when ROWWISE
        scale_ptr,  # (round_up(M, 128), round_up(K / 32, 4)) uint8 rowwise codes, when ROWWISE
        data_c_ptr,  # (M, K) uint8: columnwise FP8 bytes, when COLUMNWISE
        scale_c_ptr,  # (round_up(M / 32, 4), round_up(K, 128)) uint8 codes, when COLUMNWISE
        M,
        K,
        scale_cols,  # round_up(K / 32, 4): the rowwise scale row stride
        scale_c_cols,  # round_up(K, 128): the columnwise scale row stride
        FP8_MAX: tl.constexpr,
        RCP_BITS: tl.constexpr,
        ROWWISE: tl.constexpr,
        COLUMNWISE: tl.constexpr,
        TWO_D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """One (BLOCK_M, BLOCK_K) tile seen as (BM/32 row blocks, 32 rows, BK/32 column blocks,
        32 columns); tiles past (M, K) read zeros and write only their (zero) scale codes."""
        MB: tl.constexpr = BLOCK_M // 32
        NB: tl.constexpr = BLOCK_K // 32
        pid_m = tl.program_id(0)
        pid_k = tl.program_id(1)
        i = tl.arange(0, MB)[:, None, None, None]
        r = tl.arange(0, 32)[None, :, None, None]
        kb = tl.arange(0, NB)[None, None, :, None]
        j = tl.arange(0, 32)[None, None, None, :]
        rows = pid_m * BLOCK_M + i * 32 + r
        cols = pid_k * BLOCK_K + kb * 32 + j
        mask = (rows < M) & (cols < K)
        offs = rows.to(tl.int64) * K + cols
        x = _load_f32(x_ptr, offs, mask)
        mag = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        mag = tl.where(mag > 0x7F800000, 0, mag)  # NaN never wins the block's max
        if TWO_D:
            amax_2d = tl.max(tl.max(mag, axis=3), axis=1)  # (MB, NB)
            amax_r = tl.broadcast_to(amax_2d[:, None, :], (MB, 32, NB))
            amax_c = tl.broadcast_to(amax_2d[:, :, None], (MB, NB, 32))
        else:
            amax_r = tl.max(mag, axis=3)  # (MB, 32, NB): 1x32 blocks
            amax_c = amax_r  # unused: the 32x1 blocks are found from a 3-D load below
        if ROWWISE:
            code = _e8m0(amax_r, RCP_BITS)
            s_rows = pid_m * BLOCK_M + tl.arange(0, MB)[:, None, None] * 32
            s_rows += tl.arange(0, 32)[None, :, None]
            s_cols = pid_k * NB + tl.arange(0, NB)[None, None, :]
            tl.store(scale_ptr + s_rows.to(tl.int64) * scale_cols + s_cols, code.to(tl.uint8))
            pre, post = _rcp_factors(code)
            out = _mxfp8_bytes(x, pre[:, :, :, None], post[:, :, :, None], FP8_MAX)
            tl.store(data_ptr + offs, out.to(tl.uint8), mask=mask)
        if COLUMNWISE and not TWO_D:
            # 32x1 blocks from a 3-D (MB, 32, BLOCK_K) load (from L2): on sm90 with Triton 3.6
            # the 4-D tile broadcast after its axis-1 reduction wrote wrong bytes.
            rows3 = pid_m * BLOCK_M + tl.arange(0, MB)[:, None, None] * 32
            rows3 += tl.arange(0, 32)[None, :, None]
            cols3 = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)[None, None, :]
            mask3 = (rows3 < M) & (cols3 < K)
            offs3 = rows3.to(tl.int64) * K + cols3
            x3 = _load_f32(x_ptr, offs3, mask3)
            mag3 = x3.to(tl.int32, bitcast=True) & 0x7FFFFFFF
            mag3 = tl.where(mag3 > 0x7F800000, 0, mag3)
            code = _e8m0(tl.max(mag3, axis=1), RCP_BITS)  # (MB, BLOCK_K)
            s_rows = pid_m * MB + tl.arange(0, MB)[:, None]
            s_cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
            tl.store(scale_c_ptr + s_rows.to(tl.int64) * scale_c_cols + s_cols, code.to(tl.uint8))
            pre, post = _rcp_factors(code)
            out = _mxfp8_bytes(x3, pre[:, None, :], post[:, None, :], FP8_MAX)
            tl.store(data_c_ptr + offs3, out.to(tl.uint8), mask=mask3)
        if COLUMNWISE and TWO_D:
            code = _e8m0(amax_c, RCP_BITS)
            s_rows = pid_m * MB + tl.arange(0, MB)[:, None, None]
            s_cols = pid_k * BLOCK_K + tl.arange(0, NB)[None, :, None] * 32
            s_cols += tl.arange(0, 32)[None, None, :]
            tl.store(scale_c_ptr + s_rows.to(tl.int64) * scale_c_cols + s_cols, code.to(tl.uint8))
            pre, post = _rcp_factors(code)
            out = _mxfp8_bytes(x, pre[:, None, :, :], post[:, None, :, :], FP8_MAX)
            tl.store(data_c_ptr + offs, out.to(tl.uint8), mask=mask)

    @triton.jit
    def _fp8_value(byte, FP8_MAX: tl.constexpr):
        """fp32 value of FP8 bytes (int32, 0..255), decoded in integer arithmetic."""
        if FP8_MAX == 448.0:  # e4m3: bias 7, 3 mantissa bits, subnormals of 2**-9, NaN 0x7F
            exp = (byte >> 3) & 0xF
            mant = byte & 0x7
            bits = ((exp + 120) << 23) | (mant << 20)
            sub = (mant.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)
            bits = tl.where(exp == 0, sub, bits)
            bits = tl.where((byte & 0x7F) == 0x7F, 0x7FC00000, bits)
        else:  # e5m2: bias 15, 2 mantissa bits, subnormals of 2**-16, inf 0x7C, NaN above
            exp = (byte >> 2) & 0x1F
            mant = byte & 0x3
            bits = ((exp + 112) << 23) | (mant << 21)
            sub = (mant.to(tl.float32) * 0.0000152587890625).to(tl.int32, bitcast=True)
            bits = tl.where(exp == 0, sub, bits)
            bits = tl.where(exp == 31, tl.where(mant == 0, 0x7F800000, 0x7FC00000), bits)
        return (bits | ((byte & 0x80) << 24)).to(tl.float32, bitcast=True)

    @triton.jit
    def _store_as(out_ptr, offs, value, mask):
        """Store fp32 value at out + offs in out's dtype, rounded to nearest even. bf16 is
        rounded in integer arithmetic and stored as its bits (NaN as 0x7FFF, as the GPU's
        conversion gives): Triton's CPU interpreter truncates, and loses subnormals, when it
        converts to bf16."""
        if out_ptr.dtype.element_ty == tl.bfloat16:
            bits = value.to(tl.int32, bitcast=True)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            rounded = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FFF, rounded)
            tl.store(out_ptr.to(tl.pointer_type(tl.int16)) + offs, rounded.to(tl.int16), mask=mask)
        else:
            tl.store(out_ptr + offs, value.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _mxfp8_dequantize_kernel(
        data_ptr,  # (M, K) uint8: FP8 bytes
        scale_ptr,  # uint8 codes, row stride scale_cols: rowwise [r, k / 32], else [r / 32, k]
        out_ptr,  # (M, K) fp32 / bf16 / fp16
        M,
        K,
        scale_cols,
        FP8_MAX: tl.constexpr,
        ROWWISE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        MB: tl.constexpr = BLOCK_M // 32
        NB: tl.constexpr = BLOCK_K // 32
        i = tl.arange(0, MB)[:, None, None, None]
        r = tl.arange(0, 32)[None, :, None, None]
        kb = tl.arange(0, NB)[None, None, :, None]
        j = tl.arange(0, 32)[None, None, None, :]
        rows = tl.program_id(0) * BLOCK_M + i * 32 + r
        cols = tl.program_id(1) * BLOCK_K + kb * 32 + j
        mask = (rows < M) & (cols < K)
        offs = rows.to(tl.int64) * K + cols
        byte = tl.load(data_ptr + offs, mask=mask, other=0).to(tl.int32)
        if ROWWISE:  # one code per (row, 32 columns): a (MB, 32, NB, 1) tile of codes
            s_mask = (rows < M) & (tl.program_id(1) * BLOCK_K + kb * 32 < K)
            s_offs = rows.to(tl.int64) * scale_cols + tl.program_id(1) * NB + kb
        else:  # one code per (32 rows, column): (MB, 1, NB, 32)
            s_mask = (i * 32 + tl.program_id(0) * BLOCK_M < M) & (cols < K)
            s_offs = (tl.program_id(0) * MB + i).to(tl.int64) * scale_cols + cols
        code = tl.load(scale_ptr + s_offs, mask=s_mask, other=127).to(tl.int32)
        # 2**(code - 127): code 0 as 2**-64 * 2**-63 (no subnormal factor), NaN at 255.
        pre = tl.where(code == 0, 5.421010862427522e-20, 1.0)
        post_bits = tl.where(code == 0, 64 << 23, tl.where(code == 255, 0x7FFFFFFF, code << 23))
        value = _fp8_value(byte, FP8_MAX) * pre * post_bits.to(tl.float32, bitcast=True)
        _store_as(out_ptr, offs, value, mask)

    _launch_quantize = FastLaunch(_mxfp8_quantize_kernel)
    _launch_dequantize = FastLaunch(_mxfp8_dequantize_kernel)


# ----------------------------------------------------------------------------------------------
# Public API, checks and launchers
# ----------------------------------------------------------------------------------------------


def scale_shape(rows: int, cols: int, columnwise: bool) -> tuple[int, int]:
    """The shape of the scale_inv of an (rows, cols) MXFP8 value, Transformer Engine's padding
    included: rowwise (round_up(rows, 128), round_up(cols / 32, 4)), columnwise
    (round_up(rows / 32, 4), round_up(cols, 128))."""
    if columnwise:
        return round_up(rows // BLOCK, 4), round_up(cols, 128)
    return round_up(rows, 128), round_up(cols // BLOCK, 4)


def check_mxfp8_shape(shape: tuple[int, ...], name: str = "x") -> None:
    """ValueError unless a value of `shape` (..., K) can be MXFP8: K and the number of rows
    prod(shape[:-1]) both multiples of 32, as Transformer Engine requires."""
    if len(shape) == 0:
        raise ValueError(f"{name}: MXFP8 needs at least one dimension, got a scalar")
    rows = 1
    for size in shape[:-1]:
        rows *= size
    if shape[-1] % BLOCK:
        raise ValueError(
            f"{name}: the last dimension (size {shape[-1]}) must be a multiple of the MXFP8 "
            f"block of {BLOCK} (shape {tuple(shape)})"
        )
    if rows % BLOCK:
        raise ValueError(
            f"{name}: the number of rows (prod of the leading dimensions, {rows}) must be a "
            f"multiple of the MXFP8 block of {BLOCK} (shape {tuple(shape)})"
        )


def _check_quantize(x: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool):
    if x.dim() != 2:
        raise ValueError(f"mxfp8_quantize: x must be 2-D (M, K), got shape {tuple(x.shape)}")
    if x.dtype not in _HP_DTYPES:
        raise TypeError(f"mxfp8_quantize: x must be fp32, bf16 or fp16, got {x.dtype}")
    check_fp8_dtype(fp8_dtype)
    if not (rowwise or columnwise):
        raise ValueError("mxfp8_quantize: at least one of rowwise and columnwise must be True")
    check_mxfp8_shape(tuple(x.shape))


@compiled_as_op(
    "(Tensor x, ScalarType fp8_dtype, bool rowwise, bool columnwise, bool two_d=False) "
    "-> (Tensor, Tensor, Tensor, Tensor)"
)
def mxfp8_quantize(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    rowwise: bool,
    columnwise: bool,
    two_d: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Quantize x (M, K) to MXFP8 (see the module docstring): (rowwise data (M, K) FP8 | None,
    rowwise scale_inv uint8 | None, columnwise data (M, K) FP8 | None, columnwise scale_inv
    uint8 | None), both usages in one pass. two_d: one scale per 32x32 block."""
    _check_quantize(x, fp8_dtype, rowwise, columnwise)
    if x.is_cuda and triton_available() and x.numel() > 0:
        return _quantize_triton(x, fp8_dtype, rowwise, columnwise, two_d)
    return mxfp8_quantize_reference(x, fp8_dtype, rowwise, columnwise, two_d)


def _alloc(x: torch.Tensor, fp8_dtype: torch.dtype, wanted: bool, columnwise: bool):
    if not wanted:
        return None, None
    rows, cols = x.shape
    data = torch.empty(rows, cols, dtype=fp8_dtype, device=x.device)
    return data, torch.empty(
        scale_shape(rows, cols, columnwise), dtype=torch.uint8, device=x.device
    )


def _quantize_triton(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    rowwise: bool,
    columnwise: bool,
    two_d: bool,
    config: tuple[int, int, int] = QUANTIZE_CONFIG,
):
    """Launch _mxfp8_quantize_kernel over round_up(M, 128) x round_up(K, 128) (M, K > 0)."""
    if not x.is_contiguous():
        x = x.contiguous()
    rows, cols = x.shape
    block_m, block_k, num_warps = config
    if block_m not in (32, 64, 128) or block_k not in (32, 64, 128):
        raise ValueError(f"MXFP8 quantize tile sides must be 32, 64 or 128, got {config}")
    data, scale = _alloc(x, fp8_dtype, rowwise, False)
    data_c, scale_c = _alloc(x, fp8_dtype, columnwise, True)
    # An output not asked for is never stored to: any pointer will do.
    out = (data if rowwise else data_c).view(torch.uint8)
    out_s = scale if rowwise else scale_c
    out_c = (data_c if columnwise else data).view(torch.uint8)
    out_cs = scale_c if columnwise else scale
    scale_cols, scale_c_cols = round_up(cols // BLOCK, 4), round_up(cols, 128)
    grid = (round_up(rows, 128) // block_m, round_up(cols, 128) // block_k, 1)
    key = (
        x.dtype, fp8_dtype, rowwise, columnwise, two_d, config,
        rows & 15, rows >> 31, cols & 15, cols >> 31, scale_cols & 15, scale_c_cols & 15,
        x.data_ptr() & 15, out.data_ptr() & 15, out_s.data_ptr() & 15, out_c.data_ptr() & 15,
        out_cs.data_ptr() & 15,
    )  # fmt: skip
    _launch_quantize(
        key, grid, num_warps, x, out, out_s, out_c, out_cs, rows, cols, scale_cols, scale_c_cols,
        FP8_MAX[fp8_dtype], _RCP_BITS[fp8_dtype], rowwise, columnwise, two_d, block_m, block_k,
    )  # fmt: skip
    return data, scale, data_c, scale_c


def _check_dequantize(data: torch.Tensor, scale_inv: torch.Tensor, rowwise: bool, dtype):
    if data.dim() != 2:
        raise ValueError(f"mxfp8_dequantize: data must be 2-D (M, K), got {tuple(data.shape)}")
    if data.dtype not in FP8_MAX:
        raise TypeError(
            f"mxfp8_dequantize: data must be torch.float8_e4m3fn or torch.float8_e5m2, got "
            f"{data.dtype}"
        )
    if scale_inv.dtype != torch.uint8 or scale_inv.dim() != 2:
        raise TypeError(
            f"mxfp8_dequantize: scale_inv must be 2-D uint8 E8M0 codes, got {scale_inv.dtype} "
            f"of shape {tuple(scale_inv.shape)}"
        )
    if dtype not in _HP_DTYPES:
        raise TypeError(f"mxfp8_dequantize: dtype must be fp32, bf16 or fp16, got {dtype}")
    if scale_inv.device != data.device:
        raise ValueError(
            f"mxfp8_dequantize: scale_inv is on {scale_inv.device}, data on {data.device}"
        )
    check_mxfp8_shape(tuple(data.shape), "data")
    rows, cols = data.shape
    need = (rows, cols // BLOCK) if rowwise else (rows // BLOCK, cols)
    if scale_inv.shape[0] < need[0] or scale_inv.shape[1] < need[1]:
        usage = "rowwise" if rowwise else "columnwise"
        raise ValueError(
            f"mxfp8_dequantize: {usage} scale_inv of shape {tuple(scale_inv.shape)} does not "
            f"cover the {need} codes of data {tuple(data.shape)}"
        )


@compiled_as_op("(Tensor data, Tensor scale_inv, bool rowwise, ScalarType dtype) -> Tensor")
def mxfp8_dequantize(
    data: torch.Tensor, scale_inv: torch.Tensor, rowwise: bool, dtype: torch.dtype
) -> torch.Tensor:
    """The values (M, K) in `dtype` of MXFP8 data (M, K) with its scale_inv: rowwise codes
    [r, k / 32] (rowwise=True) or columnwise codes [r / 32, k]; padding beyond them ignored."""
    _check_dequantize(data, scale_inv, rowwise, dtype)
    if data.is_cuda and triton_available() and data.numel() > 0:
        return _dequantize_triton(data, scale_inv, rowwise, dtype)
    return mxfp8_dequantize_reference(data, scale_inv, rowwise, dtype)


def _dequantize_triton(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    rowwise: bool,
    dtype: torch.dtype,
    config: tuple[int, int, int] = DEQUANTIZE_CONFIG,
) -> torch.Tensor:
    """Launch _mxfp8_dequantize_kernel on data (M, K), M, K > 0."""
    fp8_max = FP8_MAX[data.dtype]
    data = data.contiguous().view(torch.uint8)
    if scale_inv.stride(1) != 1:
        scale_inv = scale_inv.contiguous()
    rows, cols = data.shape
    block_m, block_k, num_warps = config
    out = torch.empty(rows, cols, dtype=dtype, device=data.device)
    scale_cols = scale_inv.stride(0)
    grid = (cdiv(rows, block_m), cdiv(cols, block_k), 1)
    key = (
        dtype, data.dtype, rowwise, config, rows & 15, rows >> 31, cols & 15, cols >> 31,
        scale_cols == 1, scale_cols & 15, data.data_ptr() & 15, scale_inv.data_ptr() & 15,
        out.data_ptr() & 15, fp8_max,
    )  # fmt: skip
    _launch_dequantize(
        key, grid, num_warps, data, scale_inv, out, rows, cols, scale_cols, fp8_max, rowwise,
        block_m, block_k,
    )  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------------
# Torch references: the same functions, used on CPU and in tests
# ----------------------------------------------------------------------------------------------


def _e8m0_reference(amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """int32 E8M0 codes of fp32 block amaxes (>= 0): float_to_e8m0(amax * fp32(1 / fp8_max))."""
    rcp = torch.tensor(_RCP_BITS[fp8_dtype], dtype=torch.int32).view(torch.float32)
    val = (amax * rcp.to(amax.device)).view(torch.int32)
    exp = val >> 23
    mant = val & 0x7FFFFF
    up = (mant > 0) & (exp != 254) & ~((exp == 0) & (mant <= 0x400000))
    code = exp + up.to(torch.int32)
    return torch.where(exp == 255, torch.where(mant == 0, 254, 255), code)


def _exp2f_rcp_reference(code: torch.Tensor) -> torch.Tensor:
    """fp32 2**(127 - code) of int32 codes: 2**-127 (subnormal) at 254, NaN at 255."""
    bits = torch.where(code == 254, 0x00400000, (254 - code) << 23)
    return torch.where(code == 255, 0x7FFFFFFF, bits).to(torch.int32).view(torch.float32)


def _exp2f_reference(code: torch.Tensor) -> torch.Tensor:
    """fp32 2**(code - 127) of int32 codes: 2**-127 (subnormal) at 0, NaN at 255."""
    bits = torch.where(code == 0, 0x00400000, code << 23)
    return torch.where(code == 255, 0x7FFFFFFF, bits).to(torch.int32).view(torch.float32)


def _encode_reference(x: torch.Tensor, code: torch.Tensor, fp8_dtype: torch.dtype):
    """FP8 values of fp32 x * exp2f_rcp(code) (code broadcast over x), saturated; NaN as the
    byte 0x7F whatever its sign (as the GPU writes it)."""
    fp8_max = FP8_MAX[fp8_dtype]
    y = (x * _exp2f_rcp_reference(code)).clamp(-fp8_max, fp8_max)
    data = y.to(fp8_dtype).view(torch.uint8)
    data = torch.where(torch.isnan(y), torch.full_like(data, 0x7F), data)
    return data.view(fp8_dtype)


def _padded_codes(code: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """code (a, b) in the top-left corner of a zero uint8 buffer of `shape`."""
    out = torch.zeros(shape, dtype=torch.uint8, device=code.device)
    out[: code.shape[0], : code.shape[1]] = code.to(torch.uint8)
    return out


def mxfp8_quantize_reference(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    rowwise: bool,
    columnwise: bool,
    two_d: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Torch reference of mxfp8_quantize (same bytes, scale padding zero)."""
    _check_quantize(x, fp8_dtype, rowwise, columnwise)
    rows, cols = x.shape
    mb, nb = rows // BLOCK, cols // BLOCK
    x4 = x.float().reshape(mb, BLOCK, nb, BLOCK)  # (row block, row, column block, column)
    mag = x4.abs()
    mag = torch.where(torch.isnan(mag), 0.0, mag)  # NaN never wins the block's max
    if two_d:
        amax_2d = mag.amax(dim=(1, 3))  # (mb, nb)
        amax_r = amax_2d[:, None, :].expand(mb, BLOCK, nb)
        amax_c = amax_2d[:, :, None].expand(mb, nb, BLOCK)
    else:
        amax_r, amax_c = mag.amax(dim=3), mag.amax(dim=1)  # (mb, 32, nb), (mb, nb, 32)
    data = scale = data_c = scale_c = None
    if rowwise:
        code = _e8m0_reference(amax_r, fp8_dtype)
        data = _encode_reference(x4, code[:, :, :, None], fp8_dtype).reshape(rows, cols)
        scale = _padded_codes(code.reshape(rows, nb), scale_shape(rows, cols, False))
    if columnwise:
        code = _e8m0_reference(amax_c, fp8_dtype)
        data_c = _encode_reference(x4, code[:, None, :, :], fp8_dtype).reshape(rows, cols)
        scale_c = _padded_codes(code.reshape(mb, cols), scale_shape(rows, cols, True))
    return data, scale, data_c, scale_c


def mxfp8_dequantize_reference(
    data: torch.Tensor, scale_inv: torch.Tensor, rowwise: bool, dtype: torch.dtype
) -> torch.Tensor:
    """Torch reference of mxfp8_dequantize: FP8 value * 2**(code - 127) in fp32, then `dtype`."""
    _check_dequantize(data, scale_inv, rowwise, dtype)
    rows, cols = data.shape
    mb, nb = rows // BLOCK, cols // BLOCK
    values = data.float().reshape(mb, BLOCK, nb, BLOCK)
    if rowwise:
        code = scale_inv[:rows, :nb].to(torch.int32).reshape(mb, BLOCK, nb, 1)
    else:
        code = scale_inv[:mb, :cols].to(torch.int32).reshape(mb, 1, nb, BLOCK)
    return (values * _exp2f_reference(code)).reshape(rows, cols).to(dtype)
