"""FP8 cast + transpose + amax: the torch reference against an fp64 model (CPU), and the Triton
kernels against the torch reference, byte for byte (GPU).

The fp64 model decodes every FP8 code from its bits and rounds to nearest even by search, so
it shares nothing with torch's conversion. Inputs are drawn from a grid of small integers times
powers of two, so x * scale is exact in fp32 and ties between FP8 neighbours do occur.
"""

from __future__ import annotations

import math

import pytest
import torch
from interpreter import requires_interpreter, run_under_interpreter

from torchte._sizes import round_up
from torchte.kernels import _fp8_codec
from torchte.kernels import cast_transpose as ct
from torchte.kernels._triton import triton_available
from torchte.kernels.cast_spec import CastSpec

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
HP_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FP32_MAX = torch.finfo(torch.float32).max
SHAPES = [(1, 1), (1, 17), (17, 1), (17, 17), (127, 131), (1023, 17), (1500, 7), (16, 1023)]

requires_triton = pytest.mark.skipif(not triton_available(), reason="needs a CUDA GPU and Triton")


# ----------------------------------------------------------------------------------------------
# The fp64 model
# ----------------------------------------------------------------------------------------------


def fp8_magnitudes(fp8_dtype: torch.dtype) -> torch.Tensor:
    """float64 value of every non-negative finite FP8 code, indexed by the code (increasing)."""
    if fp8_dtype == torch.float8_e4m3fn:
        mant_bits, bias, last_code = 3, 7, 0x7E  # 0x7F is NaN; no inf
    else:
        mant_bits, bias, last_code = 2, 15, 0x7B  # 0x7C is inf
    values = []
    for code in range(last_code + 1):
        exp, mant = code >> mant_bits, code & ((1 << mant_bits) - 1)
        if exp == 0:
            values.append(math.ldexp(mant / (1 << mant_bits), 1 - bias))
        else:
            values.append(math.ldexp(1 + mant / (1 << mant_bits), exp - bias))
    return torch.tensor(values, dtype=torch.float64)


