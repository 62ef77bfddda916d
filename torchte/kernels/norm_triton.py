"""The Triton kernels of LayerNorm and RMSNorm (the math and launchers are in norm.py; the
fused FP8 forward in norm_fp8.py reuses the statistics helpers here). Imported only where
triton is installed."""

import triton
import triton.language as tl


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
    xc = x if RMS else x - mean[:, None]
    y = xc * rstd[:, None] * g[None, :]
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
def _load_rows(ptr, rows, M, N, cols, col_in):
    """The (BLOCK_M, BLOCK_N) tile of rows `rows` at columns `cols` (zeros past M or N), in
    the tensor's dtype."""
    mask = (rows < M)[:, None] & col_in[None, :]
    return tl.load(ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0)


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
    STAGES: tl.constexpr,  # whole rows: > 1 pipelines the loop's loads (async copies)
):
    """Program p normalizes row blocks p, p + P, ... (P programs)."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    if CHUNKED:
        for block in range(pid, tl.cdiv(M, BLOCK_M), num_programs):
            rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
            row_in = rows < M
            row_offs = rows.to(tl.int64) * N
            mean, rstd = _row_stats_chunked(x_ptr, row_offs, row_in, N, eps, RMS, BLOCK_M, BLOCK_N)
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
        n = tl.zeros((BLOCK_M,), tl.float32) + N * 1.0
        for block in tl.range(pid, tl.cdiv(M, BLOCK_M), num_programs, num_stages=STAGES):
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
            g = _gamma(w_ptr, cols, col_in, ZERO_CENTERED)
            b = _bias(b_ptr, cols, col_in, HAS_BIAS)
            _normalize_store(x, y_ptr, offs, mask, g, b, mean, rstd, RMS, HAS_BIAS)


@triton.jit
def _bwd_tile(
    dy_ptr, x_ptr, mean_ptr, rstd_ptr, rows, row_in, cols, col_in, M, N, g,
    RMS: tl.constexpr,
):  # fmt: skip
    """(dy, xhat, g dy, rstd) of one (BLOCK_M, BLOCK_N) tile, fp32; zero outside M x N."""
    x = _load_rows(x_ptr, rows, M, N, cols, col_in)
    dy = _load_rows(dy_ptr, rows, M, N, cols, col_in)
    return _bwd_math(x, dy, mean_ptr, rstd_ptr, rows, row_in, col_in, g, RMS)


@triton.jit
def _bwd_math(x, dy, mean_ptr, rstd_ptr, rows, row_in, col_in, g, RMS: tl.constexpr):
    """(dy, xhat, g dy, rstd) fp32 from the loaded tiles x, dy (zero outside M x N)."""
    mask = row_in[:, None] & col_in[None, :]
    x = x.to(tl.float32)
    dy = dy.to(tl.float32)
    rstd = tl.load(rstd_ptr + rows, mask=row_in, other=0.0)
    if RMS:
        xhat = x * rstd[:, None]
    else:
        mean = tl.load(mean_ptr + rows, mask=row_in, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
    return dy, xhat, dy * g[None, :], rstd


@triton.jit
def _add_pairs(a1, b1, a2, b2):
    return a1 + a2, b1 + b2


@triton.jit
def _row_means(u, v, n, RMS: tl.constexpr):
    """(mean of u, mean of v) over each row of the (BLOCK_M, BLOCK_N) tiles; LayerNorm takes
    both sums in one reduction (one round of cross-warp exchange), RMSNorm needs only u's."""
    if RMS:
        su = tl.sum(u, axis=1)
        sv = su
    else:
        su, sv = tl.reduce((u, v), 1, _add_pairs)
    return tl.math.div_rn(su, n), tl.math.div_rn(sv, n)


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
            dy_ptr, x_ptr, mean_ptr, rstd_ptr, rows, row_in, cols, col_in, M, N, g, RMS
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
            dy_ptr, x_ptr, mean_ptr, rstd_ptr, rows, row_in, cols, col_in, M, N, g, RMS
        )
        dx = _dx(xhat, gdy, rstd, c1, c2, RMS)
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        mask = row_in[:, None] & col_in[None, :]
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw = tl.sum(dy * xhat, axis=0)
        # col_in & accumulate, written as one comparison: Triton 3.9's interpreter makes an
        # int32 (an invalid mask) of a block mask & a scalar flag.
        add_to = cols < tl.where(accumulate, N, 0)
        dw += tl.load(part_w + cols, mask=add_to, other=0.0)
        tl.store(part_w + cols, dw, mask=col_in)
        if HAS_BIAS:
            db = tl.sum(dy, axis=0)
            db += tl.load(part_b + cols, mask=add_to, other=0.0)
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
    STAGES: tl.constexpr,  # whole rows: > 1 pipelines the loop's loads (async copies)
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
        for block in tl.range(pid, tl.cdiv(M, BLOCK_M), num_programs, num_stages=STAGES):
            rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
            row_in = rows < M
            x = _load_rows(x_ptr, rows, M, N, cols, col_in)
            dy = _load_rows(dy_ptr, rows, M, N, cols, col_in)
            dy, xhat, gdy, rstd = _bwd_math(x, dy, mean_ptr, rstd_ptr, rows, row_in, col_in, g, RMS)
            # The column sums first: dy is then dead while the row sums are exchanged.
            dw += tl.sum(dy * xhat, axis=0)
            db += tl.sum(dy, axis=0)
            c1, c2 = _row_means(xhat * gdy, gdy, n, RMS)
            dx = _dx(xhat, gdy, rstd, c1, c2, RMS)
            offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
            mask = row_in[:, None] & col_in[None, :]
            tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
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
