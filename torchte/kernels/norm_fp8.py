"""LayerNorm / RMSNorm forward fused with FP8 quantization of y (delayed scaling), one launch.

Shapes as in norm.py: x (M, N) fp32 / bf16 / fp16; weight, bias (N,) in the parameters' dtype;
mean, rstd (M,) fp32. The FP8 data is laid out as _fp8_codec says: rowwise (M, N) and
columnwise (N, Mp), Mp = round_up(M, 16), the padding columns zero. How y is written comes in
a CastSpec of delayed scaling: its scale and amax (max-accumulated), and the scale_inv
returned, are fp32 tensors of shape (1,) on x's device.

This replaces two launches with one and never writes y in high precision:
    y, mean, rstd = layernorm_forward(x, ...)        (or rmsnorm_forward)
    cast_transpose.quantize(y, spec)
and gives the same bytes, amax, scale_inv, mean and rstd as those:

- The row statistics are computed by the unfused kernel's code on the same tiles: given the
  same (BLOCK_M, BLOCK_N, num_warps, chunked), a row longer than one block goes through norm's
  _row_stats_chunked, a shorter one through the same single-block sums, so the fp32 reductions
  run in the same order. The default here is norm.row_config with FP8_TILE elements per tile
  (the unfused forward's own default tile is larger: pass this config to compare bits).
- y is the same fp32 expression, rounded to x's dtype (as storing y does), then quantized with
  _fp8_codec's encoder: uint8 bytes rowwise, int32 words of four rows columnwise, amax as an
  int32 atomic max of the bits of |y|.

A program owns GROUP_M = max(GROUP_ROWS, BLOCK_M) consecutive rows (a multiple of 16, so the
words of four rows and the padding rows M..Mp of its part of the columnwise data are all its
own). It first computes and stores the statistics of its rows, BLOCK_M rows at a time; then,
after a CTA barrier, walks the columns in chunks of OUT_BLOCK_N, reading x again and the
statistics back, and writes the FP8 bytes. x is read twice (the second read of a group's rows
mostly from L2).

Launches per call (M > 0, CUDA with Triton): 1. Elsewhere, and for M == 0, the torch
references below, composed of norm.py's references and _fp8_codec's cast.
"""

from __future__ import annotations

import functools

import torch

from . import norm as norm_mod
from ._compile import compiled_as_op
from ._fp8_codec import (
    COLUMNWISE_ALIGN,
    FP8_MAX,
    alloc_outputs,
    check_producer_spec,
    encode_reference,
)
from ._triton import FastLaunch, int_key, tl, triton, triton_available
from .cast_spec import CastSpec

__all__ = [
    "FP8_TILE",
    "OUT_TILE",
    "fp8_config",
    "layernorm_forward_fp8",
    "layernorm_forward_fp8_reference",
    "rmsnorm_forward_fp8",
    "rmsnorm_forward_fp8_reference",
]

# Elements of one of the four row slices (GROUP_M / 4 rows) of the output pass's column chunk.
# Chosen for about 4-16 fp32 values per thread at the norm config's num_warps; not yet tuned
# on a GPU.
OUT_TILE = 2048
# Elements per statistics tile (BLOCK_M x BLOCK_N), about 16 fp32 values per thread: the
# unfused forward's larger tile (64 per thread) leaves this kernel's output pass too few warps.
FP8_TILE = 4096
# Rows a program owns at least: its columnwise bytes are GROUP_M-byte runs per column.
GROUP_ROWS = 16

