"""Producers that write Float8BlockScaling's 1x128 FP8 themselves, against the unfused path
(the producer in bf16 to memory, then block_cast.block_quantize): ms and the fraction of a
device-to-device copy's bandwidth, and whether the fused bytes equal the unfused ones.

CASES maps a case name to a function(args) -> rows; each case keeps its own functions below
(activation: kernels/activation_block.py). A row: op, impl, ms, GB/s, frac
(of copy), check (fused bytes vs the unfused path with the same statistics config: OK /
MISMATCH; "-" for the unfused rows), regs (registers/spills of what compiled). Bytes counted
per element: the input read once (2 B bf16) and both FP8 copies written (1 + 1 B); scales and
statistics left out. Timed with CUDA events (median of 20, each over 10 back-to-back calls).
Never asserts.

    PYTHONPATH=. python benchmarks/fused_block.py [--cases activation] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

import torch
from block_quantize import compiled_info, same_bytes
from timing import gpu_ms

CASES: dict[str, Callable[[argparse.Namespace], list[dict]]] = {}


def timed_row(op: str, impl: str, fn, moved: int, copy_gbs: float, check: str) -> dict:
    """One table row: fn timed, its bandwidth as a fraction of copy (errors recorded)."""
    row = {"op": op, "impl": impl, "check": check}
    try:
        ms = gpu_ms(fn, reps=20, inner=10)
    except Exception as exc:  # a benchmark reports, never stops
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
        return row
    gbs = moved / ms / 1e6
    row.update(ms=ms, **{"GB/s": gbs}, frac=gbs / copy_gbs)
    return row


# ----------------------------------------------------------------------------------------------
# activation: LayerNormMLP's activation -> 1x128 FP8 (kernels/activation_block.py), forward,
# backward with the bias gradient, and a GEMM's output gradient with its bias gradient
# ----------------------------------------------------------------------------------------------

# (activation, rows, columns of h): gelu 8192 x 16384, swiglu 8192 x 2x8192.
ACT_SHAPES = [("gelu", 8192, 16384), ("swiglu", 8192, 16384)]
# (num_warps, group_m) tried besides activation_block's FORWARD_CONFIG / BACKWARD_CONFIG.
ACT_SWEEP = [(4, 1), (4, 8), (4, 64), (8, 1), (8, 8)]
ACT_LIMIT, ACT_ALPHA = 7.0, 1.702


def _act_runners(name: str, h: torch.Tensor, da: torch.Tensor):
    """(fused forward(config), unfused forward(), fused backward(config), unfused backward())
    of one activation on h, da: the fused kernels through their launchers; the unfused path
    activation.py's kernel, block_quantize, and (backward) dh.sum(0)."""
    from torchte.kernels import activation as act
    from torchte.kernels import activation_block as ab
    from torchte.kernels import block_cast as bc
    from torchte.kernels.cast_spec import CastSpec

    fp8 = torch.float8_e4m3fn
    spec = CastSpec(fp8, True, True, amax_epsilon=0.0, power_2_scale=True)
    kind, gated = act._SPECS[name]
    args = (da.shape[1], kind, gated, ACT_LIMIT, ACT_ALPHA, spec)

    def fused_fwd(config=ab.FORWARD_CONFIG):
        return ab._forward_triton(h, *args, config)

    def unfused_fwd():
        a = act.activation_forward(h, name, ACT_LIMIT, ACT_ALPHA)
        return bc.block_quantize(a, fp8, 1, True, True, True, 0.0)

    def fused_bwd(config=ab.BACKWARD_CONFIG):
        return ab._backward_triton(da, h, *args, config)

    def unfused_bwd():
        dh = act.activation_backward(da, h, name, ACT_LIMIT, ACT_ALPHA)
        return (*bc.block_quantize(dh, fp8, 1, True, True, True, 0.0), dh.sum(0))

    return fused_fwd, unfused_fwd, fused_bwd, unfused_bwd


