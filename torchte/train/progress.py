"""A progress bar on stderr: step/total, loss, tokens/s, ETA of the whole run.

The ETA counts the steps left in this recipe's run and in the recipes still to run after it,
at the wall time per step of this run so far (evaluation included, the validation at step 0
left out): the recipes after it are assumed to run at its pace until they start and measure
their own.

On a terminal the bar redraws in place at most `REFRESH_PER_S` times a second (reading the
loss only then, so a GPU is not made to wait every step), from the first step on. Elsewhere (a
file, a pipe, CI) it writes one plain line per logged row instead, and one after the run's
first step, so that a slow run shows its pace at once.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import TextIO

REFRESH_PER_S = 4
BAR_WIDTH = 24


def format_duration(seconds: float) -> str:
    """'1:02:03', '2:03' or '0:05'."""
    seconds = max(round(seconds), 0)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Progress:
    """The progress of one recipe's run, steps first_step+1 .. end (end = total unless it stops
    early), with `later_steps` steps of other recipes to run after it."""

    def __init__(
        self,
        label: str,
        total: int,
        first_step: int,
        stream: TextIO | None = None,
        end: int | None = None,
        later_steps: int = 0,
    ) -> None:
        self.label, self.total, self.first_step = label, total, first_step
        self.end = total if end is None else end
        self.later_steps = later_steps
        self.stream = sys.stderr if stream is None else stream
        isatty = getattr(self.stream, "isatty", None)
        self.interactive = bool(isatty and isatty())
        self.start = time.perf_counter()
        self.last_draw = float("-inf")
        self.last_line = -1  # the step of the last plain line written
        self.val_loss: float | None = None

    def eta(self, step: int) -> float:
        """Seconds left in the whole run (this recipe's steps to `end` and the later recipes'),
        at the wall time per step of the steps run so far in this process."""
        done = step - self.first_step
        if done <= 0:
            return float("nan")
        left = self.end - step + self.later_steps
        return (time.perf_counter() - self.start) / done * left

    def update(self, step: int, loss: Callable[[], float], tokens_per_s: float) -> None:
        """Redraw the bar (on a terminal, when due); `loss` is read only when drawn. Off a
        terminal, a plain line after the run's first step unless its row was logged."""
        if not self.interactive:
            if step == self.first_step + 1 and self.last_line != step:
                self._write_line(step, loss(), None, tokens_per_s)
            return
        now = time.perf_counter()
        if now - self.last_draw < 1.0 / REFRESH_PER_S and step != self.end:
            return
        self.last_draw = now
        filled = int(BAR_WIDTH * step / self.total)
        bar = "#" * filled + "-" * (BAR_WIDTH - filled)
        val = f" val {self.val_loss:.4f}" if self.val_loss is not None else ""
        speed = f"{tokens_per_s:,.0f}" if math.isfinite(tokens_per_s) else "-"
        eta = self.eta(step)
        text = (
            f"[{self.label}] |{bar}| {step}/{self.total} loss {loss():.4f}{val} "
            f"{speed} tok/s ETA {format_duration(eta) if math.isfinite(eta) else '-'}"
        )
        self.stream.write("\r" + text + "\x1b[K")
        self.stream.flush()

    def log(self, row: dict) -> None:
        """A logged row: remembered for the bar, or written as one line off a terminal. The
        row of the run's first step (step 0's validation) restarts the clock of the ETA."""
        if row["step"] == self.first_step:
            self.start = time.perf_counter()
        if row["val_loss"] is not None:
            self.val_loss = row["val_loss"]
        if not self.interactive:
            self._write_line(row["step"], row["train_loss"], row["val_loss"], row["tokens_per_s"])

    def _write_line(
        self, step: int, train: float | None, val: float | None, speed: float | None
    ) -> None:
        """One plain line: step/total, the losses, tokens/s and the ETA where known."""
        train_text = "" if train is None else f" loss {train:.4f}"
        val_text = "" if val is None else f" val {val:.4f}"
        known = speed is not None and math.isfinite(speed)
        speed_text = f" {speed:,.0f} tok/s" if known else ""
        eta = self.eta(step)
        eta_text = f" ETA {format_duration(eta)}" if math.isfinite(eta) else ""
        head = f"[{self.label}] step {step}/{self.total}"
        self.stream.write(f"{head}{train_text}{val_text}{speed_text}{eta_text}\n")
        self.stream.flush()
        self.last_line = step

    def close(self) -> None:
        """End the bar's line (on a terminal)."""
        if self.interactive:
            self.stream.write("\n")
            self.stream.flush()
