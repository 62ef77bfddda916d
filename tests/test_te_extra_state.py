"""Transformer Engine's `_extra_state` format: read by te modules, written by
te.export_transformer_engine_state_dict.

Payloads are built here as Transformer Engine 2.x's get_extra_state builds them (1.x's where
named): pickle.dumps of a dict holding its recipe object, with stand-in recipe classes
registered under Transformer Engine's module name (transformer_engine.common.recipe) for the
test only. Column layout per direction: slot s of GEMM g at g*S + s in Transformer Engine 2.x;
torchte's GroupedLinear keeps it at s*G + g.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import io
import pickle
import sys
import types
from typing import NamedTuple

import pytest
import torch
from tolerances import representable, same_bits
from torch import nn

import torchte as te
from torchte.module._lifecycle import ExtraStateError
from torchte.recipe import DelayedScaling as TorchteDelayed

pytestmark = pytest.mark.usefixtures("cpu_default_device")

TE_RECIPE = "transformer_engine.common.recipe"
L = 4  # amax history length
SLOTS = {"fwd": 3, "bwd": 2}
RECIPE_L = TorchteDelayed(amax_history_len=L)


# -- stand-ins for Transformer Engine's recipe module ---------------------------------------------


def _in_te(cls):
    cls.__module__, cls.__qualname__ = TE_RECIPE, cls.__name__
    return cls


@_in_te
class _FormatHelper(NamedTuple):
    max_fwd: float
    max_bwd: float


@_in_te
class Format(enum.Enum):
    E2M1 = _FormatHelper(max_fwd=6, max_bwd=6)
    E4M3 = _FormatHelper(max_fwd=448, max_bwd=448)
    E5M2 = _FormatHelper(max_fwd=57344, max_bwd=57344)
    HYBRID = _FormatHelper(max_fwd=448, max_bwd=57344)


@_in_te
@dataclasses.dataclass(frozen=True)
class MMParams:
    use_split_accumulator: bool = True


@_in_te
class Recipe:
    @classmethod
    def delayed(cls):
        return issubclass(cls, DelayedScaling)


@_in_te
@dataclasses.dataclass
class DelayedScaling(Recipe):
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    scaling_factor_compute_algo: object = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: object = None


@_in_te
@dataclasses.dataclass
class Float8CurrentScaling(Recipe):
    use_power_2_scales: bool = False
    fp8_format: Format = Format.HYBRID
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
    fp8_dpa: bool = False


@_in_te
@dataclasses.dataclass
class NVFP4BlockScaling(Recipe):
    fp4_format: Format = Format.E2M1
    fp8_format: Format = Format.E4M3


@pytest.fixture
def te_recipe_module(monkeypatch):
    """Transformer Engine's recipe module path, holding the stand-ins, for this test only."""
    module = types.ModuleType(TE_RECIPE)
    for cls in (_FormatHelper, Format, MMParams, Recipe, DelayedScaling, Float8CurrentScaling):
        setattr(module, cls.__name__, cls)
    module.NVFP4BlockScaling = NVFP4BlockScaling
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    monkeypatch.setitem(sys.modules, "transformer_engine.common", types.ModuleType("te.common"))
    monkeypatch.setitem(sys.modules, TE_RECIPE, module)
    return module


# -- payloads -------------------------------------------------------------------------------------


def values(direction: str, num_gemms: int, grouped: bool) -> dict[tuple[int, int], tuple]:
    """(gemm, slot) -> (scale, amax history (L,)) of one direction: distinct powers of two, and
    exactly representable histories. A grouped module never quantizes its output and
    grad_input slots: scale 1, zero history (as Transformer Engine saves them)."""
    out = {}
    for g in range(num_gemms):
        for s in range(SLOTS[direction]):
            unused = grouped and s == SLOTS[direction] - 1
            k = g * SLOTS[direction] + s + (1 if direction == "fwd" else 0)
            scale = torch.tensor(1.0 if unused else 2.0 ** (k % 4))
            seed = torch.Generator().manual_seed(100 * k + g)
            drawn = representable(L, torch.float32, generator=seed).abs() + 0.5
            history = torch.zeros(L) if unused else drawn
            out[g, s] = scale, history
    return out


