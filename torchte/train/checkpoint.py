"""Checkpoints: everything a run needs to continue with bit-identical losses.

A checkpoint is one torch.save file (loaded with weights_only=True) holding:

- "format", "recipe", "compute_dtype" ("bf16" or "fp32"; files without it computed in bf16),
  "step", "model_config" (ModelConfig fields), "corpus" (the corpus fingerprint) and "run"
  (the training settings: "steps", "warmup" and "lr" define the learning-rate schedule,
  which a resumed run must continue, check_schedule);
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


def check_schedule(
    state: dict[str, Any], path: Path, schedule: dict[str, Any], stop_at: int | None
) -> None:
    """SystemExit unless this run continues the checkpoint's learning-rate schedule: the same
    --steps, --warmup and --lr (`schedule`: this run's), and a --stop-at past its step. A
    checkpoint at the end of its schedule passes (another recipe's may go on; the runner
    refuses a resume that trains nothing). One that does not record its schedule resumes
    under this run's, with a note saying so."""
    step = int(state["step"])
    saved = state.get("run", {})
    if "steps" not in saved:
        print(
            f"note: --resume {path} does not record the schedule it was trained under; its "
            f"learning rates from step {step + 1} on follow this run's --steps "
            f"{schedule['steps']}",
            flush=True,
        )
        saved = {"steps": schedule["steps"]}
    steps = int(saved["steps"])
    changed = [
        key for key in ("steps", "warmup", "lr") if key in saved and schedule[key] != saved[key]
    ]
    if changed and step >= steps:
        raise SystemExit(
            f"--resume {path}: {at_the_end(step, steps)}; a longer or another schedule needs a "
            "new run (without --resume)"
        )
    if changed and schedule["steps"] <= step:
        raise SystemExit(
            f"--resume {path}: the checkpoint is already at step {step}, so --steps "
            f"{schedule['steps']} leaves nothing to train; pass --steps {steps} (its schedule's) "
            "to continue it"
        )
    if changed:
        now = ", ".join(
            f"--{key} {schedule[key]} (the checkpoint's: {saved[key]})" for key in changed
        )
        same = " ".join(f"--{key} {saved[key]}" for key in changed)
        raise SystemExit(
            f"--resume {path}: this run's learning-rate schedule differs from the checkpoint's: "
            f"{now}, which would change its learning rates from step {step + 1} on; pass "
            f"{same} to continue the same schedule (another schedule needs a new run, without "
            "--resume)"
        )
    if stop_at is not None and stop_at <= step < steps:
        raise SystemExit(
            f"--resume {path}: the checkpoint is already at step {step}, so --stop-at {stop_at} "
            f"leaves nothing to train; pass a --stop-at between {step + 1} and {steps}, or leave "
            "it out"
        )


def at_the_end(step: int, steps: int, whose: str = "the checkpoint") -> str:
    """What a checkpoint (`whose`) at step `step` of a schedule of `steps`, its end, is."""
    return (
        f"{whose} is already at step {step}, the end of its schedule (--steps {steps}): "
        "nothing is left to train"
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
