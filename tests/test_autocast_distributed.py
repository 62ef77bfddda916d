"""Delayed-scaling amaxes are all-reduced (MAX) over the amax reduction group: 2 CPU ranks."""

from __future__ import annotations

import torch
from ranks import on_ranks

import torchte as te
from torchte import recipe

WORLD = 2


def _rank_main(rank: int) -> tuple[float, float]:
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
    return reduced_scale, local_scale


def test_amax_all_reduced_over_the_group(tmp_path):
    for rank, (reduced_scale, local_scale) in enumerate(on_ranks(_rank_main, WORLD, tmp_path)):
        assert reduced_scale == 448.0 / 2.0  # max over ranks of the input amax
        assert local_scale == 448.0 / 2.0**rank  # reduce_amax=False: this rank's own
