"""A te module's life outside the hot path: (re)initializing parameters, following them to
another device, and its FP8 scaling state in a state_dict.

- `ParameterInit` says how one logical tensor is initialized: the parameters it is split into
  (concatenated along dim 0) and the function that fills the whole. `reset_parameters` runs them
  again exactly as the constructor did (same random draws for the same generator state), also
  for FP8 parameters, which are requantized in place.
- A module built on the meta device (deferred initialization) or moved with .to()/.cuda()/
  to_empty() takes its parameters' device (`moved_state`).
- `extra_state_of` / `read_extra_state`: the delayed-scaling scales, amax histories and
  non-finite counts as a dict of tensors, checked on load: what get_extra_state writes into
  Transformer Engine's form (_te_extra_state.py), and torchte's older `_extra_state` form.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from torchte.quantization.delayed import DelayedScalingState
from torchte.quantization.float8_tensor import Float8Tensor

__all__ = [
    "EXTRA_STATE_KEYS",
    "ExtraStateError",
    "ParameterInit",
    "extra_state_of",
    "fill",
    "keeping_out_of_inference",
    "load_counts",
    "moved_state",
    "norm_inits",
    "read_extra_state",
    "reinitialize",
]


@dataclass(frozen=True)
class ParameterInit:
    """One logical tensor: the parameters `names` (dim-0 parts of it, in order) and `init`,
    which fills the whole tensor in place; `gemm` is the GEMM whose FP8 weight quantizer an FP8
    parameter uses (None for tensors that are never FP8)."""

    names: tuple[str, ...]
    init: Callable[[torch.Tensor], Any]
    gemm: int | None = None


def fill(value: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """An init function that fills the tensor with `value`."""

    def init(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(value)

    return init


def norm_inits(weight: str, bias: str, zero_centered_gamma: bool) -> list[ParameterInit]:
    """A norm's parameters: the gain `weight` (0 under zero_centered_gamma, else 1) and the
    `bias` (0; skipped where the module has none)."""
    gamma = 0.0 if zero_centered_gamma else 1.0
    return [ParameterInit((weight,), fill(gamma)), ParameterInit((bias,), fill(0.0))]


def reinitialize(module, inits: Sequence[ParameterInit], prime: Callable | None) -> None:
    """Fill each logical tensor of `inits` anew and write it into its parameters in place.

    FP8 parameters (Float8Tensor) are requantized; `prime(full_hp, gemm)`, when given, first
    sets their delayed scale from the new value (as at construction).
    """
    params = module._parameters
    with torch.no_grad():
        for spec in inits:
            parts = [params[n] for n in spec.names if params.get(n) is not None]
            if not parts:
                continue
            rows = sum(p.shape[0] for p in parts)
            full = torch.empty(
                (rows, *parts[0].shape[1:]), dtype=parts[0].dtype, device=parts[0].device
            )
            spec.init(full)
            fp8 = isinstance(parts[0], Float8Tensor)
            if fp8 and prime is not None and spec.gemm is not None:
                prime(full, spec.gemm)
            start = 0
            for part in parts:
                piece = _like(part, full[start : start + part.shape[0]])
                if fp8:
                    part.quantize_(piece)
                else:
                    part.copy_(piece)
                start += part.shape[0]


def _like(part: torch.Tensor, piece: torch.Tensor) -> torch.Tensor:
    """piece laid out as the parameter `part`: for a DTensor (a parameter sharded by FSDP2)
    this rank's shard of rank 0's piece (every rank then holds one model, whatever its RNG)."""
    if not isinstance(part, _dtensor_type()):
        return piece
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(piece, part.device_mesh, part.placements, src_data_rank=0)


@functools.cache
def _dtensor_type() -> type:
    """torch's DTensor class (a class nothing is an instance of where torch.distributed is not
    built)."""
    if not torch.distributed.is_available():
        return type("NoDTensor", (), {})
    from torch.distributed.tensor import DTensor

    return DTensor


def keeping_out_of_inference() -> contextlib.AbstractContextManager:
    """A context for tensors a module keeps across calls (scaling state, cached FP8 weights):
    they are made as normal tensors even under torch.inference_mode(), whose inference tensors
    could never be updated in place or saved for backward afterwards. (torch.compile traces no
    inference mode: it treats it as no_grad.)"""
    if not torch.compiler.is_compiling() and torch.is_inference_mode_enabled():
        return torch.inference_mode(False)
    return contextlib.nullcontext()


def moved_state(state: DelayedScalingState, device: torch.device) -> None:
    """Move `state`'s tensors to `device` (in the object; quantizers made from it are stale).
    A state on the meta device holds no values: it starts afresh on the new device."""
    fresh = state.amax_history.is_meta
    for name in ("amax_history", "scale", "nonfinite"):
        tensor = getattr(state, name)
        value = 1 if name == "scale" else 0
        moved = torch.full_like(tensor, value, device=device) if fresh else tensor.to(device)
        setattr(state, name, moved)
    state.generation += 1


# -- extra state ----------------------------------------------------------------------------------

EXTRA_STATE_KEYS = ("fwd_scale", "fwd_amax_history", "bwd_scale", "bwd_amax_history")
_COUNT_KEYS = ("fwd_nonfinite", "bwd_nonfinite")


class ExtraStateError(ValueError):
    """A state_dict's `_extra_state` for a te module cannot be loaded (named in the message)."""


