"""Grouped FP8 cast + transpose + amax: the torch reference against cast_transpose's one-tensor
references group by group (CPU), the Triton kernels against the reference byte for byte (Triton's
CPU interpreter; GPU), and the launch counts (GPU)."""

from __future__ import annotations

import math

import pytest
import torch
from interpreter import requires_interpreter, run_under_interpreter
from launches import count_device_ops
from tolerances import same_bits

from torchte._sizes import round_up
from torchte.kernels import cast_transpose as ct
from torchte.kernels import grouped_cast as gc
from torchte.kernels._triton import triton_available
from torchte.kernels.cast_spec import CastSpec

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
HP_DTYPES = [torch.float32, torch.bfloat16]
SPLITS = [[7, 0, 33, 1], [0, 0, 5], [20], [16, 32, 0], [0]]

requires_triton = pytest.mark.skipif(not triton_available(), reason="needs a CUDA GPU and Triton")


def u8(t: torch.Tensor | None) -> torch.Tensor | None:
    """FP8 data as its bytes."""
    return None if t is None else t.view(torch.uint8)


def random_input(shape, dtype, device="cpu", seed=0) -> torch.Tensor:
    """Normal values, a few huge (to saturate) and a few tiny (FP8 subnormals and zero)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(shape, device=device, generator=gen) * 3
    x.view(-1)[::7] *= 1e-3
    x.view(-1)[::13] *= 300
    x.view(-1)[::29] = 0.0
    return x.to(dtype)


def group_scales(groups: int, fp8_dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """A different scale per group, some making values saturate."""
    return ct.FP8_MAX[fp8_dtype] / torch.linspace(2.0, 600.0, groups, device=device)


def columnwise_blocks(data_t: torch.Tensor, m_splits: list[int], features: int):
    """Group g's (K, round_up(m_g, 16)) block of the flat columnwise output, as bytes."""
    blocks, start = [], 0
    for rows in m_splits:
        padded = round_up(rows, 16)
        blocks.append(u8(data_t)[start : start + features * padded].view(features, padded))
        start += features * padded
    assert start == data_t.numel()
    return blocks


