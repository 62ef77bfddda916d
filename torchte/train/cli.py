"""The command line of `python -m torchte.train` (also `torchte-train`): options, checks, main.

Bad option values end the program with a message that names the option and the fix, and a
pointer to --help (argparse's exit status 2); a missing or too small corpus, an FP8 recipe the
device cannot run, an --out or --save path that cannot be written and a checkpoint that does
not fit end it with status 1, all before the first training step. Ctrl-C ends it with status
130, after writing the table, CSV and plot of the steps that finished and saying where each
recipe stopped.

Before each recipe's run it prints an estimate of its time (estimate.py); on the CPU it
computes with the thread count --threads chose (threads.py), named in the run's header.

The parts: arguments.py (the options, their checks, the configurations they make), runner.py
(the checks before training and each recipe's run) and outputs.py (the CSV, plot and table);
their public names are importable from here too.
"""

from __future__ import annotations

import sys

from .arguments import DESCRIPTION, build_parser, parse_args
from .outputs import plot_title, write_outputs
from .runner import check_outputs, describe_model, resume_steps, run_recipes, train

__all__ = [
    "DESCRIPTION",
    "build_parser",
    "check_outputs",
    "describe_model",
    "main",
    "parse_args",
    "plot_title",
    "resume_steps",
    "run_recipes",
    "train",
    "write_outputs",
]


def main(argv: list[str] | None = None) -> None:
    """The program's entry point (`python -m torchte.train`, `torchte-train`)."""
    try:
        train(argv)
    except KeyboardInterrupt:  # outside a recipe's run (which handles its own)
        print("\ninterrupted (Ctrl-C)", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
