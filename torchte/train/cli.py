"""The command line of `python -m torchte.train` (also `torchte-train`): options, checks, main.

Bad option values end the program with a message that names the option and the fix (argparse's
exit status 2); a missing or too small corpus, an FP8 recipe the device cannot run and a
checkpoint that does not fit end it with status 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from torchte import _device

from .config import DEFAULT_MAX_BYTES, FP8_MULTIPLE, RECIPES, SIZES, ModelConfig, RunConfig
from .data import load_corpus
from .loop import COMPUTE_DTYPE, PARAMS_DTYPE, RunResult, Trainer
from .model import count_parameters
from .plot import write_plot
from .progress import Progress, format_duration
from .report import format_table, peak_memory, reset_peak_memory, summarize, write_csv

DESCRIPTION = """\
Train a small GPT built from torchte modules as a byte-level language model, in bf16 and in
FP8, and compare the two. By default it runs bf16 and then FP8 delayed scaling from the same
seed on the same batches, on the Python standard library's source files; on the CPU (FP8
emulated) with a tiny model in a minute or two, on a GPU with a ~350M-parameter model.

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
        "--recipe", choices=RECIPES, help="bf16 (FP8 off), FP8 delayed or current scaling"
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="run bf16, then --recipe (default delayed); the default when --recipe is not given",
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
    p.add_argument("--data", type=Path, help="a text file or folder (default: Python's stdlib)")
    p.add_argument(
        "--max-bytes",
        type=int,
        default=DEFAULT_MAX_BYTES,
        help=f"read at most this many bytes of text (default {DEFAULT_MAX_BYTES // 2**20} MiB)",
    )
    p.add_argument("--out", type=Path, default=Path("train_out"), help="output folder")
    p.add_argument("--save", type=Path, help="checkpoint file, written at the end")
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
        p.error("--compare runs bf16 and then an FP8 recipe: give --recipe delayed or current")
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
    try:
        model_config = ModelConfig(
            hidden=preset.hidden,
            layers=preset.layers,
            heads=preset.heads,
            ffn=preset.ffn,
            seq_len=preset.seq_len if args.seq_len is None else args.seq_len,
            experts=0 if args.experts is None else args.experts,
            top_k=args.top_k,
        )
        if args.experts is not None and args.experts < 1:
            raise ValueError(f"--experts must be at least 1, got {args.experts}")
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
        )
    except ValueError as err:
        p.error(str(err))
    supported = _fp8_supported(args, recipes)
    if supported != recipes:
        config = dataclasses.replace(config, recipes=supported)
    tokens = config.batch_size * model_config.seq_len
    if config.uses_fp8 and tokens % FP8_MULTIPLE:
        p.error(
            f"--batch-size {config.batch_size} x --seq-len {model_config.seq_len} = {tokens} "
            f"tokens per step, but FP8 needs a multiple of {FP8_MULTIPLE}: change --batch-size "
            "or --seq-len, or use --recipe bf16"
        )
    return model_config, config


def describe_model(config: ModelConfig, parameters: int) -> str:
    """One line: the model's shape and parameter count."""
    mlp = f"{config.experts} experts, top-{config.top_k}" if config.experts else "dense MLP"
    return (
        f"model: {config.layers} layers, hidden {config.hidden}, {config.heads} heads, "
        f"ffn {config.ffn}, {mlp}, seq {config.seq_len}: {parameters / 1e6:.2f}M parameters "
        f"({_dtype_name(PARAMS_DTYPE)} weights, {_dtype_name(COMPUTE_DTYPE)} compute)"
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def main(argv: list[str] | None = None) -> None:
    """The program's entry point (`python -m torchte.train`, `torchte-train`)."""
    train(argv)


def train(argv: list[str] | None = None) -> list[RunResult]:
    """Run the command line: train each recipe, then write the table, CSV and plot."""
    model_config, config = parse_args(argv)
    corpus = load_corpus(config.data, config.max_bytes, model_config.seq_len)
    capped = f", capped at --max-bytes {config.max_bytes}" if corpus.capped else ""
    print(
        f"data: {corpus.source}: {corpus.files} files ({corpus.skipped} skipped as not UTF-8 "
        f"text){capped}; {corpus.train.numel():,} bytes train, {corpus.val.numel():,} bytes "
        "validation",
        flush=True,
    )
    print(
        f"run: {', '.join(config.recipes)} on {config.device}; {config.steps} steps of "
        f"{config.batch_size} x {model_config.seq_len} tokens, lr {config.lr:g} (warmup "
        f"{config.warmup}, cosine), validation every {config.eval_every} steps",
        flush=True,
    )
    device = torch.device(config.device)
    results, summaries = [], []
    for name in config.recipes:
        trainer = Trainer(name, model_config, config, corpus)
        if not results:
            print(describe_model(model_config, count_parameters(trainer.model)), flush=True)
        if config.resume is not None:
            trainer.resume(config.resume)
            print(f"[{name}] resumed at step {trainer.step}", flush=True)
        reset_peak_memory(device)
        result = trainer.run(Progress(name, config.steps, trainer.step))
        results.append(result)
        summary = summarize(result, peak_memory(device))
        summaries.append(summary)
        print(
            f"[{name}] validation loss {summary.first_val_loss:.4f} (step 0) -> "
            f"{summary.val_loss:.4f} (step {summary.val_step}); {summary.steps}/{config.steps} "
            f"steps in {format_duration(trainer.elapsed)}",
            flush=True,
        )
    rows = [row for result in results for row in result.rows]
    config.out.mkdir(parents=True, exist_ok=True)
    csv_path, png_path = config.out / "losses.csv", config.out / "losses.png"
    write_csv(csv_path, rows)
    backend = write_plot(png_path, rows)
    print()
    print(format_table(summaries))
    print(f"\nwrote {csv_path} and {png_path} ({backend} plot)", flush=True)
    return results
