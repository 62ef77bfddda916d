"""Grouped FP8 GEMMs with device-side group sizes: the torch references against fp64 products of
exactly representable operands, and every argument check (CPU); the Triton kernels against the
references under Triton's CPU interpreter; the kernels against per-group torch._scaled_mm, in a
CUDA graph, and their launch count (GPU)."""

from __future__ import annotations

import itertools

import pytest
import torch
from interpreter import requires_interpreter, run_under_interpreter
from launches import count_device_ops
from tolerances import assert_close_to_scale, representable

from torchte.gemm import fp8_gemm
from torchte.kernels import grouped_gemm_fp8 as gg
from torchte.kernels._triton import triton_available

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DTYPE_PAIRS = [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2), (E5M2, E5M2)]
SPLITS = [[7, 0, 33, 1], [0, 0, 5], [20], [16, 32, 0], [0, 0]]
WIDTHS = [[16, 0, 48, 32], [0, 0, 16], [64], [0, 0]]  # w_g of the reduction GEMM

requires_triton = pytest.mark.skipif(not triton_available(), reason="needs a CUDA GPU and Triton")


def fp8_operand(shape, dtype, seed: int, device="cpu") -> torch.Tensor:
    """FP8 values k / 8 * 2**e, |k| <= 8, e in -2..1: exact in both FP8 dtypes, and sums of up
    to 2**12 of their products are exact in fp32 (multiples of 2**-10, each at most 4)."""
    gen = torch.Generator().manual_seed(seed)
    values = representable(tuple(shape), E4M3, generator=gen)
    exponents = torch.randint(-2, 2, tuple(shape), generator=gen)
    return torch.ldexp(values, exponents).to(dtype).to(device)


def scale_invs(groups: int, seed: int, device="cpu") -> torch.Tensor:
    """A power of two per group (2**-3 .. 2**3), so that scaling stays exact."""
    gen = torch.Generator().manual_seed(seed)
    exponents = torch.randint(-3, 4, (groups,), generator=gen)
    return torch.ldexp(torch.ones(groups), exponents).to(device)


def offsets(sizes: list[int], device="cpu") -> torch.Tensor:
    """int32 (G + 1,) running sums of sizes, from 0."""
    return torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32).to(device)


def rows_case(splits, reduced, features, dtypes, seed=0, device="cpu"):
    """The arguments of grouped_rows_gemm but out_dtype: a (T, R), b (G, N, R), scales, o_g."""
    groups = len(splits)
    a = fp8_operand((sum(splits), reduced), dtypes[0], seed, device)
    b = fp8_operand((groups, features, reduced), dtypes[1], seed + 1, device)
    scales = scale_invs(groups, seed, device), scale_invs(groups, seed + 1, device)
    return a, scales[0], b, scales[1], offsets(splits, device)


def reduction_case(widths, m, n, dtypes, seed=0, device="cpu", capacity=32):
    """The arguments of grouped_reduction_gemm but out_dtype: flat blocks of (m, w_g) and
    (n, w_g), with `capacity` spare columns of NaN bytes behind them (never to be read)."""
    groups, columns = len(widths), sum(widths)
    flats = []
    for rows, dtype, shift in ((m, dtypes[0], 0), (n, dtypes[1], 1)):
        flat = torch.full((rows * (columns + capacity),), float("nan")).to(dtype)
        flat[: rows * columns] = fp8_operand((rows * columns,), dtype, seed + shift)
        flats.append(flat.to(device))
    scales = scale_invs(groups, seed, device), scale_invs(groups, seed + 1, device)
    return flats[0], scales[0], flats[1], scales[1], offsets(widths, device), m, n


def dequantized(x_fp8: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """x_fp8 * scale_inv in fp64, on the CPU."""
    return x_fp8.cpu().double() * scale_inv.cpu().double()


def rows_fp64(a, a_scale_inv, b, b_scale_inv, row_offsets) -> torch.Tensor:
    bounds = row_offsets.tolist()
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64)
    for g, (start, end) in enumerate(itertools.pairwise(bounds)):
        out[start:end] = (
            dequantized(a[start:end], a_scale_inv[g]) @ dequantized(b[g], b_scale_inv[g]).t()
        )
    return out


