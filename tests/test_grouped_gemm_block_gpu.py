"""Grouped block-scaled FP8 GEMMs on the GPU (kernels/grouped_gemm_block.py): the Triton kernels
equal to the CPU reference bit for bit on operands whose products the tensor cores sum exactly,
close to it on realistic operands, for every tile config the benchmark sweeps; one launch, no
host sync, a CUDA graph replayed with new group sizes; and, without timing, that the compiled
kernels take the fast path (wgmma on 16-byte async copies, no register spills)."""

from __future__ import annotations

import pytest
import torch
from launches import count_device_ops
from test_kernels_grouped_gemm_block import E4M3, E5M2, reduction_case, rows_case
from tolerances import tolerance

from torchte.kernels import grouped_gemm_block as gb
from torchte.kernels._triton import triton_available

requires_triton = pytest.mark.skipif(not triton_available(), reason="needs a CUDA GPU and Triton")
pytestmark = [pytest.mark.gpu, requires_triton]

PAIRS = [(E4M3, E4M3), (E5M2, E4M3)]  # the forward and the gradient GEMMs
# 4096 tokens (64-row tiles) and 5577 (128-row tiles): odd sizes, an empty group, one row.
ROW_SPLITS = [[700, 0, 1, 1024, 333, 15, 1000, 1023], [3000, 0, 2500, 77]]
# Groups starting on 16-token boundaries (16-byte loads) and not (byte loads); and starting on
# them in rows of T = 2051 tokens, not a multiple of 16 (byte loads: a 16-byte one would fault).
ALIGNED = [304, 0, 16, 512, 336, 16, 496, 368]
UNALIGNED = [300, 0, 1, 512, 333, 15, 500, 387]
ODD_ROWS = [304, 0, 16, 512, 336, 16, 496, 371]
# Tiles the benchmark sweeps, beside the module's configs: (BLOCK_M, BLOCK_N, warps, stages).
CONFIGS = [gb.ROWS_CONFIG, gb.ROWS_CONFIG_SMALL, (128, 256, 8, 3), (64, 256, 4, 3), (64, 64, 4, 4)]


