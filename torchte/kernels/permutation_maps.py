"""Row-id maps of mixture-of-experts token permutation (torchte/kernels/permutation.py uses them).

Shape legend: N tokens, E experts, K routes per token (top-k), S chunks.

  mask_row_id_map   routing map (N, E) bool/integer (nonzero = routed) -> (row_id_map
                    (N, 2E+1) int32, row_counts (E+1,) int32: the rows of each expert, then
                    their sum). Row t of the map: [0, n) the permuted rows of its n routes in
                    descending order, [E, E+n) their experts, column 2E = n; other slots -1.
                    Expert e's rows are a block, in token order, after experts 0..e-1's.
  index_row_id_map  indices (N, K) integer expert ids, num_out_tokens -> (K*N,) int32: entry
                    k*N + t is the row of route k of token t; routes are stably sorted by
                    expert id read as uint32 (negative ids last); sorted positions >=
                    num_out_tokens are dropped (-1).
  chunk_sort_map    split_sizes (S,), sorted_index (S,), N -> (N,) int32: the output row of
                    each input row once the chunks are put in sorted_index's order; rows past
                    sum(split_sizes) keep their place.
These are Transformer Engine's layouts (its unused mask-map slots hold leftovers; here -1).

On CUDA with Triton: a mask map in one launch when it is small (N times E, rounded up to a power
of two, at most ONE_LAUNCH_MAX: one program counts, scans and writes), else three (block
counts, a scan over blocks, the map); a torch stable sort and one launch for an index map; one
launch for a chunk map; elsewhere the torch references below, which give the same maps.
`mask_map_block_counts` (one launch) reads a mask map's routes per expert back from the map,
per block of tokens (the permute kernels' zeroing of pad rows uses it where the routing map's
counts are gone: unpermute's backward).
"""

from __future__ import annotations

import torch

from ._compile import compiled_as_op
from ._triton import FastLaunch, int_key, tl, triton, triton_available

__all__ = [
    "chunk_sort_map",
    "chunk_sort_map_reference",
    "index_row_id_map",
    "index_row_id_map_reference",
    "mask_map_block_counts",
    "mask_map_block_counts_reference",
    "mask_row_id_map",
    "mask_row_id_map_reference",
]

TILE = 4096  # elements of a (tokens, experts) or (tokens, chunks) tile
# One program builds the whole mask map when N * BLOCK_E is at most this. Why: below it the
# three launches (their host cost and the gaps between dependent kernels) weigh more than one
# program's two passes over the map (its tile loads all in flight in the first, unrolled, pass);
# above it one SM's bandwidth for the map's writes would. The value is the brief's (64K) until
# a GPU measurement moves it.
ONE_LAUNCH_MAX = 65536
ONE_LAUNCH_TILE = 8192  # elements of the one-launch kernel's tile (8 warps: 32 a thread)
ONE_LAUNCH_WARPS = 8
# mask_map_block_counts: blocks of 16K map slots (8 warps), so that the zeroing programs that
# add up its rows (kernels/_permutation_tiles.py) loop over few of them (128 at 32K tokens x 64).
BLOCK_COUNTS_TILE = 16384

