"""`te.autocast`: the active FP8 recipe, and when delayed-scaling state moves.

Modules read the state once per forward (`autocast_state()`); nothing inside ops reads it. The
state is per thread, as torch.autocast's is: a region entered in one thread does not turn FP8 on
for te modules run by another. Backward passes read none of it (the forward's plan carries the
recipe), so autograd's worker threads need no region of their own.
Delayed scaling: forward amaxes recorded in an autocast region update the forward scales when
the outermost region exits (before the next forward); gradient amaxes update the backward scales
once the backward pass that recorded them ends. Amaxes are all-reduced (MAX) over the region's
amax_reduction_group first, when torch.distributed is initialized and the recipe asks for it.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist

from .quantization.delayed import DelayedScalingState
from .recipe import DelayedScaling, Recipe

__all__ = [
    "autocast",
    "autocast_state",
    "default_recipe",
    "fp8_autocast",
    "pending_backward_updates",
    "refuse_recipe",
    "update_after_backward",
]

_DEFAULT_RECIPE = DelayedScaling()


def default_recipe() -> Recipe:
    """The recipe used when autocast is given none: DelayedScaling() with its defaults."""
    return _DEFAULT_RECIPE


class AutocastState(threading.local):
    """What modules read at the start of a forward, and the forward scale updates still owed.

    One per thread, as torch.autocast's state is: a thread inside `te.autocast` makes only its
    own te modules run FP8. (A threading.local subclass: each thread gets its own attributes,
    set by __init__ on the thread's first access.)
    """

    def __init__(self) -> None:
        self.enabled = False
        self.calibrating = False
        self.recipe: Recipe = _DEFAULT_RECIPE
        self.group = None
        self.depth = 0
        # Whether no module asked FP8GlobalStateManager.is_first_fp8_module() yet in the
        # outermost region (Transformer Engine's convention).
        self.first_module = False
        # state -> (state, recipe, group): each state is updated once however often used.
        self.pending_forward: dict[DelayedScalingState, tuple] = {}
        # te.checkpoint: the states a checkpointed forward records into (None outside one),
        # and whether a checkpointed forward is being recomputed (it owes no update).
        self.recorded_states: list[DelayedScalingState] | None = None
        self.replaying = False

    @property
    def step(self) -> int:
        """Outermost region exits so far, in any thread: an FP8 weight cache made in an
        earlier step is stale even where the weight's _version did not move (writes through
        .data)."""
        return _STEPS.count

    def drop_forward(self, state: DelayedScalingState) -> None:
        """A forward into `state` failed: drop every amax it recorded this step, and the
        update, so the scales stay as they were (nothing half-recorded is used)."""
        self.pending_forward.pop(state, None)
        state.discard_pending()

    def register_step(
        self, fwd_state: DelayedScalingState, bwd_state: DelayedScalingState, recipe, group
    ) -> None:
        """A forward recorded amaxes into `fwd_state`: update it when the outermost region
        exits. Under torch.compile, which cannot trace the end-of-backward callback, the
        backward state of a forward that will have a backward is updated there too: at that
        point its row 0 holds the amaxes the previous backward recorded, so each backward
        still quantizes with the scales of all backwards before it, as in eager mode."""
        if self.replaying:  # te.checkpoint's recompute: its amaxes are taken back
            return
        if self.recorded_states is not None:
            self.recorded_states.append(fwd_state)
        self.pending_forward[fwd_state] = (fwd_state, recipe, group)
        if torch.compiler.is_compiling() and torch.is_grad_enabled():
            self.pending_forward[bwd_state] = (bwd_state, recipe, group)


class _StepCounter:
    """The process-wide count of outermost autocast exits (see AutocastState.step)."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0


class BackwardUpdates:
    """Backward scale updates owed at the end of each backward pass, keyed by autograd's graph
    task. Process-wide rather than per thread: backward Functions may run on autograd's
    worker threads, and the end-of-pass callback on yet another."""

    __slots__ = ("pending",)

    def __init__(self) -> None:
        # graph task id -> {state: (state, recipe, group)}
        self.pending: dict[int, dict[DelayedScalingState, tuple]] = {}

    def register(self, state: DelayedScalingState, recipe, group) -> None:
        """Update `state` once the running backward pass ends (one callback per pass)."""
        task = torch._C._current_graph_task_id()
        entries = self.pending.get(task)
        if entries is None:
            entries = self.pending[task] = {}
            torch.autograd.Variable._execution_engine.queue_callback(
                functools.partial(self._finish, task)
            )
        entries[state] = (state, recipe, group)

    def _finish(self, task: int) -> None:
        _update(self.pending.pop(task, {}).values())


_STATE = AutocastState()
_STEPS = _StepCounter()
_BACKWARD = BackwardUpdates()


def autocast_state() -> AutocastState:
    """The calling thread's autocast state (read once per module forward)."""
    return _STATE


def update_after_backward(state: DelayedScalingState, recipe, group) -> None:
    """A backward recorded gradient amaxes into `state`: update it when this backward pass
    ends (under torch.compile: see AutocastState.register_step). Called through the hook the
    forward's plan carries (quantization/setup.py's backward_hook), never read from here."""
    if not torch.compiler.is_compiling():
        _BACKWARD.register(state, recipe, group)


