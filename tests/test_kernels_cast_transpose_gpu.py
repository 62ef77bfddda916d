"""FP8 cast + transpose + amax on the GPU: the Triton kernels against the torch reference, byte
for byte, and their launch counts."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from launches import count_device_ops
from tolerances import same_bits

from torchte.kernels import cast_transpose as ct
from torchte.kernels._triton import triton_available
from torchte.kernels.cast_spec import CastSpec

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
HP_DTYPES = [torch.float32, torch.bfloat16, torch.float16]

requires_triton = pytest.mark.skipif(not triton_available(), reason="needs a CUDA GPU and Triton")


def u8(t: torch.Tensor | None) -> torch.Tensor | None:
    """FP8 data as its bytes."""
    return None if t is None else t.view(torch.uint8)


# ----------------------------------------------------------------------------------------------
# Triton vs the reference, byte for byte (GPU)
# ----------------------------------------------------------------------------------------------

GPU_SHAPES = [(1, 1), (1, 17), (17, 1), (16, 1024), (127, 131), (1023, 1500), (2048, 4096)]


def random_input(shape, dtype, seed=0) -> torch.Tensor:
    """Normal values, a few huge (to saturate) and a few tiny (FP8 subnormals and zero)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, device="cuda", generator=gen) * 3
    x.view(-1)[::7] *= 1e-3
    x.view(-1)[::13] *= 300
    x.view(-1)[::29] = 0.0
    return x.to(dtype)


def assert_same(out, ref):
    for got, want in zip(out, ref, strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(u8(got), u8(want))


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("hp_dtype", HP_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_triton_delayed_matches_reference(shape, hp_dtype, fp8_dtype):
    x = random_input(shape, hp_dtype, seed=shape[0] * 7 + shape[1])
    scale = torch.tensor([ct.FP8_MAX[fp8_dtype] / 50.0], device="cuda")
    amax = torch.tensor([0.25], device="cuda")
    amax_ref = amax.clone()
    *out, scale_inv = ct.quantize(x, CastSpec(fp8_dtype, True, True, scale, amax))
    *ref, scale_inv_ref = ct.quantize_reference(x, CastSpec(fp8_dtype, True, True, scale, amax_ref))
    assert_same(out, ref)
    assert torch.equal(amax, amax_ref) and same_bits(scale_inv, scale_inv_ref)


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (False, True), (False, False)])
def test_triton_delayed_usage(rowwise, columnwise):
    x = random_input((33, 65), torch.bfloat16)
    scale = torch.tensor([3.0], device="cuda")
    amax, amax_ref = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    fp8 = torch.float8_e4m3fn
    *out, scale_inv = ct.quantize(x, CastSpec(fp8, rowwise, columnwise, scale, amax))
    spec_ref = CastSpec(fp8, rowwise, columnwise, scale, amax_ref)
    *ref, scale_inv_ref = ct.quantize_reference(x, spec_ref)
    assert_same(out, ref)
    assert torch.equal(amax, amax_ref) and same_bits(scale_inv, scale_inv_ref)


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("scale_value", [1e-30, 3e38, math.inf])
def test_triton_delayed_extreme_scales(scale_value):
    x = random_input((17, 40), torch.float32)
    for fp8 in FP8_DTYPES:
        scale = torch.tensor([scale_value], device="cuda")
        amax, amax_ref = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
        *out, scale_inv = ct.quantize(x, CastSpec(fp8, True, True, scale, amax))
        *ref, scale_inv_ref = ct.quantize_reference(x, CastSpec(fp8, True, True, scale, amax_ref))
        # x * inf is NaN where x == 0: compare the NaN-free bytes and the zero padding.
        if math.isinf(scale_value):
            assert not u8(out[1])[:, 17:].any()
            assert torch.equal(u8(out[1])[:, 17:], u8(ref[1])[:, 17:])
            finite = x != 0
            assert torch.equal(u8(out[0])[finite], u8(ref[0])[finite])
        else:
            assert_same(out, ref)
        assert same_bits(scale_inv, scale_inv_ref)


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("eps", [0.0, 1e-3])
@pytest.mark.parametrize("power_2", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (127, 131), (16, 1024), (1023, 1500)])
@pytest.mark.parametrize("hp_dtype", HP_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_triton_current_matches_reference(fp8_dtype, hp_dtype, shape, power_2, eps):
    x = random_input(shape, hp_dtype, seed=shape[1])
    spec = CastSpec(fp8_dtype, True, True, amax_epsilon=eps, power_2_scale=power_2)
    *out, scale_inv = ct.quantize(x, spec)
    *ref, scale_inv_ref = ct.quantize_reference(x, spec)
    assert_same(out, ref)
    assert same_bits(scale_inv, scale_inv_ref)


# The single-program path: odd shapes, one tile to 16 (the bound); and just past the bound, where
# the 3-launch path runs.
SMALL_SHAPES = [(1, 16), (3, 48), (17, 1024), (127, 131), (16, 4096), (4096, 16), (64, 1024)]
PAST_SMALL_SHAPES = [(65, 1024), (17, 4096), (4097, 16)]


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("power_2", [False, True])
@pytest.mark.parametrize("shape", SMALL_SHAPES + PAST_SMALL_SHAPES)
@pytest.mark.parametrize("hp_dtype", HP_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_triton_current_small_matches_reference(fp8_dtype, hp_dtype, shape, power_2):
    assert (ct.small_tile(*shape) is not None) == (shape in SMALL_SHAPES)
    x = random_input(shape, hp_dtype, seed=shape[0] + 3 * shape[1])
    eps = 1e-3 if power_2 else 0.0
    spec = CastSpec(fp8_dtype, True, True, amax_epsilon=eps, power_2_scale=power_2)
    *out, scale_inv = ct.quantize(x, spec)
    *ref, scale_inv_ref = ct.quantize_reference(x, spec)
    assert_same(out, ref)
    assert same_bits(scale_inv, scale_inv_ref)


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (False, True), (False, False)])
@pytest.mark.parametrize("shape", [(33, 65), (100, 1024)])  # single program; 3 launches
def test_triton_current_usage(shape, rowwise, columnwise):
    x = random_input(shape, torch.bfloat16)
    fp8, usage = torch.float8_e4m3fn, (rowwise, columnwise)
    spec = CastSpec(fp8, *usage, amax_epsilon=0.0, power_2_scale=False)
    *out, scale_inv = ct.quantize(x, spec)
    *ref, scale_inv_ref = ct.quantize_reference(x, spec)
    assert_same(out, ref)
    assert same_bits(scale_inv, scale_inv_ref)


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("fill", [0.0, 1e-3, 1e-42, math.inf, math.nan])
def test_triton_current_special_amax(fill):
    for x, eps in itertools.product(
        [torch.full((5, 33), fill, device="cuda"), torch.full((257, 300), fill, device="cuda")],
        [0.0, 1e-2],
    ):  # the single-program path and the 3-launch path
        fp8 = torch.float8_e4m3fn
        spec = CastSpec(fp8, True, True, amax_epsilon=eps, power_2_scale=False)
        *out, scale_inv = ct.quantize(x, spec)
        *ref, scale_inv_ref = ct.quantize_reference(x, spec)
        assert_same(out, ref)
        assert same_bits(scale_inv, scale_inv_ref)


