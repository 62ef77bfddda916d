"""The command line of `python -m torchte.train` (also `torchte-train`): options, checks, main.

Bad option values end the program with a message that names the option and the fix (argparse's
exit status 2); a missing or too small corpus, an FP8 recipe the device cannot run, an --out or
--save path that cannot be written and a checkpoint that does not fit end it with status 1,
all before the first training step. Ctrl-C ends it with status 130, after writing the table,
CSV and plot of the steps that finished and saying where each recipe stopped.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from torchte import _device

from . import checkpoint
from .config import (
    ACTIVATIONS,
    DEFAULT_MAX_BYTES,
    FP8_MULTIPLE,
    GATHER_DTYPES,
    NORMALIZATIONS,
    RECIPES,
    SIZES,
    ModelConfig,
    RunConfig,
)
from .cuda_graph import CUDA_GRAPH_MODES, resolve_cuda_graph
from .data import Corpus, load_corpus
from .fsdp_run import DataParallel, check_fsdp, data_parallel, data_parallel_ranks
from .fsdp_state import check_save_path, read_position
from .interruption import interruption_report
from .loop import PARAMS_DTYPE, RunResult, Trainer, check_resumable
from .model import count_parameters
from .parallel import check_launch, launched_run, tensor_parallel_run
from .plot import write_plot
from .precision import choose_compute_dtype
from .progress import Progress, format_duration
from .report import (
    Summary,
    check_writable,
    compute_note,
    format_table,
    peak_memory,
    reset_peak_memory,
    summarize,
    write_csv,
)

DESCRIPTION = """\
Train a small GPT built from torchte modules as a byte-level language model without FP8 and
with it, and compare the two. By default it runs the model without FP8 and then with FP8
delayed scaling, from the same seed on the same batches, on the Python standard library's
source files; on the CPU (FP8 emulated) with a tiny model in about a minute, on a GPU with a
~350M-parameter model. The model computes in bf16 (torch.autocast) on a GPU and on a CPU that
runs bf16 fast, else in fp32 (--compute-dtype).

