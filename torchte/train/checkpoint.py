"""Checkpoints: everything a run needs to continue with bit-identical losses.

A checkpoint is one torch.save file (loaded with weights_only=True) holding:

- "format", "recipe", "compute_dtype" ("bf16" or "fp32"; files without it computed in bf16),
  "step", "model_config" (ModelConfig fields), "corpus" (the corpus fingerprint) and "run"
  (the training settings, for the record);
- "model": the model's state_dict, in which each te module's extra state (a uint8 tensor;
  torchte's older dict form in files written before, which load too) carries its
  delayed-scaling scales and amax histories;
- "optimizer": AdamW's state_dict;
- "rng": torch's CPU generator, every CUDA device's generator (when on CUDA) and the batch
  sampler's generator;
- "history": the logged rows so far, "window": the train losses since the last row,
  "elapsed_s": wall time so far.

Files are written to a temporary file beside the target and moved into place with os.replace,
so a crash never leaves a half-written checkpoint. With several recipes in one run each gets
its own file: the recipe's name goes before the suffix (ckpt.pt -> ckpt-delayed.pt).
Under --fsdp a checkpoint is a folder instead (fsdp_state.py), whose SHARDED_POSITION file holds
this format without "model" and "optimizer".
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

FORMAT = "torchte.train/1"
SHARDED_POSITION = "position.pt"  # the training position in a --fsdp checkpoint folder


def recipe_path(path: Path, recipe: str, several: bool) -> Path:
    """The checkpoint file of `recipe`: `path` itself for a one-recipe run."""
    return path.with_name(f"{path.stem}-{recipe}{path.suffix}") if several else path


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write `state` to `path` atomically (a temporary file, then os.replace)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({"format": FORMAT, **state}, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_checkpoint(path: Path, mmap: bool = False) -> dict[str, Any]:
    """Read a checkpoint written by save_checkpoint; SystemExit naming the fix if it is not
    one. `mmap`: map the tensors' bytes instead of reading them (for a quick look at the
    metadata)."""
    if (path / SHARDED_POSITION).is_file():
        raise SystemExit(
            f"--resume {path}: a checkpoint folder written under --fsdp; resume it with --fsdp "
            "under torchrun (--nproc-per-node 1 for one process)"
        )
    if not path.is_file():
        raise SystemExit(
            f"--resume {path}: no such checkpoint file; give a file written by --save "
            "(with several recipes, one per recipe: NAME-RECIPE.pt)"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception:
        # torch's own message would advise loading the file as arbitrary pickled code: not
        # the fix for a file that --save did not write.
        raise SystemExit(
            f"--resume {path}: not a readable checkpoint (not a file written by torch.save, "
            "damaged, or holding more than tensors and plain data); give a file written by "
            "--save"
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise SystemExit(
            f"--resume {path}: not a torchte.train checkpoint (format {FORMAT} expected); "
            "give a file written by --save"
        )
    return state


def check_compatible(
    state: dict[str, Any],
    path: Path,
    model_config: dict,
    recipe: str,
    corpus: str,
    compute_dtype: str,
) -> None:
    """SystemExit unless the checkpoint was made by this model, recipe, corpus and compute
    dtype."""
    saved = state["model_config"]
    if saved != model_config:
        diff = ", ".join(
            f"{key} {saved.get(key)} (now {model_config.get(key)})"
            for key in sorted(set(saved) | set(model_config))
            if saved.get(key) != model_config.get(key)
        )
        raise SystemExit(
            f"--resume {path}: the checkpoint's model differs from this run's: {diff}; resume "
            "with the options it was saved with (--size, --seq-len, --experts, --top-k, "
            "--normalization, --activation, --rope, --gqa-groups, --packed), or drop --resume "
            "to start a new run"
        )
    if state["recipe"] != recipe:
        raise SystemExit(
            f"--resume {path}: the checkpoint was trained with recipe {state['recipe']}, this "
            f"run uses {recipe}; pass --recipe {state['recipe']} (without --compare)"
        )
    if state["corpus"] != corpus:
        raise SystemExit(
            f"--resume {path}: the checkpoint was trained on other data (corpus "
            f"{state['corpus']}, now {corpus}); resume with the same --data and --max-bytes"
        )
    saved_dtype = state.get("compute_dtype", "bf16")
    if saved_dtype != compute_dtype:
        raise SystemExit(
            f"--resume {path}: the checkpoint computed in {saved_dtype}, this run computes in "
            f"{compute_dtype}; pass --compute-dtype {saved_dtype} to continue it"
        )


def check_steps(state: dict[str, Any], path: Path, steps: int, stop_at: int | None) -> None:
    """SystemExit unless the checkpoint's step lies within --steps (and --stop-at)."""
    step = int(state["step"])
    if step > steps:
        raise SystemExit(
            f"--resume {path}: the checkpoint is at step {step}, past --steps {steps}; pass "
            f"--steps {step} or more to continue it (the schedule it was saved with had "
            f"--steps {state['run']['steps']})"
        )
    if stop_at is not None and step > stop_at:
        raise SystemExit(
            f"--resume {path}: the checkpoint is at step {step}, past --stop-at {stop_at}; "
            f"pass a --stop-at of {step} or more, or leave it out"
        )


def rng_states(device: torch.device, data_state: torch.Tensor) -> dict[str, Any]:
    """torch's generators (CPU, and CUDA when the run is on it) and the sampler's."""
    cuda = torch.cuda.get_rng_state_all() if device.type == "cuda" else None
    return {"torch": torch.get_rng_state(), "cuda": cuda, "data": data_state}


def restore_rng(states: dict[str, Any]) -> torch.Tensor:
    """Restore torch's generators; return the sampler's state."""
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None:
        torch.cuda.set_rng_state_all(states["cuda"])
    return states["data"]
