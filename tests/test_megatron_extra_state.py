"""Megatron-Core's side of the te modules' FP8 state: the `_extra_state` a Megatron process
pickles (its two spellings), the split and merge its TEGroupedLinear makes of it, the
per-module attributes it reads (fp8_meta, fp8, fp8_calibration, init_fp8_metadata) and the
`save_original_input` it writes. Megatron itself is not imported: the payloads are built the
way it builds them."""

from __future__ import annotations

import copy
import io
import pickle
import sys
import types
import warnings

import pytest
import torch
from tolerances import representable, same_bits

import torchte as te
from torchte import _alias as alias_api
from torchte.module._lifecycle import ExtraStateError
from torchte.recipe import DelayedScaling, Float8CurrentScaling

L = 4
MEGATRON_TE = "megatron.core.extensions.transformer_engine"
MEGATRON_SAFE = "megatron.core.safe_globals"


@pytest.fixture
def alias():
    """The alias installed for one test, then removed."""
    alias_api.install()
    try:
        yield
    finally:
        alias_api.uninstall()


def trained(module, recipe=None):
    """`module` after one FP8 step (delayed scaling with history L unless `recipe`)."""
    x = representable((16 * module.num_gemms, module.in_features), torch.float32)
    with te.autocast(recipe=recipe or DelayedScaling(amax_history_len=L)):
        args = (x, [16] * module.num_gemms) if isinstance(module, te.GroupedLinear) else (x,)
        out = module(*args)
    out.sum().backward()
    return module


def forward(module, x):
    with te.autocast(recipe=DelayedScaling(amax_history_len=L)):
        args = (x, [16] * module.num_gemms) if isinstance(module, te.GroupedLinear) else (x,)
        return module(*args)


def states_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


# -- Megatron's spellings -------------------------------------------------------------------------


class _MegatronUnpickler(pickle.Unpickler):
    """Megatron-Core's SafeUnpickler allow-list for FP8 extra state (its safe_globals.py), as
    Megatron reads what torchte writes under the alias."""

    ALLOWED: frozenset[tuple[str, str]] = frozenset(
        {
            ("builtins", "dict"),
            ("collections", "OrderedDict"),
            ("torch._utils", "_rebuild_tensor_v2"),
            ("torch.storage", "_load_from_bytes"),
            ("transformer_engine.common.recipe", "DelayedScaling"),
            ("transformer_engine.common.recipe", "Format"),
            ("transformer_engine.common.recipe", "_FormatHelper"),
            ("transformer_engine.common.recipe", "MMParams"),
            ("transformer_engine.common.recipe", "QParams"),
            (MEGATRON_TE, "TEDelayedScaling"),
            (MEGATRON_SAFE, "safe_load_from_bytes"),
        }
    )

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"Megatron refuses {module}.{name}")
        if (module, name) == (MEGATRON_SAFE, "safe_load_from_bytes"):
            return lambda b: torch.load(io.BytesIO(b), weights_only=True)
        return super().find_class(module, name)


@pytest.fixture
def megatron_process(monkeypatch):
    """What importing megatron.core does to pickling: torch's `_load_from_bytes` replaced by
    its safe_load_from_bytes, and its TEDelayedScaling (a DelayedScaling subclass) defined."""
    safe = types.ModuleType(MEGATRON_SAFE)

    def safe_load_from_bytes(b):
        return torch.load(io.BytesIO(b), weights_only=True)

    safe_load_from_bytes.__module__ = MEGATRON_SAFE
    safe_load_from_bytes.__qualname__ = "safe_load_from_bytes"
    safe.safe_load_from_bytes = safe_load_from_bytes
    extensions = types.ModuleType(MEGATRON_TE)

    class TEDelayedScaling(DelayedScaling):
        pass

    TEDelayedScaling.__module__, TEDelayedScaling.__qualname__ = MEGATRON_TE, "TEDelayedScaling"
    extensions.TEDelayedScaling = TEDelayedScaling
    for name in ("megatron", "megatron.core", "megatron.core.extensions"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, MEGATRON_SAFE, safe)
    monkeypatch.setitem(sys.modules, MEGATRON_TE, extensions)
    monkeypatch.setattr(torch.storage, "_load_from_bytes", safe_load_from_bytes)
    return extensions