Writes to --out: losses.csv (every logged step) and losses.png (the loss curves); prints a
table of final losses, tokens/s and peak memory."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (defaults of None are filled in from --size and the device)."""
    script = Path(sys.argv[0]).name
    p = argparse.ArgumentParser(
        prog="python -m torchte.train" if script == "__main__.py" else script,
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--recipe",
        choices=RECIPES,
        help="bf16 (FP8 off: all in --compute-dtype), FP8 delayed or current scaling, block "
        "(1x128 / 128x128 block-scaled FP8), mxfp8 or nvfp4 (emulated on Hopper and the CPU)",
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="run bf16, then --recipe (default delayed); the default when --recipe is not given",
    )
    p.add_argument(
        "--compute-dtype",
        choices=("auto", "bf16", "fp32"),
        default="auto",
        help="what the model computes in besides FP8 GEMMs (weights are fp32 either way); "
        "auto: bf16 on a GPU, on the CPU bf16 where it is faster than fp32, else fp32",
    )
    p.add_argument(
        "--cuda-graph",
        choices=CUDA_GRAPH_MODES,
        default="auto",
        help="capture each transformer block's forward and backward as CUDA graphs (fewer "
        "kernel launches from Python); auto: on for a model with --experts in one process on "
        "a GPU, off for dense models and elsewhere (the CPU, --tp, --fsdp, --packed, which "
        "`on` refuses)",
    )
    p.add_argument(
        "--size", choices=tuple(SIZES), help="model size (default: tiny on the CPU, large on a GPU)"
    )
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda if available")
    p.add_argument("--steps", type=int, help="optimizer steps per recipe (default by --size)")
    p.add_argument("--batch-size", type=int, help="sequences per step (default by --size)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default by --size)")
    p.add_argument("--lr", type=float, help="peak learning rate (default by --size)")
    p.add_argument("--warmup", type=int, help="warmup steps (default: steps / 10, at most 200)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and batch order")
    p.add_argument("--log-every", type=int, help="steps between logged rows (default: steps / 50)")
    p.add_argument("--eval-every", type=int, help="steps between validations (default: steps / 10)")
    p.add_argument("--eval-batches", type=int, default=8, help="validation batches (default 8)")
    p.add_argument("--experts", type=int, help="mixture of N experts instead of the dense MLP")
    p.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
    p.add_argument(
        "--normalization",
        choices=NORMALIZATIONS,
        default="LayerNorm",
        help="the blocks' and the final norm (default LayerNorm)",
    )
    p.add_argument(
        "--activation",
        choices=ACTIVATIONS,
        default="gelu",
        help="the MLP's activation (default gelu); gated ones (swiglu, geglu, ...) make its "
        "first GEMM twice as wide",
    )
    p.add_argument(
        "--rope",
        action="store_true",
        help="rotary position embeddings on queries and keys instead of learned positions",
    )
    p.add_argument(
        "--gqa-groups",
        type=int,
        default=0,
        help="key/value head groups (grouped-query attention; default: one per head)",
    )
    p.add_argument(
        "--packed",
        action="store_true",
        help="pack documents (the corpus's files) into each sequence: attention stays within "
        "each document (cu_seqlens, thd) and positions restart at each",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks (launch with torchrun --nproc-per-node N; default 1)",
    )
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with --tp: each rank keeps its rows of the batch between the split layers",
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="sharded data parallelism (FSDP2) over the processes of torchrun --nproc-per-node N "
        "(N = 1 too): each rank trains on its share of every batch; --save and --resume take "
        "torch.distributed.checkpoint folders, which resume over any N; with --tp M, FSDP over "
        "N / M groups of M tensor-parallel ranks",
    )
    p.add_argument(
        "--fp8-all-gather",
        action="store_true",
        help="with --fsdp: the FP8 recipes' te modules shard and all-gather their weights as FP8 "
        "(torchte.fsdp.enable_fp8_all_gather)",
    )
    p.add_argument(
        "--fsdp-gather-dtype",
        choices=GATHER_DTYPES,
        default="fp32",
        help="with --fsdp: all-gather the parameters as they are (fp32, default) or cast to "
        "bf16 (half the bytes; gradients reduced in fp32)",
    )
    p.add_argument("--data", type=Path, help="a text file or folder (default: Python's stdlib)")
    p.add_argument(
        "--max-bytes",
        type=int,
        default=DEFAULT_MAX_BYTES,
        help=f"read at most this many bytes of text (default {DEFAULT_MAX_BYTES // 2**20} MiB)",
    )
    p.add_argument("--out", type=Path, default=Path("train_out"), help="output folder")
    p.add_argument(
        "--save", type=Path, help="checkpoint file (a folder with --fsdp), written at the end"
    )
    p.add_argument("--save-every", type=int, default=0, help="also save every N steps")
    p.add_argument("--resume", type=Path, help="continue from this checkpoint")
    p.add_argument(
        "--stop-at",
        type=int,
        help="stop after this step of the --steps schedule (save with --save, go on later with "
        "--resume)",
    )
    return p


def _recipes(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, ...]:
    if args.compare and args.recipe == "bf16":
        p.error(
            "--compare runs bf16 and then an FP8 recipe: give an FP8 --recipe (delayed, "
            "current, block, mxfp8, nvfp4)"
        )
    if args.recipe is not None and not args.compare:
        return (args.recipe,)
    return ("bf16", args.recipe or "delayed")


def _fp8_supported(args: argparse.Namespace, recipes: tuple[str, ...]) -> tuple[str, ...]:
    """The recipes this device runs. An FP8 recipe asked for by name and not supported is an
    error; the default comparison falls back to bf16 alone, with a note."""
    fp8 = [name for name in recipes if name != "bf16"]
    if not fp8:
        return recipes
    ok, reason = _device.fp8_support(_device.default_device(args.device))
    if ok:
        return recipes
    if args.recipe is None:
        print(f"note: FP8 is not supported here ({reason}); running bf16 only")
        return ("bf16",)
    raise SystemExit(
        f"--recipe {fp8[0]}: FP8 is not supported on {args.device}: {reason}; use --recipe bf16 "
        "here, or run on a GPU of compute capability 8.9 or newer (or with --device cpu, where "
        "FP8 is emulated)"
    )


