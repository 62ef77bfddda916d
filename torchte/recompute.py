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

Transformer Engine's recompute flags, for clients that checkpoint by themselves (Megatron-Core's
CheckpointWithoutOutput): `activation_recompute_forward(activation_recompute, recompute_phase)`
around the first forward (phase False) and around its recompute (phase True, inside the same
te.autocast settings). The first forward keeps, per delayed-scaling state it quantized with,
the scale it used (first in, first out per state, as Transformer Engine keeps them per module);
the recompute quantizes with the oldest kept scale of each state and leaves no trace, as above.
A first forward that is never recomputed keeps its scales (one small tensor per state), as
Transformer Engine's recompute buffer does; a recompute switches the scales of every state with
one kept (a few copies each), since which ones it uses is known only after it ran.
`is_fp8_activation_recompute_enabled()` / `in_fp8_activation_recompute_phase()` read the flags
(te.checkpoint sets them too). The flags are process-wide, as Transformer Engine's are: the
recompute runs in backward, on autograd's threads.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator

import torch

from .autocast import autocast, autocast_state
from .quantization.delayed import DelayedScalingState

__all__ = [
    "activation_recompute_forward",
    "checkpoint",
    "get_activation_recompute_contexts",
    "in_fp8_activation_recompute_phase",
    "is_fp8_activation_recompute_enabled",
]

_STATE = autocast_state()


class _Flags:
    """Transformer Engine's recompute flags: inside a checkpointed region, and whether it is
    the recompute (second) forward."""

    __slots__ = ("phase", "region")

    def __init__(self) -> None:
        self.region = False
        self.phase = False


_FLAGS = _Flags()
# activation_recompute_forward: per delayed-scaling state, the scales first forwards used, oldest
# first; and the is-first-module flags at their entries (Transformer Engine keeps both).
_KEPT_SCALES: dict[DelayedScalingState, deque[torch.Tensor]] = {}
_KEPT_FIRST: deque[bool] = deque()


def is_fp8_activation_recompute_enabled() -> bool:
    """Whether code runs inside a checkpointed region (activation_recompute_forward with
    activation_recompute=True, or te.checkpoint) with FP8 on (te.autocast enabled)."""
    return _FLAGS.region and _STATE.enabled


def in_fp8_activation_recompute_phase() -> bool:
    """Whether code runs in the recompute (second) forward of a checkpointed region."""
    return _FLAGS.phase


@contextlib.contextmanager
def _flags(region: bool, phase: bool) -> Iterator[None]:
    saved = (_FLAGS.region, _FLAGS.phase)
    _FLAGS.region, _FLAGS.phase = region, phase
    try:
        yield
    finally:
        _FLAGS.region, _FLAGS.phase = saved


class _Recorded(list):
    """te.autocast's recorded_states list of a checkpointed forward: the states it registers
    updates for, and (`scales`) the scale each quantized with, taken when it registered (before
    any region exit inside the forward moves it)."""

    def __init__(self) -> None:
        super().__init__()
        self.scales: dict[DelayedScalingState, torch.Tensor] = {}

    def append(self, state: DelayedScalingState) -> None:
        super().append(state)
        if state not in self.scales:
            self.scales[state] = state.scale.clone()

    def extend(self, states) -> None:
        for state in states:
            self.append(state)


@contextlib.contextmanager
def _recording() -> Iterator[_Recorded]:
    """The delayed-scaling states forwards inside register updates for, with their scales;
    also handed to an enclosing recording."""
    outer = _STATE.recorded_states
    mine = _Recorded()
    _STATE.recorded_states = mine
    try:
        yield mine
    finally:
        _STATE.recorded_states = outer
        if outer is not None:
            outer.extend(mine)


