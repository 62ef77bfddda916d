"""te.GroupedLinear against a stack of te.Linear layers with the same weights.

On the CPU (and on a GPU outside the grouped-GEMM path) each group goes through te.Linear's own
forward and backward, so everything must be bit-identical: output, input grad, weight and bias
grads, main_grad, over several steps (delayed scaling's scales move between them). The grouped
path (torch._grouped_mm) is also run on the CPU here by forcing it on, against the stack within
bf16 tolerance.
"""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_close_to_scale, representable

import torchte as te
from torchte._group_splits import GroupSplits
from torchte.module import grouped_linear as grouped_module
from torchte.recipe import DelayedScaling, Float8CurrentScaling

pytestmark = pytest.mark.usefixtures("cpu_default_device")

K, N = 32, 48
RECIPES = {
    "hp": None,
    "delayed": DelayedScaling(amax_history_len=4),
    "current": Float8CurrentScaling(),
}
SPLITS = [[5, 0, 11, 3], [1], [0, 0, 7], [16, 16]]


def make_pair(num_gemms: int, dtype: torch.dtype, bias: bool = True, **kwargs):
    """A GroupedLinear and G te.Linear layers holding the same weights and biases."""
    grouped = te.GroupedLinear(num_gemms, K, N, bias=bias, params_dtype=dtype, **kwargs)
    stack = [te.Linear(K, N, bias=bias, params_dtype=dtype, **kwargs) for _ in range(num_gemms)]
    gen = torch.Generator(device="cpu").manual_seed(3)
    with torch.no_grad():
        for g, layer in enumerate(stack):
            w = representable((N, K), torch.bfloat16, scale=0.125, generator=gen, device="cpu")
            w = w.to(dtype)
            getattr(grouped, f"weight{g}").copy_(w)
            layer.weight.copy_(w)
            if bias:
                b = representable(N, torch.bfloat16, generator=gen, device="cpu").to(dtype)
                getattr(grouped, f"bias{g}").copy_(b)
                layer.bias.copy_(b)
    return grouped, stack


def run_both(grouped, stack, splits, fp8_recipe, dtype, steps: int = 3):
    """(grouped results, stack results) of `steps` forward+backward steps; each result is the
    list of (y, dx, weight grads, bias grads) per step."""
    results = ([], [])
    for _ in range(steps):
        device = grouped.device
        x = representable((sum(splits), K), torch.bfloat16, device=device).to(dtype)
        dy = representable((sum(splits), N), torch.bfloat16, scale=0.25, device=device).to(dtype)
        for which in (0, 1):
            params = list(grouped.parameters()) if which == 0 else [
                p for layer in stack for p in layer.parameters()
            ]  # fmt: skip
            for p in params:
                p.grad = None
            xi = x.clone().requires_grad_()
            with te.autocast(enabled=fp8_recipe is not None, recipe=fp8_recipe):
                if which == 0:
                    y = grouped(xi, splits)
                else:
                    parts = xi.split(splits)
                    y = torch.cat([layer(part) for layer, part in zip(stack, parts, strict=True)])
            y.backward(dy)
            weights = [p.grad for name, p in _named(grouped, stack, which) if "weight" in name]
            biases = [p.grad for name, p in _named(grouped, stack, which) if "bias" in name]
            results[which].append((y.detach(), xi.grad, weights, biases))
    return results


def _named(grouped, stack, which):
    if which == 0:
        return list(grouped.named_parameters())
    return [(name, p) for layer in stack for name, p in layer.named_parameters()]


