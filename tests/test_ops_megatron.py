"""te.ops as Megatron-Core 0.19 calls it for dense layers (megatron/core/extensions/
transformer_engine.py: TEActivationOp, TEFusedResidualRMSNorm, TEFusedMLP): each builder below
makes Megatron's calls with Megatron's argument lists (ops on the meta device, then Megatron's
own parameters assigned), and the results are held to an fp64 reference of the same layer. The
meta-device sequence and the arguments of the linear ops; tensor parallelism on two gloo ranks
(tests/ranks.py), checked against te.Linear's own tensor-parallel GEMMs bit for bit and against
fp64. The mixture-of-experts layers and the activations they use: test_ops_megatron_moe.py.

Legend: H hidden, F the MLP's width (FC1 makes 2F for a gated activation); S, B, K, N the
sequence, batch, input and output sizes of the tensor-parallel GEMMs.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import each_config, on_ranks
from tolerances import assert_close, representable

import torchte as te
from torchte import recipe

pytestmark = pytest.mark.usefixtures("cpu_default_device")
H, F_ = 32, 64


def _param(shape, dtype=torch.float32, scale=0.5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter(
        representable(shape, torch.bfloat16, scale=scale, generator=gen).to(dtype)
    )


def _act64(name, h, limit=7.0):
    """The fp64 reference of an activation of h ([a, b] halves for the gated ones)."""
    if name == "srelu":
        return F.relu(h).square()
    a, b = h.chunk(2, dim=-1)
    if name == "swiglu":
        return F.silu(a) * b
    a_c, b_c = a.clamp(max=limit), b.clamp(-limit, limit)  # clamped quick-GEGLU
    return a_c * torch.sigmoid(1.702 * a_c) * (b_c + 1)


# ---------------------------------------------------------------------------------------------
# TEActivationOp, TEFusedResidualRMSNorm, TEFusedMLP (one rank)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layer_type", ["SwiGLU", "GEGLU", "ReGLU", "GELU", "ReLU", "SiLU"])
def test_activation_op_calls(layer_type):
    """TEActivationOp / TEFusedMLP._make_activation_op: op_type(**kwargs) with and without
    cache_quantized_input; the cached FP8 input gives the same output and a close gradient."""
    x = representable((5, 64), torch.bfloat16, scale=4.0).requires_grad_()
    results = []
    for kwargs in ({}, {"cache_quantized_input": False}, {"cache_quantized_input": True}):
        op = getattr(te.ops, layer_type)(**kwargs)
        y = op(x)
        (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
        results.append((y, dx))
    assert torch.equal(results[0][0], results[2][0]) and torch.equal(results[0][1], results[1][1])
    assert_close(results[2][1], results[0][1], torch.float8_e4m3fn)


def test_fused_residual_rmsnorm_sequence():
    """TEFusedResidualRMSNorm._make_fused_impl: MakeExtraOutput, then an RMSNorm op built on
    the meta device that takes the te.RMSNorm's weight: (norm(x), x), bit for bit."""
    norm = te.RMSNorm(H, eps=1e-5, zero_centered_gamma=True)
    with torch.no_grad():
        norm.weight.copy_(representable(H, torch.bfloat16))
    fused_impl = te.ops.Sequential()
    fused_impl.append(te.ops.MakeExtraOutput())
    kwargs = {
        "eps": norm.eps,
        "device": "meta",
        "dtype": norm.weight.dtype,
        "zero_centered_gamma": norm.zero_centered_gamma,
    }
    if hasattr(norm, "_sm_margins"):
        kwargs["sm_margin"] = norm._sm_margins
    rmsnorm_op = te.ops.RMSNorm(norm.weight.shape, **kwargs)
    rmsnorm_op.weight = norm.weight
    fused_impl.append(rmsnorm_op)
    x = representable((3, 4, H), torch.bfloat16).requires_grad_()
    out, residual = fused_impl(x)
    assert rmsnorm_op.device == torch.device("cpu") and torch.equal(residual, x)
    assert torch.equal(out, norm(x))
    out.sum().backward()
    assert norm.weight.grad is not None and norm.weight.grad.shape == (H,)


