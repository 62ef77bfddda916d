"""Per-tensor FP8 quantize: achieved bandwidth and host overhead, torchte vs the torch reference.

GPU-bound: quantize_delayed (rowwise + columnwise) and quantize_current on an 8192 x 8192 bf16
matrix; bandwidth = bytes the op must move (reads + writes) / time, as a fraction of the
bandwidth of a device-to-device copy (read + write counted). quantize_current reads x twice
(amax, then cast), and both reads are counted.
CPU-bound: host microseconds per launcher call at 16 x 1024 (calls queued back to back, one
synchronize at the end), and for update_delayed_scaling on a (1024, 3) history.

Also sweeps the cast tile and the amax block (printed before the main table). Never asserts.

    python benchmarks/quantize.py [--json out.json] [--rows 8192 --cols 8192]
"""

from __future__ import annotations

import argparse

import torch
from timing import fmt, gpu_ms, host_us, print_bandwidth, write_kernel_json

from torchte._sizes import round_up
from torchte.kernels import cast_transpose as ct
from torchte.kernels import scaling
from torchte.kernels.cast_spec import CastSpec

FP8 = torch.float8_e4m3fn
CAST_SWEEP = [
    (32, 128, 4),
    (64, 64, 4),
    (64, 128, 4),
    (128, 64, 4),
    (128, 64, 8),
    (128, 128, 8),
    (64, 256, 8),
]
AMAX_SWEEP = [(4096, 4), (8192, 8), (16384, 8), (32768, 16)]


def quantize_fns(x: torch.Tensor) -> dict[str, tuple]:
    """name -> (torchte fn, reference fn) on x, all outputs asked for."""
    dev = x.device
    scale, amax = torch.ones(1, device=dev), torch.zeros(1, device=dev)
    # Made once, as a quantizer makes its CastSpec once per usage.
    delayed, current = CastSpec(FP8, True, True, scale, amax), CastSpec(FP8, True, True)
    return {
        "quantize_delayed": (
            lambda: ct.quantize(x, delayed),
            lambda: ct.quantize_reference(x, delayed),
        ),
        "quantize_current": (
            lambda: ct.quantize(x, current),
            lambda: ct.quantize_reference(x, current),
        ),
        "record_amax": (
            lambda: ct.record_amax(x, amax),
            lambda: ct.record_amax_reference(x, amax),
        ),
    }


def bandwidth(rows: int, cols: int) -> tuple[list[dict], list[dict]]:
    """(main rows, sweep rows) at rows x cols bf16."""
    x = torch.randn((rows, cols), device="cuda", dtype=torch.bfloat16)
    x_bytes = x.numel() * x.element_size()
    out_bytes = rows * cols + cols * round_up(rows, ct.COLUMNWISE_ALIGN)
    dst = torch.empty_like(x)
    copy_ms = gpu_ms(lambda: dst.copy_(x))
    copy_gbs = 2 * x_bytes / copy_ms / 1e6
    moved = {
        "quantize_delayed": x_bytes + out_bytes,
        "quantize_current": 2 * x_bytes + out_bytes,
        "record_amax": x_bytes,
    }
    main = [{"op": "copy_ (d2d)", "impl": "torch", "ms": copy_ms, "GB/s": copy_gbs, "frac": 1.0}]
    for name, (fn, ref) in quantize_fns(x).items():
        for impl, f in (("torchte", fn), ("torch ref", ref)):
            try:
                ms = gpu_ms(f)
            except Exception as exc:  # a benchmark reports, never stops
                main.append({"op": name, "impl": impl, "error": repr(exc)})
                continue
            gbs = moved[name] / ms / 1e6
            main.append({"op": name, "impl": impl, "ms": ms, "GB/s": gbs, "frac": gbs / copy_gbs})
    sweep = []
    scale, amax = (torch.ones(1, device="cuda") for _ in range(2))
    for cfg in CAST_SWEEP:
        try:
            ms = gpu_ms(
                lambda cfg=cfg: ct._cast_transpose(
                    x, scale, amax, FP8, True, True, False, 0.0, False, cfg
                )
            )
        except Exception as exc:
            sweep.append({"kernel": "cast", "config": cfg, "error": repr(exc)})
            continue
        gbs = moved["quantize_delayed"] / ms / 1e6
        sweep.append({"kernel": "cast", "config": cfg, "ms": ms, "frac": gbs / copy_gbs})
    for cfg in AMAX_SWEEP:
        try:
            ms = gpu_ms(lambda cfg=cfg: ct._launch_amax(x, amax, cfg))
        except Exception as exc:
            sweep.append({"kernel": "amax", "config": cfg, "error": repr(exc)})
            continue
        gbs = x_bytes / ms / 1e6
        sweep.append({"kernel": "amax", "config": cfg, "ms": ms, "frac": gbs / copy_gbs})
    return main, sweep


