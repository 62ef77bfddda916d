"""NVFP4 (Transformer Engine's NVFP4BlockScaling): one pass over a high-precision matrix writes
its rowwise and columnwise FP4 copies with their E4M3 block scales; one pass turns a copy back
into the exact (R, K) GEMM operand; torch references of both giving the same bytes.

Layout of x (M, K), M and K multiples of 16 (FP4_BLOCK):
- rowwise data (M, K/2) uint8: E2M1 codes of x in blocks of 16 along K, value 2j in the low
  nibble of byte j and value 2j + 1 in the high nibble; scales (round_up(M, 128),
  round_up(K/16, 4)) uint8 E4M3, block (m, j) at [m, j], the padding zero.
- columnwise data (K, M/2) uint8 and scales (round_up(K, 128), round_up(M/16, 4)): the same
  of x^T (blocks of 16 along M), of RHT(x^T) with spec.rht (hadamard.py).
- 2-D blocks (spec.two_d, weights): one scale per 16 x 16 tile, written for each of its rows
  in both layouts, so that without RHT or stochastic rounding the two copies are transposes.

Per-tensor amaxes come from a separate reduction (compute_amax), as in Transformer Engine:
amax[0] = max |x| (rowwise), amax[1] = max |RHT(x)| with spec.rht, else max |x| (columnwise),
NaN skipped as its max instructions skip it. The RHT'd values are rounded to x's dtype (bf16 in
Transformer Engine, which takes RHT for bf16 only) before their amax and their encoding. Block
scales, FP4 codes and stochastic rounding: _fp4_codec.py. Random blocks: rowwise block (m, j)
has index m * K/16 + j, columnwise block (k, i) of x^T the index M * K/16 + k * M/16 + i.

Launches: compute_amax 2 (zeroing, amax); quantize one per copy (the rowwise copy here, the
columnwise one by nvfp4_cols.py, which also takes the amax with the transform) plus the zeroing
of the scale paddings; dequantize_values 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchte._sizes import round_up

from ._fp4_codec import (
    E4M3_MAX,
    FLT_MAX,
    RCP_6,
    RCP_2688,
    block_scale_values,
    e2m1_values,
    fp4_codes_reference,
    global_scales_reference,
    random_bytes_reference,
)
from ._triton import FastLaunch, cdiv, int_key, ptr_key, tl, triton, triton_available
from .hadamard import TE_SIGN_MASK, rht16_reference
from .nvfp4_cols import quantize_columnwise, rht_amax

__all__ = [
    "AMAX_CONFIG",
    "CAST_CONFIG",
    "FP4_BLOCK",
    "VALUES_CONFIG",
    "NVFP4Spec",
    "check_shape",
    "compute_amax",
    "compute_amax_reference",
    "dequantize",
    "dequantize_values",
    "dequantize_values_reference",
    "fp4_transpose",
    "quantize",
    "quantize_reference",
    "scale_shape",
    "tensor_factor",
]

FP4_BLOCK = 16
SCALE_ROW_ALIGN, SCALE_COL_ALIGN = 128, 4
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Tiles (BLOCK_M, BLOCK_K, num_warps), powers of two, multiples of 16: the rowwise copy, the
# amax without the transform, dequantize_values (the columnwise copy: nvfp4_cols.COLS_CONFIG).
# Each the fastest of benchmarks/nvfp4_cast.py's sweep on an H200 (8192 x 8192 bf16).
CAST_CONFIG = (16, 256, 4)
AMAX_CONFIG = (32, 256, 4)
VALUES_CONFIG = (32, 256, 8)


@dataclass(frozen=True, slots=True)
class NVFP4Spec:
    """How quantize writes NVFP4: which copies, the RHT of the columnwise copy (with the sign
    mask of hadamard.py), 16 x 16 blocks, stochastic rounding."""

    rowwise: bool = True
    columnwise: bool = True
    rht: bool = False
    two_d: bool = False
    stochastic: bool = False
    sign_mask: int = TE_SIGN_MASK


if triton is not None:
    from ._fp4_codec import (
        _block_scales,
        _e2m1_value,
        _e4m3_value,
        _fp4_rn,
        _fp4_sr,
        _global_scales,
        _nonnan_abs,
        _random_bytes,
    )
    from ._fp8_codec import _abs_bits

    @triton.jit
    def _encode_rows(
        v, row0, col0, M, K, amax_ptr, rng_ptr, data_ptr, scale_ptr, scale_stride,
        TWO_D: tl.constexpr, STOCHASTIC: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """Rowwise NVFP4 of the tile v (BLOCK_M, BLOCK_K) fp32 at (row0, col0): data bytes and
        scales stored."""
        NB: tl.constexpr = BLOCK_K // 16
        a = _nonnan_abs(v)
        if TWO_D:
            tile = tl.max(tl.max(tl.reshape(a, (BLOCK_M // 16, 16, NB, 16)), axis=3), axis=1)
            tile = tl.broadcast_to(tile[:, None, :], (BLOCK_M // 16, 16, NB))
            block_amax = tl.reshape(tile, (BLOCK_M, NB))
        else:
            block_amax = tl.max(tl.reshape(a, (BLOCK_M, NB, 16)), axis=2)
        s_enc, s_dec = _global_scales(tl.load(amax_ptr))
        code_s, encode = _block_scales(block_amax, s_enc, s_dec)
        y = tl.reshape(v, (BLOCK_M, NB, 16)) * encode[:, :, None]
        rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        blocks = col0 // 16 + tl.arange(0, NB)
        if STOCHASTIC:
            index = rows[:, None] * (K // 16) + blocks[None, :]
            q = _fp4_sr(y, _random_bytes(rng_ptr, index))
        else:
            q = _fp4_rn(y)
        lo, hi = tl.split(tl.reshape(q, (BLOCK_M, BLOCK_K // 2, 2)))
        byte_cols = col0 // 2 + tl.arange(0, BLOCK_K // 2)
        mask = (rows < M)[:, None] & (byte_cols < K // 2)[None, :]
        offs = rows[:, None] * (K // 2) + byte_cols[None, :]
        tl.store(data_ptr + offs, (lo | (hi << 4)).to(tl.uint8), mask=mask)
        mask = (rows < M)[:, None] & (blocks < K // 16)[None, :]
        offs = rows[:, None] * scale_stride + blocks[None, :]
        tl.store(scale_ptr + offs, code_s.to(tl.uint8), mask=mask)

    @triton.jit
    def _load_tile(x_ptr, row0, col0, M, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        """The fp32 tile (BLOCK_M, BLOCK_K) of x (M, K) at (row0, col0), zero outside."""
        rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = col0 + tl.arange(0, BLOCK_K)
        mask = (rows < M)[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0)
        return x.to(tl.float32)

    @triton.jit
    def _nvfp4_rows_kernel(
        x_ptr,  # (M, K) fp32 / bf16 / fp16, contiguous
        amax_ptr,  # (2,) fp32: [0] the rowwise per-tensor amax
        rng_ptr,  # (2,) int64: Philox seed, counter offset (read when STOCHASTIC)
        data_ptr,  # (M, K/2) uint8 rowwise codes
        scale_ptr,  # (round_up(M, 128), round_up(K/16, 4)) uint8 E4M3 rowwise scales
        M,
        K,
        scale_stride,
        TWO_D: tl.constexpr,
        STOCHASTIC: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        row0 = tl.program_id(0) * BLOCK_M
        col0 = tl.program_id(1) * BLOCK_K
        v = _load_tile(x_ptr, row0, col0, M, K, BLOCK_M, BLOCK_K)
        _encode_rows(
            v, row0, col0, M, K, amax_ptr, rng_ptr, data_ptr, scale_ptr, scale_stride,
            TWO_D, STOCHASTIC, BLOCK_M, BLOCK_K,
        )  # fmt: skip

    @triton.jit
    def _nvfp4_amax_kernel(
        x_ptr,  # (M, K) fp32 / bf16 / fp16, contiguous
        amax_ptr,  # (2,) fp32, zeroed: max-accumulated as int32 bits (no NaN reaches it)
        M,
        K,
        BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        row0 = tl.program_id(0) * BLOCK_M
        col0 = tl.program_id(1) * BLOCK_K
        v = _load_tile(x_ptr, row0, col0, M, K, BLOCK_M, BLOCK_K)
        bits = tl.max(_abs_bits(_nonnan_abs(v)))
        amax_bits = amax_ptr.to(tl.pointer_type(tl.int32))
        tl.atomic_max(amax_bits, bits, sem="relaxed")
        tl.atomic_max(amax_bits + 1, bits, sem="relaxed")

    @triton.jit
    def _nvfp4_values_kernel(
        data_ptr,  # (R, C/2) uint8 E2M1 codes
        scale_ptr,  # (>= R, >= C/16) uint8 E4M3 block scales, row stride scale_stride
        out_ptr,  # (R, C) bf16 / fp32: code value * block scale
        R,
        C,
        scale_stride,
        BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        col0 = tl.program_id(1) * BLOCK_C
        byte_cols = col0 // 2 + tl.arange(0, BLOCK_C // 2)
        mask = (rows < R)[:, None] & (byte_cols < C // 2)[None, :]
        offs = rows[:, None] * (C // 2) + byte_cols[None, :]
        byte = tl.load(data_ptr + offs, mask=mask, other=0).to(tl.int32)
        codes = tl.reshape(tl.join(byte & 15, byte >> 4), (BLOCK_R, BLOCK_C))
        blocks = col0 // 16 + tl.arange(0, BLOCK_C // 16)
        mask = (rows < R)[:, None] & (blocks < C // 16)[None, :]
        offs = rows[:, None] * scale_stride + blocks[None, :]
        scale = _e4m3_value(tl.load(scale_ptr + offs, mask=mask, other=0).to(tl.int32))
        values = tl.reshape(_e2m1_value(codes), (BLOCK_R, BLOCK_C // 16, 16))
        out = tl.reshape(values * scale[:, :, None], (BLOCK_R, BLOCK_C))
        cols = col0 + tl.arange(0, BLOCK_C)
        mask = (rows < R)[:, None] & (cols < C)[None, :]
        tl.store(
            out_ptr + rows[:, None] * C + cols[None, :], out.to(out_ptr.dtype.element_ty), mask
        )


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


if triton is not None:
    _launch_rows = FastLaunch(_nvfp4_rows_kernel)
    _launch_amax = FastLaunch(_nvfp4_amax_kernel)
    _launch_values = FastLaunch(_nvfp4_values_kernel)


def check_shape(x: torch.Tensor) -> None:
    """ValueError unless x is 2-D (M, K) with M and K multiples of 16; TypeError unless its
    dtype is fp32 / bf16 / fp16."""
    if x.dim() != 2:
        raise ValueError(f"NVFP4 quantization takes a 2-D x (M, K), got shape {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"NVFP4 quantization takes fp32, bf16 or fp16 input, got {x.dtype}")
    for name, size in (("rows M", x.shape[0]), ("last dimension K", x.shape[1])):
        if size % FP4_BLOCK:
            raise ValueError(
                f"NVFP4 needs the {name} divisible by its block of {FP4_BLOCK}: got {size} "
                f"(x of shape {tuple(x.shape)})"
            )


def scale_shape(rows: int, cols: int) -> tuple[int, int]:
    """Shape of the E4M3 scales of an NVFP4 copy of (rows, cols) in blocks of 16 along cols:
    (round_up(rows, 128), round_up(cols / 16, 4)), Transformer Engine's padding."""
    return round_up(rows, SCALE_ROW_ALIGN), round_up(cols // FP4_BLOCK, SCALE_COL_ALIGN)


def _outputs(rows: int, cols: int, device, wanted: bool):
    """(data (rows, cols/2) uint8, zeroed scales) of one copy, or (None, None)."""
    if not wanted:
        return None, None
    data = torch.empty(rows, cols // 2, dtype=torch.uint8, device=device)
    return data, torch.zeros(scale_shape(rows, cols), dtype=torch.uint8, device=device)


def compute_amax(x: torch.Tensor, spec: NVFP4Spec) -> torch.Tensor:
    """(2,) fp32 per-tensor amaxes of x (M, K): rowwise max |x|; columnwise max |RHT(x)| with
    spec.rht and spec.columnwise (the transform in x's dtype), else max |x|. NaN skipped; 0 for
    an empty x."""
    check_shape(x)
    if not (x.is_cuda and triton_available() and x.numel() > 0):
        return compute_amax_reference(x, spec)
    return _amax_triton(x, spec)


def _amax_triton(x: torch.Tensor, spec: NVFP4Spec) -> torch.Tensor:
    """compute_amax's kernels on x (M, K), M, K > 0: nvfp4_cols.rht_amax for a columnwise copy
    with the transform, else _nvfp4_amax_kernel (both amaxes max |x|)."""
    x = x.contiguous()
    if spec.rht and spec.columnwise:
        return rht_amax(x, spec.sign_mask)
    rows, cols = x.shape
    block_m, block_k, num_warps = AMAX_CONFIG
    amax = torch.zeros(2, dtype=torch.float32, device=x.device)
    grid = (cdiv(rows, block_m), cdiv(cols, block_k), 1)
    key = (x.dtype, AMAX_CONFIG, *int_key(rows), *int_key(cols), *ptr_key(x, amax))
    _launch_amax(key, grid, num_warps, x, amax, rows, cols, block_m, block_k)
    return amax


def quantize(
    x: torch.Tensor, amax: torch.Tensor, spec: NVFP4Spec, rng: torch.Tensor | None = None
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """NVFP4 of x (M, K) with per-tensor amaxes amax (2,) fp32 (compute_amax, reduced over
    ranks if need be), as spec says; rng (2,) int64 (Philox seed, offset) for stochastic
    rounding. Returns (data (M, K/2), scales, data_t (K, M/2), scales_t), None where not asked
    for (module docstring for layouts)."""
    check_shape(x)
    if spec.stochastic and (rng is None or rng.shape != (2,) or rng.dtype != torch.int64):
        raise ValueError("stochastic rounding needs rng: a (2,) int64 tensor (seed, offset)")
    if not (x.is_cuda and triton_available() and x.numel() > 0):
        return quantize_reference(x, amax, spec, rng)
    return _quantize_triton(x, amax, spec, rng)


def _quantize_triton(x, amax, spec, rng):
    """The copies of x (M, K), M, K > 0 (quantize's arguments, checked): the rowwise one by
    _nvfp4_rows_kernel, the columnwise one by nvfp4_cols.quantize_columnwise."""
    x = x.contiguous()
    rows, cols = x.shape
    data, scale = _outputs(rows, cols, x.device, spec.rowwise)
    data_t, scale_t = _outputs(cols, rows, x.device, spec.columnwise)
    if spec.rowwise:
        rng_in = amax if rng is None else rng  # read only when stochastic
        block_m, block_k, num_warps = CAST_CONFIG
        grid = (cdiv(rows, block_m), cdiv(cols, block_k), 1)
        stride = scale.stride(0)
        flags = (spec.two_d, spec.stochastic)
        key = (x.dtype, *flags, CAST_CONFIG, *int_key(rows), *int_key(cols), *int_key(stride))
        key += ptr_key(x, amax, rng_in, data, scale)
        _launch_rows(
            key, grid, num_warps, x, amax, rng_in, data, scale, rows, cols, stride, *flags,
            block_m, block_k,
        )  # fmt: skip
    if spec.columnwise:
        quantize_columnwise(x, amax, spec, rng, data_t, scale_t)
    return data, scale, data_t, scale_t


def dequantize_values(
    data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """The (R, C) GEMM operand of an NVFP4 copy, data (R, C/2) uint8 with scales (>= R,
    >= C/16) uint8: E2M1 value * E4M3 block scale, exact in bf16 (no per-tensor factor)."""
    if not (data.is_cuda and triton_available() and data.numel() > 0):
        return dequantize_values_reference(data, scale, dtype)
    return _values_triton(data, scale, dtype)


def _values_triton(data, scale, dtype):
    """Launch _nvfp4_values_kernel on data (R, C/2), R, C > 0."""
    data = data.contiguous()
    rows, cols = data.shape[0], data.shape[1] * 2
    out = torch.empty(rows, cols, dtype=dtype, device=data.device)
    block_r, block_c, num_warps = VALUES_CONFIG
    grid = (cdiv(rows, block_r), cdiv(cols, block_c), 1)
    stride = scale.stride(0)
    key = (dtype, VALUES_CONFIG, *int_key(rows), *int_key(cols), *int_key(stride))
    key += ptr_key(data, scale, out)
    _launch_values(key, grid, num_warps, data, scale, out, rows, cols, stride, block_r, block_c)
    return out


def tensor_factor(amax: torch.Tensor) -> torch.Tensor:
    """(1,) fp32 per-tensor decode factor of an NVFP4 copy with per-tensor amax (1,):
    amax * fp32(1 / 2688), Transformer Engine's dequantize factor; value = operand * factor."""
    return amax.float() * RCP_2688  # an fp32 product: RCP_2688 is an fp32 value


# ----------------------------------------------------------------------------------------------
# Torch reference: the same bytes, used on CPU and in tests
# ----------------------------------------------------------------------------------------------


def _block_amax_reference(v: torch.Tensor, two_d: bool) -> torch.Tensor:
    """(R, C/16) fp32 block amaxes of v (R, C), NaN skipped: 1 x 16 blocks, or 16 x 16 tiles
    repeated on each of their rows."""
    rows, cols = v.shape
    a = torch.where(torch.isnan(v), 0.0, v.abs())
    if two_d:
        tiles = a.reshape(rows // 16, 16, cols // 16, 16).amax(dim=(1, 3))
        return tiles.repeat_interleave(16, dim=0)
    return a.reshape(rows, cols // 16, 16).amax(dim=2)


def _encode_reference(
    v: torch.Tensor, amax: torch.Tensor, two_d: bool, rbits: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One NVFP4 copy of v (R, C) fp32 in blocks along C: (data (R, C/2) uint8, scales
    scale_shape(R, C) uint8)."""
    rows, cols = v.shape
    s_enc, s_dec = global_scales_reference(amax)
    s = _block_amax_reference(v, two_d) * (s_enc * RCP_6)  # fp32 products (RCP_6 is fp32)
    s = torch.where(s < FLT_MAX, s, FLT_MAX).clamp(max=E4M3_MAX)
    code_s = s.to(torch.float8_e4m3fn)
    encode = torch.ones_like(s) / (code_s.float() * s_dec)
    encode = torch.where(encode < FLT_MAX, encode, FLT_MAX)
    y = v.reshape(rows, cols // 16, 16) * encode[:, :, None]
    q = fp4_codes_reference(y, rbits).reshape(rows, cols // 2, 2)
    data = (q[:, :, 0] | (q[:, :, 1] << 4)).to(torch.uint8)
    scales = torch.zeros(scale_shape(rows, cols), dtype=torch.uint8, device=v.device)
    scales[:rows, : cols // 16] = code_s.view(torch.uint8)
    return data, scales


def compute_amax_reference(x: torch.Tensor, spec: NVFP4Spec) -> torch.Tensor:
    """Torch reference of compute_amax."""
    check_shape(x)
    amax = torch.zeros(2, dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return amax
    v = x.float()
    amax[0] = torch.where(torch.isnan(v), 0.0, v.abs()).max()
    if spec.rht and spec.columnwise:
        w = rht16_reference(v, spec.sign_mask).to(x.dtype).float()
        amax[1] = torch.where(torch.isnan(w), 0.0, w.abs()).max()
    else:
        amax[1] = amax[0]
    return amax


def quantize_reference(
    x: torch.Tensor, amax: torch.Tensor, spec: NVFP4Spec, rng: torch.Tensor | None = None
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Torch reference of quantize."""
    check_shape(x)
    rows, cols = x.shape
    v = x.float()
    blocks = rows * cols // 16
    data = scale = data_t = scale_t = None
    if spec.rowwise:
        rbits = None
        if spec.stochastic:
            rbits = random_bytes_reference(rng, 0, blocks).reshape(rows, cols // 16, 16)
        data, scale = _encode_reference(v, amax[0:1], spec.two_d, rbits)
    if spec.columnwise:
        if spec.rht:
            v = rht16_reference(v, spec.sign_mask).to(x.dtype).float()
        rbits = None
        if spec.stochastic:
            rbits = random_bytes_reference(rng, blocks, blocks).reshape(cols, rows // 16, 16)
        data_t, scale_t = _encode_reference(v.t(), amax[1:2], spec.two_d, rbits)
    return data, scale, data_t, scale_t


def dequantize_values_reference(
    data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Torch reference of dequantize_values."""
    rows, cols = data.shape[0], data.shape[1] * 2
    return (e2m1_values(data) * block_scale_values(scale, rows, cols)).to(dtype)


def dequantize(
    data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The values (R, C) in `dtype` of an NVFP4 copy (data (R, C/2), scales, per-tensor amax
    (1,)), as Transformer Engine's dequantize computes them: code value * ((block scale *
    amax) * fp32(1 / 2688)) in fp32, rounded to dtype."""
    rows, cols = data.shape[0], data.shape[1] * 2
    final = block_scale_values(scale, rows, cols) * amax.float() * RCP_2688
    return (e2m1_values(data) * final).to(dtype)


def fp4_transpose(data: torch.Tensor) -> torch.Tensor:
    """The FP4 codes of data (R, C/2) uint8 transposed: (C, R/2) uint8, R even (a nibble
    transpose; exact)."""
    rows, cols = data.shape[0], data.shape[1] * 2
    codes = torch.stack((data & 15, data >> 4), dim=-1).reshape(rows, cols)
    pairs = codes.t().reshape(cols, rows // 2, 2)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).contiguous()