def as_bytes(payload) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(payload)), dtype=torch.uint8)


def test_a_payload_pickled_in_a_megatron_process_loads(alias, megatron_process):
    source = trained(te.Linear(32, 16))
    payload = _MegatronUnpickler(io.BytesIO(source.get_extra_state().numpy().tobytes())).load()
    payload["recipe"] = megatron_process.TEDelayedScaling(amax_history_len=L)
    data = as_bytes(payload)
    assert MEGATRON_SAFE.encode() in data.numpy().tobytes()
    assert b"TEDelayedScaling" in data.numpy().tobytes()
    alias_api.uninstall()  # torchte's own format from here: the load reads Megatron's spelling
    try:
        target = te.Linear(32, 16)
        target.load_state_dict({**source.state_dict(), "_extra_state": data})
        expected = copy.deepcopy(source)
        x = representable((32, 32), torch.float32)
        assert same_bits(forward(target, x), forward(expected, x))
    finally:
        alias_api.install()


@pytest.mark.parametrize("name", ["other_function", "SafeUnpickler"], ids=["function", "class"])
def test_other_megatron_globals_are_refused_and_never_run(megatron_process, name):
    ran = []

    def planted(*args):
        ran.append(args)
        return {}

    planted.__module__, planted.__qualname__ = MEGATRON_SAFE, name
    setattr(sys.modules[MEGATRON_SAFE], name, planted)

    class Payload:
        def __reduce__(self):
            return (planted, ("boom",))

    layer = te.Linear(32, 16)
    with pytest.raises(ExtraStateError, match=f"{MEGATRON_SAFE}.{name}"):
        layer.set_extra_state(as_bytes({"recipe": Payload()}))
    assert ran == []


# -- the alias writes Transformer Engine's form -----------------------------------------------


def test_under_the_alias_extra_state_is_the_uint8_form_megatron_reads(alias):
    layer = te.Linear(32, 16)
    empty = layer.get_extra_state()
    assert empty.dtype == torch.uint8 and empty.numel() == 0
    state = trained(layer).get_extra_state()
    payload = _MegatronUnpickler(io.BytesIO(state.numpy().tobytes())).load()
    assert payload["recipe"].amax_history_len == L
    assert payload["scale_fwd"].shape == (3,) and payload["amax_history_fwd"].shape == (L, 3)
    assert payload["extra_fp8_variables"]["num_gemms"] == 1


def test_recipes_pickle_under_transformer_engine_names_only_while_installed():
    recipe = DelayedScaling(amax_history_len=L)
    assert b"torchte.recipe" in pickle.dumps(recipe)
    alias_api.install()
    try:
        data = pickle.dumps(recipe)
        assert b"transformer_engine.common.recipe" in data and b"torchte" not in data
        assert pickle.loads(data) == recipe
    finally:
        alias_api.uninstall()
    assert b"torchte.recipe" in pickle.dumps(recipe)
    state = te.Linear(8, 8).get_extra_state()  # the same form without the alias
    assert state.dtype == torch.uint8 and state.numel() == 0


def _split(state: torch.Tensor, num_gemms: int) -> list[torch.Tensor]:
    """Megatron's TEGroupedLinear._split_extra_state: one payload per GEMM (its column views)."""
    state = _MegatronUnpickler(io.BytesIO(state.numpy().tobytes())).load()
    pieces = []
    for g in range(num_gemms):
        piece = {"extra_fp8_variables": {**state["extra_fp8_variables"], "num_gemms": 1}}
        piece["recipe"] = state["recipe"]
        for d, slots in (("fwd", 3), ("bwd", 2)):
            piece[f"scale_{d}"] = state[f"scale_{d}"].view(slots, -1)[:, g]
            piece[f"amax_history_{d}"] = state[f"amax_history_{d}"].view(L, slots, -1)[:, :, g]
        pieces.append(as_bytes(piece))
    return pieces


