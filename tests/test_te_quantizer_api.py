"""Transformer Engine 2.x's quantizer API on torchte: the quantizer constructors and calls,
QuantizerRole, Float8Tensor's keyword constructor and view rules, the quantized_tensor helpers,
is_non_tn_fp8_gemm_supported, a module's fp8_meta and the recipe-change warning, also reached
through the alias's module paths."""

from __future__ import annotations

import dataclasses
import sys
import warnings

import pytest
import torch

import torchte
from torchte import _alias as alias_api
from torchte import recipe, utils
from torchte.constants import DType
from torchte.fp8 import FP8GlobalStateManager
from torchte.quantization import float8 as own
from torchte.quantization import te_api
from torchte.quantization.float8 import Float8Storage
from torchte.quantization.float8_tensor import Float8Tensor

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _bytes(value) -> torch.Tensor:
    storage = value._storage if isinstance(value, Float8Tensor) else value
    return storage.rowwise_data.view(torch.uint8)


# -- quantizers -------------------------------------------------------------------------------


@pytest.mark.parametrize("fp8_dtype", [DType.kFloat8E4M3, DType.kFloat8E5M2, E4M3, E5M2])
def test_delayed_quantizer_with_te_signature(fp8_dtype):
    torch.manual_seed(0)
    x = torch.randn(8, 32)
    scale, amax = torch.tensor([2.0]), torch.zeros(1)
    q = te_api.Float8Quantizer(scale, amax, fp8_dtype)
    y = q(x)
    torch_dtype = fp8_dtype if isinstance(fp8_dtype, torch.dtype) else {7: E4M3, 8: E5M2}[fp8_dtype]
    expected = own.Float8Quantizer(torch.tensor([2.0]), torch.zeros(1), torch_dtype).quantize(x)
    assert isinstance(y, Float8Tensor) and y.fp8_dtype == torch_dtype
    assert torch.equal(_bytes(y), _bytes(expected))
    assert y._storage.columnwise_data is not None
    # amax written in place, scale read in place
    assert amax.item() == x.abs().max().item()
    scale.fill_(0.5)
    expected = own.Float8Quantizer(torch.tensor([0.5]), torch.zeros(1), torch_dtype).quantize(x)
    assert torch.equal(_bytes(q.quantize(x)), _bytes(expected))
    assert q.dtype == {E4M3: DType.kFloat8E4M3, E5M2: DType.kFloat8E5M2}[torch_dtype]


def test_delayed_quantizer_usage_internal_copy_and_checks():
    x = torch.randn(16, 16)
    q = te_api.Float8Quantizer(torch.ones(1), torch.zeros(1), DType.kFloat8E4M3, columnwise=False)
    assert (q.rowwise_usage, q.columnwise_usage, q.internal) == (True, False, False)
    assert q(x)._storage.columnwise_data is None
    q.set_usage(rowwise=False, columnwise=True)
    out = q(x)
    assert out._storage.rowwise_data is None and out._storage.columnwise_data is not None
    q.internal = True
    assert isinstance(q(x), Float8Storage)
    twin = q.copy()
    assert twin.scale is q.scale and twin.amax is q.amax and twin.internal
    assert (twin.rowwise_usage, twin.columnwise_usage) == (False, True)
    twin.set_usage(rowwise=True)
    assert not q.rowwise_usage
    with pytest.raises(ValueError, match="scale"):
        te_api.Float8Quantizer(torch.ones(2), torch.zeros(1), DType.kFloat8E4M3)
    with pytest.raises(TypeError, match="fp8_dtype"):
        te_api.Float8Quantizer(torch.ones(1), torch.zeros(1), DType.kBFloat16)


