"""GPU time of each kernel in one FP8 training step of each te module, from the torch profiler.

    PYTHONPATH=<tree> python benchmarks/kernel_times.py [--json out.json]   # on a CUDA GPU

te.LayerNormLinear (LayerNorm, RMSNorm), te.LayerNormMLP (GELU, SwiGLU) and te.GroupedLinear
(8 experts) under delayed and current scaling at 8192 tokens, hidden 4096 (ffn 16384 for the
MLP): forward under te.autocast, then backward. Each step runs 5 times after warm-up; the table
gives each Triton kernel's median time per step, so two trees (before and after a change to
the kernels or their launchers) can be compared kernel by kernel. It uses the public API only.
Never asserts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import torchte as te
from torchte import recipe

RECIPES = {"delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling}
TOKENS, HIDDEN, FFN, EXPERTS = 8192, 4096, 16384, 8
REPEATS = 5


def _modules() -> dict:
    kw = {"params_dtype": torch.bfloat16, "device": "cuda"}
    return {
        "LayerNormLinear": lambda: te.LayerNormLinear(HIDDEN, HIDDEN, **kw),
        "RMSNormLinear": lambda: te.LayerNormLinear(HIDDEN, HIDDEN, normalization="RMSNorm", **kw),
        "LayerNormMLP gelu": lambda: te.LayerNormMLP(HIDDEN, FFN, **kw),
        "LayerNormMLP swiglu": lambda: te.LayerNormMLP(HIDDEN, FFN, activation="swiglu", **kw),
        "GroupedLinear": lambda: te.GroupedLinear(EXPERTS, HIDDEN, HIDDEN, **kw),
    }


def step_fn(kind: str, module, make_recipe):
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    extra = ([TOKENS // EXPERTS] * EXPERTS,) if kind == "GroupedLinear" else ()

    def step() -> None:
        with te.autocast(enabled=True, recipe=make_recipe()):
            y = module(x, *extra)
        y = y[0] if isinstance(y, tuple) else y
        y.backward(torch.ones_like(y))

    return step


def kernel_us(step, match: str = "_kernel", width: int | None = None) -> dict[str, float]:
    """Median microseconds per step of each CUDA kernel whose name contains `match` (the
    default: the Triton kernels; "" for all) over REPEATS steps, by name (cut to `width`)."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    per_step: dict[str, list[float]] = {}
    for _ in range(REPEATS):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        totals: dict[str, float] = {}
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA and match in event.name:
                name = event.name.split("(")[0][:width]
                totals[name] = totals.get(name, 0.0) + event.device_time
        for name, us in totals.items():
            per_step.setdefault(name, []).append(us)
    return {name: statistics.median(v) for name, v in per_step.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--only", default="", help="run the configs whose name contains this")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernel_times.py needs a CUDA GPU")
    results = {}
    for kind, make in _modules().items():
        for rname, make_recipe in RECIPES.items():
            if args.only not in f"{kind} {rname}":
                continue
            torch.manual_seed(0)
            results[f"{kind} {rname}"] = kernel_us(step_fn(kind, make(), make_recipe))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    print(f"{'config':28s} {'kernel':44s} {'us/step':>9s}")
    for config, kernels in results.items():
        for name, us in sorted(kernels.items()):
            print(f"{config:28s} {name[:44]:44s} {us:9.1f}")


if __name__ == "__main__":
    main()
