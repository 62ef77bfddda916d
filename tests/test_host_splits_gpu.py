"""A grouped layer called with new host split sizes at every call never makes the host wait for
the GPU (the sizes' device tensors are copied from pinned memory, kernels/host_values.py), in
bf16 and under the per-tensor and block-scaled FP8 recipes; the copy helper itself on both
devices."""

from __future__ import annotations

import pytest
import torch

import torchte as te
from torchte.kernels.host_values import to_device_async
from torchte.recipe import Float8BlockScaling, Float8CurrentScaling

RECIPES = {"bf16": None, "current": Float8CurrentScaling, "block": Float8BlockScaling}
SPLITS = ([64, 0, 160, 32], [16, 96, 96, 48], [256, 0, 0, 0], [32, 32, 32, 160])


def test_to_device_async_on_the_cpu_gives_the_values():
    got = to_device_async([[0, 3, 5], [0, 16, 32]], torch.int32, torch.device("cpu"))
    assert got.dtype == torch.int32 and got.tolist() == [[0, 3, 5], [0, 16, 32]]
    got = to_device_async(torch.tensor([1, 2]), torch.int64, torch.device("cpu"))
    assert got.dtype == torch.int64 and got.tolist() == [1, 2]


@pytest.mark.gpu
def test_to_device_async_on_the_gpu_gives_the_values_without_a_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = to_device_async([7, -2, 9], torch.int32, torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert got.is_cuda and got.cpu().tolist() == [7, -2, 9]


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(RECIPES))
def test_new_host_splits_at_every_call_do_not_synchronize(name):
    recipe = RECIPES[name]
    layer = te.GroupedLinear(4, 256, 128, params_dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    outputs = []
    for sizes in SPLITS:
        x = torch.randn(256, 256, device="cuda", generator=gen).bfloat16().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with te.autocast(enabled=recipe is not None, recipe=recipe() if recipe else None):
                y = layer(x, sizes)
            y.float().square().sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        outputs.append((x, y.detach()))
    # The rows of each group went through its own weight: group g's rows equal a te.Linear-free
    # product with weight g (bf16 only: FP8 rounds differently).
    if recipe is None:
        for (x, y), sizes in zip(outputs, SPLITS, strict=True):
            start = 0
            for g, m in enumerate(sizes):
                w, b = getattr(layer, f"weight{g}"), getattr(layer, f"bias{g}")
                want = torch.nn.functional.linear(x[start : start + m].detach(), w, b)
                torch.testing.assert_close(y[start : start + m], want)
                start += m
