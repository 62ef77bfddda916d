"""te.Linear against torch.nn.Linear: host time per call, and fwd+bwd throughput.

    PYTHONPATH=. python benchmarks/linear.py [--json out.json]   # on a CUDA GPU
    PYTHONPATH=. python benchmarks/linear.py --quick             # tiny sizes, any device

Host regime (few tokens, the GPU waits for Python): microseconds per forward and per
forward+backward, the median over repeats of a loop with no synchronization inside and one at
its end. One te.autocast per iteration around the forward, backward outside it, as in a
training step. Throughput regime (large GEMMs): TFLOP/s of forward+backward (3 GEMMs of
2*M*N*K flops), timed with CUDA events. Every figure is also given as a ratio to
torch.nn.Linear in bf16, measured in the same run, beside its target if it has one: ok or MISS
on a GPU; on the CPU (--quick sizes) the targets, set for a GPU, are shown with no verdict.
Nothing here asserts.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import operator
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from timing import GPU_TARGETS_NOTE
from torch import nn

import torchte as te
from torchte import recipe

BASELINE = "torch bf16"


@dataclass(frozen=True)
class Config:
    """One contender: a layer kind and an optional FP8 recipe."""

    name: str
    use_te: bool
    make_recipe: Callable[[], recipe.Recipe] | None = None


CONFIGS = (
    Config(BASELINE, use_te=False),
    Config("te bf16", use_te=True),
    Config("te fp8 delayed", use_te=True, make_recipe=recipe.DelayedScaling),
    Config("te fp8 current", use_te=True, make_recipe=recipe.Float8CurrentScaling),
)

# (figure, config prefix, comparison, bound): the goals printed beside the figures.
TARGETS = (
    ("host_fwd_ratio", "te bf16", "<=", 1.1),
    ("host_fwd_bwd_ratio", "te bf16", "<=", 1.1),
    ("host_fwd_bwd_ratio", "te fp8", "<=", 1.5),
    ("tflops_ratio", "te fp8", ">=", 1.6),
)
_COMPARE = {"<=": operator.le, ">=": operator.ge}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line; on a machine without CUDA the run falls back to --quick sizes."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny sizes and few iterations")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None)
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False")
    if args.device == "cpu" and not args.quick:
        print("note: no CUDA device, using --quick sizes", file=sys.stderr)
        args.quick = True
    q = args.quick
    args.host_shape = (16, 64, 64) if q else (16, 1024, 1024)  # tokens, in, out
    args.gemm_shape = (256, 256, 256) if q else (8192, 8192, 8192)  # M, K, N
    args.host_iters, args.host_repeats = (20, 3) if q else (200, 7)
    args.gemm_iters, args.gemm_repeats = (2, 3) if q else (10, 5)
    return args


def make_layer(cfg: Config, in_f: int, out_f: int, device: str) -> nn.Module:
    """A bf16 layer of the config's kind on `device`."""
    if cfg.use_te:
        return te.Linear(in_f, out_f, params_dtype=torch.bfloat16, device=device)
    return nn.Linear(in_f, out_f, dtype=torch.bfloat16, device=device)


def make_step(cfg: Config, layer: nn.Module, x: torch.Tensor, dy: torch.Tensor, backward: bool):
    """A closure running one forward (under autocast for FP8), and backward if asked."""
    fp8_recipe = cfg.make_recipe() if cfg.make_recipe else None
    params = list(layer.parameters())

    def step() -> None:
        ctx = te.autocast(recipe=fp8_recipe) if fp8_recipe else contextlib.nullcontext()
        with ctx:
            y = layer(x)
        if backward:
            for p in params:  # fresh grads, as after zero_grad(set_to_none=True)
                p.grad = None
            x.grad = None
            torch.autograd.backward(y, dy)

    return step


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def host_round_us(step: Callable[[], None], iters: int, device: str) -> float:
    """Microseconds per call over one round of `iters` calls, synchronized at its ends."""
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        step()
    _sync(device)
    return (time.perf_counter() - start) / iters * 1e6