def _merge(pieces: list[torch.Tensor], num_gemms: int) -> torch.Tensor:
    """Megatron's TEGroupedLinear merge_extra_states pre-hook: the inverse of _split."""
    states = [_MegatronUnpickler(io.BytesIO(p.numpy().tobytes())).load() for p in pieces]
    merged = {
        "extra_fp8_variables": {**states[0]["extra_fp8_variables"], "num_gemms": num_gemms},
        "recipe": states[0]["recipe"],
    }
    for d in ("fwd", "bwd"):
        merged[f"scale_{d}"] = torch.cat([s[f"scale_{d}"].view(-1, 1) for s in states], 1).view(-1)
        merged[f"amax_history_{d}"] = torch.cat(
            [s[f"amax_history_{d}"].view(-1, 1) for s in states], 1
        ).view(L, -1)
    return as_bytes(merged)


def test_megatron_grouped_split_and_merge_round_trip(alias, megatron_process):
    source = trained(te.GroupedLinear(3, 32, 16))
    pieces = _split(source.get_extra_state(), 3)
    target = te.GroupedLinear(3, 32, 16)
    target.init_fp8_metadata(num_gemms=3)
    target.load_state_dict({**source.state_dict(), "_extra_state": _merge(pieces, 3)})
    assert states_equal(target._scaling_state(), source._scaling_state())


# -- attributes Megatron reads and writes ---------------------------------------------------------


def test_fp8_meta_fp8_and_calibration_follow_the_last_forward():
    layer = te.GroupedLinear(2, 32, 16)
    assert not layer.fp8 and not layer.fp8_calibration
    assert layer.fp8_meta["fp8_checkpoint"] is False and layer.fp8_meta["num_gemms"] == 2
    trained(layer, Float8CurrentScaling())
    assert layer.fp8 and layer.fp8_meta["fp8_checkpoint"] is False  # nothing to save
    assert isinstance(layer.fp8_meta["recipe"], Float8CurrentScaling)
    trained(layer)
    assert layer.fp8 and layer.fp8_meta["fp8_checkpoint"] is True
    layer(torch.randn(32, 32), [16, 16])
    assert not layer.fp8
    with te.autocast(enabled=False, calibrating=True, recipe=DelayedScaling()):
        layer(torch.randn(32, 32), [16, 16])
    assert layer.fp8_calibration and not layer.fp8
    meta = layer.fp8_meta
    meta["fp8_group"] = "set by the client"
    assert layer.fp8_meta is meta and layer.fp8_meta["fp8_group"] == "set by the client"
    with pytest.raises(ValueError, match="num_gemms=3"):
        layer.init_fp8_metadata(num_gemms=3)


@pytest.mark.parametrize("make", [lambda: te.Linear(32, 16), lambda: te.GroupedLinear(2, 32, 16)])
def test_save_original_input_set_after_construction(make):
    layer = make()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer.save_original_input = True  # Megatron's set_save_original_input
    assert layer.save_original_input is True
    x = representable((32, 32), torch.float32).requires_grad_()
    args = (x, [16, 16]) if isinstance(layer, te.GroupedLinear) else (x,)
    with te.autocast(recipe=Float8CurrentScaling()):
        out = layer(*args)
    out.sum().backward()
    with te.autocast(recipe=DelayedScaling()), pytest.raises(NotImplementedError):
        layer(*args)
    assert not hasattr(te.LayerNormLinear(16, 16), "save_original_input")


def test_trigger_wgrad_hooks_runs_the_registered_hooks():
    layer = te.GroupedLinear(2, 32, 16)
    calls = []
    layer.register_wgrad_accumulation_and_reduce_hooks(lambda: calls.append("reduce"))
    layer._trigger_wgrad_accumulation_and_reduce_hooks()  # Megatron's fused-experts backward_dw
    assert calls == ["reduce"]
