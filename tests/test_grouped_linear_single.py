"""te.GroupedLinear(single_grouped_weight=True / single_grouped_bias=True): one `weight`
(G, N, K) and one `bias` (G, N) parameter against the per-group layout (weight0.., bias0..)
holding the same values: the same initialization for a seed, and output, input gradient and
parameter gradients (stacked) bit for bit in every path (per group, FP8, the grouped GEMM path
forced on), with fused wgrad accumulation into a (G, N, K) main_grad, tensor parallelism, and
state_dicts that load across the two layouts.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ranks import on_ranks
from tolerances import representable

import torchte as te
from torchte.module import grouped_linear as grouped_module
from torchte.recipe import DelayedScaling, Float8CurrentScaling

pytestmark = pytest.mark.usefixtures("cpu_default_device")

K, N = 32, 48
RECIPES = {
    "hp": None,
    "delayed": DelayedScaling(amax_history_len=4),
    "current": Float8CurrentScaling(),
}
LAYOUTS = [(True, True), (True, False), (False, True)]


def make_layouts(num_gemms, dtype, single_weight, single_bias, seed=5, out=N, **kwargs):
    """(the module with the single parameters asked for, the per-group module), built from
    one seed (so initialized alike), biases set to nonzero representable values."""
    torch.manual_seed(seed)
    single = te.GroupedLinear(
        num_gemms, K, out, params_dtype=dtype, single_grouped_weight=single_weight,
        single_grouped_bias=single_bias, **kwargs,
    )  # fmt: skip
    torch.manual_seed(seed)
    per_group = te.GroupedLinear(num_gemms, K, out, params_dtype=dtype, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for g in range(num_gemms):
            b = representable(per_group.out_features, torch.bfloat16, generator=gen).to(dtype)
            getattr(per_group, f"bias{g}").copy_(b)
            (single.bias[g] if single_bias else getattr(single, f"bias{g}")).copy_(b)
    return single, per_group


def stacked(module, kind: str, attr: str = "grad"):
    """The G per-group values of `kind` ("weight"/"bias") stacked, whichever layout: the
    parameter's `attr` (grad, main_grad) or the parameter itself (attr None)."""
    p = dict(module.named_parameters())
    if kind in p:
        return p[kind] if attr is None else getattr(p[kind], attr)
    parts = [p[f"{kind}{g}"] for g in range(module.num_gemms)]
    return torch.stack([part if attr is None else getattr(part, attr) for part in parts])


def run(module, x, dy, splits, fp8_recipe, **kwargs):
    """(y, dx, weight grads (G, N, K), bias grads (G, N)) of one step."""
    for p in module.parameters():
        p.grad = None
    x = x.clone().requires_grad_()
    with te.autocast(enabled=fp8_recipe is not None, recipe=fp8_recipe):
        y = module(x, splits, **kwargs)
    y.backward(dy)
    return y.detach(), x.grad, stacked(module, "weight"), stacked(module, "bias")


def assert_same_steps(single, per_group, splits, fp8_recipe, dtype, steps=3):
    rows, device = sum(splits), single.device
    for step in range(steps):
        x = representable((rows, K), torch.bfloat16, device=device).to(dtype)
        dy = representable((rows, N), torch.bfloat16, scale=0.25, device=device).to(dtype)
        got = run(single, x, dy, splits, fp8_recipe)
        want = run(per_group, x, dy, splits, fp8_recipe)
        for name, a, b in zip(("y", "dx", "dw", "db"), got, want, strict=True):
            assert torch.equal(a, b), f"step {step}: {name} differs"


