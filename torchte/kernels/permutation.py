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

On CUDA with Triton one kernel runs per call; elsewhere the references. Both give the same
permuted bytes; sums in fp32 add the routes in the map's order, and the kernels are compiled
without fused multiply-add, so unpermute matches the reference bit for bit (the merging-probs
gradient, a dot product, matches to rounding). fp64 rows are summed in fp64.
"""

from __future__ import annotations

import torch

from ._compile import compiled_as_op
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

MAX_BLOCK_H = 1024  # hidden elements per program
TAIL_PROGRAMS = 32  # programs that zero the rows past the scattered ones

if triton is not None:

    @triton.jit
    def _route(map_ptr, t, r, n, routes, INDEX_MAP: tl.constexpr):
        """(row, expert or k) of route r of token t (int64 t)."""
        if INDEX_MAP:
            row = tl.load(map_ptr + r * n + t)
            expert = r
        else:
            base = map_ptr + t * (2 * routes + 1)
            row = tl.load(base + r)
            expert = tl.load(base + routes + r)
        return row, expert

    @triton.jit
    def _route_count(map_ptr, t, routes, INDEX_MAP: tl.constexpr):
        """How many routes token t has (int64 t): K, or column 2E of its mask-map row."""
        count = routes if INDEX_MAP else tl.load(map_ptr + t * (2 * routes + 1) + 2 * routes)
        return count

    @triton.jit
    def _permute_kernel(
        x_ptr,  # (N, H) rows in (FP8 as uint8 bytes), strides (s_x, 1)
        map_ptr,  # mask (N, 2E+1) / index (K*N,) int32
        probs_ptr,  # (N, E) mask / (N, K) index, strides (s_p0, s_p1); read when HAS_PROBS
        pad_ptr,  # (E,) integer row shift per expert; read when HAS_PAD
        valid_ptr,  # (1,) int32: the tail programs zero rows [valid, num_out)
        y_ptr,  # (num_out, H) contiguous, x's dtype
        yp_ptr,  # (num_out,) probs' dtype; written when HAS_PROBS
        n,
        h,
        num_out,
        routes,  # E (mask) or K (index)
        s_x,
        s_p0,
        s_p1,
        INDEX_MAP: tl.constexpr,
        HAS_PROBS: tl.constexpr,
        HAS_PAD: tl.constexpr,
        TAIL: tl.constexpr,  # programs n.. n+TAIL-1 zero the tail
        BLOCK_H: tl.constexpr,
    ):
        pid_t = tl.program_id(0)
        pid_h = tl.program_id(1)
        cols = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        cmask = cols < h
        if pid_t < n:
            t = pid_t.to(tl.int64)
            x = tl.load(x_ptr + t * s_x + cols, mask=cmask)
            for r in range(_route_count(map_ptr, t, routes, INDEX_MAP)):
                dst, expert = _route(map_ptr, t, r, n, routes, INDEX_MAP)
                if HAS_PAD:
                    dst += tl.load(pad_ptr + expert).to(tl.int32)
                keep = (dst >= 0) & (dst < num_out)
                dst = dst.to(tl.int64)
                val = x
                if HAS_PROBS:
                    p = tl.load(probs_ptr + t * s_p0 + expert * s_p1)
                    if pid_h == 0:
                        tl.store(yp_ptr + dst, p, mask=keep)
                    if not INDEX_MAP:  # a zero prob marks a padding route: its row is zero
                        val = tl.where(p == 0, tl.zeros_like(x), x)
                tl.store(y_ptr + dst * h + cols, val, mask=cmask & keep)
        elif TAIL > 0:
            start = tl.load(valid_ptr) + (pid_t - n)
            for row in range(start, num_out, TAIL):
                tl.store(y_ptr + tl.cast(row, tl.int64) * h + cols, 0, mask=cmask)
                if HAS_PROBS and pid_h == 0:
                    tl.store(yp_ptr + row, 0)

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
        BLOCK_R: tl.constexpr,
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
            slots = tl.arange(0, BLOCK_R)
            up = tl.zeros((BLOCK_R,), pp_ptr.dtype.element_ty)
            for r in range(_route_count(map_ptr, t, routes, INDEX_MAP)):
                src, expert = _route(map_ptr, t, r, n, routes, INDEX_MAP)
                if HAS_PAD:
                    src += tl.load(pad_ptr + expert).to(tl.int32)
                keep = (src >= 0) & (src < r_rows)
                src = src.to(tl.int64)
                v = tl.load(x_ptr + src * s_x + cols, mask=cmask & keep, other=0).to(acc_ty)
                if HAS_MERGE:
                    p = tl.load(mp_ptr + t * s_m0 + expert * s_m1).to(acc_ty)
                    v = tl.where(keep, v * p, 0.0)
                acc += v
                if HAS_PP:
                    pv = tl.load(pp_ptr + src, mask=keep, other=0)
                    up = tl.where(slots == expert, pv, up)
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
        valid_ptr,  # (1,) int32: the tail programs zero rows [valid, R) of dx
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
        INDEX_MAP: tl.constexpr,
        HAS_PAD: tl.constexpr,
        TAIL: tl.constexpr,
        F64: tl.constexpr,  # compute in fp64 (fp64 gradients), else fp32
        BLOCK_H: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        acc_ty = tl.float64 if F64 else tl.float32
        pid = tl.program_id(0)
        if pid < n:
            t = pid.to(tl.int64)
            slots = tl.arange(0, BLOCK_R)
            dp = tl.zeros((BLOCK_R,), acc_ty)
            for r in range(_route_count(map_ptr, t, routes, INDEX_MAP)):
                dst, expert = _route(map_ptr, t, r, n, routes, INDEX_MAP)
                if HAS_PAD:
                    dst += tl.load(pad_ptr + expert).to(tl.int32)
                keep = (dst >= 0) & (dst < r_rows)
                dst = dst.to(tl.int64)
                p = tl.load(mp_ptr + t * s_m0 + expert * s_m1).to(acc_ty)
                dot = tl.zeros((BLOCK_H,), acc_ty)
                for c0 in range(0, h, BLOCK_H):
                    cols = c0 + tl.arange(0, BLOCK_H)
                    cm = cols < h
                    g = tl.load(g_ptr + t * s_g + cols, mask=cm, other=0).to(acc_ty)
                    out = (g * p).to(dx_ptr.dtype.element_ty)
                    tl.store(dx_ptr + dst * h + cols, out, mask=cm & keep)
                    xv = tl.load(x_ptr + dst * s_x + cols, mask=cm & keep, other=0)
                    dot += xv.to(acc_ty) * g
                dp = tl.where(slots == expert, tl.where(keep, tl.sum(dot, axis=0), 0.0), dp)
            out_p = dp.to(dp_ptr.dtype.element_ty)
            tl.store(dp_ptr + t * routes + slots, out_p, mask=slots < routes)
        elif TAIL > 0:
            for row in range(tl.load(valid_ptr) + (pid - n), r_rows, TAIL):
                for c0 in range(0, h, BLOCK_H):
                    cols = c0 + tl.arange(0, BLOCK_H)
                    tl.store(dx_ptr + tl.cast(row, tl.int64) * h + cols, 0, mask=cols < h)

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
    "(Tensor inp, Tensor row_id_map, Tensor? probs, Tensor? pad_offsets, Tensor? valid_rows, "
    "int num_out_tokens, int index_topk) -> (Tensor, Tensor)"
)


@compiled_as_op(_PERMUTE_SCHEMA)
def permute_rows(
    inp: torch.Tensor,
    row_id_map: torch.Tensor,
    probs: torch.Tensor | None,
    pad_offsets: torch.Tensor | None,
    valid_rows: torch.Tensor | None,
    num_out_tokens: int,
    index_topk: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scatter inp (N, H) to its routes' rows -> (out (num_out_tokens, H), out_probs
    (num_out_tokens,) or None). probs (N, E) mask / (N, K) index go with the rows; under a mask
    map a route whose prob is 0 writes a zero row (a padding route). Rows no route writes are
    zero; valid_rows (1,) int32, the rows a mask map writes without padding (None: counted
    from the map), tells where they start."""
    if _on_triton(inp):
        return _permute_triton(
            inp, row_id_map, probs, pad_offsets, valid_rows, num_out_tokens, index_topk
        )
    return permute_rows_reference(
        inp, row_id_map, probs, pad_offsets, valid_rows, num_out_tokens, index_topk
    )


