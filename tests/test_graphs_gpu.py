"""te.make_graphed_callables on a GPU: graphed and eager training give the same losses and
gradients over several steps (delayed scaling's scales move between them)."""

from __future__ import annotations

import pytest
import torch

import torchte as te
from torchte.recipe import DelayedScaling, Float8CurrentScaling

pytestmark = pytest.mark.gpu

RECIPES = {
    "bf16": None,
    "delayed": DelayedScaling(amax_history_len=4),
    "current": Float8CurrentScaling(),
}


def assert_same_step(loss_e, loss_g, eager_params, graphed_params, step: int) -> None:
    """Bit-identical loss and gradients of an eager and a graphed step."""
    assert torch.equal(loss_e, loss_g), step
    for pe, pg in zip(eager_params, graphed_params, strict=True):
        assert torch.equal(pe.grad, pg.grad), step


def make(kind: str):
    torch.manual_seed(0)
    kw = {"params_dtype": torch.bfloat16, "device": "cuda"}
    if kind == "linear":
        return te.Linear(256, 256, **kw)
    return te.LayerNormMLP(256, 1024, **kw)


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_graphed_training_equals_eager(kind, recipe_name):
    fp8 = RECIPES[recipe_name]
    eager, graphed = make(kind), make(kind)
    sample = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed = te.make_graphed_callables(
        graphed, (sample,), fp8_enabled=fp8 is not None, fp8_recipe=fp8
    )
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_g = torch.optim.SGD(graphed.parameters(), lr=0.1)
    for step in range(5):
        x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
        with te.autocast(enabled=fp8 is not None, recipe=fp8):
            loss_e = eager(x.clone().requires_grad_()).float().square().mean()
        loss_g = graphed(x.clone().requires_grad_()).float().square().mean()
        loss_e.backward()
        loss_g.backward()
        assert_same_step(loss_e, loss_g, eager.parameters(), graphed.parameters(), step)
        opt_e.step()
        opt_g.step()
        opt_e.zero_grad(set_to_none=False)
        opt_g.zero_grad(set_to_none=False)


def test_gradients_accumulate_over_microbatches():
    """Two backwards without zeroing: .grad is the sum (a .grad kept as the graph's static
    buffer would be overwritten by the second replay)."""
    fp8 = RECIPES["delayed"]
    eager, graphed = make("linear"), make("linear")
    sample = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    graphed = te.make_graphed_callables(graphed, (sample,), fp8_enabled=True, fp8_recipe=fp8)
    for micro in range(2):
        x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        with te.autocast(recipe=fp8):
            eager(x).float().square().mean().backward()
        graphed(x.detach().clone().requires_grad_()).float().square().mean().backward()
        for pe, pg in zip(eager.parameters(), graphed.parameters(), strict=True):
            assert torch.equal(pe.grad, pg.grad), micro


def test_fused_wgrad_accumulation_into_main_grad():
    eager, graphed = (
        te.Linear(
            256, 256, params_dtype=torch.bfloat16, device="cuda", fuse_wgrad_accumulation=True
        )
        for _ in range(2)
    )
    graphed.load_state_dict(eager.state_dict())
    for layer in (eager, graphed):
        layer.weight.main_grad = torch.zeros(256, 256, device="cuda")
    sample = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    graphed = te.make_graphed_callables(graphed, (sample,))
    assert torch.count_nonzero(graphed.weight.main_grad) == 0  # the warm-up left no trace
    for step in range(3):
        x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
        eager(x).float().sum().backward()
        graphed(x).float().sum().backward()
        assert torch.equal(eager.weight.main_grad, graphed.weight.main_grad), step


def test_chained_modules_share_one_pool():
    fp8 = RECIPES["current"]
    first, second = make("linear"), make("mlp")
    eager = torch.nn.Sequential(make("linear"), make("mlp"))
    sample = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with torch.no_grad():
        mid = first(sample).detach().requires_grad_()
    first, second = te.make_graphed_callables(
        (first, second), ((sample,), (mid,)), fp8_enabled=True, fp8_recipe=fp8
    )
    for step in range(3):
        x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
        with te.autocast(recipe=fp8):
            loss_e = eager(x).float().square().mean()
        loss_g = second(first(x)).float().square().mean()
        loss_e.backward()
        loss_g.backward()
        graphed_params = [*first.parameters(), *second.parameters()]
        assert_same_step(loss_e, loss_g, eager.parameters(), graphed_params, step)
        for pe, pg in zip(eager.parameters(), graphed_params, strict=True):
            pe.grad = pg.grad = None