def test_current_scaling_quantizer_with_te_signature():
    torch.manual_seed(1)
    x = torch.randn(24, 48) * 3
    q = te_api.Float8CurrentScalingQuantizer(DType.kFloat8E4M3, torch.device("cpu"))
    y = q(x)
    assert isinstance(y, Float8Tensor)
    assert torch.equal(_bytes(y), _bytes(own.Float8CurrentScalingQuantizer(E4M3).quantize(x)))
    q2 = te_api.Float8CurrentScalingQuantizer(
        DType.kFloat8E5M2, "cpu", columnwise=False, force_pow_2_scales=True, amax_epsilon=1e-3
    )
    ref = own.Float8CurrentScalingQuantizer(E5M2, power_2_scale=True, amax_epsilon=1e-3)
    y2 = q2(x)
    assert torch.equal(_bytes(y2), _bytes(ref.quantize(x)))
    assert y2._storage.columnwise_data is None and q2.force_pow_2_scales
    twin = q2.copy()
    assert (twin.force_pow_2_scales, twin.amax_epsilon, twin.dtype) == (
        True,
        1e-3,
        DType.kFloat8E5M2,
    )
    assert not twin.internal and not twin.columnwise_usage


def test_quantizers_a_module_makes_are_te_quantizers():
    layer = torchte.Linear(16, 16, device="cpu")
    with torchte.autocast(recipe=recipe.DelayedScaling()):
        layer(torch.randn(4, 16))
    delayed = layer._delayed_states[recipe.DelayedScaling().amax_history_len][0].quantizer(
        "input", E4M3
    )
    assert isinstance(delayed, te_api.Float8Quantizer)
    assert isinstance(own.Float8CurrentScalingQuantizer(E4M3), te_api.Float8CurrentScalingQuantizer)
    assert not isinstance(delayed, te_api.Float8CurrentScalingQuantizer)
    assert issubclass(own.Float8Quantizer, te_api.Float8Quantizer)
    assert isinstance(delayed, te_api.Quantizer)


def test_quantizer_role():
    role = te_api.QuantizerRole(module_type="linear", tensor_type="weight", name="fc1")
    assert (role.module_type, role.tensor_type, role.name) == ("linear", "weight", "fc1")
    assert te_api.QuantizerRole() == te_api.QuantizerRole("", "", "")
    with pytest.raises(dataclasses.FrozenInstanceError):
        role.name = "fc2"
    assert "fc1" in str(role) and "linear" in str(role)
    assert hash(role) == hash(te_api.QuantizerRole("linear", "weight", "fc1"))


# -- Float8Tensor -----------------------------------------------------------------------------


def test_float8_tensor_te_constructor():
    x = torch.randn(6, 16)
    storage = own.Float8CurrentScalingQuantizer(E4M3).quantize(x)
    data = storage.rowwise_data.view(torch.uint8).clone()
    scale_inv = storage.scale_inv.clone()
    q = te_api.Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu")
    t = Float8Tensor(
        shape=(6, 16),
        dtype=torch.bfloat16,
        data=data,
        fp8_scale_inv=scale_inv,
        fp8_dtype=DType.kFloat8E4M3,
        quantizer=q,
        requires_grad=True,
    )
    assert t.shape == (6, 16) and t.dtype == torch.bfloat16 and t.requires_grad
    assert t._data.data_ptr() == data.data_ptr() and t._scale_inv is scale_inv
    assert t._get_quantizer() is q and t._fp8_dtype == DType.kFloat8E4M3
    assert torch.equal(t.dequantize(dtype=torch.float32), storage.dequantize())
    transpose = data.view(6, 16).t().contiguous()
    t2 = Float8Tensor(
        (6, 16),
        torch.float32,
        data=None,
        fp8_scale_inv=scale_inv,
        fp8_dtype=E4M3,
        data_transpose=transpose,
    )
    assert t2._data is None and torch.equal(t2._transpose, transpose)
    assert torch.equal(t2.dequantize(), storage.dequantize())
    with pytest.raises(ValueError, match="data"):
        Float8Tensor(
            shape=(6, 15), dtype=torch.float32, data=data, fp8_scale_inv=scale_inv, fp8_dtype=E4M3
        )
    like = Float8Tensor.make_like(t, shape=(96,))
    assert like.shape == (96,) and like._data.data_ptr() == data.data_ptr()


