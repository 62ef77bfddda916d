"""What FP8GlobalStateManager (fp8.py) keeps beyond te.autocast's state: Transformer Engine's
`quantization_state` object, and the delayed-scaling updates a client asks for by hand.

Transformer Engine's modules put their scaling state into a global buffer on their first
forward and the buffer is updated at each autocast exit (forward) and after each backward.
torchte's modules register their own updates per step instead (autocast.py), so the buffer is
needed only where no module code ran in Python: a CUDA-graph replay (Megatron-Core's
cuda_graph_impl="local" replays a layer's graphs, then calls
`add_fp8_tensors_to_global_buffer` for each module in the forward and
`reduce_and_update_fp8_tensors(forward=False)` after the backward). Here:
- add_fp8_tensors_to_global_buffer(m) owes m's forward state an update at the exit of the
  outermost te.autocast region (or at the next reduce_and_update_fp8_tensors(forward=True)),
  as m's own forward would, and its backward state one at the next
  reduce_and_update_fp8_tensors(forward=False); each state at most once per call of these.
- reduce_and_update_fp8_tensors(forward) all-reduces (MAX) the owed states' newest amaxes over
  their groups (where the recipe asks for it) and updates their scales and histories now.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .autocast import _update, autocast_state
from .module.base import TransformerEngineBaseModule
from .quantization.delayed import DelayedScalingState
from .quantization.model_init import model_init_settings
from .quantization.setup import needs_delayed_state
from .recipe import Recipe

__all__ = [
    "QuantizationState",
    "add_to_global_buffer",
    "quantization_state",
    "reduce_and_update",
]

_STATE = autocast_state()


class QuantizationState:
    """Transformer Engine's `FP8GlobalStateManager.quantization_state`: the fields of the FP8
    state, read from (and written to) te.autocast's state of the calling thread, and
    `skip_fp8_weight_update_tensor`, kept here (None until set)."""

    def __init__(self) -> None:
        self.skip_fp8_weight_update_tensor: torch.Tensor | None = None

    @property
    def fp8_enabled(self) -> bool:
        return _STATE.enabled

    @fp8_enabled.setter
    def fp8_enabled(self, value: bool) -> None:
        _STATE.enabled = bool(value)

    @property
    def fp8_calibration(self) -> bool:
        return _STATE.calibrating

    @fp8_calibration.setter
    def fp8_calibration(self, value: bool) -> None:
        _STATE.calibrating = bool(value)

    @property
    def fp8_recipe(self) -> Recipe | None:
        """The innermost region's recipe (None outside any, as Transformer Engine's)."""
        return _STATE.recipe if _STATE.depth else None

    @fp8_recipe.setter
    def fp8_recipe(self, recipe: Recipe) -> None:
        if not isinstance(recipe, Recipe):
            raise TypeError(f"quantization_state.fp8_recipe must be a Recipe, got {recipe!r}")
        _STATE.recipe = recipe._frozen()

    @property
    def fp8_distributed_group(self):
        return _STATE.group

    @fp8_distributed_group.setter
    def fp8_distributed_group(self, group) -> None:
        _STATE.group = group

    @property
    def is_first_fp8_module(self) -> bool:
        return _STATE.first_module

    @is_first_fp8_module.setter
    def is_first_fp8_module(self, value: bool) -> None:
        _STATE.first_module = bool(value)

    @property
    def autocast_depth(self) -> int:
        return _STATE.depth

    @property
    def fp8_parameters(self) -> bool:
        return model_init_settings() is not None

    @property
    def high_precision_init_val(self) -> bool:
        settings = model_init_settings()
        return settings is not None and settings.preserve_high_precision_init_val

    @property
    def fp8_graph_capturing(self) -> bool:
        from .fp8 import FP8GlobalStateManager  # fp8.py imports this file

        return FP8GlobalStateManager.fp8_graph_capturing()


quantization_state = QuantizationState()

# Backward states owed an update at the next reduce_and_update(forward=False):
# state -> (state, recipe, group), process-wide (backward runs on autograd's threads).
_OWED_BACKWARD: dict[DelayedScalingState, tuple] = {}


def delayed_states_of(fp8_meta) -> tuple | None:
    """(forward state, backward state, recipe, group) of a te module (its state of the current
    recipe's history length, the current autocast group) or of a Transformer-Engine-style
    fp8_meta dict ("recipe", "fp8_group", "scaling_fwd", "scaling_bwd"); None where there is
    no delayed-scaling state (another recipe, or a module that never ran under it)."""
    if isinstance(fp8_meta, TransformerEngineBaseModule):
        recipe = _STATE.recipe
        history_len = needs_delayed_state(recipe)
        pair = None if history_len is None else fp8_meta._delayed_states.get(history_len)
        return None if pair is None else (*pair, recipe, _STATE.group)
    if not isinstance(fp8_meta, Mapping):
        raise TypeError(
            "add_fp8_tensors_to_global_buffer: fp8_meta must be a te module or a dict with "
            f"'recipe', 'fp8_group', 'scaling_fwd' and 'scaling_bwd'; got {type(fp8_meta)}"
        )
    recipe = fp8_meta.get("recipe")
    if recipe is None or needs_delayed_state(recipe) is None:
        return None
    states = []
    for key in ("scaling_fwd", "scaling_bwd"):
        state = fp8_meta.get(key)
        state = getattr(state, "delayed_state", state)  # a module's fp8_meta holds views of it
        if state is not None and not isinstance(state, DelayedScalingState):
            raise TypeError(
                f"add_fp8_tensors_to_global_buffer: fp8_meta[{key!r}] must be a torchte "
                f"DelayedScalingState, got {type(state).__name__}"
            )
        states.append(state)
    if states == [None, None]:
        return None
    return (*states, recipe._frozen(), fp8_meta.get("fp8_group"))


def add_to_global_buffer(fp8_meta) -> None:
    """Owe the forward and backward states of `fp8_meta` their updates (module docstring)."""
    found = delayed_states_of(fp8_meta)
    if found is None:
        return
    fwd, bwd, recipe, group = found
    if fwd is not None:
        _STATE.register_step(fwd, bwd if bwd is not None else fwd, recipe, group)
    if bwd is not None:
        _OWED_BACKWARD[bwd] = (bwd, recipe, group)


def reduce_and_update(forward: bool) -> None:
    """Update now the states owed an update in one direction: forward, those of the calling
    thread's te.autocast (registered by module forwards or add_to_global_buffer; the exit of the
    outermost region then owes them nothing); backward, those add_to_global_buffer registered."""
    if forward:
        entries = list(_STATE.pending_forward.values())
        _STATE.pending_forward.clear()
    else:
        entries = list(_OWED_BACKWARD.values())
        _OWED_BACKWARD.clear()
    _update(entries)


def owed_backward() -> list[DelayedScalingState]:
    """The backward states owed an update at the next reduce_and_update(forward=False)."""
    return list(_OWED_BACKWARD)


def reset() -> None:
    """Forget every update owed (the calling thread's forward ones too) and the skip flag
    tensor (FP8GlobalStateManager.reset)."""
    _STATE.pending_forward.clear()
    _OWED_BACKWARD.clear()
    quantization_state.skip_fp8_weight_update_tensor = None
