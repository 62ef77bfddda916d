"""Block-scaled FP8 quantize kernels (kernels/block_cast.py): achieved bandwidth of each launch
configuration as a fraction of a device-to-device copy, and a byte check of the configurations.

Kernels, both usages (rowwise + columnwise), bf16 -> e4m3, power-of-2 scales: the 1x128 cast
(block_quantize block_dim 1) and the 128x128 cast (block_dim 2) at 8192 x 8192 and
32768 x 4096; the grouped 1x128 cast (grouped_block_quantize) of 32768 x 4096 in 8 uneven
groups: sizes multiples of 4, odd sizes, and sizes multiples of 16 (T % 16 == 0: every tile
stores its columnwise bytes in aligned 16-byte runs, but for the 16-row chunks at an edge of
its block shared with a neighbour, byte by byte). Each configuration of SWEEP
(SWEEP_GROUPED for the grouped kernel; block_cast.CONFIG_1D's form) is timed with CUDA events
(median of 20, each over 10 back-to-back calls so that host launch time is hidden) beside
x.clone(). Bytes moved: x read (2 B an element), both FP8 copies written (1 B + 1 B) and the
fp32 scales.

Byte checks: every configuration's output against the torch reference run on the GPU on the
same input ("bytes" column: OK / MISMATCH); then each kernel's best configuration on a small
odd-shaped input with NaN, inf, zero and tiny blocks against the torch reference on the CPU
(the check the GPU tests make). Never asserts.

    PYTHONPATH=. python benchmarks/block_quantize.py [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from timing import gpu_ms

from torchte.kernels import block_cast as bc

FP8 = torch.float8_e4m3fn
# (num_warps, num_stages, programs_per_sm, group_m), block_cast.CONFIG_1D's form. num_stages 0:
# one program per tile; >= 1: persistent programs, loads pipelined num_stages deep. group_m:
# the tile order (bands of group_m rows of tiles; 1: the input in order, 64: the columnwise copy
# in order at 8192 rows). Every entry compiles for sm_90 without spills (bf16, fp16, fp32 in);
# the grouped kernel's pipelined 16-warp variants spill, so its list leaves them out.
SWEEP = [
    (4, 0, 0, 8),
    (8, 0, 0, 1),
    (8, 0, 0, 8),
    (8, 0, 0, 64),
    (16, 0, 0, 8),
    (8, 2, 1, 8),
    (8, 3, 1, 8),
    (16, 1, 1, 8),
    (16, 2, 1, 8),
    (16, 3, 1, 8),
    (16, 4, 1, 8),
    (16, 3, 1, 1),
]
SWEEP_GROUPED = [
    (4, 0, 0, 8),
    (8, 0, 0, 1),
    (8, 0, 0, 8),
    (8, 0, 0, 64),
    (16, 0, 0, 8),
    (16, 1, 1, 8),
    (8, 2, 1, 8),
]
GROUP_SIZES = [1000, 7000, 3000, 5500, 2500, 6000, 4768, 3000]
ODD_GROUP_SIZES = [999, 7001, 3003, 5497, 2501, 5999, 4767, 3001]
GROUP_SIZES_16 = [1008, 7008, 3008, 5504, 2496, 6000, 4736, 3008]
DEFAULTS = {"1x128": bc.CONFIG_1D, "128x128": bc.CONFIG_2D, "grouped": bc.CONFIG_GROUPED}


def offsets_of(sizes: list[int], device) -> torch.Tensor:
    """row_offsets (G + 1,) int32 of group sizes."""
    return torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32).to(device)


def runner(kind: str, x: torch.Tensor, offsets: torch.Tensor | None):
    """(fn(config) -> outputs, reference() -> outputs) of one kernel on x."""
    consts = bc._constexprs(x, FP8, True, True, True)
    if kind == "1x128":
        return (
            lambda cfg: bc._quantize_1d(x, FP8, 0.0, consts, cfg),
            lambda: bc.block_quantize_reference(x, FP8, 1, True, True, True, 0.0),
        )
    if kind == "128x128":
        return (
            lambda cfg: bc._quantize_2d(x, FP8, 0.0, consts, cfg),
            lambda: bc.block_quantize_reference(x, FP8, 2, True, True, True, 0.0),
        )
    return (
        lambda cfg: bc._quantize_grouped(x, offsets, FP8, 0.0, consts, cfg),
        lambda: bc.grouped_block_quantize_reference(x, offsets, FP8, True, True, True, 0.0),
    )


def same_bytes(got, want) -> bool:
    """The outputs hold the same bytes (data) and bit patterns (scales)."""
    for a, b in zip(got, want, strict=True):
        if (a is None) != (b is None):
            return False
        if a is None:
            continue
        bits = torch.int32 if a.dtype == torch.float32 else torch.uint8
        if a.shape != b.shape or not torch.equal(a.view(bits), b.to(a.device).view(bits)):
            return False
    return True


def launcher_of(kind: str):
    """The FastLaunch of a kernel kind."""
    return {"1x128": bc._launch_1d, "128x128": bc._launch_2d}.get(kind, bc._launch_grouped)


def compiled_info(launcher, before: set) -> str:
    """Registers and spills of the kernels the launcher compiled since `before` (its keys)."""
    infos = []
    for key, kernel in launcher.compiled.items():
        if key not in before:
            regs, spills = getattr(kernel, "n_regs", None), getattr(kernel, "n_spills", None)
            infos.append(f"{regs}r/{spills}s")
    return ",".join(infos) or "-"


def sweep_case(kind: str, name: str, x: torch.Tensor, offsets, copy_ms: float, sweep) -> list:
    """One row per configuration of one kernel on x."""
    fn, reference = runner(kind, x, offsets)
    want = reference()
    numel = x.numel()
    scale_bytes = 2 * 4 * (numel // 128)  # both usages' fp32 scales (1x128; 128x128: less)
    moved = numel * (x.element_size() + 2) + (scale_bytes if kind != "128x128" else 0)
    copy_gbs = 2 * numel * x.element_size() / copy_ms / 1e6
    rows = []
    for cfg in sweep:
        row = {"kernel": kind, "case": name, "config": list(cfg)}
        launcher = launcher_of(kind)
        before = set(launcher.compiled)
        try:
            ok = same_bytes(fn(cfg), want)
            ms = gpu_ms(lambda cfg=cfg: fn(cfg), reps=20, inner=10)
        except Exception as exc:  # a benchmark reports, never stops
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
            rows.append(row)
            continue
        gbs = moved / ms / 1e6
        row.update(ms=ms, frac=gbs / copy_gbs, bytes="OK" if ok else "MISMATCH")
        row["regs"] = compiled_info(launcher, before)
        rows.append(row)
    del want
    return rows


def special_input(shape, dtype, seed: int) -> torch.Tensor:
    """Normal values of varied size with zero blocks, NaN, -NaN, inf and (fp32 / bf16) a row so
    small that fp8_max / amax overflows, on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, device="cuda", generator=gen) * 3
    flat = x.view(-1)
    flat[::7] *= 1e-3
    flat[::13] *= 300
    flat[::29] = 0.0
    x[0, :128] = 0.0
    x[1, 3], x[2, 1], x[-1, -1] = float("nan"), float("-inf"), -float("nan")
    if dtype != torch.float16:
        x[3] = torch.where(x[3] < 0, -1.5, 1.5) * 2.0**-126
    return x.to(dtype)


