"""The native MXFP8 / NVFP4 GEMM path on a GPU. On Hopper (these machines) it stays off: the
storages hand out the emulated "values" operands, and the swizzle gives the CPU's bytes. On
compute capability 10+ (never run here: the path is untested on such hardware) the native
GEMMs through torch's F.scaled_mm are compared with the emulated ones on the same storages."""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_close, assert_close_to_scale, representable

import torchte as te
from torchte import _device
from torchte.gemm import operand_gemm
from torchte.kernels.mx_swizzle import swizzle_block_scales, unswizzle_block_scales
from torchte.quantization import mxfp8, nvfp4
from torchte.quantization.mxfp8 import MXFP8Quantizer
from torchte.quantization.nvfp4 import NVFP4Quantizer
from torchte.recipe import MXFP8BlockScaling, NVFP4BlockScaling

pytestmark = pytest.mark.gpu


def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


blackwell = pytest.mark.skipif(
    _capability() < (10, 0), reason="needs compute capability 10+ (the native MX GEMMs)"
)


def sample(shape, seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = representable(shape, torch.bfloat16, scale=4.0, generator=gen, device="cpu")
    return (x * torch.pow(2.0, torch.randint(-6, 7, (shape[0], 1), generator=gen))).cuda()


def storages(fmt):
    """(x (96, 160), w (64, 160), dy (96, 64)) storages of one format, on the GPU."""
    if fmt == "mxfp8":
        quantizers = [MXFP8Quantizer(torch.float8_e4m3fn)] * 2
        quantizers.append(MXFP8Quantizer(torch.float8_e5m2))
    else:
        rht = {"with_rht": True, "with_post_rht_amax": True}
        quantizers = [NVFP4Quantizer(**rht), NVFP4Quantizer(with_2d_quantization=True)]
        quantizers.append(NVFP4Quantizer(**rht))
    shapes = [(96, 160), (64, 160), (96, 64)]
    pairs = enumerate(zip(quantizers, shapes, strict=True))
    return [q.quantize(sample(s, i)) for i, (q, s) in pairs]


def test_swizzle_on_the_gpu_gives_the_cpus_bytes():
    gen = torch.Generator().manual_seed(0)
    compact = torch.randint(0, 255, (384, 12), dtype=torch.uint8, generator=gen)
    swizzled = swizzle_block_scales(compact.cuda())
    assert torch.equal(swizzled.cpu(), swizzle_block_scales(compact))
    assert torch.equal(unswizzle_block_scales(swizzled).cpu(), compact)


@pytest.mark.skipif(_capability() >= (10, 0), reason="the native path is on here")
@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_emulated_below_capability_10(fmt):
    recipe = "MXFP8BlockScaling" if fmt == "mxfp8" else "NVFP4BlockScaling"
    native, reason = _device.block_gemm_native(recipe, torch.device("cuda", 0))
    assert native is False and "compute capability 10.0 or higher" in reason
    for storage in storages(fmt):
        assert storage.gemm_operand("rowwise").kind == "values"
        assert storage.gemm_operand("columnwise").kind == "values"


@pytest.fixture
def path(monkeypatch):
    """path["native"] = False makes the storages hand out the emulated operands on this GPU."""
    state = {"native": True}

    def answer(recipe, device):
        return _device.block_gemm_native(recipe, device) if state["native"] else (False, "")

    monkeypatch.setattr(mxfp8, "block_gemm_native", answer)
    monkeypatch.setattr(nvfp4, "block_gemm_native", answer)
    return state


@blackwell
@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_native_gemms_match_the_emulated_ones(fmt, path):
    x_q, w_q, dy_q = storages(fmt)
    bias = representable(64, torch.bfloat16, device="cuda").to(torch.bfloat16)
    gemms = {
        "fprop": ((x_q, "rowwise"), (w_q, "rowwise"), torch.bfloat16, bias, slice(None)),
        "dgrad": ((dy_q, "rowwise"), (w_q, "columnwise"), torch.bfloat16, None, slice(None)),
        "wgrad": ((dy_q, "columnwise"), (x_q, "columnwise"), torch.float32, None, slice(None)),
    }
    part = slice(16, 48)  # rows of dy's columnwise operand (64, 96): an unaligned start
    gemms["wgrad-rows"] = ((dy_q, "columnwise"), (x_q, "columnwise"), torch.float32, None, part)
    for name, ((a, a_usage), (b, b_usage), out_dtype, bias_, rows) in gemms.items():
        path["native"] = True
        a_nat, b_nat = a.gemm_operand(a_usage), b.gemm_operand(b_usage)
        assert a_nat.kind == b_nat.kind == ("mx" if fmt == "mxfp8" else "nvfp4"), name
        got = operand_gemm(a_nat.rows(rows), b_nat, out_dtype, bias_)
        path["native"] = False
        a_emu, b_emu = a.gemm_operand(a_usage), b.gemm_operand(b_usage)
        want = operand_gemm(a_emu.rows(rows), b_emu, out_dtype, bias_)
        assert_close_to_scale(got, want, out_dtype, msg=name)


@blackwell
@pytest.mark.parametrize(
    "recipe",
    [MXFP8BlockScaling(fp8_format=te.recipe.Format.HYBRID), NVFP4BlockScaling()],
    ids=["mxfp8-hybrid", "nvfp4"],
)
def test_linear_native_matches_emulated(recipe, path):
    layer = te.Linear(160, 64, params_dtype=torch.bfloat16, device="cuda")
    x, dy = sample((96, 160), 1), sample((96, 64), 2).to(torch.bfloat16)
    results = []
    for native in (True, False):
        path["native"] = native
        torch.manual_seed(0)
        x_in = x.to(torch.bfloat16).requires_grad_()
        layer.weight.grad = layer.bias.grad = None
        with te.autocast(recipe=recipe):
            y = layer(x_in)
        y.backward(dy)
        results.append((y.detach(), x_in.grad, layer.weight.grad.clone()))
    for got, want in zip(*results, strict=True):
        assert_close(got.float(), want.float(), torch.bfloat16)
