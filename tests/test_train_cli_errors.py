"""Tests of how `python -m torchte.train` answers a bad command line (the message and a pointer
to --help, exit status 2) and of its --help (every option's default)."""

from __future__ import annotations

import sys

import pytest

from torchte.train import arguments

PROG = "python -m torchte.train"


@pytest.fixture
def as_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """The program runs as `python -m torchte.train` (its name in messages); help text at a
    fixed width."""
    monkeypatch.setattr(sys, "argv", ["/somewhere/torchte/train/__main__.py"])
    monkeypatch.setenv("COLUMNS", "100")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--steps", "many"], "argument --steps: invalid int value: 'many'"),
        (["--sequence-parallel"], "--sequence-parallel needs --tp N with N > 1"),  # a check
    ],
)
def test_errors_print_the_message_and_a_pointer_to_help(
    argv: list[str], message: str, as_module: None, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as info:
        arguments.parse_args(["--device", "cpu", *argv])
    assert info.value.code == 2
    printed = capsys.readouterr()
    assert printed.err == f"{PROG}: error: {message}\nrun with --help for the options\n"
    assert printed.out == ""


def _option_entries(help_text: str) -> dict[str, str]:
    """Each option's entry in --help's options section, by its first flag."""
    section = help_text[help_text.index("\noptions:\n") :].splitlines()[2:]
    entries: dict[str, str] = {}
    for line in section:
        if line.startswith("  -"):
            flag = line.split()[0].rstrip(",")
            entries[flag] = line
        else:
            entries[flag] += " " + line.strip()
    return entries


def test_help_shows_every_default(as_module: None, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        arguments.parse_args(["--help"])
    assert info.value.code == 0
    entries = _option_entries(capsys.readouterr().out)
    parser = arguments.build_parser()
    flags = {action.option_strings[0] for action in parser._actions} - {"-h"}
    assert set(entries) - {"-h"} == flags  # every option has its entry
    missing = [flag for flag in flags if "default" not in entries[flag]]
    assert missing == []
    for flag, default in [
        ("--size", "(default: tiny on the CPU, large on a GPU)"),
        ("--steps", "(default by --size: tiny 300, small 1000, medium 2000, large 1000)"),
        ("--batch-size", "(default: 16)"),
        ("--seed", "(default: 0)"),
        ("--out", "(default: train_out)"),
        ("--compute-dtype", "(default: auto)"),
        ("--rope", "(default: off)"),
        ("--threads", "(default: auto: on the CPU 1, unless a probe"),
    ]:
        assert default in entries[flag], flag
