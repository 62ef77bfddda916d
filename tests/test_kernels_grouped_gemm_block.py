"""Grouped block-scaled FP8 GEMMs with device-side group sizes (kernels/grouped_gemm_block.py):
the torch references against fp64 products of exactly representable operands, and every
argument check (CPU); the Triton kernels against fp64 under Triton's CPU interpreter. The GPU
tests are in test_grouped_gemm_block_gpu.py.

Operands are built directly: FP8 values k / 8 * 2**e (exact in both FP8 dtypes) and a power of
two per scale block, 2**-3 .. 2**3, drawn independently per block, so that reading the scale of
a wrong block (or row, or group) changes the result. Scale entries no valid index reaches (the
padding of b's tile scales, the scale rows past the last group's blocks) are NaN."""

from __future__ import annotations

import itertools

import pytest
import torch
from interpreter import requires_interpreter, run_under_interpreter
from tolerances import assert_close, representable

from torchte.kernels import grouped_gemm_block as gb
from torchte.kernels.block_layout import block_offsets, max_blocks

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DTYPE_PAIRS = [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2), (E5M2, E5M2)]
# Group sizes: T not a multiple of 128, empty groups (first, middle, last), a group of 1 row.
SPLITS = [[7, 0, 161, 1], [0, 130, 37, 133], [300], [0, 0, 5, 0]]
NAN = float("nan")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fp8_operand(shape, dtype, seed: int) -> torch.Tensor:
    """FP8 values k / 8 * 2**e, |k| <= 8, e in -2..1: exact in both FP8 dtypes."""
    gen = torch.Generator().manual_seed(seed)
    values = representable(tuple(shape), E4M3, generator=gen, device="cpu")
    return torch.ldexp(values, torch.randint(-2, 2, tuple(shape), generator=gen)).to(dtype)


def block_scales(shape, seed: int) -> torch.Tensor:
    """fp32 powers of two 2**-3 .. 2**3, one per entry."""
    gen = torch.Generator().manual_seed(seed)
    return torch.ldexp(torch.ones(shape), torch.randint(-3, 4, tuple(shape), generator=gen))


def offsets(sizes: list[int]) -> torch.Tensor:
    """int32 (G + 1,) running sums of sizes, from 0."""
    return torch.tensor([0, *itertools.accumulate(sizes)], dtype=torch.int32)


def rows_case(splits, reduced, features, dtypes, seed=0, operand=fp8_operand, scales=block_scales):
    """(a (T, R), a_scale, b (G, N, R), b_scale, row_offsets) of grouped_block_rows_gemm, on the
    CPU; operand(shape, dtype, seed) makes the FP8 data, scales(shape, seed) the scales."""
    tokens, groups, r_blocks = sum(splits), len(splits), cdiv(reduced, 128)
    a = operand((tokens, reduced), dtypes[0], seed)
    b = operand((groups, features, reduced), dtypes[1], seed + 1)
    a_scale = scales((r_blocks, tokens), seed + 2)
    b_scale = torch.full((groups, cdiv(features, 128), cdiv(r_blocks, 4) * 4), NAN)
    b_scale[:, :, :r_blocks] = scales((groups, cdiv(features, 128), r_blocks), seed + 3)
    return a, a_scale, b, b_scale, offsets(splits)


def reduction_case(splits, m, n, dtypes, seed=0, operand=fp8_operand, scales=block_scales):
    """(a_cols (m, T), a_scale, b_cols (n, T), b_scale, row_offsets, block_offsets) of
    grouped_block_reduction_gemm, on the CPU (operand and scales as for rows_case)."""
    tokens, groups = sum(splits), len(splits)
    row_offsets = offsets(splits)
    first_blocks = block_offsets(row_offsets)
    used, blocks = int(first_blocks[-1]), max_blocks(tokens, groups)
    a_cols = operand((m, tokens), dtypes[0], seed)
    b_cols = operand((n, tokens), dtypes[1], seed + 1)
    a_scale, b_scale = torch.full((blocks, m), NAN), torch.full((blocks, n), NAN)
    a_scale[:used] = scales((used, m), seed + 2)
    b_scale[:used] = scales((used, n), seed + 3)
    return a_cols, a_scale, b_cols, b_scale, row_offsets, first_blocks


