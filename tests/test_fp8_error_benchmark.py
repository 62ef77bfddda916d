"""benchmarks/fp8_error.py on the CPU: each FP8 recipe's outputs and gradients of a tiny
te.TransformerLayer (and of the same block built from te modules) are near, but not equal to,
the block's without FP8, the two builds alike; the saved tables compare side by side."""

from __future__ import annotations

import pytest
from benchmark_modules import import_benchmark

TINY = (64, 128, 2, 2, 16)  # hidden, ffn, heads, batch, seq


@pytest.fixture(scope="module")
def fp8_error():
    """benchmarks/fp8_error.py."""
    return import_benchmark("fp8_error")


@pytest.mark.parametrize(("model", "fc1"), [("layer", "layernorm_mlp"), ("block", "mlp")])
def test_fp8_errors_are_small_and_not_zero(fp8_error, model, fc1):
    table = fp8_error.errors(TINY, "cpu", model)
    assert set(table) == set(fp8_error.RECIPES)
    for recipe, errors in table.items():
        assert {"output", "input grad", f"grad {fc1}.fc1_weight"} <= set(errors)
        # FP8 changes the output, by about E4M3's precision, not more
        assert 0 < errors["output"] < 0.1, (recipe, errors["output"])
        assert 0 < errors[f"grad {fc1}.fc1_weight"] < 0.3, recipe


def test_transformer_layer_has_the_fp8_errors_of_its_modules(fp8_error):
    """te.TransformerLayer computes what the block of te modules computes (the same seeded
    weights), so under FP8 its output and input gradient are as far from bf16's."""
    layer = fp8_error.errors(TINY, "cpu", "layer")
    block = fp8_error.errors(TINY, "cpu", "block")
    for recipe in fp8_error.RECIPES:
        for tensor in ("output", "input grad"):
            assert layer[recipe][tensor] == pytest.approx(block[recipe][tensor], rel=1e-3)


def test_saved_runs_compare_side_by_side(fp8_error, tmp_path, capsys):
    table = {"delayed": {"output": 0.25, "input grad": 0.5}}
    fp8_error.torch.save(table, tmp_path / "before.pt")
    table["delayed"]["output"] = 0.125
    fp8_error.torch.save(table, tmp_path / "after.pt")
    fp8_error.main(["--compare", str(tmp_path / "before.pt"), str(tmp_path / "after.pt")])
    out = capsys.readouterr().out
    assert "before       after" in out
    line = next(row for row in out.splitlines() if row.strip().startswith("output"))
    assert line.split()[1:] == ["0.25000", "0.12500"]
