"""quantize_grouped with src_rows: the grouped FP8 cast of x[src_rows] (zero rows where
src_rows < 0) read straight from x, the permutation of tokens to experts and their cast in one
pass. The same bytes, amaxes and scale_invs as gathering first, then quantizing: on the CPU
(the reference), under Triton's interpreter (the kernels) and on a GPU."""

from __future__ import annotations

import pytest
import torch
from interpreter import requires_interpreter, run_under_interpreter
from tolerances import assert_same_tensors

from torchte.kernels.cast_spec import CastSpec
from torchte.kernels.grouped_cast import gather_rows_reference, grouped_offsets, quantize_grouped

SPLITS = [7, 0, 21, 4]


def _sources(tokens: int, rows: int, seed: int) -> torch.Tensor:
    """(rows,) int32 token indices, some repeated (a token routed twice), some -1 (padding)."""
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, tokens, (rows,), generator=gen, dtype=torch.int32)
    src[::5] = -1
    return src


def _spec(delayed: bool) -> CastSpec:
    scale = torch.tensor([0.5, 1.0, 2.0, 4.0]) if delayed else None
    return CastSpec(torch.float8_e4m3fn, True, True, scale, torch.zeros(4))


def test_gather_rows_reference_takes_rows_and_zeros():
    x = torch.arange(12.0).reshape(4, 3)
    src = torch.tensor([2, -1, 0, 2], dtype=torch.int32)
    want = torch.stack([x[2], torch.zeros(3), x[0], x[2]])
    assert torch.equal(gather_rows_reference(x, src), want)


@pytest.mark.parametrize("delayed", [True, False])
def test_reference_equals_gather_then_quantize(delayed):
    x = (torch.randn(19, 24, generator=torch.Generator().manual_seed(1)) * 4).bfloat16()
    src = _sources(19, sum(SPLITS), seed=2)
    offsets = grouped_offsets(SPLITS, "cpu")
    got_spec, want_spec = _spec(delayed), _spec(delayed)
    got = quantize_grouped(x, SPLITS, *offsets, got_spec, src_rows=src)
    want = quantize_grouped(gather_rows_reference(x, src), SPLITS, *offsets, want_spec)
    assert_same_tensors((*got, got_spec.amax), (*want, want_spec.amax))


@pytest.mark.parametrize(
    ("src", "match"),
    [
        (torch.zeros(32, dtype=torch.int64), "int32"),
        (torch.zeros(2, 16, dtype=torch.int32), "1-D"),
        (torch.zeros(31, dtype=torch.int32), "sum"),
    ],
)
def test_bad_src_rows(src, match):
    x = torch.zeros(5, 8)
    with pytest.raises(ValueError, match=match):
        quantize_grouped(x, SPLITS, *grouped_offsets(SPLITS, "cpu"), _spec(True), src_rows=src)


INTERPRETER_SCRIPT = """
import torch
from tolerances import assert_same_tensors as same
from torchte.kernels import grouped_cast as gc
from torchte.kernels.cast_spec import CastSpec

gen = torch.Generator().manual_seed(0)
for m_splits, tokens, features, config in (([7, 0, 21, 4], 19, 24, (16, 32, 4)),
                                           ([40, 3], 50, 37, (32, 32, 4))):
    rows = sum(m_splits)
    x = (torch.randn(tokens, features, generator=gen) * 4).bfloat16()
    src = torch.randint(0, tokens, (rows,), generator=gen, dtype=torch.int32)
    src[::5] = -1
    gathered = gc.gather_rows_reference(x, src)
    for on_device in (False, True):
        splits = None if on_device else m_splits
        if on_device:
            offsets = gc.device_grouped_offsets(torch.tensor(m_splits))
        else:
            offsets = gc.grouped_offsets(m_splits, "cpu")
        end = features * int(offsets[1][-1])  # the columnwise blocks' written part
        groups, what = len(m_splits), (m_splits, on_device)
        scale = torch.linspace(0.5, 4.0, groups)
        amax, amax_ref = torch.zeros(groups), torch.zeros(groups)
        out = gc._grouped_cast_transpose(
            x, splits, *offsets, CastSpec(torch.float8_e4m3fn, True, True, scale, amax), None,
            config, src=src)
        ref = gc.quantize_grouped_reference(
            gathered, m_splits, *gc.grouped_offsets(m_splits, "cpu"),
            CastSpec(torch.float8_e4m3fn, True, True, scale, amax_ref))
        same((out[0], out[1][:end], out[2], amax), (ref[0], ref[1][:end], ref[2], amax_ref), what)
        amax, amax_ref = torch.zeros(groups), torch.empty(groups)
        gc._grouped_amax(x, splits, offsets[0], amax, (config[0], config[1], 4), src=src)
        out = gc._grouped_cast_transpose(
            x, splits, *offsets, CastSpec(torch.float8_e4m3fn, True, True), amax, config,
            src=src)
        ref = gc.quantize_grouped_reference(
            gathered, m_splits, *gc.grouped_offsets(m_splits, "cpu"),
            CastSpec(torch.float8_e4m3fn, True, True, amax=amax_ref))
        same((out[0], out[1][:end], out[2], amax), (ref[0], ref[1][:end], ref[2], amax_ref), what)
print("ok")
"""


@requires_interpreter
def test_kernels_in_interpreter_equal_gather_then_quantize():
    run_under_interpreter(INTERPRETER_SCRIPT)


@pytest.mark.gpu
@pytest.mark.parametrize("delayed", [True, False])
def test_cuda_gather_quantize_equals_gather_then_quantize(delayed):
    """The kernels' bytes on a GPU (hardware FP8 conversion) against the gathered matrix's."""
    x = (torch.randn(3000, 512, generator=torch.Generator().manual_seed(3)) * 4).bfloat16()
    splits = [900, 0, 2100, 1000, 7]
    src = _sources(3000, sum(splits), seed=4)
    offsets = grouped_offsets(splits, "cuda")
    spec = [CastSpec(torch.float8_e4m3fn, True, True, None if not delayed else
                     torch.linspace(0.5, 4.0, 5, device="cuda"), torch.zeros(5, device="cuda"))
            for _ in range(2)]  # fmt: skip
    got = quantize_grouped(x.cuda(), splits, *offsets, spec[0], src_rows=src.cuda())
    want = quantize_grouped(gather_rows_reference(x, src).cuda(), splits, *offsets, spec[1])
    assert_same_tensors((*got, spec[0].amax), (*want, spec[1].amax))
