"""LayerNormMLP's activation fused with Float8BlockScaling's 1x128 cast, forward and backward,
and the 1x128 cast of a GEMM's output gradient with its bias gradient (the "identity"
activation).

Legend: h (M, K) the activation's input, K = 2N for gated activations (else N); a = act(h)
(M, N); da (M, N) the gradient of a; dh (M, K) the gradient of h; dy (M, C) a GEMM's output
gradient. Leading dims are allowed ((..., K)); the values are cast as 2-D (rows, cols).

These give the bytes and scales of the unfused composition, bit for bit:
  forward:  a = activation.activation_forward(h); block_cast.block_quantize(a, ..., 1, ...)
  backward: dh = activation.activation_backward(da, h); block_quantize(dh, ..., 1, ...)
  identity: block_quantize(dy, ..., 1, ...)
in block_cast's 1x128 layout (rowwise data (M, C) + scale_inv (ceil(C/128), M); columnwise
data (C, M) + scale_inv (ceil(M/128), C)): the activation math is activation.py's jit code in
fp32, each value is rounded to h's dtype (as storing a or dh in h's dtype does) before its
blocks' amaxes are taken, and the casts are _block_tiles.py's device functions. How the values
are cast comes in a CastSpec of the current form (scale and amax None): fp8_dtype, the usages,
amax_epsilon and power_2_scale, applied block by block (block_cast's scale rule).

dbias (backward, identity) is the column sums of dh (of dy), summed in fp32 over the values as
rounded to h's dtype, then rounded to da's (dy's) dtype. The unfused path's dh.sum(0) (torch,
fp32 accumulation in another order) may round differently by an ulp of that dtype: dbias is
within the tolerance table's entry for its dtype, and bit-equal where the fp32 sums are exact.
It is deterministic: each 128 x 128 tile writes its column sums to an fp32 (ceil(M/128), C)
buffer and one small kernel sums each column over the row blocks in a fixed order (no atomics).

Kernel: one program per 128 x 128 tile of the output, read once as four slices of 32 rows
(rows 4i + k), rowwise and columnwise blocks cast from the same registers (block_cast's tile
scheme). The forward tile reads h's columns c and c + N (gated). A backward tile of a gated
activation maps each output column to its pair: column j < N (dh of x1) and j + N (dh of x2)
both need da[:, j], h[:, j] and h[:, j + N], so each dh tile reads the band of da and h it
needs: every input byte is read twice, the second time expected from L2 (launch order: a row
band's tiles one after another, BACKWARD_CONFIG's group_m 1; not measured yet). Launches per
call (M, C > 0): forward 1, backward and identity 2 (the tile kernel, the column sums). On CPU
tensors (and on CUDA without Triton, and for empty outputs) the torch references below run.
"""

from __future__ import annotations

import math

import torch

from . import activation as act_mod
from ._compile import compiled_as_op
from ._fp8_codec import FP8_MAX, check_fp8_dtype
from ._triton import FastLaunch, int_key, ptr_key, tl, triton, triton_available
from .block_cast import _INF_SCALE_BITS, HP_DTYPES, _check_kernel_sizes, block_quantize_reference
from .block_layout import BLOCK
from .cast_spec import CastSpec

__all__ = [
    "BACKWARD_CONFIG",
    "FORWARD_CONFIG",
    "SUM_CONFIG",
    "activation_backward_block",
    "activation_backward_block_reference",
    "activation_forward_block",
    "activation_forward_block_reference",
    "block_quantize_dbias",
    "block_quantize_dbias_reference",
]

# (num_warps, group_m) of the tile kernel: one program per 128 x 128 tile, launched in bands
# of group_m rows of tiles (block_cast's order; group_m 1: a row band's tiles one after
# another, so a gated backward's second read of a band finds it in L2). From
# benchmarks/fused_block.py on an H100 (2026-11-27, 8192 x 16384 bf16): forward 8 warps (gelu
# 0.30 ms, swiglu 0.20 ms, against 0.38 / 0.24 ms for the activation kernel and the cast; 4
# warps spill); output gradient with its bias gradient 0.135 ms against 0.166 ms; the fused
# activation backward (0.60 ms against 0.53-0.57 ms) is not used by the modules.
FORWARD_CONFIG = (8, 8)
BACKWARD_CONFIG = (8, 1)
# (BLOCK_R, BLOCK_C, num_warps) of the column-sum kernel: BLOCK_C columns a program, the row
# blocks' partial sums BLOCK_R at a time.
SUM_CONFIG = (32, 64, 4)