# The fp64 products, from the layouts' definitions (one scale index per element).


def rows_fp64(a, a_scale, b, b_scale, row_offsets) -> torch.Tensor:
    (tokens, reduced), features = a.shape, b.shape[1]
    r_block = torch.arange(reduced) // 128
    a_values = a.double() * a_scale.double()[r_block[None, :], torch.arange(tokens)[:, None]]
    n_block = torch.arange(features) // 128
    out = torch.zeros(tokens, features, dtype=torch.float64)
    for g, (start, end) in enumerate(itertools.pairwise(row_offsets.tolist())):
        b_values = b[g].double() * b_scale[g].double()[n_block[:, None], r_block[None, :]]
        out[start:end] = a_values[start:end] @ b_values.t()
    return out


def reduction_fp64(a_cols, a_scale, b_cols, b_scale, row_offsets, first_blocks) -> torch.Tensor:
    bounds, firsts = row_offsets.tolist(), first_blocks.tolist()
    out = torch.zeros(len(bounds) - 1, a_cols.shape[0], b_cols.shape[0], dtype=torch.float64)
    for g, (start, end) in enumerate(itertools.pairwise(bounds)):
        scale_row = firsts[g] + torch.arange(end - start) // 128  # per token of the group
        a_g = a_cols[:, start:end].double() * a_scale.double()[scale_row].t()
        b_g = b_cols[:, start:end].double() * b_scale.double()[scale_row].t()
        out[g] = a_g @ b_g.t()
    return out


# ----------------------------------------------------------------------------------------------
# The references against fp64 (CPU)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("dtypes", DTYPE_PAIRS)
def test_rows_reference_matches_fp64(dtypes, splits):
    args = rows_case(splits, 272, 200, dtypes, seed=len(splits))
    want = rows_fp64(*args)
    for fn in (gb.grouped_block_rows_gemm, gb.grouped_block_rows_gemm_reference):
        for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
            out = fn(*args, out_dtype)
            assert out.shape == want.shape and out.dtype == out_dtype
            assert_close(out, want, out_dtype)


@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("dtypes", DTYPE_PAIRS)
def test_reduction_reference_matches_fp64(dtypes, splits):
    args = reduction_case(splits, 72, 200, dtypes, seed=len(splits))
    want = reduction_fp64(*args)
    empty = [g for g, m in enumerate(splits) if m == 0]
    for fn in (gb.grouped_block_reduction_gemm, gb.grouped_block_reduction_gemm_reference):
        for out_dtype in (torch.float32, torch.bfloat16):
            out = fn(*args, out_dtype)
            assert out.shape == want.shape and out.dtype == out_dtype
            assert_close(out, want, out_dtype)
            assert not out[empty].any()


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_reduction_writes_and_accumulates_into_out(out_dtype):
    args = reduction_case([0, 130, 37, 133], 40, 24, (E4M3, E4M3), seed=5)
    want = reduction_fp64(*args)
    main_grad = representable((4, 40, 24), torch.bfloat16, scale=4.0, device="cpu")
    for fn in (gb.grouped_block_reduction_gemm, gb.grouped_block_reduction_gemm_reference):
        out = main_grad.to(out_dtype, copy=True)
        got = fn(*args, out_dtype, out=out, accumulate=True)
        assert got is out
        # Empty group 0 keeps what was there; the others add in fp32, rounded once.
        assert torch.equal(out[0], main_grad[0].to(out_dtype))
        assert_close(out, want + main_grad.double(), out_dtype)
        got = fn(*args, out_dtype, out=out)
        assert got is out and not out[0].any()
        assert_close(out, want, out_dtype)


