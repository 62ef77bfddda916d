"""gemm.py: high-precision mm with out/accumulate, and the FP8 GEMM on the CPU.

FP8 references are built in fp64 from exactly representable FP8 values and power-of-two
scales, so the only rounding in the GEMM under test is that of its output dtype.
"""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_close, representable

from torchte.gemm import fp8_gemm, hp_linear, hp_mm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def fp8_operand(shape, dtype, scale_inv: float):
    """(fp8 data, scale_inv (1,) fp32, its exact fp64 value data * scale_inv)."""
    values = representable(shape, torch.float8_e4m3fn, scale=4.0)
    data = values.to(dtype)
    assert torch.equal(data.float(), values)  # exact in the FP8 dtype
    si = torch.tensor([scale_inv], dtype=torch.float32)
    return data, si, values.double() * scale_inv


# -- hp_mm / hp_linear ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_hp_mm_without_out_keeps_dtype(dtype):
    a = representable((7, 13), dtype).to(dtype)
    b = representable((13, 5), dtype).to(dtype)
    result = hp_mm(a, b)
    assert result.dtype == dtype and result.shape == (7, 5)
    assert_close(result, a.double() @ b.double(), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_hp_mm_writes_fp32_out(dtype):
    # Values on the bf16 grid (k / 128): exact in every dtype here, products exact in fp32.
    a = representable((9, 17), torch.bfloat16).to(dtype)
    b = representable((17, 3), torch.bfloat16).to(dtype)
    out = torch.full((9, 3), 123.0)
    result = hp_mm(a, b, out=out)
    assert result.data_ptr() == out.data_ptr()
    assert out.dtype == torch.float32
    # Products of these values and their sums are exact in fp32: no output rounding at all.
    assert torch.equal(out.double(), a.double() @ b.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_hp_mm_accumulates_into_out(dtype):
    a = representable((5, 11), dtype).to(dtype)
    b = representable((11, 4), dtype).to(dtype)
    start = representable((5, 4), torch.float32)
    out = start.clone()
    hp_mm(a, b, out=out, accumulate=True)
    hp_mm(a, b, out=out, accumulate=True)
    expected = start.double() + 2 * (a.double() @ b.double())
    assert_close(out, expected, torch.float32)
    assert out.dtype == torch.float32


def test_hp_mm_accumulates_in_fp32_not_in_input_dtype():
    # 1 + 2**-9 is not a bf16 value; accumulating in fp32 keeps it.
    a = torch.tensor([[1.0, 2.0**-9]], dtype=torch.bfloat16)
    b = torch.tensor([[1.0], [1.0]], dtype=torch.bfloat16)
    out = torch.zeros(1, 1)
    hp_mm(a, b, out=out)
    assert out.item() == 1.0 + 2.0**-9


def test_hp_linear_matches_fp64():
    x = representable((6, 10), torch.float32)
    w = representable((4, 10), torch.float32)
    b = representable(4, torch.float32)
    expected = x.double() @ w.double().t() + b.double()
    assert_close(hp_linear(x, w, b), expected, torch.float32)
    assert_close(hp_linear(x, w, None), expected - b.double(), torch.float32)


# -- fp8_gemm on the CPU ---------------------------------------------------------------------------


@pytest.mark.parametrize("a_dtype,b_dtype", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)])
@pytest.mark.parametrize("m,n,k", [(1, 16, 16), (17, 32, 48), (5, 48, 16), (64, 16, 32)])
def test_fp8_gemm_exact_against_fp64(a_dtype, b_dtype, m, n, k):
    a, a_si, a_ref = fp8_operand((m, k), a_dtype, 2.0**-3)
    b, b_si, b_ref = fp8_operand((n, k), b_dtype, 2.0**5)
    result = fp8_gemm(a, a_si, b, b_si, torch.float32)
    assert result.shape == (m, n) and result.dtype == torch.float32
    # FP8 products and their sums are exact in fp32 at these sizes; scales are powers of two.
    assert torch.equal(result.double(), a_ref @ b_ref.t())


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_gemm_out_dtype_and_bias(out_dtype):
    a, a_si, a_ref = fp8_operand((13, 32), E4M3, 2.0**-2)
    b, b_si, b_ref = fp8_operand((16, 32), E4M3, 2.0**-4)
    bias = representable(16, torch.bfloat16).to(out_dtype)
    result = fp8_gemm(a, a_si, b, b_si, out_dtype, bias=bias)
    assert result.dtype == out_dtype and result.shape == (13, 16)
    assert_close(result, a_ref @ b_ref.t() + bias.double(), out_dtype)
    no_bias = fp8_gemm(a, a_si, b, b_si, out_dtype)
    assert_close(no_bias, a_ref @ b_ref.t(), out_dtype)


