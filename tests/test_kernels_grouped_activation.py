"""The grouped scaled-activation kernels of the fused grouped MLP
(kernels/grouped_activation_fp8.py) against their composition: the activation (scaled per row)
and its backward, then the grouped cast. Byte for byte on the GPU (the CPU runs the composition
itself), sums within their order."""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_close, assert_same_tensors

from torchte.kernels.activation import activation_forward
from torchte.kernels.cast_spec import CastSpec
from torchte.kernels.grouped_activation_fp8 import (
    scaled_activation_backward_grouped_fp8,
    scaled_activation_grouped_fp8,
)
from torchte.kernels.grouped_cast import grouped_offsets, quantize_grouped
from torchte.kernels.scaled_activation import (
    row_dots,
    scaled_activation_backward,
    scaled_activation_forward,
)
from torchte.quantization.grouped_quantizer import GroupedQuantizer

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
SPLITS = [16, 0, 48, 32]  # an expert without tokens among them


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaling", ["delayed", "current"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ["swiglu", "glu"])
def test_scaled_activation_grouped_fp8_equals_activation_then_grouped_cast(
    device, scaling, dtype, name
):
    """The fused kernel writes the bytes, amaxes and scale_invs of the activation, the scaling
    and the grouped cast done one after the other."""
    gen = torch.Generator().manual_seed(3)
    tokens = sum(SPLITS) + 5
    splits = [*SPLITS[:-1], SPLITS[-1] + 5]  # a group not a multiple of 16 rows
    h = (torch.randn(tokens, 96, generator=gen) * 3).to(device, dtype)
    s = torch.rand(tokens, generator=gen).to(device)
    rows, cols = grouped_offsets(splits, device)
    outputs = []
    for fused in (True, False):
        spec = _grouped_spec(scaling, device, torch.float8_e4m3fn, (True, True))
        if fused:
            out = scaled_activation_grouped_fp8(h, s, name, 7.0, 1.702, splits, rows, cols, spec)
        else:
            a = scaled_activation_forward(h, s, name)
            out = quantize_grouped(a, splits, rows, cols, spec)
        outputs.append((*out, spec.amax))
    assert_same_tensors(*outputs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaling", ["delayed", "current"])
@pytest.mark.parametrize(("name", "usage"), [("swiglu", (True, True)), ("gelu", (False, True)),
                                             ("clamped_swiglu", (True, False)),
                                             ("glu", (True, True))])  # fmt: skip
def test_scaled_activation_backward_grouped_fp8_equals_backward_then_grouped_cast(
    device, scaling, name, usage
):
    """dh's bytes, amaxes and scale_invs as the backward then the grouped cast; ds as
    scaled_activation_backward's (summed in another order on a GPU)."""
    gen = torch.Generator().manual_seed(5)
    splits = [*SPLITS[:-1], SPLITS[-1] + 5]
    tokens, n = sum(splits), 80
    k = 2 * n if name != "gelu" else n
    h = (torch.randn(tokens, k, generator=gen) * 3).to(device, torch.bfloat16)
    dy = torch.randn(tokens, n, generator=gen).to(device, torch.bfloat16)
    s = torch.rand(tokens, generator=gen).to(device)
    rows, cols = grouped_offsets(splits, device)
    outputs = []
    for fused in (True, False):
        spec = _grouped_spec(scaling, device, torch.float8_e5m2, usage)
        if fused:
            *out, ds, dbias = scaled_activation_backward_grouped_fp8(
                dy, h, s, name, 7.0, 1.702, splits, rows, cols, spec, (True, True)
            )
        else:
            dh, ds = scaled_activation_backward(dy, h, s, name, 7.0, 1.702, True)
            out = quantize_grouped(dh, splits, rows, cols, spec)
            dbias = torch.stack([part.float().sum(0) for part in dh.split(splits)])
        outputs.append((*out, spec.amax, ds, dbias))
    got, want = outputs
    assert_close(got[-1], want[-1], torch.bfloat16)  # dbias: sums of dh in bf16
    got, want = got[:-1], want[:-1]
    assert_same_tensors(got[:-1], want[:-1])
    if device == "cpu":
        assert torch.equal(got[-1], want[-1])
    else:  # fp32 sums in another order: off by a few ulps of the sum of |terms|
        a = activation_forward(h, name)
        bound = 4 * torch.finfo(torch.float32).eps * row_dots(dy.abs(), a.abs()) + 1e-6
        assert ((got[-1] - want[-1]).abs() <= bound).all()


def _grouped_spec(scaling: str, device, fp8_dtype, usage) -> CastSpec:
    """A grouped CastSpec of 4 groups: fixed delayed scales and a zero amax, or current."""
    if scaling == "delayed":
        scale = torch.tensor([0.5, 1.0, 2.0, 4.0], device=device)
        return _DelayedVectors(scale, torch.zeros(4, device=device), fp8_dtype).cast_spec(*usage)
    return GroupedQuantizer(fp8_dtype).cast_spec(*usage)


class _DelayedVectors:
    """A delayed-scaling GroupedQuantizer stand-in holding its own (G,) scale and amax."""

    def __init__(self, scale, amax, fp8_dtype=torch.float8_e4m3fn) -> None:
        self.scale, self.amax, self.fp8_dtype = scale, amax, fp8_dtype

    def cast_spec(self, rowwise, columnwise):
        return CastSpec(self.fp8_dtype, rowwise, columnwise, self.scale, self.amax)