def reduction_fp64(a_cols, a_scale_inv, b_cols, b_scale_inv, col_offsets, m, n) -> torch.Tensor:
    bounds = col_offsets.tolist()
    out = torch.zeros(len(bounds) - 1, m, n, dtype=torch.float64)
    for g, (start, end) in enumerate(itertools.pairwise(bounds)):
        a_g = a_cols[m * start : m * end].view(m, end - start)
        b_g = b_cols[n * start : n * end].view(n, end - start)
        out[g] = dequantized(a_g, a_scale_inv[g]) @ dequantized(b_g, b_scale_inv[g]).t()
    return out


# ----------------------------------------------------------------------------------------------
# The references against fp64 (CPU)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("dtypes", DTYPE_PAIRS)
def test_rows_reference_is_exact(dtypes, splits):
    args = rows_case(splits, 48, 24, dtypes, seed=len(splits))
    want = rows_fp64(*args)
    for fn in (gg.grouped_rows_gemm, gg.grouped_rows_gemm_reference):
        out = fn(*args, torch.float32)
        assert out.shape == want.shape and out.dtype == torch.float32
        assert torch.equal(out.double(), want)
        for out_dtype in (torch.bfloat16, torch.float16):
            out = fn(*args, out_dtype)
            assert out.dtype == out_dtype and torch.equal(out, want.to(out_dtype))


@pytest.mark.parametrize("widths", WIDTHS)
@pytest.mark.parametrize("dtypes", DTYPE_PAIRS)
def test_reduction_reference_is_exact(dtypes, widths):
    args = reduction_case(widths, 24, 40, dtypes, seed=len(widths))
    want = reduction_fp64(*args)
    for fn in (gg.grouped_reduction_gemm, gg.grouped_reduction_gemm_reference):
        out = fn(*args, torch.float32)
        assert out.shape == (len(widths), 24, 40) and out.dtype == torch.float32
        assert torch.equal(out.double(), want)
        assert not out[[g for g, w in enumerate(widths) if w == 0]].any()
        assert torch.equal(fn(*args, torch.bfloat16), want.to(torch.bfloat16))


def test_empty_dimensions_give_zeros():
    dtypes = (E4M3, E4M3)
    for splits, reduced, features in [([0, 0], 16, 8), ([3, 2], 16, 0), ([3, 2], 0, 8), ([], 8, 8)]:
        args = rows_case(splits, reduced, features, dtypes)
        out = gg.grouped_rows_gemm(*args, torch.bfloat16)
        assert out.shape == (sum(splits), features) and not out.any()
    for widths, m, n in [([16, 0], 0, 8), ([16, 0], 8, 0), ([0, 0], 8, 8), ([], 8, 8)]:
        out = gg.grouped_reduction_gemm(*reduction_case(widths, m, n, dtypes), torch.float32)
        assert out.shape == (len(widths), m, n) and not out.any()


def _rows_args(**override):
    names = ("a", "a_scale_inv", "b", "b_scale_inv", "row_offsets")
    args = dict(zip(names, rows_case([3, 0, 5], 16, 8, (E4M3, E4M3)), strict=True))
    return {**args, "out_dtype": torch.bfloat16, **override}


def _reduction_args(**override):
    names = ("a_cols", "a_scale_inv", "b_cols", "b_scale_inv", "col_offsets", "m", "n")
    args = dict(zip(names, reduction_case([16, 0, 32], 8, 4, (E5M2, E4M3)), strict=True))
    return {**args, "out_dtype": torch.float32, **override}


