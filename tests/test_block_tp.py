"""Sequence parallelism under the block-scaled recipes: the sequence-parallel input of a
column-parallel layer is gathered as block-scaled bytes (quantization/block_gather.py).

quantize_gathered on 2 and 4 gloo ranks equals, bytes and scales, the quantization of the
gathered high-precision tensor, for Float8BlockScaling's 1x128 blocks, MXFP8 and NVFP4 (with
the Hadamard transform of the columnwise copy, and with 16x16 blocks), K not a multiple of 128,
each rank's rows whole blocks of the columnwise copy or not (then the high-precision gather,
with its one warning). te.Linear and te.LayerNormLinear, column-parallel with
sequence_parallel on 2 ranks, equal the one-process layer under each recipe (values -1, 0 and
1: their quantization is exact, as in tests/test_tensor_parallel.py) and move about half of
bf16's bytes through the gather when only the rowwise copy is gathered.
"""

from __future__ import annotations

import contextlib
import threading
import warnings

import pytest
import torch
import torch.distributed as dist
from ranks import each_config, on_ranks
from tolerances import assert_close, representable

import torchte as te
from torchte import distributed as te_dist
from torchte.module._tensor_parallel import TensorParallel
from torchte.quantization import block_gather
from torchte.quantization.blockwise import Float8BlockQuantizer
from torchte.quantization.mxfp8 import MXFP8Quantizer
from torchte.quantization.nvfp4 import NVFP4Quantizer
from torchte.recipe import Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling

E4M3 = torch.float8_e4m3fn
QUANTIZERS = {
    "block": lambda: Float8BlockQuantizer(E4M3, block_scaling_dim=1),
    "block-e5m2-fp32-scales": lambda: Float8BlockQuantizer(
        torch.float8_e5m2, block_scaling_dim=1, force_pow_2_scales=False
    ),
    "mxfp8": lambda: MXFP8Quantizer(E4M3),
    "nvfp4-rht": lambda: NVFP4Quantizer(with_rht=True, with_post_rht_amax=True),
    "nvfp4-2d": lambda: NVFP4Quantizer(with_2d_quantization=True),
}
# (format: (K, rows per rank whole blocks, rows per rank not)): rows as (S_l, B).
SIZES = {
    "block": (200, (64, 2), (24, 3)),
    "mxfp8": (96, (16, 2), (8, 2)),
    "nvfp4": (80, (8, 2), (4, 2)),
}
RECIPES = {
    "block": Float8BlockScaling,
    "mxfp8": MXFP8BlockScaling,
    "nvfp4": lambda: NVFP4BlockScaling(disable_stochastic_rounding=True),
}


def _family(name: str) -> str:
    return name.split("-")[0]


def _tp(world: int) -> TensorParallel:
    return TensorParallel("column", dist.group.WORLD, world, True)


def _whole(name: str, rows: tuple[int, int], world: int, device: str) -> torch.Tensor:
    """The whole (world S_l, B, K) input, the same on every rank; each rank's rows of another
    magnitude, so the largest value (NVFP4's per-tensor amax) sits on one rank."""
    k = SIZES[_family(name)][0]
    gen = torch.Generator().manual_seed(17)
    x = torch.randn(world * rows[0], rows[1], k, generator=gen)
    x *= torch.linspace(0.5, 4.0, world * rows[0])[:, None, None]
    dtype = torch.float32 if "fp32" in name else torch.bfloat16
    return x.to(device, dtype)


def _assert_same(got, want, label: str) -> None:
    """Same class, shape, flags, and every data tensor the same bytes (None where None)."""
    assert type(got) is type(want) and tuple(got.shape) == tuple(want.shape), label
    for flag in ("block_dim", "two_d", "rht_sign_mask", "with_2d_quantization", "fp8_dtype"):
        assert getattr(got, flag, None) == getattr(want, flag, None), f"{label}: {flag}"
    for i, (a, b) in enumerate(zip(got.get_data_tensors(), want.get_data_tensors(), strict=True)):
        if b is None:
            assert a is None, f"{label}: tensor {i} should be absent"
            continue
        assert a is not None and a.dtype == b.dtype and a.shape == b.shape, f"{label}: {i}"
        bits = {1: torch.uint8, 4: torch.int32}[b.element_size()]
        same = torch.equal(a.cpu().contiguous().view(bits), b.cpu().contiguous().view(bits))
        assert same, f"{label}: tensor {i} differs"


