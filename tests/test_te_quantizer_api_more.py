"""The rest of Transformer Engine 2.x's quantizer API on torchte: make_empty, update_quantized
(with noop_flag), create_tensor_from_data and is_quantizable on every quantizer family;
Float8Tensor's prepare_for_saving / restore_from_saved / get_metadata; Float8TensorStorage's
private names; the block-scaled quantizers at the top level; `_fp8_metas` on te.ops."""

from __future__ import annotations

import pytest
import torch

import torchte
from torchte import recipe
from torchte.constants import DType
from torchte.fp8 import FP8GlobalStateManager
from torchte.quantization import blockwise, mxfp8, nvfp4, te_api
from torchte.quantization import float8 as own
from torchte.quantization.block_tensor import Float8BlockwiseQTensor, MXFP8Tensor, NVFP4Tensor
from torchte.quantization.float8 import Float8Storage
from torchte.quantization.float8_tensor import Float8Tensor

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _delayed(scale: float = 2.0) -> te_api.Float8Quantizer:
    return te_api.Float8Quantizer(torch.tensor([scale]), torch.zeros(1), DType.kFloat8E4M3)


def _quantizers() -> dict:
    """One quantizer of each family, Transformer Engine's defaults (a Tensor from q(x))."""
    return {
        "delayed": _delayed(),
        "current": te_api.Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu"),
        "block": te_api.Float8BlockQuantizer(E4M3, rowwise=True, columnwise=True),
        "mxfp8": te_api.MXFP8Quantizer(DType.kFloat8E4M3),
        "nvfp4": te_api.NVFP4Quantizer(),
    }


def _data_bytes(value) -> list:
    storage = getattr(value, "_storage", value)
    out = []
    for t in storage.get_data_tensors():
        if t is not None and t.dtype in (E4M3, E5M2):
            t = t.view(torch.uint8)
        out.append(t)
    return out


def _same_bytes(a, b) -> bool:
    pairs = zip(_data_bytes(a), _data_bytes(b), strict=True)
    return all((x is None and y is None) or torch.equal(x, y) for x, y in pairs)


# -- make_empty ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["delayed", "current", "block", "mxfp8", "nvfp4"])
def test_make_empty_gives_a_quantized_tensor_of_that_shape(family):
    q = _quantizers()[family]
    t = q.make_empty((64, 128), dtype=torch.bfloat16, device="cpu", requires_grad=True)
    assert isinstance(t, torchte.QuantizedTensor)
    assert t.shape == (64, 128) and t.dtype == torch.bfloat16 and t.requires_grad
    assert t.device == torch.device("cpu")
    assert type(t) is type(q(torch.zeros(64, 128)))
    q.internal = True
    storage = q.make_empty(torch.Size([64, 128]), device="cpu")
    assert not isinstance(storage, torch.Tensor) and tuple(storage.shape) == (64, 128)


def test_make_empty_leaves_the_delayed_amax_alone_and_checks_arguments():
    q = _delayed()
    q.amax.fill_(3.0)
    q.make_empty([4, 16], device="cpu")
    assert q.amax.item() == 3.0
    with pytest.raises(ValueError, match="dtype"):
        q.make_empty((4, 16), dtype=torch.int32, device="cpu")
    with pytest.raises(NotImplementedError, match="pin_memory"):
        q.make_empty((4, 16), device="cpu", pin_memory=True)


# -- update_quantized ------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["delayed", "current", "block", "mxfp8", "nvfp4"])
def test_update_quantized_writes_in_place_what_quantize_makes(family):
    torch.manual_seed(0)
    q = _quantizers()[family]
    dst = q(torch.randn(64, 128))
    pointers = [t.data_ptr() for t in _data_bytes(dst) if t is not None]
    src = torch.randn(64, 128) * 3
    assert q.update_quantized(src, dst) is dst
    assert [t.data_ptr() for t in _data_bytes(dst) if t is not None] == pointers
    assert _same_bytes(dst, q(src))


def test_update_quantized_honours_noop_flag():
    torch.manual_seed(1)
    q = _delayed()
    dst = q(torch.randn(8, 32))
    before = [t.clone() for t in _data_bytes(dst)]
    amax = q.amax.clone()
    q.update_quantized(torch.randn(8, 32) * 100, dst, noop_flag=torch.ones(1))
    assert all(torch.equal(a, b) for a, b in zip(before, _data_bytes(dst), strict=True))
    assert torch.equal(q.amax, amax)
    src = torch.randn(8, 32) * 100
    q.update_quantized(src, dst, noop_flag=torch.zeros(1))
    assert _same_bytes(dst, _delayed()(src))
    assert q.amax.item() == src.abs().max().item()


def test_update_quantized_checks_its_destination():
    q = te_api.Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu")
    with pytest.raises(ValueError, match="Float8"):
        q.update_quantized(torch.randn(64, 128), _quantizers()["mxfp8"](torch.randn(64, 128)))
    with pytest.raises(ValueError, match="shape"):
        q.update_quantized(torch.randn(4, 8), q(torch.randn(4, 16)))


