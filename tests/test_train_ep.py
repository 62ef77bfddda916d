"""The training example with expert parallelism (--ep): 2 gloo ranks, each holding half of every
MoE layer's experts and training on half of every batch, start from the one-process model's
weights and reach the same losses as one process on the whole batch (fp32 compute, and FP8
current scaling within bf16's tolerance, as the tensor-parallel test), with the weights still
equal after the steps in fp32 (each rank's experts the one-process model's slice); the
options' checks. In the FP8 run one rank's experts can receive no rows at a step. Checkpoints
carry over between one process and --ep 2 both ways."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from ranks import on_ranks
from test_train import tiny, write_corpus
from test_train_tp import check_whole
from tolerances import assert_close

from torchte.train import checkpoint, cli, data, loop, tp_state

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
        (["--ep", "2", "--experts", "4", "--tp", "2"], "with sequence parallelism only"),
        (["--ep", "2", "--experts", "4"], "launch it with torchrun --nproc-per-node 2"),
    ],
)
def test_bad_ep_options_end_with_a_message(tmp_path, capsys, extra, match):
    args = tiny(tmp_path / "corpus.txt", tmp_path / "out", *extra)
    with pytest.raises(SystemExit):
        cli.parse_args(args)
    assert match in capsys.readouterr().err


def _steps(args, ep_group, steps: int, save=None, resume=None) -> list[float]:
    """Losses of `steps` steps of a trainer (its experts split over ep_group's ranks where
    given), resumed from `resume` and saved to `save` after them where given."""
    model_config, config = cli.parse_args([*args, *(["--save", str(save)] if save else [])])
    if ep_group is not None:
        config = dataclasses.replace(config, ep=dist.get_world_size(ep_group))
    corpus = data.load_corpus(config.data, config.max_bytes, model_config.seq_len)
    trainer = loop.Trainer(config.recipes[0], model_config, config, corpus, ep_group=ep_group)
    if resume is not None:
        trainer.resume(resume)
        if ep_group is not None:  # the ranks' experts put together are the saved ones, exactly
            saved = checkpoint.load_checkpoint(resume)
            check_whole(trainer, saved, ep_group, tp_state.expert_index)
    losses = [trainer.train_step().item() for _ in range(steps)]
    if save is not None:
        trainer.save(0.0)
    return losses


def _rank_steps(rank: int, args, steps: int, save, resume) -> list[float]:
    return _steps(args, dist.group.WORLD, steps, save, resume)


def test_checkpoints_carry_over_between_one_process_and_expert_parallel(tmp_path):
    """A checkpoint of an --ep run holds every expert (the one-process format): saved over 2
    ranks it resumes in one process, saved in one process it resumes over 2 ranks (whose
    experts put together are the saved ones, AdamW's moments included, exactly), each going on
    with the losses of a run never interrupted (fp32 compute: within fp32's tolerance)."""
    args = tiny(write_corpus(tmp_path), tmp_path / "out", "--recipe", "bf16", *EXPERTS)
    args += ["--compute-dtype", "fp32", "--batch-size", "4"]
    want = _steps(args, None, 4)
    split_saved, one_saved = tmp_path / "split.pt", tmp_path / "one.pt"
    first = on_ranks(_rank_steps, 2, tmp_path / "a", args, 2, split_saved, None)[0]
    then = _steps(args, None, 2, resume=split_saved)
    assert_close(torch.tensor(first + then), torch.tensor(want, dtype=torch.float64), torch.float32)
    _steps(args, None, 2, save=one_saved)
    then = on_ranks(_rank_steps, 2, tmp_path / "b", args, 2, None, one_saved)[0]
    assert_close(torch.tensor(then), torch.tensor(want[2:], dtype=torch.float64), torch.float32)