def laid_out(vals: dict, num_gemms: int, slots: int, by_slot: bool) -> tuple:
    """(scale (S*G,), history (L, S*G)) with (g, s) at s*G + g if by_slot, else g*S + s."""
    scale, history = torch.empty(slots * num_gemms), torch.empty(L, slots * num_gemms)
    for (g, s), (v, h) in vals.items():
        col = s * num_gemms + g if by_slot else g * slots + s
        scale[col], history[:, col] = v, h
    return scale, history


def te_payload(num_gemms: int, grouped: bool, *, version: str = "2.x", by_slot=None) -> dict:
    """The dict Transformer Engine pickles for a module of `num_gemms` GEMMs (2.x, or 1.x)."""
    by_slot = (version == "1.x" and grouped) if by_slot is None else by_slot
    payload: dict = {} if version == "1.x" else {"recipe": DelayedScaling(amax_history_len=L)}
    for d in ("fwd", "bwd"):
        scale, history = laid_out(values(d, num_gemms, grouped), num_gemms, SLOTS[d], by_slot)
        payload[f"scale_{d}"], payload[f"amax_history_{d}"] = scale, history
        if version == "1.x":
            payload[f"scale_inv_{d}"] = 1 / scale
    payload["extra_fp8_variables"] = {
        "fp8_checkpoint": True,
        "num_gemms": num_gemms,
        "fp8_max_fwd": 448,
        "fp8_max_bwd": 57344,
        "fp8_group": "ignored",
    }
    return payload


def as_bytes(payload) -> torch.Tensor:
    """Transformer Engine 2.x's serialization: a uint8 tensor of pickle.dumps."""
    return torch.frombuffer(bytearray(pickle.dumps(payload)), dtype=torch.uint8)


def torchte_state(num_gemms: int, grouped: bool) -> dict:
    """torchte's extra state carrying the same values, in the module's own layout."""
    state: dict = {"amax_history_len": L}
    for d in ("fwd", "bwd"):
        scale, history = laid_out(values(d, num_gemms, grouped), num_gemms, SLOTS[d], grouped)
        state[f"{d}_scale"], state[f"{d}_amax_history"] = scale, history
    return state


# -- modules --------------------------------------------------------------------------------------

MODULES = {
    "Linear": (lambda: te.Linear(32, 16), 1, False),
    "LayerNormLinear": (lambda: te.LayerNormLinear(32, 16), 1, False),
    "LayerNormMLP": (lambda: te.LayerNormMLP(32, 64), 2, False),
    "GroupedLinear": (lambda: te.GroupedLinear(3, 32, 16), 3, True),
}


