"""Transformer Engine's tensor.utils.quantize_master_weights for MXFP8 weights
(block_param_utils), as Megatron-Core's distributed optimizer calls it with --fp8-param-gather:
each data-parallel rank holds a slice of each weight's flattened fp32 / bf16 master, cut
anywhere (through rows and 32-value blocks), and casts it into both FP8 copies of the weight.

After every rank wrote its slice and the bytes are gathered (here: each rank's written range
summed over the ranks), the weight must equal MXFP8-quantizing the whole master: identical
rowwise and columnwise bytes and E8M0 codes, special values included.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from ranks import on_ranks

import torchte as te
from torchte import recipe
from torchte.quantization import block_param_utils as bpu
from torchte.quantization.block_tensor import MXFP8Tensor
from torchte.quantization.mxfp8 import MXFP8Quantizer

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


def _rank_main(rank: int) -> dict:
    warnings.simplefilter("error", RuntimeWarning)
    outcome = {}
    checks = [
        ("slices", lambda: _check_slices(rank, False, None)),
        ("fsdp fragments", lambda: _check_slices(rank, True, dist.group.WORLD)),
        ("te.Linear weight", lambda: _check_linear_weight(rank)),
    ]
    for name, check in checks:
        try:
            check()
            outcome[name] = "ok"
        except Exception as err:  # reported per check, in the main process
            outcome[name] = f"{type(err).__name__}: {str(err)[:800]}"
    return outcome


def test_mxfp8_master_slices_on_two_ranks(tmp_path):
    for outcome in on_ranks(_rank_main, WORLD, tmp_path):
        failed = {name: text for name, text in outcome.items() if text != "ok"}
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


def test_nvfp4_weights_not_implemented():
    from torchte.quantization.nvfp4 import NVFP4Quantizer

    weight = NVFP4Quantizer(with_2d_quantization=True, internal=False).quantize(torch.zeros(32, 64))
    with pytest.raises(NotImplementedError, match="NVFP4Tensor"):
        bpu.quantize_master_weights([weight], [torch.zeros(32 * 64)], [0], None)


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
