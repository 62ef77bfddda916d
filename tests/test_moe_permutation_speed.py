"""The MoE permutation's launch-saving paths keep the bytes (torchte/kernels/permutation*.py).

Under Triton's CPU interpreter, with small odd sizes: the one-launch mask map equals the
reference and the three-launch map (odd N and E, zero tokens, an expert with no token, tiles
small enough for several blocks); the per-block expert counts read back from a map; the permute
kernels' zeroing of the rows no route writes (pad rows between experts, spare rows at the end,
rows past a short output, shuffled expert blocks, zero tokens) with every torch.empty of the
run poisoned (NaN, or 0x5A bytes), so a row left unwritten cannot pass for a zero; unpermute's
sum unrolled over several route tiles, bit-exact; a row split over several programs. Each
launcher call is counted: its Triton launches, and no torch fill. On a GPU: the same bytes as
the CPU under a poisoned allocator, and the device operations per call.
"""

from __future__ import annotations

import pytest
import torch
from interpreter import requires_interpreter, run_under_interpreter
from launches import count_device_ops

from torchte.kernels.permutation_maps import mask_row_id_map
from torchte.moe import (
    moe_permute,
    moe_permute_and_pad_with_probs,
    moe_permute_with_probs,
    moe_unpermute,
)
from torchte.moe._permutation_functions import MaskPermute, Plan

# Shared by the interpreter scripts: a launch counter, a poisoned torch.empty, comparisons.
COMMON = """
import torch
import torchte.kernels._triton as triton_plumbing
from torchte.kernels import permutation as kp, permutation_maps as km
from test_moe_permutation import routing, routed_probs

calls = {"launch": 0, "fill": 0}
plain_call = triton_plumbing.FastLaunch.__call__

def counted_call(self, *args, **kw):
    calls["launch"] += 1
    return plain_call(self, *args, **kw)

triton_plumbing.FastLaunch.__call__ = counted_call
plain_empty, plain_zeros, plain_zero_ = torch.empty, torch.zeros, torch.Tensor.zero_

def poisoned_empty(*args, **kw):
    t = plain_empty(*args, **kw)
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(0x5A)
    return t

def counted_zeros(*args, **kw):
    calls["fill"] += 1
    return plain_zeros(*args, **kw)

def counted_zero_(self):
    calls["fill"] += 1
    return plain_zero_(self)

def launches(fn, *args, fills=0, **kw):
    # (fn's result, its Triton launches), every torch.empty poisoned; `fills` torch fills
    calls["launch"] = calls["fill"] = 0
    torch.empty, torch.zeros, torch.Tensor.zero_ = poisoned_empty, counted_zeros, counted_zero_
    try:
        out = fn(*args, **kw)
    finally:
        torch.empty, torch.zeros, torch.Tensor.zero_ = plain_empty, plain_zeros, plain_zero_
    assert calls["fill"] == fills, ("torch fills", calls["fill"])
    return out, calls["launch"]

def same(a, b, where):
    assert a.dtype == b.dtype and a.shape == b.shape, (where, a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(a, b), where
"""

