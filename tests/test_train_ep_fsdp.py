"""The training example with expert parallelism and FSDP2 together (--ep 2 --fsdp): 2 gloo
ranks, each holding half of every MoE layer's experts (left whole by FSDP) and a shard of every
dense parameter, training on half of every batch, reach the losses of one process on the whole
batch; its --fsdp folders resume over --ep 2 --fsdp and under --fsdp alone, going on as a run
never interrupted; the options' checks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ranks import on_ranks
from test_train import tiny, write_corpus
from tolerances import assert_close
from torch.distributed.tensor import DTensor

from torchte.train import cli, data, fsdp_run, loop

EXPERTS = ["--experts", "4", "--top-k", "2"]


def _args(tmp_path: Path) -> list[str]:
    args = tiny(write_corpus(tmp_path), tmp_path / "out", "--recipe", "bf16", *EXPERTS)
    return [*args, "--compute-dtype", "fp32", "--batch-size", "4"]


def _trainer(args: list[str], ep: bool, save: Path | None = None) -> loop.Trainer:
    """A --fsdp trainer over the initialized group's ranks, with --ep over the same ranks where
    `ep` (parse_args refuses both outside torchrun: the layout is given directly)."""
    model_config, config = cli.parse_args(args)
    ranks = dist.get_world_size()
    config = dataclasses.replace(config, fsdp=True, ep=ranks if ep else 1, save=save)
    corpus = data.load_corpus(config.data, config.max_bytes, model_config.seq_len)
    dp = fsdp_run.data_parallel("cpu")
    group = dist.group.WORLD if ep else None
    return loop.Trainer(config.recipes[0], model_config, config, corpus, dp=dp, ep_group=group)


def _steps(trainer: loop.Trainer, steps: int) -> list[float]:
    return [trainer.train_step().item() for _ in range(steps)]


def _rank_train(rank: int, args: list[str]) -> dict:
    trainer = _trainer(args, ep=True)
    losses = _steps(trainer, 4)
    mlp = trainer.model.blocks[0].mlp
    experts, router = mlp.experts.fc1.weight, mlp.router.weight
    assert not isinstance(experts, DTensor) and experts.shape[0] == 2  # this rank's 2 of 4
    assert isinstance(router, DTensor)  # dense: sharded by FSDP
    assert trainer.optimizer.fused_steps == 4  # the step on this rank's pieces
    return {"losses": losses, "experts": experts.detach().clone()}


def test_expert_parallel_with_fsdp_equals_one_process(tmp_path: Path) -> None:
    args = _args(tmp_path)
    model_config, config = cli.parse_args(args)
    corpus = data.load_corpus(config.data, config.max_bytes, model_config.seq_len)
    whole = loop.Trainer(config.recipes[0], model_config, config, corpus)
    want = _steps(whole, 4)
    ranks = on_ranks(_rank_train, 2, tmp_path / "ranks", args)
    assert ranks[0]["losses"] == ranks[1]["losses"]
    want64 = torch.tensor(want, dtype=torch.float64)
    assert_close(torch.tensor(ranks[0]["losses"]), want64, torch.float32)
    whole_experts = whole.model.blocks[0].mlp.experts.fc1.weight.detach()
    for rank, got in enumerate(ranks):
        rows = whole_experts[2 * rank : 2 * rank + 2]
        assert_close(got["experts"], rows, torch.float32, msg=f"rank {rank}'s experts")


def _rank_save_resume(rank: int, args: list[str], folder: Path) -> dict:
    """4 steps uninterrupted; 2 steps saved to folder; resumed from it with --ep and with
    --fsdp alone, 2 steps each."""
    whole = _steps(_trainer(args, ep=True), 4)
    first = _trainer(args, ep=True, save=folder)
    _steps(first, 2)
    first.save(0.0)
    resumed = {}
    for name, ep in (("ep", True), ("fsdp", False)):
        trainer = _trainer(args, ep=ep)
        trainer.resume(folder)
        assert trainer.step == 2
        resumed[name] = _steps(trainer, 2)
    return {"whole": whole, **resumed}


def test_checkpoints_keep_every_ranks_experts(tmp_path: Path) -> None:
    """Each rank's experts go into the folder as its piece of the (E, ...) weights: resumed
    over --ep 2 --fsdp or under --fsdp alone (FSDP then shards the experts), the run goes on
    with the losses of one never interrupted. (Were only rank 0's experts saved, rank 1's would
    come back as rank 0's.)"""
    args = _args(tmp_path)
    got = on_ranks(_rank_save_resume, 2, tmp_path / "ranks", args, tmp_path / "saved")[0]
    want = torch.tensor(got["whole"][2:], dtype=torch.float64)
    assert_close(torch.tensor(got["ep"]), want, torch.float32, msg="resumed over --ep 2")
    assert_close(torch.tensor(got["fsdp"]), want, torch.float32, msg="resumed under --fsdp")


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--fp8-all-gather", "--recipe", "current"], "--ep with --fp8-all-gather"),
        ([], "launch it with torchrun --nproc-per-node 2 -m torchte.train --experts 4 --fsdp"),
    ],
)
def test_bad_options_end_with_a_message(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch, extra, match
) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = tiny(tmp_path / "corpus.txt", tmp_path / "out", *EXPERTS, "--ep", "2", "--fsdp")
    with pytest.raises(SystemExit):
        cli.parse_args([*args, *extra])
    assert match in capsys.readouterr().err


def test_the_batch_is_split_once_over_the_ranks(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--ep 2 --fsdp over 2 processes: each trains on half the batch (not a quarter), and the
    FP8 token check counts that half."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = tiny(tmp_path / "corpus.txt", tmp_path / "out", *EXPERTS, "--ep", "2", "--fsdp")
    args += ["--recipe", "current", "--batch-size", "2", "--seq-len", "24"]
    with pytest.raises(SystemExit):
        cli.parse_args(args)
    assert "--batch-size 2 / 2 --fsdp ranks x --seq-len 24 = 24 tokens" in capsys.readouterr().err
