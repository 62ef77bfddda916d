"""te modules under the block-scaled recipes (Float8BlockScaling, MXFP8BlockScaling,
NVFP4BlockScaling) on the CPU emulation, against block_reference's plain-PyTorch GEMMs on the
quantized-dequantized operands.

te.Linear and the grouped layer are held to the fp32 tolerance: their operands are the
reference's exactly, so only fp32 accumulation differs. Modules with a norm or an activation
before a GEMM are held to the FP8 tolerance of the format: their GEMM inputs come from a kernel
whose last-bit differences from torch's may move a value across a rounding boundary.
"""

from __future__ import annotations

import pytest
import torch
from block_reference import QDQLinear
from tolerances import assert_close, representable

import torchte as te
from torchte import _group_splits
from torchte.recipe import Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling

pytestmark = pytest.mark.usefixtures("cpu_default_device")

RECIPES = {
    "block": Float8BlockScaling(),
    "block-x2d-w1d": Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1),
    "block-fp32-scales": Float8BlockScaling(
        fp8_quant_fwd_inp=te.recipe.QParams(power_2_scale=False),
        fp8_quant_fwd_weight=te.recipe.QParams(power_2_scale=False),
        fp8_quant_bwd_grad=te.recipe.QParams(power_2_scale=False),
    ),
    "mxfp8": MXFP8BlockScaling(),
    "mxfp8-hybrid": MXFP8BlockScaling(fp8_format=te.recipe.Format.HYBRID),
    "mxfp8-2d-weights": MXFP8BlockScaling(enable_2d_quantization=True),
    "nvfp4": NVFP4BlockScaling(disable_stochastic_rounding=True),
    "nvfp4-plain": NVFP4BlockScaling(
        disable_stochastic_rounding=True, disable_rht=True, disable_2d_quantization=True
    ),
}
# (tokens, in_features, out_features): partial 128-blocks in every dimension, multiples of 32
# (MXFP8's block) so every recipe takes them.
SHAPES = [(64, 160, 96), (192, 256, 128)]


def _linear(k, n, bias=True, **kwargs):
    layer = te.Linear(k, n, bias=bias, params_dtype=torch.float32, **kwargs)
    with torch.no_grad():
        layer.weight.copy_(representable((n, k), torch.bfloat16, scale=0.125))
        if bias:
            layer.bias.copy_(representable(n, torch.bfloat16))
    return layer


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_linear_matches_the_dequantized_reference(name, shape):
    recipe = RECIPES[name]
    m, k, n = shape
    layer = _linear(k, n)
    x = representable((m, k), torch.bfloat16).requires_grad_()
    dy = representable((m, n), torch.bfloat16)
    with te.autocast(recipe=recipe):
        y = layer(x)
    y.backward(dy)
    x_ref = x.detach().clone().requires_grad_()
    w_ref = layer.weight.detach().clone().requires_grad_()
    b_ref = layer.bias.detach().clone().requires_grad_()
    y_ref = QDQLinear.apply(x_ref, w_ref, b_ref, recipe)
    y_ref.backward(dy)
    assert_close(y, y_ref, torch.float32)
    assert_close(x.grad, x_ref.grad, torch.float32)
    assert_close(layer.weight.grad, w_ref.grad, torch.float32)
    assert_close(layer.bias.grad, b_ref.grad, torch.float32)


@pytest.mark.parametrize("name", ["block", "mxfp8", "nvfp4"])
def test_fused_wgrad_accumulation_into_main_grad(name):
    recipe = RECIPES[name]
    m, k, n = SHAPES[0]
    layer = _linear(k, n, bias=False, fuse_wgrad_accumulation=True)
    start = representable((n, k), torch.bfloat16)
    layer.weight.main_grad = start.clone()
    x = representable((m, k), torch.bfloat16)
    dy = representable((m, n), torch.bfloat16)
    x.requires_grad_()
    with te.autocast(recipe=recipe):
        y = layer(x)
    y.backward(dy)
    w_ref = layer.weight.detach().clone().requires_grad_()
    QDQLinear.apply(x.detach(), w_ref, None, recipe).backward(dy)
    assert_close(layer.weight.main_grad, start + w_ref.grad, torch.float32)