@pytest.mark.parametrize("single_weight,single_bias", LAYOUTS)
def test_parameters_and_initialization(single_weight, single_bias):
    single, per_group = make_layouts(3, torch.float32, single_weight, single_bias)
    names = [n for n, _ in single.named_parameters()]
    assert ("weight" in names) == single_weight and ("bias" in names) == single_bias
    assert ("weight0" in names) != single_weight and ("bias0" in names) != single_bias
    if single_weight:
        assert single.weight.shape == (3, N, K)
    if single_bias:
        assert single.bias.shape == (3, N)
    assert torch.equal(stacked(single, "weight", None), stacked(per_group, "weight", None))
    assert set(single.state_dict()) == set(names) | {"_extra_state"}
    torch.manual_seed(9)
    single.reset_parameters()
    torch.manual_seed(9)
    per_group.reset_parameters()
    assert torch.equal(stacked(single, "weight", None), stacked(per_group, "weight", None))
    assert not stacked(single, "bias", None).any()  # biases reset to zero
    if single_weight:
        assert single.weight.std() > 0.01  # drawn, not left empty


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("single_weight,single_bias", LAYOUTS)
def test_equals_per_group_layout(recipe_name, dtype, single_weight, single_bias):
    single, per_group = make_layouts(4, dtype, single_weight, single_bias)
    assert_same_steps(single, per_group, [5, 0, 11, 3], RECIPES[recipe_name], dtype)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="needs torch._grouped_mm")
def test_grouped_gemm_path(monkeypatch):
    """bf16 through torch._grouped_mm (forced on; off by default on the CPU): the single weight
    is read in place and its gradient comes out of the grouped wgrad's one buffer."""
    monkeypatch.setattr(grouped_module, "grouped_mm_supported", lambda *args: True)
    single, per_group = make_layouts(4, torch.bfloat16, True, True)
    assert single._plan(torch.bfloat16, None, False, False).mode == "grouped"
    assert_same_steps(single, per_group, [5, 0, 11, 3], None, torch.bfloat16, steps=1)


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_main_grad_accumulation(recipe_name):
    """fuse_wgrad_accumulation: GEMM g's gradient goes into slice g of the single weight's
    main_grad (G, N, K), overwritten on the first microbatch, as the per-group weights'."""
    splits, fp8_recipe = [6, 0, 3], RECIPES[recipe_name]
    single, per_group = make_layouts(3, torch.float32, True, True, fuse_wgrad_accumulation=True)
    weights = [single.weight] + [getattr(per_group, f"weight{g}") for g in range(3)]
    for w in weights:
        w.main_grad = torch.full(w.shape, 0.5)
        w.grad_added_to_main_grad = False
    for first in (True, False, False):
        x = representable((sum(splits), K), torch.bfloat16)
        dy = representable((sum(splits), N), torch.bfloat16, scale=0.25)
        got = run(single, x, dy, splits, fp8_recipe, is_first_microbatch=first)
        want = run(per_group, x, dy, splits, fp8_recipe, is_first_microbatch=first)
        assert all(torch.equal(a, b) for a, b in zip(got[:2], want[:2], strict=True))
    assert torch.equal(single.weight.main_grad, stacked(per_group, "weight", "main_grad"))
    assert not single.weight.main_grad[1].any()  # overwritten, then + 0 (no rows)
    assert single.weight.grad_added_to_main_grad
    assert single.weight.grad.shape == (3, N, K)  # the dummy gradient Megatron ignores


def test_main_grad_of_the_wrong_shape():
    single, _ = make_layouts(3, torch.float32, True, True, fuse_wgrad_accumulation=True)
    single.weight.main_grad = torch.zeros(N, K)
    y = single(torch.randn(4, K), [2, 2, 0])
    with pytest.raises(RuntimeError, match=r"main_grad.*\(3, 48, 32\)"):
        y.sum().backward()


@pytest.mark.parametrize("single_bias", [True, False])
def test_return_bias(single_bias):
    single, _ = make_layouts(3, torch.float32, True, single_bias, return_bias=True)
    x = torch.randn(6, K)
    y, bias = single(x, [2, 4, 0])
    if single_bias:
        assert torch.equal(bias, single.bias)
    else:
        assert isinstance(bias, list) and torch.equal(bias[1], single.bias1)
    assert torch.equal(y[2:], x[2:] @ single.weight[1].t())  # the bias is not added


