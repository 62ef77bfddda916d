"""Training throughput: tokens per second of the training steps alone."""

from __future__ import annotations

import time


class Throughput:
    """Training tokens per second: the wall time between steps, with evaluation and saving
    left out (restart() after them)."""

    def __init__(self, tokens_per_step: int) -> None:
        self.tokens_per_step = tokens_per_step
        self.last = time.perf_counter()
        self.window_tokens, self.window_s = 0, 0.0
        self.tokens, self.seconds = 0, 0.0

    def tick(self, counted: bool = True) -> None:
        """A step ended now; `counted`: it also counts toward rate()."""
        now = time.perf_counter()
        dt, self.last = now - self.last, now
        self.window_tokens, self.window_s = (
            self.window_tokens + self.tokens_per_step,
            dt + self.window_s,
        )
        if counted:
            self.tokens, self.seconds = self.tokens + self.tokens_per_step, self.seconds + dt

    def restart(self) -> None:
        """The time since the last tick was not training."""
        self.last = time.perf_counter()

    def window_rate(self) -> float:
        """Tokens/s of the steps since the last call (all of them counted)."""
        rate = self.window_tokens / self.window_s if self.window_s > 0 else float("nan")
        self.window_tokens, self.window_s = 0, 0.0
        return rate

    def rate(self) -> float:
        """Tokens/s of the counted steps so far (nan before the first)."""
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")
