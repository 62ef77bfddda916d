"""The training example with context parallelism (`--cp 2`): 2 gloo ranks train the tiny model,
each on its load-balanced share of every sequence, and reach the one-process run's losses
within the compute dtype's tolerance (learned positions and RoPE, plain and grouped-query
attention); the command line refuses what --cp does not take."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from ranks import on_ranks
from test_train import tiny, write_corpus
from tolerances import assert_close

from torchte.train import cli, data, loop

STEPS = 4


def _losses(args: list[str], cp: int = 1) -> list[float]:
    model_config, config = cli.parse_args(args)
    config = dataclasses.replace(config, cp=cp)
    corpus = data.load_corpus(config.data, config.max_bytes, model_config.seq_len)
    trainer = loop.Trainer(config.recipes[0], model_config, config, corpus)
    losses = [trainer.train_step().item() for _ in range(STEPS)]
    return [*losses, trainer.evaluate()]


def _rank_main(rank: int, args: list[str]) -> list[float]:
    # parse_args refuses --cp outside torchrun: the config is given cp directly
    return _losses(args, dist.get_world_size())


@pytest.mark.parametrize(
    ("compute", "extra"),
    [("fp32", []), ("fp32", ["--rope", "--gqa-groups", "2"]), ("bf16", ["--rope"])],
)
def test_context_parallel_training_equals_one_process(tmp_path, compute, extra):
    args = tiny(write_corpus(tmp_path), tmp_path / "out", "--recipe", "bf16", *extra)
    args += ["--compute-dtype", compute]
    want = _losses(args)
    ranks = on_ranks(_rank_main, 2, tmp_path, args)
    assert ranks[0] == ranks[1]  # the loss of the whole sequences on every rank
    tol = torch.float32 if compute == "fp32" else torch.bfloat16
    assert_close(torch.tensor(ranks[0]), torch.tensor(want, dtype=torch.float64), tol)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--cp", "2", "--tp", "2"], "with --tp is not implemented"),
        (["--cp", "2", "--packed"], "with --packed is not implemented"),
        (["--cp", "2", "--fsdp"], "with --fsdp is not implemented"),
        (["--cp", "2", "--experts", "2"], "with --experts is not implemented"),
        (["--cp", "2", "--seq-len", "30"], "must be a multiple of 4"),
        (["--cp", "2"], "launch it with torchrun --nproc-per-node 2"),
    ],
)
def test_cp_refusals(tmp_path, capsys, extra, message):
    args = tiny(tmp_path, tmp_path / "out", *extra)
    with pytest.raises(SystemExit):
        cli.parse_args(args)
    assert message in capsys.readouterr().err
