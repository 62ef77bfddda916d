"""The training example with FSDP2 (--fsdp): 2 gloo ranks, each training on half of every batch
of the tiny model, reach the losses of one process that trains on the whole batch (without FP8,
FP8 delayed and current scaling); checkpoints written through torch.distributed.checkpoint resume
over another number of ranks, delayed-scaling state included; bad options fail before training.

The ranks add their gradients in another order than one process does (each sums its rows, then
the ranks' sums are averaged), so the weights drift apart in their last fp32 bits: the runs
without FP8 agree within fp32's tolerance. Under FP8 a weight a few bits off can round to a
neighbouring FP8 value, and current scaling scales each rank's activations by the amax of its
own rows (the batch's amax in one process), so FP8 runs agree within bf16's tolerance.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ranks import on_ranks
from test_train import tiny, write_corpus
from tolerances import assert_close
from torch.distributed.tensor import DTensor

from torchte.distributed.fsdp import FP8GatheredWeight
from torchte.train import checkpoint, cli, data, fsdp_run, fsdp_state, loop
from torchte.train.model import scaling_snapshot

STEPS = 4
# (recipe, compute dtype); "+ag": the FP8 weights gathered as FP8 (--fp8-all-gather).
CASES = [
    ("bf16", "fp32"),
    ("bf16", "bf16"),
    ("delayed", "fp32"),
    ("current", "fp32"),
    ("current+ag", "fp32"),
]


def _args(tmp_path: Path, recipe: str, compute: str) -> list[str]:
    recipe = recipe.removesuffix("+ag")  # set on the config (_trainer): the option needs torchrun
    args = tiny(tmp_path / "corpus", tmp_path / "out", "--recipe", recipe, "--batch-size", "4")
    return [*args, "--compute-dtype", compute, "--steps", str(STEPS)]


def _fp8_gathered(trainer: loop.Trainer) -> bool:
    weight = trainer.model.blocks[0].layernorm_mlp.fc1_weight
    return isinstance(weight.to_local(), FP8GatheredWeight)


def _trainer(args: list[str], fsdp: bool, gather: bool = False) -> loop.Trainer:
    """A trainer of `args`, sharded over the initialized group's ranks where `fsdp` (parse_args
    refuses --fsdp outside torchrun: the trainer is given the layout directly)."""
    model_config, config = cli.parse_args(args)
    corpus = data.load_corpus(config.data, config.max_bytes, model_config.seq_len)
    if not fsdp:
        return loop.Trainer(config.recipes[0], model_config, config, corpus)
    config = dataclasses.replace(config, fsdp=True, fp8_all_gather=gather)
    dp = fsdp_run.data_parallel("cpu")
    return loop.Trainer(config.recipes[0], model_config, config, corpus, dp=dp)


def _steps(trainer: loop.Trainer, steps: int) -> list[float]:
    return [trainer.train_step().item() for _ in range(steps)]


def _scales(trainer: loop.Trainer) -> list[list[float]]:
    """The forward scales of the te modules' delayed-scaling state (none before FP8 ran)."""
    return [s["fwd_scale"].tolist() for s in scaling_snapshot(trainer.model) if s]


def _rank_losses(rank: int, tmp_path: Path) -> list[list[float]]:
    losses = []
    for recipe, compute in CASES:
        gather = recipe.endswith("+ag")
        trainer = _trainer(_args(tmp_path, recipe, compute), fsdp=True, gather=gather)
        weight = trainer.model.blocks[0].layernorm_mlp.fc1_weight
        assert isinstance(weight, DTensor) and weight.to_local().shape[0] == weight.shape[0] // 2
        assert _fp8_gathered(trainer) == gather
        losses.append(_steps(trainer, STEPS))
    return losses


def test_two_ranks_reach_the_losses_of_one_process(tmp_path: Path) -> None:
    write_corpus(tmp_path)
    ranks = on_ranks(_rank_losses, 2, tmp_path / "ranks", tmp_path)
    assert ranks[0] == ranks[1]  # the losses are averaged over the ranks
    for (recipe, compute), got in zip(CASES, ranks[0], strict=True):
        want = _steps(_trainer(_args(tmp_path, recipe, compute), fsdp=False), STEPS)
        tol = torch.float32 if (recipe, compute) == ("bf16", "fp32") else torch.bfloat16
        msg = f"{recipe} recipe, {compute} compute"
        assert_close(torch.tensor(got), torch.tensor(want, dtype=torch.float64), tol, msg=msg)


