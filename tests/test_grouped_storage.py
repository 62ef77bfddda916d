"""GroupedStorage and GroupedTensor: the grouped FP8 layout byte for byte, views into it, usage
changes, saving for backward, and the tensor wrapper's ops.

Each group is quantized alone by torchte's quantizers (torch reference kernels on the CPU) from
values exact in the FP8 dtype, with a power-of-two scale of its own, so dequantized values are
exact and groups with mixed-up scales would show.
"""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_close, representable

from torchte._sizes import round_up
from torchte.module._common import restore_saved, save_for_backward
from torchte.quantization.float8 import (
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Float8Storage,
)
from torchte.quantization.float8_tensor import Float8Tensor
from torchte.quantization.grouped import GroupedStorage, GroupedTensor

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
SPLITS = [(5, 0, 17, 16, 1), (33,), (0, 3), (0,)]
K = 20


def _groups(
    m_splits, fp8_dtype, k=K, *, rowwise=True, columnwise=True
) -> tuple[list[Float8Storage], torch.Tensor]:
    """Per-group storages (group g scaled by 2**g) and the exact (T, k) fp32 value."""
    quantizer = Float8CurrentScalingQuantizer(fp8_dtype, power_2_scale=True)
    storages, values = [], []
    for g, m in enumerate(m_splits):
        x_hp = representable((m, k), fp8_dtype, scale=2.0**g)
        storages.append(quantizer.quantize(x_hp, rowwise=rowwise, columnwise=columnwise))
        values.append(x_hp)
    return storages, torch.cat(values)


def _grouped(m_splits=SPLITS[0], fp8_dtype=torch.float8_e4m3fn, **usage):
    storages, x_hp = _groups(m_splits, fp8_dtype, **usage)
    return GroupedStorage.from_groups(storages, fp8_dtype), storages, x_hp


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _inside(view: torch.Tensor, buffer: torch.Tensor) -> bool:
    """view's bytes lie in buffer's (an empty view: it slices buffer's memory)."""
    if view.numel() == 0:
        return view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    start = buffer.data_ptr()
    end = start + buffer.numel() * buffer.element_size()
    return start <= view.data_ptr() and view.data_ptr() + view.numel() * view.element_size() <= end


def _padded_offsets(m_splits) -> list[int]:
    offsets = [0]
    for m in m_splits:
        offsets.append(offsets[-1] + round_up(m, 16))
    return offsets


# ----------------------------------------------------------------------------------------------
# Layout
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m_splits", SPLITS)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_from_groups_layout_byte_for_byte(fp8_dtype, m_splits):
    grouped, storages, _ = _grouped(m_splits, fp8_dtype)
    total, offsets = sum(m_splits), _padded_offsets(m_splits)
    assert grouped.shape == (total, K)
    assert grouped.m_splits == tuple(m_splits) and grouped.num_groups == len(m_splits)
    assert grouped.col_offsets() == offsets
    assert grouped.device == torch.device("cpu")
    assert grouped.rowwise_data.shape == (total, K) and grouped.rowwise_data.dtype == fp8_dtype
    assert grouped.columnwise_data.shape == (K * offsets[-1],)
    assert grouped.columnwise_data.dtype == fp8_dtype
    rows = torch.cat([_u8(s.rowwise_data) for s in storages])
    assert torch.equal(_u8(grouped.rowwise_data), rows)
    assert torch.equal(grouped.scale_inv, torch.cat([s.scale_inv for s in storages]))
    assert grouped.scale_inv.shape == (len(m_splits),)
    flat = _u8(grouped.columnwise_data)
    for g, (m, s) in enumerate(zip(m_splits, storages, strict=True)):
        block = flat[K * offsets[g] : K * offsets[g + 1]].view(K, round_up(m, 16))
        assert torch.equal(block[:, :m], _u8(s.rowwise_data).t())
        assert torch.equal(block, _u8(s.columnwise_data))
        assert bool((block[:, m:] == 0).all())


