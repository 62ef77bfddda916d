"""LayerNormMLP activations: the torch reference against an fp64 model (CPU), the Triton kernels
against the reference (GPU, and under Triton's CPU interpreter where triton is installed).

The fp64 model is written from the definitions alone (tanh-form gelu, torch.clamp, torch.relu,
torch.sigmoid in float64) and its gradients come from torch.autograd, so it shares no code or
formula with the reference, which computes gelu through a sigmoid and its derivatives by hand.
Inputs are exactly representable in the tested dtype, so the model sees the very values the
reference does; the tolerance is the shared one of that dtype.
"""

from __future__ import annotations

import math

import pytest
import torch
from interpreter import requires_interpreter, run_under_interpreter
from launches import count_device_ops
from tolerances import assert_close, representable

from torchte.kernels import activation as act
from torchte.kernels._triton import triton_available

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GATED = {"geglu", "glu", "qgeglu", "reglu", "sreglu", "swiglu", "clamped_swiglu"}
# Each activation's function of x (non-gated) or of x1 (gated), for the model.
BASE = {
    "gelu": "gelu",
    "geglu": "gelu",
    "glu": "sigmoid",
    "qgelu": "qgelu",
    "qgeglu": "qgelu",
    "relu": "relu",
    "reglu": "relu",
    "srelu": "srelu",
    "sreglu": "srelu",
    "silu": "silu",
    "swiglu": "silu",
}
NON_GATED_SHAPES = [(0, 7), (1, 1), (17, 1023), (127, 4096)]  # x (M, K), y (M, K)
GATED_SHAPES = [(0, 14), (1, 2), (3, 34), (17, 2046), (127, 8192)]  # x (M, 2N), y (M, N)
CASES = [
    (name, shape)
    for name in act.ACTIVATIONS
    for shape in (GATED_SHAPES if name in GATED else NON_GATED_SHAPES)
]
X_SCALE = 8.0  # past clamped_swiglu's limit of 7, and into the flat tails of the sigmoids
DY_SCALE = 2.0

requires_triton = pytest.mark.skipif(not triton_available(), reason="needs a CUDA GPU and Triton")


# ----------------------------------------------------------------------------------------------
# The fp64 model
# ----------------------------------------------------------------------------------------------


def model_base(a: torch.Tensor, base: str) -> torch.Tensor:
    """The activation of float64 a, from its textbook definition."""
    if base == "gelu":
        return 0.5 * a * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (a + 0.044715 * a**3)))
    if base == "qgelu":
        return a * torch.sigmoid(1.702 * a)
    if base == "relu":
        return torch.relu(a)
    if base == "srelu":
        return torch.relu(a) ** 2
    if base == "sigmoid":
        return torch.sigmoid(a)
    assert base == "silu"
    return a * torch.sigmoid(a)


def model_forward(x: torch.Tensor, name: str, limit: float = 7.0, alpha: float = 1.702):
    """y of the fp64 model: x (M, K) -> y (M, N), float64."""
    x = x.double()
    if name not in GATED:
        return model_base(x, BASE[name])
    x1, x2 = x.chunk(2, dim=-1)
    if name == "clamped_swiglu":
        x1 = torch.clamp(x1, max=limit)
        return x1 * torch.sigmoid(alpha * x1) * (torch.clamp(x2, -limit, limit) + 1.0)
    return model_base(x1, BASE[name]) * x2


def model_backward(dy: torch.Tensor, x: torch.Tensor, name: str, **params) -> torch.Tensor:
    """dx of the fp64 model by torch.autograd: dy (M, N), x (M, K) -> dx (M, K), float64."""
    x64 = x.detach().double().requires_grad_()
    y = model_forward(x64, name, **params)
    (dx,) = torch.autograd.grad(y, x64, dy.double(), allow_unused=True)
    return torch.zeros_like(x64) if dx is None else dx


