"""How long a recipe's run will take, estimated before it starts (the line printed before its
first validation, which on a slow configuration may itself take minutes).

The estimate rests on one timed forward pass of a validation batch (after one more to warm up):
a training step does a forward and a backward of about twice its work (the optimizer's update
is small beside them), so it costs about FORWARDS_PER_STEP forward passes, and a validation
costs one per validation batch. It is rough (the first steps compile and warm up; FP8's casts
weigh more in the backward) and is said to be an estimate; the progress bar's ETA, measured
from the first training step on, replaces it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .config import RunConfig
from .progress import format_duration
from .timing import format_seconds

if TYPE_CHECKING:
    from .loop import Trainer

FORWARDS_PER_STEP = 3


@dataclass(frozen=True)
class RunEstimate:
    """The time a recipe's run will take, from the time of one forward pass."""

    label: str
    """The recipe's label, as its progress lines give it."""
    forward_s: float
    """Seconds of one forward pass of a batch (no gradients)."""
    steps: int
    """Training steps still to run."""
    validations: int
    """Validations still to run (step 0's included on a fresh run)."""
    eval_batches: int
    """Batches of each validation."""
    fresh: bool
    """Whether the run starts at step 0 (with a validation) rather than from a checkpoint."""

    @property
    def step_s(self) -> float:
        """Estimated seconds of a training step."""
        return FORWARDS_PER_STEP * self.forward_s

    @property
    def validation_s(self) -> float:
        """Estimated seconds of a validation."""
        return self.eval_batches * self.forward_s

    @property
    def total_s(self) -> float:
        """Estimated seconds of the whole run of this recipe."""
        return self.steps * self.step_s + self.validations * self.validation_s

    def describe(self) -> str:
        """One line: the estimate, what it is made of, and what comes first."""
        first = "; validating step 0 first" if self.fresh else ""
        return (
            f"[{self.label}] estimate: {format_duration(self.total_s)} for {self.steps} steps "
            f"(~{format_seconds(self.step_s)} each) and {self.validations} validations "
            f"(~{format_seconds(self.validation_s)} each), from a timed forward pass{first}"
        )


def validations_left(start: int, config: RunConfig) -> int:
    """Validations a run from step `start` to config.last_step makes: at step 0 of a fresh run,
    every config.eval_every steps and at config.steps (as Trainer._train does)."""
    later = range(start + 1, config.last_step + 1)
    scheduled = sum(1 for step in later if step % config.eval_every == 0 or step == config.steps)
    return scheduled + (start == 0)


def time_forward(trainer: Trainer) -> float:
    """Seconds of a forward pass of one validation batch through the trainer's model (as its
    validation runs it, leaving the training state as it was): the second of two, the first
    warming up."""
    batches = trainer.val_batches[:1]
    trainer.evaluate(batches)
    start = time.perf_counter()
    trainer.evaluate(batches)  # ends reading the loss: the device's work is done
    return time.perf_counter() - start


def estimate_run(trainer: Trainer) -> RunEstimate:
    """The estimate of `trainer`'s run from its current step; takes two forward passes."""
    config = trainer.config
    return RunEstimate(
        label=trainer.label,
        forward_s=time_forward(trainer),
        steps=config.last_step - trainer.step,
        validations=validations_left(trainer.step, config),
        eval_batches=len(trainer.val_batches),
        fresh=trainer.step == 0,
    )