# -- checkpoints ----------------------------------------------------------------------------


def _saved_run(args: list[str], steps: int, save: Path | None, resume: Path | None):
    """(losses of `steps` steps of a sharded trainer, its forward scales): resumed from `resume`
    where given (the scales just after), saved to `save` after the steps where given (the
    scales saved)."""
    trainer = _trainer([*args, *(["--save", str(save)] if save else [])], fsdp=True)
    scales = []
    if resume is not None:
        trainer.resume(resume)
        scales = _scales(trainer)
    losses = _steps(trainer, steps)
    if save is not None:
        trainer.save(0.0)
        scales = _scales(trainer)
    return losses, scales


def _rank_save_or_resume(rank: int, args, save, resume) -> tuple:
    return _saved_run(args, 2, save, resume)


def _one_rank_round_trips(rank: int, args, two: Path, one: Path) -> dict:
    whole = _steps(_trainer(args, fsdp=True), 4)
    first, _ = _saved_run(args, 2, one, None)
    then, _ = _saved_run(args, 2, None, one)
    from_two, scales = _saved_run(args, 2, None, two)
    return {"whole": whole, "split": first + then, "from_two": from_two, "scales": scales}


def test_checkpoints_resume_over_another_number_of_ranks(tmp_path: Path) -> None:
    """Saved over 2 ranks, a delayed-scaling run resumes over 1 with its scales and continues
    with the losses of a run never interrupted; saved over 1 it resumes over 2; over one rank a
    resumed run's losses are bit-identical."""
    write_corpus(tmp_path)
    args = _args(tmp_path, "delayed", "fp32")
    two, one = tmp_path / "two", tmp_path / "one"
    saved, saved_scales = on_ranks(_rank_save_or_resume, 2, tmp_path / "a", args, two, None)[0]
    assert (two / "position.pt").is_file() and not (tmp_path / "two.partial").exists()
    got = on_ranks(_one_rank_round_trips, 1, tmp_path / "b", args, two, one)[0]
    assert got["split"] == got["whole"]  # exactly: one rank, the same order of sums
    assert saved_scales and got["scales"] == saved_scales  # the delayed-scaling state, loaded
    want = torch.tensor(got["whole"], dtype=torch.float64)
    assert_close(torch.tensor(saved + got["from_two"]), want, torch.bfloat16)
    then = on_ranks(_rank_save_or_resume, 2, tmp_path / "c", args, None, one)[0][0]
    assert_close(torch.tensor(then), want[2:], torch.bfloat16)
    # What the folder's position says is checked before any rank loads it.
    model_config, config = cli.parse_args([*args, "--seq-len", "48"])
    corpus = data.load_corpus(config.data, config.max_bytes, model_config.seq_len)
    config = dataclasses.replace(config, fsdp=True, resume=two)
    with pytest.raises(SystemExit, match=r"seq_len 32 \(now 48\).*--seq-len"):
        cli.resume_steps(model_config, config, corpus)
    with pytest.raises(SystemExit, match=r"written under --fsdp; resume it with --fsdp"):
        cli.train([*args, "--resume", str(two)])
    model_config, config = cli.parse_args(args)
    config = dataclasses.replace(config, fsdp=True, resume=tmp_path / "one-process.pt")
    (tmp_path / "one-process.pt").write_bytes(b"")
    with pytest.raises(SystemExit, match=r"one-process checkpoint file .* without --fsdp"):
        cli.resume_steps(model_config, config, corpus)


# -- 2-D: FSDP over data-parallel ranks, tensor parallelism inside -----------------------------