@pytest.mark.parametrize("name", ["block", "mxfp8", "nvfp4"])
def test_layernorm_mlp_is_close_to_the_reference(name):
    recipe = RECIPES[name]
    m, k, f = 64, 128, 192
    mlp = te.LayerNormMLP(k, f, params_dtype=torch.float32, activation="gelu")
    with torch.no_grad():
        mlp.fc1_weight.copy_(representable((f, k), torch.bfloat16, scale=0.125))
        mlp.fc2_weight.copy_(representable((k, f), torch.bfloat16, scale=0.125))
    x = representable((m, k), torch.bfloat16).requires_grad_()
    dy = representable((m, k), torch.bfloat16)
    with te.autocast(recipe=recipe):
        y = mlp(x)
    y.backward(dy)
    x_ref = x.detach().clone().requires_grad_()
    z = torch.nn.functional.layer_norm(x_ref, (k,), mlp.layer_norm_weight, mlp.layer_norm_bias)
    h = QDQLinear.apply(z, mlp.fc1_weight, mlp.fc1_bias, recipe)
    a = torch.nn.functional.gelu(h, approximate="tanh")
    y_ref = QDQLinear.apply(a, mlp.fc2_weight, mlp.fc2_bias, recipe)
    y_ref.backward(dy)
    fmt = torch.float8_e4m3fn if name != "nvfp4" else torch.float8_e5m2  # 4-bit: looser
    assert_close(y, y_ref, fmt)
    assert_close(x.grad, x_ref.grad, fmt)


def _grouped(num, k, n, **kwargs):
    layer = te.GroupedLinear(num, k, n, bias=True, params_dtype=torch.float32, **kwargs)
    with torch.no_grad():
        for g in range(num):
            getattr(layer, f"weight{g}").copy_(representable((n, k), torch.bfloat16, scale=0.125))
            getattr(layer, f"bias{g}").copy_(representable(n, torch.bfloat16))
    return layer


