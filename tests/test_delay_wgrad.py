"""delay_wgrad_compute=True with module.backward_dw(), and te.Linear's save_original_input.

The deferred path must give the very gradients of the ordinary one (bit for bit: the same GEMMs
on the same operands, only later), leave the weights' gradients untouched until backward_dw,
run one backward's GEMMs per backward_dw call in order, and honour main_grad fusion.
"""

from __future__ import annotations

import pytest
import torch
from tolerances import representable

import torchte as te
from torchte.module._deferred_wgrad import WgradStore
from torchte.recipe import DelayedScaling, Float8CurrentScaling

pytestmark = pytest.mark.usefixtures("cpu_default_device")

H, F = 32, 48
RECIPES = [None, DelayedScaling(amax_history_len=4), Float8CurrentScaling()]
RECIPE_IDS = ["hp", "delayed", "current"]


def _build(kind: str, delay: bool, dtype, fuse: bool = False, **kw):
    torch.manual_seed(3)
    common = dict(params_dtype=dtype, delay_wgrad_compute=delay, fuse_wgrad_accumulation=fuse)
    if kind == "linear":
        return te.Linear(H, F, **common, **kw)
    if kind == "linear_split":
        return te.Linear(H, F, parameters_split={"a": 16, "b": 32}, **common, **kw)
    if kind == "ln_linear":
        return te.LayerNormLinear(H, F, **common, **kw)
    return te.LayerNormMLP(H, F, activation="swiglu", **common, **kw)


def _weights(module) -> list[torch.nn.Parameter]:
    return [p for n, p in module.named_parameters() if n.endswith("weight") and p.dim() == 2]


def _inputs(n: int, dtype, tokens: int = 16):
    gen = torch.Generator().manual_seed(11)
    return [representable((tokens, H), torch.bfloat16, generator=gen).to(dtype) for _ in range(n)]


