"""te.ops against the te modules they mirror: host time per call, forward+backward.

    cd benchmarks && PYTHONPATH=.. python ops_overhead.py [--device cpu] [--rounds 7]

At 16 tokens, hidden 1024, bf16 and FP8 (delayed, current): te.ops.Linear beside te.Linear,
te.ops.Sequential(LayerNorm, Linear) beside te.LayerNormLinear, and a dense MLP block
(LayerNorm, Linear, GELU, Linear) beside te.LayerNormMLP, each beside nn.Linear's step for
scale; configs interleaved round by round, medians of rounds, kernels per call on a GPU.
Never asserts.
"""

from __future__ import annotations

import argparse

import torch
from host_overhead import RECIPES, make_step, measure
from torch import nn

import torchte as te

H, F_MLP = 1024, 4096


def mlp_ops(device: str) -> te.ops.Sequential:
    """LayerNorm -> Linear -> GELU -> Linear as ops."""
    kw = {"dtype": torch.bfloat16, "device": device}
    ops = [te.ops.LayerNorm(H, **kw), te.ops.Linear(H, F_MLP, **kw), te.ops.GELU()]
    return te.ops.Sequential(*ops, te.ops.Linear(F_MLP, H, **kw))


def pairs(device: str) -> dict[str, tuple[nn.Module, nn.Module]]:
    """name -> (te.ops version, te module version)."""
    kw = {"dtype": torch.bfloat16, "device": device}
    mkw = {"params_dtype": torch.bfloat16, "device": device}
    norm_linear = te.ops.Sequential(te.ops.LayerNorm(H, **kw), te.ops.Linear(H, H, **kw))
    return {
        "Linear": (te.ops.Linear(H, H, **kw), te.Linear(H, H, **mkw)),
        "LayerNormLinear": (norm_linear, te.LayerNormLinear(H, H, **mkw)),
        "LayerNormMLP": (mlp_ops(device), te.LayerNormMLP(H, F_MLP, **mkw)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args()
    device = args.device
    steps = {"nn.Linear bf16": make_step(nn.Linear(H, H, dtype=torch.bfloat16, device=device),
                                          16, (), None, True, device)}  # fmt: skip
    for kind, (ops, module) in pairs(device).items():
        for rname, make_recipe in RECIPES.items():
            for label, layer in (("te.ops", ops), ("module", module)):
                fp8 = make_recipe() if make_recipe else None
                steps[f"{kind} {label} {rname}"] = make_step(layer, 16, (), fp8, True, device)
    host, counts = measure(steps, args.rounds, args.calls, device)
    base = host["nn.Linear bf16"]
    head = ("config (fwd+bwd, 16 tokens)", "host us", "vs nn", "vs module", "kernels")
    print(f"{head[0]:36s} {head[1]:>9s} {head[2]:>7s} {head[3]:>10s} {head[4]:>8s}")
    for name, us in host.items():
        twin = name.replace(" te.ops ", " module ")
        versus = f"{us / host[twin]:.2f}x" if " te.ops " in name else "-"
        print(f"{name:36s} {us:9.1f} {us / base:6.2f}x {versus:>10s} {counts[name]!s:>8s}")


if __name__ == "__main__":
    main()