MAP_SCRIPT = (
    COMMON
    + """
torch.manual_seed(0)
cases = [(37, 7, 2, (3,)), (1, 1, 1, ()), (29, 33, 5, (0, 32)), (203, 5, 3, (4,)), (0, 7, 2, ())]
for n, e, k, empty in cases:
    routing_map = routing(n, e, k, empty)[0]
    want_map, want_counts = km.mask_row_id_map_reference(routing_map)
    for rm in (routing_map, routing_map.int().t().contiguous().t()):
        runs = {
            "one launch": (dict(one_launch_tile=64), 1),  # several blocks of 64 elements
            "one launch, one block": ({}, 1),
            "three launches": (dict(tile=64, one_launch_max=0), 3),
        }
        for name, (kw, count) in runs.items():
            # zero tokens: no launch, the counts zeroed by torch
            (m, c), n_launches = launches(km._mask_map_triton, rm, fills=int(n == 0), **kw)
            where = (n, e, name)
            same(m, want_map, where)
            same(c, want_counts, where)
            assert n_launches == (count if n else 0), (where, n_launches)
    # Per-block expert counts read back from the map (unpermute's padded backward)
    ws, n_launches = launches(km.mask_map_block_counts, want_map, 64)
    same(ws, km.mask_map_block_counts_reference(want_map, 64), (n, e, "block counts"))
    assert n_launches == (1 if n else 0) and torch.equal(ws.sum(0), want_counts[:e])
# The threshold: a map of N * BLOCK_E elements above ONE_LAUNCH_MAX takes three launches.
routing_map = routing(40, 7, 2, ())[0]
_, n_launches = launches(km._mask_map_triton, routing_map, one_launch_max=40 * 16 - 1)
assert n_launches == 3
_, n_launches = launches(km._mask_map_triton, routing_map, one_launch_max=40 * 16)
assert n_launches == 1
print("ok")
"""
)

