"""A user's te.ops.FusedOperation as a module of its own, as in Transformer Engine 2.x: it holds
its basic ops (their parameters seen once, under `basic_ops.<i>.`), goes into a
te.ops.Sequential or is called alone, and then runs as its basic ops planned afresh (the
fusions registered for them apply; its own fuser_forward runs where a fusion makes it).
"""

from __future__ import annotations

import pytest
import torch
from test_ops_te_api import restore_registered_fusions  # noqa: F401  (autouse: applies here)
from tolerances import assert_close, representable

import torchte as te
from torchte.ops.fused.linear_add import ForwardLinearAdd

pytestmark = pytest.mark.usefixtures("cpu_default_device")

IN, OUT, TOKENS = 12, 20, 7
F32 = torch.float32


class LinearBias(te.ops.FusedOperation):
    """BasicLinear -> Bias in one step (torchte's fuser signatures); counts its calls."""

    def __init__(self, linear: te.ops.BasicLinear, bias: te.ops.Bias) -> None:
        super().__init__([linear, bias])
        self.linear, self.bias_op = linear, bias  # aliases of the basic ops, not submodules
        self.calls = []

    def fuser_forward(self, ctxs, x, extra_inputs, settings):
        self.calls.append("forward")
        y, _ = self.linear.op_forward(ctxs[0], x, (), settings)
        return y + self.bias_op.bias.to(y.dtype), [(), ()]

    def fuser_backward(self, ctxs, dy, extra_output_grads):
        self.calls.append("backward")
        dx, _, wgrads = self.linear.op_backward(ctxs[0], dy, ())
        return dx, [(), ()], [wgrads, (dy.reshape(-1, dy.shape[-1]).sum(0),)]


def _ops(seed: int = 0):
    """(BasicLinear, Bias) with representable weights, the same for a seed."""
    gen = torch.Generator().manual_seed(seed)
    linear, bias = te.ops.BasicLinear(IN, OUT, dtype=F32), te.ops.Bias(OUT, dtype=F32)
    with torch.no_grad():
        linear.weight.copy_(representable((OUT, IN), F32, scale=0.25, generator=gen))
        bias.bias.copy_(representable(OUT, F32, generator=gen))
    return linear, bias


