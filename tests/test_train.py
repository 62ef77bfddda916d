"""Smoke tests of the README's main job, `python -m torchte.train`, at tiny sizes."""

from __future__ import annotations

import math

import pytest

from torchte import train

TINY = ["--steps", "4", "--batch", "16", "--width", "32", "--log-every", "2", "--device", "cpu"]


@pytest.mark.parametrize("recipe", ["bf16", "fp32", "delayed", "current"])
def test_each_recipe_trains_and_reports(recipe: str, capsys: pytest.CaptureFixture) -> None:
    results = train.main([*TINY, "--recipe", recipe])
    assert [r.recipe for r in results] == [recipe]
    assert math.isfinite(results[0].final_loss)
    out = capsys.readouterr().out
    assert "step     2/4" in out
    assert out.rstrip().splitlines()[-1].startswith(recipe)


def test_default_runs_three_recipes_and_loss_falls() -> None:
    results = train.main(["--steps", "60", "--batch", "32", "--width", "64", "--device", "cpu"])
    assert [r.recipe for r in results] == ["bf16", "delayed", "current"]
    first = train.main(["--steps", "1", "--batch", "32", "--width", "64", "--device", "cpu"])
    for trained, start in zip(results, first, strict=True):
        assert trained.final_loss < start.final_loss


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "0"], "--steps: must be positive"),
        (["--width", "30"], "--width: must be a positive multiple of 16"),
        (["--lr", "-1"], "--lr: must be positive"),
        (["--recipe", "fp4"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_with_a_clear_message(
    args: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as info:
        train.parse_args(args)
    assert info.value.code == 2
    assert message in capsys.readouterr().err
