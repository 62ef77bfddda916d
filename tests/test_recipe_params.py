"""Transformer Engine's QParams / MMParams and the recipe fields that hold them: validation,
the per-role power-of-two and epsilon options honoured by current scaling's quantizers, the
GEMM accumulation choices refused at the first forward, and the other 2.x recipe fields."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tolerances import assert_close, representable

import torchte as te
from torchte import recipe
from torchte.kernels.cast_transpose import FP8_MAX
from torchte.quantization.float8 import Float8CurrentScalingQuantizer
from torchte.recipe import Float8CurrentScaling, MMParams, QParams

pytestmark = pytest.mark.usefixtures("cpu_default_device")


def test_qparams_and_mmparams_have_transformer_engines_fields_and_defaults():
    assert [f.name for f in dataclasses.fields(QParams)] == [
        "power_2_scale",
        "amax_epsilon",
        "random_hadamard_transform",
        "stochastic_rounding",
        "fp4_2d_quantization",
    ]
    q = QParams()
    assert (q.power_2_scale, q.amax_epsilon, q.random_hadamard_transform) == (False, 0.0, False)
    assert MMParams().use_split_accumulator is True
    assert QParams(True, 1) == QParams(power_2_scale=True, amax_epsilon=1.0)
    assert isinstance(QParams(amax_epsilon=1).amax_epsilon, float)
    assert len({QParams(), QParams()}) == 1 and hash(MMParams()) == hash(MMParams(True))
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.power_2_scale = True
    assert "QParams" in recipe.__all__ and "MMParams" in recipe.__all__


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"power_2_scale": 1}, TypeError, "power_2_scale must be a bool"),
        ({"amax_epsilon": -1e-3}, ValueError, "amax_epsilon must be finite and >= 0"),
        ({"amax_epsilon": float("nan")}, ValueError, "amax_epsilon"),
        ({"amax_epsilon": "0"}, TypeError, "amax_epsilon must be a float"),
        ({"stochastic_rounding": None}, TypeError, "stochastic_rounding"),
    ],
)
def test_qparams_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        QParams(**kwargs)


def test_mmparams_validation():
    with pytest.raises(TypeError, match="use_split_accumulator must be a bool"):
        MMParams(use_split_accumulator="yes")


def test_current_scaling_holds_them_with_transformer_engines_defaults():
    r = Float8CurrentScaling()
    for name in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
        assert getattr(r, name) == QParams()
    assert r.fp8_gemm_fprop == MMParams(use_split_accumulator=False)
    assert r.fp8_gemm_dgrad == r.fp8_gemm_wgrad == MMParams(use_split_accumulator=True)
    r.fp8_quant_bwd_grad = QParams(amax_epsilon=0.5)  # mutable, validated on assignment
    assert r.fp8_quant_bwd_grad.amax_epsilon == 0.5 and r != Float8CurrentScaling()
    with pytest.raises(TypeError, match=r"fp8_quant_fwd_inp must be a recipe\.QParams"):
        r.fp8_quant_fwd_inp = {"power_2_scale": True}
    assert r.fp8_quant_fwd_inp == QParams()  # the old value kept
    with pytest.raises(TypeError, match=r"fp8_gemm_wgrad must be a recipe\.MMParams"):
        Float8CurrentScaling(fp8_gemm_wgrad=True)


def _setup(layer, fp8):
    return layer._fp8_setup(fp8._frozen())


def test_each_roles_qparams_reach_its_quantizers():
    """Inputs, weights and output gradients take their QParams joined with the recipe-wide
    use_power_2_scales / amax_epsilon; outputs and input gradients the recipe-wide values."""
    fp8 = Float8CurrentScaling(
        amax_epsilon=0.25,
        fp8_quant_fwd_inp=QParams(power_2_scale=True),
        fp8_quant_fwd_weight=QParams(amax_epsilon=2.0),
        fp8_quant_bwd_grad=QParams(power_2_scale=True, amax_epsilon=0.125),
    )
    setup = _setup(te.Linear(32, 32), fp8)
    expected = {
        "input": (True, 0.25),
        "weight": (False, 2.0),
        "grad_output": (True, 0.25),
        "output": (False, 0.25),
        "grad_input": (False, 0.25),
    }
    for slot, settings in expected.items():
        q = getattr(setup, slot)[0]
        assert (q.power_2_scale, q.amax_epsilon) == settings, slot
    grouped = _setup(te.GroupedLinear(2, 32, 32), fp8).grouped_input
    assert (grouped.power_2_scale, grouped.amax_epsilon) == (True, 0.25)
    everywhere = _setup(te.Linear(32, 32), Float8CurrentScaling(use_power_2_scales=True))
    assert all(getattr(everywhere, s)[0].power_2_scale for s in expected)


def _dequantized(x, power_2: bool, eps: float = 0.0) -> torch.Tensor:
    q = Float8CurrentScalingQuantizer(torch.float8_e4m3fn, power_2_scale=power_2, amax_epsilon=eps)
    storage = q.quantize(x, rowwise=True, columnwise=False)
    return storage.rowwise_data.double() * storage.scale_inv.double()


def test_a_power_of_two_input_scale_changes_the_forward_as_the_reference_says():
    torch.manual_seed(0)
    layer = te.Linear(32, 16, bias=False)
    with torch.no_grad():
        layer.weight.copy_(representable((16, 32), torch.bfloat16, scale=0.125))
    x = torch.randn(24, 32) * 3.1
    fp8 = Float8CurrentScaling(fp8_format=recipe.Format.E4M3)
    power_2 = Float8CurrentScaling(
        fp8_format=recipe.Format.E4M3, fp8_quant_fwd_inp=QParams(power_2_scale=True)
    )
    outputs = {}
    for name, r in (("default", fp8), ("power_2", power_2)):
        with te.autocast(recipe=r):
            outputs[name] = layer(x)
        x_ref = _dequantized(x, name == "power_2")
        y_ref = x_ref @ _dequantized(layer.weight.detach(), False).t()
        assert_close(outputs[name], y_ref, torch.float32, msg=name)
    assert not torch.equal(outputs["default"], outputs["power_2"])
    scale = FP8_MAX[torch.float8_e4m3fn] / x.abs().max()
    assert scale != torch.exp2(torch.floor(torch.log2(scale)))  # so the two scales differ


@pytest.mark.parametrize("gemm", ["fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"])
def test_other_gemm_accumulation_is_refused_at_the_first_forward(gemm):
    default = getattr(Float8CurrentScaling(), gemm).use_split_accumulator
    fp8 = Float8CurrentScaling(**{gemm: MMParams(use_split_accumulator=not default)})
    layer = te.Linear(16, 16)
    with pytest.raises(NotImplementedError, match=f"{gemm}=MMParams"), te.autocast(recipe=fp8):
        layer(torch.randn(4, 16))
    setattr(fp8, gemm, MMParams(use_split_accumulator=default))  # back to the default: runs
    with te.autocast(recipe=fp8):
        assert layer(torch.randn(4, 16)).shape == (4, 16)


def test_float8_block_scaling_2x_fields_and_validation():
    r = recipe.Float8BlockScaling()
    assert r.use_f32_scales is False
    assert r.fp8_quant_fwd_weight == QParams(power_2_scale=True)
    assert r.fp8_gemm_fprop == MMParams(use_split_accumulator=True)
    bad = (
        ({"x_block_scaling_dim": 3}, "x_block_scaling_dim"),
        ({"x_block_scaling_dim": 2}, "2D x 2D"),  # with the default 2-D weights
        ({"fp8_gemm_dgrad": MMParams(use_split_accumulator=False)}, "use_split_accumulator"),
        ({"fp8_dpa": True}, "FP8 attention"),
        ({"fp8_format": recipe.Format.E5M2}, "E5M2"),
    )
    for kwargs, match in bad:
        with pytest.raises(ValueError, match=match):
            recipe.Float8BlockScaling(**kwargs)
    assert recipe.Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1)


def test_nvfp4_custom_and_mxfp4_qat_recipes():
    r = recipe.NVFP4BlockScaling(disable_rht=True)
    assert r.fp8_format is recipe.Format.E4M3 and r.row_scaled_activation is False
    assert (r.nvfp4_4over6, r.nvfp4_4over6_e4m3_use_256, r.nvfp4_4over6_err_mode) == (
        "none",
        "all",
        "MAE",
    )
    assert r.fp4_quant_fwd_inp == QParams()  # no Hadamard transform: disabled
    assert r.fp4_quant_bwd_grad == QParams(stochastic_rounding=True)
    assert r.fp4_quant_fwd_weight == QParams(fp4_2d_quantization=True)
    for kwargs in ({"nvfp4_4over6": "some"}, {"nvfp4_4over6_err_mode": "L1"}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            recipe.NVFP4BlockScaling(**kwargs)
    with pytest.raises(ValueError, match=r"fp8_format must be Format\.E4M3"):
        recipe.NVFP4BlockScaling(fp8_format=recipe.Format.HYBRID)
    assert recipe.CustomRecipe(qfactory=print).fp8_format is recipe.Format.HYBRID
    qat = recipe.MXFP4QATMXFP8BlockScaling()
    assert qat.mxfp8() and qat.mxfp4_qat() and not recipe.MXFP8BlockScaling.mxfp4_qat()
    block_qat = recipe.MXFP4QATFloat8BlockScaling()
    assert block_qat.float8_block_scaling() and block_qat.mxfp4_qat()
    with pytest.raises(ValueError, match="w_block_scaling_dim=2"):
        recipe.MXFP4QATFloat8BlockScaling(w_block_scaling_dim=1)
    layer = te.Linear(32, 32)
    with pytest.raises(NotImplementedError, match="MXFP4QATMXFP8"), te.autocast(recipe=qat):
        layer(torch.randn(32, 32))
