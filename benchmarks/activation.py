"""LayerNormMLP activations: achieved bandwidth and host overhead, torchte vs torch.

GPU-bound: swiglu and gelu, forward and backward, on x 8192 x 16384 bf16 (swiglu: y, dy are
8192 x 8192); bandwidth = bytes the op must move (reads + writes) / time, as a fraction of the
bandwidth of a device-to-device copy of x (read + write counted). Compared in the same run with
the eager torch composition a user would write (F.silu(x1) * x2, F.gelu(approximate="tanh"),
aten's silu_backward / gelu_backward) and with torchte's fp32 torch reference.
CPU-bound: host microseconds per call at 16 x 4096 (calls queued back to back, one synchronize
at the end), and the forward kernel's launch alone (FastLaunch vs Triton's kernel[grid](...)).

Also sweeps the kernels' (elements per program, num_warps) configs (printed before the main
table). Target: >= 80% of copy bandwidth. Never asserts.

    python benchmarks/activation.py [--json out.json] [--rows 8192 --cols 16384]
    python benchmarks/activation.py --fp8-sweep   # activation -> FP8 (delayed) tiles only

--fp8-sweep times the fused activation -> FP8 kernels (kernels/activation_fp8: the forward
writing both FP8 copies; the backward writing dh's two copies and the bias gradient) per
(BLOCK_M, BLOCK_N, num_warps), GELU and SwiGLU at the GPT block's 16K tokens and FFN 8192,
against the unfused activation then the cast. Bytes: forward h read, two FP8 copies written;
backward dy and h read, two FP8 copies written.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from timing import fmt, gpu_ms, host_us, print_bandwidth, write_kernel_json

from torchte.kernels import activation as act
from torchte.kernels import activation_fp8, cast_transpose
from torchte.kernels.cast_spec import CastSpec

SWEEP = [(1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (8192, 16)]
NAMES = ["swiglu", "gelu"]


def eager_forward(x: torch.Tensor, name: str) -> torch.Tensor:
    """The torch composition of the forward, in x's dtype."""
    if name == "swiglu":
        x1, x2 = x.chunk(2, dim=-1)
        return F.silu(x1) * x2
    return F.gelu(x, approximate="tanh")


def eager_backward(dy: torch.Tensor, x: torch.Tensor, name: str) -> torch.Tensor:
    """The torch composition of the backward, in x's dtype."""
    if name == "swiglu":
        x1, x2 = x.chunk(2, dim=-1)
        dx1 = torch.ops.aten.silu_backward(dy * x2, x1)
        return torch.cat([dx1, dy * F.silu(x1)], dim=-1)
    return torch.ops.aten.gelu_backward(dy, x, approximate="tanh")


