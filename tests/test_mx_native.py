"""The native MXFP8 / NVFP4 GEMM path of compute capability 10+ (untested on such hardware
here: the machines have Hopper GPUs or none), checked on the CPU:

- kernels/mx_swizzle.py against its definition formula, both ways, and its row slices;
- _device.block_gemm_native's answers on a faked compute capability (9.0: emulated, 10.0:
  native when torch has the scaling types; the reason says it is untested);
- the "mx" / "nvfp4" operands the storages make where the path is on (forced here), and
  gemm.operand_gemm's native branch through a stand-in for torch.nn.functional.scaled_mm that
  checks the layouts, dtypes, recipes and swizzles it receives (torch's documented contract)
  and computes the product from them, un-swizzling the scales itself: its results equal the
  emulated path's on the same storages, also through a te.Linear's forward and backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tolerances import assert_close, representable

import torchte as te
from torchte import _device
from torchte._sizes import round_up
from torchte.gemm import operand_gemm
from torchte.kernels import nvfp4_cast as nv
from torchte.kernels.mx_swizzle import (
    swizzle_block_scales,
    swizzled_rows,
    unswizzle_block_scales,
)
from torchte.quantization import mx_operand, mxfp8, nvfp4
from torchte.quantization.base import GemmOperand
from torchte.quantization.mxfp8 import MXFP8Quantizer
from torchte.quantization.nvfp4 import NVFP4Quantizer
from torchte.recipe import MXFP8BlockScaling, NVFP4BlockScaling

E4M3, E5M2, E8M0 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu
FP4 = torch.float4_e2m1fn_x2
MX_RECIPES = ("MXFP8BlockScaling", "NVFP4BlockScaling")


def sample(shape, seed=0, spread=6) -> torch.Tensor:
    """bf16-exact values whose rows have different magnitudes (different block scales)."""
    gen = torch.Generator().manual_seed(seed)
    x = representable(shape, torch.bfloat16, scale=4.0, generator=gen, device="cpu")
    rows = torch.randint(-spread, spread + 1, (*shape[:-1], 1), generator=gen)
    return x * torch.pow(2.0, rows.float())


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


# ----------------------------------------------------------------------------------------------
# The swizzled scale layout
# ----------------------------------------------------------------------------------------------


def swizzle_by_formula(compact: torch.Tensor) -> torch.Tensor:
    """The module docstring's formula, element by element (as index arithmetic)."""
    rows, cols = compact.shape
    r = torch.arange(rows).view(-1, 1)
    c = torch.arange(cols).view(1, -1)
    pos = ((r // 128) * (cols // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    flat = torch.empty(rows * cols, dtype=torch.uint8)
    flat[pos.reshape(-1)] = u8(compact).reshape(-1)
    return flat.view(rows, cols)


@pytest.mark.parametrize("shape", [(128, 4), (256, 12), (384, 8), (0, 4), (128, 0)], ids=str)
@pytest.mark.parametrize("dtype", [torch.uint8, E8M0, E4M3], ids=str)
def test_swizzle_follows_its_formula_and_inverts(shape, dtype):
    gen = torch.Generator().manual_seed(shape[0] + shape[1])
    compact = torch.randint(0, 120, shape, dtype=torch.uint8, generator=gen).view(dtype)
    swizzled = swizzle_block_scales(compact)
    assert swizzled.shape == shape and swizzled.dtype == dtype and swizzled.is_contiguous()
    assert torch.equal(u8(swizzled), swizzle_by_formula(compact))
    assert torch.equal(u8(unswizzle_block_scales(swizzled)), u8(compact))
    assert torch.equal(u8(swizzle_block_scales(unswizzle_block_scales(swizzled))), u8(swizzled))
    if compact.numel():  # a layout that moves bytes (not the identity)
        assert not torch.equal(u8(swizzled), u8(compact))


def test_swizzle_reads_any_strides_and_refuses_bad_buffers():
    gen = torch.Generator().manual_seed(1)
    compact_t = torch.randint(0, 255, (8, 256), dtype=torch.uint8, generator=gen)
    assert torch.equal(swizzle_block_scales(compact_t.t()), swizzle_by_formula(compact_t.t()))
    with pytest.raises(ValueError, match="multiple of 128"):
        swizzle_block_scales(torch.zeros(100, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 128 and columns of 4"):
        unswizzle_block_scales(torch.zeros(128, 6, dtype=torch.uint8))
    with pytest.raises(ValueError, match="2-D"):
        swizzle_block_scales(torch.zeros(2, 128, 4, dtype=torch.uint8))
    with pytest.raises(TypeError, match="one byte"):
        swizzle_block_scales(torch.zeros(128, 4))


@pytest.mark.parametrize("rows", [(0, 384), (128, 200), (256, 384), (32, 96), (100, 300)], ids=str)
def test_swizzled_rows_are_the_rows_swizzled(rows):
    start, stop = rows
    gen = torch.Generator().manual_seed(start)
    compact = torch.randint(0, 255, (384, 8), dtype=torch.uint8, generator=gen)
    sliced = swizzled_rows(swizzle_block_scales(compact), start, stop)
    assert sliced.shape == (round_up(stop - start, 128), 8)
    # Rows past stop - start are padding the GEMM never reads.
    assert torch.equal(unswizzle_block_scales(sliced)[: stop - start], compact[start:stop])
    with pytest.raises(ValueError, match="not within"):
        swizzled_rows(swizzle_block_scales(compact), 10, 400)


# ----------------------------------------------------------------------------------------------
# block_gemm_native on a faked device
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device 0 of a chosen compute capability (call the fixture's value with it), the
    capability caches emptied."""

    def set_capability(capability):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(_device, "_FP8_SUPPORT", {})
        monkeypatch.setattr(_device, "_BLOCK_GEMM", {})
        # An earlier test may have left torch.set_default_device's mode on the stack: the
        # availability answers must ask the faked GPU.
        monkeypatch.setattr(_device, "_user_set_default_device", lambda: False)
        return torch.device("cuda", 0)

    return set_capability


def test_emulated_on_the_cpu():
    for recipe in MX_RECIPES:
        native, reason = _device.block_gemm_native(recipe, torch.device("cpu"))
        assert native is False and "emulated on the CPU" in reason


@pytest.mark.parametrize("recipe", MX_RECIPES)
def test_emulated_on_hopper_native_on_capability_10(recipe, fake_gpu, monkeypatch):
    monkeypatch.delenv("TORCHTE_MX_EMULATE", raising=False)
    device = fake_gpu((9, 0))
    native, reason = _device.block_gemm_native(recipe, device)
    assert native is False
    assert "compute capability 10.0 or higher" in reason and "has 9.0" in reason
    assert "emulated" in reason
    # The availability answer names the reason (TE's is_*_available(return_reason=True)).
    check = te.is_mxfp8_available if recipe.startswith("MX") else te.is_nvfp4_available
    available, why = check(return_reason=True)
    assert available is True and why == "emulated: " + reason
    assert _device.block_gemm_native("Float8BlockScaling", device)[0] is True

    device = fake_gpu((10, 0))
    native, reason = _device.block_gemm_native(recipe, device)
    assert native is True and "untested" in reason and "scaled_mm" in reason
    assert check(return_reason=True) == (True, "native: " + reason)
    assert _device.block_gemm_native("Float8BlockScaling", device)[0] is False
    assert _device.block_gemm_native(recipe, device) is _device._BLOCK_GEMM[(recipe, device)]


@pytest.mark.parametrize("recipe", MX_RECIPES)
def test_emulated_on_capability_10_without_torch_support_or_when_asked(
    recipe, fake_gpu, monkeypatch
):
    monkeypatch.delenv("TORCHTE_MX_EMULATE", raising=False)
    device = fake_gpu((10, 0))

    class OldScalingType:  # a torch with the block-scaled FP8 types only
        BlockWise1x128 = 4
        BlockWise128x128 = 5

    monkeypatch.setattr(F, "ScalingType", OldScalingType)
    native, reason = _device.block_gemm_native(recipe, device)
    assert native is False and "this torch has no" in reason and "ScalingType.BlockWise1x" in reason
    monkeypatch.undo()
    device = fake_gpu((12, 0))
    monkeypatch.setenv("TORCHTE_MX_EMULATE", "1")
    native, reason = _device.block_gemm_native(recipe, device)
    assert native is False and "TORCHTE_MX_EMULATE" in reason


# ----------------------------------------------------------------------------------------------
# The native operands, and the GEMM through a stand-in for F.scaled_mm
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def native(monkeypatch):
    """The storages' native check answering True on the CPU (as on compute capability 10+)."""
    answer = (True, "forced native (test)")
    monkeypatch.setattr(mxfp8, "block_gemm_native", lambda recipe, device: answer)
    monkeypatch.setattr(nvfp4, "block_gemm_native", lambda recipe, device: answer)


E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)


def _decode(mat: torch.Tensor, compact: torch.Tensor, block: int) -> torch.Tensor:
    """(R, K) float64 values of a K-major operand: FP8 or packed FP4 (low nibble first) times
    its block's scale (E8M0 code: 2**(code - 127); E4M3: the FP8 value)."""
    if mat.dtype == FP4:
        codes = u8(mat)
        nibbles = torch.stack((codes & 15, codes >> 4), dim=-1).reshape(mat.shape[0], -1).long()
        values = E2M1[nibbles & 7] * (1 - 2 * (nibbles >> 3)).double()
    else:
        values = mat.double()
    rows, k = values.shape
    scales = compact[:rows, : k // block]
    e8m0 = scales.dtype == E8M0
    factors = torch.pow(2.0, u8(scales).double() - 127) if e8m0 else scales.double()
    return values * factors.repeat_interleave(block, dim=1)


class FakeScaledMM:
    """Stands in for F.scaled_mm: asserts the call follows torch's contract for MXFP8 / NVFP4
    on CUDA (mat_a row-major, mat_b column-major, the scale dtypes, sizes and swizzles, the
    recipes, the bias rule), then computes the product from what it got: scales un-swizzled,
    values in fp32, an fp32 GEMM, times both per-tensor scales (cuBLAS's alpha), the bias,
    one rounding."""

    def __init__(self):
        self.calls = []

    def __call__(self, mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, swizzle_a=None,
                 swizzle_b=None, bias=None, output_dtype=torch.bfloat16, contraction_dim=(),
                 use_fast_accum=False):  # fmt: skip
        scaling, swizzle = F.ScalingType, F.SwizzleType
        fp4 = mat_a.dtype == FP4
        assert mat_b.dtype == mat_a.dtype or not fp4
        assert mat_a.is_contiguous() and mat_b.t().is_contiguous()  # row- / column-major
        assert mat_a.data_ptr() % 16 == 0 and mat_b.data_ptr() % 16 == 0
        m, k = mat_a.shape[0], mat_a.shape[1] * (2 if fp4 else 1)
        n = mat_b.shape[1]
        assert mat_b.shape[0] * (2 if fp4 else 1) == k and k % 16 == 0 and n % 16 == 0
        block = 16 if fp4 else 32
        if fp4:
            want = [scaling.BlockWise1x16, scaling.TensorWise]
            swizzles = [swizzle.SWIZZLE_32_4_4, swizzle.NO_SWIZZLE]
        else:
            assert mat_a.dtype in (E4M3, E5M2) and mat_b.dtype in (E4M3, E5M2)
            assert E4M3 in (mat_a.dtype, mat_b.dtype)  # never E5M2 x E5M2
            want, swizzles = [scaling.BlockWise1x32], [swizzle.SWIZZLE_32_4_4]
        assert list(recipe_a) == want and list(recipe_b) == want
        assert list(swizzle_a) == swizzles and list(swizzle_b) == swizzles
        assert use_fast_accum is False and tuple(contraction_dim) == ()
        values = []
        for mat, scales, rows in ((mat_a, scale_a, m), (mat_b.t(), scale_b, n)):
            blocks = scales[0]
            assert blocks.dtype == (E4M3 if fp4 else E8M0) and blocks.is_contiguous()
            assert blocks.numel() == round_up(rows, 128) * round_up(k // block, 4)
            compact = unswizzle_block_scales(blocks.view(round_up(rows, 128), -1))
            values.append(_decode(mat, compact, block).float())
        acc = torch.mm(values[0], values[1].t())
        if fp4:
            for tensor_scale in (scale_a[1], scale_b[1]):
                assert tensor_scale.dtype == torch.float32 and tensor_scale.numel() == 1
            acc = acc * (scale_a[1] * scale_b[1])
        if bias is not None:
            assert output_dtype in (torch.bfloat16, torch.float16) and bias.dtype == output_dtype
            acc = acc + bias.float()
        self.calls.append((m, n, k, mat_a.dtype, mat_b.dtype, output_dtype))
        return acc.to(output_dtype)


@pytest.fixture
def fake_mm(monkeypatch):
    fake = FakeScaledMM()
    monkeypatch.setattr(F, "scaled_mm", fake)
    return fake


def test_mxfp8_operands(native):
    x = sample((96, 160), seed=1)
    q = MXFP8Quantizer(E4M3).quantize(x)
    rows = q.gemm_operand("rowwise")
    assert isinstance(rows, mx_operand.MXGemmOperand) and rows.kind == "mx"
    assert rows.data.shape == (96, 160) and rows.data.dtype == E4M3 and rows.factor is None
    assert torch.equal(u8(rows.data), u8(q.rowwise_data))
    assert rows.scale.dtype == E8M0 and rows.scale.shape == (128, 8)
    assert torch.equal(u8(unswizzle_block_scales(rows.scale)), u8(q.rowwise_scale_inv))
    cols = q.gemm_operand("columnwise")
    assert cols.data.shape == (160, 96) and cols.data.is_contiguous()  # (K, num_rows), K-major
    assert torch.equal(u8(cols.data), u8(q.columnwise_data).t())
    assert cols.scale.shape == (256, 4)  # the columnwise codes (4, 256), transposed
    assert torch.equal(u8(unswizzle_block_scales(cols.scale)), u8(q.columnwise_scale_inv).t())
    # Made once while the storage is unchanged; made again after its bytes are written.
    again = q.gemm_operand("columnwise")
    assert again.data is cols.data and again.scale is cols.scale
    q.copy_from_(MXFP8Quantizer(E4M3).quantize(sample((96, 160), seed=2)))
    fresh = q.gemm_operand("columnwise")
    assert fresh.data is not cols.data
    assert torch.equal(u8(fresh.data), u8(q.columnwise_data).t())
    # Data at an address cuBLAS cannot read from (a view into a flat buffer): copied.
    flat = torch.empty(1 + q.rowwise_data.numel(), dtype=torch.uint8)
    shifted = flat[1:].view(96, 160).view(E4M3)
    shifted.copy_(q.rowwise_data)
    op = mx_operand.mxfp8_native_operand(shifted, q.rowwise_scale_inv, columnwise=False)
    assert op.data.data_ptr() % 16 == 0 and torch.equal(u8(op.data), u8(q.rowwise_data))


def test_nvfp4_operands_and_the_emulated_fallback(native):
    q = NVFP4Quantizer(with_rht=True, with_post_rht_amax=True).quantize(sample((64, 96)))
    for usage, (rows, k) in (("rowwise", (64, 96)), ("columnwise", (96, 64))):
        op = q.gemm_operand(usage)
        data, scale, amax = q._copy(usage)
        assert isinstance(op, mx_operand.MXGemmOperand) and op.kind == "nvfp4"
        assert op.data.dtype == FP4 and op.data.shape == (rows, k // 2)
        assert torch.equal(u8(op.data), data)
        assert op.scale.dtype == E4M3 and op.scale.shape == nv.scale_shape(rows, k)
        assert torch.equal(u8(unswizzle_block_scales(op.scale)), scale)
        assert torch.equal(op.factor, nv.tensor_factor(amax))
    # Packed rows of 24 bytes (K = 48): not a multiple of 16 bytes, so emulated.
    q = NVFP4Quantizer().quantize(sample((32, 48)))
    assert q.gemm_operand("rowwise").kind == "values"
    assert q.gemm_operand("columnwise").kind == "nvfp4"  # K = 32 tokens


def _operands(storages_and_usages, forced: bool, monkeypatch):
    """The GEMM operands of (storage, usage) pairs, native (forced) or emulated."""
    answer = (forced, "test")
    monkeypatch.setattr(mxfp8, "block_gemm_native", lambda recipe, device: answer)
    monkeypatch.setattr(nvfp4, "block_gemm_native", lambda recipe, device: answer)
    return [s.gemm_operand(u) for s, u in storages_and_usages]


def _gemm_cases(fmt):
    """(x, w, dy) storages of one format: x (96, 160), w (64, 160), dy (96, 64)."""
    if fmt == "mxfp8":
        x_q = MXFP8Quantizer(E4M3).quantize(sample((96, 160), seed=3))
        w_q = MXFP8Quantizer(E4M3).quantize(sample((64, 160), seed=4, spread=2))
        dy_q = MXFP8Quantizer(E5M2).quantize(sample((96, 64), seed=5))
        return x_q, w_q, dy_q
    rht = {"with_rht": True, "with_post_rht_amax": True}
    x_q = NVFP4Quantizer(**rht).quantize(sample((96, 160), seed=3))
    w_q = NVFP4Quantizer(with_2d_quantization=True).quantize(sample((64, 160), seed=4))
    dy_q = NVFP4Quantizer(**rht).quantize(sample((96, 64), seed=5))
    return x_q, w_q, dy_q


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_operand_gemm_native_equals_emulated(fmt, fake_mm, monkeypatch):
    x_q, w_q, dy_q = _gemm_cases(fmt)
    bias = representable(64, torch.bfloat16, device="cpu").to(torch.bfloat16)
    gemms = {  # name: ((a, usage), (b, usage), out_dtype, bias, rows of a)
        "fprop": ((x_q, "rowwise"), (w_q, "rowwise"), torch.bfloat16, bias, slice(None)),
        "fprop-fp32-bias": ((x_q, "rowwise"), (w_q, "rowwise"), torch.float32, bias, slice(None)),
        "dgrad": ((dy_q, "rowwise"), (w_q, "columnwise"), torch.float16, None, slice(None)),
        "wgrad": ((dy_q, "columnwise"), (x_q, "columnwise"), torch.float32, None, slice(None)),
    }
    part = slice(16, 48)  # rows of dy's columnwise operand (64, 96): an unaligned start
    gemms["wgrad-rows"] = ((dy_q, "columnwise"), (x_q, "columnwise"), torch.bfloat16, None, part)
    # NVFP4's alpha (both per-tensor factors multiplied first) may round differently in fp32.
    exact = fmt == "mxfp8"
    for name, (a, b, out_dtype, bias_, rows) in gemms.items():
        a_nat, b_nat = _operands([a, b], True, monkeypatch)
        a_emu, b_emu = _operands([a, b], False, monkeypatch)
        assert a_nat.kind == b_nat.kind == ("mx" if fmt == "mxfp8" else "nvfp4"), name
        assert a_emu.kind == "values", name
        calls = len(fake_mm.calls)
        got = operand_gemm(a_nat.rows(rows), b_nat, out_dtype, bias_)
        want = operand_gemm(a_emu.rows(rows), b_emu, out_dtype, bias_)
        assert len(fake_mm.calls) == calls + 1, name
        assert got.dtype == want.dtype == out_dtype and got.shape == want.shape, name
        if exact:
            assert torch.equal(got, want), name
        else:
            assert_close(got, want, out_dtype, msg=name)
    # out= and accumulate: written into / added to an fp32 buffer.
    a_nat, b_nat = _operands([(dy_q, "columnwise"), (x_q, "columnwise")], True, monkeypatch)
    a_emu, b_emu = _operands([(dy_q, "columnwise"), (x_q, "columnwise")], False, monkeypatch)
    start = torch.full((64, 160), 0.5)
    got, want = start.clone(), start.clone()
    operand_gemm(a_nat, b_nat, torch.float32, out=got, accumulate=True)
    operand_gemm(a_emu, b_emu, torch.float32, out=want, accumulate=True)
    assert_close(got, want, torch.float32)
    assert not torch.equal(got, start)


def test_operand_gemm_refuses_mixed_operands(fake_mm, monkeypatch):
    mx_x, mx_w, _ = _gemm_cases("mxfp8")
    nv_x, nv_w, _ = _gemm_cases("nvfp4")
    (a_mx,) = _operands([(mx_x, "rowwise")], True, monkeypatch)
    (b_nv,) = _operands([(nv_w, "rowwise")], True, monkeypatch)
    (b_values,) = _operands([(mx_w, "rowwise")], False, monkeypatch)
    with pytest.raises(ValueError, match="'mx' and a 'nvfp4'"):
        operand_gemm(a_mx, b_nv, torch.bfloat16)
    with pytest.raises(ValueError, match="'values' and a 'mx'"):
        operand_gemm(b_values, a_mx, torch.bfloat16)
    assert fake_mm.calls == []
    # A row slice keeps the operand's kind and its factor.
    (a_nv,) = _operands([(nv_x, "rowwise")], True, monkeypatch)
    part = a_nv.rows(slice(0, 32))
    assert part.kind == "nvfp4" and part.factor is a_nv.factor and part.data.shape[0] == 32
    with pytest.raises(ValueError, match="step 1"):
        a_nv.rows(slice(0, 32, 2))
    assert isinstance(GemmOperand("values", torch.zeros(2, 2), None).rows(slice(1)), GemmOperand)


@pytest.mark.parametrize(
    "recipe",
    [MXFP8BlockScaling(fp8_format=te.recipe.Format.HYBRID), NVFP4BlockScaling()],
    ids=["mxfp8-hybrid", "nvfp4"],
)
@pytest.mark.usefixtures("cpu_default_device")
def test_linear_native_equals_emulated(recipe, fake_mm, monkeypatch):
    """te.Linear's forward, input and weight gradients: the same through both paths (NVFP4:
    within the tolerance of its per-tensor factors' rounding; stochastic rounding reseeded)."""
    m, k, n = 96, 160, 64
    layer = te.Linear(k, n, params_dtype=torch.float32)
    with torch.no_grad():
        layer.weight.copy_(representable((n, k), torch.bfloat16, scale=0.125))
        layer.bias.copy_(representable(n, torch.bfloat16))
    x = representable((m, k), torch.bfloat16)
    dy = representable((m, n), torch.bfloat16)
    results = []
    for forced in (True, False):
        _operands([], forced, monkeypatch)
        torch.manual_seed(0)
        x_in = x.clone().requires_grad_()
        layer.weight.grad = layer.bias.grad = None
        with te.autocast(recipe=recipe):
            y = layer(x_in)
        y.backward(dy)
        results.append((y.detach(), x_in.grad, layer.weight.grad.clone(), layer.bias.grad))
    assert len(fake_mm.calls) == 3  # fprop, dgrad, wgrad: native in the first run only
    for got, want in zip(*results, strict=True):
        assert_close(got, want, torch.float32)
