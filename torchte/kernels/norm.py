"""LayerNorm and RMSNorm, forward and backward: Triton kernels and their torch reference.

Shapes: x, dy, y, dx (M, N) contiguous, fp32 / bf16 / fp16 (y and dx in x's dtype); weight,
bias (N,) in the parameters' dtype, which may differ from x's (fp32 parameters, bf16 x);
dweight, dbias (N,) in the weight's dtype; mean, rstd (M,) fp32. All math in fp32:

    LayerNorm  y = (x - mean) * rstd * g + b,  rstd = 1 / sqrt(var + eps), biased variance
    RMSNorm    y = x * rstd * g,               rstd = 1 / sqrt(mean(x^2) + eps)

with g = 1 + weight under zero_centered_gamma (Transformer Engine's convention), else weight.
Backward, with xhat = (x - mean) * rstd (LayerNorm) or x * rstd (RMSNorm):

    dx = rstd * (g dy - xhat * mean(g dy xhat) - mean(g dy))   (RMSNorm: no last term)
    dweight = sum over rows of dy * xhat,  dbias = sum over rows of dy

On CUDA with Triton the kernels of norm_triton.py run; elsewhere the torch reference below. M == 0
also takes the reference: empty outputs, zero gradients (one fill each on CUDA).

Launches per call: forward 1; backward 2 (the row kernel writes dx and each program's partial
dweight/dbias sums, over the rows it owns, into a (P, N) fp32 buffer; a second kernel sums
that buffer over P in a fixed order, so the gradients are the same run to run, no atomics).

A row of up to FWD_MAX_BLOCK_N (forward) or BWD_MAX_BLOCK_N (backward) elements is held in
registers and read once; a longer row is walked in chunks of that size, read twice (statistics
first, then the outputs). The forward combines the chunks' means and centered sums of squares
with Chan's pairwise formula, so the variance is never taken as E[x^2] - E[x]^2.
"""

from __future__ import annotations

import functools

import torch

from ._compile import compiled_as_op
from ._triton import FastLaunch, int_key, sm_count, triton_available

# A program handles blocks of BLOCK_M rows x BLOCK_N columns, BLOCK_M * BLOCK_N about *_TILE
# elements when rows are short, *_ELEMS_PER_THREAD of them per thread (which sets num_warps);
# P programs (*_PROGRAMS_PER_SM per SM, fewer when there are fewer row blocks) each own row
# blocks p, p + P, ... . The forward over-subscribes the SMs (extra programs queue) and loads
# weight and bias with each row block (cache hits; holding them for the whole loop costs the
# registers that let more rows be in flight). The backward's P sets the size of its
# partial-sum buffer; for rows of WIDE_ROW elements or more it takes one program per SM and
# lets Triton pipeline the row loads through shared memory (num_stages of its loop).
# Reduction of the partial sums: (BLOCK_P, BLOCK_N, num_warps). Tuned by the sweep in
# benchmarks/norm.py on an H200 at 8192 rows x 1024/4096/8192 bf16 (docs/benchmarks.md).
FWD_TILE = 8192
FWD_ELEMS_PER_THREAD = 64
FWD_MAX_BLOCK_N = 16384
FWD_PROGRAMS_PER_SM = 16
FWD_STAGES = 1
BWD_TILE = 4096
BWD_ELEMS_PER_THREAD = 16
BWD_MAX_BLOCK_N = 8192
BWD_PROGRAMS_PER_SM = 2
BWD_STAGES = 1
WIDE_ROW = 4096
BWD_WIDE = (8192, 1, 3)  # (tile, programs per SM, stages) for rows of WIDE_ROW or more
REDUCE_CONFIG = (32, 64, 4)

try:
    from .norm_triton import _norm_bwd_kernel, _norm_fwd_kernel, _reduce_partials_kernel
except ImportError:  # CPU-only installs: the torch reference runs
    _norm_fwd_kernel = None

# ----------------------------------------------------------------------------------------------
# Public functions: Triton on CUDA, the torch reference elsewhere
# ----------------------------------------------------------------------------------------------


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and x.shape[0] > 0 and triton_available()


