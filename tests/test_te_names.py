"""Transformer Engine names clients use beside the modules: te.QuantizedTensor,
Float8Tensor._transpose, te.DType (and te.constants), get_align_size_for_quantization and the
init methods of te.utils."""

from __future__ import annotations

import math

import pytest
import torch
from tolerances import representable

import torchte as te
from torchte import recipe
from torchte.quantization import Float8CurrentScalingQuantizer, QuantizedTensor

pytestmark = pytest.mark.usefixtures("cpu_default_device")


def fp8_tensor(shape, columnwise: bool = True) -> te.Float8Tensor:
    quantizer = Float8CurrentScalingQuantizer(torch.float8_e4m3fn, internal=False)
    return quantizer.quantize(representable(shape, torch.bfloat16), columnwise=columnwise)


def test_quantized_tensor_is_the_base_of_float8_tensor():
    t = fp8_tensor((4, 16))
    assert te.QuantizedTensor is QuantizedTensor and issubclass(te.Float8Tensor, QuantizedTensor)
    assert isinstance(t, te.QuantizedTensor) and isinstance(t.detach(), te.QuantizedTensor)
    assert not isinstance(torch.ones(2), te.QuantizedTensor)
    with te.quantized_model_init(recipe=recipe.Float8CurrentScaling()):
        layer = te.Linear(16, 16)
    quantized = [n for n, p in layer.named_parameters() if isinstance(p, te.QuantizedTensor)]
    assert quantized == ["weight"]
    assert "QuantizedTensor" in te.__all__


@pytest.mark.parametrize("shape", [(16, 32), (5, 16), (2, 3, 16)])
def test_float8_tensor_transpose_is_the_columnwise_bytes(shape):
    t = fp8_tensor(shape)
    rows = math.prod(shape[:-1])
    transpose = t._transpose
    assert transpose.dtype == torch.uint8 and transpose.shape == (shape[-1], rows)
    assert torch.equal(transpose, t._data.reshape(rows, shape[-1]).t())
    assert transpose.data_ptr() == t._columnwise_data.data_ptr()  # a view, not a copy
    assert fp8_tensor(shape, columnwise=False)._transpose is None


def test_dtype_enum_has_transformer_engines_values():
    expected = {
        "kByte": 0,
        "kInt32": 2,
        "kFloat32": 4,
        "kFloat16": 5,
        "kBFloat16": 6,
        "kFloat8E4M3": 7,
        "kFloat8E5M2": 8,
        "kFloat4E2M1": 10,
    }
    assert {m.name: int(m) for m in te.DType} == expected
    assert te.DType is te.constants.DType and "DType" in te.__all__
    assert te.constants.TE_DType[torch.float8_e5m2] is te.DType.kFloat8E5M2
    for dtype, tag in te.constants.TE_DType.items():
        assert te.constants.TE_DType_To_Torch[tag] is dtype
    assert te.constants.dist_group_type is torch.distributed.ProcessGroup


@pytest.mark.parametrize(
    ("make", "align"),
    [
        (recipe.DelayedScaling, 16),
        (recipe.Float8CurrentScaling, 16),
        (recipe.Float8BlockScaling, 16),
        (recipe.MXFP8BlockScaling, 32),
        (recipe.MXFP4QATMXFP8BlockScaling, 32),
        (recipe.NVFP4BlockScaling, 128),
    ],
)
def test_align_size_for_quantization(make, align):
    assert te.fp8.get_align_size_for_quantization(make()) == align


def test_init_methods_draw_from_the_normal_they_name():
    torch.manual_seed(0)
    w = torch.empty(512, 512)
    assert te.utils.init_method_normal(0.02)(w) is w
    assert abs(w.std().item() - 0.02) < 0.02 * 0.02 and abs(w.mean().item()) < 1e-3
    std = 0.02 / math.sqrt(2.0 * 8)
    te.utils.scaled_init_method_normal(0.02, 8)(w)
    assert abs(w.std().item() - std) < std * 0.02
    layer = te.Linear(64, 64, init_method=te.utils.init_method_normal(0.5))
    assert abs(layer.weight.std().item() - 0.5) < 0.05
    for bad in (-1.0, float("nan"), "0.1"):
        with pytest.raises(ValueError, match="sigma"):
            te.utils.init_method_normal(bad)
    with pytest.raises(ValueError, match="num_layers"):
        te.utils.scaled_init_method_normal(0.02, 0)
