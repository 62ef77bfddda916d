"""Transformer Engine's graph-capture helpers (`transformer_engine.pytorch.graph`) beside
make_graphed_callables: the capture flags, and the snapshot of delayed-scaling state that a
client takes before warming up and capturing its own graphs and puts back after.

- `set_capture_start()` / `set_capture_end()` / `is_graph_capturing()`: a process-wide flag a
  client raises around the creation of its graphs (Megatron-Core does around its per-layer
  captures); make_graphed_callables raises it while it runs, as Transformer Engine's does.
- `save_fp8_tensors(modules, recipe)` / `restore_fp8_tensors(modules, saved)`: the scales,
  amax histories and non-finite counts of every te module under `modules` for a delayed-scaling
  `recipe`, copied out and copied back in place (the captured graphs keep the memory they
  point at). A forward after the restore computes what it computed at the save, bit for bit:
  the FP8 weight copies quantized since are made stale.

Snapshot layout (one entry per submodule, in `module.modules()` order, module after module):
None for a module that is not a te module, else a dict with Transformer Engine's keys
"scaling_fwd" and "scaling_bwd" ([scale (n,) fp32, amax_history (L, n) fp32] each, clones) and
torchte's "nonfinite" ([forward (n,), backward (n,)] int32) and "amax_history_len" (L). A te
module that had no state of that history length yet gets only "amax_history_len": its state,
if made in between, is put back to the values a new one starts with (scale 1, history 0).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ..module.base import TransformerEngineBaseModule
from ..quantization.delayed import DelayedScalingState
from ..quantization.setup import needs_delayed_state

__all__ = [
    "graph_pool_handle",
    "is_graph_capturing",
    "restore_fp8_tensors",
    "save_fp8_tensors",
    "set_capture_end",
    "set_capture_start",
]

_KEYS = ("scaling_fwd", "scaling_bwd")


class _CaptureFlags:
    """client: set_capture_start/end (Transformer Engine's flag); making: how many
    make_graphed_callables calls are warming up and capturing now (FP8GlobalStateManager's
    fp8_graph_capturing reads it)."""

    __slots__ = ("client", "making")

    def __init__(self) -> None:
        self.client = False
        self.making = 0


_FLAGS = _CaptureFlags()


def set_capture_start() -> None:
    """Say that CUDA graphs are being made from now on (is_graph_capturing() is True)."""
    _FLAGS.client = True


def set_capture_end() -> None:
    """Say that the graphs are made (is_graph_capturing() is False)."""
    _FLAGS.client = False


def is_graph_capturing() -> bool:
    """Whether set_capture_start() was called without set_capture_end() since, or
    make_graphed_callables is running."""
    return _FLAGS.client


def making_graphs() -> bool:
    """Whether a make_graphed_callables call is warming up or capturing now."""
    return _FLAGS.making > 0


@contextlib.contextmanager
def capture_window() -> Iterator[None]:
    """The span of one make_graphed_callables call: is_graph_capturing() and making_graphs()
    are True inside; the capture flag is put back as it was afterwards (even on error)."""
    previous = _FLAGS.client
    _FLAGS.client = True
    _FLAGS.making += 1
    try:
        yield
    finally:
        _FLAGS.making -= 1
        _FLAGS.client = previous


def graph_pool_handle():
    """An opaque token naming a new CUDA graph memory pool (torch.cuda.graph_pool_handle), to
    pass as make_graphed_callables' `pool`."""
    return torch.cuda.graph_pool_handle()


def _submodules(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """Every submodule of each of `modules`, in order (a module given twice counts twice)."""
    if isinstance(modules, nn.Module) and not hasattr(modules, "__iter__"):
        raise TypeError("modules must be an iterable of nn.Modules (e.g. [model]), not a module")
    found = []
    for module in modules:
        if not isinstance(module, nn.Module):
            raise TypeError(f"modules must hold nn.Modules, got {type(module).__name__}")
        found.extend(module.modules())
    return found


def save_fp8_tensors(
    modules: Iterable[nn.Module], recipe: Any
) -> list[dict[str, Any] | None] | None:
    """A copy of the delayed-scaling state of `recipe`'s history length of every te module
    under `modules` (layout: see the module docstring); None unless `recipe` is a
    DelayedScaling (other recipes keep no state to put back)."""
    history_len = needs_delayed_state(recipe)
    if history_len is None:
        return None
    saved: list[dict[str, Any] | None] = []
    with torch.no_grad():
        for module in _submodules(modules):
            if not isinstance(module, TransformerEngineBaseModule):
                saved.append(None)
                continue
            entry: dict[str, Any] = {"amax_history_len": history_len}
            pair = module._delayed_states.get(history_len)
            if pair is not None:
                for key, state in zip(_KEYS, pair, strict=True):
                    entry[key] = [state.scale.clone(), state.amax_history.clone()]
                entry["nonfinite"] = [state.nonfinite.clone() for state in pair]
            saved.append(entry)
    return saved


def restore_fp8_tensors(
    modules: Iterable[nn.Module], fp8_tensors: list[dict[str, Any] | None] | None
) -> None:
    """Copy what save_fp8_tensors(modules, ...) returned back into the modules' states, in
    place; nothing when it is None. RuntimeError when the entries do not match the modules'
    submodules (a different module list, or modules added since); the list is not changed."""
    if fp8_tensors is None:
        return
    submodules = _submodules(modules)
    if len(fp8_tensors) != len(submodules):
        raise RuntimeError(
            f"restore_fp8_tensors: the saved FP8 state has {len(fp8_tensors)} entries but the "
            f"modules have {len(submodules)} submodules; pass the modules given to "
            "save_fp8_tensors"
        )
    with torch.no_grad():
        for index, (module, entry) in enumerate(zip(submodules, fp8_tensors, strict=True)):
            if entry is None:
                continue
            if not isinstance(module, TransformerEngineBaseModule):
                raise RuntimeError(
                    f"restore_fp8_tensors: entry {index} holds FP8 state but submodule {index} "
                    f"is a {type(module).__name__}, not a te module"
                )
            _restore_module(module, entry, index)


def _restore_module(module: TransformerEngineBaseModule, entry: dict, index: int) -> None:
    """Put one module's saved state back (or reset the state made since the save)."""
    if _KEYS[0] not in entry:
        history_len = entry.get("amax_history_len")
        pair = module._delayed_states.get(history_len)
        for state in pair or ():
            _reset(state)
        return
    history_len = entry["scaling_fwd"][1].shape[0]
    pair = module._delayed_state_pair(history_len)
    counts = entry.get("nonfinite", [None, None])
    for key, state, count in zip(_KEYS, pair, counts, strict=True):
        scale, amax_history = entry[key]
        try:
            state.load(scale, amax_history)
        except ValueError as err:
            raise RuntimeError(f"restore_fp8_tensors: entry {index} ({key}): {err}") from None
        if count is not None:
            state.nonfinite.copy_(count)


def _reset(state: DelayedScalingState) -> None:
    """The values a new state starts with; FP8 weights quantized with the old scale go stale."""
    state.scale.fill_(1.0)
    state.amax_history.zero_()
    state.nonfinite.zero_()
    state.generation += 1
