"""NVFP4 on the GPU: the Triton kernels' bytes equal the CPU reference's, stochastic rounding
included (the same seed and offset), on shapes that leave partial tiles; the quantizer's
storages equal on both devices."""

from __future__ import annotations

import math

import pytest
import torch

from torchte.kernels import nvfp4_cast as nv
from torchte.quantization.nvfp4 import NVFP4Quantizer

pytestmark = pytest.mark.gpu

S = nv.NVFP4Spec
SPECS = {
    "1d": S(),
    "rht": S(rht=True),
    "2d": S(two_d=True),
    "sr": S(stochastic=True),
    "rht_sr": S(rht=True, stochastic=True),
    "2d_sr_nosign": S(two_d=True, stochastic=True, rht=True, sign_mask=0),
    "rowwise": S(columnwise=False, stochastic=True),
    "columnwise_rht": S(rowwise=False, rht=True),
}
SHAPES = [(16, 16), (48, 80), (144, 272), (1040, 2064), (4112, 528)]


def special_input(shape, dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * 3
    x.view(-1)[::7] *= 1e-3
    x.view(-1)[::13] *= 300
    x.view(-1)[::29] = 0.0
    x[:16, :16] = 0.0
    x.view(-1)[5::31] = -0.0
    return x.to(dtype)


def assert_same(gpu, cpu, what):
    for i, (g, c) in enumerate(zip(gpu, cpu, strict=True)):
        assert (g is None) == (c is None), (what, i)
        if g is not None:
            assert g.is_cuda and torch.equal(g.cpu(), c), (what, i, (g.cpu() != c).sum())


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gpu_bytes_equal_cpu_bytes(shape, dtype, spec):
    x = special_input(shape, dtype, seed=sum(shape))
    rng = torch.tensor([0x5EED5EED5EED, 2**33 + 17], dtype=torch.int64)
    amax_cpu = nv.compute_amax(x, spec)
    amax_gpu = nv.compute_amax(x.cuda(), spec)
    assert torch.equal(amax_gpu.cpu(), amax_cpu), (amax_gpu, amax_cpu)
    cpu = nv.quantize(x, amax_cpu, spec, rng)
    for _ in range(2):  # the first launch compiles, the second takes FastLaunch's cached path
        gpu = nv.quantize(x.cuda(), amax_gpu, spec, rng.cuda())
        assert_same(gpu, cpu, (shape, dtype, spec))
    if cpu[0] is not None:
        for out_dtype in (torch.bfloat16, torch.float32):
            got = nv.dequantize_values(gpu[0], gpu[1], out_dtype)
            want = nv.dequantize_values(cpu[0], cpu[1], out_dtype)
            assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("spec", [S(), S(rht=True), S(two_d=True, stochastic=True)], ids=str)
def test_gpu_non_finite_inputs(spec):
    x = special_input((64, 96), torch.bfloat16, seed=3)
    x[3, 7], x[20, 40], x[33, 1] = math.nan, -math.inf, math.inf
    rng = torch.tensor([7, 9], dtype=torch.int64)
    amax_cpu = nv.compute_amax(x, spec)
    amax_gpu = nv.compute_amax(x.cuda(), spec)
    assert torch.equal(amax_gpu.cpu(), amax_cpu)
    assert_same(
        nv.quantize(x.cuda(), amax_gpu, spec, rng.cuda()), nv.quantize(x, amax_cpu, spec, rng), spec
    )


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"with_rht": True, "with_post_rht_amax": True}, {"with_2d_quantization": True}],
    ids=["1d", "rht", "2d"],
)
def test_quantizer_storages_equal_on_both_devices(kwargs):
    x = special_input((2, 264, 400), torch.bfloat16, seed=4)
    quantizer = NVFP4Quantizer(**kwargs)
    gpu, cpu = quantizer.quantize(x.cuda()), quantizer.quantize(x)
    assert_same(gpu.get_data_tensors(), cpu.get_data_tensors(), kwargs)
    for usage in ("rowwise", "columnwise"):
        g, c = gpu.gemm_operand(usage), cpu.gemm_operand(usage)
        assert torch.equal(g.data.cpu(), c.data) and torch.equal(g.scale.cpu(), c.scale)
    assert torch.equal(gpu.dequantize().cpu(), cpu.dequantize())
    gpu.update_usage(rowwise_usage=False)
    cpu.update_usage(rowwise_usage=False)
    torch.testing.assert_close(gpu.dequantize().cpu(), cpu.dequantize())


def test_stochastic_rounding_on_the_gpu_draws_from_the_cuda_generator():
    x = special_input((256, 512), torch.bfloat16, seed=5).cuda()
    quantizer = NVFP4Quantizer(stochastic_rounding=True)
    torch.cuda.manual_seed(11)
    first = quantizer.quantize(x)
    torch.cuda.manual_seed(11)
    again = quantizer.quantize(x)
    assert torch.equal(first.rowwise_data, again.rowwise_data)
    assert not torch.equal(first.rowwise_data, quantizer.quantize(x).rowwise_data)
