"""LayerNormMLP's activation fused with its FP8 quantization: one launch each under delayed
scaling, an amax pass and that launch under current scaling.

Legend: h (M, K) the activation's input, K = 2N for gated activations (else N); a = act(h)
(M, N); dy (M, N) the gradient of a; dh (M, K) the gradient of h. FP8 data is laid out as in
_fp8_codec: rowwise (rows, cols) and columnwise (cols, Mp), Mp = round_up(M, 16), the padding
columns zero. How the output is written comes in a CastSpec of one scale for the tensor:
delayed (its scale and amax, fp32 (1,) on h's device) or current (the scale made from the
values' own amax); the scale_inv returned is fp32 (1,).

Under delayed scaling these replace two launches (forward) and three (backward, the dbias sum
included) with one, and never write a or dh in high precision:
  forward:  a = activation_forward(h); cast_transpose.quantize(a, spec)
  backward: dh = activation_backward(dy, h); cast_transpose.quantize(dh, spec); dbias = dh.sum(0)
and give the same FP8 bytes, amax and scale_inv as those: the activation math is the same code
(activation.py's jit helpers, in fp32), each value is rounded to h's dtype before it is
quantized or summed (as storing a or dh in h's dtype does), and the bytes come from
_fp8_codec's FP8 encoder, stored as uint8 bytes (rowwise) and as int32 words packing four rows
(columnwise), never as FP8-typed values. dbias is summed in fp32 over
the rounded dh, then rounded to dy's dtype: the unfused dh.sum(0) in dh's dtype may round it
differently by an ulp.

Under current scaling the scale needs the amax of all of a (or dh) first: an amax pass computes
the values as the fused kernel does and keeps only their amax (reading h, and dy, once more;
writing nothing else), then the fused kernel casts with the scale made from it. Against the
unfused activation, amax pass and cast, this never writes a or dh in high precision nor reads
them back: the forward moves 3 of the 5 bf16-sized passes over the activation, the backward
5 of 6.

Launches per call (non-empty h): activation_forward_fp8 1; activation_backward_fp8 1 when the
rows are few, else 2; current scaling 2 more (the zeroed amax, the amax pass). The backward
grid is (column blocks, row blocks): with one row block (column_sums.row_split keeps one while
the column blocks alone give about 4 programs per SM) each program walks all M rows and owns
the full column sums of its block, so dbias needs no atomics and no second launch; with more,
each row block writes fp32 partial sums, which column_sums.sum_partials adds in the row
blocks' order (one launch) into dbias.

On CUDA with Triton the kernels run; elsewhere (and for an empty h) the torch references below,
composed of activation.py's reference and _fp8_codec's cast.
"""

from __future__ import annotations

import torch

from . import activation as act_mod
from ._compile import compiled_as_op
from ._fp8_codec import FP8_MAX, alloc_outputs, check_producer_spec, encode_reference
from ._triton import FastLaunch, sm_count, tl, triton, triton_available
from .cast_spec import CastSpec
from .column_sums import row_split, sum_partials

__all__ = [
    "BACKWARD_FP8_CONFIG",
    "BACKWARD_FP8_GATED_CONFIG",
    "FORWARD_FP8_CONFIG",
    "activation_backward_fp8",
    "activation_backward_fp8_reference",
    "activation_forward_fp8",
    "activation_forward_fp8_reference",
]

# (BLOCK_M, BLOCK_N, num_warps). BLOCK_M is a multiple of 16 (_fp8_codec's columnwise
# alignment) so the row blocks that cover M also cover the padding up to Mp. Forward: the tile
# of cast_transpose's CAST_CONFIG, over a 2-D grid. Backward: BLOCK_M rows per loop step over
# a column-block grid, the rows split into blocks until there are about 4 programs per SM
# (column_sums.row_split); BLOCK_N = 64 (GELU backward at 16384 x 8192 on an H200,
# `benchmarks/activation.py --fp8-sweep`: 0.335 ms against 0.403 ms with BLOCK_N = 32 and
# 0.349 ms with (32, 128, 4)); gated activations, which hold two column sets a step, keep
# BLOCK_N = 32 (not yet measured wider).
FORWARD_FP8_CONFIG = (32, 128, 4)
BACKWARD_FP8_CONFIG = (64, 64, 4)
BACKWARD_FP8_GATED_CONFIG = (64, 32, 4)

