"""Activation + FP8 quantization (delayed scaling) in one launch: the torch references against
the unfused composition the module runs today (CPU), the Triton kernels against that
composition and against the references (GPU, and under Triton's CPU interpreter).

The unfused composition: a = activation_forward(h), then Float8Quantizer.quantize(a); dh =
activation_backward(dy, h), then Float8Quantizer.quantize(dh) and dbias = dh.sum(0). The fused
kernels run the same fp32 activation code as the unfused Triton kernels, so their bytes equal
that path's exactly; against the torch references (torch.sigmoid, not the kernels' exp) bytes
are equal exactly only where the activation has no transcendental (relu and srelu, gated or
not), and elsewhere within one FP8 step.
"""

from __future__ import annotations

import pytest
import torch
from interpreter import requires_interpreter, run_under_interpreter
from launches import count_device_ops
from tolerances import assert_close, assert_close_to_scale

from torchte.kernels import activation as act
from torchte.kernels import activation_fp8 as afp8
from torchte.kernels import column_sums
from torchte.kernels._triton import triton_available
from torchte.kernels.cast_dbias import quantize_dbias
from torchte.kernels.cast_spec import CastSpec
from torchte.quantization.float8 import Float8CurrentScalingQuantizer, Float8Quantizer

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
NAMES = ["gelu", "swiglu", "srelu", "clamped_swiglu"]
EXACT = {"relu", "reglu", "srelu", "sreglu"}  # no exp: bytes equal the torch reference's
PARAMS = {"limit": 7.0, "alpha": 1.702}
# An amax (1,) of a values around 8 (a few saturate): scale = fp8_max / 8.
SCALE_OF = {torch.float8_e4m3fn: 56.0, torch.float8_e5m2: 7168.0}

requires_triton = pytest.mark.skipif(not triton_available(), reason="needs a CUDA GPU and Triton")


def draw(name: str, m: int, n: int, dtype: torch.dtype, device="cpu", seed: int = 0):
    """(h (m, K), dy (m, n)) in dtype: normal values, some tiny, some large."""
    gen = torch.Generator(device=device).manual_seed(seed)
    k = 2 * n if act.is_gated(name) else n
    h = torch.randn((m, k), generator=gen, device=device) * 3
    h.view(-1)[::7] *= 1e-3
    h.view(-1)[::13] *= 30
    dy = torch.randn((m, n), generator=gen, device=device) * 2
    dy.view(-1)[::11] *= 1e-4
    return h.to(dtype), dy.to(dtype)


def quant_state(fp8_dtype: torch.dtype, device="cpu", amax0: float = 0.25):
    """(scale, amax), each (1,) fp32."""
    scale = torch.tensor([SCALE_OF[fp8_dtype]], device=device)
    amax = torch.tensor([amax0], device=device)
    return scale, amax


def u8(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.view(torch.uint8)


def assert_same_bytes(got, want, where):
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None), where
        if g is not None:
            assert g.dtype == w.dtype and g.shape == w.shape, where
            assert torch.equal(u8(g), u8(w)), where


def assert_near_bytes(got, want, fp8_dtype, where):
    """Bytes equal, or the FP8 values one step apart (rounding of a value that differs in its
    last bits), compared through the FP8 dtype's tolerance."""
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None), where
        if g is not None:
            assert g.dtype == w.dtype and g.shape == w.shape, where
            assert_close(g.float(), w.float(), fp8_dtype, msg=str(where))


def unfused_forward(h, name, scale, amax, fp8_dtype, columnwise):
    """What LayerNormMLP runs today: activation_forward, then the input quantizer of fc2."""
    a = act.activation_forward(h, name, **PARAMS)
    q = Float8Quantizer(scale, amax, fp8_dtype).quantize(a, rowwise=True, columnwise=columnwise)
    return (q.rowwise_data, q.columnwise_data), q.scale_inv


def unfused_backward(dy, h, name, scale, amax, fp8_dtype, rowwise, columnwise):
    """activation_backward, then fc1's grad_output quantizer and linear_backward's dbias."""
    dh = act.activation_backward(dy, h, name, **PARAMS)
    q = Float8Quantizer(scale, amax, fp8_dtype).quantize(dh, rowwise=rowwise, columnwise=columnwise)
    return (q.rowwise_data, q.columnwise_data), q.scale_inv, dh.sum(0).to(dy.dtype)