def test_fp8_gemm_bf16_output_is_rounded_once():
    a, a_si, a_ref = fp8_operand((8, 16), E4M3, 1.0)
    b, b_si, b_ref = fp8_operand((16, 16), E4M3, 2.0**-7)
    result = fp8_gemm(a, a_si, b, b_si, torch.bfloat16)
    assert torch.equal(result, (a_ref @ b_ref.t()).to(torch.bfloat16))


def test_fp8_gemm_writes_out():
    a, a_si, a_ref = fp8_operand((7, 16), E5M2, 2.0**-1)
    b, b_si, b_ref = fp8_operand((16, 16), E4M3, 2.0**-3)
    out = torch.full((7, 16), 5.0)
    result = fp8_gemm(a, a_si, b, b_si, torch.float32, out=out)
    assert result.data_ptr() == out.data_ptr()
    assert torch.equal(out.double(), a_ref @ b_ref.t())


def test_fp8_gemm_accumulates_into_fp32_out():
    a, a_si, a_ref = fp8_operand((7, 16), E5M2, 2.0**-1)
    b, b_si, b_ref = fp8_operand((16, 16), E4M3, 2.0**-3)
    start = representable((7, 16), torch.float32)
    out = start.clone()
    fp8_gemm(a, a_si, b, b_si, torch.float32, out=out, accumulate=True)
    fp8_gemm(a, a_si, b, b_si, torch.float32, out=out, accumulate=True)
    assert_close(out, start.double() + 2 * (a_ref @ b_ref.t()), torch.float32)


def test_fp8_gemm_non_power_of_two_scales():
    a, _, _ = fp8_operand((9, 32), E4M3, 1.0)
    b, _, _ = fp8_operand((16, 32), E4M3, 1.0)
    a_si, b_si = torch.tensor([0.3]), torch.tensor([1.7])
    expected = (a.double() * a_si.double()) @ (b.double() * b_si.double()).t()
    assert_close(fp8_gemm(a, a_si, b, b_si, torch.float32), expected, torch.float32)


# -- empty dimensions -----------------------------------------------------------------------------


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fp8_gemm_zero_rows(out_dtype):
    a = torch.empty(0, 32, dtype=E4M3)
    b, b_si, _ = fp8_operand((16, 32), E4M3, 1.0)
    bias = torch.ones(16, dtype=out_dtype)
    result = fp8_gemm(a, torch.ones(1), b, b_si, out_dtype, bias=bias)
    assert result.shape == (0, 16) and result.dtype == out_dtype


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fp8_gemm_zero_inner_dim_gives_bias(out_dtype):
    a = torch.empty(5, 0, dtype=E4M3)
    b = torch.empty(16, 0, dtype=E4M3)
    one = torch.ones(1)
    result = fp8_gemm(a, one, b, one, out_dtype)
    assert result.dtype == out_dtype
    assert torch.equal(result, torch.zeros(5, 16, dtype=out_dtype))
    bias = representable(16, torch.bfloat16).to(out_dtype)
    with_bias = fp8_gemm(a, one, b, one, out_dtype, bias=bias)
    assert torch.equal(with_bias, bias.expand(5, 16))


def test_fp8_gemm_zero_inner_dim_with_out():
    a = torch.empty(5, 0, dtype=E4M3)
    b = torch.empty(16, 0, dtype=E4M3)
    one = torch.ones(1)
    start = representable((5, 16), torch.float32)
    out = start.clone()
    fp8_gemm(a, one, b, one, torch.float32, out=out, accumulate=True)
    assert torch.equal(out, start)  # adding an empty sum changes nothing
    fp8_gemm(a, one, b, one, torch.float32, out=out, accumulate=False)
    assert torch.equal(out, torch.zeros(5, 16))  # writing an empty sum gives zeros


def test_fp8_gemm_zero_inner_dim_with_out_adds_bias():
    # With `out`, the result must be the same as without it: the (empty) product plus bias.
    a = torch.empty(3, 0, dtype=E4M3)
    b = torch.empty(16, 0, dtype=E4M3)
    one = torch.ones(1)
    bias = representable(16, torch.float32)
    out = torch.full((3, 16), 7.0)
    fp8_gemm(a, one, b, one, torch.float32, bias=bias, out=out)
    assert torch.equal(out, bias.expand(3, 16))


def test_hp_mm_empty_dims():
    a = torch.empty(0, 8)
    b = torch.randn(8, 4)
    assert hp_mm(a, b).shape == (0, 4)
    out = torch.full((3, 4), 2.0)
    hp_mm(torch.empty(3, 0), torch.empty(0, 4), out=out, accumulate=True)
    assert torch.equal(out, torch.full((3, 4), 2.0))
    hp_mm(torch.empty(3, 0), torch.empty(0, 4), out=out)
    assert torch.equal(out, torch.zeros(3, 4))
