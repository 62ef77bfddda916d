"""te.make_graphed_callables: arguments, the CPU behaviour (eager under the given autocast
arguments), and the capture-time rule that FP8 weights are requantized at every call."""

from __future__ import annotations

import pytest
import torch

import torchte as te
from torchte.graphs.hooks import capture_hooks
from torchte.graphs.schedule import pipeline_schedule, reused_samples
from torchte.module._weight_cache import cached_value
from torchte.recipe import DelayedScaling, Float8CurrentScaling

pytestmark = pytest.mark.usefixtures("cpu_default_device")


def twins(seed: int = 0):
    layers = []
    for _ in range(2):
        torch.manual_seed(seed)
        layers.append(te.Linear(32, 32, params_dtype=torch.bfloat16))
    return layers


def test_on_the_cpu_modules_run_eagerly_under_the_autocast_arguments():
    graphed, eager = twins()
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    fp8 = DelayedScaling(amax_history_len=4)
    result = te.make_graphed_callables(graphed, (x,), fp8_enabled=True, fp8_recipe=fp8)
    assert result is graphed
    for step in range(3):
        xs = torch.randn(
            16, 32, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(step)
        )
        ya = graphed(xs.clone().requires_grad_())
        with te.autocast(recipe=fp8):
            yb = eager(xs.clone().requires_grad_())
        assert torch.equal(ya, yb), step
        ya.float().sum().backward()
        yb.float().sum().backward()
        assert torch.equal(graphed.weight.grad, eager.weight.grad), step
    with te.autocast(enabled=False):
        plain = eager(x)
    assert not torch.equal(graphed(x), plain)  # FP8 really ran


def test_transformer_engine_2x_argument_names():
    """enabled / recipe (2.x's names of fp8_enabled / fp8_recipe) work as the old ones do; the
    2.x capture options are accepted and checked."""
    graphed, eager = twins(1)
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    fp8 = DelayedScaling(amax_history_len=4)
    te.make_graphed_callables(
        graphed, (x,), enabled=True, recipe=fp8, amax_reduction_group=None,
        cache_quantized_params=False, clone_param_grads_on_return=True,
        _clone_param_grads_on_return=True, _reuse_graph_input_output_buffers=False,
        retain_graph_in_backward=True, pre_warmup_hook=lambda: None, post_warmup_hook=None,
        capture_time_hooks=[{"forward_pre_hooks": {0: lambda module, args: None}}],
        capture_stream=None,
    )  # fmt: skip
    with te.autocast(recipe=fp8):
        want = eager(x)
    assert torch.equal(graphed(x), want)
    layer = te.Linear(32, 32)
    with pytest.raises(ValueError, match="enabled=True and fp8_enabled=False disagree"):
        te.make_graphed_callables(layer, (x,), enabled=True, fp8_enabled=False)
    with pytest.raises(ValueError, match="_clone_param_grads_on_return=True and clone_param"):
        te.make_graphed_callables(
            layer, (x,), clone_param_grads_on_return=False, _clone_param_grads_on_return=True
        )
    cached = te.Linear(32, 32)
    graphed = te.make_graphed_callables(cached, (x,), cache_quantized_params=True)
    assert torch.equal(graphed(x, is_first_microbatch=False), cached(x))
    with pytest.raises(TypeError, match="not_an_option"):
        te.make_graphed_callables(layer, (x,), not_an_option=1)
    assert "forward" not in layer.__dict__


def test_bad_arguments():
    layer = te.Linear(32, 32)
    x = torch.randn(4, 32)
    bad = [
        ((layer, (x,)), {"sample_kwargs": {"a": 1}}, TypeError, "tensors or None"),
        ((layer, (x,)), {"sample_kwargs": [{}]}, TypeError, "sample_kwargs must be dicts"),
        (((lambda t: t,), ((x,),)), {}, TypeError, r"nn\.Modules"),
        (((layer, layer), ((x,),)), {}, ValueError, "one tuple"),
        (((layer, layer), ((x,), (x,))), {"sample_kwargs": ({},)}, ValueError, "one dict"),
        ((layer, (x, 3)), {}, TypeError, "only tensors"),
        ((layer, (x,)), {"num_warmup_iters": 0}, ValueError, "num_warmup_iters"),
        ((layer, (x,)), {"enabled": (True, False)}, ValueError, "2 entries for 1 modules"),
        ((layer, (x,)), {"enabled": 1}, TypeError, "enabled must be a bool"),
        ((layer, (x,)), {"pre_warmup_hook": 3}, TypeError, "pre_warmup_hook must be callable"),
        ((layer, (x,)), {"capture_stream": "s"}, TypeError, "capture_stream"),
        ((layer, (x,)), {"retain_graph_in_backward": None}, TypeError, "retain_graph"),
        ((layer, (x,)), {"capture_time_hooks": {"pre": []}}, TypeError, "a list"),
        ((layer, (x,)), {"capture_time_hooks": [None, None]}, ValueError, "2 entries"),
        ((layer, (x,)), {"capture_time_hooks": [{"pre": {}}]}, ValueError, "unknown keys"),
        ((layer, (x,)), {"capture_time_hooks": [{"forward_hooks": {0: 1}}]}, TypeError, "call"),
        ((layer, (x,)), {"_num_layers_per_chunk": 1}, ValueError, "without _order"),
        ((layer, (x,)), {"_reuse_graph_input_output_buffers": True}, ValueError, "needs _order"),
    ]
    for args, kwargs, error, match in bad:
        with pytest.raises(error, match=match):
            te.make_graphed_callables(*args, **kwargs)
    assert "forward" not in layer.__dict__  # nothing was changed by the refused calls