def fused_forward(h, name, fp8_dtype, columnwise, device="cpu"):
    scale, amax = quant_state(fp8_dtype, device)
    spec = CastSpec(fp8_dtype, True, columnwise, scale, amax)
    data, data_t, scale_inv = afp8.activation_forward_fp8(
        h, name, PARAMS["limit"], PARAMS["alpha"], spec
    )
    return (data, data_t), amax, scale_inv


def fused_backward(dy, h, name, fp8_dtype, rowwise, columnwise, device="cpu"):
    scale, amax = quant_state(fp8_dtype, device)
    spec = CastSpec(fp8_dtype, rowwise, columnwise, scale, amax)
    data, data_t, scale_inv, dbias = afp8.activation_backward_fp8(
        dy, h, name, PARAMS["limit"], PARAMS["alpha"], spec
    )
    return (data, data_t), amax, scale_inv, dbias


# ----------------------------------------------------------------------------------------------
# The references against the unfused composition (CPU)
# ----------------------------------------------------------------------------------------------

CPU_SHAPES = [(1, 1), (1, 24), (16, 64), (17, 33), (64, 96)]  # (M, N): a and dy are (M, N)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n", CPU_SHAPES)
@pytest.mark.parametrize("name", act.ACTIVATIONS)
def test_reference_forward_equals_unfused(name, m, n, dtype, fp8_dtype):
    h, _ = draw(name, m, n, dtype, seed=m * 31 + n)
    where = (name, m, n, dtype, fp8_dtype)
    for columnwise in (True, False):
        out, amax, scale_inv = fused_forward(h, name, fp8_dtype, columnwise)
        scale, amax_ref = quant_state(fp8_dtype)
        ref, scale_inv_ref = unfused_forward(h, name, scale, amax_ref, fp8_dtype, columnwise)
        assert_same_bytes(out, ref, where)
        assert out[0].shape == (m, n) and (out[1] is None) == (not columnwise)
        assert torch.equal(amax, amax_ref) and torch.equal(scale_inv, scale_inv_ref), where


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n", CPU_SHAPES)
@pytest.mark.parametrize("name", act.ACTIVATIONS)
def test_reference_backward_equals_unfused(name, m, n, dtype, fp8_dtype):
    h, dy = draw(name, m, n, dtype, seed=m * 31 + n)
    where = (name, m, n, dtype, fp8_dtype)
    out, amax, scale_inv, dbias = fused_backward(dy, h, name, fp8_dtype, True, True)
    scale, amax_ref = quant_state(fp8_dtype)
    ref, scale_inv_ref, dbias_ref = unfused_backward(
        dy, h, name, scale, amax_ref, fp8_dtype, True, True
    )
    assert_same_bytes(out, ref, where)
    assert torch.equal(amax, amax_ref) and torch.equal(scale_inv, scale_inv_ref), where
    assert dbias.dtype == dy.dtype and dbias.shape == (h.shape[1],)
    # On the CPU torch sums dh in fp32 whatever its dtype: the same values as the fp32 sum.
    assert torch.equal(dbias, dbias_ref), where


@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (False, True), (False, False)])
def test_reference_backward_usage(rowwise, columnwise):
    h, dy = draw("swiglu", 33, 20, torch.bfloat16)
    fp8 = torch.float8_e4m3fn
    out, amax, _, dbias = fused_backward(dy, h, "swiglu", fp8, rowwise, columnwise)
    scale, amax_ref = quant_state(fp8)
    ref, _, dbias_ref = unfused_backward(dy, h, "swiglu", scale, amax_ref, fp8, rowwise, columnwise)
    assert_same_bytes(out, ref, (rowwise, columnwise))
    assert torch.equal(amax, amax_ref) and torch.equal(dbias, dbias_ref)


