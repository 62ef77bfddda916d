"""Transformer Engine's `FP8GlobalStateManager`, the class clients query for the FP8 settings in
force (`from transformer_engine.pytorch.fp8 import FP8GlobalStateManager`), answered from
torchte's own state: te.autocast's (per thread) and quantized_model_init's.
"""

from __future__ import annotations

import torch

from .autocast import autocast_state, default_recipe
from .quantization.model_init import model_init_settings
from .recipe import Recipe

__all__ = ["FP8GlobalStateManager"]


class FP8GlobalStateManager:
    """Class methods with Transformer Engine's names over torchte's FP8 state (read-only but
    for is_first_fp8_module, set_fp8_autocast_state and reset)."""

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
