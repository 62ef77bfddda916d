"""The options of `python -m torchte.train`, their checks, and the model and run configurations
they make (parse_args). Bad values end the program with a message that names the option and the
fix, and a pointer to --help (exit status 2); an FP8 recipe the device cannot run ends it with
status 1. --help gives every option's default, the computed ones in words.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from torchte import _device

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
from .ep_run import check_ep
from .fsdp_run import check_fsdp, data_parallel_ranks
from .optimizer_choice import MOMENT_DTYPES, OPTIMIZERS, check_optimizer
from .option_types import finite_float
from .parallel import check_launch, launch_mismatch
from .precision import choose_compute_dtype
from .threads import choose_threads, parse_threads

__all__ = ["DESCRIPTION", "HELP_POINTER", "build_parser", "parse_args"]

DESCRIPTION = """\
Train a small GPT built from torchte modules as a byte-level language model without FP8 and
with it, and compare the two. By default it runs the model without FP8 and then with FP8
delayed scaling, from the same seed on the same batches, on the Python standard library's
source files; on the CPU (FP8 emulated) with a tiny model in about a minute, on a GPU with a
~350M-parameter model. The model computes in bf16 (torch.autocast) on a GPU and on a CPU that
runs bf16 fast, else in fp32 (--compute-dtype).

Writes to --out: losses.csv (every logged step) and losses.png (the loss curves); prints a
table of final losses, tokens/s and peak memory."""

HELP_POINTER = "run with --help for the options"


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors are the message and a pointer to --help (not the whole
    usage first, which pushes the message off a small terminal)."""

    def error(self, message: str):
        """Print `prog: error: message` and HELP_POINTER to stderr; exit with status 2."""
        self.exit(2, f"{self.prog}: error: {message}\n{HELP_POINTER}\n")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written; each option's default after its help, unless the help
    already says it (as it must where the default is computed, a default of None)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS):
            return text
        if action.default is False:  # a flag
            return f"{text} (default: off)"
        return f"{text} (default: %(default)s)"


