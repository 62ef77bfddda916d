"""NVFP4 kernels: the torch reference against a float64 model of Transformer Engine's formulas
(exact bytes), the random Hadamard transform, zero / NaN / inf blocks, 2-D blocks, stochastic
rounding, and the Triton kernels against the reference under Triton's CPU interpreter.

The model shares nothing with the reference's conversions: it rounds to fp32 where Transformer
Engine's kernels compute in fp32 (fp64 results of one operation on fp32 values, rounded once,
are the fp32 results), and finds E4M3 and E2M1 codes by searching their value tables.
"""

from __future__ import annotations

import math

import pytest
import torch
from interpreter import requires_interpreter, run_under_interpreter
from tolerances import assert_close

from torchte.kernels import nvfp4_cast as nv
from torchte.kernels._fp4_codec import fp4_codes_reference, philox_reference
from torchte.kernels.hadamard import (
    TE_SIGN_MASK,
    hadamard_matrix,
    rht16_reference,
    sign_mask,
    sign_vector,
)

FLT_MAX = torch.finfo(torch.float32).max
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
HP_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(16, 16), (48, 80), (112, 48), (16, 272)]


# ----------------------------------------------------------------------------------------------
# The float64 model
# ----------------------------------------------------------------------------------------------


def e4m3_table() -> torch.Tensor:
    """float64 value of each non-negative finite E4M3 code 0..126, indexed by the code."""
    values = [
        math.ldexp(code & 7, -9) if code >> 3 == 0 else math.ldexp(8 + (code & 7), (code >> 3) - 10)
        for code in range(127)
    ]
    return torch.tensor(values, dtype=torch.float64)


