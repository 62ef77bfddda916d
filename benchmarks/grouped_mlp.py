"""The fused grouped MLP of te.ops (MoE: grouped FC1 -> SwiGLU scaled by the router's
probabilities -> grouped FC2) against the same MLP from torch._grouped_mm and torch ops.

    PYTHONPATH=. python benchmarks/grouped_mlp.py [--json out.json]   # on a CUDA GPU

Throughput: forward+backward milliseconds (CUDA events, medians), 8 experts, 32768 tokens split
unevenly, hidden 4096, FFN 14336 (FC1 4096 -> 28672, FC2 14336 -> 4096), no biases. Launches:
kernels per forward+backward step (torch profiler). Host: microseconds per forward+backward at
128 tokens (hidden 1024, FFN 1024, so the GPU waits on the host), beside one te.Linear fwd+bwd
on the same 128 tokens, configs interleaved round by round, medians. CUDA graph: one capture of
the te.ops MLP with the split sizes in a device tensor, replayed with other splits against the
eager result. Never asserts.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
from grouped_linear import EXPERTS, split_tokens
from host_overhead import launches, measure
from linear import device_s, environment
from torch import nn

import torchte as te
from torchte import recipe


class TorchGroupedMLP(nn.Module):
    """torch._grouped_mm bf16 for both GEMMs, torch's SwiGLU times the probabilities."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        kw = {"dtype": torch.bfloat16, "device": "cuda"}
        self.w1 = nn.Parameter(torch.randn(EXPERTS, 2 * ffn, hidden, **kw) / hidden**0.5)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, hidden, ffn, **kw) / ffn**0.5)

    def forward(self, x, splits, probs, _splits):
        offs = torch.tensor(splits, device="cuda").cumsum(0).to(torch.int32)
        h = torch._grouped_mm(x, self.w1.transpose(1, 2), offs=offs)
        gate, up = h.chunk(2, dim=-1)
        a = (F.silu(gate) * up * probs[:, None]).to(torch.bfloat16)
        return torch._grouped_mm(a, self.w2.transpose(1, 2), offs=offs)


def te_mlp(hidden: int, ffn: int) -> te.ops.Sequential:
    kw = {"dtype": torch.bfloat16, "device": "cuda", "bias": False}
    return te.ops.Sequential(
        te.ops.GroupedLinear(EXPERTS, hidden, 2 * ffn, **kw),
        te.ops.ScaledSwiGLU(),
        te.ops.GroupedLinear(EXPERTS, ffn, hidden, **kw),
    )