def assert_same(out, ref):
    for got, want in zip(out, ref, strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(u8(got), u8(want))


# ----------------------------------------------------------------------------------------------
# The reference against cast_transpose's references, group by group (CPU)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("features", [1, 17, 64])
@pytest.mark.parametrize("m_splits", SPLITS)
@pytest.mark.parametrize("hp_dtype", HP_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_delayed_reference_matches_single_tensor(fp8_dtype, hp_dtype, m_splits, features):
    groups = len(m_splits)
    x = random_input((sum(m_splits), features), hp_dtype, seed=features)
    row_offsets, col_offsets = gc.grouped_offsets(m_splits, "cpu")
    scale = group_scales(groups, fp8_dtype)
    amax = torch.linspace(0.5, 1.5, groups)
    amax_before = amax.clone()
    spec = CastSpec(fp8_dtype, True, True, scale, amax)
    data, data_t, scale_inv = gc.quantize_grouped(x, m_splits, row_offsets, col_offsets, spec)
    assert data.shape == x.shape and data.dtype == fp8_dtype and data_t.dtype == fp8_dtype
    assert data_t.shape == (features * sum(round_up(m, 16) for m in m_splits),)
    blocks = columnwise_blocks(data_t, m_splits, features)
    start = 0
    for g, rows in enumerate(m_splits):
        amax_g = amax_before[g : g + 1].clone()
        spec_g = CastSpec(fp8_dtype, True, True, scale[g : g + 1], amax_g)
        one = ct.quantize_reference(x[start : start + rows], spec_g)
        scale_inv_g = one[2]
        assert torch.equal(u8(data)[start : start + rows], u8(one[0]))
        assert torch.equal(blocks[g], u8(one[1]))
        assert torch.equal(amax[g : g + 1], amax_g) and torch.equal(
            scale_inv[g : g + 1], scale_inv_g
        )
        start += rows


@pytest.mark.parametrize("eps,power_2", [(0.0, False), (0.0, True), (1e-3, False), (1e-3, True)])
@pytest.mark.parametrize("features", [1, 17, 64])
@pytest.mark.parametrize("m_splits", SPLITS)
@pytest.mark.parametrize("hp_dtype", HP_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_current_reference_matches_single_tensor(
    fp8_dtype, hp_dtype, m_splits, features, eps, power_2
):
    groups = len(m_splits)
    x = random_input((sum(m_splits), features), hp_dtype, seed=features + 1)
    start = 0
    for rows in m_splits:  # a different amax per group
        x[start : start + rows] *= 2.0 ** (rows % 5 - 2)
        start += rows
    row_offsets, col_offsets = gc.grouped_offsets(m_splits, "cpu")
    amax = torch.empty(groups)  # overwritten with each group's amax
    spec = CastSpec(fp8_dtype, True, True, amax=amax, amax_epsilon=eps, power_2_scale=power_2)
    data, data_t, scale_inv = gc.quantize_grouped(x, m_splits, row_offsets, col_offsets, spec)
    assert amax.shape == (groups,) and amax.dtype == torch.float32
    blocks = columnwise_blocks(data_t, m_splits, features)
    start = 0
    for g, rows in enumerate(m_splits):
        x_g, amax_g = x[start : start + rows], torch.zeros(1)
        spec_g = CastSpec(fp8_dtype, True, True, amax_epsilon=eps, power_2_scale=power_2)
        one = ct.quantize_reference(x_g, spec_g)
        scale_inv_g = one[2]
        ct.record_amax_reference(x_g, amax_g)
        assert torch.equal(u8(data)[start : start + rows], u8(one[0]))
        assert torch.equal(blocks[g], u8(one[1]))
        assert torch.equal(amax[g : g + 1], amax_g) and torch.equal(
            scale_inv[g : g + 1], scale_inv_g
        )
        start += rows


def test_columnwise_blocks_are_padded_transposes_of_rowwise():
    m_splits, features = [3, 0, 17, 16], 5
    x = random_input((sum(m_splits), features), torch.bfloat16)
    offsets = gc.grouped_offsets(m_splits, "cpu")
    spec = CastSpec(torch.float8_e4m3fn, True, True, amax_epsilon=0.0, power_2_scale=False)
    data, data_t, _ = gc.quantize_grouped(x, m_splits, *offsets, spec)
    start = 0
    for block, rows in zip(columnwise_blocks(data_t, m_splits, features), m_splits, strict=True):
        assert torch.equal(block[:, :rows], u8(data)[start : start + rows].t())
        assert not block[:, rows:].any()
        start += rows


@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (False, True), (False, False)])
def test_reference_usage(rowwise, columnwise):
    m_splits, features, fp8 = [5, 0, 9], 3, torch.float8_e5m2
    x = random_input((14, features), torch.bfloat16)
    offsets = gc.grouped_offsets(m_splits, "cpu")
    scale, amax = group_scales(3, fp8), torch.zeros(3)
    both = gc.quantize_grouped(x, m_splits, *offsets, CastSpec(fp8, 1, 1, scale, amax))
    out = gc.quantize_grouped(
        x, m_splits, *offsets, CastSpec(fp8, rowwise, columnwise, scale, amax)
    )
    assert (out[0] is not None) == rowwise and (out[1] is not None) == columnwise
    for got, want in zip(out[:2], both[:2], strict=True):
        if got is not None:
            assert torch.equal(u8(got), u8(want))
    current = gc.quantize_grouped(
        x, m_splits, *offsets, CastSpec(fp8, rowwise, columnwise, None, None, 0.0, False)
    )
    assert (current[0] is not None) == rowwise and (current[1] is not None) == columnwise


def test_delayed_amax_accumulates_per_group_and_carries_nan():
    m_splits, fp8 = [2, 0, 3], torch.float8_e4m3fn
    offsets = gc.grouped_offsets(m_splits, "cpu")
    scale, amax = torch.tensor([1.0, 2.0, 4.0]), torch.tensor([0.0, 9.0, 5.0])
    spec = CastSpec(fp8, 1, 1, scale, amax)
    for value in [2.0, -7.0, 3.0]:
        x = torch.full((5, 4), value)
        x[2:] *= 0.5
        *_, scale_inv = gc.quantize_grouped(x, m_splits, *offsets, spec)
    assert amax.tolist() == [7.0, 9.0, 5.0] and scale_inv.tolist() == [1.0, 0.5, 0.25]
    x[3, 1] = math.nan
    gc.quantize_grouped(x, m_splits, *offsets, spec)
    assert amax[:2].tolist() == [7.0, 9.0] and math.isnan(amax[2].item())


def test_current_amax_buffer_is_overwritten_and_returned():
    m_splits, fp8 = [4, 0, 2], torch.float8_e4m3fn
    x = torch.tensor([[1.0], [-3.0], [2.0], [0.5], [-0.25], [0.125]])
    buffer = torch.full((3,), 100.0)
    offsets = gc.grouped_offsets(m_splits, "cpu")
    spec = CastSpec(fp8, True, False, amax=buffer, amax_epsilon=0.0, power_2_scale=True)
    *_, scale_inv = gc.quantize_grouped(x, m_splits, *offsets, spec)
    assert buffer.tolist() == [3.0, 0.0, 0.25]
    assert scale_inv[1].item() == 1.0  # an empty group: amax 0, scale 1


def test_zero_tokens_and_zero_features():
    fp8 = torch.float8_e4m3fn
    for m_splits, features in [([0, 0], 8), ([3, 2], 0)]:
        x = torch.empty((sum(m_splits), features))
        offsets = gc.grouped_offsets(m_splits, "cpu")
        scale, amax = torch.tensor([2.0, 4.0]), torch.ones(2)
        spec = CastSpec(fp8, True, True, scale, amax)
        data, data_t, scale_inv = gc.quantize_grouped(x, m_splits, *offsets, spec)
        assert data.shape == x.shape and data_t.numel() == features * 16 * sum(map(bool, m_splits))
        assert amax.tolist() == [1.0, 1.0] and scale_inv.tolist() == [0.5, 0.25]


def test_grouped_offsets_values_and_cache():
    row_offsets, col_offsets = gc.grouped_offsets([7, 0, 33, 16, 1], "cpu")
    assert row_offsets.dtype == col_offsets.dtype == torch.int32
    assert row_offsets.tolist() == [0, 7, 7, 40, 56, 57]
    assert col_offsets.tolist() == [0, 16, 16, 64, 80, 96]
    again = gc.grouped_offsets((7, 0, 33, 16, 1), torch.device("cpu"))
    assert again[0] is row_offsets and again[1] is col_offsets


def _delayed_args(m_splits, tokens=6, groups=None, **override):
    """quantize_grouped's keyword arguments; an override names an argument or a CastSpec
    field."""
    groups = len(m_splits) if groups is None else groups
    offsets = gc.grouped_offsets([max(m, 0) for m in m_splits], "cpu")
    args = dict(
        x=torch.zeros(tokens, 4),
        m_splits=m_splits,
        row_offsets=offsets[0],
        col_offsets=offsets[1],
    )
    fields = dict(
        scale=torch.ones(groups),
        amax=torch.zeros(groups),
        fp8_dtype=torch.float8_e4m3fn,
        rowwise=True,
        columnwise=True,
    )
    for name, value in override.items():
        (fields if name in fields or name in CastSpec.__slots__ else args)[name] = value
    return dict(args, spec=CastSpec(**fields))


@pytest.mark.parametrize(
    "args,match",
    [
        (_delayed_args([2, 4], groups=3), "scale has 3 elements but there are 2 groups"),
        (_delayed_args([2, 4], amax=torch.zeros(1)), "amax has 1 elements"),
        (_delayed_args([2, 5]), "m_splits sum to 7, not to the token count 6"),
        (_delayed_args([8, -2]), "m_splits must be non-negative"),
        (_delayed_args([2, 4], x=torch.zeros(6)), "x must be 2-D"),
        (_delayed_args([2, 4], row_offsets=torch.tensor([0, 2])), "row_offsets must be int32"),
        (
            _delayed_args([2, 4], col_offsets=torch.tensor([0, 16, 32])),
            "col_offsets must be int32",
        ),
        (_delayed_args([2, 4], fp8_dtype=torch.bfloat16), "fp8_dtype must be one of"),
        (_delayed_args([2, 4], scale=torch.ones(2, device="meta")), "scale is on meta"),
    ],
)
def test_validation_errors(args, match):
    for fn in (gc.quantize_grouped, gc.quantize_grouped_reference):
        with pytest.raises(ValueError, match=match):
            fn(**args)


def test_validation_errors_current():
    current = dict(scale=None, amax=None, amax_epsilon=0.0, power_2_scale=False)
    for fn in (gc.quantize_grouped, gc.quantize_grouped_reference):
        with pytest.raises(ValueError, match="amax has 3 elements"):
            fn(**_delayed_args([2, 4], **dict(current, amax=torch.zeros(3))))
        with pytest.raises(ValueError, match="m_splits sum to 5, not to the token count"):
            fn(**_delayed_args([1, 4], **current))


# ----------------------------------------------------------------------------------------------
# The Triton kernels under Triton's CPU interpreter (where triton is installed)
# ----------------------------------------------------------------------------------------------

# Runs in a fresh process: TRITON_INTERPRET must be set before the kernels are defined. FP8
# outputs are allocated poisoned (0xA5), so a byte the kernel fails to write shows.
INTERPRETER_SCRIPT = """
import math
import torch
from tolerances import same_bits

from torchte.kernels import grouped_cast as gc
from torchte.kernels.cast_spec import CastSpec

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
_empty = torch.empty

def poisoned_empty(*shape, dtype=None, **kwargs):
    out = _empty(*shape, dtype=dtype, **kwargs)
    if dtype in FP8:
        out.view(torch.uint8).fill_(0xA5)
    return out

torch.empty = poisoned_empty

def same(out, ref, what):
    for got, want in zip(out, ref):
        assert (got is None) == (want is None), what
        if got is not None:
            assert got.dtype == want.dtype and got.shape == want.shape, what
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), what

def check(x, m_splits, fp8, config, power_2=False, eps=0.0, usage=(True, True)):
    groups, what = len(m_splits), (tuple(x.shape), x.dtype, m_splits, fp8, config, usage)
    offsets = gc.grouped_offsets(m_splits, "cpu")
    # Delayed: one launch.
    scale = gc.FP8_MAX[fp8] / torch.linspace(2.0, 600.0, groups)
    amax, amax_ref = torch.linspace(0.5, 1.5, groups), torch.linspace(0.5, 1.5, groups)
    out = gc._grouped_cast_transpose(
        x, m_splits, *offsets, CastSpec(fp8, *usage, scale, amax), None, config)
    ref = gc.quantize_grouped_reference(
        x, m_splits, *offsets, CastSpec(fp8, *usage, scale, amax_ref))
    same(out[:2], ref[:2], what)
    assert torch.equal(amax.nan_to_num(-1.0), amax_ref.nan_to_num(-1.0)), what
    assert same_bits(out[2], ref[2]), what
    # Current: the amax kernel, then the cast making each group's scale.
    amax, amax_ref = torch.zeros(groups), torch.empty(groups)
    gc._grouped_amax(x, m_splits, offsets[0], amax, (config[0] * 2, config[1], 4))
    current = dict(amax_epsilon=eps, power_2_scale=power_2)
    out = gc._grouped_cast_transpose(
        x, m_splits, *offsets, CastSpec(fp8, *usage, **current), amax, config)
    ref = gc.quantize_grouped_reference(
        x, m_splits, *offsets, CastSpec(fp8, *usage, amax=amax_ref, **current))
    same(out[:2], ref[:2], what)
    assert torch.equal(amax.nan_to_num(-1.0), amax_ref.nan_to_num(-1.0)), what
    assert same_bits(out[2], ref[2]), what

def random_input(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * 3
    x.view(-1)[::7] *= 1e-3
    x.view(-1)[::13] *= 300
    x.view(-1)[::29] = 0.0
    return x.to(dtype)

CASES = [  # (m_splits, features, config): groups smaller than, equal to and past a tile
    ([7, 0, 33, 1], 37, (16, 32, 4)),
    ([0, 16, 5, 0], 64, (32, 32, 4)),
    ([50], 17, (16, 16, 4)),
    ([1, 1, 1], 1, (16, 16, 4)),
    ([0] * 9 + [3, 0, 20, 0, 0, 0, 0, 2, 0, 0, 1], 24, (16, 16, 4)),  # G = 20 > 16
]
for i, (m_splits, features, config) in enumerate(CASES):
    for j, dtype in enumerate([torch.float32, torch.bfloat16, torch.float16]):
        for k, fp8 in enumerate(FP8):
            x = random_input((sum(m_splits), features), dtype, seed=i * 6 + j * 2 + k)
            check(x, m_splits, fp8, config, power_2=(i + j + k) % 2 == 1, eps=1e-3 * (k == 1))
x = random_input((40, 20), torch.bfloat16, seed=99)
for usage in [(True, False), (False, True), (False, False)]:
    check(x, [9, 0, 31], torch.float8_e4m3fn, (16, 32, 4), usage=usage)
x[12, 3] = math.nan  # a NaN reaches its own group's amax only
check(x, [9, 0, 31], torch.float8_e5m2, (16, 32, 4), power_2=True)
print("ok")
"""


@requires_interpreter
def test_triton_kernels_in_interpreter_match_reference():
    run_under_interpreter(INTERPRETER_SCRIPT)


# ----------------------------------------------------------------------------------------------
# Triton vs the reference on the GPU, and launch counts
# ----------------------------------------------------------------------------------------------

GPU_SPLITS = [
    [700, 0, 1, 1024, 333, 15, 1000, 1023],  # 8 groups, 4096 tokens, one empty
    [4096],
    [0] * 40 + [17] * 8 + [0] * 15 + [3960],  # 64 groups, mostly empty
]


def _gpu_case(m_splits, features, hp_dtype, fp8_dtype, seed=0):
    groups = len(m_splits)
    x = random_input((sum(m_splits), features), hp_dtype, device="cuda", seed=seed)
    return x, gc.grouped_offsets(m_splits, "cuda"), group_scales(groups, fp8_dtype, "cuda")


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("features", [4096, 1024, 129])
@pytest.mark.parametrize("m_splits", GPU_SPLITS)
@pytest.mark.parametrize("hp_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_triton_delayed_matches_reference(fp8_dtype, hp_dtype, m_splits, features):
    x, offsets, scale = _gpu_case(m_splits, features, hp_dtype, fp8_dtype, seed=features)
    amax = torch.linspace(0.5, 1.5, len(m_splits), device="cuda")
    amax_ref = amax.clone()
    common = (x, m_splits, *offsets)
    out = gc.quantize_grouped(*common, CastSpec(fp8_dtype, True, True, scale, amax))
    ref = gc.quantize_grouped_reference(*common, CastSpec(fp8_dtype, True, True, scale, amax_ref))
    assert_same(out[:2], ref[:2])
    assert torch.equal(amax, amax_ref) and same_bits(out[2], ref[2])


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("eps,power_2", [(0.0, False), (1e-3, True)])
@pytest.mark.parametrize("features", [4096, 1024, 129])
@pytest.mark.parametrize("m_splits", GPU_SPLITS)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_triton_current_matches_reference(fp8_dtype, m_splits, features, eps, power_2):
    x, offsets, _ = _gpu_case(m_splits, features, torch.bfloat16, fp8_dtype, seed=features + 1)
    groups = len(m_splits)
    # Each group's amax is written to these buffers (read as the amax the call found).
    amax, amax_ref = torch.empty(groups, device="cuda"), torch.empty(groups, device="cuda")
    common = (x, m_splits, *offsets)
    current = dict(amax_epsilon=eps, power_2_scale=power_2)
    out = gc.quantize_grouped(*common, CastSpec(fp8_dtype, True, True, amax=amax, **current))
    ref = gc.quantize_grouped_reference(
        *common, CastSpec(fp8_dtype, True, True, amax=amax_ref, **current)
    )
    assert_same(out[:2], ref[:2])
    assert torch.equal(amax, amax_ref) and same_bits(out[2], ref[2])


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("m_splits", GPU_SPLITS)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_triton_current_with_amax_reduction_matches_reference(fp8_dtype, m_splits):
    """A reduction (as tensor parallelism's MAX over the ranks) raising some groups' amaxes:
    the kernels cast with the reduced amaxes, byte for byte as the reference."""
    x, offsets, _ = _gpu_case(m_splits, 1024, torch.bfloat16, fp8_dtype, seed=5)
    floor = torch.zeros(len(m_splits), device="cuda")
    floor[::3] = 1e5  # above every group's own amax (random_input stays below 1e4)
    calls = []

    def reduce_max(amax: torch.Tensor) -> None:
        calls.append(amax.clone())
        torch.maximum(amax, floor, out=amax)

    common = (x, m_splits, *offsets)
    spec = CastSpec(fp8_dtype, True, True)
    out = gc.quantize_grouped(*common, spec, reduce_max)
    ref = gc.quantize_grouped_reference(*common, spec, reduce_max)
    assert len(calls) == 2 and torch.equal(calls[0], calls[1])  # the groups' own amaxes
    assert_same(out[:2], ref[:2])
    assert same_bits(out[2], ref[2])
    plain = gc.quantize_grouped(*common, spec)
    raised = (floor > calls[0]).cpu()
    assert torch.equal(out[2].cpu()[~raised], plain[2].cpu()[~raised])
    assert (out[2].cpu()[raised] > plain[2].cpu()[raised]).all()


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (False, True), (False, False)])
def test_triton_usage_and_nan(rowwise, columnwise):
    m_splits, fp8 = [100, 0, 37, 300], torch.float8_e4m3fn
    x, offsets, scale = _gpu_case(m_splits, 256, torch.bfloat16, fp8)
    x[120, 7] = math.nan  # group 2
    amax, amax_ref = torch.zeros(4, device="cuda"), torch.zeros(4, device="cuda")
    usage = (rowwise, columnwise)
    out = gc.quantize_grouped(x, m_splits, *offsets, CastSpec(fp8, *usage, scale, amax))
    ref = gc.quantize_grouped_reference(
        x, m_splits, *offsets, CastSpec(fp8, *usage, scale, amax_ref)
    )
    assert_same(out[:2], ref[:2])
    assert math.isnan(amax[2].item()) and torch.equal(amax.nan_to_num(-1), amax_ref.nan_to_num(-1))
    assert same_bits(out[2], ref[2])


