"""te.ops for mixture-of-experts: GroupedLinear, the scaled activations and the fused grouped MLP.

te.ops.GroupedLinear shares te.GroupedLinear's GEMM code, so the two agree bit for bit in every
recipe. The scaled activations are held to an fp64 reference. The grouped MLP, fused under FP8
(the scaled activation writes the second GEMM's FP8 input), agrees bit for bit with the same
ops run one by one, and with te.Linear -> scaled activation -> te.Linear per expert.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_offload import offloaded_tensors
from tolerances import assert_close, representable

import torchte as te
from torchte import recipe
from torchte.offload import SynchronousCopies

RECIPES = {
    "bf16": None,
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "current": lambda: recipe.Float8CurrentScaling(),
}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
SPLITS = [16, 0, 48, 32]  # an expert without tokens among them
pytestmark = pytest.mark.usefixtures("cpu_default_device")


def _fp8(name):
    make = RECIPES[name]
    return te.autocast(enabled=make is not None, recipe=make() if make else None)


def _equal(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def _grads(module) -> dict:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _data(tokens, features, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = representable((tokens, features), torch.bfloat16, generator=gen, device=device)
    probs = representable(tokens, torch.bfloat16, generator=gen, device=device).abs()
    return x.to(torch.bfloat16), probs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("bias", [True, False])
def test_grouped_linear_op_equals_te_grouped_linear_bit_for_bit(device, recipe_name, bias):
    groups, k, n = len(SPLITS), 64, 32
    op = te.ops.GroupedLinear(groups, k, n, bias=bias, device=device, dtype=torch.bfloat16)
    module = te.GroupedLinear(groups, k, n, bias=bias, device=device, params_dtype=torch.bfloat16)
    with torch.no_grad():
        for name, param in module.named_parameters():
            value = representable(param.shape, torch.bfloat16, scale=0.125)
            param.copy_(value)
            op.get_parameter(name).copy_(value)
    x, _ = _data(sum(SPLITS), k, device)
    dy = representable((sum(SPLITS), n), torch.bfloat16, device=device).to(torch.bfloat16)
    for step in range(2):  # the second step runs on updated delayed scales
        outs = []
        for layer in (op, module):
            xi = x.clone().requires_grad_(True)
            with _fp8(recipe_name):
                y = layer(xi, SPLITS)
            y.backward(dy)
            outs.append((y.detach(), xi.grad, _grads(layer)))
            layer.zero_grad(set_to_none=True)
        (y_op, dx_op, g_op), (y_te, dx_te, g_te) = outs
        assert _equal(y_op, y_te) and _equal(dx_op, dx_te), (step, recipe_name)
        assert g_op.keys() == g_te.keys()
        for name in g_te:
            assert _equal(g_op[name], g_te[name]), (step, name)


def test_grouped_linear_op_splits_as_tensor_and_names():
    op = te.ops.GroupedLinear(3, 16, 8)
    assert [n for n, _ in op.named_parameters()] == [
        "weight0", "weight1", "weight2", "bias0", "bias1", "bias2",
    ]  # fmt: skip
    x = torch.randn(10, 16)
    y_list = op(x, [3, 0, 7])
    y_tensor = op(x, torch.tensor([3, 0, 7]))
    assert _equal(y_list, y_tensor)
    assert _equal(y_list[3:], x[3:] @ op.weight2.t() + op.bias2)


def test_grouped_linear_op_main_grad():
    op = te.ops.GroupedLinear(2, 16, 8, bias=False, accumulate_into_main_grad=True)
    for g in range(2):
        op.get_parameter(f"weight{g}").main_grad = torch.zeros(8, 16)
    x = torch.randn(6, 16)
    for _ in range(2):
        op(x, [2, 4]).sum().backward()
    assert_close(op.weight0.main_grad, 2 * torch.ones(2, 8).t() @ x[:2], torch.float32)
    assert_close(op.weight1.main_grad, 2 * torch.ones(4, 8).t() @ x[2:], torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_linear_op_scale_bias_matches_fp64_reference(device):
    """scale_bias: y = x W_g^T + s b_g, with the gradients of x, W, b and s."""
    op = te.ops.GroupedLinear(4, 32, 16, scale_bias=True, device=device)
    assert op.num_extra_inputs == 2
    with torch.no_grad():
        for param in op.parameters():
            param.copy_(representable(param.shape, torch.float32, scale=0.5))
    x = representable((sum(SPLITS), 32), torch.float32, device=device).requires_grad_(True)
    s = representable(sum(SPLITS), torch.float32, device=device).requires_grad_(True)
    y = op(x, SPLITS, s)
    dy = representable(y.shape, torch.float32, device=device)
    y.backward(dy)
    x64, s64 = x.detach().double().requires_grad_(True), s.detach().double().requires_grad_(True)
    params64 = {n: p.detach().double().requires_grad_(True) for n, p in op.named_parameters()}
    parts, start = [], 0
    for g, rows in enumerate(SPLITS):
        xg, sg = x64[start : start + rows], s64[start : start + rows]
        parts.append(xg @ params64[f"weight{g}"].t() + sg[:, None] * params64[f"bias{g}"])
        start += rows
    y64 = torch.cat(parts)
    y64.backward(dy.double())
    assert_close(y, y64, torch.float32)
    assert_close(x.grad, x64.grad, torch.float32)
    assert_close(s.grad, s64.grad, torch.float32)
    for name, param in op.named_parameters():
        assert_close(param.grad, params64[name].grad, torch.float32)


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_grouped_mlp_main_grad_fused_equals_one_by_one(recipe_name):
    """accumulate_into_main_grad (Megatron-style): the grouped MLP still fuses under FP8, and
    each expert's main_grad equals the ops one by one, over two accumulating steps."""
    mlp = te.ops.Sequential(
        te.ops.GroupedLinear(4, 64, 64, bias=False, dtype=torch.bfloat16,
                             accumulate_into_main_grad=True),
        te.ops.ScaledSwiGLU(),
        te.ops.GroupedLinear(4, 32, 64, bias=False, dtype=torch.bfloat16,
                             accumulate_into_main_grad=True),
    )  # fmt: skip
    twin = copy.deepcopy(mlp)
    for module in (mlp, twin):
        for op in (module[0], module[2]):  # one grouped main_grad buffer, viewed per expert
            buffer = torch.zeros(op.num_groups, op.out_features, op.in_features)
            for g in range(op.num_groups):
                op.get_parameter(f"weight{g}").main_grad = buffer[g]
    x, probs = _data(sum(SPLITS), 64, "cpu")
    dy = representable((sum(SPLITS), 64), torch.bfloat16).to(torch.bfloat16)
    for _ in range(2):
        with _fp8(recipe_name):
            y_fused = mlp(x, SPLITS, probs, SPLITS)
            h = twin[0](x, SPLITS)
            y_one = twin[2](twin[1](h, probs), SPLITS)
        y_fused.backward(dy)
        y_one.backward(dy)
    assert _forward_ops(mlp) == ["GroupedMLP"] and _forward_ops(mlp, "backward") == ["GroupedMLP"]
    assert _equal(y_fused.detach(), y_one.detach())
    for (name, a), b in zip(mlp.named_parameters(), twin.parameters(), strict=True):
        assert a.main_grad.any() or name.endswith("1"), name  # expert 1 has no tokens
        assert _equal(a.main_grad, b.main_grad), name


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_grouped_mlp_takes_leading_dims_and_device_splits(recipe_name):
    """x (B, S, H) with probabilities (B, S), and the split sizes as a tensor: the fused MLP
    equals the ops one by one."""
    fused = _mlp("cpu")
    twin = copy.deepcopy(fused)
    x, probs = _data(sum(SPLITS), 64, "cpu")
    x3, p3 = x.view(6, 16, 64), probs.view(6, 16)
    splits = torch.tensor(SPLITS)

    def run_fused(x, p):
        return fused(x, splits, p, splits)

    def run_one_by_one(x, p):
        return twin[2](twin[1](twin[0](x, splits), p), splits)

    got = _train_step(run_fused, x3, p3, fused, recipe_name)
    want = _train_step(run_one_by_one, x3, p3, twin, recipe_name)
    assert _forward_ops(fused) == ["GroupedMLP"] and got[0].shape == (6, 16, 64)
    for a, b in zip(got[:3], want[:3], strict=True):
        assert _equal(a, b)
    for name in want[3]:
        assert _equal(got[3][name], want[3][name]), name


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_grouped_mlp_only_probabilities_want_gradients(recipe_name):
    """FC1 frozen and x without gradient: the fused backward has nothing to quantize and runs
    the activation's and FC1's own backwards; d(probs) equals the ops one by one."""
    fused = _mlp("cpu")
    for param in fused[0].parameters():
        param.requires_grad_(False)
    twin = copy.deepcopy(fused)
    x, probs = _data(sum(SPLITS), 64, "cpu")
    grads = []
    for run in (
        lambda p: fused(x, SPLITS, p, SPLITS),
        lambda p: twin[2](twin[1](twin[0](x, SPLITS), p), SPLITS),
    ):
        p = probs.clone().requires_grad_(True)
        with _fp8(recipe_name):
            y = run(p)
        y.float().square().sum().backward()
        grads.append(p.grad)
    assert _forward_ops(fused, "backward") == ["GroupedMLP"]
    assert grads[0].any() and _equal(grads[0], grads[1])