def test_float8_tensor_views_as_te():
    x = torch.randn(4, 8, 16)
    t = own.Float8CurrentScalingQuantizer(E4M3, internal=False).quantize(x)
    plain = t.dequantize()
    cols = t._storage.columnwise_data
    same_last = t.view(32, 16)
    assert isinstance(same_last, Float8Tensor) and same_last._storage.columnwise_data is cols
    assert torch.equal(same_last.dequantize(), plain.view(32, 16))
    assert t._storage.columnwise_data is cols  # the source keeps its copy
    reshaped = t.reshape(-1, 16)
    assert isinstance(reshaped, Float8Tensor) and reshaped._storage.columnwise_data is cols
    new_last = t.view(4, 128)
    assert isinstance(new_last, Float8Tensor) and new_last._storage.columnwise_data is None
    assert torch.equal(new_last.dequantize(), plain.view(4, 128))
    rows = t[1:3]
    assert isinstance(rows, Float8Tensor) and rows.shape == (2, 8, 16)
    assert torch.equal(rows.dequantize(), plain[1:3])
    swapped = t.transpose(0, 1)
    assert type(swapped) is torch.Tensor and torch.equal(swapped, plain.transpose(0, 1))


def test_float8_tensor_view_passes_gradients():
    t = own.Float8CurrentScalingQuantizer(E4M3, internal=False).quantize(torch.randn(4, 8, 16))
    t.requires_grad_(True)
    t.view(32, 16).dequantize().sum().backward()
    assert t.grad.shape == (4, 8, 16) and torch.equal(t.grad, torch.ones(4, 8, 16))


def test_prepare_for_saving_and_restore_from_saved():
    plain = torch.randn(3)
    storage = own.Float8CurrentScalingQuantizer(E4M3).quantize(torch.randn(4, 16))
    expected = storage.dequantize()
    tensors, objects = te_api.prepare_for_saving(plain, storage, None)
    assert tensors[0] is plain and objects[0] is None and objects[2] is None
    assert storage.rowwise_data is None
    restored = te_api.restore_from_saved(objects, tensors)
    assert restored[0] is plain and restored[2] is None
    assert torch.equal(restored[1].dequantize(), expected)
    assert isinstance(storage, te_api.QuantizedTensorStorage)
    assert isinstance(
        Float8Tensor.from_storage(storage, torch.float32, None), te_api.QuantizedTensorStorage
    )
    assert not isinstance(plain, te_api.QuantizedTensorStorage)


# -- utils ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "capability, expected",
    [
        ((8, 9), False),
        ((9, 0), False),
        ((10, 0), True),
        ((11, 0), True),
        ((12, 0), False),
        ((13, 0), True),
    ],
)
def test_is_non_tn_fp8_gemm_supported(monkeypatch, capability, expected):
    utils._non_tn_fp8_gemm.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    try:
        assert utils.is_non_tn_fp8_gemm_supported() is expected
    finally:
        utils._non_tn_fp8_gemm.cache_clear()


def test_is_non_tn_fp8_gemm_supported_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert utils.is_non_tn_fp8_gemm_supported() is False


# -- fp8_meta ---------------------------------------------------------------------------------


def _linear_step(layer, fp8_recipe, features=16):
    with torchte.autocast(recipe=fp8_recipe):
        out = layer(torch.randn(8, features))
    out.sum().backward()


def test_fp8_meta_gives_views_of_the_delayed_scaling_state():
    layer = torchte.Linear(16, 16, device="cpu")
    delayed = recipe.DelayedScaling(amax_history_len=4)
    _linear_step(layer, delayed)
    meta = layer.fp8_meta
    assert meta["recipe"] == delayed and meta["num_gemms"] == 1 and meta["fp8_checkpoint"]
    fwd_key = FP8GlobalStateManager.get_meta_tensor_key(forward=True)
    bwd_key = FP8GlobalStateManager.get_meta_tensor_key(forward=False)
    fwd_state = layer._delayed_states[4][0]
    fwd, bwd = meta[fwd_key], meta[bwd_key]
    assert fwd.scale.data_ptr() == fwd_state.scale.data_ptr() and fwd.scale.shape == (3,)
    assert fwd.amax_history.data_ptr() == fwd_state.amax_history.data_ptr()
    assert bwd.amax_history.shape == (4, 2)
    assert torch.equal(fwd.scale_inv, 1.0 / fwd_state.scale)
    fwd.scale.fill_(0.25)
    assert torch.equal(fwd_state.scale, torch.full((3,), 0.25))
    fwd.amax_history = torch.full((4, 3), 2.0)
    assert torch.equal(fwd_state.amax_history, torch.full((4, 3), 2.0))
    quantizer = fwd_state.quantizer("input", E4M3)
    assert quantizer.scale.item() == 0.25
    assert meta is layer.fp8_meta and meta[fwd_key] is layer.fp8_meta[fwd_key]
    assert meta["fp8_max_fwd"] == delayed.fp8_format.value.max_fwd


