"""Tiles of the fused scaled activation + grouped FP8 cast (kernels/grouped_activation_fp8.py),
forward and backward, at the large training example's MoE shape, with the bytes each moves as
a fraction of a device copy's bandwidth.

    PYTHONPATH=. python benchmarks/scaled_act_sweep.py [--quick]   # on a CUDA GPU
    PYTHONPATH=. python benchmarks/scaled_act_sweep.py --gelu   # the example's experts

Shape: 16 x 1024 tokens routed top-2 to 8 experts (32768 rows, uneven split sizes on the
device, as the example's graphed blocks give them), SwiGLU, h (rows, 2 x 8192) bf16, s fp32,
E4M3 rowwise and columnwise outputs (--gelu: GELU, h (rows, 8192), and the backward also
sums the bias gradients, as the training example's experts have biases); FP8 current scaling
(an amax pass, then the cast) and delayed. Ideal bytes: forward reads h (twice under current)
and writes the rowwise and columnwise FP8; backward reads dy and h (twice under current) and
writes dh's two FP8 copies. Each (BLOCK_M, BLOCK_N, num_warps) is timed with CUDA events
(medians); the fastest per pass and scaling is printed last. Never asserts.
"""

from __future__ import annotations

import sys

import torch
from timing import copy_gbps, gpu_ms

from torchte.kernels import grouped_activation_fp8 as gaf
from torchte.kernels.cast_spec import CastSpec
from torchte.kernels.grouped_cast import device_grouped_offsets

ROWS, N, GROUPS = 32768, 8192, 8
CONFIGS = [
    (32, 128, 4),
    (32, 256, 4),
    (32, 256, 8),
    (64, 128, 4),
    (64, 128, 8),
    (64, 256, 8),
    (128, 128, 8),
    (128, 64, 4),
    (16, 256, 4),
    (16, 512, 8),
]


def spec(scaling: str) -> CastSpec:
    amax = torch.zeros(GROUPS, device="cuda")
    if scaling == "delayed":
        scale = torch.full((GROUPS,), 0.5, device="cuda")
        return CastSpec(torch.float8_e4m3fn, True, True, scale, amax)
    return CastSpec(torch.float8_e4m3fn, True, True, None, amax)


QUICK = [(32, 128, 4), (64, 128, 4), (32, 128, 8), (64, 128, 8), (16, 256, 4)]


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("scaled_act_sweep.py needs a CUDA GPU")
    configs = QUICK if "--quick" in sys.argv else CONFIGS
    if "--gelu" in sys.argv:
        act, width, need = "gelu", N, (True, True)
    else:
        act, width, need = "swiglu", 2 * N, (True, False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = torch.tensor([9, 7, 6, 5, 3, 2, 0, 0.5])
    sizes = (weights / weights.sum() * ROWS).long()
    sizes[-1] += ROWS - sizes.sum()
    rows_off, cols_off = device_grouped_offsets(sizes.cuda())
    h = torch.randn(ROWS, width, device="cuda", dtype=torch.bfloat16, generator=gen)
    dy = torch.randn(ROWS, N, device="cuda", dtype=torch.bfloat16, generator=gen)
    s = torch.rand(ROWS, device="cuda", generator=gen)
    copy = copy_gbps()
    fp8_out = 2 * ROWS * N
    results = []
    for scaling in ("current", "delayed"):
        reads = 2 if scaling == "current" else 1
        ideal = {"forward": reads * h.nbytes + fp8_out, "backward": reads * (h.nbytes + dy.nbytes)
                 + 2 * fp8_out}  # fmt: skip
        for config in configs:
            gaf.SCALED_ACT_CONFIG = config
            gaf.SCALED_ACT_GRAD_CONFIG = {"delayed": config, "current": config}
            calls = {
                "forward": lambda sc=scaling: gaf.scaled_activation_grouped_fp8(
                    h, s, act, 0.0, 0.0, None, rows_off, cols_off, spec(sc)
                ),
                "backward": lambda sc=scaling: gaf.scaled_activation_backward_grouped_fp8(
                    dy, h, s, act, 0.0, 0.0, None, rows_off, cols_off, spec(sc), need,
                ),
            }  # fmt: skip
            for name, fn in calls.items():
                try:
                    ms = gpu_ms(fn, reps=10)
                except Exception as exc:  # a benchmark reports, never stops
                    print(f"{scaling:8s} {name:8s} {config}: {type(exc).__name__}: {exc}"[:200])
                    continue
                frac = ideal[name] / ms / 1e6 / copy
                results.append((scaling, name, config, ms, frac))
                print(f"{scaling:8s} {name:8s} {config!s:16s} {ms:8.3f} ms {frac:6.2f} of copy")
    print(f"\n{act}; copy {copy:.0f} GB/s; best per pass (default: the first config):")
    for scaling in ("current", "delayed"):
        for name in ("forward", "backward"):
            rows = [r for r in results if r[:2] == (scaling, name)]
            if rows:
                best = min(rows, key=lambda r: r[3])
                base = next((r for r in rows if r[2] == configs[0]), best)
                print(f"  {scaling:8s} {name:8s} best {best[2]} {best[3]:.3f} ms ({best[4]:.2f} "
                      f"of copy), default {base[3]:.3f} ms ({base[4]:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
