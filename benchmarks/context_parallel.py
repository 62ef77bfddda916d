"""Context parallelism in te.DotProductAttention: causal self-attention over a long sequence
split across the ranks, forward + backward, against one GPU doing the whole attention.

    torchrun --standalone --nproc-per-node 2 benchmarks/context_parallel.py [--json out.json]

Shape: batch 1 x sequence 32768 (bshd), 32 heads of 128, bf16, causal. Each rank holds its
load-balanced share (chunks r and 2 P - 1 - r of 2 P) and runs te.DotProductAttention(
cp_group=WORLD, cp_comm_type=...) for "p2p" (ring, flash kernels), "a2a" (Ulysses) and
"all_gather"; its time is the median of --reps steps (CUDA events) after warm-up, and the
slowest rank's median is reported. Rank 0 measures the baseline in the same run: the whole
sequence's attention on one GPU (the others wait); 1/P of the work = that time / P;
efficiency = (one-GPU time / P) / CP time. Rank 0 prints; never asserts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from timing import gpu_ms

import torchte as te
from torchte.distributed import split_for_cp_rank

COMMS = ("p2p", "a2a", "all_gather")


def _step(module, q, k, v, dout):
    """One forward + backward of module on leaf copies of q, k, v."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]

    def step():
        out = module(*leaves)
        out.backward(dout)
        for x in leaves:
            x.grad = None

    return step


def _inputs(args, device):
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (args.batch, args.seq, args.heads, args.head_dim)
    q, k, v = (
        torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16) for _ in "qkv"
    )
    dout = torch.randn(
        args.batch, args.seq, args.heads * args.head_dim, generator=gen, device=device,
        dtype=torch.bfloat16,
    )  # fmt: skip
    return q, k, v, dout


def measure(args, world: int, rank: int, device) -> dict:
    """{comm type: slowest rank's median ms} and the one-GPU baseline (rank 0's) in ms."""
    q, k, v, dout = _inputs(args, device)
    results = {}
    if rank == 0:
        whole = te.DotProductAttention(args.heads, args.head_dim, qkv_format="bshd")
        results["baseline_ms"] = gpu_ms(_step(whole, q, k, v, dout), args.reps, 1, args.warmup)
    dist.barrier()
    local = [split_for_cp_rank(x, world, rank, 1) for x in (q, k, v, dout)]
    for comm in COMMS:
        module = te.DotProductAttention(
            args.heads, args.head_dim, qkv_format="bshd", cp_group=dist.group.WORLD,
            cp_global_ranks=list(range(world)), cp_comm_type=comm,
        )  # fmt: skip
        ms = gpu_ms(_step(module, *local), args.reps, 1, args.warmup)
        slowest = torch.tensor([ms], device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        results[comm] = slowest.item()
        if comm == args.profile:
            _profile(_step(module, *local), rank)
    return results


def _profile(step, rank: int) -> None:
    """Rank 0 prints the GPU kernels of 3 steps (torch.profiler), the costliest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    if rank == 0:
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18)
        print(table)


def report(args, world: int, results: dict) -> None:
    base = results["baseline_ms"]
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}: te.DotProductAttention "
        f"causal, batch {args.batch} x {args.seq} tokens, {args.heads} heads x {args.head_dim}, "
        f"bf16, forward + backward, CP over {world} GPUs"
    )
    print(f"one GPU, whole sequence: {base:.2f} ms; 1/{world} of the work: {base / world:.2f} ms")
    print(f"{'cp_comm_type':14s} {'CP ms':>9s} {'efficiency':>11s}")
    for comm in COMMS:
        ms = results[comm]
        print(f"{comm:14s} {ms:9.2f} {base / world / ms:10.1%}")
    print("efficiency: (one-GPU time / P) / the slowest rank's CP time (medians)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--profile", choices=COMMS, help="print the kernels of this comm type")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/context_parallel.py needs CUDA GPUs (torchrun, one per rank)")
    dist.init_process_group("nccl")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        results = measure(args, world, rank, device)
        if rank == 0:
            report(args, world, results)
            if args.json is not None:
                shape = {"batch": args.batch, "seq": args.seq, "heads": args.heads}
                shape["head_dim"] = args.head_dim
                base = results["baseline_ms"]
                rows = {
                    c: {"ms": results[c], "efficiency": base / world / results[c]} for c in COMMS
                }
                out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
                out.update(ranks=world, shape=shape, baseline_ms=base, cp=rows)
                args.json.write_text(json.dumps(out, indent=2))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
