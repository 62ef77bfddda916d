"""A te module's `_extra_state` is a tensor (Transformer Engine's uint8 pickled form), so that
every state_dict value is a tensor: what tensor-only checkpoint formats (safetensors, and
through it HF transformers' save_pretrained) require. Loads of the older forms, torch.save,
deepcopy and torch.distributed.checkpoint keep working."""

from __future__ import annotations

import copy
import json
import struct
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from tolerances import representable, same_bits
from torch import nn

import torchte as te
from torchte.recipe import DelayedScaling
from torchte.train import fsdp_state

pytestmark = pytest.mark.usefixtures("cpu_default_device")

L = 4
MODULES = {
    "Linear": lambda: te.Linear(32, 16),
    "LayerNormLinear": lambda: te.LayerNormLinear(32, 16),
    "LayerNormMLP": lambda: te.LayerNormMLP(32, 64),
    "GroupedLinear": lambda: te.GroupedLinear(3, 32, 16),
    "ops.Linear": lambda: te.ops.Linear(32, 16),
}


def fp8_step(module: nn.Module, x: torch.Tensor, history: int = L) -> torch.Tensor:
    """One delayed-scaling FP8 forward and backward: the output."""
    with te.autocast(recipe=DelayedScaling(amax_history_len=history)):
        args = (x, [16, 16, 16]) if isinstance(module, te.GroupedLinear) else (x,)
        out = module(*args)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(torch.ones_like(out))
    return out