class Scaled(torch.nn.Module):
    """A te.Linear whose output is scaled by a keyword tensor argument."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = te.Linear(32, 32, params_dtype=torch.bfloat16)

    def forward(self, x, *, scale, shift=None):
        y = self.linear(x) * scale
        return y if shift is None else y + shift


def test_sample_kwargs_and_per_module_enabled_on_the_cpu():
    """Keyword sample arguments are accepted; a tuple of `enabled` runs each module under its
    own setting (the first in FP8, the second not)."""
    torch.manual_seed(3)
    first, second = Scaled(), Scaled()
    reference = [Scaled(), Scaled()]
    for ref, module in zip(reference, (first, second), strict=True):
        ref.load_state_dict(module.state_dict())
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    scale = torch.full((32,), 0.5, dtype=torch.bfloat16)
    fp8 = DelayedScaling(amax_history_len=4)
    got = te.make_graphed_callables(
        (first, second), ((x,), (x,)), sample_kwargs=({"scale": scale}, {"scale": scale}),
        enabled=(True, False), recipe=fp8,
    )  # fmt: skip
    assert got == (first, second)
    with te.autocast(recipe=fp8):
        want_first = reference[0](x, scale=scale)
    assert torch.equal(first(x, scale=scale), want_first)
    with te.autocast(enabled=False):
        want_second = reference[1](x, scale=scale, shift=x)
    assert torch.equal(second(x, scale=scale, shift=x), want_second)
    with te.autocast(enabled=False):
        assert not torch.equal(reference[0](x, scale=scale), want_first)  # FP8 really ran


def test_reset_gives_the_module_its_forward_back():
    graphed, eager = twins(2)
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    te.make_graphed_callables(graphed, (x,), fp8_enabled=True)
    assert "forward" in graphed.__dict__ and callable(graphed.backward_dw)
    graphed.reset()
    assert "forward" not in graphed.__dict__
    assert torch.equal(graphed(x), eager(x))  # its own forward: no FP8 outside autocast
    graphed.reset()  # a second reset changes nothing


class DefersWgrad(torch.nn.Module):
    """Stands for a module built with delay_wgrad_compute=True."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.runs = 0

    def forward(self, x):
        return self.linear(x)

    def need_backward_dw(self) -> bool:
        return True

    def backward_dw(self) -> None:
        self.runs += 1


def test_backward_dw_runs_the_deferred_weight_gradients_on_the_cpu():
    module = DefersWgrad()
    graphed = te.make_graphed_callables(module, (torch.randn(4, 8),))
    graphed.backward_dw()
    assert module.runs == 1
    (layer,) = te.make_graphed_callables((DefersWgrad(),), [(torch.randn(4, 8),)], _order=[1, -1])
    layer.backward_dw()
    assert layer.backward_dw.args[0].runs == 1


def test_pipeline_order_on_the_cpu():
    """_order: one eager function per forward pass (chunk-major, then microbatch, then layer),
    each running its layer under the autocast arguments; reset() ends it."""
    torch.manual_seed(4)
    layers = [te.Linear(16, 16) for _ in range(3)]  # chunk 1: layers 0, 1; chunk 2: layer 2
    samples = [(torch.randn(4, 16),) for _ in range(6)]
    order = [1, 1, 2, -2, 2, -2, -1, -1]
    fp8 = Float8CurrentScaling()  # no scaling state: a layer called twice quantizes alike
    fns = te.make_graphed_callables(
        tuple(layers), samples, _order=order, _num_layers_per_chunk=[2, 1], enabled=True,
        recipe=fp8,
    )  # fmt: skip
    assert isinstance(fns, tuple) and len(fns) == 6
    for p, layer in enumerate([0, 1, 0, 1, 2, 2]):
        with te.autocast(recipe=fp8):
            want = layers[layer](samples[p][0])
        assert torch.equal(fns[p](samples[p][0]), want), p
    assert all("forward" not in layer.__dict__ for layer in layers)
    fns[0].reset()
    with pytest.raises(RuntimeError, match="reset"):
        fns[0](samples[0][0])
    assert fns[1](samples[1][0]).shape == (4, 16)


