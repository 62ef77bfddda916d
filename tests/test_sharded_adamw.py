"""train/optimizer.py's ClippedAdamW over a model sharded by FSDP2 (clip_and_step's
shard_group): the pieces' squares summed over the ranks clip by the global norm, AdamW steps the
local pieces, and the result is torch's clip_grad_norm_ and AdamW on the whole model. On the
CPU (2 gloo ranks) the kernels' torch references run; on a GPU the Triton kernels, against
torch's fused AdamW over the same DTensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ranks import on_ranks
from tolerances import assert_close
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from torchte.train.optimizer import ClippedAdamW

STEPS = 3


def _model(device: str) -> torch.nn.Sequential:
    """Rows 130, 7 and 1 split over 2 ranks: an uneven split, and a bias of one row, which
    leaves rank 1 an empty piece."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 130), torch.nn.LayerNorm(130), torch.nn.Linear(130, 7),
        torch.nn.Linear(7, 1),
    ).to(device)  # fmt: skip


def _optimizer(model: torch.nn.Module, cls, fused: bool):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return cls(groups, lr=1e-2, betas=(0.9, 0.95), fused=fused)


def _backward(model: torch.nn.Module, step: int, device: str) -> None:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(33, 64, generator=gen).to(device)
    model(x).square().mean().mul(50.0).backward()  # large enough that clipping acts


def _no_fallback(*_args) -> None:
    raise AssertionError("the fused path was not taken")


def _sharded_steps(rank: int, device: str) -> dict:
    """STEPS steps of the sharded model (every rank the same batch: FSDP2's average of equal
    gradients is each one), a state_dict round trip in the middle; the whole parameters."""
    model = _model(device)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = _optimizer(model, ClippedAdamW, fused=device == "cuda")
    for step in range(STEPS):
        if step == 1:
            optimizer.load_state_dict(optimizer.state_dict())
        model.zero_grad(set_to_none=True)
        _backward(model, step, device)
        optimizer.clip_and_step(1.0, _no_fallback, torch.distributed.group.WORLD)
    moments = [optimizer.state[p]["exp_avg"] for p in model.parameters()]
    assert all(isinstance(m, DTensor) for m in moments)  # as torch's AdamW keeps them
    assert optimizer.fused_steps == STEPS
    assert all(optimizer.state[p]["step"].item() == STEPS for p in model.parameters())
    whole = [p.detach().full_tensor().cpu() for p in model.parameters()]
    # A plain parameter among the DTensors: the given clip and torch's step run instead.
    extra = torch.nn.Parameter(torch.ones(3, device=device))
    extra.grad = torch.ones(3, device=device)
    optimizer.add_param_group({"params": [extra]})
    clipped = []
    optimizer.clip_and_step(1.0, lambda params, norm: clipped.append(len(params)))
    assert clipped == [len(whole) + 1]
    return {"whole": whole}


def _whole_steps(device: str) -> list[torch.Tensor]:
    model = _model(device)
    optimizer = _optimizer(model, torch.optim.AdamW, fused=device == "cuda")
    for step in range(STEPS):
        model.zero_grad(set_to_none=True)
        _backward(model, step, device)
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
        optimizer.step()
    return [p.detach().cpu() for p in model.parameters()]


def test_two_gloo_ranks_step_as_one_process(tmp_path: Path) -> None:
    got = on_ranks(_sharded_steps, 2, tmp_path, "cpu")
    want = _whole_steps("cpu")
    for rank in got:
        for a, b in zip(rank["whole"], want, strict=True):
            assert_close(a, b, torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_nccl_rank_steps_as_torch_fused_adamw(tmp_path: Path) -> None:
    got = on_ranks(_sharded_steps, 1, tmp_path, "cuda", backend="nccl")[0]
    for a, b in zip(got["whole"], _whole_steps("cuda"), strict=True):
        assert_close(a, b, torch.float32)
