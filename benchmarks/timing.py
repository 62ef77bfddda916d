"""Timing helpers shared by the kernel benchmarks (imported as `from timing import ...`)."""

from __future__ import annotations

import cProfile
import datetime
import io
import json
import pstats
import statistics
import time

import torch


def gpu_ms(fn, reps: int = 20, inner: int = 1, warmup: int = 3) -> float:
    """Median milliseconds per call of fn on the GPU: CUDA events around `inner` calls, `reps`
    times, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def copy_gbps() -> float:
    """GB/s of a device copy of 512 MiB (read + write counted): what a kernel's bytes are
    measured against."""
    src = torch.empty(1 << 29, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / gpu_ms(lambda: dst.copy_(src)) / 1e6


def host_us(fn, calls: int = 2000, warmup: int = 50) -> float:
    """Wall microseconds per call of fn, calls queued back to back with one synchronize at the
    end (the GPU waits on the host); best of 3 rounds."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def fmt(value, spec: str) -> str:
    """value formatted by spec, or '-' for a missing figure."""
    return "-" if value is None else format(value, spec)


# Printed under a table of figures measured on the CPU beside targets set for a GPU, which
# then get no verdict (a CPU run says nothing of whether a GPU meets them).
GPU_TARGETS_NOTE = (
    "note: the targets are for a CUDA GPU; on the CPU they are shown as GPU targets, with no "
    "ok / MISS"
)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def cprofile_top(step, steps: int = 300, warmup: int = 30, rows: int = 25) -> str:
    """The top `rows` entries by own time of cProfile over `steps` calls of step (after
    `warmup` calls; the GPU synchronized at both ends)."""
    for _ in range(warmup):
        step()
    _sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    _sync()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(rows)
    return out.getvalue()


def fwd_bwd_step(module, x, dy, fp8_recipe, extra: tuple = (), backward: bool = True):
    """A closure running module(x, *extra) under te.autocast (FP8 when fp8_recipe is given),
    then, if `backward`, its backward from dy with fresh gradients (as after
    zero_grad(set_to_none=True))."""
    import torchte as te

    params = list(module.parameters())

    def step():
        with te.autocast(enabled=fp8_recipe is not None, recipe=fp8_recipe):
            y = module(x, *extra)
        if backward:
            for p in params:
                p.grad = None
            x.grad = None
            y.backward(dy)

    return step


def print_bandwidth(title: str, rows: list[dict], op_width: int, impl_width: int) -> None:
    """The kernel benchmarks' bandwidth table: per (op, impl), ms, GB/s and the fraction of a
    device-to-device copy (or the error a row recorded)."""
    print(title)
    print(f"  {'op':{op_width}s} {'impl':{impl_width}s} {'ms':>8s} {'GB/s':>8s} {'of copy':>8s}")
    for row in rows:
        head = f"  {row['op']:{op_width}s} {row['impl']:{impl_width}s}"
        if "error" in row:
            print(f"{head} {row['error']}")
            continue
        print(f"{head} {row['ms']:8.4f} {row['GB/s']:8.1f} {row['frac']:8.3f}")


def write_kernel_json(path: str, rows: int, cols: int, **fields) -> None:
    """The kernel benchmarks' JSON: device, versions, date and shape, then `fields`."""
    import triton

    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.date.today().isoformat(),
        "shape": [rows, cols],
        **fields,
    }
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=str)
