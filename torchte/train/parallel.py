"""The training example over several processes: `torchrun --nproc-per-node N -m torchte.train
--tp N` trains one model split over N ranks (tensor parallelism, model.py), every rank on the
same batches. torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous address; the
group uses NCCL on GPUs (one GPU per rank, LOCAL_RANK's) and gloo on the CPU. Rank 0 prints,
draws the progress bar and writes the outputs; the others stay quiet. launched_run sets this up
for any run under torchrun (--tp here, --fsdp in fsdp_run.py).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

__all__ = ["check_launch", "launch_mismatch", "launched_run", "tensor_parallel_run"]


def check_launch(tp: int, fsdp: bool = False) -> str | None:
    """Why `--tp tp` cannot run in this process (None when it can): a split needs torchrun
    with as many processes (under --fsdp, a multiple of them: fsdp_run.check_fsdp)."""
    if tp < 1:
        return f"--tp must be at least 1, got {tp}"
    if tp == 1 or fsdp:
        return None
    return launch_mismatch("--tp", tp)


def launch_mismatch(option: str, ranks: int, flags: str = "") -> str | None:
    """Why `option ranks` cannot run in this process: unless torchrun started `ranks`
    processes, the message with the command that does (flags: other options it needs)."""
    world = os.environ.get("WORLD_SIZE")
    if world == str(ranks):
        return None
    found = "not under torchrun" if world is None else f"WORLD_SIZE={world}"
    return (
        f"{option} {ranks} trains over {ranks} processes ({found}): launch it with torchrun "
        f"--nproc-per-node {ranks} -m torchte.train {flags}{option} {ranks} ..."
    )


@contextlib.contextmanager
def tensor_parallel_run(tp: int, device: str) -> Iterator[object | None]:
    """The process group of a `--tp` run (None for one process): launched_run's."""
    if tp == 1:
        yield None
        return
    with launched_run(device) as group:
        yield group


@contextlib.contextmanager
def launched_run(device: str) -> Iterator[object]:
    """The default process group of the processes torchrun started, initialized for the block
    and destroyed after it, even when it raises; ranks other than 0 print nothing inside it."""
    if device == "cuda":  # one GPU per rank, named to NCCL (which would guess it otherwise)
        gpu = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(gpu)
        dist.init_process_group("nccl", device_id=gpu)
    else:
        dist.init_process_group("gloo")
    try:
        if dist.get_rank() == 0:
            yield dist.group.WORLD
        else:
            with (
                open(os.devnull, "w") as devnull,
                contextlib.redirect_stdout(devnull),
                contextlib.redirect_stderr(devnull),
            ):
                yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
