"""te.LayerNormMLP against an fp64 norm -> fc1 -> activation -> fc2 with the same weights.

The reference rounds where the module rounds: the norm output, h and a to the compute dtype,
and under FP8 each GEMM operand to FP8 with the first step's scale (delayed scaling starts at
1; current scaling uses the tensor's own amax). What is left is GEMM accumulation order.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_layernorm_linear import qdq
from tolerances import assert_close, assert_close_to_scale, representable

import torchte as te
from torchte import recipe
from torchte.kernels.activation import (
    ACTIVATIONS,
    activation_backward_reference,
    activation_forward_reference,
    is_gated,
)

pytestmark = pytest.mark.usefixtures("cpu_default_device")

RECIPES = {
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "current": lambda: recipe.Float8CurrentScaling(),
}


def _gelu(t):
    return 0.5 * t * (1 + torch.tanh(math.sqrt(2 / math.pi) * (t + 0.044715 * t**3)))


def _qgelu(t):
    return t * torch.sigmoid(1.702 * t)


def _srelu(t):
    return torch.relu(t) ** 2


def _silu(t):
    return t * torch.sigmoid(t)


# The function applied to x (or, gated, to the first half x1, times the second half x2).
BASE = {
    "gelu": _gelu,
    "geglu": _gelu,
    "glu": torch.sigmoid,  # of the first half, as in Transformer Engine (F.glu: the second)
    "qgelu": _qgelu,
    "qgeglu": _qgelu,
    "relu": torch.relu,
    "reglu": torch.relu,
    "srelu": _srelu,
    "sreglu": _srelu,
    "silu": _silu,
    "swiglu": _silu,
}


def act_ref(h: torch.Tensor, name: str, limit=7.0, alpha=1.702) -> torch.Tensor:
    """The activation in fp64 torch ops, written from Transformer Engine's definitions."""
    if name == "clamped_swiglu":
        x1, x2 = h.chunk(2, dim=-1)
        x1c, x2c = x1.clamp(max=limit), x2.clamp(-limit, limit)
        return x1c * torch.sigmoid(alpha * x1c) * (x2c + 1)
    if is_gated(name):
        x1, x2 = h.chunk(2, dim=-1)
        return BASE[name](x1) * x2
    return BASE[name](h)


def make_mlp(hidden, ffn, activation, dtype=torch.float32, **kw):
    mlp = te.LayerNormMLP(hidden, ffn, activation=activation, params_dtype=dtype, **kw)
    with torch.no_grad():
        for name, p in mlp.named_parameters():
            if name.endswith("weight") and name.startswith("fc"):
                p.copy_(representable(p.shape, torch.float8_e4m3fn, scale=0.25))
            elif name == "layer_norm_weight":
                p.copy_(1 + representable(p.shape, torch.bfloat16, scale=0.25))
            else:
                p.copy_(representable(p.shape, torch.bfloat16, scale=0.25))
    return mlp


def reference(mlp, x, dy, dtype, recipe_name=None):
    """(y, dx, {param: grad}) in fp64, rounded where the module rounds."""
    p = {n: t.detach().double().requires_grad_() for n, t in mlp.named_parameters()}
    x64 = x.double().requires_grad_()
    g = p["layer_norm_weight"]
    z = F.layer_norm(x64, x64.shape[-1:], g, p.get("layer_norm_bias"), 1e-5)
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    z_q = qdq(z.detach().to(dtype), e4m3, recipe_name)
    w1_q = qdq(p["fc1_weight"].detach(), e4m3, recipe_name)
    h = (z_q @ w1_q.t() + p["fc1_bias"].detach()).to(dtype).double().requires_grad_()
    a = act_ref(h, mlp.activation)
    # The forward value of a as the module rounds it (the activation kernels are checked
    # against fp64 in test_kernels_activation.py): a one-ulp difference here could move an
    # FP8 rounding of a and make the comparison of y test the rounding boundary.
    a_value = activation_forward_reference(h.detach().to(dtype), mlp.activation)
    a_q = qdq(a_value, e4m3, recipe_name)
    w2_q = qdq(p["fc2_weight"].detach(), e4m3, recipe_name)
    y = a_q @ w2_q.t() + p["fc2_bias"].detach()
    dy_q = qdq(dy, e5m2, recipe_name)
    da = (dy_q @ w2_q).to(dtype)
    a.backward(da.double())  # h.grad: the fp64 gradient, checked against the module's below
    dh = activation_backward_reference(da, h.detach().to(dtype), mlp.activation)
    assert_close(dh, h.grad, dtype, msg="activation backward")
    dh_q = qdq(dh, e5m2, recipe_name)
    dz = (dh_q @ w1_q).to(dtype).double()
    z.backward(dz)
    grads = {n: t.grad for n, t in p.items()}
    grads.update(
        fc2_weight=dy_q.t() @ a_q,
        fc2_bias=dy.double().sum(0),
        fc1_weight=dh_q.t() @ z_q,
        fc1_bias=dh.double().sum(0),
    )
    return y, x64.grad, grads


