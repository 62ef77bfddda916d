"""te.ops written against Transformer Engine's op API: user BasicOperations with its op_forward /
op_backward signatures, user FusedOperations with its fuser_forward / fuser_backward, fusions
registered with register_forward_fusion / register_backward_fusion /
register_forward_backward_fusion, get_quantizer, extra-tensor channels, and plain nn.Modules
inside a Sequential."""

from __future__ import annotations

import typing

import pytest
import torch
from tolerances import assert_close, representable

import torchte as te
from torchte.ops import fuser as fuser_mod

pytestmark = pytest.mark.usefixtures("cpu_default_device")


@pytest.fixture(autouse=True)
def restore_registered_fusions():
    """Each test's registered fusions are removed after it."""
    lists = [
        fuser_mod.OperationFuser.forward_fusion_functions,
        fuser_mod.OperationFuser.backward_fusion_functions,
        fuser_mod.OperationFuser.forward_backward_fusion_functions,
    ]
    saved = [list(functions) for functions in lists]
    yield
    for functions, old in zip(lists, saved, strict=True):
        functions[:] = old


class TEScale(te.ops.BasicOperation):
    """y = x * w (w a parameter of one element), written with Transformer Engine 2.7+'s
    signatures and its context (save_for_backward, saved_tensors, requires_grad)."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([value]))
        self.seen = []

    def op_forward(self, ctx, input_, prev_op_grad_output_quantizer, next_op_input_quantizer):
        self.seen.append(
            (prev_op_grad_output_quantizer, next_op_input_quantizer, ctx.requires_grad)
        )
        if ctx.requires_grad:
            ctx.save_for_backward(input_, self.w.detach())
        return input_ * self.w.detach()

    def op_backward(self, ctx, grad_output):
        x, w = ctx.saved_tensors
        return grad_output * w, ((grad_output * x).sum().reshape(1),)


class OldTEScale(TEScale):
    """The same op with Transformer Engine 2.0-2.5's forward signature (neighbouring ops)."""

    def op_forward(self, ctx, input_, *, prev_op=None, next_op=None, **kwargs):
        self.seen.append((prev_op, next_op))
        ctx.save_for_backward(input_, self.w.detach())
        return input_ * self.w.detach()


def _plain_grads(x, dy, *factors):
    """(y, dx, d factors) of y = x * prod(factors) by autograd in fp64."""
    x64 = x.detach().double().requires_grad_()
    ws = [torch.tensor([f], dtype=torch.float64, requires_grad=True) for f in factors]
    y = x64
    for w in ws:
        y = y * w
    grads = torch.autograd.grad(y, [x64, *ws], dy.double())
    return y.detach(), grads[0], grads[1:]


def test_user_op_with_te_signatures_runs_in_a_sequential():
    gen = torch.Generator().manual_seed(0)
    x = representable((6, 8), torch.float32, generator=gen).requires_grad_()
    dy = representable((6, 8), torch.float32, generator=gen)
    first, last = TEScale(2.0), OldTEScale(0.5)
    block = te.ops.Sequential(first, te.ops.ConstantScale(3.0), last)
    y = block(x)
    y.backward(dy)
    y_ref, dx_ref, (dw1, _, dw2) = _plain_grads(x, dy, 2.0, 3.0, 0.5)
    assert_close(y, y_ref, torch.float32)
    assert_close(x.grad, dx_ref, torch.float32)
    assert_close(first.w.grad, dw1, torch.float32)
    assert_close(last.w.grad, dw2, torch.float32)
    assert first.seen == [(None, None, True)]  # high precision: no quantizers
    assert last.seen[0][0] is block[1] and last.seen[0][1] is None


def test_user_op_context_knows_when_no_backward_runs():
    op = TEScale(2.0)
    with torch.no_grad():
        op(torch.ones(2, 4))
    assert op.seen[-1][2] is False


def test_user_op_gets_the_next_linear_input_quantizer_under_fp8():
    op, linear = TEScale(1.0), te.ops.BasicLinear(16, 16)
    block = te.ops.Sequential(op, linear)
    with te.autocast(recipe=te.recipe.Float8CurrentScaling()):
        block(torch.randn(16, 16))
        expected = linear.get_quantizer("forward", 0)
    assert op.seen[0][1] is expected and expected is not None


def test_get_quantizer_follows_transformer_engine_roles():
    linear = te.ops.BasicLinear(16, 32)
    assert (linear.num_quantizers("forward"), linear.num_quantizers("backward")) == (2, 1)
    assert linear.get_quantizer("forward", 0) is None  # outside te.autocast
    with te.autocast(recipe=te.recipe.Float8CurrentScaling()):
        inp, weight = linear.get_quantizer("forward", 0), linear.get_quantizer("forward", 1)
        grad = linear.get_quantizer("backward", 0)
        assert linear.get_input_quantizer() is inp
        assert linear.get_grad_output_quantizer() is grad
        with pytest.raises(IndexError, match="2 forward quantizer"):
            linear.get_quantizer("forward", 2)
    assert len({id(inp), id(weight), id(grad)}) == 3
    assert inp.dtype.name == "kFloat8E4M3" and grad.dtype.name == "kFloat8E5M2"  # HYBRID
    with pytest.raises(ValueError, match="mode must be"):
        linear.get_quantizer("sideways", 0)
    assert te.ops.ConstantScale(2.0).num_quantizers("forward") == 0


