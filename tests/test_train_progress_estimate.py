"""Tests of what `python -m torchte.train` prints before and at the start of each recipe's run:
the estimate of its time (before its first validation) and progress from its first step."""

from __future__ import annotations

import io
import math
import re
import sys
from pathlib import Path

import pytest
from test_train import losses, tiny, write_corpus

from torchte.train import cli, estimate, loop, progress, runner
from torchte.train.config import RunConfig


def _config(steps: int, eval_every: int, stop_at: int | None = None) -> RunConfig:
    return RunConfig(
        ("bf16",), "cpu", steps, 2, 1e-3, 1, 0, 1, eval_every, 2, None, 1, Path("."),
        stop_at=stop_at,
    )  # fmt: skip


def test_estimate_comes_before_the_first_validation_and_progress_from_step_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Off a terminal, with rows logged every 5 steps: the estimate is printed before step 0's
    validation starts, and a progress line follows the first step."""
    printed = io.StringIO()  # stdout and stderr in the order written
    monkeypatch.setattr(sys, "stdout", printed)
    monkeypatch.setattr(sys, "stderr", printed)
    at_validation = []
    evaluate = loop.Trainer.evaluate

    def recording_evaluate(self: loop.Trainer, batches=None) -> float:
        if batches is None:  # a validation (the estimate times one batch)
            at_validation.append(printed.getvalue())
        return evaluate(self, batches)

    monkeypatch.setattr(loop.Trainer, "evaluate", recording_evaluate)
    args = tiny(write_corpus(tmp_path), tmp_path / "out", "--recipe", "bf16", "--log-every", "5")
    cli.train(args)
    lines = printed.getvalue().splitlines()
    (line,) = [i for i, text in enumerate(lines) if "estimate:" in text]
    assert re.fullmatch(
        r"\[bf16\] estimate: \d+:\d\d for 6 steps \(~[\d.]+ m?s each\) and 3 validations "
        r"\(~[\d.]+ m?s each\), from a timed forward pass; validating step 0 first",
        lines[line],
    )
    assert lines[line] in at_validation[0]  # printed before step 0's validation ran
    steps = [text.split()[2] for text in lines if text.startswith("[bf16] step ")]
    assert steps == ["0/6", "1/6", "3/6", "5/6", "6/6"]  # step 1: not a logged row
    assert lines.index(next(t for t in lines if t.startswith("[bf16] step 0/6"))) > line
    assert re.match(r"\[bf16\] step 1/6 loss \d\.\d{4} ETA \d+:\d\d$", lines[line + 2])


def test_the_estimates_forward_passes_leave_the_losses_as_they_were(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = tiny(write_corpus(tmp_path), tmp_path / "out", "--recipe", "delayed", "--steps", "4")
    timed = cli.train(args)
    untimed = estimate.RunEstimate("delayed", 0.0, 4, 3, 2, True)
    monkeypatch.setattr(runner, "estimate_run", lambda trainer: untimed)
    assert losses(cli.train(args)) == losses(timed)  # the delayed scaling state too


def test_estimate_adds_steps_and_validations() -> None:
    guess = estimate.RunEstimate("fp32", 0.01, 30, 11, 8, fresh=True)
    assert guess.step_s == pytest.approx(0.03) and guess.validation_s == pytest.approx(0.08)
    assert guess.total_s == pytest.approx(30 * 0.03 + 11 * 0.08)
    assert guess.describe() == (
        "[fp32] estimate: 0:02 for 30 steps (~30 ms each) and 11 validations (~80 ms each), "
        "from a timed forward pass; validating step 0 first"
    )
    resumed = estimate.RunEstimate("fp32", 2.0, 100, 2, 8, fresh=False)
    assert resumed.describe() == (
        "[fp32] estimate: 10:32 for 100 steps (~6.0 s each) and 2 validations (~16 s each), "
        "from a timed forward pass"
    )


def test_validations_left_follow_the_schedule() -> None:
    assert estimate.validations_left(0, _config(8, 4)) == 3  # steps 0, 4, 8
    assert estimate.validations_left(4, _config(8, 4)) == 1  # resumed: step 8
    assert estimate.validations_left(0, _config(8, 3)) == 4  # 0, 3, 6 and the last, 8
    assert estimate.validations_left(0, _config(8, 4, stop_at=6)) == 2  # 0, 4


def test_eta_leaves_out_step_0s_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    bar = progress.Progress("fp32", 100, 0, io.StringIO())
    now[0] += 10.0  # step 0's validation
    bar.log({"step": 0, "train_loss": None, "val_loss": 5.5, "tokens_per_s": None})
    now[0] += 0.5  # step 1
    assert bar.eta(1) == pytest.approx(0.5 * 99)


def test_first_step_writes_a_line_off_a_terminal_once() -> None:
    stream = io.StringIO()
    bar = progress.Progress("fp32", 10, 0, stream)
    bar.update(1, lambda: 5.25, math.nan)  # the first step's speed is not measured
    bar.update(2, lambda: pytest.fail("the loss is read after the first step only"), 1.0)
    assert stream.getvalue().startswith("[fp32] step 1/10 loss 5.2500 ETA ")
    assert stream.getvalue().count("\n") == 1
    logged = io.StringIO()  # the first step's row logged: no second line for it
    bar = progress.Progress("fp32", 10, 0, logged)
    bar.log({"step": 1, "train_loss": 5.25, "val_loss": None, "tokens_per_s": 100.0})
    bar.update(1, lambda: pytest.fail("logged already"), 100.0)
    assert logged.getvalue().count("\n") == 1
