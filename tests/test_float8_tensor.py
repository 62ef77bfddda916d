"""Float8Tensor: metadata, numerics against fp64, aliasing, in-place requantization, and its
life as an nn.Parameter (autograd, optimizers, state_dict, torch.save, module.to).

Inputs are exactly representable in the FP8 dtype and quantized with power-of-two scales, so
quantizing them is exact; results are compared in float64 within the shared tolerance table.
"""

from __future__ import annotations

import copy
import io
import logging

import pytest
import torch
from tolerances import assert_close, representable
from torch._dynamo.testing import CompileCounter
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

import torchte as te
from torchte import recipe
from torchte.quantization.float8 import (
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Float8Storage,
)
from torchte.quantization.float8_tensor import Float8Tensor, _map_storage

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
NOMINAL_DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(7, 33), (1, 5), (3, 4, 6), (16, 16)]


def _quantizer(fp8_dtype: torch.dtype, internal: bool = False) -> Float8CurrentScalingQuantizer:
    return Float8CurrentScalingQuantizer(fp8_dtype, power_2_scale=True, internal=internal)


def _exact(shape, fp8_dtype: torch.dtype, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values exact in fp8_dtype (and in dtype), in dtype."""
    return representable(tuple(shape), fp8_dtype, scale=4.0).to(dtype)


def _f8(shape, fp8_dtype, dtype=torch.float32) -> tuple[Float8Tensor, torch.Tensor]:
    x_hp = _exact(shape, fp8_dtype, dtype)
    return _quantizer(fp8_dtype).quantize(x_hp), x_hp


def _bytes(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.view(torch.uint8)


def _assert_same_bytes(a: Float8Storage, b: Float8Storage) -> None:
    for name in ("rowwise_data", "columnwise_data", "scale_inv"):
        ta, tb = getattr(a, name), getattr(b, name)
        assert (ta is None) == (tb is None), name
        if ta is not None:
            assert torch.equal(_bytes(ta), _bytes(tb)), name


def _data_ptrs(t: Float8Tensor) -> tuple[int, ...]:
    return tuple(x.data_ptr() for x in t._storage.get_data_tensors() if x is not None)


# ----------------------------------------------------------------------------------------------
# Construction, dequantize, repr
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", NOMINAL_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_from_storage_metadata(fp8_dtype, dtype):
    quantizer = _quantizer(fp8_dtype, internal=True)
    storage = quantizer.quantize(_exact((7, 33), fp8_dtype, dtype))
    assert isinstance(storage, Float8Storage)
    tensor = Float8Tensor.from_storage(storage, dtype=dtype, quantizer=quantizer)
    assert type(tensor) is Float8Tensor
    assert tensor.shape == (7, 33)
    assert tensor.dtype == dtype
    assert tensor.device == storage.device
    assert tensor.fp8_dtype == fp8_dtype
    assert tensor._storage is storage
    assert tensor._quantizer is quantizer
    assert not tensor.requires_grad


@pytest.mark.parametrize("dtype", NOMINAL_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_quantizer_not_internal_makes_float8_tensor(fp8_dtype, dtype):
    x_hp = _exact((3, 4, 6), fp8_dtype, dtype)
    tensor = _quantizer(fp8_dtype).quantize(x_hp)
    assert type(tensor) is Float8Tensor
    assert (tensor.shape, tensor.dtype) == (x_hp.shape, dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", NOMINAL_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_dequantize_matches_fp64_reference(fp8_dtype, dtype, shape):
    tensor, x_hp = _f8(shape, fp8_dtype, dtype)
    out = tensor.dequantize()
    assert type(out) is torch.Tensor
    assert (out.shape, out.dtype) == (tensor.shape, dtype)
    assert_close(out, x_hp.double(), fp8_dtype)
    assert torch.equal(out.double(), x_hp.double())  # exact inputs, power-of-two scale
    assert tensor.dequantize(torch.float64).dtype == torch.float64


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_dequantize_of_random_values_within_fp8_tolerance(fp8_dtype):
    x_hp = torch.randn(37, 129)
    tensor = Float8CurrentScalingQuantizer(fp8_dtype, internal=False).quantize(x_hp)
    assert_close(tensor.dequantize(), x_hp.double(), fp8_dtype)


def test_dequantize_passes_gradient_through():
    tensor, _ = _f8((4, 8), torch.float8_e4m3fn)
    param = torch.nn.Parameter(tensor)
    weight = torch.randn(4, 8)
    (param.dequantize() * weight).sum().backward()
    assert type(param.grad) is torch.Tensor
    assert torch.equal(param.grad, weight)


def test_repr_shows_metadata_and_values():
    tensor, x_hp = _f8((3, 5), torch.float8_e5m2, torch.bfloat16)
    text = repr(tensor)
    assert text.startswith("Float8Tensor(")
    assert "shape=(3, 5)" in text
    assert "dtype=torch.bfloat16" in text
    assert "fp8_dtype=torch.float8_e5m2" in text
    assert f"{x_hp.reshape(-1)[0].item():.4g}" in text
    assert "..." in text  # 15 values, only the first few shown


def test_repr_of_fake_or_meta_tensor_shows_no_values():
    tensor, _ = _f8((3, 16), torch.float8_e4m3fn)
    fake = FakeTensorMode().from_tensor(tensor)  # as torch.compile traces it
    assert type(fake) is Float8Tensor
    meta = Float8Tensor(_map_storage(tensor._storage, lambda t: t.to("meta")), torch.float32)
    for value in (fake, meta):
        text = repr(value)
        assert "values=<not materialized>" in text and "shape=(3, 16)" in text


# ----------------------------------------------------------------------------------------------
# Aliases and copies
# ----------------------------------------------------------------------------------------------


def test_detach_and_same_shape_views_share_storage():
    tensor, _ = _f8((6, 10), torch.float8_e4m3fn)
    aliases = [
        tensor.detach(),
        tensor.view(6, 10),
        tensor.view(-1, 10),
        tensor.view_as(tensor),
        tensor[:],
        tensor.data,
    ]
    for alias in aliases:
        assert type(alias) is Float8Tensor
        assert alias._storage is tensor._storage
        assert alias.shape == tensor.shape and alias.dtype == tensor.dtype


def test_transposing_views_give_plain_tensors():
    tensor, x_hp = _f8((6, 10), torch.float8_e4m3fn)
    for out, expected in ((tensor.t(), x_hp.t()), (tensor[:, 2:5], x_hp[:, 2:5])):
        assert type(out) is torch.Tensor
        assert torch.equal(out, expected)


def test_row_views_are_float8_tensors_over_the_same_bytes():
    """reshape(-1), a block of rows, split along rows (how FSDP2 shards a parameter): Float8Tensors
    over the rowwise bytes with the same scale_inv; a write through one shows in the other."""
    tensor, x_hp = _f8((6, 10), torch.float8_e4m3fn)
    views = [
        (tensor.reshape(-1), x_hp.reshape(-1)),
        (tensor[2:5], x_hp[2:5]),
        *zip(torch.split(tensor, 4), torch.split(x_hp, 4), strict=True),
    ]
    for out, expected in views:
        assert isinstance(out, Float8Tensor) and out.shape == expected.shape
        assert out._storage.scale_inv is tensor._storage.scale_inv
        assert out._storage.columnwise_data is None
        assert torch.equal(out.dequantize(), expected)
    zeros = tensor.new_zeros((3, 10))
    assert isinstance(zeros, Float8Tensor) and torch.equal(zeros.dequantize(), torch.zeros(3, 10))
    tensor[2:5].copy_(zeros)
    assert tensor._storage.columnwise_data is None  # no stale transpose left behind
    tensor._storage.update_usage(rowwise_usage=False, columnwise_usage=True)
    want = torch.cat([x_hp[:2], torch.zeros(3, 10), x_hp[5:]])
    assert torch.equal(tensor.dequantize(), want)  # from the transpose made anew


def test_detach_sees_in_place_updates():
    tensor, _ = _f8((6, 10), torch.float8_e4m3fn)
    alias = tensor.detach()
    new_hp = _exact((6, 10), torch.float8_e4m3fn)
    tensor.copy_(new_hp)
    assert torch.equal(alias.dequantize(), new_hp)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_copy_from_hp_requantizes_in_place(fp8_dtype):
    tensor, _ = _f8((9, 20), fp8_dtype)
    ptrs, version = _data_ptrs(tensor), tensor._version
    new_hp = _exact((9, 20), fp8_dtype) * 8
    out = tensor.copy_(new_hp)
    assert out is tensor
    assert _data_ptrs(tensor) == ptrs
    assert tensor._version > version
    assert_close(tensor.dequantize(), new_hp.double(), fp8_dtype)
    assert torch.equal(tensor.dequantize(), new_hp)
    # The columnwise copy is rewritten too.
    columnwise = tensor._storage.columnwise_data[:, :9].t().float() * tensor._storage.scale_inv
    assert torch.equal(columnwise, new_hp)


def test_copy_broadcasts_the_source():
    tensor, _ = _f8((4, 6), torch.float8_e4m3fn)
    row = _exact((6,), torch.float8_e4m3fn)
    tensor.copy_(row)
    assert torch.equal(tensor.dequantize(), row.expand(4, 6))


def test_copy_from_float8_tensor_of_same_format_copies_bytes():
    dst, _ = _f8((9, 20), torch.float8_e4m3fn)
    src = Float8CurrentScalingQuantizer(torch.float8_e4m3fn, internal=False).quantize(
        torch.randn(9, 20)
    )
    ptrs = _data_ptrs(dst)
    dst.copy_(src)
    assert _data_ptrs(dst) == ptrs
    _assert_same_bytes(dst._storage, src._storage)


def test_copy_from_rowwise_only_source_fills_columnwise():
    dst, _ = _f8((5, 7), torch.float8_e4m3fn)
    x_hp = _exact((5, 7), torch.float8_e4m3fn)
    src = _quantizer(torch.float8_e4m3fn).quantize(x_hp, columnwise=False)
    assert src._storage.columnwise_data is None
    dst.copy_(src)
    assert src._storage.columnwise_data is None  # the source is left as it was
    cols = dst._storage.columnwise_data[:, :5].t().float() * dst._storage.scale_inv
    assert torch.equal(cols, x_hp)


def test_copy_from_float8_tensor_of_other_format_requantizes():
    dst, _ = _f8((9, 20), torch.float8_e5m2)
    src, x_hp = _f8((9, 20), torch.float8_e4m3fn)
    dst.copy_(src)
    assert dst.fp8_dtype == torch.float8_e5m2
    assert_close(dst.dequantize(), x_hp.double(), torch.float8_e5m2)


def test_copy_into_plain_tensor_dequantizes():
    tensor, x_hp = _f8((4, 6), torch.float8_e4m3fn)
    plain = torch.zeros(4, 6)
    plain.copy_(tensor)
    assert type(plain) is torch.Tensor and torch.equal(plain, x_hp)


def test_clone_copies_data():
    tensor, x_hp = _f8((4, 6), torch.float8_e4m3fn)
    clone = tensor.clone()
    assert type(clone) is Float8Tensor
    assert set(_data_ptrs(clone)).isdisjoint(_data_ptrs(tensor))
    _assert_same_bytes(clone._storage, tensor._storage)
    clone.zero_()
    assert torch.equal(tensor.dequantize(), x_hp)


def test_quantize_with_delayed_scaling_quantizer_uses_its_scale():
    scale, amax = torch.tensor([4.0]), torch.zeros(1)
    quantizer = Float8Quantizer(scale, amax, torch.float8_e4m3fn, internal=False)
    x_hp = _exact((3, 8), torch.float8_e4m3fn)
    tensor = quantizer.quantize(x_hp)
    ptrs, version = _data_ptrs(tensor), tensor._version
    assert tensor.quantize_(x_hp * 2) is tensor
    assert _data_ptrs(tensor) == ptrs and tensor._version > version
    assert tensor._storage.scale_inv.item() == 0.25
    assert amax.item() == (x_hp * 2).abs().max().item()
    assert torch.equal(tensor.dequantize(), x_hp * 2)


# ----------------------------------------------------------------------------------------------
# In-place ops and the fallback
# ----------------------------------------------------------------------------------------------

IN_PLACE_OPS = {
    "add_": lambda t, o: t.add_(o, alpha=0.5),
    "mul_": lambda t, o: t.mul_(o),
    "sub_scalar": lambda t, o: t.sub_(1.0),
    "addcdiv_": lambda t, o: t.addcdiv_(o, o.abs() + 1, value=-2.0),
    "lerp_": lambda t, o: t.lerp_(o, 0.25),
    "zero_": lambda t, o: t.zero_(),
    "fill_": lambda t, o: t.fill_(1.5),
    "clamp_": lambda t, o: t.clamp_(min=-0.5, max=0.5),
}


@pytest.mark.parametrize("op", list(IN_PLACE_OPS))
@pytest.mark.parametrize("dtype", NOMINAL_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_in_place_ops_requantize_into_self(fp8_dtype, dtype, op):
    tensor, x_hp = _f8((7, 33), fp8_dtype, dtype)
    other = torch.randn(7, 33, dtype=dtype)
    ptrs = _data_ptrs(tensor)
    expected = IN_PLACE_OPS[op](x_hp.double(), other.double())
    out = IN_PLACE_OPS[op](tensor, other)
    assert out is tensor
    assert type(tensor) is Float8Tensor and tensor.dtype == dtype
    assert _data_ptrs(tensor) == ptrs
    assert_close(tensor.dequantize(), expected, fp8_dtype)


def test_out_argument_that_is_float8_is_requantized():
    tensor, _ = _f8((4, 6), torch.float8_e4m3fn)
    a, b = _exact((4, 6), torch.float8_e4m3fn), _exact((4, 6), torch.float8_e4m3fn)
    out = torch.add(a, b, out=tensor)
    assert out is tensor and type(out) is Float8Tensor
    assert_close(tensor.dequantize(), a.double() + b.double(), torch.float8_e4m3fn)


def test_in_place_op_on_plain_tensor_reads_float8_value():
    tensor, x_hp = _f8((4, 6), torch.float8_e4m3fn)
    plain = torch.ones(4, 6)
    plain.add_(tensor)
    assert type(plain) is torch.Tensor and torch.equal(plain, x_hp + 1)


@pytest.mark.parametrize("dtype", NOMINAL_DTYPES)
def test_fallback_matmul_gives_plain_dequantized_result(dtype):
    tensor, x_hp = _f8((7, 33), torch.float8_e4m3fn, dtype)
    other = _exact((33, 5), torch.float8_e4m3fn, dtype)
    out = torch.matmul(tensor, other)
    assert type(out) is torch.Tensor
    assert (out.shape, out.dtype) == ((7, 5), dtype)
    assert_close(out, x_hp.double() @ other.double(), dtype)
    assert torch.equal(tensor + 1, x_hp + 1)


def test_like_ops_give_plain_tensors_of_nominal_dtype():
    tensor, _ = _f8((4, 6), torch.float8_e4m3fn, torch.bfloat16)
    for out, fill in ((torch.zeros_like(tensor), 0.0), (tensor.new_ones(3), 1.0)):
        assert type(out) is torch.Tensor and out.dtype == torch.bfloat16
        assert bool((out == fill).all())
    assert torch.empty_like(tensor).shape == (4, 6)


# ----------------------------------------------------------------------------------------------
# to / device moves
# ----------------------------------------------------------------------------------------------


def test_to_other_dtype_gives_plain_dequantized_tensor():
    tensor, x_hp = _f8((4, 6), torch.float8_e4m3fn, torch.float32)
    for out in (tensor.to(torch.bfloat16), tensor.double(), tensor.to("cpu", torch.float16)):
        assert type(out) is torch.Tensor
        assert torch.equal(out.double(), x_hp.double())
    assert tensor.to(torch.float32) is tensor


def test_to_same_dtype_with_copy_gives_float8_copy():
    tensor, _ = _f8((4, 6), torch.float8_e4m3fn)
    assert tensor.to("cpu") is tensor
    moved = tensor.to("cpu", copy=True)
    assert type(moved) is Float8Tensor and moved.device.type == "cpu"
    assert set(_data_ptrs(moved)).isdisjoint(_data_ptrs(tensor))
    _assert_same_bytes(moved._storage, tensor._storage)


def test_data_setter_takes_the_new_value():
    tensor, _ = _f8((4, 6), torch.float8_e4m3fn)
    other, _ = _f8((3, 5), torch.float8_e4m3fn)
    tensor.data = other
    assert tensor.shape == (3, 5) and tensor._storage is other._storage
    plain = _exact((2, 8), torch.float8_e4m3fn)
    tensor.data = plain
    assert type(tensor) is Float8Tensor and tensor.shape == (2, 8)
    assert torch.equal(tensor.dequantize(), plain)


# ----------------------------------------------------------------------------------------------
# As an nn.Parameter
# ----------------------------------------------------------------------------------------------


def _fp8_linear(fp8_dtype=torch.float8_e4m3fn, dtype=torch.float32) -> torch.nn.Linear:
    linear = torch.nn.Linear(33, 7, bias=False, dtype=dtype)
    weight, _ = _f8((7, 33), fp8_dtype, dtype)
    linear.weight = torch.nn.Parameter(weight)
    return linear


@pytest.mark.parametrize("dtype", NOMINAL_DTYPES)
def test_parameter_gradients_are_plain_and_accumulate(dtype):
    tensor, w_hp = _f8((7, 33), torch.float8_e4m3fn, dtype)
    param = torch.nn.Parameter(tensor)
    assert type(param) is Float8Tensor and isinstance(param, torch.nn.Parameter)
    assert param.requires_grad and param._storage is tensor._storage
    x = _exact((5, 33), torch.float8_e4m3fn, dtype).requires_grad_()
    grad_out = _exact((5, 7), torch.float8_e4m3fn, dtype)
    for step in (1, 2):
        torch.nn.functional.linear(x, param).backward(grad_out)
        assert type(param.grad) is torch.Tensor and param.grad.dtype == dtype
        assert_close(param.grad, step * grad_out.double().t() @ x.double(), dtype)
    assert_close(x.grad, 2 * grad_out.double() @ w_hp.double(), dtype)


def _optimizer_step(param: torch.Tensor, grad: torch.Tensor, opt_cls, **opt_kwargs) -> None:
    param.grad = grad.clone()
    opt_cls([param], **opt_kwargs).step()


OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.5, "momentum": 0.9, "weight_decay": 0.1}),
    "adam": (torch.optim.Adam, {"lr": 0.5}),
    "adamw": (torch.optim.AdamW, {"lr": 0.5, "weight_decay": 0.25}),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", NOMINAL_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_optimizer_step_matches_high_precision_step(fp8_dtype, dtype, name):
    opt_cls, opt_kwargs = OPTIMIZERS[name]
    param = torch.nn.Parameter(_f8((7, 33), fp8_dtype, dtype)[0])
    ref = torch.nn.Parameter(param.dequantize().detach().clone())
    grad = torch.randn(7, 33, dtype=dtype)
    ptrs, before = _data_ptrs(param), ref.detach().clone()
    _optimizer_step(ref, grad, opt_cls, **opt_kwargs)
    _optimizer_step(param, grad, opt_cls, **opt_kwargs)
    assert type(param) is Float8Tensor and isinstance(param, torch.nn.Parameter)
    assert _data_ptrs(param) == ptrs
    assert (ref - before).abs().max() > 0.25  # the step is large enough to show in FP8
    assert (param.dequantize() - before).abs().max() > 0.25
    assert_close(param.dequantize(), ref.double(), fp8_dtype)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_state_dict_round_trip_is_bit_identical(fp8_dtype):
    source, target = _fp8_linear(fp8_dtype), _fp8_linear(fp8_dtype)
    with torch.no_grad():
        target.weight.copy_(torch.randn(7, 33))
    assert not torch.equal(target.weight.dequantize(), source.weight.dequantize())
    weight_before, ptrs = target.weight, _data_ptrs(target.weight)
    state = source.state_dict()
    assert type(state["weight"]) is Float8Tensor
    assert not state["weight"].requires_grad
    target.load_state_dict(state)
    assert target.weight is weight_before and type(target.weight) is Float8Tensor
    assert _data_ptrs(target.weight) == ptrs
    _assert_same_bytes(target.weight._storage, source.weight._storage)


def test_load_high_precision_state_dict_into_fp8_module_quantizes():
    linear = _fp8_linear()
    w_hp = _exact((7, 33), torch.float8_e4m3fn)
    linear.load_state_dict({"weight": w_hp})
    assert type(linear.weight) is Float8Tensor
    assert torch.equal(linear.weight.dequantize(), w_hp)


def test_load_fp8_state_dict_into_plain_module_dequantizes():
    source, plain = _fp8_linear(), torch.nn.Linear(33, 7, bias=False)
    plain.load_state_dict(source.state_dict())
    assert type(plain.weight.data) is torch.Tensor
    assert torch.equal(plain.weight.detach(), source.weight.dequantize())


def _save_load(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer)  # weights_only=True, torch's default


@pytest.mark.parametrize("dtype", NOMINAL_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_torch_save_load_round_trip(fp8_dtype, dtype):
    tensor, x_hp = _f8((3, 4, 6), fp8_dtype, dtype)
    loaded = _save_load({"w": tensor})["w"]
    assert type(loaded) is Float8Tensor
    assert (loaded.shape, loaded.dtype, loaded.fp8_dtype) == (tensor.shape, dtype, fp8_dtype)
    _assert_same_bytes(loaded._storage, tensor._storage)
    assert torch.equal(loaded.dequantize(), x_hp)
    # The current-scaling quantizer comes back (its settings are all it has): an update
    # requantizes with its power-of-two scale, exactly.
    assert type(loaded._quantizer) is Float8CurrentScalingQuantizer
    assert loaded._quantizer.power_2_scale
    loaded.copy_(x_hp * 2)
    assert torch.equal(loaded.dequantize(), x_hp * 2)


def test_torch_save_load_of_parameter_keeps_it_a_parameter():
    linear = _fp8_linear()
    loaded = _save_load(linear.weight)
    assert type(loaded) is Float8Tensor and isinstance(loaded, torch.nn.Parameter)
    assert loaded.requires_grad
    _assert_same_bytes(loaded._storage, linear.weight._storage)


def test_module_to_cpu_and_deepcopy_keep_fp8_parameters():
    linear = _fp8_linear()
    weight = linear.weight
    linear.to("cpu")
    linear.to(device=torch.device("cpu"), dtype=torch.float32)
    assert linear.weight is weight and type(linear.weight) is Float8Tensor
    clone = copy.deepcopy(linear)
    assert type(clone.weight) is Float8Tensor and isinstance(clone.weight, torch.nn.Parameter)
    assert set(_data_ptrs(clone.weight)).isdisjoint(_data_ptrs(weight))
    _assert_same_bytes(clone.weight._storage, weight._storage)


def test_module_to_other_dtype_keeps_fp8_with_new_nominal_dtype():
    # module.to(dtype) sets param.data to the converted value; the setter requantizes it.
    linear = _fp8_linear()
    weight, w_hp = linear.weight, linear.weight.dequantize()
    linear.to(torch.bfloat16)
    assert linear.weight is weight and type(weight) is Float8Tensor
    assert weight.dtype == torch.bfloat16 and weight.fp8_dtype == torch.float8_e4m3fn
    assert torch.equal(weight.dequantize().float(), w_hp)
    x = _exact((2, 33), torch.float8_e4m3fn, torch.bfloat16)
    assert linear(x).dtype == torch.bfloat16


# ----------------------------------------------------------------------------------------------
# The traceable wrapper-subclass protocol (torch.compile)
# ----------------------------------------------------------------------------------------------

USAGES = {"rowwise": (True, False), "columnwise": (False, True), "both": (True, True)}


@pytest.mark.parametrize("usage", list(USAGES))
@pytest.mark.parametrize("dtype", NOMINAL_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_tensor_flatten_unflatten_round_trip(fp8_dtype, dtype, usage):
    rowwise, columnwise = USAGES[usage]
    x_hp = _exact((7, 33), fp8_dtype, dtype)
    tensor = _quantizer(fp8_dtype).quantize(x_hp, rowwise=rowwise, columnwise=columnwise)
    assert is_traceable_wrapper_subclass(tensor)
    names, meta = tensor.__tensor_flatten__()
    kept = (("_rowwise_data", rowwise), ("_columnwise_data", columnwise), ("_scale_inv", True))
    assert names == [name for name, present in kept if present]
    assert (meta.fp8_dtype, meta.shape, meta.dtype) == (fp8_dtype, (7, 33), dtype)
    inner = {name: getattr(tensor, name) for name in names}
    rebuilt = Float8Tensor.__tensor_unflatten__(inner, meta, tensor.shape, tensor.stride())
    assert type(rebuilt) is Float8Tensor
    assert (rebuilt.shape, rebuilt.dtype, rebuilt.fp8_dtype) == (tensor.shape, dtype, fp8_dtype)
    _assert_same_bytes(rebuilt._storage, tensor._storage)
    assert torch.equal(rebuilt.dequantize(), x_hp)
    # The metadata is plain values: torch.compile deep-copies it and compares it by value.
    assert copy.deepcopy(meta) == meta
    assert type(rebuilt._quantizer) is Float8CurrentScalingQuantizer
    assert rebuilt._quantizer.power_2_scale


def test_unflatten_drops_a_delayed_scaling_quantizer():
    quantizer = Float8Quantizer(torch.tensor([4.0]), torch.zeros(1), torch.float8_e4m3fn, False)
    tensor = quantizer.quantize(_exact((3, 16), torch.float8_e4m3fn))
    names, meta = tensor.__tensor_flatten__()
    assert meta.quantizer is None
    inner = {name: getattr(tensor, name) for name in names}
    rebuilt = Float8Tensor.__tensor_unflatten__(inner, meta, tensor.shape, tensor.stride())
    assert rebuilt._quantizer is None
    _assert_same_bytes(rebuilt._storage, tensor._storage)


COMPILED_FUNCTIONS = {
    "dequantize_times_2": lambda t: t.dequantize() * 2,
    "add_1": lambda t: t + 1,
}


@pytest.mark.parametrize("name", list(COMPILED_FUNCTIONS))
def test_compiled_function_of_float8_tensor_matches_eager(name):
    fn = COMPILED_FUNCTIONS[name]
    counter = CompileCounter()
    compiled = torch.compile(fn, fullgraph=True, backend=counter)
    for _ in range(2):  # a second tensor of the same format reuses the graph
        tensor, x_hp = _f8((8, 32), torch.float8_e4m3fn, torch.bfloat16)
        out = compiled(tensor)
        assert type(out) is torch.Tensor
        assert torch.equal(out, fn(tensor))
        assert torch.equal(out.float(), fn(x_hp).float())
    assert counter.frame_count == 1


def test_compiled_function_differentiates_through_dequantize():
    param = torch.nn.Parameter(_f8((8, 32), torch.float8_e4m3fn)[0])
    weight = torch.randn(8, 32)
    compiled = torch.compile(lambda p, w: (p.dequantize() * w).sum(), backend="aot_eager")
    out = compiled(param, weight)
    assert torch.equal(out, (param.dequantize() * weight).sum())
    out.backward()
    assert type(param.grad) is torch.Tensor and torch.equal(param.grad, weight)


def test_compiled_function_returns_float8_tensor(caplog):
    # At debug level torch's logs print the traced (fake) outputs: repr must not need values.
    caplog.set_level(logging.DEBUG, logger="torch")
    tensor, _ = _f8((8, 32), torch.float8_e5m2)
    out = torch.compile(lambda t: t.detach(), fullgraph=True, backend="aot_eager")(tensor)
    assert type(out) is Float8Tensor and out.fp8_dtype == torch.float8_e5m2
    _assert_same_bytes(out._storage, tensor._storage)


def test_data_is_transformer_engines_name_for_the_bytes():
    tensor, _ = _f8((6, 10), torch.float8_e4m3fn)
    data = tensor._data
    assert data.dtype == torch.uint8 and data.shape == (6, 10)
    assert torch.equal(data, tensor._storage.rowwise_data.view(torch.uint8))
    assert data.data_ptr() == tensor._storage.rowwise_data.data_ptr()  # a view, no copy


@pytest.mark.gpu
@pytest.mark.parametrize("recipe_name", ["current", "block"])
def test_fp8_parameters_through_cpu_and_cuda_keep_their_bytes_and_quantizer(recipe_name):
    """Quantized parameters moved to the CPU and back (module.cpu(), module.cuda()) stay
    quantized parameters with their quantizer and bytes, and the layer gives the same output."""
    recipes = {"current": recipe.Float8CurrentScaling, "block": recipe.Float8BlockScaling}
    fp8 = recipes[recipe_name]()
    with te.quantized_model_init(enabled=True, recipe=fp8):
        layer = te.Linear(128, 128, params_dtype=torch.bfloat16, device="cuda")
    weight_type = type(layer.weight)
    bytes_before = [t.cpu() for t in layer.weight._storage.get_data_tensors() if t is not None]
    x = torch.randn(32, 128, device="cuda", dtype=torch.bfloat16)
    with te.autocast(recipe=fp8):
        want = layer(x)
    layer.cpu()
    assert type(layer.weight) is weight_type and layer.weight.device.type == "cpu"
    layer.cuda()
    layer.apply(lambda module: None)
    weight = layer.weight
    assert type(weight) is weight_type and isinstance(weight, torch.nn.Parameter)
    assert weight.is_cuda and weight._get_quantizer() is not None
    after = [t.cpu() for t in weight._storage.get_data_tensors() if t is not None]
    assert all(torch.equal(a, b) for a, b in zip(after, bytes_before, strict=True))
    with te.autocast(recipe=fp8):
        assert torch.equal(layer(x), want)
