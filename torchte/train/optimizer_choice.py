"""Which optimizer the training example steps with (`--optimizer`), and what follows from it.

- "adamw" (default): ClippedAdamW (optimizer.py), torch's AdamW state, the gradients' clipping
  and the update in two launches on a GPU; every parallel layout.
- "fused-adam": te.optimizers.FusedAdam, Transformer Engine's optimizer, after torch's
  clip_grad_norm_; one process. `--master-weights`: the model's weights in bf16, their fp32
  masters in the optimizer (the forward reads the bf16 weights as they are, where autocast
  casts fp32 weights each step: the same values). `--adam-moments bf16`: AdamW's moments
  stored in bf16.

A checkpoint records the choice; a run resumes only with the same one (check_same_optimizer).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from torchte.optimizers import FusedAdam

from .optimizer import ClippedAdamW

__all__ = [
    "MOMENT_DTYPES",
    "OPTIMIZERS",
    "check_optimizer",
    "check_same_optimizer",
    "make_optimizer",
    "optimizer_record",
    "params_dtype",
]

OPTIMIZERS = ("adamw", "fused-adam")
MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The record of a checkpoint written before the choice existed: the default AdamW.
DEFAULT_RECORD = {"optimizer": "adamw", "master_weights": False, "adam_moments": "fp32"}


def check_optimizer(optimizer: str, master_weights: bool, moments: str, parallel: str | None):
    """Why these options do not go together (a message naming the fix), or None. parallel:
    the first parallel option given (--fsdp, --tp N, ...), or None for one process."""
    if optimizer != "fused-adam":
        if master_weights:
            return "--master-weights keeps fp32 masters in FusedAdam: add --optimizer fused-adam"
        if moments != "fp32":
            return f"--adam-moments {moments} is FusedAdam's: add --optimizer fused-adam"
        return None
    if parallel is not None:
        return (
            f"--optimizer fused-adam runs in one process; {parallel} steps with the default "
            "--optimizer adamw (its sharded and split steps)"
        )
    return None


def params_dtype(master_weights: bool) -> torch.dtype:
    """The model's weights: bf16 where FusedAdam keeps their fp32 masters, else fp32."""
    return torch.bfloat16 if master_weights else torch.float32


def make_optimizer(groups: list[dict], config, lr: float, betas: tuple[float, float], device):
    """The run's optimizer over the parameter groups (config: a RunConfig)."""
    if config.optimizer == "fused-adam":
        moments = MOMENT_DTYPES[config.adam_moments]
        return FusedAdam(
            groups, lr=lr, betas=betas, master_weights=config.master_weights,
            exp_avg_dtype=moments, exp_avg_sq_dtype=moments,
        )  # fmt: skip
    return ClippedAdamW(groups, lr=lr, betas=betas, fused=device.type == "cuda")


def optimizer_record(config) -> dict[str, Any]:
    """What a checkpoint records of the optimizer choice."""
    return {
        "optimizer": config.optimizer,
        "master_weights": config.master_weights,
        "adam_moments": config.adam_moments,
    }


def check_same_optimizer(state: dict[str, Any], path: Path, config) -> None:
    """SystemExit unless the checkpoint was trained with this run's optimizer choice (files
    without a record: the default AdamW)."""
    saved = state.get("optimizer_choice", DEFAULT_RECORD)
    now = optimizer_record(config)
    if saved == now:
        return
    flags = [f"--optimizer {saved['optimizer']}"]
    if saved["master_weights"]:
        flags.append("--master-weights")
    if saved["adam_moments"] != "fp32":
        flags.append(f"--adam-moments {saved['adam_moments']}")
    raise SystemExit(
        f"--resume {path}: the checkpoint was trained with {_describe(saved)}, this run uses "
        f"{_describe(now)}; pass {' '.join(flags)} to continue it"
    )


def _describe(record: dict[str, Any]) -> str:
    extras = [
        "master weights" if record["master_weights"] else "",
        f"{record['adam_moments']} moments" if record["optimizer"] == "fused-adam" else "",
    ]
    extra = ", ".join(x for x in extras if x)
    return f"{record['optimizer']}" + (f" ({extra})" if extra else "")