def test_update_quantized_takes_the_quantizers_fp8_dtype():
    torch.manual_seed(2)
    dst = te_api.Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu")(torch.randn(16, 16))
    q5 = te_api.Float8CurrentScalingQuantizer(DType.kFloat8E5M2, "cpu")
    src = torch.randn(16, 16)
    q5.update_quantized(src, dst)
    assert dst.fp8_dtype == E5M2 and dst._fp8_dtype == DType.kFloat8E5M2
    assert _same_bytes(dst, q5(src))


def test_float8_tensor_quantize_with_noop_flag():
    torch.manual_seed(3)
    q = te_api.Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu")
    t = q(torch.randn(8, 16))
    before = _data_bytes(t)[0].clone()
    assert t.quantize_(torch.randn(8, 16), noop_flag=torch.ones(1)) is t
    assert torch.equal(_data_bytes(t)[0], before)
    src = torch.randn(8, 16)
    t.quantize_(src, noop_flag=torch.zeros(1))
    assert _same_bytes(t, q(src))


# -- create_tensor_from_data, is_quantizable -------------------------------------------------


def test_create_tensor_from_data():
    q = _delayed(4.0)
    data = torch.randint(0, 120, (6, 16), dtype=torch.uint8)
    t = q.create_tensor_from_data(data, fake_dtype=torch.bfloat16, requires_grad=True)
    assert isinstance(t, Float8Tensor) and t.dtype == torch.bfloat16 and t.requires_grad
    assert t._data.data_ptr() == data.data_ptr() and t._scale_inv.item() == 0.25
    assert t._get_quantizer() is q
    expected = data.view(E4M3).float() * 0.25
    assert torch.equal(t.dequantize(dtype=torch.float32), expected)
    storage = q.create_tensor_from_data(data, internal=True)
    assert isinstance(storage, Float8Storage) and torch.equal(storage.dequantize(), expected)
    current = te_api.Float8CurrentScalingQuantizer(DType.kFloat8E5M2, "cpu")
    t5 = current.create_tensor_from_data(data.view(E5M2))
    assert t5.fp8_dtype == E5M2 and t5.shape == (6, 16)
    with pytest.raises(ValueError, match="data"):
        q.create_tensor_from_data(torch.zeros(4, 4))


def test_is_quantizable():
    assert _delayed().is_quantizable(torch.randn(3, 5))
    block = te_api.Float8BlockQuantizer(E4M3, rowwise=True, columnwise=True)
    assert block.is_quantizable(torch.randn(128, 256))
    assert not block.is_quantizable(torch.randn(128, 200))
    assert not block.is_quantizable(torch.randn(256))


# -- Float8Tensor's saving and metadata ------------------------------------------------------


def test_float8_tensor_prepare_for_saving_and_restore():
    t = te_api.Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu")(torch.randn(8, 16))
    expected = t.dequantize()
    tensors, obj = t.prepare_for_saving()
    assert obj is t and len(tensors) == 3 and t._storage.rowwise_data is None
    rest = t.restore_from_saved([*tensors, "next"])
    assert rest == ["next"] and torch.equal(t.dequantize(), expected)


def test_float8_tensor_get_metadata_rebuilds_it():
    t = te_api.Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu")(torch.randn(5, 16))
    meta = t.get_metadata()
    assert {"data", "fp8_scale_inv", "fp8_dtype", "data_transpose", "quantizer", "fake_dtype"} <= (
        set(meta)
    )
    assert meta["fp8_dtype"] == DType.kFloat8E4M3 and meta["fake_dtype"] == t.dtype
    twin = Float8Tensor(shape=t.shape, dtype=t.dtype, **meta)
    assert twin._data.data_ptr() == t._data.data_ptr()
    assert twin._storage.columnwise_data.data_ptr() == t._storage.columnwise_data.data_ptr()
    assert torch.equal(twin.dequantize(), t.dequantize())


# -- Float8TensorStorage's private names ------------------------------------------------------


def test_float8_tensor_storage_te_names():
    storage = own.Float8CurrentScalingQuantizer(E4M3).quantize(torch.randn(5, 16))
    assert isinstance(storage, te_api.Float8TensorStorage)
    assert storage._data.dtype == torch.uint8 and storage._data.shape == (5, 16)
    assert storage._data.data_ptr() == storage.rowwise_data.data_ptr()
    assert storage._transpose.shape == (16, 5)
    assert torch.equal(storage._transpose, storage._data.t())
    assert storage._scale_inv is storage.scale_inv and storage._fp8_dtype == DType.kFloat8E4M3
    fresh = torch.zeros(5, 16, dtype=torch.uint8)
    storage._data = fresh
    assert (
        storage.rowwise_data.data_ptr() == fresh.data_ptr() and storage.rowwise_data.dtype == E4M3
    )
    storage._transpose = None
    assert storage.columnwise_data is None
    scale_inv = torch.ones(1)
    storage._scale_inv = scale_inv
    assert storage.scale_inv is scale_inv
    with pytest.raises(ValueError, match="_data"):
        storage._data = torch.zeros(3, dtype=torch.uint8)


