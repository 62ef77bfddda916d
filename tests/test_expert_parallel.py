"""te.moe.MoELayer with expert parallelism (ep_group) on spawned gloo ranks of the CPU.

Every rank builds the same whole layer (all E experts, exactly representable weights) and an
expert-parallel one holding its slice of the experts (the rest copied). The whole layer runs on
every rank's tokens put together; each rank's expert-parallel layer on its own. Each rank's
output and input gradient equal the whole layer's rows for its tokens; its experts' weight
gradients equal the whole layer's for those experts; the router's (and shared expert's) weight
gradients summed over the ranks equal the whole layer's. Configs: top-1 and top-2, with and
without a shared expert and biases, one (E, N, K) weight or E weights per GEMM, an expert no
token chooses, a rank without tokens, the shared expert run under the dispatch (the overlap's
code path), sigmoid routing with expert bias and the aux loss (both of this rank's tokens, as
Megatron-Core's), FP8 current scaling (within FP8's tolerance: each rank's expert GEMMs scale
by the amax of their own rows). One spawn of 2 ranks runs all of them, one of 4 ranks two.

Legend: T tokens (per rank), H hidden, F the experts' width, E experts (global).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ranks import each_config, on_ranks
from tolerances import assert_close, assert_close_to_scale, representable

import torchte as te
import torchte.moe
from torchte import recipe
from torchte.moe import layer as moe_layer

H, F_ = 32, 16


def _fill(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every parameter exactly representable in `dtype`, the same on every rank."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(representable(tuple(p.shape), dtype, scale=0.5, generator=gen))


def _copy_slice(ep: te.moe.MoELayer, whole: te.moe.MoELayer, first: int) -> None:
    """The expert-parallel layer's parameters from the whole layer's: its experts' slice
    (weight{g} <- weight{first + g}, or rows [first, first + El) of one (E, N, K) weight)."""
    with torch.no_grad():
        for name, p in ep.named_parameters():
            if not name.startswith("experts."):
                p.copy_(whole.get_parameter(name))
                continue
            op, kind = name.split(".")[1:]
            if kind in ("weight", "bias"):
                p.copy_(whole.get_parameter(name)[first : first + p.shape[0]])
            else:
                base = kind.rstrip("0123456789")
                index = first + int(kind[len(base) :])
                p.copy_(getattr(whole.experts, op).get_parameter(f"{base}{index}"))


def _whole_grad(whole: te.moe.MoELayer, name: str, first: int, rows: int) -> torch.Tensor:
    """The whole layer's gradient of the expert-parallel layer's parameter `name`."""
    op, kind = name.split(".")[1:]
    if kind in ("weight", "bias"):
        return _grad(whole.get_parameter(name))[first : first + rows]
    base = kind.rstrip("0123456789")
    return _grad(
        getattr(whole.experts, op).get_parameter(f"{base}{first + int(kind[len(base) :])}")
    )


def _grad(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p) if p.grad is None else p.grad


def _check(top_k, shared, bias, single, tokens, starve, fp8, overlap, sigmoid, experts):
    """One config on this rank (see the module's docstring); tokens: each rank's count."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.bfloat16 if fp8 else torch.float32
    kw = {
        "shared_expert_ffn_hidden_size": 16 if shared else None,
        "bias": bias,
        "single_grouped_weight": single,
        "params_dtype": dtype,
        "device": "cpu",
        "device_splits": False,
    }
    if sigmoid:
        kw.update(score_function="sigmoid", expert_bias=True, aux_loss_coeff=0.125)
    whole = te.moe.MoELayer(H, F_, experts, top_k, **kw)
    _fill(whole, dtype)
    if starve:  # the last expert's router row is -1/2 and x >= 1/16: it never wins
        with torch.no_grad():
            whole.router.weight[-1] = -0.5
            whole.router.weight[:-1] /= 8
    ep = te.moe.MoELayer(H, F_, experts, top_k, ep_group=dist.group.WORLD, **kw)
    local = experts // world
    first = rank * local
    _copy_slice(ep, whole, first)
    assert all(p.allreduce is False for p in ep.experts.parameters())
    assert all(p.allreduce is True for p in whole.experts.parameters())
    if sigmoid:
        for layer in (whole, ep):
            layer.expert_bias.copy_(torch.arange(experts) % 3 / 4 - 0.25)

    x_dtype = torch.float8_e4m3fn if fp8 else torch.float32
    gen = torch.Generator().manual_seed(1)
    total = sum(tokens)
    x_all = representable((total, H), x_dtype, generator=gen)
    x_all = x_all.abs() + 1 / 16 if starve else x_all
    gy_all = representable((total, H), x_dtype, generator=gen)
    start = sum(tokens[:rank])
    mine = slice(start, start + tokens[rank])
    x_w = x_all.to(dtype).clone().requires_grad_()
    x_e = x_all[mine].to(dtype).clone().requires_grad_()

    fp8_ctx = te.autocast(enabled=fp8, recipe=recipe.Float8CurrentScaling() if fp8 else None)
    with fp8_ctx:
        y_w = whole(x_w)
        if overlap:  # the code path of NCCL's overlap: the shared expert before the wait
            moe_layer.overlaps, saved = (lambda group: True), moe_layer.overlaps
        try:
            y_e = ep(x_e)
        finally:
            if overlap:
                moe_layer.overlaps = saved
    (y_w.float() * gy_all).sum().backward()
    (y_e.float() * gy_all[mine]).sum().backward()

    # the collectives first, so that a rank failing an assertion leaves none half done
    summed = {n: _grad(p).clone() for n, p in ep.named_parameters() if not n.startswith("experts.")}
    for grad in summed.values():  # whole on every rank: each rank's part of the gradient
        dist.all_reduce(grad)
    out_dtype, grad_dtype = (
        (torch.float8_e4m3fn, torch.float8_e5m2) if fp8 else (torch.float32, torch.float32)
    )
    # FP8: sums of rounded terms whose scales differ (each GEMM's amax of its own rows), so
    # their error follows the terms' size
    close = assert_close_to_scale if fp8 else assert_close
    close(y_e, y_w[mine], out_dtype, msg="output")
    close(x_e.grad, x_w.grad[mine], grad_dtype, msg="input grad")
    for name, p in ep.named_parameters():
        if name in summed:
            close(summed[name], _grad(whole.get_parameter(name)), grad_dtype, msg=name)
        else:
            want = _whole_grad(whole, name, first, local)
            close(_grad(p), want, grad_dtype, msg=f"grad of {name}")
    if starve:  # the last expert got no rows on the rank holding it
        assert not whole.router.weight.grad[-1].any()
    if sigmoid:
        _check_local_router_state(ep, whole, x_all[mine].to(dtype), experts)


def _check_local_router_state(ep, whole, x_mine, experts) -> None:
    """The aux loss and the routed counts are of this rank's tokens (Megatron-Core's): those
    of the whole layer run on them alone."""
    whole.local_tokens_per_expert.zero_()
    with torch.no_grad():
        whole(x_mine)
    assert torch.equal(ep.local_tokens_per_expert, whole.local_tokens_per_expert)
    assert_close(ep.aux_loss, whole.aux_loss, torch.float32, msg="aux loss")


def _check_errors(experts) -> None:
    """E not divisible by the ranks; device split sizes over several ranks."""
    world = dist.get_world_size()
    with pytest.raises(ValueError, match="must be divisible by the ep_group's"):
        te.moe.MoELayer(H, F_, experts * world + 1, 1, device="cpu", ep_group=dist.group.WORLD)
    with pytest.raises(ValueError, match="device_splits=True"):
        te.moe.MoELayer(
            H, F_, experts, 1, device="cpu", ep_group=dist.group.WORLD, device_splits=True
        )


# (top_k, shared, bias, single, tokens per rank, starve, fp8, overlap, sigmoid)
CONFIGS_2 = [
    (1, False, False, False, (9, 7), False, False, False, False),
    (2, False, False, True, (9, 7), False, False, False, False),
    (2, True, True, False, (8, 11), False, False, True, False),
    (2, True, False, True, (8, 11), False, False, False, False),
    (1, False, True, True, (0, 13), False, False, False, False),
    (2, False, False, False, (12, 5), True, False, False, False),
    (2, False, False, True, (10, 6), False, False, False, True),
    (2, True, False, False, (16, 16), False, True, False, False),
]
CONFIGS_4 = [
    (2, True, True, True, (5, 0, 9, 4), False, False, True, False),
    (1, False, False, False, (3, 7, 6, 2), True, False, False, False),
]


def _rank_main(rank: int, configs, experts: int) -> dict:
    torch.set_num_threads(1)
    outcome = each_config(_check, configs, experts)
    outcome.update(each_config(_check_errors, [()], experts, named=True))
    return outcome


def test_two_ranks_equal_one_layer_holding_every_expert(tmp_path):
    results = on_ranks(_rank_main, 2, tmp_path, CONFIGS_2, 4)
    for rank, outcome in enumerate(results):
        assert all(v == "ok" for v in outcome.values()), (rank, outcome)


def test_four_ranks_equal_one_layer_holding_every_expert(tmp_path):
    results = on_ranks(_rank_main, 4, tmp_path, CONFIGS_4, 8)
    for rank, outcome in enumerate(results):
        assert all(v == "ok" for v in outcome.values()), (rank, outcome)


def test_one_rank_group_is_the_single_rank_layer(tmp_path):
    """An ep_group of one rank: all experts here, the single-rank path (allreduce True)."""
    on_ranks(_one_rank, 1, tmp_path)


def _one_rank(rank: int) -> None:
    layer = te.moe.MoELayer(H, F_, 4, 2, device="cpu", ep_group=dist.group.WORLD)
    assert layer.experts.fc1.num_groups == 4
    assert all(p.allreduce is True for p in layer.experts.parameters())


def _rank_main_nccl(rank: int) -> dict:
    return each_config(_check_bf16_gpu, [(2, True), (1, False)], torch.device("cuda", rank))


def _check_bf16_gpu(top_k: int, shared: bool, device: torch.device) -> None:
    """The main check on NCCL in bf16 (with the shared expert's overlap where shared)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    experts, tokens = 8, (96, 64)
    kw = {"shared_expert_ffn_hidden_size": 64 if shared else None, "device": device}
    kw.update(params_dtype=torch.bfloat16, single_grouped_weight=True, device_splits=False)
    whole = te.moe.MoELayer(H, F_, experts, top_k, **kw)
    _fill(whole, torch.bfloat16)
    ep = te.moe.MoELayer(H, F_, experts, top_k, ep_group=dist.group.WORLD, **kw)
    first = rank * experts // world
    _copy_slice(ep, whole, first)
    gen = torch.Generator().manual_seed(1)
    x_all = representable((sum(tokens), H), torch.bfloat16, generator=gen).to(device)
    gy_all = representable((sum(tokens), H), torch.bfloat16, generator=gen).to(device)
    start = sum(tokens[:rank])
    mine = slice(start, start + tokens[rank])
    x_w = x_all.clone().requires_grad_()
    x_e = x_all[mine].clone().requires_grad_()
    y_w, y_e = whole(x_w), ep(x_e)
    (y_w.float() * gy_all).sum().backward()
    (y_e.float() * gy_all[mine]).sum().backward()
    assert_close(y_e, y_w[mine], torch.bfloat16, msg="output")
    assert_close(x_e.grad, x_w.grad[mine], torch.bfloat16, msg="input grad")
    for name, p in ep.named_parameters():
        if name.startswith("experts."):
            want = _whole_grad(whole, name, first, experts // world)
            assert_close(_grad(p), want, torch.bfloat16, msg=name)


@pytest.mark.gpu
def test_two_gpus_nccl_bf16(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    results = on_ranks(_rank_main_nccl, 2, tmp_path, backend="nccl")
    for rank, outcome in enumerate(results):
        assert all(v == "ok" for v in outcome.values()), (rank, outcome)
