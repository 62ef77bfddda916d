"""MoELayer with expert parallelism: step time against one GPU holding every expert, with
the shared expert's overlap with the dispatch all-to-all on and off.

    torchrun --standalone --nproc-per-node 2 benchmarks/expert_parallel.py [--json out.json]

Layer: 8 experts, top-2 softmax routing, SwiGLU experts of hidden 2048 and FFN 4096 (FC1 8192
wide), a shared expert of FFN 4096, bf16 weights, host split sizes, one (E, N, K) weight per
GEMM; 16384 tokens a rank (the sizes of the brief: a 16K-token step is where the example's
large model runs, and FFN 4096 keeps each expert's GEMMs large enough (about 4K rows each) for
FP8 to pay). Forward + backward, CUDA events, median of --reps steps after warm-up; bf16, FP8
current scaling and FP8 delayed scaling (te.autocast). With P ranks each holds 8 / P experts
and its 16384 tokens are routed over all 8: the all-to-alls move each token's k rows to the
ranks of its experts and back. The baseline, measured in the same run by rank 0 alone (the
others wait at a barrier): one GPU holding all 8 experts running one rank's 16384 tokens (the
same expert GEMM work per GPU on balanced routing, no communication); efficiency = baseline
time / EP time. Overlap on: the shared expert runs while the dispatch all-to-all is in flight
(MoELayer(ep_overlap=True)); off: after the routed experts. Rank 0 prints; never asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

import torchte as te
from torchte import recipe
from torchte.moe import MoELayer

RECIPES = {
    "bf16": None,
    "fp8 current": recipe.Float8CurrentScaling,
    "fp8 delayed": recipe.DelayedScaling,
}


def step_ms(layer, x, dy, fp8, reps: int, warmup: int = 5) -> float:
    """Median milliseconds of a forward + backward of `layer` on x (CUDA events)."""

    def step():
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        with te.autocast(enabled=fp8 is not None, recipe=fp8):
            y = layer(x)
        y.backward(dy)

    for _ in range(warmup):
        step()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def make_layer(args, group, overlap: bool = True) -> MoELayer:
    """The benchmark's MoE layer (all experts here when group is None)."""
    return MoELayer(
        args.hidden, args.ffn, args.experts, args.top_k, activation="swiglu",
        shared_expert_ffn_hidden_size=args.shared_ffn or None, params_dtype=torch.bfloat16,
        device="cuda", device_splits=False, single_grouped_weight=True, ep_group=group,
        ep_overlap=overlap,
    )  # fmt: skip


def measure(args, world: int) -> dict:
    """{recipe: {"overlap_ms", "no_overlap_ms", "baseline_ms"}} (baseline on rank 0 only)."""
    gen = torch.Generator(device="cuda").manual_seed(1 + dist.get_rank())
    x = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    x.requires_grad_(True)
    dy = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    results = {}
    for name, make in RECIPES.items():
        row = {}
        for overlap in (True, False):
            torch.manual_seed(0)
            layer = make_layer(args, dist.group.WORLD, overlap)
            fp8 = make() if make else None
            key = "overlap_ms" if overlap else "no_overlap_ms"
            row[key] = step_ms(layer, x, dy, fp8, args.reps)
            del layer
        dist.barrier()
        if dist.get_rank() == 0:
            torch.manual_seed(0)
            baseline = make_layer(args, None)
            fp8 = make() if make else None
            row["baseline_ms"] = step_ms(baseline, x, dy, fp8, args.reps)
            del baseline
        torch.cuda.empty_cache()
        dist.barrier()
        results[name] = row
        if dist.get_rank() == 0:  # each row as it lands: a run cut short still reports
            print(f"{name}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
    return results


def report(args, world: int, results: dict) -> None:
    print(
        f"MoELayer EP={world}: {args.experts} experts, top-{args.top_k}, hidden {args.hidden}, "
        f"FFN {args.ffn} (swiglu), shared expert FFN {args.shared_ffn}, {args.tokens} tokens a "
        f"rank, forward+backward, median of {args.reps}; {torch.cuda.get_device_name()}"
    )
    head = ("recipe", "1 GPU ms", "EP ms", "eff.", "EP no-overlap ms", "eff.", "overlap gain")
    print(f"{head[0]:12s} {head[1]:>9s} {head[2]:>9s} {head[3]:>7s} {head[4]:>17s} "
          f"{head[5]:>7s} {head[6]:>12s}")  # fmt: skip
    for name, r in results.items():
        base, on, off = r["baseline_ms"], r["overlap_ms"], r["no_overlap_ms"]
        print(f"{name:12s} {base:9.2f} {on:9.2f} {base / on:7.1%} {off:17.2f} {base / off:7.1%} "
              f"{off / on:11.3f}x")  # fmt: skip
    print("efficiency: one GPU holding every expert on one rank's tokens / the EP step time")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384, help="tokens a rank")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=4096, help="each expert's FFN width")
    parser.add_argument("--shared-ffn", type=int, default=4096, help="0: no shared expert")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    try:
        world = dist.get_world_size()
        results = measure(args, world)
        if dist.get_rank() == 0:
            report(args, world, results)
            if args.json is not None:
                sizes = {k: getattr(args, k) for k in ("tokens", "hidden", "ffn", "experts")}
                payload = {"world": world, **sizes, "top_k": args.top_k, "results": results}
                payload["device"] = torch.cuda.get_device_name()
                args.json.write_text(json.dumps(payload, indent=2))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
