"""The Tensor forms of the block-scaled formats (Float8BlockwiseQTensor, MXFP8Tensor,
NVFP4Tensor): metadata, numerics against fp64, aliasing, in-place requantization, pickling, and
their life as parameters of te.Linear built under quantized_model_init.

Inputs are exact in FP8 (k/8 for |k| <= 8, so every block's scale is a power of two and
quantizing them is exact); results are compared in float64 with the shared tolerance table.
"""

from __future__ import annotations

import copy
import importlib
import io
import pickle

import pytest
import torch
from tolerances import assert_close, representable

import torchte as te
from torchte import recipe
from torchte.quantization import block_tensor as bt

E4M3 = torch.float8_e4m3fn
# name -> (module, quantizer class, its keywords, an odd shape the format takes)
FORMATS = {
    "block1d": ("blockwise", "Float8BlockQuantizer", {"block_scaling_dim": 1}, (7, 33)),
    "block2d": ("blockwise", "Float8BlockQuantizer", {"block_scaling_dim": 2}, (3, 131, 70)),
    "mxfp8": ("mxfp8", "MXFP8Quantizer", {}, (3, 32, 96)),
    "nvfp4": ("nvfp4", "NVFP4Quantizer", {}, (48, 64)),
}
FP8_FORMATS = ["block1d", "block2d", "mxfp8", "nvfp4"]
TENSOR_CLASS = {
    "block1d": bt.Float8BlockwiseQTensor,
    "block2d": bt.Float8BlockwiseQTensor,
    "mxfp8": bt.MXFP8Tensor,
    "nvfp4": bt.NVFP4Tensor,
}


def _module(name: str):
    """The format's quantization module; a visible skip (with the reason) while it is not
    importable (a helper is still writing it)."""
    path = f"torchte.quantization.{FORMATS[name][0]}"
    try:
        return importlib.import_module(path)
    except ImportError as exc:
        pytest.skip(f"{path} is not importable yet: {exc}")


def _quantizer(name: str, **overrides):
    _, cls, kwargs, _ = FORMATS[name]
    if name == "nvfp4":
        return getattr(_module(name), cls)(**{**kwargs, **overrides})
    return getattr(_module(name), cls)(E4M3, **{**kwargs, **overrides})


def _exact(name: str, shape=None, dtype=torch.float32, scale=1.0) -> torch.Tensor:
    """Values quantized exactly by format `name` (NVFP4: e2m1 values, a 6 in every 16)."""
    shape = FORMATS[name][3] if shape is None else shape
    if name != "nvfp4":
        return representable(shape, E4M3, scale=scale).to(dtype)
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -2, -4, -6])
    x = grid[torch.randint(0, len(grid), shape)]
    x2d = x.view(-1, shape[-1])
    x2d[::16, :] = x2d[:, ::16] = 6.0  # each block of 16 in a row or a column has the amax
    return (x * scale).to(dtype)


def _tensor(name: str, dtype=torch.float32, x_hp=None, **overrides):
    """(tensor of format `name` holding x_hp, x_hp)."""
    x_hp = _exact(name, dtype=dtype) if x_hp is None else x_hp
    quantizer = _quantizer(name, **overrides)
    storage = quantizer.quantize(x_hp)
    return TENSOR_CLASS[name].from_storage(storage, dtype, quantizer), x_hp


def _bytes(storage) -> list[torch.Tensor | None]:
    return [None if t is None else t.view(torch.uint8) for t in storage.get_data_tensors()]


def _same_bytes(a, b) -> bool:
    pairs = zip(_bytes(a), _bytes(b), strict=True)
    return all((x is None and y is None) or torch.equal(x, y) for x, y in pairs)


def _ptrs(t) -> list[int]:
    return [x.data_ptr() for x in t._storage.get_data_tensors() if x is not None]


