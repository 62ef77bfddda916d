"""te.GroupedLinear when determinism is asked for (torch.use_deterministic_algorithms(True), or
TORCHTE_DETERMINISTIC=1): every GEMM runs per group as te.Linear runs it, so output, input
gradient and weight and bias gradients equal a stack of te.Linear bit for bit also where the
layer would otherwise take a grouped GEMM (torch._grouped_mm in bf16, one
torch._scaled_grouped_mm for the FP8 fprop and dgrad). The CPU has neither: here they are
forced on (bf16) or made to fail if consulted (FP8); tests/test_grouped_linear_gpu.py runs the
real ones.
"""

from __future__ import annotations

import pytest
import torch
from test_grouped_linear import RECIPES, assert_identical, make_pair, run_both
from tolerances import representable

import torchte as te
from torchte.module import _grouped_fp8
from torchte.module import grouped_linear as grouped_module

pytestmark = pytest.mark.usefixtures("cpu_default_device")

SPLITS = [5, 0, 11, 3]


@pytest.fixture
def deterministic():
    """torch.use_deterministic_algorithms(True) for the test, restored after."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def test_asked_for_by_torch_or_the_environment(monkeypatch):
    assert not grouped_module.exact_requested()
    monkeypatch.setattr(grouped_module, "DETERMINISTIC_ENV", True)
    assert grouped_module.exact_requested()
    monkeypatch.setattr(grouped_module, "DETERMINISTIC_ENV", False)
    torch.use_deterministic_algorithms(True)
    try:
        assert grouped_module.exact_requested()
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="needs torch._grouped_mm")
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("how", ["torch", "environment"])
def test_bf16_grouped_path_runs_per_group(monkeypatch, request, bias, how):
    """bf16 with torch._grouped_mm forced on: the plan stays "grouped", the call runs per group
    and matches the stack bit for bit (the grouped GEMMs and the separate bias add do not)."""
    monkeypatch.setattr(grouped_module, "grouped_mm_supported", lambda *args: True)
    if how == "torch":
        request.getfixturevalue("deterministic")
    else:
        monkeypatch.setattr(grouped_module, "DETERMINISTIC_ENV", True)
    grouped, stack = make_pair(4, torch.bfloat16, bias=bias)
    assert grouped._plan(torch.bfloat16, None, False, False).mode == "grouped"
    a, b = run_both(grouped, stack, SPLITS, None, torch.bfloat16, steps=2)
    assert_identical(a, b, f"bf16 bias={bias} {how}")


def _no_grouped_fp8_gemm(*args):
    raise AssertionError("consulted the one-GEMM FP8 path although determinism was asked for")


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_fp8_never_takes_the_one_gemm_path(monkeypatch, deterministic, recipe_name):
    monkeypatch.setattr(_grouped_fp8, "one_fprop_gemm", _no_grouped_fp8_gemm)
    grouped, stack = make_pair(4, torch.bfloat16)
    a, b = run_both(grouped, stack, SPLITS, RECIPES[recipe_name], torch.bfloat16)
    assert_identical(a, b, recipe_name)


def test_fp8_consults_the_one_gemm_path_otherwise(monkeypatch):
    """The check above can fail: without determinism the path is consulted."""
    monkeypatch.setattr(_grouped_fp8, "one_fprop_gemm", _no_grouped_fp8_gemm)
    grouped, _ = make_pair(4, torch.bfloat16)
    with pytest.raises(AssertionError, match="consulted"), te.autocast(recipe=RECIPES["current"]):
        grouped(torch.randn(sum(SPLITS), grouped.in_features), SPLITS)


def test_split_tensor_and_ops_module(deterministic):
    """Sizes given as a tensor are read back once; te.ops.GroupedLinear follows the same rule."""
    grouped, stack = make_pair(4, torch.float32)
    x = representable((sum(SPLITS), grouped.in_features), torch.bfloat16)
    with torch.no_grad():
        want = torch.cat([layer(p) for layer, p in zip(stack, x.split(SPLITS), strict=True)])
        assert torch.equal(grouped(x, torch.tensor(SPLITS)), want)
        op = te.ops.GroupedLinear(4, grouped.in_features, grouped.out_features)
        for name, param in op.named_parameters():
            param.copy_(grouped.get_parameter(name))
        assert torch.equal(op(x, torch.tensor(SPLITS)), want)