def test_distinct_scales_per_group():
    grouped, _, _ = _grouped((4, 4, 4))
    assert len(set(grouped.scale_inv.tolist())) == 3


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_from_groups_keeps_only_usages_every_group_has(fp8_dtype):
    rows_only, _, _ = _grouped((3, 0, 18), fp8_dtype, columnwise=False)
    assert rows_only.rowwise_data is not None and rows_only.columnwise_data is None
    cols_only, _, x_hp = _grouped((3, 0, 18), fp8_dtype, rowwise=False)
    assert cols_only.rowwise_data is None and cols_only.columnwise_data is not None
    assert torch.equal(cols_only.dequantize(), x_hp)
    storages, _ = _groups((3, 4), fp8_dtype)
    storages[0].update_usage(columnwise_usage=False)
    mixed = GroupedStorage.from_groups(storages, fp8_dtype)
    assert mixed.rowwise_data is not None and mixed.columnwise_data is None
    storages[1].update_usage(rowwise_usage=False)
    with pytest.raises(ValueError, match="no usage in common"):
        GroupedStorage.from_groups(storages, fp8_dtype)


def test_from_groups_rejects_mismatched_groups():
    storages, _ = _groups((3, 4), torch.float8_e4m3fn)
    other_k, _ = _groups((2,), torch.float8_e4m3fn, k=K + 1)
    with pytest.raises(ValueError, match="K="):
        GroupedStorage.from_groups(storages + other_k, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="float8_e5m2"):
        GroupedStorage.from_groups(storages, torch.float8_e5m2)
    with pytest.raises(ValueError, match="at least one"):
        GroupedStorage.from_groups([], torch.float8_e4m3fn)


def test_from_groups_with_delayed_scaling_quantizer():
    scales = [4.0, 0.5]
    storages = [
        Float8Quantizer(torch.tensor([s]), torch.zeros(1), torch.float8_e5m2).quantize(
            representable((m, K), torch.float8_e5m2)
        )
        for s, m in zip(scales, (7, 9), strict=True)
    ]
    grouped = GroupedStorage.from_groups(storages, torch.float8_e5m2)
    assert grouped.scale_inv.tolist() == [0.25, 2.0]
    expected = torch.cat([s.dequantize() for s in storages])
    assert torch.equal(grouped.dequantize(), expected)


def test_constructor_checks_the_layout():
    grouped, _, _ = _grouped((5, 0, 17))
    row, col, scale = grouped.get_data_tensors()
    fp8 = torch.float8_e4m3fn
    with pytest.raises(ValueError, match="sum to 21, not to the token count 22"):
        GroupedStorage(None, None, scale, fp8, (5, 0, 16), (22, K))
    with pytest.raises(ValueError, match="m_splits must be non-negative"):
        GroupedStorage(None, None, scale, fp8, (5, -1, 18), (22, K))
    with pytest.raises(ValueError, match="rowwise_data"):
        GroupedStorage(row[:, 1:], None, scale, fp8, (5, 0, 17), (22, K))
    with pytest.raises(ValueError, match="columnwise_data"):
        GroupedStorage(None, col[:-1], scale, fp8, (5, 0, 17), (22, K))
    with pytest.raises(ValueError, match="scale_inv"):
        GroupedStorage(row, col, scale[:2], fp8, (5, 0, 17), (22, K))
    with pytest.raises(ValueError, match=r"rowwise_data must be torch\.float8_e5m2"):
        GroupedStorage(row, None, scale, torch.float8_e5m2, (5, 0, 17), (22, K))


# ----------------------------------------------------------------------------------------------
# Groups as views
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m_splits", SPLITS)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_group_views_match_the_per_group_storages(fp8_dtype, m_splits):
    grouped, storages, _ = _grouped(m_splits, fp8_dtype)
    views = grouped.groups()
    assert len(views) == len(m_splits)
    for view, s in zip(views, storages, strict=True):
        assert isinstance(view, Float8Storage)
        assert view.shape == s.shape and view.fp8_dtype == fp8_dtype
        assert torch.equal(_u8(view.rowwise_data), _u8(s.rowwise_data))
        assert torch.equal(_u8(view.columnwise_data), _u8(s.columnwise_data))
        assert torch.equal(view.scale_inv, s.scale_inv)
        assert torch.equal(view.dequantize(), s.dequantize())


