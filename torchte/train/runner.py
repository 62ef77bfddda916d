"""The run of `python -m torchte.train`: the checks of --out, --save and --resume before the first
step, the corpus, each recipe trained in turn with the lines it prints, then the outputs
(outputs.py) and the command that continues from the checkpoints saved (resume_command.py) or,
after Ctrl-C, where each recipe stopped. A loss that became inf or nan ends the run with its
message (exit status 1) and no table.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from . import checkpoint
from .arguments import build_parser, parse_args
from .config import ModelConfig, RunConfig
from .data import Corpus, load_corpus
from .divergence import Diverged
from .estimate import estimate_run
from .fsdp_run import DataParallel, data_parallel
from .fsdp_state import check_save_path, read_position
from .interruption import interruption_report
from .loop import RunResult, Trainer, check_resumable
from .model import count_parameters
from .optimizer_choice import params_dtype
from .outputs import write_outputs
from .parallel import launched_run, tensor_parallel_run
from .progress import Progress, format_duration
from .report import Summary, check_writable, peak_memory, reset_peak_memory, summarize
from .resume_command import continue_hint
from .threads import describe_threads, run_threads

__all__ = ["check_outputs", "describe_model", "resume_steps", "run_recipes", "train"]


def describe_model(
    config: ModelConfig, parameters: int, compute_dtype: str, master_weights: bool = False
) -> str:
    """One line: the model's shape, parameter count and dtypes."""
    mlp = f"{config.experts} experts, top-{config.top_k}" if config.experts else "dense MLP"
    weights = str(params_dtype(master_weights)).removeprefix("torch.")
    weights += " (fp32 masters in the optimizer)" if master_weights else ""
    groups = f" ({config.gqa_groups} kv groups)" if config.gqa_groups != config.heads else ""
    positions = "RoPE" if config.rope else "learned positions"
    packed = ", packed documents" if config.packed else ""
    return (
        f"model: {config.layers} layers, hidden {config.hidden}, {config.heads} heads{groups}, "
        f"ffn {config.ffn}, {mlp}, {config.normalization}, {config.activation}, {positions}, "
        f"seq {config.seq_len}{packed}: {parameters / 1e6:.2f}M parameters ({weights} weights, "
        f"{compute_dtype} compute)"
    )


def check_outputs(config: RunConfig) -> None:
    """SystemExit (status 1) unless --out and --save can be written: checked before training,
    so that a run never ends without its results for want of a folder."""
    check_writable(config.out, f"--out {config.out}")
    if config.save is None:
        return
    save, several = config.save, len(config.recipes) > 1
    paths = [checkpoint.recipe_path(save, name, several) for name in config.recipes]
    if config.fsdp:
        if several and save.is_dir():  # each recipe's folder would go beside it
            inside = [checkpoint.recipe_path(save / "ckpt", name, True) for name in config.recipes]
            raise SystemExit(
                f"--save {save}: {save} is a folder, and with {len(paths)} recipes their "
                f"checkpoint folders would go beside it ({_names(paths)}); give a new path, "
                f"such as {save / 'ckpt'} (written as {_names(inside)})"
            )
        for path in paths:
            check_save_path(path)
    else:
        _check_save_files(save, config.recipes, paths)
    check_writable(save.parent, f"--save {save}")


def _check_save_files(save: Path, recipes: tuple[str, ...], paths: list[Path]) -> None:
    """SystemExit if --save `save`, or with several recipes a file beside it that one of them
    would be saved to (`paths`, one per recipe), is a folder: a one-process checkpoint is a
    file."""
    several = len(recipes) > 1
    folders = [p for p in ([save] if several else []) + paths if p.is_dir()]
    if not folders:
        return
    named = f"{folders[0]} is a folder" if len(folders) == 1 else f"{_names(folders)} are folders"
    if save.is_dir():
        fix = f"give a file path, such as {save / 'ckpt.pt'}"
        if several:
            inside = [checkpoint.recipe_path(save / "ckpt.pt", name, True) for name in recipes]
            fix += f" (written as {_names(inside)})"
    else:
        beside = _names(paths)
        fix = f"give a file path whose recipes' checkpoints (beside it: {beside}) are not folders"
    if several and all(p.is_file() for p in paths):  # what an earlier run saved with it
        fix += f"; to continue from {_names(paths)}, pass --resume {save}"
    raise SystemExit(f"--save {save}: {named}; {fix}")