@pytest.mark.gpu
@requires_triton
def test_triton_views_of_any_alignment():
    # The launch cache keys on pointer alignment: x at an odd offset and per-group vectors that
    # are unaligned views (as rows of a delayed-scaling state) must get their own kernels.
    # (scale_inv is allocated by the call, so only scale and amax are views.)
    m_splits, fp8, features = [40, 0, 25], torch.float8_e4m3fn, 96
    base = random_input((65 * features + 3,), torch.bfloat16, device="cuda")
    offsets = gc.grouped_offsets(m_splits, "cuda")
    state = torch.zeros(2, 8, device="cuda")
    state[0] = 8.0
    for shift in [0, 1, 0, 3]:
        x = base[shift : shift + 65 * features].view(65, features)
        scale, amax = state[0, shift : shift + 3], state[1, shift : shift + 3]
        amax_ref = amax.clone()
        out = gc.quantize_grouped(x, m_splits, *offsets, CastSpec(fp8, True, True, scale, amax))
        ref = gc.quantize_grouped_reference(
            x, m_splits, *offsets, CastSpec(fp8, True, True, scale, amax_ref)
        )
        assert_same(out[:2], ref[:2])
        assert torch.equal(amax, amax_ref) and same_bits(out[2], ref[2])


@pytest.mark.gpu
@requires_triton
def test_triton_launch_counts():
    # Delayed: one launch. Current: zeroing the amax buffer + the amax kernel + the cast.
    m_splits, fp8 = GPU_SPLITS[0], torch.float8_e4m3fn
    x, offsets, scale = _gpu_case(m_splits, 1024, torch.bfloat16, fp8)
    amax = torch.zeros(8, device="cuda")

    def delayed():
        gc.quantize_grouped(x, m_splits, *offsets, CastSpec(fp8, 1, 1, scale, amax))

    def current():
        gc.quantize_grouped(x, m_splits, *offsets, CastSpec(fp8, 1, 1, None, None, 0.0, False))

    def current_into_buffer():
        gc.quantize_grouped(x, m_splits, *offsets, CastSpec(fp8, 1, 1, None, amax, 0.0, False))

    fns = (delayed, current, current_into_buffer)
    for fn in fns:
        fn()  # compile outside the profile
    counts = [count_device_ops(fn) for fn in fns]
    if counts == [0, 0, 0]:
        pytest.skip("the profiler records no GPU activity here")
    assert counts == [1, 3, 3]