def special_check(kind: str, cfg) -> str:
    """A configuration on odd-shaped inputs with special values (each input dtype) against the
    torch reference on the CPU: OK or MISMATCH (and where)."""
    bad = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for shape, sizes in (((1031, 1500), [0, 5, 300, 1, 128, 597, 0]), ((256, 384), [256])):
            x = special_input(shape, dtype, seed=shape[0])
            offsets = offsets_of(sizes, "cuda") if kind == "grouped" else None
            fn, _ = runner(kind, x, offsets)
            _, reference = runner(kind, x.cpu(), None if offsets is None else offsets.cpu())
            try:
                if not same_bytes(fn(cfg), reference()):
                    bad.append(f"{dtype} {shape}")
            except Exception as exc:
                bad.append(f"{dtype} {shape} {type(exc).__name__}: {str(exc)[:80]}")
    return "OK" if not bad else "MISMATCH " + "; ".join(bad)


def run_cases(quick: bool) -> tuple[list[dict], dict]:
    """(rows of every case and configuration, copy ms per shape)."""
    cases = [("1x128", "8192x8192"), ("128x128", "8192x8192")]
    if not quick:
        cases += [("1x128", "32768x4096"), ("128x128", "32768x4096")]
        cases += [("grouped", "32768x4096 8 groups"), ("grouped", "32768x4096 8 odd groups")]
        cases += [("grouped", "32768x4096 8 groups of 16")]
    rows, copies = [], {}
    for kind, name in cases:
        shape = (8192, 8192) if name.startswith("8192") else (32768, 4096)
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        key = f"{shape[0]}x{shape[1]}"
        if key not in copies:
            copies[key] = gpu_ms(lambda x=x: x.clone(), reps=20, inner=10)
        offsets = None
        if kind == "grouped":
            sizes = GROUP_SIZES_16 if name.endswith("of 16") else GROUP_SIZES
            offsets = offsets_of(ODD_GROUP_SIZES if "odd" in name else sizes, "cuda")
        sweep = SWEEP_GROUPED if kind == "grouped" else SWEEP
        rows += sweep_case(kind, name, x, offsets, copies[key], sweep)
        del x
        torch.cuda.empty_cache()
    return rows, copies


