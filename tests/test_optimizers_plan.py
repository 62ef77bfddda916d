"""FusedAdam's routes kept between steps (optimizers/_adam_plan.py): later steps reuse a
param's route, and anything that changes what the route holds (states replaced by a loaded
state dict, a gradient of another shape, kind or layout) routes the param again, with the same
results and errors as a first step."""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_close, representable

from torchte.optimizers import FusedAdam

BF16 = torch.bfloat16
CONFIGS = {
    "fp32": (torch.float32, {}),
    "bf16 master": (BF16, {"master_weights": True}),
    "bf16 master, bf16 moments": (
        BF16,
        {"master_weights": True, "exp_avg_dtype": BF16, "exp_avg_sq_dtype": BF16},
    ),
    "bf16 remainders": (BF16, {"master_weights": True, "store_param_remainders": True}),
    "bf16 no master": (BF16, {}),
}


def _params(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(4, 6), (5,), (3, 3)]
    return [torch.nn.Parameter(representable(s, BF16, generator=gen).to(dtype)) for s in shapes]


def _grads(step: int, params):
    gen = torch.Generator().manual_seed(100 + step)
    return [representable(p.shape, BF16, generator=gen).to(p.dtype) for p in params]


def _run(params, opt, steps, first=0):
    for k in range(first, first + steps):
        for p, g in zip(params, _grads(k, params), strict=True):
            p.grad = g
        opt.step()


@pytest.mark.parametrize("config", list(CONFIGS))
def test_kept_routes_give_the_steps_of_routing_every_step(config):
    dtype, kw = CONFIGS[config]
    kept, fresh = _params(dtype), _params(dtype)
    opt_kept, opt_fresh = FusedAdam(kept, lr=2.0**-5, **kw), FusedAdam(fresh, lr=2.0**-5, **kw)
    for k in range(4):
        _run(kept, opt_kept, 1, k)
        opt_fresh._entries.clear()  # every step routed from scratch
        _run(fresh, opt_fresh, 1, k)
    assert opt_kept._entries, "later steps should keep the params' routes"
    for a, b in zip(kept, fresh, strict=True):
        assert torch.equal(a, b)
        for name in opt_fresh.state[b]:
            assert torch.equal(opt_kept.state[a][name], opt_fresh.state[b][name])


@pytest.mark.parametrize("config", ["fp32", "bf16 master, bf16 moments"])
def test_a_loaded_state_dict_is_what_the_next_step_reads(config):
    dtype, kw = CONFIGS[config]
    source, target = _params(dtype, seed=1), _params(dtype, seed=1)
    opt_source = FusedAdam(source, lr=2.0**-5, **kw)
    opt_target = FusedAdam(target, lr=2.0**-5, **kw)
    _run(source, opt_source, 3)
    _run(target, opt_target, 1)  # routes kept, of states the load replaces
    with torch.no_grad():
        for a, b in zip(target, source, strict=True):
            a.copy_(b)
    opt_target.load_state_dict(opt_source.state_dict())
    _run(source, opt_source, 2, first=3)
    _run(target, opt_target, 2, first=3)
    for a, b in zip(target, source, strict=True):
        assert_close(a, b, dtype)
        for name in opt_source.state[b]:
            assert torch.equal(opt_target.state[a][name], opt_source.state[b][name])


def test_a_gradient_of_another_shape_is_refused_after_a_kept_route():
    """(decoupled gradients: torch refuses a .grad of another shape itself)"""
    params = _params(torch.float32)
    opt = FusedAdam(params, lr=2.0**-5, use_decoupled_grad=True)
    for k in range(2):
        for p, g in zip(params, _grads(k, params), strict=True):
            p.decoupled_grad = g
        opt.step()
    assert params[0] in opt._entries
    params[0].decoupled_grad = torch.zeros(6, 4)
    with pytest.raises(ValueError, match="gradient of shape"):
        opt.step()
    params[0].decoupled_grad = torch.zeros(4, 6).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


def test_a_param_without_gradient_is_left_alone_after_a_kept_route():
    params = _params(torch.float32)
    opt = FusedAdam(params, lr=2.0**-5)
    _run(params, opt, 2)
    before = params[1].detach().clone()
    exp_avg = opt.state[params[1]]["exp_avg"].clone()
    for p, g in zip(params, _grads(7, params), strict=True):
        p.grad = g
    params[1].grad = None
    opt.step()
    assert torch.equal(params[1], before)
    assert torch.equal(opt.state[params[1]]["exp_avg"], exp_avg)
    assert not torch.equal(opt.state[params[0]]["exp_avg"], torch.zeros(4, 6))
