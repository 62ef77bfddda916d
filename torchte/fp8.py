"""Transformer Engine's `FP8GlobalStateManager`, the class clients query for the FP8 settings in
force (`from transformer_engine.pytorch.fp8 import FP8GlobalStateManager`), answered from
torchte's own state: te.autocast's (per thread) and quantized_model_init's; and its
`check_*_support()` functions, (supported, reason) for each recipe family on the default device.
"""

from __future__ import annotations

import torch

from ._device import (
    is_fp8_available,
    is_fp8_block_scaling_available,
    is_mxfp8_available,
    is_nvfp4_available,
)
from .autocast import autocast_state, default_recipe
from .module.fp8_padding import get_align_size_for_quantization
from .quantization.model_init import model_init_settings
from .recipe import Recipe

__all__ = [
    "FP8GlobalStateManager",
    "check_fp8_block_scaling_support",
    "check_fp8_support",
    "check_mxfp8_support",
    "check_nvfp4_support",
    "get_align_size_for_quantization",
]


def check_fp8_support() -> tuple[bool, str]:
    """(supported, reason) for DelayedScaling and Float8CurrentScaling on the device modules are
    built on by default: `te.is_fp8_available(return_reason=True)`."""
    return is_fp8_available(return_reason=True)


def check_mxfp8_support() -> tuple[bool, str]:
    """(supported, reason) for MXFP8BlockScaling: False on every device (not implemented yet)."""
    return is_mxfp8_available(return_reason=True)


def check_fp8_block_scaling_support() -> tuple[bool, str]:
    """(supported, reason) for Float8BlockScaling: False on every device (not implemented
    yet)."""
    return is_fp8_block_scaling_available(return_reason=True)


def check_nvfp4_support() -> tuple[bool, str]:
    """(supported, reason) for NVFP4BlockScaling: False on every device (not implemented yet)."""
    return is_nvfp4_available(return_reason=True)


class FP8GlobalStateManager:
    """Class methods with Transformer Engine's names over torchte's FP8 state (read-only but
    for is_first_fp8_module, set_fp8_autocast_state and reset)."""

    # (supported, reason), as Transformer Engine's class methods of these names answer.
    is_fp8_available = staticmethod(check_fp8_support)
    is_mxfp8_available = staticmethod(check_mxfp8_support)
    is_fp8_block_scaling_available = staticmethod(check_fp8_block_scaling_support)
    is_nvfp4_available = staticmethod(check_nvfp4_support)

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        """Whether modules run in FP8 here (inside te.autocast(enabled=True))."""
        return autocast_state().enabled

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        """Whether modules record amaxes in high precision here (calibrating=True)."""
        return autocast_state().calibrating

    @classmethod
    def with_fp8_parameters(cls) -> bool:
        """Whether modules built here store FP8 parameters (inside quantized_model_init)."""
        return model_init_settings() is not None

    @classmethod
    def fp8_graph_capturing(cls) -> bool:
        """Whether a CUDA graph is being captured on the current stream."""
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()

    @classmethod
    def get_fp8_recipe(cls) -> Recipe:
        """The recipe of the innermost te.autocast (DelayedScaling() outside any)."""
        state = autocast_state()
        return state.recipe if state.depth else default_recipe()

    @classmethod
    def get_fp8_group(cls):
        """The amax reduction group of the innermost te.autocast (None outside any)."""
        return autocast_state().group

    @classmethod
    def is_first_fp8_module(cls) -> bool:
        """True for the first call inside the outermost te.autocast region, False after (and
        outside any region)."""
        state = autocast_state()
        first, state.first_module = state.first_module, False
        return first

    @classmethod
    def get_fp8_autocast_state(cls) -> tuple:
        """(enabled, calibrating, recipe, group, is-first-module, graph capturing)."""
        state = autocast_state()
        return (
            state.enabled,
            state.calibrating,
            state.recipe,
            state.group,
            state.first_module,
            cls.fp8_graph_capturing(),
        )

    @classmethod
    def set_fp8_autocast_state(cls, fp8_state: tuple) -> None:
        """Restore what get_fp8_autocast_state returned (the capturing flag is the stream's)."""
        state = autocast_state()
        enabled, calibrating, recipe, group, first = fp8_state[:5]
        if not isinstance(recipe, Recipe):
            raise TypeError(f"set_fp8_autocast_state: the recipe must be a Recipe, got {recipe!r}")
        state.enabled, state.calibrating = bool(enabled), bool(calibrating)
        state.recipe, state.group, state.first_module = recipe._frozen(), group, bool(first)

    @classmethod
    def reset(cls) -> None:
        """FP8 off in this thread: te.autocast's settings back to their defaults (scaling state
        already recorded in modules is kept)."""
        state = autocast_state()
        state.enabled = state.calibrating = state.first_module = False
        state.recipe, state.group = default_recipe(), None
