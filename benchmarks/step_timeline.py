"""Where a block step's wall time goes between its kernels: the GPU's idle gaps, each put down
to the host (its launch came after the GPU ran dry) or to the GPU (the work was queued).

    PYTHONPATH=. python benchmarks/step_timeline.py [--blocks gpt] [--recipes bf16 delayed]

For the plain-PyTorch bf16 block and the te block under each recipe (benchmarks/block.py's
blocks and sizes), two ways of timing:
- alone: each step between two CUDA events after a synchronize (block.py's timing);
- back to back: `STEPS` steps between two events, the host ahead as in a training loop.
Then a profiled run of each way (torch profiler, CUDA activities): per step the GPU's busy
time (kernels, copies and fills), its idle time, and the idle time's share where the next
launch call ended after the GPU had gone idle ("host late"); the largest gaps with the CPU op
that launched the kernel after them; the CUDA API calls that took the host longest (a
cudaMalloc, a wait). Never asserts.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from block import FULL, KINDS, QUICK, TeBlock, TorchBlock, block_step
from timing import gpu_ms
from torch.profiler import ProfilerActivity, profile, record_function

STEPS = 5  # steps per back-to-back timing and per profiled run
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
GAP_US = 2.0  # gaps shorter than this are the hardware's own between queued kernels
SLOW_CALL_US = 20.0  # CUDA API calls longer than this are listed (allocations, waits)


def event_ms(step, steps: int, alone: bool, rounds: int = 7) -> float:
    """Median ms per step: each step between two events after the last one finished (alone),
    or `steps` steps between two events (back to back), `rounds` times (timing.gpu_ms)."""
    if alone:
        return gpu_ms(step, reps=rounds * steps, warmup=0)
    return gpu_ms(step, reps=rounds, inner=steps, warmup=0)


def trace_events(step, steps: int, alone: bool) -> list[dict]:
    """The chrome-trace events of `steps` profiled steps (a synchronize between them if
    alone), each step inside a `step` annotation."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            if alone:
                torch.cuda.synchronize()
            with record_function("step"):
                step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())["traceEvents"]


def enclosing_op(cpu_ops: list[dict], tid, ts: float) -> str:
    """The innermost CPU op on thread `tid` running at time ts (the launch's caller)."""
    running = [op for op in cpu_ops if op["tid"] == tid and op["ts"] <= ts <= op["ts"] + op["dur"]]
    return min(running, key=lambda op: op["dur"])["name"] if running else "?"


def gaps_of(events: list[dict], steps: int) -> dict:
    """Busy / idle / host-late microseconds per step over the profiled window (from the first
    step's start to the last GPU work's end) and the largest gaps."""
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})
    }
    cpu_ops = [e for e in events if e.get("cat") == "cpu_op" and "dur" in e]
    marks = [e for e in events if e.get("cat") == "user_annotation" and e.get("name") == "step"]
    start = min(m["ts"] for m in marks)
    end_of_work, busy, idle, host_late, gaps = start, 0.0, 0.0, 0.0, []
    for e in gpu:
        gap = e["ts"] - end_of_work
        if gap > GAP_US:
            idle += gap
            launch = launches.get(e.get("args", {}).get("correlation"))
            late = launch is not None and launch["ts"] + launch.get("dur", 0) > end_of_work
            host_late += gap if late else 0.0
            op = enclosing_op(cpu_ops, launch["tid"], launch["ts"]) if launch else "?"
            gaps.append((gap, "host" if late else "gpu", op, e["name"][:60]))
        busy += max(0.0, e["ts"] + e["dur"] - max(e["ts"], end_of_work))
        end_of_work = max(end_of_work, e["ts"] + e["dur"])
    gaps.sort(key=lambda g: -g[0])
    slow: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") in LAUNCH_CATEGORIES and e.get("dur", 0) > SLOW_CALL_US:
            slow.setdefault(e["name"], []).append(e["dur"])
    return {
        "slow_calls": sorted(
            ((n, sum(d) / steps, len(d) / steps) for n, d in slow.items()), key=lambda c: -c[1]
        )[:6],
        "wall_us": (end_of_work - start) / steps,
        "busy_us": busy / steps,
        "idle_us": idle / steps,
        "host_late_us": host_late / steps,
        "largest": gaps[:8],
    }


def contenders(blocks, recipes, dims, device):
    """(name, step) of the torch bf16 block and the te block under each recipe, per block."""
    for name in blocks:
        kind = KINDS[name]
        yield (
            f"{name} torch bf16",
            lambda k=kind: block_step(lambda: TorchBlock(dims, k, device), dims, device, "bf16"),
        )
        for recipe in recipes:
            yield (
                f"{name} te {recipe}",
                lambda k=kind, r=recipe: block_step(
                    lambda: TeBlock(dims, k, device), dims, device, r
                ),
            )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--blocks", nargs="+", choices=tuple(KINDS), default=["gpt"])
    p.add_argument("--recipes", nargs="+", default=["bf16", "delayed", "current", "block"])
    p.add_argument("--quick", action="store_true", help="block.py's smaller block")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--no-cudnn-attention", action="store_true", help="SDPA without cuDNN")
    opts = p.parse_args(argv)
    torch.backends.cuda.enable_cudnn_sdp(not opts.no_cudnn_attention)
    if not torch.cuda.is_available():
        print("benchmarks/step_timeline.py needs a CUDA GPU")
        return 0
    device, dims = torch.device("cuda"), QUICK if opts.quick else FULL
    results = {}
    for name, make in contenders(opts.blocks, opts.recipes, dims, device):
        step = make()
        for _ in range(3):
            step()
        row = {"alone_ms": event_ms(step, STEPS, True), "b2b_ms": event_ms(step, STEPS, False)}
        for mode, alone in (("alone", True), ("b2b", False)):
            row[mode] = gaps_of(trace_events(step, STEPS, alone), STEPS)
        results[name] = row
        del step
        torch.cuda.empty_cache()
        print(f"done {name}", flush=True)
        for mode in ("alone", "b2b"):
            for gap, cause, op, kernel in row[mode]["largest"][:5]:
                print(f"  {mode:5s} gap {gap:7.1f} us {cause:4s} after {op[:40]:40s} -> {kernel}")
            for call, us, count in row[mode]["slow_calls"]:
                print(f"  {mode:5s} slow API call {call[:40]:40s} {us:8.1f} us {count:5.1f} a step")
    if opts.json:
        Path(opts.json).write_text(json.dumps(results, indent=2))
    base = {n.split()[0]: r for n, r in results.items() if n.endswith("torch bf16")}
    print("\nms per step; profiled: GPU busy / idle / idle with the host late (us per step)")
    print(f"{'contender':22s} {'alone':>7s} {'b2b':>7s} {'x alone':>7s} {'x b2b':>6s}  profiled")
    for name, r in results.items():
        ref = base[name.split()[0]]
        prof = "  ".join(
            f"{m}: {r[m]['busy_us']:.0f}/{r[m]['idle_us']:.0f}/{r[m]['host_late_us']:.0f}"
            for m in ("alone", "b2b")
        )
        print(
            f"{name:22s} {r['alone_ms']:7.3f} {r['b2b_ms']:7.3f} "
            f"{ref['alone_ms'] / r['alone_ms']:6.2f}x {ref['b2b_ms'] / r['b2b_ms']:5.2f}x  {prof}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
