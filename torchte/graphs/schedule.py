"""The order in which make_graphed_callables runs and captures forward and backward passes.

Without `_order` every callable is one forward pass: forwards are captured first to last,
backwards last to first, as a training step runs them.

With `_order` (Transformer Engine's schedule for interleaved pipeline parallelism, as
Megatron-Core runs it) the callables are the layers of C model chunks, chunk after chunk,
`_num_layers_per_chunk[c]` layers in chunk c (default: the same number in every chunk), and
each chunk runs M microbatches. `_order` lists 2 * C * M chunk ids, 1-based: +c runs chunk c's
next microbatch forward (its layers first to last), -c its oldest microbatch not yet run
backward (its layers last to first). sample_args holds one entry per forward pass, chunk-major,
then microbatch, then layer: pass (c, m, l) is sample `prefix[c] * M + m * L[c] + l`, where
prefix[c] counts the layers of the chunks before c. Each forward pass gets its own graphs.

With `_reuse_graph_input_output_buffers` a forward pass whose sample tensors have the same
shapes, dtypes, layouts and requires_grad as those of a pass that already ran backward takes that
pass's sample tensors (its static inputs), as Transformer Engine reorganizes them: the two
never hold live data at the same time when replays follow the captured order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["Schedule", "pipeline_schedule", "plain_schedule", "reused_samples"]


class Schedule(NamedTuple):
    """callable_of[p]: the callable forward pass p runs; steps: (forward?, pass) in the order
    passes run (warm-up) and are captured; layers: the layers of each chunk (() without
    _order); microbatches: M (1 without _order)."""

    callable_of: tuple[int, ...]
    steps: tuple[tuple[bool, int], ...]
    layers: tuple[int, ...] = ()
    microbatches: int = 1


def plain_schedule(num_callables: int) -> Schedule:
    """One pass per callable: forwards first to last, then backwards last to first."""
    passes = range(num_callables)
    steps = [(True, p) for p in passes] + [(False, p) for p in reversed(passes)]
    return Schedule(tuple(passes), tuple(steps))


def pipeline_schedule(order, layers_per_chunk, num_callables: int, num_samples: int) -> Schedule:
    """The schedule `_order` and `_num_layers_per_chunk` describe (see the module docstring),
    checked against the number of callables and of sample argument tuples (ValueError)."""
    order = _checked_order(order)
    chunks = max(order)
    microbatches = len(order) // (2 * chunks) if chunks > 0 else 0
    if microbatches < 1 or 2 * chunks * microbatches != len(order) or min(order) < -chunks:
        raise ValueError(
            f"_order must hold each chunk id 1..{max(chunks, 1)} as often forward (+c) as "
            f"backward (-c), the same number of times for every chunk; got {list(order)}"
        )
    layers = _layers(layers_per_chunk, chunks, microbatches, num_samples)
    if sum(layers) != num_callables:
        raise ValueError(
            f"_num_layers_per_chunk {list(layers)} makes {sum(layers)} layers, but "
            f"{num_callables} callables were given (one per layer)"
        )
    if num_samples != sum(layers) * microbatches:
        raise ValueError(
            f"sample_args must give one tuple per forward pass: {sum(layers)} layers x "
            f"{microbatches} microbatches = {sum(layers) * microbatches}, got {num_samples}"
        )
    prefix = [0]
    for count in layers:
        prefix.append(prefix[-1] + count)
    steps = _steps(order, layers, prefix, microbatches)
    callable_of = [0] * num_samples
    for chunk, count in enumerate(layers):
        for micro in range(microbatches):
            for layer in range(count):
                callable_of[prefix[chunk] * microbatches + micro * count + layer] = (
                    prefix[chunk] + layer
                )
    return Schedule(tuple(callable_of), steps, layers, microbatches)


def _checked_order(order) -> tuple[int, ...]:
    if not isinstance(order, Sequence) or isinstance(order, str) or not order:
        raise TypeError(f"_order must be a non-empty list of chunk ids, got {order!r}")
    for entry in order:
        if isinstance(entry, float) and entry < 0 and math.ceil(entry) - entry == 0.5:
            raise NotImplementedError(
                f"_order entry {entry}: a separate weight-gradient pass (delay_wgrad_compute) "
                "is not implemented in torchte's make_graphed_callables yet"
            )
        if isinstance(entry, bool) or not isinstance(entry, int) or entry == 0:
            raise ValueError(f"_order entries must be nonzero ints (+c / -c), got {entry!r}")
    return tuple(order)


def _layers(layers_per_chunk, chunks: int, microbatches: int, num_samples: int) -> tuple:
    """The number of layers in each chunk (_num_layers_per_chunk, or the same in each)."""
    if layers_per_chunk is None:
        count, rest = divmod(num_samples, chunks * microbatches)
        if count < 1 or rest:
            raise ValueError(
                f"{num_samples} sample argument tuples do not split evenly over {chunks} "
                f"chunks x {microbatches} microbatches; give _num_layers_per_chunk"
            )
        return (count,) * chunks
    if isinstance(layers_per_chunk, int) and not isinstance(layers_per_chunk, bool):
        layers_per_chunk = [layers_per_chunk] * chunks
    layers = tuple(layers_per_chunk)
    if len(layers) != chunks or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in layers
    ):
        raise ValueError(
            f"_num_layers_per_chunk must be an int >= 1 or {chunks} of them (one per chunk), "
            f"got {layers_per_chunk!r}"
        )
    return layers


def _steps(order, layers, prefix, microbatches: int) -> tuple[tuple[bool, int], ...]:
    """(forward?, pass) for every layer of every _order entry; ValueError for a backward
    before its forward."""
    runs = {True: [0] * len(layers), False: [0] * len(layers)}
    steps = []
    for entry in order:
        forward, chunk = entry > 0, abs(entry) - 1
        micro = runs[forward][chunk]
        runs[forward][chunk] += 1
        if micro >= microbatches or (not forward and micro >= runs[True][chunk]):
            raise ValueError(
                f"_order runs chunk {chunk + 1} {'forward' if forward else 'backward'} more "
                "often than its forwards allow (a backward needs its forward first)"
            )
        first = prefix[chunk] * microbatches + micro * layers[chunk]
        passes = range(first, first + layers[chunk])
        steps += [(forward, p) for p in (passes if forward else reversed(passes))]
    return tuple(steps)


def _signature(args: Sequence, kwargs: dict) -> tuple:
    """What a sample must match to take over another's tensors: each tensor's shape, dtype,
    layout and requires_grad (keyword ones with their names)."""

    def sig(t):
        return None if t is None else (tuple(t.shape), t.dtype, t.layout, t.requires_grad)

    return tuple(sig(t) for t in args) + tuple((k, sig(v)) for k, v in sorted(kwargs.items()))


def reused_samples(schedule: Schedule, samples: list) -> list:
    """samples (one (args, kwargs) per pass) with Transformer Engine's input-buffer reuse: a
    pass takes the sample tensors of a pass of the same signature whose chunk's backward
    already ran (the oldest such first); the others keep their own."""
    samples = list(samples)
    pending: set[int] = set()  # passes run forward whose backward did not run yet
    free: dict[tuple, list[int]] = {}  # signature -> passes whose backward ran
    for forward, p in schedule.steps:
        if forward:
            key = _signature(*samples[p])
            if free.get(key):
                samples[p] = samples[free[key].pop(0)]
            pending.add(p)
        elif p in pending:
            pending.remove(p)
            free.setdefault(_signature(*samples[p]), []).append(p)
    return samples
