"""What a run that Ctrl-C stopped says at the end: where each recipe stopped, its last
checkpoint, and the options that continue it."""

from __future__ import annotations

from .config import RunConfig
from .loop import RunResult


def interruption_report(results: list[RunResult], config: RunConfig) -> str:
    """What Ctrl-C left: where each recipe stopped and its last checkpoint, or how to get
    one."""
    lines = ["interrupted (Ctrl-C):"]
    for i, name in enumerate(config.recipes):
        label = config.label(name)
        if i >= len(results):
            lines.append(f"  {label}: not started")
            continue
        result = results[i]
        state = "stopped at" if result.interrupted else "finished"
        saved = (
            f"last checkpoint {result.saved[0]} (step {result.saved[1]})"
            if result.saved
            else "no checkpoint written"
        )
        lines.append(f"  {label}: {state} step {result.steps}/{config.last_step}; {saved}")
    lines.append("  " + _how_to_continue(results, config))
    return "\n".join(lines)


def _how_to_continue(results: list[RunResult], config: RunConfig) -> str:
    """The options that continue an interrupted run from its checkpoints, or that would have
    written some."""
    if config.save is None:
        return (
            "to be able to continue an interrupted run, pass --save PATH and --save-every N (a "
            "checkpoint every N steps); then run again with --resume PATH"
        )
    if len(results) == len(config.recipes) and all(r.saved for r in results):
        return f"to continue, run again with the same options and --resume {config.save}"
    # The recipe that did not finish: the one interrupted, else the one that never started.
    i = len(results) - 1 if results and results[-1].interrupted else len(results)
    name, saved = config.recipes[i], results[i].saved if i < len(results) else None
    if saved is None:
        return f"no checkpoint of {config.label(name)} yet: --save-every N saves one every N steps"
    return (
        f"--resume {config.save} needs a checkpoint of every recipe; to continue "
        f"{config.label(name)} alone, run again with --recipe {name} --resume {saved[0]}"
    )
