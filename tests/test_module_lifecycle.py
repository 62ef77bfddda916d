"""A te module's life around the hot path: inference mode, deferred initialization on the meta
device, reset_parameters, following its parameters to another device, copies, and loading
its FP8 scaling state (extra state) from a state_dict."""

from __future__ import annotations

import copy

import pytest
import torch

import torchte as te
from torchte.module._lifecycle import ExtraStateError
from torchte.recipe import DelayedScaling, Float8CurrentScaling

pytestmark = pytest.mark.usefixtures("cpu_default_device")

H = 32
RECIPES = [DelayedScaling(amax_history_len=4), Float8CurrentScaling()]


def builders(device=None) -> dict:
    """name -> a function building that module (on `device`), each with an RNG-drawn weight."""
    return {
        "Linear": lambda: te.Linear(H, H, device=device),
        "Linear-split": lambda: te.Linear(
            H, 2 * H, parameters_split=("query", "key"), device=device
        ),
        "LayerNormLinear": lambda: te.LayerNormLinear(H, H, device=device),
        "LayerNormMLP": lambda: te.LayerNormMLP(H, 2 * H, normalization="RMSNorm", device=device),
        "GroupedLinear": lambda: te.GroupedLinear(2, H, H, device=device),
        "LayerNorm": lambda: te.LayerNorm(H, zero_centered_gamma=True, device=device),
        "RMSNorm": lambda: te.RMSNorm(H, device=device),
    }


