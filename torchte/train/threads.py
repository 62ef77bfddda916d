"""The number of CPU threads torch computes with in a run on the CPU (--threads).

torch's default is one OpenMP thread per core. On a machine where other programs also run,
those threads wait for each other at the end of every parallel region, and a sibling that
another process keeps off its core stalls them all: a training step can take 10-100x longer
than with one thread. `--threads auto` times a few matrix products of about the model's size at
one thread and at torch's default count (timing.py; the median of a few runs each, so that
one lucky run does not decide) and keeps one thread unless the default count is clearly faster.
An OMP_NUM_THREADS set in the environment is kept as it is; on a GPU the count is left alone.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
from dataclasses import dataclass

import torch

from .timing import format_seconds, probe_shape, time_in_turn

# torch's thread count when the program started (one per core, or OMP_NUM_THREADS), before any
# choice of this module changed it
DEFAULT_THREADS = torch.get_num_threads()
MIN_SPEEDUP = 1.4  # the default count must be this much faster than one thread to be chosen
PROBE_SPLITS = 4  # the probe's rows in this many products: as many parallel regions to wait at


@dataclass(frozen=True)
class ThreadChoice:
    """The CPU thread count of a run and why it was chosen."""

    count: int | None
    """Threads for torch.set_num_threads; None: torch's default, left alone (a GPU run)."""
    reason: str
    """Why, for the run's header line."""


def parse_threads(text: str) -> str | int:
    """The value of --threads: "auto" or a positive int (argparse's type function)."""
    if text == "auto":
        return text
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(
            f"give auto or a number of threads of 1 or more, got {text!r}"
        )
    return count


def choose_threads(
    requested: str | int, device: str, hidden: int = 128, ffn: int = 512
) -> ThreadChoice:
    """The thread count for --threads `requested` ("auto" or a count) on `device`; the CPU's
    probe multiplies (tokens, hidden) by (hidden, ffn), both clamped (timing.probe_shape)."""
    if requested != "auto":
        return ThreadChoice(int(requested), "--threads")
    if device != "cpu":
        return ThreadChoice(None, "auto: torch's default on a GPU run")
    if os.environ.get("OMP_NUM_THREADS"):
        return ThreadChoice(
            torch.get_num_threads(), f"auto: OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
        )
    if DEFAULT_THREADS == 1:
        return ThreadChoice(1, "auto: torch's default on this CPU")
    one_s, many_s = thread_probe_times(*probe_shape(hidden, ffn), DEFAULT_THREADS)
    count = DEFAULT_THREADS if many_s * MIN_SPEEDUP <= one_s else 1
    return ThreadChoice(
        count,
        f"auto: a probe took {format_seconds(one_s)} at 1 thread, {format_seconds(many_s)} "
        f"at {DEFAULT_THREADS}",
    )


@functools.cache
def thread_probe_times(m: int, k: int, n: int, threads: int) -> tuple[float, float]:
    """Seconds of PROBE_SPLITS fp32 products that make up a (m, k) @ (k, n) one, at 1 thread
    and at `threads` threads: the median of a few runs each (timing.time_in_turn); measured
    once per shape and count. torch's thread count is as before afterwards."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    parts = a.chunk(PROBE_SPLITS)

    def products() -> None:
        for part in parts:
            torch.mm(part, b)

    counts = (1, threads)
    before = torch.get_num_threads()
    try:
        return time_in_turn(
            (products, products), lambda i: torch.set_num_threads(counts[i]), statistics.median
        )
    finally:
        torch.set_num_threads(before)


def describe_threads(count: int | None, reason: str) -> str:
    """'; threads 1 (auto: ...)', what the run's header adds; '' when the count is left
    alone."""
    return "" if count is None else f"; threads {count} ({reason})"


@contextlib.contextmanager
def run_threads(count: int | None):
    """torch computes with `count` CPU threads inside (None: its count as it is), and with the
    count it had before afterwards."""
    before = torch.get_num_threads()
    if count is not None and before != count:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
