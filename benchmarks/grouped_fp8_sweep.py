"""Tile configurations of the TMA grouped FP8 GEMMs (kernels/grouped_gemm_tma.py) beside the
pointer kernels (kernels/grouped_gemm_fp8.py) and per-expert torch._scaled_mm, at the te.ops
grouped MLP's shapes (grouped_fp8_gemm.py's cases): ms of each, the relative difference of each
configuration's result to the pointer kernel's, and the fastest configuration per GEMM.

    PYTHONPATH=. python benchmarks/grouped_fp8_sweep.py [--tokens 32768] [--experts 8]

Never asserts; a configuration that fails to compile is reported and skipped.
"""

from __future__ import annotations

import sys

import torch
from grouped_fp8_gemm import ALIGN, E4M3, E5M2, columns, fp8, shape_args, uneven_splits
from timing import gpu_ms

from torchte.kernels import grouped_gemm_fp8 as gg
from torchte.kernels import grouped_gemm_tma as tma
from torchte.kernels.grouped_cast import _group_block

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, GROUP_M, TMA store)
ROWS_CONFIGS = (
    (256, 128, 128, 8, 3, 8, True),
    (256, 128, 128, 8, 3, 8, False),
    (256, 128, 128, 8, 3, 4, True),
    (256, 128, 128, 8, 3, 16, True),
    (128, 256, 128, 8, 3, 8, False),
)
REDUCTION_CONFIGS = (
    (128, 256, 128, 8, 3, 8, False),
    (128, 256, 128, 8, 3, 8, True),
    (256, 128, 128, 8, 3, 8, True),
    (256, 128, 128, 8, 3, 8, False),
)


