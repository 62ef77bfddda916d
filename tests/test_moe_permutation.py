"""MoE token permutation (torchte.moe.permutation, Transformer Engine's te.permutation names).

The references of torchte/kernels/permutation*.py against a float64 model written from the
definitions alone (rows grouped by expert, tokens in order within an expert; `nonzero` on the
transposed routing map, a stable sort of expert ids, python list slicing for chunks; gather and
index_add for the data), whose gradients come from torch.autograd; gradcheck on small sizes;
the Triton kernels against the references under Triton's CPU interpreter; and on a GPU, CUDA
against the CPU byte for byte. Sizes are odd: 37 tokens, 7 experts (one with no token), top-2,
hidden 129.
"""

from __future__ import annotations

import pytest
import torch
from interpreter import requires_interpreter, run_under_interpreter
from tolerances import assert_close, representable

from torchte.kernels import permutation as kp
from torchte.moe import (
    moe_permute,
    moe_permute_and_pad_with_probs,
    moe_permute_with_probs,
    moe_sort_chunks_by_index,
    moe_sort_chunks_by_index_with_probs,
    moe_unpermute,
)
from torchte.quantization.float8 import Float8Storage
from torchte.quantization.float8_tensor import Float8Tensor

N, E, K, H = 37, 7, 2, 129
EMPTY_EXPERT = 3
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def routing(n: int = N, e: int = E, k: int = K, empty: tuple[int, ...] = (EMPTY_EXPERT,)):
    """(routing_map (n, e) bool, indices (n, k) int64): top-k of random scores, never choosing
    the experts in `empty` (so they get no token)."""
    scores = torch.rand(n, e)
    scores[:, list(empty)] = -1.0
    indices = scores.topk(k, dim=1).indices
    routing_map = torch.zeros(n, e, dtype=torch.bool).scatter_(1, indices, True)
    return routing_map, indices


def routed_probs(routing_map: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Probs (N, E): nonzero, exactly representable, where routed; zero elsewhere."""
    p = (torch.randint(1, 64, routing_map.shape) / 64.0).to(dtype)
    return p * routing_map


# ----------------------------------------------------------------------------------------------
# The float64 model
# ----------------------------------------------------------------------------------------------


def model_routes(routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, expert) of each permuted row: experts in order, tokens in order within one."""
    expert, token = (routing_map != 0).t().nonzero(as_tuple=True)
    return token, expert


def model_mask_map(routing_map: torch.Tensor) -> torch.Tensor:
    """Transformer Engine's mask row_id_map (N, 2E+1), unused slots -1, built route by route."""
    n, e = routing_map.shape
    token, expert = model_routes(routing_map)
    row_id_map = torch.full((n, 2 * e + 1), -1, dtype=torch.int32)
    for t in range(n):
        rows = [(r, int(expert[r])) for r in range(len(token)) if token[r] == t]
        rows.sort(reverse=True)
        for slot, (r, x) in enumerate(rows):
            row_id_map[t, slot], row_id_map[t, e + slot] = r, x
        row_id_map[t, 2 * e] = len(rows)
    return row_id_map


def model_index_map(indices: torch.Tensor, num_out: int) -> torch.Tensor:
    """Transformer Engine's index row_id_map (K*N,): routes stably sorted by expert id read
    as uint32; sorted positions >= num_out dropped (-1)."""
    n, k = indices.shape
    flat = [int(v) % 2**32 for v in indices.reshape(-1)]
    order = sorted(range(n * k), key=lambda j: (flat[j], j))
    row_id_map = torch.empty(n * k, dtype=torch.int32)
    for position, j in enumerate(order):
        row_id_map[(j % k) * n + j // k] = position if position < num_out else -1
    return row_id_map


def model_permute(x, routing_map, probs, num_out):
    """(out (num_out, H), out_probs (num_out,) or None) in float64, routes past num_out
    dropped, rows past the routed ones zero; a zero prob zeroes its row."""
    token, expert = model_routes(routing_map)
    token, expert = token[:num_out], expert[:num_out]
    rows = x.double().index_select(0, token)
    out_probs = None
    if probs is not None:
        p = probs.double()[token, expert]
        out_probs = torch.cat([p, p.new_zeros(num_out - len(p))])
        rows = rows * (p != 0)[:, None]
    return torch.cat([rows, rows.new_zeros(num_out - len(rows), x.shape[1])]), out_probs


def model_unpermute(y, routing_map, merging_probs):
    """out (N, H) float64: each token's routes (rows of y below len(y)) summed, times the
    merging probs when given."""
    token, expert = model_routes(routing_map)
    r = min(len(token), y.shape[0])
    rows = y.double()[:r]
    if merging_probs is not None:
        rows = rows * merging_probs.double()[token[:r], expert[:r]][:, None]
    out = torch.zeros(routing_map.shape[0], y.shape[1], dtype=torch.float64)
    return out.index_add(0, token[:r], rows)


def model_sort_chunks(x, split_sizes, sorted_index):
    sizes = split_sizes.tolist()
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    chunks = [x[starts[i] : starts[i] + sizes[i]] for i in sorted_index.tolist()]
    return torch.cat([*chunks, x[sum(sizes) :]])


# ----------------------------------------------------------------------------------------------
# Maps
# ----------------------------------------------------------------------------------------------


def test_mask_map_has_transformer_engines_layout():
    # The example in Transformer Engine's make_row_id_map comments (its unused slots: -1 here).
    routing_map = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 0, 1], [1, 1, 0], [0, 0, 0]])
    row_id_map, counts = kp.mask_row_id_map(routing_map)
    r = -1
    expected = [
        [3, 0, r, 1, 0, r, 2],
        [5, 1, r, 2, 0, r, 2],
        [6, r, r, 2, r, r, 1],
        [4, 2, r, 1, 0, r, 2],
        [r, r, r, r, r, r, 0],
    ]
    assert row_id_map.tolist() == expected and row_id_map.dtype == torch.int32
    assert counts.tolist() == [3, 2, 2, 7]


