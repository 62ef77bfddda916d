"""The short table that ends benchmarks/multi_gpu_session.sh: each P-GPU target with its
measured value and whether it is met, read from the files the session wrote into one folder.

    python benchmarks/multi_gpu_summary.py OUT [--nproc P]

P, the session's rank count (its NPROC): --nproc, else the line "nproc P" of OUT/device.txt,
else 2. Reads OUT/pytest_gpu2.log (the gpu-marked distributed tests, 2 ranks whatever P),
OUT/tpP.json (benchmarks/tensor_parallel.py --json), OUT/fsdpP_b*.json (benchmarks/fsdp.py
--json, one per batch size), OUT/epP.json (benchmarks/expert_parallel.py --json), OUT/cpP.json
(benchmarks/context_parallel.py --json) and the training runs' OUT/train_<name>/losses.csv
(1gpu_a, 1gpu_b and any more 1gpu_*: one-GPU runs, whose spread is the run-to-run spread;
fsdpP, fsdpPk, tpP: the P-GPU runs; epP, epPf, epPt: an MoE model against the one-GPU 1moe_*
runs; cpP: --cp P). With P = 2 the names are tp2.json, fsdp2_b16.json, train_fsdp2 and so on.
A missing file is reported as such, never guessed. Prints only; never asserts.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import sys
from pathlib import Path

DEFAULT_NPROC = 2  # the rank count when neither --nproc nor device.txt gives one
TP_FP8_EFFICIENCY = 0.95  # TP=P + SP FP8 LayerNormMLP with the collectives under the GEMMs
EFFICIENCY = 0.90  # scaling efficiency target
EP_EFFICIENCY = 0.85  # expert parallelism's target (its all-to-alls move every routed row)
CP_EFFICIENCY = 0.90  # context parallelism's target for p2p and a2a (attention at 32K tokens)
FP8_SPEEDUP = 1.3  # FP8 tokens/s over bf16's under FSDP2
BYTES_RATIO = 0.5  # FP8 all-gather bytes over bf16's
BYTES_SLACK = 0.05  # biases and norm parameters still move in high precision


def _json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "MISSED")


def session_nproc(out: Path) -> int:
    """The rank count the session wrote into OUT/device.txt ("nproc P"), else DEFAULT_NPROC."""
    device = out / "device.txt"
    found = re.search(r"^nproc (\d+)\s*$", device.read_text(), re.M) if device.is_file() else None
    return int(found.group(1)) if found else DEFAULT_NPROC


def tests_rows(out: Path) -> list[tuple[str, str, bool | None]]:
    """The pytest summary line ("N passed, M failed ...") and pytest's exit status."""
    log = out / "pytest_gpu2.log"
    if not log.is_file():
        return [("gpu distributed tests", "no log", None)]
    text = log.read_text()
    counts = re.findall(r"(\d+) (passed|failed|errors?|skipped)", text)
    seen = {kind: int(n) for n, kind in counts}
    status = re.search(r"pytest exit: (\d+)", text)
    value = ", ".join(f"{n} {kind}" for kind, n in seen.items()) or "no summary"
    ok = bool(status) and status.group(1) == "0" and seen.get("passed", 0) > 0
    return [("gpu distributed tests pass", value, ok)]


def tp_rows(out: Path, nproc: int) -> list[tuple[str, str, bool | None]]:
    """Tensor parallel over nproc ranks: efficiency of each mode, FP8's forward-gather bytes
    over bf16's."""
    data = _json(out / f"tp{nproc}.json")
    if data is None:
        return [(f"TP={nproc} + SP benchmark", f"no tp{nproc}.json", None)]
    rows = []
    for name, r in data["mlp"].items():
        eff = r["baseline_ms"] / r["ms"]
        target = TP_FP8_EFFICIENCY if "fp8" in name and "overlap" in name else EFFICIENCY
        label = f"TP LayerNormMLP {name} efficiency ({target:.0%})"
        rows.append((label, f"{eff:.1%}", eff >= target))
    pair = dict(data["linear_pair_ms"])
    base = pair.pop("1 GPU, 1/P work", float("nan"))
    for name, ms in pair.items():
        eff = base / ms
        rows.append((f"TP Linear pair, {name} efficiency", f"{eff:.1%}", eff >= EFFICIENCY))
    mlp = data["mlp"]
    bf16 = mlp.get("bf16, plain", mlp.get("bf16", {})).get("gather_bytes", 0)
    fp8 = mlp.get("fp8 current, plain", mlp.get("fp8 current", {})).get("gather_bytes", 0)
    ratio = fp8 / bf16 if bf16 else None
    ok = None if ratio is None else ratio <= BYTES_RATIO * (1 + BYTES_SLACK)
    value = "no bytes" if ratio is None else f"{ratio:.2f}"
    rows.append(("TP FP8 gather bytes / bf16's (0.5)", value, ok))
    return rows


