"""kernels/cast_dbias: an output gradient's FP8 cast with its column sums in one pass, against
cast_transpose's cast and an fp64 column sum (CPU reference, Triton's CPU interpreter, GPU),
and the route linear_backward takes through it (quantization/fused.grad_output_with_dbias)."""

from __future__ import annotations

import pytest
import torch
from interpreter import requires_interpreter, run_under_interpreter
from launches import count_device_ops
from tolerances import assert_close_to_scale, representable

import torchte as te
from torchte.kernels import cast_dbias as cd
from torchte.kernels import cast_transpose as ct
from torchte.kernels._triton import triton_available
from torchte.kernels.cast_spec import CastSpec
from torchte.quantization import fused
from torchte.quantization.float8 import Float8CurrentScalingQuantizer, Float8Quantizer

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
requires_triton = pytest.mark.skipif(not triton_available(), reason="needs a CUDA GPU and Triton")


def draw(m: int, n: int, dtype: torch.dtype, device="cpu", seed: int = 0) -> torch.Tensor:
    """dy (m, n) of values exact in bf16 (so every fp32 column sum of a few hundred rows is
    exact), a few of them large."""
    gen = torch.Generator().manual_seed(seed)
    dy = representable((m, n), torch.bfloat16, scale=4.0, generator=gen)
    dy.view(-1)[::37] *= 64
    return dy.to(device=device, dtype=dtype)


def specs(fp8: torch.dtype, usage=(True, True), device="cpu") -> dict[str, CastSpec]:
    """A delayed spec (scale 8, amax 0.25 to be max-accumulated) and a current one."""
    scale = torch.tensor([8.0], device=device)
    return {
        "delayed": CastSpec(fp8, *usage, scale, torch.tensor([0.25], device=device)),
        "current": CastSpec(fp8, *usage, amax_epsilon=0.0, power_2_scale=False),
    }


def fp64_column_sums(dy: torch.Tensor) -> torch.Tensor:
    return dy.double().sum(0).to(dy.dtype)


def assert_matches_cast(got, dy, spec_got, spec_want, where):
    """got = quantize_dbias(dy, spec_got): the bytes, amax and scale_inv of
    cast_transpose.quantize_reference(dy, spec_want) (spec_want: a fresh amax), dbias the
    fp64 column sums rounded to dy's dtype (exact: the values are)."""
    *want, want_scale_inv = ct.quantize_reference(dy.cpu(), spec_want)
    data, data_t, scale_inv, dbias = got
    for g, w in zip((data, data_t), want, strict=True):
        assert (g is None) == (w is None), where
        if g is not None:
            assert g.dtype == w.dtype and g.shape == w.shape, where
            assert torch.equal(g.cpu().view(torch.uint8), w.view(torch.uint8)), where
    assert torch.equal(scale_inv.cpu(), want_scale_inv), where
    if spec_got.delayed:
        assert torch.equal(spec_got.amax.cpu(), spec_want.amax), where
    assert dbias.dtype == dy.dtype and dbias.shape == (dy.shape[1],), where
    assert torch.equal(dbias.cpu(), fp64_column_sums(dy.cpu())), where


def cpu_twin(spec: CastSpec) -> CastSpec:
    """spec on the CPU with a fresh copy of its amax (delayed) for the reference to accumulate."""
    if not spec.delayed:
        return spec
    return CastSpec(spec.fp8_dtype, spec.rowwise, spec.columnwise, spec.scale.cpu(),
                    spec.amax.detach().cpu().clone())  # fmt: skip


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n", [(1, 1), (17, 33), (64, 96)])
@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_reference_is_the_cast_and_the_column_sums(scaling, m, n, dtype, fp8):
    dy = draw(m, n, dtype, seed=m + n)
    spec = specs(fp8)[scaling]
    want = cpu_twin(spec)
    assert_matches_cast(cd.quantize_dbias(dy, spec), dy, spec, want, (scaling, m, n, dtype))


