"""LayerNorm / RMSNorm forward + FP8 quantization (delayed scaling) in one launch: the torch
references against the unfused composition (CPU), the Triton kernels against the unfused
Triton norm kernel followed by quantize (GPU, and under Triton's CPU interpreter).

The fused kernel computes the row statistics with the unfused kernel's code on its tiles and
y with the same fp32 expression, so bytes, amax, mean and rstd are compared exactly.
"""

from __future__ import annotations

import pytest
import torch
from interpreter import requires_interpreter, run_under_interpreter
from launches import count_device_ops

from torchte.kernels import norm
from torchte.kernels import norm_fp8 as nfp8
from torchte.kernels._triton import triton_available
from torchte.kernels.cast_spec import CastSpec
from torchte.kernels.cast_transpose import quantize

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
# y is about N(0, 1) times g (around 1) plus b: scale = fp8_max / 4, a few values saturate.
SCALE_OF = {torch.float8_e4m3fn: 112.0, torch.float8_e5m2: 14336.0}
EPS = 1e-5

requires_triton = pytest.mark.skipif(not triton_available(), reason="needs a CUDA GPU and Triton")


def draw(m, n, dtype, param_dtype, device="cpu", seed=0):
    """(x (m, n) in dtype, weight, bias (n,) in param_dtype): rows with offsets and spreads."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn((m, n), generator=gen, device=device) * 2 + 0.5
    x = x * torch.rand((m, 1), generator=gen, device=device) * 4 + torch.randn(
        (m, 1), generator=gen, device=device
    )
    weight = torch.randn(n, generator=gen, device=device) * 0.3 + 1.0
    bias = torch.randn(n, generator=gen, device=device) * 0.5
    return x.to(dtype), weight.to(param_dtype), bias.to(param_dtype)


def quant_state(fp8_dtype, device="cpu", amax0=0.25):
    """(scale, amax), each (1,) fp32."""
    scale = torch.tensor([SCALE_OF[fp8_dtype]], device=device)
    return scale, torch.tensor([amax0], device=device)


def assert_same_bytes(got, want, where):
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None), where
        if g is not None:
            assert g.dtype == w.dtype and g.shape == w.shape, where
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), where


def run_fused(rms, x, weight, bias, zc, fp8_dtype, columnwise):
    """((rowwise, columnwise), stats, amax, scale_inv) of the public fused function."""
    scale, amax = quant_state(fp8_dtype, x.device)
    spec = CastSpec(fp8_dtype, True, columnwise, scale, amax)
    if rms:
        data, data_t, scale_inv, rstd = nfp8.rmsnorm_forward_fp8(x, weight, EPS, zc, spec)
        return (data, data_t), (rstd,), amax, scale_inv
    data, data_t, scale_inv, mean, rstd = nfp8.layernorm_forward_fp8(x, weight, bias, EPS, zc, spec)
    return (data, data_t), (mean, rstd), amax, scale_inv


def run_unfused(rms, x, weight, bias, zc, fp8_dtype, columnwise):
    """The same from norm's forward, then quantize (Triton on CUDA, where the norm runs on the
    fused kernel's tile config: the reductions then add in the same order)."""
    scale, amax = quant_state(fp8_dtype, x.device)
    if x.is_cuda:
        cfg = norm.row_config(*x.shape, norm.FWD_MAX_BLOCK_N, nfp8.FP8_TILE)
        y, mean, rstd = norm._forward(x, weight, None if rms else bias, EPS, zc, rms, cfg)
        stats = (rstd,) if rms else (mean, rstd)
    elif rms:
        y, rstd = norm.rmsnorm_forward(x, weight, EPS, zc)
        stats = (rstd,)
    else:
        y, mean, rstd = norm.layernorm_forward(x, weight, bias, EPS, zc)
        stats = (mean, rstd)
    data, data_t, scale_inv = quantize(y, CastSpec(fp8_dtype, True, columnwise, scale, amax))
    return (data, data_t), stats, amax, scale_inv


def assert_same(fused, unfused, where):
    (out, stats, amax, scale_inv), (out_u, stats_u, amax_u, scale_inv_u) = fused, unfused
    assert_same_bytes(out, out_u, where)
    for s, s_u in zip(stats, stats_u, strict=True):
        assert s.dtype == torch.float32 and torch.equal(s, s_u), where
    assert torch.equal(amax, amax_u) and torch.equal(scale_inv, scale_inv_u), where


# ----------------------------------------------------------------------------------------------
# The references against the unfused composition (CPU)
# ----------------------------------------------------------------------------------------------