def fsdp_rows(out: Path, nproc: int) -> list[tuple[str, str, bool | None]]:
    """FSDP2 (fully_shard) over nproc ranks, per fsdpP_b*.json (one per batch size):
    efficiency per config, FP8 all-gather bytes over the bf16 gather's, FP8 tokens/s over the
    faster bf16 row's."""
    pattern = f"fsdp{nproc}_b*.json"
    paths = sorted(out.glob(pattern), key=lambda p: (len(p.name), p.name))
    if not paths:
        return [(f"FSDP2 benchmark over {nproc} GPUs", f"no {pattern}", None)]
    return [row for path in paths for row in _fsdp_file_rows(_json(path))]


def _fsdp_file_rows(data: dict) -> list[tuple[str, str, bool | None]]:
    per_rank = data["tokens_per_rank"] // data["model"]["seq_len"]
    rows = []
    for r in data["rows"]:
        name = f"{per_rank}/rank {r['config']}"
        rows.append(
            (f"FSDP2 {name} efficiency", f"{r['efficiency']:.1%}", r["efficiency"] >= EFFICIENCY)
        )
        peak = f"{r['peak_bytes'] / 2**30:.2f} GiB"
        rows.append((f"FSDP2 {name} peak memory", peak, None))
    bf16 = [r for r in data["rows"] if r["recipe"] == "bf16"]
    bf16_gather = next((r for r in bf16 if r["gather"] == "bf16"), None)
    gathered = [r for r in data["rows"] if r["gather"] == "fp8"]
    if bf16_gather and gathered:
        ratio = max(r["all_gather_bytes"] for r in gathered) / bf16_gather["all_gather_bytes"]
        ok = ratio <= BYTES_RATIO * (1 + BYTES_SLACK)
        rows.append((f"FSDP2 {per_rank}/rank FP8 gather bytes / bf16's", f"{ratio:.2f}", ok))
    fp8 = [r for r in data["rows"] if r["recipe"] != "bf16"]
    if bf16 and fp8:
        best, fastest_bf16 = (max(rs, key=lambda r: r["tokens_per_s"]) for rs in (fp8, bf16))
        gain = best["tokens_per_s"] / fastest_bf16["tokens_per_s"]
        value = f"{gain:.2f}x ({best['config']})"
        rows.append((f"FSDP2 {per_rank}/rank FP8 tokens/s / bf16's", value, gain >= FP8_SPEEDUP))
    return rows


def ep_rows(out: Path, nproc: int) -> list[tuple[str, str, bool | None]]:
    """Expert parallelism over nproc ranks: efficiency per recipe with the shared expert's
    overlap (the target) and without it; the EP=P training runs' final validation losses
    where they ran."""
    data = _json(out / f"ep{nproc}.json")
    rows = []
    if data is None:
        rows.append((f"EP={nproc} MoE benchmark", f"no ep{nproc}.json", None))
    else:
        for name, r in data["results"].items():
            eff = r["baseline_ms"] / r["overlap_ms"]
            rows.append((f"EP MoE {name} efficiency", f"{eff:.1%}", eff >= EP_EFFICIENCY))
            plain = r["baseline_ms"] / r["no_overlap_ms"]
            rows.append((f"EP MoE {name} efficiency, no overlap", f"{plain:.1%}", None))
    moe = [r[max(r)] for r in map(val_losses, sorted(out.glob("train_1moe_*/losses.csv"))) if r]
    for suffix in ("", "f", "t"):  # epPf: with --fsdp; epPt: with --tp P --sequence-parallel
        name = f"ep{nproc}{suffix}"
        run = val_losses(out / f"train_{name}" / "losses.csv")
        if not run:
            continue
        loss = run[max(run)]
        if not moe:
            rows.append((f"{name} final val loss (no one-GPU MoE run)", f"{loss:.4f}", None))
            continue
        low, high = min(moe), max(moe)
        ok = low <= loss <= high if len(moe) > 1 else None
        label = f"{name} final val loss, one-GPU MoE {len(moe)} runs {low:.4f}-{high:.4f}"
        rows.append((label, f"{loss:.4f}", ok))
    return rows


def cp_rows(out: Path, nproc: int) -> list[tuple[str, str, bool | None]]:
    """Context parallelism over nproc ranks: efficiency per cp_comm_type (target
    CP_EFFICIENCY for p2p and a2a); the --cp P training run's final validation loss where it
    ran."""
    data = _json(out / f"cp{nproc}.json")
    rows = []
    if data is None:
        rows.append((f"CP={nproc} attention benchmark", f"no cp{nproc}.json", None))
    else:
        for comm, r in data["cp"].items():
            eff = r["efficiency"]
            target = eff >= CP_EFFICIENCY if comm in ("p2p", "a2a") else None
            rows.append((f"CP attention {comm} efficiency", f"{eff:.1%}", target))
    run = val_losses(out / f"train_cp{nproc}" / "losses.csv")
    if run:
        rows.append((f"cp{nproc} (--cp {nproc}) final val loss", f"{run[max(run)]:.4f}", None))
    return rows