def _names(paths: list[Path]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    names = [str(p) for p in paths]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def resume_steps(model_config: ModelConfig, config: RunConfig, corpus: Corpus) -> list[int]:
    """The step each recipe starts from: 0, or with --resume its checkpoint's, every checkpoint
    checked (SystemExit if one does not fit) before any recipe trains."""
    if config.resume is None:
        return [0] * len(config.recipes)
    steps = []
    for name in config.recipes:
        path = checkpoint.recipe_path(config.resume, name, len(config.recipes) > 1)
        # mmap: the tensors stay on disk (a --fsdp folder's position holds none)
        state = read_position(path) if config.fsdp else checkpoint.load_checkpoint(path, mmap=True)
        check_resumable(state, path, name, model_config, config, corpus)
        steps.append(int(state["step"]))
    if min(steps) >= config.steps:  # check_resumable let only a finished schedule through
        whose = "every recipe's checkpoint" if len(steps) > 1 else "the checkpoint"
        done = checkpoint.at_the_end(config.steps, config.steps, whose)
        raise SystemExit(
            f"--resume {config.resume}: {done}; to train longer, start a new run with a larger "
            "--steps (without --resume)"
        )
    return steps


def train(argv: list[str] | None = None) -> list[RunResult]:
    """Run the command line: train each recipe, then write the table, CSV and plot
    (SystemExit(130) after them when Ctrl-C stopped the run). torch's CPU thread count is
    the run's (--threads) while it trains, and as it was afterwards."""
    model_config, config = parse_args(argv)
    with run_threads(config.threads):
        return _train_in_groups(model_config, config, argv)


def _train_in_groups(model_config: ModelConfig, config: RunConfig, argv) -> list[RunResult]:
    """train() after the arguments: _train inside the run's process groups."""
    run = functools.partial(_train, model_config, config, sys.argv[1:] if argv is None else argv)
    if config.fsdp:  # with --ep the same ranks split the experts (ep_run.py)
        with launched_run(config.device) as group:
            dp, ep_group = data_parallel(config.device, config.tp), None
            if config.ep > 1:
                ep_group = group
            return run(group, dp, ep_group)
    if config.cp > 1:  # context parallelism over torchrun's processes (the Trainer's group)
        with launched_run(config.device):
            return run(None)
    if config.ep > 1:  # expert parallelism (ep_run.py) over torchrun's processes (with --tp:
        with launched_run(config.device) as group:  # the same ones)
            return run(group if config.tp > 1 else None, ep_group=group)
    with tensor_parallel_run(config.tp, config.device) as group:
        return run(group)


def _train(
    model_config: ModelConfig,
    config: RunConfig,
    argv: list[str],
    group,
    dp: DataParallel | None = None,
    ep_group=None,
) -> list[RunResult]:
    """train() inside its process group; argv: the command line's arguments (for the command
    that continues the run)."""
    check_outputs(config)
    corpus = load_corpus(config.data, config.max_bytes, model_config.seq_len)
    capped = f", capped at --max-bytes {config.max_bytes}" if corpus.capped else ""
    print(
        f"data: {corpus.source}: {corpus.files} files ({corpus.skipped} skipped as not UTF-8 "
        f"text){capped}; {corpus.train.numel():,} bytes train, {corpus.val.numel():,} bytes "
        "validation",
        flush=True,
    )
    starts = resume_steps(model_config, config, corpus)
    labels = [config.label(name) for name in config.recipes]
    print(
        f"run: {', '.join(labels)} on {config.device}, compute {config.compute_dtype} "
        f"({config.compute_reason}){describe_threads(config.threads, config.threads_reason)}; "
        f"{config.steps} steps of {config.batch_size} x "
        f"{model_config.seq_len} tokens, lr {config.lr:g} (warmup {config.warmup}, cosine), "
        f"validation every {config.eval_every} steps; CUDA graphs "
        f"{'on' if config.cuda_graph else 'off'} ({config.cuda_graph_reason})",
        flush=True,
    )
    results, summaries = run_recipes(model_config, config, corpus, starts, group, dp, ep_group)
    writes = _rank0(group) and _rank0(ep_group)
    if summaries and writes:
        write_outputs(model_config, config, results, summaries)
    if len(results) < len(config.recipes) or results[-1].interrupted:
        print(interruption_report(results, config), flush=True)
        raise SystemExit(130)
    if config.save is not None and writes:
        ranks = dist.get_world_size() if dist.is_initialized() else None
        print(continue_hint(config, argv, build_parser().prog, ranks), flush=True)
    return results


def run_recipes(
    model_config: ModelConfig,
    config: RunConfig,
    corpus: Corpus,
    starts: list[int],
    group=None,
    dp: DataParallel | None = None,
    ep_group=None,
) -> tuple[list[RunResult], list[Summary]]:
    """Train each recipe in turn (from its step in `starts`) and summarize it; stops after
    a run that Ctrl-C interrupted, or at a recipe whose setup it interrupted. group: the
    tensor-parallel ranks (without dp); dp: FSDP's; ep_group: expert parallelism's."""
    device = torch.device(config.device)
    results, summaries = [], []
    for i, name in enumerate(config.recipes):
        later = sum(config.last_step - min(s, config.last_step) for s in starts[i + 1 :])
        try:
            tp_group = dp.tp_group if dp else group
            trainer = Trainer(name, model_config, config, corpus, tp_group, dp, ep_group)
            if not results:
                parameters = count_parameters(trainer.model)
                line = describe_model(
                    model_config, parameters, config.compute_dtype, config.master_weights
                )
                if dp is not None:
                    if dp.tp_group is not None:
                        line += f", split over {config.tp} tensor-parallel ranks"
                    line += f", sharded over {dp.size} ranks (FSDP)"
                    if ep_group is not None:
                        line += f", experts split over them ({config.ep} expert-parallel ranks)"
                elif group is not None:
                    line += f", on each of {config.tp} tensor-parallel ranks"
                    if ep_group is not None:
                        line += ", experts split over them"
                elif ep_group is not None:
                    line += f", experts split over {config.ep} expert-parallel ranks"
                print(line, flush=True)
            if config.resume is not None:
                trainer.resume(config.resume)
                print(f"[{trainer.label}] resumed at step {trainer.step}", flush=True)
            if trainer.graph_plan is not None:
                print(f"[{trainer.label}] CUDA graphs: {trainer.graph_plan.note}", flush=True)
            print(estimate_run(trainer).describe(), flush=True)  # before a slow first validation
            own_peak = reset_peak_memory(device)
        except KeyboardInterrupt:
            break
        progress = Progress(
            trainer.label, config.steps, trainer.step, end=config.last_step, later_steps=later
        )
        try:
            result = trainer.run(progress)
        except Diverged as err:  # no table: the run did not succeed
            raise SystemExit(str(err)) from None
        results.append(result)
        summary = summarize(result, peak_memory(device, own_peak), config.computes(name))
        summaries.append(summary)
        first = "-" if summary.first_val_loss is None else f"{summary.first_val_loss:.4f}"
        last = "-" if summary.val_loss is None else f"{summary.val_loss:.4f}"
        print(
            f"[{result.recipe}] validation loss {first} (step 0) -> {last} (step "
            f"{summary.val_step}); {summary.steps}/{config.steps} steps in "
            f"{format_duration(trainer.elapsed)}",
            flush=True,
        )
        if result.saved is not None and not result.interrupted:
            path, step = result.saved
            print(f"[{result.recipe}] checkpoint of step {step} saved to {path}", flush=True)
        if result.interrupted:
            break
        trainer = None  # its memory is free before the next recipe's model is built
    return results, summaries


def _rank0(group) -> bool:
    """Whether this process writes the outputs: rank 0 of `group`, or any without one."""
    return group is None or dist.get_rank(group) == 0
