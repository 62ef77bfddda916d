"""The state of a block-scaled Storage or Quantizer as plain values: copies that share or map
its tensors, the pickled form block_tensor.py saves (bytes, never dequantized values), and a
storage's first values for a repr.

The contract's Storages and Quantizers are plain objects with __slots__; these helpers read and
write those slots (and any __dict__) without knowing the format, so one Tensor class serves
every format.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_map_only

__all__ = [
    "build",
    "map_storage",
    "pickled_quantizer",
    "pickled_storage",
    "repr_values",
    "slot_state",
    "unpickled_storage",
]

# One-byte float dtypes (FP8, E8M0, packed FP4): pickled as uint8 views, because plain pickle
# cannot rebuild tensors of these dtypes (torch.save alone can).
_BYTE_FLOATS = frozenset(
    d
    for d in vars(torch).values()
    if isinstance(d, torch.dtype) and d.is_floating_point and d.itemsize == 1
)
# What a quantizer's setting may be to be pickled (anything else, e.g. an amax reduction bound
# to its module, comes back None).
_PLAIN = (type(None), bool, int, float, str, tuple, torch.dtype)


def slot_state(obj: object) -> dict[str, Any]:
    """The set attributes of a __slots__ object (its class and bases), plus any __dict__."""
    state: dict[str, Any] = {}
    for klass in reversed(type(obj).__mro__):
        slots = klass.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                state[name] = getattr(obj, name)
    state.update(getattr(obj, "__dict__", {}))
    return state


def build(cls: type, state: dict[str, Any]) -> Any:
    """An object of cls with `state` set, its constructor not run (a copy of one that was)."""
    obj = cls.__new__(cls)
    for name, value in state.items():
        setattr(obj, name, value)
    return obj


def map_storage(storage: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A storage of the same class with fn applied to each tensor it holds (metadata shared)."""
    state = {k: tree_map_only(torch.Tensor, fn, v) for k, v in slot_state(storage).items()}
    return build(type(storage), state)


def pickled_storage(storage: Any) -> tuple[dict[str, Any], dict[str, torch.dtype]]:
    """(state, byte_dtypes): storage's slots, 1-byte float tensors as uint8 views (their dtypes
    in byte_dtypes, by slot)."""
    state, byte_dtypes = {}, {}
    for name, value in slot_state(storage).items():
        if isinstance(value, torch.Tensor) and value.dtype in _BYTE_FLOATS:
            byte_dtypes[name] = value.dtype
            value = value.view(torch.uint8)
        state[name] = value
    return state, byte_dtypes


def unpickled_storage(cls: type, state: dict[str, Any], byte_dtypes: dict[str, torch.dtype]) -> Any:
    """The storage of class cls that pickled_storage gave (state, byte_dtypes) for."""
    state = dict(state)
    for name, byte_dtype in byte_dtypes.items():
        state[name] = state[name].view(byte_dtype)
    return build(cls, state)


def pickled_quantizer(quantizer: Any) -> dict[str, Any]:
    """The quantizer's settings (slots) as plain values: a dict holding anything else comes
    back empty (a cache, as NVFP4Quantizer's specs), any other value None (an amax reduction,
    a process group)."""
    return {k: _setting(v) for k, v in slot_state(quantizer).items()}


def _setting(value: Any) -> Any:
    if isinstance(value, dict):
        plain = all(isinstance(v, _PLAIN) for v in (*value, *value.values()))
        return value if plain else {}
    return value if isinstance(value, _PLAIN) else None


def repr_values(storage: Any, count: int = 6) -> str:
    """The first `count` values of a storage, for a repr; or why there are none (emptied, or
    meta / fake tensors, as torch.compile traces with)."""
    data = [t for t in storage.get_data_tensors() if t is not None]
    if not data:
        return "<no data>"
    if any(t.is_meta or is_fake(t) for t in data):
        return "<not materialized>"
    flat = storage.dequantize(torch.float32).reshape(-1)
    shown = ", ".join(f"{v:.4g}" for v in flat[:count].tolist())
    return f"[{shown}{', ...' if flat.numel() > count else ''}]"
