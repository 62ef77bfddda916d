"""te modules under the block-scaled recipes on a GPU: cuBLAS's block-scaled GEMMs (Hopper) and
the Triton grouped ones against block_reference's GEMMs on the dequantized operands (computed
on the CPU, whose quantization writes the GPU's bytes), with the bf16 tolerance (the layers
compute in bf16). A CUDA graph of the grouped block path replays with other device splits."""

from __future__ import annotations

import pytest
import torch
from block_reference import QDQLinear
from tolerances import representable, tolerance

import torchte as te
from torchte.recipe import Float8BlockScaling, Format, MXFP8BlockScaling, NVFP4BlockScaling

pytestmark = pytest.mark.gpu

RECIPES = {
    "block": Float8BlockScaling(),
    "block-x2d": Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1),
    # E5M2 gradients: dgrad runs as 1x128 x 1x128, the weight's tiles read as strips
    # (F.scaled_mm takes E5M2 in no block-scaled pairing).
    "block-hybrid": Float8BlockScaling(fp8_format=Format.HYBRID),
    "mxfp8": MXFP8BlockScaling(),
    "nvfp4": NVFP4BlockScaling(disable_stochastic_rounding=True),
}


def _reference(x, weight, bias, dy, recipe):
    """(y, dx, dw, db) of QDQLinear on CPU copies of the same dtype (a cast of another dtype may
    round differently: NVFP4's Hadamard transform rounds to its input's dtype)."""
    x_ref = x.detach().cpu().requires_grad_()
    w_ref = weight.detach().cpu().requires_grad_()
    b_ref = bias.detach().cpu().requires_grad_()
    y = QDQLinear.apply(x_ref, w_ref, b_ref, recipe)
    y.backward(dy.cpu())
    return y, x_ref.grad, w_ref.grad, b_ref.grad


# FP8 tensor cores add a 128-wide step's products in fewer bits than fp32 (the GEMMs promote
# each step's sum to fp32): besides the output's bf16 rounding, an error within 2**-10 of the
# largest |value|.
TENSOR_CORE_ERROR = 2**-10


