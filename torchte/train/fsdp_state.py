"""Checkpoints of a --fsdp run: a folder written through torch.distributed.checkpoint (DCP).

The folder holds DCP's files, with {"model": the model's state_dict, "optimizer": AdamW's}, each
rank writing its shards (torch.distributed.checkpoint.state_dict's sharded form), and the
training position (checkpoint.SHARDED_POSITION: the one-process format's file without "model"
and "optimizer": step, recipe, configs, corpus, RNG, history), written by rank 0. DCP reshards
on load, so a folder saved over N ranks resumes over any number of them.

The te modules' delayed-scaling state (each one's `_extra_state`: scales and amax histories, a
uint8 tensor) goes through DCP with the rest of the model, saved once (it is the same on every
rank: the amaxes are reduced over the ranks). DCP loads into tensors of the saved size, and a
model that has not run under delayed scaling holds empty ones, so before loading, the entries
of the state_dict it loads into are sized from the folder's metadata (folders written before,
with torchte's older dict form, load too).

With --tp (2-D) each tensor-parallel rank's pieces live under their own name, "tp<r>" (DCP
reshards them over the data-parallel ranks, not over tensor-parallel ones): such a folder
resumes with the same --tp, over any number of data-parallel ranks.

With --ep (ep_run.py) the experts are left out of FSDP, each rank's whole on it: in the folder
each becomes that rank's Shard(0) piece of the (E, ...) weight (and of its AdamW moments), so
DCP writes every rank's experts and reshards them on load: the folder resumes over any --ep,
or under --fsdp alone (whose FSDP shards the experts as any weight).

A save is written to PATH.partial and then moved to PATH (a crash never leaves a half-written
folder at PATH); the folder it replaces must be such a checkpoint, never any other folder.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from . import checkpoint
from .checkpoint import SHARDED_POSITION
from .ep_run import is_expert

__all__ = ["check_save_path", "load_sharded", "read_position", "save_sharded"]

EXTRA_STATE = "._extra_state."  # a field of a module's entry in the older dict form


def read_position(path: Path) -> dict[str, Any]:
    """The training position of the checkpoint folder `path` (SystemExit naming the fix if it
    is not one)."""
    if path.is_file():
        raise SystemExit(
            f"--resume {path}: a one-process checkpoint file (written without --fsdp); resume "
            "it without --fsdp, or give a folder written by --save under --fsdp"
        )
    if not (path / SHARDED_POSITION).is_file():
        found = "no such folder" if not path.exists() else f"no {SHARDED_POSITION} in it"
        raise SystemExit(
            f"--resume {path}: not a --fsdp checkpoint ({found}); give a folder written by "
            "--save under --fsdp (with several recipes, one per recipe: NAME-RECIPE)"
        )
    return checkpoint.load_checkpoint(path / SHARDED_POSITION)


def check_save_path(path: Path) -> None:
    """SystemExit unless `path` can become a checkpoint folder: absent, or one written before
    (which a save replaces), never a file or another folder with files in it."""
    if path.is_file():
        raise SystemExit(
            f"--save {path}: a file; under --fsdp a checkpoint is a folder: give a new path, "
            f"such as {path.with_suffix('')}-fsdp"
        )
    if path.is_dir() and any(path.iterdir()) and not (path / SHARDED_POSITION).is_file():
        raise SystemExit(
            f"--save {path}: a folder with other files in it (a save replaces the folder); "
            "give a new path or an earlier --fsdp checkpoint's"
        )


def _tp_key(tp_group) -> str | None:
    """The name this rank's tensor-parallel pieces are saved under (None without --tp)."""
    return None if tp_group is None else f"tp{dist.get_rank(tp_group)}"


def _nested(state: dict, tp_group) -> dict:
    key = _tp_key(tp_group)
    return state if key is None else {key: state}