BF16 = torch.zeros(8, 16, dtype=torch.bfloat16)
ROWS_ERRORS = [
    (dict(a=BF16), TypeError, "a must be one of"),
    (dict(b=torch.zeros(3, 8, 16, dtype=torch.float16)), TypeError, "b must be one of"),
    (dict(a=torch.zeros(128, dtype=E4M3)), ValueError, "a must be 2-D"),
    (dict(b=torch.zeros(24, 16, dtype=E4M3)), ValueError, "b must be 3-D"),
    (dict(b=torch.zeros(3, 8, 32, dtype=E4M3)), ValueError, "a's R = 16 as its last dimension"),
    (dict(b=torch.zeros(0, 8, 16, dtype=E4M3)), ValueError, "b has no groups"),
    (dict(b=torch.zeros(3, 8, 16, dtype=E4M3, device="meta")), ValueError, "b is on meta"),
    (dict(row_offsets=torch.tensor([0, 3, 3, 8])), ValueError, "row_offsets must be torch.int32"),
    (dict(row_offsets=offsets([3, 5])), ValueError, r"row_offsets must be .* shape \(4,\)"),
    (dict(a_scale_inv=torch.ones(3, dtype=torch.float64)), ValueError, "a_scale_inv must be"),
    (dict(b_scale_inv=torch.ones(2)), ValueError, r"b_scale_inv must be .* shape \(3,\)"),
    (dict(a_scale_inv=torch.ones(3, device="meta")), ValueError, "a_scale_inv is on meta"),
    (dict(out_dtype=E4M3), TypeError, "out_dtype must be one of"),
]
REDUCTION_ERRORS = [
    (dict(a_cols=torch.zeros(8 * 48)), TypeError, "a_cols must be one of"),
    (dict(b_cols=torch.zeros(4, 48, dtype=E4M3)), ValueError, "b_cols must be 1-D"),
    (dict(b_cols=torch.zeros(4 * 48, dtype=E4M3, device="meta")), ValueError, "b_cols is on"),
    (dict(m=-1), ValueError, "m and n must be non-negative"),
    (dict(col_offsets=torch.zeros(0, dtype=torch.int32)), ValueError, "col_offsets must be 1-D"),
    (dict(col_offsets=torch.tensor([0, 16, 16, 48])), ValueError, "must be torch.int32"),
    (dict(a_scale_inv=torch.ones(2)), ValueError, r"a_scale_inv must be .* shape \(3,\)"),
    (dict(b_scale_inv=torch.ones(3, dtype=torch.bfloat16)), ValueError, "b_scale_inv must be"),
    (dict(out_dtype=torch.int32), TypeError, "out_dtype must be one of"),
]


@pytest.mark.parametrize("override,error,match", ROWS_ERRORS)
def test_rows_argument_checks(override, error, match):
    for fn in (gg.grouped_rows_gemm, gg.grouped_rows_gemm_reference):
        with pytest.raises(error, match=match):
            fn(**_rows_args(**override))


@pytest.mark.parametrize("override,error,match", REDUCTION_ERRORS)
def test_reduction_argument_checks(override, error, match):
    for fn in (gg.grouped_reduction_gemm, gg.grouped_reduction_gemm_reference):
        with pytest.raises(error, match=match):
            fn(**_reduction_args(**override))