def _fused_mlp(fc1, fc2, tp_world_size=1, tp_group=None, act="swiglu"):
    """TEFusedMLP._make_fused_impl's calls, Megatron's argument lists, on SimpleNamespace
    stand-ins for its te.LayerNormLinear (fc1) and te.Linear (fc2)."""
    fused_impl = te.ops.Sequential()
    rng_state_tracker_function = None
    kwargs = {
        "eps": fc1.eps,
        "device": "meta",
        "dtype": fc1.layer_norm_weight.dtype,
        "zero_centered_gamma": fc1.zero_centered_gamma,
    }
    op = te.ops.RMSNorm(fc1.weight.size(1), **kwargs)
    op.weight = fc1.layer_norm_weight
    fused_impl.append(op)
    weight = fc1.weight
    userbuffers_options = None
    op = te.ops.BasicLinear(
        weight.size(1),
        weight.size(0) * tp_world_size,
        device="meta",
        dtype=weight.dtype,
        tensor_parallel_mode="column" if tp_world_size > 1 else None,
        tensor_parallel_group=tp_group,
        sequence_parallel=fc1.sequence_parallel,
        rng_state_tracker_function=rng_state_tracker_function,
        accumulate_into_main_grad=fc1.fuse_wgrad_accumulation,
        userbuffers_options=userbuffers_options,
    )
    op.weight = weight
    fused_impl.append(op)
    op = te.ops.Bias(fc1.bias.numel(), device="meta", dtype=fc1.bias.dtype)
    op.bias = fc1.bias
    fused_impl.append(op)
    fused_impl.append(
        {"swiglu": te.ops.SwiGLU, "gelu": te.ops.GELU}[act](cache_quantized_input=False)
    )
    weight = fc2.weight
    op = te.ops.BasicLinear(
        weight.size(1),
        weight.size(0),
        device="meta",
        dtype=weight.dtype,
        rng_state_tracker_function=rng_state_tracker_function,
        accumulate_into_main_grad=fc2.fuse_wgrad_accumulation,
        userbuffers_options=userbuffers_options,
    )
    op.weight = weight
    fused_impl.append(op)
    if tp_world_size > 1:
        if fc2.sequence_parallel:
            fused_impl.append(te.ops.ReduceScatter(tp_group))
        else:
            fused_impl.append(te.ops.AllReduce(tp_group))
    op = te.ops.Bias(fc2.bias.numel(), device="meta", dtype=fc2.bias.dtype)
    op.bias = fc2.bias
    fused_impl.append(op)
    return fused_impl


def _mlp_layers(w1, b1, w2, b2, g, sequence_parallel=False, main_grad=False):
    """Stand-ins for Megatron's LayerNormLinear / Linear: the attributes _fused_mlp reads."""
    fc1 = SimpleNamespace(
        eps=1e-5, zero_centered_gamma=False, layer_norm_weight=g, weight=w1, bias=b1,
        sequence_parallel=sequence_parallel, fuse_wgrad_accumulation=main_grad,
    )  # fmt: skip
    fc2 = SimpleNamespace(
        weight=w2, bias=b2, sequence_parallel=sequence_parallel, fuse_wgrad_accumulation=main_grad
    )
    return fc1, fc2


def _mlp64(x, g, w1, b1, w2, b2, act="swiglu"):
    """fp64 RMSNorm -> FC1 + b1 -> act -> FC2 + b2 (w1's rows [a; b] for SwiGLU)."""
    x = x.double()
    z = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-5) * g.double()
    h = z @ w1.double().t() + b1.double()
    a = _act64("swiglu", h) if act == "swiglu" else F.gelu(h, approximate="tanh")
    return a @ w2.double().t() + b2.double()


