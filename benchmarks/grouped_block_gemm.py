"""Grouped block-scaled FP8 GEMMs (1x128 and 128x128 scales, DeepSeek-V3's recipe) against bf16
torch._grouped_mm on the same shapes: TFLOP/s of each kernel.

    PYTHONPATH=. python benchmarks/grouped_block_gemm.py [--json out.json] [--sweep]
        [--tokens 32768 --groups 8 --k 4096 --n 4096 --splits uneven|even|ragged]

For each GEMM of a mixture-of-experts linear layer, fprop (y_g = x_g W_g^T), dgrad (dx_g =
dy_g W_g) and wgrad (dW_g = dy_g^T x_g, written in bf16, and added to an fp32 main_grad): the
block-scaled kernels (kernels/grouped_gemm_block.py), the per-tensor grouped FP8 kernels
(kernels/grouped_gemm_fp8.py) and torch._grouped_mm in bf16 (gemm.grouped_fprop / dgrad /
wgrad; for main_grad, its wgrad then an add), e4m3 operands, bf16 outputs; median of CUDA-event
timings; and the three GEMMs together (a layer's forward + backward). Splits: "uneven" (a heavy
expert, light ones, one empty; multiples of 16, as FP8 MoE layers pad them), "even", "ragged"
(uneven, then 7 tokens moved so no group after the first starts on a 16-token boundary: the
byte-load path of the block wgrad). --sweep times every (BLOCK_M, BLOCK_N, num_warps,
num_stages) of SWEEP for each block kernel, printed before the table. Never asserts.
"""

from __future__ import annotations

import argparse
import sys

import torch
from timing import fmt, gpu_ms, write_kernel_json

from torchte import gemm
from torchte._sizes import round_up
from torchte.kernels import grouped_gemm_block as gb
from torchte.kernels import grouped_gemm_fp8 as gg
from torchte.kernels.block_layout import block_offsets, max_blocks

FP8 = torch.float8_e4m3fn
WEIGHTS = [0.30, 0.20, 0.15, 0.12, 0.10, 0.08, 0.05, 0.0]  # benchmarks/grouped_linear.py's
SWEEP = [
    (128, 128, 8, 4),
    (128, 128, 8, 3),
    (128, 128, 8, 5),
    (128, 128, 4, 4),
    (64, 128, 4, 4),
    (64, 128, 4, 5),
    (128, 64, 4, 4),
    (128, 256, 8, 3),
    (128, 256, 8, 4),
    (64, 256, 4, 3),
    (64, 256, 8, 4),
    (256, 128, 8, 3),
]
IMPLS = ("block fp8", "per-tensor fp8", "bf16 _grouped_mm")


