"""The FP4 (E2M1) and E4M3-scale codec of the NVFP4 kernels (nvfp4_cast.py): Triton device
functions and their torch references, which give the same codes and bits.

Scales (Transformer Engine's core_nvfp4.cuh, quantize_transpose_nvfp4.cuh), fp32 with IEEE
rounding, from a per-tensor amax and a block amax:
  S_enc = min(448 * 6 / amax, FLT_MAX), 1 where amax is 0 or S_enc is 0;  S_dec = 1 / S_enc
  scale = e4m3(min(block_amax * (S_enc * fp32(1/6)), FLT_MAX))  (nearest even, saturating)
  encode = min(1 / (float(scale) * S_dec), FLT_MAX)
Values y = x * encode become E2M1 codes (4 bits: sign, 2 exponent bits, 1 mantissa bit; values
0, 0.5, 1, 1.5, 2, 3, 4, 6): nearest, ties to even, saturating at +-6, NaN -> +6 (the
satfinite conversion), the sign kept on zero; or stochastically: Transformer Engine's software
rounding (ptx::stochastic_round_fp4_e2m1, its path for GPUs without cvt.rs) with 8 random bits
r per value: t = |y| + r / 256 * step(|y|), floored onto the grid, at most 6.

Random bits: Philox4x32-10 as tl.randint4x computes it, keyed by rng[0], counter rng[1] + the
index of a block of 16 values; one call gives the block's 16 bytes (value j: byte j % 4 of word
j // 4). philox_reference is the same generator in torch (int64 arithmetic).

Codes come from comparisons and integer arithmetic (E4M3 through _fp8_codec's encoder), never
from Triton's float conversions, which the CPU interpreter mis-rounds.
"""

from __future__ import annotations

import torch

from ._triton import tl, triton

__all__ = [
    "E4M3_MAX",
    "FLT_MAX",
    "FP4_MAX",
    "RCP_6",
    "RCP_2688",
    "block_scale_values",
    "e2m1_values",
    "fp4_codes_reference",
    "global_scales_reference",
    "philox_reference",
    "random_bytes_reference",
]

FP4_MAX = 6.0
E4M3_MAX = 448.0
FLT_MAX = 3.4028234663852886e38
RCP_6 = 0.1666666716337204  # fp32(1 / 6), Transformer Engine's fp4_max_inv
RCP_2688 = 3.7202381528913975e-04  # fp32(1 / (6 * 448)), its dequantize factor_inv

