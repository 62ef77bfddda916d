"""A short training example: an MLP of te.Linear layers learns a fixed random teacher network.

    python -m torchte.train                    # bf16, then FP8 delayed, then FP8 current scaling
    python -m torchte.train --recipe delayed --steps 500

Every recipe starts from the same seed, sees the same batches and prints a progress line every
`--log-every` steps; a table of final loss and steps/s closes the run. It runs on CUDA when a
GPU is present and on the CPU otherwise (FP8 is emulated there).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import torchte as te
from torchte import recipe

RECIPES = ("bf16", "fp32", "delayed", "current")
DEFAULT_RECIPES = ("bf16", "delayed", "current")
OUT_FEATURES = 16


@dataclass(frozen=True)
class Result:
    """The outcome of one training run."""

    recipe: str
    final_loss: float
    steps_per_s: float


def _positive(kind: type, multiple: int = 1) -> Callable[[str], int | float]:
    """An argparse type: a positive `kind` that is a multiple of `multiple`."""

    def convert(text: str) -> int | float:
        value = kind(text)
        if not value > 0 or value % multiple:
            rule = f"a positive multiple of {multiple} (FP8 GEMM dims)" if multiple > 1 else ""
            raise argparse.ArgumentTypeError(f"must be {rule or 'positive'}, got {text}")
        return value

    return convert


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and validate the command line; exit with a clear message on bad values."""
    p = argparse.ArgumentParser(
        prog="python -m torchte.train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--recipe",
        choices=(*RECIPES, "all"),
        default="all",
        help="bf16 or fp32 (no FP8), FP8 delayed or current scaling; "
        "all: bf16, delayed, current (default)",
    )
    p.add_argument("--steps", type=_positive(int), default=500, help="optimizer steps per recipe")
    p.add_argument("--batch", type=_positive(int, 16), default=64, help="samples per step")
    p.add_argument("--width", type=_positive(int, 16), default=256, help="input, hidden width")
    p.add_argument("--lr", type=_positive(float), default=1e-3, help="Adam learning rate")
    p.add_argument("--log-every", type=_positive(int), default=100, help="steps between logs")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and data")
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda if present")
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False")
    args.recipes = DEFAULT_RECIPES if args.recipe == "all" else (args.recipe,)
    return args


def make_recipe(name: str) -> recipe.Recipe | None:
    """The FP8 recipe called `name`, or None for the high-precision runs."""
    if name == "delayed":
        return recipe.DelayedScaling()
    if name == "current":
        return recipe.Float8CurrentScaling()
    return None


def make_student(width: int, dtype: torch.dtype, device: str) -> nn.Sequential:
    """Three te.Linear layers with GELU between: width -> width -> width -> OUT_FEATURES."""
    kwargs = {"params_dtype": dtype, "device": device}
    return nn.Sequential(
        te.Linear(width, width, **kwargs),
        nn.GELU(),
        te.Linear(width, width, **kwargs),
        nn.GELU(),
        te.Linear(width, OUT_FEATURES, **kwargs),
    )


def train(name: str, args: argparse.Namespace) -> Result:
    """Train a fresh student under recipe `name`; return its final loss and speed."""
    torch.manual_seed(args.seed)
    data_gen = torch.Generator().manual_seed(args.seed)
    # The teacher: a fixed random fp32 network x -> tanh(x @ w1) @ w2, kept on the CPU.
    w1 = torch.randn(args.width, args.width, generator=data_gen) / args.width**0.5
    w2 = torch.randn(args.width, OUT_FEATURES, generator=data_gen) / args.width**0.5
    dtype = torch.float32 if name == "fp32" else torch.bfloat16
    model = make_student(args.width, dtype, args.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    fp8_recipe = make_recipe(name)
    losses: list[torch.Tensor] = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        if step == 2:  # the first step compiles kernels: leave it out of steps/s
            _sync(args.device)
            start = time.perf_counter()
        x_cpu = torch.randn(args.batch, args.width, generator=data_gen)
        y_cpu = torch.tanh(x_cpu @ w1) @ w2
        x, y = x_cpu.to(args.device, dtype), y_cpu.to(args.device)
        with te.autocast(enabled=fp8_recipe is not None, recipe=fp8_recipe):
            pred = model(x)
        loss = F.mse_loss(pred.float(), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
        if step % args.log_every == 0 or step == args.steps:
            print(f"[{name:>7}] step {step:5d}/{args.steps}  loss {loss.item():.5f}", flush=True)
    _sync(args.device)
    elapsed = time.perf_counter() - start
    timed_steps = max(args.steps - 1, 1)
    final = torch.stack(losses[-10:]).mean().item()
    return Result(name, final, timed_steps / elapsed if elapsed > 0 else float("nan"))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> list[Result]:
    """Run the chosen recipes back to back and print a summary table."""
    args = parse_args(argv)
    fp8_ok, reason = te.is_fp8_available()
    settings = ("device", "steps", "batch", "width", "lr", "seed")
    print("torchte.train:", " ".join(f"{k}={getattr(args, k)}" for k in settings), flush=True)
    results = []
    for name in args.recipes:
        if make_recipe(name) is not None and not fp8_ok:
            if args.recipe != "all":
                raise SystemExit(f"--recipe {name}: FP8 is not available: {reason}")
            print(f"[{name:>7}] skipped: FP8 is not available ({reason})", flush=True)
            continue
        results.append(train(name, args))
    print(f"\n{'recipe':<8} {'final loss':>11} {'steps/s':>9}")
    for r in results:
        print(f"{r.recipe:<8} {r.final_loss:>11.5f} {r.steps_per_s:>9.1f}")
    return results


if __name__ == "__main__":
    main()
