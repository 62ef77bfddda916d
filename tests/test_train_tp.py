"""The training example with tensor parallelism: 2 gloo ranks train the tiny model from the
one-rank model's weights and reach the same losses as one process (fp32 and bf16 compute, FP8
delayed and current scaling, with and without sequence parallelism), within the compute dtype's
tolerance: the split GEMMs add their partial sums in another order, so the last bits drift
over the steps."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from ranks import on_ranks
from test_train import tiny, write_corpus
from tolerances import assert_close

from torchte.train import checkpoint, cli, data, loop, tp_state

STEPS = 5


def _losses(args: list[str]) -> list[float]:
    model_config, config = cli.parse_args(args)
    return _losses_of(model_config, config, None)


def _losses_of(model_config, config, tp_group) -> list[float]:
    corpus = data.load_corpus(config.data, config.max_bytes, model_config.seq_len)
    trainer = loop.Trainer(config.recipes[0], model_config, config, corpus, tp_group)
    ranks = 1 if tp_group is None else dist.get_world_size(tp_group)
    block = trainer.model.blocks[0]
    assert block.self_attention.layernorm_qkv.query_weight.shape[0] == model_config.hidden // ranks
    assert block.layernorm_mlp.fc2_weight.shape[1] == model_config.ffn // ranks
    return [trainer.train_step().item() for _ in range(STEPS)]


def _rank_main(rank: int, args: list[str], sequence_parallel: bool) -> list[float]:
    # parse_args refuses --tp outside torchrun: the Trainer is given the group directly
    model_config, config = cli.parse_args(args)
    config = dataclasses.replace(config, tp=2, sequence_parallel=sequence_parallel)
    return _losses_of(model_config, config, dist.group.WORLD)


# Packed documents, RoPE, RMSNorm, a gated MLP (FC1's two halves split) and 2 key/value groups
# (one per rank) at once.
VARIANT = ["--packed", "--rope", "--normalization", "RMSNorm", "--activation", "swiglu"]
VARIANT += ["--gqa-groups", "2"]


@pytest.mark.parametrize(
    ("recipe", "compute", "sp", "extra"),
    [
        ("bf16", "fp32", False, []),
        ("delayed", "fp32", False, []),
        ("bf16", "bf16", False, []),
        ("bf16", "fp32", True, []),
        ("current", "fp32", True, []),
        ("bf16", "fp32", True, VARIANT),
    ],
)
def test_tensor_parallel_training_equals_one_process(tmp_path, recipe, compute, sp, extra):
    args = tiny(write_corpus(tmp_path), tmp_path / "out", "--recipe", recipe, *extra)
    args += ["--compute-dtype", compute]
    want = _losses(args)
    ranks = on_ranks(_rank_main, 2, tmp_path, args, sp)
    assert ranks[0] == ranks[1]  # the same stream on every rank
    # FP8: a tensor a few fp32 steps off the one-process run's (partial sums added in another
    # order) can round to a neighbouring FP8 value, so FP8 runs agree within bf16's tolerance.
    tol = torch.float32 if compute == "fp32" and recipe == "bf16" else torch.bfloat16
    assert_close(torch.tensor(ranks[0]), torch.tensor(want, dtype=torch.float64), tol)


def _steps(args, tp_group, steps: int, save=None, resume=None) -> list[float]:
    """Losses of `steps` steps of a trainer (over tp_group's ranks where given), resumed from
    `resume` and saved to `save` after them where given."""
    model_config, config = cli.parse_args([*args, *(["--save", str(save)] if save else [])])
    if tp_group is not None:
        config = dataclasses.replace(config, tp=dist.get_world_size(tp_group))
    corpus = data.load_corpus(config.data, config.max_bytes, model_config.seq_len)
    trainer = loop.Trainer(config.recipes[0], model_config, config, corpus, tp_group)
    if resume is not None:
        trainer.resume(resume)
        if tp_group is not None:  # the pieces put together again are the saved whole, exactly
            check_whole(trainer, checkpoint.load_checkpoint(resume), tp_group)
    losses = [trainer.train_step().item() for _ in range(steps)]
    if save is not None:
        trainer.save(0.0)
    return losses


def check_whole(trainer: loop.Trainer, saved: dict, group, *index) -> None:
    """The ranks' pieces put together (tp_state.whole_state, with its `index` where given)
    equal the saved whole model and AdamW state, exactly."""
    model, optim = tp_state.whole_state(trainer.model, trainer.optimizer, group, *index)
    for name, value in saved["model"].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(model[name], value), name
    for index, moments in saved["optimizer"]["state"].items():
        for key, value in moments.items():
            assert torch.equal(optim["state"][index][key], value), (index, key)


def _rank_steps(rank: int, args, steps: int, save, resume) -> list[float]:
    return _steps(args, dist.group.WORLD, steps, save, resume)


def test_checkpoints_carry_over_between_one_process_and_tensor_parallel(tmp_path):
    """A checkpoint holds the whole model whatever saved it: saved over 2 ranks it resumes in one
    process, saved in one process it resumes over 2 ranks (whose pieces put together are the
    saved model and AdamW state, exactly), each continuing with the losses of a run never
    interrupted, within bf16's tolerance as in the test above: the split GEMMs add in another
    order, which FP8 rounding amplifies, and so does AdamW, which divides each gradient by its
    own running size: the key biases' gradient (zero in exact arithmetic: softmax ignores a
    shift shared by every key) is rounding noise alone, and moves them by far more than the
    last bits."""
    args = tiny(write_corpus(tmp_path), tmp_path / "out", "--recipe", "delayed")
    args += ["--compute-dtype", "fp32"]
    want = _steps(args, None, 4)
    split_saved, one_saved = tmp_path / "split.pt", tmp_path / "one.pt"
    first = on_ranks(_rank_steps, 2, tmp_path / "a", args, 2, split_saved, None)[0]
    then = _steps(args, None, 2, resume=split_saved)
    assert_close(
        torch.tensor(first + then), torch.tensor(want, dtype=torch.float64), torch.bfloat16
    )
    _steps(args, None, 2, save=one_saved)
    then = on_ranks(_rank_steps, 2, tmp_path / "b", args, 2, None, one_saved)[0]
    assert_close(torch.tensor(then), torch.tensor(want[2:], dtype=torch.float64), torch.bfloat16)