def _check_gathered(name, aligned, columnwise, rank, world, device="cpu") -> None:
    """quantize_gathered of this rank's rows == quantize of the whole tensor; the fallback
    (rows not whole blocks, where the format's columnwise copy or cast needs them) warns."""
    _, whole_blocks, partial = SIZES[_family(name)]
    rows = whole_blocks if aligned else partial
    x = _whole(name, rows, world, device)
    quantizer = QUANTIZERS[name]()
    tp = _tp(world)
    fallback = not aligned and (columnwise or _family(name) != "block")
    block_gather._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2 if fallback else 1):  # the fallback warns once for the two calls
            piece = x.chunk(world)[rank]
            got = quantizer.quantize_gathered(piece, tp.reduce_max, tp.gather_sequence, columnwise)
    want = quantizer.quantize(x, rowwise=True, columnwise=columnwise)
    _assert_same(got, want, f"{name} aligned={aligned} columnwise={columnwise}")
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(messages) == (1 if fallback else 0), messages
    if fallback:
        assert "gathered in high precision" in messages[0] and "rows" in messages[0]


GATHER_CONFIGS = [
    (name, aligned, columnwise)
    for name in QUANTIZERS
    for aligned in (True, False)
    for columnwise in (False, True)
]


def _check_empty(rank, world) -> None:
    """Zero rows on every rank: an empty value of the whole shape, no warning."""
    tp = _tp(world)
    for name, make in QUANTIZERS.items():
        k = SIZES[_family(name)][0]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = make().quantize_gathered(torch.zeros(0, 2, k), tp.reduce_max,
                                           tp.gather_sequence, True)  # fmt: skip
        assert tuple(got.shape) == (0, 2, k), name
        assert got.dequantize().shape == (0, 2, k), name


@contextlib.contextmanager
def _gathered_bytes():
    """[bytes of each tensor te.distributed all-gathers from this rank] inside."""
    original, seen = te_dist.gather_along_first_dim, []

    def recorded(inp, *args, **kwargs):
        seen.append(inp.numel() * inp.element_size())
        return original(inp, *args, **kwargs)

    te_dist.gather_along_first_dim = recorded
    try:
        yield seen
    finally:
        te_dist.gather_along_first_dim = original