def _act_rows(op, fused, unfused, moved, copy_gbs, sweep, launcher) -> list[dict]:
    """The unfused row, then the fused kernel's under its default config and each of sweep;
    check: the fused data and scales against the unfused ones (dbias, where made, within 2%
    of the unfused sum: the sums' order differs)."""
    want = unfused()
    rows = [timed_row(op, "activation + block_quantize", unfused, moved, copy_gbs, "-")]
    for config in [None, *sweep]:
        before = set(launcher.compiled)
        try:
            got = fused() if config is None else fused(config)
            check = "OK" if same_bytes(got[:4], want[:4]) else "MISMATCH"
            if len(got) > 4 and not torch.allclose(
                got[4].float(), want[4].float(), rtol=2e-2, atol=1e-2
            ):
                check += " (dbias far)"
        except Exception as exc:
            check = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
        impl = "fused default" if config is None else f"fused {config}"
        fn = fused if config is None else (lambda c=config: fused(c))
        row = timed_row(op, impl, fn, moved, copy_gbs, check)
        row["regs"] = compiled_info(launcher, before)
        rows.append(row)
    return rows


def activation_case(args: argparse.Namespace) -> list[dict]:
    """gelu and swiglu of bf16 h -> 1x128 e4m3, both usages, power-of-2 scales, forward and
    backward (with dbias), fused against unfused; then dy -> 1x128 with dbias (identity)."""
    from torchte.kernels import activation_block as ab
    from torchte.kernels import block_cast as bc
    from torchte.kernels.cast_spec import CastSpec

    rows = []
    sweep = [] if args.quick else ACT_SWEEP
    for name, m, k in ACT_SHAPES[:1] if args.quick else ACT_SHAPES:
        n = k // 2 if name == "swiglu" else k
        h = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
        da = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        copy_ms = gpu_ms(lambda h=h: h.clone(), reps=20, inner=10)
        copy_gbs = 2 * h.numel() * h.element_size() / copy_ms / 1e6
        fused_fwd, unfused_fwd, fused_bwd, unfused_bwd = _act_runners(name, h, da)
        op = f"{name} fwd {m}x{k}"
        moved = h.numel() * 2 + m * n * 2
        rows += _act_rows(op, fused_fwd, unfused_fwd, moved, copy_gbs, sweep, ab._launch_tiles)
        op = f"{name} bwd {m}x{k}"
        moved = (h.numel() + da.numel()) * 2 + m * k * 2
        rows += _act_rows(op, fused_bwd, unfused_bwd, moved, copy_gbs, sweep, ab._launch_tiles)
        del h, da
        torch.cuda.empty_cache()
    dy = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    copy_ms = gpu_ms(lambda: dy.clone(), reps=20, inner=10)
    copy_gbs = 2 * dy.numel() * dy.element_size() / copy_ms / 1e6
    spec = CastSpec(torch.float8_e4m3fn, True, True, amax_epsilon=0.0, power_2_scale=True)

    def unfused_dy():
        return (*bc.block_quantize(dy, spec.fp8_dtype, 1, True, True, True, 0.0), dy.sum(0))

    def fused_dy(config=ab.BACKWARD_CONFIG):
        return ab._dbias_triton(dy, spec, config)

    moved = dy.numel() * 4
    op = "dy + dbias 8192x8192"
    rows += _act_rows(op, fused_dy, unfused_dy, moved, copy_gbs, sweep, ab._launch_tiles)
    return rows


CASES["activation"] = activation_case


# ----------------------------------------------------------------------------------------------
# Table and entry point
# ----------------------------------------------------------------------------------------------


def print_rows(rows: list[dict]) -> None:
    print(f"  {'op':22s} {'impl':30s} {'ms':>8s} {'GB/s':>8s} {'of copy':>8s}  check  regs")
    for row in rows:
        head = f"  {row['op']:22s} {row['impl']:30s}"
        if "error" in row:
            print(f"{head} {row['error']}")
            continue
        tail = f"{row['check']}  {row.get('regs', '')}"
        print(f"{head} {row['ms']:8.4f} {row['GB/s']:8.1f} {row['frac']:8.3f}  {tail}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--quick", action="store_true", help="first shape, defaults only")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("fused_block benchmark: no CUDA device, nothing measured")
        return 1
    import triton

    device = torch.cuda.get_device_name()
    print(f"{device}, torch {torch.__version__}, triton {triton.__version__}")
    results = {}
    for name in args.cases:
        start = time.time()
        results[name] = CASES[name](args)
        print(f"\n{name} ({time.time() - start:.0f} s)")
        print_rows(results[name])
    if args.json:
        meta = {"device": device, "torch": torch.__version__, "triton": triton.__version__}
        meta["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        with open(args.json, "w") as f:
            json.dump({**meta, "cases": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