def _step(module, x, recipe):
    x = x.clone().requires_grad_(True)
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        out = module(x)
    out = out[0] if isinstance(out, tuple) else out
    gen = torch.Generator().manual_seed(5)
    dy = representable(out.shape, torch.bfloat16, scale=0.25, generator=gen).to(out.dtype)
    out.backward(dy)
    return x.grad


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("kind", ["linear", "linear_split", "ln_linear", "mlp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backward_dw_equals_the_ordinary_backward(kind, recipe, dtype):
    ref, mod = _build(kind, False, dtype), _build(kind, True, dtype)
    assert mod.need_backward_dw() and not ref.need_backward_dw()
    xs = _inputs(2, dtype)
    for x in xs:  # two microbatches: each backward_dw adds one backward's gradients
        dx_ref, dx = _step(ref, x, recipe), _step(mod, x, recipe)
        assert torch.equal(dx, dx_ref)
        if x is xs[0]:
            assert all(w.grad is None for w in _weights(mod))
        mod.backward_dw()
    for (name, p), p_ref in zip(mod.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None, name
        assert torch.equal(p.grad, p_ref.grad), name
    mod.backward_dw()  # nothing waits: no change
    assert all(
        torch.equal(p.grad, q.grad) for p, q in zip(mod.parameters(), ref.parameters(), strict=True)
    )


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_backward_dw_runs_backwards_in_order(kind, recipe):
    """Two backwards, then two backward_dw: the first call gives the first backward's
    gradients only (a pipeline schedule's B B W W)."""
    dtype = torch.float32
    ref, mod = _build(kind, False, dtype), _build(kind, True, dtype)
    x1, x2 = _inputs(2, dtype)
    _step(mod, x1, recipe)
    _step(mod, x2, recipe)
    assert len(mod._wgrad_store) == 2
    _step(ref, x1, recipe)
    mod.backward_dw()
    for p, q in zip(_weights(mod), _weights(ref), strict=True):
        assert torch.equal(p.grad, q.grad)
    _step(ref, x2, recipe)
    mod.backward_dw()
    for p, q in zip(_weights(mod), _weights(ref), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert len(mod._wgrad_store) == 0


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("kind", ["linear", "ln_linear", "mlp"])
@pytest.mark.parametrize("marked", [False, True], ids=["plain", "megatron"])
def test_backward_dw_accumulates_into_main_grad(kind, recipe, marked):
    dtype = torch.bfloat16
    ref, mod = _build(kind, False, dtype, fuse=True), _build(kind, True, dtype, fuse=True)
    for module in (ref, mod):
        for w in _weights(module):
            w.main_grad = torch.full(w.shape, 0.5, dtype=torch.float32)
            if marked:
                w.grad_added_to_main_grad = False
    x = _inputs(1, dtype)[0]
    _step(ref, x, recipe)
    _step(mod, x, recipe)
    for w in _weights(mod):
        assert torch.equal(w.main_grad, torch.full_like(w.main_grad, 0.5))  # not yet
        assert w.skip_backward_post_hook is True
        if marked:  # marked in backward, as Transformer Engine marks it
            assert w.grad_added_to_main_grad is True
        else:
            assert w.grad is None
    calls = []
    mod.register_wgrad_accumulation_and_reduce_hooks(lambda: calls.append(len(calls)))
    mod.backward_dw()
    assert calls == [0]
    for w, w_ref in zip(_weights(mod), _weights(ref), strict=True):
        assert torch.equal(w.main_grad, w_ref.main_grad)
        assert not torch.equal(w.main_grad, torch.full_like(w.main_grad, 0.5))
    mod.backward_dw()  # nothing waits: the hooks run only with work
    assert calls == [0]


def test_modules_without_delay_have_nothing_to_run():
    for module in (te.Linear(H, F), te.LayerNorm(H), te.RMSNorm(H)):
        assert not module.need_backward_dw()
        module.backward_dw()  # a no-op, as Transformer Engine's
    with pytest.raises(TypeError, match="delay_wgrad_compute must be a bool"):
        te.Linear(H, F, delay_wgrad_compute="yes")
    with pytest.raises(TypeError, match="hook must be callable"):
        te.Linear(H, F).register_wgrad_accumulation_and_reduce_hooks(3)


def test_a_failed_backward_leaves_no_entry():
    store = WgradStore()
    with pytest.raises(RuntimeError, match="boom"), store.one_backward():
        store.put(0, lambda: None)
        raise RuntimeError("boom")
    assert len(store) == 0 and store.pop() is None
    with store.one_backward():
        store.put(1, lambda: "fc2")
        store.put(0, lambda: "fc1")
    store.put(0, lambda: "next")
    assert [g for g, _ in store.pop()] == [1, 0]
    assert [s() for _, s in store.pop()] == ["next"]


def test_no_grad_forward_defers_nothing():
    mod = _build("linear", True, torch.float32)
    with torch.no_grad():
        mod(_inputs(1, torch.float32)[0])
    assert len(mod._wgrad_store) == 0


# -- save_original_input -----------------------------------------------------------------------


def _saved_tensors(module, x, recipe):
    """The tensors autograd saved for the module's backward, and x's gradient."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        dx = _step(module, x, recipe)
    return saved, dx


@pytest.mark.parametrize("recipe", [None, Float8CurrentScaling()], ids=["hp", "current"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_save_original_input_keeps_the_input_and_the_gradients(recipe, dtype):
    ref = _build("linear", False, dtype)
    mod = _build("linear", False, dtype, save_original_input=True)
    x = _inputs(1, torch.float32)[0]  # fp32 input: bf16 layers would save a bf16 copy
    saved_ref, dx_ref = _saved_tensors(ref, x, recipe)
    saved, dx = _saved_tensors(mod, x, recipe)
    assert torch.equal(dx, dx_ref)
    assert torch.equal(mod.weight.grad, ref.weight.grad)
    assert torch.equal(mod.bias.grad, ref.bias.grad)
    assert any(t.dtype == torch.float32 and t.shape == x.shape for t in saved)
    if recipe is not None:  # no FP8 copy of the input is kept
        fp8_x_t = (torch.float8_e4m3fn, (H, 16))  # the input's transpose, as FP8
        assert any((t.dtype, tuple(t.shape)) == fp8_x_t for t in saved_ref)
        assert not any((t.dtype, tuple(t.shape)) == fp8_x_t for t in saved)


def test_save_original_input_with_delay_wgrad():
    ref = _build("linear", False, torch.float32)
    mod = _build("linear", True, torch.float32, save_original_input=True)
    x = _inputs(1, torch.float32)[0]
    recipe = Float8CurrentScaling()
    _step(ref, x, recipe)
    _step(mod, x, recipe)
    mod.backward_dw()
    assert torch.equal(mod.weight.grad, ref.weight.grad)


def test_save_original_input_refuses_delayed_scaling():
    mod = _build("linear", False, torch.float32, save_original_input=True)
    with pytest.raises(NotImplementedError, match="DelayedScaling"):
        _step(mod, _inputs(1, torch.float32)[0], DelayedScaling())