ROWS_SCRIPT = (
    COMMON
    + """
from tolerances import assert_close

torch.manual_seed(0)
n, e, k, h, align = 23, 6, 2, 19, 4
routing_map = routing(n, e, k, (2,))[0]  # expert 2 gets no token
m, c = km.mask_row_id_map_reference(routing_map)
counts = c[:e].long()
total = int(c[-1])
target = (counts + align - 1) // align * align
pads = target - counts
pad = torch.cumsum(pads, 0) - pads  # moe_permute_and_pad_with_probs's offsets
padded = int(target.sum())
spare = n * k + e * (align - 1)  # MoELayer's device path: room for any routing
# Expert blocks shuffled, with gaps: non-decreasing offsets no more (the generic zeroing).
order, starts, row = [4, 0, 5, 2, 3, 1], [0] * e, 3
for x in order:
    starts[x], row = row, row + int(counts[x]) + 2
shuffled = torch.tensor(starts) - (torch.cumsum(counts, 0) - counts)
probs = routed_probs(routing_map)
probs[7, routing_map[7].nonzero()[0, 0]] = 0.0  # a padding route: a zero row

def model_rows(pd, num_out):
    # rows an expert's block covers (no route drops here)
    first = torch.cumsum(counts, 0) - counts
    data = torch.zeros(num_out, dtype=torch.bool)
    for x in range(e):
        lo = int(first[x] + pd[x])
        data[max(lo, 0) : max(min(lo + int(counts[x]), num_out), 0)] = True
    return data

permute_cases = [  # (pad offsets, row counts given, rows, launches)
    (pad, c, padded, 1), (pad, c, spare, 1), (pad, c, padded - 5, 1), (pad, None, spare, 2),
    (shuffled, c, row + 4, 1), (shuffled, None, row - 6, 2), (None, c, total + 5, 1),
    (None, c[-1:], total, 1), (None, None, total + 3, 1), (None, c, total - 4, 1),
]
for dtype in (torch.float32, torch.bfloat16, torch.uint8):
    x = (torch.randn(n, h) * 4).to(dtype)
    for i, (pd, rc, n_out, count) in enumerate(permute_cases):
        if dtype != torch.float32 and i not in (1, 3, 4):
            continue
        where = (dtype, i)
        (out, pp), n_launches = launches(kp._permute_triton, x, m, probs, pd, rc, n_out, 0, 8, 3)
        out_ref, pp_ref = kp.permute_rows_reference(x, m, probs, pd, rc, n_out, 0)
        same(out, out_ref, where)
        same(pp, pp_ref, where)
        assert n_launches == count, (where, n_launches)
        if pd is not None:  # zeros exactly where no expert's block is
            data = model_rows(pd, n_out)
            assert not out[~data].any() and not pp[~data].any(), where
            assert int(pp[data].ne(0).sum()) >= int(data.sum()) - 1, where  # one zero prob
        # Unpermute's backward without merging probs: the same kernel, counts read back.
        if dtype != torch.uint8:
            (back, _), n_launches = launches(kp._permute_triton, x, m, None, pd, None, n_out, 0)
            same(back, kp.permute_rows_reference(x, m, None, pd, None, n_out, 0)[0], where)
            assert n_launches == (2 if pd is not None else 1), (where, n_launches)
# Unpermute's backward with merging probs, padded: dx zero in the free rows, dp close.
for pd, n_out in ((pad, spare), (shuffled, row + 1), (None, total + 2)):
    g = torch.randn(n, h)
    fwd = torch.randn(n_out, h)
    (dx, dp), n_launches = launches(kp._unpermute_bwd_triton, g, m, fwd, probs, pd, None, 0, 8, 3)
    ref = kp.unpermute_rows_backward_reference(g, m, fwd, probs, pd, None, 0)
    same(dx, ref[0], ("bwd", n_out))
    assert_close(dp, ref[1], torch.float32)
    assert n_launches == (2 if pd is not None else 1)
# Zero tokens: every row is free.
x0, m0 = torch.zeros(0, h), km.mask_row_id_map_reference(routing_map[:0])[0]
for pd, rc in ((pad, None), (None, None), (pad, torch.zeros(e + 1, dtype=torch.int32))):
    (out, pp), _ = launches(kp._permute_triton, x0, m0, probs[:0], pd, rc, 9, 0, 8, 3)
    same(out, torch.zeros(9, h), "zero tokens")
    same(pp, torch.zeros(9), "zero tokens, probs")

# Routes in several tiles: K = 5 (permute tiles of 2, unpermute unrolled 4 at a time, backward
# tiles of 4) and a row split over programs (spans of one chunk of 8 columns).
routing_map = routing(n, 9, 5, (1,))[0]
m, c = km.mask_row_id_map_reference(routing_map)
total = int(c[-1])
x = torch.randn(n, h)
probs = routed_probs(routing_map)
kp.TUNING.permute_block_r, kp.TUNING.permute_span_blocks = 2, 1
(out, pp), _ = launches(kp._permute_triton, x, m, probs, None, c, total + 3, 0, 8, 3)
out_ref, pp_ref = kp.permute_rows_reference(x, m, probs, None, c, total + 3, 0)
same(out, out_ref, "tiles of 2, spans")
same(pp, pp_ref, "tiles of 2, spans: probs")
for mp, ppr in ((probs, pp), (None, None)):
    (y, up), n_launches = launches(kp._unpermute_triton, out, m, mp, ppr, None, 0, 8)
    y_ref, up_ref = kp.unpermute_rows_reference(out, m, mp, ppr, None, 0)
    same(y, y_ref, "unpermute, routes unrolled")  # fp32 sums in route order: bit-exact
    if ppr is not None:
        same(up, up_ref, "unpermute probs")
    assert n_launches == 1
g = torch.randn(n, h)
(dx, dp), _ = launches(kp._unpermute_bwd_triton, g, m, out, probs, None, c, 0, 8, 3)
ref = kp.unpermute_rows_backward_reference(g, m, out, probs, None, c, 0)
same(dx, ref[0], "bwd tiles")
assert_close(dp, ref[1], torch.float32)
print("ok")
"""
)


@requires_interpreter
def test_one_launch_mask_map_equals_reference_and_three_launches():
    run_under_interpreter(MAP_SCRIPT)


@requires_interpreter
def test_unwritten_rows_are_zeroed_in_the_permute_kernel():
    run_under_interpreter(ROWS_SCRIPT)


