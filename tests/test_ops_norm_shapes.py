"""te.ops.LayerNorm / te.ops.RMSNorm over several trailing dimensions (normalized_shape a
tuple, as Transformer Engine's ops take it): parameters of that shape, forward and backward
against an fp64 computation from exactly representable inputs."""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_close, representable

import torchte as te

pytestmark = pytest.mark.usefixtures("cpu_default_device")


def norm_fp64(kind, x, weight, bias, shape, eps, zero_centered):
    """y in float64 over the trailing `shape` dims (weight, bias of that shape or None)."""
    dims = tuple(range(-len(shape), 0))
    x = x.double()
    g = weight.double() + (1.0 if zero_centered else 0.0)
    if kind == "LayerNorm":
        mean = x.mean(dims, keepdim=True)
        var = (x - mean).square().mean(dims, keepdim=True)
        return (x - mean) / torch.sqrt(var + eps) * g + bias.double()
    return x / torch.sqrt(x.square().mean(dims, keepdim=True) + eps) * g


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("shape", [(4, 8), (3, 5, 7)], ids=str)
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_several_trailing_dims_match_fp64(kind, shape, zero_centered, dtype):
    gen = torch.Generator().manual_seed(1)
    op = getattr(te.ops, kind)(shape, eps=1e-5, zero_centered_gamma=zero_centered, dtype=dtype)
    assert op.weight.shape == shape
    with torch.no_grad():
        op.weight.copy_(representable(shape, dtype, scale=0.5, generator=gen))
        if kind == "LayerNorm":
            assert op.bias.shape == shape
            op.bias.copy_(representable(shape, dtype, generator=gen))
    x = representable((2, 3, *shape), dtype, generator=gen).to(dtype).requires_grad_()
    dy = representable((2, 3, *shape), dtype, generator=gen).to(dtype)
    y = op(x)
    y.backward(dy)
    params = [op.weight] + ([op.bias] if kind == "LayerNorm" else [])
    leaves = [x.detach().double().requires_grad_()]
    leaves += [p.detach().double().requires_grad_() for p in params]
    bias64 = leaves[2] if kind == "LayerNorm" else None
    y64 = norm_fp64(kind, leaves[0], leaves[1], bias64, shape, 1e-5, zero_centered)
    y64.backward(dy.double())
    assert y.shape == x.shape and y.dtype == dtype
    assert_close(y, y64, dtype)
    assert_close(x.grad, leaves[0].grad, dtype)
    for p, p64 in zip(params, leaves[1:], strict=True):
        assert p.grad.shape == shape
        assert_close(p.grad, p64.grad, dtype)


def test_in_a_sequential_and_in_the_state_dict():
    norm = te.ops.RMSNorm((4, 8))
    seq = te.ops.Sequential(norm, te.ops.Linear(8, 6))
    x = torch.randn(5, 4, 8)
    assert seq(x).shape == (5, 4, 6)
    assert seq.state_dict()["0.weight"].shape == (4, 8)
    assert "(4, 8)" in repr(norm)


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_input_not_ending_in_normalized_shape_is_refused(kind):
    op = getattr(te.ops, kind)((4, 8))
    with pytest.raises(ValueError, match=r"trailing dimensions must be \(4, 8\)"):
        op(torch.randn(3, 8, 4))
    with pytest.raises(ValueError, match="positive ints"):
        getattr(te.ops, kind)((4, 0))