def _trainer_2d(args: list[str]) -> loop.Trainer:
    """A trainer of `args` + --fsdp --tp 2 --sequence-parallel over the initialized group's
    ranks (WORLD_SIZE set as torchrun would)."""
    os.environ["WORLD_SIZE"] = str(dist.get_world_size())
    args = [*args, "--fsdp", "--tp", "2", "--sequence-parallel"]
    model_config, config = cli.parse_args(args)
    corpus = data.load_corpus(config.data, config.max_bytes, model_config.seq_len)
    dp = fsdp_run.data_parallel("cpu", config.tp)
    return loop.Trainer(config.recipes[0], model_config, config, corpus, dp.tp_group, dp)


def _rank_2d(rank: int, args, save: Path | None, resume: Path | None):
    """4 steps uninterrupted (and 2 more saved to `save`: the losses and a norm's weight then),
    or 2 steps resumed from `resume` (the losses)."""
    if resume is not None:
        trainer = _trainer_2d([*args, "--resume", str(resume)])
        trainer.resume(resume)
        return _steps(trainer, 2)
    first = _trainer_2d(args)
    norms = []
    sum_squares = first.optimizer._sum_squares

    def recorded(params, kernels, split_group):
        squares = sum_squares(params, kernels, split_group)
        total = squares.clone()
        dist.all_reduce(total, group=first.dp.group)
        norms.append(total.sqrt().item())
        return squares

    first.optimizer._sum_squares = recorded
    whole = _steps(first, 4)
    trainer = _trainer_2d([*args, "--save", str(save)])
    _steps(trainer, 2)
    trainer.save(0.0)
    # FSDP's shard of this rank's TP piece, still marked as one (the norm sums its squares
    # over the tensor-parallel ranks); the step taken on the local pieces
    weight = trainer.model.blocks[0].layernorm_mlp.fc1_weight
    assert isinstance(weight, DTensor) and weight.to_local().shape[0] * 2 == weight.shape[0]
    assert weight.tensor_model_parallel
    norm = trainer.model.blocks[0].layernorm_mlp.layer_norm_weight
    assert not getattr(norm, "tensor_model_parallel", False)
    assert trainer.optimizer.fused_steps == 2
    # whole on every tensor-parallel rank; its AdamW momentum (the clipped gradients' average)
    # equal there only if every rank clipped by the same norm
    momentum = trainer.optimizer.state[norm]["exp_avg"]
    return {"losses": whole, "norm": momentum.full_tensor(), "grad_norms": norms}


def test_fsdp_with_tensor_parallelism(tmp_path: Path) -> None:
    """--fsdp --tp 2 over 4 ranks (2 x 2, sequence parallel inside): the one-process losses
    (within bf16's tolerance: other orders of sums, per-rank current amaxes); saved there and
    resumed over 2 ranks (1 x 2), the run goes on as the uninterrupted one."""
    write_corpus(tmp_path)
    args = _args(tmp_path, "delayed", "fp32")
    folder = tmp_path / "2d"
    ranks = on_ranks(_rank_2d, 4, tmp_path / "a", args, folder, None)
    whole = [r["losses"] for r in ranks]
    assert all(losses == whole[0] for losses in whole)
    assert all(torch.equal(r["norm"], ranks[0]["norm"]) for r in ranks)
    one, norms = _trainer(args, fsdp=False), []
    clip = torch.nn.utils.clip_grad_norm_

    def recorded(params, max_norm):
        norms.append(clip(params, max_norm).item())

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.utils, "clip_grad_norm_", recorded)
        want = torch.tensor(_steps(one, 4), dtype=torch.float64)
    assert_close(torch.tensor(whole[0]), want, torch.bfloat16)
    # the clipping norm over every piece: each tensor-parallel piece's squares counted once
    assert norms[0] > 1.0  # clipping acts
    for r in ranks:
        assert_close(torch.tensor(r["grad_norms"]), torch.tensor(norms), torch.bfloat16)
    resumed = on_ranks(_rank_2d, 2, tmp_path / "b", args, None, folder)
    assert_close(torch.tensor(resumed[0]), want[2:], torch.bfloat16)


def _rank_backward_amaxes(rank: int, tmp_path: Path) -> list[torch.Tensor]:
    trainer = _trainer(_args(tmp_path, "delayed", "fp32"), fsdp=True)
    trainer.train_step()
    return [state["bwd_amax_history"] for state in scaling_snapshot(trainer.model) if state]


