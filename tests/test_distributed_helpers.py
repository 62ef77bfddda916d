"""te.distributed: the collectives (2 gloo ranks on the CPU, through the fallbacks) and the RNG
states tracker."""

from __future__ import annotations

import pytest
import torch
from ranks import on_ranks

import torchte as te

WORLD = 2


def _rank_main(rank: int) -> tuple:
    x = torch.arange(6.0).view(3, 2) + 10 * rank
    gathered, handle = te.distributed.gather_along_first_dim(x, None)
    assert handle is None
    full = torch.arange(8.0).view(4, 2) * (rank + 1)
    part, handle = te.distributed.reduce_scatter_along_first_dim(full, None, async_op=True)
    handle.wait()
    summed, _ = te.distributed.allreduce(torch.full((2,), float(rank + 1)))
    try:
        te.distributed.reduce_scatter_along_first_dim(torch.ones(3, 2), None)
        odd = "no error"
    except ValueError as err:
        odd = str(err)
    return gathered, part, summed, odd


def test_collectives_on_two_gloo_ranks(tmp_path):
    results = on_ranks(_rank_main, WORLD, tmp_path)
    rank_inputs = [torch.arange(6.0).view(3, 2) + 10 * r for r in range(WORLD)]
    total = sum(torch.arange(8.0).view(4, 2) * (r + 1) for r in range(WORLD))
    for rank in range(WORLD):
        gathered, part, summed, odd = results[rank]
        assert torch.equal(gathered, torch.cat(rank_inputs))
        assert torch.equal(part, total[2 * rank : 2 * rank + 2])
        assert torch.equal(summed, torch.full((2,), 3.0))
        assert "divisible by the group's 2 ranks" in odd


def test_collectives_without_a_group_are_identities():
    x = torch.randn(3, 4)
    for fn in (
        te.distributed.gather_along_first_dim,
        te.distributed.reduce_scatter_along_first_dim,
        te.distributed.allreduce,
    ):
        out, handle = fn(x, None)
        assert out is x and handle is None


def test_rng_states_tracker():
    tracker = te.distributed.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)
    before = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream is left as it was
    saved = tracker.get_states()
    with tracker.fork():
        second = torch.rand(4)
    assert not torch.equal(first, second)  # the forked state advanced
    tracker.set_states(saved)
    with tracker.fork():
        assert torch.equal(torch.rand(4), second)  # replayed
    with pytest.raises(ValueError, match="seed 1234 already exists"):
        tracker.add("other", 1234)
    with pytest.raises(KeyError, match="no state 'data'"), tracker.fork("data"):
        pass
    assert te.distributed.checkpoint is te.checkpoint