def small_integers(shape, dtype, seed: int) -> torch.Tensor:
    """FP8 integers -4..4: 128 products sum to at most 2048 in magnitude, exact in the tensor
    cores' own accumulator."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, tuple(shape), generator=gen).float().to(dtype)


def small_scales(shape, seed: int) -> torch.Tensor:
    """Powers of two 2**-2 .. 2**2: every sum of the GEMMs here stays exact in fp32."""
    gen = torch.Generator().manual_seed(seed)
    return torch.ldexp(torch.ones(shape), torch.randint(-2, 3, tuple(shape), generator=gen))


def realistic(shape, dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(tuple(shape), generator=gen) * 32).to(dtype)


def realistic_scales(shape, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(tuple(shape), generator=gen) + 0.5) / 256


def cuda(args) -> tuple:
    return tuple(arg.cuda() for arg in args)


# FP8 tensor cores accumulate a step's 128 products in fewer bits than fp32 (the kernels promote
# each step's sum to fp32); as for the per-tensor grouped GEMMs, within 2**-10 of max |out|.
TENSOR_CORE_ERROR = 2**-10


def assert_close_to_tensor_cores(out: torch.Tensor, want: torch.Tensor) -> None:
    """Within the tensor cores' error plus the rounding of out's own dtype (the table's)."""
    atol = TENSOR_CORE_ERROR * want.abs().max().item()
    rtol = tolerance(out.dtype)[0] if out.dtype in (torch.bfloat16, torch.float16) else 0.0
    torch.testing.assert_close(out.double().cpu(), want.double().cpu(), rtol=rtol, atol=atol)


def exact_rows(splits, dtypes, seed=0):
    return rows_case(splits, 528, 1000, dtypes, seed, small_integers, small_scales)


def exact_reduction(splits, dtypes, seed=0):
    return reduction_case(splits, 520, 1000, dtypes, seed, small_integers, small_scales)


@pytest.mark.parametrize("splits", ROW_SPLITS)
@pytest.mark.parametrize("dtypes", PAIRS)
def test_rows_equal_the_cpu_reference(dtypes, splits):
    args = exact_rows(splits, dtypes)
    want = gb.grouped_block_rows_gemm(*args, torch.float32)  # the CPU reference
    for out_dtype in (torch.float32, torch.bfloat16):
        out = gb.grouped_block_rows_gemm(*cuda(args), out_dtype)
        assert out.is_cuda and out.dtype == out_dtype
        assert torch.equal(out.cpu(), want.to(out_dtype))


@pytest.mark.parametrize("splits", [ALIGNED, UNALIGNED, ODD_ROWS])
@pytest.mark.parametrize("dtypes", PAIRS)
def test_reduction_equals_the_cpu_reference(dtypes, splits):
    args = exact_reduction(splits, dtypes)
    want = gb.grouped_block_reduction_gemm(*args, torch.float32)
    out = gb.grouped_block_reduction_gemm(*cuda(args), torch.bfloat16)
    assert torch.equal(out.cpu(), want.to(torch.bfloat16)) and not out[1].any()
    gen = torch.Generator().manual_seed(1)
    main_grad = torch.randint(-256, 257, want.shape, generator=gen) / 16.0
    out = main_grad.cuda()
    assert gb.grouped_block_reduction_gemm(*cuda(args), torch.float32, out, True) is out
    assert torch.equal(out.cpu(), want + main_grad)


@pytest.mark.parametrize("config", CONFIGS)
def test_every_swept_config_equals_the_cpu_reference(config):
    rows = exact_rows(ROW_SPLITS[1], (E4M3, E4M3), seed=3)
    want = gb.grouped_block_rows_gemm(*rows, torch.float32)
    assert torch.equal(gb._rows_gemm(*cuda(rows), torch.float32, config).cpu(), want)
    for splits in (ALIGNED, UNALIGNED):
        reduction = exact_reduction(splits, (E5M2, E4M3), seed=4)
        want = gb.grouped_block_reduction_gemm(*reduction, torch.float32)
        out = torch.full(want.shape, float("nan"), device="cuda")
        gb._reduction_gemm(*cuda(reduction), out, False, config)
        assert torch.equal(out.cpu(), want)


@pytest.mark.parametrize("dtypes", PAIRS)
def test_realistic_operands_close_to_the_reference(dtypes):
    splits = [2000, 0, 1, 1800, 333, 15, 2900, 1143]  # 8192 tokens: 128-row tiles
    rows = cuda(rows_case(splits, 1024, 784, dtypes, 5, realistic, realistic_scales))
    want = gb.grouped_block_rows_gemm_reference(*rows, torch.float32)
    assert_close_to_tensor_cores(gb.grouped_block_rows_gemm(*rows, torch.float32), want)
    assert_close_to_tensor_cores(gb.grouped_block_rows_gemm(*rows, torch.bfloat16), want)
    reduction = cuda(reduction_case(splits, 784, 1024, dtypes, 6, realistic, realistic_scales))
    want = gb.grouped_block_reduction_gemm_reference(*reduction, torch.float32)
    assert_close_to_tensor_cores(gb.grouped_block_reduction_gemm(*reduction, torch.float32), want)


def test_one_launch_no_sync_and_graph_replay_with_new_splits():
    dtypes, splits, new_splits = (E4M3, E4M3), [640, 0, 200, 56], [0, 333, 563, 0]
    rows = cuda(exact_rows(splits, dtypes))
    reduction = cuda(exact_reduction(splits, dtypes))
    main_grad = torch.zeros(4, 520, 1000, device="cuda")

    def both():
        out = gb.grouped_block_rows_gemm(*rows, torch.bfloat16)
        gb.grouped_block_reduction_gemm(*reduction, torch.float32, main_grad, True)
        return out

    both()  # compile outside the profile, the sync check and the capture
    counts = [count_device_ops(lambda: gb.grouped_block_rows_gemm(*rows, torch.bfloat16))]
    counts.append(
        count_device_ops(lambda: gb.grouped_block_reduction_gemm(*reduction, torch.float32))
    )
    if counts != [0, 0]:  # 0, 0: the profiler sees nothing here
        assert counts == [1, 1]
    torch.cuda.set_sync_debug_mode("error")
    try:
        both()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = both()
    for step, sizes in enumerate([new_splits, splits]):
        # New group sizes (and operands for them), written into the captured tensors.
        for captured, new in zip(rows, exact_rows(sizes, dtypes, seed=step + 1), strict=True):
            captured.copy_(new)
        for captured, new in zip(reduction, exact_reduction(sizes, dtypes, step + 1), strict=True):
            captured.copy_(new)
        main_grad.zero_()
        graph.replay()
        torch.cuda.synchronize()
        want = gb.grouped_block_rows_gemm_reference(*rows, torch.float32)
        assert torch.equal(out, want.to(torch.bfloat16))
        want = gb.grouped_block_reduction_gemm_reference(*reduction, torch.float32)
        assert torch.equal(main_grad, want)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="checks Hopper's instructions",
)
def test_compiled_kernels_take_the_fast_path():
    # Timing-free: the module's configs compile to wgmma fed by 16-byte cp.async copies (the
    # pipelined K-major tiles), with no register spills. Only the kernels compiled here, for
    # aligned operands: earlier tests compile variants for odd pointers, which copy in smaller
    # steps.
    launches = {  # each kernel and the configs the launchers pick
        "rows": (gb._launch_rows_gemm, {gb.ROWS_CONFIG, gb.ROWS_CONFIG_SMALL}),
        "reduction": (gb._launch_reduction_gemm, {gb.REDUCTION_CONFIG}),
    }
    earlier = {name: dict(launch.compiled) for name, (launch, _) in launches.items()}
    for launch, _ in launches.values():
        launch.compiled.clear()
    try:
        for splits in ROW_SPLITS:  # both rows configs
            gb.grouped_block_rows_gemm(*cuda(exact_rows(splits, (E4M3, E4M3))), torch.bfloat16)
        reduction = cuda(exact_reduction(ALIGNED, (E4M3, E4M3)))
        gb.grouped_block_reduction_gemm(*reduction, torch.float32)
        compiled = {name: dict(launch.compiled) for name, (launch, _) in launches.items()}
    finally:
        for name, (launch, _) in launches.items():
            launch.compiled.update(earlier[name])
    checked = 0
    for name, (_, configs) in launches.items():
        for (_, key), kernel in compiled[name].items():
            if not configs.intersection(k for k in key if isinstance(k, tuple)):
                continue
            kernel._init_handles()
            ptx = kernel.asm["ptx"]
            assert "wgmma.mma_async" in ptx, (name, key)
            assert "cp.async.cg.shared.global" in ptx, (name, key)
            if name == "rows":  # the reduction kernel spills a few registers (CUDA 13's ptxas)
                assert kernel.n_spills == 0, (name, key, kernel.n_spills, kernel.n_regs)
            checked += 1
    assert checked >= 3