def test_group_views_share_memory_with_the_buffers():
    grouped, _, _ = _grouped((5, 0, 17, 16, 1))
    for g in range(grouped.num_groups):
        view = grouped.group(g)
        for name in ("rowwise_data", "columnwise_data", "scale_inv"):
            part, buffer = getattr(view, name), getattr(grouped, name)
            assert part.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
            assert _inside(part, buffer), (g, name)
    view = grouped.group(2)  # rows 5..21, columnwise block at K * 16
    _u8(view.rowwise_data)[3, 4] = 0x11
    assert grouped.rowwise_data.view(torch.uint8)[5 + 3, 4] == 0x11
    _u8(view.columnwise_data)[6, 2] = 0x22
    assert _u8(grouped.columnwise_data)[K * 16 + 6 * 32 + 2] == 0x22
    view.scale_inv.fill_(3.0)
    assert grouped.scale_inv[2] == 3.0


@pytest.mark.parametrize("m_splits", SPLITS)
def test_gemm_operands_are_the_group_views_with_aligned_scales(m_splits):
    grouped, _, _ = _grouped(m_splits)
    rows, cols, scales = grouped.gemm_operands()
    for g, view in enumerate(grouped.groups()):
        assert torch.equal(_u8(rows[g]), _u8(view.rowwise_data))
        assert torch.equal(_u8(cols[g]), _u8(view.columnwise_data))
        assert cols[g].shape == view.columnwise_data.shape
        assert scales[g].shape == (1,) and torch.equal(scales[g], view.scale_inv)
        assert scales[g].data_ptr() % 16 == 0
        assert _inside(rows[g], grouped.rowwise_data) and _inside(cols[g], grouped.columnwise_data)


def test_group_index_out_of_range():
    grouped, _, _ = _grouped((3, 4))
    with pytest.raises(IndexError, match="group 2 out of range"):
        grouped.group(2)
    with pytest.raises(IndexError):
        grouped.group(-1)


# ----------------------------------------------------------------------------------------------
# Dequantize, update_usage
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m_splits", SPLITS)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_dequantize_equals_concatenated_groups(fp8_dtype, m_splits, dtype):
    grouped, storages, x_hp = _grouped(m_splits, fp8_dtype)
    out = grouped.dequantize(dtype)
    assert (out.shape, out.dtype) == ((sum(m_splits), K), dtype)
    assert torch.equal(out, torch.cat([s.dequantize(dtype) for s in storages]))
    assert torch.equal(out.float(), x_hp)  # exact inputs, power-of-two scales
    grouped.update_usage(rowwise_usage=False)  # from the columnwise blocks alone
    assert torch.equal(grouped.dequantize(dtype), out)


def test_dequantize_of_random_values_within_fp8_tolerance():
    quantizer = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
    x_hp = torch.randn(41, 24) * torch.tensor([1.0, 100.0, 0.01]).repeat_interleave(
        torch.tensor([10, 30, 1])
    ).unsqueeze(1)
    storages = [quantizer.quantize(part) for part in x_hp.split([10, 30, 1])]
    grouped = GroupedStorage.from_groups(storages, torch.float8_e4m3fn)
    for g, part in enumerate(grouped.dequantize().split([10, 30, 1])):
        scale = x_hp.split([10, 30, 1])[g].abs().max()
        assert_close(part / scale, x_hp.split([10, 30, 1])[g] / scale, torch.float8_e4m3fn)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_update_usage_drops_and_rebuilds_exactly(fp8_dtype):
    grouped, _, x_hp = _grouped((5, 0, 17, 16, 1), fp8_dtype)
    row, col = _u8(grouped.rowwise_data).clone(), _u8(grouped.columnwise_data).clone()
    grouped.update_usage()  # None, None: nothing changes
    assert torch.equal(_u8(grouped.rowwise_data), row)
    grouped.update_usage(columnwise_usage=False)
    assert grouped.columnwise_data is None
    grouped.update_usage(columnwise_usage=True)  # rebuilt from rowwise, padding zero
    assert torch.equal(_u8(grouped.columnwise_data), col)
    grouped.update_usage(rowwise_usage=False, columnwise_usage=True)
    assert grouped.rowwise_data is None
    grouped.update_usage(rowwise_usage=True, columnwise_usage=False)  # rebuilt from columnwise
    assert grouped.columnwise_data is None
    assert torch.equal(_u8(grouped.rowwise_data), row)
    assert grouped.rowwise_data.dtype == fp8_dtype
    assert torch.equal(grouped.dequantize(), x_hp)


