"""MXFP8 cast and dequantize (kernels/mxfp8_cast.py): the torch reference against an fp64 model
of Transformer Engine's formula, byte for byte and code for code (CPU), and the Triton kernels
against the reference under Triton's CPU interpreter.

The fp64 model shares nothing with the reference: the E8M0 code is ceil(log2(v)) + 127 clamped
to [0, 254] (v = amax * fp32(1 / fp8_max) rounded once to fp32, the block amax ignoring NaN),
which is Transformer Engine's "exponent bits, rounded up if the mantissa is not zero" stated
arithmetically; FP8 bytes come from a table of every FP8 value, searched and rounded to nearest
even; FP8 values are decoded from their bits. Inputs are small integers times powers of two, so
every product is exact and ties between FP8 neighbours occur.
"""

from __future__ import annotations

import math

import pytest
import torch
from interpreter import requires_interpreter, run_under_interpreter

from torchte._sizes import round_up
from torchte.kernels import mxfp8_cast as mx

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
HP_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
MAX_CODE = {torch.float8_e4m3fn: 0x7E, torch.float8_e5m2: 0x7B}  # the largest finite magnitude


# ----------------------------------------------------------------------------------------------
# The fp64 model
# ----------------------------------------------------------------------------------------------


def fp8_table(fp8_dtype: torch.dtype) -> torch.Tensor:
    """float64 magnitude of every FP8 code 0..127 (NaN where the code is NaN, inf for inf)."""
    mant_bits, bias = (3, 7) if fp8_dtype == torch.float8_e4m3fn else (2, 15)
    values = []
    for code in range(128):
        exp, mant = code >> mant_bits, code & ((1 << mant_bits) - 1)
        if exp == 0:
            values.append(math.ldexp(mant / (1 << mant_bits), 1 - bias))
        else:
            values.append(math.ldexp(1 + mant / (1 << mant_bits), exp - bias))
    if fp8_dtype == torch.float8_e4m3fn:
        values[0x7F] = math.nan
    else:
        values[0x7C] = math.inf
        values[0x7D:] = [math.nan] * 3
    return torch.tensor(values, dtype=torch.float64)


