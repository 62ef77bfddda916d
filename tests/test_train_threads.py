"""Tests of `python -m torchte.train --threads`: the CPU thread count, chosen by the option, the
environment or a probe, and named in the run's header (tiny runs on the CPU)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_train import tiny, write_corpus

from torchte.train import arguments, cli, runner, threads, timing


@pytest.fixture(autouse=True)
def _torch_threads():
    """Each test leaves torch's thread count and the probe's cache as it found them."""
    before = torch.get_num_threads()
    threads.thread_probe_times.cache_clear()
    yield
    threads.thread_probe_times.cache_clear()
    torch.set_num_threads(before)


@pytest.fixture
def training_threads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """torch's thread count while the recipes train (appended by each run)."""
    seen: list[int] = []
    run_recipes = runner.run_recipes

    def recorded(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return run_recipes(*args, **kwargs)

    monkeypatch.setattr(runner, "run_recipes", recorded)
    return seen


@pytest.fixture
def busy_clock(monkeypatch: pytest.MonkeyPatch):
    """A clock for the probe on which a run takes 0.5 ms at one thread and `slowdown[0]` times
    that at more (a busy CPU when above 1), whatever the CPU does; torch's default is 2
    threads and no OMP_NUM_THREADS is set."""
    slowdown = [1.0]
    now = [0.0]

    def perf_counter() -> float:
        now[0] += 0.5e-3 * (slowdown[0] if torch.get_num_threads() > 1 else 1.0)
        return now[0]

    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=perf_counter))
    monkeypatch.setattr(threads, "DEFAULT_THREADS", 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    return slowdown


@pytest.mark.parametrize(
    ("slowdown", "count", "times"),
    [
        (6.0, 1, "0.5 ms at 1 thread, 3 ms at 2"),  # busy: the threads wait for each other
        (0.9, 1, "0.5 ms at 1 thread, 0.45 ms at 2"),  # hardly faster: one thread is safer
        (0.25, 2, "0.5 ms at 1 thread, 0.125 ms at 2"),  # idle cores: clearly faster
    ],
)
def test_auto_keeps_one_thread_unless_more_are_clearly_faster(
    slowdown: float, count: int, times: str, busy_clock: list[float]
) -> None:
    busy_clock[0] = slowdown
    torch.set_num_threads(2)
    choice = threads.choose_threads("auto", "cpu", hidden=128, ffn=512)
    assert (choice.count, choice.reason) == (count, f"auto: a probe took {times}")
    assert torch.get_num_threads() == 2  # the probe leaves torch's count as it was


def test_auto_keeps_omp_num_threads_and_leaves_a_gpu_run_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(threads, "thread_probe_times", lambda *a: pytest.fail("no probe"))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    choice = threads.choose_threads("auto", "cpu")
    assert choice == threads.ThreadChoice(torch.get_num_threads(), "auto: OMP_NUM_THREADS=3")
    gpu = threads.choose_threads("auto", "cuda")
    assert gpu.count is None and threads.describe_threads(gpu.count, gpu.reason) == ""
    assert threads.choose_threads(3, "cuda") == threads.ThreadChoice(3, "--threads")


def test_probe_times_both_counts_and_restores_torchs() -> None:
    torch.set_num_threads(1)
    one_s, many_s = threads.thread_probe_times(64, 32, 48, 2)
    assert 0 < one_s < 1 and 0 < many_s < 1
    assert torch.get_num_threads() == 1


def test_threads_option_sets_torchs_count_and_the_header_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture, training_threads: list[int]
) -> None:
    torch.set_num_threads(2)
    args = tiny(write_corpus(tmp_path), tmp_path / "out", "--recipe", "bf16", "--steps", "2")
    cli.train([*args, "--threads", "1"])
    assert training_threads == [1]
    assert torch.get_num_threads() == 2  # the caller's count again after the run
    run = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("run:"))
    assert "compute bf16 (--compute-dtype bf16); threads 1 (--threads); 2 steps" in run


def test_auto_run_names_its_choice_in_the_header(
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    busy_clock: list[float],
    training_threads: list[int],
) -> None:
    busy_clock[0] = 6.0
    torch.set_num_threads(2)
    args = tiny(write_corpus(tmp_path), tmp_path / "out", "--recipe", "bf16", "--steps", "2")
    cli.train(args)  # --threads auto
    assert training_threads == [1]
    out = capsys.readouterr().out
    assert "; threads 1 (auto: a probe took 0.5 ms at 1 thread, 3 ms at 2); 2 steps" in out


@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_bad_thread_counts_are_refused(value: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        arguments.parse_args(["--device", "cpu", "--threads", value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    refusal = f"argument --threads: give auto or a number of threads of 1 or more, got '{value}'"
    assert refusal in err
    assert err.endswith(f"{arguments.HELP_POINTER}\n")