def run(mlp, x, dy, fp8_recipe=None):
    """(y, dx, {name: grad}) of the module's Function, whose rounding `reference` follows
    (without FP8 a plain module takes torch's own ops instead: test_layernorm_torch_path.py)."""
    mlp._fast_setattr("_plain", False)
    x = x.clone().requires_grad_()
    with te.autocast(enabled=fp8_recipe is not None, recipe=fp8_recipe):
        y = mlp(x)
    y.backward(dy)
    return y, x.grad, {n: p.grad for n, p in mlp.named_parameters()}


def check(mlp, x, dy, dtype, name=None):
    fp8_recipe = RECIPES[name]() if name else None
    y, dx, grads = run(mlp, x.to(dtype), dy.to(dtype), fp8_recipe)
    y_ref, dx_ref, grads_ref = reference(mlp, x.to(dtype), dy.to(dtype), dtype, name)
    assert_close(y, y_ref, dtype)
    assert_close_to_scale(dx, dx_ref, dtype)
    for pname, grad in grads.items():
        assert_close(grad, grads_ref[pname], dtype, msg=pname)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_every_activation_high_precision(activation):
    mlp = make_mlp(16, 24, activation)
    x = representable((5, 16), torch.bfloat16)
    dy = representable((5, 16), torch.bfloat16, scale=0.5)
    check(mlp, x, dy, torch.float32)


@pytest.mark.parametrize("activation", ["gelu", "swiglu", "srelu", "clamped_swiglu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_odd_sizes(activation, dtype):
    mlp = make_mlp(17, 33, activation, dtype)
    x = representable((7, 17), torch.bfloat16)
    dy = representable((7, 17), torch.bfloat16, scale=0.5)
    check(mlp, x, dy, dtype)


@pytest.mark.parametrize("activation", ["gelu", "swiglu", "qgeglu", "glu"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_fp8(activation, name):
    mlp = make_mlp(32, 48, activation, torch.bfloat16)
    x = representable((17, 32), torch.bfloat16)
    dy = representable((17, 32), torch.float8_e5m2)
    check(mlp, x, dy, torch.bfloat16, name)


@pytest.mark.parametrize("name", ["hp", *RECIPES])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_checkpoint_gives_the_same_gradients(name, activation):
    x = representable((2, 9, 32), torch.bfloat16)
    dy = representable((2, 9, 32), torch.bfloat16, scale=0.5)
    results = []
    for checkpoint in (False, True):
        torch.manual_seed(0)
        mlp = make_mlp(32, 64, activation, torch.bfloat16, checkpoint=checkpoint)
        fp8_recipe = RECIPES[name]() if name in RECIPES else None
        for _ in range(2):  # two steps: delayed scales move between them
            y, dx, grads = run(mlp, x.bfloat16(), dy.bfloat16(), fp8_recipe)
        results.append((y, dx, grads))
    (y0, dx0, g0), (y1, dx1, g1) = results
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1)
    for pname in g0:
        assert torch.equal(g0[pname], g1[pname]), pname


def test_parameters_and_outputs():
    mlp = te.LayerNormMLP(
        16, 32, activation="swiglu", return_bias=True, return_layernorm_output=True
    )
    names = [n for n, _ in mlp.named_parameters()]
    assert names == [
        "layer_norm_weight",
        "layer_norm_bias",
        "fc1_weight",
        "fc1_bias",
        "fc2_weight",
        "fc2_bias",
    ]
    assert mlp.fc1_weight.shape == (64, 16) and mlp.fc2_weight.shape == (16, 32)
    x = representable((3, 16), torch.bfloat16)
    _, bias, z = mlp(x)
    assert bias is mlp.fc2_bias and z.shape == (3, 16)
    assert_close(z, F.layer_norm(x.double(), (16,), eps=1e-5), torch.float32)


def test_rmsnorm_zero_centered_and_main_grad():
    mlp = te.LayerNormMLP(
        16, 16, normalization="RMSNorm", zero_centered_gamma=True, fuse_wgrad_accumulation=True
    )
    assert mlp.layer_norm_bias is None and not mlp.layer_norm_weight.any()
    mlp.fc1_weight.main_grad = torch.zeros(16, 16)
    mlp.fc2_weight.main_grad = torch.zeros(16, 16)
    x = representable((4, 16), torch.bfloat16, scale=2.0).requires_grad_()
    mlp(x).sum().backward()
    assert mlp.fc1_weight.grad is None and mlp.fc2_weight.main_grad.abs().sum() > 0
    assert mlp.fc1_weight.main_grad.abs().sum() > 0 and x.grad is not None


def test_model_init_and_errors():
    with te.quantized_model_init():
        mlp = te.LayerNormMLP(32, 32)
    assert isinstance(mlp.fc1_weight, te.Float8Tensor)
    with te.autocast():
        mlp(torch.randn(4, 32)).sum().backward()
    with pytest.raises(ValueError, match="activation must be one of"):
        te.LayerNormMLP(16, 16, activation="tanh")
    with pytest.raises(ValueError, match="hidden_size is 16"):
        te.LayerNormMLP(16, 16)(torch.randn(2, 8))
    with pytest.raises(ValueError, match="ffn_hidden_size divisible by 16"), te.autocast():
        te.LayerNormMLP(16, 24)(torch.randn(2, 16))
    with pytest.raises(ValueError, match="activation_params"):
        te.LayerNormMLP(16, 16, activation="clamped_swiglu", activation_params={"beta": 1})
