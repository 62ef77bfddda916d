"""make_graphed_callables with Transformer Engine's semantics on a GPU: FP8 weight caching
across microbatches (cache_quantized_params / fp8_weight_caching), te.ops layers under delayed
scaling, capture-time hooks that take the module alone, and gradients of parameters marked
skip_backward_post_hook kept as aliases."""

from __future__ import annotations

import copy

import pytest
import torch

import torchte as te
from torchte.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling

pytestmark = pytest.mark.gpu

RECIPES = {
    "delayed": DelayedScaling(),
    "current": Float8CurrentScaling(),
    "block": Float8BlockScaling(),
}
HIDDEN, HEADS = 64, 2


def make(kind: str, layers: int = 2) -> torch.nn.Sequential:
    torch.manual_seed(0)
    kw = {"params_dtype": torch.bfloat16, "device": "cuda"}
    build = {
        "linear": lambda: te.Linear(HIDDEN, HIDDEN, **kw),
        "layernorm_linear": lambda: te.LayerNormLinear(HIDDEN, HIDDEN, **kw),
        "layernorm_mlp": lambda: te.LayerNormMLP(HIDDEN, HIDDEN, **kw),
        "mlp_checkpoint": lambda: te.LayerNormMLP(HIDDEN, HIDDEN, checkpoint=True, **kw),
        "ops_linear": lambda: te.ops.Sequential(
            te.ops.Linear(HIDDEN, HIDDEN, device="cuda", dtype=torch.bfloat16)
        ),
        "transformer": lambda: te.TransformerLayer(
            HIDDEN, HIDDEN, HEADS, hidden_dropout=0.0, attention_dropout=0.0,
            fuse_qkv_params=True, **kw,
        ),
    }[kind]  # fmt: skip
    return torch.nn.Sequential(*(build() for _ in range(layers)))


class _Forwarding(torch.nn.Sequential):
    """Passes is_first_microbatch to every layer, as a training loop with weight caching does."""

    def forward(self, x, **kwargs):
        for layer in self:
            x = layer(x, **kwargs)
        return x


def train(model, fp8, steps: int = 3, microbatches: int = 2):
    """Outputs, parameters and gradients of SGD steps of `microbatches` microbatches each."""
    torch.manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=False)
        for micro in range(microbatches):
            x = torch.randn(32, 2, HIDDEN, device="cuda", dtype=torch.bfloat16)
            x.requires_grad_()
            dy = torch.randn_like(x)
            with te.autocast(recipe=fp8):
                y = model(x, is_first_microbatch=micro == 0)
            y.backward(dy)
            seen += [y.detach().clone(), x.grad.clone()]
        optimizer.step()
    seen += [t.detach().clone() for p in model.parameters() for t in (p, p.grad)]
    return seen


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize(
    "kind", ["linear", "layernorm_linear", "layernorm_mlp", "mlp_checkpoint", "transformer"]
)
def test_weight_caching_replays_equal_eager(kind, recipe_name):
    """With weight caching, a later microbatch's replay uses the FP8 weight the first one cast,
    as eager layers do with is_first_microbatch=False: every output and gradient equal."""
    fp8 = RECIPES[recipe_name]
    eager = _Forwarding(*make(kind))
    whole = _Forwarding(*copy.deepcopy(list(eager)))
    sample = torch.ones(32, 2, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for p in whole.parameters():
        p.grad = torch.zeros_like(p)
    graphed = te.make_graphed_callables(
        whole, (sample,), num_warmup_iters=3, enabled=True, recipe=fp8,
        cache_quantized_params=True,
    )  # fmt: skip
    want = train(eager, fp8)
    got = train(graphed, fp8)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), i
    with pytest.raises(ValueError, match="is_first_microbatch"):
        graphed(sample)


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_ops_layers_replay_equal_eager(recipe_name):
    """te.ops layers (whose basic operations hold the FP8 state outside the module tree): the
    warm-up leaves their delayed-scaling state as it was, so replays equal eager steps."""
    fp8 = RECIPES[recipe_name]
    eager = make("ops_linear", layers=3)
    whole = copy.deepcopy(eager)
    sample = torch.ones(32, 2, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed = te.make_graphed_callables(
        whole, (sample,), num_warmup_iters=3, enabled=True, recipe=fp8
    )
    want = train(_Plain(eager), fp8)
    got = train(_Plain(graphed), fp8)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), i


class _Plain(torch.nn.Module):
    """Calls a model without is_first_microbatch (te.ops layers take none)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x, **kwargs):
        return self.model(x)


def test_capture_time_hooks_take_the_module_alone():
    """Hooks of one parameter get the module, outside the capture, in the passes' order, at
    every warm-up iteration and the capture; replays call none."""
    modules = (torch.nn.Linear(8, 8, device="cuda"), torch.nn.Linear(8, 8, device="cuda"))
    records = []

    def hook_for(index, name):
        def hook(module):
            assert module is modules[index]
            assert not torch.cuda.is_current_stream_capturing()
            records.append((index, name))

        return hook

    names = ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")
    hooks = [{name: {0: hook_for(i, name)} for name in names} for i in range(2)]
    samples = tuple((torch.ones(4, 8, device="cuda", requires_grad=True),) for _ in modules)
    graphed = te.make_graphed_callables(
        modules, samples, num_warmup_iters=2, capture_time_hooks=hooks
    )
    one_pass = [
        (0, "forward_pre_hooks"), (0, "forward_hooks"), (1, "forward_pre_hooks"),
        (1, "forward_hooks"), (1, "backward_pre_hooks"), (1, "backward_hooks"),
        (0, "backward_pre_hooks"), (0, "backward_hooks"),
    ]  # fmt: skip
    assert records == one_pass * 3
    for module in graphed:
        module(torch.randn(4, 8, device="cuda", requires_grad=True)).sum().backward()
    assert records == one_pass * 3


def test_skipped_parameter_gradient_keeps_its_alias():
    """skip_backward_post_hook (set before the capture): the parameter's gradient is the
    graph's static buffer at every replay; others get fresh tensors."""
    model = torch.nn.Linear(64, 64, bias=True, device="cuda")
    model.weight.skip_backward_post_hook = True
    sample = torch.ones(8, 64, device="cuda")
    graphed = te.make_graphed_callables(model, (sample,))
    grads = []  # kept alive, so that a fresh tensor cannot take a freed one's address
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        graphed(torch.randn(8, 64, device="cuda")).sum().backward()
        grads.append((model.weight.grad, model.bias.grad))
    assert grads[0][0].data_ptr() == grads[1][0].data_ptr()
    assert grads[0][1].data_ptr() != grads[1][1].data_ptr()