def test_reference_amax_accumulates_and_leading_dims():
    h, dy = draw("geglu", 6, 10, torch.float32)
    fp8 = torch.float8_e4m3fn
    scale, amax = quant_state(fp8, amax0=1e6)  # above every |a|: kept
    args = (PARAMS["limit"], PARAMS["alpha"], CastSpec(fp8, True, True, scale, amax))
    data, data_t, _ = afp8.activation_forward_fp8(h.view(2, 3, 20), "geglu", *args)
    assert amax.item() == 1e6 and data.shape == (6, 10) and data_t.shape == (10, 16)
    h3, dy3 = h.view(2, 3, 20), dy.view(2, 3, 10)
    data, data_t, _, dbias = afp8.activation_backward_fp8(dy3, h3, "geglu", *args)
    assert data.shape == (6, 20) and data_t.shape == (20, 16) and dbias.shape == (20,)
    assert amax.item() == 1e6


def test_reference_zero_rows():
    fp8 = torch.float8_e5m2
    h, dy = torch.empty((0, 8), dtype=torch.bfloat16), torch.empty((0, 4), dtype=torch.bfloat16)
    (data, data_t), amax, _ = fused_forward(h, "swiglu", fp8, True)
    assert data.shape == (0, 4) and data_t.shape == (4, 0) and amax.item() == 0.25
    (data, data_t), amax, _, dbias = fused_backward(dy, h, "swiglu", fp8, True, True)
    assert data.shape == (0, 8) and data_t.shape == (8, 0)
    assert dbias.dtype == torch.bfloat16 and not dbias.any() and dbias.shape == (8,)


def test_bad_inputs_raise():
    h, _ = draw("swiglu", 3, 4, torch.float32)
    scale, amax = quant_state(torch.float8_e4m3fn)
    spec = CastSpec(torch.float8_e4m3fn, True, True, scale, amax)
    with pytest.raises(ValueError, match="unknown activation 'gelu_tanh'"):
        afp8.activation_forward_fp8(h, "gelu_tanh", 7.0, 1.7, spec)
    with pytest.raises(TypeError, match="fp8_dtype"):
        afp8.activation_forward_fp8(
            h, "swiglu", 7.0, 1.7, CastSpec(torch.bfloat16, True, True, scale, amax)
        )
    with pytest.raises(ValueError, match=r"dy must have shape \(3, 4\)"):
        afp8.activation_backward_fp8(h, h, "swiglu", 7.0, 1.7, spec)


def test_spec_without_rowwise_raises():
    """The forward always writes the rowwise data: a columnwise-only spec is refused by it (the
    backward takes it: test_reference_backward_usage)."""
    h, _ = draw("swiglu", 3, 4, torch.float32)
    fp8 = torch.float8_e4m3fn
    scale, amax = quant_state(fp8)
    with pytest.raises(ValueError, match="always writes rowwise data"):
        afp8.activation_forward_fp8(h, "swiglu", 7.0, 1.7, CastSpec(fp8, False, True, scale, amax))
    assert amax.item() == 0.25  # refused before anything was written


def current_spec(fp8_dtype, rowwise=True, columnwise=True, power_2=False) -> CastSpec:
    return CastSpec(fp8_dtype, rowwise, columnwise, amax_epsilon=0.0, power_2_scale=power_2)


def unfused_current(dy, h, name, fp8_dtype, power_2, device="cpu"):
    """What LayerNormMLP ran under current scaling before: the activation (and its backward),
    then the current quantizer's cast (and the gradient's cast with its column sums)."""
    quantizer = Float8CurrentScalingQuantizer(fp8_dtype, power_2_scale=power_2)
    a = act.activation_forward(h, name, **PARAMS)
    qa = quantizer.quantize(a)
    dh = act.activation_backward(dy, h, name, **PARAMS)
    data, data_t, scale_inv, dbias = quantize_dbias(dh, quantizer.cast_spec(True, True))
    return (qa.rowwise_data, qa.columnwise_data), qa.scale_inv, (data, data_t), scale_inv, dbias