def make_splits(tokens: int, groups: int, kind: str) -> list[int]:
    """Group sizes summing to tokens (see the module docstring for the kinds)."""
    if kind == "even":
        sizes = [tokens // groups] * groups
    else:
        weights = WEIGHTS if groups == len(WEIGHTS) else [1 / groups] * groups
        sizes = [int(tokens * w) // 16 * 16 for w in weights]
    sizes[0] += tokens - sum(sizes)
    if kind == "ragged" and groups > 1:
        sizes[0], sizes[1] = sizes[0] - 7, sizes[1] + 7
    return sizes


def fp8_random(*shape) -> torch.Tensor:
    return (torch.randn(shape, device="cuda") * 16).to(FP8)


def scales(*shape) -> torch.Tensor:
    return (torch.rand(shape, device="cuda") + 0.5) / 256


def operands(tokens: int, k: int, n: int, splits: list[int]) -> dict:
    """Every operand of the three GEMMs, in each implementation's layout."""
    groups = len(splits)
    row_offsets = torch.tensor([0, *splits], device="cuda").cumsum(0).to(torch.int32)
    kb, nb, blocks = -(-k // 128), -(-n // 128), max_blocks(tokens, groups)
    padded = [round_up(m, 16) for m in splits]  # the per-tensor columnwise layout
    col_offsets = torch.tensor([0, *padded], device="cuda").cumsum(0).to(torch.int32)
    ones = torch.ones(groups, device="cuda")
    return {
        "row_offsets": row_offsets,
        "block_offsets": block_offsets(row_offsets),
        "col_offsets": col_offsets,
        "x": fp8_random(tokens, k),
        "x_scale": scales(kb, tokens),
        "x_cols": fp8_random(k, tokens),
        "x_cols_scale": scales(blocks, k),
        "x_flat": fp8_random(k * sum(padded)),
        "dy": fp8_random(tokens, n),
        "dy_scale": scales(nb, tokens),
        "dy_cols": fp8_random(n, tokens),
        "dy_cols_scale": scales(blocks, n),
        "dy_flat": fp8_random(n * sum(padded)),
        "w": fp8_random(groups, n, k),
        "w_scale": scales(groups, nb, round_up(kb, 4)),
        "w_t": fp8_random(groups, k, n),
        "w_t_scale": scales(groups, kb, round_up(nb, 4)),
        "scale_inv": ones,
        "x_bf16": torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16),
        "dy_bf16": torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16),
        "w_bf16": torch.randn(groups, n, k, device="cuda", dtype=torch.bfloat16),
        "main_grad": torch.zeros(groups, n, k, device="cuda"),
    }


def kernels(o: dict, k: int, n: int) -> dict[str, dict]:
    """GEMM name -> {implementation: call}."""
    bf16, offs, ro, si = torch.bfloat16, o["row_offsets"][1:], o["row_offsets"], o["scale_inv"]
    wgrad_args = (o["dy_cols"], o["dy_cols_scale"], o["x_cols"], o["x_cols_scale"], ro)
    wgrad_args += (o["block_offsets"],)
    flat_args = (o["dy_flat"], si, o["x_flat"], si, o["col_offsets"], n, k)
    return {
        "fprop": {
            IMPLS[0]: lambda: gb.grouped_block_rows_gemm(
                o["x"], o["x_scale"], o["w"], o["w_scale"], ro, bf16
            ),
            IMPLS[1]: lambda: gg.grouped_rows_gemm(o["x"], si, o["w"], si, ro, bf16),
            IMPLS[2]: lambda: gemm.grouped_fprop(o["x_bf16"], o["w_bf16"], offs),
        },
        "dgrad": {
            IMPLS[0]: lambda: gb.grouped_block_rows_gemm(
                o["dy"], o["dy_scale"], o["w_t"], o["w_t_scale"], ro, bf16
            ),
            IMPLS[1]: lambda: gg.grouped_rows_gemm(o["dy"], si, o["w_t"], si, ro, bf16),
            IMPLS[2]: lambda: gemm.grouped_dgrad(o["dy_bf16"], o["w_bf16"], offs),
        },
        "wgrad": {
            IMPLS[0]: lambda: gb.grouped_block_reduction_gemm(*wgrad_args, bf16),
            IMPLS[1]: lambda: gg.grouped_reduction_gemm(*flat_args, bf16),
            IMPLS[2]: lambda: gemm.grouped_wgrad(o["dy_bf16"], o["x_bf16"], offs),
        },
        "wgrad += main_grad": {
            IMPLS[0]: lambda: gb.grouped_block_reduction_gemm(
                *wgrad_args, torch.float32, o["main_grad"], True
            ),
            IMPLS[2]: lambda: o["main_grad"].add_(
                gemm.grouped_wgrad(o["dy_bf16"], o["x_bf16"], offs)
            ),
        },
    }


def timed(fn, flops: float) -> dict:
    """{"ms", "TFLOP/s"} of fn, or {"error"}."""
    try:
        ms = gpu_ms(fn)
    except Exception as exc:  # a benchmark reports, never stops
        return {"error": repr(exc)[:200]}
    return {"ms": ms, "TFLOP/s": flops / ms / 1e9}


def sweep(o: dict, k: int, n: int, flops: float) -> list[dict]:
    """Times of every SWEEP config of each block kernel."""
    bf16, ro = torch.bfloat16, o["row_offsets"]
    wgrad_args = (o["dy_cols"], o["dy_cols_scale"], o["x_cols"], o["x_cols_scale"], ro)
    wgrad_args += (o["block_offsets"],)
    out = torch.empty(len(ro) - 1, n, k, dtype=bf16, device="cuda")
    calls = {
        "fprop": lambda c: gb._rows_gemm(o["x"], o["x_scale"], o["w"], o["w_scale"], ro, bf16, c),
        "dgrad": lambda c: gb._rows_gemm(
            o["dy"], o["dy_scale"], o["w_t"], o["w_t_scale"], ro, bf16, c
        ),
        "wgrad": lambda c: gb._reduction_gemm(*wgrad_args, out, False, c),
    }
    rows = []
    for name, call in calls.items():
        for config in SWEEP:
            row = timed(lambda call=call, c=config: call(c), flops)
            rows.append({"gemm": name, "config": config, **row})
    return rows


def print_table(results: dict, title: str) -> None:
    print(title)
    head = "".join(f"{impl:>22s}" for impl in IMPLS)
    print(f"  {'GEMM':20s}{head}{'block / bf16':>13s}")
    for name, row in results.items():
        cells = ""
        for impl in IMPLS:
            r = row.get(impl, {})
            cells += (
                f"{r['TFLOP/s']:13.0f} TFLOP/s "
                if "ms" in r
                else f"{'error' if 'error' in r else '-':>22s}"
            )
        block, bf16 = (row.get(impl, {}).get("TFLOP/s") for impl in (IMPLS[0], IMPLS[2]))
        print(f"  {name:20s}{cells}{fmt(block / bf16 if block and bf16 else None, '13.2f')}")
    for name, row in results.items():
        for impl, r in row.items():
            if "error" in r:
                print(f"  {name} {impl}: {r['error']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--sweep", action="store_true", help="time every SWEEP tile config")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--k", type=int, default=4096, help="in_features")
    parser.add_argument("--n", type=int, default=4096, help="out_features")
    parser.add_argument("--splits", choices=("uneven", "even", "ragged"), default="uneven")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/grouped_block_gemm.py needs a CUDA GPU")
    tokens, k, n = args.tokens, args.k, args.n
    splits = make_splits(tokens, args.groups, args.splits)
    o = operands(tokens, k, n, splits)
    flops = 2.0 * tokens * k * n
    swept = sweep(o, k, n, flops) if args.sweep else []
    if swept:
        print(f"sweep (BLOCK_M, BLOCK_N, num_warps, num_stages), TFLOP/s at {tokens} tokens:")
        for row in swept:
            value = row.get("error") or f"{row['TFLOP/s']:7.0f}"
            print(f"  {row['gemm']:6s} {row['config']!s:20s} {value}")
    results = {name: {impl: timed(fn, flops) for impl, fn in calls.items()}
               for name, calls in kernels(o, k, n).items()}  # fmt: skip
    # A layer's forward and backward: the three GEMMs, 3x the FLOPs in the sum of their times.
    layer = {}
    for impl in IMPLS:
        times = [results[g][impl].get("ms") for g in ("fprop", "dgrad", "wgrad")]
        if None not in times:
            layer[impl] = {"ms": sum(times), "TFLOP/s": 3 * flops / sum(times) / 1e9}
    results["fprop+dgrad+wgrad"] = layer
    title = f"\n{args.groups} groups, {tokens} tokens ({args.splits}: {splits}), {k} -> {n}, "
    print_table(results, title + f"e4m3 operands, on {torch.cuda.get_device_name()}")
    print("target: block fp8 fprop+dgrad+wgrad >= 1.35x bf16 torch._grouped_mm")
    if args.json:
        configs = {"rows": gb.ROWS_CONFIG, "rows_small": gb.ROWS_CONFIG_SMALL}
        configs["reduction"] = gb.REDUCTION_CONFIG
        write_kernel_json(
            args.json, tokens, k, n=n, groups=args.groups, splits=splits, results=results,
            sweep=swept, configs=configs,
        )  # fmt: skip


if __name__ == "__main__":
    main()
