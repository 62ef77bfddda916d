"""MXFP8 on the GPU: the Triton quantize and dequantize kernels against the CPU torch reference,
byte for byte (data, E8M0 codes and the zero scale padding), on shapes that fill and do not fill
the tiles, with special values, for every tile configuration a tuner may pick; and the
quantizer's Storage on CUDA."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from torchte.kernels import mxfp8_cast as mx
from torchte.kernels._triton import triton_available
from torchte.quantization.mxfp8 import MXFP8Quantizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not triton_available(), reason="needs a CUDA GPU and Triton"),
]

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
HP_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
USAGES = [(True, True), (True, False), (False, True)]
SHAPES = [(32, 32), (96, 160), (160, 96), (1056, 2080), (4096, 4096)]
QUANTIZE_CONFIGS = [(32, 32, 1), (32, 128, 4), (64, 64, 4), (128, 64, 4), (128, 128, 8)]
DEQUANTIZE_CONFIGS = [(32, 32, 1), (64, 128, 4), (128, 256, 8)]


def random_input(shape, dtype, seed=0) -> torch.Tensor:
    """Made on the CPU in `dtype` (so the GPU gets the same bytes): normal values with blocks
    of very different magnitudes, a few huge and tiny values (fp32 and bf16 subnormals), zero
    blocks, NaN, +-inf."""
    gen = torch.Generator().manual_seed(seed)
    rows, cols = shape
    x = torch.randn(shape, generator=gen) * 3
    exps = torch.randint(-40, 40, (rows // 32, cols // 32), generator=gen).float()
    x *= torch.pow(2.0, exps).repeat_interleave(32, 0).repeat_interleave(32, 1)
    flat = x.view(-1)
    flat[::7] *= 1e-3
    flat[::13] *= 300
    flat[5::97] = 1e-40
    flat[11::389] = math.nan
    flat[17::1009] = math.inf
    flat[19::1013] = -math.inf
    x[:32, :32] = 0.0
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)  # fp16's range; keep the NaN
    return x.to(dtype)


def assert_same_bytes(got, want, context):
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None), context
        if g is not None:
            assert g.dtype == w.dtype and g.shape == w.shape and g.is_contiguous(), context
            assert torch.equal(g.cpu().view(torch.uint8), w.view(torch.uint8)), context


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_quantize_gpu_bytes_equal_cpu_reference(shape, fp8_dtype):
    for i, (dtype, (rowwise, columnwise), two_d) in enumerate(
        itertools.product(HP_DTYPES, USAGES, [False, True])
    ):
        if shape[0] * shape[1] > 2**22 and i % 5:  # the largest shape: a few of the cases
            continue
        x = random_input(shape, dtype, seed=i)
        got = mx.mxfp8_quantize(x.cuda(), fp8_dtype, rowwise, columnwise, two_d)
        want = mx.mxfp8_quantize_reference(x, fp8_dtype, rowwise, columnwise, two_d)
        assert_same_bytes(got, want, (shape, fp8_dtype, dtype, rowwise, columnwise, two_d))


@pytest.mark.parametrize("config", QUANTIZE_CONFIGS)
def test_quantize_every_tile_config(config):
    for i, shape in enumerate([(96, 160), (1056, 2080)]):
        for fp8_dtype, two_d in [(torch.float8_e4m3fn, False), (torch.float8_e5m2, True)]:
            x = random_input(shape, torch.bfloat16, seed=i)
            got = mx._quantize_triton(x.cuda(), fp8_dtype, True, True, two_d, config)
            want = mx.mxfp8_quantize_reference(x, fp8_dtype, True, True, two_d)
            assert_same_bytes(got, want, (config, shape, fp8_dtype, two_d))


def assert_same_values(got: torch.Tensor, want: torch.Tensor, context):
    """Equal values, NaN where NaN (a NaN's bits may differ between GPU and CPU casts)."""
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape, context
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), context
    assert torch.equal(got[~nan], want[~nan]), context


@pytest.mark.parametrize("config", DEQUANTIZE_CONFIGS)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_dequantize_gpu_equals_cpu_reference(fp8_dtype, config):
    for shape in [(32, 32), (160, 96), (1056, 2080)]:
        x = random_input(shape, torch.float32, seed=3)
        data, scale, data_c, scale_c = mx.mxfp8_quantize_reference(x, fp8_dtype, True, True)
        for rowwise, d, s in [(True, data, scale), (False, data_c, scale_c)]:
            for dtype in HP_DTYPES:
                got = mx._dequantize_triton(d.cuda(), s.cuda(), rowwise, dtype, config)
                want = mx.mxfp8_dequantize_reference(d, s, rowwise, dtype)
                assert_same_values(got, want, (shape, rowwise, dtype, config))
    # Every FP8 byte under every code.
    data = torch.arange(256, dtype=torch.uint8).repeat(32, 1).view(fp8_dtype)
    scale = torch.zeros(128, 8, dtype=torch.uint8)
    scale[:32] = torch.arange(256, dtype=torch.uint8).reshape(32, 8)
    for dtype in HP_DTYPES:
        got = mx.mxfp8_dequantize(data.cuda(), scale.cuda(), True, dtype)
        assert_same_values(got, mx.mxfp8_dequantize_reference(data, scale, True, dtype), dtype)


def test_storage_on_cuda_matches_cpu():
    x = random_input((256, 512), torch.bfloat16, seed=5).reshape(2, 128, 512)
    for two_d in [False, True]:
        q = MXFP8Quantizer(torch.float8_e4m3fn, with_2d_quantization=two_d)
        on_gpu, on_cpu = q.quantize(x.cuda()), q.quantize(x)
        assert on_gpu.device.type == "cuda"
        assert_same_bytes(on_gpu.get_data_tensors(), on_cpu.get_data_tensors(), two_d)
        assert_same_values(on_gpu.dequantize(), on_cpu.dequantize(), two_d)
        for usage in ["rowwise", "columnwise"]:
            op_gpu, op_cpu = on_gpu.gemm_operand(usage), on_cpu.gemm_operand(usage)
            assert op_gpu.data.dtype == torch.bfloat16 and op_gpu.data.is_cuda
            assert_same_values(op_gpu.data, op_cpu.data, usage)
    groups = MXFP8Quantizer(torch.float8_e5m2).quantize_grouped(x.reshape(256, 512).cuda(),
                                                                [64, 0, 160, 32])  # fmt: skip
    assert [g.shape for g in groups] == [(64, 512), (0, 512), (160, 512), (32, 512)]
    assert groups[1].dequantize().is_cuda
    ref = MXFP8Quantizer(torch.float8_e5m2).quantize(x.reshape(256, 512)[64:224])
    assert_same_bytes(groups[2].get_data_tensors(), ref.get_data_tensors(), "group 2")
