"""Tile configurations of the TMA grouped FP8 GEMMs (kernels/grouped_gemm_tma.py) beside the
pointer kernels (kernels/grouped_gemm_fp8.py) and per-expert torch._scaled_mm, at the te.ops
grouped MLP's shapes (grouped_fp8_gemm.py's cases): ms of each, the relative difference of each
configuration's result to the pointer kernel's, and the fastest configuration per GEMM.

    PYTHONPATH=. python benchmarks/grouped_fp8_sweep.py [--tokens 32768] [--experts 8]
    PYTHONPATH=. python benchmarks/grouped_fp8_sweep.py --tokens 16384 --shapes 512x2048,2048x512

Never asserts; a configuration that fails to compile is reported and skipped.
"""

from __future__ import annotations

import sys

import torch
from grouped_fp8_gemm import operands, per_expert_loops, shape_args
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
    (128, 128, 128, 8, 4, 8, True),
    (128, 128, 128, 4, 4, 8, True),
    (128, 256, 128, 8, 3, 8, True),
)
REDUCTION_CONFIGS = (
    (128, 256, 128, 8, 3, 8, False),
    (128, 256, 128, 8, 3, 8, True),
    (256, 128, 128, 8, 3, 8, True),
    (256, 128, 128, 8, 3, 8, False),
    (128, 128, 128, 8, 4, 8, False),
    (128, 128, 128, 4, 4, 8, False),
    (128, 128, 64, 4, 6, 8, False),
)


def contenders(ops: dict, k: int, n: int):
    """(gemm, {name: fn}) for fprop, dgrad and wgrad: the per-expert loop, the pointer kernels
    (grouped_gemm_fp8's _rows_gemm / _reduction_gemm, called directly: at these sizes the
    launchers choose the TMA kernels) and each TMA configuration."""
    x, dy, w, w_t, ones = ops["x"], ops["dy"], ops["w"], ops["w_t"], ops["ones"]
    sizes, offs, col_offs = ops["sizes"], ops["offs"], ops["col_offs"]
    x_cols, dy_cols = ops["x_cols"], ops["dy_cols"]
    loop_rows, loop_wgrad = per_expert_loops(ops, k, n)
    bf16, fp32 = torch.bfloat16, torch.float32
    g_block = _group_block(len(sizes))
    pointer_config = gg.ROWS_CONFIG_SMALL if x.shape[0] <= gg.SMALL_ROWS else gg.ROWS_CONFIG
    for gemm, a, b in (("fprop", x, w), ("dgrad", dy, w_t)):
        fns = {"loop": lambda a=a, b=b: loop_rows(a, b, bf16)}
        fns["pointer"] = lambda a=a, b=b: gg._rows_gemm(
            a, ones, b, ones, offs, bf16, pointer_config
        )
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
            fns["loop fast"] = lambda a=a, b=b: loop_rows(a, b, bf16, True)
            fns[f"{ROWS_CONFIGS[0]} fast"] = lambda a=a, b=b: tma.rows_gemm_tma(
                a, ones, b, ones, offs, bf16, ROWS_CONFIGS[0], g_block, True
            )
        yield gemm, fns
    fns = {"loop": loop_wgrad}
    fns["pointer"] = lambda: gg._reduction_gemm(
        dy_cols, ones, x_cols, ones, col_offs, n, k, fp32, gg.REDUCTION_CONFIG
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
    for k, n in args.shapes:
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
