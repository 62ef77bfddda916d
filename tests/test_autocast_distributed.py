"""Delayed-scaling amaxes are all-reduced (MAX) over the amax reduction group: 2 CPU ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torchte as te
from torchte import recipe

WORLD = 2


def _rank_main(rank: int, init_file: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)  # same weights on every rank
        layer = te.Linear(16, 16, device="cpu")
        # Rank r's input has amax 2**r: the reduced input amax is 2 on every rank.
        x = torch.full((4, 16), 0.5) * 2.0**rank
        x[0, 0] = 2.0**rank
        reduced = recipe.DelayedScaling(amax_history_len=2)
        local = recipe.DelayedScaling(amax_history_len=3, reduce_amax=False)
        with te.autocast(recipe=reduced):
            layer(x)
        with te.autocast(recipe=local):
            layer(x)
        reduced_scale = layer._delayed_states[2][0].scale[0].item()
        local_scale = layer._delayed_states[3][0].scale[0].item()
        results[rank] = (reduced_scale, local_scale)
    finally:
        dist.destroy_process_group()


def test_amax_all_reduced_over_the_group(tmp_path):
    results = mp.Manager().dict()
    mp.spawn(_rank_main, args=(str(tmp_path / "init"), results), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        reduced_scale, local_scale = results[rank]
        assert reduced_scale == 448.0 / 2.0  # max over ranks of the input amax
        assert local_scale == 448.0 / 2.0**rank  # reduce_amax=False: this rank's own