def test_update_usage_without_data_raises():
    grouped, _, _ = _grouped((3, 4))
    grouped.update_usage(rowwise_usage=False, columnwise_usage=False)
    assert grouped.get_data_tensors()[:2] == (None, None)
    with pytest.raises(RuntimeError, match="cannot make rowwise FP8 data"):
        grouped.update_usage(rowwise_usage=True)
    with pytest.raises(RuntimeError, match="cannot make columnwise FP8 data"):
        grouped.update_usage(columnwise_usage=True)
    with pytest.raises(RuntimeError, match="holds no data"):
        grouped.dequantize()


# ----------------------------------------------------------------------------------------------
# Saving for backward
# ----------------------------------------------------------------------------------------------


def test_prepare_for_saving_and_restore_round_trip():
    grouped, _, x_hp = _grouped()
    data = grouped.get_data_tensors()
    tensors, emptied = grouped.prepare_for_saving()
    assert emptied is grouped
    assert len(tensors) == 3 and all(a is b for a, b in zip(tensors, data, strict=True))
    assert grouped.get_data_tensors() == (None, None, None)
    with pytest.raises(RuntimeError, match="holds no data"):
        grouped.dequantize()
    with pytest.raises(RuntimeError, match="holds no data"):
        grouped.group(0)
    extra = torch.ones(2)
    rest = grouped.restore_from_saved([*tensors, extra, None])
    assert len(rest) == 2 and rest[0] is extra and rest[1] is None
    assert all(a is b for a, b in zip(grouped.get_data_tensors(), data, strict=True))
    assert torch.equal(grouped.dequantize(), x_hp)


class _SaveGrouped(torch.autograd.Function):
    """y = x * 2; saves x, a GroupedStorage, None and a Float8Storage through _common."""

    @staticmethod
    def forward(ctx, x, grouped, f8):
        save_for_backward(ctx, x, grouped, None, f8)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        x, grouped, none, f8 = restore_saved(ctx)
        ctx.restored = (x, grouped, none, f8)
        return grad * 2, None, None


def test_save_for_backward_handles_grouped_storage():
    grouped, _, x_grouped = _grouped((5, 0, 17))
    f8, _ = _groups((4,), torch.float8_e5m2)
    data = grouped.get_data_tensors()
    x = torch.randn(3, requires_grad=True)
    packed = []

    def pack(t):
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = _SaveGrouped.apply(x, grouped, f8[0])
    assert all(any(t is p for p in packed) for t in data)  # hooks see every data tensor
    assert grouped.get_data_tensors() == data  # the original stays whole
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))
    ctx = y.grad_fn
    x_saved, grouped_saved, none, f8_saved = ctx.restored
    assert torch.equal(x_saved, x) and none is None
    assert type(grouped_saved) is GroupedStorage and grouped_saved is not grouped
    assert grouped_saved.m_splits == (5, 0, 17)
    assert all(a is b for a, b in zip(grouped_saved.get_data_tensors(), data, strict=True))
    assert torch.equal(grouped_saved.dequantize(), x_grouped)
    assert type(f8_saved) is Float8Storage and f8_saved is not f8[0]
    assert torch.equal(f8_saved.dequantize(), f8[0].dequantize())


