"""kernels/multi_cast.py: the amaxes and FP8 casts of many tensors in one launch each, against
their torch references (the interpreter on the CPU, the hardware conversion on a GPU), and the
references against the single-tensor cast's bytes and an fp64 amax."""

from __future__ import annotations

import pytest
import torch
from interpreter import requires_interpreter, run_under_interpreter

from torchte.kernels import multi_cast
from torchte.kernels._fp8_codec import FP8_MAX
from torchte.kernels.cast_spec import CastSpec
from torchte.kernels.cast_transpose import quantize_reference

# One element, odd sizes, one past a chunk, an empty tensor, several chunks and a partial one.
SHAPES = [(1,), (3, 5), (0, 4), (multi_cast.MULTI_CAST_CHUNK + 1,), (2, 3 * 4096 + 77)]
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def tensors(dtype: torch.dtype, seed: int = 0, device: str = "cpu") -> list[torch.Tensor]:
    """Values of many binades (exactly representable in bf16), one tensor spanning past the
    FP8 range once scaled."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, shape in enumerate(SHAPES):
        mantissa = torch.randint(-128, 128, shape, generator=gen).float() / 128
        exponent = torch.randint(-12, 6 + i, shape, generator=gen).float()
        out.append((mantissa * exponent.exp2()).to(dtype).to(device))
    return out


def scales_for(values: list[torch.Tensor]) -> torch.Tensor:
    """One scale a tensor, the last one large enough to saturate."""
    scales = torch.tensor([2.0**k for k in range(len(values))], dtype=torch.float32)
    scales[-1] = 1e6
    return scales.to(values[0].device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_amaxes_are_fp64_maxima(dtype):
    values = tensors(dtype)
    values[1][0, 2] = float("nan")
    got = multi_cast.amaxes_reference(values)
    for i, t in enumerate(values):
        if i == 1:
            assert got[i].isnan()
        else:
            want = t.double().abs().max().item() if t.numel() else 0.0
            assert got[i].item() == want


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_reference_bytes_are_the_single_cast_bytes(fp8_dtype):
    values = tensors(torch.float32)
    values[0][0] = float("nan")
    scales = scales_for(values)
    got = multi_cast.quantize_reference(values, scales, fp8_dtype)
    for t, out, scale in zip(values, got, scales, strict=True):
        assert out.shape == t.shape and out.dtype == fp8_dtype
        if not t.numel():
            continue
        spec = CastSpec(fp8_dtype, True, False, scale.reshape(1), torch.zeros(1))
        want = quantize_reference(t.reshape(-1, t.shape[-1]), spec)[0].reshape(t.shape)
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))
    assert got[-1].float().abs().max().item() == FP8_MAX[fp8_dtype]  # saturated, not inf


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: multi_cast.amaxes([]), "no tensors"),
        (lambda: multi_cast.amaxes([torch.ones(2), torch.ones(2).half()]), "one dtype"),
        (lambda: multi_cast.amaxes([torch.ones(4, 2).t()]), "contiguous"),
        (
            lambda: multi_cast.quantize([torch.ones(2)], torch.ones(2), torch.float8_e4m3fn),
            r"scales must be \(1,\) fp32",
        ),
        (
            lambda: multi_cast.quantize_reference([torch.ones(2)], torch.ones(1), torch.int8),
            "float8",
        ),
    ],
)
def test_bad_inputs_are_refused(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call()


INTERPRETER_SCRIPT = """
import torch
from test_kernels_multi_cast import FP8_DTYPES, scales_for, tensors
from torchte.kernels import multi_cast

for dtype in (torch.float32, torch.bfloat16):
    values = tensors(dtype, seed=1)
    values[1][1, 1] = float("nan")
    got, want = multi_cast.amaxes(values), multi_cast.amaxes_reference(values)
    assert got[1].isnan() and want[1].isnan()
    assert torch.equal(got[[0, 2, 3, 4]], want[[0, 2, 3, 4]]), (got, want)
    values[1][1, 1] = 3.0
    scales = scales_for(values)
    for fp8_dtype in FP8_DTYPES:
        cast = multi_cast.quantize(values, scales, fp8_dtype)
        ref = multi_cast.quantize_reference(values, scales, fp8_dtype)
        for a, b in zip(cast, ref):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
print("ok")
"""


@requires_interpreter
def test_kernels_in_interpreter_equal_the_references():
    run_under_interpreter(INTERPRETER_SCRIPT)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_on_the_gpu_equal_the_references(dtype):
    values = tensors(dtype, seed=2, device="cuda")
    assert torch.equal(multi_cast.amaxes(values), multi_cast.amaxes_reference(values))
    scales = scales_for(values)
    for fp8_dtype in FP8_DTYPES:
        cast = multi_cast.quantize(values, scales, fp8_dtype)
        ref = multi_cast.quantize_reference(values, scales, fp8_dtype)
        for a, b in zip(cast, ref, strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
