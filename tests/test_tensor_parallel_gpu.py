"""Tensor-parallel modules on one GPU with an NCCL group of one rank: they run, mark their
parameters, and equal the same modules without a group bit for bit (every collective of one
rank is the tensor itself)."""

from __future__ import annotations

import copy

import pytest
import torch

import torchte as te
from torchte import recipe

pytestmark = pytest.mark.gpu


def _modules(group):
    kw = {"params_dtype": torch.bfloat16, "device": "cuda"}
    tp = {"tp_group": group, "sequence_parallel": True}
    plain = [
        te.Linear(64, 64, **kw),
        te.Linear(64, 64, **kw),
        te.LayerNormLinear(64, 64, **kw),
        te.LayerNormMLP(64, 128, **kw),
    ]
    split = [copy.deepcopy(m) for m in plain]
    split[0] = te.Linear(64, 64, parallel_mode="column", **tp, **kw)
    split[1] = te.Linear(64, 64, parallel_mode="row", **tp, **kw)
    split[2] = te.LayerNormLinear(64, 64, parallel_mode="column", **tp, **kw)
    split[3] = te.LayerNormMLP(64, 128, set_parallel_mode=True, **tp, **kw)
    for a, b in zip(plain, split, strict=True):
        b.load_state_dict(a.state_dict())
    return plain, split


@pytest.mark.parametrize("fp8", [None, "current", "delayed"])
def test_tensor_parallel_of_one_rank_equals_no_parallelism(nccl_group, fp8):
    make = {"current": recipe.Float8CurrentScaling, "delayed": recipe.DelayedScaling}.get(fp8)
    plain, split = _modules(nccl_group)
    x = torch.randn(16, 2, 64, device="cuda", dtype=torch.bfloat16)
    for a, b in zip(plain, split, strict=True):
        outs = []
        for module in (a, b):
            xi = x.clone().requires_grad_(True)
            with te.autocast(enabled=make is not None, recipe=make() if make else None):
                y = module(xi)
            y.float().square().sum().backward()
            grads = [p.grad for p in module.parameters()]
            outs.append((y.detach(), xi.grad, *grads))
        for got, want in zip(outs[1], outs[0], strict=True):
            assert torch.equal(got, want), type(a).__name__
    assert split[1].weight.partition_dim == 1 and split[1].bias.sequence_parallel


@pytest.mark.parametrize("mode", ["column", "row"])
def test_grouped_linear_of_one_rank_equals_no_parallelism(nccl_group, mode):
    kw = {"params_dtype": torch.bfloat16, "device": "cuda"}
    plain = te.GroupedLinear(3, 64, 64, **kw)
    split = te.GroupedLinear(3, 64, 64, parallel_mode=mode, tp_group=nccl_group, **kw)
    split.load_state_dict(plain.state_dict())
    x = torch.randn(48, 64, device="cuda", dtype=torch.bfloat16)
    splits = torch.tensor([16, 0, 32], device="cuda")
    outs = []
    for module in (plain, split):
        xi = x.clone().requires_grad_(True)
        with te.autocast(recipe=recipe.Float8CurrentScaling()):
            y = module(xi, splits)
        y.float().square().sum().backward()
        outs.append((y.detach(), xi.grad, *(p.grad for p in module.parameters())))
    for got, want in zip(outs[1], outs[0], strict=True):
        assert torch.equal(got, want)


def test_symmetric_memory_gemms_of_one_rank(nccl_group):
    """te.distributed's fused symmetric-memory GEMMs run on the device (torch's ops, where this
    torch has them) and equal the GEMM of the whole tensor."""
    from torchte import distributed as te_dist
    from torchte.distributed.symmetric_memory import symmetric_group

    gen = torch.Generator(device="cuda").manual_seed(3)
    a = torch.randint(-2, 3, (256, 512), device="cuda", generator=gen).to(torch.bfloat16)
    b = torch.randint(-2, 3, (512, 384), device="cuda", generator=gen).to(torch.bfloat16)
    previous = te_dist.use_symmetric_memory(True)
    try:
        fused = symmetric_group(a, nccl_group)
        gathered, product = te_dist.all_gather_matmul(a, b, nccl_group)
        scattered = te_dist.matmul_reduce_scatter(a, b, nccl_group)
    finally:
        te_dist.use_symmetric_memory(previous)
    assert fused == nccl_group.group_name  # torch 2.11 on CUDA has the ops
    want = torch.mm(a, b)
    assert torch.equal(gathered, a)
    assert torch.equal(product, want) and torch.equal(scattered, want)