def launch_only(x: torch.Tensor) -> dict[str, tuple]:
    """The cast kernel's launch alone: torchte's FastLaunch vs Triton's kernel[grid](...)."""
    rows, cols = x.shape
    block_m, block_n, num_warps = ct.CAST_CONFIG
    scale, amax, scale_inv = (torch.ones(1, device=x.device) for _ in range(3))
    data = torch.empty((rows, cols), dtype=FP8, device=x.device)
    data_t = torch.empty((cols, round_up(rows, 16)), dtype=FP8, device=x.device)
    grid = (-(-rows // block_m), -(-cols // block_n), 1)
    args = (x, scale, amax, scale_inv, data, data_t, rows, cols, 0.0, 448.0, False, False, True)
    args += (True, block_m, block_n)
    key = ("benchmark", x.dtype, rows, cols)
    return {
        "cast launch only": (
            lambda: ct._launch_cast_transpose(key, grid, num_warps, *args),
            lambda: ct._cast_transpose_kernel[grid](*args, num_warps=num_warps),
        )
    }


def host_overhead(rows: int = 16, cols: int = 1024) -> list[dict]:
    """Host microseconds per call of each launcher and of its torch reference."""
    x = torch.randn((rows, cols), device="cuda", dtype=torch.bfloat16)
    fns = quantize_fns(x)
    history, scale = torch.zeros((1024, 3), device="cuda"), torch.ones(3, device="cuda")
    nonfinite = torch.zeros(3, dtype=torch.int32, device="cuda")
    fns["update_delayed_scaling"] = (
        lambda: scaling.update_delayed_scaling(history, scale, nonfinite, 448.0, 0, "max"),
        lambda: scaling.update_delayed_scaling_reference(
            history, scale, nonfinite, 448.0, 0, "max"
        ),
    )
    fns.update(launch_only(x))
    out = []
    for name, (fn, ref) in fns.items():
        row = {"op": name}
        for impl, f in (("torchte_us", fn), ("torch_ref_us", ref)):
            try:
                row[impl] = host_us(f)
            except Exception as exc:
                row[impl] = None
                row[impl + "_error"] = repr(exc)
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--cols", type=int, default=8192)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("quantize benchmark: no CUDA device, nothing measured")
        return
    main_rows, sweep = bandwidth(args.rows, args.cols)
    host = host_overhead()

    print(f"\nsweep at {args.rows}x{args.cols} bf16 -> e4m3 (fraction of d2d copy bandwidth)")
    for row in sweep:
        print(f"  {row['kernel']:5s} {row['config']!s:16s} ", end="")
        print(row.get("error") or f"{row['ms']:.4f} ms  {row['frac']:.3f}")

    print("\nhost us per call at 16x1024 bf16 (update: (1024, 3) history; 'cast launch only':")
    print("torchte's FastLaunch vs Triton's kernel[grid](...) in the 'torch ref' column)")
    print(f"  {'op':24s} {'torchte':>9s} {'torch ref':>10s} {'ratio':>6s}")
    for row in host:
        te, ref = row.get("torchte_us"), row.get("torch_ref_us")
        ratio = ref / te if te and ref else None
        print(f"  {row['op']:24s} {fmt(te, '9.1f')} {fmt(ref, '10.1f')} {fmt(ratio, '6.2f')}")

    device = torch.cuda.get_device_name()
    print_bandwidth(
        f"\nbandwidth at {args.rows}x{args.cols} bf16 -> e4m3 on {device}", main_rows, 18, 10
    )
    if args.json:
        write_kernel_json(
            args.json, args.rows, args.cols, bandwidth=main_rows, sweep=sweep, host_us=host
        )


if __name__ == "__main__":
    main()
