"""Delayed-scaling update: the torch reference against an fp64 model (CPU), and the Triton kernel
against the torch reference, bit for bit and in place (GPU)."""

from __future__ import annotations

import math

import pytest
import torch
from interpreter import requires_interpreter, run_under_interpreter

from torchte.kernels import scaling
from torchte.kernels._triton import triton_available

requires_triton = pytest.mark.skipif(not triton_available(), reason="needs a CUDA GPU and Triton")


def f32(value: float) -> float:
    """value rounded to fp32 (a quotient rounded first to fp64 then fp32 is rounded once)."""
    return torch.tensor(value, dtype=torch.float32).item()


def update_model(history: list[list[float]], scale: list[float], fp8_max, margin, algo):
    """(new history, new scale, skipped columns) as Python lists, in fp64 arithmetic with fp32
    rounding. A column whose row 0 is NaN or inf is skipped: not rolled, scale kept."""
    rows, cols = len(history), len(scale)
    new_scale = list(scale)
    rolled = history[1:] + history[:1]
    skipped = [0] * cols
    for j in range(cols):
        column = [history[i][j] for i in range(rows)]
        if not math.isfinite(column[0]):
            skipped[j] = 1
            for i in range(rows):
                rolled[i][j] = column[i]
            continue
        if algo == "max":
            amax = math.nan if any(math.isnan(v) for v in column) else max(column)
        else:
            amax = column[0]
        if amax > 0 and math.isfinite(amax):
            new_scale[j] = f32(f32(fp8_max / amax) / 2.0**margin)
    rolled[0] = [0.0] * cols
    return rolled, new_scale, skipped


def update(history, scale, fp8_max, margin, algo, reference=False) -> torch.Tensor:
    """Run the update (or its torch reference) in place; returns the skip counts (n,) int32."""
    nonfinite = torch.zeros(scale.shape[0], dtype=torch.int32, device=scale.device)
    fn = scaling.update_delayed_scaling_reference if reference else scaling.update_delayed_scaling
    fn(history, scale, nonfinite, fp8_max, margin, algo)
    return nonfinite