SCALED = ["ScaledSwiGLU", "ScaledGEGLU", "ScaledGLU", "ScaledReGLU", "ScaledSReGLU", "ScaledGELU"]


def _act_fp64(name, h):
    gelu = lambda v: F.gelu(v, approximate="tanh")  # noqa: E731
    acts = {
        "ScaledSwiGLU": (F.silu, True),
        "ScaledGEGLU": (gelu, True),
        "ScaledGLU": (torch.sigmoid, True),  # the sigmoid of the first half, as in TE
        "ScaledReGLU": (F.relu, True),
        "ScaledSReGLU": (lambda v: F.relu(v) ** 2, True),
        "ScaledGELU": (gelu, False),
    }
    fn, gated = acts[name]
    if gated:
        half = h.shape[-1] // 2
        return fn(h[..., :half]) * h[..., half:]
    return fn(h)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", SCALED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_activation_matches_fp64_reference(device, name, dtype):
    op = getattr(te.ops, name)(device=device)
    h = representable((3, 5, 64), torch.bfloat16, scale=2.0, device=device).to(dtype)
    s = representable((3, 5), torch.bfloat16, device=device).to(dtype)
    h.requires_grad_(True), s.requires_grad_(True)
    y = op(h, s)  # an op without parameters computes in its input's dtype
    dy = representable(y.shape, torch.bfloat16, device=device).to(dtype)
    y.backward(dy)
    h64 = h.detach().double().requires_grad_(True)
    s64 = s.detach().double().requires_grad_(True)
    y64 = _act_fp64(name, h64) * s64[..., None]
    y64.backward(dy.double())
    assert y.dtype == dtype and s.grad.shape == s.shape
    assert_close(y, y64, dtype)
    assert_close(h.grad, h64.grad, dtype)
    # ds sums a row of products: its error grows with the row, not with the result
    rtol = 4 * torch.finfo(dtype).eps * (dy.abs() * y64.detach().abs()).sum(-1).max().item()
    assert (s.grad.double().cpu() - s64.grad.cpu()).abs().max().item() <= rtol + 1e-5