@pytest.mark.parametrize("dtype", [torch.bool, torch.int32, torch.int64, torch.uint8])
def test_mask_map_matches_model(dtype):
    routing_map, _ = routing()
    row_id_map, counts = kp.mask_row_id_map(routing_map.to(dtype))
    assert torch.equal(row_id_map, model_mask_map(routing_map))
    assert counts[EMPTY_EXPERT] == 0
    assert torch.equal(counts[:-1], routing_map.sum(0).int()) and counts[-1] == N * K
    # A non-contiguous map (a transposed view) gives the same.
    transposed = routing_map.t().contiguous().t()
    assert torch.equal(kp.mask_row_id_map(transposed)[0], row_id_map)


@pytest.mark.parametrize("num_out", [N * K, N * K - 9, 5])
def test_index_map_matches_model(num_out):
    _, indices = routing()
    indices[4, 1] = -1  # an id masked off (expert parallelism): sorted last
    for dtype in (torch.int32, torch.int64):
        row_id_map = kp.index_row_id_map(indices.to(dtype), num_out)
        assert torch.equal(row_id_map, model_index_map(indices, num_out))


def test_chunk_map_matches_model():
    sizes, order = torch.tensor([3, 0, 10, 5, 9]), torch.tensor([2, 4, 0, 3, 1])
    row_id_map = kp.chunk_sort_map(sizes, order, 30)  # 3 rows past the chunks keep their place
    x = torch.arange(30)
    out = torch.empty_like(x)
    out[row_id_map.long()] = x
    assert torch.equal(out, model_sort_chunks(x, sizes, order))


# ----------------------------------------------------------------------------------------------
# Values: the reference against the model
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("drop", [0, 9, -6])  # num_out = routed - drop
def test_permute_and_unpermute_match_model(dtype, drop):
    routing_map, _ = routing()
    x = representable((N, H), dtype).to(dtype)
    probs = routed_probs(routing_map)
    probs[5, routing_map[5].nonzero()[0, 0]] = 0.0  # a padding route: its row is zero
    num_out = N * K - drop
    out, permuted_probs, row_id_map = moe_permute_with_probs(x, probs, routing_map, num_out)
    want, want_probs = model_permute(x, routing_map, probs, num_out)
    assert out.dtype == dtype and out.shape == (num_out, H)
    assert torch.equal(out.double(), want) and torch.equal(permuted_probs.double(), want_probs)
    plain, _ = moe_permute(x, routing_map, num_out)
    assert torch.equal(plain.double(), model_permute(x, routing_map, None, num_out)[0])
    merged = moe_unpermute(out, row_id_map, merging_probs=probs, restore_shape=(N, H))
    assert merged.dtype == dtype
    assert_close(merged, model_unpermute(out, routing_map, probs), dtype)
    summed = moe_unpermute(plain, row_id_map)
    assert_close(summed, model_unpermute(plain, routing_map, None), dtype)


