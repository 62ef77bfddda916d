"""te.LayerNormLinear against a plain-PyTorch norm + linear with the same weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from setattr_writes import set_as_torchte
from tolerances import assert_close, assert_close_to_scale, representable

import torchte as te
from torchte import recipe
from torchte.kernels import cast_transpose as ct

pytestmark = pytest.mark.usefixtures("cpu_default_device")

RECIPES = {
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "current": lambda: recipe.Float8CurrentScaling(),
}
NORMS = ["LayerNorm", "RMSNorm"]


def ref_forward(x, params: dict, normalization: str, zero_centered_gamma: bool, eps=1e-5):
    """fp64 norm + linear from a {name: tensor} of the layer's parameters: (y, z)."""
    p = {name: t.double() for name, t in params.items()}
    x = x.double()
    g = p["layer_norm_weight"] + 1 if zero_centered_gamma else p["layer_norm_weight"]
    if normalization == "LayerNorm":
        z = F.layer_norm(x, x.shape[-1:], g, p["layer_norm_bias"], eps)
    else:
        z = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g
    return F.linear(z, p["weight"], p.get("bias")), z


def reference(x, layer):
    """(y, z) of `layer`'s parameters in fp64."""
    params = {name: t.detach() for name, t in layer.named_parameters()}
    return ref_forward(x, params, layer.normalization, layer.zero_centered_gamma)


def make_layer(in_f, out_f, normalization, dtype=torch.float32, **kw):
    layer = te.LayerNormLinear(in_f, out_f, normalization=normalization, params_dtype=dtype, **kw)
    with torch.no_grad():
        layer.weight.copy_(representable(layer.weight.shape, torch.float8_e4m3fn, scale=0.25))
        layer.layer_norm_weight.copy_(1 + representable(in_f, torch.bfloat16, scale=0.25))
        if layer.layer_norm_bias is not None:
            layer.layer_norm_bias.copy_(representable(in_f, torch.bfloat16, scale=0.25))
        if layer.bias is not None:
            layer.bias.copy_(representable(out_f, torch.bfloat16, scale=0.25))
    return layer


def grads_of(layer, x, dy, fp8_recipe=None, **fwd):
    x = x.clone().requires_grad_()
    with te.autocast(enabled=fp8_recipe is not None, recipe=fp8_recipe):
        y = layer(x, **fwd)
    y.backward(dy)
    names = ["layer_norm_weight", "layer_norm_bias", "weight", "bias"]
    grads = {n: getattr(layer, n).grad for n in names if getattr(layer, n) is not None}
    return y, x.grad, grads


def qdq(t: torch.Tensor, fp8_dtype: torch.dtype, recipe_name: str | None) -> torch.Tensor:
    """t as the layer's GEMM sees it: quantized and dequantized with the first step's scale
    (delayed scaling starts at scale 1; current scaling uses t's own amax); t unchanged in hp."""
    if recipe_name is None:
        return t.double()
    amax = t.detach().abs().max().float().reshape(1)
    scale = torch.ones(1)
    if recipe_name == "current":
        scale = ct.compute_scale_reference(amax, ct.FP8_MAX[fp8_dtype], 0.0, False)
    return ct.cast_reference(t.float(), scale, fp8_dtype).double() / scale.double()


def reference_grads(layer, x, dy, dtype, recipe_name=None):
    """(y, dx, {name: grad}) in fp64, rounded where the layer rounds: the norm output and its
    gradient to `dtype`, the GEMM operands to FP8 under a recipe."""
    params = {n: p.detach().double().requires_grad_() for n, p in layer.named_parameters()}
    x64 = x.double().requires_grad_()
    _, z = ref_forward(x64, params, layer.normalization, layer.zero_centered_gamma)
    z_q = qdq(z.detach().to(dtype), torch.float8_e4m3fn, recipe_name)
    w_q = qdq(params["weight"].detach(), torch.float8_e4m3fn, recipe_name)
    y = z_q @ w_q.t() + params["bias"].detach()
    dy_q = qdq(dy, torch.float8_e5m2, recipe_name)
    dz = (dy_q @ w_q).to(dtype).double()
    z.backward(dz)
    grads = {n: p.grad for n, p in params.items()}
    grads["weight"] = dy_q.t() @ z_q
    grads["bias"] = dy.double().sum(0)
    return y, x64.grad, grads


