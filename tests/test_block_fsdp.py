"""Block-scaled parameters (te.quantized_model_init under Float8BlockScaling, MXFP8 and NVFP4
(2-D weight blocks, and 1 x 16 with disable_2d_quantization)) under FSDP2 (fully_shard) on 2
gloo ranks of the CPU, and their pieces on one process.

Every rank trains on the same batch, so the sharded model must equal one process training the
whole model bit for bit: the gathered bytes and scales are the unsharded parameter's, the
losses and the stepped parameters the one process's. NVFP4's stochastic rounding of gradients
draws from torch's generator, seeded alike before each step in both runs.
"""

from __future__ import annotations

import contextlib
import functools
import io
import warnings

import pytest
import torch
import torch.distributed as dist
from ranks import each_config, on_ranks
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import fully_shard

import torchte as te
from torchte import recipe
from torchte.quantization import block_fsdp, block_state
from torchte.quantization.block_tensor import Float8BlockwiseQTensor, MXFP8Tensor, NVFP4Tensor

WORLD = 2
H, F, T = 128, 256, 32
RECIPES = {
    "blockwise": recipe.Float8BlockScaling,
    "mxfp8": recipe.MXFP8BlockScaling,
    "nvfp4": recipe.NVFP4BlockScaling,
    "nvfp4_1d": functools.partial(recipe.NVFP4BlockScaling, disable_2d_quantization=True),
}
CLASSES = {
    "blockwise": Float8BlockwiseQTensor,
    "mxfp8": MXFP8Tensor,
    "nvfp4": NVFP4Tensor,
    "nvfp4_1d": NVFP4Tensor,
}
# The slots a gathered weight holds: the rowwise copy (and its amax), both where neither copy
# is made exactly from the other (MXFP8, NVFP4 with 1 x 16 blocks).
GATHERED = {"blockwise": 2, "mxfp8": 4, "nvfp4": 3, "nvfp4_1d": 6}
# NVFP4 shards in 16-row tiles: out = 32 gives te.Linear's weight 16 rows a rank (its scales
# padded to 128 rows on each rank and after the gather).
OUT = {"nvfp4": 32, "nvfp4_1d": 32}
FP8_BLOCK = ["blockwise", "mxfp8"]


def _model(precision: str, out: int | None = None) -> torch.nn.Module:
    """te.Linear (H -> out) and te.LayerNormMLP (out -> F -> out) with block-scaled weights."""
    out = OUT.get(precision, F) if out is None else out
    torch.manual_seed(0)
    with te.quantized_model_init(recipe=RECIPES[precision]()):
        return torch.nn.Sequential(te.Linear(H, out), te.LayerNormMLP(out, F))


def _shard(model: torch.nn.Module) -> torch.nn.Module:
    for child in model.children():
        fully_shard(child)
    return fully_shard(model)


def _batch() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(-4, 5, (T, H), generator=gen).float() / 8


def _train(model, precision: str, steps: int = 3, start: int = 0) -> list[float]:
    """The losses of `steps` SGD steps (numbered from `start`: each seeds torch's generator)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.25, foreach=True)
    losses = []
    for step in range(start, start + steps):
        torch.manual_seed(100 + step)
        with te.autocast(recipe=RECIPES[precision]()):
            loss = model(_batch()).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _held(storage) -> dict[str, torch.Tensor]:
    """{slot: tensor} of the data tensors a storage holds."""
    held = zip(storage._SAVED, storage.get_data_tensors(), strict=True)
    return {n: t for n, t in held if t is not None}


def _bytes(tensor) -> dict[str, torch.Tensor]:
    """{slot: its bytes as uint8} of the data tensors tensor's storage holds."""
    return {n: t.contiguous().view(torch.uint8) for n, t in _held(tensor._storage).items()}


def _gathered_per_rank(value, precision: str) -> int:
    """The bytes a rank sends for block-scaled weight `value` (its unsharded form) per
    all-gather: its rows of the gathered slots (scales without their padding rows)."""
    if precision == "blockwise":
        rowwise = [t for n, t in _bytes(value).items() if n.startswith("rowwise")]
        return sum(t.numel() for t in rowwise) // WORLD
    if precision == "mxfp8":
        return sum(t.numel() for t in _bytes(value).values()) // WORLD
    storage, rows = value._storage, value.shape[0] // WORLD  # 2-D values: rows = M / WORLD
    sent = storage.rowwise_data.numel() // WORLD + rows * storage.rowwise_scale_inv.shape[1] + 4
    if precision == "nvfp4_1d":
        scale_rows = storage.columnwise_scale_inv.shape[0]
        sent += storage.columnwise_data.numel() // WORLD + rows // 16 * scale_rows + 4
    return sent