if triton is not None:
    # Constants as the Triton functions see them (globals there must be constexpr).
    _FLT_MAX = tl.constexpr(FLT_MAX)
    _RCP_6 = tl.constexpr(RCP_6)
    _E4M3_MAX = tl.constexpr(E4M3_MAX)

    from ._fp8_codec import _fp8_code

    @triton.jit
    def _global_scales(amax):
        """(S_enc, S_dec) fp32 scalars of a per-tensor amax (module docstring)."""
        s_enc = tl.math.div_rn(tl.full((), 2688.0, tl.float32), amax)
        s_enc = tl.where(s_enc < _FLT_MAX, s_enc, _FLT_MAX)  # fminf: inf and NaN -> FLT_MAX
        s_enc = tl.where((amax == 0.0) | (s_enc == 0.0), 1.0, s_enc)
        return s_enc, tl.math.div_rn(tl.full((), 1.0, tl.float32), s_enc)

    @triton.jit
    def _e4m3_value(code):
        """fp32 value of E4M3 bytes (int32 0..255), exactly."""
        exp = (code >> 3) & 15
        mant = code & 7
        normal = (((exp + 120) << 23) | (mant << 20)).to(tl.float32, bitcast=True)
        value = tl.where(exp == 0, mant.to(tl.float32) * 0.001953125, normal)
        value = tl.where((code & 127) == 127, float("nan"), value)
        return tl.where((code & 128) != 0, -value, value)

    @triton.jit
    def _e2m1_value(code):
        """fp32 value of E2M1 codes (int32 0..15), exactly."""
        mag = code & 7
        exp = mag >> 1
        mant = (mag & 1).to(tl.float32)
        unit = tl.where(exp == 1, 0.5, tl.where(exp == 2, 1.0, 2.0))
        value = tl.where(exp == 0, mant * 0.5, (2.0 + mant) * unit)
        return tl.where((code & 8) != 0, -value, value)

    @triton.jit
    def _block_scales(block_amax, s_enc, s_dec):
        """(E4M3 scale codes int32, fp32 encode factors) of fp32 block amaxes."""
        s = block_amax * (s_enc * _RCP_6)
        s = tl.where(s < _FLT_MAX, s, _FLT_MAX)
        code = _fp8_code(tl.where(s > _E4M3_MAX, _E4M3_MAX, s), 448.0)
        encode = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), _e4m3_value(code) * s_dec)
        return code, tl.where(encode < _FLT_MAX, encode, _FLT_MAX)

    @triton.jit
    def _fp4_magnitude(a):
        """E2M1 magnitude code (int32 0..7) of |y| = a >= 0: nearest, ties to even, >= 6 -> 7."""
        code = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
        code += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
        return code + (a > 5.0).to(tl.int32)

    @triton.jit
    def _fp4_sign(y):
        """8 where fp32 y has its sign bit set (-0 included) and is not NaN, else 0."""
        sign = (y.to(tl.int32, bitcast=True) >> 28) & 8
        return tl.where(y == y, sign, 0)

    @triton.jit
    def _fp4_rn(y):
        """E2M1 codes (int32 0..15) of fp32 y, round to nearest even, saturating; NaN -> +6."""
        code = tl.where(y == y, _fp4_magnitude(tl.abs(y)), 7)
        return code | _fp4_sign(y)

    @triton.jit
    def _fp4_sr(y, rbits):
        """E2M1 codes of fp32 y rounded stochastically with random bytes rbits (int32 0..255)
        (module docstring); NaN -> +6."""
        a = tl.abs(y)
        step = tl.where(a >= 4.0, 2.0, tl.where(a >= 2.0, 1.0, 0.5))
        t = a + rbits.to(tl.float32) * 0.00390625 * step
        step_t = tl.where(t >= 4.0, 2.0, tl.where(t >= 2.0, 1.0, 0.5))
        inv_step_t = tl.where(t >= 4.0, 0.5, tl.where(t >= 2.0, 1.0, 2.0))
        q = tl.floor(t * inv_step_t) * step_t
        q = tl.where(q < 6.0, q, 6.0)  # fminf: NaN -> 6
        return _fp4_magnitude(q) | _fp4_sign(y)

    @triton.jit
    def _random_bytes(rng_ptr, blocks):
        """(A, B, 16) int32 random bytes of the blocks of 16 values with indices `blocks`
        (A, B) int64: Philox keyed by rng[0], counter rng[1] + index (module docstring)."""
        seed = tl.load(rng_ptr)
        r0, r1, r2, r3 = tl.randint4x(seed, blocks + tl.load(rng_ptr + 1))
        j = tl.arange(0, 16)[None, None, :]
        word = tl.where(j < 4, r0[:, :, None], r1[:, :, None])
        word = tl.where(j < 8, word, r2[:, :, None])
        word = tl.where(j < 12, word, r3[:, :, None])
        return ((word >> ((j % 4) * 8).to(tl.uint32)) & 255).to(tl.int32)

    @triton.jit
    def _nonnan_abs(v):
        return tl.where(v == v, tl.abs(v), 0.0)


# ----------------------------------------------------------------------------------------------
# Torch references
# ----------------------------------------------------------------------------------------------

_U32 = 0xFFFFFFFF


