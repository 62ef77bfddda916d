"""te.ops for Megatron-Core 0.19's mixture-of-experts layers (megatron/core/transformer/moe/
experts.py: TEGroupedMLP._make_fused_ops; moe/shared_experts.py: FusedSharedExpertMLP;
extensions/transformer_engine.py: TEFusedMLPWithGroupedLinear), and the activations and
arguments they use (glu_interleave_size, ScaledClampedQGeGLU, ScaledSReLU, the unit scale of
shared experts). Each builder makes Megatron's calls with Megatron's argument lists (ops on the
meta device given Megatron's te.GroupedLinear / te.Linear parameters); results are held to an
fp64 reference, and the fused ops to Megatron's unfused path bit for bit. The dense layers and
tensor parallelism are in test_ops_megatron.py.

Legend: T tokens, H hidden, F the MLP's width (FC1 makes 2F for a gated activation), G experts.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from test_ops_megatron import F_, H, _act64, _param
from tolerances import assert_close, representable

import torchte as te
from torchte import recipe
from torchte.ops.basic.grouped_linear import GRAD_INPUT_BUFFER_KEY, OUTPUT_BUFFER_KEY

pytestmark = pytest.mark.usefixtures("cpu_default_device")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
T, INTERLEAVE = 12, 8


def _deinterleave(h, size):
    """(..., 2F) blocks [a (size), b (size), ...] -> [all a, all b], in fp64 torch ops."""
    shape = h.shape
    return h.reshape(-1, shape[-1] // (2 * size), 2, size).transpose(1, 2).reshape(shape)


# ---------------------------------------------------------------------------------------------
# Mixture of experts: TEGroupedMLP._make_fused_ops, FusedSharedExpertMLP, TEFusedMLPWithGrouped
# ---------------------------------------------------------------------------------------------


def _register_grouped_linear_params(op, linear, single_grouped_weight, single_grouped_bias):
    """experts.py's register_grouped_linear_params, as Megatron writes it."""
    if single_grouped_weight:
        op.register_parameter("weight", linear.get_parameter("weight"))
        for idx in range(linear.num_gemms):
            op.register_parameter(f"weight{idx}", None)
    else:
        op.register_parameter("weight", None)
        for idx in range(linear.num_gemms):
            op.register_parameter(f"weight{idx}", linear.get_parameter(f"weight{idx}"))
    if not linear.use_bias:
        return
    if single_grouped_bias:
        op.register_parameter("bias", linear.get_parameter("bias"))
        for idx in range(linear.num_gemms):
            op.register_parameter(f"bias{idx}", None)
    else:
        op.register_parameter("bias", None)
        for idx in range(linear.num_gemms):
            op.register_parameter(f"bias{idx}", linear.get_parameter(f"bias{idx}"))


def _make_fused_ops(fc1, fc2, activation, glu_interleave, clamp=None, recompute=False):
    """TEGroupedMLP._make_fused_ops's calls with Megatron's argument lists (fc1, fc2 its
    te.GroupedLinear layers)."""
    ops = te.ops.Sequential()
    fc1_weight_dtype = fc1.weight.dtype if fc1.single_grouped_weight else fc1.weight0.dtype
    fc2_weight_dtype = fc2.weight.dtype if fc2.single_grouped_weight else fc2.weight0.dtype
    op = te.ops.GroupedLinear(
        fc1.num_gemms,
        fc1.in_features,
        fc1.out_features,
        bias=fc1.use_bias,
        device="meta",
        dtype=fc1_weight_dtype,
        accumulate_into_main_grad=fc1.fuse_wgrad_accumulation,
        single_grouped_weight=fc1.single_grouped_weight,
        single_grouped_bias=fc1.single_grouped_bias,
        delay_wgrad_compute=fc1.delay_wgrad_compute,
    )
    _register_grouped_linear_params(op, fc1, fc1.single_grouped_weight, fc1.single_grouped_bias)
    ops.append(op)
    if activation == "swiglu":
        assert "activation_recompute_in_mlp" in inspect.signature(te.ops.ScaledSwiGLU).parameters
        op = te.ops.ScaledSwiGLU(
            glu_interleave_size=glu_interleave, activation_recompute_in_mlp=recompute
        )
    elif activation == "quick_gelu":
        assert (
            "activation_recompute_in_mlp"
            in inspect.signature(te.ops.ScaledClampedQGeGLU).parameters
        )
        op = te.ops.ScaledClampedQGeGLU(
            glu_interleave_size=glu_interleave, activation_recompute_in_mlp=recompute, limit=clamp
        )
    else:
        assert "activation_recompute_in_mlp" in inspect.signature(te.ops.ScaledSReLU).parameters
        op = te.ops.ScaledSReLU(activation_recompute_in_mlp=recompute)
    ops.append(op)
    fc2_bias_kwargs = {"scale_bias": True} if fc2.use_bias else {}
    op = te.ops.GroupedLinear(
        fc2.num_gemms,
        fc2.in_features,
        fc2.out_features,
        bias=fc2.use_bias,
        device="meta",
        dtype=fc2_weight_dtype,
        accumulate_into_main_grad=fc2.fuse_wgrad_accumulation,
        single_grouped_weight=fc2.single_grouped_weight,
        single_grouped_bias=fc2.single_grouped_bias,
        delay_wgrad_compute=fc2.delay_wgrad_compute,
        **fc2_bias_kwargs,
    )
    _register_grouped_linear_params(op, fc2, fc2.single_grouped_weight, fc2.single_grouped_bias)
    ops.append(op)
    ops.register_forward_pre_hook(lambda module, *_: None)
    return ops


