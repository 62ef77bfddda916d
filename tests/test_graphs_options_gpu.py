"""make_graphed_callables' Transformer Engine 2.x options on a GPU: keyword sample arguments,
the pipeline-parallel capture order (_order, with and without buffer reuse), reset(), the
warm-up and capture-time hooks, a tuple of `enabled`, and the gradient-return and stream
options. Graphed runs are compared bit for bit with eager ones of the same weights."""

from __future__ import annotations

import pytest
import torch

import torchte as te
from torchte.recipe import Float8CurrentScaling

pytestmark = pytest.mark.gpu

RECIPES = {"bf16": None, "current": Float8CurrentScaling()}
KW = {"params_dtype": torch.bfloat16, "device": "cuda"}


def rand(requires_grad: bool = False) -> torch.Tensor:
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    return x.requires_grad_(requires_grad)


def linears(count: int) -> list[te.Linear]:
    """`count` layers; the same weights at every call (a fixed seed)."""
    torch.manual_seed(0)
    return [te.Linear(256, 256, **KW) for _ in range(count)]


def assert_same_grads(eager, graphed, step) -> None:
    for pe, pg in zip(eager, graphed, strict=True):
        assert torch.equal(pe.grad, pg.grad), step
        pe.grad = pg.grad = None


class Scaled(torch.nn.Module):
    """A te.Linear whose output is scaled by a keyword tensor (and shifted by an optional one)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.linear = te.Linear(256, 256, **KW)

    def forward(self, x, *, scale, shift=None):
        y = self.linear(x) * scale
        return y if shift is None else y + shift


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_sample_kwargs_are_captured_and_replayed(recipe_name):
    fp8 = RECIPES[recipe_name]
    on = fp8 is not None
    eager, graphed = Scaled(), Scaled()
    scale = torch.rand(256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed = te.make_graphed_callables(
        graphed, (rand(True),), sample_kwargs={"scale": scale, "shift": None}, enabled=on,
        recipe=fp8,
    )  # fmt: skip
    for step in range(3):
        x, s = rand(), torch.rand(256, device="cuda", dtype=torch.bfloat16)
        xe, se = x.clone().requires_grad_(), s.clone().requires_grad_()
        xg, sg = x.clone().requires_grad_(), s.clone().requires_grad_()
        with te.autocast(enabled=on, recipe=fp8):
            ye = eager(xe, scale=se)
        yg = graphed(xg, scale=sg, shift=None, is_first_microbatch=step == 0)
        assert torch.equal(ye, yg), step
        ye.float().square().mean().backward()
        yg.float().square().mean().backward()
        assert torch.equal(xe.grad, xg.grad) and torch.equal(se.grad, sg.grad), step
        assert_same_grads(eager.parameters(), graphed.parameters(), step)
    x = rand()
    with pytest.raises(TypeError, match=r"missing \['scale', 'shift'\]"):
        graphed(x)
    with pytest.raises(ValueError, match="'shift' was None at capture"):
        graphed(x, scale=scale, shift=x)
    with pytest.raises(NotImplementedError, match="cuda_graph_stream"):
        graphed(x, scale=scale, shift=None, cuda_graph_stream=torch.cuda.current_stream())


def pipeline_step(order, run, xs) -> list[torch.Tensor]:
    """One step of a 2-chunk schedule, one layer per chunk: +1 runs chunk 1 on the next
    microbatch, +2 chunk 2 on chunk 1's output (detached, as received from another stage), -2
    backpropagates that microbatch's loss through chunk 2, -1 chunk 2's input gradient through
    chunk 1. run(chunk, microbatch, x) -> y. Returns the losses."""
    h, h_in, y, losses = {}, {}, {}, []
    runs = {1: 0, 2: 0, -1: 0, -2: 0}
    for c in order:
        m = runs[c]
        runs[c] += 1
        if c == 1:
            h[m] = run(1, m, xs[m])
        elif c == 2:
            h_in[m] = h[m].detach().requires_grad_()
            y[m] = run(2, m, h_in[m])
        elif c == -2:
            loss = y[m].float().square().mean()
            loss.backward()
            losses.append(loss.detach())
        else:
            h[m].backward(h_in[m].grad)
    return losses


@pytest.mark.parametrize("reuse", [False, True])
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_pipeline_order_training_equals_eager(recipe_name, reuse):
    """Two chunks of one layer, two microbatches: pass (chunk c, microbatch m) is graphed
    function (c - 1) * 2 + m; replays in the captured order give eager's losses and grads."""
    fp8 = RECIPES[recipe_name]
    on = fp8 is not None
    eager, graphed = linears(2), linears(2)
    order = [1, 2, -2, -1, 1, 2, -2, -1] if reuse else [1, 2, 1, 2, -2, -1, -2, -1]
    samples = [(rand(),), (rand(),), (rand(True),), (rand(True),)]
    fns = te.make_graphed_callables(
        tuple(graphed), samples, _order=order, enabled=on, recipe=fp8,
        _reuse_graph_input_output_buffers=reuse,
    )  # fmt: skip
    assert len(fns) == 4 and all("forward" not in layer.__dict__ for layer in graphed)

    def run_eager(chunk, micro, x):
        with te.autocast(enabled=on, recipe=fp8):
            return eager[chunk - 1](x)

    def run_graphed(chunk, micro, x):
        return fns[(chunk - 1) * 2 + micro](x)

    opt_e = torch.optim.SGD([p for layer in eager for p in layer.parameters()], lr=0.1)
    opt_g = torch.optim.SGD([p for layer in graphed for p in layer.parameters()], lr=0.1)
    for step in range(3):
        xs = [rand(), rand()]
        losses_e = pipeline_step(order, run_eager, xs)
        losses_g = pipeline_step(order, run_graphed, xs)
        assert all(torch.equal(a, b) for a, b in zip(losses_e, losses_g, strict=True)), step
        for pe, pg in zip(eager, graphed, strict=True):
            for a, b in zip(pe.parameters(), pg.parameters(), strict=True):
                assert torch.equal(a.grad, b.grad), step
        opt_e.step()
        opt_g.step()
        opt_e.zero_grad(set_to_none=True)
        opt_g.zero_grad(set_to_none=True)


