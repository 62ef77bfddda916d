"""The grouped block-scaled GEMMs' per-group cuBLAS path with host sizes (gemm_block.py):
kernels/group_scales.py (the 1x128 rowwise scales regrouped, one launch) against its torch
reference and the layout's definition, bit for bit (CPU, and Triton's interpreter);
block_layout.host_block_offsets against the device sum; the per-group loops' views checked on
the CPU through an emulation of torch._scaled_mm / F.scaled_mm that checks the layouts cuBLAS
takes and multiplies exactly; and on the GPU (marked gpu) the grouped fprop / dgrad / wgrad equal
to the formulation they replace (a GemmOperand and a fresh scale buffer per group) bit for bit,
with no host synchronization.

Operands as in test_kernels_grouped_gemm_block.py: FP8 values and power-of-two scales drawn
independently per block, so that a view of the wrong group, block or row changes the result;
group sizes multiples of 16 (the cuBLAS path), with empty groups."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from interpreter import requires_interpreter, run_under_interpreter
from test_kernels_grouped_gemm_block import (
    E4M3,
    E5M2,
    block_scales,
    offsets,
    reduction_case,
    reduction_fp64,
    rows_case,
    rows_fp64,
)

from torchte import gemm_block
from torchte.kernels import block_layout
from torchte.kernels.block_layout import block_offsets, host_block_offsets
from torchte.kernels.group_scales import group_scales, group_scales_reference
from torchte.quantization.blockwise import GroupedBlockwiseStorage

# Tokens not a multiple of 128 or of the kernel's tile, empty groups first / middle / last, one
# row, one group, many groups.
LAYOUT_SPLITS = [[7, 0, 161, 1], [0, 130, 37, 133], [300], [0, 0, 5, 0], [3, 1, 0, 9] * 5]
# The cuBLAS path's sizes: multiples of 16, uneven, empty groups.
ALIGNED = [48, 0, 272, 16, 160, 32, 0, 496]


def layout_by_definition(scales: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """out[KB * o_g + j * m_g + (t - o_g)] = scales[j, t], element by element."""
    blocks, tokens = scales.shape
    out = torch.full((blocks * tokens,), float("nan"))
    bounds = [0, *itertools.accumulate(sizes)]
    for g, (start, end) in enumerate(itertools.pairwise(bounds)):
        for j in range(blocks):
            for t in range(start, end):
                out[blocks * start + j * sizes[g] + t - start] = scales[j, t]
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


# ----------------------------------------------------------------------------------------------
# group_scales: the reference (CPU)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("blocks", [1, 5])
@pytest.mark.parametrize("sizes", LAYOUT_SPLITS, ids=str)
def test_reference_is_the_layout(sizes, blocks):
    scales = block_scales((blocks, sum(sizes)), seed=len(sizes) + blocks)
    out = group_scales(scales, offsets(sizes))  # the reference on the CPU
    assert out.shape == (blocks * sum(sizes),) and out.dtype == torch.float32
    assert same_bytes(out, layout_by_definition(scales, sizes))
    start = 0
    for m in sizes:  # each group's GEMM operand: (m, KB) with strides (1, m)
        view = out[blocks * start : blocks * (start + m)].view(blocks, m).t()
        assert torch.equal(view, scales[:, start : start + m].t())
        assert m == 0 or view.stride() == (1, m)
        start += m


def test_nothing_to_copy():
    assert group_scales(torch.empty(4, 0), offsets([0, 0])).shape == (0,)
    assert group_scales(torch.empty(0, 7), offsets([3, 4])).shape == (0,)


@pytest.mark.parametrize(
    "scales, row_offsets, error, match",
    [
        (torch.ones(2, 5, dtype=torch.float64), offsets([5]), ValueError, "2-D fp32"),
        (torch.ones(10), offsets([5]), ValueError, "2-D fp32"),
        (torch.ones(2, 5), offsets([5]).long(), TypeError, "int32"),
        (torch.ones(2, 5), torch.zeros(1, dtype=torch.int32), ValueError, r"\(G \+ 1,\)"),
        (torch.ones(2, 5), offsets([5])[None], ValueError, r"\(G \+ 1,\)"),
        (torch.ones(2, 5), offsets([5]).to("meta"), ValueError, "row_offsets is on meta"),
    ],
)
def test_argument_checks(scales, row_offsets, error, match):
    with pytest.raises(error, match=match):
        group_scales(scales, row_offsets)


@pytest.mark.parametrize(
    "values, match",
    [([1, 3, 5], "start at 0"), ([0, 4, 3], "never decrease"), ([0, 2, 4], "end at the token")],
)
def test_reference_checks_the_offsets_it_reads(values, match):
    # The kernel trusts the offsets (reading them would sync); the reference checks them.
    with pytest.raises(ValueError, match=match):
        group_scales_reference(torch.ones(2, 5), torch.tensor(values, dtype=torch.int32))


# ----------------------------------------------------------------------------------------------
# group_scales: the Triton kernel under Triton's CPU interpreter
# ----------------------------------------------------------------------------------------------

INTERPRETER_SCRIPT = """
import torch
from test_group_scales import LAYOUT_SPLITS, same_bytes
from test_kernels_grouped_gemm_block import block_scales, offsets
from torchte.kernels import group_scales as gs