def print_rows(rows: list[dict], copies: dict) -> None:
    print("\ncopy (x.clone()): " + ", ".join(f"{k} {ms:.4f} ms" for k, ms in copies.items()))
    head = f"{'kernel':8s} {'case':24s} {'config':12s} {'ms':>8s} {'of copy':>8s}"
    print(f"{head} {'bytes':>8s}  regs/spills")
    for r in rows:
        head = f"{r['kernel']:8s} {r['case']:24s} {tuple(r['config'])!s:12s}"
        if "error" in r:
            print(f"{head} {r['error']}")
            continue
        print(f"{head} {r['ms']:8.4f} {r['frac']:8.3f} {r['bytes']:>8s}  {r['regs']}")


def pick_best(rows: list[dict]) -> dict:
    """Per kernel, the configuration with the highest worst-case fraction of copy over the
    kernel's cases (configurations whose bytes matched, timed in every case)."""
    best = {}
    for kind in ("1x128", "128x128", "grouped"):
        by_cfg: dict[tuple, list[float]] = {}
        for r in rows:
            if r["kernel"] == kind and r.get("bytes") == "OK":
                by_cfg.setdefault(tuple(r["config"]), []).append(r["frac"])
        if not by_cfg:
            continue
        most = max(map(len, by_cfg.values()))
        full = {c: f for c, f in by_cfg.items() if len(f) == most}
        cfg = max(full, key=lambda c: min(full[c]))
        best[kind] = {"config": list(cfg), "fracs": full[cfg], "default": list(DEFAULTS[kind])}
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--quick", action="store_true", help="8192 x 8192 only, no grouped")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("block_quantize benchmark: no CUDA device, nothing measured")
        return 1
    import triton

    device = torch.cuda.get_device_name()
    print(f"{device}, torch {torch.__version__}, triton {triton.__version__}")
    start = time.time()
    rows, copies = run_cases(args.quick)
    print_rows(rows, copies)
    best = pick_best(rows)
    print("\nbest config per kernel (highest worst-case fraction of copy over its cases):")
    for kind, b in best.items():
        b["special_bytes"] = special_check(kind, tuple(b["config"]))
        fracs = " ".join(f"{f:.3f}" for f in b["fracs"])
        print(
            f"  {kind:8s} {tuple(b['config'])!s:12s} of copy {fracs} (default now "
            f"{tuple(b['default'])}); special-value bytes vs CPU: {b['special_bytes']}"
        )
    print(f"\n{time.time() - start:.0f} s")
    if args.json:
        result = {"device": device, "torch": torch.__version__, "triton": triton.__version__}
        result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        with open(args.json, "w") as f:
            result.update(copy_ms=copies, rows=rows, best=best)
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