@pytest.mark.parametrize("usage", [(True, False), (False, True), (False, False)])
def test_reference_usages_and_empty_rows(usage):
    dy = draw(9, 20, torch.bfloat16)
    spec = specs(torch.float8_e5m2, usage)["delayed"]
    assert_matches_cast(cd.quantize_dbias(dy, spec), dy, spec, cpu_twin(spec), usage)
    data, _, _, dbias = cd.quantize_dbias(dy[:0], specs(torch.float8_e4m3fn)["current"])
    assert data.shape == (0, 20) and torch.equal(dbias, torch.zeros(20, dtype=dy.dtype))


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="2-D"):
        cd.quantize_dbias(torch.ones(2, 3, 4), specs(torch.float8_e4m3fn)["current"])
    with pytest.raises(TypeError, match="fp8_dtype"):
        cd.quantize_dbias(torch.ones(2, 3), CastSpec(torch.bfloat16))


def test_fusable_quantizers():
    """The one-scale route takes internal delayed and current quantizers; not a current one
    whose amax is reduced over ranks, nor a subclass, nor one that makes Float8Tensors."""
    delayed = Float8Quantizer(torch.ones(1), torch.zeros(1), torch.float8_e5m2)
    current = Float8CurrentScalingQuantizer(torch.float8_e5m2)
    assert fused._one_scale_fusable(delayed) and fused._one_scale_fusable(current)
    reduced = Float8CurrentScalingQuantizer(torch.float8_e5m2)
    reduced.amax_reduction = lambda amax: amax
    assert not fused._one_scale_fusable(reduced)
    assert not fused._one_scale_fusable(
        Float8CurrentScalingQuantizer(torch.float8_e5m2, internal=False)
    )

    class Custom(Float8Quantizer):
        pass

    assert not fused._one_scale_fusable(Custom(torch.ones(1), torch.zeros(1), torch.float8_e5m2))


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_linear_bias_gradient_comes_from_the_fused_cast(recipe, monkeypatch):
    """te.Linear's backward under FP8 takes dbias from quantize_dbias (one call per backward),
    and it is dy's fp64 column sum over the leading dims."""
    calls = []
    original = cd.quantize_dbias

    def spy(dy, spec):
        calls.append(tuple(dy.shape))
        return original(dy, spec)

    monkeypatch.setattr(cd, "quantize_dbias", spy)
    layer = te.Linear(32, 48, params_dtype=torch.bfloat16)
    x = draw(2 * 24, 32, torch.bfloat16, seed=1).view(2, 24, 32).requires_grad_()
    dy = draw(2 * 24, 48, torch.bfloat16, seed=2).view(2, 24, 48)
    make = {"delayed": te.recipe.DelayedScaling, "current": te.recipe.Float8CurrentScaling}
    with te.autocast(recipe=make[recipe]()):
        y = layer(x)
    y.backward(dy)
    assert calls == [(48, 48)]
    assert torch.equal(layer.bias.grad, fp64_column_sums(dy.reshape(-1, 48)))


# ----------------------------------------------------------------------------------------------
# The Triton kernel on a GPU
# ----------------------------------------------------------------------------------------------

GPU_SHAPES = [(1, 1), (16, 1024), (33, 300), (4096, 2048), (16384, 96), (300, 260)]


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,n", GPU_SHAPES)
@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_triton_equals_reference(scaling, m, n, dtype, fp8):
    dy = draw(m, n, dtype, device="cuda", seed=m * n)
    for usage in [(True, True), (True, False), (False, True)]:
        spec = specs(fp8, usage, "cuda")[scaling]
        want = cpu_twin(spec)
        got = cd.quantize_dbias(dy, spec)
        assert_matches_cast(got, dy, spec, want, (scaling, m, n, dtype, fp8, usage))


@pytest.mark.gpu
@requires_triton
def test_triton_launches():
    """Delayed: one launch while one row block covers the rows, plus the partial sums' sum
    with several; current: one launch for a small dy."""
    fp8 = torch.float8_e5m2
    small, large = draw(16, 1024, torch.bfloat16, "cuda"), draw(8192, 1024, torch.bfloat16, "cuda")
    cases = [(small, "delayed", 1), (small, "current", 1), (large, "delayed", 2)]
    for dy, scaling, want in cases:
        spec = specs(fp8, device="cuda")[scaling]
        cd.quantize_dbias(dy, spec)  # compile outside the count
        count = count_device_ops(lambda dy=dy, spec=spec: cd.quantize_dbias(dy, spec))
        if count == 0:
            pytest.skip("the profiler records no GPU activity here")
        assert count == want, (tuple(dy.shape), scaling, count)