def _mulhilo(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of a * b, a (int64 holding uint32) and b < 2**32, without
    overflowing int64."""
    low_half = (a & 0xFFFF) * b
    mid = (a >> 16) * b + (low_half >> 16)
    return mid >> 16, ((mid & 0xFFFF) << 16) | (low_half & 0xFFFF)


def philox_reference(seed: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Philox4x32-10 as tl.randint4x computes it: key = seed (int64 scalar tensor, split in two
    32-bit words), counter = (low, high 32 bits of counters (int64), 0, 0). Returns (..., 4)
    int64 holding the four uint32 words."""
    c0, c1 = counters & _U32, (counters >> 32) & _U32
    c2 = c3 = torch.zeros_like(c0)
    k0, k1 = seed & _U32, (seed >> 32) & _U32
    for _ in range(10):
        hi_b, lo_b = _mulhilo(c2, 0xCD9E8D57)
        hi_a, lo_a = _mulhilo(c0, 0xD2511F53)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + 0x9E3779B9) & _U32, (k1 + 0xBB67AE85) & _U32
    return torch.stack((c0, c1, c2, c3), dim=-1)


def random_bytes_reference(rng: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """(count, 16) int64 random bytes of blocks first .. first + count - 1 (_random_bytes)."""
    counters = torch.arange(first, first + count, dtype=torch.int64, device=rng.device) + rng[1]
    words = philox_reference(rng[0], counters)
    shifts = torch.arange(0, 32, 8, dtype=torch.int64, device=rng.device)
    return ((words[:, :, None] >> shifts) & 255).reshape(count, 16)


def global_scales_reference(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(S_enc, S_dec) (1,) fp32 of a per-tensor amax (1,) (module docstring)."""
    amax = amax.float()
    s_enc = torch.full_like(amax, 2688.0) / amax
    s_enc = torch.where(s_enc < FLT_MAX, s_enc, FLT_MAX)
    s_enc = torch.where((amax == 0) | (s_enc == 0), 1.0, s_enc)
    return s_enc, torch.ones_like(s_enc) / s_enc


def _fp4_magnitude_reference(a: torch.Tensor) -> torch.Tensor:
    code = (a > 0.25).long() + (a >= 0.75).long() + (a > 1.25).long() + (a >= 1.75).long()
    return code + (a > 2.5).long() + (a >= 3.5).long() + (a > 5.0).long()


def fp4_codes_reference(y: torch.Tensor, rbits: torch.Tensor | None) -> torch.Tensor:
    """E2M1 codes (int64 0..15) of fp32 y: nearest even (rbits None) or stochastic with random
    bytes rbits (int64 0..255, y's shape)."""
    nan = torch.isnan(y)
    a = y.abs()
    if rbits is None:
        magnitude = torch.where(nan, 7, _fp4_magnitude_reference(a))
    else:
        step = torch.where(a >= 4.0, 2.0, torch.where(a >= 2.0, 1.0, 0.5))
        t = a + rbits.float() * 0.00390625 * step
        step_t = torch.where(t >= 4.0, 2.0, torch.where(t >= 2.0, 1.0, 0.5))
        inv_step_t = torch.where(t >= 4.0, 0.5, torch.where(t >= 2.0, 1.0, 2.0))
        q = torch.floor(t * inv_step_t) * step_t
        magnitude = _fp4_magnitude_reference(torch.where(q < 6.0, q, 6.0))
    return magnitude | ((torch.signbit(y) & ~nan).long() << 3)


def e2m1_values(data: torch.Tensor) -> torch.Tensor:
    """(R, C) fp32 E2M1 values of data (R, C/2) uint8 (low nibble first)."""
    codes = torch.stack((data & 15, data >> 4), dim=-1).reshape(data.shape[0], data.shape[1] * 2)
    codes = codes.to(torch.int32)
    exp, mant = (codes >> 1) & 3, (codes & 1).float()
    value = torch.where(exp == 0, mant * 0.5, (mant + 2.0) * torch.exp2(exp.float() - 2.0))
    return torch.where(codes >= 8, -value, value)


def block_scale_values(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """(rows, cols) fp32 E4M3 block scales of scale (>= rows, >= cols/16) uint8, each
    repeated over its 16 values."""
    blocks = scale[:rows, : cols // 16].contiguous().view(torch.float8_e4m3fn).float()
    return blocks.repeat_interleave(16, dim=1)
