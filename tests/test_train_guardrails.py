"""Tests of what `python -m torchte.train` refuses or reports so that a run never goes wrong
silently: --save paths that are folders, the command that continues a saved run, resuming under
another schedule, learning rates and losses that are not finite, and each recipe's own peak
memory (tiny runs on the CPU; helpers from test_train)."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

import pytest
import torch
from test_train import tiny, write_corpus

from torchte.train import checkpoint, cli, divergence, report, resume_command, runner


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    """test_train's corpus: a folder of a few UTF-8 text files (about 20 KB)."""
    return write_corpus(tmp_path)


@pytest.fixture
def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building a Trainer fails the test: the run must end before any training."""
    monkeypatch.setattr(runner, "Trainer", lambda *a, **k: pytest.fail("training started"))


def _refusal(argv: list[str]) -> str:
    """The message `cli.train(argv)` exits with (a message: exit status 1)."""
    with pytest.raises(SystemExit) as info:
        cli.train(argv)
    assert isinstance(info.value.code, str), info.value.code
    return info.value.code


def _table(out: str) -> list[str]:
    """The summary table's lines in printed output, through the note under it."""
    lines = out[out.index("recipe ") :].splitlines()
    return lines[: lines.index("") if "" in lines else len(lines)]


# -- --save to a folder, and what a save prints ---------------------------------------------------


