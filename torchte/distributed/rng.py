"""Megatron-Core's model-parallel RNG: named RNG states, forked for initialization and dropout
inside tensor-parallel regions and replayed by `checkpoint`.

`CudaRNGStatesTracker` holds the states; `get_all_rng_states()` gives the states of the tracker
last added to or set.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = [
    "CudaRNGStatesTracker",
    "get_all_rng_states",
    "graph_safe_rng_available",
    "set_all_rng_states",
]

_MODEL_PARALLEL_RNG = "model-parallel-rng"

# The states of the tracker last added to or set (Transformer Engine's get_all_rng_states):
# the dict object the tracker holds, so later forks show in it.
_ALL_RNG_STATES: dict[str, dict[str, torch.Tensor]] = {"states": {}}


def get_all_rng_states() -> dict[str, torch.Tensor]:
    """The RNG states (by name) of the CudaRNGStatesTracker last added to or set: the
    tracker's own dict, not a copy ({} before any)."""
    return _ALL_RNG_STATES["states"]


def set_all_rng_states(states: dict[str, torch.Tensor]) -> None:
    """Make `states` what get_all_rng_states() returns."""
    if not isinstance(states, dict):
        raise TypeError(f"set_all_rng_states: states must be a dict, got {type(states).__name__}")
    _ALL_RNG_STATES["states"] = states


def graph_safe_rng_available() -> bool:
    """Whether torch has the CUDA-graph-safe generator API (register_generator_state and the
    graphsafe_get/set_state of generators). torchte's tracker keeps its states as RNG state
    tensors either way."""
    return (
        hasattr(torch.cuda.CUDAGraph, "register_generator_state")
        and hasattr(torch.Generator, "graphsafe_set_state")
        and hasattr(torch.Generator, "graphsafe_get_state")
        and hasattr(torch.Generator, "clone_state")
    )


class CudaRNGStatesTracker:
    """Named RNG states of the device's default generator (the GPU's where there is one, else
    the CPU's): `add` one from a seed, `fork` to draw from it (dropout or initialization
    inside a tensor-parallel region), `get_states` / `set_states` to save and replay them."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        """Forget every state and seed."""
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of the states by name."""
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the states (as get_states gave them); get_all_rng_states() shows these."""
        self.states_ = {name: state.clone() for name, state in states.items()}
        set_all_rng_states(self.states_)

    def add(self, name: str, seed: int) -> None:
        """A new state `name` seeded with `seed`; ValueError if the name or seed is taken.
        get_all_rng_states() shows this tracker's states from now on."""
        if seed in self.seeds_:
            raise ValueError(f"CudaRNGStatesTracker: seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"CudaRNGStatesTracker: state {name!r} already exists")
        self.seeds_.add(seed)
        saved = _get_rng_state()
        _manual_seed(seed)
        self.states_[name] = _get_rng_state()
        _set_rng_state(saved)
        set_all_rng_states(self.states_)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from state `name` inside the block (it advances), then return to the state
        before; KeyError naming the states there are if `name` was never added."""
        if name not in self.states_:
            raise KeyError(
                f"CudaRNGStatesTracker: no state {name!r} (added: {sorted(self.states_)})"
            )
        saved = _get_rng_state()
        _set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_rng_state()
            _set_rng_state(saved)


def _get_rng_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state()


def _set_rng_state(state: torch.Tensor) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _manual_seed(seed: int) -> None:
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)
