"""The grouped FP8 GEMMs with split sizes on the device (kernels/grouped_gemm_fp8.py: one launch
each for fprop, dgrad and wgrad) beside the same work as per-expert torch._scaled_mm calls
(cuBLAS, per-tensor scales, the sizes on the host), at the te.ops grouped MLP's shapes (8
experts, 32768 tokens split unevenly in multiples of 16, 4096 -> 2 x 14336 and 14336 -> 4096).

    PYTHONPATH=. python benchmarks/grouped_fp8_gemm.py [--tokens 32768] [--experts 8]

x and the weights E4M3, the output gradient E5M2 (HYBRID), bf16 outputs (fp32 for wgrad, as
into main_grad). Per GEMM: ms of the grouped launch and of the per-expert loop (CUDA events,
10 calls back to back, medians), their ratio (the target: the grouped launch takes <= 1.05x
the loop's time), TFLOP/s, and the largest difference between the two results relative to
the largest value (the same products, summed in another order). Never asserts.
"""

from __future__ import annotations

import argparse
import sys

import torch
from timing import gpu_ms

from torchte.kernels import grouped_gemm_fp8 as gg

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ALIGN = 16


def uneven_splits(tokens: int, experts: int, seed: int = 0) -> list[int]:
    """Sizes, multiples of 16 summing to tokens, drawn around tokens / experts."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(experts, generator=gen) + 0.5
    sizes = [int(w / weights.sum() * tokens) // ALIGN * ALIGN for w in weights]
    sizes[-1] += tokens - sum(sizes)
    return sizes


def fp8(shape, dtype, gen) -> torch.Tensor:
    return (torch.randn(shape, device="cuda", generator=gen) * 0.5).to(dtype)


def columns(rows_major: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """The flat columnwise layout of grouped_cast: group g's (C, m_g) block of rows_major^T
    (rows_major (T, C)), padded to round_up(m_g, 16) columns with zeros, one after another."""
    blocks = []
    for part in rows_major.split(sizes):
        width = -(-part.shape[0] // ALIGN) * ALIGN
        block = torch.zeros(part.shape[1], width, dtype=part.dtype, device=part.device)
        block[:, : part.shape[0]] = part.t()
        blocks.append(block.reshape(-1))
    return torch.cat(blocks)


def operands(tokens: int, experts: int, k: int, n: int) -> dict:
    """The operands of one linear K -> N: x (T, K) and dy (T, N) with their columnwise blocks,
    w (G, N, K) and w_t (G, K, N), the split sizes, their padded widths and both offsets."""
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


def per_expert_loops(ops: dict, k: int, n: int):
    """(loop_rows(a, b, out_dtype, fast=False), loop_wgrad()): the grouped GEMMs as
    per-expert torch._scaled_mm calls with the sizes on the host (no sync). loop_rows: a_g @
    b[g]^T for b (G, N_out, R); loop_wgrad: dy_g^T x_g from the columnwise blocks, fp32."""
    sizes, widths = ops["sizes"], ops["widths"]
    dy_cols, x_cols = ops["dy_cols"], ops["x_cols"]
    one = torch.ones((), device="cuda")
    starts = [0]
    for width in widths:
        starts.append(starts[-1] + width)

    def loop_rows(a, b, out_dtype, fast=False):
        return torch.cat([
            torch._scaled_mm(part, b[g].t(), one, one, out_dtype=out_dtype, use_fast_accum=fast)
            for g, part in enumerate(a.split(sizes))
        ])  # fmt: skip

    def loop_wgrad():
        return torch.stack([
            torch._scaled_mm(
                dy_cols[n * starts[g] : n * starts[g + 1]].view(n, width),
                x_cols[k * starts[g] : k * starts[g + 1]].view(k, width).t(), one, one,
                out_dtype=torch.float32,
            )
            for g, width in enumerate(widths)
        ])  # fmt: skip

    return loop_rows, loop_wgrad


def case(tokens: int, experts: int, k: int, n: int):
    """Rows of (gemm, grouped ms, loop ms, flop, relative difference) for one linear K -> N."""
    ops = operands(tokens, experts, k, n)
    x, dy, w, w_t, ones, offs = (ops[key] for key in ("x", "dy", "w", "w_t", "ones", "offs"))
    loop_rows, loop_wgrad = per_expert_loops(ops, k, n)
    bf16, fp32 = torch.bfloat16, torch.float32
    cols = (ops["dy_cols"], ones, ops["x_cols"], ones, ops["col_offs"], n, k, fp32)
    gemms = {
        "fprop": (
            lambda: gg.grouped_rows_gemm(x, ones, w, ones, offs, bf16),
            lambda: loop_rows(x, w, bf16),
        ),
        "dgrad": (
            lambda: gg.grouped_rows_gemm(dy, ones, w_t, ones, offs, bf16),
            lambda: loop_rows(dy, w_t, bf16),
        ),
        "wgrad": (lambda: gg.grouped_reduction_gemm(*cols), loop_wgrad),
    }
    for name, (grouped, loop) in gemms.items():
        got, want = grouped().float(), loop().float()
        diff = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
        t_grouped = gpu_ms(grouped, reps=10, inner=10)
        t_loop = gpu_ms(loop, reps=10, inner=10)
        yield f"{name} {k}->{n}", t_grouped, t_loop, 2 * tokens * k * n, diff


def shape_args(doc: str) -> argparse.Namespace | None:
    """--tokens and --experts from the command line (a script's doc as its description); None,
    said on stdout, without a CUDA GPU."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument(
        "--shapes", default="4096x28672,14336x4096",
        help="the GEMMs' K x N, comma-separated (default: the te.ops grouped MLP's two)",
    )  # fmt: skip
    args = parser.parse_args()
    args.shapes = [tuple(int(v) for v in kn.split("x")) for kn in args.shapes.split(",")]
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return None
    return args


def main() -> int:
    args = shape_args(__doc__)
    if args is None:
        return 1
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.experts} experts, "
          f"{args.tokens} tokens")  # fmt: skip
    print(f"  {'gemm':20s} {'grouped ms':>10s} {'loop ms':>8s} {'grouped/loop':>12s} "
          f"{'grouped TFLOP/s':>15s} {'rel diff':>9s}")  # fmt: skip
    for k, n in args.shapes:
        for name, t_grouped, t_loop, flop, diff in case(args.tokens, args.experts, k, n):
            print(f"  {name:20s} {t_grouped:10.3f} {t_loop:8.3f} {t_grouped / t_loop:12.2f} "
                  f"{flop / t_grouped / 1e9:15.0f} {diff:9.1e}")  # fmt: skip
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
