"""The scaled activation of a mixture-of-experts MLP fused with the grouped FP8 quantization of
the second GEMM's input: a = act(h) * s quantized group by group, each group with its own
scale, in one launch (delayed scaling) or three (current: zeroing the amaxes, the amax pass,
the cast), never writing a in high precision.

Legend: h (T, K) the first grouped GEMM's output, K = 2N for gated activations (else N), s (T,)
the per-row scales (the router's probabilities), G groups of m_g consecutive rows (m_splits),
a (T, N). The output is laid out as grouped_cast's (rowwise (T, N), columnwise (N * C,) flat in
per-group (N, round_up(m_g, 16)) blocks, scale_inv (G,)), and the bytes, amaxes and scale_invs
are those of
    grouped_cast.quantize_grouped(scaled_activation.scaled_activation_forward(h, s), ...)
(the activation math is activation.py's jit helper in fp32; a, s and their product each
rounded to h's dtype, as scaled_activation.py defines them).

How a program finds its group, and the grid: as in grouped_cast (row tiles numbered group by
group, _tile_group_or_last), also with m_splits None (sizes on the device: worst-case grid and
columnwise room, grouped_cast.grouped_columns). Elsewhere than on CUDA with Triton (and for
an empty h), the composition above runs.
"""

from __future__ import annotations

import functools

import torch

from . import activation as act_mod
from ._fp8_codec import FP8_MAX, check_fp8_dtype
from ._triton import FastLaunch, int_key, ptr_key, tl, triton, triton_available
from .cast_spec import CastSpec
from .grouped_cast import (
    _check_groups,
    _group_block,
    _row_tiles,
    _zeroed_amax,
    grouped_columns,
    quantize_grouped,
)
from .scaled_activation import scaled_activation_backward, scaled_activation_forward

__all__ = [
    "SCALED_ACT_CONFIG",
    "SCALED_ACT_GRAD_CONFIG",
    "scaled_activation_backward_grouped_fp8",
    "scaled_activation_grouped_fp8",
]

# (BLOCK_M, BLOCK_N, num_warps) of the forward kernel and, per scaling, of the backward kernel,
# read at each call (benchmarks/scaled_act_sweep.py sets them to compare tiles); BLOCK_M a
# multiple of 16 so a group's last row tile also covers its columnwise padding. Measured on an
# H200 at 32768 x 8192 SwiGLU (docs/benchmarks.md): tiles from 16 x 256 to 128 x 128 within 10%
# of each other but for the delayed backward, whose 64-row tiles are 4-11% faster.
SCALED_ACT_CONFIG = (32, 128, 4)
SCALED_ACT_GRAD_CONFIG = {"delayed": (64, 128, 4), "current": (32, 128, 4)}

