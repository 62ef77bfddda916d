"""Host time of one te.moe.MoELayer step (forward+backward) at 128 tokens, eager and graphed,
beside one te.Linear step of the same hidden size, with issue 32's target.

    PYTHONPATH=. python benchmarks/moe_layer_host.py [--json out.json] [--rounds 7] [--calls 50]

The layer is the medium training example's MoE MLP (torchte/train/config.py "medium" with
`--experts 8 --top-k 2`, as torchte/train/moe.py builds it): hidden 512, ffn 2048, 8 experts,
top-2 softmax routing, GELU, biases, LayerNorm first. Per recipe (bf16, FP8 delayed, FP8
current): MoELayer eager with host split sizes (the example's default), eager with device split
sizes, graphed (device splits; the layer's forward and backward captured with
te.make_graphed_callables) and graphed with single_grouped_weight (one weight and one bias
parameter per expert GEMM instead of one per expert), that again with its parameter gradients
handed out as the graph's static buffers (clone_param_grads_on_return=False, as the training
example captures its blocks); te.Linear (512 -> 512, 128 tokens) eager, graphed, and graphed
with static gradients. Host ms per step: wall time of steps queued back to back with one
synchronization a round, medians of interleaved rounds, and the kernels of one step (torch
profiler):
benchmarks/host_overhead.py's `measure`. That wall time is the GPU's when the GPU is the slower
side, as for a graphed MoE step (about 170 small kernels); "issue ms" is the host's own: the
time one call takes to return, each call started on an idle GPU (synchronized before, not
after), medians. "vs Linear graphed" divides issue times by te.Linear's graphed step's under the
same recipe (the static-gradient MoE rows by te.Linear's static-gradient one); the target
(graphed MoELayer <= 1.5x graphed te.Linear) gets a PASS / MISS row per recipe and layout,
printed last.
Never asserts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time

import torch
from host_overhead import measure
from timing import fwd_bwd_step

import torchte as te
from torchte import recipe
from torchte.moe import MoELayer

RECIPES = {"bf16": None, "delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling}
TOKENS, HIDDEN, FFN, EXPERTS, TOP_K = 128, 512, 2048, 8, 2
TARGET = 1.5
SINGLE = "MoE graphed single-weight"  # device splits, single_grouped_weight=True
STATIC = "MoE graphed single, static grads"  # and clone_param_grads_on_return=False
LINEAR_STATIC = "Linear graphed, static grads"


def moe_layer(device_splits: bool, single: bool = False) -> MoELayer:
    """The medium training example's MoE MLP (see the module docstring); single: one weight
    and one bias parameter per expert GEMM (single_grouped_weight)."""
    return MoELayer(
        HIDDEN, FFN, EXPERTS, TOP_K, activation="gelu", bias=True, normalization="LayerNorm",
        params_dtype=torch.bfloat16, device="cuda", device_splits=device_splits,
        single_grouped_weight=single,
    )  # fmt: skip


def linear_layer() -> te.Linear:
    return te.Linear(HIDDEN, HIDDEN, params_dtype=torch.bfloat16, device="cuda")


def io() -> tuple[torch.Tensor, torch.Tensor]:
    """(x (TOKENS, HIDDEN) bf16 requiring grad, dy of the same shape)."""
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return x, torch.randn_like(x)


def graphed_step(module: torch.nn.Module, make_recipe, clone: bool = True):
    """fwd+bwd of module graphed by te.make_graphed_callables under the recipe (FP8 baked
    into the graphs; replays run outside te.autocast, as in benchmarks/host_overhead.py);
    clone: clone_param_grads_on_return."""
    x, dy = io()
    fp8 = make_recipe() if make_recipe else None
    graphed = te.make_graphed_callables(
        module, (x,), fp8_enabled=fp8 is not None, fp8_recipe=fp8,
        clone_param_grads_on_return=clone,
    )  # fmt: skip
    return fwd_bwd_step(graphed, x, dy, None)


def static_step(module: torch.nn.Module, make_recipe):
    """graphed_step with the parameter gradients handed out as the graph's static buffers."""
    return graphed_step(module, make_recipe, clone=False)


def eager_step(module: torch.nn.Module, make_recipe):
    x, dy = io()
    return fwd_bwd_step(module, x, dy, make_recipe() if make_recipe else None)


