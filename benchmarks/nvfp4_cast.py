"""NVFP4 cast kernels (kernels/nvfp4_cast.py, kernels/nvfp4_cols.py): time of each launch beside
a device copy of the input, per spec (rowwise / columnwise / both, the Hadamard transform,
16 x 16 tiles, stochastic rounding), the per-tensor amax passes and the dequantization to bf16
values, each over a sweep of tile configurations; with a byte check of every configuration
against the torch reference run on the same GPU.

    PYTHONPATH=. python benchmarks/nvfp4_cast.py [--rows 8192] [--cols 8192] [--quick]

Bytes moved: x read (2 B an element) and each copy written (0.5 B an element, plus a scale
byte per 16). The last table gives each row's best configuration. Never asserts.
"""

from __future__ import annotations

import argparse
import sys

import torch
from timing import gpu_ms

from torchte.kernels import nvfp4_cast as nv
from torchte.kernels import nvfp4_cols as nc

S = nv.NVFP4Spec
SPECS = {
    "rowwise": S(columnwise=False),
    "rowwise 16x16": S(columnwise=False, two_d=True),
    "columnwise": S(rowwise=False),
    "columnwise rht": S(rowwise=False, rht=True),
    "columnwise rht stochastic": S(rowwise=False, rht=True, stochastic=True),
    "both, rht (activation)": S(rht=True),
    "both, 16x16 (weight)": S(two_d=True),
}
# (module, attribute, configurations) per kernel family.
SWEEPS = {
    "rows": (nv, "CAST_CONFIG", [(32, 64, 4), (16, 128, 4), (32, 128, 4), (64, 128, 8),
                                 (16, 256, 4), (32, 256, 8)]),
    "cols": (nc, "COLS_CONFIG", [(1, 128, 4), (2, 128, 4), (4, 64, 4), (1, 256, 4),
                                 (2, 256, 8), (4, 128, 8), (8, 64, 8)]),
    "amax": (nv, "AMAX_CONFIG", [(64, 64, 4), (32, 256, 4), (64, 256, 8)]),
    "values": (nv, "VALUES_CONFIG", [(32, 128, 4), (16, 256, 4), (32, 256, 8), (64, 128, 8)]),
}  # fmt: skip


def _same(got, want) -> str:
    pairs = [(g, w) for g, w in zip(got, want, strict=True) if w is not None]
    return "OK" if all(torch.equal(g, w) for g, w in pairs) else "MISMATCH"


def _family(label: str) -> str:
    if label.startswith("rowwise"):
        return "rows"
    return "cols" if label.startswith("columnwise") else "both"


def cases(x, rng, quick: bool):
    """Rows (op, config, ms, bytes moved, check) of every case and configuration."""
    n = x.numel()
    for label, spec in SPECS.items():
        family = _family(label)
        amax = nv.compute_amax(x, spec)
        want = nv.quantize_reference(x, amax, spec, rng)
        written = (spec.rowwise + spec.columnwise) * (n // 2 + n // 16)
        configs = [None] if family == "both" or quick else SWEEPS[family][2]
        module, attr = (None, None) if family == "both" else SWEEPS[family][:2]
        for config in configs:
            if config is not None:
                setattr(module, attr, config)
            ms = gpu_ms(lambda s=spec, a=amax: nv.quantize(x, a, s, rng), reps=20, inner=10)
            check = _same(nv.quantize(x, amax, spec, rng), want)
            yield f"quantize {label}", config, ms, 2 * n + written, check
    for rht in (False, True):
        spec = S(rht=rht)
        want = [nv.compute_amax_reference(x, spec)]
        family = "cols" if rht else "amax"
        configs = [None] if quick else SWEEPS[family][2]
        for config in configs:
            if config is not None:
                setattr(SWEEPS[family][0], SWEEPS[family][1], config)
            ms = gpu_ms(lambda s=spec: nv.compute_amax(x, s), reps=20, inner=10)
            check = _same([nv.compute_amax(x, spec)], want)
            yield f"amax{' rht' if rht else ''}", config, ms, 2 * n, check
    spec = SPECS["rowwise"]
    data, scale, _, _ = nv.quantize(x, nv.compute_amax(x, spec), spec)
    want = [nv.dequantize_values_reference(data, scale)]
    for config in [None] if quick else SWEEPS["values"][2]:
        if config is not None:
            nv.VALUES_CONFIG = config
        ms = gpu_ms(lambda: nv.dequantize_values(data, scale), reps=20, inner=10)
        check = _same([nv.dequantize_values(data, scale)], want)
        yield "dequantize_values", config, ms, n // 2 + n // 16 + 2 * n, check


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--cols", type=int, default=8192)
    parser.add_argument("--quick", action="store_true", help="the default configurations only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    defaults = {name: getattr(mod, attr) for name, (mod, attr, _) in SWEEPS.items()}
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.rows, args.cols, device="cuda", generator=gen).to(torch.bfloat16)
    copy = gpu_ms(lambda: x.clone(), reps=20, inner=10)
    copy_rate = 4 * x.numel() / copy
    rng = torch.tensor([7, 0], dtype=torch.int64, device="cuda")
    print(f"NVFP4 kernels, {args.rows} x {args.cols} bf16, {torch.cuda.get_device_name()}; "
          f"copy {copy:.3f} ms; defaults {defaults}")  # fmt: skip
    print(f"  {'op':34s} {'config':14s} {'ms':>8s} {'of copy':>8s}  bytes")
    best: dict[str, tuple] = {}
    for op, config, ms, moved, check in cases(x, rng, args.quick):
        frac = moved / ms / copy_rate
        print(f"  {op:34s} {config!s:14s} {ms:8.3f} {frac:8.2f}  {check}")
        if check == "OK" and (op not in best or ms < best[op][1]):
            best[op] = (config, ms, frac)
        for name, (mod, attr, _) in SWEEPS.items():
            setattr(mod, attr, defaults[name])
    print("best per op:")
    for op, (config, ms, frac) in best.items():
        print(f"  {op:34s} {config!s:14s} {ms:8.3f} {frac:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