# ----------------------------------------------------------------------------------------------
# Construction, dequantize, repr
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(FORMATS))
def test_metadata_and_exact_dequantize(name, dtype):
    tensor, x_hp = _tensor(name, dtype)
    assert type(tensor) is TENSOR_CLASS[name]
    assert bt.block_tensor_class(tensor._storage) is TENSOR_CLASS[name]
    assert (tensor.shape, tensor.dtype, tensor.device) == (x_hp.shape, dtype, x_hp.device)
    assert tensor.fp8_dtype == tensor._storage.fp8_dtype and not tensor.requires_grad
    out = tensor.dequantize()
    assert type(out) is torch.Tensor and out.dtype == dtype
    assert torch.equal(out.double(), x_hp.double())
    assert tensor.dequantize(torch.float64).dtype == torch.float64


def test_bad_construction_raises():
    storage = _quantizer("mxfp8").quantize(_exact("mxfp8"))
    with pytest.raises(TypeError, match="storage must be a Float8BlockwiseQTensorStorage"):
        bt.Float8BlockwiseQTensor(storage, torch.float32)
    with pytest.raises(TypeError, match="dtype must be fp32, bf16 or fp16"):
        bt.MXFP8Tensor(storage, torch.int32)
    assert bt.block_tensor_class(object()) is None


@pytest.mark.parametrize("name", FP8_FORMATS)
def test_dequantize_passes_gradient_through(name):
    param = torch.nn.Parameter(_tensor(name)[0])
    weight = torch.randn(param.shape)
    (param.dequantize() * weight).sum().backward()
    assert type(param.grad) is torch.Tensor and torch.equal(param.grad, weight)


def test_repr_shows_values_or_why_not():
    tensor, x_hp = _tensor("mxfp8", torch.bfloat16)
    text = repr(tensor)
    assert text.startswith("MXFP8Tensor(shape=(3, 32, 96), dtype=torch.bfloat16")
    assert f"{x_hp.reshape(-1)[0].item():.4g}" in text and "..." in text
    assert "values=<not materialized>" in repr(tensor.to("meta"))
    tensor._storage.prepare_for_saving()
    assert "values=<no data>" in repr(tensor)


# ----------------------------------------------------------------------------------------------
# Views, copies, in-place ops
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FP8_FORMATS)
def test_same_shape_views_share_storage_others_dequantize(name):
    tensor, x_hp = _tensor(name)
    for alias in (tensor.detach(), tensor.view(tensor.shape), tensor.view_as(tensor), tensor[:]):
        assert type(alias) is type(tensor) and alias._storage is tensor._storage
    assert tensor.data._storage is tensor._storage
    changed = [
        (tensor.reshape(-1), x_hp.reshape(-1)),
        (tensor[1:], x_hp[1:]),
        (tensor.transpose(-1, -2), x_hp.transpose(-1, -2)),
        (tensor[..., 2:5], x_hp[..., 2:5]),
    ]
    for out, expected in changed:
        assert type(out) is torch.Tensor and torch.equal(out, expected)


@pytest.mark.parametrize("name", FP8_FORMATS)
def test_copy_from_hp_requantizes_in_place(name):
    tensor, _ = _tensor(name)
    alias, ptrs, version = tensor.detach(), _ptrs(tensor), tensor._version
    new_hp = _exact(name, scale=8.0)
    assert tensor.copy_(new_hp) is tensor
    assert _ptrs(tensor) == ptrs and tensor._version > version
    assert torch.equal(alias.dequantize(), new_hp)
    tensor._storage.update_usage(rowwise_usage=False)  # the columnwise copy was rewritten too
    assert torch.equal(tensor.dequantize(), new_hp)


def test_copy_broadcasts_the_source():
    tensor, _ = _tensor("block1d")
    row = _exact("block1d", (33,))
    tensor.copy_(row)
    assert torch.equal(tensor.dequantize(), row.expand(7, 33))


@pytest.mark.parametrize("name", FP8_FORMATS)
def test_copy_from_same_class_copies_bytes(name):
    dst, _ = _tensor(name)
    # Scales that are no power of two (blockwise) show that the bytes were not requantized.
    pow2 = {"force_pow_2_scales": False} if name.startswith("block") else {}
    src, _ = _tensor(name, x_hp=torch.randn(FORMATS[name][3]), **pow2)
    ptrs = _ptrs(dst)
    dst.copy_(src)
    assert _ptrs(dst) == ptrs and _same_bytes(dst._storage, src._storage)