def build_steps() -> tuple[dict, dict]:
    """({config: step}, {config: error}) for every recipe; a config that fails to build (or to
    capture) records its error instead of stopping the run."""
    steps, errors = {}, {}
    torch.manual_seed(0)
    eager = {"MoE eager host-splits": moe_layer(False), "MoE eager device-splits": moe_layer(True),
             "Linear eager": linear_layer()}  # fmt: skip
    for rname, make_recipe in RECIPES.items():
        makers = {name: (eager_step, m) for name, m in eager.items()}
        makers["MoE graphed device-splits"] = (graphed_step, lambda: moe_layer(True))
        makers[SINGLE] = (graphed_step, lambda: moe_layer(True, single=True))
        makers[STATIC] = (static_step, lambda: moe_layer(True, single=True))
        makers["Linear graphed"] = (graphed_step, linear_layer)
        makers[LINEAR_STATIC] = (static_step, linear_layer)
        for name, (make_step, module) in makers.items():
            try:
                module = module() if make_step is not eager_step else module
                step = make_step(module, make_recipe)
                step()  # a step that fails fails here, recorded, not inside the timing
                steps[f"{name} {rname}"] = step
            except Exception as exc:  # a benchmark reports, never stops
                errors[f"{name} {rname}"] = f"{type(exc).__name__}: {exc}"[:160]
    return steps, errors


def issue_ms(steps: dict, calls: int) -> dict:
    """{config: median ms one call of its step takes to return on an idle GPU}."""
    times = {name: [] for name in steps}
    for _ in range(calls):
        for name, step in steps.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            times[name].append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return {name: statistics.median(t) for name, t in times.items()}


def print_table(host: dict, issue: dict, counts: dict, errors: dict) -> list:
    """The per-config table, then the targets' rows (returned: (recipe, ratio, met))."""
    print(f"{'config':36s} {'wall ms':>9s} {'issue ms':>9s} {'vs Linear graphed':>18s} "
          f"{'launches':>9s}")  # fmt: skip
    for rname in RECIPES:
        base = issue.get(f"Linear graphed {rname}")
        for name in ("MoE eager host-splits", "MoE eager device-splits",
                     "MoE graphed device-splits", SINGLE, STATIC, "Linear eager",
                     "Linear graphed", LINEAR_STATIC):  # fmt: skip
            config = f"{name} {rname}"
            if config in errors:
                print(f"{config:36s} {errors[config]}")
                continue
            static_base = issue.get(f"{LINEAR_STATIC} {rname}")
            by = static_base if name in (STATIC, LINEAR_STATIC) else base
            ratio = f"{issue[config] / by:.2f}x" if by else "-"
            count = "-" if counts.get(config) is None else str(counts[config])
            print(f"{config:36s} {host[config] / 1e3:9.3f} {issue[config]:9.3f} {ratio:>18s} "
                  f"{count:>9s}")  # fmt: skip
    rows = []
    print(f"\ntarget (issue 32): MoELayer graphed step's issue time <= {TARGET}x te.Linear's")
    for rname in RECIPES:
        for layout, name, linear in (
            ("per-expert", "MoE graphed device-splits", "Linear graphed"),
            ("single", SINGLE, "Linear graphed"),
            ("static", STATIC, LINEAR_STATIC),
        ):
            moe = issue.get(f"{name} {rname}")
            lin = issue.get(f"{linear} {rname}")
            met = moe is not None and lin is not None and moe / lin <= TARGET
            ratio = f"{moe / lin:.2f}x" if moe and lin else "error"
            rows.append((rname, layout, ratio, met))
            print(f"  {rname:8s} {layout:10s} {ratio:>8s}  {'PASS' if met else 'MISS'}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/moe_layer_host.py needs a CUDA GPU; none is available (nothing run)")
    print(f"device={torch.cuda.get_device_name()} torch={torch.__version__} "
          f"date={datetime.date.today().isoformat()}", flush=True)  # fmt: skip
    steps, errors = build_steps()
    host, counts = measure(steps, args.rounds, args.calls, "cuda")
    issue = issue_ms(steps, args.calls)
    rows = print_table(host, issue, counts, errors)
    if args.json:
        with open(args.json, "w") as f:
            out = {"device": torch.cuda.get_device_name(), "host_us": host, "issue_ms": issue}
            out["launches"] = counts
            json.dump({**out, "errors": errors, "targets": rows}, f, indent=2)


if __name__ == "__main__":
    main()