def _by_size(field: str) -> str:
    """'(default by --size: tiny 300, small 1000, ...)' for a field of the size presets, or
    '(default: 16)' where every size has the same."""
    values = {name: f"{getattr(preset, field):g}" for name, preset in SIZES.items()}
    if len(set(values.values())) == 1:
        return f"(default: {next(iter(values.values()))})"
    return f"(default by --size: {', '.join(f'{k} {v}' for k, v in values.items())})"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (defaults of None are filled in from --size and the device)."""
    script = Path(sys.argv[0]).name
    p = _Parser(
        prog="python -m torchte.train" if script == "__main__.py" else script,
        description=DESCRIPTION,
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "--recipe",
        choices=RECIPES,
        help="bf16 (FP8 off: all in --compute-dtype), FP8 delayed or current scaling, block "
        "(1x128 / 128x128 block-scaled FP8), mxfp8 or nvfp4 (emulated on Hopper and the CPU) "
        "(default: --compare of bf16 and delayed)",
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
        help="what the model computes in besides FP8 GEMMs (weights are fp32 unless "
        "--master-weights); "
        "auto: bf16 on a GPU, on the CPU bf16 where it is faster than fp32, else fp32",
    )
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="adamw",
        help="adamw (default): torch's AdamW state, clipping and update fused on a GPU; "
        "fused-adam: te.optimizers.FusedAdam (Transformer Engine's), one process",
    )
    p.add_argument(
        "--master-weights",
        action="store_true",
        help="with --optimizer fused-adam: the model's weights in bf16, fp32 masters in the "
        "optimizer (needs --compute-dtype bf16)",
    )
    p.add_argument(
        "--adam-moments",
        choices=tuple(MOMENT_DTYPES),
        default="fp32",
        help="with --optimizer fused-adam: the dtype AdamW's moments are stored in",
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
    p.add_argument(
        "--threads",
        type=parse_threads,
        default="auto",
        metavar="{auto,N}",
        help="CPU threads torch computes with (default: auto: on the CPU 1, unless a probe of a "
        "fraction of a second finds torch's default count, one per core, clearly faster, which "
        "it seldom is where other programs run; an OMP_NUM_THREADS set in the environment is "
        "kept; on a GPU torch's default)",
    )
    p.add_argument("--steps", type=int, help=f"optimizer steps per recipe {_by_size('steps')}")
    p.add_argument("--batch-size", type=int, help=f"sequences per step {_by_size('batch_size')}")
    p.add_argument("--seq-len", type=int, help=f"tokens per sequence {_by_size('seq_len')}")
    p.add_argument("--lr", type=finite_float, help=f"peak learning rate {_by_size('lr')}")
    p.add_argument("--warmup", type=int, help="warmup steps (default: steps / 10, at most 200)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and batch order")
    p.add_argument("--log-every", type=int, help="steps between logged rows (default: steps / 50)")
    p.add_argument("--eval-every", type=int, help="steps between validations (default: steps / 10)")
    p.add_argument("--eval-batches", type=int, default=8, help="validation batches (default 8)")
    p.add_argument(
        "--experts",
        type=int,
        help="mixture of N experts instead of the dense MLP (default: none, the dense MLP)",
    )
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
        "--ep",
        type=int,
        default=1,
        help="expert-parallel ranks (with --experts E, N dividing E; launch with torchrun "
        "--nproc-per-node N): each rank holds E / N experts of every MoE layer and trains on "
        "its share of every batch; --save / --resume in the one-process format (with --fsdp: "
        "the dense parameters sharded over the same ranks, --fsdp folders) (default 1)",
    )
    p.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel ranks (launch with torchrun --nproc-per-node N): every rank "
        "trains on the same rows of each batch, each on its load-balanced share of every "
        "sequence (--seq-len a multiple of 2 N; dense models, not --packed; default 1)",
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
    p.add_argument(
        "--fsdp-keep-gathered",
        action="store_true",
        help="with --fsdp: keep each block's gathered weights from its forward to its backward "
        "(the backward gathers nothing: half the all-gathers and their host time, for the "
        "memory of the whole gathered model)",
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
        "--save",
        type=Path,
        help="checkpoint file (a folder with --fsdp), written at the end (default: none)",
    )
    p.add_argument(
        "--save-every",
        type=int,
        default=0,
        help="also save every N steps (default: 0, at the end only)",
    )
    p.add_argument(
        "--resume", type=Path, help="continue from this checkpoint (default: none, from step 0)"
    )
    p.add_argument(
        "--stop-at",
        type=int,
        help="stop after this step of the --steps schedule (save with --save, go on later with "
        "--resume) (default: --steps)",
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


def check_cp(args) -> str | None:
    """Why `--cp N` cannot run with these arguments (None when it can)."""
    if args.cp < 1:
        return f"--cp must be at least 1, got {args.cp}"
    if args.cp == 1:
        return None
    for flag, on in (
        ("--tp", args.tp > 1),
        ("--fsdp", args.fsdp),
        ("--experts", bool(args.experts)),
        ("--packed", args.packed),
        ("--ep", args.ep > 1),
    ):
        if on:
            return f"--cp {args.cp} with {flag} is not implemented (--cp trains a dense model)"
    preset = SIZES[args.size or ("large" if args.device == "cuda" else "tiny")]
    seq_len = preset.seq_len if args.seq_len is None else args.seq_len
    if seq_len % (2 * args.cp):
        return (
            f"--cp {args.cp} cuts each sequence in {2 * args.cp} chunks: --seq-len {seq_len} "
            f"must be a multiple of {2 * args.cp}"
        )
    return launch_mismatch("--cp", args.cp)


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
    why = check_ep(args) or check_cp(args) or check_launch(args.tp, args.fsdp)
    if why is None:
        why = check_optimizer(
            args.optimizer, args.master_weights, args.adam_moments, _parallel_option(args)
        )
    if why is None and args.tp > 1 and args.experts and args.ep != args.tp:
        why = (
            f"--tp {args.tp} with --experts needs --ep {args.tp} --sequence-parallel (the "
            "experts split over the same ranks)"
        )
    batch = preset.batch_size if args.batch_size is None else args.batch_size
    if why is None and args.ep > 1 and batch % args.ep:
        why = (
            f"--ep {args.ep} splits each batch over its ranks: --batch-size {batch} must be a "
            f"multiple of {args.ep}"
        )
    if why is None and args.sequence_parallel and args.tp == 1:
        why = "--sequence-parallel needs --tp N with N > 1"
    if why is None:
        batch_size = preset.batch_size if args.batch_size is None else args.batch_size
        why = check_fsdp(
            args.fsdp, args.fp8_all_gather, args.tp, batch_size, args.fsdp_gather_dtype,
            args.fsdp_keep_gathered,
        )  # fmt: skip
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
        if args.cp > 1 and graphs and args.cuda_graph == "auto":  # several processes
            graphs, graphs_reason = False, "auto: not with --cp"
        if args.ep > 1 and graphs and args.cuda_graph == "auto":  # several processes
            graphs, graphs_reason = False, "auto: not with --ep, which reads row counts"
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
            ep=args.ep,
            cp=args.cp,
            fsdp=args.fsdp,
            fp8_all_gather=args.fp8_all_gather,
            fsdp_gather_dtype=args.fsdp_gather_dtype,
            fsdp_keep_gathered=args.fsdp_keep_gathered,
            optimizer=args.optimizer,
            master_weights=args.master_weights,
            adam_moments=args.adam_moments,
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
    # each trains on batch / ranks rows (--ep with --fsdp: the same ranks, the batch split once)
    ranks = data_parallel_ranks(config.fsdp, config.tp)
    ranks = ranks if config.fsdp else ranks * config.ep
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
    threads = choose_threads(args.threads, config.device, model_config.hidden, model_config.ffn)
    config = dataclasses.replace(
        config,
        compute_dtype=compute.name,
        compute_reason=compute.reason,
        threads=threads.count,
        threads_reason=threads.reason,
    )
    if config.master_weights and compute.name != "bf16":
        p.error(
            f"--master-weights keeps the weights in bf16, but this run computes in "
            f"{compute.name} ({compute.reason}): add --compute-dtype bf16"
        )
    return model_config, config


def _parallel_option(args) -> str | None:
    """The first option that spreads the run over several processes, as typed, or None."""
    for flag, value in (("--tp", args.tp), ("--cp", args.cp), ("--ep", args.ep)):
        if value > 1:
            return f"{flag} {value}"
    return "--fsdp" if args.fsdp else None
