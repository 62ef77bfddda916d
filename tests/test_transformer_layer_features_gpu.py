"""te.TransformerLayer and te.MultiheadAttention on a GPU: make_graphed_callables captures them
(replays equal eager training step after step, in bf16 and under both FP8 recipes, main_grad
too) and CPU offloading with CUDA copies loses nothing (gradients bit-identical)."""

from __future__ import annotations

import pytest
import torch
from test_offload import offloaded_tensors
from test_transformer_layer_features import (
    FP8_DTYPES,
    RECIPES,
    assert_same,
    make,
    sample,
    train_step,
    twin_of,
)

import torchte as te
from torchte.offload.copies import CudaCopies

pytestmark = pytest.mark.gpu


def _pair(kind: str, **kwargs):
    with torch.device("cuda"):
        first = make(kind, **kwargs)
        return first, twin_of(first, kind, **kwargs)


def _loss(module, x) -> torch.Tensor:
    out = module(x.clone().requires_grad_(True))
    return (out[0] if isinstance(out, tuple) else out).float().square().mean()


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("kind", ["layer", "mha"])
def test_graphed_training_equals_eager(kind, recipe_name):
    """Loss and every gradient bit-identical over steps an optimizer moves the weights
    between (delayed scaling's scales move in the graph as in eager)."""
    fp8 = RECIPES[recipe_name]()
    eager, graphed = _pair(kind)
    sample_x = sample(0).cuda().requires_grad_(True)
    graphed = te.make_graphed_callables(graphed, (sample_x,), enabled=fp8 is not None, recipe=fp8)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_g = torch.optim.SGD(graphed.parameters(), lr=0.1)
    for step in range(4):
        x = sample(step + 1).cuda()
        with te.autocast(enabled=fp8 is not None, recipe=fp8):
            loss_e = _loss(eager, x)
        loss_g = _loss(graphed, x)
        loss_e.backward()
        loss_g.backward()
        assert torch.equal(loss_e, loss_g), step
        for (name, pe), pg in zip(eager.named_parameters(), graphed.parameters(), strict=True):
            assert torch.equal(pe.grad, pg.grad), f"{step}: {name}"
        opt_e.step()
        opt_g.step()
        opt_e.zero_grad(set_to_none=False)
        opt_g.zero_grad(set_to_none=False)


@pytest.mark.parametrize("recipe_name", ["bf16", "current"])
def test_graphed_layer_accumulates_into_main_grad(recipe_name):
    fp8 = RECIPES[recipe_name]()
    kw = {"fuse_qkv_params": True, "fuse_wgrad_accumulation": True}
    eager, graphed = _pair("layer", **kw)
    weights = [
        (pe, pg)
        for pe, pg in zip(eager.parameters(), graphed.parameters(), strict=True)
        if pe.dim() == 2
    ]
    for pe, pg in weights:
        pe.main_grad = torch.zeros(pe.shape, device="cuda")
        pg.main_grad = torch.zeros(pg.shape, device="cuda")
    sample_x = sample(0).cuda().requires_grad_(True)
    graphed = te.make_graphed_callables(graphed, (sample_x,), enabled=fp8 is not None, recipe=fp8)
    assert all(torch.count_nonzero(pg.main_grad) == 0 for _, pg in weights)  # warm-up: no trace
    for step in range(3):
        x = sample(step + 1).cuda()
        with te.autocast(enabled=fp8 is not None, recipe=fp8):
            _loss(eager, x).backward()
        _loss(graphed, x).backward()
        for pe, pg in weights:
            assert torch.equal(pe.main_grad, pg.main_grad), step
    assert all(torch.count_nonzero(pg.main_grad) > 0 for _, pg in weights)


class CountingCudaCopies(CudaCopies):
    """CudaCopies that records the dtype of every tensor it moved out."""

    def __init__(self) -> None:
        super().__init__()
        self.moved: list[torch.dtype] = []

    def to_host(self, tensor, host):
        self.moved.append(tensor.dtype)
        return super().to_host(tensor, host)


@pytest.mark.parametrize("retain", [False, True])
@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("kind", ["layer", "mha"])
def test_offloaded_gradients_are_bit_identical(kind, recipe_name, retain):
    fp8 = RECIPES[recipe_name]()
    with torch.device("cuda"):
        modules = [make(kind, seed=i) for i in range(3)]
        twins = [twin_of(m, kind) for m in modules]
    copies = CountingCudaCopies()
    context, sync = te.get_cpu_offload_context(
        enabled=True, num_layers=2, model_layers=3, retain_pinned_cpu_buffers=retain,
        min_offload_bytes=0, copies=copies,
    )  # fmt: skip
    offloaded_saves = offloaded_tensors(context.handler)

    def offloaded(module, h):
        with context:
            out = module(h)
        return sync(out[0] if isinstance(out, tuple) else out)

    for step in range(3):
        x = sample(step).cuda()
        want_y, want = train_step(twins, x, fp8)
        got_y, got = train_step(modules, x, fp8, offloaded)
        assert torch.equal(got_y, want_y), step
        assert_same(got, want, f"{kind} {recipe_name} step {step}")
    assert copies.moved, "nothing was offloaded"
    if fp8 is not None:
        assert any(dtype in FP8_DTYPES for dtype, _ in offloaded_saves), offloaded_saves
    assert (context.handler.pooled_buffers() > 0) == retain
