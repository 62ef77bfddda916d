"""Block-scaled FP8 casts on the GPU: the Triton kernels of all three launchers (1x128,
128x128, grouped 1x128) against the torch reference on the CPU, byte for byte and bit for bit,
on odd shapes and special values, under the default launch configurations and others; one
launch per quantize; no host synchronization in the grouped cast; the quantizer's storages
equal to the CPU's."""

from __future__ import annotations

import pytest
import torch
from launches import count_device_ops

from torchte.kernels import block_cast as bc
from torchte.kernels._triton import triton_available
from torchte.quantization.blockwise import Float8BlockQuantizer

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
HP_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 1), (3, 129), (127, 131), (256, 384), (1023, 1500), (2048, 4096)]

requires_triton = pytest.mark.skipif(not triton_available(), reason="needs a CUDA GPU and Triton")


def gpu_input(shape, dtype, seed=0) -> torch.Tensor:
    """Normal values of varied size, a few huge and tiny ones, zero blocks, NaN and inf (on the
    GPU); for fp32 / bf16 a row of normal values so small that fp8_max / amax overflows."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, device="cuda", generator=gen) * 3
    flat = x.view(-1)
    flat[::7] *= 1e-3
    flat[::13] *= 300
    flat[::29] = 0.0
    cols = shape[-1]
    x2d = x.view(-1, cols)
    x2d[0, : min(cols, 128)] = 0.0
    if x2d.shape[0] > 3 and cols > 3:
        x2d[1, 3] = float("nan")
        x2d[2, 1] = float("-inf")
        x2d[-1, -1] = -float("nan")
        if dtype != torch.float16:
            x2d[3] = torch.where(x2d[3] < 0, -1.5, 1.5) * 2.0**-126
    return x.to(dtype)


def assert_same(got, want, what) -> None:
    """Tuples of outputs (None where not asked for) hold the same bytes / bit patterns."""
    for a, b in zip(got, want, strict=True):
        assert (a is None) == (b is None), what
        if a is None:
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, what
        bits = torch.int32 if a.dtype == torch.float32 else torch.uint8
        assert torch.equal(a.cpu().view(bits), b.cpu().view(bits)), what


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("hp_dtype", HP_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("block_dim", [1, 2])
def test_block_quantize_gpu_matches_cpu(shape, hp_dtype, fp8_dtype, block_dim):
    x = gpu_input(shape, hp_dtype, seed=shape[0] + 7 * shape[1])
    for power_2, eps, usage in ((True, 0.0, (True, True)), (False, 1e-2, (True, True))):
        for rowwise, columnwise in (usage, (True, False), (False, True)):
            args = (fp8_dtype, block_dim, rowwise, columnwise, power_2, eps)
            got = bc.block_quantize(x, *args)
            want = bc.block_quantize_reference(x.cpu(), *args)
            assert_same(got, want, (shape, hp_dtype, fp8_dtype, block_dim, args))


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("hp_dtype", HP_DTYPES)
def test_batched_128x128_gpu_matches_cpu(hp_dtype):
    x = gpu_input((3, 130, 260), hp_dtype, seed=3)
    x[1] *= 64
    for power_2 in (True, False):
        args = (torch.float8_e4m3fn, 2, True, True, power_2, 0.0)
        assert_same(bc.block_quantize(x, *args), bc.block_quantize_reference(x.cpu(), *args), 1)


# T % 16 == 0 (the aligned-window tiles: odd sizes, and sizes multiples of 16) and not.
GROUP_SIZES = [[0, 5, 300, 1, 128, 700, 0], [1023], [0, 0, 129], [5, 0, 300, 1, 130, 700, 0]]
GROUP_SIZES += [[32, 0, 144, 1008], [1, 1, 14]]


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("sizes", GROUP_SIZES)
@pytest.mark.parametrize("hp_dtype", HP_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_grouped_block_quantize_gpu_matches_cpu(sizes, hp_dtype, fp8_dtype):
    rows = sum(sizes)
    x = gpu_input((rows, 1500), hp_dtype, seed=rows)
    offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
    for power_2, eps in ((True, 0.0), (False, 2.0**-10)):
        for rowwise, columnwise in ((True, True), (False, True), (True, False)):
            args = (fp8_dtype, rowwise, columnwise, power_2, eps)
            got = bc.grouped_block_quantize(x, offsets.cuda(), *args)
            want = bc.grouped_block_quantize_reference(x.cpu(), offsets, *args)
            assert_same(got, want, (sizes, hp_dtype, fp8_dtype, args))


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("hp_dtype", [torch.float32, torch.bfloat16])
def test_subnormal_inputs_gpu_matches_cpu(hp_dtype):
    """Subnormal inputs (fp32 and bf16 have them): the kernels must neither flush them nor
    their products."""
    x = torch.zeros(4, 200)
    x[0, :6] = torch.tensor([1.0, -3.0, 5.0, 0.5, 7.0, 2.0**10]) * 2.0**-140
    x[1, 128:131] = torch.tensor([3.0, 1.0, -2.0]) * 2.0**-133
    x[2] = torch.linspace(-1, 1, 200) * 2.0**-127
    x = x.to(hp_dtype)
    for block_dim in (1, 2):
        for power_2 in (True, False):
            args = (torch.float8_e4m3fn, block_dim, True, True, power_2, 0.0)
            got = bc.block_quantize(x.cuda(), *args)
            assert_same(got, bc.block_quantize_reference(x, *args), (block_dim, power_2))


# Launch configurations besides the defaults (block_cast.CONFIG_1D's form: num_warps,
# num_stages, programs_per_sm, group_m): one program per tile in other tile orders, persistent
# programs with and without pipelined loads. benchmarks/block_quantize.py times them.
CONFIGS = [(4, 0, 0, 1), (16, 0, 0, 64), (16, 1, 1, 8), (16, 3, 1, 8), (8, 2, 1, 1)]


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("hp_dtype", [torch.bfloat16, torch.float32])
def test_launch_configs_gpu_match_cpu(config, hp_dtype):
    """Every kernel under each configuration, on row counts that store the columnwise bytes
    as words (multiples of 4; of 16: the grouped cast's aligned windows) and byte by byte,
    against the CPU reference."""
    fp8 = torch.float8_e4m3fn
    offsets = torch.tensor([0, 5, 5, 305, 306, 434, 1028], dtype=torch.int32)
    for rows in (1028, 1031, 1040):
        x = gpu_input((rows, 1500), hp_dtype, seed=rows)
        consts = bc._constexprs(x, fp8, True, True, True)
        x3 = x[:1026].view(3, 342, 1500) if rows == 1031 else x[:1024].view(2, 512, 1500)
        what = (config, hp_dtype, rows)
        got = bc._quantize_1d(x, fp8, 0.0, consts, config)
        assert_same(got, bc.block_quantize_reference(x.cpu(), fp8, 1, True, True, True, 0.0), what)
        got = bc._quantize_2d(x3, fp8, 0.0, consts, config)
        assert_same(got, bc.block_quantize_reference(x3.cpu(), fp8, 2, True, True, True, 0.0), what)
        ends = offsets.clone()
        ends[-1] = rows
        got = bc._quantize_grouped(x, ends.cuda(), fp8, 0.0, consts, config)
        want = bc.grouped_block_quantize_reference(x.cpu(), ends, fp8, True, True, True, 0.0)
        assert_same(got, want, what)


@pytest.mark.gpu
@requires_triton
def test_one_launch_per_quantize_and_no_host_sync():
    x = gpu_input((1024, 1536), torch.bfloat16)
    offsets = torch.tensor([0, 100, 100, 1024], dtype=torch.int32, device="cuda")
    fp8 = torch.float8_e4m3fn

    def one_d():
        bc.block_quantize(x, fp8, 1, True, True, True, 0.0)

    def two_d():
        bc.block_quantize(x.view(2, 512, 1536), fp8, 2, True, True, True, 0.0)

    def grouped():
        bc.grouped_block_quantize(x, offsets, fp8, True, True, True, 0.0)

    for fn in (one_d, two_d, grouped):
        fn()  # compile outside the profile
    counts = [count_device_ops(fn) for fn in (one_d, two_d, grouped)]
    if counts == [0, 0, 0]:
        pytest.skip("the profiler records no GPU activity here")
    assert counts == [1, 1, 1]
    quantizer = Float8BlockQuantizer(fp8, block_scaling_dim=1)
    torch.cuda.set_sync_debug_mode("error")
    try:
        storage = quantizer.quantize_grouped(x, offsets)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert storage.m_splits is None and storage.columnwise_data.shape == (1536, 1024)


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("block_scaling_dim", [1, 2])
def test_quantizer_storages_gpu_match_cpu(block_scaling_dim):
    quantizer = Float8BlockQuantizer(torch.float8_e4m3fn, block_scaling_dim=block_scaling_dim)
    x = gpu_input((3, 131, 260), torch.bfloat16, seed=11)
    got, want = quantizer.quantize(x), quantizer.quantize(x.cpu())
    assert got.shape == want.shape == (3, 131, 260)
    assert_same(got.get_data_tensors(), want.get_data_tensors(), block_scaling_dim)
    finite = torch.isfinite(x.cpu().float())
    deq_gpu, deq_cpu = got.dequantize().cpu(), want.dequantize()
    assert torch.equal(deq_gpu[finite], deq_cpu[finite])
    if block_scaling_dim == 1:
        offsets = torch.tensor([0, 7, 7, 393], dtype=torch.int32)
        x2d = x.view(-1, 260)
        got = quantizer.quantize_grouped(x2d, offsets.cuda())
        want = quantizer.quantize_grouped(x2d.cpu(), offsets, [7, 0, 386])
        assert_same(got.get_data_tensors()[:4], want.get_data_tensors()[:4], "grouped")
        assert torch.equal(got.block_offsets.cpu(), want.block_offsets)