CPU_SHAPES = [(1, 1), (1, 16), (17, 33), (33, 130), (64, 96)]


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n", CPU_SHAPES)
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("zc", [False, True])
def test_reference_equals_unfused(zc, rms, m, n, dtype, fp8_dtype):
    x, weight, bias = draw(m, n, dtype, torch.float32, seed=m * n)
    where = (zc, rms, m, n, dtype, fp8_dtype)
    for columnwise in (True, False):
        fused = run_fused(rms, x, weight, bias, zc, fp8_dtype, columnwise)
        assert_same(fused, run_unfused(rms, x, weight, bias, zc, fp8_dtype, columnwise), where)
        assert fused[0][0].shape == (m, n)
        if columnwise:
            assert fused[0][1].shape == (n, (m + 15) // 16 * 16)
        else:
            assert fused[0][1] is None


def test_reference_no_bias_amax_kept_and_zero_rows():
    x, weight, _ = draw(5, 12, torch.bfloat16, torch.bfloat16)
    fp8 = torch.float8_e4m3fn
    scale, amax = quant_state(fp8, amax0=1e6)  # above every |y|: kept
    spec = CastSpec(fp8, True, True, scale, amax)
    _, _, scale_inv, _, _ = nfp8.layernorm_forward_fp8(x, weight, None, EPS, False, spec)
    assert amax.item() == 1e6 and scale_inv.item() == pytest.approx(1 / SCALE_OF[fp8])
    empty = torch.empty((0, 8), dtype=torch.bfloat16)
    w8 = torch.ones(8, dtype=torch.bfloat16)
    scale, amax = quant_state(fp8)
    data, data_t, _, mean, rstd = nfp8.layernorm_forward_fp8(
        empty, w8, w8, EPS, False, CastSpec(fp8, True, True, scale, amax)
    )
    assert data.shape == (0, 8) and data_t.shape == (8, 0) and mean.shape == rstd.shape == (0,)
    data, data_t, _, rstd = nfp8.rmsnorm_forward_fp8(
        empty, w8, EPS, True, CastSpec(fp8, True, False, scale, amax)
    )
    assert data.shape == (0, 8) and data_t is None and rstd.shape == (0,)
    assert amax.item() == 0.25


def test_bad_fp8_dtype_raises():
    x, weight, _ = draw(3, 4, torch.float32, torch.float32)
    scale, amax = quant_state(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="fp8_dtype"):
        nfp8.rmsnorm_forward_fp8(
            x, weight, EPS, False, CastSpec(torch.bfloat16, True, True, scale, amax)
        )


def test_spec_without_scale_or_rowwise_raises():
    """The fused norm writes with a scale known before y exists (delayed scaling) and always
    writes the rowwise data: a current-scaling spec and a columnwise-only spec are refused."""
    x, weight, bias = draw(3, 4, torch.float32, torch.float32)
    fp8 = torch.float8_e4m3fn
    scale, amax = quant_state(fp8)
    current = CastSpec(fp8, True, True, amax=amax)
    columnwise_only = CastSpec(fp8, False, True, scale, amax)
    with pytest.raises(ValueError, match="delayed scaling only"):
        nfp8.layernorm_forward_fp8(x, weight, bias, EPS, False, current)
    with pytest.raises(ValueError, match="delayed scaling only"):
        nfp8.rmsnorm_forward_fp8(x, weight, EPS, False, current)
    with pytest.raises(ValueError, match="always writes rowwise data"):
        nfp8.layernorm_forward_fp8(x, weight, bias, EPS, False, columnwise_only)
    with pytest.raises(ValueError, match="always writes rowwise data"):
        nfp8.rmsnorm_forward_fp8(x, weight, EPS, False, columnwise_only)
    assert amax.item() == 0.25  # refused before anything was written


# ----------------------------------------------------------------------------------------------
# Triton vs the unfused Triton path (GPU)
# ----------------------------------------------------------------------------------------------

GPU_SHAPES = [(1, 64), (16, 1024), (17, 1001), (257, 4096)]


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,n", GPU_SHAPES)
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("zc", [False, True])
def test_triton_equals_unfused(zc, rms, m, n, dtype, fp8_dtype):
    x, weight, bias = draw(m, n, dtype, torch.float32, device="cuda", seed=m + n)
    where = (zc, rms, m, n, dtype, fp8_dtype)
    for columnwise in (True, False):
        fused = run_fused(rms, x, weight, bias, zc, fp8_dtype, columnwise)
        unfused = run_unfused(rms, x, weight, bias, zc, fp8_dtype, columnwise)
        assert_same(fused, unfused, where)


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("n", [16384, 20000])
def test_triton_long_rows_equal_unfused(n):
    x, weight, bias = draw(19, n, torch.bfloat16, torch.bfloat16, device="cuda", seed=n)
    for rms in (False, True):
        fused = run_fused(rms, x, weight, bias, True, torch.float8_e4m3fn, True)
        unfused = run_unfused(rms, x, weight, bias, True, torch.float8_e4m3fn, True)
        assert_same(fused, unfused, (n, rms))


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("rms", [False, True])
def test_triton_one_launch_per_call(rms):
    x, weight, bias = draw(16, 4096, torch.bfloat16, torch.bfloat16, device="cuda")

    scale, amax = quant_state(torch.float8_e4m3fn, "cuda")
    spec = CastSpec(torch.float8_e4m3fn, True, True, scale, amax)

    def fused():
        if rms:
            nfp8.rmsnorm_forward_fp8(x, weight, EPS, False, spec)
        else:
            nfp8.layernorm_forward_fp8(x, weight, bias, EPS, False, spec)

    fused()  # compile outside the profile
    count = count_device_ops(fused)
    if count == 0:
        pytest.skip("the profiler records no GPU activity here")
    assert count == 1


# ----------------------------------------------------------------------------------------------
# The Triton kernel under Triton's CPU interpreter (where triton is installed)
# ----------------------------------------------------------------------------------------------

# Runs in a fresh process: TRITON_INTERPRET must be set before the kernels are defined. The
# launcher runs on CPU tensors with the default config and with small ones (chunked rows,
# several row slices per group, several output column steps). The fused bytes are checked
# exactly against the unfused Triton norm kernel run on x in fp32 with the same config, its y
# rounded to x's dtype by torch, then quantized by the reference: the interpreter's own
# fp32 -> bf16 cast truncates, which the fused kernel's integer rounding does not rely on.
INTERPRETER_SCRIPT = """
import torch
from torchte.kernels import cast_transpose as ct
from torchte.kernels import norm
from torchte.kernels import norm_fp8 as nfp8
from torchte.kernels.cast_spec import CastSpec

EPS = 1e-5
SCALE_OF = {torch.float8_e4m3fn: 112.0, torch.float8_e5m2: 14336.0}

def state(fp8):
    return torch.tensor([SCALE_OF[fp8]]), torch.tensor([0.25])

def draw(m, n, dtype, param_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((m, n), generator=gen) * 2 + 0.5
    x = x * torch.rand((m, 1), generator=gen) * 4 + torch.randn((m, 1), generator=gen)
    w = torch.randn(n, generator=gen) * 0.3 + 1.0
    b = torch.randn(n, generator=gen) * 0.5
    return x.to(dtype), w.to(param_dtype), b.to(param_dtype)

def check(x, w, b, zc, rms, fp8, columnwise, config, out_tile):
    where = (tuple(x.shape), x.dtype, w.dtype, b is None, zc, rms, fp8, columnwise, config,
             out_tile)
    scale, amax = state(fp8)
    data, data_t, scale_inv, mean, rstd = nfp8._forward_fp8(
        x, w, b, EPS, zc, rms, CastSpec(fp8, True, columnwise, scale, amax), config, out_tile)
    cfg = config or norm.row_config(*x.shape, norm.FWD_MAX_BLOCK_N, nfp8.FP8_TILE)
    y, mean_u, rstd_u = norm._forward(x.float(), w, b, EPS, zc, rms, cfg, 3)
    _, amax_u = state(fp8)
    *want, scale_inv_u = ct.quantize_reference(y.to(x.dtype),
                                               CastSpec(fp8, True, columnwise, scale, amax_u))
    for g, u in zip((data, data_t), want):
        assert (g is None) == (u is None), where
        if g is not None:
            assert g.shape == u.shape and g.dtype == u.dtype, where
            assert torch.equal(g.view(torch.uint8), u.view(torch.uint8)), where
    assert torch.equal(rstd, rstd_u), where
    assert (mean is None) == rms and (rms or torch.equal(mean, mean_u)), where
    assert torch.equal(amax, amax_u) and torch.equal(scale_inv, scale_inv_u), where

DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
          (torch.bfloat16, torch.float32), (torch.float16, torch.float32)]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# (M, N) with (norm config, out_tile): the defaults; small tiles (several output steps, a
# group of four statistics blocks); chunked rows (N past BLOCK_N).
CASES = [((1, 16), [(None, nfp8.OUT_TILE), ((1, 16, 1, False), 64)]),
         ((17, 33), [(None, nfp8.OUT_TILE), ((4, 64, 4, False), 64), ((2, 16, 4, True), 64)]),
         ((33, 130), [(None, nfp8.OUT_TILE), ((16, 32, 4, True), 256)]),
         ((70, 9), [(None, nfp8.OUT_TILE), ((32, 16, 4, False), 128)])]
i = 0
for (m, n), configs in CASES:
    for dtype, param_dtype in DTYPES:
        x, w, b = draw(m, n, dtype, param_dtype, seed=i)
        for config, out_tile in configs:
            for rms in (False, True):
                i += 1
                check(x, w, None if i % 3 == 0 else b, i % 2 == 0, rms, FP8[i % 2], i % 4 != 1,
                      config, out_tile)
print("ok")
"""


@requires_interpreter
def test_triton_kernel_in_interpreter_matches_unfused():
    run_under_interpreter(INTERPRETER_SCRIPT)
