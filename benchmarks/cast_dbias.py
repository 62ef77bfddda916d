"""An output gradient's FP8 cast with its bias gradient (kernels/cast_dbias) against the pair it
replaces (cast_transpose.quantize, then dy.sum(0)), at the GPT block's gradient shapes.

    PYTHONPATH=. python benchmarks/cast_dbias.py [--json out.json] [--sweep]

Per shape (16K tokens: the proj / fc2 output gradient (16384, 2048) and the qkv one (16384,
6144); 16 tokens x 1024, host-bound) and scaling (delayed, current): GPU milliseconds of the
fused call and of the pair (CUDA events, medians), the fused call's bandwidth (dy read once,
both FP8 copies written) as a fraction of a device copy's, and host microseconds per call at
the small shape. --sweep also times the kernel's tile and programs per SM. Checks that both
give the same bytes and scale_inv before timing. Never asserts.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from timing import copy_gbps, gpu_ms, host_us

from torchte.kernels import cast_dbias as cd
from torchte.kernels import cast_transpose as ct
from torchte.kernels._triton import sm_count
from torchte.kernels.cast_spec import CastSpec

SHAPES = [(16384, 2048), (16384, 6144), (16, 1024)]
FP8 = torch.float8_e5m2
SWEEP = [(32, 128, 4, 1), (32, 128, 4, 2), (64, 64, 4, 1), (64, 128, 8, 1), (16, 128, 4, 2)]


def spec_of(scaling: str) -> CastSpec:
    if scaling == "delayed":
        scale = torch.tensor([64.0], device="cuda")
        return CastSpec(FP8, True, True, scale, torch.zeros(1, device="cuda"))
    return CastSpec(FP8, True, True)


def same_result(dy: torch.Tensor, scaling: str) -> bool:
    data, data_t, scale_inv, _ = cd.quantize_dbias(dy, spec_of(scaling))
    want = ct.quantize(dy, spec_of(scaling))
    pairs = zip((data, data_t), want[:2], strict=True)
    same_bytes = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in pairs)
    return same_bytes and torch.equal(scale_inv, want[2])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    p.add_argument("--sweep", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/cast_dbias.py needs a CUDA GPU")
        return 0
    copy = copy_gbps()
    rows_out = []
    for rows, cols in SHAPES:
        dy = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
        moved = rows * cols * 4  # bf16 read, two FP8 copies written
        for scaling in ("delayed", "current"):
            spec = spec_of(scaling)
            row = {"shape": [rows, cols], "scaling": scaling, "same": same_result(dy, scaling)}

            def fused(dy=dy, spec=spec):
                return cd.quantize_dbias(dy, spec)

            def pair(dy=dy, spec=spec):
                return ct.quantize(dy, spec), dy.sum(0)

            row["fused ms"], row["pair ms"] = gpu_ms(fused, inner=20), gpu_ms(pair, inner=20)
            row["of copy"] = moved / row["fused ms"] / 1e6 / copy
            if rows * cols <= 1 << 16:
                row["fused host us"], row["pair host us"] = host_us(fused), host_us(pair)
            if args.sweep and rows * cols > 1 << 16:
                sms = sm_count(torch.cuda.current_device())
                for bm, bn, warps, per_sm in SWEEP:
                    ms = gpu_ms(
                        lambda dy=dy, spec=spec, c=(bm, bn, warps), s=sms * per_sm:
                        cd._cast_dbias_triton(dy, spec, c, s), inner=20,
                    )  # fmt: skip
                    row[f"tile {bm}x{bn}/{warps}w x{per_sm}"] = ms
            rows_out.append(row)
    print(f"device {torch.cuda.get_device_name()}  copy {copy:.0f} GB/s")
    for row in rows_out:
        shape = "x".join(map(str, row["shape"]))
        line = f"{shape:>11s} {row['scaling']:8s} same={row['same']!s:5s} "
        line += f"fused {row['fused ms']:.4f} ms  pair {row['pair ms']:.4f} ms  "
        line += f"of copy {row['of copy']:.2f}"
        if "fused host us" in row:
            line += f"  host {row['fused host us']:.1f} us vs {row['pair host us']:.1f} us"
        print(line)
        for key, value in row.items():
            if key.startswith("tile"):
                print(f"    {key:22s} {value:.4f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows_out}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
