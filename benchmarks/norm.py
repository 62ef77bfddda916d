"""LayerNorm and RMSNorm: achieved bandwidth and host overhead, torchte vs torch.

GPU-bound: forward and backward at 8192 x 4096 bf16 (bf16 parameters). Bandwidth = the bytes
the op must move, each tensor read or written once (forward: x, weight, bias in; y, mean, rstd
out; backward: dy, x, weight, mean, rstd in; dx, dweight, dbias out), over the time, as a
fraction of the bandwidth of a device-to-device copy of x (read + write counted). torchte's
scratch traffic (the backward's partial sums) is not counted: it is overhead the figure shows.
Baselines in the same run: F.layer_norm and aten's layer-norm backward; F.rms_norm and its
autograd backward.
CPU-bound: host microseconds per call at 16 x 1024 (calls queued back to back, one synchronize
at the end): the kernel functions, and te.LayerNorm / te.RMSNorm forward + backward against
torch.nn.LayerNorm / nn.RMSNorm.

Also sweeps the kernels' block configurations (printed before the main table). Never asserts.

    python benchmarks/norm.py [--json out.json] [--rows 8192 --cols 4096]
    python benchmarks/norm.py --fp8-sweep     # norm -> FP8 (delayed) tiles only

--fp8-sweep times the fused norm -> FP8 kernel (kernels/norm_fp8, rowwise + columnwise) over
its rows per program, output tile and statistics tile at the GPT block's shapes, against the
norm then the cast (bytes: x read, both FP8 copies written).
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F
from timing import fmt, gpu_ms, host_us, print_bandwidth, write_kernel_json
from torch import nn

from torchte.kernels import cast_transpose, norm, norm_fp8
from torchte.kernels.cast_spec import CastSpec
from torchte.module.norm import LayerNorm, RMSNorm

EPS = 1e-5
DTYPE = torch.bfloat16
# (BLOCK_M, num_warps, programs per SM, stages) to try, BLOCK_N the row's (up to the maximum)
# and stages the kernels' STAGES (Triton's pipelining of the row loop). The first forward entry
# is the default at 4096 columns, the fifth at 1024; the first backward entry the default for
# wide rows, the fifth for narrow ones. Earlier sweeps (docs/benchmarks.md) ruled out holding
# weight and bias in registers across the forward loop and prefetching rows by hand.
FWD_SWEEP = [(2, 4, 16, 1), (1, 4, 16, 1), (1, 8, 8, 1), (2, 4, 16, 2), (8, 4, 16, 1)]
FWD_SWEEP += [(4, 8, 8, 1), (2, 8, 8, 1)]
BWD_SWEEP = [(2, 16, 1, 3), (1, 8, 2, 3), (1, 16, 1, 3), (4, 16, 1, 1), (4, 8, 2, 1)]
BWD_SWEEP += [(1, 8, 2, 1), (2, 16, 1, 2)]
# (norm, columns) the sweep runs at, rows = the benchmark's.
SWEEP_SHAPES = [("layernorm", 4096), ("rmsnorm", 4096), ("layernorm", 1024), ("layernorm", 8192)]


def ops(rows: int, cols: int) -> tuple[dict[str, tuple], dict[str, int]]:
    """name -> (torchte fn, torch fn) at rows x cols, and name -> bytes the op must move."""
    dev = "cuda"
    x = torch.randn(rows, cols, device=dev, dtype=DTYPE)
    dy = torch.randn_like(x)
    w = torch.randn(cols, device=dev, dtype=DTYPE)
    b = torch.randn(cols, device=dev, dtype=DTYPE)
    _, mean, rstd = norm.layernorm_forward(x, w, b, EPS, False)
    _, rms_rstd = norm.rmsnorm_forward(x, w, EPS, False)
    _, t_mean, t_rstd = torch.ops.aten.native_layer_norm(x, [cols], w, b, EPS)
    x_req = x.detach().requires_grad_()
    w_req = w.detach().requires_grad_()
    y_rms = F.rms_norm(x_req, (cols,), w_req, EPS)
    fns = {
        "layernorm fwd": (
            lambda: norm.layernorm_forward(x, w, b, EPS, False),
            lambda: F.layer_norm(x, (cols,), w, b, EPS),
        ),
        "layernorm bwd": (
            lambda: norm.layernorm_backward(dy, x, w, mean, rstd, False),
            lambda: torch.ops.aten.native_layer_norm_backward(
                dy, x, [cols], t_mean, t_rstd, w, b, [True, True, True]
            ),
        ),
        "rmsnorm fwd": (
            lambda: norm.rmsnorm_forward(x, w, EPS, False),
            lambda: F.rms_norm(x, (cols,), w, EPS),
        ),
        "rmsnorm bwd": (
            lambda: norm.rmsnorm_backward(dy, x, w, rms_rstd, False),
            lambda: torch.autograd.grad(y_rms, (x_req, w_req), dy, retain_graph=True),
        ),
    }
    act, vec, stat = x.numel() * x.element_size(), cols * w.element_size(), rows * 4
    moved = {
        "layernorm fwd": 2 * act + 2 * vec + 2 * stat,
        "layernorm bwd": 3 * act + 3 * vec + 2 * stat,
        "rmsnorm fwd": 2 * act + vec + stat,
        "rmsnorm bwd": 3 * act + 2 * vec + stat,
    }
    return fns, moved


def copy_gbs(rows: int, cols: int) -> tuple[float, float]:
    """(ms, GB/s) of a device-to-device copy of a rows x cols bf16 tensor, read + write."""
    x = torch.randn(rows, cols, device="cuda", dtype=DTYPE)
    dst = torch.empty_like(x)
    ms = gpu_ms(lambda: dst.copy_(x), reps=15, inner=5)
    return ms, 2 * x.numel() * x.element_size() / ms / 1e6


def bandwidth(rows: int, cols: int) -> list[dict]:
    copy_ms, copy_rate = copy_gbs(rows, cols)
    out = [{"op": "copy_ (d2d)", "impl": "torch", "ms": copy_ms, "GB/s": copy_rate, "frac": 1.0}]
    fns, moved = ops(rows, cols)
    for name, (fn, ref) in fns.items():
        for impl, f in (("torchte", fn), ("torch", ref)):
            try:
                ms = gpu_ms(f, reps=15, inner=5)
            except Exception as exc:  # a benchmark reports, never stops
                out.append({"op": name, "impl": impl, "error": repr(exc)})
                continue
            gbs = moved[name] / ms / 1e6
            out.append({"op": name, "impl": impl, "ms": ms, "GB/s": gbs, "frac": gbs / copy_rate})
    return out


def sweep(rows: int) -> list[dict]:
    """Block configurations of the forward and backward kernels at SWEEP_SHAPES."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = []
    for kind, cols in SWEEP_SHAPES:
        out += _sweep_shape(kind, rows, cols, sms)
    return out


