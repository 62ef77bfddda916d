"""`te.autocast`: the active FP8 recipe, and when delayed-scaling state moves.

Modules read the state once per forward (`autocast_state()`); nothing inside ops reads it.
Delayed scaling: forward amaxes recorded in an autocast region update the forward scales when
the outermost region exits (before the next forward); gradient amaxes update the backward scales
once the backward pass that recorded them ends. Amaxes are all-reduced (MAX) over the region's
amax_reduction_group first, when torch.distributed is initialized and the recipe asks for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from .quantization.delayed import DelayedScalingState
from .recipe import DelayedScaling, Recipe

__all__ = ["autocast", "autocast_state", "default_recipe", "fp8_autocast"]

_DEFAULT_RECIPE = DelayedScaling()


def default_recipe() -> Recipe:
    """The recipe used when autocast is given none: DelayedScaling() with its defaults."""
    return _DEFAULT_RECIPE


class AutocastState:
    """What modules read at the start of a forward, and the scaling updates still owed."""

    __slots__ = (
        "backward_task",
        "calibrating",
        "depth",
        "enabled",
        "group",
        "pending_backward",
        "pending_forward",
        "recipe",
        "step",
    )

    def __init__(self) -> None:
        self.enabled = False
        self.calibrating = False
        self.recipe: Recipe = _DEFAULT_RECIPE
        self.group = None
        self.depth = 0
        # id(state) -> (state, recipe, group): each state is updated once however often used.
        self.pending_forward: dict[int, tuple] = {}
        self.pending_backward: dict[int, tuple] = {}
        self.backward_task = -1
        # Counts outermost region exits: an FP8 weight cache made in an earlier step is stale
        # even where the weight's _version did not move (writes through .data).
        self.step = 0

    def register_forward(self, state: DelayedScalingState, recipe, group) -> None:
        """A forward recorded amaxes into `state`: update it when the outermost region exits."""
        self.pending_forward[id(state)] = (state, recipe, group)

    def drop_forward(self, state: DelayedScalingState) -> None:
        """A forward into `state` failed: drop every amax it recorded this step, and the
        update, so the scales stay as they were (nothing half-recorded is used)."""
        self.pending_forward.pop(id(state), None)
        state.discard_pending()

    def register_backward(self, state: DelayedScalingState, recipe, group) -> None:
        """A backward recorded gradient amaxes: update `state` when this backward pass ends."""
        self.pending_backward[id(state)] = (state, recipe, group)
        task = torch._C._current_graph_task_id()
        if task != self.backward_task:
            self.backward_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _finish_backward(self) -> None:
        pending, self.pending_backward = self.pending_backward, {}
        self.backward_task = -1
        _update(pending.values())


_STATE = AutocastState()


def autocast_state() -> AutocastState:
    """The process-wide autocast state (read once per module forward)."""
    return _STATE


@contextlib.contextmanager
def autocast(
    enabled: bool = True,
    calibrating: bool = False,
    recipe: Recipe | None = None,
    amax_reduction_group: dist.ProcessGroup | None = None,
) -> Iterator[None]:
    """Run te modules in FP8 under `recipe` (default: DelayedScaling()).

    enabled=False runs them in high precision; calibrating=True (with enabled=False) computes in
    high precision while recording amaxes, so delayed scales are ready when FP8 is turned on.
    Regions nest; the innermost settings apply.
    """
    if recipe is None:
        recipe = _DEFAULT_RECIPE
    if not isinstance(recipe, Recipe):
        raise TypeError(f"autocast recipe must be a torchte.recipe.Recipe, got {recipe!r}")
    state = _STATE
    saved = (state.enabled, state.calibrating, state.recipe, state.group)
    state.enabled, state.calibrating = bool(enabled), bool(calibrating)
    state.recipe, state.group = recipe, amax_reduction_group
    state.depth += 1
    completed = False
    try:
        yield
        completed = True
    finally:
        state.enabled, state.calibrating, state.recipe, state.group = saved
        state.depth -= 1
        if state.depth == 0:
            state.step += 1
            pending, state.pending_forward = state.pending_forward, {}
            if completed:
                _update(pending.values())
            else:
                # The step failed: forget its amaxes rather than scale from half a step.
                for delayed_state, _, _ in pending.values():
                    delayed_state.discard_pending()


def fp8_autocast(
    enabled: bool = True,
    calibrating: bool = False,
    fp8_recipe: Recipe | None = None,
    fp8_group: dist.ProcessGroup | None = None,
    _graph: bool = False,
) -> contextlib.AbstractContextManager[None]:
    """Transformer Engine's older name for `autocast`."""
    return autocast(enabled, calibrating, fp8_recipe, fp8_group)


def _update(entries) -> None:
    entries = list(entries)
    if not entries:
        return
    _reduce_amaxes(entries)
    for delayed_state, recipe, _ in entries:
        delayed_state.update(recipe)


def _reduce_amaxes(entries) -> None:
    """All-reduce row 0 of each history (MAX) over its group, one collective per group."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    by_group: dict[int, tuple] = {}
    for delayed_state, recipe, group in entries:
        if recipe.reduce_amax and dist.get_world_size(group) > 1:
            by_group.setdefault(id(group), (group, []))[1].append(delayed_state)
    for group, states in by_group.values():
        rows = [s.amax_history[0] for s in states]
        flat = torch.cat(rows)
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
        for row, reduced in zip(rows, flat.split([r.numel() for r in rows]), strict=True):
            row.copy_(reduced)
