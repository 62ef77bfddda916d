"""te.LayerNormMLP against the torch bf16 composition: throughput and host time per call.

    PYTHONPATH=. python benchmarks/layernorm_mlp.py [--json out.json]   # on a CUDA GPU

Throughput: forward+backward TFLOP/s at 8192 tokens, hidden 4096, ffn 16384 (CUDA events).
Host: microseconds per forward+backward at 16 tokens, hidden 1024, ffn 4096 (configs
interleaved round by round; medians). For GELU and SwiGLU MLPs, torch bf16 (LayerNorm, Linear,
activation, Linear) beside te.LayerNormMLP in bf16 and FP8 (delayed, current). Never asserts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F
from linear import device_s, environment, host_round_us
from timing import fwd_bwd_step
from torch import nn

import torchte as te
from torchte import recipe


class TorchMLP(nn.Module):
    """The plain-PyTorch composition: LayerNorm (or RMSNorm) -> Linear -> GELU / SwiGLU ->
    Linear, in bf16; bias: whether the linear layers have biases."""

    def __init__(
        self, hidden: int, ffn: int, activation: str, device: str = "cuda",
        norm: str = "LayerNorm", bias: bool = True,
    ) -> None:  # fmt: skip
        super().__init__()
        kw = {"dtype": torch.bfloat16, "device": device}
        gated = activation == "swiglu"
        self.activation = activation
        self.norm = (nn.LayerNorm if norm == "LayerNorm" else nn.RMSNorm)(hidden, eps=1e-5, **kw)
        self.fc1 = nn.Linear(hidden, 2 * ffn if gated else ffn, bias=bias, **kw)
        self.fc2 = nn.Linear(ffn, hidden, bias=bias, **kw)

    def forward(self, x):
        h = self.fc1(self.norm(x))
        if self.activation == "swiglu":
            x1, x2 = h.chunk(2, dim=-1)
            a = F.silu(x1) * x2
        else:
            a = F.gelu(h, approximate="tanh")
        return self.fc2(a)


CONFIGS = {
    "torch bf16": None,
    "te bf16": None,
    "te fp8 delayed": recipe.DelayedScaling,
    "te fp8 current": recipe.Float8CurrentScaling,
}


def make_step(name: str, activation: str, tokens: int, hidden: int, ffn: int):
    if name.startswith("torch"):
        module = TorchMLP(hidden, ffn, activation)
    else:
        module = te.LayerNormMLP(
            hidden, ffn, activation=activation, params_dtype=torch.bfloat16, device="cuda"
        )
    make_recipe = CONFIGS[name]
    fp8_recipe = make_recipe() if make_recipe else None
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    return fwd_bwd_step(module, x, dy, fp8_recipe)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/layernorm_mlp.py needs a CUDA GPU")
    env = environment(
        argparse.Namespace(device="cuda", quick=False, host_shape=None, gemm_shape=None)
    )
    results: dict[str, dict] = {}
    for activation in ("gelu", "swiglu"):
        big = (8192, 4096, 16384)
        gated = 2 if activation == "swiglu" else 1
        flops = 3 * 2 * big[0] * big[1] * big[2] * (gated + 1)
        for name in CONFIGS:
            torch.manual_seed(0)
            step = make_step(name, activation, *big)
            seconds = device_s(step, 5, 5, "cuda")
            results[f"{activation} {name}"] = {"tflops": flops / seconds / 1e12}
            del step
            torch.cuda.empty_cache()
        steps = {name: make_step(name, activation, 16, 1024, 4096) for name in CONFIGS}
        for step in steps.values():
            for _ in range(50):
                step()
        samples = {name: [] for name in steps}
        for _ in range(7):
            for name, step in steps.items():
                samples[name].append(host_round_us(step, 200, "cuda"))
        for name, values in samples.items():
            results[f"{activation} {name}"]["host_fwd_bwd_us"] = statistics.median(values)
    for key, r in results.items():
        base = results[f"{key.split()[0]} torch bf16"]
        r["tflops_ratio"] = r["tflops"] / base["tflops"]
        r["host_ratio"] = r["host_fwd_bwd_us"] / base["host_fwd_bwd_us"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "results": results}, f, indent=2)
    print(" ".join(f"{k}={v}" for k, v in env.items() if k in ("device", "torch", "date")))
    print("targets: FP8 fwd+bwd >= 1.5x torch bf16 throughput; host <= 1.3x torch bf16")
    print(f"{'config':28s} {'TFLOP/s [8192x4096x16384]':>28s} {'host fwd+bwd us [16x1024]':>28s}")
    for key, r in results.items():
        tput = f"{r['tflops']:.0f} ({r['tflops_ratio']:.2f}x)"
        host = f"{r['host_fwd_bwd_us']:.1f} ({r['host_ratio']:.2f}x)"
        print(f"{key:28s} {tput:>28s} {host:>28s}")


if __name__ == "__main__":
    main()