def _weights(model) -> list[tuple[str, torch.nn.Module]]:
    return [("weight", model[0]), ("fc1_weight", model[1]), ("fc2_weight", model[1])]


@contextlib.contextmanager
def _gathered(model):
    """{(module index, name): (class, shape, bytes, bytes with the columnwise copy made) of the
    weight each module's forward saw (the all-gathered one: copied, as FSDP2 frees its memory
    after the forward)}."""
    seen, hooks = {}, []
    for i, (name, module) in enumerate(_weights(model)):

        def hook(mod, args, i=i, name=name):
            weight = getattr(mod, name)
            data = {n: b.clone() for n, b in _bytes(weight).items()}
            made = block_state.map_storage(weight._storage, torch.clone)
            made.update_usage(columnwise_usage=True)  # as the module makes it for its dgrad
            derived = {n: t.contiguous().view(torch.uint8) for n, t in _held(made).items()}
            seen[(i, name)] = (type(weight), weight.shape, data, derived)

        hooks.append(module.register_forward_pre_hook(hook))
    try:
        yield seen
    finally:
        for handle in hooks:
            handle.remove()


def _recorded_gathers():
    """[(dtype, numel)] of the inputs of FSDP2's all-gathers (patched for the block)."""
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    original, seen = getattr(dist, name), []

    def run(*args, **kwargs):
        tensor = kwargs.get("input_tensor", args[1] if len(args) > 1 else None)
        seen.append((tensor.dtype, tensor.numel()))
        return original(*args, **kwargs)

    @contextlib.contextmanager
    def patched():
        setattr(dist, name, run)
        try:
            yield seen
        finally:
            setattr(dist, name, original)

    return patched()


def _check_trains_as_one_process(precision: str, rank: int) -> None:
    """Shards are block-scaled tensors of half the rows; the gathered weights hold the
    unsharded bytes (the columnwise copy made from them too); three SGD steps equal one
    process's, parameters included; the weights move as their bytes plus their scales (NVFP4:
    and its amax). NVFP4: the ranks' rows of a weight peak at different values, so a step that
    cast each shard with its own amax could not match."""
    ref, sharded = _model(precision), _shard(_model(precision))
    cls = CLASSES[precision]
    peaks = []
    for (name, module), (_, ref_module) in zip(_weights(sharded), _weights(ref), strict=True):
        local = getattr(module, name).to_local()
        whole = getattr(ref_module, name)
        assert type(local) is cls and local.shape[0] == whole.shape[0] // WORLD, local
        rows = slice(rank * local.shape[0], (rank + 1) * local.shape[0])
        assert torch.equal(local.dequantize(), whole.dequantize()[rows])
        peaks.append(local.dequantize().abs().max())
    if precision.startswith("nvfp4"):
        low, high = torch.stack(peaks), torch.stack(peaks)
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        assert (low < high).any(), (low, high)
    with _gathered(sharded) as seen, _recorded_gathers() as moves:
        got = _train(sharded, precision, steps=1)
    assert len(seen) == 3, seen
    for (i, name), (kind, shape, data, derived) in seen.items():
        want = getattr(_weights(ref)[i][1], name)
        assert kind is cls and shape == want.shape
        assert "rowwise_data" in data and len(data) == GATHERED[precision], data.keys()
        assert derived.keys() == _bytes(want).keys(), (derived.keys(), _bytes(want).keys())
        for slot, expected in _bytes(want).items():
            assert torch.equal(derived[slot], expected), (i, name, slot)
            if slot in data:
                assert torch.equal(data[slot], expected), (i, name, slot)
    want = _train(ref, precision)
    assert got == want[:1], (got, want)
    assert got + _train(sharded, precision, steps=2, start=1) == want
    for name, value in sharded.named_parameters():
        full = value.full_tensor()
        ref_value = ref.get_parameter(name)
        if isinstance(ref_value, cls):
            assert type(full) is torch.Tensor or isinstance(full, cls)
            full, ref_value = full.float(), ref_value.dequantize().float()
        assert torch.equal(full, ref_value), name
    # Forward and backward each gather every shard once: the block weights as their bytes
    # and scales (the rowwise copy; MXFP8 and 1-D NVFP4 both), the others in fp32.
    per_rank = 0
    for value in ref.parameters():
        if isinstance(value, cls):
            per_rank += _gathered_per_rank(value, precision)
        else:
            per_rank += value.numel() * 4 // WORLD
    assert sum(n * d.itemsize for d, n in moves) == 2 * per_rank, moves