@pytest.mark.parametrize("main_grad", [False, True])
def test_fused_mlp_sequence(main_grad):
    """TEFusedMLP on one rank: the ops take Megatron's parameters (main_grad accumulation where
    its layers fuse it) and compute the MLP, gradients included."""
    g, b1, b2 = _param(H, seed=1), _param(2 * F_, seed=2), _param(H, seed=3)
    w1, w2 = _param((2 * F_, H), seed=4), _param((H, F_), seed=5)
    fc1, fc2 = _mlp_layers(w1, b1, w2, b2, g, main_grad=main_grad)
    if main_grad:
        for w in (w1, w2):
            w.main_grad = torch.full(w.shape, 0.5)
            w.grad_added_to_main_grad = False
    fused_impl = _fused_mlp(fc1, fc2)
    x = _param((2, 6, H), seed=6).detach().requires_grad_()
    y = fused_impl(x)
    leaves = [t.detach().double().requires_grad_() for t in (x, g, w1, b1, w2, b2)]
    y64 = _mlp64(*leaves)
    assert_close(y, y64, torch.float32)
    dy = _param(y.shape, seed=7).detach()
    y.backward(dy)
    y64.backward(dy.double())
    assert_close(x.grad, leaves[0].grad, torch.float32)
    for param, leaf in zip((g, w1, b1, w2, b2), leaves[1:], strict=True):
        got = param.grad
        if main_grad and param.dim() == 2:
            got = param.main_grad - 0.5
            assert param.grad_added_to_main_grad
        assert_close(got, leaf.grad, torch.float32)


# ---------------------------------------------------------------------------------------------
# The meta-device sequence and the arguments of the linear ops
# ---------------------------------------------------------------------------------------------


def test_meta_ops_follow_the_parameters_they_are_given():
    """Built on the meta device, the ops take their device from the parameters a client gives
    them (setattr, register_parameter, load_state_dict(assign=True)), from to_empty +
    reset_parameters, or at the first call (reset_parameters on the default device); and a
    parameter moved in place by its owner is followed at the next call."""
    linear = te.ops.BasicLinear(16, 8, device="meta", dtype=torch.bfloat16)
    assert linear.weight.is_meta and linear.device.type == "meta"
    linear.weight = _param((8, 16), torch.bfloat16)
    assert linear.device == torch.device("cpu") and linear(torch.ones(2, 16)).shape == (2, 8)
    bias = te.ops.Bias(8, device="meta")
    state = bias.state_dict()
    state["bias"] = torch.ones(8)
    bias.load_state_dict(state, assign=True)
    assert bias.device.type == "cpu" and torch.equal(bias(torch.zeros(8)), torch.ones(8))
    norm = te.ops.LayerNorm(16, device="meta")
    norm.to_empty(device="cpu")
    norm.reset_parameters()
    assert norm.device.type == "cpu" and torch.equal(norm.weight, torch.ones(16))
    fresh = te.ops.Linear(16, 8, device="meta")
    y = fresh(torch.ones(3, 16))  # made and initialized on the default device at the call
    assert fresh.weight.device.type == "cpu" and fresh.weight.abs().sum() > 0 and y.shape == (3, 8)
    moved = te.ops.RMSNorm(16, device="meta")
    weight = torch.nn.Parameter(torch.full((16,), 2.0))
    moved.weight = weight
    weight.data = weight.data.to(torch.bfloat16)  # cast in place, as nn.Module.to casts it
    y = moved(torch.ones(2, 16, dtype=torch.bfloat16))
    assert moved.device.type == "cpu" and moved.params_dtype == torch.bfloat16
    assert y.dtype == torch.bfloat16 and torch.equal(y, torch.full((2, 16), 2.0).bfloat16())
    grouped = te.ops.GroupedLinear(2, 16, 8, device="meta", delay_wgrad_compute=True)
    given = _param((8, 16))
    grouped.weight1 = given
    assert given.skip_backward_post_hook
    with pytest.raises(RuntimeError, match="still on the meta device"):
        grouped(torch.ones(2, 16), [1, 1])
    with pytest.raises(ValueError, match=r"weight must have shape \(8, 16\)"):
        linear.weight = _param((16, 8))
    with pytest.raises(ValueError, match=r"bias0 must have shape \(8,\)"):
        grouped.bias0 = _param(9)