def val_losses(path: Path) -> dict[int, float]:
    """{step: validation loss} of a training run's losses.csv ({} without the file)."""
    if not path.is_file():
        return {}
    with path.open() as f:
        rows = [row for row in csv.DictReader(f) if row["val_loss"]]
    return {int(row["step"]): float(row["val_loss"]) for row in rows}


def tokens_per_s(path: Path) -> float | None:
    """The median tokens/s of a training run's logged rows (None without the file or rows)."""
    if not path.is_file():
        return None
    with path.open() as f:
        rows = [row["tokens_per_s"] for row in csv.DictReader(f)]
    speeds = sorted(v for v in (float(x) for x in rows if x) if math.isfinite(v))
    return speeds[len(speeds) // 2] if speeds else None


def _largest_gap(a: dict[int, float], b: dict[int, float]) -> float:
    """The largest |a - b| over the validation steps both runs reached."""
    return max((abs(a[s] - b[s]) for s in a.keys() & b.keys()), default=float("nan"))


def loss_rows(out: Path, nproc: int) -> list[tuple[str, str, bool | None]]:
    """P-GPU final validation losses against the one-GPU runs' mean (runs train_1gpu_*: a, b,
    and any more), within their spread (largest - smallest); and the largest gap along the
    validation curve against one-GPU run a, beside run b's own."""
    runs = {p.parent.name: val_losses(p) for p in sorted(out.glob("train_1gpu_*/losses.csv"))}
    ones = [run[max(run)] for run in runs.values() if run]
    if not ones or not runs.get("train_1gpu_a"):
        return [("training losses", "no one-GPU losses.csv (train_1gpu_a)", None)]
    mean, spread = sum(ones) / len(ones), max(ones) - min(ones)
    label = f"1 GPU final val loss, {len(ones)} runs (spread)"
    rows = [(label, f"{mean:.4f} ({spread:.4f})", None)]
    curve_spread = _largest_gap(runs["train_1gpu_a"], runs.get("train_1gpu_b", {}))
    rows.append(("1 GPU a vs b, largest val gap", f"{curve_spread:.4f}", None))
    one_gpu = tokens_per_s(out / "train_1gpu_a" / "losses.csv")
    for name in (f"fsdp{nproc}", f"fsdp{nproc}k", f"tp{nproc}", f"cp{nproc}"):
        run = val_losses(out / f"train_{name}" / "losses.csv")
        if not run:
            rows.append((f"{name} final val loss", "no losses.csv", None))
            continue
        loss = run[max(run)]
        ok = abs(loss - mean) <= spread if len(ones) > 1 else None
        rows.append((f"{name} final val loss (diff)", f"{loss:.4f} ({loss - mean:+.4f})", ok))
        gap = _largest_gap(run, runs["train_1gpu_a"])
        rows.append((f"{name} vs 1 GPU a, largest val gap", f"{gap:.4f}", None))
        speed = tokens_per_s(out / f"train_{name}" / "losses.csv")
        if name.startswith("fsdp") and speed and one_gpu:  # the target: within 10% per GPU
            ratio = speed / nproc / one_gpu
            value = f"{ratio:.2f} ({speed:,.0f} / {nproc} vs {one_gpu:,.0f})"
            rows.append((f"{name} tokens/s per GPU / 1 GPU a's", value, ratio >= 0.9))
    return rows


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="The multi-GPU session's table of targets.")
    parser.add_argument("out", type=Path, help="the session's folder (its WORK)")
    parser.add_argument(
        "--nproc", type=int, help="the session's rank count (default: device.txt's, else 2)"
    )
    args = parser.parse_args(argv)
    if not args.out.is_dir():
        parser.error(f"{args.out} is not a folder")
    out = args.out
    nproc = args.nproc if args.nproc is not None else session_nproc(out)
    if nproc < 1:
        parser.error(f"--nproc must be at least 1, not {nproc}")
    rows = tests_rows(out) + tp_rows(out, nproc) + fsdp_rows(out, nproc)
    rows += ep_rows(out, nproc) + cp_rows(out, nproc) + loss_rows(out, nproc)
    width = max(len(r[0]) for r in rows)
    print(f"{'target':{width}s}  {'measured':>28s}  verdict")
    for name, value, ok in rows:
        print(f"{name:{width}s}  {value:>28s}  {_verdict(ok)}")


if __name__ == "__main__":
    main(sys.argv[1:])
