"""Where the GPU time of a block-scaled step goes: every kernel of one forward+backward of the
block-scaling benchmark's cases (benchmarks/block_scaling.py), from the torch profiler.

    PYTHONPATH=. python benchmarks/block_profile.py [--only NAME ...] [--recipe block|mxfp8|nvfp4]

Per case: 3 warm-up steps, then 5 profiled steps (benchmarks/kernel_times.kernel_us); the
table lists each kernel's median microseconds per step (largest first, the top 14), then the
sum of all kernels and the step's wall time between CUDA events. Never asserts.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from block_scaling import CASES, RECIPES, _extras
from kernel_times import kernel_us
from timing import fwd_bwd_step

TOP = 14


def step_ms(step, reps: int = 5) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="case names (substrings)")
    parser.add_argument("--recipe", default="block", choices=["block", "mxfp8", "nvfp4", "bf16"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    make_recipe = None
    if args.recipe != "bf16":
        make_recipe = next(v for k, v in RECIPES.items() if k.startswith(args.recipe))
    for name, (make, _flops) in CASES.items():
        if args.only and not any(s in name for s in args.only):
            continue
        _torch_mod, te_mod, x, dy, extra = make()
        _, te_extra = _extras(extra)
        step = fwd_bwd_step(te_mod, x, dy, make_recipe() if make_recipe else None, te_extra)
        kernels = kernel_us(step, match="", width=70)
        wall = step_ms(step)
        print(f"\n== {name} [{args.recipe}]: kernels {sum(kernels.values()) / 1e3:.3f} ms, "
              f"step {wall:.3f} ms")  # fmt: skip
        for kname, us in sorted(kernels.items(), key=lambda kv: -kv[1])[:TOP]:
            print(f"  {us:9.1f} us  {kname}")
        del _torch_mod, te_mod
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