def measure_host(configs, args: argparse.Namespace) -> dict[str, dict]:
    """Host figures of every config, interleaved: each round times every config once, so a
    drift of the shared CPU's speed over the run touches all of them alike; medians of rounds.
    """
    m, k, n = args.host_shape
    steps: dict[tuple[str, str], Callable[[], None]] = {}
    out: dict[str, dict] = {cfg.name: {} for cfg in configs}
    for cfg in configs:
        try:
            torch.manual_seed(0)
            layer, x, dy = _inputs(cfg, m, k, n, args.device)
            for key, bwd in (("host_fwd_us", False), ("host_fwd_bwd_us", True)):
                step = make_step(cfg, layer, x, dy, backward=bwd)
                for _ in range(max(args.host_iters // 4, 3)):
                    step()
                steps[(cfg.name, key)] = step
        except Exception as exc:  # a broken contender must not hide the others' figures
            out[cfg.name]["error"] = f"{type(exc).__name__}: {exc}"
    samples: dict[tuple[str, str], list[float]] = {key: [] for key in steps}
    for _ in range(args.host_repeats):
        for key, step in steps.items():
            samples[key].append(host_round_us(step, args.host_iters, args.device))
    for (name, key), values in samples.items():
        out[name][key] = statistics.median(values)
    return out


def device_s(step: Callable[[], None], iters: int, repeats: int, device: str) -> float:
    """Median seconds per call on the device (CUDA events; wall clock on the CPU)."""
    for _ in range(3):
        step()
    times = []
    for _ in range(repeats):
        _sync(device)
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                step()
            times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def _inputs(cfg: Config, m: int, k: int, n: int, device: str):
    layer = make_layer(cfg, k, n, device)
    x = torch.randn(m, k, dtype=torch.bfloat16, device=device, requires_grad=True)
    dy = torch.randn(m, n, dtype=torch.bfloat16, device=device)
    return layer, x, dy


def measure_gemm(cfg: Config, args: argparse.Namespace) -> dict:
    """Forward+backward TFLOP/s at the large shape; an error is recorded, not raised."""
    out: dict = {}
    try:
        torch.manual_seed(0)
        m, k, n = args.gemm_shape
        layer, x, dy = _inputs(cfg, m, k, n, args.device)
        step = make_step(cfg, layer, x, dy, backward=True)
        seconds = device_s(step, args.gemm_iters, args.gemm_repeats, args.device)
        out["tflops"] = 3 * 2 * m * n * k / seconds / 1e12
    except Exception as exc:  # a broken contender must not hide the others' figures
        out["error"] = f"{type(exc).__name__}: {exc}"
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return out


def add_ratios(results: list[dict]) -> None:
    """Add each figure's ratio to the torch bf16 baseline of the same run."""
    base = next(r for r in results if r["name"] == BASELINE)
    for r in results:
        for key in ("host_fwd_us", "host_fwd_bwd_us", "tflops"):
            if key in r and key in base:
                ratio_key = key.removesuffix("_us") + "_ratio"
                r[ratio_key] = r[key] / base[key]


def _target(name: str, ratio_key: str) -> tuple[str, float] | None:
    for key, prefix, op, bound in TARGETS:
        if key == ratio_key and name.startswith(prefix):
            return op, bound
    return None


def _cell(r: dict, key: str, ratio_key: str, on_gpu: bool = True) -> str:
    """A figure, its ratio to torch bf16 and its target: with ok / MISS on a GPU, else marked
    as a GPU target (the targets are set for one)."""
    if key not in r or ratio_key not in r:
        return "-"
    value = r[key]
    text = f"{value:.1f}" if value >= 10 else f"{value:.3f}"
    text += f" ({r[ratio_key]:.2f}x"
    target = _target(r["name"], ratio_key)
    if target is None:
        return text + ")"
    op, bound = target
    if not on_gpu:
        return text + f", GPU target {op}{bound})"
    return text + f" {op}{bound} {'ok' if _COMPARE[op](r[ratio_key], bound) else 'MISS'})"


def print_table(results: list[dict], args: argparse.Namespace) -> None:
    """The summary table: figures, ratios to torch bf16, and targets where set (on the CPU
    without a verdict, and a note under the table saying why)."""
    on_gpu = args.device == "cuda"
    hm, hk, hn = args.host_shape
    gm, gk, gn = args.gemm_shape
    cols = (
        f"host fwd us [{hm}x{hk}x{hn}]",
        "host fwd+bwd us",
        f"fwd+bwd TFLOP/s [{gm}x{gk}x{gn}]",
    )
    print(f"\n{'config':<16} {cols[0]:<32} {cols[1]:<32} {cols[2]}")
    for r in results:
        cells = (
            _cell(r, "host_fwd_us", "host_fwd_ratio", on_gpu),
            _cell(r, "host_fwd_bwd_us", "host_fwd_bwd_ratio", on_gpu),
            _cell(r, "tflops", "tflops_ratio", on_gpu),
        )
        print(f"{r['name']:<16} {cells[0]:<32} {cells[1]:<32} {cells[2]}")
        if "error" in r:
            print(f"{'':<16} error: {r['error']}")
    if not on_gpu:
        print(GPU_TARGETS_NOTE)


def environment(args: argparse.Namespace) -> dict:
    """What the figures were measured on."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    dev = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    return {
        "device": dev,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "fp8_available": list(te.is_fp8_available(return_reason=True)),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "quick": args.quick,
        "host_shape": args.host_shape,
        "gemm_shape": args.gemm_shape,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    """Measure every config, print the table last, and write JSON if asked."""
    args = parse_args(argv)
    env = environment(args)
    print(" ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    fp8_ok, reason = te.is_fp8_available(return_reason=True)
    runnable = [cfg for cfg in CONFIGS if fp8_ok or not cfg.make_recipe]
    host = measure_host(runnable, args)
    results = []
    for cfg in CONFIGS:
        if cfg not in runnable:
            results.append({"name": cfg.name, "error": f"FP8 not available: {reason}"})
            continue
        result = {"name": cfg.name, **host[cfg.name]}
        gemm = measure_gemm(cfg, args)
        if "error" in gemm and "error" in result:
            gemm.pop("error")
        result.update(gemm)
        results.append(result)
        print(f"measured {cfg.name}: {result}", flush=True)
    add_ratios(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "results": results}, f, indent=2)
    print_table(results, args)
    return results


if __name__ == "__main__":
    main()