def test_copy_from_rowwise_only_source():
    # 128x128 blocks: the columnwise copy is made from the source's bytes, the source kept.
    dst, _ = _tensor("block2d")
    x_hp = torch.randn(FORMATS["block2d"][3])
    src, _ = _tensor("block2d", x_hp=x_hp, force_pow_2_scales=False)
    src._storage.update_usage(columnwise_usage=False)
    dst.copy_(src)
    assert src._storage.columnwise_data is None
    assert torch.equal(dst._storage.rowwise_scale_inv, src._storage.rowwise_scale_inv)
    dst._storage.update_usage(rowwise_usage=False)
    assert torch.equal(dst.dequantize(), src.dequantize())
    # MXFP8 (1x32 / 32x1 blocks): the columnwise copy cannot be made: the value is requantized.
    dst, _ = _tensor("mxfp8")
    x_hp = _exact("mxfp8", scale=2.0)
    src, _ = _tensor("mxfp8", x_hp=x_hp)
    src._storage.update_usage(columnwise_usage=False)
    dst.copy_(src)
    dst._storage.update_usage(rowwise_usage=False)
    assert torch.equal(dst.dequantize(), x_hp)


def test_copy_from_other_layout_or_format_requantizes():
    dst, _ = _tensor("block2d")
    x_hp = _exact("block2d", scale=4.0)
    dst.copy_(_tensor("block1d", x_hp=x_hp)[0])
    assert dst._storage.block_dim == 2 and torch.equal(dst.dequantize(), x_hp)
    x_hp = _exact("mxfp8", scale=2.0)
    dst, _ = _tensor("mxfp8")
    dst.copy_(_tensor("block1d", x_hp=x_hp)[0])
    assert torch.equal(dst.dequantize(), x_hp)


def test_copy_into_plain_tensor_dequantizes():
    tensor, x_hp = _tensor("block1d")
    plain = torch.empty(7, 33)
    plain.copy_(tensor)
    assert torch.equal(plain, x_hp)


@pytest.mark.parametrize(
    "op",
    [
        lambda t: t.add_(0.5),
        lambda t: t.mul_(2.0),
        lambda t: t.zero_(),
        lambda t: torch.add(t, 0.5, out=t),
    ],
    ids=["add_", "mul_", "zero_", "out="],
)
@pytest.mark.parametrize("name", FP8_FORMATS)
def test_in_place_ops_requantize_into_self(name, op):
    tensor, x_hp = _tensor(name)
    ptrs = _ptrs(tensor)
    expected = op(x_hp.clone())
    assert op(tensor) is tensor
    assert _ptrs(tensor) == ptrs
    assert _same_bytes(tensor._storage, _quantizer(name).quantize(expected))
    if name != "nvfp4":
        assert_close(tensor.dequantize(), expected, E4M3)


def test_without_quantizer_requantizing_raises():
    tensor, _ = _tensor("mxfp8")
    tensor._quantizer = None
    with pytest.raises(RuntimeError, match="no quantizer to requantize with"):
        tensor.copy_(torch.zeros(tensor.shape))


@pytest.mark.parametrize("name", FP8_FORMATS)
def test_clone_and_to_copy_keep_the_bytes(name):
    tensor, x_hp = _tensor(name, torch.bfloat16)
    for out, dtype in ((tensor.clone(), torch.bfloat16), (tensor.to(torch.float16), torch.float16)):
        assert type(out) is type(tensor) and out.dtype == dtype
        assert _same_bytes(out._storage, tensor._storage)
        assert not set(_ptrs(out)) & set(_ptrs(tensor))
        assert out._quantizer is tensor._quantizer
    assert tensor.to(torch.float32).dequantize().dtype == torch.float32
    as_int = tensor.to(torch.int32)
    assert type(as_int) is torch.Tensor and torch.equal(as_int, x_hp.to(torch.int32))
    meta = tensor.to("meta")
    assert type(meta) is type(tensor) and meta.device.type == "meta"