def nearest_even(mag: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Index into increasing `table` of the value nearest mag >= 0 (ties to the even index),
    saturating at the last one."""
    mag = mag.clamp_max(table[-1].item()).contiguous()
    lo = torch.searchsorted(table, mag, right=True) - 1
    hi = (lo + 1).clamp_max(len(table) - 1)
    d_lo, d_hi = mag - table[lo], table[hi] - mag
    return torch.where((d_hi < d_lo) | ((d_hi == d_lo) & (lo % 2 == 1)), hi, lo)


def f32(t: torch.Tensor | float) -> torch.Tensor:
    """float64 t rounded to fp32, back in float64."""
    return torch.as_tensor(t, dtype=torch.float64).float().double()


def model_copy(v: torch.Tensor, amax: float, two_d: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(data (R, C/2) uint8, scale codes (R, C/16) uint8) of v (R, C) float64 (values exact in
    fp32) with per-tensor amax, Transformer Engine's formulas in fp64 with fp32 roundings."""
    rows, cols = v.shape
    s_enc = f32(2688.0 / amax) if amax > 0 else torch.tensor(math.inf, dtype=torch.float64)
    s_enc = s_enc.clamp_max(FLT_MAX)
    if amax == 0 or s_enc == 0:
        s_enc = torch.tensor(1.0, dtype=torch.float64)
    s_dec = f32(1.0 / s_enc)
    a = torch.where(torch.isnan(v), 0.0, v.abs())
    if two_d:
        tiles = a.reshape(rows // 16, 16, cols // 16, 16).amax(dim=(1, 3))
        block_amax = tiles.repeat_interleave(16, dim=0)
    else:
        block_amax = a.reshape(rows, cols // 16, 16).amax(dim=2)
    s = f32(block_amax * f32(s_enc * f32(1.0 / 6.0))).clamp_max(FLT_MAX).clamp_max(448.0)
    table = e4m3_table()
    code_s = nearest_even(s, table)
    encode = f32(1.0 / f32(table[code_s] * s_dec)).clamp_max(FLT_MAX)
    y = f32(v.reshape(rows, cols // 16, 16) * encode[:, :, None]).reshape(rows, cols)
    nan = torch.isnan(y)
    code = torch.where(nan, 7, nearest_even(torch.where(nan, 0.0, y.abs()), E2M1))
    code = code | ((torch.signbit(y) & ~nan).long() << 3)
    data = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)
    return data, code_s.to(torch.uint8)


def model_rht(v: torch.Tensor, mask: int) -> torch.Tensor:
    """The transform of v (M, N) float64 along M by a float64 matrix product, rounded to fp32."""
    rows, cols = v.shape
    groups = v.reshape(rows // 16, 16, cols)
    out = torch.einsum("grn,rc->gcn", groups, hadamard_matrix(mask)).reshape(rows, cols)
    return f32(out)


def nonnan_amax(v: torch.Tensor) -> float:
    return torch.where(torch.isnan(v), 0.0, v.double().abs()).max().item()


def grid_input(shape, dtype, seed: int) -> torch.Tensor:
    """Values k * 2**e (|k| < 128, e in [-10, 2]), exact in every input dtype; a few zeros."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randint(-127, 128, shape, generator=gen).double()
    e = torch.randint(-10, 3, shape, generator=gen).double()
    x = k * torch.pow(2.0, e)
    x.view(-1)[::37] = 0.0
    return x.to(dtype)


def check_copy(data, scale, v64, amax, two_d, rows, cols, msg):
    """A copy's bytes and its zero-padded scales against the model."""
    want_data, want_scale = model_copy(v64, amax, two_d)
    assert torch.equal(data, want_data), msg
    assert scale.shape == nv.scale_shape(rows, cols), msg
    assert torch.equal(scale[:rows, : cols // 16], want_scale), msg
    padded = scale.clone()
    padded[:rows, : cols // 16] = 0
    assert not padded.any(), msg


# ----------------------------------------------------------------------------------------------
# The model itself; the reference against it
# ----------------------------------------------------------------------------------------------


def test_model_tables_round_to_nearest_even():
    assert e4m3_table()[-1].item() == 448.0 and e4m3_table()[1].item() == 2.0**-9
    mid = (E2M1[1:] + E2M1[:-1]) / 2  # ties go to the even code
    assert nearest_even(mid, E2M1).tolist() == [0, 2, 2, 4, 4, 6, 6]
    assert nearest_even(torch.tensor([7.0, 1e9], dtype=torch.float64), E2M1).tolist() == [7, 7]


def test_reference_codes_ties_specials():
    y = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, -0.1, -0.0, math.nan, -math.inf])
    assert fp4_codes_reference(y, None).tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 8, 8, 7, 15]


@pytest.mark.parametrize("two_d", [False, True], ids=["1x16", "16x16"])
@pytest.mark.parametrize("dtype", HP_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_reference_matches_fp64_model(shape, dtype, two_d):
    x = grid_input(shape, dtype, seed=sum(shape))
    spec = nv.NVFP4Spec(two_d=two_d)
    amax = nv.compute_amax(x, spec)
    assert amax.tolist() == [nonnan_amax(x)] * 2
    data, scale, data_t, scale_t = nv.quantize(x, amax, spec)
    rows, cols = shape
    assert data.shape == (rows, cols // 2) and data_t.shape == (cols, rows // 2)
    v64 = x.double()
    check_copy(data, scale, v64, amax[0].item(), two_d, rows, cols, "rowwise")
    check_copy(data_t, scale_t, v64.t(), amax[1].item(), two_d, cols, rows, "columnwise")


@pytest.mark.parametrize("rowwise, columnwise", [(True, False), (False, True)])
def test_one_copy_only(rowwise, columnwise):
    x = grid_input((48, 32), torch.bfloat16, seed=3)
    spec = nv.NVFP4Spec(rowwise=rowwise, columnwise=columnwise)
    both = nv.quantize(x, nv.compute_amax(x, nv.NVFP4Spec()), nv.NVFP4Spec())
    one = nv.quantize(x, nv.compute_amax(x, spec), spec)
    for got, want, wanted in zip(
        one, both, (rowwise, rowwise, columnwise, columnwise), strict=True
    ):
        assert (got is None) == (not wanted)
        assert got is None or torch.equal(got, want)


def test_scale_codes_and_saturation_against_model():
    """Block amaxes across E4M3's range: subnormal scales, saturation at 448, blocks whose
    scale rounds to zero (values saturate at 6, scale 0)."""
    exps = torch.arange(-40, 24, dtype=torch.float64)
    block_max = torch.pow(2.0, exps) * 1.37
    x = torch.rand(64, 16, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    x = f32((x * 2 - 1) * block_max[:, None])
    x[:, 0] = block_max
    x = x.reshape(16, 64).float()
    amax = nv.compute_amax(x, nv.NVFP4Spec())
    data, scale, data_t, scale_t = nv.quantize(x, amax, nv.NVFP4Spec())
    check_copy(data, scale, x.double(), amax[0].item(), False, 16, 64, "rowwise")
    check_copy(data_t, scale_t, x.double().t(), amax[1].item(), False, 64, 16, "columnwise")
    assert (scale == 0).any() and (scale == 0x7E).any()  # both ends reached


def test_zero_nan_inf_blocks():
    x = grid_input((32, 48), torch.float32, seed=11)
    x[0:1, 0:16] = 0.0  # a zero block: scale 0, codes 0
    x[1, 16:32] = -0.0  # negative zeros keep their sign
    x[2, 5] = math.nan  # skipped by the amaxes; coded +6
    spec = nv.NVFP4Spec()
    amax = nv.compute_amax(x, spec)
    assert amax[0].item() == nonnan_amax(x)
    data, scale, data_t, scale_t = nv.quantize(x, amax, spec)
    check_copy(data, scale, x.double(), amax[0].item(), False, 32, 48, "rowwise")
    check_copy(data_t, scale_t, x.double().t(), amax[1].item(), False, 48, 32, "columnwise")
    assert scale[0, 0] == 0 and not data[0, :8].any()
    assert (data[1, 8:16] == 0x88).all()
    assert (data[2, 2] >> 4) == 7  # column 5: the high nibble of byte 2
    x[3, 7] = -math.inf  # amax inf: S_enc 1; the block scale saturates at 448
    amax = nv.compute_amax(x, spec)
    assert amax[0].item() == math.inf
    data, scale, *_ = nv.quantize(x, amax, spec)
    check_copy(data, scale, x.double(), math.inf, False, 32, 48, "rowwise, inf")
    assert scale[3, 0] == 0x7E and (data[3, 3] >> 4) == 15
    zeros = torch.zeros(16, 32)
    amax = nv.compute_amax(zeros, spec)
    out = nv.quantize(zeros, amax, spec)
    assert amax.tolist() == [0.0, 0.0] and not any(t.any() for t in out)


def test_two_d_blocks_give_transposed_copies():
    x = grid_input((48, 80), torch.bfloat16, seed=2)
    spec = nv.NVFP4Spec(two_d=True)
    data, scale, data_t, scale_t = nv.quantize(x, nv.compute_amax(x, spec), spec)
    assert torch.equal(nv.fp4_transpose(data), data_t)
    assert torch.equal(nv.fp4_transpose(data_t), data)
    tiles = scale[:48, :5].reshape(3, 16, 5)
    assert (tiles == tiles[:, :1]).all()  # one scale per tile, on each of its rows
    assert torch.equal(scale_t[:80, :3], tiles[:, 0].t().repeat_interleave(16, 0))


# ----------------------------------------------------------------------------------------------
# The random Hadamard transform
# ----------------------------------------------------------------------------------------------


def sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def test_hadamard_matrix_is_te_signs_times_sylvester_and_orthogonal():
    te_signs = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]
    assert sign_vector(TE_SIGN_MASK).tolist() == te_signs
    assert sign_mask(True) == TE_SIGN_MASK and sign_mask(False) == 0
    for mask in (TE_SIGN_MASK, 0):
        q = hadamard_matrix(mask)
        assert torch.equal(q, torch.diag(sign_vector(mask)) @ sylvester(16) / 4)
        assert torch.equal(q @ q.t(), torch.eye(16, dtype=torch.float64))  # exact in fp64


@pytest.mark.parametrize("mask", [TE_SIGN_MASK, 0])
def test_rht_reference_matches_fp64_product_and_inverts(mask):
    v = grid_input((64, 24), torch.bfloat16, seed=7).float()
    y = rht16_reference(v, mask)
    assert torch.equal(y.double(), model_rht(v.double(), mask))
    back = rht16_reference(y, mask, inverse=True)
    assert_close(back, v, torch.float32)
    assert not torch.signbit(rht16_reference(-torch.zeros(16, 3), mask)).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_rht_columnwise_copy_matches_fp64_model(dtype):
    x = grid_input((48, 32), dtype, seed=9)
    spec = nv.NVFP4Spec(rht=True)
    amax = nv.compute_amax(x, spec)
    w = model_rht(x.double(), TE_SIGN_MASK).to(dtype).double()  # rounded to the input dtype
    assert amax.tolist() == [nonnan_amax(x), nonnan_amax(w)]
    data, scale, data_t, scale_t = nv.quantize(x, amax, spec)
    check_copy(data, scale, x.double(), amax[0].item(), False, 48, 32, "rowwise (no RHT)")
    check_copy(data_t, scale_t, w.t(), amax[1].item(), False, 32, 48, "columnwise (RHT)")


# ----------------------------------------------------------------------------------------------
# Stochastic rounding
# ----------------------------------------------------------------------------------------------


def test_philox_reference_known_answer():
    """Random123's known-answer vector of Philox4x32-10 for key 0, counter 0."""
    words = philox_reference(torch.tensor(0), torch.tensor([0]))[0].tolist()
    assert words == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


def sr_input(rows: int) -> torch.Tensor:
    """(rows, 32) fp32: row 0 holds 2688 (so S_enc = 1), every other row the same values, block
    maxima 6 (encode factor 1): values y on a grid of step / 256, for which the rounding is
    exactly unbiased."""
    gen = torch.Generator().manual_seed(4)
    y = torch.randint(-1536, 1537, (32,), generator=gen).float() / 256  # |y| <= 6
    y = torch.where(y.abs() >= 4, torch.round(y * 128) / 128, y)  # step 2 there: 2/256
    y[0], y[16] = 6.0, -6.0
    x = y.repeat(rows, 1)
    x[0, 1] = 2688.0
    return x


def test_stochastic_rounding_unbiased():
    """Mean of N = 4095 independent roundings of each value within 4 standard errors of the
    value (sigma^2 = step^2 f (1 - f), f the value's fraction between its grid neighbours);
    each rounding one of the two neighbours."""
    x = sr_input(4096)
    spec = nv.NVFP4Spec(stochastic=True)
    amax = nv.compute_amax(x, spec)
    rng = torch.tensor([2024, 7], dtype=torch.int64)
    data, scale, *_ = nv.quantize(x, amax, spec, rng)
    assert (scale[1:4096, :2].view(torch.float8_e4m3fn).float() == 1.0).all()  # encode 1
    codes = torch.stack((data & 15, data >> 4), -1).reshape(4096, 32)[1:].long()
    values = torch.cat([E2M1, -E2M1])[codes]
    y = x[1].double()
    lo = E2M1[nearest_lower(y.abs())]
    hi = E2M1[(nearest_lower(y.abs()) + 1).clamp_max(7)]
    step = hi - lo
    frac = torch.where(step > 0, (y.abs() - lo) / step.clamp_min(1e-30), 0.0)
    assert ((values.abs() == lo) | (values.abs() == hi)).all()
    std_err = step * torch.sqrt(frac * (1 - frac)) / math.sqrt(values.shape[0])
    assert ((values.mean(0) - y).abs() <= 4 * std_err + 1e-12).all()
    assert (frac > 0).sum() > 20  # the test rounds many values that are off the grid


def nearest_lower(a: torch.Tensor) -> torch.Tensor:
    """Index of the largest E2M1 magnitude <= a."""
    return torch.searchsorted(E2M1, a, right=True) - 1


def test_stochastic_rounding_reproducible_with_the_seed():
    x = grid_input((32, 48), torch.bfloat16, seed=1)
    spec = nv.NVFP4Spec(stochastic=True, rht=True)
    amax = nv.compute_amax(x, spec)
    rng = torch.tensor([99, 5], dtype=torch.int64)
    first = nv.quantize(x, amax, spec, rng)
    again = nv.quantize(x, amax, spec, rng.clone())
    other = nv.quantize(x, amax, spec, torch.tensor([100, 5], dtype=torch.int64))
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], other[0]) and not torch.equal(first[2], other[2])
    nearest = nv.quantize(x, amax, nv.NVFP4Spec(rht=True))
    assert torch.equal(first[1], nearest[1])  # the scales do not depend on the rounding


# ----------------------------------------------------------------------------------------------
# Dequantizing; bad input
# ----------------------------------------------------------------------------------------------


def test_dequantize_values_are_exact_products():
    x = grid_input((48, 64), torch.float32, seed=8)
    data, scale, *_ = nv.quantize(x, nv.compute_amax(x, nv.NVFP4Spec()), nv.NVFP4Spec())
    codes = torch.stack((data & 15, data >> 4), -1).reshape(48, 64).long()
    e2m1 = torch.cat([E2M1, -E2M1])[codes]
    block = e4m3_table()[scale[:48, :4].long()].repeat_interleave(16, 1)
    values = nv.dequantize_values(data, scale)
    assert values.dtype == torch.bfloat16 and torch.equal(values.double(), e2m1 * block)
    amax = nv.compute_amax(x, nv.NVFP4Spec())[0:1]
    final = f32(f32(block * amax.item()) * f32(1 / 2688))  # TE's (scale * amax) * (1 / 2688)
    dq = nv.dequantize(data, scale, amax, torch.float32)
    assert torch.equal(dq.double(), f32(e2m1 * final))
    assert torch.equal(nv.tensor_factor(amax).double(), f32(amax.double() * f32(1 / 2688)))


def test_bad_input():
    spec = nv.NVFP4Spec()
    with pytest.raises(ValueError, match=r"last dimension K.*16: got 40"):
        nv.compute_amax(torch.zeros(16, 40), spec)
    with pytest.raises(ValueError, match=r"rows M.*16: got 24"):
        nv.quantize(torch.zeros(24, 32), torch.zeros(2), spec)
    with pytest.raises(TypeError, match="fp32, bf16 or fp16"):
        nv.quantize(torch.zeros(16, 32, dtype=torch.int32), torch.zeros(2), spec)
    with pytest.raises(ValueError, match="2-D"):
        nv.compute_amax(torch.zeros(2, 16, 32), spec)
    with pytest.raises(ValueError, match="rng"):
        nv.quantize(torch.zeros(16, 32), torch.zeros(2), nv.NVFP4Spec(stochastic=True))


def test_empty_input():
    x = torch.zeros(0, 32)
    amax = nv.compute_amax(x, nv.NVFP4Spec())
    data, scale, data_t, scale_t = nv.quantize(x, amax, nv.NVFP4Spec())
    assert amax.tolist() == [0.0, 0.0] and data.shape == (0, 16) and data_t.shape == (32, 0)
    assert scale.shape == (0, 4) and scale_t.shape == (128, 0)


# ----------------------------------------------------------------------------------------------
# Triton kernels under the interpreter
# ----------------------------------------------------------------------------------------------

INTERPRETER_SCRIPT = """
import math
import torch
from torchte.kernels import nvfp4_cast as nv
from torchte.kernels._fp4_codec import philox_reference

def check(x, spec, rng):
    amax_ref = nv.compute_amax_reference(x, spec)
    amax = nv._amax_triton(x, spec)
    assert torch.equal(amax, amax_ref), (x.shape, x.dtype, spec, amax, amax_ref)
    ref = nv.quantize_reference(x, amax, spec, rng)
    out = nv._quantize_triton(x, amax, spec, rng)
    for got, want in zip(out, ref):
        assert (got is None) == (want is None), spec
        if got is not None:
            assert torch.equal(got, want), (x.shape, x.dtype, spec, (got != want).nonzero()[:4])
    if out[0] is not None:
        for dtype in (torch.bfloat16, torch.float32):
            got = nv._values_triton(out[0], out[1], dtype)
            assert torch.equal(got, nv.dequantize_values_reference(out[0], out[1], dtype)), spec

def special_input(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * 3
    x.view(-1)[::7] *= 1e-3
    x.view(-1)[::13] *= 300
    x.view(-1)[::29] = 0.0
    x[:16, :16] = 0.0
    x.view(-1)[5::31] = -0.0
    return x.to(dtype)

# Philox: tl.randint4x against the reference, 64-bit seeds and counters.
import triton, triton.language as tl
@triton.jit
def philox_kernel(rng_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N).to(tl.int64) + tl.load(rng_ptr + 1)
    r0, r1, r2, r3 = tl.randint4x(tl.load(rng_ptr), i)
    base = tl.arange(0, N) * 4
    tl.store(out_ptr + base, r0.to(tl.int32, bitcast=True))
    tl.store(out_ptr + base + 1, r1.to(tl.int32, bitcast=True))
    tl.store(out_ptr + base + 2, r2.to(tl.int32, bitcast=True))
    tl.store(out_ptr + base + 3, r3.to(tl.int32, bitcast=True))

rng = torch.tensor([0x123456789ABCDEF, (1 << 32) - 5], dtype=torch.int64)
words = torch.zeros(16, 4, dtype=torch.int32)
philox_kernel[(1,)](rng, words, 16)
want = philox_reference(rng[0], torch.arange(16, dtype=torch.int64) + rng[1])
assert torch.equal(words, want.to(torch.int32))

S = nv.NVFP4Spec
SPECS = [S(), S(rht=True), S(two_d=True), S(stochastic=True), S(rht=True, stochastic=True),
         S(two_d=True, stochastic=True, rht=True, sign_mask=0), S(rowwise=False),
         S(columnwise=False, stochastic=True), S(rowwise=False, rht=True)]
rng = torch.tensor([31337, 2**40 + 3], dtype=torch.int64)
SHAPES = [(48, 80), (16, 16), (112, 48), (80, 144)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
for k, spec in enumerate(SPECS):
    check(special_input((48, 80), DTYPES[k % 3], k), spec, rng)
    check(special_input(SHAPES[1 + k % 3], DTYPES[(k + 1) % 3], k), spec, rng)
x = special_input((32, 48), torch.float32, 1)
x[3, 7], x[20, 40], x[9, 1] = math.nan, -math.inf, math.inf
for spec in [S(), S(rht=True), S(two_d=True, stochastic=True)]:
    check(x.bfloat16(), spec, rng)
check(torch.zeros(32, 64), S(rht=True), rng)
print("ok")
"""


@requires_interpreter
def test_triton_kernels_in_interpreter_match_reference():
    run_under_interpreter(INTERPRETER_SCRIPT)
