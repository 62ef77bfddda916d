"""Tiles of the grouped FP8 cast and amax kernels (kernels/grouped_cast.py) at the large
training example's MoE shapes, with the bytes each moves as a fraction of a device copy.

    PYTHONPATH=. python benchmarks/moe_cast_sweep.py [--quick]   # on a CUDA GPU

Shape: 16 x 1024 tokens routed top-2 to 8 experts, padded (32888 rows, uneven split sizes on
the device), hidden 2048 bf16: the experts' first GEMM's input (gathered from the 16384 tokens
when --gather's rows are given, as MoELayer's fused permutation does) and the second GEMM's
output gradient. E4M3 rowwise + columnwise; current scaling (the amax pass, then the cast)
and delayed. Ideal bytes: the cast reads x once and writes two FP8 copies; the amax pass
reads x once. CUDA-event medians per (BLOCK_M, BLOCK_N, num_warps); never asserts.
"""

from __future__ import annotations

import sys

import torch
from timing import copy_gbps, gpu_ms

from torchte.kernels import grouped_cast as gc
from torchte.kernels.cast_spec import CastSpec

TOKENS, HIDDEN, GROUPS, TOP_K = 16384, 2048, 8, 2
CAST_TILES = [(32, 128, 4), (64, 128, 4), (32, 256, 4), (64, 256, 8), (128, 128, 8), (16, 256, 4)]
AMAX_TILES = [(64, 256, 8), (128, 256, 8), (256, 256, 8), (64, 512, 8), (128, 512, 16)]
AMAX_TILES += [(32, 1024, 8)]
QUICK = 3  # tiles of each list with --quick
CAST = gc._grouped_cast_transpose


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("moe_cast_sweep.py needs a CUDA GPU")
    quick = "--quick" in sys.argv
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = torch.tensor([9, 7, 6, 5, 3, 2, 0, 0.5])
    sizes = (weights / weights.sum() * TOKENS * TOP_K).long()
    sizes[-1] += TOKENS * TOP_K - sizes.sum()
    sizes = (sizes + 15) // 16 * 16
    rows = int(sizes.sum())
    row_off, col_off = gc.device_grouped_offsets(sizes.cuda())
    x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
    tokens = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
    src = torch.randint(0, TOKENS, (rows,), device="cuda", dtype=torch.int32, generator=gen)
    copy = copy_gbps()
    cast_bytes, amax_bytes = x.nbytes + 2 * x.numel(), x.nbytes
    scale = torch.full((GROUPS,), 0.5, device="cuda")
    results = []

    def report(what, tile, ms, nbytes):
        frac = nbytes / ms / 1e6 / copy
        results.append((what, tile, ms, frac))
        print(f"{what:24s} {tile!s:16s} {ms:7.3f} ms {frac:5.2f} of copy")

    for gather in (False, True):
        inp, rows_src = (tokens, src) if gather else (x, None)
        tag = " gather" if gather else ""
        for tile in CAST_TILES[:QUICK] if quick else CAST_TILES:
            for current in (False, True):
                spec = CastSpec(torch.float8_e4m3fn, True, True, None if current else scale,
                                torch.zeros(GROUPS, device="cuda"))  # fmt: skip
                amax = torch.ones(GROUPS, device="cuda") if current else None
                ms = gpu_ms(lambda s=spec, a=amax, t=tile, i=inp, r=rows_src: CAST(
                    i, None, row_off, col_off, s, a, t, src=r))  # fmt: skip
                report(f"cast {'current' if current else 'delayed'}{tag}", tile, ms, cast_bytes)
        for tile in AMAX_TILES[:QUICK] if quick else AMAX_TILES:
            amax = torch.zeros(GROUPS, device="cuda")
            ms = gpu_ms(lambda t=tile, i=inp, r=rows_src, a=amax: gc._grouped_amax(
                i, None, row_off, a, t, src=r))  # fmt: skip
            report(f"amax{tag}", tile, ms, amax_bytes)
    print(f"\ncopy {copy:.0f} GB/s; {rows} x {HIDDEN} rows; best per kernel (default first):")
    for what in dict.fromkeys(r[0] for r in results):
        mine = [r for r in results if r[0] == what]
        best = min(mine, key=lambda r: r[2])
        print(f"  {what:24s} default {mine[0][2]:.3f} ms ({mine[0][3]:.2f}), best {best[1]} "
              f"{best[2]:.3f} ms ({best[3]:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
