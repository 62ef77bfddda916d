"""te.make_graphed_callables: arguments, the CPU behaviour (eager under the given autocast
arguments), and the capture-time rule that FP8 weights are requantized at every call."""

from __future__ import annotations

import pytest
import torch

import torchte as te
from torchte.module.base import cached_value
from torchte.recipe import DelayedScaling

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
    2.x capture options are accepted while off."""
    graphed, eager = twins(1)
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    fp8 = DelayedScaling(amax_history_len=4)
    te.make_graphed_callables(
        graphed, (x,), enabled=True, recipe=fp8, amax_reduction_group=None,
        cache_quantized_params=False, clone_param_grads_on_return=False,
        _reuse_graph_input_output_buffers=False,
    )  # fmt: skip
    with te.autocast(recipe=fp8):
        want = eager(x)
    assert torch.equal(graphed(x), want)
    layer = te.Linear(32, 32)
    with pytest.raises(ValueError, match="enabled=True and fp8_enabled=False disagree"):
        te.make_graphed_callables(layer, (x,), enabled=True, fp8_enabled=False)
    with pytest.raises(NotImplementedError, match="fp8_weight_caching"):
        te.make_graphed_callables(layer, (x,), cache_quantized_params=True)
    with pytest.raises(NotImplementedError, match="capture_time_hooks"):
        te.make_graphed_callables(layer, (x,), capture_time_hooks={"pre": []})
    with pytest.raises(TypeError, match="not_an_option"):
        te.make_graphed_callables(layer, (x,), not_an_option=1)
    assert "forward" not in layer.__dict__


def test_bad_arguments():
    layer = te.Linear(32, 32)
    x = torch.randn(4, 32)
    with pytest.raises(NotImplementedError, match="sample_kwargs"):
        te.make_graphed_callables(layer, (x,), sample_kwargs={"a": 1})
    with pytest.raises(TypeError, match=r"nn\.Modules"):
        te.make_graphed_callables((lambda t: t,), ((x,),))
    with pytest.raises(ValueError, match="one tuple"):
        te.make_graphed_callables((layer, layer), ((x,),))
    with pytest.raises(TypeError, match="only tensors"):
        te.make_graphed_callables(layer, (x, 3))
    with pytest.raises(ValueError, match="num_warmup_iters"):
        te.make_graphed_callables(layer, (x,), num_warmup_iters=0)
    assert "forward" not in layer.__dict__  # nothing was changed by the refused calls


def test_weights_are_requantized_while_capturing():
    cache = [(("key",), "cached")]
    assert cached_value(cache, ("key",), None, False) == "cached"
    assert cached_value(cache, ("other",), False, False) == "cached"
    assert cached_value(cache, ("other",), None, False) is None
    assert cached_value(cache, ("key",), True, False) is None
    assert cached_value(cache, ("key",), None, True) is None
    assert cached_value(cache, ("key",), False, True) is None