def test_like_ops_and_fallback_ops_give_plain_tensors():
    tensor, x_hp = _tensor("block2d", torch.bfloat16)
    zeros = torch.zeros_like(tensor)
    assert type(zeros) is torch.Tensor and zeros.dtype == torch.bfloat16 and not zeros.any()
    assert type(tensor.new_ones(3)) is torch.Tensor
    total = tensor + tensor
    assert type(total) is torch.Tensor and torch.equal(total, x_hp + x_hp)


def test_quantize_and_data_setter():
    tensor, _ = _tensor("mxfp8", torch.bfloat16)
    ptrs, version = _ptrs(tensor), tensor._version
    new_hp = _exact("mxfp8", dtype=torch.bfloat16, scale=2.0)
    assert tensor.quantize_(new_hp) is tensor
    assert _ptrs(tensor) == ptrs and tensor._version > version
    assert torch.equal(tensor.dequantize(), new_hp)
    other_hp = _exact("mxfp8", (64, 32), torch.float32)
    tensor.data = other_hp  # a plain value of another shape and dtype: quantized
    assert type(tensor) is bt.MXFP8Tensor and (tensor.shape, tensor.dtype) == (
        other_hp.shape,
        torch.float32,
    )
    assert torch.equal(tensor.dequantize(), other_hp)
    same, _ = _tensor("mxfp8", torch.float32, x_hp=other_hp * 4)
    tensor.data = same
    assert tensor._storage is same._storage


# ----------------------------------------------------------------------------------------------
# Pickling, deepcopy, optimizers
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FORMATS))
def test_torch_save_load_and_pickle_keep_the_bytes(name):
    tensor, x_hp = _tensor(name, torch.bfloat16)
    tensor._quantizer.amax_reduction = lambda amax: amax  # not picklable: comes back None
    param = torch.nn.Parameter(tensor)
    buf = io.BytesIO()
    torch.save({"t": tensor, "p": param}, buf)
    buf.seek(0)
    loaded = torch.load(buf)  # weights_only=True
    for value in (loaded["t"], pickle.loads(pickle.dumps(tensor))):
        assert type(value) is type(tensor) and value.dtype == torch.bfloat16
        assert _same_bytes(value._storage, tensor._storage)
        assert torch.equal(value.dequantize(), x_hp)
        assert type(value._quantizer) is type(tensor._quantizer)
        assert value._quantizer.amax_reduction is None
        assert repr(value._quantizer) == repr(tensor._quantizer)
        value.copy_(x_hp * 2)  # the quantizer came back able to quantize
        assert torch.equal(value.dequantize(), (x_hp * 2).to(torch.bfloat16))
    assert loaded["p"].requires_grad and getattr(loaded["p"], "_is_param", False)


def test_deepcopy_copies_the_bytes():
    tensor, _ = _tensor("block2d")
    other = copy.deepcopy(tensor)
    assert type(other) is type(tensor) and _same_bytes(other._storage, tensor._storage)
    assert not set(_ptrs(other)) & set(_ptrs(tensor))


@pytest.mark.parametrize("name", FP8_FORMATS)
def test_optimizer_step_matches_high_precision_step(name):
    tensor, x_hp = _tensor(name)
    param = torch.nn.Parameter(tensor)
    ref = torch.nn.Parameter(x_hp.clone())
    grad = _exact(name, scale=4.0)
    for p in (param, ref):
        p.grad = grad.clone()
        torch.optim.SGD([p], lr=0.25, momentum=0.5).step()
    assert type(param) is type(tensor)
    assert _same_bytes(param._storage, _quantizer(name).quantize(ref.detach()))
    if name != "nvfp4":
        assert_close(param.dequantize(), ref.detach(), E4M3)


# ----------------------------------------------------------------------------------------------
# te.Linear built under quantized_model_init with the block-scaled recipes
# ----------------------------------------------------------------------------------------------

