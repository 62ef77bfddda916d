"""Short timing probes that settings of a run rest on: the compute dtype (precision.py) and the
CPU thread count (threads.py). Each compares two ways of doing the same work, run in turn so
that whatever else the machine does slows both alike, and stops early once the answer is clear.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

PROBE_ROWS = 1024  # enough rows that a probe times arithmetic, not call overhead
PROBE_DIMS = (128, 512)  # K and N of a probe's product: the model's, clamped to this range
PROBE_REPEATS = 7  # timed runs of each way at most
CLEAR_RATIO = 3.0  # after three runs each, a ratio beyond this (or its inverse) decides early


def probe_shape(hidden: int, ffn: int) -> tuple[int, int, int]:
    """(m, k, n) of a probe's (m, k) @ (k, n) product for a model of width `hidden` and MLP
    width `ffn`: PROBE_ROWS tokens, k and n clamped to PROBE_DIMS."""
    lo, hi = PROBE_DIMS
    return PROBE_ROWS, min(max(hidden, lo), hi), min(max(ffn, lo), hi)


def time_in_turn(
    work: Sequence[Callable[[], object]],
    before: Callable[[int], None] | None = None,
    summary: Callable[[list[float]], float] = min,
) -> tuple[float, float]:
    """Seconds of each of two ways of doing the same work: `summary` (the best by default)
    of up to PROBE_REPEATS timed runs each, alternating, after one untimed run each to warm up.
    `before(i)` runs off the clock before each run of way i (to switch a setting)."""
    runs: tuple[list[float], list[float]] = ([], [])
    for repeat in range(PROBE_REPEATS + 1):
        for i, run in enumerate(work):
            if before is not None:
                before(i)
            start = time.perf_counter()
            run()
            if repeat:  # run 0 sets up the kernels
                runs[i].append(max(time.perf_counter() - start, 1e-9))
        if repeat >= 3:
            ratio = summary(runs[1]) / summary(runs[0])
            if not 1 / CLEAR_RATIO < ratio < CLEAR_RATIO:
                break
    return summary(runs[0]), summary(runs[1])


def format_seconds(seconds: float) -> str:
    """A short time for a message: '0.85 ms', '290 ms', '2.4 s', '75 s'."""
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
