"""Benchmarks that compare contenders doing the same work: each case's contenders are built
(a missing name or an unavailable device becomes a row status, not a crash), measured together
with their rounds interleaved (GPU time by CUDA events, or host time), and printed as a table of
values, TFLOP/s, launches and ratios to the case's best baseline, with any target marked ok or
MISS on a GPU (targets are for one: on the CPU each is shown as a GPU target, with no verdict).
benchmarks/attention.py is built on it; nothing here asserts.
"""

from __future__ import annotations

import gc
import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from timing import GPU_TARGETS_NOTE, fmt, gpu_ms

Step = Callable[[], None]


class Missing(Exception):
    """A torchte name a contender needs does not exist (yet)."""


class Unavailable(Exception):
    """A contender this device or this torch cannot run."""


@dataclass
class Contender:
    """One row: how to build its step (may raise Missing / Unavailable), whether it is a
    baseline of its case, and the bound on its ratio to the best baseline (<=), if any."""

    impl: str
    build: Callable[[], Step]
    baseline: bool = False
    target: float | None = None


@dataclass
class Case:
    """Contenders doing the same work, measured together (interleaved) and compared."""

    section: int
    name: str
    unit: str  # "ms" (GPU time) or "host us"
    contenders: list[Contender]
    flops: float | None = None  # per forward+backward, for TFLOP/s


def failure(exc: Exception) -> str:
    """A row's status for an exception raised building or running its contender."""
    if isinstance(exc, Missing):
        return f"missing: {exc}"
    if isinstance(exc, Unavailable):
        return f"n/a: {exc}"
    if isinstance(exc, NotImplementedError):
        return f"not implemented: {exc}"
    return f"error: {type(exc).__name__}: {exc}"


def run_checked(steps: dict[str, Step], rows: dict[str, dict], calls: int) -> dict[str, Step]:
    """Run each step `calls` times (warm-up, compilation); a failing one leaves its row the
    error and drops out. Returns the steps that ran."""
    alive = {}
    for name, step in steps.items():
        try:
            for _ in range(calls):
                step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            alive[name] = step
        except Exception as exc:  # a broken contender must not hide the others' figures
            rows[name]["status"] = failure(exc)
    return alive


def measure_gpu(steps, rows, opts) -> None:
    """Median ms per step: CUDA events over `reps` timings of `opts.inner` calls each (1 unless
    the benchmark sets it), rounds interleaved across steps."""
    alive = run_checked(steps, rows, 3)
    samples = {name: [] for name in alive}
    for _ in range(opts.rounds):
        for name, step in list(alive.items()):
            try:
                samples[name].append(
                    gpu_ms(step, reps=opts.reps, inner=getattr(opts, "inner", 1), warmup=1)
                )
            except Exception as exc:  # e.g. out of memory: report it, keep the others
                rows[name]["status"] = failure(exc)
                del alive[name], samples[name]
    for name, values in samples.items():
        rows[name]["value"] = statistics.median(values)


def measure_host(steps, rows, opts) -> None:
    """Median host us per step and kernel launches per step (benchmarks/host_overhead.py)."""
    from host_overhead import measure

    alive = run_checked(steps, rows, 3)
    host, launches = measure(alive, opts.host_rounds, opts.host_calls, "cuda")
    for name in alive:
        rows[name]["value"], rows[name]["launches"] = host[name], launches[name]


def finite_grad(t: torch.Tensor) -> bool:
    """Whether t has a gradient, all finite."""
    return t.grad is not None and bool(torch.isfinite(t.grad).all())


def check_once(steps, rows, opts) -> None:
    """--cpu-check: one forward+backward each; every tensor it should reach gets a finite
    gradient. Wall seconds recorded only to show it ran (not a measurement)."""
    for name, step in steps.items():
        try:
            start = time.perf_counter()
            step()
            seconds = time.perf_counter() - start
        except Exception as exc:
            rows[name]["status"] = failure(exc)
            continue
        n = len(step.grad_of)
        bad = [i for i, t in enumerate(step.grad_of) if not finite_grad(t)]
        rows[name]["status"] = (
            f"ran fwd+bwd ({seconds * 1e3:.1f} ms wall), {n} grads finite"
            if not bad
            else f"error: tensors {bad} of {n} got no finite gradient"
        )


def run_case(case: Case, measure, opts) -> list[dict]:
    """Build every contender, measure them together, add ratios; rows of the table."""
    rows, steps = {}, {}
    for c in case.contenders:
        row = {
            "section": case.section,
            "case": case.name,
            "impl": c.impl,
            "unit": case.unit,
            "baseline": c.baseline,
            "target": c.target,
            "status": "ok",
        }
        try:
            steps[c.impl] = c.build()
        except Exception as exc:  # reported in the table; the others still run
            row["status"] = failure(exc)
        rows[c.impl] = row
    measure(steps, rows, opts)
    del steps
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    add_ratios(list(rows.values()), case.flops)
    return list(rows.values())


def add_ratios(rows: list[dict], flops: float | None) -> None:
    """TFLOP/s where the case has flops, and each value's ratio to the case's best baseline."""
    base = [r["value"] for r in rows if r["baseline"] and "value" in r]
    for r in rows:
        if "value" not in r:
            continue
        if flops and r["unit"] == "ms":
            r["tflops"] = flops / r["value"] / 1e9
        if base:
            r["ratio"] = r["value"] / min(base)


def cell_target(r: dict, on_gpu: bool = True) -> str:
    """The target column: the bound, and ok / MISS once there is a ratio measured on a GPU;
    off a GPU the bound marked "(GPU target)", with no verdict."""
    if r.get("target") is None:
        return ""
    bound = f"<={r['target']:.2f}"
    if not on_gpu:
        return f"{bound} (GPU target)"
    if "ratio" not in r:
        return bound
    return f"{bound} {'ok' if r['ratio'] <= r['target'] else 'MISS'}"


def print_table(rows: list[dict], opts) -> None:
    """One block per case: value, TFLOP/s, launches, ratio to the best baseline, target
    (without a verdict, and a note saying why, when opts.device is the CPU)."""
    on_gpu = opts.device != "cpu"
    print(f"\n{'impl':38s} {'value':>10s} {'TFLOP/s':>8s} {'launch':>6s} {'vs base':>8s}  target")
    for case, group in itertools.groupby(rows, key=lambda r: (r["section"], r["case"])):
        group = list(group)
        print(f"[{case[0]}] {case[1]} ({group[0]['unit']})")
        for r in group:
            value = r.get("value")
            text = fmt(value, ".1f" if r["unit"] == "host us" else ".3f")
            ratio = fmt(r.get("ratio"), ".3f") + ("x" if "ratio" in r else "")
            name = r["impl"] + (" *" if r["baseline"] else "")
            print(
                f"  {name:36s} {text:>10s} {fmt(r.get('tflops'), '.1f'):>8s} "
                f"{fmt(r.get('launches'), 'd'):>6s} {ratio:>8s}  {cell_target(r, on_gpu)}"
            )
            if r["status"] != "ok":
                print(f"    {r['status'][:300]}")
    print("* baseline; vs base: value / the case's best baseline (lower is better)")
    if not on_gpu and any(r.get("target") is not None for r in rows):
        print(GPU_TARGETS_NOTE)