# -- top-level names --------------------------------------------------------------------------


def test_block_quantizers_at_the_top_level():
    for name in (
        "MXFP8Quantizer",
        "Float8BlockQuantizer",
        "NVFP4Quantizer",
        "MXFP8TensorStorage",
        "Float8BlockwiseQTensorStorage",
        "NVFP4TensorStorage",
    ):
        assert name in torchte.__all__ and hasattr(torchte, name)
    x = torch.randn(64, 128)
    assert isinstance(torchte.MXFP8Quantizer(DType.kFloat8E4M3)(x), MXFP8Tensor)
    assert isinstance(torchte.NVFP4Quantizer()(x), NVFP4Tensor)
    block = torchte.Float8BlockQuantizer(E4M3, rowwise=True, columnwise=True)
    assert isinstance(block(x), Float8BlockwiseQTensor)
    # torchte's own quantizers are the same classes for isinstance
    assert isinstance(mxfp8.MXFP8Quantizer(E4M3), torchte.MXFP8Quantizer)
    assert isinstance(blockwise.Float8BlockQuantizer(E4M3), torchte.Float8BlockQuantizer)
    assert isinstance(nvfp4.NVFP4Quantizer(), torchte.NVFP4Quantizer)
    assert isinstance(mxfp8.MXFP8Quantizer(E4M3)(x), torchte.MXFP8TensorStorage)


# -- _fp8_metas on te.ops ---------------------------------------------------------------------


def _op_step(op, rec, features=16):
    x = torch.randn(8, features, requires_grad=True)
    with torchte.autocast(recipe=rec):
        y = op(x)
    y.sum().backward()
    return x


def test_ops_fp8_metas_are_views_of_the_delayed_state():
    op = torchte.ops.BasicLinear(16, 16, device="cpu")
    assert op._fp8_metas is None
    delayed = recipe.DelayedScaling(amax_history_len=4)
    x = _op_step(op, delayed)
    fwd_key = FP8GlobalStateManager.get_meta_tensor_key(forward=True)
    bwd_key = FP8GlobalStateManager.get_meta_tensor_key(forward=False)
    metas = op._fp8_metas
    assert metas is op._fp8_metas and set(metas) == {"forward", "backward"}
    assert metas["forward"]["recipe"] == delayed and "fp8_group" in metas["forward"]
    fwd, bwd = metas["forward"][fwd_key], metas["backward"][bwd_key]
    assert fwd.num_quantizers == 2 and bwd.num_quantizers == 1
    assert fwd.amax_history.shape == (4, 2) and bwd.scale.shape == (1,)
    fwd_state, bwd_state = op._delayed_states[4]
    assert fwd.amax_history[:, 0].max().item() == x.detach().abs().max().item()
    assert fwd.amax_history.data_ptr() == fwd_state.amax_history.data_ptr()
    assert torch.equal(fwd.amax_history, fwd_state.amax_history[:, :2])
    fwd.scale.fill_(0.5)
    assert torch.equal(fwd_state.scale[:2], torch.full((2,), 0.5))
    with torchte.autocast(recipe=delayed):
        assert op.get_quantizer("forward", 1).scale.item() == 0.5
    bwd.scale = torch.full((1,), 0.125)
    assert bwd_state.scale[0].item() == 0.125


def test_ops_fp8_metas_of_other_recipes_and_ops():
    op = torchte.ops.BasicLinear(16, 16, device="cpu")
    current = recipe.Float8CurrentScaling()
    _op_step(op, current)
    metas = op._fp8_metas
    assert metas["forward"]["recipe"] == current and "scaling_fwd" not in metas["forward"]
    assert torchte.ops.Identity()._fp8_metas is None
    grouped = torchte.ops.GroupedLinear(2, 16, 16, device="cpu")
    x = torch.randn(8, 16)
    with torchte.autocast(recipe=recipe.DelayedScaling()):
        grouped(x, torch.tensor([4, 4]))
    metas = grouped._fp8_metas
    assert metas["backward"]["scaling_bwd"].scale.shape == (2,)
    with pytest.raises(NotImplementedError, match="GroupedLinear"):
        _ = metas["forward"]["scaling_fwd"].scale


def test_the_alias_paths_hand_out_te_defaults():
    from torchte._alias.paths import PATHS

    for path, name in (
        ("transformer_engine.pytorch.tensor", "MXFP8Quantizer"),
        ("transformer_engine.pytorch.tensor.mxfp8_tensor", "MXFP8Quantizer"),
        ("transformer_engine.pytorch.tensor.float8_blockwise_tensor", "Float8BlockQuantizer"),
        ("transformer_engine.pytorch.tensor.nvfp4_tensor", "NVFP4Quantizer"),
    ):
        assert PATHS[path].names[name] == f"torchte.quantization.te_api:{name}"
        assert not getattr(te_api, name)(E4M3 if name != "NVFP4Quantizer" else None).internal
