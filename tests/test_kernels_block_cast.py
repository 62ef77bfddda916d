"""Block-scaled FP8 casts (1x128, 128x128, grouped 1x128): the torch reference against an fp64
model of Transformer Engine's block kernels, byte for byte and bit for bit, on partial blocks,
special values and both scale modes; the Triton kernels against the reference under Triton's
CPU interpreter; the layouts, dequantize and the argument checks.

The model takes each block's amax in float64 (NaN values skipped), its scale by
compute_scale_from_amax's steps in Python floats rounded to fp32 (a float64 quotient rounded
once to fp32 is the correctly rounded fp32 quotient), the product x * scale rounded to fp32 as
the kernels compute it, and the FP8 code by search in the table of FP8 values
(test_kernels_cast_transpose's model), sharing nothing with torch's conversion.
"""

from __future__ import annotations

import math

import pytest
import torch
from interpreter import requires_interpreter, run_under_interpreter
from test_kernels_cast_transpose import f32, fp8_codes_model, grid_input

from torchte._sizes import round_up
from torchte.kernels import block_cast as bc
from torchte.kernels.block_layout import block_offsets, max_blocks

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_DTYPES = [E4M3, E5M2]
HP_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
INF_SCALE = {dtype: torch.finfo(dtype).max for dtype in HP_DTYPES}
SHAPES = [(1, 1), (3, 129), (131, 257), (127, 7), (256, 128), (67, 389)]


# ----------------------------------------------------------------------------------------------
# The fp64 model
# ----------------------------------------------------------------------------------------------


def scale_model(amax: float, fp8_max: float, eps: float, power_2: bool, inf_scale: float):
    """compute_scale_from_amax in Python floats: the scale of a block of amax (no NaN)."""
    if amax < f32(eps):
        amax = f32(eps)
    if amax == 0 or math.isinf(amax):
        return 1.0
    scale = f32(fp8_max / amax)
    if math.isinf(scale):
        scale = inf_scale
    if power_2:
        scale = math.ldexp(1.0, math.frexp(scale)[1] - 1)
    return scale


def codes_model(values: torch.Tensor, scale: float, fp8_dtype) -> torch.Tensor:
    """FP8 bytes of values (float64, exact inputs) * scale, the product rounded to fp32 first;
    NaN as 0x7F, whatever its sign."""
    y = (values * scale).float().double()
    nan = torch.isnan(y)
    codes = fp8_codes_model(torch.where(nan, 0.0, y), fp8_dtype)
    return torch.where(nan, torch.tensor(0x7F, dtype=torch.uint8), codes)


def block_model(block: torch.Tensor, fp8_dtype, eps, power_2, inf_scale):
    """(codes, scale_inv) of one block (float64 values) under one scale."""
    mags = block.abs()
    amax = mags[~torch.isnan(mags)].max().item() if (~torch.isnan(mags)).any() else 0.0
    scale = scale_model(amax, FP8_MAX[fp8_dtype], eps, power_2, inf_scale)
    return codes_model(block, scale, fp8_dtype), f32(1.0 / scale)


