"""Where the host time of an FP8 te.Linear step goes: each piece timed alone, then cProfile.

    PYTHONPATH=. python benchmarks/host_profile.py [--json out.json]

Host-bound regime (16 tokens x 1024 x 1024): each piece runs in a loop with no synchronization
inside; the figure is the median over rounds of microseconds per call. Nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from timing import cprofile_top

import torchte as te
from torchte import recipe
from torchte.kernels import cast_transpose as ct
from torchte.kernels.cast_spec import CastSpec
from torchte.kernels.scaling import update_delayed_scaling


def host_us(fn, calls: int = 300, rounds: int = 7) -> float:
    """Median over rounds of host microseconds per call of fn (synchronized per round)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per_call)


def pieces(tokens: int, features: int) -> dict[str, float]:
    dev = "cuda"
    x = torch.randn(tokens, features, device=dev, dtype=torch.bfloat16)
    w = torch.randn(features, features, device=dev, dtype=torch.bfloat16)
    b = torch.randn(features, device=dev, dtype=torch.bfloat16)
    a8 = x.to(torch.float8_e4m3fn)
    w8 = w.to(torch.float8_e4m3fn)
    one = torch.ones(1, device=dev)
    amax = torch.zeros(1, device=dev)
    e4m3 = torch.float8_e4m3fn
    # Made once, as a quantizer makes its CastSpec once per usage.
    delayed, current = CastSpec(e4m3, True, True, one, amax), CastSpec(e4m3, True, True)
    hist = torch.zeros(1024, 3, device=dev)
    nonfinite = torch.zeros(3, dtype=torch.int32, device=dev)
    scale = torch.ones(3, device=dev)
    lin = torch.nn.Linear(features, features, device=dev, dtype=torch.bfloat16)
    layer = te.Linear(features, features, device=dev, params_dtype=torch.bfloat16)
    xg = x.clone().requires_grad_()
    delayed, current = recipe.DelayedScaling(), recipe.Float8CurrentScaling()

    def fwd_in_region(r):
        def run():
            with te.autocast(recipe=r):
                layer(xg)

        return run

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, grad):
            return grad

    xr = x.clone().requires_grad_()
    gr = torch.ones_like(x)

    def lin_fwd_bwd():
        xr.grad = lin.weight.grad = lin.bias.grad = None
        lin(xr).backward(gr)

    results = {
        "python call": host_us(lambda: None),
        "custom Function fwd+bwd": host_us(lambda: Identity.apply(xr).backward(gr)),
        "torch view fwd+bwd": host_us(lambda: xr.view_as(xr).backward(gr)),
        "nn.Linear fwd+bwd": host_us(lin_fwd_bwd),
        "torch.empty(1)": host_us(lambda: torch.empty(1, device=dev)),
        "torch.zeros(1)": host_us(lambda: torch.zeros(1, device=dev)),
        "F.linear bf16": host_us(lambda: F.linear(x, w, b)),
        "nn.Linear fwd": host_us(lambda: lin(x)),
        "_scaled_mm": host_us(
            lambda: torch._scaled_mm(a8, w8.t(), one, one, b, None, torch.bfloat16, True)
        ),
        "quantize_delayed": host_us(lambda: ct.quantize(x, delayed)),
        "quantize_current": host_us(lambda: ct.quantize(x, current)),
        "update_delayed_scaling": host_us(
            lambda: update_delayed_scaling(hist, scale, nonfinite, 448.0, 0, "max")
        ),
        "autocast enter+exit": host_us(lambda: te.autocast(recipe=delayed).__enter__()),
        "te.Linear bf16 fwd": host_us(lambda: layer(x)),
    }
    with te.autocast(recipe=delayed):  # outer region: inner exits do not update scales
        results["te fwd delayed (no update)"] = host_us(lambda: layer(xg))
    with te.autocast(recipe=current):
        results["te fwd current"] = host_us(lambda: layer(xg))
    results["te fwd delayed + region"] = host_us(fwd_in_region(delayed))
    return results