def pending_backward_updates() -> dict[int, dict[DelayedScalingState, tuple]]:
    """Backward scale updates not yet made, by autograd graph task (empty between passes)."""
    return _BACKWARD.pending


_IN_AUTOCAST = "a recipe goes to te.autocast(recipe=...), around the forward calls"


def refuse_recipe(owner: str, advice: str = _IN_AUTOCAST, **flags) -> None:
    """TypeError where one of `owner`'s flag arguments (given as name=value) holds a recipe,
    as a recipe passed positionally does (te.autocast(recipe) puts it in `enabled`, where it
    would read as True): the message names the argument, then `advice` says where it goes
    (by default: to te.autocast, for a module's arguments)."""
    for name, value in flags.items():
        if isinstance(value, Recipe):
            raise TypeError(f"{owner} got a recipe as `{name}`; {advice}")


class _Keywords(NamedTuple):
    """One region function's names: its own, its recipe keyword, the other function's
    keywords (-> its own for the same argument), and the other function's name."""

    owner: str
    recipe: str
    foreign: dict[str, str]
    other: str


_AUTOCAST_KEYWORDS = _Keywords(
    "te.autocast",
    "recipe",
    {"fp8_recipe": "recipe", "fp8_group": "amax_reduction_group"},
    "te.fp8_autocast",
)
_FP8_AUTOCAST_KEYWORDS = _Keywords(
    "te.fp8_autocast",
    "fp8_recipe",
    {"recipe": "fp8_recipe", "amax_reduction_group": "fp8_group"},
    "te.autocast",
)


def _check_region_arguments(keywords: _Keywords, enabled, calibrating, misnamed) -> None:
    """A recipe given as `enabled` or `calibrating` (positionally), or a keyword of the other
    region function: TypeError naming the keyword to use."""
    owner = keywords.owner
    refuse_recipe(
        owner, f"pass it as {keywords.recipe}=...", enabled=enabled, calibrating=calibrating
    )
    for name in misnamed:
        ours = keywords.foreign.get(name)
        if ours is None:
            raise TypeError(f"{owner} got an unexpected keyword argument {name!r}")
        raise TypeError(
            f"{owner} takes {ours}=, not {name}= ({keywords.other}'s name for it): "
            f"use {ours}= (or {keywords.other})"
        )


def autocast(
    enabled: bool = True,
    calibrating: bool = False,
    recipe: Recipe | None = None,
    amax_reduction_group: dist.ProcessGroup | None = None,
    **misnamed,
) -> contextlib.AbstractContextManager[None]:
    """Run te modules in FP8 under `recipe` (default: DelayedScaling()).

    enabled=False runs them in high precision; calibrating=True (with enabled=False) computes in
    high precision while recording amaxes, so delayed scales are ready when FP8 is turned on.
    Regions nest; the innermost settings apply. A recipe given positionally (as `enabled`) or
    te.fp8_autocast's keywords (fp8_recipe=, fp8_group=) are a TypeError naming the keyword.
    """
    _check_region_arguments(_AUTOCAST_KEYWORDS, enabled, calibrating, misnamed)
    return _region(enabled, calibrating, recipe, amax_reduction_group)


@contextlib.contextmanager
def _region(enabled, calibrating, recipe: Recipe | None, amax_reduction_group) -> Iterator[None]:
    """The region te.autocast and te.fp8_autocast open (their arguments checked)."""
    if recipe is None:
        recipe = _DEFAULT_RECIPE
    if not isinstance(recipe, Recipe):
        raise TypeError(f"autocast recipe must be a torchte.recipe.Recipe, got {recipe!r}")
    recipe = recipe._frozen()  # modules key their state by it: later field changes are new
    state = _STATE
    saved = (state.enabled, state.calibrating, state.recipe, state.group)
    state.enabled, state.calibrating = bool(enabled), bool(calibrating)
    state.recipe, state.group = recipe, amax_reduction_group
    if state.depth == 0:
        state.first_module = True
    state.depth += 1
    completed = False
    try:
        yield
        completed = True
    finally:
        state.enabled, state.calibrating, state.recipe, state.group = saved
        state.depth -= 1
        if state.depth == 0:
            state.first_module = False  # asked outside any region: False
            if not torch.compiler.is_compiling():  # a compiled graph keeps no weight cache
                _STEPS.count += 1  # (and a traced count would recompile it every step)
            # Emptied in place (not replaced): torch.compile replays in-place changes of the
            # dict, while it would lose a new dict set on this threading.local object.
            pending = list(state.pending_forward.values())
            state.pending_forward.clear()
            if completed:
                _update(pending)
            else:
                # The step failed: forget its amaxes rather than scale from half a step.
                for delayed_state, _, _ in pending:
                    delayed_state.discard_pending()


def fp8_autocast(
    enabled: bool = True,
    calibrating: bool = False,
    fp8_recipe: Recipe | None = None,
    fp8_group: dist.ProcessGroup | None = None,
    _graph: bool = False,
    **misnamed,
) -> contextlib.AbstractContextManager[None]:
    """Transformer Engine's older name for `autocast`, with its keywords (fp8_recipe,
    fp8_group); te.autocast's (recipe=, amax_reduction_group=) are a TypeError naming them."""
    _check_region_arguments(_FP8_AUTOCAST_KEYWORDS, enabled, calibrating, misnamed)
    return _region(enabled, calibrating, fp8_recipe, fp8_group)


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