def history_case(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A history (rows, cols) with columns that exercise each rule, and a scale (cols,)."""
    gen = torch.Generator().manual_seed(seed)
    history = torch.rand((rows, cols), generator=gen) * 10
    scale = torch.rand(cols, generator=gen) + 0.5
    specials = [
        lambda c: c.zero_(),  # amax 0: scale kept
        lambda c: c.__setitem__(rows // 2, math.nan),  # NaN somewhere: kept for "max"
        lambda c: c.__setitem__(0, math.inf),  # inf in row 0: skipped, not rolled
        lambda c: c.__setitem__(0, math.nan),  # NaN in row 0: skipped, not rolled
        lambda c: c.__setitem__(rows - 1, math.inf),  # inf further back: scale kept
        lambda c: c.fill_(1e-40),  # subnormal amax: the quotient overflows to inf
        lambda c: c.__setitem__(slice(1, None), 1e6),  # row 0 small, the rest large
    ]
    for j, special in enumerate(specials[: max(cols - 1, 0)]):
        special(history[:, j + 1])
    return history, scale


CASES = [(1, 1), (1, 6), (2, 3), (16, 1), (17, 6), (1024, 1), (1024, 8), (1500, 3), (4099, 2)]
CASES += [(1024, 37), (33, 19)]  # several programs (8 columns each)


@pytest.mark.parametrize("rows,cols", CASES)
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 1, 3])
def test_reference_matches_model(rows, cols, algo, margin):
    history, scale = history_case(rows, cols, seed=rows + cols)
    want_history, want_scale, want_skipped = update_model(
        history.tolist(), scale.tolist(), 448.0, margin, algo
    )
    row0, scale_view = history[0], scale[:]
    skipped = update(history, scale, 448.0, margin, algo)
    torch.testing.assert_close(history, torch.tensor(want_history), rtol=0, atol=0, equal_nan=True)
    assert scale.tolist() == want_scale
    assert skipped.tolist() == want_skipped
    # Updated in place: views taken before see the new values.
    assert torch.equal(row0, history[0]) and torch.equal(scale_view, scale)


def test_reference_rules():
    history = torch.tensor([[4.0, 0.0, 2.0, math.nan], [8.0, 0.0, math.inf, 1.0]])
    scale = torch.tensor([5.0, 5.0, 5.0, 5.0])
    skipped = update(history, scale, 448.0, 1, "max")
    # max: column 0 -> 448 / 8 / 2; zero and inf keep the scale; the NaN in row 0 is not taken
    # into the history: column 3 stays as it was, its row 0 cleared, and the skip is counted.
    assert scale.tolist() == [28.0, 5.0, 5.0, 5.0]
    assert history[0].tolist() == [0.0] * 4
    assert history[1].tolist() == [4.0, 0.0, 2.0, 1.0]
    assert skipped.tolist() == [0, 0, 0, 1]

    history = torch.tensor([[4.0, 0.0, 2.0, math.nan], [8.0, 0.0, math.inf, 1.0]])
    update(history, scale, 57344.0, 0, "most_recent")
    assert scale.tolist() == [14336.0, 5.0, 28672.0, 5.0]


def test_reference_nonfinite_amax_does_not_freeze_the_scale():
    """One inf amax, then clean ones: the next clean step scales from the clean history."""
    history, scale = torch.zeros(1024, 1), torch.ones(1)
    history[0, 0] = 2.0
    update(history, scale, 448.0, 0, "max")
    history[0, 0] = math.inf
    assert update(history, scale, 448.0, 0, "max").tolist() == [1]
    assert scale.tolist() == [224.0]
    history[0, 0] = 4.0
    update(history, scale, 448.0, 0, "max")
    assert scale.tolist() == [112.0]
    assert torch.isfinite(history).all()


def test_reference_single_row():
    history, scale = torch.tensor([[2.0, 0.0]]), torch.tensor([1.0, 1.0])
    update(history, scale, 448.0, 0, "max")
    assert history.tolist() == [[0.0, 0.0]] and scale.tolist() == [224.0, 1.0]


INTERPRETER_SCRIPT = """
import torch
from torchte.kernels import scaling
from test_kernels_scaling import CASES, history_case

for rows, cols in CASES:
    for algo in ("max", "most_recent"):
        history, scale = history_case(rows, cols, seed=rows * cols)
        want_history, want_scale = history.clone(), scale.clone()
        want_skipped, skipped = (torch.zeros(cols, dtype=torch.int32) for _ in range(2))
        scaling.update_delayed_scaling_reference(
            want_history, want_scale, want_skipped, 448.0, 1, algo
        )
        scaling._launch_update(history, scale, skipped, 448.0, 1, algo)
        assert torch.equal(history.view(torch.int32), want_history.view(torch.int32)), (rows, cols)
        assert torch.equal(scale, want_scale) and torch.equal(skipped, want_skipped), (rows, cols)
print("ok")
"""


@requires_interpreter
def test_triton_kernel_in_interpreter_matches_reference():
    run_under_interpreter(INTERPRETER_SCRIPT)


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("rows,cols", CASES)
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize("fp8_max", [448.0, 57344.0])
def test_triton_matches_reference(rows, cols, algo, margin, fp8_max):
    history, scale = (t.cuda() for t in history_case(rows, cols, seed=rows * cols))
    want_history, want_scale = history.clone(), scale.clone()
    want_skipped = update(want_history, want_scale, fp8_max, margin, algo, reference=True)
    row0, history_ptr, scale_ptr = history[0], history.data_ptr(), scale.data_ptr()
    skipped = update(history, scale, fp8_max, margin, algo)
    assert history.data_ptr() == history_ptr and scale.data_ptr() == scale_ptr
    assert torch.equal(skipped, want_skipped)
    assert torch.equal(history.view(torch.int32), want_history.view(torch.int32))
    assert torch.equal(scale.view(torch.int32), want_scale.view(torch.int32))
    assert torch.equal(row0, history[0])


@pytest.mark.gpu
@requires_triton
def test_triton_repeated_updates():
    history, scale = (t.cuda() for t in history_case(1024, 4, seed=5))
    want_history, want_scale = history.clone(), scale.clone()
    for step in range(5):
        value = math.inf if step == 2 else step + 0.5
        history[0] = value
        want_history[0] = value
        update(history, scale, 448.0, 0, "max")
        update(want_history, want_scale, 448.0, 0, "max", reference=True)
    assert torch.equal(history.view(torch.int32), want_history.view(torch.int32))
    assert torch.equal(scale.view(torch.int32), want_scale.view(torch.int32))


@pytest.mark.gpu
@requires_triton
def test_triton_unaligned_views():
    # A history and scales that are views at odd offsets (the launcher keys its compiled kernel
    # on pointer alignment), after an aligned call of the same shape.
    for offset in (0, 1):
        store, scale_store = torch.rand(1024 * 3 + 1, device="cuda"), torch.ones(4, device="cuda")
        history, scale = store[offset : offset + 1024 * 3].view(1024, 3), scale_store[offset:][:3]
        want_history, want_scale = history.clone(), scale.clone()
        update(history, scale, 448.0, 0, "max")
        update(want_history, want_scale, 448.0, 0, "max", reference=True)
        assert torch.equal(history, want_history) and torch.equal(scale, want_scale)


@pytest.mark.gpu
@requires_triton
def test_triton_one_launch():
    from torch.profiler import ProfilerActivity, profile

    history, scale = (t.cuda() for t in history_case(1024, 3, seed=1))
    nonfinite = torch.zeros(3, dtype=torch.int32, device="cuda")
    scaling.update_delayed_scaling(history, scale, nonfinite, 448.0, 0, "max")  # compile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        scaling.update_delayed_scaling(history, scale, nonfinite, 448.0, 0, "max")
        torch.cuda.synchronize()
    count = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    if count == 0:
        pytest.skip("the profiler records no GPU activity here")
    assert count == 1
