"""Transformer Engine's tensor.utils.quantize_master_weights for MXFP8 and 16x16-tile NVFP4
weights (block_param_utils), as Megatron-Core's distributed optimizer calls it with
--fp8-param-gather / --fp4-param-gather: each data-parallel rank holds a slice of each weight's
flattened fp32 / bf16 master, cut anywhere (through rows, 32-value blocks, 16x16 tiles and, for
NVFP4, through a byte holding two values), and casts it into the weight's bytes.

After every rank wrote its slice and the bytes are gathered (here: each rank's written range
summed over the ranks, per FP4 nibble for NVFP4), the weight must equal quantizing the whole
master: identical bytes, scales (and NVFP4's amax and, after post_all_gather_processing, its
columnwise copy), special values included.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from ranks import on_ranks

import torchte as te
from torchte import recipe
from torchte.kernels import nvfp4_cast as nv
from torchte.quantization import block_param_utils as bpu
from torchte.quantization.block_tensor import MXFP8Tensor, NVFP4Tensor
from torchte.quantization.mxfp8 import MXFP8Quantizer
from torchte.quantization.nvfp4 import NVFP4Quantizer

WORLD = 2
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SLOTS = ("rowwise_data", "columnwise_data", "rowwise_scale_inv", "columnwise_scale_inv")


def _master(rows: int, cols: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """A master (rows, cols) of `dtype` whose 32-value blocks span many exponents, with an
    all-zero 32x32 block, tiny (subnormal in bf16) values, NaN, inf and -0.0."""
    gen = torch.Generator().manual_seed(seed)
    spread = torch.exp2(torch.randint(-20, 12, (rows, 1), generator=gen).float())
    master = torch.randn(rows, cols, generator=gen) * spread
    master[:32, 32:64] = 0.0
    master[40, 70:90] = 3e-39  # bf16 / fp32 subnormal
    master[41, 3] = float("nan")
    master[50, 100] = float("inf")
    master[51, 5] = -0.0
    return master.to(dtype)


def _weight(shape, nominal: torch.dtype, fp8_dtype=E4M3, two_d: bool = False):
    """An MXFP8Tensor of zeros (both copies) and its quantizer."""
    quantizer = MXFP8Quantizer(fp8_dtype, with_2d_quantization=two_d, internal=False)
    return quantizer.quantize(torch.zeros(shape, dtype=nominal)), quantizer


def _bytes(value) -> dict[str, torch.Tensor]:
    """{slot: its bytes as uint8} of an MXFP8Tensor's (or MXFP8TensorStorage's) tensors."""
    storage = getattr(value, "_storage", value)
    return {s: getattr(storage, s).contiguous().view(torch.uint8) for s in SLOTS}


def _assert_same(weight, want, what: str) -> None:
    got, expected = _bytes(weight), _bytes(want)
    for slot in SLOTS:
        assert torch.equal(got[slot], expected[slot]), f"{what}: {slot} differs"


def _slice(master: torch.Tensor, cut: int, rank: int):
    """(this rank's flat slice of master, its start): rank 0 [0, cut), rank 1 [cut, N);
    None where the rank's range is empty."""
    start, stop = (0, cut) if rank == 0 else (cut, master.numel())
    if start == stop:
        return None, None
    return master.reshape(-1)[start:stop].clone(), start


def _gather(buffers: list[torch.Tensor], bounds: tuple[int, int] | None) -> None:
    """Make every rank's flat buffers (uint8 or FP8) hold what each rank wrote in its range
    `bounds` [start, stop) (a sum over the ranks of each one's range: the all-gather of the
    bytes that Megatron-Core runs)."""
    for buffer in buffers:
        flat = buffer.view(torch.uint8).view(-1)
        written = torch.zeros(flat.numel(), dtype=torch.int32)
        if bounds is not None:
            written[bounds[0] : bounds[1]] = flat[bounds[0] : bounds[1]].int()
        dist.all_reduce(written)
        flat.copy_(written.to(torch.uint8))


# (shape, nominal dtype, master dtype, fp8 dtype, 2-D blocks, the cut (rank 0 holds [0, cut)))
CASES = [
    ((96, 160), torch.float32, torch.float32, E4M3, False, 37 * 160 + 45),  # row 37, col 45
    ((64, 256), torch.bfloat16, torch.float32, E4M3, False, 0),  # rank 0 holds nothing
    ((96, 160), torch.bfloat16, torch.bfloat16, E5M2, False, 64 * 160 + 17),
    ((64, 256), torch.float32, torch.bfloat16, E4M3, True, 33 * 256 + 100),  # 32x32 blocks
    ((64, 256), torch.float32, torch.float32, E4M3, False, 64 * 256),  # rank 1 holds nothing
]


def _check_slices(rank: int, fsdp: bool, group) -> None:
    """All CASES in one call; every rank then has the whole-master quantization."""
    weights, masters, starts, shards, wants, ranges = [], [], [], [], [], []
    for k, (shape, nominal, master_dtype, fp8_dtype, two_d, cut) in enumerate(CASES):
        master = _master(*shape, seed=k, dtype=master_dtype)
        weight, quantizer = _weight(shape, nominal, fp8_dtype, two_d)
        mine, start = _slice(master, cut, rank)
        weights.append(weight)
        masters.append(mine)
        starts.append(start)
        wants.append(quantizer.quantize(master.to(nominal)))
        ranges.append(None if mine is None else (start, start + mine.numel()))
        count = 0 if mine is None else mine.numel()
        shards.append((torch.zeros(count, dtype=torch.uint8), torch.zeros(count, dtype=fp8_dtype)))
    bpu.quantize_master_weights(
        weights, masters, starts, group, fsdp_shard_model_weights=shards if fsdp else None
    )
    for weight, want, shard, bounds in zip(weights, wants, shards, ranges, strict=True):
        storage = weight._storage
        for slot in ("rowwise_scale_inv", "columnwise_scale_inv"):  # every rank: all codes
            assert torch.equal(getattr(storage, slot), getattr(want._storage, slot)), slot
        if fsdp and bounds is not None:  # the fragments: this rank's range of both copies
            for part, data in zip(shard, (want._rowwise_data, want._columnwise_data), strict=True):
                assert torch.equal(part.view(torch.uint8), data.view(-1)[bounds[0] : bounds[1]])
        if not fsdp:
            _gather([storage.rowwise_data, storage.columnwise_data], bounds)
            _assert_same(weight, want, f"weight {tuple(weight.shape)}")
    bpu.post_all_gather_processing(weights)  # nothing to do for MXFP8: nothing changes
    if not fsdp:
        for weight, want in zip(weights, wants, strict=True):
            _assert_same(weight, want, "after post_all_gather_processing")


def _check_linear_weight(rank: int) -> None:
    """A te.Linear weight from quantized_model_init under MXFP8BlockScaling, a bf16 master."""
    with te.quantized_model_init(recipe=recipe.MXFP8BlockScaling()):
        weight = te.Linear(128, 96, params_dtype=torch.bfloat16, device="cpu").weight
    assert type(weight) is MXFP8Tensor
    master = _master(96, 128, seed=9, dtype=torch.float32)
    want = weight._get_quantizer().quantize(master.to(weight.dtype))
    mine, start = _slice(master, 50 * 128 + 31, rank)
    version = weight._version
    bpu.quantize_master_weights([weight], [mine], [start], dist.group.WORLD)
    assert weight._version > version
    bounds = (start, start + mine.numel())
    _gather([weight._storage.rowwise_data, weight._storage.columnwise_data], bounds)
    _assert_same(weight, want, "te.Linear weight")


# -- NVFP4 (16x16 tiles): each rank writes the nibbles of its slice of the rowwise data --------

NV_ROWWISE = ("rowwise_data", "rowwise_scale_inv", "amax_rowwise")
NV_ALL = (*NV_ROWWISE, "columnwise_data", "columnwise_scale_inv", "amax_columnwise")


def _nvfp4_master(rows: int, cols: int, seed: int, dtype: torch.dtype, inf: bool = False):
    """A master (rows, cols) of `dtype` whose 16x16 tiles span exponents 2^-6 .. 2^6, with an
    all-zero tile, tiny (subnormal in bf16) values, NaN, -0.0 and, if asked, inf."""
    gen = torch.Generator().manual_seed(seed)
    tiles = (rows // 16, 1, cols // 16, 1)
    spread = torch.exp2(torch.randint(-6, 7, tiles, generator=gen).float())
    master = torch.randn(rows // 16, 16, cols // 16, 16, generator=gen) * spread
    master = master.reshape(rows, cols)
    master[16:32, 16:32] = 0.0
    master[5, 20:30] = 3e-39
    master[7, 3] = float("nan")
    master[9, 10] = -0.0
    if inf:
        master[20, 40] = float("inf")
    return master.to(dtype)


def _nvfp4_weight(shape, nominal: torch.dtype, **flags):
    """An NVFP4Tensor of zeros (16x16 tiles unless flags say otherwise) and its quantizer."""
    quantizer = NVFP4Quantizer(**{"with_2d_quantization": True, **flags}, internal=False)
    return quantizer.quantize(torch.zeros(shape, dtype=nominal)), quantizer


def _nv_same(weight, want, slots, what: str) -> None:
    for slot in slots:
        got = getattr(weight._storage, slot)
        expected = getattr(getattr(want, "_storage", want), slot)
        assert got is not None and torch.equal(got, expected), f"{what}: {slot} differs"


def _nibbles(data: torch.Tensor) -> torch.Tensor:
    """The FP4 codes (int64, one per value, flat) of NVFP4 bytes (low nibble first)."""
    return torch.stack((data & 15, data >> 4), dim=-1).reshape(-1).long()


def _gather_nibbles(data: torch.Tensor, bounds: tuple[int, int] | None) -> None:
    """Make every rank's NVFP4 bytes hold, value by value, what the rank owning the value
    [start, stop) wrote (a byte may hold one value of each rank)."""
    codes = _nibbles(data)
    written = torch.zeros_like(codes)
    if bounds is not None:
        written[bounds[0] : bounds[1]] = codes[bounds[0] : bounds[1]]
    dist.all_reduce(written)
    pairs = written.view(-1, 2)
    data.view(-1).copy_(pairs[:, 0] | (pairs[:, 1] << 4))


# (shape, nominal dtype, master dtype, the cut (rank 0 holds [0, cut)), inf in the master)
NV_CASES = [
    ((96, 160), torch.float32, torch.float32, 37 * 160 + 45, False),  # odd: a byte is shared
    ((64, 256), torch.bfloat16, torch.float32, 0, False),  # rank 0 holds nothing
    ((48, 80), torch.bfloat16, torch.bfloat16, 20 * 80 + 7, True),  # odd, inf
    ((32, 48), torch.float16, torch.float32, 16 * 48 + 20, False),  # even, inside a row
    ((64, 128), torch.float32, torch.bfloat16, 64 * 128, False),  # rank 1 holds nothing
]


def _check_nvfp4_slices(rank: int, fsdp: bool) -> None:
    """All NV_CASES in one call; every rank then has the whole-master quantization."""
    weights, masters, starts, shards, wants, ranges = [], [], [], [], [], []
    for k, (shape, nominal, master_dtype, cut, inf) in enumerate(NV_CASES):
        master = _nvfp4_master(*shape, seed=10 + k, dtype=master_dtype, inf=inf)
        weight, quantizer = _nvfp4_weight(shape, nominal)
        mine, start = _slice(master, cut, rank)
        bounds = None if mine is None else (start, start + mine.numel())
        weights.append(weight)
        masters.append(mine)
        starts.append(start)
        wants.append(quantizer.quantize(master.to(nominal)))
        ranges.append(bounds)
        nbytes = 0 if bounds is None else (bounds[1] + 1) // 2 - bounds[0] // 2
        shards.append(torch.zeros(nbytes, dtype=torch.uint8))
    group = dist.group.WORLD if fsdp else None
    bpu.quantize_master_weights(weights, masters, starts, group, shards if fsdp else None)
    for weight, want, shard, bounds in zip(weights, wants, shards, ranges, strict=True):
        _nv_same(weight, want, NV_ROWWISE[1:], "every rank")  # scales and amax
        assert weight._storage.columnwise_data is None  # dropped: made after the gather
        if fsdp and bounds is not None:  # the fragment: this rank's nibbles, the others zero
            got, lead = _nibbles(shard), bounds[0] % 2
            count = bounds[1] - bounds[0]
            want_codes = _nibbles(want._rowwise_data)[bounds[0] : bounds[1]]
            assert torch.equal(got[lead : lead + count], want_codes), "fragment: its nibbles"
            assert not got[:lead].any() and not got[lead + count :].any(), "fragment: others"
        if not fsdp:
            _gather_nibbles(weight._storage.rowwise_data, bounds)
    if not fsdp:
        bpu.post_all_gather_processing(weights)
        for weight, want in zip(weights, wants, strict=True):
            _nv_same(weight, want, NV_ALL, f"NVFP4 weight {tuple(weight.shape)}")


def _check_nvfp4_linear_weight(rank: int) -> None:
    """A te.Linear weight from quantized_model_init under NVFP4BlockScaling, a bf16 master."""
    with te.quantized_model_init(recipe=recipe.NVFP4BlockScaling()):
        weight = te.Linear(128, 96, params_dtype=torch.bfloat16, device="cpu").weight
    assert type(weight) is NVFP4Tensor
    master = _nvfp4_master(96, 128, seed=19, dtype=torch.float32)
    want = weight._get_quantizer().quantize(master.to(weight.dtype))
    mine, start = _slice(master, 50 * 128 + 31, rank)
    version = weight._version
    bpu.quantize_master_weights([weight], [mine], [start], dist.group.WORLD)
    assert weight._version > version
    _gather_nibbles(weight._storage.rowwise_data, (start, start + mine.numel()))
    bpu.post_all_gather_processing(weight)
    _nv_same(weight, want, NV_ALL, "te.Linear NVFP4 weight")


def _rank_main(rank: int) -> dict:
    warnings.simplefilter("error", RuntimeWarning)
    outcome = {}
    checks = [
        ("slices", lambda: _check_slices(rank, False, None)),
        ("fsdp fragments", lambda: _check_slices(rank, True, dist.group.WORLD)),
        ("te.Linear weight", lambda: _check_linear_weight(rank)),
        ("NVFP4 slices", lambda: _check_nvfp4_slices(rank, False)),
        ("NVFP4 fsdp fragments", lambda: _check_nvfp4_slices(rank, True)),
        ("NVFP4 te.Linear weight", lambda: _check_nvfp4_linear_weight(rank)),
    ]
    for name, check in checks:
        try:
            check()
            outcome[name] = "ok"
        except Exception as err:  # reported per check, in the main process
            outcome[name] = f"{type(err).__name__}: {str(err)[:800]}"
    return outcome


def test_master_slices_on_two_ranks(tmp_path):
    outcomes = on_ranks(_rank_main, WORLD, tmp_path)
    failed = {
        f"rank {rank}: {name}": text
        for rank, outcome in enumerate(outcomes)
        for name, text in outcome.items()
        if text != "ok"
    }
    assert not failed, failed


# -- one process (group None, torch.distributed not initialized) -------------------------------


@pytest.mark.parametrize(
    ("nominal", "master_dtype", "fp8_dtype", "two_d"),
    [
        (torch.float32, torch.float32, E4M3, False),
        (torch.bfloat16, torch.float32, E5M2, False),
        (torch.float16, torch.bfloat16, E4M3, False),
        (torch.bfloat16, torch.bfloat16, E4M3, True),
    ],
)
def test_one_process_whole_master(nominal, master_dtype, fp8_dtype, two_d):
    master = _master(96, 160, seed=1, dtype=master_dtype)
    weight, quantizer = _weight((96, 160), nominal, fp8_dtype, two_d)
    bpu.quantize_master_weights([weight], [master], [0], None)
    _assert_same(weight, quantizer.quantize(master.to(nominal)), "whole master")
    bpu.post_all_gather_processing(weight)  # accepted, changes nothing
    _assert_same(weight, quantizer.quantize(master.to(nominal)), "post_all_gather_processing")


def test_one_process_slice_writes_only_its_range():
    """Alone, a slice's blocks get the scales of its own values: the bytes in its range are
    those of quantizing the master zeroed outside it; the bytes outside stay as they were."""
    master = _master(64, 256, seed=2, dtype=torch.float32)
    weight, quantizer = _weight((64, 256), torch.float32)
    before = {k: v.clone() for k, v in _bytes(weight).items()}
    start, stop = 17 * 256 + 40, 45 * 256 + 3
    bpu.quantize_master_weights([weight], [master.reshape(-1)[start:stop]], [start], None)
    alone = torch.zeros(master.numel())
    alone[start:stop] = master.reshape(-1)[start:stop]
    want = _bytes(quantizer.quantize(alone.view(64, 256)))
    got = _bytes(weight)
    for slot in ("rowwise_scale_inv", "columnwise_scale_inv"):
        assert torch.equal(got[slot], want[slot]), slot
    for slot in ("rowwise_data", "columnwise_data"):
        flat, flat_want, flat_before = (
            got[slot].view(-1),
            want[slot].view(-1),
            before[slot].view(-1),
        )
        assert torch.equal(flat[start:stop], flat_want[start:stop]), slot
        assert torch.equal(flat[:start], flat_before[:start]), slot
        assert torch.equal(flat[stop:], flat_before[stop:]), slot


def test_one_process_mixed_formats_and_missing_copy_under_2d():
    """A 128x128-block weight, an MXFP8 weight and a 2-D MXFP8 weight holding only its rowwise
    copy (the columnwise one is made) in one call; a weight without a master keeps its bytes
    but gets the codes of all-zero blocks."""
    from torchte.quantization.blockwise import Float8BlockQuantizer

    block_q = Float8BlockQuantizer(E4M3, internal=False)
    masters = [_master(96, 160, seed=k, dtype=torch.float32) for k in range(4)]
    block_w = block_q.quantize(torch.zeros(96, 160))
    mx_w, mx_q = _weight((96, 160), torch.float32)
    q_2d = MXFP8Quantizer(E4M3, columnwise=False, with_2d_quantization=True, internal=False)
    two_d_w = q_2d.quantize(torch.zeros(96, 160))
    assert two_d_w._storage.columnwise_data is None
    idle_w, _ = _weight((96, 160), torch.float32)
    idle_w.quantize_(masters[3])
    idle_bytes = _bytes(idle_w)
    bpu.quantize_master_weights(
        [block_w, mx_w, two_d_w, idle_w], [*masters[:3], None], [0, 0, 0, None], None
    )
    bpu.post_all_gather_processing([block_w, mx_w, two_d_w, idle_w])
    want_block = block_q.quantize(masters[0])  # inf in a tile: its scale 1, as the cast's
    for name in ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data"):
        assert torch.equal(getattr(block_w, name), getattr(want_block, name)), name
    _assert_same(mx_w, mx_q.quantize(masters[1]), "MXFP8")
    want_2d = MXFP8Quantizer(E4M3, with_2d_quantization=True).quantize(masters[2])
    _assert_same(two_d_w, want_2d, "MXFP8 2-D")
    got_idle = _bytes(idle_w)
    for slot in ("rowwise_data", "columnwise_data"):
        assert torch.equal(got_idle[slot], idle_bytes[slot]), slot
    assert not got_idle["rowwise_scale_inv"].any() and not got_idle["columnwise_scale_inv"].any()


def test_rejects_bad_inputs_before_any_change():
    weight, _ = _weight((64, 96), torch.float32)
    master = torch.randn(64 * 96)
    before = _bytes(weight)
    three_d, _ = _weight((2, 32, 64), torch.float32)
    with pytest.raises(ValueError, match=r"2-D for MXFP8.*\(2, 32, 64\)"):
        bpu.quantize_master_weights([weight, three_d], [master, None], [0, None], None)
    rowwise_only = MXFP8Quantizer(E4M3, columnwise=False, internal=False)
    with pytest.raises(ValueError, match="no columnwise data"):
        bpu.quantize_master_weights(
            [weight, rowwise_only.quantize(torch.zeros(32, 64))], [master, None], [0, None], None
        )
    with pytest.raises(ValueError, match=r"start_offsets\[1\] = 1"):
        bpu.quantize_master_weights([weight, weight], [None, master], [None, 1], None)
    with pytest.raises(TypeError, match="pair"):
        bpu.quantize_master_weights([weight], [master], [0], None, [torch.zeros(64 * 96)])
    small = (torch.zeros(10, dtype=torch.uint8), torch.zeros(10, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"\(rowwise\) must have 6144 elements"):
        bpu.quantize_master_weights([weight], [master], [0], None, [small])
    for slot, data in _bytes(weight).items():
        assert torch.equal(data, before[slot]), slot


# -- NVFP4, one process -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nominal", "master_dtype", "inf"),
    [
        (torch.float32, torch.float32, False),
        (torch.bfloat16, torch.float32, True),
        (torch.float16, torch.bfloat16, False),
    ],
)
def test_nvfp4_one_process_whole_master(nominal, master_dtype, inf):
    master = _nvfp4_master(96, 160, seed=3, dtype=master_dtype, inf=inf)
    weight, quantizer = _nvfp4_weight((96, 160), nominal)
    want = quantizer.quantize(master.to(nominal))
    bpu.quantize_master_weights([weight], [master], [0], None)
    _nv_same(weight, want, NV_ROWWISE, "whole master")
    assert weight._storage.columnwise_data is None
    bpu.post_all_gather_processing([weight])
    _nv_same(weight, want, NV_ALL, "after post_all_gather_processing")
    values, want_values = weight.dequantize(), want.dequantize()  # NaN where amax is inf
    torch.testing.assert_close(values, want_values, rtol=0, atol=0, equal_nan=True)


def test_nvfp4_slice_writes_only_its_nibbles():
    """Alone, an odd slice [start, stop) gets the scales and amax of its own values, and writes
    its values' nibbles only: the other nibble of the first and last byte, and every byte
    outside, keep what they held. With manual_post_all_gather_processing the columnwise copy
    stays until post_all_gather_processing makes it again in the same tensors."""
    master = _nvfp4_master(64, 160, seed=4, dtype=torch.float32)
    weight, quantizer = _nvfp4_weight((64, 160), torch.float32)
    weight.quantize_(_nvfp4_master(64, 160, seed=5, dtype=torch.float32))
    before = _nibbles(weight._rowwise_data.clone())
    columnwise = weight._storage.columnwise_data
    columnwise_before = columnwise.clone()
    start, stop = 17 * 160 + 41, 45 * 160 + 3
    slice_ = master.reshape(-1)[start:stop]
    bpu.quantize_master_weights([weight], [slice_], [start], None, None, True)
    alone = torch.zeros(master.numel())
    alone[start:stop] = slice_
    want = quantizer.quantize(alone.view(64, 160))
    _nv_same(weight, want, NV_ROWWISE[1:], "a slice alone")
    got, want_codes = _nibbles(weight._rowwise_data), _nibbles(want._rowwise_data)
    assert torch.equal(got[start:stop], want_codes[start:stop])
    assert torch.equal(got[:start], before[:start]) and torch.equal(got[stop:], before[stop:])
    assert weight._storage.columnwise_data is columnwise
    assert torch.equal(columnwise, columnwise_before)  # manual: not yet made again
    bpu.post_all_gather_processing(weight)
    assert weight._storage.columnwise_data is columnwise  # the same tensor, new bytes
    assert torch.equal(columnwise, nv.fp4_transpose(weight._rowwise_data))
    assert torch.equal(weight._storage.amax_columnwise, weight._storage.amax_rowwise)


def test_nvfp4_columnwise_only_weight_in_a_mixed_call():
    """An NVFP4 weight holding only its columnwise copy (the rowwise one is made) next to an
    MXFP8 weight; an NVFP4 weight without a master keeps its bytes but gets zero scales."""
    masters = [_nvfp4_master(96, 160, seed=k, dtype=torch.float32) for k in range(3)]
    columnwise_only = NVFP4Quantizer(rowwise=False, with_2d_quantization=True, internal=False)
    nv_w = columnwise_only.quantize(torch.zeros(96, 160))
    assert nv_w._storage.rowwise_data is None
    mx_w, mx_q = _weight((96, 160), torch.float32)
    idle_w, _ = _nvfp4_weight((96, 160), torch.float32)
    idle_w.quantize_(masters[2])
    idle_data = idle_w._rowwise_data.clone()
    bpu.quantize_master_weights(
        [nv_w, mx_w, idle_w], [masters[0], masters[1], None], [0, 0, None], None
    )
    bpu.post_all_gather_processing([nv_w, mx_w, idle_w])
    want = NVFP4Quantizer(with_2d_quantization=True).quantize(masters[0])
    _nv_same(nv_w, want, NV_ALL, "columnwise-only NVFP4")
    _assert_same(mx_w, mx_q.quantize(masters[1]), "MXFP8")
    assert torch.equal(idle_w._rowwise_data, idle_data)
    assert not idle_w._rowwise_scale_inv.any() and not idle_w._amax_rowwise.any()


def test_nvfp4_rejects_bad_inputs_before_any_change():
    weight, _ = _nvfp4_weight((32, 64), torch.float32)
    master = torch.randn(32 * 64)
    before = {slot: getattr(weight._storage, slot).clone() for slot in NV_ALL}
    bad_weights = [
        (_nvfp4_weight((32, 64), torch.float32, with_2d_quantization=False)[0], "16x16"),
        (_nvfp4_weight((32, 64), torch.float32, with_rht=True, with_post_rht_amax=True)[0], "RHT"),
        (_nvfp4_weight((32, 64), torch.float32, stochastic_rounding=True)[0], "stochastic"),
        (_nvfp4_weight((2, 16, 32), torch.float32)[0], r"2-D, got shape \(2, 16, 32\)"),
    ]
    for bad, match in bad_weights:
        with pytest.raises(ValueError, match=rf"model_weights\[1\] \(NVFP4Tensor\).*{match}"):
            bpu.quantize_master_weights([weight, bad], [master, None], [0, None], None)
    with pytest.raises(ValueError, match=r"post_all_gather_processing.*16x16"):
        bpu.post_all_gather_processing(bad_weights[0][0])
    slice_ = master[3:100]  # values [3, 100): bytes [1, 50)
    for shard, error, match in [
        (torch.zeros(48, dtype=torch.uint8), ValueError, r"49 bytes \(values \[3, 100\)"),
        (torch.zeros(49, dtype=torch.int8), TypeError, "torch.uint8"),
        (torch.zeros(98, dtype=torch.uint8)[::2], ValueError, "contiguous"),
    ]:
        with pytest.raises(error, match=match):
            bpu.quantize_master_weights([weight], [slice_], [3], None, [shard])
    with pytest.raises(ValueError, match=r"start_offsets\[0\] = 2000"):
        bpu.quantize_master_weights([weight], [slice_], [2000], None)
    for slot, data in before.items():
        assert torch.equal(getattr(weight._storage, slot), data), slot


@pytest.mark.gpu
def test_cuda_whole_master_matches_the_triton_cast():
    master = _master(96, 160, seed=5, dtype=torch.float32).cuda()
    for two_d in (False, True):
        weight, quantizer = _weight((96, 160), torch.bfloat16, E4M3, two_d)
        weight = quantizer.quantize(torch.zeros(96, 160, dtype=torch.bfloat16, device="cuda"))
        bpu.quantize_master_weights([weight], [master.reshape(-1)[7:]], [7], None)
        bpu.quantize_master_weights([weight], [master.reshape(-1)], [0], None)
        want = quantizer.quantize(master.to(torch.bfloat16))  # the Triton kernel
        _assert_same(weight, want, f"cuda two_d={two_d}")
        cpu = quantizer.quantize(master.cpu().to(torch.bfloat16))
        for slot, data in _bytes(weight).items():
            assert torch.equal(data.cpu(), _bytes(cpu)[slot]), slot


@pytest.mark.gpu
def test_cuda_nvfp4_whole_master_matches_the_triton_cast():
    master = _nvfp4_master(96, 160, seed=6, dtype=torch.float32).cuda()
    quantizer = NVFP4Quantizer(with_2d_quantization=True, internal=False)
    weight = quantizer.quantize(torch.zeros(96, 160, dtype=torch.bfloat16, device="cuda"))
    bpu.quantize_master_weights([weight], [master.reshape(-1)[7:]], [7], None)
    bpu.quantize_master_weights([weight], [master.reshape(-1)], [0], None)
    bpu.post_all_gather_processing(weight)
    _nv_same(weight, quantizer.quantize(master.to(torch.bfloat16)), NV_ALL, "cuda")  # Triton
    cpu = quantizer.quantize(master.cpu().to(torch.bfloat16))
    for slot in NV_ALL:
        assert torch.equal(getattr(weight._storage, slot).cpu(), getattr(cpu._storage, slot))
