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
        module = te.LayerNormLinear(H, F, **common, **kw)
    else:
        module = te.LayerNormMLP(H, F, activation="swiglu", **common, **kw)
    # The reference runs the module's Function too: without FP8 a plain module would take
    # torch's own ops instead (its `_plain` shortcut), which round elsewhere.
    module._fast_setattr("_plain", False)
    return module


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


# -- te.GroupedLinear ----------------------------------------------------------------------------

G = 3
SPLITS = [16, 0, 32]  # an empty group too


def _grouped(delay: bool, dtype, single: bool, fuse: bool = False, device="cpu"):
    torch.manual_seed(3)
    return te.GroupedLinear(
        G, H, F, params_dtype=dtype, single_grouped_weight=single, delay_wgrad_compute=delay,
        fuse_wgrad_accumulation=fuse, device=device,
    )  # fmt: skip


def _grouped_step(module, x, recipe, splits):
    x = x.clone().requires_grad_(True)
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        out = module(x, splits)
    gen = torch.Generator().manual_seed(5)
    dy = representable(out.shape, torch.bfloat16, scale=0.25, generator=gen).to(out.dtype)
    out.backward(dy.to(out.device))
    return x.grad


def _grouped_inputs(n: int, dtype, device="cpu"):
    gen = torch.Generator().manual_seed(11)
    rows = sum(SPLITS)
    return [
        representable((rows, H), torch.bfloat16, generator=gen).to(dtype).to(device)
        for _ in range(n)
    ]


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("single", [False, True], ids=["per_group", "single"])
@pytest.mark.parametrize("device_splits", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_backward_dw_equals_the_ordinary_backward(recipe, single, device_splits, dtype):
    ref, mod = _grouped(False, dtype, single), _grouped(True, dtype, single)
    splits = torch.tensor(SPLITS) if device_splits else SPLITS
    x1, x2 = _grouped_inputs(2, dtype)
    dx = _grouped_step(mod, x1, recipe, splits)
    _grouped_step(mod, x2, recipe, splits)  # two backwards wait
    assert len(mod._wgrad_store) == 2
    assert all(p.grad is None for n, p in mod.named_parameters() if n.startswith("weight"))
    assert torch.equal(dx, _grouped_step(ref, x1, recipe, splits))
    mod.backward_dw()  # the first backward's only
    for (name, p), q in zip(mod.named_parameters(), ref.parameters(), strict=True):
        if name.startswith("weight"):
            assert torch.equal(p.grad, q.grad), name
    _grouped_step(ref, x2, recipe, splits)
    mod.backward_dw()
    for (name, p), q in zip(mod.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("single", [False, True], ids=["per_group", "single"])
def test_grouped_backward_dw_accumulates_into_main_grad(recipe, single):
    dtype = torch.bfloat16
    ref, mod = _grouped(False, dtype, single, fuse=True), _grouped(True, dtype, single, fuse=True)
    for module in (ref, mod):
        for n, w in module.named_parameters():
            if n.startswith("weight"):
                w.main_grad = torch.full(w.shape, 0.5, dtype=torch.float32)
                w.grad_added_to_main_grad = False
    x = _grouped_inputs(1, dtype)[0]
    _grouped_step(ref, x, recipe, SPLITS)
    _grouped_step(mod, x, recipe, SPLITS)
    weights = [(w, r) for (n, w), r in zip(mod.named_parameters(), ref.parameters(), strict=True)]
    weights = [(w, r) for w, r in weights if hasattr(w, "main_grad")]
    for w, _ in weights:
        assert torch.equal(w.main_grad, torch.full_like(w.main_grad, 0.5))
        assert w.grad_added_to_main_grad is True
    mod.backward_dw()
    for w, r in weights:
        assert torch.equal(w.main_grad, r.main_grad)


@pytest.mark.gpu
@pytest.mark.parametrize("single", [False, True], ids=["per_group", "single"])
def test_grouped_backward_dw_on_the_grouped_gemm_path(single):
    """bf16 on the GPU: the one grouped wgrad GEMM is what backward_dw runs."""
    dtype = torch.bfloat16
    ref, mod = (
        _grouped(False, dtype, single, device="cuda"),
        _grouped(True, dtype, single, device="cuda"),
    )
    splits = torch.tensor(SPLITS, device="cuda")
    x = _grouped_inputs(1, dtype, "cuda")[0]
    assert torch.equal(_grouped_step(mod, x, None, splits), _grouped_step(ref, x, None, splits))
    assert mod._last_plan[1].mode == "grouped"
    assert [g for g, _ in mod._wgrad_store._entries[0]] == [-1]  # one step for all groups
    mod.backward_dw()
    for p, q in zip(mod.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("recipe", [None, Float8CurrentScaling()], ids=["hp", "current"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("delay", [False, True], ids=["now", "deferred"])
def test_grouped_save_original_input(recipe, dtype, delay):
    ref = _grouped(False, dtype, False)
    torch.manual_seed(3)
    mod = te.GroupedLinear(
        G, H, F, params_dtype=dtype, save_original_input=True, delay_wgrad_compute=delay,
        device="cpu",
    )  # fmt: skip
    x = _grouped_inputs(1, torch.float32)[0].requires_grad_(True)  # fp32: no copy kept
    saved = []
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t)
    with hooks, te.autocast(enabled=recipe is not None, recipe=recipe):
        out = mod(x, SPLITS)
    gen = torch.Generator().manual_seed(5)
    out.backward(representable(out.shape, torch.bfloat16, scale=0.25, generator=gen).to(out.dtype))
    assert torch.equal(x.grad, _grouped_step(ref, x.detach(), recipe, SPLITS))
    mod.backward_dw()
    for p, q in zip(mod.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    x_storage = x.untyped_storage().data_ptr()
    kept = [t for t in saved if t.untyped_storage().data_ptr() == x_storage]
    assert sum(t.numel() for t in kept) == x.numel()  # the input itself, all of its rows
    with pytest.raises(NotImplementedError, match="DelayedScaling"):
        _grouped_step(mod, x, DelayedScaling(), SPLITS)
