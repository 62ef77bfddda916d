"""NVFP4Quantizer and NVFP4TensorStorage: Transformer Engine's keywords, the Storage contract
(dequantize, update_usage, saving, copy_from_, gemm_operand), the RHT'd wgrad operands, amax
reduction, stochastic rounding drawn from torch's generator, bad input."""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_close

from torchte.kernels import nvfp4_cast as nv
from torchte.kernels.hadamard import TE_SIGN_MASK, hadamard_matrix
from torchte.quantization.base import GemmOperand
from torchte.quantization.nvfp4 import NVFP4Quantizer, NVFP4TensorStorage

RHT = {"with_rht": True, "with_post_rht_amax": True}
KINDS = {"1d": {}, "rht": RHT, "2d": {"with_2d_quantization": True}}


def values(shape, dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 2).to(dtype)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# NVFP4 rounds to 1 + 3 levels per binade over a block's range: a relative error (Frobenius)
# of about 0.1 for Gaussian data; 0.15 bounds it with room.
NVFP4_REL_ERR = 0.15


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(2, 24, 64), (48, 80), (16, 16)], ids=str)
def test_quantize_layout_and_dequantize(shape, kind):
    x = values(shape)
    storage = NVFP4Quantizer(**KINDS[kind]).quantize(x)
    rows, cols = storage.num_rows, shape[-1]
    assert isinstance(storage, NVFP4TensorStorage) and storage.shape == shape
    assert storage.rowwise_data.shape == (rows, cols // 2)
    assert storage.columnwise_data.shape == (cols, rows // 2)
    assert storage.rowwise_scale_inv.shape == nv.scale_shape(rows, cols)
    assert storage.columnwise_scale_inv.shape == nv.scale_shape(cols, rows)
    assert storage.rowwise_data.dtype == storage.rowwise_scale_inv.dtype == torch.uint8
    assert storage.amax_rowwise.shape == storage.amax_columnwise.shape == (1,)
    assert storage.device == x.device and storage.fp8_dtype == torch.float4_e2m1fn_x2
    out = storage.dequantize(torch.bfloat16)
    assert out.shape == shape and out.dtype == torch.bfloat16
    assert rel_err(out, x) < NVFP4_REL_ERR
    # The rowwise copy dequantizes as Transformer Engine's formula says.
    data, scale, amax = storage.rowwise_data, storage.rowwise_scale_inv, storage.amax_rowwise
    assert torch.equal(out.reshape(rows, cols), nv.dequantize(data, scale, amax, torch.bfloat16))


def test_columnwise_only_dequantize():
    x = values((48, 32), torch.float32, seed=1)
    plain = NVFP4Quantizer().quantize(x, rowwise=False)
    data, scale, amax = plain.columnwise_data, plain.columnwise_scale_inv, plain.amax_columnwise
    assert torch.equal(plain.dequantize(), nv.dequantize(data, scale, amax, torch.float32).t())
    rht = NVFP4Quantizer(**RHT).quantize(x, rowwise=False)
    assert rht.rowwise_data is None and rht.amax_rowwise is None
    undone = rht.dequantize()
    assert rel_err(undone, x) < NVFP4_REL_ERR  # the transform undone: close to x again
    # ... by the transpose of the transform's matrix, in fp64.
    transformed = nv.dequantize(rht.columnwise_data, rht.columnwise_scale_inv, rht.amax_columnwise,
                                torch.float32).double()  # fmt: skip
    q = hadamard_matrix(TE_SIGN_MASK)
    expected = (transformed.reshape(32, 3, 16) @ q.t()).reshape(32, 48).t()
    assert_close(undone, expected, torch.float32)
    assert rel_err(transformed.t(), x) > 0.5  # without undoing it, nothing like x


@pytest.mark.parametrize("kind", KINDS)
def test_gemm_operands(kind):
    x = values((48, 64), seed=2)
    storage = NVFP4Quantizer(**KINDS[kind]).quantize(x)
    rows_op = storage.gemm_operand("rowwise")
    cols_op = storage.gemm_operand("columnwise")
    assert isinstance(rows_op, GemmOperand) and rows_op.kind == cols_op.kind == "values"
    assert rows_op.data.shape == (48, 64) and cols_op.data.shape == (64, 48)
    assert rows_op.data.dtype == cols_op.data.dtype == torch.bfloat16
    assert rows_op.scale.shape == (1,) and rows_op.scale.dtype == torch.float32
    assert_close(rows_op.data.float() * rows_op.scale, storage.dequantize(), torch.float32)
    if kind != "rht":
        plain = NVFP4Quantizer(**KINDS[kind]).quantize(x, rowwise=False).dequantize()
        assert_close(cols_op.data.float().t() * cols_op.scale, plain, torch.float32)
    with pytest.raises(ValueError, match="usage"):
        storage.gemm_operand("both")
    storage.update_usage(rowwise_usage=False)
    with pytest.raises(RuntimeError, match="no rowwise data"):
        storage.gemm_operand("rowwise")


def test_rht_cancels_in_the_wgrad_product():
    """dy^T x from the two RHT'd columnwise operands (transformed along the tokens, which the
    GEMM reduces over) equals the product of the values dequantized with the transform undone;
    and approximates the unquantized dy^T x."""
    x, dy = values((64, 48), seed=3), values((64, 32), seed=4)
    quantizer = NVFP4Quantizer(**RHT)
    x_q, dy_q = quantizer.quantize(x), quantizer.quantize(dy)
    a, b = dy_q.gemm_operand("columnwise"), x_q.gemm_operand("columnwise")
    from_operands = (a.data.double() @ b.data.double().t()) * (a.scale * b.scale).double()
    x_q.update_usage(rowwise_usage=False)
    dy_q.update_usage(rowwise_usage=False)
    plain = dy_q.dequantize().double().t() @ x_q.dequantize().double()
    assert_close(from_operands, plain, torch.float32)
    assert rel_err(from_operands, dy.double().t() @ x.double()) < 2 * NVFP4_REL_ERR


def test_update_usage_drops_and_makes_copies_where_exact():
    x = values((48, 32), seed=5)
    two_d = NVFP4Quantizer(with_2d_quantization=True)
    full = two_d.quantize(x)
    storage = two_d.quantize(x)
    storage.update_usage(columnwise_usage=False)
    assert storage.columnwise_data is None and storage.amax_columnwise is None
    storage.update_usage(columnwise_usage=True)  # a transpose: the kernel's own bytes
    for name in ("columnwise_data", "columnwise_scale_inv", "amax_columnwise"):
        assert torch.equal(getattr(storage, name), getattr(full, name)), name
    storage.update_usage(rowwise_usage=False)
    storage.update_usage(rowwise_usage=True)
    for name in ("rowwise_data", "rowwise_scale_inv", "amax_rowwise"):
        assert torch.equal(getattr(storage, name), getattr(full, name)), name
    for kwargs, why in (({}, "1 x 16 blocks"), ({**KINDS["2d"], **RHT}, "Hadamard")):
        storage = NVFP4Quantizer(**kwargs).quantize(x, columnwise=False)
        with pytest.raises(RuntimeError, match=why):
            storage.update_usage(columnwise_usage=True)
    storage.update_usage(rowwise_usage=False)  # None left: nothing to make anything from
    with pytest.raises(RuntimeError, match="holds none"):
        storage.update_usage(rowwise_usage=True)


def test_saving_restoring_and_data_tensors():
    storage = NVFP4Quantizer().quantize(values((32, 48), seed=6))
    before = storage.dequantize()
    held = storage.get_data_tensors()
    assert len(held) == 6 and held[0] is storage.rowwise_data and held[5] is storage.amax_columnwise
    tensors, same = storage.prepare_for_saving()
    assert same is storage and all(t is None for t in storage.get_data_tensors())
    assert [t.data_ptr() for t in tensors] == [t.data_ptr() for t in held]
    with pytest.raises(RuntimeError, match="no data"):
        storage.dequantize()
    rest = storage.restore_from_saved([*tensors, "next"])
    assert rest == ["next"] and torch.equal(storage.dequantize(), before)


def test_copy_from_keeps_addresses():
    quantizer = NVFP4Quantizer(with_2d_quantization=True)
    dst, src = quantizer.quantize(values((32, 32), seed=7)), quantizer.quantize(values((32, 32)))
    addresses = [t.data_ptr() for t in dst.get_data_tensors()]
    dst.copy_from_(src)
    assert [t.data_ptr() for t in dst.get_data_tensors()] == addresses
    assert torch.equal(dst.dequantize(), src.dequantize())
    src.update_usage(columnwise_usage=False)
    with pytest.raises(RuntimeError, match="source has none"):
        dst.copy_from_(src)
    with pytest.raises(RuntimeError, match="differently"):
        dst.copy_from_(NVFP4Quantizer().quantize(values((32, 32))))
    with pytest.raises(TypeError, match="shape"):
        dst.copy_from_(quantizer.quantize(values((16, 32))))


def test_amax_reduction_gives_the_whole_tensors_scales():
    """A piece quantized with its amax reduced over the pieces (one rank here: the MAX with
    the other piece's amax) has the bytes of those rows of the whole tensor."""
    pieces = [values((32, 48), seed=8), values((16, 48), seed=9) * 4]
    quantizer = NVFP4Quantizer()
    calls = []

    def reduce_max(amax):
        calls.append(amax.shape)
        amax.copy_(torch.maximum(amax, pieces[1].float().abs().max().reshape(1)))

    quantizer.amax_reduction = reduce_max
    piece = quantizer.quantize(pieces[0])
    whole = NVFP4Quantizer().quantize(torch.cat(pieces))
    assert calls == [(1,)]
    assert torch.equal(piece.rowwise_data, whole.rowwise_data[:32])
    assert torch.equal(piece.rowwise_scale_inv[:32], whole.rowwise_scale_inv[:32])
    assert torch.equal(piece.columnwise_data, whole.columnwise_data[:, :16])
    assert torch.equal(piece.amax_columnwise, whole.amax_columnwise)
    rht = NVFP4Quantizer(**RHT)
    rht.amax_reduction = reduce_max
    rht.quantize(pieces[0])
    assert calls == [(1,)] * 3  # both amaxes reduced: they differ under RHT


def test_stochastic_rounding_draws_from_torchs_generator():
    x = values((32, 64), seed=10)
    quantizer = NVFP4Quantizer(stochastic_rounding=True, **RHT)
    torch.manual_seed(5)
    first = quantizer.quantize(x)
    torch.manual_seed(5)
    again = quantizer.quantize(x)
    third = quantizer.quantize(x)
    for a, b in zip(first.get_data_tensors(), again.get_data_tensors(), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(first.rowwise_data, third.rowwise_data)
    assert not torch.equal(first.columnwise_data, third.columnwise_data)


def test_te_keywords_and_settings():
    q = NVFP4Quantizer(
        rowwise=True, columnwise=False, with_rht=True, with_post_rht_amax=True,
        with_2d_quantization=False, stochastic_rounding=True, with_random_sign_mask=False,
        nvfp4_e4m3_max=448, nvfp4_4over6_err_mode="mse",
    )  # fmt: skip
    assert q.rht_matrix_random_sign_mask_t == 0 and q.nvfp4_4over6_err_mode == "MSE"
    assert NVFP4Quantizer().rht_matrix_random_sign_mask_t == TE_SIGN_MASK
    assert torch.equal(q.rht_matrix, hadamard_matrix(0, torch.bfloat16))
    assert NVFP4Quantizer.fusable is False and q.amax_reduction is None and q.internal
    storage = q.quantize(values((16, 32)))
    assert storage.columnwise_data is None and storage.rowwise_data is not None
    q.set_usage(columnwise=True)
    assert q.quantize(values((16, 32))).columnwise_data is not None
    copy = q.copy()
    assert copy.spec(True, True) == q.spec(True, True) and copy is not q
    q.stochastic_rounding = False  # attributes stay mutable, as in Transformer Engine
    assert not q.spec(True, True).stochastic and copy.spec(True, True).stochastic
    assert q.get_scale_shape((2, 16, 32), columnwise=True) == (128, 4)
    assert q.is_quantizable(torch.zeros(2, 8, 32)) and not q.is_quantizable(torch.zeros(8, 32))
    q.record_amax(values((16, 32)))
    q.prime_scale(values((16, 32)), 448.0, 0)
    assert "NVFP4Quantizer" in repr(q) and "rht" in repr(storage)


def test_unsupported_settings_raise():
    with pytest.raises(NotImplementedError, match="row_scaled_nvfp4"):
        NVFP4Quantizer(row_scaled_nvfp4=True)
    with pytest.raises(NotImplementedError, match="4over6"):
        NVFP4Quantizer(nvfp4_use_4over6=True)
    with pytest.raises(ValueError, match="nvfp4_e4m3_max"):
        NVFP4Quantizer(nvfp4_e4m3_max=300)
    with pytest.raises(ValueError, match="err_mode"):
        NVFP4Quantizer(nvfp4_4over6_err_mode="max")
    with pytest.raises(TypeError, match="fp4_dtype"):
        NVFP4Quantizer(torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="with_post_rht_amax"):
        NVFP4Quantizer(with_rht=True).quantize(values((16, 16)))
    tensor = NVFP4Quantizer(internal=False).quantize(values((16, 16)))
    assert type(tensor).__name__ == "NVFP4Tensor" and tensor.shape == (16, 16)


def test_bad_input():
    quantizer = NVFP4Quantizer()
    with pytest.raises(ValueError, match=r"K.*16: got 40"):
        quantizer.quantize(torch.zeros(16, 40))
    with pytest.raises(ValueError, match=r"M = prod.*16: got M = 30"):
        quantizer.quantize(torch.zeros(3, 10, 32))
    with pytest.raises(TypeError, match="fp32, bf16 or fp16"):
        quantizer.quantize(torch.zeros(16, 32, dtype=torch.float64))


def test_zero_tokens():
    storage = NVFP4Quantizer(**RHT).quantize(torch.zeros(0, 4, 32))
    assert storage.shape == (0, 4, 32) and storage.rowwise_data.shape == (0, 16)
    assert storage.dequantize().shape == (0, 4, 32)
    assert storage.gemm_operand("columnwise").data.shape == (32, 0)