def test_reset_frees_the_graphs_and_gives_the_forward_back():
    (eager,), (layer,) = linears(1), linears(1)
    x = rand()
    graphed = te.make_graphed_callables(layer, (x,))
    assert torch.equal(graphed(x), eager(x))
    graphed.reset()
    assert "forward" not in graphed.__dict__
    assert torch.equal(graphed(x), eager(x))  # the module's own forward
    again = te.make_graphed_callables(graphed, (x,))  # and it can be captured again
    assert torch.equal(again(x), eager(x))
    (fn,) = te.make_graphed_callables((linears(1)[0],), [(x,)], _order=[1, -1])
    assert torch.equal(fn(x), eager(x))
    fn.reset()
    with pytest.raises(RuntimeError, match="freed by reset"):
        fn(x)


def test_warmup_and_capture_time_hooks_run_outside_the_graphs():
    events = []

    def note(name):
        def hook(*args):
            events.append((name, torch.cuda.is_current_stream_capturing()))

        return hook

    hooks = [{"forward_pre_hooks": {0: note("fwd")}, "backward_pre_hooks": {0: note("bwd")}}]
    x = rand(True)
    graphed = te.make_graphed_callables(
        linears(1)[0], (x,), num_warmup_iters=2, pre_warmup_hook=note("pre"),
        post_warmup_hook=note("post"), capture_time_hooks=hooks,
    )  # fmt: skip
    names = ["pre", "fwd", "bwd", "fwd", "bwd", "post", "fwd", "bwd"]
    assert events == [(name, False) for name in names]
    graphed(rand(True)).float().sum().backward()
    assert len(events) == len(names)  # replays run no hook


def test_enabled_per_module():
    """enabled=(True, False): the first module's graphs run FP8, the second's bf16."""
    fp8 = RECIPES["current"]
    eager, graphed = linears(2), linears(2)
    first, second = te.make_graphed_callables(
        tuple(graphed), ((rand(True),), (rand(True),)), enabled=(True, False), recipe=fp8
    )
    for step in range(3):
        x = rand()
        with te.autocast(recipe=fp8):
            h = eager[0](x)
        with te.autocast(enabled=False):
            y_e = eager[1](h)
        y_g = second(first(x))
        assert torch.equal(y_e, y_g), step
        y_e.float().square().mean().backward()
        y_g.float().square().mean().backward()
        params = [
            [p for layer in layers for p in layer.parameters()] for layers in (eager, graphed)
        ]
        assert_same_grads(*params, step)
    with te.autocast(enabled=False):
        assert not torch.equal(eager[1](eager[0](x)), y_e)  # the first did run in FP8


@pytest.mark.parametrize(
    "option", ["_clone_param_grads_on_return", "retain_graph_in_backward", "capture_stream"]
)
def test_capture_options_keep_training_equal_to_eager(option):
    fp8 = RECIPES["current"]
    value = {
        "_clone_param_grads_on_return": False,
        "retain_graph_in_backward": True,
        "capture_stream": torch.cuda.Stream(),
    }[option]
    torch.manual_seed(2)
    eager = te.LayerNormMLP(256, 1024, **KW)
    torch.manual_seed(2)
    graphed = te.LayerNormMLP(256, 1024, **KW)
    graphed = te.make_graphed_callables(
        graphed, (rand(True),), enabled=True, recipe=fp8, **{option: value}
    )
    for step in range(3):
        x = rand()
        with te.autocast(recipe=fp8):
            loss_e = eager(x.clone().requires_grad_()).float().square().mean()
        loss_g = graphed(x.clone().requires_grad_()).float().square().mean()
        assert torch.equal(loss_e, loss_g), step
        loss_e.backward()
        loss_g.backward()
        assert_same_grads(eager.parameters(), graphed.parameters(), step)


class DefersWgrad(torch.nn.Module):
    """Stands for a module built with delay_wgrad_compute=True."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8, device="cuda")

    def forward(self, x):
        return self.linear(x)

    def need_backward_dw(self) -> bool:
        return True

    def backward_dw(self) -> None:
        pass


def test_modules_deferring_weight_gradients_are_refused():
    module = DefersWgrad()
    with pytest.raises(NotImplementedError, match="delay_wgrad_compute"):
        te.make_graphed_callables(module, (torch.randn(4, 8, device="cuda"),))
    assert "forward" not in module.__dict__