# Small tiles: several token tiles per group, groups straddling tiles, K-blocks past the last
# tile's (masked); and the module's config.
for config in ((16, 2, 1), (64, 4, 1), gs.CONFIG):
    for i, sizes in enumerate(LAYOUT_SPLITS):
        for blocks in (1, 3, 5):
            scales = block_scales((blocks, sum(sizes)), seed=i * 7 + blocks)
            row_offsets = offsets(sizes)
            want = gs.group_scales_reference(scales, row_offsets)
            got = gs._group_scales(scales, row_offsets, config)
            assert same_bytes(got, want), (config, sizes, blocks)
assert gs._group_scales(torch.ones(3, 0), offsets([0, 0]), gs.CONFIG).shape == (0,)
print("ok")
"""


@requires_interpreter
def test_triton_kernel_in_interpreter_equals_the_reference():
    run_under_interpreter(INTERPRETER_SCRIPT)


# ----------------------------------------------------------------------------------------------
# host_block_offsets (CPU)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes", [*LAYOUT_SPLITS, [128, 129, 0, 256, 1], [0]], ids=str)
def test_host_block_offsets_equal_the_device_sum(sizes):
    row_offsets = offsets(sizes)
    got = host_block_offsets(sizes, row_offsets)
    assert got.dtype == torch.int32 and torch.equal(got, block_offsets(row_offsets))
    # On the CPU a fresh tensor each call: nothing shared to overwrite.
    assert host_block_offsets(sizes, row_offsets) is not got


def test_quantize_grouped_takes_the_block_offsets_from_host_sizes(monkeypatch):
    from torchte.quantization.blockwise import Float8BlockQuantizer

    sizes = [3, 0, 200, 129]
    x = torch.randn(sum(sizes), 64)
    quantizer = Float8BlockQuantizer(E4M3, block_scaling_dim=1)
    device_sum = quantizer.quantize_grouped(x, offsets(sizes), None).block_offsets
    host_sum = quantizer.quantize_grouped(x, offsets(sizes), sizes).block_offsets
    assert torch.equal(host_sum, device_sum) and host_sum.tolist() == [0, 1, 1, 3, 5]

    def fail(_row_offsets):
        raise AssertionError("summed on the device although the host has the sizes")

    monkeypatch.setattr("torchte.quantization.blockwise.block_offsets", fail)
    quantizer.quantize_grouped(x, offsets(sizes), sizes)
    with pytest.raises(AssertionError, match="summed on the device"):
        quantizer.quantize_grouped(x, offsets(sizes), None)


# ----------------------------------------------------------------------------------------------
# The per-group loops' views, on the CPU through an emulated cuBLAS
# ----------------------------------------------------------------------------------------------


def _along(scale: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """A block scale repeated over its 128 elements along dim, cut to size."""
    return scale.double().repeat_interleave(128, dim).narrow(dim, 0, size)


class EmulatedCublas:
    """torch._scaled_mm and F.scaled_mm as the per-group loops call them, on the CPU: check
    the operand layouts cuBLAS's block-scaled GEMM takes, then multiply exactly (fp64)."""

    def __init__(self, b_tiles: bool) -> None:
        self.b_tiles = b_tiles  # b in 128x128 tiles (fprop, dgrad), else 1x128 (wgrad)
        self.direct = self.padded = 0

    def product(self, a, b, a_scale, b_scale) -> torch.Tensor:
        (m, k), n = a.shape, b.shape[1]
        assert a.dtype in (E4M3, E5M2) and b.dtype in (E4M3, E5M2) and b.shape[0] == k
        assert a.stride(1) == 1 and b.stride(0) == 1  # both K-major
        kb = -(-k // 128)
        # a's 1x128 scales: (M, KB), M-major, as cuBLAS reads them.
        assert a_scale.shape == (m, kb) and a_scale.stride(0) == 1
        assert kb == 1 or a_scale.stride(1) == m
        a_values = a.double() * _along(a_scale, 1, k)
        if self.b_tiles:
            tiles = _along(_along(b_scale[:kb], 0, k), 1, n)
            b_values = b.double() * tiles
        else:
            assert b_scale.shape == (kb, n)
            b_values = b.double() * _along(b_scale, 0, k)
        return a_values @ b_values

    def scaled_mm(self, a, b, a_scale, b_scale, *, out_dtype, out):
        if self.b_tiles:  # torch._scaled_mm takes the tiles' scales unpadded: (KB, NB)
            assert b_scale.shape == (-(-a.shape[1] // 128), -(-b.shape[1] // 128))
        self.direct += 1
        return out.copy_(self.product(a, b, a_scale, b_scale).to(out_dtype))

    def functional(self, a, b, a_scale, kind_a, b_scale, kind_b, *, bias, output_dtype):
        assert self.b_tiles and bias is None
        assert (kind_a, kind_b) == (F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128)
        kb = -(-a.shape[1] // 128)
        assert b_scale.shape == (-(-kb // 4) * 4, -(-b.shape[1] // 128))  # padded to 4
        self.padded += 1
        return self.product(a, b, a_scale, b_scale).to(output_dtype)


def _emulate(monkeypatch, b_tiles: bool) -> EmulatedCublas:
    cublas = EmulatedCublas(b_tiles)
    monkeypatch.setattr(torch, "_scaled_mm", cublas.scaled_mm)
    monkeypatch.setattr(F, "scaled_mm", cublas.functional)
    return cublas


@pytest.mark.parametrize(
    "sizes, reduced, features",
    [(ALIGNED, 512, 272), (ALIGNED, 640, 48), (ALIGNED, 128, 144), ([96], 384, 32)],
    ids=["KB4", "KB5", "KB1", "one-group"],
)
def test_per_group_rows_take_each_groups_views(monkeypatch, sizes, reduced, features):
    a, a_scale, b, b_scale, row_offsets = rows_case(sizes, reduced, features, (E4M3, E4M3), 3)
    a_q = GroupedBlockwiseStorage(
        a, a_scale, None, None, E4M3, a.shape, row_offsets, block_offsets(row_offsets), sizes
    )
    cublas = _emulate(monkeypatch, b_tiles=True)
    out = gemm_block._per_group_rows(a_q, b, b_scale, sizes, torch.float32)
    want = rows_fp64(a, a_scale, b, b_scale, row_offsets).float()
    assert torch.equal(out, want)
    groups = sum(1 for m in sizes if m)
    kb = -(-reduced // 128)
    assert (cublas.direct, cublas.padded) == ((groups, 0) if kb % 4 == 0 else (0, groups))


@pytest.mark.parametrize("features, reduced", [(48, 272), (16, 640)])
def test_per_group_wgrad_takes_each_groups_views(monkeypatch, features, reduced):
    args = reduction_case(ALIGNED, features, reduced, (E5M2, E4M3), seed=4)
    a_cols, a_scale, b_cols, b_scale, row_offsets, first_blocks = args
    tokens = sum(ALIGNED)
    common = (row_offsets, first_blocks, ALIGNED)
    dy_q = GroupedBlockwiseStorage(None, None, a_cols, a_scale, E5M2, (tokens, features), *common)
    x_q = GroupedBlockwiseStorage(None, None, b_cols, b_scale, E4M3, (tokens, reduced), *common)
    cublas = _emulate(monkeypatch, b_tiles=False)
    out = gemm_block._per_group_wgrad(dy_q, x_q, ALIGNED, torch.float32)
    assert out.shape == (len(ALIGNED), features, reduced)
    assert torch.equal(out, reduction_fp64(*args).float())  # zeros for the empty groups
    assert cublas.direct == sum(1 for m in ALIGNED if m)


def test_only_aligned_host_sizes_on_a_gpu_take_the_cublas_path():
    # On the CPU (and wherever the GEMMs are not native) the Triton kernels / references run.
    a, a_scale, *_, row_offsets = rows_case(ALIGNED, 128, 16, (E4M3, E4M3))
    blocks = block_offsets(row_offsets)
    q = GroupedBlockwiseStorage(a, a_scale, None, None, E4M3, a.shape, row_offsets, blocks, ALIGNED)
    assert gemm_block._cublas_group_sizes(q, 16, 128) is None


# ----------------------------------------------------------------------------------------------
# On the GPU
# ----------------------------------------------------------------------------------------------


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


requires_hopper = pytest.mark.skipif(not _hopper(), reason="cuBLAS's block-scaled GEMM: Hopper")


@pytest.mark.gpu
@pytest.mark.parametrize("blocks", [1, 5, 32])
@pytest.mark.parametrize("sizes", [*LAYOUT_SPLITS, ALIGNED], ids=str)
def test_kernel_on_the_gpu_equals_the_reference(sizes, blocks):
    from torchte.kernels._triton import triton_available

    if not triton_available():
        pytest.skip("needs Triton")
    scales = block_scales((blocks, sum(sizes)), seed=blocks)
    want = group_scales_reference(scales, offsets(sizes))
    got = group_scales(scales.cuda(), offsets(sizes).cuda())
    assert same_bytes(got.cpu(), want)


@pytest.mark.gpu
def test_host_block_offsets_on_the_gpu_never_synchronize():
    sizes = [16 * i for i in (3, 0, 17, 1, 40)]
    row_offsets = offsets(sizes).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        first = host_block_offsets(sizes, row_offsets)  # not cached yet: the pinned copy
        again = host_block_offsets(sizes, row_offsets)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert again is first and torch.equal(first.cpu(), block_offsets(offsets(sizes)))
    # A split first seen while a graph is captured is summed on the device, not cached.
    other = [5, 0, 300]
    other_offsets = offsets(other).cuda()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = host_block_offsets(other, other_offsets)
    graph.replay()
    torch.cuda.synchronize()
    assert captured.tolist() == [0, 1, 1, 4]
    assert (tuple(other), other_offsets.device) not in block_layout._HOST_CACHE


# The formulation the per-group loops replaced (gemm_block before this change): per group a
# fresh (KB, m) scale buffer, two GemmOperands and _block_scaled_mm's checks.


def previous_rows(a_q, data, scales, sizes, out_dtype) -> torch.Tensor:
    from torchte.quantization.base import GemmOperand

    out = torch.empty(a_q.shape[0], data.shape[1], dtype=out_dtype, device=data.device)
    start = 0
    for g, m in enumerate(sizes):
        if m:
            rows = slice(start, start + m)
            part = a_q.rowwise_scale_inv[:, rows]
            a_scale = torch.empty(part.shape, dtype=part.dtype, device=part.device).copy_(part)
            a = GemmOperand("block1d", a_q.rowwise_data[rows], a_scale)
            b = GemmOperand("block2d", data[g], scales[g])
            assert gemm_block._block_scaled_mm(a, b, out_dtype, None, out[rows]) is not None
        start += m
    return out


def previous_wgrad(dy_q, x_q, sizes, out_dtype) -> torch.Tensor:
    from torchte.quantization.base import GemmOperand

    n, k = dy_q.shape[1], x_q.shape[1]
    out = torch.empty(len(sizes), n, k, dtype=out_dtype, device=dy_q.columnwise_data.device)
    start = block = 0
    for g, m in enumerate(sizes):
        if m == 0:
            out[g].zero_()
            continue
        tokens, blocks = slice(start, start + m), slice(block, block + -(-m // 128))
        dy_scale, x_scale = dy_q.columnwise_scale_inv[blocks], x_q.columnwise_scale_inv[blocks]
        a = GemmOperand("block1d", dy_q.columnwise_data[:, tokens], dy_scale)
        b = GemmOperand("block1d", x_q.columnwise_data[:, tokens], x_scale)
        assert gemm_block._block_scaled_mm(a, b, out_dtype, None, out=out[g]) is not None
        start, block = start + m, blocks.stop
    return out


def varied(shape, seed: int) -> torch.Tensor:
    """bf16 (R, C) values whose magnitude varies by 2**-6 .. 2**6 per 16 x 16 patch, so that
    neighbouring 1x128 blocks (either way) and 128x128 tiles get different scales."""
    gen = torch.Generator().manual_seed(seed)
    rows, cols = shape[-2:]
    values = torch.randn(shape, generator=gen)
    patches = torch.randint(-6, 7, (*shape[:-2], -(-rows // 16), -(-cols // 16)), generator=gen)
    factor = torch.ldexp(torch.ones(()), patches).repeat_interleave(16, -2)
    factor = factor.repeat_interleave(16, -1)[..., :rows, :cols]
    return (values * factor).bfloat16().cuda()


def grouped_operands(sizes, k, n, seed=0):
    """(x_q, dy_q, w_q): x (T, K) and dy (T, N) grouped 1x128 (both copies, host sizes), the G
    weights (G, N, K) in 128x128 tiles (both copies), on the GPU."""
    from torchte.quantization.blockwise import Float8BlockQuantizer

    row_offsets = offsets(sizes).cuda()
    tokens = sum(sizes)
    x_q = Float8BlockQuantizer(E4M3, block_scaling_dim=1).quantize_grouped(
        varied((tokens, k), seed), row_offsets, sizes
    )
    dy_q = Float8BlockQuantizer(E5M2, block_scaling_dim=1).quantize_grouped(
        varied((tokens, n), seed + 1), row_offsets, sizes
    )
    w_q = Float8BlockQuantizer(E4M3, block_scaling_dim=2).quantize(varied((len(sizes), n, k), 2))
    return x_q, dy_q, w_q


def all_gemms(x_q, dy_q, w_q):
    """fprop (bf16), dgrad (bf16), wgrad (bf16 and fp32, as into main_grad)."""
    return (
        gemm_block.block_grouped_fprop(x_q, w_q, torch.bfloat16),
        gemm_block.block_grouped_dgrad(dy_q, w_q, torch.bfloat16),
        gemm_block.block_grouped_wgrad(dy_q, x_q, torch.bfloat16),
        gemm_block.block_grouped_wgrad(dy_q, x_q, torch.float32),
    )


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize(
    "sizes, k, n",
    [(ALIGNED, 4096, 512), (ALIGNED, 640, 384), (ALIGNED, 128, 144), ([512], 640, 256)],
    ids=["K4096", "K640", "K128", "one-group"],
)
def test_grouped_gemms_equal_the_previous_per_group_formulation(sizes, k, n):
    x_q, dy_q, w_q = grouped_operands(sizes, k, n)
    assert gemm_block._cublas_group_sizes(x_q, n, k) == sizes  # the cuBLAS path runs
    got = all_gemms(x_q, dy_q, w_q)  # also compiles the kernel before the sync check
    want = (
        previous_rows(x_q, w_q.rowwise_data, w_q.rowwise_scale_inv, sizes, torch.bfloat16),
        None,
        previous_wgrad(dy_q, x_q, sizes, torch.bfloat16),
        previous_wgrad(dy_q, x_q, sizes, torch.float32),
    )
    if -(-n // 128) % 4 == 0:
        w_cols = (w_q.columnwise_data, w_q.columnwise_scale_inv)
        want = (want[0], previous_rows(dy_q, *w_cols, sizes, torch.bfloat16), *want[2:])
    for name, a, b in zip(("fprop", "dgrad", "wgrad", "wgrad fp32"), got, want, strict=True):
        assert b is None or (a.dtype == b.dtype and torch.equal(a, b)), name
    # dy is E5M2: where dgrad's N-blocks need padded tile scales, the tiles run as 1x128 strips
    # (F.scaled_mm refuses E5M2); close to the reference, which test_both_paths_... checks.
    for g in (g for g, m in enumerate(sizes) if m == 0):  # an empty group's weight gradient
        assert not got[2][g].any() and not got[3][g].any()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = all_gemms(x_q, dy_q, w_q)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(torch.equal(a, b) for a, b in zip(again, got, strict=True))


@pytest.mark.gpu
@requires_hopper
def test_both_paths_close_to_the_reference_and_unaligned_dims_take_the_kernels():
    from test_grouped_gemm_block_gpu import assert_close_to_tensor_cores

    from torchte.kernels import grouped_gemm_block as gb

    def device_sizes(q):  # the same values, their sizes on the device only
        tensors = (q.rowwise_data, q.rowwise_scale_inv, q.columnwise_data, q.columnwise_scale_inv)
        return GroupedBlockwiseStorage(
            *tensors, q.fp8_dtype, q.shape, q.row_offsets, q.block_offsets, None
        )

    x_q, dy_q, w_q = grouped_operands(ALIGNED, 640, 384, seed=5)
    rows = (x_q.rowwise_data, x_q.rowwise_scale_inv, w_q.rowwise_data, w_q.rowwise_scale_inv)
    rows_t = (dy_q.rowwise_data, dy_q.rowwise_scale_inv, w_q.columnwise_data)
    rows_t += (w_q.columnwise_scale_inv,)
    cols = (dy_q.columnwise_data, dy_q.columnwise_scale_inv, x_q.columnwise_data)
    cols += (x_q.columnwise_scale_inv, x_q.row_offsets, x_q.block_offsets)
    fp32 = torch.float32
    want = (
        gb.grouped_block_rows_gemm_reference(*rows, x_q.row_offsets, fp32),
        gb.grouped_block_rows_gemm_reference(*rows_t, x_q.row_offsets, fp32),
        gb.grouped_block_reduction_gemm_reference(*cols, fp32),
    )
    want = (*want, want[2])  # wgrad in bf16 and fp32
    per_group = all_gemms(x_q, dy_q, w_q)
    kernels = all_gemms(device_sizes(x_q), device_sizes(dy_q), w_q)
    for got in (per_group, kernels):
        for a, b in zip(got, want, strict=True):
            assert_close_to_tensor_cores(a, b)
    # N = 200 (not a multiple of 16): the Triton kernel, with host sizes too.
    x_q, _, w_q = grouped_operands(ALIGNED, 640, 200, seed=6)
    assert gemm_block._cublas_group_sizes(x_q, 200, 640) is None
    y = gemm_block.block_grouped_fprop(x_q, w_q, torch.bfloat16)
    rows = (x_q.rowwise_data, x_q.rowwise_scale_inv, w_q.rowwise_data, w_q.rowwise_scale_inv)
    assert torch.equal(y, gb.grouped_block_rows_gemm(*rows, x_q.row_offsets, torch.bfloat16))


@pytest.mark.gpu
@requires_hopper
def test_grouped_linear_step_equals_the_previous_formulation(monkeypatch):
    import torchte as te
    from torchte.recipe import Float8BlockScaling

    sizes, k, n = ALIGNED, 640, 384
    layer = te.GroupedLinear(
        len(sizes), k, n, bias=False, params_dtype=torch.bfloat16, device="cuda"
    )
    x = varied((sum(sizes), k), 7).requires_grad_()
    dy = varied((sum(sizes), n), 8)

    def step():
        x.grad = None
        for param in layer.parameters():
            param.grad = None
        with te.autocast(recipe=Float8BlockScaling()):
            y = layer(x, sizes)
        y.backward(dy)
        return y.detach(), x.grad, *(p.grad for p in layer.parameters())

    got = step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    monkeypatch.setattr(gemm_block, "_per_group_rows", previous_rows)
    monkeypatch.setattr(gemm_block, "_per_group_wgrad", previous_wgrad)
    want = step()
    assert len(got) == 2 + len(sizes)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), i
