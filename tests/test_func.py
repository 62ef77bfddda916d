"""te modules under torch.func: grad and vjp through functional_call give the gradients eager
autograd gives (high precision and current scaling); delayed scaling and vmap are refused with
a message saying what to do instead; functional_call with other parameters never gets the FP8
copy cached for the module's own."""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_close
from torch.func import functional_call, grad, vjp, vmap

import torchte as te
from torchte.recipe import DelayedScaling, Float8CurrentScaling

pytestmark = pytest.mark.usefixtures("cpu_default_device")

H, TOKENS = 32, 16


def builders() -> dict:
    return {
        "Linear": lambda: te.Linear(H, H),
        "Linear-split": lambda: te.Linear(H, 2 * H, parameters_split=("a", "b")),
        "LayerNormLinear": lambda: te.LayerNormLinear(H, H),
        "LayerNormMLP": lambda: te.LayerNormMLP(H, 2 * H, activation="swiglu"),
        "LayerNormMLP-checkpoint": lambda: te.LayerNormMLP(H, 2 * H, checkpoint=True),
        "GroupedLinear": lambda: te.GroupedLinear(2, H, H),
        "LayerNorm": lambda: te.LayerNorm(H),
        "RMSNorm": lambda: te.RMSNorm(H),
    }


def inputs(module, x) -> tuple:
    """The forward's arguments for x: with the split of a grouped module's tokens."""
    if isinstance(module, te.GroupedLinear):
        return x, [x.shape[0] // 2, x.shape[0] - x.shape[0] // 2]
    return (x,)


def loss_of(module, recipe):
    def loss(params, x):
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y = functional_call(module, params, inputs(module, x))
        return y.float().square().mean()

    return loss


CASES = [(name, None) for name in builders()] + [
    (name, Float8CurrentScaling())
    for name in builders()
    if not name.endswith("Norm") and name != "GroupedLinear"
]


@pytest.mark.parametrize(
    "name,recipe", CASES, ids=[f"{n}-{'fp32' if r is None else 'current'}" for n, r in CASES]
)
def test_grad_through_functional_call_equals_autograd(name, recipe):
    torch.manual_seed(0)
    assert_grad_equals_autograd(builders()[name](), recipe, torch.randn(TOKENS, H))


def assert_grad_equals_autograd(module, recipe, x) -> None:
    """torch.func.grad of the loss through functional_call equals autograd's .grad, exactly;
    to fp32 rounding for a LayerNormMLP on torch's own ops (its `_plain` shortcut, without
    FP8): torch.func differentiates F.silu through torch's decomposition of its backward, not
    the eager kernel, as for torch's own modules."""
    params = {k: v.detach() for k, v in module.named_parameters()}
    grads = grad(loss_of(module, recipe))(params, x)
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        module(*inputs(module, x)).float().square().mean().backward()
    torch_ops = recipe is None and isinstance(module, te.LayerNormMLP) and module._plain
    for k, p in module.named_parameters():
        if torch_ops:
            assert_close(grads[k], p.grad, torch.float32, msg=k)
        else:
            assert torch.equal(grads[k], p.grad), k


def test_vjp_gives_the_input_gradient():
    torch.manual_seed(1)
    module = te.LayerNormMLP(H, 2 * H)
    params = {k: v.detach() for k, v in module.named_parameters()}
    x = torch.randn(TOKENS, H, requires_grad=True)
    recipe = Float8CurrentScaling()

    def forward(x_in):
        with te.autocast(recipe=recipe):
            return functional_call(module, params, (x_in,))

    y, pullback = vjp(forward, x.detach())
    dy = torch.randn_like(y)
    (dx,) = pullback(dy)
    with te.autocast(recipe=recipe):
        y_eager = module(x)
    y_eager.backward(dy)
    assert torch.equal(y, y_eager.detach())
    assert torch.equal(dx, x.grad)


def test_functional_call_with_other_parameters_is_not_served_a_stale_fp8_weight():
    """Eagerly (no transform), under FP8: functional_call with other weights of the same
    version computes with those weights, not with the cached FP8 copy of the module's own."""
    torch.manual_seed(2)
    module = te.Linear(H, H)
    other = te.Linear(H, H)
    x = torch.randn(TOKENS, H)
    recipe = Float8CurrentScaling()
    with torch.no_grad(), te.autocast(recipe=recipe):
        module(x)  # caches the FP8 copy of module.weight
        swapped = functional_call(module, dict(other.named_parameters()), (x,))
        expected = other(x)
    assert torch.equal(swapped, expected)


def test_grouped_linear_fp8_under_torch_func_says_what_to_do():
    module = builders()["GroupedLinear"]()
    params = {k: v.detach() for k, v in module.named_parameters()}
    with pytest.raises(NotImplementedError, match="high precision only"):
        grad(loss_of(module, Float8CurrentScaling()))(params, torch.randn(TOKENS, H))


@pytest.mark.parametrize("name", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_delayed_scaling_under_torch_func_says_what_to_use(name):
    module = builders()[name]()
    params = {k: v.detach() for k, v in module.named_parameters()}
    with pytest.raises(NotImplementedError, match="Float8CurrentScaling"):
        grad(loss_of(module, DelayedScaling()))(params, torch.randn(TOKENS, H))
    # The refused call left nothing behind: the module trains eagerly as before.
    with te.autocast(recipe=DelayedScaling()):
        module(torch.randn(TOKENS, H, requires_grad=True)).sum().backward()


def test_vmap_is_refused_clearly():
    module = te.LayerNorm(H)
    params = {k: v.detach() for k, v in module.named_parameters()}
    per_sample = vmap(grad(loss_of(module, None)), in_dims=(None, 0))
    with pytest.raises(NotImplementedError, match="vmap over a te module"):
        per_sample(params, torch.randn(4, TOKENS, H))


GPU_CASES = [
    ("LayerNorm", None),
    ("LayerNormMLP", None),
    ("Linear", Float8CurrentScaling()),
    ("LayerNormLinear", Float8CurrentScaling()),
    ("LayerNormMLP", Float8CurrentScaling()),
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name,recipe",
    GPU_CASES,
    ids=[f"{n}-{'bf16' if r is None else 'current'}" for n, r in GPU_CASES],
)
def test_grad_on_gpu(name, recipe):
    """On a GPU the Triton kernels run inside the adapted forward and backward, below the
    transform, on plain tensors; the gradients are eager autograd's."""
    torch.manual_seed(4)
    with torch.device("cuda"):
        module = builders()[name]().bfloat16()
        x = torch.randn(TOKENS, H, dtype=torch.bfloat16)
    assert_grad_equals_autograd(module, recipe, x)
