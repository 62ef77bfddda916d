"""te.ops: the operation fuser against te modules and plain PyTorch with the same weights.

te.ops.Linear and te.Linear share their GEMM code, so they agree bit for bit in every recipe;
a norm -> linear run under delayed scaling (the norm writes FP8 itself) agrees bit for bit with
te.LayerNormLinear and with the same ops unfused; whole blocks agree with an fp64 reference.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from setattr_writes import set_as_torchte
from tolerances import assert_close, representable

import torchte as te
from torchte import recipe
from torchte.ops import fuser as fuser_mod

RECIPES = {
    "bf16": None,
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "current": lambda: recipe.Float8CurrentScaling(),
}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# Ops built without a device go to the CPU here, also on a GPU machine.
pytestmark = pytest.mark.usefixtures("cpu_default_device")


def _fp8(name):
    make = RECIPES[name]
    return te.autocast(enabled=make is not None, recipe=make() if make else None)


def _run(module, x, *extra, recipe_name="bf16"):
    """(y, dx, {name: grad}) of one forward under the recipe and a backward of a fixed dy."""
    x = x.detach().requires_grad_(True)
    with _fp8(recipe_name):
        y = module(x, *extra)
    dy = representable(y.shape, torch.bfloat16, generator=torch.Generator().manual_seed(7))
    y.backward(dy.to(y.device, y.dtype))
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    return y.detach(), x.grad, grads


def _equal(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("bias", [True, False])
def test_linear_op_equals_te_linear_bit_for_bit(device, recipe_name, bias):
    op = te.ops.Linear(64, 48, bias=bias, device=device, dtype=torch.bfloat16)
    module = te.Linear(64, 48, bias=bias, device=device, params_dtype=torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(op.weight)
        if bias:
            module.bias.copy_(representable(48, torch.bfloat16))
            op.bias.copy_(module.bias)
    x = representable((3, 5, 64), torch.bfloat16, device=device).to(torch.bfloat16)
    for step in range(2):  # the second step runs on updated delayed scales
        y_op, dx_op, g_op = _run(op, x, recipe_name=recipe_name)
        y_te, dx_te, g_te = _run(module, x, recipe_name=recipe_name)
        assert _equal(y_op, y_te) and _equal(dx_op, dx_te), (step, recipe_name)
        for name in g_te:
            assert _equal(g_op[name], g_te[name]), (step, name)
        op.zero_grad(), module.zero_grad()


def _norm_linear_pair(normalization, device):
    kw = {"device": device, "dtype": torch.bfloat16}
    norm_cls = te.ops.LayerNorm if normalization == "LayerNorm" else te.ops.RMSNorm
    ops = te.ops.Sequential(norm_cls(64, **kw), te.ops.Linear(64, 32, **kw))
    module = te.LayerNormLinear(
        64, 32, normalization=normalization, device=device, params_dtype=torch.bfloat16
    )
    # The module's Function, whose kernels the ops share (in bf16 a plain LayerNormLinear
    # takes torch's own ops instead: its `_plain` shortcut).
    module._fast_setattr("_plain", False)
    with torch.no_grad():
        ops[0].weight.copy_(representable(64, torch.bfloat16, scale=1.0) + 1)
        module.layer_norm_weight.copy_(ops[0].weight)
        if normalization == "LayerNorm":
            ops[0].bias.copy_(representable(64, torch.bfloat16))
            module.layer_norm_bias.copy_(ops[0].bias)
        module.weight.copy_(ops[1].weight)
        ops[1].bias.copy_(representable(32, torch.bfloat16))
        module.bias.copy_(ops[1].bias)
    return ops, module


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_norm_linear_ops_equal_layernorm_linear(device, recipe_name, normalization):
    ops, module = _norm_linear_pair(normalization, device)
    x = representable((2, 7, 64), torch.bfloat16, device=device).to(torch.bfloat16)
    y_op, dx_op, g_op = _run(ops, x, recipe_name=recipe_name)
    y_te, dx_te, g_te = _run(module, x, recipe_name=recipe_name)
    assert _equal(y_op, y_te), recipe_name
    assert _equal(dx_op, dx_te), recipe_name
    names = {"0.weight": "layer_norm_weight", "1.weight": "weight", "1.bias": "bias"}
    names |= {"0.bias": "layer_norm_bias"} if normalization == "LayerNorm" else {}
    for op_name, te_name in names.items():
        assert _equal(g_op[op_name], g_te[te_name]), (recipe_name, op_name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("producer", ["RMSNorm", "SwiGLU", "GLU"])
def test_delayed_producer_linear_is_fused_and_equals_unfused(monkeypatch, producer, device):
    """Under delayed scaling the norm or activation writes the GEMM's FP8 input itself: the
    same bytes as the op followed by the GEMM's own quantization."""
    kw = {"dtype": torch.bfloat16, "device": device}
    if producer == "RMSNorm":
        first = te.ops.RMSNorm(64, **kw)
    else:
        first = getattr(te.ops, producer)(device=device)
    features = 64 if producer == "RMSNorm" else 32
    ops = te.ops.Sequential(first, te.ops.BasicLinear(features, 32, **kw))
    twin = copy.deepcopy(ops)  # the same weights and fresh scaling state
    x = representable((40, 64), torch.bfloat16, device=device).to(torch.bfloat16)
    fused = _run(ops, x, recipe_name="delayed")
    pipeline = next(iter(ops._stages[0]._pipelines.values()))
    assert [type(op).__name__ for op, _ in pipeline.forward] == ["ForwardLinear"]
    monkeypatch.setattr(fuser_mod, "FORWARD_FUSIONS", ())
    unfused = _run(twin, x, recipe_name="delayed")
    pipeline = next(iter(twin._stages[0]._pipelines.values()))
    assert [type(op).__name__ for op, _ in pipeline.forward] == [producer, "BasicLinear"]
    assert _equal(fused[0], unfused[0]) and _equal(fused[1], unfused[1])
    for name, grad in fused[2].items():
        assert _equal(grad, unfused[2][name]), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("activation", ["SwiGLU", "GLU"])