def _pad16(n: int) -> int:
    return -(-n // 16) * 16


def _wire_bytes(family: str, rows: int, k: int, columnwise: bool) -> int:
    """The bytes one rank sends: its data, then its scales (and transposed data) packed."""
    up = lambda v, m: -(-v // m) * m  # noqa: E731
    if family == "block":
        packed = [4 * -(-k // 128) * rows] + ([k * rows, 4 * k * rows // 128] if columnwise else [])
        data = [k * rows]
    elif family == "mxfp8":
        packed = [rows * up(k // 32, 4)] + ([rows // 32 * up(k, 128)] if columnwise else [])
        data = [k * rows] * (2 if columnwise else 1)
    else:
        packed = [rows * up(k // 16, 4)] + ([k * rows // 2, k * rows // 16] if columnwise else [])
        data = [k * rows // 2]
    return sum(data) + sum(_pad16(n) for n in packed)


def _check_module(kind, family, aligned, frozen, rank, world) -> None:
    """te.Linear / te.LayerNormLinear, column-parallel with sequence parallelism, == the
    one-process layer (fp32 tolerance: the operands are the same bytes, the GEMMs sum in
    another order); the bytes gathered those of the quantized gather (about half of bf16's
    when only the rowwise copy is gathered: frozen weight), or with rowwise not-whole blocks
    the high-precision input."""
    k, n = 160, 64
    s_l, b = (64, 2) if aligned else (16, 2)
    gen = torch.Generator().manual_seed(3)
    ternary = lambda *shape: torch.randint(-1, 2, shape, generator=gen).float()  # noqa: E731
    x, dy = ternary(world * s_l, b, k), ternary(world * s_l, b, n // 2)
    dy = torch.cat([dy, dy], dim=-1)  # the same amaxes for each rank's columns and the whole
    make = getattr(te, kind)
    ref = make(k, n, params_dtype=torch.float32)
    layer = make(k, n, params_dtype=torch.float32, parallel_mode="column", sequence_parallel=True,
                 tp_group=dist.group.WORLD)  # fmt: skip
    cols = slice(rank * n // world, (rank + 1) * n // world)
    seq = slice(rank * s_l, (rank + 1) * s_l)
    with torch.no_grad():
        ref.weight.copy_(ternary(n, k))
        ref.bias.copy_(ternary(n))
        layer.weight.copy_(ref.weight[cols])
        layer.bias.copy_(ref.bias[cols])
    for module in (ref, layer):
        module.weight.requires_grad_(not frozen)
    results = []
    for module, xi, dyi in ((ref, x, dy), (layer, x[seq], dy[:, :, cols])):
        xi = xi.clone().requires_grad_(True)
        block_gather._warned.clear()
        with _gathered_bytes() as moved, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with te.autocast(recipe=RECIPES[family]()):
                y = module(xi)
        y.backward(dyi)
        grads = [xi.grad, module.bias.grad] + ([] if frozen else [module.weight.grad])
        results.append(([y.detach(), *grads], sum(moved), caught))
    (want, _, _), (got, moved, caught) = results
    want = [want[0][:, :, cols], want[1][seq], want[2][cols], *[w[cols] for w in want[3:]]]
    label = f"{kind} {family} aligned={aligned} frozen={frozen}"
    for i, (a, e) in enumerate(zip(got, want, strict=True)):
        assert_close(a, e.double(), torch.float32, msg=f"{label}: output {i}")
    rows, bf16 = s_l * b, 2 * s_l * b * k
    warned = [w for w in caught if "gathered in high precision" in str(w.message)]
    if aligned:
        assert moved == _wire_bytes(family, rows, k, not frozen), (label, moved)
        assert not warned, label
        if frozen:  # the rowwise copy only: half of bf16's (NVFP4: a quarter) plus the scales
            assert moved <= (0.3 if family == "nvfp4" else 0.55) * bf16, (label, moved / bf16)
    else:  # 32 rows a rank: not whole 1x128 blocks of the columnwise copy
        assert moved == rows * k * 4 and len(warned) == 1, (label, moved)


MODULE_CONFIGS = [
    (kind, family, True, frozen)
    for kind in ("Linear", "LayerNormLinear")
    for family in RECIPES
    for frozen in (False, True)
] + [("Linear", "block", False, False)]


# Four ranks: each quantizer with the columnwise copy, rows whole blocks or not, and the rowwise
# 1x128 gather of rows that are not (no fallback).
GATHER_CONFIGS_4 = [(name, aligned, True) for name in QUANTIZERS for aligned in (True, False)]
GATHER_CONFIGS_4.append(("block", False, False))


def _rank_main(rank: int, world: int) -> dict:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    if world != 2:
        return each_config(_check_gathered, GATHER_CONFIGS_4, rank, world)
    outcome = each_config(_check_gathered, GATHER_CONFIGS, rank, world)
    outcome.update(each_config(_check_empty, [()], rank, world))
    outcome.update(each_config(_check_module, MODULE_CONFIGS, rank, world))
    return outcome


@pytest.mark.parametrize("world", [2, 4])
def test_block_scaled_sequence_parallel_gathers(world, tmp_path):
    for outcome in on_ranks(_rank_main, world, tmp_path, world):
        failed = {config: text for config, text in outcome.items() if text != "ok"}
        assert not failed, failed


def test_a_128x128_activation_is_gathered_in_high_precision_with_a_warning():
    """A 128x128 tile spans the rows of several ranks: the input moves in high precision and
    is cast after the gather (two ranks simulated by a gather that stacks two copies)."""
    quantizer = Float8BlockQuantizer(E4M3, block_scaling_dim=2)
    x = representable((64, 256), torch.bfloat16).bfloat16()
    moved = []

    def gather(t):
        moved.append(t.dtype)
        return torch.cat([t, t])

    with pytest.warns(UserWarning, match="128x128 activation tiles"):
        out = quantizer.quantize_gathered(x, None, gather, True)
    want = quantizer.quantize(torch.cat([x, x]))
    assert moved == [torch.bfloat16]
    for name in ("rowwise_data", "columnwise_data"):
        got, wanted = getattr(out, name), getattr(want, name)
        assert torch.equal(got.view(torch.uint8), wanted.view(torch.uint8)), name
    assert torch.equal(out.rowwise_scale_inv, want.rowwise_scale_inv)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match=r"x_hp must be \(S, \.\.\., K\)"):
        MXFP8Quantizer(E4M3).quantize_gathered(torch.zeros(64), None, None, False)
    with pytest.raises(TypeError, match="no block-scaled gather for object"):
        block_gather.quantize_gathered(object(), torch.zeros(4, 4), None, None, False)


class _ThreadGroup:
    """P threads of one process standing in for P ranks (a GPU test needs one GPU)."""

    def __init__(self, world: int) -> None:
        self.barrier, self.slots = threading.Barrier(world), [None] * world

    def _exchange(self, rank: int, t: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = t.clone()
        self.barrier.wait()
        every = list(self.slots)
        self.barrier.wait()
        return every

    def gather(self, rank: int, t: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._exchange(rank, t))

    def reduce_max(self, rank: int, t: torch.Tensor) -> None:
        t.copy_(torch.stack(self._exchange(rank, t)).amax(0))


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(QUANTIZERS))
@pytest.mark.parametrize("columnwise", [False, True])
def test_gathered_bytes_on_the_gpu_equal_the_cpu_cast(name, columnwise):
    """The Triton casts through quantize_gathered (4 threads as ranks on one GPU) == the CPU
    reference's cast of the whole tensor, byte for byte."""
    world, rows = 4, SIZES[_family(name)][1]
    x = _whole(name, rows, world, "cuda")
    group, results = _ThreadGroup(world), [None] * world

    def rank_main(rank: int) -> None:
        reduce_max = lambda t: group.reduce_max(rank, t)  # noqa: E731
        gather = lambda t: group.gather(rank, t)  # noqa: E731
        piece = x.chunk(world)[rank]
        try:
            results[rank] = QUANTIZERS[name]().quantize_gathered(
                piece, reduce_max, gather, columnwise
            )
        except Exception as err:  # re-raised in the test's thread
            results[rank] = err
            group.barrier.abort()  # the other ranks stop waiting

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    torch.cuda.synchronize()
    want = QUANTIZERS[name]().quantize(x.cpu(), rowwise=True, columnwise=columnwise)
    errors = [e for e in results if isinstance(e, Exception)]
    own = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if errors:  # the failing rank's own error, not the broken barrier of the others
        raise (own or errors)[0]
    for rank, got in enumerate(results):
        _assert_same(got, want, f"{name} columnwise={columnwise} rank {rank}")


@pytest.mark.gpu
def test_block_scaled_gathers_over_nccl(tmp_path):
    """The quantized gathers over NCCL (2 GPUs), bytes as on one rank's cast of the whole."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    for outcome in on_ranks(_rank_main_nccl, 2, tmp_path, backend="nccl"):
        failed = {config: text for config, text in outcome.items() if text != "ok"}
        assert not failed, failed


def _check_gathered_cuda(name, aligned, columnwise, rank, world) -> None:
    _check_gathered(name, aligned, columnwise, rank, world, "cuda")


def _rank_main_nccl(rank: int) -> dict:
    return each_config(_check_gathered_cuda, GATHER_CONFIGS, rank, 2)