class DoubleThenScale(te.ops.FusedOperation):
    """ConstantScale(a) -> TEScale(w) in one step, with Transformer Engine's fuser signatures."""

    calls: typing.ClassVar[list[str]] = []

    def __init__(self, scale, user_op):
        super().__init__([scale, user_op])

    def fuser_forward(
        self,
        basic_op_ctxs,
        input_,
        *,
        basic_op_extra_inputs,
        prev_op_grad_output_quantizer,
        next_op_input_quantizer,
        basic_op_kwargs,
    ):
        DoubleThenScale.calls.append("forward")
        scale, user_op = self.basic_ops
        factor = scale.scale * user_op.w.detach()
        basic_op_ctxs[1].save_for_backward(input_ * scale.scale, user_op.w.detach())
        return input_ * factor, [(), ()]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        DoubleThenScale.calls.append("backward")
        scale = self.basic_ops[0]
        x_scaled, w = basic_op_ctxs[1].saved_tensors
        dw = (grad_output * x_scaled).sum().reshape(1)
        return grad_output * w * scale.scale, [(), (dw,)], [(), ()]


def _fuse_scale_then_user(ops, *, recipe):
    out, i = [], 0
    while i < len(ops):
        pair = ops[i : i + 2]
        if (
            len(pair) == 2
            and isinstance(pair[0], te.ops.ConstantScale)
            and isinstance(pair[1], TEScale)
        ):
            out.append(DoubleThenScale(*pair))
            i += 2
        else:
            out.append(ops[i])
            i += 1
    return out


@pytest.mark.parametrize(
    "register, fused_directions",
    [
        ("register_forward_fusion", ["forward"]),
        ("register_backward_fusion", ["backward"]),
        ("register_forward_backward_fusion", ["forward", "backward"]),
    ],
)
def test_registered_fusion_is_applied(register, fused_directions):
    DoubleThenScale.calls = []
    getattr(te.ops, register)(_fuse_scale_then_user)
    gen = torch.Generator().manual_seed(1)
    x = representable((4, 8), torch.float32, generator=gen).requires_grad_()
    dy = representable((4, 8), torch.float32, generator=gen)
    user_op = TEScale(0.5)
    block = te.ops.Sequential(te.ops.Identity(), te.ops.ConstantScale(4.0), user_op)
    y = block(x)
    y.backward(dy)
    assert DoubleThenScale.calls == fused_directions
    y_ref, dx_ref, (_, dw) = _plain_grads(x, dy, 4.0, 0.5)
    assert_close(y, y_ref, torch.float32)
    assert_close(x.grad, dx_ref, torch.float32)
    assert_close(user_op.w.grad, dw, torch.float32)


def test_fusion_that_loses_an_op_is_refused():
    te.ops.register_forward_fusion(lambda ops, *, recipe: ops[1:])
    with pytest.raises(RuntimeError, match="do not cover the run's basic ops"):
        te.ops.Sequential(te.ops.Identity(), te.ops.ConstantScale(2.0))(torch.ones(2, 2))


def test_channel_carries_an_extra_output_to_a_later_op():
    """MakeExtraOutput's copy goes to AddExtraInput through a channel: y = 3x + x, the call
    takes and returns no extra tensor, and the gradient flows through both paths."""
    make = te.ops.MakeExtraOutput().set_extra_output_channel(0, "skip", output_to_caller=False)
    add = te.ops.AddExtraInput().set_extra_input_channel(0, "skip")
    block = te.ops.Sequential(make, te.ops.ConstantScale(3.0), add)
    x = torch.randn(5, 4, requires_grad=True)
    y = block(x)
    assert isinstance(y, torch.Tensor)
    torch.testing.assert_close(y, 4.0 * x.detach())
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, torch.full_like(x, 4.0))
    with pytest.raises(RuntimeError, match="cannot change"):
        add.set_extra_input_channel(0, None)


def test_channel_output_also_returned_to_the_caller():
    make = te.ops.MakeExtraOutput().set_extra_output_channel(0, "skip")
    add = te.ops.AddExtraInput().set_extra_input_channel(0, "skip")
    y, copy = te.ops.Sequential(make, te.ops.ConstantScale(2.0), add)(torch.ones(2, 3))
    torch.testing.assert_close(y, torch.full((2, 3), 3.0))
    torch.testing.assert_close(copy, torch.ones(2, 3))


def test_channel_errors():
    with pytest.raises(IndexError):
        te.ops.AddExtraInput().set_extra_input_channel(1, "a")
    with pytest.raises(ValueError, match="non-empty str"):
        te.ops.AddExtraInput().set_extra_input_channel(0, "")
    add = te.ops.AddExtraInput().set_extra_input_channel(0, "nowhere")
    with pytest.raises(ValueError, match="no earlier op"):
        te.ops.Sequential(te.ops.Identity(), add)(torch.ones(2, 2))


def test_plain_module_runs_between_fused_runs():
    gen = torch.Generator().manual_seed(2)
    x = representable((3, 8), torch.float32, generator=gen).requires_grad_()
    block = te.ops.Sequential(te.ops.ConstantScale(2.0), torch.nn.Tanh(), te.ops.ConstantScale(0.5))
    y = block(x)
    y.sum().backward()
    x64 = x.detach().double().requires_grad_()
    y_ref = 0.5 * torch.tanh(2.0 * x64)
    y_ref.sum().backward()
    assert_close(y, y_ref, torch.float32)
    assert_close(x.grad, x64.grad, torch.float32)
