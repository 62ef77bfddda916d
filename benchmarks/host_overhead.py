"""Host overhead per layer call: te layers beside their plain-PyTorch compositions.

    PYTHONPATH=. python benchmarks/host_overhead.py [--json out.json] [--device cpu]

Host microseconds per forward and per forward+backward at 16 tokens (GroupedLinear: 8 experts,
128 tokens) for te.Linear (1024 -> 1024), te.LayerNormLinear (1024 -> 1024), te.LayerNormMLP
(1024, ffn 4096, GELU) and te.GroupedLinear (8 x 1024 -> 1024) in bf16 and under each FP8
recipe, each beside its torch composition in the same run (configs interleaved round by round,
medians of rounds), with the kernel launches of one call (torch profiler, on a GPU); plus a
graphed FP8 te.Linear (te.make_graphed_callables, and the whole step captured with
torch.cuda.graph) against nn.Linear run eagerly. `--profile CONFIG` prints cProfile's top
functions for a config. `--device cpu` runs the same on the CPU (FP8 emulated; no launch
counts, no graphs): a smoke run. Never asserts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from grouped_linear import LinearLoop, split_tokens
from layernorm_mlp import TorchMLP
from linear import environment, host_round_us
from timing import cprofile_top, fwd_bwd_step
from torch import nn

import torchte as te
from torchte import recipe

RECIPES = {"bf16": None, "delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling}
H, F_MLP, EXPERTS = 1024, 4096, 8


class TorchNormLinear(nn.Module):
    def __init__(self, device) -> None:
        super().__init__()
        kw = {"dtype": torch.bfloat16, "device": device}
        self.norm, self.linear = nn.LayerNorm(H, **kw), nn.Linear(H, H, **kw)

    def forward(self, x):
        return self.linear(self.norm(x))


def make_pair(kind: str, device: str):
    """(te module, torch composition, tokens, extra forward arguments)."""
    kw = {"params_dtype": torch.bfloat16, "device": device}
    if kind == "Linear":
        return te.Linear(H, H, **kw), nn.Linear(H, H, dtype=torch.bfloat16, device=device), 16, ()
    if kind == "LayerNormLinear":
        return te.LayerNormLinear(H, H, **kw), TorchNormLinear(device), 16, ()
    if kind == "LayerNormMLP":
        return te.LayerNormMLP(H, F_MLP, **kw), TorchMLP(H, F_MLP, "gelu", device), 16, ()
    splits = split_tokens(128)
    return te.GroupedLinear(EXPERTS, H, H, **kw), LinearLoop(H, H, device), 128, (splits,)


def make_step(module, tokens: int, extra: tuple, fp8, backward: bool, device: str):
    x = torch.randn(tokens, H, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, H, device=device, dtype=torch.bfloat16)
    return fwd_bwd_step(module, x, dy, fp8, extra, backward)


def launches(step, device: str) -> int | None:
    """CUDA kernels one call of step launches (None off the GPU)."""
    if device != "cuda":
        return None
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def measure(steps: dict, rounds: int, calls: int, device: str) -> tuple[dict, dict]:
    """({name: median host us per call}, {name: kernels per call}) of each step: warmed up,
    then timed in interleaved rounds (a drift of the shared CPU touches all steps alike)."""
    counts = {}
    for name, step in steps.items():
        for _ in range(20):
            step()
        counts[name] = launches(step, device)
    samples = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            samples[name].append(host_round_us(step, calls, device))
    return {name: statistics.median(v) for name, v in samples.items()}, counts


def graphed_linear_steps(device: str) -> dict:
    """A graphed FP8 te.Linear forward+backward two ways: te.make_graphed_callables (the layer
    stays an autograd node) and the whole step captured by torch.cuda.graph (one replay).
    Empty off the GPU: nothing to capture."""
    if device != "cuda":
        return {}
    fp8 = recipe.DelayedScaling()
    layer = te.Linear(H, H, params_dtype=torch.bfloat16, device=device)
    x = torch.randn(16, H, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(16, H, device=device, dtype=torch.bfloat16)
    layer = te.make_graphed_callables(layer, (x,), fp8_enabled=True, fp8_recipe=fp8)
    steps = {"Linear te graphed delayed fwd+bwd": fwd_bwd_step(layer, x, dy, None)}
    whole = te.Linear(H, H, params_dtype=torch.bfloat16, device=device)
    step = fwd_bwd_step(whole, x, dy, fp8)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    steps["Linear te step-graph delayed fwd+bwd"] = graph.replay
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument(
        "--profile", action="append", default=[], metavar="CONFIG",
        help="print cProfile's top functions for this config (e.g. 'Linear te delayed fwd+bwd')",
    )  # fmt: skip
    parser.add_argument("--profile-rows", type=int, default=18)
    args = parser.parse_args()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/host_overhead.py needs a CUDA GPU (or --device cpu)")
    steps = {}
    for kind in ("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear"):
        te_module, torch_module, tokens, extra = make_pair(kind, device)
        for phase, backward in (("fwd", False), ("fwd+bwd", True)):
            name = f"{kind} torch bf16 {phase}"
            steps[name] = make_step(torch_module, tokens, extra, None, backward, device)
            for rname, make_recipe in RECIPES.items():
                fp8 = make_recipe() if make_recipe else None
                name = f"{kind} te {rname} {phase}"
                steps[name] = make_step(te_module, tokens, extra, fp8, backward, device)
    steps.update(graphed_linear_steps(device))
    host, counts = measure(steps, args.rounds, args.calls, device)
    env = environment(argparse.Namespace(device=device, quick=False, host_shape=None,
                                         gemm_shape=None))  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "host_us": host, "launches": counts}, f, indent=2)
    print(" ".join(f"{k}={v}" for k, v in env.items() if k in ("device", "torch", "date")))
    print(f"{'config':44s} {'host us':>9s} {'vs torch':>9s} {'launches':>9s}")
    for name, us in host.items():
        kind, phase = name.split()[0], name.split()[-1]
        base = host.get(f"{kind} torch bf16 {phase}")
        ratio = f"{us / base:.2f}x" if base else "-"
        count = "-" if counts[name] is None else str(counts[name])
        print(f"{name:44s} {us:9.1f} {ratio:>9s} {count:>9s}")
    for name in args.profile:
        print(f"\n== cProfile: {name}\n{cprofile_top(steps[name], rows=args.profile_rows)}")


if __name__ == "__main__":
    main()