def test_scales_vary_per_block_so_a_wrong_index_shows():
    # The operands' check on themselves: reading a neighbouring block's scale must change the
    # product beyond the fp32 tolerance, for each operand of both GEMMs.
    rows = rows_case([7, 0, 161, 1], 272, 200, (E4M3, E4M3))
    want = rows_fp64(*rows)
    a, a_scale, b, b_scale, row_offsets = rows
    shifted = [
        rows_fp64(a, a_scale.roll(1, 0), b, b_scale, row_offsets),
        rows_fp64(a, a_scale, b, b_scale.roll(1, 1), row_offsets),
        rows_fp64(a, a_scale, b, b_scale.roll(1, 2), row_offsets),
        rows_fp64(a, a_scale.roll(1, 1), b, b_scale, row_offsets),
    ]
    reduction = reduction_case([0, 130, 37, 133], 72, 200, (E4M3, E4M3))
    a_cols, a_s, b_cols, b_s, row_offsets, firsts = reduction
    used = int(firsts[-1])
    roll = torch.cat([a_s[:used].roll(1, 0), a_s[used:]])
    shifted.append(reduction_fp64(a_cols, roll, b_cols, b_s, row_offsets, firsts))
    want_reduction = reduction_fp64(*reduction)
    for i, other in enumerate(shifted):
        expected = want if i < 4 else want_reduction
        with pytest.raises(AssertionError):
            assert_close(other, expected, torch.float32, msg=str(i))


def test_empty_dimensions():
    for splits, reduced, features in [
        ([0, 0], 16, 8),
        ([3, 2], 16, 0),
        ([3, 2], 0, 8),
        ([], 16, 8),
    ]:
        args = rows_case(splits, reduced, features, (E4M3, E4M3))
        for fn in (gb.grouped_block_rows_gemm, gb.grouped_block_rows_gemm_reference):
            out = fn(*args, torch.bfloat16)
            assert out.shape == (sum(splits), features) and not out.any()
    for splits, m, n in [([0, 0], 8, 8), ([3, 2], 0, 8), ([3, 2], 8, 0), ([], 8, 8)]:
        args = reduction_case(splits, m, n, (E4M3, E4M3))
        for fn in (gb.grouped_block_reduction_gemm, gb.grouped_block_reduction_gemm_reference):
            out = fn(*args, torch.float32)
            assert out.shape == (len(splits), m, n) and not out.any()
            ones = torch.ones(len(splits), m, n)
            assert torch.equal(fn(*args, torch.float32, out=ones, accumulate=True), ones)


# ----------------------------------------------------------------------------------------------
# Argument checks: ValueError / TypeError naming the argument, before any kernel
# ----------------------------------------------------------------------------------------------


def _rows_args(**override):
    names = ("a", "a_scale", "b", "b_scale", "row_offsets")
    args = dict(zip(names, rows_case([3, 0, 5], 144, 8, (E4M3, E4M3)), strict=True))
    return {**args, "out_dtype": torch.bfloat16, **override}


def _reduction_args(**override):
    names = ("a_cols", "a_scale", "b_cols", "b_scale", "row_offsets", "block_offsets")
    args = dict(zip(names, reduction_case([3, 0, 5], 8, 4, (E5M2, E4M3)), strict=True))
    return {**args, "out_dtype": torch.float32, **override}


def _fp8(*shape, device="cpu"):
    return torch.zeros(shape, dtype=E4M3, device=device)