def test_scaled_activation_refuses_bad_scales():
    op = te.ops.ScaledSwiGLU()
    with pytest.raises(ValueError, match="one scale per row"):
        op(torch.randn(4, 8), torch.randn(3))
    with pytest.raises(TypeError, match="floating-point"):
        op(torch.randn(4, 8), [1.0] * 4)
    with pytest.raises(ValueError, match="takes 1 extra input"):
        op(torch.randn(4, 8))
    with pytest.raises(TypeError, match="gate_interleave_size"):  # glu_interleave_size, as TE
        te.ops.ScaledSwiGLU(gate_interleave_size=32)


def _mlp(device, bias=False, groups=4, hidden=64, ffn=32, act="ScaledSwiGLU", dtype=None):
    kw = {"device": device, "dtype": dtype or torch.bfloat16, "bias": bias}
    gated = act.endswith("GLU")
    mlp = te.ops.Sequential(
        te.ops.GroupedLinear(groups, hidden, 2 * ffn if gated else ffn, **kw),
        getattr(te.ops, act)(device=device),
        te.ops.GroupedLinear(groups, ffn, hidden, **kw),
    )
    with torch.no_grad():
        for param in mlp.parameters():
            param.copy_(representable(param.shape, torch.bfloat16, scale=0.125))
    return mlp


