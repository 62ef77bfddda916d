"""torchte modules under FSDP2 on one GPU (an NCCL group of one rank): the same training as
without FSDP2, bit for bit; with te.fsdp.enable_fp8_all_gather the GEMMs read the gathered FP8
bytes (real FP8 GEMMs) and, under current scaling, train as the high-precision gather does."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import torchte as te
from torchte import recipe
from torchte.distributed import fsdp as te_fsdp
from torchte.quantization.float8_tensor import Float8Tensor

pytestmark = pytest.mark.gpu

H, F, T = 256, 512, 128
FP8 = torch.float8_e4m3fn
RECIPES = {"delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling}


def _model():
    torch.manual_seed(0)
    kw = {"device": "cuda"}
    return torch.nn.Sequential(
        te.LayerNormLinear(H, F, normalization="RMSNorm", **kw),
        te.Linear(F, H, **kw),
        te.LayerNormMLP(H, F, **kw),
    )


def _shard(model, policy):
    for child in model:
        fully_shard(child, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


def _train(model, make, steps=3, seen=None):
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(T, H, device="cuda", generator=gen)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if seen is not None:
        model[1].register_forward_pre_hook(lambda module, args: seen.append(module.weight))
    losses = []
    for _ in range(steps):
        with torch.autocast("cuda", torch.bfloat16), te.autocast(recipe=make()):
            loss = model(x).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", list(RECIPES))
def test_fsdp2_of_one_rank_equals_no_fsdp(nccl_group, name):
    make = RECIPES[name]
    want = _train(_model(), make)
    assert _train(_shard(_model(), MixedPrecisionPolicy()), make) == want


def test_fp8_all_gather_feeds_the_fp8_gemms(nccl_group):
    """Gathered from fp32 masters as FP8: the GEMMs cast the same whole-weight amax as from the
    fp32 gather, so the training is the same bit for bit."""
    plain = _train(_shard(_model(), MixedPrecisionPolicy()), RECIPES["current"])
    seen = []
    model = _shard(te_fsdp.enable_fp8_all_gather(_model()), MixedPrecisionPolicy())
    te_fsdp.precompute_fp8_scales(model)
    assert _train(model, RECIPES["current"], seen=seen) == plain
    weight = seen[0]
    assert isinstance(weight, Float8Tensor) and weight._storage.rowwise_data.dtype == FP8


def test_fp8_all_gather_under_a_bf16_policy(nccl_group):
    """param_dtype bf16: the gathered FP8 weight stands for bf16, the layers compute in it."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    seen = []
    model = _shard(te_fsdp.enable_fp8_all_gather(_model()), policy)
    losses = _train(model, RECIPES["delayed"], steps=4, seen=seen)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert isinstance(seen[0], Float8Tensor) and seen[0].dtype == torch.bfloat16
    assert model[1].weight.grad is None and model[1].weight.dtype == torch.float32


@pytest.mark.parametrize("name", list(RECIPES))
def test_fp8_parameters_shard_as_fp8_bytes(nccl_group, name):
    """te.quantized_model_init: the shards are Float8Tensors of FP8 bytes, gathered as such,
    and the training equals the unsharded FP8-parameter model's."""

    def quantized():
        with te.quantized_model_init(recipe=RECIPES[name]()):
            return _model()

    want = _train(quantized(), RECIPES[name])
    model = _shard(quantized(), MixedPrecisionPolicy())
    local = model[1].weight.to_local()
    assert isinstance(local, Float8Tensor) and local._storage.rowwise_data.dtype == FP8
    assert _train(model, RECIPES[name]) == want