ROWS_ERRORS = [
    (dict(a=torch.zeros(8, 144)), TypeError, "a must be one of"),
    (dict(b=torch.zeros(3, 8, 144, dtype=torch.bfloat16)), TypeError, "b must be one of"),
    (dict(a=_fp8(8 * 144)), ValueError, "a must be 2-D"),
    (dict(b=_fp8(24, 144)), ValueError, "b must be 3-D"),
    (dict(b=_fp8(3, 8, 160)), ValueError, "a's R = 144 as its last dimension"),
    (dict(a=_fp8(8, 136), b=_fp8(3, 8, 136)), ValueError, "multiple of 16, got 136"),
    (dict(b=_fp8(3, 8, 144, device="meta")), ValueError, "b is on meta"),
    (dict(b=_fp8(0, 8, 144), row_offsets=offsets([])), ValueError, "no groups, so there must"),
    (dict(row_offsets=offsets([3, 0, 5]).long()), ValueError, "row_offsets must be torch.int32"),
    (dict(row_offsets=offsets([3, 5])), ValueError, r"row_offsets must be .* shape \(4,\)"),
    (dict(a_scale=torch.ones(2, 8, dtype=torch.float64)), ValueError, "a_scale must be"),
    (dict(a_scale=torch.ones(8, 2)), ValueError, r"a_scale must be .* shape \(2, 8\)"),
    (dict(b_scale=torch.ones(3, 1, 2)), ValueError, r"b_scale must be .* shape \(3, 1, 4\)"),
    (dict(a_scale=torch.ones(2, 8, device="meta")), ValueError, "a_scale is on meta"),
    (dict(out_dtype=E4M3), TypeError, "out_dtype must be one of"),
]
REDUCTION_ERRORS = [
    (dict(a_cols=torch.zeros(8, 8)), TypeError, "a_cols must be one of"),
    (dict(b_cols=_fp8(4 * 8)), ValueError, "b_cols must be 2-D"),
    (dict(b_cols=_fp8(4, 9)), ValueError, "a_cols' T = 8 columns"),
    (dict(b_cols=_fp8(4, 8, device="meta")), ValueError, "b_cols is on meta"),
    (dict(row_offsets=torch.zeros(0, dtype=torch.int32)), ValueError, "row_offsets must be 1-D"),
    (dict(row_offsets=torch.tensor([0, 3, 3, 8])), ValueError, "must be torch.int32"),
    (dict(block_offsets=offsets([1, 0])), ValueError, r"block_offsets must be .* shape \(4,\)"),
    (dict(a_scale=torch.ones(3, 8)), ValueError, r"a_scale must be .* shape \(4, 8\)"),
    (dict(b_scale=torch.ones(4, 4, dtype=torch.bfloat16)), ValueError, "b_scale must be"),
    (dict(out_dtype=torch.int32), TypeError, "out_dtype must be one of"),
    (dict(accumulate=True), ValueError, "accumulate=True needs `out`"),
    (dict(out=torch.zeros(3, 8, 5)), ValueError, r"out must be .* shape \(3, 8, 4\)"),
    (dict(out=torch.zeros(3, 8, 4, dtype=torch.bfloat16)), ValueError, "out must be torch.float32"),
    (dict(out=torch.zeros(3, 4, 8).transpose(1, 2)), ValueError, "out must be contiguous"),
]


@pytest.mark.parametrize("override,error,match", ROWS_ERRORS)
def test_rows_argument_checks(override, error, match):
    for fn in (gb.grouped_block_rows_gemm, gb.grouped_block_rows_gemm_reference):
        with pytest.raises(error, match=match):
            fn(**_rows_args(**override))


@pytest.mark.parametrize("override,error,match", REDUCTION_ERRORS)
def test_reduction_argument_checks(override, error, match):
    for fn in (gb.grouped_block_reduction_gemm, gb.grouped_block_reduction_gemm_reference):
        with pytest.raises(error, match=match):
            fn(**_reduction_args(**override))