def _check_state_dict(precision: str, rank: int) -> None:
    """The full state_dict of the sharded model holds the one process's values."""
    ref, sharded = _model(precision), _shard(_model(precision))
    options = StateDictOptions(full_state_dict=True)
    state = get_model_state_dict(sharded, options=options)
    for name, value in ref.state_dict().items():
        if not isinstance(value, torch.Tensor):
            continue
        got = state[name]
        got = got.dequantize() if hasattr(got, "dequantize") else got
        value = value.dequantize() if hasattr(value, "dequantize") else value
        assert torch.equal(got.float(), value.float()), name


def _check_state_dict_round_trip(precision: str, rank: int) -> None:
    """After a step, the sharded state_dict (pickled through torch.save) and the full one each
    load into a freshly sharded model as the same bytes, scales and amaxes."""
    trained = _shard(_model(precision))
    _train(trained, precision, steps=1)
    buffer = io.BytesIO()
    torch.save(get_model_state_dict(trained), buffer)
    buffer.seek(0)
    sharded_state = torch.load(buffer, weights_only=False)
    full = StateDictOptions(full_state_dict=True)
    full_state = get_model_state_dict(trained, options=full)
    for state, options in ((sharded_state, None), (full_state, full)):
        fresh = _shard(_model(precision))
        set_model_state_dict(fresh, state, options=options)
        for (name, want), got in zip(trained.named_parameters(), fresh.parameters(), strict=True):
            want, got = want.to_local(), got.to_local()
            if not isinstance(want, CLASSES[precision]):
                assert torch.equal(got, want), name
                continue
            assert type(got) is type(want), name
            assert _bytes(got).keys() == _bytes(want).keys(), name
            for slot, data in _bytes(want).items():
                assert torch.equal(_bytes(got)[slot], data), (name, slot)


# te.Linear's out_features whose shards are not whole blocks: 64 rows a rank (not 128-row
# blocks), NVFP4 24 (not 16-row tiles).
UNALIGNED = {"blockwise": 128, "mxfp8": 128, "nvfp4": 48, "nvfp4_1d": 48}


def _check_unaligned_falls_back(precision: str, rank: int) -> None:
    """A weight whose shards are not whole blocks is sharded in high precision, with a warning
    saying why; the first step equals one process's (the gathered values are the quantized
    values, and requantizing them in the forward gives them back)."""
    out = UNALIGNED[precision]
    block_fsdp._warned.clear()  # once per class, shape and reason: nvfp4 and nvfp4_1d share them
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        sharded = _shard(_model(precision, out=out))
    messages = [str(w.message) for w in caught if "high precision" in str(w.message)]
    rows = 16 if precision.startswith("nvfp4") else 128
    assert messages and f"multiple of {rows} x the number of ranks" in messages[0], messages
    assert type(sharded[0].weight.to_local()) is torch.Tensor
    assert type(sharded[1].fc1_weight.to_local()) is CLASSES[precision]
    assert _train(sharded, precision, steps=1) == _train(_model(precision, out=out), precision, 1)


def _check_amax_reductions_chain(rank: int) -> None:
    """An NVFP4 shard's quantizer all-reduces the amax over the FSDP2 group after any reduction
    its quantizer had (which it keeps); other formats' quantizers are left as they are."""
    from torchte.quantization.nvfp4 import NVFP4Quantizer

    calls = []
    quantizer = NVFP4Quantizer(internal=False)
    quantizer.amax_reduction = calls.append
    agreeing = block_fsdp._agreeing_quantizer(quantizer, dist.group.WORLD)
    amax = torch.tensor([1.0 + rank])
    agreeing.amax_reduction(amax)
    assert calls == [amax] and amax.item() == WORLD, (calls, amax)
    assert quantizer.amax_reduction == calls.append and agreeing is not quantizer
    other = _param("blockwise")._quantizer
    assert block_fsdp._agreeing_quantizer(other, dist.group.WORLD) is other


