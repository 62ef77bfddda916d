"""FP8 weights kept across the replays of CUDA graphs: make_graphed_callables(...,
cache_quantized_params=True), Transformer Engine's fp8_weight_caching.

Eagerly, is_first_microbatch=False reuses the FP8 weight cast at the step's first microbatch.
A graph cannot choose at replay whether a cast runs, so a captured forward always casts, then
keeps on the device the bytes the replay asks for: each tensor of the fresh FP8 weight becomes
the kept copy where the `skip` flag is set (a later microbatch), and the kept copy is refreshed
from it. The copy is one per cached weight (per module and GEMM), shared by every graph that
casts that weight, so the graph of a later microbatch reads what the first microbatch's graph
cast. The flag is set before each replay from the call's is_first_microbatch.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["WeightCaching", "active_caching", "caching_weights"]


class WeightCaching:
    """The skip flag of one make_graphed_callables call and the weights' kept copies (alive
    as long as the graphs that read them)."""

    __slots__ = ("kept", "skip")

    def __init__(self, device: torch.device) -> None:
        self.skip = torch.zeros((), dtype=torch.bool, device=device)
        self.kept: dict[int, tuple[list, list[torch.Tensor]]] = {}

    def set_first_microbatch(self, first) -> None:
        """Before a replay: cast the weights (first=True) or keep the last cast (False)."""
        if not isinstance(first, bool):
            raise ValueError(
                "a graph captured with cache_quantized_params=True (fp8_weight_caching) needs "
                f"is_first_microbatch=True or False at each call, got {first!r}"
            )
        self.skip.fill_(not first)

    def prepare(self, cache: list, storage) -> list[torch.Tensor]:
        """The kept copies for the FP8 weight of the one-element `cache` (shaped as the
        tensors of `storage`), made on first use. Made during the warm-up (outside the graphs'
        memory pool) where the weight is cast there, which keeps them apart from the memory
        the captures hand out and take back."""
        tensors = [_raw(t) for t in storage.get_data_tensors() if t is not None]
        entry = self.kept.get(id(cache))
        if (
            entry is None
            or entry[0] is not cache
            or [k.shape for k in entry[1]] != [t.shape for t in tensors]
        ):
            entry = self.kept[id(cache)] = (cache, [torch.empty_like(t) for t in tensors])
        return entry[1]

    def keep(self, cache: list, storage) -> None:
        """While capturing: the tensors of `storage` (the FP8 weight just cast for the
        one-element `cache`) become, at each replay, the kept copy (skip) or the fresh cast,
        which is then kept."""
        tensors = [_raw(t) for t in storage.get_data_tensors() if t is not None]
        for fresh, kept in zip(tensors, self.prepare(cache, storage), strict=True):
            torch.where(self.skip, kept, fresh, out=fresh)
            kept.copy_(fresh)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """t, or its bytes for one-byte float formats (FP8, E8M0 scales) torch.where lacks."""
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t


_ACTIVE: list[WeightCaching | None] = [None]


def active_caching() -> WeightCaching | None:
    """The WeightCaching of the capture in progress (None: none, or no weight caching)."""
    return _ACTIVE[0]


@contextlib.contextmanager
def caching_weights(caching: WeightCaching | None):
    """The warm-up and captures inside keep their FP8 weights with `caching` (None: cast at
    every replay)."""
    previous = _ACTIVE[0]
    _ACTIVE[0] = caching
    try:
        yield
    finally:
        _ACTIVE[0] = previous