def parse_args(argv: list[str] | None = None) -> tuple[ModelConfig, RunConfig]:
    """The model and run configurations of the command line (SystemExit on bad values)."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU is available; use --device cpu")
    preset = SIZES[args.size or ("large" if args.device == "cuda" else "tiny")]
    steps = preset.steps if args.steps is None else args.steps
    recipes = _recipes(p, args)
    why = check_launch(args.tp, args.fsdp)
    if why is None and args.tp > 1 and args.experts:
        why = f"--tp {args.tp} with --experts is not implemented yet"
    if why is None and args.sequence_parallel and args.tp == 1:
        why = "--sequence-parallel needs --tp N with N > 1"
    if why is None:
        batch_size = preset.batch_size if args.batch_size is None else args.batch_size
        why = check_fsdp(
            args.fsdp, args.fp8_all_gather, args.tp, batch_size, args.fsdp_gather_dtype
        )
    if why is not None:
        p.error(why)
    try:
        model_config = ModelConfig(
            hidden=preset.hidden,
            layers=preset.layers,
            heads=preset.heads,
            ffn=preset.ffn,
            seq_len=preset.seq_len if args.seq_len is None else args.seq_len,
            experts=0 if args.experts is None else args.experts,
            top_k=args.top_k,
            normalization=args.normalization,
            activation=args.activation,
            rope=args.rope,
            gqa_groups=args.gqa_groups,
            packed=args.packed,
        )
        if args.tp > 1 and model_config.gqa_groups % args.tp:
            raise ValueError(
                f"--tp {args.tp} splits the key/value groups over the ranks: --gqa-groups "
                f"{model_config.gqa_groups} must be a multiple of it"
            )
        if args.experts is not None and args.experts < 1:
            raise ValueError(f"--experts must be at least 1, got {args.experts}")
        graphs, graphs_reason = resolve_cuda_graph(
            args.cuda_graph, args.device, args.tp, args.fsdp, args.packed, bool(args.experts)
        )
        config = RunConfig(
            recipes=recipes,
            device=args.device,
            steps=steps,
            batch_size=preset.batch_size if args.batch_size is None else args.batch_size,
            lr=preset.lr if args.lr is None else args.lr,
            warmup=min(200, max(1, steps // 10)) if args.warmup is None else args.warmup,
            seed=args.seed,
            log_every=max(1, steps // 50) if args.log_every is None else args.log_every,
            eval_every=max(1, steps // 10) if args.eval_every is None else args.eval_every,
            eval_batches=args.eval_batches,
            data=args.data,
            max_bytes=args.max_bytes,
            out=args.out,
            save=args.save,
            save_every=args.save_every,
            resume=args.resume,
            stop_at=args.stop_at,
            tp=args.tp,
            sequence_parallel=args.sequence_parallel,
            fsdp=args.fsdp,
            fp8_all_gather=args.fp8_all_gather,
            fsdp_gather_dtype=args.fsdp_gather_dtype,
            cuda_graph=graphs,
            cuda_graph_reason=graphs_reason,
        )
    except ValueError as err:
        p.error(str(err))
    supported = _fp8_supported(args, recipes)
    if supported != recipes:
        config = dataclasses.replace(config, recipes=supported)
    per_tensor = {"delayed", "current"}
    if config.fp8_all_gather and not per_tensor.intersection(config.recipes):
        p.error("--fp8-all-gather gathers FP8 weights: it needs --recipe delayed or current")
    if config.fp8_all_gather and set(config.recipes) - per_tensor - {"bf16"}:
        p.error("--fp8-all-gather with a block-scaled --recipe is not implemented yet")
    ranks = data_parallel_ranks(config.fsdp, config.tp)  # each trains on batch / ranks rows
    if config.sequence_parallel and (config.batch_size // ranks) % config.tp:
        p.error(
            f"--sequence-parallel splits each rank's rows of the batch over the {config.tp} "
            f"tensor-parallel ranks: --batch-size {config.batch_size} / {ranks} must be a "
            f"multiple of {config.tp}"
        )
    tokens = config.batch_size // ranks * model_config.seq_len
    if config.uses_fp8 and tokens % FP8_MULTIPLE:
        share = f" / {ranks} --fsdp ranks" if ranks > 1 else ""
        p.error(
            f"--batch-size {config.batch_size}{share} x --seq-len {model_config.seq_len} = "
            f"{tokens} tokens per step, but FP8 needs a multiple of {FP8_MULTIPLE}: change "
            "--batch-size or --seq-len, or use --recipe bf16"
        )
    compute = choose_compute_dtype(
        args.compute_dtype, config.device, model_config.hidden, model_config.ffn
    )
    config = dataclasses.replace(config, compute_dtype=compute.name, compute_reason=compute.reason)
    return model_config, config


def describe_model(config: ModelConfig, parameters: int, compute_dtype: str) -> str:
    """One line: the model's shape, parameter count and dtypes."""
    mlp = f"{config.experts} experts, top-{config.top_k}" if config.experts else "dense MLP"
    weights = str(PARAMS_DTYPE).removeprefix("torch.")
    groups = f" ({config.gqa_groups} kv groups)" if config.gqa_groups != config.heads else ""
    positions = "RoPE" if config.rope else "learned positions"
    packed = ", packed documents" if config.packed else ""
    return (
        f"model: {config.layers} layers, hidden {config.hidden}, {config.heads} heads{groups}, "
        f"ffn {config.ffn}, {mlp}, {config.normalization}, {config.activation}, {positions}, "
        f"seq {config.seq_len}{packed}: {parameters / 1e6:.2f}M parameters ({weights} weights, "
        f"{compute_dtype} compute)"
    )