def _rank_main(rank: int) -> dict:
    warnings.simplefilter("error", RuntimeWarning)  # torchte's setattr guard, as in the suite
    configs = [(p,) for p in RECIPES]
    outcome = each_config(_check_trains_as_one_process, configs, rank, named=True, limit=800)
    outcome.update(each_config(_check_state_dict, configs, rank, named=True, limit=800))
    outcome.update(
        each_config(
            _check_state_dict_round_trip, [("nvfp4",), ("blockwise",)], rank, named=True, limit=800
        )
    )
    outcome.update(each_config(_check_unaligned_falls_back, configs, rank, named=True, limit=800))
    outcome.update(each_config(_check_amax_reductions_chain, [()], rank, named=True, limit=800))
    outcome.update(
        each_config(_check_master_slices_cut_anywhere, [()], rank, named=True, limit=800)
    )
    return outcome


def test_fsdp2_block_scaled_parameters(tmp_path):
    for outcome in on_ranks(_rank_main, WORLD, tmp_path):
        failed = {config: text for config, text in outcome.items() if text != "ok"}
        assert not failed, failed


# -- one process: the pieces FSDP2 shards with -----------------------------------------------


def _param(precision: str, rows: int = 256, cols: int = 128):
    torch.manual_seed(0)
    with te.quantized_model_init(recipe=RECIPES[precision]()):
        return te.Linear(cols, rows).weight


@pytest.mark.parametrize("precision", FP8_BLOCK)
def test_even_chunks_are_views_of_whole_blocks(precision):
    weight = _param(precision)
    pieces = torch.chunk(weight, 2)
    assert all(type(p) is CLASSES[precision] for p in pieces)
    assert (
        pieces[1]._storage.rowwise_data.data_ptr() == weight._storage.rowwise_data[128:].data_ptr()
    )
    assert torch.equal(torch.cat([p.dequantize() for p in pieces]), weight.dequantize())
    zeros = weight.new_zeros((128, 128))
    assert type(zeros) is CLASSES[precision] and not zeros.dequantize().any()
    zeros.copy_(pieces[1])
    assert torch.equal(zeros.dequantize(), pieces[1].dequantize())


@pytest.mark.parametrize("precision", FP8_BLOCK)
def test_uneven_chunks_dequantize_without_warning_outside_fsdp(precision):
    weight = _param(precision)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pieces = torch.chunk(weight, 4)  # 64 rows: not whole blocks
    assert all(type(p) is torch.Tensor for p in pieces)
    assert torch.equal(torch.cat(pieces), weight.dequantize())
    assert type(weight.new_zeros((64, 128))) is torch.Tensor
    assert type(weight.view(-1)) is torch.Tensor  # the lazy flat view is FSDP2's only


@pytest.mark.parametrize("precision", ["nvfp4", "nvfp4_1d"])
def test_nvfp4_chunks_are_16_row_values_of_their_own(precision):
    """torch.chunk of an NVFP4 weight into 16-row pieces: NVFP4Tensors holding those rows'
    bytes, their scales padded as a 16-row value's, the whole weight's amax; copies (a write
    into one leaves the weight as it was). With 2-D blocks the columnwise copy is dropped (made
    again from the rowwise one); with 1 x 16 blocks each piece keeps its columns of it."""
    weight = _param(precision, rows=48, cols=64).detach()
    whole = {n: t.clone() for n, t in _held(weight._storage).items()}
    whole_columns = block_state.map_storage(weight._storage, torch.clone)
    if precision == "nvfp4_1d":
        whole_columns.update_usage(rowwise_usage=False)
        whole_columns = whole_columns.dequantize()
    pieces = torch.chunk(weight, 3)
    assert all(type(p) is NVFP4Tensor and p.shape == (16, 64) for p in pieces)
    for i, piece in enumerate(pieces):
        held = _held(piece._storage)
        rows = slice(16 * i, 16 * (i + 1))
        assert held["rowwise_scale_inv"].shape == (128, 4)
        assert torch.equal(held["rowwise_data"], whole["rowwise_data"][rows])
        assert torch.equal(held["rowwise_scale_inv"][:16], whole["rowwise_scale_inv"][rows])
        assert not held["rowwise_scale_inv"][16:].any()
        assert torch.equal(held["amax_rowwise"], whole["amax_rowwise"])
        assert ("columnwise_data" in held) == (precision == "nvfp4_1d"), held.keys()
        if precision == "nvfp4_1d":
            assert held["columnwise_scale_inv"].shape == (128, 4)
            assert torch.equal(
                held["columnwise_data"], whole["columnwise_data"][:, 8 * i : 8 * i + 8]
            )
            columns_only = block_state.map_storage(piece._storage, torch.clone)
            columns_only.update_usage(rowwise_usage=False)
            assert torch.equal(columns_only.dequantize(), whole_columns[rows])
    assert torch.equal(torch.cat([p.dequantize() for p in pieces]), weight.dequantize())
    pieces[0].copy_(torch.zeros(16, 64))
    assert torch.equal(weight._storage.rowwise_data, whole["rowwise_data"])
    zeros = weight.new_zeros((16, 64))
    assert type(zeros) is NVFP4Tensor and not zeros.dequantize().any()
    zeros.copy_(pieces[1])
    assert torch.equal(zeros.dequantize(), pieces[1].dequantize())
    assert _bytes(zeros).keys() == _bytes(pieces[1]).keys()


