"""The scan every fusion matcher shares: runs of consecutive steps replaced by one fused op."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["WINDOW", "replace_runs"]

WINDOW = 3  # the longest run any fusion takes


def replace_runs(steps: list, match: Callable) -> list:
    """steps: [(op, indices of its basic ops)]. Left to right, match(ops), ops the ops of the
    next WINDOW steps, returns (fused op, count) to replace the next `count` steps with the
    fused op (their indices joined), or None to keep the step and move one on."""
    out, i = [], 0
    while i < len(steps):
        found = match([op for op, _ in steps[i : i + WINDOW]])
        if found is None:
            out.append(steps[i])
            i += 1
            continue
        fused, count = found
        out.append((fused, [idx for step in steps[i : i + count] for idx in step[1]]))
        i += count
    return out