def rows_model(x2d: torch.Tensor, fp8_dtype, eps, power_2, inf_scale):
    """(codes (M, K), scale_inv (ceil(K/128), M) float64) of 1x128 blocks along K."""
    rows, cols = x2d.shape
    x64 = x2d.double()
    codes = torch.zeros(rows, cols, dtype=torch.uint8)
    scale_inv = torch.zeros(-(-cols // 128), rows, dtype=torch.float64)
    for r in range(rows):
        for j in range(0, cols, 128):
            block = x64[r, j : j + 128]
            codes[r, j : j + 128], scale_inv[j // 128, r] = block_model(
                block, fp8_dtype, eps, power_2, inf_scale
            )
    return codes, scale_inv


def tiles_model(x2d: torch.Tensor, fp8_dtype, eps, power_2, inf_scale):
    """(codes (R, C), scale_inv (ceil(R/128), round_up(ceil(C/128), 4)), padding 0) of
    128x128 tiles."""
    rows, cols = x2d.shape
    x64 = x2d.double()
    codes = torch.zeros(rows, cols, dtype=torch.uint8)
    n_c = -(-cols // 128)
    scale_inv = torch.zeros(-(-rows // 128), round_up(n_c, 4), dtype=torch.float64)
    for i in range(0, rows, 128):
        for j in range(0, cols, 128):
            tile = x64[i : i + 128, j : j + 128]
            codes[i : i + 128, j : j + 128], scale_inv[i // 128, j // 128] = block_model(
                tile, fp8_dtype, eps, power_2, inf_scale
            )
    return codes, scale_inv


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def assert_scales(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got.double(), want), (got, want)


def special_input(shape, dtype, seed) -> torch.Tensor:
    """grid_input with an all-zero block row, NaNs (one negative), infs and (fp32 / bf16) a row
    of normal values so small (below 2**-125) that fp8_max / amax overflows fp32."""
    x = grid_input(shape, torch.float32, seed)
    rows, cols = shape
    x[0, : min(cols, 128)] = 0.0
    if rows > 2 and cols > 3:
        x[1, 3] = float("nan")
        x[2, 1] = float("-inf")
        x[rows - 1, cols - 1] = -float("nan")
    if dtype != torch.float16 and rows > 3:
        gen = torch.Generator().manual_seed(seed)
        tiny = torch.randint(128, 256, (cols,), generator=gen) * 2.0**-133
        x[3, :] = torch.where(x[3, :] < 0, -tiny, tiny)
    return x.to(dtype)


# ----------------------------------------------------------------------------------------------
# The model itself: the values Transformer Engine's formula gives
# ----------------------------------------------------------------------------------------------


def test_scale_model_follows_compute_scale_from_amax():
    flt_max = INF_SCALE[torch.float32]
    assert scale_model(0.0, 448.0, 0.0, True, flt_max) == 1.0
    assert scale_model(math.inf, 448.0, 0.0, False, flt_max) == 1.0
    assert scale_model(0.0, 448.0, 0.5, False, flt_max) == 896.0  # eps floors amax
    assert scale_model(3.0, 448.0, 0.0, False, flt_max) == f32(448.0 / 3.0)
    assert scale_model(3.0, 448.0, 0.0, True, flt_max) == 128.0  # 149.33 rounded down
    assert scale_model(2.0**-125, 448.0, 0.0, False, flt_max) == flt_max
    bf16_max = INF_SCALE[torch.bfloat16]
    assert scale_model(2.0**-125, 448.0, 0.0, False, bf16_max) == bf16_max
    assert scale_model(2.0**-125, 448.0, 0.0, True, bf16_max) == 2.0**127


# ----------------------------------------------------------------------------------------------
# The torch reference against the model
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("hp_dtype", HP_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("power_2", [True, False])
def test_reference_1x128_matches_model(shape, hp_dtype, fp8_dtype, power_2):
    x = special_input(shape, hp_dtype, seed=shape[0] * 31 + shape[1])
    inf_scale = INF_SCALE[hp_dtype]
    data, scale, data_t, scale_t = bc.block_quantize_reference(
        x, fp8_dtype, 1, True, True, power_2, 0
    )
    codes, scale_want = rows_model(x, fp8_dtype, 0.0, power_2, inf_scale)
    assert data.dtype == fp8_dtype and torch.equal(u8(data), codes)
    assert_scales(scale, scale_want)
    codes_t, scale_t_want = rows_model(x.t(), fp8_dtype, 0.0, power_2, inf_scale)
    assert data_t.shape == (shape[1], shape[0]) and torch.equal(u8(data_t), codes_t)
    assert_scales(scale_t, scale_t_want)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("hp_dtype", HP_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("power_2", [True, False])
def test_reference_128x128_matches_model(shape, hp_dtype, fp8_dtype, power_2):
    x = special_input(shape, hp_dtype, seed=shape[0] * 17 + shape[1])
    data, scale, data_t, scale_t = bc.block_quantize_reference(
        x, fp8_dtype, 2, True, True, power_2, 0
    )
    codes, scale_want = tiles_model(x, fp8_dtype, 0.0, power_2, INF_SCALE[hp_dtype])
    assert torch.equal(u8(data), codes)
    assert_scales(scale, scale_want)
    # The columnwise copy: the same bytes and scales, transposed (padding 0 again).
    assert torch.equal(u8(data_t), codes.t())
    n_r, n_c = scale_want.shape[0], -(-shape[1] // 128)
    want_t = torch.zeros(n_c, round_up(n_r, 4), dtype=torch.float64)
    want_t[:, :n_r] = scale_want[:, :n_c].t()
    assert_scales(scale_t, want_t)


@pytest.mark.parametrize("block_dim", [1, 2])
@pytest.mark.parametrize("eps", [2.0**-4, 1e-3, 3.0])
def test_epsilon_floors_the_amax(block_dim, eps):
    x = grid_input((130, 200), torch.bfloat16, seed=5, max_exp=-2)  # |x| < 2**5.99 * 2**-2
    x[:, :128] = 0.0  # zero blocks: scale fp8_max / eps
    model = rows_model if block_dim == 1 else tiles_model
    for power_2 in (True, False):
        data, scale, _, _ = bc.block_quantize_reference(
            x, E4M3, block_dim, True, False, power_2, eps
        )
        codes, scale_want = model(x, E4M3, eps, power_2, INF_SCALE[torch.bfloat16])
        assert torch.equal(u8(data), codes)
        assert_scales(scale, scale_want)
    assert scale_want[0, 0] == f32(1.0 / scale_model(0.0, 448.0, eps, False, 0.0))


def test_subnormal_inputs():
    """Subnormal fp32 values: an amax so small that the scale is the largest fp32 value (or
    2**127 as a power of two); the values then cast as any others."""
    x = torch.zeros(2, 130)
    x[0, :5] = torch.tensor([1.0, -3.0, 5.0, 0.5, 7.0]) * 2.0**-135
    x[1, 128:] = torch.tensor([3.0, 1.0]) * 2.0**-149
    for power_2 in (True, False):
        data, scale, _, _ = bc.block_quantize_reference(x, E4M3, 1, True, False, power_2, 0)
        codes, scale_want = rows_model(x, E4M3, 0.0, power_2, INF_SCALE[torch.float32])
        assert torch.equal(u8(data), codes) and u8(data)[0, :5].ne(0).all()
        assert_scales(scale, scale_want)
        assert scale[0, 0] == f32(1.0 / (2.0**127 if power_2 else INF_SCALE[torch.float32]))


def test_special_blocks():
    """Zero block: scale 1; a block with inf: scale 1 and inf saturated; NaN skipped by the
    amax and kept as NaN; an all-NaN block: scale 1."""
    x = torch.zeros(4, 256)
    x[1, 0], x[1, 1] = float("inf"), 3.0
    x[2, 0], x[2, 1] = float("nan"), 2.0
    x[3, 128:] = float("nan")
    data, scale, _, _ = bc.block_quantize_reference(x, E4M3, 1, True, False, True, 0.0)
    assert scale[:, 0].tolist() == [1.0, 1.0]  # zero blocks
    assert scale[0, 1] == 1.0 and u8(data)[1, :2].tolist() == [0x7E, 0x44]  # 448, 3.0
    assert scale[0, 2] == 2.0**-7  # amax 2 (NaN skipped): scale 448/2 -> 128
    assert u8(data)[2, :2].tolist() == [0x7F, 0x78]  # NaN kept; 2 * 128 = 256
    assert scale[1, 3] == 1.0 and bool(((u8(data)[3, 128:] & 0x7F) == 0x7F).all())


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_grouped_reference_matches_model_per_group(fp8_dtype):
    """Rowwise as the plain 1x128 cast; columnwise each group's own blocks from its first row
    (an empty group, sizes not multiples of 128), unused scale rows 0."""
    sizes = [5, 0, 130, 1, 257, 0]
    rows = sum(sizes)
    x = special_input((rows, 140), torch.bfloat16, seed=9)
    offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
    out = bc.grouped_block_quantize_reference(x, offsets, fp8_dtype, True, True, True, 0.0)
    data, scale, data_t, scale_t = out
    plain = bc.block_quantize_reference(x, fp8_dtype, 1, True, False, True, 0.0)
    assert torch.equal(u8(data), u8(plain[0])) and torch.equal(scale, plain[1])
    assert data_t.shape == (140, rows)
    assert scale_t.shape == (max_blocks(rows, len(sizes)), 140)
    inf_scale = INF_SCALE[torch.bfloat16]
    first_block = block_offsets(offsets).tolist()
    bounds = zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)
    for g, (start, end) in enumerate(bounds):
        codes_t, scale_t_want = rows_model(x[start:end].t(), fp8_dtype, 0.0, True, inf_scale)
        assert torch.equal(u8(data_t)[:, start:end], codes_t), g
        b = first_block[g]
        assert_scales(scale_t[b : b + scale_t_want.shape[0]], scale_t_want)
    assert not scale_t[first_block[-1] :].any()


def test_grouped_row_blocks_and_zero_tokens():
    offsets = torch.tensor([0, 129, 129, 130], dtype=torch.int32)
    blocks = bc.grouped_row_blocks(offsets, 130)
    assert blocks[:128].eq(0).all() and blocks[128] == 1 and blocks[129] == 2
    x = torch.zeros(0, 33)
    empty = torch.zeros(4, dtype=torch.int32)
    data, scale, data_t, scale_t = bc.grouped_block_quantize(x, empty, E4M3, True, True, True, 0)
    assert data.shape == (0, 33) and scale.shape == (1, 0) and data_t.shape == (33, 0)
    assert scale_t.shape == (3, 33) and not scale_t.any()


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (2, 0, 7)])
def test_empty_inputs(shape):
    x = torch.zeros(shape)
    dims = [2] if len(shape) == 3 else [1, 2]
    for block_dim in dims:
        data, scale, data_t, scale_t = bc.block_quantize(x, E4M3, block_dim, True, True, True, 0)
        assert data.shape == shape and data_t.shape == (*shape[:-2], shape[-1], shape[-2])
        assert scale.dim() == len(shape) and scale_t.dim() == len(shape)


def test_batched_tiles_never_straddle_matrices():
    x = grid_input((3, 130, 200), torch.float32, seed=2)
    x[1] *= 2.0**8  # one matrix far larger: its tiles alone see its amax
    data, scale, data_t, scale_t = bc.block_quantize_reference(x, E4M3, 2, True, True, True, 0)
    assert data.shape == (3, 130, 200) and scale.shape == (3, 2, 4)
    assert data_t.shape == (3, 200, 130) and scale_t.shape == (3, 2, 4)
    for g in range(3):
        alone = bc.block_quantize_reference(x[g], E4M3, 2, True, True, True, 0)
        for got, want in zip((data[g], scale[g], data_t[g], scale_t[g]), alone, strict=True):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("block_dim", [1, 2])
def test_block_dequantize_is_data_times_scale(block_dim):
    x = special_input((131, 257), torch.float32, seed=4)
    x = torch.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)
    data, scale, data_t, scale_t = bc.block_quantize_reference(
        x, E5M2, block_dim, True, True, False, 0
    )
    values = bc.block_dequantize(data, scale, block_dim, x.shape, torch.float64)
    decoded = data.double()
    for r in range(0, 131, 50):
        for c in range(0, 257, 60):
            s = scale[c // 128, r] if block_dim == 1 else scale[r // 128, c // 128]
            assert values[r, c] == f32(decoded[r, c].item() * s.item())  # fp32 product
    values_t = bc.block_dequantize(data_t, scale_t, block_dim, (257, 131), torch.bfloat16)
    assert values_t.dtype == torch.bfloat16 and values_t.shape == (257, 131)
    assert torch.allclose(values_t.t().float(), x, rtol=0.25, atol=1e-6)


def test_transpose_block2d_round_trip():
    x = grid_input((3, 130, 260), torch.float32, seed=8)
    data, scale, data_t, scale_t = bc.block_quantize_reference(x, E4M3, 2, True, True, True, 0)
    made_t = bc.transpose_block2d(data, scale)
    assert torch.equal(u8(made_t[0]), u8(data_t)) and torch.equal(made_t[1], scale_t)
    made = bc.transpose_block2d(data_t, scale_t)
    assert torch.equal(u8(made[0]), u8(data)) and torch.equal(made[1], scale)


# ----------------------------------------------------------------------------------------------
# Argument checks
# ----------------------------------------------------------------------------------------------


def test_bad_arguments_raise_before_any_kernel():
    x = torch.zeros(4, 8)
    with pytest.raises(TypeError, match="x must be a float32"):
        bc.block_quantize(x.int(), E4M3, 1, True, True, True, 0.0)
    with pytest.raises(TypeError, match="fp8_dtype"):
        bc.block_quantize(x, torch.int8, 1, True, True, True, 0.0)
    with pytest.raises(ValueError, match="block_dim must be 1"):
        bc.block_quantize(x, E4M3, 3, True, True, True, 0.0)
    with pytest.raises(ValueError, match="block_dim 1 quantizes a 2-D x"):
        bc.block_quantize(x[None], E4M3, 1, True, True, True, 0.0)
    with pytest.raises(ValueError, match="block_dim 2 quantizes x"):
        bc.block_quantize(x[0], E4M3, 2, True, True, True, 0.0)
    with pytest.raises(ValueError, match="at least one of rowwise and columnwise"):
        bc.block_quantize(x, E4M3, 1, False, False, True, 0.0)
    for eps in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="amax_epsilon must be finite"):
            bc.block_quantize(x, E4M3, 2, True, True, True, eps)
    offsets = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(TypeError, match="row_offsets must be an int32"):
        bc.grouped_block_quantize(x, offsets.long(), E4M3, True, True, True, 0.0)
    with pytest.raises(ValueError, match=r"row_offsets must have shape \(G \+ 1,\)"):
        bc.grouped_block_quantize(x, offsets[:1], E4M3, True, True, True, 0.0)
    with pytest.raises(ValueError, match="x must be 2-D"):
        bc.grouped_block_quantize(x[None], offsets, E4M3, True, True, True, 0.0)
    with pytest.raises(ValueError, match="block_dim must be 1 or 2"):
        bc.block_dequantize(torch.zeros(2, 2, dtype=E4M3), torch.ones(1, 2), 0, (2, 2))


# ----------------------------------------------------------------------------------------------
# The Triton kernels under Triton's CPU interpreter (where triton is installed)
# ----------------------------------------------------------------------------------------------

# Runs in a fresh process: TRITON_INTERPRET must be set before the kernels are defined. The
# launchers' outputs start filled with a pattern, so a byte or scale a kernel fails to write
# shows. Each kernel runs under one tile-per-program config and one persistent config (one or
# two programs looping over all tiles), on sizes whose columnwise bytes go out as int32 words
# (row counts multiples of 4) and byte by byte (the rest, and the grouped tiles that start or
# end off a multiple of 4).
INTERPRETER_SCRIPT = """
import torch
from test_kernels_block_cast import special_input
from torchte.kernels import block_cast as bc

programs = [1]
bc.sm_count = lambda index: programs[0]

def filled(out):
    for t in out:
        if t is not None and t.dtype == torch.float32:
            t.fill_(7.0)
        elif t is not None:
            t.view(torch.uint8).fill_(0x55)
    return out

alloc_1x128, alloc_2d = bc._alloc_1x128, bc._alloc_2d
bc._alloc_1x128 = lambda *args: filled(alloc_1x128(*args))
bc._alloc_2d = lambda *args: filled(alloc_2d(*args))

def check(got, want, what):
    for a, b in zip(got, want, strict=True):
        assert (a is None) == (b is None), what
        if a is not None:
            assert a.shape == b.shape and a.dtype == b.dtype, what
            bits = torch.int32 if a.dtype == torch.float32 else torch.uint8
            assert torch.equal(a.view(bits), b.view(bits)), what

CONFIGS = [(4, 0, 0, 2), (4, 2, 1, 3)]

def run(kind, x, fp8, p2, eps, rw, cw, sizes=None, configs=CONFIGS):
    consts = bc._constexprs(x, fp8, p2, rw, cw)
    for config in configs:
        what = (kind, tuple(x.shape), sizes, fp8, p2, eps, rw, cw, config)
        if kind == "grouped":
            offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
            got = bc._quantize_grouped(x, offsets, fp8, eps, consts, config)
            want = bc.grouped_block_quantize_reference(x, offsets, fp8, rw, cw, p2, eps)
        elif kind == "1d":
            got = bc._quantize_1d(x, fp8, eps, consts, config)
            want = bc.block_quantize_reference(x, fp8, 1, rw, cw, p2, eps)
        else:
            got = bc._quantize_2d(x, fp8, eps, consts, config)
            want = bc.block_quantize_reference(x, fp8, 2, rw, cw, p2, eps)
        check(got, want, what)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
x = special_input((131, 259), torch.bfloat16, seed=1)
x4 = special_input((260, 140), torch.bfloat16, seed=4)
x16 = special_input((67, 130), torch.float16, seed=2)
x32 = special_input((132, 7), torch.float32, seed=3)
run("1d", x, E4M3, True, 0.0, True, True)
run("1d", x4, E5M2, False, 1e-3, True, True)
run("1d", x16, E5M2, False, 1e-3, True, False, configs=CONFIGS[:1])
run("1d", x32, E4M3, False, 0.0, False, True)
run("2d", x, E5M2, False, 0.0, True, True)
run("2d", x4, E4M3, True, 0.5, True, True)
run("2d", x16, E4M3, True, 0.5, True, False, configs=CONFIGS[:1])
run("2d", x32, E4M3, True, 0.0, False, True, configs=CONFIGS[:1])
run("2d", x[:130].reshape(2, 65, 259), E4M3, False, 0.0, True, True)
programs[0] = 2
run("2d", x4[:256].reshape(2, 128, 140), E5M2, True, 0.0, True, True)
run("grouped", x, E4M3, True, 0.0, True, True, sizes=[5, 0, 126, 0])
run("grouped", x4, E5M2, False, 0.0, True, True, sizes=[4, 0, 135, 1, 120])
run("grouped", x16, E5M2, False, 0.0, False, True, sizes=[67], configs=CONFIGS[:1])
run("grouped", x32, E4M3, False, 2.0**-3, True, False, sizes=[0, 1, 131])
# T % 16 == 0: the tiles read from a 16-row-aligned window (blocks straddling its end, edge
# chunks shared between neighbours, one-row groups, 16-row-aligned groups).
x288 = special_input((288, 130), torch.bfloat16, seed=5)
run("grouped", x288, E4M3, True, 0.0, True, True, sizes=[5, 0, 140, 17, 1, 125])
run("grouped", x288, E5M2, False, 1e-3, True, True, sizes=[32, 0, 144, 16, 96], configs=CONFIGS[:1])
run("grouped", x288.float(), E4M3, False, 0.0, False, True, sizes=[127, 161], configs=CONFIGS[1:])
run("grouped", x288[:160].half(), E5M2, True, 0.0, True, False, sizes=[3, 157], configs=CONFIGS[:1])
tiny = torch.zeros(8, 130)  # subnormal fp32 (the interpreter flushes bf16 ones): scales overflow
tiny[0, :5] = torch.tensor([1.0, -3.0, 5.0, 0.5, 7.0]) * 2.0**-135
tiny[1, 128:] = torch.tensor([3.0, 1.0]) * 2.0**-149
tiny[2] = torch.linspace(-1, 1, 130) * 2.0**-127
for p2 in (True, False):
    run("1d", tiny, E4M3, p2, 0.0, True, True, configs=CONFIGS[:1])
    run("2d", tiny, E5M2, p2, 0.0, True, True, configs=CONFIGS[:1])
print("ok")
"""


@requires_interpreter
def test_triton_kernels_match_reference_under_interpreter():
    run_under_interpreter(INTERPRETER_SCRIPT)