def assert_close_gemm(actual, expected, msg=None):
    """The bf16 tolerance of the table, atol raised to the tensor cores' error."""
    rtol, atol = tolerance(torch.bfloat16)
    if expected.numel():
        atol = max(atol, TENSOR_CORE_ERROR * expected.detach().abs().max().item())
    torch.testing.assert_close(
        actual.detach().cpu().double(), expected.detach().cpu().double(), rtol=rtol,
        atol=atol, msg=msg,
    )  # fmt: skip


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("shape", [(256, 384, 512), (384, 640, 256)], ids=str)
def test_linear_on_the_gpu_matches_the_reference(name, shape):
    recipe = RECIPES[name]
    m, k, n = shape
    layer = te.Linear(k, n, params_dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        layer.weight.copy_(representable((n, k), torch.bfloat16, scale=0.125))
        layer.bias.copy_(representable(n, torch.bfloat16))
    x = representable((m, k), torch.bfloat16, device="cuda").bfloat16().requires_grad_()
    dy = representable((m, n), torch.bfloat16, device="cuda").bfloat16()
    with te.autocast(recipe=recipe):
        y = layer(x)
    y.backward(dy)
    y_ref, dx_ref, dw_ref, db_ref = _reference(x, layer.weight, layer.bias, dy, recipe)
    assert_close_gemm(y, y_ref)
    assert_close_gemm(x.grad, dx_ref)
    assert_close_gemm(layer.weight.grad, dw_ref)
    assert_close_gemm(layer.bias.grad, db_ref)


def _grouped(sizes, k, n):
    layer = te.GroupedLinear(len(sizes), k, n, params_dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        for g in range(len(sizes)):
            w = representable((n, k), torch.bfloat16, scale=0.125, device="cuda")
            getattr(layer, f"weight{g}").copy_(w)
            getattr(layer, f"bias{g}").copy_(representable(n, torch.bfloat16, device="cuda"))
    return layer


@pytest.mark.parametrize("on_device", [True, False], ids=["device-splits", "host-splits"])
@pytest.mark.parametrize("sizes", [[256, 0, 384, 128], [40, 8, 0, 16], [32, 16, 0, 16]], ids=str)
@pytest.mark.parametrize("recipe_name", ["block", "block-hybrid"])
def test_grouped_block_path_matches_per_group_references(sizes, on_device, recipe_name):
    """Device splits: the Triton grouped kernels; host splits of multiples of 16: cuBLAS per
    group (else the Triton kernels again)."""
    recipe = RECIPES[recipe_name]
    k, n = (384, 256) if sum(sizes) > 64 else (128, 64)  # one K-block: scale strides of size 1
    layer = _grouped(sizes, k, n)
    x = representable((sum(sizes), k), torch.bfloat16, device="cuda").bfloat16()
    x.requires_grad_()
    dy = representable((sum(sizes), n), torch.bfloat16, device="cuda").bfloat16()
    with te.autocast(recipe=recipe):
        y = layer(x, torch.tensor(sizes, device="cuda") if on_device else sizes)
    y.backward(dy)
    start = 0
    for g, size in enumerate(sizes):
        rows = slice(start, start + size)
        start += size
        weight, bias = getattr(layer, f"weight{g}"), getattr(layer, f"bias{g}")
        y_ref, dx_ref, dw_ref, db_ref = _reference(x[rows], weight, bias, dy[rows], recipe)
        assert_close_gemm(y[rows], y_ref, msg=f"group {g}")
        assert_close_gemm(x.grad[rows], dx_ref, msg=f"group {g}")
        assert_close_gemm(weight.grad, dw_ref, msg=f"group {g}")
        assert_close_gemm(bias.grad, db_ref, msg=f"group {g}")


def test_grouped_block_path_in_a_cuda_graph_replays_with_other_splits():
    recipe = RECIPES["block"]
    sizes, other = [128, 0, 256, 128], [64, 192, 0, 256]
    k, n = 256, 128
    layer = _grouped(sizes, k, n)
    x = representable((512, k), torch.bfloat16, device="cuda").bfloat16().requires_grad_()
    splits = torch.tensor(sizes, device="cuda")
    graphed = te.make_graphed_callables(layer, (x, splits), fp8_enabled=True, fp8_recipe=recipe)
    splits.copy_(torch.tensor(other, device="cuda"))
    y_graph = graphed(x, splits).clone()
    with te.autocast(recipe=recipe):
        y_eager = layer(x, torch.tensor(other, device="cuda"))
    assert torch.equal(y_graph, y_eager)


@pytest.mark.parametrize("recipe_name", ["block", "mxfp8", "nvfp4"])
def test_dense_modules_in_a_cuda_graph_equal_eager(recipe_name):
    """te.Linear and te.LayerNormMLP under each block-scaled recipe: a graphed forward and
    backward replays the eager layer's output and gradients bit for bit on new input."""
    recipe = RECIPES[recipe_name]
    torch.manual_seed(0)
    kw = {"params_dtype": torch.bfloat16, "device": "cuda"}
    for layer in (te.Linear(256, 384, **kw), te.LayerNormMLP(256, 512, **kw)):
        sample = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        graphed = te.make_graphed_callables(layer, (sample,), fp8_enabled=True, fp8_recipe=recipe)
        x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(128, 256 if isinstance(layer, te.LayerNormMLP) else 384,
                         device="cuda", dtype=torch.bfloat16)  # fmt: skip
        results = []
        for run in (graphed, None):
            inp = x.clone().requires_grad_()
            layer.zero_grad(set_to_none=True)
            if run is None:
                with te.autocast(recipe=recipe):
                    y = layer(inp)
            else:
                y = run(inp)
            y.backward(dy)
            grads = [p.grad.clone() for p in layer.parameters() if p.grad is not None]
            results.append((y.detach().clone(), inp.grad.clone(), grads))
        (y_g, dx_g, gw_g), (y_e, dx_e, gw_e) = results
        assert torch.equal(y_g, y_e) and torch.equal(dx_g, dx_e), type(layer).__name__
        assert len(gw_g) == len(gw_e) > 0
        assert all(torch.equal(a, b) for a, b in zip(gw_g, gw_e, strict=True))