def _sweep_shape(kind: str, rows: int, cols: int, sms: int) -> list[dict]:
    rms = kind == "rmsnorm"
    _, copy_rate = copy_gbs(rows, cols)
    x = torch.randn(rows, cols, device="cuda", dtype=DTYPE)
    dy = torch.randn_like(x)
    w = torch.randn(cols, device="cuda", dtype=DTYPE)
    b = None if rms else torch.randn(cols, device="cuda", dtype=DTYPE)
    _, mean, rstd = norm._forward(x, w, b, EPS, False, rms)
    mean = rstd if rms else mean
    act = x.numel() * x.element_size()
    out = []
    for block_m, warps, per_sm, stages in FWD_SWEEP:
        block_n = min(1 << (cols - 1).bit_length(), norm.FWD_MAX_BLOCK_N)
        cfg = (block_m, block_n, warps, cols > block_n)
        fwd = functools.partial(norm._forward, x, w, b, EPS, False, rms, cfg, sms * per_sm, stages)
        name = (kind, *cfg, f"{per_sm}/SM", f"stages {stages}")
        out.append(_sweep_row("fwd", name, fwd, 2 * act, copy_rate, norm._launch_fwd))
    for block_m, warps, per_sm, stages in BWD_SWEEP:
        block_n = min(1 << (cols - 1).bit_length(), norm.BWD_MAX_BLOCK_N)
        cfg = (block_m, block_n, warps, cols > block_n)
        bwd = functools.partial(
            norm._backward, dy, x, w, mean, rstd, False, rms, not rms, cfg, sms * per_sm,
            stages=stages,
        )  # fmt: skip
        name = (kind, *cfg, f"{per_sm}/SM", f"stages {stages}")
        out.append(_sweep_row("bwd", name, bwd, 3 * act, copy_rate, norm._launch_bwd))
    return out


def _sweep_row(kernel: str, config, fn, nbytes: int, copy_rate: float, launcher) -> dict:
    """Time fn; registers and spills per thread of the kernel its first call compiled."""
    try:
        before = set(map(id, launcher.compiled.values()))
        fn()
        new = [k for k in launcher.compiled.values() if id(k) not in before]
        ms = gpu_ms(fn, reps=15, inner=5)
    except Exception as exc:
        return {"kernel": kernel, "config": config, "error": repr(exc)}
    regs = f"{new[0].n_regs} regs, {new[0].n_spills} spills" if new else ""
    frac = nbytes / ms / 1e6 / copy_rate
    return {"kernel": kernel, "config": config, "ms": ms, "frac": frac, "regs": regs}