def _train_step(run, x, probs, mlp, recipe_name, dy_seed=7):
    """(y, dx, dprobs, parameter grads) of one forward and backward; run(x, probs) -> y."""
    x = x.clone().requires_grad_(True)
    probs = probs.clone().requires_grad_(True)
    with _fp8(recipe_name):
        y = run(x, probs)
    dy = representable(y.shape, torch.bfloat16, generator=torch.Generator().manual_seed(dy_seed))
    y.backward(dy.to(y.device, y.dtype))
    out = (y.detach(), x.grad, probs.grad, _grads(mlp))
    mlp.zero_grad(set_to_none=True)
    return out


def _forward_ops(mlp, direction="forward") -> list[str]:
    pipelines = mlp._stages[0]._pipelines.values()
    return [type(op).__name__ for op, _ in getattr(list(pipelines)[-1], direction)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize(
    ("act", "bias", "dtype"),
    [
        ("ScaledSwiGLU", False, torch.bfloat16),
        ("SwiGLU", False, torch.bfloat16),
        ("ScaledGELU", True, torch.bfloat16),
        ("ScaledGLU", False, torch.bfloat16),
        ("ScaledSwiGLU", True, torch.float32),
    ],
)
def test_grouped_mlp_fused_equals_ops_one_by_one(device, recipe_name, act, bias, dtype):
    ffn = 64 if act == "ScaledGELU" else 32
    fused = _mlp(device, act=act, bias=bias, ffn=ffn, dtype=dtype)
    twin = copy.deepcopy(fused)  # the same weights and fresh scaling state
    scaled = act.startswith("Scaled")
    x, probs = _data(sum(SPLITS), 64, device)
    x = x.to(dtype)

    def run_fused(x, p):
        return fused(x, SPLITS, p, SPLITS) if scaled else fused(x, SPLITS, SPLITS)

    def run_one_by_one(x, p):
        h = twin[0](x, SPLITS)
        a = twin[1](h, p) if scaled else twin[1](h)
        return twin[2](a, SPLITS)

    for step in range(2):
        got = _train_step(run_fused, x, probs, fused, recipe_name)
        want = _train_step(run_one_by_one, x, probs, twin, recipe_name)
        assert _forward_ops(fused) == ["GroupedMLP"]
        assert _forward_ops(fused, "backward") == ["GroupedMLP"]
        for a, b in zip(got[:2], want[:2], strict=True):
            assert _equal(a, b), step
        if scaled and device == "cpu":
            assert _equal(got[2], want[2]), step
        elif scaled:  # the fused kernel sums d(scales) in another order
            assert_close(got[2], want[2], torch.float32)
        assert got[3].keys() == want[3].keys()
        for name in want[3]:
            if device == "cuda" and "bias" in name:  # the fused kernel sums dh in fp32 tiles
                assert_close(got[3][name], want[3][name], dtype)
            else:
                assert _equal(got[3][name], want[3][name]), (step, name)
    if recipe_name == "delayed":
        for op, op_twin in zip(fused, twin, strict=True):
            if not op.num_gemms:
                continue
            states = zip(op._delayed_states[4], op_twin._delayed_states[4], strict=True)
            for state, state_twin in states:
                assert _equal(state.amax_history, state_twin.amax_history)
                assert _equal(state.scale, state_twin.scale)


@pytest.mark.parametrize("recipe_name", ["bf16", "delayed", "current"])
def test_grouped_mlp_equals_te_linear_per_expert(recipe_name):
    """The fused grouped MLP against te.Linear -> scaled SwiGLU -> te.Linear per expert on the
    same weights: bit for bit (current scaling quantizes each expert with its own amax, as a
    te.Linear per expert does)."""
    mlp = _mlp("cpu")
    fc1, fc2 = mlp[0], mlp[2]
    experts = []
    for g in range(len(SPLITS)):
        first = te.Linear(64, 64, bias=False, params_dtype=torch.bfloat16)
        second = te.Linear(32, 64, bias=False, params_dtype=torch.bfloat16)
        with torch.no_grad():
            first.weight.copy_(fc1.get_parameter(f"weight{g}"))
            second.weight.copy_(fc2.get_parameter(f"weight{g}"))
        experts.append((first, second))
    x, probs = _data(sum(SPLITS), 64, "cpu")
    got = _train_step(lambda x, p: mlp(x, SPLITS, p, SPLITS), x, probs, mlp, recipe_name)
    if recipe_name != "bf16":
        assert _forward_ops(mlp) == ["GroupedMLP"]

    def per_expert(x, p):
        outs = []
        for (first, second), xg, pg in zip(experts, x.split(SPLITS), p.split(SPLITS), strict=True):
            if xg.shape[0]:
                outs.append(second(te.ops.ScaledSwiGLU()(first(xg), pg)))
        return torch.cat(outs)

    holder = torch.nn.ModuleList([m for pair in experts for m in pair])
    want = _train_step(per_expert, x, probs, holder, recipe_name)
    for a, b in zip(got[:3], want[:3], strict=True):
        assert _equal(a, b)
    for g in range(len(experts)):
        for fc, index in (("0", 2 * g), ("2", 2 * g + 1)):
            grad = got[3][f"{fc}.weight{g}"]
            if SPLITS[g]:
                assert _equal(grad, want[3][f"{index}.weight"]), (fc, g)
            else:  # an expert without tokens: zero gradients
                assert not grad.any() and f"{index}.weight" not in want[3]


def test_grouped_mlp_bad_input_is_refused_before_any_kernel(monkeypatch):
    mlp = _mlp("cpu")
    x, probs = _data(sum(SPLITS), 64, "cpu")
    calls = []
    monkeypatch.setattr(  # any GEMM of the grouped ops would go through here
        "torchte.ops.basic.grouped_linear.grouped_linear_forward", lambda *a: calls.append(a)
    )
    with te.autocast(recipe=recipe.Float8CurrentScaling()):
        with pytest.raises(ValueError, match="entries, but the layer has 4"):
            mlp(x, SPLITS[:3], probs, SPLITS)
        with pytest.raises(ValueError, match=r"negative|>= 0|non-negative"):
            mlp(x, [16, -16, 64, 32], probs, SPLITS)
        with pytest.raises(ValueError, match="sum"):
            mlp(x, [16, 0, 48, 31], probs, SPLITS)
        with pytest.raises(ValueError, match="takes 3 extra input"):
            mlp(x, SPLITS, probs)
        with pytest.raises(ValueError, match="one scale per row"):
            mlp(x, SPLITS, probs[:-1], SPLITS)
    assert not calls
    odd = te.ops.Sequential(te.ops.GroupedLinear(2, 24, 16), te.ops.GELU())
    with te.autocast(recipe=recipe.DelayedScaling()), pytest.raises(ValueError, match="by 16"):
        odd(torch.randn(4, 24), [2, 2])
    with pytest.raises(ValueError, match=r"op 2 \(GroupedLinear\) takes 48 features"):
        te.ops.Sequential(te.ops.GroupedLinear(2, 8, 64), te.ops.SwiGLU(),
                          te.ops.GroupedLinear(2, 48, 8))  # fmt: skip
    assert te.ops.GroupedLinear(2, 8, 8, delay_wgrad_compute=True).delay_wgrad_compute
    qat = te.autocast(recipe=recipe.MXFP4QATMXFP8BlockScaling())
    with pytest.raises(NotImplementedError, match="MXFP4QATMXFP8BlockScaling"), qat:
        mlp(x, SPLITS, probs, SPLITS)


class _Counting(SynchronousCopies):
    """SynchronousCopies recording the tensors it moved out."""

    def __init__(self) -> None:
        super().__init__()
        self.moved: list[torch.Tensor] = []

    def to_host(self, tensor, host):
        self.moved.append(tensor)
        return super().to_host(tensor, host)


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_grouped_mlp_offloaded_equals_kept_bit_for_bit(recipe_name):
    """CPU offloading of everything the fused ops save (GroupedStorages component by
    component): the same gradients, FP8 bytes among what moved, each tensor moved once, and
    nothing left behind."""
    blocks, twins = [_mlp("cpu", bias=True) for _ in range(3)], []
    for block in blocks:
        twins.append(copy.deepcopy(block))
    copies = _Counting()
    context, sync = te.get_cpu_offload_context(
        enabled=True, num_layers=2, model_layers=3, min_offload_bytes=0, copies=copies
    )
    offloaded = offloaded_tensors(context.handler)
    x, probs = _data(sum(SPLITS), 64, "cpu")

    def run(layers, offload: bool):
        h = x.clone().requires_grad_(True)
        out = h
        with _fp8(recipe_name):
            for layer in layers:
                if offload:
                    with context:
                        out = layer(out, SPLITS, probs, SPLITS)
                    out = sync(out)
                else:
                    out = layer(out, SPLITS, probs, SPLITS)
        out.float().square().mean().backward()
        grads = [h.grad] + [p.grad for layer in layers for p in layer.parameters()]
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        return grads

    for step in range(2):
        copies.moved.clear()
        offloaded.clear()
        got, want = run(blocks, True), run(twins, False)
        for a, b in zip(got, want, strict=True):
            assert (a is None) == (b is None) and (a is None or _equal(a, b)), step
        assert copies.moved, "nothing was offloaded"
        assert len({id(t) for t in copies.moved}) == len(copies.moved)  # each moved once
        if recipe_name != "bf16":
            fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
            assert any(dtype in fp8 for dtype, _ in offloaded), offloaded
        assert not any(context.handler.saved.values())  # every offloaded tensor came back


@pytest.mark.parametrize("recipe_name", ["bf16", "current"])
def test_grouped_ops_checkpointed_equal_kept(recipe_name):
    """torch.utils.checkpoint around the unfused grouped ops (te.autocast entered inside the
    checkpointed function, so the recompute runs under the same recipe) gives the same
    output and gradients."""
    mlp = _mlp("cpu", bias=True)
    fc1, act, fc2 = mlp
    x, probs = _data(sum(SPLITS), 64, "cpu")

    def block(x, p):
        with _fp8(recipe_name):
            return fc2(act(fc1(x, SPLITS), p), SPLITS)

    def checkpointed(x, p):
        return torch.utils.checkpoint.checkpoint(block, x, p, use_reentrant=False)

    want = _train_step(block, x, probs, mlp, "bf16")
    got = _train_step(checkpointed, x, probs, mlp, "bf16")
    for a, b in zip(got[:3], want[:3], strict=True):
        assert _equal(a, b)
    for name in want[3]:
        assert _equal(got[3][name], want[3][name]), name
