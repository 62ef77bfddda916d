"""What a run leaves behind: the summary table (stdout), the CSV of logged rows, peak memory.

Peak memory is torch.cuda.max_memory_allocated on a GPU (reset before each recipe, so it is
that recipe's own) and the process's maximum resident set size on the CPU (which only grows:
a later recipe's figure includes the earlier ones').
"""

from __future__ import annotations

import csv
import math
import resource
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from .loop import RunResult

CSV_FIELDS = ("recipe", "step", "train_loss", "val_loss", "tokens_per_s", "elapsed_s")


def reset_peak_memory(device: torch.device) -> None:
    """Start a recipe's peak-memory count (on a GPU; the CPU's max RSS cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, what was measured): the GPU's peak allocation, or the process's max RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "GPU allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kilobytes, macOS bytes.
    return (rss if sys.platform == "darwin" else rss * 1024), "max RSS"


def format_bytes(n: int) -> str:
    """'512 KiB', '1.5 MiB', '3.2 GiB'."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 2**10:.0f} KiB"


@dataclass(frozen=True)
class Summary:
    """One recipe's line of the table."""

    recipe: str
    steps: int
    train_loss: float | None
    first_val_loss: float | None
    val_loss: float | None
    val_step: int | None
    tokens_per_s: float
    peak_bytes: int
    peak_kind: str


def summarize(result: RunResult, peak: tuple[int, str]) -> Summary:
    """The table line of a finished run: last train and first/last validation losses."""
    rows = result.rows
    train = [r["train_loss"] for r in rows if r["train_loss"] is not None]
    val_rows = [r for r in rows if r["val_loss"] is not None]
    return Summary(
        result.recipe,
        result.steps,
        train[-1] if train else None,
        val_rows[0]["val_loss"] if val_rows else None,
        val_rows[-1]["val_loss"] if val_rows else None,
        val_rows[-1]["step"] if val_rows else None,
        result.tokens_per_s,
        *peak,
    )


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def format_table(summaries: list[Summary]) -> str:
    """The summary table, one line per recipe."""
    header = ("recipe", "steps", "train loss", "val loss (first -> last)", "tokens/s", "peak mem")
    lines = [
        (
            s.recipe,
            str(s.steps),
            _loss(s.train_loss),
            f"{_loss(s.first_val_loss)} -> {_loss(s.val_loss)}",
            f"{s.tokens_per_s:,.0f}" if math.isfinite(s.tokens_per_s) else "-",
            f"{format_bytes(s.peak_bytes)} ({s.peak_kind})",
        )
        for s in summaries
    ]
    widths = [max(len(row[i]) for row in (header, *lines)) for i in range(len(header))]

    def fmt(row) -> str:
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        return "  ".join(cells)

    rule = "-" * len(fmt(header))
    return "\n".join([fmt(header), rule, *(fmt(row) for row in lines)])


def write_csv(path: Path, rows: list[dict]) -> None:
    """Every logged row of every recipe; blank where a value was not measured."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_FIELDS)
        for row in rows:
            writer.writerow([_cell(k, row[k]) for k in CSV_FIELDS])


def _cell(field: str, value) -> str:
    """Losses exactly (repr round-trips a float), speed and time rounded."""
    if value is None:
        return ""
    if field == "tokens_per_s":
        return f"{value:.1f}"
    if field == "elapsed_s":
        return f"{value:.3f}"
    return repr(value) if isinstance(value, float) else str(value)