# (rows, cols) of --fp8-sweep, and (GROUP_ROWS, OUT_TILE, FP8_TILE) tried at each.
FP8_SHAPES = [(16384, 2048), (8192, 4096), (16384, 8192)]
FP8_SWEEP = [(g, o, t) for g in (16, 32, 64) for o in (2048, 4096) for t in (4096, 8192)]


def fp8_sweep() -> None:
    """Print the fused norm -> FP8 kernel's time per tile choice and the unfused pair's."""
    copy = copy_gbs(1 << 14, 1 << 12)[1]
    for rows, cols in FP8_SHAPES:
        x = torch.randn(rows, cols, device="cuda", dtype=DTYPE)
        w, b = torch.randn(cols, device="cuda", dtype=DTYPE), torch.randn_like(x[0])
        spec = CastSpec(torch.float8_e4m3fn, True, True, torch.ones(1, device="cuda"),
                        torch.zeros(1, device="cuda"))  # fmt: skip
        moved = rows * cols * (DTYPE.itemsize + 2)
        pair = gpu_ms(
            lambda x=x, w=w, b=b, spec=spec: cast_transpose.quantize(
                norm._forward(x, w, b, EPS, False, False)[0], spec
            ), reps=15, inner=5,
        )  # fmt: skip
        print(f"\nnorm -> FP8 at {rows}x{cols}: norm then cast {pair:.4f} ms "
              f"({moved / pair / 1e6 / copy:.2f} of copy)")  # fmt: skip
        for group, out_tile, tile in FP8_SWEEP:
            cfg = norm.row_config(rows, cols, norm.FWD_MAX_BLOCK_N, tile)
            fn = functools.partial(
                norm_fp8._forward_fp8, x, w, b, EPS, False, False, spec, cfg, out_tile, group
            )
            ms = gpu_ms(fn, reps=15, inner=5)
            print(f"  rows {group:3d} out {out_tile:5d} stats {tile:5d}: {ms:.4f} ms "
                  f"({moved / ms / 1e6 / copy:.2f} of copy)")  # fmt: skip


def host_overhead(rows: int = 16, cols: int = 1024) -> list[dict]:
    """Host microseconds per call: kernel functions and modules, torchte vs torch."""
    fns, _ = ops(rows, cols)
    x = torch.randn(rows, cols, device="cuda", dtype=DTYPE, requires_grad=True)
    dy = torch.randn_like(x)
    modules = {
        "LayerNorm fwd+bwd": (LayerNorm(cols, params_dtype=DTYPE, device="cuda"),
                              nn.LayerNorm(cols, dtype=DTYPE, device="cuda")),
        "RMSNorm fwd+bwd": (RMSNorm(cols, params_dtype=DTYPE, device="cuda"),
                            nn.RMSNorm(cols, dtype=DTYPE, device="cuda")),
    }  # fmt: skip
    for name, (te_mod, torch_mod) in modules.items():
        fns[name] = (
            lambda m=te_mod: m(x).backward(dy),
            lambda m=torch_mod: m(x).backward(dy),
        )
    out = []
    for name, (fn, ref) in fns.items():
        row = {"op": name}
        for impl, f in (("torchte_us", fn), ("torch_us", ref)):
            try:
                row[impl] = host_us(f, calls=1000)
            except Exception as exc:
                row[impl] = None
                row[impl + "_error"] = repr(exc)
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--fp8-sweep", action="store_true", help="the norm -> FP8 sweep only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("norm benchmark: no CUDA device, nothing measured")
        return
    if args.fp8_sweep:
        fp8_sweep()
        return
    sweep_rows = sweep(args.rows)
    host = host_overhead()
    main_rows = bandwidth(args.rows, args.cols)

    print(f"\nsweep at {args.rows} rows, bf16 (fraction of d2d copy bandwidth)")
    for row in sweep_rows:
        config = " ".join(str(part) for part in row["config"] if part)
        print(f"  {row['kernel']:4s} {config:44s} ", end="")
        print(row.get("error") or f"{row['ms']:.4f} ms  {row['frac']:.3f}  {row['regs']}")

    print("\nhost us per call at 16x1024 bf16 (calls queued, one synchronize)")
    print(f"  {'op':20s} {'torchte':>9s} {'torch':>9s} {'torch/te':>9s}")
    for row in host:
        te, ref = row.get("torchte_us"), row.get("torch_us")
        ratio = ref / te if te and ref else None
        print(f"  {row['op']:20s} {fmt(te, '9.1f')} {fmt(ref, '9.1f')} {fmt(ratio, '9.2f')}")

    title = f"\nbandwidth at {args.rows}x{args.cols} bf16 on {torch.cuda.get_device_name()}"
    print_bandwidth(title, main_rows, 14, 8)
    if args.json:
        write_kernel_json(
            args.json, args.rows, args.cols, bandwidth=main_rows, sweep=sweep_rows, host_us=host
        )


if __name__ == "__main__":
    main()
