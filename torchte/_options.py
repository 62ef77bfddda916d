"""Transformer Engine's keyword arguments that torchte does not implement: accepted while off
(clients pass them on every call, at their defaults), refused by name when on."""

from __future__ import annotations

from collections.abc import Collection, Mapping

__all__ = ["check_options"]


def check_options(owner: str, given: Mapping, off: Mapping, inert: Collection[str] = ()) -> None:
    """The keyword arguments `given` beyond `owner`'s own: those in `off` (name -> the value
    meaning off) pass at that value (or None / False) and raise NotImplementedError naming
    them otherwise; names in `inert` pass with any value; any other name is a TypeError."""
    unknown = sorted(k for k in given if k not in off and k not in inert)
    if unknown:
        raise TypeError(f"{owner} got unexpected keyword arguments: {', '.join(unknown)}")
    on = [k for k, value in off.items() if k in given and given[k] not in (value, None, False)]
    enabled = sorted(f"{k}={given[k]!r}" for k in on)
    if enabled:
        raise NotImplementedError(
            f"{owner}: {', '.join(enabled)} is not implemented in torchte yet; leave it off"
        )
