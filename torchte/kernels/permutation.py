"""Token permutation for mixture-of-experts: permute, unpermute and their gradients.

Shape legend: N tokens, H hidden, E experts, K routes per token (top-k), R permuted rows.

Rows move as a row-id map says (permutation_maps.py makes the maps, re-exported here): a mask
map (N, 2E+1) int32 from a routing map, an index map (K*N,) int32 from expert indices (a
chunk-sort map is an index map with K = 1). `index_topk` is 0 for a mask map, else K. A route
whose row is -1 or not below the number of permuted rows is dropped: permute does not write
it, unpermute reads it as zero. `pad_offsets` (E,) shifts expert e's rows by pad_offsets[e]
(mask maps), leaving zero rows between the experts' blocks.

Launchers (each with a torch reference `<name>_reference` of the same signature, in
permutation_reference.py):
  permute_rows      rows scattered to their routes' rows (+ probs); rows nothing writes are 0
  unpermute_rows    each token's routes gathered and summed in fp32 (times merging probs)
  unpermute_rows_backward  the gradients of unpermute_rows with merging probs

On CUDA with Triton one kernel runs per call (a padded permute of unpermute's gradient adds
one: the routes per expert read back from the map); elsewhere the references. Both give the
same permuted bytes; sums in fp32 add the routes in the map's order, and the kernels are
compiled without fused multiply-add, so unpermute matches the reference bit for bit (the
merging-probs gradient, a dot product, matches to rounding). fp64 rows are summed in fp64.
The rows no route writes are zeroed by the kernel's first programs, and only those rows
(kernels/_permutation_tiles.py): no whole-buffer fill, also with padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._compile import compiled_as_op
from ._permutation_tiles import ZERO_NONE, zero_plan
from ._triton import FastLaunch, tl, triton
from .permutation_maps import (
    _key,
    _on_triton,
    _pow2,
    chunk_sort_map,
    chunk_sort_map_reference,
    index_row_id_map,
    index_row_id_map_reference,
    mask_row_id_map,
    mask_row_id_map_reference,
)
from .permutation_reference import (
    permute_rows_reference,
    routes_of,
    tokens_of,
    unpermute_rows_backward_reference,
    unpermute_rows_reference,
)

__all__ = [
    "TUNING",
    "Tuning",
    "chunk_sort_map",
    "chunk_sort_map_reference",
    "index_row_id_map",
    "index_row_id_map_reference",
    "mask_row_id_map",
    "mask_row_id_map_reference",
    "permute_rows",
    "permute_rows_reference",
    "unpermute_rows",
    "unpermute_rows_backward",
    "unpermute_rows_backward_reference",
    "unpermute_rows_reference",
]


@dataclass(slots=True)
class Tuning:
    """Launch shapes of the permutation kernels, read at each launch (a benchmark may set
    them: `TUNING.permute_block_h = 1024`). Why these defaults, kernel by kernel:

    permute (rows scattered; also unpermute's backward without merging probs): one program per
    token over the whole hidden width. It reads its map row once, as vectors of block_r routes
    (rows, experts, probs and pad offsets gathered at once: no chain of dependent scalar loads
    per route, as a loop over routes has), writes the permuted probs once, then loops over the
    hidden width in chunks of block_h: one load of the token's chunk, one (block_r, block_h)
    store to all its routes' rows (a zero-prob route's row gets zeros from the same store).
    block_h 2048 with 4 warps: 16 bf16 (two 16-byte vectors) a thread a row, 4 KB of loads in
    flight a program; the int64 row addresses are formed once per route tile. 72 registers
    (sm_90, with probs): 7 programs an SM. permute_span_blocks splits a row over programs
    (chunks of block_h a program; None: one program a row), a knob for the measurement.
    unpermute (each token's routes summed): the sum adds the routes one by one in map order
    (bit-exact with the reference), so routes stay a loop, unrolled block_r at a time so that
    their row loads are in flight together; one program per (token, block_h chunk), the map row
    re-read per chunk (a few cached words); the permuted probs gathered back by the first
    chunk's programs only.
    unpermute backward with merging probs: one program per token, routes in tiles of block_r,
    the hidden width in chunks of block_h: the gradient chunk loaded once per tile, the block_r
    forward-input rows loaded together, the probs' gradients (block_r, block_h) fp32 partial
    sums reduced once per tile (not once per route and chunk). block_r 4, block_h 1024: 32
    registers of partial sums a thread.
    """

    permute_block_h: int = 2048
    permute_block_r: int = 8
    permute_span_blocks: int | None = None
    unpermute_block_h: int = 1024
    unpermute_block_r: int = 4
    bwd_block_h: int = 1024
    bwd_block_r: int = 4
    num_warps: int = 4
    z_programs: int = 32  # programs zeroing the rows no route writes (_permutation_tiles.py)


TUNING = Tuning()
ZROWS = 4  # rows a zeroing program stores at once

if triton is not None:
    from ._permutation_tiles import (
        from_bits,
        int_bits,
        route_count,
        route_scalar,
        route_tile,
        zero_unwritten,
    )

    @triton.jit
    def _permute_kernel(
        x_ptr,  # (N, H) rows in (FP8 as uint8 bytes), strides (s_x, 1)
        map_ptr,  # mask (N, 2E+1) / index (K*N,) int32
        probs_ptr,  # (N, E) mask / (N, K) index, strides (s_p0, s_p1); read when HAS_PROBS
        pad_ptr,  # (E,) integer row shift per expert; read when HAS_PAD
        counts_ptr,  # int32 row counts the zeroing reads (kernels/_permutation_tiles.py)
        y_ptr,  # (num_out, H) contiguous, x's dtype
        yp_ptr,  # (num_out,) probs' dtype; written when HAS_PROBS
        n,
        h,
        num_out,
        routes,  # E (mask) or K (index)
        s_x,
        s_p0,
        s_p1,
        span,  # columns a program covers, a multiple of BLOCK_H
        zero_lo,
        c_blocks,
        c_stride,
        INDEX_MAP: tl.constexpr,
        HAS_PROBS: tl.constexpr,
        HAS_PAD: tl.constexpr,
        ZERO: tl.constexpr,
        Z_PROGRAMS: tl.constexpr,  # programs 0 .. Z_PROGRAMS-1 zero; the others: a token each
        ZROWS: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_E1: tl.constexpr,  # power of two > E (the zeroing's gap table)
    ):
        pid = tl.program_id(0)
        c_start = tl.program_id(1) * span
        c_end = tl.minimum(h, c_start + span)
        if pid < Z_PROGRAMS:
            zero_unwritten(
                pid, map_ptr, counts_ptr, pad_ptr, y_ptr, yp_ptr, n, routes, num_out, h, c_start,
                c_end, zero_lo, c_blocks, c_stride, ZERO, Z_PROGRAMS, ZROWS, HAS_PROBS, BLOCK_H,
                BLOCK_E1,
            )  # fmt: skip
        else:
            t = (pid - Z_PROGRAMS).to(tl.int64)
            count = route_count(map_ptr, t, routes, INDEX_MAP)
            x_row = x_ptr + t * s_x
            for r0 in range(0, count, BLOCK_R):
                dst, expert, live = route_tile(map_ptr, t, r0, n, routes, count, BLOCK_R, INDEX_MAP)
                if HAS_PAD:
                    dst += tl.load(pad_ptr + expert, mask=live, other=0).to(tl.int32)
                keep = live & (dst >= 0) & (dst < num_out)
                copy = keep
                if HAS_PROBS:
                    p = tl.load(probs_ptr + t * s_p0 + expert * s_p1, mask=live, other=0)
                    tl.store(yp_ptr + dst, p, mask=keep & (c_start == 0))
                    if not INDEX_MAP:  # a zero prob marks a padding route: its row is zero
                        copy = keep & (p != 0)
                y_rows = y_ptr + dst.to(tl.int64) * h
                for c0 in range(c_start, c_end, BLOCK_H):
                    cols = c0 + tl.arange(0, BLOCK_H)
                    cm = cols < h
                    v = tl.load(x_row + cols, mask=cm)
                    ptrs = y_rows[:, None] + cols[None, :]
                    v_tile = tl.broadcast_to(v[None, :], (BLOCK_R, BLOCK_H))
                    if HAS_PROBS and not INDEX_MAP:
                        v_tile = tl.where(copy[:, None], v_tile, 0)
                    tl.store(ptrs, v_tile, mask=keep[:, None] & cm[None, :])

    @triton.jit
    def _unpermute_kernel(
        x_ptr,  # (R, H) permuted rows, strides (s_x, 1)
        map_ptr,  # mask (N, 2E+1) / index (K*N,) int32
        mp_ptr,  # merging probs (N, E) / (N, K), strides (s_m0, s_m1); read when HAS_MERGE
        pp_ptr,  # (R,) permuted probs to gather back; read when HAS_PP
        pad_ptr,  # (E,) integer row shift per expert; read when HAS_PAD
        y_ptr,  # (N, H) contiguous, x's dtype
        up_ptr,  # (N, routes) contiguous, pp's dtype, zero where no route; when HAS_PP
        n,
        h,
        r_rows,
        routes,
        s_x,
        s_m0,
        s_m1,
        INDEX_MAP: tl.constexpr,
        HAS_MERGE: tl.constexpr,
        HAS_PP: tl.constexpr,
        HAS_PAD: tl.constexpr,
        SINGLE: tl.constexpr,  # index map with K = 1 and no merging: a plain gather, any dtype
        F64: tl.constexpr,  # sum in fp64 (fp64 rows), else fp32
        BLOCK_H: tl.constexpr,
        BLOCK_R: tl.constexpr,  # routes unrolled at once
        BLOCK_RT: tl.constexpr,  # power of two >= routes
    ):
        acc_ty = tl.float64 if F64 else tl.float32
        t = tl.program_id(0).to(tl.int64)
        pid_h = tl.program_id(1)
        cols = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        cmask = cols < h
        if SINGLE:
            src = tl.load(map_ptr + t)
            keep = (src >= 0) & (src < r_rows)
            v = tl.load(x_ptr + src.to(tl.int64) * s_x + cols, mask=cmask & keep, other=0)
            tl.store(y_ptr + t * h + cols, v, mask=cmask)
            if HAS_PP and pid_h == 0:
                tl.store(up_ptr + t, tl.load(pp_ptr + src, mask=keep, other=0))
        else:
            acc = tl.zeros((BLOCK_H,), acc_ty)
            slots = tl.arange(0, BLOCK_RT)
            up = tl.zeros((BLOCK_RT,), pp_ptr.dtype.element_ty)
            count = route_count(map_ptr, t, routes, INDEX_MAP)
            for r0 in range(0, count, BLOCK_R):
                # A route past count adds +0.0, which changes no sum: a sum started at +0.0
                # never is -0.0. So the order and the bits are those of a loop over count.
                for j in tl.static_range(BLOCK_R):
                    r = tl.minimum(r0 + j, routes - 1)
                    live = r0 + j < count
                    src, expert = route_scalar(map_ptr, t, r, n, routes, INDEX_MAP)
                    if HAS_PAD:
                        src += tl.load(pad_ptr + expert, mask=live, other=0).to(tl.int32)
                    keep = live & (src >= 0) & (src < r_rows)
                    src = src.to(tl.int64)
                    v = tl.load(x_ptr + src * s_x + cols, mask=cmask & keep, other=0).to(acc_ty)
                    if HAS_MERGE:
                        p = tl.load(mp_ptr + t * s_m0 + expert * s_m1, mask=live, other=0)
                        v = tl.where(keep, v * p.to(acc_ty), 0.0)
                    acc += v
                    if HAS_PP:
                        pv = tl.load(pp_ptr + src, mask=keep & (pid_h == 0), other=0)
                        up = tl.where((slots == expert) & live, pv, up)
            tl.store(y_ptr + t * h + cols, acc.to(y_ptr.dtype.element_ty), mask=cmask)
            if HAS_PP and pid_h == 0:
                tl.store(up_ptr + t * routes + slots, up, mask=slots < routes)

    @triton.jit
    def _unpermute_bwd_kernel(
        g_ptr,  # (N, H) gradient of unpermute's output, strides (s_g, 1)
        x_ptr,  # (R, H) unpermute's input, strides (s_x, 1)
        map_ptr,  # mask (N, 2E+1) / index (K*N,) int32
        mp_ptr,  # merging probs (N, E) / (N, K), strides (s_m0, s_m1)
        pad_ptr,  # (E,) integer row shift per expert; read when HAS_PAD
        counts_ptr,  # int32 row counts the zeroing reads (kernels/_permutation_tiles.py)
        dx_ptr,  # (R, H) contiguous, g's dtype
        dp_ptr,  # (N, routes) contiguous, merging probs' dtype
        n,
        h,
        r_rows,
        routes,
        s_g,
        s_x,
        s_m0,
        s_m1,
        zero_lo,
        c_blocks,
        c_stride,
        INDEX_MAP: tl.constexpr,
        HAS_PAD: tl.constexpr,
        ZERO: tl.constexpr,
        Z_PROGRAMS: tl.constexpr,  # programs 0 .. Z_PROGRAMS-1 zero; the others: a token each
        ZROWS: tl.constexpr,
        F64: tl.constexpr,  # compute in fp64 (fp64 gradients), else fp32
        BLOCK_H: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_RT: tl.constexpr,  # power of two >= routes
        BLOCK_E1: tl.constexpr,
    ):
        acc_ty = tl.float64 if F64 else tl.float32
        pid = tl.program_id(0)
        if pid < Z_PROGRAMS:
            zero_unwritten(
                pid, map_ptr, counts_ptr, pad_ptr, dx_ptr, dx_ptr, n, routes, r_rows, h, 0, h,
                zero_lo, c_blocks, c_stride, ZERO, Z_PROGRAMS, ZROWS, False, BLOCK_H, BLOCK_E1,
            )  # fmt: skip
        else:
            t = (pid - Z_PROGRAMS).to(tl.int64)
            count = route_count(map_ptr, t, routes, INDEX_MAP)
            g_row = g_ptr + t * s_g
            slots = tl.arange(0, BLOCK_RT)
            dp_bits = tl.zeros((BLOCK_RT,), tl.int64)
            for r0 in range(0, count, BLOCK_R):
                dst, expert, live = route_tile(map_ptr, t, r0, n, routes, count, BLOCK_R, INDEX_MAP)
                if HAS_PAD:
                    dst += tl.load(pad_ptr + expert, mask=live, other=0).to(tl.int32)
                keep = live & (dst >= 0) & (dst < r_rows)
                p = tl.load(mp_ptr + t * s_m0 + expert * s_m1, mask=live, other=0).to(acc_ty)
                dst = dst.to(tl.int64)
                dx_rows = dx_ptr + dst * h
                x_rows = x_ptr + dst * s_x
                dot = tl.zeros((BLOCK_R, BLOCK_H), acc_ty)
                for c0 in range(0, h, BLOCK_H):
                    cols = c0 + tl.arange(0, BLOCK_H)
                    cm = cols < h
                    g = tl.load(g_row + cols, mask=cm, other=0).to(acc_ty)
                    m2 = keep[:, None] & cm[None, :]
                    out = (g[None, :] * p[:, None]).to(dx_ptr.dtype.element_ty)
                    tl.store(dx_rows[:, None] + cols[None, :], out, mask=m2)
                    xv = tl.load(x_rows[:, None] + cols[None, :], mask=m2, other=0)
                    dot += xv.to(acc_ty) * g[None, :]
                dots = tl.where(keep, tl.sum(dot, axis=1), 0.0).to(dp_ptr.dtype.element_ty)
                # Each route's value to its expert's (or k's) column: summed as bit patterns,
                # one value and zeros, so the value comes through exactly (-0.0 and NaN too).
                hit = (expert[:, None] == slots[None, :]) & live[:, None]
                dp_bits += tl.sum(tl.where(hit, int_bits(dots)[:, None], 0), axis=0)
            dp = from_bits(dp_bits, dp_ptr.dtype.element_ty)
            tl.store(dp_ptr + t * routes + slots, dp, mask=slots < routes)

    class _NoFpFusion:
        """Gives FastLaunch the kernel compiled without fused multiply-add (a * b + c rounded
        once), so that fp32 sums round as the torch reference's do."""

        __slots__ = ("kernel",)

        def __init__(self, kernel) -> None:
            self.kernel = kernel

        def __getitem__(self, grid):
            launch = self.kernel[grid]
            return lambda *args, **kw: launch(*args, enable_fp_fusion=False, **kw)

    _launch_permute = FastLaunch(_permute_kernel)
    _launch_unpermute = FastLaunch(_NoFpFusion(_unpermute_kernel))
    _launch_unpermute_bwd = FastLaunch(_NoFpFusion(_unpermute_bwd_kernel))


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


_PERMUTE_SCHEMA = (
    "(Tensor inp, Tensor row_id_map, Tensor? probs, Tensor? pad_offsets, Tensor? row_counts, "
    "int num_out_tokens, int index_topk) -> (Tensor, Tensor)"
)


@compiled_as_op(_PERMUTE_SCHEMA)
def permute_rows(
    inp: torch.Tensor,
    row_id_map: torch.Tensor,
    probs: torch.Tensor | None,
    pad_offsets: torch.Tensor | None,
    row_counts: torch.Tensor | None,
    num_out_tokens: int,
    index_topk: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scatter inp (N, H) to its routes' rows -> (out (num_out_tokens, H), out_probs
    (num_out_tokens,) or None). probs (N, E) mask / (N, K) index go with the rows; under a mask
    map a route whose prob is 0 writes a zero row (a padding route). Rows no route writes are
    zero. row_counts (mask maps; None: read from the map) says which rows those are: the map's
    counts (E+1,) int32 from mask_row_id_map (the rows of each expert, then their sum), or
    without padding just their sum (1,)."""
    if _on_triton(inp):
        return _permute_triton(
            inp, row_id_map, probs, pad_offsets, row_counts, num_out_tokens, index_topk
        )
    return permute_rows_reference(
        inp, row_id_map, probs, pad_offsets, row_counts, num_out_tokens, index_topk
    )


def _block_h(h: int, max_block_h: int) -> int:
    return min(_pow2(h), max_block_h)


def _permute_triton(
    inp: torch.Tensor,
    row_id_map: torch.Tensor,
    probs: torch.Tensor | None,
    pad_offsets: torch.Tensor | None,
    row_counts: torch.Tensor | None,
    num_out_tokens: int,
    index_topk: int,
    max_block_h: int | None = None,
    z_programs: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One launch: z_programs zeroing programs, then one program per token (per span of
    TUNING.permute_span_blocks chunks when set); None: TUNING's."""
    tune = TUNING
    max_block_h = tune.permute_block_h if max_block_h is None else max_block_h
    z_programs = tune.z_programs if z_programs is None else z_programs
    n, h = inp.shape
    if inp.stride(1) != 1:
        inp = inp.contiguous()
    out = torch.empty((num_out_tokens, h), dtype=inp.dtype, device=inp.device)
    out_probs = None
    if probs is not None:
        out_probs = torch.empty((num_out_tokens,), dtype=probs.dtype, device=inp.device)
    zero, zero_lo, counts, c_blocks, c_stride = zero_plan(
        row_id_map, index_topk, pad_offsets, row_counts, num_out_tokens, n
    )
    z = z_programs if zero != ZERO_NONE else 0
    if num_out_tokens == 0 or n + z == 0:
        return out, out_probs
    routes = routes_of(row_id_map, index_topk)
    block_h = _block_h(h, max_block_h)
    span_blocks = tune.permute_span_blocks
    span = max(h, 1) if span_blocks is None else span_blocks * block_h
    span = -(-span // block_h) * block_h
    grid = (n + z, max(1, -(-h // span)), 1)
    probs_arg = probs if probs is not None else row_id_map  # unread pointers when absent
    s_p0, s_p1 = probs.stride() if probs is not None else (0, 0)
    pad_arg = pad_offsets if pad_offsets is not None else row_id_map
    out_probs_arg = out_probs if out_probs is not None else out
    block_r = min(tune.permute_block_r, _pow2(routes, 1))
    consts = (
        bool(index_topk), probs is not None, pad_offsets is not None, zero, z, ZROWS, block_h,
        block_r, _pow2(routes + 1, 2),
    )  # fmt: skip
    tensors = (inp, row_id_map, probs_arg, pad_arg, counts, out, out_probs_arg)
    ints = (n, h, num_out_tokens, routes, inp.stride(0), s_p0, s_p1, span, zero_lo)
    ints += (c_blocks, c_stride)
    key = _key((*consts, tune.num_warps), tensors, ints)
    _launch_permute(key, grid, tune.num_warps, *tensors, *ints, *consts)
    return out, out_probs


_UNPERMUTE_SCHEMA = (
    "(Tensor inp, Tensor row_id_map, Tensor? merging_probs, Tensor? permuted_probs, "
    "Tensor? pad_offsets, int index_topk) -> (Tensor, Tensor)"
)


@compiled_as_op(_UNPERMUTE_SCHEMA)
def unpermute_rows(
    inp: torch.Tensor,
    row_id_map: torch.Tensor,
    merging_probs: torch.Tensor | None,
    permuted_probs: torch.Tensor | None,
    pad_offsets: torch.Tensor | None,
    index_topk: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gather the routes of each token from inp (R, H) and sum them in fp32, each times its
    merging prob ((N, E) mask / (N, K) index) when given -> (out (N, H) in inp's dtype,
    unpermuted_probs (N, E|K) or None: permuted_probs (R,) sent back, zero where no route).
    An index map with K = 1 and no merging probs is a plain gather (any dtype)."""
    if _on_triton(inp):
        return _unpermute_triton(
            inp, row_id_map, merging_probs, permuted_probs, pad_offsets, index_topk
        )
    return unpermute_rows_reference(
        inp, row_id_map, merging_probs, permuted_probs, pad_offsets, index_topk
    )


def _unpermute_triton(
    inp: torch.Tensor,
    row_id_map: torch.Tensor,
    merging_probs: torch.Tensor | None,
    permuted_probs: torch.Tensor | None,
    pad_offsets: torch.Tensor | None,
    index_topk: int,
    max_block_h: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One launch: a program per (token, chunk of max_block_h columns; None: TUNING's)."""
    tune = TUNING
    max_block_h = tune.unpermute_block_h if max_block_h is None else max_block_h
    r_rows, h = inp.shape
    if inp.stride(1) != 1:
        inp = inp.contiguous()
    routes = routes_of(row_id_map, index_topk)
    n = tokens_of(row_id_map, index_topk)
    out = torch.empty((n, h), dtype=inp.dtype, device=inp.device)
    up = None
    if permuted_probs is not None:
        permuted_probs = permuted_probs.contiguous()
        up = torch.empty((n, routes), dtype=permuted_probs.dtype, device=inp.device)
    block_h = _block_h(h, max_block_h)
    grid = (n, max(1, -(-h // block_h)), 1)
    if n == 0:
        return out, up
    single = index_topk == 1 and merging_probs is None
    mp_arg = merging_probs if merging_probs is not None else row_id_map
    s_m0, s_m1 = merging_probs.stride() if merging_probs is not None else (0, 0)
    pp_arg = permuted_probs if permuted_probs is not None else row_id_map
    pad_arg = pad_offsets if pad_offsets is not None else row_id_map
    up_arg = up if up is not None else out
    block_r = min(tune.unpermute_block_r, _pow2(routes, 1))
    consts = (
        bool(index_topk), merging_probs is not None, permuted_probs is not None,
        pad_offsets is not None, single, inp.dtype == torch.float64, block_h, block_r,
        _pow2(routes, 2),
    )  # fmt: skip
    tensors = (inp, row_id_map, mp_arg, pp_arg, pad_arg, out, up_arg)
    ints = (n, h, r_rows, routes, inp.stride(0), s_m0, s_m1)
    key = _key((*consts, tune.num_warps), tensors, ints)
    _launch_unpermute(key, grid, tune.num_warps, *tensors, *ints, *consts)
    return out, up


_UNPERMUTE_BWD_SCHEMA = (
    "(Tensor grad, Tensor row_id_map, Tensor fwd_input, Tensor merging_probs, "
    "Tensor? pad_offsets, Tensor? row_counts, int index_topk) -> (Tensor, Tensor)"
)


@compiled_as_op(_UNPERMUTE_BWD_SCHEMA)
def unpermute_rows_backward(
    grad: torch.Tensor,
    row_id_map: torch.Tensor,
    fwd_input: torch.Tensor,
    merging_probs: torch.Tensor,
    pad_offsets: torch.Tensor | None,
    row_counts: torch.Tensor | None,
    index_topk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of unpermute_rows with merging probs: grad (N, H), fwd_input (R, H) ->
    (d_input (R, H) in grad's dtype: grad times the prob at each route's row, zero elsewhere;
    d_probs like merging_probs: the fp32 dot of grad and the route's row, zero where none).
    row_counts: as permute_rows'."""
    if _on_triton(grad):
        return _unpermute_bwd_triton(
            grad, row_id_map, fwd_input, merging_probs, pad_offsets, row_counts, index_topk
        )
    return unpermute_rows_backward_reference(
        grad, row_id_map, fwd_input, merging_probs, pad_offsets, row_counts, index_topk
    )


def _unpermute_bwd_triton(
    grad: torch.Tensor,
    row_id_map: torch.Tensor,
    fwd_input: torch.Tensor,
    merging_probs: torch.Tensor,
    pad_offsets: torch.Tensor | None,
    row_counts: torch.Tensor | None,
    index_topk: int,
    max_block_h: int | None = None,
    z_programs: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch: z_programs zeroing programs, then one program per token; None: TUNING's."""
    tune = TUNING
    max_block_h = tune.bwd_block_h if max_block_h is None else max_block_h
    z_programs = tune.z_programs if z_programs is None else z_programs
    n, h = grad.shape
    r_rows = fwd_input.shape[0]
    grad = grad if grad.stride(1) == 1 else grad.contiguous()
    fwd_input = fwd_input if fwd_input.stride(1) == 1 else fwd_input.contiguous()
    routes = routes_of(row_id_map, index_topk)
    d_input = torch.empty((r_rows, h), dtype=grad.dtype, device=grad.device)
    d_probs = torch.empty((n, routes), dtype=merging_probs.dtype, device=grad.device)
    zero, zero_lo, counts, c_blocks, c_stride = zero_plan(
        row_id_map, index_topk, pad_offsets, row_counts, r_rows, n
    )
    z = z_programs if zero != ZERO_NONE else 0
    if n + z == 0:
        return d_input, d_probs
    block_h = _block_h(h, max_block_h)
    pad_arg = pad_offsets if pad_offsets is not None else row_id_map
    f64 = grad.dtype == torch.float64
    block_r = min(tune.bwd_block_r, _pow2(routes, 1))
    consts = (
        bool(index_topk), pad_offsets is not None, zero, z, ZROWS, f64, block_h, block_r,
        _pow2(routes, 2), _pow2(routes + 1, 2),
    )  # fmt: skip
    tensors = (grad, fwd_input, row_id_map, merging_probs, pad_arg, counts, d_input, d_probs)
    s_m0, s_m1 = merging_probs.stride()
    ints = (n, h, r_rows, routes, grad.stride(0), fwd_input.stride(0), s_m0, s_m1, zero_lo)
    ints += (c_blocks, c_stride)
    grid = (n + z, 1, 1)
    key = _key((*consts, tune.num_warps), tensors, ints)
    _launch_unpermute_bwd(key, grid, tune.num_warps, *tensors, *ints, *consts)
    return d_input, d_probs