def call(module, x: torch.Tensor, **kwargs):
    """module(x) with the extra arguments its forward needs; the first output."""
    if isinstance(module, te.GroupedLinear):
        return module(x, [x.shape[0] // 2, x.shape[0] - x.shape[0] // 2], **kwargs)
    return module(x, **kwargs)


def train_step(module, recipe, x: torch.Tensor, **kwargs) -> torch.Tensor:
    x = x.clone().requires_grad_()
    with te.autocast(recipe=recipe):
        y = call(module, x, **kwargs)
    y.float().square().mean().backward()
    return y.detach()


# -- inference mode ----------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES, ids=["delayed", "current"])
@pytest.mark.parametrize("name", ["Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear"])
def test_fp8_forward_under_inference_mode_leaves_training_intact(name, recipe):
    """FP8 forwards under torch.inference_mode() (the first one included, which creates the
    scaling state and the cached FP8 weight) leave a module that trains, and trains as one
    that never ran inference; the cached weight is not reused across the switch."""
    torch.manual_seed(0)
    module = builders()[name]()
    twin = copy.deepcopy(module)
    x = torch.randn(16, H)
    with torch.inference_mode():
        with te.autocast(recipe=recipe):
            call(module, x)
        with te.autocast(recipe=recipe):
            call(module, x.clone().requires_grad_())  # a tensor that requires grad, too
    # The first step reuses the cached FP8 weight (is_first_microbatch=False: the weights did
    # not change), which the inference forward made.
    for step, first in enumerate((False, True, None)):
        y = train_step(module, recipe, x * (step + 1), is_first_microbatch=first)
        y_twin = train_step(twin, recipe, x * (step + 1), is_first_microbatch=first)
        if isinstance(recipe, Float8CurrentScaling):
            assert torch.equal(y, y_twin)
    for p, q in zip(module.parameters(), twin.parameters(), strict=True):
        assert p.grad is not None and torch.isfinite(p.grad).all()
        if isinstance(recipe, Float8CurrentScaling):
            assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("recipe", RECIPES, ids=["delayed", "current"])
@pytest.mark.parametrize("name", ["Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear"])
@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_fp8_forward_without_autograd_makes_no_columnwise_copy(name, recipe, mode, monkeypatch):
    """Without autograd nothing runs backward: no FP8 tensor of the forward, input or weight,
    carries a columnwise (transposed) copy, whether or not the parameters require grad."""
    from torchte.quantization.float8 import Float8Storage
    from torchte.quantization.grouped import GroupedStorage

    made = []
    for cls in (Float8Storage, GroupedStorage):
        init = cls.__init__

        def spy(self, *args, _init=init, **kwargs):
            _init(self, *args, **kwargs)
            made.append(self)

        monkeypatch.setattr(cls, "__init__", spy)
    module = builders()[name]()
    x = torch.randn(16, H, requires_grad=mode == "no_grad")
    context = torch.inference_mode() if mode == "inference_mode" else torch.no_grad()
    with context, te.autocast(recipe=recipe):
        call(module, x)
    assert made, "no FP8 tensor was made"
    assert all(t.rowwise_data is not None for t in made)
    assert [t for t in made if t.columnwise_data is not None] == []


# -- deferred initialization, reset_parameters, device ------------------------------------------


@pytest.mark.parametrize("name", list(builders()))
def test_meta_init_then_to_empty_and_reset_matches_eager(name):
    torch.manual_seed(3)
    eager = builders()[name]()
    with torch.device("meta"):
        deferred = builders()[name]()
    assert deferred.device == torch.device("meta")
    assert all(p.is_meta for p in deferred.parameters())
    deferred.to_empty(device="cpu")
    assert deferred.device == torch.device("cpu")
    torch.manual_seed(3)
    deferred.reset_parameters()
    for (n, p), (_, q) in zip(eager.named_parameters(), deferred.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    x = torch.randn(16, H)
    with torch.no_grad():
        assert torch.equal(call(deferred, x), call(eager, x))
        with te.autocast(recipe=DelayedScaling()):
            if not isinstance(eager, te.LayerNorm | te.RMSNorm):
                assert torch.equal(call(deferred, x), call(eager, x))


@pytest.mark.parametrize("name", list(builders()))
def test_meta_module_materializes_on_reset_parameters(name):
    """Built with device="meta", reset_parameters() alone makes the parameters on the default
    device (Transformer Engine's rule: the current CUDA device; the CPU here) with the values
    an eager build draws, and the module runs there."""
    torch.manual_seed(7)
    eager = builders()[name]()
    deferred = builders(device="meta")[name]()
    assert all(p.is_meta for p in deferred.parameters())
    torch.manual_seed(7)
    deferred.reset_parameters()
    assert deferred.device == eager.device
    for (n, p), (_, q) in zip(eager.named_parameters(), deferred.named_parameters(), strict=True):
        assert not q.is_meta and q.device == p.device, n
        assert torch.equal(p, q), n
    x = torch.randn(16, H)
    with torch.no_grad():
        assert torch.equal(call(deferred, x), call(eager, x))


@pytest.mark.parametrize("name", list(builders()))
def test_reset_parameters_reruns_the_init(name):
    torch.manual_seed(5)
    module = builders()[name]()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)
    torch.manual_seed(5)
    module.reset_parameters()
    for n, p in module.named_parameters():
        assert torch.equal(p, before[n]), n
    module.reset_parameters(defer_init=True)  # Transformer Engine's flag: nothing happens
    for n, p in module.named_parameters():
        assert torch.equal(p, before[n]), n


def test_reset_parameters_with_a_custom_init_method():
    layer = te.Linear(H, H, init_method=lambda w: torch.nn.init.constant_(w, 0.25))
    with torch.no_grad():
        layer.weight.zero_()
        layer.bias.fill_(3.0)
    layer.reset_parameters()
    assert (layer.weight == 0.25).all() and (layer.bias == 0).all()


@pytest.mark.parametrize("recipe", RECIPES, ids=["delayed", "current"])
@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
def test_reset_parameters_of_fp8_weights_requantizes_them(kind, recipe):
    torch.manual_seed(7)
    with te.quantized_model_init(recipe=recipe):
        module = te.Linear(H, H) if kind == "Linear" else te.LayerNormMLP(H, 2 * H)
    weights = {n: p for n, p in module.named_parameters() if isinstance(p, te.Float8Tensor)}
    assert weights
    first = {n: p._storage.rowwise_data.view(torch.uint8).clone() for n, p in weights.items()}
    scale_inv = {n: p._storage.scale_inv.clone() for n, p in weights.items()}
    torch.manual_seed(8)
    module.reset_parameters()
    assert any(not torch.equal(p._storage.rowwise_data.view(torch.uint8), first[n])
               for n, p in weights.items())  # fmt: skip
    torch.manual_seed(7)
    module.reset_parameters()
    for n, p in module.named_parameters():
        if n in weights:
            assert p is weights[n], "reset works in place: the parameter objects stay"
            assert torch.equal(p._storage.rowwise_data.view(torch.uint8), first[n]), n
            assert torch.equal(p._storage.scale_inv, scale_inv[n]), n


def test_module_device_follows_its_parameters():
    layer = te.Linear(H, H)
    with te.autocast(recipe=DelayedScaling(amax_history_len=4)):
        layer(torch.randn(16, H))
    layer.to("meta")
    assert layer.device == torch.device("meta")
    fwd, bwd = layer._delayed_states[4]
    assert fwd.scale.is_meta and bwd.amax_history.is_meta and fwd.nonfinite.is_meta
    # Shape inference on meta runs; FP8 names the meta device as the reason it cannot run.
    assert layer(torch.randn(16, H, device="meta")).shape == (16, H)
    with (
        pytest.raises(RuntimeError, match="device type 'meta'"),
        te.autocast(recipe=DelayedScaling(amax_history_len=4)),
    ):
        layer(torch.randn(16, H, device="meta"))
    layer.to_empty(device="cpu")
    assert layer.device == torch.device("cpu")
    assert torch.equal(fwd.scale, torch.ones(3)) and not fwd.amax_history.any()
    with pytest.raises(ValueError, match="input is on meta but the module's parameters"):
        layer(torch.randn(16, H, device="meta"))


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES, ids=["delayed", "current"])
def test_module_built_on_cpu_runs_fp8_after_cuda(recipe):
    layer = te.Linear(H, H)
    x = torch.randn(16, H)
    with te.autocast(recipe=recipe):
        y_cpu = layer(x)
    layer.cuda()
    assert layer.device.type == "cuda"
    for pair in layer._delayed_states.values():
        assert all(s.scale.is_cuda and s.amax_history.is_cuda for s in pair)
    y = train_step(layer, recipe, x.cuda())
    assert y.is_cuda and torch.isfinite(y).all()
    torch.testing.assert_close(y.cpu(), y_cpu, rtol=0.125, atol=0.0675)


@pytest.mark.parametrize("recipe", RECIPES, ids=["delayed", "current"])
def test_copy_of_fp8_weight_module_uses_its_own_scaling_state(recipe):
    """A deep copy's FP8 weights requantize through the copy's own state, not the original's."""
    with te.quantized_model_init(recipe=recipe):
        layer = te.Linear(H, H)
    twin = copy.deepcopy(layer)
    quantizer = twin.weight._quantizer
    assert quantizer is not None
    if isinstance(recipe, DelayedScaling):
        fwd, _ = twin._delayed_states[recipe.amax_history_len]
        assert quantizer.scale.data_ptr() == fwd.scale.data_ptr() + 4  # the weight slot
    x = torch.randn(16, H)
    torch.testing.assert_close(train_step(twin, recipe, x), train_step(layer, recipe, x))


# -- extra state -------------------------------------------------------------------------------


def _trained_state_dict() -> dict:
    """A trained model's state_dict with the extra state in torchte's older dict form."""
    model = torch.nn.Sequential(te.Linear(H, H), te.Linear(H, H))
    train_step(model, DelayedScaling(amax_history_len=4), torch.randn(16, H))
    state = model.state_dict()
    for i, layer in enumerate(model):
        state[f"{i}._extra_state"] = layer._scaling_state()
    return state


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda e: e.pop("amax_history_len"), r"1\._extra_state.*lacks 'amax_history_len'"),
        (lambda e: e.pop("fwd_scale"), r"1\._extra_state.*lacks 'fwd_scale'"),
        (lambda e: e.update(amax_history_len="4"), "amax_history_len must be a positive int"),
        (lambda e: e.update(bwd_scale=[1.0, 1.0]), "bwd_scale must be a tensor"),
        (lambda e: e.update(fwd_amax_history=torch.zeros(4, 7)), r"amax history has shape"),
        (lambda e: e.update(fwd_nonfinite=torch.zeros(2)), r"fwd_nonfinite has shape"),
    ],
)
def test_malformed_extra_state_names_the_module_and_the_problem(damage, message):
    state = _trained_state_dict()
    damage(state["1._extra_state"])
    model = torch.nn.Sequential(te.Linear(H, H), te.Linear(H, H))
    with pytest.raises(ExtraStateError, match=message) as info:
        model.load_state_dict(state)
    assert "te.Linear" in str(info.value)