def operands(tokens: int, experts: int, k: int, n: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(k + n)
    sizes = uneven_splits(tokens, experts)
    widths = [-(-m // ALIGN) * ALIGN for m in sizes]
    x, dy = fp8((tokens, k), E4M3, gen), fp8((tokens, n), E5M2, gen)
    w = fp8((experts, n, k), E4M3, gen)
    return {
        "sizes": sizes, "widths": widths, "x": x, "dy": dy, "w": w,
        "w_t": w.float().transpose(1, 2).contiguous().to(E4M3),
        "offs": torch.tensor([0, *sizes], device="cuda").cumsum(0).to(torch.int32),
        "col_offs": torch.tensor([0, *widths], device="cuda").cumsum(0).to(torch.int32),
        "x_cols": columns(x, sizes), "dy_cols": columns(dy, sizes),
        "ones": torch.ones(experts, device="cuda"),
    }  # fmt: skip


def contenders(ops: dict, k: int, n: int):
    """(gemm, {name: fn}) for fprop, dgrad and wgrad; the first entry of each is the loop."""
    x, dy, w, w_t, ones = ops["x"], ops["dy"], ops["w"], ops["w_t"], ops["ones"]
    sizes, widths, offs, col_offs = ops["sizes"], ops["widths"], ops["offs"], ops["col_offs"]
    x_cols, dy_cols = ops["x_cols"], ops["dy_cols"]
    one = torch.ones((), device="cuda")
    bf16, fp32 = torch.bfloat16, torch.float32
    g_block = _group_block(len(sizes))
    starts = [0]
    for width in widths:
        starts.append(starts[-1] + width)

    def loop_rows(a, b, fast=False):
        parts = a.split(sizes)
        return torch.cat([
            torch._scaled_mm(p, b[g].t(), one, one, out_dtype=bf16, use_fast_accum=fast)
            for g, p in enumerate(parts)
        ])  # fmt: skip

    def loop_wgrad():
        return torch.stack([
            torch._scaled_mm(
                dy_cols[n * starts[g] : n * starts[g + 1]].view(n, width),
                x_cols[k * starts[g] : k * starts[g + 1]].view(k, width).t(), one, one,
                out_dtype=fp32,
            )
            for g, width in enumerate(widths)
        ])  # fmt: skip

    for gemm, a, b in (("fprop", x, w), ("dgrad", dy, w_t)):
        fns = {"loop": lambda a=a, b=b: loop_rows(a, b)}
        fns["pointer"] = lambda a=a, b=b: gg.grouped_rows_gemm(a, ones, b, ones, offs, bf16)
        if gemm == "fprop":  # torch's grouped scaled GEMM (e4m3 only on sm90)
            row_scale = torch.ones(a.shape[0], device="cuda")
            col_scale = torch.ones(b.shape[0], b.shape[1], device="cuda")
            fns["torch grouped"] = lambda a=a, b=b, rs=row_scale, cs=col_scale: (
                torch._scaled_grouped_mm(
                    a, b.transpose(1, 2), rs, cs, offs=offs[1:], out_dtype=bf16
                )
            )
        for cfg in ROWS_CONFIGS:
            fns[str(cfg)] = lambda a=a, b=b, cfg=cfg: tma.rows_gemm_tma(
                a, ones, b, ones, offs, bf16, cfg, g_block
            )
        if gemm == "fprop":  # te.Linear's forward accumulates fast: so do both of these
            fns["loop fast"] = lambda a=a, b=b: loop_rows(a, b, True)
            fns[f"{ROWS_CONFIGS[0]} fast"] = lambda a=a, b=b: tma.rows_gemm_tma(
                a, ones, b, ones, offs, bf16, ROWS_CONFIGS[0], g_block, True
            )
        yield gemm, fns
    fns = {"loop": loop_wgrad}
    fns["pointer"] = lambda: gg.grouped_reduction_gemm(
        dy_cols, ones, x_cols, ones, col_offs, n, k, fp32
    )
    for cfg in REDUCTION_CONFIGS:
        fns[str(cfg)] = lambda cfg=cfg: tma.reduction_gemm_tma(
            dy_cols, ones, x_cols, ones, col_offs, n, k, fp32, cfg
        )
    yield "wgrad", fns


def main() -> int:
    args = shape_args(__doc__)
    if args is None:
        return 1
    print(f"{torch.cuda.get_device_name()}; {args.experts} experts, {args.tokens} tokens")
    best_rows = []
    for k, n in ((4096, 2 * 14336), (14336, 4096)):
        ops = operands(args.tokens, args.experts, k, n)
        flop = 2 * args.tokens * k * n
        for gemm, fns in contenders(ops, k, n):
            want = fns["pointer"]().float()
            scale = want.abs().max().clamp_min(1e-30)
            times = {}
            for name, fn in fns.items():
                try:
                    diff = ((fn().float() - want).abs().max() / scale).item()
                    times[name] = gpu_ms(fn, reps=5, inner=5)
                except Exception as error:  # a configuration that fails is reported
                    print(f"  {gemm} {k}->{n} {name}: failed: {type(error).__name__}"[:200])
                    print(f"    {error}"[:400])
                    continue
                print(f"  {gemm:5s} {k:5d}->{n:5d} {name:34s} {times[name]:8.3f} ms "
                      f"{flop / times[name] / 1e9:6.0f} TFLOP/s  diff {diff:.1e}")  # fmt: skip
            tma_times = {c: t for c, t in times.items() if c.startswith("(") and "fast" not in c}
            if tma_times and "loop" in times:
                best = min(tma_times, key=tma_times.get)
                best_rows.append((f"{gemm} {k}->{n}", best, tma_times[best], times["loop"],
                                  times.get("pointer")))  # fmt: skip
            fast = [c for c in times if c.endswith("fast") and c.startswith("(")]
            if fast and "loop fast" in times:
                best_rows.append((f"{gemm} {k}->{n}", fast[0], times[fast[0]],
                                  times["loop fast"], None))  # fmt: skip
        del ops
        torch.cuda.empty_cache()
    print(f"\n{'gemm':18s} {'best tma config':34s} {'tma ms':>7s} {'loop ms':>8s} "
          f"{'tma/loop':>8s} {'pointer/loop':>12s}")  # fmt: skip
    for gemm, cfg, t, loop, pointer in best_rows:
        ratio = f"{pointer / loop:12.2f}" if pointer else f"{'-':>12s}"
        print(f"{gemm:18s} {cfg:34s} {t:7.3f} {loop:8.3f} {t / loop:8.2f} {ratio}")
    print("target: grouped time <= 1.05x the per-expert loop's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
