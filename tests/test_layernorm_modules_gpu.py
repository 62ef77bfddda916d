"""te.LayerNormLinear and te.LayerNormMLP on a CUDA GPU against the CPU emulation, and their
launch counts."""

from __future__ import annotations

import pytest
import torch
from launches import count_device_ops
from tolerances import assert_close, assert_close_to_scale, representable

import torchte as te
from torchte import recipe

pytestmark = pytest.mark.gpu

RECIPES = {
    "bf16": lambda: None,
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "current": lambda: recipe.Float8CurrentScaling(),
}


def _same_weights(gpu: torch.nn.Module, cpu: torch.nn.Module) -> None:
    with torch.no_grad():
        for (name, p_gpu), (_, p_cpu) in zip(
            gpu.named_parameters(), cpu.named_parameters(), strict=True
        ):
            scale = 0.25 if "layer_norm" not in name else 0.125
            value = representable(p_cpu.shape, torch.float8_e4m3fn, scale=scale)
            if name == "layer_norm_weight":
                value = value + 1
            p_gpu.copy_(value)
            p_cpu.copy_(value)


def _step(module, x, dy, fp8_recipe):
    x = x.clone().requires_grad_()
    with te.autocast(enabled=fp8_recipe is not None, recipe=fp8_recipe):
        y = module(x)
    y.backward(dy)
    grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    return [y, x.grad, *grads]


def _compare(make, shape_in, shape_out, name):
    gpu, cpu = make("cuda"), make("cpu")
    _same_weights(gpu, cpu)
    fp8_recipe = RECIPES[name]()
    tol = torch.bfloat16 if fp8_recipe is None else torch.float8_e5m2
    for step in range(2):
        x = representable(shape_in, torch.bfloat16, scale=2.0**step).bfloat16()
        dy = representable(shape_out, torch.bfloat16, scale=0.5).bfloat16()
        got = _step(gpu, x.cuda(), dy.cuda(), fp8_recipe)
        want = _step(cpu, x, dy, fp8_recipe)
        for g, w in zip(got, want, strict=True):
            assert_close_to_scale(g.float().cpu(), w.float(), tol)


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_linear_gpu_matches_cpu(name, normalization):
    def make(device):
        return te.LayerNormLinear(
            64, 48, normalization=normalization, params_dtype=torch.bfloat16, device=device
        )

    _compare(make, (3, 17, 64), (3, 17, 48), name)


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("activation", ["gelu", "swiglu", "glu"])
@pytest.mark.parametrize("checkpoint", [False, True])
def test_layernorm_mlp_gpu_matches_cpu(name, activation, checkpoint):
    def make(device):
        return te.LayerNormMLP(
            64,
            96,
            activation=activation,
            checkpoint=checkpoint,
            params_dtype=torch.bfloat16,
            device=device,
        )

    _compare(make, (2, 9, 64), (2, 9, 64), name)


def test_layernorm_mlp_gpu_fp32_close_to_fp64():
    mlp = te.LayerNormMLP(64, 128, activation="swiglu", device="cuda")
    x = representable((33, 64), torch.bfloat16, device="cuda")
    y = mlp(x)
    p = {n: t.detach().double() for n, t in mlp.named_parameters()}
    z = torch.nn.functional.layer_norm(
        x.double(), (64,), p["layer_norm_weight"], p["layer_norm_bias"], 1e-5
    )
    h = z @ p["fc1_weight"].t() + p["fc1_bias"]
    x1, x2 = h.chunk(2, dim=-1)
    a = x1 * torch.sigmoid(x1) * x2
    assert_close(y, a @ p["fc2_weight"].t() + p["fc2_bias"], torch.bfloat16)


# Forward+backward launches at 16 tokens, hidden 1024, ffn 4096, per recipe: a regression in
# fusion shows up here. bf16: norm, fc1, act, fc2 forward; fc2 dgrad, wgrad, dbias, act bwd,
# fc1 dgrad, wgrad, dbias, and the norm backward (measured 15 in all on an H200). FP8 adds the
# quantizations (input, weight and grad of each GEMM; current scaling of a large weight takes
# 3 launches) and, for delayed scaling, the two scale updates; under delayed scaling the
# norm and the activation forward are fused with their quantization, and the activation
# backward with the quantization of dh and fc1's bias gradient (4 launches fewer).
EXPECTED_MLP_LAUNCHES = {"bf16": 15, "delayed": 17, "current": 23}


@pytest.mark.parametrize("name", list(RECIPES))
def test_layernorm_mlp_launch_count(name):
    mlp = te.LayerNormMLP(1024, 4096, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16)
    fp8_recipe = RECIPES[name]()

    def step():
        x.grad = None
        mlp.zero_grad(set_to_none=True)
        with te.autocast(enabled=fp8_recipe is not None, recipe=fp8_recipe):
            y = mlp(x)
        y.backward(dy)

    step()
    count = count_device_ops(step)
    print(f"launches LayerNormMLP {name} fwdbwd: {count}")
    assert count <= EXPECTED_MLP_LAUNCHES[name]