def assert_identical(a, b, what):
    assert len(a) == len(b), what
    for step, (ra, rb) in enumerate(zip(a, b, strict=True)):
        for name, va, vb in zip(("y", "dx", "dw", "db"), ra, rb, strict=True):
            va = va if isinstance(va, list) else [va]
            vb = vb if isinstance(vb, list) else [vb]
            for i, (ta, tb) in enumerate(zip(va, vb, strict=True)):
                assert torch.equal(ta, tb), f"{what}: step {step} {name}[{i}] differs"


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", SPLITS, ids=str)
def test_equals_stack_of_linear(recipe_name, dtype, splits):
    grouped, stack = make_pair(len(splits), dtype)
    with te.autocast(enabled=RECIPES[recipe_name] is not None, recipe=RECIPES[recipe_name]):
        mode = grouped._plan(dtype, None, False, False).mode
    assert mode == ("per_group" if recipe_name == "hp" else "fp8")
    a, b = run_both(grouped, stack, splits, RECIPES[recipe_name], dtype)
    assert_identical(a, b, f"{recipe_name} {dtype} {splits}")


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_without_bias_and_return_bias(recipe_name):
    grouped, stack = make_pair(3, torch.float32, bias=False)
    assert all(getattr(grouped, f"bias{g}") is None for g in range(3))
    a, b = run_both(grouped, stack, [4, 0, 9], RECIPES[recipe_name], torch.float32, steps=2)
    assert_identical(a, b, recipe_name)
    grouped = te.GroupedLinear(2, K, N, return_bias=True, params_dtype=torch.float32)
    with torch.no_grad():
        grouped.bias1.fill_(3.0)
    x = torch.randn(6, K)
    y, biases = grouped(x, [2, 4])
    assert len(biases) == 2 and torch.equal(biases[1], torch.full((N,), 3.0))
    assert torch.equal(y[2:], x[2:] @ grouped.weight1.t())  # the bias is not added


def test_weight_grads_share_one_buffer():
    grouped, _ = make_pair(4, torch.float32)
    x = torch.randn(10, K, requires_grad=True)
    grouped(x, [3, 0, 2, 5]).sum().backward()
    grads = [getattr(grouped, f"weight{g}").grad for g in range(4)]
    storage = grads[0].untyped_storage().data_ptr()
    assert all(g.untyped_storage().data_ptr() == storage for g in grads)
    assert torch.equal(grads[1], torch.zeros(N, K))  # the expert without tokens


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_main_grad_accumulation(recipe_name):
    splits = [6, 0, 3]
    grouped, stack = make_pair(3, torch.float32, fuse_wgrad_accumulation=True)
    fp8_recipe = RECIPES[recipe_name]
    with te.autocast(enabled=fp8_recipe is not None, recipe=fp8_recipe):
        mode = grouped._plan(torch.float32, None, False, False).mode
    assert mode == ("per_group" if fp8_recipe is None else "fp8")  # main_grad on either path
    weights = [getattr(grouped, f"weight{g}") for g in range(3)] + [s.weight for s in stack]
    for w in weights:
        w.main_grad = torch.full(w.shape, 0.5)
        w.grad_added_to_main_grad = False
    for first in (True, False, False):
        x = representable((sum(splits), K), torch.bfloat16).float()
        dy = representable((sum(splits), N), torch.bfloat16, scale=0.25).float()
        fp8 = RECIPES[recipe_name]
        with te.autocast(enabled=fp8 is not None, recipe=fp8):
            y_g = grouped(x, splits, is_first_microbatch=first)
            parts = x.split(splits)
            y_s = torch.cat(
                [s(p, is_first_microbatch=first) for s, p in zip(stack, parts, strict=True)]
            )
        y_g.backward(dy)
        y_s.backward(dy)
    for g in range(3):
        ref = stack[g].weight.main_grad
        assert torch.equal(weights[g].main_grad, ref), g
        assert weights[g].grad_added_to_main_grad
    assert torch.equal(weights[1].main_grad, torch.zeros(N, K))  # overwritten, then + 0


def test_state_dict_names_and_round_trip():
    grouped, _ = make_pair(3, torch.float32)
    names = set(grouped.state_dict())
    assert {f"weight{g}" for g in range(3)} | {f"bias{g}" for g in range(3)} <= names
    fresh = te.GroupedLinear(3, K, N, params_dtype=torch.float32)
    fresh.load_state_dict(grouped.state_dict())
    x = torch.randn(7, K)
    assert torch.equal(fresh(x, [2, 2, 3]), grouped(x, [2, 2, 3]))