def test_unused_permute_outputs_still_get_zero_gradients():
    """Autograd no longer fills the map's gradient: an unused output still counts as zeros."""
    routing_map = torch.rand(11, 5) > 0.5
    x = torch.randn(11, 7, requires_grad=True)
    probs = (torch.rand(11, 5) * routing_map).requires_grad_()
    out, permuted_probs, _ = moe_permute_with_probs(x, probs, routing_map)
    permuted_probs.sum().backward(retain_graph=True)
    assert torch.equal(x.grad, torch.zeros_like(x))
    assert torch.equal(probs.grad, routing_map.float())
    x.grad = probs.grad = None
    out.sum().backward()
    assert torch.equal(x.grad, routing_map.sum(1, keepdim=True).float().expand(11, 7))
    assert torch.equal(probs.grad, torch.zeros_like(probs))
    y, row_id_map = moe_permute(x, torch.randint(0, 5, (11, 2)), map_type="index")
    assert row_id_map.requires_grad is False and y.shape == (22, 7)


# ----------------------------------------------------------------------------------------------
# GPU: the CPU's bytes under a poisoned allocator, and the device operations per call
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty filled with NaN (floats) or 0x5A bytes, so that unwritten rows show."""
    plain = torch.empty

    def empty(*args, **kw):
        t = plain(*args, **kw)
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(0x5A)
        return t

    monkeypatch.setattr(torch, "empty", empty)


def _layer_case(device, tokens=301, experts=13, topk=3, hidden=1000):
    torch.manual_seed(0)
    scores = torch.rand(tokens, experts)
    scores[:, 5] = -1.0  # an expert with no token
    index = scores.topk(topk, dim=1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, index, True)
    probs = torch.rand(tokens, experts) * routing_map
    x = torch.randn(tokens, hidden).bfloat16()
    counts = routing_map.sum(0)
    target = (counts + 15) // 16 * 16
    pad = torch.cumsum(target - counts, 0) - (target - counts)
    return [t.to(device) for t in (routing_map, probs, x, pad)]


@pytest.mark.gpu
def test_cuda_padded_permute_gives_the_cpus_bytes(poisoned_empty):
    """MoELayer's device path (spare rows at the end) and unpermute's padded backward."""

    def run(device):
        routing_map, probs, x, pad = _layer_case(device)
        rows = x.shape[0] * 3 + 13 * 15
        x = x.requires_grad_()
        out, row_id_map, out_probs = MaskPermute.apply(
            x, routing_map, probs, pad, Plan(num_out_tokens=rows)
        )
        y = out.detach().float().mul(0.5).bfloat16().requires_grad_()
        back = moe_unpermute(y, row_id_map, None, None, "mask", None, pad)
        (grad_y,) = torch.autograd.grad(back, y, torch.ones_like(back))
        merged = moe_unpermute(y, row_id_map, probs, pad_offsets=pad)
        grad_m = torch.autograd.grad(merged, y, torch.ones_like(merged))[0]
        return [out, out_probs, row_id_map, back, grad_y, merged, grad_m]

    for i, (a, b) in enumerate(zip(run("cpu"), run("cuda"), strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b.cpu()), i


def _ops_per_call(tokens: int, experts: int) -> dict[str, int]:
    topk, hidden = 2, 256
    scores = torch.rand(tokens, experts, device="cuda")
    index = scores.topk(topk, dim=1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool, device="cuda")
    routing_map.scatter_(1, index, True)
    probs = torch.rand(tokens, experts, device="cuda") * routing_map
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    x_g, probs_g = x.clone().requires_grad_(), probs.clone().requires_grad_()
    routed = tokens * topk
    out, row_id_map = moe_permute(x_g, routing_map, routed)
    out_p, perm_probs, _ = moe_permute_with_probs(x_g, probs_g, routing_map, routed)
    y_g = out.detach().clone().requires_grad_()
    un, un_p = moe_unpermute(y_g, row_id_map), moe_unpermute(y_g, row_id_map, probs_g)
    pad = torch.arange(experts, device="cuda") * 3
    rows = routed + 3 * experts
    out_pad = MaskPermute.apply(x_g, routing_map, probs, pad, Plan(num_out_tokens=rows))[0]
    y_pad = out_pad.detach().clone().requires_grad_()
    un_pad = moe_unpermute(y_pad, row_id_map, None, None, "mask", None, pad)

    def grad(outputs, inputs):
        grads = [torch.ones_like(o) for o in outputs]
        return lambda: torch.autograd.grad(outputs, inputs, grads, retain_graph=True)

    calls = {
        "mask map": lambda: mask_row_id_map(routing_map),
        "permute fwd": lambda: moe_permute(x, routing_map, routed),
        "permute bwd": grad((out,), (x_g,)),
        "permute_with_probs fwd": lambda: moe_permute_with_probs(x, probs, routing_map, routed),
        "permute_with_probs bwd": grad((out_p, perm_probs), (x_g, probs_g)),
        "unpermute fwd": lambda: moe_unpermute(y_g.detach(), row_id_map),
        "unpermute bwd": grad((un,), (y_g,)),
        "unpermute+probs bwd": grad((un_p,), (y_g, probs_g)),
        "padded permute fwd": lambda: MaskPermute.apply(
            x, routing_map, probs, pad, Plan(num_out_tokens=rows)
        ),
        "padded unpermute bwd": grad((un_pad,), (y_pad,)),
    }
    ops = {}
    for name, fn in calls.items():
        fn()  # compiles
        ops[name] = count_device_ops(fn)
    return ops


@pytest.mark.gpu
@pytest.mark.parametrize(("tokens", "experts", "map_launches"), [(301, 13, 1), (4096, 64, 3)])
def test_cuda_device_ops_per_call(tokens, experts, map_launches):
    """One kernel per call besides the map (one launch while N * pow2(E) <= 64K, else three);
    the padded unpermute's backward reads the counts per expert back (one more); no fills."""
    ops = _ops_per_call(tokens, experts)
    want = {
        "mask map": map_launches,
        "permute fwd": map_launches + 1,
        "permute bwd": 1,
        "permute_with_probs fwd": map_launches + 1,
        "permute_with_probs bwd": 1,
        "unpermute fwd": 1,
        "unpermute bwd": 1,
        "unpermute+probs bwd": 1,
        "padded permute fwd": map_launches + 1,
        "padded unpermute bwd": 2,
    }
    assert ops == want, ops


