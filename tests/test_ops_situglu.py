"""te.ops.SiTUGLU and te.ops.ScaledSiTUGLU (the soft-capped SiLU-gated unit) against an fp64
formula from exactly representable inputs, forward and backward, alone, interleaved, scaled, and
inside a Sequential under FP8 (where they run unfused: high-precision activation, then the next
GEMM's own quantization)."""

from __future__ import annotations

import math

import pytest
import torch
from tolerances import assert_close, representable

import torchte as te

pytestmark = pytest.mark.usefixtures("cpu_default_device")


def situglu_fp64(x: torch.Tensor, beta1: float, beta2: float) -> torch.Tensor:
    """y = beta1 tanh(a / beta1) sigmoid(a) * beta2 tanh(b / beta2) for x = [a, b], in fp64."""
    a, b = x.double().chunk(2, dim=-1)
    return beta1 * torch.tanh(a / beta1) * torch.sigmoid(a) * beta2 * torch.tanh(b / beta2)


def reference(x, dy, beta1, beta2, scales=None):
    """(y, dx, ds) in fp64 by autograd over the formula; ds None without scales."""
    x64 = x.detach().double().requires_grad_()
    s64 = None if scales is None else scales.detach().double().requires_grad_()
    y = situglu_fp64(x64, beta1, beta2)
    if s64 is not None:
        y = y * s64.reshape(*y.shape[:-1], 1)
    inputs = (x64,) if s64 is None else (x64, s64)
    grads = torch.autograd.grad(y, inputs, dy.double())
    return y.detach(), grads[0], grads[1] if s64 is not None else None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 34), (2, 3, 10), (1, 2)], ids=str)
@pytest.mark.parametrize("betas", [(4.0, 25.0), (0.5, 2.0)], ids=str)
def test_situglu_matches_fp64(dtype, shape, betas):
    beta1, beta2 = betas
    gen = torch.Generator().manual_seed(1)
    x = representable(shape, dtype, scale=8.0, generator=gen).to(dtype).requires_grad_()
    dy = representable((*shape[:-1], shape[-1] // 2), dtype, generator=gen).to(dtype)
    op = te.ops.SiTUGLU(beta1=beta1, beta2=beta2)
    y = op(x)
    y.backward(dy)
    y_ref, dx_ref, _ = reference(x, dy, beta1, beta2)
    assert y.dtype == dtype and x.grad.dtype == dtype
    assert_close(y, y_ref, dtype)
    assert_close(x.grad, dx_ref, dtype)


def test_situglu_defaults_and_interleave():
    """beta1=4, beta2=25 by default; glu_interleave_size reads blocks [a, b, a, b, ...]."""
    op = te.ops.SiTUGLU()
    assert (op.beta1, op.beta2) == (4.0, 25.0)
    gen = torch.Generator().manual_seed(2)
    x = representable((5, 16), torch.float32, scale=4.0, generator=gen).requires_grad_()
    dy = representable((5, 8), torch.float32, generator=gen)
    # blocks of 2: [a0 a1 b0 b1 a2 a3 b2 b3 ...] -> halves [a, b]
    x_halves = x.detach().view(5, 4, 2, 2).transpose(1, 2).reshape(5, 16)
    y = te.ops.SiTUGLU(glu_interleave_size=2)(x)
    y.backward(dy)
    y_ref, dx_ref, _ = reference(x_halves, dy, 4.0, 25.0)
    dx_ref = dx_ref.view(5, 2, 4, 2).transpose(1, 2).reshape(5, 16)
    assert_close(y, y_ref, torch.float32)
    assert_close(x.grad, dx_ref, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_situglu_matches_fp64(dtype):
    gen = torch.Generator().manual_seed(3)
    x = representable((2, 5, 12), dtype, scale=8.0, generator=gen).to(dtype).requires_grad_()
    s = representable((2, 5), dtype, generator=gen).to(dtype).requires_grad_()
    dy = representable((2, 5, 6), dtype, generator=gen).to(dtype)
    op = te.ops.ScaledSiTUGLU(beta1=2.0, beta2=8.0)
    y = op(x, s)
    y.backward(dy)
    y_ref, dx_ref, ds_ref = reference(x, dy, 2.0, 8.0, s)
    assert_close(y, y_ref, dtype)
    assert_close(x.grad, dx_ref, dtype)
    assert_close(s.grad, ds_ref, dtype)


@pytest.mark.parametrize("cls", ["SiTUGLU", "ScaledSiTUGLU"])
@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_betas_must_be_finite_and_positive(cls, bad):
    with pytest.raises(ValueError, match="beta1 must be finite and positive"):
        getattr(te.ops, cls)(beta1=bad)
    with pytest.raises(ValueError, match="beta2 must be finite and positive"):
        getattr(te.ops, cls)(beta2=bad)


def test_scaled_situglu_refuses_activation_recompute():
    with pytest.raises(ValueError, match="activation recomputation"):
        te.ops.ScaledSiTUGLU(activation_recompute_in_mlp=True)


def test_situglu_between_linears_under_fp8_runs_unfused():
    """Under FP8 SiTUGLU is not folded into the next GEMM's FP8 cast: the second linear
    quantizes SiTUGLU's high-precision output itself, so the block gives the bits of the three
    ops called one by one (and the activation is the fp64 formula's within fp32 tolerance)."""
    torch.manual_seed(0)
    fc1, fc2 = te.ops.BasicLinear(32, 64), te.ops.BasicLinear(32, 16)
    act = te.ops.SiTUGLU(beta1=3.0)
    block = te.ops.Sequential(fc1, act, fc2)
    x = torch.randn(16, 32)
    for recipe in (te.recipe.DelayedScaling(), te.recipe.Float8CurrentScaling()):
        with te.autocast(recipe=recipe):
            y = block(x)
            h = fc1(x)
            a = act(h)
            y_ref = fc2(a)
        assert torch.equal(y, y_ref)
        assert_close(a, situglu_fp64(h, 3.0, 25.0), torch.float32)