def test_no_grad_forward_and_split_tensor():
    grouped, _ = make_pair(3, torch.float32)
    x = torch.randn(9, K)
    with torch.no_grad():
        y = grouped(x, [4, 0, 5])
    assert not y.requires_grad
    assert torch.equal(y, grouped(x, torch.tensor([4, 0, 5])).detach())
    y3 = grouped(x.view(3, 3, K), [4, 0, 5])
    assert y3.shape == (3, 3, N) and torch.equal(y3.reshape(9, N).detach(), y)


@pytest.mark.parametrize(
    "splits,error,match",
    [
        ([4, 4], ValueError, "2 entries"),
        ([4, 4, 2], ValueError, "sum to 10"),
        ([10, -1, 0], ValueError, "negative"),
        ([4.0, 4, 1], TypeError, "list of ints"),
        (torch.tensor([4.0, 4.0, 1.0]), TypeError, "integer tensor"),
    ],
)
def test_bad_splits(splits, error, match):
    grouped, _ = make_pair(3, torch.float32)
    with pytest.raises(error, match=match):
        grouped(torch.randn(9, K), splits)


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_gemms"):
        te.GroupedLinear(0, K, N)
    with pytest.raises(TypeError, match="unexpected keyword"):
        te.GroupedLinear(2, K, N, bogus=True)
    grouped = te.GroupedLinear(2, 20, N, params_dtype=torch.float32)
    with pytest.raises(ValueError, match="divisible by 16"), te.autocast(recipe=DelayedScaling()):
        grouped(torch.randn(4, 20), [2, 2])
    with pytest.raises(ValueError, match="in_features is 20"):
        grouped(torch.randn(4, 21), [2, 2])
    y = grouped(torch.randn(4, 20), [2, 2])  # nothing was left half-done by the failures
    assert y.shape == (4, N)


def test_split_tensors_on_the_device_side():
    """GroupSplits built from a tensor computes offsets and row groups without host lists."""
    splits = GroupSplits(None, torch.tensor([2, 0, 3]), 3, 5, torch.device("cpu"))
    assert splits.offsets().tolist() == [2, 2, 5]
    assert splits.row_groups().tolist() == [0, 0, 2, 2, 2]
    assert splits.sizes() == [2, 0, 3]
    bad = GroupSplits(None, torch.tensor([2, 0, 4]), 3, 5, torch.device("cpu"))
    with pytest.raises(ValueError, match="sum to 6"):
        bad.sizes()


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="needs torch._grouped_mm")
@pytest.mark.parametrize("bias", [True, False])
def test_grouped_path_matches_stack(monkeypatch, bias):
    """The torch._grouped_mm path (forced on: on the CPU it is off by default) against the
    stack of te.Linear, within bf16 tolerance; the weight grads are views of one buffer."""
    monkeypatch.setattr(grouped_module, "grouped_mm_supported", lambda *args: True)
    splits = [5, 0, 11, 3]
    grouped, stack = make_pair(4, torch.bfloat16, bias=bias)
    assert grouped._plan(torch.bfloat16, None, False, False).mode == "grouped"
    a, b = run_both(grouped, stack, splits, None, torch.bfloat16, steps=1)
    (ya, dxa, dwa, dba), (yb, dxb, dwb, dbb) = a[0], b[0]
    # y rounds x W^T before adding the bias (te.Linear rounds once): differences follow the
    # size of the terms, not of the result.
    for ta, tb in zip([ya, dxa, *dwa, *dba], [yb, dxb, *dwb, *dbb], strict=True):
        assert_close_to_scale(ta, tb, torch.bfloat16)
    assert len({g.untyped_storage().data_ptr() for g in dwa}) == 1
