"""backward_override on the FP8 recipes: the forward is the FP8 forward, the backward GEMMs run in
high precision, from the input and weight as given ("high_precision") or from the forward's FP8
operands dequantized ("dequantized"). Checked against fp64 references rounded where the layers
round, for every module that ends in a GEMM, and against each other where one module is another's
building block (GroupedLinear: a stack of te.Linear; te.ops: the te modules)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from test_grouped_linear import assert_identical, make_pair, run_both
from test_layernorm_linear import make_layer as make_ln_linear
from test_layernorm_linear import qdq, ref_forward
from test_layernorm_mlp import act_ref, make_mlp
from tolerances import assert_close, assert_close_to_scale, representable

import torchte as te
from torchte import recipe
from torchte.kernels.activation import activation_backward_reference, activation_forward_reference

pytestmark = pytest.mark.usefixtures("cpu_default_device")

OVERRIDES = ["high_precision", "dequantized"]
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BLOCK_RECIPES = {
    "current": recipe.Float8CurrentScaling,
    "block": recipe.Float8BlockScaling,
    "mxfp8": recipe.MXFP8BlockScaling,
    "nvfp4": recipe.NVFP4BlockScaling,
}


def current(override):
    return recipe.Float8CurrentScaling(backward_override=override)


def run(layer, x, dy, fp8_recipe, **fwd):
    """(y, dx, {name: grad}) of one forward and backward under fp8_recipe."""
    x = x.detach().clone().requires_grad_()
    with te.autocast(recipe=fp8_recipe):
        y = layer(x, **fwd)
    y.backward(dy)
    grads = {n: p.grad for n, p in layer.named_parameters()}
    for p in layer.parameters():
        p.grad = None
    return y, x.grad, grads


def dequantized(layer, fp8_recipe, slot, t):
    """t through `layer`'s quantizer of `slot` ("input", "weight") for GEMM 0, dequantized in
    fp64: the value a "dequantized" backward reads."""
    quantizer = getattr(layer._fp8_setup(fp8_recipe), slot)[0]
    value = quantizer.quantize(t.detach(), rowwise=True, columnwise=False)
    return value.dequantize(torch.float32).double()


# -- te.Linear under every recipe that takes an override ------------------------------------------


@pytest.mark.parametrize("override", OVERRIDES)
@pytest.mark.parametrize("name", list(BLOCK_RECIPES))
def test_linear(name, override):
    fp8_recipe = BLOCK_RECIPES[name](backward_override=override)
    layer = te.Linear(128, 64, params_dtype=torch.float32)
    with torch.no_grad():
        layer.weight.copy_(representable((64, 128), E4M3, scale=0.25))
        layer.bias.copy_(representable(64, torch.bfloat16))
    x = representable((32, 128), torch.bfloat16)
    dy = representable((32, 64), torch.bfloat16, scale=0.5)
    y, dx, grads = run(layer, x, dy, fp8_recipe)
    y_plain, dx_plain, _ = run(layer, x, dy, BLOCK_RECIPES[name]())
    assert torch.equal(y, y_plain), "the forward is the FP8 forward"
    if override == "high_precision":
        x_b, w_b = x.double(), layer.weight.detach().double()
    else:
        x_b = dequantized(layer, fp8_recipe, "input", x)
        w_b = dequantized(layer, fp8_recipe, "weight", layer.weight)
    dy64 = dy.double()
    assert_close(dx, dy64 @ w_b, torch.float32, msg="dgrad")
    assert_close(grads["weight"], dy64.t() @ x_b, torch.float32, msg="wgrad")
    assert_close(grads["bias"], dy64.sum(0), torch.float32, msg="bias grad")
    assert not torch.equal(dx, dx_plain), "the FP8 backward gives other values"


@pytest.mark.parametrize("override", OVERRIDES)
@pytest.mark.parametrize("kind", ["linear", "layernorm_linear", "layernorm_mlp"])
def test_three_dimensional_inputs(kind, override):
    """[seq, batch, hidden] inputs: the gradients are those of the same rows given as 2-D."""
    torch.manual_seed(0)
    build = {
        "linear": lambda: te.Linear(32, 48),
        "layernorm_linear": lambda: te.LayerNormLinear(32, 48),
        "layernorm_mlp": lambda: te.LayerNormMLP(32, 48),
    }[kind]
    layer = build()
    out = 32 if kind == "layernorm_mlp" else 48
    x = torch.randn(6, 3, 32)
    dy = torch.randn(6, 3, out)
    y3, dx3, g3 = run(layer, x, dy, current(override))
    y2, dx2, g2 = run(layer, x.reshape(18, 32), dy.reshape(18, out), current(override))
    assert torch.equal(y3.reshape(18, out), y2) and torch.equal(dx3.reshape(18, 32), dx2)
    for name in g2:
        assert torch.equal(g3[name], g2[name]), name


@pytest.mark.parametrize("override", OVERRIDES)
def test_linear_makes_no_transposed_copies(override):
    """The backward needs no columnwise FP8 copy of the weight or the input."""
    fp8_recipe = current(override)
    layer = te.Linear(32, 16)
    x = torch.randn(8, 32, requires_grad=True)
    with te.autocast(recipe=fp8_recipe):
        y = layer(x)
    (_, w_fp8) = layer._fp8_setup(fp8_recipe).weight_cache[0][0]
    assert w_fp8.rowwise_data is not None and w_fp8.columnwise_data is None
    saved = [t for t in y.grad_fn.saved_tensors if t is not None]
    fp8_shapes = [tuple(t.shape) for t in saved if t.dtype in (E4M3, E5M2)]
    # Rowwise copies end in K = 32; a transposed one (the FP8 backward's) in M or N.
    assert all(shape[-1] == 32 for shape in fp8_shapes), fp8_shapes
    y.sum().backward()
    assert w_fp8.columnwise_data is None


def test_fp8_grad_output_comes_back_in_high_precision():
    """fp8_grad asks for an FP8 input gradient; a backward_override gives it in high precision,
    as Transformer Engine does."""
    layer = te.Linear(32, 16)
    x = torch.randn(8, 32, requires_grad=True)
    with te.autocast(recipe=current("dequantized")):
        y = layer(x, fp8_grad=True)
    y.sum().backward()
    assert type(x.grad) is torch.Tensor and x.grad.dtype == torch.float32


# -- modules with a norm in front ------------------------------------------------------------------


@pytest.mark.parametrize("override", OVERRIDES)
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_linear(normalization, override):
    dtype = torch.float32
    layer = make_ln_linear(32, 48, normalization)
    x = representable((9, 32), torch.bfloat16)
    dy = representable((9, 48), torch.bfloat16, scale=0.5)
    y, dx, grads = run(layer, x, dy, current(override))
    params = {n: p.detach().double().requires_grad_() for n, p in layer.named_parameters()}
    x64 = x.double().requires_grad_()
    _, z = ref_forward(x64, params, normalization, layer.zero_centered_gamma)
    z_d = z.detach().to(dtype)
    z_q = qdq(z_d, E4M3, "current")
    w_q = qdq(params["weight"].detach(), E4M3, "current")
    assert_close(y, z_q @ w_q.t() + params["bias"].detach(), dtype, msg="forward")
    z_b, w_b = (
        (z_d.double(), params["weight"].detach()) if override == "high_precision" else (z_q, w_q)
    )
    dy64 = dy.double()
    z.backward((dy64 @ w_b).to(dtype).double())
    assert_close_to_scale(dx, x64.grad, dtype)
    assert_close(grads["weight"], dy64.t() @ z_b, dtype, msg="wgrad")
    for pname in ("layer_norm_weight", "layer_norm_bias"):
        if pname in params:
            assert_close(grads[pname], params[pname].grad, dtype, msg=pname)


def mlp_reference(mlp, x, dy, dtype, override):
    """(y, dx, {param: grad}) in fp64 of LayerNormMLP under current scaling with `override`:
    the FP8 forward; backward GEMMs from the values as given or their FP8 casts dequantized."""
    p = {n: t.detach().double().requires_grad_() for n, t in mlp.named_parameters()}
    x64 = x.double().requires_grad_()
    z = F.layer_norm(x64, x64.shape[-1:], p["layer_norm_weight"], p["layer_norm_bias"], 1e-5)
    z_d = z.detach().to(dtype)
    z_q = qdq(z_d, E4M3, "current")
    w1, w2 = p["fc1_weight"].detach(), p["fc2_weight"].detach()
    w1_q, w2_q = qdq(w1, E4M3, "current"), qdq(w2, E4M3, "current")
    h = (z_q @ w1_q.t() + p["fc1_bias"].detach()).to(dtype)
    a = activation_forward_reference(h, mlp.activation)
    a_q = qdq(a, E4M3, "current")
    y = a_q @ w2_q.t() + p["fc2_bias"].detach()
    hp = override == "high_precision"
    a_b, w2_b, z_b, w1_b = (a.double(), w2, z_d.double(), w1) if hp else (a_q, w2_q, z_q, w1_q)
    dy64 = dy.double()
    da = (dy64 @ w2_b).to(dtype)
    h64 = h.double().requires_grad_()
    act_ref(h64, mlp.activation).backward(da.double())
    dh = activation_backward_reference(da, h, mlp.activation)
    assert_close(dh, h64.grad, dtype, msg="activation backward")
    z.backward((dh.double() @ w1_b).to(dtype).double())
    grads = {n: t.grad for n, t in p.items()}
    grads.update(
        fc2_weight=dy64.t() @ a_b,
        fc2_bias=dy64.sum(0),
        fc1_weight=dh.double().t() @ z_b,
        fc1_bias=dh.double().sum(0),
    )
    return y, x64.grad, grads


@pytest.mark.parametrize("override", OVERRIDES)
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_layernorm_mlp(activation, override):
    dtype = torch.float32
    mlp = make_mlp(32, 48, activation, dtype)
    x = representable((17, 32), torch.bfloat16)
    dy = representable((17, 32), torch.bfloat16, scale=0.5)
    y, dx, grads = run(mlp, x, dy, current(override))
    y_ref, dx_ref, grads_ref = mlp_reference(mlp, x, dy, dtype, override)
    assert_close(y, y_ref, dtype)
    assert_close_to_scale(dx, dx_ref, dtype)
    for pname, grad in grads.items():
        assert_close(grad, grads_ref[pname], dtype, msg=pname)


@pytest.mark.parametrize("override", OVERRIDES)
def test_layernorm_mlp_checkpoint_gives_the_same_gradients(override):
    x = representable((2, 9, 32), torch.bfloat16)
    dy = representable((2, 9, 32), torch.bfloat16, scale=0.5)
    results = []
    for checkpoint in (False, True):
        torch.manual_seed(0)
        mlp = make_mlp(32, 64, "swiglu", torch.bfloat16, checkpoint=checkpoint)
        results.append(run(mlp, x.bfloat16(), dy.bfloat16(), current(override)))
    (y0, dx0, g0), (y1, dx1, g1) = results
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1)
    for pname in g0:
        assert torch.equal(g0[pname], g1[pname]), pname


# -- GroupedLinear and te.ops: the same as the te modules -----------------------------------------


@pytest.mark.parametrize("override", OVERRIDES)
def test_grouped_linear_equals_a_stack_of_linear(override):
    grouped, stack = make_pair(3, torch.float32)
    ours, theirs = run_both(grouped, stack, [5, 0, 11], current(override), torch.float32, steps=2)
    assert_identical(ours, theirs, override)


@pytest.mark.parametrize("override", OVERRIDES)
def test_ops_norm_linear_equals_layernorm_linear(override):
    module = make_ln_linear(32, 48, "LayerNorm", bias=False)
    ops = te.ops.Sequential(te.ops.LayerNorm(32, eps=1e-5), te.ops.Linear(32, 48, bias=False))
    with torch.no_grad():
        ops[0].weight.copy_(module.layer_norm_weight)
        ops[0].bias.copy_(module.layer_norm_bias)
        ops[1].weight.copy_(module.weight)
    x = representable((9, 32), torch.bfloat16)
    dy = representable((9, 48), torch.bfloat16, scale=0.5)
    y0, dx0, g0 = run(module, x, dy, current(override))
    y1, dx1, g1 = run(ops, x, dy, current(override))
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1)
    assert torch.equal(g0["weight"], g1["1.weight"])
    assert torch.equal(g0["layer_norm_weight"], g1["0.weight"])


def test_delayed_scaling_refuses_an_override():
    with pytest.raises(ValueError, match="backward_override"):
        recipe.DelayedScaling(backward_override="high_precision")


def test_environment_variable_sets_the_default():
    """NVTE_BACKWARD_OVERRIDE gives the default of the recipes' field, read at import, as in
    Transformer Engine; DelayedScaling, which takes None only, does not read it."""
    code = (
        "from torchte import recipe; "
        "print(recipe.Float8CurrentScaling().backward_override, "
        "recipe.MXFP8BlockScaling().backward_override, recipe.DelayedScaling().backward_override)"
    )
    env = {**os.environ, "NVTE_BACKWARD_OVERRIDE": "dequantized"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["dequantized", "dequantized", "None"]
