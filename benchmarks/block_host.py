"""Where a block-scaled step's wall time goes beyond its kernels: per case of
benchmarks/block_scaling.py, the GPU milliseconds of one step timed alone (CUDA events around
one step after a synchronize: the GPU waits for the host's first launch) and of steps back to
back (events around 10 steps: the host runs ahead, as in a training loop), the host
milliseconds to launch one step, and whether a step synchronizes with the GPU
(torch.cuda.set_sync_debug_mode).

    PYTHONPATH=. python benchmarks/block_host.py [--only NAME ...] [--cprofile]

With --cprofile, also the host's Python functions over 20 te block steps (cProfile, the 25
largest by own time).

Never asserts.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
import warnings

import torch
from block_scaling import CASES, RECIPES, _extras
from timing import fwd_bwd_step, gpu_ms


def host_ms(step, reps: int = 10) -> float:
    """Median wall milliseconds for the host to issue one step (GPU idle before each)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def syncs(step) -> list[str]:
    """The distinct synchronization warnings of one step."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sorted({str(w.message).splitlines()[0][:90] for w in caught})


def profile_host(name: str, step, reps: int = 20) -> None:
    """Print the 25 Python functions with the most own time over `reps` steps."""
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(reps):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    print(f"== host profile of {name}, te block, {reps} steps")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--cprofile", action="store_true")
    args = parser.parse_args()
    rows = []
    for name, (make, _flops) in CASES.items():
        if args.only and not any(s in name for s in args.only):
            continue
        torch_mod, te_mod, x, dy, extra = make()
        torch_extra, te_extra = _extras(extra)
        steps = {
            "torch bf16": fwd_bwd_step(torch_mod, x, dy, None, torch_extra),
            "te block": fwd_bwd_step(te_mod, x, dy, RECIPES["block"](), te_extra),
        }
        for label, step in steps.items():
            alone = gpu_ms(step, reps=10)
            back = gpu_ms(step, reps=5, inner=10)
            rows.append((name, label, alone, back, host_ms(step), syncs(step)))
        if args.cprofile:
            profile_host(name, steps["te block"])
        del torch_mod, te_mod
        torch.cuda.empty_cache()
    print(f"{'case':46s} {'impl':11s} {'alone ms':>9s} {'b2b ms':>8s} {'host ms':>8s}  syncs")
    base = {}
    for name, label, alone, back, host, found in rows:
        if label == "torch bf16":
            base[name] = (alone, back)
        ratio = f"({base[name][0] / alone:.2f}x / {base[name][1] / back:.2f}x)"
        print(f"{name:46s} {label:11s} {alone:9.3f} {back:8.3f} {host:8.3f}  "
              f"{ratio} {'; '.join(found) or 'none'}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