def _stacked(layer, name):
    """A te.GroupedLinear's weights (G, N, K) or biases (G, N), either layout, as one tensor."""
    single = getattr(layer, f"single_grouped_{name}")
    if single:
        return layer.get_parameter(name)
    return torch.stack([layer.get_parameter(f"{name}{g}") for g in range(layer.num_gemms)])


def _grouped_mlp64(x, splits, probs, w1, b1, w2, b2, activation, interleave, clamp):
    """fp64 reference of the routed experts: p (act(x W1_g^T + b1_g)) W2_g^T + p b2_g."""
    outs, start = [], 0
    for g, rows in enumerate(splits):
        xg, pg = x[start : start + rows], probs[start : start + rows, None]
        h = xg @ w1[g].t() + (0 if b1 is None else b1[g])
        if interleave:
            h = _deinterleave(h, interleave)
        a = _act64(activation, h, clamp or 7.0) * pg
        outs.append(a @ w2[g].t() + (0 if b2 is None else pg * b2[g]))
        start += rows
    return torch.cat(outs)


MOE_CASES = [
    # (activation, glu interleave, single weight, single bias, bias, delay_wgrad_compute)
    ("swiglu", None, False, False, True, False),
    ("swiglu", INTERLEAVE, True, True, True, True),
    ("quick_gelu", INTERLEAVE, False, True, False, False),
    ("srelu", None, True, False, True, True),
]