def test_extra_state_round_trip_carries_nonfinite_counts():
    model = torch.nn.Sequential(te.Linear(H, H))
    bad = torch.randn(16, H)
    bad[3, 5] = float("nan")
    train_step(model, DelayedScaling(amax_history_len=4), bad)
    assert model[0].nonfinite_amax_count() > 0
    other = torch.nn.Sequential(te.Linear(H, H))
    other.load_state_dict(model.state_dict())
    assert other[0].nonfinite_amax_count() == model[0].nonfinite_amax_count()
    # An older checkpoint without counts loads, and the counts start at zero.
    state = {**model.state_dict(), "0._extra_state": model[0]._scaling_state()}
    for key in ("fwd_nonfinite", "bwd_nonfinite"):
        del state["0._extra_state"][key]
    other.load_state_dict(state)
    assert other[0].nonfinite_amax_count() == 0


def test_extra_state_in_transformer_engine_tensor_form():
    layer = te.Linear(H, H)
    layer.set_extra_state(torch.empty(0, dtype=torch.uint8))  # "no FP8 state": nothing to load
    assert layer.get_extra_state().numel() == 0 and layer._scaling_state() == {}
    with pytest.raises(ExtraStateError, match="Transformer Engine's format"):
        layer.set_extra_state(torch.zeros(10, dtype=torch.uint8))


@pytest.mark.parametrize("recipe", RECIPES, ids=["delayed", "current"])
def test_fp8_weight_module_moves_to_meta(recipe):
    """Moving a module with FP8 weights to the meta device (which runs no FP8) works; FP8 there
    is refused when a forward asks for it, naming the device."""
    with te.quantized_model_init(recipe=recipe):
        layer = te.Linear(H, H)
    layer.to("meta")
    assert layer.device == torch.device("meta") and layer.weight.is_meta
    assert layer.weight._quantizer is not None
    with pytest.raises(RuntimeError, match="device type 'meta'"), te.autocast(recipe=recipe):
        layer(torch.randn(16, H, device="meta"))
