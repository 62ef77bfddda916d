"""MXFP8Quantizer and MXFP8TensorStorage (quantization/mxfp8.py): the Storage contract (usages,
saving, copying, GEMM operands), the quantizer's Transformer Engine surface, grouped
quantization and bad input. The bytes themselves are tested in test_kernels_mxfp8.py."""

from __future__ import annotations

import pytest
import torch
from tolerances import representable

from torchte.constants import DType
from torchte.kernels import mxfp8_cast as mx
from torchte.quantization.base import GemmOperand, QuantizedStorage
from torchte.quantization.mxfp8 import MXFP8Quantizer, MXFP8TensorStorage

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def sample(shape=(2, 48, 96), dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    """Values exact in bf16, with blocks of different magnitudes (different codes)."""
    gen = torch.Generator().manual_seed(seed)
    x = representable(shape, torch.bfloat16, scale=4.0, generator=gen)
    x = x * torch.pow(2.0, torch.randint(-6, 7, (*shape[:-1], 1), generator=gen).float())
    return x.to(dtype)


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def same_storage(a: MXFP8TensorStorage, b: MXFP8TensorStorage) -> bool:
    """Same shape, dtype, and the same bytes in every tensor (None where the other has None)."""
    if (a.shape, a.fp8_dtype) != (b.shape, b.fp8_dtype):
        return False
    for ta, tb in zip(a.get_data_tensors(), b.get_data_tensors(), strict=True):
        if (ta is None) != (tb is None) or (ta is not None and not torch.equal(u8(ta), u8(tb))):
            return False
    return True


# ----------------------------------------------------------------------------------------------
# Quantize and dequantize
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_makes_the_kernel_bytes(fp8_dtype, dtype):
    x = sample(dtype=dtype)
    s = MXFP8Quantizer(fp8_dtype).quantize(x)
    assert isinstance(s, QuantizedStorage) and not isinstance(s, torch.Tensor)
    assert s.shape == (2, 48, 96) and s.num_rows == 96 and s.fp8_dtype == fp8_dtype
    assert s.device == x.device and s.two_d is False
    want = mx.mxfp8_quantize_reference(x.reshape(96, 96), fp8_dtype, True, True)
    for got, ref in zip(
        (s.rowwise_data, s.rowwise_scale_inv, s.columnwise_data, s.columnwise_scale_inv),
        want,
        strict=True,
    ):
        assert torch.equal(u8(got), u8(ref))
    assert s.rowwise_data.shape == s.columnwise_data.shape == (96, 96)  # not transposed
    y = s.dequantize()
    assert y.shape == x.shape and y.dtype == torch.float32
    ref = mx.mxfp8_dequantize_reference(want[0], want[1], True, torch.float32).reshape(x.shape)
    assert torch.equal(y, ref)
    assert s.dequantize(torch.bfloat16).dtype == torch.bfloat16
    # Close to x: within an FP8 step of each block's scale.
    step = 2.0**-3 if fp8_dtype == E4M3 else 2.0**-2
    amax = x.float().abs().reshape(96, 3, 32).amax(-1, keepdim=True)
    err = (y.float() - x.float()).abs().reshape(96, 3, 32)
    assert (err <= amax * step).all()


def test_usages_from_the_constructor_and_the_call():
    x = sample()
    both = MXFP8Quantizer(E4M3).quantize(x)
    rowwise_q = MXFP8Quantizer(E4M3, columnwise=False)
    rowwise = rowwise_q.quantize(x)
    assert rowwise.columnwise_data is None and rowwise.columnwise_scale_inv is None
    assert torch.equal(u8(rowwise.rowwise_data), u8(both.rowwise_data))
    columnwise = rowwise_q.quantize(x, rowwise=False, columnwise=True)
    assert columnwise.rowwise_data is None
    assert torch.equal(u8(columnwise.columnwise_data), u8(both.columnwise_data))
    both.update_usage(rowwise_usage=False)  # dequantize now reads the columnwise copy
    assert torch.equal(columnwise.dequantize(), both.dequantize())
    rowwise_q.set_usage(columnwise=True)
    assert rowwise_q.quantize(x).columnwise_data is not None
    assert rowwise_q(x).rowwise_data is not None  # Transformer Engine's call form


def test_two_d_quantization_shares_one_code_per_32x32_block():
    x = sample((64, 96), torch.float32)
    s = MXFP8Quantizer(E4M3, with_2d_quantization=True).quantize(x)
    assert s.two_d
    assert torch.equal(u8(s.rowwise_data), u8(s.columnwise_data))
    codes = s.rowwise_scale_inv[:64, :3]
    assert torch.equal(codes, codes[::32].repeat_interleave(32, 0))
    assert torch.equal(s.columnwise_scale_inv[:2, :96], codes[::32].repeat_interleave(32, 1))


def test_zero_rows_and_gradients():
    s = MXFP8Quantizer(E4M3).quantize(torch.zeros(0, 4, 64))
    assert s.shape == (0, 4, 64) and s.num_rows == 0
    assert s.dequantize().shape == (0, 4, 64)
    assert s.gemm_operand("columnwise").data.shape == (64, 0)
    x = sample((32, 64), torch.float32).requires_grad_()
    assert MXFP8Quantizer(E4M3).quantize(x).rowwise_data.requires_grad is False


# ----------------------------------------------------------------------------------------------
# The Storage contract
# ----------------------------------------------------------------------------------------------


def test_update_usage_drops_and_refuses_to_remake():
    x = sample()
    s = MXFP8Quantizer(E4M3).quantize(x)
    before = s.dequantize()
    s.update_usage()  # None: nothing changes
    assert s.rowwise_data is not None and s.columnwise_data is not None
    s.update_usage(rowwise_usage=True, columnwise_usage=False)
    assert s.columnwise_data is None and s.columnwise_scale_inv is None
    assert torch.equal(s.dequantize(), before)
    with pytest.raises(RuntimeError, match="different values"):
        s.update_usage(columnwise_usage=True)
    s.update_usage(rowwise_usage=False)
    assert all(t is None for t in s.get_data_tensors())
    with pytest.raises(RuntimeError, match="holds none"):
        s.update_usage(rowwise_usage=True)
    with pytest.raises(RuntimeError, match="holds no data"):
        s.dequantize()


@pytest.mark.parametrize("keep", ["rowwise", "columnwise"])
def test_two_d_update_usage_remakes_the_other_copy_exactly(keep):
    x = sample((96, 64), torch.bfloat16)
    quantizer = MXFP8Quantizer(E5M2, with_2d_quantization=True)
    both = quantizer.quantize(x)
    one = quantizer.quantize(x, rowwise=keep == "rowwise", columnwise=keep == "columnwise")
    if keep == "rowwise":
        one.update_usage(columnwise_usage=True, rowwise_usage=False)
        assert one.rowwise_data is None
        both.update_usage(rowwise_usage=False)
    else:
        one.update_usage(rowwise_usage=True)
    assert same_storage(one, both)


def test_prepare_and_restore():
    s = MXFP8Quantizer(E4M3).quantize(sample())
    want = s.dequantize()
    held = s.get_data_tensors()
    assert len(held) == 4 and held[2].dtype == held[3].dtype == torch.uint8
    tensors, same = s.prepare_for_saving()
    assert same is s and all(t is None for t in s.get_data_tensors())
    assert [t is h for t, h in zip(tensors, held, strict=True)] == [True] * 4
    with pytest.raises(RuntimeError, match="holds no data"):
        _ = s.device
    extra = torch.ones(1)
    rest = s.restore_from_saved([*tensors, extra])
    assert len(rest) == 1 and rest[0] is extra
    assert all(t is h for t, h in zip(s.get_data_tensors(), held, strict=True))
    assert torch.equal(s.dequantize(), want)


def test_copy_from_keeps_addresses():
    quantizer = MXFP8Quantizer(E4M3)
    dst = quantizer.quantize(sample(seed=1))
    src = quantizer.quantize(sample(seed=2))
    addresses = [t.data_ptr() for t in dst.get_data_tensors()]
    dst.copy_from_(src)
    assert [t.data_ptr() for t in dst.get_data_tensors()] == addresses
    assert same_storage(dst, src)
    rowwise_only = quantizer.quantize(sample(seed=3), columnwise=False)
    with pytest.raises(RuntimeError, match="the source has none"):
        dst.copy_from_(rowwise_only)
    assert same_storage(dst, src)  # nothing copied
    rowwise_only.copy_from_(src)  # a copy the destination lacks is skipped
    assert torch.equal(u8(rowwise_only.rowwise_data), u8(src.rowwise_data))
    with pytest.raises(RuntimeError, match="does not match"):
        dst.copy_from_(quantizer.quantize(sample((64, 96))))
    with pytest.raises(TypeError, match="MXFP8TensorStorage"):
        dst.copy_from_(torch.zeros(2, 48, 96))


def test_gemm_operands_are_the_exact_values():
    x, w = sample((64, 96), seed=4), sample((32, 96), seed=5)
    quantizer = MXFP8Quantizer(E4M3)
    x_q, w_q = quantizer.quantize(x), quantizer.quantize(w)
    a = x_q.gemm_operand("rowwise")
    assert isinstance(a, GemmOperand) and a.kind == "values" and a.scale is None
    assert a.data.shape == (64, 96) and a.data.dtype == torch.bfloat16
    assert torch.equal(a.data.float(), x_q.dequantize())  # exact in bf16
    c = x_q.gemm_operand("columnwise")
    assert c.data.shape == (96, 64)  # (K, num_rows): the reduction over the rows
    cols = mx.mxfp8_dequantize(x_q.columnwise_data, x_q.columnwise_scale_inv, False, torch.float32)
    assert torch.equal(c.data.float(), cols.t())
    assert not torch.equal(c.data.float().t(), a.data.float())  # different blocks, values
    # fprop's x @ W^T from the operands equals the product of the dequantized values.
    product = a.data.double() @ w_q.gemm_operand("rowwise").data.double().t()
    assert torch.equal(product, x_q.dequantize().double() @ w_q.dequantize().double().t())
    with pytest.raises(ValueError, match="usage"):
        x_q.gemm_operand("transposed")
    x_q.update_usage(columnwise_usage=False)
    with pytest.raises(RuntimeError, match="no columnwise data"):
        x_q.gemm_operand("columnwise")


def test_repr_names_the_value():
    s = MXFP8Quantizer(E5M2, columnwise=False).quantize(sample())
    text = repr(s)
    assert "MXFP8TensorStorage" in text and "(2, 48, 96)" in text and "float8_e5m2" in text
    assert "['rowwise']" in text
    assert "with_2d_quantization=False" in repr(MXFP8Quantizer(E4M3))


# ----------------------------------------------------------------------------------------------
# The quantizer
# ----------------------------------------------------------------------------------------------


def test_quantizer_surface():
    q = MXFP8Quantizer(DType.kFloat8E5M2, rowwise=True, columnwise=False)
    assert q.fp8_dtype == E5M2 and q.dtype == DType.kFloat8E5M2
    assert MXFP8Quantizer.fusable is False and q.amax_reduction is None
    q.amax_reduction = print  # settable (block scales need no agreement: unused)
    copy = q.copy()
    assert (copy.fp8_dtype, copy.rowwise_usage, copy.columnwise_usage) == (E5M2, True, False)
    assert copy is not q and copy.with_2d_quantization is False
    assert q.is_quantizable(torch.zeros(4, 8, 64))
    assert not q.is_quantizable(torch.zeros(64)) and not q.is_quantizable(torch.zeros(33, 64))
    assert not q.is_quantizable(torch.zeros(32, 48))
    assert q.get_scale_shape((2, 80, 160), columnwise=False) == (256, 8)
    assert q.get_scale_shape((2, 80, 160), columnwise=True) == (8, 256)
    assert q.get_columnwise_shape((2, 80, 160)) == (2, 80, 160)
    x = sample()
    q.record_amax(x)
    q.prime_scale(x, 448.0, 0)
    q.calibrate(x)  # no state: nothing to check but that they run
    assert same_storage(q.quantize(x), q.copy().quantize(x))


def test_internal_false_gives_the_tensor_form():
    from torchte.quantization.block_tensor import MXFP8Tensor

    x = sample()
    tensor = MXFP8Quantizer(E4M3, internal=False).quantize(x)
    assert isinstance(tensor, MXFP8Tensor) and tensor.shape == x.shape and tensor.dtype == x.dtype
    assert same_storage(tensor._storage, MXFP8Quantizer(E4M3).quantize(x))


def test_quantizer_bad_input():
    with pytest.raises(TypeError, match="fp8_dtype"):
        MXFP8Quantizer(torch.bfloat16)
    with pytest.raises(TypeError, match="fp8_dtype"):
        MXFP8Quantizer(DType.kBFloat16)
    q = MXFP8Quantizer(E4M3)
    with pytest.raises(ValueError, match=r"x_hp: the number of rows .*\b40\b.* block of 32"):
        q.quantize(torch.zeros(4, 10, 64))
    with pytest.raises(ValueError, match=r"x_hp: the last dimension \(size 100\).* block of 32"):
        q.quantize(torch.zeros(32, 100))
    with pytest.raises(ValueError, match="number of rows"):
        q.quantize(torch.zeros(64))  # one row
    with pytest.raises(TypeError, match="fp32, bf16 or fp16"):
        q.quantize(torch.zeros(32, 32, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        q.quantize([[0.0] * 32] * 32)


# ----------------------------------------------------------------------------------------------
# Grouped (MoE) quantization
# ----------------------------------------------------------------------------------------------


def test_quantize_grouped_is_each_group_on_its_own():
    x = sample((160, 64), torch.bfloat16)
    splits = [64, 0, 32, 64]
    q = MXFP8Quantizer(E4M3)
    groups = q.quantize_grouped(x, splits)
    assert len(groups) == 4 and groups[1].shape == (0, 64)
    start = 0
    for g, m in zip(groups, splits, strict=True):
        assert same_storage(g, q.quantize(x[start : start + m]))
        start += m
    rowwise = q.quantize_grouped(x, splits, columnwise=False)
    assert all(g.columnwise_data is None for g in rowwise)
    assert q.quantize_grouped(torch.zeros(0, 64), []) == []


def test_quantize_grouped_bad_splits():
    q = MXFP8Quantizer(E4M3)
    x = torch.zeros(96, 64)
    with pytest.raises(ValueError, match=r"m_splits\[1\] = 48.*multiple of the MXFP8 block of 32"):
        q.quantize_grouped(x, [32, 48, 16])
    with pytest.raises(ValueError, match="sum to 64"):
        q.quantize_grouped(x, [32, 32])
    with pytest.raises(ValueError, match="2-D"):
        q.quantize_grouped(torch.zeros(2, 48, 64), [96])