def test_setting_client_hints_does_not_warn_but_others_do():
    op = te.ops.GroupedLinear(1, 16, 16)
    op._glu_interleave_size = 32
    act = te.ops.ScaledSwiGLU()
    act._grouped_mlp_unit_activation_scale = True
    assert op._glu_interleave_size == 32 and act._grouped_mlp_unit_activation_scale
    with pytest.warns(RuntimeWarning, match="_fast_setattr"):
        op.something = 1


def test_linear_op_arguments_are_checked():
    """Transformer Engine's BasicLinear signature: userbuffers_options only as None, a bad
    tensor_parallel_mode, tensor parallelism without torch.distributed."""
    te.ops.BasicLinear(16, 16, userbuffers_options=None, rng_state_tracker_function=None)
    with pytest.raises(NotImplementedError, match="userbuffers_options"):
        te.ops.BasicLinear(16, 16, userbuffers_options={"comm_name": "fc1"})
    with pytest.raises(ValueError, match="tensor_parallel_mode must be None"):
        te.ops.BasicLinear(16, 16, tensor_parallel_mode="diagonal")
    with pytest.raises(RuntimeError, match=r"torch\.distributed initialized"):
        te.ops.BasicLinear(16, 16, tensor_parallel_mode="column")
    for make in (te.ops.AllGather, te.ops.AllReduce, te.ops.ReduceScatter):
        with pytest.raises(RuntimeError, match=r"torch\.distributed initialized"):
            make(None)
    forks = []

    class Tracker:
        def fork(self):
            forks.append(1)
            return torch.random.fork_rng()

    te.ops.BasicLinear(16, 16, rng_state_tracker_function=Tracker)
    te.ops.BasicLinear(16, 16, device="meta", rng_state_tracker_function=Tracker)
    assert len(forks) == 1  # nothing is drawn on the meta device


# ---------------------------------------------------------------------------------------------
# Tensor parallelism on two gloo ranks
# ---------------------------------------------------------------------------------------------

S, B, K, N = 8, 2, 32, 64
TP_CONFIGS = [
    (mode, sp, precision)
    for mode in ("column", "row")
    for sp in (False, True)
    for precision in ("fp32", "bf16", "current")
]


def _shard(t, dim, rank, world=2):
    return t.chunk(world, dim)[rank]


def _check_basic_linear(mode, sp, precision, rank):
    """BasicLinear(tensor_parallel_mode=mode) equals te.Linear(parallel_mode=mode) bit for bit
    (forward, dx, dW), and in fp32 the full layer in fp64."""
    group = dist.group.WORLD
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    x_full = representable((S, B, K), torch.bfloat16, generator=gen).to(dtype)
    w_full = representable((N, K), torch.bfloat16, scale=0.25, generator=gen).to(dtype)
    dy_full = representable((S, B, N), torch.bfloat16, generator=gen).to(dtype)
    w = _shard(w_full, 0 if mode == "column" else 1, rank)
    x = _shard(x_full, 2, rank) if mode == "row" else x_full
    if mode == "column" and sp:
        x = _shard(x, 0, rank)
    dy = _shard(dy_full, 2, rank) if mode == "column" else dy_full
    if mode == "row" and sp:
        dy = _shard(dy, 0, rank)
    op = te.ops.BasicLinear(
        K, N, device="meta", dtype=dtype, tensor_parallel_mode=mode, tensor_parallel_group=group,
        sequence_parallel=sp,
    )  # fmt: skip
    op.weight = torch.nn.Parameter(w.clone())
    module = te.Linear(K, N, bias=False, params_dtype=dtype, parallel_mode=mode, tp_group=group,
                       tp_size=2, sequence_parallel=sp, device="cpu")  # fmt: skip
    with torch.no_grad():
        module.weight.copy_(w)
    results = []
    for layer in (op, module):
        xi = x.clone().requires_grad_()
        with te.autocast(enabled=precision == "current", recipe=recipe.Float8CurrentScaling()):
            y = layer(xi)
        y.backward(dy)
        results.append((y, xi.grad, layer.weight.grad))
    for got, want in zip(*results, strict=True):
        assert got.shape == want.shape and torch.equal(got, want)
    if precision != "fp32":
        return
    x64, w64 = x_full.double().requires_grad_(), w_full.double().requires_grad_()
    y64 = x64 @ w64.t()
    y64.backward(dy_full.double())
    y_want = _shard(y64, 2, rank) if mode == "column" else y64
    dx_want = _shard(x64.grad, 2, rank) if mode == "row" else x64.grad
    if sp:
        y_want = y_want if mode == "column" else _shard(y_want, 0, rank)
        dx_want = _shard(dx_want, 0, rank) if mode == "column" else dx_want
    assert_close(results[0][0], y_want, torch.float32)
    assert_close(results[0][1], dx_want, torch.float32)
    assert_close(results[0][2], _shard(w64.grad, 0 if mode == "column" else 1, rank), torch.float32)


