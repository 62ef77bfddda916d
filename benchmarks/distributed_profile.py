"""Where the time of a distributed step goes: the torch profiler over a few steps of the FSDP2
training step (benchmarks/fsdp.py's) or the tensor-parallel te.LayerNormMLP step
(benchmarks/tensor_parallel.py's), summarised on rank 0.

    torchrun --nproc-per-node 2 benchmarks/distributed_profile.py fsdp:bf16:fp32 tp:fp8 ...

A case is fsdp:RECIPE:GATHER[:noprefetch][:keep] (RECIPE bf16, delayed or current; GATHER fp32,
bf16 or fp8; noprefetch: without the blocks' explicit all-gather prefetch, FSDP2's default
order; keep: --fsdp-keep-gathered, no all-gather in the backward) or
tp:PRECISION (bf16 or fp8, current scaling). Per case and rank: the step's wall time (median
of 10, synchronized), GPU time in the step as the union of kernel intervals (all streams), that
of the compute kernels, that of the NCCL kernels and the part of it no compute kernel overlaps
(exposed communication: transfers, and waits for the other rank), the host's time blocked in
synchronizations, kernels launched; rank 0's NCCL kernels by name and its host operations with
the most own CPU time. Prints only; never asserts.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from fsdp import random_corpus, run_config
from tensor_parallel import make_step
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import torchte as te
from torchte import recipe
from torchte.train import loop
from torchte.train.config import SIZES, ModelConfig
from torchte.train.fsdp_run import data_parallel, shard_model

PROFILED = 3
SYNCS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _minus(spans, cover) -> float:
    """Length of the union `spans` not covered by the union `cover` (both sorted)."""
    left, j = 0.0, 0
    for a, b in spans:
        while j < len(cover) and cover[j][1] <= a:
            j += 1
        k, covered = j, 0.0
        while k < len(cover) and cover[k][0] < b:
            covered += min(b, cover[k][1]) - max(a, cover[k][0])
            k += 1
        left += (b - a) - covered
    return left


def summarise(step, label: str) -> dict:
    """Wall ms (median of 10), then the profile of PROFILED steps: per-step ms of GPU busy,
    compute, NCCL, exposed NCCL, host blocked; launches; top host ops."""
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    walls = []
    for _ in range(10):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - start) * 1e3)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED):
            step()
        torch.cuda.synchronize()
    kernels, nccl, blocked, own = [], [], 0.0, defaultdict(float)
    by_collective = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            span, is_nccl = (e.time_range.start, e.time_range.end), "nccl" in e.name.lower()
            (nccl if is_nccl else kernels).append(span)
            if is_nccl:
                entry = by_collective[e.name.split("(")[0][:48]]
                entry[0] += 1
                entry[1] += (span[1] - span[0]) / 1e3
        else:
            own[e.name] += e.self_cpu_time_total / 1e3 / PROFILED
            if e.name in SYNCS:
                blocked += e.cpu_time_total / 1e3 / PROFILED
    compute, comm = _union(kernels), _union(nccl)
    top = sorted(own.items(), key=lambda kv: -kv[1])[:8]
    return {
        "case": label,
        "wall": statistics.median(walls),
        "gpu": _length(_union(kernels + nccl)) / 1e3 / PROFILED,
        "compute": _length(compute) / 1e3 / PROFILED,
        "nccl": _length(comm) / 1e3 / PROFILED,
        "exposed": _minus(comm, compute) / 1e3 / PROFILED,
        "blocked": blocked,
        "launches": (len(kernels) + len(nccl)) // PROFILED,
        "top": top,
        "collectives": {k: (n / PROFILED, ms / PROFILED) for k, (n, ms) in by_collective.items()},
    }


def fsdp_step(recipe_name: str, gather: str, *variant: str, dp, corpus, batch: int):
    preset = SIZES["large"]
    model_config = ModelConfig(preset.hidden, preset.layers, preset.heads, preset.ffn, 1024)
    config = run_config(recipe_name, batch * dp.size, True, gather, keep="keep" in variant)
    prefetch = "noprefetch" not in variant
    loop.shard_model = functools.partial(shard_model, prefetch=prefetch)
    try:
        trainer = loop.Trainer(recipe_name, model_config, config, corpus, dp=dp)
    finally:
        loop.shard_model = shard_model
    return trainer.train_step, trainer


def tp_step(precision: str, world: int, group):
    kw = {"params_dtype": torch.bfloat16, "device": "cuda", "activation": "gelu"}
    module = te.LayerNormMLP(
        8192, 28672, set_parallel_mode=True, sequence_parallel=True, tp_group=group, **kw
    )
    fp8 = recipe.Float8CurrentScaling() if precision == "fp8" else None
    return make_step(module, 4096 // world, 4, 8192, fp8), module


def main(cases: list[str]) -> None:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    try:
        dp, corpus, rows = None, None, []
        for case in cases:
            kind, *options = case.split(":")
            if kind == "fsdp":
                if dp is None:
                    dp, corpus = data_parallel("cuda"), random_corpus()
                step, keep = fsdp_step(*options, dp=dp, corpus=corpus, batch=16)
            else:
                step, keep = tp_step(options[0], world, dist.group.WORLD)
            row = summarise(step, case)
            del step, keep
            torch.cuda.empty_cache()
            every = [None] * world
            dist.all_gather_object(every, {k: v for k, v in row.items() if k != "top"})
            row["ranks"] = every
            rows.append(row)
        if rank == 0:
            report(rows)
    finally:
        dist.destroy_process_group()


def report(rows: list[dict]) -> None:
    for r in rows:
        print(f"== {r['case']}: top host ops (own ms per step)")
        print("   " + ", ".join(f"{name} {ms:.2f}" for name, ms in r["top"]))
        print("   NCCL kernels (calls, ms per step): " + ", ".join(
            f"{name} {n:.0f} {ms:.2f}" for name, (n, ms) in r["collectives"].items()
        ))  # fmt: skip
    head = ("case", "rank", "wall", "GPU busy", "compute", "NCCL", "exposed", "blocked")
    print(f"{head[0]:28s}" + "".join(f"{h:>9s}" for h in head[1:]) + "  launches")
    for r in rows:
        for rank, each in enumerate(r["ranks"]):
            values = [each[k] for k in ("wall", "gpu", "compute", "nccl", "exposed", "blocked")]
            line = f"{r['case']:28s}{rank:9d}" + "".join(f"{v:9.2f}" for v in values)
            print(line + f"{each['launches']:10d}")
    print("ms per step; GPU busy: union of all kernels; exposed: NCCL time without compute")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