@pytest.mark.parametrize("name", ["block", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("on_device", [False, True], ids=["host-splits", "device-splits"])
def test_grouped_linear_matches_a_stack_of_references(name, on_device, monkeypatch):
    recipe = RECIPES[name]
    sizes, k, n = [64, 0, 160, 32], 160, 96
    layer = _grouped(len(sizes), k, n)
    x = representable((sum(sizes), k), torch.bfloat16).requires_grad_()
    dy = representable((sum(sizes), n), torch.bfloat16)
    splits = sizes
    if on_device:
        monkeypatch.setattr(_group_splits, "READ_CPU_SPLITS", False)
        splits = torch.tensor(sizes)
    with te.autocast(recipe=recipe):
        y = layer(x, splits)
    y.backward(dy)
    for g, (xs, dys) in enumerate(zip(x.detach().split(sizes), dy.split(sizes), strict=True)):
        weight, bias = getattr(layer, f"weight{g}"), getattr(layer, f"bias{g}")
        x_ref = xs.clone().requires_grad_()
        w_ref = weight.detach().clone().requires_grad_()
        b_ref = bias.detach().clone().requires_grad_()
        y_ref = QDQLinear.apply(x_ref, w_ref, b_ref, recipe)
        y_ref.backward(dys)
        rows = slice(sum(sizes[:g]), sum(sizes[: g + 1]))
        assert_close(y[rows], y_ref, torch.float32, msg=f"group {g}")
        assert_close(x.grad[rows], x_ref.grad, torch.float32, msg=f"group {g}")
        assert_close(weight.grad, w_ref.grad, torch.float32, msg=f"group {g}")
        assert_close(bias.grad, b_ref.grad, torch.float32, msg=f"group {g}")


def test_grouped_block_path_runs_without_reading_device_splits(monkeypatch):
    """Float8BlockScaling's grouped path never reads the sizes back: a GroupSplits whose
    sizes() would sync fails the test."""
    monkeypatch.setattr(_group_splits, "READ_CPU_SPLITS", False)

    def no_sync(self):
        raise AssertionError("the block path read the split sizes on the host")

    monkeypatch.setattr(_group_splits.GroupSplits, "sizes", no_sync)
    layer = _grouped(3, 128, 64)
    x = representable((96, 128), torch.bfloat16).requires_grad_()
    with te.autocast(recipe=RECIPES["block"]):
        y = layer(x, torch.tensor([32, 0, 64]))
    y.sum().backward()
    assert y.shape == (96, 64) and x.grad.shape == x.shape


@pytest.mark.parametrize("name", ["block", "mxfp8", "nvfp4"])
def test_transformer_layer_trains_a_step(name):
    recipe = RECIPES[name]
    layer = te.TransformerLayer(
        128, 256, 4, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32
    )
    x = torch.randn(32, 2, 128, requires_grad=True)
    with te.autocast(recipe=recipe):
        y = layer(x)
    y.float().pow(2).mean().backward()
    grads = [p.grad for p in layer.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_a_dimension_the_block_does_not_divide_is_named():
    layer = te.Linear(48, 32, params_dtype=torch.float32)
    with pytest.raises(ValueError, match="48"), te.autocast(recipe=MXFP8BlockScaling()):
        layer(torch.randn(32, 48))


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_producers_write_1x128_blocks_with_the_unfused_bytes(normalization, activation):
    """Under Float8BlockScaling the activation writes fc2's 1x128 FP8 input itself, and the
    output-gradient casts of fc2 and (after the activation's backward) fc1 sum their bias
    gradients: those fused producers run, and outputs and gradients equal those of the unfused
    path (activation in high precision, then the quantizer) bit for bit (the bias gradients'
    sums, added in another order, to the fp32 tolerance)."""
    from torchte.quantization import blockwise, fused

    calls = []

    def counted(name):
        original = getattr(fused, name)

        def run(*args, **kwargs):
            calls.append(name)
            return original(*args, **kwargs)

        return run

    torch.manual_seed(0)
    layer = te.LayerNormMLP(
        160, 256, normalization=normalization, activation=activation, params_dtype=torch.float32
    )
    x = representable((192, 160), torch.bfloat16).requires_grad_()
    dy = representable((192, 160), torch.bfloat16)
    results = []
    for fusable in (True, False):
        patch = pytest.MonkeyPatch()
        if fusable:
            for name in ("activation_to_block", "quantize_with_dbias"):
                patch.setattr(fused, name, counted(name))
        else:
            patch.setattr(blockwise.Float8BlockQuantizer, "fusable", property(lambda q: False))
        try:
            layer.zero_grad(set_to_none=True)
            x.grad = None
            with te.autocast(recipe=Float8BlockScaling()):
                y = layer(x)
            y.backward(dy)
            grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
            results.append((y.detach().clone(), x.grad.clone(), grads))
        finally:
            patch.undo()
    # fc2's dy and fc1's dh (with fc1's and fc2's bias gradients), and fc2's input
    assert sorted(calls) == ["activation_to_block", "quantize_with_dbias", "quantize_with_dbias"]
    (y_f, dx_f, g_f), (y_u, dx_u, g_u) = results
    assert torch.equal(y_f, y_u) and torch.equal(dx_f, dx_u)
    for name, grad in g_f.items():
        if name.endswith("bias") and name.startswith("fc"):
            assert_close(grad, g_u[name], torch.float32)
        else:
            assert torch.equal(grad, g_u[name]), name


@pytest.mark.parametrize("activation", ["GELU", "SwiGLU"])
def test_ops_fusions_under_1x128_blocks_equal_the_unfused_ops(activation):
    """te.ops LayerNorm -> Linear -> activation -> Linear under Float8BlockScaling: the fusions
    a 1x128 quantizer allows (norm and activation producers, the activation's backward with
    the bias gradient) give the outputs and gradients of the ops run one by one (bias
    gradients to the fp32 tolerance: their sums run in another order)."""
    from torchte.quantization import blockwise

    torch.manual_seed(0)
    kw = {"dtype": torch.float32}
    width = 256 if activation == "SwiGLU" else 128
    ops = te.ops.Sequential(
        te.ops.LayerNorm(160, **kw),
        te.ops.Linear(160, width, **kw),
        getattr(te.ops, activation)(),
        te.ops.Linear(128, 96, **kw),
    )
    x = representable((192, 160), torch.bfloat16).requires_grad_()
    dy = representable((192, 96), torch.bfloat16)
    results = []
    for fusable in (True, False):
        patch = pytest.MonkeyPatch()
        if not fusable:
            patch.setattr(blockwise.Float8BlockQuantizer, "fusable", property(lambda q: False))
        try:
            ops.zero_grad(set_to_none=True)
            x.grad = None
            with te.autocast(recipe=Float8BlockScaling()):
                y = ops(x)
            y.backward(dy)
            grads = {n: p.grad.clone() for n, p in ops.named_parameters()}
            results.append((y.detach().clone(), x.grad.clone(), grads))
        finally:
            patch.undo()
    (y_f, dx_f, g_f), (y_u, dx_u, g_u) = results
    assert torch.equal(y_f, y_u) and torch.equal(dx_f, dx_u)
    for name, grad in g_f.items():
        if name.endswith("bias"):
            assert_close(grad, g_u[name], torch.float32, msg=name)
        else:
            assert torch.equal(grad, g_u[name]), name
