"""NVFP4's columnwise copy (x^T in blocks of 16 along M, optionally of the random Hadamard
transform of x) and the per-tensor amaxes with the transform, on the GPU.

A program holds each group of 16 rows of its tile as 16 separate tensors (BLOCK_G groups x
BLOCK_K columns each). A columnwise block is the 16 values of one column in one group, so the
block's amax, the transform (hadamard._wht16) and the encoding are elementwise work on each
thread's own values, and a block's eight code bytes leave as one 64-bit store into the
columnwise data (K, M/2).

The bytes are those of nvfp4_cast.quantize_reference / compute_amax_reference (layouts, scales,
codes, random bytes: nvfp4_cast.py's docstring); nvfp4_cast.quantize and compute_amax launch
these kernels on CUDA.
"""

from __future__ import annotations

import torch

from ._triton import FastLaunch, cdiv, int_key, ptr_key, tl, triton

__all__ = ["COLS_CONFIG", "quantize_columnwise", "rht_amax"]

# Tile (BLOCK_G groups of 16 rows, BLOCK_K columns, num_warps): the fastest of
# benchmarks/nvfp4_cast.py's sweep on an H200 for the copy without the transform, within 5% of
# the fastest for the other cases.
COLS_CONFIG = (4, 64, 4)

if triton is not None:
    from ._fp4_codec import _block_scales, _fp4_rn, _fp4_sr, _global_scales, _nonnan_abs
    from ._fp8_codec import _abs_bits, _round_as
    from .hadamard import _rht_value, _signed, _wht16

    @triton.jit
    def _group_row(x_ptr, groups, cols, M, K, ROW: tl.constexpr):
        """(BLOCK_G, BLOCK_K) fp32: row ROW of each group of 16 rows in `groups` (int64), at
        columns `cols`; zero outside x."""
        rows = groups * 16 + ROW
        mask = (rows < M)[:, None] & (cols < K)[None, :]
        v = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0)
        return v.to(tl.float32)

    @triton.jit
    def _group_rows(x_ptr, groups, cols, M, K):
        """The 16 rows of each group (_group_row for rows 0..15)."""
        return (
            _group_row(x_ptr, groups, cols, M, K, 0), _group_row(x_ptr, groups, cols, M, K, 1),
            _group_row(x_ptr, groups, cols, M, K, 2), _group_row(x_ptr, groups, cols, M, K, 3),
            _group_row(x_ptr, groups, cols, M, K, 4), _group_row(x_ptr, groups, cols, M, K, 5),
            _group_row(x_ptr, groups, cols, M, K, 6), _group_row(x_ptr, groups, cols, M, K, 7),
            _group_row(x_ptr, groups, cols, M, K, 8), _group_row(x_ptr, groups, cols, M, K, 9),
            _group_row(x_ptr, groups, cols, M, K, 10), _group_row(x_ptr, groups, cols, M, K, 11),
            _group_row(x_ptr, groups, cols, M, K, 12), _group_row(x_ptr, groups, cols, M, K, 13),
            _group_row(x_ptr, groups, cols, M, K, 14), _group_row(x_ptr, groups, cols, M, K, 15),
        )  # fmt: skip

    @triton.jit
    def _rht_in(v, SIGN_MASK: tl.constexpr, ROW: tl.constexpr):
        """Row ROW of a group as the butterfly takes it: float64, times its sign."""
        return _signed(v.to(tl.float64), SIGN_MASK, ROW)

    @triton.jit
    def _rht_out(t, x_ptr):
        """A butterfly output row -> the transform's value rounded to x's dtype (in fp32)."""
        return _round_as(_rht_value(t), x_ptr)

    @triton.jit
    def _rht_group(
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15, x_ptr,
        SIGN_MASK: tl.constexpr,
    ):  # fmt: skip
        """The transform of a group's 16 rows (hadamard.py): signs, butterfly in float64, 1/4,
        fp32, rounded to x's dtype, as rht16_reference(...).to(x.dtype) computes it."""
        t = _wht16(
            _rht_in(v0, SIGN_MASK, 0), _rht_in(v1, SIGN_MASK, 1), _rht_in(v2, SIGN_MASK, 2),
            _rht_in(v3, SIGN_MASK, 3), _rht_in(v4, SIGN_MASK, 4), _rht_in(v5, SIGN_MASK, 5),
            _rht_in(v6, SIGN_MASK, 6), _rht_in(v7, SIGN_MASK, 7), _rht_in(v8, SIGN_MASK, 8),
            _rht_in(v9, SIGN_MASK, 9), _rht_in(v10, SIGN_MASK, 10), _rht_in(v11, SIGN_MASK, 11),
            _rht_in(v12, SIGN_MASK, 12), _rht_in(v13, SIGN_MASK, 13),
            _rht_in(v14, SIGN_MASK, 14), _rht_in(v15, SIGN_MASK, 15),
        )  # fmt: skip
        return (
            _rht_out(t[0], x_ptr), _rht_out(t[1], x_ptr), _rht_out(t[2], x_ptr),
            _rht_out(t[3], x_ptr), _rht_out(t[4], x_ptr), _rht_out(t[5], x_ptr),
            _rht_out(t[6], x_ptr), _rht_out(t[7], x_ptr), _rht_out(t[8], x_ptr),
            _rht_out(t[9], x_ptr), _rht_out(t[10], x_ptr), _rht_out(t[11], x_ptr),
            _rht_out(t[12], x_ptr), _rht_out(t[13], x_ptr), _rht_out(t[14], x_ptr),
            _rht_out(t[15], x_ptr),
        )  # fmt: skip

    @triton.jit
    def _group_amax(v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15):
        """Elementwise max |v| over the 16 rows, NaN skipped."""
        a = tl.maximum(_nonnan_abs(v0), _nonnan_abs(v1))
        a = tl.maximum(a, tl.maximum(_nonnan_abs(v2), _nonnan_abs(v3)))
        a = tl.maximum(a, tl.maximum(_nonnan_abs(v4), _nonnan_abs(v5)))
        a = tl.maximum(a, tl.maximum(_nonnan_abs(v6), _nonnan_abs(v7)))
        a = tl.maximum(a, tl.maximum(_nonnan_abs(v8), _nonnan_abs(v9)))
        a = tl.maximum(a, tl.maximum(_nonnan_abs(v10), _nonnan_abs(v11)))
        a = tl.maximum(a, tl.maximum(_nonnan_abs(v12), _nonnan_abs(v13)))
        return tl.maximum(a, tl.maximum(_nonnan_abs(v14), _nonnan_abs(v15)))

    @triton.jit
    def _random_byte(r0, r1, r2, r3, ROW: tl.constexpr):
        """The random byte (int32 0..255) of value ROW of a block, from its Philox words:
        byte ROW % 4 of word ROW // 4 (_fp4_codec._random_bytes' order)."""
        word = r0
        if ROW // 4 == 1:
            word = r1
        elif ROW // 4 == 2:
            word = r2
        elif ROW // 4 == 3:
            word = r3
        return ((word >> (8 * (ROW % 4))) & 255).to(tl.int32)

    @triton.jit
    def _nibble(v, encode, r0, r1, r2, r3, ROW: tl.constexpr, STOCHASTIC: tl.constexpr):
        """The E2M1 code of value ROW of each block (v times its block's encode factor),
        shifted to its nibble of the block's 64-bit word (value 2j low, 2j + 1 high in byte j)."""
        y = v * encode
        q = _fp4_sr(y, _random_byte(r0, r1, r2, r3, ROW)) if STOCHASTIC else _fp4_rn(y)
        return q.to(tl.int64) << (4 * ROW)

    @triton.jit
    def _nvfp4_cols_kernel(
        x_ptr,  # (M, K) fp32 / bf16 / fp16, contiguous
        amax_ptr,  # (2,) fp32 per-tensor amaxes; [1] is the columnwise copy's
        rng_ptr,  # (2,) int64 Philox seed, counter offset (read when STOCHASTIC)
        data_t_ptr,  # (K, M/2) uint8 columnwise codes, written as int64 words
        scale_t_ptr,  # (round_up(K, 128), round_up(M/16, 4)) uint8 E4M3 columnwise scales
        M,
        K,
        scale_t_stride,
        RHT: tl.constexpr,
        SIGN_MASK: tl.constexpr,
        TWO_D: tl.constexpr,
        STOCHASTIC: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        groups = (tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        v = _group_rows(x_ptr, groups, cols, M, K)
        if RHT:
            v = _rht_group(*v, x_ptr, SIGN_MASK)
        a = _group_amax(*v)
        if TWO_D:  # one scale per 16 x 16 tile: the max over 16 neighbouring columns too
            tile = tl.max(tl.reshape(a, (BLOCK_G, BLOCK_K // 16, 16)), axis=2)
            tile = tl.broadcast_to(tile[:, :, None], (BLOCK_G, BLOCK_K // 16, 16))
            a = tl.reshape(tile, (BLOCK_G, BLOCK_K))
        s_enc, s_dec = _global_scales(tl.load(amax_ptr + 1))
        code_s, encode = _block_scales(a, s_enc, s_dec)
        if STOCHASTIC:  # block (k, g) of x^T has the random index M*K/16 + k*M/16 + g
            index = (K + cols[None, :]) * (M // 16) + groups[:, None]
            r0, r1, r2, r3 = tl.randint4x(tl.load(rng_ptr), index + tl.load(rng_ptr + 1))
        else:
            r0, r1, r2, r3 = 0, 0, 0, 0
        word = _nibble(v[0], encode, r0, r1, r2, r3, 0, STOCHASTIC)
        word |= _nibble(v[1], encode, r0, r1, r2, r3, 1, STOCHASTIC)
        word |= _nibble(v[2], encode, r0, r1, r2, r3, 2, STOCHASTIC)
        word |= _nibble(v[3], encode, r0, r1, r2, r3, 3, STOCHASTIC)
        word |= _nibble(v[4], encode, r0, r1, r2, r3, 4, STOCHASTIC)
        word |= _nibble(v[5], encode, r0, r1, r2, r3, 5, STOCHASTIC)
        word |= _nibble(v[6], encode, r0, r1, r2, r3, 6, STOCHASTIC)
        word |= _nibble(v[7], encode, r0, r1, r2, r3, 7, STOCHASTIC)
        word |= _nibble(v[8], encode, r0, r1, r2, r3, 8, STOCHASTIC)
        word |= _nibble(v[9], encode, r0, r1, r2, r3, 9, STOCHASTIC)
        word |= _nibble(v[10], encode, r0, r1, r2, r3, 10, STOCHASTIC)
        word |= _nibble(v[11], encode, r0, r1, r2, r3, 11, STOCHASTIC)
        word |= _nibble(v[12], encode, r0, r1, r2, r3, 12, STOCHASTIC)
        word |= _nibble(v[13], encode, r0, r1, r2, r3, 13, STOCHASTIC)
        word |= _nibble(v[14], encode, r0, r1, r2, r3, 14, STOCHASTIC)
        word |= _nibble(v[15], encode, r0, r1, r2, r3, 15, STOCHASTIC)
        mask = (groups < M // 16)[:, None] & (cols < K)[None, :]
        words = data_t_ptr.to(tl.pointer_type(tl.int64))
        tl.store(words + cols[None, :] * (M // 16) + groups[:, None], word, mask=mask)
        offs = cols[None, :] * scale_t_stride + groups[:, None]
        tl.store(scale_t_ptr + offs, code_s.to(tl.uint8), mask=mask)

    @triton.jit
    def _nvfp4_rht_amax_kernel(
        x_ptr,  # (M, K) fp32 / bf16 / fp16, contiguous
        amax_ptr,  # (2,) fp32, zeroed: max-accumulated as int32 bits (no NaN reaches it)
        M,
        K,
        SIGN_MASK: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        groups = (tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        v = _group_rows(x_ptr, groups, cols, M, K)
        amax_bits = amax_ptr.to(tl.pointer_type(tl.int32))
        tl.atomic_max(amax_bits, tl.max(_abs_bits(_group_amax(*v))), sem="relaxed")
        w = _rht_group(*v, x_ptr, SIGN_MASK)
        tl.atomic_max(amax_bits + 1, tl.max(_abs_bits(_group_amax(*w))), sem="relaxed")

    _launch_cols = FastLaunch(_nvfp4_cols_kernel)
    _launch_rht_amax = FastLaunch(_nvfp4_rht_amax_kernel)


def _grid(rows: int, cols: int) -> tuple[int, int, int]:
    block_g, block_k, _ = COLS_CONFIG
    return cdiv(rows // 16, block_g), cdiv(cols, block_k), 1


def quantize_columnwise(x, amax, spec, rng, data_t, scale_t) -> None:
    """Write the columnwise NVFP4 copy of x (M, K) contiguous, M, K > 0 multiples of 16, into
    data_t (K, M/2) uint8 and scale_t (zeroed, TE's padded shape) as spec (nvfp4_cast.NVFP4Spec)
    asks: the transform with spec.rht, 16 x 16 tiles with spec.two_d, stochastic rounding with
    rng (2,) int64; amax (2,) fp32, [1] the copy's per-tensor amax."""
    rows, cols = x.shape
    rng = amax if rng is None else rng  # read only when stochastic
    stride = scale_t.stride(0)
    flags = (spec.rht, spec.sign_mask if spec.rht else 0, spec.two_d, spec.stochastic)
    key = (x.dtype, *flags, COLS_CONFIG, *int_key(rows), *int_key(cols), *int_key(stride))
    key += ptr_key(x, amax, rng, data_t, scale_t)
    block_g, block_k, num_warps = COLS_CONFIG
    _launch_cols(
        key, _grid(rows, cols), num_warps, x, amax, rng, data_t, scale_t, rows, cols, stride,
        *flags, block_g, block_k,
    )  # fmt: skip


def rht_amax(x: torch.Tensor, sign_mask: int) -> torch.Tensor:
    """(2,) fp32: max |x| and max |RHT(x)| (the transform with `sign_mask`, rounded to x's
    dtype), NaN skipped, of x (M, K) contiguous, M, K > 0 multiples of 16."""
    rows, cols = x.shape
    amax = torch.zeros(2, dtype=torch.float32, device=x.device)
    block_g, block_k, num_warps = COLS_CONFIG
    key = (x.dtype, sign_mask, COLS_CONFIG, *int_key(rows), *int_key(cols), *ptr_key(x, amax))
    _launch_rht_amax(
        key, _grid(rows, cols), num_warps, x, amax, rows, cols, sign_mask, block_g, block_k
    )
    return amax
