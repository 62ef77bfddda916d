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

On CUDA with Triton the kernels below run; elsewhere the torch reference beside them. M == 0
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

from ._triton import FastLaunch, int_key, sm_count, triton_available

# A program handles blocks of BLOCK_M rows x BLOCK_N columns, BLOCK_M * BLOCK_N about *_TILE
# elements when rows are short; P programs (*_PROGRAMS_PER_SM per SM, fewer when there are
# fewer row blocks) each own row blocks p, p + P, ... . The forward over-subscribes the SMs
# (extra programs queue) and reads weight and bias once per program; the backward's P sets the
# size of its partial-sum buffer. Reduction of the partial sums: (BLOCK_P, BLOCK_N, num_warps).
# Chosen from register budgets (fp32 values per thread), not yet tuned on a GPU:
# benchmarks/norm.py sweeps them.
FWD_TILE = 4096
BWD_TILE = 4096
FWD_MAX_BLOCK_N = 16384
BWD_MAX_BLOCK_N = 8192
FWD_PROGRAMS_PER_SM = 8
BWD_PROGRAMS_PER_SM = 2
REDUCE_CONFIG = (32, 64, 4)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference runs
    triton = None

if triton is not None:

    @triton.jit
    def _gamma(w_ptr, cols, col_in, ZERO_CENTERED: tl.constexpr):
        """g (BLOCK_N,) fp32 from weight columns `cols`; 0 past N (1 when zero-centered)."""
        g = tl.load(w_ptr + cols, mask=col_in, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            g = g + 1.0
        return g

    @triton.jit
    def _rstd(var, eps):
        """1 / sqrt(var + eps), both correctly rounded (one value per row: free)."""
        return tl.math.div_rn(tl.full(var.shape, 1.0, tl.float32), tl.sqrt_rn(var + eps))

    @triton.jit
    def _row_stats_chunked(
        x_ptr, row_offs, row_in, N, eps,
        RMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """(mean, rstd), each (BLOCK_M,) fp32, of rows longer than one block."""
        mean = tl.zeros((BLOCK_M,), tl.float32)
        m2 = tl.zeros((BLOCK_M,), tl.float32)  # centered sum of squares (RMS: sum of squares)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = row_in[:, None] & (cols < N)[None, :]
            x = tl.load(x_ptr + row_offs[:, None] + cols[None, :], mask=mask, other=0.0)
            x = x.to(tl.float32)
            if RMS:
                m2 += tl.sum(x * x, axis=1)
            else:
                # Chan et al.: merge this chunk's (count, mean, m2) into the running ones.
                count = tl.minimum(N - start, BLOCK_N) * 1.0
                seen = start * 1.0
                chunk_mean = tl.sum(x, axis=1) / count
                d = tl.where(mask, x - chunk_mean[:, None], 0.0)
                delta = chunk_mean - mean
                total = seen + count
                mean += delta * (count / total)
                m2 += tl.sum(d * d, axis=1) + delta * delta * (seen * count / total)
        n = tl.zeros((BLOCK_M,), tl.float32) + N * 1.0
        return mean, _rstd(tl.math.div_rn(m2, n), eps)

    @triton.jit
    def _tile_mean_var(x, mask, n, RMS: tl.constexpr):
        """(mean, biased variance) (BLOCK_M,) fp32 of the rows of the whole-row tile x (BLOCK_M,
        BLOCK_N) fp32, masked entries 0, n the row length as fp32; mean is 0 for RMSNorm, whose
        "variance" is mean(x^2). The fused FP8 norm calls it too, for the same bits."""
        if RMS:
            mean = tl.zeros_like(n)
            var = tl.math.div_rn(tl.sum(x * x, axis=1), n)
        else:
            mean = tl.math.div_rn(tl.sum(x, axis=1), n)
            xc = tl.where(mask, x - mean[:, None], 0.0)
            var = tl.math.div_rn(tl.sum(xc * xc, axis=1), n)
        return mean, var

    @triton.jit
    def _normalize_store(
        x, y_ptr, offs, mask, g, b, mean, rstd, RMS: tl.constexpr, HAS_BIAS: tl.constexpr
    ):
        """Store y for the (BLOCK_M, BLOCK_N) tile x (fp32) at `offs`: the row stats mean,
        rstd (BLOCK_M,), the column scales g and biases b (BLOCK_N,), all fp32."""
        if RMS:
            y = x * rstd[:, None] * g[None, :]
        else:
            y = (x - mean[:, None]) * rstd[:, None] * g[None, :]
        if HAS_BIAS:
            y += b[None, :]
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _bias(b_ptr, cols, col_in, HAS_BIAS: tl.constexpr):
        """b (BLOCK_N,) fp32 from bias columns `cols` (zeros without a bias)."""
        if HAS_BIAS:
            b = tl.load(b_ptr + cols, mask=col_in, other=0.0).to(tl.float32)
        else:
            b = tl.zeros(cols.shape, tl.float32)
        return b

    @triton.jit
    def _norm_fwd_kernel(
        x_ptr,  # (M, N) fp32 / bf16 / fp16, contiguous
        w_ptr,  # (N,) the parameters' dtype
        b_ptr,  # (N,) the parameters' dtype; read when HAS_BIAS
        y_ptr,  # (M, N) x's dtype
        mean_ptr,  # (M,) fp32; written unless RMS
        rstd_ptr,  # (M,) fp32
        M,
        N,
        eps,  # fp32
        RMS: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        ZERO_CENTERED: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        CHUNKED: tl.constexpr,  # N > BLOCK_N: walk each row in chunks
    ):
        """Program p normalizes row blocks p, p + P, ... (P programs): a single-block row's
        weight and bias are read once per program, not once per row."""
        pid = tl.program_id(0)
        num_programs = tl.num_programs(0)
        if CHUNKED:
            for block in range(pid, tl.cdiv(M, BLOCK_M), num_programs):
                rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
                row_in = rows < M
                row_offs = rows.to(tl.int64) * N
                mean, rstd = _row_stats_chunked(
                    x_ptr, row_offs, row_in, N, eps, RMS, BLOCK_M, BLOCK_N
                )
                for start in range(0, N, BLOCK_N):
                    cols = start + tl.arange(0, BLOCK_N)
                    col_in = cols < N
                    mask = row_in[:, None] & col_in[None, :]
                    offs = row_offs[:, None] + cols[None, :]
                    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                    g = _gamma(w_ptr, cols, col_in, ZERO_CENTERED)
                    b = _bias(b_ptr, cols, col_in, HAS_BIAS)
                    _normalize_store(x, y_ptr, offs, mask, g, b, mean, rstd, RMS, HAS_BIAS)
                if not RMS:
                    tl.store(mean_ptr + rows, mean, mask=row_in)
                tl.store(rstd_ptr + rows, rstd, mask=row_in)
        else:
            cols = tl.arange(0, BLOCK_N)
            col_in = cols < N
            g = _gamma(w_ptr, cols, col_in, ZERO_CENTERED)
            b = _bias(b_ptr, cols, col_in, HAS_BIAS)
            n = tl.zeros((BLOCK_M,), tl.float32) + N * 1.0
            for block in range(pid, tl.cdiv(M, BLOCK_M), num_programs):
                rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
                row_in = rows < M
                mask = row_in[:, None] & col_in[None, :]
                offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
                x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                mean, var = _tile_mean_var(x, mask, n, RMS)
                if not RMS:
                    tl.store(mean_ptr + rows, mean, mask=row_in)
                rstd = _rstd(var, eps)
                tl.store(rstd_ptr + rows, rstd, mask=row_in)
                _normalize_store(x, y_ptr, offs, mask, g, b, mean, rstd, RMS, HAS_BIAS)

    @triton.jit
    def _bwd_tile(
        dy_ptr, x_ptr, mean_ptr, rstd_ptr, rows, row_in, cols, col_in, N, g,
        RMS: tl.constexpr,
    ):  # fmt: skip
        """(dy, xhat, g dy, rstd) of one (BLOCK_M, BLOCK_N) tile, fp32; zero outside M x N."""
        mask = row_in[:, None] & col_in[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_in, other=0.0)
        if RMS:
            xhat = x * rstd[:, None]
        else:
            mean = tl.load(mean_ptr + rows, mask=row_in, other=0.0)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        return dy, xhat, dy * g[None, :], rstd

    @triton.jit
    def _dx(xhat, gdy, rstd, c1, c2, RMS: tl.constexpr):
        """dx from the row means c1 = mean(g dy xhat) and c2 = mean(g dy) (unused for RMS)."""
        if RMS:
            dx = (gdy - xhat * c1[:, None]) * rstd[:, None]
        else:
            dx = (gdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        return dx

    @triton.jit
    def _bwd_rows_chunked(
        dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, part_w, part_b, block, accumulate,
        M, N, n,
        RMS: tl.constexpr, HAS_BIAS: tl.constexpr, ZERO_CENTERED: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """Backward of one row block whose rows are longer than BLOCK_N: the row means first,
        then dx and the partial sums chunk by chunk. Partial sums go to this program's own row
        of the buffer, added to what it holds when `accumulate` (not the program's first block).
        """
        # The previous block's partial sums may have been stored by other threads of this
        # program than the ones that read them back below (layouts are the compiler's choice):
        # a CTA barrier orders those global stores before these loads.
        tl.debug_barrier()
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_in = rows < M
        s1 = tl.zeros((BLOCK_M,), tl.float32)
        s2 = tl.zeros((BLOCK_M,), tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_in = cols < N
            g = _gamma(w_ptr, cols, col_in, ZERO_CENTERED)
            dy, xhat, gdy, rstd = _bwd_tile(
                dy_ptr, x_ptr, mean_ptr, rstd_ptr, rows, row_in, cols, col_in, N, g, RMS
            )
            s1 += tl.sum(xhat * gdy, axis=1)
            s2 += tl.sum(gdy, axis=1)
        c1 = tl.math.div_rn(s1, n)
        c2 = tl.math.div_rn(s2, n)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_in = cols < N
            g = _gamma(w_ptr, cols, col_in, ZERO_CENTERED)
            dy, xhat, gdy, rstd = _bwd_tile(
                dy_ptr, x_ptr, mean_ptr, rstd_ptr, rows, row_in, cols, col_in, N, g, RMS
            )
            dx = _dx(xhat, gdy, rstd, c1, c2, RMS)
            offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
            mask = row_in[:, None] & col_in[None, :]
            tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dw = tl.sum(dy * xhat, axis=0)
            dw += tl.load(part_w + cols, mask=col_in & accumulate, other=0.0)
            tl.store(part_w + cols, dw, mask=col_in)
            if HAS_BIAS:
                db = tl.sum(dy, axis=0)
                db += tl.load(part_b + cols, mask=col_in & accumulate, other=0.0)
                tl.store(part_b + cols, db, mask=col_in)

    @triton.jit
    def _norm_bwd_kernel(
        dy_ptr,  # (M, N) fp32 / bf16 / fp16, contiguous
        x_ptr,  # (M, N) fp32 / bf16 / fp16, contiguous
        w_ptr,  # (N,) the parameters' dtype
        mean_ptr,  # (M,) fp32; read unless RMS
        rstd_ptr,  # (M,) fp32
        dx_ptr,  # (M, N) x's dtype
        part_ptr,  # (2 if HAS_BIAS else 1, P, N) fp32: row p = program p's partial dweight
        # (then dbias) sums; P = the number of programs, each owning row blocks p, p + P, ...
        M,
        N,
        RMS: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        ZERO_CENTERED: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        CHUNKED: tl.constexpr,  # N > BLOCK_N: walk each row in chunks
    ):
        pid = tl.program_id(0)
        num_programs = tl.num_programs(0)
        part_w = part_ptr + pid.to(tl.int64) * N
        part_b = part_w + num_programs.to(tl.int64) * N
        n = tl.zeros((BLOCK_M,), tl.float32) + N * 1.0
        if not CHUNKED:
            cols = tl.arange(0, BLOCK_N)
            col_in = cols < N
            g = _gamma(w_ptr, cols, col_in, ZERO_CENTERED)
            dw = tl.zeros((BLOCK_N,), tl.float32)
            db = tl.zeros((BLOCK_N,), tl.float32)
            for block in range(pid, tl.cdiv(M, BLOCK_M), num_programs):
                rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
                row_in = rows < M
                dy, xhat, gdy, rstd = _bwd_tile(
                    dy_ptr, x_ptr, mean_ptr, rstd_ptr, rows, row_in, cols, col_in, N, g, RMS
                )
                c1 = tl.math.div_rn(tl.sum(xhat * gdy, axis=1), n)
                c2 = tl.math.div_rn(tl.sum(gdy, axis=1), n)
                dx = _dx(xhat, gdy, rstd, c1, c2, RMS)
                offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
                mask = row_in[:, None] & col_in[None, :]
                tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
                dw += tl.sum(dy * xhat, axis=0)
                db += tl.sum(dy, axis=0)
            tl.store(part_w + cols, dw, mask=col_in)
            if HAS_BIAS:
                tl.store(part_b + cols, db, mask=col_in)
        else:
            for block in range(pid, tl.cdiv(M, BLOCK_M), num_programs):
                _bwd_rows_chunked(
                    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, part_w, part_b,
                    block, block != pid, M, N, n,
                    RMS, HAS_BIAS, ZERO_CENTERED, BLOCK_M, BLOCK_N,
                )  # fmt: skip

    @triton.jit
    def _reduce_partials_kernel(
        part_ptr,  # (2 if HAS_BIAS else 1, P, N) fp32, contiguous
        dw_ptr,  # (N,) the weight's dtype
        db_ptr,  # (N,) the weight's dtype; written when HAS_BIAS
        P,
        N,
        HAS_BIAS: tl.constexpr,
        BLOCK_P: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """dw = part[0].sum(0), db = part[1].sum(0) for BLOCK_N columns, in a fixed order."""
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_in = cols < N
        acc_w = tl.zeros((BLOCK_P, BLOCK_N), tl.float32)
        acc_b = tl.zeros((BLOCK_P, BLOCK_N), tl.float32)
        for start in range(0, P, BLOCK_P):
            prow = start + tl.arange(0, BLOCK_P)
            mask = (prow < P)[:, None] & col_in[None, :]
            offs = prow.to(tl.int64)[:, None] * N + cols[None, :]
            acc_w += tl.load(part_ptr + offs, mask=mask, other=0.0)
            if HAS_BIAS:
                offs_b = (prow + P).to(tl.int64)[:, None] * N + cols[None, :]
                acc_b += tl.load(part_ptr + offs_b, mask=mask, other=0.0)
        tl.store(dw_ptr + cols, tl.sum(acc_w, axis=0).to(dw_ptr.dtype.element_ty), mask=col_in)
        if HAS_BIAS:
            db = tl.sum(acc_b, axis=0).to(db_ptr.dtype.element_ty)
            tl.store(db_ptr + cols, db, mask=col_in)


# ----------------------------------------------------------------------------------------------
# Public functions: Triton on CUDA, the torch reference elsewhere
# ----------------------------------------------------------------------------------------------


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and x.shape[0] > 0 and triton_available()


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


def rmsnorm_forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x (M, N) over N: (y (M, N) in x's dtype, rstd (M,) fp32); weight (N,)."""
    if _use_triton(x):
        y, _, rstd = _forward(x, weight, None, eps, zero_centered_gamma, True)
        return y, rstd
    return rmsnorm_forward_reference(x, weight, eps, zero_centered_gamma)


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


if triton is not None:
    _launch_fwd = FastLaunch(_norm_fwd_kernel)
    _launch_bwd = FastLaunch(_norm_bwd_kernel)
    _launch_reduce = FastLaunch(_reduce_partials_kernel)


@functools.lru_cache(maxsize=1024)
def row_config(rows: int, cols: int, max_block_n: int, tile: int) -> tuple[int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, num_warps, chunked) for rows of `cols` elements: the whole row in one
    block up to max_block_n (else chunks of max_block_n), and several short rows per block, up
    to `tile` elements; about 16 fp32 values per thread."""
    block_n = max(16, 1 << (cols - 1).bit_length())
    chunked = block_n > max_block_n
    block_n = min(block_n, max_block_n)
    block_m = max(1, min(tile // block_n, 1 << (rows - 1).bit_length()))
    num_warps = min(max(block_m * block_n // 512, 1), 16)
    return block_m, block_n, num_warps, chunked


def _forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    zero_centered_gamma: bool,
    rms: bool,
    config: tuple[int, int, int, bool] | None = None,
    num_programs: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Launch _norm_fwd_kernel on x (M, N), M > 0: (y, mean (None for RMS), rstd). config and
    num_programs (before capping at the row-block count) override the defaults."""
    if not x.is_contiguous():
        x = x.contiguous()
    rows, cols = x.shape
    if config is None:
        config = row_config(rows, cols, FWD_MAX_BLOCK_N, FWD_TILE)
    block_m, block_n, num_warps, chunked = config
    if num_programs is None:
        num_programs = sm_count(x.get_device()) * FWD_PROGRAMS_PER_SM
    programs = min((rows + block_m - 1) // block_m, num_programs)
    device = x.device
    y = torch.empty(rows, cols, dtype=x.dtype, device=device)
    rstd = torch.empty(rows, dtype=torch.float32, device=device)
    mean = None if rms else torch.empty(rows, dtype=torch.float32, device=device)
    # Arguments not read (no bias; mean under RMS) get any pointer: never dereferenced.
    b = weight if bias is None else bias
    m = rstd if mean is None else mean
    key = (
        x.dtype, weight.dtype, b.dtype, rms, bias is not None, zero_centered_gamma, config,
        *int_key(rows), *int_key(cols), x.data_ptr() & 15, weight.data_ptr() & 15,
        b.data_ptr() & 15, y.data_ptr() & 15, m.data_ptr() & 15, rstd.data_ptr() & 15,
    )  # fmt: skip
    _launch_fwd(
        key, (programs, 1, 1), num_warps, x, weight, b, y, m, rstd, rows, cols, float(eps),
        rms, bias is not None, zero_centered_gamma, block_m, block_n, chunked,
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Launch _norm_bwd_kernel and _reduce_partials_kernel on x, dy (M, N), M > 0:
    (dx, dweight, dbias or None). mean is not read under RMS (pass rstd). config,
    num_programs (before capping at the row-block count) and reduce_config override the
    defaults (tests, benchmark sweeps)."""
    if not x.is_contiguous():
        x = x.contiguous()
    if not dy.is_contiguous():
        dy = dy.contiguous()
    rows, cols = x.shape
    if config is None:
        config = row_config(rows, cols, BWD_MAX_BLOCK_N, BWD_TILE)
    block_m, block_n, num_warps, chunked = config
    num_blocks = (rows + block_m - 1) // block_m
    if num_programs is None:
        num_programs = sm_count(x.get_device()) * BWD_PROGRAMS_PER_SM
    # Every program owns at least one row block, so every row of the partials gets written.
    programs = min(num_blocks, num_programs)
    device = x.device
    dx = torch.empty(rows, cols, dtype=x.dtype, device=device)
    part = torch.empty(2 if has_bias else 1, programs, cols, dtype=torch.float32, device=device)
    dw = torch.empty(cols, dtype=weight.dtype, device=device)
    db = torch.empty(cols, dtype=weight.dtype, device=device) if has_bias else None
    key = (
        dy.dtype, x.dtype, weight.dtype, rms, has_bias, zero_centered_gamma, config,
        *int_key(rows), *int_key(cols), dy.data_ptr() & 15, x.data_ptr() & 15,
        weight.data_ptr() & 15, mean.data_ptr() & 15, rstd.data_ptr() & 15, dx.data_ptr() & 15,
        part.data_ptr() & 15,
    )  # fmt: skip
    _launch_bwd(
        key, (programs, 1, 1), num_warps, dy, x, weight, mean, rstd, dx, part, rows, cols,
        rms, has_bias, zero_centered_gamma, block_m, block_n, chunked,
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
    x, weight, bias, eps, zero_centered_gamma
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
    dy, x, weight, mean, rstd, zero_centered_gamma, *, has_bias: bool = True
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
    x, weight, eps, zero_centered_gamma
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of rmsnorm_forward."""
    x32 = x.float()
    rstd = _rstd_reference((x32 * x32).mean(dim=1), eps)
    y = x32 * rstd[:, None] * _gamma_reference(weight, zero_centered_gamma)
    return y.to(x.dtype), rstd


def rmsnorm_backward_reference(
    dy, x, weight, rstd, zero_centered_gamma
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of rmsnorm_backward."""
    dy32 = dy.float()
    xhat = x.float() * rstd[:, None]
    gdy = dy32 * _gamma_reference(weight, zero_centered_gamma)
    c1 = (xhat * gdy).mean(dim=1, keepdim=True)
    dx = (gdy - xhat * c1) * rstd[:, None]
    return dx.to(x.dtype), (dy32 * xhat).sum(dim=0).to(weight.dtype)
