"""Activations written straight in 1x128 block FP8 on the GPU (kernels/activation_block.py through
quantization/fused_block_act.py): the fused kernels against the unfused composition the
modules run today on the same device (activation_forward / activation_backward, then
Float8BlockQuantizer.quantize, and dh.sum(0)), bytes and scales bit for bit; against the CPU
(the torch references: bytes equal for relu-like activations, else within one FP8 step);
dbias within the tolerance table; other launch configurations; launches per call.
"""

from __future__ import annotations

import pytest
import torch
from launches import count_device_ops
from test_kernels_activation_block import close_sums, quantizer, same, special
from tolerances import assert_close

from torchte.kernels import activation as act
from torchte.kernels import activation_block as ab
from torchte.kernels._triton import triton_available
from torchte.kernels.cast_spec import CastSpec
from torchte.quantization.blockwise import Float8BlockwiseQTensorStorage
from torchte.quantization.fused_block_act import (
    activation_grad_to_block,
    activation_to_block,
    quantize_with_dbias,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
LIMIT, ALPHA = 7.0, 1.702
RELU_LIKE = {"relu", "reglu", "srelu", "sreglu"}
# (rows, N): one partial tile; odd sizes over several tiles (gated: dh tiles straddling the
# halves where N % 128 != 0); whole tiles.
SHAPES = [(1, 40), (127, 131), (1023, 750), (256, 384)]
SETTINGS = [
    (torch.bfloat16, E4M3, True, (True, True)),
    (torch.float32, E5M2, False, (False, True)),
    (torch.float16, E4M3, False, (True, False)),
]

requires_triton = pytest.mark.skipif(not triton_available(), reason="needs a CUDA GPU and Triton")
pytestmark = [pytest.mark.gpu, requires_triton]


def near(got: Float8BlockwiseQTensorStorage, want: Float8BlockwiseQTensorStorage, exact, where):
    """GPU storage against the CPU reference's: the same bytes (exact), else the same NaN and
    values within one FP8 step, copy by copy."""
    if exact:
        return same(_cpu(got), want, where)
    for usage in ("rowwise", "columnwise"):
        data = getattr(got, f"{usage}_data")
        assert (data is None) == (getattr(want, f"{usage}_data") is None), where
        if data is None:
            continue
        value = _copy_values(got, usage).cpu()
        ref = _copy_values(want, usage)
        nan = torch.isnan(ref)
        assert torch.equal(torch.isnan(value), nan), where
        assert_close(value[~nan], ref[~nan], got.fp8_dtype, msg=str(where))


def _copy_values(storage: Float8BlockwiseQTensorStorage, usage: str) -> torch.Tensor:
    """The values of one copy (rowwise (M, C) or columnwise (C, M)), fp32."""
    data, scale = getattr(storage, f"{usage}_data"), getattr(storage, f"{usage}_scale_inv")
    return data.float() * scale.t().repeat_interleave(128, dim=1)[:, : data.shape[1]]


def _cpu(storage: Float8BlockwiseQTensorStorage) -> Float8BlockwiseQTensorStorage:
    tensors = [None if t is None else t.cpu() for t in storage.get_data_tensors()]
    rowwise, columnwise, rowwise_scale, columnwise_scale = tensors
    return Float8BlockwiseQTensorStorage(
        rowwise, rowwise_scale, columnwise, columnwise_scale, storage.fp8_dtype, storage.shape, 1
    )


@pytest.mark.parametrize("name", act.ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_equals_unfused_on_gpu(name, shape):
    rows, n = shape
    for i, (dtype, fp8, power_2, usage) in enumerate(SETTINGS):
        h, _ = special(name, (rows,), n, dtype, seed=i)
        q = quantizer(fp8, power_2)
        where = (name, shape, dtype)
        got = activation_to_block(q, h.cuda(), name, LIMIT, ALPHA, usage[1], (rows, n))
        a = act.activation_forward(h.cuda(), name, LIMIT, ALPHA)
        same(got, q.quantize(a, rowwise=True, columnwise=usage[1]), where)
        want = activation_to_block(q, h, name, LIMIT, ALPHA, usage[1], (rows, n))
        near(got, want, name in RELU_LIKE, where)


@pytest.mark.parametrize("name", act.ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES)
def test_backward_equals_unfused_on_gpu(name, shape):
    rows, n = shape
    for i, (dtype, fp8, power_2, usage) in enumerate(SETTINGS):
        h, da = special(name, (rows,), n, dtype, seed=10 + i)
        q = quantizer(fp8, power_2)
        where = (name, shape, dtype, usage)
        hc, dac = h.cuda(), da.cuda()
        got, dbias = activation_grad_to_block(q, dac, hc, name, LIMIT, ALPHA, usage, h.shape)
        dh = act.activation_backward(dac, hc, name, LIMIT, ALPHA)
        same(got, q.quantize(dh, rowwise=usage[0], columnwise=usage[1]), where)
        close_sums(dbias.cpu(), dh.sum(0).to(da.dtype).cpu(), dtype, where)
        want, dbias_ref = activation_grad_to_block(q, da, h, name, LIMIT, ALPHA, usage, h.shape)
        near(got, want, name in RELU_LIKE, where)
        close_sums(dbias.cpu(), dbias_ref, dtype, where)


@pytest.mark.parametrize("shape", [(1, 1), (127, 131), (1023, 1500), (3, 5, 256)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_quantize_with_dbias_equals_quantize_on_gpu(shape, dtype):
    dy, _ = special("gelu", shape[:-1], shape[-1], dtype, seed=3)
    for usage in [(True, True), (True, False), (False, True), (False, False)]:
        q = quantizer(E4M3, usage[0])
        got, dbias = quantize_with_dbias(q, dy.cuda(), usage, dy.shape)
        same(got, q.quantize(dy.cuda(), rowwise=usage[0], columnwise=usage[1]), (shape, usage))
        want, dbias_ref = quantize_with_dbias(q, dy, usage, dy.shape)
        same(_cpu(got), want, (shape, usage))  # the 1x128 cast's bytes equal the CPU's
        close_sums(dbias.cpu(), dbias_ref, dtype, (shape, usage))
        unfused = dy.cuda().reshape(-1, shape[-1]).sum(0).cpu()
        close_sums(dbias.cpu(), unfused, dtype, (shape, usage))


@pytest.mark.parametrize("config", [(4, 64), (8, 1), (8, 8), (2, 4)])
def test_other_configurations_give_the_same_bytes(config):
    spec = CastSpec(E4M3, True, True, power_2_scale=True)
    for name in ("swiglu", "gelu"):
        kind, gated = act._SPECS[name]
        h, da = special(name, (1031,), 1000, torch.bfloat16, seed=5)
        h, da = h.cuda(), da.cuda()
        fwd = ab._forward_triton(h, 1000, kind, gated, LIMIT, ALPHA, spec, config)
        same_outputs(fwd, ab.activation_forward_block(h, name, LIMIT, ALPHA, spec), config)
        bwd = ab._backward_triton(da, h, 1000, kind, gated, LIMIT, ALPHA, spec, config)
        default = ab.activation_backward_block(da, h, name, LIMIT, ALPHA, spec)
        same_outputs(bwd[:4], default[:4], config)
        # The sums within a tile follow the layout (num_warps): equal within the tolerance.
        close_sums(bwd[4].cpu(), default[4].cpu(), torch.bfloat16, config)


def same_outputs(got, want, where) -> None:
    for a, b in zip(got, want, strict=True):
        assert (a is None) == (b is None), where
        if a is not None:
            bits = torch.int32 if a.dtype == torch.float32 else torch.uint8
            assert torch.equal(a.view(bits), b.view(bits)), where


def test_launches_per_call():
    q = quantizer()
    h, da = special("swiglu", (512,), 384, torch.bfloat16)
    h, da = h.cuda(), da.cuda()

    def forward():
        activation_to_block(q, h, "swiglu", LIMIT, ALPHA, True, (512, 384))

    def backward():
        activation_grad_to_block(q, da, h, "swiglu", LIMIT, ALPHA, (True, True), h.shape)

    def dbias():
        quantize_with_dbias(q, da, (True, True), da.shape)

    for fn, launches in ((forward, 1), (backward, 2), (dbias, 2)):
        fn()
        assert count_device_ops(fn) == launches, fn.__name__


def test_large_gated_backward_is_deterministic():
    h, da = special("swiglu", (4096,), 2048, torch.bfloat16, seed=8)
    h, da = h.cuda(), da.cuda()
    spec = CastSpec(E4M3, True, True, power_2_scale=True)
    first = ab.activation_backward_block(da, h, "swiglu", LIMIT, ALPHA, spec)
    again = ab.activation_backward_block(da, h, "swiglu", LIMIT, ALPHA, spec)
    same_outputs(first, again, "repeat")
    dh = act.activation_backward(da, h, "swiglu", LIMIT, ALPHA)
    close_sums(first[4].cpu(), dh.sum(0).cpu(), torch.bfloat16, "large")