def test_gradients_inside_backward_have_the_values_of_one_process(tmp_path: Path) -> None:
    """Each rank back-propagates its loss divided by the ranks and FSDP2 sums their gradients:
    the gradient amaxes delayed scaling records in the first backward (the max over the ranks)
    equal one process's on the whole batch, so the gradients' FP8 casts see the same values.
    (Ranks that average instead hold twice the gradients inside backward: under the first
    step's scale of 1 more of one process's values flush to zero in e5m2, and the runs part.)"""
    write_corpus(tmp_path)
    ranks = on_ranks(_rank_backward_amaxes, 2, tmp_path / "ranks", tmp_path)
    one = _trainer(_args(tmp_path, "delayed", "fp32"), fsdp=False)
    one.train_step()
    want = [state["bwd_amax_history"] for state in scaling_snapshot(one.model) if state]
    assert len(ranks[0]) == len(want) > 0
    for got, expected in zip(ranks[0], want, strict=True):
        assert expected.abs().sum() > 0  # the first backward recorded amaxes
        assert_close(got, expected, torch.float32)


# -- what FSDP2 gathers, and when -----------------------------------------------------------


def _gathered_trainer(
    tmp_path: Path, gather: str, prefetch: bool, keep: bool = False
) -> loop.Trainer:
    """The tiny bf16 model's trainer over the group's ranks, shard_model(gather_dtype=gather,
    prefetch=prefetch, keep_gathered=keep)."""
    model_config, config = cli.parse_args(_args(tmp_path, "bf16", "bf16"))
    config = dataclasses.replace(
        config, fsdp=True, fsdp_gather_dtype=gather, fsdp_keep_gathered=keep
    )
    corpus = data.load_corpus(config.data, config.max_bytes, model_config.seq_len)
    shard = fsdp_run.shard_model
    loop.shard_model = functools.partial(shard, prefetch=prefetch)
    try:
        return loop.Trainer("bf16", model_config, config, corpus, dp=fsdp_run.data_parallel("cpu"))
    finally:
        loop.shard_model = shard


def _rank_gathers(rank: int, tmp_path: Path) -> dict[str, object]:
    """Per setting of shard_model: the losses of STEPS steps, the dtype the first block's
    fc1 weight had inside its forward, and the all-gathers FSDP2 called."""
    outcome = {}
    for name, gather, prefetch, keep in (
        ("fp32", "fp32", True, False),
        ("fp32, no prefetch", "fp32", False, False),
        ("fp32, kept", "fp32", True, True),
        ("bf16", "bf16", True, False),
    ):
        trainer = _gathered_trainer(tmp_path, gather, prefetch, keep)
        seen = []
        trainer.model.blocks[0].layernorm_mlp.register_forward_pre_hook(
            functools.partial(_record_fc1_dtype, seen)
        )
        with _counted_all_gathers() as gathers:
            losses = _steps(trainer, STEPS)
        outcome[name] = (losses, seen[0], gathers[0])
        outcome["blocks"] = len(trainer.model.blocks)
        assert trainer.model.blocks[0].layernorm_mlp.fc1_weight.dtype == torch.float32  # shard
    return outcome


@contextlib.contextmanager
def _counted_all_gathers():
    """[how many all-gathers torch.distributed ran inside]: FSDP2's (all_gather_into_tensor
    or, in some torch releases, all_gather_single)."""
    count = [0]
    originals = {
        name: getattr(dist, name)
        for name in ("all_gather_into_tensor", "all_gather_single")
        if hasattr(dist, name)
    }

    def counted(*args, _original, **kwargs):
        count[0] += 1
        return _original(*args, **kwargs)

    for name, original in originals.items():
        setattr(dist, name, functools.partial(counted, _original=original))
    try:
        yield count
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def _record_fc1_dtype(seen: list, module: torch.nn.Module, args) -> None:
    seen.append(module.fc1_weight.dtype)


