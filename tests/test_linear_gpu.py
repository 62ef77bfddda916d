"""te.Linear on a CUDA GPU: same FP8 bytes and scales as the CPU emulation, numerics, launches."""

from __future__ import annotations

import pytest
import torch
from launches import count_device_ops
from tolerances import assert_close, representable

import torchte as te
from torchte import recipe

pytestmark = pytest.mark.gpu

RECIPES = {
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "current": lambda: recipe.Float8CurrentScaling(),
}


def _pair(in_f, out_f, dtype, **kw):
    """The same layer on the GPU and on the CPU."""
    gpu = te.Linear(in_f, out_f, params_dtype=dtype, device="cuda", **kw)
    cpu = te.Linear(in_f, out_f, params_dtype=dtype, device="cpu", **kw)
    with torch.no_grad():
        w = representable((out_f, in_f), torch.float8_e4m3fn, scale=0.125)
        gpu.weight.copy_(w)
        cpu.weight.copy_(w)
        if gpu.bias is not None:
            b = representable(out_f, torch.bfloat16, scale=0.5)
            gpu.bias.copy_(b)
            cpu.bias.copy_(b)
    return gpu, cpu


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_matches_cpu_emulation_over_steps(name, dtype):
    """Three steps of training: scales, amax histories and grads match the CPU emulation."""
    gpu, cpu = _pair(64, 48, dtype)
    fp8_recipe = RECIPES[name]()
    for step in range(3):
        x = representable((3, 17, 64), torch.bfloat16, scale=2.0**step).to(dtype)
        dy = representable((3, 17, 48), torch.bfloat16, scale=0.25).to(dtype)
        outs = []
        for layer, device in ((gpu, "cuda"), (cpu, "cpu")):
            xi = x.to(device).requires_grad_()
            with te.autocast(recipe=fp8_recipe):
                y = layer(xi)
            y.backward(dy.to(device))
            outs.append((y, xi.grad, layer.weight.grad, layer.bias.grad))
            layer.weight.grad = None
            layer.bias.grad = None
        tol = torch.float8_e4m3fn
        for got, want in zip(outs[0], outs[1], strict=True):
            assert_close(got.float().cpu(), want.float(), tol)
    if name == "delayed":
        for g_state, c_state in zip(gpu._delayed_states[4], cpu._delayed_states[4], strict=True):
            assert torch.equal(g_state.scale.cpu(), c_state.scale)
            assert torch.equal(g_state.amax_history.cpu(), c_state.amax_history)


@pytest.mark.parametrize("name", list(RECIPES))
def test_gpu_quantizer_bytes_match_cpu(name):
    """The input quantizer of a GPU layer writes the same bytes as the CPU one."""
    gpu, cpu = _pair(128, 32, torch.bfloat16)
    fp8_recipe = RECIPES[name]()
    x = torch.randn(131, 128, dtype=torch.bfloat16) * 3
    values = []
    for layer, device in ((gpu, "cuda"), (cpu, "cpu")):
        setup = layer._fp8_setup(fp8_recipe)
        storage = setup.input[0].quantize(x.to(device), rowwise=True, columnwise=True)
        values.append([t.cpu() for t in storage.get_data_tensors()])
    for got, want in zip(*values, strict=True):
        if got.dtype.is_floating_point and got.element_size() == 1:
            got, want = got.view(torch.uint8), want.view(torch.uint8)
        assert torch.equal(got, want)


def _power_2_scale(amax, scale, fp8_max, recipe):
    """Delayed scaling rounded down to powers of two, so that scaled values stay exact."""
    new_scale = torch.exp2(torch.floor(torch.log2(fp8_max / amax)))
    return torch.where((amax > 0) & torch.isfinite(amax), new_scale, scale)


EXACT_RECIPES = {
    "delayed": lambda: recipe.DelayedScaling(
        amax_history_len=2, scaling_factor_compute_algo=_power_2_scale
    ),
    "current": lambda: recipe.Float8CurrentScaling(use_power_2_scales=True),
}


@pytest.mark.parametrize("tokens", [1, 17, 256])
@pytest.mark.parametrize("name", list(EXACT_RECIPES))
def test_gpu_main_grad_accumulates(name, tokens):
    """x on the e4m3 grid, dy on the e5m2 grid, power-of-two scales: the FP8 operands are the
    exact inputs and every partial sum is exact in fp32, so main_grad meets the fp32 tolerance
    against an fp64 reference."""
    layer = te.Linear(
        64, 32, params_dtype=torch.bfloat16, device="cuda", fuse_wgrad_accumulation=True
    )
    layer.weight.main_grad = torch.zeros(32, 64, device="cuda")
    x = representable((tokens, 64), torch.float8_e4m3fn, device="cuda")
    dy = representable((tokens, 32), torch.float8_e5m2, device="cuda")
    for _ in range(2):
        with te.autocast(recipe=EXACT_RECIPES[name]()):
            y = layer(x.to(torch.bfloat16))
        y.backward(dy.to(torch.bfloat16))
    expected = 2 * (dy.double().t() @ x.double())
    assert_close(layer.weight.main_grad, expected, torch.float32)


def test_gpu_bf16_main_grad_uses_fp32_accumulation():
    layer = te.Linear(
        64, 32, params_dtype=torch.bfloat16, device="cuda", fuse_wgrad_accumulation=True
    )
    layer.weight.main_grad = torch.zeros(32, 64, device="cuda")
    x = representable((40, 64), torch.bfloat16, device="cuda").bfloat16()
    dy = representable((40, 32), torch.bfloat16, device="cuda").bfloat16()
    for _ in range(3):
        layer(x).backward(dy)
    expected = 3 * (dy.double().t() @ x.double())
    assert_close(layer.weight.main_grad, expected, torch.float32)


# Launch counts per call: a regression in fusion shows up here as a larger number.
# forward: quantize x (one launch; current scaling of a large tensor, such as the 1024 x 1024
# weight, takes three: memset + amax + cast) + GEMM. The FP8 weight is requantized once per
# step (autocast region): its delayed scale moves at every region exit, and a write through
# .data does not move _version. The exit runs one scale-update launch under delayed scaling.
# forward+backward adds: quantize dy, dgrad, wgrad, dbias, and for delayed scaling the update at
# the end of backward.
EXPECTED_LAUNCHES = {
    ("bf16", "fwd"): 1,
    ("delayed", "fwd"): 4,
    ("current", "fwd"): 5,
    ("bf16", "fwdbwd"): 4,
    ("delayed", "fwdbwd"): 9,
    ("current", "fwdbwd"): 9,
}


@pytest.mark.parametrize("name", ["bf16", *RECIPES])
@pytest.mark.parametrize("phase", ["fwd", "fwdbwd"])
def test_launch_count(name, phase):
    layer = te.Linear(1024, 1024, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16)
    fp8_recipe = RECIPES[name]() if name in RECIPES else None

    def step():
        x.grad = layer.weight.grad = layer.bias.grad = None  # no grad accumulation launches
        with te.autocast(enabled=fp8_recipe is not None, recipe=fp8_recipe):
            y = layer(x)
        if phase == "fwdbwd":
            y.backward(dy)

    step()  # warm-up: compile kernels, fill caches
    count = count_device_ops(step)
    print(f"launches {name} {phase}: {count}")
    assert count <= EXPECTED_LAUNCHES[(name, phase)]