def test_backward_activation_bias_quantize_fusion(monkeypatch, device, recipe_name, activation):
    """Under delayed scaling the backward of Linear -> SwiGLU (or GLU) computes dh, the bias
    gradient and the FP8 dh in one kernel: the same input and weight gradients as the ops
    unfused, the bias gradient summed in fp32 (within an ulp of bf16). Current scaling: not
    fused."""
    kw = {"dtype": torch.bfloat16, "device": device}
    first, last = te.ops.Linear(64, 64, **kw), te.ops.Linear(32, 16, **kw)
    ops = te.ops.Sequential(first, getattr(te.ops, activation)(), last)
    with torch.no_grad():
        ops[0].bias.copy_(representable(64, torch.bfloat16))
    twin = copy.deepcopy(ops)
    x = representable((40, 64), torch.bfloat16, device=device).to(torch.bfloat16)
    fused = _run(ops, x, recipe_name=recipe_name)
    pipeline = next(iter(ops._stages[0]._pipelines.values()))
    names = [type(op).__name__ for op, _ in pipeline.backward]
    expected_fused = recipe_name == "delayed"
    assert ("BackwardActivationLinear" in names) == expected_fused, names
    monkeypatch.setattr(fuser_mod, "BACKWARD_FUSIONS", ())
    unfused = _run(twin, x, recipe_name=recipe_name)
    assert _equal(fused[0], unfused[0]) and _equal(fused[1], unfused[1])
    for name, grad in fused[2].items():
        if name == "0.bias" and expected_fused:
            assert_close(grad, unfused[2][name], torch.bfloat16)
        else:
            assert _equal(grad, unfused[2][name]), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_glu_op_is_sigmoid_of_the_first_half_times_the_second(device, dtype):
    """te.ops.GLU: sigmoid(a) * b for x = [a, b], Transformer Engine's convention; the same as
    torch's F.glu (a * sigmoid(b)) on the halves swapped, in fp64, with its gradient."""
    op = te.ops.GLU(device=device)
    x = representable((3, 5, 24), dtype, scale=8.0, device=device).to(dtype).requires_grad_()
    y = op(x)
    dy = representable(y.shape, dtype, device=device).to(dtype)
    y.backward(dy)
    a, b = x.detach().double().chunk(2, dim=-1)
    swapped = torch.cat([b, a], dim=-1).requires_grad_()
    y64 = F.glu(swapped, dim=-1)
    y64.backward(dy.double())
    assert y.shape == (3, 5, 12) and y.dtype == dtype
    assert_close(y, y64, dtype)
    assert_close(x.grad, torch.cat(swapped.grad.chunk(2, dim=-1)[::-1], dim=-1), dtype)
    with pytest.raises(ValueError, match=r"te\.ops\.GLU is gated"):
        te.ops.Sequential(te.ops.Linear(16, 63, device=device), te.ops.GLU(device=device))


