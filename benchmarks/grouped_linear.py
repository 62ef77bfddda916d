"""te.GroupedLinear against a loop of nn.Linear and raw torch._grouped_mm: throughput and host.

    PYTHONPATH=. python benchmarks/grouped_linear.py [--json out.json]   # on a CUDA GPU

Throughput: forward+backward TFLOP/s, 8 experts, 32768 tokens split unevenly, 4096 -> 4096 and
4096 -> 14336 (CUDA events). Host: microseconds per forward+backward at 128 tokens over the 8
experts, beside one te.Linear on all 128 tokens (configs interleaved round by round;
medians). Never asserts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from linear import device_s, environment, host_round_us
from timing import cprofile_top, fwd_bwd_step
from torch import nn

import torchte as te
from torchte import recipe

EXPERTS = 8
# Uneven: a heavy expert, light ones, and one without tokens.
WEIGHTS = [0.30, 0.20, 0.15, 0.12, 0.10, 0.08, 0.05, 0.0]


def split_tokens(tokens: int) -> list[int]:
    """Uneven sizes, multiples of 16 (as FP8 MoE layers pad them), summing to tokens."""
    sizes = [int(tokens * w) // 16 * 16 for w in WEIGHTS]
    sizes[0] += tokens - sum(sizes)
    return sizes


class LinearLoop(nn.Module):
    """One nn.Linear per expert, called on its slice: the plain-PyTorch MoE layer."""

    def __init__(self, k: int, n: int, device: str = "cuda") -> None:
        super().__init__()
        kw = {"dtype": torch.bfloat16, "device": device}
        self.experts = nn.ModuleList(nn.Linear(k, n, **kw) for _ in range(EXPERTS))

    def forward(self, x, splits):
        parts = x.split(splits)
        return torch.cat([e(p) for e, p in zip(self.experts, parts, strict=True)])


class RawGroupedMM(nn.Module):
    """torch._grouped_mm on a (G, K, N) weight, autograd through torch, no bias."""

    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        w = torch.randn(EXPERTS, n, k, dtype=torch.bfloat16, device="cuda") / k**0.5
        self.weight = nn.Parameter(w)

    def forward(self, x, splits):
        offs = torch.tensor(splits, device="cuda").cumsum(0).to(torch.int32)
        return torch._grouped_mm(x, self.weight.transpose(1, 2), offs=offs)


def make_module(name: str, k: int, n: int) -> nn.Module:
    if name == "nn.Linear loop bf16":
        return LinearLoop(k, n)
    if name == "torch._grouped_mm bf16":
        return RawGroupedMM(k, n)
    return te.GroupedLinear(EXPERTS, k, n, params_dtype=torch.bfloat16, device="cuda")


CONFIGS = {
    "nn.Linear loop bf16": None,
    "torch._grouped_mm bf16": None,
    "te.GroupedLinear bf16": None,
    "te.GroupedLinear fp8 delayed": recipe.DelayedScaling,
    "te.GroupedLinear fp8 current": recipe.Float8CurrentScaling,
}


def make_step(name: str, module: nn.Module, tokens: int, k: int, n: int):
    splits = split_tokens(tokens)
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
    make_recipe = CONFIGS.get(name)
    fp8_recipe = make_recipe() if make_recipe else None
    return fwd_bwd_step(module, x, dy, fp8_recipe, (splits,))


def single_linear_step(tokens: int, k: int, n: int):
    layer = te.Linear(k, n, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)

    def step():
        x.grad = layer.weight.grad = layer.bias.grad = None
        layer(x).backward(dy)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", action="store_true", help="cProfile at 128 tokens only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/grouped_linear.py needs a CUDA GPU")
    if args.profile:
        for name in ("te.GroupedLinear bf16", "te.GroupedLinear fp8 delayed"):
            print(f"=== cProfile, {name}, 300 forward+backward steps at 128 tokens (tottime)")
            print(cprofile_top(make_step(name, make_module(name, 4096, 4096), 128, 4096, 4096)))
        return
    env = environment(
        argparse.Namespace(device="cuda", quick=False, host_shape=None, gemm_shape=None)
    )
    results: dict[str, dict] = {}
    tokens = 32768
    for k, n in ((4096, 4096), (4096, 14336)):
        flops = 3 * 2 * tokens * k * n
        for name in CONFIGS:
            torch.manual_seed(0)
            try:
                step = make_step(name, make_module(name, k, n), tokens, k, n)
                seconds = device_s(step, 5, 5, "cuda")
                results[f"{name} {k}x{n}"] = {"tflops": flops / seconds / 1e12}
            except Exception as exc:  # a benchmark reports, never stops
                results[f"{name} {k}x{n}"] = {"error": repr(exc)[:200]}
            step = None
            torch.cuda.empty_cache()
    steps = {name: make_step(name, make_module(name, 4096, 4096), 128, 4096, 4096)
             for name in CONFIGS}  # fmt: skip
    steps["te.Linear bf16 (one layer, 128 tokens)"] = single_linear_step(128, 4096, 4096)
    for step in steps.values():
        for _ in range(30):
            step()
    samples = {name: [] for name in steps}
    for _ in range(7):
        for name, step in steps.items():
            samples[name].append(host_round_us(step, 100, "cuda"))
    host = {name: statistics.median(v) for name, v in samples.items()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "results": results, "host_us": host}, f, indent=2)
    print(" ".join(f"{k}={v}" for k, v in env.items() if k in ("device", "torch", "date")))
    print("targets: te FP8 fwd+bwd >= 1.25x torch._grouped_mm bf16; host at 128 tokens <= 2x")
    print("         one te.Linear")
    for shape in ("4096x4096", "4096x14336"):
        base = results.get(f"torch._grouped_mm bf16 {shape}", {}).get("tflops")
        for name in CONFIGS:
            r = results[f"{name} {shape}"]
            if "error" in r:
                print(f"{name + ' ' + shape:46s} {r['error']}")
                continue
            ratio = f" ({r['tflops'] / base:.2f}x)" if base else ""
            print(f"{name + ' ' + shape:46s} {r['tflops']:8.0f} TFLOP/s{ratio}")
    single = host["te.Linear bf16 (one layer, 128 tokens)"]
    for name, us in host.items():
        print(f"host fwd+bwd {name:40s} {us:8.1f} us ({us / single:.2f}x one te.Linear)")


if __name__ == "__main__":
    main()