def run(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One FP8 step under DelayedScaling(amax_history_len=L): the output; grads accumulate."""
    with te.autocast(recipe=TorchteDelayed(amax_history_len=L)):
        args = (x, [16, 16, 16]) if isinstance(module, te.GroupedLinear) else (x,)
        out = module(*args)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(torch.ones_like(out))
    return out


def states_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


# -- loading ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MODULES))
def test_te_bytes_load_as_the_same_state_and_forward(te_recipe_module, name):
    make, num_gemms, grouped = MODULES[name]
    from_te = make()
    from_dict, wrong = copy.deepcopy(from_te), copy.deepcopy(from_te)
    saved = as_bytes(te_payload(num_gemms, grouped))
    from_te.load_state_dict({**from_te.state_dict(), "_extra_state": saved})  # strict
    from_dict.set_extra_state(torchte_state(num_gemms, grouped))
    loaded = from_te._scaling_state()
    assert loaded["amax_history_len"] == L and not loaded["fwd_nonfinite"].any()
    assert states_equal(loaded, from_dict._scaling_state())
    # The loaded scales are used: the FP8 forward, backward and next state match bit for bit.
    x = representable((48, 32), torch.float32)
    out = run(from_te, x)
    assert same_bits(out, run(from_dict, x))
    for p, q in zip(from_te.parameters(), from_dict.parameters(), strict=True):
        assert same_bits(p.grad, q.grad)
    assert states_equal(from_te._scaling_state(), from_dict._scaling_state())
    # ... and a state whose slots were swapped would have given another output.
    swapped = torchte_state(num_gemms, grouped)
    swapped["fwd_scale"] = swapped["fwd_scale"].roll(1)
    wrong.set_extra_state(swapped)
    assert not torch.equal(run(wrong, x), out)


@pytest.mark.parametrize("form", ["uint8", "BytesIO"])
@pytest.mark.parametrize("name", ["Linear", "GroupedLinear"])
def test_transformer_engine_1x_forms_load(te_recipe_module, name, form):
    make, num_gemms, grouped = MODULES[name]
    payload = te_payload(num_gemms, grouped, version="1.x")  # no recipe; scale_inv; by slot
    if form == "uint8":
        saved = as_bytes(payload)
    else:
        saved = io.BytesIO()
        torch.save(payload, saved)
    module = make()
    module.set_extra_state(saved)
    assert states_equal(module._scaling_state(), _loaded(make, torchte_state(num_gemms, grouped)))


def _loaded(make, state: dict) -> dict:
    module = make()
    module.set_extra_state(state)
    return module._scaling_state()


def test_a_1x_grouped_payload_is_read_slot_by_slot_even_when_values_do_not_tell(
    te_recipe_module,
):
    make, num_gemms, grouped = MODULES["GroupedLinear"]
    payload, want = te_payload(num_gemms, grouped, version="1.x"), torchte_state(3, True)
    for d in ("fwd", "bwd"):  # GEMMs 1 and 2 never ran: either layout fits the zeros
        cols = [s * num_gemms + g for s in range(SLOTS[d]) for g in (1, 2)]
        for t in (payload[f"amax_history_{d}"], want[f"{d}_amax_history"]):
            t[:, cols] = 0
    module = make()
    module.set_extra_state(as_bytes(payload))
    assert states_equal(module._scaling_state(), _loaded(make, want))


def test_early_2x_grouped_layout_is_told_from_the_unused_slots(te_recipe_module):
    make, num_gemms, grouped = MODULES["GroupedLinear"]
    want = _loaded(make, torchte_state(num_gemms, grouped))
    for by_slot in (False, True):
        module = make()
        module.set_extra_state(as_bytes(te_payload(num_gemms, grouped, by_slot=by_slot)))
        assert states_equal(module._scaling_state(), want), by_slot


@pytest.mark.parametrize("recipe", ["current", "nvfp4"])
def test_a_recipe_without_delayed_scaling_has_nothing_to_load(te_recipe_module, recipe):
    layer = te.Linear(32, 16)
    layer.set_extra_state(torchte_state(1, False))
    before = layer._scaling_state()
    saved = {"recipe": Float8CurrentScaling() if recipe == "current" else NVFP4BlockScaling()}
    saved["extra_fp8_variables"] = {"num_gemms": 1}
    layer.set_extra_state(as_bytes(saved))
    assert states_equal(layer._scaling_state(), before)
    fresh = te.Linear(32, 16)
    fresh.set_extra_state(as_bytes(saved))
    assert fresh._scaling_state() == {}


def _side_effect(*args):
    _side_effect.calls.append(args)


_side_effect.calls = []


class _Calls:
    """Pickles as a call of _side_effect (a global that no extra state references)."""

    def __reduce__(self):
        return (_side_effect, ("ran",))


class _StorageBytes:
    """Pickles as torch.storage._load_from_bytes of torch.save bytes holding a _Calls."""

    def __reduce__(self):
        buffer = io.BytesIO()
        torch.save(_Calls(), buffer, _use_new_zipfile_serialization=False)
        return (torch.storage._load_from_bytes, (buffer.getvalue(),))


@pytest.mark.parametrize("inner", [_Calls, _StorageBytes])
def test_foreign_globals_are_refused_and_never_run(te_recipe_module, inner):
    payload = te_payload(1, False)
    payload["scale_fwd"] = inner()
    layer = te.Linear(32, 16)
    with pytest.raises(ExtraStateError, match=r"(?s)te\.Linear.*_side_effect"):
        layer.set_extra_state(as_bytes(payload))
    buffer = io.BytesIO()
    torch.save({"recipe": inner()}, buffer)
    with pytest.raises(ExtraStateError, match=r"(?s)io.BytesIO.*_side_effect"):
        layer.set_extra_state(buffer)
    assert _side_effect.calls == [] and layer._scaling_state() == {}


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda p: p.pop("scale_bwd"), "lacks 'scale_bwd'"),
        (lambda p: p.update(amax_history_bwd=torch.zeros(L + 1, 2)), "have 4 and 5 rows"),
        (lambda p: p.update(scale_fwd=torch.ones(6)), r"scale_fwd has shape \(6,\)"),
        (lambda p: p["extra_fp8_variables"].update(num_gemms=2), "saved by a module of 2 GEMMs"),
        (lambda p: p.update(recipe="delayed"), "recipe is a str"),
    ],
)
def test_malformed_te_state_names_the_module_and_the_problem(te_recipe_module, damage, message):
    payload = te_payload(1, False)
    damage(payload)
    model = nn.Sequential(te.Linear(32, 16))
    state = {**model.state_dict(), "0._extra_state": as_bytes(payload)}
    with pytest.raises(ExtraStateError, match=message) as info:
        model.load_state_dict(state)
    assert "0._extra_state" in str(info.value) and "te.Linear" in str(info.value)


def test_other_te_forms_are_refused_clearly(te_recipe_module):
    layer = te.Linear(32, 16)
    with pytest.raises(ExtraStateError, match="does not read as Transformer Engine's format"):
        layer.set_extra_state(torch.full((12,), 7, dtype=torch.uint8))
    with pytest.raises(ExtraStateError, match="1-D uint8 bytes"):
        layer.set_extra_state(torch.ones(3))
    with pytest.raises(ExtraStateError, match=r"te.ops operation"):
        layer.set_extra_state(as_bytes({"forward": {"recipe": DelayedScaling()}}))
    layer.set_extra_state(as_bytes(None))  # 1.x with FP8 off pickled None: nothing to load
    assert layer._scaling_state() == {}


def test_te_norm_extra_state_loads_and_is_dropped():
    norm = te.LayerNorm(32)
    saved = {**norm.state_dict(), "_extra_state": as_bytes({})}  # an op without quantizers
    norm.load_state_dict(saved)  # strict
    assert "_extra_state" not in norm.state_dict()
    with pytest.raises(ExtraStateError, match=r"cannot load _extra_state.*te.LayerNorm"):
        norm.load_state_dict({**saved, "_extra_state": {"fwd_scale": torch.ones(3)}})


# -- writing ------------------------------------------------------------------------------


class Model(nn.Module):
    """Every te module kind, one never run under FP8, and a norm."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = te.LayerNorm(32)
        self.lin = te.Linear(32, 32)
        self.ln_lin = te.LayerNormLinear(32, 32)
        self.mlp = te.LayerNormMLP(32, 64)
        self.moe = te.GroupedLinear(3, 32, 16)
        self.idle = te.Linear(32, 16)

    def forward(self, x):
        y = self.mlp(self.ln_lin(self.lin(self.norm(x))))
        return self.moe(y, [16, 16, 16])


def trained_model() -> Model:
    model = Model()
    run(model, representable((48, 32), torch.float32))
    return model


def te_reads(payload: dict, num_gemms: int) -> dict[str, torch.Tensor]:
    """What Transformer Engine 2.x's set_extra_state does with a payload: the recipe sizes the
    state (num_gemms from extra_fp8_variables), then the saved tensors are copied in."""
    extra = payload["extra_fp8_variables"]
    recipe = payload["recipe"]
    assert recipe.delayed() and extra["num_gemms"] == num_gemms
    n = {"fwd": 3 * extra["num_gemms"], "bwd": 2 * extra["num_gemms"]}
    state = {}
    for d in ("fwd", "bwd"):
        state[f"scale_{d}"] = torch.ones(n[d]).copy_(payload[f"scale_{d}"])
        history = torch.zeros(recipe.amax_history_len, n[d])
        state[f"amax_history_{d}"] = history.copy_(payload[f"amax_history_{d}"])
    return state


def test_export_is_read_by_transformer_engine_and_back_by_torchte(te_recipe_module, tmp_path):
    model = trained_model()
    exported = te.export_transformer_engine_state_dict(model)
    own = model.state_dict()
    assert exported.keys() == own.keys() | {"norm._extra_state"}
    for key, value in own.items():
        if not key.endswith("_extra_state"):
            assert exported[key].data_ptr() == value.data_ptr()  # the same tensor's view
    assert exported["idle._extra_state"].numel() == 0
    assert pickle.loads(exported["norm._extra_state"].numpy().tobytes()) == {}
    # Transformer Engine's view: its own classes, its layout (GEMM by GEMM).
    for name, num_gemms, grouped in (("lin", 1, 0), ("ln_lin", 1, 0), ("mlp", 2, 0), ("moe", 3, 1)):
        payload = pickle.loads(exported[f"{name}._extra_state"].numpy().tobytes())
        assert type(payload["recipe"]) is DelayedScaling
        assert payload["recipe"].amax_history_len == L
        assert payload["recipe"].fp8_format is Format.HYBRID and payload["recipe"].margin == 0
        assert payload.keys() == {
            "recipe", "scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd",
            "extra_fp8_variables", "nonfinite_fwd", "nonfinite_bwd",  # (torchte's, ignored)
        }  # fmt: skip
        state = te_reads(payload, num_gemms)
        mine = getattr(model, name)._scaling_state()
        for d in ("fwd", "bwd"):
            s = SLOTS[d]
            for g in range(num_gemms):
                for j in range(s):
                    col = j * num_gemms + g if grouped else g * s + j
                    assert state[f"scale_{d}"][g * s + j] == mine[f"{d}_scale"][col]
                    assert torch.equal(
                        state[f"amax_history_{d}"][:, g * s + j], mine[f"{d}_amax_history"][:, col]
                    )
    # A checkpoint file of it loads with weights_only, strictly, into a fresh torchte model.
    torch.save(exported, tmp_path / "te.pt")
    fresh = Model()
    fresh.load_state_dict(torch.load(tmp_path / "te.pt", weights_only=True))
    for name in ("lin", "ln_lin", "mlp", "moe", "idle"):
        want = getattr(model, name)._scaling_state()
        assert states_equal(getattr(fresh, name)._scaling_state(), want)
        # The model's own state_dict already holds these bytes (up to the recipe written).
        assert torch.equal(exported[f"{name}._extra_state"], own[f"{name}._extra_state"])


def test_export_of_a_state_dict_tells_the_layout_from_the_parameters(te_recipe_module):
    model = trained_model()
    from_module = te.export_transformer_engine_state_dict(model)
    from_dict = te.export_transformer_engine_state_dict(model.state_dict())
    for name in ("lin", "ln_lin", "mlp", "moe"):  # (the bytes name storages by address)
        key = f"{name}._extra_state"
        a, b = (pickle.loads(d[key].numpy().tobytes()) for d in (from_dict, from_module))
        assert a.keys() == b.keys() and a["recipe"] == b["recipe"], name
        assert a["extra_fp8_variables"] == b["extra_fp8_variables"], name
        assert all(torch.equal(a[k], b[k]) for k in a if k.startswith(("scale", "amax"))), name
    own = model.state_dict()["mlp._extra_state"]  # already Transformer Engine's: kept as it is
    alone = te.export_transformer_engine_state_dict({"mlp._extra_state": own})
    assert alone["mlp._extra_state"] is own
    older = {"mlp._extra_state": model.mlp._scaling_state()}  # torchte's older dict form
    with pytest.raises(ValueError, match="pass the model"):
        te.export_transformer_engine_state_dict(older)
    with pytest.raises(ValueError, match="pass the model"):  # rewritten with another recipe
        te.export_transformer_engine_state_dict({"mlp._extra_state": own}, recipe=RECIPE_L)
    older["mlp.fc1_weight"] = model.mlp.fc1_weight
    from_older = te.export_transformer_engine_state_dict(older)["mlp._extra_state"]
    assert torch.equal(from_older, from_module["mlp._extra_state"])


def test_export_writes_the_given_recipe_and_refuses_what_it_cannot(te_recipe_module):
    model = trained_model()
    recipe = TorchteDelayed(amax_history_len=L, margin=1, fp8_format=te.recipe.Format.E4M3)
    exported = te.export_transformer_engine_state_dict(model, recipe=recipe)
    payload = pickle.loads(exported["lin._extra_state"].numpy().tobytes())
    assert payload["recipe"].margin == 1 and payload["recipe"].fp8_format is Format.E4M3
    assert payload["extra_fp8_variables"]["fp8_max_bwd"] == 448
    with pytest.raises(ValueError, match="saved amax history has 4 rows"):
        te.export_transformer_engine_state_dict(model, recipe=TorchteDelayed())
    with pytest.raises(ValueError, match=r"recipe must be a torchte.recipe.DelayedScaling"):
        te.export_transformer_engine_state_dict(model, recipe=te.recipe.Float8CurrentScaling())
    custom = TorchteDelayed(amax_history_len=L, amax_compute_algo=lambda h: h.amax(0))
    with pytest.raises(ValueError, match="amax_compute_algo is a callable"):
        te.export_transformer_engine_state_dict(model, recipe=custom)
    ops_model = nn.Sequential(te.ops.Linear(32, 16))
    run(ops_model, representable((48, 32), torch.float32))
    with pytest.raises(NotImplementedError, match=r"te.ops"):
        te.export_transformer_engine_state_dict(ops_model)