def _check_fused_mlp(sp, rank):
    """TEFusedMLP's sequence over two ranks (FC1 column-parallel with its bias, FC2 local,
    then ReduceScatter / AllReduce, then FC2's bias) against the one-rank fp64 MLP: output,
    dx, the norm weight's and FC2 bias's gradients (partial sums under sequence parallelism),
    FC1's main_grad and bias gradient, FC2's weight gradient, each this rank's part."""
    group = dist.group.WORLD
    g, b2 = _param(H, seed=1), _param(H, seed=3)
    b1_full, w1_full, w2_full = (
        _param(2 * F_, seed=2),
        _param((2 * F_, H), seed=4),
        _param((H, F_), seed=5),
    )
    rows = [
        slice(rank * F_ // 2, (rank + 1) * F_ // 2),
        slice(F_ + rank * F_ // 2, F_ + (rank + 1) * F_ // 2),
    ]
    w1 = torch.nn.Parameter(torch.cat([w1_full.detach()[r] for r in rows]))  # [a_r; b_r]
    b1 = torch.nn.Parameter(torch.cat([b1_full.detach()[r] for r in rows]))
    w2 = torch.nn.Parameter(_shard(w2_full.detach(), 1, rank).clone())
    w1.main_grad = torch.zeros(w1.shape)
    fc1, fc2 = _mlp_layers(w1, b1, w2, b2, g, sequence_parallel=sp)
    fc1.fuse_wgrad_accumulation = True
    fused_impl = _fused_mlp(fc1, fc2, tp_world_size=2, tp_group=group)
    x_full, dy_full = _param((S, B, H), seed=6).detach(), _param((S, B, H), seed=7).detach()
    x = (_shard(x_full, 0, rank) if sp else x_full).clone().requires_grad_()
    y = fused_impl(x)
    y.backward(_shard(dy_full, 0, rank) if sp else dy_full)
    leaves = [
        t.detach().double().requires_grad_() for t in (x_full, g, w1_full, b1_full, w2_full, b2)
    ]
    y64 = _mlp64(*leaves)
    y64.backward(dy_full.double())
    x64, g64, w1_64, b1_64, w2_64, b2_64 = leaves
    seq = (lambda t: _shard(t, 0, rank)) if sp else (lambda t: t)
    assert_close(y, seq(y64), torch.float32)
    assert_close(x.grad, seq(x64.grad), torch.float32)
    for partial, want in ((g.grad, g64.grad), (b2.grad, b2_64.grad)):
        whole = partial.clone()
        if sp:
            dist.all_reduce(whole)
        assert_close(whole, want, torch.float32)
    assert_close(w1.main_grad, torch.cat([w1_64.grad[r] for r in rows]), torch.float32)
    assert w1.grad is None or not w1.grad.any()
    assert_close(b1.grad, torch.cat([b1_64.grad[r] for r in rows]), torch.float32)
    assert_close(w2.grad, _shard(w2_64.grad, 1, rank), torch.float32)


def _check_collectives(rank):
    """AllGather, ReduceScatter, AllReduce: forward and backward against their definitions; the
    AllReduce input is left as it was; a first dim the ranks do not divide is refused."""
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(4, 3, generator=gen)
    xs = [torch.empty_like(x) for _ in range(2)]
    dist.all_gather(xs, x)
    dy = torch.randn(8, 3, generator=gen)
    dys = [torch.empty_like(dy) for _ in range(2)]
    dist.all_gather(dys, dy)
    xi = x.clone().requires_grad_()
    y = te.ops.AllGather(dist.group.WORLD)(xi)
    y.backward(dy)
    assert torch.equal(y, torch.cat(xs)) and torch.equal(
        xi.grad, (dys[0] + dys[1])[rank * 4 : rank * 4 + 4]
    )
    xi = torch.cat(xs).clone().requires_grad_()  # the same (8, 3) on both ranks
    y = te.ops.ReduceScatter(None)(xi)
    assert torch.equal(y, (2 * torch.cat(xs))[rank * 4 : rank * 4 + 4])
    y.backward(dy[:4])
    d4 = [torch.empty(4, 3) for _ in range(2)]
    dist.all_gather(d4, dy[:4].contiguous())
    assert torch.equal(xi.grad, torch.cat(d4))
    xi = x.clone().requires_grad_()
    y = te.ops.AllReduce(dist.group.WORLD)(xi)
    y.backward(dy[:4])
    assert torch.equal(xi, x) and torch.equal(y, xs[0] + xs[1]) and torch.equal(xi.grad, dy[:4])
    with pytest.raises(ValueError, match="divisible by the group's 2 ranks"):
        te.ops.ReduceScatter()(torch.ones(3, 2))
    seq = te.ops.Sequential(te.ops.AllGather(), te.ops.ReduceScatter())
    assert_close(seq(x), 2 * x, torch.float32)


def _check_linear_composite(mode, sp, rank):
    """te.ops.Linear(tensor_parallel_mode=...) with its bias against fp64: the column bias is
    this rank's part, the row bias added once after the reduction."""
    group = dist.group.WORLD
    layer = te.ops.Linear(K, N, tensor_parallel_mode=mode, tensor_parallel_group=group,
                          sequence_parallel=sp)  # fmt: skip
    w_full, b_full = _param((N, K), seed=1), _param(N, seed=2)
    with torch.no_grad():
        layer.weight.copy_(_shard(w_full.detach(), 0 if mode == "column" else 1, rank))
        layer.bias.copy_(_shard(b_full.detach(), 0, rank) if mode == "column" else b_full)
    x_full = _param((S, B, K), seed=3).detach()
    x = _shard(x_full, 2, rank) if mode == "row" else x_full
    x = _shard(x, 0, rank) if sp and mode == "column" else x
    want = x_full.double() @ w_full.double().t() + b_full.double()
    want = _shard(want, 2, rank) if mode == "column" else want
    want = _shard(want, 0, rank) if sp and mode == "row" else want
    assert_close(layer(x), want, torch.float32)


def _tp_rank(rank: int) -> dict:
    with torch.device("cpu"):
        outcome = each_config(_check_basic_linear, TP_CONFIGS, rank)
        outcome.update({("mlp", sp): each_config(_check_fused_mlp, [(sp,)], rank)[(sp,)]
                        for sp in (False, True)})  # fmt: skip
        outcome.update(each_config(_check_collectives, [()], rank))
        linear = [(mode, sp) for mode in ("column", "row") for sp in (False, True)]
        outcome.update(
            {
                ("linear", *c): t
                for c, t in each_config(_check_linear_composite, linear, rank).items()
            }
        )
    return outcome


def test_tensor_parallel_ops_on_two_ranks(tmp_path):
    for outcome in on_ranks(_tp_rank, 2, tmp_path):
        failed = {config: text for config, text in outcome.items() if text != "ok"}
        assert not failed, failed
        assert len(outcome) == len(TP_CONFIGS) + 2 + 1 + 4
