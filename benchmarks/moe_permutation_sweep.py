"""The MoE permutation kernels' launch shapes against their bandwidth: which TUNING values
(torchte/kernels/permutation.py) and which one-launch map threshold
(torchte/kernels/permutation_maps.py) reach the highest fraction of a device copy.

    PYTHONPATH=. python benchmarks/moe_permutation_sweep.py [--json out.json] [--quick]
        [--tokens 32768 ...]

Each variant changes one setting from the defaults and runs benchmarks/moe_routing.py's
permutation rows (hidden 4096 bf16; 32768 and 4096 tokens, E64 k8 and E8 k2; the same bytes
and copy baseline); the table gives, per variant and op, the lowest fraction over the shapes
(issue 32's target: >= 0.8), and the variant's lowest over all ops. Never asserts.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from moe_routing import BANDWIDTH_TARGET, permutation_rows

from torchte.kernels import permutation as kp
from torchte.kernels import permutation_maps as km

# (name, settings): TUNING fields, and "one_launch_max" for the map's threshold.
VARIANTS: list[tuple[str, dict]] = [
    ("defaults", {}),
    ("permute block_h 1024", {"permute_block_h": 1024}),
    ("permute block_h 4096", {"permute_block_h": 4096}),
    ("permute 2-D grid (1024 a program)", {"permute_block_h": 1024, "permute_span_blocks": 1}),
    ("permute block_r 4", {"permute_block_r": 4}),
    ("unpermute block_r 2", {"unpermute_block_r": 2}),
    ("unpermute block_r 8", {"unpermute_block_r": 8}),
    ("unpermute block_h 2048", {"unpermute_block_h": 2048}),
    ("bwd block_r 2", {"bwd_block_r": 2}),
    ("bwd block_r 8", {"bwd_block_r": 8}),
    ("8 warps", {"num_warps": 8}),
    ("mask map: three launches always", {"one_launch_max": 0}),
    ("mask map: one launch to 256K", {"one_launch_max": 262144}),
]


def run_variant(settings: dict, shapes: list[tuple[int, int, int]]) -> list[dict]:
    """The permutation rows of every shape under settings (restored afterwards)."""
    saved = {name: getattr(kp.TUNING, name) for name in settings if name != "one_launch_max"}
    saved_max = km.ONE_LAUNCH_MAX
    try:
        for name, value in settings.items():
            if name == "one_launch_max":
                km.ONE_LAUNCH_MAX = value
            else:
                setattr(kp.TUNING, name, value)
        rows = []
        for tokens, experts, topk in shapes:
            rows += permutation_rows(tokens, experts, topk)
        return rows
    finally:
        km.ONE_LAUNCH_MAX = saved_max
        for name, value in saved.items():
            setattr(kp.TUNING, name, value)


def worst_by_op(rows: list[dict]) -> dict[str, float]:
    """The lowest fraction of copy per 'op phase' over the shapes (0 for an error)."""
    worst: dict[str, float] = {}
    for row in rows:
        key = f"{row['name']} {row['impl']}"
        worst[key] = min(worst.get(key, 1e9), row.get("frac", 0.0))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="4096 tokens only")
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="token counts")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/moe_permutation_sweep.py needs a CUDA GPU (nothing run)")
    torch.manual_seed(0)
    print(f"device={torch.cuda.get_device_name()} torch={torch.__version__}", flush=True)
    tokens = args.tokens or ((4096,) if args.quick else (32768, 4096))
    shapes = [(t, e, k) for t in tokens for e, k in ((64, 8), (8, 2))]
    results = {}
    for name, settings in VARIANTS:
        results[name] = worst_by_op(run_variant(settings, shapes))
        cells = ", ".join(f"{op} {v:.3f}" for op, v in results[name].items())
        print(f"  {name}: lowest {min(results[name].values()):.3f} ({cells})", flush=True)
    ops = list(results["defaults"])
    print(f"\nlowest fraction of copy over {len(shapes)} shapes (target >= {BANDWIDTH_TARGET})")
    print(f"  {'variant':34s}" + "".join(f" {op[:14]:>14s}" for op in ops) + f" {'min':>6s}")
    for name, worst in results.items():
        cells = "".join(f" {worst.get(op, 0.0):14.3f}" for op in ops)
        print(f"  {name:34s}{cells} {min(worst.values()):6.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