@pytest.mark.parametrize("normalization", NORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 17, 33), (5, 17, 33), (2, 3, 48, 16)])
def test_high_precision_matches_reference(normalization, dtype, shape):
    *lead, in_f, out_f = shape
    layer = make_layer(in_f, out_f, normalization, dtype)
    x = representable((*lead, in_f), torch.bfloat16).to(dtype)
    dy = representable((*lead, out_f), torch.bfloat16, scale=0.5).to(dtype)
    y, dx, grads = grads_of(layer, x, dy)
    y_ref, dx_ref, grads_ref = reference_grads(
        layer, x.reshape(-1, in_f), dy.reshape(-1, out_f), dtype
    )
    y_ref, dx_ref = y_ref.view(y.shape), dx_ref.view(dx.shape)
    assert y.dtype == dtype and y.shape == (*lead, out_f)
    assert_close(y, y_ref, dtype)
    assert_close(dx, dx_ref, dtype)
    for name, grad in grads.items():
        assert_close(grad, grads_ref[name], dtype, msg=name)


@pytest.mark.parametrize("normalization", NORMS)
@pytest.mark.parametrize("name", list(RECIPES))
def test_fp8_matches_reference(normalization, name):
    layer = make_layer(32, 48, normalization, torch.bfloat16)
    x = representable((17, 32), torch.bfloat16).bfloat16()
    dy = representable((17, 48), torch.float8_e5m2).bfloat16()
    y, dx, grads = grads_of(layer, x, dy, RECIPES[name]())
    y_ref, dx_ref, grads_ref = reference_grads(layer, x, dy, torch.bfloat16, name)
    assert_close(y, y_ref, torch.bfloat16)
    assert_close(dx, dx_ref, torch.bfloat16)
    for pname, grad in grads.items():
        assert_close(grad, grads_ref[pname], torch.bfloat16, msg=pname)


@pytest.mark.parametrize("normalization", NORMS)
def test_return_layernorm_output_and_bias(normalization):
    layer = make_layer(16, 32, normalization, return_layernorm_output=True, return_bias=True)
    x = representable((3, 16), torch.bfloat16).requires_grad_()
    y, bias, z = layer(x)
    y_ref, z_ref = reference(x, layer)
    assert bias is layer.bias
    assert_close(y + bias, y_ref, torch.float32)
    assert_close(z, z_ref, torch.float32)
    # Gradients flow through both outputs.
    (y.sum() + 2 * z.sum()).backward()
    x_ref = x.detach().double().requires_grad_()
    params = {n: p.detach() for n, p in layer.named_parameters() if n != "bias"}
    y2, z2 = ref_forward(x_ref, params, normalization, False)
    (y2.sum() + 2 * z2.sum()).backward()
    assert_close(x.grad, x_ref.grad, torch.float32)


def test_zero_centered_gamma_and_rmsnorm_parameters():
    layer = te.LayerNormLinear(16, 8, normalization="RMSNorm", zero_centered_gamma=True)
    names = [n for n, _ in layer.named_parameters()]
    assert names == ["layer_norm_weight", "weight", "bias"]
    assert torch.equal(layer.layer_norm_weight, torch.zeros(16))  # g = 1 + w = 1
    x = representable((4, 16), torch.bfloat16)
    assert_close(layer(x), reference(x, layer)[0], torch.float32)


def test_layernorm_parameter_names_match_transformer_engine():
    layer = te.LayerNormLinear(16, 8)
    assert list(layer.state_dict()) == [
        "layer_norm_weight",
        "layer_norm_bias",
        "weight",
        "bias",
        "_extra_state",
    ]


@pytest.mark.parametrize("name", ["hp", *RECIPES])
def test_zero_tokens(name):
    layer = make_layer(16, 16, "LayerNorm")
    x = torch.zeros(0, 16, requires_grad=True)
    fp8_recipe = RECIPES[name]() if name in RECIPES else None
    with te.autocast(enabled=fp8_recipe is not None, recipe=fp8_recipe):
        y = layer(x)
    y.sum().backward()
    assert y.shape == (0, 16) and x.grad.shape == (0, 16)
    assert not layer.weight.grad.any() and not layer.layer_norm_weight.grad.any()