if triton is not None:
    from ._fp8_codec import _encode_slice, _round_as, _scale_from_amax, _store_words
    from .activation_fp8 import _act_values, grads_of
    from .grouped_cast import _tile_group_or_last, store_scale_invs

    @triton.jit
    def _load_grad_rows(h_g, s_g, dy_g, rows, rows_g, cols, col_in, N, GATED: tl.constexpr):
        """The backward's inputs of one slice of rows as stored: (x, the gate g (x when not
        GATED), the scale p, dy), 0 in masked lanes. Every slice of a tile is loaded before
        any is stored: the stores may alias the inputs for all the compiler knows, so a load
        after a store waits for it. Measured on an H200 (docs/benchmarks.md): 12-16% faster
        than loading each slice after the last one's stores under current scaling, the same
        under delayed; the forward, slower that way under delayed scaling, loads slice by
        slice."""
        row_in = rows < rows_g
        mask = row_in[:, None] & col_in[None, :]
        r64 = rows.to(tl.int64)[:, None]
        offs = r64 * (N * 2 if GATED else N) + cols[None, :]
        x = tl.load(h_g + offs, mask=mask, other=0.0)
        g = x
        if GATED:
            g = tl.load(h_g + offs + N, mask=mask, other=0.0)
        p = tl.load(s_g + rows, mask=row_in, other=0.0)
        dy = tl.load(dy_g + r64 * N + cols[None, :], mask=mask, other=0.0)
        return x, g, p, dy

    @triton.jit
    def _scaled_act_grouped_kernel(
        h_ptr,  # (T, K) fp32 / bf16 / fp16, contiguous; K = 2N when GATED else N
        s_ptr,  # (T,) float: the per-row scales
        row_offsets_ptr,  # (G + 1,) int32: o_g
        col_offsets_ptr,  # (G + 1,) int32: c_g, multiples of 16
        scale_ptr,  # (G,) fp32: the delayed scales; unused when CURRENT or AMAX_ONLY
        amax_ptr,  # (G,) fp32: max-accumulated (delayed, AMAX_ONLY); read when CURRENT
        scale_inv_ptr,  # (G,) fp32: written by program (0, 0) unless AMAX_ONLY
        out_ptr,  # (T, N) fp8 rowwise data, written as uint8 bytes unless AMAX_ONLY
        out_t_ptr,  # (N * C,) fp8 columnwise blocks, written as int32 words when COLUMNWISE
        N,
        G,
        limit,  # fp32; clamped_silu only
        alpha,  # fp32; clamped_silu only
        amax_epsilon,  # fp32; CURRENT only
        FP8_MAX: tl.constexpr,
        ACT: tl.constexpr,
        GATED: tl.constexpr,
        CURRENT: tl.constexpr,
        POWER_2: tl.constexpr,
        AMAX_ONLY: tl.constexpr,  # the amax pass of current scaling: no output
        COLUMNWISE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        G_BLOCK: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if not AMAX_ONLY:  # the amax pass writes no scale_inv
            first = (pid_m == 0) & (pid_n == 0)
            if first:
                store_scale_invs(
                    scale_ptr, amax_ptr, scale_inv_ptr, G, amax_epsilon, FP8_MAX, CURRENT,
                    POWER_2, G_BLOCK,
                )  # fmt: skip
        group, tile = _tile_group_or_last(row_offsets_ptr, G, pid_m, BLOCK_M, G_BLOCK)
        row_start = tl.load(row_offsets_ptr + group)
        rows_g = tl.load(row_offsets_ptr + group + 1) - row_start
        if AMAX_ONLY:
            scale = 1.0
        elif CURRENT:
            scale = _scale_from_amax(tl.load(amax_ptr + group), amax_epsilon, FP8_MAX, POWER_2)
        else:
            scale = tl.load(scale_ptr + group)
        k_cols = N * 2 if GATED else N
        h_g = h_ptr + row_start.to(tl.int64) * k_cols
        out_g = out_ptr + row_start.to(tl.int64) * N
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_in = cols < N
        # Rows 4i + k of the tile, k = 0..3, as four slices: their bytes pack into int32 words.
        quads = tile * BLOCK_M + 4 * tl.arange(0, BLOCK_M // 4)
        bits = tl.zeros((BLOCK_M // 4, BLOCK_N), tl.int32)
        words = tl.zeros((BLOCK_M // 4, BLOCK_N), tl.int32)
        for k in tl.static_range(4):
            rows = quads + k
            row_in = rows < rows_g
            mask = row_in[:, None] & col_in[None, :]
            a = _act_values(h_g, rows, cols, mask, N, limit, alpha, ACT, GATED)
            p = tl.load(s_ptr + row_start + rows, mask=row_in, other=0.0).to(tl.float32)
            y = _round_as(a * _round_as(p, h_ptr)[:, None], h_ptr)
            offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
            bits, words = _encode_slice(
                y, k, row_in, offs, mask, scale, bits, words, out_g, FP8_MAX, True,
                not AMAX_ONLY, COLUMNWISE and not AMAX_ONLY,
            )  # fmt: skip
        if COLUMNWISE and not AMAX_ONLY:
            col_start = tl.multiple_of(tl.load(col_offsets_ptr + group), 16)
            out_t_g = out_t_ptr + col_start.to(tl.int64) * N
            _store_words(out_t_g, words, cols, col_in, tile * (BLOCK_M // 4), rows_g, BLOCK_M)
        if AMAX_ONLY or not CURRENT:
            amax_bits = amax_ptr.to(tl.pointer_type(tl.int32))
            tl.atomic_max(amax_bits + group, tl.max(bits), sem="relaxed")

    _launch_scaled_act_grouped = FastLaunch(_scaled_act_grouped_kernel)

    @triton.jit
    def _grad_slice(
        dy, x, g, p, k, quads, rows_g, cols, col_in, N, T, row_start, pid_n, h_ptr, partial_ptr,
        out_g, scale, bits, words1, words2, sum1, sum2, limit, alpha, ACT: tl.constexpr,
        GATED: tl.constexpr, DS: tl.constexpr, DBIAS: tl.constexpr, ROWWISE: tl.constexpr,
        COLUMNWISE: tl.constexpr, FP8_MAX: tl.constexpr,
    ):  # fmt: skip
        """Slice k (rows 4i + k) of the backward tile from its loaded inputs: dh encoded (and
        its amax), ds's part, and dh added into the bias sums sum1, sum2 ((BLOCK_M // 4,
        BLOCK_N) each: summed over their rows once, after the four slices; sum2 only when
        GATED); (bits, words1, words2, sum1, sum2)."""
        rows = quads + k
        row_in = rows < rows_g
        mask = row_in[:, None] & col_in[None, :]
        offs = rows.to(tl.int64)[:, None] * (N * 2 if GATED else N) + cols[None, :]
        dy = dy.to(tl.float32)
        p = _round_as(p.to(tl.float32), h_ptr)
        x = x.to(tl.float32)
        dx1, dx2, a = grads_of(_round_as(dy * p[:, None], h_ptr), x, g.to(tl.float32), limit,
                               alpha, ACT, GATED)  # fmt: skip
        if DS:
            part = tl.sum(dy * _round_as(a, h_ptr), 1)
            tl.store(partial_ptr + pid_n.to(tl.int64) * T + row_start + rows, part, mask=row_in)
        dx1, dx2 = _round_as(dx1, h_ptr), _round_as(dx2, h_ptr)  # 0 in masked rows
        if DBIAS:
            sum1 += dx1
            if GATED:
                sum2 += dx2
        bits, words1 = _encode_slice(
            dx1, k, row_in, offs, mask, scale, bits, words1, out_g, FP8_MAX, True, ROWWISE,
            COLUMNWISE,
        )  # fmt: skip
        if GATED:
            bits, words2 = _encode_slice(
                dx2, k, row_in, offs + N, mask, scale, bits, words2, out_g, FP8_MAX, True,
                ROWWISE, COLUMNWISE,
            )  # fmt: skip
        return bits, words1, words2, sum1, sum2

    @triton.jit
    def _scaled_act_grad_grouped_kernel(
        dy_ptr,  # (T, N) the gradient of a = act(h) * s, contiguous
        h_ptr,  # (T, K) fp32 / bf16 / fp16, contiguous; K = 2N when GATED else N
        s_ptr,  # (T,) float: the per-row scales
        row_offsets_ptr,  # (G + 1,) int32: o_g
        col_offsets_ptr,  # (G + 1,) int32: c_g, multiples of 16
        scale_ptr,  # (G,) fp32: the delayed scales; unused when CURRENT or AMAX_ONLY
        amax_ptr,  # (G,) fp32: max-accumulated (delayed, AMAX_ONLY); read when CURRENT
        scale_inv_ptr,  # (G,) fp32: written by program (0, 0) unless AMAX_ONLY
        out_ptr,  # (T, K) fp8 rowwise dh, written as uint8 bytes when ROWWISE
        out_t_ptr,  # (K * C,) fp8 columnwise blocks, written as int32 words when COLUMNWISE
        # (ROWWISE and COLUMNWISE are off in the amax pass)
        partial_ptr,  # (column blocks, T) fp32: each block's part of ds (when DS)
        dbias_ptr,  # (row tiles, K) fp32: each row tile's column sums of dh (when DBIAS)
        N,
        T,
        G,
        limit,
        alpha,
        amax_epsilon,
        FP8_MAX: tl.constexpr,
        ACT: tl.constexpr,
        GATED: tl.constexpr,
        CURRENT: tl.constexpr,
        POWER_2: tl.constexpr,
        AMAX_ONLY: tl.constexpr,
        ROWWISE: tl.constexpr,
        COLUMNWISE: tl.constexpr,
        DS: tl.constexpr,
        DBIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        G_BLOCK: tl.constexpr,
    ):
        """Program (p, q): row tile p (numbered group by group), columns [q BLOCK_N, (q + 1)
        BLOCK_N) of dh's first half (and the same + N of the gate half when GATED)."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if not AMAX_ONLY:  # the amax pass writes no scale_inv
            first = (pid_m == 0) & (pid_n == 0)
            if first:
                store_scale_invs(
                    scale_ptr, amax_ptr, scale_inv_ptr, G, amax_epsilon, FP8_MAX, CURRENT,
                    POWER_2, G_BLOCK,
                )  # fmt: skip
        group, tile = _tile_group_or_last(row_offsets_ptr, G, pid_m, BLOCK_M, G_BLOCK)
        row_start = tl.load(row_offsets_ptr + group)
        rows_g = tl.load(row_offsets_ptr + group + 1) - row_start
        if AMAX_ONLY:
            scale = 1.0
        elif CURRENT:
            scale = _scale_from_amax(tl.load(amax_ptr + group), amax_epsilon, FP8_MAX, POWER_2)
        else:
            scale = tl.load(scale_ptr + group)
        k_cols = N * 2 if GATED else N
        h_g = h_ptr + row_start.to(tl.int64) * k_cols
        dy_g = dy_ptr + row_start.to(tl.int64) * N
        out_g = out_ptr + row_start.to(tl.int64) * k_cols
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_in = cols < N
        quads = tile * BLOCK_M + 4 * tl.arange(0, BLOCK_M // 4)
        bits = tl.zeros((BLOCK_M // 4, BLOCK_N), tl.int32)
        words1 = tl.zeros((BLOCK_M // 4, BLOCK_N), tl.int32)
        words2 = tl.zeros((BLOCK_M // 4, BLOCK_N), tl.int32)
        sum1 = tl.zeros((BLOCK_M // 4, BLOCK_N), tl.float32)
        sum2 = tl.zeros((BLOCK_M // 4, BLOCK_N), tl.float32)
        # All four slices loaded first, then each computed and encoded (_load_grad_rows says why)
        s_g = s_ptr + row_start
        x0, g0, p0, dy0 = _load_grad_rows(h_g, s_g, dy_g, quads, rows_g, cols, col_in, N, GATED)
        x1, g1, p1, dy1 = _load_grad_rows(h_g, s_g, dy_g, quads + 1, rows_g, cols,
                                          col_in, N, GATED)  # fmt: skip
        x2, g2, p2, dy2 = _load_grad_rows(h_g, s_g, dy_g, quads + 2, rows_g, cols,
                                          col_in, N, GATED)  # fmt: skip
        x3, g3, p3, dy3 = _load_grad_rows(h_g, s_g, dy_g, quads + 3, rows_g, cols,
                                          col_in, N, GATED)  # fmt: skip
        bits, words1, words2, sum1, sum2 = _grad_slice(
            dy0, x0, g0, p0, 0, quads, rows_g, cols, col_in, N, T, row_start, pid_n, h_ptr,
            partial_ptr, out_g, scale, bits, words1, words2, sum1, sum2, limit, alpha, ACT, GATED,
            DS, DBIAS, ROWWISE, COLUMNWISE, FP8_MAX,
        )  # fmt: skip
        bits, words1, words2, sum1, sum2 = _grad_slice(
            dy1, x1, g1, p1, 1, quads, rows_g, cols, col_in, N, T, row_start, pid_n, h_ptr,
            partial_ptr, out_g, scale, bits, words1, words2, sum1, sum2, limit, alpha, ACT, GATED,
            DS, DBIAS, ROWWISE, COLUMNWISE, FP8_MAX,
        )  # fmt: skip
        bits, words1, words2, sum1, sum2 = _grad_slice(
            dy2, x2, g2, p2, 2, quads, rows_g, cols, col_in, N, T, row_start, pid_n, h_ptr,
            partial_ptr, out_g, scale, bits, words1, words2, sum1, sum2, limit, alpha, ACT, GATED,
            DS, DBIAS, ROWWISE, COLUMNWISE, FP8_MAX,
        )  # fmt: skip
        bits, words1, words2, sum1, sum2 = _grad_slice(
            dy3, x3, g3, p3, 3, quads, rows_g, cols, col_in, N, T, row_start, pid_n, h_ptr,
            partial_ptr, out_g, scale, bits, words1, words2, sum1, sum2, limit, alpha, ACT, GATED,
            DS, DBIAS, ROWWISE, COLUMNWISE, FP8_MAX,
        )  # fmt: skip
        if DBIAS:
            db = dbias_ptr + pid_m.to(tl.int64) * k_cols
            tl.store(db + cols, tl.sum(sum1, 0), mask=col_in)
            if GATED:
                tl.store(db + N + cols, tl.sum(sum2, 0), mask=col_in)
        if COLUMNWISE:
            col_start = tl.multiple_of(tl.load(col_offsets_ptr + group), 16)
            out_t_g = out_t_ptr + col_start.to(tl.int64) * k_cols
            word0 = tile * (BLOCK_M // 4)
            _store_words(out_t_g, words1, cols, col_in, word0, rows_g, BLOCK_M)
            if GATED:
                _store_words(out_t_g, words2, cols + N, col_in, word0, rows_g, BLOCK_M)
        if AMAX_ONLY or not CURRENT:
            amax_bits = amax_ptr.to(tl.pointer_type(tl.int32))
            tl.atomic_max(amax_bits + group, tl.max(bits), sem="relaxed")

    _launch_scaled_act_grad_grouped = FastLaunch(_scaled_act_grad_grouped_kernel)


def scaled_activation_grouped_fp8(
    h: torch.Tensor,
    s: torch.Tensor,
    name: str,
    limit: float,
    alpha: float,
    m_splits: list[int] | None,
    row_offsets: torch.Tensor,
    col_offsets: torch.Tensor,
    spec: CastSpec,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """a = name(h) * s[:, None] quantized group by group as spec says (see the module
    docstring): h (T, K) contiguous, s (T,) -> (rowwise (T, N), columnwise (N * C,) or None,
    scale_inv (G,)). spec.rowwise must be set (the GEMM reads the rowwise bytes)."""
    act, gated = act_mod._spec(name)
    n = act_mod._out_cols(h, gated, name)
    if h.dim() != 2 or s.shape != (h.shape[0],):
        raise ValueError(
            f"h must be 2-D and s one value per row of h, got {tuple(h.shape)}, {tuple(s.shape)}"
        )
    if not spec.rowwise:
        raise ValueError(f"scaled_activation_grouped_fp8 always writes rowwise data, got {spec!r}")
    check_fp8_dtype(spec.fp8_dtype, ValueError)
    if not (h.is_cuda and triton_available() and h.numel() > 0):
        a = scaled_activation_forward(h, s, name, limit, alpha)
        return quantize_grouped(a, m_splits, row_offsets, col_offsets, spec)
    _check_groups(h[:, :n], m_splits, row_offsets, col_offsets, spec)
    return _forward_triton(h, s, act, gated, n, limit, alpha, m_splits, row_offsets,
                           col_offsets, spec)  # fmt: skip


def _forward_triton(h, s, act, gated, n, limit, alpha, m_splits, row_offsets, col_offsets, spec):
    """scaled_activation_grouped_fp8's kernels on checked arguments, (act, gated) the
    activation's spec and n its output width (one launch, or three under current scaling)."""
    h = h if h.is_contiguous() else h.contiguous()
    args = (h, s, n, act, gated, limit, alpha, m_splits, row_offsets, col_offsets, spec)
    config = SCALED_ACT_CONFIG
    if spec.delayed:
        return _launch(*args, amax=spec.amax, amax_only=False, current=False, config=config)
    amax = _zeroed_amax(spec.amax, row_offsets.numel() - 1, h.device)
    _launch(*args, amax=amax, amax_only=True, current=True, config=config)
    return _launch(*args, amax=amax, amax_only=False, current=True, config=config)


def _launch(
    h, s, n, act, gated, limit, alpha, m_splits, row_offsets, col_offsets, spec, *, amax,
    amax_only: bool, current: bool, config: tuple[int, int, int],
):  # fmt: skip
    """One launch of _scaled_act_grouped_kernel; (rowwise, columnwise, scale_inv), the data
    None in the amax pass."""
    tokens, groups = h.shape[0], row_offsets.numel() - 1
    block_m, block_n, num_warps = config
    fp8_dtype = spec.fp8_dtype
    columnwise = spec.columnwise and not amax_only
    scale_inv = torch.empty(groups, dtype=torch.float32, device=h.device)
    data = data_t = None
    if not amax_only:
        data = torch.empty(tokens, n, dtype=fp8_dtype, device=h.device)
    if columnwise:
        columns = grouped_columns(m_splits, tokens, groups)
        data_t = torch.empty(n * columns, dtype=fp8_dtype, device=h.device)
    out = scale_inv if data is None else data  # never stored to when not asked for
    out_t = scale_inv if data_t is None else data_t
    scale = amax if spec.scale is None else spec.scale
    grid = (_row_tiles(m_splits, block_m, tokens, groups), (n + block_n - 1) // block_n, 1)
    g_block = _group_block(groups)
    power_2 = spec.power_2_scale
    pointers = (h, s, row_offsets, col_offsets, scale, amax, scale_inv, out, out_t)
    key = (h.dtype, s.dtype, fp8_dtype, act, gated, current, power_2, amax_only, columnwise)
    key += (config, g_block, *int_key(n), *int_key(groups), *ptr_key(*pointers))
    _launch_scaled_act_grouped(
        key, grid, num_warps, *pointers, n, groups, float(limit), float(alpha),
        float(spec.amax_epsilon), FP8_MAX[fp8_dtype], act, gated, current, power_2, amax_only,
        columnwise, block_m, block_n, g_block,
    )  # fmt: skip
    return data, data_t, scale_inv


def scaled_activation_backward_grouped_fp8(
    dy: torch.Tensor,
    h: torch.Tensor,
    s: torch.Tensor,
    name: str,
    limit: float,
    alpha: float,
    m_splits: list[int] | None,
    row_offsets: torch.Tensor,
    col_offsets: torch.Tensor,
    spec: CastSpec,
    need: tuple[bool, bool],
) -> tuple:
    """The backward of a = name(h) * s[:, None] with dh quantized group by group as spec says:
    dy (T, N), h (T, K), s (T,) -> (dh rowwise (T, K) or None, columnwise (K * C,) or None,
    scale_inv (G,), ds (T,) in s's dtype or None, dbias (G, K) in dy's dtype or None).
    need = (ds, dbias): whether to compute them; dbias is each group's column sums of dh (the
    bias gradient of the GEMM that made h). One launch under delayed scaling, three under
    current (zeroing, the amax pass, which also sums ds and dbias, the cast). dh and ds as
    scaled_activation_backward computes them, dbias as torch.sum over each group's rows of
    dh (both summed in another order on a GPU); the bytes those of quantize_grouped(dh)."""
    act, gated = act_mod._spec(name)
    n = act_mod._out_cols(h, gated, name)
    if h.dim() != 2 or s.shape != (h.shape[0],) or dy.shape != (h.shape[0], n):
        raise ValueError(
            f"h must be 2-D, s one value per row, dy (rows, {n}); got {tuple(h.shape)}, "
            f"{tuple(s.shape)}, {tuple(dy.shape)}"
        )
    check_fp8_dtype(spec.fp8_dtype, ValueError)
    need_ds, need_dbias = need
    if not (h.is_cuda and triton_available() and h.numel() > 0):
        dh, ds = scaled_activation_backward(dy, h, s, name, limit, alpha, need_ds)
        dbias = None
        if need_dbias:
            sizes = torch.diff(row_offsets).tolist() if m_splits is None else m_splits
            dbias = torch.zeros(len(sizes), h.shape[1], dtype=dy.dtype, device=h.device)
            for g, part in enumerate(dh.split(sizes)):
                if part.shape[0]:
                    torch.sum(part, 0, out=dbias[g])
        return (*quantize_grouped(dh, m_splits, row_offsets, col_offsets, spec), ds, dbias)
    _check_groups(h, m_splits, row_offsets, col_offsets, spec)
    return _backward_triton(
        dy, h, s, act, gated, n, limit, alpha, m_splits, row_offsets, col_offsets, spec, need
    )


def _backward_triton(
    dy, h, s, act, gated, n, limit, alpha, m_splits, row_offsets, col_offsets, spec, need
):
    """scaled_activation_backward_grouped_fp8's kernels on checked arguments ((act, gated) the
    activation's spec, n its output width), and the sums of their ds and dbias parts."""
    need_ds, need_dbias = need
    h, dy = h.contiguous(), dy.contiguous()
    config = SCALED_ACT_GRAD_CONFIG["delayed" if spec.delayed else "current"]
    block_m, block_n, _ = config
    col_blocks = (n + block_n - 1) // block_n
    tokens, groups = h.shape[0], row_offsets.numel() - 1
    row_tiles = _row_tiles(m_splits, block_m, tokens, groups)
    f32 = {"dtype": torch.float32, "device": h.device}
    sums = (
        torch.empty(col_blocks, tokens, **f32) if need_ds else None,
        torch.empty(row_tiles, h.shape[1], **f32) if need_dbias else None,
    )
    args = (dy, h, s, n, act, gated, limit, alpha, m_splits, row_offsets, col_offsets, spec)
    if spec.delayed:
        out = _launch_grad(*args, sums, amax=spec.amax, amax_only=False, current=False,
                           config=config)  # fmt: skip
    else:
        amax = _zeroed_amax(spec.amax, groups, h.device)
        _launch_grad(*args, sums, amax=amax, amax_only=True, current=True, config=config)
        out = _launch_grad(*args, (None, None), amax=amax, amax_only=False, current=True,
                           config=config)  # fmt: skip
    ds = sums[0].sum(0).to(s.dtype) if need_ds else None
    dbias = None
    if need_dbias:
        if m_splits is None:
            one_hot = _device_tile_one_hot(row_offsets, block_m, row_tiles)
        else:
            one_hot = _tile_one_hot(tuple(m_splits), block_m, h.device)
        with torch.autocast(h.device.type, enabled=False):  # an fp32 product stays fp32
            dbias = torch.mm(one_hot, sums[1]).to(dy.dtype)
    return (*out, ds, dbias)


@functools.lru_cache(maxsize=16)
def _tile_one_hot(m_splits: tuple[int, ...], block_m: int, device) -> torch.Tensor:
    """(G, row tiles) fp32: 1 where the tile belongs to the group (tiles numbered group by
    group), to sum each group's tiles as one GEMM, in a fixed order."""
    groups = [g for g, rows in enumerate(m_splits) for _ in range((rows + block_m - 1) // block_m)]
    one_hot = torch.zeros(len(m_splits), len(groups), dtype=torch.float32)
    one_hot[torch.tensor(groups, dtype=torch.int64), torch.arange(len(groups))] = 1.0
    return one_hot.to(device)


def _device_tile_one_hot(row_offsets: torch.Tensor, block_m: int, row_tiles: int):
    """_tile_one_hot from the offsets on the device, for a worst-case grid of row_tiles
    tiles: the tiles past the last real one (which store zero sums) belong to no group."""
    tiles = (torch.diff(row_offsets) + (block_m - 1)) // block_m
    ends = tiles.cumsum(0)
    index = torch.arange(row_tiles, device=row_offsets.device, dtype=ends.dtype)
    tile_group = torch.searchsorted(ends, index, right=True)
    groups = torch.arange(tiles.numel(), device=row_offsets.device)
    return (groups[:, None] == tile_group[None, :]).float()


def _launch_grad(
    dy, h, s, n, act, gated, limit, alpha, m_splits, row_offsets, col_offsets, spec, sums,
    *, amax, amax_only: bool, current: bool, config: tuple[int, int, int],
):  # fmt: skip
    """One launch of _scaled_act_grad_grouped_kernel; (rowwise, columnwise, scale_inv), the
    data None in the amax pass; sums = (ds parts | None, dbias parts | None) written when
    given."""
    tokens, k_cols, groups = h.shape[0], h.shape[1], row_offsets.numel() - 1
    block_m, block_n, num_warps = config
    fp8_dtype = spec.fp8_dtype
    rowwise, columnwise = spec.rowwise and not amax_only, spec.columnwise and not amax_only
    scale_inv = torch.empty(groups, dtype=torch.float32, device=h.device)
    data = data_t = None
    if rowwise:
        data = torch.empty(tokens, k_cols, dtype=fp8_dtype, device=h.device)
    if columnwise:
        columns = grouped_columns(m_splits, tokens, groups)
        data_t = torch.empty(k_cols * columns, dtype=fp8_dtype, device=h.device)
    out = scale_inv if data is None else data  # never stored to when not asked for
    out_t = scale_inv if data_t is None else data_t
    partial, dbias = (scale_inv if t is None else t for t in sums)
    scale = amax if spec.scale is None else spec.scale
    grid = (_row_tiles(m_splits, block_m, tokens, groups), (n + block_n - 1) // block_n, 1)
    g_block = _group_block(groups)
    power_2 = spec.power_2_scale
    pointers = (dy, h, s, row_offsets, col_offsets, scale, amax, scale_inv, out, out_t)
    pointers += (partial, dbias)
    flags = (current, power_2, amax_only, rowwise, columnwise, *(t is not None for t in sums))
    key = (dy.dtype, h.dtype, s.dtype, fp8_dtype, act, gated, *flags, config, g_block)
    key += (*int_key(n), *int_key(tokens), *int_key(groups), *ptr_key(*pointers))
    _launch_scaled_act_grad_grouped(
        key, grid, num_warps, *pointers, n, tokens, groups, float(limit), float(alpha),
        float(spec.amax_epsilon), FP8_MAX[fp8_dtype], act, gated, *flags, block_m, block_n,
        g_block,
    )  # fmt: skip
    return data, data_t, scale_inv
