"""The training example with expert and tensor parallelism over the same ranks (--experts 4
--ep 2 --tp 2 --sequence-parallel): 2 gloo ranks split the attention Megatron-style and the
experts, each rank's MoE layers taking its rows of the batch; they start from the one-process
model's weights and reach its losses (fp32 compute without FP8 within fp32's tolerance, FP8
current scaling within bf16's), and checkpoints carry over between one process and the split
run both ways; the options' checks."""

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


def _args(tmp_path, recipe: str) -> list[str]:
    args = tiny(write_corpus(tmp_path), tmp_path / "out", "--recipe", recipe, *EXPERTS)
    return [*args, "--compute-dtype", "fp32", "--batch-size", "4"]


def _steps(args, split: bool, steps: int, save=None, resume=None) -> list[float]:
    """Losses of `steps` steps of a trainer (split over the initialized group's ranks where
    `split`), resumed from `resume` and saved to `save` after them where given."""
    model_config, config = cli.parse_args([*args, *(["--save", str(save)] if save else [])])
    group = None
    if split:  # parse_args refuses --ep / --tp outside torchrun: the layout is given directly
        ranks = dist.get_world_size()
        config = dataclasses.replace(config, ep=ranks, tp=ranks, sequence_parallel=True)
        group = dist.group.WORLD
    corpus = data.load_corpus(config.data, config.max_bytes, model_config.seq_len)
    trainer = loop.Trainer(
        config.recipes[0], model_config, config, corpus, tp_group=group, ep_group=group
    )
    if split:
        mlp = trainer.model.blocks[0].mlp
        assert mlp.experts.fc1.weight.shape[0] == 2  # half of the 4 experts
        qkv = trainer.model.blocks[0].self_attention.layernorm_qkv
        assert qkv.query_weight.shape[0] * 2 == model_config.hidden  # half of the heads
    if resume is not None:
        trainer.resume(resume)
    losses = [trainer.train_step().item() for _ in range(steps)]
    if save is not None:
        trainer.save(0.0)
    return losses


def _rank_steps(rank: int, args, steps: int, save, resume) -> list[float]:
    return _steps(args, True, steps, save, resume)


@pytest.mark.parametrize("recipe", ["bf16", "current"])
def test_expert_and_tensor_parallel_training_equals_one_process(tmp_path, recipe):
    args = _args(tmp_path, recipe)
    want = _steps(args, False, STEPS)
    ranks = on_ranks(_rank_steps, 2, tmp_path / "ranks", args, STEPS, None, None)
    assert ranks[0] == ranks[1]  # the same (averaged) loss on every rank
    tol = torch.float32 if recipe == "bf16" else torch.bfloat16
    assert_close(torch.tensor(ranks[0]), torch.tensor(want, dtype=torch.float64), tol)


def test_checkpoints_carry_over_both_ways(tmp_path):
    """Saved over the 2 split ranks (the one-process format: every expert and every
    tensor-parallel piece put together), a run resumes in one process; saved in one process it
    resumes split; each goes on with the losses of a run never interrupted."""
    args = _args(tmp_path, "bf16")
    want = torch.tensor(_steps(args, False, 4), dtype=torch.float64)
    split_saved, one_saved = tmp_path / "split.pt", tmp_path / "one.pt"
    first = on_ranks(_rank_steps, 2, tmp_path / "a", args, 2, split_saved, None)[0]
    then = _steps(args, False, 2, resume=split_saved)
    assert_close(torch.tensor(first + then), want, torch.float32)
    _steps(args, False, 2, save=one_saved)
    then = on_ranks(_rank_steps, 2, tmp_path / "b", args, 2, None, one_saved)[0]
    assert_close(torch.tensor(then), want[2:], torch.float32)


@pytest.mark.parametrize(
    ("world", "extra", "match"),
    [
        ("2", ["--tp", "2", "--sequence-parallel"], "needs --ep 2 --sequence-parallel"),
        ("2", ["--tp", "2", "--ep", "2"], "over the same ranks with sequence parallelism only"),
        (
            None,
            ["--tp", "2", "--ep", "2", "--sequence-parallel"],
            "-m torchte.train --experts 4 --tp 2 --sequence-parallel --ep 2",
        ),
    ],
)
def test_bad_options_end_with_a_message(tmp_path, capsys, monkeypatch, world, extra, match):
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    args = tiny(tmp_path / "corpus.txt", tmp_path / "out", *EXPERTS, *extra)
    with pytest.raises(SystemExit):
        cli.parse_args(args)
    assert match in capsys.readouterr().err