@contextlib.contextmanager
def _scales_swapped(
    scales: dict[DelayedScalingState, torch.Tensor], whole_history: bool = False
) -> Iterator[None]:
    """Inside: each state quantizes with the given scale. After: every scale and the newest
    amax row (whole_history: the whole amax history) back as they were before, so what a
    recompute recorded is taken back; FP8 weights quantized in between go stale."""
    found = [
        (s, s.scale.clone(), (s.amax_history if whole_history else s.amax_history[0]).clone())
        for s in scales
    ]
    for state, scale in scales.items():
        state.scale.copy_(scale)
        state.generation += 1  # no FP8 weight cached since is valid now
    try:
        yield
    finally:
        for state, scale, history in found:
            state.scale.copy_(scale)
            (state.amax_history if whole_history else state.amax_history[0]).copy_(history)
            state.generation += 1


class activation_recompute_forward(contextlib.ContextDecorator):  # TE's (lowercase) name
    """Transformer Engine's context manager around a checkpointed forward (recompute_phase=
    False) and its recompute (recompute_phase=True); see the module docstring. With
    activation_recompute=False it only clears the flags inside."""

    def __init__(self, activation_recompute: bool = False, recompute_phase: bool = False):
        self.activation_recompute = bool(activation_recompute)
        self.recompute_phase = bool(recompute_phase)
        self._exits: list[contextlib.ExitStack] = []

    def __enter__(self) -> activation_recompute_forward:
        stack = contextlib.ExitStack()
        stack.enter_context(_flags(self.activation_recompute, self.recompute_phase))
        if self.activation_recompute:
            if self.recompute_phase:
                stack.enter_context(_recompute_phase())
            else:
                stack.enter_context(_first_phase())
        self._exits.append(stack)
        return self

    def __exit__(self, *exc_details) -> None:
        self._exits.pop().__exit__(*exc_details)


@contextlib.contextmanager
def _first_phase() -> Iterator[None]:
    """Keep the is-first-module flag and, after the forward, the scale of each state it
    quantized with (a failed forward keeps nothing)."""
    _KEPT_FIRST.append(_STATE.first_module)
    try:
        with _recording() as used:
            yield
    except BaseException:
        _KEPT_FIRST.pop()
        raise
    for state, scale in used.scales.items():
        _KEPT_SCALES.setdefault(state, deque()).append(scale)


@contextlib.contextmanager
def _recompute_phase() -> Iterator[None]:
    """Quantize with the oldest kept scale of every state that has one; afterwards drop the
    kept scale of each state the recompute used, take back its amaxes and owe no update for
    it. (All states with a kept scale are switched: which ones the recompute uses is known
    only after it ran. Their whole histories are put back: a te.autocast region exiting inside
    this context would have updated them.)"""
    if _KEPT_FIRST:
        _STATE.first_module = _KEPT_FIRST.popleft()
    kept = {state: scales[0] for state, scales in _KEPT_SCALES.items()}
    owed_before = set(_STATE.pending_forward)
    replaying = _STATE.replaying
    _STATE.replaying = False  # modules register, so that the states used are seen
    try:
        with _scales_swapped(kept, whole_history=True), _recording() as used:
            yield
    finally:
        _STATE.replaying = replaying
        for state in dict.fromkeys(used):
            if state not in owed_before:
                _STATE.pending_forward.pop(state, None)
            scales = _KEPT_SCALES.get(state)
            if scales:
                scales.popleft()
                if not scales:
                    del _KEPT_SCALES[state]


def get_activation_recompute_contexts() -> tuple[
    activation_recompute_forward, activation_recompute_forward
]:
    """(around the first forward, around its recompute) of a checkpointed region."""
    return (
        activation_recompute_forward(activation_recompute=True, recompute_phase=False),
        activation_recompute_forward(activation_recompute=True, recompute_phase=True),
    )