def _block_reference(block, x, residual):
    """fp64 RMSNorm -> Linear -> SwiGLU -> Linear -> + residual with the block's parameters."""
    p = {n: t.detach().double() for n, t in block.named_parameters()}
    x64 = x.double()
    z = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * p["0.weight"]
    h = F.linear(z, p["1.weight"], p["1.bias"])
    a = F.silu(h[..., :64]) * h[..., 64:]
    return F.linear(a, p["3.weight"], p["3.bias"]) + residual.double()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_block_matches_fp64_reference(device, dtype):
    kw = {"device": device, "dtype": dtype}
    block = te.ops.Sequential(
        te.ops.RMSNorm(64, **kw), te.ops.Linear(64, 128, **kw), te.ops.SwiGLU(),
        te.ops.Linear(64, 64, **kw), te.ops.AddExtraInput(),
    )  # fmt: skip
    x = representable((3, 4, 64), dtype, device=device).to(dtype)
    residual = representable((3, 4, 64), dtype, device=device).to(dtype).requires_grad_(True)
    y = block(x, residual)
    assert_close(y, _block_reference(block, x, residual), dtype)
    y.float().sum().backward()
    assert torch.equal(residual.grad, torch.ones_like(residual))
    assert block[1].weight.grad is not None and block[3].bias.grad is not None


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_fp8_dense_block_trains_close_to_bf16(recipe_name):
    kw = {"dtype": torch.bfloat16}
    block = te.ops.Sequential(
        te.ops.LayerNorm(64, **kw), te.ops.Linear(64, 128, **kw), te.ops.GELU(),
        te.ops.Linear(128, 64, **kw),
    )  # fmt: skip
    x = representable((32, 64), torch.bfloat16).to(torch.bfloat16)
    y_hp, dx_hp, _ = _run(block, x)
    block.zero_grad()
    y_fp8, dx_fp8, _ = _run(block, x, recipe_name=recipe_name)
    assert_close(y_fp8, y_hp, torch.float8_e4m3fn)
    assert torch.isfinite(dx_fp8).all() and dx_fp8.shape == dx_hp.shape


def test_make_extra_output_returns_x_and_adds_gradients():
    block = te.ops.Sequential(te.ops.MakeExtraOutput(), te.ops.ConstantScale(3.0))
    x = torch.randn(4, 8, requires_grad=True)
    y, extra = block(x)
    assert torch.equal(extra, x) and torch.equal(y, 3 * x)
    (y.sum() + 2 * extra.sum()).backward()
    assert torch.equal(x.grad, torch.full_like(x, 5.0))