def fp8_codes_model(y: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """FP8 bytes (uint8) of float64 y: clamp to the FP8 range, round to nearest, ties to even."""
    table = fp8_magnitudes(fp8_dtype)
    mag = y.abs().clamp_max(table[-1].item())
    lo = torch.searchsorted(table, mag, right=True) - 1  # table[lo] <= mag
    hi = (lo + 1).clamp_max(len(table) - 1)
    d_lo, d_hi = mag - table[lo], table[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (lo % 2 == 1))
    code = torch.where(pick_hi, hi, lo)
    return (code | (torch.signbit(y).long() << 7)).to(torch.uint8)


def grid_input(shape, dtype, seed, max_exp=4, min_exp=-12) -> torch.Tensor:
    """Values k * 2**e (|k| < 256, e in [min_exp, max_exp]): exact in bf16, fp16 and fp32."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randint(-255, 256, shape, generator=gen).double()
    e = torch.randint(min_exp, max_exp + 1, shape, generator=gen).double()
    return (k * torch.pow(2.0, e)).to(dtype)


def model_outputs(x: torch.Tensor, scale: float, fp8_dtype: torch.dtype):
    """(rowwise bytes (M, N), columnwise bytes (N, Mp) zero padded) of the fp64 model."""
    codes = fp8_codes_model(x.double() * scale, fp8_dtype)
    rows, cols = x.shape
    codes_t = torch.zeros((cols, round_up(rows, 16)), dtype=torch.uint8)
    codes_t[:, :rows] = codes.t()
    return codes, codes_t


def f32(value: float) -> float:
    """value rounded to fp32 (division results: the fp64 -> fp32 double rounding is exact)."""
    return torch.tensor(value, dtype=torch.float32).item()


def scale_model(amax: float, fp8_max: float, eps: float, power_2: bool) -> float:
    """compute_scale_reference in fp64 arithmetic."""
    if eps > 0 and not math.isnan(amax):
        amax = max(amax, f32(eps))
    if amax == 0 or not math.isfinite(amax):
        return 1.0
    scale = f32(fp8_max / amax)
    if math.isinf(scale):
        scale = FP32_MAX
    if power_2:
        scale = math.ldexp(1.0, math.frexp(scale)[1] - 1)
    return scale


def u8(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.view(torch.uint8)


# ----------------------------------------------------------------------------------------------
# The model itself
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_model_rounds_to_nearest_even(fp8_dtype):
    table = fp8_magnitudes(fp8_dtype)
    assert table[-1].item() == ct.FP8_MAX[fp8_dtype]
    mid = (table[1:] + table[:-1]) / 2  # ties: to the even code
    codes = fp8_codes_model(mid, fp8_dtype).long()
    assert torch.equal(codes % 2, torch.zeros_like(codes))
    assert fp8_codes_model(torch.tensor([-0.0, 1e9, -1e9]), fp8_dtype).tolist() == [
        0x80,
        len(table) - 1,
        0x80 | (len(table) - 1),
    ]


# ----------------------------------------------------------------------------------------------
# Reference vs the fp64 model (CPU)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("hp_dtype", HP_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_delayed_reference_matches_model(shape, hp_dtype, fp8_dtype):
    x = grid_input(shape, hp_dtype, seed=sum(shape))
    scale_value = 0.75 if fp8_dtype == torch.float8_e4m3fn else 48.0  # some values saturate
    scale = torch.tensor([scale_value])
    amax = torch.tensor([3.0])
    data, data_t, scale_inv = ct.quantize(x, CastSpec(fp8_dtype, True, True, scale, amax))
    codes, codes_t = model_outputs(x, scale_value, fp8_dtype)
    assert data.dtype == fp8_dtype and data_t.dtype == fp8_dtype
    assert torch.equal(u8(data), codes)
    assert torch.equal(u8(data_t), codes_t)
    assert amax.item() == max(3.0, x.double().abs().max().item())
    assert scale_inv.item() == f32(1 / scale_value)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_delayed_reference_every_code_tie_and_saturation(fp8_dtype):
    # Every FP8 value, every midpoint (a tie), the quarter points either side of it, and values
    # past the range; both signs. All are exact in fp32, so with scale 1, x * scale is y.
    table = fp8_magnitudes(fp8_dtype)
    lo, hi = table[:-1], table[1:]
    fp8_max = table[-1].item()
    points = [table, (lo + hi) / 2, lo + (hi - lo) / 4, lo + 3 * (hi - lo) / 4]
    points.append(torch.tensor([fp8_max * 1.0625, fp8_max * 1.5, fp8_max * 4, 1e30, math.inf]))
    y = torch.cat(points)
    y = torch.cat([y, -y]).reshape(2, -1)
    scale, amax = torch.ones(1), torch.zeros(1)
    data, _, _ = ct.quantize(y.float(), CastSpec(fp8_dtype, True, False, scale, amax))
    assert torch.equal(u8(data), fp8_codes_model(y, fp8_dtype))


@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (False, True), (False, False)])
def test_delayed_reference_usage(rowwise, columnwise):
    x = grid_input((5, 3), torch.bfloat16, seed=1)
    amax = torch.zeros(1)
    spec = CastSpec(torch.float8_e4m3fn, rowwise, columnwise, torch.tensor([2.0]), amax)
    data, data_t, scale_inv = ct.quantize(x, spec)
    assert (data is not None) == rowwise and (data_t is not None) == columnwise
    if data_t is not None:
        assert data_t.shape == (3, 16)
    assert amax.item() == x.float().abs().max().item() and scale_inv.item() == 0.5


@pytest.mark.parametrize("cols", [1, 17])
def test_delayed_reference_zero_rows(cols):
    x = torch.empty((0, cols), dtype=torch.bfloat16)
    amax = torch.tensor([5.0])
    spec = CastSpec(torch.float8_e5m2, True, True, torch.tensor([4.0]), amax)
    data, data_t, scale_inv = ct.quantize(x, spec)
    assert data.shape == (0, cols) and data_t.shape == (cols, 0)
    assert amax.item() == 5.0 and scale_inv.item() == 0.25


def test_delayed_reference_amax_accumulates():
    amax = torch.zeros(1)
    for value in [2.0, -7.0, 3.0]:
        x = torch.full((3, 5), value, dtype=torch.bfloat16)
        ct.quantize(x, CastSpec(torch.float8_e4m3fn, 1, 0, torch.ones(1), amax))
    assert amax.item() == 7.0


@pytest.mark.parametrize(
    "amax,eps,power_2",
    [
        (0.0, 0.0, False),
        (math.inf, 0.0, False),
        (math.nan, 0.0, False),
        (math.nan, 1e-3, False),
        (1e-40, 0.0, False),  # quotient overflows fp32: largest finite
        (1e-40, 0.0, True),
        (0.0, 2.0**-10, False),  # epsilon lifts a zero amax
        (0.1, 1e-3, False),
        (0.1, 1.0, False),
        (3.0, 0.0, False),
        (3.0, 0.0, True),
        (1e30, 0.0, True),
        (448.0, 0.0, True),
        (5e-38, 0.0, False),
    ],
)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_compute_scale_reference_rules(amax, eps, power_2, fp8_dtype):
    fp8_max = ct.FP8_MAX[fp8_dtype]
    scale = ct.compute_scale_reference(torch.tensor([amax]), fp8_max, eps, power_2)
    assert scale.dtype == torch.float32
    assert scale.item() == scale_model(f32(amax), fp8_max, eps, power_2)


@pytest.mark.parametrize("shape", [(1, 1), (17, 17), (127, 131), (1500, 7)])
@pytest.mark.parametrize("power_2", [False, True])
@pytest.mark.parametrize("hp_dtype", HP_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_current_reference_matches_model(shape, power_2, hp_dtype, fp8_dtype):
    # amax is a power of two, so fp8_max / amax is exact and x * scale stays on the grid.
    x = grid_input(shape, hp_dtype, seed=7 + sum(shape), max_exp=1)  # |x| <= 510
    x.view(-1)[0] = 512.0
    scale_value = scale_model(512.0, ct.FP8_MAX[fp8_dtype], 0.0, power_2)
    spec = CastSpec(fp8_dtype, True, True, amax_epsilon=0.0, power_2_scale=power_2)
    data, data_t, scale_inv = ct.quantize(x, spec)
    codes, codes_t = model_outputs(x, scale_value, fp8_dtype)
    assert torch.equal(u8(data), codes)
    assert torch.equal(u8(data_t), codes_t)
    assert scale_inv.item() == f32(1 / scale_value)


def test_current_reference_zero_input_and_zero_rows():
    for x in [torch.zeros((3, 4)), torch.empty((0, 4))]:
        spec = CastSpec(torch.float8_e4m3fn, 1, 1, amax_epsilon=0.0, power_2_scale=True)
        data, data_t, scale_inv = ct.quantize(x, spec)
        assert scale_inv.item() == 1.0
        assert not u8(data).any() and not u8(data_t).any()
        assert data_t.shape == (4, round_up(x.shape[0], 16))


def test_record_amax_reference():
    amax = torch.tensor([1.5])
    ct.record_amax(torch.tensor([[0.5, -1.0]], dtype=torch.float16), amax)
    assert amax.item() == 1.5
    ct.record_amax(torch.tensor([[0.5, -2.5]], dtype=torch.bfloat16), amax)
    assert amax.item() == 2.5
    ct.record_amax(torch.empty((0, 3)), amax)
    assert amax.item() == 2.5
    ct.record_amax(torch.tensor([[math.nan, 1.0]]), amax)
    assert math.isnan(amax.item())


def test_fp8_transpose_pads_with_zeros():
    data = torch.arange(1, 1 + 17 * 3, dtype=torch.uint8).reshape(17, 3)
    out = ct.fp8_transpose(data.view(torch.float8_e4m3fn))
    assert out.shape == (3, 32)
    assert torch.equal(u8(out)[:, :17], data.t())
    assert not u8(out)[:, 17:].any()


# ----------------------------------------------------------------------------------------------
# Launcher helpers (CPU)
# ----------------------------------------------------------------------------------------------

SMALL_NUMEL = ct.SMALL_TILE * ct.SMALL_MAX_TILES


@pytest.mark.parametrize(
    "shape,small",
    [
        ((1, 1), True),
        ((1, 16), True),
        ((3, 48), True),
        ((17, 1024), True),
        ((127, 131), True),
        ((16, 4096), True),  # 16 tiles of (16, 256): the bound
        ((64, 1024), True),
        ((17, 4096), False),
        ((65, 1024), False),
        ((4096, 16), True),  # 16 tiles of (256, 16)
        ((4097, 16), False),
        ((1, 4096), True),
        ((1, SMALL_NUMEL), False),  # few elements but 256 tiles of one row each
        ((255, 257), False),
        ((1023, 1500), False),
    ],
)
def test_small_tile_threshold(shape, small):
    assert (ct.small_tile(*shape) is not None) == small


def test_small_tile_covers_x_within_the_bound():
    for rows in [*range(1, 70), 127, 128, 129, 255, 256, 257, 1000, 4096, 4097, 65536]:
        for cols in [1, 2, 15, 16, 17, 31, 33, 64, 100, 128, 129, 256, 257, 1024, 4096, 65536]:
            tile = ct.small_tile(rows, cols)
            block_n = min(max(1 << (cols - 1).bit_length(), 16), 256)
            tiles = -(-rows // (ct.SMALL_TILE // block_n)) * -(-cols // block_n)
            if tile is None:
                assert rows * cols > SMALL_NUMEL or tiles > ct.SMALL_MAX_TILES
                continue
            block_m, block_n = tile
            assert block_m * block_n == ct.SMALL_TILE and block_m % ct.COLUMNWISE_ALIGN == 0
            assert 16 <= block_n <= 256 and block_n & (block_n - 1) == 0
            assert block_n >= cols or block_n == 256  # as wide as cols needs
            assert rows * cols <= SMALL_NUMEL and tiles <= ct.SMALL_MAX_TILES


@pytest.mark.parametrize("rowwise,columnwise", [(True, True), (True, False), (False, True)])
def test_alloc_outputs_layout(rowwise, columnwise):
    fp8 = torch.float8_e5m2
    data, data_t = _fp8_codec.alloc_outputs(17, 33, fp8, torch.device("cpu"), rowwise, columnwise)
    assert (data is not None) == rowwise and (data_t is not None) == columnwise
    for t, shape in [(data, (17, 33)), (data_t, (33, 32))]:
        if t is not None:
            assert t.shape == shape and t.dtype == fp8 and t.is_contiguous()
    if rowwise and columnwise:  # separate storage: dropping one frees its memory
        assert data.untyped_storage().data_ptr() != data_t.untyped_storage().data_ptr()


# ----------------------------------------------------------------------------------------------
# The Triton kernels under Triton's CPU interpreter (where triton is installed)
# ----------------------------------------------------------------------------------------------

# Runs in a fresh process: TRITON_INTERPRET must be set before the kernels are defined. The
# kernels encode FP8 in integer arithmetic, so the interpreter gives their exact bytes.
INTERPRETER_SCRIPT = """
import math
import torch
from tolerances import same_bits

from torchte.kernels import cast_transpose as ct
from torchte.kernels.cast_spec import CastSpec

def check_small(x, fp8, power_2, eps=0.0, rowwise=True, columnwise=True):
    tile = ct.small_tile(*x.shape)
    assert tile is not None, x.shape
    usage = (rowwise, columnwise)
    spec = CastSpec(fp8, *usage, amax_epsilon=eps, power_2_scale=power_2)
    *ref, scale_inv_ref = ct.quantize_reference(x, spec)
    *out, scale_inv = ct._quantize_current_small(x, fp8, *usage, eps, power_2, tile)
    for got, want in zip(out, ref):
        assert (got is None) == (want is None), (x.shape, usage)
        if got is not None:
            assert got.dtype == want.dtype and got.shape == want.shape, (x.shape, fp8)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (x.shape, fp8)
    assert same_bits(scale_inv, scale_inv_ref), (x.shape, fp8, power_2, eps)

def check(x, fp8, mode, config, scale_value=7.25, eps=0.0):
    if mode.startswith("small"):
        return check_small(x, fp8, mode == "small_p2", eps)
    if mode == "delayed":
        scale, amax, amax_ref = torch.tensor([scale_value]), torch.ones(1), torch.ones(1)
        *ref, scale_inv_ref = ct.quantize_reference(x, CastSpec(fp8, True, True, scale, amax_ref))
        *out, scale_inv = ct._cast_transpose(x, scale, amax, fp8, True, True, False, 0.0, False,
                                             config)
    else:
        power_2 = mode == "current_p2"
        spec = CastSpec(fp8, True, True, amax_epsilon=eps, power_2_scale=power_2)
        *ref, scale_inv_ref = ct.quantize_reference(x, spec)
        amax = amax_ref = torch.zeros(1)
        ct._launch_amax(x, amax, (64, 4))
        *out, scale_inv = ct._cast_transpose(x, amax, amax, fp8, True, True, True, eps, power_2,
                                             config)
    for got, want in zip(out, ref):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (x.shape, fp8, mode)
    assert torch.equal(amax.nan_to_num(-1.0), amax_ref.nan_to_num(-1.0)), (x.shape, mode)
    assert same_bits(scale_inv, scale_inv_ref), (x.shape, fp8, mode)

def random_input(shape):
    x = torch.randn(shape) * 3
    x.view(-1)[::7] *= 1e-3
    x.view(-1)[::11] *= 1e-5
    x.view(-1)[::13] *= 300
    x.view(-1)[::29] = 0.0
    return x

torch.manual_seed(0)
HP = [torch.float32, torch.bfloat16, torch.float16]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
for shape in [(1, 1), (17, 1), (1, 17), (33, 48), (70, 130)]:
    for dtype in HP:
        for fp8 in FP8:
            for mode in ["delayed", "current", "current_p2", "small", "small_p2"]:
                x = random_input(shape)
                config = (32, 32, 4) if sum(shape) % 2 else (16, 64, 4)
                check(x.to(dtype), fp8, mode, config, eps=1e-3 if shape[0] == 33 else 0.0)
# The single-program kernel on odd shapes and at its bound: one tile, several, 16 of them.
for i, shape in enumerate([(1, 16), (3, 48), (17, 1024), (127, 131), (16, 4096), (4096, 16)]):
    for j, dtype in enumerate(HP):
        for k, fp8 in enumerate(FP8):
            check_small(random_input(shape).to(dtype), fp8, (i + j + k) % 2 == 1)
x = random_input((40, 70))
for rowwise, columnwise in [(True, False), (False, True)]:
    check_small(x, torch.float8_e4m3fn, False, 0.0, rowwise, columnwise)
for special in [math.nan, -math.inf]:  # amax NaN or inf: scale 1
    x[5, 7] = special
    check_small(x.bfloat16(), torch.float8_e5m2, True, 1e-3)
    check_small(x, torch.float8_e4m3fn, False)
    x[5, 7] = 1.0
for fill in [0.0, 1e-42]:  # amax 0: scale 1; fp8_max / amax overflows: the largest fp32
    for eps in [0.0, 1e-3]:
        check_small(torch.full((5, 33), fill), torch.float8_e4m3fn, False, eps)
for fp8 in [torch.float8_e4m3fn, torch.float8_e5m2]:
    # Every FP8 value, every tie, quarter points, specials, and random fp32 bit patterns.
    values = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    values = values[torch.isfinite(values)].sort().values
    lo, hi = values[:-1], values[1:]
    specials = [math.nan, -math.nan, -0.0, 1e-40, -1e-42, 1e30, -math.inf, 3e38]
    y = torch.cat([values, (lo + hi) / 2, lo + (hi - lo) / 4, lo + 3 * (hi - lo) / 4,
                   torch.tensor(specials)])
    y = torch.cat([y, -y, torch.zeros((-2 * len(y)) % 64)]).reshape(-1, 64)
    check(y, fp8, "delayed", (32, 64, 4), scale_value=1.0)
    bits = torch.randint(-(2**31), 2**31 - 1, (64, 64), dtype=torch.int64).to(torch.int32)
    check(bits.view(torch.float32).clone(), fp8, "delayed", (32, 64, 4), scale_value=1.0)
print("ok")
"""


@requires_interpreter
def test_triton_kernels_in_interpreter_match_reference():
    run_under_interpreter(INTERPRETER_SCRIPT)