def fp8_bytes_model(y: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """FP8 bytes (uint8) of float64 y: saturated to the largest finite value, rounded to
    nearest even, the sign bit y's; NaN as 0x7F whatever its sign."""
    table = fp8_table(fp8_dtype)[: MAX_CODE[fp8_dtype] + 1]
    mag = y.abs().clamp_max(table[-1].item()).nan_to_num(0.0)
    lo = torch.searchsorted(table, mag, right=True) - 1  # table[lo] <= mag
    hi = (lo + 1).clamp_max(len(table) - 1)
    d_lo, d_hi = mag - table[lo], table[hi] - mag
    code = torch.where((d_hi < d_lo) | ((d_hi == d_lo) & (lo % 2 == 1)), hi, lo)
    code = code | (torch.signbit(y).long() << 7)
    return torch.where(torch.isnan(y), 0x7F, code).to(torch.uint8)


def fp8_values_model(data: torch.Tensor) -> torch.Tensor:
    """float64 values of FP8 data, decoded from its bits."""
    bits = data.view(torch.uint8).long()
    mag = fp8_table(data.dtype)[bits & 0x7F]
    return torch.where(bits >= 0x80, -mag, mag)


def e8m0_model(amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """E8M0 codes (int64) of float64 block amaxes: the power of two at or above
    v = fp32(amax * fp32(1 / fp8_max)), as 127 + its exponent, within [0, 254]."""
    rcp = torch.tensor(1.0 / FP8_MAX[fp8_dtype], dtype=torch.float64).float().double()
    v = (amax * rcp).float().double()  # the fp64 product is exact: one rounding, to fp32
    mant, exp = torch.frexp(v)  # v = mant * 2**exp, mant in [0.5, 1)
    ceil_log2 = torch.where(mant == 0.5, exp - 1, exp).long()
    code = (ceil_log2 + 127).clamp(0, 254)
    code = torch.where(v == 0, 0, code)
    return torch.where(torch.isinf(v), 254, code)


def block_amax_model(x: torch.Tensor, two_d: bool):
    """float64 block amaxes of x (M, K), NaN ignored: (rowwise (M, K/32), columnwise (M/32,
    K)), each 32x32 block's amax at its rows / columns when two_d."""
    rows, cols = x.shape
    mag = x.double().abs().nan_to_num(nan=0.0, posinf=math.inf)
    blocks = mag.reshape(rows // 32, 32, cols // 32, 32)
    if two_d:
        amax = blocks.amax(dim=(1, 3))
        return amax.repeat_interleave(32, 0), amax.repeat_interleave(32, 1)
    return blocks.amax(dim=3).reshape(rows, cols // 32), blocks.amax(dim=1).reshape(-1, cols)


def quantize_model(x: torch.Tensor, fp8_dtype: torch.dtype, two_d: bool = False):
    """(rowwise bytes (M, K), rowwise codes (M, K/32), columnwise bytes (M, K), columnwise
    codes (M/32, K)) of the fp64 model, scales unpadded."""
    amax_r, amax_c = block_amax_model(x, two_d)
    code_r, code_c = e8m0_model(amax_r, fp8_dtype), e8m0_model(amax_c, fp8_dtype)
    x64 = x.double()
    mult_r = torch.pow(2.0, (127 - code_r).double()).repeat_interleave(32, 1)
    mult_c = torch.pow(2.0, (127 - code_c).double()).repeat_interleave(32, 0)
    data_r = fp8_bytes_model(x64 * mult_r, fp8_dtype)
    data_c = fp8_bytes_model(x64 * mult_c, fp8_dtype)
    return data_r, code_r.to(torch.uint8), data_c, code_c.to(torch.uint8)


def assert_matches_model(out, x, fp8_dtype, two_d=False):
    """The outputs of mxfp8_quantize(x, fp8_dtype, True, True, two_d) equal the model's: the
    bytes, the codes, and zero scale padding in Transformer Engine's padded shapes."""
    rows, cols = x.shape
    data, scale, data_c, scale_c = out
    want = quantize_model(x, fp8_dtype, two_d)
    assert data.dtype == data_c.dtype == fp8_dtype
    assert scale.shape == (round_up(rows, 128), round_up(cols // 32, 4))
    assert scale_c.shape == (round_up(rows // 32, 4), round_up(cols, 128))
    assert torch.equal(data.view(torch.uint8), want[0])
    assert torch.equal(data_c.view(torch.uint8), want[2])
    assert torch.equal(scale[:rows, : cols // 32], want[1])
    assert torch.equal(scale_c[: rows // 32, :cols], want[3])
    assert scale.sum() == scale[:rows, : cols // 32].sum()  # padding zero
    assert scale_c.sum() == scale_c[: rows // 32, :cols].sum()


def grid_input(shape, dtype, seed, spread=24) -> torch.Tensor:
    """k * 2**e, |k| < 256, e = a per-(32x32)-block offset in [-spread, spread] minus 0..3 per
    value: exact in every input dtype, block scales that differ widely."""
    gen = torch.Generator().manual_seed(seed)
    rows, cols = shape
    k = torch.randint(-255, 256, shape, generator=gen).double()
    if dtype == torch.float16:  # keep within fp16 (subnormals included): e in [-22, 7]
        block = torch.randint(-19, 8, (rows // 32 + 1, cols // 32 + 1), generator=gen)
    else:
        block = torch.randint(-spread, spread + 1, (rows // 32 + 1, cols // 32 + 1), generator=gen)
    e = block.repeat_interleave(32, 0)[:rows].repeat_interleave(32, 1)[:, :cols]
    e = e - torch.randint(0, 4, shape, generator=gen)
    return (k * torch.pow(2.0, e.double())).to(dtype)


# ----------------------------------------------------------------------------------------------
# The model itself
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_model_follows_te_rounding_of_the_scale(fp8_dtype):
    fp8_max = FP8_MAX[fp8_dtype]
    amax = torch.tensor([0.0, fp8_max, fp8_max * 2.0**-40, fp8_max * 1.5, 1e-45, math.inf, 3e38])
    codes = e8m0_model(amax.double(), fp8_dtype).tolist()
    # 0 -> 0; amax = fp8_max * 2**k -> 127 + k; above -> rounded up; tiny -> 0; inf -> 254.
    assert codes[:5] == [0, 127, 87, 128, 0]
    assert codes[5] == 254 and 127 < codes[6] < 254
    table = fp8_table(fp8_dtype)
    assert table[MAX_CODE[fp8_dtype]].item() == fp8_max
    mid = (table[1 : MAX_CODE[fp8_dtype] + 1] + table[: MAX_CODE[fp8_dtype]]) / 2
    assert torch.equal(fp8_bytes_model(mid, fp8_dtype).long() % 2, torch.zeros(len(mid)).long())


# ----------------------------------------------------------------------------------------------
# The reference against the model
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("two_d", [False, True])
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", [(32, 32), (96, 160), (160, 96), (288, 64)])
def test_reference_matches_model(shape, fp8_dtype, dtype, two_d):
    x = grid_input(shape, dtype, seed=sum(shape))
    out = mx.mxfp8_quantize_reference(x, fp8_dtype, True, True, two_d)
    assert_matches_model(out, x, fp8_dtype, two_d)
    assert torch.equal(mx.mxfp8_quantize(x, fp8_dtype, True, True, two_d)[0], out[0])


def f32_next(value: float, toward: float) -> float:
    """The fp32 neighbour of fp32 `value` in the direction of `toward` (+1.0 or -1.0)."""
    v = torch.tensor(value, dtype=torch.float32)
    return v.nextafter(torch.tensor(math.copysign(math.inf, toward))).item()


def special_input(fp8_dtype) -> torch.Tensor:
    """(64, 128) fp32: each 1x32 row block (and 32x1 column block) a special case."""
    fp8_max = FP8_MAX[fp8_dtype]
    x = grid_input((64, 128), torch.float32, seed=3, spread=0)  # |x| < 256 but below
    x[0:32, 0:32] = 0.0  # a zero 32x32 block
    x[1, 32:64] = -0.0
    x[2, 33] = math.nan  # NaN among values: ignored by the amax, NaN byte
    x[3, 32:64] = math.nan  # all NaN: amax 0
    x[4, 40] = math.inf  # inf: code 254, saturated to the largest FP8 value
    x[5, 41] = -math.inf
    x[6, 32:64] = 1e-40  # fp32 subnormals
    x[7, 32:64] = torch.linspace(-3e38, 3e38, 32)  # near the fp32 maximum
    x[8, 32:64] = fp8_max * 2.0**-20  # amax = fp8_max * 2**k exactly: the largest FP8 byte
    x[9, 32] = f32_next(fp8_max * 4, -1.0)  # just below: the code stays
    x[10, 32] = f32_next(fp8_max * 8, 1.0)  # just above: the next power of two
    x[32:64, 96] = math.nan  # an all-NaN column block, and one with inf
    x[40, 97] = math.inf
    x[33, 64:96] = torch.tensor(2.0**-133).float()  # bf16's smallest subnormal
    return x


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_reference_special_blocks(fp8_dtype):
    x = special_input(fp8_dtype)
    for dtype in (torch.bfloat16, torch.float32):
        xd = x.to(dtype)
        out = mx.mxfp8_quantize_reference(xd, fp8_dtype, True, True)
        assert_matches_model(out, xd, fp8_dtype)
        assert_matches_model(mx.mxfp8_quantize_reference(xd, fp8_dtype, True, True, True), xd,
                             fp8_dtype, True)  # fmt: skip
    # The fp32 input's bytes, case by case (bf16 would round some of these inputs).
    data, scale, data_c, scale_c = (t.view(torch.uint8) for t in out)
    top = MAX_CODE[fp8_dtype]
    assert scale[0, 0] == 0 and (data[:32, :32] == 0).all()  # zero block: code 0, zero bytes
    assert (data[1, 32:64] == 0x80).all()  # -0.0 keeps its sign
    assert data[2, 33] == 0x7F and scale[2, 1] > 0  # NaN byte; the amax of the rest
    assert scale[3, 1] == 0 and (data[3, 32:64] == 0x7F).all()
    assert scale[4, 1] == 254 and data[4, 40] == top and data[5, 41] == 0x80 | top
    assert scale_c[1, 97] == 254 and data_c[40, 97] == top and scale_c[1, 96] == 0
    assert data[8, 32] == top and scale[8, 1] == 127 - 20  # amax exactly fp8_max * 2**-20
    assert scale[9, 1] == 129 and data[9, 32] == top  # rounds up to fp8_max, within range
    assert scale[10, 1] == 131  # a hair above fp8_max * 8: the next power of two
    assert scale[6, 1] == 0 and data[6, 32] != 0  # subnormals scaled up, not flushed


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_single_usage_and_zero_rows(fp8_dtype):
    x = grid_input((64, 96), torch.bfloat16, seed=5)
    both = mx.mxfp8_quantize_reference(x, fp8_dtype, True, True)
    rowwise = mx.mxfp8_quantize_reference(x, fp8_dtype, True, False)
    columnwise = mx.mxfp8_quantize_reference(x, fp8_dtype, False, True)
    assert rowwise[2] is None and rowwise[3] is None
    assert columnwise[0] is None and columnwise[1] is None
    assert torch.equal(rowwise[1], both[1]) and torch.equal(columnwise[3], both[3])
    assert not torch.equal(both[0].view(torch.uint8), both[2].view(torch.uint8))
    empty = mx.mxfp8_quantize(torch.zeros(0, 64), fp8_dtype, True, True)
    shapes = [tuple(t.shape) for t in empty]
    assert shapes == [(0, 64), (0, 4), (0, 64), (0, 128)]


def test_scale_shape_is_te_padding():
    for rows, cols in [(32, 32), (128, 128), (160, 4128), (4096, 96)]:
        assert mx.scale_shape(rows, cols, False) == (round_up(rows, 128), round_up(cols // 32, 4))
        assert mx.scale_shape(rows, cols, True) == (round_up(rows // 32, 4), round_up(cols, 128))
    assert mx.scale_shape(160, 4128, False) == (256, 132)
    assert mx.scale_shape(160, 4128, True) == (8, 4224)


# ----------------------------------------------------------------------------------------------
# Dequantize
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_dequantize_is_exact(fp8_dtype):
    x = grid_input((96, 128), torch.float32, seed=7, spread=12)
    data, scale, data_c, scale_c = mx.mxfp8_quantize(x, fp8_dtype, True, True)
    for rowwise, d, s in [(True, data, scale), (False, data_c, scale_c)]:
        codes = s[:96, :4] if rowwise else s[:3, :128]
        codes = codes.repeat_interleave(32, 1 if rowwise else 0).double()
        want = fp8_values_model(d) * torch.pow(2.0, codes - 127)
        for dtype in HP_DTYPES:
            got = mx.mxfp8_dequantize(d, s, rowwise, dtype)
            assert got.dtype == dtype and got.shape == (96, 128)
            assert torch.equal(got, want.to(dtype))  # one rounding, from the exact value
            if dtype != torch.float16:  # exact in fp32 and bf16 (fp16's range is narrower)
                assert torch.equal(got.double(), want)
    # The values are close to x (half an FP8 step of the block's scale).
    y = mx.mxfp8_dequantize(data, scale, True, torch.float32)
    assert ((y - x).abs() <= x.abs().amax() * 2.0**-3).all()


def test_dequantize_extreme_codes():
    """Code 0 is 2**-127 (not 0) and code 255 NaN (not inf), as in Transformer Engine."""
    data = torch.full((32, 64), 56, dtype=torch.uint8).view(torch.float8_e4m3fn)  # 1.0
    scale = torch.full((128, 4), 127, dtype=torch.uint8)
    scale[0, 0], scale[1, 0], scale[2, 1] = 0, 255, 254
    y = mx.mxfp8_dequantize(data, scale, True, torch.float32)
    assert (y[0, :32] == 2.0**-127).all() and torch.isnan(y[1, :32]).all()
    assert (y[2, 32:] == 2.0**127).all() and (y[3] == 1.0).all()
    assert torch.isinf(mx.mxfp8_dequantize(data, scale, True, torch.bfloat16)[2, 32:]).sum() == 0


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------


def test_bad_input():
    e4m3 = torch.float8_e4m3fn
    with pytest.raises(ValueError, match=r"rows .*33.* block of 32"):
        mx.mxfp8_quantize(torch.zeros(33, 64), e4m3, True, True)
    with pytest.raises(ValueError, match=r"last dimension \(size 48\).* block of 32"):
        mx.mxfp8_quantize(torch.zeros(32, 48), e4m3, True, True)
    with pytest.raises(ValueError, match="2-D"):
        mx.mxfp8_quantize(torch.zeros(64), e4m3, True, True)
    with pytest.raises(TypeError, match="fp32, bf16 or fp16"):
        mx.mxfp8_quantize(torch.zeros(32, 32, dtype=torch.int32), e4m3, True, True)
    with pytest.raises(TypeError, match="fp8_dtype"):
        mx.mxfp8_quantize(torch.zeros(32, 32), torch.float16, True, True)
    with pytest.raises(ValueError, match="at least one"):
        mx.mxfp8_quantize(torch.zeros(32, 32), e4m3, False, False)
    data, scale, _, _ = mx.mxfp8_quantize(torch.ones(64, 64), e4m3, True, False)
    with pytest.raises(ValueError, match="does not cover"):
        mx.mxfp8_dequantize(data, scale[:, :1], True, torch.float32)
    with pytest.raises(TypeError, match="uint8"):
        mx.mxfp8_dequantize(data, scale.float(), True, torch.float32)
    with pytest.raises(TypeError, match="data must be"):
        mx.mxfp8_dequantize(data.view(torch.uint8), scale, True, torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        mx.mxfp8_dequantize(data, scale, True, torch.int32)
    with pytest.raises(ValueError, match=r"last dimension \(size 40\)"):
        mx.check_mxfp8_shape((4, 8, 40))


def test_custom_op_schema_runs():
    """The torch.library op torch.compile traces to runs and gives the reference's bytes."""
    x = grid_input((64, 64), torch.bfloat16, seed=9)
    outputs = torch.ops.torchte.mxfp8_quantize(x, torch.float8_e5m2, True, False)
    ref = mx.mxfp8_quantize_reference(x, torch.float8_e5m2, True, False)
    assert torch.equal(outputs[0].view(torch.uint8), ref[0].view(torch.uint8))
    assert outputs[2].shape == (0,)  # a None output's placeholder
    y = torch.ops.torchte.mxfp8_dequantize(outputs[0], outputs[1], True, torch.float32)
    assert torch.equal(y, mx.mxfp8_dequantize_reference(ref[0], ref[1], True, torch.float32))


# ----------------------------------------------------------------------------------------------
# Triton under the interpreter vs the reference
# ----------------------------------------------------------------------------------------------

INTERPRETER_SCRIPT = """
import math
import torch
from test_kernels_mxfp8 import grid_input, special_input
from torchte.kernels import mxfp8_cast as mx

HP = [torch.float32, torch.bfloat16, torch.float16]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
USAGES = [(True, True), (True, False), (False, True)]

def same(a, b):
    return (a is None and b is None) or torch.equal(a.view(torch.uint8), b.view(torch.uint8))

def check(x, fp8, rowwise, columnwise, two_d, config):
    out = mx._quantize_triton(x, fp8, rowwise, columnwise, two_d, config)
    ref = mx.mxfp8_quantize_reference(x, fp8, rowwise, columnwise, two_d)
    for got, want in zip(out, ref):
        assert same(got, want), (tuple(x.shape), x.dtype, fp8, rowwise, columnwise, two_d, config)
    return out

def check_dequantize(data, scale, rowwise, dtype, config):
    got = mx._dequantize_triton(data, scale, rowwise, dtype, config)
    want = mx.mxfp8_dequantize_reference(data, scale, rowwise, dtype)
    assert torch.equal(got.float().nan_to_num(7.0), want.float().nan_to_num(7.0)), (rowwise, dtype)
    assert torch.equal(torch.isnan(got), torch.isnan(want))

# Shapes that fill, and do not fill, the tiles; the grid covers the scale padding (large tiles
# mostly: the interpreter's time goes with the number of programs).
cases = [((32, 32), (128, 128, 4)), ((96, 160), (64, 128, 4)), ((160, 96), (128, 64, 4)),
         ((64, 288), (128, 128, 4)), ((32, 64), (32, 32, 4))]
n = 0
for shape, config in cases:
    for dtype in HP[: 2 if shape == (32, 64) else 3]:
        fp8 = FP8[n % 2]
        rowwise, columnwise = USAGES[n % 3]
        x = grid_input(shape, dtype, seed=n)
        out = check(x, fp8, rowwise, columnwise, n % 4 == 1, config)
        if rowwise:
            check_dequantize(out[0], out[1], True, HP[(n + 1) % 3], (64, 32, 4))
        if columnwise:
            check_dequantize(out[2], out[3], False, HP[n % 3], (32, 64, 4))
        n += 1
for fp8 in FP8:
    x = special_input(fp8)
    for dtype, two_d in [(torch.float32, False), (torch.bfloat16, True)]:
        out = check(x.to(dtype), fp8, True, True, two_d, (64, 128, 4))
    check_dequantize(out[0], out[1], True, torch.bfloat16, (32, 128, 4))
    check_dequantize(out[2], out[3], False, torch.float32, (64, 32, 4))
# Every code 0..255 and every FP8 byte through dequantize.
data = torch.arange(256, dtype=torch.uint8).repeat(32, 1).view(torch.float8_e4m3fn)
scale = torch.zeros(128, 8, dtype=torch.uint8)
scale[:32] = torch.arange(256, dtype=torch.uint8).reshape(32, 8)
for fp8 in FP8:
    for dtype in HP:
        check_dequantize(data.view(fp8), scale, True, dtype, (32, 64, 4))
print("ok")
"""


@requires_interpreter
def test_triton_kernels_in_interpreter_match_reference():
    run_under_interpreter(INTERPRETER_SCRIPT)