@pytest.mark.gpu
@requires_triton
def test_triton_zero_rows():
    x = torch.empty((0, 24), device="cuda", dtype=torch.bfloat16)
    scale = torch.tensor([4.0], device="cuda")
    amax = torch.tensor([2.0], device="cuda")
    data, data_t, scale_inv = ct.quantize(x, CastSpec(torch.float8_e4m3fn, 1, 1, scale, amax))
    assert data.shape == (0, 24) and data_t.shape == (24, 0)
    assert amax.item() == 2.0 and scale_inv.item() == 0.25
    spec = CastSpec(torch.float8_e5m2, 1, 1, amax_epsilon=0.0, power_2_scale=False)
    data, data_t, scale_inv = ct.quantize(x, spec)
    assert data.shape == (0, 24) and data_t.shape == (24, 0) and scale_inv.item() == 1.0


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("hp_dtype", HP_DTYPES)
def test_triton_record_amax(hp_dtype):
    for shape in [(1, 1), (127, 131), (4097, 33)]:
        x = random_input(shape, hp_dtype, seed=3)
        amax, amax_ref = torch.tensor([0.5], device="cuda"), torch.tensor([0.5], device="cuda")
        ct.record_amax(x, amax)
        ct.record_amax_reference(x, amax_ref)
        assert torch.equal(amax, amax_ref)
    x[1, 2] = math.nan
    ct.record_amax(x, amax)
    assert math.isnan(amax.item())


@pytest.mark.gpu
@requires_triton
def test_triton_views_of_any_alignment():
    # The launchers key their compiled kernels on pointer alignment: an aligned call followed by
    # unaligned views of the same shapes (amax and scale inside a delayed-scaling state, x at an
    # odd offset) must each get a kernel specialized for them. (scale_inv is now allocated by
    # quantize, so it is always aligned.)
    fp8 = torch.float8_e4m3fn
    base = random_input((1, 64 * 128 + 1), torch.bfloat16).view(-1)
    history, scales = torch.zeros((4, 3), device="cuda"), torch.full((3,), 2.0, device="cuda")
    for offset, col in [(0, 0), (1, 1), (0, 2), (1, 0)]:
        x = base[offset : offset + 64 * 128].view(64, 128)
        amax, scale = history[0, col : col + 1], scales[col : col + 1]
        amax_ref = amax.clone()
        *out, scale_inv = ct.quantize(x, CastSpec(fp8, True, True, scale, amax))
        *ref, scale_inv_ref = ct.quantize_reference(x, CastSpec(fp8, True, True, scale, amax_ref))
        assert_same(out, ref)
        assert torch.equal(amax, amax_ref) and same_bits(scale_inv, scale_inv_ref)
        history[1].zero_()
        ct.record_amax(x[1:], history[1, col : col + 1])
        assert history[1, col].item() == x[1:].float().abs().max().item()


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("shape,current_launches", [((16, 1024), 1), ((1024, 1024), 3)])
def test_triton_launch_counts(shape, current_launches):
    # Current scaling: one program for a small x; zeroed amax buffer + amax + cast otherwise.
    x = random_input(shape, torch.bfloat16)
    scale, amax = torch.ones(1, device="cuda"), torch.zeros(1, device="cuda")
    fp8 = torch.float8_e4m3fn
    delayed_spec = CastSpec(fp8, True, True, scale, amax)
    current_spec = CastSpec(fp8, True, True, amax_epsilon=0.0, power_2_scale=True)

    def delayed():
        ct.quantize(x, delayed_spec)

    def current():
        ct.quantize(x, current_spec)

    def amax_only():
        ct.record_amax(x, amax)

    for fn in (delayed, current, amax_only):
        fn()  # compile outside the profile
    counts = [count_device_ops(fn) for fn in (delayed, current, amax_only)]
    if counts == [0, 0, 0]:
        pytest.skip("the profiler records no GPU activity here")
    assert counts == [1, current_launches, 1]