def save_sharded(
    path: Path,
    position: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    tp_group=None,
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """Write the checkpoint folder `path` of every rank's shards and rank 0's `position`
    (with the tensor-parallel size); all ranks call it. expert_mesh: the experts of this rank
    (left out of FSDP) are its pieces over that mesh (module docstring)."""
    partial = path.with_name(path.name + ".partial")
    first = dist.get_rank() == 0
    if first:
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    _experts_as_pieces(model, model_state, optim_state, expert_mesh)
    state = _nested({"model": model_state, "optimizer": optim_state}, tp_group)
    dcp.save(state, checkpoint_id=partial)
    if first:
        tp = 1 if tp_group is None else dist.get_world_size(tp_group)
        checkpoint.save_checkpoint(partial / SHARDED_POSITION, {**position, "tp": tp})
        _replace(partial, path)
    dist.barrier()


def _replace(new: Path, path: Path) -> None:
    """Move the folder `new` to `path`, removing the folder there after the move."""
    old = path.with_name(path.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    new.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def load_sharded(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    tp_group=None,
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """Load the model and AdamW state of the checkpoint folder `path` into this rank's shards
    (any data-parallel rank count may have saved it; SystemExit for another tensor-parallel
    size); all ranks call it. expert_mesh: as save_sharded's."""
    tp = 1 if tp_group is None else dist.get_world_size(tp_group)
    saved_tp = checkpoint.load_checkpoint(path / SHARDED_POSITION).get("tp", 1)
    if saved_tp != tp:
        raise SystemExit(
            f"--resume {path}: saved with --tp {saved_tp}, this run has --tp {tp}; resume with "
            f"--tp {saved_tp} (the number of data-parallel ranks may differ)"
        )
    model_state, optim_state = get_state_dict(model, optimizer)
    metadata = dcp.FileSystemReader(path).read_metadata()
    key = _tp_key(tp_group)
    prefix = "model." if key is None else f"{key}.model."
    _add_extra_states(model_state, metadata.state_dict_metadata, prefix)
    pieces = _experts_as_pieces(model, model_state, optim_state, expert_mesh)
    state = _nested({"model": model_state, "optimizer": optim_state}, tp_group)
    dcp.load(state, checkpoint_id=path)
    state = state if key is None else state[key]
    for entries, name in pieces:  # loaded in place: the plain tensors again
        entries[name] = entries[name].to_local()
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )


def _experts_as_pieces(
    model: nn.Module, model_state: dict, optim_state: dict, mesh: DeviceMesh | None
) -> list[tuple[dict, str]]:
    """Replace, in place, every expert's entries (its weight and AdamW moments: this rank's
    rows of an (E, ...) tensor, plain) by DTensors of the whole sharded along dim 0 over `mesh`
    that share their memory; returns (dict, key) of each. Nothing without a mesh."""
    if mesh is None:
        return []
    # the experts left whole by FSDP (its sharded ones are DTensors already)
    experts = [
        n for n, p in model.named_parameters() if is_expert(p) and not isinstance(p, DTensor)
    ]
    optim = optim_state.get("state", {})
    replaced = []
    for name in experts:
        entries = [(model_state, name)]
        entries += [(optim[name], k) for k in ("exp_avg", "exp_avg_sq") if k in optim.get(name, {})]
        for entry, key in entries:
            local = entry[key]
            entry[key] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
            replaced.append((entry, key))
    return replaced


def _add_extra_states(model_state: dict, saved: dict, prefix: str) -> None:
    """Size every module's extra state in `model_state` as the checkpoint holds it (`saved`:
    DCP's metadata by flattened key), so that DCP loads it: a module that has not run under
    delayed scaling holds an empty tensor, or a history of another length. An entry
    "<prefix><module>._extra_state" is a tensor (Transformer Engine's uint8 form); a folder
    written before keeps torchte's older dict form, "<prefix><module>._extra_state.<field>"
    (tensors of the saved size and dtype, None for plain values), and nothing for a module
    that had no state: its entry becomes {} (nothing to load)."""
    older: set[str] = set()
    for key, meta in saved.items():
        if not key.startswith(prefix):
            continue
        name = key.removeprefix(prefix)
        whole = name == "_extra_state" or name.endswith("._extra_state")
        if whole and isinstance(meta, TensorStorageMetadata):
            model_state[name] = torch.empty(meta.size, dtype=meta.properties.dtype)
            continue
        if EXTRA_STATE not in name:
            continue
        module, field = name.split(EXTRA_STATE)
        older.add(module)
        entry = model_state.get(f"{module}._extra_state")
        if not isinstance(entry, dict):
            entry = model_state[f"{module}._extra_state"] = {}
        if isinstance(meta, TensorStorageMetadata):
            entry[field] = torch.empty(meta.size, dtype=meta.properties.dtype)
        else:
            entry[field] = None
    if not older:
        return
    for name in list(model_state):
        module = name.removesuffix("._extra_state")
        if module != name and module not in older and prefix + name not in saved:
            model_state[name] = {}
