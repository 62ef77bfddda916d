"""FP8 parameters under a sharded optimizer (torchte.quantization.param_utils, Transformer
Engine's `tensor.utils`): fp32 master weights split into slices as Megatron-Core's distributed
optimizer splits them, cast into the FP8 parameters of te.Linear layers built under
quantized_model_init, give the bytes and scale_inv of quantizing each whole master weight
(delayed and current scaling); the raw bytes move into a client's buffer; make_like and the
other Transformer Engine names of Float8Tensor.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from ranks import on_ranks
from tolerances import assert_close, representable

import torchte as te
from torchte import recipe
from torchte.quantization import (
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Float8Storage,
)
from torchte.quantization.float8_tensor import Float8Tensor
from torchte.quantization.param_utils import (
    cast_master_weights_to_fp8,
    post_all_gather_processing,
    quantize_master_weights,
    replace_raw_data,
)

RECIPES = {"delayed": recipe.DelayedScaling(), "current": recipe.Float8CurrentScaling()}
# (in_features, out_features) of the layers: weights of 1536, 768 and 1280 elements.
LAYERS = [(32, 48), (48, 16), (16, 80)]


def _layers(recipe_name: str, dtype: torch.dtype, device: str = "cpu") -> list[te.Linear]:
    """te.Linear layers built under quantized_model_init (FP8 weights)."""
    with te.quantized_model_init(
        recipe=RECIPES[recipe_name], preserve_high_precision_init_val=True
    ):
        return [te.Linear(i, o, params_dtype=dtype, device=device) for i, o in LAYERS]


def _model(recipe_name: str, dtype: torch.dtype) -> list[Float8Tensor]:
    """The FP8 weights of _layers (on the CPU)."""
    return [layer.weight for layer in _layers(recipe_name, dtype)]


def _masters(weights: list[Float8Tensor], seed: int = 7) -> list[torch.Tensor]:
    """fp32 master weights: each weight's initial value after a step (values bf16 cannot hold),
    the largest magnitude at the last element (for a weight split over ranks, on the last)."""
    gen = torch.Generator().manual_seed(seed)
    masters = []
    for w in weights:
        init = w.get_high_precision_init_val().float()
        master = init + 1e-3 * torch.randn(init.shape, generator=gen)
        master.view(-1)[-1] = 3.0 * init.abs().max()
        masters.append(master.to(w.device))
    return masters


def megatron_ranges(numels: list[int], world: int, rank: int) -> list[tuple[int, int] | None]:
    """Per parameter, (start_offset, numel) of the slice `rank` holds, or None: the parameters
    laid out in reverse order in one buffer padded to a multiple of `world`, which is split
    into `world` equal contiguous shards (Megatron-Core's distributed optimizer)."""
    shard = -(-sum(numels) // world)
    lo, hi = rank * shard, (rank + 1) * shard
    ranges: list[tuple[int, int] | None] = [None] * len(numels)
    offset = 0
    for i in reversed(range(len(numels))):
        start, end = max(lo, offset), min(hi, offset + numels[i])
        if start < end:
            ranges[i] = (start - offset, end - start)
        offset += numels[i]
    return ranges


def _slices(masters, ranges):
    """(master slices, start offsets) for one rank's ranges."""
    slices = [
        None if r is None else m.reshape(-1)[r[0] : r[0] + r[1]]
        for m, r in zip(masters, ranges, strict=True)
    ]
    return slices, [None if r is None else r[0] for r in ranges]


def _expected(weight: Float8Tensor, master: torch.Tensor) -> Float8Storage:
    """The whole master weight (in the weight's nominal dtype) quantized as the weight's
    quantizer would: delayed with its scale, current with its own amax."""
    q = weight._get_quantizer()
    hp = master.to(weight.dtype)
    if isinstance(q, Float8Quantizer):
        amax = torch.zeros(1, device=hp.device)
        return Float8Quantizer(q.scale.clone(), amax, q.fp8_dtype).quantize(hp, columnwise=False)
    fresh = Float8CurrentScalingQuantizer(
        q.fp8_dtype, power_2_scale=q.power_2_scale, amax_epsilon=q.amax_epsilon
    )
    return fresh.quantize(hp, columnwise=False)


def _assert_equals_whole(weights, masters) -> None:
    for i, (w, m) in enumerate(zip(weights, masters, strict=True)):
        expected = _expected(w, m)
        assert torch.equal(w._data, expected.rowwise_data.view(torch.uint8)), f"weight {i}"
        assert torch.equal(w._scale_inv, expected.scale_inv), f"weight {i}"


# ----------------------------------------------------------------------------------------------
# One process
# ----------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("cpu_default_device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_delayed_scaling_slices_give_the_bytes_of_the_whole_master(dtype):
    weights = _model("delayed", dtype)
    masters = _masters(weights)
    for w in weights:
        w._get_quantizer().amax.zero_()
    world = 3  # one process plays the ranks in turn: delayed scaling needs no reduction
    for rank in range(world):
        slices, offsets = _slices(
            masters, megatron_ranges([w.numel() for w in weights], world, rank)
        )
        cast_master_weights_to_fp8(weights, slices, offsets, None)
    _assert_equals_whole(weights, masters)
    for w, m in zip(weights, masters, strict=True):
        q = w._get_quantizer()
        assert torch.equal(q.amax, m.to(dtype).abs().max().float().view(1))
        assert torch.equal(w._scale_inv, torch.reciprocal(q.scale))


@pytest.mark.usefixtures("cpu_default_device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_current_scaling_whole_masters_give_the_bytes_of_quantizing_them(dtype):
    weights = _model("current", dtype)
    masters = _masters(weights)
    before = [w._scale_inv.clone() for w in weights]
    quantize_master_weights(weights, masters, [0] * len(weights), None)
    _assert_equals_whole(weights, masters)
    assert all(not torch.equal(b, w._scale_inv) for b, w in zip(before, weights, strict=True))


@pytest.mark.usefixtures("cpu_default_device")
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_manual_post_all_gather_processing_refreshes_the_transpose_in_place(recipe_name):
    weights = _model(recipe_name, torch.bfloat16)
    masters = _masters(weights)
    for w in weights:
        w.update_usage(columnwise_usage=True)
    pointers = [w._transpose.data_ptr() for w in weights]
    stale = [w._transpose.clone() for w in weights]
    cast_master_weights_to_fp8(
        weights, masters, [0] * 3, None, manual_post_all_gather_processing=True
    )
    assert all(
        torch.equal(w._transpose, s) for w, s in zip(weights, stale, strict=True)
    )  # not yet made
    post_all_gather_processing(weights)
    for w, ptr in zip(weights, pointers, strict=True):
        assert w._transpose.data_ptr() == ptr
        assert torch.equal(w._transpose, w._data.t())
    _assert_equals_whole(weights, masters)


@pytest.mark.usefixtures("cpu_default_device")
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_automatic_processing_drops_the_transpose_and_the_layer_uses_the_new_bytes(recipe_name):
    with te.quantized_model_init(
        recipe=RECIPES[recipe_name], preserve_high_precision_init_val=True
    ):
        layer = te.Linear(32, 48, params_dtype=torch.bfloat16)
    w = layer.weight
    w.update_usage(columnwise_usage=True)
    (master,) = _masters([w])
    version = w._version
    cast_master_weights_to_fp8([w], [master.view(-1)], [0], None)
    assert w._transpose is None and w._version > version
    assert w.get_high_precision_init_val() is None  # the masters exist: freed
    _assert_equals_whole([w], [master])
    x = representable((5, 32), torch.bfloat16).bfloat16().requires_grad_(True)
    with te.autocast(recipe=RECIPES[recipe_name]):
        y = layer(x)
    y.sum().backward()  # the input gradient reads the transpose, made from the new bytes
    assert torch.equal(w._transpose, w._data.t())
    expected = x.double() @ w.dequantize().double().t() + layer.bias.double()
    assert_close(y, expected, torch.float8_e4m3fn)


@pytest.mark.usefixtures("cpu_default_device")
def test_fsdp_shard_model_weights_receive_the_bytes():
    weights = _model("current", torch.float32)
    masters = _masters(weights)
    ranges = [(100, 500), (0, 768), (1, 1279)]
    slices, offsets = _slices(masters, ranges)
    params_before = [w._data.clone() for w in weights]
    shards = [torch.zeros(500, dtype=torch.uint8), None, None]
    shards[1] = Float8Tensor.make_like(weights[1], data=torch.zeros(16, 48, dtype=torch.uint8))
    shards[2] = torch.zeros(1279, dtype=weights[2]._storage.fp8_dtype)
    # Only the slices of each weight: current scaling takes its amax from them.
    quantize_master_weights(weights, slices, offsets, None, fsdp_shard_model_weights=shards)
    for i, (w, s) in enumerate(zip(weights, slices, strict=True)):
        expected = Float8CurrentScalingQuantizer(w._storage.fp8_dtype).quantize(s)
        written = shards[i]._data if isinstance(shards[i], Float8Tensor) else shards[i]
        expected_bytes = expected.rowwise_data.view(torch.uint8).view(-1)
        assert torch.equal(written.view(torch.uint8).view(-1), expected_bytes), i
        assert torch.equal(w._scale_inv, expected.scale_inv), i
        assert torch.equal(w._data, params_before[i]), i  # the parameter's own bytes untouched


@pytest.mark.usefixtures("cpu_default_device")
def test_masters_on_no_rank_leave_the_bytes_and_still_set_scale_inv():
    weights = _model("delayed", torch.float32)
    before = [w._data.clone() for w in weights]
    for w in weights:
        w._scale_inv.fill_(123.0)
    quantize_master_weights(weights, [None] * 3, [None] * 3, None)
    for w, b in zip(weights, before, strict=True):
        assert torch.equal(w._data, b)
        assert torch.equal(w._scale_inv, torch.reciprocal(w._get_quantizer().scale))


# ----------------------------------------------------------------------------------------------
# Two gloo ranks: Megatron's buffer, the casts, the all-gather, the transposes
# ----------------------------------------------------------------------------------------------


def _megatron_step(rank: int) -> dict:
    """On each rank: FP8 weights moved into one uint8 buffer, this rank's master slices cast
    into it, the buffer all-gathered, the transposes made; what the whole masters give."""
    world = dist.get_world_size()
    out = {}
    for recipe_name in RECIPES:
        torch.manual_seed(0)  # the same model on every rank
        weights = _model(recipe_name, torch.bfloat16)
        numels = [w.numel() for w in weights]
        shard = -(-sum(numels) // world)
        buffer = torch.zeros(shard * world, dtype=torch.uint8)
        offset = 0
        for w in reversed(weights):
            replace_raw_data(w, buffer[offset : offset + w.numel()].view(w.shape))
            offset += w.numel()
        for w in weights:
            w.update_usage(columnwise_usage=True)
            if recipe_name == "delayed":
                w._get_quantizer().amax.zero_()
        masters = _masters(weights)
        slices, offsets = _slices(masters, megatron_ranges(numels, world, rank))
        cast_master_weights_to_fp8(
            weights, slices, offsets, dist.group.WORLD, manual_post_all_gather_processing=True
        )
        mine = buffer[rank * shard : (rank + 1) * shard].clone()
        dist.all_gather(list(buffer.chunk(world)), mine)
        post_all_gather_processing(weights)
        out[recipe_name] = [
            _result(w, m, buffer, recipe_name) for w, m in zip(weights, masters, strict=True)
        ]
    return out


def _result(w: Float8Tensor, master: torch.Tensor, buffer: torch.Tensor, recipe_name: str):
    """What a rank sends back about one weight (plain tensors: fp8 ones do not pickle)."""
    expected = _expected(w, master)
    start = buffer.data_ptr()
    delayed = recipe_name == "delayed"
    return {
        "data": w._data.clone(),
        "transpose": w._transpose.clone(),
        "aliased": start <= w._data.data_ptr() < start + buffer.numel(),
        "scale_inv": w._scale_inv.clone(),
        "expected_data": expected.rowwise_data.view(torch.uint8).clone(),
        "expected_scale_inv": expected.scale_inv.clone(),
        "amax_max": master.to(w.dtype).abs().max().float().view(1),
        "amax": w._get_quantizer().amax.clone() if delayed else None,
    }


def test_two_ranks_cast_their_slices_and_the_gathered_bytes_equal_the_whole(tmp_path):
    results = on_ranks(_megatron_step, 2, tmp_path)
    for rank, out in enumerate(results):
        for recipe_name, weights in out.items():
            for i, w in enumerate(weights):
                where = f"rank {rank}, {recipe_name}, weight {i}"
                assert w["aliased"], where
                assert torch.equal(w["data"], w["expected_data"]), where
                assert torch.equal(w["transpose"], w["data"].t()), where
                # Current scaling: the amax of the whole weight, though weight 1's largest value
                # lies in rank 1's slice; delayed: the recorded amax reduced over the ranks.
                assert torch.equal(w["scale_inv"], w["expected_scale_inv"]), where
                if recipe_name == "delayed":
                    assert torch.equal(w["amax"], w["amax_max"]), where


# ----------------------------------------------------------------------------------------------
# replace_raw_data, make_like and the other Transformer Engine names
# ----------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("cpu_default_device")
def test_replace_raw_data_keeps_the_value_and_aliases_the_buffer():
    (w, _, _) = _model("current", torch.bfloat16)
    w.update_usage(columnwise_usage=True)
    value, transpose = w.dequantize(), w._transpose.clone()
    buffer = torch.full((2000,), 7, dtype=torch.uint8)
    replace_raw_data(w, buffer[100 : 100 + w.numel()])
    assert torch.equal(w.dequantize(), value) and torch.equal(w._transpose, transpose)
    assert w._data.data_ptr() == buffer[100:].data_ptr()
    assert torch.all(buffer[:100] == 7) and torch.all(buffer[100 + w.numel() :] == 7)
    buffer[100 : 100 + w.numel()] = 0x38  # 1.0 in e4m3: the tensor reads the buffer
    assert torch.all(w._data == 0x38)


@pytest.mark.usefixtures("cpu_default_device")
def test_replace_raw_data_refuses_bad_input():
    (w, _, _) = _model("current", torch.float32)
    with pytest.raises(ValueError, match="Float8Tensor"):
        replace_raw_data(torch.zeros(4), torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"torch\.uint8"):
        replace_raw_data(w, torch.zeros(w.numel(), dtype=torch.float32))
    with pytest.raises(ValueError, match=f"{w.numel()} elements"):
        replace_raw_data(w, torch.zeros(w.numel() + 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous"):
        replace_raw_data(w, torch.zeros(w.numel(), 2, dtype=torch.uint8)[:, 0])
    with pytest.raises(TypeError, match="new_raw_data"):
        replace_raw_data(w, None)
    with pytest.raises(ValueError, match="must be on cpu"):
        replace_raw_data(w, torch.zeros(w.numel(), dtype=torch.uint8, device="meta"))


@pytest.mark.usefixtures("cpu_default_device")
def test_make_like_shares_scale_inv_and_by_default_the_data():
    (w, _, _) = _model("current", torch.bfloat16)
    w.update_usage(columnwise_usage=True)
    same = Float8Tensor.make_like(w)
    assert type(same) is Float8Tensor and same.shape == w.shape and same.dtype == w.dtype
    assert same._data.data_ptr() == w._data.data_ptr()
    assert same._transpose.data_ptr() == w._transpose.data_ptr()
    assert same._scale_inv is w._scale_inv and same._quantizer is w._quantizer
    assert not same.requires_grad
    flat = Float8Tensor.make_like(w, shape=(w.numel(),), dtype=torch.float32, requires_grad=True)
    assert flat.shape == (w.numel(),) and flat.dtype == torch.float32 and flat.requires_grad
    assert flat._transpose is None and flat._data.data_ptr() == w._data.data_ptr()
    assert torch.equal(flat.dequantize().detach(), w.dequantize(torch.float32).view(-1))
    data = torch.full((3, 48), 0x38, dtype=torch.uint8)  # 1.0 in e4m3
    new = Float8Tensor.make_like(w, data=data)
    assert new.shape == (3, 48) and new._data.data_ptr() == data.data_ptr()
    assert torch.equal(new.dequantize(), torch.full((3, 48), 1.0) * w._scale_inv.bfloat16())
    t = torch.full((48, 3), 0x38, dtype=torch.uint8)
    both = Float8Tensor.make_like(w, data=data, data_transpose=t)
    assert torch.equal(both._transpose, t) and both._storage.columnwise_data.shape == (48, 16)


@pytest.mark.usefixtures("cpu_default_device")
def test_make_like_refuses_bad_input():
    (w, _, _) = _model("current", torch.float32)
    with pytest.raises(TypeError, match="Float8Tensor"):
        Float8Tensor.make_like(torch.zeros(2))
    with pytest.raises(ValueError, match="elements"):
        Float8Tensor.make_like(w, shape=(5, 5))
    with pytest.raises(ValueError, match="dtype"):
        Float8Tensor.make_like(w, dtype=torch.int32)
    with pytest.raises(ValueError, match="data_transpose"):
        Float8Tensor.make_like(w, data_transpose=torch.zeros(3, 3, dtype=torch.uint8))


@pytest.mark.usefixtures("cpu_default_device")
def test_transformer_engine_names_of_float8_tensor():
    quantizer = Float8CurrentScalingQuantizer(torch.float8_e5m2, internal=False)
    t = quantizer.quantize(representable((5, 16), torch.float8_e5m2), columnwise=False)
    assert t._get_quantizer() is quantizer
    t._quantizer = None
    default = t._get_quantizer()
    assert type(default) is Float8CurrentScalingQuantizer
    assert default.fp8_dtype == torch.float8_e5m2
    t.update_usage(columnwise_usage=True)
    assert torch.equal(t._transpose, t._data.t())
    t._reset_caches()
    assert t._transpose is None and t._data is not None
    t._create_transpose()
    assert torch.equal(t._transpose, t._data.t())
    with pytest.raises(ValueError, match="80 elements"):
        t._data = torch.zeros(3, dtype=torch.uint8)
    value = t.dequantize()
    t._data = None  # the columnwise copy is the value now
    t._reset_caches()  # ... and is kept
    assert t._transpose is not None and t._data is None
    t.update_usage(rowwise_usage=True, columnwise_usage=False)
    assert torch.equal(t.dequantize(), value)
    with pytest.raises(ValueError, match="without data"):
        t._data = None


# ----------------------------------------------------------------------------------------------
# Bad input to the casts: refused before anything changes
# ----------------------------------------------------------------------------------------------


def _bad_call(case: str, weights, masters):
    """(arguments, error, message) of a call with one bad argument."""
    m0 = masters[0].view(-1)
    good = [m0[:10], None, None]
    two = [m0[:10], m0[:4], None]  # weight 1 (768 elements) gets 4 of them
    return {
        "lengths": ((weights, good[:2], [0, None]), ValueError, "master_weights has 2"),
        "plain weight": (
            ([weights[0], torch.zeros(3)], good[:2], [0, None]),
            ValueError,
            r"model_weights\[1\]",
        ),
        "no offset": ((weights, two, [0, None, None]), ValueError, r"start_offsets\[1\] is None"),
        "negative": ((weights, two, [0, -1, None]), ValueError, r"start_offsets\[1\] = -1"),
        "too far": ((weights, two, [0, 766, None]), ValueError, r"\[0, 768\]"),
        "offset type": ((weights, two, [0, 1.5, None]), TypeError, "must be an int"),
        "master device": (
            (weights, [m0[:10], torch.ones(4, device="meta"), None], [0, 0, None]),
            ValueError,
            r"master_weights\[1\] is on meta",
        ),
        "integer master": (
            (weights, [m0[:10], torch.ones(4, dtype=torch.int32), None], [0, 0, None]),
            TypeError,
            "floating-point",
        ),
        "fsdp lengths": (
            (weights, good, [0, None, None], None, [None]),
            ValueError,
            "fsdp_shard_model_weights has 1",
        ),
        "fsdp none": (
            (weights, good, [0, None, None], None, [None] * 3),
            ValueError,
            r"fsdp_shard_model_weights\[0\] is None",
        ),
        "fsdp size": (
            (weights, good, [0, None, None], None, [torch.zeros(9, dtype=torch.uint8), None, None]),
            ValueError,
            "10 elements",
        ),
    }[case]


BAD_CASES = [
    "lengths",
    "plain weight",
    "no offset",
    "negative",
    "too far",
    "offset type",
    "master device",
    "integer master",
    "fsdp lengths",
    "fsdp none",
    "fsdp size",
]


@pytest.mark.usefixtures("cpu_default_device")
@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_is_refused_before_anything_changes(case):
    weights = _model("current", torch.float32)
    masters = _masters(weights)
    args, error, match = _bad_call(case, weights, masters)
    args = (*args, None) if len(args) == 3 else args  # group: none (one process)
    before = [(w._data.clone(), w._scale_inv.clone()) for w in weights]
    with pytest.raises(error, match=match):
        quantize_master_weights(*args)
    for w, (data, scale_inv) in zip(weights, before, strict=True):
        assert torch.equal(w._data, data) and torch.equal(w._scale_inv, scale_inv)
        assert w.get_high_precision_init_val() is not None


@pytest.mark.usefixtures("cpu_default_device")
def test_quantizer_of_another_fp8_dtype_and_bad_post_processing_input_are_refused():
    (w, _, _) = _model("current", torch.float32)
    w._quantizer = Float8CurrentScalingQuantizer(torch.float8_e5m2)
    with pytest.raises(ValueError, match="quantizer makes"):
        quantize_master_weights([w], [torch.zeros(4)], [0], None)
    plain = torch.zeros(3)
    post_all_gather_processing(plain)  # plain tensors: nothing to do
    with pytest.raises(TypeError, match=r"model_weights\[1\]"):
        post_all_gather_processing([plain, "weight"])


# ----------------------------------------------------------------------------------------------
# GPU: the same bytes as on the CPU
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_cuda_casts_give_the_cpu_bytes(recipe_name):
    cpu_layers = _layers(recipe_name, torch.bfloat16)
    masters = _masters([layer.weight for layer in cpu_layers])
    cuda_layers = [copy.deepcopy(layer).to("cuda") for layer in cpu_layers]
    results = []
    for layers in (cpu_layers, cuda_layers):
        weights = [layer.weight for layer in layers]
        assert all(isinstance(w, Float8Tensor) for w in weights)
        on_device = [m.to(weights[0].device) for m in masters]
        ranges = megatron_ranges([w.numel() for w in weights], 2, 0)
        ranges = [
            r if r is not None else (0, w.numel()) for r, w in zip(ranges, weights, strict=True)
        ]
        slices, offsets = _slices(on_device, ranges)  # weight 1 in part, the others whole
        cast_master_weights_to_fp8(weights, slices, offsets, None)
        post_all_gather_processing(weights)
        results.append([(w._data.cpu(), w._transpose.cpu(), w._scale_inv.cpu()) for w in weights])
    for cpu, cuda in zip(*results, strict=True):
        for a, b in zip(cpu, cuda, strict=True):
            assert torch.equal(a, b)