def _data(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = representable((TOKENS, IN), F32, generator=gen)
    dy = representable((TOKENS, OUT), F32, scale=0.5, generator=gen)
    return x, dy


def _fwd_bwd(module, x, dy, *extra):
    x = x.detach().requires_grad_()
    y = module(x, *extra)
    y.backward(dy)
    return y.detach(), x.grad


@pytest.mark.parametrize("where", ["sequential", "alone", "sequential-with-others"])
def test_user_fused_op_matches_its_basic_ops_unfused(where):
    x, dy = _data()
    fused = LinearBias(*_ops())
    plain_linear, plain_bias = _ops()
    if where == "sequential":
        module, plain = te.ops.Sequential(fused), te.ops.Sequential(plain_linear, plain_bias)
    elif where == "alone":
        module, plain = fused, te.ops.Sequential(plain_linear, plain_bias)
    else:
        module = te.ops.Sequential(te.ops.Identity(), fused, te.ops.GELU())
        plain = te.ops.Sequential(te.ops.Identity(), plain_linear, plain_bias, te.ops.GELU())
    y, dx = _fwd_bwd(module, x, dy)
    y_ref, dx_ref = _fwd_bwd(plain, x, dy)
    assert_close(y, y_ref, F32)
    assert_close(dx, dx_ref, F32)
    assert_close(fused.linear.weight.grad, plain_linear.weight.grad, F32)
    assert_close(fused.bias_op.bias.grad, plain_bias.bias.grad, F32)
    if where != "sequential-with-others":  # against fp64 as well
        w64, b64 = fused.linear.weight.double(), fused.bias_op.bias.double()
        assert_close(y, x.double() @ w64.t() + b64, F32)
        assert_close(dx, dy.double() @ w64, F32)
        assert_close(fused.linear.weight.grad, dy.double().t() @ x.double(), F32)
    # Transformer Engine plans the run from the basic ops: no fusion registered makes this op.
    assert fused.calls == []


def test_registered_fusion_runs_the_user_fused_op_forward_and_backward():
    def fuse(ops, *, recipe):
        out, i = [], 0
        while i < len(ops):
            pair = ops[i : i + 2]
            if (
                len(pair) == 2
                and type(pair[0]) is te.ops.BasicLinear
                and isinstance(pair[1], te.ops.Bias)
            ):
                out.append(made.setdefault(id(pair[0]), LinearBias(*pair)))
                i += 2
            else:
                out.append(ops[i])
                i += 1
        return out

    made = {}
    te.ops.register_forward_backward_fusion(fuse)
    x, dy = _data()
    fused = LinearBias(*_ops())
    y, dx = _fwd_bwd(fused, x, dy)
    (planned,) = made.values()
    assert planned is not fused and planned.basic_ops == fused.basic_ops
    assert planned.calls == ["forward", "backward"]
    plain = te.ops.Sequential(*_ops())
    te.ops.OperationFuser.forward_backward_fusion_functions.clear()
    y_ref, dx_ref = _fwd_bwd(plain, x, dy)
    assert_close(y, y_ref, F32)
    assert_close(dx, dx_ref, F32)


def test_parameters_seen_once_under_transformer_engines_names():
    fused = LinearBias(*_ops())
    assert isinstance(fused, torch.nn.Module)
    names = [name for name, _ in fused.named_parameters()]
    assert names == ["basic_ops.0.weight", "basic_ops.1.bias"]
    assert len(list(fused.parameters())) == 2
    block = te.ops.Sequential(fused, te.ops.GELU())
    keys = [k for k in block.state_dict() if not k.endswith("_extra_state")]
    assert keys == ["0.basic_ops.0.weight", "0.basic_ops.1.bias"]
    # A state dict with those keys loads into a fresh block.
    other = te.ops.Sequential(LinearBias(*_ops(seed=5)), te.ops.GELU())
    other.load_state_dict(block.state_dict())
    assert torch.equal(other[0].basic_ops[0].weight, fused.linear.weight)
    # Modules follow the basic ops (train / eval, to).
    block.eval()
    assert not fused.linear.training and not fused.bias_op.training


def test_torchtes_own_fused_ops_register_no_second_copy():
    linear, add = te.ops.BasicLinear(IN, OUT), te.ops.AddExtraInput()
    fused = ForwardLinearAdd(linear, add)
    assert [n for n, _ in fused.named_parameters()] == ["basic_ops.0.weight"]
    assert set(fused._modules) == {"basic_ops"}
    assert fused.__dict__["linear"] is linear  # read without nn.Module.__getattr__


def test_fused_op_with_an_extra_input_called_alone():
    linear, _ = _ops()
    plain_linear, _ = _ops()
    fused = ForwardLinearAdd(linear, te.ops.AddExtraInput())
    x, dy = _data()
    residual = representable((TOKENS, OUT), F32)
    y, dx = _fwd_bwd(fused, x, dy, residual)
    y_ref, dx_ref = _fwd_bwd(
        te.ops.Sequential(plain_linear, te.ops.AddExtraInput()), x, dy, residual
    )
    assert_close(y, y_ref, F32)
    assert_close(dx, dx_ref, F32)
    assert_close(linear.weight.grad, plain_linear.weight.grad, F32)
    with pytest.raises(ValueError, match="extra input"):
        fused(x)


def test_basic_op_kwargs_reach_the_basic_ops():
    seen = []

    class Probe(te.ops.Identity):
        def op_forward(self, ctx, x, extra_inputs, settings):
            seen.append(dict(ctx.kwargs))
            return super().op_forward(ctx, x, extra_inputs, settings)

    linear, _ = _ops()
    fused = ForwardLinearAdd(linear, te.ops.AddExtraInput())
    probe_fused = type("ProbeThenLinear", (te.ops.FusedOperation,), {})([Probe(), linear])
    x, _ = _data()
    probe_fused(x, basic_op_kwargs=[{"tag": 1}, {}])
    assert seen == [{"tag": 1}]
    assert fused.basic_ops[0] is linear


def test_empty_fused_op_is_refused():
    with pytest.raises(ValueError, match="basic op"):
        te.ops.FusedOperation([])