def mlp_pieces(tokens: int, hidden: int) -> dict[str, float]:
    """Host us per call of the pieces of a bf16 LayerNormMLP step (ffn = 4 x hidden), each
    beside the torch op it replaces."""
    from torchte.kernels import activation as act
    from torchte.kernels import norm

    dev, bf16, ffn = "cuda", torch.bfloat16, 4 * hidden
    x = torch.randn(tokens, hidden, device=dev, dtype=bf16)
    h = torch.randn(tokens, ffn, device=dev, dtype=bf16)
    w1 = torch.randn(ffn, hidden, device=dev, dtype=bf16)
    g = torch.randn(hidden, device=dev, dtype=bf16)
    _, mean, rstd = norm.layernorm_forward(x, g, g, 1e-5, False)
    _, t_mean, t_rstd = torch.ops.aten.native_layer_norm(x, [hidden], g, g, 1e-5)
    layer = te.LayerNormMLP(hidden, ffn, device=dev, params_dtype=bf16)
    ref = torch.nn.Sequential(
        torch.nn.LayerNorm(hidden, device=dev, dtype=bf16),
        torch.nn.Linear(hidden, ffn, device=dev, dtype=bf16),
        torch.nn.GELU(approximate="tanh"),
        torch.nn.Linear(ffn, hidden, device=dev, dtype=bf16),
    )
    xg = x.clone().requires_grad_()

    class Seven(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b, c, d, e, f, g_):
            return a.view_as(a)

        @staticmethod
        def backward(ctx, grad):
            return grad, None, None, None, None, None, None

    def te_step():
        xg.grad = None
        layer.zero_grad(set_to_none=True)
        layer(xg).backward(x)

    def torch_step():
        xg.grad = None
        ref.zero_grad(set_to_none=True)
        ref(xg).backward(x)

    with torch.no_grad():
        fwd_only = {"te.LayerNormMLP fwd (no grad)": host_us(lambda: layer(x))}
        fwd_only["torch MLP fwd (no grad)"] = host_us(lambda: ref(x))
    return fwd_only | {
        "te.LayerNormMLP fwd+bwd": host_us(te_step),
        "torch MLP fwd+bwd": host_us(torch_step),
        "7-input Function fwd+bwd": host_us(
            lambda: Seven.apply(xg, g, g, w1, g, w1, g).backward(x)
        ),
        "te layernorm_forward": host_us(lambda: norm.layernorm_forward(x, g, g, 1e-5, False)),
        "F.layer_norm": host_us(lambda: torch.nn.functional.layer_norm(x, (hidden,), g, g)),
        "te layernorm_backward": host_us(
            lambda: norm.layernorm_backward(x, x, g, mean, rstd, False)
        ),
        "aten layer_norm_backward": host_us(
            lambda: torch.ops.aten.native_layer_norm_backward(
                x, x, [hidden], t_mean, t_rstd, g, g, [True, True, True]
            )
        ),
        "te activation_forward gelu": host_us(
            lambda: act.activation_forward(h, "gelu", 7.0, 1.702)
        ),
        "F.gelu tanh": host_us(lambda: torch.nn.functional.gelu(h, approximate="tanh")),
        "te activation_backward gelu": host_us(
            lambda: act.activation_backward(h, h, "gelu", 7.0, 1.702)
        ),
        "aten gelu_backward": host_us(
            lambda: torch.ops.aten.gelu_backward(h, h, approximate="tanh")
        ),
        "F.linear 16x1024->4096": host_us(lambda: F.linear(x, w1, None)),
        "torch.mm dgrad 16x4096x1024": host_us(lambda: torch.mm(h, w1)),
        "h.sum(0) (bias grad)": host_us(lambda: h.sum(0)),
    }


def kernel_list(tokens: int, hidden: int) -> str:
    """The CUDA kernels (and their count) of one bf16 te.LayerNormMLP forward+backward."""
    layer = te.LayerNormMLP(hidden, 4 * hidden, device="cuda", params_dtype=torch.bfloat16)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for _ in range(3):
        layer(x).backward(x.detach())
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        layer(x).backward(x.detach())
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return f"{len(names)} kernels:\n  " + "\n  ".join(n[:100] for n in names)


def profile_step(tokens: int, features: int, fp8_recipe, steps: int = 300, mlp=False) -> str:
    """cProfile of `steps` forward+backward steps of a te.Linear (or te.LayerNormMLP with
    ffn = 4 x features), the top entries by own time."""
    if mlp:
        layer = te.LayerNormMLP(features, 4 * features, device="cuda", params_dtype=torch.bfloat16)
    else:
        layer = te.Linear(features, features, device="cuda", params_dtype=torch.bfloat16)
    x = torch.randn(tokens, features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, features, device="cuda", dtype=torch.bfloat16)

    def step():
        x.grad = None
        layer.zero_grad(set_to_none=True)
        with te.autocast(enabled=fp8_recipe is not None, recipe=fp8_recipe):
            y = layer(x)
        y.backward(dy)

    return cprofile_top(step, steps, rows=22)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--features", type=int, default=1024)
    parser.add_argument("--mlp", action="store_true", help="profile te.LayerNormMLP only")
    args = parser.parse_args()
    if args.mlp:
        for name, r in (("bf16", None), ("delayed", recipe.DelayedScaling())):
            print(f"=== cProfile, LayerNormMLP {name}, per 300 fwd+bwd steps (tottime)")
            print(profile_step(args.tokens, args.features, r, mlp=True))
        print("=== LayerNormMLP bf16", kernel_list(args.tokens, args.features))
        print(f"{'piece (LayerNormMLP bf16)':36s} {'host us/call':>12s}")
        for name, us in mlp_pieces(args.tokens, args.features).items():
            print(f"{name:36s} {us:12.1f}")
        return
    for name, r in (
        ("delayed", recipe.DelayedScaling()),
        ("current", recipe.Float8CurrentScaling()),
    ):
        print(f"=== cProfile, {name}, per 300 fwd+bwd steps (tottime)")
        print(profile_step(args.tokens, args.features, r))
    results = pieces(args.tokens, args.features)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    print(f"{'piece':32s} {'host us/call':>12s}")
    for name, us in results.items():
        print(f"{name:32s} {us:12.1f}")


if __name__ == "__main__":
    main()