@pytest.mark.parametrize("name", ["hp", *RECIPES])
def test_main_grad_accumulation(name):
    layer = make_layer(32, 16, "LayerNorm", fuse_wgrad_accumulation=True)
    layer.weight.main_grad = torch.zeros(16, 32)
    x = representable((5, 32), torch.bfloat16)
    dy = representable((5, 16), torch.float8_e5m2)
    fp8_recipe = RECIPES[name]() if name in RECIPES else None
    for _ in range(2):
        with te.autocast(enabled=fp8_recipe is not None, recipe=fp8_recipe):
            y = layer(x)
        y.backward(dy)
    # Step 1 of delayed scaling quantizes with scale 1; step 2 with fp8_max / (step 1's amax),
    # which for the same inputs is the current-scaling scale.
    steps = {"hp": (None, None), "delayed": ("delayed", "current"), "current": ("current",) * 2}
    expected = sum(
        reference_grads(layer, x, dy, torch.float32, step)[2]["weight"] for step in steps[name]
    )
    assert_close(layer.weight.main_grad, expected, torch.float32)
    assert layer.weight.grad is None
    assert layer.layer_norm_weight.grad is not None


def test_errors():
    with pytest.raises(ValueError, match="normalization must be one of"):
        te.LayerNormLinear(16, 8, normalization="BatchNorm")
    layer = te.LayerNormLinear(16, 8)
    with pytest.raises(ValueError, match="in_features is 16"):
        layer(torch.randn(2, 15))
    with pytest.raises(ValueError, match="divisible by 16"), te.autocast():
        te.LayerNormLinear(16, 8)(torch.randn(2, 16))
    with pytest.raises(TypeError, match="unexpected keyword"):
        te.LayerNormLinear(16, 8, bogus=1)


def test_no_setattr_on_the_hot_path():
    layer = te.LayerNormLinear(32, 16)
    x = torch.randn(4, 32, requires_grad=True)
    for fp8_recipe in (None, *[make() for make in RECIPES.values()]):
        with te.autocast(enabled=fp8_recipe is not None, recipe=fp8_recipe):
            y = layer(x)
        y.sum().backward()
    with pytest.warns(RuntimeWarning, match="_fast_setattr"):
        set_as_torchte(layer, "some_state", 1)


@pytest.mark.parametrize("module", ["LayerNormLinear", "LayerNormMLP"])
def test_gradient_through_the_norm_output_alone(module):
    layer = getattr(te, module)(16, 16, return_layernorm_output=True)
    x = representable((3, 16), torch.bfloat16).requires_grad_()
    _, z = layer(x)
    z.sum().backward()
    x_ref = x.detach().double().requires_grad_()
    F.layer_norm(x_ref, (16,), eps=1e-5).sum().backward()
    assert_close_to_scale(x.grad, x_ref.grad, torch.float32)
    weight = layer.weight if module == "LayerNormLinear" else layer.fc2_weight
    assert not weight.grad.any()  # the GEMM got a zero gradient


@pytest.mark.parametrize("keep_output", [False, True])
def test_delayed_scaling_fuses_the_norm_with_the_quantization(monkeypatch, keep_output):
    """Under delayed scaling the norm writes the GEMM's FP8 input itself, unless the module
    must hand out the high-precision norm output; the numerics are the unfused ones."""
    from torchte.kernels import norm_fp8

    calls = []
    original = norm_fp8.layernorm_forward_fp8

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(norm_fp8, "layernorm_forward_fp8", spy)
    layer = make_layer(32, 16, "LayerNorm", return_layernorm_output=keep_output)
    x = representable((5, 32), torch.bfloat16)
    with te.autocast(recipe=RECIPES["delayed"]()):
        out = layer(x)
    assert len(calls) == (0 if keep_output else 1)
    y = out[0] if keep_output else out
    y_ref, _, _ = reference_grads(layer, x, torch.zeros(5, 16), torch.float32, "delayed")
    assert_close(y, y_ref, torch.float32)