@pytest.mark.parametrize(
    "which,values,match",
    [
        ("rows", [0, 5, 3, 8], "never decrease"),
        ("rows", [1, 3, 3, 8], "start at 0"),
        ("rows", [0, 3, 3, 7], "end at the token count 8"),
        ("reduction", [0, 5, 3, 8], "never decrease"),
        ("reduction", [0, 3, 3, 9], "end at the token count 8"),
        ("blocks", [0, 1, 1, 3], "block_offsets must be the running sum"),
    ],
)
def test_references_check_the_offsets_they_read(which, values, match):
    # The kernels trust the offsets (reading them would sync); the references check them.
    values = torch.tensor(values, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        if which == "rows":
            gb.grouped_block_rows_gemm_reference(**_rows_args(row_offsets=values))
        elif which == "reduction":
            gb.grouped_block_reduction_gemm_reference(**_reduction_args(row_offsets=values))
        else:
            gb.grouped_block_reduction_gemm_reference(**_reduction_args(block_offsets=values))


def test_tile_widths_are_checked():
    for block_n in (0, 48, 512):
        with pytest.raises(ValueError, match="BLOCK_N must be a power of two up to 256"):
            gb._slices(block_n)
    assert [gb._slices(n) for n in (16, 128, 256)] == [16, 128, 128]


# ----------------------------------------------------------------------------------------------
# The Triton kernels under Triton's CPU interpreter (where triton is installed)
# ----------------------------------------------------------------------------------------------

# Runs in a fresh process (TRITON_INTERPRET must be set before the kernels are defined). Outputs
# are allocated poisoned with NaN, so an element the kernel fails to write shows; the operands'
# unused scale entries are NaN, so a scale read from a wrong place shows. Configs:
# (BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_N 256 is the two-slice tile.
INTERPRETER_SCRIPT = """
import torch
from tolerances import assert_close, representable
from test_kernels_grouped_gemm_block import (
    E4M3, E5M2, reduction_case, reduction_fp64, rows_case, rows_fp64,
)

from torchte.kernels import grouped_gemm_block as gb

_empty = torch.empty

def poisoned_empty(*shape, dtype=None, **kwargs):
    out = _empty(*shape, dtype=dtype, **kwargs)
    if dtype is not None and dtype.is_floating_point:
        out.fill_(float("nan"))
    return out

torch.empty = poisoned_empty

ROWS = [  # (splits, R, N, dtypes, config)
    ([7, 0, 161, 1], 272, 200, (E4M3, E4M3), (32, 64, 4, 2)),  # idle programs, 3 R-steps
    ([0, 40, 5, 0], 144, 300, (E5M2, E4M3), (16, 256, 4, 1)),  # two slices, the second partial
    ([50], 16, 17, (E4M3, E5M2), (64, 16, 4, 2)),
    ([0] * 9 + [3, 0, 20, 0, 0, 0, 0, 2, 0, 0, 1], 128, 136, (E5M2, E5M2), (16, 256, 4, 2)),
]
for i, (splits, reduced, features, dtypes, config) in enumerate(ROWS):
    args = rows_case(splits, reduced, features, dtypes, seed=i)
    want = rows_fp64(*args)
    for out_dtype in (torch.float32, torch.bfloat16) if i == 0 else (torch.float32,):
        out = gb._rows_gemm(*args, out_dtype, config)
        assert out.dtype == out_dtype
        assert_close(out, want, out_dtype, msg=str((i, out_dtype)))

# Groups starting on 16 tokens (T too) take whole blocks, then a last block of whole 16-byte
# chunks with the columns past the group zeroed; the others byte loads, 32 columns at a time.
REDUCTIONS = [  # (splits, N, K, dtypes, config)
    ([0, 130, 37, 133], 40, 200, (E5M2, E4M3), (32, 64, 4, 2)),  # T = 300: no 16-byte path
    # Starts 0, 16, 16, 53, 64, 336 of T = 368: aligned tails of 37 and 16 columns, unaligned
    # 11; 256-wide tiles, the second slice partial.
    ([16, 0, 37, 11, 272, 32], 24, 300, (E4M3, E4M3), (16, 256, 4, 1)),
    ([0, 0], 8, 8, (E4M3, E4M3), (16, 16, 4, 2)),  # nothing to reduce: zeros written
    ([5], 17, 33, (E4M3, E5M2), (32, 32, 4, 2)),
]
for i, (splits, m, n, dtypes, config) in enumerate(REDUCTIONS):
    args = reduction_case(splits, m, n, dtypes, seed=i)
    want = reduction_fp64(*args)
    for out_dtype in (torch.float32, torch.bfloat16) if i == 0 else (torch.float32,):
        out = torch.empty(len(splits), m, n, dtype=out_dtype)
        gb._reduction_gemm(*args, out, False, config)
        assert_close(out, want, out_dtype, msg=str((i, out_dtype)))
    main_grad = representable((len(splits), m, n), torch.bfloat16, scale=4.0, device="cpu")
    out = main_grad.clone()
    gb._reduction_gemm(*args, out, True, config)
    assert_close(out, want + main_grad.double(), torch.float32, msg=str((i, "accumulate")))
print("ok")
"""


@requires_interpreter
def test_triton_kernels_in_interpreter_match_fp64():
    run_under_interpreter(INTERPRETER_SCRIPT)
