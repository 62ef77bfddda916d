"""Float8Tensor through pickle, copy.deepcopy and torch.save / torch.load.

A copy holds the same FP8 bytes, scale_inv, usages, nominal dtype and requires_grad in new
tensors on the same device; te modules built under te.quantized_model_init come back computing,
differentiating and taking optimizer steps bit for bit as the original.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from tolerances import assert_close, representable

import torchte as te
from torchte import recipe
from torchte.quantization.float8 import (
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Float8Storage,
)
from torchte.quantization.float8_tensor import Float8Tensor, _rebuild_float8_tensor

pytestmark = pytest.mark.usefixtures("cpu_default_device")

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
NOMINAL_DTYPES = [torch.float32, torch.bfloat16]
USAGES = {"rowwise": (True, False), "columnwise": (False, True), "both": (True, True)}


def _torch_save_load(obj, weights_only: bool = True):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=weights_only)


ROUND_TRIPS = {
    "pickle": lambda obj: pickle.loads(pickle.dumps(obj)),
    "deepcopy": copy.deepcopy,
    "torch_save": _torch_save_load,  # weights_only=True, torch's default
}
# Modules are not allow-listed for weights_only loading.
MODULE_ROUND_TRIPS = {
    **ROUND_TRIPS,
    "torch_save": lambda obj: _torch_save_load(obj, weights_only=False),
}


def _f8(fp8_dtype, dtype, usage="both", quantizer=None, shape=(7, 33)) -> Float8Tensor:
    rowwise, columnwise = USAGES[usage]
    quantizer = quantizer or Float8CurrentScalingQuantizer(fp8_dtype, internal=False)
    x_hp = representable(shape, fp8_dtype, scale=4.0).to(dtype)
    value = quantizer.quantize(x_hp, rowwise=rowwise, columnwise=columnwise)
    if isinstance(value, Float8Storage):  # an internal quantizer, as a parameter's is
        value = Float8Tensor.from_storage(value, dtype, quantizer)
    return value


def _assert_same_value(copy_: Float8Tensor, original: Float8Tensor) -> None:
    """Same metadata and bytes, in tensors of its own on the same device."""
    assert type(copy_) is Float8Tensor
    assert copy_.shape == original.shape and copy_.dtype == original.dtype
    assert copy_.fp8_dtype == original.fp8_dtype and copy_.device == original.device
    assert copy_.requires_grad == original.requires_grad
    a, b = copy_._storage, original._storage
    assert a.shape == b.shape
    for name in ("rowwise_data", "columnwise_data", "scale_inv"):
        ta, tb = getattr(a, name), getattr(b, name)
        assert (ta is None) == (tb is None), name
        if tb is None:
            continue
        assert ta.dtype == tb.dtype and ta.device == tb.device, name
        assert torch.equal(ta.view(torch.uint8), tb.view(torch.uint8)), name
        assert ta.data_ptr() != tb.data_ptr(), name
    assert torch.equal(copy_.dequantize(), original.dequantize())


# ----------------------------------------------------------------------------------------------
# One tensor
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", list(ROUND_TRIPS))
@pytest.mark.parametrize("usage", list(USAGES))
@pytest.mark.parametrize("dtype", NOMINAL_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_round_trip_is_exact(fp8_dtype, dtype, usage, how):
    tensor = _f8(fp8_dtype, dtype, usage)
    loaded = ROUND_TRIPS[how](tensor)
    _assert_same_value(loaded, tensor)
    assert not isinstance(loaded, torch.nn.Parameter)


@pytest.mark.parametrize("how", list(ROUND_TRIPS))
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_round_trip_of_parameter_keeps_it_a_parameter(fp8_dtype, how):
    param = torch.nn.Parameter(_f8(fp8_dtype, torch.bfloat16, shape=(3, 4, 16)))
    loaded = ROUND_TRIPS[how](param)
    assert isinstance(loaded, torch.nn.Parameter) and loaded.requires_grad
    _assert_same_value(loaded, param)
    frozen = ROUND_TRIPS[how](torch.nn.Parameter(_f8(fp8_dtype, torch.float32), False))
    assert isinstance(frozen, torch.nn.Parameter) and not frozen.requires_grad


@pytest.mark.parametrize("how", list(ROUND_TRIPS))
def test_round_trip_of_meta_tensor_stays_on_meta(how):
    # The data comes back where it was saved from, as torch's own tensors do.
    fp8 = torch.float8_e5m2
    storage = Float8Storage(
        torch.empty(4, 16, dtype=fp8, device="meta"),
        torch.empty(16, 16, dtype=fp8, device="meta"),
        torch.empty(1, device="meta"),
        fp8,
        (4, 16),
    )
    loaded = ROUND_TRIPS[how](Float8Tensor(storage, torch.bfloat16))
    assert loaded.device.type == "meta" and loaded.dtype == torch.bfloat16
    assert all(t.device.type == "meta" for t in loaded._storage.get_data_tensors())
    assert loaded._storage.columnwise_data.dtype == fp8


@pytest.mark.gpu
@pytest.mark.parametrize("how", list(ROUND_TRIPS))
def test_round_trip_of_cuda_tensor_stays_on_cuda(how):
    tensor = _f8(torch.float8_e4m3fn, torch.bfloat16).to("cuda", copy=True)
    param = torch.nn.Parameter(tensor)
    loaded = ROUND_TRIPS[how](param)
    assert loaded.device == tensor.device and isinstance(loaded, torch.nn.Parameter)
    assert all(t.device == tensor.device for t in loaded._storage.get_data_tensors())
    _assert_same_value(loaded, param)
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    buffer.seek(0)
    on_cpu = torch.load(buffer, map_location="cpu")
    assert on_cpu.device.type == "cpu" and on_cpu._storage.rowwise_data.device.type == "cpu"
    assert torch.equal(on_cpu.dequantize().cuda(), tensor.dequantize())


@pytest.mark.parametrize("how", list(ROUND_TRIPS))
def test_current_scaling_quantizer_comes_back_with_its_settings(how):
    quantizer = Float8CurrentScalingQuantizer(
        torch.float8_e4m3fn, power_2_scale=True, amax_epsilon=0.5, internal=True
    )
    loaded = ROUND_TRIPS[how](_f8(torch.float8_e4m3fn, torch.float32, quantizer=quantizer))
    q = loaded._quantizer
    assert type(q) is Float8CurrentScalingQuantizer
    settings = (q.fp8_dtype, q.power_2_scale, q.amax_epsilon, q.internal)
    assert settings == (torch.float8_e4m3fn, True, 0.5, True)
    # It is the one used: an update makes a power-of-two scale (448 / amax is none here).
    loaded.copy_(representable((7, 33), torch.float8_e4m3fn, scale=4.0) * 3)
    assert loaded._storage.scale_inv.log2().frac().item() == 0.0


@pytest.mark.parametrize("how", ["pickle", "torch_save"])
def test_delayed_scaling_quantizer_is_not_pickled(how):
    # Its scale and amax are views into the owner's state: a pickled copy would be detached.
    scale, amax = torch.tensor([2.0]), torch.zeros(1)
    quantizer = Float8Quantizer(scale, amax, torch.float8_e4m3fn, internal=False)
    tensor = _f8(torch.float8_e4m3fn, torch.float32, quantizer=quantizer)
    recorded = amax.clone()
    loaded = ROUND_TRIPS[how](tensor)
    assert loaded._quantizer is None
    _assert_same_value(loaded, tensor)
    # Without a quantizer, an update requantizes with current scaling: values the original's
    # scale (2.0) would saturate are kept.
    new_hp = tensor.dequantize() * 64
    loaded.copy_(new_hp)
    assert_close(loaded.dequantize(), new_hp.double(), torch.float8_e4m3fn)
    assert torch.equal(amax, recorded)  # the original's state is untouched


def test_old_files_with_fp8_data_still_load():
    # Files written before the data was pickled as bytes call the rebuild with fp8 tensors.
    tensor = _f8(torch.float8_e4m3fn, torch.bfloat16)
    s = tensor._storage
    args = (s.rowwise_data, s.columnwise_data, s.scale_inv, s.fp8_dtype, s.shape)
    loaded = _rebuild_float8_tensor(*args, torch.bfloat16, True, True)
    assert isinstance(loaded, torch.nn.Parameter) and loaded._quantizer is None
    assert loaded._storage.rowwise_data.dtype == torch.float8_e4m3fn
    assert torch.equal(loaded.dequantize(), tensor.dequantize())


# ----------------------------------------------------------------------------------------------
# Modules with FP8 weights
# ----------------------------------------------------------------------------------------------

RECIPES = {"delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling}
# name -> (constructor, output features); inputs have 32 features.
MODULES = {
    "linear": (lambda: te.Linear(32, 48), 48),
    "layernorm_mlp": (lambda: te.LayerNormMLP(32, 64), 32),
}


def _build(recipe_name: str, module_name: str) -> torch.nn.Module:
    with te.quantized_model_init(recipe=RECIPES[recipe_name]()):
        module = MODULES[module_name][0]()
    assert any(isinstance(p, Float8Tensor) for p in module.parameters())
    return module


def _step(module: torch.nn.Module, recipe_name: str, x: torch.Tensor, grad_y: torch.Tensor):
    """Forward and backward under te.autocast: (output, gradient of each parameter)."""
    for p in module.parameters():
        p.grad = None
    with te.autocast(recipe=RECIPES[recipe_name]()):
        y = module(x)
    y.backward(grad_y)
    return y.detach(), [p.grad for p in module.parameters()]


def _fp8_bytes(module: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for p in module.parameters():
        if isinstance(p, Float8Tensor):
            assert isinstance(p, torch.nn.Parameter)
            storage = p._storage
            out.append((storage.rowwise_data.view(torch.uint8).clone(), storage.scale_inv.clone()))
    return out


def _assert_equal_lists(a: list, b: list) -> None:
    assert len(a) == len(b) > 0
    for ta, tb in zip(a, b, strict=True):
        if isinstance(ta, tuple):
            _assert_equal_lists(list(ta), list(tb))
        else:
            assert torch.equal(ta, tb)


@pytest.mark.parametrize("how", list(MODULE_ROUND_TRIPS))
@pytest.mark.parametrize("module_name", list(MODULES))
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_module_copy_computes_identically(recipe_name, module_name, how):
    original = _build(recipe_name, module_name)
    copied = MODULE_ROUND_TRIPS[how](original)
    _assert_equal_lists(_fp8_bytes(copied), _fp8_bytes(original))
    x, grad_y = torch.randn(16, 32), torch.randn(16, MODULES[module_name][1])
    y, grads = _step(original, recipe_name, x, grad_y)
    y_copy, grads_copy = _step(copied, recipe_name, x, grad_y)
    assert torch.equal(y_copy, y)
    _assert_equal_lists(grads_copy, grads)


@pytest.mark.parametrize("how", list(MODULE_ROUND_TRIPS))
@pytest.mark.parametrize("module_name", list(MODULES))
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_module_copy_trains_identically(recipe_name, module_name, how):
    original = _build(recipe_name, module_name)
    copied = MODULE_ROUND_TRIPS[how](original)
    x, grad_y = torch.randn(16, 32), torch.randn(16, MODULES[module_name][1])
    bytes_before = _fp8_bytes(original)
    results = []
    for module in (original, copied):
        _step(module, recipe_name, x, grad_y)
        torch.optim.SGD(module.parameters(), lr=0.5).step()
        y_next, _ = _step(module, recipe_name, x, grad_y)
        results.append((_fp8_bytes(module), y_next))
    (bytes_original, y_original), (bytes_copy, y_copy) = results
    assert not torch.equal(bytes_original[0][0], bytes_before[0][0])  # the step moved them
    _assert_equal_lists(bytes_copy, bytes_original)
    assert torch.equal(y_copy, y_original)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_cuda_module_copy_computes_identically(recipe_name):
    with te.quantized_model_init(recipe=RECIPES[recipe_name]()):
        original = te.Linear(32, 48, device="cuda")
    copied = pickle.loads(pickle.dumps(original))
    assert copied.weight.device == original.weight.device
    x, grad_y = torch.randn(16, 32, device="cuda"), torch.randn(16, 48, device="cuda")
    y, grads = _step(original, recipe_name, x, grad_y)
    y_copy, grads_copy = _step(copied, recipe_name, x, grad_y)
    assert torch.equal(y_copy, y)
    _assert_equal_lists(grads_copy, grads)
