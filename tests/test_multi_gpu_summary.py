"""benchmarks/multi_gpu_summary.py on fake session folders of 2 and 4 ranks: it reads the files
named for the session's rank count P, says P in its rows and divides tokens/s per GPU by P."""

from __future__ import annotations

import csv
import importlib.util
import json
import re
from pathlib import Path

import pytest

SUMMARY_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "multi_gpu_summary.py"
CSV_FIELDS = ("recipe", "step", "train_loss", "val_loss", "tokens_per_s", "elapsed_s")
ONE_GPU_TOKENS_PER_S = 1000.0
FSDP_TOKENS_PER_S = 3000.0  # the P-GPU FSDP run's tokens/s, all ranks together


def _load_summary():
    spec = importlib.util.spec_from_file_location("multi_gpu_summary", SUMMARY_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


summary = _load_summary()


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data))


def _write_losses(run: Path, final_val_loss: float, tokens_per_s: float) -> None:
    """A training run's losses.csv: two validation steps, the last one at final_val_loss."""
    run.mkdir(parents=True)
    with (run / "losses.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for step, val in ((50, final_val_loss + 0.5), (100, final_val_loss)):
            row = {"recipe": "delayed", "step": step, "train_loss": val, "val_loss": val}
            writer.writerow(row | {"tokens_per_s": tokens_per_s, "elapsed_s": step / 10})


def _fsdp_result(sequences_per_rank: int) -> dict:
    """benchmarks/fsdp.py --json: a bf16 row and an FP8 row gathered as FP8."""
    row = {"efficiency": 0.95, "peak_bytes": 2**31, "tokens_per_s": 100.0}
    return {
        "tokens_per_rank": sequences_per_rank * 1024,
        "model": {"seq_len": 1024},
        "rows": [
            row | {"config": "bf16", "recipe": "bf16", "gather": "bf16", "all_gather_bytes": 1000},
            row
            | {"config": "delayed fp8-gather", "recipe": "delayed", "gather": "fp8"}
            | {"all_gather_bytes": 500, "tokens_per_s": 140.0},
        ],
    }


def write_session(out: Path, nproc: int) -> None:
    """The files a session over nproc ranks writes, plus files of other rank counts that the
    summary must leave alone (their rows would say 99/rank)."""
    (out / "pytest_gpu2.log").write_text("12 passed in 30.0s\npytest exit: 0\n")
    mlp_row = {"ms": 1.0, "baseline_ms": 0.96, "bytes": 4096}
    _write_json(
        out / f"tp{nproc}.json",
        {
            "mlp": {
                "bf16, plain": mlp_row | {"gather_bytes": 2000},
                "fp8 current, plain": mlp_row | {"gather_bytes": 1000},
            },
            "linear_pair_ms": {"1 GPU, 1/P work": 1.0, "te collectives": 1.05},
        },
    )
    _write_json(out / f"fsdp{nproc}_b16.json", _fsdp_result(16))
    strays = ["fsdp24_b16.json", f"fsdp{nproc}k.json"]
    strays += [f"fsdp{other}_b16.json" for other in (2, 4, 8) if other != nproc]
    for stray in strays:
        _write_json(out / stray, _fsdp_result(99))
    ep = {"baseline_ms": 1.0, "overlap_ms": 1.1, "no_overlap_ms": 1.3}
    _write_json(out / f"ep{nproc}.json", {"results": {"bf16": ep}})
    cp = {comm: {"ms": 1.0, "efficiency": 0.93} for comm in ("p2p", "a2a", "all_gather")}
    _write_json(out / f"cp{nproc}.json", {"cp": cp})
    _write_losses(out / "train_1gpu_a", 3.00, ONE_GPU_TOKENS_PER_S)
    _write_losses(out / "train_1gpu_b", 3.02, ONE_GPU_TOKENS_PER_S)
    _write_losses(out / f"train_fsdp{nproc}", 3.005, FSDP_TOKENS_PER_S)
    _write_losses(out / f"train_tp{nproc}", 3.05, 500.0)
    _write_losses(out / f"train_cp{nproc}", 3.015, 500.0)
    _write_losses(out / "train_1moe_a", 2.90, 800.0)
    _write_losses(out / "train_1moe_b", 2.94, 800.0)
    _write_losses(out / f"train_ep{nproc}", 2.92, 1500.0)
    _write_losses(out / f"train_ep{nproc}f", 2.93, 1500.0)


def printed_rows(capsys, argv: list[str]) -> dict[str, tuple[str, str]]:
    """{row label: (measured, verdict)} of the table main prints."""
    summary.main(argv)
    lines = capsys.readouterr().out.splitlines()
    assert re.split(r"\s{2,}", lines[0].strip()) == ["target", "measured", "verdict"]
    rows = {}
    for line in lines[1:]:
        label, value, verdict = re.split(r"\s{2,}", line.strip())
        rows[label] = (value, verdict)
    return rows


@pytest.mark.parametrize("nproc", [2, 4])
def test_rows_name_the_rank_count_and_divide_by_it(tmp_path, capsys, nproc):
    write_session(tmp_path, nproc)
    (tmp_path / "device.txt").write_text(f"0, NVIDIA H100\ntorch 2.9\nnproc {nproc}\n")
    rows = printed_rows(capsys, [str(tmp_path)])

    assert rows["gpu distributed tests pass"] == ("12 passed", "met")
    assert rows["TP LayerNormMLP bf16, plain efficiency (90%)"] == ("96.0%", "met")
    assert rows["TP FP8 gather bytes / bf16's (0.5)"] == ("0.50", "met")
    assert rows["FSDP2 16/rank bf16 efficiency"] == ("95.0%", "met")
    assert rows["FSDP2 16/rank FP8 gather bytes / bf16's"] == ("0.50", "met")
    assert rows["FSDP2 16/rank FP8 tokens/s / bf16's"] == ("1.40x (delayed fp8-gather)", "met")
    assert not [label for label in rows if "99/rank" in label]  # other rank counts' files
    assert rows["EP MoE bf16 efficiency"] == ("90.9%", "met")
    assert rows["CP attention p2p efficiency"] == ("93.0%", "met")
    assert rows[f"cp{nproc} (--cp {nproc}) final val loss"] == ("3.0150", "n/a")
    moe = "one-GPU MoE 2 runs 2.9000-2.9400"
    assert rows[f"ep{nproc} final val loss, {moe}"] == ("2.9200", "met")
    assert rows[f"ep{nproc}f final val loss, {moe}"] == ("2.9300", "met")
    assert rows[f"fsdp{nproc} final val loss (diff)"] == ("3.0050 (-0.0050)", "met")
    assert rows[f"tp{nproc} final val loss (diff)"] == ("3.0500 (+0.0400)", "MISSED")
    assert rows[f"fsdp{nproc}k final val loss"] == ("no losses.csv", "n/a")

    per_gpu = FSDP_TOKENS_PER_S / nproc / ONE_GPU_TOKENS_PER_S  # 1.50 at 2 ranks, 0.75 at 4
    value, verdict = rows[f"fsdp{nproc} tokens/s per GPU / 1 GPU a's"]
    assert value == f"{per_gpu:.2f} (3,000 / {nproc} vs 1,000)"
    assert verdict == ("met" if per_gpu >= 0.9 else "MISSED")

    other = 4 if nproc == 2 else 2
    for label in rows:
        assert not re.search(rf"\b(fsdp|tp|ep|cp){other}|[A-Z]+={other}\b", label), label


@pytest.mark.parametrize("nproc", [2, 4])
def test_missing_files_are_named_for_the_rank_count(tmp_path, capsys, nproc):
    rows = printed_rows(capsys, [str(tmp_path), "--nproc", str(nproc)])
    assert rows[f"TP={nproc} + SP benchmark"] == (f"no tp{nproc}.json", "n/a")
    assert rows[f"FSDP2 benchmark over {nproc} GPUs"] == (f"no fsdp{nproc}_b*.json", "n/a")
    assert rows[f"EP={nproc} MoE benchmark"] == (f"no ep{nproc}.json", "n/a")
    assert rows[f"CP={nproc} attention benchmark"] == (f"no cp{nproc}.json", "n/a")


def test_nproc_argument_overrides_device_txt(tmp_path, capsys):
    write_session(tmp_path, 4)
    (tmp_path / "device.txt").write_text("nproc 2\n")
    assert summary.session_nproc(tmp_path) == 2
    rows = printed_rows(capsys, [str(tmp_path), "--nproc", "4"])
    assert rows["fsdp4 tokens/s per GPU / 1 GPU a's"] == ("0.75 (3,000 / 4 vs 1,000)", "MISSED")
    assert "TP=4 + SP benchmark" not in rows  # tp4.json was read


def test_rank_count_defaults_to_two(tmp_path):
    assert summary.session_nproc(tmp_path) == 2  # no device.txt
    (tmp_path / "device.txt").write_text("0, NVIDIA H100\nnproc\ntorch 2.9 gpus 4\n")
    assert summary.session_nproc(tmp_path) == 2  # no "nproc P" line
    (tmp_path / "device.txt").write_text("0, NVIDIA H100\nnproc 8\n")
    assert summary.session_nproc(tmp_path) == 8
