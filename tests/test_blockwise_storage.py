"""Float8BlockQuantizer and its values (Float8BlockwiseQTensorStorage, GroupedBlockwiseStorage):
the storage contract (usages, saving, copying, dequantize, GEMM operands, expert views), the
quantizer's settings and the argument checks, on the CPU (the kernels' torch references)."""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_close, representable

from torchte.constants import DType
from torchte.kernels import block_cast as bc
from torchte.kernels.block_layout import block_offsets, max_blocks
from torchte.quantization.base import GemmOperand, QuantizedStorage
from torchte.quantization.blockwise import (
    Float8BlockQuantizer,
    Float8BlockwiseQTensorStorage,
    GroupedBlockwiseStorage,
)

E4M3 = torch.float8_e4m3fn


def quantizer(block_dim: int, **kwargs) -> Float8BlockQuantizer:
    return Float8BlockQuantizer(E4M3, block_scaling_dim=block_dim, **kwargs)


def sample(shape, dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    """Values exact in e4m3 (and bf16), varied in size between rows and columns so that block
    scales differ."""
    gen = torch.Generator().manual_seed(seed)
    x = representable(shape, E4M3, scale=4.0, generator=gen)
    x = x * torch.pow(2.0, torch.randint(-3, 4, (shape[-1],), generator=gen).float())
    return x.to(dtype)


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Same bytes (or both None)."""
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def offsets_of(sizes) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)


# ----------------------------------------------------------------------------------------------
# Layouts and dequantize
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(131, 257), (2, 65, 130), (200,)])
def test_1x128_layout_and_dequantize(shape):
    x = sample(shape)
    q = quantizer(1).quantize(x)
    rows, cols = q.num_rows, shape[-1]
    assert isinstance(q, Float8BlockwiseQTensorStorage) and isinstance(q, QuantizedStorage)
    assert q.shape == shape and q.block_dim == 1
    assert q.rowwise_data.shape == (rows, cols) and q.rowwise_data.dtype == E4M3
    assert q.rowwise_scale_inv.shape == (-(-cols // 128), rows)
    assert q.columnwise_data.shape == (cols, rows)
    assert q.columnwise_scale_inv.shape == (-(-rows // 128), cols)
    assert q.device == x.device and not q.is_2D_scaled
    assert_close(q.dequantize(), x, E4M3)
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16
    q.update_usage(rowwise_usage=False)
    assert_close(q.dequantize(), x, E4M3)  # from the columnwise copy


@pytest.mark.parametrize("shape", [(131, 257), (3, 130, 260), (2, 2, 129, 5), (200,)])
def test_128x128_layout_and_dequantize(shape):
    x = sample(shape, torch.float32)
    q = quantizer(2).quantize(x)
    matrix = shape if len(shape) >= 2 else (1, *shape)
    *batch, rows, cols = matrix
    n_r, n_c = -(-rows // 128), -(-cols // 128)
    assert q.shape == shape and q.is_2D_scaled
    assert q.rowwise_data.shape == (*batch, rows, cols)
    assert q.rowwise_scale_inv.shape == (*batch, n_r, -(-n_c // 4) * 4)
    assert q.columnwise_data.shape == (*batch, cols, rows)
    assert q.columnwise_scale_inv.shape == (*batch, n_c, -(-n_r // 4) * 4)
    assert_close(q.dequantize(), x, E4M3)
    q.update_usage(rowwise_usage=False)
    assert q.rowwise_data is None and q.rowwise_scale_inv is None
    assert_close(q.dequantize(), x, E4M3)


def test_usage_choice_and_quantizer_defaults():
    x = sample((130, 140))
    q = quantizer(1, rowwise=True, columnwise=False)
    assert q.quantize(x).columnwise_data is None  # the quantizer's usage
    assert q.quantize(x, columnwise=True).columnwise_data is not None  # the call's
    q.set_usage(rowwise=False, columnwise=True)
    only_t = q.quantize(x)
    assert only_t.rowwise_data is None and only_t.columnwise_data is not None
    empty = q.quantize(x, rowwise=False, columnwise=False)
    assert empty.get_data_tensors() == (None, None, None, None) and empty.shape == (130, 140)
    with pytest.raises(RuntimeError, match="holds no data"):
        empty.device  # noqa: B018


# ----------------------------------------------------------------------------------------------
# update_usage
# ----------------------------------------------------------------------------------------------


def test_1x128_copies_are_never_made_from_each_other():
    x = sample((130, 260))
    q = quantizer(1).quantize(x)
    both = quantizer(1).quantize(x)
    q.update_usage(columnwise_usage=False)
    with pytest.raises(RuntimeError, match="separate quantizations"):
        q.update_usage(columnwise_usage=True)
    q.update_usage(rowwise_usage=True)  # held: nothing to do
    assert same(q.rowwise_data, both.rowwise_data)
    assert q.columnwise_data is None and q.columnwise_scale_inv is None
    q.update_usage()  # None leaves both as they are
    assert q.rowwise_data is not None and q.columnwise_data is None
    t = quantizer(1).quantize(x, rowwise=False)
    with pytest.raises(RuntimeError, match="cannot make the rowwise copy"):
        t.update_usage(rowwise_usage=True)


@pytest.mark.parametrize("shape", [(131, 260), (3, 130, 7)])
def test_128x128_copies_are_made_exactly_from_each_other(shape):
    x = sample(shape, torch.float32)
    full = quantizer(2).quantize(x)
    q = quantizer(2).quantize(x, columnwise=False)
    q.update_usage(columnwise_usage=True)
    assert same(q.columnwise_data, full.columnwise_data)
    assert torch.equal(q.columnwise_scale_inv, full.columnwise_scale_inv)
    t = quantizer(2).quantize(x, rowwise=False)
    t.update_usage(rowwise_usage=True, columnwise_usage=False)
    assert same(t.rowwise_data, full.rowwise_data) and t.columnwise_data is None
    assert torch.equal(t.rowwise_scale_inv, full.rowwise_scale_inv)
    t.update_usage(rowwise_usage=False)
    with pytest.raises(RuntimeError, match="holds none"):
        t.update_usage(columnwise_usage=True)


# ----------------------------------------------------------------------------------------------
# Saving, copying, repr
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_dim", [1, 2])
def test_saving_round_trip(block_dim):
    q = quantizer(block_dim).quantize(sample((130, 131)))
    held = q.get_data_tensors()
    assert len(held) == 4 and all(t is not None for t in held)
    assert held[0] is q.rowwise_data and held[3] is q.columnwise_scale_inv
    tensors, emptied = q.prepare_for_saving()
    assert emptied is q and q.get_data_tensors() == (None, None, None, None)
    extra = torch.ones(1)
    rest = q.restore_from_saved([*tensors, extra])
    assert rest == [extra]
    assert all(a is b for a, b in zip(q.get_data_tensors(), held, strict=True))


@pytest.mark.parametrize("block_dim", [1, 2])
def test_copy_from_keeps_addresses(block_dim):
    dst = quantizer(block_dim).quantize(sample((130, 140), seed=1))
    src = quantizer(block_dim).quantize(sample((130, 140), seed=2))
    addresses = [t.data_ptr() for t in dst.get_data_tensors()]
    dst.copy_from_(src)
    assert [t.data_ptr() for t in dst.get_data_tensors()] == addresses
    for a, b in zip(dst.get_data_tensors(), src.get_data_tensors(), strict=True):
        assert same(a, b)
    with pytest.raises(ValueError, match="differs"):
        dst.copy_from_(quantizer(block_dim).quantize(sample((130, 141))))
    other = 2 if block_dim == 1 else 1
    with pytest.raises(ValueError, match="block_dim"):
        dst.copy_from_(quantizer(other).quantize(sample((130, 140))))
    with pytest.raises(RuntimeError, match="has none"):
        dst.copy_from_(quantizer(block_dim).quantize(sample((130, 140)), columnwise=False))
    with pytest.raises(TypeError, match="copy_from_ needs"):
        dst.copy_from_(object())


def test_repr_names_shape_blocks_and_usage():
    q = quantizer(2).quantize(sample((4, 8)), columnwise=False)
    text = repr(q)
    assert "Float8BlockwiseQTensorStorage" in text and "128x128" in text
    assert "(4, 8)" in text and "['rowwise']" in text
    assert "block_scaling_dim=2" in repr(quantizer(2))


# ----------------------------------------------------------------------------------------------
# GEMM operands and expert views
# ----------------------------------------------------------------------------------------------


def operand_values(op: GemmOperand) -> torch.Tensor:
    """The (R, K) values an operand stands for."""
    block_dim = 1 if op.kind == "block1d" else 2
    return bc.block_dequantize(op.data, op.scale, block_dim, op.data.shape)


@pytest.mark.parametrize("block_dim", [1, 2])
def test_gemm_operands(block_dim):
    x = sample((2, 65, 200), torch.float32)
    q = quantizer(block_dim).quantize(x.reshape(130, 200) if block_dim == 2 else x)
    kind = f"block{block_dim}d"
    rows = q.gemm_operand("rowwise")
    cols = q.gemm_operand("columnwise")
    assert rows.kind == cols.kind == kind
    assert rows.data.shape == (130, 200) and cols.data.shape == (200, 130)
    if block_dim == 1:
        assert rows.scale.shape == (2, 130) and cols.scale.shape == (2, 200)
    else:
        assert rows.scale.shape == (2, 4) and cols.scale.shape == (2, 4)
    values = q.dequantize().reshape(130, 200)
    assert torch.equal(operand_values(rows), values)
    assert_close(operand_values(cols).t(), values, E4M3)
    q.update_usage(rowwise_usage=False)
    with pytest.raises(RuntimeError, match="no rowwise data"):
        q.gemm_operand("rowwise")
    with pytest.raises(ValueError, match="usage must be"):
        q.gemm_operand("both")


def test_experts_are_views_equal_to_quantizing_each_alone():
    x = sample((3, 130, 260), torch.float32, seed=3)
    x[1] *= 16
    q = quantizer(2).quantize(x)
    assert q.shape == (3, 130, 260)
    for g in range(3):
        expert = q.expert(g)
        alone = quantizer(2).quantize(x[g])
        assert expert.shape == (130, 260)
        for view, base, want in zip(
            expert.get_data_tensors(), q.get_data_tensors(), alone.get_data_tensors(), strict=True
        ):
            assert view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
            assert same(view, want)
        assert expert.gemm_operand("columnwise").data.shape == (260, 130)
    with pytest.raises(IndexError, match="out of range"):
        q.expert(3)
    with pytest.raises(ValueError, match="expert"):
        quantizer(1).quantize(x).expert(0)
    # A batch is one rowwise operand only where its tiles stack: rows a multiple of 128.
    with pytest.raises(ValueError, match="multiple of 128"):
        q.gemm_operand("rowwise")
    with pytest.raises(ValueError, match="expert"):
        q.gemm_operand("columnwise")
    stacked = quantizer(2).quantize(sample((2, 128, 200), torch.float32)).gemm_operand("rowwise")
    assert stacked.data.shape == (256, 200) and stacked.scale.shape == (2, 4)


# ----------------------------------------------------------------------------------------------
# The quantizer
# ----------------------------------------------------------------------------------------------


def test_quantizer_settings_and_checks():
    q = Float8BlockQuantizer(
        DType.kFloat8E5M2, rowwise=True, columnwise=False, amax_epsilon=1e-3,
        force_pow_2_scales=False, block_scaling_dim=1, all_gather_usage=True,
    )  # fmt: skip
    assert q.fp8_dtype == torch.float8_e5m2 and q.block_len == 128 and q.all_gather_usage
    assert q.amax_epsilon == 1e-3 and not q.force_pow_2_scales and q.internal
    assert q.fusable and q.amax_reduction is None  # 1x128: producers write it themselves
    assert not Float8BlockQuantizer(torch.float8_e4m3fn, block_scaling_dim=2).fusable
    q.amax_reduction = lambda amax: None
    copy = q.copy()
    assert copy.amax_reduction is q.amax_reduction and copy.block_scaling_dim == 1
    assert (copy.rowwise_usage, copy.columnwise_usage) == (True, False)
    x = sample((5, 7))
    assert q.record_amax(x) is None and q.prime_scale(x, 448.0, 0) is None
    data = q.quantize(x).rowwise_data
    want = bc.block_quantize_reference(x, torch.float8_e5m2, 1, True, False, False, 1e-3)[0]
    assert same(data, want)
    with pytest.raises(ValueError, match="block_scaling_dim must be 1"):
        Float8BlockQuantizer(E4M3, block_scaling_dim=3)
    with pytest.raises(ValueError, match="amax_epsilon"):
        Float8BlockQuantizer(E4M3, amax_epsilon=-1.0)
    with pytest.raises(TypeError, match="fp8_dtype"):
        Float8BlockQuantizer(torch.bfloat16)
    tensor = Float8BlockQuantizer(E4M3, block_scaling_dim=1, internal=False)(x)
    assert type(tensor).__name__ == "Float8BlockwiseQTensor" and tensor.dtype == x.dtype
    assert tensor.shape == x.shape
    assert same(tensor._storage.rowwise_data, quantizer(1).quantize(x).rowwise_data)
    assert_close(tensor.dequantize(torch.float32), x, E4M3)
    leaf = x.float().requires_grad_()
    held = quantizer(1).quantize(leaf).get_data_tensors()
    assert not any(t.requires_grad for t in held)
    with pytest.raises(TypeError, match="x must be a float32"):
        quantizer(1).quantize(x.int())
    with pytest.raises(ValueError, match="at least one dimension"):
        quantizer(1).quantize(torch.tensor(1.0))
    with pytest.raises(ValueError, match="block_dim must be 1"):
        Float8BlockwiseQTensorStorage(None, None, None, None, E4M3, (4, 8), 3)


# ----------------------------------------------------------------------------------------------
# Grouped values
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m_splits", [[5, 0, 130, 1, 257, 0], None])
def test_grouped_storage(m_splits):
    sizes = [5, 0, 130, 1, 257, 0]
    rows = sum(sizes)
    x = sample((rows, 140), seed=5)
    offsets = offsets_of(sizes)
    g = quantizer(1).quantize_grouped(x, offsets, m_splits)
    assert isinstance(g, GroupedBlockwiseStorage) and isinstance(g, QuantizedStorage)
    assert g.shape == (rows, 140) and g.num_groups == 6 and g.m_splits == m_splits
    assert torch.equal(g.block_offsets, block_offsets(offsets)) and g.row_offsets is offsets
    assert g.columnwise_data.shape == (140, rows)
    assert g.columnwise_scale_inv.shape == (max_blocks(rows, 6), 140)
    plain = quantizer(1).quantize(x, columnwise=False)
    assert same(g.rowwise_data, plain.rowwise_data)  # groups do not matter rowwise
    assert torch.equal(g.rowwise_scale_inv, plain.rowwise_scale_inv)
    assert_close(g.dequantize(), x, E4M3)
    # Each group's columnwise copy is its rows quantized alone.
    start = 0
    for size in sizes:
        alone = quantizer(1).quantize(x[start : start + size], rowwise=False)
        assert same(g.columnwise_data[:, start : start + size], alone.columnwise_data)
        start += size
    g.update_usage(rowwise_usage=False)
    assert g.rowwise_data is None and g.rowwise_scale_inv is None
    assert_close(g.dequantize(), x, E4M3)  # from the columnwise copy
    with pytest.raises(RuntimeError, match="separate quantizations"):
        g.update_usage(rowwise_usage=True)
    assert "GroupedBlockwiseStorage" in repr(g) and "['columnwise']" in repr(g)


def test_grouped_saving_copying_and_zero_tokens():
    sizes = [3, 0, 200]
    x = sample((203, 64), seed=6)
    g = quantizer(1).quantize_grouped(x, offsets_of(sizes), sizes)
    held = g.get_data_tensors()
    assert len(held) == 6 and held[4] is g.row_offsets and held[5] is g.block_offsets
    tensors, emptied = g.prepare_for_saving()
    assert emptied is g and all(t is None for t in g.get_data_tensors())
    assert g.restore_from_saved([*tensors, "rest"]) == ["rest"]
    assert all(a is b for a, b in zip(g.get_data_tensors(), held, strict=True))
    src = quantizer(1).quantize_grouped(sample((203, 64), seed=7), offsets_of(sizes), None)
    addresses = [t.data_ptr() for t in g.get_data_tensors()]
    g.copy_from_(src)
    assert [t.data_ptr() for t in g.get_data_tensors()] == addresses and g.m_splits is None
    pairs = zip(g.get_data_tensors(), src.get_data_tensors(), strict=True)
    assert all(same(a, b) for a, b in pairs)
    empty = quantizer(1).quantize_grouped(torch.zeros(0, 64), torch.zeros(3, dtype=torch.int32))
    assert empty.dequantize().shape == (0, 64) and empty.columnwise_scale_inv.shape == (2, 64)
    nothing = quantizer(1).quantize_grouped(x, offsets_of(sizes), rowwise=False, columnwise=False)
    assert nothing.get_data_tensors()[:4] == (None, None, None, None)


def test_grouped_checks():
    x = sample((10, 16))
    offsets = offsets_of([4, 6])
    with pytest.raises(ValueError, match="needs block_scaling_dim=1"):
        quantizer(2).quantize_grouped(x, offsets)
    with pytest.raises(ValueError, match="m_splits has 3 sizes"):
        quantizer(1).quantize_grouped(x, offsets, [4, 6, 0])
    with pytest.raises(ValueError, match="sum to 9"):
        quantizer(1).quantize_grouped(x, offsets, [4, 5])
    with pytest.raises(TypeError, match="int32"):
        quantizer(1).quantize_grouped(x, offsets.long())
    with pytest.raises(ValueError, match="2-D"):
        quantizer(1).quantize_grouped(x[None], offsets)