def test_reshape_identity_dropout_and_no_grad():
    block = te.ops.Sequential(te.ops.Reshape((-1, 4)), te.ops.Identity(), te.ops.Dropout(0.5))
    x = torch.randn(2, 8, requires_grad=True)
    block.eval()
    assert torch.equal(block(x), x.reshape(-1, 4))
    block.train()
    y = block(x)
    kept = y != 0
    y.sum().backward()
    assert torch.equal(x.grad.reshape(-1, 4), kept.float() * 2.0)
    with torch.no_grad():
        assert block(x).shape == (4, 4)


def test_accumulate_into_main_grad():
    op = te.ops.BasicLinear(32, 16, accumulate_into_main_grad=True)
    op.weight.main_grad = torch.zeros(16, 32)
    x = torch.randn(5, 32)
    for _ in range(2):
        op(x).sum().backward()
    expected = 2 * torch.ones(5, 16).t() @ x
    assert_close(op.weight.main_grad, expected, torch.float32)


def test_bad_input_is_refused_before_any_kernel():
    with pytest.raises(ValueError, match=r"op 1 \(Linear\) takes 32 features, but .* make 64"):
        te.ops.Sequential(te.ops.Linear(16, 64), te.ops.Linear(32, 8))
    with pytest.raises(ValueError, match="must be even"):
        te.ops.Sequential(te.ops.Linear(16, 63), te.ops.SwiGLU())
    block = te.ops.Sequential(te.ops.Linear(16, 16), te.ops.AddExtraInput())
    with pytest.raises(ValueError, match="takes 1 extra input"):
        block(torch.randn(2, 16))
    with pytest.raises(ValueError, match="extra input has shape"):
        block(torch.randn(2, 16), torch.randn(3, 16))
    with pytest.raises(ValueError, match="in_features is 16"):
        block(torch.randn(2, 15), torch.randn(2, 16))
    odd = te.ops.Sequential(te.ops.Linear(24, 16))
    with te.autocast(recipe=recipe.DelayedScaling()), pytest.raises(ValueError, match="by 16"):
        odd(torch.randn(2, 24))


def test_failed_forward_leaves_no_delayed_scaling_state():
    block = te.ops.Sequential(te.ops.Linear(16, 16), te.ops.AddExtraInput())
    linear = block[0].basic_ops[0]
    delayed = recipe.DelayedScaling(amax_history_len=4)
    with te.autocast(recipe=delayed), pytest.raises(ValueError, match="extra input has shape"):
        block(torch.randn(2, 16), torch.randn(3, 16))
    state = linear._delayed_states[4][0]
    assert torch.equal(state.amax_history, torch.zeros_like(state.amax_history))
    assert torch.equal(state.scale, torch.ones_like(state.scale))


def test_setattr_after_construction_warns():
    op = te.ops.GELU()
    with pytest.warns(RuntimeWarning, match="_fast_setattr"):
        set_as_torchte(op, "something", 1)


def test_linear_op_state_dict_and_move():
    op = te.ops.Linear(16, 16)
    with te.autocast(recipe=recipe.DelayedScaling(amax_history_len=4)):
        op(torch.randn(2, 16))
    state = op.state_dict()
    assert {"weight", "bias", "_extra_state"} <= set(state)
    other = te.ops.Linear(16, 16)
    other.load_state_dict(state)
    assert torch.equal(other.weight, op.weight)
    assert torch.equal(
        other.basic_ops[0]._delayed_states[4][0].scale, op.basic_ops[0]._delayed_states[4][0].scale
    )
    op.to(torch.float64)
    assert op.weight.dtype == torch.float64 and op.basic_ops[0].weight is op.weight