if triton is not None:
    from ._fp8_codec import (
        _abs_bits,
        _encode,
        _encode_slice,
        _round_as,
        _store_bytes,
        _store_words,
        _tensor_scale,
    )
    from .activation import _act_and_grad, _gate

    @triton.jit
    def _act_values(
        h_ptr, rows, cols, mask, N, limit, alpha, ACT: tl.constexpr, GATED: tl.constexpr
    ):
        """a = act(h) at (rows, cols), fp32, rounded to h's dtype; 0 where masked out."""
        k = N * 2 if GATED else N
        offs = rows.to(tl.int64)[:, None] * k + cols[None, :]
        x = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        a, _ = _act_and_grad(x, limit, alpha, ACT)
        if GATED:
            g = tl.load(h_ptr + offs + N, mask=mask, other=0.0).to(tl.float32)
            a = a * _gate(g, limit, ACT)
        return _round_as(a, h_ptr)

    @triton.jit
    def grads_of(dy, x, g, limit, alpha, ACT: tl.constexpr, GATED: tl.constexpr):
        """(dx1, dx2, a), fp32, unrounded: the gradients for dy (fp32) of the activation's input
        x and (GATED) of its gate input g, and a = act(x) [* gate(g)]. Not gated: dx2 is dx1
        and g is not read."""
        act, dact = _act_and_grad(x, limit, alpha, ACT)
        if GATED:
            gate = _gate(g, limit, ACT)
            dx1 = dy * dact * gate
            dx2 = dy * act
            if ACT == "clamped_silu":
                dx2 = tl.where((g >= -limit) & (g <= limit), dx2, 0.0)
            a = act * gate
        else:
            dx1 = dy * dact
            dx2 = dx1
            a = act
        return dx1, dx2, a

    @triton.jit
    def _grad_values(
        dy_ptr, h_ptr, rows, cols, mask, N, limit, alpha, ACT: tl.constexpr, GATED: tl.constexpr
    ):
        """(dh at (rows, cols), dh at (rows, cols + N)), fp32, rounded to h's dtype; 0 where
        masked out. Not gated: the second is the first."""
        r64 = rows.to(tl.int64)[:, None]
        dy = tl.load(dy_ptr + r64 * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        k = N * 2 if GATED else N
        offs = r64 * k + cols[None, :]
        x = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = x
        if GATED:
            g = tl.load(h_ptr + offs + N, mask=mask, other=0.0).to(tl.float32)
        dx1, dx2, _ = grads_of(dy, x, g, limit, alpha, ACT, GATED)
        return _round_as(dx1, h_ptr), _round_as(dx2, h_ptr)

    @triton.jit
    def _act_amax_kernel(
        dy_ptr,  # (M, N) fp32 / bf16 / fp16, contiguous; read when BACKWARD
        h_ptr,  # (M, K) fp32 / bf16 / fp16, contiguous; K = 2N when GATED else N
        amax_ptr,  # (1,) fp32, zeroed, max-accumulated as int32 bits
        M,
        N,
        limit,  # fp32; clamped_silu only
        alpha,  # fp32; clamped_silu only
        ACT: tl.constexpr,
        GATED: tl.constexpr,
        BACKWARD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """max |a| (forward) or max |dh| (BACKWARD) of tile (pid_m, pid_n), over the values as
        the fused kernels cast them (rounded to h's dtype), into amax: current scaling's pass
        before the cast, which writes nothing else."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        if BACKWARD:
            dx1, dx2 = _grad_values(dy_ptr, h_ptr, rows, cols, mask, N, limit, alpha, ACT, GATED)
            bits = tl.maximum(_abs_bits(dx1), _abs_bits(dx2))
        else:
            a = _act_values(h_ptr, rows, cols, mask, N, limit, alpha, ACT, GATED)
            bits = _abs_bits(a)
        tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32)), tl.max(bits), sem="relaxed")

    @triton.jit
    def _forward_fp8_kernel(
        h_ptr,  # (M, K) fp32 / bf16 / fp16, contiguous; K = 2N when GATED else N
        scale_ptr,  # (1,) fp32
        amax_ptr,  # (1,) fp32, max-accumulated as int32 bits (see cast_transpose)
        scale_inv_ptr,  # (1,) fp32: 1 / scale, written by program (0, 0)
        out_ptr,  # (M, N) fp8 rowwise data, written as uint8 bytes
        out_t_ptr,  # (N, Mp) fp8 columnwise data, written as int32 words when COLUMNWISE
        M,
        N,
        limit,  # fp32; clamped_silu only
        alpha,  # fp32; clamped_silu only
        amax_epsilon,  # fp32; CURRENT only
        FP8_MAX: tl.constexpr,  # 448.0 (e4m3) or 57344.0 (e5m2)
        ACT: tl.constexpr,  # gelu, qgelu, relu, srelu, silu, sigmoid, clamped_silu
        GATED: tl.constexpr,
        COLUMNWISE: tl.constexpr,
        CURRENT: tl.constexpr,  # amax_ptr holds max |a| (read), not a running amax (written)
        POWER_2: tl.constexpr,  # CURRENT only
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        first = (pid_m == 0) & (pid_n == 0)
        scale = _tensor_scale(
            scale_ptr, amax_ptr, scale_inv_ptr, first, amax_epsilon, FP8_MAX, CURRENT, POWER_2
        )
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_in = cols < N
        # Rows 4i + k of the tile, k = 0..3, as four slices: their bytes pack into int32 words.
        group = pid_m * BLOCK_M + 4 * tl.arange(0, BLOCK_M // 4)
        bits = tl.zeros((BLOCK_M // 4, BLOCK_N), tl.int32)
        words = tl.zeros((BLOCK_M // 4, BLOCK_N), tl.int32)
        for k in tl.static_range(4):
            rows = group + k
            row_in = rows < M
            mask = row_in[:, None] & col_in[None, :]
            a = _act_values(h_ptr, rows, cols, mask, N, limit, alpha, ACT, GATED)
            offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
            bits, words = _encode_slice(
                a, k, row_in, offs, mask, scale, bits, words, out_ptr, FP8_MAX, not CURRENT,
                True, COLUMNWISE,
            )  # fmt: skip
        if COLUMNWISE:
            _store_words(out_t_ptr, words, cols, col_in, pid_m * (BLOCK_M // 4), M, BLOCK_M)
        if not CURRENT:
            tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32)), tl.max(bits), sem="relaxed")

    @triton.jit
    def _backward_fp8_kernel(
        dy_ptr,  # (M, N) fp32 / bf16 / fp16, contiguous
        h_ptr,  # (M, K) fp32 / bf16 / fp16, contiguous; K = 2N when GATED else N
        scale_ptr,  # (1,) fp32
        amax_ptr,  # (1,) fp32, max-accumulated as int32 bits (see cast_transpose)
        scale_inv_ptr,  # (1,) fp32: 1 / scale, written by program 0
        out_ptr,  # (M, K) fp8 rowwise data, written as uint8 bytes when ROWWISE
        out_t_ptr,  # (K, Mp) fp8 columnwise data, written as int32 words when COLUMNWISE
        dbias_ptr,  # (K,) dy's dtype: column sums of dh (when not SPLIT)
        partial_ptr,  # (splits, K) fp32: each row block's column sums of dh (when SPLIT)
        M,
        N,
        rows_per_program,  # a multiple of BLOCK_M
        limit,  # fp32; clamped_silu only
        alpha,  # fp32; clamped_silu only
        amax_epsilon,  # fp32; CURRENT only
        FP8_MAX: tl.constexpr,  # 448.0 (e4m3) or 57344.0 (e5m2)
        ACT: tl.constexpr,  # gelu, qgelu, relu, srelu, silu, sigmoid, clamped_silu
        GATED: tl.constexpr,
        ROWWISE: tl.constexpr,
        COLUMNWISE: tl.constexpr,
        SPLIT: tl.constexpr,
        CURRENT: tl.constexpr,  # amax_ptr holds max |dh| (read), not a running amax (written)
        POWER_2: tl.constexpr,  # CURRENT only
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """Program (p, q) owns columns [p BLOCK_N, (p + 1) BLOCK_N) of dh (and the same columns
        + N when GATED) over rows [q rows_per_program, (q + 1) rows_per_program): with one row
        block (not SPLIT) it writes the columns' full sums to dbias, else its partial sums to
        row q of partial (summed afterwards in a fixed order: deterministic)."""
        pid = tl.program_id(0)
        pid_m = tl.program_id(1)
        first = (pid == 0) & (pid_m == 0)
        scale = _tensor_scale(
            scale_ptr, amax_ptr, scale_inv_ptr, first, amax_epsilon, FP8_MAX, CURRENT, POWER_2
        )
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        col_in = cols < N
        k_cols = N * 2 if GATED else N
        bits = tl.zeros((BLOCK_M // 4, BLOCK_N), tl.int32)
        sum1 = tl.zeros((BLOCK_M // 4, BLOCK_N), tl.float32)
        sum2 = tl.zeros((BLOCK_M // 4, BLOCK_N), tl.float32)
        # Steps of BLOCK_M rows (a multiple of 16): the last one also covers the padding to Mp.
        row0 = pid_m * rows_per_program
        for start in range(row0, tl.minimum(row0 + rows_per_program, M), BLOCK_M):
            group = start + 4 * tl.arange(0, BLOCK_M // 4)
            words1 = tl.zeros((BLOCK_M // 4, BLOCK_N), tl.int32)
            words2 = tl.zeros((BLOCK_M // 4, BLOCK_N), tl.int32)
            for k in tl.static_range(4):
                rows = group + k
                row_in = rows < M
                mask = row_in[:, None] & col_in[None, :]
                dx1, dx2 = _grad_values(
                    dy_ptr, h_ptr, rows, cols, mask, N, limit, alpha, ACT, GATED
                )
                offs = rows.to(tl.int64)[:, None] * k_cols + cols[None, :]
                # Written out rather than through _encode_slice: that form measured 5% slower
                # here (H100, GELU backward at 8192 x 16384, benchmarks/kernel_times.py).
                bits = tl.maximum(bits, _abs_bits(dx1))
                sum1 += dx1
                code1 = _encode(dx1, row_in, scale, FP8_MAX)
                words1 = words1 | (code1 << (8 * k))
                if ROWWISE:
                    _store_bytes(out_ptr, offs, code1, mask)
                if GATED:
                    bits = tl.maximum(bits, _abs_bits(dx2))
                    sum2 += dx2
                    code2 = _encode(dx2, row_in, scale, FP8_MAX)
                    words2 = words2 | (code2 << (8 * k))
                    if ROWWISE:
                        _store_bytes(out_ptr, offs + N, code2, mask)
            if COLUMNWISE:
                _store_words(out_t_ptr, words1, cols, col_in, start // 4, M, BLOCK_M)
                if GATED:
                    _store_words(out_t_ptr, words2, cols + N, col_in, start // 4, M, BLOCK_M)
        if SPLIT:
            part = partial_ptr + pid_m.to(tl.int64) * k_cols
            tl.store(part + cols, tl.sum(sum1, 0), mask=col_in)
            if GATED:
                tl.store(part + N + cols, tl.sum(sum2, 0), mask=col_in)
        else:
            # Rounded in fp32 first, so the cast is exact (the interpreter's cast truncates).
            bias_ty = dbias_ptr.dtype.element_ty
            dbias1 = _round_as(tl.sum(sum1, 0), dbias_ptr).to(bias_ty)
            tl.store(dbias_ptr + cols, dbias1, mask=col_in)
            if GATED:
                dbias2 = _round_as(tl.sum(sum2, 0), dbias_ptr).to(bias_ty)
                tl.store(dbias_ptr + N + cols, dbias2, mask=col_in)
        if not CURRENT:
            tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32)), tl.max(bits), sem="relaxed")

    _launch_forward_fp8 = FastLaunch(_forward_fp8_kernel)
    _launch_backward_fp8 = FastLaunch(_backward_fp8_kernel)
    _launch_act_amax = FastLaunch(_act_amax_kernel)


# ----------------------------------------------------------------------------------------------
# Public API and launchers
# ----------------------------------------------------------------------------------------------


@compiled_as_op(
    "(Tensor h, str name, float limit, float alpha, CastSpec spec) -> (Tensor, Tensor, Tensor)"
)
def activation_forward_fp8(
    h: torch.Tensor, name: str, limit: float, alpha: float, spec: CastSpec
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """a = name(h) quantized as spec says (rowwise always): h (M, K) -> (rowwise (M, N),
    columnwise (N, Mp) or None, scale_inv (1,)). Delayed scaling max-accumulates max |a| into
    spec.amax (1,); current scaling makes the scale from max |a| (an amax pass over h first).
    Same bytes as activation_forward then cast_transpose.quantize."""
    act, gated = act_mod._spec(name)
    n = act_mod._out_cols(h, gated, name)
    check_producer_spec(spec, "activation_forward_fp8", needs_rowwise=True, current=True)
    h2d = _as_2d(h)
    if h2d.is_cuda and triton_available() and h2d.numel() > 0:
        return _forward_fp8_triton(h2d, n, act, gated, limit, alpha, spec)
    return activation_forward_fp8_reference(h2d, name, limit, alpha, spec)


@compiled_as_op(
    "(Tensor dy, Tensor h, str name, float limit, float alpha, CastSpec spec) -> "
    "(Tensor, Tensor, Tensor, Tensor)"
)
def activation_backward_fp8(
    dy: torch.Tensor, h: torch.Tensor, name: str, limit: float, alpha: float, spec: CastSpec
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """dh = dy * d name(h) / dh quantized as spec says: dy (M, N), h (M, K) -> (rowwise (M, K)
    or None, columnwise (K, Mp) or None, scale_inv (1,), dbias (K,) in dy's dtype), dbias the
    column sums of dh. Delayed scaling max-accumulates max |dh| into spec.amax (1,); current
    scaling makes the scale from max |dh| (an amax pass over dy and h first)."""
    act, gated = act_mod._spec(name)
    n = act_mod._out_cols(h, gated, name)
    act_mod._check_dy(dy, h, n, name)
    check_producer_spec(spec, "activation_backward_fp8", needs_rowwise=False, current=True)
    h2d, dy2d = _as_2d(h), _as_2d(dy)
    if h2d.is_cuda and triton_available() and h2d.numel() > 0:
        return _backward_fp8_triton(dy2d, h2d, n, act, gated, limit, alpha, spec)
    return activation_backward_fp8_reference(dy2d, h2d, name, limit, alpha, spec)


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    """x (..., C) as a contiguous (prod(...), C)."""
    x2d = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return x2d if x2d.is_contiguous() else x2d.contiguous()


def _forward_fp8_triton(
    h: torch.Tensor,
    n: int,
    act: str,
    gated: bool,
    limit: float,
    alpha: float,
    spec: CastSpec,
    config: tuple[int, int, int] = FORWARD_FP8_CONFIG,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Launch _forward_fp8_kernel on a contiguous, non-empty h (M, K); a is (M, n). Current
    scaling (spec.scale None): the amax pass first (zeroing its buffer, _act_amax_kernel)."""
    rows = h.shape[0]
    block_m, block_n, num_warps = config
    fp8_dtype, columnwise = spec.fp8_dtype, spec.columnwise
    current = spec.scale is None
    scale_inv = torch.empty(1, dtype=torch.float32, device=h.device)
    if current:
        amax = _act_amax(h, h, rows, n, act, gated, limit, alpha, False, config)
        scale = amax  # not read
    else:
        scale, amax = spec.scale, spec.amax
    data, data_t = alloc_outputs(rows, n, fp8_dtype, h.device, True, columnwise)
    out_t = scale_inv if data_t is None else data_t  # never stored to when not asked for
    grid = ((rows + block_m - 1) // block_m, (n + block_n - 1) // block_n, 1)
    power_2 = bool(spec.power_2_scale)
    key = (
        h.dtype, fp8_dtype, act, gated, columnwise, config, current, power_2,
        rows == 1, rows & 15, rows >> 31, n == 1, n & 15, n >> 31,
        h.data_ptr() & 15, scale.data_ptr() & 15, amax.data_ptr() & 15,
        scale_inv.data_ptr() & 15, data.data_ptr() & 15, out_t.data_ptr() & 15,
    )  # fmt: skip
    _launch_forward_fp8(
        key, grid, num_warps, h, scale, amax, scale_inv, data, out_t, rows, n, float(limit),
        float(alpha), float(spec.amax_epsilon), FP8_MAX[fp8_dtype], act, gated, columnwise,
        current, power_2, block_m, block_n,
    )  # fmt: skip
    return data, data_t, scale_inv


def _act_amax(dy, h, rows, n, act, gated, limit, alpha, backward: bool, config) -> torch.Tensor:
    """(1,) fp32: max |a| (forward) or max |dh| (backward) over h (M, K) (and dy (M, n)), the
    values rounded to h's dtype as the fused kernels cast them; two launches (the zeroed
    buffer, _act_amax_kernel over config's tiles)."""
    block_m, block_n, num_warps = config
    amax = torch.zeros(1, dtype=torch.float32, device=h.device)
    grid = ((rows + block_m - 1) // block_m, (n + block_n - 1) // block_n, 1)
    key = (
        dy.dtype, h.dtype, act, gated, backward, config,
        rows == 1, rows & 15, rows >> 31, n == 1, n & 15, n >> 31,
        dy.data_ptr() & 15, h.data_ptr() & 15, amax.data_ptr() & 15,
    )  # fmt: skip
    _launch_act_amax(
        key, grid, num_warps, dy, h, amax, rows, n, float(limit), float(alpha), act, gated,
        backward, block_m, block_n,
    )  # fmt: skip
    return amax


def _backward_fp8_triton(
    dy: torch.Tensor,
    h: torch.Tensor,
    n: int,
    act: str,
    gated: bool,
    limit: float,
    alpha: float,
    spec: CastSpec,
    config: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Launch _backward_fp8_kernel on contiguous dy (M, n) and non-empty h (M, K) (config:
    BACKWARD_FP8_GATED_CONFIG or BACKWARD_FP8_CONFIG by default)."""
    rows, cols = h.shape
    if config is None:
        config = BACKWARD_FP8_GATED_CONFIG if gated else BACKWARD_FP8_CONFIG
    block_m, block_n, num_warps = config
    fp8_dtype, rowwise, columnwise = spec.fp8_dtype, spec.rowwise, spec.columnwise
    current = spec.scale is None
    if current:  # the amax pass first, over the forward's tiles
        amax = _act_amax(dy, h, rows, n, act, gated, limit, alpha, True, FORWARD_FP8_CONFIG)
        scale = amax  # not read
    else:
        scale, amax = spec.scale, spec.amax
    col_blocks = (n + block_n - 1) // block_n
    sms = sm_count(h.device.index) if h.is_cuda else 1  # the interpreter's tests: a few blocks
    rows_per, splits = row_split(rows, col_blocks, block_m, sms)
    scale_inv = torch.empty(1, dtype=torch.float32, device=h.device)
    data, data_t = alloc_outputs(rows, cols, fp8_dtype, h.device, rowwise, columnwise)
    split = splits > 1
    if split:
        partial = torch.empty(splits, cols, dtype=torch.float32, device=h.device)
        dbias = partial
    else:
        dbias = torch.empty(cols, dtype=dy.dtype, device=h.device)
        partial = dbias  # never stored to
    out = scale_inv if data is None else data  # never stored to when not asked for
    out_t = scale_inv if data_t is None else data_t
    power_2 = bool(spec.power_2_scale)
    key = (
        dy.dtype, h.dtype, fp8_dtype, act, gated, rowwise, columnwise, config, split, current,
        power_2, rows == 1, rows & 15, rows >> 31, n == 1, n & 15, n >> 31, rows_per & 15,
        dy.data_ptr() & 15, h.data_ptr() & 15, scale.data_ptr() & 15, amax.data_ptr() & 15,
        scale_inv.data_ptr() & 15, out.data_ptr() & 15, out_t.data_ptr() & 15,
        dbias.data_ptr() & 15,
    )  # fmt: skip
    _launch_backward_fp8(
        key, (col_blocks, splits, 1), num_warps, dy, h, scale, amax, scale_inv, out, out_t,
        dbias, partial, rows, n, rows_per, float(limit), float(alpha), float(spec.amax_epsilon),
        FP8_MAX[fp8_dtype], act, gated, rowwise, columnwise, split, current, power_2, block_m,
        block_n,
    )  # fmt: skip
    if split:
        dbias = sum_partials(partial, dy.dtype)  # the row blocks' sums in a fixed order
    return data, data_t, scale_inv, dbias


# ----------------------------------------------------------------------------------------------
# Torch references: the same functions, used on CPU and in tests
# ----------------------------------------------------------------------------------------------


def activation_forward_fp8_reference(
    h: torch.Tensor, name: str, limit: float, alpha: float, spec: CastSpec
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Torch reference of activation_forward_fp8: h (M, K) -> (rowwise (M, N), columnwise
    (N, Mp) or None, scale_inv (1,))."""
    a = act_mod.activation_forward_reference(h, name, limit, alpha)
    return encode_reference(a.reshape(-1, a.shape[-1]), spec)


def activation_backward_fp8_reference(
    dy: torch.Tensor, h: torch.Tensor, name: str, limit: float, alpha: float, spec: CastSpec
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Torch reference of activation_backward_fp8: dy (M, N), h (M, K) -> (rowwise (M, K) or
    None, columnwise (K, Mp) or None, scale_inv (1,), dbias (K,) in dy's dtype, summed in
    fp32)."""
    dh = act_mod.activation_backward_reference(dy, h, name, limit, alpha)
    dh2d = dh.reshape(-1, dh.shape[-1])
    data, data_t, scale_inv = encode_reference(dh2d, spec)
    return data, data_t, scale_inv, dh2d.float().sum(0).to(dy.dtype)
