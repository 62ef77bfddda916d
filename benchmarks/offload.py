"""CPU activation offloading: step time and GPU memory of a te.LayerNormMLP stack, with and
without offloading L - 1 of its L layers.

    PYTHONPATH=. python benchmarks/offload.py [--layers 6 --tokens 4096 --hidden 8192]
        [--json out.json]                                          # on a CUDA GPU

Figures: forward+backward step time (CUDA events, median of steps after warm-up), activation
memory held at the end of the forward (memory allocated then, minus before it: gradients of
the last step are cleared), and the peak of a step (parameters and gradients included), for
prefetch depths 1-3. Never asserts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

import torchte as te


def run(layers, x, offload: bool, steps: int, prefetch: int = 1) -> dict:
    count = len(layers)
    context, sync = te.get_cpu_offload_context(
        enabled=offload,
        num_layers=count - 1,
        model_layers=count,
        retain_pinned_cpu_buffers=True,  # the host buffers of one step serve the next
        prefetch_layers=prefetch,
    )
    times, held = [], []
    for step in range(steps + 2):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        h = x
        for layer in layers:
            with context:
                h = layer(h)
            h = sync(h)
        held.append(torch.cuda.memory_allocated() - base)  # the allocator's view: no sync
        h.float().square().mean().backward()
        end.record()
        end.synchronize()
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        x.grad = None
        if step >= 2:
            times.append(start.elapsed_time(end))
    return {
        "step_ms": statistics.median(times),
        "activations_gib": statistics.median(held[2:]) / 2**30,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/offload.py needs a CUDA GPU")
    layers = [
        te.LayerNormMLP(args.hidden, 4 * args.hidden, params_dtype=torch.bfloat16, device="cuda")
        for _ in range(args.layers)
    ]
    x = torch.randn(
        args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True
    )
    results = {}
    runs = (("no offload", False, 1), ("offload, prefetch 1", True, 1))
    runs += (("offload, prefetch 2", True, 2), ("offload, prefetch 3", True, 3))
    for name, offload, prefetch in runs:
        results[name] = run(layers, x, offload, args.steps, prefetch)
    base = results["no offload"]
    print(
        f"{torch.cuda.get_device_name()}: {args.layers} x te.LayerNormMLP({args.hidden}, "
        f"{4 * args.hidden}) bf16, {args.tokens} tokens"
    )
    print("targets: activations <= 1/L of no-offload + 10%; step time <= 1.05x")
    for name, r in results.items():
        print(
            f"{name:22s} step {r['step_ms']:8.2f} ms ({r['step_ms'] / base['step_ms']:.2f}x)  "
            f"activations {r['activations_gib']:6.2f} GiB "
            f"({r['activations_gib'] / base['activations_gib']:.3f} of no-offload; 1/L = "
            f"{1 / args.layers:.3f})  peak {r['peak_gib']:6.2f} GiB"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