RECIPES = {
    "block": (recipe.Float8BlockScaling, "block2d"),
    "mxfp8": (recipe.MXFP8BlockScaling, "mxfp8"),
    "nvfp4": (recipe.NVFP4BlockScaling, "nvfp4"),
}
IN, OUT, TOKENS = 96, 64, 32


def _linear(kind: str) -> tuple[te.Linear, recipe.Recipe]:
    make_recipe, fmt = RECIPES[kind]
    _module(fmt)
    fp8_recipe = make_recipe()
    with te.quantized_model_init(recipe=fp8_recipe):
        layer = te.Linear(IN, OUT, params_dtype=torch.bfloat16)
    return layer, fp8_recipe


def _run(layer: te.Linear, fp8_recipe, x_hp: torch.Tensor):
    """(y, x.grad) of one forward and backward with dy = 1 (exact in every format)."""
    x = x_hp.to(torch.bfloat16).requires_grad_()
    with te.autocast(recipe=fp8_recipe):
        y = layer(x)
    y.float().sum().backward()
    return y, x.grad


def _weight_caches(layer) -> list:
    return [c for setup in layer._fp8_setups.values() for c in setup.weight_cache]


@pytest.mark.usefixtures("cpu_default_device")
@pytest.mark.parametrize("kind", list(RECIPES))
def test_linear_trains_on_its_quantized_weight(kind):
    layer, fp8_recipe = _linear(kind)
    fmt = RECIPES[kind][1]
    assert type(layer.weight) is TENSOR_CLASS[fmt] and layer.weight.dtype == torch.bfloat16
    assert type(layer.bias) is torch.nn.Parameter
    x_hp = _exact(fmt, (TOKENS, IN))
    y, x_grad = _run(layer, fp8_recipe, x_hp)
    w = layer.weight.dequantize(torch.float64)  # the exact values (NVFP4: not bf16 ones)
    assert_close(y, x_hp.double() @ w.t() + layer.bias.double(), torch.bfloat16)
    assert_close(x_grad, torch.ones(TOKENS, OUT, dtype=torch.float64) @ w, torch.bfloat16)
    assert all(c == [None] for c in _weight_caches(layer))  # the parameter's own bytes served
    grad = layer.weight.grad
    assert type(grad) is torch.Tensor and grad.shape == (OUT, IN) and grad.dtype == torch.bfloat16
    wgrad = x_hp.double().sum(0).expand(OUT, IN)
    if kind == "nvfp4":  # the columnwise copies carry random Hadamard transforms: only close
        cosine = torch.nn.functional.cosine_similarity(grad.double().flatten(), wgrad.flatten(), 0)
        assert cosine > 0.99
    else:
        assert_close(grad, wgrad, E4M3)
    ptrs = _ptrs(layer.weight)
    torch.optim.SGD(layer.parameters(), lr=0.5).step()
    assert type(layer.weight) is TENSOR_CLASS[fmt] and _ptrs(layer.weight) == ptrs
    assert not torch.equal(layer.weight.dequantize().double(), w)


@pytest.mark.usefixtures("cpu_default_device")
@pytest.mark.parametrize("kind", list(RECIPES))
def test_linear_weight_copies_requantize_in_place(kind):
    layer, fp8_recipe = _linear(kind)
    fmt = RECIPES[kind][1]
    ptrs = _ptrs(layer.weight)
    x_hp = _exact(fmt, (TOKENS, IN))
    for scale, write in ((2.0, lambda w: layer.weight.data.copy_(w)), (4.0, layer.weight.copy_)):
        new_w = _exact(fmt, (OUT, IN), torch.bfloat16, scale=scale)
        with torch.no_grad():
            write(new_w)
        assert _ptrs(layer.weight) == ptrs and torch.equal(layer.weight.dequantize(), new_w)
        with te.autocast(recipe=fp8_recipe):
            y = layer(x_hp.to(torch.bfloat16))
        expected = x_hp.double() @ new_w.double().t() + layer.bias.double()
        assert_close(y, expected, torch.bfloat16)


