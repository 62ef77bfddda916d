"""te.fp8.FP8GlobalStateManager: Transformer Engine's class methods over torchte's FP8 state."""

from __future__ import annotations

import pytest

import torchte as te
from torchte import recipe
from torchte.fp8 import FP8GlobalStateManager as Manager


def test_it_reports_the_region_it_is_asked_in():
    with te.autocast():
        pass  # a region where no module asked: the flag does not outlive it
    assert not Manager.is_fp8_enabled() and not Manager.is_fp8_calibration()
    assert Manager.get_fp8_recipe() == recipe.DelayedScaling() and Manager.get_fp8_group() is None
    assert Manager.is_first_fp8_module() is False  # outside any region
    current = recipe.Float8CurrentScaling()
    with te.autocast(recipe=current):
        assert Manager.is_fp8_enabled() and Manager.get_fp8_recipe() == current
        assert Manager.is_first_fp8_module() is True
        with te.autocast(enabled=False, calibrating=True):
            assert not Manager.is_fp8_enabled() and Manager.is_fp8_calibration()
            assert Manager.is_first_fp8_module() is False  # once per outermost region
    assert not Manager.is_fp8_enabled()
    with te.autocast():
        assert Manager.is_first_fp8_module() is True
    assert not Manager.with_fp8_parameters() and not Manager.fp8_graph_capturing()
    with te.quantized_model_init():
        assert Manager.with_fp8_parameters()


def test_autocast_state_round_trip_and_reset():
    with te.autocast(recipe=recipe.Float8CurrentScaling()):
        saved = Manager.get_fp8_autocast_state()
    assert not Manager.is_fp8_enabled()
    with te.autocast(enabled=False):
        Manager.set_fp8_autocast_state(saved)
        assert Manager.is_fp8_enabled() and Manager.get_fp8_recipe() == saved[2]
        Manager.reset()
        assert not Manager.is_fp8_enabled() and Manager.get_fp8_group() is None
        with pytest.raises(TypeError, match="must be a Recipe"):
            Manager.set_fp8_autocast_state((True, False, "delayed", None, False, False))
    assert not Manager.is_fp8_enabled()


def test_availability_class_methods_answer_with_a_reason():
    from torchte.fp8 import check_fp8_support

    assert Manager.is_fp8_available() == check_fp8_support()
    for query in (
        Manager.is_mxfp8_available,
        Manager.is_fp8_block_scaling_available,
        Manager.is_nvfp4_available,
    ):
        supported, reason = query()
        assert supported is True and reason.startswith(("native: ", "emulated: "))