@compiled_as_op(
    "(Tensor x, Tensor weight, Tensor? bias, float eps, bool zero_centered_gamma) -> "
    "(Tensor, Tensor, Tensor)"
)
def layernorm_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    zero_centered_gamma: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm of x (M, N) over N: (y (M, N) in x's dtype, mean (M,) fp32, rstd (M,) fp32).
    weight, bias (N,) in the parameters' dtype; bias may be None."""
    if _use_triton(x):
        return _forward(x, weight, bias, eps, zero_centered_gamma, False)
    return layernorm_forward_reference(x, weight, bias, eps, zero_centered_gamma)


@compiled_as_op(
    "(Tensor dy, Tensor x, Tensor weight, Tensor mean, Tensor rstd, bool "
    "zero_centered_gamma, *, bool has_bias=True) -> (Tensor, Tensor, Tensor)"
)
def layernorm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    zero_centered_gamma: bool,
    *,
    has_bias: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """LayerNorm backward: (dx (M, N) in x's dtype, dweight (N,), dbias (N,) or None when not
    has_bias), the gradients in the weight's dtype. dy, x (M, N); mean, rstd (M,) fp32 from
    layernorm_forward."""
    if _use_triton(x):
        return _backward(dy, x, weight, mean, rstd, zero_centered_gamma, False, has_bias)
    return layernorm_backward_reference(
        dy, x, weight, mean, rstd, zero_centered_gamma, has_bias=has_bias
    )


@compiled_as_op(
    "(Tensor x, Tensor weight, float eps, bool zero_centered_gamma) -> (Tensor, Tensor)"
)
def rmsnorm_forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x (M, N) over N: (y (M, N) in x's dtype, rstd (M,) fp32); weight (N,)."""
    if _use_triton(x):
        y, _, rstd = _forward(x, weight, None, eps, zero_centered_gamma, True)
        return y, rstd
    return rmsnorm_forward_reference(x, weight, eps, zero_centered_gamma)


@compiled_as_op(
    "(Tensor dy, Tensor x, Tensor weight, Tensor rstd, bool zero_centered_gamma) -> "
    "(Tensor, Tensor)"
)
def rmsnorm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    zero_centered_gamma: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm backward: (dx (M, N) in x's dtype, dweight (N,) in the weight's dtype)."""
    if _use_triton(x):
        dx, dw, _ = _backward(dy, x, weight, rstd, rstd, zero_centered_gamma, True, False)
        return dx, dw
    return rmsnorm_backward_reference(dy, x, weight, rstd, zero_centered_gamma)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


if _norm_fwd_kernel is not None:
    _launch_fwd = FastLaunch(_norm_fwd_kernel)
    _launch_bwd = FastLaunch(_norm_bwd_kernel)
    _launch_reduce = FastLaunch(_reduce_partials_kernel)


@functools.lru_cache(maxsize=1024)
def row_config(
    rows: int, cols: int, max_block_n: int, tile: int, elems_per_thread: int = 16
) -> tuple[int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, num_warps, chunked) for rows of `cols` elements: the whole row in one
    block up to max_block_n (else chunks of max_block_n), and several short rows per block, up
    to `tile` elements; about elems_per_thread fp32 values per thread."""
    block_n = max(16, 1 << (cols - 1).bit_length())
    chunked = block_n > max_block_n
    block_n = min(block_n, max_block_n)
    block_m = max(1, min(tile // block_n, 1 << (rows - 1).bit_length()))
    num_warps = min(max(block_m * block_n // (32 * elems_per_thread), 1), 16)
    return block_m, block_n, num_warps, chunked


@functools.lru_cache(maxsize=1024)
def forward_launch(rows: int, cols: int, sms: int) -> tuple[tuple[int, int, int, bool], int]:
    """(config, programs) of the forward kernel for an (rows, cols) input on `sms` SMs."""
    config = row_config(rows, cols, FWD_MAX_BLOCK_N, FWD_TILE, FWD_ELEMS_PER_THREAD)
    return config, min(-(-rows // config[0]), sms * FWD_PROGRAMS_PER_SM)


def _backward_scheme(cols: int) -> tuple[int, int, int]:
    """(tile, programs per SM, stages) of the backward for rows of `cols` elements."""
    return BWD_WIDE if cols >= WIDE_ROW else (BWD_TILE, BWD_PROGRAMS_PER_SM, BWD_STAGES)


@functools.lru_cache(maxsize=1024)
def backward_launch(rows: int, cols: int, sms: int) -> tuple[tuple[int, int, int, bool], int, int]:
    """(config, programs, stages) of the backward kernel for (rows, cols) on `sms` SMs."""
    tile, per_sm, stages = _backward_scheme(cols)
    config = row_config(rows, cols, BWD_MAX_BLOCK_N, tile, BWD_ELEMS_PER_THREAD)
    return config, min(-(-rows // config[0]), sms * per_sm), stages


def _forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    zero_centered_gamma: bool,
    rms: bool,
    config: tuple[int, int, int, bool] | None = None,
    num_programs: int | None = None,
    stages: int = FWD_STAGES,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Launch _norm_fwd_kernel on x (M, N), M > 0: (y, mean (None for RMS), rstd). config,
    num_programs (before capping at the row-block count) and stages override the defaults
    (tests, benchmark sweeps)."""
    if not x.is_contiguous():
        x = x.contiguous()
    rows, cols = x.shape
    if config is None and num_programs is None:
        config, programs = forward_launch(rows, cols, sm_count(x.get_device()))
    else:
        config = config or forward_launch(rows, cols, 1)[0]
        if num_programs is None:
            num_programs = sm_count(x.get_device()) * FWD_PROGRAMS_PER_SM
        programs = min(-(-rows // config[0]), num_programs)
    block_m, block_n, num_warps, chunked = config
    device = x.device
    y = torch.empty(rows, cols, dtype=x.dtype, device=device)
    rstd = torch.empty(rows, dtype=torch.float32, device=device)
    mean = None if rms else torch.empty(rows, dtype=torch.float32, device=device)
    # Arguments not read (no bias; mean under RMS) get any pointer: never dereferenced.
    b = weight if bias is None else bias
    m = rstd if mean is None else mean
    key = (
        x.dtype, weight.dtype, b.dtype, rms, bias is not None, zero_centered_gamma, config,
        stages, *int_key(rows), *int_key(cols), x.data_ptr() & 15, weight.data_ptr() & 15,
        b.data_ptr() & 15, y.data_ptr() & 15, m.data_ptr() & 15, rstd.data_ptr() & 15,
    )  # fmt: skip
    _launch_fwd(
        key, (programs, 1, 1), num_warps, x, weight, b, y, m, rstd, rows, cols, float(eps),
        rms, bias is not None, zero_centered_gamma, block_m, block_n, chunked, stages,
    )  # fmt: skip
    return y, mean, rstd


def _backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    zero_centered_gamma: bool,
    rms: bool,
    has_bias: bool,
    config: tuple[int, int, int, bool] | None = None,
    num_programs: int | None = None,
    reduce_config: tuple[int, int, int] = REDUCE_CONFIG,
    stages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Launch _norm_bwd_kernel and _reduce_partials_kernel on x, dy (M, N), M > 0:
    (dx, dweight, dbias or None). mean is not read under RMS (pass rstd). config,
    num_programs (before capping at the row-block count), reduce_config and stages override
    the defaults (tests, benchmark sweeps)."""
    if not x.is_contiguous():
        x = x.contiguous()
    if not dy.is_contiguous():
        dy = dy.contiguous()
    rows, cols = x.shape
    if config is None and num_programs is None:
        config, programs, default_stages = backward_launch(rows, cols, sm_count(x.get_device()))
    else:
        default_config, _, default_stages = backward_launch(rows, cols, 1)
        config = config or default_config
        if num_programs is None:
            num_programs = sm_count(x.get_device()) * _backward_scheme(cols)[1]
        # Every program owns at least one row block, so every row of the partials is written.
        programs = min(-(-rows // config[0]), num_programs)
    stages = default_stages if stages is None else stages
    block_m, block_n, num_warps, chunked = config
    device = x.device
    dx = torch.empty(rows, cols, dtype=x.dtype, device=device)
    part = torch.empty(2 if has_bias else 1, programs, cols, dtype=torch.float32, device=device)
    dw = torch.empty(cols, dtype=weight.dtype, device=device)
    db = torch.empty(cols, dtype=weight.dtype, device=device) if has_bias else None
    key = (
        dy.dtype, x.dtype, weight.dtype, rms, has_bias, zero_centered_gamma, config, stages,
        *int_key(rows), *int_key(cols), dy.data_ptr() & 15, x.data_ptr() & 15,
        weight.data_ptr() & 15, mean.data_ptr() & 15, rstd.data_ptr() & 15, dx.data_ptr() & 15,
        part.data_ptr() & 15,
    )  # fmt: skip
    _launch_bwd(
        key, (programs, 1, 1), num_warps, dy, x, weight, mean, rstd, dx, part, rows, cols,
        rms, has_bias, zero_centered_gamma, block_m, block_n, chunked, stages,
    )  # fmt: skip
    block_p, block_c, reduce_warps = reduce_config
    b = dw if db is None else db
    key = (
        weight.dtype, has_bias, reduce_config, *int_key(programs), *int_key(cols),
        part.data_ptr() & 15, dw.data_ptr() & 15, b.data_ptr() & 15,
    )  # fmt: skip
    _launch_reduce(
        key, ((cols + block_c - 1) // block_c, 1, 1), reduce_warps, part, dw, b, programs, cols,
        has_bias, block_p, block_c,
    )  # fmt: skip
    return dx, dw, db


# ----------------------------------------------------------------------------------------------
# Torch reference: the same functions, used on CPU, for M == 0 and in tests
# ----------------------------------------------------------------------------------------------


def _gamma_reference(weight: torch.Tensor, zero_centered_gamma: bool) -> torch.Tensor:
    g = weight.float()
    return g + 1.0 if zero_centered_gamma else g


def _rstd_reference(var: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.reciprocal(torch.sqrt(var + eps))


def layernorm_forward_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    zero_centered_gamma: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of layernorm_forward."""
    x32 = x.float()
    mean = x32.mean(dim=1)
    xc = x32 - mean[:, None]
    rstd = _rstd_reference((xc * xc).mean(dim=1), eps)
    y = xc * rstd[:, None] * _gamma_reference(weight, zero_centered_gamma)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype), mean, rstd


def layernorm_backward_reference(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    zero_centered_gamma: bool,
    *,
    has_bias: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Torch reference of layernorm_backward."""
    dy32 = dy.float()
    xhat = (x.float() - mean[:, None]) * rstd[:, None]
    gdy = dy32 * _gamma_reference(weight, zero_centered_gamma)
    c1 = (xhat * gdy).mean(dim=1, keepdim=True)
    c2 = gdy.mean(dim=1, keepdim=True)
    dx = (gdy - (xhat * c1 + c2)) * rstd[:, None]
    dw = (dy32 * xhat).sum(dim=0).to(weight.dtype)
    db = dy32.sum(dim=0).to(weight.dtype) if has_bias else None
    return dx.to(x.dtype), dw, db


def rmsnorm_forward_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of rmsnorm_forward."""
    x32 = x.float()
    rstd = _rstd_reference((x32 * x32).mean(dim=1), eps)
    y = x32 * rstd[:, None] * _gamma_reference(weight, zero_centered_gamma)
    return y.to(x.dtype), rstd


def rmsnorm_backward_reference(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    zero_centered_gamma: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of rmsnorm_backward."""
    dy32 = dy.float()
    xhat = x.float() * rstd[:, None]
    gdy = dy32 * _gamma_reference(weight, zero_centered_gamma)
    c1 = (xhat * gdy).mean(dim=1, keepdim=True)
    dx = (gdy - xhat * c1) * rstd[:, None]
    return dx.to(x.dtype), (dy32 * xhat).sum(dim=0).to(weight.dtype)
