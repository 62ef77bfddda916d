"""The one tolerance table of the test suite, and helpers built on it.

Tests import it as `from tolerances import assert_close, representable` (pytest puts this
folder on sys.path because conftest.py lives here). Every comparison in the suite takes its
(rtol, atol) from TOLERANCES, keyed by the dtype whose rounding the result went through.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "TOLERANCES",
    "assert_close",
    "assert_equal_or_close",
    "assert_same_tensors",
    "representable",
    "same_bits",
    "tolerance",
]

TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1.3e-6, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float16: (1e-3, 1e-5),
    torch.float8_e4m3fn: (0.125, 0.0675),
    torch.float8_e5m2: (0.25, 0.125),
}
"""(rtol, atol) per dtype."""

# Largest integer n such that every k/n, |k| <= n, is exact in the dtype (n a power of two, so
# the values are small integers times 2**-log2(n); their significand fits the mantissa).
_STEPS: dict[torch.dtype, int] = {
    torch.float64: 2**20,
    torch.float32: 2**20,
    torch.bfloat16: 2**7,
    torch.float16: 2**10,
    torch.float8_e4m3fn: 2**3,
    torch.float8_e5m2: 2**2,
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """The (rtol, atol) of `dtype` from TOLERANCES; KeyError naming the dtype if it has none."""
    try:
        return TOLERANCES[dtype]
    except KeyError:
        known = ", ".join(str(d) for d in TOLERANCES)
        raise KeyError(f"no tolerance for dtype {dtype}; the table has {known}") from None


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, msg: str | None = None
) -> None:
    """Assert `actual` matches `expected` within `dtype`'s tolerances, compared in float64.

    Both tensors may have any dtype and device; shapes must match.
    """
    rtol, atol = tolerance(dtype)
    actual_f64 = actual.detach().to(device="cpu", dtype=torch.float64)
    expected_f64 = expected.detach().to(device="cpu", dtype=torch.float64)
    torch.testing.assert_close(actual_f64, expected_f64, rtol=rtol, atol=atol, msg=msg)


def representable(
    shape: tuple[int, ...] | torch.Size | int,
    dtype: torch.dtype,
    *,
    scale: float = 1.0,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Random float32 values in [-scale, scale] that are exact in `dtype` (and in float32).

    Values are k / n * scale for random integers |k| <= n, with n a power of two small enough
    for `dtype`'s mantissa: bf16 and fp16 draws are exact in their dtype, e4m3 draws are exact
    in e4m3, e5m2, bf16 and fp16. `scale` must be a power of two so that exactness is kept.
    Drawn on the CPU (same values for a seed on every device, and a CPU `generator` serves
    under any default device), then moved to `device` (None: torch's default device).
    """
    if dtype not in _STEPS:
        raise KeyError(f"representable: unsupported dtype {dtype}; use one of {list(_STEPS)}")
    if not (scale > 0 and math.frexp(scale)[0] == 0.5):
        raise ValueError(f"representable: scale must be a positive power of two, got {scale}")
    n = _STEPS[dtype]
    size = shape if isinstance(shape, tuple | torch.Size) else (shape,)
    ints = torch.randint(-n, n + 1, size, generator=generator, device="cpu")
    values = ints.to(torch.float32) * (scale / n)
    return values.to(torch.get_default_device() if device is None else device)


def assert_close_to_scale(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, msg: str | None = None
) -> None:
    """Like assert_close, with atol raised to rtol * max |expected|: for results that are
    differences of rounded terms of that size (a norm's input gradient subtracts two means
    from each element), whose absolute error follows the terms, not the result."""
    rtol, atol = tolerance(dtype)
    expected_f64 = expected.detach().to(device="cpu", dtype=torch.float64)
    atol = max(atol, rtol * expected_f64.abs().max().item())
    actual_f64 = actual.detach().to(device="cpu", dtype=torch.float64)
    torch.testing.assert_close(actual_f64, expected_f64, rtol=rtol, atol=atol, msg=msg)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one 4-byte dtype hold the same bit patterns (NaN equal to NaN)."""
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def assert_same_tensors(got, want, msg=None) -> None:
    """Each pair of the two sequences both None or equal tensors, one-byte (FP8) ones compared
    as bytes (so NaN codes compare equal)."""
    for a, b in zip(got, want, strict=True):
        assert (a is None) == (b is None), msg
        if a is not None:
            a = a.view(torch.uint8) if a.dtype.itemsize == 1 else a
            b = b.view(torch.uint8) if b.dtype.itemsize == 1 else b
            assert torch.equal(a, b), msg


def assert_equal_or_close(a: torch.Tensor, b: torch.Tensor, msg=None) -> None:
    """Same shape and dtype; floating values within the table's tolerance of their dtype,
    others equal."""
    assert a.shape == b.shape and a.dtype == b.dtype, (msg, a.shape, b.shape, a.dtype, b.dtype)
    if a.is_floating_point():
        assert_close(a, b, a.dtype, msg=str(msg))
    else:
        assert torch.equal(a, b), msg
