"""What a run of `python -m torchte.train` leaves in --out and prints at its end: losses.csv,
losses.png (the loss curves) and the table of final losses, tokens/s and peak memory.
"""

from __future__ import annotations

from .config import ModelConfig, RunConfig
from .loop import RunResult
from .plot import write_plot
from .report import Summary, compute_note, format_table, write_csv

__all__ = ["plot_title", "write_outputs"]


def write_outputs(
    model_config: ModelConfig,
    config: RunConfig,
    results: list[RunResult],
    summaries: list[Summary],
) -> None:
    """Write the CSV and the plot to --out and print the table."""
    rows = [row for result in results for row in result.rows]
    csv_path, png_path = config.out / "losses.csv", config.out / "losses.png"
    write_csv(csv_path, rows)
    backend = write_plot(png_path, rows, plot_title(model_config, config))
    print()
    fp8 = any(s.compute.startswith("fp8+") for s in summaries)  # an FP8 recipe ran
    print(format_table(summaries, compute_note(config.compute_dtype, config.compute_reason, fp8)))
    print(f"\nwrote {csv_path} and {png_path} ({backend} plot)", flush=True)


def plot_title(model_config: ModelConfig, config: RunConfig) -> str:
    """The plot's title: what was trained, where, in which dtype."""
    mlp = f", {model_config.experts} experts" if model_config.experts else ""
    return (
        f"loss of a byte-level GPT ({model_config.layers} layers x {model_config.hidden}{mlp}) "
        f"on {config.device}, {config.compute_dtype} compute"
    )
