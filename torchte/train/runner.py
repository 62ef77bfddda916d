"""The run of `python -m torchte.train`: the checks of --out, --save and --resume before the first
step, the corpus, each recipe trained in turn with the lines it prints, then the outputs
(outputs.py) and, after Ctrl-C, where each recipe stopped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import checkpoint
from .arguments import parse_args
from .config import ModelConfig, RunConfig
from .data import Corpus, load_corpus
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
    for name in config.recipes:
        path = checkpoint.recipe_path(config.save, name, len(config.recipes) > 1)
        if config.fsdp:
            check_save_path(path)
        elif path.is_dir():
            raise SystemExit(
                f"--save {config.save}: {path} is a folder; give a file path, such as "
                f"{config.save / 'ckpt.pt'}"
            )
    check_writable(config.save.parent, f"--save {config.save}")


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
    return steps


def train(argv: list[str] | None = None) -> list[RunResult]:
    """Run the command line: train each recipe, then write the table, CSV and plot
    (SystemExit(130) after them when Ctrl-C stopped the run)."""
    model_config, config = parse_args(argv)
    if config.fsdp:  # with --ep the same ranks split the experts (ep_run.py)
        with launched_run(config.device) as group:
            dp, ep_group = data_parallel(config.device, config.tp), None
            if config.ep > 1:
                ep_group = group
            return _train(model_config, config, group, dp, ep_group)
    if config.cp > 1:  # context parallelism over torchrun's processes (the Trainer's group)
        with launched_run(config.device):
            return _train(model_config, config, None)
    if config.ep > 1:  # expert parallelism (ep_run.py) over torchrun's processes (with --tp:
        with launched_run(config.device) as group:  # the same ones)
            return _train(model_config, config, group if config.tp > 1 else None, ep_group=group)
    with tensor_parallel_run(config.tp, config.device) as group:
        return _train(model_config, config, group)


def _train(
    model_config: ModelConfig,
    config: RunConfig,
    group,
    dp: DataParallel | None = None,
    ep_group=None,
) -> list[RunResult]:
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
        f"({config.compute_reason}); {config.steps} steps of {config.batch_size} x "
        f"{model_config.seq_len} tokens, lr {config.lr:g} (warmup {config.warmup}, cosine), "
        f"validation every {config.eval_every} steps; CUDA graphs "
        f"{'on' if config.cuda_graph else 'off'} ({config.cuda_graph_reason})",
        flush=True,
    )
    results, summaries = run_recipes(model_config, config, corpus, starts, group, dp, ep_group)
    if summaries and (group is None or dist.get_rank(group) == 0) and _rank0(ep_group):
        write_outputs(model_config, config, results, summaries)
    if len(results) < len(config.recipes) or results[-1].interrupted:
        print(interruption_report(results, config), flush=True)
        raise SystemExit(130)
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
            reset_peak_memory(device)
        except KeyboardInterrupt:
            break
        progress = Progress(
            trainer.label, config.steps, trainer.step, end=config.last_step, later_steps=later
        )
        result = trainer.run(progress)
        results.append(result)
        summary = summarize(result, peak_memory(device), config.computes(name))
        summaries.append(summary)
        first = "-" if summary.first_val_loss is None else f"{summary.first_val_loss:.4f}"
        last = "-" if summary.val_loss is None else f"{summary.val_loss:.4f}"
        print(
            f"[{result.recipe}] validation loss {first} (step 0) -> {last} (step "
            f"{summary.val_step}); {summary.steps}/{config.steps} steps in "
            f"{format_duration(trainer.elapsed)}",
            flush=True,
        )
        if result.interrupted:
            break
    return results, summaries


def _rank0(group) -> bool:
    """Whether this process writes the outputs: rank 0 of `group`, or any without one."""
    return group is None or dist.get_rank(group) == 0