@pytest.mark.parametrize("recipe_name", ["bf16", "current"])
def test_compiled_sequential_equals_eager(recipe_name):
    """torch.compile of a te.ops.Sequential runs (each fused run is one autograd Function that
    Dynamo leaves to eager: a graph break, so fullgraph=True is refused) with eager's numbers."""
    block = te.ops.Sequential(te.ops.Linear(32, 64), te.ops.SwiGLU(), te.ops.Linear(32, 32))
    x = representable((16, 32), torch.bfloat16)
    want = _run(block, x, recipe_name=recipe_name)
    block.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    try:
        got = _run(torch.compile(block, backend="eager"), x, recipe_name=recipe_name)
    finally:
        torch._dynamo.reset()
    assert _equal(got[0], want[0]) and _equal(got[1], want[1])
    got_grads = {name.removeprefix("_orig_mod."): grad for name, grad in got[2].items()}
    assert got_grads.keys() == want[2].keys()
    for name, grad in want[2].items():
        assert _equal(got_grads[name], grad), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_residual_add_is_one_gemm(monkeypatch, device, dtype):
    """BasicLinear -> AddExtraInput in high precision: the GEMM adds the residual (torch.addmm:
    one rounding on the CPU, against an fp64 reference; cuBLAS in bf16 rounds the product
    before adding, so on the GPU it is addmm's bits); gradients as unfused, bit for bit."""
    block = te.ops.Sequential(
        te.ops.Linear(64, 48, bias=False, device=device, dtype=dtype), te.ops.AddExtraInput()
    )
    twin = copy.deepcopy(block)
    x = representable((5, 8, 64), torch.bfloat16, device=device).to(dtype)
    residual = representable((5, 8, 48), torch.bfloat16, device=device).to(dtype)
    fused = _run(block, x, residual.clone().requires_grad_(True))
    pipeline = next(iter(block._stages[0]._pipelines.values()))
    assert [type(op).__name__ for op, _ in pipeline.forward] == ["ForwardLinearAdd"]
    weight = block[0].weight.detach()
    if device == "cpu":
        want = x.double() @ weight.double().t() + residual.double()
        assert_close(fused[0], want, dtype)
    else:
        want = torch.addmm(residual.reshape(-1, 48), x.reshape(-1, 64), weight.t())
        assert torch.equal(fused[0], want.view(fused[0].shape))
    monkeypatch.setattr(fuser_mod, "FORWARD_FUSIONS", ())
    unfused = _run(twin, x, residual.clone().requires_grad_(True))
    assert _equal(fused[1], unfused[1])
    for name, grad in fused[2].items():
        assert _equal(grad, unfused[2][name]), name


def _func_blocks():
    dense = te.ops.Sequential(
        te.ops.Linear(16, 32), te.ops.SwiGLU(), te.ops.Linear(16, 16), te.ops.AddExtraInput()
    )
    grouped = te.ops.Sequential(
        te.ops.GroupedLinear(2, 16, 32), te.ops.ScaledSwiGLU(), te.ops.GroupedLinear(2, 16, 16)
    )
    return [(dense, (torch.randn(16, 16),)), (grouped, ([16, 0], torch.rand(16), [16, 0]))]


@pytest.mark.parametrize("which", [0, 1], ids=["dense", "grouped"])
def test_torch_func_grad_equals_autograd(which):
    """torch.func.grad through functional_call (the parameters swapped for others, also those
    te.ops.Linear hands to its ops) gives autograd's gradients, bit for bit."""
    block, extra = _func_blocks()[which]
    params = {n: p.detach().clone() for n, p in block.named_parameters()}
    x = torch.randn(16, 16)

    def loss(p, x):
        return torch.func.functional_call(block, p, (x, *extra)).square().sum()

    got = torch.func.grad(loss, argnums=(0, 1))(params, x)
    leaves = {n: p.clone().requires_grad_(True) for n, p in params.items()}
    x_leaf = x.clone().requires_grad_(True)
    loss(leaves, x_leaf).backward()
    assert torch.equal(got[1], x_leaf.grad)
    for name, leaf in leaves.items():
        assert torch.equal(got[0][name], leaf.grad), name
    assert all(p.grad is None for p in block.parameters())  # the module's own are untouched
    with (
        te.autocast(recipe=recipe.Float8CurrentScaling()),
        pytest.raises(NotImplementedError, match="high precision only"),
    ):
        torch.func.grad(loss)(params, x)