@pytest.mark.parametrize("power_2", [False, True])
@pytest.mark.parametrize("name", ["gelu", "swiglu"])
def test_current_scaling_equals_the_unfused_path(name, power_2):
    """Under current scaling (no scale given) both functions cast with the scale of the values'
    own amax: the same bytes, scale_inv and dbias as the activation then the cast."""
    h, dy = draw(name, 37, 48, torch.bfloat16, seed=3)
    fp8 = torch.float8_e4m3fn
    want_a, want_a_inv, want_dh, want_dh_inv, want_dbias = unfused_current(
        dy, h, name, fp8, power_2
    )
    spec = current_spec(fp8, power_2=power_2)
    *got_a, got_a_inv = afp8.activation_forward_fp8(h, name, PARAMS["limit"], PARAMS["alpha"], spec)
    assert_same_bytes(got_a, want_a, name)
    assert torch.equal(got_a_inv, want_a_inv)
    *got_dh, got_dh_inv, got_dbias = afp8.activation_backward_fp8(
        dy, h, name, PARAMS["limit"], PARAMS["alpha"], spec
    )
    assert_same_bytes(got_dh, want_dh, name)
    assert torch.equal(got_dh_inv, want_dh_inv) and torch.equal(got_dbias, want_dbias)


# ----------------------------------------------------------------------------------------------
# Triton vs the unfused path and the references (GPU)
# ----------------------------------------------------------------------------------------------

GPU_SHAPES = [(1, 1), (1, 64), (16, 1024), (17, 1001), (257, 4096)]  # (M, N)
GPU_NAMES = ["gelu", "swiglu", "srelu", "clamped_swiglu", "reglu", "qgelu", "glu"]


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,n", GPU_SHAPES)
@pytest.mark.parametrize("name", GPU_NAMES)
def test_triton_forward(name, m, n, dtype, fp8_dtype):
    h, _ = draw(name, m, n, dtype, device="cuda", seed=m + n)
    where = (name, m, n, dtype, fp8_dtype)
    out, amax, scale_inv = fused_forward(h, name, fp8_dtype, True, device="cuda")
    # The unfused Triton path: the same bytes and amax bits.
    scale, amax_unf = quant_state(fp8_dtype, "cuda")
    unf, scale_inv_unf = unfused_forward(h, name, scale, amax_unf, fp8_dtype, True)
    assert_same_bytes(out, unf, where)
    assert torch.equal(amax, amax_unf) and torch.equal(scale_inv, scale_inv_unf), where
    # The torch reference: the same bytes where the math has no exp, else one FP8 step.
    scale, amax_ref = quant_state(fp8_dtype, "cuda")
    *ref, scale_inv_ref = afp8.activation_forward_fp8_reference(
        h, name, PARAMS["limit"], PARAMS["alpha"], CastSpec(fp8_dtype, True, True, scale, amax_ref)
    )
    assert torch.equal(scale_inv, scale_inv_ref), where
    if name in EXACT:
        assert_same_bytes(out, ref, where)
        assert torch.equal(amax, amax_ref), where
    else:
        assert_near_bytes(out, ref, fp8_dtype, where)
        assert_close(amax, amax_ref, dtype, msg=str(where))


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,n", GPU_SHAPES)
@pytest.mark.parametrize("name", GPU_NAMES)
def test_triton_backward(name, m, n, dtype, fp8_dtype):
    h, dy = draw(name, m, n, dtype, device="cuda", seed=m + n)
    where = (name, m, n, dtype, fp8_dtype)
    out, amax, scale_inv, dbias = fused_backward(dy, h, name, fp8_dtype, True, True, "cuda")
    scale, amax_unf = quant_state(fp8_dtype, "cuda")
    unf, scale_inv_unf, dbias_unf = unfused_backward(
        dy, h, name, scale, amax_unf, fp8_dtype, True, True
    )
    assert_same_bytes(out, unf, where)
    assert torch.equal(amax, amax_unf) and torch.equal(scale_inv, scale_inv_unf), where
    assert dbias.dtype == dy.dtype and dbias.shape == (h.shape[1],)
    assert_close_to_scale(dbias, dbias_unf, dtype, msg=str(where))
    scale, amax_ref = quant_state(fp8_dtype, "cuda")
    spec_ref = CastSpec(fp8_dtype, True, True, scale, amax_ref)
    *ref, scale_inv_ref, dbias_ref = afp8.activation_backward_fp8_reference(
        dy, h, name, PARAMS["limit"], PARAMS["alpha"], spec_ref
    )
    assert torch.equal(scale_inv, scale_inv_ref), where
    if name in EXACT:
        assert_same_bytes(out, ref, where)
        assert torch.equal(amax, amax_ref), where
    else:
        assert_near_bytes(out, ref, fp8_dtype, where)
        assert_close(amax, amax_ref, dtype, msg=str(where))
    assert_close_to_scale(dbias, dbias_ref, dtype, msg=str(where))


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("m,n", [(16, 1024), (257, 4096), (4096, 1000)])
@pytest.mark.parametrize("name", ["gelu", "swiglu", "srelu", "clamped_swiglu"])
def test_triton_current_scaling_equals_the_unfused_path(name, m, n, fp8_dtype):
    """Current scaling on the GPU: the amax pass and the fused kernel give the bytes,
    scale_inv and (within the tolerance of dy's dtype: another summation order) the dbias of
    the activation kernel followed by the current cast."""
    h, dy = draw(name, m, n, torch.bfloat16, device="cuda", seed=m + n)
    want_a, want_a_inv, want_dh, want_dh_inv, want_dbias = unfused_current(
        dy, h, name, fp8_dtype, False, "cuda"
    )
    spec = current_spec(fp8_dtype)
    *got_a, got_a_inv = afp8.activation_forward_fp8(h, name, PARAMS["limit"], PARAMS["alpha"], spec)
    assert_same_bytes(got_a, want_a, (name, m, n))
    assert torch.equal(got_a_inv, want_a_inv)
    *got_dh, got_dh_inv, got_dbias = afp8.activation_backward_fp8(
        dy, h, name, PARAMS["limit"], PARAMS["alpha"], spec
    )
    assert_same_bytes(got_dh, want_dh, (name, m, n))
    assert torch.equal(got_dh_inv, want_dh_inv)
    assert_close_to_scale(got_dbias, want_dbias, torch.bfloat16, msg=str((name, m, n)))


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (False, True), (False, False)])
def test_triton_backward_usage(rowwise, columnwise):
    h, dy = draw("swiglu", 33, 65, torch.bfloat16, device="cuda")
    fp8 = torch.float8_e4m3fn
    out, amax, _, dbias = fused_backward(dy, h, "swiglu", fp8, rowwise, columnwise, "cuda")
    scale, amax_unf = quant_state(fp8, "cuda")
    unf, _, dbias_unf = unfused_backward(dy, h, "swiglu", scale, amax_unf, fp8, rowwise, columnwise)
    assert_same_bytes(out, unf, (rowwise, columnwise))
    assert torch.equal(amax, amax_unf)
    assert_close_to_scale(dbias, dbias_unf, torch.bfloat16)


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("name", NAMES)
def test_triton_one_launch_per_call(name):
    h, dy = draw(name, 16, 4096, torch.bfloat16, device="cuda")
    fp8 = torch.float8_e4m3fn
    scale, amax = quant_state(fp8, "cuda")
    args = (PARAMS["limit"], PARAMS["alpha"], CastSpec(fp8, True, True, scale, amax))

    def forward():
        afp8.activation_forward_fp8(h, name, *args)

    def backward():
        afp8.activation_backward_fp8(dy, h, name, *args)

    forward()  # compile outside the profile
    backward()
    counts = [count_device_ops(forward), count_device_ops(backward)]
    if counts == [0, 0]:
        pytest.skip("the profiler records no GPU activity here")
    assert counts == [1, 1]


