"""The emulated GEMM's epilogue (kernels/gemm_epilogue.py): the torch reference against a float64
model rounding to fp32 after every operation; the Triton kernel against the reference under
Triton's CPU interpreter; the GPU's bytes against the CPU's; bad input."""

from __future__ import annotations

import pytest
import torch
from interpreter import requires_interpreter, run_under_interpreter

from torchte.kernels.gemm_epilogue import scale_epilogue, scale_epilogue_reference

OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def inputs(rows: int, cols: int, seed: int):
    """(acc (rows, cols) fp32 over a wide range with -0.0 entries, factor_a, factor_b (1,)
    fp32 with full significands, bias (cols,) bf16)."""
    gen = torch.Generator().manual_seed(seed)
    acc = torch.randn(rows, cols, generator=gen) * torch.exp2(torch.randint(-20, 20, (1, cols)))
    acc.view(-1)[::11] = -0.0
    factor_a = torch.rand(1, generator=gen) * 3 + 0.1
    factor_b = torch.rand(1, generator=gen) / 7 + 1e-3
    bias = (torch.randn(cols, generator=gen) * 4).bfloat16()
    return acc, factor_a, factor_b, bias


def f32(t: torch.Tensor) -> torch.Tensor:
    """float64 t rounded to fp32, back in float64."""
    return t.float().double()


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("with_a, with_b, with_bias", [(1, 1, 1), (1, 1, 0), (0, 0, 1), (1, 0, 0)])
def test_reference_rounds_after_every_operation(out_dtype, with_a, with_b, with_bias):
    acc, factor_a, factor_b, bias = inputs(37, 53, seed=1)
    model = acc.double()
    if with_a:
        model = f32(model * factor_a.double())
    if with_b:
        model = f32(model * factor_b.double())
    if with_bias:
        model = f32(model + bias.double())
    got = scale_epilogue(
        acc.clone(), factor_a if with_a else None, factor_b if with_b else None,
        bias if with_bias else None, out_dtype,
    )  # fmt: skip
    assert got.dtype == out_dtype
    want = model.to(out_dtype)
    assert torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8))
    if not with_bias:  # nothing added: -0.0 keeps its sign
        assert torch.signbit(got.view(-1)[::11]).all()


def test_nothing_to_apply_returns_the_accumulator():
    acc = torch.randn(4, 8)
    assert scale_epilogue(acc, None, None, None, torch.float32) is acc


def test_bad_input():
    acc = torch.zeros(4, 8)
    with pytest.raises(TypeError, match="acc must be a 2-D fp32"):
        scale_epilogue(acc.bfloat16(), None, None, None, torch.bfloat16)
    with pytest.raises(ValueError, match="factor_b must be a one-element fp32"):
        scale_epilogue(acc, None, torch.ones(2), None, torch.bfloat16)
    with pytest.raises(ValueError, match=r"bias must be \(N,\) = \(8,\)"):
        scale_epilogue(acc, None, None, torch.zeros(7), torch.bfloat16)
    with pytest.raises(TypeError, match="out_dtype"):
        scale_epilogue(acc, None, None, None, torch.int32)


INTERPRETER_SCRIPT = """
import torch
from torchte.kernels import gemm_epilogue as ep

gen = torch.Generator().manual_seed(3)
for rows, cols in [(37, 53), (1, 300), (64, 128)]:
    acc = torch.randn(rows, cols, generator=gen) * 1e3
    acc.view(-1)[::7] = -0.0
    acc.view(-1)[5::13] = float("nan")
    acc[0, :3] = torch.tensor([float("inf"), 3e38, -3e38])
    fa, fb = torch.rand(1, generator=gen) * 3, torch.rand(1, generator=gen) / 7
    for bias in (None, torch.randn(cols, generator=gen).bfloat16(), torch.randn(cols)):
        for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
            for a, b in ((fa, fb), (None, fb), (None, None)):
                got = ep._epilogue_triton(acc, a, b, bias, out_dtype, (16, 64, 4))
                want = ep.scale_epilogue_reference(acc.clone(), a, b, bias, out_dtype)
                # NaN bytes differ (the GPU's canonical NaN, torch's CPU one): NaN matches NaN.
                nan = torch.isnan(want)
                assert torch.equal(torch.isnan(got), nan)
                got, want = got.masked_fill(nan, 0), want.masked_fill(nan, 0)
                same = got.view(-1).view(torch.uint8) == want.view(-1).view(torch.uint8)
                assert same.all(), (rows, cols, out_dtype, a is None, bias is None)
print("ok")
"""


@requires_interpreter
def test_triton_kernel_in_interpreter_matches_reference():
    run_under_interpreter(INTERPRETER_SCRIPT)


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
def test_gpu_bytes_equal_cpu_bytes(out_dtype):
    for shape, seed in (((1037, 2053), 4), ((4096, 4096), 5), ((1, 129), 6)):
        acc, factor_a, factor_b, bias = inputs(*shape, seed=seed)
        cuda = [t.cuda() for t in (acc, factor_a, factor_b, bias)]
        for with_bias in (False, True):
            b_cpu, b_gpu = (bias, cuda[3]) if with_bias else (None, None)
            want = scale_epilogue(acc.clone(), factor_a, factor_b, b_cpu, out_dtype)
            for _ in range(2):  # compiled, then FastLaunch's cached path
                got = scale_epilogue(cuda[0], cuda[1], cuda[2], b_gpu, out_dtype)
                assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
            assert torch.equal(cuda[0].cpu(), acc)  # the accumulator is left as it was


def test_reference_overwrites_only_its_own_accumulator():
    acc, factor_a, _, bias = inputs(5, 16, seed=2)
    copy = acc.clone()
    out = scale_epilogue_reference(copy, factor_a, None, bias, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and not torch.equal(copy, acc)
