"""te.Fp8Padding / te.Fp8Unpadding against a plain PyTorch reference (split, append zero rows,
concatenate): the same values and gradients, bit for bit (they only move rows)."""

from __future__ import annotations

import pytest
import torch
from tolerances import representable

import torchte as te
from torchte import recipe
from torchte.quantization.float8 import Float8CurrentScalingQuantizer

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def round_up(m: int, align: int) -> int:
    return -(-m // align) * align


def pad_reference(x: torch.Tensor, sizes: list[int], align: int) -> torch.Tensor:
    """(T, H) -> (P, H): each group's rows, then zero rows up to a multiple of align."""
    parts = []
    for part, m in zip(torch.split(x, sizes), sizes, strict=True):
        parts += [part, x.new_zeros(round_up(m, align) - m, x.shape[-1])]
    return torch.cat(parts)


def unpad_reference(y: torch.Tensor, sizes: list[int], align: int) -> torch.Tensor:
    """(P, H) -> (T, H): the first m rows of each padded group."""
    padded = [round_up(m, align) for m in sizes]
    return torch.cat([part[:m] for part, m in zip(torch.split(y, padded), sizes, strict=True)])


def check_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert torch.equal(actual.view(torch.uint8), expected.view(torch.uint8))


def inputs(rows: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    return representable((rows, hidden), dtype).to(dtype).requires_grad_()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("sizes", "align"),
    [([3, 0, 17, 16, 1], 16), ([5], 8), ([1, 31, 33], 32), ([0, 7], 128), ([0, 0], 16)],
)
def test_padding_matches_the_reference(sizes, align, dtype):
    hidden = 13
    x = inputs(sum(sizes), hidden, dtype)
    out, padded = te.Fp8Padding(len(sizes), align_size=align)(x, sizes)
    assert padded == [round_up(m, align) for m in sizes]
    x_ref = x.detach().clone().requires_grad_()
    out_ref = pad_reference(x_ref, sizes, align)
    check_same(out, out_ref)
    grad = representable(tuple(out.shape), dtype).to(dtype)
    out.backward(grad)
    out_ref.backward(grad)
    check_same(x.grad, x_ref.grad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("sizes", "align"), [([3, 0, 17, 16, 1], 16), ([2, 5, 11], 8)])
def test_unpadding_matches_the_reference(sizes, align, dtype):
    hidden = 7
    y = inputs(sum(round_up(m, align) for m in sizes), hidden, dtype)
    out = te.Fp8Unpadding(len(sizes), align_size=align)(y, sizes)
    y_ref = y.detach().clone().requires_grad_()
    out_ref = unpad_reference(y_ref, sizes, align)
    check_same(out, out_ref)
    grad = representable(tuple(out.shape), dtype).to(dtype)
    out.backward(grad)
    out_ref.backward(grad)
    check_same(y.grad, y_ref.grad)
    # The padding rows get no gradient: zero, as the reference's.
    assert sum(round_up(m, align) - m for m in sizes) > 0
    assert y.grad.abs().sum(dim=1).eq(0).sum() >= sum(round_up(m, align) - m for m in sizes)


def test_unpadding_undoes_padding_on_a_3d_input():
    sizes = [4, 9, 7]  # 20 tokens as (2, 10, H)
    x = representable((2, 10, 6), torch.float32)
    padded_x, padded = te.Fp8Padding(3)(x, sizes)
    assert padded == [16, 16, 16] and padded_x.shape == (48, 6)
    assert torch.equal(te.Fp8Unpadding(3)(padded_x, sizes), x.reshape(20, 6))


def test_aligned_splits_come_back_as_given():
    x = representable((48, 5), torch.float32)
    padding, unpadding = te.Fp8Padding(2), te.Fp8Unpadding(2)
    out, splits = padding(x, [16, 32])
    assert out is x and splits == [16, 32]
    assert unpadding(x, (16, 32)) is x


def test_alignment_comes_from_the_recipe_at_the_first_call():
    x = representable((5, 4), torch.float32)
    assert te.Fp8Padding(2)(x, [2, 3])[1] == [16, 16]  # outside autocast: DelayedScaling
    with te.autocast(recipe=recipe.Float8CurrentScaling()):
        assert te.Fp8Padding(2)(x, [2, 3])[1] == [16, 16]
    mxfp8 = te.Fp8Padding(2)
    with te.autocast(recipe=recipe.MXFP8BlockScaling()):
        assert mxfp8(x, [2, 3])[1] == [32, 32]
    assert mxfp8.align_size == 32 and mxfp8(x, [2, 3])[1] == [32, 32]  # kept, as TE does
    with te.autocast(recipe=recipe.NVFP4BlockScaling()):
        unpadding = te.Fp8Unpadding(2)
        assert unpadding(representable((256, 4), torch.float32), [2, 3]).shape == (5, 4)
    assert unpadding.align_size == 128


def test_without_grad_mode():
    x = inputs(5, 3, torch.float32)
    with torch.no_grad():
        out, _ = te.Fp8Padding(1, align_size=4)(x, [5])
        back = te.Fp8Unpadding(1, align_size=4)(out, [5])
    assert not out.requires_grad and torch.equal(back, x.detach())


def test_split_sizes_from_a_cpu_tensor():
    x = representable((10, 3), torch.float32)
    out, padded = te.Fp8Padding(2)(x, torch.tensor([4, 6]))
    assert padded == [16, 16] and torch.equal(out, pad_reference(x, [4, 6], 16))


def test_bad_arguments_are_refused_before_any_work():
    x = representable((10, 3), torch.float32)
    with pytest.raises(ValueError, match="num_gemms"):
        te.Fp8Padding(0)
    with pytest.raises(ValueError, match="align_size"):
        te.Fp8Unpadding(2, align_size=0)
    with pytest.raises(ValueError, match="3 entries, but the layer has 2 GEMMs"):
        te.Fp8Padding(2)(x, [3, 3, 4])
    with pytest.raises(ValueError, match="sum to 9, not to the token count 10"):
        te.Fp8Padding(2)(x, [4, 5])
    with pytest.raises(ValueError, match="non-negative"):
        te.Fp8Padding(2)(x, [12, -2])
    with pytest.raises(ValueError, match="inp has 10 rows"):
        te.Fp8Unpadding(2)(x, [4, 6])
    with pytest.raises(TypeError, match="list of ints"):
        te.Fp8Padding(2)(x, [4.0, 6.0])
    with pytest.raises(TypeError, match="on the host"):
        te.Fp8Padding(2)(x, torch.tensor([4, 6], device="meta"))
    with pytest.raises(ValueError, match="row and a hidden dimension"):
        te.Fp8Padding(1)(torch.zeros(4), [4])
    fp8 = Float8CurrentScalingQuantizer(torch.float8_e4m3fn, internal=False).quantize(x)
    with pytest.raises(TypeError, match="high-precision"):
        te.Fp8Padding(2)(fp8, [4, 6])


@pytest.mark.gpu
def test_on_the_gpu_as_on_the_cpu():
    sizes = [3, 0, 17, 16, 1]
    x_cpu = inputs(sum(sizes), 64, torch.bfloat16)
    x_gpu = x_cpu.detach().cuda().requires_grad_()
    out_cpu, _ = te.Fp8Padding(5)(x_cpu, sizes)
    out_gpu, _ = te.Fp8Padding(5)(x_gpu, sizes)
    check_same(out_gpu.cpu(), out_cpu.detach())
    grad = representable(tuple(out_cpu.shape), torch.bfloat16).to(torch.bfloat16)
    out_cpu.backward(grad)
    out_gpu.backward(grad.cuda())
    check_same(x_gpu.grad.cpu(), x_cpu.grad)
    back = te.Fp8Unpadding(5)(out_gpu, sizes)
    check_same(back.detach().cpu(), x_cpu.detach())
