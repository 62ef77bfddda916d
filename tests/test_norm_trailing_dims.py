"""te.LayerNorm and te.RMSNorm over several trailing dimensions (normalized_shape a tuple, as
Transformer Engine's modules and torch.nn.LayerNorm take it): parameters of that shape, forward
and backward against an fp64 computation from exactly representable inputs and against
te.ops' norms, the input's trailing dimensions checked, state_dict, sequence_parallel.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tolerances import assert_close, representable
from torch import nn

import torchte as te
from torchte.module.norm import LayerNorm, RMSNorm

pytestmark = pytest.mark.usefixtures("cpu_default_device")

CLASSES = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}


def norm_fp64(kind, x, weight, bias, shape, eps, zero_centered):
    """y in float64 over the trailing `shape` dims: torch's layer_norm for LayerNorm, the
    root-mean-square formula for RMSNorm (weight, bias of that shape or None)."""
    g = weight.double() + (1.0 if zero_centered else 0.0)
    if kind == "LayerNorm":
        return nn.functional.layer_norm(x.double(), shape, g, bias.double(), eps)
    dims = tuple(range(-len(shape), 0))
    x = x.double()
    return x / torch.sqrt(x.square().mean(dims, keepdim=True) + eps) * g


def make_norm(kind, shape, dtype, zero_centered=False, seed=0, **kwargs):
    """A te module over `shape` with representable random parameters."""
    layer = CLASSES[kind](shape, params_dtype=dtype, zero_centered_gamma=zero_centered, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.weight.copy_(representable(shape, dtype, scale=0.5, generator=gen))
        if layer.bias is not None:
            layer.bias.copy_(representable(shape, dtype, generator=gen))
    return layer


def forward_backward(module, x, dy):
    """(y, dx, dweight, dbias) of one forward and backward of a fresh copy of x."""
    x = x.detach().requires_grad_()
    y = module(x)
    y.backward(dy)
    bias = getattr(module, "bias", None)
    return y, x.grad, module.weight.grad, None if bias is None else bias.grad


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("shape", [(4, 8), (3, 5, 7), (1, 13)], ids=str)
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_several_trailing_dims_match_fp64(kind, shape, zero_centered, dtype):
    layer = make_norm(kind, shape, dtype, zero_centered, seed=len(shape))
    assert layer.normalized_shape == shape and layer.weight.shape == shape
    gen = torch.Generator().manual_seed(7)
    x = (representable((2, 3, *shape), dtype, scale=2.0, generator=gen) + 0.5).to(dtype)
    dy = representable((2, 3, *shape), dtype, generator=gen).to(dtype)
    y, dx, dw, db = forward_backward(layer, x, dy)

    params = [layer.weight] + ([layer.bias] if kind == "LayerNorm" else [])
    leaves = [x.double().requires_grad_()] + [p.detach().double().requires_grad_() for p in params]
    bias64 = leaves[2] if kind == "LayerNorm" else None
    y64 = norm_fp64(kind, leaves[0], leaves[1], bias64, shape, layer.eps, zero_centered)
    y64.backward(dy.double())

    assert y.shape == x.shape and y.dtype == dtype and dx.dtype == dtype
    assert_close(y, y64, dtype, "y")
    assert_close(dx, leaves[0].grad, dtype, "dx")
    assert dw.shape == shape and dw.dtype == dtype
    assert_close(dw, leaves[1].grad, dtype, "dweight")
    if kind == "LayerNorm":
        assert db.shape == shape
        assert_close(db, leaves[2].grad, dtype, "dbias")


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_same_results_as_te_ops(kind, zero_centered):
    """The module and te.ops' norm run the same kernels on the same rows: equal results."""
    shape = (3, 5, 7)
    layer = make_norm(kind, shape, torch.float32, zero_centered, seed=3)
    op = getattr(te.ops, kind)(shape, eps=layer.eps, zero_centered_gamma=zero_centered)
    op.load_state_dict(layer.state_dict())
    x, dy = torch.randn(4, *shape) * 2 + 1, torch.randn(4, *shape)
    for got, want in zip(forward_backward(layer, x, dy), forward_backward(op, x, dy), strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            assert torch.equal(got, want)


def test_layernorm_matches_nn_layernorm_and_loads_its_state_dict():
    shape = (6, 10)
    ref = nn.LayerNorm(shape)
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    layer = LayerNorm(shape)
    layer.load_state_dict(ref.state_dict())  # strict: same names and shapes
    assert {k: v.shape for k, v in layer.state_dict().items()} == {
        "weight": torch.Size(shape),
        "bias": torch.Size(shape),
    }
    x, dy = torch.randn(2, 3, *shape) * 3 + 1, torch.randn(2, 3, *shape)
    for got, want in zip(forward_backward(layer, x, dy), forward_backward(ref, x, dy), strict=True):
        assert_close(got, want, torch.float32)


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_no_grad_matches_grad_path_and_zero_tokens(kind):
    layer = make_norm(kind, (4, 6), torch.float32, seed=1)
    x = torch.randn(5, 4, 6)
    y = layer(x.requires_grad_())
    with torch.no_grad():
        y_ng = layer(x)
    assert torch.equal(y.detach(), y_ng) and not y_ng.requires_grad
    empty = torch.randn(0, 4, 6, requires_grad=True)
    y0 = layer(empty)
    y0.sum().backward()
    assert y0.shape == (0, 4, 6) and empty.grad.shape == (0, 4, 6)
    assert layer.weight.grad.shape == (4, 6)


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_non_contiguous_input(kind):
    layer = make_norm(kind, (4, 6), torch.float32, seed=2)
    x = torch.randn(4, 6, 5).permute(2, 0, 1)  # (5, 4, 6), not contiguous
    assert not x.is_contiguous()
    assert torch.equal(layer(x), layer(x.contiguous()))


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_normalized_shape_forms(kind):
    """An int, a 1-sequence and a torch.Size of one dimension all mean the last dimension;
    a torch.Size or list of several dimensions means those trailing dimensions."""
    cls = CLASSES[kind]
    for arg in (7, (7,), [7], torch.Size([7])):
        layer = cls(arg)
        assert layer.normalized_shape == (7,) and layer.weight.shape == (7,)
        assert layer.hidden_size == 7
    for arg in ((2, 3), [2, 3], torch.Size([2, 3])):
        layer = cls(normalized_shape=arg)
        assert layer.normalized_shape == (2, 3) and layer.weight.shape == (2, 3)
        assert "(2, 3)" in repr(layer)
    assert cls(hidden_size=(2, 3)).weight.shape == (2, 3)


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_init_sequence_parallel_and_reset(kind):
    cls = CLASSES[kind]
    layer = cls((3, 4), sequence_parallel=True, zero_centered_gamma=True)
    assert torch.equal(layer.weight, torch.zeros(3, 4))
    assert all(p.sequence_parallel for p in layer.parameters())
    plain = cls((3, 4), params_dtype=torch.bfloat16)
    assert torch.equal(plain.weight, torch.ones(3, 4, dtype=torch.bfloat16))
    assert not any(p.sequence_parallel for p in plain.parameters())
    with torch.no_grad():
        plain.weight.fill_(3.0)
    plain.reset_parameters()
    assert torch.equal(plain.weight, torch.ones(3, 4, dtype=torch.bfloat16))
    if kind == "LayerNorm":
        assert plain.bias.shape == (3, 4) and torch.equal(plain.bias, torch.zeros(3, 4).bfloat16())


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_setattr_guard_not_triggered(kind):
    layer = CLASSES[kind]((3, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x = torch.randn(2, 3, 4, requires_grad=True)
        layer(x).sum().backward()
        with torch.no_grad():
            layer(x)


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_input_trailing_dims_checked(kind):
    layer = CLASSES[kind]((4, 8))
    with pytest.raises(
        ValueError, match=r"trailing dimensions must be \(4, 8\), got shape \(3, 8, 4\)"
    ):
        layer(torch.randn(3, 8, 4))
    with pytest.raises(ValueError, match=r"got shape \(8,\)"):
        layer(torch.randn(8))
    with pytest.raises(TypeError, match=r"input dtype torch.float64 is not supported"):
        layer(torch.randn(2, 4, 8, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"must be a torch\.Tensor"):
        layer([1.0] * 32)


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_bad_normalized_shapes(kind):
    cls = CLASSES[kind]
    with pytest.raises(ValueError, match="positive ints"):
        cls((4, 0))
    with pytest.raises(ValueError, match="positive ints"):
        cls((4, 2.0))
    with pytest.raises(ValueError, match="at least one dimension"):
        cls(())