@pytest.mark.parametrize(
    "which,values,match",
    [
        ("rows", [0, 5, 3, 8], "never decrease"),
        ("rows", [1, 3, 3, 8], "start at 0"),
        ("rows", [0, 3, 3, 7], "end at the token count 8"),
        ("reduction", [0, 16, 8, 48], "never decrease"),
        ("reduction", [0, 16, 24, 48], "multiples of 16"),
        ("reduction", [0, 16, 16, 96], "a_cols has"),
    ],
)
def test_references_check_the_offsets_they_read(which, values, match):
    # The kernels trust the offsets (reading them would sync); the references check them.
    offsets = torch.tensor(values, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        if which == "rows":
            gg.grouped_rows_gemm_reference(**_rows_args(row_offsets=offsets))
        else:
            gg.grouped_reduction_gemm_reference(**_reduction_args(col_offsets=offsets))


# ----------------------------------------------------------------------------------------------
# The Triton kernels under Triton's CPU interpreter (where triton is installed)
# ----------------------------------------------------------------------------------------------

# Runs in a fresh process (TRITON_INTERPRET must be set before the kernels are defined). Float
# outputs are allocated poisoned with NaN, so an element the kernel fails to write shows. The
# interpreter upcasts FP8 exactly, and the operands' products sum exactly in fp32, so fp32 and
# fp16 outputs must equal the fp64 products rounded once; bf16 it rounds its own way (tolerance).
INTERPRETER_SCRIPT = """
import torch
from tolerances import assert_close
from test_kernels_grouped_gemm import reduction_case, reduction_fp64, rows_case, rows_fp64

from torchte.kernels import grouped_gemm_fp8 as gg

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_empty = torch.empty

def poisoned_empty(*shape, dtype=None, **kwargs):
    out = _empty(*shape, dtype=dtype, **kwargs)
    if dtype is not None and dtype.is_floating_point:
        out.fill_(float("nan"))
    return out

torch.empty = poisoned_empty

def check(launch, args, want, what):
    for out_dtype in (torch.float32, torch.float16, torch.bfloat16):
        out = launch(*args, out_dtype)
        assert out.shape == want.shape and out.dtype == out_dtype, what
        if out_dtype == torch.bfloat16:
            assert_close(out, want, out_dtype, msg=str(what))
        else:
            assert torch.equal(out, want.to(out_dtype)), (what, out_dtype)

ROWS = [  # (splits, R, N, dtypes, config): (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
    ([7, 0, 33, 1], 40, 24, (E4M3, E4M3), (16, 16, 16, 4, 2)),  # 5 of 7 row tiles used
    ([0, 16, 5, 0], 32, 40, (E5M2, E4M3), (32, 32, 32, 4, 2)),
    ([50], 20, 17, (E4M3, E5M2), (16, 32, 16, 4, 1)),
    ([0] * 9 + [3, 0, 20, 0, 0, 0, 0, 2, 0, 0, 1], 16, 16, (E5M2, E5M2), (16, 16, 16, 4, 2)),
    ([7, 0, 33, 1], 48, 24, (E4M3, E5M2), (16, 16, 16, 4, 2)),  # 3 k steps, 16-byte rows
]
for i, (splits, reduced, features, dtypes, config) in enumerate(ROWS):
    args = rows_case(splits, reduced, features, dtypes, seed=i)
    launch = lambda *args: gg._rows_gemm(*args, config)
    check(launch, args, rows_fp64(*args), (splits, reduced, features, dtypes, config))

REDUCTIONS = [  # (widths, m, n, dtypes, config)
    ([16, 0, 48, 32], 24, 40, (E5M2, E4M3), (16, 16, 16, 4, 2)),
    ([0, 0], 8, 8, (E4M3, E4M3), (16, 16, 16, 4, 2)),  # nothing to reduce: zeros written
    ([64], 17, 33, (E4M3, E5M2), (32, 32, 32, 4, 1)),
    ([32, 0, 16], 16, 16, (E4M3, E4M3), (16, 16, 32, 4, 2)),  # widths below BLOCK_K
]
for i, (widths, m, n, dtypes, config) in enumerate(REDUCTIONS):
    args = reduction_case(widths, m, n, dtypes, seed=i)
    launch = lambda *args: gg._reduction_gemm(*args, config)
    check(launch, args, reduction_fp64(*args), (widths, m, n, dtypes, config))

# The TMA kernels (grouped_gemm_tma.py): configs (BLOCK_M, BLOCK_N, BLOCK_K, num_warps,
# num_stages, GROUP_M, TMA store); TMA stores only where the row bytes allow it.
from torchte.kernels import grouped_gemm_tma as tma
from torchte.kernels.grouped_cast import _group_block
for i, (splits, reduced, features, dtypes, config) in enumerate(ROWS):
    if reduced % 16:  # TMA's row stride rule: the launcher's callers take the pointer kernel
        continue
    tma_config = (*config[:3], 4, 2, 2, True)
    args = rows_case(splits, reduced, features, dtypes, seed=i)
    g_block = _group_block(len(splits))
    launch = lambda *args: tma.rows_gemm_tma(*args, tma_config, g_block)
    check(launch, args, rows_fp64(*args), (splits, reduced, features, dtypes, tma_config))
for i, (widths, m, n, dtypes, config) in enumerate(REDUCTIONS):
    for store in (False, True):
        tma_config = (*config[:3], 4, 2, 2, store)
        args = reduction_case(widths, m, n, dtypes, seed=i)
        launch = lambda *args: tma.reduction_gemm_tma(*args, tma_config)
        check(launch, args, reduction_fp64(*args), (widths, m, n, dtypes, tma_config))
print("ok")
"""


@requires_interpreter
def test_triton_kernels_in_interpreter_match_fp64():
    run_under_interpreter(INTERPRETER_SCRIPT)


# ----------------------------------------------------------------------------------------------
# The kernels on the GPU: against torch._scaled_mm group by group, in a CUDA graph, launches
# ----------------------------------------------------------------------------------------------

GPU_SPLITS = [700, 0, 1, 1024, 333, 15, 1000, 1023]  # 8 groups, 4096 tokens, one empty
GPU_PAIRS = [(E4M3, E4M3), (E5M2, E4M3)]  # the forward and the gradient GEMMs


# FP8 tensor cores accumulate in fewer bits than fp32; the kernels promote their sums to fp32
# every BLOCK_K products, as cuBLAS does without fast accumulation. Against the fp32 reference
# the error measured up to 3.6e-4 of max |out| on an H200 (never promoting: 1.2e-3 to 3.8e-3).
TENSOR_CORE_ERROR = 2**-10


def assert_close_to_tensor_cores(out: torch.Tensor, want: torch.Tensor) -> None:
    """out within TENSOR_CORE_ERROR * max |want| of want, compared in fp64."""
    atol = TENSOR_CORE_ERROR * want.abs().max().item()
    torch.testing.assert_close(out.double(), want.double(), rtol=0.0, atol=atol)


def gpu_operand(shape, dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape, device="cuda", generator=gen) * 8).to(dtype)