class OneByOne(nn.Module):
    """The same te.ops, each called alone: nothing fused."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.mlp = te_mlp(hidden, ffn)

    def forward(self, x, splits, probs, splits2):
        fc1, act, fc2 = self.mlp
        return fc2(act(fc1(x, splits), probs), splits2)


# name: (module, recipe, split sizes in a device tensor)
CONFIGS = {
    "torch._grouped_mm bf16": (TorchGroupedMLP, None, False),
    "te.ops bf16": (te_mlp, None, False),
    "te.ops fp8 delayed, unfused": (OneByOne, recipe.DelayedScaling, False),
    "te.ops fp8 delayed": (te_mlp, recipe.DelayedScaling, False),
    "te.ops fp8 delayed, device splits": (te_mlp, recipe.DelayedScaling, True),
    "te.ops fp8 current, unfused": (OneByOne, recipe.Float8CurrentScaling, False),
    "te.ops fp8 current": (te_mlp, recipe.Float8CurrentScaling, False),
    "te.ops fp8 current, device splits": (te_mlp, recipe.Float8CurrentScaling, True),
}


def make_step(name: str, tokens: int, hidden: int, ffn: int):
    make, make_recipe, on_device = CONFIGS[name]
    module = make(hidden, ffn)
    splits = split_tokens(tokens)
    if on_device:
        splits = torch.tensor(splits, device="cuda")
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(tokens, device="cuda", requires_grad=True)
    dy = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    fp8_recipe = make_recipe() if make_recipe else None
    params = list(module.parameters())

    def step():
        with te.autocast(enabled=fp8_recipe is not None, recipe=fp8_recipe):
            y = module(x, splits, probs, splits)
        for p in params:
            p.grad = None
        x.grad = probs.grad = None
        y.backward(dy)

    return step


def linear_step(tokens: int, features: int):
    layer = te.Linear(features, features, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(tokens, features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, features, device="cuda", dtype=torch.bfloat16)

    def step():
        x.grad = layer.weight.grad = layer.bias.grad = None
        layer(x).backward(dy)

    return step


def graphed_step(tokens: int, hidden: int, ffn: int):
    """fwd+bwd of the fused FP8 (delayed) MLP with device splits through
    te.make_graphed_callables: what the host does per step once the MLP is graphed."""
    mlp = te_mlp(hidden, ffn)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(tokens, device="cuda", requires_grad=True)
    splits = torch.tensor(split_tokens(tokens), device="cuda")
    dy = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    fp8 = recipe.DelayedScaling()
    graphed = te.make_graphed_callables(
        mlp, (x, splits, probs, splits), fp8_enabled=True, fp8_recipe=fp8
    )

    def step():
        x.grad = probs.grad = None
        graphed(x, splits, probs, splits).backward(dy)

    return step


def graph_capture(fp8_recipe) -> str:
    """Capture fwd+bwd of the te.ops MLP with device-side splits; replay with other splits."""
    hidden, ffn, tokens = 256, 256, 512
    mlp = te_mlp(hidden, ffn)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(tokens, device="cuda")
    splits = torch.tensor(split_tokens(tokens), device="cuda")
    try:
        graphed = te.make_graphed_callables(
            mlp, (x, splits, probs, splits), fp8_enabled=fp8_recipe is not None,
            fp8_recipe=fp8_recipe,
        )  # fmt: skip
        other = torch.tensor([64] * EXPERTS, device="cuda")
        splits.copy_(other)
        with te.autocast(enabled=fp8_recipe is not None, recipe=fp8_recipe):
            want = mlp(x, splits, probs, splits)
        got = graphed(x, splits, probs, splits)
        same = torch.equal(got, want)
        return "replay == eager" if same else f"replay differs by {(got - want).abs().max():.3g}"
    except Exception as exc:  # a benchmark reports, never stops
        return f"fails: {type(exc).__name__}: {str(exc)[:160]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/grouped_mlp.py needs a CUDA GPU")
    env = environment(
        argparse.Namespace(device="cuda", quick=False, host_shape=None, gemm_shape=None)
    )
    tokens, hidden, ffn = 32768, 4096, 14336
    results: dict[str, dict] = {}
    for name in CONFIGS:
        torch.manual_seed(0)
        try:
            step = make_step(name, tokens, hidden, ffn)
            ms = device_s(step, 3, 5, "cuda") * 1e3
            results[name] = {"ms": ms, "launches": launches(step, "cuda")}
        except Exception as exc:  # a benchmark reports, never stops
            results[name] = {"error": repr(exc)[:200]}
        step = None
        torch.cuda.empty_cache()
    steps = {name: make_step(name, 128, 1024, 1024) for name in CONFIGS}
    steps["te.ops fp8 delayed, device splits, graphed"] = graphed_step(128, 1024, 1024)
    steps["te.Linear bf16 1024x1024"] = linear_step(128, 1024)
    host, _ = measure(steps, 7, 100, "cuda")
    graphs = {
        "bf16": graph_capture(None),
        "fp8 delayed": graph_capture(recipe.DelayedScaling()),
        "fp8 current": graph_capture(recipe.Float8CurrentScaling()),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "results": results, "host_us": host,
                       "graphs": graphs}, f, indent=2)  # fmt: skip
    print(" ".join(f"{k}={v}" for k, v in env.items() if k in ("device", "torch", "date")))
    print(f"{EXPERTS} experts, {tokens} tokens {split_tokens(tokens)}, {hidden} -> 2x{ffn} -> "
          f"{hidden}; target: FP8 fwd+bwd >= 1.4x torch bf16 grouped")  # fmt: skip
    base = results["torch._grouped_mm bf16"].get("ms")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:34s} {r['error']}")
            continue
        ratio = f"{base / r['ms']:.2f}x" if base else "-"
        print(f"{name:34s} {r['ms']:8.2f} ms  {ratio:>6s}  launches {r['launches']}")
    single = host["te.Linear bf16 1024x1024"]
    print("host fwd+bwd at 128 tokens (target: fused grouped MLP <= 3x one te.Linear):")
    for name, us in host.items():
        print(f"  {name:42s} {us:8.1f} us ({us / single:.2f}x one te.Linear)")
    for name, outcome in graphs.items():
        print(f"CUDA graph, device splits, {name}: {outcome}")


if __name__ == "__main__":
    main()
