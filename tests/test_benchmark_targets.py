"""The benchmarks' targets are set for a GPU: a run on the CPU (benchmarks/linear.py --quick,
a --cpu-check of benchmarks/contenders.py's tables) shows them as GPU targets with a note,
never as ok / MISS, while a run on a GPU gives each its verdict."""

from __future__ import annotations

import argparse

import pytest
from benchmark_modules import import_benchmark as _benchmark


@pytest.fixture(scope="module")
def contenders():
    return _benchmark("contenders")


@pytest.fixture(scope="module")
def linear():
    return _benchmark("linear")


def _contender_rows() -> list[dict]:
    """A case of three rows: the baseline, one over its target, one with no target."""
    row = {"section": 1, "case": "block", "unit": "ms", "status": "ok", "baseline": False}
    return [
        {**row, "impl": "torch", "baseline": True, "target": None, "value": 1.0, "ratio": 1.0},
        {**row, "impl": "te fp8", "target": 0.8, "value": 1.2, "ratio": 1.2},
        {**row, "impl": "te bf16", "target": None, "value": 0.9, "ratio": 0.9},
    ]


def test_contender_targets_get_a_verdict_only_on_a_gpu(contenders) -> None:
    over, under = {"target": 1.03, "ratio": 1.2}, {"target": 1.03, "ratio": 0.9}
    assert contenders.cell_target(over) == "<=1.03 MISS"
    assert contenders.cell_target(under) == "<=1.03 ok"
    assert contenders.cell_target({"target": 1.03}) == "<=1.03"  # not measured
    for row in (over, under, {"target": 1.03}):
        assert contenders.cell_target(row, on_gpu=False) == "<=1.03 (GPU target)"
    assert contenders.cell_target({"target": None, "ratio": 1.2}, on_gpu=False) == ""


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_contender_table_on_the_cpu_says_the_targets_are_for_a_gpu(
    contenders, device: str, capsys: pytest.CaptureFixture
) -> None:
    contenders.print_table(_contender_rows(), argparse.Namespace(device=device))
    out = capsys.readouterr().out
    if device == "cpu":
        table, note = out.rstrip().rsplit("\n", 1)
        assert note == contenders.GPU_TARGETS_NOTE
        assert "MISS" not in table and " ok" not in table
        assert "<=0.80 (GPU target)" in table
    else:
        assert "<=0.80 MISS" in out and "GPU target" not in out


def _linear_results() -> list[dict]:
    """Figures of benchmarks/linear.py's four configs, ratios added as it adds them."""
    return [
        {"name": name, "host_fwd_us": us, "host_fwd_bwd_us": 2 * us, "tflops": tflops}
        for name, us, tflops in (
            ("torch bf16", 36.0, 0.16),
            ("te bf16", 29.0, 0.15),
            ("te fp8 delayed", 395.0, 0.03),
            ("te fp8 current", 352.0, 0.03),
        )
    ]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_linear_quick_on_the_cpu_prints_gpu_targets_not_misses(
    linear, device: str, capsys: pytest.CaptureFixture
) -> None:
    results = _linear_results()
    linear.add_ratios(results)
    args = argparse.Namespace(host_shape=(16, 64, 64), gemm_shape=(256, 256, 256), device=device)
    linear.print_table(results, args)
    out = capsys.readouterr().out
    fp8 = next(line for line in out.splitlines() if line.startswith("te fp8 delayed"))
    if device == "cpu":
        table, note = out.rstrip().rsplit("\n", 1)
        assert note == linear.GPU_TARGETS_NOTE
        assert "MISS" not in table and " ok" not in table
        assert "(10.97x, GPU target <=1.5)" in fp8 and "(0.19x, GPU target >=1.6)" in fp8
    else:
        assert "(10.97x <=1.5 MISS)" in fp8 and "(0.19x >=1.6 MISS)" in fp8
        assert "GPU target" not in out and "<=1.1 ok" in out