def delayed_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every delayed-scaling tensor of every te module of `model`, by module, length and name."""
    found = {}
    for name, module in model.named_modules():
        for length, pair in getattr(module, "_delayed_states", {}).items():
            for direction, state in zip(("fwd", "bwd"), pair, strict=True):
                for field in ("scale", "amax_history", "nonfinite"):
                    found[f"{name}/{length}/{direction}/{field}"] = getattr(state, field)
    return found


def assert_same_delayed_state(a: nn.Module, b: nn.Module) -> None:
    ta, tb = delayed_tensors(a), delayed_tensors(b)
    assert ta.keys() == tb.keys()
    for key, value in ta.items():
        assert torch.equal(value, tb[key]), key


@pytest.mark.parametrize("name", list(MODULES))
def test_every_state_dict_value_is_a_tensor(name):
    module = MODULES[name]()
    empty = module.state_dict()["_extra_state"]
    assert isinstance(empty, torch.Tensor) and empty.dtype == torch.uint8 and empty.numel() == 0
    fp8_step(module, representable((48, 32), torch.float32))
    for key, value in module.state_dict().items():
        assert isinstance(value, torch.Tensor) and value.device.type == "cpu", key
    extra = module.state_dict()["_extra_state"]
    assert extra.dtype == torch.uint8 and extra.dim() == 1 and extra.numel() > 0


def test_size_depends_only_on_gemms_and_history_length():
    """torch.distributed.checkpoint loads into tensors of the saved size: the bytes of one module
    under one recipe keep their size whatever the values (and whichever module made them)."""
    a, b = te.Linear(32, 16), te.LayerNormLinear(32, 16)
    fp8_step(a, representable((48, 32), torch.float32))
    first = a.get_extra_state()
    fp8_step(a, 1000 * representable((48, 32), torch.float32))
    fp8_step(b, representable((48, 32), torch.float32))
    second = a.get_extra_state()
    assert not torch.equal(first, second)
    assert first.shape == second.shape == b.get_extra_state().shape
    assert torch.equal(second, a.get_extra_state())  # the same state, the same bytes


# -- a safetensors-style file: only dense tensors, written as raw bytes -------------------------


def save_tensor_file(state: dict, path) -> None:
    """What safetensors.torch.save_file writes: a JSON header of dtype, shape and byte range per
    entry, then each tensor's raw bytes; anything but a dense tensor is refused."""
    header, blobs, offset = {}, [], 0
    for key, value in state.items():
        data = value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        header[key] = {
            "dtype": str(value.dtype).removeprefix("torch."),
            "shape": list(value.shape),
            "device": str(value.device),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def load_tensor_file(path) -> dict[str, torch.Tensor]:
    raw = Path(path).read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header, body = json.loads(raw[8 : 8 + size]), raw[8 + size :]
    out = {}
    for key, meta in header.items():
        start, stop = meta["data_offsets"]
        dtype = getattr(torch, meta["dtype"])
        flat = torch.frombuffer(bytearray(body[start:stop]) or bytearray(1), dtype=torch.uint8)
        out[key] = flat[: stop - start].view(dtype).reshape(meta["shape"]).clone()
    return out


class TinyPretrained(nn.Module):
    """A stand-in for an HF PreTrainedModel holding te modules: an embedding, a te.Linear, a
    te.LayerNormMLP (run under FP8) and a te.Linear that never ran under FP8."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 32)
        self.proj = te.Linear(32, 32)
        self.mlp = te.LayerNormMLP(32, 64)
        self.idle = te.Linear(32, 16)

    def forward(self, x):
        return self.mlp(self.proj(x))


def test_tensor_file_round_trip_keeps_parameters_and_delayed_state(tmp_path):
    torch.manual_seed(0)
    model = TinyPretrained()
    fp8_step(model, representable((48, 32), torch.float32))
    save_tensor_file(model.state_dict(), tmp_path / "model.safetensors")
    torch.manual_seed(1)
    loaded = TinyPretrained()
    loaded.load_state_dict(load_tensor_file(tmp_path / "model.safetensors"))  # strict
    for (name, p), q in zip(model.named_parameters(), loaded.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert_same_delayed_state(model, loaded)
    assert model.mlp.nonfinite_amax_count() == loaded.mlp.nonfinite_amax_count()
    x = representable((48, 32), torch.float32)
    assert same_bits(fp8_step(loaded, x), fp8_step(model, x))
    assert_same_delayed_state(model, loaded)


def test_torch_save_round_trip_deepcopy_and_nonfinite_counts(tmp_path):
    model = TinyPretrained()
    bad = representable((48, 32), torch.float32)
    bad[3, 5] = float("nan")
    fp8_step(model, bad)
    assert model.proj.nonfinite_amax_count() > 0
    torch.save(model.state_dict(), tmp_path / "model.pt")
    loaded = TinyPretrained()
    loaded.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    assert_same_delayed_state(model, loaded)
    assert loaded.proj.nonfinite_amax_count() == model.proj.nonfinite_amax_count()
    twin = copy.deepcopy(model)
    assert_same_delayed_state(model, twin)
    assert torch.equal(twin.proj.get_extra_state(), model.proj.get_extra_state())


def test_the_older_dict_form_still_loads():
    source = te.GroupedLinear(3, 32, 16)
    fp8_step(source, representable((48, 32), torch.float32))
    fwd, bwd = source._delayed_states[L]
    older = {"amax_history_len": L}  # what torchte wrote before (non-finite counts optional)
    for key, state in (("fwd", fwd), ("bwd", bwd)):
        older[f"{key}_scale"] = state.scale.clone()
        older[f"{key}_amax_history"] = state.amax_history.clone()
    target = te.GroupedLinear(3, 32, 16)
    target.load_state_dict({**source.state_dict(), "_extra_state": older})
    assert_same_delayed_state(source, target)
    target.load_state_dict({**source.state_dict(), "_extra_state": {}})  # "nothing saved"
    assert_same_delayed_state(source, target)


# -- torch.distributed.checkpoint (one process) ---------------------------------------------------


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_distributed_checkpoint_round_trip(tmp_path):
    model = TinyPretrained()
    fp8_step(model, representable((48, 32), torch.float32))
    dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path, no_dist=True)
    # A model that ran under the same recipe holds tensors of the saved sizes: a plain load.
    ran = TinyPretrained()
    fp8_step(ran, 3 * representable((48, 32), torch.float32))
    state = {"model": ran.state_dict()}
    dcp.load(state, checkpoint_id=tmp_path, no_dist=True)
    ran.load_state_dict(state["model"])
    assert_same_delayed_state(model, ran)
    # A fresh one has none: the entries are sized from the checkpoint's metadata first.
    assert_same_delayed_state(model, loaded_into_a_fresh_model(tmp_path))


def loaded_into_a_fresh_model(path) -> TinyPretrained:
    """A model that never ran, loaded from the DCP folder `path`: its empty extra-state entries
    are sized from the checkpoint's metadata first (as the training example does)."""
    fresh = TinyPretrained()
    fresh_state = fresh.state_dict()
    metadata = dcp.FileSystemReader(path).read_metadata()
    fsdp_state._add_extra_states(fresh_state, metadata.state_dict_metadata, "model.")
    state = {"model": fresh_state}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    fresh.load_state_dict(state["model"])
    return fresh


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_folder_of_the_older_dict_form_loads(tmp_path):
    model = TinyPretrained()
    fp8_step(model, representable((48, 32), torch.float32))
    older = model.state_dict()
    for name in ("proj", "mlp", "idle"):  # as torchte wrote before: DCP flattens the dicts
        older[f"{name}._extra_state"] = getattr(model, name)._scaling_state()
    dcp.save({"model": older}, checkpoint_id=tmp_path, no_dist=True)
    assert_same_delayed_state(model, loaded_into_a_fresh_model(tmp_path))


@pytest.mark.gpu
def test_state_of_a_cuda_module_round_trips_through_the_cpu_tensor():
    """A module on the GPU saves its delayed-scaling state as a CPU uint8 tensor and loads it
    back onto the GPU: the next FP8 step of the loaded copy equals the original's bit for bit."""
    recipe = DelayedScaling(amax_history_len=4)
    torch.manual_seed(0)
    layer = te.Linear(64, 64, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        with te.autocast(recipe=recipe):
            layer(x).sum().backward()
    state = layer.state_dict()
    extra = state["_extra_state"]
    assert extra.dtype == torch.uint8 and extra.device.type == "cpu" and extra.numel() > 0
    twin = te.Linear(64, 64, params_dtype=torch.bfloat16, device="cuda")
    twin.load_state_dict(state)
    with te.autocast(recipe=recipe):
        want = layer(x)
    with te.autocast(recipe=recipe):
        got = twin(x)
    assert torch.equal(got, want)


def test_state_loaded_on_the_meta_device_waits_for_the_parameters():
    """A module built on the meta device keeps a loaded scaling state until it is real: after
    to_empty, or after its parameters are replaced in place (as HF's from_pretrained does), the
    state is the one loaded."""
    recipe = DelayedScaling(amax_history_len=4)
    source = te.Linear(32, 32)
    with te.autocast(recipe=recipe):
        source(torch.randn(8, 32)).sum().backward()
    state = source.state_dict()
    for materialize in ("to_empty", "replace"):
        with torch.device("meta"):
            target = te.Linear(32, 32)
        target.load_state_dict(state, assign=materialize == "replace")
        assert target.state_dict()["_extra_state"].numel() == state["_extra_state"].numel()
        if materialize == "to_empty":
            target.to_empty(device="cpu")
        assert target.device.type == "cpu" or materialize == "replace"
        assert torch.equal(target.state_dict()["_extra_state"], state["_extra_state"]), materialize
        assert target.device.type == "cpu"