def test_gather_dtype_and_prefetch(tmp_path: Path) -> None:
    """--fsdp-gather-dtype bf16: the blocks compute from bf16-gathered weights (the fp32
    shards stay the masters) and train as the fp32 gather does within bf16's tolerance;
    prefetching the next block's all-gather changes the order of work, not a bit of the
    losses; --fsdp-keep-gathered neither, and its backwards gather nothing (one gather a
    block and step, and the root's, where resharding gathers each block twice)."""
    write_corpus(tmp_path)
    ranks = on_ranks(_rank_gathers, 2, tmp_path / "ranks", tmp_path)
    assert ranks[0] == ranks[1]
    got = ranks[0]
    assert got["fp32"][1] == torch.float32 and got["bf16"][1] == torch.bfloat16
    assert got["fp32, no prefetch"] == got["fp32"]
    assert got["fp32, kept"][:2] == got["fp32"][:2]
    blocks = got["blocks"]
    assert got["fp32"][2] == STEPS * (2 * blocks + 1)
    assert got["fp32, kept"][2] == STEPS * (blocks + 1)
    want = torch.tensor(got["fp32"][0], dtype=torch.float64)
    assert_close(torch.tensor(got["bf16"][0]), want, torch.bfloat16)
    assert got["bf16"][0] != got["fp32"][0]  # the gather did change the arithmetic


# -- bad options ----------------------------------------------------------------------------


def _error(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit) as info:
        cli.parse_args(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


def test_bad_fsdp_options_are_refused_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    args = tiny(tmp_path, tmp_path / "out", "--recipe", "delayed")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert "launch it with torchrun --nproc-per-node N" in _error([*args, "--fsdp"], capsys)
    assert "it needs --fsdp" in _error([*args, "--fp8-all-gather"], capsys)
    monkeypatch.setenv("WORLD_SIZE", "2")
    err = _error([*args, "--fsdp", "--batch-size", "3"], capsys)
    assert "--batch-size 3 must be a multiple of 2" in err
    err = _error([*args, "--fsdp", "--tp", "3"], capsys)
    assert "the 2 processes must be a multiple of 3" in err
    folder = tmp_path / "saved-2d"
    folder.mkdir()
    checkpoint.save_checkpoint(folder / checkpoint.SHARDED_POSITION, {"tp": 2})
    with pytest.raises(SystemExit, match="saved with --tp 2, this run has --tp 1"):
        fsdp_state.load_sharded(folder, torch.nn.Linear(2, 2), None)
    err = _error([*args, "--fsdp", "--batch-size", "2", "--seq-len", "24"], capsys)
    assert "--batch-size 2 / 2 --fsdp ranks x --seq-len 24 = 24 tokens" in err
    err = _error([*args, "--fsdp", "--fp8-all-gather", "--recipe", "bf16"], capsys)
    assert "it needs --recipe delayed or current" in err
    err = _error([*args, "--fsdp", "--fsdp-gather-dtype", "fp16"], capsys)
    assert "invalid choice: 'fp16'" in err
    monkeypatch.delenv("WORLD_SIZE")
    assert "it needs --fsdp" in _error([*args, "--fsdp-gather-dtype", "bf16"], capsys)
    assert "it needs --fsdp" in _error([*args, "--fsdp-keep-gathered"], capsys)
    monkeypatch.setenv("WORLD_SIZE", "2")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    _, config = cli.parse_args([*args, "--fsdp", "--save", str(tmp_path / "notes")])
    with pytest.raises(SystemExit, match="a folder with other files in it"):
        cli.check_outputs(config)
    assert (tmp_path / "notes" / "keep.txt").read_text() == "mine"


def test_torchrun_prints_one_report(tmp_path: Path) -> None:
    """Under torchrun, rank 0 alone prints the log and the table, and writes the outputs."""
    args = tiny(write_corpus(tmp_path), tmp_path / "out", "--recipe", "bf16", "--steps", "2")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", "-m", "torchte.train", "--fsdp", *args]
    command += ["--batch-size", "4", "--save", str(tmp_path / "ckpt")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "sharded over 2 ranks (FSDP)" in done.stdout
    assert done.stdout.count("recipe ") == 1  # one table
    assert (tmp_path / "out" / "losses.csv").is_file()
    assert (tmp_path / "ckpt" / "position.pt").is_file()