@pytest.mark.parametrize(
    "rows,col_blocks,sms",
    [(16, 128, 132), (16384, 256, 132), (70, 1, 1), (1, 1, 132), (4096, 8, 16)],
)
def test_row_split_covers_the_rows_once(rows, col_blocks, sms):
    """Row blocks of whole BLOCK_M steps, none empty, covering every row; a single block
    (dbias written by the kernel itself) where the column blocks fill the GPU or rows are few."""
    block_m = afp8.BACKWARD_FP8_CONFIG[0]
    per, splits = column_sums.row_split(rows, col_blocks, block_m, sms)
    assert per % block_m == 0 and per * (splits - 1) < rows <= per * splits
    steps = -(-rows // block_m)
    assert col_blocks * splits >= min(4 * sms, col_blocks * steps)
    if col_blocks >= 4 * sms or rows <= block_m:
        assert splits == 1


# ----------------------------------------------------------------------------------------------
# The Triton kernels under Triton's CPU interpreter (where triton is installed)
# ----------------------------------------------------------------------------------------------

# Runs in a fresh process: TRITON_INTERPRET must be set before the kernels are defined. The
# launchers run on CPU tensors, with small tiles for several row and column blocks (forward)
# and several row steps (backward). The fused bytes are checked exactly against the unfused
# Triton activation kernel run on h in fp32, rounded to h's dtype by torch, then quantized by
# the reference: the interpreter's own fp32 -> bf16 cast truncates, which the fused kernels'
# integer rounding does not rely on.
INTERPRETER_SCRIPT = """
import torch
from tolerances import assert_close, assert_close_to_scale
from torchte.kernels import activation as act
from torchte.kernels import activation_fp8 as afp8
from torchte.kernels import cast_transpose as ct
from torchte.kernels.cast_spec import CastSpec

LIMIT, ALPHA = 7.0, 1.702
EXACT = {"relu", "reglu", "srelu", "sreglu"}
SCALE_OF = {torch.float8_e4m3fn: 56.0, torch.float8_e5m2: 7168.0}

def state(fp8):
    return torch.tensor([SCALE_OF[fp8]]), torch.tensor([0.25])

def same(got, want, where):
    for g, w in zip(got, want):
        assert (g is None) == (w is None), where
        if g is not None:
            assert g.shape == w.shape and g.dtype == w.dtype, where
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), where

def near(got, want, name, fp8, where):
    # Exact bytes where the activation has no exp, else within one FP8 step.
    if name in EXACT:
        return same(got, want, where)
    for g, w in zip(got, want):
        if g is not None:
            assert_close(g.float(), w.float(), fp8, msg=str(where))

def check(h, dy, name, fp8, configs, usage=(True, True)):
    kind, gated = act._SPECS[name]
    n = dy.shape[1]
    where = (name, tuple(h.shape), h.dtype, fp8, configs, usage)
    fwd_config, bwd_config = configs
    # Forward.
    scale, amax = state(fp8)
    *out, scale_inv = afp8._forward_fp8_triton(h, n, kind, gated, LIMIT, ALPHA,
                                               CastSpec(fp8, True, usage[1], scale, amax),
                                               fwd_config)
    a = act._forward_triton(h.float(), name, LIMIT, ALPHA).to(h.dtype)
    _, amax_unf = state(fp8)
    *unf, scale_inv_unf = ct.quantize_reference(a, CastSpec(fp8, True, usage[1], scale, amax_unf))
    same(out, unf, where)
    assert torch.equal(amax, amax_unf) and torch.equal(scale_inv, scale_inv_unf), where
    _, amax_ref = state(fp8)
    *ref, _ = afp8.activation_forward_fp8_reference(h, name, LIMIT, ALPHA,
                                                    CastSpec(fp8, True, usage[1], scale, amax_ref))
    near(out, ref, name, fp8, where)
    assert_close(amax, amax_ref, h.dtype, msg=str(where))
    # Backward.
    scale, amax = state(fp8)
    *out, scale_inv, dbias = afp8._backward_fp8_triton(dy, h, n, kind, gated, LIMIT, ALPHA,
                                                       CastSpec(fp8, *usage, scale, amax),
                                                       bwd_config)
    dh = act._backward_triton(dy.float(), h.float(), name, LIMIT, ALPHA).to(h.dtype)
    _, amax_unf = state(fp8)
    *unf, scale_inv_unf = ct.quantize_reference(dh, CastSpec(fp8, *usage, scale, amax_unf))
    same(out, unf, where)
    assert torch.equal(amax, amax_unf) and torch.equal(scale_inv, scale_inv_unf), where
    assert dbias.dtype == dy.dtype and dbias.shape == (h.shape[1],), where
    assert_close_to_scale(dbias, dh.sum(0).to(dy.dtype), h.dtype, msg=str(where))
    _, amax_ref = state(fp8)
    *ref, _, dbias_ref = afp8.activation_backward_fp8_reference(
        dy, h, name, LIMIT, ALPHA, CastSpec(fp8, *usage, scale, amax_ref))
    near(out, ref, name, fp8, where)
    assert_close(amax, amax_ref, h.dtype, msg=str(where))
    assert_close_to_scale(dbias, dbias_ref, h.dtype, msg=str(where))

def draw(name, m, n, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    k = 2 * n if act.is_gated(name) else n
    h = torch.randn((m, k), generator=gen) * 3
    h.view(-1)[::7] *= 1e-3
    h.view(-1)[::13] *= 30
    dy = torch.randn((m, n), generator=gen) * 2
    return h.to(dtype), dy.to(dtype)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# (M, N) with (forward tile, backward tile): one block; odd M and N over several blocks and
# row steps (17 rows: padding to 32 in the columnwise data); M past two backward steps.
CASES = [((1, 1), ((16, 16, 4), (16, 16, 4))), ((17, 40), ((16, 32, 4), (16, 16, 4))),
         ((33, 20), ((32, 16, 4), (32, 16, 4))), ((70, 9), ((16, 16, 4), (32, 16, 4)))]
for i, name in enumerate(act.ACTIVATIONS):
    for j, dtype in enumerate(DTYPES):
        for (m, n), configs in CASES:
            fp8 = FP8[(i + j + m) % 2]
            check(*draw(name, m, n, dtype, seed=i * 100 + j * 10 + m), name, fp8, configs)
# The default configs, dy in another dtype than h, and every usage of the backward.
h, dy = draw("swiglu", 19, 48, torch.bfloat16, seed=1)
defaults = (afp8.FORWARD_FP8_CONFIG, afp8.BACKWARD_FP8_CONFIG)
check(h, dy.float(), "swiglu", torch.float8_e4m3fn, defaults)
for usage in [(True, False), (False, True), (False, False)]:
    check(h, dy, "swiglu", torch.float8_e5m2, ((16, 16, 4), (16, 16, 4)), usage)
# Current scaling (no scale given): the amax pass, then the fused kernels with its scale; the
# bytes and scale_inv of the unfused values cast by the reference under current scaling.
def check_current(h, dy, name, fp8, configs, power_2):
    kind, gated = act._SPECS[name]
    n = dy.shape[1]
    where = ("current", name, tuple(h.shape), h.dtype, fp8, configs, power_2)
    spec = CastSpec(fp8, True, True, amax_epsilon=0.0, power_2_scale=power_2)
    *out, scale_inv = afp8._forward_fp8_triton(h, n, kind, gated, LIMIT, ALPHA, spec, configs[0])
    a = act._forward_triton(h.float(), name, LIMIT, ALPHA).to(h.dtype)
    *want, want_inv = ct.quantize_reference(a, spec)
    same(out, want, where)
    assert torch.equal(scale_inv, want_inv), where
    *out, scale_inv, dbias = afp8._backward_fp8_triton(dy, h, n, kind, gated, LIMIT, ALPHA,
                                                       spec, configs[1])
    dh = act._backward_triton(dy.float(), h.float(), name, LIMIT, ALPHA).to(h.dtype)
    *want, want_inv = ct.quantize_reference(dh, spec)
    same(out, want, where)
    assert torch.equal(scale_inv, want_inv), where
    assert_close_to_scale(dbias, dh.sum(0).to(dy.dtype), h.dtype, msg=str(where))

for i, name in enumerate(["gelu", "swiglu", "srelu", "clamped_swiglu"]):
    for (m, n), configs in CASES[1:]:
        check_current(*draw(name, m, n, torch.bfloat16, seed=500 + i + m), name, FP8[i % 2],
                      configs, power_2=bool(i % 2))
# Huge inputs (saturating FP8, x^3 overflowing fp32) and clamped_swiglu around its limit.
huge = torch.tensor([1e30, -1e30, 1e20, -1e20, 100.0, -100.0, 0.0, 1.0, 7.0, 7.5, -7.5, -7.0])
for name in ["gelu", "qgelu", "silu", "srelu", "geglu", "glu", "swiglu", "clamped_swiglu"]:
    h = huge[:, None] if not act.is_gated(name) else torch.stack([huge, huge.flip(0)], 1)
    check(h, torch.ones((12, 1)), name, torch.float8_e4m3fn, ((16, 16, 4), (16, 16, 4)))
print("ok")
"""


@requires_interpreter
def test_triton_kernels_in_interpreter_match_reference():
    run_under_interpreter(INTERPRETER_SCRIPT)