def main(argv: list[str] | None = None) -> None:
    """The program's entry point (`python -m torchte.train`, `torchte-train`)."""
    try:
        train(argv)
    except KeyboardInterrupt:  # outside a recipe's run (which handles its own)
        print("\ninterrupted (Ctrl-C)", file=sys.stderr, flush=True)
        raise SystemExit(130) from None


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
    if config.fsdp:
        with launched_run(config.device) as group:
            return _train(model_config, config, group, data_parallel(config.device, config.tp))
    with tensor_parallel_run(config.tp, config.device) as group:
        return _train(model_config, config, group)


def _train(
    model_config: ModelConfig, config: RunConfig, group, dp: DataParallel | None = None
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
    results, summaries = run_recipes(model_config, config, corpus, starts, group, dp)
    if summaries and (group is None or dist.get_rank(group) == 0):
        write_outputs(model_config, config, results, summaries)
    if len(results) < len(config.recipes) or results[-1].interrupted:
        print(interruption_report(results, config), flush=True)
        raise SystemExit(130)
    return results


def write_outputs(
    model_config: ModelConfig,
    config: RunConfig,
    results: list[RunResult],
    summaries: list[Summary],
) -> None:
    """Write the CSV and the plot to --out and print the table."""
    rows = [row for result in results for row in result.rows]
    csv_path, png_path = config.out / "losses.csv", config.out / "losses.png"
    write_csv(csv_path, rows)
    backend = write_plot(png_path, rows, plot_title(model_config, config))
    print()
    print(format_table(summaries, compute_note(config.compute_dtype, config.compute_reason)))
    print(f"\nwrote {csv_path} and {png_path} ({backend} plot)", flush=True)


def run_recipes(
    model_config: ModelConfig,
    config: RunConfig,
    corpus: Corpus,
    starts: list[int],
    group=None,
    dp: DataParallel | None = None,
) -> tuple[list[RunResult], list[Summary]]:
    """Train each recipe in turn (from its step in `starts`) and summarize it; stops after
    a run that Ctrl-C interrupted, or at a recipe whose setup it interrupted. group: the
    tensor-parallel ranks (without dp); dp: FSDP's."""
    device = torch.device(config.device)
    results, summaries = [], []
    for i, name in enumerate(config.recipes):
        later = sum(config.last_step - min(s, config.last_step) for s in starts[i + 1 :])
        try:
            tp_group = dp.tp_group if dp else group
            trainer = Trainer(name, model_config, config, corpus, tp_group, dp)
            if not results:
                parameters = count_parameters(trainer.model)
                line = describe_model(model_config, parameters, config.compute_dtype)
                if dp is not None:
                    if dp.tp_group is not None:
                        line += f", split over {config.tp} tensor-parallel ranks"
                    line += f", sharded over {dp.size} ranks (FSDP)"
                elif group is not None:
                    line += f", on each of {config.tp} tensor-parallel ranks"
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


def plot_title(model_config: ModelConfig, config: RunConfig) -> str:
    """The plot's title: what was trained, where, in which dtype."""
    mlp = f", {model_config.experts} experts" if model_config.experts else ""
    return (
        f"loss of a byte-level GPT ({model_config.layers} layers x {model_config.hidden}{mlp}) "
        f"on {config.device}, {config.compute_dtype} compute"
    )
