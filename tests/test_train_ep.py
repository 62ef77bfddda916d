"""The training example with expert parallelism (--ep): 2 gloo ranks, each holding half of every
MoE layer's experts and training on half of every batch, start from the one-process model's
weights and reach the same losses as one process on the whole batch (fp32 compute, and FP8
current scaling within bf16's tolerance, as the tensor-parallel test), with the weights still
equal after the steps in fp32 (each rank's experts the one-process model's slice); the
options' checks. In the FP8 run one rank's experts can receive no rows at a step."""

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
EXPERTS = ["--experts", "4", "--top-k", "2"]


def _run(model_config, config, ep_group) -> tuple[list[float], dict]:
    """(losses of STEPS steps, the first MoE layer's expert fc1 weight and router weight)."""
    corpus = data.load_corpus(config.data, config.max_bytes, model_config.seq_len)
    trainer = loop.Trainer(config.recipes[0], model_config, config, corpus, ep_group=ep_group)
    losses = [trainer.train_step().item() for _ in range(STEPS)]
    mlp = trainer.model.blocks[0].mlp
    weights = {"fc1": mlp.experts.fc1.weight.detach().clone(), "router": mlp.router.weight}
    return losses, {k: v.detach().clone() for k, v in weights.items()}


def _rank_main(rank: int, args: list[str]) -> tuple[list[float], dict]:
    # parse_args refuses --ep outside torchrun: the Trainer is given the group directly
    model_config, config = cli.parse_args(args)
    config = dataclasses.replace(config, ep=2)
    return _run(model_config, config, dist.group.WORLD)


@pytest.mark.parametrize("recipe", ["bf16", "current"])
def test_expert_parallel_training_equals_one_process(tmp_path, recipe):
    args = tiny(write_corpus(tmp_path), tmp_path / "out", "--recipe", recipe, *EXPERTS)
    args += ["--compute-dtype", "fp32", "--batch-size", "4"]
    want, whole = _run(*cli.parse_args(args), None)
    ranks = on_ranks(_rank_main, 2, tmp_path, args)
    assert ranks[0][0] == ranks[1][0]  # the same (averaged) loss on every rank
    tol = torch.float32 if recipe == "bf16" else torch.bfloat16
    assert_close(torch.tensor(ranks[0][0]), torch.tensor(want, dtype=torch.float64), tol)
    for rank, (_, weights) in enumerate(ranks):
        assert weights["fc1"].shape[0] == 2  # half of the 4 experts
        if recipe != "bf16":  # AdamW moves rounding noise by whole steps: the losses only
            continue
        assert_close(weights["fc1"], whole["fc1"][2 * rank : 2 * rank + 2], tol, msg="experts")
        assert_close(weights["router"], whole["router"], tol, msg="router")


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--ep", "2"], "needs --experts"),
        (["--ep", "3", "--experts", "4"], "must divide --experts"),
        (["--ep", "2", "--experts", "4", "--tp", "2"], "--ep with --tp is not supported"),
        (["--ep", "2", "--experts", "4"], "launch it with torchrun --nproc-per-node 2"),
    ],
)
def test_bad_ep_options_end_with_a_message(tmp_path, capsys, extra, match):
    args = tiny(tmp_path / "corpus.txt", tmp_path / "out", *extra)
    with pytest.raises(SystemExit):
        cli.parse_args(args)
    assert match in capsys.readouterr().err
