"""The short table that ends benchmarks/multi_gpu_session.sh: each 2-GPU target with its
measured value and whether it is met, read from the files the session wrote into one folder.

    python benchmarks/multi_gpu_summary.py OUT

Reads OUT/pytest_gpu2.log (the gpu-marked distributed tests), OUT/tp2.json
(benchmarks/tensor_parallel.py --json), OUT/fsdp2.json (benchmarks/fsdp.py --json) and the
training runs' OUT/train_<name>/losses.csv (1gpu_a, 1gpu_b: two one-GPU runs, whose
difference is the run-to-run spread; fsdp2, tp2: the 2-GPU runs). A missing file is reported
as such, never guessed. Prints only; never asserts.
"""

from __future__ import annotations

import csv
import json
import re
import sys
from pathlib import Path

EFFICIENCY = 0.90  # scaling efficiency target
FP8_SPEEDUP = 1.3  # FP8 tokens/s over bf16's under FSDP2
BYTES_RATIO = 0.5  # FP8 all-gather bytes over bf16's
BYTES_SLACK = 0.05  # biases and norm parameters still move in high precision


def _json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "MISSED")


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


def tp_rows(out: Path) -> list[tuple[str, str, bool | None]]:
    """Tensor parallel: efficiency of each mode, FP8's forward-gather bytes over bf16's."""
    data = _json(out / "tp2.json")
    if data is None:
        return [("TP=2 + SP benchmark", "no tp2.json", None)]
    rows = []
    for name, r in data["mlp"].items():
        eff = r["baseline_ms"] / r["ms"]
        rows.append((f"TP LayerNormMLP {name} efficiency", f"{eff:.1%}", eff >= EFFICIENCY))
    pair = dict(data["linear_pair_ms"])
    base = pair.pop("1 GPU, 1/P work")
    for name, ms in pair.items():
        eff = base / ms
        rows.append((f"TP Linear pair, {name} efficiency", f"{eff:.1%}", eff >= EFFICIENCY))
    bf16, fp8 = data["mlp"]["bf16"]["gather_bytes"], data["mlp"]["fp8 current"]["gather_bytes"]
    ratio = fp8 / bf16 if bf16 else None
    ok = None if ratio is None else ratio <= BYTES_RATIO * (1 + BYTES_SLACK)
    value = "no bytes" if ratio is None else f"{ratio:.2f}"
    rows.append(("TP FP8 gather bytes / bf16's (0.5)", value, ok))
    return rows


def fsdp_rows(out: Path) -> list[tuple[str, str, bool | None]]:
    """FSDP2: efficiency per config, FP8 all-gather bytes over bf16's, FP8 tokens/s gain."""
    data = _json(out / "fsdp2.json")
    if data is None:
        return [("FSDP2 benchmark", "no fsdp2.json", None)]
    by_name = {r["config"]: r for r in data["rows"]}
    rows = []
    for name, r in by_name.items():
        rows.append(
            (f"FSDP2 {name} efficiency", f"{r['efficiency']:.1%}", r["efficiency"] >= EFFICIENCY)
        )
        peak = f"{r['peak_bytes'] / 2**30:.2f} GiB"
        rows.append((f"FSDP2 {name} peak memory", peak, None))
    bf16 = by_name.get("bf16")
    gathered = [r for n, r in by_name.items() if n.endswith("fp8 all-gather")]
    if bf16 and gathered:
        ratio = max(r["all_gather_bytes"] for r in gathered) / bf16["all_gather_bytes"]
        ok = ratio <= BYTES_RATIO * (1 + BYTES_SLACK)
        rows.append(("FSDP2 FP8 all-gather bytes / bf16's (0.5)", f"{ratio:.2f}", ok))
    fp8 = [r for n, r in by_name.items() if n != "bf16"]
    if bf16 and fp8:
        best = max(fp8, key=lambda r: r["tokens_per_s"])
        gain = best["tokens_per_s"] / bf16["tokens_per_s"]
        value = f"{gain:.2f}x ({best['config']})"
        rows.append(("FSDP2 FP8 tokens/s / bf16's (1.3x)", value, gain >= FP8_SPEEDUP))
    return rows


def final_val_loss(path: Path) -> float | None:
    """The last validation loss in a training run's losses.csv, or None."""
    if not path.is_file():
        return None
    with path.open() as f:
        values = [float(row["val_loss"]) for row in csv.DictReader(f) if row["val_loss"]]
    return values[-1] if values else None


def loss_rows(out: Path) -> list[tuple[str, str, bool | None]]:
    """2-GPU final validation losses against the one-GPU runs' mean, within their spread."""
    ones = [final_val_loss(out / f"train_{n}" / "losses.csv") for n in ("1gpu_a", "1gpu_b")]
    ones = [v for v in ones if v is not None]
    if not ones:
        return [("training losses", "no one-GPU losses.csv", None)]
    mean, spread = sum(ones) / len(ones), max(ones) - min(ones)
    rows = [("1 GPU final val loss (spread)", f"{mean:.4f} ({spread:.4f})", None)]
    for name in ("fsdp2", "tp2"):
        loss = final_val_loss(out / f"train_{name}" / "losses.csv")
        if loss is None:
            rows.append((f"{name} final val loss", "no losses.csv", None))
            continue
        ok = abs(loss - mean) <= spread if len(ones) > 1 else None
        rows.append((f"{name} final val loss (diff)", f"{loss:.4f} ({loss - mean:+.4f})", ok))
    return rows


def main(argv: list[str]) -> None:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        sys.exit("usage: python benchmarks/multi_gpu_summary.py OUT (the session's folder)")
    out = Path(argv[0])
    rows = tests_rows(out) + tp_rows(out) + fsdp_rows(out) + loss_rows(out)
    width = max(len(r[0]) for r in rows)
    print(f"{'target':{width}s}  {'measured':>28s}  verdict")
    for name, value, ok in rows:
        print(f"{name:{width}s}  {value:>28s}  {_verdict(ok)}")


if __name__ == "__main__":
    main(sys.argv[1:])