if triton is not None:
    from ._block_tiles import _cast_1x128_slices
    from ._fp8_codec import _round_as
    from .activation import _act_and_grad, _gate
    from .activation_fp8 import grads_of

    @triton.jit
    def _slice_values(
        h_tile, da_tile, r, j, first, rows, j_in, N, limit, alpha,
        ACT: tl.constexpr, GATED: tl.constexpr, BACKWARD: tl.constexpr,
    ):  # fmt: skip
        """fp32 values of tile rows r (< rows) at input columns j (where j_in), 0 elsewhere:
        a = act(h) (forward), dh (BACKWARD: dh of x1 where `first`, of x2 elsewhere), rounded
        to h's dtype; or da itself (ACT "identity"). h_tile, da_tile: the tile's first row."""
        mask = (r < rows)[:, None] & j_in[None, :]
        da_offs = r[:, None] * N + j[None, :]
        if ACT == "identity":
            return tl.load(da_tile + da_offs, mask=mask, other=0.0).to(tl.float32)
        h_offs = r[:, None] * (2 * N if GATED else N) + j[None, :]
        x = tl.load(h_tile + h_offs, mask=mask, other=0.0).to(tl.float32)
        g = x
        if GATED:
            g = tl.load(h_tile + h_offs + N, mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:
            dy = tl.load(da_tile + da_offs, mask=mask, other=0.0).to(tl.float32)
            dx1, dx2, _ = grads_of(dy, x, g, limit, alpha, ACT, GATED)
            v = tl.where(first[None, :], dx1, dx2)
        else:
            v, _ = _act_and_grad(x, limit, alpha, ACT)
            if GATED:
                v = v * _gate(g, limit, ACT)
        return tl.where(mask, _round_as(v, h_tile), 0.0)

    @triton.jit
    def _act_block_kernel(
        h_ptr,  # (M, 2N) when GATED else (M, N); fp32 / bf16 / fp16, contiguous (identity: dy)
        da_ptr,  # (M, N) when BACKWARD: the gradient of a (identity: dy (M, C), N = C)
        out_ptr,  # (M, C) fp8 rowwise data, written as uint8 bytes when ROWWISE
        s_ptr,  # (ceil(C/128), M) fp32 rowwise scale_inv
        out_t_ptr,  # (C, M) fp8 columnwise data, written as int32 words or bytes
        s_t_ptr,  # (ceil(M/128), C) fp32 columnwise scale_inv
        partial_ptr,  # (ceil(M/128), C) fp32 per-tile column sums when DBIAS
        M,
        N,
        C,  # output columns: N (forward), K (backward), dy's (identity)
        eps,  # fp32 amax floor
        limit,  # fp32; clamped_silu only
        alpha,  # fp32; clamped_silu only
        FP8_MAX: tl.constexpr,  # 448.0 (e4m3) or 57344.0 (e5m2)
        INF_BITS: tl.constexpr,  # bits of the scale where fp8_max / amax overflows
        POWER_2: tl.constexpr,
        ROWWISE: tl.constexpr,
        COLUMNWISE: tl.constexpr,
        ACT: tl.constexpr,  # activation.py's kernel names, or "identity"
        GATED: tl.constexpr,
        BACKWARD: tl.constexpr,
        DBIAS: tl.constexpr,
        BLOCK: tl.constexpr,  # 128
        WORDS: tl.constexpr,  # M % 4 == 0: columnwise bytes stored as int32 words
        GROUP_M: tl.constexpr,  # the tile order (bands of GROUP_M rows of tiles)
    ):
        """Program (p0, p1, p2): the tile of row block p2 GROUP_M + p0, column block p1."""
        pid_m = tl.program_id(2) * GROUP_M + tl.program_id(0)
        if pid_m < tl.cdiv(M, BLOCK):
            row0 = pid_m * BLOCK
            col0 = tl.program_id(1) * BLOCK
            rows = M - row0
            r = 4 * tl.arange(0, BLOCK // 4)
            c = tl.arange(0, BLOCK)
            col = col0 + c
            col_in = col < C
            first = col < N  # the x1 half of a gated backward's dh
            j = col
            if GATED and BACKWARD:
                j = tl.where(first, col, col - N)
            h_tile = h_ptr + row0.to(tl.int64) * (2 * N if GATED else N)
            da_tile = da_ptr + row0.to(tl.int64) * N
            v0 = _slice_values(
                h_tile, da_tile, r, j, first, rows, col_in, N, limit, alpha, ACT, GATED, BACKWARD
            )
            v1 = _slice_values(
                h_tile, da_tile, r + 1, j, first, rows, col_in, N, limit, alpha, ACT, GATED,
                BACKWARD,
            )  # fmt: skip
            v2 = _slice_values(
                h_tile, da_tile, r + 2, j, first, rows, col_in, N, limit, alpha, ACT, GATED,
                BACKWARD,
            )  # fmt: skip
            v3 = _slice_values(
                h_tile, da_tile, r + 3, j, first, rows, col_in, N, limit, alpha, ACT, GATED,
                BACKWARD,
            )  # fmt: skip
            _cast_1x128_slices(
                v0, v1, v2, v3, r, c, rows, col_in, out_ptr, s_ptr, out_t_ptr, s_t_ptr, M, C,
                row0, pid_m, col0, eps, FP8_MAX, INF_BITS, POWER_2, ROWWISE, COLUMNWISE, BLOCK,
                WORDS,
            )  # fmt: skip
            if DBIAS:
                part = tl.sum((v0 + v1) + (v2 + v3), axis=0)
                tl.store(partial_ptr + pid_m.to(tl.int64) * C + col, part, mask=col_in)

    @triton.jit
    def _column_sum_kernel(
        partial_ptr,  # (R, C) fp32, contiguous
        out_ptr,  # (C,) fp32 / bf16 / fp16: the column sums, rounded once
        R,
        C,
        BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        """Columns [p BLOCK_C, (p + 1) BLOCK_C) of partial summed over its R rows, BLOCK_R rows
        a step then across them: a fixed order for given R (deterministic)."""
        cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        col_in = cols < C
        acc = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
        for start in range(0, R, BLOCK_R):
            rows = start + tl.arange(0, BLOCK_R)
            mask = (rows < R)[:, None] & col_in[None, :]
            offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
            acc += tl.load(partial_ptr + offs, mask=mask, other=0.0)
        # Rounded in fp32 first, so the cast is exact (the interpreter's bf16 cast truncates).
        total = _round_as(tl.sum(acc, axis=0), out_ptr).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + cols, total, mask=col_in)

    _launch_tiles = FastLaunch(_act_block_kernel)
    _launch_sum = FastLaunch(_column_sum_kernel)


# ----------------------------------------------------------------------------------------------
# Public API and launchers
# ----------------------------------------------------------------------------------------------


@compiled_as_op(
    "(Tensor h, str name, float limit, float alpha, CastSpec spec) -> "
    "(Tensor, Tensor, Tensor, Tensor)"
)
def activation_forward_block(
    h: torch.Tensor, name: str, limit: float, alpha: float, spec: CastSpec
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """a = name(h) cast in 1x128 blocks as spec says (current form): h (..., K) -> (data (M, N),
    scale_inv (ceil(N/128), M), data_t (N, M), scale_inv_t (ceil(M/128), N)), a usage not asked
    for as Nones. Same bytes as activation_forward then block_quantize."""
    act, gated = act_mod._spec(name)
    n = act_mod._out_cols(h, gated, name)
    _check_spec(spec, "activation_forward_block", needs_usage=True)
    h2d = _as_2d(h)
    if h2d.is_cuda and triton_available() and h2d.shape[0] * n > 0:
        _check_kernel_sizes(h2d)
        return _forward_triton(h2d, n, act, gated, limit, alpha, spec)
    return activation_forward_block_reference(h2d, name, limit, alpha, spec)


@compiled_as_op(
    "(Tensor da, Tensor h, str name, float limit, float alpha, CastSpec spec) -> "
    "(Tensor, Tensor, Tensor, Tensor, Tensor)"
)
def activation_backward_block(
    da: torch.Tensor, h: torch.Tensor, name: str, limit: float, alpha: float, spec: CastSpec
) -> tuple[
    torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor
]:
    """dh = da * d name(h) / dh cast in 1x128 blocks as spec says (current form; usages may
    both be False: dbias alone): da (..., N), h (..., K) -> (data (M, K), scale_inv, data_t
    (K, M), scale_inv_t, dbias (K,) in da's dtype), dbias the column sums of dh."""
    act, gated = act_mod._spec(name)
    n = act_mod._out_cols(h, gated, name)
    act_mod._check_dy(da, h, n, name)
    _check_spec(spec, "activation_backward_block", needs_usage=False)
    h2d, da2d = _as_2d(h), _as_2d(da)
    if h2d.is_cuda and triton_available() and h2d.numel() > 0:
        _check_kernel_sizes(h2d)
        return _backward_triton(da2d, h2d, n, act, gated, limit, alpha, spec)
    return activation_backward_block_reference(da2d, h2d, name, limit, alpha, spec)


@compiled_as_op("(Tensor dy, CastSpec spec) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
def block_quantize_dbias(
    dy: torch.Tensor, spec: CastSpec
) -> tuple[
    torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor
]:
    """dy (..., C) cast in 1x128 blocks as spec says (current form; usages may both be False)
    with its column sums: (data (M, C), scale_inv, data_t (C, M), scale_inv_t, dbias (C,) in
    dy's dtype). Same bytes as block_quantize(dy, ..., 1, ...); one tile launch and one sum."""
    if not isinstance(dy, torch.Tensor) or dy.dtype not in HP_DTYPES or dy.dim() == 0:
        got = f"{dy.dtype} {tuple(dy.shape)}" if isinstance(dy, torch.Tensor) else type(dy)
        raise TypeError(f"dy must be a float32, bfloat16 or float16 tensor (..., C), got {got}")
    _check_spec(spec, "block_quantize_dbias", needs_usage=False)
    dy2d = _as_2d(dy)
    if dy2d.is_cuda and triton_available() and dy2d.numel() > 0:
        _check_kernel_sizes(dy2d)
        return _dbias_triton(dy2d, spec)
    return block_quantize_dbias_reference(dy2d, spec)


def _check_spec(spec: CastSpec, op: str, needs_usage: bool) -> None:
    """The CastSpec rules of these casts: an FP8 dtype, the current form (each block's scale
    from its own amax: no scale or amax tensor), a finite amax_epsilon >= 0, and (forward) at
    least one usage."""
    if not isinstance(spec, CastSpec):
        raise TypeError(f"{op}: spec must be a CastSpec, got {type(spec).__name__}")
    check_fp8_dtype(spec.fp8_dtype)
    if spec.scale is not None or spec.amax is not None:
        raise ValueError(
            f"{op}: block scaling computes each block's scale from its own amax: spec.scale "
            f"and spec.amax must be None, got {spec!r}"
        )
    eps = float(spec.amax_epsilon)
    if not (math.isfinite(eps) and eps >= 0.0):
        raise ValueError(f"{op}: spec.amax_epsilon must be finite and >= 0, got {eps}")
    if needs_usage and not (spec.rowwise or spec.columnwise):
        raise ValueError(f"{op}: at least one of spec.rowwise and spec.columnwise must be True")


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    """x (..., C) as a contiguous (prod(...), C)."""
    x2d = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return x2d if x2d.is_contiguous() else x2d.contiguous()


def _alloc(rows: int, cols: int, spec: CastSpec, device, dbias: bool):
    """Uninitialized outputs (data, scale_inv, data_t, scale_inv_t, partial sums), a usage not
    asked for (and the sums without dbias) as None."""
    fp8, n_m, n_c = spec.fp8_dtype, -(-rows // BLOCK), -(-cols // BLOCK)
    data = scale = data_t = scale_t = partial = None
    if spec.rowwise:
        data = torch.empty(rows, cols, dtype=fp8, device=device)
        scale = torch.empty(n_c, rows, dtype=torch.float32, device=device)
    if spec.columnwise:
        data_t = torch.empty(cols, rows, dtype=fp8, device=device)
        scale_t = torch.empty(n_m, cols, dtype=torch.float32, device=device)
    if dbias:
        partial = torch.empty(n_m, cols, dtype=torch.float32, device=device)
    return data, scale, data_t, scale_t, partial


def _forward_triton(h, n: int, act: str, gated: bool, limit, alpha, spec, config=FORWARD_CONFIG):
    """The tile kernel on contiguous h (M, K), M, n > 0: a (M, n)'s four outputs."""
    values = (act, gated, False, h.dtype)
    return _launch(h, h, n, n, values, limit, alpha, spec, False, config)[:4]


def _backward_triton(
    da, h, n: int, act: str, gated: bool, limit, alpha, spec, config=BACKWARD_CONFIG
):
    """The tile kernel and the column sums on contiguous da (M, n) and h (M, K), M, K > 0:
    dh's four outputs and dbias (K,)."""
    values = (act, gated, True, h.dtype)
    return _launch(h, da, n, h.shape[1], values, limit, alpha, spec, True, config)


def _dbias_triton(dy, spec, config=BACKWARD_CONFIG):
    """The tile kernel (identity) and the column sums on contiguous dy (M, C), M, C > 0: its
    four outputs and dbias (C,)."""
    cols = dy.shape[1]
    values = ("identity", False, True, dy.dtype)
    return _launch(dy, dy, cols, cols, values, 0.0, 0.0, spec, True, config)


def _launch(h, da, n: int, cols: int, values, limit, alpha, spec: CastSpec, dbias: bool, config):
    """Launch _act_block_kernel on contiguous 2-D h and da (rows > 0, cols > 0) for output
    columns `cols` (N the activation's width; identity: cols), values = (ACT, GATED, BACKWARD,
    the values' dtype); then, with dbias, _column_sum_kernel. Returns the four outputs, and
    dbias (cols,) in da's dtype with dbias."""
    rows = h.shape[0]
    act, gated, backward, value_dtype = values
    outs = _alloc(rows, cols, spec, h.device, dbias)
    num_warps, group_m = config
    n_m = -(-rows // BLOCK)
    group_m = max(group_m, -(-n_m // 65535))  # grid axis 2 holds at most 65535 bands
    grid = (group_m, -(-cols // BLOCK), -(-n_m // group_m))
    consts = (
        FP8_MAX[spec.fp8_dtype], _INF_SCALE_BITS[value_dtype], bool(spec.power_2_scale),
        bool(spec.rowwise), bool(spec.columnwise), act, gated, backward, dbias, BLOCK,
        rows % 4 == 0, group_m,
    )  # fmt: skip
    ptrs = [h if t is None else t for t in outs]  # h in place of an output not asked for
    key = (h.dtype, da.dtype, ptrs[0].dtype, ptrs[2].dtype, consts, num_warps)
    key += ptr_key(h, da, *ptrs) + int_key(rows) + int_key(n) + int_key(cols)
    eps = float(spec.amax_epsilon)
    _launch_tiles(
        key, grid, num_warps, h, da, *ptrs, rows, n, cols, eps, float(limit), float(alpha),
        *consts,
    )  # fmt: skip
    if not dbias:
        return (*outs[:4], None)
    return (*outs[:4], _column_sums(outs[4], da.dtype))


def _column_sums(partial: torch.Tensor, dtype: torch.dtype, config=SUM_CONFIG) -> torch.Tensor:
    """partial (R, C) fp32 summed over its rows in a fixed order: (C,) in `dtype`."""
    block_r, block_c, num_warps = config
    part_rows, cols = partial.shape
    out = torch.empty(cols, dtype=dtype, device=partial.device)
    key = (dtype, block_r, block_c, num_warps, *ptr_key(partial, out))
    key += int_key(part_rows) + int_key(cols)
    grid = (-(-cols // block_c), 1, 1)
    _launch_sum(key, grid, num_warps, partial, out, part_rows, cols, block_r, block_c)
    return out


# ----------------------------------------------------------------------------------------------
# Torch references: the unfused compositions, used on CPU and in tests
# ----------------------------------------------------------------------------------------------


def _cast_reference(x2d: torch.Tensor, spec: CastSpec):
    """block_quantize_reference of x2d (M, C) in 1x128 blocks under spec (Nones where no
    usage is asked for)."""
    return block_quantize_reference(
        x2d, spec.fp8_dtype, 1, spec.rowwise, spec.columnwise, spec.power_2_scale,
        spec.amax_epsilon,
    )  # fmt: skip


def activation_forward_block_reference(
    h: torch.Tensor, name: str, limit: float, alpha: float, spec: CastSpec
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Torch reference of activation_forward_block: activation_forward_reference, then the 1x128
    cast of a (M, N) in h's dtype."""
    a = act_mod.activation_forward_reference(h, name, limit, alpha)
    return _cast_reference(a.reshape(-1, a.shape[-1]), spec)


def activation_backward_block_reference(
    da: torch.Tensor, h: torch.Tensor, name: str, limit: float, alpha: float, spec: CastSpec
) -> tuple[
    torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor
]:
    """Torch reference of activation_backward_block: activation_backward_reference, the 1x128
    cast of dh (M, K) in h's dtype, and dbias = dh's column sums in fp32, in da's dtype."""
    dh = act_mod.activation_backward_reference(da, h, name, limit, alpha)
    dh2d = dh.reshape(-1, dh.shape[-1])
    return (*_cast_reference(dh2d, spec), dh2d.float().sum(0).to(da.dtype))


def block_quantize_dbias_reference(
    dy: torch.Tensor, spec: CastSpec
) -> tuple[
    torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor
]:
    """Torch reference of block_quantize_dbias: the 1x128 cast of dy (M, C) and its column sums
    in fp32, in dy's dtype."""
    dy2d = dy.reshape(-1, dy.shape[-1])
    return (*_cast_reference(dy2d, spec), dy2d.float().sum(0).to(dy.dtype))