def test_save_for_backward_rejects_other_objects():
    class _Plain(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            save_for_backward(ctx, x, object())
            return x

    with pytest.raises(TypeError, match="neither a tensor nor a quantized storage"):
        _Plain.apply(torch.ones(2))


def test_repr_of_storage():
    grouped, _, _ = _grouped((3, 4), columnwise=False)
    text = repr(grouped)
    assert text.startswith("GroupedStorage(") and "m_splits=(3, 4)" in text
    assert "usage=['rowwise']" in text


# ----------------------------------------------------------------------------------------------
# GroupedTensor
# ----------------------------------------------------------------------------------------------


def _tensor(m_splits=(5, 0, 17), dtype=torch.float32, fp8_dtype=torch.float8_e4m3fn):
    grouped, storages, x_hp = _grouped(m_splits, fp8_dtype)
    return GroupedTensor(grouped, dtype), storages, x_hp


def _ptrs(storage) -> set[int]:
    return {t.data_ptr() for t in storage.get_data_tensors() if t is not None and t.numel()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_grouped_tensor_metadata_and_dequantize(fp8_dtype, dtype):
    tensor, _, x_hp = _tensor(dtype=dtype, fp8_dtype=fp8_dtype)
    assert type(tensor) is GroupedTensor and isinstance(tensor._storage, GroupedStorage)
    assert (tensor.shape, tensor.dtype, tensor.device) == ((22, K), dtype, torch.device("cpu"))
    assert tensor.fp8_dtype == fp8_dtype and tensor.m_splits == (5, 0, 17)
    out = tensor.dequantize()
    assert type(out) is torch.Tensor and out.dtype == dtype
    assert torch.equal(out.float(), x_hp)
    assert tensor.dequantize(torch.float64).dtype == torch.float64


def test_grouped_tensor_detach_shares_and_clone_copies():
    tensor, _, x_hp = _tensor()
    alias = tensor.detach()
    assert type(alias) is GroupedTensor and alias._storage is tensor._storage
    clone = tensor.clone()
    assert type(clone) is GroupedTensor and clone.shape == tensor.shape
    assert clone._storage.m_splits == tensor._storage.m_splits
    assert _ptrs(clone._storage).isdisjoint(_ptrs(tensor._storage))
    pairs = zip(clone._storage.get_data_tensors(), tensor._storage.get_data_tensors(), strict=True)
    assert all(torch.equal(_u8(a), _u8(b)) for a, b in pairs)
    clone._storage.scale_inv.zero_()
    assert torch.equal(tensor.dequantize(), x_hp)


def test_grouped_tensor_split_groups_are_float8_views():
    tensor, storages, x_hp = _tensor(dtype=torch.bfloat16)
    parts = tensor.split_groups()
    assert len(parts) == 3
    for part, s, expected in zip(parts, storages, x_hp.split([5, 0, 17]), strict=True):
        assert type(part) is Float8Tensor and part.dtype == torch.bfloat16
        assert part.shape == s.shape
        assert torch.equal(part.dequantize().float(), expected)
        assert _inside(part._storage.rowwise_data, tensor._storage.rowwise_data)
        assert _inside(part._storage.columnwise_data, tensor._storage.columnwise_data)


def test_grouped_tensor_other_ops_run_dequantized():
    tensor, _, x_hp = _tensor()
    for out, expected in (
        (tensor + 1, x_hp + 1),
        (tensor.sum(0), x_hp.sum(0)),
        (tensor @ torch.ones(K, 2), x_hp @ torch.ones(K, 2)),
        (tensor[5:7], x_hp[5:7]),
        (tensor.to(torch.bfloat16), x_hp.bfloat16()),
    ):
        assert type(out) is torch.Tensor
        assert torch.equal(out, expected)
    plain = torch.zeros(22, K)
    plain.add_(tensor)
    assert torch.equal(plain, x_hp)


def test_grouped_tensor_to_same_dtype_copy_keeps_it_grouped():
    tensor, _, x_hp = _tensor()
    assert tensor.to(torch.float32) is tensor
    moved = tensor.to("cpu", copy=True)
    assert type(moved) is GroupedTensor
    assert _ptrs(moved._storage).isdisjoint(_ptrs(tensor._storage))
    assert torch.equal(moved.dequantize(), x_hp)


def test_grouped_tensor_rejects_in_place_writes():
    tensor, _, _ = _tensor()
    with pytest.raises(NotImplementedError, match="cannot be written in place"):
        tensor.add_(1)
    with pytest.raises(NotImplementedError, match="cannot be written in place"):
        tensor.copy_(torch.zeros(22, K))


def test_grouped_tensor_dequantize_passes_gradient_through():
    grouped, _, _ = _grouped((3, 4))
    tensor = GroupedTensor(grouped, torch.float32, requires_grad=True)
    weight = torch.randn(7, K)
    (tensor.dequantize() * weight).sum().backward()
    assert type(tensor.grad) is torch.Tensor and torch.equal(tensor.grad, weight)


def test_grouped_tensor_repr():
    tensor, _, x_hp = _tensor(dtype=torch.bfloat16)
    text = repr(tensor)
    assert text.startswith("GroupedTensor(") and "m_splits=(5, 0, 17)" in text
    assert "dtype=torch.bfloat16" in text and "fp8_dtype=torch.float8_e4m3fn" in text
    assert f"{x_hp.reshape(-1)[0].item():.4g}" in text
