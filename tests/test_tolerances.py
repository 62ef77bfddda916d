"""Checks of the shared test helpers: the tolerance table and exactly representable draws."""

from __future__ import annotations

import pytest
import torch
from tolerances import TOLERANCES, assert_close, representable, tolerance

LOW_PRECISION = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", [torch.float32, *LOW_PRECISION])
def test_representable_is_exact_in_its_dtype(dtype: torch.dtype) -> None:
    x = representable((37, 129), dtype, scale=4.0)
    assert x.dtype == torch.float32
    assert x.abs().max() <= 4.0
    assert x.unique().numel() > 2
    torch.testing.assert_close(x.to(dtype).float(), x, rtol=0, atol=0)


def test_e4m3_draws_are_exact_in_bf16_and_e4m3() -> None:
    x = representable(1000, torch.float8_e4m3fn)
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        torch.testing.assert_close(x.to(dtype).float(), x, rtol=0, atol=0)


def test_representable_is_reproducible_with_a_generator() -> None:
    draws = [
        representable((8, 8), torch.bfloat16, generator=torch.Generator().manual_seed(7))
        for _ in range(2)
    ]
    assert torch.equal(*draws)


def test_representable_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="power of two"):
        representable(4, torch.bfloat16, scale=3.0)
    with pytest.raises(KeyError, match="unsupported dtype"):
        representable(4, torch.int32)


def test_assert_close_uses_the_dtype_tolerance() -> None:
    rtol, atol = tolerance(torch.bfloat16)
    assert (rtol, atol) == TOLERANCES[torch.bfloat16]
    expected = torch.ones(16)
    assert_close(expected * (1 + rtol / 2), expected, torch.bfloat16)
    with pytest.raises(AssertionError):
        assert_close(expected * (1 + 4 * rtol), expected, torch.bfloat16)
    with pytest.raises(KeyError, match="no tolerance"):
        tolerance(torch.int8)


def test_assert_close_to_scale_uses_the_largest_magnitude():
    from tolerances import assert_close_to_scale

    expected = torch.tensor([1.0, 0.001])
    assert_close_to_scale(torch.tensor([1.0, 0.001 + 0.015]), expected, torch.bfloat16)
    with pytest.raises(AssertionError):
        assert_close_to_scale(torch.tensor([1.0, 0.001 + 0.02]), expected, torch.bfloat16)