@pytest.mark.parametrize("single_weight,single_bias", LAYOUTS)
def test_state_dicts_load_across_layouts(single_weight, single_bias):
    single, per_group = make_layouts(3, torch.float32, single_weight, single_bias)
    fresh_single, fresh_per_group = make_layouts(
        3, torch.float32, single_weight, single_bias, seed=11
    )
    fresh_single.load_state_dict(per_group.state_dict())  # strict: nothing missing or extra
    fresh_per_group.load_state_dict(single.state_dict())
    for kind in ("weight", "bias"):
        want = stacked(per_group, kind, None)
        assert torch.equal(stacked(fresh_single, kind, None), want)
        assert torch.equal(stacked(fresh_per_group, kind, None), want)
    both = {**single.state_dict(), **per_group.state_dict()}  # both layouts: this one's wins
    fresh_single.load_state_dict(both)
    x = torch.randn(7, K)
    assert torch.equal(fresh_single(x, [2, 2, 3]), single(x, [2, 2, 3]))


def test_no_grad_and_split_tensor():
    single, per_group = make_layouts(3, torch.float32, True, True)
    x = torch.randn(9, K)
    with torch.no_grad():
        y = single(x, torch.tensor([4, 0, 5]))
    assert not y.requires_grad and torch.equal(y, per_group(x, [4, 0, 5]).detach())


def test_arguments():
    with pytest.raises(TypeError, match="single_grouped_weight must be a bool"):
        te.GroupedLinear(2, K, N, single_grouped_weight="yes")
    with pytest.raises(TypeError, match="use_grouped_tensor must be a bool or None"):
        te.GroupedLinear(2, K, N, use_grouped_tensor=1)
    layer = te.GroupedLinear(2, K, N, single_grouped_weight=True, use_grouped_tensor=True)
    assert layer.use_grouped_tensor and "single_grouped_weight=True" in repr(layer)
    no_bias = te.GroupedLinear(2, K, N, bias=False, single_grouped_bias=True)
    assert no_bias.bias is None and not any("bias" in n for n, _ in no_bias.named_parameters())
    with (
        pytest.raises(NotImplementedError, match=r"single_grouped_weight=True.*quantized_model"),
        te.quantized_model_init(),
    ):
        te.GroupedLinear(2, K, N, single_grouped_weight=True)


def _tensor_parallel_rank(rank: int) -> list[str]:
    """Per mode and precision, the single layout against the per-group one on the same rank
    (both split the same way): the names of the results that differ."""
    failures = []
    with torch.device("cpu"):
        for mode in ("column", "row"):
            failures += _tensor_parallel_mode(rank, mode)
    return failures


def _tensor_parallel_mode(rank: int, mode: str) -> list[str]:
    failures = []
    out = 2 * N // 3  # 32 columns on a rank: FP8 GEMMs need multiples of 16
    x_width, y_width = (K, out // 2) if mode == "column" else (K // 2, out)
    for name in ("hp", "current"):
        tp = {"parallel_mode": mode, "tp_group": dist.group.WORLD}
        single, per_group = make_layouts(3, torch.float32, True, True, out=out, **tp)
        if single.weight.shape != (3, *per_group.weight0.shape):
            failures.append(f"{mode} weight shape {tuple(single.weight.shape)}")
        if single.weight.partition_dim != (1 if mode == "row" else 0):
            failures.append(f"{mode} partition_dim")
        torch.manual_seed(rank)
        x = representable((9, x_width), torch.bfloat16)
        dy = representable((9, y_width), torch.bfloat16, scale=0.25)
        got = run(single, x, dy, [4, 0, 5], RECIPES[name])
        want = run(per_group, x, dy, [4, 0, 5], RECIPES[name])
        for what, a, b in zip(("y", "dx", "dw", "db"), got, want, strict=True):
            if not torch.equal(a, b):
                failures.append(f"{mode} {name} {what}")
    return failures


def test_tensor_parallel(tmp_path):
    for failures in on_ranks(_tensor_parallel_rank, 2, tmp_path):
        assert failures == []