def test_round_trip_restores_tokens():
    routing_map, _ = routing()
    x = representable((N, H), torch.float32)
    out, row_id_map = moe_permute(x, routing_map, N * K)
    assert torch.equal(moe_unpermute(out, row_id_map), x * K)  # every token goes to K experts
    probs = routing_map / K  # halves: exact
    merged = moe_unpermute(out, row_id_map, probs, restore_shape=(1, N, H))
    assert merged.shape == (1, N, H) and torch.equal(merged[0], x)


def test_index_map_round_trip_and_te_reading_without_probs():
    _, indices = routing()
    x = representable((N, H), torch.float32)
    out, row_id_map = moe_permute(x, indices.int(), map_type="index")
    assert out.shape == (N * K, H) and row_id_map.shape == (N * K,)
    assert torch.equal(out, x[indices.reshape(-1).sort(stable=True).indices // K])
    probs = torch.full((N, K), 1.0 / K)
    assert torch.equal(moe_unpermute(out, row_id_map, probs, map_type="index"), x)
    # Without probs Transformer Engine reads the map with K = 1: row k*N + t is route k of t.
    rows = moe_unpermute(out, row_id_map, map_type="index")
    assert torch.equal(rows, x.repeat(K, 1))


def test_index_map_drops_routes_past_num_out_tokens_and_zeroes_extra_rows():
    _, indices = routing()
    x = representable((N, H), torch.float32)
    out, row_id_map = moe_permute(x, indices, num_out_tokens=N * K - 5, map_type="index")
    assert (row_id_map == -1).sum() == 5 and out.shape == (N * K - 5, H)
    merged = moe_unpermute(out, row_id_map, torch.ones(N, K), map_type="index")
    kept = (row_id_map.view(K, N).t() >= 0).sum(1, keepdim=True)
    assert torch.equal(merged, x * kept)
    wide, _ = moe_permute(x, indices, num_out_tokens=N * K + 3, map_type="index")
    assert torch.equal(wide[: N * K], moe_permute(x, indices, map_type="index")[0])
    assert not wide[N * K :].any()


def test_num_out_tokens_inferred_or_given_as_tensor():
    routing_map, _ = routing()
    x = representable((N, H), torch.float32)
    full, row_id_map = moe_permute(x, routing_map, N * K)
    for num_out in (-1, None, torch.tensor(N * K)):
        out, again = moe_permute(x, routing_map, num_out)
        assert torch.equal(out, full) and torch.equal(again, row_id_map)


def test_dropped_routes_unpermute_as_zero_and_get_no_gradient():
    routing_map, _ = routing()
    x = representable((N, H), torch.float64).double().requires_grad_()
    probs = routed_probs(routing_map, torch.float64).requires_grad_()
    num_out = N * K - 9  # the last expert's last 9 routes
    out, permuted_probs, row_id_map = moe_permute_with_probs(x, probs, routing_map, num_out)
    token, expert = model_routes(routing_map)
    merged = moe_unpermute(out, row_id_map, probs)
    assert torch.equal(merged, model_unpermute(out, routing_map, probs))
    (merged.sum() + permuted_probs.sum()).backward()
    dropped = (token[num_out:], expert[num_out:])
    assert not probs.grad[dropped].any() and probs.grad[token[:num_out], expert[:num_out]].all()


# ----------------------------------------------------------------------------------------------
# Gradients
# ----------------------------------------------------------------------------------------------


def test_gradients_match_autograd_through_model():
    routing_map, _ = routing()
    x = representable((N, H), torch.float64).double()
    probs = routed_probs(routing_map, torch.float64)
    weight = representable((H,), torch.float64).double()  # an "expert" between the two
    grad = representable((N, H), torch.float64).double()

    def run(permute, unpermute):
        xs, ps = x.clone().requires_grad_(), probs.clone().requires_grad_()
        y = unpermute(permute(xs, ps) * weight, ps)
        y.backward(grad)
        return y, xs.grad, ps.grad

    ours = run(
        lambda xs, ps: moe_permute_with_probs(xs, ps, routing_map, N * K)[0],
        lambda y, ps: moe_unpermute(y, moe_permute(x, routing_map, N * K)[1], ps),
    )
    model = run(
        lambda xs, ps: model_permute(xs, routing_map, ps, N * K)[0],
        lambda y, ps: model_unpermute(y, routing_map, ps),
    )
    for a, b in zip(ours, model, strict=True):
        assert_close(a, b, torch.float32)


def test_gradcheck_float64():
    routing_map, indices = routing(n=5, e=4, k=2, empty=(1,))
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    probs = (torch.rand(5, 4, dtype=torch.float64) + 0.5) * routing_map
    probs.requires_grad_()
    _, row_id_map = moe_permute(x, routing_map, 10)
    pad_offsets = moe_permute_and_pad_with_probs(x, probs, routing_map, routing_map.sum(0), 4)[3]

    def mask(a, p):
        out, pp, _ = moe_permute_with_probs(a, p, routing_map, 10)
        return moe_unpermute(out * pp[:, None], row_id_map, p), pp

    def padded(a, p):
        out, pp, m, pad, _ = moe_permute_and_pad_with_probs(
            a, p, routing_map, routing_map.sum(0), 4
        )
        return moe_unpermute(out, m, p, pad_offsets=pad), pp

    def index(a, p):
        out, m = moe_permute(a, indices, map_type="index")
        return moe_unpermute(out, m, p[:, :2] + 0.5, map_type="index")

    def chunks(a, p):
        sizes, order = torch.tensor([2, 0, 3]), torch.tensor([2, 0, 1])
        return moe_sort_chunks_by_index_with_probs(a, p[:, 0], sizes, order)

    for fn in (mask, padded, index, chunks):
        assert torch.autograd.gradcheck(fn, (x, probs)), fn.__name__
    assert pad_offsets is not None


# ----------------------------------------------------------------------------------------------
# Padding, chunk sort, zero tokens, FP8
# ----------------------------------------------------------------------------------------------


def test_permute_and_pad_conventions():
    routing_map, _ = routing()
    x = representable((N, H), torch.bfloat16).bfloat16()
    probs = routed_probs(routing_map)
    counts = routing_map.sum(0)
    out, permuted_probs, row_id_map, pad_offsets, target = moe_permute_and_pad_with_probs(
        x, probs, routing_map, counts, 8
    )
    want_target = (counts + 7) // 8 * 8
    assert target.dtype == torch.int64 and torch.equal(target, want_target)
    assert pad_offsets.dtype == torch.int64
    assert torch.equal(pad_offsets, torch.cumsum(want_target - counts, 0) - (want_target - counts))
    assert out.shape == (int(target.sum()), H) and permuted_probs.shape == (int(target.sum()),)
    unpadded, unpadded_probs = model_permute(x, routing_map, probs, N * K)
    starts, ends = torch.cumsum(target, 0) - target, torch.cumsum(target, 0)
    source = torch.cumsum(counts, 0) - counts
    for e in range(E):  # each expert's block: its rows, then zero rows up to the multiple of 8
        block, rows = slice(int(starts[e]), int(ends[e])), int(counts[e])
        want = unpadded[int(source[e]) : int(source[e]) + rows]
        assert torch.equal(out[block][:rows].double(), want) and not out[block][rows:].any()
        assert not permuted_probs[block][rows:].any()
    assert torch.equal(permuted_probs[permuted_probs != 0].double(), unpadded_probs)
    merged = moe_unpermute(out, row_id_map, probs, pad_offsets=pad_offsets)
    assert torch.equal(
        merged, moe_unpermute(moe_permute(x, routing_map, N * K)[0], row_id_map, probs)
    )
    # Counts already aligned: no padding, pad_offsets None.
    aligned = moe_permute_and_pad_with_probs(x, probs, routing_map, counts, 1)
    assert aligned[3] is None and torch.equal(aligned[0], moe_permute(x, routing_map, N * K)[0])


@pytest.mark.parametrize("with_probs", [False, True])
def test_sort_chunks_matches_model(with_probs):
    x = representable((N, H), torch.bfloat16).bfloat16().requires_grad_()
    sizes, order = torch.tensor([3, 0, 10, 5, 17]), torch.tensor([4, 2, 0, 3, 1])
    grad = representable((N, H), torch.bfloat16).bfloat16()
    if with_probs:
        probs = representable((N,), torch.float32).requires_grad_()
        out, out_probs = moe_sort_chunks_by_index_with_probs(x, probs, sizes, order)
        assert torch.equal(out_probs, model_sort_chunks(probs, sizes, order))
        (out.float() * grad.float()).sum().add(out_probs.sum()).backward()
        assert torch.equal(probs.grad, torch.ones(N))
    else:
        out = moe_sort_chunks_by_index(x, sizes, order)
        out.backward(grad)
    assert torch.equal(out, model_sort_chunks(x, sizes, order))
    restore = torch.tensor([2, 4, 1, 3, 0])  # sorted sizes [17, 10, 3, 5, 0] back
    back = moe_sort_chunks_by_index(grad, sizes[order], restore)
    assert torch.equal(x.grad, back)


def test_zero_tokens():
    x = torch.zeros(0, H, requires_grad=True)
    routing_map, probs = torch.zeros(0, E, dtype=torch.bool), torch.zeros(0, E)
    out, row_id_map = moe_permute(x, routing_map, 0)
    assert out.shape == (0, H) and row_id_map.shape == (0, 2 * E + 1)
    out, permuted_probs, _ = moe_permute_with_probs(x, probs, routing_map, 5)
    assert out.shape == (0, H) and permuted_probs.shape == (0,)
    assert moe_unpermute(out, row_id_map, probs).shape == (0, H)
    padded = moe_permute_and_pad_with_probs(
        x, probs, routing_map, torch.zeros(E, dtype=torch.long), 16
    )
    assert padded[0].shape == (0, H) and padded[3] is None
    out, idx_map = moe_permute(x, torch.zeros(0, K, dtype=torch.long), map_type="index")
    assert out.shape == (0, H) and idx_map.shape == (0,)
    sorted_x = moe_sort_chunks_by_index(x, torch.zeros(3, dtype=torch.long), torch.arange(3))
    sorted_x.sum().backward()
    assert sorted_x.shape == (0, H) and x.grad.shape == (0, H)
    # Tokens, but every route dropped by the unpermute's input: zeros.
    routing_map, _ = routing()
    _, row_id_map = moe_permute(torch.zeros(N, H), routing_map, N * K)
    assert not moe_unpermute(torch.zeros(0, H), row_id_map).any()


def test_float8_tensor_moves_as_bytes():
    routing_map, _ = routing()
    data = torch.randint(0, 120, (N, H), dtype=torch.uint8)
    scale_inv = torch.tensor([0.5])
    storage = Float8Storage(
        data.view(torch.float8_e4m3fn), None, scale_inv, torch.float8_e4m3fn, (N, H)
    )
    x8 = Float8Tensor(storage, torch.bfloat16, requires_grad=True)
    out, row_id_map = moe_permute(x8, routing_map, N * K)
    assert isinstance(out, Float8Tensor) and out.dtype == torch.bfloat16
    assert out._storage.scale_inv is scale_inv
    token, _ = model_routes(routing_map)
    assert torch.equal(out._storage.rowwise_data.view(torch.uint8), data[token])
    sizes, order = torch.tensor([30, 7]), torch.tensor([1, 0])
    sorted8 = moe_sort_chunks_by_index(x8, sizes, order)
    assert torch.equal(
        sorted8._storage.rowwise_data.view(torch.uint8), model_sort_chunks(data, sizes, order)
    )
    # Gradients are plain tensors of the nominal dtype: K copies of the output's gradient.
    moe_unpermute(out.dequantize(), row_id_map).float().sum().backward()
    assert x8.grad.dtype == torch.bfloat16 and torch.equal(x8.grad, torch.full((N, H), K * 1.0))
    with pytest.raises(NotImplementedError, match="index"):
        moe_permute(x8, routing_map.long().topk(K).indices, map_type="index")
    with pytest.raises(NotImplementedError, match="moe_unpermute"):
        moe_unpermute(out, row_id_map)


def test_compiles_in_one_graph():
    routing_map, _ = routing()
    x = representable((N, H), torch.float32)
    probs = routed_probs(routing_map)

    def step(x, probs):
        out, permuted_probs, row_id_map = moe_permute_with_probs(x, probs, routing_map, N * K)
        return moe_unpermute(out * permuted_probs[:, None], row_id_map, probs)

    eager_x, eager_p = x.clone().requires_grad_(), probs.clone().requires_grad_()
    step(eager_x, eager_p).square().sum().backward()
    compiled_x, compiled_p = x.clone().requires_grad_(), probs.clone().requires_grad_()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    compiled(compiled_x, compiled_p).square().sum().backward()
    assert torch.equal(compiled_x.grad, eager_x.grad)
    assert torch.equal(compiled_p.grad, eager_p.grad)


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------


def _bad_cases():
    routing_map, indices = routing()
    x, probs = torch.zeros(N, H), routed_probs(routing_map)
    _, row_id_map = moe_permute(x, routing_map, N * K)
    counts = routing_map.sum(0)
    sizes, order = torch.tensor([30, 7]), torch.tensor([1, 0])
    return [
        (lambda: moe_permute(x, routing_map, N * K, map_type="dense"), ValueError, "map_type"),
        (lambda: moe_permute(x[None], routing_map, N * K), ValueError, "inp must be a 2-D"),
        (lambda: moe_permute(x, routing_map.float(), N * K), TypeError, "routing_map must be bool"),
        (lambda: moe_permute(x, indices.float(), map_type="index"), TypeError, "integer expert"),
        (lambda: moe_permute(x[:5], routing_map, N * K), ValueError, "37 rows, inp 5"),
        (lambda: moe_permute(x, routing_map, 0), ValueError, "num_out_tokens must be positive"),
        (lambda: moe_permute(x, routing_map, 3.0), TypeError, "num_out_tokens must be an int"),
        (lambda: moe_permute(x, routing_map, N * K, max_token_num="8"), TypeError, "max_token_num"),
        (
            lambda: moe_permute(x, routing_map.to("meta"), N * K),
            ValueError,
            "routing_map is on meta",
        ),
        (
            lambda: moe_permute_with_probs(x, probs[:, :3], routing_map, N * K),
            ValueError,
            "probs must have shape",
        ),
        (
            lambda: moe_permute_with_probs(x, routing_map.int(), routing_map, N * K),
            TypeError,
            "probs must be floating",
        ),
        (lambda: moe_unpermute(x, row_id_map.long()), ValueError, "row_id_map must be"),
        (
            lambda: moe_unpermute(x, row_id_map, restore_shape=(N + 1, H)),
            ValueError,
            "restore_shape",
        ),
        (
            lambda: moe_unpermute(x, row_id_map, probs[:, :2]),
            ValueError,
            "merging_probs must have shape",
        ),
        (lambda: moe_unpermute(x, row_id_map, probs, probs=probs), ValueError, "not both"),
        (
            lambda: moe_unpermute(x, row_id_map, pad_offsets=torch.zeros(3, dtype=torch.long)),
            ValueError,
            "pad_offsets must have shape",
        ),
        (lambda: moe_unpermute(x, row_id_map, map_type="index"), ValueError, "row_id_map must be"),
        (
            lambda: moe_permute_and_pad_with_probs(x, probs, routing_map, None, 8),
            ValueError,
            "tokens_per_expert must be given",
        ),
        (
            lambda: moe_permute_and_pad_with_probs(x, probs, routing_map, counts, 0),
            ValueError,
            "align_size must be positive",
        ),
        (
            lambda: moe_permute_and_pad_with_probs(x, probs, routing_map, counts + 1, 8),
            ValueError,
            "routes per expert",
        ),
        (
            lambda: moe_sort_chunks_by_index(x, sizes.float(), order),
            ValueError,
            "split_sizes must be a 1-D integer",
        ),
        (lambda: moe_sort_chunks_by_index(x, sizes, order[:1]), ValueError, "one entry per chunk"),
        (
            lambda: moe_sort_chunks_by_index(x, sizes + 1, order),
            ValueError,
            "more than inp's 37 rows",
        ),
        (
            lambda: moe_sort_chunks_by_index(x, sizes, torch.tensor([1, 1])),
            ValueError,
            "permutation",
        ),
        (lambda: moe_sort_chunks_by_index(x, torch.tensor([-1, 7]), order), ValueError, ">= 0"),
        (
            lambda: moe_sort_chunks_by_index_with_probs(x, probs, sizes, order),
            ValueError,
            "probs must have shape",
        ),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_input_raises_naming_the_argument(case):
    call, error, match = _bad_cases()[case]
    with pytest.raises(error, match=match):
        call()


def test_deprecated_probs_keyword_still_works():
    routing_map, _ = routing()
    x, probs = representable((N, H), torch.float32), routed_probs(routing_map)
    out, row_id_map = moe_permute(x, routing_map, N * K)
    with pytest.warns(DeprecationWarning, match="merging_probs"):
        old = moe_unpermute(out, row_id_map, probs=probs)
    assert torch.equal(old, moe_unpermute(out, row_id_map, probs))


# ----------------------------------------------------------------------------------------------
# The Triton kernels under Triton's CPU interpreter; CUDA against the CPU
# ----------------------------------------------------------------------------------------------

INTERPRETER_SCRIPT = """
import torch
from tolerances import assert_close
from torchte.kernels import permutation as kp, permutation_maps as km
from test_moe_permutation import routing, routed_probs, N, E, K, H

def same(a, b, where):
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where

torch.manual_seed(0)
routing_map, indices = routing()
routing_map[5, :] = False  # a token with no route
# Small tiles: several token blocks in the map kernels.
for rm in (routing_map, routing_map.int().t().contiguous().t()):
    m, c = km._mask_map_triton(rm, 64)
    m_ref, c_ref = kp.mask_row_id_map_reference(rm)
    same(m, m_ref, "mask map"); same(c, c_ref, "counts")
total = int(c[-1])
indices[3, 1] = -1
for num_out in (N * K, N * K - 7):
    want = kp.index_row_id_map_reference(indices, num_out)
    same(km._index_map_triton(indices, num_out), want, "index map")
sizes, order = torch.tensor([3, 0, 10, 5, 9]), torch.tensor([2, 4, 0, 3, 1])
want = kp.chunk_sort_map_reference(sizes, order, 30)
same(km._chunk_map_triton(sizes, order, 30, 64), want, "chunks")
# The row kernels on 17 tokens (the interpreter runs each program in Python).
n = 17
routing_map, indices = routing(n=n)
routing_map[5, :] = False
indices[3, 1] = -1
m, c = km._mask_map_triton(routing_map)
total = int(c[-1])
pad = torch.tensor([0, 3, 3, 5, 9, 9, 12])
h = 19  # one hidden block of 32, or three of 8 (the launchers' last arguments)
cases = [(m, True, None, c[-1:], n_out, 0) for n_out in (total, total - 5, total + 6)]
cases += [(m, True, pad, None, total + 12, 0), (m, False, None, None, total, 0)]
for n_out in (n * K - 3, n * K + 2):
    cases.append((kp.index_row_id_map_reference(indices, n_out), False, None, None, n_out, K))
for dtype in (torch.float32, torch.bfloat16, torch.uint8):
    x = (torch.randn(n, h) * 4).to(dtype)
    probs = routed_probs(routing_map)
    probs[7, routing_map[7].nonzero()[0, 0]] = 0.0
    for i, (row_map, with_p, pd, valid, n_out, topk) in enumerate(cases):
        if dtype != torch.float32 and i not in (1, 6):
            continue
        block = 8 if i in (1, 3, 6) else 32
        p = probs if with_p else None
        where = (dtype, n_out, topk, with_p, pd is not None)
        out, pp = kp._permute_triton(x, row_map, p, pd, valid, n_out, topk, block, 3)
        out_ref, pp_ref = kp.permute_rows_reference(x, row_map, p, pd, valid, n_out, topk)
        same(out, out_ref, where)
        if p is not None:
            same(pp, pp_ref, where)
        if dtype == torch.uint8:
            continue
        merge = p if not topk else torch.rand(n, K)
        for mp, ppr in ((merge, pp), (None, None)):
            y, up = kp._unpermute_triton(out, row_map, mp, ppr, pd, topk, block)
            y_ref, up_ref = kp.unpermute_rows_reference(out, row_map, mp, ppr, pd, topk)
            if dtype == torch.bfloat16:  # the interpreter rounds fp32 -> bf16 its own way
                assert_close(y, y_ref, dtype, msg=str(where))
            else:
                same(y, y_ref, where)
            if ppr is not None:
                same(up, up_ref, where)
        if merge is None:
            continue
        g = torch.randn(n, h).to(dtype)
        d, dp = kp._unpermute_bwd_triton(g, row_map, out, merge, pd, valid, topk, block, 3)
        ref = kp.unpermute_rows_backward_reference
        d_ref, dp_ref = ref(g, row_map, out, merge, pd, valid, topk)
        if dtype == torch.bfloat16:
            assert_close(d, d_ref, dtype, msg=str(where))
        else:
            same(d, d_ref, where)
        assert_close(dp, dp_ref, torch.float32, msg=str(where))
# Chunk sort: an index map with K = 1 (a plain gather back, bytes kept).
cmap = kp.chunk_sort_map_reference(sizes, order, 30)
x = torch.randint(0, 255, (30, 5), dtype=torch.uint8)
p = torch.rand(30, 1)
out, pp = kp._permute_triton(x, cmap, p, None, None, 30, 1)
same(out, kp.permute_rows_reference(x, cmap, p, None, None, 30, 1)[0], "chunk sort")
back, up = kp._unpermute_triton(out, cmap, None, pp, None, 1)
same(back, x, "chunk sort back"); same(up, p, "chunk sort probs back")
print("ok")
"""


@requires_interpreter
def test_triton_kernels_in_interpreter_match_reference():
    run_under_interpreter(INTERPRETER_SCRIPT)


def _cuda_cases():
    routing_map, indices = routing()
    x = representable((N, H), torch.bfloat16).bfloat16()
    probs = routed_probs(routing_map)
    return routing_map, indices, x, probs


@pytest.mark.gpu
def test_cuda_gives_the_cpus_bytes():
    routing_map, indices, x, probs = _cuda_cases()
    counts = routing_map.sum(0)

    def run(device):
        rm, idx, xs, ps = (t.to(device) for t in (routing_map, indices, x, probs))
        out, pp, m = moe_permute_with_probs(xs, ps, rm, N * K - 4)
        padded = moe_permute_and_pad_with_probs(xs, ps, rm, counts.to(device), 16)
        iout, imap = moe_permute(xs, idx, N * K - 3, map_type="index")
        sizes, order = (
            torch.tensor([3, 0, 10, 24], device=device),
            torch.tensor([2, 0, 3, 1], device=device),
        )
        sorted_x, sorted_p = moe_sort_chunks_by_index_with_probs(xs, ps[:, 0], sizes, order)
        merged = moe_unpermute(out, m, ps)
        return [out, pp, m, *padded[:4], iout, imap, sorted_x, sorted_p, merged]

    cpu, cuda = run("cpu"), run("cuda")
    for i, (a, b) in enumerate(zip(cpu, cuda, strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b.cpu()), i


@pytest.mark.gpu
def test_cuda_gradients_give_the_cpus_bytes():
    """Gradients that are copies and fp32 sums (not the merging probs' dot products)."""
    routing_map, _, x, probs = _cuda_cases()
    grad = representable((N, H), torch.bfloat16).bfloat16()

    def run(device):
        xs = x.detach().to(device).requires_grad_()  # leaves on either device
        ps = probs.detach().to(device).requires_grad_()
        rm = routing_map.to(device)
        out, pp, m = moe_permute_with_probs(xs, ps, rm, N * K + 3)
        back = moe_unpermute(out, m)
        (back.float() * grad.to(device).float()).sum().add(pp.sum()).backward()
        return [back, xs.grad, ps.grad]

    cpu, cuda = run("cpu"), run("cuda")
    for i, (a, b) in enumerate(zip(cpu, cuda, strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b.cpu()), i