@pytest.mark.parametrize("case", MOE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_moe_experts_fused_ops(case):
    """TEGroupedMLP._make_fused_ops on te.GroupedLinear layers of either parameter layout:
    output and every gradient (x, probs, weights, biases) against fp64; with delay_wgrad_compute
    the weight gradients arrive at Megatron's backward_dw (fc2's op, then fc1's)."""
    activation, interleave, single_w, single_b, bias, delay = case
    splits, clamp = [5, 0, 7], 0.75 if activation == "quick_gelu" else None
    width = F_ if activation == "srelu" else 2 * F_
    kw = {"bias": bias, "single_grouped_weight": single_w, "single_grouped_bias": single_b}
    fc1 = te.GroupedLinear(3, H, width, delay_wgrad_compute=delay, **kw)
    fc2 = te.GroupedLinear(3, F_, H, delay_wgrad_compute=delay, **kw)
    with torch.no_grad():
        for i, param in enumerate([*fc1.parameters(), *fc2.parameters()]):
            param.copy_(_param(param.shape, seed=10 + i))
    ops = _make_fused_ops(fc1, fc2, activation, interleave, clamp)
    x = _param((sum(splits), H), seed=1).detach().requires_grad_()
    probs = _param(sum(splits), seed=2).detach().abs().requires_grad_()
    tokens_per_expert = torch.tensor(splits)
    extra = (tokens_per_expert, probs) if fc2.use_bias else (tokens_per_expert,)
    y = ops(x, tokens_per_expert, probs, *extra)
    names = ["weight", "bias"] if bias else ["weight"]
    tensors = [_stacked(layer, n) for layer in (fc1, fc2) for n in names]
    leaves = [t.detach().double().requires_grad_() for t in (x, probs, *tensors)]
    w1, b1, w2, b2 = leaves[2:] if bias else (leaves[2], None, leaves[3], None)
    y64 = _grouped_mlp64(
        leaves[0], splits, leaves[1], w1, b1, w2, b2, activation, interleave, clamp
    )
    assert_close(y, y64, torch.float32)
    dy = _param(y.shape, seed=3).detach()
    y.backward(dy)
    y64.backward(dy.double())
    assert_close(x.grad, leaves[0].grad, torch.float32)
    assert_close(probs.grad, leaves[1].grad, torch.float32)
    children = list(ops.children())
    assert len(children) >= 3 and all(c.need_backward_dw() == delay for c in children[::2])
    if delay:
        assert fc1.get_parameter("weight" if single_w else "weight0").grad is None
        children[2].backward_dw()
        children[0].backward_dw()
    for layer, name, leaf in zip(
        [layer for layer in (fc1, fc2) for _ in names], names * 2, leaves[2:], strict=True
    ):
        assert_close(_grad_stacked(layer, name), leaf.grad, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe_name", ["bf16", "current"])
@pytest.mark.parametrize(
    ("single", "delay", "interleave"), [(False, False, None), (True, True, INTERLEAVE)]
)
def test_moe_fused_ops_equal_the_layers_they_stand_for(device, recipe_name, single, delay,
                                                       interleave):  # fmt: skip
    """The fused ops of TEGroupedMLP equal Megatron's unfused path (its te.GroupedLinear layers
    with the scaled activation between them) bit for bit: forward, dx, d(probs) and the weight
    gradients (those of delay_wgrad_compute after backward_dw); under FP8 the ops run the fused
    grouped MLP (whose d(probs) on the GPU equals to fp32 rounding). Split sizes in a device
    tensor on the GPU."""
    kw = {"bias": False, "params_dtype": torch.bfloat16, "device": device,
          "single_grouped_weight": single}  # fmt: skip
    layers = [te.GroupedLinear(3, H, 2 * F_, delay_wgrad_compute=delay, **kw),
              te.GroupedLinear(3, F_, H, delay_wgrad_compute=delay, **kw)]  # fmt: skip
    ref = [te.GroupedLinear(3, H, 2 * F_, **kw), te.GroupedLinear(3, F_, H, **kw)]
    with torch.no_grad():
        mine = [*layers[0].parameters(), *layers[1].parameters()]
        theirs = [*ref[0].parameters(), *ref[1].parameters()]
        for i, (p, q) in enumerate(zip(mine, theirs, strict=True)):
            p.copy_(_param(p.shape, seed=20 + i))
            q.copy_(p)
    ops = _make_fused_ops(*layers, "swiglu", interleave)
    act = te.ops.ScaledSwiGLU(glu_interleave_size=interleave, device=device)
    splits = torch.tensor([16, 0, 32], device=device)
    x = _param((48, H), torch.bfloat16, seed=1).detach().to(device)
    probs = _param(48, seed=2).detach().abs().to(device)
    dy = _param((48, H), torch.bfloat16, seed=3).detach().to(device)
    results = []
    for run in ("ops", "layers"):
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        enabled = recipe_name == "current"
        with te.autocast(enabled=enabled, recipe=recipe.Float8CurrentScaling()):
            if run == "ops":
                y = ops(xi, splits, pi, splits)
            else:
                y = ref[1](act(ref[0](xi, splits), pi), splits)
        y.backward(dy)
        if run == "ops" and delay:
            children = list(ops.children())
            children[2].backward_dw()
            children[0].backward_dw()
        grads = [p.grad for layer in (layers if run == "ops" else ref) for p in layer.parameters()]
        results.append([y, xi.grad, pi.grad, *grads])
    for i, (got, want) in enumerate(zip(*results, strict=True)):
        assert got.shape == want.shape
        if i == 2 and recipe_name == "current" and device == "cuda":
            # d(probs): a sum over the features, which the fused FP8 kernel on the GPU adds in
            # another order than the unfused activation's backward (fp32 rounding apart).
            assert_close(got, want, torch.float32)
        else:
            assert torch.equal(got, want), i


def _grad_stacked(layer, name):
    if getattr(layer, f"single_grouped_{name}"):
        return layer.get_parameter(name).grad
    return torch.stack([layer.get_parameter(f"{name}{g}").grad for g in range(layer.num_gemms)])


def test_moe_experts_main_grad_and_op_kwargs_buffers():
    """fuse_wgrad_accumulation into a single grouped weight's (G, N, K) main_grad (and per-group
    ones) gives the gradients the same ops return without it; Megatron's op_kwargs: FC2 writes
    its output into a given buffer, FC1 its input gradient."""
    x = _param((9, H), seed=1).detach()
    probs, splits = _param(9, seed=2).detach().abs(), torch.tensor([4, 5])
    runs = []
    for fuse in (True, False):
        fc1 = te.GroupedLinear(2, H, 2 * F_, bias=False, single_grouped_weight=True,
                               fuse_wgrad_accumulation=fuse)  # fmt: skip
        fc2 = te.GroupedLinear(2, F_, H, bias=False, fuse_wgrad_accumulation=fuse)
        with torch.no_grad():
            for i, param in enumerate([*fc1.parameters(), *fc2.parameters()]):
                param.copy_(_param(param.shape, seed=10 + i))
                param.main_grad = torch.zeros(param.shape)
        ops = _make_fused_ops(fc1, fc2, "swiglu", None)
        xi = x.clone().requires_grad_()
        out, grad_in = torch.empty(9, H), torch.empty(9, H)
        op_kwargs = {-1: {OUTPUT_BUFFER_KEY: out}, 0: {GRAD_INPUT_BUFFER_KEY: grad_in}}
        y = ops(xi, splits, probs, splits, op_kwargs=op_kwargs if fuse else None)
        y.backward(torch.ones_like(y))
        params = [*fc1.parameters(), *fc2.parameters()]
        grads = [p.main_grad if fuse else p.grad for p in params]
        runs.append((y, xi.grad, grads, out, grad_in))
    (y, dx, main_grads, out, grad_in), (y_plain, dx_plain, grads, _, _) = runs
    assert y.data_ptr() == out.data_ptr() and torch.equal(out, y_plain)
    assert torch.equal(grad_in, dx_plain) and torch.equal(dx, dx_plain)
    assert main_grads[0].shape == (2, 2 * F_, H)
    for got, want in zip(main_grads, grads, strict=True):
        assert_close(got, want, torch.float32)
    with te.autocast(recipe=recipe.Float8CurrentScaling()):  # the fused grouped MLP
        fp8 = ops(x, splits, probs, splits)
        into = ops(x, splits, probs, splits, op_kwargs={-1: {OUTPUT_BUFFER_KEY: out}})
    assert into.data_ptr() == out.data_ptr() and torch.equal(into, fp8)
    with pytest.raises(TypeError, match="unknown op_kwargs"):
        ops(x, splits, probs, splits, op_kwargs={0: {"outptu": out}})
    with pytest.raises(ValueError, match="op_kwargs has a key for an op not in it"):
        ops(x, splits, probs, splits, op_kwargs={te.ops.GELU(): {}})
    with pytest.raises(ValueError, match="basic operations only"):
        te.ops.Sequential(te.ops.Linear(H, H))(x, op_kwargs={0: {}})
    with pytest.raises(ValueError, match="'output' buffer must be"):
        ops(x, splits, probs, splits, op_kwargs={-1: {OUTPUT_BUFFER_KEY: torch.empty(9, 3)}})


@pytest.mark.parametrize("shared", [False, True], ids=["grouped-linear-mlp", "shared-experts"])
def test_single_group_swiglu_mlp(shared):
    """FusedSharedExpertMLP._make_fused_grouped_swiglu_ops (one unit scale for every token: the
    op is marked _grouped_mlp_unit_activation_scale) and TEFusedMLPWithGroupedLinear (built
    inside quantized_model_init, one scale per token): GroupedLinear(num_groups=1) ops on the
    meta device given te.Linear weights, interleaved SwiGLU; against fp64."""
    fc1, fc2 = te.Linear(H, 2 * F_), te.Linear(F_, H)
    with torch.no_grad():
        fc1.weight.copy_(_param(fc1.weight.shape, seed=1))
        fc2.weight.copy_(_param(fc2.weight.shape, seed=2))
    glu_interleave_size = INTERLEAVE
    tp_world_size, rng_state_tracker_function = 1, None
    mxfp8 = recipe.MXFP8BlockScaling()
    # Megatron builds the shared experts' ops inside fp8_autocast, the other's inside
    # quantized_model_init (and runs both under an MXFP8 autocast, not here: high precision).
    if shared:
        context = te.fp8_autocast(enabled=True, fp8_recipe=mxfp8)
    else:
        context = te.quantized_model_init(enabled=True, recipe=mxfp8)
    with context:
        ops = te.ops.Sequential()
        op = te.ops.GroupedLinear(
            num_groups=1,
            in_features=fc1.weight.size(1),
            out_features=fc1.weight.size(0) * tp_world_size,
            device="meta",
            dtype=fc1.weight.dtype,
            bias=False,
            rng_state_tracker_function=rng_state_tracker_function,
            accumulate_into_main_grad=fc1.fuse_wgrad_accumulation,
        )
        op.weight0 = fc1.weight
        op._glu_interleave_size = glu_interleave_size
        ops.append(op)
        activation_op = te.ops.ScaledSwiGLU(glu_interleave_size=glu_interleave_size)
        if shared:
            activation_op._grouped_mlp_unit_activation_scale = True
        ops.append(activation_op)
        op = te.ops.GroupedLinear(
            num_groups=1,
            in_features=fc2.weight.size(1),
            out_features=fc2.weight.size(0),
            device="meta",
            dtype=fc2.weight.dtype,
            bias=False,
            rng_state_tracker_function=rng_state_tracker_function,
            accumulate_into_main_grad=fc2.fuse_wgrad_accumulation,
        )
        op.weight0 = fc2.weight
        ops.append(op)
    hidden_states_2d = _param((T, H), seed=3).detach().requires_grad_()
    tokens_per_expert = torch.tensor([T], dtype=torch.long)
    scales = torch.ones(1) if shared else _param(T, seed=4).detach().requires_grad_()
    output = ops(hidden_states_2d, tokens_per_expert, scales, tokens_per_expert)
    h = hidden_states_2d.double() @ fc1.weight.double().t()
    s = scales.double().expand(T) if shared else scales.double()
    want = (_act64("swiglu", _deinterleave(h, INTERLEAVE)) * s[:, None]) @ fc2.weight.double().t()
    assert_close(output, want, torch.float32)
    output.sum().backward()
    assert fc1.weight.grad is not None and hidden_states_2d.grad is not None
    assert list(ops.children())[2].backward_dw() is None  # no deferred wgrads: nothing to do


def test_grouped_mlp_interleaved_fp8_matches_reordered_weights():
    """Under FP8 (the fused grouped MLP: the activation writes FC2's FP8 input) an interleaved
    ScaledSwiGLU equals the plain one with FC1's weight rows reordered to [a; b]."""
    splits, probs = [8, 0, 8], _param(16, seed=5).detach().abs()
    layers = []
    for interleave in (INTERLEAVE, None):
        layers.append(te.ops.Sequential(
            te.ops.GroupedLinear(3, H, 2 * F_, bias=False),
            te.ops.ScaledSwiGLU(glu_interleave_size=interleave),
            te.ops.GroupedLinear(3, F_, H, bias=False),
        ))  # fmt: skip
    with torch.no_grad():
        for g in range(3):
            w1 = _param((2 * F_, H), seed=g)
            layers[0][0].get_parameter(f"weight{g}").copy_(w1)
            layers[1][0].get_parameter(f"weight{g}").copy_(_deinterleave(w1.t(), INTERLEAVE).t())
            for seq in layers:
                seq[2].get_parameter(f"weight{g}").copy_(_param((H, F_), seed=9 + g))
    x = _param((16, H), seed=6).detach()
    outs = []
    for seq in layers:
        xi = x.clone().requires_grad_()
        with te.autocast(recipe=recipe.Float8CurrentScaling()):
            y = seq(xi, splits, probs, splits)
        y.sum().backward()
        outs.append((y, xi.grad))
    assert_close(outs[0][0], outs[1][0], torch.float8_e4m3fn)
    assert_close(outs[0][1], outs[1][1], torch.float8_e4m3fn)


# ---------------------------------------------------------------------------------------------
# The new activations and arguments against fp64
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "name", "limit"),
    [
        (lambda: te.ops.ScaledSwiGLU(glu_interleave_size=4), "swiglu", None),
        (lambda: te.ops.ScaledSwiGLU(4, activation_recompute_in_mlp=False), "swiglu", None),
        (lambda: te.ops.ScaledClampedQGeGLU(glu_interleave_size=4, limit=0.5), "quick_gelu", 0.5),
        (lambda: te.ops.ScaledClampedQGeGLU(), "quick_gelu", 7.0),
        (lambda: te.ops.ScaledSReLU(activation_recompute_in_mlp=False), "srelu", None),
    ],
    ids=["swiglu-interleaved", "swiglu-positional", "clamped-qgeglu-4", "clamped-qgeglu", "srelu"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_activations_match_fp64(make, name, limit, dtype):
    op = make()
    size = op.glu_interleave_size
    x = representable((3, 5, 16), torch.bfloat16).to(dtype).requires_grad_()
    s = representable((3, 5), torch.bfloat16).to(dtype).requires_grad_()
    y = op(x, s)
    x64, s64 = (t.detach().double().requires_grad_() for t in (x, s))
    h = _deinterleave(x64, size) if size else x64
    y64 = _act64(name, h, limit or 7.0) * s64[..., None]
    assert y.shape == y64.shape and y.dtype == dtype
    assert_close(y, y64, dtype)
    dy = representable(y.shape, torch.bfloat16).to(dtype)
    y.backward(dy)
    y64.backward(dy.double())
    assert_close(x.grad, x64.grad, dtype)
    # ds sums a row of products: its error grows with the row
    tol = 16 * torch.finfo(dtype).eps * (dy.abs().double() * y64.detach().abs()).sum(-1).max()
    assert (s.grad.double() - s64.grad).abs().max() <= tol + 1e-5


@pytest.mark.parametrize("op_name", ["SwiGLU", "ClampedSwiGLU", "GEGLU"])
def test_gated_activation_glu_interleave_size(op_name):
    """glu_interleave_size on the unscaled gated ops: the input read as blocks of a and b."""
    op = getattr(te.ops, op_name)(glu_interleave_size=2)
    x = representable((4, 24), torch.bfloat16, scale=4.0).requires_grad_()
    plain = getattr(te.ops, op_name)()
    x_plain = _deinterleave(x.detach(), 2).requires_grad_()
    y, y_plain = op(x), plain(x_plain)
    assert torch.equal(y, y_plain)
    y.backward(torch.ones_like(y))
    y_plain.backward(torch.ones_like(y))
    assert torch.equal(_deinterleave(x.grad, 2), x_plain.grad)


def test_activation_arguments_are_checked():
    with pytest.raises(ValueError, match="activation recomputation"):
        te.ops.ScaledSwiGLU(glu_interleave_size=32, activation_recompute_in_mlp=True)
    with pytest.raises(ValueError, match="activation recomputation"):
        te.ops.ScaledClampedQGeGLU(activation_recompute_in_mlp=True)
    with pytest.raises(NotImplementedError, match="activation_recompute_in_mlp"):
        te.ops.ScaledSReLU(activation_recompute_in_mlp=True)
    with pytest.raises(NotImplementedError, match="glu_linear_offset"):
        te.ops.ClampedSwiGLU(glu_linear_offset=0.0)
    with pytest.raises(TypeError, match="gate_interleave_size"):
        te.ops.ScaledSwiGLU(gate_interleave_size=32)
    with pytest.raises(ValueError, match="glu_interleave_size must be a positive int"):
        te.ops.SwiGLU(glu_interleave_size=0)
    with pytest.raises(ValueError, match="multiple of 64"):
        te.ops.ScaledSwiGLU(glu_interleave_size=32)(torch.randn(2, 96), torch.ones(2))
    with pytest.raises(ValueError, match="one scale per row"):  # unmarked: one per row
        te.ops.ScaledSwiGLU()(torch.randn(2, 8), torch.ones(1))