def extra_state_of(length: int, fwd: DelayedScalingState, bwd: DelayedScalingState) -> dict:
    """The extra state (a dict of copies of its tensors) of a module whose last used
    delayed-scaling history length is `length`."""
    state: dict[str, Any] = {"amax_history_len": length}
    for key, s in (("fwd", fwd), ("bwd", bwd)):
        state[f"{key}_scale"] = s.scale.clone()
        state[f"{key}_amax_history"] = s.amax_history.clone()
        state[f"{key}_nonfinite"] = s.nonfinite.clone()
    return state


def read_extra_state(state: Any, module: str) -> dict | None:
    """The checked extra state to load into te module `module` (a name for messages); None
    when there is nothing to load. ExtraStateError names what is wrong."""
    if state is None or (isinstance(state, dict) and not state):
        return None
    if isinstance(state, torch.Tensor):
        if state.numel() == 0:  # Transformer Engine's form for "no FP8 state"
            return None
        raise ExtraStateError(
            f"{module}: this extra state is a serialized tensor ({state.numel()} bytes, "
            "Transformer Engine's format): read it with _te_extra_state.from_te_extra_state "
            "(as set_extra_state does) first"
        )
    if not isinstance(state, dict):
        raise ExtraStateError(
            f"{module}: extra state must be Transformer Engine's uint8 tensor (as "
            "get_extra_state() makes) or torchte's older dict form, "
            f"got {type(state).__name__}"
        )
    missing = [k for k in ("amax_history_len", *EXTRA_STATE_KEYS) if k not in state]
    if missing:
        raise ExtraStateError(
            f"{module}: extra state lacks {', '.join(repr(k) for k in missing)}; it must hold "
            f"amax_history_len and {', '.join(EXTRA_STATE_KEYS)} (torchte's older form)"
        )
    length = state["amax_history_len"]
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ExtraStateError(
            f"{module}: extra state's amax_history_len must be a positive int, got {length!r}"
        )
    for key in (*EXTRA_STATE_KEYS, *_COUNT_KEYS):
        if key in state and not isinstance(state[key], torch.Tensor):
            raise ExtraStateError(
                f"{module}: extra state's {key} must be a tensor, got {type(state[key]).__name__}"
            )
    return state


def load_counts(state: dict, fwd: DelayedScalingState, bwd: DelayedScalingState) -> None:
    """The non-finite counts of `state` (zero where an older checkpoint has none)."""
    for key, s in (("fwd", fwd), ("bwd", bwd)):
        saved = state.get(f"{key}_nonfinite")
        if saved is None:
            s.nonfinite.zero_()
        elif saved.shape != s.nonfinite.shape:
            raise ExtraStateError(
                f"saved {key}_nonfinite has shape {tuple(saved.shape)}, this module's has "
                f"{tuple(s.nonfinite.shape)}"
            )
        else:
            s.nonfinite.copy_(saved)