@pytest.mark.gpu
@requires_triton
def test_triton_nonfinite_and_large_values():
    """A NaN gives a NaN scale_inv and NaN sums in its column (current); inf saturates
    (delayed), as the cast alone does."""
    dy = draw(64, 256, torch.bfloat16, "cuda")
    dy[3, 5] = float("nan")
    dy[7, 9] = float("inf")
    for scaling in ("delayed", "current"):
        spec = specs(torch.float8_e4m3fn, device="cuda")[scaling]
        want = cpu_twin(spec)
        data, data_t, scale_inv, dbias = cd.quantize_dbias(dy, spec)
        *ref, ref_scale_inv = ct.quantize_reference(dy.cpu(), want)
        assert torch.equal(data.cpu().view(torch.uint8), ref[0].view(torch.uint8))
        assert torch.equal(data_t.cpu().view(torch.uint8), ref[1].view(torch.uint8))
        torch.testing.assert_close(scale_inv.cpu(), ref_scale_inv, rtol=0, atol=0, equal_nan=True)
        assert dbias[5].isnan() and dbias[9].isinf()
        assert_close_to_scale(dbias[10:], fp64_column_sums(dy.cpu())[10:].cuda(), torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# The Triton kernel under Triton's CPU interpreter (where triton is installed)
# ----------------------------------------------------------------------------------------------

# Runs in a fresh process: TRITON_INTERPRET must be set before the kernel is defined. Small
# tiles over several column tiles and row steps; `sms` picks several row blocks (partial sums)
# or one. The bytes come from _fp8_codec's integer encoder there, so they are compared exactly.
INTERPRETER_SCRIPT = """
import torch
from tolerances import representable
from torchte.kernels import cast_dbias as cd
from torchte.kernels import cast_transpose as ct
from torchte.kernels.cast_spec import CastSpec

def draw(m, n, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    dy = representable((m, n), torch.bfloat16, scale=4.0, generator=gen)
    dy.view(-1)[::37] *= 64
    return dy.to(dtype)

def check(dy, fp8, scaling, usage, config, sms):
    where = (tuple(dy.shape), dy.dtype, fp8, scaling, usage, config, sms)
    if scaling == "delayed":
        spec = CastSpec(fp8, *usage, torch.tensor([8.0]), torch.tensor([0.25]))
        want = CastSpec(fp8, *usage, torch.tensor([8.0]), torch.tensor([0.25]))
    else:
        spec = want = CastSpec(fp8, *usage)
    data, data_t, scale_inv, dbias = cd._cast_dbias_triton(dy, spec, config, sms)
    *ref, ref_scale_inv = ct.quantize_reference(dy, want)
    for g, w in zip((data, data_t), ref):
        assert (g is None) == (w is None), where
        if g is not None:
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), where
    assert torch.equal(scale_inv, ref_scale_inv), where
    if scaling == "delayed":
        assert torch.equal(spec.amax, want.amax), where
    assert dbias.dtype == dy.dtype and torch.equal(dbias, dy.double().sum(0).to(dy.dtype)), where

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
i = 0
for m, n, config, sms in [(1, 1, (16, 16, 4), 1), (17, 40, (16, 16, 4), 1),
                          (70, 9, (16, 16, 4), 8), (33, 50, (32, 16, 4), 4)]:
    for dtype in [torch.float32, torch.bfloat16, torch.float16]:
        for scaling in ["delayed", "current"]:
            i += 1
            check(draw(m, n, dtype, i), FP8[i % 2], scaling, (True, True), config, sms)
for usage in [(True, False), (False, True), (False, False)]:
    check(draw(40, 24, torch.bfloat16, 7), FP8[0], "delayed", usage, (16, 16, 4), 4)
# Past small_tile's bound: current scaling with its amax pass first.
check(draw(300, 260, torch.bfloat16, 9), FP8[1], "current", (True, True), (32, 64, 4), 2)
print("ok")
"""


@requires_interpreter
def test_triton_kernel_in_interpreter_matches_reference():
    run_under_interpreter(INTERPRETER_SCRIPT)