@pytest.mark.usefixtures("cpu_default_device")
@pytest.mark.parametrize("kind", list(RECIPES))
def test_linear_state_dict_round_trip_keeps_the_bytes(kind):
    src, fp8_recipe = _linear(kind)
    dst, _ = _linear(kind)
    x_hp = _exact(RECIPES[kind][1], (TOKENS, IN))
    y_src, _ = _run(src, fp8_recipe, x_hp)
    buf = io.BytesIO()
    torch.save(src.state_dict(), buf)
    buf.seek(0)
    ptrs = _ptrs(dst.weight)
    dst.load_state_dict(torch.load(buf))
    assert type(dst.weight) is type(src.weight) and _ptrs(dst.weight) == ptrs
    assert _same_bytes(dst.weight._storage, src.weight._storage)
    y_dst, _ = _run(dst, fp8_recipe, x_hp)
    assert torch.equal(y_dst, y_src)


@pytest.mark.usefixtures("cpu_default_device")
@pytest.mark.parametrize("kind", list(RECIPES))
def test_linear_weight_without_columnwise_copy(kind):
    """A weight whose columnwise copy was dropped: made again in place where the format can
    (128x128 blocks, NVFP4's 16x16 weight blocks), else quantized anew for the backward from
    the dequantized weight (MXFP8's 1x32 / 32x1 blocks), the parameter left as it was."""
    layer, fp8_recipe = _linear(kind)
    x_hp = _exact(RECIPES[kind][1], (TOKENS, IN))
    _, x_grad = _run(layer, fp8_recipe, x_hp)
    layer.weight._storage.update_usage(columnwise_usage=False)
    _, x_grad_again = _run(layer, fp8_recipe, x_hp)
    made_in_place = layer.weight._storage.columnwise_data is not None
    assert made_in_place == (kind != "mxfp8")
    if made_in_place:
        assert torch.equal(x_grad_again, x_grad)
    else:
        w = layer.weight.dequantize(torch.float64)  # the exact values (NVFP4: not bf16 ones)
        assert_close(x_grad_again, torch.ones(TOKENS, OUT, dtype=torch.float64) @ w, E4M3)


@pytest.mark.usefixtures("cpu_default_device")
def test_linear_copies_keep_block_parameters():
    layer, fp8_recipe = _linear("mxfp8")
    x_hp = _exact("mxfp8", (TOKENS, IN))
    for other in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert type(other.weight) is bt.MXFP8Tensor
        assert _same_bytes(other.weight._storage, layer.weight._storage)
        assert other.weight._quantizer is not None
    layer.to(torch.float32)
    assert type(layer.weight) is bt.MXFP8Tensor and layer.weight.dtype == torch.float32
    with te.autocast(recipe=fp8_recipe):
        y = layer(x_hp)
    w = layer.weight.dequantize(torch.float64)
    assert_close(y, x_hp.double() @ w.t() + layer.bias.double(), torch.float32)


def test_unpickling_rebuilds_only_known_classes():
    with pytest.raises(ValueError, match="unknown block-scaled tensor class 'Nope'"):
        bt._rebuild_block_tensor("Nope", {}, {}, torch.float32, False, False, None)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(FORMATS))
