"""Tests of `python -m torchte.train`'s command line: the compute dtype, checks made before
training, Ctrl-C, and resume limits (tiny runs on the CPU; helpers from test_train)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from test_train import tiny, write_corpus

from torchte.train import cli, loop, precision, progress, runner


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    """test_train's corpus: a folder of a few UTF-8 text files (about 20 KB)."""
    return write_corpus(tmp_path)


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """bf16_slowdown answers 8.0 (an AVX2-only CPU) without timing; the shapes asked for."""
    asked = []

    def slowdown(m: int, k: int, n: int) -> float:
        asked.append((m, k, n))
        return 8.0

    monkeypatch.setattr(precision, "bf16_slowdown", slowdown)
    return asked


# -- the compute dtype ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("slowdown", "name", "reason"),
    [
        (8.0, "fp32", "auto: bf16 is emulated on this CPU, 8x slower than fp32"),
        (1.4, "fp32", "auto: bf16 is no faster than fp32 on this CPU"),
        (0.25, "bf16", "auto: this CPU runs bf16 4.0x faster than fp32"),
    ],
)
def test_auto_compute_dtype_is_what_the_cpu_runs_fast(
    slowdown: float, name: str, reason: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked = []
    monkeypatch.setattr(precision, "bf16_slowdown", lambda *shape: asked.append(shape) or slowdown)
    choice = precision.choose_compute_dtype("auto", "cpu", hidden=2048, ffn=64)
    assert (choice.name, choice.reason) == (name, reason)
    assert choice.dtype == {"bf16": torch.bfloat16, "fp32": torch.float32}[name]
    assert asked == [(1024, 512, 128)]  # the model's K and N, clamped to 128..512


def test_explicit_compute_dtype_wins_and_a_gpu_gets_bf16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(precision, "bf16_slowdown", lambda *shape: pytest.fail("no probe"))
    for name in ("bf16", "fp32"):
        choice = precision.choose_compute_dtype(name, "cpu")
        assert (choice.name, choice.reason) == (name, f"--compute-dtype {name}")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert precision.choose_compute_dtype("auto", "cuda").name == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert precision.choose_compute_dtype("auto", "cuda").name == "fp32"


def test_bf16_probe_measures_a_positive_ratio() -> None:
    ratio = precision.bf16_slowdown(64, 32, 48)
    assert 0 < ratio < float("inf")


def test_auto_fp32_run_says_so_and_never_claims_bf16(
    probe: list, corpus_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    results = cli.train(tiny(corpus_dir, tmp_path, "--compare", "--compute-dtype", "auto"))
    assert probe == [(1024, 128, 512)]  # the tiny model's hidden and ffn
    assert [r.recipe for r in results] == ["fp32", "delayed"]
    out = capsys.readouterr().out
    reason = "auto: bf16 is emulated on this CPU, 8x slower than fp32"
    assert f"run: fp32, delayed on cpu, compute fp32 ({reason});" in out
    table = out[out.index("recipe ") :].splitlines()
    assert [line.split()[:2] for line in table[2:4]] == [["fp32", "fp32"], ["delayed", "fp8+fp32"]]
    assert table[4].startswith(f"compute fp32 ({reason})")
    assert "bf16" not in "\n".join(table[:4])
    with (tmp_path / "losses.csv").open() as f:
        assert {row["recipe"] for row in csv.DictReader(f)} == {"fp32", "delayed"}


def test_resume_in_another_compute_dtype_names_the_option(corpus_dir: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "run.pt"
    args = tiny(corpus_dir, tmp_path, "--steps", "2", "--recipe", "bf16")
    cli.train([*args, "--compute-dtype", "fp32", "--save", str(ckpt)])
    assert torch.load(ckpt, weights_only=True)["compute_dtype"] == "fp32"
    with pytest.raises(SystemExit, match=r"computed in fp32, .* pass --compute-dtype fp32"):
        cli.train([*args, "--resume", str(ckpt)])


# -- checks made before the first step ----------------------------------------------------------


@pytest.fixture
def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building a Trainer fails the test: the run must end before any training."""
    monkeypatch.setattr(runner, "Trainer", lambda *a, **k: pytest.fail("training started"))


@pytest.mark.parametrize("option", ["--out", "--save"])
def test_unwritable_output_paths_are_refused_before_training(
    option: str, no_training: None, corpus_dir: Path, tmp_path: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    path = blocker / "sub" / ("ckpt.pt" if option == "--save" else "out")
    with pytest.raises(SystemExit) as info:
        cli.train([*tiny(corpus_dir, tmp_path / "out"), option, str(path)])
    message = str(info.value.code)  # a message: exit status 1
    assert message.startswith(f"{option} {path}: cannot write to the folder ")
    assert f"{blocker} is a file, not a folder; give a path in a folder you can write to" in message


def test_save_path_that_is_a_folder_is_refused(
    no_training: None, corpus_dir: Path, tmp_path: Path
) -> None:
    (tmp_path / "ckpt-bf16.pt").mkdir()
    args = [*tiny(corpus_dir, tmp_path, "--compare"), "--save", str(tmp_path / "ckpt.pt")]
    with pytest.raises(SystemExit, match=r"ckpt-bf16\.pt is a folder; give a file path"):
        cli.train(args)


def test_stop_at_past_steps_is_an_argument_error(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        cli.parse_args(["--device", "cpu", "--steps", "6", "--stop-at", "7"])
    assert info.value.code == 2
    assert "--stop-at 7 is past --steps 6" in capsys.readouterr().err


def test_resume_past_steps_or_stop_at_is_refused_before_training(
    corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = tmp_path / "run.pt"
    args = tiny(corpus_dir, tmp_path, "--compare", "--steps", "4", "--eval-every", "2")
    cli.train([*args, "--stop-at", "2", "--save", str(ckpt)])
    monkeypatch.setattr(runner, "Trainer", lambda *a, **k: pytest.fail("training started"))
    with pytest.raises(SystemExit, match=r"at step 2, so --steps 2 leaves nothing to train; pass"):
        cli.train([*args, "--steps", "2", "--resume", str(ckpt)])
    with pytest.raises(SystemExit, match=r"at step 2, so --stop-at 1 leaves nothing to train"):
        cli.train([*args, "--stop-at", "1", "--resume", str(ckpt)])
    (tmp_path / "run-delayed.pt").write_bytes(b"garbage")  # the second recipe's: found first
    with pytest.raises(SystemExit, match=r"run-delayed\.pt: not a readable checkpoint"):
        cli.train([*args, "--resume", str(ckpt)])


@pytest.mark.parametrize("content", ["random", "pickled object"])
def test_unreadable_resume_file_says_what_to_give(
    content: str, corpus_dir: Path, tmp_path: Path
) -> None:
    path = tmp_path / "bad.pt"
    if content == "random":
        path.write_bytes(bytes(range(256)) * 8)
    else:
        torch.save({"format": progress.Progress}, path)  # a class: not loadable weights-only
    with pytest.raises(SystemExit) as info:
        cli.train([*tiny(corpus_dir, tmp_path, "--recipe", "bf16"), "--resume", str(path)])
    message = str(info.value.code)
    assert message.startswith(f"--resume {path}: not a readable checkpoint")
    assert message.endswith("give a file written by --save")
    assert "weights_only" not in message


# -- progress over the whole run ----------------------------------------------------------------


def test_eta_counts_the_recipes_still_to_run(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    bar = progress.Progress("fp32", 400, 0, end=300, later_steps=400)
    alone = progress.Progress("fp32", 400, 0)
    now[0] = 110.0  # 50 steps in 10 s
    assert bar.eta(50) == pytest.approx(0.2 * (300 - 50 + 400))  # to --stop-at, then the rest
    assert alone.eta(50) == pytest.approx(0.2 * (400 - 50))


def test_each_recipe_counts_the_steps_of_those_after_it(
    corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = []

    class Recorder(progress.Progress):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append((self.label, self.first_step, self.end, self.later_steps))

    monkeypatch.setattr(runner, "Progress", Recorder)
    ckpt = tmp_path / "run.pt"
    args = tiny(corpus_dir, tmp_path, "--recipe", "current", "--compare", "--steps", "8")
    cli.train([*args, "--stop-at", "3", "--save", str(ckpt)])
    assert made == [("bf16", 0, 3, 3), ("current", 0, 3, 0)]
    made.clear()
    cli.train([*args, "--resume", str(ckpt)])
    assert made == [("bf16", 3, 8, 5), ("current", 3, 8, 0)]


# -- Ctrl-C --------------------------------------------------------------------------------------


def _interrupt_at(monkeypatch: pytest.MonkeyPatch, recipe: str, step: int) -> None:
    """Trainer.train_step raises KeyboardInterrupt inside step `step` of `recipe`."""
    original = loop.Trainer.train_step

    def train_step(self: loop.Trainer) -> torch.Tensor:
        if self.name == recipe and self.step + 1 == step:
            raise KeyboardInterrupt
        return original(self)

    monkeypatch.setattr(loop.Trainer, "train_step", train_step)


def _exit_status(argv: list[str]) -> int | str | None:
    """The status `cli.main(argv)` exits with; fails the test if KeyboardInterrupt escapes
    (Python would print its traceback)."""
    try:
        cli.main(argv)
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped from main()")
    except SystemExit as exit_:
        return exit_.code
    return 0


def test_ctrl_c_stops_cleanly_with_status_130_and_writes_what_finished(
    corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    _interrupt_at(monkeypatch, "bf16", 5)
    assert _exit_status(tiny(corpus_dir, tmp_path, "--compare")) == 130
    printed = capsys.readouterr()
    assert "Traceback" not in printed.err + printed.out
    report = printed.out[printed.out.index("interrupted (Ctrl-C):") :].splitlines()
    assert report[1:3] == [
        "  bf16: stopped at step 4/6; no checkpoint written",
        "  delayed: not started",
    ]
    assert "pass --save PATH and --save-every N" in report[3]
    table = printed.out[printed.out.index("recipe ") :].splitlines()
    assert table[2].split()[:3] == ["bf16", "bf16", "4"]
    with (tmp_path / "losses.csv").open() as f:
        assert [row["step"] for row in csv.DictReader(f)] == ["0", "2", "3", "4"]
    assert (tmp_path / "losses.png").is_file()


@pytest.mark.parametrize("recipe", ["bf16", "delayed"])
def test_ctrl_c_names_the_last_checkpoints(
    recipe: str, corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    _interrupt_at(monkeypatch, recipe, 6)
    ckpt = tmp_path / "run.pt"
    args = [*tiny(corpus_dir, tmp_path, "--compare"), "--save", str(ckpt), "--save-every", "4"]
    assert _exit_status(args) == 130
    out = capsys.readouterr().out
    report = out[out.index("interrupted (Ctrl-C):") :].splitlines()
    bf16, delayed = tmp_path / "run-bf16.pt", tmp_path / "run-delayed.pt"
    if recipe == "bf16":
        assert report[1:] == [
            f"  bf16: stopped at step 5/6; last checkpoint {bf16} (step 4)",
            "  delayed: not started",
            f"  --resume {ckpt} needs a checkpoint of every recipe; to continue bf16 alone, run "
            f"again with --recipe bf16 --resume {bf16}",
        ]
        return
    assert report[1:] == [
        f"  bf16: finished step 6/6; last checkpoint {bf16} (step 6)",
        f"  delayed: stopped at step 5/6; last checkpoint {delayed} (step 4)",
        f"  to continue, run again with the same options and --resume {ckpt}",
    ]
    monkeypatch.undo()
    resumed = cli.train([*args, "--resume", str(ckpt)])
    assert [r.steps for r in resumed] == [6, 6]
