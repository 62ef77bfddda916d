"""LayerNorm and RMSNorm kernels: the torch reference against an fp64 model (CPU), the Triton
kernels under Triton's interpreter (CPU, a subprocess), and on the GPU against the reference,
with determinism and launch counts.

The fp64 model is torch autograd through F.layer_norm (LayerNorm) or the RMSNorm formula, in
float64, so it shares no code with the reference. Inputs are exactly representable in their
dtypes (tolerances.representable), so the model sees the very values the kernels read.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from interpreter import requires_interpreter, run_under_interpreter
from tolerances import assert_close, representable, tolerance

from torchte.kernels import norm
from torchte.kernels._triton import triton_available

pytestmark = pytest.mark.usefixtures("cpu_default_device")

EPS = 1e-5
SHAPES = [(1, 1), (3, 17), (17, 1023), (127, 4096)]
# (x dtype, parameters' dtype): alike, and mixed as under autocast (fp32 parameters).
DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.float32, torch.bfloat16),
]
KINDS = ["layernorm", "rmsnorm"]

requires_triton = pytest.mark.skipif(not triton_available(), reason="needs a CUDA GPU and Triton")


# ----------------------------------------------------------------------------------------------
# Inputs, the fp64 model, and one call of either norm
# ----------------------------------------------------------------------------------------------


def make_inputs(shape, x_dtype, w_dtype, zero_centered, device="cpu", seed=0):
    """(x, dy, weight, bias), each exactly representable in its dtype."""
    gen = torch.Generator().manual_seed(seed)
    cols = shape[1]
    x = representable(shape, x_dtype, scale=2.0, generator=gen) + 0.25
    dy = representable(shape, x_dtype, generator=gen)
    w = representable(cols, w_dtype, scale=0.25 if zero_centered else 1.0, generator=gen)
    b = representable(cols, w_dtype, generator=gen)
    return (
        x.to(device, x_dtype),
        dy.to(device, x_dtype),
        w.to(device, w_dtype),
        b.to(device, w_dtype),
    )


def model(kind, x, dy, w, b, zero_centered):
    """fp64 (y, stats, dx, dw, db) by autograd; stats = (mean, rstd) or (rstd,)."""
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    b64 = b.double().requires_grad_() if b is not None else None
    g = 1.0 + w64 if zero_centered else w64
    if kind == "layernorm":
        y = F.layer_norm(x64, (x.shape[1],), g, b64, EPS)
        mean = x64.detach().mean(1)
        var = (x64.detach() - mean[:, None]).square().mean(1)
        stats = (mean, (var + EPS).rsqrt())
    else:
        rstd = (x64.square().mean(1, keepdim=True) + EPS).rsqrt()
        y = x64 * rstd * g
        stats = (rstd.detach()[:, 0],)
    y.backward(dy.double())
    return y.detach(), stats, x64.grad, w64.grad, (b64.grad if b64 is not None else None)


def run_reference(kind, x, dy, w, b, zero_centered):
    """(y, stats, dx, dw, db) of the torch reference functions."""
    if kind == "layernorm":
        y, mean, rstd = norm.layernorm_forward_reference(x, w, b, EPS, zero_centered)
        dx, dw, db = norm.layernorm_backward_reference(
            dy, x, w, mean, rstd, zero_centered, has_bias=b is not None
        )
        return y, (mean, rstd), dx, dw, db
    y, rstd = norm.rmsnorm_forward_reference(x, w, EPS, zero_centered)
    dx, dw = norm.rmsnorm_backward_reference(dy, x, w, rstd, zero_centered)
    return y, (rstd,), dx, dw, None


def run_public(kind, x, dy, w, b, zero_centered):
    """(y, stats, dx, dw, db) of the public functions (Triton on CUDA)."""
    if kind == "layernorm":
        y, mean, rstd = norm.layernorm_forward(x, w, b, EPS, zero_centered)
        dx, dw, db = norm.layernorm_backward(
            dy, x, w, mean, rstd, zero_centered, has_bias=b is not None
        )
        return y, (mean, rstd), dx, dw, db
    y, rstd = norm.rmsnorm_forward(x, w, EPS, zero_centered)
    dx, dw = norm.rmsnorm_backward(dy, x, w, rstd, zero_centered)
    return y, (rstd,), dx, dw, None


def check_against(got, want, x_dtype, w_dtype, reduction_bound=None):
    """Outputs `got` against `want`: y, dx by x's dtype, stats by fp32, dw, db by the weight's
    dtype (or within reduction_bound's per-column bounds, see assert_reduction_close)."""
    y, stats, dx, dw, db = got
    y_w, stats_w, dx_w, dw_w, db_w = want
    assert y.dtype == dx.dtype == x_dtype and y.shape == dx.shape == y_w.shape
    assert dw.dtype == w_dtype and dw.shape == dw_w.shape
    assert all(s.dtype == torch.float32 and s.shape == (y.shape[0],) for s in stats)
    assert_close(y, y_w, x_dtype, "y")
    for s, s_w in zip(stats, stats_w, strict=True):
        assert_close(s, s_w, torch.float32, "mean / rstd")
    assert_close(dx, dx_w, x_dtype, "dx")
    grads = [(dw, dw_w, 0)] + ([(db, db_w, 1)] if db_w is not None else [])
    assert (db is None) == (db_w is None)
    for got_g, want_g, i in grads:
        assert got_g.dtype == w_dtype
        if reduction_bound is None:
            assert_close(got_g, want_g, w_dtype, "dweight / dbias")
        else:
            assert_reduction_close(got_g, want_g, reduction_bound[i], w_dtype)


def assert_reduction_close(actual, expected, abs_sum, dtype):
    """|actual - expected| <= atol + rtol * abs_sum per column: the bound for two sums of the
    same terms taken in different orders (abs_sum = the sum of the terms' magnitudes)."""
    rtol, atol = tolerance(dtype)
    diff = (actual.double().cpu() - expected.double().cpu()).abs()
    bound = atol + rtol * abs_sum.double().cpu()
    worst = (diff - bound).max().item() if diff.numel() else 0.0
    assert worst <= 0, f"reduction differs beyond rtol * sum|terms| + atol by {worst:.3g}"


# ----------------------------------------------------------------------------------------------
# The torch reference against the fp64 model (CPU)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("x_dtype,w_dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_reference_matches_fp64_model(kind, zero_centered, x_dtype, w_dtype, shape):
    x, dy, w, b = make_inputs(shape, x_dtype, w_dtype, zero_centered, seed=sum(shape))
    b = b if kind == "layernorm" else None
    got = run_public(kind, x, dy, w, b, zero_centered)  # the reference, on the CPU
    check_against(got, model(kind, x, dy, w, b, zero_centered), x_dtype, w_dtype)


def test_layernorm_without_bias():
    x, dy, w, _ = make_inputs((5, 33), torch.float32, torch.float32, False)
    got = run_public("layernorm", x, dy, w, None, False)
    assert got[4] is None
    check_against(got, model("layernorm", x, dy, w, None, False), torch.float32, torch.float32)


@pytest.mark.parametrize("kind", KINDS)
def test_zero_rows(kind):
    x, dy, w, b = make_inputs((0, 19), torch.bfloat16, torch.float32, False)
    y, stats, dx, dw, db = run_public(kind, x, dy, w, b if kind == "layernorm" else None, False)
    assert y.shape == dx.shape == (0, 19) and y.dtype == dx.dtype == torch.bfloat16
    assert all(s.shape == (0,) for s in stats)
    assert dw.dtype == torch.float32 and torch.equal(dw, torch.zeros(19))
    if kind == "layernorm":
        assert torch.equal(db, torch.zeros(19))


def test_row_config():
    # Short rows share a block; a long row is one block up to the limit, then chunks.
    assert norm.row_config(16, 1024, 16384, 4096) == (4, 1024, 8, False)
    assert norm.row_config(3, 1024, 16384, 4096) == (4, 1024, 8, False)
    assert norm.row_config(8192, 4096, 16384, 4096) == (1, 4096, 8, False)
    assert norm.row_config(1, 1, 16384, 4096) == (1, 16, 1, False)
    assert norm.row_config(64, 16384, norm.FWD_MAX_BLOCK_N, 4096)[3] is False
    assert norm.row_config(64, 16384, norm.BWD_MAX_BLOCK_N, 4096)[1:] == (8192, 16, True)
    assert norm.row_config(4, 65536, norm.FWD_MAX_BLOCK_N, 4096) == (1, 16384, 16, True)
    # More values per thread, fewer warps.
    assert norm.row_config(8192, 4096, 16384, 8192, 64) == (2, 4096, 4, False)
    assert norm.row_config(8192, 1024, 16384, 8192, 64) == (8, 1024, 4, False)


def test_launch_configs():
    # Forward: 2 rows x 4096 per program step, 4 warps, 16 programs per SM (capped at the
    # row-block count).
    assert norm.forward_launch(8192, 4096, 132) == ((2, 4096, 4, False), 2112)
    assert norm.forward_launch(6, 4096, 132) == ((2, 4096, 4, False), 3)
    # Backward: wide rows take one program per SM and a 3-stage pipelined loop; narrow rows
    # two programs per SM, no pipelining.
    assert norm.backward_launch(8192, 4096, 132) == ((2, 4096, 16, False), 132, 3)
    assert norm.backward_launch(8192, 1024, 132) == ((4, 1024, 8, False), 264, 1)
    assert norm.backward_launch(5, 8192, 132) == ((1, 8192, 16, False), 5, 3)
    assert norm.backward_launch(64, 20000, 132)[0][3] is True


# ----------------------------------------------------------------------------------------------
# The Triton kernels under Triton's interpreter (CPU)
# ----------------------------------------------------------------------------------------------

# Runs in a fresh process: TRITON_INTERPRET must be set before the kernels are defined.
INTERPRETER_SCRIPT = """
import itertools
import torch

from torchte.kernels import norm

EPS = 1e-5

def close(got, want, tol, what):
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape)
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol,
                               msg=lambda m: f"{what}: {m}")

def check(rows, cols, x_dtype, w_dtype, rms, zc, has_bias, fwd=None, bwd=None, programs=3):
    x = (torch.randn(rows, cols) * 2 + 0.5).to(x_dtype)
    dy = torch.randn(rows, cols).to(x_dtype)
    w = (torch.randn(cols) * (0.1 if zc else 1.0)).to(w_dtype)
    has_bias = has_bias and not rms
    b = torch.randn(cols).to(w_dtype) if has_bias else None
    tol = 1e-5 if x_dtype == torch.float32 else 2e-2
    wtol = (1e-5 if w_dtype == torch.float32 else 2e-2) * max(1.0, rows ** 0.5)
    if rms:
        y, rstd = norm.rmsnorm_forward_reference(x, w, EPS, zc)
        dx, dw = norm.rmsnorm_backward_reference(dy, x, w, rstd, zc)
        mean, db = rstd, None
    else:
        y, mean, rstd = norm.layernorm_forward_reference(x, w, b, EPS, zc)
        dx, dw, db = norm.layernorm_backward_reference(dy, x, w, mean, rstd, zc,
                                                       has_bias=has_bias)
    y2, mean2, rstd2 = norm._forward(x, w, b, EPS, zc, rms, fwd, programs)
    assert (mean2 is None) == rms
    close(y2, y, tol, "y"); close(rstd2, rstd, 1e-5, "rstd")
    if not rms:
        close(mean2, mean, 1e-5, "mean")
    dx2, dw2, db2 = norm._backward(dy, x, w, mean, rstd, zc, rms, has_bias, bwd, programs,
                                   (4, 16, 1))
    close(dx2, dx, tol, "dx"); close(dw2, dw, wtol, "dw")
    assert (db2 is None) == (db is None)
    if db is not None:
        close(db2, db, wtol, "db")

torch.manual_seed(0)
for rms, zc in itertools.product([False, True], [False, True]):
    # Default configs: one block per row (several rows per block when short); 5 row blocks
    # over 3 programs for (17, 1023), so programs walk more than one block (both kernels).
    for rows, cols in [(1, 1), (3, 17), (17, 130), (17, 1023)]:
        check(rows, cols, torch.float32, torch.float32, rms, zc, True)
    # Chunked rows (N > BLOCK_N, last chunk partial), several row blocks per program, so the
    # backward accumulates into its partial sums.
    check(7, 100, torch.float32, torch.float32, rms, zc, True, (2, 32, 1, True),
          (2, 32, 1, True), 2)
    check(9, 64, torch.float32, torch.float32, rms, zc, True, (4, 32, 1, True),
          (1, 16, 1, True), 4)
    check(5, 50, torch.float32, torch.float32, rms, zc, False, (1, 16, 1, True),
          (4, 16, 1, True), 1)
    # Mixed dtypes, no bias.
    check(9, 37, torch.bfloat16, torch.float32, rms, zc, not zc)
    check(9, 37, torch.float16, torch.bfloat16, rms, zc, False)
    check(6, 40, torch.float32, torch.float16, rms, zc, True)
# Default configs past one block: forward chunks of 16384, backward of 8192.
for rms in [False, True]:
    check(2, 20000, torch.float32, torch.float32, rms, False, not rms, programs=2)
# A large mean next to small deviations: the chunked variance must not cancel.
x = torch.randn(3, 100) * 1e-2 + 1000.0
w = torch.ones(100)
y, mean, rstd = norm.layernorm_forward_reference(x, w, None, EPS, False)
y2, mean2, rstd2 = norm._forward(x, w, None, EPS, False, False, (1, 16, 1, True), 2)
close(rstd2, rstd, 1e-3, "rstd, large mean")
print("ok")
"""


@requires_interpreter
def test_triton_kernels_in_interpreter_match_reference():
    run_under_interpreter(INTERPRETER_SCRIPT)


# ----------------------------------------------------------------------------------------------
# Triton against the reference, determinism, launch counts (GPU)
# ----------------------------------------------------------------------------------------------

# Single blocks of one and several rows, odd and prime sizes, a forward block of 16384 with a
# chunked backward, chunked rows both ways, and enough rows that programs walk several blocks.
GPU_SHAPES = [
    (1, 1),
    (3, 17),
    (17, 1023),
    (127, 4096),
    (1000, 1531),
    (4096, 1024),
    (64, 16384),
    (8, 65536),
    (5, 40009),
]


def reduction_bounds(kind, x, dy, stats):
    """sum over rows of |dy * xhat| and of |dy|, per column, in fp64."""
    x64, dy64 = x.double(), dy.double()
    if kind == "layernorm":
        mean, rstd = stats
        xhat = (x64 - mean.double()[:, None]) * rstd.double()[:, None]
    else:
        xhat = x64 * stats[0].double()[:, None]
    return (dy64 * xhat).abs().sum(0), dy64.abs().sum(0)


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("x_dtype,w_dtype", DTYPES)
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_triton_matches_reference(kind, zero_centered, x_dtype, w_dtype, shape):
    x, dy, w, b = make_inputs(shape, x_dtype, w_dtype, zero_centered, "cuda", sum(shape))
    b = b if kind == "layernorm" else None
    got = run_public(kind, x, dy, w, b, zero_centered)
    want = run_reference(kind, x, dy, w, b, zero_centered)
    check_against(got, want, x_dtype, w_dtype, reduction_bounds(kind, x, dy, want[1]))


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("kind", KINDS)
def test_triton_unaligned_views(kind):
    """Tensors whose addresses are not 16-byte aligned (the launch cache keys on alignment)."""
    rows, cols = 33, 515
    x, dy, w, b = make_inputs((rows, cols), torch.bfloat16, torch.float32, False, "cuda")
    outs = []
    for offset in (0, 1):
        xs = torch.empty(rows * cols + offset, dtype=x.dtype, device="cuda")
        xs[offset:].copy_(x.reshape(-1))
        ws = torch.empty(cols + offset, device="cuda")
        ws[offset:].copy_(w)
        x_view, w_view = xs[offset:].view(rows, cols), ws[offset:]
        b_use = b if kind == "layernorm" else None
        outs.append(run_public(kind, x_view, dy, w_view, b_use, False))
    want = run_reference(kind, x, dy, w, b if kind == "layernorm" else None, False)
    for got in outs:
        check_against(
            got, want, torch.bfloat16, torch.float32, reduction_bounds(kind, x, dy, want[1])
        )


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(4096, 1024), (127, 4096), (64, 65536)])
def test_triton_backward_is_deterministic(kind, shape):
    x, dy, w, b = make_inputs(shape, torch.bfloat16, torch.float32, False, "cuda")
    x = x + torch.randn_like(x)  # values that make summation order matter
    b = b if kind == "layernorm" else None
    first = run_public(kind, x, dy, w, b, False)
    for _ in range(3):
        again = run_public(kind, x, dy, w, b, False)
        for a, c in zip(first[2:], again[2:], strict=True):
            assert (a is None and c is None) or torch.equal(a, c)


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(16, 1024), (8192, 4096), (4, 65536)])
def test_launch_counts(kind, shape):
    from launches import count_device_ops

    x, dy, w, b = make_inputs(shape, torch.bfloat16, torch.bfloat16, False, "cuda")
    if kind == "layernorm":
        fwd = lambda: norm.layernorm_forward(x, w, b, EPS, False)  # noqa: E731
        _, mean, rstd = fwd()
        bwd = lambda: norm.layernorm_backward(dy, x, w, mean, rstd, False)  # noqa: E731
    else:
        fwd = lambda: norm.rmsnorm_forward(x, w, EPS, False)  # noqa: E731
        _, rstd = fwd()
        bwd = lambda: norm.rmsnorm_backward(dy, x, w, rstd, False)  # noqa: E731
    bwd()
    assert count_device_ops(fwd) == 1
    assert count_device_ops(bwd) == 2
