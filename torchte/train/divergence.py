"""A run whose loss became inf or nan: the error that stops it, and the step it happened at.

The training loop does not read the loss every step (on a GPU that would make the host wait
for the device each step); it checks the values it already reads: the mean training loss of a
logged row, the validation loss, and the losses a checkpoint records. When one is not finite,
the per-step losses kept since the last row (already computed) name the first bad step.
"""

from __future__ import annotations

import math

import torch

__all__ = ["Diverged", "first_non_finite"]


class Diverged(Exception):
    """The loss of a recipe's run became inf or nan: training cannot go on. Its message says
    which run, which step and what to try."""

    def __init__(self, label: str, step: int, kind: str, value: float, lr: float) -> None:
        """label: the run's name; kind: "training" or "validation"; lr: the peak learning rate
        (--lr)."""
        self.label, self.step, self.kind, self.value = label, step, kind, value
        super().__init__(
            f"[{label}] the {kind} loss became {value} at step {step}: the run diverged and "
            f"stops here, without a summary table; lower --lr (this run's: {lr:g}) or check "
            "the data (--data)"
        )


def first_non_finite(losses: list[torch.Tensor], last_step: int) -> tuple[int, float]:
    """(step, value) of the first inf or nan among `losses`, the per-step losses of the steps
    up to `last_step` (the last one's); (last_step, nan) when all are finite."""
    values = torch.stack(losses).tolist() if losses else []
    first = last_step - len(values) + 1
    for i, value in enumerate(values):
        if not math.isfinite(value):
            return first + i, value
    return last_step, math.nan