def gpu_scales(groups: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.rand(groups, device="cuda", generator=gen) + 0.5) / 16


def per_group_scaled_mm(a_groups, a_scale_inv, b_groups, b_scale_inv) -> list[torch.Tensor]:
    """fp8_gemm (torch._scaled_mm) of each group's a (M_g, K) and b (N, K), in bf16 (each
    scale copied: cuBLAS wants its scale pointers 16-byte aligned)."""
    return [
        fp8_gemm(
            a_g, a_scale_inv[g].view(1).clone(), b_g, b_scale_inv[g].view(1).clone(), torch.bfloat16
        )
        for g, (a_g, b_g) in enumerate(zip(a_groups, b_groups, strict=True))
    ]


def gpu_rows_case(splits, reduced, features, dtypes, seed=0):
    groups = len(splits)
    a = gpu_operand((sum(splits), reduced), dtypes[0], seed)
    b = gpu_operand((groups, features, reduced), dtypes[1], seed + 1)
    return a, gpu_scales(groups, seed), b, gpu_scales(groups, seed + 1), offsets(splits, "cuda")


def gpu_reduction_case(widths, m, n, dtypes, seed=0, capacity=64):
    columns = sum(widths) + capacity
    a_cols = gpu_operand((m * columns,), dtypes[0], seed)
    b_cols = gpu_operand((n * columns,), dtypes[1], seed + 1)
    scales = gpu_scales(len(widths), seed), gpu_scales(len(widths), seed + 1)
    return a_cols, scales[0], b_cols, scales[1], offsets(widths, "cuda"), m, n


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("dtypes", GPU_PAIRS)
def test_triton_rows_gemm_matches_scaled_mm(dtypes):
    args = gpu_rows_case(GPU_SPLITS, 1024, 1024, dtypes)
    a, a_scale_inv, b, b_scale_inv, _ = args
    want = torch.cat(per_group_scaled_mm(a.split(GPU_SPLITS), a_scale_inv, b, b_scale_inv))
    assert_close_to_scale(gg.grouped_rows_gemm(*args, torch.bfloat16), want, torch.bfloat16)
    out = gg.grouped_rows_gemm(*args, torch.float32)
    assert_close_to_tensor_cores(out, gg.grouped_rows_gemm_reference(*args, torch.float32))


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("dtypes", GPU_PAIRS)
def test_triton_reduction_gemm_matches_scaled_mm(dtypes):
    widths = [(m + 15) // 16 * 16 for m in GPU_SPLITS]
    args = gpu_reduction_case(widths, 1024, 512, dtypes)
    a_cols, a_scale_inv, b_cols, b_scale_inv, _, m, n = args
    bounds = [0, *itertools.accumulate(widths)]
    a_groups = [a_cols[m * s : m * e].view(m, e - s) for s, e in itertools.pairwise(bounds)]
    b_groups = [b_cols[n * s : n * e].view(n, e - s) for s, e in itertools.pairwise(bounds)]
    want = torch.stack(per_group_scaled_mm(a_groups, a_scale_inv, b_groups, b_scale_inv))
    out = gg.grouped_reduction_gemm(*args, torch.bfloat16)
    assert out.shape == (len(widths), m, n) and not out[1].any()
    assert_close_to_scale(out, want, torch.bfloat16)
    out = gg.grouped_reduction_gemm(*args, torch.float32)
    want = gg.grouped_reduction_gemm_reference(*args, torch.float32)
    assert_close_to_tensor_cores(out, want)


@pytest.mark.gpu
@requires_triton
def test_triton_small_tokens_many_groups_odd_sizes():
    # 600 tokens take ROWS_CONFIG_SMALL; 64 groups, most empty, leave many programs idle.
    splits = [0] * 40 + [17] * 8 + [0] * 15 + [464]
    args = gpu_rows_case(splits, 272, 200, (E4M3, E4M3), seed=3)
    out = gg.grouped_rows_gemm(*args, torch.float32)
    assert_close_to_tensor_cores(out, gg.grouped_rows_gemm_reference(*args, torch.float32))
    args = gpu_reduction_case([(m + 15) // 16 * 16 for m in splits], 200, 136, (E5M2, E4M3))
    out = gg.grouped_reduction_gemm(*args, torch.float32)
    want = gg.grouped_reduction_gemm_reference(*args, torch.float32)
    assert_close_to_tensor_cores(out, want)


@pytest.mark.gpu
@requires_triton
def test_triton_one_launch_each_and_graph_replay_with_new_splits():
    dtypes, splits = (E4M3, E4M3), [64, 0, 200, 56]
    rows = gpu_rows_case(splits, 256, 128, dtypes)
    reduction = gpu_reduction_case([64, 0, 208, 64], 128, 256, dtypes)

    def both():
        out = gg.grouped_rows_gemm(*rows, torch.bfloat16)
        return out, gg.grouped_reduction_gemm(*reduction, torch.float32)

    both()  # compile outside the profile and the capture
    counts = [count_device_ops(lambda: gg.grouped_rows_gemm(*rows, torch.bfloat16))]
    counts.append(count_device_ops(lambda: gg.grouped_reduction_gemm(*reduction, torch.float32)))
    if counts != [0, 0]:
        assert counts == [1, 1]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = both()
    # New group sizes, written into the same offsets tensors: the replay must follow them.
    for new_splits, new_widths in [([0, 300, 20, 0], [0, 304, 32, 0]), (splits, [64, 0, 0, 16])]:
        rows[4].copy_(offsets(new_splits, "cuda"))
        reduction[4].copy_(offsets(new_widths, "cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(outs[0], gg.grouped_rows_gemm(*rows, torch.bfloat16))
        assert torch.equal(outs[1], gg.grouped_reduction_gemm(*reduction, torch.float32))
        want = gg.grouped_rows_gemm_reference(*rows, torch.bfloat16)
        assert_close_to_scale(outs[0], want, torch.bfloat16)
        want = gg.grouped_reduction_gemm_reference(*reduction, torch.float32)
        assert_close_to_tensor_cores(outs[1], want)


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("dtypes", GPU_PAIRS)
def test_tma_rows_gemm_past_small_rows(dtypes):
    # Past SMALL_ROWS tokens the persistent TMA kernel runs where the GPU has TMA: partial row
    # tiles at every group's end, an empty group, N not a multiple of the tile, and a CUDA
    # graph replayed with new splits (its descriptors live in scratch from the graph's pool).
    splits = [0, 3000, 1, 1500, 700]
    rows = gpu_rows_case(splits, 512, 200, dtypes, seed=5)
    assert sum(splits) > gg.SMALL_ROWS
    want = gg.grouped_rows_gemm_reference(*rows, torch.float32)
    assert_close_to_tensor_cores(gg.grouped_rows_gemm(*rows, torch.float32), want)
    fast = gg.grouped_rows_gemm(*rows, torch.bfloat16, fast_accum=True)
    assert_close_to_scale(fast, want, torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gg.grouped_rows_gemm(*rows, torch.bfloat16)
    rows[4].copy_(offsets([2600, 0, 1, 2500, 100], "cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, gg.grouped_rows_gemm(*rows, torch.bfloat16))
    want = gg.grouped_rows_gemm_reference(*rows, torch.bfloat16)
    assert_close_to_scale(out, want, torch.bfloat16)


@requires_interpreter  # needs triton installed (its allocator registry), not a GPU
def test_scratch_allocator_is_set_per_thread_and_never_replaces_one():
    """The TMA kernels' descriptors live in Triton's scratch: the launchers set
    scratch_allocator where a thread has none (autograd's backward thread starts with none),
    and keep an allocator the caller set."""
    import threading

    import triton

    from torchte.kernels import grouped_gemm_tma as tma

    def current():
        return triton.runtime._allocation._allocator.get()

    seen = {}

    def fresh_thread():
        seen["before"] = current()
        tma._use_scratch_allocator()
        seen["after"] = current()

        def mine(size, alignment, stream):
            return None

        triton.set_allocator(mine)
        tma._use_scratch_allocator()
        seen["kept"], seen["mine"] = current(), mine

    worker = threading.Thread(target=fresh_thread)
    worker.start()
    worker.join()
    assert isinstance(seen["before"], triton.runtime._allocation.NullAllocator)
    assert seen["after"] is tma.scratch_allocator
    assert seen["kept"] is seen["mine"]