@pytest.mark.gpu
@pytest.mark.parametrize(("tokens", "experts"), [(4096, 8), (4097, 8), (1000, 64), (301, 13)])
def test_cuda_mask_map_one_launch_and_three_equal_the_reference(tokens, experts, poisoned_empty):
    """Either side of the one-launch threshold (N * pow2(E) <= 64K: 4096 x 8 and 1000 x 64 take
    one launch, 4097 x 8 three), and each path forced."""
    from torchte.kernels import permutation_maps as km

    scores = torch.rand(tokens, experts)
    scores[:, 1] = -1.0  # an expert with no token
    index = scores.topk(min(4, experts - 1), dim=1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, index, True)
    want = km.mask_row_id_map_reference(routing_map)
    on_gpu = routing_map.cuda()
    for kw in ({}, {"one_launch_max": 0}, {"one_launch_max": 1 << 30}):
        got = km._mask_map_triton(on_gpu, **kw)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype and torch.equal(a.cpu(), b), kw


@pytest.mark.gpu
def test_cuda_permute_and_pad_gives_the_cpus_bytes(poisoned_empty):
    def run(device):
        routing_map, probs, x, _ = _layer_case(device, tokens=97, experts=7, topk=2, hidden=264)
        counts = routing_map.sum(0).cpu()
        return list(moe_permute_and_pad_with_probs(x, probs, routing_map, counts, 16))

    for i, (a, b) in enumerate(zip(run("cpu"), run("cuda"), strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b.cpu()), i