@pytest.mark.parametrize(
    ("order", "layers", "counts", "error", "match"),
    [
        ([1, 2, -1], None, (2, 2), ValueError, "as often forward"),
        ([1, -1, -1, 1], None, (1, 2), ValueError, "a backward needs its forward first"),
        ([1, 1, 1, -1], None, (1, 2), ValueError, "more often than its forwards allow"),
        ([1, 2, -2, -3], None, (2, 2), ValueError, "as often forward"),
        ([1, -1], 2, (1, 1), ValueError, "2 layers, but 1 callables"),
        ([1, -1], [1, 1], (1, 1), ValueError, "_num_layers_per_chunk must be"),
        ([1, 1, -1, -1], None, (1, 1), ValueError, "do not split evenly"),
        ([1, 1, -1, -1], 1, (1, 3), ValueError, "one tuple per forward pass"),
        ([1, 0, -1], None, (1, 1), ValueError, "nonzero ints"),
        ([1, -1, -0.5], None, (1, 1), NotImplementedError, "weight-gradient pass"),
        ((), None, (1, 1), TypeError, "non-empty list"),
    ],
)
def test_pipeline_order_is_checked(order, layers, counts, error, match):
    modules = tuple(te.Linear(8, 8) for _ in range(counts[0]))
    samples = [(torch.randn(2, 8),) for _ in range(counts[1])]
    with pytest.raises(error, match=match):
        te.make_graphed_callables(modules, samples, _order=order, _num_layers_per_chunk=layers)


def test_pipeline_schedule_and_buffer_reuse():
    """The passes in capture order, and which passes share static inputs when their chunk's
    backward ran before (equal signatures only)."""
    schedule = pipeline_schedule([1, 2, 1, 2, -2, -1, 1, -2, 2, -1, -1, -2], None, 2, 6)
    assert schedule.callable_of == (0, 0, 0, 1, 1, 1)
    forwards = [p for forward, p in schedule.steps if forward]
    backwards = [p for forward, p in schedule.steps if not forward]
    assert forwards == [0, 3, 1, 4, 2, 5] and backwards == [3, 0, 4, 1, 2, 5]
    x = [torch.randn(4, 8) for _ in range(6)]
    x[5] = torch.randn(4, 9)  # another shape: never shares
    samples = reused_samples(schedule, [((t,), {}) for t in x])
    # Pass 2 (chunk 1, third microbatch) runs after the backwards of passes 3 and 0: it takes
    # pass 3's tensors (the oldest freed); pass 5 keeps its own.
    assert samples[2][0][0] is x[3] and samples[5][0][0] is x[5]
    assert [samples[p][0][0] is x[p] for p in (0, 1, 3, 4)] == [True] * 4


def test_weights_are_requantized_while_capturing():
    cache = [(("key",), "cached")]
    assert cached_value(cache, ("key",), None, False) == "cached"
    assert cached_value(cache, ("other",), False, False) == "cached"
    assert cached_value(cache, ("other",), None, False) is None
    assert cached_value(cache, ("key",), True, False) is None
    assert cached_value(cache, ("key",), None, True) is None
    assert cached_value(cache, ("key",), False, True) is None


def test_capture_time_hooks_are_called_with_transformer_engines_signatures():
    calls = []
    module = torch.nn.Identity()
    entry = {
        "forward_pre_hooks": {0: lambda m, a: calls.append(("pre", a)), 1: lambda *h: None},
        "forward_pre_hooks_with_kwargs": {1: True},
        "forward_hooks": {0: lambda m, a, k, out: calls.append(("fwd", k, out))},
        "forward_hooks_with_kwargs": {0: True},
        "backward_pre_hooks": {0: lambda m, g: calls.append(("bwd_pre", g))},
        "backward_hooks": {7: lambda m, gi, go: calls.append(("bwd", gi, go))},
    }
    (hooks,) = capture_hooks([entry], 1)
    hooks.before_forward(module, (1,), {"k": 2})
    hooks.after_forward(module, (1,), {"k": 2}, "out")
    hooks.before_backward(module, ("g",))
    hooks.after_backward(module, ("gi",), ("g",))
    assert calls == [
        ("pre", (1,)),
        ("fwd", {"k": 2}, "out"),
        ("bwd_pre", ("g",)),
        ("bwd", ("gi",), ("g",)),
    ]
    (returning,) = capture_hooks([{"backward_hooks": {0: lambda m, gi, go: gi}}], 1)
    with pytest.raises(RuntimeError, match="backward_hooks must return None"):
        returning.after_backward(module, ("gi",), ("g",))
    (none,) = capture_hooks([None], 1)
    none.before_forward(module, (), {})  # no hooks: nothing runs


def test_attention_module_takes_the_graphed_forward_without_a_setattr_warning():
    """DotProductAttention guards its attributes as te modules do: installing the graphed
    forward goes through _fast_setattr (a plain assignment would warn, an error here)."""
    attention = te.DotProductAttention(2, 16)
    q, k, v = (torch.randn(8, 2, 2, 16) for _ in range(3))
    graphed = te.make_graphed_callables(attention, (q, k, v))
    assert "forward" in graphed.__dict__
    assert torch.equal(graphed(q, k, v), type(attention).forward(attention, q, k, v))