def draw(name: str, shape: tuple[int, int], dtype: torch.dtype, device=None):
    """(x (M, K), dy (M, N)) exactly representable in dtype."""
    n = shape[1] // 2 if name in GATED else shape[1]
    x = representable(shape, dtype, scale=X_SCALE, device=device).to(dtype)
    dy = representable((shape[0], n), dtype, scale=DY_SCALE, device=device).to(dtype)
    return x, dy


def test_model_gelu_gradient_is_the_closed_form():
    # The autograd gradient of the model against Transformer Engine's dgelu, written out.
    a = torch.linspace(-9, 9, 721, dtype=torch.float64)
    dx = model_backward(torch.ones_like(a), a, "gelu")
    c = math.sqrt(2.0 / math.pi)
    t = torch.tanh(c * a * (1 + 0.044715 * a * a))
    closed = 0.5 * a * (1 - t * t) * (c + 3 * 0.044715 * c * a * a) + 0.5 * (1 + t)
    torch.testing.assert_close(dx, closed, rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------------------------------------------
# Reference vs the fp64 model (CPU)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,shape", CASES)
def test_reference_forward_matches_model(name, shape, dtype):
    x, _ = draw(name, shape, dtype)
    y = act.activation_forward(x, name)
    assert y.dtype == dtype and y.shape == (shape[0], shape[1] // 2 if name in GATED else shape[1])
    assert_close(y, model_forward(x, name), dtype, msg=f"{name} {shape} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,shape", CASES)
def test_reference_backward_matches_autograd(name, shape, dtype):
    x, dy = draw(name, shape, dtype)
    dx = act.activation_backward(dy, x, name)
    assert dx.dtype == dtype and dx.shape == x.shape
    assert_close(dx, model_backward(dy, x, name), dtype, msg=f"{name} {shape} {dtype}")


def clamp_grid(limit: float) -> torch.Tensor:
    """x (144, 2): every pair (x1, x2) of values around +-limit, at and past it."""
    points = [-2 * limit, -limit - 1, -limit - 0.5, -limit, -limit + 0.5, -1.0, 0.0, 0.5]
    points += [limit - 0.5, limit, limit + 0.5, 2 * limit]
    values = torch.tensor(points)
    x1, x2 = torch.meshgrid(values, values, indexing="ij")
    return torch.stack([x1.reshape(-1), x2.reshape(-1)], dim=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("limit,alpha", [(7.0, 1.702), (3.5, 1.0), (0.5, 2.0)])
def test_clamped_swiglu_near_and_beyond_the_limit(limit, alpha, dtype):
    x = clamp_grid(limit).to(dtype)
    dy = representable((x.shape[0], 1), dtype, scale=DY_SCALE).to(dtype)
    dy[dy == 0] = 1.0
    params = {"limit": limit, "alpha": alpha}
    y = act.activation_forward(x, "clamped_swiglu", **params)
    dx = act.activation_backward(dy, x, "clamped_swiglu", **params)
    assert_close(y, model_forward(x, "clamped_swiglu", **params), dtype)
    assert_close(dx, model_backward(dy, x, "clamped_swiglu", **params), dtype)
    x1, x2 = x[:, 0].float(), x[:, 1].float()
    # No gradient where a clamp is active; full gradient at the limit itself.
    assert not dx[:, 0][x1 > limit].any() and not dx[:, 1][x2.abs() > limit].any()
    assert dx[:, 0][(x1 == limit) & (x2 != -1.0)].all()
    # (x1 >= -limit - 1: further out, x1 sigmoid(alpha x1) underflows fp16.)
    assert dx[:, 1][(x2.abs() <= limit) & (x1 != 0.0) & (x1 >= -limit - 1)].all()
    # Past the limit, y is y at the limit.
    at_limit = act.activation_forward(x.clamp(max=limit), "clamped_swiglu", **params)
    past = x1 > limit
    assert torch.equal(y[past], at_limit[past])


@pytest.mark.parametrize("name", ["gelu", "geglu", "glu", "qgelu", "qgeglu", "silu", "swiglu"])
def test_reference_huge_inputs_stay_finite(name):
    # |x1|^3 overflows fp32: sigmoid saturates to 0 or 1 and the gradient is 0 or 1, not NaN.
    values = torch.tensor([1e30, -1e30, 1e20, -1e20, 1e10, -1e10, 100.0, -100.0])
    x = values[:, None] if name not in GATED else torch.stack([values, values.sign() * 2], 1)
    dy = torch.ones((8, 1))
    y = act.activation_forward(x, name)
    dx = act.activation_backward(dy, x, name)
    assert torch.isfinite(y).all() and torch.isfinite(dx).all()
    assert_close(y, model_forward(x, name), torch.float32)
    assert_close(dx, model_backward(dy, x, name), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_glu_gates_with_the_first_half(dtype):
    # Transformer Engine's glu is sigmoid(x1) * x2; torch's F.glu is x1 * sigmoid(x2): the same
    # function once the halves are swapped, and a different one on the halves as given.
    x, dy = draw("glu", (9, 24), dtype)
    x1, x2 = x.double().chunk(2, dim=-1)
    swapped = torch.cat([x2, x1], dim=-1).requires_grad_()
    y_torch = torch.nn.functional.glu(swapped, dim=-1)
    (d_swapped,) = torch.autograd.grad(y_torch, swapped, dy.double())
    y = act.activation_forward(x, "glu")
    dx = act.activation_backward(dy, x, "glu")
    assert_close(y, y_torch, dtype)
    assert_close(dx, torch.cat(d_swapped.chunk(2, dim=-1)[::-1], dim=-1), dtype)
    unswapped = torch.nn.functional.glu(x.double(), dim=-1)
    assert (y.double() - unswapped).abs().max() > 1.0


def test_relu_family_gradient_at_zero_is_zero():
    x = torch.zeros((1, 2))
    for name in ["relu", "srelu", "reglu", "sreglu"]:
        dx = act.activation_backward(torch.ones((1, 2 if name not in GATED else 1)), x, name)
        assert not dx.any(), name


# ----------------------------------------------------------------------------------------------
# API: names, shapes, errors
# ----------------------------------------------------------------------------------------------


def test_activation_names_and_gating():
    assert act.ACTIVATIONS == (
        "gelu", "geglu", "glu", "qgelu", "qgeglu", "relu", "reglu", "srelu", "sreglu", "silu",
        "swiglu", "clamped_swiglu",
    )  # fmt: skip
    assert {name for name in act.ACTIVATIONS if act.is_gated(name)} == GATED


@pytest.mark.parametrize("name", act.ACTIVATIONS)
def test_shapes_gated_and_not(name):
    x = representable((2, 3, 10), torch.bfloat16).bfloat16()  # leading dims are kept
    n = 5 if name in GATED else 10
    y = act.activation_forward(x, name)
    assert y.shape == (2, 3, n) and y.dtype == torch.bfloat16
    dy = torch.ones((2, 3, n), dtype=torch.float32)  # dy may differ from x's dtype
    dx = act.activation_backward(dy, x, name)
    assert dx.shape == x.shape and dx.dtype == torch.bfloat16
    assert_close(dx, model_backward(dy, x, name), torch.bfloat16)


@pytest.mark.parametrize("name", act.ACTIVATIONS)
def test_zero_rows(name):
    x = torch.empty((0, 6), dtype=torch.float16)
    y = act.activation_forward(x, name)
    assert y.shape == (0, 3 if name in GATED else 6) and y.dtype == torch.float16
    assert act.activation_backward(y, x, name).shape == (0, 6)


def test_unknown_name_raises_listing_the_known_ones():
    x = torch.ones((2, 4))
    calls = [
        lambda: act.activation_forward(x, "gelu_tanh"),
        lambda: act.activation_backward(x, x, "gelu_tanh"),
        lambda: act.is_gated("gelu_tanh"),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="unknown activation 'gelu_tanh'") as info:
            call()
        assert all(name in str(info.value) for name in act.ACTIVATIONS)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="even"):
        act.activation_forward(torch.ones((3, 5)), "swiglu")
    with pytest.raises(TypeError, match="float64"):
        act.activation_forward(torch.ones((3, 4), dtype=torch.float64), "gelu")
    with pytest.raises(ValueError, match=r"dy must have shape \(3, 2\)"):
        act.activation_backward(torch.ones((3, 4)), torch.ones((3, 4)), "geglu")
    with pytest.raises(TypeError, match="dy must be"):
        act.activation_backward(torch.ones((3, 4), dtype=torch.int32), torch.ones((3, 4)), "relu")


# ----------------------------------------------------------------------------------------------
# Triton vs the reference (GPU)
# ----------------------------------------------------------------------------------------------

GPU_SHAPES = [(0, 5), (1, 1), (3, 17), (16, 2048), (17, 1023), (127, 4096), (1000, 1536)]


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("m,n", GPU_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", act.ACTIVATIONS)
def test_triton_matches_reference(name, dtype, m, n):
    shape = (m, 2 * n) if name in GATED else (m, n)
    x, dy = draw(name, shape, dtype, device="cuda")
    y, y_ref = act.activation_forward(x, name), act.activation_forward_reference(x, name)
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    assert_close(y, y_ref, dtype, msg=f"forward {name} {shape} {dtype}")
    dx, dx_ref = (
        act.activation_backward(dy, x, name),
        act.activation_backward_reference(dy, x, name),
    )
    assert dx.dtype == dx_ref.dtype and dx.shape == dx_ref.shape
    assert_close(dx, dx_ref, dtype, msg=f"backward {name} {shape} {dtype}")


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_clamped_swiglu_params_and_huge_inputs(dtype):
    for limit, alpha in [(7.0, 1.702), (3.5, 1.0), (0.5, 2.0)]:
        x = clamp_grid(limit).to(device="cuda", dtype=dtype)
        dy = representable((x.shape[0], 1), dtype, scale=DY_SCALE, device="cuda").to(dtype)
        params = {"name": "clamped_swiglu", "limit": limit, "alpha": alpha}
        y, y_ref = (
            act.activation_forward(x, **params),
            act.activation_forward_reference(x, **params),
        )
        assert_close(y, y_ref, dtype)
        dx = act.activation_backward(dy, x, **params)
        assert_close(dx, act.activation_backward_reference(dy, x, **params), dtype)
    values = torch.tensor([1e30, -1e30, 1e20, -1e20, 100.0, -100.0], device="cuda")
    for name in ["gelu", "qgelu", "silu", "geglu", "glu", "swiglu"]:
        x = values[:, None] if name not in GATED else torch.stack([values, values.sign()], 1)
        dy = torch.ones((6, 1), device="cuda")
        y, dx = act.activation_forward(x, name), act.activation_backward(dy, x, name)
        assert_close(y, act.activation_forward_reference(x, name), torch.float32)
        assert_close(dx, act.activation_backward_reference(dy, x, name), torch.float32)


@pytest.mark.gpu
@requires_triton
def test_triton_mixed_dy_dtype_and_leading_dims():
    x = representable((2, 7, 34), torch.bfloat16, scale=X_SCALE, device="cuda").bfloat16()
    dy = representable((2, 7, 17), torch.float16, device="cuda")  # fp32, not bf16
    for name in ["swiglu", "gelu"]:
        dy_n = dy if name in GATED else torch.cat([dy, dy], -1)
        dx = act.activation_backward(dy_n, x, name)
        assert_close(dx, act.activation_backward_reference(dy_n, x, name), torch.bfloat16)


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("name", ["gelu", "swiglu", "clamped_swiglu", "srelu"])
def test_triton_one_launch_per_call(name):
    x, dy = draw(name, (16, 4096), torch.bfloat16, device="cuda")
    empty_x = x[:0]

    def forward():
        act.activation_forward(x, name)

    def backward():
        act.activation_backward(dy, x, name)

    def empty():
        act.activation_backward(dy[:0], empty_x, name)
        act.activation_forward(empty_x, name)

    forward()  # compile outside the profile
    backward()
    counts = [count_device_ops(forward), count_device_ops(backward)]
    if counts == [0, 0]:
        pytest.skip("the profiler records no GPU activity here")
    assert counts == [1, 1]
    assert count_device_ops(empty) == 0


# ----------------------------------------------------------------------------------------------
# The Triton kernels under Triton's CPU interpreter (where triton is installed)
# ----------------------------------------------------------------------------------------------

# Runs in a fresh process: TRITON_INTERPRET must be set before the kernels are defined. The
# launchers run on CPU tensors there; the tile configs make several row and column blocks.
INTERPRETER_SCRIPT = """
import torch
from tolerances import assert_close, representable
from torchte.kernels import activation as act

def check(x, dy, name, config, **params):
    where = (name, tuple(x.shape), x.dtype, config, params)
    y = act._forward_triton(x, name, params.get("limit", 7.0), params.get("alpha", 1.702), config)
    y_ref = act.activation_forward_reference(x, name, **params)
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape, where
    assert_close(y, y_ref, x.dtype, msg=str(where))
    dx = act._backward_triton(dy, x, name, params.get("limit", 7.0), params.get("alpha", 1.702),
                              config)
    dx_ref = act.activation_backward_reference(dy, x, name, **params)
    assert dx.dtype == dx_ref.dtype and dx.shape == dx_ref.shape, where
    assert_close(dx, dx_ref, x.dtype, msg=str(where))

def draw(shape, n, dtype):
    x = representable(shape, dtype, scale=8.0).to(dtype)
    return x, representable((*shape[:-1], n), dtype, scale=2.0).to(dtype)

torch.manual_seed(0)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (x shape, tile config): one program; (2, 32) / 64-element tiles with masked rows and columns;
# 68 programs of (1, 256) on an odd width; the default config on a wide row.
SHAPES = [((1, 2), act.FORWARD_CONFIG), ((3, 34), (64, 4)), ((17, 2046), (256, 4)),
          ((3, 4096), act.FORWARD_CONFIG), ((0, 6), act.FORWARD_CONFIG)]
for name in act.ACTIVATIONS:
    for dtype in DTYPES:
        for shape, config in SHAPES:
            n = shape[1] // 2
            if not act.is_gated(name):  # the same sizes as non-gated x: (1, 1), (3, 17), ...
                shape = (shape[0], n)
            check(*draw(shape, n, dtype), name, config)
for limit, alpha in [(3.5, 1.0), (0.5, 2.0)]:
    check(*draw((5, 40), 20, torch.float32), "clamped_swiglu", (64, 2), limit=limit, alpha=alpha)
    values = torch.tensor([-2 * limit, -limit - 0.5, -limit, -1.0, 0.0, limit, limit + 0.5])
    x1, x2 = torch.meshgrid(values, values, indexing="ij")
    x = torch.stack([x1.reshape(-1), x2.reshape(-1)], 1)
    dy = torch.ones((x.shape[0], 1))
    check(x, dy, "clamped_swiglu", (64, 2), limit=limit, alpha=alpha)
huge = torch.tensor([1e30, -1e30, 1e20, -1e20, 100.0, -100.0, 0.0, 1.0])
for name in ["gelu", "qgelu", "silu", "geglu", "glu", "swiglu", "relu", "srelu"]:
    x = huge[:, None] if not act.is_gated(name) else torch.stack([huge, huge.sign()], 1)
    check(x, torch.ones((8, 1)), name, (32, 1))
# Leading dims and a dy in another dtype than x.
x = representable((2, 3, 20), torch.bfloat16, scale=8.0).bfloat16()
check(x, representable((2, 3, 10), torch.float32), "swiglu", (64, 2))
check(x, representable((2, 3, 20), torch.float16).half(), "qgelu", (64, 2))
print("ok")
"""


@requires_interpreter
def test_triton_kernels_in_interpreter_match_reference():
    run_under_interpreter(INTERPRETER_SCRIPT)
