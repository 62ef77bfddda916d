"""A te.LayerNormMLP block with tensor + sequence parallelism: step time, bytes moved by the
collectives, and scaling efficiency against one GPU doing one rank's share of the work.

    torchrun --nproc-per-node 2 benchmarks/tensor_parallel.py [--json out.json]  # 2 GPUs
    PYTHONPATH=. python benchmarks/tensor_parallel.py --single    # one GPU: checks it runs

Block: hidden 8192, FFN 28672 (GELU), 16384 tokens (sequence 4096 x batch 4, sequence first),
FP8 current scaling (and bf16), forward+backward, CUDA events, median of 5 x 3 steps.
With P ranks: te.LayerNormMLP(set_parallel_mode=True, sequence_parallel=True), each rank holding
S/P of the sequence; the baseline is one GPU running one rank's share, te.LayerNormMLP(hidden,
FFN / P) on all 16384 tokens (the same GEMM work per GPU, no communication); efficiency =
baseline time / parallel time. Bytes: what this rank's collectives send per step, counted in
te.distributed's helpers (all-gather: the rank's input; reduce-scatter and all-reduce: the
whole buffer) in a step, and apart those of the forward's all-gather of the norm output (FP8
bytes under FP8). --single runs the parallel module at P = 1 (an NCCL group of one rank; nothing
to move) at a smaller size beside its baseline, to check the script. Rank 0 prints; never
asserts.

Modes: te's collectives (the backward's reduce-scatter of fc1's input gradient overlapping
fc1's weight-gradient GEMM, the rest not overlapped). Then, in bf16, the same MLP built from
two te.Linear (column + SP, GELU, row + SP; no norm) with te's collectives and with torch's
symmetric-memory async TP (te.distributed.use_symmetric_memory: all-gather-matmul and
matmul-reduce-scatter micro-pipelined), against one GPU running that pair at FFN / P; at P = 1
(--single) both run without collectives (nothing is split).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from linear import device_s

import torchte as te
from torchte import distributed as te_dist
from torchte import recipe
from torchte.module import _tp_gemm as tp_gemm

RECIPES = {
    "bf16": None,
    "fp8 current": recipe.Float8CurrentScaling,
    "fp8 delayed": recipe.DelayedScaling,
    "fp8 block": recipe.Float8BlockScaling,
}


class ByteCounter:
    """Counts the bytes te.distributed's collectives take from this rank, per helper (wraps
    them)."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        self._wrapped = {}

    def __enter__(self):
        for name in ("gather_along_first_dim", "reduce_scatter_along_first_dim", "allreduce"):
            original = getattr(te_dist, name)
            self._wrapped[name] = original

            def counted(inp, *args, _original=original, _name=name, **kwargs):
                size = inp.numel() * inp.element_size()
                self.bytes[_name] = self.bytes.get(_name, 0) + size
                return _original(inp, *args, **kwargs)

            setattr(te_dist, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._wrapped.items():
            setattr(te_dist, name, original)


def make_step(module, tokens_local: int, batch: int, hidden: int, fp8_recipe, backward=True):
    x = torch.randn(tokens_local, batch, hidden, device="cuda", dtype=torch.bfloat16)
    x.requires_grad_(True)
    dy = torch.randn_like(x)

    def step():
        x.grad = None
        for p in module.parameters():
            p.grad = None
        with te.autocast(enabled=fp8_recipe is not None, recipe=fp8_recipe):
            y = module(x)
        if backward:
            y.backward(dy)

    return step


# mode: (overlap_tp_comm, use_symmetric_memory, fc2's ring reduce-scatter)
MODES = {
    "overlap": (True, False, True),
    "plain": (False, False, False),
    "symmetric": (True, True, True),
    "gathers only": (True, False, False),
}
_SCATTER = tp_gemm.overlapped_scatter


def _no_scatter(tp, plan):
    return None


def measure(args, world: int, group) -> dict:
    """{config: step ms, bytes, baseline ms}: each recipe with the collectives under the GEMMs
    (te.distributed.overlap_tp_comm, the default), without ("plain"), through torch's
    symmetric-memory fused GEMMs ("symmetric"), and with only the gathers overlapped ("gathers
    only")."""
    seq, batch, hidden, ffn = args.seq, args.batch, args.hidden, args.ffn
    kw = {"params_dtype": torch.bfloat16, "device": "cuda", "activation": "gelu"}
    results = {}
    for name, make in RECIPES.items():
        if args.recipes and name not in args.recipes:
            continue
        fp8 = make() if make else None
        baseline = te.LayerNormMLP(hidden, ffn // world, **kw)
        base_ms = device_s(make_step(baseline, seq, batch, hidden, fp8), 3, 5, "cuda") * 1e3
        del baseline
        parallel = te.LayerNormMLP(
            hidden, ffn, set_parallel_mode=True, sequence_parallel=True, tp_group=group, **kw
        )
        step = make_step(parallel, seq // world, batch, hidden, fp8)
        for mode, (overlapped, symmetric, ring) in MODES.items():
            if args.modes and mode not in args.modes:
                continue
            previous = te_dist.overlap_tp_comm(overlapped, fp8=overlapped)
            previous_symmetric = te_dist.use_symmetric_memory(symmetric)
            if not ring:  # the gathers overlapped, fc2's reduce-scatter plain
                tp_gemm.overlapped_scatter = _no_scatter
            try:
                ms = device_s(step, 3, 5, "cuda") * 1e3
                with ByteCounter() as counter:
                    step()
                with ByteCounter() as forward:
                    make_step(parallel, seq // world, batch, hidden, fp8, backward=False)()
            except Exception as err:  # reported; the other rows still stand
                print(f"rank {dist.get_rank()}: {name}, {mode} failed: {type(err).__name__}: {err}")
                continue
            finally:
                te_dist.overlap_tp_comm(previous, fp8=False)
                te_dist.use_symmetric_memory(previous_symmetric)
                tp_gemm.overlapped_scatter = _SCATTER
            torch.cuda.synchronize()
            gathered = forward.bytes.get("gather_along_first_dim", 0)
            total = sum(counter.bytes.values())
            results[f"{name}, {mode}"] = {
                "ms": ms, "bytes": total, "gather_bytes": gathered, "baseline_ms": base_ms
            }  # fmt: skip
        del parallel, step
        torch.cuda.empty_cache()
    return results


class LinearPair(torch.nn.Module):
    """fc2(gelu(fc1(x))): two te.Linear, column then row, sequence parallel over `group` (or
    whole, group None)."""

    def __init__(self, hidden: int, ffn: int, group) -> None:
        super().__init__()
        kw = {"params_dtype": torch.bfloat16, "device": "cuda"}
        if group is not None:
            kw.update(sequence_parallel=True, tp_group=group)
        column, row = ("column", "row") if group is not None else (None, None)
        self.fc1 = te.Linear(hidden, ffn, parallel_mode=column, **kw)
        self.fc2 = te.Linear(ffn, hidden, parallel_mode=row, **kw)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def measure_symmetric(args, world: int, group) -> dict:
    """Step ms of the bf16 te.Linear pair: te's collectives, symmetric memory, one GPU."""
    seq, batch, hidden, ffn = args.seq, args.batch, args.hidden, args.ffn
    pair = LinearPair(hidden, ffn, group)
    step = make_step(pair, seq // world, batch, hidden, None)
    results = {}
    for name, enabled in (("te collectives", False), ("symmetric memory", True)):
        previous = te_dist.use_symmetric_memory(enabled)
        try:
            results[name] = device_s(step, 3, 5, "cuda") * 1e3
        except Exception as err:  # reported in the table; the other rows still stand
            print(f"rank {dist.get_rank()}: {name} failed: {type(err).__name__}: {err}")
            results[name] = float("nan")
        finally:
            te_dist.use_symmetric_memory(previous)
    del pair, step
    baseline = LinearPair(hidden, ffn // world, None)
    base_step = make_step(baseline, seq, batch, hidden, None)
    results["1 GPU, 1/P work"] = device_s(base_step, 3, 5, "cuda") * 1e3
    del baseline, base_step
    torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--single", action="store_true", help="one GPU, P = 1, smaller size")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--ffn", type=int, default=28672)
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--recipes", nargs="*", choices=list(RECIPES), help="(default: all)")
    parser.add_argument("--modes", nargs="*", choices=list(MODES), help="(default: all)")
    parser.add_argument("--no-pair", action="store_true", help="skip the te.Linear pair")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/tensor_parallel.py needs CUDA GPUs")
    if args.single:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl", rank=0, world_size=1)
        args.seq, args.hidden, args.ffn = 1024, 4096, 14336
    else:
        dist.init_process_group("nccl")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.cuda.set_device(rank % torch.cuda.device_count())
        results = measure(args, world, dist.group.WORLD)
        if rank == 0:  # kept should the pair's run not finish
            write_json(args, world, results, {})
        pair = {} if args.no_pair else measure_symmetric(args, world, dist.group.WORLD)
        if rank == 0:
            write_json(args, world, results, pair)
            report(args, world, results, pair)
    finally:
        dist.destroy_process_group()


def write_json(args, world: int, results: dict, pair: dict) -> None:
    """Write --json (if given): the rows of the table, step times in ms, bytes per step."""
    if args.json is None:
        return
    shape = {"hidden": args.hidden, "ffn": args.ffn, "tokens": args.seq * args.batch}
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    result.update(ranks=world, shape=shape, mlp=results, linear_pair_ms=dict(pair))
    args.json.write_text(json.dumps(result, indent=2))


def report(args, world: int, results: dict, pair: dict) -> None:
    """Print the table."""
    tokens = args.seq * args.batch
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}: te.LayerNormMLP "
        f"{args.hidden} -> {args.ffn} -> {args.hidden}, {tokens} tokens, TP={world} + sequence "
        "parallel. overlap: the sequence-parallel collectives under the GEMMs "
        "(te.distributed.overlap_tp_comm; MB sent then leaves out fc2's ring reduce-scatter); "
        "plain: the collective, then the GEMM; symmetric: torch's symmetric-memory fused GEMMs; "
        "gathers only: the all-gathers overlapped, fc2's reduce-scatter plain (the backward's "
        "dgrad reduce-scatter overlaps the wgrad GEMM in every mode)"
    )
    head = ("config", "step ms", "1 GPU, 1/P work", "efficiency", "MB sent", "fwd gather MB")
    print(f"{head[0]:22s} {head[1]:>9s} {head[2]:>16s} {head[3]:>11s} {head[4]:>9s} {head[5]:>14s}")
    for name, r in results.items():
        efficiency = r["baseline_ms"] / r["ms"]
        print(
            f"{name:22s} {r['ms']:9.2f} {r['baseline_ms']:16.2f} {efficiency:10.1%} "
            f"{r['bytes'] / 2**20:9.1f} {r['gather_bytes'] / 2**20:14.1f}"
        )
    if "bf16, plain" in results and "fp8 current, plain" in results:
        bf16 = results["bf16, plain"]["gather_bytes"]
        fp8 = results["fp8 current, plain"]["gather_bytes"]
        if bf16:
            print(f"FP8 forward all-gather bytes / bf16's: {fp8 / bf16:.2f}")
    if pair:
        base = pair.pop("1 GPU, 1/P work")
        print(f"bf16 te.Linear pair (column + SP, GELU, row + SP); 1 GPU, 1/P work: {base:.2f} ms")
        for name, ms in pair.items():
            print(f"  {name:18s} {ms:9.2f} ms  efficiency {base / ms:6.1%}")
    print("efficiency: one GPU's step time on 1/P of the work / the parallel step time")


if __name__ == "__main__":
    main()
