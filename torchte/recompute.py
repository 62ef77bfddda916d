"""te.checkpoint: activation checkpointing that replays the forward's FP8 settings.

    y = te.checkpoint(block, x, *more_args, **block_kwargs)

Inside `te.autocast`, `block` runs once without keeping its activations, and backward runs it
again (torch.utils.checkpoint, non-reentrant) before going through it. torch's own checkpoint
would recompute outside the autocast region (in high precision, so the saved shapes and values
differ from the forward's); here the recompute re-enters the region the forward ran in, and for
delayed scaling (and calibration) it quantizes with the scales the forward used, not the ones
updated since, and leaves no trace in the scaling state: the amaxes it records are taken back
and no update is owed for it. Gradients then equal those of the same block not checkpointed,
bit for bit, and so does every scale and amax history afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from .autocast import autocast, autocast_state
from .quantization.delayed import DelayedScalingState

__all__ = ["checkpoint"]

_STATE = autocast_state()


class _Replay:
    """The forward's FP8 settings and the scales of every delayed-scaling state it recorded
    into, and how to run the function again under them."""

    def __init__(self, function: Callable, tracker) -> None:
        self.function, self.tracker = function, tracker
        state = _STATE
        self.inside = state.depth > 0
        self.settings = (state.enabled, state.calibrating, state.recipe, state.group)
        self.scales: dict[DelayedScalingState, torch.Tensor] = {}
        self.rng_states = tracker.get_states() if tracker is not None else None
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 1:
            return self._forward(args, kwargs)
        return self._recompute(args, kwargs)

    def _forward(self, args, kwargs):
        state = _STATE
        outer = state.recorded_states
        mine = state.recorded_states = []
        try:
            out = self.function(*args, **kwargs)
            # The scales these states quantized with: they move when the region exits.
            self.scales = {s: s.scale.clone() for s in mine}
        finally:
            state.recorded_states = outer
            if outer is not None:  # a checkpoint around this one replays these states too
                outer.extend(mine)
        return out

    def _recompute(self, args, kwargs):
        saved = [(s, s.scale.clone(), s.amax_history[0].clone()) for s in self.scales]
        for delayed_state, scale in self.scales.items():
            delayed_state.scale.copy_(scale)
            delayed_state.generation += 1  # no FP8 weight cached since is valid now
        rng = self.tracker.get_states() if self.tracker is not None else None
        region = contextlib.nullcontext()
        if self.inside:
            enabled, calibrating, recipe, group = self.settings
            region = autocast(enabled, calibrating, recipe, group)
        state = _STATE
        replaying = state.replaying
        state.replaying = True
        try:
            if rng is not None:
                self.tracker.set_states(self.rng_states)
            with region:
                return self.function(*args, **kwargs)
        finally:
            state.replaying = replaying
            if rng is not None:
                self.tracker.set_states(rng)
            for delayed_state, scale, row0 in saved:  # the state as the recompute found it
                delayed_state.scale.copy_(scale)
                delayed_state.amax_history[0].copy_(row0)
                delayed_state.generation += 1


def checkpoint(
    function: Callable,
    *args,
    distribute_saved_activations: bool = False,
    get_rng_state_tracker: Callable | None = None,
    tp_group=None,
    use_reentrant: bool = True,
    **kwargs,
):
    """function(*args, **kwargs), its activations recomputed in backward under the forward's
    te.autocast settings and scales (see the module docstring).

    get_rng_state_tracker: a callable returning an RNG states tracker (get_states/set_states,
    as Megatron-Core's): its states are replayed too (torch's own RNG always is).
    use_reentrant is accepted and either way torch's non-reentrant checkpoint runs (it takes
    keyword arguments and inputs that do not require grad).
    tp_group serves distribute_saved_activations only (as in Transformer Engine): any group is
    accepted without it; distribute_saved_activations over a group of more than one rank raises
    NotImplementedError.
    """
    if distribute_saved_activations and tp_group is not None and _group_size(tp_group) > 1:
        raise NotImplementedError(
            "te.checkpoint: distribute_saved_activations (each tensor-parallel rank keeping a "
            "shard of the saved input) is not implemented in torchte yet"
        )
    if not callable(function):
        raise TypeError(f"te.checkpoint: function must be callable, got {function!r}")
    tracker = get_rng_state_tracker() if get_rng_state_tracker is not None else None
    replay = _Replay(function, tracker)
    return torch.utils.checkpoint.checkpoint(replay, *args, use_reentrant=False, **kwargs)


def _group_size(group) -> int:
    """The ranks of a process group (1 without torch.distributed)."""
    if not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(group)