if triton is not None:
    from ._fp8_codec import _delayed_scale, _encode_slice, _round_as, _store_words
    from .norm_triton import _bias, _gamma, _row_stats_chunked, _rstd, _tile_mean_var

    @triton.jit
    def _group_stats(
        x_ptr, mean_ptr, rstd_ptr, first, M, N, eps,
        RMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CHUNKED: tl.constexpr, GROUP_M: tl.constexpr,
    ):  # fmt: skip
        """Store mean (unless RMS) and rstd of rows first .. first + GROUP_M - 1 (those < M),
        BLOCK_M rows at a time, by _norm_fwd_kernel's own statistics code."""
        n = tl.zeros((BLOCK_M,), tl.float32) + N * 1.0
        for sub in range(0, GROUP_M, BLOCK_M):
            rows = first + sub + tl.arange(0, BLOCK_M)
            row_in = rows < M
            if CHUNKED:
                row_offs = rows.to(tl.int64) * N
                mean, rstd = _row_stats_chunked(
                    x_ptr, row_offs, row_in, N, eps, RMS, BLOCK_M, BLOCK_N
                )
            else:
                cols = tl.arange(0, BLOCK_N)
                col_in = cols < N
                mask = row_in[:, None] & col_in[None, :]
                offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
                x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                mean, var = _tile_mean_var(x, mask, n, RMS)
                rstd = _rstd(var, eps)
            if not RMS:
                tl.store(mean_ptr + rows, mean, mask=row_in)
            tl.store(rstd_ptr + rows, rstd, mask=row_in)

    @triton.jit
    def _norm_values(
        x_ptr, mean_ptr, rstd_ptr, rows, row_in, cols, mask, N, g, b,
        RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
    ):  # fmt: skip
        """y at (rows, cols) in fp32, as _normalize_store computes it, rounded to x's dtype;
        0 where masked out (under zero_centered_gamma, g is 1 past N)."""
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_in, other=0.0)
        if RMS:
            y = x * rstd[:, None] * g[None, :]
        else:
            mean = tl.load(mean_ptr + rows, mask=row_in, other=0.0)
            y = (x - mean[:, None]) * rstd[:, None] * g[None, :]
        if HAS_BIAS:
            y += b[None, :]
        return _round_as(tl.where(mask, y, 0.0), x_ptr), offs

    @triton.jit
    def _norm_fwd_fp8_kernel(
        x_ptr,  # (M, N) fp32 / bf16 / fp16, contiguous
        w_ptr,  # (N,) the parameters' dtype
        b_ptr,  # (N,) the parameters' dtype; read when HAS_BIAS
        mean_ptr,  # (M,) fp32; written (and read back) unless RMS
        rstd_ptr,  # (M,) fp32; written and read back
        scale_ptr,  # (1,) fp32
        amax_ptr,  # (1,) fp32, max-accumulated as int32 bits (see _fp8_codec)
        scale_inv_ptr,  # (1,) fp32: 1 / scale, written by program 0
        out_ptr,  # (M, N) fp8 rowwise data, written as uint8 bytes
        out_t_ptr,  # (N, Mp) fp8 columnwise data, written as int32 words when COLUMNWISE
        M,
        N,
        eps,  # fp32
        FP8_MAX: tl.constexpr,  # 448.0 (e4m3) or 57344.0 (e5m2)
        RMS: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        ZERO_CENTERED: tl.constexpr,
        COLUMNWISE: tl.constexpr,
        BLOCK_M: tl.constexpr,  # the unfused kernel's statistics tile
        BLOCK_N: tl.constexpr,
        CHUNKED: tl.constexpr,
        GROUP_M: tl.constexpr,  # rows per program: a multiple of 16 and of BLOCK_M
        OUT_BLOCK_N: tl.constexpr,  # columns per step of the output pass
    ):
        pid = tl.program_id(0)
        scale = _delayed_scale(scale_ptr, scale_inv_ptr, pid == 0)
        first = pid * GROUP_M
        _group_stats(
            x_ptr, mean_ptr, rstd_ptr, first, M, N, eps, RMS, BLOCK_M, BLOCK_N, CHUNKED, GROUP_M
        )
        # The statistics were stored by threads of this program other than those that read
        # them back below: a CTA barrier orders those global stores before these loads.
        tl.debug_barrier()
        # Rows 4i + k of the group, k = 0..3, as four slices: their bytes pack into int32 words.
        group = first + 4 * tl.arange(0, GROUP_M // 4)
        bits = tl.zeros((GROUP_M // 4, OUT_BLOCK_N), tl.int32)
        for start in range(0, N, OUT_BLOCK_N):
            cols = start + tl.arange(0, OUT_BLOCK_N)
            col_in = cols < N
            g = _gamma(w_ptr, cols, col_in, ZERO_CENTERED)
            b = _bias(b_ptr, cols, col_in, HAS_BIAS)
            words = tl.zeros((GROUP_M // 4, OUT_BLOCK_N), tl.int32)
            for k in tl.static_range(4):
                rows = group + k
                row_in = rows < M
                mask = row_in[:, None] & col_in[None, :]
                y, offs = _norm_values(
                    x_ptr, mean_ptr, rstd_ptr, rows, row_in, cols, mask, N, g, b, RMS, HAS_BIAS
                )
                bits, words = _encode_slice(
                    y, k, row_in, offs, mask, scale, bits, words, out_ptr, FP8_MAX, True, True,
                    COLUMNWISE,
                )  # fmt: skip
            if COLUMNWISE:
                _store_words(out_t_ptr, words, cols, col_in, first // 4, M, GROUP_M)
        tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32)), tl.max(bits), sem="relaxed")

    _launch_fwd_fp8 = FastLaunch(_norm_fwd_fp8_kernel)


# ----------------------------------------------------------------------------------------------
# Public functions: Triton on CUDA, the torch references elsewhere
# ----------------------------------------------------------------------------------------------


@compiled_as_op(
    "(Tensor x, Tensor weight, Tensor? bias, float eps, bool zero_centered_gamma, "
    "CastSpec spec) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)
def layernorm_forward_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    zero_centered_gamma: bool,
    spec: CastSpec,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm of x (M, N) quantized as spec says (delayed scaling, rowwise always):
    (rowwise (M, N), columnwise (N, Mp) or None, scale_inv (1,), mean (M,) fp32, rstd (M,)
    fp32). Max-accumulates max |y| into spec.amax (1,). Same bytes as layernorm_forward then
    cast_transpose.quantize."""
    check_producer_spec(spec, "layernorm_forward_fp8", needs_rowwise=True)
    if _use_triton(x):
        return _forward_fp8(x, weight, bias, eps, zero_centered_gamma, False, spec)
    return layernorm_forward_fp8_reference(x, weight, bias, eps, zero_centered_gamma, spec)


@compiled_as_op(
    "(Tensor x, Tensor weight, float eps, bool zero_centered_gamma, CastSpec spec) -> "
    "(Tensor, Tensor, Tensor, Tensor)"
)
def rmsnorm_forward_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool, spec: CastSpec
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """RMSNorm of x (M, N) quantized as spec says: (rowwise (M, N), columnwise (N, Mp) or None,
    scale_inv (1,), rstd (M,) fp32); amax as in layernorm_forward_fp8."""
    check_producer_spec(spec, "rmsnorm_forward_fp8", needs_rowwise=True)
    if _use_triton(x):
        data, data_t, scale_inv, _, rstd = _forward_fp8(
            x, weight, None, eps, zero_centered_gamma, True, spec
        )
        return data, data_t, scale_inv, rstd
    return rmsnorm_forward_fp8_reference(x, weight, eps, zero_centered_gamma, spec)


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and x.shape[0] > 0 and triton_available()


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1024)
def fp8_config(
    config: tuple[int, int, int, bool], out_tile: int = OUT_TILE, group_rows: int = GROUP_ROWS
) -> tuple[int, int]:
    """(GROUP_M, OUT_BLOCK_N) for the norm config (BLOCK_M, BLOCK_N, num_warps, chunked):
    rows per program, at least group_rows (a power of two >= 16) and a multiple of BLOCK_M;
    columns per output step, at most BLOCK_N and about out_tile / (GROUP_M / 4)."""
    block_m, block_n, _, _ = config
    group_m = max(group_rows, COLUMNWISE_ALIGN, block_m)
    out_block_n = min(block_n, max(16, out_tile // (group_m // 4)))
    return group_m, out_block_n


def _forward_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    zero_centered_gamma: bool,
    rms: bool,
    spec: CastSpec,
    config: tuple[int, int, int, bool] | None = None,
    out_tile: int = OUT_TILE,
    group_rows: int = GROUP_ROWS,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Launch _norm_fwd_fp8_kernel on x (M, N), M > 0: (rowwise, columnwise or None, scale_inv,
    mean (None for RMS), rstd). config is the unfused kernel's (BLOCK_M, BLOCK_N, num_warps,
    chunked), by default norm.row_config's for (M, N) with FP8_TILE; pass the same one to
    norm._forward to compare. out_tile, group_rows: fp8_config's."""
    if not x.is_contiguous():
        x = x.contiguous()
    rows, cols = x.shape
    if config is None:
        config = norm_mod.row_config(rows, cols, norm_mod.FWD_MAX_BLOCK_N, FP8_TILE)
    block_m, block_n, num_warps, chunked = config
    group_m, out_block_n = fp8_config(config, out_tile, group_rows)
    device = x.device
    fp8_dtype, columnwise, scale, amax = spec.fp8_dtype, spec.columnwise, spec.scale, spec.amax
    scale_inv = torch.empty(1, dtype=torch.float32, device=device)
    data, data_t = alloc_outputs(rows, cols, fp8_dtype, device, True, columnwise)
    rstd = torch.empty(rows, dtype=torch.float32, device=device)
    mean = None if rms else torch.empty(rows, dtype=torch.float32, device=device)
    # Arguments not read (no bias; mean under RMS; no columnwise) get any pointer.
    b = weight if bias is None else bias
    m = rstd if mean is None else mean
    out_t = scale_inv if data_t is None else data_t
    key = (
        x.dtype, weight.dtype, b.dtype, fp8_dtype, rms, bias is not None, zero_centered_gamma,
        columnwise, config, group_m, out_block_n,
        *int_key(rows), *int_key(cols),
        x.data_ptr() & 15, weight.data_ptr() & 15, b.data_ptr() & 15, m.data_ptr() & 15,
        rstd.data_ptr() & 15, scale.data_ptr() & 15, amax.data_ptr() & 15,
        scale_inv.data_ptr() & 15, data.data_ptr() & 15, out_t.data_ptr() & 15,
    )  # fmt: skip
    _launch_fwd_fp8(
        key, ((rows + group_m - 1) // group_m, 1, 1), num_warps, x, weight, b, m, rstd, scale,
        amax, scale_inv, data, out_t, rows, cols, float(eps), FP8_MAX[fp8_dtype], rms,
        bias is not None, zero_centered_gamma, columnwise, block_m, block_n, chunked, group_m,
        out_block_n,
    )  # fmt: skip
    return data, data_t, scale_inv, mean, rstd


# ----------------------------------------------------------------------------------------------
# Torch references: the same functions, used on CPU, for M == 0 and in tests
# ----------------------------------------------------------------------------------------------


def layernorm_forward_fp8_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    zero_centered_gamma: bool,
    spec: CastSpec,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of layernorm_forward_fp8."""
    y, mean, rstd = norm_mod.layernorm_forward_reference(x, weight, bias, eps, zero_centered_gamma)
    return (*encode_reference(y, spec), mean, rstd)


def rmsnorm_forward_fp8_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool, spec: CastSpec
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Torch reference of rmsnorm_forward_fp8."""
    y, rstd = norm_mod.rmsnorm_forward_reference(x, weight, eps, zero_centered_gamma)
    return (*encode_reference(y, spec), rstd)