def inputs(rows: int, cols: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(x (rows, cols), dy (rows, N)) bf16 on the GPU."""
    x = torch.randn((rows, cols), device="cuda", dtype=torch.bfloat16)
    n = cols // 2 if act.is_gated(name) else cols
    return x, torch.randn((rows, n), device="cuda", dtype=torch.bfloat16)


def op_fns(x: torch.Tensor, dy: torch.Tensor, name: str) -> dict[str, dict[str, object]]:
    """direction -> impl -> fn, for forward and backward of `name` on x, dy."""
    return {
        "fwd": {
            "torchte": lambda: act.activation_forward(x, name),
            "torch eager": lambda: eager_forward(x, name),
            "torch ref": lambda: act.activation_forward_reference(x, name),
        },
        "bwd": {
            "torchte": lambda: act.activation_backward(dy, x, name),
            "torch eager": lambda: eager_backward(dy, x, name),
            "torch ref": lambda: act.activation_backward_reference(dy, x, name),
        },
    }


def moved_bytes(x: torch.Tensor, dy: torch.Tensor) -> dict[str, int]:
    """Bytes each direction must move: forward reads x, writes y; backward reads dy, x, writes
    dx (y and dy have the same size)."""
    x_bytes, y_bytes = x.numel() * x.element_size(), dy.numel() * dy.element_size()
    return {"fwd": x_bytes + y_bytes, "bwd": y_bytes + 2 * x_bytes}


def copy_gbs(rows: int, cols: int) -> float:
    """GB/s of a device-to-device copy of a rows x cols bf16 matrix (read + write counted)."""
    src = torch.randn((rows, cols), device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / gpu_ms(lambda: dst.copy_(src)) / 1e6


def sweep_configs(x: torch.Tensor, dy: torch.Tensor, name: str, copy: float) -> list[dict]:
    """Each SWEEP config of the forward and backward kernels on x, dy: ms and fraction of copy."""
    moved = moved_bytes(x, dy)
    out = []
    for cfg in SWEEP:
        launches = {
            "fwd": lambda cfg=cfg: act._forward_triton(x, name, 7.0, 1.702, cfg),
            "bwd": lambda cfg=cfg: act._backward_triton(dy, x, name, 7.0, 1.702, cfg),
        }
        for direction, fn in launches.items():
            row = {"op": f"{name} {direction}", "config": cfg}
            try:
                ms = gpu_ms(fn)
            except Exception as exc:  # a benchmark reports, never stops
                out.append({**row, "error": repr(exc)})
                continue
            out.append({**row, "ms": ms, "frac": moved[direction] / ms / 1e6 / copy})
    return out


def bandwidth(rows: int, cols: int) -> tuple[list[dict], list[dict]]:
    """(main rows, sweep rows) at rows x cols bf16."""
    copy = copy_gbs(rows, cols)
    main = [{"op": "copy_ (d2d)", "impl": "torch", "GB/s": copy, "frac": 1.0}]
    main[0]["ms"] = 2 * rows * cols * 2 / copy / 1e6
    sweep = []
    for name in NAMES:
        x, dy = inputs(rows, cols, name)
        moved = moved_bytes(x, dy)
        for direction, impls in op_fns(x, dy, name).items():
            for impl, fn in impls.items():
                row = {"op": f"{name} {direction}", "impl": impl}
                try:
                    ms = gpu_ms(fn)
                except Exception as exc:
                    main.append({**row, "error": repr(exc)})
                    continue
                gbs = moved[direction] / ms / 1e6
                main.append({**row, "ms": ms, "GB/s": gbs, "frac": gbs / copy})
        sweep += sweep_configs(x, dy, name, copy)
    return main, sweep


def launch_only(x: torch.Tensor) -> tuple:
    """The swiglu forward kernel's launch alone: FastLaunch vs Triton's kernel[grid](...)."""
    rows, cols = x.shape[0], x.shape[1] // 2
    block_m, block_n, num_warps = act._tile(rows, cols, True, act.FORWARD_CONFIG)
    y = torch.empty((rows, cols), device=x.device, dtype=x.dtype)
    grid = (-(-rows // block_m) * -(-cols // block_n), 1, 1)
    args = (x, y, rows, cols, 7.0, 1.702, "silu", True, block_m, block_n)
    key = ("benchmark", x.dtype, rows, cols)
    return (
        lambda: act._launch_forward(key, grid, num_warps, *args),
        lambda: act._forward_kernel[grid](*args, num_warps=num_warps),
    )


def host_overhead(rows: int = 16, cols: int = 4096) -> list[dict]:
    """Host microseconds per call of torchte, the eager composition and the torch reference."""
    out = []
    for name in NAMES:
        x, dy = inputs(rows, cols, name)
        for direction, impls in op_fns(x, dy, name).items():
            row = {"op": f"{name} {direction}"}
            for impl, fn in impls.items():
                try:
                    row[impl] = host_us(fn)
                except Exception as exc:
                    row[impl] = None
                    row[impl + " error"] = repr(exc)
            out.append(row)
    x, _ = inputs(rows, cols, "swiglu")
    row = {"op": "swiglu fwd launch only"}
    for impl, fn in zip(("torchte", "triton kernel[grid]"), launch_only(x), strict=True):
        try:
            row[impl] = host_us(fn)
        except Exception as exc:
            row[impl] = None
            row[impl + " error"] = repr(exc)
    out.append(row)
    return out


def print_results(args, main_rows: list[dict], sweep: list[dict], host: list[dict]) -> None:
    print(f"\nsweep at {args.rows}x{args.cols} bf16 (elements per program, num_warps): ", end="")
    print(f"fraction of d2d copy bandwidth (now fwd {act.FORWARD_CONFIG}, bwd ", end="")
    print(f"{act.BACKWARD_CONFIG})")
    for row in sweep:
        print(f"  {row['op']:12s} {row['config']!s:12s} ", end="")
        print(row.get("error") or f"{row['ms']:.4f} ms  {row['frac']:.3f}")

    print(f"\nhost us per call at 16x{args.host_cols} bf16 (launch only: torchte's FastLaunch vs")
    print("Triton's kernel[grid](...) in the 'eager' column)")
    print(f"  {'op':24s} {'torchte':>9s} {'eager':>9s} {'torch ref':>10s}")
    for row in host:
        eager = row.get("torch eager", row.get("triton kernel[grid]"))
        print(
            f"  {row['op']:24s} {fmt(row.get('torchte'), '9.1f')} {fmt(eager, '9.1f')} "
            f"{fmt(row.get('torch ref'), '10.1f')}"
        )

    title = f"\nbandwidth at {args.rows}x{args.cols} bf16 on {torch.cuda.get_device_name()}"
    print_bandwidth(title, main_rows, 12, 12)


FP8_FORWARD_SWEEP = [(32, 128, 4), (64, 128, 8), (32, 256, 8), (64, 64, 4), (16, 128, 4)]
FP8_BACKWARD_SWEEP = [(64, 32, 4), (64, 64, 4), (32, 64, 4), (64, 128, 8), (128, 32, 4),
                      (32, 128, 4), (64, 64, 8)]  # fmt: skip


def fp8_sweep(rows: int = 16384, n: int = 8192) -> None:
    """Print the fused activation -> FP8 kernels' time per tile and the unfused pair's, for
    GELU (h (rows, n)) and SwiGLU (h (rows, 2n)); a and dy are (rows, n)."""
    spec = CastSpec(torch.float8_e4m3fn, True, True, torch.ones(1, device="cuda"),
                    torch.zeros(1, device="cuda"))  # fmt: skip
    src = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = 2 * src.numel() / gpu_ms(lambda: dst.copy_(src)) / 1e6
    for name in ("gelu", "swiglu"):
        kind, gated = act._spec(name)
        k = 2 * n if gated else n
        h = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
        passes = {
            "forward": (
                rows * (2 * k + 2 * n),
                lambda h=h, name=name: cast_transpose.quantize(
                    act.activation_forward(h, name), spec
                ),
                lambda c, h=h, kind=kind, gated=gated: activation_fp8._forward_fp8_triton(
                    h, n, kind, gated, 7.0, 1.702, spec, c
                ),
                FP8_FORWARD_SWEEP,
            ),
            "backward": (
                rows * (2 * n + 2 * k + 2 * k),
                lambda h=h, dy=dy, name=name: cast_transpose.quantize(
                    act.activation_backward(dy, h, name), spec
                ),
                lambda c, h=h, dy=dy, kind=kind, gated=gated: activation_fp8._backward_fp8_triton(
                    dy, h, n, kind, gated, 7.0, 1.702, spec, c
                ),
                FP8_BACKWARD_SWEEP,
            ),
        }
        for which, (moved, pair, fused, configs) in passes.items():
            ms = gpu_ms(pair, reps=10, inner=5)
            print(f"\n{name} {which} -> FP8, h {rows}x{k}: unfused {ms:.4f} ms "
                  f"({moved / ms / 1e6 / copy:.2f} of copy)")  # fmt: skip
            for config in configs:
                ms = gpu_ms(lambda c=config, f=fused: f(c), reps=10, inner=5)
                print(f"  {config}: {ms:.4f} ms ({moved / ms / 1e6 / copy:.2f} of copy)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--cols", type=int, default=16384, help="K, the width of x")
    parser.add_argument("--host-cols", type=int, default=4096, help="K at 16 tokens")
    parser.add_argument("--fp8-sweep", action="store_true", help="the activation -> FP8 sweep")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("activation benchmark: no CUDA device, nothing measured")
        return
    if args.fp8_sweep:
        fp8_sweep()
        return
    main_rows, sweep = bandwidth(args.rows, args.cols)
    host = host_overhead(16, args.host_cols)
    print_results(args, main_rows, sweep, host)
    if args.json:
        write_kernel_json(
            args.json, args.rows, args.cols, host_shape=[16, args.host_cols],
            forward_config=act.FORWARD_CONFIG, backward_config=act.BACKWARD_CONFIG,
            bandwidth=main_rows, sweep=sweep, host_us=host,
        )  # fmt: skip


if __name__ == "__main__":
    main()