class _Replay:
    """The forward's FP8 settings and the scales of every delayed-scaling state it recorded
    into, and how to run the function again under them."""

    def __init__(self, function: Callable, tracker, kwargs: dict) -> None:
        self.function, self.tracker, self.kwargs = function, tracker, kwargs
        state = _STATE
        self.inside = state.depth > 0
        self.settings = (state.enabled, state.calibrating, state.recipe, state.group)
        self.scales: dict[DelayedScalingState, torch.Tensor] = {}
        self.rng_states = tracker.get_states() if tracker is not None else None
        self.calls = 0

    def __call__(self, *args):
        self.calls += 1
        if self.calls == 1:
            return self._forward(args)
        return self._recompute(args)

    def _forward(self, args):
        with _flags(True, False), _recording() as used:
            out = self.function(*args, **self.kwargs)
        self.scales = used.scales
        return out

    def _recompute(self, args):
        rng = self.tracker.get_states() if self.tracker is not None else None
        region = contextlib.nullcontext()
        if self.inside:
            enabled, calibrating, recipe, group = self.settings
            region = autocast(enabled, calibrating, recipe, group)
        replaying = _STATE.replaying
        _STATE.replaying = True
        try:
            if rng is not None:
                self.tracker.set_states(self.rng_states)
            with _scales_swapped(self.scales), _flags(True, True), region:
                return self.function(*args, **self.kwargs)
        finally:
            _STATE.replaying = replaying
            if rng is not None:
                self.tracker.set_states(rng)


def checkpoint(function: Callable, *args, **kwargs):
    """function(*args, **kwargs), its activations recomputed in backward under the forward's
    te.autocast settings and scales (see the module docstring).

    Transformer Engine's keyword arguments are taken out of kwargs (the rest go to function):
    get_rng_state_tracker: a callable returning an RNG states tracker (get_states/set_states,
    as Megatron-Core's): its states are replayed too (torch's own RNG always is).
    use_reentrant (default True) is accepted and either way torch's non-reentrant checkpoint
    runs (it takes keyword arguments and inputs that do not require grad).
    tp_group serves distribute_saved_activations only: any group is accepted without it;
    distribute_saved_activations over a group of more than one rank raises
    NotImplementedError. context_fn, determinism_check and debug go to torch's checkpoint.
    Transformer Engine's older positional form, checkpoint(function,
    distribute_saved_activations, get_rng_state_tracker, tp_group, *args), is taken too.
    """
    if not callable(function):
        raise TypeError(f"te.checkpoint: function must be callable, got {function!r}")
    options = {name: kwargs.pop(name, default) for name, default in _OPTIONS.items()}
    args = _old_positional_form(args, options)
    tp_group = options["tp_group"]
    if options["distribute_saved_activations"] and _group_size(tp_group) > 1:
        raise NotImplementedError(
            "te.checkpoint: distribute_saved_activations (each tensor-parallel rank keeping a "
            "shard of the saved input) is not implemented in torchte yet"
        )
    get_tracker = options["get_rng_state_tracker"]
    tracker = get_tracker() if get_tracker is not None else None
    replay = _Replay(function, tracker, kwargs)
    torch_options = {k: options[k] for k in ("context_fn", "determinism_check", "debug")}
    return torch.utils.checkpoint.checkpoint(replay, *args, use_reentrant=False, **torch_options)


# Transformer Engine's checkpoint arguments (taken out of the function's keyword arguments).
_OPTIONS = {
    "distribute_saved_activations": False,
    "get_rng_state_tracker": None,
    "tp_group": None,
    "use_reentrant": True,
    "context_fn": torch.utils.checkpoint.noop_context_fn,
    "determinism_check": "default",
    "debug": False,
}


def _old_positional_form(args: tuple, options: dict) -> tuple:
    """args without Transformer Engine 1.x's leading (distribute_saved_activations,
    get_rng_state_tracker, tp_group), which go into options when they are there."""
    if (
        len(args) > 3
        and isinstance(args[0], bool)
        and callable(args[1])
        and (args[2] is None or isinstance(args[2], torch.distributed.ProcessGroup))
    ):
        options["distribute_saved_activations"] = args[0]
        options["get_rng_state_tracker"] = args[1]
        options["tp_group"] = args[2]
        return args[3:]
    return args


def _group_size(group) -> int:
    """The ranks of a process group, the default one for None (1 without torch.distributed)."""
    if not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(group)