def test_replay_checks_the_input_shape():
    graphed = te.make_graphed_callables(
        make("linear"), (torch.randn(64, 256, device="cuda", dtype=torch.bfloat16),)
    )
    with pytest.raises(ValueError, match="captured with an input of shape"):
        graphed(torch.randn(32, 256, device="cuda", dtype=torch.bfloat16))


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_whole_step_capture_with_torch_cuda_graph(recipe_name):
    """A training step (forward under te.autocast, backward) captured by torch.cuda.graph
    itself: replays requantize the weights the optimizer moves and keep the scales updating."""
    fp8 = RECIPES[recipe_name]
    eager, graphed = make("linear"), make("linear")
    static_x = torch.zeros(64, 256, device="cuda", dtype=torch.bfloat16)

    def step(layer, x):
        with te.autocast(recipe=fp8):
            loss = layer(x).float().square().mean()
        loss.backward()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(graphed, static_x)
    torch.cuda.current_stream().wait_stream(side)
    graphed.load_state_dict(eager.state_dict())  # warm-up moved the scales: start as eager
    for module in (graphed,):
        for pair in module._delayed_states.values():
            for state in pair:
                state.scale.fill_(1.0)
                state.amax_history.zero_()
    for p in graphed.parameters():
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step(graphed, static_x)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_g = torch.optim.SGD(graphed.parameters(), lr=0.1)
    for n in range(5):
        x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
        for p in eager.parameters():
            p.grad = None
        loss_e = step(eager, x)
        static_x.copy_(x)
        graph.replay()
        assert_same_step(loss_e, static_loss, eager.parameters(), graphed.parameters(), n)
        opt_e.step()
        opt_g.step()


class FailsOnce(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("second warm-up call fails")
        return x


def test_a_failed_warm_up_leaves_the_modules_as_they_were():
    fp8 = RECIPES["delayed"]
    layer = make("linear")
    with te.autocast(recipe=fp8):  # scaling state with history
        layer(torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)).sum().backward()
    before = {k: v.clone() for k, v in layer.state_dict().items() if isinstance(v, torch.Tensor)}
    extra_before = layer._scaling_state()
    model = torch.nn.Sequential(layer, FailsOnce())
    sample = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(RuntimeError, match="second warm-up call fails"):
        te.make_graphed_callables(model, (sample,), fp8_enabled=True, fp8_recipe=fp8)
    assert "forward" not in model.__dict__
    for key, value in layer.state_dict().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, before[key]), key
    extra_after = layer._scaling_state()
    assert extra_after.keys() == extra_before.keys()
    for key, value in extra_before.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(extra_after[key], value), key


def test_parameters_of_two_dtypes_get_fresh_gradients_of_their_dtype():
    """A module with fp32 and bf16 parameters (as te.moe.MoELayer's router and experts): the
    graphed backward hands each parameter a fresh gradient (never the graph's buffer, which the
    next replay overwrites) of its own dtype, equal to eager's, without a cast per parameter
    outside the graph."""

    class Mixed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.router = torch.nn.Linear(256, 8, bias=False, device="cuda")
            self.experts = torch.nn.ModuleList(
                te.Linear(256, 256, params_dtype=torch.bfloat16, device="cuda") for _ in range(3)
            )

        def forward(self, x):
            gate = self.router(x.float()).sum()
            for layer in self.experts:
                x = layer(x)
            return x * gate.to(x.dtype)

    eager, graphed = Mixed(), Mixed()
    sample = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed = te.make_graphed_callables(graphed, (sample,))
    param_shapes = {tuple(p.shape) for p in graphed.parameters()}
    first = None
    for step in range(2):
        x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
        eager.zero_grad(set_to_none=True)
        graphed.zero_grad(set_to_none=True)
        eager(x.clone().requires_grad_()).float().square().mean().backward()
        loss = graphed(x.clone().requires_grad_()).float().square().mean()
        activities = [torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
            loss.backward()
        for pe, pg in zip(eager.parameters(), graphed.parameters(), strict=True):
            assert pg.grad.dtype == pg.dtype
            assert torch.equal(pe.grad, pg.grad), step
        casts = [
            (e.name, e.input_shapes)
            for e in prof.events()
            if e.name == "aten::_to_copy"  # a dtype conversion (.to)
            and e.input_shapes and tuple(e.input_shapes[0]) in param_shapes
        ]  # fmt: skip
        assert not casts, casts
        if first is None:
            first = [(p.grad, p.grad.clone()) for p in graphed.parameters()]
    for kept, value in first:  # the first step's gradients, untouched by the second replay
        assert torch.equal(kept, value)