def test_fp8_meta_of_each_module():
    delayed = recipe.DelayedScaling()
    mlp = torchte.LayerNormMLP(16, 32, device="cpu")
    _linear_step(mlp, delayed)
    assert mlp.fp8_meta["num_gemms"] == 2 and mlp.fp8_meta["scaling_fwd"].scale.shape == (6,)
    ln = torchte.LayerNormLinear(16, 16, device="cpu")
    _linear_step(ln, delayed)
    assert ln.fp8_meta["scaling_bwd"].scale.shape == (2,)
    grouped = torchte.GroupedLinear(2, 16, 16, device="cpu")
    with torchte.autocast(recipe=delayed):
        grouped(torch.randn(32, 16), [16, 16]).sum().backward()
    meta = grouped.fp8_meta
    assert meta["num_gemms"] == 2
    with pytest.raises(NotImplementedError, match="slot"):
        meta["scaling_fwd"].scale  # noqa: B018
    FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(meta)
    FP8GlobalStateManager.reset()
    current = torchte.Linear(16, 16, device="cpu")
    _linear_step(current, recipe.Float8CurrentScaling())
    assert "scaling_fwd" not in current.fp8_meta
    assert isinstance(current.fp8_meta["recipe"], recipe.Float8CurrentScaling)


def test_recipe_type_change_warns_once_per_change():
    layer = torchte.Linear(16, 16, device="cpu")
    _linear_step(layer, recipe.DelayedScaling())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _linear_step(layer, recipe.DelayedScaling(amax_history_len=8))  # same type
    with pytest.warns(
        UserWarning, match="Recipe type changed from DelayedScaling to Float8CurrentScaling"
    ) as record:
        _linear_step(layer, recipe.Float8CurrentScaling())
    assert len([w for w in record if "Recipe type" in str(w.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _linear_step(layer, recipe.Float8CurrentScaling())
        layer(torch.randn(4, 16))  # high precision in between
        _linear_step(layer, recipe.Float8CurrentScaling())
    assert isinstance(layer.fp8_meta["recipe"], recipe.Float8CurrentScaling)


# -- through the alias ------------------------------------------------------------------------


@pytest.fixture
def alias():
    assert not alias_api.is_installed()
    alias_api.install()
    try:
        yield
    finally:
        alias_api.uninstall()
    assert not [n for n in sys.modules if n.startswith("transformer_engine")]


def test_the_te_paths_hand_out_the_quantizer_api(alias):
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.quantization import QuantizerRole
    from transformer_engine.pytorch.quantized_tensor import (
        QuantizedTensor,
        QuantizedTensorStorage,
        Quantizer,
        prepare_for_saving,
        restore_from_saved,
    )
    from transformer_engine.pytorch.tensor.float8_tensor import (
        Float8CurrentScalingQuantizer,
        Float8Quantizer,
        Float8Tensor,
    )
    from transformer_engine.pytorch.utils import is_non_tn_fp8_gemm_supported

    assert Float8Quantizer is te.Float8Quantizer is te_api.Float8Quantizer
    assert Float8CurrentScalingQuantizer is te.Float8CurrentScalingQuantizer
    assert Float8Tensor is te.Float8Tensor and QuantizedTensor is te.QuantizedTensor
    assert Quantizer is te.Quantizer and QuantizedTensorStorage is te.QuantizedTensorStorage
    assert prepare_for_saving is te.prepare_for_saving is te_api.prepare_for_saving
    assert restore_from_saved is te.restore_from_saved
    assert QuantizerRole is te.QuantizerRole is te_api.QuantizerRole
    assert is_non_tn_fp8_gemm_supported is utils.is_non_tn_fp8_gemm_supported
    from transformer_engine.pytorch.constants import DType as TEDType

    q = Float8CurrentScalingQuantizer(TEDType.kFloat8E4M3, torch.device("cpu"))
    assert isinstance(q(torch.randn(4, 16)), Float8Tensor)
