"""te.GroupedLinear on a GPU: the grouped-GEMM path against a stack of te.Linear, no host sync
with device-side m_splits, and the FP8 recipes bit-identical to the stack."""

from __future__ import annotations

import pytest
import torch
from test_grouped_linear import RECIPES, K, assert_identical, make_pair, run_both
from tolerances import assert_close_to_scale

from torchte.module._grouped_fp8 import one_fprop_gemm

pytestmark = pytest.mark.gpu

SPLITS = [37, 0, 200, 3, 16, 1, 0, 99]


def test_bf16_takes_the_grouped_path_and_matches_the_stack():
    grouped, stack = make_pair(len(SPLITS), torch.bfloat16, device="cuda")
    assert grouped._plan(torch.bfloat16, None, False, False).mode == "grouped"
    a, b = run_both(grouped, stack, SPLITS, None, torch.bfloat16, steps=2)
    for (ya, dxa, dwa, dba), (yb, dxb, dwb, dbb) in zip(a, b, strict=True):
        for ta, tb in zip([ya, dxa, *dwa, *dba], [yb, dxb, *dwb, *dbb], strict=True):
            assert_close_to_scale(ta, tb, torch.bfloat16)
        assert len({g.untyped_storage().data_ptr() for g in dwa}) == 1
        assert torch.equal(dwa[1], torch.zeros_like(dwa[1]))


def test_device_splits_make_no_host_sync():
    grouped, _ = make_pair(len(SPLITS), torch.bfloat16, device="cuda")
    splits = torch.tensor(SPLITS, device="cuda")
    x = torch.randn(sum(SPLITS), K, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    reference = grouped(x, SPLITS)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = grouped(x, splits)
        y.backward(torch.ones_like(y))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(y, reference)


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_fp8_equals_stack_of_linear(recipe_name):
    """The same FP8 bytes as the stack: dgrad, wgrad and bias grads bit-identical; y too, unless
    fprop ran as one torch._scaled_grouped_mm (a different GEMM kernel on the same bytes)."""
    grouped, stack = make_pair(len(SPLITS), torch.bfloat16, device="cuda")
    a, b = run_both(grouped, stack, SPLITS, RECIPES[recipe_name], torch.bfloat16)
    fmt = RECIPES[recipe_name].fp8_format
    one_gemm = one_fprop_gemm(grouped.device, fmt.fwd_dtype, fmt.fwd_dtype, SPLITS, torch.bfloat16)
    print(f"\nGroupedLinear {recipe_name}: fprop as one _scaled_grouped_mm: {one_gemm}")
    if one_gemm:
        for ra, rb in zip(a, b, strict=True):
            assert_close_to_scale(ra[0], rb[0], torch.bfloat16)
        a = [(rb[0], *ra[1:]) for ra, rb in zip(a, b, strict=True)]
    assert_identical(a, b, recipe_name)


def test_fp32_runs_the_per_group_path():
    grouped, stack = make_pair(3, torch.float32, device="cuda")
    assert grouped._plan(torch.float32, None, False, False).mode == "per_group"
    a, b = run_both(grouped, stack, [5, 0, 9], None, torch.float32, steps=1)
    assert_identical(a, b, "fp32")