def test_gpu_bytes_equal_the_cpu_ones(name):
    """Moving to the GPU keeps the bytes; requantizing there writes the CPU reference's bytes;
    a GPU tensor saved and loaded comes back on the GPU with its bytes."""
    tensor, x_hp = _tensor(name, torch.bfloat16)
    gpu = tensor.to("cuda")
    assert type(gpu) is type(tensor) and gpu.device.type == "cuda"
    assert all(t.is_cuda for t in gpu._storage.get_data_tensors() if t is not None)
    assert torch.equal(gpu.dequantize().cpu(), x_hp.to(torch.bfloat16))
    new_hp = torch.randn(x_hp.shape)
    gpu.copy_(new_hp.cuda())
    cpu_ref = _quantizer(name).quantize(new_hp.to(torch.bfloat16))
    assert _same_bytes(gpu.to("cpu")._storage, cpu_ref)
    buf = io.BytesIO()
    torch.save(gpu, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    assert loaded.device.type == "cuda" and _same_bytes(loaded._storage, gpu._storage)


# ----------------------------------------------------------------------------------------------
# Transformer Engine's private names (what Megatron-Core reads and assigns)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FP8_FORMATS)
def test_te_private_names_alias_the_storage(name):
    from torchte.constants import TE_DType

    tensor, x_hp = _tensor(name)
    storage = tensor._storage
    for slot in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
        for owner in (tensor, storage):
            value = getattr(owner, f"_{slot}")
            held = getattr(storage, slot)
            assert value.data_ptr() == held.data_ptr() and value.shape == held.shape
            if held.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                assert value.dtype == torch.uint8  # Transformer Engine holds FP8 bytes as uint8
    assert tensor._fp8_dtype == storage._fp8_dtype == TE_DType.get(storage.fp8_dtype)
    assert tensor._get_quantizer() is tensor._quantizer
    # Megatron-FSDP assigns its own buffer (uint8) as the data: kept as the same memory.
    buffer = tensor._rowwise_data.clone()
    tensor._rowwise_data = buffer
    assert storage.rowwise_data.data_ptr() == buffer.data_ptr()
    assert storage.rowwise_data.dtype == storage.fp8_dtype or name == "nvfp4"
    assert torch.equal(tensor.dequantize(), x_hp)


def test_te_format_specific_names():
    block2d, _ = _tensor("block2d")
    block1d, _ = _tensor("block1d")
    assert block2d._is_2D_scaled and not block1d._is_2D_scaled
    assert _tensor("mxfp8")[0]._with_gemm_swizzled_scales is False
    nvfp4, _ = _tensor("nvfp4")
    assert nvfp4._amax_rowwise is nvfp4._storage.amax_rowwise
    with pytest.raises(AttributeError):
        _ = _tensor("mxfp8")[0]._storage._is_2D_scaled


def test_replace_raw_data_and_post_all_gather_processing():
    from torchte.quantization import block_param_utils as bpu

    tensor, x_hp = _tensor("block2d", x_hp=_exact("block2d", (256, 130)))
    columnwise = tensor._storage.columnwise_data.clone()
    buffer = torch.zeros(2 * tensor.numel(), dtype=torch.uint8)
    bpu.replace_raw_data(tensor, buffer[tensor.numel() :])
    assert tensor._rowwise_data.data_ptr() == buffer[tensor.numel() :].data_ptr()
    assert torch.equal(tensor.dequantize(), x_hp)
    bpu.post_all_gather_processing(tensor)
    assert torch.equal(
        tensor._storage.columnwise_data.view(torch.uint8), columnwise.view(torch.uint8)
    )
    with pytest.raises(ValueError, match="new_raw_data must have"):
        bpu.replace_raw_data(tensor, buffer)
    with pytest.raises(NotImplementedError, match="MXFP8Tensor"):
        bpu.replace_raw_data(_tensor("mxfp8")[0], buffer)
    mxfp8, _ = _tensor("mxfp8")  # (3, 32, 96): MXFP8 masters need 2-D weights
    with pytest.raises(ValueError, match=r"2-D for MXFP8 scaling, got shape \(3, 32, 96\)"):
        bpu.quantize_master_weights([mxfp8], [None], [None], None)


def test_quantize_master_weights_one_rank_equals_quantize():
    from torchte.quantization import block_param_utils as bpu

    x_hp = torch.randn(200, 260) * 3
    tensor, _ = _tensor("block2d", x_hp=torch.zeros(200, 260))
    want = _quantizer("block2d").quantize(x_hp)
    bpu.cast_master_weights_to_fp8([tensor], [x_hp.reshape(-1)], [0], None)
    assert tensor._storage.columnwise_data is None  # dropped: made again when needed
    assert torch.equal(_bytes(tensor._storage)[0], _bytes(want)[0])
    assert torch.equal(tensor._storage.rowwise_scale_inv, want.rowwise_scale_inv)
    with pytest.raises(ValueError, match="start_offsets"):
        bpu.quantize_master_weights([tensor], [x_hp.reshape(-1)[1:]], [10], None)
