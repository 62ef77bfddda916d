"""te.GroupedLinear on a GPU: the grouped-GEMM path against a stack of te.Linear, no host sync
with device-side m_splits, the FP8 recipes bit-identical to the stack (also y when determinism
is asked for), the single grouped weight, and FP8 weight parameters."""

from __future__ import annotations

import pytest
import torch
from test_grouped_linear import RECIPES, K, N, assert_identical, make_pair, run_both
from test_grouped_linear_model_init import SPLITS as model_init_splits
from test_grouped_linear_model_init import assert_identical as model_init_identical
from test_grouped_linear_model_init import make_pair as model_init_pair
from test_grouped_linear_model_init import step as model_init_step
from test_grouped_linear_single import assert_same_steps, make_layouts
from tolerances import assert_close_to_scale, representable

from torchte.module import grouped_linear as grouped_module
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


class _DeviceSplits(torch.nn.Module):
    """A grouped layer called with its split sizes as a device tensor (run_both passes lists)."""

    def __init__(self, layer) -> None:
        super().__init__()
        self.layer, self.device, self.num_gemms = layer, layer.device, layer.num_gemms

    def named_parameters(self, *args, **kwargs):
        return self.layer.named_parameters(*args, **kwargs)

    def forward(self, x, splits, **kwargs):
        return self.layer(x, torch.tensor(splits, device=x.device), **kwargs)


@pytest.mark.parametrize("recipe_name", ["hp", "delayed", "current"])
def test_deterministic_equals_stack_of_linear(monkeypatch, recipe_name):
    """TORCHTE_DETERMINISTIC=1 (torch.use_deterministic_algorithms would need
    CUBLAS_WORKSPACE_CONFIG for cuBLAS): bf16 and FP8 bit for bit as the stack, y included,
    also with the split sizes in a device tensor (read back once)."""
    monkeypatch.setattr(grouped_module, "DETERMINISTIC_ENV", True)
    grouped, stack = make_pair(len(SPLITS), torch.bfloat16, device="cuda")
    for layer in (grouped, _DeviceSplits(grouped)):
        a, b = run_both(layer, stack, SPLITS, RECIPES[recipe_name], torch.bfloat16, steps=2)
        assert_identical(a, b, f"{recipe_name} {type(layer).__name__}")


@pytest.mark.parametrize("recipe_name", ["hp", "delayed", "current"])
def test_single_grouped_weight_equals_per_group(recipe_name):
    """bf16 (torch._grouped_mm reading the (G, N, K) weight in place) and FP8, split sizes as
    a list and as a device tensor: the single layout gives the per-group layout's bits."""
    single, per_group = make_layouts(len(SPLITS), torch.bfloat16, True, True, device="cuda")
    if recipe_name == "hp":
        assert single._plan(torch.bfloat16, None, False, False).mode == "grouped"
    assert_same_steps(single, per_group, SPLITS, RECIPES[recipe_name], torch.bfloat16, 2)
    single_t, per_group_t = _DeviceSplits(single), _DeviceSplits(per_group)
    assert_same_steps(single_t, per_group_t, SPLITS, RECIPES[recipe_name], torch.bfloat16, 2)


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_fp8_model_init_trains_as_a_stack(monkeypatch, recipe_name):
    """FP8 weight parameters read in place by the grouped FP8 GEMMs; under
    TORCHTE_DETERMINISTIC every result equals the stack's bit for bit."""
    monkeypatch.setattr(grouped_module, "DETERMINISTIC_ENV", True)
    fp8_recipe = RECIPES[recipe_name]
    grouped, stack = model_init_pair(fp8_recipe, device="cuda")
    rows = sum(model_init_splits)
    x = representable((rows, K), torch.bfloat16, device="cuda").bfloat16()
    dy = representable((rows, N), torch.bfloat16, scale=0.25, device="cuda").bfloat16()
    got, want = model_init_step(grouped, stack, fp8_recipe, x, dy)
    model_init_identical(got, want, recipe_name)
    _, viewed = grouped._fp8_weight_group[0]
    assert viewed.rowwise_data.data_ptr() == grouped.weight0._storage.rowwise_data.data_ptr()