def _block_h(h: int, max_block_h: int) -> int:
    return min(_pow2(h), max_block_h)


def _valid_rows(row_id_map: torch.Tensor) -> torch.Tensor:
    """(1,) int32: how many rows a mask map routes to (column 2E summed)."""
    return row_id_map[:, -1].sum(dtype=torch.int32).reshape(1)


def _tail(
    row_id_map: torch.Tensor,
    index_topk: int,
    pad_offsets: torch.Tensor | None,
    valid_rows: torch.Tensor | None,
    outs: tuple[torch.Tensor, ...],
    n: int,
    tail_programs: int,
) -> tuple[int, torch.Tensor | None]:
    """(tail programs, valid_rows) of a launch writing outs (R, ...), one row per route: under
    an index map the rows past its N K routes are zeroed here; under a mask map without
    padding `tail_programs` extra programs zero the rows past valid_rows (counted from the map
    when None); else none."""
    rows = outs[0].shape[0]
    if index_topk and rows > n * index_topk:
        for t in outs:
            t[n * index_topk :].zero_()
    elif not index_topk and pad_offsets is None and rows:
        valid_rows = _valid_rows(row_id_map) if valid_rows is None else valid_rows
        return tail_programs, valid_rows
    return 0, valid_rows


def _permute_triton(
    inp: torch.Tensor,
    row_id_map: torch.Tensor,
    probs: torch.Tensor | None,
    pad_offsets: torch.Tensor | None,
    valid_rows: torch.Tensor | None,
    num_out_tokens: int,
    index_topk: int,
    max_block_h: int = MAX_BLOCK_H,
    tail_programs: int = TAIL_PROGRAMS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    n, h = inp.shape
    if inp.stride(1) != 1:
        inp = inp.contiguous()
    alloc = torch.zeros if pad_offsets is not None else torch.empty
    out = alloc((num_out_tokens, h), dtype=inp.dtype, device=inp.device)
    out_probs = None
    if probs is not None:
        out_probs = alloc((num_out_tokens,), dtype=probs.dtype, device=inp.device)
    outs = (out,) if out_probs is None else (out, out_probs)
    tail, valid_rows = _tail(
        row_id_map, index_topk, pad_offsets, valid_rows, outs, n, tail_programs
    )
    block_h = _block_h(h, max_block_h)
    grid = (n + tail, max(1, -(-h // block_h)), 1)
    if grid[0] == 0:
        return out, out_probs
    routes = routes_of(row_id_map, index_topk)
    probs_arg = probs if probs is not None else row_id_map  # unread pointers when absent
    s_p0, s_p1 = probs.stride() if probs is not None else (0, 0)
    pad_arg = pad_offsets if pad_offsets is not None else row_id_map
    valid_arg = valid_rows if valid_rows is not None else row_id_map
    out_probs_arg = out_probs if out_probs is not None else out
    consts = (bool(index_topk), probs is not None, pad_offsets is not None, tail, block_h)
    tensors = (inp, row_id_map, probs_arg, pad_arg, valid_arg, out, out_probs_arg)
    ints = (n, h, num_out_tokens, routes, inp.stride(0), s_p0, s_p1)
    _launch_permute(_key(consts, tensors, ints), grid, 4, *tensors, *ints, *consts)
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
    max_block_h: int = MAX_BLOCK_H,
) -> tuple[torch.Tensor, torch.Tensor | None]:
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
    consts = (
        bool(index_topk), merging_probs is not None, permuted_probs is not None,
        pad_offsets is not None, single, inp.dtype == torch.float64, block_h, _pow2(routes, 2),
    )  # fmt: skip
    tensors = (inp, row_id_map, mp_arg, pp_arg, pad_arg, out, up_arg)
    ints = (n, h, r_rows, routes, inp.stride(0), s_m0, s_m1)
    _launch_unpermute(_key(consts, tensors, ints), grid, 4, *tensors, *ints, *consts)
    return out, up


_UNPERMUTE_BWD_SCHEMA = (
    "(Tensor grad, Tensor row_id_map, Tensor fwd_input, Tensor merging_probs, "
    "Tensor? pad_offsets, Tensor? valid_rows, int index_topk) -> (Tensor, Tensor)"
)


@compiled_as_op(_UNPERMUTE_BWD_SCHEMA)
def unpermute_rows_backward(
    grad: torch.Tensor,
    row_id_map: torch.Tensor,
    fwd_input: torch.Tensor,
    merging_probs: torch.Tensor,
    pad_offsets: torch.Tensor | None,
    valid_rows: torch.Tensor | None,
    index_topk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of unpermute_rows with merging probs: grad (N, H), fwd_input (R, H) ->
    (d_input (R, H) in grad's dtype: grad times the prob at each route's row, zero elsewhere;
    d_probs like merging_probs: the fp32 dot of grad and the route's row, zero where none)."""
    if _on_triton(grad):
        return _unpermute_bwd_triton(
            grad, row_id_map, fwd_input, merging_probs, pad_offsets, valid_rows, index_topk
        )
    return unpermute_rows_backward_reference(
        grad, row_id_map, fwd_input, merging_probs, pad_offsets, valid_rows, index_topk
    )


def _unpermute_bwd_triton(
    grad: torch.Tensor,
    row_id_map: torch.Tensor,
    fwd_input: torch.Tensor,
    merging_probs: torch.Tensor,
    pad_offsets: torch.Tensor | None,
    valid_rows: torch.Tensor | None,
    index_topk: int,
    max_block_h: int = MAX_BLOCK_H,
    tail_programs: int = TAIL_PROGRAMS,
) -> tuple[torch.Tensor, torch.Tensor]:
    n, h = grad.shape
    r_rows = fwd_input.shape[0]
    grad = grad if grad.stride(1) == 1 else grad.contiguous()
    fwd_input = fwd_input if fwd_input.stride(1) == 1 else fwd_input.contiguous()
    routes = routes_of(row_id_map, index_topk)
    alloc = torch.zeros if pad_offsets is not None else torch.empty
    d_input = alloc((r_rows, h), dtype=grad.dtype, device=grad.device)
    d_probs = torch.empty((n, routes), dtype=merging_probs.dtype, device=grad.device)
    tail, valid_rows = _tail(
        row_id_map, index_topk, pad_offsets, valid_rows, (d_input,), n, tail_programs
    )
    if n + tail == 0:
        return d_input, d_probs
    block_h = _block_h(h, max_block_h)
    pad_arg = pad_offsets if pad_offsets is not None else row_id_map
    valid_arg = valid_rows if valid_rows is not None else row_id_map
    f64 = grad.dtype == torch.float64
    consts = (bool(index_topk), pad_offsets is not None, tail, f64, block_h, _pow2(routes, 2))
    tensors = (grad, fwd_input, row_id_map, merging_probs, pad_arg, valid_arg, d_input, d_probs)
    s_m0, s_m1 = merging_probs.stride()
    ints = (n, h, r_rows, routes, grad.stride(0), fwd_input.stride(0), s_m0, s_m1)
    grid = (n + tail, 1, 1)
    _launch_unpermute_bwd(_key(consts, tensors, ints), grid, 4, *tensors, *ints, *consts)
    return d_input, d_probs
