"""What a run that saved checkpoints says after its table: the command that continues it from
them (its own command line, without --stop-at, with --resume), or that its schedule is done.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from .config import RunConfig

__all__ = ["continue_hint", "resume_command"]

# Options the continuing run leaves out: the checkpoint it resumed from (if any) and where it
# stopped. argparse takes any unambiguous prefix of an option (--res, --stop), so a prefix of
# one of these on a command line that parsed is that option.
DROPPED = ("--resume", "--stop-at")
MODULE = "torchte.train"


def resume_command(argv: list[str], save: Path, prog: str, ranks: int | None = None) -> str:
    """The command line of `prog` with the options `argv` ran with, less --resume and
    --stop-at, plus --resume `save`; quoted for a POSIX shell. ranks: the number of processes
    of a run under torchrun (then launched by it), None for one process."""
    kept, tokens = [], iter(argv)
    for token in tokens:
        name, has_value, _ = token.partition("=")
        if not any(len(name) > 2 and option.startswith(name) for option in DROPPED):
            kept.append(token)
        elif not has_value:
            next(tokens, None)  # its value
    head = prog if ranks is None else f"torchrun --nproc-per-node {ranks} -m {MODULE}"
    return f"{head} {shlex.join([*kept, '--resume', str(save)])}"


def continue_hint(config: RunConfig, argv: list[str], prog: str, ranks: int | None) -> str:
    """The line after the table of a run that saved its checkpoints at config.last_step (the
    arguments as resume_command's)."""
    if config.last_step < config.steps:
        command = resume_command(argv, config.save, prog, ranks)
        return f"to continue to step {config.steps} (--steps): {command}"
    what = "the checkpoint is" if len(config.recipes) == 1 else "the checkpoints are"
    return (
        f"{what} at the end of the schedule (step {config.steps} of --steps {config.steps}): "
        "nothing is left to resume; to train longer, start a new run with a larger --steps"
    )
