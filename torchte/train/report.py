"""What a run leaves behind: the summary table (stdout), the CSV of logged rows, peak memory;
and the check, before training, that its output folders can be written.

Peak memory is each recipe's own: torch.cuda.max_memory_allocated on a GPU, and on the CPU the
process's peak resident set size during the recipe ("peak RSS": Linux's high-water mark VmHWM,
reset before each recipe by writing 5 to /proc/self/clear_refs; it counts what the process
holds besides the recipe too, such as torch and the corpus). Where that reset is not possible
(another OS, a kernel that refuses it) the figure is the process's peak since it started,
labelled "process peak RSS": a later recipe's then includes the earlier ones'.
"""

from __future__ import annotations

import csv
import math
import re
import resource
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .loop import RunResult

CSV_FIELDS = ("recipe", "step", "train_loss", "val_loss", "tokens_per_s", "elapsed_s")


CLEAR_REFS = Path("/proc/self/clear_refs")  # Linux: writing "5" resets VmHWM
PROC_STATUS = Path("/proc/self/status")


def reset_peak_memory(device: torch.device) -> bool:
    """Start a recipe's peak-memory count; whether it was reset (False on a CPU whose peak
    RSS cannot be: peak_memory then gives the process's peak since it started)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return _rss_high_water_mark() is not None


def peak_memory(device: torch.device, since_reset: bool = False) -> tuple[int, str]:
    """(bytes, what was measured): the GPU's peak allocation, or on the CPU the peak RSS since
    reset_peak_memory (`since_reset`: what it returned) or else since the process started."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "GPU allocated"
    high_water = _rss_high_water_mark() if since_reset else None
    if high_water is not None:
        return high_water, "peak RSS"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kilobytes, macOS bytes.
    return (rss if sys.platform == "darwin" else rss * 1024), "process peak RSS"


def _rss_high_water_mark() -> int | None:
    """Linux's VmHWM in bytes (the peak RSS since it was last reset); None elsewhere."""
    try:
        match = re.search(r"^VmHWM:\s+(\d+) kB", PROC_STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


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
    """The run's label (loop.RunResult.recipe)."""
    compute: str
    """What it computed in: "bf16", "fp32", or "fp8+" either (FP8 GEMMs, the rest in it)."""
    steps: int
    train_loss: float | None
    first_val_loss: float | None
    val_loss: float | None
    val_step: int | None
    tokens_per_s: float
    peak_bytes: int
    peak_kind: str


def summarize(result: RunResult, peak: tuple[int, str], compute: str) -> Summary:
    """The table line of a finished run: last train and first/last validation losses;
    `compute` says what it computed in (RunConfig.computes)."""
    rows = result.rows
    train = [r["train_loss"] for r in rows if r["train_loss"] is not None]
    val_rows = [r for r in rows if r["val_loss"] is not None]
    return Summary(
        result.recipe,
        compute,
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


def format_table(summaries: list[Summary], note: str = "") -> str:
    """The summary table, one line per recipe, and `note` under it."""
    header = (
        "recipe",
        "compute",
        "steps",
        "train loss",
        "val loss (first -> last)",
        "tokens/s",
        "peak mem",
    )
    lines = [
        (
            s.recipe,
            s.compute,
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
        cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1])] + [
            c.rjust(w) for c, w in zip(row[2:], widths[2:], strict=True)
        ]
        return "  ".join(cells)

    rule = "-" * len(fmt(header))
    return "\n".join([fmt(header), rule, *(fmt(row) for row in lines), *([note] if note else [])])


def compute_note(compute_dtype: str, reason: str, fp8: bool = True) -> str:
    """The line under the table: the compute dtype, why, and (`fp8`: when an FP8 recipe ran)
    what "fp8+" means."""
    fp8_note = f"fp8+{compute_dtype}: FP8 GEMMs, the rest in {compute_dtype}; " if fp8 else ""
    return f"compute {compute_dtype} ({reason}); {fp8_note}--compute-dtype bf16|fp32 chooses"


def check_writable(folder: Path, what: str) -> None:
    """SystemExit naming `what` (the option and its value) unless `folder` exists or can be
    made and a file can be created in it (one is, then removed)."""
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    try:
        if not existing.is_dir():
            raise NotADirectoryError(f"{existing} is a file, not a folder")
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            pass
    except OSError as err:
        problem = err.strerror or str(err)
        raise SystemExit(
            f"{what}: cannot write to the folder {folder}: {problem}; give a path in a folder "
            "you can write to"
        ) from None


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