def test_nvfp4_pieces_not_whole_tiles_dequantize():
    """Pieces of 8 rows (not 16-row tiles) are plain dequantized tensors, without a warning
    outside FSDP2."""
    weight = _param("nvfp4", rows=32, cols=64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pieces = torch.chunk(weight, 4)
    assert all(type(p) is torch.Tensor for p in pieces)
    assert torch.equal(torch.cat(pieces), weight.dequantize())
    assert type(weight.new_zeros((8, 64))) is torch.Tensor


def test_grouped_3d_value_splits_by_whole_matrices():
    from torchte.quantization.blockwise import Float8BlockQuantizer

    quantizer = Float8BlockQuantizer(torch.float8_e4m3fn, internal=False)
    value = quantizer.quantize(torch.randn(4, 96, 130))
    pieces = torch.chunk(value, 2)
    assert all(type(p) is Float8BlockwiseQTensor and p.shape == (2, 96, 130) for p in pieces)
    assert torch.equal(torch.cat([p.dequantize() for p in pieces]), value.dequantize())


def test_block1d_pieces_slice_both_copies():
    from torchte.quantization.blockwise import Float8BlockQuantizer

    quantizer = Float8BlockQuantizer(torch.float8_e4m3fn, block_scaling_dim=1, internal=False)
    x_hp = torch.randn(256, 200)
    pieces = torch.chunk(quantizer.quantize(x_hp), 2)
    for i, piece in enumerate(pieces):  # each copy's bytes and scales: those of its rows alone
        alone = quantizer.quantize(x_hp[i * 128 : (i + 1) * 128])
        want = _bytes(alone)
        assert _bytes(piece).keys() == want.keys()
        for slot, data in _bytes(piece).items():
            assert torch.equal(data, want[slot]), slot


def test_layout_reasons():
    from torchte.quantization.blockwise import Float8BlockQuantizer

    vector = Float8BlockQuantizer(torch.float8_e4m3fn, internal=False).quantize(torch.ones(256))
    assert "1-D" in block_fsdp.row_layout(vector)
    assert not block_fsdp.in_fsdp_sharding()


# -- Megatron-Core's --fp8-param-gather under fp8_recipe="blockwise" (tensor.utils) ----------


def _blockwise_weight(master: torch.Tensor):
    from torchte.quantization.blockwise import Float8BlockQuantizer

    quantizer = Float8BlockQuantizer(torch.float8_e4m3fn, internal=False)
    return quantizer.quantize(torch.zeros_like(master)), quantizer.quantize(master)


def _check_master_slices_cut_anywhere(rank: int) -> None:
    """Each rank casts a slice of the master cut inside a 128x128 tile (and inside a row); after
    the bytes' all-gather (here a sum of what each rank wrote) and post_all_gather_processing,
    the weight equals quantizing the whole master: bytes, scales, columnwise copy."""
    from torchte.quantization import block_param_utils as bpu

    gen = torch.Generator().manual_seed(3)
    master = torch.randn(300, 200, generator=gen) * torch.rand(300, 1, generator=gen) * 4
    weight, want = _blockwise_weight(master)
    cut = 131 * 200 + 77  # row 131 (block row 1), column 77
    start, stop = (0, cut) if rank == 0 else (cut, master.numel())
    mine = master.reshape(-1)[start:stop].clone()
    bpu.quantize_master_weights(
        [weight], [mine], [start], None, manual_post_all_gather_processing=True
    )
    written = torch.zeros(master.numel(), dtype=torch.int32)
    written[start:stop] = weight._storage.rowwise_data.view(torch.uint8).view(-1)[start:stop].int()
    dist.all_reduce(written)
    weight._rowwise_data.view(-1).copy_(written.to(torch.uint8))
    bpu.post_all_gather_processing([weight])
    assert _bytes(weight).keys() == _bytes(want).keys()
    for slot, data in _bytes(want).items():
        assert torch.equal(_bytes(weight)[slot], data), slot