if triton is not None:

    @triton.jit
    def _map_tile(rm_ptr, b, n, e, s_t, s_e, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
        """(t (BLOCK_T,) tokens, x (BLOCK_E,) experts, mask (BLOCK_T, BLOCK_E) in range, m
        (BLOCK_T, BLOCK_E) int32): block b's tokens of the routing map (N, E) as 0 / 1, zero
        outside it."""
        t = b * BLOCK_T + tl.arange(0, BLOCK_T)
        x = tl.arange(0, BLOCK_E)
        mask = (t < n)[:, None] & (x < e)[None, :]
        m = tl.load(rm_ptr + t.to(tl.int64)[:, None] * s_t + x[None, :] * s_e, mask=mask, other=0)
        return t, x, mask, (m != 0).to(tl.int32)

    @triton.jit
    def _map_count_kernel(
        rm_ptr,  # (N, E) routing map, any integer or bool dtype, strides (s_t, s_e)
        ws_ptr,  # (n_blocks, E) int32: tokens of each block routed to each expert
        n,
        e,
        s_t,
        s_e,
        BLOCK_T: tl.constexpr,
        BLOCK_E: tl.constexpr,
    ):
        b = tl.program_id(0)
        _t, x, _mask, m = _map_tile(rm_ptr, b, n, e, s_t, s_e, BLOCK_T, BLOCK_E)
        tl.store(ws_ptr + b * e + x, tl.sum(m, axis=0), mask=x < e)

    @triton.jit
    def _map_scan_kernel(
        ws_ptr,  # (n_blocks, E) int32, in place: block counts -> rows of earlier blocks
        counts_ptr,  # (E + 1,) int32: [:E] written here, tokens per expert
        n_blocks,
        e,
        CHUNK: tl.constexpr,
        BLOCK_E: tl.constexpr,
    ):
        x = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
        carry = tl.zeros((BLOCK_E,), tl.int32)
        for start in range(0, n_blocks, CHUNK):
            b = start + tl.arange(0, CHUNK)
            mask = (b < n_blocks)[:, None] & (x < e)[None, :]
            ptrs = ws_ptr + b[:, None] * e + x[None, :]
            v = tl.load(ptrs, mask=mask, other=0)
            tl.store(ptrs, tl.cumsum(v, axis=0) - v + carry[None, :], mask=mask)
            carry += tl.sum(v, axis=0)
        tl.store(counts_ptr + x, carry, mask=x < e)

    @triton.jit
    def _write_map_rows(map_ptr, t, x, mask, m, row, n, e):
        """Write rows t (BLOCK_T,) of the map (N, 2E+1) int32 from m (BLOCK_T, BLOCK_E) 0 / 1 and
        row (BLOCK_T, BLOCK_E) int32, the permuted row of each routed (token, expert)."""
        n_routed = tl.sum(m, axis=1)
        above = n_routed[:, None] - tl.cumsum(m, axis=1)  # routed experts past e
        routed = m != 0
        # Routed experts take slots [0, n) by descending id, the others [n, E): one store each.
        slot = tl.where(routed, above, n_routed[:, None] + (e - 1 - x[None, :]) - above)
        base = map_ptr + t.to(tl.int64)[:, None] * (2 * e + 1) + slot
        tl.store(base, tl.where(routed, row, -1), mask=mask)
        tl.store(base + e, tl.where(routed, x[None, :], -1), mask=mask)
        tl.store(map_ptr + t.to(tl.int64) * (2 * e + 1) + 2 * e, n_routed, mask=t < n)

    @triton.jit
    def _map_write_kernel(
        rm_ptr,  # (N, E) routing map, strides (s_t, s_e)
        ws_ptr,  # (n_blocks, E) int32: rows of expert e taken by earlier blocks
        counts_ptr,  # (E + 1,) int32: tokens per expert; [E] written here (their sum)
        map_ptr,  # (N, 2E + 1) int32, contiguous
        n,
        e,
        s_t,
        s_e,
        BLOCK_T: tl.constexpr,
        BLOCK_E: tl.constexpr,
    ):
        b = tl.program_id(0)
        t, x, mask, m = _map_tile(rm_ptr, b, n, e, s_t, s_e, BLOCK_T, BLOCK_E)
        totals = tl.load(counts_ptr + x, mask=x < e, other=0)
        if b == 0:
            tl.store(counts_ptr + e, tl.sum(totals, axis=0))
        before = tl.cumsum(totals, axis=0) - totals
        before += tl.load(ws_ptr + b * e + x, mask=x < e, other=0)
        row = before[None, :] + tl.cumsum(m, axis=0) - 1
        _write_map_rows(map_ptr, t, x, mask, m, row, n, e)

    @triton.jit
    def _map_one_kernel(
        rm_ptr,  # (N, E) routing map, any integer or bool dtype, strides (s_t, s_e)
        counts_ptr,  # (E + 1,) int32: tokens per expert, then their sum
        map_ptr,  # (N, 2E + 1) int32, contiguous
        n,
        e,
        s_t,
        s_e,
        N_BLOCKS: tl.constexpr,  # token blocks covering N
        BLOCK_T: tl.constexpr,
        BLOCK_E: tl.constexpr,
    ):
        """The whole mask map in one program: counts (a pass over the blocks, unrolled so that
        their loads are in flight together), then the map (a second pass, carrying each
        expert's rows taken by earlier blocks)."""
        x = tl.arange(0, BLOCK_E)
        totals = tl.zeros((BLOCK_E,), tl.int32)
        for b in tl.static_range(N_BLOCKS):
            m = _map_tile(rm_ptr, b, n, e, s_t, s_e, BLOCK_T, BLOCK_E)[3]
            totals += tl.sum(m, axis=0)
        tl.store(counts_ptr + x, totals, mask=x < e)
        tl.store(counts_ptr + e, tl.sum(totals, axis=0))
        before = tl.cumsum(totals, axis=0) - totals
        for b in range(N_BLOCKS):
            t, x, mask, m = _map_tile(rm_ptr, b, n, e, s_t, s_e, BLOCK_T, BLOCK_E)
            row = before[None, :] + tl.cumsum(m, axis=0) - 1
            _write_map_rows(map_ptr, t, x, mask, m, row, n, e)
            before += tl.sum(m, axis=0)

    @triton.jit
    def _map_block_counts_kernel(
        map_ptr,  # (N, 2E + 1) int32 mask map (unused slots -1)
        ws_ptr,  # (n_blocks, E) int32: routes of block b's tokens to each expert
        n,
        e,
        BLOCK_T: tl.constexpr,
        BLOCK_E: tl.constexpr,
    ):
        b = tl.program_id(0)
        i = tl.arange(0, BLOCK_T * BLOCK_E)
        t = b * BLOCK_T + i // BLOCK_E
        s = i % BLOCK_E
        ok = (t < n) & (s < e)
        expert = tl.load(map_ptr + t.to(tl.int64) * (2 * e + 1) + e + s, mask=ok, other=-1)
        counts = tl.histogram(expert, BLOCK_E, mask=expert >= 0)
        x = tl.arange(0, BLOCK_E)
        tl.store(ws_ptr + b * e + x, counts, mask=x < e)

    @triton.jit
    def _index_map_kernel(
        order_ptr,  # (N*K,) int64: flat route ids t*K + k in stable expert order
        map_ptr,  # (K*N,) int32
        n,
        k,
        total,  # N*K
        num_out,
        BLOCK: tl.constexpr,
    ):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        j = tl.load(order_ptr + i, mask=i < total, other=0)
        t = j // k
        tl.store(map_ptr + (j - t * k) * n + t, tl.where(i < num_out, i, -1), mask=i < total)

    @triton.jit
    def _chunk_map_kernel(
        sizes_ptr,  # (S,) integer: rows of each input chunk, in input order
        order_ptr,  # (S,) integer: the input chunks in output order
        map_ptr,  # (N,) int32: output row of each input row
        n,
        s,
        BLOCK_T: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        j = tl.arange(0, BLOCK_S)
        sm = j < s
        sizes = tl.load(sizes_ptr + j, mask=sm, other=0).to(tl.int64)
        ends = tl.cumsum(sizes, axis=0)
        chunk = tl.sum(((ends[None, :] <= t[:, None]) & sm[None, :]).to(tl.int32), axis=1)
        start_in = tl.sum(tl.where(j[None, :] == chunk[:, None], (ends - sizes)[None, :], 0), 1)
        order = tl.load(order_ptr + j, mask=sm, other=-1)
        ok = sm & (order >= 0) & (order < s)
        sorted_sizes = tl.load(sizes_ptr + order, mask=ok, other=0).to(tl.int64)
        out_starts = tl.cumsum(sorted_sizes, axis=0) - sorted_sizes
        hit = (order[None, :] == chunk[:, None]) & sm[None, :]
        first = tl.min(tl.where(hit, j[None, :], BLOCK_S), axis=1)
        start_out = tl.sum(tl.where(j[None, :] == first[:, None], out_starts[None, :], 0), 1)
        dst = tl.where(t < tl.sum(sizes, axis=0), start_out + t - start_in, t)
        tl.store(map_ptr + t, dst.to(tl.int32), mask=t < n)

    _launch_count = FastLaunch(_map_count_kernel)
    _launch_scan = FastLaunch(_map_scan_kernel)
    _launch_write = FastLaunch(_map_write_kernel)
    _launch_one = FastLaunch(_map_one_kernel)
    _launch_block_counts = FastLaunch(_map_block_counts_kernel)
    _launch_index = FastLaunch(_index_map_kernel)
    _launch_chunk = FastLaunch(_chunk_map_kernel)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def _pow2(n: int, least: int = 16) -> int:
    """The power of two >= max(n, least)."""
    return max(least, 1 << (max(n, 1) - 1).bit_length())


def _key(consts: tuple, tensors: tuple, ints: tuple) -> tuple:
    """What Triton specializes a launch on: constexprs, pointer dtypes and alignment, ints."""
    key = list(consts)
    for t in tensors:
        key += (t.dtype, t.data_ptr() & 15)
    for i in ints:
        key += int_key(i)
    return tuple(key)


def _on_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and triton_available()


@compiled_as_op("(Tensor routing_map) -> (Tensor, Tensor)")
def mask_row_id_map(routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """routing_map (N, E) bool/integer -> (row_id_map (N, 2E+1) int32, row_counts (E+1,)
    int32: the rows of each expert, then their sum)."""
    if _on_triton(routing_map):
        return _mask_map_triton(routing_map)
    return mask_row_id_map_reference(routing_map)


def _mask_map_triton(
    routing_map: torch.Tensor,
    tile: int = TILE,
    one_launch_max: int | None = None,
    one_launch_tile: int = ONE_LAUNCH_TILE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch when N * BLOCK_E <= one_launch_max (None: ONE_LAUNCH_MAX, read per call;
    tiles of one_launch_tile elements), else three: block counts, their scan over blocks, the
    map (tile: elements of a (tokens, experts) block)."""
    one_launch_max = ONE_LAUNCH_MAX if one_launch_max is None else one_launch_max
    n, e = routing_map.shape
    if routing_map.dtype == torch.bool:
        routing_map = routing_map.view(torch.uint8)
    dev = routing_map.device
    row_id_map = torch.empty((n, 2 * e + 1), dtype=torch.int32, device=dev)
    counts = torch.empty((e + 1,), dtype=torch.int32, device=dev)
    if n == 0:
        return row_id_map, counts.zero_()
    block_e = _pow2(e)
    s_t, s_e = routing_map.stride()
    if n * block_e <= one_launch_max:
        block_t = max(1, one_launch_tile // block_e)
        n_blocks = -(-n // block_t)
        key = _key(
            (n_blocks, block_t, block_e), (routing_map, counts, row_id_map), (n, e, s_t, s_e)
        )
        _launch_one(
            key, (1, 1, 1), ONE_LAUNCH_WARPS, routing_map, counts, row_id_map, n, e, s_t, s_e,
            n_blocks, block_t, block_e,
        )  # fmt: skip
        return row_id_map, counts
    block_t = max(1, tile // block_e)
    n_blocks = -(-n // block_t)
    ws = torch.empty((n_blocks, e), dtype=torch.int32, device=dev)
    key = _key((block_t, block_e), (routing_map, ws), (n, e, s_t, s_e))
    _launch_count(key, (n_blocks, 1, 1), 4, routing_map, ws, n, e, s_t, s_e, block_t, block_e)
    scan_e = min(block_e, 64)
    chunk = max(1, tile // scan_e)
    if e:
        key = _key((chunk, scan_e), (ws, counts), (n_blocks, e))
        grid = (-(-e // scan_e), 1, 1)
        _launch_scan(key, grid, 4, ws, counts, n_blocks, e, chunk, scan_e)
    key = _key((block_t, block_e), (routing_map, ws, counts, row_id_map), (n, e, s_t, s_e))
    _launch_write(
        key, (n_blocks, 1, 1), 4, routing_map, ws, counts, row_id_map, n, e, s_t, s_e,
        block_t, block_e,
    )  # fmt: skip
    return row_id_map, counts


def mask_map_block_counts(row_id_map: torch.Tensor, tile: int = BLOCK_COUNTS_TILE) -> torch.Tensor:
    """A mask map (N, 2E+1) int32 -> (n_blocks, E) int32: the routes of each block of tokens
    to each expert (their column sums are mask_row_id_map's counts), one launch (CUDA only:
    the permute kernels' zeroing reads it)."""
    n = row_id_map.shape[0]
    e = (row_id_map.shape[1] - 1) // 2
    block_e = _pow2(e)
    block_t = max(1, tile // block_e)
    n_blocks = -(-n // block_t)
    ws = torch.empty((n_blocks, e), dtype=torch.int32, device=row_id_map.device)
    if n_blocks and e:
        key = _key((block_t, block_e), (row_id_map, ws), (n, e))
        _launch_block_counts(key, (n_blocks, 1, 1), 8, row_id_map, ws, n, e, block_t, block_e)
    return ws


@compiled_as_op("(Tensor indices, int num_out_tokens) -> Tensor")
def index_row_id_map(indices: torch.Tensor, num_out_tokens: int) -> torch.Tensor:
    """indices (N, K) integer expert ids -> row_id_map (K*N,) int32; routes at sorted position
    >= num_out_tokens are dropped (-1)."""
    if _on_triton(indices):
        return _index_map_triton(indices, num_out_tokens)
    return index_row_id_map_reference(indices, num_out_tokens)


def _index_map_triton(indices: torch.Tensor, num_out_tokens: int) -> torch.Tensor:
    """A torch stable sort, then one launch writing each route's row."""
    n, k = indices.shape
    order = _stable_expert_order(indices)
    row_id_map = torch.empty((n * k,), dtype=torch.int32, device=indices.device)
    total = n * k
    if total:
        block = 1024
        key = _key((block,), (order, row_id_map), (n, k, total, num_out_tokens))
        grid = (-(-total // block), 1, 1)
        _launch_index(key, grid, 4, order, row_id_map, n, k, total, num_out_tokens, block)
    return row_id_map


def _stable_expert_order(indices: torch.Tensor) -> torch.Tensor:
    """The flat route ids (t*K + k) of indices (N, K) stably sorted by expert id read as uint32
    (so negative ids come last), int64."""
    keys = indices.reshape(-1).to(torch.int64) & 0xFFFFFFFF
    return torch.sort(keys, stable=True).indices


@compiled_as_op("(Tensor split_sizes, Tensor sorted_index, int num_tokens) -> Tensor")
def chunk_sort_map(
    split_sizes: torch.Tensor, sorted_index: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """split_sizes (S,), sorted_index (S,) integer -> (num_tokens,) int32: the output row of
    each input row when the chunks are put in sorted_index's order; rows past sum(split_sizes)
    stay where they are."""
    if _on_triton(split_sizes):
        return _chunk_map_triton(split_sizes, sorted_index, num_tokens)
    return chunk_sort_map_reference(split_sizes, sorted_index, num_tokens)


def _chunk_map_triton(
    split_sizes: torch.Tensor, sorted_index: torch.Tensor, num_tokens: int, tile: int = TILE
) -> torch.Tensor:
    """One launch over blocks of rows (tile: elements of a (rows, chunks) block)."""
    s = split_sizes.shape[0]
    row_id_map = torch.empty((num_tokens,), dtype=torch.int32, device=split_sizes.device)
    if num_tokens:
        block_s = _pow2(s)
        block_t = max(1, tile // block_s)
        key = _key((block_t, block_s), (split_sizes, sorted_index), (num_tokens, s))
        grid = (-(-num_tokens // block_t), 1, 1)
        _launch_chunk(
            key, grid, 4, split_sizes, sorted_index, row_id_map, num_tokens, s, block_t, block_s
        )
    return row_id_map


# ----------------------------------------------------------------------------------------------
# Torch references: the same functions, used on CPU and in tests
# ----------------------------------------------------------------------------------------------


def mask_row_id_map_reference(routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of mask_row_id_map: (N, E) -> ((N, 2E+1) int32, (E+1,) int32)."""
    n, e = routing_map.shape
    m = (routing_map != 0).to(torch.int32)
    counts = m.sum(0, dtype=torch.int32)
    before = torch.cumsum(counts, 0, dtype=torch.int32) - counts
    row = before + torch.cumsum(m, 0, dtype=torch.int32) - 1
    n_routed = m.sum(1, dtype=torch.int32)
    above = n_routed[:, None] - torch.cumsum(m, 1, dtype=torch.int32)
    experts = torch.arange(e, dtype=torch.int32, device=m.device).expand(n, e)
    routed = m != 0
    slot = torch.where(routed, above, n_routed[:, None] + (e - 1 - experts) - above).long()
    row_id_map = torch.empty((n, 2 * e + 1), dtype=torch.int32, device=m.device)
    row_id_map[:, :e].scatter_(1, slot, torch.where(routed, row, -1))
    row_id_map[:, e : 2 * e].scatter_(1, slot, torch.where(routed, experts, -1))
    row_id_map[:, 2 * e] = n_routed
    return row_id_map, torch.cat([counts, counts.sum(dtype=torch.int32).reshape(1)])


def mask_map_block_counts_reference(
    row_id_map: torch.Tensor, tile: int = BLOCK_COUNTS_TILE
) -> torch.Tensor:
    """Torch reference of mask_map_block_counts: (N, 2E+1) -> (n_blocks, E) int32."""
    n = row_id_map.shape[0]
    e = (row_id_map.shape[1] - 1) // 2
    block_t = max(1, tile // _pow2(e))
    n_blocks = -(-n // block_t)
    experts = row_id_map[:, e : 2 * e].long()
    one_hot = torch.zeros((n_blocks * block_t, e + 1), dtype=torch.int32, device=experts.device)
    one_hot[:n].scatter_add_(
        1, torch.where(experts >= 0, experts, e), torch.ones_like(experts, dtype=torch.int32)
    )
    return one_hot[:, :e].reshape(n_blocks, block_t, e).sum(1, dtype=torch.int32)


def index_row_id_map_reference(indices: torch.Tensor, num_out_tokens: int) -> torch.Tensor:
    """Torch reference of index_row_id_map: (N, K) -> (K*N,) int32."""
    n, k = indices.shape
    order = _stable_expert_order(indices)
    position = torch.arange(n * k, device=indices.device)
    row_id_map = torch.empty((n * k,), dtype=torch.int32, device=indices.device)
    row_id_map[(order % k) * n + order // k] = torch.where(
        position < num_out_tokens, position, -1
    ).to(torch.int32)
    return row_id_map


def chunk_sort_map_reference(
    split_sizes: torch.Tensor, sorted_index: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """Torch reference of chunk_sort_map: -> (num_tokens,) int32."""
    s = split_sizes.shape[0]
    dev = split_sizes.device
    t = torch.arange(num_tokens, device=dev)
    if s == 0:
        return t.to(torch.int32)
    sizes = split_sizes.to(torch.int64)
    ends = torch.cumsum(sizes, 0)
    chunk = (ends[None, :] <= t[:, None]).sum(1)
    start_in = torch.where(chunk < s, (ends - sizes)[chunk.clamp(max=s - 1)], 0)
    order = sorted_index.to(torch.int64)
    ok = (order >= 0) & (order < s)
    sorted_sizes = torch.where(ok, sizes[order.clamp(0, s - 1)], 0)
    out_starts = torch.cumsum(sorted_sizes, 0) - sorted_sizes
    j = torch.arange(s, device=dev)
    first = torch.where(order[None, :] == chunk[:, None], j, s).min(1).values
    start_out = torch.where(first < s, out_starts[first.clamp(max=s - 1)], 0)
    return torch.where(t < ends[-1], start_out + t - start_in, t).to(torch.int32)
