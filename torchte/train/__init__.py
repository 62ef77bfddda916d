"""The README's main job: a small GPT of torchte modules trained as a byte-level language model.

    python -m torchte.train                     # without FP8, then FP8 delayed scaling
    python -m torchte.train --recipe current    # one recipe
    python -m torchte.train --help

Files: config.py (model shape, size presets, run settings), precision.py (the compute dtype:
bf16 or fp32), data.py (the byte corpus and batches), model.py, moe.py and packing.py (the
GPT, its experts and its packed documents), loop.py (one recipe's training run), checkpoint.py
(save and resume), progress.py (the progress bar), report.py (table, CSV, peak memory, output
checks), plot.py (the loss curves), cli.py (the command line's entry point: main), arguments.py
(its options and their checks), runner.py (the run of each recipe) and outputs.py (the CSV, plot
and table a run writes).
"""

from .cli import main, train

__all__ = ["main", "train"]
