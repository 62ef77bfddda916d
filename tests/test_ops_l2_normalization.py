"""te.ops.L2Normalization (ops/basic/l2_normalization.py) against an fp64 computation from
exactly representable inputs, and as te.MultiheadAttention's qk_norm_type="L2Normalization"."""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_close, representable

import torchte as te

pytestmark = pytest.mark.usefixtures("cpu_default_device")


def l2_fp64(x: torch.Tensor, dy: torch.Tensor, eps: float):
    """(y, dx) in float64: y = x / sqrt(sum x^2 + eps), dx its vector-Jacobian product."""
    x64 = x.double().requires_grad_()
    y = x64 / torch.sqrt(x64.square().sum(-1, keepdim=True) + eps)
    (dx,) = torch.autograd.grad(y, x64, dy.double())
    return y.detach(), dx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 33), (2, 3, 129), (1, 1)], ids=str)
@pytest.mark.parametrize("eps", [1e-6, 0.5])
def test_forward_and_backward_match_fp64(dtype, shape, eps):
    gen = torch.Generator().manual_seed(0)
    x = representable(shape, dtype, generator=gen).to(dtype).requires_grad_()
    dy = representable(shape, dtype, generator=gen).to(dtype)
    y = te.ops.L2Normalization(eps=eps)(x)
    y.backward(dy)
    y_ref, dx_ref = l2_fp64(x.detach(), dy, eps)
    assert y.dtype == dtype and x.grad.dtype == dtype
    assert_close(y, y_ref, dtype)
    assert_close(x.grad, dx_ref, dtype)


def test_inside_a_sequential_and_without_grad():
    x = torch.randn(5, 16)
    seq = te.ops.Sequential(te.ops.ConstantScale(2.0), te.ops.L2Normalization())
    with torch.no_grad():
        y = seq(x)
    assert_close(y, l2_fp64(2.0 * x, torch.zeros_like(x), 1e-6)[0], torch.float32)


def test_bad_eps_is_refused():
    with pytest.raises(ValueError, match="eps must be >= 0"):
        te.ops.L2Normalization(eps=-1.0)


def test_multihead_attention_normalizes_queries_and_keys():
    """qk_norm_type="L2Normalization": q and k (per head, over the head dim) reach attention
    with unit norm, computed from the projections' outputs; gradients flow through."""
    torch.manual_seed(0)
    mha = te.MultiheadAttention(64, 4, qk_norm_type="L2Normalization", qk_norm_eps=1e-6)
    seen = []
    for norm in (mha.q_norm, mha.k_norm):
        norm.register_forward_hook(lambda m, args, out: seen.append((args[0], out)))
    x = torch.randn(8, 2, 64, requires_grad=True)
    mha(x).sum().backward()
    assert len(seen) == 2 and x.grad is not None and torch.isfinite(x.grad).all()
    for inp, out in seen:
        assert out.shape[-1] == 16
        assert_close(out, l2_fp64(inp.detach(), torch.zeros_like(inp), 1e-6)[0], torch.float32)
        norms = out.detach().double().norm(dim=-1)
        assert_close(norms, torch.ones_like(norms), torch.float32)
