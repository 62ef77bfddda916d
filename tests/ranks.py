"""Running a function on several gloo ranks of this machine (tests import it as `from ranks
import on_ranks`): each rank initializes its process group through a file next to the test,
runs the function, and destroys the group even when the function raises; every process is
joined. The results come back per rank. backend="nccl" runs the ranks on the GPUs instead, rank
r on GPU r (torch.cuda.set_device before the group is made)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# A rank that fails where the others wait in a collective makes them fail after this long,
# not after gloo's 30 minutes.
TIMEOUT = datetime.timedelta(seconds=120)


def _rank_main(rank: int, world: int, init_file: str, fn, args, results, backend: str) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend, init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=TIMEOUT
    )
    try:
        results[rank] = fn(rank, *args)
    finally:
        dist.destroy_process_group()


def on_ranks(fn, world: int, tmp_path, *args, backend: str = "gloo") -> list:
    """[fn(rank, *args) for each of `world` ranks of `backend` ("gloo" on the CPU, or "nccl":
    one GPU per rank)], run in spawned processes; fn must be a module-level function and its
    result picklable. A rank that raises fails the call."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"on_ranks: backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise RuntimeError(f"on_ranks: {world} NCCL ranks need {world} GPUs")
    results = mp.Manager().dict()
    tmp_path.mkdir(parents=True, exist_ok=True)
    init_file = str(tmp_path / "init")
    mp.spawn(
        _rank_main, args=(world, init_file, fn, args, results, backend), nprocs=world, join=True
    )
    return [results[rank] for rank in range(world)]


def each_config(check, configs, *extra, named: bool = False, limit: int = 600) -> dict:
    """{key: "ok" or the error, cut to `limit` characters} of check(*config, *extra) for each
    config, run on this rank: the errors come back to the main process per config. The key is
    the config, or (check.__name__, *config) with named."""
    outcome = {}
    for config in configs:
        key = (check.__name__, *config) if named else config
        try:
            check(*config, *extra)
            outcome[key] = "ok"
        except Exception as err:  # reported per config, in the main process
            outcome[key] = f"{type(err).__name__}: {str(err)[:limit]}"
    return outcome