@pytest.mark.parametrize("recipes", [("--recipe", "bf16"), ("--compare",)])
def test_save_to_an_existing_folder_is_refused_with_one_recipe_or_several(
    recipes: tuple[str, ...], no_training: None, corpus_dir: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "runs"
    folder.mkdir()
    message = _refusal([*tiny(corpus_dir, tmp_path / "out", *recipes), "--save", str(folder)])
    want = f"--save {folder}: {folder} is a folder; give a file path, such as {folder / 'ckpt.pt'}"
    if recipes[0] == "--recipe":  # as before
        assert message == want
        return
    inside = f"{folder / 'ckpt-bf16.pt'} and {folder / 'ckpt-delayed.pt'}"
    assert message == f"{want} (written as {inside})"
    assert not (tmp_path / "runs-bf16").exists()
    # checkpoints an earlier run wrote beside the folder: the message says how to go on from them
    for name in ("bf16", "delayed"):
        (tmp_path / f"runs-{name}").write_bytes(b"saved")
    message = _refusal([*tiny(corpus_dir, tmp_path / "out", *recipes), "--save", str(folder)])
    earlier = f"{tmp_path / 'runs-bf16'} and {tmp_path / 'runs-delayed'}"
    go_on = f"to continue from {earlier}, pass --resume {folder}"
    assert message == f"{want} (written as {inside}); {go_on}"


def test_fsdp_save_to_an_existing_folder_is_refused_with_several_recipes(
    corpus_dir: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "runs"
    folder.mkdir()
    _, config = cli.parse_args([*tiny(corpus_dir, tmp_path / "out"), "--save", str(folder)])
    config = dataclasses.replace(config, fsdp=True)  # --fsdp itself needs torchrun
    with pytest.raises(SystemExit) as info:
        cli.check_outputs(config)
    assert info.value.code == (
        f"--save {folder}: {folder} is a folder, and with 2 recipes their checkpoint folders "
        f"would go beside it ({tmp_path / 'runs-bf16'} and {tmp_path / 'runs-delayed'}); give a "
        f"new path, such as {folder / 'ckpt'} (written as {folder / 'ckpt-bf16'} and "
        f"{folder / 'ckpt-delayed'})"
    )
    cli.check_outputs(dataclasses.replace(config, recipes=("bf16",)))  # an empty folder: fine


def test_a_save_prints_its_path_and_the_command_that_continues_it(
    corpus_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    ckpt = tmp_path / "my run" / "ckpt.pt"  # a space: the command quotes it
    args = [*tiny(corpus_dir, tmp_path / "out", "--compare"), "--save", str(ckpt)]
    cli.train([*args, "--stop-at", "3"])
    out = capsys.readouterr().out
    for name in ("bf16", "delayed"):
        path = tmp_path / "my run" / f"ckpt-{name}.pt"
        assert f"[{name}] checkpoint of step 3 saved to {path}\n" in out
    line = out.splitlines()[-1]
    head = "to continue to step 6 (--steps): " + cli.build_parser().prog + " "
    assert line.startswith(head) and shlex.quote(str(ckpt)) in line
    command = shlex.split(line.removeprefix(head))
    assert command == [*args, "--resume", str(ckpt)]  # --stop-at left out
    resumed = cli.train(command)  # the command as printed continues the run
    assert [r.steps for r in resumed] == [6, 6]
    assert capsys.readouterr().out.splitlines()[-1] == (
        "the checkpoints are at the end of the schedule (step 6 of --steps 6): nothing is left to "
        "resume; to train longer, start a new run with a larger --steps"
    )


def test_resume_command_drops_resume_and_stop_at_in_every_spelling() -> None:
    argv = ["--steps", "8", "--res", "old.pt", "--stop-at=3", "--stop", "4", "--save", "a b.pt"]
    got = resume_command.resume_command(argv, Path("a b.pt"), "torchte-train")
    assert got == "torchte-train --steps 8 --save 'a b.pt' --resume 'a b.pt'"
    got = resume_command.resume_command(["--fsdp"], Path("ck"), "torchte-train", ranks=4)
    assert got == "torchrun --nproc-per-node 4 -m torchte.train --fsdp --resume ck"


# -- resuming under another schedule -------------------------------------------------------------


def test_resume_under_another_schedule_is_refused_saying_what_continues_it(
    corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = tmp_path / "run.pt"
    args = tiny(corpus_dir, tmp_path / "out", "--recipe", "bf16")  # --steps 6: warmup 1
    args += ["--save", str(ckpt)]
    cli.train([*args, "--stop-at", "3"])
    monkeypatch.setattr(runner, "Trainer", lambda *a, **k: pytest.fail("training started"))
    resume = [*args, "--resume", str(ckpt)]
    assert _refusal([*resume, "--steps", "20"]) == (
        f"--resume {ckpt}: this run's learning-rate schedule differs from the checkpoint's: "
        "--steps 20 (the checkpoint's: 6), --warmup 2 (the checkpoint's: 1), which would change "
        "its learning rates from step 4 on; pass --steps 6 --warmup 1 to continue the same "
        "schedule (another schedule needs a new run, without --resume)"
    )
    assert "--lr 0.001 (the checkpoint's: 0.002)" in _refusal([*resume, "--lr", "1e-3"])
    assert _refusal([*resume, "--steps", "3"]) == (
        f"--resume {ckpt}: the checkpoint is already at step 3, so --steps 3 leaves nothing to "
        "train; pass --steps 6 (its schedule's) to continue it"
    )
    assert _refusal([*resume, "--stop-at", "2"]) == (
        f"--resume {ckpt}: the checkpoint is already at step 3, so --stop-at 2 leaves nothing to "
        "train; pass a --stop-at between 4 and 6, or leave it out"
    )
    monkeypatch.undo()
    cli.train(resume)  # the same schedule: on to step 6, saved
    finished = (
        f"--resume {ckpt}: the checkpoint is already at step 6, the end of its schedule "
        "(--steps 6): nothing is left to train"
    )
    longer = "to train longer, start a new run with a larger --steps (without --resume)"
    assert _refusal(resume) == f"{finished}; {longer}"
    assert _refusal([*resume, "--steps", "12"]).startswith(finished)


def test_checkpoint_without_its_schedule_resumes_under_this_runs(
    capsys: pytest.CaptureFixture,
) -> None:
    schedule = {"steps": 8, "warmup": 1, "lr": 2e-3}
    checkpoint.check_schedule({"step": 3}, Path("old.pt"), schedule, None)
    assert capsys.readouterr().out == (
        "note: --resume old.pt does not record the schedule it was trained under; its learning "
        "rates from step 4 on follow this run's --steps 8\n"
    )


# -- learning rates and losses that are not finite ---------------------------------------------


@pytest.mark.parametrize("lr", ["inf", "-inf", "nan", "1e400", "fast", "0", "-1e-3"])
def test_learning_rate_must_be_a_finite_positive_number(
    lr: str, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.parse_args(["--device", "cpu", f"--lr={lr}"])  # =: "-1e-3" is not an option
    assert info.value.code == 2
    err = capsys.readouterr().err
    if lr == "fast":
        assert f"argument --lr: expected a number, got {lr!r}" in err
    elif lr in ("0", "-1e-3"):
        assert f"--lr must be positive, got {float(lr)}" in err
    else:
        assert f"argument --lr: must be a finite number (such as 1e-3), got {lr!r}" in err


def test_a_loss_that_becomes_nan_stops_the_run_without_a_table(
    corpus_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "out"
    message = _refusal(tiny(corpus_dir, out, "--compare", "--lr", "1e30"))
    assert message.startswith("[bf16] the training loss became ")  # the first recipe: no more
    value, rest = message.removeprefix("[bf16] the training loss became ").split(" ", 1)
    assert value in ("nan", "inf")
    assert rest == (
        "at step 2: the run diverged and stops here, without a summary table; lower --lr "
        "(this run's: 1e+30) or check the data (--data)"
    )
    printed = capsys.readouterr()
    assert "recipe " not in printed.out and "[delayed]" not in printed.out + printed.err
    assert not (out / "losses.csv").exists()


def test_the_first_non_finite_step_is_found_among_the_window() -> None:
    window = [torch.tensor(2.0), torch.tensor(float("inf")), torch.tensor(float("nan"))]
    assert divergence.first_non_finite(window, 9) == (8, float("inf"))


# -- peak memory and the note under the table ------------------------------------------------


def test_cpu_peak_memory_is_each_recipes_own() -> None:
    cpu = torch.device("cpu")
    assert report.reset_peak_memory(cpu)  # Linux: VmHWM resets
    held = torch.ones(256 * 2**20, dtype=torch.uint8)  # 256 MiB written, so resident
    del held
    first, kind = report.peak_memory(cpu, since_reset=True)
    assert report.reset_peak_memory(cpu)
    second, _ = report.peak_memory(cpu, since_reset=True)
    assert kind == "peak RSS" and second < first - 128 * 2**20  # the 256 MiB was the first's


def test_cpu_peak_memory_says_process_peak_where_it_cannot_be_reset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(report, "CLEAR_REFS", tmp_path / "missing" / "clear_refs")
    assert not report.reset_peak_memory(torch.device("cpu"))
    peak, kind = report.peak_memory(torch.device("cpu"), since_reset=False)
    assert kind == "process peak RSS" and peak > 10 * 2**20


def test_table_of_a_run_without_fp8_explains_no_fp8(
    corpus_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    cli.train(tiny(corpus_dir, tmp_path / "out", "--recipe", "bf16", "--steps", "2"))
    table = _table(capsys.readouterr().out)
    assert table[2].split()[:2] == ["bf16", "bf16"] and table[2].endswith("(peak RSS)")
    assert table[3] == "compute bf16 (--compute-dtype bf16); --compute-dtype bf16|fp32 chooses"
